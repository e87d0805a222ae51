//! The fetch side of a stream: where its shards come from and the memory they land in.
//!
//! [`Supply`] is what a stream shares between its trainer side and its task: the manifest,
//! the region's allocator, the datasets and the links that serve them, and the wake-up for a
//! task that waits for memory (the region's free upcall notifies it only while it waits).
//! [`Fetches`] is the task's own half, the same for both drivers (shard mode:
//! [`super::fetcher`], batch mode: [`super::batcher`]): allocating a slab with the wait for
//! memory counted as a trainer stall, issuing a FETCH through an [`Issue`] (the links, or a
//! fake in tests), queueing what found no live source, and classifying failures: a CRC error
//! or a lost connection is fetched again (from another source when one is up), a refusal that
//! may pass is asked again (at once of a source that has not refused the shard yet, else after
//! a backoff), and a refusal that will not change (an unknown shard or dataset, a bad request)
//! ends the stream with the source's reason. A fetch asked again passes over the sources that
//! refused its shard since its last delivery while another live one serves it
//! ([`route::Avoid`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use shardwire_gpu::{Part, Slab, SlabPool};
use shardwire_protocol::Manifest;
use tokio::sync::{Notify, mpsc};

use super::error::{CloseReason, MAX_CRC_MISMATCHES, MAX_REFUSALS, refusal_backoff};
use super::hints::{HintTarget, Hints};
use super::route::{self, Avoid, Routing, Version};
use crate::counters::Counters;
use crate::fetch::{Completion, Completions, FetchFailure, FetchRequest, InFlight, RetryClass};
use crate::link::{SendError, SourceLink};

/// Assembled batches that may always wait for their trainer; the region keeps room for them
/// (and the one the trainer holds) beside the shards it reads.
pub const READY_AHEAD: usize = 2;

/// The most assembled batches a batch-mode stream keeps waiting for its trainer ([`ready_ahead`]).
pub const READY_AHEAD_MAX: usize = 8;

/// A ready-ahead depth above [`READY_AHEAD`] keeps all its batches' slabs within this fraction
/// (1 / N) of the region.
const AHEAD_SHARE: u64 = 16;

/// How long the fetches may find no source before the stream asks whether any ever will
/// ([`route::unserved`]): a source that just reconnected has its answer recorded by then.
pub const UNSERVED_GRACE: Duration = Duration::from_secs(10);

/// How many assembled batches a batch-mode stream keeps waiting for its trainer: at least
/// [`READY_AHEAD`], and up to [`READY_AHEAD_MAX`] while their slabs (`batch_class` bytes each)
/// take at most 1/16 of the region (`capacity` bytes) and fit beside the shards it reads at
/// once (`window` bytes) and the batch the trainer holds. A deeper queue lets one `next` with
/// `count` answer several batches in one write, so a trainer pays one request and one receive
/// per several batches; where the region is tight it stays at [`READY_AHEAD`], as before.
pub fn ready_ahead(capacity: u64, window: u64, batch_class: u64) -> usize {
    let class = batch_class.max(1);
    let by_share = capacity / AHEAD_SHARE / class;
    let by_room = (capacity.saturating_sub(window) / class).saturating_sub(1);
    let depth = usize::try_from(by_share.min(by_room)).unwrap_or(READY_AHEAD_MAX);
    depth.clamp(READY_AHEAD, READY_AHEAD_MAX)
}

/// The shards `[first, first + shards)` of a stream's manifest: shards `0..` of `dataset`,
/// version `digest`, served by the sources whose manifest of it has that digest
/// ([`route::members`]).
pub struct DatasetSource {
    /// Dataset name on the wire.
    pub dataset: String,
    /// Its first shard in the stream's manifest.
    pub first: u32,
    /// Its number of shards.
    pub shards: u32,
    /// The digest of the manifest the stream was opened with.
    pub digest: String,
}

impl DatasetSource {
    /// The version, as routing names it.
    fn version(&self) -> Version<'_> {
        Version {
            dataset: &self.dataset,
            digest: &self.digest,
        }
    }
}

/// A fetch to issue: the first attempt or another one after a failure.
#[derive(Debug)]
pub struct Pending {
    /// The stream position (shard mode) or the shard (batch mode) it is for.
    pub pos: u64,
    /// The shard (index in the stream's manifest).
    pub shard: u32,
    /// Its destination.
    pub slab: Slab,
    /// The link that failed it last, avoided while another is up.
    pub avoid: Option<usize>,
    /// The links that refused its shard since its last delivery, avoided too while a live
    /// source is not one of them ([`Avoid`]).
    pub refused: Box<[usize]>,
    /// Not before this (a throttled source asked the node to wait).
    pub not_before: Option<Instant>,
}

impl Pending {
    /// A batch-mode stream's first fetch of `shard` into `slab` (its position is the shard;
    /// no link to avoid, due now).
    pub fn of_shard(shard: u32, slab: Slab) -> Self {
        Self {
            pos: u64::from(shard),
            shard,
            slab,
            avoid: None,
            refused: Box::default(),
            not_before: None,
        }
    }

