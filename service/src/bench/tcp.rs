//! The plain-TCP baselines of `shardwire bench --compare-tcp`: the same flows and thread
//! layout as shardwire (one sender thread per flow, `sendfile` from the same shard files; one
//! receiver thread per flow), without CRC, trainer or control path. Two placements:
//! `recv` into one hot buffer of a shard's size, or into a rotating region as large as the
//! stream's (each flow a share of it, shard-sized slots in turn), which separates the cost
//! of memory placement from shardwire's own work. `rate` paces every sender (bytes/s in all)
//! in pieces of 50 ms of its share, as the source paces its data connections.
//! The receive primitive is chosen by [`Recv`]: `recv` as it comes, the node's own
//! data-connection reader, or io_uring multishot receive into provided buffers
//! (`shardwire_devmem::uring`), so the primitives compare with everything else equal.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use shardwire_devmem::uring::bench::{Buffers, MultishotRecv, Received, RecvInto};
use shardwire_node::bench::{PayloadRead, Plain, RCVLOWAT};

/// How a plain-TCP receiver takes its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recv {
    /// `recv` of the rest of the slot at the kernel's default mark (1 byte).
    Read,
    /// `recv` of the rest of the slot with `SO_RCVLOWAT` at [`RCVLOWAT`].
    ReadLowat,
    /// The node's data-connection reader ([`Plain`]): `recv` of the rest of the slot with
    /// its `SO_RCVLOWAT` rule, as the node's `recv` path reads the rest of a payload.
    Node,
    /// io_uring multishot receive into 64 KiB provided buffers, each copied into the slot
    /// (`lowat`: with `SO_RCVLOWAT` at [`RCVLOWAT`]).
    UringCopy { lowat: bool },
    /// io_uring multishot receive whose incremental provided buffers are the region's
    /// slots: the kernel places the bytes, no copy (`lowat` as above).
    UringSlots { lowat: bool },
    /// [`RecvInto`] one slot at a time, the `SO_RCVLOWAT` of the node's rule for a whole slot
    /// set once per slot (one payload posted at a time, unlike the node's queue).
    UringInto,
    /// With CRC-32C of every shard, checksummed where [`super::crc::Way`] says.
    Crc(super::crc::Way),
}

impl Recv {
    /// The name of a run with this primitive.
    pub fn label(self) -> String {
        let s = match self {
            Self::Read => "recv",
            Self::ReadLowat => "recv-lowat",
            Self::Node => "node-recv",
            Self::UringCopy { lowat: false } => "uring-copy",
            Self::UringCopy { lowat: true } => "uring-copy-lowat",
            Self::UringSlots { lowat: false } => "uring-slots",
            Self::UringSlots { lowat: true } => "uring-slots-lowat",
            Self::UringInto => "uring-into",
            Self::Crc(way) => return way.label(),
        };
        s.to_string()
    }
}

/// The files' CRCs for `Recv::Crc` runs, and what the receivers' checksums saw.
#[derive(Default)]
pub struct CrcCheck {
    /// CRC-32C of each file, in the order the senders cycle through them.
    pub crcs: Vec<u32>,
    /// The receivers' results.
    pub stats: super::crc::CrcStats,
}

/// How a plain-TCP run places and paces its bytes.
#[derive(Clone, Copy, Debug)]
pub struct TcpRun {
    /// Flows.
    pub flows: u16,
    /// Shard size.
    pub shard: usize,
    /// Receive into a rotating region of this many bytes (all flows) instead of one buffer.
    pub region: Option<usize>,
    /// The receive primitive.
    pub recv: Recv,
    /// Total send rate in bytes/s (0: unlimited).
    pub rate: u64,
    /// Measured time.
    pub seconds: u64,
}

/// What a run measured.
#[derive(Debug)]
pub struct Measured {
    /// Bytes received in the measured time.
    pub bytes: u64,
    /// Measured time.
    pub secs: f64,
}

/// The longest a paced sender sleeps before it looks at the run's stop again.
const PACE_STEP: Duration = Duration::from_millis(50);

