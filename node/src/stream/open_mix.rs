//! The checks of opening a mixture stream (`mix: [{dataset, weight}]`, see [`super::mix`]):
//! the weights, every dataset's order, that the datasets' samples agree (the same tensors,
//! or token windows of one dtype), the resume state (same datasets and global batch; the
//! weights may change, where the rank is one stream: not split among DataLoader workers), and
//! the region.

use std::sync::Arc;

use shardwire_gpu::SlabPool;
use shardwire_protocol::Manifest;
use shardwire_protocol::plan::compare_fingerprints;
use shardwire_protocol::samples::mix::{ONE, carry_is_valid, fixed_weights};
use shardwire_protocol::samples::{BlockKeys, SampleOrder};
use shardwire_protocol::trainer::{ErrorCode, MixEntry, MixState, StreamRequest};

use super::error::OpenError;
use super::kind::{BatchMode, Kind, Sampler};
use super::layout::Layout;
use super::mix::{MixPart, Mixture, Point};
use super::open::{Outside, block_shards, check_workers, max_class, sample_order};
use super::peak;
use super::supply::{READY_AHEAD, ready_ahead};
use super::tokens::TokenMode;

fn bad(code: ErrorCode, msg: String) -> OpenError {
    OpenError::new(code, format!("mix: {msg}"))
}

/// A mixture of `parts` (each dataset's name and manifest, in the request's order) whose
/// stream manifest is `combined` (`Manifest::mixture`); returns the stream's kind, its start
/// position and fingerprint.
pub fn mix_mode(
    parts: &[(String, Arc<Manifest>)],
    combined: &Manifest,
    r: &StreamRequest,
    batch_size: u32,
    region_bytes: u64,
    cuda: bool,
) -> Result<(Kind, u64, String), OpenError> {
    let entries: &[MixEntry] = r.mix.as_deref().unwrap_or_default();
    let names: Vec<&str> = entries.iter().map(|e| e.dataset.as_str()).collect();
    let weights: Vec<f64> = entries.iter().map(|e| e.weight).collect();
    let q =
        fixed_weights(&names, &weights).map_err(|e| bad(ErrorCode::BadRequest, e.to_string()))?;
    check_workers(r)?;
    if batch_size == 0 || r.world_size == 0 || r.rank >= r.world_size {
        return Err(bad(
            ErrorCode::BadPlan,
            format!(
                "batch_size {batch_size}, rank {}, world_size {}: batch_size and world_size must be at least 1 and rank below world_size",
                r.rank, r.world_size
            ),
        ));
    }
    // Rows: every dataset's samples hold the same tensors (checked over all their shards);
    // token windows: only the documents' tensor is read.
    let layout = match r.seq_len {
        None => Layout::of(combined).map_err(|e| bad(e.code, e.message))?,
        Some(_) => {
            let mut all: Option<Layout> = None;
            for (name, m) in parts {
                let l = Layout::of(m)
                    .map_err(|e| bad(e.code, format!("dataset {name:?}: {}", e.message)))?;
                match &mut all {
                    None => all = Some(l),
                    Some(a) => a.shard_rows.extend(l.shard_rows),
                }
            }
            all.ok_or_else(|| bad(ErrorCode::BadRequest, "no datasets".into()))?
        }
    };
    let mut orders = Vec::with_capacity(parts.len());
    let mut tokens: Option<TokenMode> = None;
    let mut first = 0u32;
    for (name, m) in parts {
        let rows = &layout.shard_rows[first as usize..first as usize + m.shards.len()];
        if r.seq_len.is_none() && rows.iter().all(|&n| n == 0) {
            return Err(no_samples(name));
        }
        let (mut order, t) = sample_order(m, r, rows, 1, cuda)
            .map_err(|e| bad(e.code, format!("dataset {name:?}: {}", e.message)))?;
        if let Some(st) = &r.state {
            // A state saved before the fingerprint named the block keys resumes with those.
            order.block_keys = BlockKeys::of_state(&st.fingerprint, &format!("{name}."));
        }
        if let Some(t) = t {
            tokens = Some(merge_tokens(tokens, t, name, first)?);
        }
        orders.push(MixPart {
            name: name.clone(),
            order: Arc::new(order),
            first_shard: first,
        });
        first += m.shards.len() as u32;
    }
    let (mix, fingerprint) = schedule(orders, q, r, batch_size, parts)?;
    check_megatron_seeds(&mix, r)?;
    let start = resume_position(r, &mix, &fingerprint)?;
    let mut mode = BatchMode::new(Sampler::Mix(Box::new(mix)), r, layout, tokens);
    let Sampler::Mix(mix) = &mode.sampler else {
        unreachable!("just made")
    };
    mode.ready_ahead = check_window(combined, mix, mode.batch_bytes, region_bytes)?;
    Ok((Kind::Batches(Arc::new(mode)), start, fingerprint))
}

