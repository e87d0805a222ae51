//! Dialling a node's data connections: `flows` to each lane's data address, numbered across
//! the lanes in lane order (`wire::conn_lanes`), each reported with `DataConn{lane, conn,
//! addr}` on the control connection, where `addr` is its local address: the node identifies
//! it by that (DESIGN §2) and checks that it arrived on the lane's address.
//!
//! A lane is a unit of failure (one GPU/NIC pair of the node): a lane whose data address cannot
//! be dialled is left out of the session, not the session ended. The node is told why (an
//! `Error{req 0}` naming the lane, its address and the connect's error) and which connections
//! it will not get (`DataConn` with [`wire::NOT_DIALLED`]); the lane's later connections are not
//! tried (each would wait out its own connect limit), and FETCHes for a lane left with no
//! connection are refused. A lane whose first connections were dialled before one failed is
//! not left out: it is served on those, and the `Error` says so. Only a node none of whose
//! connections could be dialled ends the session. The next session dials every lane again.
//!
//! The lanes are dialled at the same time (each lane's connections one after another), so
//! lanes whose connects time out cost one connect limit together, not one each, out of the
//! session's dial deadline; the sender threads start once dialling ends, each paced at its
//! share of `rate_limit` over the connections dialled.
//!
//! Each data socket is bound to an ephemeral port of its own before it connects, so its local
//! address is unique on this host even across lanes: the kernel may otherwise reuse one
//! source port for connections to different destinations, and the node would see two
//! connections from one address.
//!
//! With devmem TX bindings on several NICs each connection is bound (`SO_BINDTODEVICE`) to the
//! NIC the kernel routes its lane through and sends from that NIC's binding
//! ([`crate::tx_nics`]). Each address is routed once per session ([`TxRoutes`]), so a lane that
//! gets no binding is warned of once per session, not once per connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use shardwire_protocol::wire::{self, ErrorCode, LaneAddr, Message};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Notify;

use crate::Shared;
use crate::control::{Control, HANDSHAKE_TIMEOUT, MAX_SESSION_FLOWS, SessionError};
use crate::devmem_tx::TxPath;
use crate::sender::{ConnFailed, Progress, Sender};
use crate::tx_nics::{TxRoute, unbound_reason};

/// A node's data connections: the senders in connection order, and the lane of each.
pub(crate) struct DataConns {
    /// One per data connection, `conn` = index; `None` for one not dialled (the node was told,
    /// [`wire::NOT_DIALLED`]).
    pub senders: Vec<Option<Sender>>,
    /// The lane of each connection.
    pub lane_of: Vec<u16>,
}

/// Where connection `conn` of lane `lane` is dialled: the lane's address, unless the fault
/// injection `fault_wrong_lane` sends one of lane 0's to lane 1.
fn target(shared: &Shared, lanes: &[LaneAddr], lane: usize) -> SocketAddr {
    let misdial = lane == 0
        && lanes.len() > 1
        && shared
            .wrong_lane_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
    if misdial {
        tracing::warn!(lane, to = %lanes[1].data_addr, "fault injection: dialling lane 0's data connection to lane 1");
        return lanes[1].data_addr;
    }
    lanes[lane].data_addr
}

/// Connects to `addr` from an ephemeral port bound first (see the module docs), through
/// `device` only when one is given (`SO_BINDTODEVICE`).
async fn connect(addr: SocketAddr, device: Option<&str>) -> std::io::Result<TcpStream> {
    let (sock, any) = match addr {
        SocketAddr::V4(_) => (TcpSocket::new_v4()?, SocketAddr::from(([0, 0, 0, 0], 0))),
        SocketAddr::V6(_) => (TcpSocket::new_v6()?, SocketAddr::from(([0u16; 8], 0))),
    };
    if let Some(d) = device {
        sock.bind_device(Some(d.as_bytes()))?;
    }
    sock.bind(any)?;
    sock.connect(addr).await
}

/// The devmem TX route of each data address one session dials (module [`crate::tx_nics`]),
/// found at its first connection and kept for the others: a lane that gets no binding is
/// warned of once per session, not once per connection (up to 256 lines at every session
/// start before).
#[derive(Default)]
struct TxRoutes(Mutex<HashMap<SocketAddr, Option<Arc<TxPath>>>>);

impl TxRoutes {
    /// The devmem TX binding a data connection to `addr` sends from, if any.
    fn path(&self, shared: &Shared, addr: SocketAddr) -> Option<Arc<TxPath>> {
        if shared.cfg.devmem_tx.is_empty() {
            return None;
        }
        self.path_with(addr, || shared.cfg.devmem_tx.route(addr))
    }

