//! Receiver threads: one per data connection. Each takes the next announced payload
//! ([`InFlight`]), receives it into the shard's slab, computes CRC-32C as the bytes arrive,
//! and ends the fetch with the outcome.
//!
//! The receive path is chosen once, when the connection is identified ([`Path::choose`]):
//! - `HostQueued`: plain TCP into host memory over io_uring, the next payloads' slabs posted
//!   as the receive's buffers ([`crate::uring_rx`]), where io_uring can be set up;
//! - `Host`: `recv` (or the devmem gather, [`crate::devmem_rx`]) straight into the slab in host
//!   memory, each piece checksummed while it is still in cache;
//! - `Staged`: CUDA memory without GPU-direct receive: `recv` into pinned buffers whose
//!   asynchronous H2D copies overlap the next `recv`s (`shardwire_gpu::cuda::H2dStager`);
//! - `GpuDirect`: devmem into GPU memory: frags gathered on the GPU, CRC by the GPU kernel.
//!
//! The loop ([`run`]) is generic over the path, so its bookkeeping (a broken connection fails
//! every later payload queued on it, counters, the link reset) is unit tested in memory.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;

use shardwire_gpu::Slab;
use shardwire_gpu::cuda::{CudaMemory, H2dStager};
use shardwire_protocol::crc::Crc32c;

use crate::counters::{Counters, FlowStats};
use crate::devmem_rx::{DevmemReader, RxRegion};
use crate::fetch::{FetchFailure, InFlight};
use crate::link::SourceLink;
use crate::uring_rx;

/// Largest single `recv`: large enough to amortise the syscall, small enough that the bytes
/// are still in L2 when they are checksummed.
pub const CHUNK: usize = 1 << 20;

/// `SO_RCVLOWAT` of plain-TCP data connections (a quarter of a [`CHUNK`]; see
/// [`Plain::read_some`] for the smaller marks near a payload's end). Measured with
/// `bench` on loopback (docs/BENCHMARKS.md): 256 KiB and 512 KiB raised goodput by about a
/// quarter over the default of 1 byte at a lower CPU per GB; 1 MiB (with 2 MiB reads) was
/// worse than both. A slow link still makes progress: a read that times out returns what
/// has arrived.
pub const RCVLOWAT: i32 = 256 << 10;

/// Below this a read takes whatever has arrived (`SO_RCVLOWAT` 1).
const MIN_LOWAT: usize = 16 << 10;

/// Pinned buffers per receiver in CUDA memory mode: while one is copied to the GPU the
/// socket fills the next; four absorb a copy that runs late without stalling `recv`.
const STAGING_BUFFERS: usize = 4;

/// A payload that stops arriving for this long (a source that is alive on its control
/// connection but stalls a data connection) fails the fetch and resets the link.
pub const DATA_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Something payload bytes can be read from.
pub trait PayloadRead {
    /// Reads some bytes into `dst` (0 at end of stream).
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize>;
}

impl PayloadRead for TcpStream {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        self.read(dst)
    }
}

impl PayloadRead for DevmemReader {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        DevmemReader::read_some(self, dst)
    }
}

impl PayloadRead for &[u8] {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        self.read(dst)
    }
}

/// Where a data connection's bytes come from: the socket, or the devmem path.
#[derive(Debug)]
pub enum Wire {
    /// Plain TCP.
    Plain(Plain),
    /// Frags gathered out of the RX binding.
    Devmem(DevmemReader),
}

impl PayloadRead for Wire {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Plain(s) => s.read_some(dst),
            Self::Devmem(r) => r.read_some(dst),
        }
    }
}

/// The `SO_RCVLOWAT` for a read that may take `len` more bytes of a payload: [`RCVLOWAT`],
/// or half of `len` if that is less (1 below [`MIN_LOWAT`]).
pub fn lowat_for(len: usize) -> i32 {
    let half = len / 2;
    match half < MIN_LOWAT {
        true => 1,
        false => half.min(RCVLOWAT as usize) as i32,
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
    /// Reads with `SO_RCVLOWAT` at [`RCVLOWAT`], or at half the read's length if that is
    /// less (1 below [`MIN_LOWAT`]): a blocked `recv` is woken only once that many bytes are
    /// queued, so a shard costs a few large reads instead of one per segment burst. Callers
    /// never read past the payload, and the kernel wakes a reader on the socket's mark, not
    /// on the read's length, so the mark stays at most half of what is still on its way:
    /// the receive window (which the queued bytes fill) never has to hold all of it.
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let want = lowat_for(dst.len());
        if want != self.lowat {
            shardwire_devmem::set_rcvlowat(std::os::fd::AsFd::as_fd(&self.sock), want)?;
            self.lowat = want;
        }
        self.sock.read(dst)
    }
}

