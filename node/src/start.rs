//! Starting a node: secrets, NIC state a crashed run left behind, the probes, the lanes (their
//! GPUs opened, their data ports bound: [`crate::lanes::open`]), the memory and receive
//! decisions (each with its reason), then the tasks: one acceptor per data listener, the source
//! roster's discovery (a link per configured or DNS-found source), the control task and the
//! trainer socket. The node serves no HTTP: the binary puts its admin and trainer HTTP fronts
//! on top.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shardwire_config::{ReceiveMode, ServeConfig};
use shardwire_devmem::emu::host::EmuHost;
use shardwire_devmem::nic::Restore;
use shardwire_devmem::probe::NicReport;
use shardwire_protocol::wire::LaneAddr;
use tokio::sync::{mpsc, watch};

use crate::binding::RxRegion;
use crate::binding::kernel::LaneRequest;
use crate::binding::{self, BindingError};
use crate::counters::Counters;
use crate::info::Info;
use crate::lanes::Lanes;
use crate::lanes::open::LaneStartError;
use crate::link::LinkConfig;
use crate::node::{ControlRequest, Node};
use crate::plane::{self, DataPlane};
use crate::roster::Roster;
use crate::stream::CloseReason;

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
    /// The secret file cannot be read.
    #[error("secret file {path}: {source}")]
    SecretUnreadable {
        /// Path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The secret file is empty.
    #[error("secret file {path}: the file is empty")]
    SecretEmpty {
        /// Path.
        path: PathBuf,
    },
    /// A `sources` entry is neither `HOST:PORT` nor `dns:NAME:PORT`.
    #[error("sources: {0}")]
    Source(#[from] shardwire_config::SourceEntryError),
    /// The lanes cannot be made (their plan, their GPUs, their data ports).
    #[error(transparent)]
    Lanes(#[from] LaneStartError),
    /// `receive = devmem-sim` and the emulator could not bind.
    #[error("receive=devmem-sim: {0}")]
    Emulator(BindingError),
    /// `receive = devmem` and no binding could be made.
    #[error(
        "receive=devmem is not possible here: {0}. Use receive=host (plain TCP) or devmem-sim (the emulator)"
    )]
    Devmem(BindingError),
    /// No sources.
    #[error("no sources configured: give --source HOST:PORT (or `sources` in the config file)")]
    NoSources,
}

/// Reads a secret file; one every user may read is taken, with a warning.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, StartError> {
    let raw = std::fs::read(path).map_err(|source| StartError::SecretUnreadable {
        path: path.into(),
        source,
    })?;
    if let Some(mode) = open_to_others(path) {
        tracing::warn!(path = %path.display(), mode = format!("{mode:o}"),
            "a secret file every user of this host may read: any local process can authenticate with it; chmod o-rwx");
    }
    shardwire_protocol::auth::parse_secret(&raw)
        .ok_or_else(|| StartError::SecretEmpty { path: path.into() })
}

/// The permission bits of `path` (its target, for a link) when users other than its owner
/// and group have any access.
fn open_to_others(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o7777;
    (mode & 0o007 != 0).then_some(mode)
}

/// A started node; dropping it does not stop it, call [`NodeHandle::shutdown`].
pub struct NodeHandle {
    /// The node.
    pub node: Arc<Node>,
    /// Trainer socket path.
    pub socket: PathBuf,
    shutdown: watch::Sender<bool>,
}

