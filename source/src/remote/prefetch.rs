//! The prefetch task of a [`RemoteDataset`]: reads the shards the nodes' hints name, soonest
//! first, before their FETCHes come; consecutive ones in hint order go in one group, so
//! adjacent small shards of one object merge into one GET. It stops at the in-flight cap
//! (the window's ceiling times the request size) and at the memory budget for shards held
//! in memory (with a cache too: a shard it does not admit stays in memory); shards held in
//! memory that no hint names any more are dropped when memory runs short (counted as
//! wasted). A shard whose read failed is not read ahead again before its [`Backoff`] ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::read::Failure;
use super::{Reading, RemoteDataset, State};

/// The first pause after a failed read ahead of a shard; it doubles with each failure in a row.
const FIRST_PAUSE: Duration = Duration::from_secs(1);

/// The longest pause between reads ahead of a shard that keeps failing.
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
        let pause = doubling.max(asked).min(MAX_PAUSE);
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
        loop {
            let Some(reading) = self.next_group(cap) else {
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
    /// in memory that no hint names any more are dropped first (counted as wasted).
    fn next_group(&self, cap: u64) -> Option<Reading> {
        let mut st = self.state();
        self.drop_unhinted(&mut st);
        let held = |s: u32| {
            self.cache
                .as_ref()
                .is_some_and(|c| c.lock().expect("poisoned").holds(s))
        };
        let now = Instant::now();
        let mut group: Vec<u32> = Vec::new();
        let mut bytes = 0;
        for s in st.hints.order() {
            let skip = st.ready.contains_key(&s) || st.loading.contains_key(&s);
            if skip || held(s) || st.backoff.waits(s, now) {
                if group.is_empty() {
                    continue;
                }
                break;
            }
            let w = &self.shards[s as usize];
            let len = w.range.end - w.range.start;
            let in_memory = st.ready_bytes + st.prefetching + bytes + len;
            // The memory budget holds with a cache too: a shard the cache does not admit
            // (the cache is full of entries still read, or a failed write) stays in memory.
            let room =
                st.prefetching + bytes + len <= cap.max(len) && in_memory <= self.budget.max(len);
            if !room || bytes + len > self.store.options().request_size.max(len) {
                break;
            }
            group.push(s);
            bytes += len;
        }
        (!group.is_empty()).then(|| self.begin(&mut st, group, true))
    }

    /// Drops shards held in memory that no hint names (their stream went away) and no FETCH
    /// under way waits for.
    pub(super) fn drop_unhinted(&self, st: &mut State) {
        let stale: Vec<u32> = st
            .ready
            .keys()
            .copied()
            .filter(|&s| st.hints.next_use(s).is_none() && !st.wanted.contains_key(&s))
            .collect();
        for s in stale {
            if st.ready_bytes > self.budget / 2 {
                let parts = st.ready.remove(&s).expect("listed");
                let n: u64 = parts.iter().map(|p| p.len() as u64).sum();
                st.ready_bytes -= n;
                metrics::counter!("shardwire_source_prefetch_wasted_bytes_total").increment(n);
            }
        }
        metrics::gauge!("shardwire_source_prefetch_ready_bytes").set(st.ready_bytes as f64);
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
    fn a_stores_retry_after_lengthens_the_pause() {
        let mut b = Backoff::default();
        let pause = b.failed(1, &failure(5_000), Instant::now());
        assert_eq!(pause, Duration::from_secs(5));
    }
}
