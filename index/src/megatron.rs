//! Megatron-LM indexed datasets: a pair `NAME.bin` + `NAME.idx` in one directory
//! (`megatron/core/datasets/indexed_dataset.py`). The `.bin` holds the token sequences back
//! to back; the `.idx` says where each starts. A `.bin` without its `.idx` stays a raw
//! `uint8` shard ([`crate::bin`]) when no `.bin` has one; beside `.bin`/`.idx` pairs it is
//! refused ([`refuse_unpaired`]), unless `--tokens` reads it as raw tokens. An `.idx`
//! without its `.bin` is reported unused.
//!
//! The `.idx` layout, all little-endian and unaligned: the magic `MMIDIDX\0\0` (9 bytes), a
//! `u64` version (1), a `u8` dtype code, a `u64` sequence count `S`, a `u64` document count
//! `D` (documents + 1), then `int32[S]` sequence lengths (in tokens), `int64[S]` sequence
//! byte offsets into the `.bin`, and `int64[D]` document indices (sequence numbers, `0 ..
//! S`). Everything is checked: the sequences must tile the `.bin` exactly.
//!
//! The `.bin` is cut into shards of whole sequences, each at most [`SHARD_CAP`] bytes of
//! tokens unless one sequence alone is larger (then that sequence is a shard by itself).
//! Each shard holds one ragged tensor `tokens` with one row per sequence (GPT-style
//! training samples are sequences).
//!
//! Future work: documents (groups of sequences) are validated but not carried in the
//! manifest; token windows that span sequences of a document would need them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry};

use crate::budget::{self, FileCheck};
use crate::error::IndexError;
use crate::root::Root;
use crate::source::Source;
use crate::walk::{Candidate, Kind, Unused};

/// Most bytes of tokens in one shard (unless a single sequence is larger).
pub(crate) const SHARD_CAP: u64 = 64 << 20;
/// The `.idx` magic.
const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Bytes before the arrays.
const HEADER: u64 = 34;

/// The `.idx` of each paired `.bin`, by the `.bin`'s relative path: (full path, relative path).
pub(crate) type Plan = HashMap<String, (PathBuf, String)>;

/// Takes the `.idx` files out of `files`, pairing each with the `.bin` of the same stem in
/// the same directory; an `.idx` with no such `.bin` goes to `unused`, with the reason, and
/// so does a second `.idx` of one `.bin` (`d.idx` and `d.IDX`: the one whose extension has
/// the case of the `.bin`'s is used, else the first by name).
pub(crate) fn plan(files: &mut Vec<Candidate>, unused: &mut Vec<Unused>) -> Plan {
    let stem = |rel: &'_ str| -> String { rel.rsplit_once('.').map_or(rel, |(s, _)| s).to_owned() };
    // By stem: the extension's case does not matter (`Kind::of` ignores it too).
    let bins: HashMap<String, &str> = files
        .iter()
        .filter(|f| f.kind == Kind::Bin)
        .map(|f| (stem(&f.rel), f.rel.as_str()))
        .collect();
    let mut plan = Plan::new();
    for f in files.iter().filter(|f| f.kind == Kind::MegatronIdx) {
        if let Some(bin) = bins.get(&stem(&f.rel)) {
            let mine = (f.path.clone(), f.rel.clone());
            let Some(used) = plan.get_mut(*bin) else {
                plan.insert((*bin).to_owned(), mine);
                continue;
            };
            if same_case(bin, &f.rel) && !same_case(bin, &used.1) {
                // This one takes the place of the one chosen so far.
                *used = mine;
            }
        } else {
            let bin = format!("{}.bin", stem(&f.rel));
            let name = bin.rsplit('/').next().unwrap_or(&bin).to_owned();
            unused.push(Unused {
                file: f.rel.clone(),
                reason: format!("Megatron .idx without its data file {name} next to it"),
            });
        }
    }
    // Every index of a `.bin` but the one chosen, named with the chosen one.
    let chosen: Vec<(&str, &str)> = plan
        .iter()
        .map(|(bin, (_, rel))| (bin.as_str(), rel.as_str()))
        .collect();
    for (bin, rel) in files
        .iter()
        .filter(|f| f.kind == Kind::MegatronIdx)
        .filter_map(|f| bins.get(&stem(&f.rel)).map(|bin| (*bin, f.rel.as_str())))
    {
        let used = chosen.iter().find(|(b, _)| *b == bin).map(|(_, r)| *r);
        if let Some(used) = used.filter(|&u| u != rel) {
            unused.push(second_index(bin, rel, used));
        }
    }
    files.retain(|f| f.kind != Kind::MegatronIdx);
    plan
}

