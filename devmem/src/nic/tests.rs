//! NIC setup against the real kernel: a veth pair in a fresh network namespace (veth has
//! real channel counts to change, and no ring parameters, like any driver without header
//! split).

use super::undo::{
    UndoOps, pending_rule_candidates, rules_deleted_by, settle_undo, undo, warn_left,
    warn_undo_failed,
};
use super::*;
use crate::testutil::Netns;

fn veth() -> (Netns, u32) {
    let ns = Netns::new();
    ns.ip(&[
        "link",
        "add",
        "va",
        "numrxqueues",
        "4",
        "numtxqueues",
        "4",
        "type",
        "veth",
        "peer",
        "name",
        "vb",
        "numrxqueues",
        "4",
        "numtxqueues",
        "4",
    ]);
    let va = ns.ifindex("va");
    (ns, va)
}

/// The errno of a kernel refusal.
fn kernel_errno(e: &NicError) -> Option<i32> {
    match e {
        NicError::Kernel { errno, .. } => Some(*errno),
        _ => None,
    }
}

fn state_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("sw-nic-{tag}-{}.json", std::process::id()))
}

#[test]
fn channels_are_read_and_changed_on_veth() {
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let ch = c.channels(va, "va").unwrap();
    eprintln!("veth channels: {ch:?}");
    assert_eq!(ch.rx_max, 4);
    c.set_channels(va, "va", 1, ch.tx, ch.combined).unwrap();
    assert_eq!(c.channels(va, "va").unwrap().rx, 1);
    let e = c.set_channels(va, "va", 9, ch.tx, ch.combined).unwrap_err();
    eprintln!("{e}");
    assert!(
        matches!(
            e,
            NicError::Kernel {
                errno: libc::EINVAL,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("va: ethtool channels-set: EINVAL"),
        "{e}"
    );
}

#[test]
fn header_split_on_a_driver_without_ring_parameters_names_the_cause() {
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let e = c.rings(va, "va").unwrap_err();
    assert!(
        matches!(
            e,
            NicError::Kernel {
                errno: libc::EOPNOTSUPP,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("header split cannot be turned on"),
        "{e}"
    );
}

#[test]
fn a_failed_setup_undoes_what_it_changed_and_leaves_no_state_file() {
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let before = c.channels(va, "va").unwrap();
    c.set_channels(va, "va", 1, before.tx, before.combined)
        .unwrap();
    let state = state_path("fail");
    let plan = SetupPlan {
        ifname: "va".into(),
        ifindex: va,
        queues: vec![2, 3],
        netns: Some(ns.path()),
        steer: Vec::new(),
    };
    // Channels are raised to 4 (queue 3 needs them), then header split fails on veth.
    let e = apply(&plan, &state).unwrap_err();
    assert!(e.to_string().contains("rings-get"), "{e}");
    assert_eq!(c.channels(va, "va").unwrap().rx, 1, "channels put back");
    assert!(!state.exists(), "state file removed after the undo");

    let too_many = SetupPlan {
        queues: vec![7],
        ..plan
    };
    let e = apply(&too_many, &state).unwrap_err();
    assert!(
        matches!(
            e,
            NicError::NotEnoughQueues {
                queue: 7,
                max: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(!state.exists());
}

#[test]
fn changes_left_by_a_crash_are_restored_from_the_state_file() {
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let before = c.channels(va, "va").unwrap();
    let state = state_path("crash");
    let _ = std::fs::remove_file(&state);
    let mut j = Journal::create(&state, "va", va, Some(ns.path())).unwrap();
    j.set_channels(&mut c, 2, before.tx, before.combined)
        .unwrap();
    assert_eq!(c.channels(va, "va").unwrap().rx, 2);
    // While the journal lives (its process runs), another process's restore leaves it alone.
    let live = restore_from(&state).unwrap_err();
    assert!(matches!(live, NicError::StateInUse(_)), "{live}");
    assert_eq!(
        c.channels(va, "va").unwrap().rx,
        2,
        "the live setup is untouched"
    );
    // The process "dies" here: nothing restores, only the file remains.
    drop(j);
    assert!(state.exists());
    let again = Journal::create(&state, "va", va, None).unwrap_err();
    assert!(matches!(again, NicError::StateExists(_)), "{again}");

    let Some(Restore::Undone(restored)) = restore_from(&state).unwrap() else {
        panic!("a state file, undone")
    };
    assert_eq!(
        restored.changes,
        [Change::Channels {
            rx: before.rx,
            tx: before.tx,
            combined: before.combined
        }]
    );
    assert_eq!(
        c.channels(va, "va").unwrap(),
        before,
        "the NIC is as it was"
    );
    assert!(!state.exists());
    assert_eq!(
        restore_from(&state).unwrap(),
        None,
        "nothing to do the second time"
    );

    std::fs::write(&state, b"{ not json").unwrap();
    let e = restore_from(&state).unwrap_err();
    assert!(
        e.to_string().contains("not a shardwire NIC state file"),
        "{e}"
    );
    std::fs::remove_file(&state).unwrap();
}

#[test]
fn steering_on_a_driver_without_ntuple_or_rss_names_the_cause() {
    let (ns, _va) = veth();
    let c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    assert!(
        !c.ntuple_enabled("va").unwrap(),
        "veth starts with ntuple off"
    );
    let e = c.set_ntuple("va", true).unwrap_err();
    assert!(
        matches!(
            e,
            NicError::Kernel {
                errno: libc::EOPNOTSUPP,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("no ntuple filters"), "{e}");
    let e = c.insert_tcp4_rule("va", 7401, 1).unwrap_err();
    assert!(
        e.to_string()
            .contains("va: ethtool ntuple-rule-count: EOPNOTSUPP"),
        "{e}"
    );
    // One connection's 5-tuple rule (what a devmem lane installs per data connection).
    let flow = steer::Tcp4Flow {
        src: "10.0.0.2:40000".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    };
    let e = c.insert_tcp4_flow_rule("va", flow, 2).unwrap_err();
    assert_eq!(kernel_errno(&e), Some(libc::EOPNOTSUPP), "{e}");
    assert!(
        e.to_string()
            .contains("va: ethtool ntuple-rule-count: EOPNOTSUPP"),
        "{e}"
    );
    let e = c.rss_indir("va").unwrap_err();
    assert!(e.to_string().contains("no RSS indirection table"), "{e}");
    let e = c.ntuple_enabled("nosuch0").unwrap_err();
    assert!(
        matches!(
            e,
            NicError::Kernel {
                errno: libc::ENODEV,
                ..
            }
        ),
        "{e}"
    );
    assert!(c.ntuple_enabled("a-name-that-is-far-too-long").is_err());
}

#[test]
fn a_refused_connection_rule_leaves_the_journal_as_it_was() {
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let path = state_path("flow");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", va, Some(ns.path())).unwrap();
    let flow = steer::Tcp4Flow {
        src: "10.0.0.2:40001".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    };
    let e = j.add_flow(&mut c, flow, 1).unwrap_err();
    assert!(e.to_string().contains("ntuple-rule-count"), "{e}");
    assert!(j.state().changes.is_empty(), "{:?}", j.state().changes);
    let on_disk: StateFile = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert!(on_disk.changes.is_empty());
    // Removing a rule on a NIC without ntuple names the NIC's refusal too (the check of
    // what is at the rule's location, before any delete).
    let rule = InsertedRule {
        location: 5,
        rule: steer::Tcp4Match::flow(flow),
        queue: 1,
    };
    let e = j.remove_flow(&mut c, rule).unwrap_err();
    assert!(
        e.to_string().contains("va: ethtool ntuple-rule-count"),
        "{e}"
    );
    j.restore(&mut c).unwrap();
    assert!(!path.exists());
}

#[test]
fn a_live_setup_raises_its_channels_for_queues_past_them_journaled() {
    // Before, only `apply` raised channels: a lane joining a live setup on queues past the
    // NIC's count only steered, and the NIC refused its port rule with a bare EINVAL.
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let before = c.channels(va, "va").unwrap();
    c.set_channels(va, "va", 2, before.tx, before.combined)
        .unwrap();
    let state = state_path("ensure");
    let _ = std::fs::remove_file(&state);
    let mut setup = NicSetup {
        journal: Some(Journal::create(&state, "va", va, Some(ns.path())).unwrap()),
        client: EthtoolClient::open_in_netns(&ns.path()).unwrap(),
        not_configured: String::new(),
    };
    setup.ensure_queues(2).unwrap();
    assert!(
        on_disk(&state).is_empty(),
        "enough already: nothing journaled"
    );
    setup.ensure_queues(4).unwrap();
    assert_eq!(c.channels(va, "va").unwrap().rx, 4, "raised for queue 3");
    let raised = [Change::Channels {
        rx: 2,
        tx: before.tx,
        combined: before.combined,
    }];
    assert_eq!(
        on_disk(&state),
        raised,
        "journaled with the counts it replaced"
    );
    // Past the NIC's maximum: refused by name, nothing journaled or changed.
    let e = setup.ensure_queues(9).unwrap_err();
    assert!(
        matches!(
            e,
            NicError::NotEnoughQueues {
                queue: 8,
                max: 4,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(on_disk(&state), raised);
    setup.restore().unwrap();
    assert_eq!(
        c.channels(va, "va").unwrap().rx,
        2,
        "put back with the setup"
    );
    assert!(!state.exists());
}

#[test]
fn channels_are_raised_in_the_kind_the_nic_uses_within_that_kinds_maximum() {
    let ch = |rx, tx, combined, rx_max, combined_max| Channels {
        rx,
        tx,
        combined,
        rx_max,
        tx_max: rx_max,
        combined_max,
    };
    let ask = |c: &Channels, need| channels_request("eth1", c, need);
    // bnxt in RX/TX mode (`ethtool -L eth1 combined 0 rx 8 tx 8`): RX-only channels are
    // raised. Before, combined was raised beside them (8/8/12), which bnxt refuses.
    let bnxt = ch(8, 8, 0, 16, 16);
    assert_eq!(ask(&bnxt, 12).unwrap(), Some((12, 8, 0)));
    // Combined mode: combined channels are raised.
    let mlx = ch(0, 0, 8, 0, 16);
    assert_eq!(ask(&mlx, 12).unwrap(), Some((0, 0, 12)));
    assert_eq!(ask(&mlx, 8).unwrap(), None, "enough already");
    // Combined mode with more RX-only channels allowed than combined ones: the combined
    // maximum is the limit. Before, the check passed on rx_max and sent combined 12 > 8.
    let e = ask(&ch(0, 0, 4, 16, 8), 12).unwrap_err();
    assert!(
        matches!(
            e,
            NicError::NotEnoughQueues {
                queue: 11,
                max: 8,
                kind: "combined",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("ethtool -l eth1"), "{e}");
    // RX-only mode (veth): the RX maximum is the limit.
    let e = ask(&ch(1, 1, 0, 4, 0), 8).unwrap_err();
    assert!(
        matches!(
            e,
            NicError::NotEnoughQueues {
                max: 4,
                kind: "RX-only",
                ..
            }
        ),
        "{e}"
    );
    // The hint names no cause that only a lowering can have.
    let e = refused("channels-set", libc::EINVAL);
    assert!(!e.to_string().contains("memory provider"), "{e}");
    assert!(e.to_string().contains("ethtool -l"), "{e}");
}

#[test]
fn steering_onto_queue_zero_is_refused_before_the_nic_is_touched() {
    assert_eq!(rss_bound("eth1", &[9, 8, 11]).unwrap(), Some(8));
    assert_eq!(rss_bound("eth1", &[]).unwrap(), None);
    let e = rss_bound("eth1", &[1, 0]).unwrap_err();
    let NicError::QueueZeroBound { ifname, queues } = &e else {
        panic!("{e}")
    };
    assert_eq!((ifname.as_str(), queues.as_slice()), ("eth1", &[1, 0][..]));
    assert!(e.to_string().contains("bind queues from 1 up"), "{e}");
    // Before, RSS over `0..0` meant "leave RSS alone": the bind went on with every flow
    // still spread over the bound queues.
    let state = state_path("queue0");
    let _ = std::fs::remove_file(&state);
    let plan = SetupPlan {
        ifname: "sw-noif0".into(),
        ifindex: u32::MAX,
        queues: vec![0, 1],
        netns: None,
        steer: vec![(7401, 0)],
    };
    let e = apply(&plan, &state).unwrap_err();
    assert!(matches!(e, NicError::QueueZeroBound { .. }), "{e}");
    assert!(!state.exists(), "refused before a journal was made");
}

#[test]
fn header_split_sends_hds_thresh_only_where_the_driver_reports_one() {
    // gve and idpf report tcp-data-split but no hds-thresh; a rings-set carrying hds-thresh
    // is refused by the kernel (EOPNOTSUPP "setting hds-thresh is not supported"). Before,
    // it was always sent: devmem could not start on them.
    let rings = |split, thresh| Rings {
        tcp_data_split: split,
        hds_thresh: thresh,
    };
    assert_eq!(header_split_request(&rings(1, None)), Some(None));
    assert_eq!(header_split_request(&rings(0, None)), Some(None));
    assert_eq!(header_split_request(&rings(1, Some(256))), Some(Some(0)));
    assert_eq!(header_split_request(&rings(2, Some(256))), Some(Some(0)));
    assert_eq!(header_split_request(&rings(2, Some(0))), None);
    assert_eq!(header_split_request(&rings(2, None)), None);
}

#[test]
fn a_state_file_whose_interface_changed_undoes_nothing_and_stays() {
    // Before, channels and rings were restored by the recorded index, and RSS and rules by
    // the recorded name, onto whatever NIC has them now.
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let before = c.channels(va, "va").unwrap();
    let state = state_path("mismatch");
    let _ = std::fs::remove_file(&state);
    let mut j = Journal::create(&state, "va", va, Some(ns.path())).unwrap();
    j.set_channels(&mut c, 2, before.tx, before.combined)
        .unwrap();
    drop(j);
    // As if va had been reloaded since (a new index): the file's index is not va's.
    let mut st: StateFile = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    st.ifindex = va + 100;
    std::fs::write(&state, serde_json::to_vec(&st).unwrap()).unwrap();
    let e = restore_from(&state).unwrap_err();
    assert!(
        matches!(&e, NicError::StateMismatch { recorded, found: Some(f), .. } if *recorded == va + 100 && *f == va),
        "{e}"
    );
    assert!(state.exists(), "kept for the operator");
    assert_eq!(c.channels(va, "va").unwrap().rx, 2, "nothing undone");
    // Renamed: no interface has the recorded name.
    let mut st: StateFile = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    st.ifindex = va;
    std::fs::write(&state, serde_json::to_vec(&st).unwrap()).unwrap();
    ns.ip(&["link", "set", "va", "name", "vz"]);
    let e = restore_from(&state).unwrap_err();
    assert!(
        matches!(&e, NicError::StateMismatch { found: None, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("no interface is named va"), "{e}");
    std::fs::remove_file(&state).unwrap();
}

#[test]
fn a_state_file_from_before_the_last_reboot_is_removed_without_undoing() {
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let before = c.channels(va, "va").unwrap();
    let state = state_path("reboot");
    let _ = std::fs::remove_file(&state);
    let mut j = Journal::create(&state, "va", va, Some(ns.path())).unwrap();
    assert!(j.state().boot_id.is_some(), "this kernel has a boot id");
    j.set_channels(&mut c, 2, before.tx, before.combined)
        .unwrap();
    drop(j);
    let mut st: StateFile = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    st.boot_id = Some("an earlier boot".into());
    std::fs::write(&state, serde_json::to_vec(&st).unwrap()).unwrap();
    assert!(matches!(
        restore_from(&state).unwrap(),
        Some(Restore::Stale(_))
    ));
    assert!(!state.exists());
    assert_eq!(
        c.channels(va, "va").unwrap().rx,
        2,
        "what was set since stays"
    );
}

#[test]
fn each_journal_has_its_own_temporary_file() {
    // Before, `bare.eth0` and `bare.eth1` (a base without an extension) shared `bare.tmp`.
    let (a, b) = (Path::new("/x/bare.eth0"), Path::new("/x/bare.eth1"));
    assert_ne!(tmp_path(a), tmp_path(b));
    assert_eq!(
        tmp_path(Path::new("/x/nic-state.eth1.json")),
        Path::new("/x/nic-state.eth1.json.tmp")
    );
}

/// The changes the state file at `path` holds now.
fn on_disk(path: &Path) -> Vec<Change> {
    let st: StateFile = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    st.changes
}

#[test]
fn a_rule_is_journaled_before_it_is_inserted() {
    // Before, the rule was inserted first and journaled after: a kill in between left a
    // rule no restore knew of (once per data connection).
    let path = state_path("rule-first");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let m = steer::Tcp4Match::flow(steer::Tcp4Flow {
        src: "10.0.0.2:40002".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    });
    let rule_at = |location| Change::Rule {
        location,
        rule: Some(m),
        queue: Some(if location == 1021 { 2 } else { 3 }),
    };
    let known = rule_at(1021);
    let l = j
        .insert_journaled(
            Some(1021),
            Vec::new(),
            m,
            2,
            |at| {
                assert_eq!(
                    on_disk(&path),
                    std::slice::from_ref(&known),
                    "saved before the insert"
                );
                Ok(at.unwrap())
            },
            |_| panic!("nothing to delete"),
        )
        .unwrap();
    assert_eq!(l, 1021);
    // The driver picks the location: a marker with the rule's match (and the rule that
    // matched already, at 4: someone else's) first, then resolved.
    let pending = Change::PendingRule {
        rule: m,
        queue: 3,
        existing: vec![4],
    };
    let l = j
        .insert_journaled(
            None,
            vec![4],
            m,
            3,
            |at| {
                assert_eq!(at, None);
                assert_eq!(on_disk(&path), [known.clone(), pending.clone()]);
                Ok(7)
            },
            |_| panic!("nothing to delete"),
        )
        .unwrap();
    assert_eq!(l, 7);
    let both = [known.clone(), rule_at(7)];
    assert_eq!(on_disk(&path), both);
    // A refused insertion leaves no entry, on disk or in memory.
    for at in [None, Some(9)] {
        let e = j
            .insert_journaled(
                at,
                Vec::new(),
                m,
                3,
                |_| Err(NicError::Restored),
                |_| panic!("not in"),
            )
            .unwrap_err();
        assert!(matches!(e, NicError::Restored), "{e}");
        assert_eq!(on_disk(&path), both);
        assert_eq!(j.state().changes, both);
    }
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_partly_failed_restore_keeps_only_the_steps_that_failed() {
    // Before, a restore with one failed step kept the whole journal, and the next start
    // undid the finished steps again (channels set since were overwritten, a deleted rule's
    // reused location deleted again).
    let (ns, va) = veth();
    let mut c = EthtoolClient::open_in_netns(&ns.path()).unwrap();
    let before = c.channels(va, "va").unwrap();
    let state = state_path("partial");
    let _ = std::fs::remove_file(&state);
    let mut j = Journal::create(&state, "va", va, Some(ns.path())).unwrap();
    j.set_channels(&mut c, 2, before.tx, before.combined)
        .unwrap();
    // veth has no ntuple rules: undoing these fails (EOPNOTSUPP).
    let rule = Change::Rule {
        location: 5,
        rule: None,
        queue: None,
    };
    let pending = Change::PendingRule {
        rule: steer::Tcp4Match::port(7401),
        queue: 1,
        existing: Vec::new(),
    };
    j.record(rule.clone()).unwrap();
    j.record(pending.clone()).unwrap();
    let e = j.restore(&mut c).unwrap_err();
    assert!(e.to_string().contains("va: ethtool ntuple-rule"), "{e}");
    assert_eq!(c.channels(va, "va").unwrap(), before, "channels put back");
    let failed = [rule, pending];
    assert_eq!(on_disk(&state), failed, "only the failed steps are left");
    // The retry at the next start redoes only those: channels set since stay.
    c.set_channels(va, "va", 3, before.tx, before.combined)
        .unwrap();
    let e = restore_from(&state).unwrap_err();
    assert!(e.to_string().contains("ntuple-rule"), "{e}");
    assert_eq!(c.channels(va, "va").unwrap().rx, 3, "not undone twice");
    assert_eq!(on_disk(&state), failed);
    std::fs::remove_file(&state).unwrap();
}

/// A rule entry names what it steers (its undo deletes only that rule at its location); a
/// state file of an earlier release, without it, still reads.
#[test]
fn rule_entries_carry_their_match_and_old_ones_still_read() {
    let old: Change = serde_json::from_str(r#"{"step":"rule","location":5}"#).unwrap();
    assert_eq!(
        old,
        Change::Rule {
            location: 5,
            rule: None,
            queue: None
        }
    );
    let new = Change::Rule {
        location: 7,
        rule: Some(steer::Tcp4Match::port(7401)),
        queue: Some(3),
    };
    let json = serde_json::to_string(&new).unwrap();
    assert!(
        json.contains("\"queue\":3") && json.contains("7401"),
        "{json}"
    );
    assert_eq!(serde_json::from_str::<Change>(&json).unwrap(), new);
}

#[test]
fn removing_a_rule_drops_its_own_entry_not_another_at_its_location() {
    // Before, `remove_flow` took a location only and dropped the last entry there: after
    // A's rule vanished and B's took its location, A's close dropped B's entry (and deleted
    // B's rule), and A's stale entry stayed.
    let path = state_path("remove-own");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let rule = |src: &str, queue| InsertedRule {
        location: 1023,
        rule: steer::Tcp4Match::flow(steer::Tcp4Flow {
            src: src.parse().unwrap(),
            dst: "10.0.0.1:7401".parse().unwrap(),
        }),
        queue,
    };
    let (a, b) = (rule("10.0.0.2:40003", 2), rule("10.0.0.2:40004", 3));
    j.record(a.change()).unwrap();
    j.record(b.change()).unwrap();
    // A failed delete keeps the entry, for the restore.
    let e = j
        .remove_journaled(a, || Err(NicError::Restored))
        .unwrap_err();
    assert!(matches!(e, NicError::Restored), "{e}");
    assert_eq!(on_disk(&path), [a.change(), b.change()]);
    let removed = || -> Result<RuleUndo, NicError> { Ok(RuleUndo::Removed) };
    assert_eq!(j.remove_journaled(a, removed).unwrap(), RuleUndo::Removed);
    assert_eq!(on_disk(&path), [b.change()], "B's entry stays");
    assert_eq!(j.state().changes, [b.change()]);
    // A rule of the same location and match but another queue is not B's either.
    j.remove_journaled(InsertedRule { queue: 9, ..b }, removed)
        .unwrap();
    assert_eq!(on_disk(&path), [b.change()]);
    j.remove_journaled(b, removed).unwrap();
    assert!(on_disk(&path).is_empty());
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_state_file_without_changes_is_removed_without_finding_its_interface() {
    // Before, an empty journal (a crash right after it was made) had to pass the interface
    // check and open its namespace: a renamed NIC or a gone namespace kept it for good, and
    // every later setup was refused with StateExists.
    let path = state_path("empty");
    let _ = std::fs::remove_file(&path);
    let st = StateFile {
        ifname: "gone0".into(),
        ifindex: 4242,
        netns: Some(PathBuf::from("/nonexistent/shardwire-test-netns")),
        boot_id: boot_id(),
        changes: Vec::new(),
    };
    write_state(&path, &st).unwrap();
    assert_eq!(restore_from(&path).unwrap(), Some(Restore::Undone(st)));
    assert!(!path.exists());
    let j = Journal::create(&path, "gone0", 4242, None).unwrap();
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_pending_rule_undo_leaves_the_rules_that_matched_before_it() {
    // Before, the one rule matching a pending entry was deleted even when it was an
    // operator's identical rule, there before shardwire's insertion began.
    assert_eq!(
        pending_rule_candidates(vec![5], &[5], &[]),
        (vec![], vec![5])
    );
    assert_eq!(
        pending_rule_candidates(vec![5, 9], &[5], &[]),
        (vec![9], vec![5])
    );
    assert_eq!(
        pending_rule_candidates(vec![9], &[], &[]),
        (vec![9], vec![])
    );
    assert_eq!(
        pending_rule_candidates(vec![9, 11], &[5], &[]),
        (vec![9, 11], vec![]),
        "a rule recorded as there before but gone since is no reason to keep others"
    );
    // A pending entry of an earlier release, without `existing`, still reads.
    let old: Change =
        serde_json::from_str(r#"{"step":"pending-rule","rule":{"src_ip":null,"dst_ip":null,"src_port":null,"dst_port":7401},"queue":1}"#)
            .unwrap();
    assert_eq!(
        old,
        Change::PendingRule {
            rule: steer::Tcp4Match::port(7401),
            queue: 1,
            existing: Vec::new(),
        }
    );
}

#[test]
fn a_rule_left_on_the_nic_is_returned_for_the_caller_to_log() {
    // Before, the undo of a closed connection's rule printed a plain-text warning itself
    // (into the node's JSON log, and without the restore's prefix) and returned nothing.
    let path = state_path("left");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let a = InsertedRule {
        location: 1022,
        rule: steer::Tcp4Match::port(7401),
        queue: 2,
    };
    j.record(a.change()).unwrap();
    let left = RuleUndo::NotOurs { location: 1022 };
    let done = j.remove_journaled(a, || Ok(left.clone())).unwrap();
    assert_eq!(done, left);
    assert!(
        on_disk(&path).is_empty(),
        "the entry is dropped: the rule is not ours"
    );
    assert_eq!(
        left.to_string(),
        "the rule at location 1022 is not the one shardwire journaled there (its own was never inserted, or is gone); left as it is"
    );
    let prior = RuleUndo::PriorLeft {
        locations: vec![4, 5],
    };
    assert!(prior.to_string().contains("[4, 5]"), "{prior}");
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_connection_rule_is_inserted_without_reading_every_rule_on_the_nic() {
    // Before, every connection's rule on a driver that picks locations first read every
    // rule on the NIC (one per live connection) to record those that matched already.
    let path = state_path("prior");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let m = steer::Tcp4Match::flow(steer::Tcp4Flow {
        src: "10.0.0.2:40005".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    });
    let other = steer::Tcp4Match::port(7401);
    let entry = |location, rule: Option<steer::Tcp4Match>, queue| Change::Rule {
        location,
        rule,
        queue: rule.map(|_| queue),
    };
    // This journal's own rule for the same 4-tuple (an earlier connection's, whose delete
    // failed) at 12; not the same rule: another queue, another match, an old entry.
    for c in [
        entry(12, Some(m), 2),
        entry(13, Some(m), 3),
        entry(14, Some(other), 2),
        entry(15, None, 2),
    ] {
        j.record(c).unwrap();
    }
    let not_read = || -> Result<Vec<u32>, NicError> { panic!("the NIC's rules were read") };
    let flow = j.prior_rules(RuleKind::Flow, None, &m, 2, not_read);
    assert_eq!(flow.unwrap(), [12], "only the journal's own");
    // A port rule's are read from the NIC: an operator's identical rule may be there.
    let port = j.prior_rules(RuleKind::Port, None, &other, 2, || Ok(vec![4]));
    assert_eq!(port.unwrap(), [4]);
    for kind in [RuleKind::Flow, RuleKind::Port] {
        let placed = j.prior_rules(kind, Some(9), &m, 2, not_read);
        assert!(
            placed.unwrap().is_empty(),
            "no marker where the location is chosen"
        );
    }
    // A crash mid-insertion: the marker's undo takes the new rule (30) for the one being
    // added and leaves 12 to its own entry, rather than refusing both as ambiguous (and
    // names it in no warning: its entry deletes it).
    let owned = rules_deleted_by(&j.state().changes, &m, 2);
    assert_eq!(
        pending_rule_candidates(vec![12, 30], &[12], &owned),
        (vec![30], vec![])
    );
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_crash_mid_insertion_warns_of_no_rule_its_own_restore_deletes() {
    // Before, with a connection's rule whose delete had failed (its entry at 12 stays) and a
    // new connection of the same 4-tuple stopped mid-insertion, the restore undid the marker
    // first and warned that the rule at 12 was there before and stays (PriorLeft); the next
    // step of the same restore, 12's own entry, then deleted it.
    let path = state_path("prior-left");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let m = steer::Tcp4Match::flow(steer::Tcp4Flow {
        src: "10.0.0.2:40006".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    });
    let earlier = InsertedRule {
        location: 12,
        rule: m,
        queue: 2,
    };
    j.record(earlier.change()).unwrap();
    let not_read = || -> Result<Vec<u32>, NicError> { panic!("the NIC's rules were read") };
    let existing = j
        .prior_rules(RuleKind::Flow, None, &m, 2, not_read)
        .unwrap();
    assert_eq!(existing, [12]);
    // What a crash while the driver inserts the rule leaves on disk.
    let mut crashed = None;
    let l = j
        .insert_journaled(
            None,
            existing,
            m,
            2,
            |_| {
                crashed = Some(on_disk(&path));
                Ok(30)
            },
            |_| panic!("resolved and saved"),
        )
        .unwrap();
    assert_eq!(l, 30);
    let crashed = crashed.unwrap();
    assert_eq!(crashed.len(), 2, "{crashed:?}");
    assert_eq!(crashed[0], earlier.change());
    let Change::PendingRule {
        rule,
        queue,
        existing,
    } = &crashed[1]
    else {
        panic!("{crashed:?}")
    };
    // The restore undoes the marker first; the entry before it comes next.
    let owned = rules_deleted_by(&crashed[..1], rule, *queue);
    assert_eq!(owned, [12], "the earlier entry deletes the rule at 12");
    assert_eq!(
        pending_rule_candidates(vec![12, 30], existing, &owned),
        (vec![30], vec![]),
        "30 is the one being added; 12 is left to its entry and named in no warning"
    );
    assert_eq!(
        pending_rule_candidates(vec![12], existing, &owned),
        (vec![], vec![]),
        "never inserted: nothing to delete, and nothing stays"
    );
    // An operator's identical rule (4, on the NIC before) still stays, and is named.
    assert_eq!(
        pending_rule_candidates(vec![4, 12, 30], &[4, 12], &owned),
        (vec![30], vec![4])
    );
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn the_rules_a_restore_deletes_by_their_own_entries_are_those_of_the_same_match() {
    let m = steer::Tcp4Match::flow(steer::Tcp4Flow {
        src: "10.0.0.2:40007".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    });
    let entry = |location, rule, queue| Change::Rule {
        location,
        rule,
        queue,
    };
    let entries = [
        entry(12, Some(m), Some(2)),
        // Another queue, another match: their undo leaves a rule of `m` onto 2 (NotOurs).
        entry(13, Some(m), Some(3)),
        entry(14, Some(steer::Tcp4Match::port(7401)), Some(2)),
        // An entry of an earlier release: deleted unchecked.
        entry(15, None, None),
        Change::NtupleOn,
        Change::PendingRule {
            rule: m,
            queue: 2,
            existing: vec![16],
        },
    ];
    assert_eq!(rules_deleted_by(&entries, &m, 2), [12, 15]);
    // A marker of an earlier release (no `existing`) matched by the rule an entry deletes
    // and one other: that other is deleted. Before, both were taken for the marker's, and
    // the restore refused them as ambiguous.
    assert_eq!(
        pending_rule_candidates(vec![15, 30], &[], &[12, 15]),
        (vec![30], vec![])
    );
}

/// The fields of the `tracing` events `f` emits on this thread: (name, value) pairs, each
/// value as the log shows it (`%` fields by their `Display`).
fn events_of(f: impl FnOnce()) -> Vec<Vec<(String, String)>> {
    use std::sync::{Arc, Mutex};
    type Events = Arc<Mutex<Vec<Vec<(String, String)>>>>;
    struct Collect(Events);
    struct Fields(Vec<(String, String)>);
    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.push((field.name().to_owned(), format!("{value:?}")));
        }
    }
    impl tracing::Subscriber for Collect {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut fields = Fields(Vec::new());
            event.record(&mut fields);
            self.0.lock().unwrap().push(fields.0);
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    let events = Events::default();
    tracing::subscriber::with_default(Collect(events.clone()), f);
    events.lock().unwrap().clone()
}

/// The value of field `name` in `event`.
fn field<'a>(event: &'a [(String, String)], name: &str) -> Option<&'a str> {
    event
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn a_restore_warns_through_tracing_with_structured_fields() {
    // Before, these went to stderr as plain text (`eprintln!`), into the node's JSON log,
    // and no tracing event was emitted.
    let not_ours = RuleUndo::NotOurs { location: 1022 };
    let events = events_of(|| warn_left("va", &not_ours));
    let [event] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert_eq!(field(event, "ifname"), Some("va"));
    assert_eq!(field(event, "location"), Some("1022"));
    assert_eq!(field(event, "outcome"), Some(not_ours.to_string().as_str()));

    let prior = RuleUndo::PriorLeft {
        locations: vec![4, 5],
    };
    let events = events_of(|| warn_left("va", &prior));
    let [event] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert_eq!(field(event, "locations"), Some("[4, 5]"));
    assert_eq!(field(event, "outcome"), Some(prior.to_string().as_str()));

    assert!(events_of(|| warn_left("va", &RuleUndo::Removed)).is_empty());

    let e = NicError::AmbiguousRule {
        ifname: "va".into(),
        locations: vec![7, 9],
    };
    let events = events_of(|| warn_undo_failed("va", &e));
    let [event] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert_eq!(field(event, "ifname"), Some("va"));
    assert_eq!(field(event, "error"), Some(e.to_string().as_str()));
}

/// A NIC for a restore driven without a kernel ([`UndoOps`]): its ntuple rules (location,
/// match, queue) and those deleted, in order. Turning ntuple off is refused (EBUSY), to make
/// a step fail; the other settings are taken as put back.
#[derive(Default)]
struct FakeNic {
    rules: std::cell::RefCell<Vec<(u32, steer::Tcp4Match, u32)>>,
    deleted: std::cell::RefCell<Vec<u32>>,
}

impl FakeNic {
    fn with_rules(rules: &[(u32, steer::Tcp4Match, u32)]) -> Self {
        Self {
            rules: rules.to_vec().into(),
            ..Self::default()
        }
    }
}

/// A kernel refusal of `op` with `errno`.
fn refused(op: &'static str, errno: i32) -> NicError {
    NicError::Kernel {
        ifname: "va".into(),
        op,
        errno,
        errno_name: crate::errno_label(errno),
        msg: None,
    }
}

impl UndoOps for FakeNic {
    fn set_ntuple(&self, _: &str, _: bool) -> Result<(), NicError> {
        Err(refused("ntuple-set", libc::EBUSY))
    }

    fn find_rules(&self, _: &str, m: &steer::Tcp4Match, queue: u32) -> Result<Vec<u32>, NicError> {
        let rules = self.rules.borrow();
        let matching = rules.iter().filter(|(_, r, q)| r == m && *q == queue);
        Ok(matching.map(|(l, ..)| *l).collect())
    }

    fn rule_at_is(
        &self,
        _: &str,
        location: u32,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Option<bool>, NicError> {
        let rules = self.rules.borrow();
        let at = rules.iter().find(|(l, ..)| *l == location);
        Ok(at.map(|(_, r, q)| r == m && *q == queue))
    }

    fn delete_rule(&self, _: &str, location: u32) -> Result<(), NicError> {
        let mut rules = self.rules.borrow_mut();
        let Some(at) = rules.iter().position(|(l, ..)| *l == location) else {
            return Err(refused("ntuple-rule-delete", libc::ENOENT));
        };
        rules.remove(at);
        self.deleted.borrow_mut().push(location);
        Ok(())
    }

    fn set_rss_indir(&self, _: &str, _: &[u32]) -> Result<(), NicError> {
        Ok(())
    }

    fn set_channels(&mut self, _: u32, _: &str, _: u32, _: u32, _: u32) -> Result<(), NicError> {
        Ok(())
    }

    fn set_rings(&mut self, _: u32, _: &str, _: u8, _: Option<u32>) -> Result<(), NicError> {
        Ok(())
    }
}

#[test]
fn a_restore_leaves_the_rule_of_an_earlier_entry_to_that_entry() {
    // `undo` hands each step the entries it undoes after it: those before it
    // (`changes[..i]`). Handed those after it instead (none, for a crash's marker, the last
    // entry), the marker's undo took the rule of the earlier entry of its match (12) for one
    // there before it and warned that it stays (PriorLeft); that entry's undo then deleted it.
    let path = state_path("undo-rest");
    let m = steer::Tcp4Match::flow(steer::Tcp4Flow {
        src: "10.0.0.2:40008".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    });
    let mut state = StateFile {
        ifname: "va".into(),
        ifindex: 1,
        netns: None,
        boot_id: None,
        changes: vec![
            Change::Rule {
                location: 12,
                rule: Some(m),
                queue: Some(2),
            },
            Change::PendingRule {
                rule: m,
                queue: 2,
                existing: vec![12],
            },
        ],
    };
    write_state(&path, &state).unwrap();
    // The crash came after the driver had put the new rule at 30.
    let mut nic = FakeNic::with_rules(&[(12, m, 2), (30, m, 2)]);
    let mut undone = None;
    let events = events_of(|| undone = Some(undo(&path, &mut state, &mut nic)));
    undone.unwrap().unwrap();
    assert!(events.is_empty(), "no rule named as left: {events:?}");
    assert_eq!(
        *nic.deleted.borrow(),
        [30, 12],
        "the marker's rule, then the entry's"
    );
    assert!(nic.rules.borrow().is_empty());
    assert!(state.changes.is_empty());
    assert!(on_disk(&path).is_empty());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_restore_that_cannot_return_its_error_logs_each_failure_once_and_a_summary() {
    // Before, drop and a failed setup's undo logged the restore's first error again, with
    // the undo's own message and fields: each failed step appeared twice, identically.
    let path = state_path("summary");
    let _ = std::fs::remove_file(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    j.record(Change::NtupleOn).unwrap();
    j.record(Change::Rss { table: Vec::new() }).unwrap();
    // The NIC refuses to turn ntuple off; the RSS table is put back.
    let mut nic = FakeNic::default();
    let events = events_of(|| j.restore_or_warn(&mut nic));
    let [step, summary] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert_eq!(
        field(step, "message"),
        Some("restoring NIC settings failed (see error)")
    );
    assert!(
        field(step, "error").is_some_and(|e| e.contains("ntuple-set: EBUSY")),
        "{step:?}"
    );
    assert_ne!(field(summary, "message"), field(step, "message"));
    assert_eq!(field(summary, "error"), None, "not logged again");
    assert_eq!(field(summary, "ifname"), Some("va"));
    assert_eq!(field(summary, "steps_left"), Some("1"));
    assert_eq!(
        field(summary, "file_stale"),
        Some("false"),
        "saved as it went"
    );
    let shown = path.display().to_string();
    assert_eq!(field(summary, "path"), Some(shown.as_str()));
    assert_eq!(
        on_disk(&path),
        [Change::NtupleOn],
        "kept for the next start"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_rule_neither_journaled_nor_deleted_keeps_its_entry_and_is_logged() {
    // Before, the deletion's error was dropped and the entry forgotten all the same: a rule
    // the deletion missed stayed on the NIC with no entry for the restore, and no warning.
    let path = state_path("unsaved");
    let tmp = tmp_path(&path);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&tmp);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let m = steer::Tcp4Match::flow(steer::Tcp4Flow {
        src: "10.0.0.2:40009".parse().unwrap(),
        dst: "10.0.0.1:7401".parse().unwrap(),
    });
    let marker = Change::PendingRule {
        rule: m,
        queue: 2,
        existing: Vec::new(),
    };
    // The driver puts the rule at 30; from then on the state file cannot be written (a
    // directory has its temporary file's name), and the rule's deletion fails too.
    let mut result = None;
    let events = events_of(|| {
        result = Some(j.insert_journaled(
            None,
            Vec::new(),
            m,
            2,
            |_| {
                std::fs::create_dir(&tmp).unwrap();
                Ok(30)
            },
            |location| {
                assert_eq!(location, 30);
                Err(refused("ntuple-rule-delete", libc::EBUSY))
            },
        ));
    });
    let e = result.unwrap().unwrap_err();
    assert!(matches!(e, NicError::State { .. }), "{e}");
    let kept = Change::Rule {
        location: 30,
        rule: Some(m),
        queue: Some(2),
    };
    assert_eq!(
        j.state().changes,
        std::slice::from_ref(&kept),
        "kept, for the restore"
    );
    assert_eq!(
        on_disk(&path),
        [marker],
        "on disk, the marker finds the rule"
    );
    let [event] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert_eq!(field(event, "ifname"), Some("va"));
    assert_eq!(field(event, "location"), Some("30"));
    assert!(
        field(event, "error").is_some_and(|e| e.contains("ntuple-rule-delete: EBUSY")),
        "{event:?}"
    );
    // A rule deleted again: its entry goes (the failed save of that is logged, no rule).
    std::fs::remove_dir(&tmp).unwrap();
    let mut result = None;
    let events = events_of(|| {
        result = Some(j.insert_journaled(
            None,
            Vec::new(),
            m,
            2,
            |_| {
                std::fs::create_dir(&tmp).unwrap();
                Ok(31)
            },
            |location| {
                assert_eq!(location, 31);
                Ok(())
            },
        ));
    });
    assert!(result.unwrap().is_err());
    assert_eq!(j.state().changes, [kept], "only the rule not deleted");
    let [event] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert_eq!(field(event, "location"), None, "{event:?}");
    std::fs::remove_dir(&tmp).unwrap();
    drop(j);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_restore_with_every_step_undone_removes_its_state_file_though_a_save_failed() {
    // Before, a restore that undid every step but could not save the state file on the way
    // was reported incomplete with no step left, and the file was kept, still listing the
    // steps: the next start redid them (ntuple turned off again, over the operator's rules).
    let path = state_path("unsaved-restore");
    let tmp = tmp_path(&path);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&tmp);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    j.record(Change::Rss { table: Vec::new() }).unwrap();
    j.record(Change::Channels {
        rx: 1,
        tx: 1,
        combined: 0,
    })
    .unwrap();
    // From now on the state file cannot be saved: a directory has its temporary file's name.
    std::fs::create_dir(&tmp).unwrap();
    let events = events_of(|| j.restore_or_warn(&mut FakeNic::default()));
    assert!(!path.exists(), "removed: no step is left to retry");
    assert!(
        events.iter().all(|e| field(e, "steps_left").is_none()),
        "not reported incomplete: {events:?}"
    );
    let last = events.last().expect("the failed saves are logged");
    assert_eq!(
        field(last, "message"),
        Some(
            "NIC settings restored: every step was undone; the state file, which could not be \
             saved on the way (logged above), is removed"
        )
    );

    // With a step left (the fake NIC refuses to turn ntuple off), the summary says incomplete
    // and the file is kept for the next start.
    std::fs::remove_dir(&tmp).unwrap();
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    j.record(Change::NtupleOn).unwrap();
    j.record(Change::Rss { table: Vec::new() }).unwrap();
    std::fs::create_dir(&tmp).unwrap();
    let events = events_of(|| j.restore_or_warn(&mut FakeNic::default()));
    let summary = events.last().unwrap();
    assert_eq!(field(summary, "steps_left"), Some("1"), "{events:?}");
    assert_eq!(
        field(summary, "file_stale"),
        Some("true"),
        "the file still lists the undone Rss: {summary:?}"
    );
    assert!(
        field(summary, "message").is_some_and(|m| m.starts_with("NIC restore incomplete")),
        "{summary:?}"
    );
    assert!(
        on_disk(&path).contains(&Change::NtupleOn),
        "kept, with the step left"
    );
    std::fs::remove_dir(&tmp).unwrap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_restore_with_every_step_undone_succeeds_though_its_state_file_stays() {
    // Before, `Journal::restore` returned the error of a failed save or of the file's removal
    // with every step undone, and the node logged the restore as incomplete.
    let path = state_path("unremovable");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&path);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    let rss = Change::Rss { table: Vec::new() };
    j.record(rss.clone()).unwrap();
    // The state file can now be neither saved (renamed over) nor removed: a directory has
    // its name.
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let mut result = None;
    let events = events_of(|| result = Some(j.restore_with(&mut FakeNic::default())));
    assert_eq!(result.unwrap().unwrap(), [rss], "the changes undone");
    let last = events.last().expect("logged");
    assert_eq!(
        field(last, "message"),
        Some(
            "NIC settings restored, but the state file could neither be saved (logged above) \
             nor removed: it may still list steps already undone, which the next start would \
             redo; remove it before then"
        )
    );
    assert!(field(last, "error").is_some(), "{last:?}");

    // Saved (it records no change) but not removed: its own message, and no error.
    let state = StateFile {
        ifname: "va".into(),
        ifindex: 1,
        netns: None,
        boot_id: None,
        changes: Vec::new(),
    };
    let mut settled = None;
    let events = events_of(|| settled = Some(settle_undo(&path, &state, Ok(()))));
    settled.unwrap().unwrap();
    let [event] = events.as_slice() else {
        panic!("{events:?}")
    };
    assert!(
        field(event, "message").is_some_and(|m| m.contains("it records no change now")),
        "{event:?}"
    );
    std::fs::remove_dir(&path).unwrap();
    let _ = std::fs::remove_file(tmp_path(&path));
}

#[test]
fn a_restore_that_returns_its_error_with_a_stale_file_says_so() {
    // `restore` (a binding's unbind) returns the error, but a file that still lists a step
    // already undone (its save failed) is named: the next start would undo that step again.
    let path = state_path("stale-restore");
    let tmp = tmp_path(&path);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&tmp);
    let mut j = Journal::create(&path, "va", 1, None).unwrap();
    j.record(Change::NtupleOn).unwrap();
    j.record(Change::Rss { table: Vec::new() }).unwrap();
    std::fs::create_dir(&tmp).unwrap();
    let mut result = None;
    let events = events_of(|| result = Some(j.restore_with(&mut FakeNic::default())));
    assert!(result.unwrap().is_err(), "ntuple could not be turned off");
    let stale: Vec<_> = events
        .iter()
        .filter(|e| field(e, "file_stale") == Some("true"))
        .collect();
    assert_eq!(stale.len(), 1, "{events:?}");
    assert!(
        on_disk(&path).contains(&Change::Rss { table: Vec::new() }),
        "still listed"
    );
    std::fs::remove_dir(&tmp).unwrap();
    let _ = std::fs::remove_file(&path);
}
