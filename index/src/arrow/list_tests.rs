//! Tests for list, string and binary columns, column choice and the index report, with
//! files written by arrow-rs's IPC writers (and hand-made bodies for offsets that do not
//! start at 0, which arrow-rs's writer never produces).

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt8Builder};
use arrow_array::types::{Float32Type, Int32Type};
use arrow_array::{
    ArrayRef, BooleanArray, DictionaryArray, Int32Array, LargeBinaryArray, LargeListArray,
    ListArray, RecordBatch, StringArray,
};
use arrow_ipc::MetadataVersion;
use arrow_schema::{Field, Schema};
use shardwire_protocol::manifest::{DType, Manifest, TensorEntry};

use super::batch::batch_tensors;
use super::body::{BatchFail, BatchLayout};
use super::layout::{ColumnPlan, ListLevel, Slot};
use super::tests::{index, rejected, struct_list, write_file, write_stream};
use crate::testutil::{check_manifest, le_bytes, temp_dir};
use crate::{IndexOptions, IndexReport, index_report};

fn batch(cols: Vec<(&str, ArrayRef)>) -> RecordBatch {
    let fields: Vec<Field> = cols
        .iter()
        .map(|(n, c)| Field::new(*n, c.data_type().clone(), true))
        .collect();
    let arrays = cols.into_iter().map(|(_, c)| c).collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap()
}

/// The rows of every ragged tensor `name`, in shard order, read from the files.
fn ragged_rows(dir: &Path, m: &Manifest, name: &str) -> Vec<Vec<u8>> {
    m.validate().unwrap();
    let mut out = Vec::new();
    for s in &m.shards {
        let file = std::fs::read(dir.join(&s.file)).unwrap();
        for t in s.tensors.iter().filter(|t| t.name == name) {
            assert!(t.ragged, "{t:?} is not ragged");
            let rows = t.rows.as_ref().unwrap();
            assert_eq!(t.offset, s.offset + rows[0][0], "offset of {t:?}");
            for &[o, l] in rows {
                let at = (s.offset + o) as usize;
                out.push(file[at..at + l as usize].to_vec());
            }
        }
    }
    out
}

fn tensor<'a>(m: &'a Manifest, shard: usize, name: &str) -> &'a TensorEntry {
    let t = m.shards[shard].tensors.iter().find(|t| t.name == name);
    t.unwrap_or_else(|| panic!("no tensor {name} in shard {shard}"))
}

