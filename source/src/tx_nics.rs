//! Devmem TX on every NIC of a source (`devmem_tx = ["eth1", "eth2"]`): one TX binding per
//! interface ([`TxPath`]: never one dma-buf on two NICs), and for each data connection the NIC
//! it leaves by.
//!
//! That NIC is the one the kernel routes the lane's address through: the local address a UDP
//! socket connected to the lane's address gets (`connect` on UDP sends nothing), matched
//! against each TX interface's primary IPv4 address (`SIOCGIFADDR`), the only address
//! compared. The data connection is then bound to that NIC (`SO_BINDTODEVICE`), so it cannot
//! leave by another after a route change, and sends from that NIC's binding. A lane routed
//! through an interface without a TX binding sends with `sendfile`, and so does an IPv6 lane,
//! or one routed from a secondary address of a bound interface; the log says which local
//! address it would leave from and each interface's address it was compared with
//! ([`unbound_reason`]).

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;

use crate::devmem_tx::TxPath;

/// The source's TX bindings, one per interface.
#[derive(Debug, Default)]
pub struct TxNics {
    paths: Vec<Arc<TxPath>>,
}

/// How a data connection to a lane's address is sent.
#[derive(Debug)]
pub enum TxRoute {
    /// Through this NIC's binding (the connection is bound to the NIC).
    Nic(Arc<TxPath>),
    /// The kernel routes it from `local`, which is the primary IPv4 address of no TX
    /// interface: `sendfile`.
    NoBinding {
        /// The local address the route chose.
        local: IpAddr,
        /// Each TX interface with the address compared: its primary IPv4 address, if it has
        /// one.
        compared: Vec<(String, Option<Ipv4Addr>)>,
    },
    /// No route to the lane's address (the connect will fail and say so).
    Unroutable(io::Error),
}

impl TxNics {
    /// Over these bindings (their interfaces are distinct: the config checks it).
    pub fn new(paths: Vec<TxPath>) -> Self {
        Self {
            paths: paths.into_iter().map(Arc::new).collect(),
        }
    }

    /// No devmem TX: every connection uses `sendfile`.
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// The bindings, in configuration order.
    pub fn paths(&self) -> &[Arc<TxPath>] {
        &self.paths
    }

    /// How a data connection to `to` is sent (see the module docs).
    pub fn route(&self, to: SocketAddr) -> TxRoute {
        let local = match local_toward(to) {
            Ok(ip) => ip,
            Err(e) => return TxRoute::Unroutable(e),
        };
        let addrs: Vec<Option<Ipv4Addr>> = self
            .paths
            .iter()
            .map(|p| shardwire_devmem::ifaddr::ipv4(&p.ifname).ok().flatten())
            .collect();
        match choose(local, &addrs) {
            Some(i) => TxRoute::Nic(Arc::clone(&self.paths[i])),
            None => TxRoute::NoBinding {
                local,
                compared: self
                    .paths
                    .iter()
                    .map(|p| p.ifname.clone())
                    .zip(addrs)
                    .collect(),
            },
        }
    }
}

/// Why a lane routed from `local` gets no devmem TX binding, naming what was compared: each
/// TX interface's primary IPv4 address (`compared`), the only address matched. Before, the log
/// said only that the lane was reached from an address of no TX interface, which is wrong for
/// an IPv6 lane, or one routed from a secondary address, of a bound interface.
pub fn unbound_reason(local: IpAddr, compared: &[(String, Option<Ipv4Addr>)]) -> String {
    let each: Vec<String> = compared
        .iter()
        .map(|(name, addr)| match addr {
            Some(a) => format!("{name}: {a}"),
            None => format!("{name}: no IPv4 address found"),
        })
        .collect();
    format!(
        "the lane is reached from an address of no devmem TX interface, as far as the source \
         compares them: its local address {local} is not the primary IPv4 address of any ({}); \
         only that address of each interface is compared, so an IPv6 lane, or one routed from \
         a secondary address of a bound interface, sends with sendfile too",
        each.join(", ")
    )
}

/// The local address the kernel would send to `to` from.
fn local_toward(to: SocketAddr) -> io::Result<IpAddr> {
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(any)?;
    s.connect(to)?;
    Ok(s.local_addr()?.ip())
}

/// The TX interface whose IPv4 address is `local` (`nics[i]`: interface `i`'s address).
fn choose(local: IpAddr, nics: &[Option<Ipv4Addr>]) -> Option<usize> {
    let IpAddr::V4(local) = local else {
        return None;
    };
    nics.iter().position(|a| *a == Some(local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nic_is_the_one_owning_the_routed_local_address() {
        let nics = [
            Some(Ipv4Addr::new(10, 0, 1, 2)),
            None,
            Some(Ipv4Addr::new(10, 0, 2, 2)),
        ];
        assert_eq!(choose("10.0.2.2".parse().unwrap(), &nics), Some(2));
        assert_eq!(choose("10.0.1.2".parse().unwrap(), &nics), Some(0));
        assert_eq!(choose("10.0.3.2".parse().unwrap(), &nics), None);
        assert_eq!(choose("::1".parse().unwrap(), &nics), None);
    }

    #[test]
    fn loopback_routes_through_lo() {
        let nics = TxNics::new(vec![TxPath::emulated("lo", 1 << 16, 1).unwrap()]);
        match nics.route("127.0.0.1:9".parse().unwrap()) {
            TxRoute::Nic(p) => assert_eq!(p.ifname, "lo"),
            other => panic!("{other:?}"),
        }
        let none = TxNics::default();
        assert!(matches!(
            none.route("127.0.0.1:9".parse().unwrap()),
            TxRoute::NoBinding { .. }
        ));
    }

    /// An IPv6 lane of a bound interface: the reason names the address compared, and that
    /// IPv6 lanes and secondary addresses are not matched.
    #[test]
    fn the_reason_for_sendfile_says_what_was_compared() {
        let compared = [
            ("eth1".to_string(), Some(Ipv4Addr::new(10, 0, 1, 2))),
            ("eth2".to_string(), None),
        ];
        let why = unbound_reason("fd00::2".parse().unwrap(), &compared);
        for says in [
            "fd00::2",
            "(eth1: 10.0.1.2, eth2: no IPv4 address found)",
            "primary IPv4 address",
            "an IPv6 lane",
            "secondary address",
        ] {
            assert!(why.contains(says), "{says}: {why}");
        }
    }
}
