//! The plain-text report of `shardwire topology`: GPUs, NICs and lanes as aligned tables,
//! lanes that deserve a warning marked with `!`.

use std::fmt::Write as _;

use crate::pair::{LanePlan, passed_over};
use crate::values::{format_ranges, hex16};
use crate::{Distance, Topology};

/// `-` for a missing value.
fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// `vendor:device` without `0x`, or `-`.
fn ids(vendor: Option<u16>, device: Option<u16>) -> String {
    match (vendor, device) {
        (None, None) => "-".to_owned(),
        (v, d) => {
            let part =
                |id: Option<u16>| id.map_or_else(|| "?".to_owned(), |i| hex16(i)[2..].to_owned());
            format!("{}:{}", part(v), part(d))
        }
    }
}

/// Appends `rows` under `header`, columns padded to their widest cell and separated by
/// two spaces, each line indented by two.
fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::from(" ");
        for (w, cell) in widths.iter().zip(row) {
            let _ = write!(line, " {cell:<w$} ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// The topology as text for a terminal.
pub fn render_text(topo: &Topology) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "GPUs: {}", topo.gpus.len());
    let uuids = topo.gpus.iter().any(|g| g.uuid.is_some());
    let gpus: Vec<Vec<String>> = topo
        .gpus
        .iter()
        .map(|g| {
            let mut row = vec![g.pci.to_string()];
            if uuids {
                row.push(or_dash(g.uuid));
            }
            row.extend([
                or_dash(g.numa_node),
                ids(Some(g.vendor), g.device),
                g.path.to_string(),
            ]);
            row
        })
        .collect();
    if !gpus.is_empty() {
        let header: &[&str] = match uuids {
            true => &["PCI", "UUID", "NUMA", "ID", "PCIE PATH"],
            false => &["PCI", "NUMA", "ID", "PCIE PATH"],
        };
        table(&mut out, header, &gpus);
    }
    let _ = writeln!(out, "\nNICs: {}", topo.nics.len());
    let probed = topo.nics.iter().any(|n| n.devmem_capable.is_some());
    let nics: Vec<Vec<String>> = topo
        .nics
        .iter()
        .map(|n| {
            let mut row = vec![
                n.interface.clone(),
                or_dash(n.pci),
                or_dash(n.numa_node),
                n.rx_queues.to_string(),
                if n.is_virtual {
                    "virtual".to_owned()
                } else {
                    ids(n.vendor, n.device)
                },
            ];
            if probed {
                row.push(or_dash(
                    n.devmem_capable.map(|c| if c { "yes" } else { "no" }),
                ));
            }
            row.push(or_dash(n.path.as_ref()));
            row
        })
        .collect();
    if !nics.is_empty() {
        let header: &[&str] = match probed {
            true => &[
                "INTERFACE",
                "PCI",
                "NUMA",
                "RX",
                "ID",
                "DEVMEM",
                "PCIE PATH",
            ],
            false => &["INTERFACE", "PCI", "NUMA", "RX", "ID", "PCIE PATH"],
        };
        table(&mut out, header, &nics);
    }
    for n in topo.nics.iter().filter(|n| !n.is_virtual) {
        if let Some(why) = &n.unusable {
            let _ = writeln!(out, "  {} is not paired with any GPU: {why}", n.interface);
        } else if let Some(why) = passed_over(&topo.nics, n) {
            let _ = writeln!(out, "  {} is passed over: {why}", n.interface);
        }
    }
    render_lanes(&mut out, topo);
    out
}

fn render_lanes(out: &mut String, topo: &Topology) {
    if topo.lanes.is_empty() {
        // Lanes without a GPU are not listed. With GPUs in the tree, `auto` gives each one a
        // lane: none here means a lanes table that names no `gpu`.
        let why = match topo.gpus.is_empty() {
            true => "no GPU: host lanes only, one unless a lanes table lists more",
            false => "the lanes table names no gpu: its lanes are host lanes, not listed",
        };
        let _ = writeln!(out, "\nLanes: no GPU lane ({why})");
        return;
    }
    let _ = writeln!(out, "\nLanes: {}", topo.lanes.len());
    let addrs = topo.lanes.iter().any(|l| l.data_addr.is_some());
    let rows: Vec<Vec<String>> = topo
        .lanes
        .iter()
        .map(|l| {
            let queues = if l.queues.is_empty() {
                "-".to_owned()
            } else {
                format_ranges(&l.queues)
            };
            let mut row = vec![
                if l.warn { "!" } else { " " }.to_owned(),
                l.lane.to_string(),
                l.gpu.to_string(),
                or_dash(l.nic.as_deref()),
                or_dash(l.distance),
                or_dash(l.numa_node()),
                queues,
            ];
            if addrs {
                row.push(or_dash(l.data_addr.as_deref()));
            }
            row.push(l.why.clone());
            row
        })
        .collect();
    let header: &[&str] = match addrs {
        true => &[
            " ",
            "LANE",
            "GPU",
            "NIC",
            "DIST",
            "NUMA",
            "QUEUES",
            "DATA ADDR",
            "WHY",
        ],
        false => &[" ", "LANE", "GPU", "NIC", "DIST", "NUMA", "QUEUES", "WHY"],
    };
    table(out, header, &rows);
    if let Some(line) = warn_footer(&topo.lanes) {
        let _ = writeln!(out, "{line}");
    }
}

