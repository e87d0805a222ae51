//! Sample-level order (DESIGN §10): which sample every rank takes at every step, as a pure
//! function of (dataset digest, shard sizes, seed, epoch, shuffle, shuffle_block, partitions),
//! never of the world size, with no per-sample arrays (memory grows with shards).
//!
//! One epoch ([`EpochOrder`]):
//! 1. The shards are permuted (`shards`, `block`; storage order for `none`) and their samples
//!    laid end to end: the sequence X of all N samples.
//! 2. X is cut into `partitions` contiguous ranges at `N*c/C`; a shard that straddles a cut is
//!    split between two partitions.
//! 3. Each partition is cut into blocks at shard boundaries: `block` closes a block once it
//!    holds at least `shuffle_block` samples and shuffles the block's samples with a keyed
//!    bijection; `shards` and `none` make every shard (piece) a block, in row order.
//! 4. The global sequence G interleaves the partitions round robin: `G[t]` is sample `t / C`
//!    of partition `t % C` for `t < C*q` (q = the shortest partition's length); the few samples
//!    left in the longer partitions follow.
//!
//! Ranks and steps ([`BatchPlan`]): global step s takes positions `[s*GB, (s+1)*GB)` of G,
//! GB = `batch_size * world_size`; rank r takes the positions `t ≡ r (mod world_size)`, in
//! order. So a step's set of samples depends only on GB, and a world size that divides the
//! partitions (or is a multiple of them) gives each rank whole partitions (or each partition
//! to a fixed group of ranks): its shards cross the network to one rank. `drop_last` ends the
//! epoch after `N / GB` steps (fewer than GB samples dropped); otherwise after `ceil(N / GB)`,
//! the last step completed with samples from the start of the epoch's order.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::bijection::{Bijection, mix};

pub mod megatron;
pub mod mix;
mod windows;

pub use windows::{TokenPiece, WindowSpec};

/// How samples are ordered within an epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Shuffle {
    /// Storage order: shards in manifest order, rows in order.
    None,
    /// Shard order shuffled per epoch, rows in order.
    Shards,
    /// Shards shuffled, and samples shuffled within blocks of about `shuffle_block`.
    #[default]
    Block,
}

impl Shuffle {
    /// The name used in requests and fingerprints.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Shards => "shards",
            Self::Block => "block",
        }
    }
}

/// Most canonical partitions a plan has: an epoch's order holds a few words per partition,
/// and a trainer's request must not size the node's memory (a request that names no
/// `partitions` on a world size beyond this, or beyond the samples, gets the world size's
/// largest divisor within both: the node's `default_partitions`).
pub const MAX_PARTITIONS: u32 = 1 << 20;

/// `partitions` is 1..=min(`samples`, [`MAX_PARTITIONS`]).
fn partitions_ok(partitions: u32, samples: u64) -> bool {
    (1..=MAX_PARTITIONS).contains(&partitions) && u64::from(partitions) <= samples
}

