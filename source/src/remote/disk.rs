//! A FETCH's disk operations on its dataset's cache: the open and `fstat` of a hit's file, the CRC
//! read of an entry not checked since a restart or a node's report, and the unlink of one that
//! failed. Each runs on a blocking thread under a [`Limiter`] shared by every dataset's cache (the
//! bound of the `fstat`s of local shard files, with tables of their own): at most
//! [`crate::stat::FS_CHECKS`] opens and unlinks of one file system at once, and [`CRC_READS`] CRC
//! reads in slots of their own, so a hit's open never waits behind the read of a whole entry
//! (before, they shared the 4 slots: after a restart, the first serves' CRC reads of large entries
//! kept every dataset's hits on that disk from starting, and those read the store); and none of a
//! kind on a file system while one of that kind is past its limit and has not returned. An open or
//! an unlink has [`STAT_LIMIT`] once started; a CRC read runs as long as it moves, and is given up
//! once one read of 1 MiB did not return within [`STAT_LIMIT`] (before, 1 s per 16 MiB of the entry
//! in all: a slow but moving read on a busy disk counted as one on a dead mount), and told to stop
//! once it ran [`STAT_LIMIT`] plus 1 s per 4 MiB of the entry ([`CRC_MIN_RATE`]): it ends at its
//! next 1 MiB (not counted as hung; its FETCH waits for that at most [`STAT_LIMIT`] more), or
//! counts as hung if that read does not return within [`STAT_LIMIT`].
//! Each may wait [`STAT_LIMIT`] to start. Before any of this, the open and `fstat` ran on the
//! runtime's worker threads: on a cache disk that stopped answering (an NFS mount or a network
//! block device whose server went away), two FETCHes of cached shards held both, and every dataset,
//! session, the accept loop and `/healthz` stopped.
//!
//! An operation that did not return in time, could not start in time, or (a CRC read) moved
//! too slowly to wait for, is given up: the FETCH reads the shard from the store at once, without
//! looking in the cache again ([`Cached::GaveUp`]; checked against its CRC there: never a byte of
//! a file that was not checked), the entry is left as it is, and a warning says so, one that could
//! not start (the source is busy) and one too slow (the disk answers, slowly) told apart from one
//! that did not answer (check the file system); at most one of each every 10 s per dataset, those
//! left out counted in the next; one count per FETCH in
//! `shardwire_source_cache_disk_given_up_total`. Every hit takes this thread hop, on a local disk
//! too: a network block device formatted ext4 looks like one.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use shardwire_protocol::warn_limit::{self, WarnLimit};

use super::cache::{self, Found, Hit};
use super::{Cached, RemoteDataset};
use crate::datasets::ShardChanged;
use crate::sender::Body;
use crate::stat::{self, Limiter, Progress, STAT_LIMIT};

/// What the opens, `fstat`s and unlinks of cache files are called in their errors (`cache
/// disk operation did not return within 5s`).
const OP: &str = "cache disk operation";

/// What the CRC reads of cache entries are called in their errors.
const CRC_OP: &str = "cache CRC read";

/// CRC reads of cache entries on one file system that run at once, over every dataset's
/// cache, in slots of their own (apart from the opens'): each reads a whole entry, and more
/// at once would only split the disk's bandwidth, which the cache writes and the sends share.
pub(super) const CRC_READS: usize = 2;

/// Bytes a CRC read reads at a time: a step of its progress ([`Progress::step`]).
const CRC_CHUNK: usize = 1 << 20;

/// How the disk operations of one dataset's cache are bounded.
pub(super) struct CacheDisk {
    /// The opens, `fstat`s and unlinks under way, by file system: one table for every
    /// dataset's cache in the process ([`CacheDisk::shared`]), so a dead mount holds at most
    /// [`crate::stat::FS_CHECKS`] blocking threads here however many datasets keep their
    /// cache on it.
    checks: Limiter,
    /// The CRC reads under way, by file system, [`CRC_READS`] at once: a table of their own,
    /// shared like `checks`.
    reads: Limiter,
    /// How long an open and `fstat`, or an unlink, may run once started, and any operation
    /// wait to start; how long one 1 MiB read of a CRC check may take ([`STAT_LIMIT`]).
    limit: Duration,
    /// Its warnings, one of each kind (did not answer, could not start, moved too slowly)
    /// every [`warn_limit::EVERY`] at most.
    warns: Mutex<WarnLimit<(bool, bool)>>,
    /// Operations given up so far (what `shardwire_source_cache_disk_given_up_total` counts).
    #[cfg(test)]
    given_up: std::sync::atomic::AtomicUsize,
}

