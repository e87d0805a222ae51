//! The node as its fronts see it. Trainer fronts (the Unix socket here, the HTTP API in the
//! binary) open, find, list and close streams and then talk to the [`Stream`] alone; the admin
//! front reads [`Status`] and sends [`Control`] messages, which one task applies in order.
//!
//! Inside, the node is split by job: [`Info`] (configuration, probes, mode and reason),
//! [`Admission`] (open streams and each lane's memory budget, under one lock) and the
//! [`DataPlane`] (links, lanes, matcher, RX bindings). A stream goes to the lane of the GPU
//! its trainer names, else to the least loaded lane a connected source of its dataset reaches
//! (a lane that every such source left out of its session is refused or passed over). The RX
//! bindings, one per lane at most, are in [`bindings`].

mod bindings;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use shardwire_config::ReceiveMode;
use shardwire_gpu::Region;
use shardwire_protocol::Manifest;
use shardwire_protocol::trainer::{ErrorCode, GpuRef, LaneRef, MemoryKind, StreamRequest};
use tokio::sync::{Notify, mpsc, oneshot};
use tracing::Instrument;

use crate::admission::{Admission, AdmitError, Reservation};
use crate::control::{Control, ControlError, Reply};
use crate::counters::Counters;
use crate::info::Info;
use crate::lanes::Lane;
use crate::plane::{DataPlane, Flow};
use crate::roster::Member;
use crate::status::{LaneStatus, Mode, PoolStatus, SourceStatus, Status};
use crate::stream::kind::Kind;
use crate::stream::{
    CloseReason, DatasetSource, OpenError, Parts, Routing, Stream, batcher, fetcher, manifests,
    open, open_mix, route, supervise,
};

/// A control message and where its answer goes.
pub(crate) type ControlRequest = (Control, oneshot::Sender<Result<Reply, ControlError>>);

/// A running node.
pub struct Node {
    info: Info,
    admission: Admission<Stream>,
    plane: Arc<DataPlane>,
    routing: Arc<Routing>,
    counters: Arc<Counters>,
    ids: Arc<AtomicU64>,
    control: mpsc::UnboundedSender<ControlRequest>,
    rt: tokio::runtime::Handle,
    drain_requested: Notify,
}

impl Node {
    /// A node over these parts; the returned receiver takes its control messages.
    pub(crate) fn new(
        info: Info,
        plane: Arc<DataPlane>,
        counters: Arc<Counters>,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<ControlRequest>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let pools = vec![info.cfg.pool_size.0; plane.lanes.all().len()];
        let units = plane.lanes.all().iter();
        let units = units.map(|l| l.cuda.as_ref().map_or(1, |c| c.region_unit));
        let admission = Admission::new(pools).with_units(units.collect());
        let stream = info.cfg.stream_memory();
        for (lane, need) in admission.never_fits(stream) {
            tracing::warn!(lane, pool_size = %info.cfg.pool_size, "lane {lane}'s GPU memory comes in allocation units: a stream's {stream} bytes (stream_memory) take {need}, more than pool_size, so it admits no stream; make pool_size a multiple of the unit of at least {need}");
        }
        let node = Arc::new(Self {
            admission,
            info,
            routing: Routing::new(Arc::clone(&plane.roster)),
            plane,
            counters,
            ids: Arc::new(AtomicU64::new(first_id())),
            control: tx,
            rt: tokio::runtime::Handle::current(),
            drain_requested: Notify::new(),
        });
        (node, rx)
    }

    /// Configuration, probes and mode.
    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The data path's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A fresh id for streams, leases and requests: never one of this node's earlier runs
    /// ([`first_id`]).
    pub fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The receive path in effect (`auto` resolved).
    pub fn receive(&self) -> ReceiveMode {
        self.plane.receive()
    }

    /// Every data connection identified so far, with its counters.
    pub fn flows(&self) -> Vec<Flow> {
        self.plane.flows()
    }