/// Sleeps until `sent` bytes at `rate` bytes/s are due since `started`, in steps of at most
/// [`PACE_STEP`]; returns early once `stop` is set (at a low rate the wait for a piece can
/// outlast the run, whose end joins the senders).
fn pace(started: Instant, sent: u64, rate: u64, stop: &AtomicBool) {
    if rate == 0 {
        return;
    }
    let due = Duration::from_secs_f64(sent as f64 / rate as f64);
    while let Some(wait) = due.checked_sub(started.elapsed()) {
        if wait.is_zero() || stop.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(wait.min(PACE_STEP));
    }
}

/// The most one `sendfile` sends of a `shard`: all of it unpaced (`rate` 0); paced, 50 ms of
/// `rate` (bytes/s) within 4 KiB..1 MiB, as the source's paced pieces (so that the goodput
/// is not counted in whole shards per flow).
fn piece(shard: usize, rate: u64) -> usize {
    match rate {
        0 => shard,
        r => usize::try_from((r / 20).clamp(4096, 1 << 20)).map_or(shard, |p| p.min(shard)),
    }
}

/// One flow's share of `rate` bytes/s (0: unlimited) over `flows`: at least 1 byte/s, so a
/// rate below the flow count does not read as unlimited (as the source's `per_flow_rate`).
fn per_flow_rate(rate: u64, flows: u16) -> u64 {
    match rate {
        0 => 0,
        r => (r / u64::from(flows.max(1))).max(1),
    }
}

fn sender(
    sock: TcpStream,
    files: Arc<[std::fs::File]>,
    first: usize,
    r: TcpRun,
    stop: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let per_flow = per_flow_rate(r.rate, r.flows);
    let piece = piece(r.shard, per_flow);
    let started = Instant::now();
    let (mut i, mut sent) = (first, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let file = &files[i % files.len()];
        let mut off = 0u64;
        while (off as usize) < r.shard && !stop.load(Ordering::Relaxed) {
            let want = (r.shard - off as usize).min(piece);
            let n = rustix::fs::sendfile(&sock, file, Some(&mut off), want)?;
            if n == 0 {
                break;
            }
            sent += n as u64;
            pace(started, sent, per_flow, &stop);
        }
        i += 1;
    }
    Ok(())
}

fn receiver(
    conn: TcpStream,
    r: TcpRun,
    (flow, check): (usize, Arc<CrcCheck>),
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let slots = r
        .region
        .map_or(1, |b| (b / usize::from(r.flows) / r.shard).max(1));
    match r.recv {
        Recv::Crc(way) => {
            let c = super::crc::Check {
                crcs: &check.crcs,
                flow,
                stats: &check.stats,
            };
            super::crc::receive(conn, way, r.shard, slots, &c, &stop, &received)
        }
        Recv::Read | Recv::ReadLowat => {
            if r.recv == Recv::ReadLowat {
                shardwire_devmem::set_rcvlowat(conn.as_fd(), RCVLOWAT)?;
            }
            let mut conn = conn;
            read_loop(|b| conn.read(b), r.shard, slots, &stop, &received)
        }
        Recv::Node => {
            let mut conn = Plain::new(conn);
            read_loop(|b| conn.read_some(b), r.shard, slots, &stop, &received)
        }
        Recv::UringCopy { lowat } => {
            let mut rx = uring(
                conn,
                Buffers::Copy {
                    len: 64 << 10,
                    count: 64,
                },
                lowat,
            )?;
            let mut buf = vec![0u8; slots * r.shard];
            let mut at = 0usize;
            multishot_loop(&mut rx, &stop, &received, |p| {
                // The stream's bytes in turn, wrapping around the region.
                let mut data = p.data;
                while !data.is_empty() {
                    let k = data.len().min(buf.len() - at);
                    buf[at..at + k].copy_from_slice(&data[..k]);
                    (at, data) = ((at + k) % buf.len(), &data[k..]);
                }
            })
        }
        Recv::UringInto => uring_into(conn, r, slots, &stop, &received),
        Recv::UringSlots { lowat } => {
            // A ring holds a power of two of slots.
            let count_slots = 1u16 << (usize::BITS - 1 - slots.min(1 << 15).leading_zeros());
            let len = u32::try_from(r.shard).map_err(std::io::Error::other)?;
            let mut rx = uring(
                conn,
                Buffers::Slots {
                    len,
                    count: count_slots,
                },
                lowat,
            )?;
            multishot_loop(&mut rx, &stop, &received, |_| {})
        }
    }
}

