//! The session's queues and its handling of the node's messages, without data connections
//! (nothing is announced): over a dataset in a scratch directory, served as a local directory
//! (`local`) and through the object-storage path (`remote`, `file://`) with a memory budget
//! of one shard.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;

use shardwire_protocol::Manifest;
use shardwire_protocol::crc::Crc32c;
use shardwire_protocol::framing::{read_message, write_message};
use shardwire_protocol::manifest::{DType, MANIFEST_FILE, ShardEntry, TensorEntry};
use tokio::net::{TcpListener, TcpSocket};

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
    let (stream, node) = connected().await;
    (session_on(stream, datasets, lanes, Arc::default()), node)
}

/// The source's and the node's ends of a loopback control connection.
async fn connected() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (stream, _) = listener.accept().await.unwrap();
    (stream, node)
}

/// [`connected`] with the smallest buffers the kernel allows (the source's send buffer, the
/// node's receive buffer, from before the connection): a write of more than a few KiB waits
/// for the node to read.
async fn connected_small() -> (TcpStream, TcpStream) {
    let listener = TcpSocket::new_v4().unwrap();
    listener.set_send_buffer_size(4096).unwrap();
    listener.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = listener.listen(1).unwrap();
    let node = TcpSocket::new_v4().unwrap();
    node.set_recv_buffer_size(4096).unwrap();
    let node = node.connect(listener.local_addr().unwrap()).await.unwrap();
    let (stream, _) = listener.accept().await.unwrap();
    (stream, node)
}

/// The source's end of control connection `stream`, with the default idle timeout.
fn control(stream: TcpStream) -> Control {
    let (rd, wr) = stream.into_split();
    Control {
        rd: BufReader::new(rd),
        wr,
        buf: Vec::new(),
        idle: crate::DEFAULT_IDLE_TIMEOUT,
        last_sent: Instant::now(),
    }
}

/// A session of `lanes` lanes over `datasets` on control connection `stream`, without data
/// connections; `failed` stands for its senders' failures.
fn session_on(
    stream: TcpStream,
    datasets: Datasets,
    lanes: usize,
    failed: Arc<ConnFailed>,
) -> Session {
    let conns = DataConns {
        senders: Vec::new(),
        lane_of: Vec::new(),
    };
    let ctl = control(stream);
    Session::new(
        SESSION,
        ctl,
        shared(datasets),
        conns,
        lanes,
        failed,
        Arc::default(),
    )
}

/// The shared state of a source without a secret (loopback peers only) that serves
/// `datasets` with one session slot.
fn shared(datasets: Datasets) -> Arc<Shared> {
    shared_with(datasets, crate::DEFAULT_IDLE_TIMEOUT)
}

/// [`shared`] with idle timeout `idle` (a data connect's limit is half of it).
fn shared_with(datasets: Datasets, idle: Duration) -> Arc<Shared> {
    let stats = Stats::of(&datasets);
    let cfg = SourceConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        secret: None,
        rate_limit: 0,
        fault_corrupt: 0,
        fault_wrong_lane: 0,
        devmem_tx: Arc::default(),
        idle_timeout: idle,
        max_connections: 1,
        drain_timeout: crate::DEFAULT_DRAIN_TIMEOUT,
    };
    Arc::new(Shared {
        datasets,
        cfg,
        corrupt_left: AtomicU32::new(0),
        wrong_lane_left: AtomicU32::new(0),
        sessions: AtomicU64::new(SESSION),
        draining: tokio::sync::watch::Sender::new(false),
        session_reads: Arc::default(),
        noise: crate::noise::Noise::default(),
        stats,
    })
}

