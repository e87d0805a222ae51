//! One node's control connection: handshake, data-connection setup (`dial.rs`), the
//! FETCH queues, read-ahead hints and cancellation.
//!
//! FETCHes wait in their lane's queue until their bytes are settled (object storage) and a
//! data connection of that lane is ready (the node said `DataReady`: on a devmem lane its flow
//! is steered first; every connection must be ready within [`HANDSHAKE_TIMEOUT`]) and has
//! room (at most [`crate::sender::DEPTH`] payloads each); only then is the payload announced
//! (`Shard`) and handed to that connection's sender. A
//! lane's shards travel only on its own connections (its NIC, its GPU's memory on the node).
//! So a `Cancel` can still drop every FETCH that is not on the wire yet, and a stream the
//! node gave up on stops costing the source bandwidth. Object-storage reads for queued
//! FETCHes start in queue order while what the session has read and not sent stays within the
//! dataset's memory budget (`Reads`): queued FETCHes cost no memory until then.
//!
//! A node of another protocol version is answered with `Error{UnsupportedVersion}` in its own
//! version (in the layout of `Error` that version reads), naming both versions, and dropped.
//!
//! Every state has a time limit: the handshake [`HANDSHAKE_TIMEOUT`], an established session
//! the idle timeout (both sides send `Ping` after a third of it without other traffic), and
//! every write [`WRITE_TIMEOUT`]. A node can never make the source buffer a frame over
//! [`shardwire_protocol::wire::MAX_SMALL_FRAME`].

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use shardwire_protocol::auth::{self, NONCE_LEN, Role};
use shardwire_protocol::framing::FrameError;
use shardwire_protocol::wire::{self, ErrorCode, LaneAddr, Message};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::Shared;
use crate::admit::HandshakeSlot;
use crate::control::{Control, kind};
pub use crate::control::{
    DIAL_DEADLINE, HANDSHAKE_TIMEOUT, MAX_QUEUED_FETCHES, SessionError, WRITE_TIMEOUT,
};
use crate::datasets::{Backend, Opened};
use crate::dial::{DataConns, dial};
use crate::payload::{Now, Payload};
use crate::sender::{Body, Held, Job, Sender};

pub(crate) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    handshake_slot: HandshakeSlot,
    slots: Arc<Semaphore>,
) -> Result<(), SessionError> {
    // Canonical: a loopback peer on a `[::]` listener arrives as ::ffff:127.0.0.1.
    if shared.cfg.secret.is_none() && !peer.ip().to_canonical().is_loopback() {
        return Err(SessionError::NotLoopback(peer));
    }
    let _ = stream.set_nodelay(true);
    let (rd, wr) = stream.into_split();
    let mut ctl = Control {
        rd: BufReader::new(rd),
        wr,
        buf: Vec::new(),
        idle: shared.cfg.idle_timeout,
        last_sent: Instant::now(),
    };
    let hs = handshake(&mut ctl, &shared, slots);
    let (lanes, node_id, _slot) = tokio::select! {
        done = tokio::time::timeout(HANDSHAKE_TIMEOUT, hs) => {
            done.map_err(|_| SessionError::Timeout(HANDSHAKE_TIMEOUT))??
        }
        () = handshake_slot.evicted() => return Err(SessionError::Evicted),
    };
    drop(handshake_slot); // a session slot now (`_slot`, until the session ends)
    let addrs: Vec<String> = lanes
        .iter()
        .map(|l| format!("{}x{}", l.data_addr, l.flows))
        .collect();
    tracing::info!(%peer, node = %node_id, lanes = %addrs.join(" "), "node authenticated");
    let failed = Arc::new(Notify::new());
    let progress = Arc::new(Notify::new());
    // Each connect has its own limit; all of them together (up to MAX_LANES * MAX_FLOWS)
    // have this one, so a node cannot hold the session in dialling for hours.
    let dialled = dial(&mut ctl, &shared, &lanes, &failed, &progress);
    let DataConns { senders, lane_of } = tokio::time::timeout(DIAL_DEADLINE, dialled)
        .await
        .map_err(|_| SessionError::DialTimeout(DIAL_DEADLINE))??;
    let id = shared.sessions.fetch_add(1, Ordering::Relaxed) + 1;
    let _hints = ForgetHints(Arc::clone(&shared), id);
    let draining = shared.draining.subscribe();
    let reads = Reads::new(&shared.session_reads);
    Session {
        id,
        ctl,
        shared,
        ready: vec![false; senders.len()],
        ready_by: Instant::now() + HANDSHAKE_TIMEOUT,
        senders,
        lane_of,
        waiting: (0..lanes.len()).map(|_| VecDeque::new()).collect(),
        later: vec![0; lanes.len()],
        queued: 0,
        queued_reqs: HashMap::new(),
        reads,
        failed,
        progress,
        draining,
        drained: false,
    }
    .serve()
    .await
}

