//! One node <-> source link: the control connection's state (pending fetches, manifest
//! requests, data-connection queues), the API streams use (fetch, cancel, manifest), and the
//! reconnect loop. The session itself ([`session`]) is generic over its I/O.
//!
//! A link knows nothing of the data plane: it announces each data connection the source
//! reports to a [`DataConns`] sink (the data plane's matcher) and forgets them there when it
//! goes down. Ownership of a fetch: the pending table holds it from FETCH until the SHARD
//! announcement, then the announced connection's queue and receiver (see [`crate::fetch`]).
//! When the node ends a session itself (a data connection failed, the source drained, ...),
//! it says why with a [`Kick`].
//!
//! A lane is a unit of failure: a source that cannot dial a lane's data address reports its
//! connections not dialled (`DataConn` with [`wire::NOT_DIALLED`]) and keeps the session with
//! the other lanes. A lane none of whose connections was dialled is *left out* of the session:
//! no fetch for it goes to this link ([`SourceLink::reaches`]), `last_error` names it, and the
//! link does not count as ready ([`SourceLink::is_ready`]) until a session dials every lane.
//! A lane only some of whose connections were dialled runs on those; `last_error` names the
//! lane and the connections missing, and the link does not count as ready either.
//!
//! Nothing dials a connection again within a session, so the node ends a session that still
//! has one not dialled [`REDIAL_AFTER`] after the source first reported one (a NIC still
//! training at boot is up by then): the next session dials every lane again. The wait doubles
//! for each session in a row that the node ended for the same connections, up to
//! [`REDIAL_MAX`] (a lane the source can never reach costs a reconnect at most once an hour),
//! and starts over once a session has every connection ready. Ending a session fails every
//! fetch and manifest request outstanding on it, so the session ends at a moment with nothing
//! under way; from [`REDIAL_BUSY_AFTER`] (doubled likewise) on, the link
//! takes no new fetch ([`SourceLink::takes_new_fetches`]) so that such a moment comes, and no
//! fetch is ever failed for a redial ([`SourceLink::redial_due`]). It counts as a healthy
//! session, so the link reconnects at its shortest wait (100 ms); the other lanes pause for
//! that and the next session's dialling.
//!
//! A lane on a wildcard whose NIC had no IPv4 address when the node started (one still
//! training at boot) is advertised at the control connection's address until the NIC has one;
//! from then on sessions advertise the NIC's, and a session that began before ends at a moment
//! with nothing under way, links one after another ([`readdress`]).

pub mod readdress;
pub mod served;
pub mod session;
pub mod stall;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardwire_protocol::framing::encode_frame;
use shardwire_protocol::wire::{self, EncodeError, LaneAddr, Message};
use tokio::sync::{Notify, mpsc, oneshot, watch};

use self::served::Served;
use self::stall::{Answered, Stall, Waiting};
use crate::fetch::{FetchFailure, Held, InFlight};

/// How long a source may take to write a control frame (the source's `WRITE_TIMEOUT`): it
/// ends the session past it.
const SOURCE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a manifest request waits for its answer, unless a frame is arriving then
/// ([`manifest_limit`]): as long as a source may take to write a manifest under 1 MiB.
pub const MANIFEST_TIMEOUT: Duration = SOURCE_WRITE_TIMEOUT;

/// How long a source may take to write a manifest frame of `len` bytes, as the source rules
/// (its `manifest_write_limit`: its write timeout plus 1 s per MiB) before it ends the
/// session: a manifest request waits that long for a frame it sees arriving.
pub fn manifest_limit(len: usize) -> Duration {
    SOURCE_WRITE_TIMEOUT + Duration::from_secs(len as u64 >> 20)
}

/// How long after the source first reported a data connection of a session not dialled the
/// node ends that session, so that the next one dials every lane again (module docs).
pub const REDIAL_AFTER: Duration = Duration::from_secs(60);

/// While something is under way on the link, the end of a session with a connection not
/// dialled waits for a moment with nothing (ending it would fail it); from this long after the
/// first report on, the link takes no new fetch, so that the moment comes.
pub const REDIAL_BUSY_AFTER: Duration = Duration::from_secs(600);

/// How long past the (backed-off) [`REDIAL_BUSY_AFTER`] a link that still has something under
/// way is given before its session is ended anyway: room for the fetches under way to end and
/// for a large manifest (94 s at the source's limit), while manifest requests, which still go
/// out, cannot keep it busy for good.
pub const REDIAL_FORCE_GRACE: Duration = Duration::from_secs(120);

/// The longest [`REDIAL_AFTER`] and [`REDIAL_BUSY_AFTER`] grow to, doubled for each session
/// in a row the node ended for the same connections not dialled.
pub const REDIAL_MAX: Duration = Duration::from_secs(3600);

