//! A kernel-faithful devmem RX emulator (DESIGN §8.4) for machines without a devmem NIC.
//!
//! Real TCP bytes from a real socket are "DMA'd" (a vectored `recvmsg`) into 4 KiB net_iov
//! pages of a memfd standing in for the dma-buf, at offsets taken from a freelist shared by
//! every socket of the binding. [`EmuSocket::recv_frags`] then describes them exactly as the
//! kernel's `tcp_recvmsg_dmabuf` does (reference devmem.md §4.4–4.5):
//!
//! * one `SCM_DEVMEM_DMABUF` cmsg per frag (offset, size, token, dmabuf id), written in the
//!   kernel's layout into the caller's control buffer, never truncated: when the buffer is
//!   full the call returns short, and `ETOOSMALL` (525) when not even one cmsg fits and a
//!   frag would be handed out (ordinary data after unbind, and EOF, need no cmsg);
//! * a socket error met after bytes were handed out ends the call short, and the next call
//!   returns it (as `tcp_recvmsg` does; the emulator's own `recv` consumed `sk_err`);
//! * the request length caps devmem bytes too; a frag cut by it continues in the next call
//!   with a new token (each token holds its own reference on the net_iov);
//! * tokens are per socket, allocated lowest-free from 1 (an `XA_FLAGS_ALLOC1` xarray), so
//!   after out-of-order returns they are not consecutive;
//! * `SO_DEVMEM_DONTNEED` semantics: EINVAL for 0 or more than 128 ranges, frags past 1024
//!   per call silently not freed, unknown or repeated tokens skipped and not counted, the
//!   return value is the number freed;
//! * optionally some packets arrive whole in the linear part (`SCM_DEVMEM_LINEAR`, bytes
//!   copied into the iov), as when header split fails for them;
//! * pool exhaustion: with no free net_iov, no bytes can land; `recv_frags` waits (the NIC
//!   would drop and TCP retransmit), so a receiver that does not return tokens stalls its
//!   peers: backpressure, never loss. Net_iovs are taken only once the socket has bytes to
//!   land (as a NIC fills pages only as packets arrive): a reader still waiting for its
//!   bytes holds none, and EOF or a socket error end the call at once, pool empty or not.
//!   The wait for bytes is the kernel's own (a blocking `MSG_PEEK | MSG_TRUNC`, which copies
//!   nothing, so `SO_RCVLOWAT`, `SO_RCVTIMEO` and `O_NONBLOCK` apply as to `recvmsg`); the
//!   wait for the pool, and a wait for bytes again after another handle of the socket took
//!   those seen, get what is left of `SO_RCVTIMEO` (nothing with `O_NONBLOCK`), then the call
//!   fails with `EAGAIN`, as the kernel's does when nothing arrived in time (the bytes stay
//!   in the socket for the next call);
//! * closing the socket releases its outstanding tokens and queued packets.
//!
//! Several NICs, each with its own bindings, and the steering table placing each flow on a
//! queue (so in one binding's dma-buf, or in host memory) are in [`host`].
//!
//! Our real parser ([`crate::cmsg`]), token batching ([`crate::TokenBatcher`]) and gather
//! ([`crate::gather`]) run unchanged on its output: it implements [`crate::DevmemRecv`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io::{self, IoSliceMut, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::cmsg::{CMSG_HDR_LEN, DMABUF_CMSG_LEN, DMABUF_CMSG_SPACE as CMSG_SPACE, synth};
use crate::mem::DmabufMem;
use crate::socket::{DEFAULT_CONTROL_LEN, DevmemError, RecvBatch, TokenBatcher};
use crate::{
    DevmemRecv, MAX_DONTNEED_FRAGS, MAX_DONTNEED_TOKENS, SO_DEVMEM_DMABUF, SO_DEVMEM_LINEAR, sys,
};

/// Size of one net_iov (PAGE_SIZE; 7.3+ can configure larger ones).
pub const NIOV_SIZE: usize = 4096;
/// Fewest net_iovs a binding may have (a few packets per socket must fit).
pub const MIN_NIOVS: usize = 16;
/// Most net_iovs a binding may have: each is named by a `u32` index, and a token slot holds
/// `index + 1` in a `u32`.
pub const MAX_NIOVS: usize = u32::MAX as usize;
/// Most net_iovs one fill takes (the NIC refills its ring in bursts).
const FILL_BURST: usize = 64;
/// Longest single wait for a free net_iov before the pool is looked at again.
const POOL_POLL: Duration = Duration::from_millis(100);

