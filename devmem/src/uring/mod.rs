//! io_uring multishot receive into provided buffers: the host-memory receive primitive of the
//! node's plain-TCP data connections.
//!
//! A ring ([`Core`]) owns a TCP socket, an io_uring and a buffer ring (the kernel takes the
//! next free buffer for each completion, so one armed request serves the whole connection).
//! [`RecvQueue`] is the node's form: the caller's buffers (shards' slabs) are the provided
//! buffers, one payload each, consumed incrementally (`IOU_PBUF_RING_INC`, Linux 6.12+), so the
//! bytes land where they belong with no copy, and each completed piece is handed over (to be
//! checksummed) in order. It owns up to [`QUEUE_DEPTH`] posted payloads (with more than one,
//! the kernel moves on to the next buffer without ending the receive; with one, which
//! measures best, a full buffer ends it and the next post re-arms it). [`bench`] holds the receivers `shardwire bench --compare-uring` measures it
//! against (buffers the receiver owns and copies out of; one payload at a time).
//!
//! Rings are set up `SINGLE_ISSUER | DEFER_TASKRUN`, so the receives normally run inside
//! this thread's `io_uring_enter`, where a completion is waited for. Soundness does not rest
//! on that: the kernel consumes a buffer's bytes once and in order, so completed bytes are
//! never written again. A payload goes back to its owner (`done` of [`RecvQueue::wait`]) as
//! soon as its last byte has completed, while the multishot receive stays armed: each of its
//! ring entries is then fully consumed (its last completion came without
//! `IORING_CQE_F_BUF_MORE`), so the ring's head has moved past it, and the kernel only takes
//! entries between the head and the tail; a slot is used again only once it is written anew
//! with another buffer. Payloads not fully received go back only after the receive has been
//! cancelled (its last completion seen) and the buffer ring unregistered
//! ([`RecvQueue::abandon`]). A ring belongs to the thread that made it (the types are not
//! `Send`), so each receiver thread sets up its own.
//!
//! Kernel facts: io_uring_register_buf_ring(3), io_uring_prep_recv_multishot(3), and
//! include/uapi/linux/io_uring.h for `IOU_PBUF_RING_INC` and `IORING_CQE_F_BUF_MORE`.
//! Memory the kernel may write is reached through raw pointers, and only completed bytes
//! are turned into slices; a request in flight is cancelled and waited for before the memory
//! is freed. Where that cannot be confirmed, memory a type owns is leaked rather than freed,
//! and [`RecvQueue`] (and `bench::RecvInto`), which hold their callers' memory, abort the process.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::VecDeque;
use std::io;
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

pub mod bench;

use io_uring::{IoUring, cqueue, opcode, types};

/// `IOU_PBUF_RING_INC` (include/uapi/linux/io_uring.h): buffers are consumed incrementally.
const IOU_PBUF_RING_INC: u16 = 2;
/// user_data of the multishot receive and of its cancel.
const RECV: u64 = 1;
const CANCEL: u64 = 2;
/// The one buffer group of a ring.
const GROUP: u16 = 0;
const PAGE: usize = 4096;

/// A zeroed, page-aligned heap allocation the kernel may write.
struct Pages {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Pages {
    fn new(len: usize) -> io::Result<Self> {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Self { ptr, layout })
    }