    /// The links this fetch passes over ([`Supply::preferred`]).
    pub fn avoiding(&self) -> Avoid<'_> {
        Avoid {
            last: self.avoid,
            refused: &self.refused,
        }
    }
}

/// Why a fetch was not issued.
#[derive(Debug)]
pub enum IssueError {
    /// No link that serves the dataset is up: try again later.
    NoSource(Pending),
    /// The FETCH cannot be sent at all (a bug: names are checked when the stream opens).
    Fatal(Pending, Box<str>),
}

/// Sends a fetch on its way; the links in the node, a fake in tests.
pub trait Issue: Send {
    /// Issues `p` (its outcome goes to `done`), or gives it back with the reason.
    fn issue(&mut self, supply: &Supply, p: Pending, done: &Completions) -> Result<(), IssueError>;
}

/// The shared fetch side of one stream.
pub struct Supply {
    stream: u64,
    /// The stream's lane (its fetches come on that lane's data connections).
    lane: u16,
    manifest: Arc<Manifest>,
    pool: Arc<SlabPool>,
    sources: Vec<DatasetSource>,
    routing: Arc<Routing>,
    counters: Arc<Counters>,
    ids: Arc<AtomicU64>,
    /// Woken when a slab is freed while the task waits for memory.
    freed: Notify,
    wants_memory: AtomicBool,
    /// Set when the stream closes, before its leases go back to the pool: from then on no
    /// slab is handed out (a trainer may still read its last batch where it mapped it).
    closed: AtomicBool,
    /// Every hint sent, as `(dataset, link, shards)`, oldest first: a test's links never
    /// connect, so this is where its hints are seen ([`Self::standing_hints`]).
    #[cfg(test)]
    hints_sent: std::sync::Mutex<Vec<(usize, usize, Vec<u32>)>>,
}

impl Supply {
    /// The supply of stream `stream`; the region's frees wake its task while it waits.
    pub fn new(
        stream: u64,
        lane: u16,
        manifest: Arc<Manifest>,
        pool: Arc<SlabPool>,
        (sources, routing): (Vec<DatasetSource>, Arc<Routing>),
        counters: Arc<Counters>,
        ids: Arc<AtomicU64>,
    ) -> Arc<Self> {
        let s = Arc::new(Self {
            stream,
            lane,
            manifest,
            pool,
            sources,
            routing,
            counters,
            ids,
            freed: Notify::new(),
            wants_memory: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            #[cfg(test)]
            hints_sent: std::sync::Mutex::default(),
        });
        let weak: Weak<Self> = Arc::downgrade(&s);
        s.pool.set_on_free(Arc::new(move || {
            // Only a task waiting for memory needs waking: a release on a fully prefetched
            // stream then costs no cross-thread wake-up.
            if let Some(s) = weak.upgrade()
                && s.wants_memory.load(Ordering::SeqCst)
            {
                s.freed.notify_one();
            }
        }));
        s
    }

    /// The stream's manifest.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// The region's allocator.
    pub fn pool(&self) -> &Arc<SlabPool> {
        &self.pool
    }

    /// The node's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Every source link of the node (a closing stream cancels its fetches on each).
    pub fn links(&self) -> Vec<Arc<SourceLink>> {
        self.routing.roster().links()
    }

    /// The dataset of manifest shard `shard`, and the shard's index in it.
    pub fn source_of(&self, shard: u32) -> (&DatasetSource, u32) {
        let (_, d, s) = self.dataset_of(shard);
        (d, s)
    }

    /// The same with the dataset's position in the stream ([`Self::dataset`]).
    pub fn dataset_of(&self, shard: u32) -> (usize, &DatasetSource, u32) {
        let i = self.sources.partition_point(|d| d.first <= shard).max(1) - 1;
        let d = &self.sources[i];
        (i, d, shard - d.first)
    }

    /// Why no source will serve `source` again, if none will ([`route::unserved`]).
    pub fn unserved(&self, source: &DatasetSource) -> Option<String> {
        route::unserved(self.routing.roster(), source.version())
    }

    /// The link to fetch `source`'s shard `wire_shard` from now: its placement's source when
    /// that one is up and not avoided (`avoid`, link ids), else the next such live one in the
    /// shard's rendezvous ranking ([`route::choose`]).
    pub fn preferred(
        &self,
        source: &DatasetSource,
        wire_shard: u32,
        avoid: Avoid<'_>,
    ) -> Option<Arc<SourceLink>> {
        let v = source.version();
        let members = self.routing.members(v, &|| self.next_id());
        let sizes = || {
            let first = source.first as usize;
            self.manifest.shards[first..first + source.shards as usize]
                .iter()
                .map(|e| e.length)
                .collect()
        };
        route::choose(
            self.routing.placements(),
            v,
            (&members, self.lane),
            (wire_shard, avoid),
            sizes,
        )
    }