/// The next message the node reads (within 10 s), past the source's keepalives.
async fn reply(node: &mut TcpStream, buf: &mut Vec<u8>) -> Message {
    loop {
        let read = read_message(node, buf, wire::MAX_FRAME);
        let m = tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("an answer within 10 s")
            .expect("a message (not a closed connection)");
        if m != Message::Ping {
            return m;
        }
    }
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
    r.cache_writes_done().await; // while it is written, it is held in memory
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

/// A payload in memory counts in the source's budget until sent, even where its FETCH started
/// on a shard held in the cache (counted in its session's budget only): the entry went, and
/// the shard was read again into memory. Before, those bytes escaped the source's budget.
#[test]
fn a_payload_in_memory_counts_source_wide_wherever_its_shard_was_held() {
    let source: Arc<AtomicU64> = Arc::default();
    let q = queues(1, &source);
    let cached = Counted {
        bytes: SHARD,
        source: false,
    };
    q.reads.count(cached);
    assert_eq!(
        source.load(Ordering::Acquire),
        0,
        "a cache file holds no memory"
    );
    let held = q.reads.held(q.reads.in_memory(cached));
    assert_eq!(
        source.load(Ordering::Acquire),
        SHARD,
        "held in memory until sent"
    );
    drop(held); // sent
    assert_eq!(source.load(Ordering::Acquire), 0);
    assert_eq!(q.reads.bytes.load(Ordering::Acquire), 0);
}

/// A finished read into memory counts source-wide from when the dispatch finds it finished,
/// though no data connection has room to send it, where its FETCH began on a shard held in
/// the cache (counted in its session's budget only; the entry then went and the shard was
/// read again). Before, it counted source-wide only once sent: every session could hold up
/// to its own budget of such payloads outside the source's.
#[tokio::test(flavor = "current_thread")]
async fn a_read_found_finished_in_memory_counts_source_wide_while_it_waits_for_a_connection() {
    let dir = Scratch::new("settled");
    let r = remote(&datasets(&dir, 2, false).await);
    let source: Arc<AtomicU64> = Arc::default();
    let reads = Reads::new(&source);
    // As started on a cached shard (`Reads::start`), then read from the store.
    let held = Counted {
        bytes: SHARD,
        source: false,
    };
    reads.count(held);
    let mut w = r.want(SESSION, 1);
    w.leave_queue();
    let mut q = Queued {
        head: head(1, 1),
        payload: Payload::read(w, SESSION, Arc::default()),
        held,
        seq: 0,
    };
    let t0 = Instant::now();
    while !q.payload.settled() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not read after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(source.load(Ordering::Acquire), 0, "not yet looked at");
    // No data connection of its lane has room: it stays, with its bytes.
    assert!(matches!(look(&mut q, true, &reads), Look::Pass));
    assert!(matches!(q.payload, Payload::Ready(Body::Memory(_))));
    assert_eq!(
        source.load(Ordering::Acquire),
        SHARD,
        "held in memory: counted source-wide"
    );
    assert!(q.held.source);
    // Its send counts it once, and gives it back once sent.
    drop(reads.held(reads.in_memory(q.held)));
    assert_eq!(source.load(Ordering::Acquire), 0);
    assert_eq!(reads.bytes.load(Ordering::Acquire), 0);
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
    r.cache_writes_done().await; // its cache write goes on in the background
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
    // dataset's (its bytes in the file are rechecked, and pass); another code.
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

/// The open file of shard `shard` of the `local` dataset of `s`, and what the source opened.
fn local_shard(s: &Session, shard: usize) -> (Arc<std::fs::File>, Arc<Opened>) {
    match &s.shared.datasets.get("local").expect("served").backend {
        Backend::Local { files, opened, .. } => {
            (Arc::clone(&files[shard]), Arc::clone(&opened[shard]))
        }
        Backend::Remote(_) => panic!("`local` is served from a directory"),
    }
}

/// The checks of a local dataset's files are grouped by the file system each is on, found
/// when the source starts (`stat`): a dead mount holds a few blocking threads, however many of
/// its files the nodes ask for. Before, they were grouped by file.
#[tokio::test(flavor = "current_thread")]
async fn local_shard_files_are_checked_by_their_file_system() {
    use std::os::unix::fs::MetadataExt;
    let dir = Scratch::new("stat-dev");
    let (s, _node) = session(datasets(&dir, 2, false).await, 1).await;
    let (file, opened) = local_shard(&s, 1);
    let dev = file.metadata().unwrap().dev();
    assert_eq!(s.shared.stats.device_of(&opened), Some(dev));
    // A scratch folder on a disk or memory file system is checked without a thread hop.
    let f_type = rustix::fs::fstatfs(&*file).unwrap().f_type;
    let expect =
        [0xEF53, 0x5846_5342, 0x9123_683E, 0x0102_1994, 0x794C_7630].contains(&(f_type as i64));
    assert!(
        !expect || s.shared.stats.checked_inline(&opened),
        "{f_type:#x}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_local_shard_reported_corrupt_that_fails_its_crc_in_its_file_is_refused() {
    use std::os::unix::fs::FileExt;
    let dir = Scratch::new("rot-local");
    let (mut s, mut node) = session(datasets(&dir, 2, false).await, 1).await;
    // Shard 1 rewritten in place (a bad disk, a tool that keeps the time): the same size,
    // its modification time put back.
    let path = dir.0.join("data").join("d.bin");
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let mtime = f.metadata().unwrap().modified().unwrap();
    f.write_all_at(&[0xA5; SHARD as usize], SHARD).unwrap();
    f.set_modified(mtime).unwrap();
    let fetch = |req, shard| Message::Fetch {
        req,
        dataset: "local".into(),
        shard,
        lane: 0,
    };
    s.handle(fetch(1, 1)).await.expect("queued");
    assert_eq!(s.queues.queued, 1, "its size and time are as opened");
    // It was sent, and the node reports that it failed its CRC check.
    s.announced.record(1, Arc::from("local"), 1);
    let report = Message::Error {
        req: 1,
        code: ErrorCode::ChecksumMismatch,
        retry_after_ms: 0,
        message: "shard 1: crc32c mismatch".into(),
    };
    s.handle(report).await.expect("the session goes on");
    // The shard's bytes are read again on a blocking thread.
    let (file, opened) = local_shard(&s, 1);
    let t0 = Instant::now();
    while opened.check(&file, SHARD..2 * SHARD).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not rechecked in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Before, it was served again at every FETCH, until the node gave up on the shard.
    s.handle(fetch(2, 1))
        .await
        .expect("refused; the session goes on");
    assert_eq!(s.queues.queued, 1, "not queued");
    // `ReadFailed`: the node fetches it from another source. Before, `DatasetChanged`, which
    // ended the node's stream though another source had a good copy.
    match reply(&mut node, &mut Vec::new()).await {
        Message::Error {
            req: 2,
            code: ErrorCode::ReadFailed,
            message,
            ..
        } => {
            let says = [
                "d.bin",
                "4096..8192",
                "CRC-32C",
                "good copy",
                "another source",
                "shardwire index",
            ];
            for says in says {
                assert!(message.contains(says), "{says}: {message}");
            }
        }
        other => panic!("{other:?}"),
    }
    s.handle(fetch(3, 0)).await.expect("queued");
    assert_eq!(s.queues.queued, 2, "the file's other shard is served");
}

/// Right before its announcement too (`send_out`), a shard found bad in its file, or a file
/// that cannot be examined, is refused as a read failure (fetched from another source), a
/// changed file as `DatasetChanged`.
#[test]
fn a_shard_found_bad_is_a_read_failure_and_a_changed_file_a_changed_dataset() {
    let corrupt = ShardChanged::Corrupt {
        name: "d.bin".into(),
        start: 0,
        end: SHARD,
        want: 1,
        found: 2,
    };
    let (code, message) = shard_refusal(&corrupt);
    assert_eq!(code, ErrorCode::ReadFailed, "{message}");
    for says in [
        "d.bin",
        "0..4096",
        "0x00000001",
        "0x00000002",
        "another source",
    ] {
        assert!(message.contains(says), "{says}: {message}");
    }
    let modified = ShardChanged::Modified {
        name: "d.bin".into(),
    };
    let (code, message) = shard_refusal(&modified);
    assert_eq!(code, ErrorCode::DatasetChanged, "{message}");
    assert!(message.contains("shardwire index"), "{message}");
    let shorter = ShardChanged::Shorter {
        name: "d.bin".into(),
        len: 1,
        need: SHARD,
        had: SHARD,
    };
    assert_eq!(shard_refusal(&shorter).0, ErrorCode::DatasetChanged);
    // Before: `DatasetChanged`, so an EIO from `fstat` on a network file system ended the
    // node's stream; a read error says nothing of the data.
    let stat = ShardChanged::Stat {
        name: "d.bin".into(),
        source: std::io::Error::from_raw_os_error(5),
    };
    let (code, message) = shard_refusal(&stat);
    assert_eq!(code, ErrorCode::ReadFailed, "{message}");
    for says in ["d.bin", "cannot stat", "file system"] {
        assert!(message.contains(says), "{says}: {message}");
    }
    assert!(!message.contains("shardwire index"), "{message}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_reply_slower_to_write_than_the_idle_timeout_is_not_the_nodes_silence() {
    let dir = Scratch::new("slow-manifest");
    let d = datasets(&dir, 2000, false).await;
    let len = d.get("local").expect("served").manifest_json.len();
    assert!(
        len > 128 << 10,
        "a manifest of {len} bytes fits the buffers"
    );
    let (stream, mut node) = connected_small().await;
    let mut s = session_on(stream, d, 1, Arc::default());
    let idle = Duration::from_millis(500);
    s.ctl.idle = idle;
    let serve = tokio::spawn(s.serve());
    let ask = |req, dataset: &str| Message::ManifestRequest {
        req,
        dataset: dataset.into(),
    };
    let mut buf = Vec::new();
    write_message(&mut node, &ask(1, "local")).await.unwrap();
    // The node reads nothing for three idle timeouts: the manifest's write takes as long.
    tokio::time::sleep(3 * idle).await;
    let manifest = reply(&mut node, &mut buf).await;
    assert!(matches!(manifest, Message::Manifest { req: 1, .. }));
    // Then it speaks at once. Before, the session took the write's time for the node's
    // silence and ended as soon as the write was done.
    write_message(&mut node, &Message::Ping).await.unwrap();
    write_message(&mut node, &ask(2, "nope")).await.unwrap();
    match reply(&mut node, &mut buf).await {
        Message::Error {
            req: 2,
            code: ErrorCode::UnknownDataset,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    assert!(!serve.is_finished(), "the session goes on");
    serve.abort();
}

#[tokio::test(flavor = "current_thread")]
async fn the_node_is_told_which_data_connection_failed_and_why() {
    let dir = Scratch::new("data-failed");
    let (stream, mut node) = connected().await;
    let failed = Arc::new(ConnFailed::default());
    let s = session_on(
        stream,
        datasets(&dir, 1, false).await,
        1,
        Arc::clone(&failed),
    );
    let serve = tokio::spawn(s.serve());
    failed.fail(3, "Connection reset by peer (os error 104)".into());
    let ended = tokio::time::timeout(Duration::from_secs(10), serve).await;
    let e = ended
        .expect("ends")
        .expect("no panic")
        .expect_err("the session ends");
    assert!(
        matches!(&e, SessionError::DataFailed { conn: 3, why } if why.contains("reset")),
        "{e}"
    );
    match reply(&mut node, &mut Vec::new()).await {
        Message::Error {
            req: 0,
            code: ErrorCode::Internal,
            message,
            ..
        } => {
            // Before: "a data connection failed; closing the session".
            assert!(message.contains("data connection 3"), "{message}");
            assert!(message.contains("reset by peer"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// A node's `Hello`, with one lane of one flow.
fn hello() -> Message {
    Message::Hello {
        node_id: "test-node".into(),
        nonce: [0; NONCE_LEN],
        lanes: vec![LaneAddr {
            data_addr: "127.0.0.1:9".parse().unwrap(),
            flows: 1,
        }],
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_node_whose_data_address_the_source_cannot_reach_is_told_why() {
    let dir = Scratch::new("dial-failed");
    let (stream, mut node) = connected().await;
    let shared = shared(datasets(&dir, 1, false).await);
    // A loopback port nothing listens on: the source's connect to it is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let handshakes = Arc::new(crate::admit::Handshakes::default());
    let slot = handshakes.enter(peer.ip()).unwrap();
    let slots = Arc::new(Semaphore::new(1));
    let source = tokio::spawn(run(stream, peer, shared, slot, slots));
    let hello = Message::Hello {
        node_id: "test-node".into(),
        nonce: [0; NONCE_LEN],
        lanes: vec![LaneAddr {
            data_addr: closed,
            flows: 1,
        }],
    };
    let mut buf = Vec::new();
    write_message(&mut node, &hello).await.unwrap();
    let challenge = reply(&mut node, &mut buf).await;
    assert!(
        matches!(challenge, Message::Challenge { .. }),
        "{challenge:?}"
    );
    let auth = Message::Auth { mac: [0; 32] };
    write_message(&mut node, &auth).await.unwrap();
    let welcome = reply(&mut node, &mut buf).await;
    assert!(matches!(welcome, Message::Welcome { .. }), "{welcome:?}");
    // Before, the control connection closed without a word: the reason was in the source's
    // log only.
    match reply(&mut node, &mut buf).await {
        Message::Error {
            req: 0,
            code: ErrorCode::Internal,
            message,
            ..
        } => {
            assert!(message.contains("cannot open data connection"), "{message}");
            assert!(message.contains(&closed.to_string()), "{message}");
            assert!(message.contains("firewall"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let ended = tokio::time::timeout(Duration::from_secs(10), source).await;
    let e = ended
        .expect("ends")
        .unwrap()
        .expect_err("the session fails");
    assert!(
        matches!(&e, SessionError::DataConnect { addr, .. } if *addr == closed),
        "{e}"
    );
}

/// A failure before `Welcome` is one any peer that reaches the port can cause (logged at most
/// once per peer and cause, `crate::noise`); one after it is a node's (logged every time).
/// Before, the two were one `SessionError`, logged alike once per connection.
#[tokio::test(flavor = "current_thread")]
async fn a_failure_is_a_strangers_before_welcome_and_a_nodes_after() {
    let dir = Scratch::new("failed-stage");
    let shared = shared(datasets(&dir, 1, false).await);
    let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let handshakes = Arc::new(crate::admit::Handshakes::default());
    let serve = |stream| {
        let slot = handshakes.enter(peer.ip()).unwrap();
        let slots = Arc::new(Semaphore::new(1));
        let shared = Arc::clone(&shared);
        tokio::spawn(serve_connection(stream, peer, shared, slot, slots))
    };
    // A first frame that is no `Hello`.
    let (stream, mut node) = connected().await;
    let source = serve(stream);
    write_message(&mut node, &Message::Ping).await.unwrap();
    let f = source.await.unwrap().expect_err("no Hello");
    assert!(!f.welcomed, "{f:?}");
    assert!(matches!(f.error, SessionError::Unexpected { .. }), "{f:?}");
    // Welcomed, then its only data address cannot be dialled.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (stream, mut node) = connected().await;
    let source = serve(stream);
    let hello = Message::Hello {
        node_id: "test-node".into(),
        nonce: [0; NONCE_LEN],
        lanes: vec![LaneAddr {
            data_addr: closed,
            flows: 1,
        }],
    };
    greet(&mut node, &mut Vec::new(), &hello).await;
    let ended = tokio::time::timeout(Duration::from_secs(10), source).await;
    let f = ended.expect("ends").unwrap().expect_err("fails");
    assert!(f.welcomed, "{f:?}");
    assert!(matches!(f.error, SessionError::DataConnect { .. }), "{f:?}");
}

/// Hello, Challenge, Auth, Welcome as a node without a secret, over `node`.
async fn greet(node: &mut TcpStream, buf: &mut Vec<u8>, hello: &Message) {
    write_message(node, hello).await.unwrap();
    let challenge = reply(node, buf).await;
    assert!(
        matches!(challenge, Message::Challenge { .. }),
        "{challenge:?}"
    );
    write_message(node, &Message::Auth { mac: [0; 32] })
        .await
        .unwrap();
    let welcome = reply(node, buf).await;
    assert!(matches!(welcome, Message::Welcome { .. }), "{welcome:?}");
}

#[test]
fn a_lane_is_undialled_when_it_has_connections_and_none_was_dialled() {
    // Lane 0: both dialled; lane 1: one of two; lane 2: none of two; lane 3: no connections.
    let senders = [Some(()), Some(()), Some(()), None, None, None];
    let lane_of = [0, 0, 1, 1, 2, 2];
    assert_eq!(
        undialled_lanes(4, &senders, &lane_of),
        [false, false, true, false]
    );
}

/// One unreachable lane stopped every session: its connect failed, the source ended the
/// session, and no lane of the node got data from it. Now the lane is left out: the node is
/// told which one and why, the other lane's data flows, and a FETCH for the lane left out is
/// refused (to be fetched from another source).
#[tokio::test(flavor = "current_thread")]
async fn a_lane_the_source_cannot_reach_is_left_out_and_the_others_are_served() {
    let dir = Scratch::new("lane-left-out");
    let (stream, mut node) = connected().await;
    let shared = shared(datasets(&dir, 1, false).await);
    // Lane 0: a loopback port nothing listens on (refused); lane 1: a data listener.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let handshakes = Arc::new(crate::admit::Handshakes::default());
    let slot = handshakes.enter(peer.ip()).unwrap();
    let source = tokio::spawn(run(stream, peer, shared, slot, Arc::new(Semaphore::new(1))));
    let lanes = vec![
        LaneAddr {
            data_addr: closed,
            flows: 2,
        },
        LaneAddr {
            data_addr: data.local_addr().unwrap(),
            flows: 1,
        },
    ];
    let hello = Message::Hello {
        node_id: "test-node".into(),
        nonce: [0; NONCE_LEN],
        lanes,
    };
    let mut buf = Vec::new();
    greet(&mut node, &mut buf, &hello).await;
    // Lane 1 is dialled at the same time as lane 0: its connection comes before or after
    // lane 0's messages, which are its Error and then both its connections not dialled (the
    // second is not tried).
    let mut told = Vec::new();
    let mut announced = None;
    while told.len() < 3 || announced.is_none() {
        match reply(&mut node, &mut buf).await {
            Message::DataConn {
                lane: 1,
                conn: 2,
                addr,
            } if addr != wire::NOT_DIALLED => announced = Some(addr),
            m => told.push(m),
        }
    }
    match &told[0] {
        Message::Error {
            req: 0,
            code: ErrorCode::Internal,
            message,
            ..
        } => {
            assert!(message.contains("lane 0"), "{message}");
            assert!(message.contains(&closed.to_string()), "{message}");
            assert!(message.contains("leaves the lane out"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    for conn in 0..2 {
        let want = Message::DataConn {
            lane: 0,
            conn,
            addr: wire::NOT_DIALLED,
        };
        assert_eq!(told[1 + usize::from(conn)], want);
    }
    let announced = announced.expect("lane 1's connection");
    let (mut conn, from) = data.accept().await.unwrap();
    assert_eq!(from, announced);
    write_message(&mut node, &Message::DataReady { conn: 2 })
        .await
        .unwrap();
    let fetch = |req, lane| Message::Fetch {
        req,
        dataset: "local".into(),
        shard: 0,
        lane,
    };
    write_message(&mut node, &fetch(1, 1)).await.unwrap();
    match reply(&mut node, &mut buf).await {
        Message::Shard {
            req: 1,
            shard: 0,
            length: SHARD,
            conn: 2,
            seq: 0,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    let mut payload = vec![0u8; SHARD as usize];
    let read = tokio::io::AsyncReadExt::read_exact(&mut conn, &mut payload);
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the payload within 10 s")
        .unwrap();
    assert_eq!(payload, shard_bytes(0), "lane 1's data flows");
    write_message(&mut node, &fetch(2, 0)).await.unwrap();
    match reply(&mut node, &mut buf).await {
        Message::Error {
            req: 2,
            code: ErrorCode::Internal,
            message,
            ..
        } => assert!(message.contains("lane 0"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(!source.is_finished(), "the session goes on");
    source.abort();
}

/// A loopback address whose connects time out: a listener that accepts nothing, its queue
/// filled (the kernel drops further SYNs). Returns it, and what must stay open meanwhile.
async fn black_hole() -> (SocketAddr, (TcpListener, Vec<TcpStream>)) {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = sock.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut held = Vec::new();
    loop {
        let connect = TcpStream::connect(addr);
        match tokio::time::timeout(Duration::from_millis(200), connect).await {
            Ok(Ok(s)) => held.push(s),
            Ok(Err(e)) => panic!("connect to the listener: {e}"),
            Err(_) => break, // the queue is full
        }
        assert!(held.len() < 16, "the kernel keeps queueing connections");
    }
    (addr, (listener, held))
}

/// The lanes were dialled one after another: each lane whose connect timed out cost a connect
/// limit (10 s at the default idle timeout) before the next was tried, so 6 such lanes spent
/// the whole DIAL_DEADLINE and the session ended although other lanes answered. Now the lanes
/// are dialled at once: 8 that time out cost one limit together, the lane that answers gets
/// both its connections, and the node is told of each lane left out.
#[tokio::test(flavor = "current_thread")]
async fn lanes_that_time_out_cost_one_connect_limit_together() {
    let dir = Scratch::new("lanes-time-out");
    // A connect limit of half the idle timeout: 500 ms.
    let shared = shared_with(datasets(&dir, 1, false).await, Duration::from_secs(1));
    let limit = Duration::from_millis(500);
    let (dropped, _held) = black_hole().await;
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let out = LaneAddr {
        data_addr: dropped,
        flows: 1,
    };
    let mut lanes = vec![out; 8];
    lanes.push(LaneAddr {
        data_addr: data.local_addr().unwrap(),
        flows: 2,
    });
    let (stream, mut node) = connected().await;
    let mut ctl = control(stream);
    let (failed, progress) = (Arc::default(), Arc::new(Notify::new()));
    let t = std::time::Instant::now();
    let conns = dial(&mut ctl, &shared, &lanes, &failed, &progress)
        .await
        .expect("lane 8 is dialled");
    let took = t.elapsed();
    assert!(took >= limit, "the 8 lanes' connects timed out: {took:?}");
    assert!(
        took < 3 * limit,
        "one limit, not 8 one after another: {took:?}"
    );
    let dialled: Vec<bool> = conns.senders.iter().map(Option::is_some).collect();
    let want: Vec<bool> = (0..10).map(|conn| conn >= 8).collect();
    assert_eq!(dialled, want, "lane 8's two connections only");
    assert_eq!(conns.lane_of, [0, 1, 2, 3, 4, 5, 6, 7, 8, 8]);
    // Each lane left out: its Error, and its connection not dialled right after it.
    let mut buf = Vec::new();
    let mut left_out = Vec::new();
    let mut announced = 0;
    while left_out.len() < 8 || announced < 2 {
        match reply(&mut node, &mut buf).await {
            Message::Error {
                req: 0, message, ..
            } => {
                let lane: u16 = message
                    .strip_prefix("lane ")
                    .and_then(|m| m.split(':').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("names its lane: {message}"));
                assert!(message.contains(&dropped.to_string()), "{message}");
                let next = reply(&mut node, &mut buf).await;
                let want = Message::DataConn {
                    lane,
                    conn: lane,
                    addr: wire::NOT_DIALLED,
                };
                assert_eq!(next, want, "after {message}");
                left_out.push(lane);
            }
            Message::DataConn { lane: 8, conn, .. } if conn == 8 || conn == 9 => announced += 1,
            other => panic!("{other:?}"),
        }
    }
    left_out.sort_unstable();
    assert_eq!(left_out, [0, 1, 2, 3, 4, 5, 6, 7]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_node_that_finishes_its_handshake_while_the_source_drains_is_told_so() {
    let dir = Scratch::new("drain-handshake");
    let (stream, mut node) = connected().await;
    let shared = shared(datasets(&dir, 1, false).await);
    shared.draining.send_replace(true);
    let slots = Arc::new(Semaphore::new(1));
    let mut ctl = control(stream);
    let source = handshake(&mut ctl, &shared, Arc::clone(&slots));
    let node_side = async {
        let mut buf = Vec::new();
        write_message(&mut node, &hello()).await.unwrap();
        let small = wire::MAX_SMALL_FRAME;
        let challenge = read_message(&mut node, &mut buf, small).await.unwrap();
        assert!(
            matches!(challenge, Message::Challenge { .. }),
            "{challenge:?}"
        );
        let auth = Message::Auth { mac: [0; 32] };
        write_message(&mut node, &auth).await.unwrap();
        read_message(&mut node, &mut buf, small).await.unwrap()
    };
    let (done, answer) = tokio::join!(source, node_side);
    match done {
        Err(SessionError::Draining) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("welcomed while the source drains"),
    }
    // Before: `Internal`, "serves 1 node sessions already" (with its slot free: Welcome).
    match answer {
        Message::Error {
            code: ErrorCode::Draining,
            message,
            ..
        } => assert!(message.contains("draining"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(slots.available_permits(), 1, "no session slot taken");
}

#[tokio::test(flavor = "current_thread")]
async fn a_peer_off_loopback_of_a_source_without_a_secret_is_told_why() {
    let dir = Scratch::new("not-loopback");
    let (stream, mut node) = connected().await;
    let shared = shared(datasets(&dir, 1, false).await);
    // As the listener saw the peer.
    let peer: SocketAddr = "10.1.2.3:40000".parse().unwrap();
    let handshakes = Arc::new(crate::admit::Handshakes::default());
    let slot = handshakes.enter(peer.ip()).unwrap();
    let slots = Arc::new(Semaphore::new(1));
    let source = tokio::spawn(run(stream, peer, shared, slot, slots));
    let mut buf = Vec::new();
    let read = read_message(&mut node, &mut buf, wire::MAX_SMALL_FRAME);
    // Before, the connection closed without a word.
    let answer = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("within 10 s")
        .expect("told why");
    // The refusal lingers until the node closes; before, it held the handshake slot meanwhile.
    let held = handshakes.under_way();
    drop(node);
    match answer {
        Message::Error {
            code: ErrorCode::AuthFailed,
            message,
            ..
        } => {
            assert!(message.contains("10.1.2.3"), "{message}");
            assert!(message.contains("--secret-file"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        held, 0,
        "the handshake slot is given back before the refusal"
    );
    let e = source.await.unwrap().expect_err("refused");
    assert!(
        matches!(e, SessionError::NotLoopback(p) if p == peer),
        "{e}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_peer_off_loopback_is_refused_before_it_takes_a_handshake_slot() {
    use crate::admit::{Handshakes, MAX_REFUSING};
    let dir = Scratch::new("not-loopback-gate");
    let (stream, mut node) = connected().await;
    let shared = shared(datasets(&dir, 1, false).await);
    let peer: SocketAddr = "10.1.2.3:40000".parse().unwrap();
    let handshakes = Arc::new(Handshakes::default());
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let slots = Arc::new(Semaphore::new(1));
    crate::admit_connection(&shared, stream, peer, (&handshakes, &refusing), &slots);
    // Before, it took a handshake slot and held it while its refusal lingered (about 1 s),
    // outside the cap on refusals: a flood of such peers held all 64.
    assert_eq!(handshakes.under_way(), 0, "no handshake slot taken");
    let told = refusing.available_permits();
    assert_eq!(told, MAX_REFUSING - 1, "counted among the refusals told");
    let mut buf = Vec::new();
    let read = read_message(&mut node, &mut buf, wire::MAX_SMALL_FRAME);
    let answer = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("within 10 s")
        .expect("told why");
    drop(node);
    match answer {
        Message::Error {
            code: ErrorCode::AuthFailed,
            message,
            ..
        } => {
            assert!(message.contains("10.1.2.3"), "{message}");
            assert!(message.contains("--secret-file"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Once the peer has gone, the refusal ends and gives its permit back.
    let all = refusing.acquire_many(MAX_REFUSING as u32);
    let all = tokio::time::timeout(Duration::from_secs(10), all).await;
    assert!(all.is_ok(), "the refusal's permit is given back");
}

#[tokio::test(flavor = "current_thread")]
async fn an_evicted_handshake_is_told_why() {
    use crate::admit::{EVICT_AFTER, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_IP};
    let dir = Scratch::new("evicted");
    let (stream, mut node) = connected().await;
    let shared = shared(datasets(&dir, 1, false).await);
    let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let handshakes = Arc::new(crate::admit::Handshakes::default());
    // The node's handshake is the oldest; it sends nothing.
    let slot = handshakes.enter(peer.ip()).unwrap();
    let slots = Arc::new(Semaphore::new(1));
    let source = tokio::spawn(run(stream, peer, shared, slot, slots));
    // Every other handshake slot is taken.
    let others: Vec<_> = (1..MAX_HANDSHAKES)
        .map(|i| {
            let ip = IpAddr::from([10, 0, (i / MAX_HANDSHAKES_PER_IP) as u8, 1]);
            handshakes.enter(ip).unwrap()
        })
        .collect();
    tokio::time::sleep(EVICT_AFTER + Duration::from_millis(50)).await;
    let newcomer = handshakes
        .enter("10.9.9.9".parse().unwrap())
        .expect("a slot, by eviction");
    let mut buf = Vec::new();
    let read = read_message(&mut node, &mut buf, wire::MAX_SMALL_FRAME);
    // Before, the connection closed without a word.
    let answer = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("within 10 s")
        .expect("told why");
    drop(node);
    match answer {
        Message::Error { message, .. } => assert!(message.contains("evicted"), "{message}"),
        other => panic!("{other:?}"),
    }
    let e = source.await.unwrap().expect_err("evicted");
    assert!(matches!(e, SessionError::Evicted), "{e}");
    drop((others, newcomer));
}
