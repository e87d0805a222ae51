//! PCIe distance between a GPU and a NIC, classified as NCCL does (`src/graph/paths.cc`,
//! path types PIX/PXB/PHB/SYS), with a one-line reason.
//!
//! Switches are found as NCCL's topology walk finds them (see [`PciPath::switches`]).
//! Not done: NCCL's flattening of Broadcom PEX two-level switches into one switch
//! (`ncclTopoFlattenBcmSwitches`), so a GPU and a NIC in sibling leaf switches of such a
//! part are PXB here where NCCL may say PIX; the pairing still prefers the leaf's own NIC.
//! NVML's NODE (across host bridges of one NUMA node) is PHB, as in NCCL.

use std::fmt;

use serde::Serialize;

use crate::path::PciPath;

/// How far apart two PCI devices are, nearest first (the derived order is the ranking).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Distance {
    /// Through at most one PCIe switch: GPU-direct at full speed.
    Pix,
    /// Through several PCIe switches, no host bridge: GPU-direct works.
    Pxb,
    /// Through a host bridge / the CPU of one socket: works, peer reads are slow.
    Phb,
    /// Across NUMA nodes (sockets, or the SNC/NPS domains of one socket), or unknown: slow or
    /// unreliable; NCCL does not use GPU-direct.
    Sys,
}

impl Distance {
    /// NCCL's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Distance::Pix => "PIX",
            Distance::Pxb => "PXB",
            Distance::Phb => "PHB",
            Distance::Sys => "SYS",
        }
    }

    /// Traffic at this distance goes through a CPU: worth a warning.
    pub fn crosses_cpu(self) -> bool {
        self >= Distance::Phb
    }
}

impl fmt::Display for Distance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A classification and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Classified {
    /// The distance.
    pub distance: Distance,
    /// One line, e.g. `same PCIe switch 0000:01:00.0`.
    pub why: String,
}

/// Classifies the PCIe path between a GPU and a NIC from their PCI paths and NUMA nodes.
///
/// With a PCIe switch in common: PIX when it is the nearest switch of both (the path
/// crosses one switch), else PXB. Without: PHB when both hang off one CPU (same host
/// bridge, or host bridges on the same known NUMA node), else SYS (different NUMA nodes,
/// or different host bridges with a NUMA node unknown). Different NUMA nodes are not always
/// different sockets (Intel SNC, AMD NPS split one socket into several), and the NUMA ids
/// alone do not tell which, so the reason names both. Switch addresses carry their PCI
/// domain, so devices in different domains never share a switch. Behind an Intel VMD
/// endpoint the paths start below the nested host bridge and keep the outer one
/// ([`PciPath::from_real_path`]): two devices in a VMD domain without a switch in common are
/// PHB through that outer bridge, never PIX or PXB through the VMD endpoint.
pub fn classify(
    gpu: &PciPath,
    gpu_numa: Option<u32>,
    nic: &PciPath,
    nic_numa: Option<u32>,
) -> Classified {
    let (gs, ns) = (gpu.switches(), nic.switches());
    // The lowest common switch, by its position on each side (0 = the nearest switch).
    let common = gs
        .iter()
        .enumerate()
        .find_map(|(i, s)| ns.iter().position(|t| t == s).map(|j| (i, j, *s)));
    if let Some((i, j, switch)) = common {
        return if i == 0 && j == 0 {
            classified(Distance::Pix, format!("same PCIe switch {switch}"))
        } else {
            let crossed = i + j + 1;
            classified(
                Distance::Pxb,
                format!("{crossed} PCIe switches, no host bridge"),
            )
        };
    }
    let same_bridge = !gpu.host_bridge.is_empty() && gpu.host_bridge == nic.host_bridge;
    if same_bridge {
        let numa = gpu_numa
            .or(nic_numa)
            .map_or(String::new(), |n| format!(" (NUMA {n})"));
        let why = format!("through host bridge {}{numa}", gpu.host_bridge);
        return classified(Distance::Phb, why);
    }
    let bridges = format!(
        "{} and {}",
        or_unknown(&gpu.host_bridge),
        or_unknown(&nic.host_bridge)
    );
    match (gpu_numa, nic_numa) {
        (Some(g), Some(n)) if g == n => classified(
            Distance::Phb,
            format!("through the CPU of NUMA {g}: host bridges {bridges}"),
        ),
        (Some(g), Some(n)) => classified(
            Distance::Sys,
            format!("across sockets or SNC/NPS domains: GPU on NUMA {g}, NIC on NUMA {n}"),
        ),
        _ => classified(
            Distance::Sys,
            format!("host bridges {bridges}, NUMA node unknown"),
        ),
    }
}