    /// (sources ready, sources connected, sources known, draining). A source is ready once
    /// its session is up and every data connection of it is ready
    /// ([`crate::link::SourceLink::is_ready`]): not while it dials, nor while it left a lane
    /// out (could not dial it); connected once its session is up, ready or not. Both are
    /// counted in one pass, ready only among the connected: a link that goes down meanwhile
    /// cannot make ready exceed connected (`/readyz` "ready: 1/1 ... (0 connected)").
    pub fn readiness(&self) -> (usize, usize, usize, bool) {
        let links = self.plane.roster.links();
        let (mut ready, mut connected) = (0, 0);
        for l in &links {
            if l.is_up() {
                connected += 1;
                ready += usize::from(l.is_ready());
            }
        }
        (ready, connected, links.len(), self.admission.draining())
    }

    /// Woken when a drain is requested over the admin API.
    pub fn drain_requested(&self) -> &Notify {
        &self.drain_requested
    }

    pub(crate) fn plane(&self) -> &Arc<DataPlane> {
        &self.plane
    }

    // --- streams -----------------------------------------------------------------------

    /// The lane a stream reading `sources` goes to, with its memory reserved there: its
    /// trainer's GPU's lane, else the least loaded (chosen and reserved at once, so streams
    /// opened together spread) of those its sources reach ([`route::reserve_reached`]), of
    /// either memory kind. Its sources are those its fetches may go to ([`Node::serving`]).
    /// While they are connected but none reaches the GPU's lane (each left it out of its
    /// session), the stream is refused `unavailable` (retryable): its fetches would wait there.
    fn place(
        &self,
        device: Option<&str>,
        bytes: u64,
        sources: &[DatasetSource],
    ) -> Result<(Arc<Lane>, Reservation<'_, Stream>), OpenError> {
        let lanes = &self.plane.lanes;
        let serving = self.serving(sources);
        let reached = route::lanes_reached(&serving, lanes.all().len());
        let reservation = match device {
            Some(d) => {
                let lane = lanes
                    .by_device(d)
                    .map_err(|e| OpenError::new(ErrorCode::UnknownDevice, e.to_string()))?;
                if reached.as_ref().and_then(|r| r.get(lane.id() as usize)) == Some(&false) {
                    let detail = format!("device {d} is on that lane");
                    return Err(self.unreached(&serving, lane, &detail));
                }
                self.admission.reserve(lane.id(), bytes).map_err(refused)?
            }
            None => route::reserve_reached(&self.admission, bytes, reached.as_deref())
                .map_err(|e| self.unplaced(e, &serving))?,
        };
        let lane = lanes
            .get(reservation.lane())
            .ok_or_else(|| OpenError::new(ErrorCode::Internal, "the node has no lane"))?;
        Ok((Arc::clone(lane), reservation))
    }

