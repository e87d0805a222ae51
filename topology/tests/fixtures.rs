//! Discovery and pairing on the fake sysfs trees of `tests/fixtures/sysfs/` (written by its
//! `generate.py`): the exact GPUs, NICs and lanes of each, and that a tree copied elsewhere
//! reads the same (its symlinks are relative).

use std::fs;
use std::path::{Path, PathBuf};

use shardwire_topology::{Distance, PairOptions, Topology, Tree, classify, pair, render_text};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/sysfs")
        .join(name)
}

fn read(name: &str) -> Tree {
    Tree::read(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn opts(names: &[&str]) -> PairOptions {
    PairOptions {
        include_virtual: names.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// (pci, numa, device id)
fn gpus(tree: &Tree) -> Vec<(String, Option<u32>, Option<u16>)> {
    tree.gpus
        .iter()
        .map(|g| (g.pci.to_string(), g.numa_node, g.device))
        .collect()
}

/// A NIC as (interface, pci, virtual, rx queues, numa).
type NicRow = (String, Option<String>, bool, u32, Option<u32>);

fn nics(tree: &Tree) -> Vec<NicRow> {
    tree.nics
        .iter()
        .map(|n| {
            let pci = n.pci.map(|p| p.to_string());
            (
                n.interface.clone(),
                pci,
                n.is_virtual,
                n.rx_queues,
                n.numa_node,
            )
        })
        .collect()
}

/// A lane as (gpu, nic, distance, queues, warn).
type Lane = (String, Option<String>, Option<Distance>, Vec<u32>, bool);

fn lanes(tree: &Tree, opts: &PairOptions) -> Vec<Lane> {
    pair(tree, opts)
        .iter()
        .map(|l| {
            (
                l.gpu.to_string(),
                l.nic.clone(),
                l.distance,
                l.queues.clone(),
                l.warn,
            )
        })
        .collect()
}

fn lane(gpu: &str, nic: Option<&str>, d: Option<Distance>, q: &[u32], warn: bool) -> Lane {
    (gpu.to_owned(), nic.map(str::to_owned), d, q.to_vec(), warn)
}

fn nic(name: &str, pci: Option<&str>, rx: u32, numa: Option<u32>) -> NicRow {
    (
        name.to_owned(),
        pci.map(str::to_owned),
        pci.is_none(),
        rx,
        numa,
    )
}

fn gpu(pci: &str, numa: u32, device: u16) -> (String, Option<u32>, Option<u16>) {
    (pci.to_owned(), Some(numa), Some(device))
}

/// Copies `from` to `to` keeping symlinks as they are; each must be relative.
fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("mkdir");
    for entry in fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type().expect("file type");
        if kind.is_symlink() {
            let target = fs::read_link(&src).expect("read_link");
            assert!(
                target.is_relative(),
                "{} -> {}",
                src.display(),
                target.display()
            );
            std::os::unix::fs::symlink(target, &dst).expect("symlink");
        } else if kind.is_dir() {
            copy_tree(&src, &dst);
        } else {
            fs::copy(&src, &dst).expect("copy");
        }
    }
}

/// Every symlink under `dir` resolves to something inside `top`.
fn assert_links_stay_inside(dir: &Path, top: &Path) {
    for entry in fs::read_dir(dir).expect("read_dir") {
        let entry = entry.expect("entry");
        let kind = entry.file_type().expect("file type");
        if kind.is_symlink() {
            let real = fs::canonicalize(entry.path()).expect("link resolves");
            assert!(
                real.starts_with(top),
                "{} leaves the tree",
                entry.path().display()
            );
        } else if kind.is_dir() {
            assert_links_stay_inside(&entry.path(), top);
        }
    }
}

/// The tree copied into cargo's temp dir reads the same as in place.
fn assert_relocates(name: &str) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("topology-{}", std::process::id()))
        .join(name);
    let _ = fs::remove_dir_all(&dir);
    copy_tree(&fixture(name), &dir);
    let top = dir.canonicalize().expect("copy root");
    assert_links_stay_inside(&top, &top);
    let moved = Tree::read(&dir).expect("read the copy");
    let _ = fs::remove_dir_all(&dir);
    assert_eq!(moved, read(name), "{name} reads differently when moved");
}