/// Knobs of the emulated NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmuConfig {
    /// Payload bytes per packet, at most [`NIOV_SIZE`] (a NIC with a 4 KiB buffer and a
    /// 4 KiB MTU fills whole pages; 1448 models a 1500-byte MTU).
    pub frag_max: usize,
    /// Every Nth packet lands in the linear part (`SCM_DEVMEM_LINEAR`); 0 = never.
    pub linear_every: u64,
}

impl Default for EmuConfig {
    fn default() -> Self {
        Self {
            frag_max: NIOV_SIZE,
            linear_every: 0,
        }
    }
}

/// Errors creating an emulated binding.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// The memfd standing in for the dma-buf could not be created or mapped.
    #[error("emulated dma-buf of {bytes} bytes: {source}")]
    Memory {
        /// Requested size.
        bytes: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Too small to hold [`MIN_NIOVS`] net_iovs.
    #[error("emulated dma-buf of {bytes} bytes is below the minimum of {min} bytes")]
    TooSmall {
        /// Requested size.
        bytes: usize,
        /// The minimum.
        min: usize,
    },
    /// More net_iovs than a `u32` index (and a token's `niov + 1`) can name.
    #[error(
        "emulated dma-buf of {bytes} bytes is above the maximum of {max} bytes \
         ({MAX_NIOVS} net_iovs of {NIOV_SIZE} bytes); ask for less memory"
    )]
    TooLarge {
        /// Requested size.
        bytes: usize,
        /// The maximum.
        max: usize,
    },
    /// `frag_max` out of 1..=4096.
    #[error("emulated frag size {0} is outside 1..={NIOV_SIZE}")]
    FragSize(usize),
    /// The connection's addresses could not be read (its flow is unknown).
    #[error("getsockname/getpeername of an emulated devmem connection: {0}")]
    Socket(#[source] io::Error),
}

/// The net_iov freelist, built as it is used: a binding near [`MAX_NIOVS`] costs nothing until
/// its pages are taken (an eager list of every index was 16 GiB for a 16 TiB binding).
#[derive(Debug)]
struct Pool {
    /// Net_iovs in the binding.
    count: u32,
    /// Net_iovs `next_fresh..count` were never taken; they are handed out in order after
    /// every returned one.
    next_fresh: u32,
    /// Returned net_iov indices; a stack, like the kernel's freelist, so reuse reorders
    /// offsets.
    free: Vec<u32>,
    /// References per net_iov ever taken (`next_fresh` of them): the queued packet's own plus
    /// one per outstanding token.
    refs: Vec<u32>,
    /// Set by [`EmuBinding::unbind`]: fills fail from then on.
    unbound: bool,
}

impl Pool {
    fn new(count: u32) -> Self {
        Self {
            count,
            next_fresh: 0,
            free: Vec::new(),
            refs: Vec::new(),
            unbound: false,
        }
    }

    /// Net_iovs free now: returned ones and those never taken.
    fn free_len(&self) -> usize {
        self.free.len() + (self.count - self.next_fresh) as usize
    }

    /// A free net_iov with one reference (its packet's): the last returned, else the lowest
    /// never taken (the order of the eager stack `count-1..=0` this replaces).
    fn pop(&mut self) -> Option<u32> {
        if let Some(i) = self.free.pop() {
            self.refs[i as usize] = 1;
            return Some(i);
        }
        if self.next_fresh == self.count {
            return None;
        }
        let i = self.next_fresh;
        self.next_fresh += 1;
        self.refs.push(1);
        Some(i)
    }
}

/// Counters of an emulated binding.
#[derive(Debug, Default)]
pub struct EmuStats {
    /// Fills that found no free net_iov and had to wait (pool exhaustion): each counted
    /// once, however long it waited and however often it was woken.
    pub exhausted_waits: AtomicU64,
    /// Frags handed out (DMABUF and LINEAR).
    pub frags: AtomicU64,
}

/// An emulated RX binding: the "dma-buf" (a memfd), its net_iov freelist, and the id that
/// frags carry as `dmabuf_id`.
#[derive(Debug)]
pub struct EmuBinding {
    id: u32,
    mem: DmabufMem,
    pool: Mutex<Pool>,
    freed: Condvar,
    stats: EmuStats,
}

