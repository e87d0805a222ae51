//! Why a stream was not opened ([`OpenError`]), why an open stream ended ([`CloseReason`]),
//! and why a batch could not be assembled ([`AssembleError`]). A refusal and a close reach
//! the trainer as a stable [`ErrorCode`] and a message; the close reason also says who ended
//! the stream, so the fronts and the logs never parse text.

use shardwire_protocol::DType;
use shardwire_protocol::trainer::ErrorCode;

use crate::fetch::FetchFailure;

/// Why a stream was not opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct OpenError {
    /// Stable code.
    pub code: ErrorCode,
    /// What was wrong, naming the field and the value.
    pub message: String,
}

impl OpenError {
    /// An error with this code.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// Why a batch (or a shard's row tables) could not be assembled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    /// Host and CUDA slabs in one assembly (a bug: a stream's slabs share one region).
    #[error("host and CUDA slabs mixed in one assembly")]
    MixedMemory,
    /// The shard's slab block cannot hold its assembled tables.
    #[error("the slab's block of {block} bytes cannot hold the assembled {need} bytes")]
    BlockTooSmall {
        /// The block's bytes.
        block: u64,
        /// The assembled bytes.
        need: u64,
    },
    /// Signed tokens cannot be widened by copies (refused when the stream opens).
    #[error("widening signed {} tokens on the GPU", dtype.name())]
    SignedWidening {
        /// The token type.
        dtype: DType,
    },
    /// A CUDA region on a node without a GPU.
    #[error("a CUDA region on a node without a GPU")]
    NoGpu,
    /// A CUDA call failed.
    #[error("{what}: {error}")]
    Gpu {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        error: String,
    },
}

impl AssembleError {
    pub(crate) fn gpu(what: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Gpu {
            what,
            error: e.to_string(),
        }
    }
}

/// Why a stream was closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CloseReason {
    /// The trainer's connection to the socket ended.
    #[error("trainer disconnected")]
    TrainerDisconnected,
    /// The trainer closed it over the HTTP API.
    #[error("closed over HTTP")]
    ClosedOverHttp,
    /// An HTTP trainer sent nothing for its idle timeout.
    #[error("no HTTP request for {secs} s")]
    HttpIdle {
        /// The stream's idle timeout.
        secs: u64,
    },
    /// An operator closed it over the admin API.
    #[error("closed by an operator over the admin API")]
    Operator,
    /// The node is shutting down.
    #[error("node shutting down")]
    Shutdown,
    /// The stream's region could not be shared with its trainer.
    #[error("cannot share the stream's region: {0}")]
    CannotShare(String),
    /// Assembling a batch (or a shard's row tables) failed.
    #[error("assembling {what} failed: {error}")]
    Assembly {
        /// `a batch`, or `shard N`.
        what: String,
        /// The failure.
        error: AssembleError,
    },
    /// The shards the next batch reads cannot fit the region beside the batch slabs.
    #[error(
        "the next batch reads {shards} shards ({need} bytes of slabs) and needs {reserve} bytes of batch slabs; stream_memory is {capacity}: raise stream_memory or lower batch_size"
    )]
    DoesNotFit {
        /// Shards the next batch reads.
        shards: usize,
        /// Their slab bytes.
        need: u64,
        /// Bytes of batch slabs kept for assembled batches.
        reserve: u64,
        /// The region's size.
        capacity: u64,
    },
    /// Every source is up and serves another version of the stream's dataset, or none.
    #[error(
        "no source serves version {digest} of dataset {dataset} any more ({answers}): reopen \
         the stream to read the version they serve (a resume state names the version it was \
         taken from, so it resumes only where that version is served)"
    )]
    Unserved {
        /// The dataset.
        dataset: String,
        /// The version the stream reads.
        digest: String,
        /// What each source answered.
        answers: String,
    },
    /// A shard's fetch failed in a way another attempt cannot change (the source refused it).
    #[error("shard {shard} of dataset {dataset} cannot be fetched: {failure}")]
    ShardFailed {
        /// The dataset.
        dataset: String,
        /// The shard's index in it.
        shard: u32,
        /// The failure.
        failure: FetchFailure,
    },
    /// A shard's bytes failed their CRC check [`MAX_CRC_MISMATCHES`] times in a row: what
    /// the sources hold differs from the manifest.
    #[error(
        "shard {shard} of dataset {dataset} failed its CRC-32C check {times} times in a row \
         (last: {got:08x}, the manifest says {want:08x}): the sources' bytes differ from the \
         manifest; re-run `shardwire index` if the data changed, else check the sources' disks"
    )]
    Corrupt {
        /// The dataset.
        dataset: String,
        /// The shard's index in it.
        shard: u32,
        /// Mismatches in a row.
        times: u32,
        /// The last CRC received.
        got: u32,
        /// The manifest's CRC.
        want: u32,
    },
    /// The answer that hands out a batch is larger than a trainer reads
    /// ([`MAX_TRAINER_FRAME`](shardwire_protocol::trainer::MAX_TRAINER_FRAME)): its shard has
    /// too many tensors, or names and shapes too long, to describe in one answer.
    #[error(
        "the answer handing out the batch of shard {shard} is {bytes} bytes, over the {max} a trainer reads: \
         its shard has too many tensors (or names and shapes too long) to describe in one answer; \
         index the dataset with fewer columns (`shardwire index --columns`)"
    )]
    AnswerTooLarge {
        /// The batch's shard.
        shard: u32,
        /// The answer's length.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A bug or an unexpected failure in the node.
    #[error("{0}")]
    Internal(String),
}

