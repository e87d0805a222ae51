//! One node's control connection: handshake, data-connection setup (`dial.rs`), the
//! FETCH queues, read-ahead hints, cancellation, and the node's reports of payloads that
//! failed their CRC-32C check.
//!
//! FETCHes wait in their lane's queue until their bytes are settled (object storage) and a
//! data connection of that lane is ready (the node said `DataReady`: on a devmem lane its flow
//! is steered first; every connection must be ready within [`HANDSHAKE_TIMEOUT`]) and has
//! room (at most [`crate::sender::DEPTH`] payloads each); only then is the payload announced
//! (`Shard`) and handed to that connection's sender. A lane's shards travel only on its own
//! connections (its NIC, its GPU's memory on the node); a FETCH for a lane the source could not
//! dial in this session is refused (`Internal`: the node fetches it from another source). So a
//! `Cancel` can still drop every FETCH that is not on the wire yet, and a stream the node gave
//! up on stops costing the source bandwidth. Object-storage reads for queued FETCHes start in
//! the order the FETCHes arrived, over all lanes, while what the session has read and not sent
//! stays within the dataset's memory budget (`Reads`): queued FETCHes cost no memory until
//! then. A FETCH of a shard already in memory or in the disk cache needs no read from the
//! store: it starts ahead of the reads that wait (also of the source-wide read budget), but
//! only while the session's own bytes stay within its budget.
//!
//! An `Error` from the node ends nothing: a `ChecksumMismatch` about a FETCH the session
//! announced lately (it keeps the last [`ANNOUNCED_KEPT`]) has that shard's cache entry
//! checked against its CRC before it is served again, or, for a local dataset, the shard's
//! bytes in its file rechecked against the manifest's CRC (a shard that fails is refused as
//! `ReadFailed` from then on, which the node fetches from another source; a shard file whose
//! size or modification time changed is refused as `DatasetChanged`); once per announcement:
//! a repeated report is logged only.
//! Any other is logged.
//!
//! A peer refused before its session starts (not on loopback without a secret, its
//! handshake evicted, every session slot taken, the source draining) is told why in an
//! `Error` before its connection closes. One off loopback is refused before it takes a
//! handshake slot, among the few refusals told at once (`crate::admit_connection`): a flood
//! of them cannot hold every handshake slot while their refusals linger.
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
use crate::datasets::{Backend, Opened, ShardChanged};
use crate::dial::{DataConns, dial};
use crate::payload::{Now, Payload};
use crate::remote::HeldIn;
use crate::remote::read::Failure;
use crate::sender::{Body, ConnFailed, Held, Job, Sender};
use crate::stat::Stats;

/// How a control connection ended without a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The node's session ran, and the node closed it.
    Served,
    /// The peer closed the connection before its first frame (no `Hello`): a TCP probe (a
    /// Kubernetes `tcpSocket` check) or a port scan, no node. A close after `Hello` is a
    /// node's, and an error ([`SessionError::Frame`]).
    NoHello,
}

/// A control connection that failed: why, and whether its peer had been welcomed (it proved
/// the secret, or, without one, is on loopback) before it did: a failure before `Welcome` is
/// one any host that reaches the port can cause at will, and is logged as such
/// ([`crate::noise`]).
#[derive(Debug)]
pub(crate) struct Failed {
    /// `Welcome` was sent: a node's session failed.
    pub welcomed: bool,
    /// Why.
    pub error: SessionError,
}

/// Serves the control connection `stream` of `peer`: the handshake, the data connections,
/// then the session, until the node closes it ([`Ended`]) or it fails ([`Failed`]).
pub(crate) async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    handshake_slot: HandshakeSlot,
    slots: Arc<Semaphore>,
) -> Result<Ended, Failed> {
    let before = |error| Failed {
        welcomed: false,
        error,
    };
    let greeted = admit_peer(stream, peer, &shared, handshake_slot, slots).await;
    // `_slot`: a session slot, held until the session ends.
    let Some((ctl, lanes, node_id, _slot)) = greeted.map_err(before)? else {
        return Ok(Ended::NoHello);
    };
    serve_node(ctl, peer, shared, &lanes, &node_id)
        .await
        .map(|()| Ended::Served)
        .map_err(|error| Failed {
            welcomed: true,
            error,
        })
}

/// [`serve_connection`], with its failure only.
#[cfg(test)]
pub(crate) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    handshake_slot: HandshakeSlot,
    slots: Arc<Semaphore>,
) -> Result<Ended, SessionError> {
    serve_connection(stream, peer, shared, handshake_slot, slots)
        .await
        .map_err(|f| f.error)
}

/// What a handshake that ended in `Welcome` leaves: the control connection, the node's lanes
/// and id, and the session slot it took.
type Greeted = (Control, Vec<LaneAddr>, String, OwnedSemaphorePermit);

