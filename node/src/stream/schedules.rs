//! Checkpoints of mixture schedules, shared by the streams of this node.
//!
//! A mixture's schedule from step 0 depends only on its weights and its global batch, and
//! reaching step `s` from the nearest earlier checkpoint costs one `counts` per step (6.5 µs
//! at 1024 samples over 2 datasets, release build). A stream opened at a later epoch
//! without a saved state (`set_epoch`, `open_at_epoch`: every DataLoader worker, every
//! epoch) replayed the schedule from step 0: seconds at tens of epochs, on a runtime worker.
//! The checkpoints a stream passed, or replayed, are kept here when it ends, so the next one
//! of the same schedule starts from the nearest of them.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Where a mixture's schedule stands before a global step (`super::mix` moves it on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Point {
    /// Global step (all epochs).
    pub step: u64,
    /// Samples each dataset has given.
    pub cursors: Vec<u64>,
    /// Rounding carry (2^-40 samples).
    pub carry: Vec<i128>,
}

/// Schedules kept at once; past it the cache starts over. (More in unit tests, which run in
/// parallel in one process, each with schedules of its own: a test's must not be cleared by
/// another's.)
const KEPT: usize = if cfg!(test) { 1024 } else { 16 };

/// A schedule: its fixed-point weights and its global batch.
pub(super) type Key = (Vec<i128>, u64);

fn cache() -> MutexGuard<'static, HashMap<Key, Vec<Point>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Vec<Point>>>> = OnceLock::new();
    CACHE
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The checkpoints of schedule `key` from step 0, in step order, as far as a stream of this
/// node got; `None` when none is kept.
pub(super) fn checkpoints(key: &Key) -> Option<Vec<Point>> {
    cache().get(key).cloned()
}

/// Keeps `points` (checkpoints of schedule `key` from step 0, in step order) when they reach
/// further than those kept.
pub(super) fn keep(key: Key, points: Vec<Point>) {
    let reach = |p: &[Point]| p.last().map_or(0, |p| p.step);
    let mut c = cache();
    if c.get(&key)
        .is_some_and(|kept| reach(kept) >= reach(&points))
    {
        return;
    }
    if c.len() >= KEPT && !c.contains_key(&key) {
        c.clear();
    }
    c.insert(key, points);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64) -> Point {
        Point {
            step,
            cursors: vec![step, 0],
            carry: vec![0, 0],
        }
    }

    #[test]
    fn the_furthest_checkpoints_are_kept_per_schedule() {
        let key: Key = (vec![7, 9], 1_000_001);
        assert_eq!(checkpoints(&key), None);
        keep(key.clone(), vec![at(0), at(1024)]);
        keep(key.clone(), vec![at(0)]); // shorter: the kept ones stay
        assert_eq!(checkpoints(&key), Some(vec![at(0), at(1024)]));
        keep(key.clone(), vec![at(0), at(1024), at(2048)]);
        assert_eq!(checkpoints(&key).map(|p| p.len()), Some(3));
        let other: Key = (vec![7, 9], 1_000_002);
        assert_eq!(
            checkpoints(&other),
            None,
            "another global batch is another schedule"
        );
    }
}
