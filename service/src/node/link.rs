//! One node <-> source link: the control connection (handshake, manifests, FETCH and SHARD),
//! the data connections' queues, and reconnection with backoff.
//!
//! Ownership of a shard's slab while it is in flight: the link's pending table holds it from
//! FETCH until the SHARD announcement, then the announced connection's receiver holds it
//! until it reports the outcome. Only the current holder can report a failure, so a slab is
//! never re-issued while a receiver may still write into it.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardwire_gpu::Slab;
use shardwire_protocol::auth::{self, NONCE_LEN, Role};
use shardwire_protocol::wire::{ErrorCode, Message};
use shardwire_source::framing::{FrameError, read_message, write_message};
use tokio::io::BufReader;
use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::Node;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const MANIFEST_TIMEOUT: Duration = Duration::from_secs(15);

/// A shard fetch in flight.
pub struct PendingFetch {
    /// Destination slab (exactly `length` bytes).
    pub slab: Slab,
    /// Stream position it is for.
    pub pos: u64,
    /// Shard index.
    pub shard: u32,
    /// Payload length from the manifest.
    pub length: u64,
    /// CRC-32C from the manifest.
    pub crc32c: u32,
    /// Where the outcome goes.
    pub done: mpsc::UnboundedSender<FetchOutcome>,
    /// Index of the link that serves it.
    pub source: usize,
    /// When the FETCH was issued (for the fetch latency histogram).
    pub issued: std::time::Instant,
    /// Request id (set when the FETCH is sent), for the fetch's log span.
    pub req: u64,
}

/// Why a fetch did not produce a verified shard.
#[derive(Debug, Clone)]
pub enum FetchFailure {
    /// The payload arrived but its CRC-32C is wrong.
    Crc {
        /// CRC of the bytes received.
        got: u32,
        /// CRC from the manifest.
        want: u32,
    },
    /// The source failed or refused.
    Source(String),
}

/// What a fetch came to; the slab always comes back.
pub struct FetchOutcome {
    /// Stream position.
    pub pos: u64,
    /// Shard index.
    pub shard: u32,
    /// The slab (holding the verified payload on success).
    pub slab: Slab,
    /// Link index.
    pub source: usize,
    /// Success or why not.
    pub result: Result<(), FetchFailure>,
    /// When the FETCH was issued.
    pub issued: std::time::Instant,
}

impl PendingFetch {
    /// Reports failure, handing the slab back.
    pub fn fail(self, f: FetchFailure) {
        let _ = self.done.send(FetchOutcome {
            pos: self.pos,
            shard: self.shard,
            slab: self.slab,
            source: self.source,
            result: Err(f),
            issued: self.issued,
        });
    }
}

#[derive(Default)]
struct LinkState {
    generation: u64,
    ctl: Option<mpsc::UnboundedSender<Message>>,
    conns: Vec<Option<std::sync::mpsc::Sender<PendingFetch>>>,
    data_socks: Vec<TcpStream>,
}

type ManifestWaiter = oneshot::Sender<Result<Vec<u8>, String>>;

/// One configured source.
pub struct SourceLink {
    /// Position in the configuration.
    pub index: usize,
    /// HOST:PORT.
    pub addr: String,
    state: Mutex<LinkState>,
    pending: Mutex<HashMap<u64, PendingFetch>>,
    manifest_waiters: Mutex<HashMap<String, Vec<ManifestWaiter>>>,
    up: AtomicBool,
    abort: Notify,
    /// Payload bytes received from this source.
    pub bytes: AtomicU64,
    /// Last connection error, for status.
    pub last_error: Mutex<Option<String>>,
}

impl SourceLink {
    /// A link that is not connected yet.
    pub fn new(index: usize, addr: String) -> Arc<Self> {
        Arc::new(Self {
            index,
            addr,
            state: Mutex::default(),
            pending: Mutex::default(),
            manifest_waiters: Mutex::default(),
            up: AtomicBool::new(false),
            abort: Notify::new(),
            bytes: AtomicU64::new(0),
            last_error: Mutex::default(),
        })
    }