    /// [`TxRoutes::path`] with `addr`'s route found by `route` (once per address); says why
    /// when the source has bindings but this lane gets none.
    fn path_with(&self, addr: SocketAddr, route: impl FnOnce() -> TxRoute) -> Option<Arc<TxPath>> {
        let mut known = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(path) = known.get(&addr) {
            return path.clone();
        }
        let path = match route() {
            TxRoute::Nic(p) => Some(p),
            TxRoute::NoBinding { local, compared } => {
                let why = unbound_reason(local, &compared);
                tracing::warn!(lane = %addr, %local,
                    "this lane's data connections send with sendfile (said once per session): {why}");
                None
            }
            TxRoute::Unroutable(e) => {
                tracing::warn!(lane = %addr, error = %e, "no route to the lane's address");
                None
            }
        };
        known.insert(addr, path.clone());
        path
    }
}

/// A session's rate limit (bytes/s, 0: unlimited) shared by its `flows` connections: at least
/// 1 byte/s each, so a limit below the flow count does not read as unlimited (0).
fn per_flow_rate(limit: u64, flows: u64) -> u64 {
    match limit {
        0 => 0,
        r => (r / flows.max(1)).max(1),
    }
}

/// Whether a connection paced at `rate` bytes/s (0: unlimited) stays under the floor a node
/// holds its data connections to.
fn below_pace(rate: u64) -> bool {
    rate != 0 && rate.saturating_mul(wire::DATA_PACE_WINDOW.as_secs()) < wire::DATA_PACE_FLOOR
}

/// Dials every lane `flows` times ([`dial_lanes`]: the lanes at once), reporting each
/// connection on the control connection as its connect ends; a lane that cannot be dialled is
/// left out. Then starts a sender thread per connection dialled, each paced at its share of
/// `rate_limit` over the connections dialled ([`conn_share`]). Fails when no connection at all
/// could be dialled (with the lowest lane's failure), or the control connection or a sender
/// thread fails.
pub(crate) async fn dial(
    ctl: &mut Control,
    shared: &Shared,
    lanes: &[LaneAddr],
    failed: &Arc<ConnFailed>,
    progress: &Arc<Notify>,
) -> Result<DataConns, SessionError> {
    check_lanes(ctl, shared, lanes).await?;
    let (dialled, failure) = dial_lanes(ctl, shared, lanes).await?;
    if let Some(e) = failure
        && dialled.iter().all(Option::is_none)
    {
        return Err(e);
    }
    let rate = conn_share(shared.cfg.rate_limit, &dialled);
    if below_pace(rate) {
        tracing::warn!(
            rate_limit = shared.cfg.rate_limit,
            connections = dialled.iter().flatten().count(),
            per_connection = rate,
            "rate_limit leaves each data connection of this node less than the {} bytes every {:?} a node needs to keep it: the node will drop them as a trickle; raise rate_limit",
            wire::DATA_PACE_FLOOR,
            wire::DATA_PACE_WINDOW
        );
    }
    let spawn = Spawn {
        rate,
        failed,
        progress,
    };
    let senders = dialled
        .into_iter()
        .enumerate()
        .map(|(conn, d)| d.map(|d| spawn.sender(d, conn as u16)).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(DataConns {
        senders,
        lane_of: wire::conn_lanes(lanes),
    })
}

/// Each dialled connection's share of `limit` (bytes/s, 0: unlimited): `limit` split over the
/// connections dialled (`Some` in `conns`), not over every one the node asked for, so a session
/// with a lane left out still sends at `rate_limit` in all.
fn conn_share<T>(limit: u64, conns: &[Option<T>]) -> u64 {
    per_flow_rate(limit, conns.iter().flatten().count() as u64)
}

/// What a data connection's sender thread is started with.
struct Spawn<'a> {
    /// Its share of the rate limit (bytes/s, 0: unlimited).
    rate: u64,
    /// Told when it fails.
    failed: &'a Arc<ConnFailed>,
    /// Notified as it sends.
    progress: &'a Arc<Notify>,
}

impl Spawn<'_> {
    /// The sender thread of data connection `conn` over `dialled`.
    fn sender(&self, dialled: Dialled, conn: u16) -> Result<Sender, SessionError> {
        let p = Arc::new(Progress::with_notify(Arc::clone(self.progress)));
        Sender::spawn(
            dialled.stream,
            conn,
            self.rate,
            Arc::clone(self.failed),
            dialled.tx.as_deref(),
            p,
        )
        .map_err(|source| SessionError::SpawnSender { conn, source })
    }
}