/// How long a session's last `Error` may take to write before the session ends anyway.
const LAST_WORD: Duration = Duration::from_secs(1);

/// Drops a session's read-ahead hints when it ends, however it ends.
struct ForgetHints(Arc<Shared>, u64);

impl Drop for ForgetHints {
    fn drop(&mut self) {
        for d in self.0.datasets.iter() {
            if let Backend::Remote(r) = &d.backend {
                r.forget_session(self.1);
            }
        }
    }
}

/// Hello, Challenge, Auth, Welcome; returns the node's lanes and id, and the session slot it
/// took (one of `slots`, `max_connections`) once the node proved the secret. Without a free
/// slot the node is answered with an `Error` naming the limit instead of `Welcome`.
async fn handshake(
    ctl: &mut Control,
    shared: &Shared,
    slots: Arc<Semaphore>,
) -> Result<(Vec<LaneAddr>, String, OwnedSemaphorePermit), SessionError> {
    let secret = shared.cfg.secret.as_deref();
    let hello = ctl.recv().await?;
    let mut src_nonce = [0u8; NONCE_LEN];
    rustix::rand::getrandom(&mut src_nonce, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| FrameError::Io(e.into()))?;
    let challenge = Message::Challenge {
        nonce: src_nonce,
        auth_required: secret.is_some(),
    };
    // Both proofs cover what each side said, not only the nonces: a relay cannot rewrite it.
    let transcript = wire::handshake_transcript(&hello, &challenge).map_err(FrameError::Encode)?;
    let (lanes, node_id) = match hello {
        Message::Hello { node_id, lanes, .. } => (lanes, node_id),
        other => {
            return Err(SessionError::Unexpected {
                expected: "Hello",
                got: kind(&other),
            });
        }
    };
    ctl.send(&challenge).await?;
    let mac = match ctl.recv().await? {
        Message::Auth { mac } => mac,
        other => {
            return Err(SessionError::Unexpected {
                expected: "Auth",
                got: kind(&other),
            });
        }
    };
    if let Some(s) = secret
        && !auth::ct_eq(&mac, &auth::proof(s, Role::Node, &transcript, 0))
    {
        let why = "wrong secret (or the handshake was changed on its way)";
        let _ = ctl.error(0, ErrorCode::AuthFailed, why.into()).await;
        return Err(SessionError::AuthFailed);
    }
    let Ok(slot) = slots.try_acquire_owned() else {
        let e = SessionError::TooManySessions(shared.cfg.max_connections);
        let _ = ctl.error(0, ErrorCode::Internal, e.to_string()).await;
        return Err(e);
    };
    let idle_timeout_s = ctl.idle.as_secs().clamp(1, u64::from(u16::MAX)) as u16;
    let welcome = secret.map_or([0; 32], |s| {
        auth::proof(s, Role::Source, &transcript, idle_timeout_s)
    });
    ctl.send(&Message::Welcome {
        mac: welcome,
        idle_timeout_s,
    })
    .await?;
    Ok((lanes, node_id, slot))
}

/// What a queued FETCH's announcement says.
struct Head {
    req: u64,
    len: u64,
    corrupt: bool,
    shard: u32,
    crc32c: u32,
    /// A local shard file: what it was when the source opened it, checked again right before
    /// the announcement (it may wait in the queue for a while).
    file: Option<Arc<Opened>>,
}

