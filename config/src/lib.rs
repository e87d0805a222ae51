//! Typed configuration for `shardwire serve` and `shardwire source`.
//!
//! Layers, lowest first: built-in defaults < TOML file < `SHARDWIRE_*` environment < flags.
//! Unknown keys in the file are errors that name the key; environment variables that are
//! not keys of the command being run are ignored (so `SHARDWIRE_SOCKET` can serve both the
//! node and its trainers). Values are validated after merging and errors name the key, the
//! value and what is allowed.
#![forbid(unsafe_code)]

mod bytesize;
mod interfaces;
mod lanes;
mod sources;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

pub use bytesize::ByteSize;
pub use lanes::{LaneConfig, Lanes, MAX_LANES, is_gpu_name};
pub use sources::{SourceEntry, SourceEntryError};

/// Why the configuration is not usable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Parsing/merging failed (unknown key, wrong type...); figment names the key and file.
    #[error(transparent)]
    Load(#[from] Box<figment::Error>),
    /// A value is out of range.
    #[error("configuration key `{key}` = {value}: {allowed}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        allowed: String,
    },
}

/// Largest size a size key takes: 64 TiB, past any host's or GPU's memory (and far from
/// the overflow of rounding it up to pages).
pub const MAX_SIZE: u64 = 1 << 46;

/// `v` of size key `key` is at most [`MAX_SIZE`].
fn check_size(key: &'static str, v: ByteSize) -> Result<(), ConfigError> {
    if v.0 > MAX_SIZE {
        return Err(invalid(
            key,
            v,
            format!("must be at most {}", ByteSize(MAX_SIZE)),
        ));
    }
    Ok(())
}

fn invalid(
    key: &'static str,
    value: impl std::fmt::Display,
    allowed: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

/// How shards are received.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case", try_from = "String")]
pub enum ReceiveMode {
    /// Devmem when a NIC can do it (the probe's trial bind), else host; the choice and its
    /// reason are logged and shown on `/v1/status`.
    #[default]
    Auto,
    /// Plain TCP into host memory.
    Host,
    /// Devmem TCP: payloads land in a dma-buf bound to NIC receive queues. Refused at start
    /// when no NIC can do it (the reason is printed).
    Devmem,
    /// The devmem receive path (frags, tokens, gather) over the kernel-faithful emulator on
    /// ordinary TCP: for tests and `shardwire bench`; not GPU-direct.
    DevmemSim,
}

impl std::fmt::Display for ReceiveMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Host => "host",
            Self::Devmem => "devmem",
            Self::DevmemSim => "devmem-sim",
        })
    }
}

impl std::str::FromStr for ReceiveMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "host" => Ok(Self::Host),
            "devmem" => Ok(Self::Devmem),
            "devmem-sim" => Ok(Self::DevmemSim),
            other => Err(format!("`{other}` is not auto, host, devmem or devmem-sim")),
        }
    }
}

/// Where shards are assembled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum MemoryMode {
    /// The best available, reported with the reason (CUDA when usable, else host).
    #[default]
    Auto,
    /// memfd regions in host memory.
    Host,
    /// GPU memory; refused at start when no usable CUDA GPU is present.
    Cuda,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum LogFormat {
    /// Human-readable.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A string only. A number is refused with the form to use: TOML reads `0o660` as 432 and
/// the environment's `0660` as 660, and no digits can tell which was meant.
fn octal_digits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct Octal;
    fn refused<E: serde::de::Error>(what: impl std::fmt::Display) -> E {
        E::custom(format!(
            "socket_mode is {what}: write it as a string of octal digits, \"0660\" (in the environment SHARDWIRE_SOCKET_MODE='\"0660\"')"
        ))
    }
    impl serde::de::Visitor<'_> for Octal {
        type Value = String;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string of octal digits, \"0660\"")
        }
        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<String, E> {
            Ok(s.to_owned())
        }
        fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<String, E> {
            Err(refused(format_args!("the number {n}")))
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<String, E> {
            Err(refused(format_args!("the number {n}")))
        }
        fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<String, E> {
            Err(refused(format_args!("the number {n}")))
        }
        fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<String, E> {
            Err(refused(b))
        }
    }
    d.deserialize_any(Octal)
}

// The choice keys are read from strings only: serde's derive also took an integer as the
// variant's index, so `receive = 2` (or SHARDWIRE_RECEIVE=2) silently meant `devmem`.
impl TryFrom<String> for ReceiveMode {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl TryFrom<String> for MemoryMode {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "auto" => Ok(Self::Auto),
            "host" => Ok(Self::Host),
            "cuda" => Ok(Self::Cuda),
            other => Err(format!("`{other}` is not auto, host or cuda")),
        }
    }
}

impl TryFrom<String> for LogFormat {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("`{other}` is not text or json")),
        }
    }
}

/// `shardwire serve` configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Shard sources: control addresses (`HOST:PORT`) and DNS names standing for every
    /// address they resolve to (`dns:NAME:PORT`) ([`SourceEntry`]).
    pub sources: Vec<String>,
    /// Seconds between two resolutions of each `dns:` source entry.
    pub source_resolve_secs: u64,
    /// Trainer Unix socket path.
    pub socket: PathBuf,
    /// Data port listen address (sources dial it).
    pub data_listen: SocketAddr,
    /// Admin HTTP listen address.
    pub admin: SocketAddr,
    /// Total memory for all stream regions.
    pub pool_size: ByteSize,
    /// Region size per stream (fetch-ahead window + leased batches); unset: derived from
    /// `pool_size` ([`ServeConfig::stream_memory`]).
    pub stream_memory: Option<ByteSize>,
    /// Data connections per source and per lane (lanes x flows at most
    /// [`MAX_SESSION_FLOWS`]).
    pub flows: u16,
    /// File holding the shared secret for sources.
    pub secret_file: Option<PathBuf>,
    /// Receive path.
    pub receive: ReceiveMode,
    /// Plain-TCP data connections into host memory receive with io_uring multishot receive,
    /// the next payloads' slabs posted as its buffers (Linux 6.12+; where io_uring cannot be
    /// set up, a warning is logged and `recv` is used); false: always `recv`.
    pub io_uring: bool,
    /// Fault injection for tests (`receive = devmem-sim` with two lanes or more): the first N
    /// devmem data connections of lane 0 have their packets land on lane 1's binding (a
    /// misplaced steering rule), so their frags name another binding; the node must count
    /// them (`steering_errors`), return their tokens and fetch their payloads again.
    pub fault_misplace: u32,
    /// Fault injection for tests: the receiver threads of the first N data connections fail
    /// to start, as when thread creation fails (EAGAIN under a pids limit); the node must
    /// drop those connections, end their links' sessions and fetch the payloads again.
    pub fault_spawn: u32,
    /// Size of the RX dma-buf bound to the NIC queues (devmem and devmem-sim): the net_iov
    /// pool frags land in before they are gathered into shard slabs.
    pub devmem_memory: ByteSize,
    /// Interface for `receive = devmem` (default: the first devmem-capable NIC).
    pub devmem_interface: Option<String>,
    /// RX queues to bind (default: the upper half of the interface's RX queues); never
    /// queue 0 with `receive` devmem or auto (RSS keeps it).
    pub devmem_queues: Vec<u32>,
    /// Where NIC changes made for devmem are journaled; a file left by a crashed run is
    /// restored (changes undone) at start.
    pub nic_state_file: PathBuf,
    /// Memory kind.
    pub memory: MemoryMode,
    /// Log format.
    pub log_format: LogFormat,
    /// File holding the bearer token for mutating admin endpoints (drain, stream close);
    /// without it those endpoints answer 403.
    pub admin_token_file: Option<PathBuf>,
    /// Seconds a drain (SIGTERM or POST /v1/drain) waits for open streams before exiting.
    pub drain_timeout_secs: u64,
    /// Permission bits of the trainer socket file, octal as a string (e.g. "0660"); a number
    /// is refused, naming the form to use.
    #[serde(deserialize_with = "octal_digits")]
    pub socket_mode: String,
    /// Trainer peers (SO_PEERCRED) allowed by uid; empty = any uid the file mode lets in.
    pub allowed_uids: Vec<u32>,
    /// Trainer peers allowed by gid; a peer passes if its uid or its gid is listed.
    pub allowed_gids: Vec<u32>,
    /// The trainer HTTP routes (`/v1/streams` open/next/close/state, `/v1/leases/...`) on
    /// the admin address; false: they answer 403 (trainers use the socket), so an admin
    /// address off loopback (Kubernetes' probes) does not serve the datasets to the network.
    pub trainer_http: bool,
    /// Admin and trainer HTTP connections served at once; more wait in the kernel's backlog.
    pub http_max_connections: usize,
    /// Seconds an HTTP client has to send a request's headers (slowloris bound), also the
    /// limit for an idle keep-alive connection's next request.
    pub http_header_timeout_secs: u64,
    /// Seconds an HTTP client has to send a request's body.
    pub http_body_timeout_secs: u64,
    /// Seconds a write of an HTTP answer may wait for the client to read, with no progress.
    pub http_write_timeout_secs: u64,
    /// Trainer socket connections served at once; more are refused with an error frame.
    pub trainer_max_connections: usize,
    /// Seconds a trainer connection may wait before its `attach`, and may take to finish a
    /// request frame it started.
    pub trainer_request_timeout_secs: u64,
    /// Seconds an attached trainer may send nothing before its stream is closed (0: never;
    /// a trainer that dies closes its socket, so this only bounds live but stuck trainers).
    pub trainer_idle_timeout_secs: u64,
    /// The node's lanes (GPU/NIC pairs): `"auto"` or one table per lane.
    pub lanes: Lanes,
    /// Root of the sysfs tree the GPUs and NICs are discovered from (`/sys`; a fake tree in
    /// tests).
    pub sysfs_root: PathBuf,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            sources: Vec::new(),
            source_resolve_secs: 10,
            socket: PathBuf::from("/run/shardwire/trainer.sock"),
            data_listen: "0.0.0.0:7401".parse().expect("valid"),
            admin: "127.0.0.1:7400".parse().expect("valid"),
            pool_size: ByteSize(1 << 30),
            stream_memory: None,
            flows: 2,
            secret_file: None,
            receive: ReceiveMode::Auto,
            io_uring: true,
            fault_misplace: 0,
            fault_spawn: 0,
            devmem_memory: ByteSize(64 << 20),
            devmem_interface: None,
            devmem_queues: Vec::new(),
            nic_state_file: PathBuf::from("/run/shardwire/nic-state.json"),
            memory: MemoryMode::Auto,
            log_format: LogFormat::Text,
            admin_token_file: None,
            drain_timeout_secs: 30,
            socket_mode: "0660".into(),
            allowed_uids: Vec::new(),
            allowed_gids: Vec::new(),
            trainer_http: true,
            http_max_connections: 256,
            http_header_timeout_secs: 10,
            http_body_timeout_secs: 10,
            http_write_timeout_secs: 30,
            trainer_max_connections: 256,
            trainer_request_timeout_secs: 10,
            trainer_idle_timeout_secs: 3600,
            lanes: Lanes::Auto,
            sysfs_root: PathBuf::from("/sys"),
        }
    }
}

