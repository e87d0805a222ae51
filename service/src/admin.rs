//! Admin/ops HTTP API (loopback by default): `/healthz`, `/readyz`, `/metrics`, `/v1/status`,
//! `/v1/streams`. Hot-path counters are atomics; they are copied into the Prometheus
//! recorder when `/metrics` is scraped, so the data path never touches the registry.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde_json::json;
use tokio::sync::watch;

use crate::node::Node;

/// Serves the admin API (and the trainer HTTP API) until shutdown.
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) {
    let limits = crate::httpd::Limits::from_config(&node.cfg);
    crate::prom::handle();
    crate::prom::register_zero(&node.receive().to_string(), &node.cfg.sources);
    let mut stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = crate::prom::upkeep() => {}
            _ = stop.changed() => {}
        }
    });
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .route("/v1/streams", get(streams))
        .route("/v1/streams/{id}", get(stream_one).delete(close_stream))
        .route("/v1/drain", post(drain))
        .route("/v1/nics", get(nics))
        .route(
            "/v1/bindings",
            get(crate::bindings::list).post(crate::bindings::create),
        )
        .route("/v1/bindings/{id}", delete(crate::bindings::delete))
        .layer(DefaultBodyLimit::max(64 << 10))
        .layer(axum::middleware::from_fn(admin_timeout))
        .with_state(Arc::clone(&node))
        .merge(crate::trainer_http::router(node));
    crate::httpd::serve(listener, app, limits, shutdown).await;
}

/// Admin requests must finish within this time (the trainer long-poll routes are separate).
const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn admin_timeout(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match tokio::time::timeout(ADMIN_TIMEOUT, next.run(req)).await {
        Ok(r) => r,
        Err(_) => api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout",
            "the admin request took too long",
        ),
    }
}

/// A JSON error with a stable code, as every API of the node answers.
pub fn api_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "code": code, "message": message.into() })),
    )
        .into_response()
}

/// Checks `Authorization: Bearer <token>` for mutating endpoints (constant-time compare).
#[allow(clippy::result_large_err)] // the error is the HTTP response itself, returned as is
pub(crate) fn authorize(node: &Node, headers: &HeaderMap) -> Result<(), Response> {
    let Some(token) = &node.admin_token else {
        return Err(api_error(
            StatusCode::FORBIDDEN,
            "admin_disabled",
            "mutating admin endpoints are disabled: no admin_token_file is configured",
        ));
    };
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => {
            metrics::counter!("shardwire_admin_auth_fails_total", "reason" => "missing")
                .increment(1);
            Err(api_error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing `Authorization: Bearer <token>`",
            ))
        }
        Some(g) if shardwire_protocol::auth::ct_eq(g.trim().as_bytes(), token) => Ok(()),
        Some(_) => {
            metrics::counter!("shardwire_admin_auth_fails_total", "reason" => "wrong").increment(1);
            Err(api_error(
                StatusCode::FORBIDDEN,
                "forbidden",
                "wrong admin token",
            ))
        }
    }
}

async fn drain(State(node): State<Arc<Node>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&node, &headers) {
        return r;
    }
    node.draining.store(true, Ordering::Release);
    node.drain_requested.notify_one();
    let open = node.streams.lock().expect("poisoned").len();
    (StatusCode::ACCEPTED, Json(json!({ "draining": true, "streams_open": open, "timeout_secs": node.cfg.drain_timeout_secs })))
        .into_response()
}

#[allow(clippy::result_large_err)] // the error is the HTTP response itself, returned as is
fn find_stream(node: &Node, id: &str) -> Result<Arc<crate::node::stream::StreamShared>, Response> {
    let n: u64 = id.parse().map_err(|_| {
        api_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("stream id `{id}` is not a number"),
        )
    })?;
    node.streams
        .lock()
        .expect("poisoned")
        .get(&n)
        .cloned()
        .ok_or_else(|| {
            api_error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no open stream {n}"),
            )
        })
}

async fn stream_one(State(node): State<Arc<Node>>, Path(id): Path<String>) -> Response {
    match find_stream(&node, &id) {
        Ok(s) => Json(stream_json(&s)).into_response(),
        Err(r) => r,
    }
}

async fn close_stream(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = authorize(&node, &headers) {
        return r;
    }
    match find_stream(&node, &id) {
        Ok(s) => {
            crate::node::trainer_socket::close_stream(
                &node,
                &s,
                "closed by an operator over the admin API",
            );
            Json(json!({ "closed": s.id })).into_response()
        }
        Err(r) => r,
    }
}