/// Checks that this source may serve `peer`, then runs the handshake of its control
/// connection `stream` within [`HANDSHAKE_TIMEOUT`], unless it is evicted from its handshake
/// slot first (each refusal is told to the peer); `None` when the peer closed the connection
/// before its first frame.
async fn admit_peer(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    handshake_slot: HandshakeSlot,
    slots: Arc<Semaphore>,
) -> Result<Option<Greeted>, SessionError> {
    // `crate::admit_connection` refuses a peer off loopback before it takes a handshake
    // slot; checked again where the session starts.
    if let Err(e) = admissible(shared, peer) {
        drop(handshake_slot); // not held while the refusal lingers
        crate::control::refuse(stream, ErrorCode::AuthFailed, e.to_string()).await;
        return Err(e);
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
    let hs = handshake(&mut ctl, shared, slots);
    let admitted = tokio::select! {
        done = tokio::time::timeout(HANDSHAKE_TIMEOUT, hs) => {
            done.map_err(|_| SessionError::Timeout(HANDSHAKE_TIMEOUT))??
        }
        () = handshake_slot.evicted() => {
            let e = SessionError::Evicted;
            // The handshake's future is gone: the connection is whole again, to tell it why.
            let Control { rd, wr, .. } = ctl;
            if let Ok(stream) = rd.into_inner().reunite(wr) {
                let why = format!("{e}: try again");
                crate::control::refuse(stream, ErrorCode::Internal, why).await;
            }
            return Err(e);
        }
    };
    // The handshake slot is given back here: a session slot now (until the session ends).
    Ok(admitted.map(|(lanes, node_id, slot)| (ctl, lanes, node_id, slot)))
}

/// The session of node `node_id` at `peer`, welcomed on `ctl`, with `lanes`: its data
/// connections dialled, then served until the node closes it or it fails.
async fn serve_node(
    mut ctl: Control,
    peer: SocketAddr,
    shared: Arc<Shared>,
    lanes: &[LaneAddr],
    node_id: &str,
) -> Result<(), SessionError> {
    let addrs: Vec<String> = lanes
        .iter()
        .map(|l| format!("{}x{}", l.data_addr, l.flows))
        .collect();
    tracing::info!(%peer, node = %node_id, lanes = %addrs.join(" "), "node authenticated");
    let failed = Arc::new(ConnFailed::default());
    let progress = Arc::new(Notify::new());
    let conns = dial_or_tell(&mut ctl, &shared, lanes, (&failed, &progress)).await?;
    let id = shared.sessions.fetch_add(1, Ordering::Relaxed) + 1;
    let _hints = ForgetHints(Arc::clone(&shared), id);
    Session::new(id, ctl, shared, conns, lanes.len(), failed, progress)
        .serve()
        .await
}

/// Whether this source may serve `peer` at all: without a secret, loopback peers only.
pub(crate) fn admissible(shared: &Shared, peer: SocketAddr) -> Result<(), SessionError> {
    // Canonical: a loopback peer on a `[::]` listener arrives as ::ffff:127.0.0.1.
    if shared.cfg.secret.is_none() && !peer.ip().to_canonical().is_loopback() {
        return Err(SessionError::NotLoopback(peer));
    }
    Ok(())
}

/// How long a session's last `Error` may take to write before the session ends anyway.
const LAST_WORD: Duration = Duration::from_secs(1);

/// Dials the node's data connections ([`dial`]) within [`DIAL_DEADLINE`]. Each connect has
/// its own limit; all of them together (up to MAX_LANES * MAX_FLOWS, the lanes dialled at
/// once) have this one, so a node cannot hold the session in dialling for hours. A lane that
/// cannot be dialled is left out (the node is told); a failure that ends the session (no
/// lane's data address reachable, the deadline, no sender thread) is sent to the node in an
/// `Error` (within [`LAST_WORD`]) before the session ends: else the node sees only its control
/// connection closed, and the reason (a firewall in between) is in this source's log only.
async fn dial_or_tell(
    ctl: &mut Control,
    shared: &Shared,
    lanes: &[LaneAddr],
    (failed, progress): (&Arc<ConnFailed>, &Arc<Notify>),
) -> Result<DataConns, SessionError> {
    let dialled = dial(ctl, shared, lanes, failed, progress);
    let e = match tokio::time::timeout(DIAL_DEADLINE, dialled).await {
        Ok(Ok(conns)) => return Ok(conns),
        Ok(Err(e)) => e,
        Err(_) => SessionError::DialTimeout(DIAL_DEADLINE),
    };
    // `check_lanes` told the node of its refusals; a broken control connection takes nothing.
    if matches!(
        e,
        SessionError::DataConnect { .. }
            | SessionError::DialTimeout(_)
            | SessionError::SpawnSender { .. }
    ) {
        let why = format!("the source ends this session: {e}");
        let _ = tokio::time::timeout(LAST_WORD, ctl.error(0, ErrorCode::Internal, why)).await;
    }
    Err(e)
}

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

/// What a handshake admits: the node's lanes and id, and the session slot it took.
type Admitted = (Vec<LaneAddr>, String, OwnedSemaphorePermit);

/// Hello, Challenge, Auth, Welcome; returns the node's lanes and id, and the session slot it
/// took (one of `slots`, `max_connections`) once the node proved the secret; `None` when the
/// peer closed the connection before sending a byte ([`Ended::NoHello`]). Without a free
/// slot the node is answered with an `Error` naming the limit instead of `Welcome`; while
/// the source drains, with `Error{Draining}` (before it takes a slot).
async fn handshake(
    ctl: &mut Control,
    shared: &Shared,
    slots: Arc<Semaphore>,
) -> Result<Option<Admitted>, SessionError> {
    let secret = shared.cfg.secret.as_deref();
    let hello = match ctl.recv().await {
        Err(SessionError::Frame(FrameError::Closed)) => return Ok(None),
        got => got?,
    };
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
    let draining = *shared.draining.borrow();
    if draining {
        let e = SessionError::Draining;
        let _ = ctl.error(0, ErrorCode::Draining, e.to_string()).await;
        return Err(e);
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
    Ok(Some((lanes, node_id, slot)))
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
    /// The dataset's name (shared: [`Names`]), kept once announced ([`Announced`]).
    dataset: Arc<str>,
}

/// Why a queued FETCH's local shard file no longer holds what the source opened (it was
/// checked when the FETCH was queued, and may have waited behind others since), if it does
/// not, or could not be examined in time ([`Stats::check`]: off the runtime's threads).
async fn changed_since_queued(stats: &Stats, q: &Head, body: &Body) -> Option<ShardChanged> {
    match (&q.file, body) {
        (Some(opened), Body::File { file, offset }) => {
            let shard = *offset..offset + q.len;
            stats.check(opened, file, shard).await.err()
        }
        _ => None,
    }
}

/// How a FETCH is refused whose local shard file no longer holds what the source opened
/// (`why`): its code and message. Bytes that a recheck found bad in the file (`Corrupt`) are
/// `ReadFailed`, which a node fetches again from another source (and gives up on after a few
/// refusals in a row): before, `DatasetChanged`, which ended the node's stream though another
/// source had a good copy. A file that could not be examined (`Stat`: `fstat` failed, EIO on a
/// network file system, or it did not return within [`crate::stat::STAT_LIMIT`]) is
/// `ReadFailed` too: a read error says nothing of the data (before, `DatasetChanged`, ending the
/// stream over an error that may pass). A file whose size or modification time changed is
/// `DatasetChanged`: the manifest no longer describes it.
fn shard_refusal(why: &ShardChanged) -> (ErrorCode, String) {
    match why {
        ShardChanged::Corrupt { .. } => (
            ErrorCode::ReadFailed,
            format!("{why} (a node fetches it from another source that has it)"),
        ),
        ShardChanged::Stat { .. } => (
            ErrorCode::ReadFailed,
            format!("{why} (check the file system; a node asks another source, or this one later)"),
        ),
        ShardChanged::Shorter { .. } | ShardChanged::Modified { .. } => (
            ErrorCode::DatasetChanged,
            format!("{why} (re-run `shardwire index` and restart the source)"),
        ),
    }
}

/// A session's object-storage reads: bytes of those it started and whose payloads are not
/// sent yet (queued, read, handed to a data connection or being sent). A read starts only
/// while those bytes stay within its dataset's memory budget (or none is under way), so a node
/// that queues many FETCHes, or reads its data connections slowly, cannot make the source hold
/// more than that in memory for it; a read from the store also only while the reads of all
/// sessions stay within [`SOURCE_READ_BUDGETS`] budgets (or none is under way, or it waited
/// [`STARVED_PATIENCE`]), so many such nodes cannot either. A FETCH of a shard held in memory
/// or in the disk cache ([`HeldIn`]) obeys its session's budget like any other, but not the
/// source-wide one (see [`Reads::start`]).
struct Reads {
    /// Bytes read (or being read) from object storage and not yet sent; shared with the
    /// sender threads, whose payloads return theirs once sent ([`Held`]).
    bytes: Arc<AtomicU64>,
    /// The same, over every session of the source (less the shards taken from the disk
    /// cache: [`Counted::source`]).
    source: Arc<AtomicU64>,
    /// A read waits for room in the source's budget: other sessions give it back without
    /// telling this one, so the session looks again shortly.
    starved: bool,
    /// The FETCH (by its arrival number, [`Queued::seq`]) whose read waits for room in the
    /// source's budget, and since when. Another FETCH in its place (that one was cancelled,
    /// or started) waits afresh; cleared when no read waits.
    starved_since: Option<(u64, Instant)>,
}

/// Bytes a queued FETCH counts in [`Reads`]: in its session's counter, and (`source`) in the
/// source's too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counted {
    bytes: u64,
    /// Counted in the source's counter as well: false only for a shard that was in the disk
    /// cache when its FETCH started ([`Reads::start`]), until its bytes turn out to be in
    /// memory ([`Reads::in_memory`]).
    source: bool,
}

/// How soon a session whose read waits for room in the source's budget looks again.
const STARVED_RECHECK: Duration = Duration::from_millis(50);

/// How long a read waits for room in the source's budget before it starts anyway, once its
/// session holds no other read. Other sessions' reads can keep that budget full for as long
/// as they keep coming (each starts as soon as it fits, and a small one fits sooner), and a
/// shard larger than the budget would start only when no session read anything: under
/// steady load, never. So the source holds at most one shard per session beyond its budget
/// (besides the shards held in memory that sessions took: [`Reads::start`]).
/// (Longer in unit tests, which spend it on purpose: a loaded machine must not spend it for
/// them between two steps.)
const STARVED_PATIENCE: Duration = if cfg!(test) {
    Duration::from_secs(30)
} else {
    Duration::from_secs(1)
};

/// Memory budgets (of the dataset read) that the object-storage reads of all sessions
/// together may hold.
pub(crate) const SOURCE_READ_BUDGETS: u64 = 4;

/// How many waiting FETCHes past the first whose read cannot start [`Queues::start_later`]
/// looks at for shards held in memory or in the cache, which may start ahead of it: a bound
/// on the work per dispatch (a queue holds up to [`MAX_QUEUED_FETCHES`]); one further back
/// starts when it comes this close, or at once if its shard was held when it arrived.
const HELD_LOOKAHEAD: usize = 64;

impl Reads {
    /// No reads yet; all sessions' counted in `source`.
    fn new(source: &Arc<AtomicU64>) -> Self {
        Self {
            bytes: Arc::default(),
            source: Arc::clone(source),
            starved: false,
            starved_since: None,
        }
    }

    /// Counts `c`'s bytes (a read starts).
    fn count(&self, c: Counted) {
        self.bytes.fetch_add(c.bytes, Ordering::AcqRel);
        if c.source {
            self.source.fetch_add(c.bytes, Ordering::AcqRel);
        }
    }

    /// Returns the bytes `c` of a FETCH that will not be sent (failed or cancelled), or whose
    /// payload holds no memory any more (a file handed to its sender).
    fn release(&self, c: Counted) {
        self.bytes.fetch_sub(c.bytes, Ordering::AcqRel);
        if c.source {
            self.source.fetch_sub(c.bytes, Ordering::AcqRel);
        }
    }

    /// `c` (counted already), counted in the source's counter as well if it was not: a
    /// payload in memory holds memory, wherever its shard was held when its FETCH started (a
    /// cache entry that failed its check or was evicted before the FETCH took it was read
    /// from the store again). Applied once its read is found finished ([`look`]), so it counts
    /// while it waits for a data connection with room; again (no change then) when sent.
    fn in_memory(&self, c: Counted) -> Counted {
        if !c.source {
            self.source.fetch_add(c.bytes, Ordering::AcqRel);
        }
        Counted { source: true, ..c }
    }

    /// A payload's hold on the bytes `c` (counted already), given back once it is sent.
    fn held(&self, c: Counted) -> Held {
        if c.source {
            Held::new(&[&self.bytes, &self.source], c.bytes)
        } else {
            Held::new(&[&self.bytes], c.bytes)
        }
    }

    /// Starts `q`'s read if it waits for one ([`Payload::Later`]) and may start now; false if
    /// it still waits.
    ///
    /// A read from the store waits behind an older FETCH that waits (`behind`), and for room
    /// ([`Reads::room`]). A FETCH of a shard held in memory or in the disk cache (looked at
    /// now, [`crate::remote::RemoteDataset::held_in`]: it may have become held since it was
    /// queued) needs no read from the store: it waits neither behind older FETCHes nor for
    /// room in the source's budget, only for room in its session's ([`Reads::mine_fit`]).
    /// That bounds what it makes the source hold: taking a shard out of memory frees room
    /// for the read ahead, which reads the next hinted shards, which the next such FETCHes
    /// would take, without end but for this.
    ///
    /// Its bytes count in its session's budget until sent (or, from the cache, handed to its
    /// sender). Source-wide they count only for a shard in memory (read, or being written to
    /// the cache and taken from memory meanwhile), which holds memory: other sessions' reads
    /// from the store wait while it is held. A cache file holds no memory, so one node's
    /// backlog of cached shards does not fill the source's budget and throttle every other
    /// session; where the cache entry fails its check or is evicted before the FETCH takes
    /// it, its read from the store is bounded by its session's budget alone, and its bytes
    /// count source-wide from when its session finds it read (the next dispatch that looks at
    /// it, [`look`]: it is looked at before it can be sent), until sent
    /// ([`Reads::in_memory`]).
    fn start(
        &mut self,
        q: &mut Queued,
        session: u64,
        progress: &Arc<Notify>,
        behind: bool,
    ) -> bool {
        let Payload::Later(w) = &q.payload else {
            return true;
        };
        let (held_in, budget) = (
            w.dataset().held_in(q.head.shard),
            w.dataset().memory_budget(),
        );
        let may = match held_in {
            Some(_) => self.mine_fit(q.head.len, budget),
            None => !behind && self.room(q.seq, q.head.len, budget),
        };
        if !may {
            return false;
        }
        // Moved out for a moment (an empty body stands in; it is replaced at once).
        let later = std::mem::replace(&mut q.payload, Payload::Ready(Body::Memory(Vec::new())));
        q.payload = match later {
            Payload::Later(mut w) => {
                // Counted as reading its shard now, not once its task runs (see there).
                w.leave_queue();
                Payload::read(w, session, Arc::clone(progress))
            }
            other => other,
        };
        q.held = Counted {
            bytes: q.head.len,
            source: held_in != Some(HeldIn::Cache),
        };
        self.count(q.held);
        true
    }

    /// Whether this session's reads stay within `budget` with one of `len` bytes more (or
    /// none is under way).
    fn mine_fit(&self, len: u64, budget: u64) -> bool {
        let mine = self.bytes.load(Ordering::Acquire);
        mine == 0 || mine + len <= budget
    }

    /// Whether a read from the store of `len` bytes, for the FETCH of arrival number `seq`,
    /// has room: this session's reads stay within `budget` ([`Reads::mine_fit`]), and all
    /// sessions' within [`SOURCE_READ_BUDGETS`] budgets (or none is under way, or it has
    /// waited [`STARVED_PATIENCE`] and this session holds no read).
    fn room(&mut self, seq: u64, len: u64, budget: u64) -> bool {
        if !self.mine_fit(len, budget) {
            return false;
        }
        let all = self.source.load(Ordering::Acquire);
        if all == 0 || all + len <= SOURCE_READ_BUDGETS * budget {
            self.starved_since = None;
            return true;
        }
        let since = match self.starved_since {
            Some((s, since)) if s == seq => since,
            _ => {
                let now = Instant::now();
                self.starved_since = Some((seq, now));
                now
            }
        };
        let mine = self.bytes.load(Ordering::Acquire);
        if mine == 0 && since.elapsed() >= STARVED_PATIENCE {
            tracing::debug!(
                len,
                all,
                "a read waited past its patience for room in the source's read budget; starting it"
            );
            self.starved_since = None;
            return true;
        }
        self.starved = true;
        false
    }
}

/// A FETCH waiting for its bytes (object storage) and a data connection with room.
struct Queued {
    head: Head,
    payload: Payload,
    /// Bytes its object-storage read counts in [`Reads`] (none: a local file, or not started).
    held: Counted,
    /// Its arrival number in its session: reads start in this order, over all lanes.
    seq: u64,
}

/// What a lane's dispatch does with a queued FETCH ([`look`]).
enum Look {
    /// Nothing more of this lane now.
    Stop,
    /// It stays (not settled, or nothing is sent now); on to the next.
    Pass,
    /// Its read failed: answer it.
    Failed(Failure),
    /// Its bytes are ready: send it if a connection of the lane has room.
    Ready,
}

/// What a lane's dispatch does with `q`, whose finished read becomes its bytes (`Ready`) in
/// place, counted in `reads` source-wide from then if they are in memory
/// ([`Reads::in_memory`]: before, only once sent, and a payload that waited for a data
/// connection with room was not counted meanwhile, where its FETCH began on a cached shard
/// whose entry then went). `full`: no connection of the lane has room, so nothing more is
/// sent (in queue order), but the started object-storage reads are still looked at, so a
/// failed one is answered now and a finished one counted; the look stops at the first entry
/// of any other kind (a FETCH whose read has not started, or a file: a local shard's, or one
/// from the disk cache), so a long queue does not cost every message a walk over all of it.
/// A read behind such an entry (a FETCH of a held shard may start behind reads that wait:
/// [`Reads::start`]) is looked at once a dispatch reaches it: once the payloads before it
/// are handed out, or the entries before it have started. Until then a failed one keeps its
/// bytes counted, and a finished one that began on a cached shard counts in its session's
/// budget only.
fn look(q: &mut Queued, full: bool, reads: &Reads) -> Look {
    if full
        && !matches!(
            q.payload,
            Payload::Reading(..) | Payload::Ready(Body::Memory(_))
        )
    {
        return Look::Stop;
    }
    if matches!(q.payload, Payload::Reading(..)) && q.payload.settled() {
        // Moved out for a moment (an empty body stands in; it is replaced, or `q` leaves).
        let done = std::mem::replace(&mut q.payload, Payload::Ready(Body::Memory(Vec::new())));
        match done.now() {
            Now::Send(body) => {
                if matches!(body, Body::Memory(_)) {
                    q.held = reads.in_memory(q.held);
                }
                q.payload = Payload::Ready(body);
            }
            Now::Fail(f) => return Look::Failed(f),
            Now::Wait(p) => q.payload = p,
        }
    }
    match q.payload {
        Payload::Ready(_) if !full => Look::Ready,
        _ => Look::Pass,
    }
}

/// Where the latest queued FETCH of a request id waits, and how many of that id are queued.
#[derive(Clone, Copy, Debug)]
struct Place {
    lane: usize,
    seq: u64,
    n: u32,
}

/// A session's queued FETCHes, per lane, and their object-storage reads.
struct Queues {
    /// The node session they are for (it scopes their reads).
    session: u64,
    /// Notified when one of their reads ends.
    progress: Arc<Notify>,
    /// FETCHes waiting, per lane, each lane's in arrival order.
    waiting: Vec<VecDeque<Queued>>,
    /// Per lane: how many of them wait for their read to start ([`Payload::Later`]): the
    /// walks over the queues skip what cannot change ([`Queues::start_later`] a lane with
    /// none, [`Session::dispatch_lane`] past the last that can be sent), so a long queue does
    /// not cost every message a walk over all of it.
    later: Vec<usize>,
    /// FETCHes waiting in all lanes.
    queued: usize,
    /// Their request ids, each with where its latest FETCH waits and how many wait (a node
    /// may reuse one): a `Cancel` of a FETCH on the wire already (the common case) is
    /// answered without a look at the queues, and one still queued is found by a binary
    /// search, not a walk (a closing stream cancels thousands).
    queued_reqs: HashMap<u64, Place>,
    /// Their object-storage reads under way or not sent yet.
    reads: Reads,
    /// The arrival number of the next FETCH.
    next_seq: u64,
}

impl Drop for Queues {
    /// The bytes of reads started for FETCHes still queued go back to the source's budget
    /// (the session's own counter goes with it; the source's lives on, and kept them for
    /// ever: a few sessions ending with full queues stopped every read of the source).
    fn drop(&mut self) {
        for q in self.waiting.iter().flatten() {
            self.reads.release(q.held);
        }
    }
}

impl Queues {
    /// Empty queues of `lanes` lanes for node session `session`, its reads counted in
    /// `source` (all sessions') and telling `progress` when they end.
    fn new(session: u64, lanes: usize, progress: Arc<Notify>, source: &Arc<AtomicU64>) -> Self {
        Self {
            session,
            progress,
            waiting: (0..lanes).map(|_| VecDeque::new()).collect(),
            later: vec![0; lanes],
            queued: 0,
            queued_reqs: HashMap::new(),
            reads: Reads::new(source),
            next_seq: 0,
        }
    }

    /// Queues a FETCH at the end of `lane`'s queue; its read starts now if no FETCH waits for
    /// its read before it, in any lane (in arrival order: a read waiting for room is not
    /// passed by a newer, smaller one, which could starve it for as long as small FETCHes
    /// keep coming), and there is room; or, if its shard is held in memory or in the cache,
    /// wherever it stands, as soon as its session's budget has room ([`Reads::start`]).
    fn push(&mut self, lane: usize, head: Head, payload: Payload) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut q = Queued {
            head,
            payload,
            held: Counted::default(),
            seq,
        };
        let behind = self.later.iter().any(|&n| n > 0);
        self.reads
            .start(&mut q, self.session, &self.progress, behind);
        if matches!(q.payload, Payload::Later(_)) {
            self.later[lane] += 1;
        }
        let req = q.head.req;
        self.waiting[lane].push_back(q);
        self.enqueued(req, lane, seq);
    }

    /// Starts the reads of queued FETCHes in the order the FETCHes arrived, over all lanes,
    /// while there is room: one lane's backlog does not hold back another lane's older
    /// FETCHes. Past the first that cannot start, no read from the store starts (it would
    /// pass an older one), but a FETCH of a shard held in memory or in the cache still does,
    /// within its session's budget, among the next [`HELD_LOOKAHEAD`] waiting FETCHes: one
    /// whose shard became held after it was queued, or that arrived while the session's
    /// budget was full ([`Reads::start`]).
    fn start_later(&mut self) {
        self.reads.starved = false; // set again by a read that still finds no room
        let mut from = vec![0; self.waiting.len()];
        let (mut blocked, mut looked) = (false, 0);
        while let Some((lane, at)) = self.oldest_later(&mut from) {
            if blocked {
                if looked == HELD_LOOKAHEAD {
                    break;
                }
                looked += 1;
            }
            from[lane] = at + 1; // on past it, started or not
            let q = &mut self.waiting[lane][at];
            if self.reads.start(q, self.session, &self.progress, blocked) {
                self.later[lane] -= 1;
            } else {
                blocked = true;
            }
        }
        if self.later.iter().all(|&n| n == 0) {
            self.reads.starved_since = None; // no read waits
        }
    }

    /// The oldest FETCH that waits for its read to start, over all lanes, as (lane, place).
    /// `from` holds where the look in each lane starts (nothing before waits but what this
    /// walk looked at already), and moves on past what it passes.
    fn oldest_later(&self, from: &mut [usize]) -> Option<(usize, usize)> {
        let mut oldest: Option<(u64, usize, usize)> = None;
        for (lane, w) in self.waiting.iter().enumerate() {
            if self.later[lane] == 0 {
                continue; // nothing to start here (a local dataset's FETCHes, or all started)
            }
            let at = &mut from[lane];
            while w
                .get(*at)
                .is_some_and(|q| !matches!(q.payload, Payload::Later(_)))
            {
                *at += 1;
            }
            if let Some(q) = w.get(*at)
                && oldest.is_none_or(|(seq, ..)| q.seq < seq)
            {
                oldest = Some((q.seq, lane, *at));
            }
        }
        oldest.map(|(_, lane, at)| (lane, at))
    }

    /// Takes the FETCH at `at` of `lane`'s queue out (its bytes stay counted: the caller
    /// sends or releases them).
    fn remove_at(&mut self, lane: usize, at: usize) -> Queued {
        let q = self.waiting[lane].remove(at).expect("a place in the queue");
        if matches!(q.payload, Payload::Later(_)) {
            self.later[lane] -= 1;
        }
        if self
            .reads
            .starved_since
            .is_some_and(|(seq, _)| seq == q.seq)
        {
            self.reads.starved_since = None; // the next read to wait waits afresh
        }
        self.unqueued(q.head.req);
        q
    }

    /// Takes the FETCH at `at` of `lane`'s queue out if its bytes are ready: its head, its
    /// bytes and the bytes it holds in [`Reads`].
    fn take_ready(&mut self, lane: usize, at: usize) -> Option<(Head, Body, Counted)> {
        if !matches!(self.waiting[lane].get(at)?.payload, Payload::Ready(_)) {
            return None;
        }
        let q = self.remove_at(lane, at);
        match q.payload {
            Payload::Ready(body) => Some((q.head, body, q.held)),
            _ => None, // checked above
        }
    }

    /// Takes FETCH `req` out of the queues if it waits there; its bytes go back to the
    /// budgets (dropping it stops its read).
    fn take(&mut self, req: u64) -> Option<Queued> {
        let place = *self.queued_reqs.get(&req)?;
        let (lane, at) = self.find(req, place)?;
        let q = self.remove_at(lane, at);
        self.reads.release(q.held);
        Some(q)
    }

    /// Where FETCH `req` waits: at `place`, found by its arrival number (each lane's queue is
    /// in arrival order), or, where that FETCH has left and another of the same id waits (a
    /// node that reuses ids), wherever a walk finds it.
    fn find(&self, req: u64, place: Place) -> Option<(usize, usize)> {
        let w = &self.waiting[place.lane];
        if let Ok(at) = w.binary_search_by_key(&place.seq, |q| q.seq)
            && w[at].head.req == req
        {
            return Some((place.lane, at));
        }
        self.waiting.iter().enumerate().find_map(|(lane, w)| {
            let at = w.iter().position(|q| q.head.req == req)?;
            Some((lane, at))
        })
    }

    /// Counts FETCH `req` queued, the latest of its id at arrival number `seq` of `lane`.
    fn enqueued(&mut self, req: u64, lane: usize, seq: u64) {
        self.queued += 1;
        let p = self
            .queued_reqs
            .entry(req)
            .or_insert(Place { lane, seq, n: 0 });
        *p = Place {
            lane,
            seq,
            n: p.n + 1,
        };
    }

    /// Counts FETCH `req` out of the queue.
    fn unqueued(&mut self, req: u64) {
        self.queued -= 1;
        if let Some(p) = self.queued_reqs.get_mut(&req) {
            p.n -= 1;
            if p.n == 0 {
                self.queued_reqs.remove(&req);
            }
        }
    }

    /// Whether [`Queues::later`] counts each lane's [`Payload::Later`] entries,
    /// [`Queues::queued_reqs`] the queued FETCHes, and each lane is in arrival order (checked
    /// in debug builds: every test run checks the bookkeeping).
    fn counts_hold(&self) -> bool {
        let later = |w: &VecDeque<Queued>| {
            w.iter()
                .filter(|q| matches!(q.payload, Payload::Later(_)))
                .count()
        };
        let in_order =
            |w: &VecDeque<Queued>| w.iter().zip(w.iter().skip(1)).all(|(a, b)| a.seq < b.seq);
        let reqs: usize = self.queued_reqs.values().map(|p| p.n as usize).sum();
        let all: usize = self.waiting.iter().map(VecDeque::len).sum();
        reqs == self.queued
            && all == self.queued
            && self.waiting.iter().all(in_order)
            && self
                .waiting
                .iter()
                .zip(&self.later)
                .all(|(w, &n)| later(w) == n)
    }
}

