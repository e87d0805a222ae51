//! The prefetch task of a [`RemoteDataset`]: reads the shards the nodes' hints name, soonest
//! first, before their FETCHes come; consecutive ones in hint order go in one group, so
//! adjacent small shards of one object merge into one GET. It stops at the in-flight cap
//! (the window's ceiling times the request size) and at the memory budget for shards held
//! in memory (with a cache too: a shard it does not admit stays in memory, and one it admits
//! is held until it is written); shards held in memory that no hint names any more are
//! dropped when memory runs short (counted as wasted), found as they become so
//! ([`State::droppable`]), not by looking at every shard in memory. A shard whose read failed
//! is not read ahead again before its [`Backoff`] ends. One wake looks at a bounded stretch of
//! the order ([`SCAN`]), with sets the task keeps from wake to wake ([`Scratch`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::hints::Place;
use super::read::Failure;
use super::{Reading, RemoteDataset, State};

/// Shards one [`RemoteDataset::next_group`] passes over (cached, in memory, being read or
/// waiting out a failure; a shard several streams name counts once): at most half of this,
/// or twice the number of hinted streams where that is more, from the front of the order (so
/// the next two shards of every stream are always looked at: one that stops being held, such as a
/// backoff that ended, is read ahead at the next wake), and as many from where the last call
/// stopped ([`State::scan_at`]). So a wake costs O(streams + SCAN) under the dataset's lock
/// (with every hinted shard cached, an epoch after the first, each wake walked the whole
/// order: up to 64 Ki entries per node session), with sets the task keeps from wake to wake
/// ([`Scratch`]), and a shard deep in the order is still reached, each wake going on where
/// the last stopped.
pub(super) const SCAN: usize = 1024;

/// Entries (with repeats) a scan passes over at most, per shard it may pass over: bounds the
/// walk where many streams name the same shards.
const ENTRIES_PER_SHARD: usize = 4;

/// The sets a scan keeps: the shards it passed over (each counted once) and those it took
/// into its group. The prefetch task keeps them from wake to wake and each scan empties them
/// ([`Scratch::start`]), so a scan allocates no set once they have grown to what a scan
/// holds (before, each scan allocated a set of up to twice the hinted streams: at 256 Ki
/// streams, a few MiB a wake).
#[derive(Debug, Default)]
struct Scratch {
    passed: HashSet<u32>,
    taken: HashSet<u32>,
}

impl Scratch {
    /// Empties both, for a scan that passes over at most `limit` shards, keeping their
    /// memory; unless `passed` has room for many more than that (the hinted streams went
    /// away): it gives back the rest, so that emptying it costs O(limit), not the largest
    /// scan's, and keeps room for `limit` (so it never grows back during a scan).
    fn start(&mut self, limit: usize) {
        self.passed.clear();
        self.taken.clear();
        if self.passed.capacity() > 4 * limit {
            self.passed.shrink_to(limit);
        }
    }
}

/// What [`RemoteDataset::scan`] found.
enum Scanned {
    /// The group to read; empty: the next shard does not fit the in-flight cap or the memory
    /// budget, so nothing is read ahead now.
    Chosen(Vec<u32>),
    /// Nothing to read among the entries passed over; the last of them (`None`: the order
    /// ended).
    Passed(Option<Place>),
}

/// The first pause after a failed read ahead of a shard; it doubles with each failure in a row.
const FIRST_PAUSE: Duration = Duration::from_secs(1);

/// The longest pause between reads ahead of a shard that keeps failing, unless the store's
/// `Retry-After` asks for longer (the store crate caps that at an hour).
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// Shards whose last read failed, with their failures in a row and when the prefetch may read
/// them again: a shard the store refuses (changed, deleted, forbidden) or cannot serve now is
/// read again after 1, 2, 4, ... s (at most [`MAX_PAUSE`]; a throttled one no sooner than the
/// store's `Retry-After`), not back to back. A FETCH still reads it whenever it comes: the
/// node decides what a failure means for its stream.
#[derive(Debug, Default)]
pub(super) struct Backoff(HashMap<u32, (u32, Instant)>);

