//! Deterministic shard order: a pure function of (manifest digest, seed, epoch, rank, world
//! size, uneven policy), so every node plans the same global order without a coordinator.
//!
//! Per epoch the shard indices are shuffled with a key derived from (digest, seed, epoch);
//! the permutation is then padded (repeating its head) or truncated to a multiple of the
//! world size, and rank `r` takes positions `r, r + W, r + 2W, ...`. Every rank therefore
//! gets exactly the same number of shards per epoch and no rank can wait forever.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What to do when the shard count is not a multiple of the world size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Uneven {
    /// Repeat shards from the start of the epoch's order until every rank has the same count.
    #[default]
    Pad,
    /// Drop the tail of the epoch's order.
    Drop,
}

/// Everything the order depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanSpec {
    /// Manifest digest.
    pub digest: [u8; 32],
    /// Number of shards in the manifest.
    pub shards: u32,
    /// User seed.
    pub seed: u64,
    /// This rank.
    pub rank: u32,
    /// Number of ranks.
    pub world_size: u32,
    /// Uneven policy.
    pub uneven: Uneven,
}

/// Why a plan cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// world size is 0.
    #[error("world_size must be at least 1, got 0")]
    ZeroWorld,
    /// rank is not below world size.
    #[error("rank {rank} is not below world_size {world_size}")]
    Rank {
        /// The rank given.
        rank: u32,
        /// The world size given.
        world_size: u32,
    },
    /// The manifest has no shards: no plan, whatever `uneven`.
    #[error(
        "the dataset's manifest lists 0 shards; a stream needs at least 1 (re-index the dataset, or check that its source serves the right directory)"
    )]
    NoShards,
    /// With `drop`, fewer shards than ranks leaves nothing.
    #[error(
        "uneven=drop with {shards} shards and world_size {world_size} gives every rank 0 shards"
    )]
    NothingLeft {
        /// Shard count.
        shards: u32,
        /// World size.
        world_size: u32,
    },
}

