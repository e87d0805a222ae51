//! The session's queues and its handling of the node's messages, without data connections
//! (nothing is announced): over a dataset in a scratch directory, served as a local directory
//! (`local`) and through the object-storage path (`remote`, `file://`) with a memory budget
//! of one shard.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;

use shardwire_protocol::Manifest;
use shardwire_protocol::crc::Crc32c;
use shardwire_protocol::manifest::{DType, MANIFEST_FILE, ShardEntry, TensorEntry};
use tokio::net::TcpListener;

use super::*;
use crate::SourceConfig;
use crate::datasets::Datasets;
use crate::remote::{RemoteDataset, RemoteOptions, Served};

/// Bytes of each shard: the remote dataset's memory budget holds one.
const SHARD: u64 = 4096;

/// The node session id of the queues and sessions made here.
const SESSION: u64 = 7;

/// A scratch directory of one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sw-session-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Shard `s`'s bytes.
fn shard_bytes(s: u32) -> Vec<u8> {
    (0..SHARD)
        .map(|i| (i * 7 + u64::from(s) * 13) as u8)
        .collect()
}

/// Writes `n` shards of [`SHARD`] bytes (one file, `d.bin`) and their manifest into `dir`.
fn write_dataset(dir: &Path, n: u32) {
    let mut data = Vec::new();
    let mut shards = Vec::new();
    for s in 0..n {
        let bytes = shard_bytes(s);
        let mut crc = Crc32c::new();
        crc.update(&bytes);
        let offset = data.len() as u64;
        data.extend_from_slice(&bytes);
        let tensor = TensorEntry::dense("x".into(), DType::Uint8, vec![SHARD], offset, SHARD);
        shards.push(ShardEntry {
            file: "d.bin".into(),
            offset,
            length: SHARD,
            crc32c: crc.finish(),
            tensors: vec![tensor],
        });
    }
    std::fs::write(dir.join("d.bin"), &data).unwrap();
    std::fs::write(dir.join(MANIFEST_FILE), Manifest::new(shards).to_json()).unwrap();
}

/// Datasets `local` and `remote` of `n` shards in `dir`; `remote` with a disk cache if `cache`.
async fn datasets(dir: &Scratch, n: u32, cache: bool) -> Datasets {
    let data = dir.0.join("data");
    write_dataset(&data, n);
    let opts = RemoteOptions {
        request_size: SHARD / 2, // a memory budget of 2 x request size x 1 in flight: one shard
        max_inflight: 1,
        cache_dir: cache.then(|| dir.0.join("cache")),
        cache_size: 1 << 20,
    };
    let mut d = Datasets::default();
    d.add("local", &data).unwrap();
    let url = format!("file://{}", data.display());
    d.add_remote("remote", &url, &opts).await.unwrap();
    d
}

/// The `remote` dataset of `d`.
fn remote(d: &Datasets) -> Arc<RemoteDataset> {
    match &d.get("remote").expect("opened").backend {
        Backend::Remote(r) => Arc::clone(r),
        Backend::Local { .. } => panic!("`remote` is served from object storage"),
    }
}

/// Empty queues of `lanes` lanes, their reads counted in `source` (all sessions').
fn queues(lanes: usize, source: &Arc<AtomicU64>) -> Queues {
    Queues::new(SESSION, lanes, Arc::default(), source)
}

/// The head of FETCH `req` of `shard`.
fn head(req: u64, shard: u32) -> Head {
    Head {
        req,
        len: SHARD,
        corrupt: false,
        shard,
        crc32c: 0,
        file: None,
        dataset: Arc::from("remote"),
    }
}

/// Queues FETCH `req` of `shard` of `r` in `lane`, as the session does.
fn fetch(q: &mut Queues, lane: usize, r: &Arc<RemoteDataset>, req: u64, shard: u32) {
    q.push(
        lane,
        head(req, shard),
        Payload::Later(r.want(SESSION, shard)),
    );
}

