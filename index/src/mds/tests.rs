//! Tests of the MDS indexer, on shards built by hand following Streaming's layout.

use std::path::Path;

use shardwire_protocol::manifest::{DType, Manifest, TensorEntry};

use crate::root::Root;
use crate::testutil::temp_dir;
use crate::{IndexError, IndexOptions, index_dir, index_report, index_root_within};

/// `(name, encoding, fixed size)`.
type Col = (&'static str, &'static str, Option<u64>);

const COLS: [Col; 4] = [
    ("blob", "bytes", None),
    ("id", "int64", Some(8)),
    ("txt", "str", None),
    ("x", "ndarray:float32:2,3", Some(24)),
];

/// An `.mds` file as `MDSWriter.encode_joint_shard` writes it: count, offsets, config,
/// samples (variable sizes first, then every column's bytes).
fn mds_file(cols: &[Col], samples: &[Vec<Vec<u8>>]) -> Vec<u8> {
    let config = br#"{"column_names":[]}"#;
    let bodies: Vec<Vec<u8>> = samples
        .iter()
        .map(|s| {
            let mut b = Vec::new();
            for (c, v) in cols.iter().zip(s) {
                if c.2.is_none() {
                    b.extend((v.len() as u32).to_le_bytes());
                }
            }
            for v in s {
                b.extend(v);
            }
            b
        })
        .collect();
    let mut out = (samples.len() as u32).to_le_bytes().to_vec();
    let mut off = 4 + 4 * (samples.len() as u32 + 1) + config.len() as u32;
    out.extend(off.to_le_bytes());
    for b in &bodies {
        off += b.len() as u32;
        out.extend(off.to_le_bytes());
    }
    out.extend(config);
    for b in bodies {
        out.extend(b);
    }
    out
}

/// One `shards` entry of an `index.json`.
fn shard_json(cols: &[Col], basename: &str, bytes: usize, samples: usize) -> String {
    let names: Vec<String> = cols.iter().map(|c| format!("\"{}\"", c.0)).collect();
    let encs: Vec<String> = cols.iter().map(|c| format!("\"{}\"", c.1)).collect();
    let sizes: Vec<String> = cols
        .iter()
        .map(|c| c.2.map_or("null".into(), |s| s.to_string()))
        .collect();
    format!(
        r#"{{"column_encodings": [{}], "column_names": [{}], "column_sizes": [{}],
        "compression": null, "format": "mds", "hashes": [],
        "raw_data": {{"basename": "{basename}", "bytes": {bytes}, "hashes": {{}}}},
        "samples": {samples}, "size_limit": 67108864, "version": 2, "zip_data": null}}"#,
        encs.join(", "),
        names.join(", "),
        sizes.join(", ")
    )
}

fn index_json(shards: &[String]) -> String {
    format!(r#"{{"version": 2, "shards": [{}]}}"#, shards.join(", "))
}

fn sample(i: usize) -> Vec<Vec<u8>> {
    let x: Vec<u8> = (0..6)
        .flat_map(|k| (i as f32 + k as f32).to_le_bytes())
        .collect();
    vec![
        vec![i as u8; i % 4],
        (i as i64 * 7).to_le_bytes().to_vec(),
        format!("sample {i}").into_bytes(),
        x,
    ]
}

/// Writes shards of `per` samples each under `dir/sub` with their `index.json`; returns the
/// samples.
fn write_dataset(dir: &Path, shards: usize, per: usize) -> Vec<Vec<Vec<u8>>> {
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let mut all = Vec::new();
    let mut entries = Vec::new();
    for s in 0..shards {
        let samples: Vec<_> = (s * per..(s + 1) * per).map(sample).collect();
        let file = mds_file(&COLS, &samples);
        let name = format!("shard.{s:05}.mds");
        std::fs::write(sub.join(&name), &file).unwrap();
        entries.push(shard_json(&COLS, &name, file.len(), per));
        all.extend(samples);
    }
    std::fs::write(sub.join("index.json"), index_json(&entries)).unwrap();
    all
}

fn gather(file: &[u8], t: &TensorEntry) -> Vec<Vec<u8>> {
    let rows = t.rows.as_ref().expect("a row table");
    rows.iter()
        .map(|&[o, l]| file[o as usize..(o + l) as usize].to_vec())
        .collect()
}

fn tensor<'m>(m: &'m Manifest, shard: usize, name: &str) -> &'m TensorEntry {
    let t = m.shards[shard].tensors.iter().find(|t| t.name == name);
    t.unwrap_or_else(|| panic!("no tensor `{name}`"))
}

