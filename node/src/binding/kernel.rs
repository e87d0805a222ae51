//! `receive = devmem` on every lane: the lanes grouped by NIC ([`plan`]), each NIC set up once
//! for all its lanes (channels, header split, RSS away from every bound queue, each lane's
//! data port steered to its first queue; one journal per NIC, [`state_file`]), then one
//! binding per lane on its own queues of its own NIC ([`bind_lanes`]). A NIC's setup is
//! shared by the lanes bound on it ([`NicShare`]) and undone when the last of them unbinds;
//! a binding made later over the admin API on a NIC already set up joins that setup. Each
//! lane's binding owns its data port's rule ([`NicHold`]): a lane that leaves while others
//! keep the setup deletes it. RSS stays narrowed below the lowest queue ever bound, and the RX
//! channels raised for the highest (a lane joining on queues past them raises them, journaled
//! as a new setup does), until the setup is undone ([`NicSetup`](nic::NicSetup) has no step
//! that widens RSS or lowers the channels alone).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use shardwire_devmem::nic::{self, SetupPlan};
use shardwire_devmem::probe::NicReport;
use shardwire_gpu::cuda::CudaMemory;

use super::region::{BindError, RxRegion, unsteer_ports};
pub use super::region::{NicHold, NicShare, SharedNic};
use super::{BindingError, probe_summary};

/// What one lane asks to bind.
#[derive(Clone)]
pub struct LaneRequest {
    /// The lane.
    pub lane: u32,
    /// Its NIC (`None`: only for a node of one lane, the interface configured or found).
    pub nic: Option<String>,
    /// The configuration named it (`lanes[i].interface`), not the pairing.
    pub named: bool,
    /// Its RX queues (empty: its share of the upper half of the NIC's).
    pub queues: Vec<u32>,
    /// Dma-buf bytes.
    pub bytes: usize,
    /// The lane's data port (steered to its first queue).
    pub data_port: u16,
    /// The lane's GPU (its memory is the dma-buf), or none (a udmabuf).
    pub cuda: Option<Arc<CudaMemory>>,
}

impl std::fmt::Debug for LaneRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneRequest")
            .field("lane", &self.lane)
            .field("nic", &self.nic)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

/// A NIC and the lanes to bind on it, each with its queues (disjoint).
#[derive(Debug)]
pub struct NicPlan {
    /// The NIC.
    pub nic: NicReport,
    /// (index in the requests, queues).
    pub lanes: Vec<(usize, Vec<u32>)>,
}

/// What `devmem_interface` (`configured`) and `devmem_queues` (`queues`) do to lanes `reqs`
/// that deserves a word: with several lanes both are ignored (each lane binds its own NIC, and
/// a share of its queues), and with one lane the interface may be another NIC than the one the
/// lane is paired with.
pub fn interface_notes(
    reqs: &[LaneRequest],
    configured: Option<&str>,
    queues: &[u32],
) -> Vec<String> {
    let mut notes = Vec::new();
    if reqs.len() > 1 && !queues.is_empty() {
        notes.push(format!(
            "devmem_queues {queues:?} is ignored: with {} lanes each binds a share of its NIC's \
             queues (lanes[i].queues chooses them)",
            reqs.len()
        ));
    }
    let Some(c) = configured else {
        return notes;
    };
    notes.extend(match reqs {
        [one] => match one.nic.as_deref() {
            Some(paired) if paired != c => vec![format!(
                "lane {} is paired with {paired} but binds devmem_interface {c} as configured",
                one.lane
            )],
            _ => Vec::new(),
        },
        _ => vec![format!(
            "devmem_interface {c} is ignored: with {} lanes each binds the NIC it is paired with \
             (lanes[i].interface chooses it)",
            reqs.len()
        )],
    });
    notes
}

