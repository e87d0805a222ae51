//! Lane plans over the fixture sysfs trees (tests/fixtures/sysfs) with interface addresses
//! and CUDA devices given by hand.

use std::net::Ipv4Addr;
use std::path::Path;

use shardwire_config::ByteSize;

use super::*;

fn tree(name: &str) -> Tree {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/sysfs")
        .join(name);
    Tree::read(&root).expect("fixture tree")
}

/// eth<N> has 10.0.<N>.5; lo 127.0.0.1; anything else does not exist.
fn addrs(ifname: &str) -> Result<Option<Ipv4Addr>, IfAddrError> {
    if ifname == "lo" {
        return Ok(Some(Ipv4Addr::LOCALHOST));
    }
    match ifname
        .strip_prefix("eth")
        .and_then(|n| n.parse::<u8>().ok())
    {
        Some(n) => Ok(Some(Ipv4Addr::new(10, 0, n, 5))),
        None => Err(IfAddrError::NoSuchInterface(ifname.to_owned())),
    }
}

fn cuda(bus: &str, ordinal: i32) -> GpuDevice {
    GpuDevice {
        ordinal,
        name: "fake".into(),
        pci_bus_id: bus.into(),
        uuid: Some(format!(
            "GPU-5a77fa4e-0000-40{}-8000-000000000000",
            &bus[5..7]
        )),
        total_memory: 1 << 30,
        compute_capability: (9, 0),
        dma_buf_supported: true,
        vmm_supported: true,
        gpu_direct_rdma_with_cuda_vmm_supported: true,
    }
}

fn inputs<'a>(lanes: &'a Lanes, listen: &str, tree: &'a Tree, cuda: &'a [GpuDevice]) -> Inputs<'a> {
    Inputs {
        lanes,
        data_listen: listen.parse().expect("address"),
        devmem_queues: &[6, 7],
        devmem_memory: 64 << 20,
        tree,
        cuda,
    }
}

/// (gpu, nic, distance, data address, queues)
fn rows(lanes: &[LaneSpec]) -> Vec<(String, String, String, String, Vec<u32>)> {
    lanes
        .iter()
        .map(|l| {
            (
                l.gpu.as_ref().map_or("-".into(), |g| g.pci.to_string()),
                l.nic.clone().unwrap_or_else(|| "-".into()),
                l.distance.map_or("-".into(), |d| d.to_string()),
                l.data_listen.to_string(),
                l.queues.clone(),
            )
        })
        .collect()
}

#[test]
fn no_gpu_is_one_host_lane_as_before() {
    let t = Tree::default();
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(lanes.len(), 1);
    let l = &lanes[0];
    assert_eq!((l.id, l.gpu.as_ref(), l.nic.as_ref()), (0, None, None));
    assert_eq!(l.data_listen.to_string(), "0.0.0.0:7401");
    assert_eq!(l.queues, [6, 7], "devmem_queues");
    assert!(
        l.cpus.is_empty() && l.numa_bind.is_none(),
        "not pinned, not placed"
    );
    assert!(l.why.starts_with("no GPU: one host lane"), "{}", l.why);
}

#[test]
fn one_gpu_is_one_lane_on_data_listen_with_its_nic_shown() {
    let t = tree("veth");
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(
        rows(&lanes),
        [(
            "0000:03:00.0".into(),
            "eth1".into(),
            "PIX".into(),
            "0.0.0.0:7401".into(),
            vec![6, 7]
        )]
    );
    assert!(lanes[0].cpus.is_empty() && !lanes[0].warn);
    // One GPU whose nearest NIC is across sockets: still one lane, with a warning.
    let far = tree("cross-socket");
    let far_lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &far, &[]), &addrs).unwrap();
    assert_eq!(far_lanes.len(), 1);
    assert!(far_lanes[0].warn && far_lanes[0].distance == Some(Distance::Sys));
    assert!(
        lanes[0].why.contains("its nearest NIC is eth1"),
        "{}",
        lanes[0].why
    );
    // The far lane says why it warns (before, this checked `lanes` again).
    let why = &far_lanes[0].why;
    assert!(
        why.starts_with("one GPU: one lane (its nearest NIC is") && why.contains("across sockets"),
        "{why}"
    );
}