/// `stream_memory` when it is not set: this, or `pool_size` when the pool is smaller.
pub const DEFAULT_STREAM_MEMORY: u64 = 256 << 20;

/// `shardwire source` configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    /// Control listen address.
    pub listen: SocketAddr,
    /// Datasets as NAME=DIR.
    pub datasets: Vec<String>,
    /// File holding the shared secret; without it only loopback peers are accepted.
    pub secret_file: Option<PathBuf>,
    /// Send rate limit in bytes/s, 0 = unlimited.
    pub rate_limit: ByteSize,
    /// Fault injection for tests: corrupt the first N payloads sent.
    pub fault_corrupt: u32,
    /// Fault injection for tests: the first N data connections of a node's lane 0 dial its
    /// lane 1 address instead (the node must refuse them).
    pub fault_wrong_lane: u32,
    /// Interfaces for devmem TX, one TX binding each (empty: `sendfile`); written as one
    /// name or a list.
    #[serde(deserialize_with = "interfaces::one_or_many")]
    pub devmem_tx: Vec<String>,
    /// TX dma-buf size for devmem TX, per interface.
    pub devmem_tx_memory: ByteSize,
    /// For tests on hosts without a devmem TX NIC: each `devmem_tx` interface gets an unbound
    /// buffer (ordinary `MSG_ZEROCOPY` sends from it) instead of a `bind-tx` dma-buf; the rest
    /// of the path (choice of NIC, `SO_BINDTODEVICE`, rings, completions) is the real one.
    pub devmem_tx_emulate: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// Seconds an established node session may be silent before it is dropped (nodes send
    /// keepalives after a third of it; they learn it in the handshake).
    pub idle_timeout_secs: u64,
    /// Node sessions (authenticated control connections) served at once; a node past it is
    /// answered with an error in place of `Welcome`.
    pub max_connections: usize,
    /// Disk cache for object-storage datasets (`None`: none; shards read ahead are held in
    /// memory until sent).
    pub cache_dir: Option<PathBuf>,
    /// Size of the disk cache (required with `cache_dir`).
    pub cache_size: ByteSize,
    /// GETs in flight per bucket at most (the ceiling of its adaptive window).
    pub object_store_max_inflight: usize,
    /// Largest ranged GET; larger shards are read in parallel parts.
    pub object_store_request_size: ByteSize,
    /// Admin HTTP address (`/v1/status`, `/metrics`); `None`: status goes to the log every
    /// minute instead.
    pub admin: Option<SocketAddr>,
    /// On SIGTERM the source takes no new FETCH and finishes the queued ones; it exits when
    /// they are sent or after this many seconds, whichever comes first.
    pub drain_timeout_secs: u64,
}

/// Default of `object_store_request_size`: 8 MiB (AWS's guidance: ranged GETs of 8-16 MB).
pub const DEFAULT_REQUEST_SIZE: u64 = 8 << 20;

impl Default for SourceConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:7500".parse().expect("valid"),
            datasets: Vec::new(),
            secret_file: None,
            rate_limit: ByteSize(0),
            fault_corrupt: 0,
            fault_wrong_lane: 0,
            devmem_tx: Vec::new(),
            devmem_tx_memory: ByteSize(64 << 20),
            devmem_tx_emulate: false,
            log_format: LogFormat::Text,
            idle_timeout_secs: 60,
            max_connections: 256,
            cache_dir: None,
            cache_size: ByteSize(0),
            object_store_max_inflight: 32,
            object_store_request_size: ByteSize(DEFAULT_REQUEST_SIZE),
            admin: None,
            drain_timeout_secs: 30,
        }
    }
}

