//! The memory bound on tensor copies the trainer HTTP API has in flight: each
//! `GET /v1/leases/{l}/tensors/{n}` copies the tensor out of the region into its answer, and
//! the copy lives until the client has read it, so a client reading slowly (or many at once)
//! would otherwise hold any amount of memory. A copy takes its bytes from a budget before it
//! is made and gives them back when its bytes are freed: the pieces the body hands the server
//! share the copy's allocation, and the server may hold the last ones after the body is gone,
//! so the room goes with the last piece, not with the body. Waiting for room is not a queue:
//! a copy larger than the room free does not hold back smaller ones behind it.
//! A client that reads, but slower than [`MIN_RATE`] after [`GRACE`], loses the answer (the
//! connection ends): the per-write stall timeout alone let a client that read a little every
//! few seconds hold its share of the budget for days.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Bytes of tensor copies in flight at most, node-wide.
pub const COPY_BUDGET: u64 = 1 << 30;

/// The budget is counted in units of this many bytes (a semaphore counts in `u32`s).
const UNIT: u64 = 1 << 10;

/// How long a download waits for room in the budget before it is refused.
pub const COPY_WAIT: Duration = Duration::from_secs(10);

/// The pieces an answer's bytes are handed to the server in.
const CHUNK: usize = 1 << 20;

/// The slowest a download may be read, in bytes per second, after [`GRACE`].
pub const MIN_RATE: u64 = 1 << 20;

/// Time every download has before [`MIN_RATE`] counts.
pub const GRACE: Duration = Duration::from_secs(30);

/// A download not read within its time ([`GRACE`] plus its length at [`MIN_RATE`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "a tensor download of {len} bytes was not read within {limit:?} (at least 1 MiB/s after 30 s): the answer is given up"
)]
pub struct TooSlow {
    /// The answer's length.
    pub len: u64,
    /// The time it had.
    pub limit: Duration,
}

/// Room for copies, shared by every stream.
#[derive(Debug)]
pub struct Copies {
    units: Arc<Semaphore>,
    /// Told whenever room is given back, or a waiter stops waiting.
    freed: Arc<Notify>,
    /// The copies waiting for room, by ticket, with when they began to wait.
    waiting: std::sync::Mutex<std::collections::BTreeMap<u64, std::time::Instant>>,
    next_ticket: std::sync::atomic::AtomicU64,
}

/// How long a copy waits for room before the copies that came after it let it go first: long
/// enough that a large copy does not hold back small ones that fit meanwhile, short enough
/// that a steady stream of small ones cannot starve it.
pub const PRIORITY_AFTER: Duration = Duration::from_secs(1);

impl Copies {
    /// A budget of [`COPY_BUDGET`].
    pub fn new() -> Self {
        Self {
            units: Arc::new(Semaphore::new((COPY_BUDGET / UNIT) as usize)),
            freed: Arc::new(Notify::new()),
            waiting: std::sync::Mutex::default(),
            next_ticket: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Room for a copy of `len` bytes (a copy above the whole budget takes all of it), or
    /// `None` if none came within `wait`. Not first come, first served: tokio's semaphore
    /// queues waiters in order, so one copy of more than the room free held back every
    /// smaller one behind it (each timing out with room to spare); here each waiter tries
    /// again whenever room is given back, except that once the oldest waiter has waited
    /// [`PRIORITY_AFTER`], the others let it go first.
    pub async fn room(&self, len: u64, wait: Duration) -> Option<Room> {
        let units = len.div_ceil(UNIT).clamp(1, COPY_BUDGET / UNIT) as u32;
        let deadline = tokio::time::Instant::now() + wait;
        let ticket = Ticket::new(self);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if !self.behind_an_older(ticket.0)
                && let Ok(p) = Arc::clone(&self.units).try_acquire_many_owned(units)
            {
                return Some(Room {
                    permit: Some(p),
                    freed: Arc::clone(&self.freed),
                });
            }
            tokio::time::timeout_at(deadline, freed).await.ok()?;
        }
    }

    /// Whether the oldest waiter is another one that has waited [`PRIORITY_AFTER`].
    fn behind_an_older(&self, ticket: u64) -> bool {
        let w = self.waiting.lock().expect("poisoned");
        w.first_key_value()
            .is_some_and(|(&t, since)| t != ticket && since.elapsed() >= PRIORITY_AFTER)
    }

    /// Bytes of the budget in use now.
    #[cfg(test)]
    fn used(&self) -> u64 {
        COPY_BUDGET - self.units.available_permits() as u64 * UNIT
    }
}

/// A copy's place among the waiters ([`Copies::room`]); it leaves when dropped (room taken,
/// or given up), and the others are told.
struct Ticket<'a>(u64, &'a Copies);

