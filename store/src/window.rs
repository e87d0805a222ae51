//! The per-bucket adaptive window: how many requests may be in flight to one bucket.
//!
//! AIMD: a throttle (503/429 SlowDown) halves the limit (floor 1), once per "epoch" (the
//! requests already in flight when it was halved report their throttles without halving it
//! again); a window's worth of successes (as many as the limit) raises it by one, up to the
//! ceiling (`max_inflight`). [`Aimd`] is the pure rule; [`Window`] hands out [`Permit`]s
//! under it, urgent requests (reads a FETCH waits for) before the rest (reads ahead). One
//! window per bucket per process ([`for_bucket`]), so every dataset and store handle on one
//! bucket shares it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

use crate::metrics as m;

/// The window's state as reported (`Store::window`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowStatus {
    /// Current in-flight limit.
    pub limit: usize,
    /// Requests in flight now.
    pub in_flight: usize,
    /// The ceiling (`max_inflight`).
    pub ceiling: usize,
    /// Throttle answers (503/429) seen, every attempt counted.
    pub throttles: u64,
}

/// The AIMD rule, without clocks or waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Aimd {
    limit: usize,
    ceiling: usize,
    in_flight: usize,
    epoch: u64,
    successes: usize,
    throttles: u64,
}

impl Aimd {
    /// A window at its ceiling (at least 1).
    pub fn new(ceiling: usize) -> Self {
        let ceiling = ceiling.max(1);
        Self {
            limit: ceiling,
            ceiling,
            in_flight: 0,
            epoch: 0,
            successes: 0,
            throttles: 0,
        }
    }

    /// Takes a slot when one is free: `Some(epoch)` of the request.
    pub fn try_acquire(&mut self) -> Option<u64> {
        if self.in_flight < self.limit {
            self.in_flight += 1;
            Some(self.epoch)
        } else {
            None
        }
    }

    /// A throttle answer to a request of `epoch`: halves the limit unless the window was
    /// already cut since that request started. Returns whether it was cut.
    pub fn throttle(&mut self, epoch: u64) -> bool {
        self.throttles += 1;
        if epoch < self.epoch {
            return false;
        }
        self.limit = (self.limit / 2).max(1);
        self.epoch += 1;
        self.successes = 0;
        true
    }

    /// A request of `epoch` ended; `ok`: it succeeded. Returns whether the limit grew.
    pub fn release(&mut self, epoch: u64, ok: bool) -> bool {
        self.in_flight = self.in_flight.saturating_sub(1);
        if !ok || epoch < self.epoch {
            return false;
        }
        self.successes += 1;
        if self.successes >= self.limit && self.limit < self.ceiling {
            self.limit += 1;
            self.successes = 0;
            return true;
        }
        false
    }

    /// Raises the ceiling (another opener asked for more); never lowers it.
    pub fn raise_ceiling(&mut self, ceiling: usize) {
        self.ceiling = self.ceiling.max(ceiling);
    }

    pub fn status(&self) -> WindowStatus {
        WindowStatus {
            limit: self.limit,
            in_flight: self.in_flight,
            ceiling: self.ceiling,
            throttles: self.throttles,
        }
    }
}

/// Whether a request goes before reads ahead for a slot: set for a read someone waits for
/// now; a read ahead's is raised when someone comes to wait for it ([`Window::raise`]), and
/// those of its requests still waiting for a slot then go first too. Clones share it.
#[derive(Clone, Debug)]
pub struct Urgency(Arc<AtomicBool>);

impl Urgency {
    /// An urgency of its own, urgent or not.
    pub fn new(urgent: bool) -> Self {
        Self(Arc::new(AtomicBool::new(urgent)))
    }

    /// Urgent now.
    pub fn is_urgent(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A bucket's window: [`Aimd`] behind a lock, with waiting for a slot. An urgent request (a
/// read someone waits for now, not a read ahead) goes first: while one waits, the others
/// leave free slots to it.
#[derive(Debug)]
pub(crate) struct Window {
    bucket: String,
    state: Mutex<Aimd>,
    freed: Notify,
    /// Urgent requests waiting for a slot.
    urgent_waiting: AtomicUsize,
}

/// An urgent request waiting for a slot (counted while it waits, however the wait ends; one
/// that gives up wakes the others, which may have left a free slot to it).
struct UrgentWait<'a>(&'a Window);

impl<'a> UrgentWait<'a> {
    fn new(w: &'a Window) -> Self {
        w.urgent_waiting.fetch_add(1, Ordering::SeqCst);
        Self(w)
    }
}

impl Drop for UrgentWait<'_> {
    fn drop(&mut self) {
        self.0.urgent_waiting.fetch_sub(1, Ordering::SeqCst);
        self.0.freed.notify_waiters();
    }
}