/// A rows dataset of a mixture none of whose shards has a row (token windows: refused by its
/// own [`Layout::of`]); `sample_order` refused it naming `partitions`, a field never set.
fn no_samples(name: &str) -> OpenError {
    bad(
        ErrorCode::BadRequest,
        format!(
            "dataset {name:?} has no samples (every shard has 0 rows); leave it out of the mixture"
        ),
    )
}

/// The token mode of the datasets so far and of `name` (from shard `first` on): one dtype.
fn merge_tokens(
    so_far: Option<TokenMode>,
    t: TokenMode,
    name: &str,
    first: u32,
) -> Result<TokenMode, OpenError> {
    let Some(mut m) = so_far else {
        return Ok(TokenMode {
            tensors: vec![(first, t.tensors[0].1)],
            ..t
        });
    };
    if m.src != t.src {
        return Err(bad(
            ErrorCode::BadRequest,
            format!(
                "dataset {name:?} holds {} tokens, the datasets before it {}; a mixture's datasets need one token dtype (index them with the same dtype)",
                t.src.name(),
                m.src.name()
            ),
        ));
    }
    m.tensors.push((first, t.tensors[0].1));
    Ok(m)
}

/// Where the schedule starts: step 0, or the resume state's point (its carry kept only if
/// the weights are unchanged). `samples`: each dataset's samples per epoch.
fn resume_point(r: &StreamRequest, q: &[i128], samples: &[u64]) -> Result<Point, OpenError> {
    let n = samples.len();
    let Some(st) = r.state.as_ref() else {
        return Ok(Point {
            step: 0,
            cursors: vec![0; n],
            carry: vec![0; n],
        });
    };
    let Some(ms) = &st.mix else {
        return Err(bad(
            ErrorCode::StateMismatch,
            "the state was saved by a stream of one dataset; it cannot resume a mixture".into(),
        ));
    };
    let names: Vec<&str> = r.mix.iter().flatten().map(|e| e.dataset.as_str()).collect();
    if ms.datasets != names || ms.cursors.len() != n || ms.carry.len() != n {
        return Err(bad(
            ErrorCode::StateMismatch,
            format!(
                "the state's datasets are {:?}, the request's {names:?}; a mixture resumes with the same datasets in the same order (weights may change)",
                ms.datasets
            ),
        ));
    }
    if !carry_is_valid(&ms.carry, n) {
        return Err(bad(
            ErrorCode::StateMismatch,
            format!(
                "the state's mix carry {:?} is not a schedule's (it sums to 0, each within 4 samples of 2^40 units); pass the state as the stream saved it",
                ms.carry
            ),
        ));
    }
    if let Some((d, &c)) = ms
        .cursors
        .iter()
        .enumerate()
        .find(|&(d, &c)| !cursor_is_valid(c, samples[d]))
    {
        return Err(bad(
            ErrorCode::StateMismatch,
            format!(
                "the state's mix cursor {c} of dataset {:?} ({} samples an epoch) is past any schedule's (epoch {}); pass the state as the stream saved it",
                ms.datasets[d],
                samples[d],
                c / samples[d].max(1)
            ),
        ));
    }
    let same = ms
        .weights
        .iter()
        .map(|&w| i128::from(w))
        .eq(q.iter().copied());
    if !same {
        check_saved_weights(ms, n)?;
        check_weight_change(r, ms, q)?;
        tracing::info!(
            saved = ?ms.weights, now = ?q, step = ms.step, epoch = st.epoch, index = st.index,
            "mixture weights changed: the schedule reaches the state's position under the saved weights, and every dataset continues from its cursor there under the new weights"
        );
    }
    Ok(Point {
        step: ms.step,
        cursors: ms.cursors.clone(),
        carry: match same {
            true => ms.carry.iter().map(|&c| i128::from(c)).collect(),
            false => vec![0; n],
        },
    })
}

/// Refuses saved weights that no schedule has: one per dataset, each at least 2^-40 (as
/// `fixed_weights` makes them), summing to exactly one. A state at the schedule's start is
/// played to its position under them ([`from_the_start`]), and a zero weight would divide by
/// zero there.
fn check_saved_weights(ms: &MixState, n: usize) -> Result<(), OpenError> {
    let valid = ms.weights.len() == n
        && ms.weights.iter().all(|&w| w >= 1)
        && ms.weights.iter().map(|&w| i128::from(w)).sum::<i128>() == ONE;
    if valid {
        return Ok(());
    }
    Err(bad(
        ErrorCode::StateMismatch,
        format!(
            "the state's mix weights {:?} are not a schedule's (one per dataset of the {n}, each at least 1, summing to 2^40); pass the state as the stream saved it",
            ms.weights
        ),
    ))
}

