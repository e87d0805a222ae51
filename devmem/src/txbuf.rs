//! The TX memory of a devmem sender: one dma-buf (a udmabuf, mapped read-write) split into
//! equal slots, one per data connection, each used as a ring whose space comes back only
//! when the kernel reports the zerocopy send that used it as complete (reference devmem.md
//! §5.4: "do not rewrite the dma-buf region until its send has completed").
//!
//! [`TxSlot::reserve`] hands out the next free contiguous bytes at the ring's head for
//! filling ([`TxSlot::fill`] fills them between the dma-buf's CPU write sync);
//! [`TxSlot::sent`] records that the next zerocopy send (numbered by the kernel from 0 per
//! socket) used `n` of them; [`TxSlot::complete`] marks the completed range's sends
//! done and frees the bytes of the oldest sends while they are done: completions are in send
//! order as a rule, not always (the kernel's msg_zerocopy.rst: "Notifications may arrive out
//! of order on retransmission and socket teardown"), so a later send's completion never
//! frees an earlier send's bytes. The slot owns its range of the buffer exclusively (a slot is handed
//! out once until dropped), which is what makes the mutable access sound.
#![allow(unsafe_code)] // one mutable slice into the mapping per reserve: SAFETY below

use std::collections::VecDeque;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::mem::DmabufMem;
use crate::tx::Completion;

/// How long a slot dropped with sends not completed stays out of use: its connection's
/// socket is reset by then (the sender resets a failed connection, linger 0), so neither the
/// socket's retransmit queue nor the NIC reads its bytes any more.
pub const QUARANTINE: Duration = Duration::from_secs(10);

/// A quarantined slot: its index, the end of its quarantine, and its socket's liveness.
type Quarantined = (usize, Instant, Option<Weak<dyn Send + Sync>>);

/// A TX dma-buf split into per-connection slots.
#[derive(Debug)]
pub struct TxBuffer {
    mem: DmabufMem,
    slot_len: usize,
    free: Mutex<Vec<usize>>,
    /// Slots dropped with sends not completed: free again once both the time has passed and
    /// the socket they were tied to ([`TxSlot::tie`]) is closed.
    quarantined: Mutex<Vec<Quarantined>>,
    /// The TX binding id; 0 means "no binding": iovec bases are then addresses (the kernel's
    /// ordinary MSG_ZEROCOPY path, which tests use on loopback).
    id: std::sync::atomic::AtomicU32,
}

impl TxBuffer {
    /// A udmabuf of `len` bytes in `slots` slots, for a TX binding.
    pub fn udmabuf(len: usize, slots: usize) -> io::Result<Arc<Self>> {
        Self::new(DmabufMem::udmabuf_rw(len)?, slots)
    }

    /// A memfd of `len` bytes in `slots` slots (no dma-buf: binding id 0, for tests).
    pub fn memfd(len: usize, slots: usize) -> io::Result<Arc<Self>> {
        Self::new(DmabufMem::memfd("shardwire-tx", len)?, slots)
    }

    fn new(mem: DmabufMem, slots: usize) -> io::Result<Arc<Self>> {
        let slots = slots.max(1);
        let slot_len = (mem.len() / slots) & !4095;
        if slot_len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a TX buffer of {} bytes cannot hold {slots} slots of 4 KiB",
                    mem.len()
                ),
            ));
        }
        Ok(Arc::new(Self {
            mem,
            slot_len,
            free: Mutex::new((0..slots).rev().collect()),
            quarantined: Mutex::new(Vec::new()),
            id: std::sync::atomic::AtomicU32::new(0),
        }))
    }

    /// The dma-buf fd (for `bind-tx`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.mem.fd()
    }

    /// Record the TX binding id that sends name.
    pub fn set_binding_id(&self, id: u32) {
        self.id.store(id, std::sync::atomic::Ordering::Relaxed);
    }

    /// The TX binding id (0: none, bases are addresses).
    pub fn binding_id(&self) -> u32 {
        self.id.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes per slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Take a free slot; `None` when every slot is in use (or quarantined: [`QUARANTINE`]).
    pub fn slot(self: &Arc<Self>) -> Option<TxSlot> {
        self.slot_at(Instant::now())
    }

    /// [`TxBuffer::slot`] at time `now`.
    fn slot_at(self: &Arc<Self>, now: Instant) -> Option<TxSlot> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        self.quarantined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(i, until, socket)| {
                let over = *until <= now && socket.as_ref().is_none_or(|w| w.strong_count() == 0);
                if over {
                    free.push(*i);
                }
                !over
            });
        let i = free.pop()?;
        Some(TxSlot {
            buf: Arc::clone(self),
            index: i,
            base: i * self.slot_len,
            written: 0,
            freed: 0,
            pending: VecDeque::new(),
            next_send: 0,
            reserved: 0,
            socket: None,
        })
    }
}

