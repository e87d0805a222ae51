//! Opening a [`RemoteDataset`]: the manifest read from beside the data, every object it names
//! listed (missing or shorter objects refuse the dataset at start, naming them), each pinned
//! to its ETag (every read sends `If-Match`), and the disk cache opened with the entries the
//! manifest still names.

use std::collections::HashMap;
use std::path::PathBuf;

use shardwire_protocol::Manifest;
use shardwire_protocol::manifest::{MANIFEST_FILE, ManifestError, ObjectEntry};
use shardwire_store::{Store, StoreError, StoreErrorKind, StoreOptions, StoreUrl};

use super::cache::{CacheError, DiskCache, entry_name};
use super::read::{Object, Want};

/// Source settings for object-storage datasets.
#[derive(Clone, Debug)]
pub struct RemoteOptions {
    /// Largest GET (`object_store_request_size`).
    pub request_size: u64,
    /// GETs in flight per bucket at most (`object_store_max_inflight`).
    pub max_inflight: usize,
    /// The disk cache's directory (`cache_dir`); `None`: no disk cache.
    pub cache_dir: Option<PathBuf>,
    /// Its size (`cache_size`).
    pub cache_size: u64,
}

/// Why an object-storage dataset cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The store refused or failed.
    #[error("dataset `{dataset}`: {source}")]
    Store {
        /// The dataset.
        dataset: String,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The manifest is not valid.
    #[error(
        "dataset `{dataset}`: {url}/{MANIFEST_FILE}: {source} (re-run `shardwire index {url}`)"
    )]
    Manifest {
        /// The dataset.
        dataset: String,
        /// Its URL.
        url: String,
        /// What is wrong.
        #[source]
        source: ManifestError,
    },
    /// An object the manifest names is missing, shorter than its shards, or changed.
    #[error(
        "dataset `{dataset}`: object {key} under {url}: {reason} (re-run `shardwire index {url}`)"
    )]
    Object {
        /// The dataset.
        dataset: String,
        /// Its URL.
        url: String,
        /// The object's key relative to the URL.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The cache cannot be used.
    #[error("dataset `{dataset}`: {source}")]
    Cache {
        /// The dataset.
        dataset: String,
        /// Why.
        #[source]
        source: CacheError,
    },
}

/// What opening a dataset found: its store, objects, shards and cache, and its manifest.
pub(super) struct Opened {
    pub store: Store,
    pub objects: Vec<Object>,
    pub shards: Vec<Want>,
    pub cache: Option<DiskCache>,
    pub manifest: Manifest,
    pub json: Vec<u8>,
}

