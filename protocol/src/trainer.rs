//! Messages of the trainer Unix socket (see docs/TRAINER_API.md).
//!
//! Frame: `len: u32 LE | JSON`. The `attached` response carries the stream's memory region
//! as an SCM_RIGHTS file descriptor on the same `sendmsg`. One connection = one stream; a
//! disconnect closes the stream and releases all its leases.

use serde::{Deserialize, Serialize};

use crate::DType;
use crate::plan::Uneven;
pub use crate::samples::Shuffle;

/// Protocol version of the trainer socket.
pub const TRAINER_VERSION: u32 = 1;
/// Largest trainer frame.
pub const MAX_TRAINER_FRAME: usize = 1 << 20;

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
        }
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
    /// No source is connected.
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
            Self::NotFound | Self::UnknownDataset | Self::UnknownLease | Self::UnknownInterface => {
                404
            }
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Open a stream on this connection and receive its region.
    Attach(Box<StreamRequest>),
    /// Take the next batch (waits up to `timeout_ms`, default forever), after releasing the
    /// leases in `release` (so a training loop needs one round trip per batch).
    Next {
        /// Wait limit in milliseconds.
        #[serde(default)]
        timeout_ms: Option<u64>,
        /// Leases to release first.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        release: Vec<u64>,
    },
    /// Give a batch's memory back.
    Release {
        /// The lease from `batch`.
        lease: u64,
    },
    /// Ask for the resumable state.
    State,
}

fn one() -> u32 {
    1
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

/// service -> trainer.
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
    },
    /// No batch arrived within the timeout.
    Timeout,
    /// The stream has delivered every epoch.
    End,
    /// A release was accepted.
    Released,
    /// The resumable state: the next batch the stream will deliver.
    State {
        /// The state.
        state: StreamState,
    },
    /// The request failed; `code` is stable, `message` says what was wrong.
    Error {
        /// Stable machine-readable code.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

/// Appends a framed message.
pub fn encode<T: Serialize>(msg: &T, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    serde_json::to_writer(&mut *out, msg).expect("trainer messages serialise");
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// Why a trainer frame is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum TrainerDecodeError {
    /// Frame over [`MAX_TRAINER_FRAME`].
    #[error("trainer frame of {0} bytes exceeds the limit {MAX_TRAINER_FRAME}")]
    TooLong(usize),
    /// Not a valid message.
    #[error("malformed trainer message: {0}")]
    Json(#[from] serde_json::Error),
}

/// Checks a frame length prefix.
pub fn check_len(prefix: [u8; 4]) -> Result<usize, TrainerDecodeError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_TRAINER_FRAME {
        return Err(TrainerDecodeError::TooLong(len));
    }
    Ok(len)
}

/// Decodes a frame body.
pub fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, TrainerDecodeError> {
    Ok(serde_json::from_slice(body)?)
}

impl Request {
    /// Appends this request as a frame: the same bytes as [`encode`], faster for `next`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::Next {
                timeout_ms,
                release,
            } => encode_next(*timeout_ms, release, out),
            other => encode(other, out),
        }
    }

    /// Decodes a request body: the same result as [`decode`], faster for `next`.
    pub fn decode(body: &[u8]) -> Result<Self, TrainerDecodeError> {
        match fast::decode_next(body) {
            Some(r) => Ok(r),
            None => decode(body),
        }
    }
}

impl Response {
    /// Appends this response as a frame: the same bytes as [`encode`], faster for `batch`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::Batch {
                lease,
                epoch,
                index,
                shard,
                tensors,
            } => frame(out, |out| {
                fast::encode_batch(*lease, *epoch, *index, *shard, tensors, out)
            }),
            other => encode(other, out),
        }
    }

    /// Decodes a response body: the same result as [`decode`], faster for `batch`.
    pub fn decode(body: &[u8]) -> Result<Self, TrainerDecodeError> {
        match fast::decode_batch(body) {
            Some(r) => Ok(r),
            None => decode(body),
        }
    }
}