/// Why a queued FETCH's local shard file no longer holds what the source opened (it was
/// checked when the FETCH was queued, and may have waited behind others since), if it does
/// not.
fn changed_since_queued(q: &Head, body: &Body) -> Option<String> {
    match (&q.file, body) {
        (Some(opened), Body::File { file, offset }) => opened.check(file, offset + q.len).err(),
        _ => None,
    }
}

/// A session's object-storage reads: bytes of those it started and whose payloads are not
/// sent yet (queued, read, handed to a data connection or being sent). A read starts only
/// while those bytes stay within its dataset's memory budget (or none is under way), so a node
/// that queues many FETCHes, or reads its data connections slowly, cannot make the source hold
/// more than that in memory for it; and only while the reads of all sessions stay within
/// [`SOURCE_READ_BUDGETS`] budgets (or none is under way), so many such nodes cannot either.
struct Reads {
    /// Bytes read (or being read) from object storage and not yet sent; shared with the
    /// sender threads, whose payloads return theirs once sent ([`Held`]).
    bytes: Arc<AtomicU64>,
    /// The same, over every session of the source.
    source: Arc<AtomicU64>,
    /// A read waits for room in the source's budget: other sessions give it back without
    /// telling this one, so the session looks again shortly.
    starved: bool,
}

/// How soon a session whose read waits for room in the source's budget looks again.
const STARVED_RECHECK: Duration = Duration::from_millis(50);

/// Memory budgets (of the dataset read) that the object-storage reads of all sessions
/// together may hold.
pub(crate) const SOURCE_READ_BUDGETS: u64 = 4;

impl Reads {
    /// No reads yet; all sessions' counted in `source`.
    fn new(source: &Arc<AtomicU64>) -> Self {
        Self {
            bytes: Arc::default(),
            source: Arc::clone(source),
            starved: false,
        }
    }

    /// Returns `n` bytes of a FETCH that will not be sent (failed or cancelled).
    fn release(&self, n: u64) {
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.source.fetch_sub(n, Ordering::AcqRel);
    }

    /// A payload's hold on `n` bytes of both budgets, given back once it is sent.
    fn held(&self, n: u64) -> Held {
        Held::new(&[&self.bytes, &self.source], n)
    }

    /// Starts `q`'s read if it waits for one ([`Payload::Later`]) and there is room; false
    /// if it still waits.
    fn start(&mut self, q: &mut Queued, session: u64, progress: &Arc<Notify>) -> bool {
        let Payload::Later(w) = &q.payload else {
            return true;
        };
        let budget = w.dataset().memory_budget();
        let mine = self.bytes.load(Ordering::Acquire);
        if mine > 0 && mine + q.head.len > budget {
            return false;
        }
        let all = self.source.load(Ordering::Acquire);
        self.starved = all > 0 && all + q.head.len > SOURCE_READ_BUDGETS * budget;
        if self.starved {
            return false;
        }
        // Moved out for a moment (an empty body stands in; it is replaced at once).
        let later = std::mem::replace(&mut q.payload, Payload::Ready(Body::Memory(Vec::new())));
        q.payload = match later {
            Payload::Later(w) => Payload::read(w, session, Arc::clone(progress)),
            other => other,
        };
        q.held = q.head.len;
        self.bytes.fetch_add(q.held, Ordering::AcqRel);
        self.source.fetch_add(q.held, Ordering::AcqRel);
        true
    }
}

/// A FETCH waiting for its bytes (object storage) and a data connection with room.
struct Queued {
    head: Head,
    payload: Payload,
    /// Bytes its object-storage read counts in [`Reads`] (0: a local file, or not started).
    held: u64,
}

