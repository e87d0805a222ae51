//! A connection whose writes may not stall: a client that reads nothing of an answer for the
//! write timeout (`http_write_timeout_secs`) gets an error on the write, so hyper ends the
//! connection and its slot is free again. hyper bounds the request head and axum's middleware
//! the body; neither bounds a write.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `S` with a limit on how long a write, flush or shutdown may make no progress.
pub struct WriteStall<S> {
    inner: S,
    limit: Duration,
    /// Armed when a write first finds the connection full; cleared by any progress.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteStall<S> {
    /// Wraps `inner`; a write pending for `limit` with no byte taken fails with `TimedOut`.
    pub fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            deadline: None,
        }
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
}

/// What a write that made no progress for the limit fails with (inside an `io::Error` of
/// kind `TimedOut`): its own type, so a kernel `ETIMEDOUT` is not taken for it.
#[derive(Debug, thiserror::Error)]
#[error("the client read nothing of the answer for {0:?} (http_write_timeout_secs)")]
struct Stalled(Duration);

/// The error of a write that made no progress for `limit`.
fn stalled(limit: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, Stalled(limit))
}

/// Whether `e` (as hyper reports a connection's end) is a write that stalled.
pub fn is_stall(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let ours = err.is::<Stalled>()
            || err
                .downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .is_some_and(|inner| inner.is::<Stalled>());
        if ours {
            return true;
        }
        cur = err.source();
    }
    false
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteStall<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteStall<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.bounded(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.bounded(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
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
}
