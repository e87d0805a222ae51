use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::cmsg::Frag;
use crate::gather::{GatherPlan, gather, plan};

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

/// A connected loopback pair; `payload` is written from a thread, then the writer closes.
fn pair(payload: Vec<u8>) -> (TcpStream, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let w = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&payload).unwrap();
    });
    let (s, _) = l.accept().unwrap();
    (s, w)
}

/// Applies a [`GatherPlan`] the way the GPU gather does (copies from the untouched iov and
/// the dma-buf into a separate destination), on the CPU.
fn apply_plan(p: &GatherPlan, iov: &[u8], mem: &crate::mem::DmabufMem) -> Vec<u8> {
    let mut dst = vec![0u8; p.bytes];
    if p.plain {
        dst.copy_from_slice(&iov[..p.bytes]);
    }
    for &(from, to, len) in &p.linear {
        dst[to..to + len].copy_from_slice(&iov[from..from + len]);
    }
    mem.begin_cpu_read().unwrap();
    for &(offset, to, len) in &p.dmabuf {
        #[allow(unsafe_code)] // copy_out of a frag whose token is held (SAFETY below)
        // SAFETY: the plan's frags are those of the batch just received into `mem` (its
        // binding's memory), whose tokens the caller returns only after this: the emulator
        // writes none of their pages meanwhile.
        let copied = unsafe { mem.copy_out(offset, &mut dst[to..to + len]) };
        copied.unwrap();
    }
    mem.end_cpu_read().unwrap();
    dst
}

/// Receive everything through recv_frags + gather + token return, as the service does; each
/// batch is also planned ([`plan`]) and the plan applied as the GPU gather would, and both
/// must agree.
fn drain(sock: &mut EmuSocket, total: usize, chunk: usize) -> (Vec<u8>, crate::gather::Gathered) {
    let mut out = vec![0u8; total];
    let mut sum = crate::gather::Gathered::default();
    let mut off = 0;
    let mut tokens = TokenBatcher::new();
    let id = sock.binding().id();
    let binding = Arc::clone(sock.binding());
    while off < total {
        let end = (off + chunk).min(total);
        let batch = sock.recv_frags(&mut out[off..end]).unwrap();
        assert!(!batch.is_eof(), "EOF after {off} of {total}");
        let iov = out[off..end].to_vec();
        let mut p = GatherPlan::default();
        plan(&batch, id, end - off, &mut p).unwrap();
        let g = gather(&batch, &mut out[off..end], binding.mem(), id, &mut tokens).unwrap();
        assert_eq!(apply_plan(&p, &iov, binding.mem()), out[off..off + g.bytes]);
        assert_eq!(
            (p.bytes, p.dmabuf.len(), p.dmabuf_bytes(), p.linear_bytes()),
            (g.bytes, g.dmabuf_frags, g.dmabuf_bytes, g.linear_bytes)
        );
        off += g.bytes;
        sum.bytes += g.bytes;
        sum.dmabuf_frags += g.dmabuf_frags;
        sum.dmabuf_bytes += g.dmabuf_bytes;
        sum.linear_bytes += g.linear_bytes;
        let n = tokens.pending_frags();
        assert_eq!(sock.return_tokens(&mut tokens).unwrap(), n);
    }
    (out, sum)
}

