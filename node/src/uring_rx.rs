//! The host-memory receive path over io_uring: each data connection's announced payloads are
//! posted ahead (up to `shardwire_devmem::uring::QUEUE_DEPTH`) as the provided buffers of one multishot receive
//! ([`shardwire_devmem::uring::RecvQueue`]), so the kernel places every payload straight in
//! its slab and moves on to the next one without a new request; each completed piece is
//! checksummed as it arrives. Measured against the `recv` path ([`crate::receiver`]) by
//! `shardwire bench --compare-uring` (docs/BENCHMARKS.md); where io_uring cannot be set up
//! (a seccomp policy, an older kernel) the connection uses `recv`, and the node logs why.

use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Once;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use shardwire_devmem::uring::{RecvQueue, StableBuf};
use shardwire_protocol::crc::Crc32c;

use crate::counters::{Counters, FlowStats};
use crate::fetch::InFlight;
use crate::link::SourceLink;
use crate::receiver::{self, DATA_STALL_TIMEOUT};

/// A posted payload: the fetch and the CRC of its bytes so far.
pub struct Job {
    f: InFlight,
    crc: Crc32c,
}

// SAFETY: the bytes are the slab's span of its pool's region, which neither moves nor is
// freed while the `InFlight` (and so this `Job`) holds the slab; every call returns that
// same span (an empty one for a slab outside host memory, which is never posted).
unsafe impl StableBuf for Job {
    fn bytes(&mut self) -> &mut [u8] {
        self.f.slab.host_slice_mut().unwrap_or(&mut [])
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

/// Receives the payloads announced for one connection until its queue closes (the io_uring
/// form of [`receiver::run`], with the same outcomes and counters).
pub fn run(
    mut q: RecvQueue<Job>,
    link: &SourceLink,
    conn: u16,
    queue: &Receiver<InFlight>,
    flow: &FlowStats,
    c: &Counters,
) {
    let mut lowat = 1;
    loop {
        let mut r = Ok(());
        if q.is_empty() {
            match queue.recv() {
                Ok(f) => r = post(&mut q, f, link, c),
                Err(_) => return, // the link is gone
            }
        }
        while r.is_ok() && !q.is_full() {
            match queue.try_recv() {
                Ok(f) => r = post(&mut q, f, link, c),
                Err(_) => break,
            }
        }
        if r.is_ok() && q.is_empty() {
            continue;
        }
        let r = r.and_then(|()| {
            set_lowat(&q, &mut lowat).map_err(|e| (None, e))?;
            receive(&mut q, flow, c, link).map_err(|e| (None, e))
        });
        if let Err((refused, e)) = r {
            let cause = e.to_string();
            for job in refused.into_iter().map(|j| *j).chain(q.abandon()) {
                job.f.finish(Err(receiver::lost(link, conn, cause.clone())));
            }
            link.kick(&format!(
                "data connection {conn} from {} failed mid-shard: {cause}",
                link.addr
            ));
            receiver::fail_queued(queue, link, conn, &cause);
            return;
        }
    }
}

/// A payload that could not be posted, and why.
type Refused = (Option<Box<Job>>, std::io::Error);

/// Posts `f`'s slab (an empty payload is complete at once). A payload that cannot be posted
/// (only a slab outside host memory could be refused) breaks the connection: its bytes are
/// on their way and would land in the next slab.
fn post(
    q: &mut RecvQueue<Job>,
    f: InFlight,
    link: &SourceLink,
    c: &Counters,
) -> Result<(), Refused> {
    if f.length == 0 {
        receiver::deliver(f, Crc32c::new().finish(), link, c);
        return Ok(());
    }
    let job = Job {
        f,
        crc: Crc32c::new(),
    };
    q.post(job).map_err(|(job, e)| {
        let e = std::io::Error::other(format!(
            "cannot post a {}-byte payload to the io_uring receive: {e}",
            job.f.length
        ));
        (Some(Box::new(job)), e)
    })
}

/// The `SO_RCVLOWAT` rule of the `recv` path over all the bytes still due.
fn set_lowat(q: &RecvQueue<Job>, lowat: &mut i32) -> std::io::Result<()> {
    let want = receiver::lowat_for(q.remaining());
    if want != *lowat {
        shardwire_devmem::set_rcvlowat(q.socket().as_fd(), want)?;
        *lowat = want;
    }
    Ok(())
}

/// One wait: checksums each piece, delivers each complete payload.
fn receive(
    q: &mut RecvQueue<Job>,
    flow: &FlowStats,
    c: &Counters,
    link: &SourceLink,
) -> std::io::Result<()> {
    let mut verify = Duration::ZERO;
    let r = q.wait(
        DATA_STALL_TIMEOUT,
        |job, _, piece| {
            let t = Instant::now();
            job.crc.update(piece);
            verify += t.elapsed();
            flow.bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
        },
        |job| receiver::deliver(job.f, job.crc.finish(), link, c),
    );
    c.assembly_ns
        .fetch_add(verify.as_nanos() as u64, Ordering::Relaxed);
    r
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;
    use crate::fetch::FetchFailure;
    use crate::fetch::tests::{in_flight, pool};
    use crate::receiver::tests::{crc, link, outcomes};

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
        run(q, &l, 0, &queue, &flow, &c);
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
            3,
            &queue,
            &FlowStats::default(),
            &Counters::default(),
        );
        t.join().unwrap();
        let out = outcomes(rxs);
        assert!(out[0].result.is_ok());
        match &out[1].result {
            Err(FetchFailure::ConnectionLost { conn: 3, cause, .. }) => {
                assert!(cause.contains("closed after 1000 of 4096"), "{cause}")
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
