//! MosaicML Streaming MDS datasets: a directory holding `index.json` and the `.mds` shard
//! files it lists (at any depth of the dataset directory). Each `.mds` file is one shard,
//! and every column one tensor with a row table (one row per sample).
//!
//! The layout is Streaming's (`streaming/base/format/mds/writer.py`): a `u32` sample count
//! `n`, `n + 1` `u32` sample offsets from the file start, the writer's JSON config, then the
//! samples; each sample is a `u32` size per variable-size column (`column_sizes` entry
//! `null`), then every column's bytes in column order. Fixed numeric encodings (`int8` ..
//! `float64`, `int`) become typed `[rows]` tensors, `ndarray:DTYPE:SHAPE` a typed
//! `[rows, *SHAPE]` tensor; every other column (`bytes`, `str`, `jpeg`, `pkl`, `json`,
//! `ndarray` without a fixed dtype and shape, ...) a ragged `uint8` tensor of the stored
//! bytes. Compressed shards are refused: they cannot be fetched by byte range.
//!
//! An `index.json` of LitData's `optimize()` (an object with `chunks` and `config`) is
//! refused: its `chunk-*.bin` files are item headers and serialized items, which would
//! otherwise be indexed as raw `.bin` data (or, with `--tokens`, read as tokens).

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use shardwire_protocol::manifest::{DType, MAX_TENSORS_PER_SHARD, ShardEntry, TensorEntry};

use crate::budget::{self, FileCheck, Floor};
use crate::error::IndexError;
use crate::root::Root;
use crate::source::Source;
use crate::walk::{Candidate, Kind, MDS_INDEX_FILE as INDEX_FILE, Unused};

/// One column: name, encoding, fixed size (`None`: variable).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Column {
    name: String,
    encoding: String,
    size: Option<u64>,
}

/// What an `index.json` says about one `.mds` file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ShardPlan {
    /// The listing `index.json`, relative to the dataset directory.
    index: String,
    columns: Vec<Column>,
    samples: u64,
    bytes: u64,
}

impl ShardPlan {
    /// Whether two indexes say the same of one `.mds` file (Streaming's `merge_index`
    /// writes a top `index.json` listing `0/shard.00000.mds` beside `0/index.json` listing
    /// `shard.00000.mds`: both are indexes of the same shard).
    fn agrees(&self, other: &ShardPlan) -> bool {
        (&self.columns, self.samples, self.bytes) == (&other.columns, other.samples, other.bytes)
    }
}

/// The `.mds` files listed by the dataset's `index.json` files, by relative path.
pub(crate) type Plan = HashMap<String, ShardPlan>;

/// Reads every `index.json` among `files` (taking them out: they are used, not shards),
/// and moves the `.mds` files no index lists to `unused`, with the reason. An
/// `index.json` that is not a Streaming index is reported unused.
pub(crate) fn plan(
    root: &Root,
    files: &mut Vec<Candidate>,
    unused: &mut Vec<Unused>,
) -> Result<Plan, IndexError> {
    let dir = root.path();
    let dir = dir.as_path();
    let mut plan = Plan::new();
    let mut index_dirs = Vec::new();
    for f in files.iter().filter(|f| f.kind == Kind::MdsIndex) {
        let Some(shards) = index_shards(root, f, files, unused)? else {
            continue;
        };
        let base = parent(&f.rel);
        index_dirs.push(base.to_owned());
        for (rel, shard) in read_index(dir, &f.path, &f.rel, base, shards)? {
            match plan.get(&rel) {
                Some(old) if !old.agrees(&shard) => {
                    return Err(IndexError::Malformed {
                        file: dir.join(&rel),
                        reason: format!(
                            "listed differently by {} and {}; the indexes must agree",
                            old.index, shard.index
                        ),
                        value: format!("{old:?} vs {shard:?}"),
                    });
                }
                Some(_) => {}
                None => {
                    plan.insert(rel, shard);
                }
            }
        }
    }
    files.retain(|f| match f.kind {
        Kind::MdsIndex => false,
        Kind::Mds if !plan.contains_key(&f.rel) => {
            let base = parent(&f.rel);
            let reason = if index_dirs.iter().any(|d| d == base) {
                format!("MDS shard not listed in {}", join(base, INDEX_FILE))
            } else {
                "MDS shard with no index.json next to it".to_owned()
            };
            unused.push(Unused {
                file: f.rel.clone(),
                reason,
            });
            false
        }
        _ => true,
    });
    check_listed_found(dir, &plan, files)?;
    Ok(plan)
}

