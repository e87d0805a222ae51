//! A test's hold on the renames into one cache directory ([`hold`]): each waits, on its own
//! thread, until the hold goes, as on a disk that stopped answering, so a test can look at
//! the cache and its dataset meanwhile. Holds are per directory: tests running at once, each
//! with a directory of its own, do not hold each other's renames.

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// The directories held, each with the renames that came to wait there.
static HELD: Mutex<Vec<(PathBuf, usize)>> = Mutex::new(Vec::new());

/// Told when a hold goes.
static RELEASED: Condvar = Condvar::new();

/// [`HELD`], locked (a test that failed while holding it does not poison the others).
fn held() -> MutexGuard<'static, Vec<(PathBuf, usize)>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits while the directory of `to` is held (the cache calls it before each rename).
pub(super) fn pass(to: &Path) {
    let Some(dir) = to.parent() else { return };
    let mut dirs = held();
    let mut came = false;
    loop {
        let Some(at) = dirs.iter().position(|(d, _)| d == dir) else {
            return;
        };
        if !came {
            dirs[at].1 += 1;
            came = true;
        }
        dirs = RELEASED.wait(dirs).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Holds the renames into `dir` until the value returned is dropped (a failing test's too).
pub(crate) fn hold(dir: &Path) -> Held {
    held().push((dir.to_path_buf(), 0));
    Held(dir.to_path_buf())
}

/// A hold on a directory's renames ([`hold`]).
pub(crate) struct Held(PathBuf);

impl Held {
    /// Renames that came to wait on this hold.
    pub(crate) fn waiting(&self) -> usize {
        held().iter().find(|(d, _)| *d == self.0).map_or(0, |h| h.1)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        held().retain(|(d, _)| *d != self.0);
        RELEASED.notify_all();
    }
}
