//! Datasets whose files are objects in object storage (`--dataset NAME=s3://bucket/prefix`).
//!
//! A [`RemoteDataset`] answers a FETCH with the shard's verified bytes: from the memory of a
//! prefetch, from its disk cache (served with `sendfile` like a local file), or by reading it
//! now ([`read`]). The nodes' hints ([`hints`]) say what comes next: a prefetch task reads
//! those shards ahead, in hint order, within a memory budget and the bucket's window, and the
//! cache ([`cache`]) keeps what is needed soonest. Only bytes whose CRC-32C matched the
//! manifest are kept, cached or sent.
//!
//! A shard the cache admits is written to it in the background ([`RemoteDataset::place`]):
//! its FETCHes are answered from memory meanwhile, so none waits for the cache's disk, and
//! the write has no `fsync` (an entry kept over a restart is length-checked at open and
//! CRC-checked on its first serve, which catches what a crash left torn). The bytes being
//! written count in the read-ahead's memory budget, and a shard that arrives while the
//! writes are behind by more than [`RemoteDataset::write_budget`] passes through uncached. At
//! most [`CACHE_WRITERS`] writes of a dataset run at once (each on a blocking thread): small
//! shards, many of them within that budget, do not take the runtime's blocking threads from
//! the checks of local shard files and the other datasets. A FETCH of a cached shard opens,
//! measures and (after a restart or a node's report) CRC-checks its entry's file on blocking
//! threads within a time limit, a few per file system ([`disk`]): a cache disk that stops
//! answering makes its FETCHes read the store, and holds none of the runtime's threads.

pub mod cache;
mod disk;
pub mod hints;
mod open;
mod prefetch;
pub mod read;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use shardwire_protocol::Manifest;
use shardwire_store::{Store, StoreUrl, Urgency};
use tokio::sync::{Notify, Semaphore, watch};

use self::cache::{DiskCache, Reservation};
use self::hints::Hints;
pub use self::open::{OpenError, RemoteOptions};
use self::read::{Failure, Object, Want, read_shards};
use crate::sender::Body;

/// Cache writes of one dataset that run at once ([`RemoteDataset::place`]); the others wait
/// their turn, their bytes counted in [`RemoteDataset::write_budget`].
const CACHE_WRITERS: usize = 2;

/// What a FETCH found in its dataset's cache ([`RemoteDataset::cached`], in `disk.rs`; here so
/// that this module names nothing of that one, which builds on it).
pub(super) enum Cached {
    /// The entry's file, checked: serve it.
    Hit(Body),
    /// Nothing to serve: no entry, or one whose file is gone, cannot be opened, is cut short
    /// or failed its CRC check (those last two deleted).
    Miss,
    /// An operation on the entry's file (its open, its CRC read, or the unlink of one that
    /// failed) did not return in time, or could not start: an entry not opened or not
    /// checked stays, and this FETCH reads the shard from the store without looking in the
    /// cache again (before, it looked it up, opened and checked it once more, waiting out a
    /// second limit, and that was counted and logged again): one count per FETCH at most.
    GaveUp,
}

/// The outcome of one load, for whoever waits on it.
type Outcome = Option<Result<(), Failure>>;

/// A read registered by [`RemoteDataset::begin`], run by [`RemoteDataset::load`].
struct Reading {
    wants: Vec<Want>,
    senders: Vec<watch::Sender<Outcome>>,
    bytes: u64,
    prefetch: bool,
    /// Its GETs' place in the bucket's window: urgent for a FETCH's read; for a read ahead,
    /// raised when a FETCH comes to wait for it.
    urgency: Urgency,
}

/// A shard being read ([`State::loading`]).
struct Loading {
    /// Its outcome, when it comes.
    outcome: watch::Receiver<Outcome>,
    /// Its read's urgency (raised by a FETCH that waits for it).
    urgency: Urgency,
}

