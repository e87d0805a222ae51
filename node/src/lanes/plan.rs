//! Planning a node's lanes (DESIGN §11) from the `lanes` configuration, the sysfs tree and the
//! CUDA devices: for each lane its GPU, its NIC and their PCIe distance, where sources dial it,
//! the CPUs its receivers run on, the NUMA node its host memory is placed on, and the RX
//! queues it binds for devmem. Pure: the tree, the devices and the interface addresses come in
//! as values and a lookup, so every rule is unit-tested without a GPU or a NIC.
//!
//! `lanes = "auto"`:
//! - the GPUs are the CUDA devices when the node may use CUDA memory and a driver lists some,
//!   else the GPUs of the sysfs tree (a host-memory node still places streams by GPU);
//! - none or one: one lane on `data_listen`, with `devmem_queues`, no CPU pinning and no NUMA
//!   placement: exactly the single-lane node of earlier releases (the paired NIC is shown);
//! - two or more: one lane per GPU, in PCI order, paired with its nearest NIC
//!   ([`shardwire_topology::pair`], over those GPUs only); its data address is the NIC's IPv4
//!   address with `data_listen`'s port when `data_listen` is a wildcard, else `data_listen`.
//!
//! A table: lane `i` is the `i`-th entry; a field left out is filled as `auto` would (the
//! NIC paired with the lane's GPU, preferring, at the same distance, one no other lane names;
//! its queue share, its address), else from the node's keys.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use shardwire_config::{LaneConfig, Lanes};
use shardwire_devmem::ifaddr::IfAddrError;
use shardwire_gpu::GpuDevice;
use shardwire_topology::{
    Distance, GpuName, GpuNameError, GpuUuid, LanePlan, PairOptions, PciAddr, Tree, classify, pair,
    passed_over,
};

/// The GPU of a lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneGpu {
    /// Its PCI bus id.
    pub pci: PciAddr,
    /// Its UUID, when the CUDA driver reports it.
    pub uuid: Option<GpuUuid>,
    /// Its CUDA ordinal in this process (`None`: CUDA does not list it).
    pub ordinal: Option<i32>,
}

/// One planned lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneSpec {
    /// Lane id, 0.. in plan order.
    pub id: u32,
    /// Its GPU (`None`: a host-memory lane without one).
    pub gpu: Option<LaneGpu>,
    /// Its NIC (interface name).
    pub nic: Option<String>,
    /// The configuration named the NIC (`lanes[i].interface`), not the pairing: one its
    /// probe could not judge gets a real bind ([`crate::binding::pick_interface`]).
    pub nic_named: bool,
    /// The NIC's PCI bus id.
    pub nic_pci: Option<PciAddr>,
    /// GPU to NIC PCIe distance, when both are in the sysfs tree.
    pub distance: Option<Distance>,
    /// The NUMA node of the NIC (else of the GPU).
    pub numa_node: Option<u32>,
    /// CPUs its receiver threads run on (empty: not pinned).
    pub cpus: Vec<u32>,
    /// The NUMA node its host-memory regions are placed on (`None`: not placed).
    pub numa_bind: Option<u32>,
    /// The RX queues it binds for devmem (empty: the binding's default).
    pub queues: Vec<u32>,
    /// Where its data listener binds (and, unless a wildcard, what sources dial).
    pub data_listen: SocketAddr,
    /// Sources are to dial its NIC's own IPv4 address (a wildcard `data_listen`, a NIC named
    /// or paired), but the NIC had none when the lane was planned (one still training at
    /// boot): the lane is on the wildcard meanwhile, and every source session looks the
    /// NIC's address up again and advertises the lane there once it has one
    /// (`crate::link::readdress`).
    pub awaits_nic_address: bool,
    /// Its RX dma-buf size for devmem.
    pub devmem_memory: u64,
    /// One line: why this GPU, NIC and address.
    pub why: String,
    /// The pairing deserves a warning (through a CPU, across sockets, or no NIC).
    pub warn: bool,
    /// Whether it deserves one once it is at its NIC's address (a lane that
    /// [awaits](Self::awaits_nic_address) it warns until then): its pairing alone. As `warn`
    /// for another lane.
    pub warn_at_nic_address: bool,
}

