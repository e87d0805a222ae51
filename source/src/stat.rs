//! The check of a local shard file ([`Opened::check`], an `fstat` of the open file) that every
//! FETCH and every announcement of one makes, run on a blocking thread within [`STAT_LIMIT`].
//!
//! On a hard-mounted network file system whose server stopped answering, `fstat` blocks for as
//! long as the server is gone. Before, the check ran on a runtime worker: as many sessions
//! fetching from that mount as there are workers blocked all of them, and the accept loop, the
//! sessions of every other dataset, their keepalives and the admin endpoint stopped too (their
//! nodes then dropped them as silent). Now a check that does not return in time refuses its
//! FETCH as a file that could not be examined ([`ShardChanged::Stat`]: `ReadFailed`, naming the
//! file; the node asks another source), and while it has not returned, every further check of
//! that file is refused at once, without a thread of its own: a dead mount holds a blocking
//! thread per file, not one per FETCH. A check that returns, however late, lets the file be
//! checked again.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::datasets::{Opened, ShardChanged};

/// How long the check of a shard file may take before its FETCH is refused.
pub(crate) const STAT_LIMIT: Duration = Duration::from_secs(5);

/// Where one check stands; changed only under the lock of [`Stats::hung`].
const RUNNING: u8 = 0;
/// It returned (in time or not).
const RETURNED: u8 = 1;
/// Its caller stopped waiting for it, and counted it in [`Stats::hung`].
const GIVEN_UP: u8 = 2;

/// The checks of local shard files that did not return within their limit and are still
/// under way (each holds a blocking thread).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// How many checks of each file are past their limit, by the address of the file's
    /// [`Opened`] (which lives as long as the source: its datasets are fixed at start).
    hung: Arc<Mutex<HashMap<usize, usize>>>,
}

/// The table of [`Stats::hung`], locked.
fn lock(hung: &Mutex<HashMap<usize, usize>>) -> MutexGuard<'_, HashMap<usize, usize>> {
    hung.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Stats {
    /// Whether `file` (the open file of `opened`) still holds what it held at open for the
    /// shard at bytes `shard` ([`Opened::check`]), found on a blocking thread within
    /// [`STAT_LIMIT`]; else why not, or that it could not be found out in time.
    pub(crate) async fn check(
        &self,
        opened: &Arc<Opened>,
        file: &Arc<File>,
        shard: Range<u64>,
    ) -> Result<(), ShardChanged> {
        let key = Arc::as_ptr(opened) as usize;
        let (o, f) = (Arc::clone(opened), Arc::clone(file));
        let check = move || o.check(&f, shard);
        self.within(key, &opened.name, STAT_LIMIT, check).await
    }

    /// Runs `check` of file `name` (`key`: its [`Opened`]) on a blocking thread and waits for
    /// it at most `limit`; refuses at once while an earlier check of that file is past its
    /// limit and has not returned.
    async fn within<F>(
        &self,
        key: usize,
        name: &str,
        limit: Duration,
        check: F,
    ) -> Result<(), ShardChanged>
    where
        F: FnOnce() -> Result<(), ShardChanged> + Send + 'static,
    {
        let hung_now = lock(&self.hung).get(&key).copied();
        if let Some(n) = hung_now {
            let why = format!(
                "{n} earlier fstat(s) of it did not return within {limit:?} and have not \
                 returned yet (a network file system whose server does not answer?)"
            );
            return Err(timed_out(name, why));
        }
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (hung, here) = (Arc::clone(&self.hung), Arc::clone(&state));
        let mut task = tokio::task::spawn_blocking(move || {
            let got = check();
            let mut hung = lock(&hung);
            if here.swap(RETURNED, Ordering::Relaxed) == GIVEN_UP {
                forget_one(&mut hung, key);
            }
            got
        });
        let joined = match tokio::time::timeout(limit, &mut task).await {
            Ok(joined) => joined,
            Err(_) => {
                if self.give_up(key, &state) {
                    let why = format!(
                        "fstat did not return within {limit:?} (a network file system whose \
                         server does not answer?)"
                    );
                    return Err(timed_out(name, why));
                }
                task.await // it returned just as the limit ran out: its answer is there
            }
        };
        joined.map_err(|e| ShardChanged::Stat {
            name: name.to_owned(),
            source: io::Error::other(format!("the thread that checked it ended: {e}")),
        })?
    }

    /// Stops waiting for the check `state` of file `key`, counting it as hung, unless it has
    /// returned (false).
    fn give_up(&self, key: usize, state: &AtomicU8) -> bool {
        let mut hung = lock(&self.hung);
        if state.load(Ordering::Relaxed) == RETURNED {
            return false;
        }
        state.store(GIVEN_UP, Ordering::Relaxed);
        *hung.entry(key).or_default() += 1;
        true
    }
}

