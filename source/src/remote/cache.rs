//! The source's disk cache of verified shards (`cache_dir`, bounded by `cache_size`): one
//! file per shard, served with `sendfile` like a local dataset's files. A shard is admitted
//! if it fits, or if cold entries can make room, and those go; otherwise it passes through
//! uncached. An entry is cold when no node's hint names it and it was not served for a few
//! times, in accesses, the shards this cache was asked for lately
//! ([`DiskCache::set_cold_after`]): an entry no hint names may still be needed beyond the
//! hints' horizon (a few hundred shards ahead), later this epoch or the next, and evicting it
//! would cost a GET then, while the shard it would make room for was read already. So an
//! epoch larger than the cache keeps the same cached slice from epoch to epoch instead of
//! churning (an LRU cache would re-download all of it), and the entries of shards nobody
//! reads any more (or no longer routed to this source) make way within a few epochs of this
//! cache's own traffic.
//!
//! Entries are named by what they hold (shard, and a hash of its object key, ETag, range and
//! CRC), so after a restart an entry is kept only if the manifest still names the same bytes
//! and its size matches; the rest are deleted and named in the log, and so are kept entries
//! beyond a `cache_size` lowered since. A kept entry is checked against its CRC the first
//! time it is served again.
//!
//! No disk operation runs under the cache's lock, which the dataset's FETCHes, hints and
//! reads take (a cache disk that stops answering would hold them all, and the runtime's
//! threads with them): the lock keeps the index only. [`DiskCache::lookup`] names an entry's
//! file, opened outside the lock ([`Found::open`]; the dataset runs it on a blocking thread
//! within a time limit, `RemoteDataset::cached`, so a stalled disk holds no runtime thread
//! either). [`DiskCache::reserve`] decides and makes room in the index; the caller deletes the
//! evicted entries' files ([`Reservation::discard_evicted`]), writes [`Reservation::temp`] and
//! renames it into place ([`Reservation::install`]), or sets it aside if it is not kept, all
//! outside the lock, and only then tells the cache ([`DiskCache::commit`] or `abort`). An
//! entry taken out because it failed a check is deleted the same way ([`DiskCache::deleted`]).
//! A shard whose old file is still being deleted is not reserved again until it is gone (it
//! passes through this time), so no new file takes the name of one being deleted, and a
//! reader that looked an entry up before it went opens either its whole file or none (then
//! reads the store). Names that start with `.` (partial writes, discarded files) are deleted
//! at the next start.

mod claims;
#[cfg(test)]
pub(super) mod stall;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Why the cache cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The directory cannot be created or read.
    #[error("cache_dir {dir}: {source}")]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file this cache wrote and does not keep (the manifest no longer names its bytes, a
    /// partial write, an entry beyond a lowered `cache_size`) cannot be deleted at start.
    #[error(
        "cache_dir {dir}: the stale cache file {file} cannot be deleted: {source}; give the \
         source write access to cache_dir, or delete the file"
    )]
    Stale {
        /// The directory.
        dir: PathBuf,
        /// The file.
        file: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file system has less room than `cache_size` asks for, with what this process's
    /// other caches on it claim.
    #[error(
        "cache_dir {dir} has {free} bytes free (plus {held} in cache entries), less than cache_size {size}{}: lower cache_size or free space",
        others_text(others)
    )]
    NoRoom {
        /// The directory.
        dir: PathBuf,
        /// Bytes free on its file system.
        free: u64,
        /// Bytes its kept entries hold.
        held: u64,
        /// The configured size.
        size: u64,
        /// The other caches of this source on the same file system: (directory, bytes each
        /// may still take).
        others: Vec<(PathBuf, u64)>,
    },
    /// The cache cannot hold even the largest shard.
    #[error(
        "cache_size {size} is smaller than the largest shard ({shard} bytes, dataset `{dataset}`): raise cache_size or leave cache_dir unset"
    )]
    TooSmall {
        /// The configured size.
        size: u64,
        /// The largest shard's length.
        shard: u64,
        /// Its dataset.
        dataset: String,
    },
}

