//! The check of a local shard file ([`Opened::check`], an `fstat` of the open file) that every
//! FETCH and every announcement of one makes, run on a blocking thread within [`STAT_LIMIT`].
//!
//! On a hard-mounted network file system whose server stopped answering, `fstat` blocks for as
//! long as the server is gone. Before, the check ran on a runtime worker: as many sessions
//! fetching from that mount as there are workers blocked all of them, and the accept loop, the
//! sessions of every other dataset, their keepalives and the admin endpoint stopped too (their
//! nodes then dropped them as silent). Now a check that does not return within [`STAT_LIMIT`]
//! of starting refuses its FETCH as a file that could not be examined ([`ShardChanged::Stat`]:
//! `ReadFailed`, naming the file; the node asks another source).
//!
//! The checks are grouped by the file system of their file (its `st_dev`, found at start:
//! [`Stats::of`], once per file). At most [`FS_CHECKS`] checks of one file system run at once,
//! and while one of them is past its limit and has not returned, every further check of that
//! file system is refused at once, without a thread, and so is one waiting for its turn when
//! that happens (before, it waited out its own limit): a dead mount holds at most
//! [`FS_CHECKS`] blocking threads, however many files and sessions meet it (before, one per
//! file, plus one per session that met the file before the first gave up: a dead mount of a
//! few thousand files took all 512 of the runtime's blocking threads, and then every check,
//! cache write and CRC check of the source waited). A check that returns, however late, lets
//! the file system be checked again. A check that cannot start within [`STAT_LIMIT`] (its file
//! system's checks are all under way, or no blocking thread is free) is refused as such, not
//! counted as hung: the time it waited does not count in the limit of its `fstat`.
//!
//! A file on a local disk or memory file system ([`on_disk`]: ext4, XFS, tmpfs, ...) is checked
//! where the check is made, without a thread: its `fstat` answers from the inode cache, and two
//! thread hops per FETCH kept a node from fetching shards of a few KiB ahead of its trainer.
//!
//! The bound itself ([`Limiter`]: a time limit, a few at once per file system, refused at once
//! while one hangs) also runs the disk operations of the object-storage datasets' caches
//! (`remote`), with limiters of their own: one for the open, `fstat` and unlink of a cache entry
//! ([`FS_CHECKS`] per file system), one with fewer slots for the CRC reads of entries, so a hit's
//! open never waits behind a long read. A CRC read may run as long as it moves, up to a total its
//! caller sets: it counts as hung once one read did not return within its limit
//! ([`Limiter::on_device_moving`]), not by its length. A check refused because it could not start
//! within its limit (its file system's slots all under way, or no blocking thread free: the source
//! is busy, the file system need not be) is told apart from one that did not return
//! ([`not_started`]).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};
use tokio::task::JoinHandle;

use crate::datasets::{Backend, Datasets, Opened, ShardChanged};

/// How long the check of a shard file may run, from when its thread starts it, before its
/// FETCH is refused; and how long it may wait to start.
pub(crate) const STAT_LIMIT: Duration = Duration::from_secs(5);

/// Checks of the files of one file system that run at once (each on a blocking thread): all
/// that a file system whose server stopped answering can hold (per [`Limiter`]: the default
/// number of its slots, [`Limiter::new`]).
pub(crate) const FS_CHECKS: usize = 4;

/// Where one check stands; changed only under the lock of [`Limiter::groups`].
const QUEUED: u8 = 0;
/// Its thread started it.
const RUNNING: u8 = 1;
/// It returned (in time or not).
const RETURNED: u8 = 2;
/// Its caller stopped waiting for it, and counted it in [`Group::hung`].
const GIVEN_UP: u8 = 3;
/// Its caller stopped waiting for it before it started: it does not run.
const DROPPED: u8 = 4;

/// What checks are grouped by: a file system (`st_dev`), or, for a file whose file system the
/// source did not find at start (a test's), the file (by the address of its [`Opened`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    /// A file system, by its `st_dev`.
    Device(u64),
    /// A file, by the address of its [`Opened`].
    File(usize),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Key::Device(dev) => {
                let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
                write!(f, "its file system (device {major}:{minor})")
            }
            Key::File(_) => f.write_str("this file"),
        }
    }
}

/// Whether a file system of type `f_type` (`statfs`) keeps its files on a local disk or in
/// memory, where an `fstat` of an open file cannot hang: ext2-4, XFS, Btrfs, ZFS, F2FS,
/// bcachefs, tmpfs, ramfs, overlayfs, SquashFS, ISO 9660, FAT, exFAT (`linux/magic.h`). Any
/// other (NFS, SMB, Ceph, Lustre, GPFS, 9p, FUSE mounts of a bucket, one not known) is checked
/// on a blocking thread within [`STAT_LIMIT`].
fn on_disk(f_type: i64) -> bool {
    const ON_DISK: [i64; 13] = [
        0xEF53,      // ext2, ext3, ext4
        0x5846_5342, // XFS
        0x9123_683E, // Btrfs
        0x2FC1_2FC1, // ZFS
        0xF2F5_2010, // F2FS
        0xCA45_1A4E, // bcachefs
        0x0102_1994, // tmpfs
        0x8584_58F6, // ramfs
        0x794C_7630, // overlayfs
        0x7371_7368, // SquashFS
        0x9660,      // ISO 9660
        0x4D44,      // FAT
        0x2011_BAB0, // exFAT
    ];
    ON_DISK.contains(&f_type)
}

/// The checks of one file system ([`Key`]).
#[derive(Debug)]
struct Group {
    /// Checks past their limit that have not returned (each holds a blocking thread and one of
    /// [`Self::slots`]); watched by the checks waiting for a slot, refused as it goes up.
    hung: watch::Sender<usize>,
    /// Room for the checks that may run at once (or wait for a thread): [`Limiter::per_fs`].
    slots: Arc<Semaphore>,
}