fn classified(distance: Distance, why: String) -> Classified {
    Classified { distance, why }
}

fn or_unknown(host_bridge: &str) -> &str {
    if host_bridge.is_empty() {
        "?"
    } else {
        host_bridge
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path under `host` whose chain is the given BDFs.
    fn path(host: &str, chain: &[&str]) -> PciPath {
        PciPath {
            host_bridge: host.to_owned(),
            chain: chain
                .iter()
                .map(|s| s.parse().expect("valid BDF"))
                .collect(),
        }
    }

    /// Root port 00:01.0 > top switch 01:00.0 > {leaf switch 03:00.0 > {GPU 05, NIC 06},
    /// leaf switch 07:00.0 > NIC 0a}, NIC 0b right under the top switch.
    fn gpu() -> PciPath {
        path(
            "pci0000:00",
            &[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:00.0",
                "0000:03:00.0",
                "0000:04:00.0",
                "0000:05:00.0",
            ],
        )
    }

    #[test]
    fn same_leaf_switch_is_pix() {
        let nic = path(
            "pci0000:00",
            &[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:00.0",
                "0000:03:00.0",
                "0000:04:01.0",
                "0000:06:00.0",
            ],
        );
        let c = classify(&gpu(), Some(0), &nic, Some(0));
        assert_eq!(c.distance, Distance::Pix);
        assert_eq!(c.why, "same PCIe switch 0000:03:00.0");
    }

    #[test]
    fn sibling_switches_and_parent_switch_are_pxb() {
        let sibling = path(
            "pci0000:00",
            &[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:01.0",
                "0000:07:00.0",
                "0000:08:00.0",
                "0000:0a:00.0",
            ],
        );
        let c = classify(&gpu(), Some(0), &sibling, Some(0));
        assert_eq!(
            (c.distance, c.why.as_str()),
            (Distance::Pxb, "3 PCIe switches, no host bridge")
        );
        let under_top = path(
            "pci0000:00",
            &[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:02.0",
                "0000:0b:00.0",
            ],
        );
        let c = classify(&gpu(), Some(0), &under_top, Some(0));
        assert_eq!(
            (c.distance, c.why.as_str()),
            (Distance::Pxb, "2 PCIe switches, no host bridge")
        );
    }

    #[test]
    fn same_host_bridge_without_common_switch_is_phb() {
        let other_port = path(
            "pci0000:00",
            &[
                "0000:00:02.0",
                "0000:10:00.0",
                "0000:11:00.0",
                "0000:12:00.0",
            ],
        );
        let c = classify(&gpu(), Some(0), &other_port, Some(0));
        assert_eq!(
            (c.distance, c.why.as_str()),
            (Distance::Phb, "through host bridge pci0000:00 (NUMA 0)")
        );
        // Right under a root port of the same host bridge: hangs off the CPU.
        let direct = path("pci0000:00", &["0000:00:03.0", "0000:20:00.0"]);
        let c = classify(&gpu(), None, &direct, None);
        assert_eq!(
            (c.distance, c.why.as_str()),
            (Distance::Phb, "through host bridge pci0000:00")
        );
    }

    #[test]
    fn host_bridges_of_one_numa_node_are_phb() {
        let nic = path("pci0000:40", &["0000:40:01.0", "0000:41:00.0"]);
        let c = classify(&gpu(), Some(0), &nic, Some(0));
        assert_eq!(c.distance, Distance::Phb);
        assert_eq!(
            c.why,
            "through the CPU of NUMA 0: host bridges pci0000:00 and pci0000:40"
        );
    }

    #[test]
    fn other_socket_or_unknown_numa_is_sys() {
        let nic = path(
            "pci0000:80",
            &[
                "0000:80:01.0",
                "0000:81:00.0",
                "0000:82:00.0",
                "0000:83:00.0",
            ],
        );
        let c = classify(&gpu(), Some(0), &nic, Some(1));
        assert_eq!(
            (c.distance, c.why.as_str()),
            (
                Distance::Sys,
                "across sockets or SNC/NPS domains: GPU on NUMA 0, NIC on NUMA 1"
            )
        );
        for (g, n) in [(None, Some(1)), (Some(0), None), (None, None)] {
            let c = classify(&gpu(), g, &nic, n);
            assert_eq!(c.distance, Distance::Sys);
            assert_eq!(
                c.why,
                "host bridges pci0000:00 and pci0000:80, NUMA node unknown"
            );
        }
    }

    #[test]
    fn domains_never_share_a_switch() {
        // Same bus numbers in domains 0 and 1: the "switches" 0000:15:00.0 and 0001:15:00.0
        // are different parts.
        let g = path(
            "pci0001:00",
            &[
                "0001:00:01.0",
                "0001:15:00.0",
                "0001:16:00.0",
                "0001:17:00.0",
            ],
        );
        let own = path(
            "pci0001:00",
            &[
                "0001:00:01.0",
                "0001:15:00.0",
                "0001:16:01.0",
                "0001:18:00.0",
            ],
        );
        let other = path(
            "pci0000:00",
            &[
                "0000:00:01.0",
                "0000:15:00.0",
                "0000:16:01.0",
                "0000:18:00.0",
            ],
        );
        assert_eq!(classify(&g, Some(0), &own, Some(0)).distance, Distance::Pix);
        let c = classify(&g, Some(0), &other, Some(0));
        assert_eq!(c.distance, Distance::Phb);
        assert_eq!(
            c.why,
            "through the CPU of NUMA 0: host bridges pci0001:00 and pci0000:00"
        );
        assert_eq!(classify(&g, None, &other, None).distance, Distance::Sys);
    }

    #[test]
    fn empty_host_bridges_are_not_the_same_bridge() {
        let a = path("", &["0000:05:00.0"]);
        let b = path("", &["0000:06:00.0"]);
        let c = classify(&a, None, &b, None);
        assert_eq!(
            (c.distance, c.why.as_str()),
            (Distance::Sys, "host bridges ? and ?, NUMA node unknown")
        );
    }

    #[test]
    fn devices_behind_vmd_meet_at_the_host_bridge_not_the_vmd_endpoint() {
        // Before, the VMD endpoint 0000:00:0e.0 above the nested host bridge pci10000:00 was
        // taken for a PCIe switch: PIX for two devices under different VMD root ports, PXB
        // for one of them and a device behind a switch inside VMD.
        let real = |p: &str| PciPath::from_real_path(std::path::Path::new(p));
        let vmd = "pci0000:00/0000:00:0e.0/pci10000:00";
        let g = real(&format!("{vmd}/10000:00:02.0/10000:01:00.0"));
        let nic = real(&format!("{vmd}/10000:00:03.0/10000:02:00.0"));
        let behind_switch = real(&format!(
            "{vmd}/10000:00:04.0/10000:03:00.0/10000:04:00.0/10000:05:00.0"
        ));
        let phb = (
            Distance::Phb,
            "through host bridge pci0000:00 (NUMA 0)".to_owned(),
        );
        for other in [&nic, &behind_switch] {
            let c = classify(&g, Some(0), other, Some(0));
            assert_eq!((c.distance, c.why), phb, "{other}");
        }
        // A device outside the VMD domain, on the same root complex: PHB too.
        let outside = path("pci0000:00", &["0000:00:01.0", "0000:01:00.0"]);
        let c = classify(&behind_switch, Some(0), &outside, Some(0));
        assert_eq!((c.distance, c.why), phb);
    }

    #[test]
    fn order_and_names() {
        assert!(
            Distance::Pix < Distance::Pxb
                && Distance::Pxb < Distance::Phb
                && Distance::Phb < Distance::Sys
        );
        let names: Vec<String> = [Distance::Pix, Distance::Pxb, Distance::Phb, Distance::Sys]
            .iter()
            .map(|d| serde_json::to_string(d).expect("serialize"))
            .collect();
        assert_eq!(names, ["\"PIX\"", "\"PXB\"", "\"PHB\"", "\"SYS\""]);
        assert_eq!(Distance::Phb.to_string(), "PHB");
        assert!(!Distance::Pxb.crosses_cpu() && Distance::Phb.crosses_cpu());
    }
}
