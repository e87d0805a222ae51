//! Admin/ops routes (loopback by default): `/healthz`, `/readyz`, `/metrics`, `/v1/status`,
//! `/v1/nics`, `/v1/streams`, and with the admin token: closing a stream and draining. They
//! read the node's status and send it control messages; they never touch the data path.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde_json::json;
use shardwire_node::{CloseReason, Control, Node, Reply};
use shardwire_protocol::trainer::ErrorCode;

use super::error::{ApiError, authorize, path_error};
use super::single_flight::SingleFlight;

/// Admin reads must finish within this time (the trainer long-poll routes are separate).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Time a change (a binding made or deleted, a stream closed, a drain) has beyond
/// `drain_timeout_secs`: a binding's delete waits that long for its readers, and the node
/// applies changes one at a time, so a change may wait for the one before it.
const CONTROL_SLACK: Duration = Duration::from_secs(30);

/// How old a NIC probe's result `GET /v1/nics` may answer with, rather than probe again.
const NICS_FRESH: Duration = Duration::from_secs(1);

/// The admin routes.
pub fn router(node: Arc<Node>) -> Router {
    let probe = Arc::new(SingleFlight::new(
        NICS_FRESH,
        || json!({ "nics": shardwire_devmem::probe::probe_nics() }),
    ));
    let reads = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .route("/v1/streams", get(streams))
        .route("/v1/streams/{id}", get(stream_one))
        .route("/v1/nics", get(move || nics(Arc::clone(&probe))))
        .route("/v1/bindings", get(super::bindings::list))
        .layer(axum::middleware::from_fn(|req, next| {
            within(ADMIN_TIMEOUT, req, next)
        }));
    let limit = Duration::from_secs(node.info().cfg.drain_timeout_secs) + CONTROL_SLACK;
    let changes = Router::new()
        .route("/v1/streams/{id}", delete(close_stream))
        .route("/v1/drain", post(drain))
        .route("/v1/bindings", post(super::bindings::create))
        .route("/v1/bindings/{id}", delete(super::bindings::delete))
        .layer(axum::middleware::from_fn(move |req, next| {
            within(limit, req, next)
        }));
    reads.merge(changes).with_state(node)
}

/// The answer of `next` for `req`, or `503 timeout` after `limit`. A change the node was
/// asked for still happens after that: the answer says so.
async fn within(
    limit: Duration,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let change = req.method() != axum::http::Method::GET;
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(r) => r,
        Err(_) => {
            let also = if change {
                ": the change may still be applied (look with GET before asking again)"
            } else {
                ""
            };
            ApiError::new(
                ErrorCode::Timeout,
                format!("the admin request took longer than {limit:?}{also}"),
            )
            .with_status(StatusCode::SERVICE_UNAVAILABLE)
            .into_response()
        }
    }
}

async fn drain(State(node): State<Arc<Node>>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize(&node, &headers)?;
    match node.control(Control::Drain).await? {
        Reply::Draining {
            streams_open,
            timeout_secs,
        } => Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "draining": true, "streams_open": streams_open, "timeout_secs": timeout_secs })),
        )
            .into_response()),
        other => Err(ApiError::new(ErrorCode::Internal, format!("drain answered {other:?}"))),
    }
}

/// The stream id a path names; a path that does not decode (`%FF`) is a JSON error too.
fn stream_id(id: Result<Path<String>, PathRejection>) -> Result<u64, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    id.parse()
        .map_err(|_| ApiError::bad_request(format!("stream id `{id}` is not a number")))
}

async fn stream_one(
    State(node): State<Arc<Node>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let n = stream_id(id)?;
    let s = node
        .stream(n)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no open stream {n}")))?;
    Ok(Json(s.info()).into_response())
}

async fn close_stream(
    State(node): State<Arc<Node>>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&node, &headers)?;
    let id = stream_id(id)?;
    let reason = CloseReason::Operator;
    node.control(Control::CloseStream { id, reason }).await?;
    Ok(Json(json!({ "closed": id })).into_response())
}

/// A capability probe of every NIC (netlink queries and a trial bind with an invalid fd,
/// which the kernel rejects before anything can be bound): one at most [`NICS_FRESH`] old, or
/// the one running now, or a new one. Never more than one runs, so requests (a client that
/// times out and asks again, a loop) cannot take the blocking threads that tensor copies,
/// binding changes and the data path need: a probe cannot be cancelled, and one whose
/// request gave up ([`ADMIN_TIMEOUT`], a client gone) answers the requests after it.
async fn nics(probe: Arc<SingleFlight<serde_json::Value>>) -> Result<Response, ApiError> {
    let v = probe
        .get()
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("NIC probe: {e}")))?;
    Ok(Json(v).into_response())
}