    /// Per dataset version a new stream reads (`sources`), the sources its fetches may go to:
    /// its [`route::members`] (serving that version, taking new fetches), as fetch routing
    /// chooses among them.
    fn serving<'a>(&self, sources: &'a [DatasetSource]) -> Vec<route::Serving<'a>> {
        let next_id = || self.next_id();
        let serving = sources.iter().map(|s| {
            let v = route::Version {
                dataset: &s.dataset,
                digest: &s.digest,
            };
            (
                s.dataset.as_str(),
                self.routing.placing_members(v, &next_id),
            )
        });
        serving.collect()
    }

    /// Why [`route::reserve_reached`] placed no stream reading from `serving`, as the trainer
    /// is told.
    fn unplaced(&self, e: route::Unplaced, serving: &[route::Serving<'_>]) -> OpenError {
        let (lane, full) = match e {
            route::Unplaced::Refused(e) => return refused(e),
            route::Unplaced::Unreached { lane, full } => (lane, full),
        };
        let Some(lane) = self.plane.lanes.get(lane) else {
            return OpenError::new(ErrorCode::Internal, "the node has no lane");
        };
        let detail = if full {
            "the other lanes its sources reach have no room left"
        } else {
            "nor do they reach any other lane"
        };
        self.unreached(serving, lane, detail)
    }

    /// `unavailable` (retryable): no connected source of a dataset the stream reads
    /// (`serving`) reaches `lane` ([`route::unreached_lane`]), named at the address its
    /// sources dial now (its NIC's, once a lane that awaited it moved there).
    fn unreached(&self, serving: &[route::Serving<'_>], lane: &Lane, detail: &str) -> OpenError {
        let (addr, _, _) = lane.shown(self.plane.lane_nic_ip(lane));
        let why = route::unreached_lane(serving, lane.id() as u16, addr, detail);
        OpenError::new(ErrorCode::Unavailable, why)
    }

    /// Whether the stream's lane has GPU memory: its device's lane, else the node's least
    /// loaded lane (before anything is reserved).
    fn lane_memory(&self, device: Option<&str>) -> Result<bool, OpenError> {
        let lanes = &self.plane.lanes;
        let lane = match device {
            Some(d) => lanes
                .by_device(d)
                .map_err(|e| OpenError::new(ErrorCode::UnknownDevice, e.to_string()))?,
            None => lanes
                .get(self.admission.least_loaded())
                .ok_or_else(|| OpenError::new(ErrorCode::Internal, "the node has no lane"))?,
        };
        Ok(lane.cuda.is_some())
    }

    /// Opens a stream whose region stays in the node (the HTTP API): request checks, its lane,
    /// manifests, plan, resume check, memory reservation on the lane, region on the lane's GPU
    /// (or NUMA node), fetcher.
    pub async fn open_stream(self: &Arc<Self>, r: StreamRequest) -> Result<Arc<Stream>, OpenError> {
        self.open_stream_as(r, false).await
    }

    /// [`Node::open_stream`]; `mapped`: a trainer will map its region (the socket's), so the
    /// stream is marked so before it is listed.
    async fn open_stream_as(
        self: &Arc<Self>,
        r: StreamRequest,
        mapped: bool,
    ) -> Result<Arc<Stream>, OpenError> {
        open::check_request(&r)?;
        if self.admission.draining() {
            return Err(OpenError::new(
                ErrorCode::Draining,
                AdmitError::Draining.to_string(),
            ));
        }
        let region_bytes = self.info.cfg.stream_memory();
        // Plan first (the manifest may take a while), reserve after: no pool budget is held
        // while the sources are asked, and a drain that began meanwhile refuses the stream.
        let cuda = self.lane_memory(r.device.as_deref())?;
        let parts = self.manifests_for(&r).await?;
        let mut planned = plan_stream(&r, &parts, region_bytes, cuda)?;
        let per_epoch = planned.2.0.per_epoch();
        // A batch-mode stream indexes the rank's samples too (position x batch_size).
        let per_position = match &planned.2.0 {
            Kind::Batches(m) => u64::from(m.batch_size()),
            Kind::Shards(_) => 1,
        };
        open::check_index_fits(per_epoch, per_position, r.epochs)?;
        let (lane, reservation) = self.place(r.device.as_deref(), region_bytes, &planned.1)?;
        if lane.cuda.is_some() != cuda {
            // Lanes of both memory kinds and the stream's lane (the least loaded, or the one it
            // was moved to: [`route::reserve_reached`]) is the other kind: plan for it (from the
            // same manifests: only the kind and layout depend on the memory).
            planned = plan_stream(&r, &parts, region_bytes, !cuda)?;
        }
        let (manifest, sources, (kind, start, fingerprint)) = planned;
        let id = self.next_id();
        let region = open::region(id, region_bytes, lane.cuda.as_deref())?;
        if let (Some(host), Some(node)) = (region.host(), lane.numa_bind) {
            // Checked at start: the kernel takes it for this lane; a failure now is logged.
            if let Err(e) = host.prefer_numa_node(node) {
                tracing::warn!(stream = id, lane = lane.id(), error = %e, "cannot place the stream's region on its lane's NUMA node");
            }
        }
        let (rank, world_size, seed) = kind.who();
        let batches = matches!(kind, Kind::Batches(_));
        let s = Stream::new(Parts {
            id,
            dataset: display_name(&r),
            kind,
            epochs: r.epochs,
            start,
            manifest,
            pool: shardwire_gpu::SlabPool::new(region),
            sources,
            routing: Arc::clone(&self.routing),
            fingerprint,
            counters: Arc::clone(&self.counters),
            ids: Arc::clone(&self.ids),
            gpu: lane.cuda.clone(),
            lane: lane.id(),
        });
        if mapped {
            // Before it is listed: a close that finds it listed (DELETE, a drain's close_all)
            // then keeps its budget until its trainer goes ([`Node::trainer_left`]).
            s.mark_mapped();
        }
        reservation.commit(id, Arc::clone(&s));
        let span = tracing::info_span!("stream", id, dataset = %s.dataset(), rank, world_size);
        let task = match batches {
            false => self
                .rt
                .spawn(fetcher::run(Arc::clone(&s), start).instrument(span)),
            true => self
                .rt
                .spawn(batcher::run(Arc::clone(&s), start).instrument(span)),
        };
        self.rt.spawn(supervise::supervise(task, Arc::clone(&s)));
        tracing::info!(stream = id, lane = lane.id(), device = r.device.as_deref().unwrap_or("-"), dataset = %s.dataset(), seed, rank, world_size, epochs = r.epochs,
            batch_size = r.batch_size, start, "stream opened");
        Ok(s)
    }

    /// The manifests `r` is planned from, each with its dataset's name: its dataset's, or
    /// each mixture part's in mix order (asked [`manifests::AT_ONCE`] at a time,
    /// [`manifests::manifests_of`]).
    async fn manifests_for(&self, r: &StreamRequest) -> Result<Vec<Part>, OpenError> {
        let names: Vec<&str> = match (&r.mix, r.batch_size) {
            (Some(mix), Some(_)) => mix.iter().map(|e| e.dataset.as_str()).collect(),
            _ => vec![r.dataset.as_str()],
        };
        let roster = &self.plane.roster;
        let got = manifests::manifests_of(roster, &names, &|| self.next_id()).await?;
        Ok(names.into_iter().map(String::from).zip(got).collect())
    }

    /// [`Node::open_stream`] from a thread outside the runtime (the trainer socket, whose trainer
    /// maps the region: the stream is marked mapped before it is listed, and from then on only
    /// [`Node::trainer_left`] returns its budget): the open runs as a task and this thread
    /// waits for its answer.
    pub fn open_stream_from_thread(
        self: &Arc<Self>,
        r: StreamRequest,
    ) -> Result<Arc<Stream>, OpenError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let node = Arc::clone(self);
        self.rt.spawn(async move {
            let _ = tx.send(node.open_stream_as(r, true).await);
        });
        rx.recv()
            .unwrap_or_else(|_| Err(OpenError::new(ErrorCode::Internal, "the node stopped")))
    }

    /// Stream `id`, if open.
    pub fn stream(&self, id: u64) -> Option<Arc<Stream>> {
        self.admission.get(id)
    }

    /// The open streams, by id.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.admission.list().into_iter().map(|(_, s)| s).collect()
    }

    /// Closes stream `id`: its leases end and the fetches it has queued at sources are
    /// cancelled. Its memory budget returns now, unless a trainer maps its region (the
    /// socket's): that memory is the trainer's until it goes, so the stream stays listed,
    /// closed, and holds its budget until [`Node::trainer_left`]. False if it is not listed
    /// (closing twice is harmless).
    pub fn close_stream(&self, id: u64, reason: CloseReason) -> bool {
        let Some(s) = self.admission.get(id) else {
            return false;
        };
        if !s.mapped() {
            if self.admission.remove(id).is_none() {
                return false; // closed meanwhile
            }
        } else if s.is_closed() {
            return true;
        }
        self.end(&s, reason);
        true
    }

    /// The trainer that mapped stream `id`'s region went: the stream closes, if it was still
    /// open, and its memory budget returns.
    pub fn trainer_left(&self, id: u64) {
        if let Some(s) = self.admission.remove(id)
            && !s.is_closed()
        {
            self.end(&s, CloseReason::TrainerDisconnected);
        }
    }

    /// Closes `s` and cancels its fetches.
    fn end(&self, s: &Stream, reason: CloseReason) {
        let why = reason.to_string();
        s.close(reason);
        // Fetches not yet on the wire are dropped at the source; the ones already announced
        // arrive and are discarded.
        let cancelled: usize = s.links().iter().map(|l| l.cancel_stream(s.id())).sum();
        tracing::info!(stream = s.id(), reason = %why, cancelled, "stream closed");
    }

    /// Closes every stream (shutdown).
    pub(crate) fn close_all(&self, reason: &CloseReason) {
        for s in self.streams() {
            self.close_stream(s.id(), reason.clone());
        }
    }

    /// The device of stream `s`'s CUDA region, for the `attached` message.
    pub fn gpu_ref(&self, s: &Stream, region: &Region) -> Option<GpuRef> {
        let gpu = self.plane.cuda(s.lane())?;
        let cuda = region.cuda()?;
        Some(GpuRef {
            ordinal: gpu.info.ordinal,
            pci_bus_id: gpu.info.pci_bus_id.clone(),
            granularity: cuda.granularity() as u64,
        })
    }

    /// The node's lanes as trainers see them (`info`).
    pub fn lane_refs(&self) -> Vec<LaneRef> {
        self.plane
            .lanes
            .all()
            .iter()
            .map(|l| LaneRef {
                lane: l.id(),
                gpu: l.spec.gpu.as_ref().map(|g| g.pci.to_string()),
                uuid: l
                    .spec
                    .gpu
                    .as_ref()
                    .and_then(|g| g.uuid)
                    .map(|u| u.to_string()),
            })
            .collect()
    }

    // --- admin -------------------------------------------------------------------------

    /// Refuses new streams from now on (`/readyz` says draining), and binding changes the
    /// control task has not begun; the streams still open. Direct, not a control message:
    /// new streams are refused at once, even behind an admin change under way.
    pub(crate) fn start_draining(&self) -> usize {
        self.admission.start_draining()
    }

    /// Sends an admin change to the control task and waits for its answer.
    pub async fn control(&self, c: Control) -> Result<Reply, ControlError> {
        let (tx, rx) = oneshot::channel();
        self.control
            .send((c, tx))
            .map_err(|_| ControlError::ShuttingDown)?;
        rx.await.unwrap_or(Err(ControlError::ShuttingDown))
    }

    /// Applies one admin change (the control task calls this, one at a time).
    pub(crate) async fn apply(self: &Arc<Self>, c: Control) -> Result<Reply, ControlError> {
        let binding_change = matches!(c, Control::CreateBinding(_) | Control::DeleteBinding { .. });
        if binding_change && self.admission.draining() {
            return Err(ControlError::Draining);
        }
        match c {
            Control::CreateBinding(spec) => Ok(Reply::Binding(self.create_binding(spec).await?)),
            Control::DeleteBinding { id } => self.delete_binding(&id).await,
            Control::Drain => {
                let streams_open = self.start_draining();
                self.drain_requested.notify_one();
                let timeout_secs = self.info.cfg.drain_timeout_secs;
                Ok(Reply::Draining {
                    streams_open,
                    timeout_secs,
                })
            }
            Control::CloseStream { id, reason } => match self.close_stream(id, reason) {
                true => Ok(Reply::Closed { id }),
                false => Err(ControlError::NoStream(id)),
            },
        }
    }

    /// The `/v1/status` document.
    pub fn status(&self) -> Status {
        let cfg = &self.info.cfg;
        let sources = self
            .plane
            .roster
            .snapshot()
            .iter()
            .map(source_status)
            .collect();
        // Lane 0's address as its lane shows it (moved to its NIC's address, once it has one).
        let lanes = self.lane_statuses();
        Status {
            version: env!("CARGO_PKG_VERSION"),
            mode: Mode {
                receive: self.receive().to_string(),
                memory: self.info.memory,
                reason: self.info.mode_reason(),
            },
            devmem: self.binding_statuses().into_iter().next(),
            draining: self.admission.draining(),
            nics: self.info.nics.clone(),
            gpus: self.info.gpus.clone(),
            data_addr: lanes
                .first()
                .map_or_else(|| self.info.data_addr.to_string(), |l| l.data_addr.clone()),
            lanes,
            lanes_excluded: self.plane.lanes.excluded().to_vec(),
            socket: cfg.socket.clone(),
            pool: PoolStatus {
                size: cfg.pool_size.0,
                reserved: self.admission.usage().1,
                stream_memory: cfg.stream_memory(),
            },
            sources,
            discovery: self.plane.roster.resolutions(),
            streams: self.streams().iter().map(|s| s.info()).collect(),
            counters: self.counters.snapshot(),
        }
    }
}