#[test]
fn tcp_bytes_round_trip_through_frags_tokens_and_gather() {
    let data = pattern(3 * 1024 * 1024 + 123, 7);
    let (s, w) = pair(data.clone());
    let b = EmuBinding::new(9, 64 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let (got, sum) = drain(&mut sock, data.len(), 256 * 1024);
    w.join().unwrap();
    assert!(got == data, "bytes differ");
    assert_eq!(sum.dmabuf_bytes, data.len() as u64);
    assert_eq!(sum.linear_bytes, 0);
    assert!(sum.dmabuf_frags >= data.len() / NIOV_SIZE);
    assert_eq!(sock.outstanding_tokens(), 0);
    drop(sock);
    assert_eq!(
        b.free_niovs(),
        b.num_niovs(),
        "every net_iov back on the freelist"
    );
    // Far more pages went through than the pool holds: the freelist recycled them.
    assert!(data.len() / NIOV_SIZE > b.num_niovs());
}

#[test]
fn frags_are_kernel_format_with_tokens_from_one_and_reused_lowest_first() {
    let (s, w) = pair(pattern(6 * NIOV_SIZE, 1));
    w.join().unwrap();
    let b = EmuBinding::new(3, 32 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 3 * NIOV_SIZE];
    let frags: Vec<Frag> = sock.recv_frags(&mut buf).unwrap().frags().collect();
    let tokens: Vec<u32> = frags
        .iter()
        .map(|f| match *f {
            Frag::Dmabuf {
                token,
                dmabuf_id,
                size,
                offset,
            } => {
                assert_eq!(dmabuf_id, 3);
                assert_eq!(size as usize, NIOV_SIZE);
                assert_eq!(offset % NIOV_SIZE as u64, 0);
                token
            }
            Frag::Linear { .. } => panic!("no linear frags configured"),
        })
        .collect();
    assert_eq!(tokens, [1, 2, 3]);
    // Return token 2 only: the next frag reuses 2, then continues at 4.
    let two = libc::dmabuf_token {
        token_start: 2,
        token_count: 1,
    };
    assert_eq!(sock.dontneed(&[two]).unwrap(), 1);
    let mut buf = vec![0u8; 2 * NIOV_SIZE];
    let next: Vec<u32> = sock
        .recv_frags(&mut buf)
        .unwrap()
        .frags()
        .filter_map(|f| match f {
            Frag::Dmabuf { token, .. } => Some(token),
            Frag::Linear { .. } => None,
        })
        .collect();
    assert_eq!(next, [2, 4]);
    // Non-consecutive tokens stay separate ranges in the batcher.
    let mut tb = TokenBatcher::new();
    for t in [1, 3, 2, 4] {
        tb.push(t);
    }
    assert_eq!(
        tb.pending_ranges().collect::<Vec<_>>(),
        [(1, 1), (3, 1), (2, 1), (4, 1)]
    );
    assert_eq!(sock.return_tokens(&mut tb).unwrap(), 4);
    assert_eq!(sock.outstanding_tokens(), 0);
}

#[test]
fn dontneed_has_the_kernels_checks_and_return_values() {
    let (s, w) = pair(pattern(40 * 1024, 2));
    w.join().unwrap();
    // Room for 2048 held tokens: each 16-byte frag holds a whole net_iov.
    let b = EmuBinding::new(1, 4096 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(
        s,
        b,
        EmuConfig {
            frag_max: 16,
            linear_every: 0,
        },
    )
    .unwrap();
    let einval = |r: io::Result<usize>| r.unwrap_err().raw_os_error() == Some(libc::EINVAL);
    assert!(einval(sock.dontneed(&[])), "optlen 0");
    let t = libc::dmabuf_token {
        token_start: 1,
        token_count: 1,
    };
    assert!(
        einval(sock.dontneed(&[t; MAX_DONTNEED_TOKENS + 1])),
        "129 ranges"
    );
    assert_eq!(
        sock.dontneed(&[t]).unwrap(),
        0,
        "unknown token frees nothing"
    );
    // 2048 frags of 16 bytes arrive (the emulated MSS is 16), 2048 tokens outstanding.
    let mut buf = vec![0u8; 32 * 1024];
    let mut got = 0;
    while got < buf.len() {
        got += sock.recv_frags(&mut buf[got..]).unwrap().bytes();
    }
    assert_eq!(sock.outstanding_tokens(), 2048);
    let all = libc::dmabuf_token {
        token_start: 1,
        token_count: 2048,
    };
    assert_eq!(
        sock.dontneed(&[all]).unwrap(),
        1024,
        "at most 1024 frags per call"
    );
    // Unknown tokens count toward the 1024 too: the same range again frees nothing.
    assert_eq!(
        sock.dontneed(&[all]).unwrap(),
        0,
        "1..=1024 are gone and use up the limit"
    );
    let rest = libc::dmabuf_token {
        token_start: 1025,
        token_count: 1024,
    };
    assert_eq!(sock.dontneed(&[rest]).unwrap(), 1024);
    assert_eq!(sock.outstanding_tokens(), 0);
}

#[test]
fn control_buffer_limits_frags_per_call_and_etoosmall_when_none_fits() {
    let (s, w) = pair(pattern(8 * NIOV_SIZE, 3));
    w.join().unwrap();
    let b = EmuBinding::new(1, 32 * NIOV_SIZE).unwrap();
    let mut tiny = EmuSocket::with_control_len(
        s.try_clone().unwrap(),
        Arc::clone(&b),
        EmuConfig::default(),
        39,
    )
    .unwrap();
    let mut buf = vec![0u8; 8 * NIOV_SIZE];
    let e = tiny.recv_frags(&mut buf).unwrap_err();
    assert_eq!(e.errno(), Some(crate::socket::ETOOSMALL), "{e}");
    drop(tiny);
    let mut three = EmuSocket::with_control_len(s, b, EmuConfig::default(), 3 * 40).unwrap();
    let batch = three.recv_frags(&mut buf).unwrap();
    assert_eq!(
        batch.summary().dmabuf_frags,
        3,
        "short count when the buffer is full"
    );
    assert_eq!(batch.bytes(), 3 * NIOV_SIZE);
}

#[test]
fn a_frag_cut_by_the_request_length_continues_with_a_new_token() {
    let data = pattern(NIOV_SIZE, 4);
    let (s, w) = pair(data.clone());
    w.join().unwrap();
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 1000];
    let f1: Vec<Frag> = sock.recv_frags(&mut buf).unwrap().frags().collect();
    let mut buf2 = vec![0u8; 5000];
    let f2: Vec<Frag> = sock.recv_frags(&mut buf2).unwrap().frags().collect();
    let (
        Frag::Dmabuf {
            offset: o1,
            size: 1000,
            token: 1,
            ..
        },
        Frag::Dmabuf {
            offset: o2,
            size: 3096,
            token: 2,
            ..
        },
    ) = (f1[0], f2[0])
    else {
        panic!("unexpected frags {f1:?} {f2:?}");
    };
    assert_eq!(o2, o1 + 1000);
    // The page is held by both tokens; it is free again only after both come back.
    let free = b.free_niovs();
    sock.dontneed(&[libc::dmabuf_token {
        token_start: 1,
        token_count: 1,
    }])
    .unwrap();
    assert_eq!(b.free_niovs(), free);
    sock.dontneed(&[libc::dmabuf_token {
        token_start: 2,
        token_count: 1,
    }])
    .unwrap();
    assert_eq!(b.free_niovs(), free + 1);
}

#[test]
fn linear_packets_are_reported_and_gathered_in_stream_order() {
    let data = pattern(200_000, 5);
    let (s, w) = pair(data.clone());
    let b = EmuBinding::new(2, 64 * NIOV_SIZE).unwrap();
    let cfg = EmuConfig {
        frag_max: 1448,
        linear_every: 3,
    };
    let mut sock = EmuSocket::new(s, Arc::clone(&b), cfg).unwrap();
    let mut saw_not_devmem = false;
    {
        let mut probe = vec![0u8; 4 * 1448];
        let batch = sock.recv_frags(&mut probe).unwrap();
        if let Err(e) = batch.check_devmem_only() {
            saw_not_devmem = true;
            assert!(e.to_string().contains("header split"), "{e}");
        }
        let mut tb = TokenBatcher::new();
        let g = gather(&batch, &mut probe, b.mem(), 2, &mut tb).unwrap();
        assert_eq!(&probe[..g.bytes], &data[..g.bytes]);
        let n = g.bytes;
        sock.return_tokens(&mut tb).unwrap();
        let (rest, sum) = drain(&mut sock, data.len() - n, 64 * 1024);
        assert!(rest == data[n..], "bytes differ after linear fix-up");
        assert!(sum.linear_bytes > 0 && sum.dmabuf_bytes > 0);
    }
    w.join().unwrap();
    assert!(saw_not_devmem, "the third packet is linear");
}

#[test]
fn pool_exhaustion_stalls_other_sockets_until_tokens_come_back() {
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let (sa, wa) = pair(pattern(MIN_NIOVS * NIOV_SIZE, 6));
    let data_b = pattern(4 * NIOV_SIZE, 7);
    let (sb, wb) = pair(data_b.clone());
    wa.join().unwrap();
    wb.join().unwrap();
    let mut a = EmuSocket::new(sa, Arc::clone(&b), EmuConfig::default()).unwrap();
    // A takes every net_iov and keeps the tokens (a receiver that does not return them).
    let mut buf = vec![0u8; MIN_NIOVS * NIOV_SIZE];
    let mut got = 0;
    while got < buf.len() {
        got += a.recv_frags(&mut buf[got..]).unwrap().bytes();
    }
    assert_eq!(b.free_niovs(), 0);
    let returned = Arc::new(AtomicBool::new(false));
    let r2 = Arc::clone(&returned);
    let bb = Arc::clone(&b);
    let reader = std::thread::spawn(move || {
        let mut sock = EmuSocket::new(sb, bb, EmuConfig::default()).unwrap();
        let (got, _) = drain(&mut sock, data_b.len(), data_b.len());
        assert!(
            r2.load(Ordering::SeqCst),
            "B received before A returned its tokens"
        );
        assert!(got == data_b);
    });
    // B waits for the pool (however late its thread first runs).
    let t = std::time::Instant::now();
    while b.stats().exhausted_waits.load(Ordering::Relaxed) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "B never waited for the pool"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100)); // and goes on waiting: it must not receive
    returned.store(true, Ordering::SeqCst);
    let all = libc::dmabuf_token {
        token_start: 1,
        token_count: MIN_NIOVS as u32,
    };
    assert_eq!(a.dontneed(&[all]).unwrap(), MIN_NIOVS);
    reader.join().unwrap();
}