/// Why a sample plan cannot be made; each names the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    /// `partitions` is 0, more than there are samples, or over [`MAX_PARTITIONS`].
    #[error(
        "partitions is {partitions}; it must be between 1 and the dataset's {samples} samples, \
         and at most {MAX_PARTITIONS}"
    )]
    Partitions {
        /// Requested.
        partitions: u32,
        /// Samples in the dataset.
        samples: u64,
    },
    /// `shuffle_block` is 0.
    #[error("shuffle_block must be at least 1 sample")]
    ShuffleBlock,
    /// `batch_size` is 0.
    #[error("batch_size must be at least 1")]
    BatchSize,
    /// world size 0 or rank outside it.
    #[error("rank {rank} is not below world_size {world_size}")]
    Rank {
        /// Rank.
        rank: u32,
        /// World size.
        world_size: u32,
    },
    /// The world size neither divides the partitions nor is a multiple of them.
    #[error(
        "world_size {world_size} does not fit partitions {partitions}: it must divide them or be a multiple of them (open the stream with partitions set to a multiple of every world size you will resume on)"
    )]
    DoesNotFit {
        /// World size.
        world_size: u32,
        /// Partitions.
        partitions: u32,
    },
    /// With `drop_last`, the dataset is smaller than one global batch.
    #[error(
        "drop_last with {samples} samples and a global batch of {global_batch} (batch_size x world_size) leaves no batch"
    )]
    NothingLeft {
        /// Samples.
        samples: u64,
        /// Global batch.
        global_batch: u64,
    },
    /// `seq_len` is 0, or too long for a window's int32 token positions.
    #[error(
        "seq_len is {seq_len}; it must be at least 1 and below {max} (a window's token positions are int32); pick a seq_len in that range",
        max = i32::MAX
    )]
    SeqLen {
        /// Requested.
        seq_len: u64,
    },
    /// Not one window of `seq_len + 1` tokens in the dataset.
    #[error(
        "the dataset's {tokens} tokens hold no window of seq_len + 1 = {} tokens; lower seq_len",
        seq_len + 1
    )]
    TooFewTokens {
        /// Tokens in the dataset.
        tokens: u64,
        /// Requested.
        seq_len: u64,
    },
    /// A limit of `order = "megatron"`.
    #[error("order \"megatron\": {0}")]
    MegatronLimit(String),
    /// A shard with more samples than the plan can index.
    #[error("the dataset has {0} shards; at most {max}", max = u32::MAX)]
    TooManyShards(usize),
    /// The shards' sample counts add up past 2^64 - 1 (a manifest's tensors of zero-byte rows
    /// can claim any row count).
    #[error(
        "the dataset's {shards} shards hold more than 2^64 - 1 samples together; a shard's row count (its tensors' first dimension) is wrong"
    )]
    TooManySamples {
        /// Shards in the dataset.
        shards: usize,
    },
}

/// One sample: a row of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleRef {
    /// Shard index in the manifest.
    pub shard: u32,
    /// Row within the shard.
    pub row: u64,
}

/// The epoch-independent inputs of the order.
#[derive(Debug)]
pub struct SampleOrder {
    digest: [u8; 32],
    shard_samples: Vec<u64>,
    /// Samples: rows, or token windows when `windows` is set.
    total: u64,
    /// Token windows over the rows (documents), if a sample is a window.
    windows: Option<windows::WindowSpec>,
    /// Seed.
    pub seed: u64,
    /// Shuffle mode.
    pub shuffle: Shuffle,
    /// Block size in samples (`block` mode).
    pub shuffle_block: u64,
    /// Canonical partitions.
    pub partitions: u32,
    /// How a `block` shuffle keys each block's permutation.
    pub block_keys: BlockKeys,
}

/// How a `block` shuffle keys the permutation of each block's samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BlockKeys {
    /// By the block's index in the epoch: every block's own permutation.
    #[default]
    Global,
    /// By its partition's first block plus its offset in samples (orders saved before
    /// `block_keys` was in the fingerprint): blocks of different partitions could share one,
    /// and a state saved then resumes with it ([`BlockKeys::of_state`]).
    Legacy,
}

impl BlockKeys {
    /// The fingerprint field that names [`BlockKeys::Global`] (a fingerprint without it was
    /// saved with [`BlockKeys::Legacy`]).
    pub const FIELD: &'static str = "block_keys=global";

    /// The keys a resume state's fingerprint was saved with: legacy where its order shuffled
    /// blocks (`shuffle=block`, a field that ends with it) and it names no keys. `prefix`
    /// scopes both fields (a mixture's dataset: `NAME.`).
    pub fn of_state(fingerprint: &str, prefix: &str) -> Self {
        let has = |field: &str| {
            fingerprint
                .split(';')
                .any(|kv| kv.strip_prefix(prefix) == Some(field))
        };
        if has("shuffle=block") && !has(Self::FIELD) {
            Self::Legacy
        } else {
            Self::Global
        }
    }
}