struct Session {
    /// This session's id (scopes its hints).
    id: u64,
    ctl: Control,
    shared: Arc<Shared>,
    /// One per data connection.
    senders: Vec<Sender>,
    /// Per data connection: the node said `DataReady` (only then are payloads sent on it).
    ready: Vec<bool>,
    /// Every data connection must be ready by then.
    ready_by: Instant,
    /// The lane of each data connection.
    lane_of: Vec<u16>,
    /// FETCHes waiting, per lane.
    waiting: Vec<VecDeque<Queued>>,
    /// Per lane: how many of them wait for their read to start ([`Payload::Later`]): the
    /// walks over the queues skip what cannot change ([`Session::start_later`] when there
    /// are none, [`Session::dispatch_lane`] past the last that can be sent), so a long queue
    /// does not cost every message a walk over all of it.
    later: Vec<usize>,
    /// FETCHes waiting in all lanes.
    queued: usize,
    /// Their request ids (with a count: a node may reuse one), so a `Cancel` of a FETCH on the
    /// wire already (the common case) is answered without a walk over the queues.
    queued_reqs: HashMap<u64, u32>,
    /// Its object-storage reads under way or not sent yet.
    reads: Reads,
    failed: Arc<Notify>,
    progress: Arc<Notify>,
    /// The source's drain flag ([`crate::Source::serve`]).
    draining: tokio::sync::watch::Receiver<bool>,
    /// The node has been told that this source drains.
    drained: bool,
}

impl Drop for Session {
    /// The bytes of reads started for FETCHes still queued go back to the source's budget
    /// (the session's own counter goes with it; the source's lives on, and kept them for
    /// ever: a few sessions ending with full queues stopped every read of the source).
    fn drop(&mut self) {
        for q in self.waiting.iter().flatten() {
            self.reads.release(q.held);
        }
    }
}

impl Session {
    async fn serve(mut self) -> Result<(), SessionError> {
        let idle = self.ctl.idle;
        let keepalive = (idle / 3).max(Duration::from_millis(300));
        let mut last_heard = Instant::now();
        loop {
            self.dispatch().await?;
            let ping_at = self.ctl.last_sent + keepalive;
            let msg = tokio::select! {
                m = self.ctl.recv() => match m {
                    Ok(m) => m,
                    Err(SessionError::Frame(FrameError::Closed)) => return Ok(()),
                    Err(e) => return Err(e),
                },
                _ = self.failed.notified() => {
                    return Err(self.last_word(ErrorCode::Internal, SessionError::DataFailed).await);
                }
                _ = self.progress.notified() => continue,
                _ = tokio::time::sleep(STARVED_RECHECK), if self.reads.starved => continue,
                _ = async { self.draining.wait_for(|d| *d).await.is_ok() }, if !self.drained => {
                    self.tell_draining().await?;
                    continue;
                }
                _ = tokio::time::sleep_until(ping_at) => {
                    self.ctl.send(&Message::Ping).await?;
                    continue;
                }
                _ = tokio::time::sleep_until(last_heard + idle) => return Err(SessionError::Idle(idle)),
                _ = tokio::time::sleep_until(self.ready_by), if self.ready.contains(&false) => {
                    let conns = self.ready.iter().filter(|r| !**r).count();
                    let e = SessionError::NotReady { conns, waited: HANDSHAKE_TIMEOUT };
                    return Err(self.last_word(ErrorCode::BadRequest, e).await);
                }
            };
            last_heard = Instant::now();
            self.handle(msg).await?;
        }
    }

    /// Tells the node why the source ends this session (an `Error` about no request, which
    /// the node logs), waiting at most [`LAST_WORD`] for a node that does not read; then
    /// returns `e`.
    async fn last_word(&mut self, code: ErrorCode, e: SessionError) -> SessionError {
        let said = self
            .ctl
            .error(0, code, format!("the source ends this session: {e}"));
        let _ = tokio::time::timeout(LAST_WORD, said).await;
        e
    }

    /// Tells the node once that this source drains: it sends nothing new here, and the
    /// queued FETCHes are still sent.
    async fn tell_draining(&mut self) -> Result<(), SessionError> {
        self.drained = true;
        let queued = self.queued;
        tracing::info!(
            session = self.id,
            queued,
            "telling the node this source drains"
        );
        let message = format!(
            "source is draining: {queued} queued FETCHes are still sent, new ones are refused"
        );
        self.ctl.error(0, ErrorCode::Draining, message).await
    }