/// FETCHes announced that a node's report of a payload that failed its CRC-32C check (by the
/// FETCH's `req`, after the payload arrived) may name: the payloads on their way and checked
/// are a few per data connection, so a report names one of the last few hundred.
const ANNOUNCED_KEPT: usize = 4096;

/// The dataset and shard of the last [`ANNOUNCED_KEPT`] FETCHes a session announced, by
/// request id, oldest first.
#[derive(Default)]
struct Announced(VecDeque<(u64, Arc<str>, u32)>);

impl Announced {
    /// FETCH `req` of `shard` of `dataset` was announced (the oldest kept goes past the limit).
    fn record(&mut self, req: u64, dataset: Arc<str>, shard: u32) {
        if self.0.len() == ANNOUNCED_KEPT {
            self.0.pop_front();
        }
        self.0.push_back((req, dataset, shard));
    }

    /// The dataset and shard of the latest FETCH `req` announced, if it is still kept, taken
    /// out with any older announcement of that id (a node that reuses ids): a node's report
    /// acts once, and a repeated one finds nothing (each report drops the shard's copy in
    /// memory and has its cache entry checked again).
    fn take(&mut self, req: u64) -> Option<(Arc<str>, u32)> {
        let at = self.0.iter().rposition(|(r, ..)| *r == req)?;
        let (_, dataset, shard) = self.0.remove(at).expect("found");
        self.0.retain(|(r, ..)| *r != req);
        Some((dataset, shard))
    }
}