impl Window {
    pub fn new(bucket: &str, ceiling: usize) -> Self {
        let w = Self {
            bucket: bucket.to_owned(),
            state: Mutex::new(Aimd::new(ceiling)),
            freed: Notify::new(),
            urgent_waiting: AtomicUsize::new(0),
        };
        w.publish(&w.lock());
        w
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Aimd> {
        // A panic while holding the lock leaves a consistent Aimd (plain integer updates).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, s: &Aimd) {
        let st = s.status();
        let b = self.bucket.clone();
        metrics::gauge!(m::WINDOW, "bucket" => b.clone()).set(st.limit as f64);
        metrics::gauge!(m::INFLIGHT, "bucket" => b).set(st.in_flight as f64);
    }

    /// Waits for a slot; an urgent request goes before the others waiting, also one whose
    /// `urgency` is raised while it waits.
    pub async fn acquire(self: &Arc<Self>, urgency: &Urgency) -> Permit {
        let mut waiting = None;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            // Read after `enable`: a raise from now on wakes this wait.
            let urgent = urgency.is_urgent();
            if urgent && waiting.is_none() {
                waiting = Some(UrgentWait::new(self));
            }
            {
                let mut s = self.lock();
                let yields = !urgent && self.urgent_waiting.load(Ordering::SeqCst) > 0;
                if !yields && let Some(epoch) = s.try_acquire() {
                    self.publish(&s);
                    return Permit {
                        window: Arc::clone(self),
                        epoch,
                        ok: false,
                    };
                }
            }
            freed.await;
        }
    }

    /// Makes `urgency` urgent and wakes the waiters, so its requests waiting for a slot go
    /// first from now on.
    pub fn raise(&self, urgency: &Urgency) {
        if !urgency.0.swap(true, Ordering::SeqCst) {
            self.freed.notify_waiters();
        }
    }

    /// A throttle answer to a request of `epoch`.
    pub fn throttle(&self, epoch: u64) {
        let mut s = self.lock();
        if s.throttle(epoch) {
            tracing::info!(
                bucket = %self.bucket,
                limit = s.status().limit,
                "object store throttled: in-flight window halved"
            );
        }
        self.publish(&s);
    }

    pub fn raise_ceiling(&self, ceiling: usize) {
        let mut s = self.lock();
        s.raise_ceiling(ceiling);
    }

    pub fn status(&self) -> WindowStatus {
        self.lock().status()
    }

    fn release(&self, epoch: u64, ok: bool) {
        {
            let mut s = self.lock();
            s.release(epoch, ok);
            self.publish(&s);
        }
        self.freed.notify_waiters();
    }
}

/// A slot in a window; gives it back when dropped (as a failure unless [`Permit::succeeded`]).
#[derive(Debug)]
pub(crate) struct Permit {
    window: Arc<Window>,
    epoch: u64,
    ok: bool,
}

impl Permit {
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Marks the request as successful (counts toward growing the window).
    pub fn succeeded(&mut self) {
        self.ok = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.window.release(self.epoch, self.ok);
    }
}