/// Puts one payload into its slab and returns the CRC-32C of what arrived.
pub trait Place {
    /// Receives `f`'s payload into `f.slab`; an error means the connection is broken.
    fn place(&mut self, f: &mut InFlight, flow: &FlowStats, c: &Counters) -> Result<u32, String>;
}

/// A receiver's path, chosen once per connection.
pub enum Path {
    /// Into host memory.
    Host(Wire),
    /// Into host memory over io_uring, payloads posted ahead ([`crate::uring_rx`]): the
    /// receiver thread sets up its ring (a ring is used by the thread that made it) and
    /// falls back to `recv` where it cannot. It has its own loop; [`Place::place`] refuses it.
    HostQueued(TcpStream),
    /// Into CUDA memory through pinned staging buffers (made on first use).
    Staged(Wire, Arc<CudaMemory>, Option<H2dStager>),
    /// Devmem frags gathered on the GPU; `Vec` is where linear bytes land.
    GpuDirect(DevmemReader, Arc<CudaMemory>, Vec<u8>),
}

impl Path {
    /// The path for a connection on a node with this binding and GPU (`None`: host memory);
    /// `io_uring`: plain TCP into host memory tries [`Path::HostQueued`].
    pub fn choose(
        sock: TcpStream,
        rx: Option<&Arc<RxRegion>>,
        cuda: Option<&Arc<CudaMemory>>,
        io_uring: bool,
    ) -> io::Result<Self> {
        if let (None, None, true) = (rx, cuda, io_uring) {
            return Ok(Self::HostQueued(sock));
        }
        let wire = match rx {
            None => Wire::Plain(Plain::new(sock)),
            Some(region) => Wire::Devmem(region.reader(sock)?),
        };
        Ok(match (wire, cuda) {
            (w, None) => Self::Host(w),
            (Wire::Devmem(r), Some(gpu)) if r.gpu_gather() => {
                Self::GpuDirect(r, Arc::clone(gpu), vec![0; CHUNK])
            }
            (w, Some(gpu)) => Self::Staged(w, Arc::clone(gpu), None),
        })
    }
}

impl Place for Path {
    fn place(&mut self, f: &mut InFlight, flow: &FlowStats, c: &Counters) -> Result<u32, String> {
        match self {
            Self::Host(w) => {
                let dst = f
                    .slab
                    .host_slice_mut()
                    .ok_or("a slab outside host memory on the host path")?;
                recv_payload(w, dst, flow, &c.assembly_ns).map_err(|e| e.to_string())
            }
            Self::HostQueued(_) => Err("the io_uring path receives in its own loop".into()),
            Self::Staged(w, gpu, stager) => staged(w, gpu, stager, &f.slab, flow, c),
            Self::GpuDirect(r, gpu, host) => gpu_direct(r, gpu, host, &f.slab, flow, c),
        }
    }
}

/// Identifies the connection's stats and starts its receiver thread.
pub fn spawn(
    link: Arc<SourceLink>,
    conn: u16,
    path: Path,
    queue: Receiver<InFlight>,
    flow: Arc<FlowStats>,
    counters: Arc<Counters>,
) {
    let name = format!("sw-recv-{}-{conn}", link.index);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || match path {
            Path::HostQueued(sock) => match uring_rx::queue_for(&sock) {
                Some(q) => {
                    counters
                        .io_uring_connections
                        .fetch_add(1, Ordering::Relaxed);
                    uring_rx::run(q, &link, conn, &queue, &flow, &counters)
                }
                None => {
                    counters.recv_connections.fetch_add(1, Ordering::Relaxed);
                    let path = Path::Host(Wire::Plain(Plain::new(sock)));
                    run(path, &link, conn, &queue, &flow, &counters)
                }
            },
            path => {
                if let Path::Host(Wire::Plain(_)) = path {
                    counters.recv_connections.fetch_add(1, Ordering::Relaxed);
                }
                run(path, &link, conn, &queue, &flow, &counters)
            }
        })
        .expect("spawn receiver thread");
}

/// Receives the payloads announced for one connection until its queue closes.
pub fn run<P: Place>(
    mut path: P,
    link: &SourceLink,
    conn: u16,
    queue: &Receiver<InFlight>,
    flow: &FlowStats,
    c: &Counters,
) {
    while let Ok(mut f) = queue.recv() {
        // One span per fetch: the receive and the verification happen inside it.
        let span = tracing::debug_span!("fetch", req = f.req, shard = f.shard, source = %link.addr);
        let _entered = span.enter();
        match path.place(&mut f, flow, c) {
            Ok(got) => deliver(f, got, link, c),
            Err(cause) => {
                let reason = format!(
                    "data connection {conn} from {} failed mid-shard: {cause}",
                    link.addr
                );
                f.finish(Err(lost(link, conn, cause.clone())));
                link.kick(&reason);
                fail_queued(queue, link, conn, &cause);
                return;
            }
        }
    }
}