/// Whether the read of queued FETCH `req` has started.
fn started(q: &Queues, req: u64) -> bool {
    let (lane, at) = q.find(req, q.queued_reqs[&req]).expect("queued");
    !matches!(q.waiting[lane][at].payload, Payload::Later(_))
}

/// The bytes of a payload.
fn body_bytes(body: &Body) -> Vec<u8> {
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

/// A session of `lanes` lanes over `datasets`, without data connections, and the node's end
/// of its control connection (kept open while the session writes to it).
async fn session(datasets: Datasets, lanes: usize) -> (Session, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (stream, _) = listener.accept().await.unwrap();
    let (rd, wr) = stream.into_split();
    let ctl = Control {
        rd: BufReader::new(rd),
        wr,
        buf: Vec::new(),
        idle: crate::DEFAULT_IDLE_TIMEOUT,
        last_sent: Instant::now(),
    };
    let cfg = SourceConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        secret: None,
        rate_limit: 0,
        fault_corrupt: 0,
        fault_wrong_lane: 0,
        devmem_tx: Arc::default(),
        idle_timeout: crate::DEFAULT_IDLE_TIMEOUT,
        max_connections: 1,
        drain_timeout: crate::DEFAULT_DRAIN_TIMEOUT,
    };
    let shared = Arc::new(Shared {
        datasets,
        cfg,
        corrupt_left: AtomicU32::new(0),
        wrong_lane_left: AtomicU32::new(0),
        sessions: AtomicU64::new(SESSION),
        draining: tokio::sync::watch::Sender::new(false),
        session_reads: Arc::default(),
    });
    let conns = DataConns {
        senders: Vec::new(),
        lane_of: Vec::new(),
    };
    let s = Session::new(
        SESSION,
        ctl,
        shared,
        conns,
        lanes,
        Arc::default(),
        Arc::default(),
    );
    (s, node)
}

#[test]
fn messages_are_named_by_kind() {
    assert_eq!(kind(&Message::Ping), "Ping");
    assert_eq!(kind(&Message::Cancel { req: 3 }), "Cancel");
}

#[tokio::test(flavor = "current_thread")]
async fn waiting_reads_start_in_the_order_their_fetches_arrived_over_all_lanes() {
    let dir = Scratch::new("order");
    let r = remote(&datasets(&dir, 4, false).await);
    let source = Arc::default();
    let mut q = queues(2, &source);
    // Lane 0 gets A1 (req 1) and A2 (req 3), lane 1 B1 (req 2) and B2 (req 4), in the order
    // 1, 2, 3, 4. The budget holds one shard: A1's read runs, the others wait.
    fetch(&mut q, 0, &r, 1, 0);
    fetch(&mut q, 1, &r, 2, 1);
    fetch(&mut q, 0, &r, 3, 2);
    fetch(&mut q, 1, &r, 4, 3);
    assert!(started(&q, 1));
    assert!(!started(&q, 2) && !started(&q, 3) && !started(&q, 4));
    // A1 leaves (sent): room for one read.
    drop(q.take(1).expect("queued"));
    q.start_later();
    // Before, lane 0 went first: A2 started, and B1, older, waited as long as lane 0 had any.
    assert!(started(&q, 2), "B1 arrived before A2");
    assert!(!started(&q, 3) && !started(&q, 4));
    assert!(q.counts_hold());
}

/// As if queued FETCH `req`'s read had waited [`STARVED_PATIENCE`] for room in the source's
/// budget.
fn patience_spent(q: &mut Queues, req: u64) {
    let (lane, at) = q.find(req, q.queued_reqs[&req]).expect("queued");
    let seq = q.waiting[lane][at].seq;
    q.reads.starved_since = Instant::now()
        .checked_sub(STARVED_PATIENCE)
        .map(|t| (seq, t));
}