/// Keys of a config struct (including optional ones), for filtering the environment.
fn keys<T: Serialize + Default>() -> Vec<String> {
    match serde_json::to_value(T::default()) {
        Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// `SHARDWIRE_*` variables of the project's own tools and tests, not settings: a trailing
/// `_` names a family (`SHARDWIRE_E2E_WORKERS`, `SHARDWIRE_E2E_RUST_LOG` of scripts/test and
/// tests/e2e; `SHARDWIRE_FAKE_CUDA_CHILD` of the fake CUDA driver's tests).
const TOOL_VARIABLES: [&str; 7] = [
    "BIN",
    "VENV",
    "STREAMING_VENV",
    "SKIP_",
    "HW_",
    "E2E_",
    "FAKE_CUDA_CHILD",
];

/// The `SHARDWIRE_*` variables among `vars` that are no key of `serve` or `source` (nor a
/// variable of the project's tools): each is ignored by both, most likely misspelled
/// (`SHARDWIRE_CACHEDIR`), and deserves a warning naming it.
pub fn unknown_env(vars: impl IntoIterator<Item = (String, String)>) -> Vec<String> {
    let known: Vec<String> = keys::<ServeConfig>()
        .into_iter()
        .chain(keys::<SourceConfig>())
        .collect();
    let mut out: Vec<String> = vars
        .into_iter()
        .filter_map(|(name, _)| {
            let key = name.strip_prefix("SHARDWIRE_")?;
            let setting = known.iter().any(|k| key.eq_ignore_ascii_case(k));
            let tool = TOOL_VARIABLES
                .iter()
                .any(|t| key == *t || (t.ends_with('_') && key.starts_with(t)));
            (!setting && !tool).then_some(name)
        })
        .collect();
    out.sort();
    out
}

/// Whether a load merges the `SHARDWIRE_*` variables between the file and the flags (`serve`,
/// `source`, `config print`) or leaves them out (`config check FILE` judges the file alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EnvLayer {
    Merge,
    Skip,
}

/// No flags: a load of the file alone.
#[derive(Serialize)]
struct NoFlags {}

fn load<T>(file: Option<&Path>, flags: &impl Serialize, env: EnvLayer) -> Result<T, ConfigError>
where
    T: Serialize + Default + for<'de> Deserialize<'de>,
{
    let defaults = Figment::from(Serialized::defaults(T::default()));
    layered::<T>(defaults, file, flags, env)?
        .extract()
        .map_err(|e| ConfigError::Load(Box::new(e)))
}

/// Whether `key` of `T` is given by the file, the environment (where `env` merges it) or
/// `flags`, whatever its value (a key left to its built-in default is not).
fn given<T: Serialize + Default>(
    key: &str,
    file: Option<&Path>,
    flags: &impl Serialize,
    env: EnvLayer,
) -> Result<bool, ConfigError> {
    Ok(layered::<T>(Figment::new(), file, flags, env)?.contains(key))
}

/// `base` < the TOML file < the `SHARDWIRE_*` variables that are keys of `T` (unless `env`
/// skips them) < `flags`.
fn layered<T: Serialize + Default>(
    base: Figment,
    file: Option<&Path>,
    flags: &impl Serialize,
    env: EnvLayer,
) -> Result<Figment, ConfigError> {
    let known = keys::<T>();
    let mut fig = base;
    if let Some(f) = file {
        if !f.exists() {
            return Err(invalid(
                "config",
                f.display(),
                "the config file does not exist",
            ));
        }
        fig = fig.merge(Toml::file(f));
    }
    if env == EnvLayer::Merge {
        let vars = Env::prefixed("SHARDWIRE_")
            .filter(move |k| known.iter().any(|x| k.as_str().eq_ignore_ascii_case(x)))
            .split("__");
        fig = fig.merge(vars);
    }
    Ok(fig.merge(Serialized::defaults(flags)))
}

/// Longest time a `*_secs` key may give: a year. Waits beyond it are "never" in practice, and
/// a value near `u64::MAX` overflows the clock (a panic at the first wait, not an error).
pub const MAX_SECS: u64 = 365 * 86400;

/// Most connections a `*max_connections` key may give (a semaphore counts at most 2^61).
pub const MAX_CONNECTIONS: usize = 1_000_000;

/// `v` seconds of `key` within `min..=`[`MAX_SECS`].
fn check_secs(key: &'static str, v: u64, min: u64) -> Result<(), ConfigError> {
    if (min..=MAX_SECS).contains(&v) {
        return Ok(());
    }
    Err(invalid(
        key,
        v,
        format!("must be between {min} and {MAX_SECS} seconds (a year)"),
    ))
}

/// `v` connections of `key` within `1..=`[`MAX_CONNECTIONS`].
fn check_connections(key: &'static str, v: usize) -> Result<(), ConfigError> {
    if (1..=MAX_CONNECTIONS).contains(&v) {
        return Ok(());
    }
    Err(invalid(
        key,
        v,
        format!("must be between 1 and {MAX_CONNECTIONS}"),
    ))
}

/// Most data connections a source dials for one node session: a node's lanes x `flows` may
/// not exceed it, or every source refuses its sessions. The protocol's
/// `wire::MAX_SESSION_FLOWS`, repeated here (config depends on no sibling crate, DESIGN §7);
/// the node's tests hold the two equal.
pub const MAX_SESSION_FLOWS: u64 = 256;

/// Longest dataset name: the protocol's `wire::MAX_DATASET_NAME` (held equal as above).
pub const MAX_DATASET_NAME: usize = 255;

/// What is wrong with dataset name `name`, if anything (`"has the character ' '"`), by the
/// protocol's rule, `wire::check_dataset_name` (repeated here as [`MAX_SESSION_FLOWS`] is; the
/// node's tests hold the two to the same answers): 1 to [`MAX_DATASET_NAME`] bytes of
/// `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn dataset_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("is empty".into());
    }
    if name.len() > MAX_DATASET_NAME {
        return Some(format!("is {} bytes long", name.len()));
    }
    if name == "." || name == ".." {
        return Some("names a directory".into());
    }
    name.chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        .map(|ch| format!("has the character {ch:?}"))
}

/// The schemes of the dataset URLs a source serves: `shardwire_store::Scheme::ALL`, repeated
/// here as [`dataset_name_problem`] repeats the protocol's rule (the service's tests hold the
/// two to the same list).
pub const DATASET_URL_SCHEMES: [&str; 6] = ["s3", "gs", "az", "file", "http", "https"];

/// What a `datasets` entry may be.
const DATASET_PLACES: &str = "NAME=DIR or NAME=URL (s3://, gs://, az://, file://, http(s)://)";

/// The `datasets` entries: each `NAME=DIR` or `NAME=URL` with a name the protocol carries
/// ([`dataset_name_problem`]) and, for a URL, a scheme a store serves
/// ([`DATASET_URL_SCHEMES`]), no name twice. An entry refused is repeated redacted
/// ([`redacted_spec`]).
fn check_datasets(datasets: &[String]) -> Result<(), ConfigError> {
    let mut names = std::collections::HashSet::new();
    for d in datasets {
        let bad = |why: String| invalid("datasets", redacted_spec(d), why);
        // A URL with its `NAME=` left out has no name either, whatever `=` its secret or
        // query holds.
        let Some((name, place)) = d
            .split_once('=')
            .filter(|(name, place)| !name.is_empty() && !place.is_empty() && !name.contains("://"))
        else {
            return Err(bad(format!("each is {DATASET_PLACES}")));
        };
        if let Some(why) = dataset_name_problem(name) {
            return Err(bad(format!(
                "the name `{}` {why}: a dataset name is 1 to {MAX_DATASET_NAME} of \
                 [A-Za-z0-9._-], not `.` or `..`",
                redacted_spec(name)
            )));
        }
        if let Some(scheme) = unsupported_scheme(place) {
            // Before, `config check` passed it and the source opened it as a directory.
            return Err(bad(format!(
                "unsupported scheme `{scheme}`; use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, \
                 az://CONTAINER/PREFIX, file:///DIR or http(s)://HOST/PATH"
            )));
        }
        if !names.insert(name) {
            return Err(bad(format!("`{name}` is given twice")));
        }
    }
    Ok(())
}

/// The scheme of `place` if it starts with a URL scheme's name (RFC 3986: a letter, then
/// letters, digits, `+`, `-` and `.`) and `://`, and no store serves it (`gcs://`, `s3a://`).
fn unsupported_scheme(place: &str) -> Option<&str> {
    let (scheme, _) = place.split_once("://")?;
    let mut chars = scheme.chars();
    let named = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    let served = DATASET_URL_SCHEMES
        .iter()
        .any(|s| s.eq_ignore_ascii_case(scheme));
    (named && !served).then_some(scheme)
}

/// A `datasets` entry as an error may repeat it: a URL's userinfo (`user:secret@`) becomes
/// `***@`, and a query or fragment (a signature) becomes `?...` (`#...`), as
/// `shardwire_store::redacted` does, more bluntly: everything from the first `://` to the
/// last `@` goes (a secret may hold `/`, `?`, `#` or `@`), and everything from the first
/// `?` or `#` outside it. The store crate refuses credentials in URLs so that they never
/// reach a log; this keeps them out of the configuration's errors too.
pub fn redacted_spec(spec: &str) -> String {
    let Some(at) = spec.rfind('@') else {
        return without_query(spec);
    };
    let start = spec[..at].find("://").map_or(0, |i| i + 3);
    let head = &spec[..start];
    if head.contains(['?', '#']) {
        return without_query(head);
    }
    format!("{head}***@{}", without_query(&spec[at + 1..]))
}

/// `s` up to its first `?` or `#`, which stays, followed by `...`.
fn without_query(s: &str) -> String {
    match s.find(['?', '#']) {
        Some(q) => format!("{}...", &s[..=q]),
        None => s.to_owned(),
    }
}

impl ServeConfig {
    /// Merges defaults < file < env < `flags` (a struct whose `None` fields are skipped).
    pub fn load(file: Option<&Path>, flags: &impl Serialize) -> Result<Self, ConfigError> {
        let c: Self = load(file, flags, EnvLayer::Merge)?;
        c.validate()?;
        Ok(c)
    }

    /// Defaults < `file` alone, validated, with no `SHARDWIRE_*` variable merged: what
    /// `shardwire config check FILE` judges (an exported variable neither hides a bad key of
    /// the file nor fails a good one).
    pub fn load_file(file: &Path) -> Result<Self, ConfigError> {
        let c: Self = load(Some(file), &NoFlags {}, EnvLayer::Skip)?;
        c.validate()?;
        Ok(c)
    }

