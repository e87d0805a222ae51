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
//! `recvmsg(MSG_SOCK_DEVMEM)` per call, the frags gathered into the shard's slab, and the
//! tokens returned right after the gather, so the binding's pool refills as fast as the
//! receiver runs. Host memory: a memcpy out of the host dma-buf ([`DevmemReader::read_some`]).
//! CUDA memory ([`DevmemReader::read_into_gpu`]): the gather kernel copies the frags, one
//! launch per `recvmsg`, from the dma-buf (a GPU `VmmRegion` bound to the NIC, or the
//! emulator's memfd registered with CUDA) into the slab on the GPU; the tokens go back once
//! the launch's event says the frags were read. A full pool
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
use shardwire_devmem::gather::{GatherPlan, gather, plan};
use shardwire_devmem::mem::DmabufMem;
use shardwire_devmem::nic::{NicSetup, SetupPlan};
use shardwire_devmem::{DevmemRecv, DevmemSocket, RxBinding, TokenBatcher};
use shardwire_gpu::cuda::{CudaMemory, DeviceRange, HostMapped, VmmRegion};
use shardwire_gpu::kernels::Frag;

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
    /// `receive = devmem`: a udmabuf (host memory) or GPU memory bound to NIC RX queues.
    /// The netlink binding and the NIC setup are dropped (unbind, then restore) by
    /// [`RxRegion::unbind`].
    Kernel {
        mem: KernelMem,
        id: u32,
        ifname: String,
        queues: Vec<u32>,
        bound: Mutex<Option<Box<(RxBinding, NicSetup)>>>,
    },
}

/// The memory a kernel binding hands to the NIC.
enum KernelMem {
    /// A udmabuf, mapped here for the CPU gather.
    Host(DmabufMem),
    /// A GPU region exported as a dma-buf (the fd stays open with the binding).
    Gpu(VmmRegion, std::os::fd::OwnedFd),
}

/// The GPU side of a binding on a node with CUDA memory.
struct GpuGather {
    cuda: Arc<CudaMemory>,
    /// The emulator's memfd registered with CUDA (`None` for a GPU kernel binding, whose
    /// memory the kernel reads directly).
    mapped: Option<HostMapped>,
}

/// The node's RX binding.
pub struct RxRegion {
    // Field order: the CUDA registration of the emulator's memory goes before the memory.
    gpu: Option<GpuGather>,
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
    /// The GPU memory for the RX binding could not be made or exported.
    #[error("GPU memory for the RX binding: {0}")]
    Gpu(shardwire_gpu::GpuError),
    /// The kernel refused the bind.
    #[error("bind-rx: {0}")]
    Bind(#[from] shardwire_devmem::NetdevError),
    /// The emulator could not make its binding.
    #[error("the emulator: {0}")]
    Emulator(#[from] EmuError),
    /// The emulator's memory could not be registered with CUDA.
    #[error("registering the emulator's dma-buf with CUDA: {0}")]
    GpuRegister(shardwire_gpu::GpuError),
}

/// What backs a binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BindingKind {
    /// The kernel-faithful emulator (`receive = devmem-sim`).
    Emulated,
    /// NIC RX queues bound with the kernel's netdev family (`receive = devmem`).
    Kernel,
}

impl RxRegion {
    /// An emulated binding of `bytes` (`receive = devmem-sim`). With `cuda`, its memory is
    /// registered with the GPU and frags are gathered by the CUDA kernel.
    pub fn emulated(bytes: usize, cuda: Option<Arc<CudaMemory>>) -> Result<Arc<Self>, BindError> {
        let binding = EmuBinding::new(1, bytes)?;
        let gpu = match cuda {
            None => None,
            Some(cuda) => {
                let mem = binding.mem();
                // SAFETY: the memfd mapping of `mem.len()` bytes at `mem.addr()` (page
                // aligned, from mmap) lives in `binding`, which this region owns in
                // `backing`; the `gpu` field (declared first) is dropped before it.
                let mapped =
                    unsafe { HostMapped::new(&cuda.device, mem.addr() as *mut u8, mem.len()) }
                        .map_err(BindError::GpuRegister)?;
                Some(GpuGather {
                    cuda,
                    mapped: Some(mapped),
                })
            }
        };
        Ok(Arc::new(Self {
            gpu,
            backing: Backing::Emulated {
                binding,
                emu: EmuConfig::default(),
            },
            counters: DevmemCounters::default(),
        }))
    }

