//! Several emulated NICs on one host, each with its own queues and dma-buf bindings, and the
//! steering table that decides which queue (so which binding's dma-buf) a connection's
//! packets land in. One devmem binding per lane needs this: a host with 8 GPU/NIC pairs binds
//! one dma-buf per pair, and a flow's payload must land in its own pair's memory.
//!
//! What it models, as the kernel does it (reference devmem.md, multi-gpu-nic.md §1-2):
//! * [`EmuHost::add_nic`]: a NIC with `rx_queues` RX queues.
//! * [`EmuHost::bind`]: `bind-rx` of a fresh dma-buf to a queue set of one NIC. The binding
//!   id is host-unique, allocated cyclically from 1 as the kernel's `xa_alloc_cyclic` does for
//!   netdev bindings; a queue already bound (`EEXIST`, as the kernel) or past the NIC's count (`ERANGE`) is
//!   refused. One dma-buf is never bound to two NICs: each `bind` makes its own.
//! * [`EmuHost::insert_rule`]: an ntuple rule (`flow-type tcp4 src-ip dst-ip src-port
//!   dst-port action QUEUE`) placing a connection's packets on one queue of one NIC; a queue
//!   past the NIC's count is refused (`EINVAL`), as ethtool's `ETHTOOL_SRXCLSRLINS` does.
//!   The returned [`EmuRule`] deletes the rule when dropped.
//! * [`EmuHost::socket`]: the receive side of an accepted connection. Its packets land where
//!   its flow's rule puts them: on a bound queue they are frags of that queue's binding
//!   ([`EmuSocket`]); with no rule (or on an unbound queue) RSS spreads them over queues
//!   without a binding (the NIC setup keeps RSS off the devmem queues), so they arrive as
//!   ordinary TCP with no cmsg ([`PlainRecv`]), as `recvmsg(MSG_SOCK_DEVMEM)` returns them.
//!   Placement is fixed when the socket is made: the node installs the rule before the first
//!   payload byte (the ready gate), and the emulator does not move a live flow.
//! * [`EmuHost::misplace`], the test hook: a flow's packets land on another NIC's queue (a
//!   stale or wrong rule, a misrouted flow), so its frags carry another binding's id: what
//!   the receiver's per-lane check must catch.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, Weak};

use super::{EmuBinding, EmuConfig, EmuError, EmuSocket};
use crate::DevmemRecv;
use crate::socket::{DevmemError, RecvBatch, TokenBatcher};

/// A TCP connection's 5-tuple as the receiving host sees it (protocol: TCP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    /// The receiver's address (`dst-ip`, `dst-port` of the rule).
    pub local: SocketAddr,
    /// The sender's address (`src-ip`, `src-port`).
    pub peer: SocketAddr,
}

impl Flow {
    /// The flow of a connected socket, from the receiver's side.
    pub fn of(sock: &TcpStream) -> io::Result<Self> {
        Ok(Self {
            local: sock.local_addr()?,
            peer: sock.peer_addr()?,
        })
    }
}

/// Where a flow's packets land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The NIC.
    pub nic: String,
    /// The RX queue.
    pub queue: u32,
}

/// Why the emulated host refused a change (each names the kernel's errno).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// No NIC of that name.
    #[error("no emulated NIC named {0} (ENODEV)")]
    NoNic(String),
    /// A queue past the NIC's count.
    #[error("{nic} has {rx_queues} RX queues; queue {queue} does not exist (ERANGE/EINVAL)")]
    NoQueue {
        /// The NIC.
        nic: String,
        /// The queue.
        queue: u32,
        /// The NIC's queue count.
        rx_queues: u32,
    },
    /// A queue already has a binding: the kernel's `EEXIST` "designated queue already
    /// memory provider bound" (its `EBUSY` means a queue in use by AF_XDP).
    #[error("{nic} RX queue {queue} is already bound to binding {binding} (EEXIST)")]
    AlreadyBound {
        /// The NIC.
        nic: String,
        /// The queue.
        queue: u32,
        /// The binding holding it.
        binding: u32,
    },
    /// `bind-rx` with no queue.
    #[error("bind-rx on {0} with no queue (EINVAL)")]
    NoQueues(String),
    /// A rule for this flow exists already.
    #[error("an ntuple rule for {0:?} exists already (EEXIST)")]
    RuleExists(Flow),
    /// The dma-buf could not be made.
    #[error(transparent)]
    Binding(#[from] EmuBindError),
}

/// [`EmuError`] is not `Clone`; the host keeps its words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EmuBindError(String);

