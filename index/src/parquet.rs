//! Parquet files (`.parquet`): converted once to Arrow IPC (file format) in
//! `DIR/.shardwire-cache/parquet/<relative path>.arrow`, which the Arrow indexer then reads,
//! so list and string columns work as they do for Arrow files.
//!
//! The columns and values are those of `pyarrow.parquet.read_table`: the Arrow schema
//! pyarrow stores in the file (`ARROW:schema`) is honoured by the `parquet` crate's reader.
//! Each row group becomes one record batch, split into batches of at most
//! [`MAX_BATCH_ROWS`] rows and about [`MAX_BATCH_BYTES`] bytes of the row group's encoded
//! data when larger: each batch is one shard, and is held in memory whole while it is
//! converted ([`plan_batches`]). The bytes are the footer's `total_byte_size`, the pages'
//! size uncompressed but still encoded: a dictionary- or run-length-encoded column (pyarrow
//! writes dictionaries by default) counts far less than it decodes to (a 4 KiB string
//! repeated in every row, a few bytes a row), so a batch may hold far more than 128 MiB once
//! decoded (64 Ki rows of it: 256 MiB). The Parquet file is opened once, and every row group
//! read through that handle, so a file replaced meanwhile (`mv`) is never half read.
//!
//! Next to each cached file a JSON sidecar (`<cache>.json`) records what it was made
//! from: the Parquet file's size and modification time (and the cached file's size). While
//! they match, the cached file is reused. The cache directory is hidden, so the walk never
//! reads it as input; the manifest names the cached file (the source serves any relative
//! path). Both files are written to a temporary file first and then renamed. Messages
//! about the data (columns, values) name the Parquet file and the row group ([`batch_at`]),
//! not the cache; those about the cached file's own bytes (a read that fails, a structure
//! damaged since it was written) name the cached file, which can be deleted to convert again.
//!
//! A dataset in object storage ([`remote`]) is converted the same way, reading the Parquet
//! object with ranged GETs; the converted file and its sidecar (which records the object's
//! size and ETag instead of a modification time) are uploaded beside the data, under the
//! same hidden cache prefix, and reused while they match. The manifest's `objects` list
//! the Parquet object too (its size and ETag when it was converted): a record only, which no
//! source checks (it reads the cache, whose entry it checks); a changed Parquet object is
//! converted again at the next index.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use ::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use ::parquet::errors::ParquetError;
use ::parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use ::parquet::file::reader::ChunkReader;
use arrow_ipc::writer::FileWriter;

use crate::error::{BatchAt, IndexError};

pub(crate) mod remote;
#[cfg(test)]
mod tests;

/// Where converted files go, relative to the dataset directory.
pub(crate) const CACHE_DIR: &str = ".shardwire-cache/parquet";
/// Most rows in one converted record batch (one shard).
pub(crate) const MAX_BATCH_ROWS: usize = 65_536;
/// About the most bytes in one converted record batch, by the footer's size of its row
/// group's encoded data (uncompressed, not decoded: a dictionary-encoded column decodes to
/// more, so a batch may hold more once decoded; the module's doc).
pub(crate) const MAX_BATCH_BYTES: u64 = 128 << 20;
/// Version of the sidecar layout; a different one means convert again (2: batches cut by
/// bytes too, so a cache of format 1 may hold other batches than [`plan_batches`] says).
const SIDECAR_FORMAT: u64 = 2;

/// How converted record batches are cut: at most `rows` rows, about `bytes` encoded bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchLimit {
    /// Most rows in a batch.
    pub rows: usize,
    /// About the most encoded bytes in a batch (at least one row).
    pub bytes: u64,
}

/// The limit every conversion uses.
pub(crate) const BATCH_LIMIT: BatchLimit = BatchLimit {
    rows: MAX_BATCH_ROWS,
    bytes: MAX_BATCH_BYTES,
};

/// One converted record batch: rows `first .. first + rows` of row group `group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Planned {
    /// The row group.
    pub group: usize,
    /// Its first row in the batch, counted from 0 in the row group.
    pub first: u64,
    /// Rows in the batch.
    pub rows: u64,
}

/// The record batches that row groups of `(rows, encoded bytes)` are converted into, in
/// order: each row group cut into batches of the same number of rows (the last one may be
/// shorter), at most `limit.rows` and about `limit.bytes` encoded bytes by the row group's
/// average row; none for an empty row group. A pyarrow file of 1 Mi rows of 256 KiB images
/// per row group gives batches of 512 rows (128 MiB), not one of 64 Ki rows (16 GiB).
pub(crate) fn plan_batches(groups: &[(usize, i64)], limit: BatchLimit) -> Vec<Planned> {
    let mut out = Vec::new();
    for (group, &(rows, bytes)) in groups.iter().enumerate() {
        let per = batch_rows(rows, bytes, limit);
        let mut first = 0;
        while first < rows {
            let n = per.min(rows - first);
            out.push(Planned {
                group,
                first: first as u64,
                rows: n as u64,
            });
            first += n;
        }
    }
    out
}

