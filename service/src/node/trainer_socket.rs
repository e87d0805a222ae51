//! The trainer Unix socket (docs/TRAINER_API.md): one thread per trainer connection, one
//! stream per connection. `attach` opens the stream and passes its region fd with
//! SCM_RIGHTS; `next` leases the next batch in plan order; `release` ends a lease. A
//! disconnect closes the stream and releases every lease. A malformed frame gets an error
//! reply and drops that connection only.

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_client::fdpass::{self, FrameIoError, ReadLimits, ReadPhase};
use shardwire_protocol::Manifest;
use shardwire_protocol::plan::PlanSpec;
use shardwire_protocol::trainer::{self, Request, Response, TRAINER_VERSION};
use tokio::sync::watch;
use tracing::Instrument;

use super::Node;
use super::stream::{Next, StreamParams, StreamShared};

/// Binds the socket (replacing a stale file) and starts the accept thread.
pub fn start(node: Arc<Node>, path: &Path, shutdown: watch::Receiver<bool>) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed a stale trainer socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    let mode = node.cfg.socket_mode_bits().map_err(std::io::Error::other)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    std::thread::Builder::new()
        .name("sw-trainer-accept".into())
        .spawn(move || accept_loop(&node, &listener, &shutdown))?;
    Ok(())
}

/// One thread per trainer connection, at most `trainer_max_connections` at once; a
/// connection over the limit is refused with an error frame naming the limit.
fn accept_loop(node: &Arc<Node>, listener: &UnixListener, shutdown: &watch::Receiver<bool>) {
    let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let max = node.cfg.trainer_max_connections;
    for conn in listener.incoming() {
        if *shutdown.borrow() {
            return;
        }
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "trainer accept failed");
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= max {
            active.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("shardwire_trainer_refused_total", "reason" => "connections")
                .increment(1);
            tracing::warn!(
                limit = max,
                "trainer refused: trainer_max_connections reached"
            );
            let msg = format!(
                "this node serves at most {max} trainer connections at once (trainer_max_connections)"
            );
            let _ = reply(&s, &error("too_many_connections", msg), &[]);
            continue; // dropping `s` closes it; the trainer reads the refusal first
        }
        let (node, active) = (Arc::clone(node), Arc::clone(&active));
        let spawned = std::thread::Builder::new()
            .name("sw-trainer".into())
            .spawn(move || {
                serve(&node, s);
                active.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a trainer thread");
        }
    }
}

fn reply(
    sock: &UnixStream,
    r: &Response,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), FrameIoError> {
    send(sock, &mut Vec::with_capacity(256), r, fds)
}

/// Encodes `r` into `frame` (cleared first) and sends it in one write.
fn send(
    sock: &UnixStream,
    frame: &mut Vec<u8>,
    r: &Response,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), FrameIoError> {
    frame.clear();
    r.encode(frame);
    fdpass::send_frame(sock, frame, fds)
}

fn error(code: &str, message: impl Into<String>) -> Response {
    Response::Error {
        code: code.into(),
        message: message.into(),
    }
}

/// After refusing a trainer: stop writing and read (and drop) what it sends until it closes,
/// for up to 2 s. Closing at once would make the trainer's first write fail with EPIPE
/// before it reads the refusal; this way it reads the error frame.
fn linger_for_the_request(sock: &UnixStream) {
    use std::io::Read;
    let _ = sock.shutdown(std::net::Shutdown::Write);
    let _ = sock.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut sink = [0u8; 4096];
    while matches!((&*sock).read(&mut sink), Ok(n) if n > 0) {}
}

