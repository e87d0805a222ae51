//! Devmem receive in the node (`receive = devmem` / `devmem-sim`).
//!
//! [`RxRegion`] is the node's RX binding: the dma-buf the NIC queues are bound to (here the
//! emulator's memfd, DESIGN §8.4) with its counters. It is shared (`Arc`) by the node and by
//! every data connection reading from it, so it lives until the last frag reader is gone,
//! whatever order shutdown happens in; [`RxRegion::unbind`] stops new frags (the kernel's
//! unbind on netlink-socket close) while frags already handed out stay readable until their
//! tokens come back.
//!
//! [`DevmemReader`] is what a receiver thread reads payload bytes through: one
//! `recvmsg(MSG_SOCK_DEVMEM)` per call, the frags gathered into the shard's slab (memcpy out
//! of a host dma-buf; the CUDA engine's job for device memory), and the tokens returned right
//! after the gather, so the binding's pool refills as fast as the receiver runs. A full pool
//! makes the emulated NIC wait: backpressure, not loss. Bytes that arrive outside the
//! dma-buf (LINEAR frags, ordinary TCP) are still placed correctly but counted and reported
//! as a header-split or steering problem.

use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use shardwire_devmem::emu::{EmuBinding, EmuConfig, EmuError, EmuSocket};
use shardwire_devmem::gather::gather;
use shardwire_devmem::{DevmemRecv, TokenBatcher};

/// Counters of the devmem receive path (exported as `shardwire_devmem_*` metrics).
#[derive(Debug, Default)]
pub struct DevmemCounters {
    /// Dma-buf frags gathered.
    pub frags: AtomicU64,
    /// Bytes gathered out of the dma-buf.
    pub dmabuf_bytes: AtomicU64,
    /// Bytes that arrived in `SCM_DEVMEM_LINEAR` frags (header split problem).
    pub linear_bytes: AtomicU64,
    /// Bytes that arrived as ordinary TCP (steering problem).
    pub plain_bytes: AtomicU64,
    /// Tokens handed back with `SO_DEVMEM_DONTNEED`.
    pub tokens_returned: AtomicU64,
}

/// The node's RX binding.
#[derive(Debug)]
pub struct RxRegion {
    binding: Arc<EmuBinding>,
    emu: EmuConfig,
    /// Counters.
    pub counters: DevmemCounters,
}

impl RxRegion {
    /// An emulated binding of `bytes` (`receive = devmem-sim`).
    pub fn emulated(bytes: usize) -> Result<Arc<Self>, EmuError> {
        Ok(Arc::new(Self {
            binding: EmuBinding::new(1, bytes)?,
            emu: EmuConfig::default(),
            counters: DevmemCounters::default(),
        }))
    }

    /// What backs the binding, for status and logs.
    pub fn kind(&self) -> &'static str {
        "emulated"
    }

    /// The binding id frags carry.
    pub fn id(&self) -> u32 {
        self.binding.id()
    }

    /// Size of the dma-buf.
    pub fn bytes(&self) -> usize {
        self.binding.mem().len()
    }

    /// `(free, total)` net_iovs.
    pub fn niovs(&self) -> (usize, usize) {
        (self.binding.free_niovs(), self.binding.num_niovs())
    }

    /// Times a fill waited for a free net_iov.
    pub fn exhausted_waits(&self) -> u64 {
        self.binding.stats().exhausted_waits.load(Ordering::Relaxed)
    }

    /// Stop handing out frags (shutdown).
    pub fn unbind(&self) {
        self.binding.unbind();
    }

    /// A reader for one data connection.
    pub fn reader(self: &Arc<Self>, sock: TcpStream) -> io::Result<DevmemReader> {
        let sock = EmuSocket::new(sock, Arc::clone(&self.binding), self.emu)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(DevmemReader {
            sock: Box::new(sock),
            region: Arc::clone(self),
            tokens: TokenBatcher::new(),
            warned: false,
        })
    }
}

/// Payload reader of one data connection on the devmem path.
pub struct DevmemReader {
    sock: Box<dyn DevmemRecv + Send>,
    region: Arc<RxRegion>,
    tokens: TokenBatcher,
    warned: bool,
}

impl std::fmt::Debug for DevmemReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevmemReader")
            .field("binding", &self.region.id())
            .finish_non_exhaustive()
    }
}

fn to_io(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl DevmemReader {
    /// Receive up to `dst.len()` payload bytes into `dst` (in stream order); 0 at EOF.
    pub fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let c = &self.region.counters;
        let batch = self.sock.recv_frags(dst).map_err(to_io)?;
        if batch.is_eof() {
            return Ok(0);
        }
        let gathered = gather(
            &batch,
            dst,
            self.region.binding.mem(),
            self.region.id(),
            &mut self.tokens,
        );
        // Tokens go back right after the gather, even when it failed.
        let returned = self.sock.return_tokens(&mut self.tokens);
        let freed = returned.map_err(to_io)?;
        c.tokens_returned.fetch_add(freed as u64, Ordering::Relaxed);
        let g = gathered.map_err(to_io)?;
        c.frags.fetch_add(g.dmabuf_frags as u64, Ordering::Relaxed);
        c.dmabuf_bytes.fetch_add(g.dmabuf_bytes, Ordering::Relaxed);
        if g.linear_bytes > 0 || g.plain_bytes > 0 {
            c.linear_bytes.fetch_add(g.linear_bytes, Ordering::Relaxed);
            c.plain_bytes.fetch_add(g.plain_bytes, Ordering::Relaxed);
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    linear_bytes = g.linear_bytes,
                    plain_bytes = g.plain_bytes,
                    "payload arrived in host memory on a devmem connection: check header split (tcp-data-split on, hds-thresh 0) and that the data port is steered to the bound queues; the bytes are still delivered"
                );
            }
        }
        Ok(g.bytes)
    }
}