impl Node {
    /// Every lane's status.
    fn lane_statuses(&self) -> Vec<LaneStatus> {
        self.plane
            .lanes
            .all()
            .iter()
            .map(|l| {
                let (streams, pool_reserved, pool_size) = self.admission.lane_usage(l.id());
                let bytes = self.plane.lane_bytes(l.id());
                let spec = &l.spec;
                // A lane that awaited its NIC's address is shown there once the NIC has one.
                let (data_addr, why, warn) = l.shown(self.plane.lane_nic_ip(l));
                LaneStatus {
                    lane: l.id(),
                    gpu: spec.gpu.as_ref().map(|g| g.pci.to_string()),
                    uuid: spec
                        .gpu
                        .as_ref()
                        .and_then(|g| g.uuid)
                        .map(|u| u.to_string()),
                    nic: spec.nic.clone(),
                    nic_pci: spec.nic_pci.map(|p| p.to_string()),
                    distance: spec.distance.map(|d| d.to_string()),
                    numa_node: spec.numa_node,
                    data_addr: data_addr.to_string(),
                    memory: if l.cuda.is_some() {
                        MemoryKind::Cuda
                    } else {
                        MemoryKind::Host
                    },
                    cpus: shardwire_topology::format_ranges(&l.cpus),
                    queues: spec.queues.clone(),
                    devmem_memory: spec.devmem_memory,
                    devmem: self.plane.binding(l.id()).is_some(),
                    binding: self.binding_status(l.id()),
                    streams,
                    pool_reserved,
                    pool_size,
                    bytes_received: bytes,
                    data_connections: l.stats.data_connections.load(Ordering::Relaxed),
                    data_connections_refused: l.stats.wrong_lane.load(Ordering::Relaxed),
                    data_connections_on_nic: l.stats.on_nic.load(Ordering::Relaxed),
                    data_connections_wrong_nic: l.stats.wrong_nic.load(Ordering::Relaxed),
                    data_connections_nic_unknown: l.stats.nic_unknown.load(Ordering::Relaxed),
                    why,
                    warn,
                    notes: l.notes.clone(),
                }
            })
            .collect()
    }
}

