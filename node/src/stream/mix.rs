//! Mixtures (DESIGN §10, mixing): a batch-mode stream over several datasets with weights.
//!
//! Each dataset keeps its own order (rows or token windows, `shuffle` as for one dataset,
//! one partition unless asked) and a *cursor*: how many of its samples the job has taken,
//! across its own epochs. Global step `s` holds `n_d` samples of dataset `d`, from
//! `samples::mix::counts` (exact shares, the rounding carried to the next step); its slots
//! interleave the datasets (`samples::mix::interleave`), slot `j` taking dataset `d`'s sample
//! at its cursor; rank `r` takes slots `[r * B, (r + 1) * B)`. So the step's set of samples
//! depends on the global batch only, never on the world size.
//!
//! A mixture epoch is `floor(sum of the datasets' samples / GB)` steps. A dataset whose
//! cursor passes the end of its epoch goes on with its next epoch (freshly shuffled): a
//! weight above a dataset's share of the samples repeats it, a weight below leaves part of
//! it for the next mixture epoch; nothing is skipped and nothing repeats early.
//!
//! The schedule is a function of the weights and of where it started: the state holds the
//! step, the cursors and the carry, so a resume with the same weights continues exactly,
//! and one with **changed weights** continues every dataset from its cursor under the new
//! weights (carry reset), with no sample repeated or skipped.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use shardwire_protocol::samples::mix::{counts, interleave};
use shardwire_protocol::samples::{EpochOrder, SampleOrder, SampleRef, TokenPiece, Unit};
use shardwire_protocol::trainer::MixState;

/// Points a mixture keeps of the steps last asked for ([`Mixture::point`]): more than the
/// batches a stream keeps ready (at most 8) and those its trainer holds.
const RECENT: usize = 64;

/// Steps between checkpoints of the schedule.
const CHECKPOINT: u64 = 1024;

/// Most checkpoints a schedule keeps: past it every other one goes (the spacing doubles), so
/// opens at ever later epochs grow neither the node's memory nor what each open copies
/// (2048 points of 64 datasets are about 3 MB) without bound.
const MAX_CHECKPOINTS: usize = 2048;

/// Every other checkpoint of `cps` (the first, step 0, stays), once there are too many.
fn thin(cps: &mut Vec<Point>) {
    if cps.len() > MAX_CHECKPOINTS {
        let mut i = 0;
        cps.retain(|_| {
            i += 1;
            i % 2 == 1
        });
    }
}

/// One dataset of a mixture.
#[derive(Debug)]
pub struct MixPart {
    /// Dataset name.
    pub name: String,
    /// Its order.
    pub order: Arc<SampleOrder>,
    /// Its first shard in the stream's (combined) manifest.
    pub first_shard: u32,
}

pub use super::schedules::Point;

impl Point {
    /// The point after this step; returns the step's counts.
    fn advance(&mut self, q: &[i128], gb: u64) -> Vec<u64> {
        let n = counts(q, gb, &mut self.carry);
        for (c, k) in self.cursors.iter_mut().zip(&n) {
            *c += k;
        }
        self.step += 1;
        n
    }
}

/// A sample of a mixture: a row, or a window, with shards in the combined manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MixSample {
    /// A row.
    Row(SampleRef),
    /// A token window.
    Window(Vec<TokenPiece>),
}

/// The checkpoints of a schedule, every [`CHECKPOINT`] steps from its base. A schedule from
/// step 0 starts from those other streams of this node reached ([`super::schedules`]), and
/// leaves its own there when it is dropped.
#[derive(Debug)]
struct Checkpoints {
    /// The schedule, when it starts at step 0 (only then are its points another's).
    shared: Option<super::schedules::Key>,
    points: Mutex<Vec<Point>>,
}

impl Checkpoints {
    fn for_base(base: &Point, q: &[i128], gb: u64) -> Self {
        let at_start = base.step == 0
            && base.cursors.iter().all(|&c| c == 0)
            && base.carry.iter().all(|&c| c == 0);
        let shared = at_start.then(|| (q.to_vec(), gb));
        let points = shared
            .as_ref()
            .and_then(super::schedules::checkpoints)
            .unwrap_or_else(|| vec![base.clone()]);
        Self {
            shared,
            points: Mutex::new(points),
        }
    }
}

