//! Parquet objects: converted to Arrow IPC by reading the object with ranged GETs into a
//! local temporary file, which is uploaded beside the data (`.shardwire-cache/parquet/
//! <rel>.arrow` and its sidecar) and indexed from the local copy (the same bytes, so no
//! second download). A sidecar recording the Parquet object's size and ETag, and a cached
//! object of the recorded size, mean the conversion is reused. The local temporary folder
//! is `std::env::temp_dir()` (`TMPDIR`): an error writing there says so ([`temp_error`]).
//!
//! Messages about the data (columns, values) name the Parquet object (its URL); those about
//! the cached object's own bytes (a read, its structure) name the cached object.

use std::path::PathBuf;

use bytes::Bytes;
use shardwire_store::{ObjectMeta, StoreError};

use super::{BATCH_LIMIT, CACHE_DIR, ParquetNote, SIDECAR_FORMAT, convert_from, temp_error};
use crate::blob::LocalFile;
use crate::error::IndexError;
use crate::remote::{Remote, RemoteChunks};
use crate::source::Source;

/// Largest sidecar read back.
const MAX_SIDECAR: u64 = 64 << 10;

/// The converted Arrow IPC file of the Parquet object `rel`, and what was done.
pub(crate) fn cached_remote(
    remote: &mut Remote,
    rel: &str,
) -> Result<(Source, ParquetNote), IndexError> {
    let cache_rel = format!("{CACHE_DIR}/{rel}.arrow");
    let side_rel = format!("{cache_rel}.json");
    let url = remote.store().url().clone();
    let src = remote
        .meta(rel)
        .cloned()
        .ok_or_else(|| StoreError::NotFound {
            bucket: url.bucket().to_owned(),
            key: url.key(rel),
        })?;
    let mut note = ParquetNote {
        source: rel.to_owned(),
        cache: cache_rel.clone(),
        reused: true,
        row_groups: 0,
        unchanged: format!("at ETag {}", src.etag.as_deref().unwrap_or("(none)")),
    };
    if let Some(row_groups) = still_valid(remote, &side_rel, &cache_rel, &src)? {
        note.row_groups = row_groups;
        let mut source = remote.open_file(&cache_rel)?;
        source.origin = Some(remote.display(rel));
        return Ok((source, note));
    }
    if !url.scheme().writable() {
        return Err(IndexError::ReadOnly {
            url: url.to_string(),
            what: format!(
                "{rel} is Parquet, which is converted once to Arrow IPC written beside the data"
            ),
            fix: "index a copy of the dataset in a writable location".into(),
        });
    }
    let tmp = TempDir::new()?;
    let local = tmp.0.join("converted.arrow");
    let chunks = RemoteChunks::new(remote.object(&src));
    let name = remote.display(rel);
    let (row_groups, _) = convert_from(|| Ok(chunks.clone()), &name, &local, BATCH_LIMIT)
        .map_err(|e| temp_error(&tmp.0, e))?;
    let meta = remote.store().put_file(&cache_rel, &local)?;
    let side = serde_json::json!({
        "format": SIDECAR_FORMAT,
        "source": rel,
        "size": src.size,
        "etag": src.etag,
        "row_groups": row_groups,
        "arrow_size": meta.size,
    });
    let text = serde_json::to_vec_pretty(&side).unwrap_or_default();
    remote.store().put(&side_rel, Bytes::from(text))?;
    remote.insert(meta);
    // Indexed from the local copy; the open file outlives the temporary directory.
    let (file, len) = LocalFile::open(&local)?;
    note.reused = false;
    note.row_groups = row_groups;
    let mut source = Source::new(remote.display(&cache_rel), &cache_rel, len, Box::new(file));
    source.origin = Some(name);
    Ok((source, note))
}

/// The row-group count the sidecar records, when it matches the Parquet object `src` and the
/// cached object has the recorded size; `None` (convert again) otherwise.
fn still_valid(
    remote: &Remote,
    side_rel: &str,
    cache_rel: &str,
    src: &ObjectMeta,
) -> Result<Option<u64>, IndexError> {
    let (Some(cache), Some(side)) = (remote.meta(cache_rel), remote.meta(side_rel)) else {
        return Ok(None);
    };
    if side.size > MAX_SIDECAR {
        return Ok(None);
    }
    let text = remote
        .store()
        .read(side_rel, 0..side.size, side.etag.as_deref())?;
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return Ok(None);
    };
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    let etag = v.get("etag").and_then(serde_json::Value::as_str);
    let ok = num("format") == Some(SIDECAR_FORMAT)
        && num("size") == Some(src.size)
        && etag == src.etag.as_deref()
        && num("arrow_size") == Some(cache.size);
    Ok(if ok { num("row_groups") } else { None })
}

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self, IndexError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "shardwire-index-parquet-{}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| temp_error(&dir, IndexError::io(&dir, e)))?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
