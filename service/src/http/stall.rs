//! A connection whose writes may not stall: a client that reads nothing of an answer for the
//! write timeout (`http_write_timeout_secs`) gets an error on the write, so hyper ends the
//! connection and its slot is free again. hyper bounds the request head and axum's middleware
//! the body; neither bounds a write. Nor may a client read at a trickle while the connection
//! is backed up ([`Floor`]): reading a few KiB inside every write timeout kept the last
//! pieces of a download (and the tensor copy they share) for hours, past the download's own
//! deadline, which only counts while the body still has pieces to hand to the server. The
//! floor's clock runs only while a write waits for the client, summed over the connection's
//! writes: hyper flushes after every piece of a body it takes (1 MiB for a download), so a
//! window that a flush ended never got past one piece, and time between answers on a
//! kept-alive connection is no wait.
//!
//! It also records whether the client has sent a byte since the server last wrote to it
//! ([`Unanswered`]): when hyper's header timer ends a connection, that tells a request head
//! that began and did not finish (a slow client, a slowloris) from a kept-alive connection
//! that sat idle between requests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// The least a backed-up connection must take: at least `bytes` in every `window` of time
/// that its writes spend waiting for the client (a write that found the connection full,
/// until it takes bytes). Only waiting time counts, across pieces, flushes and answers: a
/// connection idle between answers, or whose server is busy making the next piece, is not
/// judged. A window begins with a write that finds the connection full and ends once it has
/// taken `bytes` (the next wait begins a new one) or when its waiting time reaches `window`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Floor {
    /// The waiting time of a window.
    pub window: Duration,
    /// Bytes per window.
    pub bytes: u64,
}

/// The current window of a [`Floor`].
#[derive(Debug, Default)]
struct Window {
    /// Since when the write now pending has waited, if one is.
    waiting_since: Option<Instant>,
    /// Time writes have waited in this window before the one now pending.
    waited: Duration,
    /// Bytes taken in this window.
    taken: u64,
}

/// Whether a connection's client has sent a byte since the server last wrote one to it (or,
/// before the first answer, since it connected): a handle [`WriteStall`] keeps up to date.
///
/// Cleared by a write, not a flush: hyper flushes on every turn of its loop, also while a
/// request head is still arriving. A client that pipelines the start of its next request
/// before the answer to the last one is taken for an idle one (HTTP clients do not pipeline).
#[derive(Clone, Debug, Default)]
pub struct Unanswered(Arc<AtomicBool>);

impl Unanswered {
    /// Whether the client has sent something since the server last wrote to it.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, sent: bool) {
        self.0.store(sent, Ordering::Relaxed);
    }
}

/// `S` with a limit on how long a write, flush or shutdown may make no progress, and a
/// [`Floor`] under its progress while it is backed up.
pub struct WriteStall<S> {
    inner: S,
    limit: Duration,
    floor: Option<Floor>,
    /// Armed when a write first finds the connection full; cleared by any progress.
    deadline: Option<Pin<Box<Sleep>>>,
    /// The current window of the floor: begun by a write that found the connection full,
    /// ended by enough bytes taken or by its waiting time running out.
    window: Option<Window>,
    /// Set by a read that got bytes, cleared by a write that took some.
    unanswered: Unanswered,
}

impl<S> WriteStall<S> {
    /// Wraps `inner`; a write pending for `limit` with no byte taken fails with `TimedOut`.
    pub fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            floor: None,
            deadline: None,
            window: None,
            unanswered: Unanswered::default(),
        }
    }

    /// A handle on whether the client has sent anything since the server last wrote to it.
    pub fn unanswered(&self) -> Unanswered {
        self.unanswered.clone()
    }

    /// Notes a write's outcome: bytes taken answer what the client had sent.
    fn wrote(&self, r: &Poll<io::Result<usize>>) {
        if matches!(r, Poll::Ready(Ok(n)) if *n > 0) {
            self.unanswered.set(false);
        }
    }

    /// Also holds the connection to `floor` while it is backed up.
    pub fn with_floor(mut self, floor: Floor) -> Self {
        self.floor = Some(floor);
        self
    }

    /// `r` as the caller sees it: pending until the deadline, then the timeout error.
    fn bounded<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.deadline = None;
            return r;
        }
        let limit = self.limit;
        let deadline = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(stalled(limit))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// A write's outcome judged by the floor: a full connection begins a window (if none is
    /// open) and starts its clock; bytes taken stop the clock and count in the window. Enough
    /// bytes end the window; a window whose waiting time has run out with too few fails the
    /// write.
    fn paced(&mut self, r: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        let Some(floor) = self.floor else {
            return r;
        };
        let now = Instant::now();
        let n = match r {
            Poll::Pending => {
                let window = self.window.get_or_insert_with(Window::default);
                window.waiting_since.get_or_insert(now);
                return r;
            }
            Poll::Ready(Ok(n)) => n as u64,
            Poll::Ready(Err(_)) => return r,
        };
        let Some(window) = self.window.as_mut() else {
            return r; // the connection has not backed up since the last window ended
        };
        if let Some(since) = window.waiting_since.take() {
            window.waited += now.saturating_duration_since(since);
        }
        window.taken += n;
        let (taken, took) = (window.taken, window.waited);
        if taken >= floor.bytes {
            self.window = None;
        } else if took >= floor.window {
            self.window = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                Stalled::Slow { taken, took, floor },
            )));
        }
        r
    }
}