impl Drop for Checkpoints {
    fn drop(&mut self) {
        if let Some(key) = self.shared.take() {
            let points = std::mem::take(self.points.get_mut().unwrap_or_else(|e| e.into_inner()));
            super::schedules::keep(key, points);
        }
    }
}

/// A rank's view of a mixture.
#[derive(Debug)]
pub struct Mixture {
    /// The datasets.
    pub parts: Vec<MixPart>,
    /// Fixed-point weights.
    pub q: Vec<i128>,
    /// Samples per rank per step.
    pub batch_size: u32,
    /// Ranks.
    pub world_size: u32,
    /// This rank.
    pub rank: u32,
    /// Steps per mixture epoch.
    pub steps: u64,
    /// Where the schedule starts (step 0, or the resume state's point).
    pub base: Point,
    checkpoints: Checkpoints,
    /// The last [`RECENT`] points asked for: the batcher asks in increasing order, and a
    /// batch's state (a step the batcher passed a few batches ago) is one of them, not a
    /// replay from the checkpoint before it (up to 1023 steps, under this lock).
    recent: Mutex<VecDeque<Point>>,
    orders: Mutex<VecDeque<(usize, u32, Arc<EpochOrder>)>>,
}

impl Mixture {
    /// A mixture of `parts` with weights `q` for rank `rank` of `world_size`, starting at
    /// `base`.
    pub fn new(
        parts: Vec<MixPart>,
        q: Vec<i128>,
        (batch_size, world_size, rank): (u32, u32, u32),
        base: Point,
    ) -> Self {
        let gb = u64::from(batch_size) * u64::from(world_size);
        let total = parts
            .iter()
            .fold(0u64, |a, p| a.saturating_add(p.order.total()));
        let checkpoints = Checkpoints::for_base(&base, &q, gb);
        Self {
            parts,
            q,
            batch_size,
            world_size,
            rank,
            steps: total / gb,
            checkpoints,
            recent: Mutex::new(VecDeque::from([base.clone()])),
            base,
            orders: Mutex::new(VecDeque::new()),
        }
    }

    /// The epoch the stream starts in (its base's).
    pub fn base_epoch(&self) -> u32 {
        u32::try_from(self.base.step / self.steps.max(1)).unwrap_or(u32::MAX)
    }

    /// Samples per global step.
    pub fn global_batch(&self) -> u64 {
        u64::from(self.batch_size) * u64::from(self.world_size)
    }

    /// The schedule before global step `step` (at or after the base).
    pub fn point(&self, step: u64) -> Point {
        self.point_counted(step).0
    }

    /// The step of the nearest point at or before `step` this schedule knows (a checkpoint
    /// another stream reached, or a recent point): where [`Self::point`] would play from.
    pub fn nearest_step(&self, step: u64) -> u64 {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let cps = self
            .checkpoints
            .points
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let i = cps.partition_point(|c| c.step <= step).max(1) - 1;
        let near = recent.iter().map(|p| p.step).filter(|&s| s <= step).max();
        near.unwrap_or(0).max(cps[i].step)
    }