/// The `shards` list of the `index.json` `f`; `None` (and `f` in `unused`, with the reason)
/// when it is not a Streaming index. JSON that does not parse is an error where MDS shards
/// lie next to it (their index, cut short), else merely unused.
fn index_shards(
    root: &Root,
    f: &Candidate,
    files: &[Candidate],
    unused: &mut Vec<Unused>,
) -> Result<Option<Vec<Value>>, IndexError> {
    let mut src = root.open(&f.rel)?;
    let text = src.read_at("index.json", 0, src.len)?;
    let reason = match streaming_shards(&text) {
        Ok(Some(shards)) => return Ok(Some(shards)),
        Ok(None) => {
            if let Some(e) = refuse_litdata(&text, f) {
                return Err(e);
            }
            "not a MosaicML Streaming index (no `shards` list)".to_owned()
        }
        Err(e) => {
            let base = parent(&f.rel);
            let beside = |c: &Candidate| c.kind == Kind::Mds && parent(&c.rel) == base;
            if files.iter().any(beside) {
                return Err(IndexError::Malformed {
                    file: f.path.clone(),
                    reason: "is not valid JSON, and MDS shards lie next to it (a truncated \
                             upload?): write it again (MDSWriter, or \
                             streaming.base.util.merge_index)"
                        .into(),
                    value: e.to_string(),
                });
            }
            format!("not valid JSON ({e})")
        }
    };
    unused.push(Unused {
        file: f.rel.clone(),
        reason,
    });
    Ok(None)
}

