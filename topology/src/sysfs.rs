//! Discovery of a host's GPUs, NICs and NUMA nodes from a sysfs tree whose root is a
//! parameter (`/sys` on a host, a fake tree in tests; see `tests/fixtures/sysfs/`).
//!
//! What is read is what TCPX RxDM, TCPXO and NCCL read: `bus/pci/devices/*/{vendor,class}`
//! for GPUs, `class/net/*` and the real path of `class/net/IF/device` for NICs, and
//! `numa_node`/`local_cpulist` of each device. Every path is resolved relative to the
//! canonicalized root, so a fake tree with relative symlinks works wherever it lies.
//! Missing or unreadable files are `None`/empty, never errors. Errors are a root that does not
//! exist or (other than `/sys` itself) has neither `class/net` nor `bus/pci/devices` (not a
//! sysfs tree); one whose entries there all link to nothing (copied without `devices/`); and a
//! cpulist no kernel writes, named by its path: malformed, naming a CPU past
//! [`MAX_CPUS`](crate::values::MAX_CPUS), or longer than [`MAX_ATTR`] bytes (no file is read
//! past that length).

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::device::GpuUuid;
use crate::path::PciPath;
use crate::pci::{PciAddr, parse_sysfs_name};
use crate::values::{
    CpulistError, parse_cpulist, parse_hex16, parse_numa, ser_cpulist, ser_hex16, ser_opt_hex16,
};

/// The sysfs root of a running host.
pub const DEFAULT_ROOT: &str = "/sys";

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;

/// PCI class prefixes of GPUs: VGA controller and 3D controller (data-center GPUs).
const GPU_CLASSES: [&str; 2] = ["0x0300", "0x0302"];

/// The most bytes of an attribute file read. The kernel writes at most a page for one, and for
/// a cpulist at most 3.5 bytes a CPU (28 KiB for 8192 CPUs): a hostile tree's file of
/// gigabytes is not read whole.
const MAX_ATTR: usize = 64 * 1024;

/// Why a sysfs tree cannot be read at all.
#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    /// The root does not exist or cannot be resolved.
    #[error("sysfs root {path}: {source}")]
    Root {
        /// The root given.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The root is not a directory.
    #[error("sysfs root {0} is not a directory")]
    NotADirectory(PathBuf),
    /// The root has neither `class/net` nor `bus/pci/devices`: not a sysfs tree (a mistyped
    /// `sysfs_root`, or the parent of the fixture trees).
    #[error(
        "sysfs root {0} has neither class/net nor bus/pci/devices: it is not a sysfs tree; set \
         sysfs_root (SHARDWIRE_SYSFS_ROOT, --sysfs-root) to /sys or to a tree such as \
         tests/fixtures/sysfs/a3-8gpu-8nic"
    )]
    NotSysfs(PathBuf),
    /// Every entry of `class/net` or `bus/pci/devices` links to nothing: the tree was copied
    /// without `devices/`, where those links point (`cp -r /sys/class /sys/bus DIR`). Read
    /// on, it was a host without GPUs or NICs, and nothing said why.
    #[error(
        "sysfs root {root}: {link} links to {target}, which does not exist, and no entry of its \
         directory links to anything that does: the tree was copied without devices/, where \
         sysfs's links point; copy /sys/devices too, keeping the links as links (e.g. `cp -r \
         /sys/devices /sys/bus /sys/class DIR`)"
    )]
    Dangling {
        /// The root given.
        root: PathBuf,
        /// The first entry that links to nothing.
        link: PathBuf,
        /// Where it links (as the link says).
        target: PathBuf,
    },
    /// A cpulist file (`local_cpulist`, a NUMA node's `cpulist`) that no kernel writes: the
    /// tree is corrupt, or was written by hand.
    #[error(
        "{path}: {reason}: no kernel writes such a cpulist, so the sysfs tree is corrupt; copy \
         it again from the host's /sys"
    )]
    Cpulist {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: CpulistError,
    },
}

