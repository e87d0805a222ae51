//! The `recv` path: a plain-TCP data connection read with `recv` straight into each shard's
//! slab in host memory, each read asking for the rest of the payload and checksummed right
//! after it lands, with `SO_RCVLOWAT` raised so that a shard costs a few large reads.
//! [`Host`] places payloads from any [`PayloadRead`] into host memory: this socket, or the
//! devmem path's host gather.

use std::io::{self, Read};
use std::net::TcpStream;

use super::error::RxError;
use super::shared::{Checksum, Pace, PayloadRead, Place, Tally, lowat_for, read_failed};
use crate::fetch::InFlight;

impl PayloadRead for TcpStream {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        self.read(dst)
    }
}

/// A plain-TCP data connection and its `SO_RCVLOWAT`.
#[derive(Debug)]
pub struct Plain {
    sock: TcpStream,
    /// The low-water mark set now (the kernel's default is 1).
    lowat: i32,
}

impl Plain {
    /// A plain-TCP data connection at the kernel's default mark (set per read).
    pub fn new(sock: TcpStream) -> Self {
        Self { sock, lowat: 1 }
    }
}

impl PayloadRead for Plain {
    /// Reads with `SO_RCVLOWAT` at [`super::shared::RCVLOWAT`], or at half the read's length
    /// if that is less ([`lowat_for`]): a blocked `recv` is woken only once that many bytes
    /// are queued. Callers never read past the payload.
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let want = lowat_for(dst.len());
        if want != self.lowat {
            shardwire_devmem::set_rcvlowat(std::os::fd::AsFd::as_fd(&self.sock), want)?;
            self.lowat = want;
        }
        self.sock.read(dst)
    }
}

/// Places payloads read from `R` into slabs in host memory.
#[derive(Debug)]
pub struct Host<R>(pub R);

impl<R: PayloadRead> Place for Host<R> {
    fn place(
        &mut self,
        f: &mut InFlight,
        tally: &mut Tally<'_>,
        pace: &mut Pace,
    ) -> Result<u32, RxError> {
        let dst = f.slab_mut().host_slice_mut().ok_or(RxError::WrongMemory {
            path: "host",
            found: "CUDA",
        })?;
        recv_payload(&mut self.0, dst, tally, pace)
    }
}

