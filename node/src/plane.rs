//! The data plane: the source links, the data-connection matcher, the lanes, the RX bindings
//! (devmem or its emulator, at most one per lane, swapped at run time by the control task),
//! and the receiver threads it starts for each identified data connection.
//!
//! Links announce data connections to the plane through [`DataConns`]; the accept loops on the
//! lanes' data listeners hand it accepted sockets with the address each arrived on; a match
//! (on the announced lane's address, else refused and counted) starts a receiver on that
//! lane's path: its GPU, its own binding if it has one, its CPUs. A connection reads through
//! its own lane's binding only. The NIC each identified connection came in on is checked
//! against its lane's on a thread of its own ([`crate::ingress`]: counted and logged,
//! received anyway). What any peer can cause (connections nobody announces:
//! refused, evicted, swept) is logged at most once per kind and peer host every
//! [`warn_limit::EVERY`], with the lines left out counted.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use shardwire_config::ReceiveMode;
use shardwire_devmem::emu::host::EmuHost;
use shardwire_gpu::cuda::CudaMemory;
use shardwire_protocol::warn_limit::{self, LeftOut, WarnLimit};
use tokio::sync::watch;

use crate::binding::{BindingKind, Reading, RxRegion};
use crate::counters::{Counters, FlowStats};
use crate::fetch::{FetchFailure, InFlight};
use crate::ingress::IngressCheck;
use crate::lanes::plan::Ipv4Lookup;
use crate::lanes::{Lane, Lanes};
use crate::link::{Announcement, DataConns, Kick, SourceLink};
use crate::matcher::{self, Accepted, Announced, Matcher, UNMATCHED_TIMEOUT, WrongLane};
use crate::roster::Roster;
use crate::rx::{self, Conn, Setup, shared::Gpus};

/// A line about a data connection nobody announced (any peer can cause one at will).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Unidentified {
    /// The table was full: the oldest held connection went for it.
    Evicted,
    /// Its host holds too many already: refused.
    Refused,
    /// Nobody announced it in time: dropped.
    Unannounced,
}

impl Unidentified {
    /// What happened, as a summary of left-out lines names it.
    fn what(self) -> &'static str {
        match self {
            Self::Evicted => "oldest unidentified data connection dropped to hold a new one",
            Self::Refused => "unidentified data connection refused (too many from this host)",
            Self::Unannounced => "data connection that no authenticated source announced dropped",
        }
    }
}

/// A data connection a source announced and the node has not accepted yet.
#[derive(Debug)]
pub struct Expected {
    link: Arc<SourceLink>,
    lane: u16,
    conn: u16,
    generation: u64,
    queue: std::sync::mpsc::Receiver<InFlight>,
}

impl Expected {
    /// Fails the fetches queued on the connection (it will not be received from), with
    /// `reason` as the link's.
    fn fail_queued(&self, reason: &str) {
        while let Ok(f) = self.queue.try_recv() {
            f.finish(Err(FetchFailure::LinkDown {
                source_addr: self.link.addr.clone(),
                reason: reason.to_owned(),
            }));
        }
    }
}

/// One identified data connection's counters, for `shardwire bench` and status.
#[derive(Debug, Clone)]
pub struct Flow {
    /// The source.
    pub source: String,
    /// Its lane.
    pub lane: u32,
    /// Its connection number.
    pub conn: u16,
    /// Its counters.
    pub stats: Arc<FlowStats>,
}

/// The RX bindings by lane.
type Bindings = BTreeMap<u32, Arc<RxRegion>>;

/// The data connections identified and still receiving, and the bytes of those that have
/// ended, under one lock: an ended connection's bytes move from one to the other inside it,
/// so a lane's total never counts them twice (or not at all).
#[derive(Debug, Default)]
struct FlowTable {
    /// Identified and still receiving (pruned as new ones come).
    live: Vec<Flow>,
    /// Bytes received by data connections that have ended, by lane.
    ended: BTreeMap<u32, u64>,
}

impl FlowTable {
    /// Adds `flow`, first moving the bytes of connections that have ended (their receiver
    /// let go of its counters) into the lanes' totals, so a source that reconnects again and
    /// again does not grow the list.
    fn add(&mut self, flow: Flow) {
        prune_ended(&mut self.live, &mut self.ended);
        self.live.push(flow);
    }

