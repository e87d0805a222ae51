//! The checks of opening a stream, before anything is allocated: the request itself (version,
//! epochs, a dataset name the wire can carry), the plan, the resume position, and whether the
//! region can hold the dataset's largest shard twice. Each refusal is an [`OpenError`] with a
//! stable code and a message that names the field and the value.

use std::sync::Arc;

use shardwire_gpu::{HostRegion, Region, SlabPool};
use shardwire_protocol::plan::{PlanSpec, compare_fingerprints};
use shardwire_protocol::samples::{BatchPlan, BlockKeys, MAX_PARTITIONS, SampleOrder, Shuffle};
use shardwire_protocol::trainer::{
    DEFAULT_BLOCK_SHARDS, ErrorCode, StreamRequest, StreamState, TRAINER_VERSION, WindowOrder,
};
use shardwire_protocol::{DType, Manifest};

use super::error::OpenError;
use super::kind::{BatchMode, Kind, Sampler};
use super::layout::Layout;
use super::order::Order;
use super::peak;
use super::supply::{READY_AHEAD, ready_ahead};
use super::tokens::TokenMode;

/// Epoch e of GPTDataset's order is seeded seed + e (numpy's 32-bit RandomState): past
/// 2^32 - 1 it wrapped to another stream's epoch (and Megatron refuses such a seed).
fn check_megatron_seeds(r: &StreamRequest) -> Result<(), OpenError> {
    let last_seed = r.seed.saturating_add(u64::from(r.epochs) - 1);
    if r.order != Some(WindowOrder::Megatron) || last_seed <= u64::from(u32::MAX) {
        return Ok(());
    }
    Err(OpenError::new(
        ErrorCode::BadPlan,
        format!(
            "order megatron seeds epoch e with seed + e (a 32-bit RandomState seed): seed {} with \
             {} epochs passes {}; lower seed",
            r.seed,
            r.epochs,
            u32::MAX
        ),
    ))
}

/// Checks the request's own fields.
pub fn check_request(r: &StreamRequest) -> Result<(), OpenError> {
    if r.version != TRAINER_VERSION {
        return Err(OpenError::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "trainer protocol {}; this service speaks {TRAINER_VERSION}",
                r.version
            ),
        ));
    }
    if r.epochs == 0 {
        return Err(OpenError::new(
            ErrorCode::BadRequest,
            "epochs must be at least 1",
        ));
    }
    if let Some(b) = r.batch_size {
        check_global_batch(b, r.world_size)?;
    }
    let token_fields = [
        ("tokens_column", r.tokens_column.is_some()),
        ("token_dtype", r.token_dtype.is_some()),
        ("boundaries", r.boundaries),
        ("order", r.order.is_some()),
    ];
    if let (None, Some((name, _))) = (r.seq_len, token_fields.iter().find(|f| f.1)) {
        return Err(OpenError::new(
            ErrorCode::BadRequest,
            format!("{name} is a token-mode field: it needs seq_len (and batch_size)"),
        ));
    }
    check_megatron_seeds(r)?;
    if r.seq_len.is_some() && r.batch_size.is_none() {
        return Err(OpenError::new(
            ErrorCode::BadRequest,
            "seq_len needs batch_size: token windows are delivered in batches",
        ));
    }
    if let Some(mix) = &r.mix {
        if !r.dataset.is_empty() {
            return Err(OpenError::new(
                ErrorCode::BadRequest,
                format!(
                    "dataset {:?} and mix both given; a mixture names its datasets in mix only",
                    r.dataset
                ),
            ));
        }
        if r.batch_size.is_none() {
            return Err(OpenError::new(
                ErrorCode::BadRequest,
                "mix needs batch_size: mixtures are delivered in batches",
            ));
        }
        for e in mix {
            shardwire_protocol::wire::check_dataset_name(&e.dataset)
                .map_err(|e| OpenError::new(ErrorCode::BadRequest, e.to_string()))?;
        }
        // Count, duplicates and weights before any manifest is fetched.
        let names: Vec<&str> = mix.iter().map(|e| e.dataset.as_str()).collect();
        let weights: Vec<f64> = mix.iter().map(|e| e.weight).collect();
        shardwire_protocol::samples::mix::fixed_weights(&names, &weights)
            .map_err(|e| OpenError::new(ErrorCode::BadRequest, e.to_string()))?;
        return Ok(());
    }
    if r.batch_size.is_none() {
        check_shard_mode_fields(r)?;
    }
    // Checked here, at the edge, against the wire's rules: a name the wire cannot carry
    // must fail this request, never the source links shared by every stream.
    shardwire_protocol::wire::check_dataset_name(&r.dataset)
        .map_err(|e| OpenError::new(ErrorCode::BadRequest, e.to_string()))
}

/// Most samples a global step (`batch_size x world_size`) may hold: 2^24, 16 times the
/// largest published global batch (SigLIP's 2^20 image-text pairs; recommender runs of 1024
/// ranks x 4096 rows are 2^22, language models' a few thousand windows). The planner's work
/// and memory grow with it (the epoch's tail, each batch's sample list, a mixture's slots
/// computed every step), and the region check does not bound it: rows of a few bytes, or none.
pub const MAX_GLOBAL_BATCH: u64 = 1 << 24;

