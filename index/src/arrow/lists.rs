//! Variable-length columns: `List`/`LargeList` (any depth) of fixed-width values or
//! `FixedSizeList`s of them, and `Utf8`/`LargeUtf8`/`Binary`/`LargeBinary` (as `uint8`).
//!
//! The offsets buffer of every list level is read from the record batch body (int32, or
//! int64 for the `Large` variants; they need not start at 0, as in sliced arrays), in reads
//! of at most [`OFFSETS_CHUNK`] bytes: an offsets buffer is bounded by the body, which lies
//! inside the file, not by the bound on metadata reads ([`crate::source::MAX_METADATA`],
//! 256 MiB, which refused a batch of 64 Mi strings, or of as many inner list elements).
//! Rules:
//!
//! - One list level (`list<item: int32>`, `string`, `list<item: fixed_size_list<...>>`):
//!   always a *ragged* tensor: dtype the leaf type, shape `[total elements]`, one row per
//!   list, each row's byte range taken from the offsets.
//! - Nested lists (`list<item: list<item: uint8>>`, as HF `datasets` writes `Array2D` and
//!   `Sequence(Sequence(...))`): when every row of the shard has the same inner shape
//!   (every offsets level has one constant step), a *dense* tensor
//!   `[rows, d1, ..., dn, *fixed dims]` over the contiguous values; otherwise ragged over
//!   the outermost list (flat leaf values, one row per outer element). Shards of a dataset
//!   may differ in inner shape only as ragged tensors: when a nested column's shards
//!   disagree (or one is ragged), [`harmonize`] makes every shard of it ragged.

use std::collections::HashSet;

use shardwire_protocol::manifest::{ShardEntry, TensorEntry};

use super::body::{BatchErr, BatchFail, CheckTensor, ReadBody, Step, Walk, no_nulls};
use super::layout::ColumnPlan;
use crate::source::MAX_METADATA;

/// Most bytes of an offsets buffer read at once (a whole number of int64 offsets).
const OFFSETS_CHUNK: u64 = 16 << 20;
const _: () = assert!(OFFSETS_CHUNK.is_multiple_of(8) && OFFSETS_CHUNK <= MAX_METADATA);

/// Offsets of one list level: entries `start..=start + len` of the level's offsets buffer.
struct Level {
    /// Index of the first entry read.
    start: u64,
    /// The entries read.
    offs: Vec<u64>,
}

impl Level {
    /// The offset at element index `i` (inside the range read).
    fn at(&self, i: u64) -> u64 {
        self.offs[(i - self.start) as usize]
    }
}

/// The tensor of a list or string column; `read` reads its offsets, `check` is shown the
/// row count of a ragged tensor before its row table is built (a dense one has none).
pub(crate) fn list_tensor(
    p: &ColumnPlan,
    w: &mut Walk<'_>,
    rows: u64,
    body_start: u64,
    read: &mut ReadBody<'_>,
    check: &mut CheckTensor<'_>,
) -> Result<TensorEntry, BatchFail> {
    let (levels, values_off, hi) = read_levels(p, w, rows, read)?;
    let hi = fixed_part(p, w, hi)?;
    let values_off = match values_off {
        Some(off) => off,
        None => {
            let desc = format!("{hi} x {} bytes", p.dtype.size());
            w.data(
                &p.name,
                "values buffer",
                hi.checked_mul(p.dtype.size()),
                &desc,
            )?
        }
    };
    // Bytes per element of the innermost list (all checked against the values buffer).
    // Checked: a schema of nested fixed-size lists can claim more than 2^64 bytes per
    // element even where the batch holds none.
    let unit = p
        .levels
        .iter()
        .try_fold(p.dtype.size(), |a, &k| a.checked_mul(k))
        .ok_or_else(|| {
            let what = format!("{:?} x {} bytes", p.levels, p.dtype.size());
            let why = "fixed-size list element size overflows".to_string();
            BatchFail::Layout((Some(p.name.clone()), why, what))
        })?;
    if levels.len() >= 2
        && let Some(inner) = uniform(&levels)
    {
        let first = values_off + leaf_index(&levels, 0) * unit;
        let mut shape = vec![rows];
        shape.extend(&inner);
        shape.extend(&p.dims);
        let length = shape.iter().product::<u64>() * p.dtype.size();
        return Ok(TensorEntry::dense(
            p.name.clone(),
            p.dtype,
            shape,
            body_start + first,
            length,
        ));
    }
    check(Step::Rows {
        name: &p.name,
        rows,
    })
    .map_err(BatchFail::Read)?;
    let table: Vec<[u64; 2]> = (0..rows)
        .map(|i| {
            let (a, b) = (leaf_index(&levels, i), leaf_index(&levels, i + 1));
            [values_off + a * unit, (b - a) * unit]
        })
        .collect();
    let length: u64 = table.iter().map(|r| r[1]).sum();
    Ok(TensorEntry {
        name: p.name.clone(),
        dtype: p.dtype,
        shape: vec![length / p.dtype.size()],
        offset: body_start + table.first().map_or(values_off, |r| r[0]),
        length,
        rows: Some(table),
        ragged: true,
    })
}

