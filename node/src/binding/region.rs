//! The node's RX binding for devmem receive (`receive = devmem` / `devmem-sim`).
//!
//! [`RxRegion`] is the dma-buf the NIC queues are bound to (a udmabuf or GPU memory bound
//! with `bind-rx` after the NIC was set up, or the emulator's memfd, DESIGN §8.4) with its
//! counters. It is shared (`Arc`) by the node and by every data connection reading from it
//! (`crate::rx::devmem`), so it lives until the last frag reader is gone, whatever order
//! shutdown happens in; [`RxRegion::unbind`] stops new frags (the kernel's unbind on
//! netlink-socket close) while frags already handed out stay readable until their tokens
//! come back.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use shardwire_devmem::emu::host::{EmuHost, EmuRule, Flow, HostError};
use shardwire_devmem::emu::{EmuBinding, EmuConfig, EmuError};
use shardwire_devmem::mem::DmabufMem;
use shardwire_devmem::nic::steer::Tcp4Flow;
use shardwire_devmem::nic::{InsertedRule, NicSetup, RuleUndo};
use shardwire_devmem::{DevmemRecv, DevmemSocket, RxBinding};
use shardwire_gpu::cuda::{CudaMemory, DeviceRange, HostMapped, VmmRegion};

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
    /// Receives whose frags named another binding's dma-buf (a flow steered to another
    /// lane's queue): their tokens went back and their payload was fetched again.
    pub steering_errors: AtomicU64,
    /// Per-connection steering rules installed now (one per open data connection).
    pub flow_rules: AtomicU64,
    /// Data connections failed because their steering rule could not be installed.
    pub flow_rule_failures: AtomicU64,
}

/// One NIC's devmem setup, shared by the lanes bound on it and their connections' rules
/// ([`super::kernel`]). The last lane to unbind restores it, whether or not connections
/// still hold it (their rules' removal is then a no-op): shutdown leaves no change behind.
#[derive(Debug)]
pub struct SharedNic {
    setup: Mutex<NicSetup>,
    /// The queues bound on the NIC now, by every lane holding this setup.
    bound: Mutex<Vec<u32>>,
}

/// A [`SharedNic`], as the lanes and rules hold it.
pub type NicShare = Arc<SharedNic>;

impl SharedNic {
    /// A NIC just set up, nothing bound yet.
    pub fn new(setup: NicSetup) -> NicShare {
        Arc::new(Self {
            setup: Mutex::new(setup),
            bound: Mutex::new(Vec::new()),
        })
    }

    /// The setup, for a change.
    pub fn setup(&self) -> std::sync::MutexGuard<'_, NicSetup> {
        self.setup.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The queues bound now.
    pub fn bound(&self) -> Vec<u32> {
        self.bound.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records `queues` as bound.
    fn claim(&self, queues: &[u32]) {
        let mut b = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        b.extend_from_slice(queues);
    }

    /// Records `queues` as unbound; true when nothing is bound any more.
    fn release(&self, queues: &[u32]) -> bool {
        let mut b = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        b.retain(|q| !queues.contains(q));
        b.is_empty()
    }
}

/// Where a [`NicHold`] deletes its port rules: a NIC's live setup ([`SharedNic`]), or a
/// recording fake in tests.
pub trait PortRules {
    /// Deletes `rules` under the setup's lock (nothing left to delete once it was restored:
    /// the restore deleted every journaled rule), logging each one left.
    fn unsteer(&self, rules: &[InsertedRule]);
}

impl PortRules for SharedNic {
    fn unsteer(&self, rules: &[InsertedRule]) {
        unsteer_ports(&mut self.setup(), rules);
    }
}

/// A hold on a NIC's setup, with the port rules (a lane's data port steered to its first
/// queue) that are the holder's to delete: dropped, it deletes them under the setup's lock,
/// before its reference to the setup goes (so before the setup's last holder can restore it).
/// [`super::kernel::setup_nic`] returns one with every rule it added;
/// [`NicHold::take_lane`] hands each lane its own, which its binding keeps while bound: a
/// lane whose bind fails, or whose binding is deleted while other lanes keep the NIC set up,
/// takes its port rule with it instead of leaving it until the whole setup is restored.
pub struct NicHold<N: PortRules = SharedNic> {
    share: Arc<N>,
    rules: Vec<InsertedRule>,
}

impl<N: PortRules> NicHold<N> {
    /// A hold on `share` that deletes `rules` when dropped.
    pub fn new(share: Arc<N>, rules: Vec<InsertedRule>) -> Self {
        Self { share, rules }
    }

