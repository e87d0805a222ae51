//! The node's HTTP fronts on one port (the admin address): the admin/ops API ([`admin`],
//! [`bindings`], Prometheus in [`prom`]) and the trainer HTTP API ([`trainer`]), over one
//! server with bounded connection states ([`server`]), one error type and one token check
//! ([`error`]). They see the node only through its public interface.

pub mod admin;
pub mod bindings;
mod copies;
pub mod error;
pub mod prom;
pub mod server;
mod single_flight;
mod stall;
pub mod trainer;

use std::sync::Arc;

use axum::http::{Method, StatusCode, Uri};
use shardwire_node::Node;
use shardwire_protocol::trainer::ErrorCode;
use tokio::sync::watch;

use error::ApiError;

/// Serves the admin and trainer HTTP APIs on `listener` until `shutdown` turns true.
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) {
    let limits = server::Limits::from_config(&node.info().cfg);
    prom::handle();
    prom::register_zero(
        &node.receive().to_string(),
        node.status().lanes.len() as u32,
    );
    let mut stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = prom::upkeep() => {}
            _ = stop.changed() => {}
        }
    });
    let app = admin::router(Arc::clone(&node))
        .merge(trainer::router(node))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method);
    server::serve(listener, app, limits, shutdown).await;
}

/// The JSON error of a path no route serves (axum's own answer has an empty body).
async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!(
            "no route {method} {}: docs/OPERATIONS.md and docs/TRAINER_API.md list them",
            uri.path()
        ),
    )
}

/// The JSON error of a method a route does not take.
async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::bad_request(format!(
        "{} does not take {method}: docs/OPERATIONS.md and docs/TRAINER_API.md list its methods",
        uri.path()
    ))
    .with_status(StatusCode::METHOD_NOT_ALLOWED)
}
