//! Command-line interface: subcommands and their flags. Flags are the top configuration
//! layer (defaults < TOML file < SHARDWIRE_* environment < flags).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use shardwire_config::{ByteSize, LogFormat, MemoryMode, ServeConfig, SourceConfig};

/// GPU-direct data ingestion for ML training.
#[derive(Parser, Debug)]
#[command(name = "shardwire", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Build DIR/shardwire.manifest.json from the Arrow IPC (HF datasets), .npy, .bin, WebDataset
    /// .tar, MDS and Parquet files in DIR (Parquet is converted once into DIR/.shardwire-cache).
    /// DIR may be a URL (s3://bucket/prefix, gs://, az://, file:///dir, http(s)://): the objects
    /// are listed and read with ranged GETs (credentials and endpoint from the standard
    /// AWS_*/GOOGLE_*/AZURE_* environment), and the manifest, with each object's size and
    /// ETag, is written beside them.
    Index {
        /// Dataset directory or URL.
        #[arg(value_name = "DIR|URL")]
        dir: String,
        /// Write the manifest to this local file instead of beside the data (needed for
        /// read-only http(s) datasets).
        #[arg(long, value_name = "PATH")]
        manifest_out: Option<PathBuf>,
        /// Never show the progress line.
        #[arg(long)]
        quiet: bool,
        /// Serve only these Arrow columns (comma-separated, e.g. `--columns image,label`).
        #[arg(long, value_delimiter = ',')]
        columns: Option<Vec<String>>,
        /// Skip Arrow columns that cannot be served (each is named) instead of failing.
        #[arg(long)]
        skip_unsupported: bool,
        /// Read `.bin` files (other than Megatron `.bin/.idx` pairs) as raw token streams of
        /// this integer dtype (e.g. `uint16` for nanoGPT's train.bin).
        #[arg(long, value_name = "DTYPE", value_parser = parse_token_dtype)]
        tokens: Option<shardwire_protocol::DType>,
        /// With --tokens: documents end at (and include) this token id.
        #[arg(long, value_name = "ID", requires = "tokens")]
        eos: Option<u64>,
        /// Index files named for different splits (train.bin beside val.bin, train/ beside
        /// test/) as one dataset, where the names mislead (refused by default; not HF
        /// DatasetDict or load_dataset cache folders: index one split's folder).
        #[arg(long)]
        allow_mixed_splits: bool,
    },
    /// Serve datasets to node services.
    Source(SourceFlags),
    /// Run the node service.
    Serve(ServeFlags),
    /// Trainer stand-in: print one line per batch.
    Consume(consume::ConsumeArgs),
    /// Run everything on loopback on a small synthetic dataset and verify every batch.
    Demo(demo::DemoArgs),
    /// kperf-style ingest throughput test on loopback.
    ///
    /// Its synthetic shards go to $TMPDIR/shardwire-bench-PID-*, removed when the run ends,
    /// an error included; a run interrupted by a signal (Ctrl-C, SIGTERM) leaves them there.
    Bench(bench::BenchArgs),
    /// Show a node's state (read from its admin API).
    Status {
        /// Admin address of the node (not read from `SHARDWIRE_ADMIN`: that is the address
        /// `serve` and `source` listen on, and one exported for this command made a source
        /// started after it bind the node's port).
        #[arg(long, default_value = "127.0.0.1:7400")]
        admin: String,
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// Probe the network interfaces for devmem TCP (driver, queues, header split, trial bind).
    Nics {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Probe for CUDA GPUs (driver, devices, dma-buf and VMM support) and say what `auto` picks.
    Gpus {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the GPUs, the NICs and the lanes `serve` would pair them into (PCIe distance
    /// classes PIX/PXB/PHB/SYS, and why), from the sysfs PCI tree.
    Topology {
        /// Root of the sysfs tree to read [default: /sys; env SHARDWIRE_SYSFS_ROOT]; another
        /// host's tree is planned from its own GPUs, not this host's CUDA devices.
        #[arg(long)]
        sysfs_root: Option<PathBuf>,
        /// Print JSON: {"gpus": [...], "nics": [...], "lanes": [...]}.
        #[arg(long)]
        json: bool,
        /// A `serve` configuration file (its `lanes`, `data_listen`, `memory`, ...); without
        /// it, the defaults.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check or print configuration.
    #[command(subcommand)]
    Config(ConfigCmd),
}

#[derive(Subcommand, Debug)]
enum ConfigCmd {
    /// Validate a config file for `serve` (or `source` with --source-config): the file alone,
    /// over the built-in defaults. SHARDWIRE_* variables are not applied (`config print
    /// --config FILE` shows the file with them merged, as `serve` and `source` read it).
    Check {
        /// The TOML file.
        file: PathBuf,
        /// The file configures a shard source, not a node.
        #[arg(long)]
        source_config: bool,
    },
    /// Print the effective `serve` configuration (defaults < file < environment) as TOML-like JSON.
    Print {
        /// Optional TOML file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print the `source` configuration instead.
        #[arg(long)]
        source_config: bool,
    },
}

use crate::out::outln;
use crate::{bench, consume, demo, logging};

fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    match s {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(format!("`{other}` is not text or json")),
    }
}

fn parse_size(s: &str) -> Result<ByteSize, String> {
    s.parse()
}

/// Flags of `shardwire source`.
#[derive(Args, Debug, Serialize)]
pub struct SourceFlags {
    /// TOML configuration file.
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Control listen address [default: 0.0.0.0:7500].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<std::net::SocketAddr>,
    /// A dataset to serve, as NAME=DIR (repeatable).
    #[arg(long = "dataset")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    datasets: Vec<String>,
    /// File with the shared secret; without it only loopback peers are accepted.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    secret_file: Option<PathBuf>,
    /// Send rate limit in bytes/s (e.g. 100MiB), 0 = unlimited.
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    rate_limit: Option<ByteSize>,
    /// Fault injection for tests: flip one byte in each of the first N payloads sent.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    fault_corrupt: Option<u32>,
    /// Fault injection for tests: the first N data connections of a node's lane 0 dial its
    /// lane 1 address instead (the node refuses them).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    fault_wrong_lane: Option<u32>,
    /// Send with devmem TX from a dma-buf bound to this interface (repeatable: one binding per
    /// NIC; each data connection leaves by the NIC its lane is routed through and sends from
    /// that NIC's binding). Refused at start, with the kernel's reason, where a NIC cannot.
    #[arg(long)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    devmem_tx: Vec<String>,
    /// For tests on hosts without a devmem TX NIC: unbound buffers stand in for the
    /// --devmem-tx bindings (ordinary MSG_ZEROCOPY sends); everything else is the real path.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    devmem_tx_emulate: bool,
    /// TX dma-buf size per --devmem-tx interface [default: 64MiB].
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    devmem_tx_memory: Option<ByteSize>,
    /// Log format: text or json.
    #[arg(long, value_parser = parse_log_format)]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_format: Option<LogFormat>,
    /// Seconds a node session may be silent before it is dropped [default: 60].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    idle_timeout_secs: Option<u64>,
    /// Disk cache for object-storage datasets (needs --cache-size).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_dir: Option<PathBuf>,
    /// Size of the disk cache per dataset (e.g. 500GiB).
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_size: Option<ByteSize>,
    /// GETs in flight per bucket at most [default: 32].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    object_store_max_inflight: Option<usize>,
    /// Largest ranged GET [default: 8MiB].
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    object_store_request_size: Option<ByteSize>,
    /// Admin HTTP address (/v1/status, /metrics).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    admin: Option<std::net::SocketAddr>,
    /// On SIGTERM: seconds to finish the queued FETCHes before exiting anyway [default: 30].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    drain_timeout_secs: Option<u64>,
}

/// Flags of `shardwire serve`.
#[derive(Args, Debug, Serialize)]
pub struct ServeFlags {
    /// TOML configuration file.
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// A shard source: its control address HOST:PORT, or dns:NAME:PORT for every address
    /// NAME resolves to (repeatable).
    #[arg(long = "source")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    sources: Vec<String>,
    /// Seconds between two resolutions of each dns: source [default: 10].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    source_resolve_secs: Option<u64>,
    /// Trainer Unix socket path [default: /run/shardwire/trainer.sock].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    socket: Option<PathBuf>,
    /// Data port listen address [default: 0.0.0.0:7401].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    data_listen: Option<std::net::SocketAddr>,
    /// Admin HTTP listen address [default: 127.0.0.1:7400].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    admin: Option<std::net::SocketAddr>,
    /// Memory for all streams of a lane together (e.g. 4GiB; per lane) [default: 1GiB].
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pool_size: Option<ByteSize>,
    /// Region per stream: fetch-ahead plus leased batches [default: min(256MiB, pool size)].
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_memory: Option<ByteSize>,
    /// Data connections per source per lane: each source dials every lane this many times
    /// (lanes x flows at most 256) [default: 2].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    flows: Option<u16>,
    /// File with the shared secret for sources.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    secret_file: Option<PathBuf>,
    /// Receive path: host (plain TCP), devmem (NIC queues bound to a dma-buf) or
    /// devmem-sim (the devmem path over the kernel-faithful emulator).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    receive: Option<shardwire_config::ReceiveMode>,
    /// RX dma-buf size for devmem and devmem-sim (e.g. 64MiB) [default: 64MiB].
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    devmem_memory: Option<ByteSize>,
    /// Interface for --receive devmem on a node of one lane [default: the lane's paired NIC,
    /// else the first devmem-capable one].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    devmem_interface: Option<String>,
    /// RX queue to bind for --receive devmem (repeatable) [default: the upper half].
    #[arg(long = "devmem-queue")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    devmem_queues: Vec<u32>,
    /// NIC state journal; one left by a crashed run is restored at start
    /// [default: /run/shardwire/nic-state.json].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    nic_state_file: Option<PathBuf>,
    /// Memory for shards: auto (the best available, with the reason), host or cuda.
    #[arg(long, value_parser = parse_memory)]
    #[serde(skip_serializing_if = "Option::is_none")]
    memory: Option<MemoryMode>,
    /// Root of the sysfs tree GPUs and NICs are discovered from [default: /sys].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    sysfs_root: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, value_parser = parse_log_format)]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_format: Option<LogFormat>,
}

fn parse_memory(s: &str) -> Result<MemoryMode, String> {
    match s {
        "auto" => Ok(MemoryMode::Auto),
        "host" => Ok(MemoryMode::Host),
        "cuda" => Ok(MemoryMode::Cuda),
        other => Err(format!("`{other}` is not auto, host or cuda")),
    }
}

/// One devmem TX binding per `devmem_tx` interface (emulated with `devmem_tx_emulate`).
fn tx_bindings(
    cfg: &shardwire_config::SourceConfig,
) -> anyhow::Result<shardwire_source::tx_nics::TxNics> {
    use shardwire_source::devmem_tx::TxPath;
    let bytes = cfg.devmem_tx_memory.0 as usize;
    let mut paths = Vec::with_capacity(cfg.devmem_tx.len());
    for ifname in &cfg.devmem_tx {
        let p = match cfg.devmem_tx_emulate {
            false => TxPath::bind(ifname, bytes, 16)?,
            true => TxPath::emulated(ifname, bytes, 16)?,
        };
        match p.is_emulated() {
            false => tracing::info!(%ifname, bytes, "sending with devmem TX"),
            true => {
                tracing::warn!(%ifname, bytes, "devmem TX emulated (devmem_tx_emulate): unbound buffer, ordinary MSG_ZEROCOPY; for tests")
            }
        }
        paths.push(p);
    }
    Ok(shardwire_source::tx_nics::TxNics::new(paths))
}

/// Most threads of the runtime's blocking pool (tokio's default, named here: the trainer
/// HTTP API's long polls take at most half of them, `http::trainer`).
pub(crate) const BLOCKING_THREADS: usize = 512;

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(BLOCKING_THREADS)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// SIGINT and SIGTERM, caught from the moment this is made: made before a process says it is
/// ready, so a signal sent right after the ready line drains instead of killing it (the
/// default action, until a handler is installed), and kept for the process's life, so one
/// between the first signal and the next wait is not lost.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers (inside the runtime).
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    /// Waits for the next SIGINT or SIGTERM; returns its number.
    async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => libc::SIGINT,
            _ = self.term.recv() => libc::SIGTERM,
        }
    }
}