/// Why the lanes cannot be planned; each names the lane table and the value.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// `gpu` is neither a PCI bus id nor a UUID.
    #[error("lanes[{lane}].gpu: {source}")]
    GpuName {
        /// The table's index.
        lane: usize,
        /// What is wrong.
        #[source]
        source: GpuNameError,
    },
    /// No GPU of this host has that name.
    #[error(
        "lanes[{lane}].gpu = {gpu}: this host has no such GPU (GPUs: {known}); `shardwire topology` lists them"
    )]
    UnknownGpu {
        /// The table's index.
        lane: usize,
        /// The name given.
        gpu: String,
        /// The GPUs there are.
        known: String,
    },
    /// The sysfs tree has the GPU, but CUDA in this process does not list it (hidden by
    /// `CUDA_VISIBLE_DEVICES`, or left out by the probe).
    #[error(
        "lanes[{lane}].gpu = {gpu}: the sysfs tree lists this GPU but CUDA in this process does not (CUDA lists: {cuda}); check CUDA_VISIBLE_DEVICES, and the start-up log for a GPU the CUDA probe left out"
    )]
    GpuNotInCuda {
        /// The table's index.
        lane: usize,
        /// The name given.
        gpu: String,
        /// The GPUs CUDA lists.
        cuda: String,
    },
    /// A UUID cannot be resolved without the CUDA driver.
    #[error(
        "lanes[{lane}].gpu = {gpu}: a UUID names a GPU only through the CUDA driver, and this node uses none (memory = \"host\" or no driver); give its PCI bus id"
    )]
    UuidWithoutCuda {
        /// The table's index.
        lane: usize,
        /// The name given.
        gpu: String,
    },
    /// Two lanes name one GPU, spelled differently (a bus id with and without its domain, or a
    /// bus id and the same GPU's UUID).
    #[error(
        "lanes[{first}] and lanes[{lane}] both name GPU {gpu} (as {first_name:?} and {name:?}): one lane per GPU"
    )]
    DuplicateGpu {
        /// The earlier lane.
        first: usize,
        /// Its name for the GPU.
        first_name: String,
        /// The later lane.
        lane: usize,
        /// Its name for the GPU.
        name: String,
        /// The GPU's PCI address.
        gpu: PciAddr,
    },
    /// The interface does not exist or its address cannot be read.
    #[error("lanes[{lane}].interface: {source}")]
    Interface {
        /// The table's index.
        lane: usize,
        /// What failed.
        #[source]
        source: IfAddrError,
    },
}

/// What the plan is made from.
pub struct Inputs<'a> {
    /// The `lanes` key.
    pub lanes: &'a Lanes,
    /// The node's `data_listen`.
    pub data_listen: SocketAddr,
    /// The node's `devmem_queues` (the single lane's).
    pub devmem_queues: &'a [u32],
    /// The node's `devmem_memory`.
    pub devmem_memory: u64,
    /// The sysfs tree (empty when it could not be read).
    pub tree: &'a Tree,
    /// The CUDA devices the node may use (empty: host memory, or no driver).
    pub cuda: &'a [GpuDevice],
}

impl<'a> Inputs<'a> {
    /// The inputs of `serve` with configuration `cfg`, over `tree` and the CUDA devices `cuda`.
    pub fn of(
        cfg: &'a shardwire_config::ServeConfig,
        tree: &'a Tree,
        cuda: &'a [GpuDevice],
    ) -> Self {
        Self {
            lanes: &cfg.lanes,
            data_listen: cfg.data_listen,
            devmem_queues: &cfg.devmem_queues,
            devmem_memory: cfg.devmem_memory.0,
            tree,
            cuda,
        }
    }
}

