//! Tests for `string_view`/`binary_view` columns (polars writes them by default, pyarrow on
//! request): stepped over when not served, their data buffers counted by the record batch's
//! `variadicBufferCounts`; refused with the fix when served. Files written by arrow-rs's IPC
//! writers, and hand-made layouts for counts that do not fit the schema.

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::StringViewBuilder;
use arrow_array::{
    ArrayRef, BinaryViewArray, Int32Array, Int64Array, RecordBatch, StringViewArray, StructArray,
};
use arrow_ipc::MetadataVersion;
use arrow_schema::{DataType, Field, Schema};
use shardwire_protocol::manifest::DType;

use super::batch::batch_tensors;
use super::body::{BatchErr, BatchFail, BatchLayout};
use super::layout::{Choice, ColumnPlan, PlanErr, Slot, plan_schema};
use super::pytype::ipc_counts;
use super::tests::{write_file, write_stream};
use crate::testutil::{check_manifest, le_bytes, temp_dir};
use crate::{IndexOptions, IndexReport, index_report};

const ROWS: usize = 5;

/// `s` (string_view, long values in several data buffers), `a` (int32), `meta`
/// (struct<t: string_view, k: int32>, its values inline: no data buffer), `b` (binary_view,
/// one data buffer), `n` (int64).
fn views_batch() -> RecordBatch {
    let mut sb = StringViewBuilder::new().with_fixed_block_size(32);
    for i in 0..ROWS {
        sb.append_value(format!("a value longer than twelve bytes, row {i}"));
    }
    let s = sb.finish();
    assert!(s.data_buffers().len() >= 2, "{:?}", s.data_buffers().len());
    let t: ArrayRef = Arc::new(StringViewArray::from(vec!["x", "yy", "zzz", "", "w"]));
    let k: ArrayRef = Arc::new(Int32Array::from_iter_values(0..ROWS as i32));
    let meta = StructArray::from(vec![
        (Arc::new(Field::new("t", DataType::Utf8View, false)), t),
        (Arc::new(Field::new("k", DataType::Int32, false)), k),
    ]);
    let b = BinaryViewArray::from_iter_values([
        "short",
        "a binary value past twelve bytes",
        "",
        "z",
        "0123456789abcdef",
    ]);
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("s", Arc::new(s)),
        ("a", Arc::new(Int32Array::from_iter_values(a_values()))),
        ("meta", Arc::new(meta)),
        ("b", Arc::new(b)),
        ("n", Arc::new(Int64Array::from_iter_values(n_values()))),
    ];
    let fields: Vec<Field> = cols
        .iter()
        .map(|(n, c)| Field::new(*n, c.data_type().clone(), false))
        .collect();
    let arrays = cols.into_iter().map(|(_, c)| c).collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap()
}

fn a_values() -> Vec<i32> {
    (0..ROWS as i32).map(|i| i * 7 - 3).collect()
}

fn n_values() -> Vec<i64> {
    (0..ROWS as i64).map(|i| -i * 1000).collect()
}

/// The bytes of `a` and `n` over `batches` record batches.
fn served(batches: usize) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("a", le_bytes(&a_values(), i32::to_le_bytes).repeat(batches)),
        ("n", le_bytes(&n_values(), i64::to_le_bytes).repeat(batches)),
    ]
}

fn report(dir: &Path, opts: &IndexOptions) -> Result<IndexReport, String> {
    index_report(dir, opts).map_err(|e| e.to_string())
}

