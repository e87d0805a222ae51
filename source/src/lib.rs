//! The shard source: serves datasets (a directory plus the manifest written by
//! `shardwire index`) to any number of node services.
//!
//! A node dials the control port, authenticates (shared secret, or loopback-only without
//! one), asks for manifests and sends FETCHes. The source dials the node's data port
//! `flows` times, reports each connection's local address on the control connection, and
//! answers every FETCH with a SHARD announcement followed by exactly the announced bytes on
//! the announced data connection, sent with `sendfile` straight from the page cache.
//! It never decides order: it sends what it is asked.
//!
//! What a peer that never authenticated can make the source log (a connection refused before
//! its handshake, or dropped before `Welcome`) is logged at most once per peer and cause every
//! 10 s, with the lines left out counted ([`noise`]).

mod admit;
mod control;
pub mod datasets;
pub mod devmem_tx;
mod dial;
mod noise;
mod payload;
pub mod remote;
mod sender;
pub mod session;
mod stat;
pub mod tx_nics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use shardwire_protocol::wire;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use datasets::{Backend, Dataset, DatasetError, Datasets};
pub use remote::RemoteOptions;

/// How a source runs.
#[derive(Clone, Debug)]
pub struct SourceConfig {
    /// Control listen address.
    pub listen: SocketAddr,
    /// Shared secret; `None` = accept loopback peers only.
    pub secret: Option<Vec<u8>>,
    /// Send rate limit of each node session in bytes/s (0 = unlimited), shared over that
    /// session's data connections.
    pub rate_limit: u64,
    /// Fault injection for tests: flip one byte in each of the first N payloads sent.
    pub fault_corrupt: u32,
    /// Fault injection for tests: the first N data connections dialled for a node's lane 0
    /// go to its lane 1 address instead (a node with one lane is never misdialled).
    pub fault_wrong_lane: u32,
    /// Devmem TX bindings, one per NIC; a data connection sends from the binding of the NIC
    /// it leaves by (empty: every connection uses `sendfile`).
    pub devmem_tx: Arc<tx_nics::TxNics>,
    /// An established session that hears nothing for this long is dropped; both sides send
    /// keepalives after a third of it (the node learns it in `Welcome`).
    pub idle_timeout: std::time::Duration,
    /// Node sessions (authenticated control connections) served at once; a node past it is
    /// refused at the end of its handshake, with the reason. Handshakes have their own caps
    /// ([`admit`]).
    pub max_connections: usize,
    /// On shutdown (SIGTERM) the source drains: it takes no new FETCH, finishes the queued
    /// ones and exits when its nodes have gone, or after this long.
    pub drain_timeout: std::time::Duration,
}

/// Default of [`SourceConfig::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// Default of [`SourceConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default of [`SourceConfig::drain_timeout`].
pub const DEFAULT_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Shared state of a running source.
pub(crate) struct Shared {
    pub datasets: Datasets,
    pub cfg: SourceConfig,
    pub corrupt_left: AtomicU32,
    pub wrong_lane_left: AtomicU32,
    /// Ids of node sessions (hints are kept per session).
    pub sessions: std::sync::atomic::AtomicU64,
    /// Turns true when the source starts draining ([`Source::serve`]).
    pub draining: watch::Sender<bool>,
    /// Bytes of object-storage reads of all sessions not yet sent (`session.rs`).
    pub session_reads: Arc<std::sync::atomic::AtomicU64>,
    /// The warnings of peers that never authenticated, rate-limited ([`noise`]).
    pub noise: noise::Noise,
    /// The checks of local shard files, bounded per file system ([`stat`]).
    pub stats: stat::Stats,
}

/// A bound, not yet serving, source.
pub struct Source {
    listener: TcpListener,
    shared: Arc<Shared>,
}

impl Source {
    /// Binds the control port.
    pub async fn bind(cfg: SourceConfig, datasets: Datasets) -> std::io::Result<Self> {
        let listener = TcpListener::bind(cfg.listen).await?;
        let corrupt_left = AtomicU32::new(cfg.fault_corrupt);
        let wrong_lane_left = AtomicU32::new(cfg.fault_wrong_lane);
        // The file system of each local shard file, found before the source serves.
        let stats = stat::Stats::of(&datasets);
        Ok(Self {
            listener,
            shared: Arc::new(Shared {
                datasets,
                cfg,
                corrupt_left,
                wrong_lane_left,
                sessions: std::sync::atomic::AtomicU64::new(0),
                draining: watch::Sender::new(false),
                session_reads: Arc::default(),
                noise: noise::Noise::default(),
                stats,
            }),
        })
    }

