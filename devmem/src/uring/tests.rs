//! Multishot receive over real loopback sockets: every byte arrives once, in order, where the
//! layout says; a ring dropped while armed lets go of its socket.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use super::bench::{Buffers, MultishotRecv, RecvInto};
use super::*;

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// A connected pair; the sender thread writes `data` in uneven pieces and closes.
fn send_over_loopback(data: Vec<u8>) -> (TcpStream, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (rx, _) = l.accept().unwrap();
    let t = std::thread::spawn(move || {
        let mut at = 0;
        for k in 0.. {
            if at == data.len() {
                break;
            }
            let n = (1000 + k * 7919 % 200_000).min(data.len() - at);
            // A receiver that shut its socket down (a test of a failed receive) ends the
            // sending; a test that needs every byte checks what it got.
            if tx.write_all(&data[at..at + n]).is_err() {
                break;
            }
            at += n;
        }
    });
    (rx, t)
}

#[test]
fn copy_buffers_hand_over_every_byte_in_order() {
    let data = pattern(3 << 20);
    let (rx, t) = send_over_loopback(data.clone());
    let mut r = MultishotRecv::new(
        rx,
        Buffers::Copy {
            len: 16 << 10,
            count: 8,
        },
    )
    .unwrap();
    let mut got = Vec::new();
    while r
        .wait(|p| {
            assert_eq!(p.offset, 0);
            assert!(p.data.len() <= 16 << 10);
            got.extend_from_slice(p.data);
        })
        .unwrap()
        > 0
    {}
    t.join().unwrap();
    assert_eq!(got.len(), data.len());
    assert!(got == data, "bytes differ from what was sent");
}

#[test]
fn slots_fill_piece_by_piece_and_rotate() {
    let slot = 256 << 10;
    let data = pattern(5 * slot + 1234);
    let (rx, t) = send_over_loopback(data.clone());
    let mut r = MultishotRecv::new(
        rx,
        Buffers::Slots {
            len: slot as u32,
            count: 4,
        },
    )
    .unwrap();
    let (mut at, mut pieces, mut slots_seen) = (0usize, 0, Vec::new());
    while r
        .wait(|p| {
            // Consecutive pieces continue the same slot until it is full.
            assert_eq!(p.offset, at % slot, "piece at stream offset {at}");
            if p.offset == 0 {
                slots_seen.push(p.buf);
            }
            assert!(p.offset + p.data.len() <= slot);
            assert!(p.data == &data[at..at + p.data.len()], "bytes at {at}");
            at += p.data.len();
            pieces += 1;
        })
        .unwrap()
        > 0
    {}
    t.join().unwrap();
    assert_eq!(at, data.len());
    assert!(
        pieces > 6,
        "{pieces} pieces: the test did not exercise partial slots"
    );
    // Six slots begun over a ring of four: buffers were given back and reused in turn.
    assert_eq!(slots_seen, vec![0, 1, 2, 3, 0, 1]);
}

#[test]
fn dropping_an_armed_receive_closes_the_socket() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (rx, _) = l.accept().unwrap();
    let r = MultishotRecv::new(
        rx,
        Buffers::Copy {
            len: 4096,
            count: 2,
        },
    )
    .unwrap();
    assert!(r.core.armed);
    drop(r);
    tx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(tx.read(&mut b).unwrap(), 0, "the peer sees the close");
}

#[test]
fn bad_buffer_counts_are_refused_with_the_count() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let _tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (rx, _) = l.accept().unwrap();
    let e = MultishotRecv::new(
        rx,
        Buffers::Copy {
            len: 4096,
            count: 3,
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("count 3"), "{e}");
}

#[test]
fn recv_into_fills_each_payload_in_place_in_order() {
    let sizes = [1usize, 4096, 300_000, 1 << 20, 17, 2 << 20];
    let data = pattern(sizes.iter().sum());
    let (rx, t) = send_over_loopback(data.clone());
    let mut r = RecvInto::new(rx).unwrap();
    let mut at = 0;
    for len in sizes {
        let mut dst = vec![0u8; len];
        let mut next = 0;
        r.recv(&mut dst, Duration::from_secs(10), |off, piece| {
            assert_eq!(off, next, "pieces arrive in order");
            assert!(piece == &data[at + off..at + off + piece.len()]);
            next += piece.len();
        })
        .unwrap();
        assert_eq!(next, len);
        assert!(dst == data[at..at + len], "payload at {at} differs");
        at += len;
    }
    t.join().unwrap();
}

