//! `shardwire index DIR`: builds the dataset manifest ([`Manifest`]) of a directory of
//! Arrow IPC (`.arrow`, `.arrows`, `.ipc`, `.feather`), `.npy` and `.bin` files.
//!
//! Each shard is one contiguous byte range of one file (a record batch body, a `.npy` data
//! section, a whole `.bin` file) with its CRC-32C; its tensors are byte ranges inside it,
//! with absolute file offsets. Files are visited in sorted relative-path order, so the same
//! directory always yields the same manifest and digest.

#![forbid(unsafe_code)]

mod arrow;
mod bin;
mod error;
mod npy;
mod pylit;
mod source;
#[cfg(test)]
mod testutil;
mod walk;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use shardwire_protocol::manifest::{MANIFEST_FILE, Manifest};

pub use crate::error::IndexError;
use crate::source::Source;
use crate::walk::Kind;

/// Options for [`index_dir`].
#[derive(Clone, Debug, Default)]
pub struct IndexOptions {
    /// Show the `indexed 120/4000 files, 3.2 GiB` progress line on stderr. Even when true,
    /// the line is drawn only if stderr is a terminal, so redirected output stays clean.
    pub progress: bool,
}

/// Indexes every data file under `dir` into a validated manifest.
pub fn index_dir(dir: &Path, opts: &IndexOptions) -> Result<Manifest, IndexError> {
    if !dir.is_dir() {
        return Err(IndexError::NotADirectory {
            dir: dir.to_path_buf(),
        });
    }
    let files = walk::collect(dir)?;
    let mut progress = Progress::new(
        opts.progress && std::io::stderr().is_terminal(),
        files.len(),
    );
    let mut shards = Vec::new();
    for f in &files {
        let found = Source::open(&f.path, &f.rel).and_then(|mut src| match f.kind {
            Kind::Arrow => arrow::index(&mut src),
            Kind::Npy => npy::index(&mut src),
            Kind::Bin => bin::index(&mut src),
        });
        match found {
            Ok(found) => shards.extend(found),
            Err(e) => {
                progress.finish();
                return Err(e);
            }
        }
        progress.file_done(f.size);
    }
    progress.finish();
    if shards.is_empty() {
        return Err(IndexError::NoUsableFiles {
            dir: dir.to_path_buf(),
            found: files.len(),
        });
    }
    let manifest = Manifest::new(shards);
    manifest.validate().map_err(|source| IndexError::Manifest {
        dir: dir.to_path_buf(),
        source,
    })?;
    Ok(manifest)
}

/// Writes `m` to `dir/shardwire.manifest.json` atomically (temporary file, fsync, rename)
/// and returns the path.
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<PathBuf, IndexError> {
    let path = dir.join(MANIFEST_FILE);
    let tmp = dir.join(format!(".{MANIFEST_FILE}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&m.to_json())?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(IndexError::io(&tmp, e));
    }
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(IndexError::io(&path, e));
    }
    // Persist the rename; not every filesystem lets a directory be fsynced, so this is
    // best effort.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(path)
}

/// The `indexed 120/4000 files, 3.2 GiB` line on stderr.
struct Progress {
    on: bool,
    total: usize,
    done: usize,
    bytes: u64,
}

impl Progress {
    fn new(on: bool, total: usize) -> Self {
        Self {
            on,
            total,
            done: 0,
            bytes: 0,
        }
    }

    fn file_done(&mut self, size: u64) {
        self.done += 1;
        self.bytes += size;
        if self.on {
            let mut e = std::io::stderr().lock();
            let _ = write!(
                e,
                "\rindexed {}/{} files, {}",
                self.done,
                self.total,
                human_bytes(self.bytes)
            );
            let _ = e.flush();
        }
    }

    fn finish(&self) {
        if self.on && self.done > 0 {
            eprintln!();
        }
    }
}

/// `1536` -> `1.5 KiB`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::temp_dir;

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn empty_or_missing_dir_is_an_error_naming_it() {
        let dir = temp_dir("lib-empty");
        std::fs::write(dir.join("readme.txt"), b"hi").unwrap();
        let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
        assert!(
            matches!(err, IndexError::NoUsableFiles { found: 0, .. }),
            "{err}"
        );
        assert!(err.to_string().contains(dir.to_str().unwrap()), "{err}");
        let missing = dir.join("nope");
        let err = index_dir(&missing, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nope") && err.contains("not a directory"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn write_manifest_round_trips_and_is_skipped_on_reindex() {
        let dir = temp_dir("lib-write");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.bin"), [1u8, 2, 3]).unwrap();
        std::fs::write(dir.join("sub/a.bin"), [4u8; 10]).unwrap();
        let m = index_dir(&dir, &IndexOptions { progress: false }).unwrap();
        let files: Vec<&str> = m.shards.iter().map(|s| s.file.as_str()).collect();
        assert_eq!(files, ["b.bin", "sub/a.bin"]);
        assert_eq!(m.total_bytes, 13);
        let path = write_manifest(&dir, &m).unwrap();
        assert_eq!(path, dir.join(MANIFEST_FILE));
        let back = Manifest::from_json(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, m);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "no temporary file left behind: {names:?}");
        // Re-indexing ignores the manifest and gives the same digest.
        assert_eq!(
            index_dir(&dir, &IndexOptions::default()).unwrap().digest,
            m.digest
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
