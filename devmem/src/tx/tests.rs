//! Devmem TX against the running kernel (loopback TCP; root not needed) and the completion
//! parser on synthetic control buffers.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

fn errno(e: &TxError) -> Option<i32> {
    match e {
        TxError::Syscall { source, .. } => source.raw_os_error(),
        TxError::Completion(_) => None,
    }
}

#[test]
fn id_zero_is_an_ordinary_zerocopy_send_and_its_completion_parses() {
    let (c, mut s) = pair();
    let mut tx = DevmemTx::new(c, 0).unwrap();
    let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    // With id 0 the bases are ordinary addresses: point at a live buffer.
    let n = tx
        .send(&[(payload.as_ptr() as u64, payload.len())])
        .unwrap();
    assert_eq!(n, payload.len());
    assert_eq!(tx.pending(), 1);
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).unwrap();
    assert!(got == payload);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut done = Vec::new();
    while tx.pending() > 0 && Instant::now() < deadline {
        done.extend(tx.poll_completions().unwrap());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(tx.pending(), 0, "no completion within 5 s");
    assert_eq!(done[0].lo, 0);
    assert_eq!(done[0].hi, 0);
    assert!(done[0].copied, "loopback always copies: {done:?}");
}

#[test]
fn id_zero_sends_no_cmsg_so_a_kernel_without_devmem_tx_takes_it() {
    // Before, id 0 still carried an SCM_DEVMEM_DMABUF cmsg, which kernels before 6.16 refuse
    // with EINVAL (`__sock_cmsg_send` knows no type 79): every emulated send failed there.
    // An AF_UNIX socket refuses any SOL_SOCKET cmsg it does not know on every kernel, so it
    // stands in for such a kernel here.
    use std::os::unix::net::UnixStream;
    let (a, mut b) = UnixStream::pair().unwrap();
    let payload = *b"plain send";
    let ranges = [(payload.as_ptr() as u64, payload.len())];
    let n = sys::sendmsg_dmabuf(a.as_fd(), &ranges, 0, 0).unwrap();
    assert_eq!(n, payload.len());
    let mut got = [0u8; 10];
    b.read_exact(&mut got).unwrap();
    assert_eq!(got, payload);
    // A non-zero id does carry the cmsg: the same socket refuses it.
    let e = sys::sendmsg_dmabuf(a.as_fd(), &ranges, 7, 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
}

#[test]
fn an_unknown_binding_id_is_einval_with_the_reason() {
    let (c, _s) = pair();
    let mut tx = DevmemTx::new(c, 12345).unwrap();
    let e = tx.send(&[(0, 4096)]).unwrap_err();
    assert_eq!(errno(&e), Some(libc::EINVAL), "{e}");
    assert!(e.to_string().contains("not a TX binding"), "{e}");
    assert_eq!(tx.pending(), 0);
}

#[test]
fn a_binding_id_without_msg_zerocopy_is_einval() {
    let (c, _s) = pair();
    let mut tx = DevmemTx::new(c, 1).unwrap();
    let e = tx.send_flags(&[(0, 4096)], 0).unwrap_err();
    assert_eq!(errno(&e), Some(libc::EINVAL), "{e}");
}

fn cmsg(level: i32, ty: i32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(CMSG_HDR_LEN + data.len()).to_ne_bytes());
    v.extend_from_slice(&level.to_ne_bytes());
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(data);
    while v.len() % WORD != 0 {
        v.push(0);
    }
    v
}

fn ee(errno: u32, origin: u8, code: u8, lo: u32, hi: u32) -> Vec<u8> {
    let mut d = errno.to_ne_bytes().to_vec();
    d.extend_from_slice(&[origin, 0, code, 0]);
    d.extend_from_slice(&lo.to_ne_bytes());
    d.extend_from_slice(&hi.to_ne_bytes());
    d
}

