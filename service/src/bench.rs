//! `shardwire bench`: kperf-style ingest throughput on loopback. A source and a node run in
//! this process on synthetic `.bin` shards; a trainer thread takes and releases batches
//! for `--seconds` after 300 ms of warm-up (as plain TCP's). Prints per-flow Rx lines, per-CPU
//! usage, CPU seconds per GB delivered by role (source send, node receive, trainer, ...) and a
//! summary; with `--compare-tcp` it also runs plain TCP with the same flows and thread layout
//! ([`tcp`]: into one hot buffer, and into a rotating region as large as the stream's) in the
//! same run, right after shardwire's, and prints the ratios. `--rate` paces both to the same
//! goodput, so their CPU per GB compares throughput-matched.

mod cpu;
mod crc;
mod lanes;
mod report;
mod tcp;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use shardwire_client::{Stream, StreamOptions};
use shardwire_config::{ByteSize, ReceiveMode};
use shardwire_protocol::wire;

use self::report::{
    Run, compare_crc, compare_tcp, compare_uring, crc_ways, gbps, node_ratio, print_crc_medians,
    print_tcp_medians, print_uring_medians,
};
use crate::demo::Loopback;
use crate::out::outln;
use crate::synth;

/// Flags of `shardwire bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Data connections (flows).
    #[arg(long, default_value_t = 4)]
    flows: u16,
    /// Measurement time per run, in seconds (at least 1).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Shard size (e.g. 4MiB).
    #[arg(long, default_value = "4MiB", value_parser = |s: &str| s.parse::<ByteSize>())]
    shard_size: ByteSize,
    /// Also run plain TCP with the same layout and print the ratio.
    #[arg(long)]
    compare_tcp: bool,
    /// Also measure the receive primitives into the stream-sized region, alternating in each
    /// round (--mode host only: its paths): the node's reader (`recv` with its SO_RCVLOWAT
    /// rule) against io_uring multishot receive into provided buffers (copied, or the
    /// region's own slots filled incrementally), with and without SO_RCVLOWAT; prints each
    /// one's ratio to the node's.
    #[arg(long)]
    compare_uring: bool,
    /// Also measure where the CRC-32C of received bytes is computed, each way into the
    /// stream-sized region with every shard checked: in place after reads of the rest of the
    /// slot (the node's recv path), of 1 MiB and of 256 KiB; the node's io_uring queue with whole payloads (its
    /// path) and with pieces of 128 KiB / 256 KiB handed over a bounded window ahead;
    /// io_uring completions uncapped; through a 256 KiB bounce buffer copied on with
    /// non-temporal stores or `memcpy`; through a 64 KiB one with CRC and copy fused per
    /// 16 KiB. Prints each one's ratio to the first, and the power-of-two range of the median
    /// piece each checksum read.
    #[arg(long)]
    compare_crc: bool,
    /// With --compare-crc: only these ways (their labels as printed, e.g. `crc-queue`;
    /// repeatable). The first one named is the reference of the ratios.
    #[arg(long = "crc-way", requires = "compare_crc")]
    crc_ways: Vec<String>,
    /// The node's plain-TCP data connections (--mode host) receive with io_uring (the service
    /// default); `--io-uring false`: with `recv`. `--compare-uring` runs the node both ways.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    io_uring: bool,
    /// Stream region size (fetch-ahead window), at least 2 slabs [default: 32 slabs,
    /// 64MiB..1GiB, and at least 2 slabs].
    #[arg(long, value_parser = |s: &str| s.parse::<ByteSize>())]
    stream_memory: Option<ByteSize>,
    /// Run shardwire and each comparison asked for (--compare-*) in turn this many times (at
    /// least 1), and report every ratio and their median (a shared machine is noisy). One lane
    /// only.
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
    /// Run the node with this many host-memory lanes on loopback addresses 127.0.0.1 ..
    /// 127.0.0.N and one trainer per lane; prints each lane's goodput and the total (the
    /// comparisons are for one lane only).
    #[arg(long, default_value_t = 1)]
    lanes: u8,
}

