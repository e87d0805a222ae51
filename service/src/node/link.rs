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
use shardwire_protocol::wire::{self, EncodeError, ErrorCode, Message};
use shardwire_source::framing::{FrameError, encode_frame, read_message, write_message};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::Instant;

use super::Node;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const MANIFEST_TIMEOUT: Duration = Duration::from_secs(15);
/// A control write the source does not take within this time ends the session.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// The stream it is for (to cancel it when the stream closes).
    pub stream: u64,
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
    /// The source dropped it on the node's request (its stream closed).
    Cancelled,
}

/// Why a message could not be sent on a link.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The link is not connected.
    #[error("source {0} is not connected")]
    Down(String),
    /// The message cannot be encoded (a field over its wire limit); the link is unaffected.
    #[error("cannot send to source {addr}: {source}")]
    Encode {
        /// The source.
        addr: String,
        /// Which field and limit.
        #[source]
        source: EncodeError,
    },
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
    /// Encoded frames for the session's writer.
    ctl: Option<mpsc::UnboundedSender<Vec<u8>>>,
    conns: Vec<Option<std::sync::mpsc::Sender<PendingFetch>>>,
    data_socks: Vec<TcpStream>,
}

type ManifestWaiter = oneshot::Sender<Result<Vec<u8>, String>>;

/// A FETCH the node asked the source to cancel: counted, and kept pending until the source
/// answers (a `Shard` if it was already on its way, `Error{Cancelled}` otherwise).
#[derive(Debug, Default)]
pub struct CancelCounts {
    /// Cancels sent.
    pub sent: AtomicU64,
    /// Fetches the source confirmed it dropped.
    pub confirmed: AtomicU64,
}

/// One configured source.
pub struct SourceLink {
    /// Position in the configuration.
    pub index: usize,
    /// HOST:PORT.
    pub addr: String,
    state: Mutex<LinkState>,
    pending: Mutex<HashMap<u64, PendingFetch>>,
    manifest_waiters: Mutex<HashMap<u64, ManifestWaiter>>,
    up: AtomicBool,
    abort: Notify,
    /// Payload bytes received from this source.
    pub bytes: AtomicU64,
    /// Last connection error, for status.
    pub last_error: Mutex<Option<String>>,
    /// Cancelled fetches.
    pub cancels: CancelCounts,
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
            cancels: CancelCounts::default(),
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

    /// Encodes `msg` and queues it for the session's writer. A message that cannot be
    /// encoded fails here, for this caller only: the session never sees it.
    fn send(&self, st: &LinkState, msg: &Message) -> Result<(), SendError> {
        let frame = encode_frame(msg).map_err(|source| SendError::Encode {
            addr: self.addr.clone(),
            source,
        })?;
        st.ctl
            .as_ref()
            .and_then(|ctl| ctl.send(frame).ok())
            .ok_or_else(|| SendError::Down(self.addr.clone()))
    }

    /// Sends a FETCH; gives the fetch back if it cannot be sent.
    pub fn fetch(
        &self,
        req: u64,
        dataset: &str,
        mut p: PendingFetch,
    ) -> Result<(), Box<(PendingFetch, SendError)>> {
        let st = self.state.lock().expect("poisoned");
        let msg = Message::Fetch {
            req,
            dataset: dataset.into(),
            shard: p.shard,
        };
        p.req = req;
        // Pending before the send, so an answer can never come for an unknown request.
        self.pending.lock().expect("poisoned").insert(req, p);
        match self.send(&st, &msg) {
            Ok(()) => Ok(()),
            Err(e) => {
                let p = self.pending.lock().expect("poisoned").remove(&req);
                Err(Box::new((p.expect("just inserted"), e)))
            }
        }
    }

    /// Asks the source to drop the FETCHes of `stream` it has not announced yet; they stay
    /// pending until it answers. Returns how many cancels were sent.
    pub fn cancel_stream(&self, stream: u64) -> usize {
        let st = self.state.lock().expect("poisoned");
        let reqs: Vec<u64> = self
            .pending
            .lock()
            .expect("poisoned")
            .values()
            .filter(|p| p.stream == stream)
            .map(|p| p.req)
            .collect();
        let sent = reqs
            .iter()
            .filter(|&&req| self.send(&st, &Message::Cancel { req }).is_ok())
            .count();
        self.cancels.sent.fetch_add(sent as u64, Ordering::Relaxed);
        sent
    }

