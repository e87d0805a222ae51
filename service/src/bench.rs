//! `shardwire bench`: kperf-style ingest throughput on loopback. A source and a node run in
//! this process on synthetic `.bin` shards; a trainer thread takes and releases batches
//! for `--seconds`. Prints per-flow Rx lines, per-CPU usage, CPU seconds per GB delivered by
//! role (source send, node receive, trainer, ...) and a summary; with `--compare-tcp` it also
//! runs plain TCP with the same flows and thread layout ([`tcp`]: into one hot buffer, and
//! into a rotating region as large as the stream's) in the same run and prints the ratios.
//! `--rate` paces both to the same goodput, so their CPU per GB compares throughput-matched.

mod cpu;
mod tcp;

use std::process::ExitCode;
use std::sync::atomic::Ordering;
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
    /// Also measure the receive primitives into the stream-sized region, alternating in each
    /// round: the node's reader (`recv` with its SO_RCVLOWAT rule) against io_uring
    /// multishot receive into provided buffers (copied, or the region's own slots filled
    /// incrementally), with and without SO_RCVLOWAT; prints each one's ratio to the node's.
    #[arg(long)]
    compare_uring: bool,
    /// The node's plain-TCP data connections receive with io_uring (the service default);
    /// `--io-uring false`: with `recv`. `--compare-uring` runs the node both ways.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    io_uring: bool,
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
    /// Pace the sources (and plain TCP) to this goodput in Gbit/s, for CPU per GB at a
    /// matched rate (default: as fast as they go).
    #[arg(long)]
    rate: Option<f64>,
}

/// What one run measured: goodput, CPU seconds per GB over this process's threads (user +
/// system) and over all CPUs (busy time, softirq included).
struct Run {
    gbps: f64,
    cpu_per_gb: f64,
    all_per_gb: f64,
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

    let rate = a.rate.map_or(0, |g| (g * 1e9 / 8.0) as u64);
    let files: Vec<_> = m.shards.iter().map(|s| data.join(&s.file)).collect();
    let region = stream_memory as usize;
    let plain = |region, recv| tcp::TcpRun {
        flows: a.flows,
        shard,
        region,
        recv,
        rate,
        seconds: a.seconds,
    };
    let result = (|| {
        let (mut ratios, mut uring_rows) = (Vec::new(), Vec::new());
        for round in 0..a.rounds.max(1) {
            if a.rounds > 1 {
                println!("-- round {}", round + 1);
            }
            let sw = run_shardwire(&a, &data, &dir, stream_memory, rate, a.io_uring)?;
            if a.compare_uring {
                let other = run_shardwire(&a, &data, &dir, stream_memory, rate, !a.io_uring)?;
                let mut row = vec![node_ratio(a.io_uring, &sw, &other)];
                row.extend(compare_uring(&files, &plain, region)?);
                uring_rows.push(row);
            }
            if a.compare_tcp {
                ratios.push(compare_tcp(&sw, &files, &plain, region)?);
            }
        }
        print_tcp_medians(&ratios);
        print_uring_medians(&uring_rows);
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
    rate: u64,
    io_uring: bool,
) -> anyhow::Result<Run> {
    let lb = Loopback::start(
        "bench",
        data,
        dir.join("trainer.sock"),
        (a.flows, rate),
        stream_memory,
        (a.mode, io_uring),
    )?;
    println!(
        "== Source {} (node data connections: {})",
        lb.source_addr,
        if io_uring { "io_uring" } else { "recv" }
    );
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
    let (cpu0, threads0) = (cpu::cpu_times(), cpu::thread_times());
    let t0 = Instant::now();
    // The trainer runs in a named thread, so its CPU shows up as its own role.
    // The end sample is taken on that thread, while it still counts among the threads.
    let (s, delivered, secs, cpu1, threads1) = std::thread::scope(|sc| {
        std::thread::Builder::new()
            .name("bench-trainer".into())
            .spawn_scoped(sc, move || -> anyhow::Result<_> {
                let mut delivered = 0u64;
                while t0.elapsed() < Duration::from_secs(a.seconds) {
                    let Some(b) = s.next()? else { break };
                    delivered += b.tensors().iter().map(|t| t.length).sum::<u64>();
                    s.release(b)?;
                }
                let secs = t0.elapsed().as_secs_f64();
                Ok((s, delivered, secs, cpu::cpu_times(), cpu::thread_times()))
            })?
            .join()
            .map_err(|_| anyhow::anyhow!("the bench trainer thread panicked"))?
    })?;
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
    let busy = cpu::print_cpu(&cpu0, &cpu1);
    let cpu_per_gb = cpu::print_per_gb(&threads0, &threads1, delivered);
    let all_per_gb = busy / (delivered as f64 / 1e9);
    let g = gbps(delivered, secs);
    println!(
        "shardwire: {g:.3} Gbps delivered to the trainer ({delivered} bytes in {secs:.2} s), all CPUs {all_per_gb:.3} busy s/GB, CRC failures: {crc}"
    );
    Ok(Run {
        gbps: g,
        cpu_per_gb,
        all_per_gb,
    })
}

/// The median of `v` and `v` sorted.
fn median(mut v: Vec<f64>) -> (f64, Vec<f64>) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v)
}

