//! The room the disk caches of this process claim on each file system: each dataset has
//! its own cache (`cache_size` each), and several on one disk must fit together, or the
//! disk fills up later and every write fails. A cache's claim is what it may still grow by:
//! its size less what it holds now ([`Used`], which the cache keeps current, so a claim
//! shrinks as its cache fills the disk); it is given back when the cache goes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes a cache holds (entries and reservations), shared with its claim.
#[derive(Debug, Default, Clone)]
pub(crate) struct Used(Arc<AtomicU64>);

impl Used {
    /// The bytes held now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

impl std::ops::AddAssign<u64> for Used {
    fn add_assign(&mut self, n: u64) {
        self.0.fetch_add(n, Ordering::AcqRel);
    }
}

impl std::ops::SubAssign<u64> for Used {
    fn sub_assign(&mut self, n: u64) {
        self.0.fetch_sub(n, Ordering::AcqRel);
    }
}

/// One claim: its id, file system (`st_dev`), cache directory, size and what it holds.
struct Held {
    id: u64,
    fs: u64,
    dir: PathBuf,
    capacity: u64,
    used: Used,
}

impl Held {
    /// What it may still take.
    fn room(&self) -> u64 {
        self.capacity.saturating_sub(self.used.get())
    }
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

/// Claims what the cache at `dir` (of `capacity`, holding `used`) may still take on file
/// system `fs` when `free` (its free bytes now) covers it together with what the process's
/// other caches there may still take; else returns those, (directory, bytes), to name.
pub(crate) fn claim(
    fs: u64,
    dir: &Path,
    (capacity, used): (u64, &Used),
    free: u64,
) -> Result<Claim, Vec<(PathBuf, u64)>> {
    let mut claims = CLAIMS.lock().unwrap_or_else(|p| p.into_inner());
    let others: Vec<(PathBuf, u64)> = claims
        .iter()
        .filter(|h| h.fs == fs)
        .map(|h| (h.dir.clone(), h.room()))
        .collect();
    let claimed = others.iter().fold(0u64, |a, o| a.saturating_add(o.1));
    if claimed.saturating_add(capacity.saturating_sub(used.get())) > free {
        return Err(others);
    }
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    claims.push(Held {
        id,
        fs,
        dir: dir.to_path_buf(),
        capacity,
        used: used.clone(),
    });
    Ok(Claim { id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_on_one_file_system_add_up_shrink_as_caches_fill_and_are_given_back() {
        // A file system id of this test's own: other tests' caches claim on real ones.
        let fs = u64::MAX - 7;
        let mut a_used = Used::default();
        let a = claim(fs, Path::new("/c/a"), (600, &a_used), 1000).unwrap();
        let b_used = Used::default();
        let refused = claim(fs, Path::new("/c/b"), (600, &b_used), 1000).unwrap_err();
        assert_eq!(refused, [(PathBuf::from("/c/a"), 600)]);
        // Another file system is another budget.
        let other = claim(fs - 1, Path::new("/d/b"), (600, &b_used), 1000).unwrap();
        // `a` writes 500 bytes: the disk has 500 free, `a` may take 100 more. Before, its
        // claim stayed 600 and refused a cache that fits.
        a_used += 500;
        let b = claim(fs, Path::new("/c/b"), (400, &b_used), 500).unwrap();
        drop((a, b, other));
        let b = claim(fs, Path::new("/c/b"), (600, &b_used), 1000).unwrap();
        drop(b);
    }
}