/// The first id of this node run: random below 2^52 (exact in every JSON reader), so that a
/// trainer's stream or lease id from before a restart names nothing of this run. Ids counted
/// from 1 again after a restart: a trainer that reopened after one and then dropped its old
/// handle closed its own new stream (or another trainer's) with the old handle's `close`.
fn first_id() -> u64 {
    let mut b = [0u8; 4];
    let random = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    let seed = match random {
        Ok(4) => u32::from_le_bytes(b),
        // No random bytes (a kernel without getrandom): the clock's nanoseconds.
        _ => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.subsec_nanos() ^ d.as_secs() as u32),
    };
    // 2^21 ids to a slot: a run uses millions of ids; its range and another run's meet only
    // if their random slots fall within that many of each other.
    u64::from(seed >> 1).max(1) << 21
}

fn source_status(m: &Member) -> SourceStatus {
    let l = &m.link;
    SourceStatus {
        link: l.index,
        addr: l.addr.clone(),
        found_by: m.found_by.clone(),
        up: l.is_up(),
        state: l.state_name(),
        fetches: l.fetches.load(Ordering::Relaxed),
        outstanding: l.outstanding(),
        in_flight: l.in_flight(),
        cancels_sent: l.cancels.sent.load(Ordering::Relaxed),
        cancelled: l.cancels.confirmed.load(Ordering::Relaxed),
        bytes_received: l.bytes.load(Ordering::Relaxed),
        last_error: l
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    }
}

