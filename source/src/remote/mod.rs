//! Datasets whose files are objects in object storage (`--dataset NAME=s3://bucket/prefix`).
//!
//! A [`RemoteDataset`] answers a FETCH with the shard's verified bytes: from the memory of a
//! prefetch, from its disk cache (served with `sendfile` like a local file), or by reading it
//! now ([`read`]). The nodes' hints ([`hints`]) say what comes next: a prefetch task reads
//! those shards ahead, in hint order, within a memory budget and the bucket's window, and the
//! cache ([`cache`]) keeps what is needed soonest. Only bytes whose CRC-32C matched the
//! manifest are kept, cached or sent.

pub mod cache;
pub mod hints;
mod open;
mod prefetch;
pub mod read;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use shardwire_protocol::Manifest;
use shardwire_protocol::wire::ErrorCode;
use shardwire_store::{Store, StoreUrl, Urgency};
use tokio::sync::{Notify, watch};

use self::cache::{DiskCache, Reservation};
use self::hints::Hints;
pub use self::open::{OpenError, RemoteOptions};
use self::read::{Failure, Object, Want, read_shards};
use crate::sender::Body;

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
    /// Shards being read, with where their outcome goes.
    loading: HashMap<u32, Loading>,
    /// Bytes the prefetch task is reading.
    prefetching: u64,
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
    state: Mutex<State>,
    /// Bytes prefetched shards may hold in memory.
    budget: u64,
    /// Wakes the prefetch task (a hint changed, a read ended, a shard was sent).
    wake: Notify,
}

