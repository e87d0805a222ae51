//! Pairing every GPU with its nearest NIC (a *lane*, DESIGN.md §11), and splitting a NIC's
//! devmem queues among the GPUs that share it. Pure: works on a [`Tree`], no I/O.
//!
//! Rules:
//! - Each GPU gets a NIC at the smallest [`Distance`] it has to any usable NIC.
//! - Ties are spread so that the most GPUs on any one NIC is as few as it can be (each GPU
//!   still at its own smallest distance): 8 GPUs on 4 equidistant NICs get 2 per NIC, a GPU
//!   with one PIX NIC is not crowded out by one with two, and GPUs whose best NICs are
//!   {A, B}, {B, C} and {A, B} get one NIC each. Among such spreads, GPUs with the fewest best
//!   candidates (VFs beside a PF count for none) choose first (then in PCI order), each
//!   taking the candidate with the fewest GPUs so far (then the lowest PCI address; virtual
//!   NICs after physical ones, by name) that still lets the GPUs after it keep that spread.
//! - A NIC's devmem queues are the upper half of its rx queues, `[rx/2, rx)` (the lower
//!   half stays with RSS for host traffic), split into contiguous runs in GPU PCI order,
//!   as evenly as possible ([`plan_queues`]). With fewer such queues than GPUs each GPU gets
//!   one from `rx/2` up, the later ones past the NIC's count: the node raises the NIC's
//!   channels to bind them (their `why` says so). A physical NIC of one queue has none for
//!   devmem (its lanes warn: devmem is refused); on a virtual NIC later GPUs get none.
//! - A usable NIC is passed over ([`passed_over`]) when its link is down while another NIC of
//!   its model on the same card or below a common PCIe switch is up and not itself passed
//!   over as slow (an uncabled second port: a GPU whose own NIC is down at start shares that
//!   one until a restart, at worst going from PIX to PXB), or is up but slow while every up
//!   NIC of its model on the host is slow too or it sits below no PCIe switch (a management
//!   card's uncabled port: one PCI id names a NIC family; a GPU port below a switch still
//!   training beside a sibling that came up slow stays a candidate where a NIC of its model
//!   elsewhere is fast). Never for an up NIC its GPUs reach only through a CPU, such as
//!   a host NIC: links still training at boot would send the GPUs there until a restart. Or
//!   when it is [`SLOW_FACTOR`] times slower than the host's fastest NIC (a management NIC
//!   beside the GPU NICs: TCPX skips the host NIC, NCCL ranks NICs by bandwidth first).
//!   A lane whose NIC is farther than a NIC passed over for its link being down names that
//!   NIC in its `why`; a lane without a NIC names each physical NIC left out and why.
//!   An SR-IOV virtual function comes after every physical function at its distance, whatever
//!   their load: a VF shares its PF's port, so it is no second NIC.
//! - Virtual NICs (veth, lo) have no PCI path. They are never used unless named in
//!   [`PairOptions::include_virtual`]; a named one is a candidate at [`Distance::Sys`]
//!   (we cannot know which CPU it hangs off), so any physical NIC at PIX, PXB or PHB wins
//!   over it, it ties with physical NICs at SYS, and it is chosen alone when no physical
//!   NIC exists. Naming a physical NIC there changes nothing.

use std::collections::HashMap;

use serde::{Serialize, Serializer};

use crate::distance::{Classified, Distance, classify};
use crate::pci::PciAddr;
use crate::sysfs::{Gpu, Nic, Tree};
use crate::values::format_ranges;

/// Choices the caller makes about pairing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PairOptions {
    /// Virtual interfaces (e.g. `veth0`) that may carry a lane; others never do.
    pub include_virtual: Vec<String>,
}

/// One planned lane: a GPU, its NIC and the NIC queues it receives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LanePlan {
    /// Lane id, 0.. in GPU PCI order.
    pub lane: u32,
    /// The GPU.
    pub gpu: PciAddr,
    /// The GPU's NUMA node.
    pub gpu_numa: Option<u32>,
    /// The NIC's interface name; `None` when no NIC is usable.
    pub nic: Option<String>,
    /// The NIC's PCI address; `None` without a NIC or for a virtual one.
    pub nic_pci: Option<PciAddr>,
    /// The NIC's NUMA node.
    pub nic_numa: Option<u32>,
    /// GPU to NIC distance; `None` without a NIC.
    pub distance: Option<Distance>,
    /// The NIC rx queues for this GPU's devmem binding (disjoint from other lanes').
    pub queues: Vec<u32>,
    /// Where sources dial this lane (`IP:PORT`), when the caller knows it (the NIC's address).
    pub data_addr: Option<String>,
    /// One line: why this NIC, and how its queues are shared.
    pub why: String,
    /// The lane crosses a CPU (PHB, SYS), has no NIC, or has no devmem queue ([`plan_queues`];
    /// queues past its NIC's RX queues do not mark it: the node raises the channels) (the plan
    /// also marks lanes whose data address is not their NIC's, and table lanes on a virtual or
    /// unknown NIC).
    pub warn: bool,
}

impl LanePlan {
    /// The NUMA node to run the lane's receivers on: the NIC's, else the GPU's.
    pub fn numa_node(&self) -> Option<u32> {
        self.nic_numa.or(self.gpu_numa)
    }
}

/// The JSON shape of a lane (`shardwire topology --json`).
#[derive(Serialize)]
struct LaneJson<'a> {
    lane: u32,
    gpu: PciAddr,
    nic: Option<&'a str>,
    nic_pci: Option<PciAddr>,
    distance: Option<Distance>,
    numa_node: Option<u32>,
    queues: &'a [u32],
    data_addr: Option<&'a str>,
    why: &'a str,
    warn: bool,
}

impl Serialize for LanePlan {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        LaneJson {
            lane: self.lane,
            gpu: self.gpu,
            nic: self.nic.as_deref(),
            nic_pci: self.nic_pci,
            distance: self.distance,
            numa_node: self.numa_node(),
            queues: &self.queues,
            data_addr: self.data_addr.as_deref(),
            why: &self.why,
            warn: self.warn,
        }
        .serialize(s)
    }
}

/// A usable NIC for a GPU at the GPU's best distance.
#[derive(Clone, Debug)]
struct Candidate {
    /// Index into `Tree::nics`.
    nic: usize,
    class: Classified,
}

/// A NIC whose link is this many times slower than the host's fastest is passed over.
pub const SLOW_FACTOR: u32 = 8;

/// Why `nic` (usable, physical) is paired with no GPU although it could be: its link is down
/// while that of another NIC of its model (PCI vendor and device id) on the same card or below
/// one of the same PCIe switches is not, that NIC not being slow unless every up NIC of its
/// model is ([`down_note`]); or it runs [`SLOW_FACTOR`] times slower than the fastest of the
/// host's `nics` (usable) whose link is not down. `None`: it is a candidate.
/// A down NIC is passed over only for one its GPUs reach without crossing a CPU: an uncabled
/// second port for the cabled one beside it, but not GPU NICs whose links still train at boot
/// for an up NIC elsewhere (a management NIC right under a root port, of another model or, as
/// on GCP A3 with gVNIC for both, of theirs; or the GPU NICs of the other socket), which
/// would take their GPUs through the CPU until a restart (the plan is made once, at start).
/// A GPU may still go one class farther (PIX to PXB below a shared upper switch) while its
/// own NIC's link is down at start.
pub fn passed_over(nics: &[Nic], nic: &Nic) -> Option<String> {
    if nic.is_virtual || nic.unusable.is_some() {
        return None;
    }
    let usable = || {
        nics.iter()
            .filter(|n| !n.is_virtual && n.unusable.is_none() && n.link_up != Some(false))
    };
    if nic.link_up == Some(false) {
        return down_note(nics, nic);
    }
    let speed = nic.speed_mbps?;
    let (fastest, name) = usable()
        .filter_map(|n| Some((n.speed_mbps?, &n.interface)))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))?;
    (speed.saturating_mul(SLOW_FACTOR) <= fastest).then(|| {
        format!(
            "its link runs at {speed} Mb/s, 1/{} of {name}'s {fastest} Mb/s (a management NIC?)",
            fastest / speed
        )
    })
}

