//! A stream fed by hand: delivery in plan order, leases, release and close.

use std::sync::atomic::AtomicU64;

use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry};
use shardwire_protocol::plan::Uneven;

use super::*;
use crate::fetch::tests::pool;
use crate::fetch::{Completions, FetchRequest, InFlight};
use crate::stream::supply::{Issue, IssueError, Pending, Supply};

fn manifest(shards: u32, len: u64) -> Arc<Manifest> {
    Arc::new(Manifest::new(
        (0..shards)
            .map(|i| ShardEntry {
                file: format!("s{i}.bin"),
                offset: 0,
                length: len,
                crc32c: 0,
                tensors: vec![TensorEntry::dense(
                    "x".into(),
                    DType::Uint8,
                    vec![len],
                    0,
                    len,
                )],
            })
            .collect(),
    ))
}

/// A shard-mode stream of `shards` shards (2 epochs) from position `start`.
pub(super) fn stream(shards: u32, start: u64) -> Arc<Stream> {
    stream_in(shards, start, 1 << 20, &[])
}

/// A shard-mode stream of `shards` shards of 4096 bytes (2 epochs) from position 0, in a
/// region of `region` bytes, its dataset `d` (version `v1`) served by live sources at
/// `addrs` (their links never connect: the hints sent are seen in the stream's supply).
pub(super) fn served_stream(shards: u32, region: usize, addrs: &[&str]) -> Arc<Stream> {
    stream_in(shards, 0, region, addrs)
}

/// [`stream`] in a region of `region` bytes, served by `addrs` ([`served_stream`]; none: no
/// source and no routing, for streams fed by hand).
fn stream_in(shards: u32, start: u64, region: usize, addrs: &[&str]) -> Arc<Stream> {
    let m = manifest(shards, 4096);
    let spec = PlanSpec {
        digest: m.digest_bytes(),
        shards,
        seed: 1,
        rank: 0,
        world_size: 1,
        uneven: Uneven::Pad,
    };
    let fingerprint = spec.fingerprint();
    let (sources, routing) = if addrs.is_empty() {
        (Vec::new(), crate::stream::route::tests::routing())
    } else {
        let v = crate::stream::route::Version {
            dataset: "d",
            digest: "v1",
        };
        let source = DatasetSource {
            dataset: "d".into(),
            first: 0,
            shards,
            digest: "v1".into(),
        };
        (vec![source], crate::stream::route::tests::serving(addrs, v))
    };
    Stream::new(Parts {
        id: 9,
        dataset: "d".into(),
        kind: super::kind::Kind::Shards(super::order::Order::new(spec)),
        epochs: 2,
        start,
        manifest: m,
        pool: pool(region),
        sources,
        routing,
        fingerprint,
        counters: Arc::new(Counters::default()),
        ids: Arc::new(AtomicU64::new(0)),
        gpu: None,
        lane: 0,
    })
}

use shardwire_protocol::plan::PlanSpec;

/// Completes position `pos` with a slab filled with `pos`.
fn arrive(s: &Stream, pos: u64) {
    let mut slab = s.pool.alloc(4096).unwrap();
    slab.host_slice_mut().unwrap().fill(pos as u8);
    s.complete(
        pos,
        Ready {
            slab,
            tensors: None,
        },
    );
}

fn batch(n: Next) -> Batch {
    match n {
        Next::Batch(b) => b,
        other => panic!("expected a batch, got {other:?}"),
    }
}

#[test]
fn batches_come_in_plan_order_whatever_order_shards_arrive_in() {
    let s = stream(3, 0);
    arrive(&s, 1);
    assert!(matches!(
        s.next(Some(Duration::from_millis(20))),
        Next::Timeout
    ));
    arrive(&s, 0);
    let b0 = batch(s.next(Some(Duration::ZERO)));
    let b1 = batch(s.next(Some(Duration::ZERO)));
    assert_eq!((b0.epoch, b0.index, b1.index), (0, 0, 1));
    let super::kind::Kind::Shards(order) = &s.kind else {
        unreachable!()
    };
    assert_eq!(b0.shard, order.shard_at(0));
    assert_eq!(
        s.read_leased(b1.lease, b1.tensors[0].offset, 4).unwrap(),
        vec![1; 4]
    );
    assert_eq!(s.state().index, 2);
    assert_eq!(s.info().leased, 2);
}

#[test]
fn batches_added_to_an_answer_keep_the_leases_within_a_quarter_of_the_region() {
    // A region of 8 slabs of 4096 bytes: a quarter holds 2 of them.
    let s = stream_in(4, 0, 8 * 4096, &[]);
    for pos in 0..4 {
        arrive(&s, pos);
    }
    let first = batch(s.next(None));
    let second = s.next_within_room().expect("two slabs take a quarter");
    assert_eq!(second.index, 1);
    // Before: the room was checked before each batch was added, without its slab: with two
    // leased (8192 bytes, a quarter) a third was added, 3/8 of the region.
    assert!(
        s.next_within_room().is_none(),
        "a third slab is past the quarter"
    );
    assert_eq!(s.info().leased, 2);
    assert_eq!(s.ready_count(), 2, "left ready for the next answer");
    // A release makes room for the next one.
    assert!(s.release(first.lease));
    assert_eq!(s.next_within_room().map(|b| b.index), Some(2));
    assert!(!leases_fit(4096, 4097, 32768));
    assert!(leases_fit(4096, 4096, 32768));
}

#[test]
fn releasing_frees_the_memory_and_unknown_leases_are_refused() {
    let s = stream(3, 0);
    arrive(&s, 0);
    let b = batch(s.next(None));
    assert!(s.pool.used() > 0);
    assert!(!s.release(b.lease + 100));
    assert!(s.release(b.lease));
    assert!(!s.release(b.lease), "a lease ends once");
    assert_eq!(s.pool.used(), 0);
    assert!(s.read_leased(b.lease, 0, 1).is_none());
}