impl EmuBinding {
    /// A binding with id `id` over a fresh memfd of `bytes` (rounded down to net_iovs): from
    /// [`MIN_NIOVS`] to [`MAX_NIOVS`] net_iovs.
    pub fn new(id: u32, bytes: usize) -> Result<Arc<Self>, EmuError> {
        let n = bytes / NIOV_SIZE;
        if n < MIN_NIOVS {
            return Err(EmuError::TooSmall {
                bytes,
                min: MIN_NIOVS * NIOV_SIZE,
            });
        }
        let Ok(count) = u32::try_from(n) else {
            return Err(EmuError::TooLarge {
                bytes,
                max: MAX_NIOVS * NIOV_SIZE,
            });
        };
        let mem = DmabufMem::memfd("shardwire-devmem-emu", n * NIOV_SIZE)
            .map_err(|source| EmuError::Memory { bytes, source })?;
        Ok(Arc::new(Self {
            id,
            mem,
            pool: Mutex::new(Pool::new(count)),
            freed: Condvar::new(),
            stats: EmuStats::default(),
        }))
    }

    /// The binding id frags carry.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The memory frags point into (for the gather). The emulator writes its pages while
    /// they are free, so reading it directly is `unsafe` ([`DmabufMem::copy_out`]);
    /// [`crate::gather::gather`] reads only the frags of a batch from this binding.
    pub fn mem(&self) -> &DmabufMem {
        &self.mem
    }

    /// Net_iovs in the binding.
    pub fn num_niovs(&self) -> usize {
        self.mem.len() / NIOV_SIZE
    }

    /// Net_iovs free now.
    pub fn free_niovs(&self) -> usize {
        self.lock().free_len()
    }

    /// Counters.
    pub fn stats(&self) -> &EmuStats {
        &self.stats
    }

    /// True once [`Self::unbind`] ran.
    pub fn is_unbound(&self) -> bool {
        self.lock().unbound
    }

    /// Unbind: no more net_iovs are handed out (the queues went back to ordinary pages:
    /// sockets read what arrives from now on as ordinary TCP, without cmsgs). Frags already
    /// handed out stay valid until their tokens come back, as in the kernel.
    pub fn unbind(&self) {
        self.lock().unbound = true;
        self.freed.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pop up to `want` free net_iovs, each with one reference (its packet's). With `wait`,
    /// waits while none is free, for at most what is left of the socket's receive timeout
    /// (`timeout`, read only once a wait starts; `None`: no limit; zero: no wait), then fails
    /// with `EAGAIN`, as the kernel's `recvmsg` does while the NIC drops what it cannot land.
    fn take(
        &self,
        want: usize,
        wait: bool,
        timeout: impl FnOnce() -> io::Result<Option<Duration>>,
        out: &mut Vec<u32>,
    ) -> io::Result<()> {
        let mut p = self.lock();
        let mut timeout = Some(timeout);
        let mut deadline = None;
        loop {
            if p.unbound {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the emulated binding was unbound",
                ));
            }
            if p.free_len() > 0 || !wait {
                break;
            }
            if let Some(read) = timeout.take() {
                // The first round of this fill's wait: counted here, once, not per round of
                // `POOL_POLL` or per wake-up by another socket's return.
                self.stats.exhausted_waits.fetch_add(1, Ordering::Relaxed);
                deadline = read()?.map(|t| Instant::now() + t);
            }
            let pause = match deadline {
                Some(d) => match d.saturating_duration_since(Instant::now()) {
                    left if left.is_zero() => {
                        return Err(io::Error::from_raw_os_error(libc::EAGAIN));
                    }
                    left => left.min(POOL_POLL),
                },
                None => POOL_POLL,
            };
            p = self
                .freed
                .wait_timeout(p, pause)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        for _ in 0..want {
            let Some(i) = p.pop() else { break };
            out.push(i);
        }
        Ok(())
    }

    fn get(&self, p: &mut Pool, niov: u32) {
        p.refs[niov as usize] += 1;
    }

    fn put(&self, p: &mut Pool, niov: u32) -> bool {
        let r = &mut p.refs[niov as usize];
        debug_assert!(*r > 0, "net_iov {niov} released more often than taken");
        *r -= 1;
        if *r == 0 {
            p.free.push(niov);
            true
        } else {
            false
        }
    }

    fn put_all(&self, niovs: impl IntoIterator<Item = u32>) {
        let mut p = self.lock();
        let mut any = false;
        for n in niovs {
            any |= self.put(&mut p, n);
        }
        drop(p);
        if any {
            self.freed.notify_all();
        }
    }
}

/// What is left at `start` of the receive timeout `timeout` (`None`: none).
fn left_of(timeout: Option<Duration>, start: Instant) -> Option<Duration> {
    timeout.map(|t| t.saturating_sub(start.elapsed()))
}

/// How long a call that began at `start` may still wait on `sock`: what is left of its
/// `SO_RCVTIMEO` (`None`: no limit), or nothing when it is `O_NONBLOCK` (as its `recvmsg`).
fn budget_left(sock: &TcpStream, start: Instant) -> io::Result<Option<Duration>> {
    if sys::is_nonblocking(sock.as_fd())? {
        return Ok(Some(Duration::ZERO));
    }
    Ok(left_of(sock.read_timeout()?, start))
}

/// A received packet not yet fully handed out.
#[derive(Debug)]
struct Packet {
    /// The net_iov it landed in; `None` when it landed in the linear part (`linear`).
    niov: Option<u32>,
    /// Linear bytes (packets that missed header split).
    linear: Vec<u8>,
    len: usize,
    consumed: usize,
}

/// The per-socket token table: an `XA_FLAGS_ALLOC1` xarray (lowest free id from 1).
#[derive(Debug, Default)]
struct Tokens {
    /// `slots[token - 1]` = net_iov + 1, or 0 when free.
    slots: Vec<u32>,
    free: BinaryHeap<Reverse<u32>>,
    outstanding: usize,
}

impl Tokens {
    fn alloc(&mut self, niov: u32) -> u32 {
        let t = match self.free.pop() {
            Some(Reverse(t)) => t,
            None => {
                self.slots.push(0);
                self.slots.len() as u32
            }
        };
        self.slots[t as usize - 1] = niov + 1;
        self.outstanding += 1;
        t
    }