/// A fresh capability probe of every NIC (netlink queries and a trial bind with an invalid
/// fd, which the kernel rejects before anything can be bound).
async fn nics() -> Response {
    match tokio::task::spawn_blocking(shardwire_devmem::probe::probe_nics).await {
        Ok(n) => Json(json!({ "nics": n })).into_response(),
        Err(e) => api_error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
    }
}

async fn readyz(State(node): State<Arc<Node>>) -> impl IntoResponse {
    if node.draining.load(Ordering::Acquire) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: draining\n".to_string(),
        );
    }
    let up = node.links.iter().filter(|l| l.is_up()).count();
    if up > 0 {
        (
            StatusCode::OK,
            format!("ready: {up}/{} sources connected\n", node.links.len()),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: 0/{} sources connected\n", node.links.len()),
        )
    }
}

async fn metrics(State(node): State<Arc<Node>>) -> impl IntoResponse {
    let c = &node.counters;
    let mode = [("mode", node.receive().to_string())];
    metrics::counter!("shardwire_bytes_received_total", &mode)
        .absolute(c.bytes_received.load(Ordering::Relaxed));
    metrics::counter!("shardwire_shards_received_total", &mode)
        .absolute(c.shards_received.load(Ordering::Relaxed));
    metrics::counter!("shardwire_crc_failures_total")
        .absolute(c.crc_failures.load(Ordering::Relaxed));
    metrics::counter!("shardwire_refetches_total").absolute(c.refetches.load(Ordering::Relaxed));
    metrics::counter!("shardwire_batches_delivered_total")
        .absolute(c.batches_delivered.load(Ordering::Relaxed));
    metrics::counter!("shardwire_h2d_staging_stalls_total")
        .absolute(c.staging_stalls.load(Ordering::Relaxed));
    let cancelled: u64 = node
        .links
        .iter()
        .map(|l| l.cancels.confirmed.load(Ordering::Relaxed))
        .sum();
    metrics::counter!("shardwire_fetches_cancelled_total").absolute(cancelled);
    let stall: Vec<(&str, f64)> = [
        ("network", &c.stall_network_ns),
        ("trainer", &c.stall_trainer_ns),
        ("assembly", &c.assembly_ns),
    ]
    .into_iter()
    .map(|(cause, v)| (cause, v.load(Ordering::Relaxed) as f64 / 1e9))
    .collect();
    for l in &node.links {
        let labels = [("source", l.addr.clone())];
        metrics::counter!("shardwire_source_bytes_received_total", &labels)
            .absolute(l.bytes.load(Ordering::Relaxed));
        metrics::gauge!("shardwire_source_up", &labels).set(if l.is_up() { 1.0 } else { 0.0 });
    }
    let streams: Vec<_> = node
        .streams
        .lock()
        .expect("poisoned")
        .values()
        .cloned()
        .collect();
    let (mut used, mut cap, mut leases) = (0usize, 0usize, 0usize);
    for s in &streams {
        used += s.pool.used();
        cap += s.pool.capacity();
        leases += s.counts().1;
    }
    metrics::gauge!("shardwire_pool_bytes_used").set(used as f64);
    metrics::gauge!("shardwire_pool_bytes_free").set((cap - used) as f64);
    metrics::gauge!("shardwire_pool_bytes_reserved")
        .set(*node.reserved.lock().expect("poisoned") as f64);
    metrics::gauge!("shardwire_leases_outstanding").set(leases as f64);
    metrics::gauge!("shardwire_streams_open").set(streams.len() as f64);
    if let Some(region) = node.devmem() {
        devmem_metrics(&region);
    }
    (
        [("content-type", "text/plain; version=0.0.4")],
        crate::prom::render(&stall),
    )
}