impl<'a> Ticket<'a> {
    fn new(c: &'a Copies) -> Self {
        let t = c
            .next_ticket
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        c.waiting
            .lock()
            .expect("poisoned")
            .insert(t, std::time::Instant::now());
        Self(t, c)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.1.waiting.lock().expect("poisoned").remove(&self.0);
        self.1.freed.notify_waiters();
    }
}

/// Room taken in the budget; given back when dropped, and the waiters told.
#[derive(Debug)]
pub struct Room {
    permit: Option<OwnedSemaphorePermit>,
    freed: Arc<Notify>,
}

impl Drop for Room {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.freed.notify_waiters();
    }
}

/// A copy's bytes and what lives as long as they do: its room, and what the answer keeps
/// (the stream's mark of being in use while its tensor downloads; never the stream itself,
/// whose region a close must free while the download goes on).
struct Owned {
    bytes: Vec<u8>,
    _room: Room,
    _keep: Box<dyn Send + Sync>,
}

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// An answer's body: a copy in pieces that share its allocation (with its room and what it
/// keeps, [`Owned`]), to be read within its time.
pub struct CopyBody {
    chunks: VecDeque<Bytes>,
    len: u64,
    limit: Duration,
    deadline: Instant,
}

impl std::fmt::Debug for CopyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyBody")
            .field("len", &self.len)
            .field("left", &self.chunks.iter().map(Bytes::len).sum::<usize>())
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl CopyBody {
    /// `bytes` as a body whose pieces hold `room` and `keep` until the last of them is gone,
    /// to be read within [`GRACE`] plus its length at [`MIN_RATE`].
    pub fn new(bytes: Vec<u8>, room: Room, keep: impl Send + Sync + 'static) -> Self {
        let limit = GRACE + Duration::from_secs(bytes.len() as u64 / MIN_RATE);
        Self::within(bytes, room, keep, limit)
    }

    fn within(
        bytes: Vec<u8>,
        room: Room,
        keep: impl Send + Sync + 'static,
        limit: Duration,
    ) -> Self {
        let len = bytes.len() as u64;
        let mut all = Bytes::from_owner(Owned {
            bytes,
            _room: room,
            _keep: Box::new(keep),
        });
        let mut chunks = VecDeque::with_capacity(all.len().div_ceil(CHUNK));
        while !all.is_empty() {
            chunks.push_back(all.split_to(all.len().min(CHUNK)));
        }
        Self {
            chunks,
            len,
            limit,
            deadline: Instant::now() + limit,
        }
    }
}

