//! The io_uring path: plain TCP into host memory, each data connection's announced payloads
//! posted ahead (up to `shardwire_devmem::uring::QUEUE_DEPTH`) as the provided buffers of one
//! multishot receive ([`shardwire_devmem::uring::RecvQueue`]), so the kernel places every
//! payload straight in its slab and moves on to the next one without a new request; each
//! completed piece is checksummed as it arrives. Measured against the `recv` path
//! ([`super::recv`]) by `shardwire bench --compare-uring` (docs/BENCHMARKS.md); where io_uring
//! cannot be set up (a seccomp policy, an older kernel) [`queue_for`] says no and the
//! connection uses `recv`, and the node logs why. A multishot receive is woken only once the
//! socket's low-water mark is queued (a timed-out `recv` returns what has arrived): a wait
//! that times out with fewer bytes queued takes them at a mark of 1, so a slow source is
//! judged by the pace floor as on the `recv` path, and only one that sent nothing is a stall.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Once;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use shardwire_devmem::uring::{RecvQueue, StableBuf};

use super::error::RxError;
use super::shared::{
    Checksum, ConnAt, DATA_STALL_TIMEOUT, Mismatches, Pace, PaceRule, Tally, broken, deliver,
    lowat_for,
};
use crate::counters::{Counters, FlowStats};
use crate::fetch::InFlight;
use crate::link::SourceLink;

/// A posted payload: the fetch and the CRC of its bytes so far.
pub struct Job {
    f: InFlight,
    sum: Checksum,
}

// SAFETY: the bytes are the slab's span of its pool's region, which neither moves nor is
// freed while the `InFlight` (and so this `Job`) holds the slab; every call returns that
// same span (an empty one for a slab outside host memory, which is never posted). The tally
// is the job's own checksum field, not the region.
unsafe impl StableBuf for Job {
    type Tally = Checksum;
    fn bytes(&mut self) -> &mut [u8] {
        self.f.slab_mut().host_slice_mut().unwrap_or(&mut [])
    }
    fn tally(&mut self) -> &mut Checksum {
        &mut self.sum
    }
}

/// The io_uring receiver for `sock`, or `None` (logged once per process) where io_uring
/// cannot be set up: the caller then reads with `recv`.
pub fn queue_for(sock: &TcpStream) -> Option<RecvQueue<Job>> {
    static WARNED: Once = Once::new();
    let dup = match sock.try_clone() {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "cannot duplicate a data connection's socket for io_uring: it reads with recv");
            return None;
        }
    };
    let made = RecvQueue::new(dup);
    if let Err(e) = &made {
        WARNED.call_once(|| {
            tracing::warn!(error = %e,
                "io_uring multishot receive is unavailable (it needs Linux 6.12+ and a seccomp policy that allows io_uring): data connections read with recv instead, at a lower throughput");
        });
    }
    made.ok()
}

/// Receives the payloads announced for one connection until its queue closes, at `rule`'s
/// pace or better over all the posted ones (the io_uring form of [`super::shared::run`],
/// with the same outcomes and counters).
pub fn run(
    q: RecvQueue<Job>,
    link: &SourceLink,
    at: ConnAt,
    queue: &Receiver<InFlight>,
    flow: &FlowStats,
    c: &Counters,
    rule: PaceRule,
) {
    let st = State::new(rule, DATA_STALL_TIMEOUT);
    run_with(q, (link, at), queue, (flow, c), st);
}

/// A connection's receive state between waits.
#[derive(Debug)]
struct State {
    /// The `SO_RCVLOWAT` set now (the kernel's default is 1).
    lowat: i32,
    misses: Mismatches,
    pace: Pace,
    /// The lengths of the posted payloads in order (the first is the one arriving: the
    /// kernel fills them in order).
    posted: VecDeque<u64>,
    /// How long one wait may see no byte land ([`DATA_STALL_TIMEOUT`]; shorter in tests).
    stall: Duration,
}

impl State {
    /// An idle connection judged by `rule`, stalled after `stall` without a byte.
    fn new(rule: PaceRule, stall: Duration) -> Self {
        Self {
            lowat: 1,
            misses: Mismatches::default(),
            pace: Pace::new(rule),
            posted: VecDeque::new(),
            stall,
        }
    }

    /// The stall of the payload arriving, `remaining` bytes of the posted ones still due:
    /// the same error as the other paths' read timeout.
    fn stalled(&self, remaining: usize) -> RxError {
        let total: u64 = self.posted.iter().sum();
        RxError::Stalled {
            after: self.stall,
            got: total.saturating_sub(remaining as u64),
            want: self.posted.front().copied().unwrap_or(0),
        }
    }
}

