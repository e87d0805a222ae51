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
        /// The file.
        file: PathBuf,
        /// Record batch index, when the problem is in the data rather than the schema.
        batch: Option<usize>,
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
    #[error("{}: cannot read Parquet file: {source}", .file.display())]
    Parquet {
        /// The Parquet file.
        file: PathBuf,
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

fn batch_prefix(batch: &Option<usize>) -> String {
    batch
        .map(|b| format!("record batch {b}: "))
        .unwrap_or_default()
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