/// An interface's IPv4 address (`shardwire_devmem::ifaddr::ipv4` on a host).
pub type Ipv4Lookup<'a> = &'a dyn Fn(&str) -> Result<Option<Ipv4Addr>, IfAddrError>;

/// A GPU the plan may give a lane.
#[derive(Debug, Clone)]
struct Candidate {
    gpu: LaneGpu,
}

/// The GPUs lanes are made of: the CUDA devices, else the tree's GPUs; in PCI order.
fn candidates(inp: &Inputs<'_>) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = if inp.cuda.is_empty() {
        inp.tree
            .gpus
            .iter()
            .map(|g| Candidate {
                gpu: LaneGpu {
                    pci: g.pci,
                    uuid: None,
                    ordinal: None,
                },
            })
            .collect()
    } else {
        inp.cuda
            .iter()
            .filter_map(|d| {
                Some(Candidate {
                    gpu: LaneGpu {
                        pci: d.pci_bus_id.parse().ok()?,
                        uuid: d.uuid.as_deref().and_then(|u| u.parse().ok()),
                        ordinal: Some(d.ordinal),
                    },
                })
            })
            .collect()
    };
    out.sort_by_key(|c| c.gpu.pci);
    out
}

/// The pairing of `gpus` only (a GPU CUDA does not list takes no NIC share), over the NICs
/// but those `without`.
fn pair_only(tree: &Tree, gpus: &[PciAddr], without: &[&str]) -> Vec<LanePlan> {
    let sub = Tree {
        gpus: tree
            .gpus
            .iter()
            .filter(|g| gpus.contains(&g.pci))
            .cloned()
            .collect(),
        nics: tree
            .nics
            .iter()
            .filter(|n| !without.contains(&n.interface.as_str()))
            .cloned()
            .collect(),
        nodes: tree.nodes.clone(),
    };
    pair(&sub, &PairOptions::default())
}

/// The NIC of a table lane of GPU `gpu` that names none: the pairing's over the table's GPUs,
/// as `auto` pairs them; but a lane that pairing puts on a NIC another lane names moves to as
/// near a NIC no lane names where that evens the loads (the lanes on each NIC, named ones
/// counted): a switch's GPUs A, B and NICs X, Y with a table {A, interface Y}, {B} put B on Y
/// too, X idle; while 8 GPUs over two NICs, one named by a lane, keep 4 on each.
fn paired_nic(inp: &Inputs<'_>, gpu: PciAddr) -> Option<String> {
    let Lanes::Table(t) = inp.lanes else {
        return None;
    };
    let gpus = |unnamed_only: bool| -> Vec<PciAddr> {
        t.iter()
            .enumerate()
            .filter(|(_, l)| !unnamed_only || l.interface.is_none())
            .filter_map(|(j, l)| named_gpu(inp, j, l.gpu.as_deref()?).ok().map(|g| g.pci))
            .collect()
    };
    let all = pair_only(inp.tree, &gpus(false), &[]);
    let p = all.iter().find(|p| p.gpu == gpu)?;
    let named: Vec<&str> = t.iter().filter_map(|l| l.interface.as_deref()).collect();
    if named.is_empty() {
        return p.nic.clone();
    }
    let spread = spread_unnamed(inp.tree, &all, &gpus(true), &named);
    spread
        .into_iter()
        .find(|(g, _)| *g == gpu)
        .map_or_else(|| p.nic.clone(), |(_, nic)| nic)
}