/// The node with io_uring over the node with `recv` (goodput, CPU s/GB of the threads),
/// printed; `sw` ran with `io_uring`, `other` the other way.
fn node_ratio(io_uring: bool, sw: &Run, other: &Run) -> (f64, f64) {
    let (on, off) = if io_uring { (sw, other) } else { (other, sw) };
    let r = (on.gbps / off.gbps, on.cpu_per_gb / off.cpu_per_gb);
    println!(
        "ratio shardwire io_uring/recv: {:.3} ({:.3} / {:.3} Gbps), CPU s/GB (threads) {:.3}",
        r.0, on.gbps, off.gbps, r.1
    );
    r
}

/// One round of `--compare-tcp`: plain TCP into a hot buffer and into the region; returns
/// shardwire's ratios (goodput to hot, goodput to region, CPU s/GB threads, all CPUs).
fn compare_tcp(
    sw: &Run,
    files: &[std::path::PathBuf],
    plain: &impl Fn(Option<usize>, tcp::Recv) -> tcp::TcpRun,
    region: usize,
) -> anyhow::Result<[f64; 4]> {
    let hot = run_plain(plain(None, tcp::Recv::Read), files)?;
    let placed = run_plain(plain(Some(region), tcp::Recv::Read), files)?;
    println!(
        "ratio shardwire/tcp: {:.3} ({:.3} / {:.3} Gbps); shardwire/tcp-region: {:.3} ({:.3} Gbps); CPU s/GB shardwire/tcp: threads {:.2} ({:.3} / {:.3}), all CPUs {:.2} ({:.3} / {:.3})",
        sw.gbps / hot.gbps,
        sw.gbps,
        hot.gbps,
        sw.gbps / placed.gbps,
        placed.gbps,
        sw.cpu_per_gb / hot.cpu_per_gb,
        sw.cpu_per_gb,
        hot.cpu_per_gb,
        sw.all_per_gb / hot.all_per_gb,
        sw.all_per_gb,
        hot.all_per_gb
    );
    Ok([
        sw.gbps / hot.gbps,
        sw.gbps / placed.gbps,
        sw.cpu_per_gb / hot.cpu_per_gb,
        sw.all_per_gb / hot.all_per_gb,
    ])
}

fn print_tcp_medians(ratios: &[[f64; 4]]) {
    if ratios.len() < 2 {
        return;
    }
    let labels = [
        format!("median ratio shardwire/tcp over {} rounds", ratios.len()),
        "median ratio shardwire/tcp-region".into(),
        "median CPU s/GB shardwire/tcp (this process's threads, user + system)".into(),
        "median CPU s/GB shardwire/tcp (all CPUs busy, softirq included)".into(),
    ];
    for (k, label) in labels.iter().enumerate() {
        let (m, sorted) = median(ratios.iter().map(|r| r[k]).collect());
        let list: Vec<String> = sorted.iter().map(|r| format!("{r:.3}")).collect();
        println!("{label}: {m:.3} (sorted: {})", list.join(" "));
    }
}