    /// A real binding (`receive = devmem`): set the NIC up for `queues` (channels, header
    /// split, RSS over the queues below them, an ntuple rule steering `data_port` to the first;
    /// journaled in `state_file`), allocate `bytes` of memory (a udmabuf, or with `cuda` a GPU
    /// region exported as a dma-buf: GPU-direct), bind it to the queues. Any failure undoes
    /// what was done.
    pub fn bind_kernel(
        ifname: &str,
        ifindex: u32,
        queues: &[u32],
        bytes: usize,
        state_file: &std::path::Path,
        data_port: u16,
        cuda: Option<Arc<CudaMemory>>,
    ) -> Result<Arc<Self>, BindError> {
        let plan = SetupPlan {
            ifname: ifname.into(),
            ifindex,
            queues: queues.to_vec(),
            netns: None,
            steer_port: Some(data_port),
        };
        let setup = shardwire_devmem::nic::apply(&plan, state_file)?;
        let (mem, gpu) = match cuda {
            None => (
                KernelMem::Host(DmabufMem::udmabuf(bytes).map_err(BindError::Dmabuf)?),
                None,
            ),
            Some(cuda) => {
                let region = VmmRegion::new(&cuda.device, bytes).map_err(BindError::Gpu)?;
                let fd = region.export_dmabuf().map_err(BindError::Gpu)?;
                let gpu = GpuGather { cuda, mapped: None };
                (KernelMem::Gpu(region, fd), Some(gpu))
            }
        };
        let fd = match &mem {
            KernelMem::Host(m) => m.fd().as_raw_fd(),
            KernelMem::Gpu(_, fd) => fd.as_raw_fd(),
        };
        let binding = shardwire_devmem::bind_rx(ifindex, fd, queues)?;
        Ok(Arc::new(Self {
            gpu,
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
    pub fn kind(&self) -> BindingKind {
        match self.backing {
            Backing::Emulated { .. } => BindingKind::Emulated,
            Backing::Kernel { .. } => BindingKind::Kernel,
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

    /// The host mapping of the dma-buf; `None` for GPU memory.
    fn mem(&self) -> Option<&DmabufMem> {
        match &self.backing {
            Backing::Emulated { binding, .. } => Some(binding.mem()),
            Backing::Kernel {
                mem: KernelMem::Host(mem),
                ..
            } => Some(mem),
            Backing::Kernel { .. } => None,
        }
    }

    /// Size of the dma-buf.
    pub fn bytes(&self) -> usize {
        match &self.backing {
            Backing::Kernel {
                mem: KernelMem::Gpu(region, _),
                ..
            } => region.len(),
            _ => self.mem().map_or(0, DmabufMem::len),
        }
    }

    /// True when frags are gathered by the CUDA kernel into GPU memory.
    pub fn gpu_gather(&self) -> bool {
        self.gpu.is_some()
    }

    /// What the gather kernel reads frags from.
    fn gpu_source(&self) -> Option<(&CudaMemory, &dyn DeviceRange)> {
        let gpu = self.gpu.as_ref()?;
        let range: &dyn DeviceRange = match (&gpu.mapped, &self.backing) {
            (Some(mapped), _) => mapped,
            (
                None,
                Backing::Kernel {
                    mem: KernelMem::Gpu(region, _),
                    ..
                },
            ) => region,
            (None, _) => return None,
        };
        Some((&gpu.cuda, range))
    }

    /// `(free, total)` net_iovs; the kernel does not report its freelist, so `free` is
    /// known only for the emulator.
    pub fn niovs(&self) -> (Option<usize>, usize) {
        match &self.backing {
            Backing::Emulated { binding, .. } => (Some(binding.free_niovs()), binding.num_niovs()),
            Backing::Kernel { .. } => (None, self.bytes() / 4096),
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
            plan: GatherPlan::default(),
            frags: Vec::new(),
            warned: false,
        })
    }
}

/// Payload reader of one data connection on the devmem path.
pub struct DevmemReader {
    sock: Box<dyn DevmemRecv + Send>,
    region: Arc<RxRegion>,
    tokens: TokenBatcher,
    /// Scratch of the GPU gather (reused per call).
    plan: GatherPlan,
    frags: Vec<Frag>,
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
    /// True when this reader gathers into GPU memory ([`Self::read_into_gpu`]).
    pub fn gpu_gather(&self) -> bool {
        self.region.gpu_gather()
    }

    /// Receive up to `dst.len()` payload bytes into `dst` (in stream order); 0 at EOF.
    /// For a binding whose frags lie in GPU memory this is an error (use
    /// [`Self::read_into_gpu`]).
    pub fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let Some(mem) = self.region.mem() else {
            return Err(io::Error::other(
                "this binding's dma-buf is GPU memory: its frags can only be gathered on the GPU",
            ));
        };
        let c = &self.region.counters;
        let batch = self.sock.recv_frags(dst).map_err(to_io)?;
        if batch.is_eof() {
            return Ok(0);
        }
        let gathered = gather(&batch, dst, mem, self.region.id(), &mut self.tokens);
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

    /// Receive up to `host.len()` payload bytes into GPU region `dst` at `dst_off` (in
    /// stream order); 0 at EOF. Dma-buf frags are copied by the gather kernel (one launch);
    /// bytes that arrived in host memory (linear or ordinary TCP, landed in `host`) are
    /// copied up. Tokens go back once the gather's event completes, also after an error.
    pub fn read_into_gpu(
        &mut self,
        dst: &VmmRegion,
        dst_off: usize,
        host: &mut [u8],
    ) -> io::Result<usize> {
        let region = Arc::clone(&self.region);
        let Some((cuda, src)) = region.gpu_source() else {
            return Err(io::Error::other(
                "this binding has no GPU gather (the node runs on host memory)",
            ));
        };
        let batch = self.sock.recv_frags(host).map_err(to_io)?;
        if batch.is_eof() {
            return Ok(0);
        }
        self.tokens.push_batch(&batch);
        let planned = plan(&batch, region.id(), host.len(), &mut self.plan);
        let copied = planned
            .map_err(to_io)
            .and_then(|()| self.copy_planned(cuda, src, dst, dst_off, host));
        let freed = self.sock.return_tokens(&mut self.tokens).map_err(to_io)?;
        let c = &region.counters;
        c.tokens_returned.fetch_add(freed as u64, Ordering::Relaxed);
        copied?;
        let p = &self.plan;
        c.frags.fetch_add(p.dmabuf.len() as u64, Ordering::Relaxed);
        c.dmabuf_bytes
            .fetch_add(p.dmabuf_bytes(), Ordering::Relaxed);
        let (linear, plain) = if p.plain {
            (0, p.bytes as u64)
        } else {
            (p.linear_bytes(), 0)
        };
        if linear > 0 || plain > 0 {
            c.linear_bytes.fetch_add(linear, Ordering::Relaxed);
            c.plain_bytes.fetch_add(plain, Ordering::Relaxed);
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    linear_bytes = linear,
                    plain_bytes = plain,
                    "payload arrived in host memory on a devmem connection: check header split and steering; the bytes are still delivered"
                );
            }
        }
        Ok(p.bytes)
    }

    /// Carries out `self.plan`: host pieces copied up, dma-buf frags gathered by the kernel;
    /// returns when the kernel has read every frag.
    fn copy_planned(
        &mut self,
        cuda: &CudaMemory,
        src: &dyn DeviceRange,
        dst: &VmmRegion,
        dst_off: usize,
        host: &[u8],
    ) -> io::Result<()> {
        let p = &self.plan;
        if p.plain {
            return dst.write(dst_off, &host[..p.bytes]).map_err(to_io);
        }
        for &(from, to, len) in &p.linear {
            dst.write(dst_off + to, &host[from..from + len])
                .map_err(to_io)?;
        }
        self.frags.clear();
        self.frags
            .extend(p.dmabuf.iter().map(|&(offset, to, len)| Frag {
                src_off: offset,
                dst_off: (dst_off + to) as u64,
                len: len as u64,
            }));
        if !self.frags.is_empty() {
            cuda.engines
                .gather(src, dst, &self.frags)
                .and_then(|done| done.wait())
                .map_err(to_io)?;
        }
        Ok(())
    }
}