#[test]
fn a3_8gpu_8nic_pairs_each_gpu_with_its_leaf_switch_nic() {
    let tree = read("a3-8gpu-8nic");
    let bus = ["05", "09", "14", "18", "85", "89", "94", "98"];
    let want_gpus: Vec<_> = bus
        .iter()
        .enumerate()
        .map(|(i, b)| gpu(&format!("0000:{b}:00.0"), u32::from(i >= 4), 0x2330))
        .collect();
    assert_eq!(
        gpus(&tree),
        want_gpus,
        "the NVSwitch is NVIDIA but not a GPU"
    );
    let nic_bus = ["06", "0a", "15", "19", "86", "8a", "95", "99"];
    let mut want_nics: Vec<_> = nic_bus
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (name, pci) = (format!("eth{}", i + 1), format!("0000:{b}:00.0"));
            nic(&name, Some(&pci), 16, Some(u32::from(i >= 4)))
        })
        .collect();
    // The host NIC (bus 20) sorts after eth4 (bus 19).
    want_nics.insert(4, nic("eth0", Some("0000:20:00.0"), 8, Some(0)));
    want_nics.push(nic("lo", None, 1, None));
    assert_eq!(nics(&tree), want_nics);
    let q: Vec<u32> = (8..16).collect();
    let want: Vec<Lane> = bus
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let nic = format!("eth{}", i + 1);
            lane(
                &format!("0000:{b}:00.0"),
                Some(&nic),
                Some(Distance::Pix),
                &q,
                false,
            )
        })
        .collect();
    assert_eq!(lanes(&tree, &PairOptions::default()), want);
    let plans = pair(&tree, &PairOptions::default());
    assert_eq!(plans[0].why, "same PCIe switch 0000:03:00.0");
    assert_eq!(plans[5].numa_node(), Some(1));
    assert_eq!(tree.cpus_of_node(1).len(), 104);
    assert_eq!(tree.gpus[0].local_cpulist, tree.cpus_of_node(0));
    assert_relocates("a3-8gpu-8nic");
}

#[test]
fn a3_tree_has_every_distance_class() {
    let tree = read("a3-8gpu-8nic");
    let g = &tree.gpus[0]; // 0000:05:00.0, leaf switch 03:00.0 under top switch 01:00.0
    let by_name = |n: &str| {
        let nic = tree.nics.iter().find(|x| x.interface == n).expect("nic");
        let c = classify(
            &g.path,
            g.numa_node,
            nic.path.as_ref().expect("physical"),
            nic.numa_node,
        );
        (c.distance, c.why)
    };
    let s = |d, w: &str| (d, w.to_owned());
    assert_eq!(
        by_name("eth1"),
        s(Distance::Pix, "same PCIe switch 0000:03:00.0")
    );
    assert_eq!(
        by_name("eth2"),
        s(Distance::Pxb, "3 PCIe switches, no host bridge")
    );
    assert_eq!(
        by_name("eth3"),
        s(Distance::Phb, "through host bridge pci0000:00 (NUMA 0)")
    );
    assert_eq!(
        by_name("eth0"),
        s(Distance::Phb, "through host bridge pci0000:00 (NUMA 0)")
    );
    assert_eq!(
        by_name("eth5"),
        s(
            Distance::Sys,
            "across sockets or SNC/NPS domains: GPU on NUMA 0, NIC on NUMA 1"
        )
    );
    let path = g.path.to_string();
    assert_eq!(
        path,
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0/0000:04:00.0/0000:05:00.0"
    );
}

#[test]
fn gpu8_nic4_shares_each_nic_between_two_gpus() {
    let tree = read("8gpu-4nic");
    let bus = ["04", "05", "0a", "0b", "84", "85", "8a", "8b"];
    let want_gpus: Vec<_> = bus
        .iter()
        .enumerate()
        .map(|(i, b)| gpu(&format!("0000:{b}:00.0"), u32::from(i >= 4), 0x2330))
        .collect();
    assert_eq!(gpus(&tree), want_gpus, "the ASPEED VGA is not NVIDIA");
    let want_nics = vec![
        nic("eth1", Some("0000:06:00.0"), 16, Some(0)),
        nic("eth2", Some("0000:0c:00.0"), 16, Some(0)),
        nic("eth0", Some("0000:10:00.0"), 8, Some(0)),
        nic("eth3", Some("0000:86:00.0"), 16, Some(1)),
        nic("eth4", Some("0000:8c:00.0"), 16, Some(1)),
        nic("lo", None, 1, None),
    ];
    assert_eq!(nics(&tree), want_nics);
    let (lo, hi): (Vec<u32>, Vec<u32>) = ((8..12).collect(), (12..16).collect());
    let want: Vec<Lane> = bus
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let nic = format!("eth{}", i / 2 + 1);
            let q = if i % 2 == 0 { &lo } else { &hi };
            lane(
                &format!("0000:{b}:00.0"),
                Some(&nic),
                Some(Distance::Pix),
                q,
                false,
            )
        })
        .collect();
    assert_eq!(lanes(&tree, &PairOptions::default()), want);
    let plans = pair(&tree, &PairOptions::default());
    assert_eq!(
        plans[1].why,
        "same PCIe switch 0000:02:00.0; eth1 shared by 2 GPUs: queues 12-15 of 8-15"
    );
    assert_relocates("8gpu-4nic");
}

#[test]
fn cross_socket_is_sys_and_warns() {
    let tree = read("cross-socket");
    assert_eq!(gpus(&tree), [gpu("0000:03:00.0", 0, 0x2330)]);
    assert_eq!(
        nics(&tree),
        [
            nic("eth1", Some("0000:83:00.0"), 16, Some(1)),
            nic("lo", None, 1, None)
        ]
    );
    let q: Vec<u32> = (8..16).collect();
    assert_eq!(
        lanes(&tree, &PairOptions::default()),
        [lane(
            "0000:03:00.0",
            Some("eth1"),
            Some(Distance::Sys),
            &q,
            true
        )]
    );
    let plan = &pair(&tree, &PairOptions::default())[0];
    assert_eq!(
        plan.why,
        "across sockets or SNC/NPS domains: GPU on NUMA 0, NIC on NUMA 1"
    );
    assert_eq!(
        (plan.gpu_numa, plan.nic_numa, plan.numa_node()),
        (Some(0), Some(1), Some(1))
    );
    assert_relocates("cross-socket");
}

