//! The prefetch task of a [`RemoteDataset`]: reads the shards the nodes' hints name, soonest
//! first, before their FETCHes come; consecutive ones in hint order go in one group, so
//! adjacent small shards of one object merge into one GET. It stops at the in-flight cap
//! (the window's ceiling times the request size) and at the memory budget for shards held
//! in memory (with a cache too: a shard it does not admit stays in memory); shards held in
//! memory that no hint names any more are dropped when memory runs short (counted as
//! wasted).

use std::sync::Arc;
use std::time::Duration;

use super::{Reading, RemoteDataset, State};

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
        let mut group: Vec<u32> = Vec::new();
        let mut bytes = 0;
        for s in st.hints.order() {
            if st.ready.contains_key(&s) || st.loading.contains_key(&s) || held(s) {
                if group.is_empty() {
                    continue;
                }
                break;
            }
            let w = &self.shards[s as usize];
            let len = w.range.end - w.range.start;
            let in_memory = st.ready_bytes + st.prefetching + bytes + len;
            // The memory budget holds with a cache too: a shard the cache does not admit
            // (needed later than what it holds, or a failed write) stays in memory.
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

    /// Drops shards held in memory that no hint names (their stream went away).
    fn drop_unhinted(&self, st: &mut State) {
        let stale: Vec<u32> = st
            .ready
            .keys()
            .copied()
            .filter(|&s| st.hints.next_use(s).is_none())
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