/// The checks of `bench`'s flags that need no dataset.
pub(crate) fn check_args(a: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.flows >= 1 && a.flows <= 64,
        "--flows must be 1..=64, got {}",
        a.flows
    );
    anyhow::ensure!(
        a.seconds >= 1,
        "--seconds 0 measures nothing (one batch; plain TCP's baselines receive nothing and \
         fail): give at least 1"
    );
    anyhow::ensure!(
        a.rounds >= 1,
        "--rounds {} runs nothing (it is how many times to run shardwire and each comparison): \
         give at least 1 (the default)",
        a.rounds
    );
    // `auto` would probe (and bind) a real devmem-capable NIC for a loopback run.
    anyhow::ensure!(
        matches!(a.mode, ReceiveMode::Host | ReceiveMode::DevmemSim),
        "bench runs on loopback, which cannot carry devmem (--mode {}); use --mode host or \
         devmem-sim",
        a.mode
    );
    anyhow::ensure!(
        (1..=lanes::MAX_LANES).contains(&a.lanes),
        "--lanes must be 1..={}, got {}",
        lanes::MAX_LANES,
        a.lanes
    );
    // The node's own check (`flows` x lanes) comes after the dataset is written, naming keys.
    let session = u64::from(a.lanes) * u64::from(a.flows);
    anyhow::ensure!(
        session <= wire::MAX_SESSION_FLOWS,
        "--lanes {} x --flows {} is {session} data connections from the source, which dials \
         at most {} per node: lower --flows to at most {} or --lanes",
        a.lanes,
        a.flows,
        wire::MAX_SESSION_FLOWS,
        wire::MAX_SESSION_FLOWS / u64::from(a.lanes.max(1))
    );
    anyhow::ensure!(
        a.lanes == 1 || !(a.compare_tcp || a.compare_uring || a.compare_crc),
        "--lanes runs no comparisons: drop --compare-tcp, --compare-uring and --compare-crc"
    );
    anyhow::ensure!(
        a.lanes == 1 || a.rounds <= 1,
        "--lanes runs once (rounds are of the one-lane run and its comparisons): drop \
         --rounds {}, or run the --lanes bench again",
        a.rounds
    );
    check_mode_flags(a)?;
    if let Some(g) = a.rate {
        // Below about 1 byte/s (or not a number) the pacing rate would become 0: unlimited.
        anyhow::ensure!(
            g.is_finite() && g * 1e9 / 8.0 >= 1.0,
            "--rate is a goodput in Gbit/s above 0, got {g}"
        );
    }
    Ok(())
}