#[test]
fn a_read_waiting_for_the_pool_fails_with_eagain_after_the_sockets_receive_timeout() {
    // As the kernel's recvmsg while the NIC drops what it cannot land. Before, the wait
    // ignored SO_RCVTIMEO: a reader waited for as long as another held its tokens.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let (sa, wa) = pair(pattern(MIN_NIOVS * NIOV_SIZE, 6));
    let data_b = pattern(4 * NIOV_SIZE, 7);
    let (sb, wb) = pair(data_b.clone());
    wa.join().unwrap();
    wb.join().unwrap();
    let mut a = EmuSocket::new(sa, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; MIN_NIOVS * NIOV_SIZE];
    let mut got = 0;
    while got < buf.len() {
        got += a.recv_frags(&mut buf[got..]).unwrap().bytes();
    }
    assert_eq!(b.free_niovs(), 0, "A holds every net_iov");
    let timeout = Duration::from_millis(300);
    sb.set_read_timeout(Some(timeout)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let bb = Arc::clone(&b);
    let reader = std::thread::spawn(move || {
        let mut sock = EmuSocket::new(sb, bb, EmuConfig::default()).unwrap();
        let mut buf = vec![0u8; 4 * NIOV_SIZE];
        let t = std::time::Instant::now();
        let first = sock.recv_frags(&mut buf).map(|r| r.bytes());
        tx.send((
            first.map_err(|e| (e.is_would_block(), e.errno())),
            t.elapsed(),
        ))
        .unwrap();
        sock
    });
    let outcome = rx.recv_timeout(Duration::from_secs(30));
    // Free the pool whatever came, so the reader ends either way.
    let all = libc::dmabuf_token {
        token_start: 1,
        token_count: MIN_NIOVS as u32,
    };
    assert_eq!(a.dontneed(&[all]).unwrap(), MIN_NIOVS);
    let (first, waited) = outcome.expect("the read gave up after its SO_RCVTIMEO");
    assert_eq!(first, Err((true, Some(libc::EAGAIN))));
    assert!(waited >= timeout, "waited {waited:?}");
    // Nothing was lost: with the pool free again, the bytes arrive.
    let mut sock = reader.join().unwrap();
    let (got, _) = drain(&mut sock, data_b.len(), data_b.len());
    assert!(got == data_b);
}

#[test]
fn a_read_waiting_for_its_bytes_holds_no_net_iovs() {
    // Before, a fill took up to 64 net_iovs first and then blocked in recv holding them:
    // readers merely waiting for bytes emptied the pool, and a socket whose bytes had
    // arrived waited for it and failed with EAGAIN.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut quiet_peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (quiet, _) = l.accept().unwrap();
    // Bounded, so that the thread ends even where the test fails before the bytes are sent.
    quiet
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let bb = Arc::clone(&b);
    let waiting = std::thread::spawn(move || {
        let mut sock = EmuSocket::new(quiet, bb, EmuConfig::default()).unwrap();
        let mut buf = vec![0u8; MIN_NIOVS * NIOV_SIZE];
        sock.recv_frags(&mut buf).unwrap().bytes()
    });
    std::thread::sleep(Duration::from_millis(300)); // it waits for bytes by now
    assert_eq!(
        b.free_niovs(),
        MIN_NIOVS,
        "a reader with no bytes holds no net_iov"
    );
    let data = pattern(4 * NIOV_SIZE, 9);
    let (s, w) = pair(data.clone());
    w.join().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let (got, _) = drain(&mut sock, data.len(), data.len());
    assert!(got == data, "the socket whose bytes arrived read them");
    quiet_peer.write_all(b"late").unwrap();
    assert_eq!(waiting.join().unwrap(), 4);
}

#[test]
fn a_fill_that_waits_for_the_pool_is_counted_once() {
    // Before, each 100 ms round of the wait, and each wake-up, counted: the metric said
    // how long readers stalled, not how many fills waited (OPERATIONS.md).
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let (sa, wa) = pair(pattern(MIN_NIOVS * NIOV_SIZE, 6));
    let data_b = pattern(4 * NIOV_SIZE, 7);
    let (sb, wb) = pair(data_b.clone());
    wa.join().unwrap();
    wb.join().unwrap();
    let mut a = EmuSocket::new(sa, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; MIN_NIOVS * NIOV_SIZE];
    let mut got = 0;
    while got < buf.len() {
        got += a.recv_frags(&mut buf[got..]).unwrap().bytes();
    }
    assert_eq!(b.free_niovs(), 0, "A holds every net_iov");
    let bb = Arc::clone(&b);
    let reader = std::thread::spawn(move || {
        let mut sock = EmuSocket::new(sb, bb, EmuConfig::default()).unwrap();
        drain(&mut sock, data_b.len(), data_b.len()).0 == data_b
    });
    let waits = || b.stats().exhausted_waits.load(Ordering::Relaxed);
    let t = std::time::Instant::now();
    while waits() == 0 {
        assert!(t.elapsed() < Duration::from_secs(60), "B never waited");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Several rounds of `POOL_POLL` go by before A returns its tokens.
    std::thread::sleep(POOL_POLL * 4);
    let all = libc::dmabuf_token {
        token_start: 1,
        token_count: MIN_NIOVS as u32,
    };
    assert_eq!(a.dontneed(&[all]).unwrap(), MIN_NIOVS);
    assert!(reader.join().unwrap(), "B read its bytes");
    assert_eq!(waits(), 1, "one fill waited");
}

#[test]
fn a_read_waiting_for_the_pool_when_the_binding_is_unbound_gets_its_bytes_as_plain_tcp() {
    // As the kernel: the queues restart with ordinary pages. Before, the waiting read failed
    // ("the emulated binding was unbound") and its payload with it.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let (sa, wa) = pair(pattern(MIN_NIOVS * NIOV_SIZE, 6));
    let data_b = pattern(4 * NIOV_SIZE, 7);
    let (sb, wb) = pair(data_b.clone());
    wa.join().unwrap();
    wb.join().unwrap();
    let mut a = EmuSocket::new(sa, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; MIN_NIOVS * NIOV_SIZE];
    let mut got = 0;
    while got < buf.len() {
        got += a.recv_frags(&mut buf[got..]).unwrap().bytes();
    }
    let bb = Arc::clone(&b);
    let reader = std::thread::spawn(move || {
        let mut sock = EmuSocket::new(sb, bb, EmuConfig::default()).unwrap();
        drain(&mut sock, data_b.len(), data_b.len())
    });
    let t = std::time::Instant::now();
    while b.stats().exhausted_waits.load(Ordering::Relaxed) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "B never waited for the pool"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    b.unbind();
    let (got, sum) = reader.join().unwrap();
    assert!(got == pattern(4 * NIOV_SIZE, 7));
    assert_eq!(sum.dmabuf_frags, 0);
}

#[test]
fn closing_a_socket_releases_its_outstanding_tokens() {
    let (s, w) = pair(pattern(8 * NIOV_SIZE, 8));
    w.join().unwrap();
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 5 * NIOV_SIZE + 10];
    let n = sock.recv_frags(&mut buf).unwrap().bytes();
    assert!(n > 0);
    assert!(b.free_niovs() < b.num_niovs());
    drop(sock);
    assert_eq!(b.free_niovs(), b.num_niovs());
}

#[test]
fn after_unbind_a_socket_reads_ordinary_tcp_without_cmsgs() {
    // As the kernel: the queues restart with ordinary pages and the same socket goes on
    // receiving. Before, the emulator failed the read ("unbound"), which hardware never does.
    let data = pattern(3 * NIOV_SIZE, 9);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    w.write_all(&data[..NIOV_SIZE]).unwrap();
    let (got, sum) = drain(&mut sock, NIOV_SIZE, NIOV_SIZE);
    assert_eq!(
        (got.as_slice(), sum.dmabuf_bytes),
        (&data[..NIOV_SIZE], NIOV_SIZE as u64)
    );
    b.unbind();
    w.write_all(&data[NIOV_SIZE..]).unwrap();
    drop(w);
    let (got, sum) = drain(&mut sock, 2 * NIOV_SIZE, NIOV_SIZE);
    assert_eq!(got.as_slice(), &data[NIOV_SIZE..]);
    assert_eq!((sum.dmabuf_frags, sum.bytes), (0, 2 * NIOV_SIZE));
    let mut buf = [0u8; 8];
    assert!(sock.recv_frags(&mut buf).unwrap().is_eof());
}

#[test]
fn eof_and_unbind() {
    let (s, w) = pair(Vec::new());
    w.join().unwrap();
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 100];
    assert!(sock.recv_frags(&mut buf).unwrap().is_eof());
    b.unbind();
    assert!(sock.recv_frags(&mut buf).unwrap().is_eof());
    assert!(matches!(
        EmuBinding::new(1, 1000),
        Err(EmuError::TooSmall { .. })
    ));
}

