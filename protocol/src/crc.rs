//! CRC-32C (Castagnoli), as used by iSCSI, ext4 and gRPC; runtime-dispatched SIMD via crc-fast.

use crc_fast::{CrcAlgorithm, Digest};

/// CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// Incremental CRC-32C, for data that arrives in pieces.
pub struct Crc32c(Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Self(Digest::new(CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    /// A fresh checksum state.
    pub fn new() -> Self {
        Self::default()
    }
    /// Feeds more bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    /// The checksum of everything fed so far.
    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
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
}
