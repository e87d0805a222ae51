//! Streams: one per trainer. Each has its own region (a trainer never gets a handle to
//! another stream's memory), a deterministic plan ([`kind`]: shards by [`order`], or batches
//! of samples), a fetch side ([`supply`]) that a task keeps busy ([`fetcher`] in shard mode,
//! [`batcher`] in batch mode, assembling batches with [`assemble`]), a reorder buffer that
//! delivers in plan order ([`reorder`]), and the leases its trainer holds.
//!
//! [`Stream`] is the trainer side and the whole interface the fronts (the trainer socket, the
//! HTTP API) use: `next`, `release`, `state`, reading a leased tensor, and what to tell the
//! trainer. Opening one is checked in [`open`] ([`open_mix`] for mixtures); a refusal is an
//! [`OpenError`], the end of an open stream a [`CloseReason`].

pub(crate) mod affinity;
pub(crate) mod assemble;
pub(crate) mod batcher;
pub(crate) mod error;
pub(crate) mod fetcher;
pub(crate) mod hints;
pub(crate) mod kind;
pub(crate) mod layout;
pub(crate) mod manifests;
pub(crate) mod mix;
pub(crate) mod open;
pub(crate) mod open_mix;
pub(crate) mod order;
pub(crate) mod peak;
pub(crate) mod placement;
pub(crate) mod prefetch;
pub(crate) mod reorder;
pub(crate) mod route;
pub(crate) mod schedules;
pub(crate) mod supervise;
pub(crate) mod supply;
pub(crate) mod tokens;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use shardwire_gpu::cuda::CudaMemory;
use shardwire_gpu::{Region, Slab, SlabPool};
use shardwire_protocol::Manifest;
use shardwire_protocol::trainer::{StreamState, TensorView};
use tokio::sync::Notify;

pub use self::error::{CloseReason, OpenError};
use self::kind::Kind;
use self::reorder::Reorder;
pub(crate) use self::route::Routing;
pub(crate) use self::supply::DatasetSource;
use self::supply::Supply;
use crate::counters::Counters;
use crate::link::SourceLink;

/// The result of `next`.
#[derive(Debug)]
pub enum Next {
    /// A batch, now leased.
    Batch(Batch),
    /// All epochs delivered.
    End,
    /// Nothing within the timeout.
    Timeout,
    /// The stream was closed.
    Closed(CloseReason),
}

/// A leased batch.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Lease id.
    pub lease: u64,
    /// Epoch.
    pub epoch: u32,
    /// Index within the epoch.
    pub index: u64,
    /// Shard index.
    pub shard: u32,
    /// Tensors in the region.
    pub tensors: Vec<TensorView>,
}

/// A stream as the admin API lists it.
#[derive(Debug, Clone, Serialize)]
pub struct StreamInfo {
    /// Stream id.
    pub id: u64,
    /// The lane it is served on.
    pub lane: u32,
    /// Dataset.
    pub dataset: String,
    /// Rank.
    pub rank: u32,
    /// World size.
    pub world_size: u32,
    /// Seed.
    pub seed: u64,
    /// Epochs to deliver.
    pub epochs: u32,
    /// Batches per epoch for this rank.
    pub batches_per_epoch: u64,
    /// Positions delivered so far (the next one to deliver), at most `total` (a DataLoader
    /// worker's next slot after its last batch lies past the end).
    pub delivered: u64,
    /// Positions in all epochs.
    pub total: u64,
    /// Batches received and waiting for the trainer.
    pub ready: usize,
    /// Batch mode: the most assembled batches kept waiting for the trainer (2 to 8, as the
    /// region allows: `supply::ready_ahead`); absent in shard mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_ahead: Option<usize>,
    /// Batches leased to the trainer.
    pub leased: usize,
    /// Region size.
    pub region_bytes: usize,
    /// Region bytes holding shards.
    pub region_used: usize,
    /// Where it would resume.
    pub state: StreamState,
    /// Why it was closed, once it was: a closed stream whose trainer maps its region stays
    /// listed (and holds its memory budget) until that trainer disconnects.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub closed: Option<String>,
}

