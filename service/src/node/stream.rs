//! Streams: one per trainer connection. Each has its own region (so a trainer never gets a
//! handle to another stream's memory), a deterministic plan, a fetcher task that keeps the
//! region full of fetch-ahead shards (credits = free slabs), a reorder buffer that delivers
//! in plan order, and the leases the trainer holds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use shardwire_gpu::{HostRegion, Region, Slab, SlabPool};
use shardwire_protocol::Manifest;
use shardwire_protocol::plan::PlanSpec;
use shardwire_protocol::trainer::{StreamState, TensorView};
use tokio::sync::{Notify, mpsc};

use super::Node;
use super::link::{FetchFailure, FetchOutcome, PendingFetch, SourceLink};

/// The result of `next`.
pub enum Next {
    /// A batch, now leased.
    Batch {
        /// Lease id.
        lease: u64,
        /// Epoch.
        epoch: u32,
        /// Index within the epoch.
        index: u64,
        /// Shard index.
        shard: u32,
        /// Tensors in the region.
        tensors: Vec<TensorView>,
    },
    /// All epochs delivered.
    End,
    /// Nothing within the timeout.
    Timeout,
    /// The stream was closed.
    Closed(String),
}

struct Inner {
    ready: BTreeMap<u64, Slab>,
    next: u64,
    leases: HashMap<u64, Slab>,
    closed: Option<String>,
}

/// A stream's state, shared by its trainer thread and its fetcher task.
pub struct StreamShared {
    /// Stream id.
    pub id: u64,
    /// Dataset name.
    pub dataset: String,
    /// Plan inputs.
    pub spec: PlanSpec,
    /// Epochs to deliver.
    pub epochs: u32,
    /// The manifest.
    pub manifest: Arc<Manifest>,
    /// The stream's region and allocator.
    pub pool: Arc<SlabPool>,
    /// Total positions (per_rank * epochs).
    pub total: u64,
    /// Fingerprint of the plan inputs.
    pub fingerprint: String,
    /// Bytes reserved from the node's pool budget.
    pub reserved: u64,
    /// Links whose manifest matches.
    pub candidates: Vec<Arc<SourceLink>>,
    inner: Mutex<Inner>,
    cv: Condvar,
    freed: Notify,
    /// Set while the fetcher waits for free memory.
    wants_memory: std::sync::atomic::AtomicBool,
    closed_notify: Notify,
    /// Per-rank shard order of the few epochs in use: (epoch, order).
    plans: Mutex<Vec<(u32, Vec<u32>)>>,
}

/// Inputs to [`StreamShared::new`].
pub struct StreamParams {
    /// Dataset.
    pub dataset: String,
    /// Plan.
    pub spec: PlanSpec,
    /// Epochs.
    pub epochs: u32,
    /// First position to deliver (resume).
    pub start: u64,
    /// Manifest.
    pub manifest: Arc<Manifest>,
    /// Region bytes.
    pub region_bytes: u64,
    /// Matching links.
    pub candidates: Vec<Arc<SourceLink>>,
    /// Fingerprint.
    pub fingerprint: String,
    /// The GPU to put the region on (`None`: host memory).
    pub cuda: Option<Arc<shardwire_gpu::cuda::CudaMemory>>,
}

