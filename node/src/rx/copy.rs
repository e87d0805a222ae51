//! Copying received bytes out of a small cache-hot buffer into a shard's slab with
//! non-temporal stores: the slab is written once and not read again by this thread (the
//! trainer or the batcher reads it later), so its lines need not displace the hot buffer and
//! the CRC's working set from the caches, and the stores skip the read-for-ownership of a
//! normal copy into cold memory.
//!
//! x86_64 only (SSE2 `movntdq`, 16 bytes per store, which every x86_64 CPU has; AVX-512
//! `vmovntdq` where present); elsewhere a plain copy.

/// Copies `src` into `dst` (equal lengths) with non-temporal stores where the CPU has them.
///
/// # Panics
///
/// If the lengths differ.
pub fn copy_nt(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_nt needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if avx512() {
            // SAFETY: the CPU has AVX-512F (checked at run time); the slices are valid for
            // their lengths and do not overlap (`&mut` and `&` borrows).
            unsafe { x86::copy_nt_avx512(dst, src) };
        } else {
            // SAFETY: SSE2 is part of the x86_64 baseline; as above for the slices.
            unsafe { x86::copy_nt_sse2(dst, src) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m512i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128, _mm512_loadu_si512,
        _mm512_stream_si512,
    };

    /// The bytes before `dst` reaches `align`, copied normally; returns how many.
    fn head(dst: &mut [u8], src: &[u8], align: usize) -> usize {
        let n = dst.as_ptr().align_offset(align).min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        n
    }

    /// # Safety
    ///
    /// The CPU must have AVX-512F; `dst` and `src` have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn copy_nt_avx512(dst: &mut [u8], src: &[u8]) {
        let mut at = head(dst, src, 64);
        while at + 64 <= dst.len() {
            // SAFETY: `at + 64 <= len` for both slices (equal lengths); the load is unaligned,
            // the store's address is 64-byte aligned (`head` aligned it, steps are 64).
            unsafe {
                let v = _mm512_loadu_si512(src.as_ptr().add(at).cast::<__m512i>());
                _mm512_stream_si512(dst.as_mut_ptr().add(at).cast::<__m512i>(), v);
            }
            at += 64;
        }
        dst[at..].copy_from_slice(&src[at..]);
        // Orders the streaming stores before any later store (another thread reads the slab
        // after a release).
        _mm_sfence();
    }

    /// # Safety
    ///
    /// `dst` and `src` have equal lengths (SSE2 is x86_64's baseline).
    pub(super) unsafe fn copy_nt_sse2(dst: &mut [u8], src: &[u8]) {
        let mut at = head(dst, src, 16);
        while at + 16 <= dst.len() {
            // SAFETY: `at + 16 <= len` for both slices; unaligned load, 16-byte aligned store.
            unsafe {
                let v = _mm_loadu_si128(src.as_ptr().add(at).cast::<__m128i>());
                _mm_stream_si128(dst.as_mut_ptr().add(at).cast::<__m128i>(), v);
            }
            at += 16;
        }
        dst[at..].copy_from_slice(&src[at..]);
        // SAFETY: `sfence` has no operands and SSE is part of the x86_64 baseline; as in
        // `copy_nt_avx512`, it orders the streaming stores before any later store.
        unsafe { _mm_sfence() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_alignment_and_length_copies_exactly() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 31 + 7) as u8).collect();
        let mut dst = vec![0u8; 5100];
        for off in [0usize, 1, 15, 16, 17, 63, 64, 65] {
            for len in [0usize, 1, 15, 63, 64, 65, 200, 4096, 4999 - off] {
                dst.fill(0xee);
                copy_nt(&mut dst[off..off + len], &src[off..off + len]);
                assert_eq!(
                    &dst[off..off + len],
                    &src[off..off + len],
                    "off {off} len {len}"
                );
                assert!(dst[..off].iter().all(|&b| b == 0xee), "before, off {off}");
                assert!(
                    dst[off + len..].iter().all(|&b| b == 0xee),
                    "after, off {off} len {len}"
                );
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            // The SSE2 path too, on a CPU with AVX-512 as well.
            dst.fill(0);
            // SAFETY: equal lengths; SSE2 is the x86_64 baseline.
            unsafe { x86::copy_nt_sse2(&mut dst[3..4003], &src[..4000]) };
            assert_eq!(&dst[3..4003], &src[..4000]);
        }
    }
}