/// What a dataset holds outside the store, under one lock.
#[derive(Default)]
struct State {
    hints: Hints,
    /// Verified shards in memory (prefetched, or not admitted to the cache), not yet sent.
    ready: HashMap<u32, Vec<Bytes>>,
    ready_bytes: u64,
    /// Verified shards being written to the cache in the background ([`RemoteDataset::place`]),
    /// their bytes shared with the write: FETCHes take them from here until the write ends.
    writing: HashMap<u32, Vec<Bytes>>,
    /// Bytes of the cache writes under way or waiting for a writer: those of `writing`, and
    /// those of a shard a node reported corrupt while it was written (no longer served from
    /// here, but its write still holds them: [`RemoteDataset::corrupt_reported`]).
    writing_bytes: u64,
    /// Shards being read, with where their outcome goes.
    loading: HashMap<u32, Loading>,
    /// Bytes the prefetch task is reading.
    prefetching: u64,
    /// Shards in memory that no hint names and no FETCH under way wants, noted as they became
    /// so (a hint changed, a FETCH ended, a shard was put in memory:
    /// [`State::maybe_droppable`]): what [`RemoteDataset::drop_unhinted`] looks at, instead of
    /// every shard in memory at every wake. One may have been hinted, wanted or taken since:
    /// it is looked at again before it is dropped.
    droppable: HashSet<u32>,
    /// Shards not to be read ahead again yet: their last read failed.
    backoff: prefetch::Backoff,
    /// Where the prefetch task's last look at the hints stopped (`prefetch::SCAN`).
    scan_at: Option<hints::Place>,
    /// FETCHes under way per shard: a shard read for one is not dropped from memory as
    /// unhinted (its hint was consumed when the FETCH came) before the FETCH takes it, nor
    /// taken out of memory by one FETCH while others that are reading it wait for the same
    /// bytes.
    wanted: HashMap<u32, Wanting>,
}

/// One dataset served from object storage.
pub struct RemoteDataset {
    name: String,
    store: Store,
    objects: Vec<Object>,
    /// Per shard: (object index, range, CRC-32C).
    shards: Vec<Want>,
    cache: Option<Mutex<DiskCache>>,
    /// How its cache's disk operations on a FETCH (open, `fstat`, CRC read, unlink) are
    /// bounded: on blocking threads, within a time limit, a few per file system.
    disk: disk::CacheDisk,
    state: Mutex<State>,
    /// Bytes prefetched shards may hold in memory.
    budget: u64,
    /// Wakes the prefetch task (a hint changed, a read ended, a shard was sent, a cache write
    /// ended).
    wake: Notify,
    /// Its cache writes that may run ([`CACHE_WRITERS`]).
    writers: Arc<Semaphore>,
    /// Holds the background cache writes back while a test says so.
    #[cfg(test)]
    write_gate: tests::WriteGate,
}

/// How a FETCH was answered (for counters and the log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// From a prefetch, in memory.
    Prefetched,
    /// From the disk cache (or, while it is written there, from its bytes in memory).
    Cached,
    /// Read from the store for this FETCH (or while another FETCH was reading it).
    Read,
}

impl RemoteDataset {
    /// Opens dataset `name` at `url`: reads its manifest, checks its objects, opens its cache;
    /// returns it with the manifest and the manifest file's bytes.
    pub async fn open(
        name: &str,
        url: &StoreUrl,
        opts: &RemoteOptions,
    ) -> Result<(Arc<Self>, Manifest, Vec<u8>), OpenError> {
        let o = open::open(name, url, opts).await?;
        let budget = 2 * opts.request_size * opts.max_inflight as u64;
        tracing::info!(dataset = %name, %url, shards = o.shards.len(), objects = o.objects.len(),
            bytes = o.manifest.total_bytes, cache = ?opts.cache_dir, memory_budget = budget,
            "serving dataset from object storage");
        let d = Arc::new(RemoteDataset {
            name: name.into(),
            store: o.store,
            objects: o.objects,
            shards: o.shards,
            cache: o.cache.map(Mutex::new),
            disk: disk::CacheDisk::shared(),
            state: Mutex::new(State::default()),
            budget,
            wake: Notify::new(),
            writers: Arc::new(Semaphore::new(CACHE_WRITERS)),
            #[cfg(test)]
            write_gate: Default::default(),
        });
        Ok((d, o.manifest, o.json))
    }

    /// The dataset's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Bytes of shards read ahead it may hold in memory; also what one node session's
    /// FETCHes may have read, or be reading, and not yet sent (`session.rs`).
    pub(crate) fn memory_budget(&self) -> u64 {
        self.budget
    }