/// One hung check of file `key` returned.
fn forget_one(hung: &mut HashMap<usize, usize>, key: usize) {
    if let Entry::Occupied(mut e) = hung.entry(key) {
        *e.get_mut() -= 1;
        if *e.get() == 0 {
            e.remove();
        }
    }
}

/// File `name` could not be examined in time (`why`): refused as `ReadFailed`.
fn timed_out(name: &str, why: String) -> ShardChanged {
    ShardChanged::Stat {
        name: name.to_owned(),
        source: io::Error::new(io::ErrorKind::TimedOut, why),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::time::Instant;

    use super::*;

    const LIMIT: Duration = Duration::from_millis(50);

    /// A check that blocks (`fstat` on a mount whose server stopped answering) refuses its
    /// FETCH after the limit, naming the file, while the runtime's one thread goes on; further
    /// checks of that file are refused at once until it returns. Before, the check ran on the
    /// runtime thread itself: nothing else ran until it returned.
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_does_not_return_is_refused_and_the_runtime_goes_on() {
        let stats = Stats::default();
        let ticks = Arc::new(AtomicU64::new(0));
        let t = Arc::clone(&ticks);
        let ticker = tokio::spawn(async move {
            loop {
                t.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let stuck = move || {
            let _ = blocked.recv(); // until released (or the test ends)
            Ok(())
        };
        match stats.within(1, "d.bin", LIMIT, stuck).await {
            Err(ShardChanged::Stat { name, source }) => {
                assert_eq!(name, "d.bin");
                assert_eq!(source.kind(), io::ErrorKind::TimedOut);
                assert!(source.to_string().contains("did not return"), "{source}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            ticks.load(Ordering::Relaxed) > 0,
            "the runtime went on meanwhile"
        );
        // While it hangs, the file's next check is refused at once, without a thread.
        let ran = Arc::new(AtomicBool::new(false));
        let r = Arc::clone(&ran);
        let again = stats.within(1, "d.bin", LIMIT, move || {
            r.store(true, Ordering::Relaxed);
            Ok(())
        });
        let again = again.await.expect_err("refused");
        assert!(again.to_string().contains("d.bin"), "{again}");
        assert!(!ran.load(Ordering::Relaxed), "no check started");
        // Another file is checked as usual, and what its check finds is passed on.
        assert!(stats.within(2, "e.bin", LIMIT, || Ok(())).await.is_ok());
        let modified = || {
            Err(ShardChanged::Modified {
                name: "e.bin".into(),
            })
        };
        let got = stats.within(2, "e.bin", LIMIT, modified).await;
        assert!(matches!(got, Err(ShardChanged::Modified { .. })), "{got:?}");
        // Once the hung check returns, the file is checked again.
        release.send(()).unwrap();
        let t0 = Instant::now();
        while lock(&stats.hung).contains_key(&1) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "not forgotten in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(stats.within(1, "d.bin", LIMIT, || Ok(())).await.is_ok());
        ticker.abort();
    }
}