/// No flag overrides (for `config check/print`).
#[derive(Serialize)]
struct NoFlags {}

/// Secrets live in files; only their paths are printed. Nothing to redact beyond that, but
/// keep the hook so a future inline secret cannot leak through `config print`.
fn redact(c: SourceConfig) -> SourceConfig {
    c
}

/// `--tokens DTYPE`: a dtype name.
fn parse_token_dtype(s: &str) -> Result<shardwire_protocol::DType, String> {
    shardwire_protocol::DType::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = shardwire_protocol::DType::ALL
            .iter()
            .map(|d| d.name())
            .collect();
        format!("{s:?} is not a dtype; one of {}", names.join(", "))
    })
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Index {
            dir,
            manifest_out,
            quiet,
            columns,
            skip_unsupported,
            tokens,
            eos,
            allow_mixed_splits,
        } => {
            let tokens = tokens
                .map(|d| shardwire_index::RawTokens::new(d, eos))
                .transpose()
                .map_err(anyhow::Error::msg)?;
            let opts = shardwire_index::IndexOptions {
                progress: !quiet,
                columns,
                skip_unsupported,
                tokens,
                allow_mixed_splits,
            };
            index(&dir, manifest_out.as_deref(), &opts)
        }
        Cmd::Source(f) => source(&f),
        Cmd::Serve(f) => serve(&f),
        Cmd::Consume(a) => consume::run(a),
        Cmd::Demo(a) => demo::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Status { admin, json } => crate::status::run(&admin, json),
        Cmd::Gpus { json } => gpus(json),
        Cmd::Topology {
            sysfs_root,
            json,
            config,
        } => crate::topology::run(
            config.as_deref(),
            &crate::topology::TopologyFlags { sysfs_root },
            json,
        ),
        Cmd::Nics { json } => nics(json),
        Cmd::Config(c) => config(c),
    }
}