    fn erase(&mut self, token: u32) -> Option<u32> {
        let slot = self.slots.get_mut((token as usize).checked_sub(1)?)?;
        if *slot == 0 {
            return None;
        }
        let niov = *slot - 1;
        *slot = 0;
        self.free.push(Reverse(token));
        self.outstanding -= 1;
        Some(niov)
    }
}

/// A TCP socket read through the emulated devmem path.
#[derive(Debug)]
pub struct EmuSocket {
    sock: TcpStream,
    binding: Arc<EmuBinding>,
    cfg: EmuConfig,
    control: Box<[u8]>,
    queue: VecDeque<Packet>,
    tokens: Tokens,
    packets: u64,
    scratch: Vec<u32>,
    /// Room for the peek that waits for bytes ([`Self::await_bytes`]): its length sets the
    /// wait's target, and on TCP nothing is copied into it (`MSG_TRUNC`), so it stays
    /// uninitialized and is never read; grown to the largest target so far, not per call.
    peek: Vec<u8>,
    /// A socket error met after a call had handed out bytes: the next call returns it.
    deferred: Option<io::Error>,
}

impl EmuSocket {
    /// Wrap `sock` (blocking) with a [`DEFAULT_CONTROL_LEN`] control buffer.
    pub fn new(
        sock: TcpStream,
        binding: Arc<EmuBinding>,
        cfg: EmuConfig,
    ) -> Result<Self, EmuError> {
        Self::with_control_len(sock, binding, cfg, DEFAULT_CONTROL_LEN)
    }

    /// Wrap `sock` with a control buffer of `control_len` bytes.
    pub fn with_control_len(
        sock: TcpStream,
        binding: Arc<EmuBinding>,
        cfg: EmuConfig,
        control_len: usize,
    ) -> Result<Self, EmuError> {
        if cfg.frag_max == 0 || cfg.frag_max > NIOV_SIZE {
            return Err(EmuError::FragSize(cfg.frag_max));
        }
        Ok(Self {
            sock,
            binding,
            cfg,
            control: vec![0; control_len].into_boxed_slice(),
            queue: VecDeque::new(),
            tokens: Tokens::default(),
            packets: 0,
            scratch: Vec::with_capacity(FILL_BURST),
            peek: Vec::new(),
            deferred: None,
        })
    }

    /// The binding.
    pub fn binding(&self) -> &Arc<EmuBinding> {
        &self.binding
    }

    /// Tokens handed out and not yet returned.
    pub fn outstanding_tokens(&self) -> usize {
        self.tokens.outstanding
    }

    /// The underlying socket.
    pub fn get_ref(&self) -> &TcpStream {
        &self.sock
    }