/// Reads every list level's node and offsets; returns the levels, the values buffer of a
/// string/binary innermost level, and the end `hi` of the element range of the innermost
/// list's child.
fn read_levels(
    p: &ColumnPlan,
    w: &mut Walk<'_>,
    rows: u64,
    read: &mut ReadBody<'_>,
) -> Result<(Vec<Level>, Option<u64>, u64), BatchFail> {
    let col = |reason: String, value: String| (Some(p.name.clone()), reason, value);
    let (mut lo, mut hi) = (0u64, rows);
    let mut levels = Vec::with_capacity(p.lists.len());
    let mut values = None;
    for (k, list) in p.lists.iter().enumerate() {
        let (len, nulls) = w.node()?;
        no_nulls(
            &p.name,
            nulls,
            if k == 0 {
                "column"
            } else {
                "column's list values"
            },
        )?;
        let ok = u64::try_from(len).is_ok_and(|l| if k == 0 { l == rows } else { l >= hi });
        if !ok {
            let reason = match k {
                0 => format!("field node length differs from the batch row count {rows}"),
                _ => format!("list values are fewer than the {hi} its parent's offsets need"),
            };
            return Err(col(reason, format!("length {len}")).into());
        }
        w.buffer()?; // validity bitmap (no nulls: unused)
        let width = if list.large { 8 } else { 4 };
        let need = hi.checked_add(1).and_then(|n| n.checked_mul(width));
        let desc = format!("{} x {width} bytes", hi.saturating_add(1));
        let off = w.data(&p.name, "offsets buffer", need, &desc)?;
        let offs = read_offsets(&p.name, read, off, lo, hi - lo + 1, width)?;
        let start = lo;
        (lo, hi) = (offs[0], offs[offs.len() - 1]);
        levels.push(Level { start, offs });
        if list.bytes {
            let desc = format!("{hi} bytes");
            values = Some(w.data(&p.name, "values buffer", Some(hi), &desc)?);
        }
    }
    Ok((levels, values, hi))
}

/// Checks the `FixedSizeList` levels and leaf node below the lists (none for strings);
/// returns the end of the leaf element range.
fn fixed_part(p: &ColumnPlan, w: &mut Walk<'_>, mut hi: u64) -> Result<u64, BatchErr> {
    if p.lists.last().is_some_and(|l| l.bytes) {
        return Ok(hi);
    }
    let col = |reason: String, value: String| (Some(p.name.clone()), reason, value);
    for level in 0..=p.levels.len() {
        let (len, nulls) = w.node()?;
        no_nulls(&p.name, nulls, "column's list values")?;
        if u64::try_from(len).ok().is_none_or(|l| l < hi) {
            return Err(col(
                format!("list values are fewer than the {hi} the offsets need"),
                format!("length {len}"),
            ));
        }
        w.buffer()?; // validity bitmap
        if let Some(&k) = p.levels.get(level) {
            let over = || col("element count overflows".into(), format!("{hi} x {k}"));
            hi = hi.checked_mul(k).ok_or_else(over)?;
        }
    }
    Ok(hi)
}

/// Reads entries `start..start + count` of the offsets buffer of `width`-byte entries at body
/// offset `off` (inside the body: checked by the caller), in reads of at most
/// [`OFFSETS_CHUNK`] bytes.
fn read_offsets(
    col: &str,
    read: &mut ReadBody<'_>,
    off: u64,
    start: u64,
    count: u64,
    width: u64,
) -> Result<Vec<u64>, BatchFail> {
    read_offsets_in(col, read, off, start, count, width, OFFSETS_CHUNK)
}

