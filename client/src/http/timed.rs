//! The connection of an HTTP stream, whose reads have two limits: each waits at most the
//! request's timeout for its next bytes (`SO_RCVTIMEO`), and, from a response's first byte on,
//! each window of that timeout must bring at least a floor of bytes. A reply trickled a byte
//! at a time (each well within the timeout) still ends, at the end of its first window short
//! of the floor; a slow link that keeps moving (a large tensor over a shared link) brings its
//! floor in every window and is read whole, however long the whole takes. No thread watches
//! it: a read in a window short of its floor waits no longer than the time the window has left.
//! The wait for a response's first byte is one deadline, kept across signals: a read cut short
//! by one (EINTR, which `read_line` and `read_to_end` retry) waits out what is left of it, not
//! the whole timeout again. A request may also have an end past which no read waits (a close,
//! bounded in all).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Shortest wait a read is given (`SO_RCVTIMEO` of zero would mean none at all).
const MIN_WAIT: Duration = Duration::from_millis(1);

/// A TCP connection read under a per-read timeout and a per-window floor of bytes.
pub(super) struct Timed {
    sock: TcpStream,
    /// Each read's wait for its next bytes, and the length of a window.
    wait: Duration,
    /// The least bytes each window must bring; none between responses.
    floor: Option<u64>,
    /// The window being counted: when it ends and the bytes it brought. None before the
    /// response's first byte, whose wait is the read timeout's alone.
    window: Option<(Instant, u64)>,
    /// When the wait for the response's first byte ends (a read timeout after `arm`).
    first_by: Option<Instant>,
    /// When every wait of this request ends, whatever the windows say (see `arm`).
    end: Option<Instant>,
    /// The `SO_RCVTIMEO` now set on the socket (not set again while it is the same).
    set: Option<Duration>,
    /// A read ended because a window ended short of the floor (since the floor was armed).
    slow: bool,
}

impl Timed {
    pub(super) fn new(sock: TcpStream) -> Self {
        Self {
            sock,
            wait: Duration::MAX,
            floor: None,
            window: None,
            first_by: None,
            end: None,
            set: None,
            slow: false,
        }
    }

    /// Reads from now on wait at most `wait` each: the response's first byte must come within
    /// `wait` of now (however many reads signals cut short), and from it on every `wait`-long
    /// window must bring at least `floor` bytes. No read waits past `end`, when given. A wait
    /// or window past what an instant can hold is none.
    pub(super) fn arm(&mut self, wait: Duration, floor: u64, end: Option<Instant>) {
        self.wait = wait;
        self.floor = Some(floor);
        self.window = None;
        self.first_by = Instant::now().checked_add(wait);
        self.end = end;
        self.slow = false;
    }

    /// Ends the floor and the deadlines; whether the floor cut a read short.
    pub(super) fn disarm(&mut self) -> bool {
        self.floor = None;
        self.window = None;
        self.first_by = None;
        self.end = None;
        std::mem::take(&mut self.slow)
    }

    /// The window at `now`, if one is being counted: (it is over, it brought its floor).
    fn window_at(&self, now: Instant) -> Option<(bool, bool)> {
        let (floor, (end, got)) = (self.floor?, self.window?);
        Some((now >= end, got >= floor))
    }

    /// Starts the next window where the current one is over having brought its floor;
    /// `false` where it is over short of it.
    fn roll(&mut self, now: Instant) -> bool {
        match self.window_at(now) {
            Some((true, false)) => false,
            Some((true, true)) => {
                self.window = now.checked_add(self.wait).map(|end| (end, 0));
                true
            }
            _ => true,
        }
    }

    /// Whether the window at `now` has not brought its floor yet (a read that times out in
    /// it ends the window short of its floor).
    fn short_window(&self, now: Instant) -> bool {
        matches!(self.window_at(now), Some((_, false)))
    }

