//! Checks the NIC each identified data connection came in on against its lane's NIC
//! (DESIGN §11). The matcher settles a connection's lane by the address it was dialled at;
//! under Linux's weak host model that address says nothing of the NIC the packets took (a
//! source whose only route to a lane's subnet is its default gateway brings the lane's
//! traffic in on the management NIC, and loose reverse-path filtering lets it in). The NIC
//! is read off the socket ([`shardwire_devmem::ingress`]: its NAPI id and netdev's
//! `napi-get`).
//!
//! A connection on another NIC is still received (its bytes are as good; only its path is
//! not the lane's): it is counted on its lane (`data_connections_wrong_nic`), and a warning
//! names both NICs, at most one per lane and source host every [`warn_limit::EVERY`]. Where
//! the NIC cannot be told (loopback, a device without NAPI ids, an interface the lane names
//! that this host lacks) the connection is counted as `data_connections_nic_unknown`, and
//! the reason is logged once per lane. A lane without a NIC (a host lane on a data address)
//! is not checked.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
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

/// The verdict on a connection of a lane on `nic`, from the lookup of that NIC's ifindex and
/// the probe's answer (`name_of` names another NIC by its ifindex). Pure.
pub fn verdict(
    nic: &str,
    lane_ifindex: Result<u32, IfAddrError>,
    got: Result<Ingress, IngressError>,
    name_of: impl Fn(u32) -> Option<String>,
) -> Verdict {
    let lane_ifindex = match lane_ifindex {
        Ok(i) => i,
        Err(e) => return Verdict::Unknown(format!("the lane's NIC {nic}: {e}")),
    };
    match got {
        Ok(Ingress::Nic(i)) if i == lane_ifindex => Verdict::OnLaneNic,
        Ok(Ingress::Nic(i)) => {
            Verdict::OtherNic(name_of(i).unwrap_or_else(|| format!("ifindex {i}")))
        }
        Ok(Ingress::NoNapiId) => Verdict::Unknown(format!(
            "its connections carry no NAPI id ({nic} receives without NAPI ids: loopback, a \
             veth without GRO, a kernel without CONFIG_NET_RX_BUSY_POLL)"
        )),
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
    /// Checks `sock`, a data connection of `lane` from `peer` (of source `source`), counts
    /// the outcome on the lane and logs it (see the module doc); returns the verdict, `None`
    /// for a lane without a NIC.
    pub fn check(
        &self,
        lane: &Lane,
        sock: &TcpStream,
        peer: SocketAddr,
        source: &str,
    ) -> Option<Verdict> {
        let nic = lane.spec.nic.as_deref()?;
        let got = self.probe.lock().expect("poisoned").ingress(sock.as_fd());
        let v = verdict(nic, ifaddr::ifindex(nic), got, ifaddr::name_of);
        match &v {
            Verdict::OnLaneNic => {}
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
        Some(v)
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
            verdict("eth1", Ok(4), Ok(Ingress::Nic(4)), name),
            Verdict::OnLaneNic
        );
        assert_eq!(
            verdict("eth1", Ok(4), Ok(Ingress::Nic(3)), name),
            Verdict::OtherNic("eth0".into())
        );
        // Another NIC that went since: named by its index.
        assert_eq!(
            verdict("eth1", Ok(4), Ok(Ingress::Nic(9)), name),
            Verdict::OtherNic("ifindex 9".into())
        );
    }

    /// Over a real loopback connection: a lane without a NIC is not checked; one on `lo`, or
    /// on a NIC this host lacks, counts the connection as unknown, not as on another NIC.
    #[test]
    fn loopback_connections_are_counted_unknown_on_their_lane() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _dialled = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (sock, peer) = listener.accept().unwrap();
        let check = IngressCheck::default();
        let mut lane = std::sync::Arc::into_inner(crate::lanes::test_lane(0, None)).unwrap();
        assert_eq!(check.check(&lane, &sock, peer, "src:1"), None);
        for nic in ["lo", "sw-no-such0"] {
            lane.spec.nic = Some(nic.into());
            let v = check.check(&lane, &sock, peer, "src:1");
            assert!(matches!(v, Some(Verdict::Unknown(_))), "{nic}: {v:?}");
        }
        assert_eq!(lane.stats.nic_unknown.load(Ordering::Relaxed), 2);
        assert_eq!(lane.stats.wrong_nic.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn what_cannot_be_told_says_why() {
        let unknown = |v: Verdict| match v {
            Verdict::Unknown(why) => why,
            v => panic!("{v:?}"),
        };
        let why = unknown(verdict("lo", Ok(1), Ok(Ingress::NoNapiId), name));
        assert!(
            why.contains("no NAPI id") && why.contains("lo receives"),
            "{why}"
        );
        let why = unknown(verdict("eth1", Ok(4), Ok(Ingress::NapiGone(700)), name));
        assert!(why.contains("NAPI instance 700"), "{why}");
        let missing = Err(IfAddrError::NoSuchInterface("eth9".into()));
        let why = unknown(verdict("eth9", missing, Ok(Ingress::Nic(3)), name));
        assert!(
            why.contains("the lane's NIC eth9") && why.contains("no network interface named eth9"),
            "{why}"
        );
        let sockopt = Err(IngressError::Sockopt(std::io::Error::other("bad fd")));
        let why = unknown(verdict("eth1", Ok(4), sockopt, name));
        assert!(why.contains("SO_INCOMING_NAPI_ID"), "{why}");
    }
}