impl Backoff {
    /// A read of `shard` failed at `now`; returns the pause before the next read ahead.
    pub(super) fn failed(&mut self, shard: u32, f: &Failure, now: Instant) -> Duration {
        let tries = self.0.get(&shard).map_or(0, |&(n, _)| n) + 1;
        let doubling = FIRST_PAUSE.saturating_mul(1 << (tries - 1).min(16));
        let asked = Duration::from_millis(u64::from(f.retry_after_ms));
        let pause = doubling.min(MAX_PAUSE).max(asked);
        self.0.insert(shard, (tries, now + pause));
        pause
    }

    /// A read of `shard` succeeded: no pause any more.
    pub(super) fn succeeded(&mut self, shard: u32) {
        self.0.remove(&shard);
    }

    /// True while `shard` is not to be read ahead.
    fn waits(&self, shard: u32, now: Instant) -> bool {
        self.0.get(&shard).is_some_and(|&(_, until)| now < until)
    }
}

impl RemoteDataset {
    /// The prefetch task: reads hinted shards ahead, soonest first, while the memory budget
    /// and the in-flight cap allow; runs until the source stops.
    pub async fn prefetch(self: Arc<Self>) {
        let cap = self.store.options().request_size * self.store.options().max_inflight as u64;
        let mut scratch = Scratch::default();
        loop {
            let Some(reading) = self.next_group(cap, &mut scratch) else {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                continue;
            };
            let me = Arc::clone(&self);
            tokio::spawn(async move {
                let _ = me.load(reading).await;
            });
        }
    }

    /// The next shards to prefetch (consecutive in hint order, so adjacent ones merge),
    /// registered as being read under the lock they were chosen under (so no FETCH starts a
    /// read of them meanwhile), or none when the budget, the cap or the hints say so. Shards
    /// in memory that no hint names any more are dropped first (counted as wasted). `scratch`:
    /// the prefetch task's sets, kept from wake to wake.
    fn next_group(&self, cap: u64, scratch: &mut Scratch) -> Option<Reading> {
        let mut st = self.state();
        self.drop_unhinted(&mut st);
        // Locked once, in the order `claim` and `place` take the locks: state, then cache.
        let cache = self.cache.as_ref().map(|c| c.lock().expect("poisoned"));
        let held = |s: u32| cache.as_ref().is_some_and(|c| c.holds(s));
        let group = self.choose_in(&mut st, &held, cap, scratch);
        drop(cache);
        (!group.is_empty()).then(|| self.begin(&mut st, group, true))
    }

    /// The group [`Self::next_group`] reads (`held`: whether the cache holds a shard): from
    /// the front of the order, or else from where the last call stopped ([`State::scan_at`],
    /// moved on, back to the front once the order ended); empty when there is none, or the
    /// next shard does not fit. Each of its two scans passes over at most half of [`SCAN`]
    /// shards, or twice the hinted streams where that is more, with the sets in `scratch`.
    fn choose_in(
        &self,
        st: &mut State,
        held: &dyn Fn(u32) -> bool,
        cap: u64,
        scratch: &mut Scratch,
    ) -> Vec<u32> {
        let front = match self.scan(st, held, None, cap, scratch) {
            Scanned::Chosen(group) => return group,
            Scanned::Passed(None) => {
                st.scan_at = None; // the whole order was looked at
                return Vec::new();
            }
            Scanned::Passed(Some(end)) => end,
        };
        let from = st.scan_at.filter(|&at| at > front).unwrap_or(front);
        match self.scan(st, held, Some(from), cap, scratch) {
            Scanned::Chosen(group) => {
                st.scan_at = Some(from);
                group
            }
            Scanned::Passed(last) => {
                st.scan_at = last;
                Vec::new()
            }
        }
    }

    /// [`Self::choose_in`] for tests, with sets kept from call to call on this thread, as the
    /// prefetch task keeps its own from wake to wake.
    #[cfg(test)]
    pub(super) fn choose(&self, st: &mut State, held: &dyn Fn(u32) -> bool, cap: u64) -> Vec<u32> {
        thread_local!(static SCRATCH: std::cell::RefCell<Scratch> = Default::default());
        SCRATCH.with(|s| self.choose_in(st, held, cap, &mut s.borrow_mut()))
    }

