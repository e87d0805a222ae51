//! The messages of the trainer socket and their parts: requests, responses, the stream
//! request and its resume state, tensor views and the stable error codes (also the HTTP
//! API's).

use serde::{Deserialize, Serialize};

use crate::DType;
use crate::plan::Uneven;
pub use crate::samples::Shuffle;

/// Protocol version of the trainer socket.
pub const TRAINER_VERSION: u32 = 1;
/// Largest trainer frame.
pub const MAX_TRAINER_FRAME: usize = 1 << 20;
/// The most batches one `next` may ask for (`count`).
pub const MAX_NEXT_COUNT: u32 = 64;

/// Resumable position of a stream.
///
/// Shard mode: the next batch of this rank (its fingerprint names the rank and world size).
/// Batch mode: a global position that resumes every rank, on any world size that fits the
/// partitions with the same global batch: `index` is the next global step, `cursor` the
/// samples of the epoch consumed before it (`index * batch_size * world_size`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamState {
    /// Epoch of the next batch.
    pub epoch: u32,
    /// Index within the epoch of the next batch (batch mode: the next global step).
    pub index: u64,
    /// The seed the stream was opened with.
    pub seed: u64,
    /// Readable fingerprint of every input of the order (`field=value;...`).
    pub fingerprint: String,
    /// Batch mode: samples of the epoch before the next step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<u64>,
    /// Batch mode: the canonical partitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<u32>,
    /// Batch mode: the shuffle block in samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle_block: Option<u64>,
    /// Mixtures: where every dataset stands (its cursor) after `step` global steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mix: Option<MixState>,
}

/// A mixture's schedule at a global step: enough to continue it exactly, or with new weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixState {
    /// Global steps taken since the stream's first epoch began.
    pub step: u64,
    /// The datasets, in the mixture's order.
    pub datasets: Vec<String>,
    /// Their weights, fixed point (2^40 = all; see `samples::mix`).
    pub weights: Vec<i64>,
    /// Samples each dataset has given (its position in its own order, across its epochs).
    pub cursors: Vec<u64>,
    /// Each dataset's rounding carry (2^-40 samples; reset when the weights change).
    pub carry: Vec<i64>,
}

/// One dataset of a mixture and its weight.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixEntry {
    /// Dataset name.
    pub dataset: String,
    /// Relative weight (positive; the weights are normalised).
    pub weight: f64,
}

