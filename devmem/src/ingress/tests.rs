//! The probe against the real kernel (root): a veth pair between two fresh network
//! namespaces, NAPI on the receiving end (GRO on, and the sending end's TSO off: a veth takes
//! TSO frames past its NAPI), loopback for the case without an id.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::Command;

use super::*;
use crate::testutil::Netns;

/// `ethtool -K DEV FEATURE on|off` inside `ns`.
fn ethtool(ns: &Netns, dev: &str, feature: &str, on: bool) {
    let ns_name = ns.path();
    let ns_name = ns_name.file_name().unwrap().to_str().unwrap();
    let state = if on { "on" } else { "off" };
    let out = Command::new("ip")
        .args([
            "netns", "exec", ns_name, "ethtool", "-K", dev, feature, state,
        ])
        .output()
        .expect("ip netns exec ethtool (needs iproute2 and ethtool: scripts/test installs both)");
    assert!(
        out.status.success(),
        "ethtool -K {dev} {feature} {state}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A connection from `client` (in its namespace) to a listener at 10.97.0.1 in `server`'s;
/// returns the accepted end, after a few bytes went across.
fn connect(server: &Netns, client: &Netns) -> TcpStream {
    let at = SocketAddr::from((Ipv4Addr::new(10, 97, 0, 1), 0));
    let listener = crate::sys::in_netns(&server.path(), || TcpListener::bind(at))
        .unwrap()
        .unwrap();
    let to = listener.local_addr().unwrap();
    let mut dialled = crate::sys::in_netns(&client.path(), || TcpStream::connect(to))
        .unwrap()
        .unwrap();
    let (mut accepted, _) = listener.accept().unwrap();
    dialled.write_all(&[7; 64 * 1024]).unwrap();
    let mut got = vec![0; 64 * 1024];
    accepted.read_exact(&mut got).unwrap();
    accepted
}

#[test]
fn a_veth_with_napi_is_named_and_one_without_or_loopback_gives_no_id() {
    let (server, client) = (Netns::new(), Netns::new());
    let (sname, cname) = (server.path(), client.path());
    let (sname, cname) = (
        sname.file_name().unwrap().to_str().unwrap(),
        cname.file_name().unwrap().to_str().unwrap(),
    );
    server.ip(&[
        "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", cname,
    ]);
    server.ip(&["addr", "add", "10.97.0.1/24", "dev", "va"]);
    server.ip(&["link", "set", "va", "up"]);
    client.ip(&["addr", "add", "10.97.0.2/24", "dev", "vb"]);
    client.ip(&["link", "set", "vb", "up"]);
    let va = server.ifindex("va");
    let mut probe = IngressProbe::with_client(NetdevClient::open_in_netns(&server.path()).unwrap());

    // A veth receives through its NAPI only with GRO on: by default there is no id.
    let plain = connect(&server, &client);
    assert_eq!(probe.ingress(plain.as_fd()).unwrap(), Ingress::NoNapiId);

    ethtool(&server, "va", "gro", true);
    ethtool(&client, "vb", "tso", false);
    let napi = connect(&server, &client);
    assert_eq!(
        probe.ingress(napi.as_fd()).unwrap(),
        Ingress::Nic(va),
        "{sname}"
    );
    // Asked again: the same answer, from what the probe remembers.
    assert_eq!(probe.known.len(), 1);
    assert_eq!(probe.ingress(napi.as_fd()).unwrap(), Ingress::Nic(va));

    // The kernel forgets an instance whose device went: napi-get answers None, not an error.
    let id = crate::sys::incoming_napi_id(napi.as_fd()).unwrap();
    assert_ne!(id, 0);
    server.ip(&["link", "del", "va"]);
    let mut fresh = NetdevClient::open_in_netns(&server.path()).unwrap();
    assert_eq!(fresh.napi_get(id).unwrap(), None);
}

#[test]
fn loopback_connections_carry_no_napi_id() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let _dialled = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (accepted, _) = listener.accept().unwrap();
    // No netdev socket is opened for a socket without an id.
    let mut probe = IngressProbe::new();
    assert_eq!(probe.ingress(accepted.as_fd()).unwrap(), Ingress::NoNapiId);
    assert!(probe.client.is_none());
}
