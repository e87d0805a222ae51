//! What a stream delivers: one shard per batch (shard mode, the plan of
//! `shardwire_protocol::plan`), or batches of samples assembled in its region (batch mode,
//! `shardwire_protocol::samples`). Both number their batches by stream *position*
//! (`epoch * batches_per_epoch + index`); a DataLoader worker's batch-mode stream delivers
//! only the positions `≡ worker (mod num_workers)`, so its reorder buffer counts *slots*:
//! slot `k` is position `worker + k * num_workers`.

use std::sync::Arc;

use shardwire_protocol::samples::BatchPlan;
use shardwire_protocol::trainer::{StreamRequest, StreamState};

use super::layout::Layout;
use super::mix::Mixture;
use super::order::Order;
use super::tokens::TokenMode;

/// What a batch-mode stream draws its samples from.
#[derive(Debug)]
pub enum Sampler {
    /// One dataset: the rank's plan.
    One(BatchPlan),
    /// A mixture of datasets.
    Mix(Box<Mixture>),
}

/// Batch mode: the rank's plan, the sample layout and the batch slab's shape.
#[derive(Debug)]
pub struct BatchMode {
    /// Where the samples come from.
    pub sampler: Sampler,
    /// Seed of the request.
    pub seed: u64,
    /// Per-sample layout.
    pub layout: Arc<Layout>,
    /// The most bytes a batch slab takes.
    pub batch_bytes: u64,
    /// Which of the rank's batches this stream delivers: `worker` of `num_workers`.
    pub worker: u32,
    /// See `worker`.
    pub num_workers: u32,
    /// Token mode: samples are token windows.
    pub tokens: Option<TokenMode>,
    /// Assembled batches kept waiting for the trainer (`supply::ready_ahead`; set when the
    /// stream opens, from what its region holds besides the shards it reads).
    pub ready_ahead: usize,
}

impl BatchMode {
    /// The mode of `sampler` for request `r`: its layout or token windows set the batch size.
    pub fn new(
        sampler: Sampler,
        r: &StreamRequest,
        layout: Layout,
        tokens: Option<TokenMode>,
    ) -> Self {
        let b = match &sampler {
            Sampler::One(p) => p.batch_size,
            Sampler::Mix(m) => m.batch_size,
        };
        let batch_bytes = match &tokens {
            Some(t) => t.batch_bytes(b),
            None => layout.max_batch_bytes(b),
        };
        Self {
            sampler,
            seed: r.seed,
            layout: Arc::new(layout),
            batch_bytes,
            worker: r.worker,
            num_workers: r.num_workers,
            tokens,
            ready_ahead: super::supply::READY_AHEAD,
        }
    }

    /// Steps (batches per rank) per epoch.
    pub fn steps(&self) -> u64 {
        match &self.sampler {
            Sampler::One(p) => p.steps(),
            Sampler::Mix(m) => m.steps,
        }
    }

    /// Samples per rank per step.
    pub fn batch_size(&self) -> u32 {
        match &self.sampler {
            Sampler::One(p) => p.batch_size,
            Sampler::Mix(m) => m.batch_size,
        }
    }

    /// (rank, world size).
    pub fn ranks(&self) -> (u32, u32) {
        match &self.sampler {
            Sampler::One(p) => (p.rank, p.world_size),
            Sampler::Mix(m) => (m.rank, m.world_size),
        }
    }

    /// Samples per global step.
    pub fn global_batch(&self) -> u64 {
        let (_, w) = self.ranks();
        u64::from(self.batch_size()) * u64::from(w)
    }
}

/// The kind of a stream.
#[derive(Debug)]
pub enum Kind {
    /// One shard per batch.
    Shards(Order),
    /// Batches of samples.
    Batches(Arc<BatchMode>),
}

impl Kind {
    /// Batches per epoch for this rank.
    pub fn per_epoch(&self) -> u64 {
        match self {
            Self::Shards(o) => o.per_epoch(),
            Self::Batches(b) => b.steps(),
        }
    }

    /// (epoch, index) of position `pos`.
    pub fn split(&self, pos: u64) -> (u32, u64) {
        let per = self.per_epoch();
        ((pos / per) as u32, pos % per)
    }

    /// The position of (epoch, index).
    pub fn join(&self, epoch: u32, index: u64) -> u64 {
        u64::from(epoch) * self.per_epoch() + index
    }

    /// (stride, offset) between slots and positions: position = offset + slot * stride.
    fn slots(&self) -> (u64, u64) {
        match self {
            Self::Shards(_) => (1, 0),
            Self::Batches(b) => (u64::from(b.num_workers), u64::from(b.worker)),
        }
    }

    /// The position of slot `k`.
    pub fn position(&self, slot: u64) -> u64 {
        let (stride, off) = self.slots();
        off + slot * stride
    }

    /// The first slot at or after position `pos`.
    pub fn slot_at(&self, pos: u64) -> u64 {
        let (stride, off) = self.slots();
        pos.saturating_sub(off).div_ceil(stride)
    }

    /// (rank, world size, seed).
    pub fn who(&self) -> (u32, u32, u64) {
        match self {
            Self::Shards(o) => (o.spec.rank, o.spec.world_size, o.spec.seed),
            Self::Batches(b) => {
                let (rank, world) = b.ranks();
                (rank, world, b.seed)
            }
        }
    }

    /// The state that resumes at position `pos`.
    pub fn state_at(&self, pos: u64, fingerprint: &str) -> StreamState {
        let (epoch, index) = self.split(pos);
        let (_, _, seed) = self.who();
        let mut st = StreamState {
            epoch,
            index,
            seed,
            fingerprint: fingerprint.to_owned(),
            cursor: None,
            partitions: None,
            shuffle_block: None,
            mix: None,
        };
        if let Self::Batches(b) = self {
            st.cursor = Some(index * b.global_batch());
            match &b.sampler {
                Sampler::One(p) => {
                    let o = &p.order;
                    st.partitions = Some(o.partitions);
                    // Saved in every order: it is in the fingerprint in every order, and a
                    // state without it resumed only with the default.
                    st.shuffle_block = Some(o.shuffle_block);
                }
                Sampler::Mix(m) => st.mix = Some(m.state(pos)),
            }
        }
        st
    }
}