/// A check started on its thread ([`Limiter::start`]): its task (`None` where it did not run:
/// its caller stopped waiting before it started), where it stands and when it started.
type Started<T> = (
    JoinHandle<Option<Result<T, ShardChanged>>>,
    Arc<AtomicU8>,
    tokio::time::Instant,
);

/// Runs checks of files (an `fstat`, an open: whatever may block on a file system whose server
/// stopped answering) on blocking threads, each within a time limit, at most
/// [`Limiter::per_fs`] of one file system at once, and refuses those of a file system while
/// one of its checks is past its limit and has not returned ([`Limiter::within`]). Cloned, it
/// shares its table.
#[derive(Debug, Clone)]
pub(crate) struct Limiter {
    /// What its checks do, for their errors (`fstat`).
    op: &'static str,
    /// Checks of one file system that run at once ([`FS_CHECKS`] unless
    /// [`Limiter::with_slots`] says otherwise).
    per_fs: usize,
    /// The checks of each file system.
    groups: Arc<Mutex<HashMap<Key, Group>>>,
}

/// How far a check that reports its progress has come ([`Limiter::on_device_moving`]), and
/// whether its caller still waits for it.
#[derive(Debug)]
pub(crate) struct Progress {
    /// What [`Self::last_step`] counts from.
    base: Instant,
    /// Nanoseconds from `base` to its last step, plus one; 0 before its first.
    last: AtomicU64,
    /// Set once its caller stopped waiting for it (gave it up, was dropped: a FETCH
    /// cancelled, or left it past its total).
    stopped: AtomicBool,
    /// Set once a step was told so ([`Self::step`] answered false): what the check then
    /// returns is no answer of its own.
    told: AtomicBool,
}

impl Progress {
    /// No step yet, its caller waiting.
    fn new() -> Self {
        Self {
            base: Instant::now(),
            last: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            told: AtomicBool::new(false),
        }
    }

    /// Notes a step (a chunk read); false once its caller stopped waiting for it: the check
    /// should end now (nobody reads its answer), freeing its slot and thread.
    pub(crate) fn step(&self) -> bool {
        let nanos = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.last.store(nanos + 1, Ordering::Relaxed);
        let stopped = self.stopped.load(Ordering::SeqCst);
        if stopped {
            self.told.store(true, Ordering::SeqCst);
        }
        !stopped
    }

    /// When it last stepped, if it did.
    fn last_step(&self) -> Option<Instant> {
        match self.last.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.base + Duration::from_nanos(n - 1)),
        }
    }
}

/// Tells a check its caller stopped waiting for it ([`Progress::stopped`]) when dropped.
struct Stop(Arc<Progress>);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::Relaxed);
    }
}

/// Whether `e`, a check's refusal, says it could not start within its limit (its file
/// system's slots all under way, or no blocking thread free: the source is busy), rather than
/// that it or an earlier check of its file system did not return (the file system may not
/// answer).
pub(crate) fn not_started(e: &ShardChanged) -> bool {
    matches!(e, ShardChanged::Stat { source, .. } if source.kind() == io::ErrorKind::ResourceBusy)
}

impl Default for Limiter {
    /// The limiter of `fstat`s ([`Stats`]).
    fn default() -> Self {
        Self::new("fstat")
    }
}

/// The checks of local shard files, by file system.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// The file system (`st_dev`) of each local shard file, by the address of its [`Opened`]
    /// (which lives as long as the source: its datasets are fixed at start).
    devices: HashMap<usize, u64>,
    /// The local shard files on a disk or memory file system ([`on_disk`]), by the address of
    /// their [`Opened`]: their `fstat` answers from the inode cache and cannot hang, so it runs
    /// where the check is made, without a thread hop (two per FETCH: with shards of a few KiB,
    /// the hops kept a node from fetching ahead of its trainer).
    inline: HashSet<usize>,
    /// The checks, by file system.
    limiter: Limiter,
}

