//! The host batch gather's speed with and without the node's software prefetch: 256 rows of
//! 1 KiB at random out of a 32 MiB block (the loader benchmark's shape: `shuffle="block"`,
//! `shuffle_block=32768`) copied into 256 KiB slabs that rotate through a 256 MiB region, as
//! the node's `execute` does, asking for the row `d` pieces ahead meanwhile. The distances run
//! interleaved, so the host's noise falls on all alike. Prints microseconds per batch;
//! `cargo run --release -p shardwire-node --example gather_speed [ROUNDS]`.

use std::time::Instant;

use shardwire_node::bench::{PREFETCH_AHEAD, prefetch};

const ROW: usize = 1024;
const BATCH: usize = 256;
const BLOCK: usize = 32 << 20;
const REGION: usize = 256 << 20;
const BATCHES_PER_TRY: usize = 200;

/// xorshift64: the row picks (the node's Feistel order is as scattered).
struct Rng(u64);

impl Rng {
    fn row(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 as usize % (BLOCK / ROW)) * ROW
    }
}

/// Gathers one batch into `out`, prefetching `ahead` rows on (0: none).
fn gather(block: &[u8], rows: &[usize], out: &mut [u8], ahead: usize) {
    for (i, &r) in rows.iter().enumerate() {
        if ahead > 0
            && let Some(&next) = rows.get(i + ahead)
        {
            prefetch(&block[next..next + ROW]);
        }
        out[i * ROW..(i + 1) * ROW].copy_from_slice(&block[r..r + ROW]);
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("ROUNDS is a number"))
        .unwrap_or(30);
    let mut region: Vec<u8> = (0..REGION).map(|i| (i * 31) as u8).collect();
    let (block, slabs) = region.split_at_mut(BLOCK);
    let count = slabs.len() / (ROW * BATCH);
    let distances = [0, 1, 2, PREFETCH_AHEAD, 8, 16];
    let mut micros = vec![Vec::new(); distances.len()];
    let (mut rng, mut slab, mut sink) = (Rng(0x9e37_79b9_7f4a_7c15), 0, 0u64);
    let mut rows = vec![0; BATCH];
    for _ in 0..rounds {
        for (k, &ahead) in distances.iter().enumerate() {
            let t = Instant::now();
            for _ in 0..BATCHES_PER_TRY {
                rows.iter_mut().for_each(|r| *r = rng.row());
                let out = slabs.chunks_mut(ROW * BATCH).nth(slab).expect("a slab");
                slab = (slab + 1) % count;
                gather(block, &rows, out, ahead);
                sink = sink.wrapping_add(u64::from(out[7]));
            }
            micros[k].push(t.elapsed().as_secs_f64() * 1e6 / BATCHES_PER_TRY as f64);
        }
    }
    for (k, &ahead) in distances.iter().enumerate() {
        micros[k].sort_by(f64::total_cmp);
        let node = if ahead == PREFETCH_AHEAD {
            " (the node's)"
        } else {
            ""
        };
        println!(
            "prefetch {ahead:2} rows ahead{node}: median {:6.1} us per batch of {BATCH} x {ROW} B",
            micros[k][micros[k].len() / 2]
        );
    }
    eprintln!("(checksum {sink})");
}