/// Refuses a global batch over [`MAX_GLOBAL_BATCH`], before any manifest is fetched or any
/// plan built; the message names both values and the largest `batch_size` that fits.
fn check_global_batch(batch_size: u32, world_size: u32) -> Result<(), OpenError> {
    let global = u64::from(batch_size) * u64::from(world_size);
    if global <= MAX_GLOBAL_BATCH {
        return Ok(());
    }
    let fits = match MAX_GLOBAL_BATCH / u64::from(world_size) {
        0 => format!("no batch_size fits world_size {world_size}; lower world_size"),
        b => format!("lower batch_size to at most {b} at world_size {world_size}"),
    };
    Err(OpenError::new(
        ErrorCode::BadRequest,
        format!(
            "batch_size {batch_size} x world_size {world_size} is a global batch of {global} \
             samples, over the limit of {MAX_GLOBAL_BATCH} (2^24) a step may hold; {fits}"
        ),
    ))
}

/// Refuses the batch-mode order fields on a shard-mode request (no `batch_size`), naming
/// each with its value. They were ignored before: `shuffle: "none"` still permuted the
/// shards, `drop_last` and `partitions` vanished, where the Python SDK refuses them.
fn check_shard_mode_fields(r: &StreamRequest) -> Result<(), OpenError> {
    let given: Vec<String> = [
        r.shuffle.map(|s| format!("shuffle {:?}", s.as_str())),
        r.shuffle_block.map(|b| format!("shuffle_block {b}")),
        r.partitions.map(|p| format!("partitions {p}")),
        r.drop_last.then(|| "drop_last true".to_owned()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if given.is_empty() {
        return Ok(());
    }
    Err(OpenError::new(
        ErrorCode::BadRequest,
        format!(
            "{} need batch_size (batch mode): a shard-mode stream delivers whole shards in its \
             plan's order (shuffled per epoch by seed) and would ignore them; set batch_size, \
             or leave them out",
            given.join(", ")
        ),
    ))
}

/// The plan of `r` over `manifest`.
pub fn plan(manifest: &Manifest, r: &StreamRequest) -> Result<PlanSpec, OpenError> {
    let shards = u32::try_from(manifest.shards.len()).map_err(|_| {
        OpenError::new(
            ErrorCode::BadRequest,
            format!(
                "the dataset has {} shards; at most {}",
                manifest.shards.len(),
                u32::MAX
            ),
        )
    })?;
    let spec = PlanSpec {
        digest: manifest.digest_bytes(),
        shards,
        seed: r.seed,
        rank: r.rank,
        world_size: r.world_size,
        uneven: r.uneven,
    };
    spec.validate()
        .map_err(|e| OpenError::new(ErrorCode::BadPlan, e.to_string()))?;
    Ok(spec)
}

/// Why a resume position is not one of a stream's ([`outside`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outside {
    /// Past its epoch's positions, or past the stream's epochs (the caller names its units).
    Past,
    /// In the epoch after the last, at an index no stream of these workers saves there.
    AfterTheEnd(AfterTheEnd),
}

/// A resume position at the end of the run (`epochs`, `index`) that no stream read by
/// `workers` streams saves: after its last batch a stream's state is (`epochs`, 0), a
/// DataLoader worker's its next slot (`epochs`, k) with k below `workers`. Such a state
/// was made by hand, mostly with `epochs` taken for the epochs still to run; it resumed to
/// an empty stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "state position epoch {epochs} index {index} is at the end of this stream of {epochs} epochs, where a saved state names an index below {workers} (num_workers; 1 in shard mode or without DataLoader workers) and nothing is left to deliver; `epochs` counts the stream's epochs from epoch 0, not those left after the state: ask for more than {epochs} epochs to resume at this position"
)]
pub(super) struct AfterTheEnd {
    /// The stream's epochs (the state's epoch).
    pub epochs: u32,
    /// The state's index.
    pub index: u64,
    /// The streams the rank's batches are split among (`num_workers`; 1 in shard mode).
    pub workers: u32,
}

/// Where a resume position (`epoch`, `index` within it) lies outside a stream of `epochs`
/// epochs of `per_epoch` positions read by `workers` streams (a rank's DataLoader workers;
/// 1 in shard mode and for a stream not split among workers); `None` when inside. The end
/// of the run is inside at the indexes a state names there: (`epochs`, 0) after the last
/// batch, a DataLoader worker's next slot (`epochs`, k) with k below `workers` (nothing is
/// left to deliver from either); any other index there is [`Outside::AfterTheEnd`].
pub(super) fn outside(
    epoch: u32,
    index: u64,
    per_epoch: u64,
    epochs: u32,
    workers: u32,
) -> Option<Outside> {
    if index >= per_epoch || epoch > epochs {
        return Some(Outside::Past);
    }
    let workers = workers.max(1);
    if epoch == epochs && index >= u64::from(workers) {
        let e = AfterTheEnd {
            epochs,
            index,
            workers,
        };
        return Some(Outside::AfterTheEnd(e));
    }
    None
}