/// The file name of shard `shard` whose bytes are `key` at `offset..offset+len` of the object
/// with `etag`, with CRC-32C `crc32c`.
pub fn entry_name(
    shard: u32,
    key: &str,
    etag: &str,
    (offset, len): (u64, u64),
    crc32c: u32,
) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for x in b {
            h = (h ^ u64::from(*x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0000_0100_0000_01b3);
    };
    eat(key.as_bytes());
    eat(etag.as_bytes());
    eat(&offset.to_be_bytes());
    eat(&len.to_be_bytes());
    eat(&crc32c.to_be_bytes());
    format!("{shard:08}-{h:016x}.shard")
}

#[derive(Debug)]
struct Entry {
    name: String,
    len: u64,
    /// Which entry this is: one written anew for the same shard has another
    /// ([`DiskCache::lost`], [`DiskCache::remove_cut_short`]).
    id: u64,
    /// Checked against its CRC since it was written or loaded.
    verified: bool,
    /// The cache's clock when it was last written or served.
    last: u64,
}

/// What [`DiskCache::open`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// Entries kept (same bytes, same size).
    pub kept: usize,
    /// Bytes they hold.
    pub kept_bytes: u64,
    /// Files deleted (names the manifest no longer has, wrong sizes, partial writes).
    pub removed: Vec<String>,
    /// Entries the manifest still names, deleted because they no longer fit `cache_size`
    /// (lowered since they were written).
    pub over_size: Vec<String>,
    /// Names that are not this cache's files (another program's, a directory): left alone.
    pub foreign: Vec<String>,
}

/// The id (`st_dev`) and free bytes of the file system holding a directory.
type Room = dyn Fn(&Path) -> std::io::Result<(u64, u64)>;

/// [`Room`] as the kernel reports it.
fn measured_room(dir: &Path) -> std::io::Result<(u64, u64)> {
    let st = rustix::fs::statvfs(dir)?;
    let fs = rustix::fs::stat(dir)?.st_dev;
    Ok((fs, st.f_bavail.saturating_mul(st.f_frsize)))
}

/// `` with the other caches' claims `` in a [`CacheError::NoRoom`] message.
fn others_text(others: &[(PathBuf, u64)]) -> String {
    if others.is_empty() {
        return String::new();
    }
    let each: Vec<String> = others
        .iter()
        .map(|(d, b)| format!("{} {b}", d.display()))
        .collect();
    format!(
        " with the other caches of this source on that file system (each dataset has its own \
         cache of cache_size), which may still take: {}",
        each.join(", ")
    )
}

