//! Raw token files (`shardwire index --tokens DTYPE [--eos ID]`): every `.bin` that is not
//! half of a Megatron pair is a stream of little-endian tokens of DTYPE, as nanoGPT's
//! `train.bin` (`uint16`) is. The file becomes shards of one ragged tensor `tokens`, one row
//! per document, so token mode (`seq_len`) cuts windows from it:
//!
//! - with `--eos ID`, a document ends at (and includes) each token equal to ID; the tokens
//!   after the last ID are the last document;
//! - without it the file has no document boundaries: it is cut into rows at shard
//!   boundaries only (positions, with `boundaries`, then restart there).
//!
//! Shards hold whole documents, at most [`SHARD_CAP`] bytes unless one document alone is
//! larger; such a document is cut into rows of [`SHARD_CAP`] bytes.

use shardwire_protocol::manifest::{DType, ShardEntry};

use crate::error::IndexError;
use crate::megatron::{self, SHARD_CAP};
use crate::source::Source;

/// Bytes read at a time while looking for end-of-document tokens.
const SCAN: u64 = 8 << 20;

/// How raw `.bin` token files are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawTokens {
    /// The tokens' dtype (an integer type).
    pub dtype: DType,
    /// The end-of-document token, if documents are marked.
    pub eos: Option<u64>,
}

impl RawTokens {
    /// Checks the options: an integer dtype, and an `eos` it can hold.
    pub fn new(dtype: DType, eos: Option<u64>) -> Result<Self, String> {
        if matches!(dtype, DType::Float16 | DType::Float32 | DType::Float64) {
            return Err(format!(
                "--tokens {}: token ids are integers; use uint16, int32, ...",
                dtype.name()
            ));
        }
        if let Some(e) = eos {
            let bits = dtype.size() * 8;
            let signed = matches!(
                dtype,
                DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64
            );
            let max = match (bits, signed) {
                (64, false) => u64::MAX,
                (b, false) => (1u64 << b) - 1,
                (b, true) => (1u64 << (b - 1)) - 1,
            };
            if e > max {
                return Err(format!(
                    "--eos {e} does not fit --tokens {} (at most {max})",
                    dtype.name()
                ));
            }
        }
        Ok(Self { dtype, eos })
    }
}

/// The rows (byte offset, length) of the documents of `src`.
fn documents(src: &mut Source, t: RawTokens) -> Result<Vec<[u64; 2]>, IndexError> {
    let size = t.dtype.size();
    let mut rows = Vec::new();
    let Some(eos) = t.eos else {
        return Ok(vec![[0, src.len]]);
    };
    let want = &eos.to_le_bytes()[..size as usize];
    let mut start = 0u64;
    let mut at = 0u64;
    while at < src.len {
        let len = SCAN.min(src.len - at);
        let buf = src.read_at("tokens", at, len)?;
        for (i, tok) in buf.chunks_exact(size as usize).enumerate() {
            if tok == want {
                let end = at + (i as u64 + 1) * size;
                rows.push([start, end - start]);
                start = end;
            }
        }
        at += len;
    }
    if start < src.len {
        rows.push([start, src.len - start]);
    }
    Ok(rows)
}

/// Indexes the raw token file `src`.
pub(crate) fn index(src: &mut Source, t: RawTokens) -> Result<Vec<ShardEntry>, IndexError> {
    let size = t.dtype.size();
    if src.len == 0 {
        return Ok(Vec::new());
    }
    if !src.len.is_multiple_of(size) {
        return Err(src.malformed(
            format!(
                "a file of {} tokens must be a multiple of {size} bytes long (is --tokens right?)",
                t.dtype.name()
            ),
            src.len,
        ));
    }
    let cap = SHARD_CAP / size * size;
    let mut shards = Vec::new();
    let mut rows: Vec<[u64; 2]> = Vec::new();
    let mut bytes = 0u64;
    for [off, len] in documents(src, t)? {
        // A document larger than a shard is cut into rows of `cap` bytes.
        let mut piece = off;
        while piece < off + len {
            let plen = cap.min(off + len - piece);
            if bytes > 0 && bytes + plen > cap {
                shards.push(megatron::shard(src, t.dtype, &rows, bytes)?);
                (rows, bytes) = (Vec::new(), 0);
            }
            rows.push([piece, plen]);
            bytes += plen;
            piece += plen;
        }
    }
    if !rows.is_empty() {
        shards.push(megatron::shard(src, t.dtype, &rows, bytes)?);
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::temp_dir;
    use crate::{IndexOptions, index_dir};

    fn opts(dtype: DType, eos: Option<u64>) -> IndexOptions {
        IndexOptions {
            tokens: Some(RawTokens::new(dtype, eos).unwrap()),
            ..IndexOptions::default()
        }
    }

    fn u16s(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn eos_ends_documents_and_the_tail_is_the_last() {
        let dir = temp_dir("tokens-eos");
        std::fs::write(dir.join("train.bin"), u16s(&[5, 6, 0, 7, 0, 0, 8, 9])).unwrap();
        let m = index_dir(&dir, &opts(DType::Uint16, Some(0))).unwrap();
        let t = &m.shards[0].tensors[0];
        assert_eq!(
            (t.name.as_str(), t.dtype, t.ragged),
            ("tokens", DType::Uint16, true)
        );
        assert_eq!(
            t.rows.as_deref().unwrap(),
            [[0, 6], [6, 4], [10, 2], [12, 4]]
        );
        let m = index_dir(&dir, &opts(DType::Uint16, None)).unwrap();
        assert_eq!(m.shards[0].tensors[0].rows.as_deref().unwrap(), [[0, 16]]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_lengths_and_options_are_refused_naming_the_value() {
        let dir = temp_dir("tokens-bad");
        std::fs::write(dir.join("odd.bin"), [1u8, 2, 3]).unwrap();
        let e = index_dir(&dir, &opts(DType::Uint16, None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("odd.bin") && e.contains("multiple of 2 bytes") && e.contains('3'),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let e = RawTokens::new(DType::Uint16, Some(70000)).unwrap_err();
        assert!(
            e.contains("--eos 70000 does not fit --tokens uint16 (at most 65535)"),
            "{e}"
        );
        assert!(
            RawTokens::new(DType::Float32, None)
                .unwrap_err()
                .contains("integers")
        );
    }

    #[test]
    fn documents_larger_than_a_shard_are_cut_into_rows() {
        let dir = temp_dir("tokens-big");
        // One document of SHARD_CAP + 4 bytes of uint16, then a short one.
        let n = (SHARD_CAP / 2 + 2) as usize;
        let mut toks: Vec<u16> = (0..n).map(|i| (i % 60000 + 1) as u16).collect();
        toks.extend([0, 3, 4]);
        std::fs::write(dir.join("t.bin"), u16s(&toks)).unwrap();
        let m = index_dir(&dir, &opts(DType::Uint16, Some(0))).unwrap();
        let rows: Vec<Vec<[u64; 2]>> = m
            .shards
            .iter()
            .map(|s| s.tensors[0].rows.clone().unwrap())
            .collect();
        assert_eq!(rows, vec![vec![[0, SHARD_CAP]], vec![[0, 6], [6, 4]]]);
        assert_eq!(m.shards[1].offset, SHARD_CAP);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