/// The line under the lanes that explains the `!` marks, counting each cause: a NIC through a
/// CPU, no NIC, or another reason the lane's WHY gives (its data address is not its NIC's, its
/// NIC is virtual or not in the tree, it has no devmem queue); `None` when no lane is
/// marked.
fn warn_footer(lanes: &[LanePlan]) -> Option<String> {
    let warned: Vec<&LanePlan> = lanes.iter().filter(|l| l.warn).collect();
    if warned.is_empty() {
        return None;
    }
    let cross = warned
        .iter()
        .filter(|l| l.distance.is_some_and(Distance::crosses_cpu))
        .count();
    let no_nic = warned
        .iter()
        .filter(|l| l.nic.is_none() && !l.distance.is_some_and(Distance::crosses_cpu))
        .count();
    let other = warned.len() - cross - no_nic;
    let parts: Vec<String> = [
        (cross, "cross a CPU (PHB/SYS)"),
        (no_nic, "have no NIC"),
        (
            other,
            "see WHY (a data address not the NIC's, a virtual or unknown NIC, or no devmem \
             queue)",
        ),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    Some(format!(
        "! {} lane(s) marked: {}: GPU-direct receive there is slow or unavailable",
        warned.len(),
        parts.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Gpu, Nic, PairOptions, PciPath, Tree};

    fn topo(with_nic: bool) -> Topology {
        let path = |chain: &[&str]| PciPath {
            host_bridge: "pci0000:00".to_owned(),
            chain: chain
                .iter()
                .map(|s| s.parse().expect("valid BDF"))
                .collect(),
        };
        let gpu = Gpu {
            pci: "0000:03:00.0".parse().expect("valid BDF"),
            uuid: None,
            numa_node: Some(0),
            vendor: 0x10de,
            device: Some(0x2330),
            local_cpulist: vec![0, 1],
            path: path(&[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:00.0",
                "0000:03:00.0",
            ]),
        };
        let eth = Nic {
            interface: "eth1".to_owned(),
            pci: Some("0000:04:00.0".parse().expect("valid BDF")),
            numa_node: Some(0),
            is_virtual: false,
            rx_queues: 16,
            devmem_capable: None,
            vendor: Some(0x15b3),
            device: Some(0x1021),
            local_cpulist: vec![0, 1],
            path: Some(path(&[
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:01.0",
                "0000:04:00.0",
            ])),
            unusable: None,
            speed_mbps: None,
            link_up: None,
            sriov_vf: false,
        };
        let lo = Nic {
            interface: "lo".to_owned(),
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
        };
        let nics = if with_nic { vec![eth, lo] } else { vec![lo] };
        let tree = Tree {
            gpus: vec![gpu],
            nics,
            ..Tree::default()
        };
        Topology::from_tree(&tree, &PairOptions::default())
    }

    #[test]
    fn tables_align_and_mark_warnings() {
        let text = render_text(&topo(true));
        let want = "\
GPUs: 1
  PCI           NUMA  ID         PCIE PATH
  0000:03:00.0  0     10de:2330  pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0

NICs: 2
  INTERFACE  PCI           NUMA  RX  ID         PCIE PATH
  eth1       0000:04:00.0  0     16  15b3:1021  pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0
  lo         -             -     1   virtual    -

Lanes: 1
     LANE  GPU           NIC   DIST  NUMA  QUEUES  WHY
     0     0000:03:00.0  eth1  PIX   0     8-15    same PCIe switch 0000:01:00.0
";
        assert_eq!(text, want);
        let text = render_text(&topo(false));
        assert!(
            text.contains("\n  !  0     0000:03:00.0  -    -     0     -       no physical NIC"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "\n! 1 lane(s) marked: 1 have no NIC: GPU-direct receive there is slow or \
                 unavailable\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn the_warning_line_counts_each_cause() {
        // A PIX lane marked for another reason (its data address is not its NIC's): the line
        // said every marked lane crossed a CPU or had no NIC.
        let mut t = topo(true);
        t.lanes[0].warn = true;
        t.lanes[0].why.push_str("; not an address of eth1");
        let crossing = LanePlan {
            lane: 1,
            distance: Some(Distance::Sys),
            ..t.lanes[0].clone()
        };
        let no_nic = LanePlan {
            lane: 2,
            nic: None,
            nic_pci: None,
            distance: None,
            ..t.lanes[0].clone()
        };
        t.lanes.extend([crossing, no_nic]);
        let text = render_text(&t);
        assert!(
            text.contains(
                "! 3 lane(s) marked: 1 cross a CPU (PHB/SYS), 1 have no NIC, 1 see WHY (a data \
                 address not the NIC's, a virtual or unknown NIC, or no devmem queue): "
            ),
            "{text}"
        );
        t.lanes.truncate(1);
        let text = render_text(&t);
        assert!(text.contains("\n! 1 lane(s) marked: 1 see WHY ("), "{text}");
        assert!(!text.contains("cross a CPU"), "{text}");
    }

    #[test]
    fn no_gpu_says_the_host_lane_stays() {
        let text = render_text(&Topology::from_tree(
            &Tree::default(),
            &PairOptions::default(),
        ));
        assert_eq!(
            text,
            "GPUs: 0\n\nNICs: 0\n\nLanes: no GPU lane (no GPU: host lanes only, one unless a \
             lanes table lists more)\n"
        );
        // GPUs, but no lane with one (a lanes table naming no gpu): it said "no GPU".
        let mut t = topo(true);
        t.lanes.clear();
        let text = render_text(&t);
        assert!(
            text.ends_with(
                "\nLanes: no GPU lane (the lanes table names no gpu: its lanes are host lanes, \
                 not listed)\n"
            ),
            "{text}"
        );
        assert!(text.starts_with("GPUs: 1\n"), "{text}");
    }
}