    /// Bytes received on lane `lane`'s data connections, ended ones included.
    fn lane_bytes(&self, lane: u32) -> u64 {
        let live: u64 = (self.live.iter())
            .filter(|f| f.lane == lane)
            .map(|f| f.stats.bytes.load(Ordering::Relaxed))
            .sum();
        live + self.ended.get(&lane).copied().unwrap_or(0)
    }
}

/// How long a lane's NIC address looked up answers every source session's look (each
/// looks every `stall::CHECK_EVERY`): one lookup per lane, not one per link.
const NIC_LOOK_EVERY: Duration = Duration::from_secs(5);

/// A lane's NIC with no IPv4 address for this long (an IPv6-only NIC never gets one) is
/// looked up once a [`NIC_LOOK_SLOWLY`] from then on.
const NIC_SLOW_AFTER: Duration = Duration::from_secs(600);

/// How often a NIC without an address past [`NIC_SLOW_AFTER`] is looked up.
const NIC_LOOK_SLOWLY: Duration = Duration::from_secs(60);

/// What a lookup of a lane's NIC address gave ([`DataPlane::nic_ip`]).
#[derive(Debug, Clone, Copy)]
struct NicSeen {
    /// The address (`None`: none, or only a link-local one).
    ip: Option<Ipv4Addr>,
    /// When it was looked up.
    at: Instant,
    /// Since when the NIC has had none, while it has none.
    none_since: Option<Instant>,
}

impl NicSeen {
    /// Whether the NIC is to be looked up again at `now`.
    fn due(&self, now: Instant) -> bool {
        let slow = self
            .none_since
            .is_some_and(|t| now.saturating_duration_since(t) >= NIC_SLOW_AFTER);
        let every = if slow {
            NIC_LOOK_SLOWLY
        } else {
            NIC_LOOK_EVERY
        };
        now.saturating_duration_since(self.at) >= every
    }
}

/// The data plane.
pub struct DataPlane {
    /// The sources: configured and found by DNS ([`crate::discovery`]).
    pub roster: Arc<Roster>,
    /// The node's lanes.
    pub lanes: Arc<Lanes>,
    matcher: Mutex<Matcher<TcpStream, Expected>>,
    /// The lines about unidentified data connections, by kind and peer host.
    noise: Mutex<WarnLimit<(Unidentified, IpAddr)>>,
    /// Checks the NIC each identified connection came in on against its lane's.
    ingress: IngressCheck,
    rx: RwLock<Bindings>,
    /// The emulated host whose NICs the `devmem-sim` bindings are on.
    emu: Arc<EmuHost>,
    /// The data connections identified and still receiving, and the bytes of those ended.
    flows: Mutex<FlowTable>,
    /// What was last seen of the NIC address of each lane that awaits one
    /// (`LaneSpec::awaits_nic_address`): answers every link's look for a while, and a change
    /// is logged once.
    nic_ips: Mutex<BTreeMap<u32, NicSeen>>,
    counters: Arc<Counters>,
    /// Plain-TCP host connections try io_uring ([`crate::rx::uring`]).
    io_uring: bool,
    /// Lane 0 devmem connections still to misplace onto lane 1's binding (`fault_misplace`).
    fault_misplace: std::sync::atomic::AtomicU32,
    /// Data connections whose receiver thread is still to fail to start (`fault_spawn`).
    fault_spawn: std::sync::atomic::AtomicU32,
}

impl DataPlane {
    /// A plane over these sources and lanes, with these bindings (each on its lane, those of
    /// the emulator on `emu`).
    pub fn new(
        roster: Arc<Roster>,
        lanes: Arc<Lanes>,
        (rx, emu): (Vec<(u32, Arc<RxRegion>)>, Arc<EmuHost>),
        counters: Arc<Counters>,
        io_uring: bool,
    ) -> Self {
        Self {
            roster,
            lanes,
            matcher: Mutex::default(),
            noise: Mutex::new(WarnLimit::new(warn_limit::EVERY)),
            ingress: IngressCheck::default(),
            rx: RwLock::new(rx.into_iter().collect()),
            emu,
            flows: Mutex::default(),
            nic_ips: Mutex::default(),
            counters,
            io_uring,
            fault_misplace: Default::default(),
            fault_spawn: Default::default(),
        }
    }

