//! The binary form of a `batch` reply (attach `batch_encoding: "binary"`): what a training
//! loop reads on every hand-off, in fixed-width little-endian fields, so that a trainer in
//! an interpreted language decodes it with a few `struct` reads instead of a JSON parser
//! (docs/TRAINER_API.md, "Binary batch frames"). The resume state rides along as the JSON the
//! JSON form carries, for the trainer to parse only when it checkpoints.
//!
//! Body (after the frame's `u32` length):
//!
//! ```text
//! tag u8 = 0x01 | flags u8 | tensors u16 | state_len u32 | lease u64 | index u64 | epoch u32 | shard u32
//! flags: bit 0 = more (another batch answering the same `next` follows); other bits 0
//! per tensor: offset u64 | length u64 | desc_len u16 | desc
//!   desc = name_len u16 | name (UTF-8) | dtype_len u8 | dtype name | ndim u8 | dims u64 x ndim
//! state_len bytes: the state's JSON (0: no state)
//! ```
//!
//! A tensor's `desc` is the part that repeats batch after batch, so a decoder can cache it by
//! its bytes. A JSON body starts with `{`, so the first byte tells the two forms apart; a
//! reply that does not fit these widths goes out as JSON.

use super::messages::{Response, StreamState, TensorView};
use crate::DType;

/// First byte of a binary `batch` body.
pub const BINARY_BATCH_TAG: u8 = 0x01;
/// Bytes of the fixed header.
const HEADER: usize = 32;
/// `flags` bit: another batch answering the same `next` follows.
const FLAG_MORE: u8 = 0x01;

/// Why a binary `batch` body is not acceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BinaryBatchError {
    /// The body ends before a field it announces.
    #[error("binary batch body of {len} bytes ends inside {field} (at byte {at})")]
    Short {
        /// The body's length.
        len: usize,
        /// The field cut off.
        field: &'static str,
        /// Where that field starts.
        at: usize,
    },
    /// Not the tag of a binary batch.
    #[error("binary batch body starts with byte {0:#04x}, expected {BINARY_BATCH_TAG:#04x}")]
    Tag(u8),
    /// A flag this decoder does not know is set.
    #[error("binary batch flags {0:#04x} set unknown bits (known: {FLAG_MORE:#04x} more)")]
    Flags(u8),
    /// A tensor's name is not UTF-8, or its dtype is unknown.
    #[error("binary batch tensor {index}: {what}")]
    Tensor {
        /// The tensor's place in the reply.
        index: usize,
        /// What was wrong.
        what: String,
    },
    /// Bytes follow the state.
    #[error("binary batch body has {0} bytes after its state")]
    Trailing(usize),
    /// The state is not a stream state.
    #[error("binary batch state: {0}")]
    State(String),
}

/// Appends the body of a binary `batch` reply; false for any other reply or when a count or
/// length does not fit its field: the caller (`frame_if`) then drops what was appended and
/// sends JSON.
pub(super) fn encode_batch(r: &Response, out: &mut Vec<u8>) -> bool {
    let Response::Batch {
        lease,
        epoch,
        index,
        shard,
        tensors,
        state,
        more,
    } = r
    else {
        return false;
    };
    let start = out.len();
    let Ok(count) = u16::try_from(tensors.len()) else {
        return false;
    };
    out.extend_from_slice(&[BINARY_BATCH_TAG, if *more { FLAG_MORE } else { 0 }]);
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&[0; 4]); // state_len, patched below
    out.extend_from_slice(&lease.to_le_bytes());
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&shard.to_le_bytes());
    if !tensors.iter().all(|t| push_tensor(t, out)) {
        return false;
    }
    if let Some(st) = state {
        let at = out.len();
        serde_json::to_writer(&mut *out, st).expect("a stream state serialises");
        let Ok(len) = u32::try_from(out.len() - at) else {
            return false;
        };
        out[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
    }
    true
}

/// One tensor's entry; false when its name or rank does not fit.
fn push_tensor(t: &TensorView, out: &mut Vec<u8>) -> bool {
    let dtype = t.dtype.name().as_bytes();
    let (Ok(name_len), Ok(ndim)) = (u16::try_from(t.name.len()), u8::try_from(t.shape.len()))
    else {
        return false;
    };
    let desc_len = 2 + t.name.len() + 1 + dtype.len() + 1 + 8 * t.shape.len();
    let Ok(desc_len) = u16::try_from(desc_len) else {
        return false;
    };
    out.extend_from_slice(&t.offset.to_le_bytes());
    out.extend_from_slice(&t.length.to_le_bytes());
    out.extend_from_slice(&desc_len.to_le_bytes());
    out.extend_from_slice(&name_len.to_le_bytes());
    out.extend_from_slice(t.name.as_bytes());
    out.push(dtype.len() as u8); // dtype names are short ASCII words
    out.extend_from_slice(dtype);
    out.push(ndim);
    for d in &t.shape {
        out.extend_from_slice(&d.to_le_bytes());
    }
    true
}

