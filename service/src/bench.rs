//! `shardwire bench`: kperf-style ingest throughput on loopback. A source and a node run in
//! this process on synthetic `.bin` shards; a trainer thread takes and releases batches
//! for `--seconds`. Prints per-flow Rx lines, per-CPU usage and a summary; with
//! `--compare-tcp` it also runs plain TCP streams with the same flows and thread layout
//! (sendfile from the same files -> `recv` into a buffer, no CRC, no trainer) in the same
//! run and prints the ratio.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use shardwire_client::{Stream, StreamOptions};
use shardwire_config::{ByteSize, ReceiveMode};

use crate::demo::Loopback;
use crate::synth;

/// Flags of `shardwire bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Data connections (flows).
    #[arg(long, default_value_t = 4)]
    flows: u16,
    /// Measurement time per run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Shard size (e.g. 4MiB).
    #[arg(long, default_value = "4MiB", value_parser = |s: &str| s.parse::<ByteSize>())]
    shard_size: ByteSize,
    /// Also run plain TCP with the same layout and print the ratio.
    #[arg(long)]
    compare_tcp: bool,
    /// Stream region size (fetch-ahead window) [default: 32 slabs, 64MiB..1GiB].
    #[arg(long, value_parser = |s: &str| s.parse::<ByteSize>())]
    stream_memory: Option<ByteSize>,
    /// With --compare-tcp: alternate the two runs this many times and report every ratio
    /// and the median (a shared machine is noisy).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Receive path: host (plain TCP into the slab) or devmem-sim (the devmem path over
    /// the kernel-faithful emulator: frags into a memfd "dma-buf", gather, token return).
    #[arg(long, default_value = "host")]
    mode: ReceiveMode,
}

/// Per-CPU jiffies from /proc/stat: (user+nice, system, idle+iowait, irq+softirq, total).
fn cpu_times() -> Vec<[u64; 5]> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let g = |i: usize| v.get(i).copied().unwrap_or(0);
            [g(0) + g(1), g(2), g(3) + g(4), g(5) + g(6), v.iter().sum()]
        })
        .collect()
}

