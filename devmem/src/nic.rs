//! NIC setup for devmem RX, and its undo (reference devmem.md §4 step 2).
//!
//! Devmem needs the NIC configured by the application: enough RX queues for the ones to
//! bind, header split on with `hds-thresh` 0 (ethtool netlink `rings-set`), other flows kept
//! off the bound queues (RSS) and the data port steered to them (ntuple). Every change is
//! written to a state file *before* it is made ([`Journal`]), so it can be undone in reverse
//! order on shutdown ([`NicSetup::restore`], also on drop) and, after a crash, at the next
//! start ([`restore_from`]): a NIC is never left altered. An ntuple rule is journaled before
//! its insertion too: by its location where that is chosen first, else (the driver picks it)
//! as a [`Change::PendingRule`] marker holding its match and the rules known to match
//! already (not the one being added), resolved to the location once the rule is in. A rule
//! is deleted only where the rule at its location is still the one journaled. Each change
//! undone is dropped from the file at once, so a restore that failed part way is retried
//! only for what failed, as long as the file can be saved: one that cannot (a full disk)
//! still lists steps already undone, which the next start undoes again, and the restore's
//! summary says so (`file_stale`).
//!
//! Channels and header split go over ethtool netlink; RSS and ntuple steering over the
//! `SIOCETHTOOL` ioctl ([`steer`]), since the netlink RSS/ntuple commands are newer than the
//! drivers' support for them.
//!
//! The journal is `nic/journal.rs`; the undo, and the restore after a crash, `nic/undo.rs`.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use netlink_bindings::ethtool;
use netlink_bindings::traits::NetlinkRequest;
use serde::{Deserialize, Serialize};

use crate::nl::{self, GenlSocket, NlError};

mod journal;
mod undo;

pub use journal::Journal;
pub use undo::restore_from;

/// ethtool message ids, user to kernel (include/uapi/linux/ethtool_netlink_generated.h).
/// netlink-bindings 0.3.5 numbers them as one id space, so each request's cmd is set here.
const MSG_RINGS_GET: u8 = 15;
const MSG_RINGS_SET: u8 = 16;
const MSG_CHANNELS_GET: u8 = 17;
const MSG_CHANNELS_SET: u8 = 18;
/// `ETHTOOL_TCP_DATA_SPLIT_ENABLED` / `_DISABLED` (include/uapi/linux/ethtool.h).
pub const TCP_DATA_SPLIT_DISABLED: u8 = 1;
/// See [`TCP_DATA_SPLIT_DISABLED`].
pub const TCP_DATA_SPLIT_ENABLED: u8 = 2;

