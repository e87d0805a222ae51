//! What the node shows the admin API: [`Status`] (the `/v1/status` document, also the source
//! of the Prometheus figures) and its parts. Plain data, serialised as the API documents it.

use serde::Serialize;
use shardwire_devmem::probe::NicReport;
use shardwire_gpu::GpuProbe;
use shardwire_protocol::trainer::MemoryKind;

use crate::binding::BindingKind;
use crate::counters::CounterStatus;
use crate::lanes::Excluded;
use crate::roster::Resolution;
use crate::stream::StreamInfo;

/// The receive and memory modes in effect, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Mode {
    /// `host`, `devmem` or `devmem-sim`.
    pub receive: String,
    /// Host or CUDA.
    pub memory: MemoryKind,
    /// Why, in words.
    pub reason: String,
}

/// A lane's RX binding.
#[derive(Debug, Clone, Serialize)]
pub struct BindingStatus {
    /// Its lane.
    pub lane: u32,
    /// Binding id (the dma-buf id its frags carry; unique among the node's bindings).
    pub binding: u32,
    /// Emulated or kernel.
    pub kind: BindingKind,
    /// Dma-buf bytes.
    pub bytes: usize,
    /// The interface (an emulated NIC's name for the emulator).
    pub interface: String,
    /// The RX queues bound.
    pub queues: Vec<u32>,
    /// net_iovs.
    pub niovs: usize,
    /// Free net_iovs (emulator only).
    pub niovs_free: Option<usize>,
    /// Waits for a free net_iov.
    pub pool_exhausted: u64,
    /// Frags gathered.
    pub frags: u64,
    /// Bytes gathered out of the dma-buf.
    pub dmabuf_bytes: u64,
    /// Tokens returned.
    pub tokens_returned: u64,
    /// Bytes in linear frags.
    pub linear_bytes: u64,
    /// Bytes of ordinary TCP.
    pub plain_bytes: u64,
    /// Receives whose frags named another binding (steered to another lane's queue):
    /// refused, tokens returned, payload fetched again.
    pub steering_errors: u64,
    /// Per-connection steering rules installed now (kernel and emulated NICs alike: one per
    /// open data connection of a kernel binding; the emulator's are not counted here).
    pub flow_rules: u64,
    /// Data connections failed because the NIC refused their steering rule.
    pub flow_rule_failures: u64,
}

/// One source link.
#[derive(Debug, Clone, Serialize)]
pub struct SourceStatus {
    /// The link's id in this node: a source that left DNS and came back has a new link, whose
    /// figures start at 0.
    pub link: usize,
    /// HOST:PORT (a configured entry as written, a discovered one as `IP:PORT`).
    pub addr: String,
    /// How it was found: `config`, or the `dns:NAME:PORT` entry that resolved to it.
    pub found_by: String,
    /// Connected and authenticated.
    pub up: bool,
    /// `active`, `draining` (the source got SIGTERM: no new fetches go to it) or `retiring`
    /// (its address left DNS: it goes once its fetches have ended).
    pub state: &'static str,
    /// FETCHes sent to it.
    pub fetches: u64,
    /// Fetches sent to it and not ended yet.
    pub outstanding: usize,
    /// Fetches waiting for the source's announcement.
    pub in_flight: usize,
    /// Cancels sent.
    pub cancels_sent: u64,
    /// Fetches the source dropped on request.
    pub cancelled: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Why the link's last session ended, or why the current one is not ready (a lane the
    /// source left out); kept until a session has every data connection ready, so a link
    /// whose sessions keep failing shows why.
    pub last_error: Option<String>,
}

/// The memory budget.
#[derive(Debug, Clone, Serialize)]
pub struct PoolStatus {
    /// `pool_size`.
    pub size: u64,
    /// Reserved by open streams.
    pub reserved: u64,
    /// Each stream's region.
    pub stream_memory: u64,
}