/// Whether `a` and `b` are ports of one card (functions of one PCI device) or sit below a
/// common PCIe switch: a GPU that reaches one without crossing a CPU reaches the other so too.
fn near_each_other(a: &Nic, b: &Nic) -> bool {
    let same_card = a
        .pci
        .zip(b.pci)
        .is_some_and(|(x, y)| (x.domain, x.bus, x.device) == (y.domain, y.bus, y.device));
    let (Some(pa), Some(pb)) = (&a.path, &b.path) else {
        return same_card;
    };
    let theirs = pb.switches();
    same_card || pa.switches().iter().any(|s| theirs.contains(s))
}

/// Why `nic`, whose link is down, is passed over: a usable physical NIC of its model on the
/// same card or below a common PCIe switch has a link that is not down and is not itself
/// passed over as slow; or each such NIC is slow, and so is every up NIC of its model on the
/// host (a management card: its uncabled ports go with its cabled one). `None` when no such
/// NIC's link is up, when its ids could not be read (it tells no model), or when each such NIC
/// is slow but an up NIC of its model elsewhere is not and `nic` sits below a PCIe switch: a
/// GPU port still training beside a sibling that came up slow (a bad cable) stays a
/// candidate, else its GPUs went through a CPU to that fast NIC until a restart.
fn down_note(nics: &[Nic], nic: &Nic) -> Option<String> {
    let model = |n: &Nic| n.vendor.zip(n.device);
    let own = model(nic)?;
    let up_of_model = |n: &Nic| {
        !n.is_virtual
            && n.unusable.is_none()
            && n.link_up != Some(false)
            && n.interface != nic.interface
            && model(n) == Some(own)
    };
    let near: Vec<&Nic> = nics
        .iter()
        .filter(|n| up_of_model(n) && near_each_other(n, nic))
        .collect();
    let peer = "the same model, on the same card or below the same PCIe switch";
    // `passed_over` of an up NIC is its speed test alone: no recursion.
    if let Some(up) = near.iter().find(|n| passed_over(nics, n).is_none()) {
        return Some(format!(
            "its link is down (operstate), and {}'s ({peer}) is not",
            up.interface
        ));
    }
    let slow = near.first()?;
    // A PCI id names a whole NIC family (every ConnectX-7 is 15b3:1021), so a fast one
    // elsewhere keeps the down port only where it sits below a PCIe switch beside GPUs; a
    // management card (an OCP or LOM port on a root port) stays passed over.
    let below_switch = nic.path.as_ref().is_some_and(|p| !p.switches().is_empty());
    let fast_elsewhere = nics
        .iter()
        .any(|n| up_of_model(n) && passed_over(nics, n).is_none());
    (!(fast_elsewhere && below_switch)).then(|| {
        format!(
            "its link is down (operstate), and {}'s ({peer}) is up but slow, {} (a management \
             card?)",
            slow.interface,
            match fast_elsewhere {
                false => "as is every up NIC of its model",
                true => "and it sits below no PCIe switch",
            }
        )
    })
}

/// Plans one lane per GPU (none when the tree has no GPU: the node keeps its host lane).
pub fn pair(tree: &Tree, opts: &PairOptions) -> Vec<LanePlan> {
    let mut gpus: Vec<&Gpu> = tree.gpus.iter().collect();
    gpus.sort_by_key(|g| g.pci);
    let skip: Vec<bool> = tree
        .nics
        .iter()
        .map(|n| passed_over(&tree.nics, n).is_some())
        .collect();
    let best: Vec<Vec<Candidate>> = gpus
        .iter()
        .map(|g| best_candidates(g, &tree.nics, &skip, opts))
        .collect();
    // What each GPU may be given: its VFs only where it has no PF at its distance.
    let cands: Vec<Vec<usize>> = best.iter().map(|b| choosable(b, &tree.nics)).collect();
    let chosen = assign(&cands, &tree.nics);
    let excluded = excluded_nics(&tree.nics);
    let mut queues: Vec<Vec<u32>> = vec![Vec::new(); gpus.len()];
    let mut shares: Vec<String> = vec![String::new(); gpus.len()];
    for (k, nic) in tree.nics.iter().enumerate() {
        // GPUs of this NIC, in PCI order (gpus is sorted).
        let users: Vec<usize> = (0..gpus.len()).filter(|&i| chosen[i] == Some(k)).collect();
        let split = plan_queues(nic, users.len());
        for (slot, &i) in users.iter().enumerate() {
            shares[i] = share_note(nic, &split, slot);
            queues[i] = split[slot].clone();
        }
    }
    gpus.iter()
        .enumerate()
        .map(|(i, gpu)| {
            let lane = u32::try_from(i).unwrap_or(u32::MAX);
            let pick = chosen[i].and_then(|k| best[i].iter().find(|c| c.nic == k));
            let Some(pick) = pick else {
                return no_nic_lane(lane, gpu, opts, &excluded);
            };
            let nic = &tree.nics[pick.nic];
            let spread = match cands[i].len() {
                1 => String::new(),
                n => format!("; 1 of {n} NICs at {}, spread", pick.class.distance),
            };
            let down = nearer_down_note(gpu, &tree.nics, &skip, pick.class.distance);
            let queues = std::mem::take(&mut queues[i]);
            let short = short_of_queues(&queues);
            LanePlan {
                lane,
                gpu: gpu.pci,
                gpu_numa: gpu.numa_node,
                nic: Some(nic.interface.clone()),
                nic_pci: nic.pci,
                nic_numa: nic.numa_node,
                distance: Some(pick.class.distance),
                queues,
                data_addr: None,
                why: format!("{}{spread}{}{down}", pick.class.why, shares[i]),
                warn: pick.class.distance.crosses_cpu() || short,
            }
        })
        .collect()
}

/// Each physical NIC of `nics` that is no candidate for any GPU, as `NAME (why)`: the
/// reason it is [`Nic::unusable`] (a bond or bridge port, an InfiniBand port...) or
/// [`passed_over`] (its link down, a management NIC).
fn excluded_nics(nics: &[Nic]) -> Vec<String> {
    nics.iter()
        .filter(|n| !n.is_virtual)
        .filter_map(|n| {
            let why = n.unusable.clone().or_else(|| passed_over(nics, n))?;
            Some(format!("{} ({why})", n.interface))
        })
        .collect()
}

/// For a lane whose NIC is at `distance` from `gpu`: a note naming the NICs nearer to the
/// GPU that were passed over (`skip`) because their link was down at start, so the plan
/// shows the nearer NIC it would have had; empty when there is none.
fn nearer_down_note(gpu: &Gpu, nics: &[Nic], skip: &[bool], distance: Distance) -> String {
    let nearer: Vec<String> = nics
        .iter()
        .zip(skip)
        .filter(|(n, skipped)| **skipped && !n.is_virtual && n.link_up == Some(false))
        .filter_map(|(n, _)| {
            let c = classify(&gpu.path, gpu.numa_node, n.path.as_ref()?, n.numa_node);
            (c.distance < distance).then(|| format!("{} ({})", n.interface, c.distance))
        })
        .collect();
    match nearer.len() {
        0 => String::new(),
        1 => format!(
            "; {} is nearer but was passed over: its link was down at start",
            nearer[0]
        ),
        _ => format!(
            "; {} are nearer but were passed over: their links were down at start",
            nearer.join(", ")
        ),
    }
}

/// The lane of a GPU no NIC is paired with; `excluded` lists the physical NICs that are no
/// candidates and why ([`excluded_nics`]).
fn no_nic_lane(lane: u32, gpu: &Gpu, opts: &PairOptions, excluded: &[String]) -> LanePlan {
    const VIRTUAL: &str = "virtual NICs are not paired with GPUs; name one in the lanes \
                           table's `interface` to use it";
    const NAMED: &str = "no NIC named in include_virtual exists";
    let list = excluded.join("; ");
    let why = match (list.is_empty(), opts.include_virtual.is_empty()) {
        (true, true) => format!("no physical NIC ({VIRTUAL})"),
        (true, false) => format!("no physical NIC, and {NAMED}"),
        (false, true) => format!("no usable physical NIC: {list} ({VIRTUAL})"),
        (false, false) => format!("no usable physical NIC: {list}; and {NAMED}"),
    };
    LanePlan {
        lane,
        gpu: gpu.pci,
        gpu_numa: gpu.numa_node,
        nic: None,
        nic_pci: None,
        nic_numa: None,
        distance: None,
        queues: Vec::new(),
        data_addr: None,
        why,
        warn: true,
    }
}