#[derive(Debug)]
struct Nic {
    rx_queues: u32,
    /// Queue -> the binding bound to it (gone when the binding is dropped).
    bound: HashMap<u32, Weak<EmuBinding>>,
}

#[derive(Debug, Default)]
struct State {
    nics: HashMap<String, Nic>,
    next_id: u32,
    next_loc: u32,
    /// Rule location -> (flow, placement).
    rules: HashMap<u32, (Flow, Placement)>,
    /// Test hook: flows whose packets land elsewhere than their rule says.
    misplaced: HashMap<Flow, Placement>,
}

/// The emulated host: its NICs, their bindings and the steering table.
#[derive(Debug, Default)]
pub struct EmuHost {
    state: Mutex<State>,
}

impl EmuHost {
    /// A host with no NIC.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds NIC `name` with `rx_queues` RX queues; adding it again (two lanes on one NIC)
    /// raises its count to the larger of the two, so each lane's queues exist.
    pub fn add_nic(&self, name: &str, rx_queues: u32) -> Result<(), HostError> {
        let mut s = self.lock();
        match s.nics.get_mut(name) {
            // Lanes sharing a NIC each ask for the queues they bind: the NIC has them all.
            Some(n) => {
                n.rx_queues = n.rx_queues.max(rx_queues);
                Ok(())
            }
            None => {
                let nic = Nic {
                    rx_queues,
                    bound: HashMap::new(),
                };
                s.nics.insert(name.into(), nic);
                Ok(())
            }
        }
    }

    /// `bind-rx`: a fresh dma-buf of `bytes` bound to `queues` of `nic`, with a new id.
    pub fn bind(
        &self,
        nic: &str,
        queues: &[u32],
        bytes: usize,
    ) -> Result<Arc<EmuBinding>, HostError> {
        let mut s = self.lock();
        if queues.is_empty() {
            return Err(HostError::NoQueues(nic.into()));
        }
        let n = s
            .nics
            .get(nic)
            .ok_or_else(|| HostError::NoNic(nic.into()))?;
        for &q in queues {
            if q >= n.rx_queues {
                return Err(HostError::NoQueue {
                    nic: nic.into(),
                    queue: q,
                    rx_queues: n.rx_queues,
                });
            }
            if let Some(b) = n
                .bound
                .get(&q)
                .and_then(Weak::upgrade)
                .filter(|b| !b.is_unbound())
            {
                return Err(HostError::AlreadyBound {
                    nic: nic.into(),
                    queue: q,
                    binding: b.id(),
                });
            }
        }
        s.next_id = s.next_id.checked_add(1).unwrap_or(1);
        let id = s.next_id;
        let binding =
            EmuBinding::new(id, bytes).map_err(|e: EmuError| EmuBindError(e.to_string()))?;
        let n = s.nics.get_mut(nic).expect("checked above");
        for &q in queues {
            n.bound.insert(q, Arc::downgrade(&binding));
        }
        Ok(binding)
    }

    /// Inserts the ntuple rule placing `flow` on `queue` of `nic`; dropping the returned rule
    /// deletes it.
    pub fn insert_rule(
        self: &Arc<Self>,
        flow: Flow,
        nic: &str,
        queue: u32,
    ) -> Result<EmuRule, HostError> {
        let mut s = self.lock();
        let n = s
            .nics
            .get(nic)
            .ok_or_else(|| HostError::NoNic(nic.into()))?;
        if queue >= n.rx_queues {
            return Err(HostError::NoQueue {
                nic: nic.into(),
                queue,
                rx_queues: n.rx_queues,
            });
        }
        if s.rules.values().any(|(f, _)| *f == flow) {
            return Err(HostError::RuleExists(flow));
        }
        s.next_loc += 1;
        let loc = s.next_loc;
        let place = Placement {
            nic: nic.into(),
            queue,
        };
        s.rules.insert(loc, (flow, place));
        Ok(EmuRule {
            host: Arc::clone(self),
            loc,
        })
    }

    /// Test hook: `flow`'s packets land on `queue` of `nic` whatever its rule says.
    pub fn misplace(&self, flow: Flow, nic: &str, queue: u32) {
        let place = Placement {
            nic: nic.into(),
            queue,
        };
        self.lock().misplaced.insert(flow, place);
    }

    /// The queue of `queues` on `nic` with the fewest rules (the first on a tie).
    pub fn least_loaded(&self, nic: &str, queues: &[u32]) -> Option<u32> {
        let s = self.lock();
        let load = |q: u32| {
            s.rules
                .values()
                .filter(|(_, p)| p.nic == nic && p.queue == q)
                .count()
        };
        queues.iter().copied().min_by_key(|&q| load(q))
    }