/// The failure of a fetch whose connection broke.
pub fn lost(link: &SourceLink, conn: u16, cause: String) -> FetchFailure {
    FetchFailure::ConnectionLost {
        source_addr: link.addr.clone(),
        conn,
        cause,
    }
}

/// Ends a received fetch: counts it when its CRC-32C (`got`) matches, warns when not (the
/// fetcher fetches it again).
pub fn deliver(f: InFlight, got: u32, link: &SourceLink, c: &Counters) {
    if got == f.crc32c {
        c.bytes_received.fetch_add(f.length, Ordering::Relaxed);
        c.shards_received.fetch_add(1, Ordering::Relaxed);
        link.bytes.fetch_add(f.length, Ordering::Relaxed);
    } else {
        c.crc_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(source = %link.addr, shard = f.shard, got = format!("{got:08x}"), want = format!("{:08x}", f.crc32c),
            "CRC-32C mismatch: the shard will be fetched again");
    }
    f.verified(got);
}

/// After a connection broke: fails every payload still announced on it until its queue
/// closes.
pub fn fail_queued(queue: &Receiver<InFlight>, link: &SourceLink, conn: u16, cause: &str) {
    while let Ok(f) = queue.recv() {
        f.finish(Err(lost(link, conn, format!("it failed earlier: {cause}"))));
    }
}

/// Fills `dst` from `r`, returning the CRC-32C of what arrived. Each read takes whatever the
/// socket holds (up to [`CHUNK`]), and that piece is checksummed right away, while it is
/// still in cache.
pub fn recv_payload<R: PayloadRead>(
    r: &mut R,
    dst: &mut [u8],
    flow: &FlowStats,
    assembly_ns: &AtomicU64,
) -> io::Result<u32> {
    let mut verify = std::time::Duration::ZERO;
    let mut crc = Crc32c::new();
    let mut off = 0;
    while off < dst.len() {
        let end = (off + CHUNK).min(dst.len());
        let n = match r.read_some(&mut dst[off..end]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "connection closed after {off} of {} payload bytes",
                        dst.len()
                    ),
                ));
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let t = std::time::Instant::now();
        crc.update(&dst[off..off + n]);
        verify += t.elapsed();
        off += n;
        flow.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    assembly_ns.fetch_add(verify.as_nanos() as u64, Ordering::Relaxed);
    Ok(crc.finish())
}

/// Receives a payload into a slab in CUDA memory through this thread's pinned staging
/// buffers, returning the CRC-32C computed while each piece was in host memory. The copies
/// have landed when this returns.
fn staged(
    wire: &mut Wire,
    gpu: &CudaMemory,
    stager: &mut Option<H2dStager>,
    slab: &Slab,
    flow: &FlowStats,
    c: &Counters,
) -> Result<u32, String> {
    let region = slab.region().cuda().ok_or("a host slab on the CUDA path")?;
    let stager = match stager {
        Some(s) => s,
        None => stager.insert(
            H2dStager::new(&gpu.device, CHUNK, STAGING_BUFFERS)
                .map_err(|e| format!("pinned staging buffers: {e}"))?,
        ),
    };
    let stalls = stager.stalls();
    let mut verify = std::time::Duration::ZERO;
    let mut crc = Crc32c::new();
    stager
        .copy_from(
            &mut |buf| wire.read_some(buf),
            &mut |piece| {
                let t = std::time::Instant::now();
                crc.update(piece);
                verify += t.elapsed();
                flow.bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
            },
            region,
            slab.offset(),
            slab.len(),
        )
        .map_err(|e| e.to_string())?;
    c.assembly_ns
        .fetch_add(verify.as_nanos() as u64, Ordering::Relaxed);
    c.staging_stalls
        .fetch_add(stager.stalls() - stalls, Ordering::Relaxed);
    Ok(crc.finish())
}