/// What a trainer asks for when it opens a stream: the fields of the socket's `attach` and of
/// `POST /v1/streams`, defined here once for every front and client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamRequest {
    /// Protocol version the client speaks.
    #[serde(default = "version")]
    pub version: u32,
    /// Dataset name (empty for a mixture, which names its datasets in `mix`).
    #[serde(default)]
    pub dataset: String,
    /// Shuffle seed.
    #[serde(default)]
    pub seed: u64,
    /// This trainer's rank.
    #[serde(default)]
    pub rank: u32,
    /// Number of ranks.
    #[serde(default = "one")]
    pub world_size: u32,
    /// Epochs to deliver.
    #[serde(default = "one")]
    pub epochs: u32,
    /// Uneven-dataset policy.
    #[serde(default)]
    pub uneven: Uneven,
    /// Resume from this state.
    #[serde(default)]
    pub state: Option<StreamState>,
    /// Samples per rank per step: batch mode. Absent: shard mode (one shard per batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u32>,
    /// Batch mode: `"block"` (default), `"shards"` or `"none"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle: Option<Shuffle>,
    /// Batch mode, `shuffle = "block"`: samples per shuffle block (default: the samples of
    /// [`DEFAULT_BLOCK_SHARDS`] average shards, or the resume state's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle_block: Option<u64>,
    /// Batch mode: canonical partitions (default: the world size, or the resume state's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<u32>,
    /// Batch mode: drop the last partial global batch instead of completing it with samples
    /// from the epoch's start.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drop_last: bool,
    /// Batch mode: this stream delivers the rank's batches `worker, worker + num_workers, ...`
    /// (a DataLoader worker's share).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub worker: u32,
    /// Batch mode: how many workers split the rank's batches.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub num_workers: u32,
    /// Token mode: each sample is a window of `seq_len + 1` tokens of the documents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    /// Token mode: the ragged integer tensor whose rows are the documents (needed when the
    /// dataset has several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_column: Option<String>,
    /// Token mode: deliver `tokens` as `int32` or `int64` (widened during assembly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_dtype: Option<crate::DType>,
    /// Token mode: also deliver `positions` (int32, the token's place in its document).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub boundaries: bool,
    /// Token mode: the window order, `"shardwire"` (default) or `"megatron"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<WindowOrder>,
    /// Batch mode: a mixture of datasets with weights (instead of `dataset`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mix: Option<Vec<MixEntry>>,
    /// Each `batch` reply carries `state`: where the stream resumes after that batch (so a
    /// trainer that asks for its next batch ahead of time still knows the state of the one
    /// it is using, without a `state` round trip). Socket only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_state: bool,
    /// How `batch` replies are encoded: `"json"` (default) or `"binary"` (fixed-width fields a
    /// trainer reads without a JSON parser; see [`super::binary`]). Socket only.
    #[serde(default, skip_serializing_if = "BatchEncoding::is_json")]
    pub batch_encoding: BatchEncoding,
    /// The trainer's GPU: a PCI bus id (`0000:19:00.0`) or a GPU UUID (`GPU-...`). The stream
    /// goes to that GPU's lane (its region lies on that GPU when the node serves CUDA
    /// memory); absent: the least loaded lane. A GPU the node does not serve is refused with
    /// code `unknown_device`, naming it and the node's GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// The order of token windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WindowOrder {
    /// Blocks of documents and windows as `shuffle` says (elastic, bounded memory).
    #[default]
    Shardwire,
    /// megatron-core `GPTDataset`'s document, sample and shuffle indices for the seed.
    Megatron,
}

/// Default shuffle block: the samples of this many average shards.
pub const DEFAULT_BLOCK_SHARDS: u64 = 8;

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

impl StreamRequest {
    /// The defaults: this protocol version, seed 0, rank 0 of 1, one epoch, pad, from the
    /// start.
    pub fn new(dataset: impl Into<String>) -> Self {
        Self {
            version: TRAINER_VERSION,
            dataset: dataset.into(),
            seed: 0,
            rank: 0,
            world_size: 1,
            epochs: 1,
            uneven: Uneven::Pad,
            state: None,
            batch_size: None,
            shuffle: None,
            shuffle_block: None,
            partitions: None,
            drop_last: false,
            worker: 0,
            num_workers: 1,
            seq_len: None,
            tokens_column: None,
            token_dtype: None,
            boundaries: false,
            order: None,
            mix: None,
            batch_state: false,
            batch_encoding: BatchEncoding::Json,
            device: None,
        }
    }
}

/// How the socket encodes `batch` replies (attach `batch_encoding`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BatchEncoding {
    /// JSON, like every other reply.
    #[default]
    Json,
    /// The binary form of [`super::binary`].
    Binary,
}

impl BatchEncoding {
    fn is_json(&self) -> bool {
        *self == Self::Json
    }
}