    /// `devmem_memory` between 1 MiB and [`MAX_SIZE`]; no queue twice in `devmem_queues`;
    /// `devmem_interface` a name Linux takes.
    fn validate_devmem(&self) -> Result<(), ConfigError> {
        if let Some(n) = &self.devmem_interface {
            interfaces::check("devmem_interface", std::slice::from_ref(n))?;
        }
        if self.devmem_memory.0 < 1 << 20 {
            return Err(invalid(
                "devmem_memory",
                self.devmem_memory,
                "must be at least 1MiB",
            ));
        }
        check_size("devmem_memory", self.devmem_memory)?;
        let mut seen = std::collections::BTreeSet::new();
        if let Some(q) = self.devmem_queues.iter().find(|q| !seen.insert(**q)) {
            return Err(invalid(
                "devmem_queues",
                format!("{:?}", self.devmem_queues),
                format!("lists queue {q} twice: each RX queue is bound once"),
            ));
        }
        Ok(())
    }

    /// `devmem_queues` and `devmem_interface` beside a `lanes` table: a table of one lane
    /// takes them as its own (as a node of one lane always has) unless the lane names other
    /// ones (which would be overridden or dropped); a table of several lanes does not use
    /// them (each lane binds its own NIC and queues), so they are refused naming the keys
    /// that do.
    fn validate_lane_table(&self) -> Result<(), ConfigError> {
        let Lanes::Table(t) = &self.lanes else {
            return Ok(());
        };
        let one = (t.len() == 1).then(|| &t[0]);
        let queues_clash =
            one.is_none_or(|l| !l.queues.is_empty() && l.queues != self.devmem_queues);
        if !self.devmem_queues.is_empty() && queues_clash {
            return Err(invalid(
                "devmem_queues",
                format!("{:?}", self.devmem_queues),
                "is not used beside a `lanes` table of several lanes, or of one lane with \
                 queues of its own: list each lane's RX queues in its table, lanes[i].queues \
                 (e.g. lanes = [{ queues = [8, 9] }]), and drop devmem_queues",
            ));
        }
        let Some(n) = &self.devmem_interface else {
            return Ok(());
        };
        if one.is_none_or(|l| l.interface.as_ref().is_some_and(|i| i != n)) {
            return Err(invalid(
                "devmem_interface",
                format!("{n:?}"),
                format!(
                    "is not used beside a `lanes` table of several lanes, and would override \
                     the interface of a lane that names another: name each lane's NIC in its \
                     table, lanes[i].interface (e.g. lanes = [{{ interface = {n:?} }}]), and \
                     drop devmem_interface"
                ),
            ));
        }
        Ok(())
    }

    /// No queue 0 in `devmem_queues` or a lane's `queues` where the node sets a real NIC up
    /// (`receive` = devmem or auto): it keeps RSS, the host's other traffic, on the queues
    /// below the lowest bound one, and none is below queue 0. The node refuses it when it
    /// binds (`auto` then fell back to host); refused here, `config check` and the start name
    /// the key before any NIC is touched. `devmem-sim` binds only emulated NICs, whose queues
    /// carry no other traffic, so it takes any queue.
    fn validate_queue_zero(&self) -> Result<(), ConfigError> {
        if !matches!(self.receive, ReceiveMode::Devmem | ReceiveMode::Auto) {
            return Ok(());
        }
        let why = format!(
            "lists queue 0, which receive = {} leaves to RSS for the host's other traffic (RSS \
             is kept on the queues below the lowest bound one, and none is below 0): name RX \
             queues from 1 up, e.g. the upper half of the NIC's (`shardwire nics` shows RXQ); \
             receive = \"devmem-sim\" takes it (its emulated NIC carries no other traffic)",
            self.receive
        );
        if self.devmem_queues.contains(&0) {
            let v = format!("{:?}", self.devmem_queues);
            return Err(invalid("devmem_queues", v, why));
        }
        if let Lanes::Table(t) = &self.lanes
            && let Some((i, l)) = t.iter().enumerate().find(|(_, l)| l.queues.contains(&0))
        {
            let v = format!("lanes[{i}].queues = {:?}", l.queues);
            return Err(invalid("lanes", v, why));
        }
        Ok(())
    }

    /// A `lanes` table's lanes x `flows` within [`MAX_SESSION_FLOWS`] (`lanes = "auto"`
    /// finds its lanes at start, where the node checks the same): a source refuses every
    /// session of a node that asks for more.
    fn validate_session_flows(&self) -> Result<(), ConfigError> {
        let Lanes::Table(t) = &self.lanes else {
            return Ok(());
        };
        let (lanes, flows) = (t.len() as u64, u64::from(self.flows));
        if lanes == 0 || lanes * flows <= MAX_SESSION_FLOWS {
            return Ok(());
        }
        Err(invalid(
            "flows",
            self.flows,
            format!(
                "is per source and per lane: the {lanes} lanes of the `lanes` table ask each \
                 source for {} data connections, and a source dials at most \
                 {MAX_SESSION_FLOWS} per node (lanes x flows); set flows to at most {}, or \
                 list fewer lanes",
                lanes * flows,
                MAX_SESSION_FLOWS / lanes
            ),
        ))
    }

    /// Checks ranges and relations between keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.flows == 0 || self.flows > 64 {
            return Err(invalid("flows", self.flows, "must be between 1 and 64"));
        }
        let stream_memory = self.stream_memory();
        if stream_memory < 64 << 10 {
            let what = if self.stream_memory.is_some() {
                "must be at least 64KiB"
            } else {
                "(derived from pool_size) must be at least 64KiB: raise pool_size"
            };
            return Err(invalid("stream_memory", ByteSize(stream_memory), what));
        }
        if let Some(sm) = self.stream_memory
            && self.pool_size.0 < sm.0
        {
            return Err(invalid(
                "pool_size",
                self.pool_size,
                format!(
                    "must be at least stream_memory ({sm}); or leave stream_memory unset to derive it from pool_size"
                ),
            ));
        }
        for (key, v) in [
            ("http_max_connections", self.http_max_connections),
            ("trainer_max_connections", self.trainer_max_connections),
        ] {
            check_connections(key, v)?;
        }
        for (key, v) in [
            ("http_header_timeout_secs", self.http_header_timeout_secs),
            ("http_body_timeout_secs", self.http_body_timeout_secs),
            ("http_write_timeout_secs", self.http_write_timeout_secs),
            (
                "trainer_request_timeout_secs",
                self.trainer_request_timeout_secs,
            ),
        ] {
            check_secs(key, v, 1)?;
        }
        check_secs("drain_timeout_secs", self.drain_timeout_secs, 0)?;
        check_secs(
            "trainer_idle_timeout_secs",
            self.trainer_idle_timeout_secs,
            0,
        )?;
        check_size("pool_size", self.pool_size)?;
        check_size("stream_memory", ByteSize(stream_memory))?;
        self.validate_devmem()?;
        self.socket_mode_bits()?;
        self.lanes.validate()?;
        self.validate_lane_table()?;
        self.validate_queue_zero()?;
        self.validate_session_flows()?;
        self.source_entries()?;
        if !(1..=3600).contains(&self.source_resolve_secs) {
            return Err(invalid(
                "source_resolve_secs",
                self.source_resolve_secs,
                "must be between 1 and 3600",
            ));
        }
        Ok(())
    }
}

impl ServeConfig {
    /// The region size of each stream: `stream_memory`, or when it is unset
    /// min([`DEFAULT_STREAM_MEMORY`], `pool_size`).
    pub fn stream_memory(&self) -> u64 {
        self.stream_memory
            .map_or(DEFAULT_STREAM_MEMORY.min(self.pool_size.0), |b| b.0)
    }

    /// How `stream_memory` was chosen, for the startup log.
    pub fn stream_memory_origin(&self) -> String {
        match self.stream_memory {
            Some(b) => format!("stream_memory = {b} (configured)"),
            None => format!(
                "stream_memory not set: using {} = min({}, pool_size {})",
                ByteSize(self.stream_memory()),
                ByteSize(DEFAULT_STREAM_MEMORY),
                self.pool_size
            ),
        }
    }

    /// `sources`, parsed; an entry that is neither `HOST:PORT` nor `dns:NAME:PORT`, whose
    /// host ends in an all-digit label without being a dotted quad, or whose `HOST` is a
    /// dotted quad with a trailing dot ([`SourceEntryError::NumericHost`]), is an error naming it.
    pub fn source_entries(&self) -> Result<Vec<SourceEntry>, ConfigError> {
        self.sources
            .iter()
            .map(|s| {
                SourceEntry::parse(s).map_err(|e| match e {
                    SourceEntryError::NumericHost { why, .. } => invalid("sources", s, why),
                    e => invalid(
                        "sources",
                        s,
                        format!("{e}; each source is HOST:PORT or dns:NAME:PORT"),
                    ),
                })
            })
            .collect()
    }