fn serve(node: &Arc<Node>, sock: UnixStream) {
    match rustix::net::sockopt::socket_peercred(&sock) {
        Ok(cred) => {
            let (uid, gid) = (cred.uid.as_raw(), cred.gid.as_raw());
            if !node.cfg.peer_allowed(uid, gid) {
                tracing::warn!(
                    uid,
                    gid,
                    pid = cred.pid.as_raw_nonzero().get(),
                    "trainer refused: uid/gid not in allowed_uids/allowed_gids"
                );
                let msg = format!(
                    "uid {uid} / gid {gid} is not allowed to use this node (allowed_uids, allowed_gids)"
                );
                let _ = reply(&sock, &error("forbidden", msg), &[]);
                metrics::counter!("shardwire_trainer_refused_total", "reason" => "peer")
                    .increment(1);
                linger_for_the_request(&sock);
                return;
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "SO_PEERCRED failed; refusing the trainer");
            return;
        }
    }
    // Registered once per connection: recording on a handle is a few atomic adds.
    let next_latency =
        metrics::histogram!("shardwire_trainer_next_duration_seconds", "api" => "socket");
    let mut reader = fdpass::FrameReader::new();
    let mut frame = Vec::with_capacity(256);
    // Work that can wait until the answer is out (the trainer is then busy with it): the
    // slabs of released leases (freeing one takes the region's locks) and the `next` latency.
    let mut released = Vec::new();
    let mut next_took = None;
    let mut stream: Option<Arc<StreamShared>> = None;
    let request = Duration::from_secs(node.cfg.trainer_request_timeout_secs);
    let idle = match node.cfg.trainer_idle_timeout_secs {
        0 => None,
        t => Some(Duration::from_secs(t)),
    };
    loop {
        // Before `attach` a trainer has the request timeout; attached, the idle timeout.
        let limits = ReadLimits {
            idle: if stream.is_some() {
                idle
            } else {
                Some(request)
            },
            frame: request,
        };
        // Trainers send no fds: a plain recv (the kernel closes any that come anyway).
        let req = match reader.read_data_timed(&sock, limits) {
            Ok(body) => match Request::decode(body) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "malformed trainer request; dropping the connection");
                    let _ = reply(&sock, &error("bad_request", e.to_string()), &[]);
                    break;
                }
            },
            Err(FrameIoError::Closed) => break,
            Err(e @ FrameIoError::Timeout { phase, .. }) => {
                let attached = stream.is_some();
                let (label, key) = match phase {
                    ReadPhase::Idle if attached => ("idle", "trainer_idle_timeout_secs"),
                    _ => ("request", "trainer_request_timeout_secs"),
                };
                metrics::counter!("shardwire_trainer_timeouts_total", "phase" => label)
                    .increment(1);
                tracing::warn!(error = %e, attached, "closing a trainer connection ({key})");
                let _ = reply(&sock, &error("timeout", format!("{e} ({key})")), &[]);
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, "trainer connection failed");
                let _ = reply(&sock, &error("bad_request", e.to_string()), &[]);
                break;
            }
        };
        let sent = match (req, &stream) {
            (Request::Attach { .. }, Some(_)) => reply(
                &sock,
                &error("already_attached", "this connection already has a stream"),
                &[],
            ),
            (
                Request::Attach {
                    version,
                    dataset,
                    seed,
                    rank,
                    world_size,
                    epochs,
                    uneven,
                    state,
                },
                None,
            ) => match open(
                node,
                Attach {
                    version,
                    dataset,
                    seed,
                    rank,
                    world_size,
                    epochs,
                    uneven,
                    state,
                },
            ) {
                Ok(s) => match s.pool.region().share_fd() {
                    Ok(fd) => {
                        let region = s.pool.region();
                        let r = Response::Attached {
                            stream: s.id,
                            region_size: region.len() as u64,
                            batches_per_epoch: s.spec.per_rank(),
                            epochs: s.epochs,
                            memory: region.memory().into(),
                            gpu: gpu_ref(node, region),
                            state: s.state(),
                        };
                        let sent = reply(&sock, &r, &[fd.as_fd()]);
                        stream = Some(s);
                        sent
                    }
                    Err(e) => {
                        let msg = format!("cannot share the stream's region: {e}");
                        close_stream(node, &s, &msg);
                        reply(&sock, &error("no_memory", msg), &[])
                    }
                },
                Err((code, msg)) => reply(&sock, &error(code, msg), &[]),
            },
            (_, None) => reply(&sock, &error("not_attached", "send attach first"), &[]),
            (Request::Next { release, .. }, Some(s))
                if !release
                    .iter()
                    .all(|l| s.take_lease(*l).map(|slab| released.push(slab)).is_some()) =>
            {
                let msg = format!("a lease in {release:?} is not held by this stream");
                send(&sock, &mut frame, &error("unknown_lease", msg), &[])
            }
            (Request::Next { timeout_ms, .. }, Some(s)) => {
                let t = std::time::Instant::now();
                let r = match s.next(node, timeout_ms.map(Duration::from_millis)) {
                    Next::Batch {
                        lease,
                        epoch,
                        index,
                        shard,
                        tensors,
                    } => Response::Batch {
                        lease,
                        epoch,
                        index,
                        shard,
                        tensors,
                    },
                    Next::End => Response::End,
                    Next::Timeout => Response::Timeout,
                    Next::Closed(why) => error("closed", why),
                };
                next_took = Some(t.elapsed());
                send(&sock, &mut frame, &r, &[])
            }
            (Request::Release { lease }, Some(s)) => {
                let r = match s.take_lease(lease) {
                    Some(slab) => {
                        released.push(slab);
                        Response::Released
                    }
                    None => error(
                        "unknown_lease",
                        format!("lease {lease} is not held by this stream"),
                    ),
                };
                send(&sock, &mut frame, &r, &[])
            }
            (Request::State, Some(s)) => send(
                &sock,
                &mut frame,
                &Response::State { state: s.state() },
                &[],
            ),
        };
        released.clear();
        if let Some(t) = next_took.take() {
            next_latency.record(t.as_secs_f64());
        }
        if let Err(e) = sent {
            tracing::debug!(error = %e, "trainer went away while we replied");
            break;
        }
    }
    if let Some(s) = stream {
        close_stream(node, &s, "trainer disconnected");
    }
}

