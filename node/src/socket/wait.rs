//! Waiting for a socket trainer's next batch: the slabs its request released are freed before
//! the wait (the batch may need their memory), and every [`PEER_CHECK`] the wait looks at the
//! trainer ([`Peer`]): one that closed its connection ends it, so its stream closes then and
//! not when a batch finally comes (a request sent ahead of time may wait for a stalled source
//! indefinitely); releases it sent behind the request are applied then, not after it (the
//! batch may be waiting for the memory they free).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardwire_gpu::Slab;

use crate::stream::{Next, Stream};

/// How often a waiting request looks at its trainer.
pub const PEER_CHECK: Duration = Duration::from_millis(100);

/// What a waiting request found when it looked at its trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// Still there (any releases it sent meanwhile applied).
    Here,
    /// Gone: it closed the connection, or sent what ends it.
    Gone,
}

/// The stream's next batch for a request that waits up to `timeout` (None: as long as it
/// takes), or None when `look` found the trainer gone meanwhile. `released` holds the slabs
/// this request released: freed after the answer when a batch is ready at once (the trainer is
/// busy with the answer by then), else before waiting, since the batch may need their memory
/// (a region of two slabs, one of them held by the trainer).
pub fn next_batch(
    s: &Stream,
    timeout: Option<Duration>,
    released: &mut Vec<Arc<Slab>>,
    mut look: impl FnMut() -> Peer,
) -> Option<Next> {
    let n = s.next(Some(Duration::ZERO));
    if !matches!(n, Next::Timeout) || timeout == Some(Duration::ZERO) {
        return Some(n);
    }
    released.clear();
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = deadline.map_or(PEER_CHECK, |d| {
            d.saturating_duration_since(Instant::now()).min(PEER_CHECK)
        });
        let n = s.next(Some(slice));
        let expired = deadline.is_some_and(|d| Instant::now() >= d);
        if !matches!(n, Next::Timeout) || expired {
            return Some(n);
        }
        if look() == Peer::Gone {
            return None;
        }
    }
}

/// True when bytes (or the end of the stream) wait to be read on `sock`.
pub fn readable(sock: &UnixStream) -> bool {
    poll_now(sock, libc::POLLIN) & libc::POLLIN != 0
}

/// True when the peer closed its end of `sock` (or the socket failed), even with requests of
/// its still unread: `poll` reports `POLLHUP` on a Unix stream socket once the peer closed it
/// (the kernel then shuts down both directions of this end). A peer that only shut down its
/// writing (`POLLRDHUP` alone) still reads, so it still gets its answer.
pub fn hung_up(sock: &UnixStream) -> bool {
    // POLLHUP and POLLERR are always reported.
    poll_now(sock, 0) & (libc::POLLHUP | libc::POLLERR) != 0
}

/// The events of `sock` now (a poll that does not wait), among `events` and those always
/// reported; 0 when none or the poll failed.
fn poll_now(sock: &UnixStream, events: libc::c_short) -> libc::c_short {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events,
        revents: 0,
    };
    // SAFETY: one live pollfd for a socket this function borrows; a timeout of 0 only asks.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    if r > 0 { p.revents } else { 0 }
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

    #[test]
    fn readable_sees_bytes_and_the_end_of_the_stream() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!readable(&a));
        (&b).write_all(b"x").unwrap();
        assert!(readable(&a));
        let (c, d) = UnixStream::pair().unwrap();
        d.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(readable(&c), "a read returns at once: 0 bytes, the end");
    }
}