/// Refuses the `.bin` files among `files` (of the dataset at `dir`) that `plan` gave no
/// `.idx`, when it paired at least one, unless `tokens` (`--tokens` reads them as raw
/// tokens). Among Megatron pairs, a lone `.bin` is one whose `.idx` was lost (a partial copy,
/// a sync filter that skips `.idx`): Megatron-LM cannot read it, and served as one raw `uint8`
/// tensor of its whole bytes beside the `tokens` of the pairs, it would give a trainer
/// garbage that no note in a log would stop. Without pairs, a `.bin` is raw data as ever.
pub(crate) fn refuse_unpaired(
    dir: &Path,
    files: &[Candidate],
    plan: &Plan,
    tokens: bool,
) -> Result<(), IndexError> {
    if plan.is_empty() || tokens {
        return Ok(());
    }
    let bins: Vec<String> = files
        .iter()
        .filter(|f| f.kind == Kind::Bin && !plan.contains_key(&f.rel))
        .map(|f| f.rel.clone())
        .collect();
    if bins.is_empty() {
        return Ok(());
    }
    Err(IndexError::UnpairedMegatronBin {
        dir: dir.to_path_buf(),
        bins,
        pairs: plan.len(),
    })
}

/// Whether the `.idx` `idx` has its extension in the case of the `.bin` `bin`'s
/// (`d.bin` and `d.idx`, `D.BIN` and `D.IDX`).
fn same_case(bin: &str, idx: &str) -> bool {
    let ext = |rel: &str| rel.rsplit_once('.').map_or("", |(_, e)| e).to_owned();
    let want = match ext(bin).as_str() {
        "bin" => "idx",
        "BIN" => "IDX",
        _ => return false,
    };
    ext(idx) == want
}

/// The note for `extra`, a second `.idx` of the `.bin` `bin`, whose index is `used`.
fn second_index(bin: &str, extra: &str, used: &str) -> Unused {
    let name = |rel: &str| rel.rsplit('/').next().unwrap_or(rel).to_owned();
    Unused {
        file: extra.to_owned(),
        reason: format!(
            "a second Megatron index of {} ({} is the one used); remove the stale one",
            name(bin),
            name(used)
        ),
    }
}

