//! The tensors of one record batch: walks its field nodes and buffers in schema order,
//! taking fixed-width columns here and list/string columns in [`super::lists`].

use shardwire_protocol::manifest::TensorEntry;

use super::body::{BatchErr, BatchFail, BatchLayout, CheckTensor, ReadBody, Step, Walk, no_nulls};
use super::layout::{ColumnPlan, Slot};
use super::lists::list_tensor;

/// [`batch_tensors_within`] with no check of the tensors.
#[cfg(test)]
pub(crate) fn batch_tensors(
    slots: &[Slot],
    b: &BatchLayout,
    body_start: u64,
    body_len: u64,
    read: &mut ReadBody<'_>,
) -> Result<Vec<TensorEntry>, BatchFail> {
    batch_tensors_within(slots, b, body_start, body_len, read, &mut |_| Ok(()))
}

/// The tensors of one record batch whose body starts at file offset `body_start` and is
/// `body_len` bytes long; `read` reads offsets buffers of list and string columns; `check`
/// sees each ragged column's row count before its row table is built and each tensor once
/// built, and its error ends the walk.
pub(crate) fn batch_tensors_within(
    slots: &[Slot],
    b: &BatchLayout,
    body_start: u64,
    body_len: u64,
    read: &mut ReadBody<'_>,
    check: &mut CheckTensor<'_>,
) -> Result<Vec<TensorEntry>, BatchFail> {
    let mut w = Walk::new(b, body_len);
    let mut out = Vec::with_capacity(slots.len());
    for slot in slots {
        let t = match slot {
            Slot::Skip(counts) => {
                w.skip(counts)?;
                continue;
            }
            Slot::Column(p) if p.lists.is_empty() => fixed_tensor(p, &mut w, b.rows, body_start)?,
            Slot::Column(p) => list_tensor(p, &mut w, b.rows, body_start, read, check)?,
        };
        check(Step::Built(&t)).map_err(BatchFail::Read)?;
        out.push(t);
    }
    if !w.at_end() {
        return Err(BatchFail::Layout((
            None,
            "the record batch has more field nodes, buffers or variadic buffer counts than its \
             schema needs"
                .into(),
            format!(
                "{} nodes, {} buffers, {} variadic buffer counts",
                b.nodes.len(),
                b.buffers.len(),
                b.variadic.len()
            ),
        )));
    }
    Ok(out)
}

/// The dense tensor of a primitive / `FixedSizeList` column.
fn fixed_tensor(
    p: &ColumnPlan,
    w: &mut Walk<'_>,
    rows: u64,
    body_start: u64,
) -> Result<TensorEntry, BatchErr> {
    let col = |reason: String, value: String| (Some(p.name.clone()), reason, value);
    let mut expect = rows;
    let mut levels = p.levels.iter();
    for level in 0..=p.levels.len() {
        let (len, nulls) = w.node()?;
        let where_ = if level == 0 {
            "column"
        } else {
            "column's FixedSizeList values"
        };
        no_nulls(&p.name, nulls, where_)?;
        if u64::try_from(len).ok() != Some(expect) {
            let reason = if level == 0 {
                format!("field node length differs from the batch row count {rows}")
            } else {
                format!(
                    "FixedSizeList child has a length other than {expect} (rows x list size); sliced arrays \
                     with a non-zero child offset are not supported"
                )
            };
            return Err(col(reason, format!("length {len}")));
        }
        w.buffer()?; // validity bitmap (no nulls: unused)
        if let Some(&k) = levels.next() {
            expect = expect
                .checked_mul(k)
                .ok_or_else(|| col("element count overflows".into(), format!("{expect} x {k}")))?;
        }
    }
    let need = expect.checked_mul(p.dtype.size());
    let desc = format!("{expect} x {} bytes", p.dtype.size());
    let off = w.data(&p.name, "values buffer", need, &desc)?;
    let mut shape = Vec::with_capacity(p.dims.len() + 1);
    shape.push(rows);
    shape.extend(&p.dims);
    Ok(TensorEntry::dense(
        p.name.clone(),
        p.dtype,
        shape,
        body_start + off,
        need.unwrap_or(0),
    ))
}
