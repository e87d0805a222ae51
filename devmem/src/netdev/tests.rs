//! Tests of the netdev client against the real kernel (root: CAP_NET_ADMIN for bind-rx and
//! `ip netns`), plus unit tests of the extack attribute lookup.
//!
//! Every pre-device `bind-rx` error of reference devmem.md §4.3 is produced here: no devmem
//! NIC or dma-buf exporter is needed, because the kernel checks attributes and the device
//! before it looks at the fd (-1 here).

use super::*;
use crate::testutil::Netns;

/// CAP_NET_ADMIN (include/uapi/linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;
/// An ifindex no test machine has.
const NO_SUCH_IFINDEX: u32 = 0x7fff_fff0;

fn client() -> NetdevClient {
    NetdevClient::open().expect("open the netdev genl family (needs Linux 6.12+)")
}

fn rejection(r: Result<impl fmt::Debug, NetdevError>) -> Rejection {
    match r {
        Err(NetdevError::Rejected(r)) => *r,
        other => panic!("expected a kernel rejection, got {other:?}"),
    }
}

fn bind_rx_err(req: &BindRequest) -> Rejection {
    let r = rejection(client().bind_rx_request(req));
    eprintln!("bind-rx({req}) -> {r}");
    r
}

#[test]
fn family_resolves_with_admin_gated_bind_rx() {
    let c = client();
    eprintln!(
        "netdev family id {} version {}",
        c.family_id(),
        c.family_version()
    );
    assert_ne!(c.family_id(), 0);
    assert_eq!(c.family_version(), 1);
    let rx = c.op_flags(NETDEV_CMD_BIND_RX).expect("bind-rx op (6.12+)");
    assert_ne!(rx & GENL_ADMIN_PERM, 0, "bind-rx flags {rx:#x}");
    for cmd in [
        NETDEV_CMD_DEV_GET,
        NETDEV_CMD_QUEUE_GET,
        NETDEV_CMD_NAPI_GET,
        NETDEV_CMD_PAGE_POOL_GET,
    ] {
        let f = c.op_flags(cmd).unwrap_or_else(|| panic!("op {cmd}"));
        assert_eq!(f & GENL_ADMIN_PERM, 0, "op {cmd} flags {f:#x}");
    }
    eprintln!("bind-tx flags: {:?}", c.op_flags(NETDEV_CMD_BIND_TX));
}

#[test]
fn dev_and_queue_dumps_on_lo() {
    let mut c = client();
    let devs = c.dev_get_dump().unwrap();
    assert!(devs.iter().any(|d| d.ifindex == 1), "{devs:?}");
    let queues = c.queue_get_dump(1).unwrap();
    eprintln!("lo queues: {queues:?}");
    for kind in [QueueType::Rx, QueueType::Tx] {
        let q = queues
            .iter()
            .find(|q| q.id == 0 && q.kind == kind)
            .unwrap_or_else(|| panic!("lo {kind:?} queue 0 in {queues:?}"));
        assert_eq!(q.ifindex, 1);
        assert_eq!(q.dmabuf, None);
        assert!(!q.io_uring && !q.xsk);
    }
}

#[test]
fn napi_and_page_pool_dumps_parse() {
    let mut c = client();
    for d in c.dev_get_dump().unwrap() {
        let napis = c.napi_get_dump(d.ifindex).unwrap();
        assert!(napis.iter().all(|n| n.ifindex == d.ifindex), "{napis:?}");
        eprintln!("ifindex {}: {} napi(s)", d.ifindex, napis.len());
    }
    let pools = c.page_pool_get_dump().unwrap();
    eprintln!("page pools: {pools:?}");
    assert!(pools.iter().all(|p| p.dmabuf.is_none()));
}

#[test]
fn queue_dump_of_unknown_ifindex_is_enodev() {
    let r = rejection(client().queue_get_dump(NO_SUCH_IFINDEX));
    eprintln!("{r}");
    assert_eq!(r.errno, libc::ENODEV);
    assert_eq!(r.request.ifindex, Some(NO_SUCH_IFINDEX));
}

#[test]
fn veth_in_a_fresh_netns() {
    let ns = Netns::new();
    ns.ip(&["link", "add", "va", "type", "veth", "peer", "name", "vb"]);
    ns.ip(&["link", "set", "va", "up"]);
    ns.ip(&["link", "set", "vb", "up"]);
    let va = ns.ifindex("va");

    let mut c = NetdevClient::open_in_netns(&ns.path()).unwrap();
    let devs = c.dev_get_dump().unwrap();
    // Only the namespace's own devices: lo, va, vb.
    assert_eq!(devs.len(), 3, "{devs:?}");
    assert!(devs.iter().any(|d| d.ifindex == va));
    let queues = c.queue_get_dump(va).unwrap();
    eprintln!("veth queues: {queues:?}");
    assert!(queues.iter().any(|q| q.id == 0 && q.kind == QueueType::Rx));
    assert!(queues.iter().any(|q| q.id == 0 && q.kind == QueueType::Tx));
    assert!(queues.iter().all(|q| q.ifindex == va && q.dmabuf.is_none()));

    // veth has no queue management ops.
    let r = rejection(c.bind_rx(va, -1, &[0]));
    eprintln!("veth: {r}");
    assert_eq!(r.errno, libc::EOPNOTSUPP);
    assert_eq!(r.bad_attr, Some(NetdevAttr::Ifindex));
    assert_eq!(r.request.ifindex, Some(va));
    assert!(r.reason().contains("no queue management ops"));

    // The namespace's lo is down: its queues are not listed, and it still cannot bind.
    let mut c = NetdevClient::open_in_netns(&ns.path()).unwrap();
    assert_eq!(c.queue_get_dump(1).unwrap(), vec![]);
    let r = rejection(c.bind_rx(1, -1, &[0]));
    assert_eq!(r.errno, libc::EOPNOTSUPP);
}