    /// Rules installed now.
    pub fn rules(&self) -> usize {
        self.lock().rules.len()
    }

    /// Where `flow`'s packets land now (`None`: RSS, no rule).
    pub fn placement(&self, flow: &Flow) -> Option<Placement> {
        let s = self.lock();
        if let Some(p) = s.misplaced.get(flow) {
            return Some(p.clone());
        }
        s.rules
            .values()
            .find(|(f, _)| f == flow)
            .map(|(_, p)| p.clone())
    }

    /// The live binding on `queue` of `nic`.
    fn bound(&self, p: &Placement) -> Option<Arc<EmuBinding>> {
        let s = self.lock();
        let b = s.nics.get(&p.nic)?.bound.get(&p.queue)?.upgrade()?;
        (!b.is_unbound()).then_some(b)
    }

    /// The receive socket of accepted connection `sock`: frags of the binding its flow is
    /// placed on, or ordinary TCP when it lands on a queue without one.
    pub fn socket(
        &self,
        sock: TcpStream,
        cfg: EmuConfig,
    ) -> Result<Box<dyn DevmemRecv + Send>, EmuError> {
        let flow = Flow::of(&sock).map_err(EmuError::Socket)?;
        match self.placement(&flow).and_then(|p| self.bound(&p)) {
            Some(binding) => Ok(Box::new(EmuSocket::new(sock, binding, cfg)?)),
            None => Ok(Box::new(PlainRecv { sock })),
        }
    }
}

/// An installed ntuple rule; deleted when dropped (the connection closed).
#[derive(Debug)]
pub struct EmuRule {
    host: Arc<EmuHost>,
    loc: u32,
}

impl EmuRule {
    /// The rule's location (`ethtool -n` `Filter:`).
    pub fn location(&self) -> u32 {
        self.loc
    }
}

impl Drop for EmuRule {
    /// The rule goes with its connection, and so does a misplacement of its flow (a later
    /// connection reusing the 5-tuple starts steered right).
    fn drop(&mut self) {
        let mut s = self.host.lock();
        if let Some((flow, _)) = s.rules.remove(&self.loc) {
            s.misplaced.remove(&flow);
        }
    }
}

/// A connection whose packets land on a queue without a binding: `recvmsg(MSG_SOCK_DEVMEM)`
/// returns its bytes as ordinary TCP, in the iov, with no cmsg.
#[derive(Debug)]
pub struct PlainRecv {
    sock: TcpStream,
}

