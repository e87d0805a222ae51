//! Token mode (DESIGN §10, token windows): a batch-mode stream with `seq_len` whose samples
//! are windows of `seq_len + 1` tokens cut from the documents, the rows of one ragged
//! integer tensor (a Megatron `.bin/.idx`, a raw token file, an Arrow `input_ids` column).
//!
//! [`TokenMode::of`] picks that tensor and checks the request; [`plan`] lays a batch out as
//! `tokens` (`[batch_size, seq_len + 1]`, the dataset's dtype or `token_dtype`) and, with
//! `boundaries`, `positions` (int32, same shape: the token's place in its document, 0 at
//! each document start), written from the host. Widening happens while copying (`Widen`).

use shardwire_protocol::manifest::ShardEntry;
use shardwire_protocol::samples::{TokenPiece, WindowSpec};
use shardwire_protocol::trainer::{ErrorCode, StreamRequest, WindowOrder};
use shardwire_protocol::{DType, Manifest};

use super::assemble::{Plan, Widen, row_range};
use super::error::OpenError;
use super::layout::TENSOR_ALIGN;

/// The delivered tokens tensor.
pub const TOKENS: &str = "tokens";
/// The delivered positions tensor (`boundaries`).
pub const POSITIONS: &str = "positions";

/// How a token-mode stream reads and delivers its windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMode {
    /// Index of the documents' tensor in the shards from each first shard on (one entry per
    /// dataset of a mixture, by first shard in the stream's manifest).
    pub tensors: Vec<(u32, usize)>,
    /// Its dtype.
    pub src: DType,
    /// The delivered dtype.
    pub out: DType,
    /// Tokens per window less one.
    pub seq_len: u64,
    /// Deliver `positions`.
    pub boundaries: bool,
}

fn bad(msg: String) -> OpenError {
    OpenError::new(ErrorCode::BadRequest, format!("token mode: {msg}"))
}

/// Whether every value of `src` fits `out` (the widenings `token_dtype` allows).
fn holds(out: DType, src: DType) -> bool {
    use DType::*;
    match out {
        Int32 => matches!(src, Int8 | Int16 | Int32 | Uint8 | Uint16),
        Int64 => matches!(src, Int8 | Int16 | Int32 | Int64 | Uint8 | Uint16 | Uint32),
        _ => false,
    }
}

fn is_int(d: DType) -> bool {
    !matches!(d, DType::Float16 | DType::Float32 | DType::Float64)
}

impl TokenMode {
    /// The documents' tensor of `m` (`tokens_column`, or its only ragged integer tensor
    /// wider than 8 bits), the window spec over its rows, and the delivery.
    pub fn of(
        m: &Manifest,
        r: &StreamRequest,
        seq_len: u64,
    ) -> Result<(WindowSpec, Self), OpenError> {
        let first = m
            .shards
            .first()
            .ok_or_else(|| bad("the dataset has no shards".into()))?;
        let (tensor, src) = choose_column(first, r.tokens_column.as_deref())?;
        let name = first.tensors[tensor].name.as_str();
        let out = r.token_dtype.unwrap_or(src);
        if out != src && !holds(out, src) {
            return Err(bad(format!(
                "token_dtype {} cannot hold every {} token; use int32 or int64 wide enough (int64 holds all but uint64)",
                out.name(),
                src.name()
            )));
        }
        let spec = WindowSpec {
            seq_len,
            column: name.to_owned(),
            doc_tokens: doc_tokens(m, tensor, name, src)?,
            megatron: r.order == Some(WindowOrder::Megatron),
        };
        let mode = Self {
            tensors: vec![(0, tensor)],
            src,
            out,
            seq_len,
            boundaries: r.boundaries,
        };
        Ok((spec, mode))
    }

    /// The documents' tensor index in shard `shard`.
    pub fn tensor(&self, shard: u32) -> usize {
        let i = self.tensors.partition_point(|&(first, _)| first <= shard);
        self.tensors[i.max(1) - 1].1
    }

    /// Tokens per window.
    pub fn width(&self) -> u64 {
        self.seq_len + 1
    }

    /// Bytes of a batch of `b` windows (`u64::MAX` where that overflows: no region holds
    /// it, and the stream is refused as too large).
    pub fn batch_bytes(&self, b: u32) -> u64 {
        let aligned = |x: Option<u64>| x?.checked_next_multiple_of(TENSOR_ALIGN);
        let bytes = || {
            let cells = u64::from(b).checked_mul(self.width())?;
            let tokens = aligned(cells.checked_mul(self.out.size()))?;
            match self.boundaries {
                true => tokens.checked_add(aligned(cells.checked_mul(4))?),
                false => Some(tokens),
            }
        };
        bytes().unwrap_or(u64::MAX)
    }
}