impl CacheDisk {
    /// The bound of a dataset's cache: [`STAT_LIMIT`], with the process's tables.
    pub(super) fn shared() -> Self {
        static CHECKS: LazyLock<Limiter> = LazyLock::new(|| Limiter::new(OP));
        static READS: LazyLock<Limiter> = LazyLock::new(|| Limiter::with_slots(CRC_OP, CRC_READS));
        Self::with(CHECKS.clone(), READS.clone(), STAT_LIMIT)
    }

    /// A test's bound, `limit`, with tables of its own: tests that run at once, each with a
    /// cache of its own on one file system, do not refuse each other's operations.
    #[cfg(test)]
    pub(super) fn own(limit: Duration) -> Self {
        let reads = Limiter::with_slots(CRC_OP, CRC_READS);
        Self::with(Limiter::new(OP), reads, limit)
    }

    /// Operations given up so far.
    #[cfg(test)]
    pub(super) fn given_up(&self) -> usize {
        self.given_up.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// With the tables `checks` and `reads` and the limit `limit`.
    fn with(checks: Limiter, reads: Limiter, limit: Duration) -> Self {
        CacheDisk {
            checks,
            reads,
            limit,
            warns: Mutex::new(WarnLimit::new(warn_limit::EVERY)),
            #[cfg(test)]
            given_up: Default::default(),
        }
    }
}

/// An operation on a cache file was given up ([`RemoteDataset::answered`]).
#[derive(Debug)]
pub(super) struct GaveUp;

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
    /// The cached entry of `shard`; an entry kept over a restart, or one a node reported
    /// corrupt ([`Self::corrupt_reported`]), is checked against its CRC first (and deleted if
    /// it fails). The cache's lock is held for its index only; the entry's file is opened,
    /// measured and checked outside it, on blocking threads within a time limit
    /// ([`CacheDisk`]): [`Cached::GaveUp`] where one of those does not answer in time.
    pub(super) async fn cached(self: &Arc<Self>, shard: u32) -> Cached {
        let Some(cache) = self.cache.as_ref() else {
            return Cached::Miss;
        };
        let Some(found) = cache.lock().expect("poisoned").lookup(shard) else {
            return Cached::Miss;
        };
        let at = (found.dev, found.path.clone());
        let (hit, size) = match self.open_entry(found).await {
            Ok(Some(opened)) => opened,
            Ok(None) => return Cached::Miss,
            Err(GaveUp) => return Cached::GaveUp,
        };
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
            return match self.discard(shard, at.0, doomed).await {
                Ok(()) => Cached::Miss,
                Err(GaveUp) => Cached::GaveUp,
            };
        }
        if !hit.verified {
            match self.crc_matches(shard, &hit, &at).await {
                Ok(true) => {}
                Ok(false) => return Cached::Miss,
                Err(GaveUp) => return Cached::GaveUp,
            }
        }
        Cached::Hit(Body::File {
            file: Arc::new(hit.file),
            offset: 0,
        })
    }

    /// Opens the file of the entry `found` and measures it, on a blocking thread
    /// ([`Self::disk_op`]); `None` where it is gone ([`Found::open`] hands it to
    /// [`cache::DiskCache::lost`]) or cannot be opened.
    async fn open_entry(
        self: &Arc<Self>,
        found: Found,
    ) -> Result<Option<(Hit, io::Result<u64>)>, GaveUp> {
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
        self.disk_op("open", (dev, &path), open).await
    }

    /// Whether the file of `hit`, `shard`'s entry at `at` (file system, path) not checked
    /// since a restart or a report, matches the shard's CRC ([`Self::crc_read`]): then the
    /// entry counts as checked. If it does not (or cannot be read), the entry is deleted
    /// ([`Self::discard`]). If the read was given up, the entry stays, to be checked at its
    /// next serve; [`GaveUp`] then, and where the unlink was.
    async fn crc_matches(
        self: &Arc<Self>,
        shard: u32,
        hit: &Hit,
        at: &(u64, PathBuf),
    ) -> Result<bool, GaveUp> {
        let Some(cache) = self.cache.as_ref() else {
            return Ok(false);
        };
        let want = self.shards[shard as usize].crc32c;
        let Ok(file) = hit.file.try_clone() else {
            return Ok(false);
        };
        let got = self.crc_read(file, hit.len, (at.0, &at.1)).await?;
        if got.as_ref().ok() == Some(&want) {
            cache.lock().expect("poisoned").verified(shard, hit.id);
            return Ok(true);
        }
        let found = got.map_or_else(|e| format!("unreadable: {e}"), |crc| format!("{crc:#010x}"));
        tracing::warn!(dataset = %self.name, shard, want = format_args!("{want:#010x}"), %found,
            "a cache entry failed its CRC check (kept over a restart, or reported corrupt by a node); deleted, reading the shard again");
        let doomed = cache
            .lock()
            .expect("poisoned")
            .remove_unverified(shard, hit.id);
        self.discard(shard, at.0, doomed).await?;
        Ok(false)
    }

    /// Deletes `doomed`, the file of `shard`'s entry taken out of the cache's index, on a
    /// blocking thread ([`Self::disk_op`]; `dev`: the cache's file system), then lets the
    /// cache take the shard again ([`Deleted`]), on that thread too: a FETCH cancelled
    /// meanwhile leaves no shard that is never cached again. An unlink that does not return
    /// in time lets the shard be cached again once it returns; one that never started does
    /// at once, its file left in place (a new entry of the shard replaces it by a rename;
    /// else the next start deletes it, or keeps and checks it). [`GaveUp`] in both cases.
    pub(super) async fn discard(
        self: &Arc<Self>,
        shard: u32,
        dev: u64,
        doomed: Option<PathBuf>,
    ) -> Result<(), GaveUp> {
        let Some(p) = doomed else { return Ok(()) };
        let path = p.clone();
        let done = Deleted {
            dataset: Arc::clone(self),
            shard,
        };
        let unlink = move || {
            cache::delete(&p);
            drop(done);
        };
        self.disk_op("unlink", (dev, &path), unlink).await
    }

    /// Runs `op` (`what`: an open, an unlink) of the cache file `path` of file system `dev`
    /// on a blocking thread within the limit ([`CacheDisk::checks`]); [`GaveUp`] if it did
    /// not return in time or could not start ([`Self::answered`]).
    async fn disk_op<T, F>(&self, what: &str, (dev, path): (u64, &Path), op: F) -> Result<T, GaveUp>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let name = path.display().to_string();
        let (checks, limit) = (&self.disk.checks, self.disk.limit);
        let got = checks.on_device(dev, &name, limit, move || Ok(op())).await;
        self.answered(what, &name, got)
    }

    /// The CRC-32C of `file`, the cache file `path` of file system `dev`, read on a blocking
    /// thread in the CRC reads' own slots ([`CacheDisk::reads`]) for as long as it moves
    /// ([`Limiter::on_device_moving`]), told to stop past [`crc_total`] (its last read then
    /// waited for, at most the limit); [`GaveUp`] if one read did not return within the limit,
    /// it was stopped past its total, or it could not start ([`Self::answered`]).
    async fn crc_read(
        &self,
        file: File,
        len: u64,
        (dev, path): (u64, &Path),
    ) -> Result<io::Result<u32>, GaveUp> {
        let name = path.display().to_string();
        let at = path.to_path_buf();
        let read = move |progress: &Progress| Ok(file_crc(&file, &at, progress));
        let (reads, limit) = (&self.disk.reads, self.disk.limit);
        let got = reads.on_device_moving(dev, &name, (limit, crc_total(limit, len)), read);
        self.answered("CRC read", &name, got.await)
    }

    /// `got`, what operation `what` of the cache file `name` answered; where it was given up (it
    /// did not return within its limit, a CRC read ran past its total, an earlier one of its file
    /// system has not returned, or it could not start), counted and logged, and [`GaveUp`]: the
    /// caller reads the shard from the store.
    fn answered<T>(
        &self,
        what: &str,
        name: &str,
        got: Result<T, ShardChanged>,
    ) -> Result<T, GaveUp> {
        let e = match got {
            Ok(done) => return Ok(done),
            Err(e) => e,
        };
        let busy = stat::not_started(&e);
        let slow = stat::too_slow(&e);
        let why = match e {
            ShardChanged::Stat { source, .. } => source.to_string(),
            other => other.to_string(),
        };
        let dataset = self.name.clone();
        metrics::counter!("shardwire_source_cache_disk_given_up_total", "dataset" => dataset)
            .increment(1);
        #[cfg(test)]
        self.disk
            .given_up
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let warns = &self.disk.warns;
        let mut warns = warns.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(suppressed) = warns.hit((busy, slow), Instant::now()) else {
            return Err(GaveUp);
        };
        drop(warns);
        if slow {
            tracing::warn!(dataset = %self.name, file = %name, operation = what, error = %why,
                suppressed, "a cache entry's CRC read moved too slowly to wait for (the disk \
                 answers, slower than 4 MiB/s): this FETCH reads the shard from the store, the \
                 entry stays cached unchecked, and other operations on that file system go on; \
                 one such line every 10 s at most per dataset, `suppressed` counts those left \
                 out since the last");
        } else if busy {
            tracing::warn!(dataset = %self.name, file = %name, operation = what, error = %why,
                suppressed, "a cache disk operation could not start in time: the source is \
                 busy (the cache operations of this file system allowed at once were all under \
                 way, or no blocking thread was free), the disk need not be at fault; this FETCH \
                 reads the shard from the store (the entry stays cached, and an entry not \
                 checked is checked at its next serve); one such line every 10 s at most per \
                 dataset, `suppressed` counts those left out since the last");
        } else {
            tracing::warn!(dataset = %self.name, file = %name, operation = what, error = %why,
                suppressed, "a cache disk operation did not answer in time (check the file \
                 system of cache_dir: a network mount whose server stopped answering?); this \
                 FETCH reads the shard from the store, and so does every FETCH whose operation \
                 of that kind on that file system comes before it returns (an entry not opened \
                 or not checked stays cached, a file not deleted is replaced or deleted later); \
                 one such line every 10 s at most per dataset, `suppressed` counts those left \
                 out since the last");
        }
        Err(GaveUp)
    }
}

