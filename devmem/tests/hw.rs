//! Hardware checks: a host with a devmem-capable NIC (gve, bnxt, mlx5, fbnic, idpf), root,
//! and `/dev/udmabuf`. Ignored everywhere else; `scripts/hw/devmem-check.sh` runs them.
//! They follow the kernel selftest's sequence (tools/testing/selftests/drivers/net/hw/
//! devmem.py, ncdevmem.c): an empty queue list fails; header split off fails; the bind
//! succeeds and shows on the queue; shrinking channels under a bound queue fails; closing
//! the netlink socket unbinds; a validated pattern crosses the wire into the dma-buf.
//!
//! Environment: `SHARDWIRE_HW_IFNAME` (required), `SHARDWIRE_HW_QUEUE` (default: the last RX
//! queue), `SHARDWIRE_HW_PORT` (pattern test; the script starts the peer's sender),
//! `SHARDWIRE_HW_BYTES` (pattern length, default 64 MiB).

use std::net::TcpListener;
use std::os::fd::AsRawFd;

use shardwire_devmem::gather::gather;
use shardwire_devmem::mem::DmabufMem;
use shardwire_devmem::netdev::QueueType;
use shardwire_devmem::nic::{
    self, Change, EthtoolClient, Journal, SetupPlan, TCP_DATA_SPLIT_DISABLED,
};
use shardwire_devmem::{DevmemSocket, NetdevClient, NetdevError, TokenBatcher};

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

struct Nic {
    name: String,
    ifindex: u32,
    queue: u32,
}

fn nic() -> Nic {
    let name = env("SHARDWIRE_HW_IFNAME").expect("set SHARDWIRE_HW_IFNAME to the devmem NIC");
    let ifindex: u32 = std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .expect("interface exists")
        .trim()
        .parse()
        .expect("ifindex");
    let rx = std::fs::read_dir(format!("/sys/class/net/{name}/queues"))
        .expect("queues")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
        .count() as u32;
    let queue = env("SHARDWIRE_HW_QUEUE").map_or(rx - 1, |q| q.parse().expect("queue id"));
    Nic {
        name,
        ifindex,
        queue,
    }
}

fn errno(e: &NetdevError) -> i32 {
    match e {
        NetdevError::Rejected(r) => r.errno,
        other => panic!("expected a kernel rejection, got {other}"),
    }
}

fn state_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("sw-hw-{}.json", std::process::id()))
}