#[test]
fn recv_into_fails_on_a_close_mid_payload_and_is_not_used_again() {
    let (rx, t) = send_over_loopback(pattern(1000));
    let mut r = RecvInto::new(rx).unwrap();
    let mut dst = vec![0u8; 4000];
    let e = r
        .recv(&mut dst, Duration::from_secs(10), |_, _| {})
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    assert!(e.to_string().contains("after 1000 of 4000"), "{e}");
    t.join().unwrap();
    let e = r
        .recv(&mut dst, Duration::from_secs(1), |_, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("failed earlier"), "{e}");
}

#[test]
fn recv_into_times_out_when_a_payload_stalls() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (rx, _) = l.accept().unwrap();
    tx.write_all(&[7; 100]).unwrap();
    let mut r = RecvInto::new(rx).unwrap();
    let mut dst = vec![0u8; 200];
    let t0 = std::time::Instant::now();
    let e = r
        .recv(&mut dst, Duration::from_millis(200), |_, _| {})
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(&dst[..100], &[7; 100]);
    // The receiver shut the socket down: the peer sees the close.
    tx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(tx.read(&mut [0u8; 1]).unwrap(), 0);
}

/// A heap buffer: its bytes do not move with the `Vec` value; its tally, the bytes landed.
struct Heap(Vec<u8>, usize);

impl Heap {
    fn new(len: usize) -> Self {
        Self(vec![0; len], 0)
    }
}

// SAFETY: a Vec's heap allocation does not move when the Vec is moved, and it is not
// resized while posted; the tally is a field of its own, not the bytes.
unsafe impl StableBuf for Heap {
    type Tally = usize;
    fn bytes(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn tally(&mut self) -> &mut usize {
        &mut self.1
    }
}

#[test]
fn a_queue_receives_posted_payloads_in_order_and_hands_them_back_whole() {
    let sizes = [
        5usize,
        1 << 20,
        70_000,
        3 << 20,
        1,
        999_999,
        4096,
        4096,
        2 << 20,
        12,
    ];
    let data = pattern(sizes.iter().sum());
    let (rx, t) = send_over_loopback(data.clone());
    let mut q = RecvQueue::<Heap>::new(rx).unwrap();
    let (mut next, mut done, mut pieces) = (0usize, Vec::new(), 0);
    while done.len() < sizes.len() {
        while !q.is_full() && next < sizes.len() {
            q.post(Heap::new(sizes[next])).map_err(|(_, e)| e).unwrap();
            next += 1;
        }
        assert!(q.remaining() > 0);
        q.wait(
            Duration::from_secs(10),
            |landed, off, p| {
                assert_eq!(off, *landed, "pieces land in order");
                *landed += p.len();
                pieces += 1;
            },
            |b| {
                assert_eq!(
                    b.1,
                    b.0.len(),
                    "every byte of a payload landed before it is done"
                );
                done.push(b.0)
            },
        )
        .unwrap();
    }
    t.join().unwrap();
    assert!(q.is_empty());
    let got: Vec<u8> = done.iter().flatten().copied().collect();
    assert_eq!(done.iter().map(Vec::len).collect::<Vec<_>>(), sizes);
    assert!(got == data, "payload bytes differ");
    assert!(pieces >= sizes.len());
}

#[test]
fn a_queue_refuses_posts_past_its_depth_and_gives_buffers_back_on_failure() {
    let (rx, t) = send_over_loopback(pattern(10));
    let mut q = RecvQueue::<Heap>::new(rx).unwrap();
    for _ in 0..QUEUE_DEPTH {
        q.post(Heap::new(4)).map_err(|(_, e)| e).unwrap();
    }
    let (back, e) = q.post(Heap::new(4)).unwrap_err();
    assert_eq!(back.0.len(), 4);
    assert!(
        e.to_string()
            .contains(&format!("{QUEUE_DEPTH} payloads are posted")),
        "{e}"
    );
    // Three payloads of 4 in all, each posted when there is room (as the node does).
    let (mut posted, mut completed) = (usize::from(QUEUE_DEPTH), 0);
    let err = loop {
        while posted < 3 && !q.is_full() {
            q.post(Heap::new(4)).map_err(|(_, e)| e).unwrap();
            posted += 1;
        }
        match q.wait(Duration::from_secs(10), |_, _, _| {}, |_| completed += 1) {
            Ok(()) => continue,
            Err(e) => break e,
        }
    };
    t.join().unwrap();
    // 10 bytes fill two payloads of 4 and half a third; then the sender closes.
    assert_eq!(completed, 2);
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    assert!(err.to_string().contains("after 2 of 4"), "{err}");
    let back = q.abandon();
    assert_eq!(back.len(), posted - 2, "every posted buffer comes back");
    assert!(q.post(Heap::new(4)).is_err());
}

#[test]
fn a_panic_while_handing_a_piece_over_takes_the_buffer_out_of_the_ring() {
    let (rx, t) = send_over_loopback(pattern(100_000));
    let mut r = RecvInto::new(rx).unwrap();
    let mut dst = vec![0u8; 100_000];
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = r.recv(&mut dst, Duration::from_secs(10), |_, _| panic!("piece"));
    }));
    assert!(caught.is_err());
    assert!(r.poisoned && !r.core.armed && !r.core.registered);
    drop(dst); // the kernel let go of it before the panic left `recv`
    let e = r
        .recv(&mut [0u8; 8], Duration::from_secs(1), |_, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("failed earlier"), "{e}");
    t.join().unwrap();
}