#[test]
fn a_control_buffer_too_small_for_a_cmsg_fails_only_when_a_frag_is_due() {
    // Before, ETOOSMALL came before anything was looked at: at EOF and for ordinary TCP
    // after unbind too, where the kernel writes no cmsg and so needs no room for one.
    let (s, w) = pair(Vec::new());
    w.join().unwrap();
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut tiny = EmuSocket::with_control_len(s, b, EmuConfig::default(), 39).unwrap();
    let mut buf = vec![0u8; 100];
    assert!(
        tiny.recv_frags(&mut buf).unwrap().is_eof(),
        "EOF needs no cmsg"
    );

    let data = pattern(2 * NIOV_SIZE, 6);
    let (s, w) = pair(data.clone());
    w.join().unwrap();
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut tiny =
        EmuSocket::with_control_len(s, Arc::clone(&b), EmuConfig::default(), 39).unwrap();
    let mut buf = vec![0u8; 2 * NIOV_SIZE];
    let e = tiny.recv_frags(&mut buf).unwrap_err();
    assert_eq!(
        e.errno(),
        Some(crate::socket::ETOOSMALL),
        "a frag is due: {e}"
    );
    b.unbind();
    // The bytes stayed in the socket; now they arrive as ordinary TCP, without a cmsg.
    let mut got = Vec::new();
    loop {
        let batch = tiny.recv_frags(&mut buf).unwrap();
        if batch.is_eof() {
            break;
        }
        assert_eq!(batch.summary().dmabuf_frags, 0);
        let n = batch.bytes();
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got == data,
        "{} of {} bytes, or other bytes",
        got.len(),
        data.len()
    );
}