/// Errors of NIC setup and restore. Each names the interface and the step.
#[derive(Debug, thiserror::Error)]
pub enum NicError {
    /// An ethtool request failed in the kernel.
    #[error("{ifname}: ethtool {op}: {errno_name}{}{}", .msg.as_deref().map(|m| format!(" ({m})")).unwrap_or_default(), hint(.errno, op))]
    Kernel {
        /// Interface.
        ifname: String,
        /// The request, e.g. `rings-set`.
        op: &'static str,
        /// The errno.
        errno: i32,
        /// Its symbolic name.
        errno_name: String,
        /// The kernel's extack message.
        msg: Option<String>,
    },
    /// Transport or decoding failure.
    #[error("{ifname}: ethtool {op}: {reason}")]
    Netlink {
        /// Interface.
        ifname: String,
        /// The request.
        op: &'static str,
        /// What failed.
        reason: String,
    },
    /// The NIC cannot have the RX queues asked for, with the kind of channel it uses now.
    #[error(
        "{ifname}: queue {queue} is needed but the NIC supports at most {max} RX queues with its {kind} channels (ethtool -l {ifname} shows its counts and maximums)"
    )]
    NotEnoughQueues {
        /// Interface.
        ifname: String,
        /// The highest queue asked for.
        queue: u32,
        /// The most RX queues that kind of channel gives.
        max: u32,
        /// The kind it uses now, the one a raise changes: `combined` or `RX-only`.
        kind: &'static str,
    },
    /// Steering was asked for on a queue set that includes queue 0: RSS is kept on the queues
    /// below the lowest bound one, and there is none below queue 0.
    #[error(
        "{ifname}: RX queues {queues:?} include queue 0, which must stay with RSS for the host's other traffic (bound, RSS would keep spreading every flow, ssh and the node's own connections included, onto the bound queues, where a plain recv cannot read them): bind queues from 1 up"
    )]
    QueueZeroBound {
        /// Interface.
        ifname: String,
        /// The queues asked for.
        queues: Vec<u32>,
    },
    /// The state file could not be read or written.
    #[error("NIC state file {path}: {reason}")]
    State {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A state file from an earlier run exists: restore it first.
    #[error(
        "NIC state file {0} exists (a previous run did not restore its NIC changes): restore it first"
    )]
    StateExists(PathBuf),
    /// A state file whose lock a running process holds: that process's live setup, not a
    /// crash's leftover; left alone.
    #[error(
        "NIC state file {0} is in use by a running node (its lock is held): its setup is live, \
         so it is left alone; give this process another nic_state_file"
    )]
    StateInUse(PathBuf),
    /// The setup was restored already (the node is shutting down or the binding went).
    #[error("the NIC's devmem setup was already restored")]
    Restored,
    /// A state file names an interface that is no longer the one it recorded (renamed,
    /// reloaded, moved, or gone): nothing was undone, lest another NIC's settings be changed.
    #[error(
        "NIC state file {path} records {ifname} as interface index {recorded}, but {}: the NIC was renamed, reloaded or moved since; nothing was undone. Check its settings (ethtool -l/-g/-x/-n {ifname}) and remove the file",
        .found.map_or_else(|| format!("no interface is named {ifname} now"), |f| format!("{ifname} is index {f} now"))
    )]
    StateMismatch {
        /// The file.
        path: PathBuf,
        /// The interface it names.
        ifname: String,
        /// Its index then.
        recorded: u32,
        /// Its index now (`None`: no interface of that name).
        found: Option<u32>,
    },
    /// A rule journaled before the driver picked its location ([`Change::PendingRule`]) is
    /// matched by several rules that were not there before it: which one this process added
    /// cannot be told, so none was deleted and the entry stays in the state file.
    #[error(
        "{ifname}: an ntuple rule journaled without its location (the process stopped while adding it) matches the rules at locations {locations:?}: none was deleted. Delete the one shardwire added (ethtool -n {ifname}; ethtool -N {ifname} delete LOC), then remove the NIC state file"
    )]
    AmbiguousRule {
        /// Interface.
        ifname: String,
        /// The matching rules' locations.
        locations: Vec<u32>,
    },
}

fn hint(errno: &i32, op: &str) -> &'static str {
    match (*errno, op) {
        (
            libc::EOPNOTSUPP,
            "ntuple-get"
            | "ntuple-set"
            | "ntuple-rule-count"
            | "ntuple-rule-list"
            | "ntuple-rule-get"
            | "ntuple-rule-insert"
            | "ntuple-flow-rule-insert"
            | "ntuple-rule-delete",
        ) => {
            ": the driver has no ntuple filters, so the data port cannot be steered to the devmem queues"
        }
        (libc::EOPNOTSUPP, "rss-get" | "rss-set") => {
            ": the driver has no RSS indirection table, so other flows cannot be kept off the devmem queues"
        }
        (libc::EOPNOTSUPP, "rings-get" | "rings-set") => {
            ": the driver has no ring parameters, so header split cannot be turned on (devmem needs gve, bnxt, mlx5, fbnic or idpf)"
        }
        (libc::ENOSPC, "ntuple-rule-insert" | "ntuple-flow-rule-insert") => {
            ": the NIC's ntuple rule table is full (`ethtool -n IFACE` lists the rules, `ethtool -N IFACE delete LOC` removes one)"
        }
        (libc::EOPNOTSUPP, _) => ": the driver does not support this",
        (libc::EINVAL, "channels-set") => {
            ": the driver refused the channel counts (ethtool -l on the interface shows its counts and maximums)"
        }
        _ => "",
    }
}

