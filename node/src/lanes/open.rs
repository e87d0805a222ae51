//! Making the lanes at start: reading the sysfs tree, planning ([`super::plan`]), opening each
//! lane's GPU (its self-test; a lane whose GPU fails is left out, with the reason), binding the
//! data listeners ([`super::listen`]), and checking, per lane, that its receivers can run on
//! its CPUs and its host memory can be placed on its NUMA node. Each decision has a reason for
//! the startup log and `/v1/status`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use shardwire_config::{Lanes as LanesConfig, MemoryMode, ServeConfig};
use shardwire_gpu::cuda::CudaMemory;
use shardwire_gpu::{GpuDevice, GpuError, GpuProbe, HostRegion, MemoryChoice};
use shardwire_protocol::trainer::MemoryKind;
use shardwire_protocol::wire::MAX_SESSION_FLOWS;
use shardwire_topology::{SysfsError, Tree};

use super::affinity;
use super::listen::{self, Listener};
use super::plan::{self, Inputs, PlanError};
use super::{Excluded, Lane, LaneSpec, LaneStats, Lanes};

/// Why the lanes cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum LaneStartError {
    /// A configured sysfs root cannot be read.
    #[error("sysfs_root = {0}")]
    Sysfs(#[source] SysfsError),
    /// The plan is impossible (a table names what is not there).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// `memory = "cuda"` and no usable GPU (the probe says why).
    #[error(transparent)]
    Memory(GpuError),
    /// `memory = "cuda"` and no lane's GPU opened.
    #[error("memory = \"cuda\": no GPU could be opened: {0}")]
    GpuOpen(String),
    /// lanes x `flows` is more data connections than a source dials for one node: every
    /// source would welcome the node, then end each of its sessions.
    #[error(
        "flows = {flows} on each of this node's {lanes} lanes asks each source for {total} data \
         connections, and a source dials at most {max} per node (lanes x flows): set flows to \
         at most {fits}, or use fewer lanes (a `lanes` table)"
    )]
    TooManyFlows {
        /// The lanes.
        lanes: usize,
        /// The `flows` key.
        flows: u16,
        /// lanes x flows.
        total: u64,
        /// The most a source dials for one node ([`MAX_SESSION_FLOWS`]).
        max: u64,
        /// The most `flows` these lanes allow.
        fits: u64,
    },
    /// A data listener could not be bound.
    #[error("cannot bind the data port of lanes {lanes:?} on {addr}: {source}")]
    Bind {
        /// The lanes it serves.
        lanes: Vec<u32>,
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The lanes made at start.
pub struct Started {
    /// The lanes.
    pub lanes: Arc<Lanes>,
    /// The data listeners.
    pub listeners: Vec<tokio::net::TcpListener>,
    /// Where stream regions live (CUDA when any lane has a GPU opened).
    pub memory: MemoryKind,
    /// Why.
    pub memory_reason: String,
}

/// The sysfs tree at `root`: an error if it was configured and cannot be read, an empty tree
/// (and a warning) if `/sys` itself cannot.
fn read_tree(root: &Path) -> Result<Tree, LaneStartError> {
    match Tree::read(root) {
        Ok(t) => Ok(t),
        Err(e) if root == Path::new(shardwire_topology::DEFAULT_ROOT) => {
            tracing::warn!(error = %e, "cannot read the sysfs tree: lanes get no NIC pairing");
            Ok(Tree::default())
        }
        Err(e) => Err(LaneStartError::Sysfs(e)),
    }
}

/// The CUDA devices lanes may use: none with `memory = "host"`; the usable ones otherwise
/// (`memory = "cuda"` without one is an error naming why).
pub fn cuda_devices(mode: MemoryMode, probe: &GpuProbe) -> Result<Vec<GpuDevice>, LaneStartError> {
    let choice = match mode {
        MemoryMode::Host => return Ok(Vec::new()),
        MemoryMode::Auto => MemoryChoice::Auto,
        MemoryMode::Cuda => MemoryChoice::Cuda,
    };
    let d = shardwire_gpu::choose_memory(choice, probe).map_err(LaneStartError::Memory)?;
    Ok(match d.device {
        None => Vec::new(),
        Some(_) => probe
            .devices
            .iter()
            .filter(|d| d.usable())
            .cloned()
            .collect(),
    })
}

/// The GPUs the probe found unusable beside the usable ones lanes are made of (`cuda`: none
/// with host memory, or without a usable GPU): they get no lane, and each is listed as left
/// out with what it lacks (a trainer naming one reads why; `/v1/status` `lanes_excluded`).
pub fn unusable_gpus(cuda: &[GpuDevice], probe: &GpuProbe) -> Vec<Excluded> {
    if cuda.is_empty() {
        return Vec::new();
    }
    let left_out = probe.devices.iter().filter_map(|d| {
        let why = d.unusable_because()?;
        Some(Excluded {
            gpu: d.pci_bus_id.clone(),
            reason: format!("the CUDA probe left it out: {why}"),
        })
    });
    left_out.collect()
}

/// Planned lanes, each with its GPU's memory where one was opened for it.
type KeptLanes = Vec<(LaneSpec, Option<Arc<CudaMemory>>)>;

/// The lanes planned, with their GPUs opened, and the GPUs left out.
struct Opened {
    /// The lanes kept, each with its GPU where it has one opened.
    kept: KeptLanes,
    /// GPUs that failed to open or their self-test (CUDA memory only).
    failed: Vec<Excluded>,
    /// GPUs the probe found unusable beside a usable one ([`unusable_gpus`]), logged as
    /// planning began.
    unusable: Vec<Excluded>,
    /// Where stream regions live.
    memory: MemoryKind,
    /// Why.
    reason: String,
}

/// Plans the lanes and opens their GPUs.
async fn plan_and_open(cfg: &ServeConfig, probe: &GpuProbe) -> Result<Opened, LaneStartError> {
    let root = cfg.sysfs_root.clone();
    let tree = tokio::task::spawn_blocking(move || read_tree(&root))
        .await
        .expect("reading sysfs does not panic")?;
    for n in tree.nics.iter().filter(|n| !n.is_virtual) {
        if let Some(why) = &n.unusable {
            tracing::warn!(nic = %n.interface, "NIC not paired with any GPU: {why}");
        }
    }
    let cuda = cuda_devices(cfg.memory, probe)?;
    // Before planning: a lanes table naming such a GPU fails next, pointing to this line.
    let unusable = unusable_gpus(&cuda, probe);
    for e in &unusable {
        tracing::warn!(gpu = %e.gpu, reason = %e.reason, "GPU left out: it serves no lane");
    }
    let specs = plan::plan(
        &Inputs::of(cfg, &tree, &cuda),
        &shardwire_devmem::ifaddr::ipv4,
    )?;
    let (mut kept, mut excluded, failures) = open_lane_gpus(specs, &cuda).await;
    let opened = kept.iter().filter(|(_, m)| m.is_some()).count();
    let (memory, mut reason) = memory_decision(cfg, probe, &kept, &failures)?;
    if memory == MemoryKind::Cuda {
        let names: Vec<&str> = unusable.iter().map(|e| e.gpu.as_str()).collect();
        if !names.is_empty() {
            reason.push_str(&format!(
                "; left out, not usable: {} (lanes_excluded)",
                names.join(", ")
            ));
        }
        // CUDA memory: a lane whose GPU did not open is left out (it is in `excluded`).
        let failed: Vec<String> = excluded.iter().map(|e| e.gpu.clone()).collect();
        kept.retain(|(s, m)| {
            m.is_some()
                || !s
                    .gpu
                    .as_ref()
                    .is_some_and(|g| failed.contains(&g.pci.to_string()))
        });
    } else {
        excluded.clear(); // host memory: every lane stays, none needs its GPU opened
    }
    debug_assert!(memory == MemoryKind::Host || opened > 0);
    Ok(Opened {
        kept,
        failed: excluded,
        unusable,
        memory,
        reason,
    })
}

/// Each planned lane's GPU opened (with its self-test), where the node may use CUDA for it:
/// the lanes with their memory (`None`: no GPU opened for it), the GPUs that failed (for
/// `lanes_excluded`) and what each failure said.
async fn open_lane_gpus(
    specs: Vec<LaneSpec>,
    cuda: &[GpuDevice],
) -> (KeptLanes, Vec<Excluded>, Vec<String>) {
    let mut kept = Vec::new();
    let (mut excluded, mut failures) = (Vec::new(), Vec::new());
    for spec in specs {
        let Some(device) = spec_device(&spec, cuda) else {
            kept.push((spec, None));
            continue;
        };
        let info = device.clone();
        let opened =
            tokio::task::spawn_blocking(move || shardwire_gpu::cuda::open_for_service(&info))
                .await
                .expect("opening the GPU does not panic");
        match opened {
            Ok(m) => {
                if let Some(why) = &m.dma_buf_default_mapping {
                    let what = shardwire_gpu::probe::device_text(device);
                    tracing::warn!(lane = spec.id, gpu = %what, "{why}");
                }
                if let Some(why) = &m.dma_buf_refused {
                    let what = shardwire_gpu::probe::device_text(device);
                    tracing::warn!(lane = spec.id, gpu = %what, "the GPU's memory does not export as a dma-buf ({why}): streams land in it through pinned staging (receive = \"host\") or a mapped host dma-buf (\"devmem-sim\"), but receive = \"devmem\" cannot bind it to NIC queues");
                }
                kept.push((spec, Some(Arc::new(m))))
            }
            Err(e) => {
                let what = shardwire_gpu::probe::device_text(device);
                tracing::error!(lane = spec.id, gpu = %what, error = %e, "the lane's GPU failed to open or its self-test failed: the lane is left out");
                failures.push(format!("{what}: {e}"));
                excluded.push(Excluded {
                    gpu: device.pci_bus_id.clone(),
                    reason: format!("opening it or its self-test failed: {e}"),
                });
                kept.push((spec, None));
            }
        }
    }
    (kept, excluded, failures)
}

/// The CUDA device of a planned lane, if the node may use CUDA for it.
fn spec_device<'a>(spec: &LaneSpec, cuda: &'a [GpuDevice]) -> Option<&'a GpuDevice> {
    let ordinal = spec.gpu.as_ref()?.ordinal?;
    cuda.iter().find(|d| d.ordinal == ordinal)
}