#[test]
fn eight_gpus_get_eight_lanes_on_their_switch_nics() {
    let t = tree("a3-8gpu-8nic");
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(lanes.len(), 8);
    for (i, l) in lanes.iter().enumerate() {
        assert_eq!(l.id, i as u32);
        assert_eq!(l.distance, Some(Distance::Pix), "{l:?}");
        let n: u8 = l.nic.as_deref().unwrap()[3..].parse().unwrap();
        assert_eq!(l.data_listen.to_string(), format!("10.0.{n}.5:7401"));
        assert!(!l.warn);
        assert_eq!(l.queues, (8..16).collect::<Vec<u32>>());
        // Receivers on the NIC's socket; host memory placed there.
        let socket = u32::from(i >= 4);
        assert_eq!(l.numa_bind, Some(socket));
        assert_eq!(l.cpus.first(), Some(&(socket * 52)));
        assert!(
            l.why.contains("(eth") && l.why.contains("IPv4"),
            "{}",
            l.why
        );
    }
    let nics: std::collections::BTreeSet<_> = lanes.iter().map(|l| l.nic.clone()).collect();
    assert_eq!(nics.len(), 8, "one NIC each");
    // A fixed data_listen is every lane's address: their traffic all arrives on the NIC that
    // holds it, not on each lane's own, which every lane says (a warning, not silence).
    let fixed = plan(&inputs(&Lanes::Auto, "10.9.9.9:7401", &t, &[]), &addrs).unwrap();
    for l in &fixed {
        assert_eq!(l.data_listen.to_string(), "10.9.9.9:7401");
        assert!(
            l.warn && l.why.contains("not an address of eth"),
            "{}",
            l.why
        );
        // Not a wildcard: the advice to make it one stays.
        let advice = "set data_listen to a wildcard such as 0.0.0.0:7401, give eth";
        assert!(l.why.contains(advice), "{}", l.why);
    }
    // Where data_listen is one NIC's own address, that lane alone is where it says.
    let on_eth3 = plan(&inputs(&Lanes::Auto, "10.0.3.5:7401", &t, &[]), &addrs).unwrap();
    let warned: Vec<_> = on_eth3
        .iter()
        .filter(|l| l.warn)
        .map(|l| l.nic.as_deref())
        .collect();
    assert_eq!(warned.len(), 7, "{warned:?}");
    assert!(!warned.contains(&Some("eth3")));
}

#[test]
fn lanes_are_the_gpus_cuda_lists_when_it_lists_some() {
    let t = tree("8gpu-4nic");
    // CUDA sees 4 of the 8 GPUs (CUDA_VISIBLE_DEVICES), one per switch: each gets its switch's
    // NIC and all of its queues.
    let seen = [
        cuda("0000:04:00.0", 0),
        cuda("0000:0a:00.0", 1),
        cuda("0000:84:00.0", 2),
        cuda("0000:8a:00.0", 3),
    ];
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &seen), &addrs).unwrap();
    let got: Vec<(String, String, Vec<u32>)> = lanes
        .iter()
        .map(|l| {
            (
                l.gpu.as_ref().unwrap().pci.to_string(),
                l.nic.clone().unwrap(),
                l.queues.clone(),
            )
        })
        .collect();
    let all: Vec<u32> = (8..16).collect();
    assert_eq!(
        got,
        [
            ("0000:04:00.0".into(), "eth1".into(), all.clone()),
            ("0000:0a:00.0".into(), "eth2".into(), all.clone()),
            ("0000:84:00.0".into(), "eth3".into(), all.clone()),
            ("0000:8a:00.0".into(), "eth4".into(), all),
        ]
    );
    assert_eq!(lanes[2].gpu.as_ref().unwrap().ordinal, Some(2));
    assert!(lanes[0].gpu.as_ref().unwrap().uuid.is_some());
    // All 8 visible: two per NIC, disjoint queue halves.
    let eight: Vec<GpuDevice> = t
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| cuda(&g.pci.to_string(), i as i32))
        .collect();
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &eight), &addrs).unwrap();
    assert_eq!(lanes.len(), 8);
    assert_eq!(
        (lanes[0].nic.as_deref(), &lanes[0].queues[..]),
        (Some("eth1"), &[8, 9, 10, 11][..])
    );
    assert_eq!(
        (lanes[1].nic.as_deref(), &lanes[1].queues[..]),
        (Some("eth1"), &[12, 13, 14, 15][..])
    );
    assert_eq!(
        lanes[0].data_listen, lanes[1].data_listen,
        "one NIC, one address"
    );
}