    /// Fault injection: the next `n` devmem data connections of lane 0 land on lane 1's
    /// binding (`fault_misplace`).
    pub(crate) fn set_fault_misplace(&self, n: u32) {
        self.fault_misplace.store(n, Ordering::Relaxed);
    }

    /// Fault injection: the next `n` data connections' receiver threads fail to start
    /// (`fault_spawn`).
    pub(crate) fn set_fault_spawn(&self, n: u32) {
        self.fault_spawn.store(n, Ordering::Relaxed);
    }

    /// Lane 1's binding when a lane 0 devmem connection is to be misplaced onto it.
    fn take_misplace(&self, lane: u32) -> Option<Arc<RxRegion>> {
        let onto = self.binding(1).filter(|_| lane == 0)?;
        self.binding(0)?;
        let left = &self.fault_misplace;
        left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .ok()?;
        Some(onto)
    }

    /// The RX binding of lane `lane` (`None`: plain TCP on it).
    pub fn binding(&self, lane: u32) -> Option<Arc<RxRegion>> {
        self.rx
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&lane)
            .cloned()
    }

    /// Lane `lane`'s RX binding and, for a connection about to read from it, its place among
    /// the binding's readers, taken under the lock that removing the binding takes.
    fn binding_read(&self, lane: u32) -> (Option<Arc<RxRegion>>, Option<Reading>) {
        let rx = self.rx.read().unwrap_or_else(|p| p.into_inner());
        match rx.get(&lane) {
            Some(b) => (Some(Arc::clone(b)), Some(b.reading())),
            None => (None, None),
        }
    }

    /// Every RX binding with its lane, by lane.
    pub fn bindings(&self) -> Vec<(u32, Arc<RxRegion>)> {
        let rx = self.rx.read().unwrap_or_else(|p| p.into_inner());
        rx.iter().map(|(l, r)| (*l, Arc::clone(r))).collect()
    }

    /// Sets (or with `None` removes) lane `lane`'s binding; its data connections identified
    /// from now on use it.
    pub(crate) fn set_binding(&self, lane: u32, rx: Option<Arc<RxRegion>>) {
        let mut all = self.rx.write().unwrap_or_else(|p| p.into_inner());
        match rx {
            Some(r) => all.insert(lane, r),
            None => all.remove(&lane),
        };
    }

    /// The emulated host of the `devmem-sim` bindings.
    pub fn emu(&self) -> &Arc<EmuHost> {
        &self.emu
    }

    /// The GPU of lane `lane` (`None`: host memory).
    pub fn cuda(&self, lane: u32) -> Option<&Arc<CudaMemory>> {
        self.lanes.get(lane).and_then(|l| l.cuda.as_ref())
    }

    /// The receive path in effect (devmem when any lane has a kernel binding).
    pub fn receive(&self) -> ReceiveMode {
        let kinds: Vec<BindingKind> = self.bindings().iter().map(|(_, r)| r.kind()).collect();
        if kinds.contains(&BindingKind::Kernel) {
            ReceiveMode::Devmem
        } else if kinds.is_empty() {
            ReceiveMode::Host
        } else {
            ReceiveMode::DevmemSim
        }
    }

    /// The data connections identified and receiving (or ended since the last one came).
    pub fn flows(&self) -> Vec<Flow> {
        self.flows.lock().expect("poisoned").live.clone()
    }

    /// Bytes received on lane `lane`'s data connections, ended ones included (read under
    /// the one lock that moves an ended connection's bytes: [`FlowTable`]).
    pub fn lane_bytes(&self, lane: u32) -> u64 {
        self.flows.lock().expect("poisoned").lane_bytes(lane)
    }

    /// Adds `flow` to the list ([`FlowTable::add`]).
    fn add_flow(&self, flow: Flow) {
        self.flows.lock().expect("poisoned").add(flow);
    }

    /// The IPv4 address lane `lane`'s NIC has now (`ipv4`, at `now`) where the lane awaits
    /// one (`LaneSpec::awaits_nic_address`); `None` for another lane, or while the NIC has
    /// none or only a link-local one ([`crate::lanes::plan::dialable`]). Looked up at most
    /// once a [`NIC_LOOK_EVERY`], whichever source's session looks, and once a
    /// [`NIC_LOOK_SLOWLY`] after [`NIC_SLOW_AFTER`] without one; a change from what was last
    /// seen is logged once.
    fn nic_ip(&self, lane: &Lane, ipv4: Ipv4Lookup<'_>, now: Instant) -> Option<IpAddr> {
        let nic = (lane.spec.nic.as_deref()).filter(|_| lane.spec.awaits_nic_address)?;
        let mut seen = self.nic_ips.lock().expect("poisoned");
        let was = seen.get(&lane.id()).copied();
        if let Some(w) = was.filter(|w| !w.due(now)) {
            return w.ip.map(IpAddr::V4);
        }
        let found = ipv4(nic).unwrap_or_else(|e| {
            tracing::debug!(lane = lane.id(), %nic, error = %e, "cannot read the lane's NIC address");
            None
        });
        let ip = crate::lanes::plan::dialable(found);
        let none_since = match (ip, was) {
            (Some(_), _) => None,
            (None, Some(w)) if w.ip.is_none() => w.none_since,
            (None, _) => Some(now),
        };
        let looked = NicSeen {
            ip,
            at: now,
            none_since,
        };
        seen.insert(lane.id(), looked);
        drop(seen);
        match (was.and_then(|w| w.ip), ip) {
            (was, Some(ip)) if was != Some(ip) => tracing::info!(lane = lane.id(), %nic, %ip,
                "the lane's NIC has an IPv4 address now: sources dial the lane there from their next session (a session under way ends at a moment with nothing under way)"),
            (Some(was), None) => tracing::warn!(lane = lane.id(), %nic, %was, ?found,
                "the lane's NIC lost its IPv4 address: sources dial the lane at the control connection's address from their next session"),
            _ => {}
        }
        ip.map(IpAddr::V4)
    }

    /// The IPv4 address lane `lane`'s NIC has now where the lane awaits one (`nic_ip` on
    /// the host, looked up at most every few seconds): what sources are to dial the lane at,
    /// and what `/v1/status` shows it at ([`Lane::shown`]).
    pub fn lane_nic_ip(&self, lane: &Lane) -> Option<IpAddr> {
        self.nic_ip(lane, &shardwire_devmem::ifaddr::ipv4, Instant::now())
    }

    /// Makes every link reconnect (its data connections come back on the current path):
    /// the receive path changed, `reason` says how.
    pub fn reconnect_all(&self, reason: &str) {
        for l in self.roster.links() {
            l.kick(Kick::ReceiveChanged(reason.to_owned()));
        }
    }

    /// A connection accepted on a data listener, at `local` (its `getsockname`).
    fn accepted(&self, sock: TcpStream, peer: SocketAddr, local: SocketAddr) {
        let got =
            self.matcher
                .lock()
                .expect("poisoned")
                .accepted(peer, local, sock, Instant::now());
        match got {
            Accepted::Matched(sock, e) => self.start(sock, peer, e),
            Accepted::Held(None) => {}
            Accepted::Held(Some((old, _))) => self.unidentified(Unidentified::Evicted, peer, old),
            Accepted::Refused(_) => self.unidentified(Unidentified::Refused, peer, peer),
            Accepted::WrongLane(w) => self.wrong_lane(peer, w),
        }
    }

    /// Logs a `kind` line about a connection from `peer` (`dropped`: the one that went, the
    /// oldest for [`Unidentified::Evicted`], else `peer`'s own), at most once per kind and
    /// peer host every [`warn_limit::EVERY`]; `suppressed` counts the lines of that kind and
    /// host left out since the last one.
    fn unidentified(&self, kind: Unidentified, peer: SocketAddr, dropped: SocketAddr) {
        let host = matcher::host_of(peer.ip());
        let now = Instant::now();
        let Some(suppressed) = self.noise.lock().expect("poisoned").hit((kind, host), now) else {
            return;
        };
        let (host, every) = (matcher::host_name(host), warn_limit::EVERY.as_secs());
        match kind {
            Unidentified::Evicted => tracing::warn!(%peer, %host, %dropped, suppressed,
                limit = matcher::MAX_UNMATCHED,
                "too many unidentified data connections; dropped the oldest to hold this one (one such line per host every {every} s)"),
            Unidentified::Refused => tracing::warn!(%peer, %host, suppressed,
                limit = matcher::MAX_UNMATCHED_PER_IP,
                "too many unidentified data connections from this host; refusing this one (one such line per host every {every} s)"),
            Unidentified::Unannounced => tracing::warn!(%peer, %host, suppressed,
                "dropping a data connection that no authenticated source announced (one such line per host every {every} s)"),
        }
    }

    /// Says the lines about unidentified data connections left out in windows now over.
    fn say_left_out(&self) {
        let left: LeftOut<_> = self.noise.lock().expect("poisoned").flush(Instant::now());
        for ((kind, host), suppressed) in left.keys {
            let host = matcher::host_name(host);
            tracing::warn!(%host, suppressed, what = kind.what(),
                "lines about unidentified data connections from this host left out since its last such line");
        }
        if left.untracked > 0 {
            tracing::warn!(
                suppressed = left.untracked,
                hosts_tracked = warn_limit::MAX_KEYS,
                "lines about unidentified data connections from hosts past those tracked left out"
            );
        }
    }

    /// Refuses a connection announced for a lane that arrived on another address: counted on
    /// that lane, logged, closed, and the link's session ends (it cannot carry that lane's
    /// payloads; the next session dials again).
    fn wrong_lane(&self, peer: SocketAddr, w: WrongLane<TcpStream, Expected>) {
        if let Some(l) = self.lanes.get(u32::from(w.e.lane)) {
            l.stats.wrong_lane.fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(%peer, source = %w.e.link.addr, lane = w.e.lane, conn = w.e.conn,
            arrived_on = %w.local, lane_address = %w.want,
            "refusing a data connection that arrived on another address than its lane's (another NIC)");
        let _ = w.sock.shutdown(std::net::Shutdown::Both);
        let why = Kick::WrongLane {
            conn: w.e.conn,
            lane: w.e.lane,
            arrived_on: w.local,
            lane_addr: w.want,
        };
        w.e.link.kick_session(w.e.generation, why);
    }

    /// The receive settings of a connection of `lane`: its own lane's binding, never
    /// another's.
    fn setup(&self, lane: &Lane) -> Setup {
        // Counted under the lock `set_binding` takes to remove it: a delete then sees this
        // connection among the binding's readers, or the connection sees no binding.
        let (binding, reading) = self.binding_read(lane.id());
        Setup {
            _reading: reading,
            binding,
            gpus: Gpus::new(lane.cuda.iter().cloned().collect()),
            io_uring: self.io_uring,
            cpus: lane.cpus.clone().into(),
            misplace: self.take_misplace(lane.id()),
            fail_spawn: self
                .fault_spawn
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
        }
    }

    /// Starts the receiver of an identified connection.
    fn start(&self, sock: TcpStream, peer: SocketAddr, e: Expected) {
        let link = e.link;
        let Some(lane) = self.lanes.get(u32::from(e.lane)) else {
            tracing::error!(%peer, lane = e.lane, "data connection for a lane this node does not have");
            return;
        };
        if !link.attach_data(e.generation, &sock) {
            tracing::debug!(%peer, "data connection for a link generation that is gone");
            return;
        }
        tracing::debug!(%peer, source = %link.addr, lane = e.lane, conn = e.conn, "data connection identified");
        // Counted up only (a Prometheus counter, `_total`): a session that starts over counts
        // its connections again. The connections open now are the lane's live `flows`.
        lane.stats.data_connections.fetch_add(1, Ordering::Relaxed);
        self.ingress.spawn(lane, &sock, peer, &link.addr);
        let flow = Arc::new(FlowStats::default());
        self.add_flow(Flow {
            source: link.addr.clone(),
            lane: lane.id(),
            conn: e.conn,
            stats: Arc::clone(&flow),
        });
        let conn = Conn {
            link,
            lane: lane.id(),
            conn: e.conn,
            generation: e.generation,
            queue: e.queue,
            flow,
            counters: Arc::clone(&self.counters),
        };
        // The receiver sends `DataReady` once its path is set up.
        rx::spawn(conn, sock, self.setup(lane));
    }

    /// Drops the unannounced connections and the announcements that waited too long; the
    /// session of an announcement whose connection never came ends (it cannot carry that
    /// connection's payloads), and what was queued on it fails.
    fn sweep(&self) {
        let swept = self.matcher.lock().expect("poisoned").sweep(Instant::now());
        for (peer, _) in swept.accepted {
            self.unidentified(Unidentified::Unannounced, peer, peer);
        }
        self.say_left_out();
        self.ingress.say_left_out();
        for (addr, e) in swept.expected {
            let why = Kick::NeverArrived {
                conn: e.conn,
                addr,
                after: UNMATCHED_TIMEOUT,
            };
            tracing::warn!(source = %e.link.addr, lane = e.lane, %why, "ending the session of a source whose data connection never arrived");
            e.fail_queued(&why.to_string());
            e.link.kick_session(e.generation, why);
        }
    }
}