/// How one data connect ended: connection `conn` of lane `lane`.
struct Connect {
    /// The lane.
    lane: usize,
    /// The connection's number (across the lanes).
    conn: u16,
    /// The connection, or why it could not be dialled.
    dialled: Result<Dialled, SessionError>,
}

/// Dials connection `conn` of lane `lane` ([`open_data_conn`]), with the session's `routes`.
async fn dial_one(
    (shared, routes): (&Shared, &TxRoutes),
    lanes: &[LaneAddr],
    lane: usize,
    conn: u16,
) -> Connect {
    let dialled = open_data_conn(shared, routes, target(shared, lanes, lane)).await;
    Connect {
        lane,
        conn,
        dialled,
    }
}

/// Dials every lane at once, each lane's connections one after another: lanes whose connects
/// time out cost one connect limit together, not one each, out of
/// [`crate::control::DIAL_DEADLINE`]. Each connection is reported with its `DataConn` as its
/// connect ends (the node numbers them, so the order does not matter). A lane's first connect
/// that fails is told to the node with the lane ([`tell_not_dialled`]), and right after it
/// that connection and the lane's later ones as [`wire::NOT_DIALLED`] (not tried): the node
/// takes the `Error` just before as the lane's reason. Returns each connection dialled (`None`
/// for one not), by number, and the failure of the lowest lane that had one.
async fn dial_lanes(
    ctl: &mut Control,
    shared: &Shared,
    lanes: &[LaneAddr],
) -> Result<(Vec<Option<Dialled>>, Option<SessionError>), SessionError> {
    // Past each lane's last connection; `check_lanes` bounds the sum to MAX_SESSION_FLOWS.
    let ends: Vec<u16> = lanes
        .iter()
        .scan(0u16, |n, l| {
            *n += l.flows;
            Some(*n)
        })
        .collect();
    let total = ends.last().copied().unwrap_or(0);
    let mut dialled: Vec<Option<Dialled>> = (0..total).map(|_| None).collect();
    let mut failures: Vec<Option<SessionError>> = lanes.iter().map(|_| None).collect();
    let routes = TxRoutes::default();
    let with = (shared, &routes);
    let mut under_way = FuturesUnordered::new();
    for (lane, (l, &end)) in lanes.iter().zip(&ends).enumerate() {
        if l.flows > 0 {
            under_way.push(dial_one(with, lanes, lane, end - l.flows));
        }
    }
    while let Some(Connect {
        lane,
        conn,
        dialled: d,
    }) = under_way.next().await
    {
        let (wire_lane, end) = (lane as u16, ends[lane]);
        match d {
            Ok(d) => {
                let addr = d.local;
                ctl.send(&Message::DataConn {
                    lane: wire_lane,
                    conn,
                    addr,
                })
                .await?;
                dialled[usize::from(conn)] = Some(d);
                if conn + 1 < end {
                    under_way.push(dial_one(with, lanes, lane, conn + 1));
                }
            }
            Err(e) => {
                // The lane's connections before this one were dialled, one after another.
                let dialled_before = conn - (end - lanes[lane].flows);
                tell_not_dialled(ctl, (lane, conn, dialled_before), &e).await?;
                for conn in conn..end {
                    let addr = wire::NOT_DIALLED;
                    ctl.send(&Message::DataConn {
                        lane: wire_lane,
                        conn,
                        addr,
                    })
                    .await?;
                }
                failures[lane] = Some(e);
            }
        }
    }
    Ok((dialled, failures.into_iter().flatten().next()))
}

/// Tells the node (an `Error` about no request, which it logs and shows) that connection
/// `conn` of lane `lane`, and the lane's later ones, cannot be dialled, and why (`e`, naming
/// the lane's data address): the session goes on without them, or ends if no lane could be
/// dialled. `dialled_before`: the lane's connections before `conn`, dialled.
async fn tell_not_dialled(
    ctl: &mut Control,
    (lane, conn, dialled_before): (usize, u16, u16),
    e: &SessionError,
) -> Result<(), SessionError> {
    if dialled_before == 0 {
        tracing::warn!(lane, error = %e, "a lane of the node cannot be dialled: this session goes on without it");
    } else {
        tracing::warn!(lane, conn, dialled = dialled_before, error = %e,
            "a data connection of the node's lane cannot be dialled: the lane is served on those dialled before it");
    }
    let message = not_dialled_message((lane, conn, dialled_before), e);
    ctl.error(0, ErrorCode::Internal, message).await
}