/// `shardwire_devmem_*`: the devmem receive path (also under `receive = devmem-sim`).
fn devmem_metrics(region: &crate::node::devmem_rx::RxRegion) {
    let c = &region.counters;
    let (free, total) = region.niovs();
    metrics::counter!("shardwire_devmem_frags_total").absolute(c.frags.load(Ordering::Relaxed));
    metrics::counter!("shardwire_devmem_bytes_total")
        .absolute(c.dmabuf_bytes.load(Ordering::Relaxed));
    metrics::counter!("shardwire_devmem_tokens_returned_total")
        .absolute(c.tokens_returned.load(Ordering::Relaxed));
    metrics::counter!("shardwire_devmem_host_bytes_total", "kind" => "linear")
        .absolute(c.linear_bytes.load(Ordering::Relaxed));
    metrics::counter!("shardwire_devmem_host_bytes_total", "kind" => "plain")
        .absolute(c.plain_bytes.load(Ordering::Relaxed));
    metrics::counter!("shardwire_devmem_pool_exhausted_total").absolute(region.exhausted_waits());
    if let Some(free) = free {
        metrics::gauge!("shardwire_devmem_niovs", "state" => "free").set(free as f64);
        metrics::gauge!("shardwire_devmem_niovs", "state" => "in_use").set((total - free) as f64);
    }
}

/// The node's binding as JSON (`null` in host mode).
pub(crate) fn devmem_json(node: &Node) -> serde_json::Value {
    let Some(region) = node.devmem() else {
        return serde_json::Value::Null;
    };
    let c = &region.counters;
    let (free, total) = region.niovs();
    let (ifname, queues) = region.queues().unzip();
    json!({
        "binding": region.id(), "kind": region.kind(), "bytes": region.bytes(),
        "interface": ifname, "queues": queues,
        "niovs": total, "niovs_free": free, "pool_exhausted": region.exhausted_waits(),
        "frags": c.frags.load(Ordering::Relaxed),
        "dmabuf_bytes": c.dmabuf_bytes.load(Ordering::Relaxed),
        "tokens_returned": c.tokens_returned.load(Ordering::Relaxed),
        "linear_bytes": c.linear_bytes.load(Ordering::Relaxed),
        "plain_bytes": c.plain_bytes.load(Ordering::Relaxed),
    })
}

fn stream_json(s: &crate::node::stream::StreamShared) -> serde_json::Value {
    let (ready, leased, next) = s.counts();
    json!({
        "id": s.id, "dataset": s.dataset, "rank": s.spec.rank, "world_size": s.spec.world_size,
        "seed": s.spec.seed, "epochs": s.epochs, "batches_per_epoch": s.spec.per_rank(),
        "delivered": next, "total": s.total, "ready": ready, "leased": leased,
        "region_bytes": s.pool.capacity(), "region_used": s.pool.used(),
        "state": s.state(),
    })
}

fn streams_json(node: &Node) -> Vec<serde_json::Value> {
    let streams: Vec<_> = node
        .streams
        .lock()
        .expect("poisoned")
        .values()
        .cloned()
        .collect();
    streams.iter().map(|s| stream_json(s)).collect()
}

async fn streams(State(node): State<Arc<Node>>) -> Json<serde_json::Value> {
    let streams = streams_json(&node);
    Json(json!({ "streams": streams }))
}

async fn status(State(node): State<Arc<Node>>) -> Json<serde_json::Value> {
    let c = &node.counters;
    let sources: Vec<_> = node
        .links
        .iter()
        .map(|l| {
            json!({
                "addr": l.addr, "up": l.is_up(), "in_flight": l.in_flight(),
                "cancels_sent": l.cancels.sent.load(Ordering::Relaxed),
                "cancelled": l.cancels.confirmed.load(Ordering::Relaxed),
                "bytes_received": l.bytes.load(Ordering::Relaxed),
                "last_error": *l.last_error.lock().expect("poisoned"),
            })
        })
        .collect();
    let streams = streams_json(&node);
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "mode": { "receive": node.receive().to_string(), "memory": node.memory(), "reason": node.mode_reason() },
        "devmem": devmem_json(&node),
        "draining": node.draining.load(Ordering::Acquire),
        "nics": node.nics,
        "gpus": node.gpus,
        "data_addr": node.data_addr.to_string(),
        "socket": node.cfg.socket,
        "pool": { "size": node.cfg.pool_size.0, "reserved": *node.reserved.lock().expect("poisoned"), "stream_memory": node.cfg.stream_memory() },
        "sources": sources,
        "streams": streams,
        "counters": {
            "bytes_received": c.bytes_received.load(Ordering::Relaxed),
            "shards_received": c.shards_received.load(Ordering::Relaxed),
            "crc_failures": c.crc_failures.load(Ordering::Relaxed),
            "refetches": c.refetches.load(Ordering::Relaxed),
            "batches_delivered": c.batches_delivered.load(Ordering::Relaxed),
        },
    }))
}
