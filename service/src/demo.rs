//! `shardwire demo`: a synthetic dataset (Arrow IPC and .npy shards) in a temp dir, a
//! source and a node service on loopback, one epoch consumed with the Rust client, every
//! batch checked byte for byte against the files, and a short summary. With `--lanes N` the
//! node has N lanes on 127.0.0.1, 127.0.0.2, ... and N trainers consume an epoch each, one per
//! lane, and the summary has each lane's figures (with `--receive devmem-sim`, its binding).

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use shardwire_client::{Stream, StreamOptions};
use shardwire_config::{ByteSize, ReceiveMode, ServeConfig};
use shardwire_protocol::Manifest;

use crate::out::outln;
use crate::synth;

/// Flags of `shardwire demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Keep the temp directory (dataset, socket) afterwards.
    #[arg(long)]
    keep: bool,
    /// Show service logs (otherwise only warnings).
    #[arg(long)]
    verbose: bool,
    /// Receive path: host, or devmem-sim (the devmem path over the emulator).
    #[arg(long, default_value = "host")]
    receive: ReceiveMode,
    /// Lanes on loopback addresses 127.0.0.1, 127.0.0.2, ...; one trainer per lane.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    lanes: u8,
}

/// A source and a node on loopback, running in this process.
pub struct Loopback {
    /// The node with its HTTP fronts.
    pub node: crate::serve::Service,
    /// Source control address.
    pub source_addr: std::net::SocketAddr,
    stop_source: tokio::sync::watch::Sender<bool>,
    /// Runtime that runs both.
    pub rt: tokio::runtime::Runtime,
}

impl Loopback {
    /// Starts a source serving `name=dir` and a node using it, with `lanes` host-memory lanes
    /// on loopback addresses 127.0.0.1, 127.0.0.2, ... (each its own data port).
    pub fn start(
        name: &str,
        dir: &std::path::Path,
        socket: PathBuf,
        (flows, rate_limit, lanes): (u16, u64, u8),
        stream_memory: u64,
        (receive, io_uring): (ReceiveMode, bool),
    ) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let mut datasets = shardwire_source::Datasets::default();
        datasets.add(name, dir)?;
        let scfg = shardwire_source::SourceConfig {
            listen: "127.0.0.1:0".parse()?,
            secret: None,
            rate_limit,
            fault_corrupt: 0,
            fault_wrong_lane: 0,
            devmem_tx: Default::default(),
            idle_timeout: shardwire_source::DEFAULT_IDLE_TIMEOUT,
            max_connections: shardwire_source::DEFAULT_MAX_CONNECTIONS,
            drain_timeout: shardwire_source::DEFAULT_DRAIN_TIMEOUT,
        };
        let src = rt.block_on(shardwire_source::Source::bind(scfg, datasets))?;
        let source_addr = src.local_addr();
        let (stop_source, rx) = tokio::sync::watch::channel(false);
        rt.spawn(src.serve(rx));
        let socket_dir = socket
            .parent()
            .map_or_else(|| dir.to_path_buf(), std::path::Path::to_path_buf);
        let cfg = ServeConfig {
            sources: vec![source_addr.to_string()],
            socket,
            data_listen: "127.0.0.1:0".parse()?,
            admin: "127.0.0.1:0".parse()?,
            pool_size: ByteSize(stream_memory),
            stream_memory: Some(ByteSize(stream_memory)),
            lanes: shardwire_config::Lanes::Table(
                (1..=lanes)
                    .map(|i| shardwire_config::LaneConfig {
                        data_listen: Some(std::net::SocketAddr::from(([127, 0, 0, i], 0))),
                        ..Default::default()
                    })
                    .collect(),
            ),
            flows,
            receive,
            io_uring,
            // The demo and bench consume with the Rust client, which maps host regions only;
            // on a GPU host `auto` would pick CUDA memory (scripts/gpu-check.sh covers that).
            memory: shardwire_config::MemoryMode::Host,
            // Its own journal: the default is a running node's, which a start restores (undoing
            // that node's NIC setup under it).
            nic_state_file: socket_dir.join("nic-state.json"),
            ..ServeConfig::default()
        };
        cfg.validate()?;
        let node = rt.block_on(crate::serve::start(cfg))?;
        Ok(Self {
            node,
            source_addr,
            stop_source,
            rt,
        })
    }

    /// Stops both.
    pub fn stop(self) {
        self.node.handle.shutdown();
        let _ = self.stop_source.send(true);
        self.rt.shutdown_timeout(std::time::Duration::from_secs(2));
    }
}

/// Runs the demo.
pub fn run(a: DemoArgs) -> anyhow::Result<ExitCode> {
    crate::logging::init_filter(if a.verbose { "info" } else { "warn" });
    // A source and a node in one process, as `serve` and `source` raise theirs.
    crate::limits::raise_open_files();
    anyhow::ensure!(
        matches!(a.receive, ReceiveMode::Host | ReceiveMode::DevmemSim),
        "the demo runs on loopback, which cannot carry devmem (--receive {}); use --receive host or devmem-sim",
        a.receive
    );
    // Removed when the demo ends, however it ends (a panic included), unless `--keep`.
    let scratch = synth::Scratch::new("demo", a.keep)?;
    demo(&scratch.dir, a.receive, a.lanes)
}

