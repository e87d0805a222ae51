//! The shardwire node service as a library: links to shard sources, receiver threads,
//! streams, and the trainer Unix socket. The `shardwire` binary puts its admin and trainer
//! HTTP fronts on top of it; this crate serves no HTTP.
//!
//! Control plane (tokio): one link task per source (`link`: handshake, manifests,
//! FETCH/SHARD), one task per stream (`stream`: fetch ahead, assemble batches), the
//! data-port acceptor (`plane`) and the control task that applies admin changes (`control`).
//! Data path (threads): one receiver per data connection (`rx`: the receive path chosen once
//! per connection, CRC-32C while the bytes are cache-hot) and one thread per trainer
//! connection (`socket`). The data path never waits on the control plane except for the
//! announcement that tells a receiver where its next payload goes.
//!
//! Layers, each using only those below it: `node` (what the fronts see) over `admission`,
//! `info`, `control`, `status`, `stream` and `plane`; the plane (the warnings any peer can
//! cause rate-limited by `shardwire_protocol::warn_limit`) over `link`, `matcher`, `binding`,
//! `rx`, `ingress` (the NIC a data connection came in on, against its lane's; over `lanes`
//! and `matcher`) and `lanes`
//! (each GPU/NIC pair: its plan, GPU, listener, CPUs; a leaf over the topology, GPU and devmem
//! crates); streams and receivers over `fetch` (a fetch in
//! flight and its one way to end; it carries `rx::error`, a leaf) and `counters`. The fronts see the
//! facade re-exported here: [`Node`] and [`Stream`], [`start`] and [`NodeHandle`], the
//! control messages and the status document; `shardwire bench` also gets the receive
//! primitives in [`bench`].

mod admission;
mod binding;
mod control;
mod counters;
mod discovery;
mod fetch;
mod info;
mod ingress;
mod lanes;
mod link;
mod matcher;
mod node;
mod plane;
mod roster;
mod rx;
mod socket;
mod start;
mod status;
mod stream;

pub use binding::BindingKind;
pub use control::{BindingSpec, Control, ControlError, Reply};
pub use counters::{COUNTERS, CounterDef, CounterStatus, Counters, FlowStats, Label, Unit};
pub use info::Info;
pub use lanes::open::{LaneStartError, cuda_devices};
pub use lanes::plan::{Inputs as LaneInputs, LaneGpu, LaneSpec, PlanError, plan as plan_lanes};
pub use lanes::{DeviceError, Excluded};
pub use node::Node;
pub use plane::Flow;
pub use start::{NodeHandle, StartError, read_secret, start};
pub use status::{BindingStatus, LaneStatus, Mode, PoolStatus, SourceStatus, Status};
pub use stream::{Batch, CloseReason, Next, OpenError, Stream, StreamInfo};

/// The receive primitives `shardwire bench` measures the node's own reader with, and the
/// gather's prefetch (`examples/gather_speed.rs`).
pub mod bench {
    pub use crate::rx::copy::copy_nt;
    pub use crate::rx::recv::Plain;
    pub use crate::rx::shared::{CHUNK, PayloadRead, RCVLOWAT, lowat_for};
    pub use crate::stream::prefetch::{AHEAD as PREFETCH_AHEAD, prefetch};
}