/// Ring parameters that matter for devmem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rings {
    /// `tcp-data-split`: 0 unknown, 1 disabled, 2 enabled.
    pub tcp_data_split: u8,
    /// `hds-thresh`, when reported.
    pub hds_thresh: Option<u32>,
}

/// Channel counts and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Channels {
    /// RX-only channels.
    pub rx: u32,
    /// TX-only channels.
    pub tx: u32,
    /// Combined channels.
    pub combined: u32,
    /// Max RX-only.
    pub rx_max: u32,
    /// Max TX-only.
    pub tx_max: u32,
    /// Max combined.
    pub combined_max: u32,
}

impl Channels {
    /// RX queues in use: combined plus RX-only channels.
    pub fn rx_queues(&self) -> u32 {
        self.combined + self.rx
    }
}

/// An ethtool client: generic netlink for rings and channels, and a datagram socket for
/// the `SIOCETHTOOL` ioctls of flow steering ([`steer`]); both in one network namespace.
#[derive(Debug)]
pub struct EthtoolClient {
    sock: GenlSocket,
    family: u16,
    ioctl_sock: std::os::fd::OwnedFd,
}

impl EthtoolClient {
    /// Open in the calling thread's network namespace.
    pub fn open() -> Result<Self, NicError> {
        let fail = |reason: String| NicError::Netlink {
            ifname: String::new(),
            op: "open",
            reason,
        };
        let mut sock = GenlSocket::open().map_err(|e| fail(e.to_string()))?;
        let family = nl::resolve_family(&mut sock, b"ethtool")
            .map_err(|e| fail(format!("resolving the ethtool family: {e:?}")))?
            .id;
        let ioctl_sock = crate::sys::ioctl_socket().map_err(|e| fail(e.to_string()))?;
        Ok(Self {
            sock,
            family,
            ioctl_sock,
        })
    }

    /// Open inside the network namespace at `netns` (the socket stays there).
    pub fn open_in_netns(netns: &Path) -> Result<Self, NicError> {
        crate::sys::in_netns(netns, Self::open).map_err(|e| NicError::Netlink {
            ifname: String::new(),
            op: "open",
            reason: e.to_string(),
        })?
    }

    fn run(
        &mut self,
        ifname: &str,
        op: &'static str,
        flags: u16,
        payload: &[u8],
        on_reply: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), NicError> {
        self.sock
            .request(self.family, flags, payload, on_reply)
            .map_err(|e| match e {
                NlError::Kernel { errno, extack } => NicError::Kernel {
                    ifname: ifname.to_string(),
                    op,
                    errno,
                    errno_name: crate::errno_label(errno),
                    msg: extack.msg,
                },
                other => NicError::Netlink {
                    ifname: ifname.to_string(),
                    op,
                    reason: format!("{other:?}"),
                },
            })
    }

    /// `rings-get`.
    pub fn rings(&mut self, ifindex: u32, ifname: &str) -> Result<Rings, NicError> {
        let mut req = ethtool::Request::new().op_rings_get_do();
        req.header_mut().cmd = MSG_RINGS_GET;
        req.encode()
            .nested_header()
            .push_dev_index(ifindex)
            .end_nested();
        let mut out = None;
        self.run(ifname, "rings-get", req.flags(), req.payload(), &mut |p| {
            let a = ethtool::OpRingsGetDo::decode_reply(p);
            out = Some(Rings {
                tcp_data_split: a.get_tcp_data_split().unwrap_or(0),
                hds_thresh: a.get_hds_thresh().ok(),
            });
            Ok(())
        })?;
        out.ok_or_else(|| NicError::Netlink {
            ifname: ifname.into(),
            op: "rings-get",
            reason: "no reply".into(),
        })
    }

