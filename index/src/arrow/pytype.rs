//! Arrow types as users know them: [`py_type`] spells a type the way pyarrow prints it
//! (`list<item: struct<a: int64>>`, `bool`, `dictionary<values=string, indices=int32,
//! ordered=0>`), falling back to arrow-rs's `Display` for rare types; [`ipc_counts`] gives
//! the number of field nodes and buffers a column of a type occupies in an IPC record batch
//! body ([`IpcCounts`]), so that a column can be stepped over without being read.

use arrow_schema::{DataType, Field, IntervalUnit, TimeUnit, UnionMode};

/// The pyarrow spelling of `dt`.
pub(crate) fn py_type(dt: &DataType) -> String {
    use DataType as D;
    let simple = match dt {
        D::Null => "null",
        D::Boolean => "bool",
        D::Int8 => "int8",
        D::Int16 => "int16",
        D::Int32 => "int32",
        D::Int64 => "int64",
        D::UInt8 => "uint8",
        D::UInt16 => "uint16",
        D::UInt32 => "uint32",
        D::UInt64 => "uint64",
        D::Float16 => "halffloat",
        D::Float32 => "float",
        D::Float64 => "double",
        D::Utf8 => "string",
        D::LargeUtf8 => "large_string",
        D::Utf8View => "string_view",
        D::Binary => "binary",
        D::LargeBinary => "large_binary",
        D::BinaryView => "binary_view",
        D::Date32 => "date32[day]",
        D::Date64 => "date64[ms]",
        D::Interval(IntervalUnit::MonthDayNano) => "month_day_nano_interval",
        _ => "",
    };
    if !simple.is_empty() {
        return simple.to_string();
    }
    match dt {
        D::FixedSizeBinary(n) => format!("fixed_size_binary[{n}]"),
        D::Timestamp(u, None) => format!("timestamp[{}]", unit(u)),
        D::Timestamp(u, Some(tz)) => format!("timestamp[{}, tz={tz}]", unit(u)),
        D::Time32(u) => format!("time32[{}]", unit(u)),
        D::Time64(u) => format!("time64[{}]", unit(u)),
        D::Duration(u) => format!("duration[{}]", unit(u)),
        D::Decimal128(p, s) => format!("decimal128({p}, {s})"),
        D::Decimal256(p, s) => format!("decimal256({p}, {s})"),
        D::List(f) => format!("list<{}>", py_field(f)),
        D::LargeList(f) => format!("large_list<{}>", py_field(f)),
        D::ListView(f) => format!("list_view<{}>", py_field(f)),
        D::LargeListView(f) => format!("large_list_view<{}>", py_field(f)),
        D::FixedSizeList(f, n) => format!("fixed_size_list<{}>[{n}]", py_field(f)),
        D::Struct(fields) => {
            let inner: Vec<String> = fields.iter().map(|f| py_field(f)).collect();
            format!("struct<{}>", inner.join(", "))
        }
        D::Map(entries, _) => match entries.data_type() {
            D::Struct(kv) if kv.len() == 2 => format!(
                "map<{}, {}>",
                py_type(kv[0].data_type()),
                py_type(kv[1].data_type())
            ),
            other => format!("map<{}>", py_type(other)),
        },
        D::Dictionary(k, v) => format!(
            "dictionary<values={}, indices={}, ordered=0>",
            py_type(v),
            py_type(k)
        ),
        other => other.to_string(),
    }
}

/// `name: type`, pyarrow's spelling of a child field.
fn py_field(f: &Field) -> String {
    format!("{}: {}", f.name(), py_type(f.data_type()))
}

fn unit(u: &TimeUnit) -> &'static str {
    match u {
        TimeUnit::Second => "s",
        TimeUnit::Millisecond => "ms",
        TimeUnit::Microsecond => "us",
        TimeUnit::Nanosecond => "ns",
    }
}

/// Where a column of one type lies in an IPC record batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IpcCounts {
    /// Field nodes.
    pub nodes: usize,
    /// Buffers the schema fixes.
    pub buffers: usize,
    /// String/binary view fields (`string_view`, `binary_view`, at any depth). Each has, after
    /// its two buffers counted in `buffers` (validity, views), as many data buffers as its
    /// entry of the record batch's `variadicBufferCounts` says (one entry per view field, in
    /// the depth-first order of the schema's fields).
    pub views: usize,
    /// Union and run-end-encoded fields (at any depth): the types with no validity buffer in
    /// IPC metadata V5 but one under V4 (every type but null has one there, as arrow-rs's
    /// writer, `has_validity_bitmap`, and Arrow C++ write it). Those V4 validity buffers are
    /// not counted in `buffers`; see [`super::body::Walk::skip`].
    pub v4_validity: usize,
}