/// How long a manifest request waits past its deadline, when no frame is seen arriving then,
/// before it looks again: the session notes a frame under way at its checks (every
/// [`stall::CHECK_EVERY`]), so one that began since the last is seen by the next.
pub const FRAME_LOOK_AGAIN: Duration = Duration::from_secs(stall::CHECK_EVERY.as_secs() + 1);

/// How long a session whose connections `conns` are not dialled waits before the node ends it
/// to dial them again, with nothing under way on the link, and before the link stops taking
/// new fetches so that nothing is: [`REDIAL_AFTER`] and [`REDIAL_BUSY_AFTER`], doubled for
/// each session in a row before it that the node ended for the same connections
/// (`redialled`), up to [`REDIAL_MAX`].
fn redial_waits(redialled: Option<&(Vec<u16>, u32)>, conns: &[u16]) -> (Duration, Duration) {
    let n = match redialled {
        Some((last, n)) if last == conns => (*n).min(16),
        _ => 0,
    };
    let wait = |base: Duration| base.saturating_mul(1 << n).min(REDIAL_MAX);
    (wait(REDIAL_AFTER), wait(REDIAL_BUSY_AFTER))
}

/// What a link needs to know about its node.
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// Shared secret for the handshake.
    pub secret: Option<Vec<u8>>,
    /// Each lane's data address (a wildcard IP is replaced by its NIC's address where it
    /// awaits one and the NIC has one now, else by the control connection's local IP; an IPv4
    /// wildcard cannot be over IPv6: [`session::advertised`]) and the data connections to ask
    /// for on it, lane `i` at index `i`.
    pub lanes: Vec<LaneAddr>,
}

/// A data connection a source announced: which lane, which connection, from where, and the
/// address its lane was advertised at (it must arrive there).
#[derive(Debug, Clone, Copy)]
pub struct Announcement {
    /// Session generation of the link.
    pub generation: u64,
    /// The lane.
    pub lane: u16,
    /// Its connection number (across lanes).
    pub conn: u16,
    /// The source's local address of it.
    pub addr: SocketAddr,
    /// The lane's data address as this session advertised it.
    pub want: SocketAddr,
}

/// Where a link's data-connection announcements go.
pub trait DataConns: Send + Sync {
    /// The source dialled a lane's data address (`a`); payloads for it arrive on `queue`.
    fn announced(
        &self,
        link: &Arc<SourceLink>,
        a: Announcement,
        queue: std::sync::mpsc::Receiver<InFlight>,
    );
    /// Session `generation` of link `link` ended: its unmatched announcements go, and the
    /// fetches queued on them fail with `reason`.
    fn forget(&self, link: usize, generation: u64, reason: &str);
    /// By lane: the IPv4 address its NIC has now where the lane awaits one (a wildcard lane
    /// whose NIC had none at start: `LaneSpec::awaits_nic_address`), else `None` (a
    /// link-local address counts as none); the data plane's answer may be a few seconds old
    /// (one lookup answers every link). Sessions advertise such a lane there
    /// ([`session::advertised`], [`readdress`]). Default: none.
    fn lane_ips(&self) -> Vec<Option<IpAddr>> {
        Vec::new()
    }
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

/// Why the node itself ends a link's session ([`SourceLink::kick`]): said in the session's
/// error, the link's `last_error` and the failure of every fetch the session held, so an
/// operator reads what happened (a drained source is not a broken data connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Kick {
    /// A data connection failed (what its receiver saw).
    #[error("a data connection from this source failed: {0}")]
    DataFailed(String),
    /// The source said it is draining and nothing of it is outstanding any more.
    #[error("the source drained: nothing was outstanding on it, so the node closed its session")]
    Drained,
    /// An RX binding changed over the admin API: the data connections come back on the new
    /// receive path.
    #[error("the node's receive path changed ({0}): the session starts over on the new path")]
    ReceiveChanged(String),
    /// A data connection arrived on another address than its lane's (another NIC).
    #[error(
        "data connection {conn} for lane {lane} arrived on {arrived_on}, not on the lane's address {lane_addr}: check the routes to the lane's subnet"
    )]
    WrongLane {
        /// The connection.
        conn: u16,
        /// Its lane.
        lane: u16,
        /// Where it arrived.
        arrived_on: SocketAddr,
        /// The lane's data address.
        lane_addr: SocketAddr,
    },
    /// The source announced a data connection from an address another announcement expects.
    #[error(
        "the source announced a data connection from {addr}, which another announcement expects already"
    )]
    DuplicateAnnouncement {
        /// The address announced twice.
        addr: SocketAddr,
    },
    /// A data connection the source announced never reached the node.
    #[error(
        "data connection {conn} announced from {addr} did not arrive within {after:?}: check that the source can reach the lane's data address"
    )]
    NeverArrived {
        /// The connection.
        conn: u16,
        /// The address the source announced it from.
        addr: SocketAddr,
        /// How long it was waited for.
        after: Duration,
    },
    /// Lanes this session advertised at another address than their NIC's now (the control
    /// connection's, before the NIC had one, or the NIC's old one): the next session
    /// advertises that ([`readdress`]).
    #[error(
        "the NICs of lanes {lanes:?} have an IPv4 address now ({addrs:?}) other than the one this session advertised (it began before they had it, or their address changed): the node ended it so that the next one dials those lanes there"
    )]
    Readdressed {
        /// The lanes.
        lanes: Vec<u16>,
        /// Their data addresses now, in the same order.
        addrs: Vec<SocketAddr>,
    },
    /// Data connections of the session stayed not dialled ([`wire::NOT_DIALLED`]) for
    /// [`REDIAL_AFTER`] or more (doubled for each such session in a row):
    /// the next session dials every lane again.
    #[error(
        "the source did not dial data connections {conns:?} (lanes {lanes:?}) of this session for {waited:?} ({said}): the node ended the session so that the next one dials every lane again"
    )]
    Redial {
        /// The lanes of those connections.
        lanes: Vec<u16>,
        /// The connections not dialled.
        conns: Vec<u16>,
        /// How long since the source reported the first (whole seconds).
        waited: Duration,
        /// What the source said of each of those lanes.
        said: String,
    },
}