#[test]
fn a_reset_after_a_short_read_is_returned_by_the_next_call() {
    // Before, the error the emulator's recv met after handing out bytes was dropped (that
    // recv consumed it from the socket): a reset read as a short read, then a clean EOF.
    let data = pattern(3 * NIOV_SIZE, 7);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    // Bytes the writer never reads make its close a reset (RST), behind its data.
    (&s).write_all(b"unread").unwrap();
    w.write_all(&data).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    drop(w);
    std::thread::sleep(std::time::Duration::from_millis(50));
    let b = EmuBinding::new(1, 16 * NIOV_SIZE).unwrap();
    let mut sock = EmuSocket::new(s, b, EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 16 * NIOV_SIZE];
    let mut got = 0;
    let e = loop {
        match sock.recv_frags(&mut buf) {
            Ok(batch) => {
                assert!(!batch.is_eof(), "the reset after {got} bytes read as EOF");
                got += batch.bytes();
            }
            Err(e) => break e,
        }
    };
    assert_eq!(got, data.len(), "every byte before the reset");
    assert_eq!(e.errno(), Some(libc::ECONNRESET), "{e}");
}

#[test]
fn the_gather_reads_emulated_memory_only_for_its_own_frags() {
    // Before, a batch gathered from another emulated binding's memory (the same id, or a
    // caller's mix-up) was read from pages that binding's emulator writes: a data race.
    let data = pattern(2 * NIOV_SIZE, 8);
    let (s, w) = pair(data.clone());
    w.join().unwrap();
    let (a, other) = (
        EmuBinding::new(1, 16 * NIOV_SIZE).unwrap(),
        EmuBinding::new(1, 16 * NIOV_SIZE).unwrap(),
    );
    let mut sock = EmuSocket::new(s, Arc::clone(&a), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 2 * NIOV_SIZE];
    let mut tokens = TokenBatcher::new();
    let batch = sock.recv_frags(&mut buf).unwrap();
    assert!(batch.summary().dmabuf_frags > 0);
    let e = gather(&batch, &mut buf, other.mem(), 1, &mut tokens).unwrap_err();
    assert!(
        matches!(e, crate::gather::GatherError::ForeignMemory { .. }),
        "{e}"
    );
    let g = gather(&batch, &mut buf, a.mem(), 1, &mut tokens).unwrap();
    assert_eq!(&buf[..g.bytes], &data[..g.bytes]);
}

