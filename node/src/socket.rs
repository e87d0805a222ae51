//! The trainer Unix socket (docs/TRAINER_API.md): one thread per trainer connection, one
//! stream per connection. `attach` opens the stream and passes its region fd with
//! SCM_RIGHTS; `next` leases the next batch in plan order; `release` ends a lease. A
//! disconnect closes the stream and releases every lease, also while a `next` waits
//! ([`wait`]). A malformed frame gets an error
//! reply and drops that connection only. This front uses the node's stream interface alone.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shardwire_gpu::Slab;
use shardwire_protocol::fdpass::{self, FrameIoError, ReadLimits, ReadPhase};
use shardwire_protocol::trainer::{
    BatchEncoding, ErrorCode, MAX_NEXT_COUNT, MAX_TRAINER_FRAME, Request, Response, StreamRequest,
};
use tokio::sync::watch;

use crate::node::Node;
use crate::stream::{CloseReason, Next, Stream};

/// How long a refused trainer's connection is kept open, in all, so it reads the refusal.
const LINGER: Duration = Duration::from_secs(2);

/// Refused peers kept open for [`LINGER`] at once; past this one is closed right after its
/// refusal (its trainer may then see EPIPE before the reason). A refused peer gives its
/// connection slot back, so without this bound peers refused in a loop held a thread each.
const MAX_LINGERING: usize = 64;

/// Refused peers lingering now (bounded by [`MAX_LINGERING`]).
static LINGERING: AtomicUsize = AtomicUsize::new(0);

mod peer;
mod wait;

/// Failed releases (unknown leases) a trainer may send behind one waiting `next`; one more
/// ends the connection. Releases that succeed need no bound (each gives back a lease the
/// trainer held), but without this one a trainer sending `release` frames without end while
/// its `next` waited grew the node's queued answers without end (45 MB in 3 s).
pub const MAX_FAILED_BEHIND: usize = 1024;

/// Binds the socket (replacing a stale one) and starts the accept thread. The socket gets
/// its mode before it has its name: no trainer can connect under the umask's mode first.
pub fn start(node: Arc<Node>, path: &Path, shutdown: watch::Receiver<bool>) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
    }
    clear_stale(path)?;
    let mode = node
        .info()
        .cfg
        .socket_mode_bits()
        .map_err(std::io::Error::other)?;
    let unnamed = dir
        .unwrap_or(Path::new("."))
        .join(format!(".sw-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&unnamed);
    let listener = UnixListener::bind(&unnamed)?;
    let named = std::fs::set_permissions(&unnamed, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&unnamed, path));
    if let Err(e) = named {
        let _ = std::fs::remove_file(&unnamed);
        return Err(e);
    }
    std::thread::Builder::new()
        .name("sw-trainer-accept".into())
        .spawn(move || accept_loop(&node, &listener, &shutdown))?;
    Ok(())
}

/// Removes a socket at `path` that nobody listens on (a node's that stopped without removing
/// it). Anything else there is refused, not removed: a file that is not a socket (a `socket`
/// path set by mistake), or the socket of a node service that is running.
fn clear_stale(path: &Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket: set `socket` to another path, or remove the file",
                    path.display()
                ),
            ));
        }
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(Error::new(
            ErrorKind::AddrInUse,
            format!(
                "another node service listens on {}: stop it, or set `socket` to another path",
                path.display()
            ),
        )),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            std::fs::remove_file(path)?;
            tracing::info!(path = %path.display(), "removed a stale trainer socket");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// One thread per trainer connection, at most `trainer_max_connections` at once; a
