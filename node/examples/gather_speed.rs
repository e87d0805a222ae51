//! The host batch gather's speed with and without the node's software prefetch: 256 rows of
//! 1 KiB at random out of a block that is not in cache (192 MiB here, larger than any L3 this
//! runs on: in the node the next block's shards stream in through the caches meanwhile)
//! copied into 256 KiB slabs that rotate through the rest of a 256 MiB buffer, as the node's
//! `execute` does, asking for the row `d` pieces ahead meanwhile, into L2 (the node's hint) or
//! into L1 (`prefetcht0`, its earlier one). The variants run interleaved, so the host's noise
//! falls on all alike. Prints microseconds per batch;
//! `cargo run --release -p shardwire-node --example gather_speed [ROUNDS]`.

use std::time::Instant;

use shardwire_node::bench::{PREFETCH_AHEAD, prefetch};

const ROW: usize = 1024;
const BATCH: usize = 256;
const BLOCK: usize = 192 << 20;
const BUFFER: usize = 256 << 20;
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

/// Which prefetch a variant issues.
#[derive(Clone, Copy)]
enum Hint {
    None,
    /// The node's: into L2.
    Node,
    /// `prefetcht0`, every line of the row: into L1.
    L1,
}

/// `prefetcht0` over the first 4 KiB of `bytes`, line by line (the node's earlier hint).
fn prefetch_l1(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes[..bytes.len().min(4096)].chunks(64) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch reads nothing architecturally and never faults; the pointer is
        // the start of a live slice.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Gathers one batch into `out`, asking for the row `ahead` pieces on with `hint`.
fn gather(block: &[u8], rows: &[usize], out: &mut [u8], hint: Hint, ahead: usize) {
    for (i, &r) in rows.iter().enumerate() {
        if let Some(&next) = rows.get(i + ahead) {
            match hint {
                Hint::None => {}
                Hint::Node => prefetch(&block[next..next + ROW]),
                Hint::L1 => prefetch_l1(&block[next..next + ROW]),
            }
        }
        out[i * ROW..(i + 1) * ROW].copy_from_slice(&block[r..r + ROW]);
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("ROUNDS is a number"))
        .unwrap_or(20);
    let mut buffer: Vec<u8> = (0..BUFFER).map(|i| (i * 31) as u8).collect();
    let (block, slabs) = buffer.split_at_mut(BLOCK);
    let count = slabs.len() / (ROW * BATCH);
    let variants = [
        (Hint::None, 0, "no prefetch"),
        (Hint::L1, 4, "into L1, 4 rows ahead (the node's earlier)"),
        (Hint::L1, 8, "into L1, 8 rows ahead"),
        (Hint::Node, 4, "into L2, 4 rows ahead"),
        (Hint::Node, PREFETCH_AHEAD, "into L2, the node's distance"),
        (Hint::Node, 16, "into L2, 16 rows ahead"),
    ];
    let mut micros = vec![Vec::new(); variants.len()];
    let (mut rng, mut slab, mut sink) = (Rng(0x9e37_79b9_7f4a_7c15), 0, 0u64);
    let mut rows = vec![0; BATCH];
    for _ in 0..rounds {
        for (k, &(hint, ahead, _)) in variants.iter().enumerate() {
            let t = Instant::now();
            for _ in 0..BATCHES_PER_TRY {
                rows.iter_mut().for_each(|r| *r = rng.row());
                let out = slabs.chunks_mut(ROW * BATCH).nth(slab).expect("a slab");
                slab = (slab + 1) % count;
                gather(block, &rows, out, hint, ahead);
                sink = sink.wrapping_add(u64::from(out[7]));
            }
            micros[k].push(t.elapsed().as_secs_f64() * 1e6 / BATCHES_PER_TRY as f64);
        }
    }
    for (k, &(_, ahead, what)) in variants.iter().enumerate() {
        micros[k].sort_by(f64::total_cmp);
        println!(
            "{what} ({ahead}): median {:6.1} us per batch of {BATCH} x {ROW} B",
            micros[k][micros[k].len() / 2]
        );
    }
    eprintln!("(checksum {sink})");
}