/// What the node is told of connection `conn` of lane `lane` that could not be dialled
/// ([`tell_not_dialled`]). Before, a lane some of whose connections were dialled was said to be
/// left out of the session, though it was served on those.
fn not_dialled_message(
    (lane, conn, dialled_before): (usize, u16, u16),
    e: &SessionError,
) -> String {
    match dialled_before {
        0 => format!(
            "lane {lane}: {e}; the source leaves the lane out of this session (the next session \
             dials it again)"
        ),
        k => format!(
            "lane {lane}: connection {conn}: {e}; the lane is served on its first {k} \
             connection(s), the rest are not dialled in this session (the next session dials \
             them again)"
        ),
    }
}

/// Refuses, on the control connection, lanes the source must not dial: more connections in
/// all than a session may have, or (without a secret) a data address that is not loopback.
async fn check_lanes(
    ctl: &mut Control,
    shared: &Shared,
    lanes: &[LaneAddr],
) -> Result<(), SessionError> {
    let total: u64 = lanes.iter().map(|l| u64::from(l.flows)).sum();
    if total > MAX_SESSION_FLOWS {
        let e = SessionError::TooManyFlows(total);
        let _ = ctl.error(0, ErrorCode::BadRequest, e.to_string()).await;
        return Err(e);
    }
    // Without a secret only loopback peers are served (`session::admit_peer`), and only loopback
    // data addresses are dialled: else any local process could have the source stream its
    // datasets to any host it names.
    if shared.cfg.secret.is_none()
        && let Some((lane, l)) = lanes
            .iter()
            .enumerate()
            .find(|(_, l)| !l.data_addr.ip().to_canonical().is_loopback())
    {
        let e = SessionError::DataNotLoopback {
            lane,
            addr: l.data_addr,
        };
        let _ = ctl.error(0, ErrorCode::BadRequest, e.to_string()).await;
        return Err(e);
    }
    Ok(())
}

/// A data connection dialled and ready for its sender thread.
struct Dialled {
    /// The socket: blocking, with the idle timeout as its send timeout.
    stream: std::net::TcpStream,
    /// Its local address: the node's name for it.
    local: SocketAddr,
    /// The devmem TX binding it sends from, if any.
    tx: Option<Arc<TxPath>>,
}

/// How long one data connect may take: [`HANDSHAKE_TIMEOUT`], or half the idle timeout the
/// node was told in `Welcome` (whole seconds, at least 1) where that is shorter. Nothing goes
/// on the control connection while a connect is under way (a `DataConn` follows each), and the
/// node ends a session it hears nothing on for that idle timeout: a connect that fails within
/// half of it leaves the source time to tell the node why (`dial_or_tell`).
fn connect_limit(idle: Duration) -> Duration {
    let told = Duration::from_secs(idle.as_secs().clamp(1, u64::from(u16::MAX)));
    HANDSHAKE_TIMEOUT.min(told / 2)
}

