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
mod stall;
pub mod trainer;

use std::sync::Arc;

use shardwire_node::Node;
use tokio::sync::watch;

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
        &node.info().cfg.sources,
        node.status().lanes.len() as u32,
    );
    let mut stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = prom::upkeep() => {}
            _ = stop.changed() => {}
        }
    });
    let app = admin::router(Arc::clone(&node)).merge(trainer::router(node));
    server::serve(listener, app, limits, shutdown).await;
}