/// A batch ready for its trainer: its slab, and (batch mode, and shard mode for shards
/// with row tables) its tensors with offsets relative to the slab (otherwise shard mode
/// derives them from the manifest).
#[derive(Debug)]
pub struct Ready {
    /// The memory.
    pub slab: Slab,
    /// Batch mode: the tensors.
    pub tensors: Option<Vec<TensorView>>,
}

/// `shard` of a batch that holds samples of many shards (batch mode).
pub const NO_SHARD: u32 = u32::MAX;

/// A `next` with `count` adds a ready batch to its answer only while the leased slabs, that
/// batch's included, take at most 1/N of the stream's region ([`Stream::next_within_room`]).
pub const ANSWER_LEASE_SHARE: usize = 4;

/// Whether a slab of `adding` bytes leased beside `leased` bytes of slabs keeps the leases
/// within 1/[`ANSWER_LEASE_SHARE`] of a region of `capacity` bytes.
fn leases_fit(leased: usize, adding: usize, capacity: usize) -> bool {
    leased.saturating_add(adding) <= capacity / ANSWER_LEASE_SHARE
}

struct Inner {
    /// Ready batches by slot.
    reorder: Reorder<Ready>,
    /// Shared with an HTTP tensor copy in progress ([`Stream::read_leased`]): a release
    /// during it frees the memory when the copy ends.
    leases: HashMap<u64, Arc<Slab>>,
    closed: Option<CloseReason>,
}

/// What a stream is made of (see [`open`]).
pub struct Parts {
    /// Stream id.
    pub id: u64,
    /// Dataset.
    pub dataset: String,
    /// Shard or batch mode, with its plan.
    pub kind: Kind,
    /// Epochs.
    pub epochs: u32,
    /// First position to deliver (resume).
    pub start: u64,
    /// The manifest.
    pub manifest: Arc<Manifest>,
    /// The region's allocator.
    pub pool: Arc<SlabPool>,
    /// The datasets the shards come from (one; several for a mixture).
    pub sources: Vec<DatasetSource>,
    /// The node's sources and placements.
    pub routing: Arc<Routing>,
    /// Fingerprint of the plan inputs.
    pub fingerprint: String,
    /// The node's counters.
    pub counters: Arc<Counters>,
    /// The node's id source (leases).
    pub ids: Arc<AtomicU64>,
    /// The GPU of a CUDA region (assembly launches the gather kernel on it).
    pub gpu: Option<Arc<CudaMemory>>,
    /// The lane it is served on.
    pub lane: u32,
}

/// A stream's trainer side, shared by its trainer's front and its task.
pub struct Stream {
    id: u64,
    dataset: String,
    kind: Kind,
    epochs: u32,
    total: u64,
    fingerprint: String,
    supply: Arc<Supply>,
    manifest: Arc<Manifest>,
    pool: Arc<SlabPool>,
    counters: Arc<Counters>,
    ids: Arc<AtomicU64>,
    gpu: Option<Arc<CudaMemory>>,
    lane: u32,
    inner: Mutex<Inner>,
    cv: Condvar,
    closed_notify: Notify,
    /// Woken when the trainer takes a batch (a batch-mode task may assemble the next).
    taken: Notify,
    /// A trainer maps the region (the socket passed it its fd): the region's memory is in use
    /// until that trainer goes, closed or not.
    mapped: AtomicBool,
}

