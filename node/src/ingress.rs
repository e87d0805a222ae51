//! Checks the NIC each identified data connection came in on against its lane's NIC
//! (DESIGN §11). The matcher settles a connection's lane by the address it was dialled at;
//! under Linux's weak host model that address says nothing of the NIC the packets took (a
//! source whose only route to a lane's subnet is its default gateway brings the lane's
//! traffic in on the management NIC, and loose reverse-path filtering lets it in). The NIC
//! is read off the socket ([`shardwire_devmem::ingress`]: its NAPI id and netdev's
//! `napi-get`); a packet for a stacked lane NIC (VLAN, macvlan, bond) comes in on a device
//! under it, which counts as the lane's.
//!
//! Only a connection dialled at its lane's NIC's (primary IPv4) address is checked: a lane on
//! another address (the one lane of a one-GPU node on the control connection's address,
//! lanes sharing one `data_listen`, a lane whose NIC had no address yet, a lane on a NIC
//! this host lacks) takes its connections on whatever NIC that address is reached through,
//! by design. A checked connection is
//! received whatever the verdict (its bytes are as good; only its path is not the lane's)
//! and counted on its lane: `data_connections_on_nic`, or `data_connections_wrong_nic`, with
//! a warning naming both NICs at most once per lane and source host every
//! [`warn_limit::EVERY`], or `data_connections_nic_unknown` where the NIC cannot be told
//! (the NIC gives no NAPI ids: loopback, a veth without GRO; a kernel without them; a
//! macvlan or ipvlan NIC whose lower device is in another network namespace, as a pod's
//! often is), with the reason logged once per lane. The checks run on one thread of their
//! own, off the accept loop (they ask the kernel, which may wait on its rtnl lock).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::Instant;

use shardwire_devmem::ifaddr::{self, IfAddrError};
use shardwire_devmem::ingress::{Ingress, IngressError, IngressProbe};
use shardwire_protocol::warn_limit::{self, WarnLimit};

use crate::lanes::Lane;
use crate::matcher;

/// What the check found of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It came in on the lane's NIC.
    OnLaneNic,
    /// It came in on this other NIC (its name, or `ifindex N` where it has none now).
    OtherNic(String),
    /// The NIC cannot be told, for this reason.
    Unknown(String),
}

/// The verdict on a connection of a lane on `nic`, from the lookup of that NIC's ifindex
/// (with those of the devices it is stacked on) and the probe's answer (`name_of` names
/// another NIC by its ifindex). Pure.
pub fn verdict(
    nic: &str,
    lane_nic: Result<(u32, Vec<u32>), IfAddrError>,
    got: Result<Ingress, IngressError>,
    name_of: impl Fn(u32) -> Option<String>,
) -> Verdict {
    let (ifindex, lowers) = match lane_nic {
        Ok(l) => l,
        Err(e) => return Verdict::Unknown(format!("the lane's NIC {nic}: {e}")),
    };
    match got {
        Ok(Ingress::Nic(i)) if i == ifindex || lowers.contains(&i) => Verdict::OnLaneNic,
        Ok(Ingress::Nic(i)) => {
            Verdict::OtherNic(name_of(i).unwrap_or_else(|| format!("ifindex {i}")))
        }
        Ok(Ingress::NoNapiId) => Verdict::Unknown(format!(
            "its connections carry no NAPI id ({nic} receives without NAPI ids: loopback, a \
             veth without GRO)"
        )),
        Ok(Ingress::NoBusyPoll) => Verdict::Unknown(
            "this kernel has no SO_INCOMING_NAPI_ID (it was built without \
             CONFIG_NET_RX_BUSY_POLL)"
                .to_owned(),
        ),
        Ok(Ingress::NapiGone(id)) => Verdict::Unknown(format!(
            "netdev knows no NAPI instance {id}, which a connection came in on: its NIC is in \
             another network namespace (a macvlan or ipvlan lane NIC on a host device), or \
             was reconfigured or removed since"
        )),
        Err(e) => Verdict::Unknown(e.to_string()),
    }
}

/// Connections at most waiting for the checker thread; past it one is left unchecked, not
/// counted, with a warning at most once per lane every [`warn_limit::EVERY`].
const QUEUE: usize = 1024;

/// A connection to check, with what its lines name.
struct Job {
    lane: Arc<Lane>,
    /// A duplicate of the connection's fd (closed when checked).
    sock: TcpStream,
    peer: SocketAddr,
    source: String,
}

/// The checker thread's queue.
enum Queue {
    /// No connection was checked yet.
    NotStarted,
    /// The thread runs and takes connections here.
    Running(SyncSender<Job>),
    /// The thread could not start, when, and why (tried again [`RETRY_START`] later).
    Failed(Instant, String),
}

