//! Devmem receive in the node (`receive = devmem` / `devmem-sim`).
//!
//! [`RxRegion`] is the node's RX binding: the dma-buf the NIC queues are bound to (a
//! udmabuf bound with `bind-rx` after the NIC was set up, or the emulator's memfd, DESIGN
//! §8.4) with its counters. It is shared (`Arc`) by the node and by
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

use std::os::fd::AsRawFd;
use std::sync::Mutex;

use shardwire_devmem::emu::{EmuBinding, EmuConfig, EmuError, EmuSocket};
use shardwire_devmem::gather::gather;
use shardwire_devmem::mem::DmabufMem;
use shardwire_devmem::nic::{NicSetup, SetupPlan};
use shardwire_devmem::{DevmemRecv, DevmemSocket, RxBinding, TokenBatcher};

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

/// What backs a binding.
enum Backing {
    /// `receive = devmem-sim`: the emulator's memfd and freelist.
    Emulated {
        binding: Arc<EmuBinding>,
        emu: EmuConfig,
    },
    /// `receive = devmem`: a udmabuf bound to NIC RX queues. The netlink binding and the
    /// NIC setup are dropped (unbind, then restore) by [`RxRegion::unbind`].
    Kernel {
        mem: DmabufMem,
        id: u32,
        ifname: String,
        queues: Vec<u32>,
        bound: Mutex<Option<Box<(RxBinding, NicSetup)>>>,
    },
}

/// The node's RX binding.
pub struct RxRegion {
    backing: Backing,
    /// Counters.
    pub counters: DevmemCounters,
}

impl std::fmt::Debug for RxRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxRegion")
            .field("kind", &self.kind())
            .field("id", &self.id())
            .finish_non_exhaustive()
    }
}

/// Why a kernel binding could not be made (each step names itself).
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// NIC setup failed (already undone).
    #[error("NIC setup: {0}")]
    Setup(#[from] shardwire_devmem::nic::NicError),
    /// No dma-buf could be allocated.
    #[error("dma-buf for the RX binding: {0}")]
    Dmabuf(io::Error),
    /// The kernel refused the bind.
    #[error("bind-rx: {0}")]
    Bind(#[from] shardwire_devmem::NetdevError),
}

impl RxRegion {
    /// An emulated binding of `bytes` (`receive = devmem-sim`).
    pub fn emulated(bytes: usize) -> Result<Arc<Self>, EmuError> {
        Ok(Arc::new(Self {
            backing: Backing::Emulated {
                binding: EmuBinding::new(1, bytes)?,
                emu: EmuConfig::default(),
            },
            counters: DevmemCounters::default(),
        }))
    }

    /// A real binding (`receive = devmem`): set the NIC up for `queues` (channels, header
    /// split, RSS over the queues below them, an ntuple rule steering `data_port` to the first;
    /// journaled in `state_file`), allocate a udmabuf of `bytes`, bind it to the queues. Any
    /// failure undoes what was done.
    pub fn bind_kernel(
        ifname: &str,
        ifindex: u32,
        queues: &[u32],
        bytes: usize,
        state_file: &std::path::Path,
        data_port: u16,
    ) -> Result<Arc<Self>, BindError> {
        let plan = SetupPlan {
            ifname: ifname.into(),
            ifindex,
            queues: queues.to_vec(),
            netns: None,
            steer_port: Some(data_port),
        };
        let setup = shardwire_devmem::nic::apply(&plan, state_file)?;
        let mem = DmabufMem::udmabuf(bytes).map_err(BindError::Dmabuf)?;
        let binding = shardwire_devmem::bind_rx(ifindex, mem.fd().as_raw_fd(), queues)?;
        Ok(Arc::new(Self {
            backing: Backing::Kernel {
                id: binding.id(),
                mem,
                ifname: ifname.into(),
                queues: queues.to_vec(),
                bound: Mutex::new(Some(Box::new((binding, setup)))),
            },
            counters: DevmemCounters::default(),
        }))
    }

    /// What backs the binding, for status and logs.
    pub fn kind(&self) -> &'static str {
        match self.backing {
            Backing::Emulated { .. } => "emulated",
            Backing::Kernel { .. } => "kernel",
        }
    }

    /// `(interface, queues)` of a kernel binding.
    pub fn queues(&self) -> Option<(&str, &[u32])> {
        match &self.backing {
            Backing::Emulated { .. } => None,
            Backing::Kernel { ifname, queues, .. } => Some((ifname, queues)),
        }
    }

    /// The binding id frags carry.
    pub fn id(&self) -> u32 {
        match &self.backing {
            Backing::Emulated { binding, .. } => binding.id(),
            Backing::Kernel { id, .. } => *id,
        }
    }

    fn mem(&self) -> &DmabufMem {
        match &self.backing {
            Backing::Emulated { binding, .. } => binding.mem(),
            Backing::Kernel { mem, .. } => mem,
        }
    }

    /// Size of the dma-buf.
    pub fn bytes(&self) -> usize {
        self.mem().len()
    }

    /// `(free, total)` net_iovs; the kernel does not report its freelist, so `free` is
    /// known only for the emulator.
    pub fn niovs(&self) -> (Option<usize>, usize) {
        match &self.backing {
            Backing::Emulated { binding, .. } => (Some(binding.free_niovs()), binding.num_niovs()),
            Backing::Kernel { mem, .. } => (None, mem.len() / 4096),
        }
    }

    /// Times a fill waited for a free net_iov (emulator only).
    pub fn exhausted_waits(&self) -> u64 {
        match &self.backing {
            Backing::Emulated { binding, .. } => {
                binding.stats().exhausted_waits.load(Ordering::Relaxed)
            }
            Backing::Kernel { .. } => 0,
        }
    }

    /// Stop handing out frags (shutdown). A kernel binding is unbound (its netlink socket
    /// closed) and the NIC restored; frags already out stay valid until their tokens return.
    pub fn unbind(&self) {
        match &self.backing {
            Backing::Emulated { binding, .. } => binding.unbind(),
            Backing::Kernel { bound, ifname, .. } => {
                let taken = bound.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(pair) = taken {
                    let (binding, setup) = *pair;
                    drop(binding);
                    match setup.restore() {
                        Ok(changes) => {
                            tracing::info!(%ifname, ?changes, "devmem binding closed and NIC settings restored")
                        }
                        Err(e) => {
                            tracing::error!(%ifname, error = %e, "restoring NIC settings failed")
                        }
                    }
                }
            }
        }
    }

    /// A reader for one data connection.
    pub fn reader(self: &Arc<Self>, sock: TcpStream) -> io::Result<DevmemReader> {
        let sock: Box<dyn DevmemRecv + Send> = match &self.backing {
            Backing::Emulated { binding, emu } => Box::new(
                EmuSocket::new(sock, Arc::clone(binding), *emu)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
            ),
            Backing::Kernel { .. } => Box::new(DevmemSocket::new(sock)),
        };
        Ok(DevmemReader {
            sock,
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
            self.region.mem(),
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