/// A plain-TCP run (see [`tcp`]) with its CPU figures.
fn run_plain(r: tcp::TcpRun, files: &[std::path::PathBuf]) -> anyhow::Result<Run> {
    let mut samples = Vec::new();
    let m = tcp::run(r, files, || {
        samples.push((cpu::cpu_times(), cpu::thread_times()))
    })?;
    let [(c0, t0), (c1, t1)] =
        <[_; 2]>::try_from(samples).map_err(|_| anyhow::anyhow!("two CPU samples"))?;
    match r.region {
        None => println!(
            "== plain TCP, same flows and threads (sendfile -> {} into one hot buffer, no CRC, no trainer)",
            r.recv.label()
        ),
        Some(b) => println!(
            "== plain TCP ({}) into a rotating region of {b} bytes (shard-sized slots in turn, as the stream's region)",
            r.recv.label()
        ),
    }
    let busy = cpu::print_cpu(&c0, &c1);
    let cpu_per_gb = cpu::print_per_gb(&t0, &t1, m.bytes);
    let all_per_gb = busy / (m.bytes as f64 / 1e9);
    let g = gbps(m.bytes, m.secs);
    let name = match (r.region, r.recv) {
        (None, tcp::Recv::Read) => "tcp".to_string(),
        (Some(_), tcp::Recv::Read) => "tcp-region".to_string(),
        (_, recv) => format!("tcp-{}", recv.label()),
    };
    println!(
        "{name}: {g:.3} Gbps ({} bytes in {:.2} s), all CPUs {all_per_gb:.3} busy s/GB",
        m.bytes, m.secs
    );
    Ok(Run {
        gbps: g,
        cpu_per_gb,
        all_per_gb,
    })
}

/// The primitives `--compare-uring` measures, the node's reader first (the reference).
const URING_RUNS: [tcp::Recv; 5] = [
    tcp::Recv::Node,
    tcp::Recv::ReadLowat,
    tcp::Recv::UringInto,
    tcp::Recv::UringCopy { lowat: false },
    tcp::Recv::UringSlots { lowat: true },
];

/// One round of `--compare-uring`: each primitive into the region; returns (goodput,
/// CPU s/GB of the threads) ratios to the node's reader, in [`URING_RUNS`] order.
fn compare_uring(
    files: &[std::path::PathBuf],
    plain: &impl Fn(Option<usize>, tcp::Recv) -> tcp::TcpRun,
    region: usize,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let mut runs = Vec::new();
    for recv in URING_RUNS {
        runs.push(run_plain(plain(Some(region), recv), files)?);
    }
    let base = &runs[0];
    let row: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (r.gbps / base.gbps, r.cpu_per_gb / base.cpu_per_gb))
        .collect();
    let cells: Vec<String> = URING_RUNS
        .iter()
        .zip(&runs)
        .zip(&row)
        .skip(1)
        .map(|((recv, r), (g, c))| {
            format!(
                "{} {g:.3} ({:.3} Gbps, CPU s/GB {c:.2})",
                recv.label(),
                r.gbps
            )
        })
        .collect();
    println!(
        "ratio to node-recv ({:.3} Gbps, {:.3} s/GB): {}",
        base.gbps,
        base.cpu_per_gb,
        cells.join("; ")
    );
    Ok(row)
}

fn print_uring_medians(rows: &[Vec<(f64, f64)>]) {
    if rows.len() < 2 {
        return;
    }
    // Column 0: the node with io_uring over the node with recv; then the primitives.
    let labels = std::iter::once("shardwire io_uring/recv".to_string()).chain(
        URING_RUNS
            .iter()
            .skip(1)
            .map(|r| format!("{}/node-recv", r.label())),
    );
    for (k, label) in labels.enumerate() {
        let k = if k == 0 { 0 } else { k + 1 };
        let (goodput, _) = median(rows.iter().map(|r| r[k].0).collect());
        let (cpu, _) = median(rows.iter().map(|r| r[k].1).collect());
        println!(
            "median {label} over {} rounds: goodput {goodput:.3}, CPU s/GB (threads) {cpu:.3}",
            rows.len()
        );
    }
}