/// An NVIDIA GPU found under `bus/pci/devices`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Its bus id.
    pub pci: PciAddr,
    /// Its UUID, when the CUDA driver sees it (sysfs does not say; the caller fills it in).
    pub uuid: Option<GpuUuid>,
    /// Its NUMA node; `None` when the platform says -1.
    pub numa_node: Option<u32>,
    /// PCI vendor id (always [`NVIDIA_VENDOR`]).
    #[serde(serialize_with = "ser_hex16")]
    pub vendor: u16,
    /// PCI device id (`0x2330` = H100 SXM); `None` when unreadable.
    #[serde(serialize_with = "ser_opt_hex16")]
    pub device: Option<u16>,
    /// CPUs near it, from `local_cpulist`.
    #[serde(serialize_with = "ser_cpulist")]
    pub local_cpulist: Vec<u32>,
    /// Its place in the PCI tree.
    pub path: PciPath,
}

/// A network interface found under `class/net`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Nic {
    /// Interface name (`eth1`).
    pub interface: String,
    /// The PCI function behind it; `None` when virtual.
    pub pci: Option<PciAddr>,
    /// Its NUMA node; `None` when unknown or virtual.
    pub numa_node: Option<u32>,
    /// No PCI device behind it (veth, lo, bridge, virtio...): it has no PCI path.
    #[serde(rename = "virtual")]
    pub is_virtual: bool,
    /// Number of `queues/rx-*` entries (0 when absent).
    pub rx_queues: u32,
    /// Whether the devmem probe found it capable (`None`: not probed, e.g. a fake tree; the
    /// caller fills it in).
    pub devmem_capable: Option<bool>,
    /// PCI vendor id (`0x15b3` = Mellanox); `None` when virtual or unreadable.
    #[serde(serialize_with = "ser_opt_hex16")]
    pub vendor: Option<u16>,
    /// PCI device id; `None` when virtual or unreadable.
    #[serde(serialize_with = "ser_opt_hex16")]
    pub device: Option<u16>,
    /// CPUs near it, from `local_cpulist`; empty when virtual.
    #[serde(serialize_with = "ser_cpulist")]
    pub local_cpulist: Vec<u32>,
    /// Its place in the PCI tree; `None` when virtual.
    pub path: Option<PciPath>,
    /// Why it cannot carry a lane, whatever its distance (never paired with a GPU): not
    /// Ethernet (an InfiniBand port), or a port of a bond, team or bridge, which carries
    /// its traffic instead. `None`: usable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unusable: Option<String>,
    /// Negotiated link speed in Mb/s (`speed`); `None` when unknown (the link down, a
    /// virtual NIC, a driver that does not say).
    pub speed_mbps: Option<u32>,
    /// Whether its link is up (`operstate`): `None` when the kernel does not know
    /// (`unknown`, `dormant`, `testing`, unreadable).
    pub link_up: Option<bool>,
    /// An SR-IOV virtual function (its PCI function has a `physfn` link): it shares the port
    /// of its physical function.
    pub sriov_vf: bool,
}

/// What a sysfs tree says about a host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tree {
    /// GPUs by PCI address.
    pub gpus: Vec<Gpu>,
    /// Physical NICs by PCI address, then virtual ones by name.
    pub nics: Vec<Nic>,
    /// The CPUs of each NUMA node (`devices/system/node/node<N>/cpulist`).
    pub nodes: BTreeMap<u32, Vec<u32>>,
}

impl Tree {
    /// Reads the tree under `root` (`/sys` on a host). A missing `bus/pci/devices` or
    /// `class/net` gives no GPUs or NICs (a VM without PCI); a root that does not exist, or
    /// (other than `/sys` itself) has neither, is an error, as are entries there that all link
    /// to nothing and a cpulist no kernel writes ([`SysfsError`]).
    pub fn read(root: &Path) -> Result<Tree, SysfsError> {
        let canonical = sysfs_root(root)?;
        let real = canonical.as_path();
        let pci = entries(&real.join("bus/pci/devices"));
        let net = entries(&real.join("class/net"));
        no_dangling(root, &pci)?;
        no_dangling(root, &net)?;
        let mut gpus = pci
            .iter()
            .filter_map(|(name, entry)| read_gpu(real, name, entry))
            .collect::<Result<Vec<Gpu>, SysfsError>>()?;
        gpus.sort_by_key(|g| g.pci);
        // Interfaces only: `class/net` also holds files, e.g. `bonding_masters` once the
        // bonding module is loaded.
        let mut nics = net
            .iter()
            .filter(|(_, entry)| entry.is_dir())
            .map(|(name, entry)| read_nic(real, name, entry))
            .collect::<Result<Vec<Nic>, SysfsError>>()?;
        nics.sort_by(|a, b| {
            (a.is_virtual, a.pci, &a.interface).cmp(&(b.is_virtual, b.pci, &b.interface))
        });
        let nodes = read_nodes(real)?;
        // Firmware without proximity information writes `numa_node` -1; on a host of one NUMA
        // node every device is on it (otherwise every pair across host bridges read as SYS,
        // "NUMA node unknown", with a cross-CPU warning).
        if let Some(only) = only_cpu_node(&nodes) {
            for g in gpus.iter_mut().filter(|g| g.numa_node.is_none()) {
                g.numa_node = Some(only);
            }
            for n in nics
                .iter_mut()
                .filter(|n| n.numa_node.is_none() && !n.is_virtual)
            {
                n.numa_node = Some(only);
            }
        }
        Ok(Tree { gpus, nics, nodes })
    }