/// The flags only `--mode host` uses: devmem-sim connections receive from the lane's emulated
/// dma-buf binding, never with io_uring or `recv` (docs/CONFIGURATION.md `io_uring`).
fn check_mode_flags(a: &BenchArgs) -> anyhow::Result<()> {
    let host = matches!(a.mode, ReceiveMode::Host);
    anyhow::ensure!(
        host || !a.compare_uring,
        "--compare-uring compares the node's io_uring and recv paths, which only --mode host \
         uses (--mode {} receives from its emulated dma-buf binding): drop --compare-uring or \
         use --mode host",
        a.mode
    );
    anyhow::ensure!(
        host || a.io_uring,
        "--io-uring false chooses how --mode host receives; --mode {} never uses io_uring: \
         drop --io-uring",
        a.mode
    );
    Ok(())
}

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> anyhow::Result<ExitCode> {
    check_args(&a)?;
    let shard = a.shard_size.0 as usize;
    anyhow::ensure!(
        shard >= 4096,
        "--shard-size must be at least 4KiB, got {shard} bytes"
    );
    let count = ((256usize << 20) / shard).clamp(8, 64);
    let crc_ways = match a.compare_crc {
        true => crc_ways(&a.crc_ways)?,
        false => Vec::new(),
    };
    // Every flag is checked before any data is written; the scratch directory goes however
    // the run ends, short of a signal (Ctrl-C leaves it: `shardwire bench --help`).
    let stream_memory = stream_memory(a.stream_memory.map(|m| m.0), shard)?;
    crate::logging::init_filter("warn");
    // The source, the node and plain TCP all live here: shard files, and up to 5 fds per data
    // connection (lanes x flows of them), outgrow a soft limit of 1024.
    crate::limits::raise_open_files();
    let scratch = synth::Scratch::new("bench", false)?;
    let dir = scratch.dir.as_path();
    let data = dir.join("data");
    let m = write_dataset(&data, count, shard)?;
    outln!(
        "bench: {} flows, {} s, {count} shards of {} bytes, CRC-32C on, delivered to a trainer, receive={}{}",
        a.flows,
        a.seconds,
        shard,
        a.mode,
        match a.lanes {
            1 => String::new(),
            n => format!(", {n} lanes (flows per lane, one trainer each)"),
        }
    );
    outln!("cpu: {}", cpu::describe());

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
    if a.lanes > 1 {
        lanes::run(&a, &data, dir, stream_memory, rate)?;
        return Ok(ExitCode::SUCCESS);
    }
    let crcs: Vec<u32> = match a.compare_crc {
        true => files
            .iter()
            .map(|f| std::fs::read(f).map(|b| shardwire_protocol::crc::crc32c(&b)))
            .collect::<Result<_, _>>()?,
        false => Vec::new(),
    };
    let ways = (&plain, &crcs[..], &crc_ways[..]);
    rounds(
        &a,
        (&data, dir),
        (stream_memory, rate),
        (&files, region),
        ways,
    )?;
    Ok(ExitCode::SUCCESS)
}

/// A `bench` flag whose value cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum FlagError {
    /// The stream must hold one shard while the next one lands.
    #[error(
        "--stream-memory {given} bytes is under 2 slabs of a {shard}-byte shard: give at least \
         {min} bytes, or leave the flag out (its default is at least 2 slabs)"
    )]
    StreamMemory { given: u64, shard: usize, min: u64 },
}

/// The bench stream's memory: `given` (`--stream-memory`), else deep enough that in-order
/// delivery (a slow head-of-line shard holds finished ones in the reorder buffer) does not
/// starve the flows: 32 slabs, like the service default, within 64 MiB..1 GiB but never under
/// the 2 slabs a stream needs (a shard over 512 MiB).
fn stream_memory(given: Option<u64>, shard: usize) -> Result<u64, FlagError> {
    let class = shardwire_gpu::SlabPool::class_size(shard) as u64;
    let min = class.saturating_mul(2);
    match given {
        None => Ok(class.saturating_mul(32).clamp(64 << 20, 1 << 30).max(min)),
        Some(given) if given < min => Err(FlagError::StreamMemory { given, shard, min }),
        Some(given) => Ok(given),
    }
}

/// The one-lane rounds: shardwire, then each comparison asked for (plain TCP first: its
/// runs are shardwire's baselines), then their medians.
fn rounds<P: Fn(Option<usize>, tcp::Recv) -> tcp::TcpRun>(
    a: &BenchArgs,
    (data, dir): (&std::path::Path, &std::path::Path),
    (stream_memory, rate): (u64, u64),
    (files, region): (&[std::path::PathBuf], usize),
    (plain, crcs, crc_ways): (&P, &[u32], &[crc::Way]),
) -> anyhow::Result<()> {
    let (mut ratios, mut uring_rows, mut crc_rows) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        if a.rounds > 1 {
            outln!("-- round {}", round + 1);
        }
        let sw = run_shardwire(a, data, dir, stream_memory, rate, a.io_uring)?;
        // The baselines shardwire is divided by run right after it, so that the ratios
        // compare runs seconds apart, not the whole of the other comparisons apart.
        if a.compare_tcp {
            ratios.push(compare_tcp(&sw, files, plain, region)?);
        }
        if a.compare_uring {
            let other = run_shardwire(a, data, dir, stream_memory, rate, !a.io_uring)?;
            let mut row = vec![node_ratio(a.io_uring, &sw, &other)];
            row.extend(compare_uring(files, plain, region)?);
            uring_rows.push(row);
        }
        if a.compare_crc {
            crc_rows.push(compare_crc(files, plain, region, crcs, crc_ways)?);
        }
    }
    print_tcp_medians(&ratios);
    print_uring_medians(&uring_rows);
    print_crc_medians(&crc_rows, crc_ways);
    Ok(())
}