/// True for the names this cache writes: entries ([`entry_name`]:
/// `NNNNNNNN-HHHHHHHHHHHHHHHH.shard`), their partial writes and written files not kept
/// (`.<entry>.partial`, `.<entry>.discarded`: [`set_aside`]), and the evicted files that
/// earlier versions renamed aside (`.<entry>.evicted`).
fn is_cache_file(name: &str) -> bool {
    let entry = name
        .strip_prefix('.')
        .and_then(|n| {
            n.strip_suffix(".partial")
                .or_else(|| n.strip_suffix(".evicted"))
                .or_else(|| n.strip_suffix(".discarded"))
        })
        .unwrap_or(name);
    let Some((shard, hash)) = entry.strip_suffix(".shard").and_then(|s| s.split_once('-')) else {
        return false;
    };
    shard.len() >= 8
        && shard.bytes().all(|b| b.is_ascii_digit())
        && hash.len() == 16
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Accesses a generation of [`Asked`] lasts, per shard it counts: 8, so the two generations
/// counted span at least 8 accesses per shard of the cache's slice, more than come between
/// two asks of a shard still read (a FETCH makes up to three accesses, and a shard read once
/// per epoch comes again at most two epochs later: 6 per shard).
const GENERATION_PER_SHARD: u64 = 8;

/// The shards a cache was asked for lately (looked up or reserved): those of this
/// generation of its accesses and of the one before. A generation ends once it made
/// [`GENERATION_PER_SHARD`] accesses per shard counted, and the one before it is forgotten:
/// a shard still read stays counted, one no longer asked for (routed to another source)
/// stops counting within two generations. Forgetting a generation costs a pass over its own
/// shards, not over the bitset, and keeps the memory for the next one.
#[derive(Debug, Default)]
struct Asked {
    /// This generation's shards.
    now: Shards,
    /// The shards of the generation before.
    before: Shards,
    /// Shards in either.
    distinct: u64,
    /// Accesses in this generation.
    accesses: u64,
}

impl Asked {
    /// One access, for `shard`: it counts in this generation (which ends first if it is over).
    fn note(&mut self, shard: u32) {
        if self.accesses >= GENERATION_PER_SHARD.saturating_mul(self.distinct) {
            std::mem::swap(&mut self.now, &mut self.before);
            self.now.clear();
            self.distinct = self.before.len();
            self.accesses = 0;
        }
        self.accesses += 1;
        if self.now.insert(shard) && !self.before.contains(shard) {
            self.distinct += 1;
        }
    }
}

/// A set of shards: a bit each, and a list of them to clear those bits by.
#[derive(Debug, Default)]
struct Shards {
    bits: Vec<u64>,
    listed: Vec<u32>,
}

impl Shards {
    /// The word of `shard`'s bit, and the bit.
    fn at(shard: u32) -> (usize, u64) {
        (shard as usize / 64, 1u64 << (shard % 64))
    }

    /// Whether `shard` is in.
    fn contains(&self, shard: u32) -> bool {
        let (word, bit) = Self::at(shard);
        self.bits.get(word).is_some_and(|w| w & bit != 0)
    }

    /// Adds `shard`; false if it was in already.
    fn insert(&mut self, shard: u32) -> bool {
        let (word, bit) = Self::at(shard);
        if word >= self.bits.len() {
            self.bits.resize(word + 1, 0);
        }
        if self.bits[word] & bit != 0 {
            return false;
        }
        self.bits[word] |= bit;
        self.listed.push(shard);
        true
    }

    /// Empties it in O(its shards), keeping its memory.
    fn clear(&mut self) {
        for s in self.listed.drain(..) {
            self.bits[s as usize / 64] = 0;
        }
    }

    /// How many.
    fn len(&self) -> u64 {
        self.listed.len() as u64
    }
}

/// Room made for one shard; outside the cache's lock, delete the evicted files
/// ([`Self::discard_evicted`]), write [`Self::temp`] and rename it into place
/// ([`Self::install`]); then, under the lock, commit or abort.
#[derive(Debug)]
pub struct Reservation {
    /// The shard.
    pub shard: u32,
    /// Its entry's name.
    pub name: String,
    /// Its length.
    pub len: u64,
    /// Where to write it (renamed into place by [`Self::install`]).
    pub temp: PathBuf,
    /// Entries evicted to make room (already out of the index; their shards are reserved
    /// again only once this reservation is committed or aborted).
    pub evicted: Vec<u32>,
    /// Their files, still under their names: deleted by [`Reservation::discard_evicted`].
    pub doomed: Vec<PathBuf>,
}

impl Reservation {
    /// Deletes the evicted entries' files (outside the cache's lock: unlinking a large file
    /// can take a while, and a disk can stall); a file already gone is no error, any other
    /// failure is logged (a restart deletes what the manifest no longer names, or keeps it
    /// as an entry).
    pub fn discard_evicted(&self) {
        for p in &self.doomed {
            delete(p);
        }
    }

    /// Renames the written [`Self::temp`] into place, outside the cache's lock (then
    /// [`DiskCache::commit`]); if that fails, the file is set aside ([`CommitError::doomed`];
    /// then [`DiskCache::abort`]).
    pub fn install(&self) -> Result<(), CommitError> {
        let live = self.temp.with_file_name(&self.name);
        match rename(&self.temp, &live) {
            Ok(()) => Ok(()),
            Err(source) => Err(CommitError {
                source,
                doomed: set_aside(&self.temp),
            }),
        }
    }

    /// Sets [`Self::temp`] aside, where the write failed (then [`DiskCache::abort`]); returns
    /// the file to delete ([`delete`]: a partial write may be as large as a shard), `None` if
    /// there is none.
    #[must_use = "the file set aside is deleted by `delete`, or at the next start"]
    pub fn set_aside(&self) -> Option<PathBuf> {
        set_aside(&self.temp)
    }
}

/// Deletes `file`, a file of the cache in `dir` that it does not keep, at start; a file
/// already gone is no error.
fn delete_stale(dir: &Path, file: PathBuf) -> Result<(), CacheError> {
    match std::fs::remove_file(&file) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CacheError::Stale {
            dir: dir.to_path_buf(),
            file,
            source,
        }),
    }
}