/// The usable NICs at the GPU's smallest distance, less those passed over (`skip`).
fn best_candidates(gpu: &Gpu, nics: &[Nic], skip: &[bool], opts: &PairOptions) -> Vec<Candidate> {
    let all: Vec<Candidate> = nics
        .iter()
        .enumerate()
        .filter_map(|(k, nic)| {
            if skip[k] || (nic.unusable.is_some() && !nic.is_virtual) {
                // Named by the caller ([`Nic::unusable`]); a virtual NIC is used only where
                // it is named anyway.
                return None;
            }
            let class = match &nic.path {
                Some(path) if !nic.is_virtual => {
                    classify(&gpu.path, gpu.numa_node, path, nic.numa_node)
                }
                _ if opts.include_virtual.contains(&nic.interface) => Classified {
                    distance: Distance::Sys,
                    why: format!(
                        "virtual NIC {} (no PCI path), named in include_virtual",
                        nic.interface
                    ),
                },
                _ => return None,
            };
            Some(Candidate { nic: k, class })
        })
        .collect();
    let Some(best) = all.iter().map(|c| c.class.distance).min() else {
        return all;
    };
    all.into_iter()
        .filter(|c| c.class.distance == best)
        .collect()
}

/// The NIC (index into `nics`) of each GPU. First the least cap on GPUs per NIC that lets
/// every GPU have one of its candidates ([`Matching::least_cap`]); then GPUs with the fewest
/// candidates choose first, each the first of its candidates, in this order, that keeps the
/// cap for the GPUs still to choose ([`Matching::fix`]): a physical function before an
/// SR-IOV virtual function ([`choosable`]), then the candidate with the fewest GPUs so far,
/// then on the adapter with the fewest (the ports and functions of one PCI device share its
/// link and its engine: as NCCL, which merges the functions of a device, two GPUs under one
/// switch with a dual-port NIC and a second NIC get one adapter each), then physical before
/// virtual, then the lowest PCI address, then the name. Where choosing greedily in that
/// order already kept the least cap, the result is the greedy one. `cands` is each GPU's
/// [`choosable`] NICs, in GPU PCI order (a VF beside its PF is no option: it counts for none).
fn assign(cands: &[Vec<usize>], nics: &[Nic]) -> Vec<Option<usize>> {
    let mut matching = Matching::least_cap(cands, nics.len());
    let mut order: Vec<usize> = (0..cands.len()).filter(|&i| !cands[i].is_empty()).collect();
    order.sort_by_key(|&i| (cands[i].len(), i));
    let mut load = vec![0usize; nics.len()];
    let adapter = |k: usize| nics[k].pci.map(|p| (p.domain, p.bus, p.device));
    let mut adapter_load: HashMap<(u32, u8, u8), usize> = HashMap::new();
    for i in order {
        let mut ranked = cands[i].clone();
        ranked.sort_by_key(|&k| {
            let nic = &nics[k];
            let on_adapter = adapter(k).map_or(0, |a| adapter_load.get(&a).copied().unwrap_or(0));
            (load[k], on_adapter, nic.is_virtual, nic.pci, &nic.interface)
        });
        // The GPU's NIC in the matching is among them and always fits: some NIC is found.
        if let Some(k) = ranked.into_iter().find(|&k| matching.fix(i, k)) {
            load[k] += 1;
            if let Some(a) = adapter(k) {
                *adapter_load.entry(a).or_default() += 1;
            }
        }
    }
    matching.nic_of
}

/// The NICs of a GPU's `best` it may be given: its physical functions, or its SR-IOV virtual
/// functions when it has none there (a VF shares its PF's port, so it is no second NIC: it
/// comes after every PF at its distance, whatever their load).
fn choosable(best: &[Candidate], nics: &[Nic]) -> Vec<usize> {
    let physical: Vec<usize> = best
        .iter()
        .map(|c| c.nic)
        .filter(|&k| !nics[k].sriov_vf)
        .collect();
    if physical.is_empty() {
        best.iter().map(|c| c.nic).collect()
    } else {
        physical
    }
}

/// GPUs placed on NICs (a bipartite b-matching): each GPU on one of its candidates, each
/// NIC with at most `cap` GPUs. A GPU that is `fixed` is never moved again; the others may
/// be moved along augmenting paths (Kuhn's algorithm, with a capacity per NIC) to make room.
struct Matching<'a> {
    /// Candidate NICs (indices into `Tree::nics`) of each GPU, in GPU PCI order.
    cands: &'a [Vec<usize>],
    /// The most GPUs a NIC may take.
    cap: usize,
    /// The NIC of each GPU; `None` while unplaced, or for a GPU without candidates.
    nic_of: Vec<Option<usize>>,
    /// GPUs on each NIC.
    count: Vec<usize>,
    /// GPUs whose NIC is chosen for good.
    fixed: Vec<bool>,
}

impl<'a> Matching<'a> {
    /// A matching of every GPU that has candidates, under the least cap that allows one
    /// (tried 1, 2, ...; at the number of GPUs any placement fits).
    fn least_cap(cands: &'a [Vec<usize>], nics: usize) -> Self {
        let mut cap = 1;
        loop {
            let mut m = Matching {
                cands,
                cap,
                nic_of: vec![None; cands.len()],
                count: vec![0; nics],
                fixed: vec![false; cands.len()],
            };
            if (0..cands.len()).all(|i| m.place(i)) || cap >= cands.len() {
                return m;
            }
            cap += 1;
        }
    }

    /// Places unplaced GPU `i` on the first of its candidates that has or can be given room;
    /// false when none can (true for a GPU without candidates: nothing to place).
    fn place(&mut self, i: usize) -> bool {
        let cands = self.cands;
        let mut seen = vec![false; self.count.len()];
        for &c in &cands[i] {
            if self.make_room(c, &mut seen) {
                self.move_to(i, c);
                return true;
            }
        }
        cands[i].is_empty()
    }

    /// Puts GPU `i` (placed) on its candidate `nic` for good, if the GPUs not fixed can make
    /// room there within the cap; else leaves the matching as it was and returns false.
    fn fix(&mut self, i: usize, nic: usize) -> bool {
        let was = self.nic_of[i];
        if was != Some(nic) {
            self.unplace(i);
            let mut seen = vec![false; self.count.len()];
            if !self.make_room(nic, &mut seen) {
                if let Some(old) = was {
                    self.move_to(i, old);
                }
                return false;
            }
            self.move_to(i, nic);
        }
        self.fixed[i] = true;
        true
    }

    /// Whether `nic` has room for one more GPU, after moving a placed GPU that is not fixed
    /// from it to another of its candidates (recursively making room there) if need be.
    /// `seen`: the full NICs already searched for this placement. Changes nothing when false.
    fn make_room(&mut self, nic: usize, seen: &mut [bool]) -> bool {
        if self.count[nic] < self.cap {
            return true;
        }
        if std::mem::replace(&mut seen[nic], true) {
            return false;
        }
        let cands = self.cands;
        for (j, its) in cands.iter().enumerate().take(self.nic_of.len()) {
            if self.fixed[j] || self.nic_of[j] != Some(nic) {
                continue;
            }
            for &other in its {
                if other != nic && self.make_room(other, seen) {
                    self.move_to(j, other);
                    return true;
                }
            }
        }
        false
    }

    /// Takes GPU `i` off its NIC, if any.
    fn unplace(&mut self, i: usize) {
        if let Some(old) = self.nic_of[i].take() {
            self.count[old] -= 1;
        }
    }

    /// Puts GPU `i` on `nic` (off its NIC before, if any).
    fn move_to(&mut self, i: usize, nic: usize) {
        self.unplace(i);
        self.nic_of[i] = Some(nic);
        self.count[nic] += 1;
    }
}

