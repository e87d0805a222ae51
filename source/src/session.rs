//! One node's control connection: handshake, data-connection setup, the FETCH queue and
//! cancellation.
//!
//! FETCHes wait in the session's queue until a data connection has room (at most
//! [`crate::sender::DEPTH`] payloads each); only then is the payload announced (`Shard`) and handed
//! to that connection's sender. So a `Cancel` can still drop every FETCH that is not on the
//! wire yet, and a stream the node gave up on stops costing the source bandwidth.
//!
//! Every state has a time limit: the handshake [`HANDSHAKE_TIMEOUT`], an established session
//! the idle timeout (both sides send `Ping` after a third of it without other traffic), and
//! every write [`WRITE_TIMEOUT`]. A node can never make the source buffer a frame over
//! [`wire::MAX_SMALL_FRAME`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_protocol::auth::{self, NONCE_LEN, Role};
use shardwire_protocol::wire::{self, ErrorCode, Message};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::Shared;
use crate::datasets::Backend;
use crate::payload::{Now, Payload};
use crate::sender::{Body, Job, Progress, Sender};
use shardwire_protocol::framing::{FrameError, read_message, write_message};

/// The handshake must be done within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A control write that cannot finish within this time (the node stopped reading) ends the
/// session.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// FETCHes a session holds before the node must wait for payloads to go out; a node that
/// sends more is broken and is dropped.
pub const MAX_QUEUED_FETCHES: usize = 1 << 16;

/// Why a node session ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Framing or socket error.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// No secret and the peer is not on loopback.
    #[error("peer {0} is not on loopback and this source has no secret configured")]
    NotLoopback(SocketAddr),
    /// Handshake took too long.
    #[error("handshake timed out after {0:?}")]
    Timeout(Duration),
    /// The node sent nothing for the idle timeout.
    #[error("the node sent nothing for {0:?} (idle timeout)")]
    Idle(Duration),
    /// A control write did not finish in time.
    #[error("a control write did not finish within {0:?} (the node stopped reading)")]
    WriteTimeout(Duration),
    /// Wrong proof of the secret.
    #[error("authentication failed: wrong secret")]
    AuthFailed,
    /// A message out of order.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What the state machine wanted.
        expected: &'static str,
        /// What came.
        got: String,
    },
    /// Could not dial the node's data port.
    #[error("cannot open data connection to {addr}: {source}")]
    DataConnect {
        /// The node's data address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A data connection died.
    #[error("a data connection failed; closing the session")]
    DataFailed,
    /// The node queued more FETCHes than any node legitimately does.
    #[error("the node has {0} FETCHes queued (limit {MAX_QUEUED_FETCHES})")]
    TooManyFetches(usize),
}

fn kind(m: &Message) -> String {
    format!("{m:?}")
        .split([' ', '{', '('])
        .next()
        .unwrap_or("?")
        .to_string()
}

/// The control connection with its time limits.
struct Control {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    buf: Vec<u8>,
    idle: Duration,
    last_sent: Instant,
}

impl Control {
    async fn send(&mut self, msg: &Message) -> Result<(), SessionError> {
        tokio::time::timeout(WRITE_TIMEOUT, write_message(&mut self.wr, msg))
            .await
            .map_err(|_| SessionError::WriteTimeout(WRITE_TIMEOUT))??;
        self.last_sent = Instant::now();
        Ok(())
    }

    async fn error(
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

    /// The next message (frames of at most [`wire::MAX_SMALL_FRAME`]: nodes send no more).
    async fn recv(&mut self) -> Result<Message, FrameError> {
        read_message(&mut self.rd, &mut self.buf, wire::MAX_SMALL_FRAME).await
    }
}

pub(crate) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
) -> Result<(), SessionError> {
    if shared.cfg.secret.is_none() && !peer.ip().is_loopback() {
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
    let (data_addr, flows, node_id) =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut ctl, &shared))
            .await
            .map_err(|_| SessionError::Timeout(HANDSHAKE_TIMEOUT))??;
    tracing::info!(%peer, node = %node_id, %data_addr, flows, "node authenticated");
    let failed = Arc::new(Notify::new());
    let progress = Arc::new(Notify::new());
    let senders = dial_data(&mut ctl, &shared, data_addr, flows, &failed, &progress).await?;
    let id = shared.sessions.fetch_add(1, Ordering::Relaxed) + 1;
    let _hints = ForgetHints(Arc::clone(&shared), id);
    let draining = shared.draining.subscribe();
    Session {
        id,
        ctl,
        shared,
        senders,
        waiting: VecDeque::new(),
        failed,
        progress,
        draining,
        drained: false,
    }
    .serve()
    .await
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

