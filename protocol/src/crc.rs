//! CRC-32C (Castagnoli), as used by iSCSI, ext4 and gRPC.
//!
//! Two implementations, chosen once at run time by what the CPU has: with AVX-512 and
//! VPCLMULQDQ, crc-fast's folding kernels (about 85 GB/s in cache on such a host); otherwise
//! the `crc32c` crate's 3-way interleaved SSE4.2 `crc32` instruction, which measured 1.6x
//! faster than crc-fast's SSE/PCLMUL path on this project's AVX2 build hosts (20.2 vs 12.9
//! GB/s on a 1 MiB buffer in the same run). Both give the same bits; a test checks it.

use std::sync::OnceLock;

use crc_fast::CrcAlgorithm;

fn use_crc_fast() -> bool {
    static FAST: OnceLock<bool> = OnceLock::new();
    *FAST.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("vpclmulqdq")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            true // aarch64: crc-fast uses PMULL/CRC32 instructions
        }
    })
}

fn append_with(fast: bool, crc: u32, bytes: &[u8]) -> u32 {
    if fast {
        let part = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, bytes) as u32;
        crc32c::crc32c_combine(crc, part, bytes.len())
    } else {
        crc32c::crc32c_append(crc, bytes)
    }
}

/// CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    append_with(use_crc_fast(), 0, bytes)
}

/// Incremental CRC-32C, for data that arrives in pieces.
#[derive(Clone, Copy, Debug, Default)]
pub struct Crc32c(u32);

impl Crc32c {
    /// A fresh checksum state.
    pub fn new() -> Self {
        Self::default()
    }
    /// Feeds more bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0 = append_with(use_crc_fast(), self.0, bytes);
    }
    /// The checksum of everything fed so far.
    pub fn finish(&self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // RFC 3720 B.4: 32 bytes of zeros -> 0x8a9136aa; "123456789" -> 0xe3069283.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn incremental_matches_one_shot() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut c = Crc32c::new();
        for chunk in data.chunks(333) {
            c.update(chunk);
        }
        assert_eq!(c.finish(), crc32c(&data));
    }

    #[test]
    fn both_implementations_agree() {
        let data: Vec<u8> = (0..200_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for chunk in [1usize, 7, 64, 4096, 65_537] {
            let (mut a, mut b) = (0, 0);
            for c in data.chunks(chunk) {
                a = append_with(true, a, c);
                b = append_with(false, b, c);
            }
            assert_eq!(a, b, "chunk {chunk}");
        }
        assert_eq!(append_with(true, 0, b"123456789"), 0xe306_9283);
        assert_eq!(append_with(false, 0, b"123456789"), 0xe306_9283);
    }
}
