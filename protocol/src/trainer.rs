//! Messages of the trainer Unix socket (see docs/TRAINER_API.md).
//!
//! Frame: `len: u32 LE | JSON`. The `attached` response carries the stream's memory region
//! as an SCM_RIGHTS file descriptor on the same `sendmsg`. One connection = one stream; a
//! disconnect closes the stream and releases all its leases.

use serde::{Deserialize, Serialize};

use crate::DType;
use crate::plan::Uneven;

/// Protocol version of the trainer socket.
pub const TRAINER_VERSION: u32 = 1;
/// Largest trainer frame.
pub const MAX_TRAINER_FRAME: usize = 1 << 20;

/// Resumable position of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamState {
    /// Epoch of the next batch.
    pub epoch: u32,
    /// Index within the epoch of the next batch.
    pub index: u64,
    /// The seed the stream was opened with.
    pub seed: u64,
    /// Hex fingerprint of (digest, seed, world size, rank, planning options).
    pub fingerprint: String,
}

/// trainer -> service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Open a stream on this connection and receive its region.
    Attach {
        /// Protocol version the client speaks.
        version: u32,
        /// Dataset name.
        dataset: String,
        /// Shuffle seed.
        #[serde(default)]
        seed: u64,
        /// This trainer's rank.
        #[serde(default)]
        rank: u32,
        /// Number of ranks.
        #[serde(default = "one")]
        world_size: u32,
        /// Epochs to deliver.
        #[serde(default = "one")]
        epochs: u32,
        /// Uneven-dataset policy.
        #[serde(default)]
        uneven: Uneven,
        /// Resume from this state.
        #[serde(default)]
        state: Option<StreamState>,
    },
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
        /// Memory kind of the region ("host").
        memory: String,
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
        code: String,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_defaults_and_round_trip() {
        let r: Request = decode(br#"{"op":"attach","version":1,"dataset":"d"}"#).unwrap();
        assert_eq!(
            r,
            Request::Attach {
                version: 1,
                dataset: "d".into(),
                seed: 0,
                rank: 0,
                world_size: 1,
                epochs: 1,
                uneven: Uneven::Pad,
                state: None
            }
        );
        let mut buf = Vec::new();
        encode(&Request::Release { lease: 9 }, &mut buf);
        let len = check_len(buf[..4].try_into().unwrap()).unwrap();
        assert_eq!(
            decode::<Request>(&buf[4..4 + len]).unwrap(),
            Request::Release { lease: 9 }
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
