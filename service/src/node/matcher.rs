//! Identifies data connections without in-band bytes (DESIGN §2): a source reports the
//! local address of each data connection on its authenticated control connection, and the
//! node matches the peer address of the connections accepted on its data port. Either can
//! come first. Connections that nobody announces within [`UNMATCHED_TIMEOUT`] are dropped.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::Node;
use super::link::{FetchFailure, PendingFetch, SourceLink};

/// How long an accepted, unannounced data connection is kept.
pub const UNMATCHED_TIMEOUT: Duration = Duration::from_secs(10);
/// At most this many unidentified connections are held at once.
pub const MAX_UNMATCHED: usize = 1024;

struct Expected {
    link: Arc<SourceLink>,
    conn: u16,
    generation: u64,
    rx: Receiver<PendingFetch>,
}

#[derive(Default)]
struct Inner {
    expected: HashMap<SocketAddr, Expected>,
    accepted: HashMap<SocketAddr, (TcpStream, Instant)>,
}

/// The matcher table.
#[derive(Default)]
pub struct Matcher(Mutex<Inner>);

impl Matcher {
    /// A source announced a data connection from `addr`.
    pub fn expect(
        &self,
        node: &Arc<Node>,
        addr: SocketAddr,
        link: Arc<SourceLink>,
        conn: u16,
        generation: u64,
        rx: Receiver<PendingFetch>,
    ) {
        let mut inner = self.0.lock().expect("poisoned");
        let e = Expected {
            link,
            conn,
            generation,
            rx,
        };
        match inner.accepted.remove(&addr) {
            Some((sock, _)) => {
                drop(inner);
                start(node, sock, addr, e);
            }
            None => {
                inner.expected.insert(addr, e);
            }
        }
    }

    /// A link went down: its announced-but-unconnected queues fail their fetches.
    pub fn forget(&self, link_index: usize, generation: u64, reason: &str) {
        let dropped: Vec<Expected> = {
            let mut inner = self.0.lock().expect("poisoned");
            let keys: Vec<SocketAddr> = inner
                .expected
                .iter()
                .filter(|(_, e)| e.link.index == link_index && e.generation == generation)
                .map(|(k, _)| *k)
                .collect();
            keys.iter()
                .filter_map(|k| inner.expected.remove(k))
                .collect()
        };
        for e in dropped {
            while let Ok(p) = e.rx.try_recv() {
                p.fail(FetchFailure::Source(reason.to_string()));
            }
        }
    }

    /// Closes accepted connections that nobody announced within [`UNMATCHED_TIMEOUT`].
    fn sweep(&self) {
        let now = Instant::now();
        self.0.lock().expect("poisoned").accepted.retain(|a, (_, t)| {
            let keep = now.duration_since(*t) < UNMATCHED_TIMEOUT;
            if !keep {
                tracing::warn!(peer = %a, "dropping a data connection that no authenticated source announced");
            }
            keep
        });
    }

    fn accepted(&self, node: &Arc<Node>, sock: TcpStream, peer: SocketAddr) {
        let mut inner = self.0.lock().expect("poisoned");
        if inner.accepted.len() >= MAX_UNMATCHED && !inner.expected.contains_key(&peer) {
            tracing::warn!(%peer, limit = MAX_UNMATCHED, "too many unidentified data connections; refusing this one");
            return;
        }
        let now = Instant::now();
        match inner.expected.remove(&peer) {
            Some(e) => {
                drop(inner);
                start(node, sock, peer, e);
            }
            None => {
                inner.accepted.insert(peer, (sock, now));
            }
        }
    }
}

fn start(node: &Arc<Node>, sock: TcpStream, peer: SocketAddr, e: Expected) {
    if !e.link.attach_data(e.generation, &sock) {
        tracing::debug!(%peer, "data connection for a link generation that is gone");
        return;
    }
    tracing::debug!(%peer, source = %e.link.addr, conn = e.conn, "data connection identified");
    super::receiver::spawn(Arc::clone(node), e.link, e.conn, sock, e.rx);
}

/// Accepts data connections until shutdown.
pub async fn accept_loop(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = sweep.tick() => node.matcher.sweep(),
            r = listener.accept() => match r {
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    match s.into_std().and_then(|s| { s.set_nonblocking(false)?; Ok(s) }) {
                        Ok(s) => node.matcher.accepted(&node, s, peer),
                        Err(e) => tracing::warn!(%peer, error = %e, "cannot take over data connection"),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "data accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}
