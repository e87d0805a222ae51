//! Receiver threads: one per data connection. Each takes the next announced payload
//! ([`InFlight`]) from its connection's queue, receives it into the shard's slab, checksums
//! it, and ends the fetch with the outcome.
//!
//! The path is chosen once, inside the thread, from the binding and memory in effect when the
//! connection was identified ([`spawn`]):
//! - [`uring`]: plain TCP into host memory over io_uring, the next payloads' slabs posted as
//!   the receive's buffers (where a ring can be set up and `io_uring` is on);
//! - [`recv`]: plain TCP into host memory with `recv`, each piece checksummed in cache;
//! - [`devmem`]: frags out of the RX binding's dma-buf, gathered into host slabs on the CPU
//!   or into CUDA slabs by the gather kernel (GPU-direct, CRC on the GPU);
//! - [`staged`]: CUDA memory without GPU-direct receive, through pinned buffers whose
//!   asynchronous H2D copies overlap the next reads.
//!
//! What they share ([`shared`]): the loop of the one-payload-at-a-time paths, the piece
//! callback, and how a fetch ends (delivered, CRC mismatch, or a broken connection that fails
//! its payload and every later one). A path that writes CUDA slabs uses the GPU that holds
//! each slab. Errors are [`error::RxError`].

pub mod copy;
pub mod devmem;
pub mod error;
pub mod recv;
pub mod shared;
pub mod staged;
pub mod uring;

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;

use self::devmem::{DevmemReader, GpuDirect};
use self::error::RxError;
use self::recv::{Host, Plain};
use self::shared::{ConnAt, DATA_STALL_TIMEOUT, Gpus, PaceRule, broken, run};
use self::staged::Staged;
use crate::binding::RxRegion;
use crate::counters::{Counters, FlowStats};
use crate::fetch::InFlight;
use crate::link::SourceLink;

/// An identified data connection: whose it is, and where its announced payloads queue.
pub struct Conn {
    /// The source link that announced it.
    pub link: Arc<SourceLink>,
    /// Its lane.
    pub lane: u32,
    /// Its connection number.
    pub conn: u16,
    /// The link session that announced it (its `DataReady` goes to that session only).
    pub generation: u64,
    /// The payloads announced on it, in order.
    pub queue: Receiver<InFlight>,
    /// Its counters.
    pub flow: Arc<FlowStats>,
    /// The node's counters.
    pub counters: Arc<Counters>,
}

impl Conn {
    /// The connection and its link session, as the receive loops name it.
    fn at(&self) -> ConnAt {
        ConnAt {
            conn: self.conn,
            generation: self.generation,
        }
    }
}

/// The receive settings in effect when the connection was identified.
#[derive(Default)]
pub struct Setup {
    /// The RX binding (`None`: plain TCP).
    pub binding: Option<Arc<RxRegion>>,
    /// Counts this connection once among its binding's readers, from when the plane chose
    /// its setup until its receiver thread ends (after its socket and steering rule are
    /// gone): a binding deleted meanwhile waits for it, even before it is steered.
    pub _reading: Option<crate::binding::Reading>,
    /// The node's GPUs (none: host memory).
    pub gpus: Gpus,
    /// Plain TCP into host memory tries io_uring.
    pub io_uring: bool,
    /// The CPUs the receiver thread runs on (its lane's; empty: not pinned).
    pub cpus: Arc<[u32]>,
    /// Fault injection (`fault_misplace`): the connection's packets land on this other
    /// lane's binding instead of its own.
    pub misplace: Option<Arc<RxRegion>>,
    /// Fault injection (`fault_spawn`): its receiver thread fails to start.
    pub fail_spawn: bool,
}

/// The path a connection's receiver runs.
enum RxPath {
    Uring(Box<shardwire_devmem::uring::RecvQueue<uring::Job>>),
    Recv(Plain),
    Devmem(DevmemReader),
    StagedPlain(Plain),
    StagedDevmem(DevmemReader),
    GpuDirect(GpuDirect),
}

