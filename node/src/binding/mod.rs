//! Making a lane's RX binding: the emulator (one emulated NIC per lane, each binding its own
//! dma-buf), or a NIC's queues chosen from the capability probe (set up, bound, journaled;
//! see [`RxRegion::bind_kernel`]). Used at start (`receive = devmem | devmem-sim | auto`) and
//! by the control task (`POST /v1/bindings`). A node holds at most one binding per lane.

pub mod kernel;
mod region;

use std::path::PathBuf;
use std::sync::Arc;

use shardwire_devmem::emu::host::EmuHost;
use shardwire_devmem::probe::NicReport;
use shardwire_gpu::cuda::CudaMemory;
use shardwire_protocol::trainer::ErrorCode;

pub use self::region::{BindError, BindingKind, RxRegion};
pub(crate) use self::region::{FlowRule, Reading};

/// Why no binding was made.
#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    /// No interface of that name (asked for over the API).
    #[error("no interface named {name} (or `emulator` for the emulator)")]
    UnknownInterface {
        /// The name asked for.
        name: String,
    },
    /// The configured `devmem_interface` does not exist.
    #[error("devmem_interface {name} does not exist here; {probe}")]
    ConfiguredInterfaceMissing {
        /// The name asked for.
        name: String,
        /// What the probe found.
        probe: String,
    },
    /// No interface was named and none can do devmem.
    #[error("{probe}")]
    NoneCapable {
        /// What the probe found, per NIC.
        probe: String,
    },
    /// The interface cannot do devmem.
    #[error("{name} cannot do devmem: {reason}")]
    NotCapable {
        /// The interface.
        name: String,
        /// Why (the probe's reason).
        reason: String,
    },
    /// The lane has a binding already.
    #[error("binding {id} exists on lane {lane}; delete it first (one binding per lane)")]
    Exists {
        /// Its id.
        id: u32,
        /// The lane.
        lane: u32,
    },
    /// No lane of that number.
    #[error("no lane {lane}; this node has {count}")]
    NoLane {
        /// The lane asked for.
        lane: u32,
        /// The node's lane count.
        count: usize,
    },
    /// The interface is not the lane's NIC: a binding there would never see the lane's
    /// traffic.
    #[error(
        "lane {lane} receives through {nic}, not {asked}: bind {nic}'s queues for it (or name the lane whose NIC {asked} is)"
    )]
    NotLanesNic {
        /// The lane.
        lane: u32,
        /// Its NIC.
        nic: String,
        /// The interface asked for.
        asked: String,
    },
    /// Several lanes, and one of them has no NIC to bind.
    #[error(
        "lane {lane} has no NIC: with several lanes every lane names its NIC (lanes = \"auto\" pairs them by PCIe distance)"
    )]
    LaneWithoutNic {
        /// The lane.
        lane: u32,
    },
    /// Lanes whose NIC cannot do devmem (every one named).
    #[error("{lanes}: cannot do devmem; {probe}")]
    LanesNotCapable {
        /// `lane N (NIC)`, comma-separated.
        lanes: String,
        /// What the probe found, per NIC.
        probe: String,
    },
    /// Two lanes on one NIC name a common queue.
    #[error(
        "lanes {} and {} both name RX queue {queue} of {nic}: lanes sharing a NIC bind disjoint queue sets",
        .lanes.0, .lanes.1
    )]
    QueuesOverlap {
        /// The NIC.
        nic: String,
        /// The two lanes.
        lanes: (u32, u32),
        /// A queue both name.
        queue: u32,
    },
    /// The NIC's upper half of RX queues cannot give each of its lanes one.
    #[error(
        "{nic}: {lanes} lane(s) need RX queues but only {free:?} are free in its upper half (queue 0 always stays with RSS); name each lane's queues, or raise the NIC's channels"
    )]
    TooFewQueues {
        /// The NIC.
        nic: String,
        /// Lanes that named none.
        lanes: usize,
        /// Queues left for them.
        free: Vec<u32>,
    },
    /// Each binding made for the lane got an id another binding of the node has (one of the
    /// other kind: the emulator and the kernel number theirs apart), as many times as there
    /// are such ids.
    #[error(
        "the new binding got ids {tried:?}, each one another binding of this node has (ids in use: {taken:?}); delete the bindings of the other kind (emulator or NIC) and try again"
    )]
    IdsTaken {
        /// The ids the new binding got, one per try.
        tried: Vec<u32>,
        /// The ids of the node's other bindings.
        taken: Vec<u32>,
    },
    /// No binding with that id.
    #[error("no binding {id}")]
    NotFound {
        /// The id asked for.
        id: String,
    },
    /// Setting the NIC up, allocating or binding failed (already undone).
    #[error("{what}: {source}")]
    Failed {
        /// Where (the interface, or "the emulator").
        what: String,
        /// The step that failed.
        #[source]
        source: BindError,
    },
}