impl NodeHandle {
    /// A receiver that turns true when the node shuts down (for the fronts on top of it).
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// Drains: refuses new streams (and binding changes not begun) at once, waits up to
    /// `timeout` from now for open streams to finish (their trainers disconnect), then shuts
    /// down. Returns the number of streams still open. New streams are refused before the
    /// control queue is reached: an admin change ahead there (a binding delete waiting
    /// `drain_timeout_secs` for its readers) kept admitting streams and pushed the deadline
    /// out. The drain itself still goes through the queue, so the shutdown after it never
    /// cuts short the one change under way (a delete dropped mid-wait left its NIC
    /// unrestored): the return can come that change's length past `timeout`.
    pub async fn drain(&self, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        self.node.start_draining();
        let _ = self.node.control(crate::control::Control::Drain).await;
        loop {
            let open = self.node.streams().len();
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
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Asks every task to stop.
    pub fn shutdown(&self) {
        stop(&self.node, &self.shutdown);
        self.node.close_all(&CloseReason::Shutdown);
        wake_accept(&self.socket);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Wakes the trainer socket's accept thread, which looks at the shutdown signal only when a
/// trainer connects, so that it ends and lets go of the node. Non-blocking: a listener whose
/// backlog is full must not hold up the shutdown.
fn wake_accept(path: &Path) {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let Ok(addr) = SocketAddrUnix::new(path) else {
        return;
    };
    let flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
    if let Ok(fd) = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None) {
        let _ = rustix::net::connect(&fd, &addr);
    }
}

/// Releases the RX bindings (their NICs restored) and tells every task to stop: at shutdown,
/// and when a start fails after the bindings were made and the tasks began.
fn stop(node: &Node, shutdown: &watch::Sender<bool>) {
    for (_, region) in node.plane().bindings() {
        region.unbind();
    }
    let _ = shutdown.send(true);
}

/// Starts the node on the current tokio runtime.
pub async fn start(cfg: ServeConfig) -> Result<NodeHandle, StartError> {
    if cfg.sources.is_empty() {
        return Err(StartError::NoSources);
    }
    let entries = cfg
        .sources
        .iter()
        .map(|s| shardwire_config::SourceEntry::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let secret = cfg.secret_file.as_deref().map(read_secret).transpose()?;
    let admin_token = cfg
        .admin_token_file
        .as_deref()
        .map(read_secret)
        .transpose()?;
    restore_nic_state(&cfg.nic_state_file).await;
    let nics = tokio::task::spawn_blocking(shardwire_devmem::probe::probe_nics)
        .await
        .unwrap_or_default();
    let gpus = tokio::task::spawn_blocking(shardwire_gpu::probe_gpus)
        .await
        .expect("the GPU probe does not panic");
    let started = crate::lanes::open::open(&cfg, &gpus).await?;
    let lanes = started.lanes;
    let emu = EmuHost::new();
    let (rx, receive_reason) = choose_receive(&cfg, &nics, (&lanes, &emu)).await?;
    let counters = Arc::new(Counters::default());
    let roster = Arc::new(Roster::new(link_config(secret.clone(), &lanes, cfg.flows)));
    let data_addr = lanes.all()[0].data_addr;
    let plane = Arc::new(DataPlane::new(
        roster,
        Arc::clone(&lanes),
        (rx, emu),
        Arc::clone(&counters),
        cfg.io_uring,
    ));
    inject_faults(&cfg, &plane);
    let info = Info::new(
        cfg,
        (secret, admin_token),
        (gpus, nics),
        data_addr,
        started.memory,
        (receive_reason, started.memory_reason),
    );
    let (node, control) = Node::new(info, Arc::clone(&plane), counters);
    tracing::info!(receive = %node.receive(), reason = %node.info().mode_reason(), "memory and receive mode chosen");
    log_region_pages();
    let cfg = &node.info().cfg;
    tracing::info!(pool_size = %cfg.pool_size, lanes = lanes.all().len(), "{} (pool_size is per lane)", cfg.stream_memory_origin());
    let (shutdown, watch) = watch::channel(false);
    spawn_tasks(&node, started.listeners, control, (entries, &watch));
    let socket = cfg.socket.clone();
    if let Err(source) = crate::socket::start(Arc::clone(&node), &socket, watch) {
        // Nothing of this node may stay behind: not its tasks, not its NIC bindings.
        stop(&node, &shutdown);
        return Err(StartError::Bind {
            what: "the trainer socket",
            addr: socket.display().to_string(),
            source,
        });
    }
    let addrs: Vec<String> = lanes
        .all()
        .iter()
        .map(|l| l.data_addr.to_string())
        .collect();
    tracing::info!(data = %addrs.join(" "), socket = %socket.display(), sources = cfg.sources.len(), "node started");
    Ok(NodeHandle {
        node,
        socket,
        shutdown,
    })
}

/// What every source link tells its source: the secret, and each lane's data address with
/// `flows` connections.
fn link_config(secret: Option<Vec<u8>>, lanes: &Lanes, flows: u16) -> LinkConfig {
    let lanes = lanes
        .all()
        .iter()
        .map(|l| LaneAddr {
            data_addr: l.data_addr,
            flows,
        })
        .collect();
    LinkConfig { secret, lanes }
}

/// The data-port acceptors, the stale-connection sweep, source discovery (which starts the
/// links) and the control task. The control task holds the node weakly: the node holds the
/// sender of its queue, so a strong hold would keep both alive for ever (and the node's
/// lanes, plane and bindings with them) after the node is let go.
fn spawn_tasks(
    node: &Arc<Node>,
    data: Vec<tokio::net::TcpListener>,
    mut control: mpsc::UnboundedReceiver<ControlRequest>,
    (entries, watch): (Vec<shardwire_config::SourceEntry>, &watch::Receiver<bool>),
) {
    let plane = Arc::clone(node.plane());
    for listener in data {
        tokio::spawn(plane::accept_loop(
            Arc::clone(&plane),
            listener,
            watch.clone(),
        ));
    }
    tokio::spawn(plane::sweep_loop(Arc::clone(&plane), watch.clone()));
    let every = Duration::from_secs(node.info().cfg.source_resolve_secs);
    crate::discovery::spawn(&plane, entries, every, watch);
    let node = Arc::downgrade(node);
    tokio::spawn(async move {
        while let Some((c, answer)) = control.recv().await {
            let Some(node) = node.upgrade() else {
                return; // the node went right after asking: nobody waits for the answer
            };
            let _ = answer.send(node.apply(c).await);
        }
    });
}

/// Undoes NIC changes a crashed run left behind (the journal of each NIC it set up),
/// before anything else looks at NICs.
async fn restore_nic_state(state: &Path) {
    for file in binding::kernel::state_files(state) {
        let path = file.clone();
        match tokio::task::spawn_blocking(move || shardwire_devmem::nic::restore_from(&path)).await
        {
            Ok(Ok(Some(Restore::Undone(st)))) => tracing::warn!(
                file = %file.display(), ifname = %st.ifname, changes = ?st.changes,
                "restored NIC settings left by a previous run that did not shut down cleanly"
            ),
            Ok(Ok(Some(Restore::Stale(st)))) => tracing::warn!(
                file = %file.display(), ifname = %st.ifname, changes = ?st.changes,
                "removed NIC settings left by a run before the last reboot: the NIC came up with its defaults, nothing to undo"
            ),
            Ok(Ok(None)) => {}
            Ok(Err(e @ shardwire_devmem::nic::NicError::StateInUse(_))) => {
                tracing::warn!(file = %file.display(), error = %e, "a running node's NIC journal: left alone")
            }
            Ok(Err(e)) => {
                tracing::error!(file = %file.display(), error = %e, "could not restore NIC settings left by a previous run; the NIC may still be altered")
            }
            Err(e) => tracing::error!(error = %e, "NIC restore task failed"),
        }
    }
}

/// The fault injection the configuration asks for (tests), each said in the log.
fn inject_faults(cfg: &ServeConfig, plane: &DataPlane) {
    if cfg.fault_misplace > 0 {
        tracing::warn!(
            connections = cfg.fault_misplace,
            "fault_misplace: lane 0's first devmem data connections land on lane 1's binding (fault injection for tests)"
        );
        plane.set_fault_misplace(cfg.fault_misplace);
    }
    if cfg.fault_spawn > 0 {
        tracing::warn!(
            connections = cfg.fault_spawn,
            "fault_spawn: the first data connections' receiver threads fail to start (fault injection for tests)"
        );
        plane.set_fault_spawn(cfg.fault_spawn);
    }
}

/// RX bindings, each with its lane.
type LaneBindings = Vec<(u32, Arc<RxRegion>)>;

/// The RX bindings for the configured receive mode, each with its lane, and why. Devmem
/// binds every lane on its own NIC's queues ([`binding::kernel`]: one setup per NIC, disjoint
/// queue sets for lanes sharing one; on a node of one lane the interface configured
/// (`devmem_interface`) or the first capable NIC); the emulator binds every lane, each its own
/// emulated NIC and dma-buf. `auto` takes devmem only if every lane can have it.
async fn choose_receive(
    cfg: &ServeConfig,
    nics: &[NicReport],
    (lanes, emu): (&Lanes, &Arc<EmuHost>),
) -> Result<(LaneBindings, String), StartError> {
    let probe = binding::probe_summary(nics);
    Ok(match cfg.receive {
        ReceiveMode::Host => (
            Vec::new(),
            format!("receive=host: plain TCP into host memory, as configured; {probe}"),
        ),
        ReceiveMode::DevmemSim => emulate_every_lane(lanes, emu, &probe)?,
        ReceiveMode::Devmem => {
            let (bound, why) = bind_every_lane(cfg, nics, lanes)
                .await
                .map_err(StartError::Devmem)?;
            (bound, format!("receive=devmem: {why}"))
        }
        ReceiveMode::Auto => match bind_every_lane(cfg, nics, lanes).await {
            Ok((bound, why)) => (bound, format!("receive=auto chose devmem: {why}")),
            Err(e) => (
                Vec::new(),
                format!("receive=auto chose host (plain TCP) on every lane: {e}"),
            ),
        },
    })
}

/// `receive = devmem` on every lane (blocking work on a blocking thread), and why.
async fn bind_every_lane(
    cfg: &ServeConfig,
    nics: &[NicReport],
    lanes: &Lanes,
) -> Result<(LaneBindings, String), binding::BindingError> {
    let reqs: Vec<LaneRequest> = lanes
        .all()
        .iter()
        .map(|l| LaneRequest {
            lane: l.id(),
            nic: l.spec.nic.clone(),
            named: l.spec.nic_named,
            queues: l.spec.queues.clone(),
            bytes: l.spec.devmem_memory as usize,
            data_port: l.data_addr.port(),
            cuda: l.cuda.clone(),
        })
        .collect();
    let notes = binding::kernel::interface_notes(
        &reqs,
        cfg.devmem_interface.as_deref(),
        &cfg.devmem_queues,
    );
    for n in &notes {
        tracing::warn!("{n}");
    }
    let plans = binding::kernel::plan(nics, &reqs, cfg.devmem_interface.as_deref())?;
    let base = cfg.nic_state_file.clone();
    let (bound, reqs) = tokio::task::spawn_blocking(move || {
        (binding::kernel::bind_lanes(&plans, &reqs, &base), reqs)
    })
    .await
    .expect("the bind task does not panic");
    let bound = bound?;
    let why: Vec<String> = bound
        .iter()
        .zip(&reqs)
        .map(|((lane, region), r)| binding::describe(region, *lane, r.data_port))
        .chain(notes)
        .collect();
    Ok((bound, why.join("; ")))
}

/// `receive = devmem-sim`: every lane gets its own emulator binding (its own emulated NIC,
/// queues and dma-buf, so its own binding id), and why.
fn emulate_every_lane(
    lanes: &Lanes,
    emu: &Arc<EmuHost>,
    probe: &str,
) -> Result<(LaneBindings, String), StartError> {
    let mut bound = Vec::new();
    let mut each = Vec::new();
    for lane in lanes.all() {
        let (nic, queues) =
            binding::emulated_nic(lane.id(), lane.spec.nic.as_deref(), &lane.spec.queues);
        let bytes = lane.spec.devmem_memory as usize;
        let region = binding::emulator(emu, (&nic, &queues), bytes, lane.cuda.clone())
            .map_err(StartError::Emulator)?;
        let gather = match region.gpu_gather() {
            true => "gathered into GPU memory by the CUDA kernel",
            false => "gathered by memcpy",
        };
        each.push(format!(
            "lane {}: binding {} on {nic} queues {queues:?}, {} ({} net_iovs), frags {gather}",
            lane.id(),
            region.id(),
            shardwire_config::ByteSize(bytes as u64),
            region.niovs().1,
        ));
        tracing::info!(lane = lane.id(), binding = region.id(), %nic, ?queues, "devmem-sim binding");
        bound.push((lane.id(), region));
    }
    let reason = format!(
        "receive=devmem-sim: the devmem receive path (frags, tokens, gather) over the kernel-faithful emulator on ordinary TCP, one binding per lane ({}); each data connection steered to its lane's queues and its frags checked against its lane's binding; NOT GPU-direct; {probe}",
        each.join("; ")
    );
    Ok((bound, reason))
}

/// Says which page size host stream regions get (docs/OPERATIONS.md, "Sizing memory"); a
/// node whose lanes all have GPUs makes none.
fn log_region_pages() {
    match shardwire_gpu::region::region_huge_pages() {
        (true, mode) => tracing::info!(
            shmem_enabled = %mode,
            "host stream regions get 2 MiB pages where the kernel has them"
        ),
        (false, mode) => tracing::info!(
            shmem_enabled = %mode,
            "host stream regions get 4 KiB pages; set /sys/kernel/mm/transparent_hugepage/shmem_enabled to advise for 2 MiB pages (a faster host batch gather)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config crate depends on no sibling crate (DESIGN §7), so it repeats the protocol
    /// limits it checks against; the node sees both, and holds them equal here.
    #[test]
    fn the_configs_copies_of_protocol_limits_agree_with_the_protocol() {
        use shardwire_protocol::wire;
        assert_eq!(shardwire_config::MAX_SESSION_FLOWS, wire::MAX_SESSION_FLOWS);
        assert_eq!(shardwire_config::MAX_DATASET_NAME, wire::MAX_DATASET_NAME);
        assert_eq!(shardwire_config::MAX_LANES, usize::from(wire::MAX_LANES));
        let long = "n".repeat(wire::MAX_DATASET_NAME + 1);
        let names: [&str; 12] = [
            "web-2024.v1_a",
            "",
            ".",
            "..",
            "..a",
            "my data",
            "a/b",
            "a=b",
            "caf\u{e9}",
            "a\n",
            long.as_str(),
            &long[1..],
        ];
        for name in names {
            assert_eq!(
                shardwire_config::dataset_name_problem(name).is_none(),
                wire::check_dataset_name(name).is_ok(),
                "{name:?}"
            );
        }
    }

    #[test]
    fn a_secret_every_user_may_read_is_noticed() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("sw-secret-{}", std::process::id()));
        std::fs::write(&path, b"s3cret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(open_to_others(&path), Some(0o644));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o440)).unwrap();
        assert_eq!(
            open_to_others(&path),
            None,
            "owner and group only (a Kubernetes Secret)"
        );
        assert_eq!(read_secret(&path).unwrap(), b"s3cret");
        std::fs::remove_file(&path).unwrap();
    }

    /// A node shut down and let go is freed, and its lanes, plane and bindings with it. Before,
    /// the control task held it (and it held that task's queue) and the trainer socket's
    /// accept thread waited for a trainer while holding it: it never was.
    #[tokio::test]
    async fn a_node_shut_down_and_let_go_is_freed() {
        let dir = std::env::temp_dir().join(format!("sw-start-{}", std::process::id()));
        let h = start(host_node(&dir))
            .await
            .expect("a host-memory node starts");
        let node = Arc::downgrade(&h.node);
        h.shutdown();
        drop(h);
        for _ in 0..500 {
            if node.upgrade().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            node.upgrade().is_none(),
            "the node is still held after its shutdown"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A drain refuses new streams at once and counts its deadline from its call, even while
    /// an admin change is under way: here a binding delete that waits (`drain_timeout_secs`,
    /// 30 s) for a data connection still reading from the binding. Before, the drain was a
    /// control message queued behind that delete: streams were admitted until the delete was
    /// done. The drain still ends only after the delete (a shutdown must not cut it short).
    #[tokio::test]
    async fn a_drain_refuses_streams_at_once_and_ends_after_an_admin_change() {
        use crate::control::{BindingSpec, Control, Reply};
        let dir = std::env::temp_dir().join(format!("sw-drain-{}", std::process::id()));
        let cfg = ServeConfig {
            drain_timeout_secs: 30,
            ..host_node(&dir)
        };
        let h = start(cfg).await.expect("a host-memory node starts");
        let spec = BindingSpec::Emulator {
            bytes: 1 << 20,
            lane: None,
        };
        let id = match h.node.control(Control::CreateBinding(spec)).await {
            Ok(Reply::Binding(b)) => b.binding,
            other => panic!("{other:?}"),
        };
        let reader = h.node.plane().binding(0).expect("bound").reading();
        let node = Arc::clone(&h.node);
        let id = id.to_string();
        let delete = tokio::spawn(async move { node.control(Control::DeleteBinding { id }).await });
        for _ in 0..500 {
            if h.node.plane().binding(0).is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            h.node.plane().binding(0).is_none(),
            "the delete is under way"
        );
        let drain = h.drain(Duration::from_millis(100));
        tokio::pin!(drain);
        let waited = tokio::time::timeout(Duration::from_millis(500), &mut drain).await;
        assert!(waited.is_err(), "the drain waits for the delete under way");
        assert!(h.node.readiness().3, "draining at once");
        // A binding change behind the one under way is refused once reached, not made (the
        // shutdown would cut it short, and the drain would wait for it).
        let node = Arc::clone(&h.node);
        let later = tokio::spawn(async move {
            let spec = BindingSpec::Emulator {
                bytes: 1 << 20,
                lane: None,
            };
            node.control(Control::CreateBinding(spec)).await
        });
        assert!(
            !delete.is_finished(),
            "the delete still waits for its reader"
        );
        drop(reader);
        let open = tokio::time::timeout(Duration::from_secs(5), drain).await;
        assert_eq!(
            open.ok(),
            Some(0),
            "the drain ended once the delete was done"
        );
        let deleted = delete.await.expect("the delete task does not panic");
        assert!(matches!(deleted, Ok(Reply::Deleted { .. })), "{deleted:?}");
        let later = later.await.expect("the create task does not panic");
        assert!(
            matches!(later, Err(crate::control::ControlError::Draining)),
            "{later:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A host-memory node of one lane on 127.0.0.1 whose only source is a port nothing
    /// listens on, its files under `dir`.
    fn host_node(dir: &Path) -> ServeConfig {
        let bytes = shardwire_config::ByteSize(64 << 20);
        // A port nothing listens on (a listener bound and closed again).
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        ServeConfig {
            sources: vec![closed.to_string()],
            socket: dir.join("trainer.sock"),
            data_listen: "127.0.0.1:0".parse().unwrap(),
            pool_size: bytes,
            stream_memory: Some(bytes),
            lanes: shardwire_config::Lanes::Table(vec![shardwire_config::LaneConfig {
                data_listen: Some("127.0.0.1:0".parse().unwrap()),
                ..Default::default()
            }]),
            receive: ReceiveMode::Host,
            io_uring: false,
            memory: shardwire_config::MemoryMode::Host,
            nic_state_file: dir.join("nic-state.json"),
            ..ServeConfig::default()
        }
    }
}
