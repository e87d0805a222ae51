//! FETCHes of one shard that meet: over an in-memory object store that counts the GETs it
//! answers and can hold them back, so a test can start a FETCH, let another wait on its read
//! and cancel the first at a chosen point. A shard's bytes are read from the store once,
//! however the FETCHes that want it meet or end. A [`WriteGate`] holds the background cache
//! writes back, so a test can see FETCHes answered while their shard is written.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use shardwire_protocol::crc::Crc32c;
use shardwire_store::{Described, StoreOptions};
use tokio::sync::Semaphore;

use super::*;

/// `InMemory` that counts the ranged GETs it was asked for and the ones it answered, and
/// answers none while its gate is shut.
#[derive(Debug)]
struct Gated {
    inner: InMemory,
    gate: Semaphore,
    asked: AtomicUsize,
    answered: AtomicUsize,
}

impl Gated {
    fn new() -> Self {
        Gated {
            inner: InMemory::new(),
            gate: Semaphore::new(0),
            asked: AtomicUsize::new(0),
            answered: AtomicUsize::new(0),
        }
    }

    fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

impl std::fmt::Display for Gated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gated")
    }
}

#[async_trait::async_trait]
impl ObjectStore for Gated {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if options.range.is_some() {
            self.asked.fetch_add(1, Ordering::SeqCst);
            let _pass = self.gate.acquire().await.expect("never closed");
        }
        let ranged = options.range.is_some();
        let got = self.inner.get_opts(location, options).await;
        if ranged {
            self.answered.fetch_add(1, Ordering::SeqCst);
        }
        got
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// Holds a dataset's background cache writes back while shut ([`RemoteDataset::write_entry`]
/// passes it first).
#[derive(Debug, Default)]
pub(super) struct WriteGate {
    shut: Mutex<bool>,
    opened: std::sync::Condvar,
    /// Writes that came to it (their threads started).
    came: AtomicUsize,
}

impl WriteGate {
    /// Waits while the gate is shut (a blocking write's thread).
    pub(super) fn pass(&self) {
        self.came.fetch_add(1, Ordering::SeqCst);
        let mut shut = self.shut.lock().unwrap_or_else(|p| p.into_inner());
        while *shut {
            shut = self.opened.wait(shut).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Shuts the gate until the guard returned goes (a failing test too opens it: a write left
    /// waiting would hold the runtime's shutdown).
    fn hold_back(&self) -> HeldBack<'_> {
        *self.shut.lock().unwrap() = true;
        HeldBack(self)
    }
}

/// The gate shut ([`WriteGate::hold_back`]); opened when dropped.
struct HeldBack<'a>(&'a WriteGate);

impl Drop for HeldBack<'_> {
    fn drop(&mut self) {
        *self.0.shut.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.0.opened.notify_all();
    }
}

/// Bytes of each of the dataset's shards: enough that writing one to the cache takes a while.
const SHARD: u64 = 16 << 20;

/// A dataset of 4 shards in one object of `os` under a bucket of the test's own, with a disk
/// cache in `cache` if given.
async fn dataset(
    test: &str,
    os: &Arc<Gated>,
    cache: Option<&std::path::Path>,
) -> Arc<RemoteDataset> {
    let url = StoreUrl::parse(&format!("s3://unit-remote-{test}/pre")).unwrap();
    let store = Store::with_object_store(
        &url,
        StoreOptions {
            request_size: 4 * SHARD, // one GET per shard
            ..StoreOptions::default()
        },
        Arc::clone(os) as Arc<dyn ObjectStore>,
        Described::plain("memory", "in-memory"),
    );
    let data: Vec<u8> = (0..4 * SHARD).map(|i| (i * 7 % 251) as u8).collect();
    os.put(&Path::from("pre/d.bin"), data.clone().into())
        .await
        .unwrap();
    let etag = store
        .head("d.bin")
        .await
        .unwrap()
        .etag
        .expect("InMemory has ETags");
    let shards: Vec<Want> = (0..4u32)
        .map(|s| {
            let range = u64::from(s) * SHARD..u64::from(s + 1) * SHARD;
            let mut crc = Crc32c::new();
            crc.update(&data[range.start as usize..range.end as usize]);
            Want {
                shard: s,
                object: 0,
                range,
                crc32c: crc.finish(),
            }
        })
        .collect();
    let cache =
        cache.map(|dir| Mutex::new(DiskCache::open(dir, 1 << 30, |_| None).expect("cache").0));
    Arc::new(RemoteDataset {
        name: test.into(),
        store,
        objects: vec![Object {
            key: "d.bin".into(),
            size: 4 * SHARD,
            etag,
        }],
        shards,
        cache,
        disk: disk::CacheDisk::own(crate::stat::STAT_LIMIT),
        state: Mutex::new(State::default()),
        budget: 1 << 30,
        wake: Notify::new(),
        writers: Arc::new(Semaphore::new(CACHE_WRITERS)),
        write_gate: WriteGate::default(),
    })
}

/// Places `parts` as shard `shard`'s verified bytes (read for a FETCH or ahead), and waits for
/// its cache write, if the cache took it.
async fn placed(d: &Arc<RemoteDataset>, shard: u32, parts: Vec<Bytes>) {
    if let Some(write) = d.place(shard, parts) {
        write.await.expect("the write ran");
    }
}

/// A temporary cache directory of test `test`.
fn cache_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "shardwire-remote-test-{test}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A FETCH as a task.
type Fetch = tokio::task::JoinHandle<Result<(Body, Served), Failure>>;

/// A FETCH of `shard` by node session `session`, as a task.
fn fetch(d: &Arc<RemoteDataset>, session: u64, shard: u32) -> Fetch {
    let d = Arc::clone(d);
    tokio::spawn(async move {
        let w = d.want(session, shard);
        w.get(session).await
    })
}

/// Lets the runtime's other tasks run until `done` holds (at most 10 s), a step at a time.
async fn until(what: &str, done: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: not after 10 s"
        );
        tokio::task::yield_now().await;
    }
}

/// Two FETCHes of `shard` (node sessions 1 and 2), the second waiting on the first's GET,
/// which the shut gate holds back.
async fn meet(d: &Arc<RemoteDataset>, os: &Gated, shard: u32) -> (Fetch, Fetch) {
    let a = fetch(d, 1, shard);
    until("the first FETCH's GET", || {
        os.asked.load(Ordering::SeqCst) == 1
    })
    .await;
    let b = fetch(d, 2, shard);
    until("the second FETCH waiting", || fetches(d, shard) == 2).await;
    (a, b)
}