#[test]
fn completion_parser_on_synthetic_buffers() {
    let v6 = cmsg(libc::SOL_IPV6, libc::IPV6_RECVERR, &ee(0, 5, 0, 3, 9));
    assert_eq!(
        parse_completion(&v6).unwrap(),
        Some(Completion {
            lo: 3,
            hi: 9,
            copied: false
        })
    );
    assert_eq!(parse_completion(&[]).unwrap(), None);
    let other = cmsg(libc::SOL_SOCKET, 99, &[1, 2, 3, 4]);
    assert_eq!(parse_completion(&other).unwrap(), None);
    let not_zc = cmsg(
        libc::SOL_IP,
        libc::IP_RECVERR,
        &ee(libc::EMSGSIZE as u32, 2, 0, 0, 0),
    );
    assert!(parse_completion(&not_zc).is_err());
    let short = cmsg(libc::SOL_IP, libc::IP_RECVERR, &[0; 8]);
    assert!(parse_completion(&short).is_err());
    let mut lying = cmsg(libc::SOL_IP, libc::IP_RECVERR, &ee(0, 5, 1, 0, 0));
    lying[0] = 200;
    assert!(parse_completion(&lying).is_err());
}

#[test]
fn completions_out_of_order_and_across_the_wrap_are_counted_not_maxed() {
    // Before, `pending` was `sent - (highest hi + 1)`: a completion of 5 arriving before
    // 3..=4 said nothing was pending, and past 2^32 sends `max` stuck at the wrap.
    let (c, _s) = pair();
    let mut tx = DevmemTx::new(c, 0).unwrap();
    let done = |lo, hi| Completion {
        lo,
        hi,
        copied: false,
    };
    tx.sent = 6;
    tx.count(&done(0, 2));
    tx.count(&done(5, 5));
    assert_eq!(tx.pending(), 2, "3 and 4 are not complete");
    tx.count(&done(3, 4));
    assert_eq!(tx.pending(), 0);
    tx.sent = 2;
    tx.completed = u32::MAX;
    tx.count(&done(u32::MAX, 1));
    assert_eq!(
        tx.pending(),
        0,
        "the range across the wrap completes all three"
    );
}

#[test]
fn a_bad_error_queue_message_after_completions_returns_them_then_the_error() {
    // Before, the `?` on the bad message dropped the completions read before it in the same
    // poll (counted, never returned): the caller never freed their bytes.
    let (c, _s) = pair();
    let mut tx = DevmemTx::new(c, 0).unwrap();
    tx.sent = 3;
    let mut queue = vec![
        cmsg(libc::SOL_IP, libc::IP_RECVERR, &ee(0, 5, 0, 0, 1)),
        cmsg(
            libc::SOL_IP,
            libc::IP_RECVERR,
            &ee(libc::EMSGSIZE as u32, 2, 0, 0, 0),
        ),
        cmsg(libc::SOL_IP, libc::IP_RECVERR, &ee(0, 5, 0, 2, 2)),
    ]
    .into_iter();
    let mut recv = |_: &TcpStream, control: &mut [u8]| match queue.next() {
        Some(m) => {
            control[..m.len()].copy_from_slice(&m);
            Ok(m.len())
        }
        None => Err(io::Error::from(io::ErrorKind::WouldBlock)),
    };
    let done = |lo, hi| Completion {
        lo,
        hi,
        copied: false,
    };
    assert_eq!(tx.drain(&mut recv).unwrap(), [done(0, 1)]);
    assert_eq!(tx.pending(), 1);
    let e = tx.drain(&mut recv).unwrap_err();
    assert!(matches!(e, TxError::Completion(_)), "{e}");
    // The poll after it goes on past the bad message.
    assert_eq!(tx.drain(&mut recv).unwrap(), [done(2, 2)]);
    assert_eq!(tx.pending(), 0);
    assert!(tx.drain(&mut recv).unwrap().is_empty());
}