    fn addr(&self, off: usize) -> u64 {
        self.ptr.as_ptr().wrapping_add(off) as u64
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; callers drop it only when the kernel
        // no longer refers to it.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A ring with one buffer group and one multishot receive on `sock`.
struct Core {
    ring: IoUring,
    entries: ManuallyDrop<Pages>,
    count: u16,
    /// Next tail of the buffer ring (published with release order).
    tail: u16,
    /// The most bytes one completion may carry (0: as many as the buffer takes).
    cap: u32,
    armed: bool,
    /// The buffer ring is registered (until [`Core::unregister`]).
    registered: bool,
    sock: TcpStream,
}

/// One completion of the receive, as the kernel reported it.
enum Event {
    /// `n` bytes in buffer `buf`; `more`: the buffer takes more (incremental buffers).
    Data { buf: u16, n: usize, more: bool },
    /// The peer closed the connection.
    Eof,
}

impl Core {
    fn new(sock: TcpStream, count: u16, incremental: bool) -> io::Result<Self> {
        if !count.is_power_of_two() || count > 1 << 15 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("provided buffers: count {count} must be a power of two up to 32768"),
            ));
        }
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_cqsize(4096)
            .build(8)?;
        let entries = Pages::new(usize::from(count) * size_of::<types::BufRingEntry>())?;
        let flags = if incremental { IOU_PBUF_RING_INC } else { 0 };
        // SAFETY: `entries` is page aligned and holds `count` ring entries; it stays
        // allocated until the ring is unregistered in `drop` (or is leaked).
        unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(entries.addr(0), count, GROUP, flags)?
        };
        Ok(Self {
            ring,
            entries: ManuallyDrop::new(entries),
            count,
            tail: 0,
            cap: 0,
            armed: false,
            registered: true,
            sock,
        })
    }

    /// Unregisters the buffer ring: the kernel takes no buffer from it any more.
    fn unregister(&mut self) -> bool {
        if self.registered && self.ring.submitter().unregister_buf_ring(GROUP).is_ok() {
            self.registered = false;
        }
        !self.registered
    }

    /// Writes a buffer at the ring's next tail slot; [`Self::publish`] hands it over.
    fn push(&mut self, addr: u64, len: u32, bid: u16) {
        let slot = usize::from(self.tail & (self.count - 1));
        let base = self.entries.ptr.as_ptr().cast::<types::BufRingEntry>();
        // SAFETY: `slot < count` entries are allocated; the slot is past the published tail,
        // so the kernel does not read or write it now; the setters leave `resv` (the tail,
        // in entry 0) alone.
        let e = unsafe { &mut *base.add(slot) };
        e.set_addr(addr);
        e.set_len(len);
        e.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    fn publish(&self) {
        let base = self.entries.ptr.as_ptr().cast::<types::BufRingEntry>();
        // SAFETY: `base` is the ring's first entry; its tail field is a u16 the kernel reads
        // with acquire order and only this struct writes.
        let tail = unsafe { &*types::BufRingEntry::tail(base).cast::<AtomicU16>() };
        tail.store(self.tail, Ordering::Release);
    }

    fn arm(&mut self) -> io::Result<()> {
        let sqe = opcode::RecvMulti::new(types::Fd(self.sock.as_raw_fd()), GROUP)
            .len(self.cap)
            .build()
            .user_data(RECV);
        // SAFETY: the request refers to the socket and the buffer group this struct owns;
        // both outlive it (`drop` cancels it and waits for its last completion), and the
        // owners of the buffers in the group keep them until the kernel gives them back.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        // Armed once queued: a later enter would submit it even if this one fails.
        self.armed = true;
        self.ring.submit()?;
        Ok(())
    }

    /// Waits for at least one completion (up to `timeout`) and passes each to `on` in order.
    /// A receive the kernel ended (for want of buffers) is re-armed by the caller, after it
    /// has given buffers back ([`Self::arm`]).
    fn wait(
        &mut self,
        timeout: Option<Duration>,
        mut on: impl FnMut(Event) -> io::Result<()>,
    ) -> io::Result<()> {
        let ts = timeout.map(types::Timespec::from);
        loop {
            let r = match &ts {
                None => self.ring.submit_and_wait(1),
                Some(ts) => {
                    let args = types::SubmitArgs::new().timespec(ts);
                    self.ring.submitter().submit_with_args(1, &args)
                }
            };
            match r {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no bytes arrived for {:?}", timeout.unwrap_or_default()),
                    ));
                }
                Err(e) => return Err(e),
            }
        }
        let mut result = Ok(());
        for cqe in self.ring.completion() {
            if cqe.user_data() != RECV {
                continue;
            }
            let (res, flags) = (cqe.result(), cqe.flags());
            if !cqueue::more(flags) {
                self.armed = false;
            }
            let event = match res {
                0 => Event::Eof,
                r if r == -libc::ENOBUFS => continue, // no buffer was free: re-armed below
                r if r < 0 => {
                    result = result.and(Err(io::Error::from_raw_os_error(-r)));
                    continue;
                }
                r => match cqueue::buffer_select(flags).filter(|b| *b < self.count) {
                    Some(buf) => Event::Data {
                        buf,
                        n: r as usize,
                        more: cqueue::buffer_more(flags),
                    },
                    None => {
                        result = result.and(Err(io::Error::other(format!(
                            "io_uring receive of {r} bytes named no valid buffer (flags {flags:#x})"
                        ))));
                        continue;
                    }
                },
            };
            if result.is_ok() {
                result = on(event);
            }
        }
        result
    }

    /// Cancels the armed receive and waits for its last completion (the socket is shut down
    /// first when `shut`); false if that could not be confirmed.
    fn disarm(&mut self, shut: bool) -> bool {
        if !self.armed {
            return true;
        }
        if shut {
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
        }
        let sqe = opcode::AsyncCancel::new(RECV).build().user_data(CANCEL);
        // SAFETY: a cancel refers to no memory.
        if unsafe { self.ring.submission().push(&sqe) }.is_err() {
            return false;
        }
        // A cancel completes at once; allow 10 s in waits of 1 s (EINTR and timeouts count).
        let ts = types::Timespec::from(Duration::from_secs(1));
        for _ in 0..10 {
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => continue,
                Err(_) => return false,
            }
            for cqe in self.ring.completion() {
                if cqe.user_data() == RECV && !cqueue::more(cqe.flags()) {
                    self.armed = false;
                }
            }
            if !self.armed {
                return true;
            }
        }
        false
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        if self.disarm(false) && self.unregister() {
            // SAFETY: no request is in flight and the buffer ring is unregistered, so the
            // kernel no longer refers to the entries.
            unsafe { ManuallyDrop::drop(&mut self.entries) };
        }
        // Otherwise the entries are leaked: the kernel might still read them.
    }
}

