//! The data listeners of a node's lanes: one socket per distinct lane address, where lanes
//! that share a NIC share its address (their connections are told apart by the source's
//! announcement), a wildcard on a port serves every lane on that port and address family
//! (one cannot bind a wildcard and a specific address to one port), `[::]` every lane on its
//! port of either family (bound with `IPV6_V6ONLY` off whatever `net.ipv6.bindv6only` says,
//! it is dual-stack and holds the port for IPv4 too), and port 0 gets an ephemeral port of its
//! own per lane. [`group`] is the pure rule, [`bind`] binds one listener.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// One listener to bind and the lanes it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// The address to bind.
    pub addr: SocketAddr,
    /// The lanes it serves, in id order.
    pub lanes: Vec<u32>,
}

/// The wildcard some lane asks for on `a`'s port that also holds `a`: `[::]` for either
/// family (dual-stack: binding it beside `10.0.1.5:7401` failed with EADDRINUSE), else
/// `0.0.0.0` for an IPv4 `a`.
fn wildcard_for(lanes: &[(u32, SocketAddr)], a: SocketAddr) -> Option<SocketAddr> {
    let asked = |ip: IpAddr| {
        lanes
            .iter()
            .any(|(_, w)| w.ip() == ip && w.port() == a.port())
    };
    let (v6, v4) = (
        IpAddr::from(Ipv6Addr::UNSPECIFIED),
        IpAddr::from(Ipv4Addr::UNSPECIFIED),
    );
    if asked(v6) {
        return Some(SocketAddr::new(v6, a.port()));
    }
    (a.is_ipv4() && asked(v4)).then_some(SocketAddr::new(v4, a.port()))
}

/// Binds a listener on `addr` as `tokio::net::TcpListener::bind` does (`SO_REUSEADDR`,
/// close-on-exec, non-blocking; a backlog of 1024 where tokio's is 128: a source tier dials
/// every lane at once), but a `[::]` listener dual-stack explicitly: [`group`] gives it the IPv4
/// lanes of its port, which a host with `net.ipv6.bindv6only = 1` would leave unreachable.
/// Call inside a Tokio runtime.
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.ip() == IpAddr::from(Ipv6Addr::UNSPECIFIED) {
        sock.set_only_v6(false)?;
    }
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    sock.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(sock.into())
}

/// The listeners of lanes `(id, data_listen)`, in the order of their first lane.
pub fn group(lanes: &[(u32, SocketAddr)]) -> Vec<Listener> {
    let mut out: Vec<Listener> = Vec::new();
    for &(id, addr) in lanes {
        let bind = match addr.port() {
            0 => None,
            _ => Some(wildcard_for(lanes, addr).unwrap_or(addr)),
        };
        match bind.and_then(|b| out.iter_mut().find(|l| l.addr == b)) {
            Some(l) => l.lanes.push(id),
            None => out.push(Listener {
                addr: bind.unwrap_or(addr),
                lanes: vec![id],
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_v6_wildcard_listener_is_dual_stack_whatever_the_sysctl() {
        let l = bind("[::]:0".parse().unwrap()).unwrap();
        assert!(!socket2::SockRef::from(&l).only_v6().unwrap());
        let port = l.local_addr().unwrap().port();
        let dial = tokio::net::TcpStream::connect(("127.0.0.1", port));
        let (accepted, dialed) = tokio::join!(l.accept(), dial);
        let (_, peer) = accepted.unwrap();
        dialed.unwrap();
        assert_eq!(peer.ip().to_canonical(), IpAddr::from(Ipv4Addr::LOCALHOST));
        // A specific address binds as before, and a second bind of a port in use fails.
        let v4 = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        assert!(bind(v4.local_addr().unwrap()).is_err());
    }

    fn lanes(addrs: &[&str]) -> Vec<(u32, SocketAddr)> {
        addrs
            .iter()
            .enumerate()
            .map(|(i, a)| (i as u32, a.parse().unwrap()))
            .collect()
    }

    fn shown(ls: &[Listener]) -> Vec<(String, Vec<u32>)> {
        ls.iter()
            .map(|l| (l.addr.to_string(), l.lanes.clone()))
            .collect()
    }

    #[test]
    fn one_listener_per_address_shared_by_lanes_of_one_nic() {
        let got = group(&lanes(&["10.0.1.5:7401", "10.0.1.5:7401", "10.0.2.5:7401"]));
        assert_eq!(
            shown(&got),
            [
                ("10.0.1.5:7401".into(), vec![0, 1]),
                ("10.0.2.5:7401".into(), vec![2])
            ]
        );
    }

    #[test]
    fn a_wildcard_serves_every_lane_on_its_port_and_family() {
        let got = group(&lanes(&[
            "10.0.1.5:7401",
            "0.0.0.0:7401",
            "10.0.2.5:7402",
            "[fd00::1]:7401",
        ]));
        assert_eq!(
            shown(&got),
            [
                ("0.0.0.0:7401".into(), vec![0, 1]),
                ("10.0.2.5:7402".into(), vec![2]),
                ("[fd00::1]:7401".into(), vec![3]),
            ]
        );
    }

    #[test]
    fn a_v6_wildcard_serves_the_ipv4_lanes_on_its_port_too() {
        // `[::]` is dual-stack: beside it, 10.0.1.5:7401 and 0.0.0.0:7401 got listeners of
        // their own, and binding them failed with EADDRINUSE.
        let got = group(&lanes(&[
            "10.0.1.5:7401",
            "[::]:7401",
            "0.0.0.0:7401",
            "[fd00::1]:7401",
            "10.0.2.5:7402",
        ]));
        assert_eq!(
            shown(&got),
            [
                ("[::]:7401".into(), vec![0, 1, 2, 3]),
                ("10.0.2.5:7402".into(), vec![4]),
            ]
        );
        // An IPv4 wildcard does not hold IPv6 addresses.
        let got = group(&lanes(&["0.0.0.0:7401", "[fd00::1]:7401"]));
        assert_eq!(
            shown(&got),
            [
                ("0.0.0.0:7401".into(), vec![0]),
                ("[fd00::1]:7401".into(), vec![1]),
            ]
        );
    }

    #[test]
    fn port_zero_is_a_listener_per_lane() {
        let got = group(&lanes(&["127.0.0.1:0", "127.0.0.2:0", "127.0.0.1:0"]));
        assert_eq!(
            shown(&got),
            [
                ("127.0.0.1:0".into(), vec![0]),
                ("127.0.0.2:0".into(), vec![1]),
                ("127.0.0.1:0".into(), vec![2]),
            ]
        );
    }
}