/// The NICs of the `unnamed` lanes' GPUs: `all`'s pairing, with a lane on a NIC another lane
/// names moved, in table order, to the NIC the pairing over the NICs no lane names gives it,
/// where that NIC is as near, not passed over in the whole tree (without the named NICs a
/// management NIC may no longer be), and carries at least two lanes fewer.
fn spread_unnamed(
    tree: &Tree,
    all: &[LanePlan],
    unnamed: &[PciAddr],
    named: &[&str],
) -> Vec<(PciAddr, Option<String>)> {
    let free = pair_only(tree, unnamed, named);
    let of = |plans: &[LanePlan], g: PciAddr| plans.iter().find(|p| p.gpu == g).cloned();
    let mut nics: Vec<(PciAddr, Option<String>)> = unnamed
        .iter()
        .map(|&g| (g, of(all, g).and_then(|p| p.nic)))
        .collect();
    let mut load: std::collections::BTreeMap<String, usize> = Default::default();
    let named_or_paired = named.iter().map(|n| n.to_string());
    for n in named_or_paired.chain(nics.iter().filter_map(|(_, n)| n.clone())) {
        *load.entry(n).or_default() += 1;
    }
    let usable = |nic: &str| {
        let n = tree.nics.iter().find(|n| n.interface == nic);
        n.is_some_and(|n| passed_over(&tree.nics, n).is_none())
    };
    for (g, nic) in &mut nics {
        let Some(from) = nic.clone().filter(|n| named.contains(&n.as_str())) else {
            continue;
        };
        let (Some(p), Some(q)) = (of(all, *g), of(&free, *g)) else {
            continue;
        };
        let Some(to) = q.nic.filter(|to| q.distance == p.distance && usable(to)) else {
            continue;
        };
        let at = |n: &str| load.get(n).copied().unwrap_or(0);
        if at(&to) + 1 < at(&from) {
            *load.entry(from).or_default() -= 1;
            *load.entry(to.clone()).or_default() += 1;
            *nic = Some(to);
        }
    }
    nics
}

/// The CPUs near a NIC (its `local_cpulist`), else those of the lane's NUMA node.
fn cpus_for(tree: &Tree, nic: Option<&str>, numa: Option<u32>) -> Vec<u32> {
    let local = nic
        .and_then(|n| tree.nics.iter().find(|x| x.interface == n))
        .map(|n| n.local_cpulist.clone())
        .unwrap_or_default();
    if !local.is_empty() {
        return local;
    }
    numa.map(|n| tree.cpus_of_node(n).to_vec())
        .unwrap_or_default()
}

/// Why a lane's data address `listen` that is not one of its NIC's (`nic`) is worth a
/// warning, and how to fix it: a wildcard `data_listen` (unless it is one already), an
/// address on the NIC, or `per_lane`.
fn elsewhere_hint(nic: &str, listen: SocketAddr, per_lane: &str) -> String {
    let wildcard = if listen.ip().is_unspecified() {
        String::new()
    } else {
        format!(
            "set data_listen to a wildcard such as 0.0.0.0:{}, ",
            listen.port()
        )
    };
    format!(
        "; not an address of {nic}: its traffic arrives on whichever NIC holds it ({wildcard}\
         give {nic} an IPv4 address, or {per_lane})"
    )
}

/// A NIC's IPv4 address as sources may dial it: none for a link-local one (169.254/16, what
/// IPv4LL gives a NIC while DHCP is late), which a source on another subnet cannot reach.
pub fn dialable(ip: Option<Ipv4Addr>) -> Option<Ipv4Addr> {
    ip.filter(|ip| !ip.is_link_local())
}

