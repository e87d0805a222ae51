//! A software prefetch for the host batch gather ([`super::assemble::execute`]): a batch's
//! rows are scattered over a block of tens of MiB that is no longer in cache, so each row's
//! copy waits on memory; asking for the rows a few pieces ahead lets those loads overlap the
//! copy in hand. The hint is `prefetcht1` (Intel documents it as "into L2 and outward"; what
//! a CPU does with it is its own choice), not `prefetcht0` (into L1): a 1 KiB row is 16
//! lines, and with several rows ahead L1's few miss buffers fill, so the L1 hint stalled the
//! gather on the prefetch instructions themselves (docs/BENCHMARKS.md, "The gather's prefetch
//! into L2, ...": a quarter off a gather of 1 KiB rows from a block out of cache, on the AMD
//! kind). A hint only: it never faults and changes no result.

/// How many pieces ahead of the one being copied the gather asks for (4-16 measured alike).
pub const AHEAD: usize = 8;

/// At most this many bytes of a piece are asked for: a longer piece is consecutive, and the
/// CPU's own prefetcher follows it once its copy starts.
const MAX_BYTES: usize = 4096;

/// The cache line the hint goes by.
const LINE: usize = 64;

/// Asks the CPU to bring the first `MAX_BYTES` of `bytes` into its caches (`prefetcht1`).
pub fn prefetch(bytes: &[u8]) {
    let bytes = &bytes[..bytes.len().min(MAX_BYTES)];
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(LINE) {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: `prefetcht1` (SSE, in the x86_64 baseline) reads nothing architecturally and
        // never faults; the pointer is the start of a live slice besides.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_length_and_alignment_is_a_harmless_hint() {
        let buf: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        for start in [0, 1, 63, 64, 4095] {
            for len in [0, 1, 64, 65, 4096, 5000] {
                prefetch(&buf[start..start + len]);
            }
        }
        assert_eq!(buf[4095], 255, "the bytes are unchanged");
    }
}