/// [`read_offsets`] in reads of at most `chunk` bytes (a multiple of `width`).
fn read_offsets_in(
    col: &str,
    read: &mut ReadBody<'_>,
    off: u64,
    start: u64,
    count: u64,
    width: u64,
    chunk: u64,
) -> Result<Vec<u64>, BatchFail> {
    // Grown per read, by what was read and checked: a record batch's claim of a long
    // buffer reserves nothing before its bytes are there.
    let mut out = Vec::new();
    let first = off + start * width;
    let total = count * width;
    let mut done = 0u64;
    while done < total {
        let len = (total - done).min(chunk);
        let raw = read("offsets buffer", first + done, len).map_err(BatchFail::Read)?;
        out.reserve(raw.len() / width as usize);
        decode(col, &raw, width, start, &mut out)?;
        done += len;
    }
    Ok(out)
}

/// Appends little-endian offsets to `out` (whose first entry is entry `start` of the
/// buffer), which must stay non-negative and non-decreasing.
fn decode(
    col: &str,
    raw: &[u8],
    width: u64,
    start: u64,
    out: &mut Vec<u64>,
) -> Result<(), BatchErr> {
    for c in raw.chunks_exact(width as usize) {
        let v = match c {
            [a, b, c, d] => i64::from(i32::from_le_bytes([*a, *b, *c, *d])),
            _ => i64::from_le_bytes(c.try_into().unwrap_or([0; 8])),
        };
        let bad = u64::try_from(v)
            .ok()
            .filter(|&v| out.last().is_none_or(|&prev| v >= prev));
        let Some(v) = bad else {
            return Err((
                Some(col.to_string()),
                "list offsets are negative or decreasing".into(),
                format!("offset {v} at entry {}", start + out.len() as u64),
            ));
        };
        out.push(v);
    }
    Ok(())
}

/// Element index, in the innermost list's child, where outer row `i` starts.
fn leaf_index(levels: &[Level], i: u64) -> u64 {
    levels.iter().fold(i, |e, l| l.at(e))
}

/// The inner shape `[d1, ..., dn]` when every offsets level has one constant step.
fn uniform(levels: &[Level]) -> Option<Vec<u64>> {
    levels
        .iter()
        .map(|l| {
            let step = l.offs.get(1)? - l.offs[0];
            l.offs
                .windows(2)
                .all(|w| w[1] - w[0] == step)
                .then_some(step)
        })
        .collect()
}

/// Makes every shard's tensor of each nested-list column in `nested` ragged unless all of
/// them are dense with one inner shape, so that a column has one form over the dataset.
pub(crate) fn harmonize(shards: &mut [ShardEntry], nested: &HashSet<String>) {
    for name in nested {
        let mut shapes = shards
            .iter()
            .flat_map(|s| &s.tensors)
            .filter(|t| &t.name == name)
            .map(|t| (t.ragged, t.shape.get(1..).map(<[u64]>::to_vec)));
        let first = shapes.next();
        if first
            .as_ref()
            .is_none_or(|f| !f.0 && shapes.all(|s| &s == f))
        {
            continue;
        }
        for s in shards.iter_mut() {
            let base = s.offset;
            for t in s
                .tensors
                .iter_mut()
                .filter(|t| &t.name == name && !t.ragged)
            {
                to_ragged(t, base);
            }
        }
    }
}

