//! Tests for the Arrow IPC reader, with files written by arrow-rs's own IPC writers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder, StructBuilder};
use arrow_array::{
    Array, ArrayRef, BooleanArray, DictionaryArray, FixedSizeListArray, Float32Array, Float64Array,
    Int8Array, Int16Array, Int32Array, Int64Array, RecordBatch, RunArray, UInt8Array, UInt16Array,
    UnionArray, types::Int32Type,
};
use arrow_ipc::MetadataVersion;
use arrow_ipc::writer::{FileWriter, IpcWriteOptions, StreamWriter};
use arrow_schema::{DataType, Field, Schema, UnionFields};
use shardwire_protocol::manifest::{DType, Manifest};

use super::batch::batch_tensors;
use super::body::{BatchErr, BatchFail, BatchLayout};
use super::layout::{ColumnPlan, Slot};
use crate::testutil::{check_manifest, le_bytes, temp_dir};
use crate::{IndexOptions, index_dir};

/// A `list<item: struct<a: int64>>` column of two rows.
pub(super) fn struct_list() -> ArrayRef {
    let fields = vec![Field::new("a", DataType::Int64, true)];
    let mut b = ListBuilder::new(StructBuilder::from_fields(fields, 0));
    for v in [1i64, 2] {
        let st = b.values();
        st.field_builder::<Int64Builder>(0).unwrap().append_value(v);
        st.append(true);
        b.append(true);
    }
    Arc::new(b.finish())
}

fn fsl(values: ArrayRef, k: i32) -> FixedSizeListArray {
    let item = Arc::new(Field::new("item", values.data_type().clone(), false));
    FixedSizeListArray::try_new(item, k, values, None).unwrap()
}

fn tensor_field(name: &str, storage: &dyn Array, shape: &str, extra: &str) -> Field {
    let meta = HashMap::from([
        (
            "ARROW:extension:name".to_string(),
            "arrow.fixed_shape_tensor".to_string(),
        ),
        (
            "ARROW:extension:metadata".to_string(),
            format!("{{\"shape\":{shape}{extra}}}"),
        ),
    ]);
    Field::new(name, storage.data_type().clone(), false).with_metadata(meta)
}

/// A batch of `n` rows starting at row `start`, with every supported column kind.
fn sample_batch(start: usize, n: usize) -> RecordBatch {
    let r = start..start + n;
    let id = Int64Array::from_iter_values(r.clone().map(|i| i as i64 * 1000 - 7));
    let x = Float32Array::from_iter_values(r.clone().map(|i| i as f32 * 0.25));
    let b = UInt8Array::from_iter_values(r.clone().map(|i| (i * 3) as u8));
    let d = Float64Array::from_iter_values(r.clone().map(|i| -(i as f64)));
    let v = fsl(
        Arc::new(Float32Array::from_iter_values(
            r.clone()
                .flat_map(|i| (0..4).map(move |j| (i * 4 + j) as f32)),
        )),
        4,
    );
    let t = fsl(
        Arc::new(Int16Array::from_iter_values(
            r.clone()
                .flat_map(|i| (0..6).map(move |j| (i * 6 + j) as i16)),
        )),
        6,
    );
    let inner = fsl(
        Arc::new(UInt16Array::from_iter_values(
            r.flat_map(|i| (0..6).map(move |j| (i * 10 + j) as u16)),
        )),
        3,
    );
    let nested = fsl(Arc::new(inner), 2);
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("x", DataType::Float32, true),
        Field::new("b", DataType::UInt8, false),
        Field::new("d", DataType::Float64, false),
        Field::new("v", v.data_type().clone(), false),
        tensor_field("t", &t, "[2,3]", ""),
        Field::new("nested", nested.data_type().clone(), false),
    ]);
    let cols: Vec<ArrayRef> = vec![
        Arc::new(id),
        Arc::new(x),
        Arc::new(b),
        Arc::new(d),
        Arc::new(v),
        Arc::new(t),
        Arc::new(nested),
    ];
    RecordBatch::try_new(Arc::new(schema), cols).unwrap()
}