    /// The CPUs of NUMA node `node`; empty when the tree does not list it.
    pub fn cpus_of_node(&self, node: u32) -> &[u32] {
        self.nodes.get(&node).map_or(&[], Vec::as_slice)
    }
}

/// The one NUMA node with CPUs, which a device whose `numa_node` is unknown must hang off:
/// node 0 when there is no `devices/system/node` (a kernel built without NUMA has neither it
/// nor `numa_node` files), the only node whose `cpulist` is not empty (CPU-less nodes, such as
/// CXL memory, HBM in flat mode or GPU memory, hold no PCI host bridge), or the only node when
/// no `cpulist` could be read. `None` on a host of several nodes with CPUs.
fn only_cpu_node(nodes: &BTreeMap<u32, Vec<u32>>) -> Option<u32> {
    if nodes.is_empty() {
        return Some(0);
    }
    let with_cpus: Vec<u32> = nodes
        .iter()
        .filter(|(_, cpus)| !cpus.is_empty())
        .map(|(&n, _)| n)
        .collect();
    match (&with_cpus[..], nodes.len()) {
        ([only], _) => Some(*only),
        ([], 1) => nodes.keys().next().copied(),
        _ => None,
    }
}

/// The CPUs of each NUMA node (`devices/system/node/node<N>/cpulist`) of the tree at `root`
/// (canonical).
fn read_nodes(root: &Path) -> Result<BTreeMap<u32, Vec<u32>>, SysfsError> {
    entries(&root.join("devices/system/node"))
        .iter()
        .filter_map(|(name, dir)| {
            let n = name.strip_prefix("node")?.parse::<u32>().ok()?;
            Some(read_cpulist(&dir.join("cpulist")).map(|cpus| (n, cpus)))
        })
        .collect()
}

/// An error naming the first of `list` (the entries of `class/net` or `bus/pci/devices` of
/// the tree given as `root`) when it has some and none exists: each links to nothing.
fn no_dangling(root: &Path, list: &[(String, PathBuf)]) -> Result<(), SysfsError> {
    let Some((_, first)) = list.first() else {
        return Ok(());
    };
    if list.iter().any(|(_, entry)| entry.exists()) {
        return Ok(());
    }
    Err(SysfsError::Dangling {
        root: root.to_owned(),
        link: first.clone(),
        target: fs::read_link(first).unwrap_or_default(),
    })
}

/// `root` canonicalized, once it is known to be a sysfs tree: a directory with `class/net` or
/// `bus/pci/devices` (a VM without PCI still has `class/net/lo`). `/sys` itself is taken as
/// it is (a sandbox without sysfs mounted there reads as a host without GPUs or NICs, as
/// before): only a configured root is refused.
fn sysfs_root(root: &Path) -> Result<PathBuf, SysfsError> {
    let canonical = root.canonicalize().map_err(|source| SysfsError::Root {
        path: root.to_owned(),
        source,
    })?;
    if !canonical.is_dir() {
        return Err(SysfsError::NotADirectory(root.to_owned()));
    }
    let own = root == Path::new(DEFAULT_ROOT);
    if !own && !canonical.join("class/net").is_dir() && !canonical.join("bus/pci/devices").is_dir()
    {
        return Err(SysfsError::NotSysfs(root.to_owned()));
    }
    Ok(canonical)
}

/// The entries of `dir` as (name, path), sorted by name; none when unreadable. Names that
/// are not UTF-8 are skipped (sysfs names are ASCII).
fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(read) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, PathBuf)> = read
        .filter_map(Result::ok)
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    out.sort();
    out
}