fn demo(dir: &std::path::Path, receive: ReceiveMode, lanes: u8) -> anyhow::Result<ExitCode> {
    let data = dir.join("data");
    std::fs::create_dir_all(&data)?;
    for i in 0..4u64 {
        synth::write_arrow(&data.join(format!("part-{i}.arrow")), 2, 256, 64, i)?;
    }
    for i in 0..4u64 {
        synth::write_npy_f32(&data.join(format!("emb-{i}.npy")), &[128, 96], i + 10)?;
    }
    let manifest = shardwire_index::index_dir(&data, &shardwire_index::IndexOptions::default())?;
    shardwire_index::write_manifest(&data, &manifest)?;
    outln!(
        "dataset: {} shards, {} bytes in {}",
        manifest.shards.len(),
        manifest.total_bytes,
        data.display()
    );

    let lb = Loopback::start(
        "demo",
        &data,
        dir.join("trainer.sock"),
        (2, 0, lanes),
        64 << 20,
        (receive, true),
    )?;
    outln!(
        "source on {}, node data port {}, admin http://{}",
        lb.source_addr,
        lb.node.handle.node.info().data_addr,
        lb.node.admin_addr
    );
    outln!("mode: {}", lb.node.handle.node.info().mode_reason());
    let started = Instant::now();
    let checked = consume_every_lane(&lb.node.handle.socket, &data, &manifest, lanes);
    let secs = started.elapsed().as_secs_f64();
    print_lanes(&lb.node.handle.node.status());
    let c = lb.node.handle.node.counters();
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    let crc_failures = load(&c.crc_failures);
    let (uring, recv) = (load(&c.io_uring_connections), load(&c.recv_connections));
    lb.stop();
    if uring + recv > 0 {
        outln!("data connections: {uring} with io_uring multishot receive, {recv} with recv");
    }
    let (shards, bytes) = checked?;
    outln!(
        "demo ok: {shards} shards, {bytes} bytes verified against the files in {:.3} s ({:.3} Gbit/s), CRC failures: {crc_failures}",
        secs,
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(ExitCode::SUCCESS)
}

/// One trainer per lane: `lanes` streams opened first (each goes to the least loaded lane, so
/// one per lane), then each consumes an epoch on its own thread; (shards, bytes) of them all.
fn consume_every_lane(
    socket: &std::path::Path,
    data: &std::path::Path,
    m: &Manifest,
    lanes: u8,
) -> anyhow::Result<(usize, u64)> {
    let streams = (0..lanes)
        .map(|i| {
            let opts = StreamOptions {
                seed: 7 + u64::from(i),
                ..StreamOptions::new("demo")
            };
            Stream::open(socket, opts).context("opening a demo stream")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::thread::scope(|scope| {
        let runs: Vec<_> = streams
            .into_iter()
            .map(|s| scope.spawn(move || consume_and_check(s, data, m)))
            .collect();
        runs.into_iter().try_fold((0, 0), |(n, b), r| {
            let (shards, bytes) = r.join().expect("a demo trainer does not panic")?;
            Ok((n + shards, b + bytes))
        })
    })
}

/// Each lane's figures: data connections, bytes, and its binding's frags and tokens.
fn print_lanes(st: &shardwire_node::Status) {
    for l in &st.lanes {
        let binding = match &l.binding {
            Some(b) => format!(
                ", binding {} on {} queues {:?}: {} frags, {} tokens returned, {} steering errors",
                b.binding, b.interface, b.queues, b.frags, b.tokens_returned, b.steering_errors
            ),
            None => String::new(),
        };
        outln!(
            "lane {} ({}): {} data connections, {} bytes received{binding}",
            l.lane,
            l.data_addr,
            l.data_connections,
            l.bytes_received
        );
    }
}

fn consume_and_check(
    mut s: Stream,
    data: &std::path::Path,
    m: &Manifest,
) -> anyhow::Result<(usize, u64)> {
    let mut seen: BTreeMap<u32, usize> = BTreeMap::new();
    let mut bytes = 0u64;
    let mut files = BTreeMap::new();
    // The training loop: each batch is given back on the request for the next ones, which
    // the stream sends ahead of time.
    let mut next = s.next()?;
    while let Some(b) = next {
        let Some(entry) = m.shards.get(b.shard as usize) else {
            bail!(
                "batch {} names shard {}, which the manifest does not have",
                b.index,
                b.shard
            );
        };
        if entry.tensors.len() != b.tensors().len() {
            bail!(
                "batch {} (shard {}) has {} tensors; the manifest says {}",
                b.index,
                b.shard,
                b.tensors().len(),
                entry.tensors.len()
            );
        }
        let f = match files.get(&entry.file) {
            Some(f) => f,
            None => files
                .entry(entry.file.clone())
                .or_insert(std::fs::File::open(data.join(&entry.file))?),
        };
        for (t, v) in entry.tensors.iter().zip(b.tensors()) {
            let mut want = vec![0u8; t.length as usize];
            f.read_exact_at(&mut want, t.offset)?;
            if b.bytes(v) != want.as_slice() || v.name != t.name || v.shape != t.shape {
                bail!(
                    "batch {} (shard {}, tensor {}) differs from the file",
                    b.index,
                    b.shard,
                    t.name
                );
            }
            bytes += t.length;
        }
        *seen.entry(b.shard).or_default() += 1;
        next = s.next_after(b)?;
    }
    if seen.len() != m.shards.len() || seen.values().any(|&c| c != 1) {
        bail!("expected every shard exactly once, got {seen:?}");
    }
    Ok((seen.len(), bytes))
}
