//! Maps an Arrow schema to tensor layouts ([`plan_schema`]); [`super::batch`] then maps one
//! record batch's field nodes and buffers to tensor byte ranges with these plans.
//!
//! Supported columns: fixed-width integers and floats, `FixedSizeList` of them (any depth),
//! the canonical `arrow.fixed_shape_tensor` extension over such storage, and
//! variable-length `List`/`LargeList` (any depth) of those, `Utf8`/`LargeUtf8`/`Binary`/
//! `LargeBinary` (as `uint8`) and lists of them (see [`super::lists`]). In the IPC body a
//! primitive column is one field node and two buffers (validity, values); each
//! `FixedSizeList` level adds one field node and one buffer (validity) before its child;
//! each list level one field node and two buffers (validity, offsets) before its child; a
//! string/binary column is one field node and three buffers (validity, offsets, values).
//!
//! Columns left out by `--columns`, or unsupported ones under `--skip-unsupported`, are
//! stepped over by their node and buffer counts ([`super::pytype::ipc_counts`]); a
//! `string_view`/`binary_view` among them adds the data buffers its entry of the record
//! batch's `variadicBufferCounts` says. Served, a view column (or a list of views) is refused
//! with the fix (write `large_string`/`large_binary`, a list as `large_list<large_string>`).

use std::collections::HashSet;

use arrow_schema::{DataType, Field, Schema};
use shardwire_protocol::manifest::{DType, MAX_DIMS, MAX_TENSORS_PER_SHARD};

use super::pytype::{IpcCounts, ipc_counts, py_type};

/// Extension name key in field metadata.
const EXT_NAME: &str = "ARROW:extension:name";
/// Extension metadata key in field metadata.
const EXT_META: &str = "ARROW:extension:metadata";
/// The canonical fixed-shape tensor extension.
const FIXED_SHAPE_TENSOR: &str = "arrow.fixed_shape_tensor";
/// What an unsupported-column error suggests.
const HINT: &str =
    "choose other columns with --columns or skip such columns with --skip-unsupported";
/// Why a `string_view`/`binary_view` column (or a list of them: polars writes `List(String)`
/// as `large_list<string_view>`) is refused, and how to write it instead.
const VIEW_REASON: &str = "string_view/binary_view columns cannot be served (their values \
    lie in several buffers, addressed per row); write the column's strings as \
    large_string/large_binary (for a list column: large_list(large_string())) (polars: \
    df.write_ipc(path, compat_level=pl.CompatLevel.oldest()); pyarrow: cast the column with \
    table.cast(...) to pa.large_string(), pa.large_binary() or \
    pa.large_list(pa.large_string()) before writing)";

/// One variable-length level of a column, outermost first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ListLevel {
    /// 64-bit offsets (`LargeList`, `LargeUtf8`, `LargeBinary`); else 32-bit.
    pub large: bool,
    /// `Utf8`/`Binary`: offsets and byte values in one field node (always the innermost).
    pub bytes: bool,
}

/// How one column becomes a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ColumnPlan {
    /// Column name (tensor name).
    pub name: String,
    /// Element type of the leaf values.
    pub dtype: DType,
    /// Variable-length list levels above the fixed part, outermost first (empty: dense).
    pub lists: Vec<ListLevel>,
    /// `FixedSizeList` sizes below the lists, outermost first (the storage nesting).
    pub levels: Vec<u64>,
    /// Per-element shape of the fixed part (after `fixed_shape_tensor` reshaping);
    /// product equals the product of `levels`.
    pub dims: Vec<u64>,
}

/// One top-level column of a record batch: a tensor, or field nodes and buffers to step over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// The column becomes a tensor.
    Column(ColumnPlan),
    /// The column is not served: the field nodes and buffers it occupies.
    Skip(IpcCounts),
}

/// A schema's plan: one slot per column, and the unsupported columns skipped.
#[derive(Debug)]
pub(crate) struct SchemaPlan {
    /// One per top-level column, in schema order.
    pub slots: Vec<Slot>,
    /// (column, pyarrow type, reason) of each unsupported column skipped.
    pub skipped: Vec<(String, String, String)>,
}

/// Which columns to serve.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Choice<'a> {
    /// Keep only these columns.
    pub columns: Option<&'a [String]>,
    /// Skip unsupported columns instead of failing.
    pub skip_unsupported: bool,
}

/// A column-level problem: (column, reason, offending value).
pub(crate) type ColumnErr = (String, String, String);

/// Why a schema cannot be planned.
#[derive(Debug)]
pub(crate) enum PlanErr {
    /// A column (or the schema, with an empty name) cannot be served.
    Column(ColumnErr),
    /// `--columns` names a column the schema lacks: (name, available columns).
    Unknown(String, Vec<String>),
}

impl From<ColumnErr> for PlanErr {
    fn from(e: ColumnErr) -> Self {
        Self::Column(e)
    }
}