/// The device a CUDA region lies on, for the attached message.
fn gpu_ref(node: &Node, region: &shardwire_gpu::Region) -> Option<trainer::GpuRef> {
    let gpu = node.cuda.as_ref()?;
    let cuda = region.cuda()?;
    Some(trainer::GpuRef {
        ordinal: gpu.info.ordinal,
        pci_bus_id: gpu.info.pci_bus_id.clone(),
        granularity: cuda.granularity() as u64,
    })
}

/// Closes a stream and returns its memory budget; safe to call more than once (an operator
/// may close a stream whose trainer disconnects later).
pub fn close_stream(node: &Node, s: &StreamShared, reason: &str) {
    s.close(reason);
    // Fetches not yet on the wire are dropped at the source (DESIGN §3: a closed stream
    // costs no more bandwidth); the ones already announced arrive and are discarded.
    let cancelled: usize = s.candidates.iter().map(|l| l.cancel_stream(s.id)).sum();
    if cancelled > 0 {
        tracing::debug!(
            stream = s.id,
            cancelled,
            "asked the sources to cancel queued fetches"
        );
    }
    if node
        .streams
        .lock()
        .expect("poisoned")
        .remove(&s.id)
        .is_some()
    {
        *node.reserved.lock().expect("poisoned") -= s.reserved;
        tracing::info!(stream = s.id, reason, "stream closed");
    }
}