    /// `rings-set` of `tcp-data-split` and, when given, `hds-thresh`.
    pub fn set_rings(
        &mut self,
        ifindex: u32,
        ifname: &str,
        tcp_data_split: u8,
        hds_thresh: Option<u32>,
    ) -> Result<(), NicError> {
        let mut req = ethtool::Request::new().op_rings_set_do();
        req.header_mut().cmd = MSG_RINGS_SET;
        {
            let enc = req
                .encode()
                .nested_header()
                .push_dev_index(ifindex)
                .end_nested()
                .push_tcp_data_split(tcp_data_split);
            if let Some(t) = hds_thresh {
                let _ = enc.push_hds_thresh(t);
            }
        }
        self.run(ifname, "rings-set", req.flags(), req.payload(), &mut |_| {
            Ok(())
        })
    }

    /// `channels-get`.
    pub fn channels(&mut self, ifindex: u32, ifname: &str) -> Result<Channels, NicError> {
        let mut req = ethtool::Request::new().op_channels_get_do();
        req.header_mut().cmd = MSG_CHANNELS_GET;
        req.encode()
            .nested_header()
            .push_dev_index(ifindex)
            .end_nested();
        let mut out = None;
        self.run(
            ifname,
            "channels-get",
            req.flags(),
            req.payload(),
            &mut |p| {
                let a = ethtool::OpChannelsGetDo::decode_reply(p);
                out = Some(Channels {
                    rx: a.get_rx_count().unwrap_or(0),
                    tx: a.get_tx_count().unwrap_or(0),
                    combined: a.get_combined_count().unwrap_or(0),
                    rx_max: a.get_rx_max().unwrap_or(0),
                    tx_max: a.get_tx_max().unwrap_or(0),
                    combined_max: a.get_combined_max().unwrap_or(0),
                });
                Ok(())
            },
        )?;
        out.ok_or_else(|| NicError::Netlink {
            ifname: ifname.into(),
            op: "channels-get",
            reason: "no reply".into(),
        })
    }

    /// `channels-set` of the RX, TX and combined counts.
    pub fn set_channels(
        &mut self,
        ifindex: u32,
        ifname: &str,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError> {
        let mut req = ethtool::Request::new().op_channels_set_do();
        req.header_mut().cmd = MSG_CHANNELS_SET;
        {
            let mut enc = req
                .encode()
                .nested_header()
                .push_dev_index(ifindex)
                .end_nested();
            // All three counts: the kernel checks each against its maximum, and a kind the
            // driver lacks (maximum 0) goes as its count, 0. A raise changes one kind only,
            // the one the NIC uses now ([`channels_request`]): drivers with either all
            // combined or all RX/TX channels (bnxt) refuse a request that mixes them.
            enc = enc.push_rx_count(rx).push_tx_count(tx);
            let _ = enc.push_combined_count(combined);
        }
        self.run(
            ifname,
            "channels-set",
            req.flags(),
            req.payload(),
            &mut |_| Ok(()),
        )
    }
}

/// One change, with the value it replaced (what restore puts back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "kebab-case")]
pub enum Change {
    /// Channel counts were changed from these.
    Channels {
        /// Old RX-only count.
        rx: u32,
        /// Old TX-only count.
        tx: u32,
        /// Old combined count.
        combined: u32,
    },
    /// Header split was changed from these.
    Rings {
        /// Old `tcp-data-split`.
        tcp_data_split: u8,
        /// Old `hds-thresh`.
        hds_thresh: Option<u32>,
    },
    /// The ntuple feature was turned on (it was off).
    NtupleOn,
    /// An ntuple rule was inserted at this location (journaled before the insertion: a
    /// process stopped in between leaves an entry whose location another rule may take
    /// later, so its undo deletes only a rule there that steers `rule` onto `queue`).
    Rule {
        /// The rule's location.
        location: u32,
        /// What it matches (absent in state files of earlier releases: deleted unchecked).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<steer::Tcp4Match>,
        /// The queue it steers to (with `rule`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queue: Option<u32>,
    },
    /// An ntuple rule is being inserted where the driver picks the location: saved before
    /// the insertion and replaced by [`Change::Rule`] once the location is known. Left in a
    /// state file by a process stopped in between, its undo deletes the rule that matches
    /// `rule` onto `queue` ([`EthtoolClient::find_rules`]) and is not one of `existing`, if
    /// there is one.
    PendingRule {
        /// What the rule matches.
        rule: steer::Tcp4Match,
        /// The queue it steers to.
        queue: u32,
        /// Locations of rules that matched `rule` onto `queue` before the insertion, never
        /// deleted by this undo: for a port rule, those on the NIC (an operator's identical
        /// `ethtool -N` rule); for a connection's rule, this journal's own (deleted by their
        /// own entries; see `Journal::prior_rules`). Empty in state files of earlier
        /// releases, whose undo takes any match for ours.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        existing: Vec<u32>,
    },
    /// The RSS indirection table was replaced; this was the old one.
    Rss {
        /// Old table; empty: it was the driver's default ([`steer::table_to_restore`]).
        table: Vec<u32>,
    },
}

/// An ntuple rule this setup inserted ([`NicSetup::add_flow`], [`NicSetup::steer`]): its
/// location and what it steers. [`NicSetup::remove_flow`] takes all three, because a
/// location alone can name another rule by then: one inserted there after this one vanished
/// behind the node's back (a driver reset, `ethtool -K ntuple off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertedRule {
    /// The rule's location.
    pub location: u32,
    /// What it matches.
    pub rule: steer::Tcp4Match,
    /// The queue it steers to.
    pub queue: u32,
}