async fn readyz(State(node): State<Arc<Node>>) -> impl IntoResponse {
    let (ready, connected, known, draining) = node.readiness();
    readyz_answer(ready, connected, known, draining)
}

/// `/readyz`: 200 while `ready` sources (of `known`) have a session with every data
/// connection ready, and the node is not draining. The text tells sources that are connected
/// (`connected`) but not ready apart from sources not connected: `/v1/status` shows those
/// `up`.
fn readyz_answer(
    ready: usize,
    connected: usize,
    known: usize,
    draining: bool,
) -> (StatusCode, String) {
    let ready_of = format!("{ready}/{known} sources with every data connection ready");
    match (draining, ready, connected) {
        (true, ..) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: draining\n".to_string(),
        ),
        (false, 0, 0) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: 0/{known} sources connected\n"),
        ),
        (false, 0, _) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: {ready_of} ({connected} connected: still dialling, or a lane or data connection was not dialled; sources[].last_error in /v1/status says why)\n"
            ),
        ),
        (false, ..) => (
            StatusCode::OK,
            format!("ready: {ready_of} ({connected} connected)\n"),
        ),
    }
}

async fn metrics(State(node): State<Arc<Node>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        super::prom::render(&node),
    )
}

async fn streams(State(node): State<Arc<Node>>) -> Json<serde_json::Value> {
    let streams: Vec<_> = node.streams().iter().map(|s| s.info()).collect();
    Json(json!({ "streams": streams }))
}

async fn status(State(node): State<Arc<Node>>) -> Json<shardwire_node::Status> {
    Json(node.status())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    /// Two sources connected that each left a lane out answered "0/2 sources connected",
    /// while /v1/status showed both up.
    #[test]
    fn readyz_tells_connected_sources_that_are_not_ready_from_sources_not_connected() {
        let (code, text) = readyz_answer(0, 2, 2, false);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        let said = "not ready: 0/2 sources with every data connection ready (2 connected";
        assert!(text.starts_with(said), "{text}");
        assert!(text.contains("last_error"), "{text}");
        let (code, text) = readyz_answer(0, 0, 2, false);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(text, "not ready: 0/2 sources connected\n");
        let (code, text) = readyz_answer(1, 2, 3, false);
        assert_eq!(code, StatusCode::OK);
        assert_eq!(
            text,
            "ready: 1/3 sources with every data connection ready (2 connected)\n"
        );
        let (code, text) = readyz_answer(1, 1, 1, true);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(text, "not ready: draining\n");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_nics_requests_start_one_probe() {
        // Before: each `GET /v1/nics` ran its own probe on a blocking thread.
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runs = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&runs);
        let probe = Arc::new(SingleFlight::new(NICS_FRESH, move || {
            std::thread::sleep(Duration::from_millis(200));
            json!({ "nics": [], "probe": r.fetch_add(1, Ordering::SeqCst) })
        }));
        let app = Router::new().route("/v1/nics", get(move || nics(Arc::clone(&probe))));
        let requests: Vec<_> = (0..8)
            .map(|_| {
                let req = axum::http::Request::get("/v1/nics")
                    .body(Body::empty())
                    .unwrap();
                tokio::spawn(super::super::server::answer(app.clone(), req))
            })
            .collect();
        for r in requests {
            let r = r.await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v, json!({ "nics": [], "probe": 0 }));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "one probe for 8 requests");
    }

    #[tokio::test]
    async fn a_stream_id_that_does_not_decode_is_a_json_error() {
        // Before: `Path<String>` answered `%FF` (not UTF-8) with axum's text/plain 400.
        let app = Router::new().route(
            "/v1/streams/{id}",
            get(|id: Result<Path<String>, PathRejection>| async move {
                stream_id(id).map(|n| n.to_string())
            }),
        );
        for (path, status) in [
            ("/v1/streams/%FF", 400),
            ("/v1/streams/x", 400),
            ("/v1/streams/7", 200),
        ] {
            let req = axum::http::Request::get(path).body(Body::empty()).unwrap();
            let r = super::super::server::answer(app.clone(), req).await;
            assert_eq!(r.status().as_u16(), status, "{path}");
            let is_json = r.headers().get(axum::http::header::CONTENT_TYPE)
                == Some(&axum::http::HeaderValue::from_static("application/json"));
            let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
            if status == 400 {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                assert!(is_json && v["code"] == "bad_request", "{path}: {v}");
            } else {
                assert_eq!(&body[..], b"7");
            }
        }
    }
}