/// Refuses a plan whose indexes list a shard that is not among the `.mds` files found (a
/// missing file, one under a hidden directory, one not named `.mds`): its samples would be
/// left out of the dataset without a word.
fn check_listed_found(dir: &Path, plan: &Plan, files: &[Candidate]) -> Result<(), IndexError> {
    let found: std::collections::HashSet<&str> = files
        .iter()
        .filter(|f| f.kind == Kind::Mds)
        .map(|f| f.rel.as_str())
        .collect();
    let mut missing: Vec<(&String, &ShardPlan)> = plan
        .iter()
        .filter(|(rel, _)| !found.contains(rel.as_str()))
        .collect();
    missing.sort_by(|a, b| a.0.cmp(b.0));
    let Some((rel, shard)) = missing.first() else {
        return Ok(());
    };
    Err(IndexError::Malformed {
        file: dir.join(&shard.index),
        reason: format!(
            "lists {} shard(s) that are not .mds files under the dataset directory (missing, \
             hidden, or named otherwise), the first {rel}: restore them or rewrite the index",
            missing.len()
        ),
        value: missing
            .iter()
            .take(8)
            .map(|m| m.0.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The `shards` list of a Streaming index, `None` when `text` is JSON but not one, or the
/// parse error when it is not JSON.
fn streaming_shards(text: &[u8]) -> Result<Option<Vec<Value>>, serde_json::Error> {
    let v: Value = serde_json::from_slice(text)?;
    let shards = v.as_object().and_then(|obj| {
        obj.get("version")?;
        obj.get("shards")?.as_array().cloned()
    });
    Ok(shards)
}

/// The error for a LitData `optimize()` index (`index.json`, an object with `chunks` and
/// `config`), `None` for other JSON. Its `chunk-*.bin` files hold a `u32` item count `n`,
/// `n + 1` `u32` offsets, then the serialized items: never raw data or tokens, so the
/// folder is refused rather than its chunks indexed as `.bin` files.
fn refuse_litdata(text: &[u8], f: &Candidate) -> Option<IndexError> {
    let v: Value = serde_json::from_slice(text).ok()?;
    let obj = v.as_object()?;
    if !(obj.contains_key("chunks") && obj.contains_key("config")) {
        return None;
    }
    let chunks = obj.get("chunks").and_then(Value::as_array);
    let names: Vec<&str> = chunks
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("filename")?.as_str())
        .collect();
    let mut value = format!("{} chunk file(s)", names.len());
    if !names.is_empty() {
        let more = if names.len() > 3 { ", ..." } else { "" };
        value = format!("{value}: {}{more}", names[..names.len().min(3)].join(", "));
    }
    Some(IndexError::Unsupported {
        file: f.path.clone(),
        reason: "LitData optimize() output is not supported (its chunk files hold item \
                 headers and serialized items, not raw data or tokens): index the data it \
                 was made from"
            .into(),
        value,
    })
}

/// The '/'-separated parent of a relative path (`""` at the top).
pub(crate) fn parent(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(d, _)| d)
}

pub(crate) fn join(base: &str, name: &str) -> String {
    if base.is_empty() {
        name.to_owned()
    } else {
        format!("{base}/{name}")
    }
}

/// The shards of one Streaming index, as (relative path of the `.mds` file, plan).
fn read_index(
    dir: &Path,
    path: &Path,
    rel: &str,
    base: &str,
    shards: Vec<Value>,
) -> Result<Vec<(String, ShardPlan)>, IndexError> {
    let mut out: Vec<(String, ShardPlan)> = Vec::with_capacity(shards.len());
    for (i, s) in shards.iter().enumerate() {
        check_uncompressed_mds(dir, path, rel, base, i, s)?;
        let (basename, plan) = read_shard(path, rel, i, s)?;
        if let Some((_, first)) = out.first()
            && first.columns != plan.columns
        {
            return Err(IndexError::Malformed {
                file: path.to_path_buf(),
                reason: format!("shard {i} has other columns than shard 0; every shard must agree"),
                value: format!("{:?} vs {:?}", plan.columns, first.columns),
            });
        }
        out.push((join(base, basename), plan));
    }
    Ok(out)
}

/// Shard `i` of the index at `path` is an MDS shard stored raw: one that can be fetched by
/// byte range.
fn check_uncompressed_mds(
    dir: &Path,
    path: &Path,
    rel: &str,
    base: &str,
    i: usize,
    s: &Value,
) -> Result<(), IndexError> {
    let field = |k: &str| s.get(k).unwrap_or(&Value::Null);
    if field("format").as_str() != Some("mds") {
        return Err(IndexError::Unsupported {
            file: path.to_path_buf(),
            reason: format!(
                "shard {i} is not in MDS format; only MosaicML Streaming MDS shards can be \
                 served (write with MDSWriter)"
            ),
            value: field("format").to_string(),
        });
    }
    let (raw, zip, compression) = (field("raw_data"), field("zip_data"), field("compression"));
    if !compression.is_null() || (raw.is_null() && !zip.is_null()) {
        let file = [zip, raw]
            .iter()
            .find_map(|d| d.get("basename").and_then(Value::as_str))
            .unwrap_or("?");
        return Err(IndexError::Unsupported {
            file: dir.join(join(base, file)),
            reason: format!(
                "MDS shard is compressed (listed in {rel}); compressed shards cannot be \
                 fetched by byte range: re-write the dataset with \
                 MDSWriter(compression=None)"
            ),
            value: format!("compression {compression}"),
        });
    }
    Ok(())
}

/// Shard `i` of the index at `path`: its file's name relative to the index, and its plan.
fn read_shard<'a>(
    path: &Path,
    rel: &str,
    i: usize,
    s: &'a Value,
) -> Result<(&'a str, ShardPlan), IndexError> {
    let bad = |reason: String, value: String| IndexError::Malformed {
        file: path.to_path_buf(),
        reason,
        value,
    };
    let field = |k: &str| s.get(k).unwrap_or(&Value::Null);
    let what = |k: &str| format!("shard {i}: `{k}`");
    let raw = field("raw_data");
    let basename = raw.get("basename").and_then(Value::as_str);
    let bytes = raw.get("bytes").and_then(Value::as_u64);
    let (Some(basename), Some(bytes)) = (basename, bytes) else {
        return Err(bad(
            format!(
                "{} must have a `basename` string and `bytes` count",
                what("raw_data")
            ),
            raw.to_string(),
        ));
    };
    if basename.is_empty()
        || basename.starts_with('/')
        || basename
            .split('/')
            .any(|c| c == ".." || c == "." || c.is_empty())
    {
        return Err(bad(
            format!(
                "{}: must be a relative path below the index",
                what("basename")
            ),
            basename.to_owned(),
        ));
    }
    let samples = field("samples")
        .as_u64()
        .ok_or_else(|| bad(what("samples"), field("samples").to_string()))?;
    let columns = read_columns(s).map_err(|(k, v)| bad(what(k), v))?;
    check_columns(path, i, &columns)?;
    let plan = ShardPlan {
        index: rel.to_owned(),
        columns,
        samples,
        bytes,
    };
    Ok((basename, plan))
}

/// The columns of one shard entry, or the offending `(key, value)`.
fn read_columns(s: &Value) -> Result<Vec<Column>, (&'static str, String)> {
    let list = |k: &'static str| {
        s.get(k)
            .and_then(Value::as_array)
            .ok_or_else(|| (k, s.get(k).unwrap_or(&Value::Null).to_string()))
    };
    let (names, encs, sizes) = (
        list("column_names")?,
        list("column_encodings")?,
        list("column_sizes")?,
    );
    if names.len() != encs.len() || names.len() != sizes.len() || names.is_empty() {
        let v = format!(
            "{} names, {} encodings, {} sizes",
            names.len(),
            encs.len(),
            sizes.len()
        );
        return Err(("column_names", v));
    }
    let mut out = Vec::with_capacity(names.len());
    for ((n, e), z) in names.iter().zip(encs).zip(sizes) {
        let name = n.as_str().ok_or(("column_names", n.to_string()))?;
        let encoding = e.as_str().ok_or(("column_encodings", e.to_string()))?;
        let size = match z {
            Value::Null => None,
            z => Some(z.as_u64().ok_or(("column_sizes", z.to_string()))?),
        };
        out.push(Column {
            name: name.to_owned(),
            encoding: encoding.to_owned(),
            size,
        });
    }
    Ok(out)
}