impl StreamShared {
    /// Allocates the region and builds the stream (the fetcher is started separately).
    pub fn new(id: u64, p: StreamParams) -> Result<Arc<Self>, String> {
        let region: Region = match &p.cuda {
            None => HostRegion::new(&format!("shardwire-stream-{id}"), p.region_bytes as usize)
                .map_err(|e| e.to_string())?
                .into(),
            Some(gpu) => shardwire_gpu::cuda::VmmRegion::new(&gpu.device, p.region_bytes as usize)
                .map_err(|e| {
                    format!(
                        "a {}-byte CUDA region on GPU {}: {e}",
                        p.region_bytes, gpu.info.ordinal
                    )
                })?
                .into(),
        };
        let pool = SlabPool::new(region);
        let total = p.spec.per_rank() * u64::from(p.epochs);
        let s = Arc::new(Self {
            id,
            dataset: p.dataset,
            spec: p.spec,
            epochs: p.epochs,
            manifest: p.manifest,
            pool,
            total,
            fingerprint: p.fingerprint,
            reserved: p.region_bytes,
            candidates: p.candidates,
            inner: Mutex::new(Inner {
                ready: BTreeMap::new(),
                next: p.start,
                leases: HashMap::new(),
                closed: None,
            }),
            cv: Condvar::new(),
            freed: Notify::new(),
            wants_memory: std::sync::atomic::AtomicBool::new(false),
            closed_notify: Notify::new(),
            plans: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&s);
        s.pool.set_on_free(Arc::new(move || {
            // Only a fetcher waiting for memory needs waking: a release on a fully
            // prefetched stream then costs no cross-thread wake-up.
            if let Some(s) = weak.upgrade()
                && s.wants_memory.load(Ordering::SeqCst)
            {
                s.freed.notify_one();
            }
        }));
        Ok(s)
    }

    /// The shard at stream position `pos`.
    pub fn shard_at(&self, pos: u64) -> u32 {
        let per = self.spec.per_rank();
        let epoch = (pos / per) as u32;
        let at = (pos % per) as usize;
        let mut plans = self.plans.lock().expect("poisoned");
        if let Some((_, plan)) = plans.iter().find(|(e, _)| *e == epoch) {
            return plan[at];
        }
        if plans.len() > 4 {
            plans.retain(|(e, _)| *e + 1 >= epoch);
        }
        let plan = self.spec.rank_order(epoch);
        let shard = plan[at];
        plans.push((epoch, plan));
        shard
    }

    /// The state that resumes at the next undelivered batch.
    pub fn state(&self) -> StreamState {
        let next = self.inner.lock().expect("poisoned").next;
        self.state_at(next)
    }

    /// The state for position `pos`.
    pub fn state_at(&self, pos: u64) -> StreamState {
        let per = self.spec.per_rank();
        StreamState {
            epoch: (pos / per) as u32,
            index: pos % per,
            seed: self.spec.seed,
            fingerprint: self.fingerprint.clone(),
        }
    }

    /// Bytes leased to the trainer and ready for it.
    pub fn counts(&self) -> (usize, usize, u64) {
        let i = self.inner.lock().expect("poisoned");
        (i.ready.len(), i.leases.len(), i.next)
    }

    /// Closes the stream: drops ready batches and leases (freeing the region when the last
    /// in-flight slab returns), wakes everyone.
    pub fn close(&self, reason: &str) {
        let (ready, leases) = {
            let mut i = self.inner.lock().expect("poisoned");
            if i.closed.is_none() {
                i.closed = Some(reason.to_string());
            }
            (std::mem::take(&mut i.ready), std::mem::take(&mut i.leases))
        };
        drop((ready, leases));
        self.cv.notify_all();
        self.closed_notify.notify_one();
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        self.inner.lock().expect("poisoned").closed.is_some()
    }

    fn complete(&self, pos: u64, slab: Slab) {
        let mut i = self.inner.lock().expect("poisoned");
        if i.closed.is_some() {
            return;
        }
        i.ready.insert(pos, slab);
        drop(i);
        self.cv.notify_all();
    }

    /// Takes the next batch in plan order, waiting up to `timeout`.
    pub fn next(&self, node: &Node, timeout: Option<Duration>) -> Next {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut i = self.inner.lock().expect("poisoned");
        let mut waited_since: Option<Instant> = None;
        // The time a trainer waits for a batch that is not ready is a network stall.
        let account = |since: Option<Instant>| {
            if let Some(t) = since {
                node.counters
                    .stall_network_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        };
        loop {
            if let Some(r) = &i.closed {
                account(waited_since);
                return Next::Closed(r.clone());
            }
            if i.next >= self.total {
                account(waited_since);
                return Next::End;
            }
            let pos = i.next;
            if let Some(slab) = i.ready.remove(&pos) {
                account(waited_since);
                i.next += 1;
                let lease = node.next_id();
                let shard = self.shard_at(pos);
                let entry = &self.manifest.shards[shard as usize];
                let tensors = entry
                    .tensors
                    .iter()
                    .map(|t| TensorView {
                        name: t.name.clone(),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        offset: slab.offset() as u64 + entry.relative_offset(t),
                        length: t.length,
                    })
                    .collect();
                i.leases.insert(lease, slab);
                node.counters
                    .batches_delivered
                    .fetch_add(1, Ordering::Relaxed);
                let per = self.spec.per_rank();
                return Next::Batch {
                    lease,
                    epoch: (pos / per) as u32,
                    index: pos % per,
                    shard,
                    tensors,
                };
            }
            waited_since.get_or_insert_with(Instant::now);
            i = match deadline {
                None => self.cv.wait(i).expect("poisoned"),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        account(waited_since);
                        return Next::Timeout;
                    }
                    self.cv.wait_timeout(i, d - now).expect("poisoned").0
                }
            };
        }
    }

    /// A copy of `length` bytes at region offset `offset`, read from leased batch `lease`;
    /// None if this stream does not hold that lease or the range is not inside its slab.
    /// (The HTTP trainer API serves tensor bytes with this; the lock keeps the lease, and so
    /// the bytes, from being released while they are copied.)
    pub fn read_leased(&self, lease: u64, offset: u64, length: u64) -> Option<Vec<u8>> {
        let i = self.inner.lock().expect("poisoned");
        let slab = i.leases.get(&lease)?;
        let start = usize::try_from(offset).ok()?.checked_sub(slab.offset())?;
        slab.read(start, usize::try_from(length).ok()?).ok()
    }

    /// Ends a lease; false if unknown.
    pub fn release(&self, lease: u64) -> bool {
        self.take_lease(lease).is_some() // the slab drops here, after the lock
    }

