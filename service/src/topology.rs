//! `shardwire topology`: the GPUs (PCI bus id, UUID when CUDA sees it, NUMA node), the NICs
//! (interface, PCI bus id, NUMA node, devmem capable) and the lanes `serve` would run with this
//! configuration, each with its distance class and why: the node's own plan
//! (`shardwire_node::plan_lanes`), rendered by `shardwire_topology` as text or JSON.
//!
//! A `sysfs_root` that is not a mounted sysfs (a fixture, a copy of another host's tree) is
//! planned from its own GPUs: this host's CUDA devices, their UUIDs and its devmem probe
//! describe this host, not that tree (a GPU host showed one lane of a fake 8-GPU tree, with
//! its own GPU's UUID on the fake GPU of the same bus id), so neither is asked for (nor is
//! `memory = "cuda"` refused on a host without a usable GPU). Data addresses are still looked
//! up here, as `serve` looks them up: the WHY column says which interface each came from, or
//! that it does not exist here.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use serde::Serialize;
use shardwire_config::ServeConfig;
use shardwire_devmem::ifaddr::IfAddrError;
use shardwire_gpu::{GpuDevice, GpuProbe};
use shardwire_node::{LaneInputs, LaneSpec, PlanError};
use shardwire_topology::{LanePlan, PairOptions, Topology, Tree};

/// Flags of `shardwire topology` that are configuration keys.
#[derive(Serialize, Default)]
pub struct TopologyFlags {
    /// `--sysfs-root`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sysfs_root: Option<PathBuf>,
}

/// An interface's IPv4 address (`shardwire_devmem::ifaddr::ipv4` on a host).
type Ipv4Lookup<'a> = &'a dyn Fn(&str) -> Result<Option<Ipv4Addr>, IfAddrError>;

/// A planned lane in the topology document's shape (lanes without a GPU are not listed: the
/// text says when none has one).
fn lane_plan(spec: &LaneSpec, tree: &Tree) -> Option<LanePlan> {
    let gpu = spec.gpu.as_ref()?;
    Some(LanePlan {
        lane: spec.id,
        gpu: gpu.pci,
        gpu_numa: tree
            .gpus
            .iter()
            .find(|g| g.pci == gpu.pci)
            .and_then(|g| g.numa_node),
        nic: spec.nic.clone(),
        nic_pci: spec.nic_pci,
        nic_numa: spec.numa_node,
        distance: spec.distance,
        queues: spec.queues.clone(),
        data_addr: Some(spec.data_listen.to_string()),
        why: spec.why.clone(),
        warn: spec.warn,
    })
}

/// sysfs's file system magic number (`SYSFS_MAGIC`, linux/magic.h).
const SYSFS_MAGIC: u64 = 0x6265_6572;

/// Whether `cfg.sysfs_root` is this host's own tree, which its CUDA devices and its devmem
/// probe describe: `/sys`, or a sysfs mounted elsewhere (a container's `/host/sys`), not a
/// copy of another host's tree.
fn own_tree(cfg: &ServeConfig) -> bool {
    let root = &cfg.sysfs_root;
    root == Path::new(shardwire_topology::DEFAULT_ROOT)
        || rustix::fs::statfs(root).is_ok_and(|s| s.f_type as u64 == SYSFS_MAGIC)
}

/// The devices of `tree` and the lanes `serve` would plan over them, with `cuda` the CUDA
/// devices lanes may use and `listed` every device the driver lists (for UUIDs); both are
/// ignored for a tree that is not this host's ([`own_tree`]).
fn plan(
    cfg: &ServeConfig,
    tree: &Tree,
    cuda: &[GpuDevice],
    listed: &[GpuDevice],
    ipv4: Ipv4Lookup<'_>,
) -> Result<Topology, PlanError> {
    let none: &[GpuDevice] = &[];
    let (cuda, listed) = match own_tree(cfg) {
        true => (cuda, listed),
        false => (none, none),
    };
    let specs = shardwire_node::plan_lanes(&LaneInputs::of(cfg, tree, cuda), ipv4)?;
    let mut topo = Topology::from_tree(tree, &PairOptions::default());
    for g in &mut topo.gpus {
        let pci = g.pci.to_string();
        g.uuid = listed
            .iter()
            .find(|d| d.pci_bus_id == pci)
            .and_then(|d| d.uuid.as_deref()?.parse().ok());
    }
    topo.lanes = specs.iter().filter_map(|s| lane_plan(s, tree)).collect();
    Ok(topo)
}

/// The CUDA devices lanes may use and every device the driver lists (for UUIDs), from
/// `probe` (`shardwire_gpu::probe_gpus`), for this host's own tree; none for another host's
/// ([`own_tree`]), which is planned from its own GPUs: there the driver is not asked (with
/// `memory = "cuda"` on a host without a usable GPU, such a tree was refused as `serve`
/// refuses this host, though this host's CUDA plays no part in its plan).
fn host_gpus(
    cfg: &ServeConfig,
    probe: impl FnOnce() -> GpuProbe,
) -> anyhow::Result<(Vec<GpuDevice>, Vec<GpuDevice>)> {
    if !own_tree(cfg) {
        return Ok((Vec::new(), Vec::new()));
    }
    let probe = probe();
    // As `serve` would: the usable CUDA devices (none with memory = "host", or with "auto"
    // and no usable driver: then the GPUs of the tree, as host-memory lanes). With "cuda" and
    // no usable GPU, `serve` refuses to start: so does this, with its reason, instead of
    // showing host lanes that would never run.
    let cuda = shardwire_node::cuda_devices(cfg.memory, &probe)
        .context("`serve` would refuse to start with this configuration")?;
    Ok((cuda, probe.devices))
}