/// A checker thread that could not start is tried again after this long.
const RETRY_START: std::time::Duration = std::time::Duration::from_secs(10);

/// The check: one thread, started at the first connection to check, that checks them in
/// turn (its lookups ask the kernel, which may wait on the rtnl lock: never on the accept
/// loop, and never a thread per connection). The thread ends when this is dropped.
pub struct IngressCheck {
    checker: Arc<Checker>,
    queue: Mutex<Queue>,
    /// Lines about connections left unchecked (the queue full, the thread not running), by
    /// lane.
    unchecked: Mutex<WarnLimit<u32>>,
}

impl std::fmt::Debug for IngressCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngressCheck").finish_non_exhaustive()
    }
}

impl Default for IngressCheck {
    fn default() -> Self {
        Self {
            checker: Arc::default(),
            queue: Mutex::new(Queue::NotStarted),
            unchecked: Mutex::new(WarnLimit::new(warn_limit::EVERY)),
        }
    }
}

impl IngressCheck {
    /// Queues `sock`, a data connection of `lane` from `peer` (of source `source`), for the
    /// checker thread, with a duplicate of its fd; see the module doc. Returns whether it was
    /// queued: a connection of a lane without a NIC is not checked, and one the thread cannot
    /// take (its queue full, the thread not running) is left unchecked, not counted (it may
    /// be one the check would skip), with a warning at most once per lane every
    /// [`warn_limit::EVERY`].
    pub fn spawn(
        &self,
        lane: &Arc<Lane>,
        sock: &TcpStream,
        peer: SocketAddr,
        source: &str,
    ) -> bool {
        if lane.spec.nic.is_none() {
            return false;
        }
        let sock = match sock.try_clone() {
            Ok(s) => s,
            Err(e) => {
                self.unchecked(lane, &format!("duplicating its fd: {e}"));
                return false;
            }
        };
        let job = Job {
            lane: Arc::clone(lane),
            sock,
            peer,
            source: source.to_owned(),
        };
        let why = match self.sender() {
            Ok(tx) => match tx.try_send(job) {
                Ok(()) => return true,
                Err(TrySendError::Full(_)) => {
                    format!("{QUEUE} connections wait for the check already")
                }
                Err(TrySendError::Disconnected(_)) => "the check thread ended".to_owned(),
            },
            Err(why) => why,
        };
        self.unchecked(lane, &why);
        false
    }

    /// Says that a connection of `lane` was left unchecked, and `why`, at most once per lane
    /// every [`warn_limit::EVERY`].
    fn unchecked(&self, lane: &Lane, why: &str) {
        let hit = self
            .unchecked
            .lock()
            .expect("poisoned")
            .hit(lane.id(), Instant::now());
        if let Some(suppressed) = hit {
            tracing::warn!(lane = lane.id(), %why, suppressed,
                "a data connection of the lane was not checked for the NIC it came in on (one such line per lane every {} s)",
                warn_limit::EVERY.as_secs());
        }
    }

    /// The checker thread's queue, the thread started if it was not (or failed to start more
    /// than [`RETRY_START`] ago); else why it cannot run.
    fn sender(&self) -> Result<SyncSender<Job>, String> {
        let mut queue = self.queue.lock().expect("poisoned");
        let start = match &*queue {
            Queue::NotStarted => true,
            Queue::Failed(at, _) => at.elapsed() >= RETRY_START,
            Queue::Running(_) => false,
        };
        if start {
            let (tx, rx) = sync_channel::<Job>(QUEUE);
            let checker = Arc::clone(&self.checker);
            let started = std::thread::Builder::new()
                .name("sw-ingress".into())
                .spawn(move || {
                    for j in rx {
                        checker.check(&j.lane, &j.sock, j.peer, &j.source);
                    }
                });
            *queue = match started {
                Ok(_) => Queue::Running(tx),
                Err(e) => Queue::Failed(
                    Instant::now(),
                    format!("the check thread cannot start: {e}"),
                ),
            };
        }
        match &*queue {
            Queue::Running(tx) => Ok(tx.clone()),
            Queue::Failed(_, why) => Err(why.clone()),
            Queue::NotStarted => unreachable!("started above"),
        }
    }

    /// Says the wrong-NIC lines left out in windows now over.
    pub fn say_left_out(&self) {
        self.checker.say_left_out();
    }
}

/// What the check remembers: NAPI ids' devices, the lines said.
#[derive(Debug)]
struct Checker {
    probe: Mutex<IngressProbe>,
    /// Wrong-NIC lines, by lane and source host.
    noise: Mutex<WarnLimit<(u32, IpAddr)>>,
    /// Lanes whose unknown NIC was logged.
    unknown_said: Mutex<BTreeSet<u32>>,
}