/// One connection's ring in a [`TxBuffer`].
#[derive(Debug)]
pub struct TxSlot {
    buf: Arc<TxBuffer>,
    index: usize,
    base: usize,
    /// Bytes committed to sends, ever.
    written: u64,
    /// Bytes whose sends completed, ever.
    freed: u64,
    /// (send number, `written` after it, completed), oldest first.
    pending: VecDeque<(u32, u64, bool)>,
    next_send: u32,
    /// Bytes of the last reservation ([`TxSlot::reserve`]): what the next send may use.
    reserved: u64,
    /// Alive while the socket that sends from this slot is open ([`TxSlot::tie`]).
    socket: Option<Weak<dyn Send + Sync>>,
}

impl TxSlot {
    fn len(&self) -> u64 {
        self.buf.slot_len as u64
    }

    /// Ties the slot to a socket: `alive` has a strong reference wherever a descriptor of the
    /// socket is open. A slot dropped with sends not completed is reused only once the socket
    /// is closed too, not merely after [`QUARANTINE`]: a socket still open (a second
    /// descriptor, held by a task busy elsewhere) keeps its unsent bytes queued, and the
    /// kernel sends them from the slot's pages when its peer reads again.
    pub fn tie(&mut self, alive: Weak<dyn Send + Sync>) {
        self.socket = Some(alive);
    }

    /// Bytes sent and not yet completed.
    pub fn in_flight(&self) -> u64 {
        self.written - self.freed
    }

    /// The slot's size in bytes.
    pub fn capacity(&self) -> u64 {
        self.len()
    }

    /// The TX binding id sends must name (0: none, iovec bases are addresses).
    pub fn binding_id(&self) -> u32 {
        self.buf.binding_id()
    }

    /// The next free contiguous bytes at the head, at most `want`: the value to put in the
    /// iovec for them (a dma-buf offset, or an address with binding id 0) and the bytes to
    /// fill. `None` while the ring is full (wait for completions). Writes into a real dma-buf
    /// need its CPU write sync around them: [`TxSlot::fill`] does both.
    pub fn reserve(&mut self, want: usize) -> Option<(u64, &mut [u8])> {
        let len = self.len();
        let pos = self.written % len;
        let room = (len - self.in_flight()).min(len - pos);
        let n = room.min(want as u64) as usize;
        self.reserved = n as u64;
        if n == 0 {
            return None;
        }
        let off = self.base + pos as usize;
        let iov = if self.buf.binding_id() == 0 {
            self.buf.mem.addr() + off as u64
        } else {
            off as u64
        };
        // SAFETY: `off..off + n` lies in this slot (pos + n <= slot_len), which no other
        // TxSlot owns; within the slot these bytes are free: they are past every byte whose
        // send has not completed (in_flight + n <= slot_len), so neither the kernel nor an
        // earlier reservation uses them; the slice borrows `self` mutably, so it cannot
        // outlive the reservation.
        let bytes = unsafe { self.buf.mem.page_mut(off, n) };
        Some((iov, bytes))
    }

    /// Reserves up to `want` bytes ([`TxSlot::reserve`]) and has `write` fill them, between
    /// the dma-buf's CPU write sync ([`DmabufMem::begin_cpu_write`], then `end_cpu_write`
    /// once `write` returned, whatever it returned), so that on a platform whose DMA is not
    /// cache-coherent the NIC sends what was written. Returns the iovec value for the bytes
    /// and how many `write` filled (from the start); `None` while the ring is full. One
    /// sync pair per fill: the exporter syncs the whole buffer (udmabuf), so fill in large
    /// pieces.
    ///
    /// # Panics
    /// If `write` reports more bytes than it was given.
    pub fn fill(
        &mut self,
        want: usize,
        write: impl FnOnce(&mut [u8]) -> io::Result<usize>,
    ) -> io::Result<Option<(u64, usize)>> {
        let buf = Arc::clone(&self.buf);
        let Some((iov, bytes)) = self.reserve(want) else {
            return Ok(None);
        };
        let len = bytes.len();
        buf.mem.begin_cpu_write()?;
        let wrote = write(bytes);
        let ended = buf.mem.end_cpu_write();
        let n = wrote?;
        ended?;
        assert!(n <= len, "TxSlot::fill: {n} bytes written into {len}");
        Ok(Some((iov, n)))
    }