    /// Let the "NIC" land up to `want_bytes` of TCP data in free net_iovs. Returns false at
    /// EOF or, when `!wait`, when nothing is available right now.
    ///
    /// With `wait` it first waits for bytes as the kernel's `recvmsg` does
    /// ([`Self::await_bytes`]), then for free net_iovs for what is left of the socket's
    /// `SO_RCVTIMEO` (nothing when `O_NONBLOCK`), then fails with `EAGAIN`
    /// ([`EmuBinding::take`]). Net_iovs are taken only once bytes arrived, as a NIC fills
    /// pages only as packets land: a reader still waiting for its bytes keeps none from
    /// sockets whose bytes are there, and EOF or a pending socket error end the call at once
    /// without touching the pool.
    fn fill(&mut self, want_bytes: usize, wait: bool) -> io::Result<bool> {
        let start = Instant::now();
        if wait && !self.await_bytes(want_bytes)? {
            return Ok(false);
        }
        loop {
            if let Some(landed) = self.land(want_bytes, wait, start)? {
                return Ok(landed);
            }
            // The bytes the peek saw were read through another handle of the socket: wait
            // for more, within what is left of the budget.
            if !self.await_bytes_within(want_bytes, start)? {
                return Ok(false);
            }
        }
    }

    /// Wait for bytes as the kernel's `recvmsg` does before anything lands: a blocking
    /// `recv(MSG_PEEK | MSG_TRUNC)` of `min(SO_RCVLOWAT, want_bytes)` bytes. The kernel applies
    /// its own rules to it: the target `min(SO_RCVLOWAT, len)` (the peek's length gives the
    /// call's), `SO_RCVTIMEO` and `O_NONBLOCK` (`EAGAIN`), EOF (false), a pending socket
    /// error (returned, and cleared as any `recvmsg` clears it); and it ignores the error
    /// queue (MSG_ZEROCOPY completions, whose `POLLERR` a `poll` would report for ever). A
    /// signal restarts the wait, as the real devmem socket's `recvmsg` retry does. A peek
    /// consumes nothing (the bytes land next), and with `MSG_TRUNC` TCP copies nothing out
    /// either ([`sys::peek_trunc`]; before, each fill zeroed and filled a buffer of the
    /// target's length, a MiB per fill with a MiB `SO_RCVLOWAT`).
    fn await_bytes(&mut self, want_bytes: usize) -> io::Result<bool> {
        let target = sys::rcvlowat(self.sock.as_fd())?.min(want_bytes).max(1);
        self.peek.clear();
        self.peek.reserve_exact(target);
        let room = &mut self.peek.spare_capacity_mut()[..target];
        Ok(sys::peek_trunc(self.sock.as_fd(), room)? > 0)
    }

    /// [`Self::await_bytes`] again, for a call that began at `start`, within what is left of
    /// its budget ([`budget_left`]; `EAGAIN` once none is): the peek runs under a receive
    /// timeout of what is left, the socket's own put back after it. Before, it ran under the
    /// socket's full `SO_RCVTIMEO` again, and each theft of its bytes through another handle
    /// of the socket could make one call wait that long once more. (Handles of one socket
    /// share the option: another handle's read meanwhile gets the shorter timeout too, and
    /// two such waits that overlap can put back each other's shorter value, which then stays.
    /// The node never reads one data socket through two handles: its one clone only shuts
    /// the socket down.)
    fn await_bytes_within(&mut self, want_bytes: usize, start: Instant) -> io::Result<bool> {
        let Some(left) = budget_left(&self.sock, start)? else {
            return self.await_bytes(want_bytes); // no limit
        };
        if left.is_zero() {
            return Err(io::Error::from_raw_os_error(libc::EAGAIN));
        }
        let own = self.sock.read_timeout()?;
        self.sock.set_read_timeout(Some(left))?;
        let got = self.await_bytes(want_bytes);
        self.sock.set_read_timeout(own)?;
        got
    }