/// Receives a payload on the devmem path into a slab in CUDA memory: each `recvmsg`'s frags
/// are gathered on the GPU (see `DevmemReader::read_into_gpu`), so the bytes never enter
/// host memory, and the CRC-32C is computed on the GPU by the CRC kernel at the end.
fn gpu_direct(
    reader: &mut DevmemReader,
    gpu: &CudaMemory,
    host: &mut [u8],
    slab: &Slab,
    flow: &FlowStats,
    c: &Counters,
) -> Result<u32, String> {
    let region = slab.region().cuda().ok_or("a host slab on the CUDA path")?;
    let mut off = 0;
    while off < slab.len() {
        let want = (slab.len() - off).min(host.len());
        let n = match reader.read_into_gpu(region, slab.offset() + off, &mut host[..want]) {
            Ok(0) => {
                return Err(format!(
                    "connection closed after {off} of {} payload bytes",
                    slab.len()
                ));
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        };
        off += n;
        flow.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    let t = std::time::Instant::now();
    let span = shardwire_gpu::kernels::Span {
        off: slab.offset() as u64,
        len: slab.len() as u64,
    };
    let crc = gpu
        .engines
        .crc32c(region, &[span])
        .map_err(|e| format!("CRC-32C on the GPU: {e}"))?;
    c.assembly_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    Ok(crc[0])
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fetch::Completion;

    /// Over a real loopback socket: a small payload arrives at once (the mark is at most
    /// half the read's length: the kernel wakes a blocked reader only at the socket's mark),
    /// a payload of exactly RCVLOWAT trickling in arrives, and a large one is read whole.
    #[test]
    fn the_low_water_mark_never_waits_past_a_payload() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (sock, _) = l.accept().unwrap();
        sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut rx = Plain::new(sock);
        let big: Vec<u8> = (0..(3 * RCVLOWAT as usize + 7)).map(|i| i as u8).collect();
        std::io::Write::write_all(&mut tx, &[7u8; 100]).unwrap();
        let t = std::time::Instant::now();
        let mut small = [0u8; 100];
        assert_eq!(rx.read_some(&mut small).unwrap(), 100);
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "waited {:?}",
            t.elapsed()
        );
        assert_eq!(rx.lowat, 1, "under MIN_LOWAT a read takes what has arrived");
        // A payload of RCVLOWAT bytes trickling in: the mark (half of it) is reached.
        let trickle: Vec<u8> = (0..RCVLOWAT as usize).map(|i| (i % 251) as u8).collect();
        let sent = trickle.clone();
        let mut tx2 = tx.try_clone().unwrap();
        let w = std::thread::spawn(move || {
            for c in sent.chunks(16 << 10) {
                std::io::Write::write_all(&mut tx2, c).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5));
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
            let end = (off + CHUNK).min(got.len());
            off += rx.read_some(&mut got[off..end]).unwrap();
        }
        assert_eq!(got, writer.join().unwrap().unwrap());
    }
    use crate::fetch::tests::{in_flight, pool};
    use crate::link::LinkConfig;

    /// Host placement from a byte string (the socket's bytes, back to back).
    struct Bytes<'a>(&'a [u8]);

    impl Place for Bytes<'_> {
        fn place(
            &mut self,
            f: &mut InFlight,
            flow: &FlowStats,
            c: &Counters,
        ) -> Result<u32, String> {
            let dst = f.slab.host_slice_mut().unwrap();
            recv_payload(&mut self.0, dst, flow, &c.assembly_ns).map_err(|e| e.to_string())
        }
    }

    pub(crate) fn link() -> Arc<SourceLink> {
        SourceLink::new(
            0,
            "src:1".into(),
            LinkConfig {
                secret: None,
                flows: 1,
                data_addr: "127.0.0.1:1".parse().unwrap(),
            },
        )
    }

    pub(crate) fn crc(b: &[u8]) -> u32 {
        let mut c = Crc32c::new();
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
        run(Bytes(&wire), &l, 0, &queue, &flow, &c);
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
        run(Bytes(&wire), &link(), 0, &queue, &FlowStats::default(), &c);
        let out = outcomes(vec![ra, rb]);
        assert!(matches!(out[0].result, Err(FetchFailure::Crc { .. })));
        assert!(out[1].result.is_ok());
        assert_eq!(c.crc_failures.load(Ordering::Relaxed), 1);
        assert_eq!(c.shards_received.load(Ordering::Relaxed), 1);
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
            Bytes(&wire),
            &link(),
            2,
            &queue,
            &FlowStats::default(),
            &Counters::default(),
        );
        let out = outcomes(vec![ra, rb]);
        match &out[0].result {
            Err(FetchFailure::ConnectionLost { conn: 2, cause, .. }) => {
                assert!(cause.contains("closed after 1000 of 4096"), "{cause}")
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(&out[1].result, Err(FetchFailure::ConnectionLost { cause, .. }) if cause.starts_with("it failed earlier"))
        );
    }
}
