//! `shardwire topology`: the GPUs (PCI bus id, UUID when CUDA sees it, NUMA node), the NICs
//! (interface, PCI bus id, NUMA node, devmem capable) and the lanes `serve` would run with this
//! configuration, each with its distance class and why: the node's own plan
//! (`shardwire_node::plan_lanes`), rendered by `shardwire_topology` as text or JSON.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use serde::Serialize;
use shardwire_config::ServeConfig;
use shardwire_node::{LaneInputs, LaneSpec};
use shardwire_topology::{LanePlan, PairOptions, Topology, Tree};

/// Flags of `shardwire topology` that are configuration keys.
#[derive(Serialize, Default)]
pub struct TopologyFlags {
    /// `--sysfs-root`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sysfs_root: Option<PathBuf>,
}

/// A planned lane in the topology document's shape (lanes without a GPU are not listed: the
/// text says when the node keeps its single host lane).
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

/// The topology of `cfg.sysfs_root` with the lanes `serve` would plan.
fn discover(cfg: &ServeConfig) -> anyhow::Result<Topology> {
    let tree = Tree::read(&cfg.sysfs_root)
        .with_context(|| format!("reading the sysfs tree at {}", cfg.sysfs_root.display()))?;
    let probe = shardwire_gpu::probe_gpus();
    // As `serve` would: the usable CUDA devices (none with memory = "host", or with "auto"
    // and no usable driver: then the GPUs of the tree, as host-memory lanes). With "cuda" and
    // no usable GPU, `serve` refuses to start: so does this, with its reason, instead of
    // showing host lanes that would never run.
    let cuda = shardwire_node::cuda_devices(cfg.memory, &probe)
        .context("`serve` would refuse to start with this configuration")?;
    let inputs = LaneInputs::of(cfg, &tree, &cuda);
    let specs = shardwire_node::plan_lanes(&inputs, &shardwire_devmem::ifaddr::ipv4)?;
    let mut topo = Topology::from_tree(&tree, &PairOptions::default());
    for g in &mut topo.gpus {
        let pci = g.pci.to_string();
        g.uuid = probe
            .devices
            .iter()
            .find(|d| d.pci_bus_id == pci)
            .and_then(|d| d.uuid.as_deref()?.parse().ok());
    }
    if cfg.sysfs_root == Path::new(shardwire_topology::DEFAULT_ROOT) {
        // The probe looks at this host's interfaces: only meaningful for its own tree.
        let nics = shardwire_devmem::probe::probe_nics();
        for n in &mut topo.nics {
            n.devmem_capable = nics
                .iter()
                .find(|r| r.name == n.interface)
                .map(|r| r.devmem_capable);
        }
    }
    topo.lanes = specs.iter().filter_map(|s| lane_plan(s, &tree)).collect();
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
    // A closed pipe (`| head`) ends the output quietly.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    Ok(ExitCode::SUCCESS)
}
