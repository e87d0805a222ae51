//! [`IndexError`]: why a directory could not be indexed.
//!
//! Every variant names the file (or the directory) it is about, and carries the offending
//! value, so that the message alone tells the user what to fix.

use std::path::PathBuf;

use shardwire_protocol::manifest::ManifestError;

use crate::unused::Unused;

/// Why `shardwire index` failed.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The dataset directory does not exist or is not a directory.
    #[error("{}: not a directory", .dir.display())]
    NotADirectory {
        /// The path given.
        dir: PathBuf,
    },
    /// Reading or writing a file (or listing a directory) failed.
    #[error("{}: {source}", .file.display())]
    Io {
        /// The file or directory.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A folder of the dataset could not be listed (permission denied, or it vanished while
    /// the dataset was listed). Its files could be data, as could an unreadable data file's
    /// bytes: the dataset is refused rather than indexed without them.
    #[error("{}: cannot list this folder of the dataset ({source}); {fix}", .dir.display())]
    UnlistedFolder {
        /// The folder.
        dir: PathBuf,
        /// The error listing it.
        source: std::io::Error,
        /// What to do.
        fix: &'static str,
    },
    /// A file name that cannot be written into the manifest (not UTF-8).
    #[error("{}: file name is not valid UTF-8; rename it", .file.display())]
    NonUtf8Name {
        /// The path, as the OS gave it.
        file: PathBuf,
    },
    /// The directory holds no file with data that could be indexed.
    #[error("{}: {}", .dir.display(), no_files_reason(*.found, .unused, *.unused_total))]
    NoUsableFiles {
        /// The dataset directory.
        dir: PathBuf,
        /// How many data files were read (each then held no rows).
        found: usize,
        /// The first [`UNUSED_SHOWN`] files not used, with why: what the user has to fix
        /// (an `.mds` shard without its `index.json`, an `.idx` without its `.bin`).
        unused: Vec<Unused>,
        /// How many files were not used in all.
        unused_total: usize,
    },
    /// The data files hold several splits by name (`train.bin` beside `val.bin`, `train/`
    /// beside `test/`): indexed together they would be one dataset, held-out rows trained on.
    #[error(
        "{}: the data files belong to the splits {} ({}): indexing them together would merge \
         them into one dataset; {fix}",
        .dir.display(),
        split_names(.splits),
        split_files(.splits)
    )]
    MixedSplits {
        /// The dataset directory.
        dir: PathBuf,
        /// Each split, and its files (relative paths), in split order.
        splits: Vec<(String, Vec<String>)>,
        /// How to index one split.
        fix: String,
    },
    /// The file is well formed but uses something shardwire does not support.
    #[error("{}: {reason} (found: {value})", .file.display())]
    Unsupported {
        /// The file.
        file: PathBuf,
        /// What is not supported, and how to fix it.
        reason: String,
        /// The offending value.
        value: String,
    },
    /// The file is truncated or corrupt.
    #[error("{}: malformed file: {reason} (found: {value})", .file.display())]
    Malformed {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
        /// The offending value.
        value: String,
    },
    /// One Arrow column cannot be a shardwire tensor.
    #[error("{}: {}column `{column}`: {reason} (found: {value})", .file.display(), batch_prefix(.batch))]
    Column {
        /// The file (for a Parquet file, the Parquet file, not its converted cache).
        file: PathBuf,
        /// Where in the file, when the problem is in the data rather than the schema.
        batch: Option<Box<BatchAt>>,
        /// The column (field) name.
        column: String,
        /// What is wrong, and how to fix it.
        reason: String,
        /// The offending value (a type, a count, a range).
        value: String,
    },
    /// One WebDataset sample does not fit the others (fields differ, a duplicate field).
    #[error("{}: sample `{key}` {reason} (found: {value})", .file.display())]
    Sample {
        /// The tar file.
        file: PathBuf,
        /// The sample's key.
        key: String,
        /// What is wrong, and how to fix it.
        reason: String,
        /// The offending value (the sample's fields, a field name).
        value: String,
    },
    /// `--columns` names a column that an Arrow file does not have.
    #[error(
        "{}: --columns names `{column}`, which is not a column of this file (available: {available})",
        .file.display()
    )]
    UnknownColumn {
        /// The file.
        file: PathBuf,
        /// The name given.
        column: String,
        /// The file's columns, comma-separated.
        available: String,
    },
    /// A Parquet file could not be read (corrupt, or a codec or type not supported).
    #[error("{}: cannot read Parquet file{}: {source}", .file.display(), in_row_group(.row_group))]
    Parquet {
        /// The Parquet file.
        file: PathBuf,
        /// The row group being read, when the error is in one (not in the footer).
        row_group: Option<usize>,
        /// The reader's error (names the bad value: codec, type, offset).
        source: ::parquet::errors::ParquetError,
    },
    /// The cache that Parquet files are converted into, beside the data
    /// (`DIR/.shardwire-cache/parquet`), cannot be written: a read-only folder or file system,
    /// no permission, no space.
    #[error(
        "{}: cannot write the Parquet cache ({source}): each Parquet file is converted once to \
         an Arrow IPC file in {cache}, beside the data, and served from there; {fix}",
        .file.display()
    )]
    ParquetCache {
        /// The file or folder that could not be written.
        file: PathBuf,
        /// The cache folder (`DIR/.shardwire-cache/parquet`).
        cache: String,
        /// The I/O error.
        source: std::io::Error,
        /// What to do.
        fix: &'static str,
    },
    /// The local temporary file that a Parquet object is converted into, before it is
    /// uploaded beside the data, cannot be written (most often: no space in the temporary
    /// folder, `TMPDIR`).
    #[error(
        "{}: cannot write the local temporary file a Parquet object is converted into before \
         it is uploaded beside the data ({source}); {fix}",
        .file.display()
    )]
    ParquetTemp {
        /// The file or folder that could not be written (under the temporary folder).
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
        /// What to do.
        fix: &'static str,
    },
    /// `.bin` files without the Megatron `.idx` of their name, beside `.bin`/`.idx` pairs (an
    /// `.idx` lost in a partial copy or by a sync filter): each would be served as one raw
    /// `uint8` tensor among the pairs' token sequences, so the dataset is refused.
    #[error(
        "{}: {}, while {pairs} other .bin {} one: read alone, each would be served as \
         one raw uint8 tensor among the token sequences of the pairs; restore the missing \
         .idx (megatron's tools/preprocess_data.py writes the .bin and the .idx together), \
         move the .bin out of the dataset (or rename it to start with '.'), or give --tokens \
         DTYPE (and --eos ID) to read every .bin without an .idx as raw tokens",
        .dir.display(),
        unpaired(.bins),
        files_have(*.pairs)
    )]
    UnpairedMegatronBin {
        /// The dataset directory.
        dir: PathBuf,
        /// The `.bin` files without their `.idx` (relative paths, sorted).
        bins: Vec<String>,
        /// How many `.bin` files have their `.idx`.
        pairs: usize,
    },
    /// An option that would change nothing for this dataset: `--columns` without an Arrow or
    /// Parquet file, `--tokens` without a `.bin` file to read as tokens. Refused before any
    /// data is read, rather than the data served as if it had not been given.
    #[error("{}: {option} would change nothing: {reason} (found: {found}); {fix}", .dir.display())]
    UnusedOption {
        /// The dataset directory.
        dir: PathBuf,
        /// The option (`--columns`, `--tokens and --eos`).
        option: String,
        /// What it acts on, that the dataset lacks.
        reason: String,
        /// The data files found, by format.
        found: String,
        /// What to do.
        fix: String,
    },
    /// Writing the Arrow IPC file converted from a Parquet file failed.
    #[error("{}: cannot write converted Arrow IPC file: {source}", .file.display())]
    ArrowWrite {
        /// The cached Arrow IPC file being written.
        file: PathBuf,
        /// The writer's error.
        source: arrow_schema::ArrowError,
    },
    /// An object-storage request failed (the message names the bucket, key and range).
    #[error(transparent)]
    Store(#[from] shardwire_store::StoreError),
    /// Listing the dataset's prefix found no objects at all.
    #[error(
        "{url}: no objects under this prefix (check the bucket and the prefix; a prefix names \
         whole path segments)"
    )]
    NoObjects {
        /// The dataset URL.
        url: String,
    },
    /// Something must be written beside the data, and the location is read-only.
    #[error("{url}: {what}, but http(s) locations are read-only; {fix}")]
    ReadOnly {
        /// The dataset URL.
        url: String,
        /// What would be written.
        what: String,
        /// How to do without.
        fix: String,
    },
    /// The manifest would be larger than can be sent to nodes: too many rows in its row
    /// tables (each an `[offset, length]` pair in the JSON), or too many shards. Checked on a
    /// lower bound of its size as each file is planned, before its data is read, and on the
    /// manifest itself when it is written.
    #[error(
        "{}: the manifest would be at least {bytes} bytes{at}, more than the {limit} bytes that \
         can be sent to nodes: it lists {shards} shards and {rows} rows (each row an [offset, \
         length] pair); {fix}",
        .dir.display()
    )]
    ManifestTooLarge {
        /// The dataset directory.
        dir: PathBuf,
        /// Bytes of the manifest, or a lower bound of them.
        bytes: u64,
        /// Where it was found (` (counted up to FILE, ...)`), or empty.
        at: String,
        /// The most bytes a manifest may have.
        limit: u64,
        /// Shards counted.
        shards: u64,
        /// Rows counted in the row tables.
        rows: u64,
        /// What to do about it.
        fix: String,
    },
    /// The manifest built from the files cannot be used: a limit the files pass (a shard
    /// over 1 TiB or with more than 4096 tensors, more shards than a manifest holds; a
    /// manifest file too large to send is [`IndexError::ManifestTooLarge`]), or a bug
    /// (validation is also its guard).
    #[error("{}: the manifest built from its files cannot be used: {source}", .dir.display())]
    Manifest {
        /// The dataset directory.
        dir: PathBuf,
        /// The validation failure.
        source: ManifestError,
    },
}