/// Rewrites a dense tensor as a ragged one with equal rows; `base` is the shard's offset.
fn to_ragged(t: &mut TensorEntry, base: u64) {
    let n = t.shape.first().copied().unwrap_or(0);
    if n == 0 || t.rows.is_some() {
        return;
    }
    let row = t.length / n;
    let start = t.offset - base;
    t.rows = Some((0..n).map(|i| [start + i * row, row]).collect());
    t.shape = vec![t.length / t.dtype.size()];
    t.ragged = true;
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::manifest::DType;

    use super::*;
    use crate::IndexError;
    use crate::arrow::batch::batch_tensors;
    use crate::arrow::body::BatchLayout;
    use crate::arrow::layout::{ListLevel, Slot};
    use crate::testutil::le_bytes;

    #[test]
    fn offsets_are_read_in_chunks_and_checked_across_them() {
        let offs = [0i32, 2, 2, 5, 9, 9, 10];
        let mut body = vec![0u8; 4];
        body.extend(le_bytes(&offs, i32::to_le_bytes));
        let mut reads = Vec::new();
        let mut read = |_: &str, off: u64, len: u64| -> Result<Vec<u8>, IndexError> {
            reads.push(len);
            Ok(body[off as usize..(off + len) as usize].to_vec())
        };
        let got = read_offsets_in("c", &mut read, 4, 0, 7, 4, 8).unwrap();
        assert_eq!(got, [0, 2, 2, 5, 9, 9, 10]);
        assert_eq!(reads, [8, 8, 8, 4]);
        // 3 then 2: decreasing where one read ends and the next begins.
        let body = le_bytes(&[0i32, 3, 2, 4], i32::to_le_bytes);
        let mut read = |_: &str, off: u64, len: u64| -> Result<Vec<u8>, IndexError> {
            Ok(body[off as usize..(off + len) as usize].to_vec())
        };
        // The entry is named by its place in the buffer, also when the read starts past
        // entry 0 (before, "at entry 1": counted from the first entry read).
        for (start, count) in [(0, 4), (1, 3)] {
            match read_offsets_in("c", &mut read, 0, start, count, 4, 8) {
                Err(BatchFail::Layout((Some(c), reason, value))) => {
                    assert_eq!(c, "c");
                    assert!(reason.contains("decreasing"), "{reason}");
                    assert_eq!(value, "offset 2 at entry 2", "from entry {start}");
                }
                other => panic!("decreasing offsets accepted: {other:?}"),
            }
        }
        let body = le_bytes(&[0i64, 1, 7], i64::to_le_bytes);
        let mut read = |_: &str, off: u64, len: u64| -> Result<Vec<u8>, IndexError> {
            Ok(body[off as usize..(off + len) as usize].to_vec())
        };
        let got = read_offsets_in("c", &mut read, 0, 0, 3, 8, 8).unwrap();
        assert_eq!(got, [0, 1, 7]);
    }

    #[test]
    fn memory_for_offsets_grows_with_what_was_read() {
        // A batch claims 2^58 int64 offsets; the second read fails. Before, room for all of
        // them (2^61 bytes, more than any address space) was reserved before the first read:
        // the allocation failed, aborting the process.
        let mut reads = 0;
        let mut read = |_: &str, _: u64, len: u64| -> Result<Vec<u8>, IndexError> {
            reads += 1;
            match reads {
                1 => Ok(vec![0; len as usize]),
                _ => Err(IndexError::io(
                    "f.arrow",
                    std::io::ErrorKind::UnexpectedEof.into(),
                )),
            }
        };
        match read_offsets_in("c", &mut read, 0, 0, 1 << 58, 8, 64) {
            Err(BatchFail::Read(IndexError::Io { .. })) => {}
            other => panic!("expected the read error, got {other:?}"),
        }
        assert_eq!(reads, 2);
    }

    #[test]
    fn an_offsets_buffer_longer_than_one_read_is_served() {
        // list<list<uint8>>, one row of n one-byte inner lists: the inner offsets (n + 1
        // int32) take more than one read. Before, they were read at once, through the reader
        // that refuses more than MAX_METADATA (256 MiB): 64 Mi inner elements were refused.
        let n = OFFSETS_CHUNK / 4 + 100;
        let level = ListLevel {
            large: false,
            bytes: false,
        };
        let plan = vec![Slot::Column(ColumnPlan {
            name: "img".into(),
            dtype: DType::Uint8,
            lists: vec![level; 2],
            levels: vec![],
            dims: vec![],
        })];
        // Body: outer offsets at 0, inner offsets at 8, then the n values.
        let inner = 8u64;
        let values = inner + (n + 1) * 4;
        let layout = BatchLayout {
            rows: 1,
            nodes: vec![(1, 0), (n as i64, 0), (n as i64, 0)],
            buffers: vec![
                (0, 0),
                (0, 8),
                (8, 0),
                (inner as i64, ((n + 1) * 4) as i64),
                (values as i64, 0),
                (values as i64, n as i64),
            ],
            variadic: vec![],
            version: arrow_ipc::MetadataVersion::V5,
        };
        let mut reads = 0;
        let mut read = |_: &str, off: u64, len: u64| -> Result<Vec<u8>, IndexError> {
            assert!(len <= OFFSETS_CHUNK, "one read of {len} bytes");
            reads += 1;
            if off == 0 {
                return Ok(le_bytes(&[0i32, n as i32], i32::to_le_bytes));
            }
            let first = (off - inner) / 4;
            let entries = first..first + len / 4;
            Ok(entries.flat_map(|e| (e as i32).to_le_bytes()).collect())
        };
        let t = batch_tensors(&plan, &layout, 1000, values + n, &mut read).unwrap();
        assert_eq!(reads, 3);
        let t = &t[0];
        assert_eq!(
            (t.shape.clone(), t.offset, t.length, t.ragged),
            (vec![1, n, 1], 1000 + values, n, false)
        );
    }
}