impl InsertedRule {
    /// Its journal entry.
    fn change(&self) -> Change {
        Change::Rule {
            location: self.location,
            rule: Some(self.rule),
            queue: Some(self.queue),
        }
    }
}

/// What an ntuple rule being inserted steers, for [`Journal::prior_rules`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RuleKind {
    /// Every connection to a port ([`Journal::steer`]).
    Port,
    /// One connection's 5-tuple ([`Journal::add_flow`]).
    Flow,
}

/// What the undo of a journaled ntuple rule did: [`NicSetup::remove_flow`] returns it for its
/// caller to log; a restore logs it as a warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleUndo {
    /// Deleted, or nothing to delete: gone already (a driver reset, `ethtool -K ntuple
    /// off`), or, for a rule journaled without its location, never inserted.
    Removed,
    /// Not deleted: the rule at `location` is not the one journaled there (that one vanished
    /// and the location was taken since: another connection's rule, an operator's).
    NotOurs {
        /// The location.
        location: u32,
    },
    /// A rule journaled without its location ([`Change::PendingRule`]) dealt with as for
    /// [`RuleUndo::Removed`]; the rules at `locations`, which matched it before its
    /// insertion, were not taken for it and stay (an operator's). Shardwire's own, which
    /// their own entries delete in the same restore, are not among them.
    PriorLeft {
        /// Their locations.
        locations: Vec<u32>,
    },
}

impl std::fmt::Display for RuleUndo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuleUndo::Removed => write!(f, "the rule was deleted"),
            RuleUndo::NotOurs { location } => write!(
                f,
                "the rule at location {location} is not the one shardwire journaled there (its own was never inserted, or is gone); left as it is"
            ),
            RuleUndo::PriorLeft { locations } => write!(
                f,
                "the rules at locations {locations:?} match the one shardwire was adding but were there before it: not deleted in its place"
            ),
        }
    }
}

/// What the state file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFile {
    /// Interface name (for messages).
    pub ifname: String,
    /// Interface index.
    pub ifindex: u32,
    /// Network namespace file the interface lives in (`None`: the service's own).
    pub netns: Option<PathBuf>,
    /// The kernel's boot id when the file was made (`/proc/sys/kernel/random/boot_id`;
    /// `None` in files of earlier releases): after a reboot the NIC has its defaults again,
    /// and undoing would only change settings someone made since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// Changes in the order they were made.
    pub changes: Vec<Change>,
}