/// connection over the limit is refused with an error frame naming the limit.
fn accept_loop(node: &Arc<Node>, listener: &UnixListener, shutdown: &watch::Receiver<bool>) {
    let active = Arc::new(AtomicUsize::new(0));
    let max = node.info().cfg.trainer_max_connections;
    for conn in listener.incoming() {
        if *shutdown.borrow() {
            return;
        }
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                // Out of fds, say: a pause, not a spin (as the HTTP server does).
                tracing::warn!(error = %e, "trainer accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= max {
            active.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("shardwire_trainer_refused_total", "reason" => "connections")
                .increment(1);
            tracing::warn!(
                limit = max,
                "trainer refused: trainer_max_connections reached"
            );
            let msg = format!(
                "this node serves at most {max} trainer connections at once (trainer_max_connections)"
            );
            let _ = reply(&s, &error(ErrorCode::TooManyConnections, msg), &[]);
            continue; // dropping `s` closes it; the trainer reads the refusal first
        }
        // Given back however the thread ends (or if it cannot start).
        let (node, slot) = (Arc::clone(node), Slot(Arc::clone(&active)));
        let spawned = std::thread::Builder::new()
            .name("sw-trainer".into())
            .spawn(move || serve(&node, s, slot));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a trainer thread");
        }
    }
}

/// One of the `trainer_max_connections` slots, taken by a connection until it is dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn reply(sock: &UnixStream, r: &Response, fds: &[BorrowedFd<'_>]) -> Result<(), FrameIoError> {
    let mut frame = Vec::with_capacity(256);
    r.encode(&mut frame);
    fdpass::send_frame(sock, &frame, fds)
}

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

/// After refusing a trainer: stop writing and read (and drop) what it sends until it closes,
/// for up to [`LINGER`] in all (a peer that trickles bytes does not keep the connection),
/// at most [`MAX_LINGERING`] peers at once.
/// Closing at once would make the trainer's first write fail with EPIPE before it reads the
/// refusal; this way it reads the error frame.
fn linger_for_the_request(sock: &UnixStream) {
    use std::io::Read;
    struct Lingering;
    impl Drop for Lingering {
        fn drop(&mut self) {
            LINGERING.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _ = sock.shutdown(std::net::Shutdown::Write);
    let _lingering = Lingering;
    if LINGERING.fetch_add(1, Ordering::AcqRel) >= MAX_LINGERING {
        return;
    }
    let deadline = Instant::now() + LINGER;
    let mut sink = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || sock.set_read_timeout(Some(left)).is_err() {
            return;
        }
        if !matches!((&*sock).read(&mut sink), Ok(n) if n > 0) {
            return;
        }
    }
}

/// Whether the peer may use the node: its uid in `allowed_uids`, or its primary gid or one of
/// its supplementary groups (`SO_PEERGROUPS`: a pod's `supplementalGroups` or `fsGroup`) in
/// `allowed_gids`. A refused peer gives its connection slot back, then gets the reason before
/// the connection closes (so peers refused in a loop cannot crowd out allowed trainers).
fn peer_allowed(node: &Node, sock: &UnixStream, slot: Slot) -> Option<Slot> {
    let cred = match peer::peer_cred(sock) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "SO_PEERCRED failed; refusing the trainer");
            return None;
        }
    };
    let cfg = &node.info().cfg;
    let (uid, gid) = (cred.uid, cred.gid);
    if cfg.peer_allowed(uid, gid) {
        return Some(slot);
    }
    let groups = match peer::peer_groups(sock) {
        Ok(g) if g.iter().any(|g| cfg.allowed_gids.contains(g)) => return Some(slot),
        Ok(g) => format!("supplementary groups {}", first_groups(&g)),
        // A kernel before 4.13: the primary gid is all that can be matched.
        Err(e) => format!("supplementary groups not checked: SO_PEERGROUPS failed: {e}"),
    };
    drop(slot);
    tracing::warn!(
        uid,
        gid,
        groups,
        pid = cred.pid.map_or_else(
            || "not visible in this pid namespace".to_string(),
            |p| p.to_string()
        ),
        "trainer refused: neither its uid nor its groups are in allowed_uids/allowed_gids"
    );
    let msg = format!(
        "uid {uid} / gid {gid} ({groups}) is not allowed to use this node: list the uid in \
         allowed_uids, or the primary gid or a supplementary group in allowed_gids"
    );
    let _ = reply(sock, &error(ErrorCode::Forbidden, msg), &[]);
    metrics::counter!("shardwire_trainer_refused_total", "reason" => "peer").increment(1);
    linger_for_the_request(sock);
    None
}