/// A block: a contiguous range of X inside one partition.
#[derive(Clone, Copy, Debug)]
struct Block {
    /// Start in X.
    start: u64,
    /// Samples.
    len: u64,
    /// Index of the first permuted shard overlapping it.
    first_shard: u32,
    /// Past the last permuted shard overlapping it.
    end_shard: u32,
}

/// Document-level blocks of a window-mode epoch.
#[derive(Debug)]
struct DocLevel {
    /// The blocks of the documents laid end to end (one partition).
    blocks: Vec<Block>,
    /// `tok[k]`: tokens before block k (`len = blocks + 1`).
    tok: Vec<u64>,
    /// Recently used blocks' token prefixes in shuffled document order.
    cache: std::sync::Mutex<std::collections::VecDeque<(u32, Arc<Vec<u64>>)>>,
}

/// One partition's place in X and its blocks.
#[derive(Clone, Copy, Debug)]
struct Part {
    start: u64,
    len: u64,
    /// Its blocks: `blocks[first_block..end_block]`.
    first_block: u32,
    end_block: u32,
}

/// The order of one epoch.
#[derive(Debug)]
pub struct EpochOrder {
    order: Arc<SampleOrder>,
    epoch: u32,
    /// Permuted shard order.
    perm: Vec<u32>,
    /// `prefix[k]`: samples before permuted shard k (`len = shards + 1`).
    prefix: Vec<u64>,
    parts: Vec<Part>,
    blocks: Vec<Block>,
    /// The shortest partition's length.
    q: u64,
    /// Partitions longer than q, in order.
    long: Vec<u32>,
    key: u64,
    /// Window mode: the documents' blocks (`parts` and `blocks` are then in window space).
    docs: Option<DocLevel>,
    /// Megatron order: GPTDataset's indices (`blocks` are units of items, their shard
    /// ranges index `unit_shards`).
    megatron: Option<windows::MegatronEpoch>,
}

/// Where partition `i` of `c` starts in `total` items: `total * i / c`, computed in 128 bits
/// (`total * i` passes 2^64 for a large dataset cut into many partitions: partitions would
/// overlap).
pub(crate) fn cut_at(total: u64, i: u64, c: u64) -> u64 {
    (u128::from(total) * u128::from(i) / u128::from(c.max(1))) as u64
}

impl SampleOrder {
    /// The order of a dataset whose shards hold `shard_samples` samples.
    pub fn new(
        digest: [u8; 32],
        shard_samples: Vec<u64>,
        seed: u64,
        shuffle: Shuffle,
        shuffle_block: u64,
        partitions: u32,
    ) -> Result<Self, SampleError> {
        if u32::try_from(shard_samples.len()).is_err() {
            return Err(SampleError::TooManyShards(shard_samples.len()));
        }
        let total = shard_samples
            .iter()
            .try_fold(0u64, |a, &n| a.checked_add(n))
            .ok_or(SampleError::TooManySamples {
                shards: shard_samples.len(),
            })?;
        if !partitions_ok(partitions, total) {
            return Err(SampleError::Partitions {
                partitions,
                samples: total,
            });
        }
        if shuffle_block == 0 {
            return Err(SampleError::ShuffleBlock);
        }
        Ok(Self {
            digest,
            shard_samples,
            total,
            windows: None,
            seed,
            shuffle,
            shuffle_block,
            partitions,
            block_keys: BlockKeys::Global,
        })
    }

    /// Whether a fingerprint of this order names its block keys: only a `block` shuffle has
    /// them (and not Megatron's order, which keeps GPTDataset's).
    pub fn names_block_keys(&self) -> bool {
        self.shuffle == Shuffle::Block
            && self.block_keys == BlockKeys::Global
            && !self.windows.as_ref().is_some_and(|w| w.megatron)
    }