/// Payloads a [`RecvQueue`] holds posted at once: one. Measured on loopback (Intel kind,
/// docs/BENCHMARKS.md, 2026-12-04): the node delivered 35.4-40.3 Gbit/s with one payload
/// posted, 33.9-38.3 with two and 31.8-35.1 with eight (alternating runs); a full buffer
/// ends the receive (`ENOBUFS`) and the next payload's post re-arms it.
pub const QUEUE_DEPTH: u16 = 1;

/// Buffer ring entries of a [`RecvQueue`]: the pieces of its payloads handed to the kernel.
const RING_ENTRIES: u16 = 64;

/// A buffer whose bytes stay where they are while it is owned by a [`RecvQueue`].
///
/// # Safety
///
/// `bytes` returns the same memory on every call, and moving the value does not move or
/// free that memory (the bytes live elsewhere: a pool, a heap allocation), so the kernel
/// may write it through its address until the queue hands the value back. `tally` returns
/// memory disjoint from those bytes: the piece callback holds it mutably while it reads a
/// piece of them.
pub unsafe trait StableBuf {
    /// What the piece callback of [`RecvQueue::wait`] updates as pieces land (a running
    /// checksum): never the bytes themselves.
    type Tally;
    /// The bytes a payload is received into.
    fn bytes(&mut self) -> &mut [u8];
    /// The payload's tally.
    fn tally(&mut self) -> &mut Self::Tally;
}

/// A payload in the queue: where its bytes go, how many arrived, how many were handed to
/// the kernel (as pieces).
struct Posted<B> {
    buf: B,
    at: *mut u8,
    len: usize,
    filled: usize,
    handed: usize,
}

/// A piece of a payload in the buffer ring: its buffer id, length and bytes filled.
struct Piece {
    bid: u16,
    len: usize,
    filled: usize,
}

/// How a [`RecvQueue`] hands payloads to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Largest piece of a payload one ring entry covers.
    pub piece: usize,
    /// The most bytes handed to the kernel and not yet received (at least one piece).
    pub ahead: usize,
}

impl Window {
    /// Whole payloads, all of them handed over at once (up to [`QUEUE_DEPTH`]).
    pub const WHOLE: Self = Self {
        piece: u32::MAX as usize,
        ahead: usize::MAX,
    };
}

/// Payloads received in order straight into buffers it owns while they are posted; see the
/// module docs. Each payload is handed to the kernel in pieces, at most [`Window::ahead`]
/// bytes before the bytes that arrived, so the kernel never copies more than that between
/// two waits: the bytes a piece callback checksums were written moments before. Dropping it
/// (or [`RecvQueue::abandon`]) makes sure the kernel has let go of every posted buffer
/// before handing it back or dropping it.
pub struct RecvQueue<B: StableBuf> {
    core: Core,
    posted: VecDeque<Posted<B>>,
    /// Pieces in the ring, in the order the kernel fills them.
    pieces: VecDeque<Piece>,
    window: Window,
    next_bid: u16,
    /// A receive failed: nothing is posted or received again.
    poisoned: bool,
}