/// Writes `count` synthetic shards of `shard` bytes into `data` and indexes them.
fn write_dataset(
    data: &std::path::Path,
    count: usize,
    shard: usize,
) -> anyhow::Result<shardwire_protocol::manifest::Manifest> {
    std::fs::create_dir_all(data)?;
    for i in 0..count {
        synth::write_bin(&data.join(format!("s{i:04}.bin")), shard, i as u64)?;
    }
    let m = shardwire_index::index_dir(data, &shardwire_index::IndexOptions::default())?;
    shardwire_index::write_manifest(data, &m)?;
    Ok(m)
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
        (a.flows, rate, 1),
        stream_memory,
        (a.mode, io_uring),
    )?;
    let node = &lb.node.handle.node;
    outln!("== Target {}", node.info().data_addr);
    let mut s = Stream::open(
        &lb.node.handle.socket,
        StreamOptions {
            epochs: 1_000_000,
            ..StreamOptions::new("bench")
        },
    )
    .context("opening the bench stream")?;
    warm_up(&mut s)?;
    let counted = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let on_uring = counted(&node.counters().io_uring_connections);
    let way = connections_label(a.mode, on_uring, counted(&node.counters().recv_connections));
    outln!(
        "== Source {} (node data connections: {way})",
        lb.source_addr
    );
    anyhow::ensure!(
        !(io_uring && on_uring == 0 && a.compare_uring),
        "--compare-uring: the node's data connections fell back to recv (io_uring cannot be \
         set up here: see the node's warning), so there is nothing to compare"
    );
    // A reader gone (`| head`) stops the bench before its next measured run (`crate::out`).
    crate::out::check()?;
    let flows0 = flow_counts(&node.flows());
    let (cpu0, threads0) = (cpu::cpu_times(), cpu::thread_times());
    let (s, delivered, secs, cpu1, threads1) = trainer_window(s, a.seconds)?;
    let flows = flow_bytes_since(&node.flows(), &flows0);
    let crc = node.counters().crc_failures.load(Ordering::Relaxed);
    let stats: Vec<_> = node.flows().into_iter().map(|f| f.stats).collect();
    print_crc_hotness(shardwire_node::FlowStats::median_crc_piece(
        stats.iter().map(|s| &**s),
    ));
    print_bindings(node);
    drop(s);
    lb.stop();
    for (_, conn, bytes) in &flows {
        outln!(
            "  Rx{:8.3} Gbps ({bytes} bytes in {} usec) flow {conn}",
            gbps(*bytes, secs),
            (secs * 1e6) as u64
        );
    }
    let busy = cpu::print_cpu(&cpu0, &cpu1);
    let cpu_per_gb = cpu::print_per_gb(&threads0, &threads1, delivered);
    let all_per_gb = busy / (delivered as f64 / 1e9);
    let g = gbps(delivered, secs);
    outln!(
        "shardwire: {g:.3} Gbps delivered to the trainer ({delivered} bytes in {secs:.2} s), all CPUs {all_per_gb:.3} busy s/GB, CRC failures: {crc}"
    );
    Ok(Run {
        gbps: g,
        cpu_per_gb,
        all_per_gb,
    })
}

