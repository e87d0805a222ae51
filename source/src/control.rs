//! A node's control connection as the source holds it: the reader and writer with their time
//! limits ([`Control`]), the constants of those limits, and why a session ends
//! ([`SessionError`]). The leaf that the session and the data-connection dialling share.

use std::net::SocketAddr;
use std::time::Duration;

use shardwire_protocol::framing::{FrameError, read_message, write_message};
use shardwire_protocol::wire::{self, DecodeError, ErrorCode, Message};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

/// The handshake must be done within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A control write that cannot finish within this time (the node stopped reading) ends the
/// session.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Time to dial all of a node's data connections: the lanes at once, each lane's connections
/// one after another (each connect also has [`HANDSHAKE_TIMEOUT`], or half the idle timeout).
pub const DIAL_DEADLINE: Duration = Duration::from_secs(60);
/// FETCHes a session holds before the node must wait for payloads to go out; a node that
/// sends more is broken and is dropped.
pub const MAX_QUEUED_FETCHES: usize = 1 << 16;

/// Data connections a source dials for one node session (each is a sender thread and a
/// socket): 8 lanes of 32 flows. The protocol allows 64 x 64; a node asking for more is refused.
/// The protocol crate holds it, so a node can refuse to start with more (`flows` x lanes).
pub use shardwire_protocol::wire::MAX_SESSION_FLOWS;

/// Why a node session ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Framing or socket error.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// No secret and the peer is not on loopback.
    #[error(
        "peer {0} is not on loopback and this source has no secret configured: without one it \
         serves loopback peers only (give the source and the node the same --secret-file)"
    )]
    NotLoopback(SocketAddr),
    /// No secret and a lane's data address is not on loopback.
    #[error(
        "lane {lane}'s data address {addr} is not on loopback, and this source has no secret \
         configured: without one it dials loopback only (give both sides --secret-file)"
    )]
    DataNotLoopback {
        /// The lane.
        lane: usize,
        /// Its data address.
        addr: SocketAddr,
    },
    /// Every session slot (`max_connections`) is taken.
    #[error(
        "this source serves {0} node sessions already (max_connections): try another source, \
         or again later"
    )]
    TooManySessions(usize),
    /// The source drains (it got SIGTERM): it starts no new node session.
    #[error("this source is draining: it starts no new session; use another source")]
    Draining,
    /// Handshake took too long.
    #[error("handshake timed out after {0:?}")]
    Timeout(Duration),
    /// Every handshake slot was taken and this was the oldest handshake under way: it made
    /// room for a newer one (`admit`).
    #[error(
        "handshake evicted: all {} handshake slots were taken and this was the oldest",
        crate::admit::MAX_HANDSHAKES
    )]
    Evicted,
    /// Dialling the node's data connections took too long (in all).
    #[error("dialling the node's data connections took over {0:?}")]
    DialTimeout(Duration),
    /// The node sent nothing for the idle timeout.
    #[error("the node sent nothing for {0:?} (idle timeout)")]
    Idle(Duration),
    /// A control write did not finish in time.
    #[error("a control write did not finish within {0:?} (the node stopped reading)")]
    WriteTimeout(Duration),
    /// Wrong proof of the secret.
    #[error("authentication failed: wrong secret (or the handshake was changed on its way)")]
    AuthFailed,
    /// A message out of order.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What the state machine wanted.
        expected: &'static str,
        /// What came.
        got: String,
    },
    /// Could not dial the node's data port, or ready the socket ([`reach_hint`] points at the
    /// network only where the network refused or dropped the connect).
    #[error("cannot open data connection to {addr}: {source}{}", reach_hint(.source))]
    DataConnect {
        /// The node's data address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A data connection died.
    #[error("data connection {conn} failed: {why}; closing the session")]
    DataFailed {
        /// The connection (the number its `DataConn` gave it).
        conn: u16,
        /// What went wrong.
        why: String,
    },
    /// The node asked for more data connections than a source dials for one session.
    #[error(
        "the node asked for {0} data connections (lanes x flows in its Hello); a source dials at most {MAX_SESSION_FLOWS} per node"
    )]
    TooManyFlows(u64),
    /// No thread for a data connection (a process or pid limit).
    #[error("cannot start a sender thread for data connection {conn}: {source}")]
    SpawnSender {
        /// The connection.
        conn: u16,
        /// Why.
        source: std::io::Error,
    },
    /// The node queued more FETCHes than any node legitimately does (the count queued).
    #[error("the node has {0} FETCHes queued (limit {MAX_QUEUED_FETCHES})")]
    TooManyFetches(usize),
    /// Data connections the node never said were ready (`DataReady`) within the time limit.
    #[error("{conns} data connection(s) not ready (no DataReady from the node) within {waited:?}")]
    NotReady {
        /// How many.
        conns: usize,
        /// The limit.
        waited: Duration,
    },
    /// `DataReady` named a connection the session does not have.
    #[error("DataReady for connection {conn}: the session has {conns} data connections")]
    NoSuchConn {
        /// The connection named.
        conn: u16,
        /// How many the session has.
        conns: usize,
    },
    /// The node speaks another protocol version (it was told so in its version).
    #[error("the node speaks protocol version {theirs}, this source {ours}: refused", ours = wire::VERSION)]
    Version {
        /// The node's version.
        theirs: u8,
    },
}

/// Where to look after a failed data connect: the path to the node (a firewall, a route) where
/// the connect was refused, timed out or found no route; nothing more for a local failure (a
/// file limit, a device or port bind), which its own message names.
fn reach_hint(e: &std::io::Error) -> &'static str {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused | K::TimedOut | K::HostUnreachable | K::NetworkUnreachable => {
            "; check that this source can reach the node's data address (a firewall or a route \
             in between?)"
        }
        _ => "",
    }
}

