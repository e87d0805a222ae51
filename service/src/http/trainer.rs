//! Trainer operations over HTTP (docs/TRAINER_API.md, "HTTP API"), for trainers that cannot
//! share memory with the node: the same streams, plans, leases and resume states as the Unix
//! socket, with tensor bytes copied into HTTP responses instead of mapped.
//!
//! An HTTP stream is opened with the same call as a socket `attach` ([`Node::open_stream`]),
//! so every check and the memory budget are exactly the socket's. `next`, `release`, `state`
//! and tensor reads go straight to the [`Stream`]. HTTP requests have no connection to tie a
//! stream to, so an HTTP
//! stream closes on `POST /v1/streams/{id}/close` or after an idle timeout (no request naming the
//! stream or one of its leases, and no `next` waiting). Only streams opened here are
//! reachable here: socket streams and their leases are unknown to these routes.
//!
//! (`DELETE /v1/streams/{id}` is the admin API's operator close, behind the admin token; a
//! trainer closes its own HTTP stream with `POST /v1/streams/{id}/close`.)

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use shardwire_node::{CloseReason, Next, Node, Stream};
use shardwire_protocol::trainer::http::{
    BatchBody, ClosedBody, EndBody, NextBody, OpenStream, Opened, ReleasedBody, TensorMeta,
};
use shardwire_protocol::trainer::{ErrorCode, StreamState, TensorView};
use tokio::sync::{OwnedMutexGuard, OwnedSemaphorePermit, Semaphore, oneshot};

use super::copies::{COPY_BUDGET, COPY_WAIT, Copies, CopyBody};
use super::error::{ApiError, path_error};
use super::server::OnReserve;
/// An HTTP stream with no request for this long is closed (overridable per stream).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest `idle_timeout_s` a stream may ask for.
pub const MAX_IDLE_TIMEOUT_S: u64 = 86_400;
/// `next` waits this long when the request names no `timeout_ms`.
pub const DEFAULT_POLL_MS: u64 = 30_000;
/// Largest `timeout_ms` of `next`.
pub const MAX_POLL_MS: u64 = 300_000;
/// Tensors up to this size are copied on the async worker; larger ones on a blocking thread.
const INLINE_COPY: u64 = 256 << 10;
/// Most `next` long-polls waiting on blocking threads at once ([`Stream::next`] waits on a
/// condvar): half of the runtime's blocking threads, so tensor copies, binding probes and
/// unbinds and the data path's `block_in_place` always find one, however many trainers poll
/// (`http_max_connections` allows far more). A `next` beyond them waits for a turn without a
/// thread, within its own timeout.
const MAX_WAITING_NEXTS: usize = crate::cli::BLOCKING_THREADS / 2;

/// The trainer HTTP routes, merged into the admin server.
pub fn router(node: Arc<Node>) -> Router {
    let trainer_http = node.info().cfg.trainer_http;
    let api = Arc::new(Api {
        node,
        streams: Mutex::new(HashMap::new()),
        leases: Mutex::new(HashMap::new()),
        gone: Mutex::new(VecDeque::new()),
        copies: Copies::new(),
        waits: Arc::new(Semaphore::new(MAX_WAITING_NEXTS)),
    });
    spawn_reaper(&api);
    Router::new()
        .route("/v1/streams", post(open))
        .route("/v1/streams/{id}/close", post(close))
        .route("/v1/streams/{id}/next", post(next))
        .route("/v1/streams/{id}/state", get(state))
        .route(
            "/v1/leases/{lease}/tensors/{name}",
            get(tensor).head(tensor_head),
        )
        .route("/v1/leases/{lease}/release", post(release))
        .layer(axum::middleware::from_fn(refuse_web_pages))
        .layer(axum::middleware::from_fn_with_state(
            trainer_http,
            refuse_when_off,
        ))
        .layer(axum::middleware::from_fn(refuse_on_reserve))
        .with_state(api)
}

/// A request on one of the server's reserve connections ([`OnReserve`]: every
/// `http_max_connections` slot is in use) answers `503 unavailable`: those serve the admin
/// and probe routes only, so trainers' long polls cannot take them too.
async fn refuse_on_reserve(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if req.extensions().get::<OnReserve>().is_some() {
        let msg = "every HTTP connection for trainers is in use (http_max_connections); this one serves the admin and probe routes only: try again later";
        return ApiError::new(ErrorCode::Unavailable, msg).into_response();
    }
    next.run(req).await
}

