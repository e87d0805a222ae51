//! Tests of hand-edited Arrow files: footers that list a record batch twice or out of order,
//! streams with data after their end marker, and files of more rows than a manifest holds
//! (refused as their record batches are planned, not once the whole file is, and before a
//! row table the manifest cannot hold is built).

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt8Builder};
use arrow_array::{ArrayRef, RecordBatch, StringArray};

use super::tests::{index, write_file, write_stream};
use crate::budget::{HEAD_FLOOR, ragged_floor, shard_floor, tensor_floor};
use crate::root::Root;
use crate::testutil::temp_dir;
use crate::{IndexError, IndexOptions, index_dir, index_root_within};

/// A batch of `n` rows of two string columns `s` and `t`, from row `start`.
fn strings(start: usize, n: usize) -> RecordBatch {
    let col = |p: &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(
            (start..start + n).map(|i| format!("{p}{i}")),
        ))
    };
    RecordBatch::try_from_iter([("s", col("s")), ("t", col("t"))]).unwrap()
}

/// The raw 24-byte blocks of the record batches the footer of the file `bytes` lists, and
/// where the footer starts.
fn blocks(bytes: &[u8]) -> (Vec<[u8; 24]>, usize) {
    let len = bytes.len();
    let footer_len = i32::from_le_bytes(bytes[len - 10..len - 6].try_into().unwrap()) as usize;
    let start = len - 10 - footer_len;
    let footer = arrow_ipc::root_as_footer(&bytes[start..len - 10]).unwrap();
    let list = footer.recordBatches().unwrap();
    (list.iter().map(|b| b.0).collect(), start)
}

/// Writes `bytes` with the footer's block `from` put where block `to` is.
fn with_block(path: &Path, bytes: &[u8], from: usize, to: usize) {
    let (list, footer) = blocks(bytes);
    let at = footer
        + bytes[footer..]
            .windows(24)
            .position(|w| w == list[to])
            .unwrap();
    let mut edited = bytes.to_vec();
    edited[at..at + 24].copy_from_slice(&list[from]);
    std::fs::write(path, edited).unwrap();
}

#[test]
fn a_footer_that_lists_a_record_batch_twice_or_out_of_order_is_refused() {
    // Before, each block was planned as listed: one batch listed twice was served twice (and
    // a footer listing it a million times built a row table for each, until out of memory).
    let dir = temp_dir("arrow-footer-twice");
    let path = dir.join("a.arrow");
    write_file(&path, &[strings(0, 10), strings(10, 10)]);
    let good = std::fs::read(&path).unwrap();
    assert_eq!(index(&dir).unwrap().shards.len(), 2);
    with_block(&path, &good, 0, 1);
    let e = index(&dir).unwrap_err();
    for want in ["a.arrow", "record batch 1", "twice", "offset"] {
        assert!(e.contains(want), "{want}: {e}");
    }
    // Swapped: block 1 put in block 0's place, then block 0 in the second place.
    let (list, footer) = blocks(&good);
    with_block(&path, &good, 1, 0);
    let mut swapped = std::fs::read(&path).unwrap();
    let second = swapped[footer..].windows(24).rposition(|w| w == list[1]);
    let at = footer + second.unwrap();
    swapped[at..at + 24].copy_from_slice(&list[0]);
    std::fs::write(&path, swapped).unwrap();
    let e = index(&dir).unwrap_err();
    assert!(
        e.contains("record batch 1") && e.contains("out of order"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rows_are_counted_as_each_column_of_each_record_batch_is_planned() {
    // Before, a file's rows were counted once all its row tables were built: here 6000
    // rows, where the refusal comes at 2000 (within the first batch) or 3000.
    let dir = temp_dir("arrow-budget");
    let batches = [strings(0, 1000), strings(1000, 1000), strings(2000, 1000)];
    write_file(&dir.join("a.arrow"), &batches);
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    let t = |shard: usize, col: usize| tensor_floor(&m.shards[shard].tensors[col]).bytes;
    let first = shard_floor(&m.shards[0]).bytes;
    for (limit, rows, batch) in [
        (HEAD_FLOOR + t(0, 0) + 5, 2000, 0),
        (HEAD_FLOOR + first + t(1, 0) - 1, 3000, 1),
    ] {
        let mut root = Root::Local(dir.clone());
        let e = index_root_within(&mut root, &IndexOptions::default(), limit).unwrap_err();
        let IndexError::ManifestTooLarge { rows: got, at, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*got, rows, "{e}");
        let want = format!("a.arrow, while planning its record batch {batch}");
        assert!(at.contains(&want), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_row_table_is_checked_before_it_is_built_a_dense_column_has_none() {
    // Before, a string column's row table (16 bytes a row in memory) was built and only then
    // counted: a 400 MB stream of 100M empty strings took 1.6 GB before it was refused.
    let dir = temp_dir("arrow-budget-before");
    let n = 1000;
    // `img`: n rows of [[0]], one inner shape (a dense tensor, no rows); `s`: n empty strings.
    let mut img = ListBuilder::new(ListBuilder::new(UInt8Builder::new()));
    for _ in 0..n {
        img.values().values().append_value(0);
        img.values().append(true);
        img.append(true);
    }
    let img: ArrayRef = Arc::new(img.finish());
    let s: ArrayRef = Arc::new(StringArray::from_iter_values((0..n).map(|_| "")));
    let batch = RecordBatch::try_from_iter([("img", img), ("s", s)]).unwrap();
    write_file(&dir.join("a.arrow"), &[batch]);
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    let shard = &m.shards[0];
    assert!(
        shard.tensors[0].rows.is_none() && shard.tensors[1].ragged,
        "{shard:?}"
    );
    let opts = IndexOptions::default();
    // At exactly the manifest's floor: served (the dense column is not checked as n rows).
    let fits = HEAD_FLOOR + shard_floor(shard).bytes;
    index_root_within(&mut Root::Local(dir.clone()), &opts, fits).unwrap();
    // Short of `img` and n rows of `s` (each at least `[0,0]`): refused before s's table.
    let img_floor = tensor_floor(&shard.tensors[0]).bytes;
    let before = HEAD_FLOOR + img_floor + ragged_floor("s", n, 0).bytes - 1;
    let e = index_root_within(&mut Root::Local(dir.clone()), &opts, before).unwrap_err();
    let IndexError::ManifestTooLarge { rows, at, .. } = &e else {
        panic!("{e:?}");
    };
    assert_eq!(*rows, n, "{e}");
    let want = "a.arrow, while planning its record batch 0: column s, before building its";
    assert!(at.contains(&format!("{want} {n} rows")), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn data_after_a_streams_end_marker_is_refused_zero_padding_is_not() {
    // Before, `cat a.arrows b.arrows` indexed a's rows only, without a word.
    let dir = temp_dir("arrow-stream-concat");
    let (a, b) = (dir.join("a.arrows"), dir.join("b.arrows"));
    write_stream(&a, &[strings(0, 5)]);
    write_stream(&b, &[strings(5, 5)]);
    let (first, second) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    std::fs::remove_file(&b).unwrap();
    let mut padded = first.clone();
    padded.extend([0u8; 100]);
    std::fs::write(&a, &padded).unwrap();
    assert_eq!(index(&dir).unwrap().shards.len(), 1);
    let mut cat = first.clone();
    cat.extend(&second);
    std::fs::write(&a, &cat).unwrap();
    let e = index(&dir).unwrap_err();
    for want in [
        "a.arrows",
        "concatenated",
        &format!("{} bytes after the marker at {}", second.len(), first.len()),
        &format!("the first non-zero at {}", first.len()),
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
