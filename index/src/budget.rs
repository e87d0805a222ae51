//! [`Budget`]: an early check that the manifest will fit the one frame it travels to nodes
//! in ([`MAX_MANIFEST_BYTES`]).
//!
//! A manifest lists every row of a row table as a JSON `[offset, length]` pair, so a dataset
//! of millions of rows (Megatron sequences, `--eos` documents, WebDataset members, MDS
//! samples) makes a manifest too large to send, however few its shards. The JSON size is
//! only known once every file has been read and checksummed (for an object store: every GET
//! paid), so each file's shards add a lower bound of their JSON size here as soon as they
//! are planned, before the file's data is read; the dataset is refused as soon as the bound
//! passes the limit, with the row count and what to do about it. The rows of a `--eos` token
//! file are found only by reading it: they are checked as it is read
//! ([`Budget::check_more`]), so a file of too many documents is not read to its end.
//!
//! A file's row tables can take far more memory than the file (16 bytes a row, per column;
//! Arrow columns may share one offsets buffer, an MDS column may hold 0 bytes a sample), so
//! the readers also count each file's rows as they plan them ([`FileCheck`]): per record
//! batch column (from its row count, before its row table is built), per MDS shard (from its
//! sample count), per Megatron index (from its header), and refuse the file before more rows
//! are built than a manifest can hold.

use std::path::Path;

use shardwire_protocol::manifest::{MAX_MANIFEST_BYTES, ShardEntry, TensorEntry};

use crate::error::IndexError;

/// Least bytes of the manifest's own fields:
/// `{"format":1,"digest":"<64 hex>","total_bytes":0,"shards":[]}` and its newline.
pub(crate) const HEAD_FLOOR: u64 = 117;
/// Least bytes of a shard besides its file name and tensors:
/// `{"file":"","offset":0,"length":0,"crc32c":0,"tensors":[]}`.
const SHARD_FLOOR: u64 = 57;
/// Least bytes of a tensor besides its name and row table:
/// `{"name":"","dtype":"int8","shape":[],"offset":0,"length":0}`.
const TENSOR_FLOOR: u64 = 59;
/// Least bytes of a row table besides its rows: `,"rows":[]`.
const ROWS_FLOOR: u64 = 10;

/// The manifest limit this build sends (the default of [`Budget::new`]).
pub(crate) const LIMIT: u64 = MAX_MANIFEST_BYTES as u64;

/// Where a file's rows come from, for the advice when there are too many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowKind {
    /// Sequences of a Megatron `.bin/.idx` pair.
    Megatron,
    /// Documents of a `--tokens` file (with `--eos`).
    Tokens,
    /// Samples: WebDataset members, MDS samples, Arrow list or string values.
    Samples,
    /// Not known (the manifest as written).
    Any,
}

/// A lower bound of the manifest bytes of some shards or rows: all of them, the part that
/// row tables take, and the rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Floor {
    pub bytes: u64,
    pub row_bytes: u64,
    pub rows: u64,
}

impl Floor {
    /// Both together.
    pub fn plus(self, other: Floor) -> Floor {
        Floor {
            bytes: self.bytes.saturating_add(other.bytes),
            row_bytes: self.row_bytes.saturating_add(other.row_bytes),
            rows: self.rows.saturating_add(other.rows),
        }
    }
}

/// A lower bound of the manifest's JSON size, added up shard by shard, against a limit.
#[derive(Clone, Debug)]
pub(crate) struct Budget {
    limit: u64,
    bytes: u64,
    /// The part of `bytes` that row tables take.
    row_bytes: u64,
    shards: u64,
    /// Rows by [`RowKind`] (in its order).
    rows: [u64; 4],
}