/// The devmem queues `[rx/2, rx)` of a NIC split among `gpus` GPUs: contiguous, disjoint,
/// in order, sizes differing by at most one; later GPUs get none when queues run out (the
/// pairing plans with [`plan_queues`], which gives them queues past the NIC's count).
pub fn split_queues(rx_queues: u32, gpus: usize) -> Vec<Vec<u32>> {
    let Ok(k) = u32::try_from(gpus) else {
        return vec![Vec::new(); gpus];
    };
    if k == 0 {
        return Vec::new();
    }
    let first = rx_queues / 2;
    let count = rx_queues - first;
    let (base, extra) = (count / k, count % k);
    let mut next = first;
    (0..k)
        .map(|i| {
            let n = base + u32::from(i < extra);
            let run: Vec<u32> = (next..next + n).collect();
            next += n;
            run
        })
        .collect()
}

/// The RX queue count [`split_queues`] splits for `nic`: none of a physical NIC with one
/// queue (binding its only queue, RSS's too, would make every other flow on it unreadable,
/// the node's control connections too). A virtual NIC's one queue is the emulator's.
pub fn devmem_rx_queues(nic: &Nic) -> u32 {
    if !nic.is_virtual && nic.rx_queues == 1 {
        0
    } else {
        nic.rx_queues
    }
}

/// The devmem queues of each of `gpus` GPUs on `nic`, in GPU order: [`split_queues`] of its
/// [`devmem_rx_queues`], except on a physical NIC whose upper half has fewer queues than
/// GPUs (and one at least): there each GPU gets one queue, contiguous from `rx/2` up, so the
/// later ones lie past the NIC's RX queues and the node raises its channels to bind them (as
/// it does for queues a lanes table names). Before, the later GPUs got none, and devmem was
/// refused on the whole node although the NIC could have had more channels. A NIC of one
/// queue (RSS's) gets none, as the node's binding of a single lane gives none there: its
/// channels are the operator's to raise.
pub fn plan_queues(nic: &Nic, gpus: usize) -> Vec<Vec<u32>> {
    let rx = devmem_rx_queues(nic);
    let first = rx / 2;
    let count = usize::try_from(rx - first).unwrap_or(usize::MAX);
    if nic.is_virtual || count == 0 || count >= gpus {
        return split_queues(rx, gpus);
    }
    (first..).take(gpus).map(|q| vec![q]).collect()
}

/// Whether a lane on `nic` with devmem `queues` deserves a warning: it has none, so devmem
/// cannot bind it and is refused on the whole node. (Queues past the NIC's count only say so
/// in the lane's `why`: the node raises the channels, as for queues a table names, and the
/// lane may not receive over devmem at all.)
fn short_of_queues(queues: &[u32]) -> bool {
    queues.is_empty()
}