/// What [`restore_from`] did with a state file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// Its changes were undone (none, for a file that recorded none).
    Undone(StateFile),
    /// It was made before the last reboot: nothing to undo (the NIC came up with its
    /// defaults), so it was removed.
    Stale(StateFile),
}

/// The kernel's boot id, if it can be read.
fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_owned()).filter(|s| !s.is_empty())
}

/// The lock file of the journal at `path`: its name and `.lock` (kept, never removed: a
/// lock file removed while another process waits on it would let two hold "the" lock).
pub fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// Takes the lock of the journal at `path` (made if missing), or says it is held.
fn lock(path: &Path) -> Result<File, NicError> {
    let lp = lock_path(path);
    let bad = |e: io::Error| NicError::State {
        path: lp.clone(),
        reason: e.to_string(),
    };
    if let Some(dir) = lp.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(bad)?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lp)
        .map_err(bad)?;
    // A lock held for a moment is not a running node's: a thread of this process that forks
    // a child holds a copy of every descriptor until the child's exec closes it.
    for _ in 0..LOCK_TRIES {
        match f.try_lock() {
            Ok(()) => return Ok(f),
            Err(std::fs::TryLockError::WouldBlock) => std::thread::sleep(LOCK_RETRY),
            Err(std::fs::TryLockError::Error(e)) => return Err(bad(e)),
        }
    }
    Err(NicError::StateInUse(path.into()))
}

/// Tries, and the pause between them, before a journal's lock counts as held by a running
/// process (half a second in all).
const LOCK_TRIES: u32 = 50;
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

/// A journal's temporary file: its name and `.tmp` (`nic-state.eth1.json.tmp`). Replacing
/// the extension instead gave the journals of a base without one (`bare.eth0`, `bare.eth1`)
/// one temporary file, `bare.tmp`, that two NICs' setups could write at once.
fn tmp_path(path: &Path) -> PathBuf {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    PathBuf::from(tmp)
}

/// Write `state` to `path` durably: a temporary file, synced, renamed over it.
fn write_state(path: &Path, state: &StateFile) -> Result<(), NicError> {
    let bad = |e: io::Error| NicError::State {
        path: path.into(),
        reason: e.to_string(),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(bad)?;
    }
    let tmp = tmp_path(path);
    let mut f = File::create(&tmp).map_err(bad)?;
    let body = serde_json::to_vec_pretty(state).expect("serializable");
    f.write_all(&body).map_err(bad)?;
    f.sync_all().map_err(bad)?;
    std::fs::rename(&tmp, path).map_err(bad)
}

fn remove(path: &Path) -> Result<(), NicError> {
    std::fs::remove_file(path).map_err(|e| NicError::State {
        path: path.into(),
        reason: e.to_string(),
    })
}

/// A rule deletion the kernel answers with ENOENT: the rule is not there, which is what the
/// deletion wanted.
fn gone_is_done(r: Result<(), NicError>) -> Result<(), NicError> {
    match r {
        Err(NicError::Kernel { errno, .. }) if errno == libc::ENOENT => Ok(()),
        r => r,
    }
}

/// What to set up on one interface.
#[derive(Debug, Clone)]
pub struct SetupPlan {
    /// Interface name.
    pub ifname: String,
    /// Interface index.
    pub ifindex: u32,
    /// RX queues that will be bound.
    pub queues: Vec<u32>,
    /// Network namespace file of the interface, if not the caller's.
    pub netns: Option<PathBuf>,
    /// Steer each of these TCP ports (a lane's data port) to its queue, and keep RSS on the
    /// queues below the lowest of `queues` (so that is not queue 0: [`rss_bound`]); empty
    /// leaves steering to the operator.
    pub steer: Vec<(u16, u32)>,
}