/// Waits on `rx` until the peer closes or `stop`, handing each piece to `f` and counting it.
fn multishot_loop(
    rx: &mut MultishotRecv,
    stop: &AtomicBool,
    received: &AtomicU64,
    mut f: impl FnMut(Received<'_>),
) -> std::io::Result<()> {
    while !stop.load(Ordering::Relaxed) {
        let n = rx.wait(&mut f)?;
        if n == 0 {
            break;
        }
        received.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// [`RecvInto`] into shard-sized slots in turn, the mark the node's rule gives a whole slot.
fn uring_into(
    conn: TcpStream,
    r: TcpRun,
    slots: usize,
    stop: &AtomicBool,
    received: &AtomicU64,
) -> std::io::Result<()> {
    let rx_lowat = shardwire_node::bench::lowat_for(r.shard);
    shardwire_devmem::set_rcvlowat(conn.as_fd(), rx_lowat)?;
    let mut rx = RecvInto::new(conn)?;
    let mut buf = vec![0u8; slots * r.shard];
    let mut slot = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let dst = &mut buf[slot * r.shard..(slot + 1) * r.shard];
        match rx.recv(dst, Duration::from_secs(60), |_, p| {
            received.fetch_add(p.len() as u64, Ordering::Relaxed);
        }) {
            Ok(()) => slot = (slot + 1) % slots,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn uring(conn: TcpStream, b: Buffers, lowat: bool) -> std::io::Result<MultishotRecv> {
    if lowat {
        shardwire_devmem::set_rcvlowat(conn.as_fd(), RCVLOWAT)?;
    }
    MultishotRecv::new(conn, b)
}

/// `read` into shard-sized slots in turn until the peer closes or `stop`.
fn read_loop(
    mut read: impl FnMut(&mut [u8]) -> std::io::Result<usize>,
    shard: usize,
    slots: usize,
    stop: &AtomicBool,
    received: &AtomicU64,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; slots * shard];
    let (mut slot, mut at) = (0usize, 0usize);
    while !stop.load(Ordering::Relaxed) {
        let base = slot * shard;
        let n = read(&mut buf[base + at..base + shard])?;
        if n == 0 {
            break;
        }
        received.fetch_add(n as u64, Ordering::Relaxed);
        at += n;
        if at == shard {
            (slot, at) = ((slot + 1) % slots, 0);
        }
    }
    Ok(())
}

/// Runs plain TCP as `r` says over `files`; returns what it received while measured (CPU
/// is sampled by `sample` at the start and the end of the measured time).
pub fn run(
    r: TcpRun,
    files: &[std::path::PathBuf],
    check: &Arc<CrcCheck>,
    mut sample: impl FnMut(),
) -> anyhow::Result<Measured> {
    // Opened once for every sender: `sendfile` with an explicit offset leaves a file's position
    // alone, so the flows share them (a set per flow took flows x shards fds: EMFILE).
    let opened: Arc<[std::fs::File]> = files
        .iter()
        .map(std::fs::File::open)
        .collect::<Result<Vec<_>, _>>()?
        .into();
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    let flows = (&opened, check, &stop, &received);
    if let Err(e) = start_flows(r, flows, &mut threads) {
        // The flows started so far end as at the stop (their listener is closed by now).
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        return Err(e);
    }
    std::thread::sleep(Duration::from_millis(300));
    let r0 = received.load(Ordering::Relaxed);
    sample();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(r.seconds));
    let bytes = received.load(Ordering::Relaxed) - r0;
    let secs = t0.elapsed().as_secs_f64();
    sample();
    stop.store(true, Ordering::Relaxed);
    // A primitive that failed (io_uring under a seccomp policy, an older kernel) is an
    // error naming it, not a measurement of 0 Gbit/s. A sender's broken pipe after the stop
    // is the receivers closing, as they do.
    let mut failed = None;
    for t in threads {
        let name = t.thread().name().unwrap_or("tcp thread").to_owned();
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) if name.starts_with("tcp-send") && closed_by_peer(&e) => {}
            Ok(Err(e)) => failed = failed.or(Some(format!("{name}: {e}"))),
            Err(_) => failed = failed.or(Some(format!("{name} panicked"))),
        }
    }
    if let Some(why) = failed {
        anyhow::bail!("plain TCP ({:?}) failed: {why}", r.recv);
    }
    anyhow::ensure!(
        bytes > 0,
        "plain TCP ({:?}) received nothing in {secs:.1} s",
        r.recv
    );
    Ok(Measured { bytes, secs })
}

/// What the threads of a plain-TCP run share: the shard files, the CRC check, the stop and
/// the count of bytes received.
type Shared<'a> = (
    &'a Arc<[std::fs::File]>,
    &'a Arc<CrcCheck>,
    &'a Arc<AtomicBool>,
    &'a Arc<AtomicU64>,
);

