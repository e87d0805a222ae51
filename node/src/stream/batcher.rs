//! The task of a batch-mode stream: it keeps the shards of the blocks its rank is reading
//! resident in the stream's region, and assembles each batch into one slab.
//!
//! The rank's plan names, per epoch, the *units* it reads (a block of a partition, or the
//! epoch's tail), each with the first and last rank-local sample that needs it, in the order
//! of first use. The task fetches units in that order: those the next batch needs always,
//! later ones (prefetch) only while free blocks remain among the shards (batch slabs have a
//! part of the region of their own: `batcher/repack.rs`). A
//! shard is fetched once while any live unit holds it (its slab is reference-counted by
//! units) and freed when the last unit holding it is past. A batch is assembled when every
//! shard its samples come from has arrived: each tensor becomes one contiguous
//! `[batch_size, ...]` array in a fresh slab, by memcpy of runs of consecutive rows (host
//! memory) or by one gather-kernel launch for the whole batch (CUDA memory), as planned by
//! `assemble` (ragged tensors as values and offsets). At most the stream's ready-ahead depth
//! of assembled batches wait for the trainer (2 to 8, as its region allows:
//! [`super::supply::ready_ahead`]), so memory stays within the region whatever the
//! trainer does.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use shardwire_gpu::{Part, Slab, SlabPool};
use shardwire_protocol::samples::{EpochOrder, Unit};

use super::error::CloseReason;
use super::kind::{BatchMode, Kind, Sampler};
use super::mix::{self, MixSample};
use super::supply::{Fetches, Issue, Links, Pending, room_for_prefetch};
use super::{Ready, Stream};
use super::{assemble, tokens};
use crate::fetch::Completion;

/// How often fetches that found no live source try again.
const RETRY: Duration = Duration::from_millis(100);

/// The largest host batch gathered on the stream's tokio worker itself (bytes); a larger one
/// runs under `block_in_place` (about 0.1-0.3 ms of copying at this size).
const INLINE_GATHER: u64 = 1 << 20;

/// A shard held for live units: its slab once it has arrived.
struct Resident {
    slab: Option<Slab>,
    refs: u32,
}

/// One epoch's units and how far they have been issued.
struct EpochUnits {
    epoch: u32,
    /// The order (one dataset; a mixture keeps its own).
    order: Option<Arc<EpochOrder>>,
    units: Vec<Unit>,
    next: usize,
    /// Shards of `units[next]` already held (a unit issued halfway, for lack of memory).
    held: usize,
}

/// A unit whose shards are held, until the rank passes its last sample.
struct Live {
    first: u64,
    last: u64,
    shards: Vec<u32>,
    /// Its epoch, and its index among that epoch's units (to hold it again in turn when it is
    /// given back: [`Driver::give_back_prefetch`]).
    epoch: u32,
    unit: usize,
}

struct Driver {
    s: Arc<Stream>,
    m: Arc<BatchMode>,
    /// Rank-local samples per epoch.
    per_epoch: u64,
    /// Positions of all epochs.
    end: u64,
    /// The next position to assemble (this worker's).
    pos: u64,
    epochs: VecDeque<EpochUnits>,
    live: Vec<Live>,
    resident: ShardMap<Resident>,
    /// Slabs taken by [`Driver::repack`] for shards the next batch reads that no unit holds
    /// yet: [`Driver::hold`] fetches into them.
    reserved: ShardMap<Slab>,
    /// A shard the next batch reads found no free block though its bytes fit: the step
    /// repacks ([`Driver::repack`]).
    stuck: bool,
    /// The position whose batch found no room when prefetched shards were last given back
    /// ([`Driver::give_back_prefetch`]): nothing is held ahead of that batch until it is
    /// assembled. Held again at once, the same shards were fetched again and given back
    /// again, one FETCH each per round trip, for as long as the trainer kept its batches.
    gave_back_at: Option<u64>,
    fetches: Fetches,
}

/// A map keyed by manifest shard index. Assembly looks a shard up for every piece of every
/// batch (256 and more per batch), and SipHash cost more than the rest of those lookups
/// (`perf`: 3 % of the node's samples in the loader benchmark); the keys are dense indexes
/// below the manifest's shard count, so one multiply spreads them.
type ShardMap<V> = HashMap<u32, V, BuildHasherDefault<ShardHasher>>;