    /// Ends a lease and hands back its slab, whose memory returns to the region when the
    /// caller drops it (the trainer socket does that after it has answered); None if unknown.
    pub fn take_lease(&self, lease: u64) -> Option<Slab> {
        self.inner.lock().expect("poisoned").leases.remove(&lease)
    }
}

struct Retry {
    pos: u64,
    shard: u32,
    slab: Slab,
    avoid: Option<usize>,
}

/// Keeps the stream's region full of fetch-ahead shards until the stream ends or closes.
pub async fn fetcher(node: Arc<Node>, s: Arc<StreamShared>, start: u64) {
    let (tx, mut rx) = mpsc::unbounded_channel::<FetchOutcome>();
    let mut next_issue = start;
    let mut retry: VecDeque<Retry> = VecDeque::new();
    let mut rr = 0usize;
    let mut starved_since: Option<Instant> = None;
    loop {
        if s.is_closed() {
            return;
        }
        while let Some(r) = retry.pop_front() {
            match issue(&node, &s, &tx, r, &mut rr) {
                Ok(()) => {}
                Err(r) => {
                    retry.push_front(r);
                    break;
                }
            }
        }
        while retry.is_empty() && next_issue < s.total {
            let shard = s.shard_at(next_issue);
            let len = s.manifest.shards[shard as usize].length as usize;
            // Announce the need before trying, so a free between the failed try and the
            // wait below leaves a permit instead of being missed.
            s.wants_memory.store(true, Ordering::SeqCst);
            let Some(slab) = s.pool.alloc(len) else {
                starved_since.get_or_insert_with(Instant::now);
                break;
            };
            s.wants_memory.store(false, Ordering::SeqCst);
            if let Some(t) = starved_since.take() {
                node.counters
                    .stall_trainer_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            let r = Retry {
                pos: next_issue,
                shard,
                slab,
                avoid: None,
            };
            next_issue += 1;
            if let Err(r) = issue(&node, &s, &tx, r, &mut rr) {
                retry.push_back(r);
            }
        }
        let idle = if retry.is_empty() {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(100)
        };
        tokio::select! {
            Some(o) = rx.recv() => match o.result {
                Ok(()) => {
                    metrics::histogram!("shardwire_fetch_duration_seconds").record(o.issued.elapsed().as_secs_f64());
                    s.complete(o.pos, o.slab);
                }
                Err(f) => {
                    node.counters.refetches.fetch_add(1, Ordering::Relaxed);
                    match &f {
                        FetchFailure::Crc { got, want } => tracing::warn!(shard = o.shard, got, want, "refetching after CRC mismatch"),
                        FetchFailure::Source(why) => tracing::warn!(shard = o.shard, %why, "refetching after source failure"),
                        FetchFailure::Cancelled => tracing::warn!(shard = o.shard, "refetching a fetch the source cancelled"),
                    }
                    retry.push_back(Retry { pos: o.pos, shard: o.shard, slab: o.slab, avoid: Some(o.source) });
                }
            },
            _ = s.freed.notified() => {}
            _ = s.closed_notify.notified() => return,
            _ = tokio::time::sleep(idle) => {}
        }
    }
}

fn issue(
    node: &Node,
    s: &StreamShared,
    tx: &mpsc::UnboundedSender<FetchOutcome>,
    r: Retry,
    rr: &mut usize,
) -> Result<(), Retry> {
    let n = s.candidates.len();
    // Round-robin over live candidates, avoiding the one that just failed when possible.
    let order: Vec<usize> = (0..n).map(|k| (*rr + k) % n).collect();
    let pick = order
        .iter()
        .copied()
        .find(|&i| s.candidates[i].is_up() && Some(s.candidates[i].index) != r.avoid)
        .or_else(|| order.iter().copied().find(|&i| s.candidates[i].is_up()));
    let Some(i) = pick else { return Err(r) };
    *rr = i + 1;
    let link = &s.candidates[i];
    let entry = &s.manifest.shards[r.shard as usize];
    let p = PendingFetch {
        issued: std::time::Instant::now(),
        req: 0,
        slab: r.slab,
        pos: r.pos,
        shard: r.shard,
        length: entry.length,
        crc32c: entry.crc32c,
        done: tx.clone(),
        source: link.index,
        stream: s.id,
    };
    let req = node.next_id();
    tracing::debug!(req, shard = r.shard, pos = r.pos, source = %link.addr, "FETCH");
    link.fetch(req, &s.dataset, p).map_err(|failed| {
        let (p, e) = *failed;
        if let super::link::SendError::Encode { .. } = e {
            // Names are checked when the stream opens, so this is a bug, not a retry.
            tracing::error!(error = %e, "cannot send a FETCH; closing the stream");
            s.close(&e.to_string());
        }
        Retry {
            pos: p.pos,
            shard: p.shard,
            slab: p.slab,
            avoid: r.avoid,
        }
    })
}