fn u8_lists(rows: &[&[&[u8]]]) -> ArrayRef {
    let mut b = ListBuilder::new(ListBuilder::new(UInt8Builder::new()));
    for row in rows {
        for inner in *row {
            b.values().values().append_slice(inner);
            b.values().append(true);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn report(dir: &Path, opts: &IndexOptions) -> Result<IndexReport, String> {
    index_report(dir, opts).map_err(|e| e.to_string())
}

#[test]
fn list_int32_of_a_sliced_batch_is_ragged_and_byte_exact() {
    let rows = [vec![1, 2, 3], vec![], vec![4], vec![5, 6, 7, 8], vec![9]];
    let list = ListArray::from_iter_primitive::<Int32Type, _, _>(
        rows.iter().map(|r| Some(r.iter().map(|&v| Some(v)))),
    );
    let dir = temp_dir("list-int32");
    let b = batch(vec![("seq", Arc::new(list))]);
    write_file(&dir.join("l.arrow"), &[b.slice(1, 4)]);
    let m = index(&dir).unwrap();
    let t = tensor(&m, 0, "seq");
    assert_eq!(
        (t.dtype, t.shape.clone(), t.length),
        (DType::Int32, vec![6], 24)
    );
    let want: Vec<Vec<u8>> = rows[1..5]
        .iter()
        .map(|r| le_bytes(r, i32::to_le_bytes))
        .collect();
    assert_eq!(ragged_rows(&dir, &m, "seq"), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn large_list_float32_utf8_and_large_binary_rows_are_byte_exact() {
    let floats = [vec![0.5f32, -1.0], vec![2.25], vec![3.0, 4.0, 5.0]];
    let large = LargeListArray::from_iter_primitive::<Float32Type, _, _>(
        floats.iter().map(|r| Some(r.iter().map(|&v| Some(v)))),
    );
    let text = StringArray::from(vec!["héllo", "", "wörld!"]);
    let blobs: [&[u8]; 3] = [b"\x00\x01", b"\xff", b""];
    let bin = LargeBinaryArray::from_iter_values(blobs);
    let dir = temp_dir("list-large");
    let b = batch(vec![
        ("f", Arc::new(large)),
        ("text", Arc::new(text)),
        ("blob", Arc::new(bin)),
    ]);
    write_stream(&dir.join("s.arrows"), &[b]);
    let m = index(&dir).unwrap();
    let want: Vec<Vec<u8>> = floats
        .iter()
        .map(|r| le_bytes(r, f32::to_le_bytes))
        .collect();
    assert_eq!(ragged_rows(&dir, &m, "f"), want);
    assert_eq!(tensor(&m, 0, "f").shape, [6]);
    let words: Vec<Vec<u8>> = ["héllo", "", "wörld!"]
        .iter()
        .map(|w| w.as_bytes().to_vec())
        .collect();
    assert_eq!(ragged_rows(&dir, &m, "text"), words);
    assert_eq!(tensor(&m, 0, "text").dtype, DType::Uint8);
    let want: Vec<Vec<u8>> = blobs.iter().map(|b| b.to_vec()).collect();
    assert_eq!(ragged_rows(&dir, &m, "blob"), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nested_uniform_lists_are_dense_and_non_uniform_ragged() {
    let dir = temp_dir("list-nested");
    let uniform = u8_lists(&[&[&[1, 2, 3], &[4, 5, 6]], &[&[7, 8, 9], &[10, 11, 12]]]);
    write_file(&dir.join("u.arrow"), &[batch(vec![("img", uniform)])]);
    let m = index(&dir).unwrap();
    let t = tensor(&m, 0, "img");
    assert!(!t.ragged && t.rows.is_none(), "{t:?}");
    assert_eq!((t.dtype, t.shape.clone()), (DType::Uint8, vec![2, 2, 3]));
    check_manifest(&dir, &m, &[("img", (1..=12).collect())]);
    std::fs::remove_file(dir.join("u.arrow")).unwrap();

    let uneven = u8_lists(&[&[&[1, 2], &[3, 4]], &[&[5, 6, 7]]]);
    write_file(&dir.join("n.arrow"), &[batch(vec![("img", uneven)])]);
    let m = index(&dir).unwrap();
    assert_eq!(tensor(&m, 0, "img").shape, [7]);
    assert_eq!(
        ragged_rows(&dir, &m, "img"),
        [vec![1, 2, 3, 4], vec![5, 6, 7]]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nested_lists_with_shapes_differing_between_shards_are_ragged_in_all() {
    let dir = temp_dir("list-nested-shards");
    let a = batch(vec![("img", u8_lists(&[&[&[1, 2], &[3, 4]]]))]);
    let b = batch(vec![("img", u8_lists(&[&[&[5, 6, 7]]]))]);
    write_file(&dir.join("h.arrow"), &[a.clone(), b]);
    let m = index(&dir).unwrap();
    assert!(m.shards.iter().all(|s| s.tensors[0].ragged), "{m:?}");
    assert_eq!(
        ragged_rows(&dir, &m, "img"),
        [vec![1, 2, 3, 4], vec![5, 6, 7]]
    );
    // The same inner shape in every shard stays dense.
    write_file(&dir.join("h.arrow"), &[a.clone(), a]);
    let m = index(&dir).unwrap();
    assert!(
        m.shards.iter().all(|s| s.tensors[0].shape == [1, 2, 2]),
        "{m:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nulls_in_list_and_string_columns_are_refused_naming_the_column() {
    let null_row =
        ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1)]), None]);
    let null_item =
        ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1), None])]);
    let cases: [(&str, &str, ArrayRef, &str); 3] = [
        ("list-null", "seq", Arc::new(null_row), "1 nulls"),
        (
            "list-null-item",
            "seq",
            Arc::new(null_item),
            "list values has 1 nulls",
        ),
        (
            "str-null",
            "text",
            Arc::new(StringArray::from(vec![Some("a"), None])),
            "1 nulls",
        ),
    ];
    for (tag, column, array, want) in cases {
        let (dir, err) = rejected(tag, "n.arrow", &[batch(vec![(column, array)])]);
        assert!(
            err.contains(&format!("column `{column}`")) && err.contains(want),
            "{tag}: {err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn list_plan() -> Vec<Slot> {
    vec![Slot::Column(ColumnPlan {
        name: "seq".into(),
        dtype: DType::Int32,
        lists: vec![ListLevel {
            large: false,
            bytes: false,
        }],
        levels: vec![],
        dims: vec![],
    })]
}

/// A hand-made body: offsets `offs` (int32) at 0, then ten int32 values at 16.
fn body_with(offs: [i32; 3]) -> (BatchLayout, Vec<u8>) {
    let mut body = le_bytes(&offs, i32::to_le_bytes);
    body.resize(16, 0);
    body.extend(le_bytes(
        &(100..110).collect::<Vec<i32>>(),
        i32::to_le_bytes,
    ));
    let layout = BatchLayout {
        rows: 2,
        nodes: vec![(2, 0), (10, 0)],
        buffers: vec![(0, 0), (0, 16), (16, 0), (16, 40)],
        variadic: vec![],
        version: MetadataVersion::V5,
    };
    (layout, body)
}

#[test]
fn offsets_that_do_not_start_at_zero_give_the_right_rows() {
    let (layout, body) = body_with([3, 5, 9]);
    let mut read =
        |_: &str, off: u64, len: u64| Ok(body[off as usize..(off + len) as usize].to_vec());
    let t = batch_tensors(&list_plan(), &layout, 1000, 56, &mut read).unwrap();
    let t = &t[0];
    // Row 0 is values 3..5 (bytes 16 + 12), row 1 values 5..9.
    assert_eq!(t.rows.as_deref(), Some(&[[28, 8], [36, 16]][..]));
    assert_eq!((t.offset, t.length, t.shape.clone()), (1028, 24, vec![6]));

    let (layout, body) = body_with([3, 2, 9]);
    let mut read =
        |_: &str, off: u64, len: u64| Ok(body[off as usize..(off + len) as usize].to_vec());
    match batch_tensors(&list_plan(), &layout, 1000, 56, &mut read) {
        Err(BatchFail::Layout((Some(c), reason, value))) => {
            assert_eq!(c, "seq");
            assert!(
                reason.contains("decreasing") && value.contains("offset 2"),
                "{reason} {value}"
            );
        }
        other => panic!("decreasing offsets accepted: {other:?}"),
    }
    let (layout, body) = body_with([0, 5, 11]);
    let mut read =
        |_: &str, off: u64, len: u64| Ok(body[off as usize..(off + len) as usize].to_vec());
    let e = batch_tensors(&list_plan(), &layout, 1000, 56, &mut read).unwrap_err();
    assert!(format!("{e:?}").contains("fewer than the 11"), "{e:?}");
}

/// A file with an int32 column `n` between unsupported ones.
fn mixed_batch() -> RecordBatch {
    batch(vec![
        ("flag", Arc::new(BooleanArray::from(vec![true, false]))),
        ("n", Arc::new(Int32Array::from(vec![7, -8]))),
        ("meta", struct_list()),
        (
            "cat",
            Arc::new(DictionaryArray::<Int32Type>::from_iter(["x", "y"])),
        ),
    ])
}

#[test]
fn columns_option_keeps_only_the_named_columns_or_names_the_unknown_one() {
    let dir = temp_dir("cols");
    write_stream(&dir.join("m.arrows"), &[mixed_batch()]);
    let opts = |c: &[&str]| IndexOptions {
        columns: Some(c.iter().map(|s| s.to_string()).collect()),
        ..IndexOptions::default()
    };
    let r = report(&dir, &opts(&["n"])).unwrap();
    let names: Vec<&str> = r.manifest.shards[0]
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(names, ["n"]);
    assert!(r.skipped.is_empty(), "{:?}", r.skipped);
    check_manifest(
        &dir,
        &r.manifest,
        &[("n", le_bytes(&[7i32, -8], i32::to_le_bytes))],
    );
    let err = report(&dir, &opts(&["n", "label"])).unwrap_err();
    assert!(
        err.contains("m.arrows")
            && err.contains("`label`")
            && err.contains("available: flag, n, meta, cat"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skip_unsupported_names_each_skipped_column_and_type() {
    let dir = temp_dir("skip");
    write_stream(&dir.join("a.arrows"), &[mixed_batch()]);
    write_file(&dir.join("b.arrow"), &[mixed_batch()]);
    let err = report(&dir, &IndexOptions::default()).unwrap_err();
    assert!(
        err.contains("column `flag`") && err.contains("--skip-unsupported"),
        "{err}"
    );
    let opts = IndexOptions {
        skip_unsupported: true,
        ..IndexOptions::default()
    };
    let r = report(&dir, &opts).unwrap();
    assert_eq!(r.manifest.shards.len(), 2);
    let n = le_bytes(&[7i32, -8, 7, -8], i32::to_le_bytes);
    check_manifest(&dir, &r.manifest, &[("n", n)]);
    let skipped: Vec<(&str, &str, usize)> = r
        .skipped
        .iter()
        .map(|c| (c.column.as_str(), c.dtype.as_str(), c.files.len()))
        .collect();
    assert_eq!(
        skipped,
        [
            ("flag", "bool", 2),
            ("meta", "list<item: struct<a: int64>>", 2),
            (
                "cat",
                "dictionary<values=string, indices=int32, ordered=0>",
                2
            ),
        ]
    );
    let notes = r.notes();
    assert!(
        notes
            .iter()
            .any(|l| l.starts_with("skipped unsupported: 3 columns: flag (bool, 2 files)")),
        "{notes:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_report_lists_every_unused_file_with_its_reason() {
    let dir = temp_dir("unused");
    std::fs::write(dir.join("data.bin"), [1u8, 2]).unwrap();
    for f in [
        "notes.txt",
        "data.zip",
        "dataset_info.json",
        "state.json",
        "x.orc",
        "y.mds",
        ".hidden.txt",
    ] {
        let json = f.ends_with(".json");
        std::fs::write(dir.join(f), if json { &b"{}"[..] } else { b"x" }).unwrap();
    }
    let none = batch(vec![("n", Arc::new(Int32Array::from(Vec::<i32>::new())))]);
    write_file(&dir.join("empty.arrow"), &[none]);
    let r = report(&dir, &IndexOptions::default()).unwrap();
    let unused: Vec<(&str, &str)> = r
        .unused
        .iter()
        .map(|u| (u.file.as_str(), u.reason.as_str()))
        .collect();
    assert_eq!(
        unused,
        [
            ("data.zip", "unknown extension .zip"),
            ("dataset_info.json", "HF datasets metadata"),
            ("empty.arrow", "holds no rows"),
            ("notes.txt", "unknown extension .txt"),
            ("state.json", "HF datasets metadata"),
            ("x.orc", "unknown extension .orc"),
            ("y.mds", "MDS shard with no index.json next to it"),
        ]
    );
    assert_eq!(
        r.notes(),
        [
            "not used: 7 files: data.zip (unknown extension .zip), dataset_info.json (HF datasets metadata), \
          empty.arrow (holds no rows), notes.txt (unknown extension .txt), state.json (HF datasets metadata), \
          and 2 more"
        ]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nested_fixed_size_lists_whose_element_size_overflows_are_refused() {
    // list<fixed_size_list<fixed_size_list<fixed_size_list<int32>[2^31]>[2^31]>[2^31]>, two
    // empty rows: before, the element size (2^93 x 4 bytes) was multiplied unchecked (a
    // panic in debug builds, a wrapped size in release).
    let big = 1u64 << 31;
    let plan = vec![Slot::Column(ColumnPlan {
        name: "seq".into(),
        dtype: DType::Int32,
        lists: vec![ListLevel {
            large: false,
            bytes: false,
        }],
        levels: vec![big; 3],
        dims: vec![big; 3],
    })];
    let mut body = le_bytes(&[0i32, 0, 0], i32::to_le_bytes);
    body.resize(16, 0);
    let layout = BatchLayout {
        rows: 2,
        nodes: vec![(2, 0), (0, 0), (0, 0), (0, 0), (0, 0)],
        buffers: vec![(0, 0), (0, 16), (16, 0), (16, 0), (16, 0), (16, 0), (16, 0)],
        variadic: vec![],
        version: MetadataVersion::V5,
    };
    let mut read =
        |_: &str, off: u64, len: u64| Ok(body[off as usize..(off + len) as usize].to_vec());
    match batch_tensors(&plan, &layout, 1000, 16, &mut read) {
        Err(BatchFail::Layout((Some(c), reason, _))) => {
            assert_eq!(c, "seq");
            assert!(reason.contains("overflows"), "{reason}");
        }
        other => panic!("an overflowing element size was accepted: {other:?}"),
    }
}