impl DataConns for DataPlane {
    fn announced(
        &self,
        link: &Arc<SourceLink>,
        a: Announcement,
        queue: std::sync::mpsc::Receiver<InFlight>,
    ) {
        let e = Expected {
            link: Arc::clone(link),
            lane: a.lane,
            conn: a.conn,
            generation: a.generation,
            queue,
        };
        let got = self
            .matcher
            .lock()
            .expect("poisoned")
            .expect(a.addr, a.want, e, Instant::now());
        match got {
            Announced::Matched(sock, e) => self.start(sock, a.addr, e),
            Announced::Waiting => {}
            Announced::WrongLane(w) => self.wrong_lane(a.addr, w),
            Announced::Duplicate(e) => {
                let why = Kick::DuplicateAnnouncement { addr: a.addr };
                tracing::error!(source = %e.link.addr, %why, "ending the source's session");
                e.link.kick_session(e.generation, why);
            }
        }
    }

    fn lane_ips(&self) -> Vec<Option<IpAddr>> {
        self.lanes
            .all()
            .iter()
            .map(|l| self.lane_nic_ip(l))
            .collect()
    }

    fn forget(&self, link: usize, generation: u64, reason: &str) {
        let gone = self
            .matcher
            .lock()
            .expect("poisoned")
            .forget(|e| e.link.index == link && e.generation == generation);
        for e in gone {
            e.fail_queued(reason);
        }
    }
}