/// Fills `dst` from `r`, returning the CRC-32C of what arrived. Each read asks for the rest
/// of the payload and takes whatever has arrived (at least the socket's low-water mark), and
/// that piece is checksummed right away and kept to `pace`. Reads of the whole rest, not of at most an
/// L2-sized [`super::shared::CHUNK`]: a reader that stays in `recv` keeps the socket owned
/// while the next segments arrive, so the kernel queues them to the socket's backlog for
/// this thread to process instead of processing each one where it arrives and waking the
/// reader; on loopback that halved the senders' CPU per GB and raised this path's goodput by
/// a third, more than the CRC of pieces no longer in L2 costs (docs/BENCHMARKS.md, 2026-12-04).
pub fn recv_payload<R: PayloadRead>(
    r: &mut R,
    dst: &mut [u8],
    tally: &mut Tally<'_>,
    pace: &mut Pace,
) -> Result<u32, RxError> {
    let mut sum = Checksum::new();
    let mut off = 0;
    while off < dst.len() {
        let n = match r.read_some(&mut dst[off..]) {
            Ok(0) => {
                return Err(RxError::Closed {
                    got: off as u64,
                    want: dst.len() as u64,
                });
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_failed("recv", &e, off as u64, dst.len() as u64)),
        };
        tally.piece(&mut sum, &dst[off..off + n]);
        off += n;
        pace.landed_now(n)?;
    }
    Ok(sum.finish())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use super::*;
    use crate::counters::{Counters, FlowStats};
    use crate::fetch::tests::{in_flight, pool};
    use crate::fetch::{Completion, FetchFailure};
    use crate::link::{LinkConfig, SourceLink};
    use crate::rx::shared::{ConnAt, DATA_STALL_TIMEOUT, PaceRule, RCVLOWAT, run};

    /// Over a real loopback socket: a small payload arrives at once (the mark is at most
    /// half the read's length: the kernel wakes a blocked reader only at the socket's mark),
    /// a payload of exactly RCVLOWAT trickling in arrives, and a large one is read whole.
    #[test]
    fn the_low_water_mark_never_waits_past_a_payload() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (sock, _) = l.accept().unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut rx = Plain::new(sock);
        let big: Vec<u8> = (0..(3 * RCVLOWAT as usize + 7)).map(|i| i as u8).collect();
        std::io::Write::write_all(&mut tx, &[7u8; 100]).unwrap();
        let t = std::time::Instant::now();
        let mut small = [0u8; 100];
        assert_eq!(rx.read_some(&mut small).unwrap(), 100);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "waited {:?}",
            t.elapsed()
        );
        assert_eq!(
            rx.lowat, 1,
            "under the minimum mark a read takes what has arrived"
        );
        // A payload of RCVLOWAT bytes trickling in: the mark (half of it) is reached.
        let trickle: Vec<u8> = (0..RCVLOWAT as usize).map(|i| (i % 251) as u8).collect();
        let sent = trickle.clone();
        let mut tx2 = tx.try_clone().unwrap();
        let w = std::thread::spawn(move || {
            for c in sent.chunks(16 << 10) {
                std::io::Write::write_all(&mut tx2, c).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let mut got = vec![0u8; trickle.len()];
        let mut off = 0;
        while off < got.len() {
            off += rx.read_some(&mut got[off..]).unwrap();
        }
        w.join().unwrap();
        assert_eq!(got, trickle);
        let writer =
            std::thread::spawn(move || std::io::Write::write_all(&mut tx, &big).map(|_| big));
        let mut got = vec![0u8; 3 * RCVLOWAT as usize + 7];
        let mut off = 0;
        while off < got.len() {
            let end = (off + crate::rx::shared::CHUNK).min(got.len());
            off += rx.read_some(&mut got[off..end]).unwrap();
        }
        assert_eq!(got, writer.join().unwrap().unwrap());
    }

    /// A connected pair whose far end a thread writes `wire` to, `piece` bytes every
    /// `every`, until it is done or the near end is closed.
    pub(crate) fn trickle(
        wire: Vec<u8>,
        piece: usize,
        every: Duration,
    ) -> (TcpStream, std::thread::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (sock, _) = l.accept().unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let w = std::thread::spawn(move || {
            for c in wire.chunks(piece) {
                if std::io::Write::write_all(&mut tx, c).is_err() {
                    return; // the receiver dropped the connection
                }
                std::thread::sleep(every);
            }
        });
        (sock, w)
    }

    /// A byte every 20 ms never trips the per-read stall timeout (the whole payload would
    /// take 80 s); the pace floor drops the connection after one window: the payload and
    /// the one behind it fail, naming the trickle.
    #[test]
    fn a_payload_that_trickles_in_is_dropped_after_one_window() {
        let rule = PaceRule {
            window: Duration::from_millis(300),
            floor: 1000,
        };
        let (sock, w) = trickle(vec![5; 4106], 1, Duration::from_millis(20));
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, 4096, 0);
        let (fb, rb) = in_flight(&p, 1, 10, 0);
        let (tx, queue) = std::sync::mpsc::channel();
        tx.send(fa).unwrap();
        tx.send(fb).unwrap();
        drop(tx);
        let t = std::time::Instant::now();
        let (flow, c) = (FlowStats::default(), Counters::default());
        run(
            Host(Plain::new(sock)),
            &link(),
            at(4),
            &queue,
            &flow,
            &c,
            rule,
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        w.join().unwrap();
        let out = outcomes(vec![ra, rb]);
        let slow = match &out[0].result {
            Err(FetchFailure::ConnectionLost { conn: 4, cause, .. }) => cause.clone(),
            other => panic!("{other:?}"),
        };
        match &slow {
            RxError::TooSlow { got, due, took, .. } => {
                assert!(*got < 1000 && got + due == 4096, "{slow}");
                assert!(*took >= rule.window, "{slow}");
            }
            other => panic!("{other:?}"),
        }
        assert!(slow.to_string().contains("slowed to a trickle"), "{slow}");
        match &out[1].result {
            Err(FetchFailure::ConnectionLost { cause, .. }) => {
                assert_eq!(cause, &RxError::Earlier(Box::new(slow)))
            }
            other => panic!("{other:?}"),
        }
    }

    /// A slow link that keeps to the floor is no trickle: payloads that take several
    /// windows arrive whole.
    #[test]
    fn a_slow_payload_that_keeps_to_the_floor_arrives() {
        let rule = PaceRule {
            window: Duration::from_millis(150),
            floor: 64,
        };
        let (a, b): (Vec<u8>, Vec<u8>) = ((0..6000u32).map(|i| i as u8).collect(), vec![9; 3000]);
        let (sock, w) = trickle(
            [a.clone(), b.clone()].concat(),
            300,
            Duration::from_millis(10),
        );
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, a.len(), crc(&a));
        let (fb, rb) = in_flight(&p, 1, b.len(), crc(&b));
        let (tx, queue) = std::sync::mpsc::channel();
        tx.send(fa).unwrap();
        tx.send(fb).unwrap();
        drop(tx);
        let (flow, c) = (FlowStats::default(), Counters::default());
        run(
            Host(Plain::new(sock)),
            &link(),
            at(5),
            &queue,
            &flow,
            &c,
            rule,
        );
        w.join().unwrap();
        let out = outcomes(vec![ra, rb]);
        assert!(out.iter().all(|o| o.result.is_ok()), "{:?}", out[0].result);
        assert_eq!(out[0].slab.host_slice().unwrap(), &a[..]);
        assert_eq!(out[1].slab.host_slice().unwrap(), &b[..]);
    }

    /// Connection `conn` of the link's first session.
    fn at(conn: u16) -> ConnAt {
        ConnAt {
            conn,
            generation: 0,
        }
    }

    pub(crate) fn link() -> Arc<SourceLink> {
        SourceLink::new(
            0,
            "src:1".into(),
            LinkConfig {
                secret: None,
                lanes: vec![shardwire_protocol::wire::LaneAddr {
                    data_addr: "127.0.0.1:1".parse().unwrap(),
                    flows: 1,
                }],
            },
        )
    }

    pub(crate) fn crc(b: &[u8]) -> u32 {
        let mut c = shardwire_protocol::crc::Crc32c::new();
        c.update(b);
        c.finish()
    }

    pub(crate) fn outcomes(
        rxs: Vec<tokio::sync::mpsc::UnboundedReceiver<Completion>>,
    ) -> Vec<Completion> {
        rxs.into_iter().map(|mut r| r.try_recv().unwrap()).collect()
    }

    #[test]
    fn payloads_back_to_back_are_verified_and_counted() {
        let (a, b): (Vec<u8>, Vec<u8>) = ((0..5000u32).map(|i| i as u8).collect(), vec![7; 3000]);
        let wire = [a.clone(), b.clone()].concat();
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, a.len(), crc(&a));
        let (fb, rb) = in_flight(&p, 1, b.len(), crc(&b));
        let (tx, queue) = std::sync::mpsc::channel();
        tx.send(fa).unwrap();
        tx.send(fb).unwrap();
        drop(tx);
        let (l, flow, c) = (link(), FlowStats::default(), Counters::default());
        run(
            Host(&wire[..]),
            &l,
            at(0),
            &queue,
            &flow,
            &c,
            PaceRule::DEFAULT,
        );
        let out = outcomes(vec![ra, rb]);
        assert!(out.iter().all(|o| o.result.is_ok()));
        assert_eq!(out[0].slab.host_slice().unwrap(), &a[..]);
        assert_eq!(out[1].slab.host_slice().unwrap(), &b[..]);
        assert_eq!(c.shards_received.load(Ordering::Relaxed), 2);
        assert_eq!(flow.bytes.load(Ordering::Relaxed), 8000);
        assert_eq!(l.bytes.load(Ordering::Relaxed), 8000);
    }

    #[test]
    fn a_crc_mismatch_fails_that_payload_only() {
        let (a, b) = (vec![1u8; 4096], vec![2u8; 4096]);
        let wire = [a.clone(), b.clone()].concat();
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, a.len(), crc(&a) ^ 1);
        let (fb, rb) = in_flight(&p, 1, b.len(), crc(&b));
        let (tx, queue) = std::sync::mpsc::channel();
        tx.send(fa).unwrap();
        tx.send(fb).unwrap();
        drop(tx);
        let c = Counters::default();
        run(
            Host(&wire[..]),
            &link(),
            at(0),
            &queue,
            &FlowStats::default(),
            &c,
            PaceRule::DEFAULT,
        );
        let out = outcomes(vec![ra, rb]);
        assert!(matches!(out[0].result, Err(FetchFailure::Crc { .. })));
        assert!(out[1].result.is_ok());
        assert_eq!(c.crc_failures.load(Ordering::Relaxed), 1);
        assert_eq!(c.shards_received.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_payload_longer_than_announced_drops_the_connection_after_two_mismatches() {
        // One stray byte after A: B and C are read one byte off. Before, the connection went
        // on: B, C and every later payload failed their CRC (and were fetched again, onto
        // the same connection, until the stream closed as `Corrupt`).
        let (a, b, c, d) = (
            vec![1u8; 4096],
            vec![2u8; 4096],
            vec![3u8; 4096],
            vec![4u8; 10],
        );
        let wire = [a.clone(), vec![9], b.clone(), c.clone(), d.clone()].concat();
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, a.len(), crc(&a));
        let (fb, rb) = in_flight(&p, 1, b.len(), crc(&b));
        let (fc, rc) = in_flight(&p, 2, c.len(), crc(&c));
        let (fd, rd) = in_flight(&p, 3, d.len(), crc(&d));
        let (tx, queue) = std::sync::mpsc::channel();
        for f in [fa, fb, fc, fd] {
            tx.send(f).unwrap();
        }
        drop(tx);
        let counters = Counters::default();
        run(
            Host(&wire[..]),
            &link(),
            at(1),
            &queue,
            &FlowStats::default(),
            &counters,
            PaceRule::DEFAULT,
        );
        let out = outcomes(vec![ra, rb, rc, rd]);
        assert!(out[0].result.is_ok());
        assert!(matches!(out[1].result, Err(FetchFailure::Crc { .. })));
        assert!(matches!(out[2].result, Err(FetchFailure::Crc { .. })));
        match &out[3].result {
            Err(FetchFailure::ConnectionLost { conn: 1, cause, .. }) => assert_eq!(
                cause,
                &RxError::Earlier(Box::new(RxError::Misframed { in_a_row: 2 }))
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(counters.crc_failures.load(Ordering::Relaxed), 2);
    }

    /// A read that times out mid-payload (`SO_RCVTIMEO`: `WouldBlock`) says that no bytes
    /// arrived for the stall timeout, and how much of the payload had. Before, it read
    /// "recv: Resource temporarily unavailable (os error 11)". The bytes that landed count
    /// for the link's stall check.
    #[test]
    fn a_payload_that_stops_arriving_says_no_bytes_arrived() {
        struct StopsAfter<'a>(&'a [u8]);
        impl PayloadRead for StopsAfter<'_> {
            fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
                match self.0.read_some(dst)? {
                    0 => Err(io::Error::from_raw_os_error(libc::EAGAIN)),
                    n => Ok(n),
                }
            }
        }
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, 4096, 0);
        let (tx, queue) = std::sync::mpsc::channel();
        tx.send(fa).unwrap();
        drop(tx);
        let l = link();
        run(
            Host(StopsAfter(&[3u8; 1000])),
            &l,
            at(3),
            &queue,
            &FlowStats::default(),
            &Counters::default(),
            PaceRule::DEFAULT,
        );
        let out = outcomes(vec![ra]);
        let cause = match &out[0].result {
            Err(FetchFailure::ConnectionLost { conn: 3, cause, .. }) => cause.clone(),
            other => panic!("{other:?}"),
        };
        let stalled = RxError::Stalled {
            after: DATA_STALL_TIMEOUT,
            got: 1000,
            want: 4096,
        };
        assert_eq!(cause, stalled);
        let said = cause.to_string();
        assert!(said.contains("no bytes arrived for 60s"), "{said}");
        assert!(!said.contains("temporarily unavailable"), "{said}");
        assert_eq!(l.landed.load(Ordering::Relaxed), 1000);
    }

    #[test]
    fn a_connection_that_breaks_fails_its_payload_and_every_later_one() {
        let wire = vec![3u8; 1000]; // the first payload needs 4096
        let p = pool(1 << 20);
        let (fa, ra) = in_flight(&p, 0, 4096, 0);
        let (fb, rb) = in_flight(&p, 1, 10, 0);
        let (tx, queue) = std::sync::mpsc::channel();
        tx.send(fa).unwrap();
        tx.send(fb).unwrap();
        drop(tx);
        run(
            Host(&wire[..]),
            &link(),
            at(2),
            &queue,
            &FlowStats::default(),
            &Counters::default(),
            PaceRule::DEFAULT,
        );
        let out = outcomes(vec![ra, rb]);
        let closed = RxError::Closed {
            got: 1000,
            want: 4096,
        };
        match &out[0].result {
            Err(FetchFailure::ConnectionLost { conn: 2, cause, .. }) => assert_eq!(cause, &closed),
            other => panic!("{other:?}"),
        }
        match &out[1].result {
            Err(FetchFailure::ConnectionLost { cause, .. }) => {
                assert_eq!(cause, &RxError::Earlier(Box::new(closed)))
            }
            other => panic!("{other:?}"),
        }
    }
}