/// The expected bytes of each column over rows `0..n`.
fn expected(n: usize) -> Vec<(&'static str, Vec<u8>)> {
    let r = 0..n;
    vec![
        (
            "id",
            le_bytes(
                &r.clone().map(|i| i as i64 * 1000 - 7).collect::<Vec<_>>(),
                i64::to_le_bytes,
            ),
        ),
        (
            "x",
            le_bytes(
                &r.clone().map(|i| i as f32 * 0.25).collect::<Vec<_>>(),
                f32::to_le_bytes,
            ),
        ),
        ("b", r.clone().map(|i| (i * 3) as u8).collect()),
        (
            "d",
            le_bytes(
                &r.clone().map(|i| -(i as f64)).collect::<Vec<_>>(),
                f64::to_le_bytes,
            ),
        ),
        (
            "v",
            le_bytes(
                &(0..n * 4).map(|i| i as f32).collect::<Vec<_>>(),
                f32::to_le_bytes,
            ),
        ),
        (
            "t",
            le_bytes(
                &(0..n * 6).map(|i| i as i16).collect::<Vec<_>>(),
                i16::to_le_bytes,
            ),
        ),
        (
            "nested",
            le_bytes(
                &r.flat_map(|i| (0..6).map(move |j| (i * 10 + j) as u16))
                    .collect::<Vec<_>>(),
                u16::to_le_bytes,
            ),
        ),
    ]
}