/// Refuses new weights for a DataLoader worker's stream (`num_workers` > 1): new weights
/// restart the schedule at the state's step from its cursors, and each worker's state is at
/// another step (its own next batch), so the workers' new schedules would overlap and leave
/// gaps in every dataset for the rest of the run. A state at the schedule's start (step 0,
/// no sample taken: a `set_epoch` or `open_at_epoch` state) is the same for every worker.
fn check_weight_change(r: &StreamRequest, ms: &MixState, q: &[i128]) -> Result<(), OpenError> {
    let at_start = ms.step == 0 && ms.cursors.iter().all(|&c| c == 0);
    if r.num_workers <= 1 || at_start {
        return Ok(());
    }
    let share = |w: i128| w as f64 / ONE as f64;
    let saved: Vec<f64> = ms.weights.iter().map(|&w| share(i128::from(w))).collect();
    let asked: Vec<f64> = q.iter().map(|&w| share(w)).collect();
    Err(bad(
        ErrorCode::StateMismatch,
        format!(
            "the state's weights are {saved:?}, the request's {asked:?}, and this stream is worker {} of num_workers {}: changing a mixture's weights on resume needs num_workers 1, as each DataLoader worker's state is at another step (their new schedules would repeat and skip samples); resume with the saved weights, or change weights only in runs with num_workers=0 in the DataLoader (one stream per rank)",
            r.worker, r.num_workers
        ),
    ))
}

/// The mixture's schedule, based where the request's state says (played there when the
/// state is at the schedule's start), and its fingerprint; a state of another plan is refused
/// before any replay (the fingerprint does not depend on the point the schedule is based at;
/// a replay to a far position could run for days).
fn schedule(
    orders: Vec<MixPart>,
    q: Vec<i128>,
    r: &StreamRequest,
    batch_size: u32,
    parts: &[(String, Arc<Manifest>)],
) -> Result<(Mixture, String), OpenError> {
    let samples: Vec<u64> = orders.iter().map(|p| p.order.total()).collect();
    let base = resume_point(r, &q, &samples)?;
    let mix = Mixture::new(orders, q, (batch_size, r.world_size, r.rank), base);
    let fingerprint = fingerprint(&mix, parts);
    if let Some(st) = &r.state {
        compare_fingerprints(&fingerprint, &st.fingerprint)
            .map_err(|m| bad(ErrorCode::StateMismatch, m))?;
    }
    let mix = from_the_start(mix, r)?;
    if mix.steps == 0 {
        let total = mix
            .parts
            .iter()
            .fold(0u64, |a, p| a.saturating_add(p.order.total()));
        return Err(bad(
            ErrorCode::BadPlan,
            format!(
                "the datasets' {total} samples make no global batch of {} (batch_size x world_size)",
                mix.global_batch()
            ),
        ));
    }
    Ok((mix, fingerprint))
}

/// A Megatron-ordered dataset of a mixture goes through its own epochs as its cursor does,
/// faster than the mixture's when its weight is above its share of the data; its epoch `e`
/// is seeded `seed + e` (a 32-bit RandomState seed). Bounded by every slot of every step the
/// stream covers going to it: past `u32::MAX` its epochs would wrap into seed 0's order.
fn check_megatron_seeds(mix: &Mixture, r: &StreamRequest) -> Result<(), OpenError> {
    // `r` for its epochs; each order carries the seed it was built with.
    let slots = u64::from(r.epochs)
        .saturating_mul(mix.steps)
        .saturating_mul(mix.global_batch());
    for p in &mix.parts {
        if !p.order.window_spec().is_some_and(|w| w.megatron) {
            continue;
        }
        let passes = slots.div_ceil(p.order.total().max(1));
        let seed = p.order.seed; // the request's, as the order was built with it
        if seed.saturating_add(passes.saturating_sub(1)) > u64::from(u32::MAX) {
            return Err(bad(
                ErrorCode::BadPlan,
                format!(
                    "dataset {:?} (order megatron) may go through {passes} epochs of its own in \
                     this stream, seeded seed + epoch: seed {seed} + {} passes {}; lower seed",
                    p.name,
                    passes - 1,
                    u32::MAX
                ),
            ));
        }
    }
    Ok(())
}

/// Most global steps, and most samples (steps x global batch), an open replays the schedule
/// from its start ([`from_the_start`]): each slot costs a `counts` turn (about 6.5 us a step
/// of 1024 samples over 2 datasets, more with more datasets), and every 1024 steps a kept
/// checkpoint. 2^33 samples is about a minute over 2 datasets: a run of a million steps of
/// 8192 samples; 2^26 steps keep 65536 checkpoints.
const MAX_REPLAY_STEPS: u64 = 1 << 26;
/// See [`MAX_REPLAY_STEPS`].
const MAX_REPLAY_SAMPLES: u64 = 1 << 33;