    /// The next zerocopy send used `n` bytes at the head, of the last reservation.
    ///
    /// # Panics
    /// If `n` is more than the last reservation left (a send reports at most the bytes it
    /// was given): counting more would hand out bytes a send still uses.
    pub fn sent(&mut self, n: usize) {
        let n = n as u64;
        assert!(
            n <= self.reserved,
            "TxSlot::sent({n}) after a reservation of {} bytes",
            self.reserved
        );
        self.reserved -= n;
        self.written += n;
        self.pending
            .push_back((self.next_send, self.written, false));
        self.next_send = self.next_send.wrapping_add(1);
    }

    /// Sends `c.lo..=c.hi` (in wrapping order) completed; the bytes of the oldest sends are
    /// free again while they are done (a send's bytes are freed only with every earlier
    /// send's: the ring frees from its tail).
    pub fn complete(&mut self, c: Completion) {
        let span = c.hi.wrapping_sub(c.lo);
        for (seq, _, done) in self.pending.iter_mut() {
            if seq.wrapping_sub(c.lo) <= span {
                *done = true;
            }
        }
        while let Some(&(_, end, true)) = self.pending.front() {
            self.freed = end;
            self.pending.pop_front();
        }
    }
}

impl Drop for TxSlot {
    fn drop(&mut self) {
        // The owner drains completions before dropping a slot of a healthy connection. One
        // dropped with sends not completed (a failed connection, a drain that timed out) may
        // still be read by its socket's retransmit queue or the NIC: rewriting it for
        // another connection would send that one's bytes in this one's stream, so it waits.
        if self.in_flight() > 0 {
            let until = Instant::now() + QUARANTINE;
            let mut q = self
                .buf
                .quarantined
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            q.push((self.index, until, self.socket.take()));
            return;
        }
        self.buf
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(lo: u32, hi: u32) -> Completion {
        Completion {
            lo,
            hi,
            copied: false,
        }
    }

    #[test]
    fn the_ring_hands_out_space_only_after_completions() {
        let b = TxBuffer::memfd(2 * 8192, 2).unwrap();
        b.set_binding_id(7);
        let mut s = b.slot().unwrap();
        let mut t = b.slot().unwrap();
        assert!(b.slot().is_none(), "two slots only");
        // Slot 0 at offset 0, slot 1 at 8192: offsets, since the binding id is set.
        let (o, bytes) = s.reserve(5000).unwrap();
        assert_eq!((o, bytes.len()), (0, 5000));
        bytes.fill(1);
        s.sent(5000);
        assert_eq!(t.reserve(10).unwrap().0, 8192);
        // 3192 left before the end of the slot, then full.
        let (o, bytes) = s.reserve(5000).unwrap();
        assert_eq!((o, bytes.len()), (5000, 3192));
        s.sent(3000);
        s.sent(192);
        assert!(s.reserve(1).is_none(), "full until a completion");
        s.complete(c(0, 0));
        let (o, bytes) = s.reserve(9000).unwrap();
        assert_eq!(
            (o, bytes.len()),
            (0, 5000),
            "wrapped; only the completed 5000 are free"
        );
        s.sent(5000);
        s.complete(c(1, 3));
        assert_eq!(s.in_flight(), 0);
        drop(s);
        assert!(b.slot().is_some(), "a dropped slot is free again");
    }

    /// A slot tied to a socket that is still open after the quarantine (a second descriptor
    /// held elsewhere) stays out of use until the socket is closed.
    #[test]
    fn a_slot_tied_to_an_open_socket_waits_for_it_to_close() {
        let b = TxBuffer::memfd(8192, 1).unwrap();
        let mut s = b.slot().unwrap();
        let socket: Arc<dyn Send + Sync> = Arc::new(());
        s.tie(Arc::downgrade(&socket));
        s.reserve(100).unwrap().1.fill(3);
        s.sent(100);
        drop(s);
        let later = Instant::now() + QUARANTINE + Duration::from_secs(1);
        assert!(b.slot_at(later).is_none(), "its socket is still open");
        drop(socket);
        assert!(b.slot_at(later).is_some(), "closed and past the quarantine");
    }

    #[test]
    fn a_slot_dropped_with_sends_in_flight_is_not_handed_out_until_its_quarantine_ends() {
        // Before, it was free at once: the next connection's bytes were written where the
        // old socket's unacknowledged sends still pointed.
        let b = TxBuffer::memfd(8192, 1).unwrap();
        let mut s = b.slot().unwrap();
        s.reserve(100).unwrap().1.fill(3);
        s.sent(100);
        drop(s);
        let now = Instant::now();
        assert!(b.slot_at(now).is_none(), "quarantined");
        assert!(b.slot_at(now + QUARANTINE / 2).is_none());
        let again = b.slot_at(now + QUARANTINE + Duration::from_millis(1));
        assert!(again.is_some(), "free once its quarantine is over");
        // Drained first: free at once.
        let mut s = again.unwrap();
        s.reserve(100).unwrap();
        s.sent(100);
        s.complete(c(0, 0));
        drop(s);
        assert!(b.slot_at(now).is_some());
    }

    #[test]
    fn a_completion_out_of_order_frees_nothing_before_the_earlier_sends_complete() {
        // Before, completing send 2 first freed sends 0 and 1 too, while a retransmit could
        // still read them: the next reservation handed their bytes out to be rewritten.
        let b = TxBuffer::memfd(8192, 1).unwrap();
        let mut s = b.slot().unwrap();
        for _ in 0..3 {
            s.reserve(1000).unwrap();
            s.sent(1000);
        }
        s.complete(c(2, 2));
        assert_eq!(s.in_flight(), 3000, "0 and 1 are not complete");
        s.complete(c(0, 0));
        assert_eq!(
            s.in_flight(),
            2000,
            "send 0 is free; 1 holds 2's bytes back"
        );
        s.complete(c(1, 1));
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.reserve(8192).unwrap().0, b.mem.addr() + 3000);
    }

