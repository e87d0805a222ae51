//! One control session with a source, generic over its I/O so that unit tests play the
//! source over an in-memory pipe: the handshake (with the frame cap of an unauthenticated
//! peer), the writer (frames queued by [`SourceLink`]'s API, each within [`WRITE_TIMEOUT`],
//! and a `Ping` after a third of the idle timeout), and the reader, which hands each message to
//! [`handle`] and ends the session when the source is silent for its idle timeout, when it
//! keeps the session alive but stops answering the FETCHes that wait on it ([`stall`]), or
//! when a data connection it did not dial is due to be dialled again
//! ([`SourceLink::redial_due`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_protocol::auth::{self, NONCE_LEN, Role};
use shardwire_protocol::framing::{FrameError, encode_frame, read_message, write_message};
use shardwire_protocol::wire::{self, DecodeError, ErrorCode, LaneAddr, Message};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::stall::{self, Stall};
use super::{
    Announcement, DataConns, Kick, LinkState, ManifestError, REDIAL_AFTER, REDIAL_BUSY_AFTER,
    REDIAL_FORCE_GRACE, REDIAL_MAX, SourceLink,
};
use crate::fetch::{FetchFailure, InFlight};

/// The handshake must be done within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A control write the source does not take within this time ends the session.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// The node ended the session itself (a data connection failed, the source drained, the
    /// receive path changed, ...).
    #[error(transparent)]
    Ended(#[from] Kick),
    /// The source sent nothing for its idle timeout.
    #[error("the source sent nothing for {0:?} (idle timeout)")]
    Idle(Duration),
    /// A control write did not finish in time.
    #[error("a control write did not finish within {0:?} (the source stopped reading)")]
    WriteTimeout(Duration),
    /// The source speaks another protocol version.
    #[error("the source speaks shardwire protocol version {theirs}, this node version {ours}: run the same release on nodes and sources", ours = wire::VERSION)]
    Version {
        /// The source's version.
        theirs: u8,
    },
    /// The source keeps the session alive but stopped answering FETCHes.
    #[error("{0}")]
    Stalled(#[from] Stall),
    /// The source's first answer could not be read: a source of protocol version 3 refuses
    /// a later node with an `Error` in version 2's layout, which this version misreads.
    #[error("the source's answer to this node's Hello could not be read ({0}): a source of another protocol version answers so (this node speaks version {ours}; see the source's log: run the same release on nodes and sources), or the address is not a shardwire source", ours = wire::VERSION)]
    UnreadableAnswer(DecodeError),
    /// The source closed the connection before answering `Hello`.
    #[error("the source closed the connection after this node's Hello without answering: a source of another protocol version does that (this node speaks version {ours}; see the source's log), or it refused this node", ours = wire::VERSION)]
    ClosedAfterHello,
    /// The source said why it ends the session (an `Error` about no request, such as a data
    /// connection it could not dial), then the control connection closed.
    #[error("{said} (then: {closed})")]
    SourceEnded {
        /// What the source said.
        said: String,
        /// How the connection ended.
        #[source]
        closed: FrameError,
    },
    /// A lane's wildcard IPv4 data address cannot be advertised: the node reaches the source
    /// over IPv6, and an IPv4 listener takes no IPv6 connection.
    #[error(
        "lane {lane}'s data address is data_listen {data_listen}, which takes IPv4 data connections only, but this node reaches the source over IPv6 (from {local_ip}): set data_listen to [::]:{port} (it takes both), or give the source an IPv4 address", port = .data_listen.port()
    )]
    DataListenFamily {
        /// The lane.
        lane: usize,
        /// Its data address (an IPv4 wildcard).
        data_listen: std::net::SocketAddr,
        /// The node's address of the control connection.
        local_ip: std::net::IpAddr,
    },
}