impl BindingError {
    /// The API code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::UnknownInterface { .. }
            | Self::ConfiguredInterfaceMissing { .. }
            | Self::NoLane { .. }
            | Self::NotLanesNic { .. }
            | Self::LaneWithoutNic { .. } => ErrorCode::UnknownInterface,
            Self::NotFound { .. } => ErrorCode::NotFound,
            Self::NoneCapable { .. } | Self::NotCapable { .. } | Self::LanesNotCapable { .. } => {
                ErrorCode::NotCapable
            }
            Self::QueuesOverlap { .. } | Self::TooFewQueues { .. } => ErrorCode::BindFailed,
            Self::Exists { .. } => ErrorCode::BindingExists,
            Self::Failed { .. } | Self::IdsTaken { .. } => ErrorCode::BindFailed,
        }
    }
}

/// One line about the probe: the capable NICs, or why each NIC that is up cannot.
pub fn probe_summary(nics: &[NicReport]) -> String {
    let capable: Vec<&str> = nics
        .iter()
        .filter(|n| n.devmem_capable)
        .map(|n| n.name.as_str())
        .collect();
    if capable.is_empty() {
        let why: Vec<String> = nics
            .iter()
            .filter(|n| n.up)
            .map(|n| format!("{}: {}", n.name, n.reason))
            .collect();
        format!("no devmem-capable NIC ({})", why.join("; "))
    } else {
        format!("devmem-capable NICs: {}", capable.join(", "))
    }
}

/// The emulated NIC and queues of lane `lane`'s binding: the lane's own NIC `emu{lane}` and
/// the upper half of its queues, or, when the lane names queues, those queues of the lane's
/// NIC (two lanes sharing a NIC name disjoint queue sets; an overlap is refused as `EEXIST`).
pub fn emulated_nic(lane: u32, nic: Option<&str>, queues: &[u32]) -> (String, Vec<u32>) {
    match (nic, queues.is_empty()) {
        (Some(nic), false) => (format!("emu-{nic}"), queues.to_vec()),
        _ => (
            format!("emu{lane}"),
            (region::EMU_RX_QUEUES / 2..region::EMU_RX_QUEUES).collect(),
        ),
    }
}

/// The emulator's binding of `bytes` on `queues` of emulated NIC `nic` of `host`.
pub fn emulator(
    host: &Arc<EmuHost>,
    (nic, queues): (&str, &[u32]),
    bytes: usize,
    cuda: Option<Arc<CudaMemory>>,
) -> Result<Arc<RxRegion>, BindingError> {
    RxRegion::emulated(host, (nic, queues), bytes, cuda).map_err(|source| BindingError::Failed {
        what: format!("the emulator ({nic} queues {queues:?})"),
        source,
    })
}

/// What to bind on a NIC (the admin API's `POST /v1/bindings`, one lane).
#[derive(Debug, Clone)]
pub struct NicRequest {
    /// The interface (`None`: the first devmem-capable one).
    pub name: Option<String>,
    /// RX queues (empty: the upper half of the interface's).
    pub queues: Vec<u32>,
    /// Dma-buf bytes.
    pub bytes: usize,
    /// NIC change journal (the NIC's own: [`kernel::state_file`]).
    pub state_file: PathBuf,
    /// The data port steered to the first bound queue.
    pub data_port: u16,
    /// The interface comes from the configuration (`devmem_interface`), not an API call.
    pub configured: bool,
}