/// Dials one data connection to `addr` within [`connect_limit`] (sending from its devmem TX
/// binding in `routes`, if any) and readies it for its sender thread.
async fn open_data_conn(
    shared: &Shared,
    routes: &TxRoutes,
    addr: SocketAddr,
) -> Result<Dialled, SessionError> {
    let data_err = |source| SessionError::DataConnect { addr, source };
    let tx = routes.path(shared, addr);
    let device = tx.as_ref().map(|p| p.ifname.as_str());
    let limit = connect_limit(shared.cfg.idle_timeout);
    let s = tokio::time::timeout(limit, connect(addr, device))
        .await
        .map_err(|_| {
            let why = format!("no answer within {limit:?}");
            data_err(std::io::Error::new(std::io::ErrorKind::TimedOut, why))
        })?
        .map_err(data_err)?;
    let local = s.local_addr().map_err(data_err)?;
    let std = s.into_std().map_err(data_err)?;
    std.set_nonblocking(false).map_err(data_err)?;
    // A node that reads nothing of a payload for the idle timeout is gone: the send fails
    // (the session ends) instead of holding the sender thread and its file.
    std.set_write_timeout(Some(shared.cfg.idle_timeout))
        .map_err(data_err)?;
    Ok(Dialled {
        stream: std,
        local,
        tx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connect_fails_within_half_the_idle_timeout_the_node_was_told() {
        // Before: 10 s whatever the idle timeout; at 5 s the node had ended the session as
        // silent, and the source's reason went into a closed connection.
        assert_eq!(
            connect_limit(Duration::from_secs(5)),
            Duration::from_millis(2500)
        );
        assert_eq!(connect_limit(Duration::from_secs(60)), HANDSHAKE_TIMEOUT);
        assert_eq!(connect_limit(Duration::from_secs(20)), HANDSHAKE_TIMEOUT);
        // Welcome carries whole seconds, at least 1.
        assert_eq!(
            connect_limit(Duration::from_millis(1900)),
            Duration::from_millis(500)
        );
        assert_eq!(connect_limit(Duration::ZERO), Duration::from_millis(500));
    }

    /// Lane 0 of 4 flows whose third connect failed is served on its first two: before, the
    /// node was told the lane was left out of the session.
    #[test]
    fn a_lane_with_connections_dialled_is_not_said_to_be_left_out() {
        let e = SessionError::DataConnect {
            addr: "10.0.0.5:7400".parse().unwrap(),
            source: std::io::Error::from(std::io::ErrorKind::TimedOut),
        };
        let some = not_dialled_message((0, 2, 2), &e);
        assert!(!some.contains("left out"), "{some}");
        for says in [
            "lane 0: connection 2:",
            "10.0.0.5:7400",
            "served on its first 2",
        ] {
            assert!(some.contains(says), "{says}: {some}");
        }
        let none = not_dialled_message((1, 4, 0), &e);
        assert!(none.starts_with("lane 1: cannot open"), "{none}");
        assert!(none.contains("leaves the lane out"), "{none}");
    }

    /// A lane's address is routed once per session: its later connections neither route it
    /// again nor warn again (before, a line per connection, up to 256 at each session start).
    #[test]
    fn a_lane_address_is_routed_and_warned_of_once_per_session() {
        let routes = TxRoutes::default();
        let looked = std::cell::Cell::new(0);
        let unbound = || {
            looked.set(looked.get() + 1);
            TxRoute::NoBinding {
                local: "fd00::2".parse().unwrap(),
                compared: vec![("eth1".into(), Some("10.0.1.2".parse().unwrap()))],
            }
        };
        let (a, b): (SocketAddr, SocketAddr) = (
            "[fd00::5]:7400".parse().unwrap(),
            "[fd00::6]:7400".parse().unwrap(),
        );
        for _ in 0..4 {
            assert!(routes.path_with(a, unbound).is_none());
        }
        assert_eq!(looked.get(), 1, "once for its four connections");
        assert!(routes.path_with(b, unbound).is_none());
        assert_eq!(looked.get(), 2, "another address is routed on its own");
        let fresh = TxRoutes::default();
        assert!(fresh.path_with(a, unbound).is_none());
        assert_eq!(looked.get(), 3, "the next session routes it again");
    }

    #[test]
    fn a_limit_below_the_flow_count_stays_a_limit() {
        assert_eq!(per_flow_rate(0, 8), 0, "unlimited");
        assert_eq!(per_flow_rate(800, 8), 100);
        assert_eq!(per_flow_rate(5, 8), 1, "not 0, which is unlimited");
        assert_eq!(per_flow_rate(5, 0), 5);
    }

    #[test]
    fn the_rate_limit_is_split_over_the_connections_dialled() {
        // 8 lanes of 1 flow, 4 left out: each of the 4 got 800 / 8 before, and the session
        // sent at half its rate_limit.
        let conns = [
            Some(()),
            None,
            Some(()),
            None,
            Some(()),
            None,
            Some(()),
            None,
        ];
        assert_eq!(conn_share(800, &conns), 200);
        assert_eq!(conn_share(0, &conns), 0, "unlimited");
        assert_eq!(conn_share(800, &[None::<()>; 2]), 800, "none dialled");
        // The pace warning follows the share too: 4 dialled at the floor each are not warned
        // of, as they were split over all 8.
        let floor_rate = wire::DATA_PACE_FLOOR.div_ceil(wire::DATA_PACE_WINDOW.as_secs());
        assert!(!below_pace(conn_share(4 * floor_rate, &conns)));
        assert!(below_pace(per_flow_rate(4 * floor_rate, 8)), "over all 8");
    }

    #[test]
    fn a_share_under_the_nodes_floor_is_warned_of() {
        assert!(!below_pace(0), "unlimited");
        let floor_rate = wire::DATA_PACE_FLOOR.div_ceil(wire::DATA_PACE_WINDOW.as_secs());
        assert!(!below_pace(floor_rate));
        assert!(below_pace(floor_rate - 1));
        assert!(below_pace(per_flow_rate(100 << 10, 8)), "100 KiB/s over 8");
        assert!(!below_pace(per_flow_rate(10 << 20, 64)));
    }
}