/// Rows in each batch of a row group of `rows` rows and `bytes` encoded bytes (a
/// count that is not positive read as 1 byte: cut by rows only).
fn batch_rows(rows: usize, bytes: i64, limit: BatchLimit) -> usize {
    let bytes = u128::from(u64::try_from(bytes).unwrap_or(0).max(1));
    let fit = u128::from(limit.bytes) * rows as u128 / bytes;
    usize::try_from(fit)
        .unwrap_or(usize::MAX)
        .clamp(1, limit.rows.max(1))
}

/// The `(rows, encoded bytes)` of each row group of `meta`; the row group whose row
/// count is negative (a damaged footer), with that count, otherwise.
fn row_groups(meta: &ParquetMetaData) -> Result<Vec<(usize, i64)>, (usize, i64)> {
    let groups = meta.row_groups().iter().enumerate();
    groups
        .map(|(i, g)| {
            let rows = usize::try_from(g.num_rows()).map_err(|_| (i, g.num_rows()))?;
            Ok((rows, g.total_byte_size()))
        })
        .collect()
}

/// Where record batch `index` of the Arrow file converted from the Parquet data `reader`
/// gives comes from: its row group and rows, as [`plan_batches`] cut them (the sidecar holds
/// the Parquet file's size and time or ETag, so the file is the one converted). `None` when
/// the footer cannot be read.
pub(crate) fn batch_at<R: ChunkReader>(reader: &R, index: usize) -> Option<BatchAt> {
    let meta = ParquetMetaDataReader::new().parse_and_finish(reader).ok()?;
    let groups = row_groups(&meta).ok()?;
    let p = plan_batches(&groups, BATCH_LIMIT).get(index).copied()?;
    Some(BatchAt::RowGroup {
        group: p.group,
        first: p.first,
        rows: p.rows,
    })
}

/// One Parquet file, ready to be read as Arrow IPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParquetNote {
    /// The Parquet file, relative to the dataset directory.
    pub source: String,
    /// The cached Arrow IPC file, relative to the dataset directory.
    pub cache: String,
    /// True when the cached file was reused, false when it was (re)written now.
    pub reused: bool,
    /// Row groups in the Parquet file.
    pub row_groups: u64,
    /// What says the file is unchanged: `since 2026-12-01T15:21:53Z` (its modification
    /// time) for a local file, `at ETag "..."` for an object.
    pub unchanged: String,
}

impl std::fmt::Display for ParquetNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, rg) = (
            if self.reused { "reused" } else { "converted" },
            self.row_groups,
        );
        let groups = if rg == 1 { "row group" } else { "row groups" };
        write!(
            f,
            "parquet: {} -> {} ({what}, {rg} {groups}",
            self.source, self.cache
        )?;
        if self.reused {
            write!(f, ", unchanged {}", self.unchanged)?;
        }
        f.write_str(")")
    }
}

/// The Parquet file's identity, as recorded in the sidecar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime_ns: u64,
}

impl Stamp {
    /// The stamp of the open file `file` (at `path`): of the bytes it reads, even if the
    /// path is replaced meanwhile.
    fn of(file: &File, path: &Path) -> Result<Self, IndexError> {
        let meta = file.metadata().map_err(|e| IndexError::io(path, e))?;
        let mtime = meta.modified().map_err(|e| IndexError::io(path, e))?;
        let ns = mtime.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        Ok(Self {
            size: meta.len(),
            mtime_ns: u64::try_from(ns).unwrap_or(u64::MAX),
        })
    }
}