/// A refusal to open a stream: (stable code, message).
pub(crate) type OpenError = (&'static str, String);

/// What a trainer asks for when it opens a stream (socket `attach`, HTTP `POST /v1/streams`).
pub(crate) struct Attach {
    pub version: u32,
    pub dataset: String,
    pub seed: u64,
    pub rank: u32,
    pub world_size: u32,
    pub epochs: u32,
    pub uneven: shardwire_protocol::plan::Uneven,
    pub state: Option<trainer::StreamState>,
}

/// Opens a stream: manifest, plan, resume check, memory reservation, region, fetcher.
/// Blocking (it waits for the manifest); call it from a thread, not from async code.
pub(crate) fn open(node: &Arc<Node>, a: Attach) -> Result<Arc<StreamShared>, OpenError> {
    let Attach {
        version,
        dataset,
        seed,
        rank,
        world_size,
        epochs,
        uneven,
        state,
    } = a;
    if version != TRAINER_VERSION {
        return Err((
            "unsupported_version",
            format!("trainer protocol {version}; this service speaks {TRAINER_VERSION}"),
        ));
    }
    if node.draining.load(std::sync::atomic::Ordering::Acquire) {
        return Err((
            "draining",
            "the node service is draining and accepts no new streams".into(),
        ));
    }
    if epochs == 0 {
        return Err(("bad_request", "epochs must be at least 1".into()));
    }
    // Checked here, at the edge, against the wire's rules: a name the wire cannot carry
    // must fail this request, never the source links shared by every stream.
    shardwire_protocol::wire::check_dataset_name(&dataset)
        .map_err(|e| ("bad_request", e.to_string()))?;
    let (manifest, candidates) = node.rt.block_on(manifest_for(node, &dataset))?;
    let shards = u32::try_from(manifest.shards.len())
        .map_err(|_| ("bad_request", "too many shards".to_string()))?;
    let spec = PlanSpec {
        digest: manifest.digest_bytes(),
        shards,
        seed,
        rank,
        world_size,
        uneven,
    };
    spec.validate().map_err(|e| ("bad_plan", e.to_string()))?;
    let fingerprint = spec.fingerprint();
    let start = match &state {
        None => 0,
        Some(st) => {
            spec.check_fingerprint(&st.fingerprint)
                .map_err(|e| ("state_mismatch", e))?;
            if st.seed != seed {
                return Err((
                    "state_mismatch",
                    format!(
                        "state fingerprint differs in `seed`: saved {}, stream has {seed}",
                        st.seed
                    ),
                ));
            }
            if st.index >= spec.per_rank() || st.epoch > epochs {
                return Err((
                    "state_mismatch",
                    format!(
                        "state position epoch {} index {} is outside this stream",
                        st.epoch, st.index
                    ),
                ));
            }
            u64::from(st.epoch) * spec.per_rank() + st.index
        }
    };
    let region_bytes = node.cfg.stream_memory();
    let largest = manifest.shards.iter().map(|s| s.length).max().unwrap_or(0) as usize;
    let class = shardwire_gpu::SlabPool::class_size(largest) as u64;
    if class * 2 > region_bytes {
        return Err((
            "no_memory",
            format!(
                "the largest shard ({largest} bytes, slab class {class}) needs stream_memory of at least {} bytes to keep one batch leased while the next arrives; stream_memory is {region_bytes}",
                class * 2
            ),
        ));
    }
    {
        let mut reserved = node.reserved.lock().expect("poisoned");
        if *reserved + region_bytes > node.cfg.pool_size.0 {
            return Err((
                "no_memory",
                format!(
                    "pool exhausted: {} of pool_size {} bytes reserved by open streams; a stream needs stream_memory {region_bytes}",
                    *reserved, node.cfg.pool_size.0
                ),
            ));
        }
        *reserved += region_bytes;
    }
    let id = node.next_id();
    let params = StreamParams {
        dataset: dataset.clone(),
        spec,
        epochs,
        start,
        manifest,
        region_bytes,
        candidates,
        fingerprint,
        cuda: node.cuda.clone(),
    };
    let s = match StreamShared::new(id, params) {
        Ok(s) => s,
        Err(e) => {
            *node.reserved.lock().expect("poisoned") -= region_bytes;
            return Err(("no_memory", e));
        }
    };
    node.streams
        .lock()
        .expect("poisoned")
        .insert(id, Arc::clone(&s));
    let span = tracing::info_span!("stream", id, dataset = %dataset, rank, world_size);
    node.rt
        .spawn(super::stream::fetcher(Arc::clone(node), Arc::clone(&s), start).instrument(span));
    tracing::info!(stream = id, %dataset, seed, rank, world_size, epochs, start, "stream opened");
    Ok(s)
}

/// The manifest for `dataset` and the links that serve exactly it.
async fn manifest_for(
    node: &Arc<Node>,
    dataset: &str,
) -> Result<(Arc<Manifest>, Vec<Arc<super::link::SourceLink>>), OpenError> {
    // Give links that are still connecting a moment (a trainer may start with the node).
    for _ in 0..50 {
        if node.links.iter().any(|l| l.is_up()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut answers = Vec::new();
    for l in node.links.iter().filter(|l| l.is_up()) {
        answers.push((
            Arc::clone(l),
            l.request_manifest(node.next_id(), dataset).await,
        ));
    }
    let mut errors = Vec::new();
    let mut chosen: Option<Arc<Manifest>> = None;
    let mut candidates = Vec::new();
    for (l, r) in answers {
        match r
            .map_err(|e| e.to_string())
            .and_then(|json| Manifest::from_json(&json).map_err(|e| e.to_string()))
        {
            Ok(m) => match &chosen {
                None => {
                    chosen = Some(Arc::new(m));
                    candidates.push(l);
                }
                Some(c) if c.digest == m.digest => candidates.push(l),
                Some(c) => {
                    tracing::warn!(source = %l.addr, %dataset, theirs = %m.digest, ours = %c.digest, "source serves a different version of the dataset; not using it for this stream")
                }
            },
            Err(e) => errors.push(format!("{}: {e}", l.addr)),
        }
    }
    match chosen {
        Some(m) => Ok((m, candidates)),
        None if errors.is_empty() => Err((
            "unavailable",
            format!(
                "no source is connected (configured: {})",
                node.links
                    .iter()
                    .map(|l| l.addr.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
        None => Err((
            "unknown_dataset",
            format!(
                "dataset `{dataset}` is not available: {}",
                errors.join("; ")
            ),
        )),
    }
}