#[test]
fn two_domains_pair_within_the_gpus_domain() {
    let tree = read("two-domains");
    assert_eq!(gpus(&tree), [gpu("0001:17:00.0", 0, 0x2330)]);
    assert_eq!(
        nics(&tree),
        [
            nic("eth0", Some("0000:18:00.0"), 16, Some(0)),
            nic("eth1", Some("0001:18:00.0"), 16, Some(0)),
            nic("lo", None, 1, None),
        ]
    );
    let q: Vec<u32> = (8..16).collect();
    assert_eq!(
        lanes(&tree, &PairOptions::default()),
        [lane(
            "0001:17:00.0",
            Some("eth1"),
            Some(Distance::Pix),
            &q,
            false
        )]
    );
    assert_eq!(
        pair(&tree, &PairOptions::default())[0].why,
        "same PCIe switch 0001:15:00.0"
    );
    let (g, other) = (&tree.gpus[0], &tree.nics[0]);
    let c = classify(
        &g.path,
        g.numa_node,
        other.path.as_ref().expect("physical"),
        other.numa_node,
    );
    assert_eq!(
        c.distance,
        Distance::Phb,
        "same bus numbers, other domain: {}",
        c.why
    );
    assert_relocates("two-domains");
}

#[test]
fn veth_is_used_only_when_named_and_never_over_a_switch_nic() {
    let tree = read("veth");
    assert_eq!(gpus(&tree), [gpu("0000:03:00.0", 0, 0x2330)]);
    assert_eq!(
        nics(&tree),
        [
            nic("eth1", Some("0000:04:00.0"), 16, Some(0)),
            nic("lo", None, 1, None),
            nic("veth0", None, 1, None),
        ]
    );
    let q: Vec<u32> = (8..16).collect();
    let want = [lane(
        "0000:03:00.0",
        Some("eth1"),
        Some(Distance::Pix),
        &q,
        false,
    )];
    assert_eq!(lanes(&tree, &PairOptions::default()), want);
    assert_eq!(
        lanes(&tree, &opts(&["veth0"])),
        want,
        "PIX beats a named veth (SYS)"
    );
    // Without the physical NIC the named veth carries the lane.
    let mut no_eth = tree.clone();
    no_eth.nics.retain(|n| n.is_virtual);
    assert_eq!(
        lanes(&no_eth, &opts(&["veth0"])),
        [lane(
            "0000:03:00.0",
            Some("veth0"),
            Some(Distance::Sys),
            &[0],
            true
        )]
    );
    assert_eq!(
        lanes(&no_eth, &PairOptions::default()),
        [lane("0000:03:00.0", None, None, &[], true)]
    );
    assert_relocates("veth");
}

#[test]
fn gpu_no_nic_lanes_have_no_nic_and_warn() {
    let tree = read("gpu-no-nic");
    assert_eq!(
        gpus(&tree),
        [
            gpu("0000:03:00.0", 0, 0x2330),
            gpu("0000:04:00.0", 0, 0x26b1)
        ],
        "3D controller and VGA class both count"
    );
    assert_eq!(nics(&tree), [nic("lo", None, 1, None)]);
    assert_eq!(
        lanes(&tree, &PairOptions::default()),
        [
            lane("0000:03:00.0", None, None, &[], true),
            lane("0000:04:00.0", None, None, &[], true),
        ]
    );
    // Naming lo: both on it, SYS; its one queue goes to the first GPU.
    assert_eq!(
        lanes(&tree, &opts(&["lo"])),
        [
            lane("0000:03:00.0", Some("lo"), Some(Distance::Sys), &[0], true),
            lane("0000:04:00.0", Some("lo"), Some(Distance::Sys), &[], true),
        ]
    );
    let plans = pair(&tree, &opts(&["lo"]));
    assert!(
        plans[1]
            .why
            .ends_with("; no devmem queue left: lo has 1 for 2 GPUs (GPU 2 of 2)"),
        "{}",
        plans[1].why
    );
    assert_relocates("gpu-no-nic");
}

#[test]
fn phb_nic_under_another_root_port_warns() {
    let tree = read("phb");
    assert_eq!(gpus(&tree), [gpu("0000:03:00.0", 0, 0x2330)]);
    assert_eq!(
        nics(&tree),
        [
            nic("eth1", Some("0000:10:00.0"), 16, Some(0)),
            nic("lo", None, 1, None)
        ]
    );
    let q: Vec<u32> = (8..16).collect();
    assert_eq!(
        lanes(&tree, &PairOptions::default()),
        [lane(
            "0000:03:00.0",
            Some("eth1"),
            Some(Distance::Phb),
            &q,
            true
        )]
    );
    assert_eq!(
        pair(&tree, &PairOptions::default())[0].why,
        "through host bridge pci0000:00 (NUMA 0)"
    );
    assert_relocates("phb");
}

fn keys(v: &serde_json::Value) -> Vec<&str> {
    let mut k: Vec<&str> = v
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    k.sort_unstable();
    k
}

