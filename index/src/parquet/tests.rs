//! Parquet conversion: the manifest of a converted file holds the Parquet file's values,
//! the cache is reused while the file is unchanged and rebuilt when it changes.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ::parquet::arrow::ArrowWriter;
use ::parquet::basic::{Compression, ZstdLevel};
use ::parquet::file::properties::WriterProperties;
use arrow_array::types::Float32Type;
use arrow_array::{ArrayRef, FixedSizeListArray, Int64Array, RecordBatch, StringArray};

use super::{
    BATCH_LIMIT, BatchLimit, CACHE_DIR, MAX_BATCH_ROWS, Planned, cache_error, convert,
    convert_from, plan_batches, temp_error, utc,
};
use crate::testutil::{check_manifest, le_bytes, temp_dir};
use crate::{BatchAt, IndexError, IndexOptions, IndexReport, index_report};

/// Rows `0..n`: `id` = i, `emb` = [i, i + 0.5, -i], `text` = "row i" repeated i % 3 times.
fn rows(n: i64) -> RecordBatch {
    let ids = Int64Array::from_iter_values(0..n);
    let emb = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
        (0..n).map(|i| Some([Some(i as f32), Some(i as f32 + 0.5), Some(-(i as f32))])),
        3,
    );
    let text =
        StringArray::from_iter_values((0..n).map(|i| format!("row {i}").repeat(i as usize % 3)));
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("id", Arc::new(ids)),
        ("emb", Arc::new(emb)),
        ("text", Arc::new(text)),
    ];
    RecordBatch::try_from_iter(cols).unwrap()
}

/// The bytes each tensor of [`rows`] must hold, concatenated over shards.
fn expected(n: i64) -> Vec<(&'static str, Vec<u8>)> {
    let ids: Vec<i64> = (0..n).collect();
    let emb: Vec<f32> = (0..n)
        .flat_map(|i| [i as f32, i as f32 + 0.5, -(i as f32)])
        .collect();
    let text: Vec<u8> = (0..n)
        .flat_map(|i| format!("row {i}").repeat(i as usize % 3).into_bytes())
        .collect();
    vec![
        ("id", le_bytes(&ids, i64::to_le_bytes)),
        ("emb", le_bytes(&emb, f32::to_le_bytes)),
        ("text", text),
    ]
}

fn write_parquet(path: &Path, batch: &RecordBatch, group_rows: usize, codec: Compression) {
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(group_rows))
        .set_compression(codec)
        .build();
    let f = std::fs::File::create(path).unwrap();
    let mut w = ArrowWriter::try_new(f, batch.schema(), Some(props)).unwrap();
    w.write(batch).unwrap();
    w.close().unwrap();
}

fn index(dir: &Path) -> IndexReport {
    index_report(dir, &IndexOptions::default()).unwrap()
}

