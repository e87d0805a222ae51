//! One node's control connection: handshake, data-connection setup, FETCH handling.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_protocol::auth::{self, NONCE_LEN, Role};
use shardwire_protocol::wire::{ErrorCode, Message};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::Shared;
use crate::framing::{FrameError, read_message, write_message};
use crate::sender::{Job, Sender};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
}

fn kind(m: &Message) -> String {
    format!("{m:?}")
        .split([' ', '{', '('])
        .next()
        .unwrap_or("?")
        .to_string()
}

pub(crate) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
) -> Result<(), SessionError> {
    let secret = shared.cfg.secret.clone();
    if secret.is_none() && !peer.ip().is_loopback() {
        return Err(SessionError::NotLoopback(peer));
    }
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut buf = Vec::new();

    let hs = async {
        let (node_nonce, data_addr, flows, node_id) = match read_message(&mut rd, &mut buf).await? {
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
        write_message(
            &mut wr,
            &Message::Challenge {
                nonce: src_nonce,
                auth_required: secret.is_some(),
            },
        )
        .await?;
        let mac = match read_message(&mut rd, &mut buf).await? {
            Message::Auth { mac } => mac,
            other => {
                return Err(SessionError::Unexpected {
                    expected: "Auth",
                    got: kind(&other),
                });
            }
        };
        let welcome = match &secret {
            Some(s) => {
                if !auth::ct_eq(&mac, &auth::proof(s, Role::Node, &node_nonce, &src_nonce)) {
                    let _ = write_message(
                        &mut wr,
                        &Message::Error {
                            req: 0,
                            code: ErrorCode::AuthFailed,
                            message: "wrong secret".into(),
                        },
                    )
                    .await;
                    return Err(SessionError::AuthFailed);
                }
                auth::proof(s, Role::Source, &node_nonce, &src_nonce)
            }
            None => [0; 32],
        };
        write_message(&mut wr, &Message::Welcome { mac: welcome }).await?;
        Ok((data_addr, flows, node_id))
    };
    let (data_addr, flows, node_id) = tokio::time::timeout(HANDSHAKE_TIMEOUT, hs)
        .await
        .map_err(|_| SessionError::Timeout(HANDSHAKE_TIMEOUT))??;
    tracing::info!(%peer, node = %node_id, %data_addr, flows, "node authenticated");

    // Dial the data connections and report each one's local address.
    let failed = Arc::new(Notify::new());
    let per_flow_rate = shared.cfg.rate_limit / u64::from(flows);
    let mut senders = Vec::with_capacity(flows as usize);
    for conn in 0..flows {
        let s =
            TcpStream::connect(data_addr)
                .await
                .map_err(|source| SessionError::DataConnect {
                    addr: data_addr,
                    source,
                })?;
        let local = s.local_addr().map_err(|source| SessionError::DataConnect {
            addr: data_addr,
            source,
        })?;
        let std = s.into_std().map_err(|source| SessionError::DataConnect {
            addr: data_addr,
            source,
        })?;
        std.set_nonblocking(false)
            .map_err(|source| SessionError::DataConnect {
                addr: data_addr,
                source,
            })?;
        write_message(&mut wr, &Message::DataConn { conn, addr: local }).await?;
        senders.push(Sender::spawn(
            std,
            conn,
            per_flow_rate,
            Arc::clone(&failed),
            shared.cfg.devmem_tx.as_ref().map(|p| &p.buffer),
        ));
    }

    loop {
        let msg = tokio::select! {
            m = read_message(&mut rd, &mut buf) => match m {
                Ok(m) => m,
                Err(FrameError::Closed) => return Ok(()),
                Err(e) => return Err(e.into()),
            },
            _ = failed.notified() => return Err(SessionError::DataFailed),
        };
        match msg {
            Message::ManifestRequest { dataset } => match shared.datasets.get(&dataset) {
                Some(d) => {
                    write_message(
                        &mut wr,
                        &Message::Manifest {
                            dataset,
                            json: d.manifest_json.clone(),
                        },
                    )
                    .await?
                }
                None => {
                    let message = format!("dataset `{dataset}` is not served here");
                    write_message(
                        &mut wr,
                        &Message::Error {
                            req: 0,
                            code: ErrorCode::UnknownDataset,
                            message,
                        },
                    )
                    .await?;
                }
            },
            Message::Fetch {
                req,
                dataset,
                shard,
            } => {
                let Some(d) = shared.datasets.get(&dataset) else {
                    let message = format!("dataset `{dataset}` is not served here");
                    write_message(
                        &mut wr,
                        &Message::Error {
                            req,
                            code: ErrorCode::UnknownDataset,
                            message,
                        },
                    )
                    .await?;
                    continue;
                };
                let Some(entry) = d.manifest.shards.get(shard as usize) else {
                    let message = format!(
                        "shard {shard} is out of range: dataset `{dataset}` has {} shards",
                        d.manifest.shards.len()
                    );
                    write_message(
                        &mut wr,
                        &Message::Error {
                            req,
                            code: ErrorCode::UnknownShard,
                            message,
                        },
                    )
                    .await?;
                    continue;
                };
                let (conn, sender) = senders
                    .iter_mut()
                    .enumerate()
                    .min_by_key(|(_, s)| s.queued.load(Ordering::Relaxed))
                    .expect("at least one flow");
                let seq = sender.seq;
                sender.seq += 1;
                write_message(
                    &mut wr,
                    &Message::Shard {
                        req,
                        shard,
                        length: entry.length,
                        crc32c: entry.crc32c,
                        conn: conn as u16,
                        seq,
                    },
                )
                .await?;
                let corrupt = shared
                    .corrupt_left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok();
                let job = Job {
                    file: Arc::clone(&d.files[shard as usize]),
                    offset: entry.offset,
                    len: entry.length,
                    corrupt,
                };
                if !sender.push(job) {
                    return Err(SessionError::DataFailed);
                }
            }
            other => {
                let message = format!("unexpected {} after the handshake", kind(&other));
                let _ = write_message(
                    &mut wr,
                    &Message::Error {
                        req: 0,
                        code: ErrorCode::BadRequest,
                        message: message.clone(),
                    },
                )
                .await;
                return Err(SessionError::Unexpected {
                    expected: "ManifestRequest or Fetch",
                    got: kind(&other),
                });
            }
        }
    }
}