/// How a FETCH was answered (for counters and the log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// From a prefetch, in memory.
    Prefetched,
    /// From the disk cache.
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
            state: Mutex::new(State::default()),
            budget,
            wake: Notify::new(),
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

    /// Replaces stream `(session, stream)`'s hint; wakes the prefetch task.
    pub fn hint(&self, session: u64, stream: u64, shards: Vec<u32>) {
        let n = self.shards.len() as u32;
        let shards: Vec<u32> = shards.into_iter().filter(|&s| s < n).collect();
        if let Err(streams) = self.state().hints.set((session, stream), shards) {
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
        self.state().hints.forget_session(session);
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
        st.hints.consumed_by_session(session, shard);
        st.wanted.entry(shard).or_default().fetches += 1;
        Wanted {
            dataset: Arc::clone(self),
            shard,
            reading: false,
            took: false,
        }
    }

    /// Where `shard` is held, if it is: in memory (looked at first, as a FETCH takes it), or
    /// in the cache (committed, or being written by the read under way). A FETCH of it starts
    /// no new read from the store, so its session need not hold it back behind older reads
    /// or the source-wide read budget (`session.rs`); what it holds in memory once taken
    /// depends on where it is.
    pub(crate) fn held_in(&self, shard: u32) -> Option<HeldIn> {
        if self.state().ready.contains_key(&shard) {
            return Some(HeldIn::Memory);
        }
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
        // A report costs one CRC read of one entry at most.
        let dropped = {
            let mut st = self.state();
            let parts = st.ready.remove(&shard).unwrap_or_default();
            let n: u64 = parts.iter().map(|p| p.len() as u64).sum();
            st.ready_bytes -= n;
            n
        };
        if dropped > 0 {
            self.wake.notify_one();
        }
        let cached = self.cache.as_ref().is_some_and(|c| {
            let mut c = c.lock().expect("poisoned");
            c.recheck(shard);
            c.holds(shard)
        });
        tracing::warn!(dataset = %self.name, session, shard, cached, dropped_from_memory = dropped,
            "a node reported that a shard's bytes failed its CRC check; its cache entry is checked \
             against its CRC before it is served again, its copy in memory dropped");
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
        let mut waited = false;
        loop {
            if let Some(parts) = self.take_ready(wanted) {
                let how = if waited {
                    Served::Read
                } else {
                    Served::Prefetched
                };
                return Ok((Body::Memory(parts), how));
            }
            if let Some(body) = self.cached(shard).await {
                let how = if waited { Served::Read } else { Served::Cached };
                return Ok((body, how));
            }
            if waited {
                // Read, then taken by another FETCH of the same shard, or not admitted and
                // evicted: read it again.
                tracing::debug!(dataset = %self.name, session, shard, "the shard went before this FETCH took it");
            }
            // A cache entry committed since `cached` looked is taken on the next turn (once:
            // an entry that cannot be opened is read from the store instead).
            let look_in_cache = !waited;
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
        if st.ready.contains_key(&shard) || (look_in_cache && cached()) {
            return Claim::Again;
        }
        Claim::Read(self.begin(&mut st, vec![shard], false))
    }

    /// A shard in memory (prefetched, or read for a FETCH), for the FETCH `w`: shared while
    /// other FETCHes of it are reading it and have not taken it (they waited on the same
    /// read), taken out of memory by the last of them. FETCHes still queued in their sessions
    /// do not keep it: a slow node's queue would hold shards in memory past any budget (and
    /// stop the read ahead); a queued FETCH reads its shard again when its turn comes.
    fn take_ready(&self, w: &mut Wanted) -> Option<Vec<Bytes>> {
        let mut st = self.state();
        let wanting = st.wanted.get(&w.shard).copied().unwrap_or_default();
        let others = wanting.reading.saturating_sub(wanting.took + 1);
        let parts = if others > 0 {
            st.ready.get(&w.shard)?.clone()
        } else {
            let parts = st.ready.remove(&w.shard)?;
            st.ready_bytes -= parts.iter().map(|p| p.len() as u64).sum::<u64>();
            self.wake.notify_one();
            parts
        };
        if let Some(n) = st.wanted.get_mut(&w.shard) {
            n.took += 1;
            w.took = true;
        }
        Some(parts)
    }

    /// The cached entry of `shard` as a payload; an entry kept over a restart, or one a node
    /// reported corrupt ([`Self::corrupt_reported`]), is checked against its CRC first (and
    /// deleted if it fails).
    async fn cached(&self, shard: u32) -> Option<Body> {
        let cache = self.cache.as_ref()?;
        let hit = cache.lock().expect("poisoned").get(shard)?;
        // A file cut short since it was written (a disk error, an operator) would end the
        // node's whole session mid-payload, again on every session it is sent to.
        let size = hit.file.metadata().map(|m| m.len());
        if size.as_ref().ok() != Some(&hit.len) {
            let found = size.map_or_else(|e| format!("unreadable: {e}"), |n| format!("{n} bytes"));
            tracing::warn!(dataset = %self.name, shard, want = hit.len, %found,
                "a cache entry is not the length it was written with; deleted, reading the shard again");
            let doomed = cache
                .lock()
                .expect("poisoned")
                .remove_if_not(shard, hit.len);
            discard(doomed).await;
            return None;
        }
        if !hit.verified {
            let want = self.shards[shard as usize].crc32c;
            let file = hit.file.try_clone().ok()?;
            let got = tokio::task::spawn_blocking(move || file_crc(&file))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            if got.as_ref().ok() != Some(&want) {
                let found =
                    got.map_or_else(|e| format!("unreadable: {e}"), |crc| format!("{crc:#010x}"));
                tracing::warn!(dataset = %self.name, shard, want = format_args!("{want:#010x}"), %found,
                    "a cache entry failed its CRC check (kept over a restart, or reported corrupt by a node); deleted, reading the shard again");
                let doomed = cache.lock().expect("poisoned").remove_unverified(shard);
                discard(doomed).await;
                return None;
            }
            cache.lock().expect("poisoned").verified(shard);
        }
        Some(Body::File {
            file: Arc::new(hit.file),
            offset: 0,
        })
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
        // The bytes are here: a task of its own places them and tells their waiters, so a
        // load dropped now (its FETCH cancelled: the node went away) neither cuts a cache
        // write short and leaks its reservation, nor leaves another FETCH waiting on this
        // read to read the shard again.
        let me = Arc::clone(self);
        let settled = tokio::spawn(async move { me.settle(reads, prefetch, registered).await });
        settled.await.unwrap_or_else(|e| {
            Err(Failure {
                code: ErrorCode::Internal,
                retry_after_ms: 0,
                message: format!("placing shards read from the store failed: {e}"),
            })
        })
    }

    /// Places each shard read (or logs its failure), hands every outcome to its waiters and
    /// returns the first.
    async fn settle(
        self: Arc<Self>,
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
                    self.place(shard, parts).await;
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

    /// Stores a verified shard: in the cache if it admits it, else in memory.
    async fn place(&self, shard: u32, parts: Vec<Bytes>) {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if let Some(cache) = &self.cache {
            let w = &self.shards[shard as usize];
            let o = &self.objects[w.object];
            let name = cache::entry_name(shard, &o.key, &o.etag, (w.range.start, len), w.crc32c);
            let reserved = {
                let st = self.state();
                let mut c = cache.lock().expect("poisoned");
                c.reserve(shard, name, len, |s| st.hints.next_use(s))
            };
            if let Some(r) = reserved {
                metrics::counter!("shardwire_source_cache_evictions_total")
                    .increment(r.evicted.len() as u64);
                let (temp, write, doomed) = (r.temp.clone(), parts.clone(), r.doomed.clone());
                let wrote = tokio::task::spawn_blocking(move || {
                    Reservation::discard_evicted(&doomed);
                    write_parts(&temp, &write)
                })
                .await;
                // What was written and is not kept is set aside under the lock and deleted
                // after it (`discard`): it may be as large as a shard, and the prefetch waits
                // on this lock while it holds the dataset's state.
                let doomed = {
                    let mut c = cache.lock().expect("poisoned");
                    match wrote {
                        Ok(Ok(())) => match c.commit(r) {
                            Ok(()) => {
                                let used = c.used() as f64;
                                metrics::gauge!("shardwire_source_cache_bytes").set(used);
                                return;
                            }
                            Err(e) => {
                                tracing::warn!(dataset = %self.name, shard, error = %e, "cache entry not kept");
                                e.doomed
                            }
                        },
                        failed => {
                            let e =
                                failed.map_or_else(|j| j.to_string(), |r| format!("{:?}", r.err()));
                            tracing::warn!(dataset = %self.name, shard, error = %e, "writing a cache entry failed; served from memory");
                            c.abort(r)
                        }
                    }
                };
                discard(doomed).await;
            }
        }
        let mut st = self.state();
        st.ready_bytes += len;
        if let Some(old) = st.ready.insert(shard, parts) {
            // Not expected (one read per shard at a time), but the count stays true.
            st.ready_bytes -= old.iter().map(|p| p.len() as u64).sum::<u64>();
        }
    }

    /// Status for the source's admin endpoint.
    pub fn status(&self) -> serde_json::Value {
        let st = self.state();
        let w = self.store.window();
        let cache = self.cache.as_ref().map(|c| {
            let c = c.lock().expect("poisoned");
            serde_json::json!({"entries": c.len(), "bytes": c.used(), "capacity": c.capacity()})
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
            }
        }
    }
}

/// Where a shard is held outside the store ([`RemoteDataset::held_in`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeldIn {
    /// In memory (read ahead, or read for a FETCH and not taken yet).
    Memory,
    /// In the disk cache: sent from its file, holding no memory.
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

/// Deletes a cache file taken out of the index (renamed aside under the cache's lock) on a
/// blocking thread: unlinking a large file can take a while, and this runs on the runtime's.
async fn discard(doomed: Option<std::path::PathBuf>) {
    if let Some(p) = doomed {
        let _ = tokio::task::spawn_blocking(move || Reservation::discard_evicted(&[p])).await;
    }
}

/// CRC-32C of a whole file.
fn file_crc(file: &std::fs::File) -> std::io::Result<u32> {
    use std::io::Read;
    let mut crc = shardwire_protocol::crc::Crc32c::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut r = file;
    loop {
        match r.read(&mut buf)? {
            0 => return Ok(crc.finish()),
            n => crc.update(&buf[..n]),
        }
    }
}

/// Writes `parts` to a new file at `path`.
fn write_parts(path: &std::path::Path, parts: &[Bytes]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    for p in parts {
        f.write_all(p)?;
    }
    f.sync_data()
}