fn sorted(mut k: Vec<&str>) -> Vec<&str> {
    k.sort_unstable();
    k
}

#[test]
fn json_has_exactly_the_documented_keys() {
    let topo = Topology::discover(&fixture("veth"), &PairOptions::default()).expect("read");
    let json = serde_json::to_value(&topo).expect("serialize");
    assert_eq!(keys(&json), ["gpus", "lanes", "nics"]);
    let g = &json["gpus"][0];
    assert_eq!(
        keys(g),
        sorted(vec![
            "pci",
            "uuid",
            "numa_node",
            "vendor",
            "device",
            "local_cpulist",
            "path"
        ])
    );
    assert_eq!(keys(&g["path"]), ["chain", "host_bridge"]);
    let nic_keys = vec![
        "interface",
        "pci",
        "numa_node",
        "virtual",
        "rx_queues",
        "devmem_capable",
        "vendor",
        "device",
        "local_cpulist",
        "path",
        "speed_mbps",
        "link_up",
        "sriov_vf",
    ];
    for n in json["nics"].as_array().expect("nics") {
        assert_eq!(keys(n), sorted(nic_keys.clone()));
    }
    let l = &json["lanes"][0];
    let lane_keys = vec![
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
    assert_eq!(keys(l), sorted(lane_keys));
    let want = serde_json::json!({
        "gpu": {"pci": "0000:03:00.0", "uuid": null, "numa_node": 0, "vendor": "0x10de", "device": "0x2330",
                "local_cpulist": "0-7", "path": {"host_bridge": "pci0000:00",
                "chain": ["0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]}},
        "eth1": {"interface": "eth1", "pci": "0000:04:00.0", "numa_node": 0, "virtual": false,
                 "rx_queues": 16, "devmem_capable": null, "vendor": "0x15b3", "device": "0x1021", "local_cpulist": "0-7",
                 "path": {"host_bridge": "pci0000:00",
                          "chain": ["0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"]},
                 "speed_mbps": null, "link_up": true, "sriov_vf": false},
        "lo": {"interface": "lo", "pci": null, "numa_node": null, "virtual": true, "rx_queues": 1,
               "devmem_capable": null, "vendor": null, "device": null, "local_cpulist": "", "path": null,
               "speed_mbps": null, "link_up": true, "sriov_vf": false},
        "lane": {"lane": 0, "gpu": "0000:03:00.0", "nic": "eth1", "nic_pci": "0000:04:00.0",
                 "distance": "PIX", "numa_node": 0, "queues": [8, 9, 10, 11, 12, 13, 14, 15],
                 "data_addr": null, "why": "same PCIe switch 0000:01:00.0", "warn": false},
    });
    assert_eq!(g, &want["gpu"]);
    assert_eq!(json["nics"][0], want["eth1"]);
    assert_eq!(json["nics"][1], want["lo"]);
    assert_eq!(l, &want["lane"]);
}

#[test]
fn text_report_of_a_fixture() {
    let topo = Topology::discover(&fixture("cross-socket"), &PairOptions::default()).expect("read");
    let text = render_text(&topo);
    assert!(text.starts_with("GPUs: 1\n"), "{text}");
    assert!(text.contains("\nNICs: 2\n"), "{text}");
    assert!(
        text.contains("  !  0     0000:03:00.0  eth1  SYS   1     8-15    across sockets or SNC/NPS domains: GPU on NUMA 0, NIC on NUMA 1\n"),
        "{text}"
    );
    assert!(
        text.contains("! 1 lane(s) marked: 1 cross a CPU (PHB/SYS): "),
        "{text}"
    );
}

#[test]
fn an_infiniband_port_and_a_bond_slave_are_never_paired_and_say_why() {
    // The A3 tree with eth1 an InfiniBand port (ARPHRD 32, as a ConnectX in IB mode) and eth2
    // a slave of bond0: before, each was paired with its switch's GPU like any NIC, and the
    // lane's traffic went elsewhere (IB carries no TCP; a bond slave's goes through the bond).
    let tree = changed_tree("a3-8gpu-8nic", "unusable", |dir| {
        let net = dir.join("class/net");
        fs::write(net.join("eth1/type"), "32\n").unwrap();
        fs::write(net.join("eth2/type"), "1\n").unwrap();
        std::os::unix::fs::symlink("../../../../../virtual/net/bond0", net.join("eth2/master"))
            .unwrap();
    });
    let why = |name: &str| {
        tree.nics
            .iter()
            .find(|n| n.interface == name)
            .and_then(|n| n.unusable.clone())
    };
    assert!(
        why("eth1").is_some_and(|w| w.contains("ARPHRD type 32 (InfiniBand)")),
        "{:?}",
        why("eth1")
    );
    assert!(
        why("eth2").is_some_and(|w| w.contains("a port of bond0")),
        "{:?}",
        why("eth2")
    );
    assert_eq!(why("eth3"), None);
    let plans = pair(&tree, &PairOptions::default());
    assert_eq!(plans.len(), 8);
    for p in &plans {
        assert!(
            !matches!(p.nic.as_deref(), Some("eth1" | "eth2")),
            "{} paired with {:?}",
            p.gpu,
            p.nic
        );
    }
    // The other six GPUs keep their own switch's NIC.
    let own = plans
        .iter()
        .filter(|p| p.distance == Some(Distance::Pix))
        .count();
    assert_eq!(own, 6, "{plans:#?}");
}

#[test]
fn link_state_speed_virtual_functions_and_representors_are_read_and_used() {
    // The A3 tree (8 GPUs, each with its own PIX NIC eth1..eth8) with, as the kernel writes
    // them: eth1's link down (no carrier: uncabled), eth2 a virtual function (its device has a
    // `physfn` link), eth3 a representor of a VF (phys_port_name pf0vf3), eth4 at 400 Gb/s,
    // eth5 a speed of -1 (unknown), host NIC eth0 at 1 Gb/s.
    let tree = changed_tree("a3-8gpu-8nic", "links", |dir| {
        let net = dir.join("class/net");
        fs::write(net.join("eth1/operstate"), "down\n").unwrap();
        std::os::unix::fs::symlink("../0000:00:00.0", net.join("eth2/device/physfn")).unwrap();
        fs::write(net.join("eth3/phys_port_name"), "pf0vf3\n").unwrap();
        fs::write(net.join("eth4/speed"), "400000\n").unwrap();
        fs::write(net.join("eth5/speed"), "-1\n").unwrap();
        fs::write(net.join("eth0/speed"), "1000\n").unwrap();
    });
    let nic = |name: &str| tree.nics.iter().find(|n| n.interface == name).unwrap();
    assert_eq!(nic("eth1").link_up, Some(false));
    assert_eq!(nic("eth6").link_up, Some(true));
    assert!(nic("eth2").sriov_vf && !nic("eth6").sriov_vf);
    assert!(
        nic("eth3")
            .unusable
            .as_deref()
            .is_some_and(|w| w.contains("representor (phys_port_name pf0vf3)")),
        "{:?}",
        nic("eth3").unusable
    );
    assert_eq!(
        (nic("eth4").speed_mbps, nic("eth5").speed_mbps),
        (Some(400_000), None)
    );
    let why = |name: &str| shardwire_topology::passed_over(&tree.nics, nic(name));
    assert!(why("eth1").is_some_and(|w| w.contains("link is down")));
    assert!(why("eth0").is_some_and(|w| w.contains("1000 Mb/s, 1/400 of eth4's")));
    let plans = pair(&tree, &PairOptions::default());
    for p in &plans {
        assert!(
            !matches!(p.nic.as_deref(), Some("eth0" | "eth1" | "eth3")),
            "{} paired with {:?}",
            p.gpu,
            p.nic
        );
    }
    // The text report names the NICs passed over and why.
    let text =
        shardwire_topology::render_text(&Topology::from_tree(&tree, &PairOptions::default()));
    assert!(
        text.contains("  eth1 is passed over: its link is down"),
        "{text}"
    );
    assert!(
        text.contains("  eth3 is not paired with any GPU: a switchdev representor"),
        "{text}"
    );
}

#[test]
fn gpu_nics_down_at_boot_beside_an_up_host_nic_of_their_model_stay_candidates() {
    // GCP A3 High: the GPU NICs eth1..eth4 and the host NIC eth0 are all gVNIC (1ae0:0042).
    // With eth1..eth4 still down at start and eth0 up, each was passed over for eth0 ("the
    // same model"), and all 8 GPUs went to eth0 at PHB or SYS until a restart.
    fn down(names: &'static [&'static str]) -> impl FnOnce(&Path) {
        move |dir: &Path| {
            for name in names {
                let state = dir.join("class/net").join(name).join("operstate");
                fs::write(state, "down\n").unwrap();
            }
        }
    }
    fn nic(tree: &Tree, name: &str) -> Option<shardwire_topology::Nic> {
        tree.nics.iter().find(|n| n.interface == name).cloned()
    }
    let tree = changed_tree(
        "8gpu-4nic",
        "gvnic-down",
        down(&["eth1", "eth2", "eth3", "eth4"]),
    );
    let eth0 = nic(&tree, "eth0").unwrap();
    let eth1 = nic(&tree, "eth1").unwrap();
    assert_eq!((eth0.vendor, eth0.device), (Some(0x1ae0), Some(0x0042)));
    assert_eq!((eth1.vendor, eth1.device), (eth0.vendor, eth0.device));
    assert_eq!(eth1.link_up, Some(false));
    assert_eq!(shardwire_topology::passed_over(&tree.nics, &eth1), None);
    let plans = pair(&tree, &PairOptions::default());
    for (i, p) in plans.iter().enumerate() {
        let own = format!("eth{}", i / 2 + 1);
        assert_eq!(
            (p.nic.as_deref(), p.distance),
            (Some(own.as_str()), Some(Distance::Pix)),
            "{p:#?}"
        );
    }
    // One GPU NIC up first: the other three (below other switches than its) still stay
    // candidates; before, they too went to the NIC that was up.
    let tree = changed_tree("8gpu-4nic", "gvnic-one-up", down(&["eth2", "eth3", "eth4"]));
    let eth2 = nic(&tree, "eth2").unwrap();
    assert_eq!(shardwire_topology::passed_over(&tree.nics, &eth2), None);
    let nics: Vec<Option<String>> = pair(&tree, &PairOptions::default())
        .into_iter()
        .map(|p| p.nic)
        .collect();
    assert_eq!(nics[2].as_deref(), Some("eth2"), "{nics:?}");
    // The other socket's NICs still down while this socket's are up: they are below other
    // switches, so they stay candidates and keep their GPUs at PIX. Under the rule that
    // counted how many of the model were up (2 of 4: half), they were passed over and the
    // four GPUs of socket 1 went across the CPU to eth0..eth2 until a restart.
    let tree = changed_tree("8gpu-4nic", "gvnic-socket-down", down(&["eth3", "eth4"]));
    for (i, p) in pair(&tree, &PairOptions::default()).iter().enumerate() {
        let own = format!("eth{}", i / 2 + 1);
        assert_eq!(
            (p.nic.as_deref(), p.distance),
            (Some(own.as_str()), Some(Distance::Pix)),
            "{p:#?}"
        );
    }
}

#[test]
fn unknown_numa_nodes_on_a_host_of_one_node_are_that_node() {
    // Firmware without proximity information writes numa_node -1. On the two-domains host
    // (one NUMA node) the GPU and eth0 sit under different host bridges: with the node
    // unknown that read as SYS ("NUMA node unknown") and warned of crossing a CPU.
    let tree = changed_tree("two-domains", "numa", |dir| {
        for dev in ["0001:17:00.0", "0000:18:00.0"] {
            let numa = dir.join("bus/pci/devices").join(dev).join("numa_node");
            fs::write(fs::canonicalize(&numa).unwrap(), "-1\n").unwrap();
        }
    });
    let gpu = &tree.gpus[0];
    let eth0 = tree.nics.iter().find(|n| n.interface == "eth0").unwrap();
    assert_eq!((gpu.numa_node, eth0.numa_node), (Some(0), Some(0)));
    let c = shardwire_topology::classify(
        &gpu.path,
        gpu.numa_node,
        eth0.path.as_ref().unwrap(),
        eth0.numa_node,
    );
    assert_eq!(c.distance, Distance::Phb, "{}", c.why);
    let lo = tree.nics.iter().find(|n| n.interface == "lo").unwrap();
    assert_eq!(lo.numa_node, None, "a virtual NIC stays without one");
}

#[test]
fn unknown_numa_nodes_beside_a_cpu_less_node_or_without_numa_are_the_cpu_node() {
    // The two-domains host (GPU and eth0 under different host bridges, one socket) with the
    // devices' numa_node -1 and either a CPU-less memory node 1 (CXL, HBM in flat mode) or
    // no NUMA at all (a kernel built without it: no devices/system/node, no numa_node
    // files). Before, both read as SYS, "NUMA node unknown": the one-node rule needed
    // exactly one nodeN directory.
    let unknown = |dir: &Path| {
        for dev in ["0001:17:00.0", "0000:18:00.0"] {
            let numa = dir.join("bus/pci/devices").join(dev).join("numa_node");
            fs::write(fs::canonicalize(&numa).unwrap(), "-1\n").unwrap();
        }
    };
    let cxl = changed_tree("two-domains", "numa-cxl", |dir| {
        unknown(dir);
        let node1 = dir.join("devices/system/node/node1");
        fs::create_dir_all(&node1).unwrap();
        fs::write(node1.join("cpulist"), "\n").unwrap();
    });
    let no_numa = changed_tree("two-domains", "numa-none", |dir| {
        unknown(dir);
        for dev in ["0001:17:00.0", "0000:18:00.0"] {
            let numa = dir.join("bus/pci/devices").join(dev).join("numa_node");
            fs::remove_file(fs::canonicalize(&numa).unwrap()).unwrap();
        }
        fs::remove_dir_all(dir.join("devices/system/node")).unwrap();
    });
    assert_eq!(cxl.nodes.len(), 2, "{:?}", cxl.nodes);
    assert!(no_numa.nodes.is_empty(), "{:?}", no_numa.nodes);
    for tree in [&cxl, &no_numa] {
        let gpu = &tree.gpus[0];
        let eth0 = tree.nics.iter().find(|n| n.interface == "eth0").unwrap();
        assert_eq!((gpu.numa_node, eth0.numa_node), (Some(0), Some(0)));
        let c = classify(
            &gpu.path,
            gpu.numa_node,
            eth0.path.as_ref().unwrap(),
            eth0.numa_node,
        );
        assert_eq!(c.distance, Distance::Phb, "{}", c.why);
    }
}

#[test]
fn a_vrf_port_and_a_bond_port_are_told_apart_by_their_master() {
    // eth3 is a port of VRF vrf-red, eth4 a port of bond1, with their masters' `flags` as the
    // kernel shows them (the VRF driver sets IFF_MASTER | IFF_NOARP; a bond IFF_MASTER and ARP)
    // and a bond slave's `bonding_slave` directory. Before, both were "a port of X (a bond,
    // team or bridge), which carries its traffic": false for a VRF, whose fix is different.
    let tree = changed_tree("a3-8gpu-8nic", "masters", |dir| {
        let net = dir.join("class/net");
        for (nic, master, flags) in [("eth3", "vrf-red", "0x4c1"), ("eth4", "bond1", "0x1443")] {
            let m = dir.join("devices/virtual/net").join(master);
            fs::create_dir_all(&m).unwrap();
            fs::write(m.join("flags"), format!("{flags}\n")).unwrap();
            std::os::unix::fs::symlink(&m, net.join(nic).join("master")).unwrap();
        }
        fs::create_dir(net.join("eth4/bonding_slave")).unwrap();
    });
    let why = |name: &str| {
        let nic = tree.nics.iter().find(|n| n.interface == name);
        nic.and_then(|n| n.unusable.clone()).unwrap_or_default()
    };
    assert!(
        why("eth3").starts_with("a port of VRF vrf-red: "),
        "{}",
        why("eth3")
    );
    assert!(
        why("eth3").contains("ip vrf exec vrf-red"),
        "{}",
        why("eth3")
    );
    assert_eq!(
        why("eth4"),
        "a port of bond1 (a bond), which carries its traffic"
    );
    let plans = pair(&tree, &PairOptions::default());
    assert!(
        plans
            .iter()
            .all(|p| !matches!(p.nic.as_deref(), Some("eth3" | "eth4")))
    );
}

/// The tree of fixture `name` as read after `change` wrote to a copy of it (as the kernel
/// would write those files), the copy removed again.
fn changed_tree(name: &str, tag: &str, change: impl FnOnce(&Path)) -> Tree {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("topology-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    copy_tree(&fixture(name), &dir);
    change(&dir);
    let tree = Tree::read(&dir).expect("read the copy");
    let _ = fs::remove_dir_all(&dir);
    tree
}

/// Adds PCI function `rel` (its path under `devices/`, ending with its BDF) to the tree at
/// `dir` as the generator writes one: ids, class, NUMA node 0, its `subsystem` link and its
/// `bus/pci/devices` link; the directories above it are created bare. Returns its directory.
fn add_function(dir: &Path, rel: &str, ids: (&str, &str), class: &str) -> PathBuf {
    let dev = dir.join("devices").join(rel);
    fs::create_dir_all(&dev).unwrap();
    let files = [
        ("vendor", ids.0),
        ("device", ids.1),
        ("class", class),
        ("numa_node", "0"),
    ];
    for (file, text) in files {
        fs::write(dev.join(file), format!("{text}\n")).unwrap();
    }
    std::os::unix::fs::symlink(dir.join("bus/pci"), dev.join("subsystem")).unwrap();
    let name = dev.file_name().expect("a BDF").to_owned();
    std::os::unix::fs::symlink(&dev, dir.join("bus/pci/devices").join(name)).unwrap();
    dev
}

/// Adds NIC `name` (a ConnectX-7 with 16 rx queues, link up) at PCI function `rel` (see
/// [`add_function`]), with its `class/net` link.
fn add_nic(dir: &Path, rel: &str, name: &str) {
    let dev = add_function(dir, rel, ("0x15b3", "0x1021"), "0x020000");
    let net = dev.join("net").join(name);
    for q in 0..16 {
        fs::create_dir_all(net.join(format!("queues/rx-{q}"))).unwrap();
    }
    fs::write(net.join("operstate"), "up\n").unwrap();
    std::os::unix::fs::symlink(&dev, net.join("device")).unwrap();
    std::os::unix::fs::symlink(&net, dir.join("class/net").join(name)).unwrap();
}

#[test]
fn devices_behind_an_intel_vmd_hang_off_the_host_bridge() {
    // The phb tree (GPU 0000:03:00.0 under a switch, eth1 under root port 00:02.0) with an
    // Intel VMD endpoint 0000:00:0e.0 whose domain 10000 (host bridge pci10000:00, nested
    // below the endpoint) holds GPU 10000:01:00.0 and NIC vmd0 10000:02:00.0 under root
    // ports 02.0 and 03.0, and GPU 10000:05:00.0 behind switch 10000:03:00.0 under root
    // port 04.0. Before, the VMD endpoint was taken for a PCIe switch: the first GPU and
    // vmd0 were PIX ("same PCIe switch 0000:00:0e.0"), the second GPU and vmd0 PXB.
    let vmd = "pci0000:00/0000:00:0e.0";
    let tree = changed_tree("phb", "vmd", |dir| {
        add_function(dir, vmd, ("0x8086", "0x28c0"), "0x010400");
        let h100 = ("0x10de", "0x2330");
        let inner = format!("{vmd}/pci10000:00");
        let gpu = format!("{inner}/10000:00:02.0/10000:01:00.0");
        add_function(dir, &gpu, h100, "0x030200");
        add_nic(dir, &format!("{inner}/10000:00:03.0/10000:02:00.0"), "vmd0");
        let switch = "10000:00:04.0/10000:03:00.0/10000:04:00.0";
        add_function(
            dir,
            &format!("{inner}/{switch}/10000:05:00.0"),
            h100,
            "0x030200",
        );
    });
    let gpu = |pci: &str| {
        let g = tree.gpus.iter().find(|g| g.pci.to_string() == pci);
        g.unwrap_or_else(|| panic!("no GPU {pci}: {:#?}", tree.gpus))
    };
    let first = gpu("10000:01:00.0");
    assert_eq!(
        first.path.to_string(),
        "pci0000:00/10000:00:02.0/10000:01:00.0"
    );
    let class = |g: &shardwire_topology::Gpu, name: &str| {
        let n = tree.nics.iter().find(|n| n.interface == name).expect("nic");
        let c = classify(
            &g.path,
            g.numa_node,
            n.path.as_ref().expect("physical"),
            n.numa_node,
        );
        (c.distance, c.why)
    };
    let phb = (
        Distance::Phb,
        "through host bridge pci0000:00 (NUMA 0)".to_owned(),
    );
    assert_eq!(class(first, "vmd0"), phb);
    assert_eq!(class(gpu("10000:05:00.0"), "vmd0"), phb, "not PXB");
    assert_eq!(class(gpu("0000:03:00.0"), "vmd0"), phb);
    assert_eq!(class(first, "eth1"), phb);
    let plans = pair(&tree, &PairOptions::default());
    assert_eq!(plans.len(), 3);
    assert!(
        plans.iter().all(|l| l.distance == Some(Distance::Phb)),
        "{plans:#?}"
    );
}

#[test]
fn bonding_masters_in_class_net_is_no_nic() {
    // With the bonding module loaded, class/net holds the regular file bonding_masters:
    // before, it was read as a virtual NIC named bonding_masters.
    let tree = changed_tree("veth", "bonding-masters", |dir| {
        fs::write(dir.join("class/net/bonding_masters"), "bond0\n").unwrap();
    });
    let names: Vec<&str> = tree.nics.iter().map(|n| n.interface.as_str()).collect();
    assert_eq!(names, ["eth1", "lo", "veth0"]);
    assert_eq!(tree, read("veth"));
}

#[test]
fn a_lane_without_a_nic_names_the_physical_nics_left_out_and_why() {
    // The veth tree (GPU 03:00.0, eth1 in its switch, lo, veth0) with eth1 an InfiniBand
    // port, then a slave of bond0: before, the lane said "no physical NIC".
    let ib = changed_tree("veth", "no-nic-ib", |dir| {
        fs::write(dir.join("class/net/eth1/type"), "32\n").unwrap();
    });
    let plan = &pair(&ib, &PairOptions::default())[0];
    assert_eq!((plan.nic.as_deref(), plan.warn), (None, true));
    assert_eq!(
        plan.why,
        "no usable physical NIC: eth1 (not an Ethernet interface: ARPHRD type 32 \
         (InfiniBand); lanes and devmem TCP need Ethernet) (virtual NICs are not paired with \
         GPUs; name one in the lanes table's `interface` to use it)"
    );
    let bonded = changed_tree("veth", "no-nic-bond", |dir| {
        let master = dir.join("devices/virtual/net/bond0");
        fs::create_dir_all(&master).unwrap();
        fs::write(master.join("flags"), "0x1443\n").unwrap();
        let eth1 = dir.join("class/net/eth1");
        std::os::unix::fs::symlink(&master, eth1.join("master")).unwrap();
        fs::create_dir(eth1.join("bonding_slave")).unwrap();
    });
    // bond0 named but not in class/net.
    let plan = &pair(&bonded, &opts(&["bond0"]))[0];
    assert_eq!(plan.nic, None);
    assert_eq!(
        plan.why,
        "no usable physical NIC: eth1 (a port of bond0 (a bond), which carries its traffic); \
         and no NIC named in include_virtual exists"
    );
}

#[test]
fn a_lane_farther_than_a_nic_down_at_start_names_it() {
    // The A3 tree with eth1, the PIX NIC of GPU 05:00.0, down at start while eth2 (the same
    // model) is up: eth1 is passed over and the GPU gets eth2 at PXB. Before, its lane did
    // not say that a nearer NIC was left out.
    let tree = changed_tree("a3-8gpu-8nic", "down-at-start", |dir| {
        fs::write(dir.join("class/net/eth1/operstate"), "down\n").unwrap();
    });
    let plans = pair(&tree, &PairOptions::default());
    assert_eq!(
        (plans[0].nic.as_deref(), plans[0].distance),
        (Some("eth2"), Some(Distance::Pxb)),
        "{plans:#?}"
    );
    assert!(
        plans[0]
            .why
            .ends_with("; eth1 (PIX) is nearer but was passed over: its link was down at start"),
        "{}",
        plans[0].why
    );
    // eth1 is no nearer to the other GPUs than their own NICs.
    for p in &plans[1..] {
        assert!(!p.why.contains("passed over"), "{}: {}", p.gpu, p.why);
    }
    // The JSON says so too: before, eth1's entry read as usable as eth2's.
    let topo = Topology::from_tree(&tree, &PairOptions::default());
    let json = serde_json::to_value(&topo).expect("serialize");
    let entry = |name: &str| {
        let nics = json["nics"].as_array().expect("nics");
        nics.iter()
            .find(|n| n["interface"] == name)
            .cloned()
            .expect("listed")
    };
    let why = entry("eth1")["passed_over"].as_str().map(str::to_owned);
    assert!(
        why.as_deref()
            .is_some_and(|w| w.starts_with("its link is down (operstate)")),
        "{why:?}"
    );
    assert!(
        entry("eth2").get("passed_over").is_none(),
        "{}",
        entry("eth2")
    );
    assert!(entry("eth1").get("unusable").is_none());
}