/// Deletes the cache file `p` (outside the cache's lock; a test can hold it back, `stall`); a
/// file already gone is no error, any other failure is logged (the next start deletes what the
/// index does not name).
pub fn delete(p: &Path) {
    #[cfg(test)]
    stall::pass(stall::Op::Unlink, p);
    match std::fs::remove_file(p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(file = %p.display(), error = %e,
            "a cache file could not be deleted; the next start deletes it"),
    }
}

/// [`std::fs::rename`], which a test can hold back (`stall`).
fn rename(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    stall::pass(stall::Op::Rename, to);
    std::fs::rename(from, to)
}

/// Renames `temp`, the file of a reservation that is not kept, out of the way (a rename is
/// quick, and a later reservation of the same entry may write `temp` anew once this one is
/// aborted); returns the path to delete ([`delete`]), `None` if there is no file (the write
/// failed before making it). Its name starts with `.`: a restart deletes it if nothing else
/// does.
fn set_aside(temp: &Path) -> Option<PathBuf> {
    let aside = temp.with_extension("discarded");
    match rename(temp, &aside) {
        Ok(()) => Some(aside),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!(file = %temp.display(), error = %e,
                "setting a partial cache file aside failed; it is deleted under its own name");
            Some(temp.to_path_buf())
        }
    }
}

/// A written reservation that could not become an entry ([`Reservation::install`]).
#[derive(Debug, thiserror::Error)]
#[error("cannot rename the written cache file into place: {source}")]
pub struct CommitError {
    /// Why the rename failed.
    #[source]
    pub source: std::io::Error,
    /// The written file, set aside: delete it ([`delete`]).
    pub doomed: Option<PathBuf>,
}

/// An entry found by [`DiskCache::lookup`]: open it outside the cache's lock
/// ([`Found::open`]).
#[derive(Debug, Clone)]
pub struct Found {
    /// Its shard.
    pub shard: u32,
    /// Its file.
    pub path: PathBuf,
    /// Its length.
    pub len: u64,
    /// False for an entry kept over a restart and not served since: check it first.
    pub verified: bool,
    /// Which entry it is ([`DiskCache::lost`]).
    pub id: u64,
    /// The file system of the cache's directory (its `st_dev`): what bounds the disk
    /// operations on its files (`crate::stat::Limiter`).
    pub dev: u64,
}

impl Found {
    /// Opens the entry's file (outside the cache's lock, and off the runtime's threads: an
    /// open can block on a stalled disk; a test can hold it back, `stall`). An entry whose
    /// file is gone (deleted behind the source's back, or just now evicted) is handed to
    /// `lost` ([`DiskCache::lost`]: it leaves the index, named in the log, so the shard is
    /// read and cached again instead of passing through uncached for good); one that cannot
    /// be opened for another reason (out of file descriptors or memory, permissions) stays,
    /// and this FETCH reads the shard from the store.
    pub fn open(self, lost: impl FnOnce(u32, u64)) -> Option<Hit> {
        #[cfg(test)]
        stall::pass(stall::Op::Open, &self.path);
        match File::open(&self.path) {
            Ok(file) => Some(Hit {
                file,
                len: self.len,
                verified: self.verified,
                id: self.id,
            }),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(file = %self.path.display(), error = %err,
                    "a cache entry's file is gone; dropped from the cache, the shard is read again");
                lost(self.shard, self.id);
                None
            }
            Err(err) => {
                tracing::warn!(file = %self.path.display(), error = %err,
                    "a cache entry's file cannot be opened; kept, the shard is read from the store this time");
                None
            }
        }
    }
}

/// A served entry: its open file and whether it was checked since it was loaded.
#[derive(Debug)]
pub struct Hit {
    /// The entry's file.
    pub file: File,
    /// Its length.
    pub len: u64,
    /// False for an entry kept over a restart and not served since: check it first.
    pub verified: bool,
    /// Which entry it is ([`DiskCache::remove_cut_short`], [`DiskCache::remove_unverified`],
    /// [`DiskCache::verified`]).
    pub id: u64,
}