/// Host or CUDA memory after opening the lanes' GPUs, and why.
fn memory_decision(
    cfg: &ServeConfig,
    probe: &GpuProbe,
    kept: &[(LaneSpec, Option<Arc<CudaMemory>>)],
    failures: &[String],
) -> Result<(MemoryKind, String), LaneStartError> {
    let opened: Vec<&CudaMemory> = kept.iter().filter_map(|(_, m)| m.as_deref()).collect();
    let how = match cfg.memory {
        MemoryMode::Cuda => "configured (memory = \"cuda\")",
        _ => "auto",
    };
    if cfg.memory == MemoryMode::Host {
        return Ok((MemoryKind::Host, "configured (memory = \"host\")".into()));
    }
    if opened.is_empty() {
        if !failures.is_empty() && cfg.memory == MemoryMode::Cuda {
            return Err(LaneStartError::GpuOpen(failures.join("; ")));
        }
        let why = match failures.first() {
            Some(f) => format!("auto: {f}; using host memory"),
            None => format!("auto: no CUDA driver or usable GPU ({})", probe.reason),
        };
        return Ok((MemoryKind::Host, why));
    }
    let text = |m: &CudaMemory| match (&m.dma_buf_refused, &m.dma_buf_default_mapping) {
        (None, None) => shardwire_gpu::probe::device_text(&m.info),
        (Some(why), _) => format!(
            "{} (no dma-buf export, so no devmem receive into it: {why})",
            shardwire_gpu::probe::device_text(&m.info)
        ),
        (None, Some(why)) => format!(
            "{} (dma-buf with the driver's default mapping: {why})",
            shardwire_gpu::probe::device_text(&m.info)
        ),
    };
    let reason = match (opened.as_slice(), cfg.memory) {
        ([one], MemoryMode::Cuda) => format!("{how}: {}", text(one)),
        ([one], _) if one.dma_buf_refused.is_some() => {
            format!("{how}: {} has VMM support", text(one))
        }
        ([one], _) => format!("{how}: {} has dma-buf and VMM support", text(one)),
        (all, _) => {
            let names: Vec<String> = all.iter().map(|m| text(m)).collect();
            format!(
                "{how}: {} GPUs, one lane each: {}",
                all.len(),
                names.join(", ")
            )
        }
    };
    Ok((MemoryKind::Cuda, reason))
}

