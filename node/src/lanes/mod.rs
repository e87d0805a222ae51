//! A node's lanes (DESIGN §11): each one GPU paired with one NIC (or a queue share of a NIC),
//! with its own data address, receiver threads, memory pool and (on the devmem lane) RX
//! binding. [`plan`] decides them from the configuration and the host (pure); [`Lane`] is a
//! lane as the node runs it, [`Lanes`] all of them with the GPUs left out and why, and the
//! lookup of the lane a trainer's `device` names.
//!
//! Layers: the plane and the links see a lane id and its data address; streams see the lane's
//! id, GPU and pool; nothing here imports the plane, the links or the streams.

pub mod affinity;
pub mod listen;
pub mod open;
pub mod plan;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use serde::Serialize;
use shardwire_gpu::cuda::CudaMemory;
use shardwire_topology::{GpuName, GpuNameError};

pub use self::plan::LaneSpec;

/// Counters of one lane (the bytes are its flows'; see the plane).
#[derive(Debug, Default)]
pub struct LaneStats {
    /// Data connections identified on the lane's address.
    pub data_connections: AtomicU64,
    /// Data connections refused: announced for this lane, arrived on another address.
    pub wrong_lane: AtomicU64,
    /// Data connections dialled at its NIC's address that came in on its NIC
    /// ([`crate::ingress`]).
    pub on_nic: AtomicU64,
    /// Data connections dialled at its NIC's address that came in on another NIC (received
    /// all the same; [`crate::ingress`]).
    pub wrong_nic: AtomicU64,
    /// Data connections dialled at its NIC's address whose NIC could not be told
    /// ([`crate::ingress`]).
    pub nic_unknown: AtomicU64,
}

/// A lane as the node runs it.
#[derive(Debug)]
pub struct Lane {
    /// What was planned.
    pub spec: LaneSpec,
    /// Its data listener's address (the planned one with the bound port; the IP may be a
    /// wildcard, advertised per source as the control connection's local address).
    pub data_addr: SocketAddr,
    /// Its GPU, opened (`memory = cuda`); `None`: host memory.
    pub cuda: Option<Arc<CudaMemory>>,
    /// The CPUs its receivers are pinned to (empty: not pinned).
    pub cpus: Vec<u32>,
    /// The NUMA node its host regions are placed on (`None`: not placed; checked at start).
    pub numa_bind: Option<u32>,
    /// Why its receivers are not pinned, or its memory not placed, where it was asked.
    pub notes: Vec<String>,
    /// Its counters.
    pub stats: LaneStats,
}

impl Lane {
    /// Lane id.
    pub fn id(&self) -> u32 {
        self.spec.id
    }

    /// True if `name` names this lane's GPU.
    pub fn has(&self, name: &GpuName) -> bool {
        self.spec
            .gpu
            .as_ref()
            .is_some_and(|g| name.is(Some(g.pci), g.uuid))
    }

    /// How `/v1/status` shows the lane's data address, why and warning: as planned, or, for a
    /// lane that [awaited](LaneSpec::awaits_nic_address) its NIC's address and whose NIC has
    /// `nic_ip` now, at that address (sources are moved there: `crate::link::readdress`),
    /// warning only for its pairing.
    pub fn shown(&self, nic_ip: Option<IpAddr>) -> (SocketAddr, String, bool) {
        let spec = &self.spec;
        match (nic_ip, spec.nic.as_deref()) {
            (Some(ip), Some(nic)) if spec.awaits_nic_address => {
                let at = SocketAddr::new(ip, self.data_addr.port());
                let why = format!(
                    "{} (that was at start); {nic} has {ip} now: sources dial the lane at {at} \
                     (a session that began before ends at a moment with nothing under way)",
                    spec.why
                );
                (at, why, spec.warn_at_nic_address)
            }
            _ => (self.data_addr, spec.why.clone(), spec.warn),
        }
    }

    /// `0000:19:00.0 (lane 2)`, or `lane 2 (no GPU)`.
    fn label(&self) -> String {
        match &self.spec.gpu {
            Some(g) => format!("{} (lane {})", g.pci, self.id()),
            None => format!("lane {} (no GPU)", self.id()),
        }
    }
}

/// A GPU that serves no lane: its self-test (or opening it) failed, or the CUDA probe found it
/// unusable beside a usable one.
#[derive(Debug, Clone, Serialize)]
pub struct Excluded {
    /// Its PCI bus id.
    pub gpu: String,
    /// Why (its self-test, or opening it, failed; what the probe found it lacks).
    pub reason: String,
}

/// Why a trainer's `device` names no lane.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Not a PCI bus id or UUID.
    #[error("device: {0}")]
    Name(#[from] GpuNameError),
    /// No lane has that GPU.
    #[error("device {device} is not a GPU this node serves (its GPUs: {gpus}){excluded}")]
    Unknown {
        /// As the trainer named it.
        device: String,
        /// The node's lanes' GPUs.
        gpus: String,
        /// GPUs left out, and why.
        excluded: String,
    },
}

/// Every lane of a node, by id (`0..n`), and the GPUs left out.
#[derive(Debug)]
pub struct Lanes {
    lanes: Vec<Arc<Lane>>,
    excluded: Vec<Excluded>,
}

impl Lanes {
    /// These lanes (ids `0..n` in order) and the GPUs left out.
    pub fn new(lanes: Vec<Arc<Lane>>, excluded: Vec<Excluded>) -> Self {
        debug_assert!(lanes.iter().enumerate().all(|(i, l)| l.id() as usize == i));
        Self { lanes, excluded }
    }

    /// All lanes, by id.
    pub fn all(&self) -> &[Arc<Lane>] {
        &self.lanes
    }