/// What the node's data connections received with, as it counted them (not the flags: where
/// io_uring cannot be set up the node falls back to `recv`, and says so). Devmem-sim ones
/// receive from the lane's emulated binding and are counted as neither.
fn connections_label(mode: ReceiveMode, on_uring: u64, on_recv: u64) -> &'static str {
    if matches!(mode, ReceiveMode::DevmemSim) {
        return "devmem-sim (frags from the emulated dma-buf binding)";
    }
    match (on_uring, on_recv) {
        (0, 0) => "none counted",
        (_, 0) => "io_uring",
        (0, _) => "recv",
        _ => "io_uring and recv",
    }
}

/// As long as plain TCP's warm-up ([`tcp`]): the window starts with the connections, the
/// page cache and the stream's fetch-ahead at speed.
const WARM_UP: Duration = Duration::from_millis(300);

/// Takes and gives back batches from `s` for [`WARM_UP`] (at least one batch).
fn warm_up(s: &mut Stream) -> anyhow::Result<()> {
    let t = Instant::now();
    let mut next = s.next()?;
    while let Some(b) = next {
        if t.elapsed() >= WARM_UP {
            s.release(b)?;
            break;
        }
        next = s.next_after(b)?;
    }
    Ok(())
}

/// What the trainer thread saw in a window of `seconds`: the stream (to drop after the
/// report), payload bytes delivered, the window's length, and the end samples of all CPUs and
/// of every thread. The trainer runs in a named thread, so its CPU shows up as its own role;
/// the end sample is taken on that thread, while it still counts among the threads.
type Window = (Stream, u64, f64, Vec<cpu::Jiffies>, cpu::ThreadTimes);

/// Reads and gives back batches from `s` for `seconds` on a thread named `bench-trainer`.
fn trainer_window(mut s: Stream, seconds: u64) -> anyhow::Result<Window> {
    let t0 = Instant::now();
    std::thread::scope(|sc| {
        std::thread::Builder::new()
            .name("bench-trainer".into())
            .spawn_scoped(sc, move || -> anyhow::Result<_> {
                let delivered = lanes::train(&mut s, t0, seconds)?;
                let secs = t0.elapsed().as_secs_f64();
                Ok((s, delivered, secs, cpu::cpu_times(), cpu::thread_times()))
            })?
            .join()
            .map_err(|_| anyhow::anyhow!("the bench trainer thread panicked"))?
    })
}

/// Each data flow's counters and the bytes received so far (the counters held, so that a
/// later flow's cannot take their place; a flow's place in the list moves when an ended one
/// is pruned).
type FlowCounts = Vec<(Arc<shardwire_node::FlowStats>, u64)>;

/// [`FlowCounts`] of `flows` now.
fn flow_counts(flows: &[shardwire_node::Flow]) -> FlowCounts {
    flows
        .iter()
        .map(|f| (Arc::clone(&f.stats), f.stats.bytes.load(Ordering::Relaxed)))
        .collect()
}

/// Each data flow's (source, connection, bytes received since `before`; a flow that began
/// since counts from 0).
fn flow_bytes_since(
    flows: &[shardwire_node::Flow],
    before: &FlowCounts,
) -> Vec<(String, u16, u64)> {
    flows
        .iter()
        .map(|f| {
            let bytes = f.stats.bytes.load(Ordering::Relaxed);
            let then = before.iter().find(|(s, _)| Arc::ptr_eq(s, &f.stats));
            (
                f.source.clone(),
                f.conn,
                bytes.saturating_sub(then.map_or(0, |t| t.1)),
            )
        })
        .collect()
}