    /// The order of token windows over the documents of `spec` (see [`windows`]).
    pub fn windows(
        digest: [u8; 32],
        spec: WindowSpec,
        seed: u64,
        shuffle: Shuffle,
        shuffle_block: u64,
        partitions: u32,
    ) -> Result<Self, SampleError> {
        let docs = spec.doc_tokens.iter().map(|d| d.len() as u64).collect();
        let n = spec.check()?;
        let mut o = Self::new(digest, docs, seed, shuffle, shuffle_block, 1)?;
        if !partitions_ok(partitions, n) {
            return Err(SampleError::Partitions {
                partitions,
                samples: n,
            });
        }
        if spec.megatron && partitions != 1 {
            return Err(SampleError::MegatronLimit(format!(
                "GPTDataset's order is one global sequence; partitions must be 1, not {partitions}"
            )));
        }
        if spec.megatron && u32::try_from(seed).is_err() {
            return Err(SampleError::MegatronLimit(format!(
                "numpy's RandomState takes a 32-bit seed; seed {seed} is larger"
            )));
        }
        o.total = n;
        o.partitions = partitions;
        o.windows = Some(spec);
        Ok(o)
    }

    /// The window spec, if a sample is a token window.
    pub fn window_spec(&self) -> Option<&WindowSpec> {
        self.windows.as_ref()
    }

    /// Samples in the dataset (windows in window mode).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Samples (documents in window mode) of each shard.
    pub fn shard_samples(&self) -> &[u64] {
        &self.shard_samples
    }

    /// A 64-bit key of (digest, seed, epoch, what).
    fn key(&self, epoch: u32, what: &[u8]) -> u64 {
        let mut h = Sha256::new();
        h.update(b"shardwire-samples-v1");
        h.update(self.digest);
        h.update(self.seed.to_le_bytes());
        h.update(epoch.to_le_bytes());
        h.update(what);
        u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
    }

    /// The order of `epoch` (memory and time grow with the shards, not the samples).
    pub fn epoch(self: &Arc<Self>, epoch: u32) -> EpochOrder {
        let n = self.shard_samples.len();
        let mut perm: Vec<u32> = (0..n as u32).collect();
        if self.shuffle != Shuffle::None {
            let mut rng = self.key(epoch, b"shards");
            for i in (1..n).rev() {
                rng = mix(rng);
                let j = ((u128::from(rng) * (i as u128 + 1)) >> 64) as usize;
                perm.swap(i, j);
            }
        }
        let mut prefix = Vec::with_capacity(n + 1);
        let mut acc = 0u64;
        prefix.push(0);
        for &s in &perm {
            acc += self.shard_samples[s as usize];
            prefix.push(acc);
        }
        let mut megatron = None;
        let (parts, blocks, docs) = match &self.windows {
            None => {
                let (parts, blocks) = self.cut(&prefix, self.total, self.partitions);
                (parts, blocks, None)
            }
            Some(w) if w.megatron => {
                let seed = (self.seed as u32).wrapping_add(epoch);
                let (m, parts, blocks) = windows::MegatronEpoch::new(w, seed);
                megatron = Some(m);
                (parts, blocks, None)
            }
            Some(w) => {
                let docs = self.shard_samples.iter().sum();
                let (_, doc_blocks) = self.cut(&prefix, docs, 1);
                let tok = w.block_tokens(&perm, &prefix, &doc_blocks);
                let (parts, blocks) = w.cut(self.total, self.partitions, &doc_blocks, &tok);
                let cache = Default::default();
                let level = DocLevel {
                    blocks: doc_blocks,
                    tok,
                    cache,
                };
                (parts, blocks, Some(level))
            }
        };
        let c = u64::from(self.partitions);
        let q = parts.iter().map(|p| p.len).min().unwrap_or(0);
        let long = (0..self.partitions)
            .filter(|&i| parts[i as usize].len > q)
            .collect();
        debug_assert!(q * c <= self.total);
        EpochOrder {
            key: self.key(epoch, b"blocks"),
            order: Arc::clone(self),
            epoch,
            perm,
            prefix,
            parts,
            blocks,
            q,
            long,
            docs,
            megatron,
        }
    }