/// One dataset's cache directory.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    /// The file system of `dir` (its `st_dev`; found by [`DiskCache::check_room`]).
    dev: u64,
    capacity: u64,
    /// Bytes of entries plus reservations (shared with its claim).
    used: claims::Used,
    entries: HashMap<u32, Entry>,
    /// The entries by when they were last written or served (`Entry::last`), oldest first:
    /// [`DiskCache::reserve`] looks at the oldest only.
    by_last: BTreeSet<(u64, u32)>,
    /// The id of the next entry ([`Entry::id`]).
    next_id: u64,
    reserved: HashMap<u32, u64>,
    /// Shards whose entry left the index and whose file is still to be deleted, outside the
    /// lock: not reserved again until it is ([`DiskCache::deleted`], or the commit or abort
    /// of the reservation that evicted it).
    going: HashSet<u32>,
    /// Entries the last [`DiskCache::reserve`] looked at for room.
    #[cfg(test)]
    visited: usize,
    /// Accesses so far (every lookup and every reservation): the cache's clock.
    clock: u64,
    /// An entry no hint names and not served for more accesses than this many times the
    /// shards asked for lately is cold: it may go ([`DiskCache::set_cold_after`]).
    cold_epochs: u64,
    /// The shards this cache was asked for lately: how many is the size of its own slice of
    /// the dataset.
    asked: Asked,
    /// The room it may still take on its file system, claimed in this process (`None` until
    /// [`DiskCache::check_room`]).
    claim: Option<claims::Claim>,
    /// `shardwire_source_cache_bytes` of its dataset ([`DiskCache::report_as`]), set at every
    /// change of [`DiskCache::used`].
    gauge: metrics::Gauge,
}

impl DiskCache {
    /// Opens `dir` (created if missing) holding at most `capacity` bytes; keeps the files that
    /// `expect(shard)` still names with their size, deletes the rest.
    pub fn open(
        dir: &Path,
        capacity: u64,
        expect: impl Fn(u32) -> Option<(String, u64)>,
    ) -> Result<(DiskCache, Loaded), CacheError> {
        Self::open_in(dir, capacity, expect, &measured_room)
    }

    /// [`DiskCache::open`], the file system's id and free bytes from `room`.
    fn open_in(
        dir: &Path,
        capacity: u64,
        expect: impl Fn(u32) -> Option<(String, u64)>,
        room: &Room,
    ) -> Result<(DiskCache, Loaded), CacheError> {
        let io = |source| CacheError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut cache = DiskCache::empty(dir, capacity);
        let mut loaded = Loaded::default();
        for e in std::fs::read_dir(dir).map_err(io)? {
            let e = e.map_err(io)?;
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().map_err(io)?;
            if !meta.is_file() || !is_cache_file(&name) {
                loaded.foreign.push(name); // a cache never deletes what it did not write
                continue;
            }
            let len = meta.len();
            let shard = name.get(..8).and_then(|s| s.parse::<u32>().ok());
            let keep = shard.and_then(|s| expect(s).map(|want| (s, want)));
            match keep {
                Some((s, (want, want_len))) if want == name && want_len == len => {
                    cache.hold(len);
                    cache.insert(s, name, len, false);
                    loaded.kept += 1;
                    loaded.kept_bytes += len;
                }
                _ => {
                    delete_stale(dir, e.path())?;
                    loaded.removed.push(name);
                }
            }
        }
        cache.shrink_to_capacity(&mut loaded)?;
        cache.check_room(room)?;
        Ok((cache, loaded))
    }

    /// A cache of `dir` holding nothing yet.
    fn empty(dir: &Path, capacity: u64) -> DiskCache {
        DiskCache {
            dir: dir.to_path_buf(),
            dev: 0,
            capacity,
            used: claims::Used::default(),
            entries: HashMap::new(),
            by_last: BTreeSet::new(),
            next_id: 0,
            reserved: HashMap::new(),
            going: HashSet::new(),
            #[cfg(test)]
            visited: 0,
            clock: 0,
            cold_epochs: u64::MAX,
            asked: Asked::default(),
            claim: None,
            gauge: metrics::Gauge::noop(),
        }
    }