    /// The setup held.
    pub fn share(&self) -> &Arc<N> {
        &self.share
    }

    /// The hold of a lane binding `queues`: this hold's rules that steer onto one of them
    /// (its data port's, to its first queue) move to it; the others stay here.
    pub fn take_lane(&mut self, queues: &[u32]) -> Self {
        let (lane, rest) = std::mem::take(&mut self.rules)
            .into_iter()
            .partition(|r| queues.contains(&r.queue));
        self.rules = rest;
        Self::new(Arc::clone(&self.share), lane)
    }

    /// Deletes the rules now and returns the setup (still held).
    fn let_go(self) -> Arc<N> {
        let share = Arc::clone(&self.share);
        drop(self);
        share
    }
}

impl<N: PortRules> Drop for NicHold<N> {
    fn drop(&mut self) {
        let rules = std::mem::take(&mut self.rules);
        if !rules.is_empty() {
            self.share.unsteer(&rules);
        }
    }
}

/// Deletes the port rules of a lane leaving its NIC's setup `s` (its bind failed, or its
/// binding closed while other lanes keep the setup), logging each one left.
pub(super) fn unsteer_ports(s: &mut NicSetup, rules: &[InsertedRule]) {
    let ifname = s.state().map(|st| st.ifname.clone()).unwrap_or_default();
    for &l in rules {
        match s.remove_flow(l) {
            Ok(RuleUndo::Removed) => {}
            Ok(left) => {
                tracing::warn!(%ifname, location = l.location, outcome = %left, "a port rule of a lane leaving its NIC (its bind failed or its binding closed): nothing deleted (see outcome)");
            }
            Err(e) => {
                tracing::warn!(%ifname, location = l.location, error = %e, "deleting a port rule of a lane leaving its NIC (its bind failed or its binding closed) failed");
            }
        }
    }
}

/// RX queues of an emulated NIC (bindings take the upper half unless told).
pub const EMU_RX_QUEUES: u32 = 16;

/// What backs a binding.
enum Backing {
    /// `receive = devmem-sim`: the emulator's memfd and freelist, bound to `queues` of the
    /// emulated NIC `nic` on the emulated `host`.
    Emulated {
        binding: Arc<EmuBinding>,
        emu: EmuConfig,
        host: Arc<EmuHost>,
        nic: String,
        queues: Vec<u32>,
    },
    /// `receive = devmem`: a udmabuf (host memory) or GPU memory bound to NIC RX queues.
    /// The netlink binding and the lane's hold on the NIC setup are dropped (unbind, the
    /// lane's port rules deleted, then the restore by the last lane) by [`RxRegion::unbind`].
    Kernel {
        // First: unbound (and the NIC restored by the last lane on it) before the memory goes.
        // The tuple drops in order: unbound, then the lane's port rules deleted.
        bound: Mutex<Option<Box<(RxBinding, NicHold)>>>,
        mem: KernelMem,
        id: u32,
        ifname: String,
        queues: Vec<u32>,
        /// Connections steered to each of `queues` now (same order).
        steered: Mutex<Vec<usize>>,
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
    /// Data connections reading through the binding now ([`Reading`]). Counted apart from
    /// the `Arc`'s references: one connection holds several (its receiver's settings, its
    /// reader, its steering rule), and other lanes' connections hold it for fault injection.
    readers: AtomicUsize,
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
    /// A queue another lane has bound on this NIC.
    #[error("RX queue {queue} is bound by another lane (bound now: {bound:?}); name other queues")]
    QueueBound {
        /// The queue asked for.
        queue: u32,
        /// The NIC's bound queues.
        bound: Vec<u32>,
    },
    /// The emulated host refused the NIC or the bind.
    #[error("the emulated NIC: {0}")]
    EmulatedNic(#[from] HostError),
    /// The lane's GPU memory does not export as a dma-buf (its self-test found so).
    #[error(
        "GPU {gpu} cannot bind its memory to NIC queues: {why}; use receive = \"host\" (pinned staging into the GPU) or memory = \"host\" with devmem"
    )]
    NoDmaBuf {
        /// The GPU.
        gpu: String,
        /// Why its export failed.
        why: String,
    },
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
    /// An emulated binding of `bytes` (`receive = devmem-sim`) on `queues` of the emulated
    /// NIC `nic` (its own dma-buf and id). With `cuda`, its memory is registered with the GPU
    /// and frags are gathered by the CUDA kernel.
    pub fn emulated(
        host: &Arc<EmuHost>,
        (nic, queues): (&str, &[u32]),
        bytes: usize,
        cuda: Option<Arc<CudaMemory>>,
    ) -> Result<Arc<Self>, BindError> {
        let rx_queues = queues.iter().max().map_or(0, |q| q + 1).max(EMU_RX_QUEUES);
        host.add_nic(nic, rx_queues)?;
        let binding = host.bind(nic, queues, bytes)?;
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
                host: Arc::clone(host),
                nic: nic.into(),
                queues: queues.to_vec(),
            },
            readers: AtomicUsize::new(0),
            counters: DevmemCounters::default(),
        }))
    }

    /// A real binding (`receive = devmem`) on `queues` of NIC `ifname`, already set up for
    /// them (`setup`: the lane's hold on the setup shared with the other lanes bound on the
    /// NIC, [`super::kernel`], with the lane's port rules): allocate `bytes` of memory (a
    /// udmabuf, or with `cuda` a GPU region exported as a dma-buf: GPU-direct), bind it to the
    /// queues. The binding keeps `setup` until it is unbound; a failure drops it (the lane's
    /// port rules deleted, the setup left to its other holders).
    pub fn bind_kernel(
        (ifname, ifindex): (&str, u32),
        queues: &[u32],
        bytes: usize,
        setup: NicHold,
        cuda: Option<Arc<CudaMemory>>,
    ) -> Result<Arc<Self>, BindError> {
        let (mem, gpu) = match cuda {
            None => (
                KernelMem::Host(DmabufMem::udmabuf(bytes).map_err(BindError::Dmabuf)?),
                None,
            ),
            Some(cuda) => {
                if let Some(why) = &cuda.dma_buf_refused {
                    return Err(BindError::NoDmaBuf {
                        gpu: shardwire_gpu::probe::device_text(&cuda.info),
                        why: why.clone(),
                    });
                }
                let region = VmmRegion::new(&cuda.device, bytes).map_err(BindError::Gpu)?;
                // A default mapping was said once, when the lane opened the GPU
                // (`CudaMemory::dma_buf_default_mapping`), not at every bind.
                let (fd, _) = region.export_dmabuf_noting().map_err(BindError::Gpu)?;
                let gpu = GpuGather { cuda, mapped: None };
                (KernelMem::Gpu(region, fd), Some(gpu))
            }
        };
        let fd = match &mem {
            KernelMem::Host(m) => m.fd().as_raw_fd(),
            KernelMem::Gpu(_, fd) => fd.as_raw_fd(),
        };
        let binding = shardwire_devmem::bind_rx(ifindex, fd, queues)?;
        setup.share().claim(queues);
        Ok(Arc::new(Self {
            gpu,
            backing: Backing::Kernel {
                id: binding.id(),
                mem,
                ifname: ifname.into(),
                queues: queues.to_vec(),
                bound: Mutex::new(Some(Box::new((binding, setup)))),
                steered: Mutex::new(vec![0; queues.len()]),
            },
            readers: AtomicUsize::new(0),
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

    /// `(interface, queues)` the binding is bound to (an emulated NIC's for the emulator).
    pub fn queues(&self) -> (&str, &[u32]) {
        match &self.backing {
            Backing::Emulated { nic, queues, .. } => (nic, queues),
            Backing::Kernel { ifname, queues, .. } => (ifname, queues),
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
    pub(crate) fn mem(&self) -> Option<&DmabufMem> {
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
    pub(crate) fn gpu_source(&self) -> Option<(&CudaMemory, &dyn DeviceRange)> {
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

    /// Marks a data connection as reading through this binding until the guard is dropped
    /// ([`Self::readers`]).
    pub(crate) fn reading(self: &Arc<Self>) -> Reading {
        self.readers.fetch_add(1, Ordering::AcqRel);
        Reading(Arc::clone(self))
    }

    /// Data connections reading through this binding now (each counted once).
    pub fn readers(&self) -> usize {
        self.readers.load(Ordering::Acquire)
    }

    /// Stop handing out frags (shutdown). A kernel binding is unbound (its netlink socket
    /// closed), its lane's port rules deleted and, by the last lane on the NIC, the NIC
    /// restored; frags already out stay valid until their tokens return.
    pub fn unbind(&self) {
        match &self.backing {
            Backing::Emulated { binding, .. } => binding.unbind(),
            Backing::Kernel {
                bound,
                ifname,
                queues,
                ..
            } => {
                let taken = bound.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(pair) = taken {
                    let (binding, hold) = *pair;
                    drop(binding);
                    // The lane's port rules go now, under the setup's lock, whether or not other
                    // lanes keep the setup (before, they stayed until it was restored).
                    let share = hold.let_go();
                    // The last lane on the NIC restores it, even while connections' rules
                    // still hold the setup (the restore deletes every journaled rule).
                    if !share.release(queues) {
                        tracing::info!(%ifname, "devmem binding closed; the NIC's settings stay for its other lanes");
                        return;
                    }
                    let restored = share.setup().restore_now();
                    match restored {
                        Ok(changes) => {
                            tracing::info!(%ifname, ?changes, "devmem binding closed and NIC settings restored")
                        }
                        Err(e) => {
                            tracing::error!(%ifname, first_error = %e, "devmem binding closed, NIC restore incomplete: its state file is kept and the next start retries the steps left (each failed step is logged above)")
                        }
                    }
                }
            }
        }
    }

    /// Steers data connection `sock` to the least-loaded queue of this binding before its
    /// first payload byte: a 5-tuple rule on the emulated NIC, or an ntuple rule on the real
    /// one (`flow-type tcp4 src-ip .. dst-ip .. src-port .. dst-port .. action Q`, journaled
    /// with the NIC setup); deleted when the returned rule is dropped. A rule the NIC refuses
    /// fails the connection with the NIC's reason.
    pub(crate) fn steer(self: &Arc<Self>, sock: &TcpStream) -> io::Result<FlowRule> {
        match &self.backing {
            Backing::Emulated {
                host, nic, queues, ..
            } => {
                let flow = Flow::of(sock)?;
                let queue = host.least_loaded(nic, queues).unwrap_or(0);
                let rule = host
                    .insert_rule(flow, nic, queue)
                    .map_err(io::Error::other)?;
                Ok(FlowRule::Emulated { _rule: rule })
            }
            Backing::Kernel { .. } => self.steer_kernel(sock).inspect_err(|_| {
                self.counters
                    .flow_rule_failures
                    .fetch_add(1, Ordering::Relaxed);
            }),
        }
    }

    /// [`Self::steer`] on a kernel binding.
    fn steer_kernel(self: &Arc<Self>, sock: &TcpStream) -> io::Result<FlowRule> {
        let Backing::Kernel {
            bound,
            queues,
            steered,
            ifname,
            ..
        } = &self.backing
        else {
            unreachable!("a kernel binding")
        };
        let v4 = |a: SocketAddr| match a {
            SocketAddr::V4(a) => Some(a),
            // An IPv4 peer on a dual-stack listener.
            SocketAddr::V6(a) => a
                .ip()
                .to_ipv4_mapped()
                .map(|ip| std::net::SocketAddrV4::new(ip, a.port())),
        };
        let (peer, local) = (sock.peer_addr()?, sock.local_addr()?);
        let flow = match (v4(peer), v4(local)) {
            (Some(src), Some(dst)) => Tcp4Flow { src, dst },
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "{ifname}: devmem steering needs an IPv4 data connection (ntuple tcp4); {peer} -> {local} is not"
                    ),
                ));
            }
        };
        let share = match bound.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(pair) => Arc::clone(pair.1.share()),
            None => {
                return Err(io::Error::other(format!(
                    "{ifname}: the devmem binding is closed"
                )));
            }
        };
        let mut steered = steered.lock().unwrap_or_else(|p| p.into_inner());
        let at = least_loaded(&steered);
        let queue = queues[at];
        let added = share.setup().add_flow(flow, queue);
        let rule = added.map_err(|e| {
            // The NIC's errno stays the error's kind; the text names the NIC and the step.
            let kind = match &e {
                shardwire_devmem::nic::NicError::Kernel { errno, .. } => {
                    io::Error::from_raw_os_error(*errno).kind()
                }
                _ => io::ErrorKind::Other,
            };
            io::Error::new(kind, format!("steering the connection: {e}"))
        })?;
        steered[at] += 1;
        self.counters.flow_rules.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%ifname, queue, location = rule.location, src = %flow.src, dst = %flow.dst, "data connection steered");
        Ok(FlowRule::Kernel {
            region: Arc::clone(self),
            share,
            rule,
            at,
        })
    }

    /// Deletes the rule of a closed connection ([`FlowRule`]'s drop).
    fn unsteer(&self, share: &NicShare, rule: InsertedRule, at: usize) {
        let Backing::Kernel {
            steered, ifname, ..
        } = &self.backing
        else {
            return;
        };
        // The setup's lock is released before logging.
        let removed = share.setup().remove_flow(rule);
        match removed {
            Ok(RuleUndo::Removed) => {}
            Ok(left) => {
                tracing::warn!(%ifname, location = rule.location, outcome = %left, "a closed connection's steering rule: nothing deleted (see outcome)");
            }
            Err(e) => {
                tracing::warn!(%ifname, location = rule.location, error = %e, "deleting a closed connection's steering rule failed");
            }
        }
        let mut steered = steered.lock().unwrap_or_else(|p| p.into_inner());
        steered[at] = steered[at].saturating_sub(1);
        self.counters.flow_rules.fetch_sub(1, Ordering::Relaxed);
    }

    /// Fault injection: `sock`'s packets land on this binding's first queue whatever rule its
    /// flow has (the emulator's `misplace`); a kernel binding cannot be told so (a no-op).
    pub(crate) fn land_here(&self, sock: &TcpStream) -> io::Result<()> {
        if let Backing::Emulated {
            host, nic, queues, ..
        } = &self.backing
        {
            host.misplace(Flow::of(sock)?, nic, queues[0]);
        }
        Ok(())
    }

    /// The devmem socket of a data connection reading through this binding: the emulated
    /// host's (frags of the binding its flow is steered to, over ordinary TCP), or
    /// `recvmsg(MSG_SOCK_DEVMEM)` on the kernel's.
    pub(crate) fn recv_socket(
        self: &Arc<Self>,
        sock: TcpStream,
    ) -> io::Result<Box<dyn DevmemRecv + Send>> {
        Ok(match &self.backing {
            Backing::Emulated { host, emu, .. } => host
                .socket(sock, *emu)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
            Backing::Kernel { .. } => Box::new(DevmemSocket::new(sock)),
        })
    }
}

/// The index of the least-loaded queue (the first of equals).
fn least_loaded(steered: &[usize]) -> usize {
    (0..steered.len()).min_by_key(|&i| steered[i]).unwrap_or(0)
}

/// One data connection reading through a binding, counted in [`RxRegion::readers`] while it
/// lives.
#[derive(Debug)]
pub(crate) struct Reading(Arc<RxRegion>);

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.readers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A data connection's steering rule; deleted from its NIC when dropped (the connection
/// closed).
pub(crate) enum FlowRule {
    /// On the emulated NIC (its own drop deletes it).
    Emulated {
        /// Held for its drop.
        _rule: EmuRule,
    },
    /// An ntuple rule on the real NIC (`rule`: its location and match), steering to the
    /// binding's queue `at`.
    Kernel {
        region: Arc<RxRegion>,
        /// The NIC's setup, whose journal holds the rule (kept until the rule is deleted).
        share: NicShare,
        rule: InsertedRule,
        at: usize,
    },
}

impl Drop for FlowRule {
    fn drop(&mut self) {
        if let FlowRule::Kernel {
            region,
            share,
            rule,
            at,
        } = self
        {
            region.unsteer(share, *rule, *at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_go_to_the_least_loaded_queue_first_of_equals() {
        assert_eq!(least_loaded(&[2, 1, 1]), 1);
        assert_eq!(least_loaded(&[0, 0]), 0);
        assert_eq!(least_loaded(&[]), 0);
    }

    /// A NIC setup that records the locations of the port rules deleted from it.
    #[derive(Default)]
    struct Recorded(Mutex<Vec<u32>>);

    impl PortRules for Recorded {
        fn unsteer(&self, rules: &[InsertedRule]) {
            let mut deleted = self.0.lock().unwrap();
            deleted.extend(rules.iter().map(|r| r.location));
        }
    }

    fn deleted(nic: &Recorded) -> Vec<u32> {
        nic.0.lock().unwrap().clone()
    }

    fn port_rule(location: u32, port: u16, queue: u32) -> InsertedRule {
        InsertedRule {
            location,
            rule: shardwire_devmem::nic::steer::Tcp4Match::port(port),
            queue,
        }
    }

    #[test]
    fn a_lane_leaving_a_shared_nic_deletes_its_port_rule_and_no_other() {
        // Before, a lane's binding held the NIC's setup only: a binding deleted while other
        // lanes kept the setup left its port rule on the NIC until the node stopped.
        let nic = Arc::new(Recorded::default());
        let rules = vec![port_rule(1020, 7400, 8), port_rule(1021, 7401, 12)];
        let mut setup = NicHold::new(Arc::clone(&nic), rules);
        let a = setup.take_lane(&[8, 9, 10, 11]);
        let b = setup.take_lane(&[12, 13, 14, 15]);
        drop(setup);
        assert!(deleted(&nic).is_empty(), "each rule went to its lane");
        let share = b.let_go();
        assert_eq!(
            deleted(&nic),
            [1021],
            "lane b's rule, while a keeps the setup"
        );
        assert!(Arc::ptr_eq(&share, &nic), "the setup, still held after");
        drop(a);
        assert_eq!(deleted(&nic), [1021, 1020]);
    }

    #[test]
    fn rules_of_lanes_that_did_not_bind_are_deleted_with_the_setup() {
        // A lane whose bind failed drops its hold; a setup dropped before its other lanes
        // bound (an earlier lane failed) deletes theirs.
        let nic = Arc::new(Recorded::default());
        let rules = vec![port_rule(1020, 7400, 8), port_rule(1021, 7401, 12)];
        let mut setup = NicHold::new(Arc::clone(&nic), rules);
        drop(setup.take_lane(&[8]));
        assert_eq!(deleted(&nic), [1020]);
        // A lane without a rule of its own takes none.
        drop(setup.take_lane(&[9]));
        assert_eq!(deleted(&nic), [1020]);
        drop(setup);
        assert_eq!(deleted(&nic), [1020, 1021]);
    }
}