/// FETCHes under way for `shard`.
fn fetches(d: &RemoteDataset, shard: u32) -> usize {
    d.state().wanted.get(&shard).map_or(0, |w| w.fetches)
}

/// The bytes a FETCH was answered with.
fn bytes_of(body: &Body) -> Vec<u8> {
    match body {
        Body::Memory(parts) => parts.concat(),
        Body::File { file, offset } => {
            use std::os::unix::fs::FileExt;
            let mut b = vec![0u8; SHARD as usize];
            file.read_exact_at(&mut b, *offset).unwrap();
            b
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn two_fetches_that_meet_on_one_read_are_both_served_from_it_without_a_cache() {
    let os = Arc::new(Gated::new());
    let d = dataset("meet", &os, None).await;
    let (a, b) = meet(&d, &os, 2).await;
    os.open();
    let (a, _) = a.await.unwrap().expect("served");
    let (b, how) = b.await.unwrap().expect("served");
    assert_eq!(bytes_of(&a), bytes_of(&b));
    assert_eq!(how, Served::Read);
    // Before, the first FETCH took the shard out of memory and the second read it again.
    assert_eq!(
        os.asked.load(Ordering::SeqCst),
        1,
        "GETs for the two FETCHes"
    );
    let st = d.state();
    assert!(
        st.ready.is_empty() && st.ready_bytes == 0,
        "memory held after both took it"
    );
}

/// `f`, or a failure after 10 s (a FETCH that waits for something held back).
async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(10), f).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: not after 10 s"),
    }
}