/// With `trainer_http = false` the trainer routes answer 403: trainers use the socket, and
/// an admin address off loopback serves no dataset to whoever can reach it.
async fn refuse_when_off(
    State(on): State<bool>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if on {
        return next.run(req).await;
    }
    let msg = "the trainer HTTP routes are off on this node (serve config `trainer_http = false`): \
               use the trainer socket";
    ApiError::new(ErrorCode::Forbidden, msg).into_response()
}

/// The trainer routes take no token, so a web page the operator's browser shows could reach
/// a node on loopback with "simple" cross-origin POSTs (no preflight: text/plain bodies, no
/// body), and close or open streams. Browsers name the page in `Origin` on every such
/// request; trainers (both SDKs, curl) send none. So a request with `Origin` is refused.
async fn refuse_web_pages(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match req.headers().get(header::ORIGIN) {
        Some(origin) => ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "requests from web pages (Origin: {}) are refused on the trainer routes",
                String::from_utf8_lossy(origin.as_bytes())
            ),
        )
        .into_response(),
        None => next.run(req).await,
    }
}

/// Whether `headers` say the body is JSON (`application/json`, any parameters).
fn says_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

// --- errors ----------------------------------------------------------------------------------

fn unknown_lease(lease: u64) -> ApiError {
    ApiError::new(
        ErrorCode::UnknownLease,
        format!("lease {lease} is not held by an HTTP stream of this node"),
    )
}

// --- state -----------------------------------------------------------------------------------

struct Api {
    node: Arc<Node>,
    /// HTTP streams by stream id.
    streams: Mutex<HashMap<u64, Arc<HttpStream>>>,
    /// Leases handed out over HTTP: lease -> (stream, tensors).
    leases: Mutex<HashMap<u64, Lease>>,
    /// The last [`GONE_KEPT`] streams closed, with why: their ids answer with the reason.
    gone: Mutex<VecDeque<(u64, CloseReason)>>,
    /// Room for tensor copies in flight.
    copies: Copies,
    /// Turns to wait for a batch on a blocking thread ([`MAX_WAITING_NEXTS`]).
    waits: Arc<Semaphore>,
}

/// How many closed HTTP streams' reasons are kept for the 404 that their ids answer.
const GONE_KEPT: usize = 256;

struct Lease {
    stream: u64,
    tensors: Arc<[TensorView]>,
}

/// A batch taken from the stream for an HTTP caller.
#[derive(Clone)]
struct Delivered {
    lease: u64,
    epoch: u32,
    index: u64,
    shard: u32,
    tensors: Arc<[TensorView]>,
}

enum Outcome {
    Batch(Delivered),
    End,
    Timeout,
    Closed(CloseReason),
}

struct HttpStream {
    id: u64,
    shared: Arc<Stream>,
    idle: Duration,
    /// Its requests in progress and when it was last used: apart from the stream, so that a
    /// download ([`Busy`] in its answer's body) keeps the stream from idling out without
    /// keeping the stream (its region) once it is closed.
    activity: Arc<Activity>,
    /// Serialises `next`, and holds a batch whose answer never reached its caller (the
    /// client went away while waiting): the next `next` delivers it, so no batch is lost.
    slot: Arc<tokio::sync::Mutex<Option<Delivered>>>,
    /// The batch the last `next` answered with, and the `after` that `next` named: answered
    /// again to a `next` naming the same `after` (its caller never got that answer: a
    /// connection that broke while it was on its way, a client timeout that fired as it
    /// came). A `next` naming another `after`, or none, is another caller's (or a later one).
    last: Mutex<Option<(Option<u64>, Delivered)>>,
}

/// How an HTTP stream is being used: what the idle reaper judges it by.
#[derive(Debug)]
struct Activity {
    /// Requests in progress (a waiting `next`, a download until its last byte is read).
    busy: AtomicUsize,
    /// When a request of the stream last began or ended.
    last_used: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self {
            busy: AtomicUsize::new(0),
            last_used: Mutex::new(Instant::now()),
        }
    }

    /// Whether the stream has had no request in progress for `idle`.
    fn idle_for(&self, idle: Duration) -> bool {
        self.busy.load(Ordering::SeqCst) == 0
            && self.last_used.lock().expect("poisoned").elapsed() >= idle
    }
}

/// Marks a stream in use while alive. It holds the stream's [`Activity`] only, never the
/// stream: a download's body keeps it until its last piece is gone, and a stream closed
/// meanwhile must free its region at once (its budget went back to the pool with the close).
struct Busy(Arc<Activity>);

impl Busy {
    fn new(s: &HttpStream) -> Self {
        Self::of(&s.activity)
    }