fn print_cpu(before: &[[u64; 5]], after: &[[u64; 5]]) {
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        let total = (a[4] - b[4]).max(1) as f64;
        let pct = |k: usize| (a[k] - b[k]) as f64 * 100.0 / total;
        println!(
            "  CPU{i:3}: usr:{:5.2}% sys:{:5.2}% idle:{:5.2}% irq:{:5.2}%",
            pct(0),
            pct(1),
            pct(2),
            pct(3)
        );
    }
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 * 8.0 / secs / 1e9
}

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> anyhow::Result<ExitCode> {
    crate::logging::init_filter("warn");
    anyhow::ensure!(
        a.flows >= 1 && a.flows <= 64,
        "--flows must be 1..=64, got {}",
        a.flows
    );
    anyhow::ensure!(
        a.mode != ReceiveMode::Devmem,
        "bench runs on loopback, which cannot carry devmem; use --mode host or devmem-sim"
    );
    let shard = a.shard_size.0 as usize;
    anyhow::ensure!(shard >= 4096, "--shard-size must be at least 4KiB");
    let count = ((256usize << 20) / shard).clamp(8, 64);
    let dir = synth::scratch_dir("bench")?;
    let data = dir.join("data");
    std::fs::create_dir_all(&data)?;
    for i in 0..count {
        synth::write_bin(&data.join(format!("s{i:04}.bin")), shard, i as u64)?;
    }
    let m = shardwire_index::index_dir(&data, &shardwire_index::IndexOptions::default())?;
    shardwire_index::write_manifest(&data, &m)?;
    let class = shardwire_gpu::SlabPool::class_size(shard) as u64;
    // Deep enough that in-order delivery (a slow head-of-line shard holds finished ones in
    // the reorder buffer) does not starve the flows: 32 slabs, like the service default.
    let stream_memory = a
        .stream_memory
        .map_or((class * 32).clamp(64 << 20, 1 << 30), |m| m.0);
    anyhow::ensure!(
        stream_memory >= 2 * class,
        "--stream-memory must be at least 2 slabs ({} bytes)",
        2 * class
    );
    println!(
        "bench: {} flows, {} s, {count} shards of {} bytes, CRC-32C on, delivered to a trainer, receive={}",
        a.flows, a.seconds, shard, a.mode
    );

    let result = (|| {
        let mut ratios = Vec::new();
        for round in 0..a.rounds.max(1) {
            if a.rounds > 1 {
                println!("-- round {}", round + 1);
            }
            let sw = run_shardwire(&a, &data, &dir, stream_memory)?;
            if a.compare_tcp {
                let files: Vec<_> = m.shards.iter().map(|s| data.join(&s.file)).collect();
                let tcp = run_tcp(&a, &files, shard)?;
                println!(
                    "ratio shardwire/tcp: {:.3} ({sw:.3} / {tcp:.3} Gbps)",
                    sw / tcp
                );
                ratios.push(sw / tcp);
            }
        }
        if ratios.len() > 1 {
            ratios.sort_by(f64::total_cmp);
            let list: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
            println!(
                "median ratio shardwire/tcp over {} rounds: {:.3} (sorted: {})",
                ratios.len(),
                ratios[ratios.len() / 2],
                list.join(" ")
            );
        }
        Ok::<_, anyhow::Error>(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    Ok(ExitCode::SUCCESS)
}

fn run_shardwire(
    a: &BenchArgs,
    data: &std::path::Path,
    dir: &std::path::Path,
    stream_memory: u64,
) -> anyhow::Result<f64> {
    let lb = Loopback::start(
        "bench",
        data,
        dir.join("trainer.sock"),
        a.flows,
        stream_memory,
        a.mode,
    )?;
    println!("== Source {}", lb.source_addr);
    let node = &lb.node.handle.node;
    println!("== Target {}", node.info().data_addr);
    let mut s = Stream::open(
        &lb.node.handle.socket,
        StreamOptions {
            epochs: 1_000_000,
            ..StreamOptions::new("bench")
        },
    )
    .context("opening the bench stream")?;
    // Warm up: one batch, so connections and the page cache are hot.
    if let Some(b) = s.next()? {
        s.release(b)?;
    }
    let flows0: Vec<u64> = node
        .flows()
        .iter()
        .map(|f| f.stats.bytes.load(Ordering::Relaxed))
        .collect();
    let cpu0 = cpu_times();
    let t0 = Instant::now();
    let mut delivered = 0u64;
    while t0.elapsed() < Duration::from_secs(a.seconds) {
        let Some(b) = s.next()? else { break };
        delivered += b.tensors().iter().map(|t| t.length).sum::<u64>();
        s.release(b)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu1 = cpu_times();
    let flows: Vec<(String, u16, u64)> = node
        .flows()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let bytes = f.stats.bytes.load(Ordering::Relaxed);
            (
                f.source.clone(),
                f.conn,
                bytes - flows0.get(i).copied().unwrap_or(0),
            )
        })
        .collect();
    let crc = node.counters().crc_failures.load(Ordering::Relaxed);
    if let Some(b) = node.binding_status() {
        println!(
            "devmem-sim: {} frags, {} tokens returned, pool exhausted {} times, {:?} of {} net_iovs free at the end",
            b.frags, b.tokens_returned, b.pool_exhausted, b.niovs_free, b.niovs
        );
    }
    drop(s);
    lb.stop();
    for (_, conn, bytes) in &flows {
        println!(
            "  Rx{:8.3} Gbps ({bytes} bytes in {} usec) flow {conn}",
            gbps(*bytes, secs),
            (secs * 1e6) as u64
        );
    }
    print_cpu(&cpu0, &cpu1);
    let g = gbps(delivered, secs);
    println!(
        "shardwire: {g:.3} Gbps delivered to the trainer ({delivered} bytes in {secs:.2} s), CRC failures: {crc}"
    );
    Ok(g)
}

fn run_tcp(a: &BenchArgs, files: &[std::path::PathBuf], shard: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for f in 0..a.flows {
        let files: Vec<std::fs::File> = files
            .iter()
            .map(std::fs::File::open)
            .collect::<Result<_, _>>()?;
        let stop_tx = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let sock = TcpStream::connect(addr)?;
            let mut i = f as usize;
            while !stop_tx.load(Ordering::Relaxed) {
                let file = &files[i % files.len()];
                let mut off = 0u64;
                while (off as usize) < shard {
                    let want = shard - off as usize;
                    let n = rustix::fs::sendfile(&sock, file, Some(&mut off), want)?;
                    if n == 0 {
                        break;
                    }
                }
                i += 1;
            }
            Ok(())
        }));
        let (mut conn, _) = listener.accept()?;
        let (stop, received) = (Arc::clone(&stop), Arc::clone(&received));
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; shard];
            while !stop.load(Ordering::Relaxed) {
                let n = conn.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    let r0 = received.load(Ordering::Relaxed);
    let cpu0 = cpu_times();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(a.seconds));
    let bytes = received.load(Ordering::Relaxed) - r0;
    let secs = t0.elapsed().as_secs_f64();
    let cpu1 = cpu_times();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    println!("== plain TCP, same flows and threads (sendfile -> recv, no CRC, no trainer)");
    print_cpu(&cpu0, &cpu1);
    let g = gbps(bytes, secs);
    println!("tcp: {g:.3} Gbps ({bytes} bytes in {secs:.2} s)");
    Ok(g)
}