    /// Bytes the background cache writes may hold in memory ([`Self::place`]): the in-flight
    /// cap (`max_inflight x request_size`, half the memory budget), or one shard if larger. A
    /// shard that would pass it is not cached this time (read again when next asked for): a
    /// cache disk slower than the store fills at its own pace, and the source serves at the
    /// store's instead of waiting for the disk.
    fn write_budget(&self) -> u64 {
        self.budget / 2
    }

    /// Replaces stream `(session, stream)`'s hint; wakes the prefetch task.
    pub fn hint(&self, session: u64, stream: u64, shards: Vec<u32>) {
        let n = self.shards.len() as u32;
        let shards: Vec<u32> = shards.into_iter().filter(|&s| s < n).collect();
        let mut st = self.state();
        let set = st.hints.set((session, stream), shards);
        st.hints_changed();
        drop(st);
        if let Err(streams) = set {
            tracing::warn!(
                dataset = %self.name,
                session,
                stream,
                streams,
                "hint refused: this node session already hints for {streams} streams \
                 (MAX_HINTED_STREAMS); the stream is served without prefetch (said once per \
                 stream)"
            );
            return;
        }
        self.wake.notify_one();
    }

    /// Node session `session` ended: its hints go.
    pub fn forget_session(&self, session: u64) {
        let mut st = self.state();
        st.hints.forget_session(session);
        st.hints_changed();
        drop(st);
        self.wake.notify_one();
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("poisoned")
    }

    /// A FETCH of `shard` (in range: the session checked it) by node session `session`, from
    /// its arrival: the node's hints count it as consumed, and the shard counts as wanted
    /// until the FETCH ends, so bytes read ahead for it stay in memory while it waits in its
    /// session's queue (no hint names a shard its node has already asked for), unless a FETCH
    /// out of its queue takes them first ([`Self::take_ready`]).
    pub(crate) fn want(self: &Arc<Self>, session: u64, shard: u32) -> Wanted {
        let mut st = self.state();
        // Wanted first: the shard's own hint entry goes, and it is not droppable meanwhile.
        st.wanted.entry(shard).or_default().fetches += 1;
        st.hints.consumed_by_session(session, shard);
        st.hints_changed();
        Wanted {
            dataset: Arc::clone(self),
            shard,
            reading: false,
            took: false,
        }
    }

    /// Where `shard` is held, if it is: in memory (read, or being written to the cache in the
    /// background, [`Self::place`]: a FETCH takes its bytes from memory then; looked at
    /// first), or in the cache (committed). A FETCH of it starts no new read from the store,
    /// so its session need not hold it back behind older reads or the source-wide read budget
    /// (`session.rs`); what it holds in memory once taken depends on where it is.
    pub(crate) fn held_in(&self, shard: u32) -> Option<HeldIn> {
        let st = self.state();
        if st.ready.contains_key(&shard) || st.writing.contains_key(&shard) {
            return Some(HeldIn::Memory);
        }
        drop(st);
        let cached = self.cache.as_ref();
        let cached = cached.is_some_and(|c| c.lock().expect("poisoned").holds(shard));
        cached.then_some(HeldIn::Cache)
    }

    /// Node session `session` reported that the bytes of `shard` it was sent failed its CRC
    /// check (wire `Error{req, ChecksumMismatch}`, protocol version 5, which every node this
    /// source serves speaks), and fetches them from another source: the shard's cache entry
    /// is checked against its CRC before it is served again (deleted if it fails), and a copy
    /// in memory goes, so the next FETCH reads it anew instead of sending the same bytes
    /// again. A FETCH asked again without a report is served as it comes: a node asks again
    /// for other reasons (two streams of one node reading one shard), and a CRC read of the
    /// entry at each was the cost.
    pub(crate) fn corrupt_reported(&self, session: u64, shard: u32) {
        let (dropped, still_written) = self.drop_from_memory(shard);
        if dropped + still_written > 0 {
            self.wake.notify_one();
        }
        let cached = self.cache.as_ref().is_some_and(|c| {
            let mut c = c.lock().expect("poisoned");
            c.recheck(shard);
            c.holds(shard)
        });
        tracing::warn!(dataset = %self.name, session, shard, cached, dropped_from_memory = dropped,
            still_written, "a node reported that a shard's bytes failed its CRC check; its cache \
             entry is checked against its CRC before it is served again, its copy in memory \
             dropped (a copy being written to the cache is no longer served; its write holds \
             its bytes until it ends)");
    }