/// One line per lane's devmem binding (`--mode devmem-sim`).
fn print_bindings(node: &shardwire_node::Node) {
    for b in node.binding_statuses() {
        outln!(
            "devmem-sim lane {} (binding {}): {} frags, {} tokens returned, {} steering errors, pool exhausted {} times, {:?} of {} net_iovs free at the end",
            b.lane,
            b.binding,
            b.frags,
            b.tokens_returned,
            b.steering_errors,
            b.pool_exhausted,
            b.niovs_free,
            b.niovs
        );
    }
}

/// Says how far behind the copy that placed them the node's CRC read the bytes: the median
/// piece (by bytes) checksummed right after it landed, as the power-of-two range it fell in,
/// against the L2 cache (hot up to a quarter of it: `protocol/examples/crc_speed.rs` measures
/// CRC speed after a copy).
fn print_crc_hotness(median: Option<usize>) {
    let Some(lo) = median else {
        outln!("crc: not computed on the CPU (GPU kernel, or nothing received)");
        return;
    };
    let l2 = cpu::l2_bytes();
    outln!(
        "crc: median piece checksummed right after landing {} (L2 {}): {}",
        crc::piece_range(lo),
        l2.map_or("unknown".into(), |b| format!("{} KiB", b >> 10)),
        match l2.map(|l2| hot(lo, l2)) {
            Some(true) => "hot (read from cache)",
            Some(false) => "cold (read back from memory or L3)",
            None => "unknown",
        }
    );
}