    /// `socket_mode` as permission bits: an optional `0o`, once, then 1 to 12 octal digits
    /// (`"0660"`, `"660"`, `"0o660"`, `"00660"`), at most `0777`; no sign, no space, no
    /// second prefix.
    pub fn socket_mode_bits(&self) -> Result<u32, ConfigError> {
        let m = self.socket_mode.as_str();
        let digits = m
            .strip_prefix("0o")
            .or_else(|| m.strip_prefix("0O"))
            .unwrap_or(m);
        // Leading zeros are only zeros ("00660" loaded before, as chmod takes it).
        let octal =
            (1..=12).contains(&digits.len()) && digits.bytes().all(|b| (b'0'..=b'7').contains(&b));
        let bits = if octal {
            u32::from_str_radix(digits, 8).ok()
        } else {
            None
        };
        bits.filter(|b| *b <= 0o777).ok_or_else(|| {
            invalid(
                "socket_mode",
                format!("{m:?}"),
                "must be permission bits in octal, at most \"0777\": digits 0-7, \
                     optionally after one \"0o\" (e.g. \"0660\" or \"0o660\"; no sign)",
            )
        })
    }

    /// Whether a trainer with these credentials may use the socket.
    pub fn peer_allowed(&self, uid: u32, gid: u32) -> bool {
        (self.allowed_uids.is_empty() && self.allowed_gids.is_empty())
            || self.allowed_uids.contains(&uid)
            || self.allowed_gids.contains(&gid)
    }
}

/// How to give `datasets` when none is: where a load merges the environment, any of the file,
/// SHARDWIRE_DATASETS or `--dataset`; where it judges the file alone (`config check`), the file
/// must, since no variable is applied there.
fn no_datasets_fix(env: EnvLayer) -> &'static str {
    match env {
        EnvLayer::Merge => {
            "give at least one NAME=DIR: `datasets = [\"NAME=DIR\"]` in the config file, \
             SHARDWIRE_DATASETS='[\"NAME=DIR\"]' in the environment, or \
             `shardwire source --dataset NAME=DIR`"
        }
        EnvLayer::Skip => {
            "the file gives no dataset: `config check` judges the file alone and applies no \
             SHARDWIRE_* variable, so the file must give at least one, \
             `datasets = [\"NAME=DIR\"]` (`shardwire config print --source-config --config \
             FILE` shows the file with the environment merged, as `source` reads it)"
        }
    }
}

impl SourceConfig {
    /// Merges defaults < file < env < `flags`.
    pub fn load(file: Option<&Path>, flags: &impl Serialize) -> Result<Self, ConfigError> {
        Self::load_with(file, flags, EnvLayer::Merge)
    }

    /// Defaults < `file` alone, validated, with no `SHARDWIRE_*` variable merged (as
    /// [`ServeConfig::load_file`]).
    pub fn load_file(file: &Path) -> Result<Self, ConfigError> {
        Self::load_with(Some(file), &NoFlags {}, EnvLayer::Skip)
    }

    fn load_with(
        file: Option<&Path>,
        flags: &impl Serialize,
        env: EnvLayer,
    ) -> Result<Self, ConfigError> {
        let c: Self = load(file, flags, env)?;
        if c.datasets.is_empty() {
            return Err(invalid("datasets", "[]", no_datasets_fix(env)));
        }
        check_datasets(&c.datasets)?;
        if !(1..=u64::from(u16::MAX)).contains(&c.idle_timeout_secs) {
            return Err(invalid(
                "idle_timeout_secs",
                c.idle_timeout_secs,
                "must be between 1 and 65535",
            ));
        }
        check_connections("max_connections", c.max_connections)?;
        check_secs("drain_timeout_secs", c.drain_timeout_secs, 1)?;
        let tx = c.devmem_tx_memory;
        if !((64 << 10)..=(1 << 40)).contains(&tx.0) {
            return Err(invalid(
                "devmem_tx_memory",
                tx,
                "must be between 64KiB (16 slots of 4KiB) and 1TiB",
            ));
        }
        // Any value given, the default's too: a key that is read and then ignored misleads.
        if c.devmem_tx.is_empty() && given::<Self>("devmem_tx_memory", file, flags, env)? {
            return Err(invalid(
                "devmem_tx_memory",
                tx,
                "needs devmem_tx: the interfaces whose TX bindings it sizes; set devmem_tx or \
                 drop devmem_tx_memory",
            ));
        }
        c.check_object_store()?;
        interfaces::check("devmem_tx", &c.devmem_tx)?;
        if c.devmem_tx_emulate && c.devmem_tx.is_empty() {
            return Err(invalid(
                "devmem_tx_emulate",
                true,
                "needs devmem_tx: the interfaces whose TX bindings it emulates",
            ));
        }
        Ok(c)
    }