/// The file system of each of `files` (`device`: its `st_dev`, if found) and those on a disk
/// or memory file system (`disk`: [`on_disk`]), by key (the address of its [`Opened`]).
/// `files` has an entry per shard, and the shards of one file share its key: each file is
/// looked at once. (Before, its `fstatfs` ran once per shard: on NFS each is a round trip to
/// the server, and a million shards packed in a hundred files took minutes to start.)
fn survey<'a, T: ?Sized + 'a>(
    files: impl IntoIterator<Item = (usize, &'a T)>,
    mut device: impl FnMut(&T) -> Option<u64>,
    mut disk: impl FnMut(&T) -> bool,
) -> (HashMap<usize, u64>, HashSet<usize>) {
    let (mut seen, mut devices, mut inline) = (HashSet::new(), HashMap::new(), HashSet::new());
    for (at, file) in files {
        if !seen.insert(at) {
            continue;
        }
        if let Some(dev) = device(file) {
            devices.insert(at, dev);
        }
        if disk(file) {
            inline.insert(at);
        }
    }
    (devices, inline)
}

/// The table of [`Limiter::groups`], locked.
fn lock(groups: &Mutex<HashMap<Key, Group>>) -> MutexGuard<'_, HashMap<Key, Group>> {
    groups.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Stats {
    /// The checks of the local shard files of `datasets`, grouped by file system: found by an
    /// `fstat` and an `fstatfs` of each open file, at start, before the source serves (opening
    /// the datasets made an `fstat` per file as well). A file whose `fstat` fails now is
    /// grouped on its own.
    pub(crate) fn of(datasets: &Datasets) -> Self {
        let files = datasets.iter().filter_map(|d| match &d.backend {
            Backend::Local { files, opened, .. } => Some(files.iter().zip(opened)),
            Backend::Remote(_) => None,
        });
        let files = files
            .flatten()
            .map(|(file, opened)| (Arc::as_ptr(opened) as usize, &**file));
        let device = |f: &File| f.metadata().ok().map(|m| m.dev());
        // `f_type` is an i64 here, a u32 on some architectures.
        #[allow(clippy::unnecessary_cast)]
        let disk = |f: &File| rustix::fs::fstatfs(f).is_ok_and(|fs| on_disk(fs.f_type as i64));
        let (devices, inline) = survey(files, device, disk);
        Self {
            devices,
            inline,
            limiter: Limiter::default(),
        }
    }

    /// Whether the file `opened` is checked where the check is made ([`Self::inline`]).
    #[cfg(test)]
    pub(crate) fn checked_inline(&self, opened: &Arc<Opened>) -> bool {
        self.inline.contains(&(Arc::as_ptr(opened) as usize))
    }

    /// The file system of the file `opened` found at start ([`Self::of`]).
    #[cfg(test)]
    pub(crate) fn device_of(&self, opened: &Arc<Opened>) -> Option<u64> {
        self.devices.get(&(Arc::as_ptr(opened) as usize)).copied()
    }

    /// Whether `file` (the open file of `opened`) still holds what it held at open for the
    /// shard at bytes `shard` ([`Opened::check`]), found on a blocking thread within
    /// [`STAT_LIMIT`]; else why not, or that it could not be found out in time.
    pub(crate) async fn check(
        &self,
        opened: &Arc<Opened>,
        file: &Arc<File>,
        shard: Range<u64>,
    ) -> Result<(), ShardChanged> {
        let at = Arc::as_ptr(opened) as usize;
        if self.inline.contains(&at) {
            return opened.check(file, shard);
        }
        let key = self
            .devices
            .get(&at)
            .map_or(Key::File(at), |&dev| Key::Device(dev));
        let (o, f) = (Arc::clone(opened), Arc::clone(file));
        let check = move || o.check(&f, shard);
        self.within(key, &opened.name, STAT_LIMIT, check).await
    }

    /// [`Limiter::within`], for the local shard files.
    async fn within<F>(
        &self,
        key: Key,
        name: &str,
        limit: Duration,
        check: F,
    ) -> Result<(), ShardChanged>
    where
        F: FnOnce() -> Result<(), ShardChanged> + Send + 'static,
    {
        self.limiter.within(key, name, limit, check).await
    }
}

impl Limiter {
    /// A limiter whose checks do `op` (for their errors: `"fstat did not return within
    /// 5s"`).
    pub(crate) fn new(op: &'static str) -> Self {
        Self::with_slots(op, FS_CHECKS)
    }

    /// A limiter whose checks do `op`, `per_fs` of one file system at once.
    pub(crate) fn with_slots(op: &'static str, per_fs: usize) -> Self {
        Self {
            op,
            per_fs,
            groups: Arc::default(),
        }
    }

    /// [`Self::within`] for file `name` of the file system `dev` (its `st_dev`).
    pub(crate) async fn on_device<T, F>(
        &self,
        dev: u64,
        name: &str,
        limit: Duration,
        check: F,
    ) -> Result<T, ShardChanged>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, ShardChanged> + Send + 'static,
    {
        self.within(Key::Device(dev), name, limit, check).await
    }

    /// Runs `check` of file `name` (of file system `key`) on a blocking thread once it starts
    /// there within `limit` ([`Self::start`]), and waits for it at most `limit` from then;
    /// counts it as hung if it does not return in that time.
    async fn within<T, F>(
        &self,
        key: Key,
        name: &str,
        limit: Duration,
        check: F,
    ) -> Result<T, ShardChanged>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, ShardChanged> + Send + 'static,
    {
        let (mut task, state, began) = self.start(key, name, limit, check).await?;
        let joined = match tokio::time::timeout_at(began + limit, &mut task).await {
            Ok(joined) => joined,
            Err(_) if self.give_up(key, &state) => {
                let op = self.op;
                let why = format!(
                    "{op} did not return within {limit:?} (a network file system whose \
                     server does not answer?)"
                );
                return Err(stat_error(name, why));
            }
            Err(_) => task.await, // it returned just as the limit ran out: its answer is there
        };
        answer(name, joined)
    }

    /// [`Self::within`] for a check that reports its progress ([`Progress::step`]: a CRC
    /// read, a step per chunk) of file `name` of file system `dev`: it may run as long as it
    /// moves, and counts as hung once `limit` passes without a step (from its start or its
    /// last step: a read that did not return in that time), not by its length (a slow disk
    /// shared by a few such reads is no dead one). Past `total` from its start it is told to
    /// stop (a disk that moves, too slowly: the FETCH would outwait the node's limit for an
    /// unanswered fetch) and watched until its next step ends it (the slow error, not counted
    /// as hung) or it reads nothing for `limit` (hung): at most `total` plus `limit`, for a
    /// check that ends at a step it is told to stop at. A check that ends on its own first
    /// answers as it does. It waits
    /// `limit` at most to start, as any check. Once its caller stops waiting for it (gave it
    /// up, or was dropped), its next step says so and it ends there.
    pub(crate) async fn on_device_moving<T, F>(
        &self,
        dev: u64,
        name: &str,
        (limit, total): (Duration, Duration),
        check: F,
    ) -> Result<T, ShardChanged>
    where
        T: Send + 'static,
        F: FnOnce(&Progress) -> Result<T, ShardChanged> + Send + 'static,
    {
        let key = Key::Device(dev);
        let progress = Arc::new(Progress::new());
        let _stop = Stop(Arc::clone(&progress));
        let p = Arc::clone(&progress);
        let (mut task, state, began) = self
            .start(key, name, limit, move || check(p.as_ref()))
            .await?;
        let mut from = began;
        // Past its total the read is told to stop and watched until it ends at its next step
        // or is found hung (no step for `limit`): left at the total at once, a read stuck
        // just after a step would hold its slot uncounted. `slow` holds why it was left.
        let (mut cap, mut slow) = (began + total, None);
        let joined = loop {
            let done = tokio::time::timeout_at((from + limit).min(cap), &mut task).await;
            if let Ok(joined) = done {
                break joined;
            }
            // A read that did not return within `limit` is hung, whatever the total (checked
            // first: an entry whose total is its limit, under 4 MiB in the cache, would else
            // never count as hung, and its stuck reads would hold every slot uncounted).
            let moved = progress.last_step().map(tokio::time::Instant::from_std);
            let moved = moved.filter(|&m| m > from);
            let now = tokio::time::Instant::now();
            if moved.is_none() && now >= from + limit {
                if self.give_up(key, &state) {
                    let op = self.op;
                    let why = format!(
                        "{op}: one read of its file did not return within {limit:?} (a \
                         network file system whose server does not answer?)"
                    );
                    return Err(stat_error(name, why));
                }
                break task.await; // it returned just as the limit ran out
            }
            if now >= cap {
                let op = self.op;
                slow = Some(format!(
                    "{op} still reading after {total:?}: the disk moves too slowly for the FETCH \
                     to wait (it reads the store instead)"
                ));
                progress.stopped.store(true, Ordering::SeqCst);
                cap = now + limit + limit; // past any hung verdict: only `from + limit` wakes
            }
            if let Some(moved) = moved {
                from = moved; // it moved since: its limit runs from its last step
            }
        };
        // Left past its total, a check that was told so answered nothing of its own (a CRC
        // read's "stopped" is no failed check); one that ended first answered for real.
        match slow {
            Some(why) if progress.told.load(Ordering::SeqCst) => Err(slow_error(name, why)),
            _ => answer(name, joined),
        }
    }

    /// Starts `check` of file `name` (of file system `key`) on a blocking thread within
    /// `limit`: it waits for one of the file system's [`Self::per_fs`] slots ([`Self::slot`]),
    /// then for a blocking thread, and is refused if it has not started by then. Returns its
    /// task, where it stands and when it started.
    async fn start<T, F>(
        &self,
        key: Key,
        name: &str,
        limit: Duration,
        check: F,
    ) -> Result<Started<T>, ShardChanged>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, ShardChanged> + Send + 'static,
    {
        let start_by = tokio::time::Instant::now() + limit;
        let slot = self.slot(key, name, limit, start_by).await?;
        let state = Arc::new(AtomicU8::new(QUEUED));
        let (began_tx, mut began) = oneshot::channel();
        let job = Job {
            groups: Arc::clone(&self.groups),
            key,
            state: Arc::clone(&state),
            slot,
            began: began_tx,
        };
        let task = tokio::task::spawn_blocking(move || job.run(check));
        let at = match tokio::time::timeout_at(start_by, &mut began).await {
            Ok(at) => at,
            Err(_) if self.drop_queued(&state) => {
                let why = format!(
                    "its check could not start within {limit:?}: no blocking thread of the \
                     source was free (it is overloaded)"
                );
                return Err(busy_error(name, why));
            }
            Err(_) => began.await, // it started just as the limit ran out
        };
        // An `Err`: it ended without starting (the runtime shuts down); its join says so.
        let at = at.map_or_else(
            |_| tokio::time::Instant::now(),
            tokio::time::Instant::from_std,
        );
        Ok((task, state, at))
    }

    /// One of file system `key`'s [`Self::per_fs`] slots for the check of file `name`, waited
    /// for until `start_by`: refused at once while an earlier check of that file system is
    /// past its limit (`limit`) and has not returned, and as soon as one turns so while this
    /// one waits (before, it waited until `start_by`, its session's messages with it, and was
    /// refused as a check that could not start).
    async fn slot(
        &self,
        key: Key,
        name: &str,
        limit: Duration,
        start_by: tokio::time::Instant,
    ) -> Result<OwnedSemaphorePermit, ShardChanged> {
        loop {
            let (slots, mut hung) = self.slots(key, name, limit)?;
            tokio::select! {
                got = tokio::time::timeout_at(start_by, slots.acquire_owned()) => {
                    let Ok(Ok(slot)) = got else {
                        let (n, op) = (self.per_fs, self.op);
                        let why = format!(
                            "its check could not start within {limit:?}: the {n} {op}s of {key} \
                             that may run at once were all under way (the source is busy)"
                        );
                        return Err(busy_error(name, why));
                    };
                    self.slots(key, name, limit)?; // one may have hung as this one got its slot
                    return Ok(slot);
                }
                // One hung: refused on the next turn, unless it has returned since.
                Ok(_) = hung.wait_for(|&n| n > 0) => {}
            }
        }
    }

    /// The slots of file system `key`'s checks, and its count of hung checks to watch; refused
    /// while one of them is past its limit (`limit`) and has not returned.
    fn slots(
        &self,
        key: Key,
        name: &str,
        limit: Duration,
    ) -> Result<(Arc<Semaphore>, watch::Receiver<usize>), ShardChanged> {
        let mut groups = lock(&self.groups);
        let g = groups.entry(key).or_insert_with(|| Group {
            hung: watch::Sender::new(0),
            slots: Arc::new(Semaphore::new(self.per_fs)),
        });
        let hung = *g.hung.borrow();
        if hung > 0 {
            let op = self.op;
            let why = format!(
                "{hung} earlier {op}(s) of files on {key} did not return within {limit:?} and \
                 have not returned yet (a network file system whose server does not answer?)",
            );
            return Err(stat_error(name, why));
        }
        Ok((Arc::clone(&g.slots), g.hung.subscribe()))
    }

    /// Stops waiting for the check `state` of file system `key`, counting it as hung, unless
    /// it has returned (false).
    fn give_up(&self, key: Key, state: &AtomicU8) -> bool {
        let groups = lock(&self.groups);
        if state.load(Ordering::Relaxed) == RETURNED {
            return false;
        }
        state.store(GIVEN_UP, Ordering::Relaxed);
        if let Some(g) = groups.get(&key) {
            g.hung.send_modify(|n| *n += 1); // the checks waiting for a slot are refused
        }
        true
    }

    /// Stops waiting for the check `state` before it starts (it will not run), unless it has
    /// started (false).
    fn drop_queued(&self, state: &AtomicU8) -> bool {
        let _groups = lock(&self.groups);
        if state.load(Ordering::Relaxed) != QUEUED {
            return false;
        }
        state.store(DROPPED, Ordering::Relaxed);
        true
    }
}

/// One check's hold on its file system's group, on its blocking thread.
struct Job {
    /// [`Limiter::groups`].
    groups: Arc<Mutex<HashMap<Key, Group>>>,
    /// Its file system.
    key: Key,
    /// Where it stands (`QUEUED` until it starts).
    state: Arc<AtomicU8>,
    /// Its slot among the file system's [`Limiter::per_fs`], held until it returns.
    slot: OwnedSemaphorePermit,
    /// When it started, for its caller.
    began: oneshot::Sender<Instant>,
}

impl Job {
    /// Runs `check` unless its caller stopped waiting before it started (`None`: then `check`
    /// is dropped unrun); a hung one that returns is no longer counted as hung.
    fn run<T, F>(self, check: F) -> Option<Result<T, ShardChanged>>
    where
        F: FnOnce() -> Result<T, ShardChanged>,
    {
        let Job {
            groups,
            key,
            state,
            slot,
            began,
        } = self;
        {
            let _groups = lock(&groups);
            if state.load(Ordering::Relaxed) == DROPPED {
                return None; // refused before it started: nobody reads this
            }
            state.store(RUNNING, Ordering::Relaxed);
        }
        let _ = began.send(Instant::now());
        let got = check();
        let table = lock(&groups);
        if state.swap(RETURNED, Ordering::Relaxed) == GIVEN_UP
            && let Some(g) = table.get(&key)
        {
            g.hung.send_modify(|n| *n -= 1);
        }
        drop(table);
        drop(slot);
        Some(got)
    }
}

/// File `name` could not be examined in time (`why`): refused as `ReadFailed`.
fn stat_error(name: &str, why: String) -> ShardChanged {
    ShardChanged::Stat {
        name: name.to_owned(),
        source: io::Error::new(io::ErrorKind::TimedOut, why),
    }
}

/// The check of file `name` moved, too slowly, past its total (`why`): not a hung one
/// ([`too_slow`]).
fn slow_error(name: &str, why: String) -> ShardChanged {
    ShardChanged::Stat {
        name: name.to_owned(),
        source: io::Error::new(io::ErrorKind::TimedOut, TooSlow(why)),
    }
}

/// Why a check was left past its total: it moved, too slowly ([`slow_error`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TooSlow(String);

/// Whether `e` is the answer of a check left past its total because it moved too slowly
/// ([`Limiter::on_device_moving`]), not one that did not return or could not start.
pub(crate) fn too_slow(e: &ShardChanged) -> bool {
    matches!(e, ShardChanged::Stat { source, .. }
        if source.get_ref().is_some_and(|inner| inner.is::<TooSlow>()))
}

/// The check of file `name` could not start in time (`why`): refused as `ReadFailed`, told
/// apart from one that did not return ([`not_started`]).
fn busy_error(name: &str, why: String) -> ShardChanged {
    ShardChanged::Stat {
        name: name.to_owned(),
        source: io::Error::new(io::ErrorKind::ResourceBusy, why),
    }
}

/// What the check of file `name` answered, once its thread returned (`joined`).
fn answer<T>(
    name: &str,
    joined: Result<Option<Result<T, ShardChanged>>, tokio::task::JoinError>,
) -> Result<T, ShardChanged> {
    let ended = |why: String| ShardChanged::Stat {
        name: name.to_owned(),
        source: io::Error::other(why),
    };
    match joined {
        Ok(Some(got)) => got,
        // Only a check its caller stopped waiting for before it started does not run, and
        // that caller is refused in `start`: not expected here.
        Ok(None) => Err(ended("its check did not run".to_owned())),
        Err(e) => Err(ended(format!("the thread that checked it ended: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::RwLock;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

    use super::*;

    const LIMIT: Duration = Duration::from_millis(250);

    #[test]
    fn only_disk_and_memory_file_systems_are_checked_without_a_thread() {
        for on in [0xEF53, 0x5846_5342, 0x0102_1994, 0x794C_7630] {
            assert!(on_disk(on), "{on:#x}");
        }
        // NFS, SMB2, Ceph, FUSE (a bucket mounted with s3fs or gcsfuse), 9p, Lustre.
        for off in [
            0x6969,
            0xFE53_4D42,
            0x00C3_6400,
            0x6573_5546,
            0x0102_1997,
            0x0BD0_0BD0,
        ] {
            assert!(!on_disk(off), "{off:#x}");
        }
    }

    /// Each file is looked at once, however many shards it holds. Before, the `fstatfs` ran
    /// once per shard: on NFS a round trip to the server each, minutes for a million shards.
    #[test]
    fn each_file_is_looked_at_once_however_many_shards_it_holds() {
        // 10 000 shards in three files (keys 1 to 3); the `fstat` of file 3 fails.
        let keys: &[usize] = &[1, 2, 3];
        let shards = (0..10_000).map(move |s| (keys[s % 3], &keys[s % 3]));
        let (stats, types) = (Cell::new(0), Cell::new(0));
        let device = |&k: &usize| {
            stats.set(stats.get() + 1);
            (k != 3).then_some(k as u64 + 10)
        };
        let disk = |&k: &usize| {
            types.set(types.get() + 1);
            k == 1
        };
        let (devices, inline) = survey(shards, device, disk);
        assert_eq!(stats.get(), 3, "an fstat per file");
        assert_eq!(types.get(), 3, "an fstatfs per file");
        assert_eq!(devices, HashMap::from([(1, 11), (2, 12)]));
        assert_eq!(inline, HashSet::from([1]));
    }

    /// Checks of `key` past their limit that have not returned.
    fn hung(stats: &Stats, key: Key) -> usize {
        hung_in(&stats.limiter, key)
    }

    /// Checks of `key` in `limiter` past their limit that have not returned.
    fn hung_in(limiter: &Limiter, key: Key) -> usize {
        lock(&limiter.groups)
            .get(&key)
            .map_or(0, |g| *g.hung.borrow())
    }

    /// Waits (10 s at most) until no check of `key` is counted as hung.
    async fn until_returned(stats: &Stats, key: Key) {
        let t0 = Instant::now();
        while hung(stats, key) > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "not forgotten in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A check that blocks (`fstat` on a mount whose server stopped answering) refuses its
    /// FETCH after the limit, naming the file, while the runtime's one thread goes on; further
    /// checks of that file system are refused at once until it returns. Before, the check ran
    /// on the runtime thread itself: nothing else ran until it returned.
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_does_not_return_is_refused_and_the_runtime_goes_on() {
        let (dead, live) = (Key::Device(1), Key::Device(2));
        let stats = Stats::default();
        let ticks = Arc::new(AtomicU64::new(0));
        let t = Arc::clone(&ticks);
        let ticker = tokio::spawn(async move {
            loop {
                t.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let stuck = move || {
            let _ = blocked.recv(); // until released (or the test ends)
            Ok(())
        };
        match stats.within(dead, "d.bin", LIMIT, stuck).await {
            Err(ShardChanged::Stat { name, source }) => {
                assert_eq!(name, "d.bin");
                assert_eq!(source.kind(), io::ErrorKind::TimedOut);
                assert!(source.to_string().contains("did not return"), "{source}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            ticks.load(Ordering::Relaxed) > 0,
            "the runtime went on meanwhile"
        );
        // While it hangs, the next check of its file system is refused at once, without a
        // thread, naming the file and the file system.
        let ran = Arc::new(AtomicBool::new(false));
        let r = Arc::clone(&ran);
        let again = stats.within(dead, "e.bin", LIMIT, move || {
            r.store(true, Ordering::Relaxed);
            Ok(())
        });
        let again = again.await.expect_err("refused");
        assert!(
            !not_started(&again),
            "refused as hung, not as busy: {again}"
        );
        let said = again.to_string();
        assert!(
            said.contains("e.bin") && said.contains("device 0:1"),
            "{said}"
        );
        assert!(!ran.load(Ordering::Relaxed), "no check started");
        // Another file system is checked as usual, and what its check finds is passed on.
        assert!(stats.within(live, "f.bin", LIMIT, || Ok(())).await.is_ok());
        let modified = || {
            Err(ShardChanged::Modified {
                name: "f.bin".into(),
            })
        };
        let got = stats.within(live, "f.bin", LIMIT, modified).await;
        assert!(matches!(got, Err(ShardChanged::Modified { .. })), "{got:?}");
        // Once the hung check returns, the file system is checked again.
        release.send(()).unwrap();
        until_returned(&stats, dead).await;
        assert!(stats.within(dead, "d.bin", LIMIT, || Ok(())).await.is_ok());
        ticker.abort();
    }

    /// A check that blocks until `gate` opens, counted in `started` when its thread starts it.
    fn stuck(
        gate: &Arc<RwLock<()>>,
        started: &Arc<AtomicUsize>,
    ) -> impl FnOnce() -> Result<(), ShardChanged> + Send + use<> {
        let (gate, started) = (Arc::clone(gate), Arc::clone(started));
        move || {
            started.fetch_add(1, Ordering::SeqCst);
            drop(gate.read());
            Ok(())
        }
    }

    /// Many files of a dead file system, checked at once, hold at most [`FS_CHECKS`] blocking
    /// threads; those that cannot start are refused as such (not blamed on a network file
    /// system), and other file systems go on. Before, each check had a thread of its own: a
    /// dead mount of a few thousand files took every blocking thread of the source.
    #[tokio::test(flavor = "current_thread")]
    // The gate's write lock is the dead mount: held on purpose while the checks wait on it.
    #[allow(clippy::await_holding_lock)]
    async fn a_dead_file_system_holds_at_most_its_slots_of_threads() {
        let limit = Duration::from_millis(500);
        let (dead, live) = (Key::Device(7), Key::Device(8));
        let stats = Stats::default();
        let gate = Arc::new(RwLock::new(()));
        let shut = gate.write().unwrap();
        let started = Arc::new(AtomicUsize::new(0));
        let names: Vec<String> = (0..FS_CHECKS + 2).map(|i| format!("f{i}.bin")).collect();
        // The last two give up waiting for a slot before the first ones hang (a check still
        // waiting when they do is refused as theirs: the next test).
        let checks = names.iter().enumerate().map(|(i, n)| {
            let limit = if i < FS_CHECKS { limit } else { limit / 2 };
            stats.within(dead, n, limit, stuck(&gate, &started))
        });
        let got = futures_util::future::join_all(checks).await;
        assert_eq!(
            started.load(Ordering::SeqCst),
            FS_CHECKS,
            "threads taken by the dead file system"
        );
        assert_eq!(hung(&stats, dead), FS_CHECKS);
        let said: Vec<String> = got
            .iter()
            .map(|r| r.as_ref().expect_err("refused").to_string())
            .collect();
        let unstarted: Vec<&String> = said
            .iter()
            .filter(|s| s.contains("could not start"))
            .collect();
        assert_eq!(unstarted.len(), 2, "{said:?}");
        let busy = got.iter().filter(|r| r.as_ref().is_err_and(not_started));
        assert_eq!(busy.count(), 2, "told apart as busy: {said:?}");
        for s in unstarted {
            assert!(!s.contains("network file system"), "{s}");
        }
        // Its next check is refused at once; another file system's runs.
        let again = stats
            .within(dead, "g.bin", limit, stuck(&gate, &started))
            .await;
        assert!(again.is_err() && started.load(Ordering::SeqCst) == FS_CHECKS);
        assert!(stats.within(live, "h.bin", limit, || Ok(())).await.is_ok());
        drop(shut);
        until_returned(&stats, dead).await;
        assert!(stats.within(dead, "g.bin", limit, || Ok(())).await.is_ok());
    }

    /// A check waiting for one of its file system's slots is refused as soon as a check of
    /// that file system hangs, naming it. Before, it waited out its own limit (its session's
    /// messages waiting with it) and was then refused as a check that could not start.
    #[tokio::test(flavor = "current_thread")]
    // The gate's write lock is the dead mount: held on purpose while the checks wait on it.
    #[allow(clippy::await_holding_lock)]
    async fn a_check_waiting_for_a_slot_is_refused_once_its_file_system_hangs() {
        let limit = Duration::from_secs(1);
        let dead = Key::Device(11);
        let stats = Stats::default();
        let gate = Arc::new(RwLock::new(()));
        let shut = gate.write().unwrap();
        let started = Arc::new(AtomicUsize::new(0));
        let names: Vec<String> = (0..FS_CHECKS).map(|i| format!("f{i}.bin")).collect();
        let first = names
            .iter()
            .map(|n| stats.within(dead, n, limit, stuck(&gate, &started)));
        let first = futures_util::future::join_all(first);
        // Half way through their limit, one more check of the file system waits for a slot.
        let late = async {
            tokio::time::sleep(limit / 2).await;
            let t0 = Instant::now();
            let got = stats
                .within(dead, "late.bin", limit, stuck(&gate, &started))
                .await;
            (got, t0.elapsed())
        };
        let (hung_ones, (got, waited)) = tokio::join!(first, late);
        assert!(hung_ones.iter().all(Result::is_err));
        let said = got.expect_err("refused").to_string();
        assert!(
            said.contains("late.bin") && said.contains("have not returned yet"),
            "{said}"
        );
        assert!(waited < limit, "refused once the others hung: {waited:?}");
        assert_eq!(
            started.load(Ordering::SeqCst),
            FS_CHECKS,
            "it did not start"
        );
        drop(shut);
        until_returned(&stats, dead).await;
    }

    /// The time a check waits for a blocking thread does not count in its `fstat`'s limit;
    /// one that cannot start in time is refused as such, is not counted as hung and does not
    /// run later. Before, the limit ran from the spawn: checks queued behind other blocking
    /// work (cache writes) were refused as hung `fstat`s of a network file system.
    #[test]
    fn the_limit_runs_from_the_start_and_a_check_that_cannot_start_is_not_hung() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .enable_time()
            .build()
            .unwrap();
        let busy =
            |ms| tokio::task::spawn_blocking(move || std::thread::sleep(Duration::from_millis(ms)));
        rt.block_on(async {
            let (stats, key, limit) =
                (Stats::default(), Key::Device(3), Duration::from_millis(600));
            // The one blocking thread is busy for 400 ms, then the check takes 400 ms.
            let other = busy(400);
            let slow = || {
                std::thread::sleep(Duration::from_millis(400));
                Ok(())
            };
            let got = stats.within(key, "a.bin", limit, slow).await;
            assert!(got.is_ok(), "within its limit once started: {got:?}");
            other.await.unwrap();
            // Busy for longer than the limit: the check is refused without starting.
            let other = busy(1000);
            let ran = Arc::new(AtomicBool::new(false));
            let r = Arc::clone(&ran);
            let late = move || {
                r.store(true, Ordering::SeqCst);
                Ok(())
            };
            let refused = stats.within(key, "b.bin", limit, late).await;
            let refused = refused.expect_err("refused");
            assert!(
                not_started(&refused),
                "told apart from a hung one: {refused}"
            );
            let said = refused.to_string();
            assert!(said.contains("could not start"), "{said}");
            assert!(!said.contains("network file system"), "{said}");
            assert_eq!(hung(&stats, key), 0, "not counted as hung");
            other.await.unwrap();
            assert!(stats.within(key, "b.bin", limit, || Ok(())).await.is_ok());
            assert!(
                !ran.load(Ordering::SeqCst),
                "the refused check did not run later"
            );
        });
    }

    /// A check that reports its progress runs past its limit as long as it moves, and is given
    /// up once `limit` passes without a step, counted from its last step (then counted as
    /// hung: the next check of its file system is refused at once); once its caller stopped
    /// waiting, its next step says so. Before, a cache entry's CRC read was given up by a
    /// budget of its length (1 s per 16 MiB): a slow but moving read on a busy disk counted
    /// as hung, and every cache operation of its file system was refused.
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_moves_runs_past_its_limit_and_one_that_stops_moving_is_given_up() {
        let limiter = Limiter::with_slots("CRC read", 1);
        let (limit, total) = (Duration::from_secs(1), Duration::from_secs(3600));
        let (dev, key) = (21, Key::Device(21));
        // Thirty steps 100 ms apart: 3 s in all, each step well within the limit.
        let moving = |p: &Progress| -> Result<u32, ShardChanged> {
            for _ in 0..30 {
                std::thread::sleep(Duration::from_millis(100));
                assert!(p.step(), "its caller still waits");
            }
            Ok(30)
        };
        let t0 = Instant::now();
        let got = limiter
            .on_device_moving(dev, "a.bin", (limit, total), moving)
            .await;
        assert_eq!(got.expect("it moved"), 30);
        assert!(t0.elapsed() >= 3 * limit, "ran past its limit");
        // Two steps 50 ms apart, then a read that does not return until released.
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let told = Arc::new(AtomicBool::new(false));
        let t = Arc::clone(&told);
        let stops = move |p: &Progress| -> Result<u32, ShardChanged> {
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(50));
                p.step();
            }
            let _ = blocked.recv(); // until released (or the test ends)
            t.store(!p.step(), Ordering::SeqCst);
            Ok(0)
        };
        let t0 = Instant::now();
        let e = limiter
            .on_device_moving(dev, "b.bin", (limit, total), stops)
            .await;
        let (e, waited) = (e.expect_err("given up"), t0.elapsed());
        assert!(
            waited >= limit + Duration::from_millis(100),
            "from its last step: {waited:?}"
        );
        assert!(
            !not_started(&e) && e.to_string().contains("did not return within"),
            "{e}"
        );
        assert_eq!(hung_in(&limiter, key), 1);
        let again = limiter
            .on_device_moving(dev, "c.bin", (limit, total), |_| Ok(1))
            .await;
        let again = again.expect_err("refused while it hangs").to_string();
        assert!(again.contains("have not returned yet"), "{again}");
        // It returns: told that nobody waits any more, and the file system is checked again.
        release.send(()).unwrap();
        let t0 = Instant::now();
        while hung_in(&limiter, key) > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "not returned in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(
            told.load(Ordering::SeqCst),
            "its last step said its caller stopped waiting"
        );
        let got = limiter
            .on_device_moving(dev, "c.bin", (limit, total), |_| Ok(1))
            .await;
        assert_eq!(got.expect("checked again"), 1);
    }

    /// A check that keeps moving, too slowly, is told to stop once `total` has passed from its
    /// start and waited for until its next step, which ends it (the slow error, not counted as
    /// hung: the next check of its file system runs). Before, each step moved its
    /// deadline: a 1 GiB entry read at 3 s per MiB held its FETCH for 51 minutes, past the
    /// node's limit for an unanswered fetch.
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_moves_too_slowly_is_left_past_its_total_without_counting_as_hung() {
        let limiter = Limiter::with_slots("CRC read", 1);
        let (limit, total) = (Duration::from_secs(2), Duration::from_millis(600));
        let (dev, key) = (22, Key::Device(22));
        let ended = Arc::new(AtomicBool::new(false));
        let e2 = Arc::clone(&ended);
        let slow = move |p: &Progress| -> Result<u32, ShardChanged> {
            while p.step() {
                std::thread::sleep(Duration::from_millis(50));
            }
            e2.store(true, Ordering::SeqCst);
            Ok(0)
        };
        let t0 = Instant::now();
        let e = limiter
            .on_device_moving(dev, "s.bin", (limit, total), slow)
            .await;
        let e = e.expect_err("left past its total");
        assert!(t0.elapsed() >= total, "{:?}", t0.elapsed());
        assert!(
            e.to_string().contains("still reading after") && too_slow(&e),
            "{e}"
        );
        assert_eq!(hung_in(&limiter, key), 0, "not counted as hung");
        let t0 = Instant::now();
        while !ended.load(Ordering::SeqCst) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the read did not end"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let got = limiter
            .on_device_moving(dev, "t.bin", (limit, total), |_| Ok(1))
            .await;
        assert_eq!(got.expect("the file system is checked as before"), 1);
    }

    /// A check whose total is its limit (a cache entry under 4 MiB) and that never moves is
    /// counted as hung, not left as a slow one: before, the total was looked at first, and on
    /// a dead disk every such read held a slot without counting.
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_never_moves_is_hung_even_when_its_total_is_its_limit() {
        let limiter = Limiter::with_slots("CRC read", 1);
        let limit = Duration::from_millis(300);
        let (dev, key) = (23, Key::Device(23));
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let stuck = move |_: &Progress| -> Result<u32, ShardChanged> {
            let _ = blocked.recv();
            Ok(0)
        };
        let e = limiter
            .on_device_moving(dev, "h.bin", (limit, limit), stuck)
            .await;
        let e = e.expect_err("given up");
        assert!(!too_slow(&e) && !not_started(&e), "{e}");
        assert_eq!(hung_in(&limiter, key), 1, "counted as hung");
        release.send(()).unwrap();
    }

    /// A check whose total is its limit that takes one step and then blocks is found hung
    /// (counted) once `limit` has passed without a step, not left as a slow one at its total:
    /// left at once, its thread held its slot uncounted for good (a 2 MiB cache entry whose
    /// disk died after its first 1 MiB).
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_steps_then_blocks_is_hung_not_slow() {
        let limiter = Limiter::with_slots("CRC read", 1);
        let limit = Duration::from_millis(300);
        let (dev, key) = (24, Key::Device(24));
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let once = move |p: &Progress| -> Result<u32, ShardChanged> {
            std::thread::sleep(Duration::from_millis(100));
            p.step();
            let _ = blocked.recv();
            Ok(0)
        };
        let e = limiter
            .on_device_moving(dev, "o.bin", (limit, limit), once)
            .await;
        let e = e.expect_err("given up");
        assert!(!too_slow(&e), "{e}");
        assert_eq!(hung_in(&limiter, key), 1, "counted as hung");
        release.send(()).unwrap();
    }

    /// A check past its total that ends on its own, not told at a step, answers as it does:
    /// its answer is real. Before (39adc6e), the slow error replaced an answer that came after
    /// the total, and a check told to stop whose "stopped" came back just as its limit ran out
    /// was taken for its answer (a CRC read's "stopped" for a failed check, deleting a good
    /// cache entry).
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_that_ends_on_its_own_past_its_total_answers_as_it_does() {
        let limiter = Limiter::with_slots("CRC read", 1);
        let (limit, total) = (Duration::from_secs(2), Duration::from_millis(300));
        let late = |_: &Progress| -> Result<u32, ShardChanged> {
            std::thread::sleep(Duration::from_millis(400));
            Ok(7)
        };
        let got = limiter
            .on_device_moving(25, "l.bin", (limit, total), late)
            .await;
        assert_eq!(got.expect("its own answer"), 7);
        assert_eq!(hung_in(&limiter, Key::Device(25)), 0);
    }
}