    /// Lane `id`.
    pub fn get(&self, id: u32) -> Option<&Arc<Lane>> {
        self.lanes.get(id as usize)
    }

    /// GPUs planned a lane but left out.
    pub fn excluded(&self) -> &[Excluded] {
        &self.excluded
    }

    /// The lane of the GPU a trainer named.
    pub fn by_device(&self, device: &str) -> Result<&Arc<Lane>, DeviceError> {
        let name: GpuName = device.parse()?;
        if let Some(l) = self.lanes.iter().find(|l| l.has(&name)) {
            return Ok(l);
        }
        let gpus: Vec<String> = self
            .lanes
            .iter()
            .filter(|l| l.spec.gpu.is_some())
            .map(|l| l.label())
            .collect();
        let excluded: Vec<String> = self
            .excluded
            .iter()
            .map(|e| format!("{}: {}", e.gpu, e.reason))
            .collect();
        Err(DeviceError::Unknown {
            device: device.to_owned(),
            gpus: if gpus.is_empty() {
                "none: its lanes are host memory without a GPU".to_owned()
            } else {
                gpus.join(", ")
            },
            excluded: if excluded.is_empty() {
                String::new()
            } else {
                format!("; left out: {}", excluded.join("; "))
            },
        })
    }
}

/// A lane for tests: lane `id`, on the GPU at bus id `gpu` (a fake UUID) or none, without a
/// NIC, listening at 127.0.0.1.
#[cfg(test)]
pub(crate) fn test_lane(id: u32, gpu: Option<&str>) -> Arc<Lane> {
    Arc::new(Lane {
        spec: LaneSpec {
            id,
            gpu: gpu.map(|g| plan::LaneGpu {
                pci: g.parse().unwrap(),
                uuid: Some(
                    format!("GPU-5a77fa4e-0000-40{}-8000-000000000000", &g[5..7])
                        .parse()
                        .unwrap(),
                ),
                ordinal: Some(id as i32),
            }),
            nic: None,
            nic_named: false,
            nic_pci: None,
            distance: None,
            numa_node: None,
            cpus: Vec::new(),
            numa_bind: None,
            queues: Vec::new(),
            data_listen: "127.0.0.1:0".parse().unwrap(),
            awaits_nic_address: false,
            devmem_memory: 1 << 20,
            why: String::new(),
            warn: false,
            warn_at_nic_address: false,
        },
        data_addr: "127.0.0.1:1".parse().unwrap(),
        cuda: None,
        cpus: Vec::new(),
        numa_bind: None,
        notes: Vec::new(),
        stats: LaneStats::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::test_lane as lane;

    /// A lane that awaited its NIC's address is shown at it once the NIC has one, and no
    /// longer warns for its address. Before, `/v1/status` showed the wildcard, the warning
    /// and "has no IPv4 address yet" for the node's whole life.
    #[test]
    fn a_lane_moved_to_its_nics_address_is_shown_there() {
        let mut l = Arc::into_inner(lane(3, None)).unwrap();
        l.spec.nic = Some("eth3".into());
        l.spec.why = "PIX; data address 0.0.0.0:7401 (eth3 has no IPv4 address yet)".into();
        l.spec.warn = true;
        l.data_addr = "0.0.0.0:7401".parse().unwrap();
        let ip = Some(IpAddr::from([10, 0, 3, 5]));
        let (at, why, warn) = l.shown(ip);
        assert_eq!(
            (at, warn),
            (l.data_addr, true),
            "awaits no address: as planned"
        );
        assert_eq!(why, l.spec.why);
        l.spec.awaits_nic_address = true;
        assert_eq!(l.shown(None), (l.data_addr, l.spec.why.clone(), true));
        let (at, why, warn) = l.shown(ip);
        assert_eq!(at.to_string(), "10.0.3.5:7401");
        assert!(!warn, "{why}");
        assert!(
            why.ends_with(
                "eth3 has 10.0.3.5 now: sources dial the lane at 10.0.3.5:7401 (a \
                           session that began before ends at a moment with nothing under way)"
            ),
            "{why}"
        );
        l.spec.warn_at_nic_address = true; // a pairing through a CPU warns still
        assert!(l.shown(ip).2);
    }

    #[test]
    fn a_device_names_its_lane_by_bus_id_or_uuid_in_any_spelling() {
        let lanes = Lanes::new(
            vec![lane(0, Some("0000:19:00.0")), lane(1, Some("0000:2a:00.0"))],
            vec![],
        );
        for name in [
            "0000:2a:00.0",
            "0000:2A:00.0",
            "2a:00.0",
            "GPU-5a77fa4e-0000-402a-8000-000000000000",
        ] {
            assert_eq!(lanes.by_device(name).unwrap().id(), 1, "{name}");
        }
    }

    #[test]
    fn an_unknown_device_is_named_with_the_nodes_gpus_and_those_left_out() {
        let lanes = Lanes::new(
            vec![lane(0, Some("0000:19:00.0"))],
            vec![Excluded {
                gpu: "0000:2a:00.0".into(),
                reason: "self-test failed: CRC kernel".into(),
            }],
        );
        let e = lanes.by_device("0000:2a:00.0").unwrap_err().to_string();
        assert_eq!(
            e,
            "device 0000:2a:00.0 is not a GPU this node serves (its GPUs: 0000:19:00.0 (lane 0)); left out: 0000:2a:00.0: self-test failed: CRC kernel"
        );
        let e = lanes.by_device("cuda:1").unwrap_err().to_string();
        assert!(e.starts_with("device: `cuda:1` names no GPU"), "{e}");
        let host = Lanes::new(vec![lane(0, None)], vec![]);
        let e = host.by_device("0000:19:00.0").unwrap_err().to_string();
        assert!(
            e.contains("its GPUs: none: its lanes are host memory"),
            "{e}"
        );
    }
}