/// The stream position to start from: 0, or where `state` says, if it belongs to this plan.
pub fn resume_position(
    spec: &PlanSpec,
    state: Option<&StreamState>,
    epochs: u32,
) -> Result<u64, OpenError> {
    let Some(st) = state else { return Ok(0) };
    let mismatch = |m: String| OpenError::new(ErrorCode::StateMismatch, m);
    // Batch mode's fingerprints (a mixture's too) are `v2;...`: compared field by field they
    // were told apart only by a field missing from the state.
    if st.fingerprint.starts_with("v2;") {
        let by = match saved_by_mixture(st) {
            true => "a mixture (mix, batch_size)",
            false => "a batch-mode stream (batch_size)",
        };
        return Err(mismatch(format!(
            "the state was saved by {by}; it cannot resume a shard-mode stream (no batch_size): \
             open the stream as it was saved"
        )));
    }
    spec.check_fingerprint(&st.fingerprint).map_err(mismatch)?;
    if st.seed != spec.seed {
        return Err(mismatch(format!(
            "state fingerprint differs in `seed`: saved {}, stream has {}",
            st.seed, spec.seed
        )));
    }
    // One stream a rank: shard mode refuses DataLoader workers (`shard_mode`).
    match outside(st.epoch, st.index, spec.per_rank(), epochs, 1) {
        None => {}
        Some(Outside::AfterTheEnd(e)) => return Err(mismatch(e.to_string())),
        Some(Outside::Past) => {
            return Err(mismatch(format!(
                "state position epoch {} index {} is outside this stream ({epochs} epochs of {} batches)",
                st.epoch,
                st.index,
                spec.per_rank()
            )));
        }
    }
    Ok(u64::from(st.epoch) * spec.per_rank() + st.index)
}

/// Whether `st` was saved by a mixture stream: its `mix`, or its fingerprint's first field.
fn saved_by_mixture(st: &StreamState) -> bool {
    st.mix.is_some() || st.fingerprint.starts_with("v2;mix=")
}

/// Checks that a region of `region_bytes` can keep one batch leased while the next arrives.
pub fn check_region(manifest: &Manifest, region_bytes: u64) -> Result<(), OpenError> {
    // A shard with row tables is assembled behind its payload, in the same slab.
    let largest = (0..manifest.shards.len() as u32)
        .map(|i| match super::assemble::plan_shard(manifest, i) {
            Some(p) => p.bytes,
            None => manifest.shards[i as usize].length,
        })
        .max()
        .unwrap_or(0) as usize;
    let class = SlabPool::class_size(largest) as u64;
    if class.saturating_mul(2) > region_bytes {
        return Err(OpenError::new(
            ErrorCode::NoMemory,
            format!(
                "the largest shard ({largest} bytes as delivered, slab class {class}) needs stream_memory of at least {} bytes to keep one batch leased while the next arrives; stream_memory is {region_bytes}",
                class * 2
            ),
        ));
    }
    Ok(())
}

/// Shard mode: the plan, the resume position and the region check; returns the stream's
/// kind, its start position and fingerprint.
pub fn shard_mode(
    m: &Manifest,
    r: &StreamRequest,
    region_bytes: u64,
) -> Result<(Kind, u64, String), OpenError> {
    if r.worker != 0 || r.num_workers != 1 {
        // Ignored here before: every worker was given the rank's whole stream.
        return Err(OpenError::new(
            ErrorCode::BadRequest,
            format!(
                "worker {} of num_workers {}: splitting a rank's stream among workers needs batch mode \
                 (batch_size); in shard mode give each worker its own rank (rank * num_workers + \
                 worker of world_size * num_workers)",
                r.worker, r.num_workers
            ),
        ));
    }
    let spec = plan(m, r)?;
    let start = resume_position(&spec, r.state.as_ref(), r.epochs)?;
    check_region(m, region_bytes)?;
    let fingerprint = spec.fingerprint();
    Ok((Kind::Shards(Order::new(spec)), start, fingerprint))
}

/// Batch mode (token mode with `seq_len`): the sample layout, the rank's plan (partitions
/// and shuffle block from the request, else from the resume state, else the defaults), the
/// resume position and the window check; returns the stream's kind, its start position and
/// fingerprint.
pub fn batch_mode(
    m: &Manifest,
    r: &StreamRequest,
    batch_size: u32,
    region_bytes: u64,
    cuda: bool,
) -> Result<(Kind, u64, String), OpenError> {
    let layout = Layout::of(m)?;
    let st = r.state.as_ref();
    let bad = |e: String| OpenError::new(ErrorCode::BadPlan, e);
    check_workers(r)?;
    let partitions = match r.order {
        Some(WindowOrder::Megatron) => 1, // one global sequence
        _ => r.world_size,
    };
    let (order, tokens) = sample_order(m, r, &layout.shard_rows, partitions, cuda)?;
    let plan = BatchPlan::new(
        Arc::new(order),
        batch_size,
        r.world_size,
        r.rank,
        r.drop_last,
    )
    .map_err(|e| bad(e.to_string()))?;
    let fingerprint = plan.fingerprint(&m.digest_bytes());
    let start = resume_batches(&plan, &fingerprint, st, (r.epochs, r.num_workers))?;
    let mut mode = BatchMode::new(Sampler::One(plan), r, layout, tokens);
    let Sampler::One(plan) = &mode.sampler else {
        unreachable!("just made")
    };
    mode.ready_ahead = check_window(m, plan, mode.batch_bytes, region_bytes)?;
    Ok((Kind::Batches(Arc::new(mode)), start, fingerprint))
}

/// Checks `worker` against `num_workers`.
pub(super) fn check_workers(r: &StreamRequest) -> Result<(), OpenError> {
    if r.num_workers == 0 || r.worker >= r.num_workers {
        return Err(OpenError::new(
            ErrorCode::BadPlan,
            format!(
                "worker {} is not below num_workers {}",
                r.worker, r.num_workers
            ),
        ));
    }
    Ok(())
}

