//! The most shard memory a batch-mode stream holds at once for the batch it assembles. A
//! unit (a block of a partition, or the epoch's tail) stays resident from its first sample
//! to its last, and a batch needs every unit its samples come from: one that crosses from a
//! block into the next needs both whole (each block is shuffled within itself, so its last
//! samples and the next one's first come from all of their shards), and one larger than a
//! block needs every block it spans. The open check sizes the window by this peak over an
//! epoch's units as well as by one block per partition.

use std::collections::HashMap;

use shardwire_gpu::SlabPool;
use shardwire_protocol::Manifest;
use shardwire_protocol::samples::Unit;

/// What one batch needs resident at most.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peak {
    /// Slab bytes (each shard's slab class) of the shards resident for it.
    pub bytes: u64,
    /// How many shards those are.
    pub shards: usize,
    /// How many units they belong to.
    pub units: usize,
}

/// The peak over the batches of `batch` rank-local samples of one epoch whose units are
/// `units` (rank-local sample indexes, as the plan gives them): the shards of the units
/// each batch overlaps, a shard held by two of them counted once.
pub fn peak(m: &Manifest, units: &[Unit], batch: u64) -> Peak {
    let batch = batch.max(1);
    let class = |s: u32| SlabPool::class_size(m.shards[s as usize].length as usize) as u64;
    // (batch index, 0 = a unit leaves before the batches from here, 1 = one arrives, unit).
    let mut events: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * units.len());
    for (i, u) in units.iter().enumerate() {
        events.push((u.first / batch, 1, i));
        events.push((u.last / batch + 1, 0, i));
    }
    events.sort_unstable();
    let (mut held, mut now, mut best) =
        (HashMap::<u32, u32>::new(), Peak::default(), Peak::default());
    let mut k = 0;
    while k < events.len() {
        let at = events[k].0;
        while k < events.len() && events[k].0 == at {
            let (_, arrives, i) = events[k];
            for &s in &units[i].shards {
                let n = held.entry(s).or_default();
                match arrives {
                    1 => {
                        *n += 1;
                        if *n == 1 {
                            (now.bytes, now.shards) = (now.bytes + class(s), now.shards + 1);
                        }
                    }
                    _ => {
                        *n -= 1;
                        if *n == 0 {
                            held.remove(&s);
                            (now.bytes, now.shards) = (now.bytes - class(s), now.shards - 1);
                        }
                    }
                }
            }
            now.units = if arrives == 1 {
                now.units + 1
            } else {
                now.units - 1
            };
            k += 1;
        }
        if now.bytes > best.bytes {
            best = now;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry};

    use super::*;

    /// `n` shards of one minimum slab class each (4 KiB or less of rows).
    fn manifest(n: u32) -> Manifest {
        Manifest::new(
            (0..n)
                .map(|i| ShardEntry {
                    file: format!("s{i}.bin"),
                    offset: 0,
                    length: 64,
                    crc32c: 0,
                    tensors: vec![TensorEntry::dense(
                        "x".into(),
                        DType::Uint8,
                        vec![16, 4],
                        0,
                        64,
                    )],
                })
                .collect(),
        )
    }

    fn unit(first: u64, last: u64, shards: &[u32]) -> Unit {
        Unit {
            first,
            last,
            shards: shards.to_vec(),
        }
    }

    #[test]
    fn a_batch_across_a_block_edge_holds_both_blocks_and_one_within_a_block_holds_one() {
        let m = manifest(8);
        let c = SlabPool::class_size(64) as u64;
        // Blocks of 32 samples, two shards each.
        let units = [
            unit(0, 31, &[0, 1]),
            unit(32, 63, &[2, 3]),
            unit(64, 95, &[4, 5]),
        ];
        let within = peak(&m, &units, 8);
        assert_eq!((within.units, within.shards, within.bytes), (1, 2, 2 * c));
        let across = peak(&m, &units, 12); // batch 2 is samples 24..35
        assert_eq!((across.units, across.shards, across.bytes), (2, 4, 4 * c));
        let spanning = peak(&m, &units, 96);
        assert_eq!((spanning.units, spanning.shards), (3, 6));
    }

    #[test]
    fn a_shard_two_overlapping_units_hold_counts_once() {
        let m = manifest(4);
        // The epoch's tail (wrapping to the start) reads shard 0 again.
        let units = [unit(0, 15, &[0]), unit(16, 31, &[1]), unit(30, 33, &[1, 0])];
        let p = peak(&m, &units, 4);
        assert_eq!((p.units, p.shards), (2, 2), "{p:?}");
    }
}