    /// `partitions` partitions of X (`total` samples) at `total*c/C` and their blocks at
    /// shard boundaries.
    fn cut(&self, prefix: &[u64], total: u64, partitions: u32) -> (Vec<Part>, Vec<Block>) {
        let c = u64::from(partitions);
        let mut parts = Vec::with_capacity(partitions as usize);
        let mut blocks = Vec::new();
        let mut k = 0usize; // permuted shard containing the partition start
        for i in 0..c {
            let (ps, pe) = (cut_at(total, i, c), cut_at(total, i + 1, c));
            let first_block = blocks.len() as u32;
            let mut start = ps;
            while start < pe {
                while prefix[k + 1] <= start {
                    k += 1;
                }
                // Close this block at the first shard end at or past the target.
                let target = match self.shuffle {
                    Shuffle::Block => start.saturating_add(self.shuffle_block).min(pe),
                    _ => start + 1,
                };
                let mut end_k = k;
                while prefix[end_k + 1] < target {
                    end_k += 1;
                }
                let end = prefix[end_k + 1].min(pe);
                blocks.push(Block {
                    start,
                    len: end - start,
                    first_shard: k as u32,
                    end_shard: end_k as u32 + 1,
                });
                start = end;
            }
            parts.push(Part {
                start: ps,
                len: pe - ps,
                first_block,
                end_block: blocks.len() as u32,
            });
        }
        (parts, blocks)
    }
}

impl EpochOrder {
    /// The epoch.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The plan's global inputs.
    pub fn order(&self) -> &SampleOrder {
        &self.order
    }

    /// Bytes this epoch's tables take (for the memory bound).
    pub fn table_bytes(&self) -> usize {
        let docs = self.docs.as_ref().map_or(0, |d| {
            d.blocks.capacity() * std::mem::size_of::<Block>() + d.tok.capacity() * 8
        });
        let megatron = self
            .megatron
            .as_ref()
            .map_or(0, windows::MegatronEpoch::bytes);
        docs + megatron
            + self.perm.capacity() * 4
            + self.prefix.capacity() * 8
            + self.parts.capacity() * std::mem::size_of::<Part>()
            + self.blocks.capacity() * std::mem::size_of::<Block>()
            + self.long.capacity() * 4
    }

    /// The sample at X position `x`.
    fn at_x(&self, x: u64) -> SampleRef {
        let k = self.prefix.partition_point(|&p| p <= x) - 1;
        SampleRef {
            shard: self.perm[k],
            row: x - self.prefix[k],
        }
    }

    /// Where sample `u` of partition `c` lies before its block's permutation: the block's
    /// index in `blocks` and the offset in it.
    fn place_in_partition(&self, c: u32, u: u64) -> (usize, u64) {
        let p = self.parts[c as usize];
        let x = p.start + u;
        let blocks = &self.blocks[p.first_block as usize..p.end_block as usize];
        let k = blocks.partition_point(|b| b.start <= x) - 1;
        (p.first_block as usize + k, x - blocks[k].start)
    }

    /// The permutation of the samples of block `k` (of partition `c`); None where the order
    /// keeps a block's rows in order.
    fn block_bijection(&self, c: u32, k: usize) -> Option<Bijection> {
        if self.order.shuffle != Shuffle::Block || self.megatron.is_some() {
            return None;
        }
        let (p, b) = (self.parts[c as usize], self.blocks[k]);
        let bi = match self.order.block_keys {
            BlockKeys::Global => k as u64,
            BlockKeys::Legacy => u64::from(p.first_block) + (b.start - p.start),
        };
        Some(Bijection::new(b.len, mix(self.key ^ mix(bi))))
    }

    /// The X position of sample `u` of partition `c`.
    fn in_partition(&self, c: u32, u: u64) -> u64 {
        let (k, off) = self.place_in_partition(c, u);
        let off = self.block_bijection(c, k).map_or(off, |b| b.apply(off));
        self.blocks[k].start + off
    }