/// The hasher of [`ShardMap`]: a Fibonacci multiply of the index.
#[derive(Default)]
struct ShardHasher(u64);

impl Hasher for ShardHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(FIBONACCI);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(FIBONACCI);
    }
}

/// 2^64 / the golden ratio, odd: multiplying by it permutes the integers mod 2^64.
const FIBONACCI: u64 = 0x9e37_79b9_7f4a_7c15;

/// Runs a batch-mode stream from position `start` until it closes.
pub async fn run(s: Arc<Stream>, start: u64) {
    let mut d = Driver::new(s, start, Box::new(Links));
    loop {
        if d.s.is_closed() {
            return;
        }
        match d.step() {
            Err(why) => {
                d.s.close(why);
                return;
            }
            Ok(true) => {
                // Another batch may be ready to assemble: give the runtime's other tasks
                // their turn first (a gather runs on this worker, tens of microseconds).
                tokio::task::yield_now().await;
                continue;
            }
            Ok(false) => {}
        }
        let s = Arc::clone(&d.s);
        let supply = Arc::clone(s.supply());
        let retry = d.fetches.has_waiting();
        tokio::select! {
            biased;
            _ = s.closed() => return,
            Some(c) = d.fetches.completed() => {
                if let Err(why) = d.completed(c) {
                    s.close(why);
                    return;
                }
            }
            _ = supply.freed() => {}
            _ = s.taken() => {}
            _ = tokio::time::sleep(RETRY), if retry => {}
        }
    }
}

impl Driver {
    /// The driver of batch-mode stream `s` from position `start`, fetching through `issuer`.
    fn new(s: Arc<Stream>, start: u64, issuer: Box<dyn Issue>) -> Self {
        let Kind::Batches(m) = s.kind() else {
            unreachable!("the batcher runs batch-mode streams");
        };
        let m = Arc::clone(m);
        let per_epoch = m.steps() * u64::from(m.batch_size());
        let end = s.kind().per_epoch() * u64::from(s.epochs());
        let pos = s.kind().position(s.kind().slot_at(start));
        let fetches = Fetches::new(Arc::clone(s.supply()), issuer);
        Self {
            s,
            m,
            per_epoch,
            end,
            pos,
            epochs: VecDeque::new(),
            live: Vec::new(),
            resident: ShardMap::default(),
            reserved: ShardMap::default(),
            stuck: false,
            gave_back_at: None,
            fetches,
        }
    }

    /// Issues what waits and what memory allows, then assembles the next batch if it can;
    /// true if it did (the next one may be ready too).
    fn step(&mut self) -> Result<bool, CloseReason> {
        self.fetches.reissue()?;
        self.issue_units()?;
        if std::mem::take(&mut self.stuck) && self.repack()? {
            self.issue_units()?;
        }
        if self.fetches.hint_due(self.issued_all()) {
            let upcoming = self.upcoming();
            self.fetches.hint(upcoming.into_iter());
        }
        self.try_assemble()
    }

    /// The shards this worker will fetch next, in first-use order: those of the loaded
    /// epochs' units not issued yet that it needs and does not hold (at most
    /// [`super::hints::HINT_AHEAD`]).
    fn upcoming(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for (_, shards) in self.not_held() {
            for &shard in shards {
                if !self.resident.contains_key(&shard) && !out.contains(&shard) {
                    out.push(shard);
                    if out.len() == super::hints::HINT_AHEAD {
                        return out;
                    }
                }
            }
        }
        out
    }

    /// Whether this worker will issue no more fetches of its own: its last batch is assembled,
    /// or every unit up to the stream's last epoch is issued and none waits for a source
    /// (its standing hints are then withdrawn: [`Fetches::hint_due`]). A give-back may still
    /// hold units again ([`Driver::give_back_prefetch`]); their fetches go unhinted.
    fn issued_all(&self) -> bool {
        let epochs = self.s.epochs();
        self.pos >= self.end
            || (!self.fetches.has_waiting()
                && self.epochs.back().is_some_and(|e| e.epoch + 1 >= epochs)
                && self.epochs.iter().all(|e| e.next >= e.units.len()))
    }

