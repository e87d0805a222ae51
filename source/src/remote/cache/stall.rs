//! A test's hold on the renames into one cache directory ([`hold`]), the opens of the files in
//! it ([`hold_opens`]), or the reads of their CRC checks and their unlinks ([`hold_op`]): each
//! waits, on its own thread, until the hold goes, as on a disk that stopped answering, so a
//! test can look at the cache and its dataset meanwhile; or the hold only slows each one down
//! ([`pace`]), as on a busy disk. Holds are per directory and operation: tests running at
//! once, each with a directory of its own, do not hold each other's operations, and a hold on
//! a directory's opens lets its renames through.

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// What a hold holds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Renames into the directory (a commit, a file set aside).
    Rename,
    /// Opens of the files in it (a cache hit, [`super::Found::open`]).
    Open,
    /// Each read of a CRC check of a file in it (`RemoteDataset::crc_read`), a chunk at a time.
    Read,
    /// Unlinks of the files in it ([`super::delete`]).
    Unlink,
}

/// One hold: its directory, its operation, how long it slows each one down (`None`: each
/// waits until the hold goes), and how many came to it.
struct Hold {
    dir: PathBuf,
    op: Op,
    pace: Option<Duration>,
    came: usize,
}

/// The holds in place.
static HELD: Mutex<Vec<Hold>> = Mutex::new(Vec::new());

/// Told when a hold goes.
static RELEASED: Condvar = Condvar::new();

/// [`HELD`], locked (a test that failed while holding it does not poison the others).
fn held() -> MutexGuard<'static, Vec<Hold>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits while `op` of `path` (a file of the directory) is held, or for the pace of its hold
/// (the cache calls it before each rename, with the rename's target, each open of an entry's
/// file and each unlink; a CRC check before each read).
pub(crate) fn pass(op: Op, path: &Path) {
    let Some(dir) = path.parent() else { return };
    let mut holds = held();
    let mut came = false;
    loop {
        let Some(h) = holds.iter_mut().find(|h| h.dir == dir && h.op == op) else {
            return;
        };
        if !came {
            h.came += 1;
            came = true;
        }
        if let Some(pace) = h.pace {
            drop(holds);
            std::thread::sleep(pace);
            return;
        }
        holds = RELEASED.wait(holds).unwrap_or_else(PoisonError::into_inner);
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

/// Holds `op` in `dir` until the value returned is dropped (a failing test's too).
pub(crate) fn hold_op(dir: &Path, op: Op) -> Held {
    add(dir, op, None)
}

/// Slows each `op` in `dir` down by `every` (it passes after that), until the value returned
/// is dropped.
pub(crate) fn pace(dir: &Path, op: Op, every: Duration) -> Held {
    add(dir, op, Some(every))
}

/// Puts a hold of `op` in `dir` in place ([`hold_op`], [`pace`]).
fn add(dir: &Path, op: Op, pace: Option<Duration>) -> Held {
    held().push(Hold {
        dir: dir.to_path_buf(),
        op,
        pace,
        came: 0,
    });
    Held(dir.to_path_buf(), op)
}

/// A hold on a directory's operations of one kind ([`hold`], [`hold_opens`], [`hold_op`],
/// [`pace`]).
pub(crate) struct Held(PathBuf, Op);

impl Held {
    /// Operations that came to this hold (held back, or slowed down).
    pub(crate) fn waiting(&self) -> usize {
        let holds = held();
        let mine = holds.iter().find(|h| h.dir == self.0 && h.op == self.1);
        mine.map_or(0, |h| h.came)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        held().retain(|h| !(h.dir == self.0 && h.op == self.1));
        RELEASED.notify_all();
    }
}
