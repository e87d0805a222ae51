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
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use shardwire_config::{ByteSize, MAX_SIZE, ServeConfig};
use shardwire_node::{BindingSpec, Control, LaneStatus, Node, Reply};
use shardwire_protocol::trainer::ErrorCode;

use super::error::{ApiError, authorize, path_error};

/// The interface name that asks for the emulator instead of a NIC.
pub const EMULATOR: &str = "emulator";

/// `POST /v1/bindings` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBinding {
    /// NIC name, or `"emulator"`.
    interface: String,
    /// RX queues (default: the lane's, as configured or paired: its share of the NIC's).
    #[serde(default)]
    queues: Vec<u32>,
    /// Dma-buf size, e.g. `"64MiB"` (default: the lane's `devmem_memory`).
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
    let spec = spec_of(req, &node.status().lanes, &node.info().cfg)?;
    match node.control(Control::CreateBinding(spec)).await? {
        Reply::Binding(b) => Ok((StatusCode::CREATED, Json(b)).into_response()),
        other => Err(ApiError::new(
            ErrorCode::Internal,
            format!("create answered {other:?}"),
        )),
    }
}

/// The binding a request asks for, with what it leaves out taken from its lane's own
/// configuration, as start-up binds that lane ([`lane_defaults`]).
fn spec_of(
    req: CreateBinding,
    lanes: &[LaneStatus],
    cfg: &ServeConfig,
) -> Result<BindingSpec, ApiError> {
    let (memory, queues) = lane_defaults(lanes, cfg, req.lane, &req.interface);
    let bytes = memory_of(req.memory.as_deref(), memory)?;
    if req.interface == EMULATOR {
        if !req.queues.is_empty() {
            return Err(ApiError::bad_request(format!(
                "queues {:?}: the emulator binds its lane's configured queues; leave `queues` out",
                req.queues
            )));
        }
        within_emulator(bytes)?;
        return Ok(BindingSpec::Emulator {
            bytes,
            lane: req.lane,
        });
    }
    Ok(BindingSpec::Nic {
        name: req.interface,
        queues: if req.queues.is_empty() {
            queues
        } else {
            req.queues
        },
        bytes,
        lane: req.lane,
    })
}

/// The dma-buf size a request's `memory` asks for (`default`, the lane's, when it names
/// none): between 1 MiB and [`MAX_SIZE`], the bounds the configuration puts on
/// `devmem_memory`.
fn memory_of(memory: Option<&str>, default: u64) -> Result<usize, ApiError> {
    let Some(memory) = memory else {
        return Ok(default as usize);
    };
    let b = memory
        .parse::<ByteSize>()
        .map_err(|e| ApiError::bad_request(format!("memory: {e}")))?;
    if b.0 < 1 << 20 {
        return Err(ApiError::bad_request(format!(
            "memory {b} is below the minimum of 1MiB"
        )));
    }
    if b.0 > MAX_SIZE {
        return Err(ApiError::bad_request(format!(
            "memory {b} is above the maximum of {} (the limit of devmem_memory)",
            ByteSize(MAX_SIZE)
        )));
    }
    usize::try_from(b.0).map_err(|_| {
        ApiError::bad_request(format!("memory {b} does not fit this host's address space"))
    })
}

/// Refuses an emulator binding of `bytes` the emulator cannot make: from 16 TiB on, more
/// net_iovs than a `u32` names (the node refused it only after queueing the request, as
/// `bind_failed` with the size in raw bytes).
fn within_emulator(bytes: usize) -> Result<(), ApiError> {
    use shardwire_devmem::emu::{MAX_NIOVS, NIOV_SIZE};
    if bytes / NIOV_SIZE <= MAX_NIOVS {
        return Ok(());
    }
    let limit = ByteSize(((MAX_NIOVS + 1) * NIOV_SIZE) as u64);
    Err(ApiError::bad_request(format!(
        "memory {}: the emulator's dma-buf must be below {limit} (at most {MAX_NIOVS} net_iovs \
         of {}); ask for less memory",
        ByteSize(bytes as u64),
        ByteSize(NIOV_SIZE as u64)
    )))
}

/// The dma-buf size and RX queues of the lane a binding request is for, as start-up binds it:
/// its `lanes[i].devmem_memory`, else `devmem_memory`; its queues as configured or paired
/// (two lanes on one NIC each bind their own share; empty: the binding's default). The lane
/// is found as the node finds it: the one named, else the one whose NIC `interface` is, else
/// lane 0. A lane that does not exist gets the node's defaults (the node refuses it).
fn lane_defaults(
    lanes: &[LaneStatus],
    cfg: &ServeConfig,
    lane: Option<u32>,
    interface: &str,
) -> (u64, Vec<u32>) {
    let found = match lane {
        Some(n) => lanes.iter().find(|l| l.lane == n),
        None => lanes
            .iter()
            .find(|l| interface != EMULATOR && l.nic.as_deref() == Some(interface))
            .or(lanes.first()),
    };
    match found {
        Some(l) => (l.devmem_memory, l.queues.clone()),
        None => (cfg.devmem_memory.0, Vec::new()),
    }
}