/// Where sources dial a lane on `nic`: its IPv4 address with `listen`'s port when `listen` is
/// a wildcard and the NIC has one ([`dialable`]), else `listen`; with the reason, and whether
/// that address is not one of `nic`'s own (its traffic then arrives on whichever NIC holds
/// it).
fn addr_for(
    nic: Option<&str>,
    listen: SocketAddr,
    ipv4: Ipv4Lookup<'_>,
) -> Result<(SocketAddr, String, bool), IfAddrError> {
    let Some(nic) = nic else {
        return Ok((
            listen,
            format!("data address {listen} (data_listen)"),
            false,
        ));
    };
    let found = ipv4(nic)?;
    let wildcard = listen.ip().is_unspecified();
    match (found, dialable(found)) {
        (_, Some(ip)) if wildcard => Ok((
            SocketAddr::new(IpAddr::V4(ip), listen.port()),
            format!("data address {ip}:{} ({nic}'s IPv4)", listen.port()),
            false,
        )),
        (_, None) if wildcard => {
            let link_local = found.map_or(String::new(), |ip| {
                format!(" other than the link-local {ip}")
            });
            Ok((
                listen,
                format!(
                    "data address {listen} ({nic} has no IPv4 address yet{link_local}: sources \
                     are moved to its address if it gets one)"
                ),
                true,
            ))
        }
        (Some(ip), _) => Ok((
            listen,
            format!("data address {listen} (data_listen is not a wildcard)"),
            listen.ip() != IpAddr::V4(ip),
        )),
        (None, _) => Ok((
            listen,
            format!("data address {listen} ({nic} has no IPv4 address)"),
            true,
        )),
    }
}

/// Plans the lanes.
pub fn plan(inp: &Inputs<'_>, ipv4: Ipv4Lookup<'_>) -> Result<Vec<LaneSpec>, PlanError> {
    match inp.lanes {
        Lanes::Auto => Ok(auto(inp, ipv4)),
        Lanes::Table(t) => {
            let mut lanes: Vec<LaneSpec> = t
                .iter()
                .enumerate()
                .map(|(i, lc)| table_lane(inp, i, lc, ipv4))
                .collect::<Result<_, _>>()?;
            one_lane_per_gpu(t, &lanes)?;
            split_table_queues(inp.tree, &mut lanes);
            Ok(lanes)
        }
    }
}

/// The devmem queues of the table lanes that name none, once every lane's NIC is settled
/// (named in the table or paired): a NIC's queues planned for its lanes in lane order as
/// `lanes = "auto"` plans them ([`shardwire_topology::plan_queues`]: its upper half split,
/// or one each from rx/2 up, past its count, where they are too few) where none of them names
/// queues; else none, and the binding
/// shares out what the named ones leave. The NIC's queues are never given twice: the auto
/// pairing's split cannot be used, since it does not know which NIC the table names.
fn split_table_queues(tree: &Tree, lanes: &mut [LaneSpec]) {
    let nics: std::collections::BTreeSet<String> =
        lanes.iter().filter_map(|l| l.nic.clone()).collect();
    // A lane's queues so far are its own, or (the one lane of a table) the node's
    // devmem_queues ([`table_queues`]).
    let named: Vec<bool> = lanes.iter().map(|l| !l.queues.is_empty()).collect();
    for nic in nics {
        let on: Vec<usize> = (0..lanes.len())
            .filter(|&i| lanes[i].nic.as_deref() == Some(nic.as_str()))
            .collect();
        let tree_nic = tree.nics.iter().find(|n| n.interface == nic);
        let split = match tree_nic {
            Some(n) if on.iter().all(|&i| !named[i]) => {
                shardwire_topology::plan_queues(n, on.len())
            }
            _ => vec![Vec::new(); on.len()],
        };
        for (&i, q) in on.iter().zip(split) {
            if !named[i] {
                if let Some(n) = tree_nic {
                    lanes[i].why.push_str(&past_note(n, &q));
                }
                lanes[i].queues = q;
            }
        }
    }
}

/// For the `why` of a table lane planned `queues` on `nic`: the ones past its RX queues,
/// which the node raises the channels to bind (as the auto pairing's lanes say); empty when
/// none is.
fn past_note(nic: &shardwire_topology::Nic, queues: &[u32]) -> String {
    let past: Vec<u32> = queues
        .iter()
        .copied()
        .filter(|&q| q >= nic.rx_queues)
        .collect();
    match past.last() {
        Some(&top) => format!(
            "; queue(s) {} past {}'s {} RX queues: devmem raises its channels to at least {}",
            shardwire_topology::format_ranges(&past),
            nic.interface,
            nic.rx_queues,
            top + 1
        ),
        None => String::new(),
    }
}