impl Budget {
    /// An empty budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            bytes: HEAD_FLOOR,
            row_bytes: 0,
            shards: 0,
            rows: [0; 4],
        }
    }

    /// Adds the `shards` of the file `rel` (rows of `kind`), before its data is read;
    /// an error once the manifest cannot fit the limit.
    pub fn add(
        &mut self,
        shards: &[ShardEntry],
        kind: RowKind,
        dir: &Path,
        rel: &str,
    ) -> Result<(), IndexError> {
        for s in shards {
            self.count(shard_floor(s), kind, 1);
        }
        if self.bytes <= self.limit {
            return Ok(());
        }
        let at = format!(" (counted up to {rel}, before its data was read)");
        Err(self.error(dir, self.bytes, at))
    }

    /// Checks, without adding them, that `more` bytes of `shards` more shards (rows of `kind`)
    /// would still fit: the rows found so far in a file being read. `at` says where
    /// (` (counted up to FILE, ...)`).
    pub fn check_more(
        &self,
        more: Floor,
        shards: u64,
        kind: RowKind,
        dir: &Path,
        at: impl FnOnce() -> String,
    ) -> Result<(), IndexError> {
        if self.bytes.saturating_add(more.bytes) <= self.limit {
            return Ok(());
        }
        let mut with = self.clone();
        with.count(more, kind, shards);
        Err(with.error(dir, with.bytes, at()))
    }

    /// Adds `floor`, the floor of `shards` shards of rows of `kind`.
    fn count(&mut self, floor: Floor, kind: RowKind, shards: u64) {
        self.bytes = self.bytes.saturating_add(floor.bytes);
        self.row_bytes = self.row_bytes.saturating_add(floor.row_bytes);
        self.rows[kind as usize] += floor.rows;
        self.shards += shards;
    }

    /// The error for a manifest of at least `bytes` bytes; `at` says where it was found.
    fn error(&self, dir: &Path, bytes: u64, at: String) -> IndexError {
        IndexError::ManifestTooLarge {
            dir: dir.to_path_buf(),
            bytes,
            at,
            limit: self.limit,
            shards: self.shards,
            rows: self.rows.iter().sum(),
            fix: self.fix().to_owned(),
        }
    }

    /// What to do: fewer shards when they take most of the bytes, else fewer rows of the
    /// kind that has the most.
    fn fix(&self) -> &'static str {
        if self.row_bytes.saturating_mul(2) < self.bytes {
            return "each shard (a file, a record batch, a row group) is an entry: use fewer, \
                    larger files, or split the dataset into several datasets, each indexed on \
                    its own, and mix them (`--mix`, or a dict of datasets and weights in \
                    open_stream)";
        }
        let kinds = [
            RowKind::Megatron,
            RowKind::Tokens,
            RowKind::Samples,
            RowKind::Any,
        ];
        let most = kinds
            .into_iter()
            .max_by_key(|&k| self.rows[k as usize])
            .unwrap_or(RowKind::Any);
        match most {
            RowKind::Megatron => {
                "each Megatron sequence is a row, and this corpus has too many for one \
                 manifest: split it into several datasets (folders of .bin/.idx pairs, each \
                 indexed on its own) and mix them (`--mix`, or a dict of datasets and weights \
                 in open_stream)"
            }
            RowKind::Tokens => {
                "each --eos document is a row: index without --eos (rows are then cut only \
                 every 64 MiB, and documents are not marked), or split the token files into \
                 several datasets, each indexed on its own, and mix them (`--mix`)"
            }
            RowKind::Samples => {
                "each sample (a WebDataset member, an MDS sample, an Arrow list or string \
                 value) is a row: use fewer, longer rows (pack several samples into one), or \
                 split the dataset into several datasets, each indexed on its own, and mix \
                 them (`--mix`)"
            }
            RowKind::Any => {
                "the number of rows is the problem: use fewer, longer rows (Megatron \
                 sequences, --eos documents, samples), or split the dataset into several \
                 datasets, each indexed on its own, and mix them (`--mix`)"
            }
        }
    }
}

/// The error for a written manifest of `len` bytes over the limit, naming its rows.
pub(crate) fn too_large(dir: &Path, shards: &[ShardEntry], len: u64) -> IndexError {
    let mut b = Budget::new(LIMIT);
    for s in shards {
        b.count(shard_floor(s), RowKind::Any, 1);
    }
    b.error(dir, len, String::new())
}

/// Decimal digits of `n`.
fn digits(n: u64) -> u64 {
    n.checked_ilog10().map_or(1, |d| u64::from(d) + 1)
}

/// A lower bound of the bytes `s` takes in the manifest JSON, whatever its checksum and
/// however `arrow::harmonize` and `webdataset::harmonize` rewrite its tensors later (they
/// only add row tables, or swap a typed WebDataset row for its whole member, which ends
/// where it does: so a row counts the digits of its end, `offset + length`, at most those
/// of its two numbers); the part of it that row tables take, and the rows.
pub(crate) fn shard_floor(s: &ShardEntry) -> Floor {
    let head = Floor {
        bytes: SHARD_FLOOR + s.file.len() as u64,
        ..Floor::default()
    };
    s.tensors
        .iter()
        .fold(head, |floor, t| floor.plus(tensor_floor(t)))
}