    async fn handle(&mut self, msg: Message) -> Result<(), SessionError> {
        match msg {
            Message::ManifestRequest { req, dataset } => match self.shared.datasets.get(&dataset) {
                Some(d) => self.ctl.manifest(req, &dataset, &d.manifest_json).await,
                None => {
                    let message = format!("dataset `{dataset}` is not served here");
                    self.ctl
                        .error(req, ErrorCode::UnknownDataset, message)
                        .await
                }
            },
            Message::Fetch {
                req,
                dataset,
                shard,
                lane,
            } => self.queue(req, &dataset, shard, lane).await,
            Message::Cancel { req } => self.cancel(req).await,
            Message::Ping => Ok(()),
            Message::DataReady { conn } => {
                let conns = self.ready.len();
                match self.ready.get_mut(usize::from(conn)) {
                    Some(r) => *r = true,
                    None => {
                        let message = format!(
                            "DataReady for connection {conn}: this session has {conns} data connections"
                        );
                        let _ = self.ctl.error(0, ErrorCode::BadRequest, message).await;
                        return Err(SessionError::NoSuchConn { conn, conns });
                    }
                }
                Ok(())
            }
            Message::Hint {
                stream,
                dataset,
                shards,
            } => {
                match self.shared.datasets.get(&dataset).map(|d| &d.backend) {
                    Some(Backend::Remote(r)) => r.hint(self.id, stream, shards),
                    Some(Backend::Local { .. }) => {}
                    None => tracing::debug!(%dataset, "hint for a dataset not served here"),
                }
                Ok(())
            }
            other => {
                let message = format!("unexpected {} after the handshake", kind(&other));
                let _ = self.ctl.error(0, ErrorCode::BadRequest, message).await;
                Err(SessionError::Unexpected {
                    expected: "ManifestRequest, Fetch, Cancel, Hint, DataReady or Ping",
                    got: kind(&other),
                })
            }
        }
    }

    /// Drops FETCH `req` if it is still queued (not on the wire yet) and says so.
    async fn cancel(&mut self, req: u64) -> Result<(), SessionError> {
        if !self.queued_reqs.contains_key(&req) {
            return Ok(()); // on the wire already, or never queued: nothing to drop
        }
        let found = self.waiting.iter_mut().enumerate().find_map(|(lane, w)| {
            let at = w.iter().position(|q| q.head.req == req)?;
            w.remove(at).map(|q| (lane, q))
        });
        if let Some((lane, q)) = found {
            self.unqueued(req);
            if matches!(q.payload, Payload::Later(_)) {
                self.later[lane] -= 1;
            }
            self.reads.release(q.held);
            tracing::debug!(req, "FETCH cancelled before it was sent");
            metrics::counter!("shardwire_source_fetches_cancelled_total").increment(1);
            let why = "cancelled by the node before it was sent".to_string();
            self.ctl.error(req, ErrorCode::Cancelled, why).await?;
        }
        Ok(())
    }

    /// Checks a FETCH and queues it in its lane (or answers it with an error).
    async fn queue(
        &mut self,
        req: u64,
        dataset: &str,
        shard: u32,
        lane: u16,
    ) -> Result<(), SessionError> {
        let lanes = self.waiting.len();
        if usize::from(lane) >= lanes {
            let message = format!("lane {lane} is not one of the node's {lanes} lanes (its Hello)");
            return self.ctl.error(req, ErrorCode::BadRequest, message).await;
        }
        if self.drained {
            metrics::counter!("shardwire_source_fetches_refused_draining_total").increment(1);
            let message = "source is draining: fetch it from another source".to_string();
            return self.ctl.error(req, ErrorCode::Draining, message).await;
        }
        let Some(d) = self.shared.datasets.get(dataset) else {
            let message = format!("dataset `{dataset}` is not served here");
            return self
                .ctl
                .error(req, ErrorCode::UnknownDataset, message)
                .await;
        };
        let Some(entry) = d.manifest.shards.get(shard as usize) else {
            let message = format!(
                "shard {shard} is out of range: dataset `{dataset}` has {} shards",
                d.manifest.shards.len()
            );
            return self.ctl.error(req, ErrorCode::UnknownShard, message).await;
        };
        if self.queued >= MAX_QUEUED_FETCHES {
            let e = SessionError::TooManyFetches(self.queued);
            return Err(self.last_word(ErrorCode::BadRequest, e).await);
        }
        let corrupt = self
            .shared
            .corrupt_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        let (payload, opened) = match &d.backend {
            Backend::Local { files, opened, .. } => {
                let (file, opened) = (&files[shard as usize], &opened[shard as usize]);
                if let Err(why) = opened.check(file, entry.offset + entry.length) {
                    tracing::warn!(dataset, shard, "{why}; FETCH refused");
                    let message = format!(
                        "dataset `{dataset}`: {why} (re-run `shardwire index` and restart the source)"
                    );
                    return self
                        .ctl
                        .error(req, ErrorCode::DatasetChanged, message)
                        .await;
                }
                let body = Body::File {
                    file: Arc::clone(file),
                    offset: entry.offset,
                };
                (Payload::Ready(body), Some(Arc::clone(opened)))
            }
            Backend::Remote(r) => (Payload::Later(r.want(self.id, shard)), None),
        };
        let head = Head {
            req,
            len: entry.length,
            corrupt,
            shard,
            crc32c: entry.crc32c,
            file: opened,
        };
        self.push(usize::from(lane), head, payload);
        Ok(())
    }

