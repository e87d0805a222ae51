//! Tests of devmem receive and token return: DONTNEED validation and `MSG_SOCK_DEVMEM` on
//! real loopback sockets (no devmem NIC needed, reference devmem.md §10), and the token
//! batching rules against a fake syscall.

use std::io::Write;
use std::net::{Shutdown, TcpListener, UdpSocket};

use super::*;

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

fn tok(start: u32, count: u32) -> libc::dmabuf_token {
    libc::dmabuf_token {
        token_start: start,
        token_count: count,
    }
}

#[test]
fn msg_sock_devmem_on_loopback_returns_plain_bytes_and_no_cmsg() {
    let (mut c, s) = tcp_pair();
    c.write_all(b"hello devmem").unwrap();
    let mut sock = DevmemSocket::new(&s);
    let mut buf = [0u8; 64];
    let batch = sock.recv_frags(&mut buf).unwrap();
    assert_eq!(batch.bytes(), 12);
    assert_eq!(*batch.summary(), CmsgSummary::default());
    assert_eq!(batch.frags().count(), 0);
    assert_eq!(batch.plain_bytes(), 12);
    assert!(!batch.is_eof() && !batch.control_truncated());
    match batch.check_devmem_only() {
        Err(DevmemError::NotDevmem {
            linear_bytes: 0,
            plain_bytes: 12,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(&buf[..12], b"hello devmem");
    c.shutdown(Shutdown::Write).unwrap();
    assert!(sock.recv_frags(&mut buf).unwrap().is_eof());
}

#[test]
fn tiny_control_buffer_is_fine_for_plain_data() {
    let (mut c, s) = tcp_pair();
    c.write_all(b"x").unwrap();
    let mut sock = DevmemSocket::with_control_len(s, 0);
    let mut buf = [0u8; 4];
    assert_eq!(sock.recv_frags(&mut buf).unwrap().bytes(), 1);
}

#[test]
fn nonblocking_recv_reports_would_block() {
    let (_c, s) = tcp_pair();
    s.set_nonblocking(true).unwrap();
    let mut sock = DevmemSocket::new(s);
    let e = sock.recv_frags(&mut [0u8; 8]).unwrap_err();
    assert!(e.is_would_block(), "{e}");
}

#[test]
fn etoosmall_is_its_own_error() {
    let e = recv_error(io::Error::from_raw_os_error(ETOOSMALL), 16);
    assert!(matches!(
        e,
        DevmemError::ControlBufferTooSmall { capacity: 16 }
    ));
    assert_eq!(e.errno(), Some(525));
    assert!(e.to_string().contains("control buffer too small"));
    assert_eq!(crate::errno_label(ETOOSMALL), "ETOOSMALL");
    let e = recv_error(io::Error::from_raw_os_error(libc::EFAULT), 16);
    assert!(matches!(e, DevmemError::Syscall { .. }));
}

#[test]
fn dontneed_of_an_unknown_token_frees_nothing() {
    let (_c, s) = tcp_pair();
    assert_eq!(sys::dontneed(s.as_fd(), &[tok(1, 1)]).unwrap(), 0);
    // 128 tokens is the limit, still accepted.
    let many: Vec<_> = (0..128).map(|i| tok(1 + 2 * i, 1)).collect();
    assert_eq!(sys::dontneed(s.as_fd(), &many).unwrap(), 0);
    // Through the batcher: the count is checked.
    let mut b = TokenBatcher::new();
    b.push(42);
    let sock = DevmemSocket::new(&s);
    match sock.return_tokens(&mut b) {
        Err(DevmemError::DontneedMismatch {
            requested: 1,
            freed: 0,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(b.pending_frags(), 0);
}

#[test]
fn dontneed_with_more_than_128_tokens_is_einval() {
    let (_c, s) = tcp_pair();
    let many: Vec<_> = (0..129).map(|i| tok(1 + 2 * i, 1)).collect();
    let e = sys::dontneed(s.as_fd(), &many).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
}

#[test]
fn dontneed_optlen_not_a_multiple_of_8_is_einval() {
    let (_c, s) = tcp_pair();
    for len in [0usize, 4, 12, 15] {
        let e = sys::setsockopt_bytes(
            s.as_fd(),
            libc::SOL_SOCKET,
            crate::SO_DEVMEM_DONTNEED,
            &vec![0u8; len],
        )
        .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "optlen {len}: {e}");
    }
}

#[test]
fn dontneed_on_udp_is_ebadf() {
    let u = UdpSocket::bind("127.0.0.1:0").unwrap();
    let e = sys::dontneed(u.as_fd(), &[tok(1, 1)]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{e}");
    let mut b = TokenBatcher::new();
    b.push(1);
    let e = b.flush(u.as_fd()).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EBADF));
    assert_eq!(
        b.pending_frags(),
        1,
        "tokens stay pending on a syscall error"
    );
}

// ---- token batching against a fake syscall ----

/// Flush with a fake that records the calls and frees everything.
fn flush_recorded(b: &mut TokenBatcher) -> Vec<Vec<(u32, u32)>> {
    let mut calls = Vec::new();
    let freed = b
        .flush_with(|t| {
            calls.push(
                t.iter()
                    .map(|t| (t.token_start, t.token_count))
                    .collect::<Vec<_>>(),
            );
            Ok(t.iter().map(|t| t.token_count as usize).sum())
        })
        .unwrap();
    let total: u32 = calls.iter().flatten().map(|c| c.1).sum();
    assert_eq!(freed, total as usize);
    calls
}

fn check_limits(calls: &[Vec<(u32, u32)>]) {
    for c in calls {
        assert!(!c.is_empty());
        assert!(
            c.len() <= MAX_DONTNEED_TOKENS,
            "{} tokens in a call",
            c.len()
        );
        let frags: u32 = c.iter().map(|t| t.1).sum();
        assert!(
            frags as usize <= MAX_DONTNEED_FRAGS,
            "{frags} frags in a call"
        );
        assert!(c.iter().all(|t| t.1 > 0));
    }
}

fn expand(calls: &[Vec<(u32, u32)>]) -> Vec<u32> {
    calls
        .iter()
        .flatten()
        .flat_map(|&(s, n)| (0..n).map(move |i| s + i))
        .collect()
}

#[test]
fn only_consecutive_tokens_coalesce() {
    let mut b = TokenBatcher::new();
    for t in [1, 3, 5, 4, 7, 8, 9, 11, 10, u32::MAX, 0, 2] {
        b.push(t);
    }
    let ranges: Vec<_> = b.pending_ranges().collect();
    assert_eq!(
        ranges,
        vec![
            (1, 1),
            (3, 1),
            (5, 1),
            (4, 1),
            (7, 3),
            (11, 1),
            (10, 1),
            (u32::MAX, 1),
            (0, 1),
            (2, 1)
        ]
    );
    assert_eq!(b.pending_frags(), 12);
    let calls = flush_recorded(&mut b);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0], ranges);
    assert_eq!(b.pending_frags(), 0);
}

#[test]
fn many_scattered_tokens_respect_the_128_token_limit() {
    let mut b = TokenBatcher::new();
    let pushed: Vec<u32> = (0..1000).map(|i| 1 + 2 * i).collect();
    pushed.iter().for_each(|&t| b.push(t));
    assert!(b.should_flush());
    let calls = flush_recorded(&mut b);
    check_limits(&calls);
    assert_eq!(calls.len(), 8); // ceil(1000 / 128)
    assert_eq!(expand(&calls), pushed);
}

#[test]
fn long_runs_respect_the_1024_frag_limit() {
    let mut b = TokenBatcher::new();
    let pushed: Vec<u32> = (1..=5000).collect();
    pushed.iter().for_each(|&t| b.push(t));
    assert!(
        b.pending_ranges()
            .all(|(_, n)| n as usize <= MAX_DONTNEED_FRAGS)
    );
    let calls = flush_recorded(&mut b);
    check_limits(&calls);
    assert_eq!(calls.len(), 5); // ceil(5000 / 1024)
    assert_eq!(calls[0], vec![(1, 1024)]);
    assert_eq!(expand(&calls), pushed);
}

#[test]
fn ranges_are_split_across_calls() {
    let mut b = TokenBatcher::new();
    let mut pushed: Vec<u32> = (0..100).map(|i| 10_000 + 2 * i).collect();
    pushed.extend(1..=2000);
    pushed.iter().for_each(|&t| b.push(t));
    let calls = flush_recorded(&mut b);
    check_limits(&calls);
    // 100 singles + 924 of the run fill the first call exactly.
    assert_eq!(calls[0].len(), 101);
    assert_eq!(*calls[0].last().unwrap(), (1, 924));
    assert_eq!(calls[1][0], (925, 100)); // the rest of the first 1024-run
    assert_eq!(expand(&calls), pushed);
}

#[test]
fn a_short_count_is_reported_not_panicked() {
    let mut b = TokenBatcher::new();
    (1..=3000).for_each(|t| b.push(t * 2));
    let e = b
        .flush_with(|t| Ok(t.iter().map(|t| t.token_count as usize).sum::<usize>() - 1))
        .unwrap_err();
    match e {
        DevmemError::DontneedMismatch { requested, freed } => {
            assert_eq!(requested, 3000);
            assert_eq!(freed, 3000 - 24); // one short per call, ceil(3000/128) calls
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(b.pending_frags(), 0);
}

#[test]
fn a_failed_call_keeps_the_unsent_tokens() {
    let mut b = TokenBatcher::new();
    let pushed: Vec<u32> = (1..=2500).collect();
    pushed.iter().for_each(|&t| b.push(t));
    let mut n = 0;
    let e = b
        .flush_with(|t| {
            n += 1;
            if n == 2 {
                Err(io::Error::from_raw_os_error(libc::EINVAL))
            } else {
                Ok(t.iter().map(|t| t.token_count as usize).sum())
            }
        })
        .unwrap_err();
    assert_eq!(e.errno(), Some(libc::EINVAL));
    assert_eq!(b.pending_frags(), 2500 - 1024);
    let calls = flush_recorded(&mut b);
    assert_eq!(expand(&calls), pushed[1024..]);
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn batching_covers_every_token_within_limits(
            runs in proptest::collection::vec((any::<u32>(), 1u32..1500), 0..40)
        ) {
            let mut b = TokenBatcher::new();
            let mut pushed = Vec::new();
            for (start, len) in runs {
                let start = start & 0x7fff_ffff; // tokens are 31-bit
                for t in start..start.saturating_add(len) {
                    b.push(t);
                    pushed.push(t);
                }
            }
            prop_assert_eq!(b.pending_frags(), pushed.len());
            let calls = flush_recorded(&mut b);
            check_limits(&calls);
            prop_assert_eq!(expand(&calls), pushed);
        }
    }
}