/// Why a manifest request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ManifestError {
    /// The link is down, or went down while waiting.
    #[error("source {addr} is not connected ({reason})")]
    Down {
        /// The source.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The request cannot be encoded (a dataset name over its wire limit, say).
    #[error("cannot ask source {addr} for a manifest: {source}")]
    Encode {
        /// The source.
        addr: String,
        /// Which field and limit.
        #[source]
        source: EncodeError,
    },
    /// The source answered with the manifest of another dataset than the one asked for.
    #[error(
        "source {addr} answered the manifest request for dataset `{asked}` with dataset `{got}`'s"
    )]
    WrongDataset {
        /// The source.
        addr: String,
        /// The dataset asked for.
        asked: String,
        /// The dataset of the answer.
        got: String,
    },
    /// The source answered with an error (e.g. it does not serve the dataset).
    #[error("{code:?}: {message}")]
    Refused {
        /// The source's code.
        code: wire::ErrorCode,
        /// Its message.
        message: String,
    },
    /// No answer in time, and no frame arriving that might be one.
    #[error("source {addr} did not answer within {after:?}")]
    Timeout {
        /// The source.
        addr: String,
        /// The limit.
        after: Duration,
    },
}

#[derive(Default)]
struct LinkState {
    generation: u64,
    /// Encoded frames for the session's writer.
    ctl: Option<mpsc::UnboundedSender<Vec<u8>>>,
    conns: Vec<Option<std::sync::mpsc::Sender<InFlight>>>,
    /// The lane of each data connection.
    conn_lane: Vec<u16>,
    /// Whether the node sent `DataReady` for each data connection: no payload may be
    /// announced on one before it.
    ready: Vec<bool>,
    /// Whether the source reported each data connection not dialled ([`wire::NOT_DIALLED`]).
    undialled: Vec<bool>,
    /// Per lane: none of its data connections was dialled, so it is left out of the session.
    lanes_out: Vec<bool>,
    /// Per lane with a data connection not dialled: what the source said of it (its `Error`
    /// about no request before the lane's first report), shown in the link's `last_error`
    /// while the session lasts.
    lane_said: Vec<Option<String>>,
    /// When the source first reported a data connection of this session not dialled: the
    /// session is redialled from [`REDIAL_AFTER`] on ([`SourceLink::redial_due`]).
    undialled_since: Option<tokio::time::Instant>,
    /// The connections not dialled of the last session the node ended to dial them again,
    /// and how many sessions in a row it ended for that same set ([`redial_waits`]). Kept
    /// across sessions; cleared once a session has every data connection ready.
    redialled: Option<(Vec<u16>, u32)>,
    /// The last `Error` about no request the source sent in this session: why a lane it
    /// reports next was not dialled, or why it ends the session (then it closes the control
    /// connection, and this is the session's error: `LinkError::SourceEnded`).
    said: Option<String>,
    /// The `seq` the next payload announced on each data connection must have.
    next_seq: Vec<u64>,
    /// Each lane's data address as this session advertised it.
    advertised: Vec<SocketAddr>,
    /// When a lane's NIC was first seen with an address this session did not advertise
    /// ([`readdress`]), while that lasts.
    moved_since: Option<tokio::time::Instant>,
    data_socks: Vec<TcpStream>,
}

/// A manifest request waiting for its answer: the dataset asked for, and where the answer goes.
type ManifestWaiter = (String, oneshot::Sender<Result<Vec<u8>, ManifestError>>);