    /// Queues a FETCH at the end of `lane`'s queue; its read starts now if no read waits for
    /// room before it (in queue order: a read waiting for room is not passed by a newer,
    /// smaller one, which could starve it for as long as small FETCHes keep coming).
    fn push(&mut self, lane: usize, head: Head, payload: Payload) {
        let req = head.req;
        let mut q = Queued {
            head,
            payload,
            held: 0,
        };
        if self.later.iter().all(|&n| n == 0) {
            self.reads.start(&mut q, self.id, &self.progress);
        }
        if matches!(q.payload, Payload::Later(_)) {
            self.later[lane] += 1;
        }
        self.waiting[lane].push_back(q);
        self.enqueued(req);
    }

    /// Starts the reads of queued FETCHes, in queue order, while there is room.
    fn start_later(&mut self) {
        self.reads.starved = false; // set again by a read that still finds no room
        for (lane, w) in self.waiting.iter_mut().enumerate() {
            if self.later[lane] == 0 {
                continue; // nothing to start here (a local dataset's FETCHes, or all started)
            }
            for q in w.iter_mut() {
                let later = matches!(q.payload, Payload::Later(_));
                if !self.reads.start(q, self.id, &self.progress) {
                    return;
                }
                if later {
                    self.later[lane] -= 1;
                    if self.later[lane] == 0 {
                        break;
                    }
                }
            }
        }
    }

    /// Dispatches every lane's queue (see [`Session::dispatch_lane`]).
    async fn dispatch(&mut self) -> Result<(), SessionError> {
        for lane in 0..self.waiting.len() {
            self.dispatch_lane(lane).await?;
        }
        self.start_later();
        debug_assert!(self.counts_hold(), "later counts {:?}", self.later);
        Ok(())
    }

    /// Whether [`Session::later`] counts each lane's [`Payload::Later`] entries and
    /// [`Session::queued_reqs`] the queued FETCHes (checked in debug builds: every test run
    /// checks the bookkeeping).
    fn counts_hold(&self) -> bool {
        let later = |w: &VecDeque<Queued>| {
            w.iter()
                .filter(|q| matches!(q.payload, Payload::Later(_)))
                .count()
        };
        let reqs: usize = self.queued_reqs.values().map(|&n| n as usize).sum();
        reqs == self.queued
            && self
                .waiting
                .iter()
                .zip(&self.later)
                .all(|(w, &n)| later(w) == n)
    }