/// Reads fixed-width fields in order, naming the one a short body cuts off.
struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], BinaryBatchError> {
        let end = self.i.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(BinaryBatchError::Short {
                len: self.b.len(),
                field,
                at: self.i,
            });
        };
        let s = &self.b[self.i..end];
        self.i = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], BinaryBatchError> {
        Ok(self
            .take(N, field)?
            .try_into()
            .expect("take returns N bytes"))
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, BinaryBatchError> {
        Ok(self.array::<1>(field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, BinaryBatchError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, BinaryBatchError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, BinaryBatchError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
}

/// Decodes a binary `batch` body (the inverse of [`encode_batch`]).
pub fn decode_batch(body: &[u8]) -> Result<Response, BinaryBatchError> {
    let (mut batch, raw) = decode_batch_raw_state(body)?;
    if let (Response::Batch { state, .. }, Some(raw)) = (&mut batch, raw) {
        *state = Some(
            serde_json::from_slice::<StreamState>(raw)
                .map_err(|e| BinaryBatchError::State(e.to_string()))?,
        );
    }
    Ok(batch)
}

/// Decodes a binary `batch` body but leaves its state as the JSON bytes it came as (`None`:
/// the batch carried none): a trainer that asks for a state now and then decodes only those,
/// not one per batch. The returned batch's `state` is `None`.
pub fn decode_batch_raw_state(body: &[u8]) -> Result<(Response, Option<&[u8]>), BinaryBatchError> {
    let mut r = Reader { b: body, i: 0 };
    let tag = r.u8("tag")?;
    if tag != BINARY_BATCH_TAG {
        return Err(BinaryBatchError::Tag(tag));
    }
    let flags = r.u8("flags")?;
    if flags & !FLAG_MORE != 0 {
        return Err(BinaryBatchError::Flags(flags));
    }
    let count = r.u16("tensors")?;
    let state_len = r.u32("state_len")? as usize;
    let lease = r.u64("lease")?;
    let index = r.u64("index")?;
    let epoch = r.u32("epoch")?;
    let shard = r.u32("shard")?;
    debug_assert_eq!(r.i, HEADER);
    let tensors = (0..usize::from(count))
        .map(|k| read_tensor(&mut r, k))
        .collect::<Result<Vec<_>, _>>()?;
    let state = match state_len {
        0 => None,
        n => Some(r.take(n, "state")?),
    };
    if r.i != body.len() {
        return Err(BinaryBatchError::Trailing(body.len() - r.i));
    }
    let batch = Response::Batch {
        lease,
        epoch,
        index,
        shard,
        tensors,
        state: None,
        more: flags & FLAG_MORE != 0,
    };
    Ok((batch, state))
}

fn read_tensor(r: &mut Reader<'_>, index: usize) -> Result<TensorView, BinaryBatchError> {
    let offset = r.u64("tensor offset")?;
    let length = r.u64("tensor length")?;
    let desc_len = usize::from(r.u16("tensor desc_len")?);
    let desc_start = r.i;
    let name_len = usize::from(r.u16("tensor name_len")?);
    let bad = |what: String| BinaryBatchError::Tensor { index, what };
    let name = std::str::from_utf8(r.take(name_len, "tensor name")?)
        .map_err(|e| bad(format!("name is not UTF-8: {e}")))?
        .to_owned();
    let dtype_len = usize::from(r.u8("tensor dtype_len")?);
    let dtype_name = r.take(dtype_len, "tensor dtype")?;
    let dtype = std::str::from_utf8(dtype_name)
        .ok()
        .and_then(DType::from_name)
        .ok_or_else(|| {
            bad(format!(
                "unknown dtype {:?}",
                String::from_utf8_lossy(dtype_name)
            ))
        })?;
    let ndim = usize::from(r.u8("tensor ndim")?);
    let shape = (0..ndim)
        .map(|_| r.u64("tensor dims"))
        .collect::<Result<Vec<_>, _>>()?;
    if r.i - desc_start != desc_len {
        return Err(bad(format!(
            "desc_len says {desc_len} bytes, its fields take {}",
            r.i - desc_start
        )));
    }
    Ok(TensorView {
        name,
        dtype,
        shape,
        offset,
        length,
    })
}