/// Hello, Challenge, Auth, Welcome; returns the node's data address, flows and id.
async fn handshake(
    ctl: &mut Control,
    shared: &Shared,
) -> Result<(SocketAddr, u16, String), SessionError> {
    let secret = shared.cfg.secret.as_deref();
    let (node_nonce, data_addr, flows, node_id) = match ctl.recv().await? {
        Message::Hello {
            node_id,
            nonce,
            data_addr,
            flows,
        } => (nonce, data_addr, flows, node_id),
        other => {
            return Err(SessionError::Unexpected {
                expected: "Hello",
                got: kind(&other),
            });
        }
    };
    let mut src_nonce = [0u8; NONCE_LEN];
    rustix::rand::getrandom(&mut src_nonce, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| FrameError::Io(e.into()))?;
    ctl.send(&Message::Challenge {
        nonce: src_nonce,
        auth_required: secret.is_some(),
    })
    .await?;
    let mac = match ctl.recv().await? {
        Message::Auth { mac } => mac,
        other => {
            return Err(SessionError::Unexpected {
                expected: "Auth",
                got: kind(&other),
            });
        }
    };
    let welcome = match secret {
        Some(s) => {
            if !auth::ct_eq(&mac, &auth::proof(s, Role::Node, &node_nonce, &src_nonce)) {
                let _ = ctl
                    .error(0, ErrorCode::AuthFailed, "wrong secret".into())
                    .await;
                return Err(SessionError::AuthFailed);
            }
            auth::proof(s, Role::Source, &node_nonce, &src_nonce)
        }
        None => [0; 32],
    };
    let idle_timeout_s = ctl.idle.as_secs().clamp(1, u64::from(u16::MAX)) as u16;
    ctl.send(&Message::Welcome {
        mac: welcome,
        idle_timeout_s,
    })
    .await?;
    Ok((data_addr, flows, node_id))
}

/// Dials the node's data port `flows` times, reporting each connection's local address.
async fn dial_data(
    ctl: &mut Control,
    shared: &Shared,
    data_addr: SocketAddr,
    flows: u16,
    failed: &Arc<Notify>,
    progress: &Arc<Notify>,
) -> Result<Vec<Sender>, SessionError> {
    let per_flow_rate = shared.cfg.rate_limit / u64::from(flows);
    let mut senders = Vec::with_capacity(flows as usize);
    let data_err = |source| SessionError::DataConnect {
        addr: data_addr,
        source,
    };
    for conn in 0..flows {
        let s = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(data_addr))
            .await
            .map_err(|_| data_err(std::io::ErrorKind::TimedOut.into()))?
            .map_err(data_err)?;
        let local = s.local_addr().map_err(data_err)?;
        let std = s.into_std().map_err(data_err)?;
        std.set_nonblocking(false).map_err(data_err)?;
        ctl.send(&Message::DataConn { conn, addr: local }).await?;
        let p = Arc::new(Progress::with_notify(Arc::clone(progress)));
        senders.push(Sender::spawn(
            std,
            conn,
            per_flow_rate,
            Arc::clone(failed),
            shared.cfg.devmem_tx.as_ref().map(|p| &p.buffer),
            p,
        ));
    }
    Ok(senders)
}

/// What a queued FETCH's announcement says.
struct Head {
    req: u64,
    len: u64,
    corrupt: bool,
    shard: u32,
    crc32c: u32,
}

/// A FETCH waiting for its bytes (object storage) and a data connection with room.
struct Queued {
    head: Head,
    payload: Payload,
}