/// `mix` based at the state's position when the state's mixture point is the schedule's
/// start while its position is later: the state of a stream that has delivered nothing (a
/// probe's), moved to another epoch (`{epoch: e, index: 0}`, as the SDK's `set_epoch` and
/// `open_at_epoch` do). The schedule from the start is played to that step under the
/// state's weights (the same as a stream run from the start would have had); where the
/// request's weights differ, the schedule goes on from there under them, every dataset from
/// its cursor (carry reset), as a resume from a state saved at that step does. A position
/// whose index would not fit, or past what an open replays, is refused first: nothing else
/// bounds the replay (a state may name epoch 2^32 - 2).
fn from_the_start(mix: Mixture, r: &StreamRequest) -> Result<Mixture, OpenError> {
    let Some(st) = r.state.as_ref() else {
        return Ok(mix);
    };
    let at_start = mix.base.step == 0
        && mix.base.cursors.iter().all(|&c| c == 0)
        && mix.base.carry.iter().all(|&c| c == 0);
    let pos = u64::from(st.epoch)
        .saturating_mul(mix.steps)
        .saturating_add(st.index);
    // A position past the stream is refused by `resume_position` with the numbers.
    let outside = super::open::outside(st.epoch, st.index, mix.steps, r.epochs, r.num_workers);
    if !at_start || pos == 0 || outside.is_some() {
        return Ok(mix);
    }
    // The node checks it again after the open; before the replay, it bounds it.
    super::open::check_index_fits(mix.steps, u64::from(mix.batch_size), r.epochs)?;
    // Played under the state's weights (checked by `resume_point` where they differ):
    // replaying under the request's gave each dataset another cursor at `pos`, so the new
    // weights repeated some samples and skipped others.
    let q = mix.q.clone();
    let saved: Option<Vec<i128>> = st
        .mix
        .as_ref()
        .map(|m| m.weights.iter().map(|&w| i128::from(w)).collect());
    let played = match saved {
        Some(w) if w != q => {
            let who = (mix.batch_size, mix.world_size, mix.rank);
            Mixture::new(mix.parts, w, who, mix.base)
        }
        _ => mix,
    };
    // What is played is the way from the nearest checkpoint a stream of this schedule reached
    // (the previous epoch's open left them up to its position), not from step 0.
    let from = played.nearest_step(pos);
    let (steps, samples) = (
        pos - from,
        (pos - from).saturating_mul(played.global_batch()),
    );
    if steps > MAX_REPLAY_STEPS || samples > MAX_REPLAY_SAMPLES {
        return Err(bad(
            ErrorCode::BadRequest,
            format!(
                "state position epoch {} step {} is global step {pos} of a schedule the state has at its start (a state made by set_epoch or open_at_epoch); the nearest point this node knows is step {from}, and an open replays at most {MAX_REPLAY_STEPS} steps and {MAX_REPLAY_SAMPLES} samples ({steps} steps, {samples} samples here); resume from a state a stream saved near that position, or open the epochs in turn",
                st.epoch, st.index
            ),
        ));
    }
    // From the nearest checkpoint another stream of this node reached (`schedules`); a
    // replay from step 0 still takes milliseconds per thousand steps: off the runtime's
    // workers' other tasks.
    let mut point = tokio::task::block_in_place(|| played.point(pos));
    if played.q != q {
        // The new weights from here: each dataset goes on from its cursor, the carry reset.
        point.carry = vec![0; point.carry.len()];
    }
    let who = (played.batch_size, played.world_size, played.rank);
    Ok(Mixture::new(played.parts, q, who, point))
}

/// Whether a dataset's resumed cursor (samples it has given) is one a schedule can reach and
/// go on from: its epoch fits the 32 bits epochs are counted in, and the cursor leaves room
/// to count on (at most half of `u64`).
fn cursor_is_valid(cursor: u64, samples: u64) -> bool {
    let epochs_fit = samples
        .checked_mul(u64::from(u32::MAX))
        .is_none_or(|end| cursor < end);
    epochs_fit && cursor <= u64::MAX / 2
}

/// The state's stream position, checked against the fingerprint and the schedule.
fn resume_position(r: &StreamRequest, mix: &Mixture, fingerprint: &str) -> Result<u64, OpenError> {
    let Some(st) = r.state.as_ref() else {
        return Ok(0);
    };
    let mismatch = |m: String| bad(ErrorCode::StateMismatch, m);
    compare_fingerprints(fingerprint, &st.fingerprint).map_err(mismatch)?;
    match super::open::outside(st.epoch, st.index, mix.steps, r.epochs, r.num_workers) {
        None => {}
        Some(Outside::AfterTheEnd(e)) => return Err(mismatch(e.to_string())),
        Some(Outside::Past) => {
            return Err(mismatch(format!(
                "state position epoch {} step {} is outside this stream ({} epochs of {} steps)",
                st.epoch, st.index, r.epochs, mix.steps
            )));
        }
    }
    let pos = u64::from(st.epoch)
        .checked_mul(mix.steps)
        .and_then(|p| p.checked_add(st.index))
        .ok_or_else(|| {
            mismatch(format!(
                "state position epoch {} step {} is past the last countable step",
                st.epoch, st.index
            ))
        })?;
    if mix.base.step != pos {
        return Err(mismatch(format!(
            "the state's mixture point is step {}, its position epoch {} step {} is step {pos}",
            mix.base.step, st.epoch, st.index
        )));
    }
    Ok(pos)
}