fn index(
    location: &str,
    out: Option<&std::path::Path>,
    opts: &shardwire_index::IndexOptions,
) -> anyhow::Result<ExitCode> {
    use shardwire_index::{Dataset, StoreOptions, StoreUrl};
    Dataset::check_output(location, out)?;
    if StoreUrl::is_remote(location) {
        // The store logs its credential source, endpoint and region when it opens.
        logging::init_filter("info");
    }
    let mut ds = Dataset::open(location, StoreOptions::default())?;
    let report = ds.index(opts)?;
    for note in report.notes() {
        eprintln!("{note}");
    }
    let m = &report.manifest;
    let path = ds.write_manifest(m, out)?;
    outln!(
        "indexed {} shards, {} bytes, digest {} -> {}",
        m.shards.len(),
        m.total_bytes,
        m.digest,
        path
    );
    Ok(ExitCode::SUCCESS)
}

/// Warns, naming each, of the `SHARDWIRE_*` variables that neither `serve` nor `source`
/// reads (most likely misspelled: both ignore them).
fn warn_unknown_env() {
    let vars = std::env::vars_os().map(|(k, v)| {
        (
            k.to_string_lossy().into_owned(),
            v.to_string_lossy().into_owned(),
        )
    });
    for name in shardwire_config::unknown_env(vars) {
        tracing::warn!(variable = %name, "this SHARDWIRE_* variable is no setting of `serve` or `source` and is ignored: misspelled? (docs/CONFIGURATION.md lists the keys)");
    }
}