/// A NIC set up for devmem; restores on [`NicSetup::restore`] or drop.
#[derive(Debug)]
pub struct NicSetup {
    journal: Option<Journal>,
    client: EthtoolClient,
    /// What was not configured, in words (RSS and ntuple steering, for now).
    pub not_configured: String,
}

impl NicSetup {
    /// The journal's state.
    pub fn state(&self) -> Option<&StateFile> {
        self.journal.as_ref().map(Journal::state)
    }

    /// Steer one connection onto `queue` of this NIC before its first payload byte (a 5-tuple
    /// ntuple rule, journaled, so a crash leaves nothing behind); returns the rule, for
    /// [`NicSetup::remove_flow`].
    pub fn add_flow(
        &mut self,
        flow: steer::Tcp4Flow,
        queue: u32,
    ) -> Result<InsertedRule, NicError> {
        let j = self.journal.as_mut().ok_or(NicError::Restored)?;
        j.add_flow(&mut self.client, flow, queue)
    }

    /// Give the NIC at least `need` RX queues (a lane joining this setup on queues past its
    /// channel count), journaled as [`apply`] raises them ([`Journal::ensure_queues`]): the
    /// raise is undone with the rest of the setup, not when that lane leaves (as RSS stays
    /// narrowed). A NIC that cannot have them is refused ([`NicError::NotEnoughQueues`])
    /// with nothing changed.
    pub fn ensure_queues(&mut self, need: u32) -> Result<(), NicError> {
        let j = self.journal.as_mut().ok_or(NicError::Restored)?;
        j.ensure_queues(&mut self.client, need)
    }

    /// Steer TCP/IPv4 to `dst_port` onto `queue` (another lane's data port on a NIC already
    /// set up), and, with `Some(n)`, RSS kept on queues `0..n` ([`Journal::steer`]; `Some(0)`
    /// is refused); journaled. Returns the rule ([`NicSetup::remove_flow`] deletes it).
    pub fn steer(
        &mut self,
        dst_port: u16,
        queue: u32,
        rss_queues: Option<u32>,
    ) -> Result<InsertedRule, NicError> {
        let j = self.journal.as_mut().ok_or(NicError::Restored)?;
        j.steer(&mut self.client, dst_port, queue, rss_queues)
    }

    /// Delete a rule ([`NicSetup::add_flow`], [`NicSetup::steer`]) if it is still at its
    /// location, and say which ([`RuleUndo`]: the caller logs a rule left); nothing to do
    /// once the setup was restored (the restore deleted every journaled rule).
    pub fn remove_flow(&mut self, rule: InsertedRule) -> Result<RuleUndo, NicError> {
        match self.journal.as_mut() {
            Some(j) => j.remove_flow(&mut self.client, rule),
            None => Ok(RuleUndo::Removed),
        }
    }

    /// Undo the changes now, while others may still hold this setup (its connections' rules:
    /// their later removal is then a no-op). Empty when already restored.
    pub fn restore_now(&mut self) -> Result<Vec<Change>, NicError> {
        match self.journal.take() {
            Some(j) => j.restore(&mut self.client),
            None => Ok(Vec::new()),
        }
    }

    /// Undo the changes now.
    pub fn restore(mut self) -> Result<Vec<Change>, NicError> {
        self.restore_now()
    }
}

impl Drop for NicSetup {
    fn drop(&mut self) {
        if let Some(j) = self.journal.take() {
            j.restore_or_warn(&mut self.client);
        }
    }
}