/// The readable fingerprint of a mixture: its datasets' plans and the global batch, never
/// the weights (a resume may change them) nor the world size.
fn fingerprint(mix: &Mixture, parts: &[(String, Arc<Manifest>)]) -> String {
    let names: Vec<&str> = parts.iter().map(|(n, _)| n.as_str()).collect();
    let mut f = format!(
        "v2;mix={};global_batch={};seed={}",
        names.join("+"),
        mix.global_batch(),
        mix.parts.first().map_or(0, |p| p.order.seed)
    );
    for (p, (_, m)) in mix.parts.iter().zip(parts) {
        f += &part_fields(&p.name, &p.order, m);
    }
    f
}

fn part_fields(name: &str, o: &SampleOrder, m: &Manifest) -> String {
    let windows = match o.window_spec() {
        Some(w) => format!(
            "{}:{}{}",
            w.column,
            w.seq_len,
            if w.megatron { ":megatron" } else { "" }
        ),
        None => "rows".into(),
    };
    let keys = if o.names_block_keys() {
        format!(";{name}.{}", BlockKeys::FIELD)
    } else {
        String::new()
    };
    format!(
        ";{name}.digest={};{name}.samples={};{name}.shuffle={};{name}.shuffle_block={};{name}.partitions={};{name}.windows={windows}{keys}",
        m.digest.get(..16).unwrap_or(&m.digest),
        o.total(),
        o.shuffle.as_str(),
        o.shuffle_block,
        o.partitions
    )
}

/// Steps, from where a mixture stream starts, over which the open check measures the most
/// one step reads at once.
const PEAK_STEPS: u64 = 4096;