/// Binds the listeners of `specs` (ids `0..n`); returns them and each lane's bound address.
fn bind_listeners(
    specs: &[LaneSpec],
) -> Result<(Vec<tokio::net::TcpListener>, Vec<SocketAddr>), LaneStartError> {
    let plan: Vec<Listener> = listen::group(
        &specs
            .iter()
            .map(|s| (s.id, s.data_listen))
            .collect::<Vec<_>>(),
    );
    let mut bound = vec![None; specs.len()];
    let mut out = Vec::with_capacity(plan.len());
    for l in plan {
        let sock = listen::bind(l.addr).map_err(|source| LaneStartError::Bind {
            lanes: l.lanes.clone(),
            addr: l.addr,
            source,
        })?;
        let port = sock.local_addr().expect("bound").port();
        for id in &l.lanes {
            let ip = specs[*id as usize].data_listen.ip();
            bound[*id as usize] = Some(SocketAddr::new(ip, port));
        }
        out.push(sock);
    }
    let addrs = bound
        .into_iter()
        .map(|a| a.expect("every lane has a listener"))
        .collect();
    Ok((out, addrs))
}

/// The CPUs a lane's receivers run on, and the NUMA node its host memory goes to, as this
/// process and kernel allow (`allowed`: this process's CPUs, or why they could not be read);
/// a note for each that is not possible.
fn placement(
    spec: &LaneSpec,
    allowed: &Result<Vec<u32>, affinity::PinError>,
    host: bool,
) -> (Vec<u32>, Option<u32>, Vec<String>) {
    let mut notes = Vec::new();
    let cpus = match (spec.cpus.as_slice(), allowed) {
        ([], _) => Vec::new(),
        // The call's error, not "none of the lane's CPUs is allowed (allowed: )".
        (_, Err(e)) => {
            notes.push(format!(
                "receivers not pinned: this process's CPUs could not be read: {e}"
            ));
            Vec::new()
        }
        (wanted, Ok(allowed)) => affinity::usable(wanted, allowed).unwrap_or_else(|e| {
            notes.push(format!("receivers not pinned: {e}"));
            Vec::new()
        }),
    };
    let numa = match (spec.numa_bind, host) {
        (Some(node), true) => match HostRegion::new("shardwire-numa-check", 4096)
            .and_then(|r| r.prefer_numa_node(node))
        {
            Ok(()) => Some(node),
            Err(e) => {
                notes.push(format!("host memory not placed on NUMA node {node}: {e}"));
                None
            }
        },
        _ => None,
    };
    (cpus, numa, notes)
}

