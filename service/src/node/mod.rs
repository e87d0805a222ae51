//! The node service: links to shard sources, receiver threads, streams, the trainer socket.
//!
//! Control plane (tokio): one [`link::SourceLink`] task per source (handshake, manifests,
//! FETCH/SHARD), one fetcher task per stream, the data-port acceptor, the admin API.
//! Data path (threads): one receiver per data connection (`recv` straight into the shard's
//! slab, CRC-32C while the bytes are cache-hot) and one thread per trainer connection.
//! The data path never waits on the control plane except for the announcement that tells
//! a receiver where its next payload goes.

pub mod devmem_rx;
pub mod link;
pub mod matcher;
pub mod receiver;
pub mod stream;
pub mod trainer_socket;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shardwire_config::{ReceiveMode, ServeConfig};
use tokio::sync::watch;

use self::link::SourceLink;
use self::stream::StreamShared;

/// Counters of the data path (also exported as Prometheus metrics).
#[derive(Default, Debug)]
pub struct Counters {
    /// Payload bytes received and verified.
    pub bytes_received: AtomicU64,
    /// Shards received and verified.
    pub shards_received: AtomicU64,
    /// Payloads whose CRC-32C did not match.
    pub crc_failures: AtomicU64,
    /// FETCHes issued again after a failure.
    pub refetches: AtomicU64,
    /// Batches handed to trainers.
    pub batches_delivered: AtomicU64,
    /// Nanoseconds trainers waited in `next` for a batch that was not ready (network-bound).
    pub stall_network_ns: AtomicU64,
    /// Nanoseconds fetchers had shards to fetch but no free memory (trainer-bound).
    pub stall_trainer_ns: AtomicU64,
    /// Nanoseconds receivers spent verifying payloads (assembly).
    pub assembly_ns: AtomicU64,
    /// Times a receiver in CUDA memory mode waited for a pinned buffer whose H2D copy had
    /// not finished (the network waited on the GPU copy).
    pub staging_stalls: AtomicU64,
}

/// State shared by every part of a running node.
pub struct Node {
    /// Effective configuration.
    pub cfg: ServeConfig,
    /// Shared secret for sources.
    pub secret: Option<Vec<u8>>,
    /// One link per configured source.
    pub links: Vec<Arc<SourceLink>>,
    /// Open streams by id.
    pub streams: Mutex<HashMap<u64, Arc<StreamShared>>>,
    /// Bytes of `pool_size` reserved by open streams.
    pub reserved: Mutex<u64>,
    /// Data-connection matcher.
    pub matcher: matcher::Matcher,
    /// Counters.
    pub counters: Counters,
    /// Bound data port.
    pub data_addr: SocketAddr,
    /// Runtime handle for trainer threads.
    pub rt: tokio::runtime::Handle,
    next_id: AtomicU64,
    /// Why the service runs in the mode it does (updated when a binding is created or
    /// deleted over the admin API).
    mode_reason: Mutex<String>,
    /// Set once a drain started: no new streams, readiness fails.
    pub draining: std::sync::atomic::AtomicBool,
    /// Woken when a drain is requested over the admin API.
    pub drain_requested: tokio::sync::Notify,
    /// Bearer token for mutating admin endpoints.
    pub admin_token: Option<Vec<u8>>,
    /// The GPU probe taken at start.
    pub gpus: shardwire_gpu::GpuProbe,
    /// The NIC capability probe taken at start.
    pub nics: Vec<shardwire_devmem::probe::NicReport>,
    /// Per data connection: (source, conn, counters).
    pub flows: Mutex<Vec<(String, u16, Arc<receiver::FlowStats>)>>,
    /// The RX binding when receiving with devmem (or its emulator); `None` in host mode.
    devmem: std::sync::RwLock<Option<Arc<devmem_rx::RxRegion>>>,
    /// The GPU stream regions live on (`memory = cuda`); `None`: host memory.
    pub cuda: Option<Arc<shardwire_gpu::cuda::CudaMemory>>,
}