    fn of(a: &Arc<Activity>) -> Self {
        a.busy.fetch_add(1, Ordering::SeqCst);
        *a.last_used.lock().expect("poisoned") = Instant::now();
        Self(Arc::clone(a))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.last_used.lock().expect("poisoned") = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Api {
    fn stream(&self, id: u64) -> Result<Arc<HttpStream>, ApiError> {
        if let Some(s) = self.streams.lock().expect("poisoned").get(&id) {
            return Ok(s.clone());
        }
        let gone = self.gone.lock().expect("poisoned");
        Err(match gone.iter().find(|(g, _)| *g == id) {
            // Closed by a trainer, an operator or the idle timeout: gone (404), as documented;
            // closed by a failure: that failure's code (`data_unavailable`, ...).
            Some((_, why)) => {
                let message = format!("HTTP stream {id} was closed: {why}");
                match why.code() {
                    ErrorCode::Closed | ErrorCode::Timeout => {
                        ApiError::new(ErrorCode::NotFound, message)
                    }
                    code => ApiError::new(code, message),
                }
            }
            None => ApiError::new(
                ErrorCode::NotFound,
                format!(
                    "no HTTP stream {id} on this node (closed, idle for too long, or opened on the Unix socket)"
                ),
            ),
        })
    }

    /// Drops stream `id` and its leases from the API (its memory goes with the last
    /// reference: handlers still running hold theirs) and keeps why for its later answers;
    /// false (and nothing done) if it was forgotten already.
    fn forget(&self, id: u64, why: CloseReason) -> bool {
        if self.streams.lock().expect("poisoned").remove(&id).is_none() {
            return false;
        }
        self.leases
            .lock()
            .expect("poisoned")
            .retain(|_, l| l.stream != id);
        let mut gone = self.gone.lock().expect("poisoned");
        if gone.len() == GONE_KEPT {
            gone.pop_front();
        }
        gone.push_back((id, why));
        true
    }

    /// Stream `id`, which the node closed on its own (a failure, an operator's `DELETE`, a
    /// drain), leaves the API, and the node's table with it: nothing else would return its
    /// memory budget, since no trainer connection ends for an HTTP stream.
    fn closed_by_node(&self, id: u64, why: CloseReason) {
        if self.forget(id, why.clone()) {
            tracing::info!(stream = id, reason = %why, "HTTP stream closed by the node");
            self.node.close_stream(id, why);
        }
    }

    /// Takes the next batch of `s` (waiting up to `timeout`) and registers its lease.
    fn take(&self, s: &HttpStream, timeout: Duration) -> Outcome {
        match s.shared.next(Some(timeout)) {
            Next::Batch(b) => {
                let (lease, epoch, index, shard) = (b.lease, b.epoch, b.index, b.shard);
                let tensors: Arc<[TensorView]> = b.tensors.into();
                // Registered only while the stream is (under its lock): a `close` that ran
                // meanwhile has purged the stream's leases, and would not see this one.
                let streams = self.streams.lock().expect("poisoned");
                if streams.contains_key(&s.id) {
                    self.leases.lock().expect("poisoned").insert(
                        lease,
                        Lease {
                            stream: s.id,
                            tensors: Arc::clone(&tensors),
                        },
                    );
                }
                drop(streams);
                Outcome::Batch(Delivered {
                    lease,
                    epoch,
                    index,
                    shard,
                    tensors,
                })
            }
            Next::End => Outcome::End,
            Next::Timeout => Outcome::Timeout,
            Next::Closed(why) => Outcome::Closed(why),
        }
    }

    /// The batch `s` last answered with, when this `next` names the same `after` (the lease
    /// of the last batch its caller received; 0: none) as the one that got it, and the batch's
    /// lease is still held (not released, the stream not closed): that answer never reached
    /// the caller.
    fn unreceived(&self, s: &HttpStream, after: u64) -> Option<Delivered> {
        let (asked, last) = s.last.lock().expect("poisoned").clone()?;
        let held = self
            .leases
            .lock()
            .expect("poisoned")
            .contains_key(&last.lease);
        (asked == Some(after) && held).then_some(last)
    }

    /// Closes an HTTP stream: its leases end, its memory budget returns to the pool.
    fn close(&self, s: &HttpStream, reason: CloseReason) {
        let why = reason.to_string();
        self.forget(s.id, reason.clone());
        self.node.close_stream(s.id, reason);
        tracing::info!(stream = s.id, reason = %why, "HTTP stream closed");
    }
}

/// Closes HTTP streams idle for longer than their timeout; ends with the router.
fn spawn_reaper(api: &Arc<Api>) {
    let weak: Weak<Api> = Arc::downgrade(api);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let Some(api) = weak.upgrade() else { return };
            forget_closed(&api);
            let idle: Vec<_> = api
                .streams
                .lock()
                .expect("poisoned")
                .values()
                .filter(|s| s.activity.idle_for(s.idle))
                .cloned()
                .collect();
            for s in idle {
                let reason = CloseReason::HttpIdle {
                    secs: s.idle.as_secs(),
                };
                api.close(&s, reason);
            }
        }
    });
}