/// The names of the datasets a session's FETCHes named, each allocated once and shared by
/// their heads and [`Announced`] (only names of datasets served here come: a few).
#[derive(Default)]
struct Names(Vec<Arc<str>>);

impl Names {
    /// `name`, shared.
    fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(n) = self.0.iter().find(|n| ***n == *name) {
            return Arc::clone(n);
        }
        let n: Arc<str> = Arc::from(name);
        self.0.push(Arc::clone(&n));
        n
    }
}

/// Per lane of `lanes`: whether it has data connections (`lane_of`, one per connection) and
/// none of them was dialled (`senders`: `None` for one not dialled).
fn undialled_lanes<T>(lanes: usize, senders: &[Option<T>], lane_of: &[u16]) -> Vec<bool> {
    let mut conns = vec![(0usize, 0usize); lanes]; // per lane: (connections, dialled)
    for (s, &lane) in senders.iter().zip(lane_of) {
        if let Some(c) = conns.get_mut(usize::from(lane)) {
            c.0 += 1;
            c.1 += usize::from(s.is_some());
        }
    }
    conns
        .into_iter()
        .map(|(n, dialled)| n > 0 && dialled == 0)
        .collect()
}

struct Session {
    /// This session's id (scopes its hints).
    id: u64,
    ctl: Control,
    shared: Arc<Shared>,
    /// One per data connection; `None` for one not dialled ([`crate::dial`]).
    senders: Vec<Option<Sender>>,
    /// Per lane: it has data connections and none of them could be dialled (a FETCH for it
    /// is refused, to be fetched from another source).
    lane_undialled: Vec<bool>,
    /// Per data connection: the node said `DataReady` (only then are payloads sent on it).
    ready: Vec<bool>,
    /// Every data connection dialled must be ready by then.
    ready_by: Instant,
    /// The lane of each data connection.
    lane_of: Vec<u16>,
    /// The FETCHes waiting, and their reads.
    queues: Queues,
    /// The FETCHes announced last, which the node's reports name.
    announced: Announced,
    /// The names of the datasets its FETCHes named.
    names: Names,
    /// Told when a data connection fails, and why.
    failed: Arc<ConnFailed>,
    progress: Arc<Notify>,
    /// The source's drain flag ([`crate::Source::serve`]).
    draining: tokio::sync::watch::Receiver<bool>,
    /// The node has been told that this source drains.
    drained: bool,
}