#[test]
fn a_close_right_after_the_last_posted_payload_is_reported_by_the_next_one() {
    let (rx, t) = send_over_loopback(pattern(4096));
    t.join().unwrap(); // all sent and closed: the close can come with the last bytes
    let mut q = RecvQueue::<Heap>::new(rx).unwrap();
    q.post(Heap::new(4096)).map_err(|(_, e)| e).unwrap();
    let mut done = Vec::new();
    while done.is_empty() {
        q.wait(Duration::from_secs(10), |_, _, _| {}, |b| done.push(b))
            .unwrap();
    }
    assert!(done[0].0 == pattern(4096));
    q.post(Heap::new(10)).map_err(|(_, e)| e).unwrap();
    let e = q
        .wait(Duration::from_secs(10), |_, _, _| {}, |_| {})
        .and_then(|()| q.wait(Duration::from_secs(10), |_, _, _| {}, |_| {}))
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    assert!(e.to_string().contains("after 0 of 10"), "{e}");
}

/// A sparse private mapping: address space only until its pages are written.
struct Sparse(*mut u8, usize);

impl Sparse {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh anonymous mapping, owned by the value and unmapped on Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", io::Error::last_os_error());
        Self(p.cast(), len)
    }
}

impl Drop for Sparse {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer posted (the queue gave it back).
        assert_eq!(unsafe { libc::munmap(self.0.cast(), self.1) }, 0);
    }
}

// SAFETY: the mapping does not move with the value and lives until Drop; the tally is
// no memory at all.
unsafe impl StableBuf for Sparse {
    type Tally = ();
    fn tally(&mut self) -> &mut () {
        Box::leak(Box::new(())) // a zero-sized box allocates nothing
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the whole mapping, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

#[test]
fn a_payload_over_4_gib_is_posted_in_pieces_a_ring_entry_holds() {
    // Before, it was refused ("1 byte to 4 GiB"): the node broke the link and fetched the
    // shard again, forever, though manifests allow shards up to 1 TiB.
    let (rx, t) = send_over_loopback(pattern(10));
    let mut q = RecvQueue::<Sparse>::new(rx).unwrap();
    let len = u32::MAX as usize + 4097;
    q.post(Sparse::new(len)).map_err(|(_, e)| e).unwrap();
    let pieces: Vec<usize> = q.pieces.iter().map(|p| p.len).collect();
    assert_eq!(pieces, [u32::MAX as usize, 4097]);
    assert_eq!(q.abandon().len(), 1);
    t.join().unwrap();
}
