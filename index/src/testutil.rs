//! Test helpers: scratch directories and a check that a manifest describes the bytes that
//! are really in the files.

use std::path::{Path, PathBuf};

use shardwire_protocol::crc::crc32c;
use shardwire_protocol::manifest::Manifest;

/// A fresh, empty directory under the system temp dir, unique to this process and `name`.
pub(crate) fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "shardwire-index-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Checks every shard's CRC-32C and range against the file, that every tensor lies inside
/// its shard, and that for each `(name, bytes)` in `expected` the tensors called `name`,
/// concatenated in shard order, hold exactly `bytes`.
pub(crate) fn check_manifest(dir: &Path, m: &Manifest, expected: &[(&str, Vec<u8>)]) {
    m.validate().unwrap();
    let mut got: Vec<Vec<u8>> = vec![Vec::new(); expected.len()];
    for s in &m.shards {
        let file = std::fs::read(dir.join(&s.file)).unwrap();
        let payload = &file[s.offset as usize..(s.offset + s.length) as usize];
        assert_eq!(
            crc32c(payload),
            s.crc32c,
            "crc of {} @ {}",
            s.file,
            s.offset
        );
        for t in &s.tensors {
            assert!(
                t.offset >= s.offset && t.offset + t.length <= s.offset + s.length,
                "{t:?} outside {s:?}"
            );
            if let Some(i) = expected.iter().position(|(n, _)| *n == t.name) {
                got[i].extend_from_slice(&file[t.offset as usize..(t.offset + t.length) as usize]);
            }
        }
    }
    for ((name, want), got) in expected.iter().zip(got) {
        assert_eq!(&got, want, "bytes of tensor `{name}`");
    }
}

/// Little-endian bytes of a slice of numbers.
pub(crate) fn le_bytes<T: Copy, const N: usize>(vals: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    vals.iter().flat_map(|&v| f(v)).collect()
}