/// The order of dataset `m` (whose shards hold `shard_rows` rows) for request `r`: rows, or
/// token windows with `seq_len`; partitions and shuffle block from the request, else the
/// resume state's, else [`default_partitions`] of `partitions` and the default block.
pub(super) fn sample_order(
    m: &Manifest,
    r: &StreamRequest,
    shard_rows: &[u64],
    partitions: u32,
    cuda: bool,
) -> Result<(SampleOrder, Option<TokenMode>), OpenError> {
    let st = r.state.as_ref();
    let bad = |e: String| OpenError::new(ErrorCode::BadPlan, e);
    let total = shard_rows.iter().fold(0u64, |a, &n| a.saturating_add(n));
    let avg = total.div_ceil(shard_rows.len().max(1) as u64);
    let shuffle = r.shuffle.unwrap_or_default();
    let named = r.partitions.or(st.and_then(|s| s.partitions));
    let shuffle_block = r
        .shuffle_block
        .or(st.and_then(|s| s.shuffle_block))
        .unwrap_or(DEFAULT_BLOCK_SHARDS * avg.max(1));
    let digest = m.digest_bytes();
    let (order, tokens) = match r.seq_len {
        None => {
            let rows = shard_rows.to_vec();
            let partitions = named.unwrap_or_else(|| default_partitions(partitions, total));
            let o = SampleOrder::new(digest, rows, r.seed, shuffle, shuffle_block, partitions);
            (o, None)
        }
        Some(seq_len) => {
            let (spec, mode) = TokenMode::of(m, r, seq_len)?;
            let partitions =
                named.unwrap_or_else(|| default_partitions(partitions, spec.windows()));
            let unsigned = matches!(mode.src, DType::Uint8 | DType::Uint16 | DType::Uint32);
            if cuda && mode.out != mode.src && !unsigned {
                return Err(OpenError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "token mode: token_dtype {} from signed {} tokens needs sign extension, which the GPU assembly (copies in one gather launch) does not do; leave token_dtype unset and widen in the trainer (tokens.long())",
                        mode.out.name(),
                        mode.src.name()
                    ),
                ));
            }
            let o = SampleOrder::windows(digest, spec, r.seed, shuffle, shuffle_block, partitions);
            (o, Some(mode))
        }
    };
    let mut order = order.map_err(|e| bad(e.to_string()))?;
    if let Some(st) = st {
        // A state saved before the fingerprint named the block keys resumes with those.
        order.block_keys = BlockKeys::of_state(&st.fingerprint, "");
    }
    Ok((order, tokens))
}

/// The partitions of a request that names none (nor does its state): `world_size`, or where
/// that is over the dataset's `samples` or [`MAX_PARTITIONS`], its largest divisor within
/// both, so the world size stays a multiple of it. The value goes into the state and the
/// fingerprint: a resume reads it back, never derives it again from another world size.
fn default_partitions(world_size: u32, samples: u64) -> u32 {
    let limit = samples.min(u64::from(MAX_PARTITIONS)).max(1);
    let w = u64::from(world_size);
    if w <= limit {
        return world_size;
    }
    // Divisors in pairs (d, w / d) up to the square root: 2^16 steps at most.
    let best = (1u64..)
        .take_while(|d| d * d <= w)
        .filter(|&d| w.is_multiple_of(d))
        .flat_map(|d| [d, w / d])
        .filter(|&d| d <= limit)
        .max()
        .unwrap_or(1);
    u32::try_from(best).unwrap_or(1)
}

/// Refuses `epochs` of `per_epoch` positions of `per_position` samples (a batch-mode stream
/// indexes the rank's samples: position x batch_size) that pass a 64-bit index, counting one
/// epoch more than asked (a worker's state after the last batch names the epoch after,
/// `Stream::state_at`). Past it, sample indexes wrapped.
pub fn check_index_fits(per_epoch: u64, per_position: u64, epochs: u32) -> Result<(), OpenError> {
    let fits = per_epoch
        .checked_mul(u64::from(epochs) + 1)
        .and_then(|p| p.checked_mul(per_position));
    if fits.is_some() {
        return Ok(());
    }
    Err(OpenError::new(
        ErrorCode::BadRequest,
        format!(
            "{epochs} epochs of {per_epoch} positions of {per_position} samples do not fit a 64-bit index; ask for fewer epochs"
        ),
    ))
}

/// The batch-mode position to start from: 0, or the global step `state` names, in a stream
/// of `epochs` epochs read by `workers` DataLoader workers.
fn resume_batches(
    plan: &BatchPlan,
    fingerprint: &str,
    state: Option<&StreamState>,
    (epochs, workers): (u32, u32),
) -> Result<u64, OpenError> {
    let Some(st) = state else { return Ok(0) };
    let mismatch = |m: String| OpenError::new(ErrorCode::StateMismatch, m);
    if !st.fingerprint.starts_with("v2;") {
        return Err(mismatch(
            "the state was saved by a shard-mode stream (no batch_size); it cannot resume a batch-mode stream".into(),
        ));
    }
    if saved_by_mixture(st) {
        return Err(mismatch(
            "the state was saved by a mixture (mix); it cannot resume a stream of one dataset: open the mixture it was saved from".into(),
        ));
    }
    compare_fingerprints(fingerprint, &st.fingerprint).map_err(mismatch)?;
    let steps = plan.steps();
    match outside(st.epoch, st.index, steps, epochs, workers) {
        None => {}
        Some(Outside::AfterTheEnd(e)) => return Err(mismatch(e.to_string())),
        Some(Outside::Past) => {
            return Err(mismatch(format!(
                "state position epoch {} step {} is outside this stream ({epochs} epochs of {steps} steps)",
                st.epoch, st.index
            )));
        }
    }
    let want = st.index * plan.global_batch();
    if st.cursor.is_some_and(|c| c != want) {
        return Err(mismatch(format!(
            "state cursor {} is not step {} x the global batch {}",
            st.cursor.unwrap_or_default(),
            st.index,
            plan.global_batch()
        )));
    }
    u64::from(st.epoch)
        .checked_mul(steps)
        .and_then(|p| p.checked_add(st.index))
        .ok_or_else(|| {
            mismatch(format!(
                "state epoch {} index {} is past any 64-bit position",
                st.epoch, st.index
            ))
        })
}