/// The interface a binding request names, or the first devmem-capable one; it must be able to
/// do devmem, or be `named` by the operator (`devmem_interface`, the admin API) with a probe
/// that could not tell ([`NicReport::worth_a_bind`]): a NIC the topology paired is never
/// reconfigured on a guess.
pub fn pick_interface<'a>(
    nics: &'a [NicReport],
    name: Option<&str>,
    configured: bool,
    named: bool,
) -> Result<&'a NicReport, BindingError> {
    let probe = probe_summary(nics);
    let nic = match name {
        Some(name) => nics
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| match configured {
                true => BindingError::ConfiguredInterfaceMissing {
                    name: name.to_owned(),
                    probe: probe.clone(),
                },
                false => BindingError::UnknownInterface {
                    name: name.to_owned(),
                },
            })?,
        None => nics
            .iter()
            .find(|n| n.devmem_capable)
            .ok_or(BindingError::NoneCapable { probe })?,
    };
    // A NIC the operator named whose probe could not tell (an older kernel) gets a real bind,
    // as the probe's reason says: the bind answers.
    let tried = nic.devmem_capable || (named && nic.worth_a_bind());
    if !tried {
        return Err(BindingError::NotCapable {
            name: nic.name.clone(),
            reason: nic.reason.clone(),
        });
    }
    Ok(nic)
}

/// Binds a NIC's queues for one lane (blocking work on a blocking thread); returns the
/// binding and a sentence on what was done. A NIC already set up for another lane is joined.
pub async fn nic(
    nics: &[NicReport],
    r: NicRequest,
    (lane, cuda): (u32, Option<Arc<CudaMemory>>),
) -> Result<(Arc<RxRegion>, String), BindingError> {
    let named = r.name.is_some();
    let nic = pick_interface(nics, r.name.as_deref(), r.configured, named)?.clone();
    let queues: Vec<u32> = if r.queues.is_empty() {
        // Less the queues other lanes have bound on this NIC.
        let free = kernel::upper_half_except(&nic, &kernel::in_use(&nic.name));
        if free.is_empty() {
            return Err(BindingError::TooFewQueues {
                nic: nic.name.clone(),
                lanes: 1,
                free,
            });
        }
        free
    } else {
        r.queues.clone()
    };
    let first = queues.iter().min().copied().unwrap_or(0);
    let (n, q, bytes, state) = (nic.clone(), queues.clone(), r.bytes, r.state_file.clone());
    let ports = [(r.data_port, first)];
    let region = tokio::task::spawn_blocking(move || {
        let mut setup = kernel::setup_nic(&n, &q, &ports, &state)?;
        kernel::bind_lane(&n, &q, bytes, &mut setup, cuda)
    })
    .await
    .expect("the bind task does not panic")
    .map_err(|source| BindingError::Failed {
        what: nic.name.clone(),
        source,
    })?;
    let why = describe(&region, lane, r.data_port);
    Ok((region, why))
}

/// A sentence on a kernel binding made on lane `lane` with data port `port`.
pub fn describe(region: &RxRegion, lane: u32, port: u16) -> String {
    let (ifname, queues) = region.queues();
    let first = queues.iter().min().copied().unwrap_or(0);
    let memory = match region.gpu_gather() {
        true => "GPU region (GPU-direct)",
        false => "udmabuf",
    };
    format!(
        "lane {lane}: {ifname} RX queues {queues:?} bound to a {} {memory} (binding {}); header split on, RSS below queue {first}, data port {port} steered to queue {first}, each data connection to its least-loaded queue by a 5-tuple rule (all undone at shutdown)",
        shardwire_config::ByteSize(region.bytes() as u64),
        region.id(),
    )
}
