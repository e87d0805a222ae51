//! Where a device sits in the PCI tree: its host bridge and the chain of bridges down to it,
//! read from the device's real sysfs path, and the PCIe switches on that chain as NCCL sees
//! them.

use std::fmt;
use std::path::Path;

use serde::Serialize;

use crate::pci::{PciAddr, parse_sysfs_name};

/// A device's place in the PCI tree, e.g. for
/// `devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0`:
/// host bridge `pci0000:00`, chain root port, switch upstream port, switch downstream port,
/// device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PciPath {
    /// The outermost `pciDDDD:BB` component (the host bridge, one per root complex: it
    /// names the CPU side the device hangs off); empty when the real path has none (a device
    /// outside `ROOT/devices/pci*`). Below an Intel VMD endpoint a second host bridge is
    /// nested (`pci0000:00/0000:00:0e.0/pci10000:00/...`); it is not kept here, so devices
    /// inside and outside the VMD domain of one root complex share this bridge.
    pub host_bridge: String,
    /// Every BDF-shaped component below the innermost host bridge, ending with the device
    /// itself (for VMD: from the root port in domain `10000` down; the VMD endpoint above the
    /// nested bridge is no switch of the device's).
    pub chain: Vec<PciAddr>,
}

/// `pciDDDD:BB` with a hex domain of 4 to 8 digits and a 2-digit bus.
fn is_host_bridge(name: &str) -> bool {
    let Some((domain, bus)) = name.strip_prefix("pci").and_then(|r| r.split_once(':')) else {
        return false;
    };
    let hex = |s: &str, min, max| {
        (min..=max).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    hex(domain, 4, 8) && hex(bus, 2, 2)
}

impl PciPath {
    /// From a device's real path, relative to `ROOT/devices` (or absolute when it lies
    /// elsewhere): the first `pciDDDD:BB` component is the host bridge, the BDF-shaped
    /// components below the last such component are the chain. A nested host bridge (Intel
    /// VMD) starts the chain afresh: as in NCCL's walk, where a component that is not
    /// BDF-shaped is a CPU node, nothing above it is a PCIe switch of the device. Without a
    /// host bridge the chain is every BDF-shaped component and `host_bridge` is empty.
    pub fn from_real_path(rel: &Path) -> PciPath {
        let mut path = PciPath::default();
        for part in rel.components() {
            let Some(name) = part.as_os_str().to_str() else {
                continue;
            };
            if is_host_bridge(name) {
                if path.host_bridge.is_empty() {
                    path.host_bridge = name.to_owned();
                }
                path.chain.clear();
            } else if let Some(addr) = parse_sysfs_name(name) {
                path.chain.push(addr);
            }
        }
        path
    }

    /// The device itself (the last component of the chain).
    pub fn device(&self) -> Option<PciAddr> {
        self.chain.last().copied()
    }

    /// The PCIe switches above the device, nearest first, as NCCL's topology walk finds
    /// them: it climbs two path components per level (skipping the switch's downstream
    /// port), so with the device at `chain[n-1]` the switch nodes are the upstream ports
    /// `chain[n-3]`, `chain[n-5]`, ... A device right under a root port has none: it hangs
    /// off the CPU.
    pub fn switches(&self) -> Vec<PciAddr> {
        let n = self.chain.len();
        (3..=n).step_by(2).map(|k| self.chain[n - k]).collect()
    }
}

impl fmt::Display for PciPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = if self.host_bridge.is_empty() {
            "?"
        } else {
            &self.host_bridge
        };
        f.write_str(host)?;
        for addr in &self.chain {
            write!(f, "/{addr}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<PciAddr> {
        list.iter().map(|s| s.parse().expect("valid BDF")).collect()
    }

    #[test]
    fn reads_host_bridge_and_chain() {
        let rel =
            Path::new("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0/net/eth1");
        let p = PciPath::from_real_path(rel);
        assert_eq!(p.host_bridge, "pci0000:00");
        assert_eq!(
            p.chain,
            addrs(&[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:01.0",
                "0000:04:00.0"
            ])
        );
        assert_eq!(p.device(), "0000:04:00.0".parse().ok());
        assert_eq!(p.switches(), addrs(&["0000:01:00.0"]));
        assert_eq!(
            p.to_string(),
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0"
        );
    }

    #[test]
    fn switches_skip_downstream_ports() {
        let deep = PciPath {
            host_bridge: "pci0000:00".into(),
            chain: addrs(&[
                "0000:00:01.0", // root port
                "0000:01:00.0", // top switch upstream
                "0000:02:00.0", // top switch downstream
                "0000:03:00.0", // leaf switch upstream
                "0000:04:00.0", // leaf switch downstream
                "0000:05:00.0", // device
            ]),
        };
        assert_eq!(deep.switches(), addrs(&["0000:03:00.0", "0000:01:00.0"]));
        let direct = PciPath {
            host_bridge: "pci0000:00".into(),
            chain: addrs(&["0000:00:03.0", "0000:20:00.0"]),
        };
        assert_eq!(direct.switches(), vec![]);
        assert_eq!(PciPath::default().switches(), vec![]);
    }

    #[test]
    fn vmd_and_odd_paths() {
        // VMD: a second host bridge nested below the first; the outer one names the CPU,
        // the chain starts below the inner one (the VMD endpoint 0000:00:0e.0 is no switch).
        let p = PciPath::from_real_path(Path::new(
            "pci0000:00/0000:00:0e.0/pci10000:00/10000:00:02.0/10000:01:00.0",
        ));
        assert_eq!(p.host_bridge, "pci0000:00");
        assert_eq!(p.chain, addrs(&["10000:00:02.0", "10000:01:00.0"]));
        assert_eq!(p.switches(), vec![]);
        let none = PciPath::from_real_path(Path::new("/elsewhere/0000:05:00.0"));
        assert_eq!(none.host_bridge, "");
        assert_eq!(none.to_string(), "?/0000:05:00.0");
        assert!(!is_host_bridge("pci0000"));
        assert!(!is_host_bridge("pci000:00"));
        assert!(is_host_bridge("pci0001:80"));
    }

    #[test]
    fn a_switch_inside_vmd_is_kept_and_the_vmd_endpoint_is_not_one() {
        // Root port 10000:00:04.0 > switch 10000:03:00.0 > port 10000:04:00.0 > device.
        // Before, the chain began at the VMD endpoint 0000:00:0e.0, which came out as a
        // second, outer switch shared with every device in the VMD domain.
        let p = PciPath::from_real_path(Path::new(
            "pci0000:00/0000:00:0e.0/pci10000:00/10000:00:04.0/10000:03:00.0/10000:04:00.0/\
             10000:05:00.0/net/eth9",
        ));
        assert_eq!(p.host_bridge, "pci0000:00");
        assert_eq!(p.switches(), addrs(&["10000:03:00.0"]));
        assert_eq!(
            p.to_string(),
            "pci0000:00/10000:00:04.0/10000:03:00.0/10000:04:00.0/10000:05:00.0"
        );
    }
}