/// Refuses `lanes` lanes of `flows` data connections each when a source would refuse them
/// ([`MAX_SESSION_FLOWS`]): it would complete every handshake, then end the session, and the
/// node would reconnect for ever with no data (only a `lanes` table is checked as the
/// configuration loads; `"auto"` finds its lanes here).
fn check_session_flows(lanes: usize, flows: u16) -> Result<(), LaneStartError> {
    let total = lanes as u64 * u64::from(flows);
    if total <= MAX_SESSION_FLOWS {
        return Ok(());
    }
    Err(LaneStartError::TooManyFlows {
        lanes,
        flows,
        total,
        max: MAX_SESSION_FLOWS,
        fits: MAX_SESSION_FLOWS / lanes as u64,
    })
}

/// Makes the lanes of `cfg`.
pub async fn open(cfg: &ServeConfig, probe: &GpuProbe) -> Result<Started, LaneStartError> {
    let Opened {
        kept,
        failed,
        unusable,
        memory,
        reason: memory_reason,
    } = plan_and_open(cfg, probe).await?;
    // The lanes kept are the ones every source is asked to dial.
    check_session_flows(kept.len(), cfg.flows)?;
    // Ids 0..n over the lanes kept (the wire numbers lanes by position).
    let specs: Vec<LaneSpec> = kept
        .iter()
        .enumerate()
        .map(|(i, (s, _))| LaneSpec {
            id: i as u32,
            ..s.clone()
        })
        .collect();
    let (listeners, addrs) = bind_listeners(&specs)?;
    let allowed = affinity::allowed();
    let lanes: Vec<Arc<Lane>> = specs
        .into_iter()
        .zip(kept.into_iter().map(|(_, m)| m))
        .zip(addrs)
        .map(|((spec, cuda), data_addr)| {
            let (cpus, numa_bind, notes) = placement(&spec, &allowed, cuda.is_none());
            Arc::new(Lane {
                spec,
                data_addr,
                cuda,
                cpus,
                numa_bind,
                notes,
                stats: LaneStats::default(),
            })
        })
        .collect();
    log_lanes(&lanes, &failed, &cfg.lanes);
    // The unusable ones were logged as planning began.
    let excluded = failed.into_iter().chain(unusable).collect();
    Ok(Started {
        lanes: Arc::new(Lanes::new(lanes, excluded)),
        listeners,
        memory,
        memory_reason,
    })
}