/// How a NIC's queues were shared among the GPUs of `split` (their queues, [`plan_queues`]),
/// for the `why` of the lane of GPU `slot`: empty when it has the NIC alone and queues.
fn share_note(nic: &Nic, split: &[Vec<u32>], slot: usize) -> String {
    let name = &nic.interface;
    let users = split.len();
    let upper = split_queues(devmem_rx_queues(nic), 1).concat();
    let queues = &split[slot];
    if queues.is_empty() && upper.is_empty() {
        return format!(
            "; {name} has no rx queues for devmem (it has {}; queue 0 stays with RSS): receive = \
             devmem refuses to start, and auto uses plain TCP on every lane; raise its RX \
             channels (ethtool -L)",
            nic.rx_queues
        );
    }
    if queues.is_empty() {
        return format!(
            "; no devmem queue left: {name} has {} for {users} GPUs (GPU {} of {users})",
            upper.len(),
            slot + 1
        );
    }
    let planned = split.concat();
    let mut note = match users {
        1 => String::new(),
        _ => format!(
            "; {name} shared by {users} GPUs: queues {} of {}",
            format_ranges(queues),
            format_ranges(&planned)
        ),
    };
    let past: Vec<u32> = planned
        .iter()
        .copied()
        .filter(|&q| q >= nic.rx_queues)
        .collect();
    if let Some(&top) = past.last() {
        note.push_str(&format!(
            "; {} past its {} RX queues: devmem raises its channels to {} (where the NIC allows \
             fewer, receive = devmem refuses to start and auto uses plain TCP on every lane)",
            format_ranges(&past),
            nic.rx_queues,
            top + 1
        ));
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::path::PciPath;

    fn addr(s: &str) -> PciAddr {
        s.parse().expect("valid BDF")
    }

    fn path(host: &str, chain: &[&str]) -> PciPath {
        PciPath {
            host_bridge: host.to_owned(),
            chain: chain.iter().map(|s| addr(s)).collect(),
        }
    }

    fn gpu(numa: Option<u32>, host: &str, chain: &[&str]) -> Gpu {
        let path = path(host, chain);
        Gpu {
            pci: path.device().expect("chain ends with the device"),
            uuid: None,
            numa_node: numa,
            vendor: 0x10de,
            device: Some(0x2330),
            local_cpulist: Vec::new(),
            path,
        }
    }

    fn nic(name: &str, numa: Option<u32>, rx: u32, host: &str, chain: &[&str]) -> Nic {
        let path = path(host, chain);
        Nic {
            interface: name.to_owned(),
            pci: path.device(),
            numa_node: numa,
            is_virtual: false,
            rx_queues: rx,
            devmem_capable: None,
            vendor: Some(0x15b3),
            device: Some(0x1021),
            local_cpulist: Vec::new(),
            path: Some(path),
            unusable: None,
            speed_mbps: None,
            link_up: None,
            sriov_vf: false,
        }
    }

    fn veth(name: &str) -> Nic {
        Nic {
            interface: name.to_owned(),
            pci: None,
            numa_node: None,
            is_virtual: true,
            rx_queues: 1,
            devmem_capable: None,
            vendor: None,
            device: None,
            local_cpulist: Vec::new(),
            path: None,
            unusable: None,
            speed_mbps: None,
            link_up: None,
            sriov_vf: false,
        }
    }

    /// Device `bus:00.0` behind downstream port `down` of the switch at `sw` (root port 00:01.0).
    fn under_switch(sw: &str, down: &str, dev: &str) -> [String; 4] {
        [
            "0000:00:01.0".to_owned(),
            sw.to_owned(),
            down.to_owned(),
            dev.to_owned(),
        ]
    }

    fn chain(c: &[String; 4]) -> Vec<&str> {
        c.iter().map(String::as_str).collect()
    }

    fn opts(names: &[&str]) -> PairOptions {
        PairOptions {
            include_virtual: names.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// lane, GPU, NIC, distance, queues, warn.
    type Summary<'a> = (
        u32,
        String,
        Option<&'a str>,
        Option<Distance>,
        Vec<u32>,
        bool,
    );

    fn summary(lanes: &[LanePlan]) -> Vec<Summary<'_>> {
        lanes
            .iter()
            .map(|l| {
                (
                    l.lane,
                    l.gpu.to_string(),
                    l.nic.as_deref(),
                    l.distance,
                    l.queues.clone(),
                    l.warn,
                )
            })
            .collect()
    }

    #[test]
    fn no_gpu_no_lanes() {
        let tree = Tree {
            nics: vec![nic(
                "eth1",
                Some(0),
                16,
                "pci0000:00",
                &["0000:00:01.0", "0000:01:00.0"],
            )],
            ..Tree::default()
        };
        assert_eq!(pair(&tree, &PairOptions::default()), vec![]);
    }

    #[test]
    fn two_gpus_take_two_adapters_before_the_second_port_of_one() {
        // One switch holds GPUs 10:00.0 and 11:00.0, a dual-port NIC (1a:00.0 and 1a:00.1:
        // one adapter, one link) and a second NIC 1b:00.0, all PIX to both GPUs. By PCI
        // address alone GPU 11 would get 1a:00.1, sharing the first adapter.
        let under = |down: &str, dev: &str| under_switch("0000:01:00.0", down, dev);
        let gpus = vec![
            gpu(
                Some(0),
                "pci0000:00",
                &chain(&under("0000:02:00.0", "0000:10:00.0")),
            ),
            gpu(
                Some(0),
                "pci0000:00",
                &chain(&under("0000:02:01.0", "0000:11:00.0")),
            ),
        ];
        let nics = vec![
            nic(
                "p0",
                Some(0),
                16,
                "pci0000:00",
                &chain(&under("0000:02:02.0", "0000:1a:00.0")),
            ),
            nic(
                "p1",
                Some(0),
                16,
                "pci0000:00",
                &chain(&under("0000:02:02.0", "0000:1a:00.1")),
            ),
            nic(
                "q0",
                Some(0),
                16,
                "pci0000:00",
                &chain(&under("0000:02:03.0", "0000:1b:00.0")),
            ),
        ];
        let tree = Tree {
            gpus,
            nics,
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        let got: Vec<_> = lanes.iter().map(|l| l.nic.as_deref()).collect();
        assert_eq!(got, [Some("p0"), Some("q0")], "{lanes:#?}");
        assert!(lanes.iter().all(|l| l.distance == Some(Distance::Pix)));
    }

    #[test]
    fn eight_gpus_on_four_equidistant_nics_get_two_each() {
        // One switch 0000:01:00.0 holding 8 GPUs (buses 10..17) and 4 NICs (buses 20..23):
        // every NIC is PIX to every GPU.
        let gpus: Vec<Gpu> = (0..8)
            .map(|i| {
                let c = under_switch(
                    "0000:01:00.0",
                    &format!("0000:02:{i:02x}.0"),
                    &format!("0000:{:02x}:00.0", 0x10 + i),
                );
                gpu(Some(0), "pci0000:00", &chain(&c))
            })
            .collect();
        let nics: Vec<Nic> = (0..4)
            .map(|i| {
                let c = under_switch(
                    "0000:01:00.0",
                    &format!("0000:02:{:02x}.0", 8 + i),
                    &format!("0000:{:02x}:00.0", 0x20 + i),
                );
                nic(
                    &format!("eth{}", i + 1),
                    Some(0),
                    16,
                    "pci0000:00",
                    &chain(&c),
                )
            })
            .collect();
        // Handed in reverse: pair() must not depend on the tree's order.
        let tree = Tree {
            gpus: gpus.into_iter().rev().collect(),
            nics: nics.into_iter().rev().collect(),
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        let got: Vec<(String, &str, Vec<u32>)> = lanes
            .iter()
            .map(|l| {
                (
                    l.gpu.to_string(),
                    l.nic.as_deref().unwrap_or("-"),
                    l.queues.clone(),
                )
            })
            .collect();
        let q_lo: Vec<u32> = (8..12).collect();
        let q_hi: Vec<u32> = (12..16).collect();
        let want = [
            ("0000:10:00.0", "eth1", &q_lo),
            ("0000:11:00.0", "eth2", &q_lo),
            ("0000:12:00.0", "eth3", &q_lo),
            ("0000:13:00.0", "eth4", &q_lo),
            ("0000:14:00.0", "eth1", &q_hi),
            ("0000:15:00.0", "eth2", &q_hi),
            ("0000:16:00.0", "eth3", &q_hi),
            ("0000:17:00.0", "eth4", &q_hi),
        ];
        let want: Vec<(String, &str, Vec<u32>)> = want
            .iter()
            .map(|(g, n, q)| ((*g).to_owned(), *n, (*q).clone()))
            .collect();
        assert_eq!(got, want);
        assert!(
            lanes
                .iter()
                .all(|l| l.distance == Some(Distance::Pix) && !l.warn)
        );
        assert_eq!(
            lanes.iter().map(|l| l.lane).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
        assert_eq!(
            lanes[4].why,
            "same PCIe switch 0000:01:00.0; 1 of 4 NICs at PIX, spread; eth1 shared by 2 GPUs: queues 12-15 of 8-15"
        );
    }

    #[test]
    fn gpus_with_fewer_candidates_choose_first() {
        // GPU A (first in PCI order) has NICs 1 and 2 at PIX, GPU B only NIC 1. Greedy in
        // PCI order would put both on NIC 1.
        let nics = [
            nic(
                "eth1",
                Some(0),
                16,
                "pci0000:00",
                &["0000:00:01.0", "0000:05:00.0"],
            ),
            nic(
                "eth2",
                Some(0),
                16,
                "pci0000:00",
                &["0000:00:02.0", "0000:06:00.0"],
            ),
        ];
        let cands = vec![vec![0, 1], vec![0]];
        assert_eq!(assign(&cands, &nics), vec![Some(1), Some(0)]);
    }

    #[test]
    fn fewest_candidates_first_on_a_tree() {
        // PCI switches make "nearest" transitive, so build the asymmetry from NUMA: GPU A
        // (NUMA 0) reaches eth1 and eth2 through the CPU (PHB); GPU B, on eth1's host bridge
        // but with its NUMA node unknown, reaches eth1 by PHB and eth2 only by SYS.
        let a = gpu(Some(0), "pci0000:00", &["0000:00:01.0", "0000:01:00.0"]);
        let b = gpu(None, "pci0000:40", &["0000:40:01.0", "0000:41:00.0"]);
        let eth1 = nic(
            "eth1",
            Some(0),
            16,
            "pci0000:40",
            &["0000:40:02.0", "0000:42:00.0"],
        );
        let eth2 = nic(
            "eth2",
            Some(0),
            16,
            "pci0000:80",
            &["0000:80:01.0", "0000:81:00.0"],
        );
        let tree = Tree {
            gpus: vec![a, b],
            nics: vec![eth1, eth2],
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        assert_eq!(
            summary(&lanes),
            [
                (
                    0,
                    "0000:01:00.0".into(),
                    Some("eth2"),
                    Some(Distance::Phb),
                    (8..16).collect(),
                    true
                ),
                (
                    1,
                    "0000:41:00.0".into(),
                    Some("eth1"),
                    Some(Distance::Phb),
                    (8..16).collect(),
                    true
                ),
            ]
        );
        assert_eq!(lanes[1].why, "through host bridge pci0000:40 (NUMA 0)");
        assert_eq!(lanes[1].numa_node(), Some(0));
    }

    #[test]
    fn overlapping_ties_get_one_gpu_per_nic() {
        // Best NICs G0 {A, B}, G1 {B, C}, G2 {A, B}. Greedy by load, then PCI address, gave
        // G0 A, G1 B, G2 A: A twice while C idled.
        let nics: Vec<Nic> = (1..=3)
            .map(|i| {
                let port = format!("0000:00:0{i}.0");
                let dev = format!("0000:0{}:00.0", 4 + i);
                let chain = [port.as_str(), dev.as_str()];
                nic(&format!("eth{i}"), Some(0), 16, "pci0000:00", &chain)
            })
            .collect();
        let cands = vec![vec![0, 1], vec![1, 2], vec![0, 1]];
        assert_eq!(assign(&cands, &nics), vec![Some(0), Some(2), Some(1)]);
    }

    #[test]
    fn overlapping_ties_on_a_tree_get_one_gpu_per_nic() {
        // Socket 0 with host bridges 00, 40 and 60 (NUMA 0), some numa_node files -1 (None):
        // GPU 01:00.0 (NUMA 0) reaches eth1 (bridge 00) and eth2 (bridge 40, NUMA 0) by PHB
        // and eth3 (NUMA unknown) by SYS; GPU 41:00.0 (NUMA unknown, bridge 40) reaches eth2
        // and eth3 by PHB (same bridge), eth1 by SYS; GPU 61:00.0 (NUMA 0) is as the first.
        let gpus = vec![
            gpu(Some(0), "pci0000:00", &["0000:00:01.0", "0000:01:00.0"]),
            gpu(None, "pci0000:40", &["0000:40:01.0", "0000:41:00.0"]),
            gpu(Some(0), "pci0000:60", &["0000:60:01.0", "0000:61:00.0"]),
        ];
        let nics = vec![
            nic(
                "eth1",
                Some(0),
                16,
                "pci0000:00",
                &["0000:00:02.0", "0000:05:00.0"],
            ),
            nic(
                "eth2",
                Some(0),
                16,
                "pci0000:40",
                &["0000:40:02.0", "0000:42:00.0"],
            ),
            nic(
                "eth3",
                None,
                16,
                "pci0000:40",
                &["0000:40:03.0", "0000:43:00.0"],
            ),
        ];
        let tree = Tree {
            gpus,
            nics,
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        let got: Vec<_> = lanes
            .iter()
            .map(|l| (l.nic.as_deref(), l.distance, l.queues.clone()))
            .collect();
        let q: Vec<u32> = (8..16).collect();
        let phb = Some(Distance::Phb);
        assert_eq!(
            got,
            [
                (Some("eth1"), phb, q.clone()),
                (Some("eth3"), phb, q.clone()),
                (Some("eth2"), phb, q)
            ],
            "{lanes:#?}"
        );
        assert_eq!(
            lanes[1].why,
            "through host bridge pci0000:40; 1 of 2 NICs at PHB, spread"
        );
    }

    #[test]
    fn queues_split_evenly_and_contiguously() {
        let ranges = |rx, gpus| -> Vec<Vec<u32>> { split_queues(rx, gpus) };
        assert_eq!(ranges(16, 1), vec![(8..16).collect::<Vec<_>>()]);
        assert_eq!(
            ranges(16, 2),
            vec![(8..12).collect::<Vec<_>>(), (12..16).collect()]
        );
        assert_eq!(
            ranges(16, 3),
            vec![vec![8, 9, 10], vec![11, 12, 13], vec![14, 15]]
        );
        assert_eq!(ranges(4, 3), vec![vec![2], vec![3], vec![]]);
        assert_eq!(ranges(1, 2), vec![vec![0], vec![]]);
        assert_eq!(ranges(0, 2), vec![Vec::<u32>::new(), vec![]]);
        assert_eq!(ranges(16, 0), Vec::<Vec<u32>>::new());
    }

    #[test]
    fn more_gpus_than_queues_take_queues_past_the_nic_without_a_warning() {
        // Before, GPU 3 got no queue and no warning: the binding then found the upper half
        // all handed out and refused devmem on the whole node.
        let gpus: Vec<Gpu> = (0..3)
            .map(|i| {
                let c = under_switch(
                    "0000:01:00.0",
                    &format!("0000:02:{i:02x}.0"),
                    &format!("0000:{:02x}:00.0", 0x10 + i),
                );
                gpu(Some(0), "pci0000:00", &chain(&c))
            })
            .collect();
        let c = under_switch("0000:01:00.0", "0000:02:08.0", "0000:20:00.0");
        let tree = Tree {
            gpus,
            nics: vec![nic("eth1", Some(0), 4, "pci0000:00", &chain(&c))],
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        let queues: Vec<Vec<u32>> = lanes.iter().map(|l| l.queues.clone()).collect();
        assert_eq!(queues, vec![vec![2], vec![3], vec![4]]);
        // No lane warns: the one past the NIC's queues is bound once the node raises the
        // channels (its why says so), and with receive = host it needs none.
        assert!(lanes.iter().all(|l| !l.warn), "{lanes:#?}");
        let past = "; 4 past its 4 RX queues: devmem raises its channels to 5 (where the NIC \
                    allows fewer, receive = devmem refuses to start and auto uses plain TCP on \
                    every lane)";
        let head = "same PCIe switch 0000:01:00.0; eth1 shared by 3 GPUs: queues";
        assert_eq!(lanes[2].why, format!("{head} 4 of 2-4{past}"));
        assert_eq!(lanes[0].why, format!("{head} 2 of 2-4{past}"));
    }

    /// GPU 0000:03:00.0 under PCIe switch 0000:01:00.0.
    fn gpu_under_switch() -> Gpu {
        let c = under_switch("0000:01:00.0", "0000:02:00.0", "0000:03:00.0");
        gpu(Some(0), "pci0000:00", &chain(&c))
    }

    #[test]
    fn a_physical_nic_of_one_queue_gives_none_to_devmem() {
        // Before, its queue 0 (RSS's, the only one) was the lane's devmem queue.
        let g = gpu_under_switch();
        let c = under_switch("0000:01:00.0", "0000:02:08.0", "0000:20:00.0");
        let tree = Tree {
            gpus: vec![g],
            nics: vec![nic("eth1", Some(0), 1, "pci0000:00", &chain(&c))],
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        assert_eq!(lanes[0].nic.as_deref(), Some("eth1"));
        assert!(lanes[0].queues.is_empty(), "{:?}", lanes[0].queues);
        assert!(
            lanes[0].why.ends_with(
                "; eth1 has no rx queues for devmem (it has 1; queue 0 stays with RSS): receive \
                 = devmem refuses to start, and auto uses plain TCP on every lane; raise its RX \
                 channels (ethtool -L)"
            ),
            "{}",
            lanes[0].why
        );
        // A PIX lane, but devmem cannot bind it: marked.
        assert!(lanes[0].warn);
    }

    #[test]
    fn planned_queues_go_past_a_physical_nic_not_a_virtual_one() {
        let mut eth = nic(
            "eth1",
            Some(0),
            8,
            "pci0000:00",
            &["0000:00:01.0", "0000:01:00.0"],
        );
        let one_each: Vec<Vec<u32>> = (4..12).map(|q| vec![q]).collect();
        assert_eq!(plan_queues(&eth, 8), one_each, "8 channels, 8 GPUs");
        assert_eq!(plan_queues(&eth, 2), split_queues(8, 2), "enough");
        assert_eq!(plan_queues(&eth, 0), Vec::<Vec<u32>>::new());
        eth.rx_queues = 2;
        assert_eq!(plan_queues(&eth, 3), [vec![1], vec![2], vec![3]]);
        // One queue: RSS's, none for devmem, none planned past it.
        eth.rx_queues = 1;
        assert_eq!(plan_queues(&eth, 2), [Vec::<u32>::new(), vec![]]);
        // A virtual NIC has no channels to raise: later GPUs get none, as before.
        assert_eq!(plan_queues(&veth("lo"), 2), [vec![0], vec![]]);
    }

    #[test]
    fn virtual_nics_only_when_named() {
        let g = gpu_under_switch();
        let alone = Tree {
            gpus: vec![g.clone()],
            nics: vec![veth("lo"), veth("veth0")],
            ..Tree::default()
        };
        let lanes = pair(&alone, &PairOptions::default());
        assert_eq!(
            summary(&lanes),
            [(0, "0000:03:00.0".into(), None, None, vec![], true)]
        );
        assert!(
            lanes[0].why.starts_with("no physical NIC"),
            "{}",
            lanes[0].why
        );
        assert_eq!(lanes[0].numa_node(), Some(0));
        let named = pair(&alone, &opts(&["veth0"]));
        assert_eq!(
            summary(&named),
            [(
                0,
                "0000:03:00.0".into(),
                Some("veth0"),
                Some(Distance::Sys),
                vec![0],
                true
            )]
        );
        assert_eq!(
            named[0].why,
            "virtual NIC veth0 (no PCI path), named in include_virtual"
        );
        assert_eq!(named[0].nic_pci, None);
        let missing = pair(&alone, &opts(&["veth9"]));
        assert_eq!(
            missing[0].why,
            "no physical NIC, and no NIC named in include_virtual exists"
        );
        // A physical NIC in the GPU's switch beats the named veth.
        let with_eth = Tree {
            gpus: vec![g],
            nics: vec![
                nic(
                    "eth1",
                    Some(0),
                    16,
                    "pci0000:00",
                    &chain(&under_switch(
                        "0000:01:00.0",
                        "0000:02:01.0",
                        "0000:04:00.0",
                    )),
                ),
                veth("veth0"),
            ],
            ..Tree::default()
        };
        let lanes = pair(&with_eth, &opts(&["veth0", "eth1"]));
        assert_eq!(
            summary(&lanes),
            [(
                0,
                "0000:03:00.0".into(),
                Some("eth1"),
                Some(Distance::Pix),
                (8..16).collect(),
                false
            )]
        );
    }

    #[test]
    fn a_named_veth_ties_with_a_cross_socket_nic() {
        // Two GPUs on socket 0, the only physical NIC on socket 1: both are SYS from it and
        // from the named veth, so they spread: physical first.
        let g0 = gpu(Some(0), "pci0000:00", &["0000:00:01.0", "0000:01:00.0"]);
        let g1 = gpu(Some(0), "pci0000:00", &["0000:00:02.0", "0000:02:00.0"]);
        let far = nic(
            "eth1",
            Some(1),
            16,
            "pci0000:80",
            &["0000:80:01.0", "0000:81:00.0"],
        );
        let tree = Tree {
            gpus: vec![g0, g1],
            nics: vec![far, veth("veth0")],
            ..Tree::default()
        };
        let lanes = pair(&tree, &opts(&["veth0"]));
        let nics: Vec<Option<&str>> = lanes.iter().map(|l| l.nic.as_deref()).collect();
        assert_eq!(nics, [Some("eth1"), Some("veth0")]);
        assert_eq!(
            lanes[0].why,
            "across sockets or SNC/NPS domains: GPU on NUMA 0, NIC on NUMA 1; 1 of 2 NICs at \
             SYS, spread"
        );
        assert_eq!(lanes[0].numa_node(), Some(1));
    }

    #[test]
    fn lane_json_has_the_documented_keys() {
        let g = gpu(Some(0), "pci0000:00", &["0000:00:01.0", "0000:01:00.0"]);
        let tree = Tree {
            gpus: vec![g],
            ..Tree::default()
        };
        let lanes = pair(&tree, &PairOptions::default());
        let json = serde_json::to_value(&lanes[0]).expect("serialize");
        let keys: Vec<&str> = json
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = [
            "lane",
            "gpu",
            "nic",
            "nic_pci",
            "distance",
            "numa_node",
            "queues",
            "data_addr",
            "why",
            "warn",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(json["nic"], serde_json::Value::Null);
        assert_eq!(json["numa_node"], 0);
        assert_eq!(json["gpu"], "0000:01:00.0");
    }

    /// The NIC of each GPU's lane, in GPU order.
    fn paired_nics(tree: &Tree) -> Vec<Option<String>> {
        pair(tree, &PairOptions::default())
            .into_iter()
            .map(|l| l.nic)
            .collect()
    }

    /// Two GPUs and the NICs `nics` builds under one switch (PIX to both).
    fn one_switch(nics: impl Fn(&dyn Fn(&str, &str) -> Nic) -> Vec<Nic>) -> Tree {
        let under = |down: &str, dev: &str| under_switch("0000:01:00.0", down, dev);
        let g = |down: &str, dev: &str| gpu(Some(0), "pci0000:00", &chain(&under(down, dev)));
        let n = |down: &str, name: &str| {
            let dev = format!("0000:1{}:00.0", &down[9..10]);
            nic(name, Some(0), 16, "pci0000:00", &chain(&under(down, &dev)))
        };
        Tree {
            gpus: vec![
                g("0000:02:00.0", "0000:10:00.0"),
                g("0000:02:01.0", "0000:11:00.0"),
            ],
            nics: nics(&n),
            ..Tree::default()
        }
    }

    #[test]
    fn a_management_nic_is_passed_over_for_a_fast_one_at_the_same_distance() {
        // A 400 Gb/s NIC and a 1 Gb/s one, equally near both GPUs: spreading the tie gave the
        // second GPU the management NIC.
        let tree = one_switch(|n| {
            let mut fast = n("0000:02:02.0", "ens1");
            fast.speed_mbps = Some(400_000);
            let mut slow = n("0000:02:03.0", "eno1");
            slow.speed_mbps = Some(1_000);
            vec![fast, slow]
        });
        let lanes = pair(&tree, &PairOptions::default());
        let got: Vec<_> = lanes
            .iter()
            .map(|l| (l.nic.as_deref(), l.queues.clone()))
            .collect();
        assert_eq!(
            got,
            [
                (Some("ens1"), (8..12).collect()),
                (Some("ens1"), (12..16).collect())
            ],
            "{lanes:#?}"
        );
        let why = passed_over(&tree.nics, &tree.nics[1]).expect("passed over");
        assert!(
            why.contains("1000 Mb/s, 1/400 of ens1's 400000 Mb/s"),
            "{why}"
        );
        assert_eq!(passed_over(&tree.nics, &tree.nics[0]), None);
        // A NIC at a quarter of the fastest is no management NIC: the tie is spread.
        let tree = one_switch(|n| {
            let mut a = n("0000:02:02.0", "ens1");
            a.speed_mbps = Some(400_000);
            let mut b = n("0000:02:03.0", "ens2");
            b.speed_mbps = Some(100_000);
            vec![a, b]
        });
        assert_eq!(
            paired_nics(&tree),
            [Some("ens1".into()), Some("ens2".into())]
        );
    }

    #[test]
    fn a_port_whose_link_is_down_is_passed_over_while_another_is_up() {
        // An uncabled second port (operstate down) took the second GPU, which then received
        // nothing.
        let tree = one_switch(|n| {
            let mut up = n("0000:02:02.0", "ens1f0");
            up.link_up = Some(true);
            let mut down = n("0000:02:03.0", "ens1f1");
            down.link_up = Some(false);
            vec![up, down]
        });
        assert_eq!(
            paired_nics(&tree),
            [Some("ens1f0".into()), Some("ens1f0".into())]
        );
        let why = passed_over(&tree.nics, &tree.nics[1]).expect("passed over");
        assert!(
            why.contains(
                "link is down (operstate), and ens1f0's (the same model, on the same card or \
                 below the same PCIe switch) is not"
            ),
            "{why}"
        );
        // GPU NICs still down at boot beside an up management NIC of another model: they
        // stay candidates (before, every GPU was paired with the management NIC).
        let tree = one_switch(|n| {
            let mut gpu_nic = n("0000:02:02.0", "ens1f0");
            gpu_nic.link_up = Some(false);
            let mut mgmt = n("0000:02:03.0", "eno1");
            (mgmt.vendor, mgmt.device) = (Some(0x8086), Some(0x1521));
            (mgmt.link_up, mgmt.speed_mbps) = (Some(true), Some(1_000));
            vec![gpu_nic, mgmt]
        });
        assert_eq!(passed_over(&tree.nics, &tree.nics[0]), None);
        // Every link down (a host booting, say): none is passed over.
        let tree = one_switch(|n| {
            let mut a = n("0000:02:02.0", "ens1f0");
            a.link_up = Some(false);
            vec![a]
        });
        assert_eq!(passed_over(&tree.nics, &tree.nics[0]), None);
        assert!(
            pair(&tree, &PairOptions::default())
                .iter()
                .all(|l| l.nic.is_some())
        );
        // Ids that could not be read tell no model: the down NIC stays a candidate.
        let tree = one_switch(|n| {
            let mut down = n("0000:02:02.0", "ens1f0");
            let mut up = n("0000:02:03.0", "ens1f1");
            (down.vendor, down.device, down.link_up) = (None, None, Some(false));
            (up.vendor, up.device, up.link_up) = (None, None, Some(true));
            vec![down, up]
        });
        assert_eq!(passed_over(&tree.nics, &tree.nics[0]), None);
    }

    #[test]
    fn a_down_port_of_a_card_under_a_root_port_is_passed_over_for_its_cabled_port() {
        // A dual-port card plugged straight into a root port (no switch above it): its
        // uncabled port 1 shares no switch with port 0, and the second GPU was paired with it.
        let g = |port: &str, dev: &str| gpu(Some(0), "pci0000:00", &[port, dev]);
        let card = |f: u8, name: &str, up: bool| {
            let mut n = nic(
                name,
                Some(0),
                16,
                "pci0000:00",
                &["0000:00:03.0", &format!("0000:30:00.{f}")],
            );
            n.link_up = Some(up);
            n
        };
        let tree = Tree {
            gpus: vec![
                g("0000:00:01.0", "0000:10:00.0"),
                g("0000:00:02.0", "0000:11:00.0"),
            ],
            nics: vec![card(0, "ens3f0", true), card(1, "ens3f1", false)],
            ..Tree::default()
        };
        let why = passed_over(&tree.nics, &tree.nics[1]).expect("passed over");
        assert!(
            why.contains("ens3f0's (the same model, on the same card"),
            "{why}"
        );
        assert_eq!(
            paired_nics(&tree),
            [Some("ens3f0".into()), Some("ens3f0".into())]
        );
    }

    #[test]
    fn an_uncabled_port_of_a_management_card_goes_with_its_slow_cabled_port() {
        // eno1 (1 Gb/s, cabled) and eno2 (its card's uncabled port) beside a 400 Gb/s ens5:
        // eno1 is passed over as slow, and eno2 with it; were eno2 a candidate, the first GPU
        // took it (lower PCI address) and devmem was refused on the whole node.
        let mut tree = one_switch(|n| {
            let mut fast = n("0000:02:02.0", "ens5");
            (fast.link_up, fast.speed_mbps) = (Some(true), Some(400_000));
            vec![fast]
        });
        let port = |f: u8, name: &str| {
            let mut p = nic(
                name,
                Some(0),
                8,
                "pci0000:00",
                &["0000:00:1c.0", &format!("0000:40:00.{f}")],
            );
            (p.vendor, p.device) = (Some(0x8086), Some(0x1521));
            p
        };
        let mut eno1 = port(0, "eno1");
        (eno1.link_up, eno1.speed_mbps) = (Some(true), Some(1_000));
        let mut eno2 = port(1, "eno2");
        eno2.link_up = Some(false);
        tree.nics.extend([eno1, eno2]);
        assert!(
            passed_over(&tree.nics, &tree.nics[1]).is_some(),
            "eno1 is slow"
        );
        let why = passed_over(&tree.nics, &tree.nics[2]).expect("eno2 goes with eno1");
        assert!(
            why.contains("eno1's (the same model, on the same card"),
            "{why}"
        );
        assert_eq!(
            paired_nics(&tree),
            [Some("ens5".into()), Some("ens5".into())]
        );
    }

    #[test]
    fn a_down_port_beside_a_slow_sibling_stays_a_candidate_while_its_model_runs_fast() {
        // A dual-port CX-7 below the GPUs' switch: ens1f0 came up at 50 Gb/s (a bad cable) and
        // is passed over as slow; ens1f1 is still training. ens9, a CX-7 on the other socket,
        // runs at 400 Gb/s. ens1f1 was passed over for ens1f0, and both GPUs went to ens9
        // across the CPU (SYS) until a restart.
        let port = |f: u8, name: &str| {
            let dev = format!("0000:1a:00.{f}");
            let at = under_switch("0000:01:00.0", "0000:02:02.0", &dev);
            nic(name, Some(0), 16, "pci0000:00", &chain(&at))
        };
        let mut f0 = port(0, "ens1f0");
        (f0.link_up, f0.speed_mbps) = (Some(true), Some(50_000));
        let mut f1 = port(1, "ens1f1");
        f1.link_up = Some(false);
        let mut far = nic(
            "ens9",
            Some(1),
            16,
            "pci0000:80",
            &["0000:80:01.0", "0000:81:00.0"],
        );
        (far.link_up, far.speed_mbps) = (Some(true), Some(400_000));
        let mut tree = one_switch(|_| Vec::new());
        tree.nics.extend([f0, f1, far]);
        assert!(
            passed_over(&tree.nics, &tree.nics[0]).is_some(),
            "ens1f0 is slow"
        );
        assert_eq!(passed_over(&tree.nics, &tree.nics[1]), None);
        let lanes = pair(&tree, &PairOptions::default());
        let got: Vec<_> = lanes
            .iter()
            .map(|l| (l.nic.as_deref(), l.distance, l.warn))
            .collect();
        let on_f1 = (Some("ens1f1"), Some(Distance::Pix), false);
        assert_eq!(got, [on_f1, on_f1], "{lanes:#?}");
        // The same card on a root port (an OCP management card of the same model: one PCI id
        // names the family): its uncabled port stays passed over beside its slow sibling,
        // though ens9 runs fast.
        let mut rooted = tree.clone();
        for (k, f) in [0u8, 1].into_iter().enumerate() {
            let dev = format!("0000:1b:00.{f}");
            let mut n = nic(
                &format!("eno{}", f + 1),
                Some(0),
                16,
                "pci0000:00",
                &["0000:00:03.0", &dev],
            );
            (n.link_up, n.speed_mbps) = (tree.nics[k].link_up, tree.nics[k].speed_mbps);
            rooted.nics[k] = n;
        }
        let why = passed_over(&rooted.nics, &rooted.nics[1]).expect("passed over");
        assert!(why.contains("below no PCIe switch"), "{why}");
        // ens9 of another model: nothing says a CX-7 runs fast here, so ens1f1 goes with its
        // slow sibling, as a management card's uncabled port does.
        (tree.nics[2].vendor, tree.nics[2].device) = (Some(0x8086), Some(0x159b));
        let why = passed_over(&tree.nics, &tree.nics[1]).expect("passed over");
        assert!(
            why.contains("ens1f0's (the same model, on the same card") && why.contains("slow"),
            "{why}"
        );
    }

    #[test]
    fn virtual_functions_beside_their_pf_count_for_no_spread() {
        // Four VFs of ens1 below the GPUs' switch: each lane read "1 of 5 NICs at PIX,
        // spread", though only ens1 could be chosen.
        let with_vfs = |pfs: &[&str]| {
            one_switch(|n| {
                let mut nics: Vec<Nic> = Vec::new();
                for (k, name) in pfs.iter().enumerate() {
                    nics.push(n(&format!("0000:02:0{}.0", k + 2), name));
                }
                for k in 0..4 {
                    let mut vf = n(&format!("0000:02:0{}.0", k + 4), &format!("ens1v{k}"));
                    vf.sriov_vf = true;
                    nics.push(vf);
                }
                nics
            })
        };
        let lanes = pair(&with_vfs(&["ens1"]), &PairOptions::default());
        for lane in &lanes {
            assert_eq!(lane.nic.as_deref(), Some("ens1"));
            assert!(!lane.why.contains("spread"), "{}", lane.why);
        }
        // A second PF is a genuine option: 2, not 6.
        let lanes = pair(&with_vfs(&["ens1", "ens2"]), &PairOptions::default());
        let nics: Vec<_> = lanes.iter().map(|l| l.nic.as_deref()).collect();
        assert_eq!(nics, [Some("ens1"), Some("ens2")]);
        assert!(
            lanes[0].why.contains("; 1 of 2 NICs at PIX, spread"),
            "{}",
            lanes[0].why
        );
    }

    #[test]
    fn gpu_nics_down_beside_an_up_host_nic_of_their_model_stay_candidates() {
        // GCP A3: the GPU NICs and the host NIC are all gVNIC. ens1 and ens2 (below the GPUs'
        // switch) are down at boot, eth0 (right under a root port) is up: before, both were
        // passed over for eth0 ("the same model") and both GPUs went to it at PHB.
        let gvnic = |mut n: Nic, up: bool| {
            (n.vendor, n.device, n.link_up) = (Some(0x1ae0), Some(0x0042), Some(up));
            n
        };
        let host = gvnic(
            nic(
                "eth0",
                Some(0),
                8,
                "pci0000:00",
                &["0000:00:03.0", "0000:20:00.0"],
            ),
            true,
        );
        let with_host = |ups: [bool; 3]| {
            let names = ["ens1", "ens2", "ens3"];
            let ports = ["0000:02:02.0", "0000:02:03.0", "0000:02:04.0"];
            let mut tree = one_switch(|n| {
                (0..3)
                    .map(|k| gvnic(n(ports[k], names[k]), ups[k]))
                    .collect::<Vec<_>>()
            });
            tree.nics.push(host.clone());
            tree
        };
        let tree = with_host([false, false, false]);
        assert_eq!(passed_over(&tree.nics, &tree.nics[0]), None);
        assert_eq!(
            paired_nics(&tree),
            [Some("ens1".into()), Some("ens2".into())]
        );
        // One of the three up, below the same switch: the two down are passed over for it
        // (their GPUs reach it without crossing the CPU), not for eth0.
        let tree = with_host([false, false, true]);
        let why = passed_over(&tree.nics, &tree.nics[0]).expect("passed over");
        assert!(why.contains("and ens3's (the same model"), "{why}");
        assert_eq!(
            paired_nics(&tree),
            [Some("ens3".into()), Some("ens3".into())]
        );
    }

    #[test]
    fn a_virtual_function_comes_after_its_physical_function_however_loaded() {
        let tree = one_switch(|n| {
            let pf = n("0000:02:02.0", "ens1");
            let mut vf = n("0000:02:03.0", "ens1v0");
            vf.sriov_vf = true;
            vec![vf, pf]
        });
        assert_eq!(
            paired_nics(&tree),
            [Some("ens1".into()), Some("ens1".into())]
        );
    }
}