/// Has the prefetch task read shard `shard` of `r` into memory (`r` has no disk cache), for a
/// hint of another node session.
async fn read_ahead(r: &Arc<RemoteDataset>, shard: u32) {
    let prefetch = tokio::spawn(Arc::clone(r).prefetch());
    r.hint(SESSION + 100, 1, vec![shard]);
    let t0 = Instant::now();
    while r.held_in(shard) != Some(HeldIn::Memory) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "shard {shard} not read ahead after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    prefetch.abort();
}

#[tokio::test(flavor = "current_thread")]
async fn a_fetch_of_a_cached_shard_waits_for_room_in_its_sessions_budget_not_behind_reads() {
    let dir = Scratch::new("held");
    let r = remote(&datasets(&dir, 4, true).await);
    // Shard 3 was read for an earlier FETCH and is in the disk cache.
    let (body, _) = r.want(1, 3).get(1).await.expect("read");
    drop(body);
    assert_eq!(r.held_in(3), Some(HeldIn::Cache));
    let source: Arc<AtomicU64> = Arc::default();
    let mut q = queues(1, &source);
    fetch(&mut q, 0, &r, 1, 0); // its read from the store fills the session's budget
    fetch(&mut q, 0, &r, 2, 1); // waits for room
    fetch(&mut q, 0, &r, 3, 3);
    assert!(started(&q, 1) && !started(&q, 2));
    // Before, it started at once: with data connections slower than the store, so did
    // every FETCH of a held shard, and the session's bytes grew past its budget.
    assert!(!started(&q, 3), "the session's budget is full");
    assert_eq!(q.reads.bytes.load(Ordering::Acquire), SHARD);
    // FETCH 1 is sent. FETCH 2's read from the store now finds the source's budget full
    // (other sessions' reads); the cached shard behind it needs no read.
    drop(q.take(1).expect("queued"));
    source.fetch_add(SOURCE_READ_BUDGETS * SHARD, Ordering::AcqRel);
    q.start_later();
    assert!(!started(&q, 2), "no room in the source's budget");
    assert!(
        started(&q, 3),
        "a cached shard waits behind no read from the store"
    );
    // Its bytes count in its session's budget, not the source's: a file holds no memory.
    assert_eq!(q.reads.bytes.load(Ordering::Acquire), SHARD);
    assert_eq!(source.load(Ordering::Acquire), SOURCE_READ_BUDGETS * SHARD);
    assert!(q.counts_hold());
}

#[tokio::test(flavor = "current_thread")]
async fn a_fetch_of_a_shard_in_memory_counts_in_the_sources_budget_and_waits_for_its_sessions() {
    let dir = Scratch::new("in-memory");
    let r = remote(&datasets(&dir, 4, false).await);
    read_ahead(&r, 2).await;
    // Other sessions' reads fill the source's budget.
    let source = Arc::new(AtomicU64::new(SOURCE_READ_BUDGETS * SHARD));
    let mut q = queues(1, &source);
    fetch(&mut q, 0, &r, 1, 0);
    fetch(&mut q, 0, &r, 2, 2);
    assert!(!started(&q, 1), "no room in the source's budget");
    assert!(started(&q, 2), "in memory: no read from the store");
    assert_eq!(q.reads.bytes.load(Ordering::Acquire), SHARD);
    assert_eq!(
        source.load(Ordering::Acquire),
        (SOURCE_READ_BUDGETS + 1) * SHARD,
        "it holds memory: counted source-wide"
    );
    // Taking shard 2 out of memory let the read ahead read the next: its FETCH waits for
    // room in the session's budget (before, it started at once, and so on without end).
    read_ahead(&r, 3).await;
    fetch(&mut q, 0, &r, 3, 3);
    q.start_later();
    assert!(!started(&q, 3), "the session's budget is full");
    assert_eq!(q.reads.bytes.load(Ordering::Acquire), SHARD);
    assert!(q.counts_hold());
}

