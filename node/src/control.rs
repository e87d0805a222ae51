//! Admin changes as typed messages (DESIGN §3: the control plane sends messages; the data
//! path never waits on it). The admin front sends a [`Control`] and awaits its [`Reply`]; one
//! task applies them in order, so two binding changes never interleave.

use shardwire_protocol::trainer::ErrorCode;

use crate::binding::BindingError;
use crate::status::BindingStatus;

/// An admin change.
#[derive(Debug, Clone)]
pub enum Control {
    /// Create the RX binding.
    CreateBinding(BindingSpec),
    /// Delete the RX binding with this id (of whichever lane has it).
    DeleteBinding {
        /// The binding id as the API names it.
        id: String,
    },
    /// Refuse new streams; the node exits once the open ones are gone (or at the timeout).
    Drain,
    /// Close a stream (an operator's close).
    CloseStream {
        /// The stream.
        id: u64,
        /// Why, for its trainer.
        reason: crate::stream::CloseReason,
    },
}

/// What binding to create.
#[derive(Debug, Clone)]
pub enum BindingSpec {
    /// The kernel-faithful emulator.
    Emulator {
        /// Dma-buf bytes.
        bytes: usize,
        /// The lane (`None`: lane 0).
        lane: Option<u32>,
    },
    /// A NIC's RX queues.
    Nic {
        /// The interface.
        name: String,
        /// Queues (empty: the upper half).
        queues: Vec<u32>,
        /// Dma-buf bytes.
        bytes: usize,
        /// The lane (`None`: the lane whose NIC it is, else lane 0).
        lane: Option<u32>,
    },
}

/// What a change did.
#[derive(Debug, Clone)]
pub enum Reply {
    /// The binding now in effect.
    Binding(BindingStatus),
    /// A binding was deleted after its readers let go (or the wait ran out).
    Deleted {
        /// Its id.
        id: u32,
        /// How long the deletion waited for data connections to leave it.
        waited_ms: u64,
        /// Data connections still reading from it when it was unbound.
        readers_left: usize,
    },
    /// Draining started.
    Draining {
        /// Streams still open.
        streams_open: usize,
        /// How long the drain waits for them.
        timeout_secs: u64,
    },
    /// A stream was closed.
    Closed {
        /// The stream.
        id: u64,
    },
}

/// Why a change was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A binding change failed.
    #[error(transparent)]
    Binding(#[from] BindingError),
    /// No open stream with that id.
    #[error("no open stream {0}")]
    NoStream(u64),
    /// The node is shutting down: no task takes changes any more.
    #[error("the node is shutting down")]
    ShuttingDown,
    /// A binding change asked for (or reached in the queue) once the node began draining:
    /// the shutdown must not cut one short, and the drain must not wait for new ones.
    #[error(
        "the node is draining: binding changes are refused until it restarts (one under way when the drain began finishes first)"
    )]
    Draining,
}

impl ControlError {
    /// The API code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Binding(e) => e.code(),
            Self::NoStream(_) => ErrorCode::NotFound,
            Self::ShuttingDown | Self::Draining => ErrorCode::Draining,
        }
    }
}