    /// Indexes `shard`'s entry `name` of `len` bytes (held already), served last now.
    fn insert(&mut self, shard: u32, name: String, len: u64, verified: bool) {
        let (id, last) = (self.next_id, self.clock);
        self.next_id += 1;
        let entry = Entry {
            name,
            len,
            id,
            verified,
            last,
        };
        if let Some(old) = self.entries.insert(shard, entry) {
            self.by_last.remove(&(old.last, shard)); // not expected: one entry per shard
        }
        self.by_last.insert((last, shard));
    }

    /// Takes `shard`'s entry out of the index (its bytes are still held: the caller
    /// releases them).
    fn unindex(&mut self, shard: u32) -> Option<Entry> {
        let e = self.entries.remove(&shard)?;
        self.by_last.remove(&(e.last, shard));
        Some(e)
    }

    /// Deletes kept entries, highest shard first (no hint says yet what is needed soonest),
    /// until they fit the capacity: a restart with a lower `cache_size` honours it.
    fn shrink_to_capacity(&mut self, loaded: &mut Loaded) -> Result<(), CacheError> {
        let mut shards: Vec<u32> = self.entries.keys().copied().collect();
        shards.sort_unstable();
        while self.used.get() > self.capacity {
            let Some(s) = shards.pop() else { break };
            let e = self.unindex(s).expect("listed");
            delete_stale(&self.dir, self.dir.join(&e.name))?;
            self.release(e.len);
            loaded.kept -= 1;
            loaded.kept_bytes -= e.len;
            loaded.over_size.push(e.name);
        }
        Ok(())
    }

    /// Refuses a capacity the file system cannot hold (`room`: its id and free bytes), with
    /// what this process's other caches there may still take; else claims what this one may.
    fn check_room(&mut self, room: &Room) -> Result<(), CacheError> {
        let (fs, free) = room(&self.dir).map_err(|source| CacheError::Io {
            dir: self.dir.clone(),
            source,
        })?;
        self.dev = fs;
        let claimed = claims::claim(fs, &self.dir, (self.capacity, &self.used), free);
        match claimed {
            Ok(c) => {
                self.claim = Some(c);
                Ok(())
            }
            Err(others) => Err(CacheError::NoRoom {
                dir: self.dir.clone(),
                free,
                held: self.used.get(),
                size: self.capacity,
                others,
            }),
        }
    }

    /// The cached entry of `shard`, to open outside the lock ([`Found::open`]): an open can
    /// block on a stalled disk, and the dataset's other FETCHes, hints and reads wait for
    /// this lock (before, the file was opened under it). It counts as served now.
    pub fn lookup(&mut self, shard: u32) -> Option<Found> {
        self.tick(shard);
        let clock = self.clock;
        let e = self.entries.get_mut(&shard)?;
        self.by_last.remove(&(e.last, shard));
        self.by_last.insert((clock, shard));
        e.last = clock;
        Some(Found {
            shard,
            path: self.dir.join(&e.name),
            len: e.len,
            verified: e.verified,
            id: e.id,
            dev: self.dev,
        })
    }

    /// The file of `shard`'s entry `id` is gone ([`Found::open`]): the entry leaves the index
    /// and its room is given back, unless another entry of the shard was written since.
    pub fn lost(&mut self, shard: u32, id: u64) {
        if self.entries.get(&shard).is_some_and(|e| e.id == id)
            && let Some(e) = self.unindex(shard)
        {
            self.release(e.len);
        }
    }

    /// Entries no hint names become cold, and may be evicted, once they were not served for
    /// `epochs` times as many lookups and reservations as the distinct shards this cache was
    /// asked for lately. An epoch asks this cache for each shard of its slice once (one to
    /// three accesses each), so a cached shard still trained on is never cold, and the entries of
    /// shards nobody asks for any more are, after a few epochs of this cache's own traffic,
    /// whether its source serves the whole dataset or one slice of it beside others behind
    /// one DNS name (counting the dataset's shards instead kept an entry no longer routed
    /// here for 3 to 8 epochs times the number of sources). A shard counts until the end of
    /// the generation of this cache's accesses after the one it was last asked for in
    /// ([`Asked`]): one routed elsewhere stops counting (before, every shard ever asked for
    /// counted for good, and after each routing change entries stayed cached longer).
    pub fn set_cold_after(&mut self, epochs: u64) {
        self.cold_epochs = epochs;
    }

