//! The remote reading path over object_store's `InMemory` (pure logic: listing rules,
//! structure reads through the extent cache, planned CRC passes, If-Match): a dataset indexed
//! from the store must give the shards its local copy gives. Real S3 (requests, ranges,
//! counts, credentials) is tested end to end against moto: tests/e2e/test_index_s3.py.

use std::sync::Arc;

use bytes::Bytes;
use object_store::memory::InMemory;
use shardwire_store::{Blocking, Described, Store, StoreErrorKind, StoreOptions, StoreUrl};

use super::Remote;
use crate::testutil::temp_dir;
use crate::{Dataset, IndexError, IndexOptions, index_dir};

fn described() -> Described {
    Described::plain("memory", "memory")
}

/// A `.npy` 1.0 file of `n` float32 values.
fn npy(n: usize) -> Vec<u8> {
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({n},), }}");
    while !(10 + dict.len() + 1).is_multiple_of(64) {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((dict.len() as u16).to_le_bytes());
    out.extend(dict.as_bytes());
    out.extend((0..n).flat_map(|i| (i as f32 * 0.5).to_le_bytes()));
    out
}

/// A WebDataset tar of `n` samples with a `txt` and a `cls` member each, of varied sizes.
fn tar(n: usize) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for i in 0..n {
        for (field, len) in [("txt", 100 + i * 37 % 3000), ("cls", 1 + i % 7)] {
            let data: Vec<u8> = (0..len).map(|k| (k * 31 + i) as u8).collect();
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("s{i:05}.{field}"), data.as_slice())
                .unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// The files of the test dataset.
fn files() -> Vec<(&'static str, Vec<u8>)> {
    let big: Vec<u8> = (0..(5u32 << 19) + 3)
        .map(|i| (i ^ (i >> 7)) as u8)
        .collect();
    vec![
        ("x.npy", npy(70_000)),
        ("sub/big.bin", big),
        ("w.tar", tar(400)),
        ("notes.txt", b"not data".to_vec()),
        (".hidden/skip.bin", vec![1, 2, 3]),
    ]
}

/// `files` in a temporary directory and in an `InMemory` store under `ds/`; the store's
/// handle and the listed prefix.
fn dataset(name: &str, request_size: u64) -> (std::path::PathBuf, Blocking, Remote) {
    let dir = temp_dir(name);
    let url = StoreUrl::parse(&format!("s3://{name}/ds")).unwrap();
    let opts = StoreOptions {
        request_size,
        ..Default::default()
    };
    let store = Store::with_object_store(&url, opts, Arc::new(InMemory::new()), described());
    let store = Blocking::new(store).unwrap();
    for (rel, data) in files() {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &data).unwrap();
        store.put(rel, Bytes::from(data)).unwrap();
    }
    let remote = Remote::with_store(store.clone()).unwrap();
    (dir, store, remote)
}