/// Refuses a batch larger than the region before its slab class is computed (a batch of
/// `u64::MAX` bytes is one whose size overflowed: `batch_size` times the sample).
pub(super) fn check_batch_fits(batch_bytes: u64, region_bytes: u64) -> Result<(), OpenError> {
    if batch_bytes <= region_bytes {
        return Ok(());
    }
    let size = match batch_bytes {
        u64::MAX => "more than 2^64 bytes".to_owned(),
        n => format!("{n} bytes"),
    };
    Err(OpenError::new(
        ErrorCode::NoMemory,
        format!(
            "one batch takes {size}, more than the stream's whole region (stream_memory {region_bytes} bytes); lower batch_size (or seq_len), or raise stream_memory"
        ),
    ))
}

/// Checks that the region holds what the rank reads at once: the current block of each
/// partition it reads, or, where more, the blocks one batch of the first epoch reads
/// together ([`peak`]: a batch across a block edge needs both), plus the batch its trainer
/// holds and [`READY_AHEAD`] assembled ones; returns how many assembled batches the stream
/// keeps ready ([`ready_ahead`]).
fn check_window(
    m: &Manifest,
    plan: &BatchPlan,
    batch_bytes: u64,
    region_bytes: u64,
) -> Result<usize, OpenError> {
    check_batch_fits(batch_bytes, region_bytes)?;
    let o = &plan.order;
    let (c, w) = (o.partitions, plan.world_size);
    let concurrent = u64::from(if c % w == 0 { c / w } else { 1 });
    let max_class = max_class(m);
    let per_block = block_shards(o).min(m.shards.len() as u64);
    let across = peak::peak(m, &plan.units(&o.epoch(0)), u64::from(plan.batch_size));
    // Saturating: a count of blocks times a large class must not wrap into "fits".
    let blocks = concurrent
        .saturating_mul(per_block)
        .saturating_mul(max_class)
        .max(across.bytes);
    let class = SlabPool::class_size(batch_bytes as usize) as u64;
    let batches = (READY_AHEAD as u64 + 1).saturating_mul(class);
    if blocks.saturating_add(batches) <= region_bytes {
        return Ok(ready_ahead(region_bytes, blocks, class));
    }
    // A window order's blocks count documents, a row order's samples.
    let unit = match o.window_spec() {
        Some(_) => "documents",
        None => "samples",
    };
    if across.bytes
        > concurrent
            .saturating_mul(per_block)
            .saturating_mul(max_class)
    {
        return Err(OpenError::new(
            ErrorCode::NoMemory,
            format!(
                "batch mode needs stream_memory of at least {} bytes: one batch of {} samples reads {} units (blocks of shuffle_block {} {unit}, or the epoch's tail) at once, {} shards of {} slab bytes, as it crosses from one into the next, plus {} batch slabs of {class} bytes; stream_memory is {region_bytes}; raise stream_memory, or lower batch_size or shuffle_block",
                blocks.saturating_add(batches),
                plan.batch_size,
                across.units,
                o.shuffle_block,
                across.shards,
                across.bytes,
                READY_AHEAD + 1,
            ),
        ));
    }
    let room = region_bytes.saturating_sub(batches) / concurrent.saturating_mul(max_class).max(1);
    let hint = match largest_block(o, room) {
        Some(b) if o.shuffle == Shuffle::Block => {
            format!("; lower shuffle_block to at most {b} {unit}, or raise stream_memory")
        }
        _ => "; raise stream_memory".into(),
    };
    Err(OpenError::new(
        ErrorCode::NoMemory,
        format!(
            "batch mode needs stream_memory of at least {} bytes: {concurrent} partition(s) read at once, each with a block of up to {per_block} shards of slab class {max_class} (shuffle_block {} {unit}), plus {} batch slabs of {} bytes; stream_memory is {region_bytes}{hint}",
            blocks.saturating_add(batches),
            o.shuffle_block,
            READY_AHEAD + 1,
            SlabPool::class_size(batch_bytes as usize)
        ),
    ))
}

/// The largest slab class of `m`'s shards.
pub(super) fn max_class(m: &Manifest) -> u64 {
    m.shards
        .iter()
        .map(|s| SlabPool::class_size(s.length as usize) as u64)
        .max()
        .unwrap_or(0)
}

/// The fewest samples (rows, documents) of a non-empty shard of `o`.
fn min_rows(o: &SampleOrder) -> u64 {
    o.shard_samples()
        .iter()
        .copied()
        .filter(|&r| r > 0)
        .min()
        .unwrap_or(1)
}

/// The most shards a block of `o` reads at once (a window block also reads into the shards
/// its last window reaches: [`window_reach`]). Saturating: a `shuffle_block` near
/// `u64::MAX` over shards of one row must not wrap into "a few shards".
pub(super) fn block_shards(o: &SampleOrder) -> u64 {
    let per_block = match o.shuffle {
        Shuffle::Block => o.shuffle_block.div_ceil(min_rows(o)).saturating_add(1),
        _ => 1,
    };
    per_block.saturating_add(window_reach(o))
}