/// Cancels sent, and fetches the source confirmed it dropped.
#[derive(Debug, Default)]
pub struct CancelCounts {
    /// Cancels sent.
    pub sent: AtomicU64,
    /// Fetches the source confirmed it dropped.
    pub confirmed: AtomicU64,
}

/// One source: configured, or found by DNS.
pub struct SourceLink {
    /// The link's id in this node, never reused (a source that leaves and comes back gets a
    /// new link).
    pub index: usize,
    /// HOST:PORT.
    pub addr: String,
    cfg: LinkConfig,
    state: Mutex<LinkState>,
    pending: Mutex<HashMap<u64, InFlight>>,
    manifest_waiters: Mutex<HashMap<u64, ManifestWaiter>>,
    up: AtomicBool,
    abort: Notify,
    abort_reason: Mutex<Option<Kick>>,
    /// Payload bytes received from this source.
    pub bytes: AtomicU64,
    /// Last connection error, for status.
    pub last_error: Mutex<Option<String>>,
    /// Cancelled fetches.
    pub cancels: CancelCounts,
    /// FETCHes sent.
    pub fetches: AtomicU64,
    /// The dataset versions the source serves.
    pub served: Served,
    /// The source said it is draining (until its next session).
    draining: AtomicBool,
    /// The node is letting it go (its address left DNS).
    retiring: AtomicBool,
    /// The session is due to be redialled but something is under way: the link takes no new
    /// fetch until its next session ([`SourceLink::redial_due`]).
    redial_waiting: AtomicBool,
    /// The same, for a session due to end so that lanes move to their NICs' addresses
    /// ([`readdress`]).
    readdress_waiting: AtomicBool,
    /// Fetches sent on it and not ended yet.
    outstanding: Arc<AtomicUsize>,
    /// When the source last answered a fetch, or payload bytes last landed (or the session
    /// began): see [`stall`].
    answered: Mutex<Answered>,
    /// Payload bytes that landed on this link's data connections, whole payloads or not,
    /// verified or not (the source at work, for [`stall`]).
    pub landed: AtomicU64,
    /// The control frame arriving, as the session last saw it: its length, and when the
    /// session first saw it under way.
    arriving: Mutex<Option<(usize, tokio::time::Instant)>>,
}

impl std::fmt::Debug for SourceLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceLink")
            .field("index", &self.index)
            .field("addr", &self.addr)
            .field("up", &self.is_up())
            .finish_non_exhaustive()
    }
}

impl SourceLink {
    /// A link that is not connected yet.
    pub fn new(index: usize, addr: String, cfg: LinkConfig) -> Arc<Self> {
        Arc::new(Self {
            index,
            addr,
            cfg,
            state: Mutex::default(),
            pending: Mutex::default(),
            manifest_waiters: Mutex::default(),
            up: AtomicBool::new(false),
            abort: Notify::new(),
            abort_reason: Mutex::default(),
            bytes: AtomicU64::new(0),
            last_error: Mutex::default(),
            cancels: CancelCounts::default(),
            fetches: AtomicU64::new(0),
            served: Served::default(),
            draining: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
            redial_waiting: AtomicBool::new(false),
            readdress_waiting: AtomicBool::new(false),
            outstanding: Arc::default(),
            answered: Mutex::new(Answered::new(Instant::now(), 0)),
            landed: AtomicU64::new(0),
            arriving: Mutex::default(),
        })
    }

    /// The source is draining: it takes no new FETCH this session.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The source said it is draining (wire `Error{req 0, Draining}`).
    pub fn set_draining(&self, message: &str) {
        if !self.draining.swap(true, Ordering::AcqRel) {
            tracing::info!(source = %self.addr, %message, "source is draining: no new fetches go to it");
        }
    }

    /// The node is letting the link go (false: it came back before it was gone).
    pub fn set_retiring(&self, retiring: bool) {
        self.retiring.store(retiring, Ordering::Release);
    }

    /// The node is letting the link go.
    pub fn is_retiring(&self) -> bool {
        self.retiring.load(Ordering::Acquire)
    }

    /// Whether new fetches may go to this source (up or not): neither draining nor retiring,
    /// nor waiting for its fetches to end so that its session is redialled
    /// ([`SourceLink::redial_due`]) or moves lanes to their NICs' addresses
    /// ([`SourceLink::readdress_due`]).
    pub fn takes_new_fetches(&self) -> bool {
        self.takes_new_streams()
            && !self.redial_waiting.load(Ordering::Acquire)
            && !self.readdress_waiting.load(Ordering::Acquire)
    }

    /// Whether streams may be placed on the lanes this link reaches: not draining or retiring.
    /// A link waiting to redial takes no new fetch for a while, but its next session serves
    /// the same lanes, so placement still counts it (and still passes over the lanes it left
    /// out).
    pub fn takes_new_streams(&self) -> bool {
        !self.is_draining() && !self.is_retiring()
    }