#[tokio::test(flavor = "current_thread")]
async fn a_read_that_waited_long_for_room_in_the_sources_budget_starts() {
    let dir = Scratch::new("patience");
    let r = remote(&datasets(&dir, 2, false).await);
    // Other sessions' reads fill the source's budget, and keep it full.
    let source = Arc::new(AtomicU64::new(SOURCE_READ_BUDGETS * SHARD));
    let mut q = queues(1, &source);
    fetch(&mut q, 0, &r, 1, 0);
    q.start_later();
    assert!(!started(&q, 1), "no room in the source's budget");
    assert!(q.reads.starved, "looked at again shortly");
    // Before, it waited until no session of the source read anything: under load, for ever.
    patience_spent(&mut q, 1);
    q.start_later();
    assert!(
        started(&q, 1),
        "it waited long enough, and its session holds no read"
    );
    assert_eq!(
        source.load(Ordering::Acquire),
        (SOURCE_READ_BUDGETS + 1) * SHARD,
        "one shard past the source's budget"
    );
    assert_eq!(q.reads.starved_since, None, "the next read waits afresh");
    // The next waits while this session holds that read.
    fetch(&mut q, 0, &r, 2, 1);
    patience_spent(&mut q, 2);
    q.start_later();
    assert!(!started(&q, 2));
}

#[tokio::test(flavor = "current_thread")]
async fn a_read_waits_its_own_patience_not_that_of_a_cancelled_one() {
    let dir = Scratch::new("patience-cancelled");
    let r = remote(&datasets(&dir, 2, false).await);
    let source = Arc::new(AtomicU64::new(SOURCE_READ_BUDGETS * SHARD));
    let mut q = queues(1, &source);
    fetch(&mut q, 0, &r, 1, 0);
    assert!(!started(&q, 1), "no room in the source's budget");
    patience_spent(&mut q, 1);
    // It is cancelled after it waited; nothing waits now.
    drop(q.take(1).expect("queued"));
    q.start_later();
    assert_eq!(q.reads.starved_since, None);
    // Before, the next read found the old time and started at once, past the budget.
    fetch(&mut q, 0, &r, 2, 1);
    q.start_later();
    assert!(!started(&q, 2), "it waits its own patience");
    assert_eq!(source.load(Ordering::Acquire), SOURCE_READ_BUDGETS * SHARD);
    // Likewise when the one it waited behind is cancelled while it waits.
    patience_spent(&mut q, 2);
    fetch(&mut q, 0, &r, 3, 0);
    drop(q.take(2).expect("queued"));
    q.start_later();
    assert!(!started(&q, 3), "it waits its own patience");
    assert!(q.counts_hold());
}

#[tokio::test(flavor = "current_thread")]
async fn cancels_find_their_fetches_in_any_order_and_by_a_reused_id() {
    let source = Arc::default();
    let mut q = queues(2, &source);
    let n = 1000;
    for req in 1..=n {
        let lane = (req % 2) as usize;
        q.push(lane, head(req, 0), Payload::Ready(Body::Memory(Vec::new())));
    }
    // Id 7 again (lane 1 holds the first): the queues point at this one.
    q.push(0, head(7, 0), Payload::Ready(Body::Memory(Vec::new())));
    for req in (n / 2 + 1..=n).rev() {
        assert!(q.take(req).is_some(), "FETCH {req}, newest first");
    }
    for req in 1..=n / 2 {
        assert!(q.take(req).is_some(), "FETCH {req}, oldest first");
    }
    // The place kept for id 7 is the FETCH cancelled; the other is found all the same.
    assert!(q.take(7).is_some(), "the other FETCH of id 7");
    assert!(q.take(7).is_none(), "none left");
    assert_eq!(q.queued, 0);
    assert!(q.counts_hold());
}