#[test]
fn view_columns_not_served_are_stepped_over_by_their_variadic_buffers() {
    // Before, any view column refused the file, served or not ("cannot be skipped").
    let dir = temp_dir("arrow-views-skip");
    write_file(&dir.join("f.arrow"), &[views_batch()]);
    write_stream(&dir.join("s.arrows"), &[views_batch(), views_batch()]);
    let opts = IndexOptions {
        columns: Some(vec!["a".into(), "n".into()]),
        ..IndexOptions::default()
    };
    let r = report(&dir, &opts).unwrap();
    assert_eq!(r.manifest.shards.len(), 3);
    assert!(r.skipped.is_empty(), "{:?}", r.skipped);
    // A miscounted view (its data buffers, or the one nested in `meta`) shifts every later
    // buffer: `a` and `n` would be refused or point at other bytes.
    check_manifest(&dir, &r.manifest, &served(3));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_served_view_column_is_refused_naming_it_its_type_and_the_fix() {
    let dir = temp_dir("arrow-views-served");
    write_file(&dir.join("f.arrow"), &[views_batch()]);
    let err = report(&dir, &IndexOptions::default()).unwrap_err();
    assert!(
        err.contains("f.arrow")
            && err.contains("column `s`")
            && err.contains("(found: string_view)")
            && err.contains("large_string")
            && err.contains("compat_level=pl.CompatLevel.oldest()")
            && err.contains("--skip-unsupported"),
        "{err}"
    );
    let opts = IndexOptions {
        columns: Some(vec!["b".into()]),
        ..IndexOptions::default()
    };
    let err = report(&dir, &opts).unwrap_err();
    assert!(
        err.contains("column `b`") && err.contains("(found: binary_view)"),
        "{err}"
    );
    // Under --skip-unsupported each is skipped and named with its type; the rest is served.
    let opts = IndexOptions {
        skip_unsupported: true,
        ..IndexOptions::default()
    };
    let r = report(&dir, &opts).unwrap();
    let skipped: Vec<(&str, &str)> = r
        .skipped
        .iter()
        .map(|c| (c.column.as_str(), c.dtype.as_str()))
        .collect();
    assert_eq!(
        skipped,
        [
            ("s", "string_view"),
            ("meta", "struct<t: string_view, k: int32>"),
            ("b", "binary_view"),
        ]
    );
    check_manifest(&dir, &r.manifest, &served(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_served_list_of_views_is_refused_with_the_list_fix() {
    // polars writes List(String) as large_list<string_view>. Before, the fix named only
    // large_string/large_binary, which a list column cannot be cast to.
    let item = Arc::new(Field::new("item", DataType::Utf8View, true));
    let schema = Schema::new(vec![Field::new("tags", DataType::LargeList(item), true)]);
    match plan_schema(&schema, Choice::default()) {
        Err(PlanErr::Column((col, reason, value))) => {
            assert_eq!(col, "tags");
            assert_eq!(value, "large_list<item: string_view>");
            assert!(
                reason.contains("(for a list column: large_list(large_string()))")
                    && reason.contains("pa.large_list(pa.large_string())"),
                "{reason}"
            );
        }
        other => panic!("a list of views was not refused: {other:?}"),
    }
}

/// A reader for layout tests, which must not read.
fn no_read(what: &str, _: u64, _: u64) -> Result<Vec<u8>, crate::IndexError> {
    panic!("unexpected read of {what}")
}

#[test]
fn variadic_buffer_counts_that_do_not_fit_the_schema_are_refused() {
    // A string_view column not served, then an int32 column `a`; two rows.
    let slots = [
        Slot::Skip(ipc_counts(&DataType::Utf8View)),
        Slot::Column(ColumnPlan {
            name: "a".into(),
            dtype: DType::Int32,
            lists: vec![],
            levels: vec![],
            dims: vec![],
        }),
    ];
    // The view column: validity, views (2 x 16 bytes), two data buffers; then `a`.
    let good = BatchLayout {
        rows: 2,
        nodes: vec![(2, 0), (2, 0)],
        buffers: vec![(0, 0), (0, 32), (32, 16), (48, 16), (64, 0), (64, 8)],
        variadic: vec![2],
        version: MetadataVersion::V5,
    };
    let t = batch_tensors(&slots, &good, 1000, 72, &mut no_read).unwrap();
    assert_eq!(
        (t[0].name.as_str(), t[0].offset, t[0].length),
        ("a", 1064, 8)
    );
    let with = |variadic: Vec<i64>| -> BatchErr {
        let b = BatchLayout {
            rows: good.rows,
            nodes: good.nodes.clone(),
            buffers: good.buffers.clone(),
            variadic,
            version: good.version,
        };
        match batch_tensors(&slots, &b, 1000, 72, &mut no_read) {
            Err(BatchFail::Layout(e)) => e,
            other => panic!("expected a layout error, got {other:?}"),
        }
    };
    let e = with(vec![]);
    assert!(e.1.contains("fewer variadic buffer counts"), "{e:?}");
    let e = with(vec![-1]);
    assert!(e.1.contains("negative") && e.2 == "-1", "{e:?}");
    let e = with(vec![2, 0]);
    assert!(
        e.0.is_none() && e.1.contains("variadic buffer counts than"),
        "{e:?}"
    );
    // Before: "fewer buffers than its schema needs (found: 6 buffers)", naming neither.
    let e = with(vec![9]);
    assert!(
        e.1.contains("more data buffers (its variadic buffer count)")
            && e.2 == "variadic buffer count 9, 4 buffers left",
        "{e:?}"
    );
    // One data buffer short: `a` would take the view's last data buffer as its validity.
    let e = with(vec![1]);
    assert!(
        e.0.as_deref() == Some("a") && e.1.contains("shorter"),
        "{e:?}"
    );
}