/// Connects to the link's source and serves the session until it ends.
pub async fn connect_and_serve(
    link: &Arc<SourceLink>,
    conns: &dyn DataConns,
) -> Result<(), LinkError> {
    let connect_err = |source| LinkError::Connect {
        addr: link.addr.clone(),
        source,
    };
    // Bounded like the handshake: a source address that drops SYNs fails in seconds, not
    // after the kernel's minutes of retries, and the link backs off and tries again.
    let stream = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio::net::TcpStream::connect(&link.addr),
    )
    .await
    .map_err(|_| connect_err(std::io::ErrorKind::TimedOut.into()))?
    .map_err(connect_err)?;
    let _ = stream.set_nodelay(true);
    let local_ip = stream.local_addr().map_err(connect_err)?.ip();
    let lanes = advertised(&link.cfg.lanes, local_ip, &conns.lane_ips())?;
    let (rd, wr) = stream.into_split();
    serve(
        link,
        conns,
        BufReader::with_capacity(256 << 10, rd),
        wr,
        &lanes,
    )
    .await
}

/// The lanes as a session advertises them: a wildcard data address becomes its NIC's address
/// where the lane awaits one and the NIC has one now (`nic_ips`, by lane:
/// [`DataConns::lane_ips`]), else `local_ip` (the node's address of the control connection:
/// one the source can reach), with its port. An IPv4 wildcard (`0.0.0.0`, an IPv4-only
/// listener) cannot take the IPv6 `local_ip` of a control connection over IPv6: that is an
/// error naming the lane (`[::]` takes both).
pub fn advertised(
    lanes: &[LaneAddr],
    local_ip: std::net::IpAddr,
    nic_ips: &[Option<std::net::IpAddr>],
) -> Result<Vec<LaneAddr>, LinkError> {
    let local_ip = local_ip.to_canonical();
    let one = |(lane, l): (usize, &LaneAddr)| {
        let a = l.data_addr;
        let nic = nic_ips.get(lane).copied().flatten();
        let data_addr = match (a.ip(), nic) {
            (ip, _) if !ip.is_unspecified() => a,
            // The wildcard listener takes connections to every address of the host.
            (_, Some(nic)) => std::net::SocketAddr::new(nic, a.port()),
            (std::net::IpAddr::V4(_), None) if local_ip.is_ipv6() => {
                return Err(LinkError::DataListenFamily {
                    lane,
                    data_listen: a,
                    local_ip,
                });
            }
            (_, None) => std::net::SocketAddr::new(local_ip, a.port()),
        };
        Ok(LaneAddr {
            data_addr,
            flows: l.flows,
        })
    };
    lanes.iter().enumerate().map(one).collect()
}

/// Runs a whole session over `rd`/`wr`: handshake, then messages until it ends.
pub async fn serve<R, W>(
    link: &Arc<SourceLink>,
    conns: &dyn DataConns,
    mut rd: R,
    mut wr: W,
    lanes: &[LaneAddr],
) -> Result<(), LinkError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    let hs = handshake(link, &mut rd, &mut wr, &mut buf, lanes);
    let idle = tokio::time::timeout(HANDSHAKE_TIMEOUT, hs)
        .await
        .map_err(|_| LinkError::Timeout(HANDSHAKE_TIMEOUT))??;
    let (ctl_tx, ctl_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let generation = link.establish(ctl_tx, lanes);
    let addrs: Vec<String> = lanes
        .iter()
        .map(|l| format!("{}x{}", l.data_addr, l.flows))
        .collect();
    tracing::info!(source = %link.addr, lanes = %addrs.join(" "),
        authenticated = link.cfg.secret.is_some(), ?idle, "source link up");
    let writer = write_frames(wr, ctl_rx, idle);
    tokio::pin!(writer);
    let mut stall_check = tokio::time::interval(stall::CHECK_EVERY);
    let mut heard_by = Instant::now() + idle;
    // Bytes of a frame under way when the source was last heard: a frame that takes longer
    // than the idle timeout to arrive (a large manifest on a slow path) is not silence.
    let mut heard_len = buf.len();
    loop {
        // Registered before the reason is looked at: a kick between the look and the wait
        // below wakes it (`notify_waiters` keeps no permit for a waiter not yet registered).
        let abort = link.abort.notified();
        tokio::pin!(abort);
        abort.as_mut().enable();
        // A kick while this task was busy (not waiting below) is not lost: its reason stays.
        if let Some(why) = link.abort_reason.lock().expect("poisoned").take() {
            return Err(LinkError::Ended(why));
        }
        link.note_frame(&buf);
        let msg = tokio::select! {
            m = read_message(&mut rd, &mut buf, wire::MAX_FRAME) => {
                m.map_err(|e| last_word(link, from_frame(e)))?
            }
            w = &mut writer => {
                w.map_err(|e| last_word(link, e))?;
                return Err(LinkError::Frame(FrameError::Closed));
            }
            _ = &mut abort => {
                let why = link.abort_reason.lock().expect("poisoned").take();
                return Err(LinkError::Ended(why.unwrap_or(Kick::DataFailed(String::new()))));
            }
            _ = tokio::time::sleep_until(heard_by) => {
                if buf.len() == heard_len {
                    return Err(LinkError::Idle(idle));
                }
                (heard_by, heard_len) = (Instant::now() + idle, buf.len());
                continue;
            }
            _ = stall_check.tick() => {
                check(link, conns)?;
                continue;
            }
        };
        (heard_by, heard_len) = (Instant::now() + idle, buf.len());
        handle(link, conns, generation, msg)?;
    }
}