/// [`run`] with its state (the stall timeout in it).
fn run_with(
    mut q: RecvQueue<Job>,
    (link, at): (&SourceLink, ConnAt),
    queue: &Receiver<InFlight>,
    (flow, c): (&FlowStats, &Counters),
    mut st: State,
) {
    loop {
        let mut r = Ok(());
        if q.is_empty() {
            match queue.recv() {
                Ok(f) => r = post(&mut q, f, link, c, &mut st),
                Err(_) => return, // the link is gone
            }
        }
        while r.is_ok() && !q.is_full() {
            match queue.try_recv() {
                Ok(f) => r = post(&mut q, f, link, c, &mut st),
                Err(_) => break,
            }
        }
        if r.is_ok() && q.is_empty() {
            continue;
        }
        let r = r.and_then(|()| {
            set_lowat(&q, &mut st.lowat)
                .map_err(|e| (None, RxError::io("setsockopt(SO_RCVLOWAT)", &e)))?;
            receive(&mut q, (flow, c), link, &mut st).map_err(|e| (None, e))
        });
        if let Err((refused, cause)) = r {
            let jobs = refused.into_iter().map(|j| *j).chain(q.abandon());
            return broken(jobs.map(|j| j.f), queue, link, at, cause);
        }
    }
}

/// A payload that could not be posted, and why.
type Refused = (Option<Box<Job>>, RxError);

/// Posts `f`'s slab (an empty payload is complete at once), its bytes due in the pace. A
/// payload that cannot be posted (only a slab outside host memory could be refused) breaks
/// the connection: its bytes are on their way and would land in the next slab.
fn post(
    q: &mut RecvQueue<Job>,
    f: InFlight,
    link: &SourceLink,
    c: &Counters,
    st: &mut State,
) -> Result<(), Refused> {
    if f.length == 0 {
        // Not noted in the connection's mismatches: no byte of it came over the connection.
        deliver(f, Checksum::new().finish(), link, c);
        return Ok(());
    }
    st.pace.due(Instant::now(), f.length);
    st.posted.push_back(f.length);
    let job = Job {
        f,
        sum: Checksum::new(),
    };
    q.post(job).map_err(|(job, e)| {
        (
            Some(Box::new(job)),
            RxError::io("posting a payload to io_uring", &e),
        )
    })
}

/// The `SO_RCVLOWAT` rule of the `recv` path over all the bytes still due.
fn set_lowat(q: &RecvQueue<Job>, lowat: &mut i32) -> io::Result<()> {
    let want = lowat_for(q.remaining());
    if want != *lowat {
        shardwire_devmem::set_rcvlowat(q.socket().as_fd(), want)?;
        *lowat = want;
    }
    Ok(())
}

/// One wait: checksums each piece and notes it in the pace, delivers each complete payload;
/// `Err` too when the connection lost its framing ([`Mismatches`]) or fell below its pace.
/// A wait that times out with bytes queued below the low-water mark (a multishot receive
/// is woken only at the mark, where a timed-out `recv` returns what has arrived) takes them
/// at a mark of 1 and goes on, so a slow source is judged by the pace as on the `recv`
/// path; one that times out with nothing queued is [`RxError::Stalled`].
fn receive(
    q: &mut RecvQueue<Job>,
    (flow, c): (&FlowStats, &Counters),
    link: &SourceLink,
    st: &mut State,
) -> Result<(), RxError> {
    let mut tally = Tally::new(flow, link);
    let mut r = take(q, &mut tally, (link, c), st);
    if st.lowat > 1
        && r.as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::TimedOut)
        && let Some(again) = take_below_mark(q, &mut tally, (link, c), st)
    {
        r = again;
    }
    tally.flush(c);
    r.map_err(|e| match e.kind() {
        io::ErrorKind::TimedOut => st.stalled(q.remaining()),
        _ => RxError::io("io_uring receive", &e),
    })?;
    st.misses.check()?;
    st.pace.check(Instant::now())
}

/// After a wait timed out at a mark above 1: `None` when nothing is queued (a stall; a
/// socket whose queue cannot be read is judged by the timeout alone), else another wait
/// at a mark of 1, which takes the queued bytes at once (lowering the mark wakes the armed
/// receive: the kernel checks the new mark against what is queued).
fn take_below_mark(
    q: &mut RecvQueue<Job>,
    tally: &mut Tally<'_>,
    (link, c): (&SourceLink, &Counters),
    st: &mut State,
) -> Option<io::Result<()>> {
    if queued(q.socket()).unwrap_or(0) == 0 {
        return None;
    }
    let lowered = shardwire_devmem::set_rcvlowat(q.socket().as_fd(), 1);
    Some(lowered.and_then(|()| {
        st.lowat = 1;
        take(q, tally, (link, c), st)
    }))
}

