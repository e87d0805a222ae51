//! The shard at each stream position, from the deterministic plan, with the orders of the
//! few epochs in use cached (a stream reads positions in order, so the fetcher and the
//! trainer are at most an epoch apart).

use std::sync::Mutex;

use shardwire_protocol::plan::PlanSpec;

/// Epoch orders kept at most (the fetcher's and the trainer's, and a spare).
const CACHED_EPOCHS: usize = 4;

/// A stream's plan with its epoch orders cached.
#[derive(Debug)]
pub struct Order {
    /// The plan inputs.
    pub spec: PlanSpec,
    per_rank: u64,
    cache: Mutex<Vec<(u32, Vec<u32>)>>,
}

impl Order {
    /// The order of `spec` (already validated).
    pub fn new(spec: PlanSpec) -> Self {
        let per_rank = spec.per_rank();
        Self {
            spec,
            per_rank,
            cache: Mutex::default(),
        }
    }

    /// Positions per epoch for this rank.
    pub fn per_epoch(&self) -> u64 {
        self.per_rank
    }

    /// (epoch, index within the epoch) of stream position `pos`.
    pub fn split(&self, pos: u64) -> (u32, u64) {
        ((pos / self.per_rank) as u32, pos % self.per_rank)
    }

    /// The stream position of (epoch, index).
    pub fn join(&self, epoch: u32, index: u64) -> u64 {
        u64::from(epoch) * self.per_rank + index
    }

    /// The shard at stream position `pos`.
    pub fn shard_at(&self, pos: u64) -> u32 {
        let (epoch, at) = self.split(pos);
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, plan)) = cache.iter().find(|(e, _)| *e == epoch) {
            return plan[at as usize];
        }
        if cache.len() >= CACHED_EPOCHS {
            // Drop the oldest epoch: positions are read in increasing order.
            let oldest = cache
                .iter()
                .enumerate()
                .min_by_key(|(_, (e, _))| *e)
                .map(|(i, _)| i);
            if let Some(i) = oldest {
                cache.swap_remove(i);
            }
        }
        let plan = self.spec.rank_order(epoch);
        let shard = plan[at as usize];
        cache.push((epoch, plan));
        shard
    }
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::plan::Uneven;

    use super::*;

    fn spec() -> PlanSpec {
        PlanSpec {
            digest: [3; 32],
            shards: 10,
            seed: 9,
            rank: 1,
            world_size: 3,
            uneven: Uneven::Pad,
        }
    }

    #[test]
    fn positions_follow_the_plan_across_epochs_and_the_cache_stays_small() {
        let o = Order::new(spec());
        assert_eq!(o.per_epoch(), 4);
        for epoch in 0..10u32 {
            let want = spec().rank_order(epoch);
            for (i, s) in want.iter().enumerate() {
                assert_eq!(o.shard_at(o.join(epoch, i as u64)), *s);
            }
        }
        assert!(o.cache.lock().unwrap().len() <= CACHED_EPOCHS);
        assert_eq!(o.split(o.join(7, 3)), (7, 3));
    }
}