/// Refuses the columns of shard `i` of the index at `path` when there are more than a shard's
/// [`MAX_TENSORS_PER_SHARD`] tensors. A column of 0 bytes a sample (`column_sizes` 0, as
/// Streaming writes for `ndarray:uint8:0`) is served, as an empty ragged tensor: its rows
/// hold nothing, but they are counted from the file's sample count before they are built
/// ([`check_rows`]), so a small file claiming millions of them is refused there.
fn check_columns(path: &Path, i: usize, columns: &[Column]) -> Result<(), IndexError> {
    let refuse = |reason: String, value: String| IndexError::Unsupported {
        file: path.to_path_buf(),
        reason: format!("shard {i}: {reason}"),
        value,
    };
    if columns.len() > MAX_TENSORS_PER_SHARD {
        return Err(refuse(
            format!(
                "has more columns than the {MAX_TENSORS_PER_SHARD} tensors a shard can hold; \
                 write the dataset with fewer columns (pack several into one)"
            ),
            format!("{} columns", columns.len()),
        ));
    }
    Ok(())
}

/// The numeric dtype of a Streaming dtype name.
fn dtype(name: &str) -> Option<DType> {
    match name {
        "int" => Some(DType::Int64), // MDS stores `int` as int64
        n => DType::from_name(n),
    }
}

/// The typed form of a fixed-size column: dtype and row shape, or `None` (ragged bytes).
fn typed(c: &Column) -> Option<(DType, Vec<u64>)> {
    let size = c.size?;
    let form = if let Some(rest) = c.encoding.strip_prefix("ndarray:") {
        let (dt, shape) = rest.split_once(':')?;
        let dims: Option<Vec<u64>> = shape.split(',').map(|d| d.trim().parse().ok()).collect();
        (dtype(dt)?, dims?)
    } else {
        (dtype(&c.encoding)?, Vec::new())
    };
    let elems = form.1.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    (elems.checked_mul(form.0.size()) == Some(size) && size > 0).then_some(form)
}