    /// One access, for `shard`: the clock advances, and `shard` counts as asked for.
    fn tick(&mut self, shard: u32) {
        self.clock += 1;
        self.asked.note(shard);
    }

    /// Accesses after which an entry no hint names and not served is cold.
    fn cold_after(&self) -> u64 {
        self.cold_epochs.saturating_mul(self.asked.distinct.max(1))
    }

    /// Whether an old file of `shard` is still being deleted: it is not reserved until it is
    /// ([`Self::deleted`]).
    #[cfg(test)]
    pub fn going(&self, shard: u32) -> bool {
        self.going.contains(&shard)
    }

    /// Whether `shard` is cached or being written.
    pub fn holds(&self, shard: u32) -> bool {
        self.entries.contains_key(&shard) || self.reserved.contains_key(&shard)
    }

    /// `shard`'s entry `id` was checked against its CRC ([`Hit::id`]): unless another entry
    /// of the shard was written since (before, a check of an old entry's file, which took a
    /// while, marked the entry written since as checked, one a node had just reported corrupt
    /// included).
    pub fn verified(&mut self, shard: u32, id: u64) {
        if let Some(e) = self.entries.get_mut(&shard)
            && e.id == id
        {
            e.verified = true;
        }
    }

    /// `shard`'s entry is to be checked against its CRC again before its next serve (a node
    /// reported the bytes it was sent corrupt).
    pub fn recheck(&mut self, shard: u32) {
        if let Some(e) = self.entries.get_mut(&shard) {
            e.verified = false;
        }
    }

    /// Takes `shard`'s entry `id` ([`Hit::id`]) out if it is still there and still not
    /// checked since a restart or a [`Self::recheck`] (it failed its check; an entry written
    /// since stays, even one a later recheck marked unchecked: before, a check of an old
    /// entry's file that failed late deleted it), as an evicted one ([`Self::evict`]):
    /// returns its file, to delete outside the lock ([`delete`]: unlinking a large file is
    /// slow), then call [`Self::deleted`].
    #[must_use = "the file is deleted by `delete`, then `deleted` lets the shard be cached again"]
    pub fn remove_unverified(&mut self, shard: u32, id: u64) -> Option<PathBuf> {
        let same = self
            .entries
            .get(&shard)
            .is_some_and(|e| e.id == id && !e.verified);
        if !same {
            return None;
        }
        self.evict(shard)
    }

    /// Takes `shard`'s entry `id` out (its file was found cut short: [`Hit::len`]) unless
    /// another entry of the shard was written since; its file returned as by
    /// [`Self::remove_unverified`]. (Before, it looked at the file's size again, under the
    /// lock.)
    #[must_use = "the file is deleted by `delete`, then `deleted` lets the shard be cached again"]
    pub fn remove_cut_short(&mut self, shard: u32, id: u64) -> Option<PathBuf> {
        let same = self.entries.get(&shard).is_some_and(|e| e.id == id);
        if !same {
            return None;
        }
        self.evict(shard)
    }

    /// The file of `shard`'s entry taken out by [`Self::remove_unverified`] or
    /// [`Self::remove_cut_short`] was deleted: the shard may be cached again.
    pub fn deleted(&mut self, shard: u32) {
        self.going.remove(&shard);
    }

    /// Makes room for `shard` (`len` bytes, entry `name`): admits it if it fits, or if cold
    /// entries (see [`Self::set_cold_after`]; no hint in `next_use` names them) can make room,
    /// which go, least recently served first. `None` when it should pass through uncached:
    /// evicting an entry that is still read would cost a GET when its turn comes, and this
    /// shard was read already; or while an old file of the shard is still being deleted.
    /// Touches no file: the evicted ones are deleted by [`Reservation::discard_evicted`].
    pub fn reserve(
        &mut self,
        shard: u32,
        name: String,
        len: u64,
        next_use: impl Fn(u32) -> Option<usize>,
    ) -> Option<Reservation> {
        self.tick(shard);
        if self.holds(shard) || self.going.contains(&shard) || len > self.capacity {
            return None;
        }
        let mut evicted = Vec::new();
        if self.used.get() + len > self.capacity {
            let need = self.used.get() + len - self.capacity;
            evicted = self.victims(need, &next_use)?;
        }
        let doomed = evicted.iter().filter_map(|&s| self.evict(s)).collect();
        self.hold(len);
        self.reserved.insert(shard, len);
        Some(Reservation {
            shard,
            temp: self.dir.join(format!(".{name}.partial")),
            name,
            len,
            evicted,
            doomed,
        })
    }

