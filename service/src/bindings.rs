//! Admin endpoints for devmem RX bindings: `GET /v1/bindings`, `POST /v1/bindings` (create)
//! and `DELETE /v1/bindings/{id}`; the mutating ones need the admin bearer token.
//!
//! A node has at most one binding. Creating one (a NIC's queues bound to a fresh udmabuf, or
//! `"interface": "emulator"` for the kernel-faithful emulator) makes the source links
//! reconnect, so every data connection comes back through the devmem path; shards in flight
//! are fetched again, nothing is lost. Deleting one switches new data connections to plain
//! TCP, makes the links reconnect, waits until no data connection reads from the binding any
//! more (so no frag is outstanding: tokens go back right after each gather) and then unbinds
//! (closing the netlink socket) and restores the NIC. Leases do not pin a binding: frags are
//! gathered into the stream's own region before a trainer sees them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use shardwire_config::ByteSize;

use crate::admin::{api_error, authorize, devmem_json};
use crate::node::Node;
use crate::node::devmem_rx::RxRegion;

/// The interface name that asks for the emulator instead of a NIC.
pub const EMULATOR: &str = "emulator";

/// `POST /v1/bindings` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBinding {
    /// NIC name, or `"emulator"`.
    interface: String,
    /// RX queues (default: the upper half of the NIC's RX queues).
    #[serde(default)]
    queues: Vec<u32>,
    /// Dma-buf size, e.g. `"64MiB"` (default: `devmem_memory`).
    memory: Option<String>,
}

/// `GET /v1/bindings`: the node's devmem RX bindings (empty in host mode).
pub async fn list(State(node): State<Arc<Node>>) -> Json<serde_json::Value> {
    let list: Vec<serde_json::Value> = match devmem_json(&node) {
        serde_json::Value::Null => Vec::new(),
        b => vec![b],
    };
    Json(json!({ "receive": node.receive().to_string(), "bindings": list }))
}

fn conflict(code: &str, message: String) -> Response {
    api_error(StatusCode::CONFLICT, code, message)
}

/// `POST /v1/bindings`.
pub async fn create(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: Result<Json<CreateBinding>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(r) = authorize(&node, &headers) {
        return r;
    }
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, "bad_request", e.body_text()),
    };
    if let Some(b) = node.devmem() {
        return conflict(
            "binding_exists",
            format!(
                "binding {} exists; delete it first (one binding per node)",
                b.id()
            ),
        );
    }
    let bytes = match req.memory.as_deref().map(str::parse::<ByteSize>) {
        None => node.cfg.devmem_memory.0 as usize,
        Some(Ok(b)) if b.0 >= 1 << 20 => b.0 as usize,
        Some(Ok(b)) => {
            return api_error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("memory {b} is below the minimum of 1MiB"),
            );
        }
        Some(Err(e)) => {
            return api_error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("memory: {e}"),
            );
        }
    };
    let made = if req.interface == EMULATOR {
        RxRegion::emulated(bytes, node.cuda.clone()).map_err(|e| conflict("bind_failed", e))
    } else {
        bind_nic(&node, &req.interface, req.queues, bytes).await
    };
    let region = match made {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let what = match region.queues() {
        Some((ifname, q)) => format!("{ifname} RX queues {q:?}"),
        None => "the emulator (NOT GPU-direct)".to_string(),
    };
    node.set_devmem(
        Some(Arc::clone(&region)),
        format!(
            "receive changed over the admin API: binding {} on {what}, {} dma-buf",
            region.id(),
            ByteSize(bytes as u64)
        ),
    );
    for l in &node.links {
        l.kick(); // data connections come back through the new path
    }
    tracing::info!(binding = region.id(), %what, "devmem binding created over the admin API");
    (StatusCode::CREATED, Json(devmem_json(&node))).into_response()
}

async fn bind_nic(
    node: &Node,
    ifname: &str,
    queues: Vec<u32>,
    bytes: usize,
) -> Result<Arc<RxRegion>, Response> {
    let nics = tokio::task::spawn_blocking(shardwire_devmem::probe::probe_nics)
        .await
        .unwrap_or_default();
    let Some(nic) = nics.iter().find(|n| n.name == ifname) else {
        return Err(api_error(
            StatusCode::NOT_FOUND,
            "unknown_interface",
            format!("no interface named {ifname} (or `{EMULATOR}` for the emulator)"),
        ));
    };
    if !nic.devmem_capable {
        return Err(conflict(
            "not_capable",
            format!("{ifname} cannot do devmem: {}", nic.reason),
        ));
    }
    let queues = if queues.is_empty() {
        (nic.rx_queues / 2..nic.rx_queues).collect()
    } else {
        queues
    };
    let cuda = node.cuda.clone();
    let (name, ifindex, state, port) = (
        nic.name.clone(),
        nic.ifindex,
        node.cfg.nic_state_file.clone(),
        node.data_addr.port(),
    );
    tokio::task::spawn_blocking(move || {
        RxRegion::bind_kernel(&name, ifindex, &queues, bytes, &state, port, cuda)
    })
    .await
    .map_err(|e| conflict("bind_failed", e.to_string()))?
    .map_err(|e| conflict("bind_failed", format!("{ifname}: {e}")))
}

/// `DELETE /v1/bindings/{id}`.
pub async fn delete(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = authorize(&node, &headers) {
        return r;
    }
    let Some(region) = node.devmem().filter(|r| r.id().to_string() == id) else {
        return api_error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no binding {id}"),
        );
    };
    node.set_devmem(
        None,
        format!(
            "receive changed over the admin API: binding {id} deleted; plain TCP into host memory"
        ),
    );
    for l in &node.links {
        l.kick();
    }
    // Wait until no data connection reads from the binding (ours is the last reference).
    let started = Instant::now();
    let limit = Duration::from_secs(node.cfg.drain_timeout_secs);
    while Arc::strong_count(&region) > 1 && started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let readers_left = Arc::strong_count(&region) - 1;
    let r = Arc::clone(&region);
    let _ = tokio::task::spawn_blocking(move || r.unbind()).await;
    tracing::info!(binding = %id, readers_left, waited_ms = started.elapsed().as_millis() as u64, "devmem binding deleted over the admin API");
    Json(json!({
        "deleted": region.id(),
        "waited_ms": started.elapsed().as_millis() as u64,
        "readers_left": readers_left,
    }))
    .into_response()
}
