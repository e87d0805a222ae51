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

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use netlink_bindings::ethtool;
use netlink_bindings::traits::NetlinkRequest;
use serde::{Deserialize, Serialize};

use crate::nl::{self, GenlSocket, NlError};

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
    /// The NIC cannot have the RX queues asked for.
    #[error("{ifname}: queue {queue} is needed but the NIC supports at most {max} RX channels")]
    NotEnoughQueues {
        /// Interface.
        ifname: String,
        /// The highest queue asked for.
        queue: u32,
        /// The driver's maximum.
        max: u32,
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
            ": the driver refused the channel counts (a memory provider may be bound to a queue above them)"
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
            // Only the kinds the driver has (a max of 0 means the kind does not exist).
            let now = (rx, tx, combined);
            enc = enc.push_rx_count(now.0).push_tx_count(now.1);
            let _ = enc.push_combined_count(now.2);
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

/// The write-ahead record of NIC changes: each change is saved before it is made. It holds
/// its lock file while it lives ([`lock`]), so another process that starts meanwhile (a
/// second node, `shardwire demo` on the same host) does not take the live setup for a
/// crash's leftover and undo it under the running node.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    state: StateFile,
    _lock: File,
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

impl Journal {
    /// Start a journal at `path` for one interface; refuses if a state file exists.
    pub fn create(
        path: &Path,
        ifname: &str,
        ifindex: u32,
        netns: Option<PathBuf>,
    ) -> Result<Self, NicError> {
        let lock = lock(path)?;
        if path.exists() {
            return Err(NicError::StateExists(path.into()));
        }
        let j = Self {
            _lock: lock,
            path: path.into(),
            state: StateFile {
                ifname: ifname.into(),
                ifindex,
                netns,
                boot_id: boot_id(),
                changes: Vec::new(),
            },
        };
        j.save()?;
        Ok(j)
    }

    /// The recorded state.
    pub fn state(&self) -> &StateFile {
        &self.state
    }

    fn save(&self) -> Result<(), NicError> {
        write_state(&self.path, &self.state)
    }

    /// Drop entry `at`, a rule not on the NIC (its insertion refused, or the rule deleted
    /// again: [`Journal::insert_journaled`]), and save. A failed save is only reported: the
    /// entry left on disk undoes nothing that exists (a rule not there is `ENOENT`, done; a
    /// pending marker finds no rule).
    fn forget(&mut self, at: usize) {
        self.state.changes.remove(at);
        if let Err(e) = self.save() {
            tracing::warn!(
                ifname = %self.state.ifname,
                path = %self.path.display(),
                error = %e,
                "NIC journal: dropping the entry of a rule not on the NIC (never inserted, or \
                 deleted again) failed; the entry left undoes nothing that exists"
            );
        }
    }

    /// Record `change` durably; call before making it.
    pub fn record(&mut self, change: Change) -> Result<(), NicError> {
        self.state.changes.push(change);
        let saved = self.save();
        if saved.is_err() {
            // Not on disk: not in memory either (the caller will not make the change).
            self.state.changes.pop();
        }
        saved
    }

    /// Set channel counts, journaled.
    pub fn set_channels(
        &mut self,
        client: &mut EthtoolClient,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError> {
        let (ifindex, ifname) = (self.state.ifindex, self.state.ifname.clone());
        let old = client.channels(ifindex, &ifname)?;
        self.record(Change::Channels {
            rx: old.rx,
            tx: old.tx,
            combined: old.combined,
        })?;
        client.set_channels(ifindex, &ifname, rx, tx, combined)
    }

    /// Turn header split on with `hds-thresh` 0, journaled.
    pub fn enable_header_split(&mut self, client: &mut EthtoolClient) -> Result<(), NicError> {
        let (ifindex, ifname) = (self.state.ifindex, self.state.ifname.clone());
        let old = client.rings(ifindex, &ifname)?;
        let Some(hds_thresh) = header_split_request(&old) else {
            return Ok(());
        };
        self.record(Change::Rings {
            tcp_data_split: old.tcp_data_split,
            hds_thresh: old.hds_thresh,
        })?;
        client.set_rings(ifindex, &ifname, TCP_DATA_SPLIT_ENABLED, hds_thresh)
    }

    /// Steer TCP/IPv4 to `dst_port` onto `queue`: RSS over queues `0..rss_queues` only
    /// (when `rss_queues` > 0), the ntuple feature on, one ntuple rule; all journaled. Returns
    /// the rule.
    pub fn steer(
        &mut self,
        client: &mut EthtoolClient,
        dst_port: u16,
        queue: u32,
        rss_queues: u32,
    ) -> Result<InsertedRule, NicError> {
        let ifname = self.state.ifname.clone();
        if rss_queues > 0 {
            let old = client.rss_indir(&ifname)?;
            let new = steer::equal_table(old.len(), rss_queues);
            if new != old {
                // The kernel's default spreads over `ETHTOOL_GRXRINGS` rings; where that
                // cannot be read, the table is restored as it was.
                let table = match client.rx_rings(&ifname) {
                    Ok(rings) => steer::table_to_restore(old, rings),
                    Err(_) => old,
                };
                self.record(Change::Rss { table })?;
                client.set_rss_indir(&ifname, &new)?;
            }
        }
        if !client.ntuple_enabled(&ifname)? {
            self.record(Change::NtupleOn)?;
            client.set_ntuple(&ifname, true)?;
        }
        let m = steer::Tcp4Match::port(dst_port);
        self.insert_rule(client, "ntuple-rule-insert", m, queue, RuleKind::Port)
    }

    /// Steer one connection onto `queue` with a 5-tuple ntuple rule, journaled (the ntuple
    /// feature must be on: [`Journal::steer`] turned it on). Returns the rule.
    pub fn add_flow(
        &mut self,
        client: &mut EthtoolClient,
        flow: steer::Tcp4Flow,
        queue: u32,
    ) -> Result<InsertedRule, NicError> {
        let m = steer::Tcp4Match::flow(flow);
        self.insert_rule(client, "ntuple-flow-rule-insert", m, queue, RuleKind::Flow)
    }

    /// Insert an ntuple rule steering what `m` matches onto `queue`, journaled before it is
    /// made ([`Journal::insert_journaled`]). `op` names the request in errors; `kind` says
    /// where rules that match it already can come from ([`Journal::prior_rules`]).
    fn insert_rule(
        &mut self,
        client: &mut EthtoolClient,
        op: &'static str,
        m: steer::Tcp4Match,
        queue: u32,
        kind: RuleKind,
    ) -> Result<InsertedRule, NicError> {
        let ifname = self.state.ifname.clone();
        let client: &EthtoolClient = client;
        let at = client.next_rule_location(&ifname)?;
        let existing = self.prior_rules(kind, at, &m, queue, || {
            client.find_rules(&ifname, &m, queue)
        })?;
        let location = self.insert_journaled(
            at,
            existing,
            m,
            queue,
            |at| client.insert_rule(&ifname, op, &m, queue, at),
            |location| gone_is_done(client.delete_rule(&ifname, location)),
        )?;
        Ok(InsertedRule {
            location,
            rule: m,
            queue,
        })
    }

    /// The rules that steer what `m` matches onto `queue` already, recorded in a
    /// [`Change::PendingRule`] marker so that its undo (a restore after a crash mid-insertion,
    /// which finds the rule by its match) leaves them. None are needed where the location
    /// `at` is chosen before the insertion: the marker is not used.
    ///
    /// A port rule's are looked for on the NIC (`find`): an operator's identical `ethtool -N`
    /// rule may be there. A connection's 5-tuple rule ([`RuleKind::Flow`]) is not looked for:
    /// that is a listing and one read per rule on the NIC, one rule per live connection,
    /// before every new connection. Its match holds the peer's ephemeral port of a connection
    /// just accepted, which no operator's rule names ahead of time; the only rules that can
    /// match it already are this journal's own, for an earlier connection of the same 4-tuple
    /// whose deletion failed, and those are taken from the journal (their own entries delete
    /// them). Were an unjournaled identical rule there all the same, the undo would find two
    /// rules (it and ours) and delete neither ([`NicError::AmbiguousRule`]), or, where the
    /// crash came before the insertion reached the NIC, delete that one: the risk the
    /// ephemeral port rules out.
    fn prior_rules(
        &self,
        kind: RuleKind,
        at: Option<u32>,
        m: &steer::Tcp4Match,
        queue: u32,
        find: impl FnOnce() -> Result<Vec<u32>, NicError>,
    ) -> Result<Vec<u32>, NicError> {
        match (at, kind) {
            (Some(_), _) => Ok(Vec::new()),
            (None, RuleKind::Port) => find(),
            (None, RuleKind::Flow) => Ok(self.journaled_rules(m, queue)),
        }
    }

    /// The locations of this journal's rule entries that steer what `m` matches onto `queue`.
    fn journaled_rules(&self, m: &steer::Tcp4Match, queue: u32) -> Vec<u32> {
        let ours = |c: &Change| match *c {
            Change::Rule {
                location,
                rule: Some(ref r),
                queue: Some(q),
            } if r == m && q == queue => Some(location),
            _ => None,
        };
        self.state.changes.iter().filter_map(ours).collect()
    }

    /// Journal one rule insertion, then make it with `insert`: `Rule { location }` is saved
    /// first where the location `at` is chosen before, else a [`Change::PendingRule`] marker
    /// (with the `existing` rules that match already), resolved to the location `insert`
    /// returns. A refused insertion drops the entry again; a resolution that cannot be saved
    /// deletes the rule (`delete`) and drops it too, or, where that deletion fails, keeps
    /// the entry (resolved in memory; on disk as first saved) for the restore to delete the
    /// rule, and logs that.
    fn insert_journaled(
        &mut self,
        at: Option<u32>,
        existing: Vec<u32>,
        rule: steer::Tcp4Match,
        queue: u32,
        insert: impl FnOnce(Option<u32>) -> Result<u32, NicError>,
        delete: impl FnOnce(u32) -> Result<(), NicError>,
    ) -> Result<u32, NicError> {
        let placed = |location| Change::Rule {
            location,
            rule: Some(rule),
            queue: Some(queue),
        };
        self.record(match at {
            Some(location) => placed(location),
            None => Change::PendingRule {
                rule,
                queue,
                existing,
            },
        })?;
        let entry = self.state.changes.len() - 1;
        let location = match insert(at) {
            Ok(location) => location,
            Err(e) => {
                // Not made: not journaled either.
                self.forget(entry);
                return Err(e);
            }
        };
        if at != Some(location) {
            self.state.changes[entry] = placed(location);
            if let Err(e) = self.save() {
                // Not journaled by its location: not left on the NIC either, if it can be
                // deleted; else its entry stays, for the restore.
                match delete(location) {
                    Ok(()) => self.forget(entry),
                    Err(del) => tracing::warn!(
                        ifname = %self.state.ifname,
                        location,
                        error = %del,
                        "NIC journal: a rule inserted but not journaled by its location could \
                         not be deleted; its entry is kept, for the restore to delete it"
                    ),
                }
                return Err(e);
            }
        }
        Ok(location)
    }

    /// Delete rule `r` ([`Journal::add_flow`], [`Journal::steer`]) and its journal entry. The
    /// rule at its location is deleted only if it is still `r`, as a restore checks it: one
    /// already gone (a driver reset, `ethtool -K ntuple off`) is as good as deleted, and a
    /// rule put there since (another connection's) is not `r`'s to delete. Returns which
    /// ([`RuleUndo`]), for the caller to log.
    pub fn remove_flow(
        &mut self,
        client: &mut EthtoolClient,
        r: InsertedRule,
    ) -> Result<RuleUndo, NicError> {
        let ifname = self.state.ifname.clone();
        let client: &EthtoolClient = client;
        self.remove_journaled(r, || {
            undo_rule(client, &ifname, r.location, Some((&r.rule, r.queue)))
        })
    }

    /// Drop `r`'s own journal entry (matched by location, match and queue: another entry at
    /// the same location is another rule's) once `delete` has dealt with the rule; if it
    /// fails the entry stays, for the restore.
    fn remove_journaled(
        &mut self,
        r: InsertedRule,
        delete: impl FnOnce() -> Result<RuleUndo, NicError>,
    ) -> Result<RuleUndo, NicError> {
        let done = delete()?;
        let entry = r.change();
        if let Some(at) = self.state.changes.iter().rposition(|c| *c == entry) {
            self.state.changes.remove(at);
            self.save()?;
        }
        Ok(done)
    }

    /// Undo every change in reverse order and delete the state file. When a step fails, its
    /// error is returned and the file is kept for the next start: with only the changes
    /// whose undo failed where it could be saved, else also steps already undone, which the
    /// next start undoes again (logged, `file_stale`: [`warn_if_stale`]). With every step
    /// undone the changes are returned and the file removed, even where saving it on the way
    /// or removing it failed (each logged): the NIC is restored ([`settle_undo`]).
    pub fn restore(self, client: &mut EthtoolClient) -> Result<Vec<Change>, NicError> {
        self.restore_with(client)
    }

    /// [`Journal::restore`] through any [`UndoOps`] (a test's stand-in for a NIC).
    fn restore_with<C: UndoOps>(mut self, client: &mut C) -> Result<Vec<Change>, NicError> {
        let changes = self.state.changes.clone();
        let undone = undo(&self.path, &mut self.state, client);
        settle_undo(&self.path, &self.state, undone)
            .inspect_err(|_| warn_if_stale(&self.path, &self.state))?;
        Ok(changes)
    }

    /// [`Journal::restore`] for a caller that cannot return its error (drop, the undo of a
    /// failed setup). Each failed step is logged by the undo ([`warn_undo_failed`]); this
    /// logs once what is left (the state file, kept for the next start), not those errors
    /// again: the steps left, and whether the file, which could not be saved, also lists
    /// steps already undone, which the next start undoes again (`file_stale`:
    /// [`lists_undone`]). With no step left there is no such summary: the file is removed
    /// ([`settle_undo`]).
    fn restore_or_warn<C: UndoOps>(mut self, client: &mut C) {
        let undone = undo(&self.path, &mut self.state, client);
        if settle_undo(&self.path, &self.state, undone).is_err() {
            let (path, state) = (&self.path, &self.state);
            if lists_undone(path, state) {
                tracing::warn!(
                    ifname = %state.ifname,
                    path = %path.display(),
                    steps_left = state.changes.len(),
                    file_stale = true,
                    "NIC restore incomplete: its state file is kept, and the next start retries \
                     the steps left (each failure is logged on its own); the file could not be \
                     saved (logged above), so it also lists steps already undone, which the \
                     next start will undo again: free its disk, and check those settings \
                     before the next start"
                );
            } else {
                tracing::warn!(
                    ifname = %state.ifname,
                    path = %path.display(),
                    steps_left = state.changes.len(),
                    file_stale = false,
                    "NIC restore incomplete: its state file is kept, and the next start retries \
                     the steps left (each failure is logged on its own)"
                );
            }
        }
    }
}

/// After [`undo`] of `state`, journaled at `path` (`undone`: what the undo returned). With
/// steps left: the undo's error, and the file keeps them for the next start (and, where its
/// last save failed, steps already undone too: the callers log that, [`lists_undone`]). With
/// none: the file is removed whatever `undone` says, since a save that failed on the way left
/// it listing steps already undone, which the next start would redo (ntuple turned off again
/// flushes the operator's rules); a failed removal is logged with its own message, not
/// returned, as the NIC is restored.
fn settle_undo(
    path: &Path,
    state: &StateFile,
    undone: Result<(), NicError>,
) -> Result<(), NicError> {
    if !state.changes.is_empty() {
        return undone;
    }
    match (remove(path), undone.is_ok()) {
        (Ok(()), true) => {}
        (Ok(()), false) => tracing::info!(
            ifname = %state.ifname,
            path = %path.display(),
            "NIC settings restored: every step was undone; the state file, which could not \
             be saved on the way (logged above), is removed"
        ),
        // The last save went through: the file records no change, and the next start
        // removes it unchecked.
        (Err(e), true) => tracing::warn!(
            ifname = %state.ifname,
            path = %path.display(),
            error = %e,
            "NIC settings restored, but the state file could not be removed; it records no \
             change now, and the next start removes it"
        ),
        (Err(e), false) => tracing::warn!(
            ifname = %state.ifname,
            path = %path.display(),
            error = %e,
            "NIC settings restored, but the state file could neither be saved (logged above) \
             nor removed: it may still list steps already undone, which the next start would \
             redo; remove it before then"
        ),
    }
    Ok(())
}

/// Whether the state file at `path` lists more steps than `state` keeps: a save after a step
/// was undone failed, so the file still lists steps already undone, which the next start
/// undoes again. Read back after a restore that left steps ([`settle_undo`]); the undo only
/// drops steps, so a file listing more is one not saved since. One that cannot be read or
/// parsed counts as not stale (the next start reports it as it is).
fn lists_undone(path: &Path, state: &StateFile) -> bool {
    std::fs::read(path)
        .ok()
        .and_then(|raw| serde_json::from_slice::<StateFile>(&raw).ok())
        .is_some_and(|disk| disk.changes.len() > state.changes.len())
}

/// For a restore that returns its error (steps left, the state file kept): logs, where the
/// file could not be saved and so also lists steps already undone ([`lists_undone`]), that
/// the next start will undo those again; nothing where the file keeps only the steps left.
fn warn_if_stale(path: &Path, state: &StateFile) {
    if lists_undone(path, state) {
        tracing::warn!(
            ifname = %state.ifname,
            path = %path.display(),
            steps_left = state.changes.len(),
            file_stale = true,
            "NIC restore incomplete, and its state file could not be saved (logged above): \
             besides the steps left it lists steps already undone, which the next start will \
             undo again; free its disk, and check those settings before the next start"
        );
    }
}

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

/// Undo `state`'s changes, last first, each tried whatever the others did. Each one undone
/// is dropped from `state` and the file at `path` right away, so the file keeps only those
/// not undone: a retry (the next start) redoes no finished step (a rule deleted twice could
/// be someone else's by then; ntuple turned off twice would flush the operator's rules).
/// Where the file cannot be saved (each failure logged, the first returned), it still lists
/// steps undone since its last save: with every step undone it is removed
/// ([`settle_undo`]); with steps left the callers say so ([`lists_undone`]). Returns the
/// first error.
fn undo<C: UndoOps>(path: &Path, state: &mut StateFile, client: &mut C) -> Result<(), NicError> {
    let mut first_err = None;
    let ifname = state.ifname.clone();
    let mut note = |e: NicError| {
        warn_undo_failed(&ifname, &e);
        first_err.get_or_insert(e);
    };
    for i in (0..state.changes.len()).rev() {
        // `changes[..i]`: the entries this restore undoes after this one.
        let (rest, c) = (&state.changes[..i], &state.changes[i]);
        match undo_one(&mut *client, state.ifindex, &state.ifname, c, rest) {
            Ok(()) => {
                // Saved after each setting put back (a retry must not put it back again over
                // what changed since); rule deletions, one per data connection and checked
                // when redone (a rule entry of an earlier release is not: saved at once),
                // are saved with the rest at the end.
                let c = state.changes.remove(i);
                let checked = matches!(
                    c,
                    Change::Rule {
                        rule: Some(_),
                        queue: Some(_),
                        ..
                    } | Change::PendingRule { .. }
                );
                if !checked && let Err(e) = write_state(path, state) {
                    note(e);
                }
            }
            Err(e) => note(e),
        }
    }
    if let Err(e) = write_state(path, state) {
        note(e);
    }
    first_err.map_or(Ok(()), Err)
}

/// Undo one change on interface `ifname` (index `ifindex`); `rest`: the journal's entries
/// undone after it (those before it), whose rules a [`Change::PendingRule`]'s undo leaves to
/// them ([`rules_deleted_by`]).
fn undo_one<C: UndoOps>(
    client: &mut C,
    ifindex: u32,
    ifname: &str,
    c: &Change,
    rest: &[Change],
) -> Result<(), NicError> {
    match *c {
        Change::NtupleOn => client.set_ntuple(ifname, false),
        Change::Rule {
            location,
            ref rule,
            queue,
        } => undo_rule(&*client, ifname, location, rule.as_ref().zip(queue))
            .map(|done| warn_left(ifname, &done)),
        Change::PendingRule {
            ref rule,
            queue,
            ref existing,
        } => {
            let owned = rules_deleted_by(rest, rule, queue);
            undo_pending_rule(&*client, ifname, rule, queue, existing, &owned)
                .map(|done| warn_left(ifname, &done))
        }
        Change::Rss { ref table } => client.set_rss_indir(ifname, table),
        Change::Channels { rx, tx, combined } => {
            client.set_channels(ifindex, ifname, rx, tx, combined)
        }
        // 0 (`unknown`) is set too: it is `tcp-data-split auto`, the driver's default. A
        // driver without the attribute (its rings-get omitted it, read as 0) refuses any
        // rings-set of it: then there is nothing to restore.
        Change::Rings {
            tcp_data_split,
            hds_thresh,
        } => match client.set_rings(ifindex, ifname, tcp_data_split, hds_thresh) {
            Err(NicError::Kernel { errno, .. })
                if tcp_data_split == 0 && errno == libc::EOPNOTSUPP =>
            {
                Ok(())
            }
            other => other,
        },
    }
}

/// A restore's warning for a rule it left ([`RuleUndo`] other than `Removed`): an event in
/// the service's log with the interface, the location(s) and the outcome in words.
fn warn_left(ifname: &str, done: &RuleUndo) {
    match done {
        RuleUndo::Removed => {}
        RuleUndo::NotOurs { location } => tracing::warn!(
            %ifname,
            location,
            outcome = %done,
            "restoring NIC settings: a journaled steering rule was not deleted (see outcome)"
        ),
        RuleUndo::PriorLeft { locations } => tracing::warn!(
            %ifname,
            ?locations,
            outcome = %done,
            "restoring NIC settings: steering rules that match one being added when the \
             process stopped were there before it, and stay (see outcome)"
        ),
    }
}

/// A restore's warning for a step whose undo failed (the state file keeps it for the next
/// start's retry), logged once per failure; a caller that cannot return the restore's error
/// logs a summary of what is left, not the error again ([`Journal::restore_or_warn`]).
fn warn_undo_failed(ifname: &str, e: &NicError) {
    tracing::warn!(%ifname, error = %e, "restoring NIC settings failed (see error)");
}

/// Undo a [`Change::Rule`]: delete the rule at `location`, where it is the one journaled
/// (`what`: its match and queue; an entry of an earlier release has none and is deleted
/// unchecked). Another rule there (the insertion never happened, and the location was taken
/// since, e.g. by `ethtool -N`) is left ([`RuleUndo::NotOurs`]); the caller logs that.
fn undo_rule<C: UndoOps>(
    client: &C,
    ifname: &str,
    location: u32,
    what: Option<(&steer::Tcp4Match, u32)>,
) -> Result<RuleUndo, NicError> {
    if let Some((rule, queue)) = what {
        match client.rule_at_is(ifname, location, rule, queue)? {
            None => return Ok(RuleUndo::Removed),
            Some(false) => return Ok(RuleUndo::NotOurs { location }),
            Some(true) => {}
        }
    }
    gone_is_done(client.delete_rule(ifname, location)).map(|()| RuleUndo::Removed)
}

/// Undo a [`Change::PendingRule`]: the insertion may or may not have happened, at a
/// location nobody recorded. Rules that match it at the locations `owned` are deleted by
/// the journal's own entries later in the same restore ([`rules_deleted_by`]), so are left
/// to them. Other rules that match it but were there before (`existing`) are not the one it
/// was adding and stay ([`RuleUndo::PriorLeft`]; the caller logs that). Of the rest: none,
/// nothing to do; one, delete it; more than one, which is ours cannot be told, so none is
/// deleted ([`NicError::AmbiguousRule`]).
fn undo_pending_rule<C: UndoOps>(
    client: &C,
    ifname: &str,
    rule: &steer::Tcp4Match,
    queue: u32,
    existing: &[u32],
    owned: &[u32],
) -> Result<RuleUndo, NicError> {
    let found = client.find_rules(ifname, rule, queue)?;
    let (ours, theirs) = pending_rule_candidates(found, existing, owned);
    match ours.as_slice() {
        [] => {}
        [location] => gone_is_done(client.delete_rule(ifname, *location))?,
        locations => {
            return Err(NicError::AmbiguousRule {
                ifname: ifname.into(),
                locations: locations.to_vec(),
            });
        }
    }
    if theirs.is_empty() {
        Ok(RuleUndo::Removed)
    } else {
        Ok(RuleUndo::PriorLeft { locations: theirs })
    }
}

/// The rules `found` matching a [`Change::PendingRule`], split into those that may be the
/// one it was inserting and those that stay: the `existing` ones, there before it. Those at
/// `owned` locations are in neither: the journal's own entries delete them in the same
/// restore ([`rules_deleted_by`]), so they neither stay nor are the marker's to delete.
fn pending_rule_candidates(
    found: Vec<u32>,
    existing: &[u32],
    owned: &[u32],
) -> (Vec<u32>, Vec<u32>) {
    found
        .into_iter()
        .filter(|l| !owned.contains(l))
        .partition(|l| !existing.contains(l))
}

/// The locations whose rule the undo of the `Rule` entries in `entries` deletes where that
/// rule steers what `rule` matches onto `queue` (a [`Change::PendingRule`]'s match): entries
/// of the same match and queue (checked at undo, and the rule there is one of theirs) and
/// those of an earlier release without them (deleted unchecked). Entries of another match
/// leave such a rule ([`RuleUndo::NotOurs`]), so are not counted.
fn rules_deleted_by(entries: &[Change], rule: &steer::Tcp4Match, queue: u32) -> Vec<u32> {
    let deletes = |c: &Change| match *c {
        Change::Rule {
            location,
            rule: Some(ref r),
            queue: Some(q),
        } => (r == rule && q == queue).then_some(location),
        Change::Rule { location, .. } => Some(location),
        _ => None,
    };
    entries.iter().filter_map(deletes).collect()
}

/// A rule deletion the kernel answers with ENOENT: the rule is not there, which is what the
/// deletion wanted.
fn gone_is_done(r: Result<(), NicError>) -> Result<(), NicError> {
    match r {
        Err(NicError::Kernel { errno, .. }) if errno == libc::ENOENT => Ok(()),
        r => r,
    }
}

/// The requests a restore makes of the NIC ([`undo`]): [`EthtoolClient`]'s own (each
/// forwards to its method of the same name), or a test's stand-in for a NIC's rules.
trait UndoOps {
    fn set_ntuple(&self, ifname: &str, on: bool) -> Result<(), NicError>;
    fn find_rules(
        &self,
        ifname: &str,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Vec<u32>, NicError>;
    fn rule_at_is(
        &self,
        ifname: &str,
        location: u32,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Option<bool>, NicError>;
    fn delete_rule(&self, ifname: &str, location: u32) -> Result<(), NicError>;
    fn set_rss_indir(&self, ifname: &str, table: &[u32]) -> Result<(), NicError>;
    fn set_channels(
        &mut self,
        ifindex: u32,
        ifname: &str,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError>;
    fn set_rings(
        &mut self,
        ifindex: u32,
        ifname: &str,
        tcp_data_split: u8,
        hds_thresh: Option<u32>,
    ) -> Result<(), NicError>;
}

impl UndoOps for EthtoolClient {
    fn set_ntuple(&self, ifname: &str, on: bool) -> Result<(), NicError> {
        EthtoolClient::set_ntuple(self, ifname, on)
    }

    fn find_rules(
        &self,
        ifname: &str,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Vec<u32>, NicError> {
        EthtoolClient::find_rules(self, ifname, m, queue)
    }

    fn rule_at_is(
        &self,
        ifname: &str,
        location: u32,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Option<bool>, NicError> {
        EthtoolClient::rule_at_is(self, ifname, location, m, queue)
    }

    fn delete_rule(&self, ifname: &str, location: u32) -> Result<(), NicError> {
        EthtoolClient::delete_rule(self, ifname, location)
    }

    fn set_rss_indir(&self, ifname: &str, table: &[u32]) -> Result<(), NicError> {
        EthtoolClient::set_rss_indir(self, ifname, table)
    }

    fn set_channels(
        &mut self,
        ifindex: u32,
        ifname: &str,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError> {
        EthtoolClient::set_channels(self, ifindex, ifname, rx, tx, combined)
    }

    fn set_rings(
        &mut self,
        ifindex: u32,
        ifname: &str,
        tcp_data_split: u8,
        hds_thresh: Option<u32>,
    ) -> Result<(), NicError> {
        EthtoolClient::set_rings(self, ifindex, ifname, tcp_data_split, hds_thresh)
    }
}

/// After a crash: undo what the state file at `path` records (entering its network
/// namespace if it names one) and delete it. `Ok(None)` when there is no state file;
/// [`NicError::StateInUse`] when a running process holds its lock (its live setup). A file
/// made before the last reboot is removed without undoing anything ([`Restore::Stale`]); one
/// whose interface name no longer has the index it recorded is left, and nothing undone
/// ([`NicError::StateMismatch`]). One that records no change is removed unchecked
/// ([`Restore::Undone`] with no changes). A step whose undo fails is returned as the error,
/// the file keeping the steps left (and, where it could not be saved, steps already undone,
/// which the next start undoes again: logged, [`warn_if_stale`]); with every step undone the
/// file is removed, even where saving it on the way failed ([`settle_undo`]).
pub fn restore_from(path: &Path) -> Result<Option<Restore>, NicError> {
    if !path.exists() {
        return Ok(None);
    }
    // Held until this returns: the file is a leftover only if no running process holds it.
    let _lock = lock(path)?;
    let raw = match std::fs::read(path) {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(NicError::State {
                path: path.into(),
                reason: e.to_string(),
            });
        }
    };
    let mut state: StateFile = serde_json::from_slice(&raw).map_err(|e| NicError::State {
        path: path.into(),
        reason: format!("not a shardwire NIC state file: {e}"),
    })?;
    if let (Some(then), Some(now)) = (&state.boot_id, boot_id())
        && *then != now
    {
        remove(path)?;
        return Ok(Some(Restore::Stale(state)));
    }
    if state.changes.is_empty() {
        // Nothing to undo (the process stopped right after creating the journal), so the
        // interface and namespace need not be there: kept, the file would refuse every
        // later setup (`StateExists`). Reported as undone, which the caller logs.
        remove(path)?;
        return Ok(Some(Restore::Undone(state)));
    }
    let mut client = match &state.netns {
        Some(ns) => EthtoolClient::open_in_netns(ns)?,
        None => EthtoolClient::open()?,
    };
    let found = match client.ifindex_of(&state.ifname) {
        Ok(i) => Some(i),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(NicError::State {
                path: path.into(),
                reason: format!("looking up interface {}: {e}", state.ifname),
            });
        }
    };
    if found != Some(state.ifindex) {
        return Err(NicError::StateMismatch {
            path: path.into(),
            ifname: state.ifname,
            recorded: state.ifindex,
            found,
        });
    }
    // What the file held: `undo` drops each change from it (and `state`) once undone.
    let recorded = state.clone();
    let undone = undo(path, &mut state, &mut client);
    settle_undo(path, &state, undone).inspect_err(|_| warn_if_stale(path, &state))?;
    Ok(Some(Restore::Undone(recorded)))
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
    /// Steer each of these TCP ports (a lane's data port) to its queue, and RSS to the queues
    /// below the lowest of `queues`; empty leaves steering to the operator.
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

    /// Steer TCP/IPv4 to `dst_port` onto `queue` (another lane's data port on a NIC already
    /// set up), and RSS over queues `0..rss_queues` when that is above 0; journaled. Returns
    /// the rule ([`NicSetup::remove_flow`] deletes it).
    pub fn steer(
        &mut self,
        dst_port: u16,
        queue: u32,
        rss_queues: u32,
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
/// `hds-thresh` 0. Each change is journaled at `state` first; on failure whatever was
/// changed is undone before the error is returned.
pub fn apply(plan: &SetupPlan, state: &Path) -> Result<NicSetup, NicError> {
    let mut client = match &plan.netns {
        Some(ns) => EthtoolClient::open_in_netns(ns)?,
        None => EthtoolClient::open()?,
    };
    let mut journal = Journal::create(state, &plan.ifname, plan.ifindex, plan.netns.clone())?;
    let result = (|| {
        let need = plan.queues.iter().max().map_or(0, |q| q + 1);
        let ch = client.channels(plan.ifindex, &plan.ifname)?;
        if ch.rx_queues() < need {
            let max = ch.combined_max.max(ch.rx_max);
            if max < need {
                return Err(NicError::NotEnoughQueues {
                    ifname: plan.ifname.clone(),
                    queue: need - 1,
                    max,
                });
            }
            if ch.combined_max > 0 {
                journal.set_channels(&mut client, ch.rx, ch.tx, need)?;
            } else {
                journal.set_channels(&mut client, need, ch.tx, ch.combined)?;
            }
        }
        journal.enable_header_split(&mut client)?;
        let first = plan.queues.iter().min().copied().unwrap_or(0);
        for (i, &(port, queue)) in plan.steer.iter().enumerate() {
            // RSS once, away from every bound queue (they are all at or above `first`).
            let rss = if i == 0 { first } else { 0 };
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
