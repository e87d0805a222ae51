//! A host's GPUs and NICs, how far apart they are on PCIe, and which NIC each GPU should
//! receive on (DESIGN.md §11, "lanes").
//!
//! [`Tree::read`] walks a sysfs tree (root `/sys` on a host, a fake tree in tests);
//! [`classify`] ranks a GPU/NIC pair PIX < PXB < PHB < SYS as NCCL does; [`pair`] plans one
//! [`LanePlan`] per GPU with its nearest NIC, spreading ties and splitting shared NICs'
//! devmem queues. [`Topology`] bundles the three for `shardwire topology` (JSON via serde,
//! text via [`render_text`]). Reading needs no privileges; nothing here needs a GPU.
//!
//! JSON keys (`serde_json::to_string(&topology)`):
//! - `gpus[]`: `pci`, `uuid` (when the caller knows it from CUDA), `numa_node`, `vendor`, `device` (`"0x10de"`), `local_cpulist`
//!   (`"0-51,104-155"`), `path` {`host_bridge`, `chain[]`}.
//! - `nics[]`: `interface`, `pci`, `numa_node`, `virtual`, `rx_queues`, `devmem_capable`
//!   (when the caller probed it), `vendor`, `device`,
//!   `local_cpulist`, `path` (null when virtual), `speed_mbps`, `link_up`, `sriov_vf`,
//!   `unusable` (why no lane may use it, whatever its distance; absent when it may), and
//!   `passed_over` (why the pairing gives it no GPU although a lane may use it: its link down,
//!   a management NIC, [`passed_over`]; absent when it is a candidate).
//! - `lanes[]`: `lane`, `gpu`, `nic`, `nic_pci`, `distance` (`"PIX"`...), `numa_node` (the
//!   NIC's, else the GPU's), `queues`, `data_addr` (when the caller knows it), `why`, `warn`
//!   (through a CPU, no NIC, or no devmem queue).
//!
//! Unknown values are `null` (NUMA `-1`, virtual NICs' PCI fields, lanes without a NIC).
#![forbid(unsafe_code)]

mod device;
mod distance;
mod pair;
mod path;
mod pci;
mod render;
mod sysfs;
mod values;

use std::path::Path;

use serde::Serialize;

pub use device::{GpuName, GpuNameError, GpuUuid};
pub use distance::{Classified, Distance, classify};
pub use pair::{
    LanePlan, PairOptions, SLOW_FACTOR, devmem_rx_queues, pair, passed_over, plan_queues,
    split_queues,
};
pub use path::PciPath;
pub use pci::{PciAddr, PciAddrError};
pub use render::render_text;
pub use sysfs::{DEFAULT_ROOT, Gpu, NVIDIA_VENDOR, Nic, SysfsError, Tree};
pub use values::{CpulistError, MAX_CPUS, format_ranges, parse_cpulist};

/// What `shardwire topology` shows: the devices found and the lanes planned. Serialized as
/// the module documentation says (each NIC with its `passed_over`, computed over all NICs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// GPUs by PCI address.
    pub gpus: Vec<Gpu>,
    /// Physical NICs by PCI address, then virtual ones by name.
    pub nics: Vec<Nic>,
    /// One lane per GPU, in GPU PCI order; empty without GPUs.
    pub lanes: Vec<LanePlan>,
}

impl Topology {
    /// Plans the lanes of an already read tree.
    pub fn from_tree(tree: &Tree, opts: &PairOptions) -> Topology {
        Topology {
            gpus: tree.gpus.clone(),
            nics: tree.nics.clone(),
            lanes: pair(tree, opts),
        }
    }

    /// Reads the sysfs tree at `root` and plans the lanes.
    pub fn discover(root: &Path, opts: &PairOptions) -> Result<Topology, SysfsError> {
        Ok(Topology::from_tree(&Tree::read(root)?, opts))
    }
}

/// The JSON shape of a NIC: its fields and why it is [`passed_over`], if it is.
#[derive(Serialize)]
struct NicJson<'a> {
    #[serde(flatten)]
    nic: &'a Nic,
    #[serde(skip_serializing_if = "Option::is_none")]
    passed_over: Option<String>,
}

/// The JSON shape of a [`Topology`].
#[derive(Serialize)]
struct TopologyJson<'a> {
    gpus: &'a [Gpu],
    nics: Vec<NicJson<'a>>,
    lanes: &'a [LanePlan],
}

impl Serialize for Topology {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let nics = self
            .nics
            .iter()
            .map(|nic| NicJson {
                nic,
                passed_over: passed_over(&self.nics, nic),
            })
            .collect();
        TopologyJson {
            gpus: &self.gpus,
            nics,
            lanes: &self.lanes,
        }
        .serialize(s)
    }
}