impl Node {
    /// A fresh id for streams, leases and requests.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The RX binding new data connections read through (`None`: plain TCP).
    pub fn devmem(&self) -> Option<Arc<devmem_rx::RxRegion>> {
        self.devmem
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace the binding (admin API) and say why; data connections opened from now on
    /// use the new path.
    pub fn set_devmem(&self, region: Option<Arc<devmem_rx::RxRegion>>, reason: String) {
        *self.devmem.write().unwrap_or_else(|p| p.into_inner()) = region;
        tracing::info!(receive = %self.receive(), %reason, "receive path changed");
        *self.mode_reason.lock().unwrap_or_else(|p| p.into_inner()) = reason;
    }

    /// The receive path in effect (`auto` resolved).
    pub fn receive(&self) -> ReceiveMode {
        match self.devmem() {
            None => ReceiveMode::Host,
            Some(r) if r.kind() == "emulated" => ReceiveMode::DevmemSim,
            Some(_) => ReceiveMode::Devmem,
        }
    }

    /// The memory stream regions live in: "host" or "cuda".
    pub fn memory(&self) -> &'static str {
        if self.cuda.is_some() { "cuda" } else { "host" }
    }

    /// Why the service receives and assembles the way it does.
    pub fn mode_reason(&self) -> String {
        self.mode_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A started node; dropping it does not stop it, call [`NodeHandle::shutdown`].
pub struct NodeHandle {
    /// The node.
    pub node: Arc<Node>,
    /// Admin address actually bound.
    pub admin_addr: SocketAddr,
    /// Trainer socket path.
    pub socket: PathBuf,
    shutdown: watch::Sender<bool>,
}

impl NodeHandle {
    /// Drains: refuses new streams, waits up to `timeout` for open streams to finish (their
    /// trainers disconnect), then shuts down. Returns the number of streams still open.
    pub async fn drain(&self, timeout: std::time::Duration) -> usize {
        self.node.draining.store(true, Ordering::Release);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let open = self.node.streams.lock().expect("poisoned").len();
            if open == 0 || tokio::time::Instant::now() >= deadline {
                if open > 0 {
                    tracing::warn!(
                        open,
                        ?timeout,
                        "drain timeout: closing the remaining streams"
                    );
                } else {
                    tracing::info!("drained: no streams open");
                }
                self.shutdown();
                return open;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Asks every task to stop.
    pub fn shutdown(&self) {
        if let Some(region) = self.node.devmem() {
            region.unbind();
        }
        let _ = self.shutdown.send(true);
        for s in self.node.streams.lock().expect("poisoned").values() {
            s.close("node shutting down");
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Why the node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A port could not be bound.
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The secret file is unusable.
    #[error("secret file {path}: {reason}")]
    Secret {
        /// Path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The configured memory kind is not available.
    #[error("{0}")]
    Memory(String),
    /// The configured receive path is not available.
    #[error("{0}")]
    Receive(String),
    /// No sources.
    #[error("no sources configured: give --source HOST:PORT (or `sources` in the config file)")]
    NoSources,
}

/// Reads a secret file.
pub fn read_secret(path: &std::path::Path) -> Result<Vec<u8>, StartError> {
    let bad = |reason: String| StartError::Secret {
        path: path.into(),
        reason,
    };
    let raw = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    shardwire_protocol::auth::parse_secret(&raw).ok_or_else(|| bad("the file is empty".into()))
}

/// Starts the node on the current tokio runtime.
pub async fn start(cfg: ServeConfig) -> Result<NodeHandle, StartError> {
    if cfg.sources.is_empty() {
        return Err(StartError::NoSources);
    }
    let secret = cfg.secret_file.as_deref().map(read_secret).transpose()?;
    let admin_token = cfg
        .admin_token_file
        .as_deref()
        .map(read_secret)
        .transpose()?;
    let data = tokio::net::TcpListener::bind(cfg.data_listen)
        .await
        .map_err(|source| StartError::Bind {
            what: "the data port",
            addr: cfg.data_listen.to_string(),
            source,
        })?;
    let data_addr = data.local_addr().expect("bound");
    let (shutdown, watch) = watch::channel(false);
    let links = cfg
        .sources
        .iter()
        .enumerate()
        .map(|(i, a)| SourceLink::new(i, a.clone()))
        .collect();
    // NIC changes a crashed run left behind are undone before anything else looks at NICs.
    let state = cfg.nic_state_file.clone();
    match tokio::task::spawn_blocking(move || shardwire_devmem::nic::restore_from(&state)).await {
        Ok(Ok(Some(st))) => tracing::warn!(
            file = %cfg.nic_state_file.display(), ifname = %st.ifname, changes = ?st.changes,
            "restored NIC settings left by a previous run that did not shut down cleanly"
        ),
        Ok(Ok(None)) => {}
        Ok(Err(e)) => {
            tracing::error!(error = %e, "could not restore NIC settings left by a previous run; the NIC may still be altered")
        }
        Err(e) => tracing::error!(error = %e, "NIC restore task failed"),
    }
    let nics = tokio::task::spawn_blocking(shardwire_devmem::probe::probe_nics)
        .await
        .unwrap_or_default();
    let capable: Vec<&str> = nics
        .iter()
        .filter(|n| n.devmem_capable)
        .map(|n| n.name.as_str())
        .collect();
    let probe = if capable.is_empty() {
        let why: Vec<String> = nics
            .iter()
            .filter(|n| n.up)
            .map(|n| format!("{}: {}", n.name, n.reason))
            .collect();
        format!("no devmem-capable NIC ({})", why.join("; "))
    } else {
        format!("devmem-capable NICs: {}", capable.join(", "))
    };
    let gpus = tokio::task::spawn_blocking(shardwire_gpu::probe_gpus)
        .await
        .map_err(|e| StartError::Memory(e.to_string()))?;
    let choice = match cfg.memory {
        shardwire_config::MemoryMode::Auto => shardwire_gpu::MemoryChoice::Auto,
        shardwire_config::MemoryMode::Host => shardwire_gpu::MemoryChoice::Host,
        shardwire_config::MemoryMode::Cuda => shardwire_gpu::MemoryChoice::Cuda,
    };
    let memory = shardwire_gpu::choose_memory(choice, &gpus)
        .map_err(|e| StartError::Memory(e.to_string()))?;
    let (memory, cuda) = open_gpu(choice, memory).await?;
    let (devmem, receive_reason) = match cfg.receive {
        ReceiveMode::Host => (
            None,
            format!("receive=host: plain TCP into host memory, as configured; {probe}"),
        ),
        ReceiveMode::DevmemSim => {
            let region = devmem_rx::RxRegion::emulated(cfg.devmem_memory.0 as usize, cuda.clone())
                .map_err(|e| StartError::Receive(format!("receive=devmem-sim: {e}")))?;
            let gather = if region.gpu_gather() {
                "frags gathered into GPU memory by the CUDA kernel from the emulator's memory registered with CUDA"
            } else {
                "frags gathered by memcpy"
            };
            let reason = format!(
                "receive=devmem-sim: the devmem receive path (frags, tokens, gather) over the kernel-faithful emulator on ordinary TCP, {} binding of {} net_iovs, {gather}; NOT GPU-direct; {probe}",
                cfg.devmem_memory,
                region.niovs().1
            );
            (Some(region), reason)
        }
        ReceiveMode::Devmem => {
            match bind_devmem(&cfg, &nics, data_addr, &probe, cuda.clone()).await {
                Ok((region, why)) => (Some(region), format!("receive=devmem: {why}")),
                Err(e) => {
                    return Err(StartError::Receive(format!(
                        "receive=devmem is not possible here: {e}. Use receive=host (plain TCP) or devmem-sim (the emulator)"
                    )));
                }
            }
        }
        ReceiveMode::Auto => {
            match bind_devmem(&cfg, &nics, data_addr, &probe, cuda.clone()).await {
                Ok((region, why)) => (Some(region), format!("receive=auto chose devmem: {why}")),
                Err(e) => (None, format!("receive=auto chose host (plain TCP): {e}")),
            }
        }
    };
    let mode_reason = format!(
        "{receive_reason}. memory={}: {}",
        memory.memory, memory.reason
    );
    let node = Arc::new(Node {
        secret,
        links,
        streams: Mutex::new(HashMap::new()),
        reserved: Mutex::new(0),
        matcher: matcher::Matcher::default(),
        counters: Counters::default(),
        data_addr,
        rt: tokio::runtime::Handle::current(),
        next_id: AtomicU64::new(0),
        mode_reason: Mutex::new(mode_reason),
        flows: Mutex::new(Vec::new()),
        devmem: std::sync::RwLock::new(devmem),
        cuda,
        nics,
        gpus,
        draining: std::sync::atomic::AtomicBool::new(false),
        drain_requested: tokio::sync::Notify::new(),
        admin_token,
        cfg,
    });
    tracing::info!(receive = %node.receive(), reason = %node.mode_reason(), "memory and receive mode chosen");
    tracing::info!(pool_size = %node.cfg.pool_size, "{}", node.cfg.stream_memory_origin());
    tokio::spawn(matcher::accept_loop(Arc::clone(&node), data, watch.clone()));
    for l in &node.links {
        tokio::spawn(link::run(Arc::clone(&node), Arc::clone(l), watch.clone()));
    }
    let socket = node.cfg.socket.clone();
    trainer_socket::start(Arc::clone(&node), &socket, watch.clone()).map_err(|source| {
        StartError::Bind {
            what: "the trainer socket",
            addr: socket.display().to_string(),
            source,
        }
    })?;
    let admin = tokio::net::TcpListener::bind(node.cfg.admin)
        .await
        .map_err(|source| StartError::Bind {
            what: "the admin API",
            addr: node.cfg.admin.to_string(),
            source,
        })?;
    let admin_addr = admin.local_addr().expect("bound");
    tokio::spawn(crate::admin::serve(Arc::clone(&node), admin, watch.clone()));
    tracing::info!(data = %data_addr, admin = %admin_addr, socket = %socket.display(), sources = node.links.len(), "node service ready");
    Ok(NodeHandle {
        node,
        admin_addr,
        socket,
        shutdown,
    })
}

/// Opens the chosen GPU (device, kernels, self-test). With `memory = "auto"` a GPU that
/// fails to open gives host memory and the reason; with `memory = "cuda"` it is an error.
async fn open_gpu(
    choice: shardwire_gpu::MemoryChoice,
    decision: shardwire_gpu::MemoryDecision,
) -> Result<
    (
        shardwire_gpu::MemoryDecision,
        Option<Arc<shardwire_gpu::cuda::CudaMemory>>,
    ),
    StartError,
> {
    let Some(device) = decision.device.clone() else {
        return Ok((decision, None));
    };
    let info = device.clone();
    let opened = tokio::task::spawn_blocking(move || shardwire_gpu::cuda::open_for_service(&info))
        .await
        .map_err(|e| StartError::Memory(format!("opening the GPU panicked: {e}")))?;
    let what = shardwire_gpu::probe::device_text(&device);
    match (opened, choice) {
        (Ok(cuda), _) => Ok((decision, Some(Arc::new(cuda)))),
        (Err(e), shardwire_gpu::MemoryChoice::Cuda) => Err(StartError::Memory(format!(
            "memory = \"cuda\": {what} could not be opened: {e}"
        ))),
        (Err(e), _) => Ok((
            shardwire_gpu::MemoryDecision {
                memory: "host",
                reason: format!(
                    "auto: {what} is usable but opening it failed ({e}); using host memory"
                ),
                device: None,
            },
            None,
        )),
    }
}

/// Choose the interface and queues for devmem, set the NIC up and bind (`receive = devmem`
/// or `auto`). The error is the reason in words.
async fn bind_devmem(
    cfg: &ServeConfig,
    nics: &[shardwire_devmem::probe::NicReport],
    data_addr: SocketAddr,
    probe: &str,
    cuda: Option<Arc<shardwire_gpu::cuda::CudaMemory>>,
) -> Result<(Arc<devmem_rx::RxRegion>, String), String> {
    let memory = if cuda.is_some() {
        "GPU region (GPU-direct)"
    } else {
        "udmabuf"
    };
    let nic = match &cfg.devmem_interface {
        Some(name) => nics
            .iter()
            .find(|n| &n.name == name)
            .ok_or_else(|| format!("devmem_interface {name} does not exist here; {probe}"))?,
        None => nics
            .iter()
            .find(|n| n.devmem_capable)
            .ok_or_else(|| probe.to_string())?,
    };
    if !nic.devmem_capable {
        return Err(format!("{} cannot do devmem: {}", nic.name, nic.reason));
    }
    let queues: Vec<u32> = if cfg.devmem_queues.is_empty() {
        // The upper half of the RX queues, leaving the lower half to other traffic.
        (nic.rx_queues / 2..nic.rx_queues).collect()
    } else {
        cfg.devmem_queues.clone()
    };
    let (name, ifindex, port) = (nic.name.clone(), nic.ifindex, data_addr.port());
    let (q, bytes, state) = (
        queues.clone(),
        cfg.devmem_memory.0 as usize,
        cfg.nic_state_file.clone(),
    );
    let region = tokio::task::spawn_blocking(move || {
        devmem_rx::RxRegion::bind_kernel(&name, ifindex, &q, bytes, &state, port, cuda)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("on {}: {e}", nic.name))?;
    let first = queues.iter().min().copied().unwrap_or(0);
    let why = format!(
        "{} RX queues {queues:?} bound to a {} {memory} (binding {}); header split on, RSS over queues 0..{first}, data port {} steered to queue {first} (all undone at shutdown)",
        nic.name,
        cfg.devmem_memory,
        region.id(),
        data_addr.port(),
    );
    Ok((region, why))
}