struct Session {
    /// This session's id (scopes its hints).
    id: u64,
    ctl: Control,
    shared: Arc<Shared>,
    senders: Vec<Sender>,
    waiting: VecDeque<Queued>,
    failed: Arc<Notify>,
    progress: Arc<Notify>,
    /// The source's drain flag ([`crate::Source::serve`]).
    draining: tokio::sync::watch::Receiver<bool>,
    /// The node has been told that this source drains.
    drained: bool,
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
                    Err(FrameError::Closed) => return Ok(()),
                    Err(e) => return Err(e.into()),
                },
                _ = self.failed.notified() => return Err(SessionError::DataFailed),
                _ = self.progress.notified() => continue,
                _ = async { self.draining.wait_for(|d| *d).await.is_ok() }, if !self.drained => {
                    self.tell_draining().await?;
                    continue;
                }
                _ = tokio::time::sleep_until(ping_at) => {
                    self.ctl.send(&Message::Ping).await?;
                    continue;
                }
                _ = tokio::time::sleep_until(last_heard + idle) => return Err(SessionError::Idle(idle)),
            };
            last_heard = Instant::now();
            self.handle(msg).await?;
        }
    }

    /// Tells the node once that this source drains: it sends nothing new here, and the
    /// queued FETCHes are still sent.
    async fn tell_draining(&mut self) -> Result<(), SessionError> {
        self.drained = true;
        let queued = self.waiting.len();
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
            Message::ManifestRequest { req, dataset } => {
                let answer = match self.shared.datasets.get(&dataset) {
                    Some(d) => Message::Manifest {
                        req,
                        dataset,
                        json: d.manifest_json.clone(),
                    },
                    None => Message::Error {
                        req,
                        code: ErrorCode::UnknownDataset,
                        retry_after_ms: 0,
                        message: format!("dataset `{dataset}` is not served here"),
                    },
                };
                self.ctl.send(&answer).await
            }
            Message::Fetch {
                req,
                dataset,
                shard,
            } => self.queue(req, &dataset, shard).await,
            Message::Cancel { req } => {
                if let Some(at) = self.waiting.iter().position(|q| q.head.req == req) {
                    self.waiting.remove(at);
                    tracing::debug!(req, "FETCH cancelled before it was sent");
                    metrics::counter!("shardwire_source_fetches_cancelled_total").increment(1);
                    let why = "cancelled by the node before it was sent".to_string();
                    self.ctl.error(req, ErrorCode::Cancelled, why).await?;
                }
                Ok(())
            }
            Message::Ping => Ok(()),
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
                    expected: "ManifestRequest, Fetch, Cancel or Ping",
                    got: kind(&other),
                })
            }
        }
    }

    /// Checks a FETCH and queues it (or answers it with an error: refused while draining).
    async fn queue(&mut self, req: u64, dataset: &str, shard: u32) -> Result<(), SessionError> {
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
        if self.waiting.len() >= MAX_QUEUED_FETCHES {
            return Err(SessionError::TooManyFetches(self.waiting.len()));
        }
        let corrupt = self
            .shared
            .corrupt_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        let payload = match &d.backend {
            Backend::Local { files, .. } => Payload::Ready(Body::File {
                file: Arc::clone(&files[shard as usize]),
                offset: entry.offset,
            }),
            Backend::Remote(r) => {
                Payload::read(Arc::clone(r), self.id, shard, Arc::clone(&self.progress))
            }
        };
        self.waiting.push_back(Queued {
            head: Head {
                req,
                len: entry.length,
                corrupt,
                shard,
                crc32c: entry.crc32c,
            },
            payload,
        });
        Ok(())
    }

    /// Answers queued FETCHes whose reads failed, then announces and hands out the first
    /// settled ones, in queue order, while a data connection has room (the least loaded).
    async fn dispatch(&mut self) -> Result<(), SessionError> {
        let mut at = 0;
        while at < self.waiting.len() {
            if !self.waiting[at].payload.settled() {
                at += 1;
                continue;
            }
            let room = self
                .senders
                .iter()
                .enumerate()
                .filter(|(_, s)| s.has_room())
                .min_by_key(|(_, s)| s.progress.bytes.load(Ordering::Relaxed))
                .map(|(conn, _)| conn);
            let Queued { head: q, payload } = self.waiting.remove(at).expect("in range");
            let body = match payload.now() {
                Now::Send(body) => body,
                Now::Fail(f) => {
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
                    self.waiting.insert(at, Queued { head: q, payload });
                    at += 1;
                    continue;
                }
            };
            let Some(conn) = room else {
                // Settled but no room: back in its place, with its bytes.
                let payload = Payload::Ready(body);
                self.waiting.insert(at, Queued { head: q, payload });
                return Ok(());
            };
            self.announce(conn, q, body).await?;
        }
        Ok(())
    }

    /// Announces `q` on data connection `conn` and hands its bytes to that connection.
    async fn announce(&mut self, conn: usize, q: Head, body: Body) -> Result<(), SessionError> {
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