/// A socket of `b` that has taken every net_iov and keeps the tokens (a receiver that does
/// not return them).
fn hold_every_niov(b: &Arc<EmuBinding>) -> EmuSocket {
    let n = b.num_niovs();
    let (s, w) = pair(pattern(n * NIOV_SIZE, 6));
    w.join().unwrap();
    let mut a = EmuSocket::new(s, Arc::clone(b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; n * NIOV_SIZE];
    let mut got = 0;
    while got < buf.len() {
        got += a.recv_frags(&mut buf[got..]).unwrap().bytes();
    }
    assert_eq!(b.free_niovs(), 0, "A holds every net_iov");
    a
}

/// Wait until `s` (blocking or not) holds `n` unread bytes (a peek consumes nothing).
fn wait_for_bytes(s: &TcpStream, n: usize) {
    let mut probe = vec![0u8; n];
    let t = Instant::now();
    loop {
        match s.peek(&mut probe) {
            Ok(k) if k >= n => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("peek: {e}"),
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{n} bytes never arrived"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The kernel counts `SO_RCVTIMEO` in jiffies, and its first one may be cut short.
const JIFFY_SLACK: Duration = Duration::from_millis(20);

#[test]
fn eof_with_the_pool_empty_is_returned_at_once() {
    // Before, the fill waited for a free net_iov before its recv could see EOF: with every
    // net_iov held by another socket the read failed with EAGAIN after SO_RCVTIMEO (a
    // "stall"), or waited for ever without one. The kernel returns 0 at once.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let _a = hold_every_niov(&b);
    let (s, w) = pair(Vec::new());
    w.join().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 4 * NIOV_SIZE];
    let eof = sock.recv_frags(&mut buf).map(|r| r.is_eof());
    assert!(matches!(eof, Ok(true)), "{eof:?}");
    assert_eq!(b.stats().exhausted_waits.load(Ordering::Relaxed), 0);
    assert_eq!(b.free_niovs(), 0);
}

#[test]
fn a_reset_with_the_pool_empty_is_returned_at_once() {
    // Before, as for EOF: the pending ECONNRESET waited behind the pool wait, and the read
    // failed with EAGAIN after SO_RCVTIMEO (the node said "stalled", not "reset").
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let _a = hold_every_niov(&b);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    // Bytes the writer never reads make its close a reset (RST).
    (&s).write_all(b"unread").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(w);
    std::thread::sleep(Duration::from_millis(50));
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 4 * NIOV_SIZE];
    let e = sock.recv_frags(&mut buf).map(|r| r.bytes()).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ECONNRESET), "{e}");
    assert_eq!(b.stats().exhausted_waits.load(Ordering::Relaxed), 0);
}