/// Groups `reqs` by NIC and gives each lane its queues: those it names, else an even share of
/// the upper half of its NIC's RX queues among the NIC's lanes that name none. Every NIC must
/// be able to do devmem (all refusals named at once), and two lanes on one NIC must not share
/// a queue.
pub fn plan(
    nics: &[NicReport],
    reqs: &[LaneRequest],
    configured: Option<&str>,
) -> Result<Vec<NicPlan>, BindingError> {
    let mut by_nic: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut refused = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let nic = match (r.nic.as_deref(), reqs.len()) {
            // One lane: `devmem_interface` when configured (as before lanes), else the lane's
            // NIC, else the first capable one.
            (n, 1) => super::pick_interface(
                nics,
                configured.or(n),
                true,
                configured.is_some() || r.named,
            ),
            (Some(n), _) => super::pick_interface(nics, Some(n), true, r.named),
            (None, _) => return Err(BindingError::LaneWithoutNic { lane: r.lane }),
        };
        match nic {
            Ok(n) => by_nic.entry(n.name.as_str()).or_default().push(i),
            // A node of one lane says it as before lanes: "IF cannot do devmem: why".
            Err(e @ BindingError::NotCapable { .. }) if reqs.len() == 1 => return Err(e),
            Err(BindingError::NotCapable { name, reason }) => {
                refused.push(format!("lane {} ({name}: {reason})", r.lane));
            }
            Err(e) => return Err(e),
        }
    }
    if !refused.is_empty() {
        return Err(BindingError::LanesNotCapable {
            lanes: refused.join(", "),
            probe: probe_summary(nics),
        });
    }
    by_nic
        .into_iter()
        .map(|(name, idx)| {
            let nic = nics.iter().find(|n| n.name == name).expect("picked");
            Ok(NicPlan {
                lanes: share_queues(nic, reqs, &idx)?,
                nic: nic.clone(),
            })
        })
        .collect()
}

/// Whether lane `lane` (paired with `nic`, on a node of `lanes` lanes) may be bound on
/// `asked`, by the rule [`plan`] binds by at start: the single lane of a node takes any NIC
/// (its data port listens on every NIC its address reaches; start binds `devmem_interface`
/// whatever the lane is paired with), and with several lanes each binds its own NIC only (a
/// binding on another would never see the lane's traffic) and needs one.
pub fn lane_takes(
    (lane, nic): (u32, Option<&str>),
    lanes: usize,
    asked: &str,
) -> Result<(), BindingError> {
    match (nic, lanes) {
        (_, 1) => Ok(()),
        (Some(nic), _) if nic == asked => Ok(()),
        (Some(nic), _) => Err(BindingError::NotLanesNic {
            lane,
            nic: nic.to_owned(),
            asked: asked.to_owned(),
        }),
        (None, _) => Err(BindingError::LaneWithoutNic { lane }),
    }
}

/// The queues of each of `idx` (lanes of `nic`): named ones kept, the others an even split of
/// the upper half of the NIC's queues not named by any; overlaps refused, and named queues
/// that include queue 0 (RSS's: [`nic::rss_bound`]).
fn share_queues(
    nic: &NicReport,
    reqs: &[LaneRequest],
    idx: &[usize],
) -> Result<Vec<(usize, Vec<u32>)>, BindingError> {
    for &i in idx {
        nic::rss_bound(&nic.name, &reqs[i].queues).map_err(|e| BindingError::Failed {
            what: format!("lane {} on {}", reqs[i].lane, nic.name),
            source: e.into(),
        })?;
    }
    let named: Vec<u32> = idx.iter().flat_map(|&i| reqs[i].queues.clone()).collect();
    let free = upper_half_except(nic, &named);
    let unnamed = idx.iter().filter(|&&i| reqs[i].queues.is_empty()).count();
    let each = free.len().checked_div(unnamed).unwrap_or(0);
    let mut next = free.chunks(each.max(1));
    let mut out: Vec<(usize, Vec<u32>)> = Vec::new();
    for &i in idx {
        let queues = match reqs[i].queues.is_empty() {
            false => reqs[i].queues.clone(),
            true if each == 0 => {
                return Err(BindingError::TooFewQueues {
                    nic: nic.name.clone(),
                    lanes: unnamed,
                    free,
                });
            }
            true => next.next().expect("a chunk per unnamed lane").to_vec(),
        };
        for (j, other) in &out {
            if let Some(q) = queues.iter().find(|q| other.contains(q)) {
                return Err(BindingError::QueuesOverlap {
                    nic: nic.name.clone(),
                    lanes: (reqs[*j].lane, reqs[i].lane),
                    queue: *q,
                });
            }
        }
        out.push((i, queues));
    }
    Ok(out)
}