/// The topology of `cfg.sysfs_root` with the lanes `serve` would plan.
fn discover(cfg: &ServeConfig) -> anyhow::Result<Topology> {
    let tree = Tree::read(&cfg.sysfs_root)
        .with_context(|| format!("reading the sysfs tree at {}", cfg.sysfs_root.display()))?;
    let (cuda, listed) = host_gpus(cfg, shardwire_gpu::probe_gpus)?;
    let mut topo = plan(cfg, &tree, &cuda, &listed, &shardwire_devmem::ifaddr::ipv4)?;
    if own_tree(cfg) {
        // The probe looks at this host's interfaces: only meaningful for its own tree.
        let nics = shardwire_devmem::probe::probe_nics();
        for n in &mut topo.nics {
            n.devmem_capable = nics
                .iter()
                .find(|r| r.name == n.interface)
                .map(|r| r.devmem_capable);
        }
    }
    Ok(topo)
}

/// Runs `shardwire topology`.
pub fn run(config: Option<&Path>, flags: &TopologyFlags, json: bool) -> anyhow::Result<ExitCode> {
    let cfg = ServeConfig::load(config, flags)?;
    let topo = discover(&cfg)?;
    let text = match json {
        true => serde_json::to_string_pretty(&topo)? + "\n",
        false => shardwire_topology::render_text(&topo),
    };
    // A closed pipe (`| head`) ends the output quietly (`crate::out`).
    crate::out::out!("{text}");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use shardwire_topology::Distance;

    use super::*;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/sysfs/a3-8gpu-8nic"
    );

    /// A usable CUDA device at the bus id of the fixture's first GPU.
    fn local_gpu() -> GpuDevice {
        GpuDevice {
            ordinal: 0,
            name: "this host's GPU".into(),
            pci_bus_id: "0000:05:00.0".into(),
            uuid: Some("GPU-5a77fa4e-0000-4000-8000-000000000000".into()),
            total_memory: 1 << 30,
            compute_capability: (9, 0),
            dma_buf_supported: true,
            vmm_supported: true,
            gpu_direct_rdma_with_cuda_vmm_supported: true,
        }
    }

    fn no_addr(ifname: &str) -> Result<Option<Ipv4Addr>, IfAddrError> {
        Err(IfAddrError::NoSuchInterface(ifname.to_owned()))
    }

    #[test]
    fn another_hosts_tree_is_planned_from_its_own_gpus() {
        let tree = Tree::read(Path::new(FIXTURE)).expect("fixture tree");
        let gpu = [local_gpu()];
        let cfg = ServeConfig {
            sysfs_root: FIXTURE.into(),
            ..ServeConfig::default()
        };
        let topo = plan(&cfg, &tree, &gpu, &gpu, &no_addr).expect("plan");
        // Before: this host's one CUDA device made the plan (one lane) and lent its UUID.
        assert_eq!(topo.lanes.len(), 8, "{:?}", topo.lanes);
        assert!(topo.lanes.iter().all(|l| l.distance == Some(Distance::Pix)));
        assert!(
            topo.gpus.iter().all(|g| g.uuid.is_none()),
            "{:?}",
            topo.gpus
        );
        // The same tree as this host's own (`/sys`): its CUDA devices are the lanes' GPUs.
        let own = ServeConfig::default();
        let topo = plan(&own, &tree, &gpu, &gpu, &no_addr).expect("plan");
        assert_eq!(topo.lanes.len(), 1, "{:?}", topo.lanes);
        assert!(topo.gpus[0].uuid.is_some(), "{:?}", topo.gpus[0]);
    }

    #[test]
    fn another_hosts_tree_does_not_ask_this_hosts_driver() {
        // A laptop without a GPU, planning a GPU node's tree with its `memory = "cuda"`
        // config: refused with "`serve` would refuse to start", though this host's CUDA plays
        // no part in that tree's plan.
        let no_gpu = || GpuProbe {
            driver_present: false,
            driver_version: None,
            devices: Vec::new(),
            usable: false,
            reason: "no CUDA driver".into(),
        };
        let cuda = |root: &str| ServeConfig {
            sysfs_root: root.into(),
            memory: shardwire_config::MemoryMode::Cuda,
            ..ServeConfig::default()
        };
        let (usable, listed) = host_gpus(&cuda(FIXTURE), || -> GpuProbe {
            panic!("the driver was asked for another host's tree")
        })
        .expect("another host's tree");
        assert!(usable.is_empty() && listed.is_empty());
        // This host's own tree: refused, as `serve` would be.
        let err = host_gpus(&cuda("/sys"), no_gpu).expect_err("no usable GPU here");
        assert!(
            format!("{err:#}").contains("`serve` would refuse to start"),
            "{err:#}"
        );
        // And the fixture, so configured, plans from its own GPUs.
        let tree = Tree::read(Path::new(FIXTURE)).expect("fixture tree");
        let topo = plan(&cuda(FIXTURE), &tree, &usable, &listed, &no_addr).expect("plan");
        assert_eq!(topo.lanes.len(), 8, "{:?}", topo.lanes);
    }

    #[test]
    fn a_sysfs_mounted_under_another_path_is_this_hosts_tree() {
        // Judged by the file system, not the spelling: `/sys/.` (as a container's `/host/sys`
        // mount) was taken for another host's tree.
        let at = |p: &str| {
            own_tree(&ServeConfig {
                sysfs_root: p.into(),
                ..ServeConfig::default()
            })
        };
        assert!(at("/sys"));
        let mounted = rustix::fs::statfs("/sys").is_ok_and(|s| s.f_type as u64 == SYSFS_MAGIC);
        assert!(at("/sys/.") || !mounted, "sysfs is mounted at /sys here");
        assert!(!at(FIXTURE) && !at("/nonexistent"));
    }
}