pub(crate) fn kind(m: &Message) -> String {
    format!("{m:?}")
        .split([' ', '{', '('])
        .next()
        .unwrap_or("?")
        .to_string()
}

/// How long a manifest of `len` bytes may take to write: [`WRITE_TIMEOUT`] plus its size at
/// 1 MiB/s (30 s in all dropped every node slower than 2.2 MB/s that asked for a 64 MiB one).
pub(crate) fn manifest_write_limit(len: usize) -> Duration {
    WRITE_TIMEOUT + Duration::from_secs(len as u64 >> 20)
}

/// The control connection with its time limits.
pub(crate) struct Control {
    pub(crate) rd: BufReader<OwnedReadHalf>,
    pub(crate) wr: OwnedWriteHalf,
    pub(crate) buf: Vec<u8>,
    pub(crate) idle: Duration,
    pub(crate) last_sent: Instant,
}

impl Control {
    pub(crate) async fn send(&mut self, msg: &Message) -> Result<(), SessionError> {
        tokio::time::timeout(WRITE_TIMEOUT, write_message(&mut self.wr, msg))
            .await
            .map_err(|_| SessionError::WriteTimeout(WRITE_TIMEOUT))??;
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Answers a `ManifestRequest` with `json` written from where it is kept (one small
    /// head per request, not a copy of a manifest of up to 64 MiB), within
    /// [`manifest_write_limit`].
    pub(crate) async fn manifest(
        &mut self,
        req: u64,
        dataset: &str,
        json: &[u8],
    ) -> Result<(), SessionError> {
        let mut head = Vec::with_capacity(64 + dataset.len());
        wire::encode_manifest_head(req, dataset, json.len(), &mut head)
            .map_err(|e| SessionError::Frame(e.into()))?;
        let write = async {
            self.wr.write_all(&head).await?;
            self.wr.write_all(json).await
        };
        let limit = manifest_write_limit(json.len());
        tokio::time::timeout(limit, write)
            .await
            .map_err(|_| SessionError::WriteTimeout(limit))?
            .map_err(|e| SessionError::Frame(e.into()))?;
        self.last_sent = Instant::now();
        Ok(())
    }

    pub(crate) async fn error(
        &mut self,
        req: u64,
        code: ErrorCode,
        message: String,
    ) -> Result<(), SessionError> {
        self.send(&Message::Error {
            req,
            code,
            retry_after_ms: 0,
            message,
        })
        .await
    }

    /// Whether the node sent bytes that [`Control::recv`] has not taken yet (buffered, or
    /// waiting in the socket), or closed the connection: a `select!` whose idle deadline
    /// came in the same turn may not have polled `recv`, and must not call the node silent.
    pub(crate) fn unread(&mut self) -> bool {
        use futures_util::FutureExt;
        if !self.rd.buffer().is_empty() {
            return true;
        }
        let mut probe = [0u8; 1];
        self.rd.get_mut().peek(&mut probe).now_or_never().is_some()
    }

    /// The next message (frames of at most [`wire::MAX_SMALL_FRAME`]: nodes send no more). A
    /// frame of another protocol version is answered in that version, naming both, and ends
    /// the session.
    pub(crate) async fn recv(&mut self) -> Result<Message, SessionError> {
        match read_message(&mut self.rd, &mut self.buf, wire::MAX_SMALL_FRAME).await {
            Err(FrameError::Decode(DecodeError::Version(theirs))) => {
                let frame = wire::version_error_frame(theirs, "source");
                let _ = tokio::time::timeout(WRITE_TIMEOUT, self.wr.write_all(&frame)).await;
                Err(SessionError::Version { theirs })
            }
            r => Ok(r?),
        }
    }
}

/// How long a refused connection is given to take its `Error` (and to have what it sent read,
/// so that closing it does not reset it before the peer reads the reason).
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// Tells a control connection the source will not serve why (`Error`, request 0, `code`),
/// then closes it.
pub(crate) async fn refuse(mut stream: tokio::net::TcpStream, code: ErrorCode, why: String) {
    use tokio::io::AsyncReadExt;
    let msg = Message::Error {
        req: 0,
        code,
        retry_after_ms: 0,
        message: why,
    };
    if tokio::time::timeout(REFUSAL_LINGER, write_message(&mut stream, &msg))
        .await
        .is_err()
    {
        return;
    }
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let deadline = Instant::now() + REFUSAL_LINGER;
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
        if n == 0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failure_on_the_way_to_the_node_points_at_the_network() {
        // Before: every failure, a file limit too, sent operators to look for a firewall.
        use rustix::io::Errno;
        let addr: SocketAddr = "10.0.0.5:7401".parse().unwrap();
        let text = |source: std::io::Error| SessionError::DataConnect { addr, source }.to_string();
        for e in [
            Errno::CONNREFUSED,
            Errno::TIMEDOUT,
            Errno::HOSTUNREACH,
            Errno::NETUNREACH,
        ] {
            let t = text(e.into());
            assert!(t.contains("firewall") && t.contains("10.0.0.5:7401"), "{t}");
        }
        assert!(text(std::io::ErrorKind::TimedOut.into()).contains("firewall"));
        for e in [Errno::MFILE, Errno::PERM, Errno::NODEV, Errno::ADDRINUSE] {
            let t = text(e.into());
            assert!(!t.contains("firewall") && t.contains("os error"), "{t}");
        }
    }

    #[test]
    fn a_large_manifest_has_time_for_its_size() {
        assert_eq!(manifest_write_limit(1000), WRITE_TIMEOUT);
        assert_eq!(
            manifest_write_limit(64 << 20),
            WRITE_TIMEOUT + Duration::from_secs(64)
        );
    }
}