/// One lane (`/v1/status` `lanes`).
#[derive(Debug, Clone, Serialize)]
pub struct LaneStatus {
    /// Lane id.
    pub lane: u32,
    /// Its GPU's PCI bus id.
    pub gpu: Option<String>,
    /// Its GPU's UUID, when CUDA reports it.
    pub uuid: Option<String>,
    /// Its NIC.
    pub nic: Option<String>,
    /// The NIC's PCI bus id.
    pub nic_pci: Option<String>,
    /// GPU to NIC distance: `PIX`, `PXB`, `PHB` or `SYS`.
    pub distance: Option<String>,
    /// Its NUMA node.
    pub numa_node: Option<u32>,
    /// Its data listener's address (a wildcard is advertised per source as the address of
    /// the control connection), or, once a lane that awaited its NIC's address has one, that
    /// address with the listener's port (what sources dial then).
    pub data_addr: String,
    /// Where its streams' regions live.
    pub memory: MemoryKind,
    /// CPUs its receivers run on (`0-51,104-155`; empty: not pinned).
    pub cpus: String,
    /// Its RX queues for devmem.
    pub queues: Vec<u32>,
    /// Its RX dma-buf size for devmem, in bytes (`lanes[i].devmem_memory`, else
    /// `devmem_memory`).
    pub devmem_memory: u64,
    /// It has an RX binding.
    pub devmem: bool,
    /// Its RX binding (`null`: plain TCP).
    pub binding: Option<BindingStatus>,
    /// Open streams.
    pub streams: usize,
    /// Bytes of its pool reserved by its streams.
    pub pool_reserved: u64,
    /// Its pool (`pool_size`).
    pub pool_size: u64,
    /// Payload bytes received on its data connections.
    pub bytes_received: u64,
    /// Data connections identified on it.
    pub data_connections: u64,
    /// Data connections refused: announced for it, arrived on another address.
    pub data_connections_refused: u64,
    /// Data connections dialled at its NIC's address that came in on its NIC (checked only
    /// on a lane on its NIC's address).
    pub data_connections_on_nic: u64,
    /// Data connections dialled at its NIC's address that came in on another NIC (received
    /// all the same: the routes to its address do not follow its NIC).
    pub data_connections_wrong_nic: u64,
    /// Data connections dialled at its NIC's address whose NIC could not be told (no NAPI
    /// ids: loopback, a veth without GRO, a kernel without them; the reason is logged once).
    pub data_connections_nic_unknown: u64,
    /// Why this pairing and address.
    pub why: String,
    /// The pairing deserves a warning.
    pub warn: bool,
    /// What could not be done for it (CPU pinning, NUMA placement), and why.
    pub notes: Vec<String>,
}

/// The `/v1/status` document.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The node's version.
    pub version: &'static str,
    /// Modes and why.
    pub mode: Mode,
    /// The first lane's RX binding (`null` in host mode; every lane's: `lanes[].binding`).
    pub devmem: Option<BindingStatus>,
    /// Draining.
    pub draining: bool,
    /// The NIC probe taken at start.
    pub nics: Vec<NicReport>,
    /// The GPU probe taken at start.
    pub gpus: GpuProbe,
    /// Lane 0's data address as `lanes[0].data_addr` shows it (every lane's: `lanes`).
    pub data_addr: String,
    /// The lanes.
    pub lanes: Vec<LaneStatus>,
    /// GPUs left out (their self-test failed, or the CUDA probe found them unusable beside a
    /// usable one), and why.
    pub lanes_excluded: Vec<Excluded>,
    /// The trainer socket.
    pub socket: std::path::PathBuf,
    /// The memory budget.
    pub pool: PoolStatus,
    /// Source links.
    pub sources: Vec<SourceStatus>,
    /// The `dns:` source entries and their last answers.
    pub discovery: Vec<Resolution>,
    /// Open streams.
    pub streams: Vec<StreamInfo>,
    /// Counters.
    pub counters: CounterStatus,
}
