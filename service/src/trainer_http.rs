//! Trainer operations over HTTP, for trainers that cannot share memory with the node.
//! (Routes are added by the HTTP trainer API work; this module currently serves none.)

use std::sync::Arc;

use axum::Router;

use crate::node::Node;

/// The trainer HTTP routes, merged into the admin server.
pub fn router(node: Arc<Node>) -> Router {
    let _ = node;
    Router::new()
}