pub(super) fn write_file(path: &Path, batches: &[RecordBatch]) {
    let f = std::fs::File::create(path).unwrap();
    let mut w = FileWriter::try_new(f, &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

pub(super) fn write_stream(path: &Path, batches: &[RecordBatch]) {
    let f = std::fs::File::create(path).unwrap();
    let mut w = StreamWriter::try_new(f, &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

pub(super) fn index(dir: &Path) -> Result<Manifest, String> {
    index_dir(dir, &IndexOptions::default()).map_err(|e| e.to_string())
}

/// Writes `batches` to `dir/name` (file format) and returns the indexing error.
pub(super) fn rejected(test: &str, name: &str, batches: &[RecordBatch]) -> (PathBuf, String) {
    let dir = temp_dir(test);
    write_file(&dir.join(name), batches);
    let err = index(&dir).expect_err("must be rejected");
    assert!(err.contains(name), "`{err}` does not name the file");
    (dir, err)
}

fn check_sample_shards(m: &Manifest, rows: &[u64]) {
    assert_eq!(m.shards.len(), rows.len());
    for (s, &n) in m.shards.iter().zip(rows) {
        let shapes: Vec<(&str, DType, Vec<u64>)> = s
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype, t.shape.clone()))
            .collect();
        assert_eq!(
            shapes,
            [
                ("id", DType::Int64, vec![n]),
                ("x", DType::Float32, vec![n]),
                ("b", DType::Uint8, vec![n]),
                ("d", DType::Float64, vec![n]),
                ("v", DType::Float32, vec![n, 4]),
                ("t", DType::Int16, vec![n, 2, 3]),
                ("nested", DType::Uint16, vec![n, 2, 3]),
            ]
        );
    }
}

#[test]
fn file_format_multi_batch() {
    let dir = temp_dir("arrow-file");
    // The empty batch in the middle yields no shard.
    write_file(
        &dir.join("data.arrow"),
        &[sample_batch(0, 5), sample_batch(5, 0), sample_batch(5, 3)],
    );
    let m = index(&dir).unwrap();
    check_sample_shards(&m, &[5, 3]);
    assert!(m.shards.iter().all(|s| s.file == "data.arrow"));
    assert!(m.shards[0].offset + m.shards[0].length <= m.shards[1].offset);
    check_manifest(&dir, &m, &expected(8));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stream_format_multi_batch() {
    let dir = temp_dir("arrow-stream");
    write_stream(
        &dir.join("s.arrows"),
        &[
            sample_batch(0, 4),
            sample_batch(4, 0),
            sample_batch(4, 6),
            sample_batch(10, 1),
        ],
    );
    let m = index(&dir).unwrap();
    check_sample_shards(&m, &[4, 6, 1]);
    check_manifest(&dir, &m, &expected(11));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sliced_batches_are_correct_or_rejected() {
    // Whatever the writer does with a sliced FixedSizeList, the index must never point at
    // the wrong bytes.
    let dir = temp_dir("arrow-sliced");
    let full = sample_batch(0, 6);
    write_file(&dir.join("sl.arrow"), &[full.slice(2, 3)]);
    match index(&dir) {
        Ok(m) => {
            let all = expected(6);
            let want: Vec<(&str, Vec<u8>)> = all
                .iter()
                .map(|(name, bytes)| {
                    let per_row = bytes.len() / 6;
                    (*name, bytes[2 * per_row..5 * per_row].to_vec())
                })
                .collect();
            check_manifest(&dir, &m, &want);
        }
        Err(e) => assert!(e.contains("sliced"), "{e}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nulls_are_rejected_naming_the_column() {
    let schema = Arc::new(Schema::new(vec![
        Field::new("ok", DataType::Int32, false),
        Field::new("label", DataType::Int32, true),
    ]));
    let ok = Int32Array::from(vec![1, 2, 3]);
    let label = Int32Array::from(vec![Some(1), None, Some(3)]);
    let batch = RecordBatch::try_new(schema, vec![Arc::new(ok), Arc::new(label)]).unwrap();
    let (dir, err) = rejected("arrow-nulls", "n.arrow", &[batch]);
    assert!(
        err.contains("column `label`") && err.contains("1 nulls") && err.contains("record batch 0"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let values = Float32Array::from(vec![Some(1.0), None, Some(3.0), Some(4.0)]);
    let item = Arc::new(Field::new("item", DataType::Float32, true));
    let v = FixedSizeListArray::try_new(item, 2, Arc::new(values), None).unwrap();
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new(
            "emb",
            v.data_type().clone(),
            false,
        )])),
        vec![Arc::new(v)],
    )
    .unwrap();
    let (dir, err) = rejected("arrow-child-nulls", "c.arrow", &[batch]);
    assert!(
        err.contains("column `emb`") && err.contains("FixedSizeList values has 1 nulls"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `u` (sparse union<i: int32, f: double>), `d` (the same, dense), `x` (int32): four rows.
fn unions_batch(x: &[i32]) -> RecordBatch {
    let fields = UnionFields::try_new(
        [0i8, 1],
        [
            Field::new("i", DataType::Int32, false),
            Field::new("f", DataType::Float64, false),
        ],
    )
    .unwrap();
    let children = |i: Vec<i32>, f: Vec<f64>| -> Vec<ArrayRef> {
        vec![
            Arc::new(Int32Array::from(i)),
            Arc::new(Float64Array::from(f)),
        ]
    };
    let sparse = UnionArray::try_new(
        fields.clone(),
        vec![0i8, 1, 1, 0].into(),
        None,
        children(vec![1, 2, 3, 4], vec![0.5, 1.5, 2.5, 3.5]),
    )
    .unwrap();
    let dense = UnionArray::try_new(
        fields,
        vec![1i8, 0, 0, 1].into(),
        Some(vec![0i32, 0, 1, 1].into()),
        children(vec![8, 9], vec![0.25, 0.75]),
    )
    .unwrap();
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("u", Arc::new(sparse)),
        ("d", Arc::new(dense)),
        ("x", Arc::new(Int32Array::from(x.to_vec()))),
    ];
    let schema: Vec<Field> = cols
        .iter()
        .map(|(n, c)| Field::new(*n, c.data_type().clone(), true))
        .collect();
    let arrays = cols.into_iter().map(|(_, c)| c).collect();
    RecordBatch::try_new(Arc::new(Schema::new(schema)), arrays).unwrap()
}

/// `r` (run_end_encoded<int32, int64>: runs of 10 and 20), `x` (int64): four rows.
fn run_end_encoded_batch(x: &[i64]) -> RecordBatch {
    let ree = RunArray::<Int32Type>::try_new(
        &Int32Array::from(vec![2, 4]),
        &Int64Array::from(vec![10, 20]),
    )
    .unwrap();
    let x = Int64Array::from(x.to_vec());
    let schema = Schema::new(vec![
        Field::new("r", ree.data_type().clone(), true),
        Field::new("x", DataType::Int64, true),
    ]);
    let cols: Vec<ArrayRef> = vec![Arc::new(ree), Arc::new(x)];
    RecordBatch::try_new(Arc::new(schema), cols).unwrap()
}

/// Indexes `batch` written as a V4 and a V5 file into a fresh directory, serving only `x`;
/// checks that `x` comes out as `x_bytes` in both shards.
fn check_v4_and_v5_serve_x(tag: &str, batch: &RecordBatch, x_bytes: &[u8]) {
    let dir = temp_dir(tag);
    for (name, version) in [
        ("v4.arrow", MetadataVersion::V4),
        ("v5.arrow", MetadataVersion::V5),
    ] {
        let opts = IpcWriteOptions::try_new(8, false, version).unwrap();
        let f = std::fs::File::create(dir.join(name)).unwrap();
        let mut w = FileWriter::try_new_with_options(f, &batch.schema(), opts).unwrap();
        w.write(batch).unwrap();
        w.finish().unwrap();
    }
    let opts = IndexOptions {
        columns: Some(vec!["x".into()]),
        ..IndexOptions::default()
    };
    let m = index_dir(&dir, &opts).map_err(|e| e.to_string()).unwrap();
    assert_eq!(m.shards.len(), 2, "{tag}");
    check_manifest(&dir, &m, &[("x", x_bytes.repeat(2))]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn union_and_run_end_encoded_columns_not_served_are_stepped_over_in_v4_and_v5_files() {
    // Under metadata V4 a union or run-end-encoded field has a validity buffer (V5 dropped
    // it), which arrow-rs and Arrow C++ write. Before, it was not counted (a run-end-encoded
    // field's until now, a union's until the fix before): the V4 file was refused as having
    // more buffers than its schema needs.
    let x = [5i32, -1, 7, 0];
    let union_x = le_bytes(&x, i32::to_le_bytes);
    check_v4_and_v5_serve_x("arrow-unions", &unions_batch(&x), &union_x);
    let x = [3i64, -9, 1 << 40, 0];
    let ree_x = le_bytes(&x, i64::to_le_bytes);
    check_v4_and_v5_serve_x("arrow-ree", &run_end_encoded_batch(&x), &ree_x);
}

#[test]
fn compressed_batches_are_rejected() {
    // Without the lz4 feature arrow-rs cannot compress data, but it writes a batch whose
    // buffers are all empty with the LZ4 flag set: a real compressed-IPC message.
    let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, false)]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(Int32Array::from(Vec::<i32>::new()))],
    )
    .unwrap();
    let opts = IpcWriteOptions::try_new(8, false, MetadataVersion::V5)
        .unwrap()
        .try_with_compression(Some(arrow_ipc::CompressionType::LZ4_FRAME))
        .unwrap();
    let dir = temp_dir("arrow-lz4");
    let path = dir.join("z.arrow");
    let mut w =
        FileWriter::try_new_with_options(std::fs::File::create(&path).unwrap(), &schema, opts)
            .unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    let err = index(&dir).unwrap_err();
    assert!(
        err.contains("z.arrow") && err.contains("compressed IPC") && err.contains("LZ4_FRAME"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsupported_types_are_rejected_naming_column_and_type() {
    let cases: Vec<(&str, ArrayRef, &str)> = vec![
        (
            "flag",
            Arc::new(BooleanArray::from(vec![true, false])),
            "(found: bool)",
        ),
        (
            "cat",
            Arc::new(DictionaryArray::<Int32Type>::from_iter(["x", "y"])),
            "dictionary-encoded columns are not supported; decode them first; choose other \
             columns with --columns or skip such columns with --skip-unsupported (found: \
             dictionary<values=string, indices=int32",
        ),
        (
            "meta",
            struct_list(),
            "(found: list<item: struct<a: int64>>)",
        ),
    ];
    for (name, col, needle) in cases {
        let schema = Arc::new(Schema::new(vec![Field::new(
            name,
            col.data_type().clone(),
            false,
        )]));
        let batch = RecordBatch::try_new(schema, vec![col]).unwrap();
        let (dir, err) = rejected(&format!("arrow-type-{name}"), "u.arrow", &[batch]);
        assert!(
            err.contains(&format!("column `{name}`"))
                && err.contains(needle)
                && err.contains("--skip-unsupported"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn bad_fixed_shape_tensor_metadata_is_rejected() {
    let storage = fsl(Arc::new(Float32Array::from(vec![0.0; 12])), 6);
    for (extra, shape, needle) in [
        (",\"permutation\":[1,0]", "[2,3]", "permutation"),
        ("", "[4,2]", "does not match the storage list size 6"),
        ("", "\"x\"", "\"shape\""),
    ] {
        let field = tensor_field("img", &storage, shape, extra);
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![field])),
            vec![Arc::new(storage.clone())],
        )
        .unwrap();
        let (dir, err) = rejected("arrow-ext", "e.arrow", &[batch]);
        assert!(
            err.contains("column `img`") && err.contains(needle),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // The identity permutation and dim_names are fine.
    let field = tensor_field(
        "img",
        &storage,
        "[3,2]",
        ",\"permutation\":[0,1],\"dim_names\":[\"h\",\"w\"]",
    );
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(vec![field])),
        vec![Arc::new(storage.clone())],
    )
    .unwrap();
    let dir = temp_dir("arrow-ext-ok");
    write_file(&dir.join("ok.arrow"), &[batch]);
    let m = index(&dir).unwrap();
    assert_eq!(m.shards[0].tensors[0].shape, [2, 3, 2]);
    check_manifest(&dir, &m, &[("img", vec![0u8; 48])]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_and_foreign_files_are_rejected() {
    let dir = temp_dir("arrow-trunc");
    write_file(&dir.join("f.arrow"), &[sample_batch(0, 4)]);
    write_stream(&dir.join("s.arrows"), &[sample_batch(0, 4)]);
    for (name, needle) in [("f.arrow", "ARROW1"), ("s.arrows", "beyond the end")] {
        let p = dir.join(name);
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
        let err = index(&dir).unwrap_err();
        assert!(err.contains(name) && err.contains(needle), "{err}");
        std::fs::remove_file(&p).unwrap();
    }
    std::fs::write(
        dir.join("j.feather"),
        b"{\"not\": \"arrow\"} and some more bytes",
    )
    .unwrap();
    let err = index(&dir).unwrap_err();
    assert!(
        err.contains("j.feather") && err.contains("malformed"),
        "{err}"
    );
    std::fs::write(dir.join("j.feather"), b"FEA1\0\0\0\0").unwrap();
    let err = index(&dir).unwrap_err();
    assert!(err.contains("Feather V1"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_fixed_size_list_of_size_zero_is_refused() {
    // Its rows take no bytes: a record batch of it could claim any row count (2^40) with
    // nothing behind it, and the manifest would list that many samples.
    let item = Arc::new(Field::new("item", DataType::Int8, false));
    let empty: ArrayRef = Arc::new(Int8Array::from(Vec::<i8>::new()));
    let v = FixedSizeListArray::try_new(item, 0, empty, None).unwrap();
    let schema = Schema::new(vec![Field::new("z", v.data_type().clone(), false)]);
    let batch = RecordBatch::try_new(Arc::new(schema), vec![Arc::new(v)]).unwrap();
    let (dir, err) = rejected("arrow-fsl0", "z.arrow", &[batch]);
    assert!(
        err.contains("column `z`") && err.contains("size 0"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stream_cut_between_record_batches_is_refused_not_read_as_fewer() {
    // Three record batches, cut at the start of the third (a whole message boundary) or
    // inside its length prefix: before, two shards and no word of the third.
    let dir = temp_dir("arrow-cut-stream");
    let p = dir.join("s.arrows");
    let batches = [sample_batch(0, 4), sample_batch(4, 4), sample_batch(8, 4)];
    write_stream(&p, &batches[..2]);
    let two = std::fs::read(&p).unwrap();
    write_stream(&p, &batches);
    let three = std::fs::read(&p).unwrap();
    // The first two batches' bytes are the same in both: the third starts where the EOS of
    // the two-batch stream did (8 bytes before its end).
    let third_at = two.len() - 8;
    for cut in [third_at, third_at + 2] {
        std::fs::write(&p, &three[..cut]).unwrap();
        let err = index(&dir).unwrap_err();
        assert!(
            err.contains("s.arrows") && err.contains("end-of-stream marker"),
            "cut at {cut}: {err}"
        );
    }
    std::fs::write(&p, &three).unwrap();
    assert_eq!(index(&dir).unwrap().shards.len(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn plan(name: &str, dtype: DType, levels: &[u64]) -> Slot {
    Slot::Column(ColumnPlan {
        name: name.into(),
        dtype,
        lists: vec![],
        levels: levels.to_vec(),
        dims: levels.to_vec(),
    })
}

/// A reader for layout tests, which must not read.
fn no_read(what: &str, _: u64, _: u64) -> Result<Vec<u8>, crate::IndexError> {
    panic!("unexpected read of {what}")
}

fn layout_err(r: Result<Vec<shardwire_protocol::manifest::TensorEntry>, BatchFail>) -> BatchErr {
    match r {
        Err(BatchFail::Layout(e)) => e,
        other => panic!("expected a layout error, got {other:?}"),
    }
}

#[test]
fn batch_layout_checks() {
    let plans = [
        plan("a", DType::Float32, &[]),
        plan("v", DType::Int16, &[2]),
    ];
    let good = BatchLayout {
        rows: 3,
        nodes: vec![(3, 0), (3, 0), (6, 0)],
        buffers: vec![(0, 0), (0, 16), (16, 0), (16, 0), (16, 16)],
        variadic: vec![],
        version: MetadataVersion::V5,
    };
    let t = batch_tensors(&plans, &good, 1000, 32, &mut no_read).unwrap();
    assert_eq!(
        (t[0].offset, t[0].length, t[0].shape.clone()),
        (1000, 12, vec![3])
    );
    assert_eq!(
        (t[1].offset, t[1].length, t[1].shape.clone()),
        (1016, 12, vec![3, 2])
    );

    let with = |f: &dyn Fn(&mut BatchLayout)| {
        let mut b = BatchLayout {
            rows: good.rows,
            nodes: good.nodes.clone(),
            buffers: good.buffers.clone(),
            variadic: good.variadic.clone(),
            version: good.version,
        };
        f(&mut b);
        layout_err(batch_tensors(&plans, &b, 1000, 32, &mut no_read))
    };
    let e = with(&|b| b.buffers[4] = (24, 16));
    assert!(
        e.0.as_deref() == Some("v") && e.1.contains("outside the record batch body"),
        "{e:?}"
    );
    let e = with(&|b| b.buffers[1] = (0, 8));
    assert!(
        e.0.as_deref() == Some("a") && e.1.contains("shorter"),
        "{e:?}"
    );
    let e = with(&|b| b.nodes[2] = (8, 0));
    assert!(
        e.0.as_deref() == Some("v") && e.1.contains("sliced") && e.2 == "length 8",
        "{e:?}"
    );
    let e = with(&|b| b.nodes[0] = (2, 0));
    assert!(e.1.contains("row count"), "{e:?}");
    let e = with(&|b| b.nodes.push((1, 0)));
    assert!(e.0.is_none() && e.1.contains("more field nodes"), "{e:?}");
    let e = with(&|b| {
        b.buffers.pop();
    });
    assert!(e.0.is_none() && e.1.contains("fewer buffers"), "{e:?}");
    let e = with(&|b| b.buffers[1] = (-8, 16));
    assert!(e.1.contains("invalid values buffer"), "{e:?}");
}