/// The session's periodic checks: a stalled source ([`stall`]), a data connection not
/// dialled for long enough that the session is redialled ([`SourceLink::redial_due`]), or a
/// lane whose NIC has an address now that the session did not advertise
/// ([`SourceLink::readdress_due`]; looked up only where a lane is on a wildcard).
fn check(link: &SourceLink, conns: &dyn DataConns) -> Result<(), LinkError> {
    let now = Instant::now();
    if let Some(stall) = link.stalled(now.into_std()) {
        return Err(LinkError::Stalled(stall));
    }
    if let Some(kick) = link.redial_due(now) {
        return Err(LinkError::Ended(kick));
    }
    let wildcard = |l: &LaneAddr| l.data_addr.ip().is_unspecified();
    if !link.cfg.lanes.iter().any(wildcard) {
        return Ok(());
    }
    match link.readdress_due(now, &conns.lane_ips()) {
        Some(kick) => Err(LinkError::Ended(kick)),
        None => Ok(()),
    }
}

/// A control connection that broke (`e`) after the source said why it ends the session:
/// the source's reason ([`LinkError::SourceEnded`]), not only the close. What it said about
/// a lane it left out is not such a reason ([`not_dialled`] took it), except where it
/// reported no connection dialled at all and closed without a last word: then that is why.
fn last_word(link: &SourceLink, e: LinkError) -> LinkError {
    match e {
        LinkError::Frame(
            closed @ (FrameError::Closed
            | FrameError::TruncatedLength { .. }
            | FrameError::Truncated { .. }
            | FrameError::Io(_)),
        ) => {
            let mut st = link.state.lock().expect("poisoned");
            let none_dialled = !st.undialled.is_empty() && st.undialled.iter().all(|u| *u);
            let said = st
                .said
                .take()
                .or_else(|| none_dialled.then(|| undialled_notes(&st)));
            match said {
                Some(said) => LinkError::SourceEnded { said, closed },
                None => LinkError::Frame(closed),
            }
        }
        e => e,
    }
}

/// A framing error as the link reports it: a frame of another protocol version names both.
fn from_frame(e: FrameError) -> LinkError {
    match e {
        FrameError::Decode(DecodeError::Version(theirs)) => LinkError::Version { theirs },
        e => LinkError::Frame(e),
    }
}