#[test]
fn a_store_gives_the_shards_of_its_local_copy_and_lists_its_objects() {
    let (dir, store, remote) = dataset("remote-same", 256 << 10);
    let local = index_dir(&dir, &IndexOptions::default()).unwrap();
    let mut ds = Dataset::remote(remote);
    let report = ds.index(&IndexOptions::default()).unwrap();
    let m = &report.manifest;
    assert_eq!(
        m.shards, local.shards,
        "same shards, offsets, CRCs and tensors"
    );
    assert_ne!(m.digest, local.digest, "the objects are in the digest");
    let unused: Vec<&str> = report.unused.iter().map(|u| u.file.as_str()).collect();
    assert_eq!(unused, ["notes.txt"]);
    let files: Vec<&str> = m.objects.iter().map(|o| o.file.as_str()).collect();
    assert_eq!(files, ["sub/big.bin", "w.tar", "x.npy"]);
    for o in &m.objects {
        let head = store.head(&o.file).unwrap();
        assert_eq!((o.size, &o.etag), (head.size, &head.etag));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_changed_object_is_named_not_mixed_in() {
    let (dir, store, remote) = dataset("remote-changed", 256 << 10);
    // Rewritten after the listing: every GET carries the listed ETag, so the store refuses.
    store.put("w.tar", Bytes::from(tar(3))).unwrap();
    let err = Dataset::remote(remote)
        .index(&IndexOptions::default())
        .unwrap_err();
    match &err {
        IndexError::Store(e) => assert_eq!(e.kind(), StoreErrorKind::Changed, "{err}"),
        other => panic!("not a store error: {other}"),
    }
    assert!(err.to_string().contains("key ds/w.tar"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_empty_prefix_is_named() {
    let url = StoreUrl::parse("s3://remote-empty/nothing/here").unwrap();
    let store = Store::with_object_store(
        &url,
        StoreOptions::default(),
        Arc::new(InMemory::new()),
        described(),
    );
    let err = Remote::with_store(Blocking::new(store).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("s3://remote-empty/nothing/here: no objects"),
        "{err}"
    );
}

#[test]
fn blob_reads_and_checksums_match_the_bytes_under_any_read_order() {
    use crate::blob::Blob;
    let (dir, _store, remote) = dataset("remote-blob", 64 << 10);
    let data = files()
        .into_iter()
        .find(|f| f.0 == "sub/big.bin")
        .unwrap()
        .1;
    let len = data.len() as u64;
    let meta = remote.meta("sub/big.bin").unwrap().clone();
    let crc = shardwire_protocol::crc::crc32c;
    // Footer first, then a sequential scan with small reads and gaps, then jumps back:
    // extents grow, are evicted (a 128 KiB budget), and the in-order CRC still covers it all.
    let mut reads: Vec<(u64, u64)> = vec![(len - 10, 10), (len - 5000, 4990)];
    reads.extend((0..len - 100).step_by(3001).map(|o| (o, 100)));
    reads.extend([(5, 70_000), (1 << 20, 200_000), (len / 2, 1)]);
    let mut blob = super::RemoteBlob::new(remote.object(&meta));
    for &(o, l) in &reads {
        let mut buf = vec![0u8; l as usize];
        blob.read_at(o, &mut buf).unwrap();
        assert!(buf == data[o as usize..(o + l) as usize], "read {o}+{l}");
    }
    let ranges = [
        (0, len),
        (3, 100_000),
        (len - 70_000, 70_000),
        (200_000, 900_000),
    ];
    let got = blob.crc32c(&ranges).unwrap();
    let want: Vec<u32> = ranges
        .iter()
        .map(|&(o, l)| crc(&data[o as usize..(o + l) as usize]))
        .collect();
    assert_eq!(got, want);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Parquet file of one int64 column `v` = `0..n`.
fn parquet(n: i64) -> Vec<u8> {
    use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    let v: ArrayRef = Arc::new(Int64Array::from_iter_values(0..n));
    let batch = RecordBatch::try_from_iter([("v", v)]).unwrap();
    let mut out = Vec::new();
    let mut w = ::parquet::arrow::ArrowWriter::try_new(&mut out, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    out
}

#[test]
fn a_converted_parquet_object_is_listed_in_the_objects_with_its_etag() {
    // Before, only the converted cache was listed: the manifest did not record which
    // Parquet object (size, ETag) its shards were converted from. (A changed object was
    // converted again at the next index, as it still is; no source compares these entries.)
    let url = StoreUrl::parse("s3://remote-parquet/ds").unwrap();
    let opts = StoreOptions::default();
    let store = Store::with_object_store(&url, opts, Arc::new(InMemory::new()), described());
    let store = Blocking::new(store).unwrap();
    store.put("a.parquet", Bytes::from(parquet(10))).unwrap();
    let index = || {
        let remote = Remote::with_store(store.clone()).unwrap();
        Dataset::remote(remote)
            .index(&IndexOptions::default())
            .unwrap()
    };
    let r = index();
    let m = &r.manifest;
    let files: Vec<&str> = m.objects.iter().map(|o| o.file.as_str()).collect();
    assert_eq!(
        files,
        [".shardwire-cache/parquet/a.parquet.arrow", "a.parquet"]
    );
    let head = store.head("a.parquet").unwrap();
    assert_eq!(
        (m.objects[1].size, &m.objects[1].etag),
        (head.size, &head.etag)
    );
    assert!(head.etag.is_some());
    m.validate().unwrap();
    let again = index();
    assert!(again.parquet[0].reused, "{:?}", again.parquet);
    assert_eq!(again.manifest.digest, m.digest);
    // Uploaded again: converted again, and its entry (so the digest) says so.
    store.put("a.parquet", Bytes::from(parquet(7))).unwrap();
    let changed = index();
    assert!(!changed.parquet[0].reused);
    let head = store.head("a.parquet").unwrap();
    let o = changed.manifest.object("a.parquet").unwrap();
    assert_eq!((o.size, &o.etag), (head.size, &head.etag));
    assert_ne!(changed.manifest.digest, m.digest);
}

#[test]
fn a_damaged_cache_object_is_named_not_the_parquet_object() {
    // The cached object uploaded again damaged, its size kept (the sidecar still matches: it
    // is reused). Before, the error named the Parquet object, which reads fine.
    let url = StoreUrl::parse("s3://remote-parquet-damaged/ds").unwrap();
    let opts = StoreOptions::default();
    let store = Store::with_object_store(&url, opts, Arc::new(InMemory::new()), described());
    let store = Blocking::new(store).unwrap();
    store.put("a.parquet", Bytes::from(parquet(10))).unwrap();
    let index = || {
        let remote = Remote::with_store(store.clone()).unwrap();
        Dataset::remote(remote).index(&IndexOptions::default())
    };
    index().unwrap();
    let cache = ".shardwire-cache/parquet/a.parquet.arrow";
    let size = store.head(cache).unwrap().size;
    let mut bytes = store.read(cache, 0..size, None).unwrap().to_vec();
    let n = bytes.len();
    bytes[n - 6..].copy_from_slice(b"XXXXXX");
    store.put(cache, Bytes::from(bytes)).unwrap();
    let e = index().unwrap_err();
    let named = Remote::with_store(store.clone()).unwrap().display(cache);
    assert!(
        matches!(&e, IndexError::Malformed { file, .. } if *file == named),
        "{e:?}"
    );
}