#[test]
fn converts_once_reuses_and_reconverts_when_changed() {
    let dir = temp_dir("parquet-cache");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let src = dir.join("data/a.parquet");
    write_parquet(&src, &rows(10), 4, Compression::SNAPPY);
    let cache = format!("{CACHE_DIR}/data/a.parquet.arrow");

    let r = index(&dir);
    let m = &r.manifest;
    assert_eq!(
        m.shards.len(),
        3,
        "one shard per row group (4 + 4 + 2 rows)"
    );
    assert!(m.shards.iter().all(|s| s.file == cache), "{:?}", m.shards);
    check_manifest(&dir, m, &expected(10));
    let notes = r.notes();
    assert_eq!(
        notes[0],
        format!("parquet: data/a.parquet -> {cache} (converted, 3 row groups)")
    );
    assert!(dir.join(format!("{cache}.json")).is_file());

    let again = index(&dir);
    assert!(again.parquet[0].reused, "{:?}", again.parquet);
    assert!(again.notes()[0].contains("(reused, 3 row groups, unchanged since "));
    assert_eq!(again.manifest.digest, m.digest);

    // Rewritten with other rows and touched: converted again.
    write_parquet(&src, &rows(7), 7, Compression::ZSTD(ZstdLevel::default()));
    let later = SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&src)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let r = index(&dir);
    assert!(!r.parquet[0].reused);
    assert_eq!(r.manifest.shards.len(), 1);
    check_manifest(&dir, &r.manifest, &expected(7));

    // Touched only (same bytes, new mtime): converted again, same manifest.
    let touched = later + Duration::from_secs(5);
    let f = std::fs::File::options().write(true).open(&src).unwrap();
    f.set_modified(touched).unwrap();
    let r2 = index(&dir);
    assert!(!r2.parquet[0].reused);
    assert_eq!(r2.manifest.digest, r.manifest.digest);
    let names: Vec<_> = std::fs::read_dir(dir.join(CACHE_DIR).join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "cache + sidecar, no temporary file: {names:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gzip_and_lz4_read_and_a_damaged_sidecar_converts_again() {
    let dir = temp_dir("parquet-codecs");
    let gz = ::parquet::basic::GzipLevel::default();
    write_parquet(&dir.join("g.parquet"), &rows(5), 2, Compression::GZIP(gz));
    write_parquet(&dir.join("l.parquet"), &rows(5), 5, Compression::LZ4_RAW);
    let r = index(&dir);
    assert_eq!(r.manifest.shards.len(), 4);
    let mut want = expected(5);
    for (_, bytes) in &mut want {
        *bytes = bytes.repeat(2);
    }
    check_manifest(&dir, &r.manifest, &want);
    std::fs::write(
        dir.join(format!("{CACHE_DIR}/g.parquet.arrow.json")),
        b"{oops",
    )
    .unwrap();
    let r = index(&dir);
    assert_eq!(
        r.parquet.iter().map(|p| p.reused).collect::<Vec<_>>(),
        [false, true]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_parquet_is_an_error_naming_the_file() {
    let dir = temp_dir("parquet-bad");
    std::fs::write(dir.join("x.parquet"), b"PAR1 not really").unwrap();
    let err = index_report(&dir, &IndexOptions::default()).unwrap_err();
    assert!(matches!(err, IndexError::Parquet { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("x.parquet") && msg.contains("Parquet"),
        "{msg}"
    );
    assert!(!dir.join(format!("{CACHE_DIR}/x.parquet.arrow")).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn empty_parquet_holds_no_rows() {
    let dir = temp_dir("parquet-empty");
    write_parquet(&dir.join("e.parquet"), &rows(0), 4, Compression::SNAPPY);
    std::fs::write(dir.join("x.bin"), [1u8]).unwrap();
    let r = index(&dir);
    assert_eq!(r.unused[0].file, "e.parquet");
    assert_eq!(r.unused[0].reason, "holds no rows");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn utc_dates() {
    assert_eq!(utc(0), "1970-01-01T00:00:00Z");
    assert_eq!(utc(1_764_602_513_000_000_000), "2025-12-01T15:21:53Z");
    assert_eq!(utc(951_782_400_000_000_000), "2000-02-29T00:00:00Z");
}

#[test]
fn a_row_group_with_a_negative_row_count_is_refused() {
    // The footer rewritten with row group 1's `num_rows` = -1 (the data pages as written).
    // Before, the count read as 0 and the row group was skipped without a word.
    use ::parquet::file::metadata::{ParquetMetaDataReader, ParquetMetaDataWriter};
    let dir = temp_dir("parquet-negative-rows");
    let p = dir.join("t.parquet");
    write_parquet(&p, &rows(20), 10, Compression::UNCOMPRESSED);
    let bytes = std::fs::read(&p).unwrap();
    let meta = ParquetMetaDataReader::new()
        .parse_and_finish(&bytes::Bytes::from(bytes.clone()))
        .unwrap();
    let mut groups = meta.row_groups().to_vec();
    assert_eq!(groups.len(), 2);
    groups[1] = groups[1]
        .clone()
        .into_builder()
        .set_num_rows(-1)
        .build()
        .unwrap();
    let bad = meta.into_builder().set_row_groups(groups).build();
    let footer_len =
        u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let mut out = bytes[..bytes.len() - 8 - footer_len as usize].to_vec();
    ParquetMetaDataWriter::new(&mut out, &bad).finish().unwrap();
    std::fs::write(&p, &out).unwrap();
    let e = index_report(&dir, &IndexOptions::default()).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("t.parquet") && text.contains("row group 1") && text.contains("negative"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cache_that_cannot_be_written_is_an_error_naming_it_and_the_fix() {
    // Before, a bare `DIR/.shardwire-cache/parquet: Permission denied (os error 13)` (or
    // `Not a directory`), with no word of what the folder is or what to do.
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("parquet-unwritable");
    write_parquet(&dir.join("a.parquet"), &rows(4), 4, Compression::SNAPPY);
    // A file in the cache's way: refused whoever runs the test.
    std::fs::write(dir.join(".shardwire-cache"), b"").unwrap();
    let e = index_report(&dir, &IndexOptions::default()).unwrap_err();
    assert!(matches!(e, IndexError::ParquetCache { .. }), "{e:?}");
    let text = e.to_string();
    for want in [
        CACHE_DIR,
        "cannot write the Parquet cache",
        "beside the data",
        "in its way",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    // A read-only folder (not for root, who may write it anyway).
    std::fs::remove_file(dir.join(".shardwire-cache")).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let writable = std::fs::write(dir.join("probe"), b"").is_ok();
    let r = index_report(&dir, &IndexOptions::default());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    if !writable {
        let text = r.unwrap_err().to_string();
        for want in ["Permission denied", "must be writable", "writable copy"] {
            assert!(text.contains(want), "{want}: {text}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cache_io_errors_get_the_advice_for_their_kind_whoever_runs_the_test() {
    // Synthetic errors, so the read-only and full-disk paths are checked under root too.
    // Before, an I/O error inside the Arrow writer (`ArrowWrite`, e.g. ENOSPC while a batch
    // was flushed) came back as it was, without the "free space" advice.
    use std::io::{Error, ErrorKind};
    let cache_dir = Path::new("/data/ds").join(CACHE_DIR);
    let file = cache_dir.join("a.parquet.arrow");
    let io = |source: Error| IndexError::io(&file, source);
    let arrow = |source: Error| IndexError::ArrowWrite {
        file: file.clone(),
        source: arrow_schema::ArrowError::IoError(source.to_string(), source),
    };
    let enospc = || Error::from_raw_os_error(28);
    assert_eq!(enospc().kind(), ErrorKind::StorageFull);
    let writable = "must be writable";
    let space = "free space";
    let cases = [
        (io(ErrorKind::PermissionDenied.into()), writable),
        (io(ErrorKind::ReadOnlyFilesystem.into()), writable),
        (io(enospc()), space),
        (arrow(enospc()), space),
        (arrow(Error::from_raw_os_error(122)), space), // EDQUOT
        (io(ErrorKind::FileTooLarge.into()), space),
        (arrow(ErrorKind::PermissionDenied.into()), writable),
        (io(ErrorKind::NotADirectory.into()), "in its way"),
    ];
    for (e, want) in cases {
        let what = format!("{e:?}");
        let e = cache_error(&cache_dir, e);
        assert!(
            matches!(e, IndexError::ParquetCache { .. }),
            "{what}: {e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains(want) && text.contains(CACHE_DIR),
            "{what}: {text}"
        );
    }
    // Outside the cache, and an Arrow error that is not I/O: passed on unchanged.
    let outside = cache_error(&cache_dir, IndexError::io("/data/a.parquet", enospc()));
    assert!(matches!(outside, IndexError::Io { .. }), "{outside:?}");
    let schema = IndexError::ArrowWrite {
        file: file.clone(),
        source: arrow_schema::ArrowError::SchemaError("x".into()),
    };
    let schema = cache_error(&cache_dir, schema);
    assert!(
        matches!(schema, IndexError::ArrowWrite { .. }),
        "{schema:?}"
    );
}

/// The row counts of the record batches of the Arrow IPC file `path`.
fn batch_rows(path: &Path) -> Vec<usize> {
    let f = std::fs::File::open(path).unwrap();
    let r = arrow_ipc::reader::FileReader::try_new(f, None).unwrap();
    r.map(|b| b.unwrap().num_rows()).collect()
}

#[test]
fn batches_are_cut_by_bytes_as_well_as_rows() {
    // Before, a row group was cut at 65,536 rows whatever their size: 64 Ki rows of 256 KiB
    // images made one 16 GiB batch, held in memory whole.
    let plan = plan_batches(&[(1 << 20, 256 << 30)], BATCH_LIMIT);
    assert_eq!(plan.len(), 2048);
    assert!(
        plan.iter().all(|p| p.group == 0 && p.rows == 512),
        "{plan:?}"
    );
    assert_eq!(plan[1].first, 512);
    // Small rows: by rows only; an empty group gives none, and the groups keep their index.
    let plan = plan_batches(
        &[(0, 5), (70_000, 560_000), (3, 1 << 40), (10, -1)],
        BATCH_LIMIT,
    );
    let want = [
        (1, 0, MAX_BATCH_ROWS as u64),
        (1, 65_536, 4_464),
        (2, 0, 1),
        (2, 1, 1),
        (2, 2, 1),
        (3, 0, 10),
    ];
    let got: Vec<(usize, u64, u64)> = plan.iter().map(|p| (p.group, p.first, p.rows)).collect();
    assert_eq!(got, want);
    // A real file converted under a small byte limit is cut as planned, rows all there.
    let dir = temp_dir("parquet-bytes");
    let src = dir.join("t.parquet");
    write_parquet(&src, &rows(100), 100, Compression::SNAPPY);
    let bytes = std::fs::read(&src).unwrap();
    let meta = ::parquet::file::metadata::ParquetMetaDataReader::new()
        .parse_and_finish(&bytes::Bytes::from(bytes))
        .unwrap();
    let group = (100, meta.row_group(0).total_byte_size());
    let limit = BatchLimit {
        rows: MAX_BATCH_ROWS,
        bytes: group.1 as u64 / 4,
    };
    let plan = plan_batches(&[group], limit);
    assert!(plan.len() >= 4, "{plan:?}");
    let dst = dir.join("t.arrow");
    let open = || Ok(std::fs::File::open(&src).unwrap());
    convert_from(open, &src, &dst, limit).unwrap();
    let want: Vec<usize> = plan.iter().map(|p: &Planned| p.rows as usize).collect();
    assert_eq!(batch_rows(&dst), want);
    assert_eq!(want.iter().sum::<usize>(), 100);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_parquet_file_is_read_through_one_handle_even_when_replaced() {
    // Before, each row group reopened the path: a file replaced meanwhile (`mv`) was read
    // with the old footer and the new pages.
    let dir = temp_dir("parquet-one-handle");
    let path = dir.join("a.parquet");
    write_parquet(&path, &rows(10), 4, Compression::SNAPPY);
    let file = std::fs::File::open(&path).unwrap();
    let other = dir.join("b.parquet");
    write_parquet(&other, &rows(3), 3, Compression::SNAPPY);
    std::fs::rename(&other, &path).unwrap();
    let dst = dir.join("a.arrow");
    let (groups, _) = convert(&file, &path, &dst).unwrap();
    assert_eq!(groups, 3);
    assert_eq!(batch_rows(&dst), [4, 4, 2]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_column_error_names_the_parquet_file_and_row_group_not_the_cache() {
    // Row group 0 of 70,000 rows is two batches (65,536 + 4,464); the null is in row 5 of
    // row group 1, the third batch. Before: `DIR/.shardwire-cache/parquet/x.parquet.arrow:
    // record batch 2: column `v` ...`, a file and a number the user's file does not have.
    let dir = temp_dir("parquet-null-row-group");
    let vals: Int64Array = (0..70_010i64).map(|i| (i != 70_005).then_some(i)).collect();
    let batch = RecordBatch::try_from_iter([("v", Arc::new(vals) as ArrayRef)]).unwrap();
    write_parquet(&dir.join("x.parquet"), &batch, 70_000, Compression::SNAPPY);
    let want = format!(
        "{}: row group 1 (its rows 0..10): column `v`",
        dir.join("x.parquet").display()
    );
    for pass in ["converted", "reused"] {
        let e = index_report(&dir, &IndexOptions::default()).unwrap_err();
        let at = BatchAt::RowGroup {
            group: 1,
            first: 0,
            rows: 10,
        };
        assert!(
            matches!(&e, IndexError::Column { batch: Some(b), .. } if **b == at),
            "{pass}: {e:?}"
        );
        let text = e.to_string();
        assert!(text.starts_with(&want), "{pass}: {text}");
        assert!(
            text.contains("nulls") && !text.contains(CACHE_DIR),
            "{pass}: {text}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_damaged_cache_is_named_not_the_parquet_file() {
    // The cache's trailer overwritten, its size kept (so the sidecar still matches and it is
    // reused). Before: `DIR/a.parquet: Arrow IPC file does not end with the ARROW1 magic`,
    // of a file pyarrow reads fine, while the cache, the file to delete, went unnamed.
    let dir = temp_dir("parquet-damaged-cache");
    write_parquet(&dir.join("a.parquet"), &rows(10), 4, Compression::SNAPPY);
    index(&dir);
    let cache = dir.join(CACHE_DIR).join("a.parquet.arrow");
    let mut bytes = std::fs::read(&cache).unwrap();
    let n = bytes.len();
    bytes[n - 6..].copy_from_slice(b"XXXXXX");
    std::fs::write(&cache, &bytes).unwrap();
    let e = index_report(&dir, &IndexOptions::default()).unwrap_err();
    assert!(
        matches!(&e, IndexError::Malformed { file, .. } if *file == cache),
        "{e:?}"
    );
    assert!(e.to_string().contains("ARROW1"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_full_temporary_folder_in_a_remote_conversion_says_so_and_names_tmpdir() {
    // Before, a bare `ArrowWrite` on /tmp/shardwire-index-parquet-*/converted.arrow: no word
    // of what the file is, nor of TMPDIR.
    use std::io::{Error, ErrorKind};
    let tmp = Path::new("/tmp/shardwire-index-parquet-1-0");
    let file = tmp.join("converted.arrow");
    let enospc = || Error::from_raw_os_error(28);
    let arrow = IndexError::ArrowWrite {
        file: file.clone(),
        source: arrow_schema::ArrowError::IoError("x".into(), enospc()),
    };
    let cases = [
        (arrow, "free space in the temporary folder"),
        (IndexError::io(&file, enospc()), "TMPDIR="),
        (
            IndexError::io(tmp, ErrorKind::PermissionDenied.into()),
            "writable",
        ),
    ];
    for (e, want) in cases {
        let e = temp_error(tmp, e);
        assert!(matches!(e, IndexError::ParquetTemp { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains(want) && text.contains("TMPDIR") && text.contains(tmp.to_str().unwrap()),
            "{want}: {text}"
        );
    }
    // A read error of the Parquet object itself is passed on unchanged.
    let other = temp_error(tmp, IndexError::io("/data/a.parquet", enospc()));
    assert!(matches!(other, IndexError::Io { .. }), "{other:?}");
}
