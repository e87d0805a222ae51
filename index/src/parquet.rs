//! Parquet files (`.parquet`): converted once to Arrow IPC (file format) in
//! `DIR/.shardwire-cache/parquet/<relative path>.arrow`, which the Arrow indexer then reads,
//! so list and string columns work as they do for Arrow files.
//!
//! The columns and values are those of `pyarrow.parquet.read_table`: the Arrow schema
//! pyarrow stores in the file (`ARROW:schema`) is honoured by the `parquet` crate's reader.
//! Each row group becomes one record batch, split into batches of at most
//! [`MAX_BATCH_ROWS`] rows when larger (each batch is one shard).
//!
//! Next to each cached file a JSON sidecar (`<cache>.json`) records what it was made
//! from: the Parquet file's size and modification time (and the cached file's size). While
//! they match, the cached file is reused. The cache directory is hidden, so the walk never
//! reads it as input; the manifest names the cached file (the source serves any relative
//! path). Both files are written to a temporary file first and then renamed.
//!
//! A dataset in object storage ([`remote`]) is converted the same way, reading the Parquet
//! object with ranged GETs; the converted file and its sidecar (which records the object's
//! size and ETag instead of a modification time) are uploaded beside the data, under the
//! same hidden cache prefix, and reused while they match.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use ::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use ::parquet::file::reader::ChunkReader;
use arrow_ipc::writer::FileWriter;

use crate::error::IndexError;

pub(crate) mod remote;
#[cfg(test)]
mod tests;

/// Where converted files go, relative to the dataset directory.
pub(crate) const CACHE_DIR: &str = ".shardwire-cache/parquet";
/// Most rows in one converted record batch (one shard).
pub(crate) const MAX_BATCH_ROWS: usize = 65_536;
/// Version of the sidecar layout; a different one means convert again.
const SIDECAR_FORMAT: u64 = 1;

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
    fn of(path: &Path) -> Result<Self, IndexError> {
        let meta = std::fs::metadata(path).map_err(|e| IndexError::io(path, e))?;
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
    let stamp = Stamp::of(path)?;
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
    let (row_groups, arrow_size) = convert(path, &cache).map_err(unwritable)?;
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
    let (file, source) = match e {
        IndexError::Io { file, source } => (file, source),
        IndexError::ArrowWrite {
            file,
            source: arrow_schema::ArrowError::IoError(_, source),
        } => (file, source),
        other => return other,
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

/// Converts the Parquet file `src` to the Arrow IPC file `dst` (atomically); returns the
/// number of row groups and the size written.
fn convert(src: &Path, dst: &Path) -> Result<(u64, u64), IndexError> {
    let open = || File::open(src).map_err(|e| IndexError::io(src, e));
    convert_from(open, src, dst)
}

/// Converts the Parquet data that `open` gives (`name` in messages) to the Arrow IPC file
/// `dst`, one record batch per row group (split at [`MAX_BATCH_ROWS`]).
fn convert_from<R: ChunkReader + 'static>(
    open: impl Fn() -> Result<R, IndexError>,
    name: &Path,
    dst: &Path,
) -> Result<(u64, u64), IndexError> {
    let bad = |source| IndexError::Parquet {
        file: name.to_path_buf(),
        source,
    };
    let meta = ArrowReaderMetadata::load(&open()?, ArrowReaderOptions::new()).map_err(bad)?;
    let groups = meta
        .metadata()
        .row_groups()
        .iter()
        .enumerate()
        .map(|(i, g)| {
            // A negative count was read as 0 and the row group skipped without a word.
            usize::try_from(g.num_rows()).map_err(|_| IndexError::Malformed {
                file: name.to_path_buf(),
                reason: format!("row group {i} has a negative row count (a damaged footer?)"),
                value: g.num_rows().to_string(),
            })
        })
        .collect::<Result<Vec<usize>, _>>()?;
    let schema = meta.schema().clone();
    let size = atomic_write(dst, |w| {
        let arrow_err = |source| IndexError::ArrowWrite {
            file: dst.to_path_buf(),
            source,
        };
        let mut out = FileWriter::try_new(w, &schema).map_err(arrow_err)?;
        for (i, &rows) in groups.iter().enumerate() {
            if rows == 0 {
                continue;
            }
            let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(open()?, meta.clone())
                .with_row_groups(vec![i])
                .with_batch_size(rows.min(MAX_BATCH_ROWS))
                .build()
                .map_err(bad)?;
            for batch in reader {
                let batch = batch.map_err(|e| bad(e.into()))?;
                out.write(&batch).map_err(arrow_err)?;
            }
        }
        out.finish().map_err(arrow_err)
    })?;
    Ok((groups.len() as u64, size))
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
