//! The room the disk caches of this process claim on each file system: each dataset has
//! its own cache (`cache_size` each), and several on one disk must fit together, or the
//! disk fills up later and every write fails. A cache's claim is what it may still grow
//! by (its size less what its kept entries hold); it is given back when the cache goes.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// One claim: its id, file system (`st_dev`), cache directory and bytes.
struct Held {
    id: u64,
    fs: u64,
    dir: PathBuf,
    bytes: u64,
}

static CLAIMS: Mutex<Vec<Held>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(1);

/// A cache's claim on its file system; given back on drop.
#[derive(Debug)]
pub(crate) struct Claim {
    id: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claims = CLAIMS.lock().unwrap_or_else(|p| p.into_inner());
        claims.retain(|h| h.id != self.id);
    }
}

/// Claims `bytes` on file system `fs` for the cache at `dir` when `free` (its free bytes)
/// covers them together with what the process's other caches there claim; else returns
/// those other claims, (directory, bytes), to name in the error.
pub(crate) fn claim(
    fs: u64,
    dir: &Path,
    bytes: u64,
    free: u64,
) -> Result<Claim, Vec<(PathBuf, u64)>> {
    let mut claims = CLAIMS.lock().unwrap_or_else(|p| p.into_inner());
    let others: Vec<(PathBuf, u64)> = claims
        .iter()
        .filter(|h| h.fs == fs)
        .map(|h| (h.dir.clone(), h.bytes))
        .collect();
    let claimed = others.iter().fold(0u64, |a, o| a.saturating_add(o.1));
    if claimed.saturating_add(bytes) > free {
        return Err(others);
    }
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    claims.push(Held {
        id,
        fs,
        dir: dir.to_path_buf(),
        bytes,
    });
    Ok(Claim { id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_on_one_file_system_add_up_and_are_given_back() {
        // A file system id of this test's own: other tests' caches claim on real ones.
        let fs = u64::MAX - 7;
        let a = claim(fs, Path::new("/c/a"), 600, 1000).unwrap();
        let refused = claim(fs, Path::new("/c/b"), 600, 1000).unwrap_err();
        assert_eq!(refused, [(PathBuf::from("/c/a"), 600)]);
        // Another file system is another budget.
        let other = claim(fs - 1, Path::new("/d/b"), 600, 1000).unwrap();
        drop(a);
        let b = claim(fs, Path::new("/c/b"), 600, 1000).unwrap();
        drop((b, other));
    }
}