/// Starts `r.flows` sender and receiver threads over loopback, pushing each onto `threads`.
fn start_flows(
    r: TcpRun,
    (files, check, stop, received): Shared<'_>,
    threads: &mut Vec<std::thread::JoinHandle<std::io::Result<()>>>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    for f in 0..r.flows {
        let start = |what: &str| format!("starting plain TCP flow {f} ({what})");
        let sock = TcpStream::connect(addr).with_context(|| start("connect"))?;
        let (files, st) = (Arc::clone(files), Arc::clone(stop));
        threads.push(
            std::thread::Builder::new()
                .name(format!("tcp-send-{f}"))
                .spawn(move || sender(sock, files, f as usize, r, st))
                .with_context(|| start("sender thread"))?,
        );
        let (conn, _) = listener.accept().with_context(|| start("accept"))?;
        let (st, rx) = (Arc::clone(stop), Arc::clone(received));
        let flow = (f as usize, Arc::clone(check));
        threads.push(
            std::thread::Builder::new()
                .name(format!("tcp-recv-{f}"))
                .spawn(move || receiver(conn, r, flow, st, rx))
                .with_context(|| start("receiver thread"))?,
        );
    }
    Ok(())
}

/// Whether `e` is what a sender sees once its receiver has closed the connection.
fn closed_by_peer(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's open fds on files under `dir`.
    fn fds_under(dir: &std::path::Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with(dir)))
            .count()
    }

    #[test]
    fn the_senders_share_one_open_file_per_shard() {
        // Before: every flow opened every shard, flows x shards fds (at --flows 16 of 64
        // shards, EMFILE under a soft limit of 1024): 12 here.
        let dir = std::env::temp_dir().join(format!("sw-tcp-fds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dir = dir.canonicalize().unwrap();
        let shard = 64usize << 10;
        let files: Vec<_> = (0..3u8)
            .map(|i| {
                let p = dir.join(format!("s{i}.bin"));
                std::fs::write(&p, vec![i; shard]).unwrap();
                p
            })
            .collect();
        let r = TcpRun {
            flows: 4,
            shard,
            region: None,
            recv: Recv::Read,
            rate: 8 << 20, // paced: light on a small machine
            seconds: 1,
        };
        let mut open = Vec::new();
        let m = run(r, &files, &Arc::default(), || open.push(fds_under(&dir)));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(m.unwrap().bytes > 0);
        assert_eq!(open, [3, 3]);
    }

    #[test]
    fn a_rate_below_the_flow_count_still_paces_each_flow() {
        // Before: 3 bytes/s over 4 flows was 0 per flow, which `pace` reads as unlimited.
        assert_eq!(per_flow_rate(3, 4), 1);
        assert_eq!(per_flow_rate(0, 4), 0);
        assert_eq!(per_flow_rate(8_000, 4), 2_000);
    }

    #[test]
    fn a_paced_sender_sends_small_pieces_and_stops_waiting_at_the_stop() {
        // Before: a whole shard per sendfile, then a sleep until it was due (134 s for a 4 MiB
        // shard at 31 KB/s), deaf to the stop that ends the run.
        assert_eq!(piece(4 << 20, 0), 4 << 20);
        assert_eq!(piece(4 << 20, 31_250), 4096);
        assert_eq!(piece(4 << 20, 2_000_000), 100_000);
        assert_eq!(piece(4 << 20, u64::MAX), 1 << 20);
        assert_eq!(piece(8192, 1 << 30), 8192);
        let stop = Arc::new(AtomicBool::new(false));
        let set = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                stop.store(true, Ordering::Relaxed);
            })
        };
        let t = Instant::now();
        pace(Instant::now(), 4 << 20, 31_250, &stop);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        set.join().unwrap();
        // Unstopped, it still waits until the bytes are due.
        let t = Instant::now();
        pace(Instant::now(), 1000, 10_000, &AtomicBool::new(false));
        assert!(
            t.elapsed() >= Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
    }
}