    /// The units this worker needs that are not held yet, in first-use order from the loaded
    /// epochs' cursors: each unit's first rank-local sample (over all epochs) and its shards
    /// not held (those of a unit held halfway that are still to hold).
    fn not_held(&self) -> impl Iterator<Item = (u64, &[u32])> + '_ {
        self.epochs.iter().flat_map(move |e| {
            let g = u64::from(e.epoch) * self.per_epoch;
            e.units
                .iter()
                .enumerate()
                .skip(e.next)
                .filter(move |(_, u)| self.needed(e.epoch, u))
                .map(move |(k, u)| {
                    let from = if k == e.next { e.held } else { 0 };
                    (g + u.first, &u.shards[from.min(u.shards.len())..])
                })
        })
    }

    /// The rank-local index (over all epochs) of the last sample of the batch at `pos`.
    fn last_index(&self, pos: u64) -> u64 {
        (pos + 1) * u64::from(self.m.batch_size()) - 1
    }

    /// The units of `epoch` (the plan's tables are computed on this worker thread: O(shards)).
    fn load_epoch(&mut self, epoch: u32) {
        let (ep, units) = tokio::task::block_in_place(|| match &self.m.sampler {
            Sampler::One(plan) => {
                let ep = plan.order.epoch(epoch);
                let units = plan.units(&ep);
                (Some(Arc::new(ep)), units)
            }
            Sampler::Mix(m) => (None, m.units(epoch)),
        });
        self.epochs.push_back(EpochUnits {
            epoch,
            order: ep,
            units,
            next: 0,
            held: 0,
        });
    }

    /// The order of `epoch` (one dataset), loading it when needed.
    fn order_of(&mut self, epoch: u32) -> Option<Arc<EpochOrder>> {
        if let Some(e) = self.epochs.iter().find(|e| e.epoch == epoch) {
            return e.order.clone();
        }
        self.load_epoch(epoch);
        self.epochs.back().expect("just loaded").order.clone()
    }

    /// Whether this worker assembles a batch that needs unit `u` of `epoch`.
    fn needed(&self, epoch: u32, u: &Unit) -> bool {
        let b = u64::from(self.m.batch_size());
        let base = u64::from(epoch) * self.m.steps();
        let (first, last) = (base + u.first / b, base + u.last / b);
        let nw = u64::from(self.m.num_workers);
        let w = u64::from(self.m.worker);
        last >= self.pos && (last - first + 1 >= nw || (first..=last).any(|p| p % nw == w))
    }

    /// Issues units in first-use order while memory allows (at most two epochs ahead).
    fn issue_units(&mut self) -> Result<(), CloseReason> {
        let epochs = (self.end / self.m.steps()) as u32;
        self.load_epoch_of_pos();
        if self.epochs.is_empty() {
            return Ok(()); // past the end
        }
        loop {
            let Some(ei) = self.epochs.iter().position(|e| e.next < e.units.len()) else {
                self.drop_passed_epochs();
                let last = self.epochs.back().expect("not empty").epoch;
                if last + 1 < epochs && self.epochs.len() < 2 {
                    self.load_epoch(last + 1);
                    continue;
                }
                return Ok(());
            };
            let (epoch, unit) = {
                let e = &self.epochs[ei];
                (e.epoch, e.units[e.next].clone())
            };
            if !self.needed(epoch, &unit) {
                // A unit left half held (memory ran out) that the rank has since passed:
                // its held shards go back, and the next unit starts holding from its first.
                let e = &mut self.epochs[ei];
                let held = std::mem::take(&mut e.held);
                e.next += 1;
                self.unref(&unit.shards[..held]);
                continue;
            }
            let g = u64::from(epoch) * self.per_epoch;
            let needed_now = g + unit.first <= self.last_index(self.pos);
            if !self.hold(ei, &unit, needed_now)? {
                return Ok(());
            }
            self.live.push(Live {
                first: g + unit.first,
                last: g + unit.last,
                shards: unit.shards,
                epoch,
                unit: self.epochs[ei].next,
            });
            let e = &mut self.epochs[ei];
            (e.next, e.held) = (e.next + 1, 0);
        }
    }

    /// Loads the epoch of the next position where it is not loaded. A DataLoader worker whose
    /// next batch lies two or more epochs past the last one loaded (more workers than twice
    /// an epoch's steps) skipped every unit of the epochs between, and the two epochs loaded
    /// ahead never reached its own: its units were issued only after [`Driver::try_assemble`]
    /// had loaded it, a wake later (no read-ahead), and with no fetch out and no batch left to
    /// take, never. Epochs load in order and none is dropped before the next position's, so
    /// every epoch loaded while it is missing is older: first-use order is kept.
    fn load_epoch_of_pos(&mut self) {
        if self.pos >= self.end {
            return;
        }
        let (epoch, _) = self.s.kind().split(self.pos);
        if !self.epochs.iter().any(|e| e.epoch == epoch) {
            self.load_epoch(epoch);
        }
    }

    /// Holds the shards of `unit` (fetching the ones not resident); false when memory ran out
    /// first (the unit stays half held, and is finished on a later call).
    fn hold(&mut self, ei: usize, unit: &Unit, needed_now: bool) -> Result<bool, CloseReason> {
        let supply = Arc::clone(self.s.supply());
        while self.epochs[ei].held < unit.shards.len() {
            let shard = unit.shards[self.epochs[ei].held];
            if let Some(r) = self.resident.get_mut(&shard) {
                r.refs += 1;
                self.epochs[ei].held += 1;
                self.reserved.remove(&shard);
                continue;
            }
            let len = supply.manifest().shards[shard as usize].length as usize;
            let slab = match self.reserved.remove(&shard) {
                Some(slab) => Some(slab),
                None if !needed_now
                    && (self.gave_back_at == Some(self.pos)
                        || !room_for_prefetch(
                            supply.pool(),
                            len,
                            self.m.batch_bytes,
                            self.m.ready_ahead,
                        )) =>
                {
                    return Ok(false);
                }
                None => self.fetches.alloc(len),
            };
            let Some(slab) = slab else {
                if needed_now {
                    self.refuse_if_it_cannot_fit(Some(unit))?;
                    self.stuck = true;
                }
                return Ok(false);
            };
            self.resident.insert(
                shard,
                Resident {
                    slab: None,
                    refs: 1,
                },
            );
            self.epochs[ei].held += 1;
            self.fetches.fetch(Pending::of_shard(shard, slab))?;
        }
        Ok(true)
    }

    /// Closes the stream when the shards the next batch needs (those of the live units it
    /// reads and of `unit`) cannot fit the region beside the batch slabs: waiting would never
    /// end (a Megatron-order batch may read a shard per window; a batch may cross from one
    /// block into the next, in an epoch whose blocks fall otherwise than the first's). Where
    /// batch slabs have a part of their own, the reserve is that part: the stream's
    /// ready-ahead depth plus the held one ([`super::supply::batch_slots`], 3 to 9 slabs; the
    /// open check counts 3 and sets the depth from the first epoch's room), since shards are
    /// only ever taken from the rest ([`Part::Main`]) and the part cannot be given back while a
    /// slab lives. In a region too small to split, it is the held one and the guaranteed
    /// [`READY_AHEAD`](super::supply::READY_AHEAD): ready batches beyond those drain as the
    /// trainer takes them, and no more are assembled while the next batch's shards are
    /// missing.
    fn refuse_if_it_cannot_fit(&self, unit: Option<&Unit>) -> Result<(), CloseReason> {
        let upto = self.last_index(self.pos);
        let mut shards: Vec<u32> = self
            .live
            .iter()
            .filter(|l| l.first <= upto)
            .flat_map(|l| l.shards.iter().copied())
            .chain(unit.iter().flat_map(|u| u.shards.iter().copied()))
            .collect();
        shards.sort_unstable();
        shards.dedup();
        let m = self.s.supply().manifest();
        let class = |s: u32| SlabPool::class_size(m.shards[s as usize].length as usize) as u64;
        let need: u64 = shards.iter().map(|&s| class(s)).sum();
        let capacity_all = self.s.supply().pool().capacity() as u64;
        let (reserve, capacity) = match self.shard_part() {
            // Batch slabs have a part of their own: the rest is the shards'.
            Some(main) => (capacity_all - main as u64, capacity_all),
            None => (
                (super::supply::READY_AHEAD as u64 + 1)
                    * SlabPool::class_size(self.m.batch_bytes as usize) as u64,
                capacity_all,
            ),
        };
        if need + reserve > capacity {
            let why = CloseReason::DoesNotFit {
                shards: shards.len(),
                need,
                reserve,
                capacity,
            };
            tracing::error!(%why, "closing the stream");
            return Err(why);
        }
        Ok(())
    }

    /// A fetch ended: the shard is resident, or waits to be fetched again. One no unit holds
    /// any more (passed while its fetch was in flight) is dropped whatever its outcome: a
    /// failure fetched again could only cost refusals, and end the stream over a shard it
    /// does not need.
    fn completed(&mut self, c: Completion) -> Result<(), CloseReason> {
        let shard = c.shard;
        if !self.resident.contains_key(&shard) {
            self.fetches.forget(shard);
            return Ok(()); // its slab goes back with `c`
        }
        if let Some(slab) = self.fetches.sort(c)? {
            match self.resident.get_mut(&shard) {
                Some(r) => r.slab = Some(slab),
                None => drop(slab), // no unit holds it any more
            }
        }
        Ok(())
    }

    /// Assembles the next batch if its shards are resident and there is room; true if it did.
    fn try_assemble(&mut self) -> Result<bool, CloseReason> {
        if self.pos >= self.end || self.s.ready_count() >= self.m.ready_ahead {
            return Ok(false);
        }
        let (epoch, step) = self.s.kind().split(self.pos);
        let ep = self.order_of(epoch);
        let Some(plan) = self.plan_batch(ep.as_deref(), epoch, step) else {
            return Ok(false);
        };
        let supply = Arc::clone(self.s.supply());
        let bytes = plan.bytes as usize;
        // The batches' own part first; a batch past its slots (the trainer keeps several)
        // takes a free block among the shards, as before the parts.
        let batch_slab = || {
            supply
                .try_alloc_in(Part::Apart, bytes)
                .or_else(|| supply.try_alloc_in(Part::Main, bytes))
        };
        let mut out = batch_slab();
        // With no assembled batch waiting, only the trainer's held batches can come back, and
        // a trainer that waits for this one may hold them until then: the prefetched shards
        // go back first (their free bytes may be in blocks too small for a batch).
        if out.is_none() && self.s.ready_count() == 0 && self.give_back_prefetch() {
            out = batch_slab();
        }
        let Some(mut out) = out else {
            if self.s.ready_count() == 0 {
                self.refuse_if_it_cannot_fit(None)?;
            }
            return Ok(false);
        };
        let t = Instant::now();
        let resident = &self.resident;
        let slab_of = |shard: u32| resident[&shard].slab.as_ref().expect("checked resident");
        let gpu = self.s.gpu();
        // A host gather of a batch of at most INLINE_GATHER bytes runs on this worker (tens
        // of microseconds: handing the worker's core to another thread for it, tokio's
        // `block_in_place`, cost more CPU in wake-ups than the copy, docs/BENCHMARKS.md); a
        // larger one, or a CUDA gather (it waits for its launch, and for the engine a shard's
        // CRC may hold), still hands the worker off.
        let filled = if out.host_slice().is_some() && plan.bytes <= INLINE_GATHER {
            assemble::execute(&plan, slab_of, &mut out, gpu)
        } else {
            tokio::task::block_in_place(|| assemble::execute(&plan, slab_of, &mut out, gpu))
        };
        let c = self.s.supply().counters();
        match filled {
            Ok(how) => {
                if how == assemble::Filled::Gather {
                    c.batch_gather_launches.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(error) => {
                tracing::error!(%error, "assembling a batch failed; closing the stream");
                return Err(CloseReason::Assembly {
                    what: "a batch".into(),
                    error,
                });
            }
        }
        c.assembly_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.batches_assembled.fetch_add(1, Ordering::Relaxed);
        self.s.complete(
            self.pos,
            Ready {
                slab: out,
                tensors: Some(plan.views),
            },
        );
        self.pos += u64::from(self.m.num_workers);
        // Units that end before this worker's next batch are done with: the positions in
        // between are other workers' (a DataLoader worker's stream assembles every
        // `num_workers`-th batch), so holding them one batch longer would only take room
        // the next unit needs.
        self.release_through((self.pos * u64::from(self.m.batch_size())).saturating_sub(1));
        Ok(true)
    }

    /// The slab plan of the batch at `step` of `ep`, if every shard it reads is resident.
    fn plan_batch(&self, ep: Option<&EpochOrder>, epoch: u32, step: u64) -> Option<assemble::Plan> {
        let here = |shard: u32| self.resident.get(&shard).is_some_and(|r| r.slab.is_some());
        let samples: Vec<MixSample> = match (&self.m.sampler, ep) {
            (Sampler::One(plan), Some(ep)) => {
                let b = plan.batch_size;
                match self.m.tokens {
                    None => plan
                        .batch_samples(ep, step)
                        .into_iter()
                        .map(MixSample::Row)
                        .collect(),
                    Some(_) => (0..b)
                        .map(|j| MixSample::Window(plan.window(ep, step, j)))
                        .collect(),
                }
            }
            (Sampler::Mix(m), _) => {
                let global = u64::from(epoch) * m.steps + step;
                m.samples(global).into_iter().map(|(_, s)| s).collect()
            }
            (Sampler::One(_), None) => unreachable!("a one-dataset epoch has its order"),
        };
        if !samples.iter().flat_map(mix::shards_of).all(here) {
            return None;
        }
        let m = self.s.supply().manifest();
        let mut rows = Vec::new();
        let mut windows = Vec::new();
        for s in samples {
            match s {
                MixSample::Row(r) => rows.push(r),
                MixSample::Window(w) => windows.push(w),
            }
        }
        Some(match &self.m.tokens {
            None => assemble::plan(m, &rows),
            Some(t) => tokens::plan(m, t, &windows),
        })
    }

    /// Releases the units the rank has passed (their last sample is at or before `index`).
    fn release_through(&mut self, index: u64) {
        let (done, live): (Vec<Live>, Vec<Live>) = std::mem::take(&mut self.live)
            .into_iter()
            .partition(|l| l.last <= index);
        self.live = live;
        for l in done {
            self.unref(&l.shards);
        }
        self.drop_passed_epochs();
    }

    /// Drops the loaded epochs before the next position's whose units are all issued (all
    /// their positions are assembled), keeping one.
    fn drop_passed_epochs(&mut self) {
        let (epoch, _) = self
            .s
            .kind()
            .split(self.pos.min(self.end.saturating_sub(1)));
        while self.epochs.len() > 1
            && self
                .epochs
                .front()
                .is_some_and(|e| e.epoch < epoch && e.next >= e.units.len())
        {
            self.epochs.pop_front();
        }
    }

    /// Gives back the shards held ahead that the next batch does not read: those of a unit
    /// held halfway, then of the live units from the last while the next batch ends before
    /// their first sample (their epochs' cursors go back, so they are held again in turn).
    /// Room for prefetch is counted in bytes, and the slab pool is a buddy allocator: shards
    /// of a smaller class than the batches can leave no free block of the batch's class while
    /// nothing else can free one (no batch waiting, the trainer holding none), and the stream
    /// waited forever. True if it gave any back; nothing is then held ahead of the next batch
    /// until it is assembled ([`Driver::gave_back_at`]). Nothing goes back once the stream is
    /// closed: every slab is refused then, and the give-back was counted for nothing.
    fn give_back_prefetch(&mut self) -> bool {
        if self.s.supply().is_closed() {
            return false;
        }
        let upto = self.last_index(self.pos);
        let per_epoch = self.per_epoch;
        let mut back: Vec<u32> = Vec::new();
        for e in self.epochs.iter_mut().filter(|e| e.held > 0) {
            let u = &e.units[e.next];
            if u64::from(e.epoch) * per_epoch + u.first > upto {
                back.extend_from_slice(&u.shards[..e.held]);
                e.held = 0;
            }
        }
        while self.live.last().is_some_and(|l| l.first > upto) {
            let l = self.live.pop().expect("just seen");
            if let Some(e) = self.epochs.iter_mut().find(|e| e.epoch == l.epoch) {
                (e.next, e.held) = (e.next.min(l.unit), 0);
            }
            back.extend(l.shards);
        }
        if back.is_empty() {
            return false;
        }
        self.gave_back_at = Some(self.pos);
        tracing::debug!(
            shards = back.len(),
            "no free block for the next batch: prefetched shards given back"
        );
        self.s
            .supply()
            .counters()
            .prefetch_given_back
            .fetch_add(1, Ordering::Relaxed);
        self.unref(&back);
        true
    }

    /// Drops one unit's hold on each of `shards`; a shard no unit holds leaves the region.
    fn unref(&mut self, shards: &[u32]) {
        for s in shards {
            if let Some(r) = self.resident.get_mut(s) {
                r.refs -= 1;
                if r.refs == 0 {
                    self.resident.remove(s); // the slab returns to the region
                }
            }
        }
    }
}

mod repack;
#[cfg(test)]
mod tests;