#[test]
fn bind_rx_missing_ifindex() {
    let r = bind_rx_err(&BindRequest {
        ifindex: None,
        fd: Some(-1),
        queues: vec![QueueSel { id: 0, kind: 0 }],
    });
    assert_eq!(r.errno, libc::EINVAL);
    assert_eq!(r.missing_attr, Some(NetdevAttr::Ifindex));
    assert!(r.reason().contains("required attribute ifindex is missing"));
}

#[test]
fn bind_rx_missing_fd() {
    let r = bind_rx_err(&BindRequest {
        ifindex: Some(1),
        fd: None,
        queues: vec![QueueSel { id: 0, kind: 0 }],
    });
    assert_eq!(r.errno, libc::EINVAL);
    assert_eq!(r.missing_attr, Some(NetdevAttr::Fd));
}

#[test]
fn bind_rx_empty_queue_list_counts_as_missing() {
    let r = bind_rx_err(&BindRequest::rx(1, -1, &[]));
    assert_eq!(r.errno, libc::EINVAL);
    assert_eq!(r.missing_attr, Some(NetdevAttr::Queues));
    assert!(r.to_string().contains("missing attribute queues"), "{r}");
}

#[test]
fn bind_rx_ifindex_zero_is_erange() {
    let r = bind_rx_err(&BindRequest::rx(0, -1, &[0]));
    assert_eq!(r.errno, libc::ERANGE);
    assert_eq!(r.bad_attr, Some(NetdevAttr::Ifindex));
    assert!(r.reason().contains("at least 1"), "{}", r.reason());
}

#[test]
fn bind_rx_queue_type_above_one_is_erange() {
    let r = bind_rx_err(&BindRequest {
        ifindex: Some(1),
        fd: Some(-1),
        queues: vec![QueueSel { id: 0, kind: 2 }],
    });
    assert_eq!(r.errno, libc::ERANGE);
    assert_eq!(r.bad_attr, Some(NetdevAttr::QueueType));
    assert_eq!(r.request.queues, vec![QueueSel { id: 0, kind: 2 }]);
}

#[test]
fn bind_rx_unknown_ifindex_is_enodev() {
    let r = bind_rx_err(&BindRequest::rx(NO_SUCH_IFINDEX, -1, &[0, 1]));
    assert_eq!(r.errno, libc::ENODEV);
    assert!(r.reason().contains(&NO_SUCH_IFINDEX.to_string()));
    assert!(r.to_string().contains("queues [rx 0, rx 1]"), "{r}");
}

#[test]
fn bind_rx_on_lo_is_eopnotsupp() {
    let r = bind_rx_err(&BindRequest::rx(1, -1, &[0]));
    assert_eq!(r.errno, libc::EOPNOTSUPP);
    assert_eq!(r.bad_attr, Some(NetdevAttr::Ifindex));
    assert_eq!(r.message, None);
    assert_eq!(
        r.reason(),
        "the driver has no queue management ops (devmem needs gve, bnxt, mlx5, fbnic or idpf)"
    );
    // The top-level helper opens its own socket.
    let e = super::bind_rx(1, -1, &[0]).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EOPNOTSUPP));
}

#[test]
fn bind_tx_on_lo_is_eopnotsupp() {
    let r = rejection(client().bind_tx(1, -1));
    eprintln!("{r}");
    assert_eq!(r.errno, libc::EOPNOTSUPP);
    assert!(r.reason().contains("netmem TX"), "{}", r.reason());
}

/// Runs `f` on a thread whose CAP_NET_ADMIN was dropped (raw capset: that thread only).
fn without_net_admin<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            crate::sys::drop_thread_capability(CAP_NET_ADMIN).expect("capset");
            f()
        })
        .join()
        .unwrap()
    })
}

#[test]
fn bind_rx_without_cap_net_admin_is_eperm() {
    let r = without_net_admin(|| rejection(client().bind_rx(1, -1, &[0])));
    eprintln!("{r}");
    assert_eq!(r.errno, libc::EPERM);
    assert!(r.reason().contains("CAP_NET_ADMIN"));
    // Unprivileged dumps still work.
    let devs = without_net_admin(|| client().dev_get_dump());
    assert!(devs.unwrap().iter().any(|d| d.ifindex == 1));
}