/// Plans every column of `schema` under `choice`, or names the first column that cannot
/// be a tensor.
pub(crate) fn plan_schema(schema: &Schema, choice: Choice<'_>) -> Result<SchemaPlan, PlanErr> {
    let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    if let Some(want) = choice.columns
        && let Some(bad) = want.iter().find(|w| !names.contains(w))
    {
        return Err(PlanErr::Unknown(bad.clone(), names));
    }
    let mut seen = HashSet::new();
    let mut plan = SchemaPlan {
        slots: Vec::with_capacity(names.len()),
        skipped: Vec::new(),
    };
    for field in schema.fields() {
        let name = field.name().clone();
        let wanted = choice.columns.is_none_or(|c| c.contains(&name));
        let slot = if wanted {
            checked_plan(field).map(Slot::Column)
        } else {
            Err((String::new(), String::new()))
        };
        let slot = match slot {
            Ok(slot) => slot,
            Err((reason, value)) => {
                let ty = py_type(field.data_type());
                if wanted && !choice.skip_unsupported {
                    let value = if value.is_empty() { ty } else { value };
                    return Err((name, format!("{reason}; {HINT}"), value).into());
                }
                if wanted {
                    plan.skipped.push((name.clone(), ty, reason));
                }
                Slot::Skip(ipc_counts(field.data_type()))
            }
        };
        if matches!(slot, Slot::Column(_)) && !seen.insert(name.clone()) {
            return Err((
                name,
                "duplicate column name; tensor names must be unique".into(),
                "a second column".into(),
            )
                .into());
        }
        plan.slots.push(slot);
    }
    check_count(&plan)?;
    Ok(plan)
}

/// At least one and at most [`MAX_TENSORS_PER_SHARD`] served columns.
fn check_count(plan: &SchemaPlan) -> Result<(), ColumnErr> {
    let used: Vec<&ColumnPlan> = plan
        .slots
        .iter()
        .filter_map(|s| match s {
            Slot::Column(c) => Some(c),
            Slot::Skip(_) => None,
        })
        .collect();
    if used.is_empty() {
        let skipped: Vec<String> = plan
            .skipped
            .iter()
            .map(|(n, t, _)| format!("{n}: {t}"))
            .collect();
        return Err((
            String::new(),
            "no column is left to serve".into(),
            if skipped.is_empty() {
                format!("{} columns", plan.slots.len())
            } else {
                format!("skipped {}", skipped.join(", "))
            },
        ));
    }
    if used.len() > MAX_TENSORS_PER_SHARD {
        return Err((
            used[MAX_TENSORS_PER_SHARD].name.clone(),
            format!("at most {MAX_TENSORS_PER_SHARD} columns are supported"),
            format!("{} columns", used.len()),
        ));
    }
    Ok(())
}

/// The plan of one top-level field, with its tensor rank checked.
fn checked_plan(field: &Field) -> Result<ColumnPlan, Reject> {
    let plan = plan_field(field)?;
    let dims = match plan.lists.len() {
        0 => 1 + plan.dims.len(),
        1 => 1,
        n => 1 + n + plan.dims.len(),
    };
    if dims > MAX_DIMS {
        return Err((
            format!("tensors have at most {MAX_DIMS} dimensions"),
            format!("{dims} dims"),
        ));
    }
    Ok(plan)
}

/// Why a field is rejected: (reason, offending value; empty: the field's type).
type Reject = (String, String);

/// The plan of one field (also used for list children), or why it is rejected.
fn plan_field(field: &Field) -> Result<ColumnPlan, Reject> {
    let leaf = |dtype, lists| ColumnPlan {
        name: String::new(),
        dtype,
        lists,
        levels: vec![],
        dims: vec![],
    };
    let mut plan = match field.data_type() {
        DataType::FixedSizeList(child, k) => {
            // Of size 0, its rows take no bytes: a record batch could claim any row count
            // (2^40 samples) with nothing behind it.
            let k = u64::try_from(*k).ok().filter(|&k| k > 0).ok_or_else(|| {
                (
                    "a FixedSizeList of size 0 or less is not supported".to_string(),
                    k.to_string(),
                )
            })?;
            let mut plan = plan_field(child)?;
            if !plan.lists.is_empty() {
                return Err((
                    "a FixedSizeList of variable-length lists or strings is not supported".into(),
                    String::new(),
                ));
            }
            plan.levels.insert(0, k);
            plan.dims.insert(0, k);
            plan
        }
        DataType::List(child) | DataType::LargeList(child) => {
            let mut plan = plan_field(child)?;
            let large = matches!(field.data_type(), DataType::LargeList(_));
            plan.lists.insert(
                0,
                ListLevel {
                    large,
                    bytes: false,
                },
            );
            plan
        }
        DataType::Utf8 | DataType::Binary => leaf(
            DType::Uint8,
            vec![ListLevel {
                large: false,
                bytes: true,
            }],
        ),
        DataType::LargeUtf8 | DataType::LargeBinary => leaf(
            DType::Uint8,
            vec![ListLevel {
                large: true,
                bytes: true,
            }],
        ),
        dt => leaf(primitive(dt)?, vec![]),
    };
    plan.name = field.name().clone();
    // Other extension types are indexed as their storage type.
    if field.metadata().get(EXT_NAME).map(String::as_str) == Some(FIXED_SHAPE_TENSOR) {
        if !plan.lists.is_empty() {
            return Err((
                "arrow.fixed_shape_tensor: storage must be a FixedSizeList of a fixed-width integer or float type".into(),
                String::new(),
            ));
        }
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
    let prod = shardwire_protocol::manifest::shape_elements(&shape);
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
                String::new(),
            ));
        }
        DataType::Dictionary(..) => {
            return Err((
                "dictionary-encoded columns are not supported; decode them first".into(),
                String::new(),
            ));
        }
        DataType::Utf8View | DataType::BinaryView => {
            return Err((VIEW_REASON.into(), String::new()));
        }
        _ => {
            return Err((
                "type is not supported; columns must be fixed-width integers/floats, FixedSizeList of them, \
                 arrow.fixed_shape_tensor, strings/binary, or lists of those"
                    .into(),
                String::new(),
            ));
        }
    })
}