    /// A handle on what the source is doing, for its admin endpoint.
    pub fn status(&self) -> SourceStatus {
        SourceStatus(Arc::clone(&self.shared))
    }

    /// The bound control address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Accepts control connections until `shutdown` turns true, then drains: the listener
    /// closes, every session tells its node it is draining, refuses new FETCHes (`Draining`:
    /// the node fetches them elsewhere) and sends the ones it queued; the source returns when
    /// every node has closed its session, or after the drain timeout.
    pub async fn serve(self, mut shutdown: watch::Receiver<bool>) {
        if self.shared.cfg.secret.is_none() {
            let msg = "no secret configured: accepting loopback peers only (use --secret-file to serve other hosts)";
            if self.local_addr().ip().is_loopback() {
                tracing::info!(listen = %self.local_addr(), "{msg}");
            } else {
                tracing::warn!(listen = %self.local_addr(), "{msg}");
            }
        }
        for d in self.shared.datasets.iter() {
            tracing::info!(dataset = %d.name, shards = d.manifest.shards.len(), bytes = d.manifest.total_bytes,
                digest = %d.manifest.digest, "serving dataset");
            if let Backend::Remote(r) = &d.backend {
                tokio::spawn(Arc::clone(r).prefetch());
            }
        }
        tracing::info!(listen = %self.local_addr(), "source ready");
        let slots = Arc::new(tokio::sync::Semaphore::new(self.shared.cfg.max_connections));
        let handshakes = Arc::new(admit::Handshakes::default());
        let refusing = Arc::new(tokio::sync::Semaphore::new(admit::MAX_REFUSING));
        let mut left_out = tokio::time::interval(shardwire_protocol::warn_limit::EVERY);
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = left_out.tick() => self.shared.noise.say_left_out(),
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let gates = (&handshakes, &refusing);
                        admit_connection(&self.shared, stream, peer, gates, &slots);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                },
            }
        }
        let Self { listener, shared } = self;
        drop(listener);
        drain(&shared, &slots).await;
    }
}

/// Starts the handshake of an accepted control connection, if this source may serve its peer
/// (without a secret, a loopback peer) and a handshake slot is free: else tells the peer why
/// (while fewer than [`admit::MAX_REFUSING`] refusals are under way) and closes it. The
/// session takes one of `slots` once the peer has authenticated. A refusal, and a failure
/// before `Welcome`, are logged at most once per peer and cause every 10 s ([`noise`]).
pub(crate) fn admit_connection(
    shared: &Arc<Shared>,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    (handshakes, refusing): (&Arc<admit::Handshakes>, &Arc<tokio::sync::Semaphore>),
    slots: &Arc<tokio::sync::Semaphore>,
) {
    // Before a handshake slot: before, a flood of peers off loopback held every slot while
    // their refusals lingered, outside the cap on refusals.
    let admitted =
        session::admissible(shared, peer).map_err(|e| (wire::ErrorCode::AuthFailed, e.to_string()));
    let handshake = admitted.and_then(|()| {
        handshakes
            .enter(peer.ip())
            .map_err(|why| (wire::ErrorCode::Internal, why))
    });
    let handshake = match handshake {
        Ok(h) => h,
        Err((code, why)) => {
            let cause = match code {
                wire::ErrorCode::AuthFailed => "not on loopback",
                _ => "handshake caps",
            };
            shared.noise.refused(peer, cause, &why);
            // Told why while few are: each refusal holds its socket for a moment, and a
            // flood must not hold the source's file descriptors.
            if let Ok(permit) = Arc::clone(refusing).try_acquire_owned() {
                tokio::spawn(async move {
                    control::refuse(stream, code, why).await;
                    drop(permit);
                });
            }
            return;
        }
    };
    let (shared, slots) = (Arc::clone(shared), Arc::clone(slots));
    tokio::spawn(async move {
        let served = session::serve_connection(stream, peer, Arc::clone(&shared), handshake, slots);
        match served.await {
            Ok(session::Ended::Served) => tracing::info!(%peer, "node disconnected"),
            // What a Kubernetes `tcpSocket` probe of the control port does every few seconds,
            // or a port scan: at debug, not as a dropped node. A peer that closes after its
            // `Hello` (a node whose secret this source lacks) is a dropped node, below.
            Ok(session::Ended::NoHello) => tracing::debug!(
                %peer,
                "control connection closed before its first frame (a TCP probe or a port scan)"
            ),
            Err(session::Failed {
                welcomed: true,
                error,
            }) => tracing::warn!(%peer, %error, "dropped node connection"),
            // Any host that reaches the port can cause these at will.
            Err(session::Failed {
                welcomed: false,
                error,
            }) => shared.noise.dropped(peer, &error),
        }
    });
}