/// The upper half of `nic`'s RX queues (the lower half is left to other traffic) less `taken`.
/// Queue 0 is never in it: a NIC of one queue has none to bind (its only queue, RSS's, bound
/// would make every other flow on it unreadable).
pub fn upper_half_except(nic: &NicReport, taken: &[u32]) -> Vec<u32> {
    ((nic.rx_queues / 2).max(1)..nic.rx_queues)
        .filter(|q| !taken.contains(q))
        .collect()
}

/// The journal of `ifname`'s changes: `base` itself on a node of one lane (as before lanes),
/// else `base` with the interface's name before its extension (`nic-state.eth1.json`).
pub fn state_file(base: &Path, ifname: &str, one_lane: bool) -> PathBuf {
    if one_lane {
        return base.to_path_buf();
    }
    let stem = base.file_stem().unwrap_or_default().to_string_lossy();
    let name = match base.extension() {
        Some(ext) => format!("{stem}.{ifname}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{ifname}"),
    };
    base.with_file_name(name)
}

/// The journals a run with `base` may have left: `base` and its per-interface siblings.
pub fn state_files(base: &Path) -> Vec<PathBuf> {
    let mut out = vec![base.to_path_buf()];
    let (Some(dir), Some(stem)) = (base.parent(), base.file_stem()) else {
        return out;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.", stem.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut siblings: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            // `STEM.IF.EXT` (or `STEM.IF` for a base without extension), never a journal's
            // temporary file or lock file.
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            let tmp = p.extension().is_some_and(|e| e == "tmp" || e == "lock");
            name.starts_with(&prefix) && !tmp && p.file_name() != base.file_name()
        })
        .collect();
    siblings.sort();
    out.extend(siblings);
    out
}

/// A live NIC setup and the lowest queue any lane bound on it (RSS stays below it). Not raised
/// when that lane leaves: the RSS table stays as narrowed until the setup is undone, so this
/// is still the table's bound (and a lane binding those queues again narrows nothing).
type Live = (Weak<SharedNic>, u32);

/// Live NIC setups by interface. A NIC's state is the host's, so this is the process's.
static SETUPS: Mutex<BTreeMap<String, Live>> = Mutex::new(BTreeMap::new());

/// The live (not restored) setup of `name`, with its lowest bound queue.
fn live<'a>(setups: &'a mut BTreeMap<String, Live>, name: &str) -> Option<(NicShare, &'a mut u32)> {
    let (weak, below) = setups.get_mut(name)?;
    let share = weak.upgrade()?;
    let restored = share.setup().state().is_none();
    (!restored).then_some((share, below))
}

/// The queues of `name` bound by lanes now (empty when the NIC is not set up).
pub fn in_use(name: &str) -> Vec<u32> {
    let mut setups = SETUPS.lock().unwrap_or_else(|p| p.into_inner());
    live(&mut setups, name).map_or_else(Vec::new, |(s, _)| s.bound())
}

/// The setup of `nic` for lanes binding `queues` and steering `ports` (port, queue): the
/// live one joined (queues already bound refused, RX channels raised if these lie past them
/// or refused with [`nic::NicError::NotEnoughQueues`] past the NIC's maximum, RSS narrowed if
/// these lie lower, the ports steered), else a new one journaled at `state`. Returned held
/// with the port rules for `ports`, which [`bind_lane`] hands to each lane's binding. Queues
/// that include queue 0 are refused first, joining as in a new setup ([`nic::rss_bound`]).
/// Blocking.
pub fn setup_nic(
    nic: &NicReport,
    queues: &[u32],
    ports: &[(u16, u32)],
    state: &Path,
) -> Result<NicHold, BindError> {
    if !ports.is_empty() {
        nic::rss_bound(&nic.name, queues)?;
    }
    let first = queues.iter().min().copied().unwrap_or(0);
    let mut setups = SETUPS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((share, below)) = live(&mut setups, &nic.name) {
        let bound = share.bound();
        if let Some(&queue) = queues.iter().find(|q| bound.contains(q)) {
            return Err(BindError::QueueBound { queue, bound });
        }
        let mut s = share.setup();
        // As a new setup does (`nic::apply`): a port rule onto a queue past the channels is
        // refused by the NIC with a bare EINVAL. Journaled after the entries there, so the
        // restore lowers the channels only once the rules onto the new queues are gone.
        s.ensure_queues(queues.iter().max().map_or(0, |q| q + 1))?;
        let mut added = Vec::new();
        for (i, &(port, queue)) in ports.iter().enumerate() {
            let rss = (i == 0 && first < *below).then_some(first);
            match s.steer(port, queue, rss) {
                Ok(location) => added.push(location),
                Err(e) => {
                    unsteer_ports(&mut s, &added);
                    return Err(e.into());
                }
            }
        }
        *below = (*below).min(first);
        drop(s);
        return Ok(NicHold::new(share, added));
    }
    let plan = SetupPlan {
        ifname: nic.name.clone(),
        ifindex: nic.ifindex,
        queues: queues.to_vec(),
        netns: None,
        steer: ports.to_vec(),
    };
    let setup = nic::apply(&plan, state)?;
    let rules = setup
        .state()
        .map_or_else(Vec::new, |s| port_rules(&s.changes, ports));
    let share = SharedNic::new(setup);
    setups.insert(nic.name.clone(), (Arc::downgrade(&share), first));
    Ok(NicHold::new(share, rules))
}