/// Appends a `next` request frame: the bytes of [`Request::Next`] with these fields, without
/// building the request.
pub fn encode_next(timeout_ms: Option<u64>, release: &[u64], out: &mut Vec<u8>) {
    frame(out, |out| fast::encode_next(timeout_ms, release, out))
}

/// Appends a length prefix and the body `body` writes.
fn frame(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    body(out);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// The hot messages of a training loop (`next` and its `batch` answer), written and read by
/// hand. serde's derived code for an internally tagged enum first buffers the whole object
/// into a generic tree to find the tag; for these small messages that costs several times the
/// parse itself, on the critical path of every hand-off.
///
/// The writers produce exactly the bytes `serde_json` produces. The readers accept only the
/// compact form (no whitespace, known fields in the order the writers use, for `next` in any
/// order; strings without escapes; plain decimal numbers) and return `None` for anything else,
/// which the callers then hand to the derived decoder: what is accepted, and every error
/// message, stay those of the derived code.
mod fast {
    use super::{Request, Response, TensorView};
    use crate::DType;

    fn push_u64(out: &mut Vec<u8>, mut v: u64) {
        let mut buf = [0u8; 20];
        let mut i = buf.len();
        loop {
            i -= 1;
            buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        out.extend_from_slice(&buf[i..]);
    }

    /// A JSON string, escaped as `serde_json` escapes it.
    fn push_str(out: &mut Vec<u8>, s: &str) {
        if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
            out.push(b'"');
            out.extend_from_slice(s.as_bytes());
            out.push(b'"');
        } else {
            serde_json::to_writer(&mut *out, s).expect("a string serialises");
        }
    }

    pub(super) fn encode_next(timeout_ms: Option<u64>, release: &[u64], out: &mut Vec<u8>) {
        out.extend_from_slice(br#"{"op":"next","timeout_ms":"#);
        match timeout_ms {
            Some(t) => push_u64(out, t),
            None => out.extend_from_slice(b"null"),
        }
        if !release.is_empty() {
            out.extend_from_slice(br#","release":["#);
            for (k, l) in release.iter().enumerate() {
                if k > 0 {
                    out.push(b',');
                }
                push_u64(out, *l);
            }
            out.push(b']');
        }
        out.push(b'}');
    }

    pub(super) fn encode_batch(
        lease: u64,
        epoch: u32,
        index: u64,
        shard: u32,
        tensors: &[TensorView],
        out: &mut Vec<u8>,
    ) {
        out.extend_from_slice(br#"{"op":"batch","lease":"#);
        push_u64(out, lease);
        out.extend_from_slice(br#","epoch":"#);
        push_u64(out, epoch.into());
        out.extend_from_slice(br#","index":"#);
        push_u64(out, index);
        out.extend_from_slice(br#","shard":"#);
        push_u64(out, shard.into());
        out.extend_from_slice(br#","tensors":["#);
        for (k, t) in tensors.iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            out.extend_from_slice(br#"{"name":"#);
            push_str(out, &t.name);
            out.extend_from_slice(br#","dtype":""#);
            out.extend_from_slice(t.dtype.name().as_bytes());
            out.extend_from_slice(br#"","shape":["#);
            for (j, d) in t.shape.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                push_u64(out, *d);
            }
            out.extend_from_slice(br#"],"offset":"#);
            push_u64(out, t.offset);
            out.extend_from_slice(br#","length":"#);
            push_u64(out, t.length);
            out.push(b'}');
        }
        out.extend_from_slice(b"]}");
    }

    /// A reader of the compact form; every method returns `None` on anything unexpected.
    struct Cursor<'a> {
        b: &'a [u8],
        i: usize,
    }

    impl<'a> Cursor<'a> {
        fn lit(&mut self, s: &[u8]) -> Option<()> {
            if self.b[self.i..].starts_with(s) {
                self.i += s.len();
                Some(())
            } else {
                None
            }
        }

        fn eat(&mut self, s: &[u8]) -> bool {
            self.lit(s).is_some()
        }

        /// A plain decimal: no sign, fraction, exponent or leading zero.
        fn u64(&mut self) -> Option<u64> {
            let digits = self.b[self.i..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if digits == 0 || (digits > 1 && self.b[self.i] == b'0') {
                return None;
            }
            let mut v: u64 = 0;
            for &d in &self.b[self.i..self.i + digits] {
                v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
            }
            self.i += digits;
            Some(v)
        }

        fn u32(&mut self) -> Option<u32> {
            u32::try_from(self.u64()?).ok()
        }

        /// `[n,n,...]`.
        fn u64s(&mut self) -> Option<Vec<u64>> {
            self.lit(b"[")?;
            let mut v = Vec::new();
            if self.eat(b"]") {
                return Some(v);
            }
            loop {
                v.push(self.u64()?);
                if !self.eat(b",") {
                    self.lit(b"]")?;
                    return Some(v);
                }
            }
        }

        /// A string without escapes or control characters.
        fn str(&mut self) -> Option<&'a str> {
            self.lit(b"\"")?;
            let rest = &self.b[self.i..];
            let n = rest
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
            if rest[n] != b'"' {
                return None;
            }
            let s = std::str::from_utf8(&rest[..n]).ok()?;
            self.i += n + 1;
            Some(s)
        }

        fn end(&self) -> Option<()> {
            (self.i == self.b.len()).then_some(())
        }
    }

    fn dtype(name: &str) -> Option<DType> {
        DType::from_name(name)
    }

    /// `{"op":"next"` then `timeout_ms` (a number or null) and `release`, each at most once.
    pub(super) fn decode_next(body: &[u8]) -> Option<Request> {
        let mut c = Cursor { b: body, i: 0 };
        c.lit(br#"{"op":"next""#)?;
        let (mut timeout_ms, mut release) = (None, None);
        while !c.eat(b"}") {
            if c.eat(br#","timeout_ms":"#) {
                if timeout_ms.is_some() {
                    return None; // duplicate: the derived decoder words the error
                }
                timeout_ms = Some(if c.eat(b"null") { None } else { Some(c.u64()?) });
            } else if c.eat(br#","release":"#) {
                if release.is_some() {
                    return None;
                }
                release = Some(c.u64s()?);
            } else {
                return None;
            }
        }
        c.end()?;
        Some(Request::Next {
            timeout_ms: timeout_ms.flatten(),
            release: release.unwrap_or_default(),
        })
    }

    /// Exactly what [`encode_batch`] writes (strings without escapes).
    pub(super) fn decode_batch(body: &[u8]) -> Option<Response> {
        let mut c = Cursor { b: body, i: 0 };
        c.lit(br#"{"op":"batch","lease":"#)?;
        let lease = c.u64()?;
        c.lit(br#","epoch":"#)?;
        let epoch = c.u32()?;
        c.lit(br#","index":"#)?;
        let index = c.u64()?;
        c.lit(br#","shard":"#)?;
        let shard = c.u32()?;
        c.lit(br#","tensors":["#)?;
        let mut tensors = Vec::new();
        if !c.eat(b"]") {
            loop {
                c.lit(br#"{"name":"#)?;
                let name = c.str()?.to_owned();
                c.lit(br#","dtype":"#)?;
                let dtype = dtype(c.str()?)?;
                c.lit(br#","shape":"#)?;
                let shape = c.u64s()?;
                c.lit(br#","offset":"#)?;
                let offset = c.u64()?;
                c.lit(br#","length":"#)?;
                let length = c.u64()?;
                c.lit(b"}")?;
                tensors.push(TensorView {
                    name,
                    dtype,
                    shape,
                    offset,
                    length,
                });
                if !c.eat(b",") {
                    c.lit(b"]")?;
                    break;
                }
            }
        }
        c.lit(b"}")?;
        c.end()?;
        Some(Response::Batch {
            lease,
            epoch,
            index,
            shard,
            tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn request_defaults_and_round_trip() {
        let r: Request = decode(br#"{"op":"attach","version":1,"dataset":"d"}"#).unwrap();
        assert_eq!(r, Request::Attach(Box::new(StreamRequest::new("d"))));
        let e = decode::<Request>(br#"{"op":"attach","dataset":"d","bogus":1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        let mut buf = Vec::new();
        encode(&Request::Release { lease: 9 }, &mut buf);
        let len = check_len(buf[..4].try_into().unwrap()).unwrap();
        assert_eq!(
            decode::<Request>(&buf[4..4 + len]).unwrap(),
            Request::Release { lease: 9 }
        );
    }

    /// `Request::decode` and `Response::decode` agree with the derived decoder: same value or
    /// the same error message.
    fn same_as_derived(body: &[u8]) {
        let (fast, slow) = (Request::decode(body), decode::<Request>(body));
        match (&fast, &slow) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            _ => panic!(
                "{}: fast {fast:?} derived {slow:?}",
                String::from_utf8_lossy(body)
            ),
        }
        let (fast, slow) = (Response::decode(body), decode::<Response>(body));
        match (&fast, &slow) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            _ => panic!(
                "{}: fast {fast:?} derived {slow:?}",
                String::from_utf8_lossy(body)
            ),
        }
    }

    #[test]
    fn hot_messages_decode_like_the_derived_code() {
        for body in [
            r#"{"op":"next"}"#,
            r#"{"op":"next","timeout_ms":null}"#,
            r#"{"op":"next","timeout_ms":250,"release":[1,2]}"#,
            r#"{"op":"next","release":[7],"timeout_ms":5}"#,
            r#"{"op":"next","release":[]}"#,
            r#"{"op":"next","release":[7],"release":[8]}"#,
            r#"{"op":"next","timeout_ms":1,"timeout_ms":2}"#,
            r#"{"op":"next","timeout_ms":01}"#,
            r#"{"op":"next","timeout_ms":-1}"#,
            r#"{"op":"next","timeout_ms":1.5}"#,
            r#"{"op":"next","timeout_ms":18446744073709551616}"#,
            r#"{"op":"next","bogus":1}"#,
            r#"{"op":"next"} "#,
            r#"{"op": "next", "release": [3]}"#,
            r#"{"release":[3],"op":"next"}"#,
            r#"{"op":"nexts"}"#,
            r#"{"op":"next","release":[1,]}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[]}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"name":"x","dtype":"float32","shape":[2,3],"offset":64,"length":24},{"name":"y","dtype":"int64","shape":[],"offset":0,"length":8}]}"#,
            r#"{"op":"batch","lease":1,"epoch":4294967296,"index":2,"shard":3,"tensors":[]}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"name":"x\"y","dtype":"uint8","shape":[1],"offset":0,"length":1}]}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"name":"x","dtype":"complex64","shape":[1],"offset":0,"length":1}]}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"dtype":"uint8","name":"x","shape":[1],"offset":0,"length":1}]}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[],"extra":1}"#,
            r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3}"#,
            r#"{"op":"released"}"#,
            r#"{"op":"error","code":"closed","message":"bye"}"#,
            r#"{"op":"attach","version":1,"dataset":"d","seed":3,"world_size":2,"rank":1}"#,
        ] {
            same_as_derived(body.as_bytes());
        }
        same_as_derived(b"{\"op\":\"batch\",\"lease\":1,\"epoch\":0,\"index\":2,\"shard\":3,\"tensors\":[{\"name\":\"\xff\",\"dtype\":\"uint8\",\"shape\":[1],\"offset\":0,\"length\":1}]}");
    }

    #[test]
    fn the_hot_path_reads_what_the_writers_write() {
        for body in [
            &br#"{"op":"next","timeout_ms":null,"release":[9]}"#[..],
            br#"{"op":"next","release":[9]}"#, // the Python SDK's form
            br#"{"op":"next","timeout_ms":250}"#,
        ] {
            assert!(fast::decode_next(body).is_some(), "{body:?}");
        }
        let b = br#"{"op":"batch","lease":7,"epoch":1,"index":2,"shard":3,"tensors":[{"name":"x","dtype":"float32","shape":[2,3],"offset":64,"length":24}]}"#;
        assert!(fast::decode_batch(b).is_some());
    }

    fn dtypes() -> impl Strategy<Value = DType> {
        prop_oneof![
            Just(DType::Int8),
            Just(DType::Int16),
            Just(DType::Int32),
            Just(DType::Int64),
            Just(DType::Uint8),
            Just(DType::Uint16),
            Just(DType::Uint32),
            Just(DType::Uint64),
            Just(DType::Float16),
            Just(DType::Float32),
            Just(DType::Float64),
        ]
    }

    fn batches() -> impl Strategy<Value = Response> {
        let tensor = (
            prop_oneof![any::<String>(), "[a-z0-9_./]{0,12}"],
            dtypes(),
            proptest::collection::vec(any::<u64>(), 0..4),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(name, dtype, shape, offset, length)| TensorView {
                name,
                dtype,
                shape,
                offset,
                length,
            });
        (
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            proptest::collection::vec(tensor, 0..4),
        )
            .prop_map(|(lease, epoch, index, shard, tensors)| Response::Batch {
                lease,
                epoch,
                index,
                shard,
                tensors,
            })
    }

    fn nexts() -> impl Strategy<Value = Request> {
        (
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(any::<u64>(), 0..4),
        )
            .prop_map(|(timeout_ms, release)| Request::Next {
                timeout_ms,
                release,
            })
    }

    proptest! {
        #[test]
        fn hot_messages_encode_like_serde_and_round_trip(b in batches(), n in nexts()) {
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            b.encode(&mut fast);
            encode(&b, &mut slow);
            prop_assert_eq!(&fast, &slow);
            prop_assert_eq!(Response::decode(&fast[4..]).unwrap(), b);
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            n.encode(&mut fast);
            encode(&n, &mut slow);
            prop_assert_eq!(&fast, &slow);
            prop_assert_eq!(Request::decode(&fast[4..]).unwrap(), n);
        }

        #[test]
        fn mangled_hot_messages_decode_like_the_derived_code(
            b in batches(),
            n in nexts(),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
        ) {
            for msg in [serde_json::to_vec(&b).unwrap(), serde_json::to_vec(&n).unwrap()] {
                let mut body = msg.clone();
                for (at, byte, how) in &edits {
                    if body.is_empty() {
                        break;
                    }
                    let i = at.index(body.len());
                    match how {
                        0 => body[i] = *byte,
                        1 => { body.remove(i); }
                        _ => body.insert(i, *byte),
                    }
                }
                same_as_derived(&body);
            }
        }
    }

    #[test]
    fn error_codes_keep_their_wire_names_and_map_to_http() {
        for (code, name, status) in [
            (ErrorCode::BadRequest, "bad_request", 400),
            (ErrorCode::UnknownDataset, "unknown_dataset", 404),
            (ErrorCode::StateMismatch, "state_mismatch", 409),
            (ErrorCode::NoMemory, "no_memory", 503),
            (ErrorCode::Timeout, "timeout", 408),
            (ErrorCode::DataUnavailable, "data_unavailable", 502),
        ] {
            assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{name}\""));
            assert_eq!(code.as_str(), name);
            assert_eq!(code.http_status(), status);
        }
        assert!(ErrorCode::NoMemory.retryable() && !ErrorCode::BadPlan.retryable());
        let r: Response =
            decode(br#"{"op":"error","code":"from_the_future","message":"x"}"#).unwrap();
        assert_eq!(
            r,
            Response::Error {
                code: ErrorCode::Unknown,
                message: "x".into()
            }
        );
    }

    #[test]
    fn unknown_fields_and_long_frames_are_rejected() {
        let e = decode::<Request>(br#"{"op":"next","bogus":1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        assert!(check_len((MAX_TRAINER_FRAME as u32 + 1).to_le_bytes()).is_err());
    }
}