fn source(f: &SourceFlags) -> anyhow::Result<ExitCode> {
    let cfg = SourceConfig::load(f.config.as_deref(), f)?;
    logging::init(cfg.log_format);
    warn_unknown_env();
    crate::limits::raise_open_files(); // every file of its datasets stays open
    // Before any work: a metric recorded while no recorder is installed is lost without a
    // word (a FETCH served before the admin task first ran went uncounted).
    crate::http::prom::handle();
    let remote = shardwire_source::RemoteOptions {
        request_size: cfg.object_store_request_size.0,
        max_inflight: cfg.object_store_max_inflight,
        cache_dir: cfg.cache_dir.clone(),
        cache_size: cfg.cache_size.0,
    };
    let secret = cfg
        .secret_file
        .as_deref()
        .map(shardwire_node::read_secret)
        .transpose()?;
    let devmem_tx = std::sync::Arc::new(tx_bindings(&cfg)?);
    let scfg = shardwire_source::SourceConfig {
        listen: cfg.listen,
        secret,
        rate_limit: cfg.rate_limit.0,
        fault_corrupt: cfg.fault_corrupt,
        fault_wrong_lane: cfg.fault_wrong_lane,
        devmem_tx,
        idle_timeout: std::time::Duration::from_secs(cfg.idle_timeout_secs),
        max_connections: cfg.max_connections,
        drain_timeout: std::time::Duration::from_secs(cfg.drain_timeout_secs),
    };
    let rt = runtime()?;
    let code = rt.block_on(async {
        // With or without an admin endpoint: the recorder keeps every histogram sample
        // until upkeep folds it into buckets (a source without --admin grew without end).
        tokio::spawn(crate::http::prom::upkeep());
        // The admin address is bound first, as `serve` binds its own: one taken fails the
        // start before the ready line below (a supervisor waiting for it saw a ready source
        // exit), and before the datasets are opened.
        let admin_listener = match cfg.admin {
            Some(addr) => Some(crate::source_admin::bind(addr).await?),
            None => None,
        };
        let datasets = shardwire_source::Datasets::open(&cfg.datasets, &remote).await?;
        let src = shardwire_source::Source::bind(scfg, datasets)
            .await
            .with_context(|| format!("binding {}", cfg.listen))?;
        let mut signals = Signals::new()?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        // The admin endpoint serves through the drain (its /metrics and /v1/status show it)
        // and stops once the source has.
        let (admin_stop, admin_rx) = tokio::sync::watch::channel(false);
        let admin_addr = admin_listener
            .as_ref()
            .map(|l| l.local_addr())
            .transpose()?;
        outln!("source listening on {}", src.local_addr());
        if let Some(a) = admin_addr {
            outln!("source admin on http://{a}");
        }
        let admin = crate::source_admin::start(admin_listener, src.status(), admin_rx);
        tokio::spawn(async move {
            signals.recv().await;
            let _ = tx.send(true);
            let sig = signals.recv().await;
            // An operator who asks twice does not wait out the drain timeout.
            tracing::warn!(
                signal = sig,
                "a second signal: exiting now, without waiting for the drain"
            );
            std::process::exit(128 + sig);
        });
        src.serve(rx).await;
        let _ = admin_stop.send(true);
        if let Some(a) = admin {
            let _ = a.await;
        }
        Ok(ExitCode::SUCCESS)
    });
    end_source(rt);
    code
}

