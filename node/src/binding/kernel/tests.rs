//! Planning lanes onto NICs: grouping, queue shares, refusals; the journals' names.

use super::*;
use shardwire_devmem::probe::TrialBind;

fn nic(name: &str, rx: u32, capable: bool) -> NicReport {
    NicReport {
        ifindex: 10,
        name: name.into(),
        driver: "mlx5_core".into(),
        up: true,
        rx_queues: rx,
        tx_queues: rx,
        bound_rx_queues: Vec::new(),
        header_split: "enabled".into(),
        hds_thresh: Some(0),
        trial_bind: TrialBind {
            errno: Some(22), // EINVAL
            error: Some("EINVAL".into()),
            message: None,
            bad_attr: None,
            reason: "EINVAL: a devmem driver".into(),
        },
        devmem_capable: capable,
        reason: if capable {
            "can bind".into()
        } else {
            "EOPNOTSUPP: the driver has no queue management ops".into()
        },
    }
}

fn lane(lane: u32, nic: Option<&str>, queues: &[u32]) -> LaneRequest {
    LaneRequest {
        lane,
        nic: nic.map(Into::into),
        named: false,
        queues: queues.to_vec(),
        bytes: 1 << 20,
        data_port: 7400 + lane as u16,
        cuda: None,
    }
}

fn queues_of(plans: &[NicPlan]) -> Vec<(String, u32, Vec<u32>)> {
    plans
        .iter()
        .flat_map(|p| {
            p.lanes
                .iter()
                .map(|(i, q)| (p.nic.name.clone(), *i as u32, q.clone()))
        })
        .collect()
}

#[test]
fn each_lane_binds_its_own_nic_upper_half() {
    let nics = [nic("eth0", 8, true), nic("eth1", 16, true)];
    let reqs = [lane(0, Some("eth0"), &[]), lane(1, Some("eth1"), &[])];
    let p = plan(&nics, &reqs, None).unwrap();
    assert_eq!(
        queues_of(&p),
        [
            ("eth0".into(), 0, vec![4, 5, 6, 7]),
            ("eth1".into(), 1, (8..16).collect())
        ]
    );
}

#[test]
fn lanes_sharing_a_nic_split_its_upper_half_into_disjoint_sets() {
    let nics = [nic("eth0", 16, true)];
    let reqs = [lane(0, Some("eth0"), &[]), lane(1, Some("eth0"), &[])];
    let p = plan(&nics, &reqs, None).unwrap();
    assert_eq!(p.len(), 1, "one setup for the NIC");
    assert_eq!(
        queues_of(&p),
        [
            ("eth0".into(), 0, vec![8, 9, 10, 11]),
            ("eth0".into(), 1, vec![12, 13, 14, 15])
        ]
    );
    // A lane naming its queues keeps them; the other gets the rest of the upper half.
    let reqs = [lane(0, Some("eth0"), &[14, 15]), lane(1, Some("eth0"), &[])];
    let p = plan(&nics, &reqs, None).unwrap();
    assert_eq!(p[0].lanes[1].1, (8..14).collect::<Vec<_>>());
}