impl<B: StableBuf> std::fmt::Debug for RecvQueue<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvQueue")
            .field("posted", &self.posted.len())
            .field("pieces", &self.pieces.len())
            .field("remaining", &self.remaining())
            .field("window", &self.window)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl<B: StableBuf> RecvQueue<B> {
    /// Sets up the ring over `sock` (fails where io_uring is unavailable or lacks
    /// incremental buffers: Linux before 6.12, or a seccomp policy that refuses it), handing
    /// whole payloads to the kernel.
    pub fn new(sock: TcpStream) -> io::Result<Self> {
        Self::with_window(sock, Window::WHOLE)
    }

    /// Like [`Self::new`], handing payloads over as `window` says.
    pub fn with_window(sock: TcpStream, window: Window) -> io::Result<Self> {
        if window.piece == 0 || window.piece > u32::MAX as usize || window.ahead == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("window {window:?}: pieces of 1 byte to 4 GiB, ahead at least 1 byte"),
            ));
        }
        Ok(Self {
            core: Core::new(sock, RING_ENTRIES, true)?,
            posted: VecDeque::new(),
            pieces: VecDeque::new(),
            window,
            next_bid: 0,
            poisoned: false,
        })
    }

    /// The socket (for socket options).
    pub fn socket(&self) -> &TcpStream {
        &self.core.sock
    }

    /// Payloads posted and not yet complete.
    pub fn len(&self) -> usize {
        self.posted.len()
    }

    /// Nothing is posted.
    pub fn is_empty(&self) -> bool {
        self.posted.is_empty()
    }

    /// No more payloads can be posted now.
    pub fn is_full(&self) -> bool {
        self.posted.len() >= usize::from(QUEUE_DEPTH)
    }

    /// Bytes of the posted payloads not yet received.
    pub fn remaining(&self) -> usize {
        self.posted.iter().map(|p| p.len - p.filled).sum()
    }

    /// Posts `buf` as the next payload (its whole `bytes()`, handed to the kernel in pieces of
    /// under 4 GiB); gives it back with the reason when the queue is full, failed earlier, or
    /// the payload is empty.
    pub fn post(&mut self, mut buf: B) -> Result<(), (B, io::Error)> {
        let bytes = buf.bytes();
        let (at, len) = (bytes.as_mut_ptr(), bytes.len());
        let refuse = if self.poisoned {
            Some("this io_uring receiver failed earlier and is not used again".to_string())
        } else if self.is_full() {
            Some(format!("{QUEUE_DEPTH} payloads are posted already"))
        } else if len == 0 {
            Some("an empty payload cannot be posted".to_string())
        } else {
            None
        };
        if let Some(why) = refuse {
            return Err((buf, io::Error::new(io::ErrorKind::InvalidInput, why)));
        }
        self.posted.push_back(Posted {
            buf,
            at,
            len,
            filled: 0,
            handed: 0,
        });
        self.hand_over();
        Ok(())
    }

    /// Hands the next pieces of the posted payloads to the kernel, while fewer than
    /// [`Window::ahead`] bytes are handed over and not received (at least one piece, so a
    /// window smaller than a piece still makes progress) and ring entries are free.
    fn hand_over(&mut self) {
        let mut ahead: usize = self.pieces.iter().map(|p| p.len - p.filled).sum();
        let mut pushed = false;
        for p in self.posted.iter_mut() {
            while p.handed < p.len && self.pieces.len() < usize::from(RING_ENTRIES) {
                // At most `window.piece`, which fits a ring entry (`with_window` checks it).
                let len = (p.len - p.handed).min(self.window.piece);
                if !self.pieces.is_empty() && ahead + len > self.window.ahead {
                    break;
                }
                let bid = self.next_bid;
                self.next_bid = (bid + 1) % RING_ENTRIES;
                // The piece lies inside the payload (`handed + len <= len`); its address
                // stays valid while the payload is posted (`StableBuf`).
                let addr = p.at.wrapping_add(p.handed) as u64;
                self.core.push(addr, len as u32, bid);
                self.pieces.push_back(Piece {
                    bid,
                    len,
                    filled: 0,
                });
                (p.handed, ahead, pushed) = (p.handed + len, ahead + len, true);
            }
            if p.handed < p.len {
                break; // pieces go over in payload order
            }
        }
        if pushed {
            self.core.publish();
        }
    }

    /// Waits (up to `stall`) for the posted payloads' next bytes: each completed piece goes
    /// to `piece` with its payload's tally and offset, in order (the tally only: a `&mut`
    /// to the buffer could reach the bytes the piece borrows), and each payload that is
    /// complete goes to `done`. After an error, call [`Self::abandon`] to get the posted
    /// buffers back.
    pub fn wait(
        &mut self,
        stall: Duration,
        mut piece: impl FnMut(&mut B::Tally, usize, &[u8]),
        mut done: impl FnMut(B),
    ) -> io::Result<()> {
        if self.poisoned || self.posted.is_empty() {
            return Err(io::Error::other(match self.poisoned {
                true => "this io_uring receiver failed earlier and is not used again",
                false => "nothing is posted to receive into",
            }));
        }
        let deadline = std::time::Instant::now() + stall;
        loop {
            if !self.core.armed {
                self.core.arm()?;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no bytes arrived for {stall:?}"),
                ));
            }
            let before = self.remaining();
            let closed = self.wait_once(left, &mut piece, &mut done)?;
            self.hand_over();
            match self.posted.front() {
                // Closed right after the last posted payload: a later wait reports it.
                None if closed => return Ok(()),
                Some(p) if closed => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "connection closed after {} of {} payload bytes",
                            p.filled, p.len
                        ),
                    ));
                }
                // Only a receive ended for want of buffers: wait again, within `stall`.
                _ if self.remaining() == before => continue,
                _ => return Ok(()),
            }
        }
    }

    /// One wait of [`Self::wait`]; returns whether the peer closed the connection.
    fn wait_once(
        &mut self,
        timeout: Duration,
        piece: &mut impl FnMut(&mut B::Tally, usize, &[u8]),
        done: &mut impl FnMut(B),
    ) -> io::Result<bool> {
        let (posted, pieces, mut closed) = (&mut self.posted, &mut self.pieces, false);
        self.core.wait(Some(timeout), |ev| {
            let Event::Data { buf, n, more } = ev else {
                closed = true;
                return Ok(());
            };
            let (Some(p), Some(q)) = (posted.front_mut(), pieces.front_mut()) else {
                return Err(io::Error::other(format!(
                    "io_uring placed {n} bytes with no payload posted"
                )));
            };
            // Pieces fill in order, and a buffer takes more exactly while it is not full.
            if buf != q.bid || q.filled + n > q.len || more != (q.filled + n < q.len) {
                return Err(io::Error::other(format!(
                    "io_uring placed {n} bytes in buffer {buf} (kept: {more}) while piece {} had {} of {}",
                    q.bid, q.filled, q.len
                )));
            }
            let filled = p.filled;
            // SAFETY: these `n` bytes of the posted payload are complete (their completion
            // is here; the front piece starts at the payload's first unfilled byte), and the
            // kernel consumes a buffer's bytes once, in order: it does not write them again.
            let bytes = unsafe { std::slice::from_raw_parts(p.at.add(filled), n) };
            piece(p.buf.tally(), filled, bytes);
            (p.filled, q.filled) = (filled + n, q.filled + n);
            if q.filled == q.len {
                pieces.pop_front();
            }
            if p.filled == p.len {
                let p = posted.pop_front().expect("the front payload");
                done(p.buf);
            }
            Ok(())
        })?;
        Ok(closed)
    }

    /// After a failed receive: shuts the socket, cancels the receive and unregisters the
    /// buffers, then hands back every posted buffer. If the kernel's release of them cannot
    /// be confirmed (the ring itself failed), the process aborts: a buffer handed back could
    /// still be written, and one kept back would leave its owner waiting forever.
    pub fn abandon(&mut self) -> Vec<B> {
        self.poisoned = true;
        if !self.core.disarm(true) || !self.core.unregister() {
            eprintln!("shardwire: an io_uring receive could not be cancelled; aborting");
            std::process::abort();
        }
        self.pieces.clear();
        self.posted.drain(..).map(|p| p.buf).collect()
    }
}

impl<B: StableBuf> Drop for RecvQueue<B> {
    fn drop(&mut self) {
        // The buffers are dropped (or leaked) only once the kernel cannot write them.
        drop(self.abandon());
    }
}

#[cfg(test)]
mod tests;