impl Default for Checker {
    fn default() -> Self {
        Self {
            probe: Mutex::default(),
            noise: Mutex::new(WarnLimit::new(warn_limit::EVERY)),
            unknown_said: Mutex::default(),
        }
    }
}

impl Checker {
    /// Checks `sock` now, counts the outcome on the lane and logs it; returns the verdict,
    /// `None` for a connection not checked (a lane without a NIC, or not dialled at an
    /// address of its NIC).
    pub fn check(
        &self,
        lane: &Lane,
        sock: &TcpStream,
        peer: SocketAddr,
        source: &str,
    ) -> Option<Verdict> {
        let nic = lane.spec.nic.as_deref()?;
        let local = sock.local_addr().ok()?.ip().to_canonical();
        if ifaddr::ipv4(nic).ok().flatten().map(IpAddr::V4) != Some(local) {
            return None;
        }
        let got = self.probe.lock().expect("poisoned").ingress(sock.as_fd());
        let lane_nic = ifaddr::ifindex(nic).map(|i| (i, ifaddr::lower_ifindexes(nic)));
        let v = verdict(nic, lane_nic, got, ifaddr::name_of);
        self.count(lane, peer, source, &v);
        Some(v)
    }

    /// Counts `v` on `lane` and logs it (see the module doc).
    fn count(&self, lane: &Lane, peer: SocketAddr, source: &str, v: &Verdict) {
        let nic = lane.spec.nic.as_deref().unwrap_or("-");
        match v {
            Verdict::OnLaneNic => {
                lane.stats.on_nic.fetch_add(1, Ordering::Relaxed);
            }
            Verdict::OtherNic(other) => {
                lane.stats.wrong_nic.fetch_add(1, Ordering::Relaxed);
                let key = (lane.id(), matcher::host_of(peer.ip()));
                let hit = self
                    .noise
                    .lock()
                    .expect("poisoned")
                    .hit(key, Instant::now());
                if let Some(suppressed) = hit {
                    tracing::warn!(lane = lane.id(), %nic, arrived_on = %other, %peer, %source,
                        suppressed, every_s = warn_limit::EVERY.as_secs(),
                        "a data connection of the lane came in on another NIC than the lane's: the source's route to the lane's address goes through another NIC (received anyway; fix the routes so the lane's subnet is reached through its NIC)");
                }
            }
            Verdict::Unknown(why) => {
                lane.stats.nic_unknown.fetch_add(1, Ordering::Relaxed);
                if self
                    .unknown_said
                    .lock()
                    .expect("poisoned")
                    .insert(lane.id())
                {
                    tracing::info!(lane = lane.id(), %nic, %why,
                        "cannot tell which NIC the lane's data connections come in on (said once per lane; counted in data_connections_nic_unknown)");
                }
            }
        }
    }