/// `groups` for a message: at most 16 named (a process may have 65536).
fn first_groups(groups: &[u32]) -> String {
    let named = &groups[..groups.len().min(16)];
    match groups.len() - named.len() {
        0 => format!("{named:?}"),
        n => format!("{named:?} and {n} more"),
    }
}

/// One trainer connection.
struct Conn<'a> {
    node: &'a Arc<Node>,
    sock: UnixStream,
    frame: Vec<u8>,
    stream: Option<Arc<Stream>>,
    /// Slabs of released leases: freed after the answer is out (freeing takes the region's
    /// locks, and the trainer is busy with the answer by then), or before a `next` that has
    /// to wait ([`wait::next_batch`]).
    released: Vec<Arc<Slab>>,
    /// The attach asked for `state` in every batch reply.
    batch_state: bool,
    /// How the attach asked for batch replies to be encoded.
    batch_encoding: BatchEncoding,
    reader: fdpass::FrameReader,
    waits: Waits,
    /// A request read while a `next` waited (anything but a release): handled next.
    ahead: Option<Request>,
    /// Answers to releases applied while a `next` waited: sent after its answer, in order.
    after: Vec<Response>,
    /// How many of `after` are failures (at most [`MAX_FAILED_BEHIND`]).
    failed_behind: usize,
    /// The trainer shut down its writing while a `next` waited: nothing more to read (it still
    /// gets its answers).
    eof: bool,
}

fn serve(node: &Arc<Node>, sock: UnixStream, slot: Slot) {
    let Some(_slot) = peer_allowed(node, &sock, slot) else {
        return;
    };
    // Registered once per connection: recording on a handle is a few atomic adds.
    let next_latency =
        metrics::histogram!("shardwire_trainer_next_duration_seconds", "api" => "socket");
    let cfg = &node.info().cfg;
    let request = Duration::from_secs(cfg.trainer_request_timeout_secs);
    let idle = (cfg.trainer_idle_timeout_secs > 0)
        .then(|| Duration::from_secs(cfg.trainer_idle_timeout_secs));
    // A trainer reads every answer it asks for: one that stops reading while the node writes
    // (its socket buffer full) has its connection and stream closed, instead of holding this
    // thread, its stream's memory and a connection slot. Before `attach` after the request
    // timeout; attached, after the idle timeout (a long step may leave the answers asked
    // ahead unread for a while).
    let mut write_limit = Some(request);
    if let Err(e) = sock.set_write_timeout(write_limit) {
        tracing::warn!(error = %e, "cannot set the trainer socket's write timeout");
        return;
    }
    let mut c = Conn {
        node,
        sock,
        frame: Vec::with_capacity(256),
        stream: None,
        released: Vec::new(),
        batch_state: false,
        batch_encoding: BatchEncoding::Json,
        reader: fdpass::FrameReader::new(),
        // The request timeout from connect to `attach`, whatever comes before it (an `info`,
        // or requests answered `not_attached`, do not extend it).
        waits: Waits {
            request,
            idle,
            attach_by: Instant::now() + request,
        },
        ahead: None,
        after: Vec::new(),
        failed_behind: 0,
        eof: false,
    };
    while let Some(req) = c.read_request() {
        let t = Instant::now();
        let is_next = matches!(req, Request::Next { .. });
        let sent = c.handle(req);
        c.released.clear();
        if is_next {
            next_latency.record(t.elapsed().as_secs_f64());
        }
        if let Err(e) = sent {
            c.write_failed(&e, write_limit);
            break;
        }
        if c.stream.is_some() && write_limit != idle {
            write_limit = idle;
            if c.sock.set_write_timeout(write_limit).is_err() {
                break;
            }
        }
    }
}