#[test]
fn closing_drops_leases_and_ready_batches_and_wakes_the_trainer() {
    let s = stream(3, 0);
    arrive(&s, 0);
    arrive(&s, 1);
    let leased = batch(s.next(None));
    assert_eq!(s.closed_reason(), None);
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            s.next(None); // takes 1
            let _ = tx.send(s.next(None)); // waits for 2 until the close
        });
    }
    // Batch 1 taken: the thread is on its way into the second wait (a close that came first
    // would be seen without waiting, and the test would show less).
    let t0 = std::time::Instant::now();
    while s.ready_count() > 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    s.close(CloseReason::TrainerDisconnected);
    // A close that failed to wake the waiter fails here instead of hanging the test binary.
    let woke = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the close woke the waiting trainer");
    assert!(matches!(
        woke,
        Next::Closed(CloseReason::TrainerDisconnected)
    ));
    assert_eq!(s.pool.used(), 0, "every lease and ready slab went back");
    assert!(s.take_lease(leased.lease).is_none());
    assert_eq!(
        s.closed_reason(),
        Some(CloseReason::TrainerDisconnected),
        "a release after the close is told why"
    );
    arrive(&s, 2); // a fetch that lands after the close is dropped
    assert_eq!(s.pool.used(), 0);
}

#[test]
fn after_a_close_the_stream_allocates_nothing_so_a_leased_block_is_not_reused() {
    let s = stream(3, 0);
    arrive(&s, 0);
    let leased = batch(s.next(None));
    assert!(s.read_leased(leased.lease, 0, 1).is_some());
    s.close(CloseReason::TrainerDisconnected);
    // Before: the stream's task, still in its loop, got the lease's block back at once
    // and fetched into it while the trainer could still read its last batch there.
    assert!(s.supply().try_alloc(4096).is_none());
    assert_eq!(s.pool.used(), 0);
}

#[test]
fn a_resumed_stream_starts_at_its_position_and_ends() {
    let s = stream(3, 5);
    arrive(&s, 4); // before the resume point: not delivered
    arrive(&s, 5);
    let b = batch(s.next(None));
    assert_eq!((b.epoch, b.index), (1, 2));
    assert!(matches!(s.next(None), Next::End));
}

#[test]
fn the_state_after_a_batch_is_the_state_once_it_is_taken() {
    let s = stream(3, 0);
    for pos in 0..6 {
        arrive(&s, pos);
        let b = batch(s.next(None));
        assert_eq!(
            s.state_after(b.epoch, b.index),
            s.state(),
            "after position {pos}"
        );
        assert!(s.release(b.lease));
    }
    assert!(matches!(s.next(None), Next::End));
    assert_eq!(
        (s.state().epoch, s.state().index),
        (2, 0),
        "the end of 2 epochs"
    );
}

/// Worker 3 of 4 of a rank of 10 batches delivers positions 3 and 7; after the last its next
/// slot is position 11, past the stream's 10.
#[test]
fn a_finished_workers_delivered_count_stays_within_the_total() {
    let m = Arc::new(Manifest::new(vec![ShardEntry {
        file: "s0.bin".into(),
        offset: 0,
        length: 40,
        crc32c: 0,
        tensors: vec![TensorEntry::dense(
            "x".into(),
            DType::Uint8,
            vec![10, 4],
            0,
            40,
        )],
    }]));
    let mut r = shardwire_protocol::trainer::StreamRequest::new("d");
    (r.batch_size, r.epochs) = (Some(1), 1);
    (r.worker, r.num_workers) = (3, 4);
    let (kind, _, fingerprint) = super::open::batch_mode(&m, &r, 1, 1 << 20, false).unwrap();
    // Resumed after position 7 (its last batch): nothing is left to deliver.
    let s = Stream::new(Parts {
        id: 9,
        dataset: "d".into(),
        kind,
        epochs: 1,
        start: 8,
        manifest: m,
        pool: pool(1 << 20),
        sources: Vec::new(),
        routing: crate::stream::route::tests::routing(),
        fingerprint,
        counters: Arc::new(Counters::default()),
        ids: Arc::new(AtomicU64::new(0)),
        gpu: None,
        lane: 0,
    });
    assert!(matches!(s.next(Some(Duration::ZERO)), Next::End));
    let info = s.info();
    assert_eq!(info.total, 10);
    // Before: 11, its next slot's position.
    assert_eq!(info.delivered, 10);
}

/// A fetch the driver issued, with the source it asked to avoid.
pub(super) type Issued = (InFlight, Option<usize>);

/// A source that takes every fetch and lets the test answer it.
#[derive(Clone, Default)]
pub(super) struct Fake {
    issued: Arc<Mutex<Vec<Issued>>>,
}

impl Issue for Fake {
    fn issue(&mut self, s: &Supply, p: Pending, done: &Completions) -> Result<(), IssueError> {
        let entry = &s.manifest().shards[p.shard as usize];
        let r = FetchRequest {
            slab: p.slab,
            pos: p.pos,
            shard: p.shard,
            length: entry.length,
            crc32c: entry.crc32c,
            stream: 1,
            lane: 0,
        };
        let f = InFlight::new(r, 0, done.clone());
        self.issued.lock().unwrap().push((f, p.avoid));
        Ok(())
    }
}

impl Fake {
    /// Takes what was issued, newest first.
    pub(super) fn take(&self) -> Vec<Issued> {
        let mut v = std::mem::take(&mut *self.issued.lock().unwrap());
        v.reverse();
        v
    }
}