impl DevmemRecv for PlainRecv {
    fn recv_frags(&mut self, iov_buf: &mut [u8]) -> Result<RecvBatch<'_>, DevmemError> {
        let n = loop {
            match self.sock.read(iov_buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r,
            }
        };
        let n = n.map_err(|source| DevmemError::Syscall {
            call: "recvmsg(MSG_SOCK_DEVMEM) [emulated, unbound queue]",
            source,
        })?;
        RecvBatch::parse(n, &[], false)
    }

    fn return_tokens(&mut self, batcher: &mut TokenBatcher) -> Result<usize, DevmemError> {
        // No frag, no token: a plain batch queues none.
        batcher.flush_with(|_| Err(io::Error::from_raw_os_error(libc::EINVAL)))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;
    use crate::cmsg::Frag;

    const MIB: usize = 1 << 20;

    /// A connection from `src` to a listener on `dst`: (receiver side, its flow); `payload`
    /// is written from a thread.
    fn conn(dst: &str, payload: Vec<u8>) -> (TcpStream, Flow, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind(dst).unwrap();
        let addr = l.local_addr().unwrap();
        let w = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&payload).unwrap();
        });
        let (s, _) = l.accept().unwrap();
        let flow = Flow::of(&s).unwrap();
        (s, flow, w)
    }

    /// Reads `n` bytes; returns the binding ids the frags named (0 for plain bytes).
    fn ids(sock: &mut dyn DevmemRecv, n: usize) -> Vec<u32> {
        let (mut got, mut out, mut buf) = (0, Vec::new(), vec![0u8; 64 << 10]);
        let mut tokens = TokenBatcher::new();
        while got < n {
            let b = sock.recv_frags(&mut buf).unwrap();
            assert!(!b.is_eof());
            got += b.bytes();
            if b.summary().dmabuf_frags == 0 {
                out.push(0);
            }
            for f in b.frags() {
                if let Frag::Dmabuf { dmabuf_id, .. } = f {
                    out.push(dmabuf_id);
                }
            }
            tokens.push_batch(&b);
            sock.return_tokens(&mut tokens).unwrap();
        }
        out.dedup();
        out
    }

    #[test]
    fn bindings_get_their_own_ids_and_queues() {
        let host = EmuHost::new();
        host.add_nic("eth1", 16).unwrap();
        host.add_nic("eth1", 8).unwrap(); // a lane needing fewer: the NIC keeps 16
        host.add_nic("eth1", 22).unwrap(); // a lane binding queues up to 21: the NIC has them
        host.bind("eth1", &[20, 21], MIB).unwrap();
        let a = host.bind("eth1", &[8, 9], MIB).unwrap();
        let b = host.bind("eth1", &[10, 11], MIB).unwrap();
        assert_ne!(a.id(), b.id());
        assert_eq!(
            host.bind("eth1", &[11, 12], MIB).unwrap_err(),
            HostError::AlreadyBound {
                nic: "eth1".into(),
                queue: 11,
                binding: b.id()
            }
        );
        assert!(matches!(
            host.bind("eth1", &[22], MIB),
            Err(HostError::NoQueue { queue: 22, .. })
        ));
        assert!(matches!(host.bind("eth9", &[1], MIB), Err(HostError::NoNic(n)) if n == "eth9"));
        b.unbind();
        let c = host.bind("eth1", &[10, 11], MIB).unwrap();
        assert!(
            c.id() > b.id(),
            "ids are allocated cyclically, not reused at once"
        );
    }

    #[test]
    fn each_flow_lands_in_its_rules_binding_and_unsteered_flows_are_plain() {
        let host = EmuHost::new();
        host.add_nic("eth1", 16).unwrap();
        host.add_nic("eth2", 16).unwrap();
        let b1 = host.bind("eth1", &[8], MIB).unwrap();
        let b2 = host.bind("eth2", &[8], MIB).unwrap();
        let (s1, f1, w1) = conn("127.0.0.1:0", vec![1; 300_000]);
        let (s2, f2, w2) = conn("127.0.0.2:0", vec![2; 300_000]);
        let (s3, _, w3) = conn("127.0.0.1:0", vec![3; 100_000]);
        let r1 = host.insert_rule(f1, "eth1", 8).unwrap();
        let _r2 = host.insert_rule(f2, "eth2", 8).unwrap();
        assert!(matches!(
            host.insert_rule(f1, "eth1", 9),
            Err(HostError::RuleExists(_))
        ));
        assert!(matches!(
            host.insert_rule(f1, "eth1", 99),
            Err(HostError::NoQueue { .. })
        ));
        assert_eq!(host.rules(), 2);
        assert_eq!(host.least_loaded("eth1", &[8, 9]), Some(9));
        let cfg = EmuConfig::default();
        assert_eq!(ids(&mut *host.socket(s1, cfg).unwrap(), 300_000), [b1.id()]);
        assert_eq!(ids(&mut *host.socket(s2, cfg).unwrap(), 300_000), [b2.id()]);
        assert_eq!(ids(&mut *host.socket(s3, cfg).unwrap(), 100_000), [0]);
        drop(r1);
        assert_eq!(host.rules(), 1);
        assert_eq!(host.placement(&f1), None);
        for w in [w1, w2, w3] {
            w.join().unwrap();
        }
    }

    #[test]
    fn a_misplaced_flow_carries_the_other_bindings_id() {
        let host = EmuHost::new();
        host.add_nic("eth1", 16).unwrap();
        host.add_nic("eth2", 16).unwrap();
        let _b1 = host.bind("eth1", &[8], MIB).unwrap();
        let b2 = host.bind("eth2", &[8], MIB).unwrap();
        let (s, f, w) = conn("127.0.0.1:0", vec![7; 50_000]);
        let rule = host.insert_rule(f, "eth1", 8).unwrap();
        host.misplace(f, "eth2", 8);
        assert_eq!(
            ids(&mut *host.socket(s, EmuConfig::default()).unwrap(), 50_000),
            [b2.id()]
        );
        assert_eq!(b2.free_niovs(), b2.num_niovs(), "every token came back");
        w.join().unwrap();
        // The misplacement goes with the rule: the same 5-tuple steered again lands right.
        drop(rule);
        assert_eq!(host.placement(&f), None);
        let _again = host.insert_rule(f, "eth1", 8).unwrap();
        assert_eq!(host.placement(&f).map(|p| p.nic), Some("eth1".into()));
    }
}