/// What a write that made no progress for the limit, or too little for the floor, fails with
/// (inside an `io::Error` of kind `TimedOut`): its own type, so a kernel `ETIMEDOUT` is not
/// taken for it.
#[derive(Debug, thiserror::Error)]
enum Stalled {
    #[error("the client read nothing of the answer for {0:?} (http_write_timeout_secs)")]
    Silent(Duration),
    #[error(
        "the client read {taken} bytes in {took:?} of the server's writes waiting for it (at \
         least {} bytes every {:?} of waiting)", floor.bytes, floor.window
    )]
    Slow {
        taken: u64,
        took: Duration,
        floor: Floor,
    },
}

/// The error of a write that made no progress for `limit`.
fn stalled(limit: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, Stalled::Silent(limit))
}

/// Which limit ended a connection (as hyper reports its end), if one of ours did:
/// `"write"` (nothing read for the write timeout) or `"download"` (read under the floor).
pub fn stall_phase(e: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let ours = err.downcast_ref::<Stalled>().or_else(|| {
            err.downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<Stalled>())
        });
        match ours {
            Some(Stalled::Silent(_)) => return Some("write"),
            Some(Stalled::Slow { .. }) => return Some("download"),
            None => cur = err.source(),
        }
    }
    None
}

/// Whether `e` is a write that stalled or fell under the floor.
#[cfg(test)]
fn is_stall(e: &(dyn std::error::Error + 'static)) -> bool {
    stall_phase(e).is_some()
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteStall<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.unanswered.set(true);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteStall<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(&r);
        let r = self.paced(r);
        self.bounded(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(&r);
        let r = self.paced(r);
        self.bounded(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The floor's window goes on: hyper flushes after every piece of a body, and a window
        // a flush ended never outlived one piece (a trickle of 1 MiB every 29 s passed).
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.bounded(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.bounded(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_write_nobody_reads_fails_after_the_limit_and_progress_resets_it() {
        let (a, _b) = tokio::io::duplex(1024);
        let mut w = WriteStall::new(a, Duration::from_millis(300));
        // 1 KiB fits; the next write waits for a reader.
        w.write_all(&[1; 1024]).await.unwrap();
        let t = std::time::Instant::now();
        let e = w.write_all(&[2; 1024]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert!(is_stall(&e));
        // The kernel's ETIMEDOUT is not a stall of ours.
        assert!(!is_stall(&io::Error::from(io::ErrorKind::TimedOut)));
        // A reader that keeps taking bytes, if slowly, keeps the writer going (the limit is
        // 500 times the reader's pace: a loaded machine does not turn it into a stall).
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteStall::new(a, Duration::from_secs(10));
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 512];
            while got < 8192 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                got += b.read(&mut buf).await.unwrap();
            }
        });
        w.write_all(&[3; 8192])
            .await
            .expect("a slow reader is not a stall");
        reader.await.unwrap();
    }

    /// A client that reads a little inside every write timeout, while its answer waits,
    /// falls under the floor once a window has passed; one that keeps up, or that keeps a
    /// connection idle between answers, is never judged.
    #[tokio::test]
    async fn a_reader_at_a_trickle_falls_under_the_floor() {
        let floor = Floor {
            window: Duration::from_millis(200),
            bytes: 4096,
        };
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteStall::new(a, Duration::from_secs(10)).with_floor(floor);
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                if matches!(b.read(&mut buf).await, Ok(0) | Err(_)) {
                    return;
                }
            }
        });
        let t = std::time::Instant::now();
        let e = w.write_all(&[1; 1 << 20]).await.unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert_eq!(stall_phase(&e), Some("download"), "{e}");
        assert!(
            e.to_string().contains("at least 4096 bytes every 200ms"),
            "{e}"
        );
        drop(w);
        reader.await.unwrap();
        // Fast enough: 64 KiB read in 16 KiB pieces at once.
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteStall::new(a, Duration::from_secs(10)).with_floor(floor);
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 16 << 10];
            while got < 64 << 10 {
                got += b.read(&mut buf).await.unwrap();
            }
        });
        w.write_all(&[2; 64 << 10]).await.unwrap();
        reader.await.unwrap();
        // A small answer that backed up and was all read, then idle past a window: time with
        // no write waiting is not counted, so the next answer is not judged by the idle time.
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteStall::new(a, Duration::from_secs(10)).with_floor(floor);
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            let mut got = 0;
            while got < 2100 {
                got += b.read(&mut buf).await.unwrap();
            }
        });
        w.write_all(&[3; 2000]).await.unwrap();
        w.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        w.write_all(&[4; 100]).await.expect("not judged");
        reader.await.unwrap();
    }

    /// hyper hands a body to the connection a piece at a time and flushes after each: a
    /// reader at a trickle that takes each piece within a window, but less than the floor
    /// over a window of waiting, is cut all the same; one that keeps up is not.
    #[tokio::test]
    async fn a_trickle_over_flushed_pieces_falls_under_the_floor() {
        // Before: each flush ended the window, so a piece taken within it (about 160 ms for
        // 1 MiB at this reader's 6.4 MiB/s at most) was never judged, and all 32 pieces went
        // out against a floor of 32 MiB per 400 ms.
        const PIECE: usize = 1 << 20;
        const PIECES: usize = 32;
        let floor = Floor {
            window: Duration::from_millis(400),
            bytes: (PIECES * PIECE) as u64,
        };
        let piece = vec![7u8; PIECE];
        let (a, mut b) = tokio::io::duplex(64 << 10);
        let mut w = WriteStall::new(a, Duration::from_secs(10)).with_floor(floor);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                if matches!(b.read(&mut buf).await, Ok(0) | Err(_)) {
                    return;
                }
            }
        });
        let t = std::time::Instant::now();
        let mut sent = 0;
        let e = loop {
            assert!(sent < PIECES, "{sent} MiB taken at a trickle, never judged");
            if let Err(e) = w.write_all(&piece).await {
                break e;
            }
            if let Err(e) = w.flush().await {
                break e;
            }
            sent += 1;
        };
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(sent < 8, "cut after about one window, not {sent} pieces");
        assert_eq!(stall_phase(&e), Some("download"), "{e}");
        drop(w);
        reader.await.unwrap();
        // A reader that keeps up takes every piece: each window fills before its waiting
        // time runs out.
        let floor = Floor {
            window: Duration::from_millis(400),
            bytes: 4 * PIECE as u64,
        };
        let (a, mut b) = tokio::io::duplex(64 << 10);
        let mut w = WriteStall::new(a, Duration::from_secs(10)).with_floor(floor);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            let mut got = 0;
            while got < 8 * PIECE {
                got += b.read(&mut buf).await.unwrap();
            }
        });
        for _ in 0..8 {
            w.write_all(&piece).await.expect("a reader that keeps up");
            w.flush().await.unwrap();
        }
        reader.await.unwrap();
    }

    #[tokio::test]
    async fn a_read_marks_the_client_unanswered_until_the_server_writes() {
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteStall::new(a, Duration::from_secs(10));
        let unanswered = w.unanswered();
        assert!(!unanswered.get(), "a new connection has sent nothing");
        b.write_all(b"GET / HT").await.unwrap();
        let mut buf = [0u8; 64];
        let n = w.read(&mut buf).await.unwrap();
        assert_eq!(n, 8);
        assert!(unanswered.get(), "a head has begun");
        // A flush (hyper flushes on every turn) answers nothing.
        w.flush().await.unwrap();
        assert!(unanswered.get());
        w.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        assert!(!unanswered.get(), "answered");
        // The end of the stream is no byte sent.
        drop(b);
        assert_eq!(w.read(&mut buf).await.unwrap(), 0);
        assert!(!unanswered.get());
    }
}