/// One [`RecvQueue::wait`] of up to the stall timeout, each piece tallied and noted in the
/// pace, each complete payload delivered and noted in the mismatches.
fn take(
    q: &mut RecvQueue<Job>,
    tally: &mut Tally<'_>,
    (link, c): (&SourceLink, &Counters),
    st: &mut State,
) -> io::Result<()> {
    let State {
        misses,
        pace,
        posted,
        stall,
        ..
    } = st;
    q.wait(
        *stall,
        |sum, _, piece| {
            tally.piece(sum, piece);
            pace.landed(piece.len() as u64);
        },
        |job| {
            posted.pop_front();
            let payload = (job.f.shard, job.f.crc32c);
            misses.note(payload, deliver(job.f, job.sum.finish(), link, c));
        },
    )
}

/// Bytes queued on `sock` and not yet read (`FIONREAD`, which is `SIOCINQ` on TCP).
fn queued(sock: &TcpStream) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: the fd is live for the call (borrowed from `sock`); FIONREAD writes one c_int
    // to the pointer, which is a live, aligned local.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n as *mut libc::c_int) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use std::sync::atomic::Ordering;

    use super::*;
    use crate::fetch::FetchFailure;
    use crate::fetch::tests::{in_flight, pool};
    use std::time::Duration;

    use crate::rx::recv::tests::{crc, link, outcomes, trickle};

    /// A connected pair; a thread writes `wire` to the far end, then closes it.
    fn socket_with(wire: Vec<u8>) -> (TcpStream, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (rx, _) = l.accept().unwrap();
        let t = std::thread::spawn(move || {
            for c in wire.chunks(100_000) {
                tx.write_all(c).unwrap();
            }
        });
        (rx, t)
    }

    /// Payloads of many sizes (an empty one among them) over a real socket, more than the
    /// queue holds at once: every slab holds its payload, one CRC mismatch fails only its
    /// own fetch, counters agree.
    #[test]
    fn posted_payloads_land_in_their_slabs_and_are_verified() {
        let sizes = [
            3000usize,
            0,
            1 << 20,
            17,
            600_000,
            4096,
            1,
            250_000,
            9,
            70_000,
            2 << 20,
        ];
        let payloads: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, n)| (0..*n).map(|i| (i * 13 + k) as u8).collect())
            .collect();
        let (sock, t) = socket_with(payloads.concat());
        let p = pool(16 << 20);
        let (tx, queue) = std::sync::mpsc::channel();
        let mut rxs = Vec::new();
        for (k, b) in payloads.iter().enumerate() {
            let want = if k == 4 { crc(b) ^ 1 } else { crc(b) };
            let (f, r) = in_flight(&p, k as u64, b.len(), want);
            tx.send(f).unwrap();
            rxs.push(r);
        }
        drop(tx);
        let (l, flow, c) = (link(), FlowStats::default(), Counters::default());
        let q = queue_for(&sock).expect("io_uring on this kernel");
        let at = ConnAt {
            conn: 0,
            generation: 0,
        };
        run(q, &l, at, &queue, &flow, &c, PaceRule::DEFAULT);
        t.join().unwrap();
        let out = outcomes(rxs);
        for (k, o) in out.iter().enumerate() {
            match k {
                4 => assert!(matches!(o.result, Err(FetchFailure::Crc { .. })), "{k}"),
                _ => assert!(o.result.is_ok(), "payload {k}: {:?}", o.result),
            }
            assert!(
                o.slab.host_slice().unwrap() == &payloads[k][..],
                "payload {k}"
            );
        }
        let total: usize = sizes.iter().sum();
        assert_eq!(flow.bytes.load(Ordering::Relaxed), total as u64);
        assert_eq!(c.crc_failures.load(Ordering::Relaxed), 1);
        assert_eq!(
            c.shards_received.load(Ordering::Relaxed),
            sizes.len() as u64 - 1
        );
    }

    /// A stray byte after the first payload: the next two fail their CRC, and then the
    /// connection is dropped (before: every later payload failed its CRC too).
    #[test]
    fn two_mismatches_in_a_row_drop_the_connection() {
        let payloads: Vec<Vec<u8>> = (0..6u8).map(|k| vec![k; 5000]).collect();
        let mut wire = payloads[0].clone();
        wire.push(0xee);
        wire.extend(payloads[1..].concat());
        let (sock, t) = socket_with(wire);
        let p = pool(1 << 20);
        let (tx, queue) = std::sync::mpsc::channel();
        let mut rxs = Vec::new();
        for (k, b) in payloads.iter().enumerate() {
            let (f, r) = in_flight(&p, k as u64, b.len(), crc(b));
            tx.send(f).unwrap();
            rxs.push(r);
        }
        drop(tx);
        let (l, c) = (link(), Counters::default());
        let q = queue_for(&sock).expect("io_uring on this kernel");
        let at = ConnAt {
            conn: 4,
            generation: 0,
        };
        run(
            q,
            &l,
            at,
            &queue,
            &FlowStats::default(),
            &c,
            PaceRule::DEFAULT,
        );
        drop(sock);
        t.join().unwrap();
        let out = outcomes(rxs);
        assert!(out[0].result.is_ok());
        let crc_failed = |k: usize| matches!(out[k].result, Err(FetchFailure::Crc { .. }));
        assert!(crc_failed(1) && crc_failed(2));
        let misframed = |e: &RxError| match e {
            RxError::Misframed { .. } => true,
            RxError::Earlier(inner) => matches!(**inner, RxError::Misframed { .. }),
            _ => false,
        };
        let lost = out[3..]
            .iter()
            .filter(|o| {
                matches!(&o.result, Err(FetchFailure::ConnectionLost { conn: 4, cause, .. }) if misframed(cause))
            })
            .count();
        assert!(
            lost >= 1,
            "{:?}",
            out.iter().map(|o| &o.result).collect::<Vec<_>>()
        );
        assert_eq!(
            c.crc_failures.load(Ordering::Relaxed) as usize,
            6 - 1 - lost
        );
    }

    /// A trickle over the posted payloads (a byte every 20 ms: each wait ends well inside
    /// the stall timeout) drops the connection after one window: every payload, posted or
    /// queued, fails, naming the trickle.
    #[test]
    fn a_trickle_over_the_posted_payloads_is_dropped_after_one_window() {
        let rule = PaceRule {
            window: Duration::from_millis(300),
            floor: 1000,
        };
        let (sock, w) = trickle(vec![5; 4106], 1, Duration::from_millis(20));
        let p = pool(1 << 20);
        let (tx, queue) = std::sync::mpsc::channel();
        let mut rxs = Vec::new();
        for (k, len) in [4096, 10].into_iter().enumerate() {
            let (f, r) = in_flight(&p, k as u64, len, 0);
            tx.send(f).unwrap();
            rxs.push(r);
        }
        drop(tx);
        let q = queue_for(&sock).expect("io_uring on this kernel");
        let at = ConnAt {
            conn: 6,
            generation: 0,
        };
        let t = std::time::Instant::now();
        let (flow, c) = (FlowStats::default(), Counters::default());
        run(q, &link(), at, &queue, &flow, &c, rule);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        w.join().unwrap();
        let out = outcomes(rxs);
        let slow = match &out[0].result {
            Err(FetchFailure::ConnectionLost { conn: 6, cause, .. }) => cause.clone(),
            other => panic!("{other:?}"),
        };
        match &slow {
            // Due: the posted payloads (QUEUE_DEPTH of them) not yet received.
            RxError::TooSlow { got, due, .. } => assert!(*got < 1000 && got + due >= 4096),
            other => panic!("{other:?}"),
        }
        match &out[1].result {
            Err(FetchFailure::ConnectionLost { conn: 6, cause, .. }) => assert!(
                cause == &slow || cause == &RxError::Earlier(Box::new(slow.clone())),
                "{cause}"
            ),
            other => panic!("{other:?}"),
        }
    }

    /// A source that sends part of a large payload (below the low-water mark of 256 KiB)
    /// and then nothing: the wait times out, the bytes held below the mark land and count,
    /// and the fetch fails as a stall naming how much had arrived, as on the `recv` path.
    /// Before, it failed with "io_uring receive: no bytes arrived for ..." (an `Io` error)
    /// whatever had arrived.
    #[test]
    fn a_source_that_stops_below_the_mark_is_a_stall_with_what_had_arrived() {
        // The writer holds the connection open well past the two waits, then closes it.
        let (sock, _w) = trickle(vec![7; 10_000], 10_000, Duration::from_secs(5));
        let p = pool(2 << 20);
        let (tx, queue) = std::sync::mpsc::channel();
        let (f, r) = in_flight(&p, 0, 1 << 20, 0);
        tx.send(f).unwrap();
        drop(tx);
        let q = queue_for(&sock).expect("io_uring on this kernel");
        let (l, flow, c) = (link(), FlowStats::default(), Counters::default());
        let stall = Duration::from_millis(500);
        let at = ConnAt {
            conn: 7,
            generation: 0,
        };
        run_with(
            q,
            (&*l, at),
            &queue,
            (&flow, &c),
            State::new(PaceRule::DEFAULT, stall),
        );
        let out = outcomes(vec![r]);
        let cause = match &out[0].result {
            Err(FetchFailure::ConnectionLost { conn: 7, cause, .. }) => cause.clone(),
            other => panic!("{other:?}"),
        };
        let want = RxError::Stalled {
            after: stall,
            got: 10_000,
            want: 1 << 20,
        };
        assert_eq!(cause, want);
        assert!(
            cause
                .to_string()
                .contains("no bytes arrived for 500ms (10000 of 1048576")
        );
        assert_eq!(flow.bytes.load(Ordering::Relaxed), 10_000);
        assert_eq!(l.landed.load(Ordering::Relaxed), 10_000);
    }

    /// A source that trickles a large payload in below the low-water mark (about 50 KB/s
    /// against a mark of 256 KiB) is dropped as too slow once a wait times out: the bytes the
    /// mark held back land and the pace judges them, as on the `recv` path. Before, the
    /// stall timeout fired with the bytes unseen ("io_uring receive: no bytes arrived").
    #[test]
    fn a_trickle_below_the_mark_is_too_slow_not_a_stall() {
        let rule = PaceRule {
            window: Duration::from_millis(300),
            floor: 200_000,
        };
        let (sock, w) = trickle(vec![5; 1 << 20], 1000, Duration::from_millis(20));
        let p = pool(2 << 20);
        let (tx, queue) = std::sync::mpsc::channel();
        let (f, r) = in_flight(&p, 0, 1 << 20, 0);
        tx.send(f).unwrap();
        drop(tx);
        let q = queue_for(&sock).expect("io_uring on this kernel");
        let (flow, c) = (FlowStats::default(), Counters::default());
        let at = ConnAt {
            conn: 8,
            generation: 0,
        };
        let st = State::new(rule, Duration::from_secs(1));
        run_with(q, (&*link(), at), &queue, (&flow, &c), st);
        drop(sock);
        w.join().unwrap();
        let out = outcomes(vec![r]);
        match &out[0].result {
            Err(FetchFailure::ConnectionLost {
                conn: 8,
                cause: RxError::TooSlow { got, due, .. },
                ..
            }) => {
                assert!(*got > 0 && *got < 200_000, "{got}");
                assert_eq!(got + due, 1 << 20);
            }
            other => panic!("{other:?}"),
        }
        assert!(flow.bytes.load(Ordering::Relaxed) > 0);
    }

    /// The connection closes inside the second payload: it and every later one (posted or
    /// still queued) fail with the connection, the first is delivered.
    #[test]
    fn a_close_mid_payload_fails_it_and_every_later_one() {
        let first = vec![5u8; 4096];
        let (sock, t) = socket_with([first.clone(), vec![6u8; 1000]].concat());
        let p = pool(1 << 20);
        let (tx, queue) = std::sync::mpsc::channel();
        let mut rxs = Vec::new();
        for (k, (len, want)) in [(4096, crc(&first)), (4096, 0), (10, 0), (10, 0)]
            .into_iter()
            .enumerate()
        {
            let (f, r) = in_flight(&p, k as u64, len, want);
            tx.send(f).unwrap();
            rxs.push(r);
        }
        drop(tx);
        let q = queue_for(&sock).expect("io_uring on this kernel");
        run(
            q,
            &link(),
            ConnAt {
                conn: 3,
                generation: 0,
            },
            &queue,
            &FlowStats::default(),
            &Counters::default(),
            PaceRule::DEFAULT,
        );
        t.join().unwrap();
        let out = outcomes(rxs);
        assert!(out[0].result.is_ok());
        match &out[1].result {
            Err(FetchFailure::ConnectionLost {
                conn: 3,
                cause: RxError::Io { kind, message, .. },
                ..
            }) => {
                assert_eq!(*kind, std::io::ErrorKind::UnexpectedEof);
                assert!(message.contains("closed after 1000 of 4096"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        for o in &out[2..] {
            assert!(
                matches!(&o.result, Err(FetchFailure::ConnectionLost { .. })),
                "{:?}",
                o.result
            );
        }
    }
}