    /// Takes `shard` out of memory, where a node reported its bytes corrupt: the bytes
    /// dropped (read, not sent yet), and those of a copy being written to the cache, no
    /// longer served from memory but still held by their write (which checks its entry once
    /// written: [`Self::written`]). The latter stay counted in `writing_bytes` until then
    /// (before, they left the count at once, and a node that reported every payload let
    /// each shard's write in past `write_budget`), and are not logged as dropped (before,
    /// they were). A report costs one CRC read of one entry at most.
    fn drop_from_memory(&self, shard: u32) -> (u64, u64) {
        let mut st = self.state();
        let parts = st.ready.remove(&shard).unwrap_or_default();
        let dropped: u64 = parts.iter().map(|p| p.len() as u64).sum();
        st.ready_bytes -= dropped;
        let parts = st.writing.remove(&shard).unwrap_or_default();
        (dropped, parts.iter().map(|p| p.len() as u64).sum())
    }

    /// The verified bytes of the shard FETCH `wanted` (of this dataset: [`Wanted::get`])
    /// names, for node session `session`.
    async fn get(
        self: &Arc<Self>,
        session: u64,
        wanted: &mut Wanted,
    ) -> Result<(Body, Served), Failure> {
        let shard = wanted.shard;
        wanted.leave_queue(); // where its session did not already
        let (mut waited, mut gave_up) = (false, false);
        loop {
            if let Some((parts, writing)) = self.take_ready(wanted) {
                let how = match (waited, writing) {
                    (true, _) => Served::Read,
                    (false, true) => Served::Cached,
                    (false, false) => Served::Prefetched,
                };
                return Ok((Body::Memory(parts), how));
            }
            // Once an operation on its entry's file was given up (the cache disk did not
            // answer in time, or the source is busy), this FETCH does not look in the cache
            // again: it reads the store (before, it looked the entry up, opened and checked it
            // once more, waiting out a second limit, counted and logged again).
            if !gave_up {
                match self.cached(shard).await {
                    Cached::Hit(body) => {
                        let how = if waited { Served::Read } else { Served::Cached };
                        return Ok((body, how));
                    }
                    Cached::GaveUp => gave_up = true,
                    Cached::Miss => {}
                }
            }
            if waited {
                // Read, then taken by another FETCH of the same shard, or not admitted and
                // evicted: read it again.
                tracing::debug!(dataset = %self.name, session, shard, "the shard went before this FETCH took it");
            }
            // A cache entry committed since `cached` looked is taken on the next turn (once:
            // an entry that cannot be opened is read from the store instead).
            let look_in_cache = !waited && !gave_up;
            waited = true;
            match self.claim(shard, look_in_cache) {
                Claim::Wait(rx) => wait(rx).await?,
                Claim::Read(reading) => self.load(reading).await?,
                Claim::Again => {}
            }
        }
    }

    /// Under one lock: whether `shard` is being read (wait for it), landed in memory (or,
    /// with `look_in_cache`, in the cache) since this FETCH looked (take it), or is to be
    /// read by this FETCH (registered here, so neither the prefetch task nor another FETCH
    /// starts a second read of it).
    fn claim(&self, shard: u32, look_in_cache: bool) -> Claim {
        let mut st = self.state();
        if let Some(l) = st.loading.get(&shard) {
            // A read ahead a FETCH now waits for: its GETs still waiting for a slot in the
            // bucket's window go before the other reads ahead from now on.
            self.store.raise(&l.urgency);
            return Claim::Wait(l.outcome.clone());
        }
        // Locks in the order `place` and `next_group` take them: state, then cache.
        let cached = || {
            let c = self.cache.as_ref();
            c.is_some_and(|c| c.lock().expect("poisoned").holds(shard))
        };
        let in_memory = st.ready.contains_key(&shard) || st.writing.contains_key(&shard);
        if in_memory || (look_in_cache && cached()) {
            return Claim::Again;
        }
        Claim::Read(self.begin(&mut st, vec![shard], false))
    }