/// The text of an attribute file, up to [`MAX_ATTR`] bytes and one more (so a longer file
/// shows as one); `None` when unreadable or not UTF-8.
fn read_text(path: &Path) -> Option<String> {
    let mut text = String::new();
    fs::File::open(path)
        .ok()?
        .take(MAX_ATTR as u64 + 1)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

fn read_hex16(path: &Path) -> Option<u16> {
    parse_hex16(&read_text(path)?)
}

fn read_numa(dev: &Path) -> Option<u32> {
    parse_numa(&read_text(&dev.join("numa_node"))?)
}

/// The CPUs a cpulist file names; none when it cannot be read. One that no kernel writes is an
/// error naming the file (before, it was an empty list, and a hostile one allocated
/// gigabytes).
fn read_cpulist(path: &Path) -> Result<Vec<u32>, SysfsError> {
    let Some(text) = read_text(path) else {
        return Ok(Vec::new());
    };
    let cpus = match text.len() > MAX_ATTR {
        true => Err(CpulistError::TooLong(MAX_ATTR)),
        false => parse_cpulist(&text),
    };
    cpus.map_err(|reason| SysfsError::Cpulist {
        path: path.to_owned(),
        reason,
    })
}

/// The PCI path of a device from its real path, relative to `ROOT/devices`.
fn pci_path(root: &Path, real: &Path) -> PciPath {
    let rel = real.strip_prefix(root.join("devices")).unwrap_or(real);
    PciPath::from_real_path(rel)
}

/// `entry` (a `bus/pci/devices` link) as a GPU, when its vendor is NVIDIA and its class
/// a display controller (an error when its `local_cpulist` is none a kernel writes).
fn read_gpu(root: &Path, name: &str, entry: &Path) -> Option<Result<Gpu, SysfsError>> {
    let pci = parse_sysfs_name(name)?;
    let vendor = read_hex16(&entry.join("vendor")).filter(|v| *v == NVIDIA_VENDOR)?;
    let class = read_text(&entry.join("class"))?.trim().to_ascii_lowercase();
    if !GPU_CLASSES.iter().any(|c| class.starts_with(c)) {
        return None;
    }
    let real = entry.canonicalize().ok()?;
    let local_cpulist = match read_cpulist(&real.join("local_cpulist")) {
        Ok(cpus) => cpus,
        Err(e) => return Some(Err(e)),
    };
    Some(Ok(Gpu {
        pci,
        uuid: None,
        numa_node: read_numa(&real),
        vendor,
        device: read_hex16(&real.join("device")),
        local_cpulist,
        path: pci_path(root, &real),
    }))
}

/// `real` lies under a `virtual` directory of the tree (`devices/virtual/net/veth0`).
fn under_virtual(root: &Path, real: &Path) -> bool {
    let rel = real.strip_prefix(root).unwrap_or(real);
    rel.components().any(|c| c.as_os_str() == "virtual")
}

/// The PCI function behind `class/net/IF` and its real path, or `None` when the interface
/// is virtual: no `device` link, a real path under `virtual/`, or a `device/subsystem`
/// that is not the PCI bus (NCCL's test).
fn pci_device(root: &Path, entry: &Path) -> Option<(PciAddr, PathBuf)> {
    if under_virtual(root, &entry.canonicalize().ok()?) {
        return None;
    }
    let dev = entry.join("device").canonicalize().ok()?;
    if under_virtual(root, &dev) {
        return None;
    }
    let subsystem = dev.join("subsystem").canonicalize().ok()?;
    if !subsystem.is_dir() || !subsystem.ends_with("bus/pci") {
        return None;
    }
    let pci = parse_sysfs_name(dev.file_name()?.to_str()?)?;
    Some((pci, dev))
}

/// Why the interface at `entry` (`class/net/NAME`) cannot carry a lane, if it cannot: its
/// `type` (ARPHRD) is not Ethernet (1), it is a switchdev representor of a virtual or
/// sub-function (`phys_port_name` `pfNvfM`, `pfNsfM`), or it has a `master`: a bond, team or
/// bridge carries its traffic, a VRF routes it in a table the node's sockets are not in.
fn unusable(entry: &Path) -> Option<String> {
    let arp_type = read_text(&entry.join("type")).and_then(|t| t.trim().parse::<u16>().ok());
    if let Some(t) = arp_type.filter(|&t| t != 1) {
        let what = if t == 32 { " (InfiniBand)" } else { "" };
        return Some(format!(
            "not an Ethernet interface: ARPHRD type {t}{what}; lanes and devmem TCP need Ethernet"
        ));
    }
    let port = read_text(&entry.join("phys_port_name")).unwrap_or_default();
    if is_function_representor(port.trim()) {
        return Some(format!(
            "a switchdev representor (phys_port_name {}): it carries that function's traffic, \
             not a port's",
            port.trim()
        ));
    }
    let link = fs::read_link(entry.join("master")).ok()?;
    let master = link.file_name()?.to_string_lossy().into_owned();
    if is_vrf(&entry.join("master")) {
        return Some(format!(
            "a port of VRF {master}: its addresses and routes are in that VRF's table, which \
             the node's sockets do not join; take it out of the VRF, or run the node in it \
             (`ip vrf exec {master}`)"
        ));
    }
    let kind = if entry.join("brport").is_dir() {
        "a bridge"
    } else if entry.join("bonding_slave").is_dir() {
        "a bond"
    } else {
        "a bond, team or bridge"
    };
    Some(format!(
        "a port of {master} ({kind}), which carries its traffic"
    ))
}

/// Whether the interface at `master` is a VRF (an L3 master device): the kernel's VRF
/// driver gives it `IFF_MASTER | IFF_NOARP` in `flags`, which no bond (ARP), team or bridge
/// (not `IFF_MASTER`) has. Its ports carry their own traffic, routed in the VRF's table.
fn is_vrf(master: &Path) -> bool {
    const IFF_NOARP: u32 = 0x80;
    const IFF_MASTER: u32 = 0x400;
    let flags = read_text(&master.join("flags"))
        .and_then(|f| u32::from_str_radix(f.trim().trim_start_matches("0x"), 16).ok());
    flags.is_some_and(|f| f & (IFF_MASTER | IFF_NOARP) == IFF_MASTER | IFF_NOARP)
}

/// Whether a `phys_port_name` names the representor of a virtual or sub-function (`pf0vf3`,
/// `pf0sf1`, with a controller `c1pf0vf3`), not a physical port (`p0`) or its PF (`pf0`).
fn is_function_representor(name: &str) -> bool {
    let digits = |s: &str| -> Option<usize> {
        let n = s.bytes().take_while(u8::is_ascii_digit).count();
        (n > 0).then_some(n)
    };
    let rest = match name.strip_prefix('c') {
        Some(r) => digits(r).map_or(name, |n| &r[n..]),
        None => name,
    };
    let Some(rest) = rest.strip_prefix("pf") else {
        return false;
    };
    let Some(n) = digits(rest) else { return false };
    let rest = &rest[n..];
    let Some(tail) = rest.strip_prefix("vf").or_else(|| rest.strip_prefix("sf")) else {
        return false;
    };
    digits(tail) == Some(tail.len())
}

fn count_rx_queues(queues: &Path) -> u32 {
    let n = entries(queues)
        .iter()
        .filter(|(name, _)| name.starts_with("rx-"))
        .count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Whether an `operstate` value (RFC 2863) says the link is up; `None`: the kernel does not
/// know.
fn link_up(operstate: &str) -> Option<bool> {
    match operstate {
        "up" => Some(true),
        "down" | "lowerlayerdown" | "notpresent" => Some(false),
        _ => None,
    }
}

/// The interface at `entry` (`class/net/NAME`); an error when its PCI function's
/// `local_cpulist` is none a kernel writes.
fn read_nic(root: &Path, name: &str, entry: &Path) -> Result<Nic, SysfsError> {
    let mut nic = Nic {
        interface: name.to_owned(),
        pci: None,
        numa_node: None,
        is_virtual: true,
        rx_queues: count_rx_queues(&entry.join("queues")),
        devmem_capable: None,
        vendor: None,
        device: None,
        local_cpulist: Vec::new(),
        path: None,
        unusable: unusable(entry),
        speed_mbps: read_text(&entry.join("speed"))
            .and_then(|t| t.trim().parse::<i64>().ok())
            .and_then(|s| u32::try_from(s).ok())
            .filter(|&s| s > 0),
        link_up: read_text(&entry.join("operstate")).and_then(|t| link_up(t.trim())),
        sriov_vf: false,
    };
    if let Some((pci, dev)) = pci_device(root, entry) {
        nic.sriov_vf = fs::symlink_metadata(dev.join("physfn")).is_ok();
        nic.pci = Some(pci);
        nic.numa_node = read_numa(&dev);
        nic.is_virtual = false;
        nic.vendor = read_hex16(&dev.join("vendor"));
        nic.device = read_hex16(&dev.join("device"));
        nic.local_cpulist = read_cpulist(&dev.join("local_cpulist"))?;
        nic.path = Some(pci_path(root, &dev));
    }
    Ok(nic)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn representors_of_functions_are_told_from_ports() {
        for r in ["pf0vf3", "pf1sf12", "c1pf0vf0"] {
            assert!(is_function_representor(r), "{r}");
        }
        for p in ["p0", "pf0", "", "pf0vf", "pfxvf1", "eth0", "c1pf0"] {
            assert!(!is_function_representor(p), "{p}");
        }
    }

    #[test]
    fn operstates_up_down_and_unknown() {
        assert_eq!(link_up("up"), Some(true));
        for s in ["down", "lowerlayerdown", "notpresent"] {
            assert_eq!(link_up(s), Some(false), "{s}");
        }
        for s in ["unknown", "dormant", "testing", ""] {
            assert_eq!(link_up(s), None, "{s}");
        }
    }

    #[test]
    fn missing_root_is_an_error_naming_it() {
        let root = Path::new("/nonexistent/shardwire-topology-sysfs");
        let err = Tree::read(root).expect_err("missing root");
        assert!(
            err.to_string()
                .contains("/nonexistent/shardwire-topology-sysfs"),
            "{err}"
        );
        assert!(matches!(err, SysfsError::Root { .. }));
    }

    #[test]
    fn a_root_that_is_no_sysfs_tree_is_refused_naming_the_key() {
        // The crate's own source directory: a directory with none of the sysfs entries. It
        // read as an empty tree: no GPU, no NIC, and nothing said why.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let err = Tree::read(&root).expect_err("not a sysfs tree");
        assert!(matches!(err, SysfsError::NotSysfs(_)), "{err}");
        let text = err.to_string();
        for part in [
            root.to_str().expect("UTF-8 path"),
            "class/net",
            "bus/pci/devices",
        ] {
            assert!(text.contains(part), "{text}");
        }
        assert!(text.contains("set sysfs_root"), "{text}");
    }

    #[test]
    fn a_root_without_pci_is_a_tree_of_virtual_nics() {
        // A VM without PCI: class/net/lo and nothing else.
        let root =
            std::env::temp_dir().join(format!("shardwire-sysfs-nopci-{}", std::process::id()));
        fs::create_dir_all(root.join("class/net/lo")).expect("mkdir");
        let tree = Tree::read(&root);
        let _ = fs::remove_dir_all(&root);
        let tree = tree.expect("a tree without PCI");
        assert!(tree.gpus.is_empty());
        assert_eq!(tree.nics.len(), 1, "{:?}", tree.nics);
        assert!(tree.nics[0].is_virtual && tree.nics[0].interface == "lo");
        assert_eq!(tree.cpus_of_node(0), &[] as &[u32]);
    }

    #[test]
    fn the_one_cpu_node_skips_cpu_less_nodes_and_is_0_without_numa() {
        // Before, only a host with exactly one nodeN directory had one: a CPU-less memory
        // node beside it, or no devices/system/node at all, left every -1 unknown.
        let none: Vec<u32> = Vec::new();
        // A kernel without NUMA.
        assert_eq!(only_cpu_node(&BTreeMap::new()), Some(0));
        let cxl = BTreeMap::from([(0, vec![0, 1]), (1, none.clone())]);
        assert_eq!(only_cpu_node(&cxl), Some(0));
        assert_eq!(only_cpu_node(&BTreeMap::from([(2, vec![0, 1])])), Some(2));
        let unread = BTreeMap::from([(3, none.clone())]);
        assert_eq!(only_cpu_node(&unread), Some(3), "cpulist unreadable");
        let two = BTreeMap::from([(0, vec![0]), (1, vec![1])]);
        assert_eq!(only_cpu_node(&two), None);
        let cpu_less = BTreeMap::from([(0, none.clone()), (1, none)]);
        assert_eq!(only_cpu_node(&cpu_less), None);
    }

    /// Copies `from` to `to`, links as links (the fixtures' links are relative).
    fn copy_keeping_links(from: &Path, to: &Path) {
        fs::create_dir_all(to).expect("mkdir");
        for (name, src) in entries(from) {
            let dst = to.join(name);
            let kind = fs::symlink_metadata(&src).expect("stat").file_type();
            if kind.is_symlink() {
                let target = fs::read_link(&src).expect("read_link");
                std::os::unix::fs::symlink(target, &dst).expect("symlink");
            } else if kind.is_dir() {
                copy_keeping_links(&src, &dst);
            } else {
                fs::copy(&src, &dst).expect("copy");
            }
        }
    }

    #[test]
    fn a_tree_copied_without_devices_is_refused_naming_a_dangling_link() {
        // `cp -r /sys/class /sys/bus t/`: every entry of bus/pci/devices and class/net links
        // into the devices/ left behind. It read as a host without GPUs or NICs, silently.
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sysfs/a3-8gpu-8nic");
        let root =
            std::env::temp_dir().join(format!("shardwire-sysfs-dangling-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for dir in ["bus", "class"] {
            copy_keeping_links(&fixture.join(dir), &root.join(dir));
        }
        let without = Tree::read(&root);
        copy_keeping_links(&fixture.join("devices"), &root.join("devices"));
        let whole = Tree::read(&root);
        let _ = fs::remove_dir_all(&root);
        let err = without.expect_err("every link dangles");
        assert!(matches!(err, SysfsError::Dangling { .. }), "{err}");
        let text = err.to_string();
        for part in [
            "bus/pci/devices/0000:00:01.0 links to ../../../devices/pci0000:00/0000:00:01.0",
            "copy /sys/devices too",
        ] {
            assert!(text.contains(part), "{text}");
        }
        let whole = whole.expect("with devices/ it reads");
        assert_eq!((whole.gpus.len(), whole.nics.len()), (8, 10));
    }

    #[test]
    fn a_cpulist_no_kernel_writes_is_an_error_naming_its_file() {
        // A node's cpulist naming 2^32 CPUs in 512 KiB (`0-65535,` repeated) was expanded
        // range by range (16 GiB, then an abort); a malformed one was read as no CPUs.
        let root =
            std::env::temp_dir().join(format!("shardwire-sysfs-cpulist-{}", std::process::id()));
        let node = root.join("devices/system/node/node0");
        let read_with = |cpulist: &str| {
            let _ = fs::remove_dir_all(&root);
            fs::create_dir_all(root.join("class/net")).expect("mkdir");
            fs::create_dir_all(&node).expect("mkdir");
            fs::write(node.join("cpulist"), cpulist).expect("write");
            Tree::read(&root)
        };
        let hostile = "0-65535,".repeat(1 << 16);
        let long = read_with(&hostile);
        let past = read_with("0-3,65536-65599\n");
        let fine = read_with("0-3\n");
        // As the tree names it: below the canonical root.
        let file = node.canonicalize().expect("the node").join("cpulist");
        let _ = fs::remove_dir_all(&root);
        for (got, reason) in [
            (long, CpulistError::TooLong(MAX_ATTR)),
            (past, CpulistError::CpuTooLarge(65599)),
        ] {
            match got {
                Err(SysfsError::Cpulist { path, reason: r }) => {
                    assert_eq!((&path, &r), (&file, &reason));
                }
                other => panic!("{other:?}"),
            }
        }
        let text = SysfsError::Cpulist {
            path: file.clone(),
            reason: CpulistError::CpuTooLarge(65599),
        }
        .to_string();
        assert!(text.contains(file.to_str().expect("UTF-8")), "{text}");
        assert_eq!(
            fine.expect("a kernel's cpulist").cpus_of_node(0),
            &[0, 1, 2, 3][..]
        );
    }

    #[test]
    fn a_file_as_root_is_refused() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let err = Tree::read(&root).expect_err("file root");
        assert!(matches!(err, SysfsError::NotADirectory(_)), "{err}");
    }

    #[test]
    fn virtual_is_judged_below_the_root_only() {
        let root = Path::new("/tmp/virtual/sys");
        assert!(!under_virtual(
            root,
            Path::new("/tmp/virtual/sys/devices/pci0000:00")
        ));
        assert!(under_virtual(
            root,
            Path::new("/tmp/virtual/sys/devices/virtual/net/lo")
        ));
        let pp = pci_path(
            root,
            Path::new("/tmp/virtual/sys/devices/pci0000:00/0000:00:01.0"),
        );
        assert_eq!(pp.host_bridge, "pci0000:00");
    }
}