/// The stable error codes of the trainer and admin APIs (`{"code": ..., "message": ...}`),
/// each with the HTTP status the HTTP fronts answer with and whether trying again later (or
/// elsewhere) can succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or a field is out of range (the message names it).
    BadRequest,
    /// rank/world size/uneven give no valid plan.
    BadPlan,
    /// The client speaks another trainer protocol version.
    UnsupportedVersion,
    /// No such stream, binding or tensor.
    NotFound,
    /// No connected source serves the dataset.
    UnknownDataset,
    /// The lease is not held by this stream.
    UnknownLease,
    /// No such network interface.
    UnknownInterface,
    /// The GPU a trainer named is not one this node serves (the message lists them).
    UnknownDevice,
    /// A resume state does not fit this stream (the message names the field).
    StateMismatch,
    /// The stream was closed.
    Closed,
    /// The connection already has a stream.
    AlreadyAttached,
    /// The connection has no stream yet.
    NotAttached,
    /// A devmem binding exists already.
    BindingExists,
    /// The interface cannot do devmem.
    NotCapable,
    /// The kernel or the GPU refused a binding.
    BindFailed,
    /// No source is connected, or none gave the dataset's manifest and one may yet (its
    /// failure may pass: a timeout, a lost link, a throttled or unavailable store).
    Unavailable,
    /// The data cannot be delivered: a source refused a shard for good (it does not have it,
    /// or the request is one it cannot serve). The message names the dataset, the shard and
    /// the source's reason; the dataset (or the sources) must change first.
    DataUnavailable,
    /// Not enough memory for the stream.
    NoMemory,
    /// The node is draining.
    Draining,
    /// Too many connections at once.
    TooManyConnections,
    /// A request, its body or a trainer took too long.
    Timeout,
    /// The peer (uid/gid) or the token is not allowed.
    Forbidden,
    /// A mutating admin request came without a token.
    Unauthorized,
    /// Mutating admin endpoints are off (no token configured).
    AdminDisabled,
    /// A bug or an unexpected failure in the node.
    Internal,
    /// A code this build does not know (from a newer peer).
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The HTTP status the HTTP fronts answer with.
    pub fn http_status(self) -> u16 {
        match self {
            Self::BadRequest | Self::BadPlan | Self::UnsupportedVersion => 400,
            Self::Unauthorized => 401,
            Self::Forbidden | Self::AdminDisabled => 403,
            Self::NotFound
            | Self::UnknownDataset
            | Self::UnknownLease
            | Self::UnknownInterface
            | Self::UnknownDevice => 404,
            Self::Timeout => 408,
            Self::StateMismatch
            | Self::Closed
            | Self::AlreadyAttached
            | Self::NotAttached
            | Self::BindingExists
            | Self::NotCapable
            | Self::BindFailed => 409,
            Self::DataUnavailable => 502,
            Self::Unavailable | Self::NoMemory | Self::Draining | Self::TooManyConnections => 503,
            Self::Internal | Self::Unknown => 500,
        }
    }

    /// Whether the same request may succeed later or on another node (capacity, readiness,
    /// time), as opposed to a request that must change first.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::Unavailable
                | Self::NoMemory
                | Self::Draining
                | Self::TooManyConnections
                | Self::Timeout
                | Self::Internal
        )
    }

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::BadPlan => "bad_plan",
            Self::UnsupportedVersion => "unsupported_version",
            Self::NotFound => "not_found",
            Self::UnknownDataset => "unknown_dataset",
            Self::UnknownLease => "unknown_lease",
            Self::UnknownInterface => "unknown_interface",
            Self::UnknownDevice => "unknown_device",
            Self::StateMismatch => "state_mismatch",
            Self::Closed => "closed",
            Self::AlreadyAttached => "already_attached",
            Self::NotAttached => "not_attached",
            Self::BindingExists => "binding_exists",
            Self::NotCapable => "not_capable",
            Self::BindFailed => "bind_failed",
            Self::Unavailable => "unavailable",
            Self::DataUnavailable => "data_unavailable",
            Self::NoMemory => "no_memory",
            Self::Draining => "draining",
            Self::TooManyConnections => "too_many_connections",
            Self::Timeout => "timeout",
            Self::Forbidden => "forbidden",
            Self::Unauthorized => "unauthorized",
            Self::AdminDisabled => "admin_disabled",
            Self::Internal => "internal",
            Self::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a stream's region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// A memfd in host memory: map it.
    Host,
    /// A CUDA VMM allocation exported as a POSIX fd: import it with the CUDA driver.
    Cuda,
}