    /// The cold entries no hint names (`next_use`) that free `need` bytes, least recently
    /// served first; `None` if those do not. Walks the entries from the least recently served
    /// and stops at the first that is not cold (all after it were served later): a full cache
    /// whose entries are all still read (one smaller than an epoch, in its steady state) pays
    /// O(log entries) per shard passing through. Before, every reservation of a full cache
    /// filtered and sorted all its entries, under the dataset's lock.
    fn victims(&mut self, need: u64, next_use: &dyn Fn(u32) -> Option<usize>) -> Option<Vec<u32>> {
        let (clock, cold_after) = (self.clock, self.cold_after());
        let (mut victims, mut freed) = (Vec::new(), 0);
        #[cfg(test)]
        {
            self.visited = 0;
        }
        for &(last, s) in &self.by_last {
            if freed >= need || clock - last <= cold_after {
                break;
            }
            #[cfg(test)]
            {
                self.visited += 1;
            }
            if next_use(s).is_none() {
                victims.push(s);
                freed += self.entries[&s].len;
            }
        }
        (freed >= need).then_some(victims)
    }

    /// Takes `shard`'s entry out of the index and gives its room back; returns its file, to
    /// delete outside the lock (no disk operation runs under it), `None` if there was no
    /// entry. The shard is not reserved again until that is done: a new file of it would
    /// take the name of the one being deleted.
    fn evict(&mut self, shard: u32) -> Option<PathBuf> {
        let e = self.unindex(shard)?;
        self.release(e.len);
        self.going.insert(shard);
        Some(self.dir.join(&e.name))
    }

    /// The reserved entry was written and renamed into place ([`Reservation::install`],
    /// outside the lock): it becomes an entry (verified: its bytes were checked before they
    /// were written), and the entries it evicted, whose files were deleted, may be cached
    /// again.
    pub fn commit(&mut self, r: Reservation) {
        self.reserved.remove(&r.shard);
        for s in &r.evicted {
            self.going.remove(s);
        }
        self.insert(r.shard, r.name, r.len, true);
    }

    /// The reserved entry was not written or not renamed into place (its file set aside
    /// outside the lock: [`Reservation::set_aside`], [`CommitError::doomed`]): its room is
    /// given back, and the entries it evicted, whose files were deleted, may be cached again.
    pub fn abort(&mut self, r: Reservation) {
        self.reserved.remove(&r.shard);
        for s in &r.evicted {
            self.going.remove(s);
        }
        self.release(r.len);
    }

    /// Bytes held (entries and reservations).
    pub fn used(&self) -> u64 {
        self.used.get()
    }

    /// Reports the bytes it holds ([`Self::used`]) as `shardwire_source_cache_bytes` with
    /// the label `dataset`: set now (the entries kept at open), and again at every change
    /// (a reservation, a commit, an abort, an eviction, an entry dropped after a failed check
    /// or found gone). Before, only a commit set it, without a label: entries kept over a
    /// restart and every removal went unseen, and two datasets overwrote each other's value.
    pub fn report_as(&mut self, dataset: &str) {
        self.gauge =
            metrics::gauge!("shardwire_source_cache_bytes", "dataset" => dataset.to_owned());
        self.gauge.set(self.used.get() as f64);
    }

    /// `n` bytes more are held (an entry kept at open, a reservation).
    fn hold(&mut self, n: u64) {
        self.used += n;
        self.gauge.set(self.used.get() as f64);
    }

    /// `n` bytes fewer are held (an entry gone, a reservation given back).
    fn release(&mut self, n: u64) {
        self.used -= n;
        self.gauge.set(self.used.get() as f64);
    }

    /// The configured size.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True with no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests;