#[test]
#[ignore = "needs a devmem-capable NIC, root and /dev/udmabuf (scripts/hw/devmem-check.sh)"]
fn hw_bind_sequence_follows_the_kernel_selftest() {
    let n = nic();
    let mem = DmabufMem::udmabuf(64 << 20).expect("udmabuf");
    let mut eth = EthtoolClient::open().unwrap();
    let rings0 = eth.rings(n.ifindex, &n.name).unwrap();
    let ch0 = eth.channels(n.ifindex, &n.name).unwrap();

    // 1. An empty queue list is refused.
    let e = NetdevClient::open()
        .unwrap()
        .bind_rx(n.ifindex, mem.fd().as_raw_fd(), &[])
        .unwrap_err();
    assert_eq!(errno(&e), libc::EINVAL, "{e}");

    // 2. Header split off: refused ("tcp-data-split is disabled").
    let state = state_path();
    let mut j = Journal::create(&state, &n.name, n.ifindex, None).unwrap();
    j.record(Change::Rings {
        tcp_data_split: rings0.tcp_data_split,
        hds_thresh: rings0.hds_thresh,
    })
    .unwrap();
    eth.set_rings(n.ifindex, &n.name, TCP_DATA_SPLIT_DISABLED, None)
        .unwrap();
    let e = NetdevClient::open()
        .unwrap()
        .bind_rx(n.ifindex, mem.fd().as_raw_fd(), &[n.queue])
        .unwrap_err();
    assert_eq!(errno(&e), libc::EINVAL, "{e}");
    j.restore(&mut eth).unwrap();

    // 3. Set up and bind: the queue reports the binding.
    let plan = SetupPlan {
        ifname: n.name.clone(),
        ifindex: n.ifindex,
        queues: vec![n.queue],
        netns: None,
        steer: Vec::new(),
    };
    let setup = nic::apply(&plan, &state).unwrap();
    let binding = NetdevClient::open()
        .unwrap()
        .bind_rx(n.ifindex, mem.fd().as_raw_fd(), &[n.queue])
        .unwrap();
    let bound = |c: &mut NetdevClient| {
        c.queue_get_dump(n.ifindex)
            .unwrap()
            .into_iter()
            .find(|q| q.id == n.queue && q.kind == QueueType::Rx)
            .and_then(|q| q.dmabuf)
    };
    let mut probe = NetdevClient::open().unwrap();
    assert_eq!(bound(&mut probe), Some(binding.id()));

    // 4. Shrinking channels under the bound queue is refused.
    let ch = eth.channels(n.ifindex, &n.name).unwrap();
    let (rx, combined) = if ch.combined_max > 0 {
        (ch.rx, n.queue)
    } else {
        (n.queue, ch.combined)
    };
    assert!(
        eth.set_channels(n.ifindex, &n.name, rx, ch.tx, combined)
            .is_err()
    );

    // 5. Closing the netlink socket unbinds.
    drop(binding);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(bound(&mut probe), None);
    setup.restore().unwrap();
    assert_eq!(eth.channels(n.ifindex, &n.name).unwrap(), ch0);
    assert_eq!(eth.rings(n.ifindex, &n.name).unwrap(), rings0);
}

#[test]
#[ignore = "needs a devmem-capable NIC, a peer sending the pattern, root and /dev/udmabuf (scripts/hw/devmem-check.sh)"]
fn hw_validated_pattern_lands_in_the_dmabuf() {
    let n = nic();
    let port: u16 = env("SHARDWIRE_HW_PORT")
        .expect("SHARDWIRE_HW_PORT")
        .parse()
        .unwrap();
    let total: usize = env("SHARDWIRE_HW_BYTES").map_or(64 << 20, |b| b.parse().unwrap());
    let mem = DmabufMem::udmabuf(64 << 20).expect("udmabuf");
    let plan = SetupPlan {
        ifname: n.name.clone(),
        ifindex: n.ifindex,
        queues: vec![n.queue],
        netns: None,
        steer: vec![(port, n.queue)],
    };
    let setup = nic::apply(&plan, &state_path()).unwrap();
    let binding = NetdevClient::open()
        .unwrap()
        .bind_rx(n.ifindex, mem.fd().as_raw_fd(), &[n.queue])
        .unwrap();
    let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
    eprintln!("listening on port {port}; the peer sends {total} bytes of (i % 251)");
    let (sock, peer) = listener.accept().unwrap();
    eprintln!("peer {peer}");
    let mut s = DevmemSocket::new(sock);
    let mut tokens = TokenBatcher::new();
    let mut buf = vec![0u8; 1 << 20];
    let (mut got, mut frags) = (0usize, 0usize);
    while got < total {
        let want = buf.len().min(total - got);
        let batch = s.recv_frags(&mut buf[..want]).unwrap();
        assert!(!batch.is_eof(), "peer closed after {got} of {total} bytes");
        batch
            .check_devmem_only()
            .unwrap_or_else(|e| panic!("after {got} bytes: {e}"));
        let g = gather(&batch, &mut buf[..want], &mem, binding.id(), &mut tokens).unwrap();
        frags += g.dmabuf_frags;
        for (k, b) in buf[..g.bytes].iter().enumerate() {
            assert_eq!(*b as usize, (got + k) % 251, "byte {}", got + k);
        }
        got += g.bytes;
        let pending = tokens.pending_frags();
        assert_eq!(s.return_tokens(&mut tokens).unwrap(), pending);
    }
    eprintln!("{got} bytes in {frags} frags, validated");
    drop(binding);
    setup.restore().unwrap();
}