#[test]
fn the_announced_fetches_kept_are_the_latest_and_each_is_reported_once() {
    let mut a = Announced::default();
    let name: Arc<str> = Arc::from("d");
    for req in 1..=ANNOUNCED_KEPT as u64 + 1 {
        a.record(req, Arc::clone(&name), req as u32);
    }
    assert!(a.take(1).is_none(), "the oldest went");
    assert_eq!(a.take(2).map(|(_, shard)| shard), Some(2));
    // Before, a repeated report found it again (and dropped the shard from memory again).
    assert!(a.take(2).is_none(), "reported already");
    // A reused id: the latest announcement counts, and the report takes both.
    a.record(3, Arc::clone(&name), 99);
    assert_eq!(a.take(3).map(|(_, shard)| shard), Some(99));
    assert!(a.take(3).is_none(), "the older one of that id went with it");
    assert_eq!(a.take(4).map(|(_, shard)| shard), Some(4));
}

/// Overwrites each cache entry of `dir` in place (same length, other bytes), as a failing
/// disk would; returns how many.
fn rot_cache(dir: &Scratch) -> usize {
    let mut rotted = 0;
    for e in std::fs::read_dir(dir.0.join("cache").join("remote")).unwrap() {
        let p = e.unwrap().path();
        if std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.len() == SHARD) {
            std::fs::write(&p, vec![0xA5u8; SHARD as usize]).unwrap();
            rotted += 1;
        }
    }
    rotted
}

#[tokio::test(flavor = "current_thread")]
async fn a_checksum_mismatch_the_node_reports_has_the_cache_entry_checked_and_ends_nothing() {
    let dir = Scratch::new("crc");
    let d = datasets(&dir, 2, true).await;
    let r = remote(&d);
    let (mut s, _node) = session(d, 1).await;
    // Shard 1 was read for this session and served from the cache; its entry then went bad.
    let (body, _) = r.want(SESSION, 1).get(SESSION).await.expect("read");
    drop(body);
    assert_eq!(rot_cache(&dir), 1, "cache entries");
    s.announced.record(9, Arc::from("remote"), 1);
    let report = Message::Error {
        req: 9,
        code: ErrorCode::ChecksumMismatch,
        retry_after_ms: 0,
        message: "shard 1: crc32c mismatch".into(),
    };
    // Before, any Error from the node ended the session.
    s.handle(report.clone()).await.expect("the session goes on");
    assert!(
        s.announced.take(9).is_none(),
        "a repeated report of it acts no more"
    );
    s.handle(report).await.expect("a repeated report is logged");
    // Another node's FETCH of it (its own report would recheck it; it sent none).
    let other = SESSION + 1;
    let (body, how) = r.want(other, 1).get(other).await.expect("served");
    assert_eq!(
        how,
        Served::Read,
        "the entry failed its CRC check and the shard was read again"
    );
    assert_eq!(
        body_bytes(&body),
        shard_bytes(1),
        "not the bad entry's bytes"
    );
    // The session serves the next FETCH.
    let next = Message::Fetch {
        req: 10,
        dataset: "local".into(),
        shard: 0,
        lane: 0,
    };
    s.handle(next).await.expect("queued");
    assert_eq!(s.queues.queued, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn other_errors_from_the_node_are_logged_and_end_nothing() {
    let dir = Scratch::new("errors");
    let (mut s, _node) = session(datasets(&dir, 1, false).await, 1).await;
    s.announced.record(5, Arc::from("local"), 0);
    // About the connection; about a FETCH this session did not announce; about a local
    // dataset's (logged only); another code.
    let reports = [
        (0, ErrorCode::Internal),
        (6, ErrorCode::ChecksumMismatch),
        (5, ErrorCode::ChecksumMismatch),
        (5, ErrorCode::BadRequest),
    ];
    for (req, code) in reports {
        let e = Message::Error {
            req,
            code,
            retry_after_ms: 0,
            message: "from the node".into(),
        };
        s.handle(e)
            .await
            .expect("an Error from the node ends nothing");
    }
}