    /// Why no source serves this stream's lane for `source` now, if every one that is up left
    /// the lane out ([`route::unreached`]).
    pub fn unreached(&self, source: &DatasetSource) -> Option<String> {
        let v = source.version();
        let members = self.routing.members(v, &|| self.next_id());
        route::unreached(&members, v, self.lane)
    }

    /// Resolves when a slab is freed after [`Fetches::alloc`] found no room.
    pub async fn freed(&self) {
        self.freed.notified().await;
    }

    /// A slab of `bytes` for a shard, or `None` when the region is full; until one is found
    /// again, a freed slab wakes the task ([`Self::freed`]).
    pub fn try_alloc(&self, bytes: usize) -> Option<Slab> {
        self.try_alloc_in(Part::Main, bytes)
    }

    /// [`Self::try_alloc`] from `part` of the region (batch slabs: [`Part::Apart`]).
    pub fn try_alloc_in(&self, part: Part, bytes: usize) -> Option<Slab> {
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        // Announce the need before trying, so a free between the failed try and the wait
        // leaves a permit instead of being missed.
        self.wants_memory.store(true, Ordering::SeqCst);
        let slab = self.pool.alloc_in(part, bytes)?;
        self.wants_memory.store(false, Ordering::SeqCst);
        // A block that a close freed (a lease's) comes only after the flag was set: seen
        // here, and given back before anything lands in it.
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        Some(slab)
    }

