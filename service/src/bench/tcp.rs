//! The plain-TCP baselines of `shardwire bench --compare-tcp`: the same flows and thread
//! layout as shardwire (one sender thread per flow, `sendfile` from the same shard files; one
//! receiver thread per flow), without CRC, trainer or control path. Two placements:
//! `recv` into one hot buffer of a shard's size, or into a rotating region as large as the
//! stream's (each flow a share of it, shard-sized slots in turn), which separates the cost
//! of memory placement from shardwire's own work. `rate` paces every sender (bytes/s in all).

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How a plain-TCP run places and paces its bytes.
#[derive(Clone, Copy, Debug)]
pub struct TcpRun {
    /// Flows.
    pub flows: u16,
    /// Shard size.
    pub shard: usize,
    /// Receive into a rotating region of this many bytes (all flows) instead of one buffer.
    pub region: Option<usize>,
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

/// Sleeps until `sent` bytes at `rate` bytes/s are due since `started`.
fn pace(started: Instant, sent: u64, rate: u64) {
    if rate == 0 {
        return;
    }
    let due = Duration::from_secs_f64(sent as f64 / rate as f64);
    if let Some(wait) = due.checked_sub(started.elapsed()) {
        std::thread::sleep(wait);
    }
}

fn sender(
    sock: TcpStream,
    files: Vec<std::fs::File>,
    first: usize,
    r: TcpRun,
    stop: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let per_flow = r.rate / u64::from(r.flows);
    let started = Instant::now();
    let (mut i, mut sent) = (first, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let file = &files[i % files.len()];
        let mut off = 0u64;
        while (off as usize) < r.shard {
            let want = r.shard - off as usize;
            let n = rustix::fs::sendfile(&sock, file, Some(&mut off), want)?;
            if n == 0 {
                break;
            }
            sent += n as u64;
            pace(started, sent, per_flow);
        }
        i += 1;
    }
    Ok(())
}

fn receiver(
    mut conn: TcpStream,
    r: TcpRun,
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let slots = r
        .region
        .map_or(1, |b| (b / usize::from(r.flows) / r.shard).max(1));
    let mut buf = vec![0u8; slots * r.shard];
    let (mut slot, mut at) = (0usize, 0usize);
    while !stop.load(Ordering::Relaxed) {
        let base = slot * r.shard;
        let n = conn.read(&mut buf[base + at..base + r.shard])?;
        if n == 0 {
            break;
        }
        received.fetch_add(n as u64, Ordering::Relaxed);
        at += n;
        if at == r.shard {
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
    mut sample: impl FnMut(),
) -> anyhow::Result<Measured> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for f in 0..r.flows {
        let files: Vec<std::fs::File> = files
            .iter()
            .map(std::fs::File::open)
            .collect::<Result<_, _>>()?;
        let sock = TcpStream::connect(addr)?;
        let st = Arc::clone(&stop);
        threads.push(
            std::thread::Builder::new()
                .name(format!("tcp-send-{f}"))
                .spawn(move || sender(sock, files, f as usize, r, st))?,
        );
        let (conn, _) = listener.accept()?;
        let (st, rx) = (Arc::clone(&stop), Arc::clone(&received));
        threads.push(
            std::thread::Builder::new()
                .name(format!("tcp-recv-{f}"))
                .spawn(move || receiver(conn, r, st, rx))?,
        );
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
    for t in threads {
        let _ = t.join();
    }
    Ok(Measured { bytes, secs })
}
