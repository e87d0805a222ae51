//! The shardwire node service as a library: links to shard sources, receiver threads,
//! streams, and the trainer Unix socket. The `shardwire` binary puts its admin and trainer
//! HTTP fronts on top of it; this crate serves no HTTP.
//!
//! Control plane (tokio): one link task per source ([`link`]: handshake, manifests,
//! FETCH/SHARD), one fetcher task per stream ([`stream::fetcher`]), the data-port acceptor
//! ([`plane`]) and the control task that applies admin changes ([`control`]). Data path
//! (threads): one receiver per data connection ([`receiver`]: `recv` straight into the shard's
//! slab, CRC-32C while the bytes are cache-hot) and one thread per trainer connection
//! ([`socket`]). The data path never waits on the control plane except for the announcement
//! that tells a receiver where its next payload goes.
//!
//! Layers, each using only those below it: [`node`] (what the fronts see) over [`admission`],
//! [`info`] and [`plane`]; the plane over [`link`], [`matcher`] and [`receiver`]; all of
//! them over [`fetch`] (a fetch in flight and its one way to end) and [`counters`].

pub mod admission;
pub mod binding;
pub mod control;
pub mod counters;
pub mod devmem_rx;
pub mod fetch;
pub mod info;
pub mod link;
pub mod matcher;
pub mod node;
pub mod plane;
pub mod receiver;
pub mod socket;
mod start;
pub mod status;
pub mod stream;
pub mod uring_rx;

pub use control::{BindingSpec, Control, ControlError, Reply};
pub use node::Node;
pub use start::{NodeHandle, StartError, read_secret, start};
pub use status::Status;
pub use stream::open::OpenError;
pub use stream::{Batch, Next, Stream, StreamInfo};