    /// The object-storage keys: sizes in range, a cache size with a cache directory.
    fn check_object_store(&self) -> Result<(), ConfigError> {
        if !(1..=1024).contains(&self.object_store_max_inflight) {
            return Err(invalid(
                "object_store_max_inflight",
                self.object_store_max_inflight,
                "must be between 1 and 1024",
            ));
        }
        let rs = self.object_store_request_size.0;
        if !((64 << 10)..=(1 << 30)).contains(&rs) {
            return Err(invalid(
                "object_store_request_size",
                rs,
                "must be between 64KiB and 1GiB (8MiB-16MiB suits S3)",
            ));
        }
        if self.cache_dir.is_some() && self.cache_size.0 == 0 {
            return Err(invalid(
                "cache_size",
                0,
                "set cache_size (e.g. 500GiB) when cache_dir is set",
            ));
        }
        if self.cache_dir.is_none() && self.cache_size.0 > 0 {
            return Err(invalid(
                "cache_size",
                self.cache_size.0,
                "cache_size without cache_dir caches nothing: set cache_dir (a local \
                 directory, e.g. /nvme/shardwire-cache) or drop cache_size",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Default)]
    struct Flags {
        #[serde(skip_serializing_if = "Option::is_none")]
        flows: Option<u16>,
    }

    fn write(content: &str) -> PathBuf {
        // One file per call: tests run in parallel, and two contents of one length collided.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("sw-config-{}-{n}.toml", std::process::id(),));
        std::fs::write(&p, content).unwrap();
        p
    }

    #[test]
    fn object_storage_keys_are_read_and_checked() {
        let p = write(
            "datasets = [\"web=s3://bucket/web\"]\ncache_dir = \"/var/cache/sw\"\ncache_size = \"500GiB\"\nobject_store_max_inflight = 64\nobject_store_request_size = \"16MiB\"\n",
        );
        let c = SourceConfig::load(Some(&p), &Flags::default()).unwrap();
        assert_eq!(c.cache_size.0, 500 << 30);
        assert_eq!(c.object_store_max_inflight, 64);
        assert_eq!(c.object_store_request_size.0, 16 << 20);
        let p = write("datasets = [\"web=s3://bucket/web\"]\ncache_dir = \"/var/cache/sw\"\n");
        let e = SourceConfig::load(Some(&p), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`cache_size`") && e.contains("when cache_dir is set"),
            "{e}"
        );
        let p = write("datasets = [\"web=/d\"]\nobject_store_request_size = 1024\n");
        let e = SourceConfig::load(Some(&p), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`object_store_request_size`") && e.contains("64KiB"),
            "{e}"
        );
        // The reverse: a size without a directory cached nothing, without a word.
        let p = write("datasets = [\"web=s3://bucket/web\"]\ncache_size = \"1GiB\"\n");
        let e = SourceConfig::load(Some(&p), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`cache_size`") && e.contains("set cache_dir"),
            "{e}"
        );
        let d = SourceConfig::default();
        assert_eq!(d.object_store_request_size.0, 8 << 20);
        assert_eq!(d.cache_dir, None);
    }

    #[test]
    fn waits_and_connection_limits_past_what_the_node_can_count_are_refused() {
        // Before, `drain_timeout_secs = 9223372036854775807` ("forever") loaded, and the
        // node panicked adding it to the clock; a connection limit past 2^61 panicked in
        // the semaphore that counts connections.
        for (toml, key) in [
            (
                "drain_timeout_secs = 9223372036854775807\n",
                "drain_timeout_secs",
            ),
            (
                "trainer_request_timeout_secs = 9223372036854775807\n",
                "trainer_request_timeout_secs",
            ),
            (
                "trainer_idle_timeout_secs = 31536001\n",
                "trainer_idle_timeout_secs",
            ),
            (
                "http_max_connections = 4611686018427387904\n",
                "http_max_connections",
            ),
        ] {
            let e = ServeConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(key) && e.contains("must be between"),
                "{toml}: {e}"
            );
        }
        let ok = "drain_timeout_secs = 31536000\ntrainer_idle_timeout_secs = 0\n";
        assert!(ServeConfig::load(Some(&write(ok)), &Flags::default()).is_ok());
        let ds = "datasets = [\"d=/data\"]\n";
        for (extra, key) in [
            ("max_connections = 2305843009213693952\n", "max_connections"),
            (
                "drain_timeout_secs = 9223372036854775807\n",
                "drain_timeout_secs",
            ),
            (
                "devmem_tx = [\"eth1\"]\ndevmem_tx_memory = \"32KiB\"\n",
                "devmem_tx_memory",
            ),
            ("devmem_tx_memory = \"128MiB\"\n", "devmem_tx_memory"),
        ] {
            let p = write(&format!("{ds}{extra}"));
            let e = SourceConfig::load(Some(&p), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
    }

    #[test]
    fn socket_mode_as_a_number_is_refused_naming_the_form_to_use() {
        // TOML reads 0o660 as 432 and the environment's 0660 as 660: neither can be read back
        // as what was meant (0o432 would let every local user connect).
        // `true`: before, "data did not match any variant of untagged enum Either".
        for toml in [
            "socket_mode = 0o660\n",
            "socket_mode = 660\n",
            "socket_mode = true\n",
        ] {
            let e = ServeConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("\"0660\"") && e.contains("SHARDWIRE_SOCKET_MODE"),
                "{toml}: {e}"
            );
        }
        let c =
            ServeConfig::load(Some(&write("socket_mode = \"0600\"\n")), &Flags::default()).unwrap();
        assert_eq!(c.socket_mode_bits().unwrap(), 0o600);
    }

    #[test]
    fn choice_keys_take_their_names_not_integers() {
        for toml in [
            "receive = 2\n",
            "memory = 2\n",
            "log_format = 1\n",
            "receive = \"fast\"\n",
        ] {
            let e = ServeConfig::load(Some(&write(toml)), &Flags::default());
            assert!(
                e.is_err(),
                "{toml} loaded as {:?}",
                e.map(|c| (c.receive, c.memory))
            );
        }
        let c = ServeConfig::load(
            Some(&write(
                "receive = \"devmem-sim\"\nmemory = \"cuda\"\nlog_format = \"json\"\n",
            )),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(
            (c.receive, c.memory, c.log_format),
            (ReceiveMode::DevmemSim, MemoryMode::Cuda, LogFormat::Json)
        );
    }

    #[test]
    fn datasets_are_name_equals_place_each_name_once() {
        for (toml, want) in [
            ("datasets = [\"example\"]\n", "NAME=DIR"),
            ("datasets = [\"=/data\"]\n", "NAME=DIR"),
            ("datasets = [\"a=/x\", \"a=/y\"]\n", "given twice"),
        ] {
            let e = SourceConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("datasets") && e.contains(want), "{toml}: {e}");
        }
        let ok = "datasets = [\"a=/x\", \"b=s3://bucket/b\"]\n";
        assert!(SourceConfig::load(Some(&write(ok)), &Flags::default()).is_ok());
    }

    #[test]
    fn a_dataset_url_of_a_scheme_no_store_serves_is_refused_naming_those_served() {
        // Before, `config check` passed them, and the source opened each as a directory.
        for (place, scheme) in [
            ("gcs://bucket/imagenet", "gcs"),
            ("s3a://bucket/web", "s3a"),
            ("abfss://c@acct.dfs.core.windows.net/d", "abfss"),
        ] {
            let toml = format!("datasets = [\"d={place}\"]\n");
            let e = SourceConfig::load(Some(&write(&toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("`datasets`") && e.contains(&format!("unsupported scheme `{scheme}`")),
                "{e}"
            );
            assert!(e.contains("gs://BUCKET/PREFIX"), "{e}");
        }
        for place in ["S3://bucket/d", "https://host/d", "file:///d", "/d/x://y"] {
            let toml = format!("datasets = [\"d={place}\"]\n");
            let c = SourceConfig::load(Some(&write(&toml)), &Flags::default());
            assert!(c.is_ok(), "{place}");
        }
    }

    #[test]
    fn a_refused_dataset_entry_never_repeats_a_urls_secret() {
        // Before, each was repeated whole: `alice:s3cr3t` and all.
        for spec in [
            "https://alice:s3cr3t@files.example/ds",
            "https://alice:s3=cr3t@files.example/ds",
            "d=gcs://alice:s3cr3t@bucket/ds",
            "d=s3a://bkt/ds?X-Amz-Signature=s3cr3t",
            // Given twice: the second one is repeated.
            "d=/x\", \"d=https://alice:s3cr3t@h/ds",
        ] {
            let toml = format!("datasets = [\"{spec}\"]\n");
            let e = SourceConfig::load(Some(&write(&toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("`datasets`"), "{e}");
            assert!(!e.contains("cr3t") && !e.contains("alice"), "{e}");
        }
        for (spec, shown) in [
            (
                "ds=https://user:pa#ss@host/ds?sig=tok3n",
                "ds=https://***@host/ds?...",
            ),
            ("s3://AKIA:wJal/rXtok3n@bkt/ds", "s3://***@bkt/ds"),
            ("bkt/ds?X-Amz-Signature=tok3n&r=https://x", "bkt/ds?..."),
            ("a?sig=tok3n&r=https://u:p@h", "a?..."),
            ("AKIA:tok3n@bkt/ds", "***@bkt/ds"),
            ("web=/data/web", "web=/data/web"),
        ] {
            assert_eq!(redacted_spec(spec), shown);
        }
    }

    #[test]
    fn dataset_names_the_protocol_refuses_are_refused_naming_the_datasets_key() {
        // Before, `config check` passed them and `source` refused them at start, naming a
        // `--dataset` flag that was never given.
        for (toml, want) in [
            ("datasets = [\"my data=/d\"]\n", "has the character ' '"),
            ("datasets = [\"a/b=/d\"]\n", "has the character '/'"),
            ("datasets = [\"..=s3://bucket/p\"]\n", "names a directory"),
        ] {
            let e = SourceConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("`datasets`") && e.contains(want), "{toml}: {e}");
            assert!(
                e.contains("[A-Za-z0-9._-]") && !e.contains("--dataset"),
                "{e}"
            );
        }
        let long = format!("datasets = [\"{}=/d\"]\n", "n".repeat(MAX_DATASET_NAME + 1));
        let e = SourceConfig::load(Some(&write(&long)), &Flags::default()).unwrap_err();
        assert!(e.to_string().contains("256 bytes long"), "{e}");
        let ok = format!(
            "datasets = [\"web-2024.v1_a=/d\", \"{}=/e\"]\n",
            "n".repeat(255)
        );
        assert!(SourceConfig::load(Some(&write(&ok)), &Flags::default()).is_ok());
    }

    #[test]
    fn a_lanes_table_asking_a_source_for_more_connections_than_it_dials_is_refused() {
        // Before, 9 lanes of 32 flows loaded; every source then refused every session (288
        // data connections, at most 256) and the node reconnected for ever.
        let nine = format!("lanes = [{}]\n", ["{}"; 9].join(", "));
        let e = ServeConfig::load(Some(&write(&nine)), &Flags { flows: Some(32) })
            .unwrap_err()
            .to_string();
        for want in [
            "`flows` = 32",
            "9 lanes",
            "288 data connections",
            "at most 256",
            "at most 28",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        let eight = format!("lanes = [{}]\n", ["{}"; 8].join(", "));
        let c = ServeConfig::load(Some(&write(&eight)), &Flags { flows: Some(32) }).unwrap();
        assert_eq!(c.flows, 32, "8 x 32 = 256: the most a source dials");
        // `auto` finds its lanes at start: the node checks it then.
        assert!(ServeConfig::load(None, &Flags { flows: Some(64) }).is_ok());
    }

    #[test]
    fn no_datasets_names_every_place_they_come_from() {
        // Before: only `--dataset`, a flag `config print --source-config` does not have.
        let file = write("listen = \"127.0.0.1:7500\"\n");
        let e = SourceConfig::load(Some(&file), &Flags::default())
            .unwrap_err()
            .to_string();
        for place in ["`datasets = [", "SHARDWIRE_DATASETS=", "--dataset NAME=DIR"] {
            assert!(e.contains(place), "{place}: {e}");
        }
    }

    #[test]
    fn config_check_asks_the_file_for_datasets() {
        // Before: `config check`, which applies no variable, told a user to set
        // SHARDWIRE_DATASETS or pass `--dataset`: doing so changed nothing.
        let file = write("listen = \"127.0.0.1:7500\"\n");
        let e = SourceConfig::load_file(&file).unwrap_err().to_string();
        for place in ["`datasets = [", "judges the file alone", "config print"] {
            assert!(e.contains(place), "{place}: {e}");
        }
        for advice in ["SHARDWIRE_DATASETS=", "--dataset"] {
            assert!(!e.contains(advice), "{advice}: {e}");
        }
    }

    #[test]
    fn layering_file_then_flags() {
        let p = write("flows = 3\npool_size = \"2GiB\"\nstream_memory = 1048576\n");
        let c = ServeConfig::load(Some(&p), &Flags::default()).unwrap();
        assert_eq!(
            (c.flows, c.pool_size.0, c.stream_memory()),
            (3, 2 << 30, 1 << 20)
        );
        let c = ServeConfig::load(Some(&p), &Flags { flows: Some(5) }).unwrap();
        assert_eq!(c.flows, 5);
    }

    #[test]
    fn unknown_key_is_named() {
        let p = write("flowz = 3\n");
        let e = ServeConfig::load(Some(&p), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("flowz"), "{e}");
    }

    #[test]
    fn misspelled_environment_variables_are_named() {
        let vars = [
            ("SHARDWIRE_CACHEDIR", "/nvme"),
            ("SHARDWIRE_CACHE_SIZE", "500GiB"),
            ("SHARDWIRE_POOL_SIZE", "8GiB"),
            ("SHARDWIRE_socket", "/run/sw.sock"),
            ("SHARDWIRE_OBJECT_STORE_REQUEST_SIZ", "16MiB"),
            ("SHARDWIRE_BIN", "target/debug/shardwire"),
            ("SHARDWIRE_HW_IFNAME", "eth1"),
            ("SHARDWIRE_SKIP_LINT", "1"),
            // Before: both were warned about as misspelled keys at every start.
            ("SHARDWIRE_E2E_WORKERS", "4"),
            ("SHARDWIRE_E2E_RUST_LOG", "debug"),
            ("SHARDWIRE_FAKE_CUDA_CHILD", "1"),
            ("PATH", "/usr/bin"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(
            unknown_env(vars),
            ["SHARDWIRE_CACHEDIR", "SHARDWIRE_OBJECT_STORE_REQUEST_SIZ"]
        );
    }

    #[test]
    fn optional_keys_are_known_to_the_environment_filter() {
        let k = keys::<ServeConfig>();
        assert!(
            k.iter().any(|x| x == "secret_file") && k.iter().any(|x| x == "admin_token_file"),
            "{k:?}"
        );
    }

    #[derive(Serialize, Default)]
    struct PoolFlags {
        pool_size: Option<ByteSize>,
        #[serde(skip_serializing_if = "Option::is_none")]
        stream_memory: Option<ByteSize>,
    }

    #[test]
    fn stream_memory_is_derived_from_a_small_pool_and_checked_when_set() {
        let small = PoolFlags {
            pool_size: Some(ByteSize(64 << 20)),
            stream_memory: None,
        };
        let c = ServeConfig::load(None, &small).unwrap();
        assert_eq!(c.stream_memory(), 64 << 20);
        assert!(
            c.stream_memory_origin().contains("not set"),
            "{}",
            c.stream_memory_origin()
        );
        let big = PoolFlags {
            pool_size: Some(ByteSize(8 << 30)),
            stream_memory: None,
        };
        assert_eq!(
            ServeConfig::load(None, &big).unwrap().stream_memory(),
            DEFAULT_STREAM_MEMORY
        );
        let both = PoolFlags {
            pool_size: Some(ByteSize(64 << 20)),
            stream_memory: Some(ByteSize(256 << 20)),
        };
        let e = ServeConfig::load(None, &both).unwrap_err().to_string();
        assert!(
            e.contains("`pool_size`") && e.contains("stream_memory (256MiB)"),
            "{e}"
        );
    }

    #[test]
    fn numeric_hosts_that_are_no_dotted_quad_are_refused() {
        // Before, each was taken as a host name, which getaddrinfo dials as IPv4 shorthand
        // (10.1.5 -> 10.1.0.5, 167772165 -> 10.0.0.5) or never reaches (10.0.0.300, src.123
        // and 10.0.0.5. go to DNS).
        for (bad, host, why) in [
            (
                "10.1.5:7500",
                "10.1.5",
                "all numbers but not an IPv4 address",
            ),
            (
                "167772165:7500",
                "167772165",
                "all numbers but not an IPv4 address",
            ),
            (
                "10.0.0.300:7500",
                "10.0.0.300",
                "all numbers but not an IPv4 address",
            ),
            (
                "010.0.0.5:7500",
                "010.0.0.5",
                "all numbers but not an IPv4 address",
            ),
            (
                "dns:10.1.5:7500",
                "10.1.5",
                "all numbers but not an IPv4 address",
            ),
            (
                "10.1.5.:7500",
                "10.1.5",
                "all numbers but not an IPv4 address",
            ),
            (
                "src.123:7500",
                "src.123",
                "a top-level domain is never all digits",
            ),
            (
                "0xa.1.5:7500",
                "0xa.1.5",
                "another notation (0xa.1.5 is 10.1.0.5)",
            ),
            ("10.0.0.5.:7500", "10.0.0.5.", "with a trailing dot"),
            ("10.0.0.5..:7500", "10.0.0.5..", "with a trailing dot"),
        ] {
            let c = ServeConfig {
                sources: vec![bad.into()],
                ..ServeConfig::default()
            };
            let e = c.source_entries().unwrap_err().to_string();
            assert!(
                e.contains("`sources`") && e.contains(bad) && e.contains(&format!("`{host}`")),
                "{bad}: {e}"
            );
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = ServeConfig {
            sources: vec!["10.0.0.5.:7500".into()],
            ..ServeConfig::default()
        }
        .source_entries()
        .unwrap_err()
        .to_string();
        assert!(e.contains("without the dot (10.0.0.5)"), "{e}");
        for good in [
            "10.0.0.5:7500",
            "[::1]:7500",
            "src-0.src.ml.svc:7500",
            "src-0.src.ml.svc.:7500",
            "1e100.net:443",
            "dns:shardwire-source.ml.svc:7500",
            "dns:10.0.0.5:7500",
        ] {
            let c = ServeConfig {
                sources: vec![good.into()],
                ..ServeConfig::default()
            };
            assert!(c.source_entries().is_ok(), "{good}");
        }
        // A `dns:` NAME is stored (and resolved) without its trailing dot.
        let c = ServeConfig {
            sources: vec!["dns:10.0.0.5.:7500".into()],
            ..ServeConfig::default()
        };
        let entries = c.source_entries().unwrap();
        assert_eq!(entries[0].lookup().as_deref(), Some("10.0.0.5:7500"));
    }

    #[test]
    fn dns_sources_and_their_resolve_interval_are_checked() {
        let p = write(
            "sources = [\"dns:shardwire-source.ml.svc:7500\", \"10.0.0.9:7500\"]\nsource_resolve_secs = 5\n",
        );
        let c = ServeConfig::load(Some(&p), &Flags::default()).unwrap();
        assert_eq!(c.source_resolve_secs, 5);
        let entries = c.source_entries().unwrap();
        assert_eq!(
            entries[0].lookup().as_deref(),
            Some("shardwire-source.ml.svc:7500")
        );
        assert_eq!(entries[1], SourceEntry::Addr("10.0.0.9:7500".into()));
        let p = write("sources = [\"dns:bad name:7500\"]\n");
        let e = ServeConfig::load(Some(&p), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`sources`") && e.contains("bad name") && e.contains("dns:NAME:PORT"),
            "{e}"
        );
        let p = write("source_resolve_secs = 0\n");
        let e = ServeConfig::load(Some(&p), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`source_resolve_secs`"), "{e}");
        assert_eq!(ServeConfig::default().source_resolve_secs, 10);
        assert_eq!(SourceConfig::default().drain_timeout_secs, 30);
    }

    #[test]
    fn sizes_past_any_memory_and_a_queue_listed_twice_are_refused_naming_the_key() {
        // Before, each loaded: u64::MAX overflowed rounding it up to pages (a panic, or a
        // wrap to 0 and the kernel's EINVAL naming no key); the queue failed at the bind.
        for (toml, key, allowed) in [
            (
                "devmem_memory = \"18446744073709551615\"\n",
                "devmem_memory",
                "at most 64TiB",
            ),
            ("pool_size = \"128TiB\"\n", "pool_size", "at most 64TiB"),
            (
                "lanes = [{ devmem_memory = \"128TiB\" }]\n",
                "lanes[0].devmem_memory",
                "at most 64TiB",
            ),
            (
                "devmem_queues = [8, 9, 8]\n",
                "devmem_queues",
                "queue 8 twice",
            ),
        ] {
            let e = ServeConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains(allowed), "{toml}: {e}");
        }
        let ok = "pool_size = \"64TiB\"\nstream_memory = \"1GiB\"\ndevmem_queues = [8, 9]\n";
        assert!(ServeConfig::load(Some(&write(ok)), &Flags::default()).is_ok());
    }

    #[test]
    fn queue_0_is_refused_at_load_where_the_node_steers_a_real_nic() {
        // Before, each loaded: `devmem` failed at the bind, `auto` fell back to host.
        for (toml, value) in [
            (
                "receive = \"devmem\"\ndevmem_queues = [0, 1]\n",
                "`devmem_queues` = [0, 1]",
            ),
            ("devmem_queues = [0]\n", "`devmem_queues` = [0]"),
            (
                "lanes = [{ queues = [8] }, { queues = [0, 1] }]\n",
                "lanes[1].queues = [0, 1]",
            ),
        ] {
            let e = ServeConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(value), "{toml}: {e}");
            assert!(
                e.contains("queue 0") && e.contains("from 1 up"),
                "{toml}: {e}"
            );
        }
        // The emulator and host receive steer no real NIC: queue 0 is theirs to take.
        for ok in [
            "receive = \"devmem-sim\"\ndevmem_queues = [0, 1]\n",
            "receive = \"devmem-sim\"\nlanes = [{ queues = [0] }]\n",
            "receive = \"host\"\ndevmem_queues = [0]\n",
        ] {
            let c = ServeConfig::load(Some(&write(ok)), &Flags::default());
            assert!(c.is_ok(), "{ok}: {:?}", c.err().map(|e| e.to_string()));
        }
    }

    #[test]
    fn devmem_queues_and_devmem_interface_are_refused_beside_a_lane_table() {
        // Before, both loaded: a table's lane binds only lanes[i].queues (devmem_queues was
        // dropped without a word) and devmem_interface took the place of lanes[0].interface.
        for (toml, key, fix) in [
            (
                "lanes = [{ queues = [10] }]\ndevmem_queues = [8, 9]\n",
                "`devmem_queues` = [8, 9]",
                "lanes[i].queues",
            ),
            (
                "lanes = [{}, {}]\ndevmem_queues = [8, 9]\n",
                "`devmem_queues` = [8, 9]",
                "lanes[i].queues",
            ),
            (
                "lanes = [{ interface = \"eth1\" }]\ndevmem_interface = \"eth2\"\n",
                "`devmem_interface` = \"eth2\"",
                "lanes[i].interface",
            ),
            (
                concat!(
                    "lanes = [{ data_listen = \"127.0.0.1:0\" }, { data_listen = \"127.0.0.2:0\" }]\n",
                    "devmem_interface = \"eth1\"\n"
                ),
                "`devmem_interface`",
                "lanes[i].interface",
            ),
        ] {
            let e = ServeConfig::load(Some(&write(toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains(fix), "{toml}: {e}");
        }
        // The Kubernetes hosts' one plain lane, with or without the node-wide keys (they are
        // its own, as for any node of one lane), and both keys with lanes auto, still load.
        for ok in [
            "lanes = [{}]\n",
            "lanes = [{}]\ndevmem_interface = \"eth1\"\ndevmem_queues = [8, 9]\n",
            "lanes = [{ interface = \"eth1\" }]\ndevmem_interface = \"eth1\"\n",
            "lanes = [{ interface = \"eth1\", queues = [8, 9] }]\n",
            "devmem_interface = \"eth1\"\ndevmem_queues = [8, 9]\n",
            "lanes = \"auto\"\ndevmem_interface = \"eth1\"\ndevmem_queues = [8, 9]\n",
        ] {
            let c = ServeConfig::load(Some(&write(ok)), &Flags::default());
            assert!(c.is_ok(), "{ok}: {:?}", c.err().map(|e| e.to_string()));
        }
    }

    #[test]
    fn devmem_interface_is_a_name_linux_takes() {
        // Before, each loaded and failed at start (or matched no NIC) naming no key.
        for name in [
            "",
            "eth1 ",
            "eth\t1",
            ".",
            "..",
            "eth1:0",
            "a-very-long-interface",
        ] {
            let toml = format!("devmem_interface = {name:?}\n");
            let e = ServeConfig::load(Some(&write(&toml)), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("`devmem_interface`")
                    && e.contains(&format!("{name:?}"))
                    && e.contains("not an interface name"),
                "{toml}: {e}"
            );
        }
        let c = ServeConfig::load(
            Some(&write("devmem_interface = \"enp25s0f1np1\"\n")),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(c.devmem_interface.as_deref(), Some("enp25s0f1np1"));
    }

    #[derive(Serialize, Default)]
    struct TxFlags {
        #[serde(skip_serializing_if = "Option::is_none")]
        devmem_tx_memory: Option<ByteSize>,
    }

    #[test]
    fn devmem_tx_memory_without_devmem_tx_is_refused_even_at_its_default() {
        // Before, only a value other than the default was refused: `devmem_tx_memory =
        // "64MiB"` alone loaded and was ignored.
        let ds = "datasets = [\"d=/data\"]\n";
        let file = write(&format!("{ds}devmem_tx_memory = \"64MiB\"\n"));
        let e = SourceConfig::load(Some(&file), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`devmem_tx_memory` = 64MiB") && e.contains("needs devmem_tx"),
            "{e}"
        );
        let flag = TxFlags {
            devmem_tx_memory: Some(ByteSize(64 << 20)),
        };
        let e = SourceConfig::load(Some(&write(ds)), &flag)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`devmem_tx_memory`"), "{e}");
        // Left unset it is the default, with or without devmem_tx; set, it is taken with it.
        let c = SourceConfig::load(Some(&write(ds)), &TxFlags::default()).unwrap();
        assert_eq!(c.devmem_tx_memory, ByteSize(64 << 20));
        let with = write(&format!("{ds}devmem_tx = \"eth1\"\n"));
        let c = SourceConfig::load(Some(&with), &flag).unwrap();
        assert_eq!(c.devmem_tx_memory, ByteSize(64 << 20));
        let c = SourceConfig::load(Some(&with), &TxFlags::default()).unwrap();
        assert_eq!(c.devmem_tx_memory, SourceConfig::default().devmem_tx_memory);
    }

    #[test]
    fn socket_mode_is_one_optional_0o_then_octal_digits() {
        // Before, "+660" and "0o0o660" were read as 0o660 (from_str_radix takes a sign, and
        // trim_start_matches removed every "0o").
        let bits = |m: &str| {
            ServeConfig {
                socket_mode: m.to_owned(),
                ..ServeConfig::default()
            }
            .socket_mode_bits()
        };
        for bad in [
            "+660",
            "-660",
            "0o0o660",
            "0o+660",
            "",
            "0o",
            " 0660",
            "0660 ",
            "0x1b4",
            "8",
            "0o8",
            "1777",
            "0o0o0",
            "0000000000000",
        ] {
            let e = bits(bad).expect_err(bad).to_string();
            let named = e.contains(&format!("{bad:?}"));
            assert!(
                e.contains("`socket_mode`") && named && e.contains("0o"),
                "{bad:?}: {e}"
            );
        }
        for (ok, want) in [
            ("0660", 0o660),
            ("660", 0o660),
            ("0o660", 0o660),
            ("0o0660", 0o660),
            ("0777", 0o777),
            ("0", 0),
            ("00660", 0o660),
            ("0O660", 0o660),
        ] {
            assert_eq!(bits(ok).ok(), Some(want), "{ok}");
        }
        let e = ServeConfig::load(Some(&write("socket_mode = \"+660\"\n")), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`socket_mode` = \"+660\""), "{e}");
    }

    #[test]
    fn invalid_value_names_key_and_allowed() {
        let e = ServeConfig::load(None, &Flags { flows: Some(0) })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`flows`") && e.contains("between 1 and 64"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod doc_tests {
    use super::*;

    /// Every key of both configurations is documented in docs/CONFIGURATION.md.
    #[test]
    fn every_key_is_documented() {
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/CONFIGURATION.md"
        ))
        .expect("docs/CONFIGURATION.md exists");
        let mut keys_seen = 0;
        for key in keys::<ServeConfig>()
            .into_iter()
            .chain(keys::<SourceConfig>())
        {
            keys_seen += 1;
            assert!(
                doc.contains(&format!("| `{key}` |")),
                "docs/CONFIGURATION.md does not document `{key}`"
            );
        }
        assert!(keys_seen >= 15, "found only {keys_seen} keys");
    }
}