    /// One fill: up to `want_bytes` worth of free net_iovs taken (with `wait`, waiting for
    /// one for what is left at `start` of the budget, [`budget_left`]) and the socket read
    /// into them without blocking. Returns whether bytes landed; `None` with `wait` when the
    /// socket had nothing to read after all (the net_iovs went back).
    fn land(&mut self, want_bytes: usize, wait: bool, start: Instant) -> io::Result<Option<bool>> {
        let fm = self.cfg.frag_max;
        let pages = want_bytes.div_ceil(fm).clamp(1, FILL_BURST);
        self.scratch.clear();
        let mut niovs = std::mem::take(&mut self.scratch);
        let sock = &self.sock;
        // The pool wait gets what the wait for bytes left of the receive timeout.
        let left = || budget_left(sock, start);
        self.binding.take(pages, wait, left, &mut niovs)?;
        if niovs.is_empty() {
            self.scratch = niovs;
            return Ok(Some(false));
        }
        #[allow(unsafe_code)] // page_mut: exclusivity comes from the freelist (SAFETY below)
        let got = {
            let mut bufs: Vec<IoSliceMut<'_>> = niovs
                .iter()
                .map(|&i| {
                    // SAFETY: net_iov `i` just left the freelist and is referenced only by
                    // this fill (refs == 1, not yet in any packet or token), so this is the
                    // only access to its page until it is queued below.
                    IoSliceMut::new(unsafe {
                        self.binding.mem.page_mut(i as usize * NIOV_SIZE, fm)
                    })
                })
                .collect();
            sys::recv_vectored(self.sock.as_fd(), &mut bufs, libc::MSG_DONTWAIT)
        };
        let n = match got {
            Ok(n) => n,
            Err(e) => {
                self.binding.put_all(niovs.drain(..));
                self.scratch = niovs;
                return match e.kind() {
                    io::ErrorKind::WouldBlock if wait => Ok(None),
                    io::ErrorKind::WouldBlock => Ok(Some(false)),
                    _ => Err(e),
                };
            }
        };
        let used = n.div_ceil(fm);
        self.queue_landed(&niovs[..used], n);
        self.binding.put_all(niovs.drain(used..));
        self.scratch = niovs;
        Ok(Some(n > 0))
    }

    /// Queue the `n` bytes just received into `niovs` (in order, `frag_max` bytes a page) as
    /// packets; every `linear_every`th lands in the linear part, its page returned at once.
    fn queue_landed(&mut self, niovs: &[u32], n: usize) {
        let fm = self.cfg.frag_max;
        for (k, &niov) in niovs.iter().enumerate() {
            let len = (n - k * fm).min(fm);
            self.packets += 1;
            let linear =
                self.cfg.linear_every > 0 && self.packets.is_multiple_of(self.cfg.linear_every);
            if linear {
                let mut bytes = vec![0; len];
                let offset = (niov as usize * NIOV_SIZE) as u64;
                #[allow(unsafe_code)] // copy_out: this fill owns the page (SAFETY below)
                // SAFETY: net_iov `niov` left the freelist for this fill and is in no packet
                // or token yet, so nothing else writes or reads its page; the `page_mut`
                // slices of the receive were dropped with their `bufs`.
                let copied = unsafe { self.binding.mem.copy_out(offset, &mut bytes) };
                copied.expect("net_iov inside the binding");
                self.binding.put_all([niov]);
                self.queue.push_back(Packet {
                    niov: None,
                    linear: bytes,
                    len,
                    consumed: 0,
                });
            } else {
                self.queue.push_back(Packet {
                    niov: Some(niov),
                    linear: Vec::new(),
                    len,
                    consumed: 0,
                });
            }
        }
    }

    /// The emulated `recvmsg(MSG_SOCK_DEVMEM)`: at most `iov.len()` bytes; linear bytes are
    /// copied to the front of `iov`, devmem frags are described in the control buffer.
    /// Returns (bytes, control length).
    fn recvmsg(&mut self, iov: &mut [u8]) -> Result<(usize, usize), DevmemError> {
        if let Some(source) = self.deferred.take() {
            // The error the previous call met after handing out bytes (the queue was empty
            // then, and nothing was read since).
            return Err(syscall_error(source));
        }
        let len = iov.len();
        let (mut done, mut iov_used, mut ctl) = (0usize, 0usize, 0usize);
        while done < len {
            if self.queue.is_empty() && self.binding.is_unbound() {
                // The queues restarted with ordinary pages (devmem.md §4 step 6): what
                // arrives now is ordinary TCP, copied into the iov without a cmsg, and one
                // recvmsg never mixes it with devmem frags (§4 step 4).
                if done > 0 {
                    break;
                }
                return self.recv_plain(iov);
            }
            let room = ctl + CMSG_SPACE <= self.control.len();
            if self.queue.is_empty() {
                match self.refill(len - done, done, room)? {
                    Refill::Filled | Refill::Unbound => continue,
                    Refill::Stop => break,
                }
            }
            if !room {
                if done == 0 {
                    // A frag is due and not one cmsg fits: nothing is taken (as in the kernel).
                    return Err(self.too_small());
                }
                break;
            }
            let piece = self.hand_out(iov, len - done, &mut iov_used, ctl);
            ctl += CMSG_SPACE;
            done += piece;
        }
        Ok((done, ctl))
    }