/// Refuses a table whose lanes name one GPU twice, spelled differently (the configuration's
/// own check compares the strings).
fn one_lane_per_gpu(t: &[LaneConfig], lanes: &[LaneSpec]) -> Result<(), PlanError> {
    for (i, l) in lanes.iter().enumerate() {
        let Some(g) = &l.gpu else { continue };
        if let Some(first) = lanes[..i]
            .iter()
            .position(|e| e.gpu.as_ref().is_some_and(|e| e.pci == g.pci))
        {
            let name = |k: usize| t[k].gpu.clone().unwrap_or_default();
            return Err(PlanError::DuplicateGpu {
                first,
                first_name: name(first),
                lane: i,
                name: name(i),
                gpu: g.pci,
            });
        }
    }
    Ok(())
}

/// `lanes = "auto"`.
fn auto(inp: &Inputs<'_>, ipv4: Ipv4Lookup<'_>) -> Vec<LaneSpec> {
    let gpus = candidates(inp);
    let pcis: Vec<PciAddr> = gpus.iter().map(|c| c.gpu.pci).collect();
    let plans = pair_only(inp.tree, &pcis, &[]);
    let plan_of = |pci: PciAddr| plans.iter().find(|p| p.gpu == pci);
    if gpus.len() <= 1 {
        return vec![single(
            inp,
            gpus.first(),
            gpus.first().and_then(|c| plan_of(c.gpu.pci)),
        )];
    }
    gpus.iter()
        .enumerate()
        .map(|(i, c)| {
            let p = plan_of(c.gpu.pci);
            let nic = p.and_then(|p| p.nic.clone());
            let (data_listen, mut addr_why, elsewhere) =
                addr_for(nic.as_deref(), inp.data_listen, ipv4).unwrap_or_else(|e| {
                    let why = format!("data address {} ({e})", inp.data_listen);
                    (inp.data_listen, why, nic.is_some())
                });
            // Sources dial the lane at data_listen, not at the paired NIC's own address: its
            // traffic enters through whichever NIC holds that address (one for every lane).
            if let Some(n) = nic.as_deref().filter(|_| elsewhere) {
                let per_lane = "name each lane's data_listen in a lanes table";
                addr_why.push_str(&elsewhere_hint(n, inp.data_listen, per_lane));
            }
            // The NIC had no address (or it could not be read): looked up again per session.
            let awaits_nic_address = nic.is_some() && data_listen.ip().is_unspecified();
            let numa_node = p.and_then(LanePlan::numa_node);
            let pairing = p.map_or_else(
                || "not in the sysfs tree: no NIC pairing".to_owned(),
                |p| p.why.clone(),
            );
            LaneSpec {
                id: i as u32,
                gpu: Some(c.gpu.clone()),
                nic_named: false,
                nic_pci: p.and_then(|p| p.nic_pci),
                distance: p.and_then(|p| p.distance),
                cpus: cpus_for(inp.tree, nic.as_deref(), numa_node),
                numa_bind: numa_node,
                queues: p.map(|p| p.queues.clone()).unwrap_or_default(),
                nic,
                numa_node,
                data_listen,
                awaits_nic_address,
                devmem_memory: inp.devmem_memory,
                why: format!("{pairing}; {addr_why}"),
                warn: p.is_none_or(|p| p.warn) || elsewhere,
                warn_at_nic_address: p.is_none_or(|p| p.warn),
            }
        })
        .collect()
}

