//! The data plane: the source links, the data-connection matcher, the RX binding (devmem or
//! its emulator, swapped at run time by the control task) and the GPU, and the receiver
//! threads it starts for each identified data connection.
//!
//! Links announce data connections to the plane through [`DataConns`]; the accept loop on
//! the data port hands it accepted sockets; a match starts a receiver on the path chosen for
//! the binding and memory in effect at that moment.

use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use shardwire_config::ReceiveMode;
use shardwire_gpu::cuda::CudaMemory;
use tokio::sync::watch;

use crate::binding::{BindingKind, RxRegion};
use crate::counters::{Counters, FlowStats};
use crate::fetch::{FetchFailure, InFlight};
use crate::link::{DataConns, SourceLink};
use crate::matcher::{Accepted, Matcher};
use crate::roster::Roster;
use crate::rx::{self, Conn, Setup, shared::Gpus};

/// A data connection a source announced and the node has not accepted yet.
#[derive(Debug)]
pub struct Expected {
    link: Arc<SourceLink>,
    conn: u16,
    generation: u64,
    queue: std::sync::mpsc::Receiver<InFlight>,
}

/// One identified data connection's counters, for `shardwire bench` and status.
#[derive(Debug, Clone)]
pub struct Flow {
    /// The source.
    pub source: String,
    /// Its connection number.
    pub conn: u16,
    /// Its counters.
    pub stats: Arc<FlowStats>,
}

/// The data plane.
pub struct DataPlane {
    /// The sources: configured and found by DNS ([`crate::discovery`]).
    pub roster: Arc<Roster>,
    matcher: Mutex<Matcher<TcpStream, Expected>>,
    rx: RwLock<Option<Arc<RxRegion>>>,
    /// The GPU stream regions live on (`memory = cuda`); `None`: host memory.
    pub cuda: Option<Arc<CudaMemory>>,
    /// The same, for the receive paths.
    gpus: Gpus,
    flows: Mutex<Vec<Flow>>,
    counters: Arc<Counters>,
    /// Plain-TCP host connections try io_uring ([`crate::rx::uring`]).
    io_uring: bool,
}

impl DataPlane {
    /// A plane over these sources, with this binding and GPU.
    pub fn new(
        roster: Arc<Roster>,
        rx: Option<Arc<RxRegion>>,
        cuda: Option<Arc<CudaMemory>>,
        counters: Arc<Counters>,
        io_uring: bool,
    ) -> Self {
        Self {
            roster,
            matcher: Mutex::default(),
            rx: RwLock::new(rx),
            gpus: Gpus::new(cuda.iter().cloned().collect()),
            cuda,
            flows: Mutex::default(),
            counters,
            io_uring,
        }
    }

    /// The RX binding new data connections read through (`None`: plain TCP).
    pub fn binding(&self) -> Option<Arc<RxRegion>> {
        self.rx.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the binding; data connections identified from now on use the new one.
    pub(crate) fn set_binding(&self, rx: Option<Arc<RxRegion>>) {
        *self.rx.write().unwrap_or_else(|p| p.into_inner()) = rx;
    }

    /// The receive path in effect.
    pub fn receive(&self) -> ReceiveMode {
        match self.binding() {
            None => ReceiveMode::Host,
            Some(r) if r.kind() == BindingKind::Emulated => ReceiveMode::DevmemSim,
            Some(_) => ReceiveMode::Devmem,
        }
    }

    /// Every data connection identified so far.
    pub fn flows(&self) -> Vec<Flow> {
        self.flows.lock().expect("poisoned").clone()
    }

    /// Makes every link reconnect (its data connections come back on the current path).
    pub fn reconnect_all(&self, reason: &str) {
        for l in self.roster.links() {
            l.kick(reason);
        }
    }

    /// A connection accepted on the data port.
    fn accepted(&self, sock: TcpStream, peer: SocketAddr) {
        let got = self
            .matcher
            .lock()
            .expect("poisoned")
            .accepted(peer, sock, Instant::now());
        match got {
            Accepted::Matched(sock, e) => self.start(sock, peer, e),
            Accepted::Held => {}
            Accepted::Refused(_) => {
                tracing::warn!(%peer, limit = crate::matcher::MAX_UNMATCHED, "too many unidentified data connections; refusing this one")
            }
        }
    }

    /// Starts the receiver of an identified connection.
    fn start(&self, sock: TcpStream, peer: SocketAddr, e: Expected) {
        let link = e.link;
        if !link.attach_data(e.generation, &sock) {
            tracing::debug!(%peer, "data connection for a link generation that is gone");
            return;
        }
        tracing::debug!(%peer, source = %link.addr, conn = e.conn, "data connection identified");
        let flow = Arc::new(FlowStats::default());
        self.flows.lock().expect("poisoned").push(Flow {
            source: link.addr.clone(),
            conn: e.conn,
            stats: Arc::clone(&flow),
        });
        let setup = Setup {
            binding: self.binding(),
            gpus: self.gpus.clone(),
            io_uring: self.io_uring,
        };
        let conn = Conn {
            link,
            conn: e.conn,
            queue: e.queue,
            flow,
            counters: Arc::clone(&self.counters),
        };
        rx::spawn(conn, sock, setup);
    }

    fn sweep(&self) {
        for (peer, _) in self.matcher.lock().expect("poisoned").sweep(Instant::now()) {
            tracing::warn!(%peer, "dropping a data connection that no authenticated source announced");
        }
    }
}

impl DataConns for DataPlane {
    fn announced(
        &self,
        link: &Arc<SourceLink>,
        generation: u64,
        conn: u16,
        addr: SocketAddr,
        queue: std::sync::mpsc::Receiver<InFlight>,
    ) {
        let e = Expected {
            link: Arc::clone(link),
            conn,
            generation,
            queue,
        };
        let matched = self.matcher.lock().expect("poisoned").expect(addr, e);
        if let Some((sock, e)) = matched {
            self.start(sock, addr, e);
        }
    }

    fn forget(&self, link: usize, generation: u64, reason: &str) {
        let gone = self
            .matcher
            .lock()
            .expect("poisoned")
            .forget(|e| e.link.index == link && e.generation == generation);
        for e in gone {
            while let Ok(f) = e.queue.try_recv() {
                f.finish(Err(FetchFailure::LinkDown {
                    source_addr: e.link.addr.clone(),
                    reason: reason.to_owned(),
                }));
            }
        }
    }
}

/// Accepts data connections until shutdown.
pub async fn accept_loop(
    plane: Arc<DataPlane>,
    listener: tokio::net::TcpListener,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = sweep.tick() => plane.sweep(),
            r = listener.accept() => match r {
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    match s.into_std().and_then(|s| { s.set_nonblocking(false)?; Ok(s) }) {
                        Ok(s) => plane.accepted(s, peer),
                        Err(e) => tracing::warn!(%peer, error = %e, "cannot take over data connection"),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "data accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}