/// The process's window for `bucket` (`scheme://bucket`), made with `ceiling` on first use.
pub(crate) fn for_bucket(bucket: &str, ceiling: usize) -> Arc<Window> {
    static ALL: OnceLock<Mutex<HashMap<String, Arc<Window>>>> = OnceLock::new();
    let mut all = ALL
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let w = all
        .entry(bucket.to_owned())
        .or_insert_with(|| Arc::new(Window::new(bucket, ceiling)));
    w.raise_ceiling(ceiling);
    Arc::clone(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aimd_halves_once_per_epoch_and_grows_by_one_per_window() {
        let mut w = Aimd::new(8);
        let epochs: Vec<u64> = (0..8).map(|_| w.try_acquire().unwrap()).collect();
        assert_eq!(w.try_acquire(), None, "full at the ceiling");
        // Three requests of epoch 0 are throttled: only the first halves.
        assert!(w.throttle(epochs[0]));
        assert!(!w.throttle(epochs[1]));
        assert!(!w.throttle(epochs[2]));
        assert_eq!((w.status().limit, w.status().throttles), (4, 3));
        // Old-epoch successes do not grow the window.
        for &e in &epochs {
            assert!(!w.release(e, true));
        }
        assert_eq!(w.status().in_flight, 0);
        // A throttle in the new epoch halves again: 4 -> 2 -> 1 -> 1 (floor).
        for want in [2, 1, 1] {
            let e = w.try_acquire().unwrap();
            assert!(w.throttle(e));
            w.release(e, false);
            assert_eq!(w.status().limit, want);
        }
        // Grow back: limit successes each raise it by one.
        let mut seq = Vec::new();
        for _ in 0..10 {
            let e = w.try_acquire().unwrap();
            w.release(e, true);
            seq.push(w.status().limit);
        }
        assert_eq!(seq, [2, 2, 3, 3, 3, 4, 4, 4, 4, 5]);
        // Never past the ceiling.
        for _ in 0..100 {
            let e = w.try_acquire().unwrap();
            w.release(e, true);
        }
        assert_eq!(w.status().limit, 8);
    }

    #[test]
    fn floor_is_one_and_ceiling_only_rises() {
        let mut w = Aimd::new(0);
        assert_eq!(w.status().limit, 1);
        let e = w.try_acquire().unwrap();
        assert_eq!(w.try_acquire(), None);
        w.throttle(e);
        assert_eq!(w.status().limit, 1);
        w.raise_ceiling(4);
        w.raise_ceiling(2);
        assert_eq!(w.status().ceiling, 4);
    }

    /// Spawns an acquire of `w` (urgent or not) and lets it reach its wait.
    async fn waiter(w: &Arc<Window>, urgent: bool) -> tokio::task::JoinHandle<Permit> {
        waiter_with(w, Urgency::new(urgent)).await
    }

    /// Spawns an acquire of `w` with `urgency` and lets it reach its wait.
    async fn waiter_with(w: &Arc<Window>, urgency: Urgency) -> tokio::task::JoinHandle<Permit> {
        let w = Arc::clone(w);
        let t = tokio::spawn(async move { w.acquire(&urgency).await });
        tokio::task::yield_now().await;
        t
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_read_ahead_raised_while_it_waits_takes_the_next_slot_before_the_others() {
        for _ in 0..20 {
            let w = Arc::new(Window::new("test://raised", 1));
            let held = w.acquire(&Urgency::new(false)).await;
            let ahead = waiter(&w, false).await;
            let wanted = Urgency::new(false);
            let raised = waiter_with(&w, wanted.clone()).await;
            let later = waiter(&w, false).await;
            w.raise(&wanted);
            tokio::task::yield_now().await;
            assert_eq!(w.urgent_waiting.load(Ordering::SeqCst), 1);
            drop(held);
            let permit = tokio::time::timeout(std::time::Duration::from_secs(5), raised)
                .await
                .expect("the raised request gets the freed slot")
                .unwrap();
            tokio::task::yield_now().await;
            assert!(
                !ahead.is_finished() && !later.is_finished(),
                "the others wait"
            );
            assert_eq!(w.urgent_waiting.load(Ordering::SeqCst), 0);
            drop(permit);
            // Done: the others' permits (whoever got the slot) go with their tasks.
            ahead.abort();
            later.abort();
            let _ = (ahead.await, later.await);
            assert_eq!(w.status().in_flight, 0);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_urgent_request_takes_the_next_slot_before_earlier_waiters() {
        let w = Arc::new(Window::new("test://urgent", 1));
        let held = w.acquire(&Urgency::new(false)).await;
        let ahead = waiter(&w, false).await;
        let urgent = waiter(&w, true).await;
        drop(held);
        let permit = tokio::time::timeout(std::time::Duration::from_secs(5), urgent)
            .await
            .expect("the urgent request gets the freed slot")
            .unwrap();
        tokio::task::yield_now().await;
        assert!(
            !ahead.is_finished(),
            "the read ahead waits for the urgent one"
        );
        drop(permit);
        let _ = ahead.await.unwrap();
        assert_eq!(w.status().in_flight, 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_urgent_request_that_gives_up_leaves_the_slot_to_the_others() {
        let w = Arc::new(Window::new("test://urgent-gone", 1));
        let held = w.acquire(&Urgency::new(false)).await;
        let ahead = waiter(&w, false).await;
        let urgent = waiter(&w, true).await;
        drop(held);
        urgent.abort();
        let permit = tokio::time::timeout(std::time::Duration::from_secs(5), ahead)
            .await
            .expect("the read ahead is not left waiting")
            .unwrap();
        drop(permit);
        assert_eq!(w.urgent_waiting.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn permits_wait_for_a_free_slot() {
        let w = Arc::new(Window::new("test://permits", 2));
        let a = w.acquire(&Urgency::new(false)).await;
        let mut b = w.acquire(&Urgency::new(false)).await;
        assert_eq!(w.status().in_flight, 2);
        let w2 = Arc::clone(&w);
        let waiter = tokio::spawn(async move { w2.acquire(&Urgency::new(false)).await.epoch() });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        b.succeeded();
        drop(b);
        assert_eq!(waiter.await.unwrap(), 0);
        drop(a);
        assert_eq!(w.status().in_flight, 0);
    }
}