    #[test]
    #[should_panic(expected = "after a reservation of 100 bytes")]
    fn a_send_larger_than_its_reservation_is_refused() {
        let b = TxBuffer::memfd(8192, 1).unwrap();
        let mut s = b.slot().unwrap();
        s.reserve(100).unwrap();
        s.sent(10_000);
    }

    #[test]
    fn a_fill_is_bracketed_with_the_dma_buf_write_sync() {
        // Before, no CPU write into the TX buffer was ever synced: on a platform whose DMA
        // is not cache-coherent the NIC could send stale bytes.
        let b = TxBuffer::memfd(8192, 1).unwrap();
        let mut s = b.slot().unwrap();
        crate::mem::take_syncs();
        let (iov, n) = s
            .fill(100, |bytes| {
                assert_eq!(crate::mem::take_syncs(), [crate::mem::SYNC_WRITE[0]]);
                bytes[..60].fill(9);
                Ok(60)
            })
            .unwrap()
            .unwrap();
        assert_eq!((iov, n), (b.mem.addr(), 60));
        assert_eq!(crate::mem::take_syncs(), [crate::mem::SYNC_WRITE[1]]);
        // A failed write still ends the sync; a full ring takes none.
        let e = s.fill(100, |_| Err(io::Error::other("no"))).unwrap_err();
        assert_eq!(e.to_string(), "no");
        assert_eq!(crate::mem::take_syncs(), crate::mem::SYNC_WRITE);
        s.reserve(8192).unwrap();
        s.sent(8192);
        assert!(s.fill(1, |_| Ok(1)).unwrap().is_none());
        assert!(crate::mem::take_syncs().is_empty());
    }

    #[test]
    fn binding_id_zero_gives_addresses() {
        let b = TxBuffer::memfd(8192, 1).unwrap();
        let mut s = b.slot().unwrap();
        let (a, _) = s.reserve(10).unwrap();
        assert_eq!(a, b.mem.addr());
    }

    #[test]
    fn too_many_slots_is_an_error() {
        assert!(TxBuffer::memfd(8192, 4).is_err());
    }
}
