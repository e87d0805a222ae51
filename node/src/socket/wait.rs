//! Waiting for a socket trainer's next batch: the slabs its request released are freed before
//! the wait (the batch may need their memory), and a trainer that closes its connection while
//! its request waits is noticed within [`HANGUP_CHECK`], so its stream closes then and not when a batch
//! finally comes (a request sent ahead of time may wait for a stalled source indefinitely).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardwire_gpu::Slab;

use crate::stream::{Next, Stream};

/// How often a waiting request looks at whether its trainer is still there.
pub const HANGUP_CHECK: Duration = Duration::from_secs(1);

/// The stream's next batch for a request that waits up to `timeout` (None: as long as it
/// takes), or None when the trainer hung up meanwhile. `released` holds the slabs this request
/// released: freed after the answer when a batch is ready at once (the trainer is busy with the
/// answer by then), else before waiting, since the batch may need their memory (a region of
/// two slabs, one of them held by the trainer).
pub fn next_batch(
    s: &Stream,
    sock: &UnixStream,
    timeout: Option<Duration>,
    released: &mut Vec<Arc<Slab>>,
) -> Option<Next> {
    let n = s.next(Some(Duration::ZERO));
    if !matches!(n, Next::Timeout) || timeout == Some(Duration::ZERO) {
        return Some(n);
    }
    released.clear();
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = deadline.map_or(HANGUP_CHECK, |d| {
            d.saturating_duration_since(Instant::now())
                .min(HANGUP_CHECK)
        });
        let n = s.next(Some(slice));
        let expired = deadline.is_some_and(|d| Instant::now() >= d);
        if !matches!(n, Next::Timeout) || expired {
            return Some(n);
        }
        if hung_up(sock) {
            return None;
        }
    }
}

/// True when the peer closed its end of `sock` (or the socket failed), even with requests of
/// its still unread: `poll` reports `POLLHUP` on a Unix stream socket once the peer closed it
/// (the kernel then shuts down both directions of this end). A peer that only shut down its
/// writing (`POLLRDHUP` alone) still reads, so it still gets its answer.
fn hung_up(sock: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: 0, // POLLHUP and POLLERR are always reported
        revents: 0,
    };
    // SAFETY: one live pollfd for a socket this function borrows; a timeout of 0 only asks.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn a_closed_peer_is_seen_even_with_bytes_unread() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!hung_up(&a));
        (&b).write_all(b"a release behind the request").unwrap();
        assert!(!hung_up(&a), "unread bytes are not a hang-up");
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(
            !hung_up(&a),
            "a peer that only stopped writing still reads its answer"
        );
        drop(b);
        assert!(hung_up(&a));
    }
}