    /// The partition of `G[t]` and its sample there (positions past the epoch's samples wrap
    /// to its start).
    fn partition_of(&self, t: u64) -> (u32, u64) {
        let n = self.order.total;
        let t = t % n;
        let c = u64::from(self.order.partitions);
        if t < c * self.q {
            ((t % c) as u32, t / c)
        } else {
            (self.long[(t - c * self.q) as usize], self.q)
        }
    }

    /// The X position of `G[t]` (positions past the epoch's samples wrap to its start).
    fn x_of(&self, t: u64) -> u64 {
        let (c, u) = self.partition_of(t);
        self.in_partition(c, u)
    }

    /// `G[t]`, a row (positions past the epoch's samples wrap to its start). In window mode
    /// see [`EpochOrder::window`].
    pub fn sample(&self, t: u64) -> SampleRef {
        self.at_x(self.x_of(t))
    }

    /// [`Self::sample`] of each of `ts`, in order, appended to `out`: the samples of each run
    /// of consecutive positions in one block are permuted together
    /// ([`Bijection::apply_all`]), which costs a third of one at a time.
    pub fn samples_into(&self, ts: impl IntoIterator<Item = u64>, out: &mut Vec<SampleRef>) {
        let placed: Vec<(u32, usize, u64)> = ts
            .into_iter()
            .map(|t| {
                let (c, u) = self.partition_of(t);
                let (k, off) = self.place_in_partition(c, u);
                (c, k, off)
            })
            .collect();
        let mut offs: Vec<u64> = placed.iter().map(|p| p.2).collect();
        let mut i = 0;
        while i < placed.len() {
            let (c, k, _) = placed[i];
            let run = placed[i..].iter().take_while(|p| p.1 == k).count();
            if let Some(b) = self.block_bijection(c, k) {
                b.apply_all(&mut offs[i..i + run]);
            }
            i += run;
        }
        out.extend(
            placed
                .iter()
                .zip(&offs)
                .map(|(&(_, k, _), &off)| self.at_x(self.blocks[k].start + off)),
        );
    }

    /// The shards sample `G[t]` reads.
    pub fn shards_at(&self, t: u64) -> Vec<u32> {
        match self.order.windows {
            None => vec![self.sample(t).shard],
            Some(_) => {
                let mut v: Vec<u32> = self.window(t).iter().map(|p| p.doc.shard).collect();
                v.dedup();
                v
            }
        }
    }

    /// The blocks of partition `c`: (partition-relative start, length, permuted shards).
    fn blocks_of(&self, c: u32) -> impl Iterator<Item = (u64, u64, std::ops::Range<u32>)> + '_ {
        let p = self.parts[c as usize];
        self.blocks[p.first_block as usize..p.end_block as usize]
            .iter()
            .map(move |b| (b.start - p.start, b.len, b.first_shard..b.end_shard))
    }

    /// The manifest indexes of permuted shards `range` (of a Megatron epoch's unit shards).
    pub fn shards(&self, range: std::ops::Range<u32>) -> &[u32] {
        let all = match &self.megatron {
            Some(m) => &m.unit_shards,
            None => &self.perm,
        };
        &all[range.start as usize..range.end as usize]
    }
}

/// What a rank takes: its batches of one epoch.
#[derive(Debug)]
pub struct BatchPlan {
    /// The order.
    pub order: Arc<SampleOrder>,
    /// Samples per rank per step.
    pub batch_size: u32,
    /// Ranks.
    pub world_size: u32,
    /// This rank.
    pub rank: u32,
    /// Drop the last partial global batch instead of completing it.
    pub drop_last: bool,
    steps: u64,
}

/// A set of shards a rank needs resident from its sample index `first` to `last`
/// (inclusive): one block of a partition it reads, or the epoch's tail.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unit {
    /// The first rank-local sample index that needs it.
    pub first: u64,
    /// The last one.
    pub last: u64,
    /// Manifest shard indexes.
    pub shards: Vec<u32>,
}