    /// Asks the source for `dataset`'s manifest JSON; `req` identifies the request (the
    /// source's answer or error names it, so only this request can fail by it).
    pub async fn request_manifest(&self, req: u64, dataset: &str) -> Result<Vec<u8>, String> {
        let (tx, rx) = oneshot::channel();
        {
            let st = self.state.lock().expect("poisoned");
            self.manifest_waiters
                .lock()
                .expect("poisoned")
                .insert(req, tx);
            let msg = Message::ManifestRequest {
                req,
                dataset: dataset.into(),
            };
            if let Err(e) = self.send(&st, &msg) {
                self.manifest_waiters.lock().expect("poisoned").remove(&req);
                return Err(e.to_string());
            }
        }
        let answer = tokio::time::timeout(MANIFEST_TIMEOUT, rx).await;
        self.manifest_waiters.lock().expect("poisoned").remove(&req);
        match answer {
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
        for (_, w) in self.manifest_waiters.lock().expect("poisoned").drain() {
            let _ = w.send(Err(reason.to_string()));
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
    #[error("connecting to {addr} failed: {source}")]
    Connect {
        /// The source's address.
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
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
    /// The source sent nothing for its idle timeout.
    #[error("the source sent nothing for {0:?} (idle timeout)")]
    Idle(Duration),
    /// A control write did not finish in time.
    #[error("a control write did not finish within {0:?} (the source stopped reading)")]
    WriteTimeout(Duration),
}

/// What the handshake settled.
struct Established {
    generation: u64,
    idle: Duration,
}

async fn session(node: &Arc<Node>, link: &Arc<SourceLink>) -> Result<(), LinkError> {
    let stream = tokio::net::TcpStream::connect(&link.addr)
        .await
        .map_err(|source| LinkError::Connect {
            addr: link.addr.clone(),
            source,
        })?;
    let _ = stream.set_nodelay(true);
    let local_ip = stream
        .local_addr()
        .map_err(|source| LinkError::Connect {
            addr: link.addr.clone(),
            source,
        })?
        .ip();
    let data_addr = if node.data_addr.ip().is_unspecified() {
        SocketAddr::new(local_ip, node.data_addr.port())
    } else {
        node.data_addr
    };
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let mut buf = Vec::new();
    let hs = handshake(node, &mut rd, &mut wr, &mut buf, data_addr);
    let idle = tokio::time::timeout(HANDSHAKE_TIMEOUT, hs)
        .await
        .map_err(|_| LinkError::Timeout(HANDSHAKE_TIMEOUT))??;

    let (ctl_tx, ctl_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let flows = node.cfg.flows;
    let generation = {
        let mut st = link.state.lock().expect("poisoned");
        st.generation += 1;
        st.ctl = Some(ctl_tx);
        st.conns = (0..flows).map(|_| None).collect();
        st.generation
    };
    link.up.store(true, Ordering::Release);
    *link.last_error.lock().expect("poisoned") = None;
    tracing::info!(source = %link.addr, %data_addr, flows, authenticated = node.secret.is_some(), ?idle, "source link up");
    let est = Established { generation, idle };
    serve_session(node, link, &mut rd, wr, &mut buf, ctl_rx, est).await
}

/// Hello, Challenge, Auth, Welcome; returns the source's idle timeout.
async fn handshake<R, W>(
    node: &Node,
    rd: &mut R,
    wr: &mut W,
    buf: &mut Vec<u8>,
    data_addr: SocketAddr,
) -> Result<Duration, LinkError>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let secret = node.secret.as_deref();
    let mut nonce = [0u8; NONCE_LEN];
    rustix::rand::getrandom(&mut nonce, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| FrameError::Io(e.into()))?;
    let node_id = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let hello = Message::Hello {
        node_id,
        nonce,
        data_addr,
        flows: node.cfg.flows,
    };
    write_message(wr, &hello).await?;
    // Until the source has proved the secret, it gets no more than a small frame.
    let small = wire::MAX_SMALL_FRAME;
    let (src_nonce, auth_required) = match read_message(rd, buf, small).await? {
        Message::Challenge {
            nonce,
            auth_required,
        } => (nonce, auth_required),
        other => return Err(unexpected("Challenge", other)),
    };
    if secret.is_some() && !auth_required {
        return Err(LinkError::Auth(
            "the source does not check a secret but this node has one; configure the same secret file on the source",
        ));
    }
    let mac = secret.map_or([0; 32], |s| auth::proof(s, Role::Node, &nonce, &src_nonce));
    write_message(wr, &Message::Auth { mac }).await?;
    match read_message(rd, buf, small).await? {
        Message::Welcome {
            mac,
            idle_timeout_s,
        } => {
            if let Some(s) = secret
                && !auth::ct_eq(&mac, &auth::proof(s, Role::Source, &nonce, &src_nonce))
            {
                return Err(LinkError::Auth(
                    "the source's proof is wrong (different secret?)",
                ));
            }
            Ok(Duration::from_secs(idle_timeout_s.into()))
        }
        other => Err(unexpected("Welcome", other)),
    }
}

/// The error for a handshake message other than the one expected.
fn unexpected(expected: &str, got: Message) -> LinkError {
    match got {
        Message::Error { code, message, .. } => LinkError::Refused { code, message },
        other => LinkError::Protocol(format!("expected {expected}, got {other:?}")),
    }
}

/// Writes queued frames (each within [`WRITE_TIMEOUT`]) and a `Ping` whenever nothing was
/// written for a third of the idle timeout.
async fn write_frames<W: tokio::io::AsyncWrite + Unpin>(
    mut wr: W,
    mut frames: mpsc::UnboundedReceiver<Vec<u8>>,
    idle: Duration,
) -> Result<(), LinkError> {
    let keepalive = (idle / 3).max(Duration::from_millis(300));
    let ping = encode_frame(&Message::Ping).map_err(FrameError::from)?;
    loop {
        let frame = match tokio::time::timeout(keepalive, frames.recv()).await {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(()),
            Err(_) => ping.clone(),
        };
        tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(&frame))
            .await
            .map_err(|_| LinkError::WriteTimeout(WRITE_TIMEOUT))?
            .map_err(FrameError::from)?;
    }
}

/// Reads and handles the source's messages until the session ends.
async fn serve_session<R: tokio::io::AsyncRead + Unpin, W: tokio::io::AsyncWrite + Unpin>(
    node: &Arc<Node>,
    link: &Arc<SourceLink>,
    rd: &mut R,
    wr: W,
    buf: &mut Vec<u8>,
    frames: mpsc::UnboundedReceiver<Vec<u8>>,
    est: Established,
) -> Result<(), LinkError> {
    let writer = write_frames(wr, frames, est.idle);
    tokio::pin!(writer);
    loop {
        let heard_by = Instant::now() + est.idle;
        let msg = tokio::select! {
            m = read_message(rd, buf, wire::MAX_FRAME) => m?,
            w = &mut writer => { w?; return Err(LinkError::Frame(FrameError::Closed)); }
            _ = link.abort.notified() => return Err(LinkError::DataFailed),
            _ = tokio::time::sleep_until(heard_by) => return Err(LinkError::Idle(est.idle)),
        };
        handle(node, link, est.generation, msg)?;
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
        Message::Manifest { req, dataset, json } => {
            match link.manifest_waiters.lock().expect("poisoned").remove(&req) {
                Some(w) => {
                    let _ = w.send(Ok(json));
                }
                None => {
                    tracing::debug!(source = %link.addr, req, %dataset, "manifest for a request that gave up")
                }
            }
        }
        Message::Error { req, code, message } => error_for(link, req, code, message),
        Message::Ping => {}
        other => {
            return Err(LinkError::Protocol(format!(
                "unexpected message from source: {other:?}"
            )));
        }
    }
    Ok(())
}

/// An `Error` from the source fails the one request it names (a fetch or a manifest
/// request) and nothing else; one about no request is logged.
fn error_for(link: &SourceLink, req: u64, code: ErrorCode, message: String) {
    if req == 0 {
        tracing::warn!(source = %link.addr, ?code, %message, "source reported an error");
        return;
    }
    if let Some(p) = link.pending.lock().expect("poisoned").remove(&req) {
        if code == ErrorCode::Cancelled {
            link.cancels.confirmed.fetch_add(1, Ordering::Relaxed);
            p.fail(FetchFailure::Cancelled);
        } else {
            p.fail(FetchFailure::Source(format!("{code:?}: {message}")));
        }
        return;
    }
    match link.manifest_waiters.lock().expect("poisoned").remove(&req) {
        Some(w) => {
            let _ = w.send(Err(format!("{code:?}: {message}")));
        }
        None => {
            tracing::debug!(source = %link.addr, req, ?code, %message, "error for a request no longer waiting")
        }
    }
}
