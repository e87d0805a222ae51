//! Admin endpoints for devmem RX bindings: `GET /v1/bindings`, `POST /v1/bindings` (create)
//! and `DELETE /v1/bindings/{id}`; the mutating ones need the admin bearer token and go to
//! the node as control messages.
//!
//! A node has at most one binding per lane, each its own dma-buf and id. Creating one on a
//! lane (`"lane": N`; default the lane of the named NIC, else lane 0; a NIC's queues bound to
//! a fresh udmabuf, or `"interface": "emulator"` for the kernel-faithful emulator's NIC of
//! that lane) makes the source links
//! reconnect, so every data connection comes back through the devmem path; shards in flight
//! are fetched again, nothing is lost. Deleting one switches new data connections to plain
//! TCP, makes the links reconnect, waits until no data connection reads from the binding any
//! more (so no frag is outstanding: tokens go back right after each gather) and then unbinds
//! (closing the netlink socket) and restores the NIC. Leases do not pin a binding: frags are
//! gathered into the stream's own region before a trainer sees them.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use shardwire_config::ByteSize;
use shardwire_node::{BindingSpec, Control, Node, Reply};
use shardwire_protocol::trainer::ErrorCode;

use super::error::{ApiError, authorize};

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
    /// The lane (default: the lane whose NIC `interface` is, else lane 0).
    lane: Option<u32>,
}

/// `GET /v1/bindings`: the node's devmem RX bindings, one per bound lane with its `lane`
/// (empty in host mode).
pub async fn list(State(node): State<Arc<Node>>) -> Json<serde_json::Value> {
    let list = node.binding_statuses();
    Json(json!({ "receive": node.receive().to_string(), "bindings": list }))
}

/// `POST /v1/bindings`.
pub async fn create(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: Result<Json<CreateBinding>, JsonRejection>,
) -> Result<Response, ApiError> {
    authorize(&node, &headers)?;
    let Json(req) = body.map_err(|e| {
        let status = match e {
            JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::bad_request(e.body_text()).with_status(status)
    })?;
    let bytes = match req.memory.as_deref().map(str::parse::<ByteSize>) {
        None => node.info().cfg.devmem_memory.0 as usize,
        Some(Ok(b)) if b.0 >= 1 << 20 => b.0 as usize,
        Some(Ok(b)) => {
            return Err(ApiError::bad_request(format!(
                "memory {b} is below the minimum of 1MiB"
            )));
        }
        Some(Err(e)) => return Err(ApiError::bad_request(format!("memory: {e}"))),
    };
    let spec = if req.interface == EMULATOR {
        if !req.queues.is_empty() {
            return Err(ApiError::bad_request(format!(
                "queues {:?}: the emulator binds its lane's configured queues; leave `queues` out",
                req.queues
            )));
        }
        BindingSpec::Emulator {
            bytes,
            lane: req.lane,
        }
    } else {
        BindingSpec::Nic {
            name: req.interface,
            queues: req.queues,
            bytes,
            lane: req.lane,
        }
    };
    match node.control(Control::CreateBinding(spec)).await? {
        Reply::Binding(b) => Ok((StatusCode::CREATED, Json(b)).into_response()),
        other => Err(ApiError::new(
            ErrorCode::Internal,
            format!("create answered {other:?}"),
        )),
    }
}

/// `DELETE /v1/bindings/{id}`.
pub async fn delete(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&node, &headers)?;
    match node.control(Control::DeleteBinding { id }).await? {
        Reply::Deleted {
            id,
            waited_ms,
            readers_left,
        } => Ok(Json(
            json!({ "deleted": id, "waited_ms": waited_ms, "readers_left": readers_left }),
        )
        .into_response()),
        other => Err(ApiError::new(
            ErrorCode::Internal,
            format!("delete answered {other:?}"),
        )),
    }
}
