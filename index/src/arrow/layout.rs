//! Maps an Arrow schema to tensor layouts ([`plan_schema`]) and one record batch's field
//! nodes and buffers to tensor byte ranges ([`batch_tensors`]).
//!
//! Supported columns: fixed-width integers and floats, `FixedSizeList` of them (any depth),
//! and the canonical `arrow.fixed_shape_tensor` extension over such storage. In the IPC
//! body a primitive column is one field node and two buffers (validity, values); each
//! `FixedSizeList` level adds one field node and one buffer (validity) before its child.

use std::collections::HashSet;

use arrow_schema::{DataType, Field, Schema};
use shardwire_protocol::manifest::{DType, MAX_DIMS, MAX_TENSORS_PER_SHARD, TensorEntry};

/// Extension name key in field metadata.
const EXT_NAME: &str = "ARROW:extension:name";
/// Extension metadata key in field metadata.
const EXT_META: &str = "ARROW:extension:metadata";
/// The canonical fixed-shape tensor extension.
const FIXED_SHAPE_TENSOR: &str = "arrow.fixed_shape_tensor";

/// How one column becomes a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ColumnPlan {
    /// Column name (tensor name).
    pub name: String,
    /// Element type of the leaf values.
    pub dtype: DType,
    /// `FixedSizeList` sizes, outermost first (the storage nesting).
    pub levels: Vec<u64>,
    /// Per-row tensor shape (after `fixed_shape_tensor` reshaping); product equals the
    /// product of `levels`.
    pub dims: Vec<u64>,
}

/// A column-level problem: (column, reason, offending value).
pub(crate) type ColumnErr = (String, String, String);

/// Plans every column of `schema`, or names the first column that cannot be a tensor.
pub(crate) fn plan_schema(schema: &Schema) -> Result<Vec<ColumnPlan>, ColumnErr> {
    let n = schema.fields().len();
    if n == 0 {
        return Err((
            String::new(),
            "the schema has no columns".into(),
            "0 columns".into(),
        ));
    }
    if n > MAX_TENSORS_PER_SHARD {
        let first = schema.field(MAX_TENSORS_PER_SHARD).name().clone();
        return Err((
            first,
            format!("at most {MAX_TENSORS_PER_SHARD} columns are supported"),
            format!("{n} columns"),
        ));
    }
    let mut seen = HashSet::new();
    let mut plans = Vec::with_capacity(n);
    for field in schema.fields() {
        let name = field.name().clone();
        if !seen.insert(name.clone()) {
            return Err((
                name,
                "duplicate column name; tensor names must be unique".into(),
                "a second column".into(),
            ));
        }
        let plan = plan_field(field).map_err(|(reason, value)| (name.clone(), reason, value))?;
        if plan.dims.len() + 1 > MAX_DIMS {
            let dims = format!("{} dims", plan.dims.len() + 1);
            return Err((
                name,
                format!("tensors have at most {MAX_DIMS} dimensions"),
                dims,
            ));
        }
        plans.push(plan);
    }
    Ok(plans)
}

/// Why a field is rejected: (reason, offending value).
type Reject = (String, String);

/// The plan of one field (also used for `FixedSizeList` children), or why it is rejected.
fn plan_field(field: &Field) -> Result<ColumnPlan, Reject> {
    let mut plan = match field.data_type() {
        DataType::FixedSizeList(child, k) => {
            let k = u64::try_from(*k)
                .map_err(|_| ("negative FixedSizeList size".to_string(), k.to_string()))?;
            let mut plan = plan_field(child)?;
            plan.levels.insert(0, k);
            plan.dims.insert(0, k);
            plan
        }
        dt => ColumnPlan {
            name: String::new(),
            dtype: primitive(dt)?,
            levels: vec![],
            dims: vec![],
        },
    };
    plan.name = field.name().clone();
    // Other extension types are indexed as their storage type.
    if field.metadata().get(EXT_NAME).map(String::as_str) == Some(FIXED_SHAPE_TENSOR) {
        plan.dims = tensor_shape(field.metadata().get(EXT_META), &plan.levels)?;
    }
    Ok(plan)
}

/// The tensor shape of an `arrow.fixed_shape_tensor` field with storage `levels`.
fn tensor_shape(meta: Option<&String>, levels: &[u64]) -> Result<Vec<u64>, Reject> {
    let raw = meta.map(String::as_str).unwrap_or("");
    let bad = |reason: &str| {
        (
            format!("arrow.fixed_shape_tensor: {reason}"),
            format!("metadata {raw:?}"),
        )
    };
    let json: serde_json::Value =
        serde_json::from_str(raw).map_err(|_| bad("extension metadata is not JSON"))?;
    let ints = |v: &serde_json::Value| -> Option<Vec<u64>> {
        v.as_array()?.iter().map(|d| d.as_u64()).collect()
    };
    let shape = json
        .get("shape")
        .and_then(ints)
        .ok_or_else(|| bad("\"shape\" is missing or not a list of integers"))?;
    match json.get("permutation") {
        None | Some(serde_json::Value::Null) => {}
        Some(p) => {
            let perm = ints(p).ok_or_else(|| bad("\"permutation\" is not a list of integers"))?;
            if !perm.iter().copied().eq(0..shape.len() as u64) {
                return Err(bad(
                    "a non-identity \"permutation\" is not supported; write the tensor in logical (C) order",
                ));
            }
        }
    }
    let [k] = levels else {
        return Err(bad(
            "storage must be a FixedSizeList of a fixed-width integer or float type",
        ));
    };
    let prod = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    if prod != Some(*k) {
        return Err(bad(&format!(
            "the product of \"shape\" does not match the storage list size {k}"
        )));
    }
    Ok(shape)
}