    /// A shard in memory (prefetched, or read for a FETCH), for the FETCH `w`: shared while
    /// other FETCHes of it are reading it and have not taken it (they waited on the same
    /// read), taken out of memory by the last of them. FETCHes still queued in their sessions
    /// do not keep it: a slow node's queue would hold shards in memory past any budget (and
    /// stop the read ahead); a queued FETCH reads its shard again when its turn comes. A shard
    /// being written to the cache is shared with its write, which drops it from memory once
    /// done ([`Self::written`]); true with those.
    fn take_ready(&self, w: &mut Wanted) -> Option<(Vec<Bytes>, bool)> {
        let mut st = self.state();
        let wanting = st.wanted.get(&w.shard).copied().unwrap_or_default();
        let others = wanting.reading.saturating_sub(wanting.took + 1);
        let taken = if !st.ready.contains_key(&w.shard) {
            (st.writing.get(&w.shard)?.clone(), true)
        } else if others > 0 {
            (st.ready.get(&w.shard)?.clone(), false)
        } else {
            let parts = st.ready.remove(&w.shard)?;
            st.ready_bytes -= parts.iter().map(|p| p.len() as u64).sum::<u64>();
            self.wake.notify_one();
            (parts, false)
        };
        if let Some(n) = st.wanted.get_mut(&w.shard) {
            n.took += 1;
            w.took = true;
        }
        Some(taken)
    }

    /// Registers a read of `shards` (none of them being read: the caller checked under the
    /// same lock, `st`), so nobody starts another, before it runs.
    fn begin(&self, st: &mut State, shards: Vec<u32>, prefetch: bool) -> Reading {
        let wants: Vec<Want> = shards
            .iter()
            .map(|&s| self.shards[s as usize].clone())
            .collect();
        let bytes: u64 = wants.iter().map(|w| w.range.end - w.range.start).sum();
        let mut senders = Vec::with_capacity(shards.len());
        let urgency = Urgency::new(!prefetch);
        for &s in &shards {
            debug_assert!(!st.loading.contains_key(&s), "shard {s} registered twice");
            let (tx, outcome) = watch::channel(None);
            let urgency = urgency.clone();
            st.loading.insert(s, Loading { outcome, urgency });
            senders.push(tx);
        }
        if prefetch {
            st.prefetching += bytes;
        }
        Reading {
            wants,
            senders,
            bytes,
            prefetch,
            urgency,
        }
    }

    /// Runs a registered read (adjacent shards merged) and places each verified shard in the
    /// cache or in memory; the first shard's outcome is returned, every shard's goes to its
    /// waiters.
    async fn load(self: &Arc<Self>, r: Reading) -> Result<(), Failure> {
        let Reading {
            wants,
            senders,
            bytes,
            prefetch,
            urgency,
        } = r;
        let registered = Registered {
            dataset: Arc::clone(self),
            pending: wants.iter().map(|w| w.shard).zip(senders).collect(),
            prefetching: if prefetch { bytes } else { 0 },
        };
        // A FETCH's read, or one a FETCH comes to wait for, goes before the reads ahead.
        let store = self.store.with_urgency(urgency);
        let reads = read_shards(&store, &self.objects, &wants).await;
        // The bytes are here. Placing them and telling their waiters awaits nothing (a cache
        // write goes on in the background), so a load dropped from now on (its FETCH
        // cancelled: the node went away) cannot stop half way: no cache write is cut short,
        // and no other FETCH waiting on this read is left to read the shard again.
        self.settle(reads, prefetch, registered)
    }

    /// Places each shard read (or logs its failure), hands every outcome to its waiters and
    /// returns the first.
    fn settle(
        self: &Arc<Self>,
        reads: Vec<read::Read>,
        prefetch: bool,
        mut registered: Registered,
    ) -> Result<(), Failure> {
        let mut first = None;
        for (shard, got) in reads {
            let outcome = match got {
                Ok(parts) => {
                    self.state().backoff.succeeded(shard);
                    metrics::counter!("shardwire_source_store_shard_bytes_total")
                        .increment(parts.iter().map(|p| p.len() as u64).sum());
                    // Its cache write, if any, goes on without this read (or its FETCH).
                    drop(self.place(shard, parts));
                    Ok(())
                }
                Err(f) => {
                    let pause = self.state().backoff.failed(shard, &f, Instant::now());
                    tracing::warn!(dataset = %self.name, shard, code = ?f.code, failure = %f.message, prefetch,
                        read_ahead_again_in = ?pause, "reading a shard from the store failed");
                    Err(f)
                }
            };
            first.get_or_insert_with(|| outcome.clone());
            registered.settle(shard, outcome);
        }
        drop(registered);
        first.expect("at least one shard")
    }

