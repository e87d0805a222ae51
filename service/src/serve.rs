//! The node service as the binary runs it: the node library with the HTTP fronts on its admin
//! address.

use std::net::SocketAddr;

use anyhow::Context;
use shardwire_config::ServeConfig;
use shardwire_node::NodeHandle;

/// A running node with its HTTP fronts.
pub struct Service {
    /// The node.
    pub handle: NodeHandle,
    /// The admin address actually bound.
    pub admin_addr: SocketAddr,
    /// The HTTP server; it ends after the node's shutdown, once open requests are answered.
    pub http: tokio::task::JoinHandle<()>,
}

/// Binds the admin address, starts the node and serves the HTTP fronts on it. The address is
/// bound first: one taken fails the start before the node has set anything up (NICs, the
/// trainer socket, source links) that an exit would leave behind.
pub async fn start(cfg: ServeConfig) -> anyhow::Result<Service> {
    let admin = cfg.admin;
    let listener = tokio::net::TcpListener::bind(admin)
        .await
        .with_context(|| format!("cannot bind the admin API on {admin}"))?;
    let admin_addr = listener.local_addr()?;
    let handle = shardwire_node::start(cfg).await?;
    let node = std::sync::Arc::clone(&handle.node);
    let http = tokio::spawn(crate::http::serve(node, listener, handle.shutdown_signal()));
    tracing::info!(admin = %admin_addr, "node service ready");
    Ok(Service {
        handle,
        admin_addr,
        http,
    })
}