/// Makes sure `dir/rel` (a Parquet file at `path`) has an up-to-date cached Arrow IPC file;
/// returns its full path and what was done.
pub(crate) fn cached(
    dir: &Path,
    path: &Path,
    rel: &str,
) -> Result<(PathBuf, ParquetNote), IndexError> {
    let cache_rel = format!("{CACHE_DIR}/{rel}.arrow");
    let cache = dir.join(&cache_rel);
    let sidecar = sidecar_path(&cache);
    let file = File::open(path).map_err(|e| IndexError::io(path, e))?;
    let stamp = Stamp::of(&file, path)?;
    let mut note = ParquetNote {
        source: rel.to_owned(),
        cache: cache_rel,
        reused: true,
        row_groups: 0,
        unchanged: format!("since {}", utc(stamp.mtime_ns)),
    };
    if let Some(row_groups) = still_valid(&sidecar, &cache, stamp) {
        note.row_groups = row_groups;
        return Ok((cache, note));
    }
    let cache_dir = dir.join(CACHE_DIR);
    let unwritable = |e| cache_error(&cache_dir, e);
    if let Some(parent) = cache.parent() {
        std::fs::create_dir_all(parent).map_err(|e| unwritable(IndexError::io(parent, e)))?;
    }
    let (row_groups, arrow_size) = convert(&file, path, &cache).map_err(unwritable)?;
    let side = serde_json::json!({
        "format": SIDECAR_FORMAT,
        "source": rel,
        "size": stamp.size,
        "mtime_ns": stamp.mtime_ns,
        "row_groups": row_groups,
        "arrow_size": arrow_size,
    });
    let text = serde_json::to_vec_pretty(&side).unwrap_or_default();
    atomic_write(&sidecar, |w| {
        w.write_all(&text).map_err(|e| IndexError::io(&sidecar, e))
    })
    .map_err(unwritable)?;
    note.reused = false;
    note.row_groups = row_groups;
    Ok((cache, note))
}

/// `e` as an [`IndexError::ParquetCache`] when it is an I/O error writing under `cache_dir`
/// (the Parquet cache), with what to do; any other error as it is. An I/O error inside the
/// Arrow writer (a full disk while a batch is written) counts as one.
fn cache_error(cache_dir: &Path, e: IndexError) -> IndexError {
    use std::io::ErrorKind;
    let (file, source) = match io_parts(e) {
        Ok(parts) => parts,
        Err(other) => return other,
    };
    // `.shardwire-cache` itself, when a file is in its way.
    let top = cache_dir.parent().unwrap_or(cache_dir);
    if !file.starts_with(top) {
        return IndexError::Io { file, source };
    }
    let fix = match source.kind() {
        ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => {
            "the dataset folder must be writable (shardwire index has no other place for it): \
             index a writable copy of the dataset, or convert the Parquet files to Arrow IPC \
             files yourself (pyarrow.feather.write_feather(pyarrow.parquet.read_table(p), \
             'p.arrow', compression='uncompressed')) and index those"
        }
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded | ErrorKind::FileTooLarge => {
            "free space (or raise the quota) on the dataset's file system (the cache takes about the size of the \
             Parquet files uncompressed), or index a copy of the dataset where there is room"
        }
        _ => {
            "make DIR/.shardwire-cache/parquet a folder that can be written (remove what is in \
             its way), or index a writable copy of the dataset"
        }
    };
    IndexError::ParquetCache {
        file,
        cache: cache_dir.display().to_string(),
        source,
        fix,
    }
}

/// The file and the I/O error of `e` when it is an I/O error, or one inside the Arrow writer
/// (a full disk while a batch is written); `e` as it is otherwise.
fn io_parts(e: IndexError) -> Result<(PathBuf, std::io::Error), IndexError> {
    match e {
        IndexError::Io { file, source } => Ok((file, source)),
        IndexError::ArrowWrite {
            file,
            source: arrow_schema::ArrowError::IoError(_, source),
        } => Ok((file, source)),
        other => Err(other),
    }
}

/// `e` as an [`IndexError::ParquetTemp`] when it is an I/O error writing under `tmp` (the
/// local temporary folder a Parquet object is converted in), with what to do; any other
/// error as it is.
fn temp_error(tmp: &Path, e: IndexError) -> IndexError {
    use std::io::ErrorKind;
    let (file, source) = match io_parts(e) {
        Ok(parts) => parts,
        Err(other) => return other,
    };
    if !file.starts_with(tmp) {
        return IndexError::Io { file, source };
    }
    let fix = match source.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded | ErrorKind::FileTooLarge => {
            "the conversion needs local space for the converted file (about the Parquet \
             object's size uncompressed): free space in the temporary folder, or set TMPDIR to \
             a folder with room (TMPDIR=/scratch shardwire index ...)"
        }
        _ => {
            "make the temporary folder writable, or set TMPDIR to a writable folder with room \
             for the converted file (about the Parquet object's size uncompressed)"
        }
    };
    IndexError::ParquetTemp { file, source, fix }
}