    /// Whether the stream closed ([`Self::close`]): every slab is refused from then on, so a
    /// failed allocation says nothing of the room.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// No slab is handed out from now on ([`Self::try_alloc`] says no): the stream closed.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// A fresh request id.
    fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The `(dataset, link)` pairs that were sent a hint naming shards, so far.
    #[cfg(test)]
    pub fn hinted_links(&self) -> Vec<(usize, usize)> {
        let sent = self.hints_sent.lock().expect("poisoned");
        let mut out: Vec<_> = sent
            .iter()
            .filter(|(_, _, shards)| !shards.is_empty())
            .map(|&(di, link, _)| (di, link))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The `(dataset, link)` pairs whose last hint named shards: the hints standing now (an
    /// empty hint withdraws one).
    #[cfg(test)]
    pub fn standing_hints(&self) -> Vec<(usize, usize)> {
        let sent = self.hints_sent.lock().expect("poisoned");
        let mut last = std::collections::BTreeMap::new();
        for (di, link, shards) in sent.iter() {
            last.insert((*di, *link), !shards.is_empty());
        }
        last.into_iter()
            .filter_map(|(k, stands)| stands.then_some(k))
            .collect()
    }
}

impl HintTarget for Supply {
    fn stream(&self) -> u64 {
        self.stream
    }

    fn locate(&self, shard: u32) -> (usize, u32) {
        let (di, _, wire_shard) = self.dataset_of(shard);
        (di, wire_shard)
    }

    fn link_for(&self, di: usize, wire_shard: u32) -> Option<usize> {
        self.preferred(&self.sources[di], wire_shard, Avoid::default())
            .map(|l| l.index)
    }

    fn send_hint(&self, di: usize, link: usize, shards: Vec<u32>) {
        #[cfg(test)]
        self.hints_sent
            .lock()
            .expect("poisoned")
            .push((di, link, shards.clone()));
        let source = &self.sources[di];
        let Some(l) = self.routing.roster().link(link) else {
            return; // retired: its hints went with it
        };
        if let Err(e) = l.hint(self.stream, &source.dataset, shards) {
            tracing::debug!(source = %l.addr, error = %e, "hint not sent");
        }
    }
}

/// The real [`Issue`]: the shard's preferred live link ([`Supply::preferred`]), avoiding the
/// one that just failed and those that refused the shard while another is up.
#[derive(Debug, Default)]
pub struct Links;

impl Issue for Links {
    fn issue(&mut self, s: &Supply, p: Pending, done: &Completions) -> Result<(), IssueError> {
        let (source, shard) = s.source_of(p.shard);
        let Some(link) = s.preferred(source, shard, p.avoiding()) else {
            return Err(IssueError::NoSource(p));
        };
        let entry = &s.manifest.shards[p.shard as usize];
        let req = FetchRequest {
            slab: p.slab,
            pos: p.pos,
            shard: p.shard,
            length: entry.length,
            crc32c: entry.crc32c,
            stream: s.stream,
            lane: s.lane,
        };
        let f = InFlight::new(req, link.index, done.clone());
        let id = s.next_id();
        tracing::debug!(req = id, shard = p.shard, pos = p.pos, source = %link.addr, "FETCH");
        link.fetch(id, &source.dataset, shard, f).map_err(|failed| {
            let (f, e) = *failed;
            let (pos, shard) = (f.pos, f.shard);
            let p = Pending {
                pos,
                shard,
                slab: f.unsent(),
                avoid: p.avoid,
                refused: p.refused,
                not_before: None,
            };
            match e {
                SendError::Encode { .. } => IssueError::Fatal(p, e.to_string().into()),
                SendError::Down(_) => IssueError::NoSource(p),
            }
        })
    }
}

/// One shard's error answers since it was last delivered.
#[derive(Debug, Default)]
struct Refusals {
    /// All of them (the backoff grows with them).
    answers: u32,
    /// Those of a kind that may not pass ([`MAX_REFUSALS`]).
    failed: u32,
    /// The links that gave them: the next fetch passes over them while a live source is not
    /// one of them ([`Pending::refused`]), and goes at once when it does.
    by: Vec<usize>,
}

/// A stream task's half of the fetch side: what waits to be issued, where outcomes arrive,
/// and since when it waits for memory.
pub struct Fetches {
    supply: Arc<Supply>,
    issuer: Box<dyn Issue>,
    waiting: VecDeque<Pending>,
    tx: Completions,
    rx: mpsc::UnboundedReceiver<Completion>,
    starved_since: Option<Instant>,
    /// Since when the fetches waiting have found no source ([`UNSERVED_GRACE`]).
    no_source_since: Option<Instant>,
    /// Whether this wait was said to be for a lane no source reaches ([`Self::tell_unreached`]).
    told_unreached: bool,
    hints: Hints,
    /// CRC mismatches in a row per shard (see [`MAX_CRC_MISMATCHES`]).
    crc_streak: HashMap<u32, u32>,
    /// Per shard, since its last delivery: its sources' error answers ([`Refusals`]).
    refused_streak: HashMap<u32, Refusals>,
    /// Per shard, since its last delivery: its fetches lost with their link or connection
    /// (the second and later are asked again after [`refusal_backoff`]).
    lost_streak: HashMap<u32, u32>,
    /// Fetches issued whose outcome has not come back (each holds its slab until it does).
    in_flight: usize,
}

impl Drop for Fetches {
    fn drop(&mut self) {
        self.hints.withdraw(&*self.supply);
    }
}

impl Fetches {
    /// The task half over `supply`, issuing through `issuer`.
    pub fn new(supply: Arc<Supply>, issuer: Box<dyn Issue>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            supply,
            issuer,
            waiting: VecDeque::new(),
            tx,
            rx,
            starved_since: None,
            no_source_since: None,
            told_unreached: false,
            hints: Hints::default(),
            crc_streak: HashMap::new(),
            refused_streak: HashMap::new(),
            lost_streak: HashMap::new(),
            in_flight: 0,
        }
    }

    /// Whether a round of read-ahead hints is due ([`super::hints`]): every
    /// [`super::hints::HINT_EVERY`] fetches, and once the task will issue no more (`done`)
    /// while a hint still stands (the round, with nothing upcoming, withdraws it).
    pub fn hint_due(&self, done: bool) -> bool {
        self.hints.due(done)
    }

    /// Tells the sources what the stream fetches next: `upcoming` yields the shards after
    /// those issued, soonest first (see [`super::hints`]).
    pub fn hint(&mut self, upcoming: impl Iterator<Item = u32>) {
        self.hints.send(&*self.supply, upcoming);
    }

    /// A slab of `bytes`, or `None` when the region is full (the task then waits for
    /// [`Supply::freed`]); the time until memory is found again counts as a trainer stall.
    pub fn alloc(&mut self, bytes: usize) -> Option<Slab> {
        let Some(slab) = self.supply.try_alloc(bytes) else {
            self.starved_since.get_or_insert_with(Instant::now);
            return None;
        };
        if let Some(t) = self.starved_since.take() {
            self.supply
                .counters
                .stall_trainer_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        Some(slab)
    }

    /// Issues `p`, or keeps it for [`Self::reissue`] when no source is up; an error is a FETCH
    /// that can never be sent.
    pub fn fetch(&mut self, p: Pending) -> Result<(), CloseReason> {
        self.hints.fetched();
        match self.issuer.issue(&self.supply, p, &self.tx) {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(IssueError::NoSource(p)) => {
                self.waiting.push_back(p);
                self.no_source_since.get_or_insert_with(Instant::now);
                Ok(())
            }
            Err(IssueError::Fatal(p, why)) => {
                self.waiting.push_back(p);
                Err(CloseReason::Internal(format!("cannot send a FETCH: {why}")))
            }
        }
    }

    /// Issues the waiting fetches in order until one finds no source; one not due yet (its
    /// source asked for a pause) keeps its place, and those behind it go.
    pub fn reissue(&mut self) -> Result<(), CloseReason> {
        let now = Instant::now();
        let mut later = VecDeque::new();
        let mut out = Ok(());
        while let Some(p) = self.waiting.pop_front() {
            if p.not_before.is_some_and(|t| now < t) {
                later.push_back(p);
                continue;
            }
            match self.issuer.issue(&self.supply, p, &self.tx) {
                Ok(()) => {
                    self.in_flight += 1;
                    self.no_source_since = None;
                    self.told_unreached = false;
                }
                Err(IssueError::NoSource(p)) => {
                    let since = *self.no_source_since.get_or_insert(now);
                    if now.duration_since(since) >= UNSERVED_GRACE {
                        match self.unserved(&p) {
                            Some(why) => out = Err(why),
                            None => self.tell_unreached(&p),
                        }
                    }
                    self.waiting.push_front(p);
                    break;
                }
                Err(IssueError::Fatal(p, why)) => {
                    self.waiting.push_front(p);
                    out = Err(CloseReason::Internal(format!("cannot send a FETCH: {why}")));
                    break;
                }
            }
        }
        // The paused ones go back ahead of what was not tried, in their order.
        later.append(&mut self.waiting);
        self.waiting = later;
        out
    }

    /// The close of a stream whose waiting fetch `p` no source will serve again.
    fn unserved(&self, p: &Pending) -> Option<CloseReason> {
        let (source, _) = self.supply.source_of(p.shard);
        let answers = self.supply.unserved(source)?;
        Some(CloseReason::Unserved {
            dataset: source.dataset.clone(),
            digest: source.digest.clone(),
            answers,
        })
    }

    /// Says once per wait (a warning) why the waiting fetch `p` finds no source, when the
    /// sources that serve it are up but every one left the stream's lane out of its session
    /// (could not dial the lane's data address): the fetches wait for a session that dials it.
    fn tell_unreached(&mut self, p: &Pending) {
        if self.told_unreached {
            return;
        }
        let (source, _) = self.supply.source_of(p.shard);
        if let Some(why) = self.supply.unreached(source) {
            tracing::warn!(stream = self.supply.stream, lane = self.supply.lane, %why,
                "the stream's fetches wait for a source that reaches its lane");
            self.told_unreached = true;
        }
    }

    /// True while fetches wait for a source to come up (the task then retries on a timer).
    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// True while any fetch holds a slab: issued and not back, or waiting to be issued.
    pub fn busy(&self) -> bool {
        self.in_flight > 0 || !self.waiting.is_empty()
    }

    /// Drops the waiting fetches of shards `held` says no longer (their slabs go back).
    pub fn drop_waiting(&mut self, held: impl Fn(u32) -> bool) {
        self.waiting.retain(|p| held(p.shard));
    }

    /// The earliest time a waiting fetch's source said to try again at.
    #[cfg(test)]
    pub fn next_due(&self) -> Option<Instant> {
        self.waiting.iter().filter_map(|p| p.not_before).min()
    }

    /// Makes every waiting fetch due now (tests: the pauses are real time).
    #[cfg(test)]
    pub fn make_due(&mut self) {
        for p in &mut self.waiting {
            p.not_before = None;
        }
    }

    /// Forgets the failures counted against `shard` (the stream no longer needs it).
    pub fn forget(&mut self, shard: u32) {
        self.crc_streak.remove(&shard);
        self.refused_streak.remove(&shard);
        self.lost_streak.remove(&shard);
    }

    /// The next outcome of a fetch.
    pub async fn completed(&mut self) -> Option<Completion> {
        let c = self.rx.recv().await;
        self.in_flight = self.in_flight.saturating_sub(usize::from(c.is_some()));
        c
    }

    /// An outcome already here, without waiting.
    #[cfg(test)]
    pub fn try_completed(&mut self) -> Option<Completion> {
        let c = self.rx.try_recv().ok();
        self.in_flight = self.in_flight.saturating_sub(usize::from(c.is_some()));
        c
    }

    /// Sorts an outcome: `Ok(Some(slab))` holds a verified shard; `Ok(None)` means it waits
    /// to be fetched again ([`Self::reissue`]; counted, logged, from another source when one
    /// is up); `Err` is a failure that will not change, which ends the stream.
    pub fn sort(&mut self, c: Completion) -> Result<Option<Slab>, CloseReason> {
        let f = match c.result {
            Ok(()) => {
                metrics::histogram!("shardwire_fetch_duration_seconds")
                    .record(c.issued.elapsed().as_secs_f64());
                self.forget(c.shard);
                return Ok(Some(c.slab));
            }
            Err(f) => f,
        };
        if let FetchFailure::Crc { got, want } = f {
            let times = self.crc_streak.entry(c.shard).or_default();
            *times += 1;
            if *times >= MAX_CRC_MISMATCHES {
                let (d, shard) = self.supply.source_of(c.shard);
                let why = CloseReason::Corrupt {
                    dataset: d.dataset.clone(),
                    shard,
                    times: *times,
                    got,
                    want,
                };
                tracing::error!(%why, "closing the stream");
                return Err(why);
            }
        }
        if f.retry_class() == RetryClass::Fail {
            let (d, shard) = self.supply.source_of(c.shard);
            tracing::error!(dataset = %d.dataset, shard, failure = %f, "a fetch failed for good; closing the stream");
            return Err(CloseReason::ShardFailed {
                dataset: d.dataset.clone(),
                shard,
                failure: f,
            });
        }
        let pause = match &f {
            FetchFailure::Refused { .. } => Some(self.refused_again(c.shard, c.source, &f)?),
            // The first goes again at once (another source, or the link's next session); a
            // shard whose fetches keep breaking their link or connection (a source that
            // fails on it every time) waits longer each time, not a round trip.
            FetchFailure::LinkDown { .. } | FetchFailure::ConnectionLost { .. } => {
                let n = self.lost_streak.entry(c.shard).or_default();
                *n += 1;
                (*n > 1).then(|| refusal_backoff(*n - 1))
            }
            _ => f.retry_after(),
        };
        self.supply
            .counters
            .refetches
            .fetch_add(1, Ordering::Relaxed);
        match &f {
            FetchFailure::Crc { got, want } => {
                tracing::warn!(shard = c.shard, got, want, "refetching after CRC mismatch")
            }
            other => {
                tracing::warn!(shard = c.shard, failure = %other, "refetching after a failed fetch")
            }
        }
        // Any failure passes over the sources that refused the shard, not only a refusal: a
        // shard with none is fetched as before (avoiding only the link that failed it).
        let refused = self.refusers(c.shard).into();
        self.waiting.push_back(Pending {
            pos: c.pos,
            shard: c.shard,
            slab: c.slab,
            avoid: Some(c.source),
            refused,
            not_before: pause.map(|d| Instant::now() + d),
        });
        Ok(None)
    }

    /// Counts a refusal of `shard` (`f`, from link `source`) in a row: the pause before it is
    /// asked again, or, at [`MAX_REFUSALS`] of a kind that may not pass, the stream's end. No
    /// pause when the next fetch goes to a link that has not refused it since its last
    /// delivery (the answer was about that source's copy: its file, its disk); else the
    /// source's `retry_after`, else [`refusal_backoff`]. A throttled or unavailable store keeps
    /// its pause wherever the shard goes next: a dataset's sources share their object store.
    fn refused_again(
        &mut self,
        shard: u32,
        source: usize,
        f: &FetchFailure,
    ) -> Result<Duration, CloseReason> {
        use shardwire_protocol::wire::ErrorCode as C;
        let code = match f {
            FetchFailure::Refused { code, .. } => *code,
            _ => C::Internal,
        };
        // A draining source: another source may serve it now.
        if code == C::Draining {
            return Ok(Duration::ZERO);
        }
        // Only refusals that may not pass count; a throttled or unavailable store is waited
        // out, with the backoff, however long it lasts.
        let passing = matches!(code, C::Throttled | C::StorageUnavailable);
        let r = self.refused_streak.entry(shard).or_default();
        r.answers += 1;
        if !passing {
            r.failed += 1;
        }
        if !r.by.contains(&source) {
            r.by.push(source);
        }
        let (answers, times) = (r.answers, r.failed);
        if times >= MAX_REFUSALS {
            let (d, shard) = self.supply.source_of(shard);
            tracing::error!(dataset = %d.dataset, shard, times, failure = %f, "the sources refused a shard again and again; closing the stream");
            return Err(CloseReason::ShardFailed {
                dataset: d.dataset.clone(),
                shard,
                failure: f.clone(),
            });
        }
        if !passing && self.goes_to_another(shard, source) {
            return Ok(Duration::ZERO);
        }
        Ok(f.retry_after().unwrap_or_else(|| refusal_backoff(answers)))
    }

    /// The links that refused `shard` since its last delivery ([`Refusals::by`]).
    fn refusers(&self, shard: u32) -> &[usize] {
        self.refused_streak
            .get(&shard)
            .map(|r| r.by.as_slice())
            .unwrap_or_default()
    }

    /// Whether the next fetch of `shard`, avoiding link `source` and those that refused it
    /// since its last delivery, goes to a live link that is none of them
    /// ([`Supply::preferred`] now, as [`Links`] will ask it).
    fn goes_to_another(&self, shard: u32, source: usize) -> bool {
        let refused = self.refusers(shard);
        let avoid = Avoid {
            last: Some(source),
            refused,
        };
        let (d, wire_shard) = self.supply.source_of(shard);
        self.supply
            .preferred(d, wire_shard, avoid)
            .is_some_and(|l| l.index != source && !refused.contains(&l.index))
    }
}

/// Whether the region keeps room for `ahead` ready batches after a prefetch of `len`.
pub fn room_for_prefetch(pool: &SlabPool, len: usize, batch_bytes: u64, ahead: usize) -> bool {
    let (main, used) = pool.part(Part::Main);
    // Batch slabs set apart ([`SlabPool::set_apart`]) need no room among the shards.
    let apart = main < pool.capacity();
    let reserve = if apart {
        0
    } else {
        ahead * SlabPool::class_size(batch_bytes as usize)
    };
    main - used >= reserve + SlabPool::class_size(len)
}

/// How many batch slabs a batch-mode stream sets apart at the top of its region
/// ([`SlabPool::set_apart`]): its `ahead` ready batches and the one its trainer uses, what its
/// open check counted beside the shards (so the shards keep all the room they had). A batch
/// past those (a trainer that keeps several, or answers of several batches) takes a block
/// among the shards where one is free, as before the parts.
pub fn batch_slots(ahead: usize) -> usize {
    ahead + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_ready_ahead_depth_grows_with_room_and_stays_at_two_where_the_region_is_tight() {
        // 256 MiB, 256 KiB batches, a 64 MiB window: 1/16 of the region holds 64, capped at 8.
        assert_eq!(ready_ahead(256 * MIB, 64 * MIB, 256 << 10), READY_AHEAD_MAX);
        // 1/16 of 64 MiB holds four 1 MiB batches.
        assert_eq!(ready_ahead(64 * MIB, 8 * MIB, MIB), 4);
        // The window leaves room for the held batch and 4 more: 4, whatever the share allows.
        assert_eq!(ready_ahead(1024 * MIB, 1019 * MIB, MIB), 4);
        // Tight: the window and three batch slabs fill the region (the least that opens).
        assert_eq!(ready_ahead(64 * MIB, 61 * MIB, MIB), READY_AHEAD);
        // A window larger than the region (refused by the caller) or batches larger than the
        // share: the minimum, never less.
        assert_eq!(ready_ahead(64 * MIB, 100 * MIB, MIB), READY_AHEAD);
        assert_eq!(ready_ahead(64 * MIB, 0, 32 * MIB), READY_AHEAD);
        assert_eq!(ready_ahead(0, 0, 0), READY_AHEAD);
    }

    /// A fake that issues nothing (the tests sort outcomes by hand).
    struct Idle;

    impl Issue for Idle {
        fn issue(&mut self, _: &Supply, p: Pending, _: &Completions) -> Result<(), IssueError> {
            Err(IssueError::NoSource(p))
        }
    }

    /// Fetches of a 2-shard dataset `d` (version `v1`) served by two live sources.
    fn two_sources() -> Fetches {
        sources(&["10.0.0.2:1", "10.0.0.3:1"])
    }

    /// Fetches of a 2-shard dataset `d` (version `v1`) served by live sources at `addrs`.
    fn sources(addrs: &[&str]) -> Fetches {
        use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry};
        let shard = |i: u32| ShardEntry {
            file: format!("s{i}.bin"),
            offset: 0,
            length: 4096,
            crc32c: 0,
            tensors: vec![TensorEntry::dense(
                "x".into(),
                DType::Uint8,
                vec![4096],
                0,
                4096,
            )],
        };
        let roster = crate::roster::Roster::new(crate::link::LinkConfig {
            secret: None,
            lanes: vec![shardwire_protocol::wire::LaneAddr {
                data_addr: "127.0.0.1:1".parse().unwrap(),
                flows: 1,
            }],
        });
        for addr in addrs {
            let (l, _) = roster.add(addr, "config").unwrap();
            l.force_up(true);
            l.served.record("d", Some("v1".into()), 0);
        }
        let source = DatasetSource {
            dataset: "d".into(),
            first: 0,
            shards: 2,
            digest: "v1".into(),
        };
        let supply = Supply::new(
            1,
            0,
            Arc::new(Manifest::new(vec![shard(0), shard(1)])),
            crate::fetch::tests::pool(1 << 20),
            (vec![source], route::Routing::new(Arc::new(roster))),
            Arc::new(Counters::default()),
            Arc::new(AtomicU64::new(0)),
        );
        Fetches::new(supply, Box::new(Idle))
    }

    /// `shard`'s fetch into `slab` refused with `code` by link `source`, sorted; the fetch
    /// requeued and when it is due.
    fn refuse(
        f: &mut Fetches,
        (shard, slab, source): (u32, Slab, usize),
        code: shardwire_protocol::wire::ErrorCode,
    ) -> (Pending, Instant) {
        let c = Completion {
            pos: u64::from(shard),
            shard,
            slab,
            source,
            issued: Instant::now(),
            result: Err(FetchFailure::Refused {
                code,
                retry_after_ms: 0,
                message: "refused".into(),
            }),
        };
        assert!(f.sort(c).unwrap().is_none(), "fetched again");
        let p = f.waiting.pop_front().expect("requeued");
        let due = p.not_before.expect("a time to ask again");
        (p, due)
    }

    #[test]
    fn a_shard_one_source_refused_goes_to_another_at_once_and_waits_once_all_refused() {
        use shardwire_protocol::wire::ErrorCode as C;
        let mut f = two_sources();
        let (d, _) = f.supply.source_of(0);
        let first = f
            .supply
            .preferred(d, 0, Avoid::default())
            .expect("a live source")
            .index;
        let slab = f.supply.try_alloc(4096).unwrap();
        // Before: 100 ms before another source was asked, every epoch the bad copy refused.
        let (p, due) = refuse(&mut f, (0, slab, first), C::ReadFailed);
        assert!(due <= Instant::now(), "due at once");
        assert_eq!(p.avoid, Some(first));
        let (d, _) = f.supply.source_of(0);
        let second = f.supply.preferred(d, 0, p.avoiding()).unwrap().index;
        assert_ne!(second, first);
        // The other refuses too: the next one to ask refused already, so it waits.
        let before = Instant::now();
        let (p, due) = refuse(&mut f, (0, p.slab, second), C::ReadFailed);
        assert!(
            due >= before + refusal_backoff(2),
            "the backoff of the 2nd answer"
        );
        let r = &f.refused_streak[&0];
        assert_eq!((r.answers, r.failed), (2, 2), "counted as before");
        // A throttled store keeps its pause though another source is up: they share it.
        let before = Instant::now();
        let (_, due) = refuse(&mut f, (1, p.slab, first), C::Throttled);
        assert!(due >= before + refusal_backoff(1));
    }

    /// Only the last refusing source was avoided: with three sources a shard that the two
    /// best-ranked refused went back to the first after a backoff, bouncing between them until
    /// [`MAX_REFUSALS`] ended the stream, while the third was up. Now it goes to the third at
    /// once, and only once all three refused does it wait (and leave the last one).
    #[test]
    fn a_shard_two_of_three_sources_refused_goes_to_the_third_at_once() {
        use shardwire_protocol::wire::ErrorCode as C;
        let mut f = sources(&["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]);
        let (d, _) = f.supply.source_of(0);
        let a = f.supply.preferred(d, 0, Avoid::default()).unwrap().index;
        let slab = f.supply.try_alloc(4096).unwrap();
        let (p, due) = refuse(&mut f, (0, slab, a), C::ReadFailed);
        assert!(due <= Instant::now(), "due at once");
        let (d, _) = f.supply.source_of(0);
        let b = f.supply.preferred(d, 0, p.avoiding()).unwrap().index;
        assert_ne!(b, a);
        let (p, due) = refuse(&mut f, (0, p.slab, b), C::ReadFailed);
        assert!(
            due <= Instant::now(),
            "due at once: the third has not refused it"
        );
        assert_eq!((p.avoid, &p.refused[..]), (Some(b), &[a, b][..]));
        let (d, _) = f.supply.source_of(0);
        let c = f.supply.preferred(d, 0, p.avoiding()).unwrap().index;
        assert!(c != a && c != b, "the third, not the first again");
        // All three refused: a backoff, and the next ask leaves the last one.
        let before = Instant::now();
        let (p, due) = refuse(&mut f, (0, p.slab, c), C::ReadFailed);
        assert!(
            due >= before + refusal_backoff(3),
            "the backoff of the 3rd answer"
        );
        let (d, _) = f.supply.source_of(0);
        let next = f.supply.preferred(d, 0, p.avoiding()).unwrap().index;
        assert_ne!(next, c);
    }

    /// A fetch lost with its link after a refusal passed over the lost link only, and went
    /// back to the source that had refused the shard while a third was up.
    #[test]
    fn a_shard_lost_after_a_refusal_passes_over_the_refusing_source_too() {
        use shardwire_protocol::wire::ErrorCode as C;
        let mut f = sources(&["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]);
        let (d, _) = f.supply.source_of(0);
        let a = f.supply.preferred(d, 0, Avoid::default()).unwrap().index;
        let slab = f.supply.try_alloc(4096).unwrap();
        let (p, _) = refuse(&mut f, (0, slab, a), C::ReadFailed);
        let (d, _) = f.supply.source_of(0);
        let b = f.supply.preferred(d, 0, p.avoiding()).unwrap().index;
        let c = Completion {
            pos: 0,
            shard: 0,
            slab: p.slab,
            source: b,
            issued: Instant::now(),
            result: Err(FetchFailure::LinkDown {
                source_addr: "10.0.0.x:1".into(),
                reason: "reset".into(),
            }),
        };
        assert!(f.sort(c).unwrap().is_none(), "fetched again");
        let p = f.waiting.pop_front().expect("requeued");
        assert_eq!((p.avoid, &p.refused[..]), (Some(b), &[a][..]));
        let (d, _) = f.supply.source_of(0);
        let next = f.supply.preferred(d, 0, p.avoiding()).unwrap().index;
        assert!(
            next != a && next != b,
            "the third: {next}, not {a} that refused"
        );
        // Delivered (or no longer needed): its refusals are forgotten.
        f.forget(0);
        assert!(f.refusers(0).is_empty());
    }

    #[test]
    fn batch_slots_hold_the_ready_batches_and_the_one_in_use() {
        assert_eq!(batch_slots(READY_AHEAD), 3, "what the open check counts");
        assert_eq!(batch_slots(READY_AHEAD_MAX), 9);
    }
}
