//! The source's admin endpoint (`admin = IP:PORT`): `GET /v1/status` (its datasets and, for
//! object storage, the store, the bucket's window, the read-ahead and the cache) and
//! `GET /metrics` (Prometheus, `shardwire_source_*`). Without an admin address the same
//! status is logged every minute instead.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use metrics::{describe_counter, describe_gauge, describe_histogram};
use shardwire_source::SourceStatus;
use tokio::sync::watch;

use crate::http::prom;
use crate::http::server::{self, Limits};

/// How often the status is logged without an admin address.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// Binds the admin endpoint's address (a failure stops the source at start).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("source admin address {addr}: {e}"))
}

/// Serves the admin endpoint on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    status: SourceStatus,
    shutdown: watch::Receiver<bool>,
) {
    prom::handle();
    describe();
    shardwire_store::metrics::describe();
    if let Ok(a) = listener.local_addr() {
        tracing::info!(admin = %a, "source admin endpoint: /v1/status, /metrics");
    }
    let app = Router::new()
        .route("/v1/status", get(status_json))
        .route("/metrics", get(metrics_text))
        .with_state(status);
    let limits = Limits {
        max_connections: 64,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(10),
        write_timeout: Duration::from_secs(30),
    };
    server::serve(listener, app, limits, shutdown).await;
}

async fn status_json(State(s): State<SourceStatus>) -> axum::Json<serde_json::Value> {
    axum::Json(s.json())
}

async fn metrics_text() -> String {
    prom::handle().render()
}

/// Logs the status every [`LOG_EVERY`] (a source without an admin address).
pub async fn log_status(status: SourceStatus) {
    let mut tick = tokio::time::interval(LOG_EVERY);
    tick.tick().await;
    loop {
        tick.tick().await;
        tracing::info!(status = %status.json(), "source status");
    }
}

/// The help of the source's metric families.
fn describe() {
    for (name, help) in [
        (
            "shardwire_source_bytes_sent_total",
            "Payload bytes sent to nodes",
        ),
        (
            "shardwire_source_shards_sent_total",
            "Payloads sent to nodes",
        ),
        (
            "shardwire_source_fetches_cancelled_total",
            "FETCHes nodes cancelled before they were sent",
        ),
        (
            "shardwire_source_fetches_refused_draining_total",
            "FETCHes refused because the source is draining",
        ),
        (
            "shardwire_source_remote_fetches_total",
            "FETCHes of object-storage shards, by how they were served (prefetched: from memory read ahead; cached: from the disk cache; read: read from the store for the FETCH)",
        ),
        (
            "shardwire_source_cache_evictions_total",
            "Disk cache entries evicted (what is needed furthest in the future goes first)",
        ),
        (
            "shardwire_source_prefetch_wasted_bytes_total",
            "Bytes read ahead and dropped unsent (their stream went away)",
        ),
        (
            "shardwire_source_origin_crc_failures_total",
            "Shards whose bytes from the store did not match the manifest's CRC-32C (read again once, then refused)",
        ),
        (
            "shardwire_source_store_shard_bytes_total",
            "Verified shard bytes read from object storage",
        ),
    ] {
        describe_counter!(name, help);
    }
    describe_gauge!(
        "shardwire_source_cache_bytes",
        "Bytes held by the disk cache"
    );
    describe_gauge!(
        "shardwire_source_prefetch_ready_bytes",
        "Bytes read ahead and held in memory, not yet asked for (the prefetch lead)"
    );
    describe_histogram!(
        "shardwire_source_remote_fetch_wait_seconds",
        "Time from a FETCH of an object-storage shard to its bytes being ready"
    );
}