/// Indexes one `.mds` file as listed by its `index.json`: its shard (none when it holds no
/// samples). Its rows (a sample a row, in every column) are counted in `check` from its
/// sample count, before they are read.
pub(crate) fn index(
    src: &mut Source,
    plan: Option<&ShardPlan>,
    check: &FileCheck<'_>,
) -> Result<Vec<ShardEntry>, IndexError> {
    let Some(plan) = plan else {
        return Err(src.malformed("MDS shard listed by no index.json", &src.rel));
    };
    if plan.bytes != src.len {
        return Err(src.malformed(
            format!(
                "{} gives this shard another size than the file has",
                plan.index
            ),
            format!(
                "raw_data.bytes {} but the file has {} bytes",
                plan.bytes, src.len
            ),
        ));
    }
    let head = src.read_at("MDS sample count", 0, 4)?;
    let n = u64::from(u32::from_le_bytes([head[0], head[1], head[2], head[3]]));
    if n != plan.samples {
        return Err(src.malformed(
            format!(
                "the sample count disagrees with `samples` in {}",
                plan.index
            ),
            format!("{n} in the file, {} in the index", plan.samples),
        ));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    check_rows(src, &plan.columns, n, check)?;
    let rows = sample_rows(src, &plan.columns, n)?;
    let tensors = plan
        .columns
        .iter()
        .zip(rows)
        .map(|(c, rows)| tensor(c, rows))
        .collect();
    let len = src.len;
    Ok(vec![src.shard(0, len, tensors)?])
}

/// Refuses an MDS file whose `n` samples in `cols` would take the manifest past its budget,
/// before their rows are read and built: each is a row of every column, ending after the
/// file's offset table.
fn check_rows(
    src: &Source,
    cols: &[Column],
    n: u64,
    check: &FileCheck<'_>,
) -> Result<(), IndexError> {
    let end = 4 + (n + 1) * 4;
    let floor = cols.iter().fold(Floor::default(), |f, c| {
        f.plus(budget::ragged_floor(&c.name, n, end))
    });
    let at = || {
        format!(
            " (counted up to {}, from its {n} samples of {} columns, before they were read)",
            src.rel,
            cols.len()
        )
    };
    check.check(floor, at)
}

/// Each column's `[offset, size]` per sample of the `n` samples of an MDS file, read from its
/// offset table and per-sample size headers, every range checked against the file.
fn sample_rows(
    src: &mut Source,
    cols: &[Column],
    n: u64,
) -> Result<Vec<Vec<[u64; 2]>>, IndexError> {
    let table_len = (n + 1) * 4;
    let table = src.read_at("MDS sample offsets", 4, table_len)?;
    let offsets: Vec<u64> = table
        .chunks_exact(4)
        .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    let var = cols.iter().filter(|c| c.size.is_none()).count() as u64;
    let mut rows: Vec<Vec<[u64; 2]>> = vec![Vec::with_capacity(n as usize); cols.len()];
    let mut sizes = Vec::with_capacity(cols.len());
    for i in 0..n as usize {
        let (begin, end) = (offsets[i], offsets[i + 1]);
        if begin < 4 + table_len || end < begin || end > src.len {
            return Err(src.malformed(
                format!("sample {i} lies outside the file's sample data"),
                format!("bytes {begin}..{end} of {}", src.len),
            ));
        }
        let sample_len = end - begin;
        if var * 4 > sample_len {
            return Err(src.malformed(
                format!("sample {i} is too short for its column sizes"),
                format!("{sample_len} bytes"),
            ));
        }
        let head = src.read_at("MDS sample column sizes", begin, var * 4)?;
        let mut var_sizes = head
            .chunks_exact(4)
            .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        sizes.clear();
        for c in cols {
            sizes.push(c.size.or_else(|| var_sizes.next()).unwrap_or(0));
        }
        let mut pos = begin + var * 4;
        for (col, &size) in rows.iter_mut().zip(&sizes) {
            col.push([pos, size]);
            // Past the sample's end (or overflowing): the check below names it.
            pos = pos.saturating_add(size);
        }
        if pos != end {
            return Err(src.malformed(
                format!("sample {i}: its columns' sizes do not add up to the sample's bytes"),
                format!(
                    "{} bytes of columns, {sample_len} bytes of sample",
                    sizes.iter().fold(0u64, |a, &b| a.saturating_add(b))
                ),
            ));
        }
    }
    Ok(rows)
}

/// The tensor of one column over its rows.
fn tensor(c: &Column, rows: Vec<[u64; 2]>) -> TensorEntry {
    let length: u64 = rows.iter().map(|r| r[1]).sum();
    let offset = rows.first().map_or(0, |r| r[0]);
    let (dtype, shape, ragged) = match typed(c) {
        Some((dtype, dims)) => {
            let mut shape = vec![rows.len() as u64];
            shape.extend(dims);
            (dtype, shape, false)
        }
        None => (DType::Uint8, vec![length], true),
    };
    TensorEntry {
        name: c.name.clone(),
        dtype,
        shape,
        offset,
        length,
        rows: Some(rows),
        ragged,
    }
}

#[cfg(test)]
mod tests;