/// How long a source that stopped serving (drained, or failed) waits for its blocking work
/// before it exits: a cache write under way (committed if it ends in time; one cut short
/// leaves a `.partial` file, deleted at the next start), or a check of a shard file on a
/// network file system whose server does not answer, which may never end.
const SOURCE_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Ends the runtime of a source that stopped serving: SIGINT and SIGTERM back to their
/// default action, so a signal ends the process at once, and its blocking work waited for at
/// most [`SOURCE_EXIT_WAIT`]. Before, dropping the runtime waited for every blocking task: an
/// `fstat` stuck on a dead mount kept the drained source alive for good, and deaf to a second
/// signal (taken by handlers nothing read any more).
fn end_source(rt: tokio::runtime::Runtime) {
    default_signals();
    let began = std::time::Instant::now();
    rt.shutdown_timeout(SOURCE_EXIT_WAIT);
    if began.elapsed() >= SOURCE_EXIT_WAIT {
        tracing::warn!(
            waited = ?SOURCE_EXIT_WAIT,
            "the source's blocking work (a check of a shard file on a network file system whose \
             server does not answer, a cache write) did not end: exiting without it"
        );
    }
}

/// Gives SIGINT and SIGTERM their default action back, once the handlers caught since the
/// start ([`Signals`]) are read no more.
fn default_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `signal` with `SIG_DFL` installs no handler of ours; it only gives the
        // kernel's default action back to a signal whose tokio handler nothing reads now.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
}

