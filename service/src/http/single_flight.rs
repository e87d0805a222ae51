//! One blocking probe at a time, shared by every request that asks for it (`GET /v1/nics`):
//! a request that finds a probe running waits for that probe's result, one that finds a
//! result at most [`SingleFlight::fresh`] old gets it at once, and only one that finds
//! neither starts a probe. A probe runs on a blocking thread, which cannot be cancelled: it
//! runs to its end whoever still waits (a request that timed out or whose client left), and
//! the requests after it wait for it rather than start another, so probes never hold more
//! than one of the runtime's blocking threads however many requests come.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// A probe run at most once at a time, its last result kept for `fresh`.
pub(super) struct SingleFlight<T> {
    /// How long a finished probe's result is answered without a new probe.
    fresh: Duration,
    probe: Box<dyn Fn() -> T + Send + Sync>,
    state: Mutex<Flight<T>>,
}

struct Flight<T> {
    /// The last probe's result and when it finished.
    last: Option<(Instant, T)>,
    /// The probe running now: its result arrives here.
    running: Option<watch::Receiver<Option<T>>>,
}

/// The probe ended without a result (it panicked, or the runtime is shutting down).
#[derive(Debug, thiserror::Error)]
#[error("the probe ended without a result (it panicked, or the node is shutting down)")]
pub(super) struct ProbeLost;

impl<T: Clone + Send + Sync + 'static> SingleFlight<T> {
    /// Runs `probe` (on a blocking thread) for the requests of [`SingleFlight::get`].
    pub(super) fn new(fresh: Duration, probe: impl Fn() -> T + Send + Sync + 'static) -> Self {
        Self {
            fresh,
            probe: Box::new(probe),
            state: Mutex::new(Flight {
                last: None,
                running: None,
            }),
        }
    }

    /// The result of a probe that finished at most `fresh` ago, else of the probe running
    /// now, else of a probe started for this call. Dropping the returned future (a timeout)
    /// leaves the probe running, for the calls after it.
    pub(super) async fn get(self: &Arc<Self>) -> Result<T, ProbeLost> {
        let mut result = {
            let mut f = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((at, v)) = &f.last
                && at.elapsed() <= self.fresh
            {
                return Ok(v.clone());
            }
            // A closed channel with no result: that probe is gone (it panicked).
            let running = f.running.as_ref().filter(|rx| rx.has_changed().is_ok());
            match running.cloned() {
                Some(rx) => rx,
                None => {
                    let rx = self.start();
                    f.running = Some(rx.clone());
                    rx
                }
            }
        };
        let got = result
            .wait_for(Option::is_some)
            .await
            .map_err(|_| ProbeLost)?;
        Option::clone(&got).ok_or(ProbeLost)
    }

    /// Starts a probe on a blocking thread (the caller holds the state's lock and records
    /// the probe as running); its result is kept, and sent to whoever waits.
    fn start(self: &Arc<Self>) -> watch::Receiver<Option<T>> {
        let (tx, rx) = watch::channel(None);
        let me = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let v = (me.probe)();
            let mut f = me.state.lock().unwrap_or_else(PoisonError::into_inner);
            f.last = Some((Instant::now(), v.clone()));
            f.running = None;
            drop(f);
            tx.send_replace(Some(v));
        });
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A flight whose probe counts its runs and takes `took`.
    fn counted(fresh: Duration, took: Duration) -> (Arc<SingleFlight<usize>>, Arc<AtomicUsize>) {
        let runs = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&runs);
        let flight = SingleFlight::new(fresh, move || {
            std::thread::sleep(took);
            r.fetch_add(1, Ordering::SeqCst) + 1
        });
        (Arc::new(flight), runs)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_share_one_probe_and_a_timed_out_one_restarts_none() {
        // Before: `GET /v1/nics` started a probe per request (`spawn_blocking` each time),
        // and one whose request timed out kept its thread while the next request began another.
        let (flight, runs) = counted(Duration::from_secs(1), Duration::from_millis(200));
        // A request that gives up first: its probe runs on, and is the one the others share.
        let gave_up = tokio::time::timeout(Duration::from_millis(20), flight.get()).await;
        assert!(gave_up.is_err(), "the probe takes 200 ms");
        let waiting: Vec<_> = (0..16)
            .map(|_| {
                let f = Arc::clone(&flight);
                tokio::spawn(async move { f.get().await.unwrap() })
            })
            .collect();
        for w in waiting {
            assert_eq!(w.await.unwrap(), 1, "the first probe's result");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "one probe for 17 requests");
        // Within `fresh` of it: its result, no probe.
        assert_eq!(flight.get().await.unwrap(), 1);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Later: a new probe.
        tokio::time::sleep(Duration::from_millis(1_050)).await;
        assert_eq!(flight.get().await.unwrap(), 2);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_probe_that_panicked_is_started_again_by_the_next_request() {
        let first = Arc::new(AtomicUsize::new(0));
        let f = Arc::clone(&first);
        let flight = Arc::new(SingleFlight::new(Duration::ZERO, move || {
            assert!(
                f.fetch_add(1, Ordering::SeqCst) > 0,
                "the first probe fails"
            );
            7
        }));
        assert!(flight.get().await.is_err(), "the panicked probe's waiter");
        assert_eq!(flight.get().await.unwrap(), 7, "a new probe");
    }
}