/// The one lane of a node with no GPU or one: as earlier releases ran it.
fn single(inp: &Inputs<'_>, gpu: Option<&Candidate>, p: Option<&LanePlan>) -> LaneSpec {
    let what = match (gpu, p.and_then(|p| p.nic.as_deref())) {
        (None, _) => "no GPU: one host lane".to_owned(),
        (Some(_), Some(nic)) => format!(
            "one GPU: one lane (its nearest NIC is {nic}: {})",
            p.map_or("", |p| p.why.as_str())
        ),
        (Some(_), None) => "one GPU: one lane".to_owned(),
    };
    LaneSpec {
        id: 0,
        gpu: gpu.map(|c| c.gpu.clone()),
        nic: p.and_then(|p| p.nic.clone()),
        nic_named: false,
        nic_pci: p.and_then(|p| p.nic_pci),
        distance: p.and_then(|p| p.distance),
        numa_node: p.and_then(LanePlan::numa_node),
        cpus: Vec::new(),
        numa_bind: None,
        queues: inp.devmem_queues.to_vec(),
        data_listen: inp.data_listen,
        // The one lane is where data_listen says, as in earlier releases.
        awaits_nic_address: false,
        devmem_memory: inp.devmem_memory,
        why: format!(
            "{what}; data address {} (data_listen), receivers not pinned",
            inp.data_listen
        ),
        // Its nearest NIC is through a CPU: worth saying even for the one lane.
        warn: p.is_some_and(|p| p.warn && p.nic.is_some()),
        warn_at_nic_address: p.is_some_and(|p| p.warn && p.nic.is_some()),
    }
}

/// The GPU a table names, among the candidates.
fn named_gpu(inp: &Inputs<'_>, lane: usize, name: &str) -> Result<LaneGpu, PlanError> {
    let parsed: GpuName = name
        .parse()
        .map_err(|source| PlanError::GpuName { lane, source })?;
    if matches!(parsed, GpuName::Uuid(_)) && inp.cuda.is_empty() {
        return Err(PlanError::UuidWithoutCuda {
            lane,
            gpu: name.to_owned(),
        });
    }
    let all = candidates(inp);
    all.iter()
        .find(|c| parsed.is(Some(c.gpu.pci), c.gpu.uuid))
        .map(|c| c.gpu.clone())
        .ok_or_else(|| {
            let known: Vec<String> = all.iter().map(|c| c.gpu.pci.to_string()).collect();
            let in_tree = inp.tree.gpus.iter().any(|g| parsed.is(Some(g.pci), None));
            if in_tree && !inp.cuda.is_empty() {
                return PlanError::GpuNotInCuda {
                    lane,
                    gpu: name.to_owned(),
                    cuda: known.join(", "),
                };
            }
            PlanError::UnknownGpu {
                lane,
                gpu: name.to_owned(),
                known: if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                },
            }
        })
}

/// The distance between a tree GPU and a tree NIC, when both are in the tree.
fn distance_of(tree: &Tree, gpu: Option<PciAddr>, nic: Option<&str>) -> Option<(Distance, String)> {
    let g = tree.gpus.iter().find(|g| Some(g.pci) == gpu)?;
    let n = tree
        .nics
        .iter()
        .find(|n| Some(n.interface.as_str()) == nic)?;
    let c = classify(&g.path, g.numa_node, n.path.as_ref()?, n.numa_node);
    Some((c.distance, c.why))
}

/// The queues of table lane `lc`: its own, else, the one lane of a table, the node's
/// `devmem_queues` (as any node of one lane; the configuration refuses both at once); a lane
/// left with none gets its share in `split_table_queues`.
fn table_queues(inp: &Inputs<'_>, lc: &LaneConfig) -> Vec<u32> {
    match inp.lanes {
        Lanes::Table(t) if t.len() == 1 && lc.queues.is_empty() => inp.devmem_queues.to_vec(),
        _ => lc.queues.clone(),
    }
}