impl BatchPlan {
    /// Rank `rank`'s plan (checks the world size against the partitions).
    pub fn new(
        order: Arc<SampleOrder>,
        batch_size: u32,
        world_size: u32,
        rank: u32,
        drop_last: bool,
    ) -> Result<Self, SampleError> {
        if batch_size == 0 {
            return Err(SampleError::BatchSize);
        }
        if world_size == 0 || rank >= world_size {
            return Err(SampleError::Rank { rank, world_size });
        }
        let c = order.partitions;
        if !c.is_multiple_of(world_size) && !world_size.is_multiple_of(c) {
            return Err(SampleError::DoesNotFit {
                world_size,
                partitions: c,
            });
        }
        let gb = u64::from(batch_size) * u64::from(world_size);
        let n = order.total;
        let steps = if drop_last { n / gb } else { n.div_ceil(gb) };
        if steps == 0 {
            return Err(SampleError::NothingLeft {
                samples: n,
                global_batch: gb,
            });
        }
        Ok(Self {
            order,
            batch_size,
            world_size,
            rank,
            drop_last,
            steps,
        })
    }

    /// Samples per global step.
    pub fn global_batch(&self) -> u64 {
        u64::from(self.batch_size) * u64::from(self.world_size)
    }

    /// Steps (batches per rank) per epoch.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The global position of this rank's sample `i`.
    pub fn position(&self, i: u64) -> u64 {
        u64::from(self.rank) + i * u64::from(self.world_size)
    }

    /// Sample `j` of this rank's batch at `step`.
    pub fn sample(&self, ep: &EpochOrder, step: u64, j: u32) -> SampleRef {
        ep.sample(self.position(step * u64::from(self.batch_size) + u64::from(j)))
    }

    /// The samples of this rank's batch at `step`, in order ([`Self::sample`] of each `j`,
    /// computed together: [`EpochOrder::samples_into`]).
    pub fn batch_samples(&self, ep: &EpochOrder, step: u64) -> Vec<SampleRef> {
        let first = step * u64::from(self.batch_size);
        let mut out = Vec::with_capacity(self.batch_size as usize);
        let positions = (0..u64::from(self.batch_size)).map(|j| self.position(first + j));
        ep.samples_into(positions, &mut out);
        out
    }

    /// Window `j` of this rank's batch at `step` (window mode).
    pub fn window(&self, ep: &EpochOrder, step: u64, j: u32) -> Vec<TokenPiece> {
        ep.window(self.position(step * u64::from(self.batch_size) + u64::from(j)))
    }

    /// The units this rank needs in `ep`, in the order of their first use.
    pub fn units(&self, ep: &EpochOrder) -> Vec<Unit> {
        let mut lists: Vec<Vec<Unit>> = self
            .partitions()
            .map(|(c, stride)| self.blocks_used(ep, c, stride))
            .collect();
        let mut out = Vec::with_capacity(lists.iter().map(Vec::len).sum::<usize>() + 1);
        // A k-way merge by first use (k = partitions this rank reads; small).
        let mut heads: Vec<usize> = vec![0; lists.len()];
        loop {
            let next = (0..lists.len())
                .filter(|&l| heads[l] < lists[l].len())
                .min_by_key(|&l| lists[l][heads[l]].first);
            let Some(l) = next else { break };
            out.push(std::mem::take(&mut lists[l][heads[l]]));
            heads[l] += 1;
        }
        if let Some(tail) = self.tail(ep) {
            out.push(tail);
        }
        out
    }

