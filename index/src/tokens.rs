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
//! larger; such a document is cut into rows of [`SHARD_CAP`] bytes. Documents are found by
//! reading the file, so their rows are checked against the manifest budget as it is read: a
//! file of too many documents is refused without reading the rest.

use std::path::Path;

use shardwire_protocol::manifest::{DType, ShardEntry};

use crate::budget::{self, Budget, Floor, RowKind};
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

/// Shards of whole documents of a token file, cut as the documents are found, and what
/// they will take in the manifest.
struct Cutter {
    dtype: DType,
    /// Most bytes of a shard (whole tokens).
    cap: u64,
    shards: Vec<ShardEntry>,
    /// Floor of the manifest bytes of `shards`.
    closed: Floor,
    /// Rows (file offset, length) of the shard being filled, their bytes, and the floor of
    /// their manifest bytes (without commas).
    rows: Vec<[u64; 2]>,
    bytes: u64,
    row_bytes: u64,
}

impl Cutter {
    fn new(dtype: DType) -> Self {
        Self {
            dtype,
            cap: SHARD_CAP / dtype.size() * dtype.size(),
            shards: Vec::new(),
            closed: Floor::default(),
            rows: Vec::new(),
            bytes: 0,
            row_bytes: 0,
        }
    }

    /// Adds the document at `off` of `len` bytes; one larger than a shard is cut into rows of
    /// `cap` bytes.
    fn document(&mut self, src: &mut Source, off: u64, len: u64) -> Result<(), IndexError> {
        let mut piece = off;
        while piece < off + len {
            let plen = self.cap.min(off + len - piece);
            if self.bytes > 0 && self.bytes + plen > self.cap {
                self.close(src)?;
            }
            self.rows.push([piece, plen]);
            self.bytes += plen;
            // The manifest's rows are relative to their shard.
            self.row_bytes += budget::row_floor(self.bytes);
            piece += plen;
        }
        Ok(())
    }

    /// Ends the shard being filled, if any.
    fn close(&mut self, src: &mut Source) -> Result<(), IndexError> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let shard = megatron::shard(src, self.dtype, &self.rows, self.bytes)?;
        self.closed = self.closed.plus(budget::shard_floor(&shard));
        self.shards.push(shard);
        (self.rows, self.bytes, self.row_bytes) = (Vec::new(), 0, 0);
        Ok(())
    }

    /// A lower bound of the manifest bytes of every row so far: the closed shards', and the
    /// open shard's rows with the commas between them.
    fn floor(&self) -> Floor {
        let n = self.rows.len() as u64;
        let open = self.row_bytes + n.saturating_sub(1);
        self.closed.plus(Floor {
            bytes: open,
            row_bytes: open,
            rows: n,
        })
    }
}

/// Cuts `src` into documents ending at `eos` (the tokens after the last one are the last),
/// reading `scan` bytes at a time; after each read the rows found so far are checked
/// against the budget (`check`: it and the dataset directory), so a file of too many
/// documents is refused without reading the rest.
fn documents(
    src: &mut Source,
    eos: u64,
    cut: &mut Cutter,
    check: (&Budget, &Path),
    scan: u64,
) -> Result<(), IndexError> {
    let size = cut.dtype.size();
    let want = &eos.to_le_bytes()[..size as usize];
    let mut start = 0u64;
    let mut at = 0u64;
    while at < src.len {
        let len = scan.min(src.len - at);
        let buf = src.read_at("tokens", at, len)?;
        for (i, tok) in buf.chunks_exact(size as usize).enumerate() {
            if tok == want {
                let end = at + (i as u64 + 1) * size;
                cut.document(src, start, end - start)?;
                start = end;
            }
        }
        at += len;
        if at == src.len && start < src.len {
            cut.document(src, start, src.len - start)?;
        }
        check_read(cut, check, src, at)?;
    }
    Ok(())
}

/// Checks the rows `cut` holds, found in the first `read` bytes of `src`, against the budget.
fn check_read(
    cut: &Cutter,
    (budget, dir): (&Budget, &Path),
    src: &Source,
    read: u64,
) -> Result<(), IndexError> {
    let shards = cut.shards.len() as u64 + u64::from(!cut.rows.is_empty());
    let at = || {
        format!(
            " (counted up to {}, while reading its --eos documents: {read} of its {} bytes \
             read)",
            src.rel, src.len
        )
    };
    budget.check_more(cut.floor(), shards, RowKind::Tokens, dir, at)
}

/// Indexes the raw token file `src` of the dataset at `dir`; with `--eos`, its documents are
/// checked against `budget` as they are found (see [`documents`]).
pub(crate) fn index(
    src: &mut Source,
    t: RawTokens,
    budget: &Budget,
    dir: &Path,
) -> Result<Vec<ShardEntry>, IndexError> {
    index_scanning(src, t, (budget, dir), SCAN)
}

/// [`index`], reading `scan` bytes at a time.
fn index_scanning(
    src: &mut Source,
    t: RawTokens,
    check: (&Budget, &Path),
    scan: u64,
) -> Result<Vec<ShardEntry>, IndexError> {
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
    let mut cut = Cutter::new(t.dtype);
    let Some(eos) = t.eos else {
        // No document boundaries: rows at shard boundaries only, counted before the data is
        // read, as any file's.
        cut.document(src, 0, src.len)?;
        cut.close(src)?;
        return Ok(cut.shards);
    };
    documents(src, eos, &mut cut, check, scan)?;
    cut.close(src)?;
    // The closed shards' floor is the one the caller adds: checked here, it is refused with
    // the truth (the file was read), never "before its data was read".
    check_read(&cut, check, src, src.len)?;
    Ok(cut.shards)
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
    fn too_many_documents_are_refused_while_reading_not_after() {
        // Before, the whole file was read for its documents, then refused "before its data
        // was read".
        let dir = temp_dir("tokens-budget");
        // 1000 one-token documents: every token is the end-of-document id 0.
        std::fs::write(dir.join("t.bin"), vec![0u8; 2000]).unwrap();
        let mut src = Source::open(&dir.join("t.bin"), "t.bin").unwrap();
        let t = RawTokens::new(DType::Uint16, Some(0)).unwrap();
        let budget = Budget::new(1000);
        let e = index_scanning(&mut src, t, (&budget, dir.as_path()), 100).unwrap_err();
        // 150 rows (300 bytes read) are the first to pass 1000 bytes.
        let IndexError::ManifestTooLarge { rows, at, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*rows, 150, "{e}");
        assert!(
            at.contains("t.bin") && at.contains("300 of its 2000 bytes read"),
            "{e}"
        );
        assert!(!e.to_string().contains("before its data was read"), "{e}");
        // The last check is exact: at the manifest's floor the file is indexed whole (and
        // the caller's count passes); a byte less is refused while reading, never later
        // by the caller "before its data was read".
        let unlimited = Budget::new(u64::MAX);
        let shards = index_scanning(&mut src, t, (&unlimited, dir.as_path()), 100).unwrap();
        assert_eq!(shards[0].tensors[0].rows.as_ref().unwrap().len(), 1000);
        let floor = budget::HEAD_FLOOR + budget::shard_floor(&shards[0]).bytes;
        let mut exact = Budget::new(floor);
        index_scanning(&mut src, t, (&exact, dir.as_path()), 100).unwrap();
        exact.add(&shards, RowKind::Tokens, &dir, "t.bin").unwrap();
        let e =
            index_scanning(&mut src, t, (&Budget::new(floor - 1), dir.as_path()), 100).unwrap_err();
        assert!(e.to_string().contains("2000 of its 2000 bytes read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
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