    /// True while the control connection is established and authenticated.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Fetches in flight on this link.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().expect("poisoned").len()
    }

    /// Asks the link to drop its current connection (a data connection failed).
    pub fn kick(&self) {
        self.abort.notify_waiters();
    }

    /// Sends a FETCH; gives the fetch back if the link is down.
    pub fn fetch(&self, req: u64, dataset: &str, p: PendingFetch) -> Result<(), PendingFetch> {
        let st = self.state.lock().expect("poisoned");
        let Some(ctl) = st.ctl.as_ref() else {
            return Err(p);
        };
        let shard = p.shard;
        let mut p = p;
        p.req = req;
        self.pending.lock().expect("poisoned").insert(req, p);
        if ctl
            .send(Message::Fetch {
                req,
                dataset: dataset.into(),
                shard,
            })
            .is_err()
        {
            return Err(self
                .pending
                .lock()
                .expect("poisoned")
                .remove(&req)
                .expect("just inserted"));
        }
        Ok(())
    }

    /// Asks the source for `dataset`'s manifest JSON.
    pub async fn request_manifest(&self, dataset: &str) -> Result<Vec<u8>, String> {
        let (tx, rx) = oneshot::channel();
        {
            let st = self.state.lock().expect("poisoned");
            let Some(ctl) = st.ctl.as_ref() else {
                return Err(format!("source {} is not connected", self.addr));
            };
            self.manifest_waiters
                .lock()
                .expect("poisoned")
                .entry(dataset.into())
                .or_default()
                .push(tx);
            let _ = ctl.send(Message::ManifestRequest {
                dataset: dataset.into(),
            });
        }
        match tokio::time::timeout(MANIFEST_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(format!("source {} disconnected", self.addr)),
            Err(_) => Err(format!(
                "source {} did not answer within {MANIFEST_TIMEOUT:?}",
                self.addr
            )),
        }
    }

    /// Called by the matcher when a data socket for `conn` was identified.
    pub fn attach_data(&self, generation: u64, sock: &TcpStream) -> bool {
        let mut st = self.state.lock().expect("poisoned");
        if st.generation != generation || st.ctl.is_none() {
            return false;
        }
        if let Ok(c) = sock.try_clone() {
            st.data_socks.push(c);
        }
        true
    }

    fn go_down(&self, node: &Node, reason: &str) {
        self.up.store(false, Ordering::Release);
        let generation = {
            let mut st = self.state.lock().expect("poisoned");
            st.ctl = None;
            st.conns.clear(); // receivers see their queue close once drained
            for s in st.data_socks.drain(..) {
                let _ = s.shutdown(std::net::Shutdown::Both); // unblocks receivers mid-payload
            }
            st.generation
        };
        node.matcher.forget(self.index, generation, reason);
        for (_, p) in self.pending.lock().expect("poisoned").drain() {
            p.fail(FetchFailure::Source(reason.to_string()));
        }
        for (_, ws) in self.manifest_waiters.lock().expect("poisoned").drain() {
            for w in ws {
                let _ = w.send(Err(reason.to_string()));
            }
        }
    }
}