/// Drops unannounced data connections and announcements whose connection never came, once
/// they waited too long, every second until shutdown.
pub async fn sweep_loop(plane: Arc<DataPlane>, mut shutdown: watch::Receiver<bool>) {
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = sweep.tick() => plane.sweep(),
        }
    }
}

/// Accepts data connections on one listener until shutdown.
pub async fn accept_loop(
    plane: Arc<DataPlane>,
    listener: tokio::net::TcpListener,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            r = listener.accept() => match r {
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    let taken = s.local_addr().and_then(|local| {
                        let s = s.into_std()?;
                        s.set_nonblocking(false)?;
                        Ok((s, local))
                    });
                    match taken {
                        Ok((s, local)) => plane.accepted(s, peer, local),
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

/// Moves the flows whose receiver has ended (nothing but `flows` holds their counters) out of
/// `flows`, adding their bytes to `ended` by lane.
fn prune_ended(flows: &mut Vec<Flow>, ended: &mut BTreeMap<u32, u64>) {
    flows.retain(|f| {
        let live = Arc::strong_count(&f.stats) > 1;
        if !live {
            *ended.entry(f.lane).or_default() += f.stats.bytes.load(Ordering::Relaxed);
        }
        live
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(lane: u32, bytes: u64) -> (Flow, Arc<FlowStats>) {
        let stats = Arc::new(FlowStats::default());
        stats.bytes.store(bytes, Ordering::Relaxed);
        let f = Flow {
            source: "a:1".into(),
            lane,
            conn: 0,
            stats: Arc::clone(&stats),
        };
        (f, stats)
    }

    #[test]
    fn ended_flows_leave_the_list_and_keep_their_bytes_in_their_lanes_total() {
        let (a, a_rx) = flow(0, 10);
        let (b, b_rx) = flow(1, 20);
        let (c, c_rx) = flow(0, 5);
        let mut flows = vec![a, b, c];
        let mut ended = BTreeMap::new();
        prune_ended(&mut flows, &mut ended);
        assert_eq!(flows.len(), 3, "every receiver still runs");
        drop((a_rx, c_rx));
        prune_ended(&mut flows, &mut ended);
        assert_eq!(flows.len(), 1);
        assert_eq!(flows[0].lane, 1);
        assert_eq!(ended.get(&0), Some(&15));
        drop(b_rx);
        prune_ended(&mut flows, &mut ended);
        assert!(flows.is_empty());
        assert_eq!((ended.get(&0), ended.get(&1)), (Some(&15), Some(&20)));
    }

    /// A plane with no source, lane or binding.
    fn bare_plane() -> DataPlane {
        plane_of(vec![])
    }

    /// A plane of `lanes`, with no source or binding.
    fn plane_of(lanes: Vec<Arc<Lane>>) -> DataPlane {
        let cfg = crate::link::LinkConfig {
            secret: None,
            lanes: vec![],
        };
        DataPlane::new(
            Arc::new(Roster::new(cfg)),
            Arc::new(Lanes::new(lanes, vec![])),
            (vec![], EmuHost::new()),
            Arc::new(Counters::default()),
            false,
        )
    }

    /// Lane `id` on NIC `nic`, on the wildcard, awaiting the NIC's address or not.
    fn lane_on(id: u32, nic: &str, awaits_nic_address: bool) -> Lane {
        let mut l = Arc::into_inner(crate::lanes::test_lane(id, None)).unwrap();
        l.spec.nic = Some(nic.into());
        l.spec.data_listen = "0.0.0.0:7401".parse().unwrap();
        l.spec.awaits_nic_address = awaits_nic_address;
        l.spec.warn = true;
        l.data_addr = "0.0.0.0:7401".parse().unwrap();
        l
    }

    /// A lane whose NIC had no address at start is told its NIC's address once the NIC has
    /// one (each source session asks), and loses it again with the NIC's. Before, the address
    /// planned at start (the wildcard) was all a session ever advertised. A lane that awaits
    /// no address is never looked up.
    #[test]
    fn a_lane_awaiting_its_nics_address_gets_it_once_the_nic_has_one() {
        let plane = bare_plane();
        let eth3 = Mutex::new(None);
        let asked = Mutex::new(Vec::new());
        let lookup =
            |nic: &str| -> Result<Option<Ipv4Addr>, shardwire_devmem::ifaddr::IfAddrError> {
                asked.lock().unwrap().push(nic.to_owned());
                Ok(*eth3.lock().unwrap())
            };
        let (awaits, planned) = (lane_on(3, "eth3", true), lane_on(2, "eth2", false));
        let t0 = Instant::now();
        assert_eq!(plane.nic_ip(&awaits, &lookup, t0), None, "no address yet");
        assert_eq!(plane.nic_ip(&planned, &lookup, t0), None);
        assert_eq!(
            *asked.lock().unwrap(),
            ["eth3"],
            "only the lane awaiting one"
        );
        *eth3.lock().unwrap() = Some(Ipv4Addr::new(10, 0, 3, 5));
        let t1 = t0 + NIC_LOOK_EVERY;
        let got = plane.nic_ip(&awaits, &lookup, t1);
        assert_eq!(got, Some(IpAddr::from([10, 0, 3, 5])));
        *eth3.lock().unwrap() = None;
        let t2 = t1 + NIC_LOOK_EVERY;
        assert_eq!(plane.nic_ip(&awaits, &lookup, t2), None, "the address went");
        // A plane without lanes has no address to say; through the host's own lookup, a
        // lane on lo awaiting its address has lo's.
        assert!(plane.lane_ips().is_empty());
        let lanes = vec![
            Arc::new(lane_on(0, "lo", true)),
            Arc::new(lane_on(1, "lo", false)),
        ];
        let on_lo = plane_of(lanes);
        assert_eq!(on_lo.lane_ips(), [Some(IpAddr::from([127, 0, 0, 1])), None]);
    }

    /// Every source's session looked the NIC up every 5 s for the node's whole life, and a
    /// link-local address (IPv4LL while DHCP is late: 169.254/16) was taken as the NIC's, so
    /// sources were moved to an address they cannot dial. Now one lookup answers every link
    /// for [`NIC_LOOK_EVERY`], a NIC with none for [`NIC_SLOW_AFTER`] (an IPv6-only NIC) is
    /// looked up once a [`NIC_LOOK_SLOWLY`], and a link-local address counts as none.
    #[test]
    fn a_nics_address_is_looked_up_once_for_every_link_and_slowly_when_it_has_none() {
        let plane = bare_plane();
        let eth3 = Mutex::new(None);
        let looked = std::sync::atomic::AtomicUsize::new(0);
        let lookup = |_: &str| -> Result<Option<Ipv4Addr>, shardwire_devmem::ifaddr::IfAddrError> {
            looked.fetch_add(1, Ordering::Relaxed);
            Ok(*eth3.lock().unwrap())
        };
        let looks = || looked.load(Ordering::Relaxed);
        let awaits = lane_on(3, "eth3", true);
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        for link in 0..8u32 {
            let at = t0 + second * link;
            assert_eq!(plane.nic_ip(&awaits, &lookup, at), None);
        }
        assert_eq!(looks(), 2, "one lookup per 5 s for 8 links' looks over 8 s");
        *eth3.lock().unwrap() = Some(Ipv4Addr::new(169, 254, 3, 5));
        assert_eq!(
            plane.nic_ip(&awaits, &lookup, t0 + NIC_LOOK_EVERY * 2),
            None
        );
        assert_eq!(looks(), 3, "a link-local address is no address");
        // No address for 10 minutes: from then on, one lookup a minute.
        let slow = t0 + NIC_SLOW_AFTER;
        assert_eq!(plane.nic_ip(&awaits, &lookup, slow), None);
        assert_eq!(looks(), 4);
        *eth3.lock().unwrap() = Some(Ipv4Addr::new(10, 0, 3, 5));
        let soon = slow + NIC_LOOK_SLOWLY - second;
        assert_eq!(
            plane.nic_ip(&awaits, &lookup, soon),
            None,
            "not looked up yet"
        );
        assert_eq!(looks(), 4);
        let got = plane.nic_ip(&awaits, &lookup, slow + NIC_LOOK_SLOWLY);
        assert_eq!(got, Some(IpAddr::from([10, 0, 3, 5])));
        // With an address, every 5 s again.
        let then = slow + NIC_LOOK_SLOWLY + NIC_LOOK_EVERY;
        assert_eq!(plane.nic_ip(&awaits, &lookup, then), got);
        assert_eq!(looks(), 6);
    }

    /// A lane's total while its connections end and new ones come (each new one moves the
    /// ended ones' bytes to the lane's total): flow `k` of a lane carries 2^k bytes, so every
    /// true total is 2^m - 1 and a flow counted twice shows as another pattern. Before, the
    /// live sum and the ended total were read under two locks, and a flow moved between the
    /// two reads counted in both (a race: this catches it when the threads meet there).
    #[test]
    fn a_flow_that_ends_while_its_lane_is_summed_counts_once() {
        use std::sync::atomic::{AtomicBool, AtomicU32};
        const LANES: u32 = 200;
        let plane = Arc::new(bare_plane());
        let (stop, on) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU32::new(0)),
        );
        let reader = {
            let (plane, stop, on) = (Arc::clone(&plane), Arc::clone(&stop), Arc::clone(&on));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let lane = on.load(Ordering::Relaxed);
                    let v = plane.lane_bytes(lane);
                    assert!((v + 1).is_power_of_two(), "lane {lane}: {v:#b}");
                }
            })
        };
        for lane in 0..LANES {
            on.store(lane, Ordering::Relaxed);
            for k in 0..63 {
                let (f, stats) = flow(lane, 0);
                plane.add_flow(f);
                stats.bytes.store(1 << k, Ordering::Relaxed);
            }
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().expect("no lane total counted a flow twice");
        for lane in 0..LANES {
            assert_eq!(plane.lane_bytes(lane), u64::MAX >> 1, "lane {lane}");
        }
        assert_eq!(
            plane.flows().len(),
            1,
            "the last flow, ended, stays listed until a new one prunes it"
        );
    }
}