/// CRC mismatches in a row of one shard after which its stream closes ([`CloseReason::Corrupt`]):
/// a payload damaged on the way is fetched again (from another source where one is up), but
/// bytes that are wrong where they are stored would be fetched again forever.
pub const MAX_CRC_MISMATCHES: u32 = 5;

/// Failed reads of one shard since it was last delivered (a source's error answer that may
/// pass) after which its stream closes ([`CloseReason::ShardFailed`]), about 30 s of
/// [`refusal_backoff`] in all: a source whose read of a shard fails for good (its store
/// refuses the request, a local read error) would be asked again forever, at the control
/// connection's round-trip rate. A store that throttles or is unavailable is waited out as long
/// as it lasts (with the backoff, which grows with every answer): those answers do not count.
pub const MAX_REFUSALS: u32 = 10;

/// The pause before fetch attempt `n + 1` of a shard refused `n` times in a row (n >= 1):
/// 100 ms, doubling, at most 10 s.
pub fn refusal_backoff(n: u32) -> std::time::Duration {
    let ms = 100u64.saturating_mul(1 << n.saturating_sub(1).min(16));
    std::time::Duration::from_millis(ms.min(10_000))
}

impl CloseReason {
    /// The code a trainer waiting on the stream gets.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::TrainerDisconnected | Self::ClosedOverHttp | Self::Operator => ErrorCode::Closed,
            Self::HttpIdle { .. } => ErrorCode::Timeout,
            Self::Shutdown => ErrorCode::Draining,
            Self::CannotShare(_) | Self::DoesNotFit { .. } => ErrorCode::NoMemory,
            Self::ShardFailed { .. } | Self::Corrupt { .. } | Self::Unserved { .. } => {
                ErrorCode::DataUnavailable
            }
            Self::AnswerTooLarge { .. } => ErrorCode::BadPlan,
            Self::Assembly { .. } | Self::Internal(_) => ErrorCode::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::wire;

    use super::*;

    #[test]
    fn each_reason_has_a_code_and_names_what_happened() {
        let refused = CloseReason::ShardFailed {
            dataset: "web".into(),
            shard: 7,
            failure: FetchFailure::Refused {
                code: wire::ErrorCode::UnknownShard,
                retry_after_ms: 0,
                message: "no shard 7".into(),
            },
        };
        assert_eq!(refused.code(), ErrorCode::DataUnavailable);
        let text = refused.to_string();
        assert!(
            text.contains("shard 7 of dataset web") && text.contains("no shard 7"),
            "{text}"
        );
        assert_eq!(CloseReason::Operator.code(), ErrorCode::Closed);
        assert_eq!(CloseReason::HttpIdle { secs: 3 }.code(), ErrorCode::Timeout);
        assert_eq!(
            CloseReason::HttpIdle { secs: 3 }.to_string(),
            "no HTTP request for 3 s"
        );
        assert_eq!(CloseReason::Shutdown.code(), ErrorCode::Draining);
    }
}