/// Below this rate a CRC read is told to stop (its FETCH reads the store; the read, ending at
/// its next 1 MiB, is not taken for a hung one): a slow disk that still moves would hold a
/// 1 GiB entry's FETCH past the node's limit for an unanswered fetch (30 min and 1 s per MiB).
const CRC_MIN_RATE: u64 = 4 << 20;

/// How long a CRC read of an entry of `len` bytes is waited for in all: `limit` and 1 s per
/// [`CRC_MIN_RATE`] bytes.
fn crc_total(limit: Duration, len: u64) -> Duration {
    limit + Duration::from_secs(len / CRC_MIN_RATE)
}

/// CRC-32C of the whole file `file` (the cache file `path`), a step of `progress` per chunk
/// read ([`CRC_CHUNK`]); ends early, with an error nobody reads, once its caller stopped
/// waiting for it (it gave the read up, or its FETCH was cancelled), freeing its slot.
fn file_crc(file: &File, path: &Path, progress: &Progress) -> io::Result<u32> {
    use std::io::Read;
    let mut crc = shardwire_protocol::crc::Crc32c::new();
    let mut buf = vec![0u8; CRC_CHUNK];
    let mut r = file;
    loop {
        before_read(path);
        let n = match r.read(&mut buf) {
            Ok(0) => return Ok(crc.finish()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        crc.update(&buf[..n]);
        if !progress.step() {
            return Err(io::Error::other("its caller stopped waiting for it"));
        }
    }
}

/// Before each read of a CRC check: a test may hold it back, or slow it down (`stall`).
fn before_read(path: &Path) {
    #[cfg(test)]
    cache::stall::pass(cache::stall::Op::Read, path);
    #[cfg(not(test))]
    let _ = path;
}
