//! Checks the NIC each identified data connection came in on against its lane's NIC
//! (DESIGN §11). The matcher settles a connection's lane by the address it was dialled at;
//! under Linux's weak host model that address says nothing of the NIC the packets took (a
//! source whose only route to a lane's subnet is its default gateway brings the lane's
//! traffic in on the management NIC, and loose reverse-path filtering lets it in). The NIC
//! is read off the socket ([`shardwire_devmem::ingress`]: its NAPI id and netdev's
//! `napi-get`); a packet for a stacked lane NIC (VLAN, macvlan, bond) comes in on a device
//! under it, which counts as the lane's.
//!
//! Only a connection dialled at an address of its lane's NIC is checked: a lane on another
//! address (the one lane of a one-GPU node on the control connection's address, lanes
//! sharing one `data_listen`, a lane whose NIC had no address yet) takes its connections on
//! whatever NIC that address is reached through, by design. A checked connection is
//! received whatever the verdict (its bytes are as good; only its path is not the lane's)
//! and counted on its lane: `data_connections_on_nic`, or `data_connections_wrong_nic`, with
//! a warning naming both NICs at most once per lane and source host every
//! [`warn_limit::EVERY`], or `data_connections_nic_unknown` where the NIC cannot be told
//! (the NIC gives no NAPI ids: loopback, a veth without GRO; a kernel without them; an
//! interface the lane names that this host lacks), with the reason logged once per lane.
//! The check runs on a blocking thread, off the accept loop (it may ask netlink).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
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
            "the NAPI instance {id} a connection came in on is gone (its NIC was reconfigured \
             or removed)"
        )),
        Err(e) => Verdict::Unknown(e.to_string()),
    }
}

/// The check, with what it remembers: NAPI ids' devices, the lines said.
#[derive(Debug)]
pub struct IngressCheck {
    probe: Mutex<IngressProbe>,
    /// Wrong-NIC lines, by lane and source host.
    noise: Mutex<WarnLimit<(u32, IpAddr)>>,
    /// Lanes whose unknown NIC was logged.
    unknown_said: Mutex<BTreeSet<u32>>,
}

impl Default for IngressCheck {
    fn default() -> Self {
        Self {
            probe: Mutex::default(),
            noise: Mutex::new(WarnLimit::new(warn_limit::EVERY)),
            unknown_said: Mutex::default(),
        }
    }
}

impl IngressCheck {
    /// Checks `sock`, a data connection of `lane` from `peer` (of source `source`), on a
    /// blocking thread of the runtime where there is one (else here), with a duplicate of
    /// its fd; see the module doc.
    pub fn spawn(
        self: &Arc<Self>,
        lane: &Arc<Lane>,
        sock: &TcpStream,
        peer: SocketAddr,
        source: &str,
    ) {
        if lane.spec.nic.is_none() {
            return;
        }
        let sock = match sock.try_clone() {
            Ok(s) => s,
            Err(e) => {
                let why = format!("duplicating the connection's fd to check it: {e}");
                return self.count(lane, peer, source, &Verdict::Unknown(why));
            }
        };
        let (check, lane, source) = (Arc::clone(self), Arc::clone(lane), source.to_owned());
        let run = move || {
            check.check(&lane, &sock, peer, &source);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(run)),
            Err(_) => run(),
        }
    }

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
        let check = Arc::new(IngressCheck::default());
        let mut lane = Arc::into_inner(crate::lanes::test_lane(0, None)).unwrap();
        assert_eq!(check.check(&lane, &sock, peer, "src:1"), None);
        lane.spec.nic = Some("sw-no-such0".into());
        assert_eq!(check.check(&lane, &sock, peer, "src:1"), None);
        lane.spec.nic = Some("lo".into());
        let v = check.check(&lane, &sock, peer, "src:1");
        assert!(
            matches!(v, Some(Verdict::Unknown(ref why)) if why.contains("no NAPI id")),
            "{v:?}"
        );
        let (other, peer2, _d2) = accept("127.0.0.2:0");
        assert_eq!(check.check(&lane, &other, peer2, "src:1"), None);
        let counted = |l: &Lane| {
            let s = &l.stats;
            [&s.on_nic, &s.wrong_nic, &s.nic_unknown].map(|c| c.load(Ordering::Relaxed))
        };
        assert_eq!(counted(&lane), [0, 0, 1]);
        // The same through `spawn`, outside a runtime: checked at once, on this thread.
        let lane = Arc::new(lane);
        check.spawn(&lane, &sock, peer, "src:1");
        assert_eq!(counted(&lane), [0, 0, 2]);
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
        assert!(why.contains("NAPI instance 700"), "{why}");
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