/// The index and dtype of the documents' tensor among `first`'s: `column`, or the only
/// ragged integer tensor wider than a byte.
fn choose_column(first: &ShardEntry, column: Option<&str>) -> Result<(usize, DType), OpenError> {
    let candidates: Vec<&str> = first
        .tensors
        .iter()
        .filter(|t| t.ragged && is_int(t.dtype))
        .map(|t| t.name.as_str())
        .collect();
    // Chosen without `tokens_column`: wider than a byte (strings, bytes, WebDataset
    // members and HF attention masks are 8-bit; token ids never are).
    let wide: Vec<&str> = first
        .tensors
        .iter()
        .filter(|t| t.ragged && is_int(t.dtype) && t.dtype.size() > 1)
        .map(|t| t.name.as_str())
        .collect();
    let name = match (column, wide.as_slice()) {
        (Some(n), _) => n,
        (None, [one]) => one,
        (None, []) => {
            return Err(bad(format!(
                "seq_len needs documents as the rows of a ragged integer tensor wider than 8 bits (a Megatron .bin/.idx, `shardwire index --tokens`, an Arrow list-of-integers column such as input_ids), or tokens_column naming one; the dataset's tensors are {:?}",
                first.tensors.iter().map(|t| &t.name).collect::<Vec<_>>()
            )));
        }
        (None, many) => {
            return Err(bad(format!(
                "the dataset has several ragged integer tensors {many:?}; name the documents with tokens_column"
            )));
        }
    };
    let tensor = first.tensors.iter().position(|t| t.name == name).ok_or_else(|| {
            bad(format!("tokens_column {name:?} is not a tensor of the dataset; ragged integer tensors: {candidates:?}"))
        })?;
    let src = first.tensors[tensor].dtype;
    if !candidates.contains(&name) {
        return Err(bad(format!(
            "tokens_column {name:?} is {} {}, not a ragged integer tensor; ragged integer tensors: {candidates:?}",
            if first.tensors[tensor].ragged {
                "ragged"
            } else {
                "fixed-shape"
            },
            src.name()
        )));
    }
    Ok((tensor, src))
}

/// The tokens of every document (row of tensor `tensor`, `name`, of `src` tokens) per shard.
fn doc_tokens(
    m: &Manifest,
    tensor: usize,
    name: &str,
    src: DType,
) -> Result<Vec<Vec<u32>>, OpenError> {
    let mut doc_tokens = Vec::with_capacity(m.shards.len());
    for (i, s) in m.shards.iter().enumerate() {
        let t = s
            .tensors
            .get(tensor)
            .filter(|t| t.name == name && t.dtype == src && t.ragged);
        let Some(t) = t else {
            return Err(bad(format!(
                "shard {i} ({}) has no ragged {} tensor {name:?} at the place shard 0 has it",
                s.file,
                src.name()
            )));
        };
        let mut docs = Vec::with_capacity(t.row_count() as usize);
        for row in 0..t.row_count() {
            let n = row_range(s, t, row).1 / src.size();
            docs.push(u32::try_from(n).map_err(|_| {
                    bad(format!(
                        "shard {i} ({}) row {row} of {name:?} holds {n} tokens; a document may hold at most {} (split it)",
                        s.file,
                        u32::MAX
                    ))
                })?);
        }
        doc_tokens.push(docs);
    }
    Ok(doc_tokens)
}

/// The slab of a batch of `windows` (in order): `tokens` at 0, then `positions`.
pub fn plan(m: &Manifest, mode: &TokenMode, windows: &[Vec<TokenPiece>]) -> Plan {
    let b = windows.len() as u64;
    let (w, src, out) = (mode.width(), mode.src.size(), mode.out.size());
    let tokens_len = b * w * out;
    let mut p = Plan {
        widen: (mode.src != mode.out).then_some(Widen {
            from: mode.src,
            to: mode.out,
        }),
        ..Plan::default()
    };
    let mut positions = Vec::with_capacity(if mode.boundaries {
        (b * w * 4) as usize
    } else {
        0
    });
    for (j, win) in windows.iter().enumerate() {
        let mut at = j as u64 * w; // in tokens
        for piece in win {
            let s = &m.shards[piece.doc.shard as usize];
            let (row, _) = row_range(s, &s.tensors[mode.tensor(piece.doc.shard)], piece.doc.row);
            let from = row + piece.start * src;
            p.push(piece.doc.shard, from, at * out, piece.len * src);
            if mode.boundaries {
                for k in piece.start..piece.start + piece.len {
                    positions.extend_from_slice(&(k.min(i32::MAX as u64) as i32).to_le_bytes());
                }
            }
            at += piece.len;
        }
    }
    p.views.push(super::assemble::view(
        TOKENS,
        mode.out,
        vec![b, w],
        0,
        tokens_len,
    ));
    p.bytes = tokens_len.next_multiple_of(TENSOR_ALIGN);
    if mode.boundaries {
        let len = positions.len() as u64;
        p.views.push(super::assemble::view(
            POSITIONS,
            DType::Int32,
            vec![b, w],
            p.bytes,
            len,
        ));
        p.writes.push((p.bytes, positions));
        p.bytes = (p.bytes + len).next_multiple_of(TENSOR_ALIGN);
    }
    p.bytes = p.bytes.max(1);
    p
}

#[cfg(test)]
mod tests;
