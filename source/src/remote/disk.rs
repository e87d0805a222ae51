//! A FETCH's disk operations on its dataset's cache: the open and `fstat` of a hit's file, the
//! CRC read of an entry not checked since a restart or a node's report, and the unlink of one
//! that failed. Each runs on a blocking thread within a time limit, at most
//! [`crate::stat::FS_CHECKS`] of one file system at once over every dataset's cache, and none
//! of a file system while one of them is past its limit and has not returned: the bound of the
//! `fstat`s of local shard files ([`Limiter`], with a table of its own). Before, the open and
//! `fstat` ran on the runtime's worker threads: on a cache disk that stopped answering (an NFS
//! mount or a network block device whose server went away), two FETCHes of cached shards held
//! both, and every dataset, session, the accept loop and `/healthz` stopped; the CRC reads and
//! unlinks ran on blocking threads without a limit, one held per FETCH.
//!
//! An operation that does not return within its limit, or cannot start within it, is given
//! up: the FETCH reads the shard from the store instead (checked against its CRC there: never
//! a byte of a file that was not checked), the entry is left as it is, and a warning says so
//! (at most one every 10 s per dataset, those left out counted in the next;
//! `shardwire_source_cache_disk_given_up_total`). Every hit takes this thread hop, on a local
//! disk too: a network block device formatted ext4 looks like one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use shardwire_protocol::warn_limit::{self, WarnLimit};

use super::RemoteDataset;
use super::cache::{self, Found, Hit};
use crate::datasets::ShardChanged;
use crate::sender::Body;
use crate::stat::{Limiter, STAT_LIMIT};

/// What the cache's disk operations are called in their errors (`cache disk operation did
/// not return within 5s`).
const OP: &str = "cache disk operation";

/// Bytes a second below which a CRC read of an entry is taken for one on a disk that stopped
/// answering ([`CacheDisk::crc_limit`]).
const CRC_RATE: u64 = 16 << 20;

/// How the disk operations of one dataset's cache are bounded.
pub(super) struct CacheDisk {
    /// The operations under way, by file system: one table for every dataset's cache in the
    /// process ([`CacheDisk::shared`]), so a dead mount holds at most
    /// [`crate::stat::FS_CHECKS`] blocking threads however many datasets keep their cache on
    /// it.
    checks: Limiter,
    /// How long an open and `fstat`, or an unlink, may run once started, and wait to start
    /// ([`STAT_LIMIT`]); a CRC read has longer, by the entry's length.
    limit: Duration,
    /// Its warnings, one every [`warn_limit::EVERY`] at most.
    warns: Mutex<WarnLimit<()>>,
}

impl CacheDisk {
    /// The bound of a dataset's cache: [`STAT_LIMIT`], with the process's table.
    pub(super) fn shared() -> Self {
        static CHECKS: LazyLock<Limiter> = LazyLock::new(|| Limiter::new(OP));
        Self::with(CHECKS.clone(), STAT_LIMIT)
    }

    /// A test's bound, `limit`, with a table of its own: tests that run at once, each with a
    /// cache of its own on one file system, do not refuse each other's operations.
    #[cfg(test)]
    pub(super) fn own(limit: Duration) -> Self {
        Self::with(Limiter::new(OP), limit)
    }

    /// With the table `checks` and the limit `limit`.
    fn with(checks: Limiter, limit: Duration) -> Self {
        CacheDisk {
            checks,
            limit,
            warns: Mutex::new(WarnLimit::new(warn_limit::EVERY)),
        }
    }

    /// How long the CRC read of an entry of `len` bytes may run: the limit, and a second
    /// more per [`CRC_RATE`] bytes.
    fn crc_limit(&self, len: u64) -> Duration {
        self.limit + Duration::from_secs(len / CRC_RATE)
    }
}

/// Lets the cache take a shard again ([`cache::DiskCache::deleted`]) when dropped: by the
/// unlink of its old file once it returned, however late, or unrun where it never started (no
/// unlink of that name is pending then).
struct Deleted {
    dataset: Arc<RemoteDataset>,
    shard: u32,
}

impl Drop for Deleted {
    fn drop(&mut self) {
        if let Some(c) = &self.dataset.cache {
            let mut c = c.lock().unwrap_or_else(PoisonError::into_inner);
            c.deleted(self.shard);
        }
    }
}

impl RemoteDataset {
    /// The cached entry of `shard` as a payload; an entry kept over a restart, or one a node
    /// reported corrupt ([`Self::corrupt_reported`]), is checked against its CRC first (and
    /// deleted if it fails). The cache's lock is held for its index only; the entry's file is
    /// opened, measured and checked outside it, on blocking threads within a time limit
    /// ([`Self::disk_op`]): `None` (the FETCH reads the store) where one of those does not
    /// answer in time.
    pub(super) async fn cached(self: &Arc<Self>, shard: u32) -> Option<Body> {
        let cache = self.cache.as_ref()?;
        let found = cache.lock().expect("poisoned").lookup(shard)?;
        let at = (found.dev, found.path.clone());
        let (hit, size) = self.open_entry(found).await?;
        // A file cut short since it was written (a disk error, an operator) would end the
        // node's whole session mid-payload, again on every session it is sent to.
        if size.as_ref().ok() != Some(&hit.len) {
            let found = size.map_or_else(|e| format!("unreadable: {e}"), |n| format!("{n} bytes"));
            tracing::warn!(dataset = %self.name, shard, want = hit.len, %found,
                "a cache entry is not the length it was written with; deleted, reading the shard again");
            let doomed = cache
                .lock()
                .expect("poisoned")
                .remove_cut_short(shard, hit.id);
            self.discard(shard, at.0, doomed).await;
            return None;
        }
        if !hit.verified && !self.crc_matches(shard, &hit, &at).await {
            return None;
        }
        Some(Body::File {
            file: Arc::new(hit.file),
            offset: 0,
        })
    }