/// `DELETE /v1/bindings/{id}`.
pub async fn delete(
    State(node): State<Arc<Node>>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&node, &headers)?;
    let Path(id) = id.map_err(path_error)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use shardwire_config::{LaneConfig, Lanes};
    use shardwire_protocol::trainer::MemoryKind;

    fn lane_status(lane: u32, nic: &str, queues: Vec<u32>, devmem_memory: u64) -> LaneStatus {
        LaneStatus {
            lane,
            gpu: None,
            uuid: None,
            nic: Some(nic.to_owned()),
            nic_pci: None,
            distance: None,
            numa_node: None,
            data_addr: format!("10.0.0.1:{}", 7401 + lane),
            memory: MemoryKind::Host,
            cpus: String::new(),
            queues,
            devmem_memory,
            devmem: false,
            binding: None,
            streams: 0,
            pool_reserved: 0,
            pool_size: 1 << 30,
            bytes_received: 0,
            data_connections: 0,
            data_connections_refused: 0,
            data_connections_on_nic: 0,
            data_connections_wrong_nic: 0,
            data_connections_nic_unknown: 0,
            why: String::new(),
            warn: false,
            notes: Vec::new(),
        }
    }

    /// What `spec_of` makes of `body` on two lanes sharing eth0, lane 1 with its own memory:
    /// (queues, bytes, lane) of a NIC binding, or (no queues, bytes, lane) of the emulator.
    fn spec(body: serde_json::Value) -> (Vec<u32>, usize, Option<u32>) {
        let cfg = ServeConfig {
            lanes: Lanes::Table(vec![
                LaneConfig {
                    interface: Some("eth0".into()),
                    ..LaneConfig::default()
                },
                LaneConfig {
                    interface: Some("eth0".into()),
                    devmem_memory: Some(ByteSize(8 << 20)),
                    ..LaneConfig::default()
                },
            ]),
            ..ServeConfig::default()
        };
        let lanes = [
            lane_status(0, "eth0", vec![8, 9], cfg.devmem_memory.0),
            lane_status(1, "eth0", vec![10, 11], 8 << 20),
        ];
        let req: CreateBinding = serde_json::from_value(body).unwrap();
        match spec_of(req, &lanes, &cfg).unwrap() {
            BindingSpec::Nic {
                queues,
                bytes,
                lane,
                ..
            } => (queues, bytes, lane),
            BindingSpec::Emulator { bytes, lane } => (Vec::new(), bytes, lane),
        }
    }

    #[test]
    fn a_binding_takes_its_lanes_memory_and_queues_where_the_request_names_none() {
        // Before: the node's devmem_memory, and no queues (the upper half of all of eth0:
        // the other lane's share too).
        let node_memory = ServeConfig::default().devmem_memory.0 as usize;
        let eth0 = |lane: u32| json!({ "interface": "eth0", "lane": lane });
        assert_eq!(spec(eth0(1)), (vec![10, 11], 8 << 20, Some(1)));
        assert_eq!(spec(eth0(0)), (vec![8, 9], node_memory, Some(0)));
        // No lane named: the first lane on the interface, as the node picks it.
        let first = spec(json!({ "interface": "eth0" }));
        assert_eq!(first, (vec![8, 9], node_memory, None));
        let emulator = spec(json!({ "interface": "emulator", "lane": 1 }));
        assert_eq!(emulator, (vec![], 8 << 20, Some(1)));
        // What the request names wins.
        let named = json!({ "interface": "eth0", "lane": 1, "queues": [3], "memory": "2MiB" });
        assert_eq!(spec(named), (vec![3], 2 << 20, Some(1)));
    }

    #[test]
    fn a_binding_larger_than_the_config_allows_is_refused() {
        // Before: any size past 1 MiB went to the node (65TiB: a 16 GiB freelist).
        let lanes = [lane_status(0, "eth0", vec![], 64 << 20)];
        let cfg = ServeConfig::default();
        for memory in ["65TiB", "1024TiB"] {
            let body = json!({ "interface": "emulator", "memory": memory });
            let req: CreateBinding = serde_json::from_value(body).unwrap();
            let text = format!("{:?}", spec_of(req, &lanes, &cfg).unwrap_err());
            assert!(
                text.contains(&format!("memory {memory} is above")),
                "{text}"
            );
            assert!(text.contains("64TiB"), "the limit is named: {text}");
        }
        // The config's bounds, both ends inclusive.
        assert_eq!(memory_of(Some("64TiB"), 0).unwrap() as u64, MAX_SIZE);
        assert_eq!(memory_of(Some("1MiB"), 0).unwrap(), 1 << 20);
        assert!(memory_of(Some("512KiB"), 0).is_err());
        assert_eq!(memory_of(None, 8 << 20).unwrap(), 8 << 20);
    }

    #[test]
    fn an_emulator_binding_past_its_limit_is_refused_with_the_limit_in_units() {
        // Before: 16-64 TiB passed here and failed at the node as `bind_failed`, naming the
        // limit in raw bytes.
        let lanes = [lane_status(0, "eth0", vec![], 64 << 20)];
        let cfg = ServeConfig::default();
        let asked = |memory: &str| {
            let body = json!({ "interface": "emulator", "memory": memory });
            let req: CreateBinding = serde_json::from_value(body).unwrap();
            spec_of(req, &lanes, &cfg)
        };
        for memory in ["16TiB", "64TiB"] {
            let text = format!("{:?}", asked(memory).unwrap_err());
            assert!(text.contains(&format!("memory {memory}:")), "{text}");
            assert!(text.contains("must be below 16TiB"), "{text}");
            assert!(text.contains("of 4KiB"), "{text}");
        }
        // Just under the limit: the emulator's (rounded down to whole net_iovs).
        assert!(asked("16383GiB").is_ok());
        assert!(within_emulator((16 << 40) - 1).is_ok());
        assert!(within_emulator(16 << 40).is_err());
        // A NIC's binding has only the configuration's limit.
        let body = json!({ "interface": "eth0", "memory": "32TiB" });
        let req: CreateBinding = serde_json::from_value(body).unwrap();
        assert!(spec_of(req, &lanes, &cfg).is_ok());
    }
}