    /// Walks the order after `after` (from its start with `None`) for a group: shards neither
    /// in memory, being read, cached (`held`) nor waiting out a failure, consecutive, within
    /// the request size, the in-flight cap and the memory budget. Passes over at most half
    /// of [`SCAN`] shards, or twice the number of hinted streams where that is more; its sets
    /// are `scratch`'s, emptied first.
    fn scan(
        &self,
        st: &State,
        held: &dyn Fn(u32) -> bool,
        after: Option<Place>,
        cap: u64,
        scratch: &mut Scratch,
    ) -> Scanned {
        let now = Instant::now();
        let limit = (SCAN / 2).max(2 * st.hints.streams());
        scratch.start(limit);
        let Scratch { passed, taken } = scratch;
        let mut group = Vec::new();
        let (mut bytes, mut entries) = (0, 0);
        for (at, s) in st.hints.order_after(after) {
            let in_ram = st.ready.contains_key(&s) || st.writing.contains_key(&s);
            let skip = taken.contains(&s) || in_ram;
            if skip || st.loading.contains_key(&s) || held(s) || st.backoff.waits(s, now) {
                if !group.is_empty() && !taken.contains(&s) {
                    return Scanned::Chosen(group);
                }
                passed.insert(s);
                entries += 1;
                if passed.len() >= limit || entries >= limit * ENTRIES_PER_SHARD {
                    return match group.is_empty() {
                        true => Scanned::Passed(Some(at)),
                        false => Scanned::Chosen(group),
                    };
                }
                continue;
            }
            let w = &self.shards[s as usize];
            let len = w.range.end - w.range.start;
            let in_memory = st.ready_bytes + st.writing_bytes + st.prefetching + bytes + len;
            // The memory budget holds with a cache too: a shard the cache does not admit
            // (the cache is full of entries still read, or a failed write) stays in memory,
            // and one it admits is held until its write ends (`RemoteDataset::place`).
            let room =
                st.prefetching + bytes + len <= cap.max(len) && in_memory <= self.budget.max(len);
            if !room || bytes + len > self.store.options().request_size.max(len) {
                return Scanned::Chosen(group);
            }
            group.push(s);
            taken.insert(s);
            bytes += len;
        }
        match group.is_empty() {
            true => Scanned::Passed(None),
            false => Scanned::Chosen(group),
        }
    }

    /// Drops shards held in memory that no hint names (their stream went away) and no FETCH
    /// under way waits for, while they hold more than half the memory budget; returns how
    /// many shards it looked at. It looks only at the shards noted as such since
    /// ([`State::droppable`]), and at none while half the budget or less is held: it runs at
    /// every wake of the prefetch task, under the dataset's lock. Before, each wake with more
    /// than half held looked up every shard in memory (up to 32 Ki of 16 KiB shards), though
    /// the read ahead keeps memory near the budget and every shard there was hinted.
    pub(super) fn drop_unhinted(&self, st: &mut State) -> usize {
        let short = st.ready_bytes > self.budget / 2 && !st.droppable.is_empty();
        let looked = match short {
            true => self.drop_stale(st),
            false => 0,
        };
        metrics::gauge!("shardwire_source_prefetch_ready_bytes", "dataset" => self.name.clone())
            .set(st.ready_bytes as f64);
        looked
    }

    /// [`Self::drop_unhinted`] once memory is short: drops the noted shards that are still
    /// unhinted, unwanted and in memory until half the budget or less is held (those not
    /// looked at stay noted); returns the shards it looked at.
    fn drop_stale(&self, st: &mut State) -> usize {
        let noted: Vec<u32> = st.droppable.drain().collect();
        let mut looked = 0;
        for (i, &s) in noted.iter().enumerate() {
            if st.ready_bytes <= self.budget / 2 {
                st.droppable.extend(&noted[i..]);
                break;
            }
            looked += 1;
            if !st.droppable_now(s) {
                continue; // hinted, wanted or taken since it was noted
            }
            let parts = st.ready.remove(&s).expect("in memory");
            let n: u64 = parts.iter().map(|p| p.len() as u64).sum();
            st.ready_bytes -= n;
            metrics::counter!("shardwire_source_prefetch_wasted_bytes_total").increment(n);
        }
        looked
    }
}