    /// The partitions this rank reads, each with (partition, the rank's first index into it
    /// and stride between its indexes there).
    fn partitions(&self) -> impl Iterator<Item = (u32, (u64, u64))> + '_ {
        let (c, w, r) = (self.order.partitions, self.world_size, self.rank);
        let owned: Vec<(u32, (u64, u64))> = if c % w == 0 {
            // Whole partitions r, r+W, ...: every sample of each.
            (0..c / w).map(|k| (r + k * w, (0, 1))).collect()
        } else {
            // Partition r % C, shared by W/C ranks: every (W/C)-th sample from r / C.
            vec![(r % c, (u64::from(r / c), u64::from(w / c)))]
        };
        owned.into_iter()
    }

    /// Rank-local index of partition `c`'s sample `u` (in the regular region).
    fn index_of(&self, c: u32, u: u64) -> u64 {
        let t = u64::from(c) + u * u64::from(self.order.partitions);
        (t - u64::from(self.rank)) / u64::from(self.world_size)
    }

    /// The blocks of partition `c` this rank uses in the regular region (u < q).
    fn blocks_used(&self, ep: &EpochOrder, c: u32, (u_first, stride): (u64, u64)) -> Vec<Unit> {
        let limit = self.regular_limit();
        let mut v = Vec::new();
        for (u0, len, shards) in ep.blocks_of(c) {
            let u1 = (u0 + len).min(ep.q);
            if u0 >= u1 {
                continue;
            }
            // This rank's partition indexes: u_first + m*stride.
            let m0 = u0.saturating_sub(u_first).div_ceil(stride);
            let u_lo = u_first + m0 * stride;
            if u_lo >= u1 {
                continue;
            }
            let u_hi = u_first + ((u1 - 1 - u_first) / stride) * stride;
            let (first, last) = (self.index_of(c, u_lo), self.index_of(c, u_hi));
            if first >= limit {
                continue;
            }
            v.push(Unit {
                first,
                last: last.min(limit - 1),
                shards: ep.shards(shards).to_vec(),
            });
        }
        v
    }

    /// Rank-local indexes below this are in the regular region and inside the epoch.
    fn regular_limit(&self) -> u64 {
        let end = self.steps * u64::from(self.batch_size); // rank-local samples per epoch
        let c = u64::from(self.order.partitions);
        let regular = c * (self.order.total / c); // positions below C*q
        // Rank-local indexes i with r + iW < regular.
        let r = u64::from(self.rank);
        let w = u64::from(self.world_size);
        let in_regular = if regular > r {
            (regular - r).div_ceil(w)
        } else {
            0
        };
        end.min(in_regular)
    }

    /// The epoch's tail for this rank: its samples at positions past the regular region (the
    /// longer partitions' last samples, and for `drop_last = false` the wrap to the start).
    fn tail(&self, ep: &EpochOrder) -> Option<Unit> {
        let first = self.regular_limit();
        let end = self.steps * u64::from(self.batch_size);
        if first >= end {
            return None;
        }
        // Positions wrap to the epoch's start (`EpochOrder::sample`), and index i + N is at
        // position(i) + W * N, the same sample: N indexes from `first` read every shard the
        // rest do. So the work is bounded by the epoch's samples, not by the batch (up to
        // 2^32 indexes for `drop_last = false` with a batch larger than the epoch).
        let once = end.min(first.saturating_add(self.order.total));
        let shards: std::collections::BTreeSet<u32> = (first..once)
            .flat_map(|i| ep.shards_at(self.position(i)))
            .collect();
        Some(Unit {
            first,
            last: end - 1,
            shards: shards.into_iter().collect(),
        })
    }

    /// The readable fingerprint of the global plan: no rank or world size in it, so a state
    /// from any rank resumes every rank.
    pub fn fingerprint(&self, digest: &[u8; 32]) -> String {
        let d: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let o = &self.order;
        format!(
            "v2;digest={d};samples={};seed={};shuffle={};shuffle_block={};partitions={};global_batch={};drop_last={}",
            o.total,
            o.seed,
            o.shuffle.as_str(),
            o.shuffle_block,
            o.partitions,
            self.global_batch(),
            self.drop_last
        ) + &match &o.windows {
            Some(w) if w.megatron => format!(";windows={}:{}:megatron", w.column, w.seq_len),
            Some(w) => format!(";windows={}:{}", w.column, w.seq_len),
            None => String::new(),
        } + &if o.names_block_keys() {
            format!(";{}", BlockKeys::FIELD)
        } else {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests;