/// A lower bound of the bytes the tensor `t` takes in the manifest JSON (as in
/// [`shard_floor`]), the part of it that its row table takes, and its rows.
pub(crate) fn tensor_floor(t: &TensorEntry) -> Floor {
    let head = TENSOR_FLOOR + t.name.len() as u64;
    let Some(table) = &t.rows else {
        return Floor {
            bytes: head,
            ..Floor::default()
        };
    };
    // `[a,b]` and a comma between rows.
    let n = table.len() as u64;
    let row_bytes = table
        .iter()
        .map(|&[o, l]| row_floor(o.saturating_add(l)))
        .fold(ROWS_FLOOR + n.saturating_sub(1), u64::saturating_add);
    Floor {
        bytes: head.saturating_add(row_bytes),
        row_bytes,
        rows: n,
    }
}

/// A lower bound of a tensor named `name` with a row table of `n` rows, each ending at or
/// after `end`, before the table is built: what [`tensor_floor`] gives once it is.
pub(crate) fn ragged_floor(name: &str, n: u64, end: u64) -> Floor {
    let row_bytes = n
        .saturating_mul(row_floor(end))
        .saturating_add(ROWS_FLOOR + n.saturating_sub(1));
    Floor {
        bytes: (TENSOR_FLOOR + name.len() as u64).saturating_add(row_bytes),
        row_bytes,
        rows: n,
    }
}

/// One file's shards, counted against a [`Budget`] as a reader plans them, so that a file
/// of too many rows is refused before its row tables are all built, not after.
pub(crate) struct FileCheck<'a> {
    budget: &'a Budget,
    dir: &'a Path,
    kind: RowKind,
    /// Floor of the shards planned so far.
    planned: Floor,
    shards: u64,
}

impl<'a> FileCheck<'a> {
    /// Nothing planned yet, of a file of rows of `kind` in the dataset at `dir`.
    pub fn new(budget: &'a Budget, dir: &'a Path, kind: RowKind) -> Self {
        Self {
            budget,
            dir,
            kind,
            planned: Floor::default(),
            shards: 0,
        }
    }

    /// The budget counted against.
    pub fn budget(&self) -> &'a Budget {
        self.budget
    }

    /// The dataset directory.
    pub fn dir(&self) -> &'a Path {
        self.dir
    }

    /// Counts a shard planned.
    pub fn planned(&mut self, s: &ShardEntry) {
        self.planned = self.planned.plus(shard_floor(s));
        self.shards += 1;
    }

    /// Checks that the shards planned so far and `more` (what a shard being planned holds so
    /// far, or will hold) still fit the budget; `at` says where
    /// (` (counted up to FILE, ...)`).
    pub fn check(&self, more: Floor, at: impl FnOnce() -> String) -> Result<(), IndexError> {
        let open = u64::from(more != Floor::default());
        let all = self.planned.plus(more);
        self.budget
            .check_more(all, self.shards + open, self.kind, self.dir, at)
    }
}