/// Starts the receiver thread of an identified connection; it pins itself to its lane's CPUs
/// and chooses its path first.
/// A thread that cannot be made (out of threads or memory, a container's `pids.max`) fails
/// the connection's payloads and ends its link's session, as a broken connection does: the
/// fetches go elsewhere or wait for the next session, and the node goes on.
pub fn spawn(c: Conn, sock: TcpStream, setup: Setup) {
    let name = format!("sw-recv-{}-{}-{}", c.lane, c.link.index, c.conn);
    // The connection goes to the thread once it runs, so a failed spawn still has it.
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Conn, TcpStream, Setup)>(1);
    let fail = setup.fail_spawn;
    let body = move || {
        let Ok((c, sock, setup)) = rx.recv() else {
            return;
        };
        if !setup.cpus.is_empty()
            && let Err(e) = crate::lanes::affinity::pin_current(&setup.cpus)
        {
            tracing::warn!(lane = c.lane, conn = c.conn, error = %e, "cannot pin the receiver to its lane's CPUs; it runs anywhere");
        }
        run_conn(sock, &setup, &c);
    };
    let spawned = match fail {
        true => Err(std::io::Error::from_raw_os_error(libc::EAGAIN)),
        false => std::thread::Builder::new().name(name).spawn(body),
    };
    match spawned {
        Ok(_) => {
            if tx.send((c, sock, setup)).is_err() {
                tracing::error!("a receiver thread ended before it was given its connection");
            }
        }
        Err(e) => {
            let cause = RxError::io("spawning the receiver thread", &e);
            tracing::error!(source = %c.link.addr, conn = c.conn, %cause, "cannot start a data connection's receiver; dropping it");
            drop(sock);
            // Not `broken`, which waits for the queue to close: this caller may be the link's
            // session task, the only one that can close it (a deadlock, every stream of the
            // source stalled). The queue is dropped instead: a payload announced on it later
            // finds it gone, which ends the session.
            abandon(c, cause);
        }
    }
}

/// Fails the payloads queued on `c` now and drops its queue, without waiting; ends its link's
/// session.
fn abandon(c: Conn, cause: RxError) {
    c.link.kick_if(
        c.generation,
        &format!(
            "data connection {} from {} failed: {cause}",
            c.conn, c.link.addr
        ),
    );
    while let Ok(f) = c.queue.try_recv() {
        f.finish(Err(shared::lost(&c.link, c.conn, cause.clone())));
    }
}

/// A receiver thread's body: the path for its connection, then its payloads.
fn run_conn(sock: TcpStream, setup: &Setup, c: &Conn) {
    match choose(sock, setup, &c.counters) {
        Ok(path) => {
            // The path is set up (on a devmem lane, the flow is steered to the lane's
            // queues): only now may the source send payloads on this connection.
            c.link.data_ready(c.generation, c.conn);
            receive(path, c)
        }
        Err(cause) => {
            tracing::error!(source = %c.link.addr, conn = c.conn, %cause,
                "cannot read a data connection through the receive path; dropping it");
            broken([], &c.queue, &c.link, c.at(), cause);
        }
    }
}

/// The path for `sock` under `setup`, counted by kind (plain-TCP host connections only).
fn choose(sock: TcpStream, setup: &Setup, c: &Counters) -> Result<RxPath, RxError> {
    sock.set_read_timeout(Some(DATA_STALL_TIMEOUT))
        .map_err(|e| RxError::io("setsockopt(SO_RCVTIMEO)", &e))?;
    let host = setup.gpus.is_empty();
    let Some(binding) = &setup.binding else {
        if !host {
            return Ok(RxPath::StagedPlain(Plain::new(sock)));
        }
        if setup.io_uring
            && let Some(q) = uring::queue_for(&sock)
        {
            c.io_uring_connections.fetch_add(1, Ordering::Relaxed);
            return Ok(RxPath::Uring(Box::new(q)));
        }
        c.recv_connections.fetch_add(1, Ordering::Relaxed);
        return Ok(RxPath::Recv(Plain::new(sock)));
    };
    if let Some(onto) = &setup.misplace {
        onto.land_here(&sock)
            .map_err(|e| RxError::io("misplacing the flow (fault_misplace)", &e))?;
        tracing::warn!(
            binding = binding.id(),
            onto = onto.id(),
            "fault_misplace: this data connection's frags land on another lane's binding"
        );
    }
    let reader = DevmemReader::new(binding, sock)
        .map_err(|e| RxError::io("making the devmem socket", &e))?;
    Ok(match (host, reader.gpu_gather()) {
        (true, _) => RxPath::Devmem(reader),
        (false, true) => RxPath::GpuDirect(GpuDirect::new(reader, setup.gpus.clone())),
        (false, false) => RxPath::StagedDevmem(reader),
    })
}

/// Runs `path` until the connection's queue closes.
fn receive(path: RxPath, c: &Conn) {
    let (link, conn, q, flow, n) = (&*c.link, c.at(), &c.queue, &*c.flow, &*c.counters);
    let rule = PaceRule::DEFAULT;
    match path {
        RxPath::Uring(ring) => uring::run(*ring, link, conn, q, flow, n, rule),
        RxPath::Recv(p) => run(Host(p), link, conn, q, flow, n, rule),
        RxPath::Devmem(r) => run(Host(r), link, conn, q, flow, n, rule),
        RxPath::StagedPlain(p) => run(Staged::new(p, n), link, conn, q, flow, n, rule),
        RxPath::StagedDevmem(r) => run(Staged::new(r, n), link, conn, q, flow, n, rule),
        RxPath::GpuDirect(g) => run(g, link, conn, q, flow, n, rule),
    }
}