/// One log line per lane (a warning when the plan marks it: see its `why`) and per
/// GPU that failed to open (`excluded`).
fn log_lanes(lanes: &[Arc<Lane>], excluded: &[Excluded], cfg: &LanesConfig) {
    let source = match cfg {
        LanesConfig::Auto => "auto",
        LanesConfig::Table(_) => "configured",
    };
    for l in lanes {
        let s = &l.spec;
        let gpu = s.gpu.as_ref().map_or("-".to_owned(), |g| g.pci.to_string());
        let (nic, dist) = (
            s.nic.as_deref().unwrap_or("-"),
            s.distance.map_or("-".to_owned(), |d| d.to_string()),
        );
        let cpus = shardwire_topology::format_ranges(&l.cpus);
        let memory = if l.cuda.is_some() { "cuda" } else { "host" };
        if s.warn {
            tracing::warn!(lane = s.id, %gpu, %nic, distance = %dist, data = %l.data_addr, memory, cpus = %cpus, lanes = source, why = %s.why,
                "lane: GPU-direct receive is slow or unavailable there (its GPU and NIC are far apart, it has no NIC, its NIC has no devmem queue, or its data address is not its NIC's: see why)");
        } else {
            tracing::info!(lane = s.id, %gpu, %nic, distance = %dist, data = %l.data_addr, memory, cpus = %cpus, lanes = source, why = %s.why, "lane");
        }
        for n in &l.notes {
            tracing::warn!(lane = s.id, "{n}");
        }
    }
    for e in excluded {
        tracing::error!(gpu = %e.gpu, reason = %e.reason, "GPU left out: it serves no lane");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane with no GPU or NIC on 127.0.0.1, its receivers to be pinned to CPUs 2 and 3.
    fn spec() -> LaneSpec {
        let mut spec = crate::lanes::test_lane(0, None).spec.clone();
        spec.cpus = vec![2, 3];
        spec
    }

    #[test]
    fn a_lane_says_why_when_this_process_cpus_cannot_be_read() {
        let spec = spec();
        let failed = Err(affinity::PinError::Syscall {
            call: "sched_getaffinity",
            errno: rustix::io::Errno::PERM,
        });
        // Before: the error was dropped, and the note said no CPU was allowed ("allowed: ").
        let (cpus, _, notes) = placement(&spec, &failed, false);
        assert!(cpus.is_empty());
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("sched_getaffinity"), "{notes:?}");
        let (cpus, _, notes) = placement(&spec, &Ok(vec![3, 4]), false);
        assert_eq!((cpus, notes.len()), (vec![3], 0));
    }

    fn gpu(ordinal: i32, name: &str, compute_capability: (i32, i32)) -> GpuDevice {
        GpuDevice {
            ordinal,
            name: name.to_owned(),
            pci_bus_id: format!("0000:1{ordinal}:00.0"),
            uuid: None,
            total_memory: 16 << 30,
            compute_capability,
            dma_buf_supported: true,
            vmm_supported: true,
            gpu_direct_rdma_with_cuda_vmm_supported: true,
        }
    }

    #[test]
    fn lanes_get_no_gpu_below_compute_capability_8() {
        // Before, a T4 (7.5: the sm_80 PTX cannot load) was a lane's GPU and failed to open.
        let probe = GpuProbe {
            driver_present: true,
            driver_version: Some(12080),
            devices: vec![gpu(0, "Tesla T4", (7, 5)), gpu(1, "NVIDIA A100", (8, 0))],
            usable: true,
            reason: "CUDA driver 12.8 with GPU 1 usable".to_owned(),
        };
        for mode in [MemoryMode::Auto, MemoryMode::Cuda] {
            let kept = cuda_devices(mode, &probe).unwrap();
            let ordinals: Vec<i32> = kept.iter().map(|d| d.ordinal).collect();
            assert_eq!(ordinals, vec![1], "{mode:?}");
        }
        let t4_only = GpuProbe {
            devices: vec![gpu(0, "Tesla T4", (7, 5))],
            usable: false,
            reason: "none of the 1 CUDA device(s) is usable".to_owned(),
            ..probe
        };
        assert!(cuda_devices(MemoryMode::Auto, &t4_only).unwrap().is_empty());
        assert!(cuda_devices(MemoryMode::Cuda, &t4_only).is_err());
    }

    /// A T4 beside an A100: the T4 gets no lane, and it is listed as left out with what it
    /// lacks, so a trainer naming it reads why. Before, it was dropped without a word (not
    /// in `lanes_excluded`, not logged).
    #[test]
    fn a_gpu_left_out_as_unusable_beside_a_usable_one_says_why() {
        let probe = GpuProbe {
            driver_present: true,
            driver_version: Some(12080),
            devices: vec![gpu(0, "Tesla T4", (7, 5)), gpu(1, "NVIDIA A100", (8, 0))],
            usable: true,
            reason: "CUDA driver 12.8 with GPU 1 usable".to_owned(),
        };
        let cuda = cuda_devices(MemoryMode::Auto, &probe).unwrap();
        let left_out = unusable_gpus(&cuda, &probe);
        assert_eq!(left_out.len(), 1, "{left_out:?}");
        assert_eq!(left_out[0].gpu, "0000:10:00.0");
        assert!(
            left_out[0]
                .reason
                .contains("compute capability 7.5 is below 8.0"),
            "{}",
            left_out[0].reason
        );
        let mut a100 = Arc::into_inner(crate::lanes::test_lane(0, Some("0000:11:00.0"))).unwrap();
        a100.spec.cpus = vec![2, 3];
        let lane = Arc::new(a100);
        let lanes = Lanes::new(vec![lane], left_out);
        let e = lanes.by_device("0000:10:00.0").unwrap_err().to_string();
        let want = "left out: 0000:10:00.0: the CUDA probe left it out: compute capability 7.5";
        assert!(e.contains(want), "{e}");
        // Host memory, or no usable GPU: no lane has a GPU, none is named as left out.
        assert!(unusable_gpus(&[], &probe).is_empty());
        let host = cuda_devices(MemoryMode::Host, &probe).unwrap();
        assert!(unusable_gpus(&host, &probe).is_empty());
    }

    #[test]
    fn lanes_asking_a_source_for_more_connections_than_it_dials_are_refused_at_start() {
        // Before, an 8-GPU host with `lanes = "auto"` and flows = 64 started and said it was
        // ready; every source then refused every session (512 data connections, at most 256).
        let e = check_session_flows(8, 64)
            .expect_err("512 > 256")
            .to_string();
        for want in [
            "flows = 64",
            "8 lanes",
            "512 data connections",
            "at most 256",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        assert!(e.contains("set flows to at most 32"), "{e}");
        let e = check_session_flows(9, 32)
            .expect_err("288 > 256")
            .to_string();
        assert!(e.contains("at most 28"), "{e}");
        assert!(check_session_flows(8, 32).is_ok(), "exactly the limit");
        assert!(check_session_flows(1, 64).is_ok());
    }
}