impl Session {
    /// Session `id` over control connection `ctl` and data connections `conns`, for a node
    /// of `lanes` lanes; its senders tell `failed` when one fails and notify `progress` as
    /// they send.
    fn new(
        id: u64,
        ctl: Control,
        shared: Arc<Shared>,
        conns: DataConns,
        lanes: usize,
        failed: Arc<ConnFailed>,
        progress: Arc<Notify>,
    ) -> Self {
        let DataConns { senders, lane_of } = conns;
        let queues = Queues::new(id, lanes, Arc::clone(&progress), &shared.session_reads);
        let draining = shared.draining.subscribe();
        let lane_undialled = undialled_lanes(lanes, &senders, &lane_of);
        Session {
            id,
            ctl,
            shared,
            lane_undialled,
            ready: vec![false; senders.len()],
            ready_by: Instant::now() + HANDSHAKE_TIMEOUT,
            senders,
            lane_of,
            queues,
            announced: Announced::default(),
            names: Names::default(),
            failed,
            progress,
            draining,
            drained: false,
        }
    }

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
                (conn, why) = self.failed.wait() => {
                    let e = SessionError::DataFailed { conn, why };
                    return Err(self.last_word(ErrorCode::Internal, e).await);
                }
                _ = self.progress.notified() => continue,
                _ = tokio::time::sleep(STARVED_RECHECK), if self.queues.reads.starved => continue,
                _ = async { self.draining.wait_for(|d| *d).await.is_ok() }, if !self.drained => {
                    self.tell_draining().await?;
                    continue;
                }
                _ = tokio::time::sleep_until(ping_at) => {
                    self.ctl.send(&Message::Ping).await?;
                    continue;
                }
                _ = tokio::time::sleep_until(last_heard + idle) => {
                    if self.ctl.unread() {
                        continue; // it spoke: `recv` was not polled this turn
                    }
                    return Err(SessionError::Idle(idle));
                }
                _ = tokio::time::sleep_until(self.ready_by), if self.not_ready() > 0 => {
                    let conns = self.not_ready();
                    let e = SessionError::NotReady { conns, waited: HANDSHAKE_TIMEOUT };
                    return Err(self.last_word(ErrorCode::BadRequest, e).await);
                }
            };
            self.handle(msg).await?;
            // Heard, and handled: the time a reply took to write (a manifest may take longer
            // than the idle timeout) is not the node's silence.
            last_heard = Instant::now();
        }
    }

    /// Dialled data connections the node has not said `DataReady` for yet.
    fn not_ready(&self) -> usize {
        self.senders
            .iter()
            .zip(&self.ready)
            .filter(|(s, r)| s.is_some() && !**r)
            .count()
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
        let queued = self.queues.queued;
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
            Message::Error {
                req, code, message, ..
            } => {
                self.node_error(req, code, &message);
                Ok(())
            }
            other => {
                let message = format!("unexpected {} after the handshake", kind(&other));
                let _ = self.ctl.error(0, ErrorCode::BadRequest, message).await;
                Err(SessionError::Unexpected {
                    expected: "ManifestRequest, Fetch, Cancel, Hint, DataReady, Error or Ping",
                    got: kind(&other),
                })
            }
        }
    }

    /// An `Error` from the node. `ChecksumMismatch` about a FETCH this session announced: the
    /// payload failed the node's CRC-32C check (the node fetches it again, elsewhere when it
    /// can), so that shard's cache entry is checked against its CRC before it is served again;
    /// a local shard's bytes are rechecked in its file (which every FETCH checks against its
    /// size and modification time only: a rewrite in place that put the time back, or a bad
    /// disk, passes that), and refused from then on if they fail
    /// ([`crate::datasets::Dataset::recheck_local`]). Once per announcement
    /// ([`Announced::take`]): a repeated report is only logged. Any other is only logged: an
    /// `Error` about a request fails that request, and one about none (`req` 0) is news.
    fn node_error(&mut self, req: u64, code: ErrorCode, message: &str) {
        let session = self.id;
        let announced = match code {
            ErrorCode::ChecksumMismatch => self.announced.take(req),
            _ => None,
        };
        match (code, announced) {
            (ErrorCode::ChecksumMismatch, Some((dataset, shard))) => {
                tracing::warn!(session, %dataset, shard, req, node_message = message,
                    "the node reports that a payload this source sent failed its CRC-32C check");
                if let Some(d) = self.shared.datasets.get(&dataset) {
                    match &d.backend {
                        Backend::Remote(r) => r.corrupt_reported(session, shard),
                        Backend::Local { .. } => d.recheck_local(shard),
                    }
                }
            }
            // At debug: a node can repeat a report as often as it likes.
            (ErrorCode::ChecksumMismatch, None) => tracing::debug!(
                session,
                req,
                node_message = message,
                "the node reports a payload that failed its CRC-32C check, for a FETCH not among the last {ANNOUNCED_KEPT} this session announced (or reported already)"
            ),
            _ => tracing::debug!(
                session,
                req,
                ?code,
                node_message = message,
                "the node sent an error"
            ),
        }
    }

    /// Drops FETCH `req` if it is still queued (not on the wire yet) and says so.
    async fn cancel(&mut self, req: u64) -> Result<(), SessionError> {
        if self.queues.take(req).is_none() {
            return Ok(()); // on the wire already, or never queued: nothing to drop
        }
        tracing::debug!(req, "FETCH cancelled before it was sent");
        metrics::counter!("shardwire_source_fetches_cancelled_total").increment(1);
        let why = "cancelled by the node before it was sent".to_string();
        self.ctl.error(req, ErrorCode::Cancelled, why).await
    }

    /// Checks a FETCH and queues it in its lane (or answers it with an error).
    async fn queue(
        &mut self,
        req: u64,
        dataset: &str,
        shard: u32,
        lane: u16,
    ) -> Result<(), SessionError> {
        let lanes = self.queues.waiting.len();
        if usize::from(lane) >= lanes {
            let message = format!("lane {lane} is not one of the node's {lanes} lanes (its Hello)");
            return self.ctl.error(req, ErrorCode::BadRequest, message).await;
        }
        if self.lane_undialled[usize::from(lane)] {
            // Internal: the node fetches it from another source (it was told the lane was not
            // dialled, so only a FETCH that crossed that report comes here).
            let message = format!(
                "lane {lane}'s data address could not be dialled by this source in this session: fetch it from another source"
            );
            return self.ctl.error(req, ErrorCode::Internal, message).await;
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
        if self.queues.queued >= MAX_QUEUED_FETCHES {
            let e = SessionError::TooManyFetches(self.queues.queued);
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
                let range = entry.offset..entry.offset + entry.length;
                // Off the runtime's threads, within a time limit: a network file system
                // whose server stopped answering blocks `fstat` for as long.
                if let Err(why) = self.shared.stats.check(opened, file, range).await {
                    tracing::warn!(dataset, shard, "{why}; FETCH refused");
                    let (code, message) = shard_refusal(&why);
                    let message = format!("dataset `{dataset}`: {message}");
                    return self.ctl.error(req, code, message).await;
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
            dataset: self.names.get(dataset),
        };
        self.queues.push(usize::from(lane), head, payload);
        Ok(())
    }

    /// Dispatches every lane's queue (see [`Session::dispatch_lane`]), then starts the reads
    /// that now have room.
    async fn dispatch(&mut self) -> Result<(), SessionError> {
        for lane in 0..self.queues.waiting.len() {
            self.dispatch_lane(lane).await?;
        }
        self.queues.start_later();
        debug_assert!(
            self.queues.counts_hold(),
            "later counts {:?}",
            self.queues.later
        );
        Ok(())
    }

    /// Answers `lane`'s queued FETCHes whose reads failed, and announces and hands out the
    /// settled ones, in queue order, while a data connection of the lane has room (the least
    /// loaded); once none has room, only the started reads before the first entry of another
    /// kind are looked at ([`look`]).
    async fn dispatch_lane(&mut self, lane: usize) -> Result<(), SessionError> {
        let (mut at, mut later_passed, mut full) = (0, 0, false);
        // Past the last entry that is not waiting for its read to start, nothing can be sent.
        while self.queues.waiting[lane].len() - at > self.queues.later[lane] - later_passed {
            let q = &mut self.queues.waiting[lane][at];
            let later = matches!(q.payload, Payload::Later(_));
            match look(q, full, &self.queues.reads) {
                Look::Stop => break,
                Look::Pass => {
                    later_passed += usize::from(later);
                    at += 1;
                }
                Look::Failed(f) => {
                    let q = self.queues.remove_at(lane, at);
                    self.answer_failed(q, f).await?;
                }
                Look::Ready => match self.room_in(lane) {
                    // Settled but no room: it stays in its place, with its bytes.
                    None => {
                        full = true;
                        at += 1;
                    }
                    Some(conn) => match self.queues.take_ready(lane, at) {
                        Some((head, body, held)) => self.send_out(conn, head, body, held).await?,
                        None => at += 1,
                    },
                },
            }
        }
        Ok(())
    }

    /// Answers FETCH `q`, whose read failed, with the store's error; its bytes go back to
    /// the budgets.
    async fn answer_failed(&mut self, q: Queued, f: Failure) -> Result<(), SessionError> {
        self.queues.reads.release(q.held);
        self.ctl
            .send(&Message::Error {
                req: q.head.req,
                code: f.code,
                retry_after_ms: f.retry_after_ms,
                message: f.message,
            })
            .await
    }

    /// Announces FETCH `q` on data connection `conn` with its bytes `body` (`held` of them
    /// counted in [`Reads`]), unless its local shard file changed since it was queued: that
    /// FETCH is refused.
    async fn send_out(
        &mut self,
        conn: usize,
        q: Head,
        body: Body,
        held: Counted,
    ) -> Result<(), SessionError> {
        if let Some(why) = changed_since_queued(&self.shared.stats, &q, &body).await {
            tracing::warn!(shard = q.shard, "{why}; FETCH refused");
            self.queues.reads.release(held);
            let (code, message) = shard_refusal(&why);
            return self.ctl.error(q.req, code, message).await;
        }
        let reads = &self.queues.reads;
        // Bytes in memory stay counted until its sender has sent them, source-wide too (from
        // when `look` found them read; `in_memory` changes nothing then); a payload read from
        // a file (the cache) holds no memory once handed over.
        let held = match body {
            Body::Memory(_) => reads.held(reads.in_memory(held)),
            Body::File { .. } => {
                reads.release(held);
                Held::default()
            }
        };
        self.announce(conn, q, body, held).await
    }

    /// The least loaded data connection of `lane` with room, if any.
    fn room_in(&self, lane: usize) -> Option<usize> {
        self.senders
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_ref()?)))
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
        let sender = self.senders[conn]
            .as_mut()
            .expect("`room_in` names a dialled connection");
        let seq = sender.seq;
        sender.seq += 1;
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
        // A node names a payload that failed its CRC-32C check by its FETCH's `req`.
        self.announced.record(q.req, q.dataset, q.shard);
        let job = Job {
            body,
            len: q.len,
            corrupt: q.corrupt,
            held,
        };
        let pushed = self.senders[conn].as_ref().is_some_and(|s| s.push(job));
        if !pushed {
            // Its thread has ended: it failed (and said why), or panicked.
            let gone = || (conn as u16, "its sender thread has ended".to_string());
            let (conn, why) = self.failed.first().unwrap_or_else(gone);
            let e = SessionError::DataFailed { conn, why };
            return Err(self.last_word(ErrorCode::Internal, e).await);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