/// Where sources dial table lane `i` (`lc`, on `nic`), why, and whether that address is not
/// one of `nic`'s own ([`addr_for`], with the hint `auto` gives); a configured address is
/// taken as meant.
fn table_addr(
    inp: &Inputs<'_>,
    i: usize,
    lc: &LaneConfig,
    nic: Option<&str>,
    ipv4: Ipv4Lookup<'_>,
) -> Result<(SocketAddr, String, bool), PlanError> {
    let failed = |source: IfAddrError| PlanError::Interface { lane: i, source };
    if let Some(a) = lc.data_listen {
        if let Some(n) = lc.interface.as_deref() {
            // The interface must exist even when its address is not used.
            ipv4(n).map_err(failed)?;
        }
        return Ok((a, format!("data address {a} (configured)"), false));
    }
    let (a, mut why, elsewhere) = addr_for(nic, inp.data_listen, ipv4).map_err(failed)?;
    if let Some(n) = nic.filter(|_| elsewhere) {
        let per_lane = format!("set lanes[{i}].data_listen");
        why.push_str(&elsewhere_hint(n, inp.data_listen, &per_lane));
    }
    Ok((a, why, elsewhere))
}

/// Lane `i` of a table.
fn table_lane(
    inp: &Inputs<'_>,
    i: usize,
    lc: &LaneConfig,
    ipv4: Ipv4Lookup<'_>,
) -> Result<LaneSpec, PlanError> {
    let gpu = lc
        .gpu
        .as_deref()
        .map(|g| named_gpu(inp, i, g))
        .transpose()?;
    let nic = lc
        .interface
        .clone()
        .or_else(|| paired_nic(inp, gpu.as_ref()?.pci));
    let (data_listen, addr_why, elsewhere) = table_addr(inp, i, lc, nic.as_deref(), ipv4)?;
    let tree_nic = inp
        .tree
        .nics
        .iter()
        .find(|n| Some(&n.interface) == nic.as_ref());
    let (distance, dist_why) =
        match distance_of(inp.tree, gpu.as_ref().map(|g| g.pci), nic.as_deref()) {
            Some((d, why)) => (Some(d), why),
            None => match tree_nic {
                Some(n) if n.is_virtual => (
                    None,
                    format!("{} is virtual (no PCI path): distance unknown", n.interface),
                ),
                _ => (None, "not both in the sysfs tree".to_owned()),
            },
        };
    let tree_gpu = inp
        .tree
        .gpus
        .iter()
        .find(|g| Some(g.pci) == gpu.as_ref().map(|g| g.pci));
    let numa_node = tree_nic
        .and_then(|n| n.numa_node)
        .or_else(|| tree_gpu.and_then(|g| g.numa_node));
    let queues = table_queues(inp, lc);
    // A configured data_listen is taken as meant, a wildcard too.
    let awaits_nic_address =
        lc.data_listen.is_none() && nic.is_some() && data_listen.ip().is_unspecified();
    // As in auto mode: a GPU lane whose NIC crosses a CPU, is virtual, or is not known.
    let pairing_warns = distance.is_some_and(Distance::crosses_cpu)
        || (gpu.is_some() && tree_nic.is_none_or(|n| n.is_virtual));
    Ok(LaneSpec {
        id: i as u32,
        cpus: cpus_for(inp.tree, nic.as_deref(), numa_node),
        numa_bind: numa_node,
        nic_named: lc.interface.is_some(),
        nic_pci: tree_nic.and_then(|n| n.pci),
        // Or whose data address is not its NIC's.
        warn: pairing_warns || elsewhere,
        warn_at_nic_address: pairing_warns,
        why: format!("configured (lanes[{i}]); {dist_why}; {addr_why}"),
        gpu,
        nic,
        distance,
        numa_node,
        queues,
        data_listen,
        awaits_nic_address,
        devmem_memory: lc.devmem_memory.map_or(inp.devmem_memory, |m| m.0),
    })
}

#[cfg(test)]
mod tests;