/// How many unused files [`IndexError::NoUsableFiles`] names.
pub(crate) const UNUSED_SHOWN: usize = 20;

/// The extensions of data files, for the message when none is usable.
const DATA_EXTENSIONS: &str =
    ".arrow, .arrows, .ipc, .feather, .npy, .bin (+ .idx), .tar, .parquet, index.json + .mds";

/// Why nothing could be indexed, naming the files not used and why: the reason there is
/// usually what to fix (a lone `.mds` is not "no data file").
fn no_files_reason(found: usize, unused: &[Unused], total: usize) -> String {
    let head = if found > 0 {
        format!("found {found} data files but none holds any rows")
    } else if total == 0 {
        return format!("no data files found (extensions {DATA_EXTENSIONS})");
    } else {
        format!("no data file could be used (data files: {DATA_EXTENSIONS})")
    };
    let mut names: Vec<String> = unused
        .iter()
        .map(|u| format!("{} ({})", u.file, u.reason))
        .collect();
    if total > unused.len() {
        names.push(format!("and {} more", total - unused.len()));
    }
    let plural = if total == 1 { "" } else { "s" };
    format!(
        "{head}; not used: {total} file{plural}: {}",
        names.join(", ")
    )
}

/// How many files of each split [`IndexError::MixedSplits`] names.
const SPLIT_FILES_SHOWN: usize = 5;