impl Drop for Conn<'_> {
    /// The connection's stream closes with it, however it ends (a panic included): its
    /// memory and leases go back.
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            self.node.trainer_left(s.id());
        }
    }
}

/// How long a trainer connection's reads may wait.
struct Waits {
    /// For a request frame once started, and from connect to `attach`.
    request: Duration,
    /// For the next request once attached (None: no limit).
    idle: Option<Duration>,
    /// When an unattached connection is closed.
    attach_by: Instant,
}

impl Conn<'_> {
    /// The trainer's next request; None when the connection ends (closed, malformed, or out
    /// of time: answered with the reason where there is one). Before `attach` the wait ends
    /// at the attach deadline; attached, after the idle timeout.
    fn read_request(&mut self) -> Option<Request> {
        if let Some(r) = self.ahead.take() {
            return Some(r);
        }
        let idle = match self.stream {
            Some(_) => self.waits.idle,
            None => {
                let left = self
                    .waits
                    .attach_by
                    .saturating_duration_since(Instant::now());
                if left.is_zero() {
                    self.attach_late(self.waits.request);
                    return None;
                }
                Some(left)
            }
        };
        self.read_frame(idle).ok()
    }

    /// Reads one request, waiting up to `idle` for it to start. Err(Ended::Eof): the trainer
    /// closed its connection (or its writing); Err(Ended::Failed): malformed or out of time,
    /// answered with the reason.
    fn read_frame(&mut self, idle: Option<Duration>) -> Result<Request, Ended> {
        let limits = ReadLimits {
            idle,
            frame: self.waits.request,
        };
        // Trainers send no fds: a plain recv (the kernel closes any that come anyway).
        match self
            .reader
            .read_data_timed(&self.sock, limits)
            .map(Request::decode)
        {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "malformed trainer request; dropping the connection");
                let _ = reply(
                    &self.sock,
                    &error(ErrorCode::BadRequest, e.to_string()),
                    &[],
                );
                Err(Ended::Failed)
            }
            Err(FrameIoError::Closed) => Err(Ended::Eof),
            Err(FrameIoError::Timeout {
                phase: ReadPhase::Idle,
                ..
            }) if self.stream.is_none() => {
                self.attach_late(self.waits.request);
                Err(Ended::Failed)
            }
            Err(e) => {
                self.read_failed(&e);
                Err(Ended::Failed)
            }
        }
    }

    /// While a `next` of stream `s` waits ([`wait::next_batch`]): a trainer that closed its
    /// connection, or sent a malformed request, ends it; releases that came behind it are
    /// applied now (their slabs freed: the batch may be waiting for that memory), their answers
    /// sent after its own; the first other request is kept for its turn, and nothing after it
    /// is read until then. More than [`MAX_FAILED_BEHIND`] failed releases end the connection.
    fn look(&mut self, s: &Stream) -> wait::Peer {
        if wait::hung_up(&self.sock) {
            return wait::Peer::Gone;
        }
        while !self.eof
            && self.ahead.is_none()
            && (self.reader.has_frame() || wait::readable(&self.sock))
        {
            match self.read_frame(Some(self.waits.request)) {
                Ok(Request::Release { lease }) => {
                    let (answer, slab) = release(s, lease);
                    self.failed_behind += usize::from(slab.is_none());
                    drop(slab);
                    if self.failed_behind > MAX_FAILED_BEHIND {
                        return self.too_many_failed(&answer);
                    }
                    self.after.push(answer);
                }
                Ok(other) => self.ahead = Some(other),
                // It still reads: it gets its answers, then the connection ends.
                Err(Ended::Eof) => self.eof = true,
                Err(Ended::Failed) => return wait::Peer::Gone,
            }
        }
        wait::Peer::Here
    }

    /// Closes a connection that has not attached within the request timeout, saying so.
    fn attach_late(&self, request: Duration) {
        metrics::counter!("shardwire_trainer_timeouts_total", "phase" => "request").increment(1);
        tracing::warn!(
            "closing a trainer connection that did not attach in time (trainer_request_timeout_secs)"
        );
        let message = format!(
            "no attach within {} s of connecting (trainer_request_timeout_secs)",
            request.as_secs()
        );
        let _ = reply(&self.sock, &error(ErrorCode::Timeout, message), &[]);
    }

    /// Answers one request.
    fn handle(&mut self, req: Request) -> Result<(), FrameIoError> {
        let Some(s) = self.stream.clone() else {
            return match req {
                Request::Attach(r) => self.attach(*r),
                Request::Info {} => self.send(&self.info()),
                _ => self.send(&error(ErrorCode::NotAttached, "send attach first")),
            };
        };
        let r = match req {
            Request::Info {} => self.info(),
            Request::Attach(_) => error(
                ErrorCode::AlreadyAttached,
                "this connection already has a stream",
            ),
            Request::Next {
                release,
                timeout_ms,
                count,
            } => {
                // Every lease held is released, whatever else the list or the request holds:
                // the trainer has let go of all of them.
                let mut unknown = Vec::new();
                for &l in &release {
                    match s.take_lease(l) {
                        Some(slab) => self.released.push(slab),
                        None => unknown.push(l),
                    }
                }
                if !(1..=MAX_NEXT_COUNT).contains(&count) {
                    error(
                        ErrorCode::BadRequest,
                        format!("next asked for {count} batches; count is 1 to {MAX_NEXT_COUNT}"),
                    )
                } else if !unknown.is_empty() {
                    match s.closed_reason() {
                        Some(why) => error(why.code(), why.to_string()),
                        None => error(
                            ErrorCode::UnknownLease,
                            unknown_leases(&unknown, release.len()),
                        ),
                    }
                } else {
                    let timeout = timeout_ms.map(Duration::from_millis);
                    let mut released = std::mem::take(&mut self.released);
                    let n = wait::next_batch(&s, timeout, &mut released, || self.look(&s));
                    self.released = released;
                    let Some(n) = n else {
                        // The trainer hung up while its request waited: close the stream.
                        return Err(FrameIoError::Closed);
                    };
                    let first = next_response(n, self.batch_state.then_some(&*s));
                    self.send_with_ready(&s, first, count)?;
                    return self.send_after();
                }
            }
            Request::Release { lease } => {
                let (answer, slab) = release(&s, lease);
                self.released.extend(slab);
                answer
            }
            Request::State {} => Response::State { state: s.state() },
        };
        self.send(&r)
    }

    /// What the node serves: its memory and its lanes' GPUs.
    fn info(&self) -> Response {
        Response::Info {
            memory: self.node.info().memory,
            lanes: self.node.lane_refs(),
        }
    }

    /// Opens the connection's stream and sends its region. The stream comes marked mapped
    /// (before it was listed), so a close meanwhile (an admin DELETE, a drain's deadline)
    /// leaves its budget held until this connection gives it back ([`Node::trainer_left`]):
    /// when it ends, or at once where no region is sent. A stream closed meanwhile is still
    /// sent; its first `next` answers why it closed.
    fn attach(&mut self, r: StreamRequest) -> Result<(), FrameIoError> {
        let (batch_state, batch_encoding) = (r.batch_state, r.batch_encoding);
        let s = match self.node.open_stream_from_thread(r) {
            Ok(s) => s,
            Err(e) => return self.send(&error(e.code, e.message)),
        };
        let region = s.region();
        let fd = match region.share_fd() {
            Ok(fd) => fd,
            Err(e) => {
                let why = CloseReason::CannotShare(e.to_string());
                let msg = why.to_string();
                // Closed with its reason, then removed: a mapped stream's close keeps it
                // listed (and its budget held) until its trainer leaves, which is now.
                self.node.close_stream(s.id(), why);
                self.node.trainer_left(s.id());
                return self.send(&error(ErrorCode::NoMemory, msg));
            }
        };
        let attached = Response::Attached {
            stream: s.id(),
            region_size: region.len() as u64,
            batches_per_epoch: s.batches_per_epoch(),
            epochs: s.epochs(),
            memory: region.memory(),
            gpu: self.node.gpu_ref(&s, region),
            state: s.state(),
        };
        // From here the stream is this connection's, which ends it (`trainer_left`).
        self.stream = Some(Arc::clone(&s));
        self.batch_state = batch_state;
        self.batch_encoding = batch_encoding;
        reply(&self.sock, &attached, &[fd.as_fd()])
    }

    /// Ends a connection that sent more than [`MAX_FAILED_BEHIND`] failed releases behind a
    /// waiting `next`, saying so (the last failure: `last`).
    fn too_many_failed(&mut self, last: &Response) -> wait::Peer {
        let why = format!(
            "more than {MAX_FAILED_BEHIND} releases failed while a next waited (the last: {last:?}); the connection ends"
        );
        tracing::warn!("{why}");
        let _ = reply(&self.sock, &error(ErrorCode::BadRequest, why), &[]);
        wait::Peer::Gone
    }

    /// Sends the answers of the releases applied while the last `next` waited.
    fn send_after(&mut self) -> Result<(), FrameIoError> {
        self.failed_behind = 0;
        if self.after.is_empty() {
            return Ok(());
        }
        self.frame.clear();
        for r in self.after.drain(..) {
            r.encode_as(self.batch_encoding, &mut self.frame);
        }
        fdpass::send_frame(&self.sock, &self.frame, &[])
    }

    /// Encodes `r` into the connection's frame buffer and sends it in one write.
    fn send(&mut self, r: &Response) -> Result<(), FrameIoError> {
        self.frame.clear();
        r.encode_as(self.batch_encoding, &mut self.frame);
        fdpass::send_frame(&self.sock, &self.frame, &[])
    }

    /// Sends `first` (the answer to a `next`) and, when it is a batch, up to `count - 1`
    /// batches after it that are ready now (none is waited for) while the stream's leases,
    /// each added batch's included, take at most a quarter of its region
    /// ([`Stream::next_within_room`]), each but the last marked `more`, all in one write.
    fn send_with_ready(
        &mut self,
        s: &Stream,
        first: Response,
        count: u32,
    ) -> Result<(), FrameIoError> {
        self.frame.clear();
        // The answer not yet encoded: it is marked `more` once another batch follows it.
        let mut held = first;
        for _ in 1..count {
            let Response::Batch { more, .. } = &mut held else {
                break;
            };
            let Some(b) = s.next_within_room() else {
                break;
            };
            *more = true;
            if !self.encode_fitting(s, &held) {
                return fdpass::send_frame(&self.sock, &self.frame, &[]);
            }
            held = next_response(Next::Batch(b), self.batch_state.then_some(s));
        }
        self.encode_fitting(s, &held);
        fdpass::send_frame(&self.sock, &self.frame, &[])
    }

    /// Appends the answer `r` of stream `s` to the frame, and true; an answer larger than a
    /// trainer reads (which it would refuse, and then meet again at every resume) is replaced
    /// by the error that closes `s` ([`CloseReason::AnswerTooLarge`]), and false.
    fn encode_fitting(&mut self, s: &Stream, r: &Response) -> bool {
        let start = self.frame.len();
        r.encode_as(self.batch_encoding, &mut self.frame);
        let bytes = self.frame.len() - start - 4;
        if bytes <= MAX_TRAINER_FRAME {
            return true;
        }
        self.frame.truncate(start);
        let shard = match r {
            Response::Batch { shard, .. } => *shard,
            _ => 0,
        };
        let why = CloseReason::AnswerTooLarge {
            shard,
            bytes,
            max: MAX_TRAINER_FRAME,
        };
        tracing::error!(stream = s.id(), reason = %why, "closing the stream");
        self.node.close_stream(s.id(), why.clone());
        error(why.code(), why.to_string()).encode_as(self.batch_encoding, &mut self.frame);
        false
    }

    /// A write of an answer that failed: a timeout (the trainer stopped reading for `limit`)
    /// is counted and logged; anything else is a trainer that went away.
    fn write_failed(&self, e: &FrameIoError, limit: Option<Duration>) {
        if !matches!(e, FrameIoError::Io(io) if is_timeout(io)) {
            tracing::debug!(error = %e, "trainer went away while we replied");
            return;
        }
        metrics::counter!("shardwire_trainer_timeouts_total", "phase" => "write").increment(1);
        let key = if self.stream.is_some() {
            "trainer_idle_timeout_secs"
        } else {
            "trainer_request_timeout_secs"
        };
        tracing::warn!(
            timeout = ?limit,
            "closing a trainer connection: it stopped reading the node's answers ({key})"
        );
    }

    /// A read that failed: a timeout is counted and answered, anything else answered.
    fn read_failed(&mut self, e: &FrameIoError) {
        if let FrameIoError::Timeout { phase, .. } = e {
            let attached = self.stream.is_some();
            let (label, key) = match phase {
                ReadPhase::Idle if attached => ("idle", "trainer_idle_timeout_secs"),
                _ => ("request", "trainer_request_timeout_secs"),
            };
            metrics::counter!("shardwire_trainer_timeouts_total", "phase" => label).increment(1);
            tracing::warn!(error = %e, attached, "closing a trainer connection ({key})");
            let _ = reply(
                &self.sock,
                &error(ErrorCode::Timeout, format!("{e} ({key})")),
                &[],
            );
        } else {
            tracing::warn!(error = %e, "trainer connection failed");
            let _ = reply(
                &self.sock,
                &error(ErrorCode::BadRequest, e.to_string()),
                &[],
            );
        }
    }
}