fn serve(f: &ServeFlags) -> anyhow::Result<ExitCode> {
    let cfg = ServeConfig::load(f.config.as_deref(), f)?;
    logging::init(cfg.log_format);
    warn_unknown_env();
    crate::limits::raise_open_files(); // a socket per trainer, source link and data connection
    crate::http::prom::handle(); // before any work (see `source`)
    let rt = runtime()?;
    let mut interrupted = false;
    let code = rt.block_on(async {
        let mut signals = Signals::new()?;
        // A signal during a start that takes long (a GPU probe, a NIC's setup) ends it, as
        // the default action did before the handler was installed this early.
        let s = tokio::select! {
            s = crate::serve::start(cfg) => s?,
            sig = signals.recv() => {
                tracing::warn!(signal = sig, "signal received while starting: exiting");
                interrupted = true;
                return Ok(ExitCode::from(128 + sig as u8));
            }
        };
        let h = &s.handle;
        outln!(
            "node service ready: socket {} admin http://{}",
            h.socket.display(),
            s.admin_addr
        );
        let timeout = std::time::Duration::from_secs(h.node.info().cfg.drain_timeout_secs);
        let by_signal = tokio::select! {
            _ = signals.recv() => {
                tracing::info!(?timeout, "signal received; draining");
                true
            }
            _ = h.node.drain_requested().notified() => {
                tracing::info!(?timeout, "drain requested over the admin API");
                false
            }
        };
        // A signal during a drain the API began is the first (it drains, as it always does);
        // one after a signal ends the drain at once.
        let again = async {
            if !by_signal {
                signals.recv().await;
                tracing::info!("signal received; draining already (another one closes the remaining streams now)");
            }
            signals.recv().await
        };
        tokio::select! {
            _ = h.drain(timeout) => {}
            _ = again => {
                // An operator who asks again does not wait out the drain timeout.
                tracing::warn!(open = h.node.streams().len(), "a second signal: closing the remaining streams now");
                h.shutdown();
            }
        }
        // Let the HTTP fronts finish what they are answering (the drain request itself).
        let _ = s.http.await;
        Ok(ExitCode::SUCCESS)
    });
    if interrupted {
        abandon_start(rt);
    }
    code
}

/// How long a signal during the start waits for the start's blocking work (a GPU open, a NIC's
/// setup and bind) before the process exits. A bind that finishes in this time is dropped, so a
/// devmem NIC's journalled changes are undone now; one that takes longer leaves them to the
/// next start, which undoes them from `nic_state_file`.
const START_ABANDON_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Ends a runtime whose start a signal interrupted: waits up to [`START_ABANDON_WAIT`] for its
/// blocking tasks, with SIGINT and SIGTERM back to their default action, so a second signal
/// ends the process at once instead of being taken by the handlers no one reads any more.
fn abandon_start(rt: tokio::runtime::Runtime) {
    default_signals();
    let began = std::time::Instant::now();
    rt.shutdown_timeout(START_ABANDON_WAIT);
    if began.elapsed() >= START_ABANDON_WAIT {
        tracing::warn!(
            waited = ?START_ABANDON_WAIT,
            "the start's blocking work (a GPU open, a NIC bind) did not end: exiting without it; \
             a devmem NIC may keep shardwire's settings until the next start, which undoes them"
        );
    }
}