impl Stream {
    /// Builds the stream (its task is started separately).
    pub fn new(p: Parts) -> Arc<Self> {
        if let Kind::Batches(m) = &p.kind {
            // Batch slabs in a part of their own: coming and going, they never split the
            // blocks the shards need (the pool is new: nothing is allocated yet).
            let class = SlabPool::class_size(m.batch_bytes as usize);
            p.pool
                .set_apart(supply::batch_slots(m.ready_ahead).saturating_mul(class));
        }
        let total = p.kind.per_epoch() * u64::from(p.epochs);
        let (first, slots) = (p.kind.slot_at(p.start), p.kind.slot_at(total));
        let supply = Supply::new(
            p.id,
            p.lane as u16,
            Arc::clone(&p.manifest),
            Arc::clone(&p.pool),
            (p.sources, p.routing),
            Arc::clone(&p.counters),
            Arc::clone(&p.ids),
        );
        Arc::new(Self {
            id: p.id,
            dataset: p.dataset,
            kind: p.kind,
            epochs: p.epochs,
            total,
            fingerprint: p.fingerprint,
            supply,
            manifest: p.manifest,
            pool: p.pool,
            counters: p.counters,
            ids: p.ids,
            gpu: p.gpu,
            lane: p.lane,
            inner: Mutex::new(Inner {
                reorder: Reorder::new(first, slots),
                leases: HashMap::new(),
                closed: None,
            }),
            cv: Condvar::new(),
            closed_notify: Notify::new(),
            taken: Notify::new(),
            mapped: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stream id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The dataset.
    pub fn dataset(&self) -> &str {
        &self.dataset
    }

    /// Batches per epoch for this rank.
    pub fn batches_per_epoch(&self) -> u64 {
        self.kind.per_epoch()
    }

    /// Shard or batch mode, with the plan.
    pub(crate) fn kind(&self) -> &Kind {
        &self.kind
    }

    /// Epochs to deliver.
    pub fn epochs(&self) -> u32 {
        self.epochs
    }

    /// Positions in all epochs.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// The fetch side.
    pub(crate) fn supply(&self) -> &Arc<Supply> {
        &self.supply
    }

    /// The GPU of a CUDA region.
    pub(crate) fn gpu(&self) -> Option<&CudaMemory> {
        self.gpu.as_deref()
    }

    /// The lane it is served on.
    pub fn lane(&self) -> u32 {
        self.lane
    }

    /// Resolves when the stream is closed (its task then ends).
    pub(crate) async fn closed(&self) {
        self.closed_notify.notified().await;
    }

    /// Resolves when the trainer takes a batch.
    pub(crate) async fn taken(&self) {
        self.taken.notified().await;
    }

    /// The stream's region (shared with its trainer).
    pub fn region(&self) -> &Region {
        self.pool.region()
    }

    /// Ready batches not yet taken.
    pub(crate) fn ready_count(&self) -> usize {
        self.lock().reorder.held()
    }

    /// The next batch, leased, when it is ready now and its slab with those already leased
    /// takes at most 1/[`ANSWER_LEASE_SHARE`] of the region; None otherwise (nothing is
    /// waited for). A `next` with `count` adds ready batches to its answer with this: the
    /// trainer keeps an answer's batches leased until its next request, and in shard mode a
    /// few large shards would otherwise hold the region and stop the fetch-ahead. The batch
    /// added is counted (checking the leases before it let one answer lease a slab past the
    /// share), and so is the answer's first, from [`Self::next`] (not checked): beside the
    /// batch the trainer still holds, an answer carries `k` batches only when they are at most
    /// 1/(4(k + 1)) of the region each: `count` 8 needs about 1/36, and 8 ready at 1/16 each
    /// give 3. Batch mode keeps more than 2 batches ready only while they take at most 1/16
    /// of the region together (`supply::ready_ahead`), so there this rarely limits: with 2
    /// kept ready (batches above about 1/48 of the region each), it cuts an answer's second
    /// batch for batches above 1/12 each, and later ones (assembled while the answer is
    /// written) sooner.
    pub fn next_within_room(&self) -> Option<Batch> {
        let mut i = self.lock();
        if i.closed.is_some() {
            return None;
        }
        let adding = i.reorder.peek()?.slab.capacity();
        let leased: usize = i.leases.values().map(|s| s.capacity()).sum();
        if !leases_fit(leased, adding, self.pool.capacity()) {
            return None;
        }
        let (slot, ready) = i.reorder.take()?;
        Some(self.deliver(&mut i, slot, ready))
    }

    /// Every source link of the node.
    pub(crate) fn links(&self) -> Vec<Arc<SourceLink>> {
        self.supply.links()
    }

    /// The state that resumes at the next undelivered batch.
    pub fn state(&self) -> StreamState {
        let next = self.lock().reorder.next();
        self.state_at(self.kind.position(next))
    }

    /// The state that resumes right after the batch at (`epoch`, `index`): at this stream's
    /// next batch (a DataLoader worker's stream skips the other workers' batches).
    pub fn state_after(&self, epoch: u32, index: u64) -> StreamState {
        let slot = self.kind.slot_at(self.kind.join(epoch, index));
        self.state_at(self.kind.position(slot + 1))
    }

    /// The state that resumes at stream position `pos`. After the last batch a DataLoader
    /// worker's state names its first index in the epoch after (`epochs`, `worker`), which
    /// resumes to nothing; where an epoch has fewer batches than workers that index would lie
    /// past the epoch (or the next slot several epochs on), so the state names the epoch's
    /// last index instead, which resumes to nothing just the same.
    pub fn state_at(&self, pos: u64) -> StreamState {
        let per = self.kind.per_epoch();
        let last = (per * u64::from(self.epochs) + per).saturating_sub(1);
        self.kind.state_at(pos.min(last), &self.fingerprint)
    }

    /// The stream position of (epoch, index).
    pub fn position(&self, epoch: u32, index: u64) -> u64 {
        self.kind.join(epoch, index)
    }

    /// What the admin API shows.
    pub fn info(&self) -> StreamInfo {
        let (ready, leased, next, closed) = {
            let i = self.lock();
            let closed = i.closed.as_ref().map(ToString::to_string);
            (i.reorder.held(), i.leases.len(), i.reorder.next(), closed)
        };
        let (rank, world_size, seed) = self.kind.who();
        let next = self.kind.position(next);
        StreamInfo {
            id: self.id,
            lane: self.lane,
            dataset: self.dataset.clone(),
            rank,
            world_size,
            seed,
            epochs: self.epochs,
            batches_per_epoch: self.kind.per_epoch(),
            delivered: next.min(self.total),
            total: self.total,
            ready,
            ready_ahead: match &self.kind {
                Kind::Batches(m) => Some(m.ready_ahead),
                Kind::Shards(_) => None,
            },
            leased,
            region_bytes: self.pool.capacity(),
            region_used: self.pool.used(),
            state: self.state_at(next),
            closed,
        }
    }

    /// Closes the stream: drops ready batches and leases (freeing the region when the last
    /// in-flight slab returns), wakes everyone.
    pub(crate) fn close(&self, reason: CloseReason) {
        // First: the stream's task, which may be allocating right now, gets none of the
        // blocks the leases below give back (a mapped trainer may still read them).
        self.supply().close();
        let (ready, leases) = {
            let mut i = self.lock();
            if i.closed.is_none() {
                i.closed = Some(reason);
            }
            (i.reorder.clear(), std::mem::take(&mut i.leases))
        };
        drop((ready, leases));
        self.cv.notify_all();
        self.closed_notify.notify_one();
    }

    /// Records that a trainer maps the region from now on (see [`Stream::mapped`]).
    pub fn mark_mapped(&self) {
        self.mapped.store(true, Ordering::Release);
    }

    /// True once a trainer maps the region: its memory is that trainer's until it goes, so
    /// closing the stream does not return its budget ([`crate::Node::close_stream`]).
    pub fn mapped(&self) -> bool {
        self.mapped.load(Ordering::Acquire)
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// Why the stream was closed, if it was (closing drops its leases: a trainer releasing
    /// one afterwards is told this, not that the lease is unknown).
    pub fn closed_reason(&self) -> Option<CloseReason> {
        self.lock().closed.clone()
    }

    /// A batch for position `pos` (dropped if the stream no longer waits for it).
    pub(crate) fn complete(&self, pos: u64, ready: Ready) {
        let mut i = self.lock();
        if i.closed.is_some() {
            return;
        }
        let accepted = i.reorder.insert(self.kind.slot_at(pos), ready).is_ok();
        drop(i);
        if accepted {
            self.cv.notify_all();
        }
    }

    /// Takes the next batch in plan order, waiting up to `timeout` (`None`: forever).
    pub fn next(&self, timeout: Option<Duration>) -> Next {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut i = self.lock();
        let mut waited_since: Option<Instant> = None;
        // The time a trainer waits for a batch that is not ready is a network stall.
        let account = |since: Option<Instant>| {
            if let Some(t) = since {
                self.counters
                    .stall_network_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        };
        loop {
            if let Some(r) = &i.closed {
                account(waited_since);
                return Next::Closed(r.clone());
            }
            if i.reorder.done() {
                account(waited_since);
                return Next::End;
            }
            if let Some((slot, ready)) = i.reorder.take() {
                account(waited_since);
                return Next::Batch(self.deliver(&mut i, slot, ready));
            }
            waited_since.get_or_insert_with(Instant::now);
            i = match deadline {
                None => self.cv.wait(i).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        account(waited_since);
                        return Next::Timeout;
                    }
                    self.cv
                        .wait_timeout(i, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Leases `ready`, the batch of `slot` just taken from the reorder buffer of `i` (this
    /// stream's, locked), and counts it delivered.
    fn deliver(&self, i: &mut Inner, slot: u64, ready: Ready) -> Batch {
        let batch = self.lease(self.kind.position(slot), &ready);
        i.leases.insert(batch.lease, Arc::new(ready.slab));
        if matches!(self.kind, Kind::Batches(_)) {
            self.taken.notify_one();
        }
        self.counters
            .batches_delivered
            .fetch_add(1, Ordering::Relaxed);
        batch
    }

    /// The description of the batch at `pos`, held in `ready`.
    fn lease(&self, pos: u64, ready: &Ready) -> Batch {
        let base = ready.slab.offset() as u64;
        let (shard, tensors) = match (&self.kind, &ready.tensors) {
            (Kind::Shards(order), Some(views)) => {
                let views = views.iter().map(|t| TensorView {
                    offset: base + t.offset,
                    ..t.clone()
                });
                (order.shard_at(pos), views.collect())
            }
            (Kind::Shards(order), None) => {
                let shard = order.shard_at(pos);
                let entry = &self.manifest.shards[shard as usize];
                let views = entry
                    .tensors
                    .iter()
                    .map(|t| TensorView {
                        name: t.name.clone(),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        offset: base + entry.relative_offset(t),
                        length: t.length,
                    })
                    .collect();
                (shard, views)
            }
            (Kind::Batches(_), views) => {
                let views = views.iter().flatten().map(|t| TensorView {
                    offset: base + t.offset,
                    ..t.clone()
                });
                (NO_SHARD, views.collect())
            }
        };
        let (epoch, index) = self.kind.split(pos);
        Batch {
            lease: self.ids.fetch_add(1, Ordering::Relaxed) + 1,
            epoch,
            index,
            shard,
            tensors,
        }
    }

    /// A copy of `length` bytes at region offset `offset`, read from leased batch `lease`;
    /// None if this stream does not hold that lease or the range is not inside its slab.
    /// (The HTTP trainer API serves tensor bytes with this. The copy runs outside the
    /// stream's lock, which the node's runtime threads take: it holds the slab itself, so
    /// a release meanwhile frees the memory only when the copy is done.)
    pub fn read_leased(&self, lease: u64, offset: u64, length: u64) -> Option<Vec<u8>> {
        let slab = Arc::clone(self.lock().leases.get(&lease)?);
        let start = usize::try_from(offset).ok()?.checked_sub(slab.offset())?;
        slab.read(start, usize::try_from(length).ok()?).ok()
    }

    /// Whether the stream holds lease `lease` still (a closed stream holds none).
    pub fn holds_lease(&self, lease: u64) -> bool {
        self.lock().leases.contains_key(&lease)
    }

    /// Ends a lease; false if unknown.
    pub fn release(&self, lease: u64) -> bool {
        self.take_lease(lease).is_some() // the slab drops here, after the lock
    }

    /// Ends a lease and hands back its slab, whose memory returns to the region when the
    /// caller drops it (the trainer socket does that after it has answered); None if unknown.
    pub fn take_lease(&self, lease: u64) -> Option<Arc<Slab>> {
        self.lock().leases.remove(&lease)
    }
}

#[cfg(test)]
mod tests;