/// The rules steering `ports` (port, queue) in a new setup's journal `changes`: each lane's
/// to delete when it leaves (one of a port not found is left to the restore).
fn port_rules(changes: &[nic::Change], ports: &[(u16, u32)]) -> Vec<nic::InsertedRule> {
    let rule_of = |port: u16, queue: u32| {
        let want = nic::steer::Tcp4Match::port(port);
        changes.iter().find_map(|c| match *c {
            nic::Change::Rule {
                location,
                rule: Some(rule),
                queue: Some(q),
            } if rule == want && q == queue => Some(nic::InsertedRule {
                location,
                rule,
                queue,
            }),
            _ => None,
        })
    };
    ports.iter().filter_map(|&(p, q)| rule_of(p, q)).collect()
}

/// One lane's binding on `nic` (`queues`, `bytes` of its own dma-buf) with `setup`, whose
/// port rules for the lane (steering onto `queues`) its binding takes: deleted when it is
/// unbound, or at once if the bind fails. Blocking.
pub fn bind_lane(
    nic: &NicReport,
    queues: &[u32],
    bytes: usize,
    setup: &mut NicHold,
    cuda: Option<Arc<CudaMemory>>,
) -> Result<Arc<RxRegion>, BindError> {
    let hold = setup.take_lane(queues);
    RxRegion::bind_kernel((&nic.name, nic.ifindex), queues, bytes, hold, cuda)
}

/// Binds every lane of `plans` (blocking): per NIC one setup, then each lane's region on its
/// queues. Returns (lane, region) in request order; on a failure what was made is undone
/// (the regions dropped: unbound, their port rules deleted, NICs restored) and the error
/// names the lane.
pub fn bind_lanes(
    plans: &[NicPlan],
    reqs: &[LaneRequest],
    state_base: &Path,
) -> Result<Vec<(u32, Arc<RxRegion>)>, BindingError> {
    let one_lane = reqs.len() == 1;
    let mut bound = Vec::new();
    for p in plans {
        let queues: Vec<u32> = p.lanes.iter().flat_map(|(_, q)| q.clone()).collect();
        let ports: Vec<(u16, u32)> = p
            .lanes
            .iter()
            .map(|(i, q)| (reqs[*i].data_port, q.iter().min().copied().unwrap_or(0)))
            .collect();
        let state = state_file(state_base, &p.nic.name, one_lane);
        let mut setup =
            setup_nic(&p.nic, &queues, &ports, &state).map_err(|source| BindingError::Failed {
                what: p.nic.name.clone(),
                source,
            })?;
        for (i, q) in &p.lanes {
            let r = &reqs[*i];
            let region =
                bind_lane(&p.nic, q, r.bytes, &mut setup, r.cuda.clone()).map_err(|source| {
                    BindingError::Failed {
                        what: format!("lane {} on {}", r.lane, p.nic.name),
                        source,
                    }
                })?;
            bound.push((r.lane, region));
        }
    }
    bound.sort_by_key(|(lane, _)| *lane);
    Ok(bound)
}

#[cfg(test)]
mod tests;