    /// Says the wrong-NIC lines left out in windows now over.
    pub fn say_left_out(&self) {
        let left = self.noise.lock().expect("poisoned").flush(Instant::now());
        for ((lane, host), suppressed) in left.keys {
            let host = matcher::host_name(host);
            tracing::warn!(lane, %host, suppressed,
                "lines about data connections of the lane from this host on another NIC left out since the last such line");
        }
        if left.untracked > 0 {
            tracing::warn!(
                suppressed = left.untracked,
                "lines about data connections on another NIC from hosts past those tracked left out"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(i: u32) -> Option<String> {
        (i == 3).then(|| "eth0".to_owned())
    }

    #[test]
    fn the_lane_nic_passes_and_another_is_named() {
        assert_eq!(
            verdict("eth1", Ok((4, vec![])), Ok(Ingress::Nic(4)), name),
            Verdict::OnLaneNic
        );
        assert_eq!(
            verdict("eth1", Ok((4, vec![])), Ok(Ingress::Nic(3)), name),
            Verdict::OtherNic("eth0".into())
        );
        // A stacked lane NIC (a VLAN or bond on eth0): packets come in on its lower device.
        assert_eq!(
            verdict("bond0", Ok((7, vec![3, 5])), Ok(Ingress::Nic(3)), name),
            Verdict::OnLaneNic
        );
        // Another NIC that went since: named by its index.
        assert_eq!(
            verdict("eth1", Ok((4, vec![])), Ok(Ingress::Nic(9)), name),
            Verdict::OtherNic("ifindex 9".into())
        );
    }

    /// Over real loopback connections: a lane on `lo` counts one dialled at lo's address as
    /// unknown (no NAPI id), not as on another NIC; a lane without a NIC, on a NIC this host
    /// lacks, or a connection dialled at another address than its NIC's (127.0.0.2: lo's
    /// address is 127.0.0.1) is not checked.
    #[test]
    fn only_connections_at_their_nics_address_are_checked() {
        let accept = |at: &str| {
            let listener = std::net::TcpListener::bind(at).unwrap();
            let dialled = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (sock, peer) = listener.accept().unwrap();
            (sock, peer, dialled)
        };
        let (sock, peer, _d1) = accept("127.0.0.1:0");
        let check = IngressCheck::default();
        let mut lane = Arc::into_inner(crate::lanes::test_lane(0, None)).unwrap();
        assert_eq!(check.checker.check(&lane, &sock, peer, "src:1"), None);
        lane.spec.nic = Some("sw-no-such0".into());
        assert_eq!(check.checker.check(&lane, &sock, peer, "src:1"), None);
        lane.spec.nic = Some("lo".into());
        let v = check.checker.check(&lane, &sock, peer, "src:1");
        assert!(
            matches!(v, Some(Verdict::Unknown(ref why)) if why.contains("no NAPI id")),
            "{v:?}"
        );
        let (other, peer2, _d2) = accept("127.0.0.2:0");
        assert_eq!(check.checker.check(&lane, &other, peer2, "src:1"), None);
        let counted = |l: &Lane| {
            let s = &l.stats;
            [&s.on_nic, &s.wrong_nic, &s.nic_unknown].map(|c| c.load(Ordering::Relaxed))
        };
        assert_eq!(counted(&lane), [0, 0, 1]);
        // The same through `spawn`: checked on the check's thread, with a duplicate fd.
        let lane = Arc::new(lane);
        check.spawn(&lane, &sock, peer, "src:1");
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while counted(&lane) != [0, 0, 2] && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(counted(&lane), [0, 0, 2]);
        // A lane without a NIC is not queued at all.
        let bare = crate::lanes::test_lane(1, None);
        assert!(!check.spawn(&bare, &sock, peer, "src:1"));
        drop(check);
        assert_eq!(counted(&bare), [0, 0, 0]);
    }

    /// A connection the check thread cannot take is left unchecked, not counted as unknown
    /// (before, it was: on lanes the check skips by design too), and a thread that failed to
    /// start is started again once [`RETRY_START`] has passed.
    #[test]
    fn connections_the_thread_cannot_take_are_not_counted_and_a_failed_start_is_retried() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _dialled = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (sock, peer) = listener.accept().unwrap();
        let mut lane = Arc::into_inner(crate::lanes::test_lane(0, None)).unwrap();
        lane.spec.nic = Some("lo".into());
        let lane = Arc::new(lane);
        let check = IngressCheck::default();
        *check.queue.lock().unwrap() = Queue::Failed(Instant::now(), "no threads".into());
        assert!(!check.spawn(&lane, &sock, peer, "src:1"));
        let s = &lane.stats;
        let counted =
            || [&s.on_nic, &s.wrong_nic, &s.nic_unknown].map(|c| c.load(Ordering::Relaxed));
        assert_eq!(counted(), [0, 0, 0]);
        let long_ago = Instant::now().checked_sub(RETRY_START).unwrap();
        *check.queue.lock().unwrap() = Queue::Failed(long_ago, "no threads".into());
        assert!(check.spawn(&lane, &sock, peer, "src:1"));
        assert!(matches!(*check.queue.lock().unwrap(), Queue::Running(_)));
    }

    #[test]
    fn what_cannot_be_told_says_why() {
        let unknown = |v: Verdict| match v {
            Verdict::Unknown(why) => why,
            v => panic!("{v:?}"),
        };
        let why = unknown(verdict("lo", Ok((1, vec![])), Ok(Ingress::NoNapiId), name));
        assert!(
            why.contains("no NAPI id") && why.contains("lo receives"),
            "{why}"
        );
        let why = unknown(verdict(
            "eth1",
            Ok((4, vec![])),
            Ok(Ingress::NapiGone(700)),
            name,
        ));
        assert!(
            why.contains("NAPI instance 700") && why.contains("another network namespace"),
            "{why}"
        );
        let why = unknown(verdict(
            "eth1",
            Ok((4, vec![])),
            Ok(Ingress::NoBusyPoll),
            name,
        ));
        assert!(why.contains("CONFIG_NET_RX_BUSY_POLL"), "{why}");
        let missing = Err(IfAddrError::NoSuchInterface("eth9".into()));
        let why = unknown(verdict("eth9", missing, Ok(Ingress::Nic(3)), name));
        assert!(
            why.contains("the lane's NIC eth9") && why.contains("no network interface named eth9"),
            "{why}"
        );
        let sockopt = Err(IngressError::Sockopt(std::io::Error::other("bad fd")));
        let why = unknown(verdict("eth1", Ok((4, vec![])), sockopt, name));
        assert!(why.contains("SO_INCOMING_NAPI_ID"), "{why}");
    }
}