    /// This read's wait: the timeout; before the response's first byte, what is left of the
    /// wait for it; in a window that has not brought its floor yet, the time the window has
    /// left where that is shorter; never past the request's end. Zero: no time is left.
    fn this_wait(&self, now: Instant) -> Duration {
        let wait = match (self.window_at(now), self.window) {
            (Some((_, false)), Some((end, _))) => self
                .wait
                .min(end.saturating_duration_since(now))
                .max(MIN_WAIT),
            (_, Some(_)) => self.wait,
            (_, None) => self
                .first_by
                .map_or(self.wait, |by| left(by, now).min(self.wait)),
        };
        self.end.map_or(wait, |end| wait.min(left(end, now)))
    }

    /// Counts `n` bytes read at `now`; the response's first opens its first window.
    fn count(&mut self, n: usize, now: Instant) {
        if self.floor.is_none() || n == 0 {
            return;
        }
        self.window = match self.window {
            Some((end, got)) => Some((end, got.saturating_add(n as u64))),
            None => now.checked_add(self.wait).map(|end| (end, n as u64)),
        };
    }
}

/// The time from `now` to `by`, rounded up to whole milliseconds (zero only once `by` has
/// passed): the first read after `arm` then waits the timeout itself, which the socket
/// already has when it is the last request's (no `setsockopt` per request).
fn left(by: Instant, now: Instant) -> Duration {
    Duration::from_millis(crate::timeout_ms(by.saturating_duration_since(now)))
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !self.roll(Instant::now()) {
            self.slow = true;
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "the response brought fewer bytes than its floor in a window of the read timeout",
            ));
        }
        let now = Instant::now();
        let wait = self.this_wait(now);
        if wait.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "no time is left of the wait for the response",
            ));
        }
        if self.set != Some(wait) {
            self.sock.set_read_timeout(Some(wait))?;
            self.set = Some(wait);
        }
        let short = self.short_window(now);
        let r = self.sock.read(buf);
        match &r {
            Ok(n) => self.count(*n, Instant::now()),
            // A timeout in a window short of its floor: the window ended short of it.
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) && short => {
                self.slow = true;
            }
            Err(_) => {}
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

    /// Reads until an error or the end; the bytes read and how it ended.
    fn read_all(t: &mut Timed) -> (usize, Option<std::io::Error>) {
        let mut got = 0;
        loop {
            match t.read(&mut [0; 64]) {
                Ok(0) => return (got, None),
                Ok(n) => got += n,
                Err(e) => return (got, Some(e)),
            }
        }
    }

    #[test]
    fn a_read_waits_the_timeout_or_what_is_left_of_a_window_short_of_its_floor() {
        let (mut t, _peer) = pair();
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        assert_eq!(t.this_wait(t0), Duration::MAX, "not armed: no limit");
        t.arm(Duration::from_secs(5), 100, None);
        assert_eq!(t.this_wait(t0), 5 * s, "before the first byte: the timeout");
        assert!(t.roll(t0 + 60 * s), "no window before the first byte");
        t.count(10, t0);
        let left = t.this_wait(t0 + 3 * s);
        assert!(left <= 2 * s && left > Duration::ZERO, "{left:?}");
        assert!(!t.roll(t0 + 5 * s), "over with 10 of its 100 bytes");
        t.count(90, t0 + 4 * s);
        assert_eq!(t.this_wait(t0 + 4 * s), 5 * s, "the floor is met");
        assert!(t.roll(t0 + 6 * s), "over with its floor: the next starts");
        assert_eq!(t.window.map(|(_, got)| got), Some(0));
        assert!(!t.roll(t0 + 12 * s), "the next window brought nothing");
        assert!(!t.disarm(), "no read was cut short");
        t.count(1, t0);
        assert!(t.window.is_none(), "disarmed: nothing is counted");
        t.arm(Duration::MAX, 100, None);
        t.count(1, t0);
        assert!(
            t.window.is_none() && t.roll(t0),
            "a window past any instant: none"
        );
    }

    #[test]
    fn bytes_trickling_in_within_the_timeout_end_with_a_window_short_of_its_floor() {
        // A byte every 50 ms: about 10 in a 500 ms window, whose floor is 24.
        let (mut t, mut peer) = pair();
        let feeder = std::thread::spawn(move || {
            for _ in 0..40 {
                if peer.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        t.arm(Duration::from_millis(500), 24, None);
        let t0 = Instant::now();
        let (got, e) = read_all(&mut t);
        let took = t0.elapsed();
        let e = e.expect("the trickle ends in an error");
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "{e}"
        );
        // The first window: 500 ms from the first byte.
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_millis(1200),
            "{took:?}"
        );
        assert!(got > 0 && got < 24, "{got}");
        assert!(t.disarm(), "the window cut the read short");
        assert!(!t.disarm(), "told once");
        drop(t);
        feeder.join().unwrap();
    }

    #[test]
    fn a_slow_link_that_keeps_moving_is_read_whole_over_many_windows() {
        // 64 bytes every 20 ms for about 1 s: each 200 ms window brings hundreds of bytes
        // against a floor of 16. Before, the whole response had one deadline: 1 s of body
        // over a 200 ms timeout was cut off however steadily it came.
        let (mut t, mut peer) = pair();
        let feeder = std::thread::spawn(move || {
            for _ in 0..50 {
                peer.write_all(&[7; 64]).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        t.arm(Duration::from_millis(200), 16, None);
        let t0 = Instant::now();
        let (got, e) = read_all(&mut t);
        assert!(e.is_none(), "{e:?} after {got} bytes, {:?}", t0.elapsed());
        assert_eq!(got, 50 * 64);
        assert!(t0.elapsed() > Duration::from_millis(600), "several windows");
        assert!(!t.disarm());
        feeder.join().unwrap();
    }

    #[test]
    fn the_wait_for_the_first_byte_is_one_deadline_and_no_wait_passes_the_end() {
        let (mut t, _peer) = pair();
        let s = Duration::from_secs(1);
        t.arm(5 * s, 100, None);
        let t0 = Instant::now();
        // Before, every read before the first byte (one after a signal) waited the whole
        // timeout again.
        let w = t.this_wait(t0 + 2 * s);
        assert!(w > 2 * s && w <= 3 * s, "{w:?}");
        assert_eq!(t.this_wait(t0 + 5 * s), Duration::ZERO, "none left");
        t.count(1, t0 + s);
        assert_eq!(
            t.this_wait(t0 + 5 * s),
            s,
            "a window now: what is left of it"
        );
        t.disarm();
        t.arm(5 * s, 100, Some(t0 + s));
        let w = t.this_wait(t0);
        assert!(w > Duration::ZERO && w <= s, "{w:?}");
        t.count(1_000, t0);
        assert!(
            t.this_wait(t0 + s / 2) <= s / 2,
            "the end binds in a window too"
        );
        assert_eq!(t.this_wait(t0 + s), Duration::ZERO);
    }

    /// A read waiting for a response's first byte while a signal arrives every 20 ms (a
    /// sampling profiler's): `read_to_end` retries each read the signal cut short (EINTR).
    /// Before, each retry waited the whole timeout again, and the wait never ended.
    #[test]
    fn signals_while_waiting_for_the_first_byte_do_not_restart_the_wait() {
        let (mut t, _peer) = pair();
        let wait = Duration::from_millis(300);
        t.arm(wait, 1, None);
        let every = Duration::from_millis(20);
        let r = crate::tests::under_signals(every, Duration::from_secs(5), move || {
            let t0 = Instant::now();
            let r = t.read_to_end(&mut Vec::new()).map_err(|e| e.kind());
            (r, t0.elapsed(), t.disarm())
        });
        let (r, took, slow) = r.expect("the wait ended while the signals came");
        assert!(
            matches!(r, Err(ErrorKind::TimedOut | ErrorKind::WouldBlock)),
            "{r:?}"
        );
        assert!(took >= wait / 2 && took < wait * 3, "{took:?}");
        assert!(!slow, "no byte came: no answer, not a stall");
    }

    #[test]
    fn a_read_timeout_before_the_first_byte_is_not_slow() {
        let (mut t, _peer) = pair();
        t.arm(Duration::from_millis(50), 1 << 20, None);
        let e = t.read(&mut [0; 8]).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "{e}"
        );
        assert!(!t.disarm());
    }
}