#[tokio::test(flavor = "current_thread")]
async fn fetches_of_a_shard_the_cache_admits_are_answered_from_memory_while_it_is_written() {
    let dir = cache_dir("written");
    let os = Arc::new(Gated::new());
    let d = dataset("written", &os, Some(&dir)).await;
    let held = d.write_gate.hold_back();
    let (a, b) = meet(&d, &os, 1).await;
    os.open();
    // Before, both waited for the cache write and its fsync (here: held back for good).
    let (a, _) = within("the first FETCH", a).await.unwrap().expect("served");
    let (b, how) = within("the FETCH waiting on its read", b)
        .await
        .unwrap()
        .expect("served");
    assert!(matches!(a, Body::Memory(_)), "from memory");
    assert_eq!(bytes_of(&a), d_bytes(1));
    assert_eq!(bytes_of(&b), d_bytes(1));
    assert_eq!(how, Served::Read);
    assert!(entry_files(&dir).is_empty(), "the entry is not written yet");
    // Its FETCHes take it from memory, and hold that memory until sent: it counts in the
    // source's read budget (before, `Cache`: those bytes escaped it once the write ended).
    assert_eq!(d.held_in(1), Some(HeldIn::Memory), "being written");
    assert_eq!(d.state().writing_bytes, SHARD);
    // A FETCH that comes while it is written takes the same bytes: no second GET.
    let during = within("a FETCH during the write", fetch(&d, 3, 1)).await;
    let (c, how) = during.unwrap().expect("served");
    assert_eq!(how, Served::Cached);
    assert!(bytes_of(&c) == d_bytes(1));
    assert_eq!(os.asked.load(Ordering::SeqCst), 1, "GETs");
    // Every FETCH ended; the write goes on, and the entry is committed.
    drop(held);
    d.cache_writes_done().await;
    assert_eq!(entry_files(&dir).len(), 1);
    assert_eq!(d.state().writing_bytes, 0, "the bytes left memory");
    let used = d.cache.as_ref().unwrap().lock().unwrap().used();
    assert_eq!(used, SHARD);
    assert!(matches!(d.cached(1).await, Cached::Hit(Body::File { .. })));
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_shard_that_comes_while_the_cache_writes_are_behind_passes_through_uncached() {
    let dir = cache_dir("behind");
    let os = Arc::new(Gated::new());
    let mut d = dataset("behind", &os, Some(&dir)).await;
    // Writes may hold one shard in memory (half the budget): a slow disk is writing it.
    Arc::get_mut(&mut d).expect("only reference").budget = 2 * SHARD;
    let held = d.write_gate.hold_back();
    let first = d.place(0, vec![Bytes::from(d_bytes(0))]).expect("admitted");
    // Before, every shard the cache admitted was written, however far behind its disk was
    // (and the FETCHes waited for it).
    assert!(
        d.place(1, vec![Bytes::from(d_bytes(1))]).is_none(),
        "not cached this time"
    );
    {
        let st = d.state();
        assert!(st.ready.contains_key(&1) && st.writing.contains_key(&0));
        assert_eq!((st.ready_bytes, st.writing_bytes), (SHARD, SHARD));
    }
    assert_eq!(d.held_in(1), Some(HeldIn::Memory));
    drop(held);
    first.await.unwrap();
    assert_eq!(d.held_in(0), Some(HeldIn::Cache));
    assert_eq!(entry_files(&dir).len(), 1, "shard 0 only");
    // With the writes done, the next shard is cached again.
    placed(&d, 2, vec![Bytes::from(d_bytes(2))]).await;
    assert_eq!(entry_files(&dir).len(), 2);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_failed_cache_write_leaves_no_entry_gives_its_room_back_and_keeps_a_wanted_shard() {
    let dir = cache_dir("failed-write");
    let os = Arc::new(Gated::new());
    let d = dataset("failed-write", &os, Some(&dir)).await;
    d.hint(1, 1, vec![1]);
    // The entry's partial file cannot be created: a directory has its name.
    let (o, w) = (&d.objects[0], &d.shards[1]);
    let name = cache::entry_name(1, &o.key, &o.etag, (SHARD, SHARD), w.crc32c);
    std::fs::create_dir_all(dir.join(format!(".{name}.partial"))).unwrap();
    placed(&d, 1, vec![Bytes::from(d_bytes(1))]).await;
    let c = d.cache.as_ref().unwrap().lock().unwrap();
    assert!(!c.holds(1) && c.is_empty(), "no entry");
    assert_eq!(c.used(), 0, "its room given back");
    drop(c);
    assert!(entry_files(&dir).is_empty());
    // A hint names the shard: its bytes stay in memory for its FETCH.
    let st = d.state();
    assert!(st.writing.is_empty() && st.ready.contains_key(&1));
    assert_eq!((st.writing_bytes, st.ready_bytes), (0, SHARD));
    drop(st);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn an_entry_whose_bytes_a_node_reported_while_it_was_written_is_checked_before_served() {
    let dir = cache_dir("reported-writing");
    let os = Arc::new(Gated::new());
    let d = dataset("reported-writing", &os, Some(&dir)).await;
    let held = d.write_gate.hold_back();
    let write = d.place(1, vec![Bytes::from(d_bytes(1))]).expect("admitted");
    d.corrupt_reported(3, 1);
    {
        let st = d.state();
        assert!(
            !st.writing.contains_key(&1),
            "the copy in memory is not served again"
        );
        // Before, they left the count at once, though the write still held them.
        assert_eq!(st.writing_bytes, SHARD, "counted until the write ends");
    }
    drop(held);
    write.await.unwrap();
    assert_eq!(d.state().writing_bytes, 0, "the write ended");
    let hit = d
        .cache
        .as_ref()
        .unwrap()
        .lock()
        .unwrap()
        .lookup(1)
        .expect("written");
    assert!(!hit.verified, "checked against its CRC before it is served");
    drop(hit);
    assert!(
        matches!(d.cached(1).await, Cached::Hit(_)),
        "its bytes are good: served"
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_commit_whose_rename_stalls_holds_up_no_fetch_of_a_cached_shard_and_no_read() {
    let dir = cache_dir("stalled-rename");
    let os = Arc::new(Gated::new());
    os.open();
    let d = dataset("stalled-rename", &os, Some(&dir)).await;
    placed(&d, 0, vec![Bytes::from(d_bytes(0))]).await;
    // The cache's disk stops answering while shard 1's write renames its file into place.
    let stall = cache::stall::hold(&dir);
    let write = d.place(1, vec![Bytes::from(d_bytes(1))]).expect("admitted");
    until("the commit's rename waiting", || stall.waiting() == 1).await;
    // Before, the rename ran under the cache's lock: a FETCH of a cached shard waited for
    // it (`cached`), and so did the next shard read, holding the dataset's lock (`place`),
    // each on one of the runtime's two threads.
    let cache = d.cache.as_ref().expect("a cache");
    assert!(
        cache.try_lock().is_ok(),
        "the cache's lock is free while its disk stalls"
    );
    let (body, how) = within("a FETCH of a cached shard", fetch(&d, 1, 0))
        .await
        .unwrap()
        .expect("served");
    assert!(matches!(body, Body::File { .. }) && how == Served::Cached);
    assert_eq!(bytes_of(&body), d_bytes(0));
    let next = d.place(2, vec![Bytes::from(d_bytes(2))]);
    assert!(
        next.is_some(),
        "the next shard read is admitted to the cache"
    );
    assert_eq!(d.held_in(1), Some(HeldIn::Memory), "still being written");
    assert!(!write.is_finished());
    drop(stall);
    write.await.unwrap();
    next.expect("admitted").await.unwrap();
    assert_eq!(d.held_in(1), Some(HeldIn::Cache));
    assert_eq!(d.held_in(2), Some(HeldIn::Cache));
    assert_eq!(entry_files(&dir).len(), 3);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `held`, dropped after `after` at the latest (whatever the test does meanwhile).
fn released_after(
    held: cache::stall::Held,
    after: Duration,
) -> Arc<Mutex<Option<cache::stall::Held>>> {
    let held = Arc::new(Mutex::new(Some(held)));
    let watchdog = Arc::clone(&held);
    std::thread::spawn(move || {
        std::thread::sleep(after);
        drop(watchdog.lock().unwrap_or_else(|p| p.into_inner()).take());
    });
    held
}

/// The open of a cached shard's file blocks (a cache disk whose server went away): its FETCH
/// is answered from the store once the open's time limit has passed, and meanwhile a FETCH of
/// another dataset's cached shard is served from its cache; once the open returns, the cache
/// serves again. Before, the open ran on the runtime's thread (here its only one): nothing
/// else ran until the disk answered (here, a watchdog lets the open through after 10 s).
#[tokio::test(flavor = "current_thread")]
async fn a_fetch_of_a_cached_shard_whose_open_stalls_reads_the_store_and_holds_up_nothing_else() {
    let (dir, other_dir) = (cache_dir("stalled-open"), cache_dir("stalled-open-other"));
    let os = Arc::new(Gated::new());
    os.open();
    let mut d = dataset("stalled-open", &os, Some(&dir)).await;
    let limit = Duration::from_millis(500);
    Arc::get_mut(&mut d).expect("only reference").disk = disk::CacheDisk::own(limit);
    let other_os = Arc::new(Gated::new()); // an object of its own (a put changes the ETag)
    let other = dataset("stalled-open-other", &other_os, Some(&other_dir)).await;
    placed(&d, 0, vec![Bytes::from(d_bytes(0))]).await;
    placed(&other, 0, vec![Bytes::from(d_bytes(0))]).await;
    let held = released_after(cache::stall::hold_opens(&dir), Duration::from_secs(10));
    let waiting = || held.lock().unwrap().as_ref().map_or(0, |h| h.waiting());
    let stalled = fetch(&d, 1, 0);
    until("the open waiting", || waiting() == 1).await;
    let (body, how) = within("another dataset's FETCH", fetch(&other, 1, 0))
        .await
        .unwrap()
        .expect("served");
    assert!(matches!(body, Body::File { .. }) && how == Served::Cached);
    assert_eq!(bytes_of(&body), d_bytes(0));
    // The stalled FETCH: from the store, past the open's limit, the disk still stalled; its
    // open given up once, and the entry not looked at again. Before, it looked the entry up
    // and opened it a second time (refused at once while the first hangs: given up twice).
    let (body, how) = within("the stalled FETCH", stalled)
        .await
        .unwrap()
        .expect("served");
    assert!(matches!(body, Body::Memory(_)) && how == Served::Read);
    assert_eq!(bytes_of(&body), d_bytes(0));
    assert_eq!(os.asked.load(Ordering::SeqCst), 1, "GETs");
    assert_eq!(waiting(), 1, "the open still stalled");
    assert_eq!(d.disk.given_up(), 1, "operations given up by the FETCH");
    // The disk answers again: once the open returns, the cache serves again.
    drop(held.lock().unwrap().take());
    let t0 = Instant::now();
    loop {
        let again = within("after the disk answers", fetch(&d, 2, 0)).await;
        let (body, how) = again.unwrap().expect("served");
        assert_eq!(bytes_of(&body), d_bytes(0));
        if how == Served::Cached {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "not from the cache");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop((d, other));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other_dir);
}

/// A dataset `test` over `os` with a cache in `dir` whose disk operations have `limit`, holding
/// shards `shards`; those of `unchecked` are to be checked against their CRC before they are
/// served (as entries kept over a restart).
async fn with_entries(
    test: &str,
    os: &Arc<Gated>,
    dir: &std::path::Path,
    limit: Duration,
    shards: &[u32],
    unchecked: &[u32],
) -> Arc<RemoteDataset> {
    let mut d = dataset(test, os, Some(dir)).await;
    Arc::get_mut(&mut d).expect("only reference").disk = disk::CacheDisk::own(limit);
    for &s in shards {
        placed(&d, s, vec![Bytes::from(d_bytes(u64::from(s)))]).await;
    }
    let mut c = d.cache.as_ref().expect("a cache").lock().unwrap();
    for &s in unchecked {
        c.recheck(s);
    }
    drop(c);
    d
}

/// The CRC reads of entries not checked yet take slots of their own: while they hang, a
/// FETCH of a checked entry opens it at once and is served from the cache. Before, they took
/// the opens' slots ([`crate::stat::FS_CHECKS`] per file system over every dataset): after a
/// restart, a hit's open waited behind the first serves' CRC reads, was given up as one that
/// could not start, and its FETCH read the store.
#[tokio::test(flavor = "current_thread")]
async fn crc_reads_that_hang_take_none_of_the_slots_of_a_hits_open() {
    let dir = cache_dir("crc-slots");
    let os = Arc::new(Gated::new());
    os.open();
    let limit = Duration::from_millis(500);
    let d = with_entries("crc-slots", &os, &dir, limit, &[0, 1], &[0]).await;
    let read = cache::stall::hold_op(&dir, cache::stall::Op::Read);
    let held = released_after(read, Duration::from_secs(10));
    let waiting = || held.lock().unwrap().as_ref().map_or(0, |h| h.waiting());
    // As many FETCHes of the unchecked entry as there are slots for opens: each reads it.
    let checks: Vec<Fetch> = (1..=crate::stat::FS_CHECKS as u64)
        .map(|session| fetch(&d, session, 0))
        .collect();
    until("the CRC reads hanging", || waiting() == disk::CRC_READS).await;
    let checked = within("a FETCH of a checked entry", fetch(&d, 9, 1)).await;
    let (body, how) = checked.unwrap().expect("served");
    assert!(
        matches!(body, Body::File { .. }) && how == Served::Cached,
        "{how:?}"
    );
    assert_eq!(bytes_of(&body), d_bytes(1));
    // Those of the unchecked one: from the store, their reads given up (nothing read within
    // the limit) or refused (while those hang), one count each; the entry stays unchecked.
    for f in checks {
        let (body, how) = within("a FETCH whose CRC read hangs", f)
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(body, Body::Memory(_)) && how == Served::Read,
            "{how:?}"
        );
        assert_eq!(bytes_of(&body), d_bytes(0));
    }
    assert_eq!(waiting(), disk::CRC_READS, "CRC reads started");
    assert_eq!(d.disk.given_up(), crate::stat::FS_CHECKS);
    let c = d.cache.as_ref().unwrap().lock().unwrap().lookup(0);
    assert!(!c.expect("kept").verified, "still to be checked");
    // The disk answers: once the reads return, the entry is checked and served.
    drop(held.lock().unwrap().take());
    let t0 = Instant::now();
    loop {
        let again = within("after the disk answers", fetch(&d, 10, 0)).await;
        let (body, how) = again.unwrap().expect("served");
        assert_eq!(bytes_of(&body), d_bytes(0));
        if how == Served::Cached {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "not from the cache");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CRC read on a slow disk runs as long as it moves: its FETCH is served from the cache
/// however long the whole read takes; one that reads nothing for the limit is given up, once,
/// and its FETCH reads the store without looking at the entry again. Before, a read had 1 s
/// per 16 MiB of the entry beyond the limit, in all (here 1.5 s, for a read of 1.7 s: given
/// up, and its FETCH read the store); and a FETCH whose read was given up looked the entry up,
/// opened it and read it again (refused at once while the first hangs: given up twice).
#[tokio::test(flavor = "current_thread")]
async fn a_crc_read_is_given_up_when_it_stops_moving_not_when_it_is_slow() {
    let dir = cache_dir("crc-moving");
    let os = Arc::new(Gated::new());
    os.open();
    let limit = Duration::from_millis(500);
    let d = with_entries("crc-moving", &os, &dir, limit, &[0, 1], &[0, 1]).await;
    // 17 reads of 1 MiB (the last finds the end), each 100 ms late: 1.7 s in all.
    let slow = cache::stall::pace(&dir, cache::stall::Op::Read, Duration::from_millis(100));
    let t0 = Instant::now();
    let got = within("a FETCH whose CRC read is slow", fetch(&d, 1, 0)).await;
    let (body, how) = got.unwrap().expect("served");
    assert!(t0.elapsed() > 3 * limit, "the read took {:?}", t0.elapsed());
    assert!(
        matches!(body, Body::File { .. }) && how == Served::Cached,
        "{how:?}"
    );
    assert_eq!(bytes_of(&body), d_bytes(0));
    assert!(
        slow.waiting() >= 17,
        "reads of the CRC check: {}",
        slow.waiting()
    );
    assert_eq!(d.disk.given_up(), 0);
    drop(slow);
    // A CRC read that reads nothing: given up after the limit, once.
    let read = cache::stall::hold_op(&dir, cache::stall::Op::Read);
    let held = released_after(read, Duration::from_secs(10));
    let t0 = Instant::now();
    let got = within("a FETCH whose CRC read hangs", fetch(&d, 1, 1)).await;
    let (body, how) = got.unwrap().expect("served");
    assert!(t0.elapsed() >= limit, "given up after {:?}", t0.elapsed());
    assert!(
        matches!(body, Body::Memory(_)) && how == Served::Read,
        "{how:?}"
    );
    assert_eq!(bytes_of(&body), d_bytes(1));
    assert_eq!(d.disk.given_up(), 1, "the entry not looked at again");
    assert_eq!(os.asked.load(Ordering::SeqCst), 1, "GETs");
    drop(held.lock().unwrap().take());
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The unlink of a failed entry's file that is given up (it did not return in time) lets the
/// shard be cached again once it returns; one refused before it starts (while that one
/// hangs) lets it be cached again at once, its file left in place for the shard's next entry
/// to replace. Either way the cache is told ([`cache::DiskCache::deleted`]): else the shard
/// would pass through uncached for good.
#[tokio::test(flavor = "current_thread")]
async fn an_unlink_given_up_or_refused_lets_the_shard_be_cached_again() {
    let dir = cache_dir("unlink-given-up");
    let os = Arc::new(Gated::new());
    let limit = Duration::from_secs(1);
    let d = with_entries("unlink-given-up", &os, &dir, limit, &[1, 2], &[]).await;
    let c = d.cache.as_ref().expect("a cache");
    // An entry taken out (as one found cut short): its file system and file to delete.
    let take_out = |s: u32| {
        let mut c = c.lock().unwrap();
        let found = c.lookup(s).expect("cached");
        let doomed = c.remove_cut_short(s, found.id).expect("its entry");
        (found.dev, doomed)
    };
    let going = |s: u32| c.lock().unwrap().going(s);
    let unlink = cache::stall::hold_op(&dir, cache::stall::Op::Unlink);
    let held = released_after(unlink, Duration::from_secs(10));
    let (dev, one) = take_out(1);
    let unlinked = d.discard(1, dev, Some(one.clone())).await;
    assert!(unlinked.is_err(), "given up past its limit");
    assert_eq!(d.disk.given_up(), 1);
    assert!(
        going(1) && one.exists(),
        "its unlink may still run: not cached again yet"
    );
    let (dev, two) = take_out(2);
    let t0 = Instant::now();
    let unlinked = d.discard(2, dev, Some(two.clone())).await;
    assert!(unlinked.is_err(), "refused");
    assert!(
        t0.elapsed() < limit,
        "refused at once while the first hangs"
    );
    assert_eq!(d.disk.given_up(), 2);
    assert!(
        !going(2) && two.exists(),
        "never started: cached again at once"
    );
    placed(&d, 2, vec![Bytes::from(d_bytes(2))]).await;
    assert_eq!(
        d.held_in(2),
        Some(HeldIn::Cache),
        "its new entry replaced the file"
    );
    // The first unlink returns: the file is gone, and the shard may be cached again.
    drop(held.lock().unwrap().take());
    until("the given-up unlink returned", || !going(1)).await;
    assert!(!one.exists(), "deleted");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn unhinted_shards_in_memory_are_not_looked_at_while_half_the_budget_or_less_is_held() {
    let os = Arc::new(Gated::new());
    let mut d = dataset("drop-unhinted", &os, None).await;
    Arc::get_mut(&mut d).expect("only reference").budget = 400;
    // Read for FETCHes that ended without taking them: no hint names them.
    let add = |s: u32| d.place(s, vec![Bytes::from(vec![s as u8; 100])]);
    assert!(add(0).is_none() && add(1).is_none(), "no cache");
    // Half the budget held by shards no hint names: none is dropped, and (before: all
    // were) none is looked at.
    assert_eq!(d.drop_unhinted(&mut d.state()), 0, "shards looked at");
    assert_eq!(d.state().ready.len(), 2);
    // Past half of it, unhinted ones go until half is held, each looked at once.
    assert!(add(2).is_none());
    assert_eq!(d.drop_unhinted(&mut d.state()), 1, "shards looked at");
    let st = d.state();
    assert_eq!((st.ready.len(), st.ready_bytes), (2, 200));
}

/// With more than half the budget held by hinted shards (the read ahead keeps memory near
/// the budget), a wake looks at no shard in memory until something made one droppable: a
/// hint replaced, a FETCH ended; and then at that one only. Before, every such wake looked
/// up every shard in memory (32 Ki lookups a wake for 16 KiB shards in 512 MiB) to drop none.
#[tokio::test(flavor = "current_thread")]
async fn wakes_with_memory_full_of_hinted_shards_look_at_none_until_one_can_go() {
    let os = Arc::new(Gated::new());
    let mut d = dataset("drop-noted", &os, None).await;
    Arc::get_mut(&mut d).expect("only reference").budget = 400;
    d.hint(1, 1, vec![0, 1]);
    d.hint(1, 2, vec![2, 3]);
    for s in 0..4 {
        assert!(d.place(s, vec![Bytes::from(vec![s as u8; 100])]).is_none());
    }
    assert_eq!(d.state().ready_bytes, 400);
    for _ in 0..3 {
        assert_eq!(d.drop_unhinted(&mut d.state()), 0, "shards looked at");
    }
    // Stream 1's hint no longer names 0: it goes, looked at alone.
    d.hint(1, 1, vec![1]);
    assert_eq!(d.drop_unhinted(&mut d.state()), 1, "shards looked at");
    assert!(!d.state().ready.contains_key(&0), "dropped");
    assert_eq!(d.drop_unhinted(&mut d.state()), 0, "nothing changed since");
    // A FETCH of 2 uses up its hint entry and is under way: 2 stays; it ends without taking
    // it (cancelled): 2 goes.
    let fetch = d.want(1, 2);
    assert_eq!(d.drop_unhinted(&mut d.state()), 0, "wanted");
    drop(fetch);
    assert_eq!(d.drop_unhinted(&mut d.state()), 1, "shards looked at");
    let st = d.state();
    assert_eq!((st.ready.len(), st.ready_bytes), (2, 200));
    assert!(st.ready.contains_key(&1) && st.ready.contains_key(&3));
}

/// A report drops from memory the bytes read and not sent, and names apart those of a copy
/// being written to the cache, which its write still holds: the log says how many of each.
/// Before, the bytes being written counted as dropped.
#[tokio::test(flavor = "current_thread")]
async fn a_report_tells_the_bytes_dropped_from_those_still_being_written() {
    let dir = cache_dir("reported-split");
    let os = Arc::new(Gated::new());
    let d = dataset("reported-split", &os, Some(&dir)).await;
    let held = d.write_gate.hold_back();
    let write = d.place(1, vec![Bytes::from(d_bytes(1))]).expect("admitted");
    {
        let mut st = d.state();
        st.ready.insert(0, vec![Bytes::from(d_bytes(0))]);
        st.ready_bytes += SHARD;
    }
    assert_eq!(
        d.drop_from_memory(1),
        (0, SHARD),
        "being written: not dropped"
    );
    assert_eq!(d.drop_from_memory(0), (SHARD, 0), "read, not sent: dropped");
    assert_eq!(d.drop_from_memory(2), (0, 0), "not in memory");
    {
        let st = d.state();
        assert_eq!(st.ready_bytes, 0);
        assert_eq!(st.writing_bytes, SHARD, "counted until the write ends");
    }
    drop(held);
    write.await.unwrap();
    assert_eq!(d.state().writing_bytes, 0, "the write ended");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node that reports every payload of shards being written does not let more writes in
/// than [`RemoteDataset::write_budget`]: the reported shard's write still holds its bytes.
#[tokio::test(flavor = "current_thread")]
async fn a_shard_reported_while_written_still_counts_in_the_write_budget() {
    let dir = cache_dir("reported-budget");
    let os = Arc::new(Gated::new());
    let mut d = dataset("reported-budget", &os, Some(&dir)).await;
    // Writes may hold one shard in memory (half the budget).
    Arc::get_mut(&mut d).expect("only reference").budget = 2 * SHARD;
    let held = d.write_gate.hold_back();
    let first = d.place(0, vec![Bytes::from(d_bytes(0))]).expect("admitted");
    d.corrupt_reported(3, 0);
    // Before, the report took shard 0's bytes out of the count and shard 1 was admitted: a
    // write per reported shard, each holding a shard in memory, up to the cache's size.
    assert!(
        d.place(1, vec![Bytes::from(d_bytes(1))]).is_none(),
        "the writes are still a shard behind"
    );
    drop(held);
    first.await.unwrap();
    assert_eq!(d.state().writing_bytes, 0);
    placed(&d, 2, vec![Bytes::from(d_bytes(2))]).await;
    assert_eq!(entry_files(&dir).len(), 2, "shards 0 and 2");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// At most [`CACHE_WRITERS`] cache writes of a dataset run at once; the others wait their
/// turn (their bytes in memory, counted). Before, each admitted shard took a blocking thread
/// at once: small shards on a slow disk took the runtime's blocking threads from the checks
/// of local shard files.
#[tokio::test(flavor = "current_thread")]
async fn cache_writes_run_a_few_at_a_time() {
    let dir = cache_dir("writers");
    let os = Arc::new(Gated::new());
    let d = dataset("writers", &os, Some(&dir)).await;
    let held = d.write_gate.hold_back();
    let writes: Vec<_> = (0..4u32)
        .map(|s| {
            let parts = vec![Bytes::from(d_bytes(u64::from(s)))];
            d.place(s, parts).expect("admitted")
        })
        .collect();
    let came = || d.write_gate.came.load(Ordering::SeqCst);
    let t0 = Instant::now();
    while came() < CACHE_WRITERS {
        assert!(t0.elapsed() < Duration::from_secs(10), "writes not started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await; // room for more to start, were it let
    assert_eq!(came(), CACHE_WRITERS, "writes running at once");
    assert_eq!(
        d.state().writing_bytes,
        4 * SHARD,
        "all four wait in memory"
    );
    drop(held);
    for w in writes {
        w.await.expect("the write ran");
    }
    assert_eq!(came(), 4);
    assert_eq!(entry_files(&dir).len(), 4);
    assert_eq!(d.state().writing_bytes, 0);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_fetch_that_waits_for_a_read_ahead_makes_it_urgent() {
    let os = Arc::new(Gated::new());
    let d = dataset("raised", &os, None).await;
    let ahead = {
        let mut st = d.state();
        d.begin(&mut st, vec![3], true)
    };
    let urgency = |d: &RemoteDataset| d.state().loading[&3].urgency.is_urgent();
    assert!(!urgency(&d), "a read ahead waits behind the FETCHes' reads");
    let me = Arc::clone(&d);
    let ahead = tokio::spawn(async move { me.load(ahead).await });
    until("the read ahead's GET", || {
        os.asked.load(Ordering::SeqCst) == 1
    })
    .await;
    let b = fetch(&d, 1, 3);
    until("the FETCH waiting", || fetches(&d, 3) == 1).await;
    tokio::task::yield_now().await;
    assert!(urgency(&d), "the read ahead a FETCH waits for goes first");
    os.open();
    ahead.await.unwrap().expect("read");
    let (b, how) = b.await.unwrap().expect("served");
    assert_eq!(bytes_of(&b).len() as u64, SHARD);
    assert_eq!(how, Served::Read);
    assert_eq!(os.asked.load(Ordering::SeqCst), 1, "GETs");
}

#[tokio::test(flavor = "current_thread")]
async fn bytes_read_ahead_for_a_fetch_still_queued_stay_when_a_new_hint_leaves_it_out() {
    let os = Arc::new(Gated::new());
    let mut d = dataset("queued", &os, None).await;
    // A budget of one shard: two in memory are past half of it, so unhinted ones go.
    Arc::get_mut(&mut d).expect("only reference").budget = SHARD;
    d.hint(1, 7, vec![0, 1, 2]);
    {
        let mut st = d.state();
        for s in [0, 1] {
            st.ready
                .insert(s, vec![Bytes::from(vec![s as u8; SHARD as usize])]);
            st.ready_bytes += SHARD;
        }
    }
    // FETCHes of 0 and 1 arrive; 1's waits in its session's queue (its reads are at the
    // memory budget), and 0's ends (its node went away). The node's next hint names only
    // what comes after.
    drop(d.want(1, 0));
    let queued = d.want(1, 1);
    d.hint(1, 7, vec![2, 3]);
    d.drop_unhinted(&mut d.state());
    {
        let st = d.state();
        assert!(
            !st.ready.contains_key(&0),
            "no FETCH wants shard 0: dropped"
        );
        assert!(st.ready.contains_key(&1), "the queued FETCH's shard stays");
        assert_eq!(st.ready_bytes, SHARD);
    }
    let (body, how) = queued.get(1).await.expect("served");
    assert_eq!(how, Served::Prefetched);
    assert_eq!(bytes_of(&body), vec![1u8; SHARD as usize]);
    assert_eq!(os.asked.load(Ordering::SeqCst), 0, "no GET");
}

#[tokio::test(flavor = "current_thread")]
async fn a_fetch_that_missed_the_cache_takes_an_entry_committed_since() {
    let dir = std::env::temp_dir().join(format!(
        "shardwire-remote-test-committed-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let os = Arc::new(Gated::new());
    let d = dataset("committed", &os, Some(&dir)).await;
    // The entry lands (a read for another FETCH, settled) after this FETCH's cache lookup.
    placed(&d, 2, vec![Bytes::from(vec![2u8; SHARD as usize])]).await;
    assert!(
        matches!(d.claim(2, true), Claim::Again),
        "taken from the cache"
    );
    // Once only: an entry it still cannot use is read from the store.
    assert!(matches!(d.claim(2, false), Claim::Read(_)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_cache_entry_cut_short_is_deleted_and_read_again_not_sent() {
    let dir = std::env::temp_dir().join(format!(
        "shardwire-remote-test-short-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let os = Arc::new(Gated::new());
    os.open();
    let d = dataset("short", &os, Some(&dir)).await;
    placed(&d, 1, vec![Bytes::from(vec![1u8; SHARD as usize])]).await;
    assert!(
        matches!(d.cached(1).await, Cached::Hit(_)),
        "a whole entry is served"
    );
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.metadata().is_ok_and(|m| m.len() == SHARD))
        .collect();
    assert_eq!(files.len(), 1, "one entry file");
    std::fs::OpenOptions::new()
        .write(true)
        .open(files[0].path())
        .unwrap()
        .set_len(SHARD / 2)
        .unwrap();
    // Before: served (verified when written), and the sender's `sendfile` ran out of bytes
    // mid-payload: the node's whole session ended, again on every session it went to.
    assert!(matches!(d.cached(1).await, Cached::Miss));
    assert!(
        !files[0].path().exists(),
        "the short entry is deleted: the next FETCH reads the store"
    );
    let (body, _) = fetch(&d, 1, 1).await.unwrap().unwrap();
    assert_eq!(bytes_of(&body), d_bytes(1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Shard `s`'s bytes in [`dataset`]'s object.
fn d_bytes(s: u64) -> Vec<u8> {
    (s * SHARD..(s + 1) * SHARD)
        .map(|i| (i * 7 % 251) as u8)
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn shards_read_for_one_session_are_not_kept_for_another_sessions_queued_fetches() {
    let os = Arc::new(Gated::new());
    os.open();
    let mut d = dataset("queued-elsewhere", &os, None).await;
    Arc::get_mut(&mut d).expect("only reference").budget = 2 * SHARD;
    // A slow node session's FETCHes of every shard wait in its queue.
    let queued: Vec<Wanted> = (0..4).map(|s| d.want(2, s)).collect();
    for s in 0..4u32 {
        let (body, _) = fetch(&d, 1, s).await.unwrap().expect("served");
        assert_eq!(bytes_of(&body), d_bytes(u64::from(s)));
    }
    // Before, each shard read for session 1 stayed in memory for session 2's queued FETCH:
    // four shards held past a budget of two, and the read ahead stopped.
    let held = d.state().ready_bytes;
    assert!(held <= d.budget, "{held} bytes held in memory");
    // The queued FETCHes are served all the same when their turn comes.
    for (s, w) in queued.into_iter().enumerate() {
        let (body, _) = w.get(2).await.expect("served");
        assert_eq!(bytes_of(&body), d_bytes(s as u64));
    }
    assert_eq!(d.state().ready_bytes, 0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_cache_entry_a_node_reports_corrupt_is_checked_again_and_read_anew() {
    let dir = std::env::temp_dir().join(format!(
        "shardwire-remote-test-reported-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let os = Arc::new(Gated::new());
    os.open();
    let d = dataset("reported", &os, Some(&dir)).await;
    placed(&d, 1, vec![Bytes::from(d_bytes(1))]).await;
    assert!(
        d.held_in(1) == Some(HeldIn::Cache) && d.held_in(2).is_none(),
        "held: the cached shard only"
    );
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "shard"))
        .collect();
    assert_eq!(files.len(), 1, "one entry file");
    // The entry goes bad on disk after it was written (and verified).
    {
        use std::os::unix::fs::FileExt;
        let rot = [d_bytes(1)[100] ^ 0xff];
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&files[0])
            .unwrap();
        f.write_all_at(&rot, 100).unwrap();
    }
    assert!(
        matches!(d.cached(1).await, Cached::Hit(_)),
        "verified when written: served"
    );
    // A session the cache never served it to reports it.
    d.corrupt_reported(3, 1);
    assert!(
        matches!(d.cached(1).await, Cached::Miss),
        "checked against its CRC: failed"
    );
    assert!(
        !files[0].exists() && d.held_in(1).is_none(),
        "the bad entry is deleted"
    );
    let (body, how) = fetch(&d, 3, 1).await.unwrap().expect("served");
    assert_eq!(bytes_of(&body), d_bytes(1));
    assert_eq!(how, Served::Read);
    assert_eq!(
        os.asked.load(Ordering::SeqCst),
        1,
        "read anew from the store"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_shard_in_memory_a_node_reports_corrupt_is_dropped() {
    let os = Arc::new(Gated::new());
    let d = dataset("reported-memory", &os, None).await;
    assert!(d.held_in(0).is_none(), "nothing in memory, no cache");
    {
        let mut st = d.state();
        st.ready.insert(0, vec![Bytes::from(d_bytes(0))]);
        st.ready_bytes += SHARD;
    }
    assert!(
        d.held_in(0) == Some(HeldIn::Memory) && d.held_in(1).is_none(),
        "held: the shard in memory only"
    );
    d.corrupt_reported(1, 0);
    {
        let st = d.state();
        assert!(
            !st.ready.contains_key(&0),
            "dropped: the next FETCH reads it anew"
        );
        assert_eq!(st.ready_bytes, 0);
    }
    assert!(d.held_in(0).is_none());
    d.corrupt_reported(1, 2); // neither in memory nor cached: nothing to do
    assert_eq!(d.state().ready_bytes, 0);
}

#[tokio::test(flavor = "current_thread")]
async fn two_fetches_of_a_shard_in_memory_started_close_together_read_nothing_from_the_store() {
    let os = Arc::new(Gated::new());
    os.open();
    let d = dataset("started-together", &os, None).await;
    {
        let mut st = d.state();
        st.ready.insert(0, vec![Bytes::from(d_bytes(0))]);
        st.ready_bytes += SHARD;
    }
    // Two node sessions start FETCHes of it close together: both leave their queues (their
    // sessions count them as reading) before either's task runs.
    let (mut a, mut b) = (d.want(1, 0), d.want(2, 0));
    a.leave_queue();
    b.leave_queue();
    let a = tokio::spawn(async move { a.get(1).await });
    let b = tokio::spawn(async move { b.get(2).await });
    let (a, how_a) = a.await.unwrap().expect("served");
    let (b, how_b) = b.await.unwrap().expect("served");
    assert_eq!(bytes_of(&a), d_bytes(0));
    assert_eq!(bytes_of(&b), d_bytes(0));
    assert_eq!((how_a, how_b), (Served::Prefetched, Served::Prefetched));
    // Before, each counted as reading only once its task ran: the first took the shard out of
    // memory, and the second read it from the store again.
    assert_eq!(os.asked.load(Ordering::SeqCst), 0, "GETs");
    let st = d.state();
    assert!(
        st.ready.is_empty() && st.ready_bytes == 0,
        "memory held after both took it"
    );
}

/// The entry files in cache directory `dir`.
fn entry_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "shard"))
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn a_node_session_asking_again_for_a_cached_shard_costs_no_crc_read() {
    let dir = std::env::temp_dir().join(format!(
        "shardwire-remote-test-again-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let os = Arc::new(Gated::new());
    os.open();
    let d = dataset("again", &os, Some(&dir)).await;
    placed(&d, 1, vec![Bytes::from(d_bytes(1))]).await;
    let (_, how) = fetch(&d, 1, 1).await.unwrap().expect("served");
    assert_eq!(how, Served::Cached);
    // A byte of the entry changes on disk: only a CRC read of the entry would notice.
    let files = entry_files(&dir);
    assert_eq!(files.len(), 1, "one entry file");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&files[0])
            .unwrap();
        f.write_all_at(&[d_bytes(1)[100] ^ 0xff], 100).unwrap();
    }
    // Two streams of one node read the shard: the same node session asks for it again at
    // once. Before, such a FETCH within 30 s read the whole entry for its CRC first (here,
    // finding the change, it deleted the entry and read the store); a node reports a payload
    // that failed its check (`ChecksumMismatch`), and that report has the entry checked.
    let (_, how) = fetch(&d, 1, 1).await.unwrap().expect("served");
    assert_eq!(how, Served::Cached, "served from the entry, unchecked");
    assert_eq!(os.asked.load(Ordering::SeqCst), 0, "GETs");
    d.corrupt_reported(1, 1);
    assert!(
        matches!(d.cached(1).await, Cached::Miss),
        "reported: checked, failed"
    );
    assert!(entry_files(&dir).is_empty(), "and deleted");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `n` shards of one byte each, in order, of object 0.
fn one_byte_shards(n: u32) -> Vec<Want> {
    (0..n)
        .map(|s| Want {
            shard: s,
            object: 0,
            range: u64::from(s)..u64::from(s) + 1,
            crc32c: 0,
        })
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn a_wake_of_the_prefetch_passes_over_a_bounded_stretch_and_goes_on_where_it_stopped() {
    let os = Arc::new(Gated::new());
    let mut d = dataset("scan", &os, None).await;
    // 20 000 one-byte shards; ten streams of one node hint 2 000 each. All are held (cached,
    // as in an epoch after the first) but the last in the order.
    let n = 20_000u32;
    Arc::get_mut(&mut d).expect("only reference").shards = one_byte_shards(n);
    for k in 0..10u32 {
        d.hint(1, u64::from(k), (k * 2000..(k + 1) * 2000).collect());
    }
    let last = n - 1;
    let looked = std::cell::Cell::new(0usize);
    let held = |s: u32| {
        looked.set(looked.get() + 1);
        s != last
    };
    let mut calls = 0;
    let group = loop {
        calls += 1;
        looked.set(0);
        let group = d.choose(&mut d.state(), &held, u64::MAX);
        // Before, one call looked at all 20 000, under the dataset's lock (and the cache's,
        // taken for each).
        assert!(
            looked.get() <= prefetch::SCAN,
            "call {calls} looked at {} shards",
            looked.get()
        );
        if !group.is_empty() {
            break group;
        }
        assert!(calls < 100, "shard {last} not reached in {calls} calls");
    };
    assert_eq!(group, [last]);
    assert!(calls > 1);
    // Every call looks at the front of the order: a shard there to be read now is found at
    // once, wherever the last call stopped.
    let held = |s: u32| s != 0 && s != last;
    assert_eq!(d.choose(&mut d.state(), &held, u64::MAX), [0]);
}

#[tokio::test]
async fn a_shard_that_stops_being_held_behind_the_scan_is_read_at_the_next_wake() {
    let os = Arc::new(Gated::new());
    let mut d = dataset("scan-behind", &os, None).await;
    // 600 streams of three shards each, all held: two wakes move the scan past the second
    // shard of the last stream. Then that shard stops being held (its backoff ended, its
    // copy in memory was taken). Before, the front of a wake was 512 entries, depth 0 of
    // the first 512 streams: it waited until the scan came round again.
    let (streams, per) = (600u32, 3u32);
    Arc::get_mut(&mut d).expect("only reference").shards = one_byte_shards(streams * per);
    for k in 0..streams {
        d.hint(1, u64::from(k), (k * per..(k + 1) * per).collect());
    }
    let target = (streams - 1) * per + 1;
    let free = std::cell::Cell::new(false);
    let held = |s: u32| !(free.get() && s == target);
    for _ in 0..2 {
        assert!(d.choose(&mut d.state(), &held, u64::MAX).is_empty());
    }
    free.set(true);
    assert_eq!(d.choose(&mut d.state(), &held, u64::MAX), [target]);
}