/// Whether a median piece in the power-of-two range `[lo, 2 lo)` was checksummed hot with
/// `l2` bytes of L2: the whole range within a quarter of it (the median may be anywhere in
/// it; judged by `lo` alone, a median of up to twice a quarter of L2 was called hot).
fn hot(lo: usize, l2: usize) -> bool {
    lo.saturating_mul(2) <= l2 / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bench`'s flags as the command line gives them.
    fn bench_args(flags: &[&str]) -> BenchArgs {
        #[derive(clap::Parser)]
        struct Bench {
            #[command(flatten)]
            a: BenchArgs,
        }
        let argv = std::iter::once("bench").chain(flags.iter().copied());
        <Bench as clap::Parser>::try_parse_from(argv).unwrap().a
    }

    #[test]
    fn more_lanes_x_flows_than_a_source_dials_is_refused_naming_the_flags() {
        // Before: passed, the dataset was written, then the node refused config key `flows`.
        let e = check_args(&bench_args(&["--lanes", "16", "--flows", "32"]))
            .unwrap_err()
            .to_string();
        for part in [
            "--lanes 16 x --flows 32",
            "512 data connections",
            "at most 16",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
        assert!(check_args(&bench_args(&["--lanes", "8", "--flows", "32"])).is_ok());
    }

    #[test]
    fn flags_the_run_would_ignore_or_fail_on_are_refused_before_it() {
        // Before: all taken. --rounds ran once with --lanes; --seconds 0 failed after the
        // shardwire run ("received nothing in 0.0 s"); devmem-sim --compare-uring wrote the
        // dataset, ran the node, then blamed an io_uring setup it never tried.
        // --rounds 0 ran one round.
        let refused: [(&[&str], &str); 5] = [
            (&["--lanes", "2", "--rounds", "3"], "drop --rounds 3"),
            (&["--rounds", "0"], "--rounds 0 runs nothing"),
            (&["--seconds", "0"], "--seconds 0 measures nothing"),
            (
                &["--mode", "devmem-sim", "--compare-uring"],
                "only --mode host",
            ),
            (
                &["--mode", "devmem-sim", "--io-uring", "false"],
                "never uses io_uring",
            ),
        ];
        for (flags, part) in refused {
            let e = check_args(&bench_args(flags)).unwrap_err().to_string();
            assert!(e.contains(part), "{flags:?}: {e}");
        }
        let taken: [&[&str]; 5] = [
            &["--lanes", "2", "--rounds", "1"],
            &["--rounds", "3"],
            &["--seconds", "1"],
            &["--mode", "devmem-sim"],
            &["--compare-uring", "--io-uring", "false"],
        ];
        for flags in taken {
            assert!(check_args(&bench_args(flags)).is_ok(), "{flags:?}");
        }
    }

    #[test]
    fn devmem_sim_connections_are_not_labelled_recv() {
        // Before: "node data connections: recv" for every devmem-sim run (it counts neither).
        let sim = connections_label(ReceiveMode::DevmemSim, 0, 0);
        assert!(sim.starts_with("devmem-sim"), "{sim}");
        assert_eq!(connections_label(ReceiveMode::Host, 4, 0), "io_uring");
        assert_eq!(connections_label(ReceiveMode::Host, 0, 4), "recv");
        assert_eq!(
            connections_label(ReceiveMode::Host, 3, 1),
            "io_uring and recv"
        );
    }

    #[test]
    fn the_default_stream_memory_holds_two_slabs_of_any_shard() {
        // Before: a shard over 512 MiB got the 1 GiB cap, then "at least 2 slabs" for a
        // flag nobody gave.
        assert_eq!(stream_memory(None, 1 << 30), Ok(2 << 30));
        assert_eq!(stream_memory(None, 600 << 20), Ok(2 << 30));
        assert_eq!(stream_memory(None, 4 << 20), Ok(128 << 20));
        assert_eq!(stream_memory(None, 4096), Ok(64 << 20));
        let e = stream_memory(Some(1 << 20), 4 << 20).unwrap_err();
        assert_eq!(
            e,
            FlagError::StreamMemory {
                given: 1 << 20,
                shard: 4 << 20,
                min: 8 << 20
            }
        );
        assert!(e.to_string().contains("at least 8388608 bytes"), "{e}");
        assert_eq!(stream_memory(Some(8 << 20), 4 << 20), Ok(8 << 20));
    }

    #[test]
    fn a_refused_stream_memory_writes_no_data() {
        // Before: 8 shards were written to $TMPDIR first, and left there by the error.
        let ours = format!("shardwire-bench-{}-", std::process::id());
        let left = || {
            std::fs::read_dir(std::env::temp_dir())
                .unwrap()
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with(&ours))
                .count()
        };
        let before = left();
        let a = bench_args(&["--shard-size", "4MiB", "--stream-memory", "1MiB"]);
        let e = run(a).unwrap_err();
        assert!(e.to_string().contains("--stream-memory"), "{e}");
        assert_eq!(left(), before, "a scratch directory was made");
    }

    fn flow(conn: u16, bytes: u64) -> shardwire_node::Flow {
        let stats = Arc::new(shardwire_node::FlowStats::default());
        stats.bytes.store(bytes, Ordering::Relaxed);
        shardwire_node::Flow {
            source: "s".into(),
            lane: 0,
            conn,
            stats,
        }
    }

    #[test]
    fn a_piece_is_hot_only_if_its_whole_range_is() {
        // A median of 256 KiB pieces lands in 256-512 KiB: against 1 MiB of L2 (hot up to
        // 256 KiB) it may be cold. Judged by the range's lower bound, it was "hot".
        assert!(!hot(256 << 10, 1 << 20));
        assert!(hot(128 << 10, 1 << 20));
        assert!(!hot(1 << 20, 2 << 20));
        assert!(hot(256 << 10, 2 << 20));
    }

    #[test]
    fn flows_are_paired_by_their_counters_not_their_place_in_the_list() {
        let (a, b) = (flow(0, 100), flow(1, 50));
        let before = flow_counts(&[a, b.clone()]);
        // `a` ended and was pruned, `c` began: before, `b` was measured against `a`'s
        // count (an underflow: a panic in a debug build, 1.8e19 bytes in a release one).
        b.stats.bytes.store(60, Ordering::Relaxed);
        let c = flow(2, 10);
        let got = flow_bytes_since(&[b, c], &before);
        assert_eq!(got, [("s".to_owned(), 1, 10), ("s".to_owned(), 2, 10)]);
    }
}