#[test]
fn gpus_the_tree_lacks_get_lanes_without_a_nic() {
    // The fake libcuda's default bus ids are not in the host's sysfs tree.
    let t = Tree::default();
    let seen = [cuda("0000:fa:00.0", 0), cuda("0000:fa:01.0", 1)];
    let lanes = plan(&inputs(&Lanes::Auto, "127.0.0.1:0", &t, &seen), &addrs).unwrap();
    assert_eq!(lanes.len(), 2);
    for l in &lanes {
        assert_eq!(l.nic, None);
        assert!(
            l.warn && l.why.starts_with("not in the sysfs tree"),
            "{}",
            l.why
        );
        assert_eq!(l.data_listen.to_string(), "127.0.0.1:0");
    }
}

#[test]
fn a_cross_socket_pair_warns() {
    let t = tree("cross-socket");
    let seen = [cuda("0000:03:00.0", 0), cuda("0000:fa:00.0", 1)];
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &seen), &addrs).unwrap();
    assert_eq!(lanes[0].distance, Some(Distance::Sys));
    assert!(lanes[0].warn);
    assert_eq!(lanes[0].numa_bind, Some(1), "memory near the NIC");
}

fn table(entries: Vec<LaneConfig>) -> Lanes {
    Lanes::Table(entries)
}

#[test]
fn tables_fill_what_they_leave_out() {
    let t = tree("8gpu-4nic");
    let lanes = table(vec![
        LaneConfig {
            gpu: Some("0000:05:00.0".into()),
            ..LaneConfig::default()
        },
        LaneConfig {
            gpu: Some("05:00.0".replace("05", "0b")),
            interface: Some("eth2".into()),
            data_listen: Some("10.1.1.1:9000".parse().unwrap()),
            queues: vec![14, 15],
            devmem_memory: Some(ByteSize(8 << 20)),
        },
        LaneConfig {
            data_listen: Some("127.0.0.2:0".parse().unwrap()),
            ..LaneConfig::default()
        },
    ]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(
        rows(&got),
        [
            (
                "0000:05:00.0".into(),
                "eth1".into(),
                "PIX".into(),
                "10.0.1.5:7401".into(),
                (8..16).collect()
            ),
            (
                "0000:0b:00.0".into(),
                "eth2".into(),
                "PIX".into(),
                "10.1.1.1:9000".into(),
                vec![14, 15]
            ),
            (
                "-".into(),
                "-".into(),
                "-".into(),
                "127.0.0.2:0".into(),
                vec![]
            ),
        ]
    );
    assert_eq!(got[1].devmem_memory, 8 << 20);
    assert_eq!(got[0].devmem_memory, 64 << 20);
    assert!(
        got[0].why.starts_with("configured (lanes[0])"),
        "{}",
        got[0].why
    );
}

#[test]
fn table_lanes_sharing_a_nic_of_too_few_queues_get_queues_past_it_as_auto_lanes_do() {
    // Before, three lanes on a NIC of 4 queues got [2], [3] and none, and the binding
    // refused devmem on the whole node, where `lanes = "auto"` raised the channels.
    let mut t = tree("8gpu-4nic");
    let eth1 = t.nics.iter_mut().find(|n| n.interface == "eth1").unwrap();
    eth1.rx_queues = 4;
    let gpus: Vec<String> = t.gpus[..3].iter().map(|g| g.pci.to_string()).collect();
    let lanes = table(
        gpus.iter()
            .enumerate()
            .map(|(i, g)| LaneConfig {
                gpu: Some(g.clone()),
                interface: Some("eth1".into()),
                data_listen: Some(format!("10.0.1.5:{}", 7401 + i).parse().unwrap()),
                ..LaneConfig::default()
            })
            .collect(),
    );
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    let queues: Vec<Vec<u32>> = got.iter().map(|l| l.queues.clone()).collect();
    assert_eq!(queues, [vec![2], vec![3], vec![4]]);
    // The lane past the NIC's queues says so, as an auto lane does; the others do not.
    assert!(
        got[2].why.ends_with(
            "; queue(s) 4 past eth1's 4 RX queues: devmem raises its channels to at least 5"
        ),
        "{}",
        got[2].why
    );
    assert!(!got[0].why.contains("past eth1"), "{}", got[0].why);
}

#[test]
fn a_table_gpu_the_tree_has_but_cuda_does_not_list_is_named_as_hidden_from_cuda() {
    // Before, it was "this host has no such GPU", though `shardwire topology` lists it.
    let t = tree("8gpu-4nic");
    let devices = [cuda("0000:05:00.0", 0)];
    let lanes = table(vec![LaneConfig {
        gpu: Some("0000:0b:00.0".into()),
        ..LaneConfig::default()
    }]);
    let e = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &devices), &addrs).unwrap_err();
    assert!(
        matches!(&e, PlanError::GpuNotInCuda { lane: 0, gpu, cuda } if gpu == "0000:0b:00.0" && cuda == "0000:05:00.0"),
        "{e}"
    );
    assert!(e.to_string().contains("CUDA_VISIBLE_DEVICES"), "{e}");
    // A GPU in neither is still unknown to the host.
    let lanes = table(vec![LaneConfig {
        gpu: Some("0000:99:00.0".into()),
        ..LaneConfig::default()
    }]);
    let e = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &devices), &addrs).unwrap_err();
    assert!(matches!(e, PlanError::UnknownGpu { lane: 0, .. }), "{e}");
}