#[test]
fn a_nonblocking_socket_with_nothing_to_land_would_block_at_once() {
    // Before, the fill waited for readability whatever O_NONBLOCK said: a non-blocking
    // socket with no bytes waited for its SO_RCVTIMEO (for ever without one).
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let timeout = Duration::from_secs(5);
    s.set_read_timeout(Some(timeout)).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let mut buf = vec![0u8; 4 * NIOV_SIZE];
    let t = Instant::now();
    let e = sock.recv_frags(&mut buf).map(|r| r.bytes()).unwrap_err();
    assert!(e.is_would_block(), "{e}");
    assert!(t.elapsed() < timeout / 2, "waited {:?}", t.elapsed());
    assert_eq!(b.free_niovs(), MIN_NIOVS, "no net_iov taken");
    // Bytes there but no free net_iov: no wait for the pool either (the NIC dropped them).
    let a = hold_every_niov(&b);
    peer.write_all(b"late").unwrap();
    wait_for_bytes(sock.get_ref(), 4);
    let t = Instant::now();
    let e = sock.recv_frags(&mut buf).map(|r| r.bytes()).unwrap_err();
    assert!(e.is_would_block(), "{e}");
    assert!(t.elapsed() < timeout / 2, "waited {:?}", t.elapsed());
    // The bytes stayed in the socket: with the pool free again they land.
    drop(a);
    let (got, _) = drain(&mut sock, 4, 4);
    assert_eq!(got, b"late");
}