    /// Let the "NIC" land more bytes for a call that has handed out `done` bytes and wants
    /// `want` more, its queue empty; `room`: whether a cmsg still fits.
    fn refill(&mut self, want: usize, done: usize, room: bool) -> Result<Refill, DevmemError> {
        if !room {
            if done > 0 {
                return Ok(Refill::Stop);
            }
            // No cmsg fits: ETOOSMALL only if bytes wait, which would land as frags; at EOF
            // the call returns 0. The bytes stay in the socket either way.
            if !self.await_bytes(want).map_err(syscall_error)? {
                return Ok(Refill::Stop);
            }
            if self.binding.is_unbound() {
                return Ok(Refill::Unbound);
            }
            return Err(self.too_small());
        }
        match self.fill(want, done == 0) {
            Ok(true) => Ok(Refill::Filled),
            Ok(false) => Ok(Refill::Stop),
            // Unbound (not a socket error): ordinary TCP from now on, in the next call if
            // this one handed out frags already.
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(if done > 0 {
                Refill::Stop
            } else {
                Refill::Unbound
            }),
            Err(e) if done > 0 => {
                // The short read now, the error in the next call.
                self.deferred = Some(e);
                Ok(Refill::Stop)
            }
            Err(source) => Err(syscall_error(source)),
        }
    }

    fn too_small(&self) -> DevmemError {
        DevmemError::ControlBufferTooSmall {
            capacity: self.control.len(),
        }
    }

    /// Hand out up to `max` bytes of the first queued packet as one frag: linear bytes into
    /// `iov` at `iov_used`, its cmsg at `ctl` of the control buffer. Returns the bytes.
    fn hand_out(&mut self, iov: &mut [u8], max: usize, iov_used: &mut usize, ctl: usize) -> usize {
        let pkt = self.queue.front_mut().expect("not empty");
        let piece = (pkt.len - pkt.consumed).min(max);
        let cmsg = match pkt.niov {
            None => {
                iov[*iov_used..*iov_used + piece]
                    .copy_from_slice(&pkt.linear[pkt.consumed..pkt.consumed + piece]);
                *iov_used += piece;
                (SO_DEVMEM_LINEAR, synth::dmabuf_cmsg(0, piece as u32, 0, 0))
            }
            Some(niov) => {
                let token = self.tokens.alloc(niov);
                self.binding.get(&mut self.binding.lock(), niov);
                let offset = (niov as usize * NIOV_SIZE + pkt.consumed) as u64;
                let d = synth::dmabuf_cmsg(offset, piece as u32, token, self.binding.id);
                (SO_DEVMEM_DMABUF, d)
            }
        };
        write_cmsg(&mut self.control[ctl..ctl + CMSG_SPACE], cmsg.0, &cmsg.1);
        self.binding.stats.frags.fetch_add(1, Ordering::Relaxed);
        pkt.consumed += piece;
        if pkt.consumed == pkt.len {
            let pkt = self.queue.pop_front().expect("not empty");
            if let Some(niov) = pkt.niov {
                self.binding.put_all([niov]);
            }
        }
        piece
    }

    /// An ordinary `recv` into `iov` (after unbind): (bytes, no control).
    fn recv_plain(&mut self, iov: &mut [u8]) -> Result<(usize, usize), DevmemError> {
        loop {
            match self.sock.read(iov) {
                Ok(n) => return Ok((n, 0)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(DevmemError::Syscall {
                        call: "recvmsg(MSG_SOCK_DEVMEM) [emulated, unbound]",
                        source,
                    });
                }
            }
        }
    }

    /// The emulated `setsockopt(SO_DEVMEM_DONTNEED)`, with the kernel's checks and return
    /// value (reference devmem.md §4.5).
    pub fn dontneed(&mut self, tokens: &[libc::dmabuf_token]) -> io::Result<usize> {
        if tokens.is_empty() || tokens.len() > MAX_DONTNEED_TOKENS {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let (mut frags, mut freed) = (0usize, 0usize);
        let mut released = Vec::new();
        'calls: for t in tokens {
            for j in 0..t.token_count {
                frags += 1;
                if frags > MAX_DONTNEED_FRAGS {
                    break 'calls;
                }
                if let Some(niov) = self.tokens.erase(t.token_start.wrapping_add(j)) {
                    released.push(niov);
                    freed += 1;
                }
            }
        }
        self.binding.put_all(released);
        Ok(freed)
    }
}

/// What [`EmuSocket::refill`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refill {
    /// Packets were queued.
    Filled,
    /// The binding is unbound and this call handed out nothing: read ordinary TCP.
    Unbound,
    /// End the call with what it has (EOF, nothing more now, or an error kept for the next).
    Stop,
}