/// Drains: sessions are told, and this waits until all of them have ended (every slot is
/// free again) or the drain timeout.
async fn drain(shared: &Shared, slots: &Arc<tokio::sync::Semaphore>) {
    let limit = shared.cfg.drain_timeout;
    let open = shared.cfg.max_connections - slots.available_permits();
    tracing::info!(
        sessions = open,
        ?limit,
        "draining: no new FETCHes; finishing the queued ones"
    );
    shared.draining.send_replace(true);
    let all = u32::try_from(shared.cfg.max_connections).unwrap_or(u32::MAX);
    let started = std::time::Instant::now();
    match tokio::time::timeout(limit, slots.acquire_many(all)).await {
        Ok(_) => tracing::info!(
            waited_ms = started.elapsed().as_millis() as u64,
            "drained: every node session has ended"
        ),
        Err(_) => {
            let left = shared.cfg.max_connections - slots.available_permits();
            tracing::warn!(
                sessions = left,
                ?limit,
                "drain timeout: exiting with node sessions still open"
            );
        }
    }
}

/// What a running source is doing: its datasets (and, for object storage, the store, the
/// window, the cache and the read-ahead) and its node sessions.
#[derive(Clone)]
pub struct SourceStatus(Arc<Shared>);

impl SourceStatus {
    /// The status as JSON (the admin endpoint's `/v1/status`).
    pub fn json(&self) -> serde_json::Value {
        let datasets: Vec<serde_json::Value> = self
            .0
            .datasets
            .iter()
            .map(|d| {
                let mut v = serde_json::json!({
                    "name": d.name,
                    "shards": d.manifest.shards.len(),
                    "bytes": d.manifest.total_bytes,
                    "digest": d.manifest.digest,
                });
                match &d.backend {
                    Backend::Local { dir, .. } => {
                        v["backend"] = "local".into();
                        v["dir"] = dir.display().to_string().into();
                    }
                    Backend::Remote(r) => {
                        v["backend"] = "object_store".into();
                        v["object_store"] = r.status();
                    }
                }
                v
            })
            .collect();
        serde_json::json!({
            "datasets": datasets,
            "sessions_started": self.0.sessions.load(std::sync::atomic::Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::auth::NONCE_LEN;
    use shardwire_protocol::framing::{FrameError, read_message, write_message};
    use shardwire_protocol::wire::{LaneAddr, Message};
    use tokio::net::TcpStream;

    use super::control::SessionError;
    use super::*;

    /// A source on loopback without a secret, serving nothing.
    async fn source() -> Source {
        let cfg = SourceConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            secret: None,
            rate_limit: 0,
            fault_corrupt: 0,
            fault_wrong_lane: 0,
            devmem_tx: Arc::default(),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: 1,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        };
        Source::bind(cfg, Datasets::default()).await.unwrap()
    }

    /// Runs the session of a loopback control connection to a source without a secret while
    /// `node` plays the peer; returns how it ended.
    async fn session_with<F, Fut>(node: F) -> Result<session::Ended, SessionError>
    where
        F: FnOnce(TcpStream) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let source = source().await;
        let peer = TcpStream::connect(source.local_addr()).await.unwrap();
        let (stream, addr) = source.listener.accept().await.unwrap();
        let handshakes = Arc::new(admit::Handshakes::default());
        let slot = handshakes.enter(addr.ip()).unwrap();
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        let run = session::run(stream, addr, Arc::clone(&source.shared), slot, slots);
        let (ended, ()) = tokio::join!(run, node(peer));
        ended
    }

    #[tokio::test(flavor = "current_thread")]
    async fn only_a_close_before_the_first_frame_is_a_probe() {
        // A kubelet tcpSocket probe: connect, then close without a byte.
        let probe = session_with(|peer| async move { drop(peer) }).await;
        assert!(matches!(probe, Ok(session::Ended::NoHello)), "{probe:?}");
        // A node that closes after the Challenge (it has a secret, this source none): before,
        // the same `Frame(Closed)` as a probe, and logged at debug only.
        let node = session_with(|mut peer| async move {
            let hello = Message::Hello {
                node_id: "n".into(),
                nonce: [0; NONCE_LEN],
                lanes: vec![LaneAddr {
                    data_addr: "127.0.0.1:9".parse().unwrap(),
                    flows: 1,
                }],
            };
            write_message(&mut peer, &hello).await.unwrap();
            let small = wire::MAX_SMALL_FRAME;
            let challenge = read_message(&mut peer, &mut Vec::new(), small).await;
            assert!(
                matches!(challenge, Ok(Message::Challenge { .. })),
                "{challenge:?}"
            );
        })
        .await;
        assert!(
            matches!(node, Err(SessionError::Frame(FrameError::Closed))),
            "{node:?}"
        );
    }

    /// The messages of the WARN events of this thread.
    struct Warnings(Arc<std::sync::Mutex<Vec<String>>>);

    /// Takes the `message` field of an event.
    struct MessageField<'a>(&'a mut String);

    impl tracing::field::Visit for MessageField<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                *self.0 = format!("{value:?}");
            }
        }
    }

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == tracing::Level::WARN {
                let mut message = String::new();
                event.record(&mut MessageField(&mut message));
                self.0.lock().unwrap().push(message);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// Collects this thread's warnings (a current-thread runtime's tasks run on it) until
    /// the guard drops.
    fn warnings() -> (
        Arc<std::sync::Mutex<Vec<String>>>,
        tracing::subscriber::DefaultGuard,
    ) {
        let seen = Arc::default();
        let guard = tracing::subscriber::set_default(Warnings(Arc::clone(&seen)));
        (seen, guard)
    }

    /// How many of `seen` start with `text`.
    fn lines(seen: &std::sync::Mutex<Vec<String>>, text: &str) -> usize {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|m| m.starts_with(text))
            .count()
    }

    /// The gates `admit_connection` takes: the handshakes under way, the refusals being
    /// sent, and one session slot.
    fn admission() -> (
        Arc<admit::Handshakes>,
        Arc<tokio::sync::Semaphore>,
        Arc<tokio::sync::Semaphore>,
    ) {
        let refusing = tokio::sync::Semaphore::new(admit::MAX_REFUSING);
        let slots = tokio::sync::Semaphore::new(1);
        (Arc::default(), Arc::new(refusing), Arc::new(slots))
    }

    /// A host off loopback that connects again and again to a source without a secret: one
    /// line, not one per connection (before, 50 here: any host could fill the log disk).
    #[tokio::test(flavor = "current_thread")]
    async fn a_flood_of_refused_connections_logs_one_line_per_peer() {
        let (seen, _guard) = warnings();
        let source = source().await;
        let (handshakes, refusing, slots) = admission();
        let gates = (&handshakes, &refusing);
        for i in 0..51u16 {
            let _peer = TcpStream::connect(source.local_addr()).await.unwrap();
            let (stream, _) = source.listener.accept().await.unwrap();
            // As the listener saw it: the 51st from another host.
            let ip: [u8; 4] = if i < 50 { [10, 1, 2, 3] } else { [10, 1, 2, 4] };
            let peer = SocketAddr::from((ip, 40000 + i));
            admit_connection(&source.shared, stream, peer, gates, &slots);
        }
        let refused = lines(&seen, "refusing a control connection");
        assert_eq!(refused, 2, "one per host: {:?}", seen.lock().unwrap());
    }

    /// Loopback peers whose first frame is no `Hello`, again and again: one line, and one for
    /// another cause (a frame cut short) from the same host. Before, one per connection.
    #[tokio::test(flavor = "current_thread")]
    async fn a_flood_of_failed_handshakes_logs_one_line_per_peer_and_cause() {
        let (seen, _guard) = warnings();
        let source = source().await;
        let (handshakes, refusing, slots) = admission();
        let gates = (&handshakes, &refusing);
        for i in 0..21 {
            let mut node = TcpStream::connect(source.local_addr()).await.unwrap();
            let (stream, peer) = source.listener.accept().await.unwrap();
            admit_connection(&source.shared, stream, peer, gates, &slots);
            if i < 20 {
                write_message(&mut node, &Message::Ping).await.unwrap();
            } else {
                use tokio::io::AsyncWriteExt;
                node.write_all(&[0, 0]).await.unwrap(); // half a length prefix
                node.shutdown().await.unwrap();
            }
            // The source closes it, and logs, in the same turn of its task.
            let mut buf = Vec::new();
            let read = read_message(&mut node, &mut buf, wire::MAX_SMALL_FRAME);
            let closed = tokio::time::timeout(std::time::Duration::from_secs(10), read).await;
            assert!(closed.expect("closed within 10 s").is_err());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let dropped = lines(&seen, "dropped node connection");
        assert_eq!(dropped, 2, "one per cause: {:?}", seen.lock().unwrap());
    }
}