    /// `draining`, `retiring` or `active` (`/v1/status`).
    pub fn state_name(&self) -> &'static str {
        if self.is_retiring() {
            "retiring"
        } else if self.is_draining() {
            "draining"
        } else {
            "active"
        }
    }

    /// Fetches sent on this link that have not ended (pending or being received).
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Acquire)
    }

    /// The current session's number (0 before the first).
    pub fn generation(&self) -> u64 {
        self.state.lock().expect("poisoned").generation
    }

    /// True while the control connection is established and authenticated.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// True while the session is up and every data connection of it is ready (the node sent
    /// its `DataReady`): what `/readyz` counts. A session is not ready while it is still
    /// dialling, nor at all when the source left a connection or a lane out (not dialled):
    /// `last_error` says which and why, and the session is redialled ([`REDIAL_AFTER`]).
    pub fn is_ready(&self) -> bool {
        if !self.is_up() {
            return false;
        }
        let st = self.state.lock().expect("poisoned");
        st.ctl.is_some() && !st.ready.is_empty() && st.ready.iter().all(|r| *r)
    }

    /// Whether fetches for lane `lane` may go to this link: not while the source left the
    /// lane out of the current session (none of its data connections was dialled).
    pub fn reaches(&self, lane: u16) -> bool {
        let st = self.state.lock().expect("poisoned");
        !st.lanes_out
            .get(usize::from(lane))
            .copied()
            .unwrap_or(false)
    }

    /// The lanes the source left out of the current session, with their data addresses as
    /// the session advertised them.
    pub fn lanes_left_out(&self) -> Vec<(u16, SocketAddr)> {
        let st = self.state.lock().expect("poisoned");
        let out = st.lanes_out.iter().zip(&st.advertised).enumerate();
        out.filter(|(_, (o, _))| **o)
            .map(|(lane, (_, addr))| (lane as u16, *addr))
            .collect()
    }

    /// Marks the link up or down without a session (unit tests of routing).
    #[cfg(test)]
    pub(crate) fn force_up(&self, up: bool) {
        self.up.store(up, Ordering::Release);
    }

    /// Marks lane `lane` (data address `addr`) left out of the session without a session
    /// (unit tests of routing).
    #[cfg(test)]
    pub(crate) fn force_lane_out(&self, lane: u16, addr: SocketAddr) {
        let mut st = self.state.lock().expect("poisoned");
        let l = usize::from(lane);
        if st.lanes_out.len() <= l {
            st.lanes_out.resize(l + 1, false);
            st.advertised.resize(l + 1, addr);
        }
        st.lanes_out[l] = true;
        st.advertised[l] = addr;
    }

    /// Fetches waiting for the source's announcement.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().expect("poisoned").len()
    }

    /// Asks the link to drop its current session, for `why`.
    pub fn kick(&self, why: Kick) {
        *self.abort_reason.lock().expect("poisoned") = Some(why);
        self.abort.notify_waiters();
    }

    /// [`SourceLink::kick`], only while session `generation` is the current one: a
    /// connection of an older session that fails late must not end its successor.
    pub fn kick_session(&self, generation: u64, why: Kick) {
        // Under the state lock, as `establish` bumps the generation and clears the reason
        // under it: a reason set between a check and the set would end the new session.
        let st = self.state.lock().expect("poisoned");
        if st.generation == generation {
            *self.abort_reason.lock().expect("poisoned") = Some(why);
            drop(st);
            self.abort.notify_waiters();
        } else {
            tracing::debug!(source = %self.addr, generation, reason = %why, "not ending the link's newer session for a connection of an older one");
        }
    }

    /// A data connection of session `generation` failed (`reason`: what its receiver saw):
    /// [`SourceLink::kick_session`] with [`Kick::DataFailed`].
    pub fn kick_if(&self, generation: u64, reason: &str) {
        self.kick_session(generation, Kick::DataFailed(reason.to_owned()));
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

    /// Sends a FETCH of `dataset`'s shard `shard` for `f`, to come on a data connection of
    /// `f.lane`; gives the fetch back if it cannot be sent.
    pub fn fetch(
        &self,
        req: u64,
        dataset: &str,
        shard: u32,
        mut f: InFlight,
    ) -> Result<(), Box<(InFlight, SendError)>> {
        let st = self.state.lock().expect("poisoned");
        let msg = Message::Fetch {
            req,
            dataset: dataset.into(),
            shard,
            lane: f.lane,
        };
        let Some(ctl) = st.ctl.as_ref() else {
            return Err(Box::new((f, SendError::Down(self.addr.clone()))));
        };
        f.req = req;
        f.wire_shard = shard;
        // Weak: a CRC report for this FETCH goes to the session that sent it or nowhere.
        f.held = Some(Held::new(&self.outstanding, Some(ctl.downgrade())));
        // Pending before the send, so an answer can never come for an unknown request.
        self.pending.lock().expect("poisoned").insert(req, f);
        let Err(e) = self.send(&st, &msg) else {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        match self.pending.lock().expect("poisoned").remove(&req) {
            Some(mut f) => {
                f.held = None;
                Err(Box::new((f, e)))
            }
            // Not expected while the state lock is held (`go_down` clears `ctl` under it
            // before it empties `pending`), but never a panic: a fetch that left `pending`
            // was finished as `LinkDown`, and its stream fetches it again from that failure.
            None => Ok(()),
        }
    }

    /// Tells the source which shards of `dataset` stream `stream` will fetch from it next,
    /// soonest first (an empty list withdraws the stream's hint). Advice only: a link that is
    /// down drops it, and the stream hints again as it goes.
    pub fn hint(&self, stream: u64, dataset: &str, shards: Vec<u32>) -> Result<(), SendError> {
        let st = self.state.lock().expect("poisoned");
        let msg = Message::Hint {
            stream,
            dataset: dataset.into(),
            shards,
        };
        self.send(&st, &msg)
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
            .filter(|f| f.stream == stream)
            .map(|f| f.req)
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
    pub async fn request_manifest(
        &self,
        req: u64,
        dataset: &str,
    ) -> Result<Vec<u8>, ManifestError> {
        let (tx, rx) = oneshot::channel();
        {
            let st = self.state.lock().expect("poisoned");
            self.manifest_waiters
                .lock()
                .expect("poisoned")
                .insert(req, (dataset.to_owned(), tx));
            let msg = Message::ManifestRequest {
                req,
                dataset: dataset.into(),
            };
            if let Err(e) = self.send(&st, &msg) {
                self.manifest_waiters.lock().expect("poisoned").remove(&req);
                return Err(match e {
                    SendError::Down(addr) => ManifestError::Down {
                        addr,
                        reason: "no control connection".into(),
                    },
                    SendError::Encode { addr, source } => ManifestError::Encode { addr, source },
                });
            }
        }
        let answer = self.manifest_answer(rx).await;
        self.manifest_waiters.lock().expect("poisoned").remove(&req);
        answer
    }

    /// Waits for a manifest request's answer on `rx`: [`MANIFEST_TIMEOUT`], and while a
    /// control frame is arriving (a large manifest on a slow path), as long as the source may
    /// take to write it ([`manifest_limit`] of its length, from when the session saw it). At a
    /// deadline with no such frame seen, it looks again [`FRAME_LOOK_AGAIN`] later: a frame
    /// that began since the session's last check (a manifest queued behind another) is seen
    /// by then.
    async fn manifest_answer(
        &self,
        mut rx: oneshot::Receiver<Result<Vec<u8>, ManifestError>>,
    ) -> Result<Vec<u8>, ManifestError> {
        let began = tokio::time::Instant::now();
        let mut deadline = began + MANIFEST_TIMEOUT;
        let mut looked_again = false;
        loop {
            match tokio::time::timeout_at(deadline, &mut rx).await {
                Ok(Ok(r)) => return r,
                Ok(Err(_)) => {
                    return Err(ManifestError::Down {
                        addr: self.addr.clone(),
                        reason: "the link went down".into(),
                    });
                }
                Err(_) => match self.frame_due() {
                    Some(due) if due > deadline => (deadline, looked_again) = (due, false),
                    _ if !looked_again => {
                        (deadline, looked_again) = (deadline + FRAME_LOOK_AGAIN, true);
                    }
                    _ => {
                        return Err(ManifestError::Timeout {
                            addr: self.addr.clone(),
                            after: deadline - began,
                        });
                    }
                },
            }
        }
    }

    /// When the control frame arriving must be in, if one is: its source's limit for writing
    /// it from when the session first saw it.
    fn frame_due(&self) -> Option<tokio::time::Instant> {
        let arriving = *self.arriving.lock().expect("poisoned");
        arriving.map(|(len, seen)| seen + manifest_limit(len))
    }

    /// Notes the control frame under way in the session's buffer `buf` (its length prefix
    /// read, not all of it yet), or that none is.
    fn note_frame(&self, buf: &[u8]) {
        let len = buf
            .first_chunk::<4>()
            .map(|p| u32::from_be_bytes(*p) as usize);
        let mut arriving = self.arriving.lock().expect("poisoned");
        match len {
            Some(len) if buf.len() < 4 + len => {
                if arriving.is_none_or(|(seen_len, _)| seen_len != len) {
                    *arriving = Some((len, tokio::time::Instant::now()));
                }
            }
            _ => *arriving = None,
        }
    }

    /// A data socket for session `generation` was identified: kept (to unblock its receiver
    /// when the session ends), unless that session is gone (false: drop the socket).
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

    /// Tells the source that data connection `conn` of session `generation` is identified
    /// and received from (`DataReady`): only then does it send payloads on it.
    pub fn data_ready(&self, generation: u64, conn: u16) {
        let mut st = self.state.lock().expect("poisoned");
        if st.generation != generation {
            return;
        }
        // Marked before the frame is queued (under the lock the session's `Shard` check
        // takes): the source's first payload on it can only follow this.
        if let Some(ready) = st.ready.get_mut(usize::from(conn)) {
            *ready = true;
        }
        if let Err(e) = self.send(&st, &Message::DataReady { conn }) {
            tracing::debug!(source = %self.addr, conn, error = %e, "DataReady not sent: the session is gone");
        }
        // The session is fully up (no lane left out: a connection not dialled is never
        // ready): why the last one ended, or why none came up, is past.
        if st.ctl.is_some() && st.ready.iter().all(|r| *r) {
            *self.last_error.lock().expect("poisoned") = None;
            st.redialled = None; // the next connection not dialled waits the shortest time
        }
    }

    /// Marks a new session up: its writer's queue, one empty slot per data connection of
    /// every lane, and the lane addresses it advertised.
    fn establish(&self, ctl: mpsc::UnboundedSender<Vec<u8>>, lanes: &[LaneAddr]) -> u64 {
        let mut st = self.state.lock().expect("poisoned");
        st.generation += 1;
        st.ctl = Some(ctl);
        st.conn_lane = wire::conn_lanes(lanes);
        st.conns = st.conn_lane.iter().map(|_| None).collect();
        st.ready = vec![false; st.conn_lane.len()];
        st.undialled = vec![false; st.conn_lane.len()];
        st.lanes_out = vec![false; lanes.len()];
        st.lane_said = vec![None; lanes.len()];
        st.undialled_since = None;
        st.said = None;
        st.next_seq = vec![0; st.conn_lane.len()];
        st.advertised = lanes.iter().map(|l| l.data_addr).collect();
        st.moved_since = None;
        *self.abort_reason.lock().expect("poisoned") = None;
        self.draining.store(false, Ordering::Release);
        self.redial_waiting.store(false, Ordering::Release);
        self.readdress_waiting.store(false, Ordering::Release);
        self.up.store(true, Ordering::Release);
        // `last_error` stays until the session is ready ([`SourceLink::data_ready`]): a link
        // whose sessions keep failing before then shows why.
        *self.arriving.lock().expect("poisoned") = None;
        self.fetch_answered();
        st.generation
    }

    /// Notes that the source answered a fetch (or a session began).
    fn fetch_answered(&self) {
        let now = tokio::time::Instant::now().into_std();
        self.answered.lock().expect("poisoned").answered(now);
    }

    /// Whether the source of this session stopped answering the fetches waiting on it, at
    /// `now` (see [`stall`]): payload bytes landing count as answers.
    pub fn stalled(&self, now: Instant) -> Option<Stall> {
        let landed = self.landed.load(Ordering::Relaxed);
        let answered = self.answered.lock().expect("poisoned").last(now, landed);
        let pending = self.pending.lock().expect("poisoned");
        let waiting = pending.values().map(|f| Waiting {
            req: f.req,
            issued: f.issued,
            length: f.length,
        });
        stall::check(now, answered, waiting)
    }

    /// Whether the node ends the current session at `now` so that the next one dials every
    /// lane again ([`Kick::Redial`]): a data connection of it was reported not dialled its
    /// wait ago or more ([`REDIAL_AFTER`], doubled for each session in a row ended for the
    /// same connections, up to [`REDIAL_MAX`]), and nothing is under way on the link (a fetch,
    /// a manifest request or a control frame arriving: ending the session would fail it). From
    /// the busy wait on, the link takes no new fetch, so that nothing is soon; from
    /// [`REDIAL_FORCE_GRACE`] after it, the session ends anyway (what is under way fails and is
    /// retried).
    /// Never for a draining source: it takes no new session.
    pub fn redial_due(&self, now: tokio::time::Instant) -> Option<Kick> {
        if self.is_draining() {
            return None;
        }
        let mut st = self.state.lock().expect("poisoned");
        let waited = now.saturating_duration_since(st.undialled_since?);
        let undialled = st.undialled.iter().enumerate().filter(|(_, u)| **u);
        let conns: Vec<u16> = undialled.map(|(c, _)| c as u16).collect();
        let (after, busy_after) = redial_waits(st.redialled.as_ref(), &conns);
        if waited < after {
            return None;
        }
        if self.busy() {
            if waited >= busy_after && !self.redial_waiting.swap(true, Ordering::AcqRel) {
                tracing::info!(source = %self.addr, ?conns, ?waited,
                    "the session is due to dial its data connections again: no new fetch goes to the source until the ones under way end");
            }
            // Manifest requests still come while no fetch does (an unanswered one is asked
            // again): past this grace the session is ended anyway, failing what is under way,
            // so that a link that never falls quiet cannot hold the source off for good.
            if waited < busy_after.saturating_add(REDIAL_FORCE_GRACE) {
                return None;
            }
            tracing::warn!(source = %self.addr, ?conns, ?waited,
                "the session is still busy past its redial limit: ending it anyway, what is under way fails and is retried");
        }
        st.redialled = match st.redialled.take() {
            Some((last, n)) if last == conns => Some((last, n.saturating_add(1))),
            _ => Some((conns.clone(), 1)),
        };
        let mut lanes: Vec<u16> = conns
            .iter()
            .map(|&c| st.conn_lane[usize::from(c)])
            .collect();
        lanes.dedup(); // connections are numbered in lane order
        let said: Vec<&str> = st.lane_said.iter().flatten().map(String::as_str).collect();
        Some(Kick::Redial {
            lanes,
            conns,
            waited: Duration::from_secs(waited.as_secs()),
            said: said.join("; "),
        })
    }

    /// Whether ending the session now would fail something under way on it: a fetch
    /// outstanding, a manifest request waiting, or a control frame arriving.
    fn busy(&self) -> bool {
        self.outstanding() > 0
            || !self.manifest_waiters.lock().expect("poisoned").is_empty()
            || self.arriving.lock().expect("poisoned").is_some()
    }

    /// Ends the current session: receivers are unblocked, and every fetch and manifest
    /// request waiting on it fails with `reason`.
    fn go_down(&self, conns: &dyn DataConns, reason: &str) {
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
        conns.forget(self.index, generation, reason);
        let down = || FetchFailure::LinkDown {
            source_addr: self.addr.clone(),
            reason: reason.to_owned(),
        };
        for (_, f) in self.pending.lock().expect("poisoned").drain() {
            f.finish(Err(down()));
        }
        for (_, (_, w)) in self.manifest_waiters.lock().expect("poisoned").drain() {
            let _ = w.send(Err(ManifestError::Down {
                addr: self.addr.clone(),
                reason: reason.to_owned(),
            }));
        }
    }
}

/// A session that lasted this long was healthy: the next dial after it waits the shortest
/// time again. One that ends sooner (a lane that fails every session right after the
/// handshake) keeps doubling the wait, so a fault that repeats does not redial 10 times a
/// second, re-reading and dropping the same shards.
const HEALTHY_SESSION: Duration = Duration::from_secs(10);

// A session the node ends to redial a connection not dialled lived long enough to count as
// healthy: its link reconnects at the shortest wait.
const _: () = assert!(REDIAL_AFTER.as_secs() >= HEALTHY_SESSION.as_secs());

/// Why a link's task was stopped: its source was retired (its address left DNS), or the
/// node shuts down. The fetches it still held fail with this.
fn stopped_reason(link: &SourceLink) -> &'static str {
    match link.is_retiring() {
        true => "the source was retired (its address left DNS); its fetches go to other sources",
        false => "node shutting down",
    }
}

/// Whether a session that never came up failed for the node's own configuration (a lane's
/// data address of the wrong family: [`session::LinkError::DataListenFamily`]) and did not
/// the last time for the same `reason`: worth a warning once, not a debug line every retry.
fn config_error(result: &Result<(), session::LinkError>, link: &SourceLink, reason: &str) -> bool {
    let family = matches!(result, Err(session::LinkError::DataListenFamily { .. }));
    family && link.last_error.lock().expect("poisoned").as_deref() != Some(reason)
}

/// Keeps the link connected until shutdown, reconnecting with backoff.
pub async fn run(
    link: Arc<SourceLink>,
    conns: Arc<dyn DataConns>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let began = tokio::time::Instant::now();
        let result = tokio::select! {
            r = session::connect_and_serve(&link, conns.as_ref()) => r,
            _ = shutdown.changed() => Ok(()),
        };
        let reason = match &result {
            Ok(()) => stopped_reason(&link).to_owned(),
            Err(e) => format!("source {}: {e}", link.addr),
        };
        let was_up = link.is_up();
        link.go_down(conns.as_ref(), &reason);
        if *shutdown.borrow() {
            return;
        }
        if was_up {
            let lived = began.elapsed();
            tracing::warn!(source = %link.addr, error = %reason, ?lived, "source link down; reconnecting");
            if lived >= HEALTHY_SESSION {
                backoff = Duration::from_millis(100);
            }
        } else if config_error(&result, &link, &reason) {
            tracing::warn!(source = %link.addr, error = %reason, "source not reachable with this node's lane addresses; retrying");
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