/// Noted shards ([`State::droppable`]) past which the note is pruned of those no longer
/// droppable, beyond twice the shards in memory.
const NOTED_SLACK: usize = 64;

impl State {
    /// Whether `shard` may be dropped from memory: it is there, no hint names it and no FETCH
    /// under way wants it.
    fn droppable_now(&self, shard: u32) -> bool {
        self.ready.contains_key(&shard)
            && self.hints.next_use(shard).is_none()
            && !self.wanted.contains_key(&shard)
    }

    /// `shard` may just have become droppable (its last FETCH under way ended, it was put in
    /// memory): noted if it is ([`State::droppable`]).
    pub(super) fn maybe_droppable(&mut self, shard: u32) {
        if !self.droppable_now(shard) {
            return;
        }
        // Those hinted, wanted or taken since they were noted go once they are many: a prune
        // keeps at most the shards in memory, half of what it looks at or less, so it costs
        // O(1) per note, amortized.
        if self.droppable.len() >= 2 * self.ready.len() + NOTED_SLACK {
            let mut noted = std::mem::take(&mut self.droppable);
            noted.retain(|&s| self.droppable_now(s));
            self.droppable = noted;
        }
        self.droppable.insert(shard);
    }

    /// The hints changed: the shards that lost their last entry
    /// ([`super::hints::Hints::take_unnamed`]) and are droppable are noted. Costs the entries
    /// the change removed, which it paid already.
    pub(super) fn hints_changed(&mut self) {
        for s in self.hints.take_unnamed() {
            self.maybe_droppable(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::wire::ErrorCode;

    use super::*;

    fn failure(retry_after_ms: u32) -> Failure {
        Failure {
            code: ErrorCode::Throttled,
            retry_after_ms,
            message: "test".into(),
        }
    }

    #[test]
    fn a_failing_shard_waits_longer_each_time_up_to_a_minute_and_a_success_ends_it() {
        let (mut b, t0) = (Backoff::default(), Instant::now());
        let pauses: Vec<u64> = (0..9)
            .map(|_| b.failed(7, &failure(0), t0).as_secs())
            .collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert!(b.waits(7, t0 + Duration::from_secs(59)));
        assert!(
            !b.waits(7, t0 + MAX_PAUSE) && !b.waits(8, t0),
            "over, and other shards"
        );
        b.succeeded(7);
        assert!(!b.waits(7, t0));
        assert_eq!(
            b.failed(7, &failure(0), t0),
            FIRST_PAUSE,
            "counting starts over"
        );
        for _ in 0..100 {
            b.failed(9, &failure(0), t0); // no overflow however long it fails
        }
    }

    #[test]
    fn a_scans_sets_are_emptied_and_keep_their_memory_unless_far_too_large() {
        let mut s = Scratch::default();
        s.start(512);
        s.passed.extend(0..512);
        s.taken.extend(0..8);
        let room = s.passed.capacity();
        s.start(512);
        assert!(
            s.passed.is_empty() && s.taken.is_empty(),
            "emptied for the next scan"
        );
        // Before, each scan made sets of its own: an allocation (of MiB at 256 Ki streams).
        assert_eq!(s.passed.capacity(), room, "its memory kept");
        s.passed.extend(0..512);
        assert_eq!(
            s.passed.capacity(),
            room,
            "and nothing allocated by the next scan"
        );
        // A scan of 256 Ki streams, then of 512 shards: the rest is given back, room for 512
        // is kept.
        s.passed.extend(0..512 * 1024);
        s.start(512);
        let room = s.passed.capacity();
        assert!((512..=4 * 512).contains(&room), "{room}");
        s.passed.extend(0..512);
        assert_eq!(s.passed.capacity(), room);
    }

    #[test]
    fn a_stores_retry_after_lengthens_the_pause() {
        let (mut b, t0) = (Backoff::default(), Instant::now());
        let pause = b.failed(1, &failure(5_000), t0);
        assert_eq!(pause, Duration::from_secs(5));
        // Longer than MAX_PAUSE: honoured (before, cut to 60 s, and the store was asked again
        // four minutes early).
        let pause = b.failed(2, &failure(300_000), t0);
        assert_eq!(pause, Duration::from_secs(300));
        assert!(b.waits(2, t0 + Duration::from_secs(299)));
    }
}