/// Checks that the region holds every dataset's current blocks (all partitions: every rank
/// of a mixture reads them all), the batch the trainer holds and [`READY_AHEAD`] more;
/// returns how many assembled batches the stream keeps ready ([`ready_ahead`]).
fn check_window(
    m: &Manifest,
    mix: &Mixture,
    batch_bytes: u64,
    region_bytes: u64,
) -> Result<usize, OpenError> {
    super::open::check_batch_fits(batch_bytes, region_bytes)?;
    let max_class = max_class(m);
    let shards: u64 = mix
        .parts
        .iter()
        .map(|p| {
            u64::from(p.order.partitions)
                .saturating_mul(block_shards(&p.order).saturating_add(1))
                .min(p.order.shard_samples().len() as u64)
        })
        .sum();
    let class = SlabPool::class_size(batch_bytes as usize) as u64;
    // One step reads every shard its samples come from at once: with Megatron's order (its
    // windows drawn from the whole dataset) or a dataset giving many samples per step, more
    // than the blocks above. Measured over the steps from where the stream starts (the
    // schedule's draws are alike across an epoch; a later step that needs more closes the
    // stream `DoesNotFit`).
    let units = tokio::task::block_in_place(|| mix.units_within(mix.base_epoch(), PEAK_STEPS));
    let step = peak::peak(m, &units, u64::from(mix.batch_size));
    let blocks = shards.saturating_mul(max_class).max(step.bytes);
    let need = blocks.saturating_add((READY_AHEAD as u64 + 1) * class);
    if need <= region_bytes {
        return Ok(ready_ahead(region_bytes, blocks, class));
    }
    if step.bytes > shards.saturating_mul(max_class) {
        return Err(bad(
            ErrorCode::NoMemory,
            format!(
                "needs stream_memory of at least {need} bytes: one step's {} samples read {} shards of {} slab bytes at once, plus {} batch slabs of {class} bytes; stream_memory is {region_bytes}; raise stream_memory or lower batch_size",
                mix.batch_size,
                step.shards,
                step.bytes,
                READY_AHEAD + 1,
            ),
        ));
    }
    Err(bad(
        ErrorCode::NoMemory,
        format!(
            "needs stream_memory of at least {need} bytes: the current blocks of every dataset ({shards} shards of slab class {max_class}) plus {} batch slabs of {} bytes; stream_memory is {region_bytes}; lower shuffle_block or raise stream_memory",
            READY_AHEAD + 1,
            SlabPool::class_size(batch_bytes as usize)
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::mix::MixSample;
    use super::*;
    use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry};
    use shardwire_protocol::trainer::{MixState, StreamState};

    /// `shards` shards of 8 rows of 4 bytes.
    fn manifest(shards: u32) -> Arc<Manifest> {
        Arc::new(Manifest::new(
            (0..shards)
                .map(|i| ShardEntry {
                    file: format!("s{i}.bin"),
                    offset: 0,
                    length: 32,
                    crc32c: 0,
                    tensors: vec![TensorEntry::dense(
                        "x".into(),
                        DType::Uint8,
                        vec![8, 4],
                        0,
                        32,
                    )],
                })
                .collect(),
        ))
    }

    /// Datasets `a` and `b` of `shards_a` and `shards_b` shards, and a request mixing them
    /// half and half.
    fn halves(
        shards_a: u32,
        shards_b: u32,
    ) -> (Vec<(String, Arc<Manifest>)>, Manifest, StreamRequest) {
        mixed_halves(("a", manifest(shards_a)), ("b", manifest(shards_b)))
    }

    /// Two named datasets and a request mixing them half and half.
    fn mixed_halves(
        (na, a): (&str, Arc<Manifest>),
        (nb, b): (&str, Arc<Manifest>),
    ) -> (Vec<(String, Arc<Manifest>)>, Manifest, StreamRequest) {
        let parts = vec![
            (na.to_owned(), Arc::clone(&a)),
            (nb.to_owned(), Arc::clone(&b)),
        ];
        let combined = Manifest::mixture(&[(na, &a), (nb, &b)]);
        let mut r = StreamRequest::new("mix");
        r.mix = Some(vec![
            MixEntry {
                dataset: na.into(),
                weight: 0.5,
            },
            MixEntry {
                dataset: nb.into(),
                weight: 0.5,
            },
        ]);
        (parts, combined, r)
    }

    #[test]
    fn the_least_region_an_open_accepts_holds_what_one_step_reads() {
        // Blocks of one shard (8 rows), and steps of 64 samples: each step reads about 4
        // blocks of each dataset at once, more than the blocks the check counted before.
        let (parts, combined, mut r) = halves(64, 64);
        r.shuffle_block = Some(8);
        let opens = |region: u64| mix_mode(&parts, &combined, &r, 64, region, false);
        let (mut lo, mut hi) = (1u64, 1 << 30);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match opens(mid) {
                Ok(_) => hi = mid,
                Err(_) => lo = mid + 1,
            }
        }
        let (Kind::Batches(mode), ..) = opens(lo).unwrap() else {
            panic!("batch mode")
        };
        let Sampler::Mix(mix) = &mode.sampler else {
            panic!("a mixture")
        };
        let class = SlabPool::class_size(32) as u64;
        let most = mix
            .units(0)
            .iter()
            .map(|u| u.shards.len() as u64)
            .max()
            .unwrap();
        assert!(
            most > 4,
            "steps read {most} shards: the case this test is about"
        );
        let batch = SlabPool::class_size(mode.batch_bytes as usize) as u64;
        assert!(
            lo >= most * class + (READY_AHEAD as u64 + 1) * batch,
            "accepted {lo} bytes, where one step reads {most} shards of {class}"
        );
        let e = opens(lo - 1).err().unwrap();
        assert!(
            e.message.contains("one step's 64 samples read"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_megatron_dataset_whose_own_epochs_would_wrap_the_seed_is_refused() {
        use shardwire_protocol::samples::{Shuffle, WindowSpec};
        // A big dataset of rows and a small Megatron one (a few windows) at half each: the
        // small one goes through many epochs of its own per mixture epoch.
        let mixture = |seed: u64| {
            let big = SampleOrder::new([1; 32], vec![1000], seed, Shuffle::Block, 100, 1);
            let spec = WindowSpec {
                seq_len: 4,
                column: "tokens".into(),
                doc_tokens: vec![vec![9; 5]],
                megatron: true,
            };
            let small = SampleOrder::windows([2; 32], spec, seed, Shuffle::Block, 1, 1).unwrap();
            assert!(small.total() < 20, "{} windows", small.total());
            let parts = vec![
                MixPart {
                    name: "big".into(),
                    order: Arc::new(big.unwrap()),
                    first_shard: 0,
                },
                MixPart {
                    name: "small".into(),
                    order: Arc::new(small),
                    first_shard: 1,
                },
            ];
            let q = fixed_weights(&["big", "small"], &[0.5, 0.5]).unwrap();
            let base = Point {
                step: 0,
                cursors: vec![0, 0],
                carry: vec![0, 0],
            };
            Mixture::new(parts, q, (10, 1, 0), base)
        };
        let r = StreamRequest::new("mix");
        // Before: accepted (the check bounded only seed + epochs - 1 = u32::MAX), and the
        // small dataset's second pass was seed 0's order.
        let e = check_megatron_seeds(&mixture(u64::from(u32::MAX)), &r).unwrap_err();
        let m = &e.message;
        assert!(m.contains("dataset \"small\" (order megatron)"), "{m}");
        assert!(m.contains("seed 4294967295 + "), "{m}");
        assert!(check_megatron_seeds(&mixture(7), &r).is_ok());
    }

    #[test]
    fn a_state_of_another_plan_is_refused_before_any_replay_to_its_position() {
        let (parts, combined, mut r) = halves(2, 3);
        r.batch_size = Some(4);
        r.epochs = u32::MAX;
        r.state = Some(StreamState {
            epoch: u32::MAX - 1,
            index: 0,
            seed: 0,
            fingerprint: "not this plan".into(),
            cursor: None,
            partitions: None,
            shuffle_block: None,
            mix: Some(MixState {
                step: 0,
                datasets: vec!["a".into(), "b".into()],
                weights: vec![1 << 39, 1 << 39],
                cursors: vec![0, 0],
                carry: vec![0, 0],
            }),
        });
        // Before: the schedule was played to step (2^32 - 2) x steps first (hours), and
        // the fingerprint compared after.
        let e = refused_at_once(parts, combined, r);
        assert_eq!(e.code, ErrorCode::StateMismatch, "{}", e.message);
    }

    /// The error `mix_mode` refuses `r` with, within 10 s (a replay of the schedule first
    /// would take hours).
    fn refused_at_once(
        parts: Vec<(String, Arc<Manifest>)>,
        combined: Manifest,
        r: StreamRequest,
    ) -> OpenError {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let got = mix_mode(&parts, &combined, &r, 4, 1 << 30, false).map(|_| ());
            let _ = tx.send(got);
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("refused at once, not after a replay");
        got.unwrap_err()
    }

    #[test]
    fn a_state_of_this_plan_at_a_far_epoch_is_refused_before_any_replay() {
        let (parts, combined, mut r) = halves(2, 3);
        r.batch_size = Some(4);
        r.epochs = u32::MAX;
        let (.., fingerprint) = mix_mode(&parts, &combined, &r, 4, 1 << 30, false).unwrap();
        let at_epoch = |epoch: u32| StreamState {
            epoch,
            index: 0,
            seed: 0,
            fingerprint: fingerprint.clone(),
            cursor: None,
            partitions: None,
            shuffle_block: None,
            mix: Some(MixState {
                step: 0,
                datasets: vec!["a".into(), "b".into()],
                weights: vec![1 << 39, 1 << 39],
                cursors: vec![0, 0],
                carry: vec![0, 0],
            }),
        };
        // A near epoch is still played to.
        r.state = Some(at_epoch(3));
        let (_, start, _) = mix_mode(&parts, &combined, &r, 4, 1 << 30, false).unwrap();
        assert_eq!(start, 3 * 10, "10 steps an epoch");
        // Before: the schedule was played to step (2^32 - 2) x 10 (hours).
        r.state = Some(at_epoch(u32::MAX - 1));
        let e = refused_at_once(parts, combined, r);
        assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
        assert!(
            e.message.contains("epoch 4294967294 step 0"),
            "{}",
            e.message
        );
    }

    /// A state of datasets `a` and `b` saved at global step `step`, at half and half, with
    /// `cursors`.
    fn halves_state(step: u64, cursors: [u64; 2]) -> StreamState {
        StreamState {
            epoch: 0,
            index: step,
            seed: 0,
            fingerprint: String::new(),
            cursor: None,
            partitions: None,
            shuffle_block: None,
            mix: Some(MixState {
                step,
                datasets: vec!["a".into(), "b".into()],
                weights: vec![1 << 39, 1 << 39],
                cursors: cursors.to_vec(),
                carry: vec![0, 0],
            }),
        }
    }

    #[test]
    fn new_weights_are_refused_for_a_dataloader_workers_stream() {
        let (.., mut r) = halves(2, 2);
        let q = fixed_weights(&["a", "b"], &[0.75, 0.25]).unwrap();
        let samples = [16u64, 16];
        r.state = Some(halves_state(5, [20, 20]));
        // One stream per rank: every dataset goes on from its cursor under the new weights.
        let p = resume_point(&r, &q, &samples).unwrap();
        assert_eq!((p.step, p.cursors), (5, vec![20, 20]));
        // Before: accepted, each worker based at its own state's step (S, S + 1, ...), so the
        // workers' new schedules overlapped and left gaps.
        (r.worker, r.num_workers) = (1, 2);
        let e = resume_point(&r, &q, &samples).unwrap_err();
        assert_eq!(e.code, ErrorCode::StateMismatch, "{}", e.message);
        let m = &e.message;
        assert!(m.contains("[0.5, 0.5], the request's [0.75, 0.25]"), "{m}");
        assert!(m.contains("worker 1 of num_workers 2"), "{m}");
        assert!(m.contains("needs num_workers 1"), "{m}");
        // The saved weights still resume every worker.
        let same = fixed_weights(&["a", "b"], &[0.5, 0.5]).unwrap();
        assert_eq!(resume_point(&r, &same, &samples).unwrap().step, 5);
        // A state at the schedule's start is every worker's: new weights are taken.
        r.state = Some(halves_state(0, [0, 0]));
        assert!(resume_point(&r, &q, &samples).is_ok());
    }

    #[test]
    fn saved_weights_no_schedule_has_are_refused() {
        let (.., mut r) = halves(2, 2);
        let q = fixed_weights(&["a", "b"], &[0.75, 0.25]).unwrap();
        let mut st = halves_state(0, [0, 0]);
        st.mix.as_mut().unwrap().weights = vec![0, 1 << 40];
        r.state = Some(st);
        // Before: accepted (the saved weights were only compared with the request's).
        let e = resume_point(&r, &q, &[16, 16]).unwrap_err();
        assert_eq!(e.code, ErrorCode::StateMismatch, "{}", e.message);
        assert!(
            e.message
                .contains("mix weights [0, 1099511627776] are not a schedule's"),
            "{}",
            e.message
        );
    }

    /// Dataset `d`'s first `n` samples in its own order (its epochs in turn): what a stream
    /// of the mixture delivers of it when no sample is repeated or skipped.
    fn own_order(mix: &Mixture, d: usize, n: u64) -> Vec<MixSample> {
        let part = &mix.parts[d];
        let total = part.order.total();
        let mut out = Vec::new();
        for e in 0..n.div_ceil(total) {
            let ep = part.order.epoch(e as u32);
            for t in 0..total.min(n - e * total) {
                let mut s = ep.sample(t);
                s.shard += part.first_shard;
                out.push(MixSample::Row(s));
            }
        }
        out
    }

    #[test]
    fn new_weights_at_an_epoch_boundary_go_on_from_every_dataset_cursor() {
        // Two datasets of 1000 samples, a global batch of 8: 250 steps an epoch.
        let (parts, combined, mut r) = halves(125, 125);
        r.batch_size = Some(8);
        r.epochs = 2;
        let open = |r: &StreamRequest| {
            let (Kind::Batches(mode), start, fingerprint) =
                mix_mode(&parts, &combined, r, 8, 1 << 30, false).unwrap()
            else {
                panic!("batch mode")
            };
            (mode, start, fingerprint)
        };
        // Epoch 0 at half and half, from the start.
        let (first, _, fingerprint) = open(&r);
        let Sampler::Mix(a) = &first.sampler else {
            panic!("a mixture")
        };
        assert_eq!(a.steps, 250);
        // Epoch 1 at 0.75 and 0.25, from the state `set_epoch(1)` makes of a stream of
        // epoch 0's weights that delivered nothing: epoch 1, the schedule's start.
        r.state = Some(StreamState {
            epoch: 1,
            fingerprint,
            ..halves_state(0, [0, 0])
        });
        r.mix = Some(vec![
            MixEntry {
                dataset: "a".into(),
                weight: 0.75,
            },
            MixEntry {
                dataset: "b".into(),
                weight: 0.25,
            },
        ]);
        let (second, start, _) = open(&r);
        assert_eq!(start, 250);
        let Sampler::Mix(b) = &second.sampler else {
            panic!("a mixture")
        };
        // Before: epoch 0 was replayed under the new weights (cursors 1500 and 500), so a's
        // samples [1000, 1500) were never delivered and b's [500, 1000) twice.
        assert_eq!(b.base.cursors, vec![1000, 1000]);
        let mut got: [Vec<MixSample>; 2] = Default::default();
        for (m, steps) in [(a, 0..250u64), (b, 250..500)] {
            for step in steps {
                for (d, s) in m.samples(step) {
                    got[d].push(s);
                }
            }
        }
        assert_eq!((got[0].len(), got[1].len()), (1000 + 1500, 1000 + 500));
        for (d, seen) in got.iter().enumerate() {
            let want = own_order(a, d, seen.len() as u64);
            let wrong = seen.iter().zip(&want).position(|(s, w)| s != w);
            assert_eq!(
                wrong, None,
                "dataset {d}: each sample once, in its own order"
            );
        }
        assert_eq!(b.state(500).cursors, vec![2500, 1500]);
    }

    #[test]
    fn a_rows_dataset_of_no_samples_is_refused_naming_it() {
        let a = manifest(2);
        // A Parquet file of no rows: one shard of the same tensor with 0 rows.
        let empty = Arc::new(Manifest::new(vec![ShardEntry {
            file: "empty.bin".into(),
            offset: 0,
            length: 0,
            crc32c: 0,
            tensors: vec![TensorEntry::dense(
                "x".into(),
                DType::Uint8,
                vec![0, 4],
                0,
                0,
            )],
        }]));
        let (parts, combined, r) = mixed_halves(("a", a), ("empty", empty));
        let e = mix_mode(&parts, &combined, &r, 4, 1 << 30, false).unwrap_err();
        // Before: bad_plan, "partitions is 1; it must be between 1 and the dataset's 0
        // samples", a field the request never set.
        assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
        assert!(
            e.message.contains("dataset \"empty\" has no samples"),
            "{}",
            e.message
        );
    }

    #[test]
    fn cursors_past_the_last_countable_epoch_or_without_room_are_invalid() {
        assert!(cursor_is_valid(0, 60));
        assert!(cursor_is_valid(60 * u64::from(u32::MAX) - 1, 60));
        // Its epoch would be 2^32 - 1, and counting on would wrap the epoch to 0.
        assert!(!cursor_is_valid(60 * u64::from(u32::MAX), 60));
        // Datasets so large that every epoch fits: the room to count on still bounds it.
        assert!(cursor_is_valid(u64::MAX / 2, u64::MAX / 4));
        assert!(!cursor_is_valid(u64::MAX / 2 + 1, u64::MAX / 4));
    }
}