fn index_err(dir: &Path) -> String {
    index_dir(dir, &IndexOptions::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn fixed_variable_and_ndarray_columns_byte_exact() {
    let dir = temp_dir("mds-basic");
    let samples = write_dataset(&dir, 3, 5);
    let r = index_report(&dir, &IndexOptions::default()).unwrap();
    assert!(r.unused.is_empty(), "{:?}", r.unused);
    let m = &r.manifest;
    let files: Vec<&str> = m.shards.iter().map(|s| s.file.as_str()).collect();
    assert_eq!(
        files,
        [
            "sub/shard.00000.mds",
            "sub/shard.00001.mds",
            "sub/shard.00002.mds"
        ]
    );
    let id = tensor(m, 0, "id");
    assert_eq!(
        (id.dtype, id.shape.clone(), id.ragged),
        (DType::Int64, vec![5], false)
    );
    let x = tensor(m, 0, "x");
    assert_eq!(
        (x.dtype, x.shape.clone(), x.ragged),
        (DType::Float32, vec![5, 2, 3], false)
    );
    for name in ["blob", "txt"] {
        let t = tensor(m, 0, name);
        assert!(t.ragged && t.dtype == DType::Uint8, "{t:?}");
    }
    let names: Vec<&str> = m.shards[0]
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(names, ["blob", "id", "txt", "x"]);
    for (s, shard) in m.shards.iter().enumerate() {
        let file = std::fs::read(dir.join(&shard.file)).unwrap();
        assert_eq!((shard.offset, shard.length), (0, file.len() as u64));
        for (c, col) in COLS.iter().enumerate() {
            let got = gather(&file, tensor(m, s, col.0));
            let want: Vec<Vec<u8>> = samples[s * 5..(s + 1) * 5]
                .iter()
                .map(|x| x[c].clone())
                .collect();
            assert_eq!(got, want, "shard {s} column {}", col.0);
        }
    }
    m.validate().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dynamic_ndarray_is_ragged_and_int_is_int64() {
    let dir = temp_dir("mds-dyn");
    let cols: [Col; 2] = [("a", "ndarray:float32", None), ("n", "int", Some(8))];
    let samples: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|i| {
            vec![
                vec![34, 1 << 2, 0, 1, 2, 3][..2 + i].to_vec(),
                (i as i64).to_le_bytes().to_vec(),
            ]
        })
        .collect();
    let file = mds_file(&cols, &samples);
    std::fs::write(dir.join("shard.00000.mds"), &file).unwrap();
    let entry = shard_json(&cols, "shard.00000.mds", file.len(), 3);
    std::fs::write(dir.join("index.json"), index_json(&[entry])).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    let a = tensor(&m, 0, "a");
    assert!(a.ragged && a.shape == [2 + 3 + 4], "{a:?}");
    assert_eq!(tensor(&m, 0, "n").dtype, DType::Int64);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compression_is_refused_naming_the_shard_and_the_fix() {
    let dir = temp_dir("mds-zstd");
    let entry = shard_json(&COLS, "shard.00000.mds", 10, 1)
        .replace(r#""compression": null"#, r#""compression": "zstd""#)
        .replace(
            r#""zip_data": null"#,
            r#""zip_data": {"basename": "shard.00000.mds.zstd", "bytes": 5, "hashes": {}}"#,
        );
    std::fs::write(dir.join("shard.00000.mds.zstd"), b"zzzzz").unwrap();
    std::fs::write(dir.join("index.json"), index_json(&[entry])).unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("shard.00000.mds.zstd")
            && err.contains("zstd")
            && err.contains("compression=None"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stray_mds_is_reported_unused_and_index_json_is_used() {
    let dir = temp_dir("mds-stray");
    write_dataset(&dir, 1, 2);
    let file = mds_file(&COLS, &[sample(0)]);
    std::fs::write(dir.join("sub/extra.mds"), &file).unwrap();
    std::fs::write(dir.join("lonely.mds"), &file).unwrap();
    let r = index_report(&dir, &IndexOptions::default()).unwrap();
    let unused: Vec<(&str, &str)> = r
        .unused
        .iter()
        .map(|u| (u.file.as_str(), u.reason.as_str()))
        .collect();
    assert_eq!(
        unused,
        [
            ("lonely.mds", "MDS shard with no index.json next to it"),
            ("sub/extra.mds", "MDS shard not listed in sub/index.json"),
        ]
    );
    assert_eq!(r.manifest.shards.len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn size_and_count_mismatches_are_refused() {
    let dir = temp_dir("mds-bad");
    write_dataset(&dir, 1, 2);
    let path = dir.join("sub/shard.00000.mds");
    let mut file = std::fs::read(&path).unwrap();
    file.push(0);
    std::fs::write(&path, &file).unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("shard.00000.mds") && err.contains("raw_data.bytes"),
        "{err}"
    );
    // A truncated file whose index agrees: the samples lie outside it.
    file.truncate(file.len() - 10);
    let entry = shard_json(&COLS, "shard.00000.mds", file.len(), 2);
    std::fs::write(&path, &file).unwrap();
    std::fs::write(dir.join("sub/index.json"), index_json(&[entry])).unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("malformed") && err.contains("sample 1"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn other_json_is_unused_and_disagreeing_columns_are_refused() {
    let dir = temp_dir("mds-cols");
    write_dataset(&dir, 2, 2);
    std::fs::write(dir.join("index.json"), b"[1, 2]").unwrap();
    let r = index_report(&dir, &IndexOptions::default()).unwrap();
    assert_eq!(r.unused.len(), 1);
    assert!(
        r.unused[0]
            .reason
            .contains("not a MosaicML Streaming index")
    );
    let text = std::fs::read_to_string(dir.join("sub/index.json")).unwrap();
    let second = text.rfind("\"txt\"").unwrap();
    let text = format!("{}\"tx2\"{}", &text[..second], &text[second + 5..]);
    std::fs::write(dir.join("sub/index.json"), text).unwrap();
    let err = index_err(&dir);
    assert!(err.contains("other columns than shard 0"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_listed_shard_that_is_not_found_is_refused_naming_it() {
    let dir = temp_dir("mds-missing");
    write_dataset(&dir, 3, 2);
    std::fs::remove_file(dir.join("sub/shard.00001.mds")).unwrap();
    // Before, the two found were indexed and the missing one left out without a word.
    let err = index_err(&dir);
    assert!(
        err.contains("sub/index.json")
            && err.contains("lists 1 shard(s) that are not .mds files")
            && err.contains("sub/shard.00001.mds"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fixed_column_sizes_that_overflow_are_refused_as_malformed() {
    let dir = temp_dir("mds-overflow");
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let cols: [Col; 2] = [("a", "bytes", Some(u64::MAX)), ("b", "bytes", Some(9))];
    let file = mds_file(&cols, &[vec![vec![1u8; 4], vec![2u8; 4]]]);
    std::fs::write(sub.join("s.mds"), &file).unwrap();
    let entry = shard_json(&cols, "s.mds", file.len(), 1);
    std::fs::write(sub.join("index.json"), index_json(&[entry])).unwrap();
    // It overflowed (a panic with overflow checks on, an invalid manifest without).
    let err = index_err(&dir);
    assert!(
        err.contains("malformed") && err.contains("do not add up"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_merged_top_index_and_the_sub_index_list_one_shard_once() {
    // Streaming's merge_index: `index.json` lists `sub/shard.00000.mds` beside `sub/index.json`
    // listing `shard.00000.mds`. Before, the two plans differed in their `index` field and
    // the dataset was refused as "listed differently".
    let dir = temp_dir("mds-merged");
    let all = write_dataset(&dir, 2, 3);
    let sub = std::fs::read_to_string(dir.join("sub/index.json")).unwrap();
    let top = sub.replace("\"basename\": \"shard.", "\"basename\": \"sub/shard.");
    assert_ne!(top, sub);
    std::fs::write(dir.join("index.json"), &top).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    assert_eq!(m.shards.len(), 2);
    let rows: usize = (0..2)
        .map(|s| tensor(&m, s, "id").rows.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(rows, all.len());
    // The two still must agree: another sample count is refused, naming both indexes.
    let wrong = top.replacen("\"samples\": 3", "\"samples\": 2", 1);
    std::fs::write(dir.join("index.json"), wrong).unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("listed differently by") && err.contains("sub/index.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_truncated_index_beside_its_shards_is_an_error_with_the_parse_position() {
    let dir = temp_dir("mds-truncated");
    write_dataset(&dir, 1, 2);
    let text = std::fs::read(dir.join("sub/index.json")).unwrap();
    std::fs::write(dir.join("sub/index.json"), &text[..text.len() / 2]).unwrap();
    // Before: the index "not a Streaming index" and its shard "with no index.json next to
    // it", both unused, and the error "no data files found".
    let err = index_err(&dir);
    assert!(
        err.contains("sub/index.json") && err.contains("not valid JSON") && err.contains("line"),
        "{err}"
    );
    // Broken JSON with no shards beside it is only named unused, with the parse error.
    std::fs::write(dir.join("index.json"), b"{\"version\": ").unwrap();
    std::fs::write(dir.join("sub/index.json"), &text).unwrap();
    let r = index_report(&dir, &IndexOptions::default()).unwrap();
    assert_eq!(r.unused.len(), 1, "{:?}", r.unused);
    assert_eq!(r.unused[0].file, "index.json");
    assert!(
        r.unused[0].reason.starts_with("not valid JSON ("),
        "{:?}",
        r.unused
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A LitData chunk as `litdata.streaming.writer.BinaryWriter` writes it: a `u32` item count
/// `n`, `n + 1` `u32` offsets from the file start, then the items' bytes.
fn litdata_chunk(items: &[&[u8]]) -> Vec<u8> {
    let n = items.len() as u32;
    let mut at = 4 * (n + 2);
    let mut out = n.to_le_bytes().to_vec();
    out.extend(at.to_le_bytes());
    for item in items {
        at += item.len() as u32;
        out.extend(at.to_le_bytes());
    }
    for item in items {
        out.extend_from_slice(item);
    }
    out
}

#[test]
fn litdata_optimize_output_is_refused_not_read_as_raw_bin() {
    // Before, index.json was named unused and chunk-0-0.bin indexed as raw bytes (with
    // --tokens, its header read as tokens).
    let dir = temp_dir("mds-litdata");
    let index = r#"{"chunks": [{"chunk_bytes": 12, "chunk_size": 2, "dim": null,
        "filename": "chunk-0-0.bin"}], "config": {"chunk_bytes": 67108864, "chunk_size": null,
        "compression": null, "data_format": ["bytes"], "data_spec": "[1, {}]",
        "encryption": null, "item_loader": "PyTreeLoader"}, "updated_at": "1700000000.0"}"#;
    std::fs::write(dir.join("index.json"), index).unwrap();
    let chunk = litdata_chunk(&[&b"hello!"[..], &b"world!"[..]]);
    std::fs::write(dir.join("chunk-0-0.bin"), chunk).unwrap();
    let err = index_err(&dir);
    for want in [
        "index.json",
        "LitData optimize()",
        "chunk-0-0.bin",
        "the data it was made from",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    let tokens = IndexOptions {
        tokens: Some(crate::RawTokens::new(DType::Uint16, None).unwrap()),
        ..IndexOptions::default()
    };
    let err = index_dir(&dir, &tokens).unwrap_err().to_string();
    assert!(err.contains("LitData"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn zero_byte_columns_are_empty_ragged_tensors_and_too_many_columns_are_refused() {
    // Streaming writes `column_sizes` 0 for `ndarray:uint8:0`; the commit before refused
    // such a dataset. It is served again, as an empty ragged tensor, its rows counted from the
    // sample count like every column's (so they cannot take more memory than the manifest
    // holds); and a shard of more than 4096 columns is refused before it is read.
    let dir = temp_dir("mds-zero");
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let cols: [Col; 2] = [("a", "bytes", None), ("z", "ndarray:uint8:0", Some(0))];
    let samples = [
        vec![vec![1u8; 4], Vec::new()],
        vec![vec![2u8; 3], Vec::new()],
    ];
    let file = mds_file(&cols, &samples);
    std::fs::write(sub.join("s.mds"), &file).unwrap();
    let entry = shard_json(&cols, "s.mds", file.len(), 2);
    std::fs::write(sub.join("index.json"), index_json(&[entry])).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    let z = tensor(&m, 0, "z");
    assert!(z.ragged && z.length == 0 && z.shape == [0], "{z:?}");
    assert_eq!(gather(&file, z), [Vec::<u8>::new(), Vec::new()]);
    let a = gather(&file, tensor(&m, 0, "a"));
    assert_eq!(a, [vec![1u8; 4], vec![2u8; 3]]);
    // 1000 samples claimed of the zero-byte column alone: refused from the count.
    let n = 1000usize;
    let mut file = (n as u32).to_le_bytes().to_vec();
    file.resize(4 + 4 * (n + 1), 0);
    std::fs::write(sub.join("s.mds"), &file).unwrap();
    let entry = shard_json(&cols[1..], "s.mds", file.len(), n);
    std::fs::write(sub.join("index.json"), index_json(&[entry])).unwrap();
    let mut root = Root::Local(dir.clone());
    let e = index_root_within(&mut root, &IndexOptions::default(), 4_000).unwrap_err();
    let IndexError::ManifestTooLarge { rows, at, .. } = &e else {
        panic!("{e:?}");
    };
    assert_eq!(*rows, 1000, "{e}");
    assert!(at.contains("1000 samples of 1 columns"), "{e}");
    let names: Vec<&'static str> = (0..4097)
        .map(|i| &*Box::leak(format!("c{i}").into_boxed_str()))
        .collect();
    let wide: Vec<Col> = names.iter().map(|&n| (n, "int8", Some(1))).collect();
    let file = mds_file(&wide, &[vec![vec![7u8]; 4097]]);
    std::fs::write(sub.join("s.mds"), &file).unwrap();
    let entry = shard_json(&wide, "s.mds", file.len(), 1);
    std::fs::write(sub.join("index.json"), index_json(&[entry])).unwrap();
    let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
    assert!(matches!(err, IndexError::Unsupported { .. }), "{err:?}");
    let text = err.to_string();
    for want in ["sub/index.json", "4097 columns", "4096 tensors"] {
        assert!(text.contains(want), "{want}: {text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn too_many_rows_are_refused_from_the_sample_count_before_they_are_read() {
    // Before, each sample's sizes were read and a row built per sample and column, and only
    // then counted: here the offset table is all zeros, which only reading it finds.
    let dir = temp_dir("mds-budget");
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let n = 1000usize;
    let mut file = (n as u32).to_le_bytes().to_vec();
    file.resize(4 + 4 * (n + 1), 0);
    std::fs::write(sub.join("s.mds"), &file).unwrap();
    let entry = shard_json(&COLS, "s.mds", file.len(), n);
    std::fs::write(sub.join("index.json"), index_json(&[entry])).unwrap();
    let mut root = Root::Local(dir.clone());
    let e = index_root_within(&mut root, &IndexOptions::default(), 10_000).unwrap_err();
    let IndexError::ManifestTooLarge { rows, at, .. } = &e else {
        panic!("{e:?}");
    };
    assert_eq!(*rows, 4000, "{e}");
    assert!(
        at.contains("sub/s.mds") && at.contains("1000 samples of 4 columns"),
        "{e}"
    );
    // Under the real limit the offsets are read, and refused.
    assert!(index_err(&dir).contains("sample 0 lies outside"));
    std::fs::remove_dir_all(&dir).unwrap();
}