fn gpus(json: bool) -> anyhow::Result<ExitCode> {
    let p = shardwire_gpu::probe_gpus();
    let auto = shardwire_gpu::choose_memory(shardwire_gpu::MemoryChoice::Auto, &p)?;
    if json {
        let doc = serde_json::json!({ "probe": p, "auto": auto });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    let version = p.driver_version.map_or("none".to_string(), |v| {
        format!("{}.{}", v / 1000, v % 1000 / 10)
    });
    let present = if p.driver_present {
        "present"
    } else {
        "absent"
    };
    outln!("CUDA driver: {present} (version {version})");
    for d in &p.devices {
        outln!(
            "GPU {} {} {} {} MiB dma-buf={} vmm={} rdma+vmm={}",
            d.ordinal,
            d.name,
            d.pci_bus_id,
            d.total_memory >> 20,
            d.dma_buf_supported,
            d.vmm_supported,
            d.gpu_direct_rdma_with_cuda_vmm_supported
        );
    }
    outln!("{}", p.reason);
    outln!("memory = \"auto\" picks {}: {}", auto.memory, auto.reason);
    if auto.memory == shardwire_protocol::trainer::MemoryKind::Cuda {
        outln!(
            "(`serve` opens the GPU and runs a self-test first; if that fails, auto uses host memory and says why)"
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn nics(json: bool) -> anyhow::Result<ExitCode> {
    let nics = shardwire_devmem::probe::probe_nics();
    if json {
        outln!("{}", serde_json::to_string_pretty(&nics)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<4} {:<12} {:<12} {:<4} {:>4} {:>4} {:<12} {:<7} REASON",
        "IDX",
        "NAME",
        "DRIVER",
        "UP",
        "RXQ",
        "TXQ",
        "HEADER-SPLIT",
        "DEVMEM"
    );
    for n in &nics {
        outln!(
            "{:<4} {:<12} {:<12} {:<4} {:>4} {:>4} {:<12} {:<7} {}",
            n.ifindex,
            n.name,
            n.driver,
            if n.up { "yes" } else { "no" },
            n.rx_queues,
            n.tx_queues,
            n.header_split,
            if n.devmem_capable { "yes" } else { "no" },
            n.reason
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `config check FILE` for `serve`: the file alone, and what `serve` refuses at start (no
/// `sources`) refused here too, asking the file for it (no SHARDWIRE_* variable applies here).
fn check_serve_file(file: &std::path::Path) -> anyhow::Result<()> {
    let c = ServeConfig::load_file(file)?;
    anyhow::ensure!(
        !c.sources.is_empty(),
        "{}: `sources` is empty: serve needs at least one (HOST:PORT or dns:NAME:PORT). \
         `config check` judges the file alone and applies no SHARDWIRE_* variable, so the file \
         must give it: `sources = [\"HOST:PORT\"]` (`shardwire config print --config FILE` \
         shows the file with the environment merged, as `serve` reads it)",
        file.display()
    );
    Ok(())
}

fn config(c: ConfigCmd) -> anyhow::Result<ExitCode> {
    match c {
        ConfigCmd::Check {
            file,
            source_config,
        } => {
            if source_config {
                SourceConfig::load_file(&file)?;
            } else {
                check_serve_file(&file)?;
            }
            outln!("{}: ok", file.display());
        }
        ConfigCmd::Print {
            config,
            source_config,
        } => {
            let v = if source_config {
                serde_json::to_value(redact(SourceConfig::load(config.as_deref(), &NoFlags {})?))?
            } else {
                serde_json::to_value(ServeConfig::load(config.as_deref(), &NoFlags {})?)?
            };
            outln!("{}", serde_json::to_string_pretty(&v)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Cli;

    #[test]
    fn config_check_asks_the_file_for_sources() {
        // Before: "`sources` is empty" alone, to a user who had exported SHARDWIRE_SOURCES,
        // which `config check` does not apply.
        let p = std::env::temp_dir().join(format!("sw-check-{}.toml", std::process::id()));
        std::fs::write(&p, "flows = 2\n").unwrap();
        let e = super::check_serve_file(&p).unwrap_err().to_string();
        std::fs::remove_file(&p).unwrap();
        for part in [
            "`sources` is empty",
            "judges the file alone",
            "config print --config",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }

    #[test]
    fn flags_that_would_do_nothing_alone_are_refused() {
        // Before: accepted, and ignored.
        let hold = ["shardwire", "consume", "--dataset", "x", "--hold-secs", "5"];
        let e = Cli::try_parse_from(hold).unwrap_err().to_string();
        assert!(e.contains("--limit"), "{e}");
        let with_limit = [
            "shardwire",
            "consume",
            "--dataset",
            "x",
            "--limit",
            "1",
            "--hold-secs",
            "5",
        ];
        assert!(Cli::try_parse_from(with_limit).is_ok());
        let way = ["shardwire", "bench", "--crc-way", "crc-queue"];
        let e = Cli::try_parse_from(way).unwrap_err().to_string();
        assert!(e.contains("--compare-crc"), "{e}");
    }

    #[test]
    fn serve_help_says_flows_are_per_lane() {
        // Before: "Data connections per source", read on an 8-GPU host as a total.
        let cmd = <Cli as clap::CommandFactory>::command();
        let serve = cmd.find_subcommand("serve").unwrap();
        let flows = serve
            .get_arguments()
            .find(|a| a.get_id().as_str() == "flows")
            .unwrap();
        let help = flows.get_help().unwrap().to_string();
        for part in ["per source per lane", "lanes x flows at most 256"] {
            assert!(help.contains(part), "{part}: {help}");
        }
    }

    #[test]
    fn a_bench_rate_that_would_pace_nothing_is_refused() {
        // Before: -1, NaN or 1e-12 Gbit/s became a pacing rate of 0, which means unlimited.
        for rate in ["-1", "NaN", "1e-12", "0"] {
            let flag = format!("--rate={rate}");
            let cli = Cli::try_parse_from(["shardwire", "bench", flag.as_str()]).unwrap();
            let super::Cmd::Bench(a) = cli.cmd else {
                panic!("bench")
            };
            let e = crate::bench::check_args(&a).unwrap_err().to_string();
            assert!(e.contains("--rate"), "{rate}: {e}");
        }
        let cli = Cli::try_parse_from(["shardwire", "bench", "--rate", "2.5"]).unwrap();
        let super::Cmd::Bench(a) = cli.cmd else {
            panic!("bench")
        };
        assert!(crate::bench::check_args(&a).is_ok());
    }

    #[test]
    fn bench_runs_only_the_loopback_modes() {
        // Before: `--mode auto` was taken, and could bind a real devmem NIC for a loopback run.
        let check = |mode: &str| {
            let cli = Cli::try_parse_from(["shardwire", "bench", "--mode", mode]).unwrap();
            let super::Cmd::Bench(a) = cli.cmd else {
                panic!("bench")
            };
            crate::bench::check_args(&a)
        };
        for mode in ["auto", "devmem"] {
            let e = check(mode).unwrap_err().to_string();
            assert!(e.contains(&format!("--mode {mode})")), "{mode}: {e}");
            assert!(e.contains("host or devmem-sim"), "{mode}: {e}");
        }
        for mode in ["host", "devmem-sim"] {
            assert!(check(mode).is_ok(), "{mode}");
        }
    }
}