#[test]
fn a_pending_zerocopy_completion_does_not_keep_a_read_from_timing_out() {
    // Before, the fill polled for readability, and poll reports POLLERR while the error
    // queue holds a MSG_ZEROCOPY completion, which recv neither drains nor waits for: the
    // fill spun (taking and returning net_iovs) and never gave up after SO_RCVTIMEO.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    // The socket also sends with MSG_ZEROCOPY: the completion lands on its error queue.
    sys::set_zerocopy(s.as_fd()).unwrap();
    let payload = pattern(NIOV_SIZE, 5);
    let ranges = [(payload.as_ptr() as u64, payload.len())];
    let sent = sys::sendmsg_dmabuf(s.as_fd(), &ranges, 0, libc::MSG_ZEROCOPY).unwrap();
    assert_eq!(sent, payload.len());
    let t = Instant::now();
    while (sys::poll_now(s.as_fd()).unwrap() & libc::POLLERR) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no completion queued"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let timeout = Duration::from_millis(300);
    s.set_read_timeout(Some(timeout)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let bb = Arc::clone(&b);
    let reader = std::thread::spawn(move || {
        let mut sock = EmuSocket::new(s, bb, EmuConfig::default()).unwrap();
        let mut buf = vec![0u8; 4 * NIOV_SIZE];
        let t = Instant::now();
        let first = sock.recv_frags(&mut buf).map(|r| r.bytes());
        let first = first.map_err(|e| (e.is_would_block(), e.errno()));
        tx.send((first, t.elapsed())).unwrap();
        sock
    });
    let outcome = rx.recv_timeout(Duration::from_secs(10));
    // Bytes end the read whatever came (before, only they ended the spin).
    peer.write_all(b"late").unwrap();
    let mut sock = reader.join().unwrap();
    let (first, waited) = outcome.expect("the read gave up after its SO_RCVTIMEO");
    assert_eq!(first, Err((true, Some(libc::EAGAIN))));
    assert!(waited + JIFFY_SLACK >= timeout, "waited {waited:?}");
    assert_eq!(b.free_niovs(), MIN_NIOVS, "no net_iov kept");
    let (got, _) = drain(&mut sock, 4, 4);
    assert_eq!(got, b"late");
}

#[test]
fn so_rcvlowat_applies_as_in_the_kernels_recvmsg() {
    // The kernel waits for min(SO_RCVLOWAT, len) bytes. Before, the fill polled, and poll
    // waits for SO_RCVLOWAT bytes whatever the read's length: a 4 KiB read with a 64 KiB
    // mark and 4 KiB there failed with EAGAIN after SO_RCVTIMEO.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let data = pattern(NIOV_SIZE, 3);
    peer.write_all(&data).unwrap();
    wait_for_bytes(&s, NIOV_SIZE);
    sys::set_rcvlowat(s.as_fd(), 64 * 1024).unwrap();
    let timeout = Duration::from_millis(500);
    s.set_read_timeout(Some(timeout)).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    let (got, _) = drain(&mut sock, NIOV_SIZE, NIOV_SIZE);
    assert!(got == data, "the read's length is the target");
    // A mark below the read's length is waited for (here until SO_RCVTIMEO, which then
    // returns what came), not just one byte.
    let more = pattern(NIOV_SIZE, 4);
    peer.write_all(&more).unwrap();
    wait_for_bytes(sock.get_ref(), NIOV_SIZE);
    sys::set_rcvlowat(sock.get_ref().as_fd(), 2 * NIOV_SIZE as i32).unwrap();
    let mut buf = vec![0u8; 4 * NIOV_SIZE];
    let t = Instant::now();
    let n = sock.recv_frags(&mut buf).unwrap().bytes();
    assert_eq!(n, NIOV_SIZE);
    assert!(
        t.elapsed() + JIFFY_SLACK >= timeout,
        "returned after {:?}",
        t.elapsed()
    );
}

#[test]
fn a_wait_for_bytes_again_gets_only_what_is_left_of_the_receive_timeout() {
    // A fill whose peek saw bytes that another handle of the socket then read waits for
    // more. Before, that wait ran under the socket's full SO_RCVTIMEO again: one call could
    // take twice its timeout, or more with each theft.
    let b = EmuBinding::new(1, MIN_NIOVS * NIOV_SIZE).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let timeout = Duration::from_secs(2);
    s.set_read_timeout(Some(timeout)).unwrap();
    let mut sock = EmuSocket::new(s, Arc::clone(&b), EmuConfig::default()).unwrap();
    // A call that began 1.8 s ago has 200 ms left.
    let left = Duration::from_millis(200);
    let start = Instant::now().checked_sub(timeout - left).unwrap();
    let t = Instant::now();
    let e = sock.await_bytes_within(NIOV_SIZE, start).unwrap_err();
    let waited = t.elapsed();
    assert!(e.kind() == io::ErrorKind::WouldBlock, "{e}");
    assert!(
        waited + JIFFY_SLACK >= left / 2 && waited < timeout / 2,
        "waited {waited:?}"
    );
    assert_eq!(
        sock.get_ref().read_timeout().unwrap(),
        Some(timeout),
        "the socket's own timeout is put back"
    );
    // None left: EAGAIN at once.
    let start = Instant::now().checked_sub(timeout).unwrap();
    let t = Instant::now();
    let e = sock.await_bytes_within(NIOV_SIZE, start).unwrap_err();
    assert!(e.kind() == io::ErrorKind::WouldBlock, "{e}");
    assert!(t.elapsed() < left, "waited {:?}", t.elapsed());
    // Bytes there: found, and left for the fill to land.
    peer.write_all(b"late").unwrap();
    let start = Instant::now().checked_sub(timeout - left).unwrap();
    assert!(sock.await_bytes_within(4, start).unwrap());
    assert_eq!(sock.get_ref().read_timeout().unwrap(), Some(timeout));
    let (got, _) = drain(&mut sock, 4, 4);
    assert_eq!(got, b"late");
}