/// Where a column of type `dt` lies in an IPC record batch (as arrow-rs's reader steps over
/// it, `RecordBatchDecoder::skip_field`).
pub(crate) fn ipc_counts(dt: &DataType) -> IpcCounts {
    use DataType as D;
    let (own, views, children): (usize, usize, Vec<&DataType>) = match dt {
        D::Null => (0, 0, vec![]),
        D::Utf8 | D::LargeUtf8 | D::Binary | D::LargeBinary => (3, 0, vec![]),
        D::Utf8View | D::BinaryView => (2, 1, vec![]),
        D::List(f) | D::LargeList(f) | D::Map(f, _) => (2, 0, vec![f.data_type()]),
        D::ListView(f) | D::LargeListView(f) => (3, 0, vec![f.data_type()]),
        D::FixedSizeList(f, _) => (1, 0, vec![f.data_type()]),
        D::Struct(fs) => (1, 0, fs.iter().map(|f| f.data_type()).collect()),
        // Type ids (and offsets when dense); V5 has no validity buffer (V4: see
        // `v4_validity`).
        D::Union(fs, mode) => (
            if *mode == UnionMode::Dense { 2 } else { 1 },
            0,
            fs.iter().map(|(_, f)| f.data_type()).collect(),
        ),
        // Only its children's buffers; V5 has no validity buffer (V4: see `v4_validity`).
        D::RunEndEncoded(r, v) => (0, 0, vec![r.data_type(), v.data_type()]),
        // Dictionary columns hold indices; the values (views too) travel in dictionary
        // batches, whose variadic counts are their own.
        _ => (2, 0, vec![]),
    };
    let mut out = IpcCounts {
        nodes: 1,
        buffers: own,
        views,
        v4_validity: usize::from(matches!(dt, D::Union(..) | D::RunEndEncoded(..))),
    };
    for c in children {
        let child = ipc_counts(c);
        out.nodes += child.nodes;
        out.buffers += child.buffers;
        out.views += child.views;
        out.v4_validity += child.v4_validity;
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_schema::{Fields, UnionFields};

    use super::*;

    #[test]
    fn pyarrow_spellings() {
        let st = DataType::Struct(Fields::from(vec![Field::new("a", DataType::Int64, true)]));
        let list = DataType::List(Arc::new(Field::new("item", st, true)));
        assert_eq!(py_type(&list), "list<item: struct<a: int64>>");
        assert_eq!(py_type(&DataType::Boolean), "bool");
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        assert_eq!(
            py_type(&dict),
            "dictionary<values=string, indices=int32, ordered=0>"
        );
        let ts = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        assert_eq!(py_type(&ts), "timestamp[us, tz=UTC]");
        let fsl = DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, true)), 3);
        assert_eq!(py_type(&fsl), "fixed_size_list<item: float>[3]");
    }

    fn counts(nodes: usize, buffers: usize, views: usize) -> IpcCounts {
        IpcCounts {
            nodes,
            buffers,
            views,
            v4_validity: 0,
        }
    }

    #[test]
    fn ipc_counts_of_nested_types() {
        assert_eq!(ipc_counts(&DataType::Int32), counts(1, 2, 0));
        assert_eq!(ipc_counts(&DataType::Utf8), counts(1, 3, 0));
        let st = DataType::Struct(Fields::from(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        let list = DataType::List(Arc::new(Field::new("item", st, true)));
        // list (2) + struct (1) + int64 (2) + utf8 (3)
        assert_eq!(ipc_counts(&list), counts(4, 8, 0));
    }

    #[test]
    fn view_columns_count_their_fixed_buffers_and_their_views() {
        // Before, a view column had no counts (None), so it could not be skipped.
        assert_eq!(ipc_counts(&DataType::Utf8View), counts(1, 2, 1));
        assert_eq!(ipc_counts(&DataType::BinaryView), counts(1, 2, 1));
        let st = DataType::Struct(Fields::from(vec![
            Field::new("s", DataType::Utf8View, true),
            Field::new("b", DataType::BinaryView, true),
        ]));
        let list = DataType::List(Arc::new(Field::new("item", st, true)));
        // list (2) + struct (1) + two views (2 each), and two variadic counts.
        assert_eq!(ipc_counts(&list), counts(4, 7, 2));
        // A dictionary's values travel in dictionary batches: no variadic count here.
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8View));
        assert_eq!(ipc_counts(&dict), counts(1, 2, 0));
    }

    #[test]
    fn unions_are_counted_for_their_v4_validity_buffers() {
        // Before, a union's V4 validity buffer had nothing to count it by.
        let union = |mode: UnionMode| {
            let fields = vec![
                Field::new("i", DataType::Int32, false),
                Field::new("s", DataType::Utf8, false),
            ];
            DataType::Union(UnionFields::try_new([0, 1], fields).unwrap(), mode)
        };
        // Type ids (1) + int32 (2) + utf8 (3); dense adds offsets.
        let sparse = IpcCounts {
            v4_validity: 1,
            ..counts(3, 6, 0)
        };
        assert_eq!(ipc_counts(&union(UnionMode::Sparse)), sparse);
        let dense = IpcCounts {
            v4_validity: 1,
            ..counts(3, 7, 0)
        };
        assert_eq!(ipc_counts(&union(UnionMode::Dense)), dense);
        let st = DataType::Struct(Fields::from(vec![
            Field::new("u", union(UnionMode::Sparse), false),
            Field::new("v", union(UnionMode::Dense), false),
        ]));
        let list = DataType::List(Arc::new(Field::new("item", st, true)));
        let nested = IpcCounts {
            v4_validity: 2,
            ..counts(8, 16, 0)
        };
        assert_eq!(ipc_counts(&list), nested);
    }

    #[test]
    fn run_end_encoded_is_counted_for_its_v4_validity_buffer() {
        // Before, only unions were: a run-end-encoded field's V4 validity buffer was not.
        let ree = DataType::RunEndEncoded(
            Arc::new(Field::new("run_ends", DataType::Int32, false)),
            Arc::new(Field::new("values", DataType::Int64, true)),
        );
        // Its own node, no buffers of its own; run ends (2) + values (2).
        let own = IpcCounts {
            v4_validity: 1,
            ..counts(3, 4, 0)
        };
        assert_eq!(ipc_counts(&ree), own);
        let st = DataType::Struct(Fields::from(vec![Field::new("r", ree, true)]));
        let nested = IpcCounts {
            v4_validity: 1,
            ..counts(4, 5, 0)
        };
        assert_eq!(ipc_counts(&st), nested);
        // A null column has no validity buffer in V4 either.
        assert_eq!(ipc_counts(&DataType::Null), counts(1, 0, 0));
    }
}