/// The least bytes of a row ending at `end` (relative to its shard) in a row table,
/// without the comma before it: `[a,b]` counted as the digits of `end`.
pub(crate) fn row_floor(end: u64) -> u64 {
    3 + digits(end)
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::manifest::{DType, Manifest, TensorEntry};

    use super::*;

    /// A shard of `file` with one ragged tensor of `n` rows of `len` bytes each.
    fn ragged_shard(file: &str, n: u64, len: u64) -> ShardEntry {
        let rows: Vec<[u64; 2]> = (0..n).map(|i| [i * len, len]).collect();
        ShardEntry {
            file: file.into(),
            offset: 0,
            length: n * len,
            crc32c: 0,
            tensors: vec![TensorEntry {
                name: "tokens".into(),
                dtype: DType::Uint8,
                shape: vec![n * len],
                offset: 0,
                length: n * len,
                rows: Some(rows),
                ragged: true,
            }],
        }
    }

    #[test]
    fn the_floor_is_a_lower_bound_of_the_manifest_json_and_close_to_it() {
        let shards = vec![
            ragged_shard("a.bin", 5000, 3),
            ragged_shard("b/c.bin", 1, 1),
            ShardEntry {
                tensors: vec![TensorEntry::dense(
                    "x".into(),
                    DType::Float32,
                    vec![4, 2],
                    16,
                    32,
                )],
                crc32c: u32::MAX,
                ..ragged_shard("d.npy", 1, 48)
            },
        ];
        let mut b = Budget::new(LIMIT);
        b.add(&shards, RowKind::Samples, Path::new("/d"), "a.bin")
            .unwrap();
        let json = Manifest::new(shards).to_json().len() as u64;
        assert!(b.bytes <= json, "floor {} > json {json}", b.bytes);
        assert!(b.bytes * 10 >= json * 8, "floor {} of {json}", b.bytes);
        assert_eq!(b.rows.iter().sum::<u64>(), 5001);
    }

    #[test]
    fn too_many_rows_are_refused_naming_the_rows_the_limit_and_the_fix() {
        let dir = Path::new("/data/corpus");
        // Each shard's floor is about 7600 bytes: the second passes the limit.
        let mut b = Budget::new(12_000);
        let shard = ragged_shard("a.bin", 1000, 2);
        b.add(
            std::slice::from_ref(&shard),
            RowKind::Megatron,
            dir,
            "a.bin",
        )
        .unwrap();
        let e = b
            .add(&[shard], RowKind::Megatron, dir, "b.bin")
            .unwrap_err();
        assert!(
            matches!(
                e,
                IndexError::ManifestTooLarge {
                    rows: 2000,
                    limit: 12_000,
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        for want in [
            "/data/corpus",
            "2000 rows",
            "12000",
            "b.bin",
            "Megatron",
            "mix",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        assert!(!text.contains("larger shards"), "{text}");
        // --eos documents: the advice names --eos.
        let mut b = Budget::new(5_000);
        let e = b
            .add(
                &[ragged_shard("t.bin", 1000, 2)],
                RowKind::Tokens,
                dir,
                "t.bin",
            )
            .unwrap_err();
        assert!(e.to_string().contains("without --eos"), "{e}");
    }

    #[test]
    fn a_floor_counted_before_the_rows_are_built_never_passes_theirs() {
        // MDS files and Megatron indexes are counted from a row count, before the rows are
        // read: that count must never refuse what the rows themselves would not.
        for (n, end) in [(1u64, 0u64), (1000, 7), (1000, 12_345), (3, 99)] {
            let rows: Vec<[u64; 2]> = (0..n).map(|i| [end + i, 1]).collect();
            let t = TensorEntry {
                rows: Some(rows),
                ragged: true,
                ..TensorEntry::dense("tokens".into(), DType::Uint8, vec![n], 0, n)
            };
            let (before, after) = (ragged_floor("tokens", n, end), tensor_floor(&t));
            assert!(
                before.bytes <= after.bytes && before.row_bytes <= after.row_bytes,
                "{n} {end}: {before:?} {after:?}"
            );
            assert_eq!(before.rows, after.rows);
        }
        // A file's check counts the shards planned and what the one being planned holds.
        let budget = Budget::new(HEAD_FLOOR + 200);
        let mut check = FileCheck::new(&budget, Path::new("/d"), RowKind::Samples);
        let at = || " (here)".to_owned();
        let bytes = |bytes: u64| Floor {
            bytes,
            row_bytes: 0,
            rows: 2,
        };
        check.check(bytes(200), at).unwrap();
        check.check(bytes(201), at).unwrap_err();
        let shard = ragged_shard("a.bin", 1, 1);
        check.planned(&shard);
        let left = 200 - shard_floor(&shard).bytes;
        check.check(bytes(left), at).unwrap();
        let e = check.check(bytes(left + 1), at).unwrap_err();
        assert!(
            matches!(
                e,
                IndexError::ManifestTooLarge {
                    shards: 2,
                    rows: 3,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("(here)"), "{e}");
    }

    #[test]
    fn many_shards_without_rows_get_the_shard_advice() {
        let dir = Path::new("/d");
        let mut b = Budget::new(1_000);
        let dense = ShardEntry {
            tensors: vec![TensorEntry::dense("x".into(), DType::Uint8, vec![4], 0, 4)],
            ..ragged_shard("x.npy", 1, 4)
        };
        let shards: Vec<ShardEntry> = std::iter::repeat_n(dense, 20).collect();
        let e = b.add(&shards, RowKind::Samples, dir, "x.npy");
        let text = e.unwrap_err().to_string();
        assert!(
            text.contains("20 shards") && text.contains("fewer"),
            "{text}"
        );
        assert!(text.contains("larger files"), "{text}");
    }
}