/// The dtype of a Megatron dtype code.
fn dtype(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::Uint8,
        2 => DType::Int8,
        3 => DType::Int16,
        4 => DType::Int32,
        5 => DType::Int64,
        6 => DType::Float64,
        7 => DType::Float32,
        8 => DType::Uint16,
        _ => return None,
    })
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn i64_at(b: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn i32_at(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// What an `.idx` says: the token dtype and each sequence's byte range `[offset, length]`
/// in the `.bin`.
struct Index {
    dtype: DType,
    seqs: Vec<[u64; 2]>,
}

/// Reads and checks an `.idx` against its `.bin`; its sequences (rows) are counted in `check`
/// from its header, before its arrays are read.
fn read_index(idx: &mut Source, bin: &Source, check: &FileCheck<'_>) -> Result<Index, IndexError> {
    let (dtype, s, d) = read_header(idx)?;
    if bin.len > 0 {
        check_rows(idx, bin, s, check)?;
    }
    // Bounded by the file size `read_header` checked.
    let arrays = idx.read_exact_at("the .idx arrays", HEADER, s * 12 + d * 8)?;
    let (s, d) = (s as usize, d as usize);
    let seqs = sequences(idx, &arrays, s, dtype.size(), bin.len, &bin.path)?;
    check_documents(idx, &arrays[12 * s..], s, d)?;
    Ok(Index { dtype, seqs })
}

/// Refuses the `s` sequences of the index `idx` of `bin` when their rows cannot fit the
/// manifest, before the index's arrays (12 bytes a sequence, 8 a document) are read and a
/// row built for each: one row per sequence, however they are cut into shards.
fn check_rows(idx: &Source, bin: &Source, s: u64, check: &FileCheck<'_>) -> Result<(), IndexError> {
    let at = || {
        format!(
            " (counted up to {}, from the {s} sequences its index {} gives in its header, \
             before the index was read)",
            bin.rel, idx.rel
        )
    };
    check.check(budget::ragged_floor("tokens", s, 0), at)
}

/// The header's dtype, sequence count and document count, checked against the file size.
fn read_header(idx: &mut Source) -> Result<(DType, u64, u64), IndexError> {
    let head = idx.read_at("the .idx header", 0, HEADER.min(idx.len))?;
    if head.len() < 9 || &head[..9] != MAGIC {
        return Err(idx.malformed(
            "not a Megatron-LM index (magic MMIDIDX\\0\\0)",
            format!("{:?}", String::from_utf8_lossy(&head[..head.len().min(9)])),
        ));
    }
    if head.len() < HEADER as usize {
        return Err(idx.malformed(
            format!("the header is {HEADER} bytes"),
            format!("{} bytes", idx.len),
        ));
    }
    let version = u64_at(&head, 9);
    if version != 1 {
        return Err(idx.unsupported("only Megatron index version 1 is known", version));
    }
    let code = head[17];
    let dtype = dtype(code).ok_or_else(|| {
        idx.unsupported(
            "unknown dtype code (known: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)",
            code,
        )
    })?;
    let s = u64_at(&head, 18);
    let d = u64_at(&head, 26);
    let need = s
        .checked_mul(12)
        .and_then(|a| d.checked_mul(8).and_then(|b| a.checked_add(b)))
        .and_then(|a| a.checked_add(HEADER));
    if need.is_none_or(|n| n > idx.len) {
        return Err(idx.malformed(
            format!(
                "{s} sequences and {d} document indices need {} bytes, more than the file's {}",
                need.map_or("too many".into(), |n| n.to_string()),
                idx.len
            ),
            format!("sequence_count {s}, document_count {d}"),
        ));
    }
    // Megatron-core writes exactly this; a multimodal dataset has one int8 sequence mode per
    // sequence after the document indices, which a text loader would silently drop.
    let need = need.unwrap_or(0);
    if idx.len != need {
        let extra = idx.len - need;
        return Err(if extra == s {
            idx.unsupported(
                "a multimodal index (an int8 sequence mode per sequence after the document indices) is not supported: shardwire serves text token datasets",
                format!("{extra} bytes of sequence modes"),
            )
        } else {
            idx.malformed(
                format!("{s} sequences and {d} document indices take {need} bytes"),
                format!("{} bytes ({extra} after them)", idx.len),
            )
        });
    }
    Ok((dtype, s, d))
}

/// Each sequence's byte range in the `.bin`: pointers contiguous from 0, tiling its `bin_len`.
fn sequences(
    idx: &Source,
    arrays: &[u8],
    s: usize,
    size: u64,
    bin_len: u64,
    bin: &Path,
) -> Result<Vec<[u64; 2]>, IndexError> {
    let mut seqs = Vec::with_capacity(s);
    let mut expect = 0u64;
    for i in 0..s {
        let len = i32_at(arrays, 4 * i);
        let ptr = i64_at(arrays, 4 * s + 8 * i);
        if len < 0 {
            return Err(idx.malformed(format!("sequence {i} has a negative length"), len));
        }
        if ptr < 0 || ptr as u64 != expect {
            return Err(idx.malformed(
                format!(
                    "sequence {i} does not start where the previous one ends (pointers must be contiguous from 0)"
                ),
                format!("pointer {ptr}, expected {expect}"),
            ));
        }
        let bytes = len as u64 * size;
        seqs.push([expect, bytes]);
        expect = expect
            .checked_add(bytes)
            .ok_or_else(|| idx.malformed(format!("sequence {i} ends beyond 2^64"), ptr))?;
    }
    if expect != bin_len {
        return Err(IndexError::Malformed {
            file: bin.to_path_buf(),
            reason: format!(
                "its index {} says the sequences take {expect} bytes, but the file has {bin_len}",
                idx.rel
            ),
            value: format!("{bin_len} bytes"),
        });
    }
    Ok(seqs)
}

/// Document indices: the first 0, never decreasing, the last the sequence count.
fn check_documents(idx: &Source, docs: &[u8], s: usize, d: usize) -> Result<(), IndexError> {
    let mut prev = 0i64;
    for j in 0..d {
        let v = i64_at(docs, 8 * j);
        if (j == 0 && v != 0) || v < prev || v as u64 > s as u64 {
            return Err(idx.malformed(
                format!(
                    "document index {j} breaks the rule: the first is 0, they never decrease, none exceeds the {s} sequences"
                ),
                v,
            ));
        }
        prev = v;
    }
    if d == 0 || prev as u64 != s as u64 {
        return Err(idx.malformed(
            format!("the last document index must be the sequence count {s}"),
            if d == 0 {
                "no document indices".to_owned()
            } else {
                prev.to_string()
            },
        ));
    }
    Ok(())
}

/// Indexes the `.bin` `src` with its `.idx` (full path, relative path).
/// Its sequences are counted in `check` before the `.idx` arrays are read.
pub(crate) fn index(
    root: &Root,
    src: &mut Source,
    idx: &(PathBuf, String),
    check: &FileCheck<'_>,
) -> Result<Vec<ShardEntry>, IndexError> {
    index_with_cap(root, src, idx, check, SHARD_CAP)
}

fn index_with_cap(
    root: &Root,
    src: &mut Source,
    (_, idx_rel): &(PathBuf, String),
    check: &FileCheck<'_>,
    cap: u64,
) -> Result<Vec<ShardEntry>, IndexError> {
    let mut idx = root.open(idx_rel)?;
    let Index { dtype, seqs } = read_index(&mut idx, src, check)?;
    if src.len == 0 {
        // No tokens at all: reported as holding no rows.
        return Ok(Vec::new());
    }
    let mut shards = Vec::new();
    let mut start = 0usize;
    let mut bytes = 0u64;
    for (i, &[_, len]) in seqs.iter().enumerate() {
        // An empty sequence never starts a shard (a shard of only empty ones would hold no
        // bytes): it stays with the one before.
        if i > start && len > 0 && bytes + len > cap && bytes > 0 {
            shards.push(shard(src, dtype, &seqs[start..i], bytes)?);
            (start, bytes) = (i, 0);
        }
        bytes += len;
    }
    if start < seqs.len() {
        shards.push(shard(src, dtype, &seqs[start..], bytes)?);
    }
    Ok(shards)
}

/// One shard of one ragged tensor `tokens` holding the rows `seqs` (contiguous byte ranges
/// of the file, `bytes` in all).
pub(crate) fn shard(
    src: &mut Source,
    dtype: DType,
    seqs: &[[u64; 2]],
    bytes: u64,
) -> Result<ShardEntry, IndexError> {
    let offset = seqs[0][0];
    let rows = seqs.iter().map(|&[o, l]| [o - offset, l]).collect();
    let tensor = TensorEntry {
        name: "tokens".into(),
        dtype,
        shape: vec![bytes / dtype.size()],
        offset,
        length: bytes,
        rows: Some(rows),
        ragged: true,
    };
    src.shard(offset, bytes, vec![tensor])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{Budget, RowKind};
    use crate::testutil::{check_manifest, le_bytes, temp_dir};
    use crate::{IndexOptions, index_dir, index_report};

    /// Writes `NAME.bin` and `NAME.idx` for `docs` (each a list of sequences of tokens,
    /// already little-endian bytes of `size`-byte elements); returns the .bin bytes.
    fn write(dir: &Path, name: &str, code: u8, size: usize, docs: &[Vec<Vec<u8>>]) -> Vec<u8> {
        let mut bin = Vec::new();
        let (mut lens, mut ptrs, mut doc_idx) = (Vec::new(), Vec::new(), vec![0i64]);
        for d in docs {
            for s in d {
                lens.push((s.len() / size) as i32);
                ptrs.push(bin.len() as i64);
                bin.extend_from_slice(s);
            }
            doc_idx.push(lens.len() as i64);
        }
        std::fs::write(dir.join(format!("{name}.bin")), &bin).unwrap();
        std::fs::write(
            dir.join(format!("{name}.idx")),
            idx(code, &lens, &ptrs, &doc_idx),
        )
        .unwrap();
        bin
    }

    fn idx(code: u8, lens: &[i32], ptrs: &[i64], docs: &[i64]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&1u64.to_le_bytes());
        out.push(code);
        out.extend_from_slice(&(lens.len() as u64).to_le_bytes());
        out.extend_from_slice(&(docs.len() as u64).to_le_bytes());
        out.extend(le_bytes(lens, i32::to_le_bytes));
        out.extend(le_bytes(ptrs, i64::to_le_bytes));
        out.extend(le_bytes(docs, i64::to_le_bytes));
        out
    }

    fn u16s(first: u16, n: u16) -> Vec<u8> {
        le_bytes(
            &(0..n).map(|k| first + k * 3).collect::<Vec<_>>(),
            u16::to_le_bytes,
        )
    }

    #[test]
    fn uint16_sequences_are_ragged_rows() {
        let dir = temp_dir("megatron-u16");
        let docs = vec![
            vec![u16s(0, 5), u16s(100, 2)],
            vec![u16s(200, 7)],
            vec![u16s(300, 0), u16s(400, 4)],
        ];
        let bin = write(&dir, "corpus_text_document", 8, 2, &docs);
        let m = index_dir(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(m.shards.len(), 1);
        let s = &m.shards[0];
        assert_eq!(
            (s.file.as_str(), s.offset, s.length),
            ("corpus_text_document.bin", 0, 36)
        );
        let t = &s.tensors[0];
        assert_eq!(
            (t.name.as_str(), t.dtype, t.ragged),
            ("tokens", DType::Uint16, true)
        );
        assert_eq!(t.shape, [18]);
        assert_eq!(
            t.rows.as_deref().unwrap(),
            [[0, 10], [10, 4], [14, 14], [28, 0], [28, 8]]
        );
        check_manifest(&dir, &m, &[("tokens", bin)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn upper_case_extensions_pair_by_stem() {
        // Before, `D.IDX` looked for `D.bin`: noted unused, and `D.BIN` indexed as raw bytes.
        let dir = temp_dir("megatron-case");
        write(&dir, "d", 8, 2, &[vec![u16s(0, 5)], vec![u16s(9, 2)]]);
        std::fs::rename(dir.join("d.bin"), dir.join("D.BIN")).unwrap();
        std::fs::rename(dir.join("d.idx"), dir.join("D.IDX")).unwrap();
        let r = index_report(&dir, &IndexOptions::default()).unwrap();
        assert!(r.unused.is_empty(), "{:?}", r.unused);
        let t = &r.manifest.shards[0].tensors[0];
        assert_eq!((t.name.as_str(), t.ragged), ("tokens", true));
        assert_eq!(t.rows.as_deref().unwrap(), [[0, 10], [10, 4]]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_idx_of_one_bin_is_named_unused() {
        // Before, `d.IDX` and `d.idx` both paired with `d.bin`: the later won, and the other
        // was neither used nor named.
        let dir = temp_dir("megatron-two-idx");
        write(&dir, "d", 8, 2, &[vec![u16s(0, 5)], vec![u16s(9, 2)]]);
        std::fs::copy(dir.join("d.idx"), dir.join("d.IDX")).unwrap();
        let r = index_report(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(r.unused.len(), 1, "{:?}", r.unused);
        assert_eq!(r.unused[0].file, "d.IDX");
        assert!(
            r.unused[0]
                .reason
                .contains("second Megatron index of d.bin")
                && r.unused[0].reason.contains("d.idx is the one used"),
            "{}",
            r.unused[0].reason
        );
        let t = &r.manifest.shards[0].tensors[0];
        assert_eq!(t.rows.as_deref().unwrap(), [[0, 10], [10, 4]]);
        // Three: each of the others names the one really used (before, a note could name one
        // that a later index then displaced).
        std::fs::copy(dir.join("d.idx"), dir.join("d.Idx")).unwrap();
        let r = index_report(&dir, &IndexOptions::default()).unwrap();
        let mut notes: Vec<(&str, bool)> = r
            .unused
            .iter()
            .map(|u| (u.file.as_str(), u.reason.contains("d.idx is the one used")))
            .collect();
        notes.sort_unstable();
        assert_eq!(notes, [("d.IDX", true), ("d.Idx", true)]);
        std::fs::remove_file(dir.join("d.Idx")).unwrap();
        // Without one of the .bin's case, the first by name is used.
        std::fs::rename(dir.join("d.idx"), dir.join("d.Idx")).unwrap();
        let r = index_report(&dir, &IndexOptions::default()).unwrap();
        let unused: Vec<&str> = r.unused.iter().map(|u| u.file.as_str()).collect();
        assert_eq!(unused, ["d.Idx"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn int32_cut_into_shards_of_whole_sequences() {
        let dir = temp_dir("megatron-i32");
        let seq = |v: i32, n: usize| le_bytes(&vec![v; n], i32::to_le_bytes);
        // 40-byte cap: 3+4 tokens (28 bytes) fit; 20 tokens (80 bytes) alone; then 2+2 (7 more would pass 40).
        let docs = vec![
            vec![seq(1, 3), seq(2, 4)],
            vec![seq(3, 20)],
            vec![seq(4, 2), seq(5, 2), seq(6, 7)],
        ];
        let bin = write(&dir, "d", 4, 4, &docs);
        let mut src = Source::open(&dir.join("d.bin"), "d.bin").unwrap();
        let idx = (dir.join("d.idx"), "d.idx".to_owned());
        let root = Root::Local(dir.clone());
        let budget = Budget::new(budget::LIMIT);
        let check = FileCheck::new(&budget, &dir, RowKind::Megatron);
        let mut shards = index_with_cap(&root, &mut src, &idx, &check, 40).unwrap();
        src.checksum(&mut shards).unwrap();
        let spans: Vec<(u64, u64, usize)> = shards
            .iter()
            .map(|s| {
                (
                    s.offset,
                    s.length,
                    s.tensors[0].rows.as_ref().unwrap().len(),
                )
            })
            .collect();
        assert_eq!(spans, [(0, 28, 2), (28, 80, 1), (108, 16, 2), (124, 28, 1)]);
        assert_eq!(
            shards[2].tensors[0].rows.as_deref().unwrap(),
            [[0, 8], [8, 8]]
        );
        assert!(shards.iter().all(|s| s.tensors[0].dtype == DType::Int32));
        let m = shardwire_protocol::manifest::Manifest::new(shards);
        check_manifest(&dir, &m, &[("tokens", bin)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_sequences_after_a_full_shard_stay_with_it() {
        let dir = temp_dir("megatron-empty-tail");
        let seq = |v: i32, n: usize| le_bytes(&vec![v; n], i32::to_le_bytes);
        // 20 tokens (80 bytes) pass the 40-byte cap alone; the empty ones after it made a
        // shard of 0 bytes (an invalid manifest).
        let docs = vec![vec![seq(1, 20)], vec![seq(2, 0), seq(3, 0)]];
        write(&dir, "d", 4, 4, &docs);
        let mut src = Source::open(&dir.join("d.bin"), "d.bin").unwrap();
        let idx = (dir.join("d.idx"), "d.idx".to_owned());
        let root = Root::Local(dir.clone());
        let budget = Budget::new(budget::LIMIT);
        let check = FileCheck::new(&budget, &dir, RowKind::Megatron);
        let shards = index_with_cap(&root, &mut src, &idx, &check, 40).unwrap();
        assert_eq!(shards.len(), 1);
        assert_eq!(shards[0].length, 80);
        assert_eq!(
            shards[0].tensors[0].rows.as_deref().unwrap(),
            [[0, 80], [80, 0], [80, 0]]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn refused(name: &str, idx_bytes: Vec<u8>, bin: &[u8]) -> String {
        let dir = temp_dir(name);
        std::fs::write(dir.join("x.bin"), bin).unwrap();
        std::fs::write(dir.join("x.idx"), idx_bytes).unwrap();
        let err = index_dir(&dir, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        err
    }

    #[test]
    fn bad_indexes_are_refused_naming_the_value() {
        let bin = u16s(0, 6);
        let good = || idx(8, &[2, 4], &[0, 4], &[0, 1, 2]);
        let mut bad = good();
        bad[0] = b'X';
        let e = refused("megatron-magic", bad, &bin);
        assert!(
            e.contains("x.idx") && e.contains("magic") && e.contains("XMIDIDX"),
            "{e}"
        );
        let mut bad = good();
        bad[9] = 2;
        let e = refused("megatron-version", bad, &bin);
        assert!(
            e.contains("x.idx") && e.contains("version") && e.contains("found: 2"),
            "{e}"
        );
        let mut bad = good();
        bad[17] = 9;
        let e = refused("megatron-dtype", bad, &bin);
        assert!(e.contains("dtype code") && e.contains("found: 9"), "{e}");
        let e = refused("megatron-ptr", idx(8, &[2, 4], &[0, 6], &[0, 2]), &bin);
        assert!(
            e.contains("sequence 1") && e.contains("pointer 6, expected 4"),
            "{e}"
        );
        let e = refused("megatron-neg", idx(8, &[2, -1], &[0, 4], &[0, 2]), &bin);
        assert!(
            e.contains("negative length") && e.contains("found: -1"),
            "{e}"
        );
        let e = refused("megatron-binlen", good(), &bin[..10]);
        assert!(
            e.contains("x.bin") && e.contains("12 bytes") && e.contains("has 10"),
            "{e}"
        );
        let e = refused("megatron-docs", idx(8, &[2, 4], &[0, 4], &[0, 2, 1]), &bin);
        assert!(
            e.contains("document index 2") && e.contains("found: 1"),
            "{e}"
        );
        let e = refused("megatron-lastdoc", idx(8, &[2, 4], &[0, 4], &[0, 1]), &bin);
        assert!(
            e.contains("last document index") && e.contains("found: 1"),
            "{e}"
        );
        let mut bad = good();
        bad.truncate(bad.len() - 1);
        let e = refused("megatron-short", bad, &bin);
        assert!(
            e.contains("more than the file's") && e.contains("document_count 3"),
            "{e}"
        );
        let mut bad = good();
        bad[18..26].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = refused("megatron-huge", bad, &bin);
        assert!(e.contains("too many"), "{e}");
        // Before, bytes after the document indices were ignored: a multimodal dataset's
        // sequence modes dropped without a word.
        let mut modes = good();
        modes.extend_from_slice(&[0, 1]);
        let e = refused("megatron-multimodal", modes, &bin);
        assert!(
            e.contains("x.idx")
                && e.contains("multimodal")
                && e.contains("2 bytes of sequence modes"),
            "{e}"
        );
        let mut trailing = good();
        trailing.extend_from_slice(&[0; 5]);
        let e = refused("megatron-trailing", trailing, &bin);
        assert!(e.contains("(5 after them)"), "{e}");
    }

    #[test]
    fn too_many_sequences_are_refused_from_the_idx_header_before_its_arrays_are_read() {
        // Before, the whole .idx was read (12 bytes a sequence, 8 a document) and a row built
        // per sequence, and only then counted: here its arrays are garbage (negative
        // lengths), which only reading them finds.
        let dir = temp_dir("megatron-budget");
        let s = 3000u64;
        let mut bytes = idx(8, &[], &[], &[]);
        bytes[18..26].copy_from_slice(&s.to_le_bytes());
        bytes[26..34].copy_from_slice(&(s + 1).to_le_bytes());
        bytes.resize((HEADER + 12 * s + 8 * (s + 1)) as usize, 0xff);
        std::fs::write(dir.join("d.idx"), bytes).unwrap();
        std::fs::write(dir.join("d.bin"), [1u8; 64]).unwrap();
        let mut root = Root::Local(dir.clone());
        let e = crate::index_root_within(&mut root, &IndexOptions::default(), 10_000);
        let e = e.unwrap_err();
        let crate::IndexError::ManifestTooLarge { rows, at, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*rows, 3000, "{e}");
        for want in [
            "d.bin",
            "3000 sequences",
            "d.idx",
            "before the index was read",
        ] {
            assert!(at.contains(want), "{want}: {e}");
        }
        assert!(
            e.to_string().contains("each Megatron sequence is a row"),
            "{e}"
        );
        // Under the real limit the arrays are read, and refused.
        let e = index_dir(&dir, &IndexOptions::default()).unwrap_err();
        assert!(e.to_string().contains("negative length"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bin_without_its_idx_beside_pairs_is_refused_naming_the_missing_idx() {
        // Before, `c1_text_document.bin` (its .idx lost) was served without a word as one
        // dense uint8 tensor of its bytes, beside the `tokens` of c0.
        let dir = temp_dir("megatron-orphan");
        write(
            &dir,
            "c0_text_document",
            8,
            2,
            &[vec![u16s(0, 5)], vec![u16s(9, 2)]],
        );
        let orphan = u16s(50, 4);
        std::fs::write(dir.join("c1_text_document.bin"), &orphan).unwrap();
        let e = index_report(&dir, &IndexOptions::default()).unwrap_err();
        assert!(
            matches!(&e, IndexError::UnpairedMegatronBin { bins, pairs: 1, .. }
                if bins == &["c1_text_document.bin"]),
            "{e:?}"
        );
        let text = e.to_string();
        for want in [
            "c1_text_document.bin has no Megatron index c1_text_document.idx",
            "1 other .bin file has one",
            "raw uint8",
            "--tokens",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        // Read as raw tokens when asked: c0 stays Megatron sequences, c1 one document.
        let tokens = crate::RawTokens::new(DType::Uint16, None).unwrap();
        let opts = IndexOptions {
            tokens: Some(tokens),
            ..IndexOptions::default()
        };
        let r = index_report(&dir, &opts).unwrap();
        let files: Vec<(&str, &str)> = r
            .manifest
            .shards
            .iter()
            .map(|s| (s.file.as_str(), s.tensors[0].name.as_str()))
            .collect();
        assert_eq!(
            files,
            [
                ("c0_text_document.bin", "tokens"),
                ("c1_text_document.bin", "tokens")
            ]
        );
        // Two of them: both named, with their missing indexes.
        std::fs::write(dir.join("c2.BIN"), [1u8]).unwrap();
        let text = index_report(&dir, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("2 .bin files have no Megatron index beside them")
                && text.contains("c1_text_document.bin: no c1_text_document.idx")
                && text.contains("c2.BIN: no c2.IDX"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn megatron_core_caches_from_data_cache_path_are_not_data_nor_splits() {
        // `--data-cache-path /d/cache --split 969,30,1`: megatron-core writes its index
        // cache straight into /d/cache. Before, its arrays were data: the folder was refused
        // as the three splits train, valid and test.
        let dir = temp_dir("megatron-cache-path");
        let bin = write(&dir, "corpus_text_document", 8, 2, &[vec![u16s(0, 5)]]);
        std::fs::create_dir_all(dir.join("cache")).unwrap();
        let md5 = "00112233445566778899aabbccddeeff";
        let mut cached = Vec::new();
        for split in ["train", "valid", "test"] {
            for end in [
                "document_index.npy",
                "sample_index.npy",
                "shuffle_index.npy",
                "description.txt",
            ] {
                cached.push(format!("cache/{md5}-GPTDataset-{split}-{end}"));
            }
        }
        for f in &cached {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        let r = index_report(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(r.manifest.shards.len(), 1);
        check_manifest(&dir, &r.manifest, &[("tokens", bin)]);
        let mut unused: Vec<&str> = r.unused.iter().map(|u| u.file.as_str()).collect();
        unused.sort_unstable();
        cached.sort_unstable();
        assert_eq!(unused, cached);
        assert!(
            r.unused
                .iter()
                .all(|u| u.reason == crate::walk::MEGATRON_CACHE),
            "{:?}",
            r.unused
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn idx_alone_is_unused_and_bin_alone_stays_raw() {
        let dir = temp_dir("megatron-alone");
        std::fs::write(dir.join("lonely.idx"), idx(8, &[1], &[0], &[0, 1])).unwrap();
        std::fs::write(dir.join("raw.bin"), [1u8, 2, 3]).unwrap();
        let r = index_report(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(r.unused.len(), 1);
        assert_eq!(r.unused[0].file, "lonely.idx");
        assert!(
            r.unused[0].reason.contains("lonely.bin"),
            "{}",
            r.unused[0].reason
        );
        let t = &r.manifest.shards[0].tensors[0];
        assert_eq!(
            (t.name.as_str(), t.dtype, t.ragged),
            ("raw", DType::Uint8, false)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