impl MemoryKind {
    /// "host" or "cuda".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// trainer -> service.
///
/// The variants without fields are empty struct variants (`State {}`), not unit ones: serde's
/// `deny_unknown_fields` does not reach a unit variant of a tagged enum, which would take
/// `{"op":"state","release":[5]}` as `state` and drop `release` unread. Either form
/// serialises to `{"op":"state"}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Open a stream on this connection and receive its region.
    Attach(Box<StreamRequest>),
    /// Take the next batch (waits up to `timeout_ms`, default forever), after releasing the
    /// leases in `release` (so a training loop needs one round trip per batch). With `count`
    /// above 1, the batches after it that are ready at once come in the same write, up to
    /// `count` in all, each but the last marked `more` (nothing else is waited for).
    Next {
        /// Wait limit in milliseconds.
        #[serde(default)]
        timeout_ms: Option<u64>,
        /// Leases to release first.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        release: Vec<u64>,
        /// At most this many batches in answer, 1..=[`MAX_NEXT_COUNT`].
        #[serde(default = "one", skip_serializing_if = "is_one")]
        count: u32,
    },
    /// Give a batch's memory back.
    Release {
        /// The lease from `batch`.
        lease: u64,
    },
    /// Ask for the resumable state.
    State {},
    /// What the node serves (memory kind, lanes and their GPUs), before or after `attach`:
    /// the SDK asks it to know whether to name the trainer's GPU.
    Info {},
}

fn one() -> u32 {
    1
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn version() -> u32 {
    TRAINER_VERSION
}

/// Where a tensor lies in the stream's region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorView {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Byte offset in the region.
    pub offset: u64,
    /// Byte length.
    pub length: u64,
}

/// The CUDA device holding a `cuda` region. A trainer finds it by PCI bus id
/// (`cuDeviceGetByPCIBusId`), which survives a different `CUDA_VISIBLE_DEVICES`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuRef {
    /// The service's CUDA ordinal (informational).
    pub ordinal: i32,
    /// PCI bus id, e.g. "0000:19:00.0".
    pub pci_bus_id: String,
    /// The allocation granularity the region was created with; a trainer reserves its
    /// virtual range at this alignment.
    pub granularity: u64,
}

/// One lane of the node, as `info` shows it to trainers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneRef {
    /// Lane id.
    pub lane: u32,
    /// The lane's GPU (PCI bus id), if it has one.
    #[serde(default)]
    pub gpu: Option<String>,
    /// The GPU's UUID, when the node's CUDA driver reports it.
    #[serde(default)]
    pub uuid: Option<String>,
}

/// service -> trainer. As in [`Request`], the variants without fields are empty struct
/// variants, so that an unknown field is refused on them too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    /// The stream is open; the region fd rides on this message.
    Attached {
        /// Stream id (for logs and the admin API).
        stream: u64,
        /// Region size in bytes (map this much).
        region_size: u64,
        /// Batches per epoch for this rank.
        batches_per_epoch: u64,
        /// Epochs to deliver.
        epochs: u32,
        /// Memory kind of the region: "host" (a memfd: map it) or "cuda" (a CUDA VMM
        /// allocation exported as a POSIX fd: import it with the CUDA driver, see `gpu`).
        memory: MemoryKind,
        /// For `memory = "cuda"`: the device that holds the region.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<GpuRef>,
        /// The state the stream starts from.
        state: StreamState,
    },
    /// A batch is leased to the trainer.
    Batch {
        /// Lease id (release it).
        lease: u64,
        /// Epoch.
        epoch: u32,
        /// Index within the epoch.
        index: u64,
        /// Shard index in the manifest.
        shard: u32,
        /// Tensors.
        tensors: Vec<TensorView>,
        /// With `batch_state` at attach: the state that resumes right after this batch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        state: Option<StreamState>,
        /// Another `batch` answering the same `next` follows (its `count` was above 1).
        #[serde(default, skip_serializing_if = "is_false")]
        more: bool,
    },
    /// No batch arrived within the timeout.
    Timeout {},
    /// The stream has delivered every epoch.
    End {},
    /// A release was accepted.
    Released {},
    /// The resumable state: the next batch the stream will deliver.
    State {
        /// The state.
        state: StreamState,
    },
    /// What the node serves.
    Info {
        /// Where stream regions live.
        memory: MemoryKind,
        /// The node's lanes.
        lanes: Vec<LaneRef>,
    },
    /// The request failed; `code` is stable, `message` says what was wrong.
    Error {
        /// Stable machine-readable code.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}