/// Forgets the HTTP streams the node closed on its own (an operator's `DELETE`, a drain, a
/// failure), so that their memory is freed now, not at their idle timeout, and their ids
/// answer with the reason.
fn forget_closed(api: &Api) {
    let closed: Vec<(u64, CloseReason)> = api
        .streams
        .lock()
        .expect("poisoned")
        .values()
        .filter_map(|s| Some((s.id, s.shared.closed_reason()?)))
        .collect();
    for (id, why) in closed {
        api.closed_by_node(id, why);
    }
}

// --- open ------------------------------------------------------------------------------------

async fn open(
    State(api): State<Arc<Api>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Opened>), ApiError> {
    let body = body.map_err(|e| ApiError::bad_request(e.body_text()).with_status(e.status()))?;
    if !body.is_empty() && !says_json(&headers) {
        return Err(ApiError::bad_request(format!(
            "the body must be JSON with Content-Type: application/json (got {:?})",
            headers.get(header::CONTENT_TYPE)
        ))
        .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE));
    }
    let OpenStream {
        stream,
        idle_timeout_s,
    } = OpenStream::from_json(&body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let idle = match idle_timeout_s {
        None => DEFAULT_IDLE_TIMEOUT,
        Some(s) if (1..=MAX_IDLE_TIMEOUT_S).contains(&s) => Duration::from_secs(s),
        Some(s) => {
            return Err(ApiError::bad_request(format!(
                "idle_timeout_s is {s}; it must be between 1 and {MAX_IDLE_TIMEOUT_S}"
            )));
        }
    };
    let shared = api.node.open_stream(stream).await?;
    let id = shared.id();
    let body = Opened {
        stream: id,
        batches_per_epoch: shared.batches_per_epoch(),
        epochs: shared.epochs(),
        state: shared.state(),
        idle_timeout_s: idle.as_secs(),
    };
    let s = Arc::new(HttpStream {
        id,
        shared,
        idle,
        activity: Arc::new(Activity::new()),
        slot: Arc::new(tokio::sync::Mutex::new(None)),
        last: Mutex::new(None),
    });
    api.streams.lock().expect("poisoned").insert(id, s);
    tracing::info!(
        stream = id,
        idle_s = idle.as_secs(),
        "stream opened over HTTP"
    );
    Ok((StatusCode::CREATED, Json(body)))
}

// --- streams ---------------------------------------------------------------------------------