/// `train, val`.
fn split_names(splits: &[(String, Vec<String>)]) -> String {
    let names: Vec<&str> = splits.iter().map(|(s, _)| s.as_str()).collect();
    names.join(", ")
}

/// `train: a.bin, b.bin; val: v.bin, and 3 more`.
fn split_files(splits: &[(String, Vec<String>)]) -> String {
    let each = splits.iter().map(|(split, files)| {
        let mut names: Vec<String> = files.iter().take(SPLIT_FILES_SHOWN).cloned().collect();
        if files.len() > SPLIT_FILES_SHOWN {
            names.push(format!("and {} more", files.len() - SPLIT_FILES_SHOWN));
        }
        format!("{split}: {}", names.join(", "))
    });
    each.collect::<Vec<_>>().join("; ")
}

/// Where the record batch of an [`IndexError::Column`] is, in the file the user gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchAt {
    /// Record batch `0`, `1`, ... of an Arrow IPC file (or of a Parquet file's converted
    /// cache, when its row groups could not be read back).
    Batch(usize),
    /// Rows `first .. first + rows` (counted from 0 in the row group) of row group `group`
    /// of a Parquet file: one converted record batch.
    RowGroup {
        /// The row group.
        group: usize,
        /// Its first row in the batch.
        first: u64,
        /// Rows in the batch.
        rows: u64,
    },
}

impl std::fmt::Display for BatchAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchAt::Batch(b) => write!(f, "record batch {b}"),
            BatchAt::RowGroup { group, first, rows } => {
                write!(f, "row group {group} (its rows {first}..{})", first + rows)
            }
        }
    }
}

fn batch_prefix(batch: &Option<Box<BatchAt>>) -> String {
    batch.as_ref().map(|b| format!("{b}: ")).unwrap_or_default()
}

/// ` (row group 5)`, or nothing.
fn in_row_group(group: &Option<usize>) -> String {
    group
        .map(|g| format!(" (row group {g})"))
        .unwrap_or_default()
}

/// How many `.bin` files of [`IndexError::UnpairedMegatronBin`] are named.
const UNPAIRED_SHOWN: usize = 5;

/// `c1.bin has no Megatron index c1.idx beside it`, or `2 .bin files have no Megatron index
/// beside them (a.bin: no a.idx, sub/b.BIN: no b.IDX)`: the `.bin` files without their
/// `.idx`, the first [`UNPAIRED_SHOWN`] named.
fn unpaired(bins: &[String]) -> String {
    if let [one] = bins {
        return format!("{one} has no Megatron index {} beside it", idx_of(one));
    }
    let mut names: Vec<String> = bins
        .iter()
        .take(UNPAIRED_SHOWN)
        .map(|b| format!("{b}: no {}", idx_of(b)))
        .collect();
    if bins.len() > UNPAIRED_SHOWN {
        names.push(format!("and {} more", bins.len() - UNPAIRED_SHOWN));
    }
    format!(
        "{} .bin files have no Megatron index beside them ({})",
        bins.len(),
        names.join(", ")
    )
}

/// `file has` or `files have`.
fn files_have(n: usize) -> &'static str {
    if n == 1 { "file has" } else { "files have" }
}

/// The name of the Megatron index of the `.bin` `rel`: `sub/c1.bin` -> `c1.idx`
/// (`C1.BIN` -> `C1.IDX`).
fn idx_of(rel: &str) -> String {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    let (stem, ext) = name.rsplit_once('.').unwrap_or((name, ""));
    let idx = if ext == "BIN" { "IDX" } else { "idx" };
    format!("{stem}.{idx}")
}

impl IndexError {
    /// Shorthand for [`IndexError::Io`].
    pub(crate) fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            file: file.into(),
            source,
        }
    }
}