/// The error a trainer gets when admission refuses its stream.
fn refused(e: AdmitError) -> OpenError {
    let code = match e {
        AdmitError::Draining => ErrorCode::Draining,
        AdmitError::Exhausted { .. } => ErrorCode::NoMemory,
    };
    OpenError::new(code, e.to_string())
}

/// A dataset's name and its manifest.
type Part = (String, Arc<Manifest>);

/// What [`plan_stream`] gives: the manifest, the datasets its shards come from, and the plan
/// (its kind, the start position and the resume fingerprint).
type Planned = (Arc<Manifest>, Vec<DatasetSource>, (Kind, u64, String));

/// The manifest, the datasets its shards come from and the opened plan of `r`, from the
/// manifests of its `parts` ([`Node::manifests_for`]): one dataset (shard or batch mode), or a
/// mixture over the combined manifest of its parts.
fn plan_stream(
    r: &StreamRequest,
    parts: &[Part],
    region_bytes: u64,
    cuda: bool,
) -> Result<Planned, OpenError> {
    let mut sources = Vec::with_capacity(parts.len());
    let mut first = 0u32;
    for (dataset, m) in parts {
        sources.push(DatasetSource {
            dataset: dataset.clone(),
            first,
            shards: m.shards.len() as u32,
            digest: m.digest.clone(),
        });
        first += m.shards.len() as u32;
    }
    Ok(match (&r.mix, r.batch_size, parts) {
        (Some(_), Some(b), _) => {
            let named: Vec<(&str, &Manifest)> = parts
                .iter()
                .map(|(n, m)| (n.as_str(), m.as_ref()))
                .collect();
            let combined = Manifest::mixture(&named);
            let opened = open_mix::mix_mode(parts, &combined, r, b, region_bytes, cuda)?;
            (Arc::new(combined), sources, opened)
        }
        (_, batch, [(_, manifest)]) => {
            let opened = match batch {
                None => open::shard_mode(manifest, r, region_bytes)?,
                Some(b) => open::batch_mode(manifest, r, b, region_bytes, cuda)?,
            };
            (Arc::clone(manifest), sources, opened)
        }
        _ => {
            let why = format!("{} manifests for one dataset", parts.len());
            return Err(OpenError::new(ErrorCode::Internal, why));
        }
    })
}

/// The name a stream shows: its dataset, or a mixture's `web+code`.
fn display_name(r: &StreamRequest) -> String {
    match &r.mix {
        Some(mix) => mix
            .iter()
            .map(|e| e.dataset.as_str())
            .collect::<Vec<_>>()
            .join("+"),
        None => r.dataset.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::first_id;

    #[test]
    fn each_run_counts_ids_from_its_own_random_start_below_two_to_the_53() {
        // Before: every run counted from 1, so a restarted node gave a reopened stream the
        // id of a stream of its last run.
        let starts: Vec<u64> = (0..4).map(|_| first_id()).collect();
        for &s in &starts {
            assert!((1 << 21..1 << 52).contains(&s), "{s}");
        }
        let mut distinct = starts.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 1, "{starts:?}");
    }
}