    /// Answers `lane`'s queued FETCHes whose reads failed (all of them, whether or not a
    /// connection has room), and announces and hands out the settled ones, in queue order,
    /// while a data connection of the lane has room (the least loaded).
    async fn dispatch_lane(&mut self, lane: usize) -> Result<(), SessionError> {
        let (mut at, mut later_passed) = (0, 0);
        // Once no connection has room nothing more is sent (in queue order), but the started
        // object-storage reads behind are still looked at, so a failed one is answered now:
        // they lie at the queue's front (reads start in queue order, a few budgets of them),
        // and the look stops at the first entry of any other kind.
        let mut full = false;
        // Past the last entry that is not waiting for its read to start, nothing can be sent.
        while at < self.waiting[lane].len()
            && self.waiting[lane].len() - at > self.later[lane] - later_passed
        {
            let payload = &self.waiting[lane][at].payload;
            if full
                && !matches!(
                    payload,
                    Payload::Reading(..) | Payload::Ready(Body::Memory(_))
                )
            {
                return Ok(());
            }
            if !payload.settled() || (full && matches!(payload, Payload::Ready(_))) {
                if matches!(payload, Payload::Later(_)) {
                    later_passed += 1;
                }
                at += 1;
                continue;
            }
            let room = if full { None } else { self.room_in(lane) };
            let Queued {
                head: q,
                payload,
                held,
            } = self.waiting[lane].remove(at).expect("in range");
            self.unqueued(q.req);
            let body = match payload.now() {
                Now::Send(body) => body,
                Now::Fail(f) => {
                    self.reads.release(held);
                    self.ctl
                        .send(&Message::Error {
                            req: q.req,
                            code: f.code,
                            retry_after_ms: f.retry_after_ms,
                            message: f.message,
                        })
                        .await?;
                    continue;
                }
                Now::Wait(payload) => {
                    self.requeue(lane, at, (q, payload, held));
                    at += 1;
                    continue;
                }
            };
            let Some(conn) = room else {
                // Settled but no room: back in its place, with its bytes.
                self.requeue(lane, at, (q, Payload::Ready(body), held));
                at += 1;
                full = true;
                continue;
            };
            if let Some(why) = changed_since_queued(&q, &body) {
                tracing::warn!(shard = q.shard, "{why}; FETCH refused");
                self.reads.release(held);
                let message = format!("{why} (re-run `shardwire index` and restart the source)");
                self.ctl
                    .error(q.req, ErrorCode::DatasetChanged, message)
                    .await?;
                continue;
            }
            // Bytes in memory stay counted until its sender has sent them; a payload read
            // from a file (the cache) holds no memory once handed over.
            let held = match body {
                Body::Memory(_) => self.reads.held(held),
                Body::File { .. } => {
                    self.reads.release(held);
                    Held::default()
                }
            };
            self.announce(conn, q, body, held).await?;
        }
        Ok(())
    }

    /// Puts a FETCH (its head, payload and held bytes) back at position `at` of `lane`'s
    /// queue.
    fn requeue(&mut self, lane: usize, at: usize, (head, payload, held): (Head, Payload, u64)) {
        let q = Queued {
            head,
            payload,
            held,
        };
        let req = q.head.req;
        self.waiting[lane].insert(at, q);
        self.enqueued(req);
    }

    /// Counts FETCH `req` queued.
    fn enqueued(&mut self, req: u64) {
        self.queued += 1;
        *self.queued_reqs.entry(req).or_default() += 1;
    }

    /// Counts FETCH `req` out of the queue.
    fn unqueued(&mut self, req: u64) {
        self.queued -= 1;
        if let Some(n) = self.queued_reqs.get_mut(&req) {
            *n -= 1;
            if *n == 0 {
                self.queued_reqs.remove(&req);
            }
        }
    }

    /// The least loaded data connection of `lane` with room, if any.
    fn room_in(&self, lane: usize) -> Option<usize> {
        self.senders
            .iter()
            .enumerate()
            .filter(|(i, s)| {
                usize::from(self.lane_of[*i]) == lane && self.ready[*i] && s.has_room()
            })
            .min_by_key(|(_, s)| s.progress.bytes.load(Ordering::Relaxed))
            .map(|(i, _)| i)
    }

    /// Announces `q` on data connection `conn` and hands its bytes to that connection.
    async fn announce(
        &mut self,
        conn: usize,
        q: Head,
        body: Body,
        held: Held,
    ) -> Result<(), SessionError> {
        let seq = self.senders[conn].seq;
        self.senders[conn].seq += 1;
        self.ctl
            .send(&Message::Shard {
                req: q.req,
                shard: q.shard,
                length: q.len,
                crc32c: q.crc32c,
                conn: conn as u16,
                seq,
            })
            .await?;
        let job = Job {
            body,
            len: q.len,
            corrupt: q.corrupt,
            held,
        };
        if !self.senders[conn].push(job) {
            return Err(SessionError::DataFailed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_named_by_kind() {
        assert_eq!(kind(&Message::Ping), "Ping");
        assert_eq!(kind(&Message::Cancel { req: 3 }), "Cancel");
    }
}
