//! One node's control connection: handshake, data-connection setup (`dial.rs`), the
//! FETCH queues and cancellation.
//!
//! FETCHes wait in their lane's queue until a data connection of that lane has room (at most
//! [`crate::sender::DEPTH`] payloads each); only then is the payload announced (`Shard`) and
//! handed to that connection's sender. A lane's shards travel only on its own connections
//! (its NIC, its GPU's memory on the node). So a `Cancel` can still drop every FETCH that is
//! not on the wire yet, and a stream the node gave up on stops costing the source bandwidth.
//!
//! A node of another protocol version is answered with `Error{UnsupportedVersion}` in its own
//! version (the layout of `Error` is the same), naming both versions, and dropped.
//!
//! Every state has a time limit: the handshake [`HANDSHAKE_TIMEOUT`], an established session
//! the idle timeout (both sides send `Ping` after a third of it without other traffic), and
//! every write [`WRITE_TIMEOUT`]. A node can never make the source buffer a frame over
//! [`shardwire_protocol::wire::MAX_SMALL_FRAME`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_protocol::auth::{self, NONCE_LEN, Role};
use shardwire_protocol::framing::FrameError;
use shardwire_protocol::wire::{ErrorCode, LaneAddr, Message};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::Shared;
use crate::control::{Control, kind};
pub use crate::control::{HANDSHAKE_TIMEOUT, MAX_QUEUED_FETCHES, SessionError, WRITE_TIMEOUT};
use crate::dial::{DataConns, dial};
use crate::sender::{Job, Sender};

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
    let (lanes, node_id) = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut ctl, &shared))
        .await
        .map_err(|_| SessionError::Timeout(HANDSHAKE_TIMEOUT))??;
    let addrs: Vec<String> = lanes
        .iter()
        .map(|l| format!("{}x{}", l.data_addr, l.flows))
        .collect();
    tracing::info!(%peer, node = %node_id, lanes = %addrs.join(" "), "node authenticated");
    let failed = Arc::new(Notify::new());
    let progress = Arc::new(Notify::new());
    let DataConns { senders, lane_of } =
        dial(&mut ctl, &shared, &lanes, &failed, &progress).await?;
    Session {
        ctl,
        shared,
        senders,
        lane_of,
        waiting: (0..lanes.len()).map(|_| VecDeque::new()).collect(),
        queued: 0,
        failed,
        progress,
    }
    .serve()
    .await
}

/// Hello, Challenge, Auth, Welcome; returns the node's lanes and id.
async fn handshake(
    ctl: &mut Control,
    shared: &Shared,
) -> Result<(Vec<LaneAddr>, String), SessionError> {
    let secret = shared.cfg.secret.as_deref();
    let (node_nonce, lanes, node_id) = match ctl.recv().await? {
        Message::Hello {
            node_id,
            nonce,
            lanes,
        } => (nonce, lanes, node_id),
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
    Ok((lanes, node_id))
}

/// A FETCH waiting for a data connection with room.
struct Queued {
    req: u64,
    job: Job,
    shard: u32,
    crc32c: u32,
}

struct Session {
    ctl: Control,
    shared: Arc<Shared>,
    /// One per data connection.
    senders: Vec<Sender>,
    /// The lane of each data connection.
    lane_of: Vec<u16>,
    /// FETCHes waiting, per lane.
    waiting: Vec<VecDeque<Queued>>,
    /// FETCHes waiting in all lanes.
    queued: usize,
    failed: Arc<Notify>,
    progress: Arc<Notify>,
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
                _ = self.failed.notified() => return Err(SessionError::DataFailed),
                _ = self.progress.notified() => continue,
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
                        message: format!("dataset `{dataset}` is not served here"),
                    },
                };
                self.ctl.send(&answer).await
            }
            Message::Fetch {
                req,
                dataset,
                shard,
                lane,
            } => self.queue(req, &dataset, shard, lane).await,
            Message::Cancel { req } => {
                let found = self.waiting.iter_mut().find_map(|w| {
                    let at = w.iter().position(|q| q.req == req)?;
                    w.remove(at)
                });
                if found.is_some() {
                    self.queued -= 1;
                    tracing::debug!(req, "FETCH cancelled before it was sent");
                    metrics::counter!("shardwire_source_fetches_cancelled_total").increment(1);
                    let why = "cancelled by the node before it was sent".to_string();
                    self.ctl.error(req, ErrorCode::Cancelled, why).await?;
                }
                Ok(())
            }
            Message::Ping => Ok(()),
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
            return Err(SessionError::TooManyFetches(self.queued));
        }
        let corrupt = self
            .shared
            .corrupt_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        let job = Job {
            file: Arc::clone(&d.files[shard as usize]),
            offset: entry.offset,
            len: entry.length,
            corrupt,
        };
        self.waiting[usize::from(lane)].push_back(Queued {
            req,
            job,
            shard,
            crc32c: entry.crc32c,
        });
        self.queued += 1;
        Ok(())
    }

    /// Announces and hands out queued FETCHes while a data connection of their lane has room
    /// (the least loaded of the lane first).
    async fn dispatch(&mut self) -> Result<(), SessionError> {
        for lane in 0..self.waiting.len() {
            while !self.waiting[lane].is_empty() {
                let Some(conn) = self.room_in(lane) else {
                    break;
                };
                let q = self.waiting[lane].pop_front().expect("not empty");
                self.queued -= 1;
                self.send_on(conn, q).await?;
            }
        }
        Ok(())
    }

    /// The least loaded data connection of `lane` with room, if any.
    fn room_in(&self, lane: usize) -> Option<usize> {
        self.senders
            .iter()
            .enumerate()
            .filter(|(i, s)| usize::from(self.lane_of[*i]) == lane && s.has_room())
            .min_by_key(|(_, s)| s.progress.bytes.load(Ordering::Relaxed))
            .map(|(i, _)| i)
    }

    /// Announces `q` as the next payload of connection `conn` and hands it to its sender.
    async fn send_on(&mut self, conn: usize, q: Queued) -> Result<(), SessionError> {
        let seq = self.senders[conn].seq;
        self.senders[conn].seq += 1;
        self.ctl
            .send(&Message::Shard {
                req: q.req,
                shard: q.shard,
                length: q.job.len,
                crc32c: q.crc32c,
                conn: conn as u16,
                seq,
            })
            .await?;
        if !self.senders[conn].push(q.job) {
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
