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

/// Binds the admin endpoint's address, before the source's own and its ready line (a
/// failure stops the source at start).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("source admin address {addr}: {e}"))
}

/// The admin side of a bound source: with `listener` (bound before the source, see
/// [`bind`]), the endpoint served until `shutdown`, whose task this returns; without, the
/// status logged every minute.
pub fn start(
    listener: Option<tokio::net::TcpListener>,
    status: SourceStatus,
    shutdown: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    match listener {
        Some(l) => Some(tokio::spawn(serve(l, status, shutdown))),
        None => {
            tokio::spawn(log_status(status));
            None
        }
    }
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

/// The source's counter families (recorded in `source/src`) and their help.
const COUNTERS: &[(&str, &str)] = &[
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
        "Disk cache entries evicted to make room: cold entries (no hint names them, not served lately), least recently served first",
    ),
    (
        "shardwire_source_cache_disk_given_up_total",
        "FETCHes whose operation on the cache disk (open, CRC read, unlink) did not answer in time or could not start: the shard was read from the store instead",
    ),
    (
        "shardwire_source_cache_writes_behind_total",
        "Shards not offered to the disk cache because its writes were behind (its disk is slower than the store): served from memory, cached when read again",
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
    (
        "shardwire_source_devmem_tx_bytes_total",
        "Payload bytes sent with devmem TX, by interface (the NIC whose binding sent them)",
    ),
];

/// The source's gauge families and their help.
const GAUGES: &[(&str, &str)] = &[
    (
        "shardwire_source_cache_bytes",
        "Bytes held by a dataset's disk cache (its entries, and those being written), by dataset",
    ),
    (
        "shardwire_source_prefetch_ready_bytes",
        "Bytes read ahead and held in memory, not yet asked for (the prefetch lead), by dataset",
    ),
];

/// The source's histogram families and their help.
const HISTOGRAMS: &[(&str, &str)] = &[(
    "shardwire_source_remote_fetch_wait_seconds",
    "Time from a FETCH of an object-storage shard to its bytes being ready",
)];

/// The help of the source's metric families.
fn describe() {
    for &(name, help) in COUNTERS {
        describe_counter!(name, help);
    }
    for &(name, help) in GAUGES {
        describe_gauge!(name, help);
    }
    for &(name, help) in HISTOGRAMS {
        describe_histogram!(name, help);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `shardwire_source_*` names quoted in the `.rs` files under `dir`.
    fn quoted_names(dir: &std::path::Path, out: &mut std::collections::BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
            let path = entry.path();
            if path.is_dir() {
                quoted_names(&path, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (at, _) in text.match_indices("\"shardwire_source_") {
                let name: String = text[at + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                out.insert(name);
            }
        }
    }

    /// (Here: the configuration crate depends on no other, and the service links both.)
    #[test]
    fn the_configuration_and_the_store_agree_on_dataset_urls() {
        let served: Vec<&str> = shardwire_store::Scheme::ALL.iter().map(|s| s.1).collect();
        assert_eq!(shardwire_config::DATASET_URL_SCHEMES.as_slice(), served);
        // What the store's errors hide, the configuration's hide too.
        for url in [
            "s3a://AKIAEXAMPLE:tok3n@bkt/ds",
            "https://u:p@host/ds?sig=tok3n",
            "s3://AKIA:wJal/rXtok3n@bkt/ds",
            "https://user:pa#tok3n@host/ds",
            "s3://k:se?tok3n@b/p?x=1",
            "bkt/ds?X-Amz-Signature=tok3n&r=https://x",
        ] {
            assert!(!shardwire_store::redacted(url).contains("tok3n"), "{url}");
            let spec = format!("d={url}");
            let shown = shardwire_config::redacted_spec(&spec);
            assert!(!shown.contains("tok3n"), "{spec}: {shown}");
        }
    }

    #[test]
    fn every_family_the_source_records_has_its_help() {
        // Before: shardwire_source_devmem_tx_bytes_total had no `# HELP` line.
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../source/src");
        let mut names = std::collections::BTreeSet::new();
        quoted_names(std::path::Path::new(src), &mut names);
        assert!(
            names.contains("shardwire_source_bytes_sent_total"),
            "{names:?}"
        );
        let described: Vec<&str> = [COUNTERS, GAUGES, HISTOGRAMS]
            .iter()
            .flat_map(|t| t.iter().map(|f| f.0))
            .collect();
        for name in &names {
            assert!(
                described.contains(&name.as_str()),
                "{name} is recorded in source/src but has no help in source_admin::describe"
            );
        }
    }
}