#[test]
fn a_table_lane_on_a_virtual_nic_says_so_rather_than_not_in_the_tree() {
    let t = tree("veth");
    let with_veth = |n: &str| match n {
        "veth0" => Ok(Some(Ipv4Addr::new(10, 9, 0, 1))),
        _ => addrs(n),
    };
    let lanes = table(vec![LaneConfig {
        gpu: Some("0000:03:00.0".into()),
        interface: Some("veth0".into()),
        ..LaneConfig::default()
    }]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &with_veth).unwrap();
    assert!(
        got[0]
            .why
            .contains("veth0 is virtual (no PCI path): distance unknown"),
        "{}",
        got[0].why
    );
    assert!(
        !got[0].why.contains("not both in the sysfs tree"),
        "{}",
        got[0].why
    );
    assert!(got[0].warn, "a GPU lane on a virtual NIC warns");
}

#[test]
fn tables_naming_what_is_not_there_are_refused_with_the_lane() {
    let t = tree("veth");
    let one = |lc: LaneConfig| plan(&inputs(&table(vec![lc]), "0.0.0.0:7401", &t, &[]), &addrs);
    let e = one(LaneConfig {
        gpu: Some("0000:99:00.0".into()),
        ..LaneConfig::default()
    })
    .unwrap_err();
    assert!(
        e.to_string().contains(
            "lanes[0].gpu = 0000:99:00.0: this host has no such GPU (GPUs: 0000:03:00.0)"
        ),
        "{e}"
    );
    let e = one(LaneConfig {
        gpu: Some("GPU-5a77fa4e-0000-4003-8000-000000000000".into()),
        ..LaneConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(e, PlanError::UuidWithoutCuda { lane: 0, .. }),
        "{e}"
    );
    let e = one(LaneConfig {
        interface: Some("ib7".into()),
        ..LaneConfig::default()
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("lanes[0].interface: no network interface named ib7"),
        "{e}"
    );
    let e = one(LaneConfig {
        interface: Some("ib7".into()),
        data_listen: Some("10.0.0.1:1".parse().unwrap()),
        ..LaneConfig::default()
    })
    .unwrap_err();
    assert!(matches!(e, PlanError::Interface { lane: 0, .. }), "{e}");
    // By UUID, through the CUDA devices.
    let seen = [cuda("0000:03:00.0", 0)];
    let by_uuid = table(vec![LaneConfig {
        gpu: Some("gpu-5A77FA4E-0000-4003-8000-000000000000".into()),
        ..LaneConfig::default()
    }]);
    let got = plan(&inputs(&by_uuid, "0.0.0.0:7401", &t, &seen), &addrs).unwrap();
    assert_eq!(got[0].gpu.as_ref().unwrap().pci.to_string(), "0000:03:00.0");
    assert_eq!(got[0].nic.as_deref(), Some("eth1"));
}

#[test]
fn a_table_naming_one_gpu_twice_in_two_spellings_is_refused_naming_both() {
    let t = tree("8gpu-4nic");
    let lanes = table(vec![
        LaneConfig {
            gpu: Some("0000:05:00.0".into()),
            ..LaneConfig::default()
        },
        LaneConfig {
            gpu: Some("05:00.0".into()), // the same GPU, without its domain
            ..LaneConfig::default()
        },
    ]);
    let e = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap_err();
    assert!(
        matches!(
            &e,
            PlanError::DuplicateGpu {
                first: 0,
                lane: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("\"0000:05:00.0\" and \"05:00.0\""),
        "{e}"
    );
}

#[test]
fn a_table_that_puts_two_gpus_on_one_nic_splits_its_queues_between_them() {
    // GPUs 04:00.0 and 0a:00.0 sit under the switches of eth1 and eth2; the table puts both
    // on eth1 (two GPUs per NIC). The pairing alone would give 04:00.0 all of eth1's devmem
    // queues and leave none for the other lane, so the binding could not start.
    let t = tree("8gpu-4nic");
    let on_eth1 = |gpu: &str| LaneConfig {
        gpu: Some(gpu.into()),
        interface: Some("eth1".into()),
        ..LaneConfig::default()
    };
    let lanes = table(vec![on_eth1("0000:04:00.0"), on_eth1("0000:0a:00.0")]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    let queues: Vec<Vec<u32>> = got.iter().map(|l| l.queues.clone()).collect();
    assert_eq!(queues, [(8..12).collect::<Vec<_>>(), (12..16).collect()]);
    // A lane of that NIC that names its queues leaves the others to the binding's share.
    let mut named = on_eth1("0000:0a:00.0");
    named.queues = vec![15];
    let lanes = table(vec![on_eth1("0000:04:00.0"), named]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(
        (got[0].queues.clone(), got[1].queues.clone()),
        (vec![], vec![15])
    );
    assert!(!got[0].warn, "PIX: {}", got[0].why);
    // A GPU lane on a virtual NIC warns, as it does in auto mode.
    let lanes = table(vec![LaneConfig {
        gpu: Some("0000:04:00.0".into()),
        interface: Some("lo".into()),
        ..LaneConfig::default()
    }]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert!(got[0].warn, "{}", got[0].why);
}

#[test]
fn a_table_lane_without_a_nic_avoids_the_nic_another_lane_names() {
    // The switch of GPUs 04:00.0 and 05:00.0 gets a second NIC (eth5, a function beside
    // eth1): two GPUs, two NICs, all at PIX.
    let mut t = tree("8gpu-4nic");
    let mut second = t
        .nics
        .iter()
        .find(|n| n.interface == "eth1")
        .expect("eth1")
        .clone();
    let pci: PciAddr = "0000:06:00.1".parse().unwrap();
    second.interface = "eth5".into();
    second.pci = Some(pci);
    let path = second.path.as_mut().expect("eth1 is in the tree");
    *path.chain.last_mut().expect("the NIC itself") = pci;
    t.nics.push(second);
    let lane = |gpu: &str, nic: Option<&str>| LaneConfig {
        gpu: Some(gpu.into()),
        interface: nic.map(str::to_owned),
        ..LaneConfig::default()
    };
    // The NIC the pairing gives 05:00.0, named for 04:00.0.
    let auto = table(vec![lane("0000:04:00.0", None), lane("0000:05:00.0", None)]);
    let paired = plan(&inputs(&auto, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    let theirs = paired[1].nic.clone().expect("a NIC");
    assert_ne!(paired[0].nic.as_deref(), Some(theirs.as_str()), "spread");
    let lanes = table(vec![
        lane("0000:04:00.0", Some(theirs.as_str())),
        lane("0000:05:00.0", None),
    ]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    // Before: 05:00.0 took the same NIC, and the other sat idle.
    let other = if theirs == "eth1" { "eth5" } else { "eth1" };
    assert_eq!(got[1].nic.as_deref(), Some(other), "{}", got[1].why);
    assert_eq!(got[1].distance, Some(Distance::Pix));
    // Where no unnamed NIC is as near, the nearest one still, though named.
    let far = table(vec![
        lane("0000:04:00.0", Some("eth1")),
        lane("0000:05:00.0", Some("eth5")),
        lane("0000:0a:00.0", Some("eth2")),
        lane("0000:0b:00.0", None),
    ]);
    let got = plan(&inputs(&far, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(got[3].nic.as_deref(), Some("eth2"), "{}", got[3].why);
    // Four GPUs on that switch, one lane naming eth1: the others do not pile onto eth5 (3 to
    // 1); each NIC keeps two lanes, as the pairing spreads them.
    let first = t
        .gpus
        .iter()
        .find(|g| g.pci == gpu("0000:04:00.0"))
        .unwrap()
        .clone();
    for bus in ["0000:07:00.0", "0000:08:00.0"] {
        let mut g = first.clone();
        g.pci = gpu(bus);
        *g.path.chain.last_mut().expect("the GPU itself") = g.pci;
        t.gpus.push(g);
    }
    let four = table(vec![
        lane("0000:04:00.0", Some("eth1")),
        lane("0000:05:00.0", None),
        lane("0000:07:00.0", None),
        lane("0000:08:00.0", None),
    ]);
    let got = plan(&inputs(&four, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    let on = |nic: &str| got.iter().filter(|l| l.nic.as_deref() == Some(nic)).count();
    assert_eq!((on("eth1"), on("eth5")), (2, 2), "{got:?}");
}

fn gpu(bus: &str) -> PciAddr {
    bus.parse().unwrap()
}

#[test]
fn a_table_of_one_lane_takes_devmem_queues_when_it_names_none() {
    // Before, a table's lane bound only lanes[i].queues: devmem_queues was dropped without a
    // word on a node of one lane (the Kubernetes hosts' `lanes = [{}]`).
    let t = tree("veth");
    let lanes = table(vec![LaneConfig::default()]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(got[0].queues, [6, 7], "the node's devmem_queues");
    let lanes = table(vec![LaneConfig {
        queues: vec![3],
        ..LaneConfig::default()
    }]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(got[0].queues, [3], "the lane's own");
    // A lane whose NIC is in the tree: the node's queues, not the NIC's upper-half share.
    let lanes = table(vec![LaneConfig {
        interface: Some("eth1".into()),
        ..LaneConfig::default()
    }]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(got[0].nic.as_deref(), Some("eth1"));
    assert_eq!(got[0].queues, [6, 7], "the node's devmem_queues");
}

#[test]
fn a_table_lane_on_a_fixed_data_listen_not_its_nics_warns_as_auto_lanes_do() {
    // data_listen is eth1's own address: the eth2 lane is dialled there too, so its traffic
    // enters through eth1. Before, a table lane said so at info level, without the hint.
    let t = tree("8gpu-4nic");
    let on = |gpu: &str, nic: &str| LaneConfig {
        gpu: Some(gpu.into()),
        interface: Some(nic.into()),
        ..LaneConfig::default()
    };
    let lanes = table(vec![on("0000:04:00.0", "eth1"), on("0000:0a:00.0", "eth2")]);
    let got = plan(&inputs(&lanes, "10.0.1.5:7401", &t, &[]), &addrs).unwrap();
    assert_eq!(got[0].data_listen.to_string(), "10.0.1.5:7401");
    assert!(!got[0].warn, "its NIC's own address: {}", got[0].why);
    assert_eq!(got[1].data_listen.to_string(), "10.0.1.5:7401");
    assert_eq!(got[1].distance, Some(Distance::Pix), "{}", got[1].why);
    assert!(got[1].warn, "{}", got[1].why);
    for hint in [
        "not an address of eth2",
        "0.0.0.0:7401",
        "set lanes[1].data_listen",
    ] {
        assert!(got[1].why.contains(hint), "{hint}: {}", got[1].why);
    }
    // A lane's own data_listen is taken as meant.
    let mut own = on("0000:0a:00.0", "eth2");
    own.data_listen = Some("10.0.1.5:7402".parse().unwrap());
    let got = plan(&inputs(&table(vec![own]), "10.0.1.5:7401", &t, &[]), &addrs).unwrap();
    assert!(!got[0].warn, "{}", got[0].why);
}

/// A NIC with no IPv4 address at start (one still training at boot): its lane is on the
/// wildcard and awaits the NIC's address, which every source session looks up again. Before,
/// nothing marked such a lane and no session looked again: it stayed on the control
/// connection's address (another NIC) for the node's whole life. A lane whose NIC has an
/// address, a fixed data_listen, the one lane of a node and a configured wildcard await none.
#[test]
fn a_lane_whose_nic_has_no_address_yet_awaits_it() {
    let t = tree("a3-8gpu-8nic");
    let no_eth3 = |n: &str| match n {
        "eth3" => Ok(None),
        n => addrs(n),
    };
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &[]), &no_eth3).unwrap();
    assert_eq!(lanes.len(), 8);
    for l in &lanes {
        let eth3 = l.nic.as_deref() == Some("eth3");
        assert_eq!(l.awaits_nic_address, eth3, "{l:?}");
        assert_eq!(l.data_listen.ip().is_unspecified(), eth3, "{l:?}");
    }
    let l3 = lanes.iter().find(|l| l.awaits_nic_address).unwrap();
    let why = &l3.why;
    assert!(
        l3.warn && why.contains("eth3 has no IPv4 address yet"),
        "{why}"
    );
    // Its data_listen is a wildcard already: no advice to make it one.
    assert!(
        why.contains("give eth3 an IPv4 address") && !why.contains("to a wildcard"),
        "{why}"
    );
    let fixed = plan(&inputs(&Lanes::Auto, "10.9.9.9:7401", &t, &[]), &no_eth3).unwrap();
    assert!(fixed.iter().all(|l| !l.awaits_nic_address));
    let one = tree("veth");
    let none = |_: &str| -> Result<Option<Ipv4Addr>, IfAddrError> { Ok(None) };
    let single = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &one, &[]), &none).unwrap();
    assert!(
        !single[0].awaits_nic_address,
        "the one lane is on data_listen"
    );
    // A table lane on eth3 awaits its address, unless its own data_listen is configured.
    let t = tree("8gpu-4nic");
    let on_eth3 = LaneConfig {
        gpu: Some("0000:04:00.0".into()),
        interface: Some("eth3".into()),
        ..LaneConfig::default()
    };
    let own = LaneConfig {
        gpu: Some("0000:0a:00.0".into()),
        data_listen: Some("0.0.0.0:7402".parse().unwrap()),
        ..on_eth3.clone()
    };
    let lanes = table(vec![on_eth3, own]);
    let got = plan(&inputs(&lanes, "0.0.0.0:7401", &t, &[]), &no_eth3).unwrap();
    assert!(got[0].awaits_nic_address, "{}", got[0].why);
    assert!(!got[1].awaits_nic_address, "taken as meant: {}", got[1].why);
}

/// A NIC on IPv4LL fallback while DHCP is late has a link-local address (169.254/16), which
/// sources on other subnets cannot dial: its lane awaits a real one, as a NIC with none does.
/// Before, the link-local address was taken as the lane's data address. The wording promises
/// no move (an IPv6-only NIC never gets an IPv4 address), and once at its NIC's address the
/// lane warns only for its pairing.
#[test]
fn a_link_local_address_is_no_address_for_a_lane() {
    let t = tree("a3-8gpu-8nic");
    let ll_eth3 = |n: &str| match n {
        "eth3" => Ok(Some(Ipv4Addr::new(169, 254, 3, 5))),
        n => addrs(n),
    };
    let lanes = plan(&inputs(&Lanes::Auto, "0.0.0.0:7401", &t, &[]), &ll_eth3).unwrap();
    let l3 = lanes
        .iter()
        .find(|l| l.nic.as_deref() == Some("eth3"))
        .unwrap();
    assert!(l3.awaits_nic_address, "{l3:?}");
    assert_eq!(l3.data_listen.to_string(), "0.0.0.0:7401");
    let why = &l3.why;
    assert!(l3.warn, "{why}");
    assert!(
        why.contains("eth3 has no IPv4 address yet other than the link-local 169.254.3.5"),
        "{why}"
    );
    assert!(why.contains("if it gets one"), "{why}");
    // Its pairing is PIX, as every lane's here: at its NIC's address it warns no more.
    assert!(!l3.warn_at_nic_address, "{why}");
    for l in lanes.iter().filter(|l| !l.awaits_nic_address) {
        assert!(!l.warn && !l.warn_at_nic_address, "{l:?}");
    }
    assert_eq!(dialable(Some(Ipv4Addr::new(169, 254, 0, 1))), None);
    let ip = Some(Ipv4Addr::new(10, 0, 3, 5));
    assert_eq!(dialable(ip), ip);
}