    /// [`Self::point`], and how many steps it played to get there.
    fn point_counted(&self, step: u64) -> (Point, u64) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = recent.iter().find(|p| p.step == step) {
            return (p.clone(), 0);
        }
        let mut cps = self
            .checkpoints
            .points
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let i = cps.partition_point(|c| c.step <= step).max(1) - 1;
        let near = recent
            .iter()
            .filter(|p| p.step <= step)
            .max_by_key(|p| p.step);
        let mut p = match near {
            Some(r) if r.step >= cps[i].step => r.clone(),
            _ => cps[i].clone(),
        };
        let from = p.step;
        while p.step < step {
            p.advance(&self.q, self.global_batch());
            if p.step.is_multiple_of(CHECKPOINT) && cps.last().is_some_and(|l| l.step < p.step) {
                cps.push(p.clone());
                thin(&mut cps);
            }
        }
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(p.clone());
        (p, step - from)
    }

    /// This rank's slots at the step after `p`: (dataset, its cursor).
    fn slots_after(&self, p: &Point) -> Vec<(usize, u64)> {
        let n = counts(&self.q, self.global_batch(), &mut p.carry.clone());
        let b = self.batch_size as usize;
        let mut next = p.cursors.clone();
        let mut out = Vec::with_capacity(b);
        for (j, d) in interleave(&n).into_iter().enumerate() {
            let d = d as usize;
            if j / b == self.rank as usize {
                out.push((d, next[d]));
            }
            next[d] += 1;
        }
        out
    }

    /// Dataset `d`'s order for its epoch `e` (the few in use are kept, least recently used
    /// evicted first: a small dataset that starts an epoch every few steps must not push out
    /// the order of a large one still read every other slot, each rebuild is O(shards)).
    fn order(&self, d: usize, e: u32) -> Arc<EpochOrder> {
        let mut o = self.orders.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = o.iter().position(|(pd, pe, _)| *pd == d && *pe == e) {
            let hit = o.remove(i).expect("the position was just found");
            let ep = Arc::clone(&hit.2);
            o.push_back(hit);
            return ep;
        }
        let ep = Arc::new(self.parts[d].order.epoch(e));
        if o.len() >= 2 * self.parts.len() + 2 {
            o.pop_front();
        }
        o.push_back((d, e, Arc::clone(&ep)));
        ep
    }

    /// Dataset `d`'s sample at cursor `k`.
    fn sample(&self, d: usize, k: u64) -> MixSample {
        let part = &self.parts[d];
        let n = part.order.total();
        let ep = self.order(d, (k / n) as u32);
        let first = part.first_shard;
        match part.order.window_spec() {
            None => {
                let mut s = ep.sample(k % n);
                s.shard += first;
                MixSample::Row(s)
            }
            Some(_) => {
                let mut w = ep.window(k % n);
                for p in &mut w {
                    p.doc.shard += first;
                }
                MixSample::Window(w)
            }
        }
    }

    /// This rank's samples of global step `step`, with the dataset of each.
    pub fn samples(&self, step: u64) -> Vec<(usize, MixSample)> {
        self.samples_after(&self.point(step))
    }

    fn samples_after(&self, p: &Point) -> Vec<(usize, MixSample)> {
        self.slots_after(p)
            .into_iter()
            .map(|(d, k)| (d, self.sample(d, k)))
            .collect()
    }

    /// The units of mixture epoch `epoch`: one per run of steps from the base on that read
    /// the same shards (a run held as one: what each step holds is unchanged, and a block
    /// shuffle reads the same shards for many steps, which made an epoch of millions of steps
    /// one unit each), holding the shards of this rank's samples (rank-local sample indexes
    /// within the epoch).
    pub fn units(&self, epoch: u32) -> Vec<Unit> {
        self.units_within(epoch, u64::MAX)
    }

    /// [`Self::units`] of at most the first `steps` steps.
    pub fn units_within(&self, epoch: u32, steps: u64) -> Vec<Unit> {
        let b = u64::from(self.batch_size);
        let first = (u64::from(epoch) * self.steps).max(self.base.step);
        let end = (u64::from(epoch + 1) * self.steps).min(first.saturating_add(steps));
        let mut p = self.point(first);
        let mut out: Vec<Unit> = Vec::new();
        while p.step < end {
            let i = p.step - u64::from(epoch) * self.steps;
            let mut shards: Vec<u32> = self
                .samples_after(&p)
                .iter()
                .flat_map(|(_, s)| shards_of(s))
                .collect();
            shards.sort_unstable();
            shards.dedup();
            match out.last_mut() {
                Some(u) if u.shards == shards && u.last + 1 == i * b => u.last = i * b + b - 1,
                _ => {
                    shards.shrink_to_fit();
                    out.push(Unit {
                        first: i * b,
                        last: i * b + b - 1,
                        shards,
                    });
                }
            }
            p.advance(&self.q, self.global_batch());
        }
        out
    }

    /// The state of the schedule before global step `step`.
    pub fn state(&self, step: u64) -> MixState {
        let p = self.point(step.max(self.base.step));
        MixState {
            step: p.step,
            datasets: self.parts.iter().map(|x| x.name.clone()).collect(),
            weights: self.q.iter().map(|&w| w as i64).collect(),
            cursors: p.cursors,
            carry: p.carry.iter().map(|&c| c as i64).collect(),
        }
    }
}