/// The shards past its document block a window block of `o` may read (its last window
/// reaches `seq_len + 1` tokens past its start); 0 for rows.
fn window_reach(o: &SampleOrder) -> u64 {
    o.window_spec().map_or(0, |w| {
        let min_tokens = w
            .doc_tokens
            .iter()
            .map(|d| d.iter().map(|&t| u64::from(t)).sum::<u64>())
            .filter(|&t| t > 0)
            .min()
            .unwrap_or(1);
        w.seq_len
            .saturating_add(1)
            .div_ceil(min_tokens)
            .saturating_add(1)
    })
}

/// The largest `shuffle_block` whose blocks ([`block_shards`]) fit `room` shards: the
/// inverse of `ceil(b / min_rows) + 1 + reach <= room`; `None` where not even a block of
/// one shard does.
fn largest_block(o: &SampleOrder, room: u64) -> Option<u64> {
    let shards = room.checked_sub(window_reach(o).saturating_add(1))?;
    (shards > 0).then_some(shards.saturating_mul(min_rows(o)))
}

/// The region of stream `id`: a memfd, or a VMM allocation on the GPU.
pub fn region(
    id: u64,
    bytes: u64,
    cuda: Option<&shardwire_gpu::cuda::CudaMemory>,
) -> Result<Region, OpenError> {
    let no_memory = |m: String| OpenError::new(ErrorCode::NoMemory, m);
    Ok(match cuda {
        None => HostRegion::new(&format!("shardwire-stream-{id}"), bytes as usize)
            .map_err(|e| no_memory(format!("a {bytes}-byte host region: {e}")))?
            .into(),
        Some(gpu) => shardwire_gpu::cuda::VmmRegion::new(&gpu.device, bytes as usize)
            .map_err(|e| {
                no_memory(format!(
                    "a {bytes}-byte CUDA region on GPU {}: {e}",
                    gpu.info.ordinal
                ))
            })?
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::plan::Uneven;
    use shardwire_protocol::trainer::MixEntry;

    use super::*;

    fn spec() -> PlanSpec {
        PlanSpec {
            digest: [1; 32],
            shards: 10,
            seed: 4,
            rank: 0,
            world_size: 2,
            uneven: Uneven::Pad,
        }
    }

    fn state(epoch: u32, index: u64, s: &PlanSpec) -> StreamState {
        StreamState {
            epoch,
            index,
            seed: s.seed,
            fingerprint: s.fingerprint(),
            cursor: None,
            partitions: None,
            shuffle_block: None,
            mix: None,
        }
    }

    #[test]
    fn shard_mode_refuses_workers_it_would_ignore() {
        let m = Manifest::new(Vec::new());
        let mut r = StreamRequest::new("web");
        r.worker = 1;
        r.num_workers = 2;
        // Before: opened, and each worker was given the rank's whole stream.
        let e = shard_mode(&m, &r, 1 << 20).err().unwrap();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(
            e.message.contains("worker 1 of num_workers 2"),
            "{}",
            e.message
        );
    }

    #[test]
    fn shard_mode_refuses_the_batch_mode_order_fields_it_would_ignore() {
        // Before: accepted and ignored (`shuffle: "none"` still permuted the shards).
        let mut r = StreamRequest::new("web");
        r.shuffle = Some(Shuffle::None);
        let e = check_request(&r).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(
            e.message
                .starts_with("shuffle \"none\" need batch_size (batch mode)"),
            "{e}"
        );
        assert!(
            e.message.contains("set batch_size, or leave them out"),
            "{e}"
        );
        r = StreamRequest::new("web");
        (r.shuffle_block, r.partitions, r.drop_last) = (Some(64), Some(8), true);
        let e = check_request(&r).unwrap_err();
        assert!(
            e.message
                .starts_with("shuffle_block 64, partitions 8, drop_last true need batch_size"),
            "{e}"
        );
        // With batch_size they are batch mode's, and checked there.
        r.batch_size = Some(4);
        assert!(check_request(&r).is_ok());
    }

    #[test]
    fn a_global_batch_over_the_limit_is_refused_before_any_plan() {
        // Before: accepted here, and the plan's tail (or a mixture's slots every step) grew
        // with batch_size x world_size: GiBs for a batch of zero-byte rows.
        let mut r = StreamRequest::new("web");
        (r.batch_size, r.world_size) = (Some(1 << 16), 1 << 8);
        assert!(check_request(&r).is_ok(), "2^24 exactly is allowed");
        r.world_size = (1 << 8) + 1;
        let e = check_request(&r).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        let want = "batch_size 65536 x world_size 257 is a global batch of 16842752 samples, \
                    over the limit of 16777216 (2^24) a step may hold; lower batch_size to at \
                    most 65280 at world_size 257";
        assert_eq!(e.message, want);
        // No batch fits a world over 2^24; u32::MAX x u32::MAX does not wrap.
        (r.batch_size, r.world_size) = (Some(u32::MAX), u32::MAX);
        let e = check_request(&r).unwrap_err();
        assert!(
            e.message
                .contains("no batch_size fits world_size 4294967295"),
            "{e}"
        );
        // A mixture is checked the same way.
        r = StreamRequest::new("");
        (r.batch_size, r.world_size) = (Some(u32::MAX), 1);
        r.mix = Some(vec![MixEntry {
            dataset: "web".into(),
            weight: 1.0,
        }]);
        let e = check_request(&r).unwrap_err();
        assert!(
            e.message
                .starts_with("batch_size 4294967295 x world_size 1 is"),
            "{e}"
        );
        // A shard-mode stream has no global batch: any world size passes.
        r = StreamRequest::new("web");
        r.world_size = u32::MAX;
        assert!(check_request(&r).is_ok());
    }

    #[test]
    fn requests_are_checked_field_by_field() {
        let mut r = StreamRequest::new("web");
        assert!(check_request(&r).is_ok());
        r.version = 7;
        assert_eq!(
            check_request(&r).unwrap_err().code,
            ErrorCode::UnsupportedVersion
        );
        r = StreamRequest::new("web");
        r.epochs = 0;
        assert!(check_request(&r).unwrap_err().message.contains("epochs"));
        // Megatron's epoch seeds must stay 32-bit (they wrapped into another stream's order).
        r = StreamRequest::new("web");
        (r.seq_len, r.batch_size, r.order) = (Some(8), Some(2), Some(WindowOrder::Megatron));
        (r.seed, r.epochs) = (u64::from(u32::MAX), 2);
        let e = check_request(&r).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadPlan);
        assert!(e.message.contains("lower seed"), "{e}");
        r.epochs = 1;
        assert!(check_request(&r).is_ok());
        let e = check_request(&StreamRequest::new("x".repeat(300))).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(
            e.message.contains("300 bytes long; the limit is 255"),
            "{e}"
        );
    }

    #[test]
    fn epochs_whose_sample_index_passes_64_bits_are_refused() {
        // 2^32 epochs of 2^20 batches of 2^12 samples: the positions fit, the samples not.
        assert!(check_index_fits(1 << 20, 1, u32::MAX).is_ok());
        let e = check_index_fits(1 << 20, 1 << 12, u32::MAX).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("ask for fewer epochs"), "{}", e.message);
        assert!(check_index_fits(1 << 20, 1 << 12, 1000).is_ok());
    }

    #[test]
    fn resume_positions_inside_the_stream_are_accepted() {
        let s = spec();
        assert_eq!(resume_position(&s, None, 3).unwrap(), 0);
        assert_eq!(resume_position(&s, Some(&state(2, 4, &s)), 3).unwrap(), 14);
        // The end of the last epoch: nothing left, but a valid place to resume.
        assert_eq!(resume_position(&s, Some(&state(3, 0, &s)), 3).unwrap(), 15);
    }

    #[test]
    fn resume_positions_outside_the_stream_or_another_plan_are_refused() {
        let s = spec();
        let e = resume_position(&s, Some(&state(0, 5, &s)), 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::StateMismatch);
        assert!(e.message.contains("index 5 is outside"), "{e}");
        assert!(resume_position(&s, Some(&state(4, 0, &s)), 3).is_err());
        // The end of the run past index 0: no shard-mode stream saves it (a state of epoch
        // 1 of a longer run, resumed with `epochs` taken as the epochs left). Before:
        // accepted, and the stream was empty.
        let e = resume_position(&s, Some(&state(3, 1, &s)), 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::StateMismatch);
        let m = &e.message;
        assert!(
            m.contains("epoch 3 index 1 is at the end of this stream"),
            "{m}"
        );
        assert!(m.contains("ask for more than 3 epochs"), "{m}");
        let mut other = s.clone();
        other.world_size = 4;
        let e = resume_position(&s, Some(&state(0, 0, &other)), 3).unwrap_err();
        assert!(
            e.message.contains("`world_size`") && e.message.contains("saved 4"),
            "{e}"
        );
        let mut st = state(0, 0, &s);
        st.seed = 5;
        assert!(
            resume_position(&s, Some(&st), 3)
                .unwrap_err()
                .message
                .contains("`seed`")
        );
    }

    #[test]
    fn a_state_of_another_kind_of_stream_is_refused_naming_that_kind() {
        use shardwire_protocol::trainer::MixState;
        // Before: "state fingerprint differs in `v1`: saved (missing), stream has " (shard
        // mode) and "differs in `digest`: saved (missing)" (batch mode): no kind named.
        let s = spec();
        let mut st = state(0, 0, &s);
        st.fingerprint = "v2;digest=0101010101010101;samples=40;seed=4;global_batch=4".into();
        let e = resume_position(&s, Some(&st), 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::StateMismatch);
        assert!(
            e.message
                .starts_with("the state was saved by a batch-mode stream (batch_size)"),
            "{e}"
        );
        st.fingerprint = "v2;mix=a+b;global_batch=4;seed=4".into();
        st.mix = Some(MixState {
            step: 0,
            datasets: vec!["a".into(), "b".into()],
            weights: vec![1 << 39, 1 << 39],
            cursors: vec![0, 0],
            carry: vec![0, 0],
        });
        let e = resume_position(&s, Some(&st), 3).unwrap_err();
        assert!(e.message.contains("saved by a mixture"), "{e}");
        // A batch-mode stream of one dataset, resumed from the mixture's state.
        let o = SampleOrder::new([1; 32], vec![40], 4, Shuffle::Block, 8, 1).unwrap();
        let plan = BatchPlan::new(Arc::new(o), 4, 1, 0, false).unwrap();
        let fingerprint = plan.fingerprint(&[1; 32]);
        let e = resume_batches(&plan, &fingerprint, Some(&st), (3, 1)).unwrap_err();
        assert_eq!(e.code, ErrorCode::StateMismatch);
        assert!(
            e.message
                .starts_with("the state was saved by a mixture (mix)"),
            "{e}"
        );
        // Its own state still resumes.
        let mut own = state(0, 2, &s);
        own.fingerprint = fingerprint.clone();
        own.cursor = Some(8);
        assert_eq!(
            resume_batches(&plan, &fingerprint, Some(&own), (3, 1)).unwrap(),
            2
        );
    }

    #[test]
    fn the_end_of_the_run_is_a_resume_point_only_at_indexes_its_workers_save() {
        // 40 samples in global batches of 4: 10 steps an epoch, 3 epochs.
        let o = SampleOrder::new([1; 32], vec![40], 4, Shuffle::Block, 8, 1).unwrap();
        let plan = BatchPlan::new(Arc::new(o), 4, 1, 0, false).unwrap();
        let fingerprint = plan.fingerprint(&[1; 32]);
        let at = |index: u64| StreamState {
            epoch: 3,
            index,
            seed: 4,
            fingerprint: fingerprint.clone(),
            cursor: None,
            partitions: None,
            shuffle_block: None,
            mix: None,
        };
        let resume = |index: u64, workers: u32| {
            resume_batches(&plan, &fingerprint, Some(&at(index)), (3, workers))
        };
        // After the last batch: index 0, or a worker's next slot (below num_workers).
        assert_eq!(resume(0, 1).unwrap(), 30);
        assert_eq!(resume(2, 3).unwrap(), 32);
        // Before: accepted for any index of the epoch, and the stream was empty.
        for (index, workers) in [(1, 1), (3, 3), (9, 3)] {
            let e = resume(index, workers).unwrap_err();
            assert_eq!(e.code, ErrorCode::StateMismatch);
            let m = &e.message;
            assert!(
                m.contains(&format!("epoch 3 index {index} is at the end")),
                "{m}"
            );
            assert!(m.contains(&format!("an index below {workers}")), "{m}");
        }
        // Past the epoch's steps: the caller's own words, as before.
        let e = resume(10, 3).unwrap_err();
        assert!(e.message.contains("step 10 is outside"), "{}", e.message);
    }

    /// 64 shards of 4 documents of 4 tokens (4096 bytes each), windows of 63 tokens (each
    /// reaching up to 5 shards past its document block), blocks of `shuffle_block`
    /// documents, batches of one window.
    fn windows_of(shuffle_block: u64) -> (Manifest, BatchPlan) {
        use shardwire_protocol::manifest::ShardEntry;
        use shardwire_protocol::samples::WindowSpec;
        let m = Manifest::new(
            (0..64)
                .map(|i| ShardEntry {
                    file: format!("s{i}.bin"),
                    offset: 0,
                    length: 4096,
                    crc32c: 0,
                    tensors: Vec::new(),
                })
                .collect(),
        );
        let spec = WindowSpec {
            seq_len: 63,
            column: "tokens".into(),
            doc_tokens: vec![vec![4; 4]; 64],
            megatron: false,
        };
        let o = SampleOrder::windows([3; 32], spec, 5, Shuffle::Block, shuffle_block, 1).unwrap();
        (m, BatchPlan::new(Arc::new(o), 1, 1, 0, false).unwrap())
    }

    #[test]
    fn the_shuffle_block_a_token_mode_refusal_suggests_fits_its_blocks() {
        // Room for 10 shards: a block of b documents reads ceil(b / 4) + 1 + 5 shards.
        let (_, plan) = windows_of(64);
        let suggested = largest_block(&plan.order, 10).unwrap();
        // Before: 36 (room - 1 shards of 4 documents), whose blocks read 9 + 1 + 5 shards.
        assert_eq!(suggested, 16);
        let (_, fits) = windows_of(suggested);
        assert_eq!(block_shards(&fits.order), 10);
        let (_, over) = windows_of(suggested + 1);
        assert_eq!(block_shards(&over.order), 11, "the largest");
        // Not even a block of one shard: no suggestion.
        assert_eq!(largest_block(&plan.order, 6), None);
    }

    #[test]
    fn default_partitions_past_the_samples_or_the_limit_divide_the_world_size() {
        // Before: 100 rows on 128 ranks was refused as "partitions is 128", a field the
        // request never set.
        let m = Manifest::new(Vec::new());
        let mut r = StreamRequest::new("web");
        (r.batch_size, r.world_size) = (Some(1), 128);
        let (o, _) = sample_order(&m, &r, &[100], 128, false).unwrap();
        assert_eq!(o.partitions, 64);
        assert!(BatchPlan::new(Arc::new(o), 1, 128, 0, false).is_ok());
        // Past 2^20 ranks (as TRAINER_API.md says): the largest divisor within it.
        assert_eq!(default_partitions(3 << 20, u64::MAX), 1 << 20);
        assert_eq!(default_partitions(8, 100), 8);
        // Named, it is taken as given (and refused).
        r.partitions = Some(128);
        assert!(sample_order(&m, &r, &[100], 128, false).is_err());
    }

    #[test]
    fn a_huge_shuffle_block_saturates_instead_of_wrapping() {
        use shardwire_protocol::samples::{SampleOrder, Shuffle};
        // Shards of one row: the block spans u64::MAX shards; `+ 1` wrapped to 0 (release)
        // or panicked the open task (debug).
        let o = SampleOrder::new([1; 32], vec![1, 1, 1], 3, Shuffle::Block, u64::MAX, 1).unwrap();
        assert_eq!(block_shards(&o), u64::MAX);
        let o = SampleOrder::new([1; 32], vec![4, 4], 3, Shuffle::Block, 8, 1).unwrap();
        assert_eq!(block_shards(&o), 3);
    }
}
