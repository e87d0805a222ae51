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
//!   `local_cpulist`, `path` (null when virtual), `speed_mbps`, `link_up`, `sriov_vf`, and
//!   `unusable` (why no lane may use it; absent when it may).
//! - `lanes[]`: `lane`, `gpu`, `nic`, `nic_pci`, `distance` (`"PIX"`...), `numa_node` (the
//!   NIC's, else the GPU's), `queues`, `data_addr` (when the caller knows it), `why`, `warn`.
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
    LanePlan, PairOptions, SLOW_FACTOR, devmem_rx_queues, pair, passed_over, split_queues,
};
pub use path::PciPath;
pub use pci::{PciAddr, PciAddrError};
pub use render::render_text;
pub use sysfs::{DEFAULT_ROOT, Gpu, NVIDIA_VENDOR, Nic, SysfsError, Tree};
pub use values::{format_ranges, parse_cpulist};

/// What `shardwire topology` shows: the devices found and the lanes planned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