#[test]
fn bind_tx_is_not_admin_gated() {
    let r = without_net_admin(|| rejection(client().bind_tx(1, -1)));
    eprintln!("unprivileged bind-tx: {r}");
    assert_ne!(r.errno, libc::EPERM);
}

/// The generated bindings put the right command ids in the genl header (their ethtool
/// module does not, see probe.rs), and the bind-rx encoding is the one of reference §3.2.
#[test]
fn generated_requests_carry_the_netdev_command_ids() {
    let cmd = |payload: &[u8]| u32::from(payload[0]);
    assert_eq!(
        cmd(netdev::Request::new().op_dev_get_dump().payload()),
        NETDEV_CMD_DEV_GET
    );
    assert_eq!(
        cmd(netdev::Request::new().op_queue_get_dump().payload()),
        NETDEV_CMD_QUEUE_GET
    );
    assert_eq!(
        cmd(netdev::Request::new().op_napi_get_dump().payload()),
        NETDEV_CMD_NAPI_GET
    );
    assert_eq!(
        cmd(netdev::Request::new().op_page_pool_get_dump().payload()),
        NETDEV_CMD_PAGE_POOL_GET
    );
    assert_eq!(
        cmd(netdev::Request::new().op_bind_tx_do().payload()),
        NETDEV_CMD_BIND_TX
    );
    let mut req = netdev::Request::new().op_bind_rx_do();
    req.encode()
        .push_ifindex(1)
        .push_fd(7)
        .nested_queues()
        .push_id(3)
        .push_type(QUEUE_TYPE_RX)
        .end_nested();
    let mut expect = vec![NETDEV_CMD_BIND_RX as u8, 1, 0, 0];
    attr(&mut expect, 1, &1u32.to_ne_bytes());
    attr(&mut expect, 3, &7u32.to_ne_bytes());
    let mut nest = Vec::new();
    attr(&mut nest, 1, &3u32.to_ne_bytes());
    attr(&mut nest, 3, &0u32.to_ne_bytes());
    attr(&mut expect, 2 | NLA_F_NESTED, &nest);
    assert_eq!(req.payload(), &expect[..]);
}

fn attr(buf: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    buf.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(payload);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

#[test]
fn extack_offsets_are_located_in_nests() {
    // genl header, ifindex, fd, queues{id, type}
    let mut req = vec![13, 1, 0, 0];
    attr(&mut req, 1, &1u32.to_ne_bytes()); // at 4
    attr(&mut req, 3, &7u32.to_ne_bytes()); // at 12
    let mut nest = Vec::new();
    attr(&mut nest, 1, &0u32.to_ne_bytes()); // at 24
    attr(&mut nest, 3, &2u32.to_ne_bytes()); // at 32
    attr(&mut req, 2 | NLA_F_NESTED, &nest); // at 20
    let at = |o: usize| locate_attr(&req, o + NLMSGHDR_LEN);
    assert_eq!(at(4), Some((None, 1)));
    assert_eq!(at(12), Some((None, 3)));
    assert_eq!(at(20), Some((None, 2)));
    assert_eq!(at(24), Some((Some(2), 1)));
    assert_eq!(at(32), Some((Some(2), 3)));
    assert_eq!(at(6), None, "not the start of an attribute");
    assert_eq!(at(100), None);
    assert_eq!(locate_attr(&req, 3), None);
    assert_eq!(
        NetdevAttr::name(NetdevOp::BindRx, Some(2), 3),
        NetdevAttr::QueueType
    );
    // Garbage never panics.
    for len in 0..req.len() {
        for o in 0..64 {
            let _ = locate_attr(&req[..len], o);
        }
    }
}

#[test]
fn a_page_pool_id_of_a_bad_length_is_an_error_not_pool_zero() {
    // Before, an id attribute of any length but 4 or 8 was taken as present, with id 0.
    let pool = |id: &[u8]| {
        let mut a = Vec::new();
        attr(&mut a, 1, id);
        attr(&mut a, 2, &3u32.to_ne_bytes());
        attr(&mut a, 8, &[]);
        page_pool_info(&a)
    };
    let p = pool(&7u32.to_ne_bytes()).unwrap();
    assert_eq!((p.id, p.ifindex, p.io_uring), (7, Some(3), true));
    assert_eq!(pool(&(1u64 << 40).to_ne_bytes()).unwrap().id, 1 << 40);
    for bad in [&[1u8, 0][..], &[1, 0, 0, 0, 0, 0][..]] {
        let e = pool(bad).unwrap_err();
        assert!(
            e.contains(&format!("id attribute of {} bytes", bad.len())),
            "{e}"
        );
    }
    let mut no_id = Vec::new();
    attr(&mut no_id, 2, &3u32.to_ne_bytes());
    assert_eq!(page_pool_info(&no_id).unwrap_err(), "page pool without id");
}
