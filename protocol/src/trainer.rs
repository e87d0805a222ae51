//! Messages of the trainer Unix socket (see docs/TRAINER_API.md).
//!
//! Frame: `len: u32 LE | JSON`. The `attached` response carries the stream's memory region
//! as an SCM_RIGHTS file descriptor on the same `sendmsg`. One connection = one stream; a
//! disconnect closes the stream and releases all its leases.
//!
//! [`messages`] holds the types; [`fast`] the hand-written codec of the hot pair (`next` and
//! its `batch`); [`binary`] the binary form of `batch` a trainer may ask for at attach;
//! [`http`] the bodies of the HTTP trainer API, built from the same types.

pub mod binary;
mod fast;
pub mod http;
mod messages;

use serde::{Deserialize, Serialize};

use crate::wire::json_error_text;

pub use self::messages::*;

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
    /// Not a valid message. serde_json's message quotes the peer's keys and tags with their
    /// JSON escapes decoded; they are shown escaped again (`json_error_text`).
    #[error("malformed trainer message: {}", json_error_text(.0))]
    Json(#[from] serde_json::Error),
    /// Not a valid binary `batch` body.
    #[error("malformed trainer message: {0}")]
    Binary(#[from] binary::BinaryBatchError),
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
                count,
            } => encode_next(*timeout_ms, release, *count, out),
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
                state,
                more,
            } => frame(out, |out| {
                fast::encode_batch(
                    (*lease, *epoch, *index, *shard),
                    tensors,
                    (state.as_ref(), *more),
                    out,
                )
            }),
            other => encode(other, out),
        }
    }

    /// Appends this response as a frame in `encoding`: a `batch` in the binary form when
    /// asked and it fits (see [`binary`]), anything else as [`Self::encode`] does.
    pub fn encode_as(&self, encoding: BatchEncoding, out: &mut Vec<u8>) {
        if encoding == BatchEncoding::Binary && frame_if(out, |out| binary::encode_batch(self, out))
        {
            return;
        }
        self.encode(out)
    }

    /// Decodes a response body, JSON or a binary `batch`: the same result as [`decode`] for
    /// JSON, faster for `batch`.
    pub fn decode(body: &[u8]) -> Result<Self, TrainerDecodeError> {
        if body.first() == Some(&binary::BINARY_BATCH_TAG) {
            return Ok(binary::decode_batch(body)?);
        }
        match fast::decode_batch(body) {
            Some(r) => Ok(r),
            None => decode(body),
        }
    }
}

/// Appends a `next` request frame: the bytes of [`Request::Next`] with these fields, without
/// building the request.
pub fn encode_next(timeout_ms: Option<u64>, release: &[u64], count: u32, out: &mut Vec<u8>) {
    frame(out, |out| {
        fast::encode_next(timeout_ms, release, count, out)
    })
}

/// Appends a length prefix and the body `body` writes; when `body` returns false, drops what
/// it wrote and returns false.
fn frame_if(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>) -> bool) -> bool {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    if !body(out) {
        out.truncate(start);
        return false;
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    true
}

/// Appends a length prefix and the body `body` writes.
fn frame(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    frame_if(out, |out| {
        body(out);
        true
    });
}

#[cfg(test)]
mod tests;