/// Keeps the link connected until shutdown.
pub async fn run(node: Arc<Node>, link: Arc<SourceLink>, mut shutdown: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let result = tokio::select! {
            r = session(&node, &link) => r,
            _ = shutdown.changed() => Ok(()),
        };
        let reason = match &result {
            Ok(()) => "node shutting down".to_string(),
            Err(e) => format!("source {}: {e}", link.addr),
        };
        let was_up = link.is_up();
        link.go_down(&node, &reason);
        if *shutdown.borrow() {
            return;
        }
        if was_up {
            tracing::warn!(source = %link.addr, error = %reason, "source link down; reconnecting");
            backoff = Duration::from_millis(100);
        } else {
            tracing::debug!(source = %link.addr, error = %reason, "source not reachable; retrying");
        }
        *link.last_error.lock().expect("poisoned") = Some(reason);
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Why a link session ended.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Could not connect.
    #[error("connect failed: {0}")]
    Connect(std::io::Error),
    /// Framing/socket.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// Handshake timeout.
    #[error("handshake timed out after {0:?}")]
    Timeout(Duration),
    /// The source refused us.
    #[error("source refused: {code:?}: {message}")]
    Refused {
        /// Code.
        code: ErrorCode,
        /// Message.
        message: String,
    },
    /// Authentication problem.
    #[error("authentication: {0}")]
    Auth(&'static str),
    /// The source broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A data connection failed.
    #[error("a data connection from this source failed")]
    DataFailed,
}

async fn session(node: &Arc<Node>, link: &Arc<SourceLink>) -> Result<(), LinkError> {
    let stream = tokio::net::TcpStream::connect(&link.addr)
        .await
        .map_err(LinkError::Connect)?;
    let _ = stream.set_nodelay(true);
    let local_ip = stream.local_addr().map_err(LinkError::Connect)?.ip();
    let data_addr = if node.data_addr.ip().is_unspecified() {
        SocketAddr::new(local_ip, node.data_addr.port())
    } else {
        node.data_addr
    };
    let flows = node.cfg.flows;
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let mut buf = Vec::new();
    let secret = node.secret.clone();

    let hs = async {
        let mut nonce = [0u8; NONCE_LEN];
        rustix::rand::getrandom(&mut nonce, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| FrameError::Io(e.into()))?;
        let node_id = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        write_message(
            &mut wr,
            &Message::Hello {
                node_id,
                nonce,
                data_addr,
                flows,
            },
        )
        .await?;
        let (src_nonce, auth_required) = match read_message(&mut rd, &mut buf).await? {
            Message::Challenge {
                nonce,
                auth_required,
            } => (nonce, auth_required),
            Message::Error { code, message, .. } => {
                return Err(LinkError::Refused { code, message });
            }
            other => {
                return Err(LinkError::Protocol(format!(
                    "expected Challenge, got {other:?}"
                )));
            }
        };
        if secret.is_some() && !auth_required {
            return Err(LinkError::Auth(
                "the source does not check a secret but this node has one; configure the same secret file on the source",
            ));
        }
        let mac = secret
            .as_deref()
            .map_or([0; 32], |s| auth::proof(s, Role::Node, &nonce, &src_nonce));
        write_message(&mut wr, &Message::Auth { mac }).await?;
        match read_message(&mut rd, &mut buf).await? {
            Message::Welcome { mac } => {
                if let Some(s) = &secret
                    && !auth::ct_eq(&mac, &auth::proof(s, Role::Source, &nonce, &src_nonce))
                {
                    return Err(LinkError::Auth(
                        "the source's proof is wrong (different secret?)",
                    ));
                }
            }
            Message::Error { code, message, .. } => {
                return Err(LinkError::Refused { code, message });
            }
            other => {
                return Err(LinkError::Protocol(format!(
                    "expected Welcome, got {other:?}"
                )));
            }
        }
        Ok::<_, LinkError>(())
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, hs)
        .await
        .map_err(|_| LinkError::Timeout(HANDSHAKE_TIMEOUT))??;

    let (ctl_tx, mut ctl_rx) = mpsc::unbounded_channel::<Message>();
    let generation = {
        let mut st = link.state.lock().expect("poisoned");
        st.generation += 1;
        st.ctl = Some(ctl_tx);
        st.conns = (0..flows).map(|_| None).collect();
        st.generation
    };
    link.up.store(true, Ordering::Release);
    *link.last_error.lock().expect("poisoned") = None;
    tracing::info!(source = %link.addr, %data_addr, flows, authenticated = secret.is_some(), "source link up");

    let writer = async move {
        while let Some(m) = ctl_rx.recv().await {
            write_message(&mut wr, &m).await?;
        }
        Ok::<_, FrameError>(())
    };
    tokio::pin!(writer);
    loop {
        let msg = tokio::select! {
            m = read_message(&mut rd, &mut buf) => m?,
            w = &mut writer => { w?; return Err(LinkError::Frame(FrameError::Closed)); }
            _ = link.abort.notified() => return Err(LinkError::DataFailed),
        };
        handle(node, link, generation, msg)?;
    }
}

fn handle(
    node: &Arc<Node>,
    link: &Arc<SourceLink>,
    generation: u64,
    msg: Message,
) -> Result<(), LinkError> {
    match msg {
        Message::DataConn { conn, addr } => {
            let rx = {
                let mut st = link.state.lock().expect("poisoned");
                let slot = st.conns.get_mut(conn as usize).ok_or_else(|| {
                    LinkError::Protocol(format!("data connection {conn} >= flows"))
                })?;
                if slot.is_some() {
                    return Err(LinkError::Protocol(format!(
                        "data connection {conn} announced twice"
                    )));
                }
                let (tx, rx) = std::sync::mpsc::channel();
                *slot = Some(tx);
                rx
            };
            node.matcher
                .expect(node, addr, Arc::clone(link), conn, generation, rx);
        }
        Message::Shard {
            req,
            shard,
            length,
            crc32c,
            conn,
            seq,
        } => {
            let p = link
                .pending
                .lock()
                .expect("poisoned")
                .remove(&req)
                .ok_or_else(|| LinkError::Protocol(format!("SHARD for unknown request {req}")))?;
            if p.shard != shard || p.length != length || p.crc32c != crc32c {
                let msg = format!(
                    "SHARD req {req} says shard {shard}, {length} bytes, crc {crc32c:08x}; expected shard {}, {} bytes, crc {:08x}",
                    p.shard, p.length, p.crc32c
                );
                p.fail(FetchFailure::Source(msg.clone()));
                return Err(LinkError::Protocol(msg));
            }
            let st = link.state.lock().expect("poisoned");
            match st.conns.get(conn as usize).and_then(Option::as_ref) {
                Some(tx) => {
                    tracing::debug!(req, shard, conn, seq, "SHARD announced");
                    if let Err(e) = tx.send(p) {
                        e.0.fail(FetchFailure::Source("receiver gone".into()));
                        return Err(LinkError::DataFailed);
                    }
                }
                None => {
                    p.fail(FetchFailure::Source(format!(
                        "data connection {conn} was never announced"
                    )));
                    return Err(LinkError::Protocol(format!(
                        "SHARD on unannounced data connection {conn}"
                    )));
                }
            }
        }
        Message::Manifest { dataset, json } => {
            for w in link
                .manifest_waiters
                .lock()
                .expect("poisoned")
                .remove(&dataset)
                .unwrap_or_default()
            {
                let _ = w.send(Ok(json.clone()));
            }
        }
        Message::Error { req, code, message } => {
            if req != 0 {
                if let Some(p) = link.pending.lock().expect("poisoned").remove(&req) {
                    p.fail(FetchFailure::Source(format!("{code:?}: {message}")));
                }
            } else {
                tracing::warn!(source = %link.addr, ?code, %message, "source reported an error");
                for (_, ws) in link.manifest_waiters.lock().expect("poisoned").drain() {
                    for w in ws {
                        let _ = w.send(Err(format!("{code:?}: {message}")));
                    }
                }
            }
        }
        other => {
            return Err(LinkError::Protocol(format!(
                "unexpected message from source: {other:?}"
            )));
        }
    }
    Ok(())
}