/// Opens dataset `name` at `url`: reads its manifest, checks its objects, opens its cache.
pub(super) async fn open(
    name: &str,
    url: &StoreUrl,
    opts: &RemoteOptions,
) -> Result<Opened, OpenError> {
    let so = StoreOptions::sized(opts.request_size, opts.max_inflight);
    let store_err = |source| OpenError::Store {
        dataset: name.into(),
        source,
    };
    let store = Store::open(url, so).map_err(store_err)?;
    let manifest_err = |source| OpenError::Manifest {
        dataset: name.into(),
        url: url.to_string(),
        source,
    };
    // HEAD, then a GET pinned to its ETag; a manifest rewritten between the two (`shardwire
    // index` writing it now) is read again.
    let mut attempt = 0;
    let json = loop {
        attempt += 1;
        let head = patiently(|| store.head(MANIFEST_FILE))
            .await
            .map_err(store_err)?;
        Manifest::check_size(head.size).map_err(manifest_err)?;
        match patiently(|| store.read(MANIFEST_FILE, 0..head.size, head.etag.as_deref())).await {
            Err(e) if e.kind() == StoreErrorKind::Changed && attempt < START_ATTEMPTS => {
                tracing::warn!(error = %e, attempt, "the manifest changed while it was read (is `shardwire index` writing it?); reading it again");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            read => break read.map_err(store_err)?.to_vec(),
        }
    };
    let manifest = Manifest::from_json(&json).map_err(manifest_err)?;
    let listed = patiently(|| store.list()).await.map_err(store_err)?;
    let (objects, shards) = pin_objects(name, url, &manifest, &listed)?;
    let cache = open_cache(name, opts, &manifest, &objects, &shards)?;
    Ok(Opened {
        store,
        objects,
        shards,
        cache,
        manifest,
        json,
    })
}

/// Attempts at each start-up read while the store throttles or is unavailable.
const START_ATTEMPTS: u32 = 6;

/// A cache entry no hint names and not served for this many times, in cache accesses, the
/// shards the cache was asked for is cold ([`DiskCache::set_cold_after`]): this cache's own
/// traffic, which is a slice of the dataset's when several sources share it (behind one DNS
/// name). A FETCH makes up to three accesses (a lookup, a reservation, a lookup), and a shard
/// read once per epoch comes again at most two epochs later: 8 leaves room, so a dataset
/// still trained on keeps its whole slice, and an entry nobody asks for any more goes cold
/// after about 3 to 8 epochs of this cache's traffic.
const COLD_AFTER_EPOCHS: u64 = 8;

/// Longest pause between them, whatever `Retry-After` says: a start-up read gives up within
/// about 5 minutes (the store's own retries aside), not after hours of a server's say-so.
const MAX_START_PAUSE: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs a start-up read again (after 0.5 s, doubling, or the store's `Retry-After`) while the
/// store throttles or is unavailable, [`START_ATTEMPTS`] times at most: a source that starts
/// during a burst of 503s waits it out instead of exiting.
async fn patiently<T, F, Fut>(op: F) -> Result<T, StoreError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut wait = std::time::Duration::from_millis(500);
    for attempt in 1.. {
        match op().await {
            Err(e)
                if attempt < START_ATTEMPTS
                    && matches!(
                        e.kind(),
                        StoreErrorKind::Throttled | StoreErrorKind::Unavailable
                    ) =>
            {
                let pause = e
                    .retry_after()
                    .unwrap_or(wait)
                    .max(wait)
                    .min(MAX_START_PAUSE);
                tracing::warn!(error = %e, attempt, ?pause, "object store not ready at start; trying again");
                tokio::time::sleep(pause).await;
                wait *= 2;
            }
            other => return other,
        }
    }
    unreachable!("the loop returns")
}

/// The objects the manifest's shards live in, each with the ETag it is read at, and each
/// shard's read; refuses objects that are missing or shorter than their shards.
fn pin_objects(
    name: &str,
    url: &StoreUrl,
    m: &Manifest,
    listed: &[shardwire_store::ObjectMeta],
) -> Result<(Vec<Object>, Vec<Want>), OpenError> {
    let by_key: HashMap<&str, &shardwire_store::ObjectMeta> =
        listed.iter().map(|o| (o.key.as_str(), o)).collect();
    let bad = |key: &str, reason: String| OpenError::Object {
        dataset: name.into(),
        url: url.to_string(),
        key: key.into(),
        reason,
    };
    let indexed: HashMap<&str, &ObjectEntry> =
        m.objects.iter().map(|o| (o.file.as_str(), o)).collect();
    if m.objects.is_empty() {
        tracing::warn!(dataset = %name, %url, "the manifest records no ETags (indexed from a local directory?): objects are pinned to the ETags they have now; re-index with `shardwire index {url}` to have changes since indexing detected");
    }
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut objects: Vec<Object> = Vec::new();
    let mut shards = Vec::with_capacity(m.shards.len());
    for (i, s) in m.shards.iter().enumerate() {
        let object = match index.get(s.file.as_str()) {
            Some(&o) => o,
            None => {
                let meta = by_key.get(s.file.as_str()).ok_or_else(|| {
                    bad(&s.file, "is not in the store (a stale manifest?)".into())
                })?;
                let etag = meta.etag.clone().ok_or_else(|| {
                    bad(
                        &s.file,
                        "the store reports no ETag, so a change could not be detected".into(),
                    )
                })?;
                check_indexed(&indexed, m, &s.file, meta.size, &etag)
                    .map_err(|r| bad(&s.file, r))?;
                objects.push(Object {
                    key: s.file.clone(),
                    size: meta.size,
                    etag,
                });
                index.insert(&s.file, objects.len() - 1);
                objects.len() - 1
            }
        };
        let end = s.offset + s.length;
        if end > objects[object].size {
            return Err(bad(
                &s.file,
                format!("is {} bytes, shard {i} needs {end}", objects[object].size),
            ));
        }
        shards.push(Want {
            shard: i as u32,
            object,
            range: s.offset..end,
            crc32c: s.crc32c,
        });
    }
    Ok((objects, shards))
}

/// Whether object `file` (now `size` bytes, ETag `etag`) is what the manifest indexed; the
/// reason it is not.
fn check_indexed(
    indexed: &HashMap<&str, &ObjectEntry>,
    m: &Manifest,
    file: &str,
    size: u64,
    etag: &str,
) -> Result<(), String> {
    let Some(o) = indexed.get(file) else {
        return match m.objects.is_empty() {
            true => Ok(()),
            false => Err("has no entry in the manifest's objects list".into()),
        };
    };
    if o.size != size {
        return Err(format!(
            "changed since it was indexed: {size} bytes, the manifest says {}",
            o.size
        ));
    }
    match &o.etag {
        Some(want) if !shardwire_store::same_etag(want, etag) => Err(format!(
            "changed since it was indexed: ETag {etag}, the manifest says {want}"
        )),
        _ => Ok(()),
    }
}

/// The dataset's disk cache (`cache_dir/NAME`), when one is configured.
fn open_cache(
    name: &str,
    opts: &RemoteOptions,
    m: &Manifest,
    objects: &[Object],
    shards: &[Want],
) -> Result<Option<DiskCache>, OpenError> {
    let Some(root) = &opts.cache_dir else {
        return Ok(None);
    };
    let cache_err = |source| OpenError::Cache {
        dataset: name.into(),
        source,
    };
    let largest = m.shards.iter().map(|s| s.length).max().unwrap_or(0);
    if largest > opts.cache_size {
        return Err(cache_err(CacheError::TooSmall {
            size: opts.cache_size,
            shard: largest,
            dataset: name.into(),
        }));
    }
    let expect = |s: u32| {
        let w = shards.get(s as usize)?;
        let o = &objects[w.object];
        let len = w.range.end - w.range.start;
        Some((
            entry_name(s, &o.key, &o.etag, (w.range.start, len), w.crc32c),
            len,
        ))
    };
    let (mut cache, loaded) =
        DiskCache::open(&root.join(name), opts.cache_size, expect).map_err(cache_err)?;
    cache.set_cold_after(COLD_AFTER_EPOCHS);
    cache.report_as(name); // the entries kept count from now on in /metrics
    tracing::info!(dataset = %name, dir = %root.join(name).display(), kept = loaded.kept,
        kept_bytes = loaded.kept_bytes, removed = loaded.removed.len() + loaded.over_size.len(), "disk cache opened");
    for f in &loaded.removed {
        tracing::info!(dataset = %name, file = %f, "removed a cache entry the manifest no longer names");
    }
    for f in &loaded.foreign {
        tracing::warn!(dataset = %name, dir = %root.join(name).display(), file = %f,
            "not a cache file (left alone): give each dataset's cache a directory of its own");
    }
    for f in &loaded.over_size {
        tracing::info!(dataset = %name, file = %f, cache_size = opts.cache_size,
            "removed a cache entry beyond cache_size (lowered since it was written)");
    }
    Ok(Some(cache))
}