impl PlanSpec {
    /// Checks rank/world size.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.world_size == 0 {
            return Err(PlanError::ZeroWorld);
        }
        if self.rank >= self.world_size {
            return Err(PlanError::Rank {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        // Before `per_rank`: with no shards `pad` gives 0 too, and "uneven=drop" misleads.
        if self.shards == 0 {
            return Err(PlanError::NoShards);
        }
        if self.per_rank() == 0 {
            return Err(PlanError::NothingLeft {
                shards: self.shards,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// A readable fingerprint of every plan input: a resumed stream must match it.
    pub fn fingerprint(&self) -> String {
        let digest: String = self.digest[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let uneven = match self.uneven {
            Uneven::Pad => "pad",
            Uneven::Drop => "drop",
        };
        format!(
            "v1;digest={digest};shards={};seed={};world_size={};rank={};uneven={uneven}",
            self.shards, self.seed, self.world_size, self.rank
        )
    }

    /// Compares a saved fingerprint with this plan's; names the first field that differs.
    pub fn check_fingerprint(&self, saved: &str) -> Result<(), String> {
        compare_fingerprints(&self.fingerprint(), saved)
    }

    /// Shards per rank per epoch.
    pub fn per_rank(&self) -> u64 {
        let (n, w) = (u64::from(self.shards), u64::from(self.world_size.max(1)));
        match self.uneven {
            Uneven::Pad => n.div_ceil(w),
            Uneven::Drop => n / w,
        }
    }

    /// The global permutation of shard indices for `epoch`.
    pub fn global_order(&self, epoch: u32) -> Vec<u32> {
        let mut h = Sha256::new();
        h.update(b"shardwire-plan-v1");
        h.update(self.digest);
        h.update(self.seed.to_le_bytes());
        h.update(epoch.to_le_bytes());
        let key = h.finalize();
        let mut rng = SplitMix64(u64::from_le_bytes(key[..8].try_into().expect("8 bytes")));
        let mut order: Vec<u32> = (0..self.shards).collect();
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        order
    }

    /// This rank's shard indices for `epoch`, in delivery order.
    pub fn rank_order(&self, epoch: u32) -> Vec<u32> {
        let global = self.global_order(epoch);
        let w = self.world_size as usize;
        let per = self.per_rank() as usize;
        (0..per)
            .map(|k| global[(k * w + self.rank as usize) % global.len()])
            .collect()
    }
}

/// Compares a saved fingerprint (`field=value;...`) with the current one; the error names the
/// first field that differs, with both values.
pub fn compare_fingerprints(mine: &str, saved: &str) -> Result<(), String> {
    if mine == saved {
        return Ok(());
    }
    let parse = |s: &str| -> Vec<(String, String)> {
        s.split(';')
            .map(|kv| {
                kv.split_once('=')
                    .map_or((kv.to_string(), String::new()), |(k, v)| {
                        (k.into(), v.into())
                    })
            })
            .collect()
    };
    let (a, b) = (parse(mine), parse(saved));
    for (k, v) in &a {
        let other = b.iter().find(|(k2, _)| k2 == k).map(|(_, v)| v.as_str());
        if other != Some(v.as_str()) {
            return Err(format!(
                "state fingerprint differs in `{k}`: saved {}, stream has {v}",
                other.unwrap_or("(missing)")
            ));
        }
    }
    Err(format!(
        "state fingerprint `{saved}` does not match `{mine}`"
    ))
}

/// SplitMix64 (Steele et al.): tiny, fast, and fully specified, so orders never change
/// with a dependency upgrade.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (Lemire's multiply-shift with rejection).
    fn below(&mut self, n: u64) -> u64 {
        loop {
            let m = u128::from(self.next()) * u128::from(n);
            if (m as u64) >= n.wrapping_neg() % n {
                return (m >> 64) as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn spec(shards: u32, rank: u32, world_size: u32, uneven: Uneven) -> PlanSpec {
        PlanSpec {
            digest: [7; 32],
            shards,
            seed: 42,
            rank,
            world_size,
            uneven,
        }
    }

    #[test]
    fn deterministic_and_reshuffled_per_epoch() {
        let s = spec(100, 0, 1, Uneven::Pad);
        assert_eq!(s.rank_order(0), s.rank_order(0));
        assert_ne!(s.rank_order(0), s.rank_order(1));
        let mut other = s.clone();
        other.seed = 43;
        assert_ne!(s.rank_order(0), other.rank_order(0));
    }

    #[test]
    fn fingerprint_names_the_differing_field() {
        let a = spec(10, 1, 4, Uneven::Pad);
        assert!(a.check_fingerprint(&a.fingerprint()).is_ok());
        let mut b = a.clone();
        b.world_size = 8;
        let e = a.check_fingerprint(&b.fingerprint()).unwrap_err();
        assert!(e.contains("`world_size`") && e.contains("saved 8"), "{e}");
    }

    #[test]
    fn validation_errors_name_the_problem() {
        assert_eq!(
            spec(10, 3, 3, Uneven::Pad).validate(),
            Err(PlanError::Rank {
                rank: 3,
                world_size: 3
            })
        );
        assert_eq!(
            spec(10, 0, 0, Uneven::Pad).validate(),
            Err(PlanError::ZeroWorld)
        );
        assert!(spec(2, 0, 3, Uneven::Drop).validate().is_err());
        assert!(spec(2, 0, 3, Uneven::Pad).validate().is_ok());
    }

    #[test]
    fn an_empty_manifest_is_refused_as_empty_whatever_uneven() {
        // Before: the default `pad` was refused as "uneven=drop with 0 shards".
        for uneven in [Uneven::Pad, Uneven::Drop] {
            assert_eq!(spec(0, 0, 1, uneven).validate(), Err(PlanError::NoShards));
        }
        assert!(PlanError::NoShards.to_string().contains("0 shards"));
    }

    proptest! {
        /// Ranks partition the epoch: each shard exactly once (even case), equal counts always.
        #[test]
        fn ranks_partition(shards in 1u32..300, world in 1u32..9, epoch in 0u32..4) {
            let counts: Vec<usize> = (0..world).map(|r| spec(shards, r, world, Uneven::Pad).rank_order(epoch).len()).collect();
            prop_assert!(counts.iter().all(|&c| c == counts[0]));
            let mut seen: HashMap<u32, usize> = HashMap::new();
            for r in 0..world {
                for s in spec(shards, r, world, Uneven::Pad).rank_order(epoch) {
                    *seen.entry(s).or_default() += 1;
                }
            }
            // pad: every shard at least once, at most world-1 repeats in total.
            prop_assert_eq!(seen.len() as u32, shards);
            let extra: usize = seen.values().map(|c| c - 1).sum();
            prop_assert!(extra < world as usize);
            // drop: no shard twice.
            let mut dropped = std::collections::HashSet::new();
            for r in 0..world {
                for s in spec(shards, r, world, Uneven::Drop).rank_order(epoch) {
                    prop_assert!(dropped.insert(s));
                }
            }
            prop_assert_eq!(dropped.len() as u32, shards / world * world);
        }
    }
}