#[test]
fn overlapping_queues_on_one_nic_are_refused_naming_both_lanes() {
    let nics = [nic("eth0", 16, true)];
    let reqs = [
        lane(0, Some("eth0"), &[8, 9]),
        lane(3, Some("eth0"), &[9, 10]),
    ];
    let e = plan(&nics, &reqs, None).unwrap_err();
    assert!(
        matches!(
            e,
            BindingError::QueuesOverlap {
                lanes: (0, 3),
                queue: 9,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("lanes 0 and 3 both name RX queue 9 of eth0"),
        "{e}"
    );
}

#[test]
fn too_few_queues_for_the_lanes_of_a_nic_is_refused() {
    let nics = [nic("eth0", 2, true)];
    let reqs = [lane(0, Some("eth0"), &[]), lane(1, Some("eth0"), &[])];
    let e = plan(&nics, &reqs, None).unwrap_err();
    assert!(
        matches!(e, BindingError::TooFewQueues { lanes: 2, .. }),
        "{e}"
    );
}

#[test]
fn a_nic_of_one_queue_has_none_to_bind_not_its_rss_queue() {
    // Before, the upper half of one queue was [0]: RSS's only queue, bound for devmem.
    let nics = [nic("eth0", 1, true)];
    assert!(upper_half_except(&nics[0], &[]).is_empty());
    assert_eq!(upper_half_except(&nic("eth0", 2, true), &[]), [1]);
    let e = plan(&nics, &[lane(0, Some("eth0"), &[])], None).unwrap_err();
    assert!(
        matches!(e, BindingError::TooFewQueues { lanes: 1, .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("queue 0 always stays with RSS"),
        "{e}"
    );
}

#[test]
fn named_queues_that_include_queue_0_are_refused_at_plan_and_at_setup() {
    // Before, they were planned and bound, and RSS went on spreading every flow (ssh, the
    // node's own connections) over the bound queues.
    let nics = [nic("eth0", 8, true)];
    let e = plan(&nics, &[lane(0, Some("eth0"), &[0, 1])], None).unwrap_err();
    let BindingError::Failed {
        what,
        source: BindError::Setup(nic::NicError::QueueZeroBound { ifname, queues }),
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!((what.as_str(), ifname.as_str()), ("lane 0 on eth0", "eth0"));
    assert_eq!(*queues, [0, 1]);
    assert!(e.to_string().contains("bind queues from 1 up"), "{e}");
    // Beside another lane's queues too.
    let two = [lane(0, Some("eth0"), &[4, 5]), lane(1, Some("eth0"), &[0])];
    assert!(plan(&nics, &two, None).is_err());
    // The path of `POST /v1/bindings` and of a join of a live setup: refused before the NIC
    // is touched (an interface that does not exist: nothing else could fail first).
    let state = std::env::temp_dir().join(format!("sw-queue0-{}.json", std::process::id()));
    let gone = NicReport {
        ifindex: u32::MAX,
        ..nic("sw-noif0", 8, true)
    };
    let e = setup_nic(&gone, &[1, 0], &[(7400, 0)], &state)
        .err()
        .expect("refused");
    assert!(
        matches!(e, BindError::Setup(nic::NicError::QueueZeroBound { .. })),
        "{e}"
    );
    assert!(!state.exists(), "no journal was made");
}

#[test]
fn every_lane_whose_nic_cannot_is_named_at_once() {
    let nics = [
        nic("va0", 4, false),
        nic("eth1", 8, true),
        nic("va2", 4, false),
    ];
    let reqs = [
        lane(0, Some("va0"), &[]),
        lane(1, Some("eth1"), &[]),
        lane(2, Some("va2"), &[]),
    ];
    let e = plan(&nics, &reqs, None).unwrap_err();
    let msg = e.to_string();
    assert!(msg.starts_with("lane 0 (va0: EOPNOTSUPP"), "{msg}");
    assert!(msg.contains(", lane 2 (va2: EOPNOTSUPP"), "{msg}");
    assert!(!msg.contains("lane 1"), "{msg}");
    // One lane: the NIC's refusal as before lanes.
    let e = plan(&nics, &[lane(0, Some("va0"), &[])], None).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("va0 cannot do devmem: EOPNOTSUPP"),
        "{e}"
    );
}

#[test]
fn a_lane_without_a_nic_is_refused_only_beside_others() {
    let nics = [nic("eth0", 8, true), nic("eth1", 8, true)];
    let e = plan(
        &nics,
        &[lane(0, Some("eth0"), &[]), lane(1, None, &[])],
        None,
    )
    .unwrap_err();
    assert!(matches!(e, BindingError::LaneWithoutNic { lane: 1 }), "{e}");
    // One lane: the interface configured (over the lane's nearest NIC), else the first
    // capable one.
    let p = plan(&nics, &[lane(0, None, &[])], Some("eth1")).unwrap();
    assert_eq!(p[0].nic.name, "eth1");
    let p = plan(&nics, &[lane(0, Some("eth0"), &[])], Some("eth1")).unwrap();
    assert_eq!(p[0].nic.name, "eth1");
    let p = plan(&nics, &[lane(0, None, &[])], None).unwrap();
    assert_eq!(p[0].nic.name, "eth0");
}

/// The admin API binds a NIC by start's rule. The single lane of a node takes any NIC, as
/// start binds `devmem_interface` whatever the lane is paired with: before, a binding that
/// start made and the operator deleted could not be made again over the API ("lane 0
/// receives through eth0, not eth1"). With several lanes each takes its own NIC only.
#[test]
fn a_lane_takes_the_nics_start_would_bind_it_on() {
    assert!(lane_takes((0, Some("eth0")), 1, "eth1").is_ok());
    assert!(lane_takes((0, None), 1, "eth1").is_ok());
    assert!(lane_takes((1, Some("eth1")), 2, "eth1").is_ok());
    let e = lane_takes((1, Some("eth1")), 2, "eth0").unwrap_err();
    assert_eq!(
        e.to_string(),
        "lane 1 receives through eth1, not eth0: bind eth1's queues for it (or name the lane \
         whose NIC eth0 is)"
    );
    assert!(matches!(
        lane_takes((1, None), 2, "eth0"),
        Err(BindingError::LaneWithoutNic { lane: 1 })
    ));
}

#[test]
fn each_nic_has_its_own_journal_beside_the_configured_one() {
    let base = Path::new("/var/lib/shardwire/nic-state.json");
    assert_eq!(state_file(base, "eth1", true), base);
    assert_eq!(
        state_file(base, "eth1", false),
        Path::new("/var/lib/shardwire/nic-state.eth1.json")
    );
    let dir = std::env::temp_dir().join(format!("sw-kernel-journals-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("nic-state.json");
    for f in [
        "nic-state.eth1.json",
        "nic-state.eth0.json",
        "nic-state.eth0.json.tmp",
        "nic-state.eth0.json.lock",
        "nic-state.json.lock",
        "other.json",
    ] {
        std::fs::write(dir.join(f), "{}").unwrap();
    }
    assert_eq!(
        state_files(&base),
        [
            base.clone(),
            dir.join("nic-state.eth0.json"),
            dir.join("nic-state.eth1.json")
        ]
    );
    // A base without an extension: `nic-state.IF`.
    let bare = dir.join("bare");
    assert_eq!(state_file(&bare, "eth1", false), dir.join("bare.eth1"));
    std::fs::write(dir.join("bare.eth1"), "{}").unwrap();
    assert_eq!(state_files(&bare), [bare.clone(), dir.join("bare.eth1")]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn devmem_interface_is_named_where_it_binds_another_nic_or_is_ignored() {
    let one = [lane(0, Some("eth1"), &[])];
    assert!(interface_notes(&one, None, &[]).is_empty());
    assert!(interface_notes(&one, Some("eth1"), &[]).is_empty());
    assert_eq!(
        interface_notes(&one, Some("eth2"), &[]),
        ["lane 0 is paired with eth1 but binds devmem_interface eth2 as configured"]
    );
    // Before, ignored without a word on a node of several lanes.
    let two = [lane(0, Some("eth1"), &[]), lane(1, Some("eth2"), &[])];
    let notes = interface_notes(&two, Some("eth1"), &[]);
    assert!(
        notes.len() == 1 && notes[0].starts_with("devmem_interface eth1 is ignored: with 2 lanes"),
        "{notes:?}"
    );
    // devmem_queues too: one lane binds them, several lanes bind shares of their NICs.
    assert!(interface_notes(&one, None, &[14, 15]).is_empty());
    let notes = interface_notes(&two, None, &[14, 15]);
    assert_eq!(
        notes,
        [
            "devmem_queues [14, 15] is ignored: with 2 lanes each binds a share of its NIC's queues \
          (lanes[i].queues chooses them)"
        ]
    );
}

/// A NIC the probe could not judge (its EBADF proves nothing before Linux 6.15, its driver off
/// the known list) gets a real bind when the operator names it, as the probe's reason says;
/// never one the topology paired, nor the first capable NIC from among such.
#[test]
fn a_named_nic_the_probe_could_not_judge_is_tried() {
    let mut unsure = nic("eth1", 16, false);
    unsure.trial_bind.errno = Some(9); // EBADF
    unsure.reason = "cannot tell: kernel 6.12.117 (before 6.15) ...".into();
    let nics = [nic("eth0", 8, false), unsure];
    let picked = super::super::pick_interface(&nics, Some("eth1"), true, true).expect("tried");
    assert_eq!(picked.name, "eth1");
    assert!(matches!(
        super::super::pick_interface(&nics, None, true, false),
        Err(BindingError::NoneCapable { .. })
    ));
    // Paired by the topology, not named: not reconfigured on a guess.
    assert!(matches!(
        super::super::pick_interface(&nics, Some("eth1"), true, false),
        Err(BindingError::NotCapable { .. })
    ));
    // One whose trial bind failed for a reason of its own is still refused when named.
    assert!(matches!(
        super::super::pick_interface(&nics, Some("eth0"), true, true),
        Err(BindingError::NotCapable { .. })
    ));
    // Lanes: one whose table names the NIC (lanes[i].interface) is tried, a paired one not.
    let mut named = lane(0, Some("eth1"), &[]);
    named.named = true;
    let reqs = [named, lane(1, Some("eth1"), &[])];
    let e = plan(&nics, &reqs, None).unwrap_err();
    assert!(e.to_string().contains("eth1"), "{e}");
    let mut one = lane(0, Some("eth1"), &[]);
    one.named = true;
    assert!(plan(&nics, &[one], None).is_ok(), "a named lane is tried");
}

#[test]
fn a_new_setups_port_rules_are_read_back_for_their_lanes() {
    // Before, a setup made for its lanes kept their port rules to itself: a lane deleted
    // while the others stayed left its rule on the NIC until the node stopped.
    let rule = |location, port, queue| nic::Change::Rule {
        location,
        rule: Some(nic::steer::Tcp4Match::port(port)),
        queue: Some(queue),
    };
    let changes = [
        nic::Change::Rss { table: Vec::new() },
        nic::Change::NtupleOn,
        rule(1023, 7400, 8),
        // Another port, another queue, a connection's rule, an entry of an earlier release.
        rule(1022, 7401, 9),
        rule(1021, 7402, 12),
        nic::Change::Rule {
            location: 1020,
            rule: Some(nic::steer::Tcp4Match::flow(nic::steer::Tcp4Flow {
                src: "10.0.0.2:40000".parse().unwrap(),
                dst: "10.0.0.1:7401".parse().unwrap(),
            })),
            queue: Some(12),
        },
        nic::Change::Rule {
            location: 1019,
            rule: None,
            queue: None,
        },
        rule(1018, 7401, 12),
    ];
    let got = port_rules(&changes, &[(7401, 12), (7400, 8), (7403, 14)]);
    let want = |location, port, queue| nic::InsertedRule {
        location,
        rule: nic::steer::Tcp4Match::port(port),
        queue,
    };
    assert_eq!(got, [want(1018, 7401, 12), want(1023, 7400, 8)]);
}

/// A lane joining a NIC set up for another, then leaving while that one stays (its binding
/// deleted over the admin API): its data port's rule leaves the NIC and the journal, the
/// other lane's stays, and the last lane to leave restores the NIC. Before, the leaving
/// lane's rule stayed until the whole setup was restored when the node stopped.
/// `SHARDWIRE_HW_IFNAME` names the NIC (4 or more RX queues; its last two are bound).
#[test]
#[ignore = "needs a devmem-capable NIC, root and /dev/udmabuf (scripts/hw/devmem-check.sh)"]
fn hw_a_lane_leaving_a_shared_nic_deletes_its_port_rule() {
    let name = std::env::var("SHARDWIRE_HW_IFNAME").expect("set SHARDWIRE_HW_IFNAME");
    let rx = std::fs::read_dir(format!("/sys/class/net/{name}/queues"))
        .expect("the interface exists")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
        .count() as u32;
    let mut n = nic(&name, rx, true);
    n.ifindex = std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .expect("the interface exists")
        .trim()
        .parse()
        .expect("an ifindex");
    let ((qa, pa), (qb, pb)) = ((rx - 2, 7490), (rx - 1, 7491));
    let state = std::env::temp_dir().join(format!("sw-kernel-leave-{}.json", std::process::id()));
    let mut a = setup_nic(&n, &[qa], &[(pa, qa)], &state).expect("set up for lane a");
    let ra = bind_lane(&n, &[qa], 16 << 20, &mut a, None).expect("lane a binds");
    let mut b = setup_nic(&n, &[qb], &[(pb, qb)], &state).expect("lane b joins");
    assert!(
        Arc::ptr_eq(a.share(), b.share()),
        "joined, not set up again"
    );
    let rb = bind_lane(&n, &[qb], 16 << 20, &mut b, None).expect("lane b binds");
    let share = Arc::clone(a.share());
    drop((a, b));
    let journaled = |port: u16| {
        let s = share.setup();
        let changes = s.state().map_or(&[][..], |st| &st.changes[..]);
        changes.iter().any(
            |c| matches!(c, nic::Change::Rule { rule: Some(r), .. } if r.dst_port == Some(port)),
        )
    };
    let on_nic = |port: u16, queue: u32| {
        let eth = nic::EthtoolClient::open().expect("ethtool netlink");
        let m = nic::steer::Tcp4Match::port(port);
        !eth.find_rules(&name, &m, queue)
            .expect("rules listed")
            .is_empty()
    };
    assert!(journaled(pb) && on_nic(pb, qb), "lane b's port steered");
    rb.unbind();
    drop(rb);
    assert!(!journaled(pb), "lane b's rule left the journal");
    assert!(!on_nic(pb, qb), "and the NIC");
    assert!(journaled(pa) && on_nic(pa, qa), "lane a's stays");
    assert_eq!(in_use(&name), [qa]);
    ra.unbind();
    drop(ra);
    assert!(
        share.setup().state().is_none(),
        "the last lane restored the NIC"
    );
    assert!(!on_nic(pa, qa));
    assert!(!state.exists());
}

/// A lane joining a NIC set up for another on a queue past the NIC's RX channels: the join
/// raises them (journaled), as a new setup does, and the last lane to leave puts them back.
/// Before, the join only steered, and the NIC refused the port rule onto that queue with a
/// bare `ntuple-rule-insert: EINVAL`. `SHARDWIRE_HW_IFNAME` names the NIC (2 or more RX
/// queues, room for one more); its last queue and the one past it are bound.
#[test]
#[ignore = "needs a devmem-capable NIC, root and /dev/udmabuf (scripts/hw/devmem-check.sh)"]
fn hw_a_lane_joining_past_the_nics_channels_raises_them_until_the_last_leaves() {
    let name = std::env::var("SHARDWIRE_HW_IFNAME").expect("set SHARDWIRE_HW_IFNAME");
    let ifindex: u32 = std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .expect("the interface exists")
        .trim()
        .parse()
        .expect("an ifindex");
    let mut eth = nic::EthtoolClient::open().expect("ethtool netlink");
    let before = eth.channels(ifindex, &name).expect("channels-get");
    let rx = before.rx_queues();
    let mut n = nic(&name, rx, true);
    n.ifindex = ifindex;
    let ((qa, pa), (qb, pb)) = ((rx - 1, 7492), (rx, 7493));
    let state = std::env::temp_dir().join(format!("sw-kernel-raise-{}.json", std::process::id()));
    let mut a = setup_nic(&n, &[qa], &[(pa, qa)], &state).expect("set up for lane a");
    let ra = bind_lane(&n, &[qa], 16 << 20, &mut a, None).expect("lane a binds");
    let mut b = setup_nic(&n, &[qb], &[(pb, qb)], &state).expect("lane b joins past the count");
    let now = eth.channels(ifindex, &name).expect("channels-get");
    assert_eq!(now.rx_queues(), rx + 1, "raised for queue {qb}");
    let rb = bind_lane(&n, &[qb], 16 << 20, &mut b, None).expect("lane b binds");
    drop((a, b));
    rb.unbind();
    drop(rb);
    let kept = eth.channels(ifindex, &name).expect("channels-get");
    assert_eq!(
        kept.rx_queues(),
        rx + 1,
        "kept while lane a holds the setup"
    );
    ra.unbind();
    drop(ra);
    let after = eth.channels(ifindex, &name).expect("channels-get");
    assert_eq!(after.rx_queues(), rx, "put back by the last lane");
    assert!(!state.exists());
}