/// The message for `unknown` leases of a release list of `of` (at most 8 named: the list may
/// be long, and the answer must fit a frame).
fn unknown_leases(unknown: &[u64], of: usize) -> String {
    let named = &unknown[..unknown.len().min(8)];
    let more = match unknown.len() - named.len() {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    format!(
        "lease(s) {named:?}{more} are not held by this stream; the other {} of the {of} released were released",
        of - unknown.len()
    )
}

/// How reading a trainer's request ended without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// The trainer closed its connection (or its writing).
    Eof,
    /// A malformed request, or one out of time: answered with the reason.
    Failed,
}

/// The answer to a release of `lease` of stream `s`, and the slab it frees (the caller decides
/// when: freeing takes the region's locks).
fn release(s: &Stream, lease: u64) -> (Response, Option<Arc<Slab>>) {
    match s.take_lease(lease) {
        Some(slab) => (Response::Released {}, Some(slab)),
        None => match s.closed_reason() {
            Some(why) => (error(why.code(), why.to_string()), None),
            None => (
                error(
                    ErrorCode::UnknownLease,
                    format!("lease {lease} is not held by this stream"),
                ),
                None,
            ),
        },
    }
}

/// A blocking socket call that ran out its `SO_SNDTIMEO`/`SO_RCVTIMEO`.
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The reply to `next`; with `states`, a batch carries the state that resumes after it.
fn next_response(n: Next, states: Option<&Stream>) -> Response {
    match n {
        Next::Batch(b) => Response::Batch {
            state: states.map(|s| s.state_after(b.epoch, b.index)),
            lease: b.lease,
            epoch: b.epoch,
            index: b.index,
            shard: b.shard,
            tensors: b.tensors,
            more: false,
        },
        Next::End => Response::End {},
        Next::Timeout => Response::Timeout {},
        Next::Closed(why) => error(why.code(), why.to_string()),
    }
}