/// A failed `recv` of the emulated `recvmsg`.
fn syscall_error(source: io::Error) -> DevmemError {
    DevmemError::Syscall {
        call: "recvmsg(MSG_SOCK_DEVMEM) [emulated]",
        source,
    }
}

impl DevmemRecv for EmuSocket {
    fn recv_frags(&mut self, iov_buf: &mut [u8]) -> Result<RecvBatch<'_>, DevmemError> {
        let (bytes, ctl) = self.recvmsg(iov_buf)?;
        let batch = RecvBatch::parse(bytes, &self.control[..ctl], false)?;
        // Its frags lie in this binding's memory: the one the gather may read them from.
        Ok(batch.in_mem(self.binding.mem.addr()))
    }

    fn return_tokens(&mut self, batcher: &mut TokenBatcher) -> Result<usize, DevmemError> {
        batcher.flush_with(|t| self.dontneed(t))
    }
}

impl Drop for EmuSocket {
    fn drop(&mut self) {
        // Socket destruction releases outstanding tokens and queued packets.
        let mut held: Vec<u32> = self.queue.drain(..).filter_map(|p| p.niov).collect();
        held.extend(
            self.tokens
                .slots
                .iter()
                .filter(|&&s| s != 0)
                .map(|&s| s - 1),
        );
        self.binding.put_all(held);
    }
}

/// Write one cmsg as `put_cmsg` does: `struct cmsghdr`, the 24-byte payload, zero padding
/// (no allocation: this runs once per frag).
fn write_cmsg(out: &mut [u8], cmsg_type: i32, data: &[u8; DMABUF_CMSG_LEN]) {
    const W: usize = std::mem::size_of::<usize>();
    out[..W].copy_from_slice(&(CMSG_HDR_LEN + DMABUF_CMSG_LEN).to_ne_bytes());
    out[W..W + 4].copy_from_slice(&libc::SOL_SOCKET.to_ne_bytes());
    out[W + 4..CMSG_HDR_LEN].copy_from_slice(&cmsg_type.to_ne_bytes());
    out[CMSG_HDR_LEN..CMSG_HDR_LEN + DMABUF_CMSG_LEN].copy_from_slice(data);
    out[CMSG_HDR_LEN + DMABUF_CMSG_LEN..].fill(0);
}

pub mod host;

#[cfg(test)]
mod size_tests {
    use super::*;

    #[test]
    fn a_binding_of_more_net_iovs_than_a_u32_names_is_refused() {
        // Before: `0..n as u32` wrapped, so 2^32 net_iovs (16 TiB) made a binding with no
        // free net_iov (every reader stalled). Refused before any memory is made.
        for niovs in [MAX_NIOVS + 1, 2 * MAX_NIOVS] {
            let bytes = niovs * NIOV_SIZE;
            match EmuBinding::new(1, bytes) {
                Err(EmuError::TooLarge { bytes: b, max }) => {
                    assert_eq!((b, max), (bytes, MAX_NIOVS * NIOV_SIZE));
                }
                other => panic!("{niovs} net_iovs: {other:?}"),
            }
        }
        let text = EmuBinding::new(1, (MAX_NIOVS + 1) * NIOV_SIZE)
            .unwrap_err()
            .to_string();
        assert!(text.contains("above the maximum"), "{text}");
    }

    #[test]
    fn the_freelist_of_a_binding_near_the_maximum_is_built_as_it_is_used() {
        // Before: `(0..count).rev().collect()` made every index up front, 16 GiB for a
        // binding of `MAX_NIOVS` (a request just under the limit), before any was used.
        let mut p = Pool::new(u32::MAX);
        assert_eq!(p.free_len(), MAX_NIOVS);
        assert!(p.free.capacity() == 0 && p.refs.capacity() == 0);
        // The eager stack's order: lowest fresh first, a returned one before any fresh one.
        let taken: Vec<u32> = (0..3).map(|_| p.pop().unwrap()).collect();
        assert_eq!(taken, [0, 1, 2]);
        assert_eq!(p.refs, [1, 1, 1]);
        p.refs[1] = 0;
        p.free.push(1);
        assert_eq!(p.free_len(), MAX_NIOVS - 2);
        assert_eq!((p.pop(), p.pop()), (Some(1), Some(3)));
        assert_eq!(p.refs[1], 1);
        // Exhausted: none left, fresh or returned.
        let mut small = Pool::new(2);
        assert_eq!(
            (small.pop(), small.pop(), small.pop()),
            (Some(0), Some(1), None)
        );
        assert_eq!(small.free_len(), 0);
    }
}

#[cfg(test)]
mod tests;