    /// Stores a verified shard in memory, and has it written to the cache if that admits it
    /// ([`Self::reserve`]): written on a blocking thread ([`Self::write_entry`]) once one of
    /// the dataset's [`CACHE_WRITERS`] is free, its bytes held in [`State::writing`]
    /// meanwhile, so its waiters are answered now, from memory, not once the cache's disk has
    /// it. Returns that write (which nobody need wait for: a test does).
    fn place(
        self: &Arc<Self>,
        shard: u32,
        parts: Vec<Bytes>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let mut st = self.state();
        // Reserved and listed under one hold of the state's lock: no FETCH and no read ahead
        // finds the shard neither in memory nor in the cache, and reads it again.
        if let Some(r) = self.reserve(&st, shard, len) {
            // Counted per write: each write takes its own bytes out ([`Self::written`]).
            st.writing_bytes += len;
            st.writing.insert(shard, parts.clone());
            drop(st);
            let (me, writers) = (Arc::clone(self), Arc::clone(&self.writers));
            return Some(tokio::spawn(async move {
                let writer = writers.acquire_owned().await.expect("never closed");
                let write = tokio::task::spawn_blocking(move || {
                    me.write_entry(r, parts);
                    drop(writer);
                });
                if let Err(e) = write.await
                    && e.is_panic()
                {
                    std::panic::resume_unwind(e.into_panic());
                }
            }));
        }
        st.ready_bytes += len;
        if let Some(old) = st.ready.insert(shard, parts) {
            // Not expected (one read per shard at a time), but the count stays true.
            st.ready_bytes -= old.iter().map(|p| p.len() as u64).sum::<u64>();
        }
        st.maybe_droppable(shard); // read ahead for a hint withdrawn meanwhile
        None
    }

    /// Room in the cache for `shard` (`len` bytes), unless there is no cache, it does not
    /// admit the shard, or the bytes being written would pass [`Self::write_budget`] (unless
    /// none are: a shard larger than it is written alone). `st`: the state, locked (the cache
    /// is locked after it, as everywhere; neither lock is held across a disk operation: the
    /// evicted entries' files are deleted by the write, [`Self::write_entry`]).
    fn reserve(&self, st: &State, shard: u32, len: u64) -> Option<Reservation> {
        let cache = self.cache.as_ref()?;
        if st.writing_bytes > 0 && st.writing_bytes + len > self.write_budget() {
            metrics::counter!("shardwire_source_cache_writes_behind_total").increment(1);
            tracing::debug!(dataset = %self.name, shard, writing = st.writing_bytes,
                "the cache's writes are behind (its disk is slower than the store): not cached this time");
            return None;
        }
        let w = &self.shards[shard as usize];
        let o = &self.objects[w.object];
        let name = cache::entry_name(shard, &o.key, &o.etag, (w.range.start, len), w.crc32c);
        let mut c = cache.lock().expect("poisoned");
        let r = c.reserve(shard, name, len, |s| st.hints.next_use(s))?;
        metrics::counter!("shardwire_source_cache_evictions_total")
            .increment(r.evicted.len() as u64);
        Some(r)
    }

    /// Writes the reserved entry `r` of `parts` (on a blocking thread: [`Self::place`]): the
    /// entries it evicted are deleted, the file written (no `fsync`: see the module's head)
    /// and renamed into place, all outside the cache's lock (a stalled disk holds this thread
    /// only; before, the rename ran under the lock that every FETCH of the dataset takes),
    /// and then committed. A write or rename that fails is logged, its room given back and
    /// its file deleted: no partial entry stays (a crash leaves a `.partial` file, deleted at
    /// the next start). Then the bytes leave memory ([`Self::written`]).
    fn write_entry(&self, r: Reservation, parts: Vec<Bytes>) {
        #[cfg(test)]
        self.write_gate.pass();
        let (shard, len) = (r.shard, r.len);
        r.discard_evicted();
        let installed = match write_parts(&r.temp, &parts) {
            Ok(()) => r.install().map_err(|e| (e.to_string(), e.doomed)),
            Err(e) => Err((format!("{}: {e}", r.temp.display()), r.set_aside())),
        };
        let kept = installed.is_ok();
        let cache = self.cache.as_ref().expect("reserved in the cache");
        let mut c = cache.lock().expect("poisoned");
        if kept {
            c.commit(r);
        } else {
            c.abort(r);
        }
        drop(c);
        if let Err((error, doomed)) = installed {
            tracing::warn!(dataset = %self.name, shard, %error,
                "writing a cache entry failed; the shard is not cached (its FETCHes were served from memory)");
            if let Some(p) = doomed {
                cache::delete(&p);
            }
        }
        drop(parts);
        self.written(shard, len, kept);
    }