    /// Opens the file of the entry `found` and measures it, on a blocking thread
    /// ([`Self::disk_op`]); `None` where it is gone ([`Found::open`] hands it to
    /// [`cache::DiskCache::lost`]), cannot be opened, or did not answer in time.
    async fn open_entry(self: &Arc<Self>, found: Found) -> Option<(Hit, std::io::Result<u64>)> {
        let (dev, path) = (found.dev, found.path.clone());
        let me = Arc::clone(self);
        let open = move || {
            let hit = found.open(|s, id| {
                if let Some(c) = &me.cache {
                    c.lock().expect("poisoned").lost(s, id);
                }
            })?;
            let size = hit.file.metadata().map(|m| m.len());
            Some((hit, size))
        };
        self.disk_op("open", (dev, &path), self.disk.limit, open)
            .await
            .flatten()
    }

    /// Whether the file of `hit`, `shard`'s entry at `at` (file system, path) not checked
    /// since a restart or a report, matches the shard's CRC, read on a blocking thread
    /// ([`Self::disk_op`], within a limit by its length): then the entry counts as checked.
    /// If it does not, the entry is deleted ([`Self::discard`]); if it was not read in time,
    /// the entry stays, to be checked at its next serve. False in both cases (the FETCH
    /// reads the store).
    async fn crc_matches(self: &Arc<Self>, shard: u32, hit: &Hit, at: &(u64, PathBuf)) -> bool {
        let Some(cache) = self.cache.as_ref() else {
            return false;
        };
        let want = self.shards[shard as usize].crc32c;
        let Ok(file) = hit.file.try_clone() else {
            return false;
        };
        let limit = self.disk.crc_limit(hit.len);
        let read = move || file_crc(&file);
        let Some(got) = self.disk_op("CRC read", (at.0, &at.1), limit, read).await else {
            return false;
        };
        if got.as_ref().ok() == Some(&want) {
            cache.lock().expect("poisoned").verified(shard, hit.id);
            return true;
        }
        let found = got.map_or_else(|e| format!("unreadable: {e}"), |crc| format!("{crc:#010x}"));
        tracing::warn!(dataset = %self.name, shard, want = format_args!("{want:#010x}"), %found,
            "a cache entry failed its CRC check (kept over a restart, or reported corrupt by a node); deleted, reading the shard again");
        let doomed = cache
            .lock()
            .expect("poisoned")
            .remove_unverified(shard, hit.id);
        self.discard(shard, at.0, doomed).await;
        false
    }

    /// Deletes `doomed`, the file of `shard`'s entry taken out of the cache's index, on a
    /// blocking thread ([`Self::disk_op`]; `dev`: the cache's file system), then lets the
    /// cache take the shard again ([`Deleted`]), on that thread too: a FETCH cancelled
    /// meanwhile leaves no shard that is never cached again. An unlink that does not return
    /// in time lets the shard be cached again once it returns; one that never started does
    /// at once, its file left in place (a new entry of the shard replaces it by a rename;
    /// else the next start deletes it, or keeps and checks it).
    async fn discard(self: &Arc<Self>, shard: u32, dev: u64, doomed: Option<PathBuf>) {
        let Some(p) = doomed else { return };
        let path = p.clone();
        let done = Deleted {
            dataset: Arc::clone(self),
            shard,
        };
        let unlink = move || {
            cache::delete(&p);
            drop(done);
        };
        let _ = self
            .disk_op("unlink", (dev, &path), self.disk.limit, unlink)
            .await;
    }

    /// Runs `op` (`what`: an open, a CRC read, an unlink) of the cache file `path` of file
    /// system `dev` on a blocking thread within `limit` ([`Limiter`]); `None` if it did not
    /// return in time or could not start, counted and logged (the caller reads the shard from
    /// the store).
    async fn disk_op<T, F>(
        &self,
        what: &str,
        (dev, path): (u64, &Path),
        limit: Duration,
        op: F,
    ) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let name = path.display().to_string();
        let checks = &self.disk.checks;
        let got = checks.on_device(dev, &name, limit, move || Ok(op()));
        let why = match got.await {
            Ok(done) => return Some(done),
            Err(ShardChanged::Stat { source, .. }) => source.to_string(),
            Err(other) => other.to_string(),
        };
        let dataset = self.name.clone();
        metrics::counter!("shardwire_source_cache_disk_given_up_total", "dataset" => dataset)
            .increment(1);
        let warns = &self.disk.warns;
        let mut warns = warns.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(suppressed) = warns.hit((), Instant::now()) {
            tracing::warn!(dataset = %self.name, file = %name, operation = what, error = %why,
                suppressed, "a cache disk operation did not answer in time, or could not start \
                 (check the file system of cache_dir); this FETCH reads the shard from the \
                 store (an entry not opened or not checked stays cached, a file not deleted is \
                 replaced or deleted later); one such line every 10 s at most per dataset, \
                 `suppressed` counts those left out since the last");
        }
        None
    }
}

/// CRC-32C of a whole file.
fn file_crc(file: &std::fs::File) -> std::io::Result<u32> {
    use std::io::Read;
    let mut crc = shardwire_protocol::crc::Crc32c::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut r = file;
    loop {
        match r.read(&mut buf)? {
            0 => return Ok(crc.finish()),
            n => crc.update(&buf[..n]),
        }
    }
}