impl Body for CopyBody {
    type Data = Bytes;
    type Error = TooSlow;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if !self.chunks.is_empty() && Instant::now() > self.deadline {
            // The server ends the connection and drops the body: the room goes back.
            let e = TooSlow {
                len: self.len,
                limit: self.limit,
            };
            metrics::counter!("shardwire_http_timeouts_total", "phase" => "download").increment(1);
            tracing::warn!(error = %e, "HTTP tensor download given up");
            self.chunks.clear();
            return Poll::Ready(Some(Err(e)));
        }
        Poll::Ready(self.chunks.pop_front().map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.chunks.iter().map(|c| c.len() as u64).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn copies_take_room_until_their_body_is_gone_and_wait_for_it_when_full() {
        let c = Copies::new();
        let half = c.room(COPY_BUDGET / 2, COPY_WAIT).await.unwrap();
        let body = CopyBody::new(vec![7u8; 3 * CHUNK + 5], half, ());
        assert_eq!(body.size_hint().exact(), Some(3 * CHUNK as u64 + 5));
        assert_eq!(c.used(), COPY_BUDGET / 2);
        // One larger than the budget takes all of it: it waits for the first to go.
        assert!(
            c.room(2 * COPY_BUDGET, Duration::from_millis(50))
                .await
                .is_none()
        );
        drop(body);
        assert_eq!(c.used(), 0, "the body gave its room back");
        let all = c
            .room(2 * COPY_BUDGET, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(c.used(), COPY_BUDGET);
        drop(all);
        // A small copy still takes one unit.
        let tiny = c.room(1, COPY_WAIT).await.unwrap();
        assert_eq!(c.used(), UNIT);
        drop(tiny);
    }

    #[tokio::test]
    async fn a_body_hands_its_bytes_over_in_order_in_pieces() {
        let c = Copies::new();
        let bytes: Vec<u8> = (0..(2 * CHUNK + 10)).map(|i| i as u8).collect();
        let mut body = CopyBody::new(
            bytes.clone(),
            c.room(bytes.len() as u64, COPY_WAIT).await.unwrap(),
            (),
        );
        let mut got = Vec::new();
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        while let Poll::Ready(Some(Ok(f))) = Pin::new(&mut body).poll_frame(&mut cx) {
            got.extend_from_slice(&f.into_data().unwrap());
        }
        assert!(body.is_end_stream());
        assert_eq!(got, bytes);
    }

    #[tokio::test]
    async fn a_body_not_read_in_its_time_is_given_up_and_gives_its_room_back() {
        let c = Copies::new();
        assert_eq!(
            CopyBody::new(vec![0; 64 << 20], c.room(1, COPY_WAIT).await.unwrap(), ()).limit,
            GRACE + Duration::from_secs(64),
            "64 MiB at 1 MiB/s after the grace"
        );
        let room = c.room(3 * CHUNK as u64, COPY_WAIT).await.unwrap();
        let mut body = CopyBody::within(vec![1u8; 3 * CHUNK], room, (), Duration::from_millis(30));
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let first = Pin::new(&mut body).poll_frame(&mut cx);
        assert!(matches!(first, Poll::Ready(Some(Ok(_)))), "read in time");
        std::thread::sleep(Duration::from_millis(40));
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Err(e))) => assert_eq!(e.len, 3 * CHUNK as u64),
            other => panic!("{other:?}"),
        }
        assert!(body.is_end_stream(), "nothing more after the error");
        drop((body, first));
        assert_eq!(
            c.used(),
            0,
            "the room went back with the body and its piece"
        );
    }

    /// The server may hold the last pieces after the body is gone (it drops a body once it
    /// has handed out its end): the room and what the answer keeps go with the last piece.
    #[tokio::test]
    async fn the_room_lasts_as_long_as_any_piece_of_the_copy() {
        let c = Copies::new();
        let kept = Arc::new(());
        let room = c.room(2 * CHUNK as u64, COPY_WAIT).await.unwrap();
        let mut body = CopyBody::new(vec![5u8; 2 * CHUNK], room, Arc::clone(&kept));
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut pieces = Vec::new();
        while let Poll::Ready(Some(Ok(f))) = Pin::new(&mut body).poll_frame(&mut cx) {
            pieces.push(f.into_data().unwrap());
        }
        drop(body);
        let last = pieces.pop().unwrap();
        drop(pieces);
        assert_eq!(
            c.used(),
            2 * CHUNK as u64,
            "the last piece still holds the copy"
        );
        assert_eq!(Arc::strong_count(&kept), 2, "and what the answer keeps");
        drop(last);
        assert_eq!(c.used(), 0);
        assert_eq!(Arc::strong_count(&kept), 1);
    }

    /// A copy waiting for more room than is free does not hold back a smaller one that fits
    /// (tokio's semaphore is a queue: the small one waited behind it and timed out).
    #[tokio::test]
    async fn a_large_copy_waiting_does_not_hold_back_a_small_one() {
        let c = Arc::new(Copies::new());
        let half = c.room(COPY_BUDGET / 2, COPY_WAIT).await.unwrap();
        let big = {
            let c = Arc::clone(&c);
            tokio::spawn(async move { c.room(COPY_BUDGET, Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let small = c.room(1024, Duration::from_millis(200)).await;
        assert!(small.is_some(), "room was free for it");
        drop((small, half));
        let big = big.await.unwrap();
        assert!(
            big.is_some(),
            "the large one gets its room once it is given back"
        );
        assert_eq!(c.used(), COPY_BUDGET);
    }

    /// Once a large copy has waited PRIORITY_AFTER, smaller ones that came after it let it
    /// go first (else a steady stream of them starved it until it gave up with a 503).
    #[tokio::test]
    async fn a_copy_that_has_waited_long_goes_first() {
        let c = Arc::new(Copies::new());
        let half = c.room(COPY_BUDGET / 2, COPY_WAIT).await.unwrap();
        let big = {
            let c = Arc::clone(&c);
            tokio::spawn(async move { c.room(COPY_BUDGET, Duration::from_secs(10)).await })
        };
        tokio::time::sleep(PRIORITY_AFTER + Duration::from_millis(100)).await;
        assert!(
            c.room(1024, Duration::from_millis(200)).await.is_none(),
            "room was free, but the big copy has waited long enough to go first"
        );
        drop(half);
        let big = big.await.unwrap().expect("it gets the whole budget");
        assert_eq!(c.used(), COPY_BUDGET);
        drop(big);
        assert!(c.room(1024, Duration::from_millis(200)).await.is_some());
        assert!(
            c.waiting.lock().unwrap().is_empty(),
            "no waiter left behind"
        );
    }
}