    /// `shard`'s cache write of `len` bytes ended (`kept`: committed): they leave
    /// [`State::writing_bytes`], and its bytes [`State::writing`]. Those of a write that
    /// failed stay in memory if a hint or a FETCH under way names the shard, as those of a
    /// shard the cache did not admit. An entry whose copy in memory a node reported corrupt
    /// while it was written ([`Self::corrupt_reported`] took it out of `writing`) is checked
    /// against its CRC before it is served.
    fn written(&self, shard: u32, len: u64, kept: bool) {
        let mut st = self.state();
        st.writing_bytes -= len;
        let Some(parts) = st.writing.remove(&shard) else {
            if kept && let Some(c) = &self.cache {
                // Locks in the order `place` takes them: state, then cache.
                c.lock().expect("poisoned").recheck(shard);
            }
            drop(st);
            self.wake.notify_one(); // the read ahead may have waited for this memory
            return;
        };
        let wanted = st.hints.next_use(shard).is_some() || st.wanted.contains_key(&shard);
        if !kept && wanted && !st.ready.contains_key(&shard) {
            st.ready_bytes += len;
            st.ready.insert(shard, parts);
        }
        drop(st);
        self.wake.notify_one(); // the read ahead may have waited for this memory
    }

    /// Waits (10 s at most) until no cache write is under way ([`Self::place`]): a test that
    /// looks at the cache after a FETCH waits for its shard's write first.
    #[cfg(test)]
    pub(crate) async fn cache_writes_done(&self) {
        let t0 = Instant::now();
        while self.state().writing_bytes > 0 {
            let waited = t0.elapsed();
            assert!(
                waited.as_secs() < 10,
                "cache writes still under way after {waited:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Status for the source's admin endpoint.
    pub fn status(&self) -> serde_json::Value {
        let st = self.state();
        let w = self.store.window();
        let cache = self.cache.as_ref().map(|c| {
            let c = c.lock().expect("poisoned");
            serde_json::json!({"entries": c.len(), "bytes": c.used(), "capacity": c.capacity(),
                "writing_bytes": st.writing_bytes})
        });
        serde_json::json!({
            "url": self.store.url().to_string(),
            "store": self.store.described().to_string(),
            "objects": self.objects.len(),
            "shards": self.shards.len(),
            "hinted_streams": st.hints.streams(),
            "prefetched_bytes": st.ready_bytes,
            "reading_shards": st.loading.len(),
            "window": format!("{w:?}"),
            "cache": cache,
        })
    }
}

/// Waits for a load's outcome.
async fn wait(mut rx: watch::Receiver<Outcome>) -> Result<(), Failure> {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone().expect("is some"),
        // The reader went away without an outcome (its task dropped or panicked; its
        // `Registered` took the shard out of `loading`): read again.
        Err(_) => Ok(()),
    }
}

/// FETCHes of one shard under way ([`State::wanted`]).
#[derive(Clone, Copy, Debug, Default)]
struct Wanting {
    /// FETCHes under way.
    fetches: usize,
    /// Of those, the ones out of their sessions' queues ([`Wanted::leave_queue`]).
    reading: usize,
    /// Of those, the ones that took the shard's bytes from memory.
    took: usize,
}

/// A FETCH of `shard` from its arrival ([`RemoteDataset::want`]: queued in its session, then
/// read), counted in [`State::wanted`] until it ends however it ends.
pub(crate) struct Wanted {
    dataset: Arc<RemoteDataset>,
    shard: u32,
    /// It left its session's queue ([`Wanted::leave_queue`]).
    reading: bool,
    /// It took the shard from memory ([`RemoteDataset::take_ready`]).
    took: bool,
}

impl Wanted {
    /// The dataset the FETCH reads.
    pub(crate) fn dataset(&self) -> &Arc<RemoteDataset> {
        &self.dataset
    }

    /// The FETCH leaves its session's queue: from now on it reads its shard, waits on a read
    /// of it or takes it from memory, and a FETCH that takes the shard before it leaves it in
    /// memory for it ([`RemoteDataset::take_ready`]). Its session calls this when the FETCH's
    /// read starts, before the task that runs [`Self::get`] is spawned: two FETCHes of one
    /// shard in memory started close together both count before either takes it, so the
    /// first leaves it for the second (counted only once that task ran, the first took it
    /// out of memory and the second read it from the store again). Once per FETCH.
    pub(crate) fn leave_queue(&mut self) {
        if self.reading {
            return;
        }
        if let Some(n) = self.dataset.state().wanted.get_mut(&self.shard) {
            n.reading += 1;
            self.reading = true;
        }
    }

    /// The verified bytes of the FETCH's shard, for node session `session`.
    pub(crate) async fn get(mut self, session: u64) -> Result<(Body, Served), Failure> {
        let d = Arc::clone(&self.dataset);
        d.get(session, &mut self).await
    }
}

impl Drop for Wanted {
    fn drop(&mut self) {
        let mut st = self.dataset.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = st.wanted.get_mut(&self.shard) {
            n.fetches -= 1;
            n.reading -= usize::from(self.reading);
            n.took -= usize::from(self.took);
            if n.fetches == 0 {
                st.wanted.remove(&self.shard);
                st.maybe_droppable(self.shard);
            }
        }
    }
}

/// Where a shard is held outside the store ([`RemoteDataset::held_in`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeldIn {
    /// In memory (read ahead, or read for a FETCH and not taken yet, or being written to the
    /// cache, [`RemoteDataset::place`]): sent from memory, which a FETCH holds until sent, so
    /// it counts in the source's read budget (`session.rs`). (Before, a shard being written
    /// was `Cache`: its FETCHes' bytes escaped that budget once the write ended.)
    Memory,
    /// In the disk cache (committed): sent from its file, holding no memory.
    Cache,
}

/// What [`RemoteDataset::claim`] found.
enum Claim {
    /// Another read of the shard is under way.
    Wait(watch::Receiver<Outcome>),
    /// This FETCH reads it (registered).
    Read(Reading),
    /// It is in memory now: take it.
    Again,
}

/// A load's shards still registered in `loading`, with where their outcomes go (and its
/// prefetch bytes): whatever way the load ends, even dropped or panicking half way, they are
/// taken out of `loading` before their waiters learn the read is gone (the senders drop after
/// [`Drop::drop`]), so a waiter reads the shard again instead of waiting on a read nobody
/// finishes.
struct Registered {
    dataset: Arc<RemoteDataset>,
    pending: Vec<(u32, watch::Sender<Outcome>)>,
    prefetching: u64,
}

impl Registered {
    /// `shard`'s outcome (placed or failed): it is no longer being read; its waiters get it.
    fn settle(&mut self, shard: u32, outcome: Result<(), Failure>) {
        self.dataset.state().loading.remove(&shard);
        if let Some(at) = self.pending.iter().position(|(s, _)| *s == shard) {
            let (_, tx) = self.pending.swap_remove(at);
            let _ = tx.send(Some(outcome));
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut st = self.dataset.state.lock().unwrap_or_else(|p| p.into_inner());
        for (s, _) in &self.pending {
            st.loading.remove(s);
        }
        st.prefetching -= self.prefetching;
        drop(st);
        self.dataset.wake.notify_one();
    }
}

/// Writes `parts` to a new file at `path`. No `fsync`: an entry written whole stays a
/// verified entry until the source stops, served from the page cache if need be; after a
/// crash its file may be torn or hold zeros, but an entry kept over a restart is length-checked
/// at open and CRC-checked on its first serve ([`DiskCache::open`],
/// [`RemoteDataset::cached`]), so that is caught and the entry deleted. (Before, each write
/// waited for `sync_data`, and so did the FETCHes of its shard.)
fn write_parts(path: &std::path::Path, parts: &[Bytes]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    for p in parts {
        f.write_all(p)?;
    }
    Ok(())
}