/// Hello, Challenge, Auth, Welcome; returns the source's idle timeout.
async fn handshake<R, W>(
    link: &SourceLink,
    rd: &mut R,
    wr: &mut W,
    buf: &mut Vec<u8>,
    lanes: &[LaneAddr],
) -> Result<Duration, LinkError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let secret = link.cfg.secret.as_deref();
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
        lanes: lanes.to_vec(),
    };
    write_message(wr, &hello).await?;
    // Until the source has proved the secret, it gets no more than a small frame.
    let small = wire::MAX_SMALL_FRAME;
    let first = match read_message(rd, buf, small).await {
        Err(FrameError::Closed) => return Err(LinkError::ClosedAfterHello),
        // A version 3 source's refusal (version 2's layout of `Error` under this version's
        // byte) misreads in its fields; a frame of no known length or kind (an SSH banner, an
        // HTTP answer) stays a framing error.
        Err(FrameError::Decode(e))
            if !matches!(
                e,
                DecodeError::Version(_) | DecodeError::FrameLength(_) | DecodeError::UnknownKind(_)
            ) =>
        {
            return Err(LinkError::UnreadableAnswer(e));
        }
        r => r.map_err(from_frame)?,
    };
    // Both proofs cover what each side said, not only the nonces: a relay cannot rewrite it.
    let transcript = wire::handshake_transcript(&hello, &first).map_err(FrameError::Encode)?;
    let auth_required = match first {
        Message::Challenge { auth_required, .. } => auth_required,
        other => return Err(unexpected("Challenge", other)),
    };
    if secret.is_some() && !auth_required {
        return Err(LinkError::Auth(
            "the source does not check a secret but this node has one; configure the same secret file on the source",
        ));
    }
    let mac = secret.map_or([0; 32], |s| auth::proof(s, Role::Node, &transcript, 0));
    write_message(wr, &Message::Auth { mac }).await?;
    match read_message(rd, buf, small).await.map_err(from_frame)? {
        Message::Welcome {
            mac,
            idle_timeout_s,
        } => {
            let theirs = |s| auth::proof(s, Role::Source, &transcript, idle_timeout_s);
            if let Some(s) = secret
                && !auth::ct_eq(&mac, &theirs(s))
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
async fn write_frames<W: AsyncWrite + Unpin>(
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

/// Handles one message of an established session.
fn handle(
    link: &Arc<SourceLink>,
    conns: &dyn DataConns,
    generation: u64,
    msg: Message,
) -> Result<(), LinkError> {
    match msg {
        Message::DataConn { lane, conn, addr } => {
            let (queue, want) = {
                let mut st = link.state.lock().expect("poisoned");
                let c = numbered(&st, lane, conn)?;
                if addr == wire::NOT_DIALLED {
                    not_dialled(link, &mut st, lane, c);
                    return Ok(());
                }
                let want = st.advertised[usize::from(lane)];
                let (tx, rx) = std::sync::mpsc::channel();
                st.conns[c] = Some(tx);
                (rx, want)
            };
            let a = Announcement {
                generation,
                lane,
                conn,
                addr,
                want,
            };
            conns.announced(link, a, queue);
            Ok(())
        }
        Message::Shard {
            req,
            shard,
            length,
            crc32c,
            conn,
            seq,
        } => announced(link, req, shard, length, crc32c, conn, seq),
        Message::Manifest { req, dataset, json } => manifest(link, req, dataset, json),
        Message::Error {
            req,
            code,
            retry_after_ms,
            message,
        } => {
            error_for(link, req, (code, retry_after_ms), message);
            Ok(())
        }
        Message::Ping => Ok(()),
        other => Err(LinkError::Protocol(format!(
            "unexpected message from source: {other:?}"
        ))),
    }
}

/// Checks a `DataConn` for connection `conn` of lane `lane`: one the node's `Hello` numbered
/// for that lane, not announced (or reported not dialled) before. Returns its index.
fn numbered(st: &LinkState, lane: u16, conn: u16) -> Result<usize, LinkError> {
    let c = usize::from(conn);
    let total = st.conn_lane.len();
    let numbered = st.conn_lane.get(c).copied().ok_or_else(|| {
        LinkError::Protocol(format!(
            "data connection {conn} is past the {total} this node asked for"
        ))
    })?;
    if numbered != lane {
        return Err(LinkError::Protocol(format!(
            "data connection {conn} announced for lane {lane}; the node's Hello numbered it for lane {numbered}"
        )));
    }
    let announced = st.conns.get(c).is_some_and(Option::is_some);
    if announced || st.undialled[c] {
        return Err(LinkError::Protocol(format!(
            "data connection {conn} announced twice"
        )));
    }
    Ok(c)
}

/// The source could not dial connection `c` of lane `lane` ([`wire::NOT_DIALLED`]; its
/// `Error` before the lane's first such report said why). While the session lasts the link's
/// `last_error` names the lane, its data address, the connections not dialled and the source's
/// reason ([`lane_note`]), and the session is redialled once it has waited [`REDIAL_AFTER`]
/// ([`SourceLink::redial_due`]). Once none of the lane's connections is left, the lane is out
/// of this session: no fetch for it goes to this link ([`SourceLink::reaches`]).
fn not_dialled(link: &SourceLink, st: &mut LinkState, lane: u16, c: usize) {
    st.undialled[c] = true;
    if st.undialled_since.is_none() {
        st.undialled_since = Some(Instant::now());
    }
    let l = usize::from(lane);
    let addr = st.advertised[l];
    if st.lane_said[l].is_none() {
        let said = st.said.take().unwrap_or_else(|| "it gave no reason".into());
        tracing::warn!(source = %link.addr, lane, conn = c, %addr, %said,
            "the source could not dial a data connection of the lane: the session goes on without it, and is redialled if it stays so");
        st.lane_said[l] = Some(said);
    }
    let of_lane = st.conn_lane.iter().zip(&st.undialled);
    let none_left = of_lane.filter(|(n, _)| **n == lane).all(|(_, u)| *u);
    if none_left && !st.lanes_out[l] {
        st.lanes_out[l] = true;
        tracing::warn!(source = %link.addr, lane, %addr,
            "no data connection of the lane was dialled: none of the lane's fetches go to the source until its next session");
    }
    *link.last_error.lock().expect("poisoned") = Some(undialled_notes(st));
}

/// What `last_error` says of the session's data connections not dialled: a [`lane_note`] for
/// each lane with one.
fn undialled_notes(st: &LinkState) -> String {
    let notes: Vec<String> = (0..st.lane_said.len())
        .filter_map(|l| lane_note(st, l))
        .collect();
    notes.join("; ")
}

/// What `last_error` says of lane `l` while some of its data connections are not dialled:
/// the lane, its data address, which connections, what that does, and the source's reason.
fn lane_note(st: &LinkState, l: usize) -> Option<String> {
    let said = st.lane_said.get(l)?.as_deref()?;
    let (lane, addr) = (l as u16, st.advertised[l]);
    let of_lane: Vec<usize> = (0..st.conn_lane.len())
        .filter(|&c| st.conn_lane[c] == lane)
        .collect();
    let missing: Vec<usize> = of_lane
        .iter()
        .copied()
        .filter(|&c| st.undialled[c])
        .collect();
    let what = if st.lanes_out[l] {
        format!(
            "the source left lane {lane} (data address {addr}) out of this session, so none of the lane's fetches go to it"
        )
    } else {
        format!(
            "the source did not dial data connections {missing:?} of lane {lane} (data address {addr}): the lane runs on {} of its {} connections, and the source does not count as ready",
            of_lane.len() - missing.len(),
            of_lane.len()
        )
    };
    Some(format!(
        "{what} (the node ends the session to dial them again after {REDIAL_AFTER:?}, doubled for each session in a row that leaves the same ones out, up to {REDIAL_MAX:?}, at a moment with nothing under way; after {REDIAL_BUSY_AFTER:?}, likewise doubled, the source takes no new fetch until then, and {REDIAL_FORCE_GRACE:?} later the session ends anyway): {said}"
    ))
}

/// A `Manifest` answers the request `req` names; one of another dataset than that request's
/// fails it and breaks the protocol.
fn manifest(link: &SourceLink, req: u64, got: String, json: Vec<u8>) -> Result<(), LinkError> {
    let Some((asked, w)) = link.manifest_waiters.lock().expect("poisoned").remove(&req) else {
        tracing::debug!(source = %link.addr, req, dataset = %got, "manifest for a request that gave up");
        return Ok(());
    };
    if asked == got {
        let _ = w.send(Ok(json));
        return Ok(());
    }
    let e = ManifestError::WrongDataset {
        addr: link.addr.clone(),
        asked,
        got,
    };
    let msg = format!("manifest req {req}: {e}");
    let _ = w.send(Err(e));
    Err(LinkError::Protocol(msg))
}

/// A `Shard` announcement: the pending fetch moves to the queue of its data connection.
fn announced(
    link: &SourceLink,
    req: u64,
    shard: u32,
    length: u64,
    crc32c: u32,
    conn: u16,
    seq: u64,
) -> Result<(), LinkError> {
    let f = link
        .pending
        .lock()
        .expect("poisoned")
        .remove(&req)
        .ok_or_else(|| LinkError::Protocol(format!("SHARD for unknown request {req}")))?;
    link.fetch_answered();
    let down = |reason: String| FetchFailure::LinkDown {
        source_addr: link.addr.clone(),
        reason,
    };
    if f.wire_shard != shard || f.length != length || f.crc32c != crc32c {
        let msg = format!(
            "SHARD req {req} says shard {shard}, {length} bytes, crc {crc32c:08x}; expected shard {}, {} bytes, crc {:08x}",
            f.wire_shard, f.length, f.crc32c
        );
        f.finish(Err(down(msg.clone())));
        return Err(LinkError::Protocol(msg));
    }
    let slot = payload_slot(
        &mut link.state.lock().expect("poisoned"),
        (req, f.lane),
        conn,
        seq,
    );
    let tx = match slot {
        Ok(tx) => tx,
        Err(msg) => {
            f.finish(Err(down(msg.clone())));
            return Err(LinkError::Protocol(msg));
        }
    };
    tracing::debug!(req, shard, conn, seq, "SHARD announced");
    if let Err(e) = tx.send(f) {
        let reason = format!("the receiver of data connection {conn} is gone");
        e.0.finish(Err(down(reason.clone())));
        return Err(LinkError::Ended(Kick::DataFailed(reason)));
    }
    Ok(())
}

/// The queue of data connection `conn` for the payload of FETCH `req` (of lane `lane`),
/// announced as the connection's `seq`th, with the connection's next `seq` counted; else
/// how the announcement breaks the protocol: a connection never announced, of another lane,
/// not ready yet (no payload before the node's `DataReady`: one could land before the
/// connection's path is set up, and no receiver would ever read it), or out of sequence.
fn payload_slot(
    st: &mut LinkState,
    (req, lane): (u64, u16),
    conn: u16,
    seq: u64,
) -> Result<std::sync::mpsc::Sender<InFlight>, String> {
    let c = usize::from(conn);
    let Some(tx) = st.conns.get(c).cloned().flatten() else {
        return Err(format!("SHARD on unannounced data connection {conn}"));
    };
    if st.conn_lane[c] != lane {
        return Err(format!(
            "SHARD req {req} on data connection {conn} of lane {}; its FETCH named lane {lane}",
            st.conn_lane[c]
        ));
    }
    if !st.ready[c] {
        return Err(format!(
            "SHARD req {req} on data connection {conn} before this node's DataReady for it: no payload may be announced on a connection before its DataReady"
        ));
    }
    if st.next_seq[c] != seq {
        return Err(format!(
            "SHARD req {req} on data connection {conn} has seq {seq}; expected {}: payloads on a connection are numbered from 0 without gaps",
            st.next_seq[c]
        ));
    }
    st.next_seq[c] += 1;
    Ok(tx)
}

/// An `Error` from the source fails the one request it names (a fetch or a manifest
/// request) and nothing else; one about no request is logged and kept (why a lane is not
/// dialled, or why the source ends the session: [`last_word`]).
fn error_for(
    link: &SourceLink,
    req: u64,
    (code, retry_after_ms): (ErrorCode, u32),
    message: String,
) {
    if req == 0 {
        match code {
            ErrorCode::Draining => link.set_draining(&message),
            _ => {
                tracing::warn!(source = %link.addr, ?code, %message, "source reported an error");
                link.state.lock().expect("poisoned").said = Some(message);
            }
        }
        return;
    }
    if let Some(f) = link.pending.lock().expect("poisoned").remove(&req) {
        link.fetch_answered();
        if code == ErrorCode::Cancelled {
            link.cancels.confirmed.fetch_add(1, Ordering::Relaxed);
            f.finish(Err(FetchFailure::Cancelled));
        } else {
            f.finish(Err(FetchFailure::Refused {
                code,
                retry_after_ms,
                message,
            }));
        }
        return;
    }
    match link.manifest_waiters.lock().expect("poisoned").remove(&req) {
        Some((_, w)) => {
            let _ = w.send(Err(ManifestError::Refused { code, message }));
        }
        None => {
            tracing::debug!(source = %link.addr, req, ?code, %message, "error for a request no longer waiting")
        }
    }
}

#[cfg(test)]
mod tests;
