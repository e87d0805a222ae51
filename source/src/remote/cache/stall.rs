//! A test's hold on the renames into one cache directory ([`hold`]), or on the opens of the
//! files in it ([`hold_opens`]): each waits, on its own thread, until the hold goes, as on a
//! disk that stopped answering, so a test can look at the cache and its dataset meanwhile.
//! Holds are per directory and operation: tests running at once, each with a directory of its
//! own, do not hold each other's renames or opens, and a hold on a directory's opens lets its
//! renames through.

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// What a hold holds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Renames into the directory (a commit, a file set aside).
    Rename,
    /// Opens of the files in it (a cache hit, [`super::Found::open`]).
    Open,
}

/// The directories held, each with the operation held and how many came to wait there.
static HELD: Mutex<Vec<(PathBuf, Op, usize)>> = Mutex::new(Vec::new());

/// Told when a hold goes.
static RELEASED: Condvar = Condvar::new();

/// [`HELD`], locked (a test that failed while holding it does not poison the others).
fn held() -> MutexGuard<'static, Vec<(PathBuf, Op, usize)>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits while `op` of `path` (a file of the directory) is held (the cache calls it before
/// each rename, with the rename's target, and each open of an entry's file).
pub(super) fn pass(op: Op, path: &Path) {
    let Some(dir) = path.parent() else { return };
    let mut dirs = held();
    let mut came = false;
    loop {
        let Some(at) = dirs.iter().position(|(d, o, _)| d == dir && *o == op) else {
            return;
        };
        if !came {
            dirs[at].2 += 1;
            came = true;
        }
        dirs = RELEASED.wait(dirs).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Holds the renames into `dir` until the value returned is dropped (a failing test's too).
pub(crate) fn hold(dir: &Path) -> Held {
    hold_op(dir, Op::Rename)
}

/// Holds the opens of the files in `dir` until the value returned is dropped (a failing
/// test's too).
pub(crate) fn hold_opens(dir: &Path) -> Held {
    hold_op(dir, Op::Open)
}

/// Holds `op` in `dir` ([`hold`], [`hold_opens`]).
fn hold_op(dir: &Path, op: Op) -> Held {
    held().push((dir.to_path_buf(), op, 0));
    Held(dir.to_path_buf(), op)
}

/// A hold on a directory's renames or opens ([`hold`], [`hold_opens`]).
pub(crate) struct Held(PathBuf, Op);

impl Held {
    /// Operations that came to wait on this hold.
    pub(crate) fn waiting(&self) -> usize {
        let dirs = held();
        let mine = dirs.iter().find(|h| h.0 == self.0 && h.1 == self.1);
        mine.map_or(0, |h| h.2)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        held().retain(|(d, o, _)| !(*d == self.0 && *o == self.1));
        RELEASED.notify_all();
    }
}