async fn close(
    State(api): State<Arc<Api>>,
    id: Result<Path<u64>, PathRejection>,
) -> Result<Json<ClosedBody>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let s = api.stream(id)?;
    api.close(&s, CloseReason::ClosedOverHttp);
    Ok(Json(ClosedBody {
        stream: id,
        closed: true,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NextQuery {
    timeout_ms: Option<u64>,
    /// The lease of the last batch the caller received (0: none yet). Without it, a batch
    /// answered to a caller that never got the answer is skipped.
    after: Option<u64>,
}

fn batch_body(b: &Delivered) -> NextBody {
    NextBody::Batch(BatchBody {
        lease: b.lease,
        epoch: b.epoch,
        index: b.index,
        shard: b.shard,
        tensors: b.tensors.iter().map(TensorMeta::from).collect(),
    })
}

async fn next(
    State(api): State<Arc<Api>>,
    id: Result<Path<u64>, PathRejection>,
    q: Result<Query<NextQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let timeout = q.timeout_ms.unwrap_or(DEFAULT_POLL_MS);
    if timeout > MAX_POLL_MS {
        return Err(ApiError::bad_request(format!(
            "timeout_ms is {timeout}; at most {MAX_POLL_MS} (poll again to wait longer)"
        )));
    }
    let s = api.stream(id)?;
    let busy = Busy::new(&s);
    let t = Instant::now();
    // Behind another `next` of the stream for at most this one's own timeout (then 204, as
    // any wait that runs out): not for the whole wait of the one in front.
    let wait_turn = Duration::from_millis(timeout);
    let Ok(mut slot) = tokio::time::timeout(wait_turn, Arc::clone(&s.slot).lock_owned()).await
    else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let timeout = timeout.saturating_sub(t.elapsed().as_millis() as u64);
    let after = q.after;
    // `last` is set while this `next`'s turn (the slot's lock) is held: the `next` after it,
    // the same caller's asking again, must see it.
    let outcome = match after.and_then(|a| api.unreceived(&s, a)) {
        Some(b) => Outcome::Batch(b), // answered again: `last` already names it
        None => match slot.take() {
            Some(b) => remembered(&s, after, Outcome::Batch(b)),
            // A ready batch is taken right here; only a wait goes to a blocking thread.
            None => match api.take(&s, Duration::ZERO) {
                Outcome::Timeout if timeout > 0 => {
                    let wait = Duration::from_millis(timeout);
                    wait_for_batch(&api, &s, (busy, slot), after, wait).await?
                }
                o => remembered(&s, after, o),
            },
        },
    };
    metrics::histogram!("shardwire_trainer_next_duration_seconds", "api" => "http")
        .record(t.elapsed().as_secs_f64());
    Ok(match outcome {
        Outcome::Batch(b) => Json(batch_body(&b)).into_response(),
        Outcome::End => Json(NextBody::End(EndBody { end: true })).into_response(),
        Outcome::Timeout => StatusCode::NO_CONTENT.into_response(),
        Outcome::Closed(why) => {
            // Its memory goes now, before the caller hears of it (a retry may open another).
            api.closed_by_node(id, why.clone());
            ApiError::new(why.code(), why.to_string()).into_response()
        }
    })
}

/// `next`'s wait of at most `timeout` for a batch of `s` not ready yet, its turn (`slot`)
/// held: on a blocking thread, once one of the [`MAX_WAITING_NEXTS`] turns is free. Until
/// then it looks for the batch every [`TURN_LOOK`] without a thread and answers with one as
/// soon as it is there; one that gets neither within its timeout answers as a wait that ran
/// out would (`204`), never having held a thread.
async fn wait_for_batch(
    api: &Arc<Api>,
    s: &Arc<HttpStream>,
    (busy, mut slot): (Busy, OwnedMutexGuard<Option<Delivered>>),
    after: Option<u64>,
    timeout: Duration,
) -> Result<Outcome, ApiError> {
    // Taken and handed out with no await between (a caller that leaves loses no batch).
    let look = || match api.take(s, Duration::ZERO) {
        Outcome::Timeout => None,
        o => Some(o),
    };
    let (turn, left) = match thread_turn(&api.waits, timeout, look).await {
        Turn::Taken(turn, left) => (turn, left),
        Turn::Found(o) => return Ok(remembered(s, after, o)),
        Turn::None => return Ok(Outcome::Timeout),
    };
    let (tx, rx) = oneshot::channel();
    let (api2, s2) = (Arc::clone(api), Arc::clone(s));
    tokio::task::spawn_blocking(move || {
        // In use until `next` returns, even if the caller left; the turn until the wait ends.
        let _held = (busy, turn);
        let out = api2.take(&s2, left);
        let taken = match &out {
            Outcome::Batch(b) => Some(b.clone()),
            _ => None,
        };
        match tx.send(out) {
            Ok(()) => {
                if let Some(b) = taken {
                    s2.remember(after, b);
                }
            }
            // The caller went away: keep it for the next `next`.
            Err(Outcome::Batch(b)) => *slot = Some(b),
            Err(_) => {}
        }
    });
    rx.await
        .map_err(|_| ApiError::new(ErrorCode::Internal, "the waiting thread failed"))
}

/// How often a `next` waiting for a turn ([`MAX_WAITING_NEXTS`]) looks for its batch without
/// one: a batch ready meanwhile is answered within this, not after the turn or the timeout.
const TURN_LOOK: Duration = Duration::from_millis(15);

/// How a wait for a turn of the waiting threads ended.
enum Turn<T> {
    /// A turn, and what is left of the timeout.
    Taken(OwnedSemaphorePermit, Duration),
    /// What the look found before a turn freed.
    Found(T),
    /// Neither within the timeout.
    None,
}

/// A turn of `waits` taken within `timeout`, calling `look` every [`TURN_LOOK`] meanwhile
/// (and once at the end): what it finds first ends the wait.
async fn thread_turn<T>(
    waits: &Arc<Semaphore>,
    timeout: Duration,
    mut look: impl FnMut() -> Option<T>,
) -> Turn<T> {
    let t = Instant::now();
    let acquire = Arc::clone(waits).acquire_owned();
    tokio::pin!(acquire);
    loop {
        let left = timeout.saturating_sub(t.elapsed());
        tokio::select! {
            biased;
            turn = &mut acquire => {
                return match turn {
                    Ok(turn) => Turn::Taken(turn, timeout.saturating_sub(t.elapsed())),
                    Err(_) => Turn::None, // closed: never, the API keeps it open
                };
            }
            () = tokio::time::sleep(left.min(TURN_LOOK)) => {
                if let Some(found) = look() {
                    return Turn::Found(found);
                }
                if left <= TURN_LOOK {
                    return Turn::None;
                }
            }
        }
    }
}

/// `o`, a batch of it kept as the one `s` last answered with, to a `next` naming `after`.
fn remembered(s: &HttpStream, after: Option<u64>, o: Outcome) -> Outcome {
    if let Outcome::Batch(b) = &o {
        s.remember(after, b.clone());
    }
    o
}

impl HttpStream {
    /// Keeps `b` as the batch this stream last answered with, to a `next` naming `after`.
    fn remember(&self, after: Option<u64>, b: Delivered) {
        *self.last.lock().expect("poisoned") = Some((after, b));
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StateQuery {
    /// The lease of the last batch the caller holds as received (as `next`'s `after`): the
    /// batch the node answered a `next` naming it with is not the caller's yet.
    after: Option<u64>,
}

async fn state(
    State(api): State<Arc<Api>>,
    id: Result<Path<u64>, PathRejection>,
    q: Result<Query<StateQuery>, QueryRejection>,
) -> Result<Json<StreamState>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let s = api.stream(id)?;
    let _busy = Busy::new(&s);
    // A batch kept back for its caller has not been delivered: resume at it.
    if let Ok(slot) = s.slot.try_lock()
        && let Some(b) = slot.as_ref()
    {
        let pos = s.shared.position(b.epoch, b.index);
        return Ok(Json(s.shared.state_at(pos)));
    }
    // Nor has the batch last answered to a `next` naming `after`, when the caller still names
    // `after` (its download failed, or an interrupt struck while it was released): the
    // caller's next `next` takes it.
    if let Some(after) = q.after
        && let Some((asked, last)) = s.last.lock().expect("poisoned").clone()
        && asked == Some(after)
    {
        let pos = s.shared.position(last.epoch, last.index);
        return Ok(Json(s.shared.state_at(pos)));
    }
    Ok(Json(s.shared.state()))
}

// --- leases ----------------------------------------------------------------------------------

/// The stream holding `lease` (its id and the stream), and the tensor `name` of its batch.
fn leased_tensor(
    api: &Api,
    lease: u64,
    name: &str,
) -> Result<(u64, Arc<HttpStream>, TensorView), ApiError> {
    let (sid, tensors) = {
        let leases = api.leases.lock().expect("poisoned");
        let l = leases.get(&lease).ok_or_else(|| unknown_lease(lease))?;
        (l.stream, Arc::clone(&l.tensors))
    };
    let Some(t) = tensors.iter().find(|t| t.name == name).cloned() else {
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!(
                "the batch of lease {lease} has no tensor `{name}`; it has: {}",
                names.join(", ")
            ),
        ));
    };
    let s = api.stream(sid).map_err(|_| unknown_lease(lease))?;
    Ok((sid, s, t))
}

/// The headers of a tensor's answer, `Content-Length` aside (its body's length).
fn tensor_headers(t: &TensorView) -> [(header::HeaderName, String); 3] {
    let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
    [
        (header::CONTENT_TYPE, "application/octet-stream".to_string()),
        (
            header::HeaderName::from_static("x-shardwire-dtype"),
            t.dtype.name().to_string(),
        ),
        (
            header::HeaderName::from_static("x-shardwire-shape"),
            shape.join(","),
        ),
    ]
}

/// `HEAD` of a tensor: the headers its `GET` answers with, `Content-Length` included, from
/// the batch's metadata. Nothing is copied (axum would otherwise run the `GET` handler and
/// drop its body: a whole tensor copied, and copy room taken, for nothing). Like any request
/// naming a lease, it counts as the stream's activity.
async fn tensor_head(
    State(api): State<Arc<Api>>,
    p: Result<Path<(u64, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path((lease, name)) = p.map_err(path_error)?;
    let (_, s, t) = leased_tensor(&api, lease, &name)?;
    // Answered only while the node still holds the lease, as `GET` reads it (a stream the
    // node closed, which this API learns of within its tick, holds none).
    if !s.shared.holds_lease(lease) {
        return Err(unknown_lease(lease));
    }
    drop(Busy::new(&s));
    Ok(head_answer(&t))
}

/// The answer to `HEAD` of `t`: [`tensor_headers`], its length, no body.
fn head_answer(t: &TensorView) -> Response {
    let mut r = (tensor_headers(t), axum::body::Body::empty()).into_response();
    r.headers_mut()
        .insert(header::CONTENT_LENGTH, header::HeaderValue::from(t.length));
    r
}

async fn tensor(
    State(api): State<Arc<Api>>,
    p: Result<Path<(u64, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path((lease, name)) = p.map_err(path_error)?;
    let (sid, s, t) = leased_tensor(&api, lease, &name)?;
    // In use until the answer's body is gone (the download read, or the client left): the
    // idle reaper must not close the stream under a slow download. The body keeps only this
    // mark: a close during the download frees the region now (the bytes are copied already).
    let busy = Busy::new(&s);
    // Nor does the wait for copy room keep the stream: one closed meanwhile frees its region
    // then, and is looked up again (gone: its lease went with it).
    drop(s);
    let Some(room) = api.copies.room(t.length, COPY_WAIT).await else {
        return Err(ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "tensor `{name}` of lease {lease} ({} bytes): the node's tensor copies in flight took its budget of {COPY_BUDGET} bytes for {COPY_WAIT:?} (clients reading slowly); try again",
                t.length
            ),
        ));
    };
    let s = api.stream(sid).map_err(|_| unknown_lease(lease))?;
    let (bytes, room) = if t.length <= INLINE_COPY {
        (s.shared.read_leased(lease, t.offset, t.length), room)
    } else {
        // The room goes with the copy: a client that leaves drops this handler, not the copy
        // running on its blocking thread, which must hold its share of the budget until done.
        let s2 = Arc::clone(&s);
        tokio::task::spawn_blocking(move || {
            (s2.shared.read_leased(lease, t.offset, t.length), room)
        })
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    };
    let bytes = bytes.ok_or_else(|| unknown_lease(lease))?;
    Ok((
        tensor_headers(&t),
        axum::body::Body::new(CopyBody::new(bytes, room, busy)),
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseQuery {
    /// The stream the caller holds the lease by: a lease of another stream is not released
    /// (lease numbers start again at 1 when the node restarts, so a release sent again late,
    /// after a restart, could name another trainer's).
    stream: Option<u64>,
}

async fn release(
    State(api): State<Arc<Api>>,
    p: Result<Path<u64>, PathRejection>,
    q: Result<Query<ReleaseQuery>, QueryRejection>,
) -> Result<Json<ReleasedBody>, ApiError> {
    let Path(lease) = p.map_err(path_error)?;
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let l = {
        let mut leases = api.leases.lock().expect("poisoned");
        match leases.get(&lease) {
            Some(l) if q.stream.is_none_or(|s| s == l.stream) => leases.remove(&lease),
            _ => None,
        }
    }
    .ok_or_else(|| unknown_lease(lease))?;
    let s = api.stream(l.stream).map_err(|_| unknown_lease(lease))?;
    let _busy = Busy::new(&s);
    if s.shared.release(lease) {
        Ok(Json(ReleasedBody { released: true }))
    } else if let Some(why) = s.shared.closed_reason() {
        // Closing the stream dropped the lease: say why it closed.
        Err(ApiError::new(why.code(), why.to_string()))
    } else {
        Err(unknown_lease(lease))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_next_beyond_the_waiting_threads_waits_for_a_turn_without_one() {
        // Before: every waiting `next` held a blocking thread for up to 300 s, so enough
        // long polls took every one (tensor copies and binding changes queued behind them).
        const _: () = assert!(MAX_WAITING_NEXTS < crate::cli::BLOCKING_THREADS);
        let waits = Arc::new(Semaphore::new(1));
        let nothing = || None::<()>;
        let got = thread_turn(&waits, Duration::from_secs(1), nothing).await;
        let Turn::Taken(held, _) = got else {
            panic!("a free turn was not taken");
        };
        // Every turn taken: the wait runs out after its own timeout, with no turn.
        let t = Instant::now();
        let got = thread_turn(&waits, Duration::from_millis(50), nothing).await;
        assert!(matches!(got, Turn::None));
        assert!(t.elapsed() >= Duration::from_millis(50));
        // A turn freed meanwhile: taken, with the rest of the timeout left for the wait.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(held);
        });
        let got = thread_turn(&waits, Duration::from_secs(10), nothing).await;
        let Turn::Taken(_turn, left) = got else {
            panic!("the freed turn was not taken");
        };
        assert!(left <= Duration::from_millis(9_900), "{left:?}");
        assert!(left >= Duration::from_secs(5), "{left:?}");
    }

    #[tokio::test]
    async fn a_next_waiting_for_a_turn_answers_with_a_batch_ready_meanwhile() {
        // Before: a `next` queued behind the busy turns only waited for a turn, so with every
        // turn held (256 long polls, orphaned ones too) a batch ready 100 ms later was
        // answered only after the whole timeout (10 s here).
        let waits = Arc::new(Semaphore::new(1));
        let _held = Arc::clone(&waits).try_acquire_owned().unwrap();
        let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = Arc::clone(&ready);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            r.store(true, Ordering::SeqCst);
        });
        let mut looks = 0;
        let look = || {
            looks += 1;
            ready.load(Ordering::SeqCst).then_some(7)
        };
        let t = Instant::now();
        let got = thread_turn(&waits, Duration::from_secs(10), look).await;
        assert!(matches!(got, Turn::Found(7)));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(looks >= 2, "{looks}"); // looked before the batch, and again after
    }

    #[tokio::test]
    async fn head_of_a_tensor_answers_gets_headers_with_no_copy() {
        // Before: axum answered HEAD with the GET handler, which took copy room and copied
        // the whole tensor to drop it. Now HEAD answers from the batch's metadata, with the
        // headers (Content-Length included) of the GET answer over the copied bytes.
        let t = TensorView {
            name: "x".into(),
            dtype: shardwire_protocol::DType::Float32,
            shape: vec![17, 8],
            offset: 4096,
            length: 17 * 8 * 4,
        };
        let copies = Arc::new(Copies::new());
        let gets = Arc::new(AtomicUsize::new(0));
        let (c, g, tg, th) = (Arc::clone(&copies), Arc::clone(&gets), t.clone(), t.clone());
        // GET as `tensor` answers once it has the bytes.
        let download = move || {
            let (copies, t) = (Arc::clone(&c), tg.clone());
            g.fetch_add(1, Ordering::SeqCst);
            async move {
                let room = copies.room(t.length, COPY_WAIT).await.unwrap();
                let bytes = vec![7u8; t.length as usize];
                let body = axum::body::Body::new(CopyBody::new(bytes, room, ()));
                (tensor_headers(&t), body).into_response()
            }
        };
        let app = Router::new().route(
            "/t",
            get(download).head(move || async move { head_answer(&th) }),
        );
        let request = |m: &str| {
            let req = axum::http::Request::builder().method(m).uri("/t");
            req.body(axum::body::Body::empty()).unwrap()
        };
        let head = super::super::server::answer(app.clone(), request("HEAD")).await;
        assert_eq!(gets.load(Ordering::SeqCst), 0, "HEAD ran no download");
        let got = super::super::server::answer(app, request("GET")).await;
        assert_eq!(head.status(), StatusCode::OK);
        assert_eq!(head.headers(), got.headers(), "HEAD's headers are GET's");
        assert_eq!(head.headers()[header::CONTENT_LENGTH], "544");
        assert_eq!(head.headers()["x-shardwire-shape"], "17,8");
        assert_eq!(head.headers()["x-shardwire-dtype"], "float32");
        let body = axum::body::to_bytes(head.into_body(), 1 << 20)
            .await
            .unwrap();
        assert!(body.is_empty());
        let body = axum::body::to_bytes(got.into_body(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(body.len() as u64, t.length);
    }

    /// A download's mark keeps the stream from idling out while it lives, and holds only the
    /// stream's activity (a closed stream's region goes at once).
    #[test]
    fn a_busy_mark_keeps_a_stream_from_idling_out_and_holds_only_its_activity() {
        // Before: `Busy` held the whole `HttpStream` (its `Arc<Stream>` and the region in
        // it), so a download in flight kept a closed stream's region for up to its deadline.
        let activity = Arc::new(Activity::new());
        let ten_s_ago = Instant::now().checked_sub(Duration::from_secs(10)).unwrap();
        *activity.last_used.lock().unwrap() = ten_s_ago;
        assert!(activity.idle_for(Duration::from_secs(5)), "unused for 10 s");
        let download = Busy::of(&activity);
        assert!(!activity.idle_for(Duration::ZERO), "in use");
        assert_eq!(Arc::strong_count(&activity), 2);
        drop(download);
        assert_eq!(activity.busy.load(Ordering::SeqCst), 0);
        assert!(!activity.idle_for(Duration::from_secs(5)), "used just now");
        assert!(activity.idle_for(Duration::ZERO));
    }
}