/// Set the NIC up for devmem on `plan.queues`: enough RX channels, header split on with
/// `hds-thresh` 0, and, with `plan.steer`, RSS kept below the lowest bound queue and each
/// port steered. Each change is journaled at `state` first; on failure whatever was
/// changed is undone before the error is returned. Steering onto a queue set that includes
/// queue 0 is refused before anything is changed ([`rss_bound`]).
pub fn apply(plan: &SetupPlan, state: &Path) -> Result<NicSetup, NicError> {
    let rss = match plan.steer.is_empty() {
        true => None,
        false => rss_bound(&plan.ifname, &plan.queues)?,
    };
    let mut client = match &plan.netns {
        Some(ns) => EthtoolClient::open_in_netns(ns)?,
        None => EthtoolClient::open()?,
    };
    let mut journal = Journal::create(state, &plan.ifname, plan.ifindex, plan.netns.clone())?;
    let result = (|| {
        let need = plan.queues.iter().max().map_or(0, |q| q + 1);
        journal.ensure_queues(&mut client, need)?;
        journal.enable_header_split(&mut client)?;
        for (i, &(port, queue)) in plan.steer.iter().enumerate() {
            // RSS once, away from every bound queue (they are all at or above its bound).
            let rss = if i == 0 { rss } else { None };
            journal.steer(&mut client, port, queue, rss)?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(NicSetup {
            journal: Some(journal),
            client,
            not_configured: if !plan.steer.is_empty() {
                String::new()
            } else {
                "flow steering was not asked for: set RSS and an ntuple rule with ethtool -X / -N"
                    .into()
            },
        }),
        Err(e) => {
            journal.restore_or_warn(&mut client);
            Err(e)
        }
    }
}

pub mod steer;

/// The queues `0..n` RSS is kept on when steering onto `queues`: `n` is the lowest of them
/// (`None` for no queues). Refused when that is queue 0
/// ([`NicError::QueueZeroBound`]): no queue is left below it for the host's other traffic,
/// so RSS would go on spreading every flow onto the bound queues.
pub fn rss_bound(ifname: &str, queues: &[u32]) -> Result<Option<u32>, NicError> {
    match queues.iter().min() {
        Some(0) => Err(NicError::QueueZeroBound {
            ifname: ifname.into(),
            queues: queues.to_vec(),
        }),
        first => Ok(first.copied()),
    }
}

/// The `channels-set` counts (rx, tx, combined) that give a NIC with channels `ch` at least
/// `need` RX queues, or `None` when it has them. Only the kind of channel the NIC uses now
/// is raised, within that kind's maximum: combined ones where it has some (or no RX-only
/// ones), else RX-only ones. Drivers with either all combined or all RX/TX channels (bnxt)
/// refuse a request mixing the two with EINVAL, and one kind's maximum says nothing about
/// the other's.
fn channels_request(
    ifname: &str,
    ch: &Channels,
    need: u32,
) -> Result<Option<(u32, u32, u32)>, NicError> {
    if ch.rx_queues() >= need {
        return Ok(None);
    }
    let combined = ch.combined > 0 || ch.rx == 0;
    let (max, kind) = match combined {
        true => (ch.rx.saturating_add(ch.combined_max), "combined"),
        false => (ch.rx_max, "RX-only"),
    };
    if need > max {
        return Err(NicError::NotEnoughQueues {
            ifname: ifname.into(),
            queue: need - 1,
            max,
            kind,
        });
    }
    Ok(Some(match combined {
        true => (ch.rx, ch.tx, need - ch.rx),
        false => (need, ch.tx, ch.combined),
    }))
}

/// What `rings-set` turns header split on with, given the NIC's `rings-get` (`old`): `None`
/// when it is on already with `hds-thresh` 0; else `Some(hds_thresh)`, the threshold to send
/// with it: 0 where the driver reports one, none where it does not (gve and idpf have no
/// `hds-thresh`, and the kernel refuses a `rings-set` that carries it with EOPNOTSUPP; their
/// threshold is 0 already, which is what devmem needs).
fn header_split_request(old: &Rings) -> Option<Option<u32>> {
    if old.tcp_data_split == TCP_DATA_SPLIT_ENABLED && old.hds_thresh.unwrap_or(0) == 0 {
        return None;
    }
    Some(old.hds_thresh.map(|_| 0))
}

#[cfg(test)]
mod tests;