/// The shards a sample reads.
pub fn shards_of(s: &MixSample) -> Vec<u32> {
    match s {
        MixSample::Row(r) => vec![r.shard],
        MixSample::Window(w) => w.iter().map(|p| p.doc.shard).collect(),
    }
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::samples::Shuffle;
    use shardwire_protocol::samples::mix::fixed_weights;

    use super::*;

    fn parts() -> Vec<MixPart> {
        let a = SampleOrder::new([1; 32], vec![10, 10], 3, Shuffle::Block, 5, 1).unwrap();
        let b = SampleOrder::new([2; 32], vec![7], 3, Shuffle::Block, 5, 1).unwrap();
        vec![
            MixPart {
                name: "web".into(),
                order: Arc::new(a),
                first_shard: 0,
            },
            MixPart {
                name: "code".into(),
                order: Arc::new(b),
                first_shard: 2,
            },
        ]
    }

    fn start() -> Point {
        Point {
            step: 0,
            cursors: vec![0, 0],
            carry: vec![0, 0],
        }
    }

    fn mix(w: &[f64], b: u32, world: u32, rank: u32, base: Point) -> Mixture {
        let q = fixed_weights(&["web", "code"], w).unwrap();
        Mixture::new(parts(), q, (b, world, rank), base)
    }

    #[test]
    fn checkpoints_past_the_most_kept_are_thinned_from_step_0() {
        let mut cps: Vec<Point> = (0..=MAX_CHECKPOINTS as u64)
            .map(|i| Point {
                step: i * CHECKPOINT,
                ..start()
            })
            .collect();
        thin(&mut cps);
        assert_eq!(cps.len(), MAX_CHECKPOINTS / 2 + 1);
        assert_eq!(cps[0].step, 0);
        assert!(
            cps.windows(2)
                .all(|w| w[1].step - w[0].step == 2 * CHECKPOINT)
        );
    }

    #[test]
    fn the_nearest_known_step_is_where_a_replay_starts() {
        // Weights no other test uses: the schedule's checkpoints are shared per weights.
        let m = mix(&[0.6875, 0.3125], 4, 1, 0, start());
        m.point(3000);
        assert_eq!(m.nearest_step(5000), 3000, "a recent point");
        assert_eq!(
            m.nearest_step(2500),
            2 * CHECKPOINT,
            "a checkpoint on the way"
        );
        assert_eq!(m.nearest_step(3000), 3000);
    }

    #[test]
    fn every_step_holds_the_exact_shares_and_ranks_split_it() {
        let one = mix(&[0.75, 0.25], 8, 1, 0, start());
        assert_eq!(one.steps, 27 / 8);
        for step in 0..10 {
            let all = one.samples(step);
            assert_eq!(
                all.iter().filter(|(d, _)| *d == 1).count(),
                2,
                "step {step}"
            );
            let mut split: Vec<_> = (0..4)
                .flat_map(|r| mix(&[0.75, 0.25], 2, 4, r, start()).samples(step))
                .collect();
            let mut whole = all.clone();
            split.sort_by_key(|x| format!("{x:?}"));
            whole.sort_by_key(|x| format!("{x:?}"));
            assert_eq!(split, whole, "step {step}: the same set on 1 and 4 ranks");
        }
        // "code" (7 samples) is taken at 2 a step: its fourth step reads its second epoch.
        let code: Vec<SampleRef> = (0..4)
            .flat_map(|s| one.samples(s))
            .filter_map(|(d, s)| match (d, s) {
                (1, MixSample::Row(r)) => Some(r),
                _ => None,
            })
            .collect();
        let first_epoch: std::collections::HashSet<_> = code[..7].iter().collect();
        assert_eq!(
            first_epoch.len(),
            7,
            "each sample once per epoch of the dataset"
        );
        assert!(code.iter().all(|r| r.shard == 2));
    }

    #[test]
    fn a_resume_with_new_weights_continues_each_cursor() {
        let old = mix(&[0.5, 0.5], 4, 1, 0, start());
        let st = old.state(5);
        assert_eq!(st.cursors, vec![10, 10]);
        let base = Point {
            step: st.step,
            cursors: st.cursors.clone(),
            carry: vec![0, 0],
        };
        let new = mix(&[0.75, 0.25], 4, 1, 0, base);
        let seen_old: Vec<_> = (0..5).flat_map(|s| old.samples(s)).collect();
        let next = new.samples(5);
        assert_eq!(next.iter().filter(|(d, _)| *d == 0).count(), 3);
        // web's next samples are its cursors 10, 11, 12 of its first epoch: none taken
        // before (code, 7 samples, is in its second epoch by now and may repeat).
        for (d, s) in next.iter().filter(|(d, _)| *d == 0) {
            assert!(!seen_old.contains(&(*d, s.clone())), "{s:?} repeated");
        }
        assert_eq!(new.state(6).cursors, vec![13, 11]);
    }

    #[test]
    fn units_cover_every_step_with_the_shards_it_reads_a_run_of_alike_steps_as_one() {
        for (b, world, rank) in [(3, 2, 1), (4, 1, 0)] {
            let m = mix(&[0.6, 0.4], b, world, rank, start());
            let units = m.units(1);
            let b = u64::from(b);
            // Contiguous over the epoch's steps, in whole steps.
            assert_eq!(units[0].first, 0);
            assert_eq!(units.last().unwrap().last, m.steps * b - 1);
            for w in units.windows(2) {
                assert_eq!(w[1].first, w[0].last + 1);
                // Before: one unit per step, alike or not (an epoch of millions of steps
                // held millions of units).
                assert_ne!(w[0].shards, w[1].shards, "alike steps left apart: {w:?}");
            }
            for i in 0..m.steps {
                let u = units
                    .iter()
                    .find(|u| u.first <= i * b && i * b + b - 1 <= u.last)
                    .expect("a unit covers each step");
                let mut reads: Vec<u32> = m
                    .samples(m.steps + i)
                    .iter()
                    .flat_map(|(_, s)| shards_of(s))
                    .collect();
                reads.sort_unstable();
                reads.dedup();
                assert_eq!(u.shards, reads, "step {i} of {u:?}");
            }
            assert!(
                (units.len() as u64) < m.steps,
                "{} units for {} steps",
                units.len(),
                m.steps
            );
        }
    }

    #[test]
    fn an_order_in_use_stays_cached_while_another_dataset_runs_through_epochs() {
        let m = mix(&[0.5, 0.5], 4, 1, 0, start());
        let web = m.order(0, 0);
        // "code" starts many epochs while "web" is still read every other slot: more
        // distinct orders than the cache holds (2 * 2 + 2).
        for e in 0..12 {
            m.order(1, e);
            assert!(
                Arc::ptr_eq(&web, &m.order(0, 0)),
                "web's order rebuilt after code's epoch {e}"
            );
        }
    }

    #[test]
    fn a_recent_step_is_not_replayed_from_its_checkpoint() {
        let q = fixed_weights(&["web", "code"], &[0.5, 0.5]).unwrap();
        let m = Mixture::new(parts(), q, (4, 1, 0), start());
        let (at, _) = m.point_counted(2000);
        // The batcher a few steps ahead of the batch whose state is asked for.
        for step in 2001..2009 {
            assert_eq!(m.point_counted(step).1, 1, "one step from the last");
        }
        // Before: 2000 - 1024 = 976 steps replayed from the checkpoint at 1024, and the
        // batcher's next step replayed again from there.
        assert_eq!(m.point_counted(2000), (at, 0));
        assert_eq!(m.point_counted(2009).1, 1);
        assert_eq!(m.point_counted(2003).1, 0);
    }

    #[test]
    fn a_schedule_from_step_0_starts_where_an_earlier_stream_of_it_got() {
        // Weights and a global batch no other test uses: the cache is the process's.
        let q = fixed_weights(&["web", "code"], &[0.61, 0.39]).unwrap();
        let first = Mixture::new(parts(), q.clone(), (13, 7, 0), start());
        let far = first.point(5000);
        drop(first);
        let second = Mixture::new(parts(), q.clone(), (13, 7, 1), start());
        let reached = second
            .checkpoints
            .points
            .lock()
            .unwrap()
            .last()
            .unwrap()
            .step;
        assert_eq!(reached, 4096, "the first stream's checkpoints");
        assert_eq!(
            second.point(5000),
            far,
            "the same schedule, whatever the rank"
        );
        // A stream resumed elsewhere (another base) neither takes nor leaves any.
        let resumed = Mixture::new(parts(), q, (13, 7, 0), far.clone());
        assert_eq!(*resumed.checkpoints.points.lock().unwrap(), vec![far]);
    }
}