/// `x.parquet.arrow` -> `x.parquet.arrow.json`.
fn sidecar_path(cache: &Path) -> PathBuf {
    let mut s = cache.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// The row-group count the sidecar records, when it matches `stamp` and the cached file is
/// there with the recorded size; `None` (convert again) otherwise.
fn still_valid(sidecar: &Path, cache: &Path, stamp: Stamp) -> Option<u64> {
    let text = std::fs::read(sidecar).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    let arrow_size = std::fs::metadata(cache).ok()?.len();
    let ok = num("format") == Some(SIDECAR_FORMAT)
        && num("size") == Some(stamp.size)
        && num("mtime_ns") == Some(stamp.mtime_ns)
        && num("arrow_size") == Some(arrow_size);
    if ok { num("row_groups") } else { None }
}

/// Converts the Parquet file open as `file` (at `path`) to the Arrow IPC file `dst`
/// (atomically), reading every row group through that one handle; returns the number of row
/// groups and the size written.
fn convert(file: &File, path: &Path, dst: &Path) -> Result<(u64, u64), IndexError> {
    let open = || file.try_clone().map_err(|e| IndexError::io(path, e));
    convert_from(open, path, dst, BATCH_LIMIT)
}

/// An [`IndexError::Parquet`] about the Parquet file `file` (in `row_group`, when given).
fn parquet_err(file: &Path, row_group: Option<usize>) -> impl Fn(ParquetError) -> IndexError + '_ {
    move |source| IndexError::Parquet {
        file: file.to_path_buf(),
        row_group,
        source,
    }
}

/// Converts the Parquet data that `open` gives (`name` in messages) to the Arrow IPC file
/// `dst`, in the record batches [`plan_batches`] cuts with `limit`: each batch read is
/// checked to hold the rows planned, so that [`batch_at`] names the rows it really holds.
fn convert_from<R: ChunkReader + 'static>(
    open: impl Fn() -> Result<R, IndexError>,
    name: &Path,
    dst: &Path,
    limit: BatchLimit,
) -> Result<(u64, u64), IndexError> {
    let meta = ArrowReaderMetadata::load(&open()?, ArrowReaderOptions::new())
        .map_err(parquet_err(name, None))?;
    // A negative count was read as 0 and the row group skipped without a word.
    let groups = row_groups(meta.metadata()).map_err(|(i, n)| IndexError::Malformed {
        file: name.to_path_buf(),
        reason: format!("row group {i} has a negative row count (a damaged footer?)"),
        value: n.to_string(),
    })?;
    let plan = plan_batches(&groups, limit);
    let schema = meta.schema().clone();
    let size = atomic_write(dst, |w| {
        let arrow_err = |source| IndexError::ArrowWrite {
            file: dst.to_path_buf(),
            source,
        };
        let mut out = FileWriter::try_new(w, &schema).map_err(arrow_err)?;
        for batches in plan.chunk_by(|a, b| a.group == b.group) {
            let group = batches[0].group;
            let bad = parquet_err(name, Some(group));
            let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(open()?, meta.clone())
                .with_row_groups(vec![group])
                .with_batch_size(batches[0].rows as usize)
                .build()
                .map_err(&bad)?;
            let mut want = batches.iter();
            for batch in reader {
                let batch = batch.map_err(|e| bad(e.into()))?;
                let planned = want.next();
                if planned.map(|p| p.rows) != Some(batch.num_rows() as u64) {
                    return Err(rows_differ(name, group, planned, batch.num_rows()));
                }
                out.write(&batch).map_err(arrow_err)?;
            }
            if let Some(missing) = want.next() {
                return Err(rows_differ(name, group, Some(missing), 0));
            }
        }
        out.finish().map_err(arrow_err)
    })?;
    Ok((groups.len() as u64, size))
}

/// The error for row group `group` of the Parquet file `name`, whose reader gave a batch of
/// `got` rows where `planned` was due (none: more rows than its footer says).
fn rows_differ(name: &Path, group: usize, planned: Option<&Planned>, got: usize) -> IndexError {
    let due = planned.map_or_else(
        || "none (all its rows were read)".to_owned(),
        |p| format!("rows {}..{}", p.first, p.first + p.rows),
    );
    IndexError::Malformed {
        file: name.to_path_buf(),
        reason: format!(
            "row group {group} does not hold the rows its footer counts (a damaged file?); \
             write it again"
        ),
        value: format!("a batch of {got} rows read where {due} were due"),
    }
}

/// Writes `path` through `fill` into a temporary file next to it, fsyncs and renames it;
/// returns the size written.
fn atomic_write(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> Result<(), IndexError>,
) -> Result<u64, IndexError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let result = (|| {
        let f = File::create(&tmp).map_err(|e| IndexError::io(&tmp, e))?;
        let mut w = BufWriter::new(f);
        fill(&mut w)?;
        let f = w
            .into_inner()
            .map_err(|e| IndexError::io(&tmp, e.into_error()))?;
        f.sync_all().map_err(|e| IndexError::io(&tmp, e))?;
        let len = f.metadata().map_err(|e| IndexError::io(&tmp, e))?.len();
        std::fs::rename(&tmp, path).map_err(|e| IndexError::io(path, e))?;
        Ok(len)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Nanoseconds since the Unix epoch as `2026-12-01T15:21:53Z` (UTC, whole seconds).
fn utc(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (h, mi, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}
