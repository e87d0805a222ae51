//! The connection of an HTTP stream, whose reads have two limits: each waits at most the
//! request's timeout for its next bytes (`SO_RCVTIMEO`), and none goes on past the whole
//! response's deadline, so a reply trickled a byte at a time (each well within the timeout)
//! still ends. No thread watches it: each read shortens its own wait to the time left.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Shortest wait a read is given (`SO_RCVTIMEO` of zero would mean none at all).
const MIN_WAIT: Duration = Duration::from_millis(1);

/// A TCP connection read under a per-read timeout and a per-response deadline.
pub(super) struct Timed {
    sock: TcpStream,
    /// Each read's wait for its next bytes.
    wait: Duration,
    /// When the response being read must be whole; none between responses.
    deadline: Option<Instant>,
    /// The `SO_RCVTIMEO` now set on the socket (not set again while it is the same).
    set: Option<Duration>,
    /// A read ended because the deadline passed (since it was armed).
    late: bool,
}

impl Timed {
    pub(super) fn new(sock: TcpStream) -> Self {
        Self {
            sock,
            wait: Duration::MAX,
            deadline: None,
            set: None,
            late: false,
        }
    }

    /// Reads from now on wait at most `wait` each and end `limit` from now. A limit past
    /// what an instant can hold is no deadline.
    pub(super) fn arm(&mut self, wait: Duration, limit: Duration) {
        self.wait = wait;
        self.deadline = Instant::now().checked_add(limit);
        self.late = false;
    }

    /// Ends the deadline; whether it cut a read short.
    pub(super) fn disarm(&mut self) -> bool {
        self.deadline = None;
        std::mem::take(&mut self.late)
    }

    /// This read's wait: the timeout, or the time left before the deadline where that is
    /// shorter; `None` when the deadline has passed.
    fn this_wait(&self, now: Instant) -> Option<Duration> {
        let Some(at) = self.deadline else {
            return Some(self.wait);
        };
        let left = at.saturating_duration_since(now);
        (!left.is_zero()).then(|| self.wait.min(left).max(MIN_WAIT))
    }

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|at| Instant::now() >= at)
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Some(wait) = self.this_wait(Instant::now()) else {
            self.late = true;
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "the whole response did not arrive by its deadline",
            ));
        };
        if self.set != Some(wait) {
            self.sock.set_read_timeout(Some(wait))?;
            self.set = Some(wait);
        }
        let r = self.sock.read(buf);
        if let Err(e) = &r
            && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
            && self.past_deadline()
        {
            self.late = true;
        }
        r
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.sock.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.sock.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Timed, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (Timed::new(c), l.accept().unwrap().0)
    }

    #[test]
    fn a_read_waits_the_timeout_or_the_time_left_whichever_is_shorter() {
        let (mut t, _peer) = pair();
        let now = Instant::now();
        assert_eq!(t.this_wait(now), Some(Duration::MAX), "not armed: no limit");
        t.arm(Duration::from_secs(5), Duration::from_secs(60));
        assert_eq!(t.this_wait(Instant::now()), Some(Duration::from_secs(5)));
        let late = Instant::now() + Duration::from_secs(58);
        let left = t.this_wait(late).unwrap();
        assert!(left <= Duration::from_secs(2), "{left:?}");
        assert_eq!(t.this_wait(late + Duration::from_secs(3)), None);
        t.arm(Duration::from_secs(5), Duration::MAX);
        assert_eq!(
            t.this_wait(now),
            Some(Duration::from_secs(5)),
            "no deadline"
        );
    }

    #[test]
    fn bytes_trickling_in_within_the_timeout_end_at_the_deadline() {
        let (mut t, mut peer) = pair();
        let feeder = std::thread::spawn(move || {
            for _ in 0..40 {
                if peer.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        });
        t.arm(Duration::from_millis(500), Duration::from_millis(300));
        let t0 = Instant::now();
        let mut got = 0;
        let e = loop {
            match t.read(&mut [0; 8]) {
                Ok(0) => panic!("closed after {got} bytes"),
                Ok(n) => got += n,
                Err(e) => break e,
            }
        };
        let took = t0.elapsed();
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "{e}"
        );
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_millis(800),
            "{took:?}"
        );
        assert!(got > 0 && got < 40, "{got}");
        assert!(t.disarm(), "the deadline cut the read short");
        assert!(!t.disarm(), "told once");
        drop(t);
        feeder.join().unwrap();
    }

    #[test]
    fn a_read_timeout_before_the_deadline_is_not_late() {
        let (mut t, _peer) = pair();
        t.arm(Duration::from_millis(50), Duration::from_secs(60));
        let e = t.read(&mut [0; 8]).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "{e}"
        );
        assert!(!t.disarm());
    }
}