/// The [`DType`] of a fixed-width integer or float type, or why the type is rejected.
fn primitive(dt: &DataType) -> Result<DType, Reject> {
    Ok(match dt {
        DataType::Int8 => DType::Int8,
        DataType::Int16 => DType::Int16,
        DataType::Int32 => DType::Int32,
        DataType::Int64 => DType::Int64,
        DataType::UInt8 => DType::Uint8,
        DataType::UInt16 => DType::Uint16,
        DataType::UInt32 => DType::Uint32,
        DataType::UInt64 => DType::Uint64,
        DataType::Float16 => DType::Float16,
        DataType::Float32 => DType::Float32,
        DataType::Float64 => DType::Float64,
        DataType::Boolean => {
            return Err((
                "boolean columns are bit-packed and not supported; cast to uint8".into(),
                dt.to_string(),
            ));
        }
        DataType::Dictionary(..) => {
            return Err((
                "dictionary-encoded columns are not supported; decode them first".into(),
                dt.to_string(),
            ));
        }
        _ => {
            return Err((
                "type is not supported; columns must be fixed-width integers/floats, FixedSizeList of them, \
                 or arrow.fixed_shape_tensor"
                    .into(),
                dt.to_string(),
            ));
        }
    })
}

/// One record batch's layout, as read from its message.
pub(crate) struct BatchLayout {
    /// Row count.
    pub rows: u64,
    /// Field nodes: (length, null count), depth-first.
    pub nodes: Vec<(i64, i64)>,
    /// Buffers: (offset, length) within the body, depth-first.
    pub buffers: Vec<(i64, i64)>,
}

/// Where a batch problem lies: `Some(column)` or `None` for the batch as a whole; plus
/// (reason, value).
pub(crate) type BatchErr = (Option<String>, String, String);

/// The tensors of one record batch whose body starts at file offset `body_start` and is
/// `body_len` bytes long.
pub(crate) fn batch_tensors(
    plans: &[ColumnPlan],
    b: &BatchLayout,
    body_start: u64,
    body_len: u64,
) -> Result<Vec<TensorEntry>, BatchErr> {
    let mut nodes = b.nodes.iter().copied();
    let mut buffers = b.buffers.iter().copied();
    let short = |what: &str| {
        (
            None,
            format!("the record batch has fewer {what} than its schema needs"),
            format!(
                "{} {what}",
                if what == "field nodes" {
                    b.nodes.len()
                } else {
                    b.buffers.len()
                }
            ),
        )
    };
    let mut out = Vec::with_capacity(plans.len());
    for p in plans {
        let col = |reason: String, value: String| (Some(p.name.clone()), reason, value);
        let mut expect = b.rows;
        let depth = p.levels.len() + 1;
        let mut levels = p.levels.iter();
        for level in 0..depth {
            let (len, nulls) = nodes.next().ok_or_else(|| short("field nodes"))?;
            if nulls != 0 {
                let where_ = if level == 0 {
                    "column"
                } else {
                    "column's FixedSizeList values"
                };
                return Err(col(
                    format!("{where_} has {nulls} nulls; shardwire tensors cannot carry nulls"),
                    format!("null_count {nulls}"),
                ));
            }
            if u64::try_from(len).ok() != Some(expect) {
                let reason = if level == 0 {
                    format!(
                        "field node length differs from the batch row count {}",
                        b.rows
                    )
                } else {
                    format!(
                        "FixedSizeList child has a length other than {expect} (rows x list size); sliced arrays \
                         with a non-zero child offset are not supported"
                    )
                };
                return Err(col(reason, format!("length {len}")));
            }
            buffers.next().ok_or_else(|| short("buffers"))?; // validity bitmap (no nulls: unused)
            if let Some(&k) = levels.next() {
                expect = expect.checked_mul(k).ok_or_else(|| {
                    col("element count overflows".into(), format!("{expect} x {k}"))
                })?;
            }
        }
        let (off, len) = buffers.next().ok_or_else(|| short("buffers"))?;
        let need = expect.checked_mul(p.dtype.size());
        let range = format!("buffer {off}+{len} in a body of {body_len} bytes");
        let (Ok(off), Ok(len), Some(need)) = (u64::try_from(off), u64::try_from(len), need) else {
            return Err(col("invalid values buffer".into(), range));
        };
        if len < need {
            return Err(col(
                format!(
                    "values buffer is shorter than {expect} x {} bytes",
                    p.dtype.size()
                ),
                range,
            ));
        }
        if off.checked_add(need).is_none_or(|end| end > body_len) {
            return Err(col(
                "values buffer lies outside the record batch body".into(),
                range,
            ));
        }
        let mut shape = Vec::with_capacity(p.dims.len() + 1);
        shape.push(b.rows);
        shape.extend(&p.dims);
        out.push(TensorEntry::dense(
            p.name.clone(),
            p.dtype,
            shape,
            body_start + off,
            need,
        ));
    }
    if nodes.next().is_some() || buffers.next().is_some() {
        return Err((
            None,
            "the record batch has more field nodes or buffers than its schema needs".into(),
            format!("{} nodes, {} buffers", b.nodes.len(), b.buffers.len()),
        ));
    }
    Ok(out)
}
