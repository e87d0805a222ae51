//! The batch-mode driver over a fake [`Issue`]: fetches are answered by the test (in any
//! order, or with failures) instead of a source, so what the driver asks for, what it
//! assembles and how it reacts to failures are checked without sockets.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use shardwire_protocol::manifest::{DType, Manifest, ShardEntry, TensorEntry};
use shardwire_protocol::samples::BlockKeys;
use shardwire_protocol::trainer::{ErrorCode, StreamRequest};
use shardwire_protocol::wire;

use super::*;
use crate::counters::Counters;
use crate::fetch::tests::pool;
use crate::fetch::{FetchFailure, InFlight};
use crate::stream::tests::{Fake, Issued};
use crate::stream::{Next, Parts, open};

const SHARDS: u32 = 6;
const ROWS: u64 = 8;
const ROW: u64 = 4;
const BATCH: u32 = 4;

/// Row `r` of shard `s`: `[s, r, 0xab, 0xcd]`.
fn shard_bytes(s: u32) -> Vec<u8> {
    (0..ROWS)
        .flat_map(|r| [s as u8, r as u8, 0xab, 0xcd])
        .collect()
}

fn manifest() -> Arc<Manifest> {
    manifest_of(SHARDS, |_| ROWS, shard_bytes)
}

/// `shards` shards of one uint8 tensor of rows of [`ROW`] bytes: shard `i` holds `rows(i)`
/// rows, its bytes `bytes(i)`.
fn manifest_of(
    shards: u32,
    rows: impl Fn(u32) -> u64,
    bytes: impl Fn(u32) -> Vec<u8>,
) -> Arc<Manifest> {
    Arc::new(Manifest::new(
        (0..shards)
            .map(|i| ShardEntry {
                file: format!("s{i}.bin"),
                offset: 0,
                length: rows(i) * ROW,
                crc32c: crc(&bytes(i)),
                tensors: vec![TensorEntry::dense(
                    "x".into(),
                    DType::Uint8,
                    vec![rows(i), ROW],
                    0,
                    rows(i) * ROW,
                )],
            })
            .collect(),
    ))
}

fn crc(b: &[u8]) -> u32 {
    let mut c = shardwire_protocol::crc::Crc32c::new();
    c.update(b);
    c.finish()
}

/// A batch-mode stream over [`manifest`] in a region of `region` bytes.
fn stream(region: usize) -> Arc<Stream> {
    stream_with(region, |_| {})
}

/// [`stream`] with the request changed by `change`.
fn stream_with(region: usize, change: impl FnOnce(&mut StreamRequest)) -> Arc<Stream> {
    stream_checked_for(region, region, change)
}

/// [`stream_with`] in a region of `region` bytes opened as if it had `checked` (the open
/// check's view: an epoch it did not foresee needs more than it counted).
fn stream_checked_for(
    checked: usize,
    region: usize,
    change: impl FnOnce(&mut StreamRequest),
) -> Arc<Stream> {
    stream_of(manifest(), &request(change), checked, region)
}

/// The request of [`stream`] changed by `change`.
fn request(change: impl FnOnce(&mut StreamRequest)) -> StreamRequest {
    let mut r = StreamRequest::new("d");
    r.batch_size = Some(BATCH);
    r.seed = 3;
    r.epochs = 2;
    change(&mut r);
    r
}

/// The batch-mode stream `r` asks for over `m` (from where its state says, if any), opened as
/// if its region had `checked` bytes, in a region of `region`.
fn stream_of(m: Arc<Manifest>, r: &StreamRequest, checked: usize, region: usize) -> Arc<Stream> {
    stream_served_by(
        m,
        r,
        (checked, region),
        crate::stream::route::tests::routing(),
    )
}

/// The stream `r` asks for over [`manifest`] in a region of `region` bytes, its dataset `d`
/// (version `v1`) served by live sources at `addrs` (their links never connect: the hints
/// sent are seen in the stream's supply).
fn served_stream(r: &StreamRequest, region: usize, addrs: &[&str]) -> Arc<Stream> {
    let v = crate::stream::route::Version {
        dataset: "d",
        digest: "v1",
    };
    let routing = crate::stream::route::tests::serving(addrs, v);
    stream_served_by(manifest(), r, (region, region), routing)
}

/// [`stream_of`] over `routing`, opened as if its region had `checked` bytes.
fn stream_served_by(
    m: Arc<Manifest>,
    r: &StreamRequest,
    (checked, region): (usize, usize),
    routing: Arc<crate::stream::Routing>,
) -> Arc<Stream> {
    let shards = m.shards.len() as u32;
    let (kind, start, fingerprint) =
        open::batch_mode(&m, r, r.batch_size.unwrap_or(BATCH), checked as u64, false)
            .expect("a valid plan");
    Stream::new(Parts {
        id: 1,
        dataset: "d".into(),
        kind,
        epochs: r.epochs,
        start,
        manifest: m,
        pool: pool(region),
        sources: vec![crate::stream::DatasetSource {
            dataset: "d".into(),
            first: 0,
            shards,
            digest: "v1".into(),
        }],
        routing,
        fingerprint,
        counters: Arc::new(Counters::default()),
        ids: Arc::new(AtomicU64::new(0)),
        gpu: None,
        lane: 0,
    })
}

/// A stream over a `region`-byte region, its fake issuer and its task, settled (its first
/// fetches issued).
fn driver(region: usize) -> (Arc<Stream>, Fake, Driver) {
    let s = stream(region);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    (s, fake, d)
}

/// One of the fetches issued, and the others, which stay in flight while the caller holds
/// them (dropped, they would come back abandoned and be fetched again).
fn one_fetch(fake: &Fake) -> (InFlight, Vec<Issued>) {
    let mut issued = fake.take();
    let (f, _) = issued.pop().expect("a fetch was issued");
    (f, issued)
}

/// Fills the fetch's slab with its shard and ends it verified.
fn answer(mut f: InFlight) {
    let bytes = shard_bytes(f.shard);
    f.slab_mut()
        .host_slice_mut()
        .unwrap()
        .copy_from_slice(&bytes);
    f.verified(crc(&bytes));
}

/// Hands every outcome that arrived to the driver, then steps it until it assembles no more.
fn settle(d: &mut Driver) -> Result<(), CloseReason> {
    while let Some(c) = d.fetches.try_completed() {
        d.completed(c)?;
    }
    while d.step()? {}
    Ok(())
}

/// The rows (as `(shard, row)`) of the batch `b` of stream `s`.
fn rows_of(s: &Stream, b: &crate::stream::Batch) -> Vec<(u8, u8)> {
    let t = &b.tensors[0];
    let bytes = s.read_leased(b.lease, t.offset, t.length).unwrap();
    bytes
        .chunks(ROW as usize)
        .map(|r| {
            assert_eq!(&r[2..], &[0xab, 0xcd], "a row of a shard, whole");
            (r[0], r[1])
        })
        .collect()
}

/// The rows the plan puts in each batch of the stream, in order.
fn planned(s: &Stream) -> Vec<Vec<(u8, u8)>> {
    let Kind::Batches(m) = s.kind() else {
        unreachable!()
    };
    let Sampler::One(plan) = &m.sampler else {
        unreachable!()
    };
    (0..s.epochs())
        .flat_map(|e| {
            let ep = plan.order.epoch(e);
            (0..plan.steps())
                .map(|step| {
                    (0..plan.batch_size)
                        .map(|j| {
                            let r = plan.sample(&ep, step, j);
                            (r.shard as u8, r.row as u8)
                        })
                        .collect()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Where the task of stream `s` starts: its first undelivered position.
fn start_of(s: &Stream) -> u64 {
    let st = s.state();
    s.position(st.epoch, st.index)
}

/// Runs a task of stream `s` from where it starts, answering every fetch, until the trainer
/// took `limit` batches or the stream ended; the rows of each batch taken. `check` sees the
/// task after each settle.
fn take_batches(s: &Arc<Stream>, limit: usize, check: impl FnMut(&Driver)) -> Vec<Vec<(u8, u8)>> {
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(s), start_of(s), Box::new(fake.clone()));
    take_with(s, &fake, &mut d, limit, check)
}

/// [`take_batches`] with the task `d` issuing through `fake`.
fn take_with(
    s: &Arc<Stream>,
    fake: &Fake,
    d: &mut Driver,
    limit: usize,
    mut check: impl FnMut(&Driver),
) -> Vec<Vec<(u8, u8)>> {
    let mut got = Vec::new();
    for _ in 0..10_000 {
        settle(d).unwrap();
        check(d);
        for (f, _) in fake.take() {
            answer(f);
        }
        settle(d).unwrap();
        check(d);
        if got.len() == limit || take_one(s, &mut got) {
            return got;
        }
    }
    panic!("the stream did not end");
}

/// Takes the next batch if one is ready (its rows into `got`, its lease released); whether
/// the stream ended.
fn take_one(s: &Arc<Stream>, got: &mut Vec<Vec<(u8, u8)>>) -> bool {
    match s.next(Some(Duration::ZERO)) {
        Next::Batch(b) => {
            got.push(rows_of(s, &b));
            assert!(s.release(b.lease));
            false
        }
        Next::End => true,
        Next::Timeout => false,
        Next::Closed(why) => panic!("closed: {why}"),
    }
}

/// Runs the driver to the end, answering fetches with `answer_all`, and returns the rows of
/// every batch the trainer took.
fn drive(
    s: &Arc<Stream>,
    fake: &Fake,
    mut answer_all: impl FnMut(Vec<Issued>),
) -> Vec<Vec<(u8, u8)>> {
    let mut d = Driver::new(Arc::clone(s), 0, Box::new(fake.clone()));
    let mut got = Vec::new();
    for _ in 0..10_000 {
        settle(&mut d).unwrap();
        answer_all(fake.take());
        settle(&mut d).unwrap();
        if take_one(s, &mut got) {
            return got;
        }
    }
    panic!("the stream did not end");
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_hold_the_planned_rows_whatever_order_shards_arrive_in() {
    let s = stream(1 << 20);
    let fake = Fake::default();
    // Newest first: every round's fetches complete in reverse order of issue.
    let got = drive(&s, &fake, |issued| {
        for (f, _) in issued {
            answer(f);
        }
    });
    let want = planned(&s);
    assert_eq!(
        got.len(),
        2 * (SHARDS as usize * ROWS as usize) / BATCH as usize
    );
    assert_eq!(got, want);
    let c = s.supply().counters();
    assert_eq!(
        c.batches_assembled.load(Ordering::Relaxed),
        got.len() as u64
    );
    assert_eq!(c.refetches.load(Ordering::Relaxed), 0);
    assert_eq!(s.supply().pool().used(), 0, "every slab went back");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crc_failure_is_fetched_again_avoiding_the_source_and_never_delivered() {
    let s = stream(1 << 20);
    let fake = Fake::default();
    let mut failed = None;
    let mut retried = Vec::new();
    let got = drive(&s, &fake, |issued| {
        for (mut f, avoid) in issued {
            if avoid.is_some() {
                retried.push((f.shard, avoid));
            }
            if failed.is_none() {
                failed = Some(f.shard);
                f.slab_mut().host_slice_mut().unwrap().fill(0xee); // damaged bytes
                f.verified(0);
            } else {
                answer(f);
            }
        }
    });
    assert_eq!(got, planned(&s), "the damaged bytes were never assembled");
    assert_eq!(retried, vec![(failed.unwrap(), Some(0))]);
    let c = s.supply().counters();
    assert_eq!(c.refetches.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_shard_ends_the_stream_with_the_reason() {
    let (s, fake, mut d) = driver(1 << 20);
    let (f, issued) = one_fetch(&fake);
    let shard = f.shard;
    refuse(
        f,
        wire::ErrorCode::UnknownShard,
        &format!("no shard {shard}"),
    );
    let why = settle(&mut d).unwrap_err();
    assert!(
        matches!(&why, CloseReason::ShardFailed { shard: s, .. } if *s == shard),
        "{why:?}"
    );
    assert_eq!(why.code(), ErrorCode::DataUnavailable);
    s.close(why); // what the task does with it
    match s.next(Some(Duration::ZERO)) {
        Next::Closed(r) => {
            let text = r.to_string();
            assert!(
                text.contains(&format!("shard {shard} of dataset d")),
                "{text}"
            );
            assert!(text.contains(&format!("no shard {shard}")), "{text}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.supply().counters().refetches.load(Ordering::Relaxed), 0);
    drop(issued);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_fetch_of_a_shard_no_unit_holds_any_more_is_not_fetched_again() {
    let (s, fake, mut d) = driver(1 << 20);
    let (f, issued) = one_fetch(&fake);
    let shard = f.shard;
    // The unit that held it was passed while the fetch was in flight.
    d.resident.remove(&shard);
    refuse(f, wire::ErrorCode::ReadFailed, "the store failed");
    settle(&mut d).unwrap();
    let again: Vec<u32> = fake.take().iter().map(|(f, _)| f.shard).collect();
    assert!(!again.contains(&shard), "{again:?}");
    assert_eq!(s.supply().counters().refetches.load(Ordering::Relaxed), 0);
    drop(issued);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fetch_its_source_paused_waits_alone_and_those_behind_it_go() {
    let s = stream(1 << 20);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    let mut issued = fake.take();
    issued.reverse(); // in order of issue
    assert!(issued.len() >= 2, "{} fetches", issued.len());
    let mut it = issued.into_iter();
    let (paused, _) = it.next().unwrap();
    let (lost, _) = it.next().unwrap();
    let (paused_shard, lost_shard) = (paused.shard, lost.shard);
    // A source asks for a pause of 46 days (the wire's u32 allows 49): at most a minute is kept.
    paused.finish(Err(FetchFailure::Refused {
        code: wire::ErrorCode::Throttled,
        retry_after_ms: 4_000_000_000,
        message: "SlowDown".into(),
    }));
    lost.finish(Err(FetchFailure::LinkDown {
        source_addr: "a:1".into(),
        reason: "reset".into(),
    }));
    settle(&mut d).unwrap();
    let again: Vec<u32> = fake.take().iter().map(|(f, _)| f.shard).collect();
    assert_eq!(
        again,
        vec![lost_shard],
        "the fetch behind the paused one went at once"
    );
    assert!(d.fetches.has_waiting(), "the paused one waits");
    let wait = d
        .fetches
        .next_due()
        .expect("a pause")
        .saturating_duration_since(Instant::now());
    assert!(
        wait <= crate::fetch::MAX_RETRY_AFTER && wait > Duration::from_secs(50),
        "{wait:?} for shard {paused_shard}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dataloader_worker_lets_go_of_units_that_end_before_its_next_batch() {
    // Worker 0 of 2: it assembles the rank's batches 0, 2, 4, ...
    let s = stream_with(1 << 20, |r| {
        r.num_workers = 2;
        r.worker = 0;
    });
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    let b = u64::from(BATCH);
    let mut batches = 0;
    for _ in 0..1000 {
        settle(&mut d).unwrap();
        for (f, _) in fake.take() {
            answer(f);
        }
        settle(&mut d).unwrap();
        // Nothing this worker will never read again is held.
        let next_first = d.pos * b;
        for l in &d.live {
            assert!(
                l.last >= next_first,
                "a unit ending at sample {} is held with the next batch at {next_first}",
                l.last
            );
        }
        assert_refs_match_live(&d);
        match s.next(Some(Duration::ZERO)) {
            Next::Batch(batch) => {
                batches += 1;
                assert!(s.release(batch.lease));
            }
            Next::End => break,
            Next::Timeout => {}
            Next::Closed(why) => panic!("closed: {why}"),
        }
    }
    // Half of 2 epochs of 12 batches.
    assert_eq!(batches, 12);
}

/// Runs stream `s` to its end with a trainer that holds each batch until it has the next
/// (the open check counts that slab and the ready-ahead ones beside the window); the number
/// of batches, or why the stream closed.
fn run_holding(s: &Arc<Stream>) -> Result<usize, String> {
    run_holding_with(s, shard_bytes)
}

/// [`run_holding`] over shards whose bytes `bytes` gives.
fn run_holding_with(s: &Arc<Stream>, bytes: impl Fn(u32) -> Vec<u8>) -> Result<usize, String> {
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(s), 0, Box::new(fake.clone()));
    let (mut held, mut batches) = (None, 0);
    for _ in 0..10_000 {
        settle(&mut d).map_err(|why| format!("closed after {batches} batches: {why}"))?;
        for (mut f, _) in fake.take() {
            let b = bytes(f.shard);
            f.slab_mut().host_slice_mut().unwrap().copy_from_slice(&b);
            f.verified(crc(&b));
        }
        settle(&mut d).map_err(|why| format!("closed after {batches} batches: {why}"))?;
        match s.next(Some(Duration::ZERO)) {
            Next::Batch(b) => {
                batches += 1;
                if let Some(old) = held.replace(b.lease) {
                    assert!(s.release(old));
                }
            }
            Next::End => return Ok(batches),
            Next::Timeout => {}
            Next::Closed(why) => return Err(format!("closed: {why}")),
        }
    }
    Err(format!(
        "did not end: {batches} batches, pos {}, live {:?}, resident {:?}, pool used {} of {}, waiting {}",
        d.pos,
        d.live
            .iter()
            .map(|l| (l.first, l.last, l.shards.clone()))
            .collect::<Vec<_>>(),
        d.resident
            .iter()
            .map(|(k, r)| (*k, r.refs, r.slab.is_some()))
            .collect::<Vec<_>>(),
        s.supply().pool().used(),
        s.supply().pool().capacity(),
        d.fetches.has_waiting(),
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_least_region_an_open_accepts_runs_batches_across_unit_edges() {
    use shardwire_protocol::trainer::Shuffle as S;
    // (shuffle, shuffle_block, batch_size, drop_last): shards of 8 rows, 48 samples an epoch.
    let cases = [
        (S::Block, 16, 4, true),
        (S::Block, 16, 6, true),
        (S::Block, 16, 6, false),
        (S::Block, 12, 8, true),
        (S::Block, 16, 20, true),
        (S::Shards, 0, 6, true),
        (S::Shards, 0, 20, false),
        (S::None, 0, 6, true),
        (S::None, 0, 20, true),
    ];
    let mut failed = Vec::new();
    for (shuffle, block, batch, drop_last) in cases {
        let change = |r: &mut StreamRequest| {
            r.batch_size = Some(batch);
            r.shuffle = Some(shuffle);
            r.shuffle_block = (block > 0).then_some(block);
            r.drop_last = drop_last;
        };
        let m = manifest();
        let mut req = StreamRequest::new("d");
        req.seed = 3;
        req.epochs = 2;
        change(&mut req);
        let accepts = |region: u64| open::batch_mode(&m, &req, batch, region, false).is_ok();
        let least = (1u64..=1 << 12)
            .map(|k| k * 1024)
            .find(|&r| accepts(r))
            .expect("some region fits");
        let s = stream_with(least as usize, change);
        let steps = if drop_last {
            48 / batch
        } else {
            48u32.div_ceil(batch)
        };
        match run_holding(&s) {
            Ok(n) if n == 2 * steps as usize => {}
            other => failed.push(format!(
                "{shuffle:?} block {block} batch {batch} drop_last {drop_last}, {least} bytes: {other:?}"
            )),
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_shards_and_slabs_cannot_fit_closes_the_stream_instead_of_waiting() {
    // Batches of 20 read 3 or 4 shards of 8 rows; the region holds 4 slabs, one of them the
    // batch the trainer keeps until it has the next.
    let s = stream_checked_for(1 << 20, 4 * 4096, |r| {
        r.batch_size = Some(20);
        r.shuffle = Some(shardwire_protocol::trainer::Shuffle::None);
        r.drop_last = true;
    });
    let why = run_holding(&s).expect_err("cannot fit");
    assert!(why.starts_with("closed after 1 batches"), "{why}");
    assert!(why.contains("raise stream_memory"), "{why}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workers_state_past_the_last_epoch_names_the_end_and_resumes_to_it() {
    // 48 samples in batches of 16: 3 steps an epoch, 2 epochs, 8 workers. Worker 5 reads
    // position 5 only; its next slot would be position 13, epoch 4.
    let change = |r: &mut StreamRequest| {
        r.batch_size = Some(16);
        r.num_workers = 8;
        r.worker = 5;
        r.drop_last = true;
    };
    let s = stream_with(1 << 20, change);
    let st = s.state_after(1, 2);
    assert_eq!(
        (st.epoch, st.index),
        (2, 2),
        "the end: the last index after the last epoch"
    );
    let mut r = StreamRequest::new("d");
    r.seed = 3;
    r.epochs = 2;
    change(&mut r);
    r.state = Some(st);
    let (_, start, _) = open::batch_mode(&manifest(), &r, 16, 1 << 20, false).expect("resumes");
    assert!(start >= 6, "at the end: nothing more to deliver ({start})");
}

/// A state saved before the fingerprint named the block keys resumes (its fingerprint
/// matches) and continues the order it was saved from: the old keys', not the new.
#[tokio::test(flavor = "multi_thread")]
async fn a_state_saved_before_block_keys_resumes_its_own_order() {
    let s = stream(1 << 20);
    let mut st = s.state_after(0, 3);
    assert!(
        st.fingerprint.ends_with(";block_keys=global"),
        "{}",
        st.fingerprint
    );
    st.fingerprint = st.fingerprint.replace(";block_keys=global", "");
    let mut r = StreamRequest::new("d");
    (r.batch_size, r.seed, r.epochs, r.state) = (Some(BATCH), 3, 2, Some(st.clone()));
    let (kind, _, fingerprint) =
        open::batch_mode(&manifest(), &r, BATCH, 1 << 20, false).expect("the old state resumes");
    assert_eq!(
        fingerprint, st.fingerprint,
        "the resumed stream keeps the old fingerprint"
    );
    let Kind::Batches(m) = &kind else {
        unreachable!()
    };
    let Sampler::One(plan) = &m.sampler else {
        unreachable!()
    };
    assert_eq!(plan.order.block_keys, BlockKeys::Legacy);
    // A state that names them resumes with them.
    r.state = Some(s.state_after(0, 3));
    let (kind, _, _) = open::batch_mode(&manifest(), &r, BATCH, 1 << 20, false).unwrap();
    let Kind::Batches(m) = &kind else {
        unreachable!()
    };
    let Sampler::One(plan) = &m.sampler else {
        unreachable!()
    };
    assert_eq!(plan.order.block_keys, BlockKeys::Global);
}

/// Every resident shard is held by exactly the live units that name it, and every live
/// unit's shards are resident.
fn assert_refs_match_live(d: &Driver) {
    for (shard, r) in &d.resident {
        let n = d.live.iter().filter(|l| l.shards.contains(shard)).count();
        assert_eq!(r.refs as usize, n, "shard {shard}: refs against live units");
    }
    for l in &d.live {
        for shard in &l.shards {
            assert!(
                d.resident.contains_key(shard),
                "shard {shard} of a live unit"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_half_held_unit_the_rank_passed_gives_its_shards_back() {
    // Blocks of two shards: three units an epoch.
    let s = stream_with(1 << 20, |r| r.shuffle_block = Some(2 * ROWS));
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    d.load_epoch(0);
    let units = d.epochs[0].units.clone();
    let multi = units
        .iter()
        .position(|u| u.shards.len() >= 2)
        .expect("a unit of several shards");
    assert!(multi + 1 < units.len(), "a unit after it");
    // The units before it are past; memory ran out after its first shard (what `hold`
    // leaves behind)...
    d.epochs[0].next = multi;
    let first = units[multi].shards[0];
    d.resident.insert(
        first,
        Resident {
            slab: None,
            refs: 1,
        },
    );
    d.epochs[0].held = 1;
    // ...and the rank has since passed its last sample (another worker's batches read it).
    d.pos = units[multi].last / u64::from(BATCH) + 1;
    d.issue_units().unwrap();
    assert!(d.epochs[0].next > multi + 1, "the next units were issued");
    assert!(!d.live.is_empty());
    assert_refs_match_live(&d);
}

#[test]
fn shard_indexes_hash_apart_and_spread_over_buckets() {
    use std::hash::BuildHasher;
    let b = BuildHasherDefault::<ShardHasher>::default();
    let hashes: Vec<u64> = (0..100_000u32).map(|i| b.hash_one(i)).collect();
    let distinct: std::collections::HashSet<_> = hashes.iter().collect();
    assert_eq!(distinct.len(), hashes.len(), "one multiply is a bijection");
    // The top 7 bits (hashbrown's control byte) take every value over dense indexes.
    let tops: std::collections::HashSet<_> = hashes.iter().map(|h| h >> 57).collect();
    assert_eq!(tops.len(), 128);
    let mut m = ShardMap::default();
    for i in 0..1000u32 {
        m.insert(i * 3, i);
    }
    assert!((0..1000u32).all(|i| m[&(i * 3)] == i) && !m.contains_key(&1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shard_refused_again_and_again_is_asked_again_later_each_time_then_ends_the_stream() {
    // Before, a refusal that may pass (a read that failed at the source) was asked again at
    // once, without end: a store that refuses a shard for good cost a FETCH per round trip.
    let s = stream(1 << 20);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    let (mut f, _) = fake.take().pop().expect("a fetch was issued");
    let shard = f.shard;
    let mut pauses = Vec::new();
    let why = loop {
        refuse(
            f,
            wire::ErrorCode::ReadFailed,
            &format!("GET of shard {shard}: 400"),
        );
        if let Err(why) = settle(&mut d) {
            break why;
        }
        let due = d.fetches.next_due().expect("it waits");
        pauses.push(due.saturating_duration_since(Instant::now()));
        f = issued_again(&mut d, &fake, shard); // as the task's timer would, later
    };
    use crate::stream::error::{MAX_REFUSALS, refusal_backoff};
    assert_eq!(pauses.len() as u32, MAX_REFUSALS - 1);
    // Each pause is the backoff of its attempt, less the moments between the two clocks.
    for (n, p) in (1..).zip(&pauses) {
        let want = refusal_backoff(n);
        assert!(
            *p <= want && *p + Duration::from_secs(1) >= want,
            "{n}: {pauses:?}"
        );
    }
    assert!(
        refusal_backoff(2) > refusal_backoff(1) && refusal_backoff(30) == Duration::from_secs(10)
    );
    assert!(
        matches!(&why, CloseReason::ShardFailed { shard: s, .. } if *s == shard),
        "{why:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_stays_unavailable_is_waited_out_with_backoff() {
    let s = stream(1 << 20);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    let (mut f, _) = fake.take().pop().expect("a fetch was issued");
    let shard = f.shard;
    for _ in 0..2 * crate::stream::error::MAX_REFUSALS {
        refuse(f, wire::ErrorCode::StorageUnavailable, "503 after retries");
        settle(&mut d).expect("an outage does not end the stream");
        let due = d.fetches.next_due().expect("it waits");
        assert!(due > Instant::now(), "asked again later, not at once");
        f = issued_again(&mut d, &fake, shard);
    }
    // A read that fails after all those is the first that counts: asked again, not closed.
    refuse(f, wire::ErrorCode::ReadFailed, "GET: connection reset");
    settle(&mut d).expect("one failed read does not end the stream");
    answer(issued_again(&mut d, &fake, shard));
    settle(&mut d).unwrap();
}

/// A shard whose fetch breaks its link every time was fetched again at once, without end:
/// the second and later go again after a growing pause (the stream waits for the sources, it
/// does not close: an outage may be long).
#[tokio::test(flavor = "multi_thread")]
async fn a_shard_whose_fetch_keeps_losing_its_link_is_asked_again_later_each_time() {
    let s = stream(1 << 20);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    let (mut f, _) = fake.take().pop().expect("a fetch was issued");
    let shard = f.shard;
    let mut pauses = Vec::new();
    for _ in 0..5 {
        f.finish(Err(FetchFailure::LinkDown {
            source_addr: "src:1".into(),
            reason: "protocol violation".into(),
        }));
        settle(&mut d).expect("a lost link does not end the stream");
        let due = d.fetches.next_due();
        pauses.push(due.map(|t| t.saturating_duration_since(Instant::now())));
        f = issued_again(&mut d, &fake, shard);
    }
    use crate::stream::error::refusal_backoff;
    assert_eq!(pauses[0], None, "the first goes again at once");
    for (n, p) in (1..).zip(&pauses[1..]) {
        let (p, want) = (p.expect("waits"), refusal_backoff(n));
        assert!(
            p <= want && p + Duration::from_secs(1) >= want,
            "{n}: {pauses:?}"
        );
    }
    answer(f);
    settle(&mut d).unwrap();
}

/// The fetch of `shard` issued again once every waiting fetch is made due.
fn issued_again(d: &mut Driver, fake: &Fake, shard: u32) -> InFlight {
    d.fetches.make_due();
    loop {
        settle(d).unwrap();
        if let Some((g, _)) = fake.take().into_iter().find(|(g, _)| g.shard == shard) {
            return g;
        }
    }
}

/// Ends fetch `f` with the source's refusal `code` (no `retry_after`) saying `message`.
fn refuse(f: InFlight, code: wire::ErrorCode, message: &str) {
    f.finish(Err(FetchFailure::Refused {
        code,
        retry_after_ms: 0,
        message: message.into(),
    }));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_region_fragmented_by_prefetched_shards_gives_them_back_instead_of_waiting_forever() {
    // Shards of 2.8 and 6 KiB (4 and 8 KiB slabs) and batches of 6000 bytes (8 KiB slabs) in
    // 96 KiB: prefetch is counted in free bytes, and the 4 KiB shard slabs came to split
    // every 8 KiB block while no batch was ready and the trainer held none. The stream waited
    // forever after 33 batches; then it gave the prefetched shards back and went on; now its
    // batch slabs have a part of the region of their own.
    // 24 shards of 700 and 1500 rows in turn, every byte of shard `i` equal to `i`.
    let rows = |i: u32| if i.is_multiple_of(2) { 700 } else { 1500 };
    let m = manifest_of(24, rows, |i| vec![i as u8; (rows(i) * ROW) as usize]);
    let mut r = StreamRequest::new("d");
    (r.batch_size, r.seed, r.epochs, r.shuffle_block) = (Some(1500), 1, 3, Some(2048));
    let region = 96 << 10;
    let s = stream_of(m, &r, region, region);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut idle = 0;
    while idle < 50 {
        settle(&mut d).unwrap();
        for (mut f, _) in fake.take() {
            let bytes = vec![f.shard as u8; f.slab().len()];
            f.slab_mut()
                .host_slice_mut()
                .unwrap()
                .copy_from_slice(&bytes);
            f.verified(crc(&bytes));
        }
        settle(&mut d).unwrap();
        match s.next(Some(Duration::ZERO)) {
            Next::Batch(b) => {
                let t = &b.tensors[0];
                let bytes = s.read_leased(b.lease, t.offset, t.length).unwrap();
                got.push(bytes.chunks(4).map(|row| row[0]).collect());
                assert!(s.release(b.lease));
                idle = 0;
            }
            Next::End => break,
            Next::Timeout => idle += 1,
            Next::Closed(why) => panic!("closed: {why}"),
        }
    }
    let pool = s.supply().pool();
    let Kind::Batches(bm) = s.kind() else {
        unreachable!()
    };
    let Sampler::One(plan) = &bm.sampler else {
        unreachable!()
    };
    assert!(
        idle < 50,
        "stuck after {} batches: {} of {} bytes used, none ready",
        got.len(),
        pool.used(),
        pool.capacity()
    );
    let want: Vec<Vec<u8>> = (0..3u32)
        .flat_map(|e| {
            let ep = plan.order.epoch(e);
            (0..plan.steps())
                .map(|step| {
                    (0..1500)
                        .map(|j| plan.sample(&ep, step, j).shard as u8)
                        .collect()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        got == want,
        "every batch holds its planned samples' shards, once"
    );
    let given_back = s
        .supply()
        .counters()
        .prefetch_given_back
        .load(Ordering::Relaxed);
    // Batch slabs now have a part of the region of their own: the shards no longer split
    // their blocks, and nothing prefetched had to go back.
    assert_eq!(given_back, 0, "the batches' part is theirs alone");
}

/// The slab bytes a `DoesNotFit` close names ("... shards (N bytes of slabs) ...").
fn slab_bytes_of(closed: &str) -> Option<u64> {
    let (_, rest) = closed.split_once(" shards (")?;
    rest.split_once(" bytes of slabs)")?.0.parse().ok()
}

/// Random datasets of mixed shard sizes in the least region their open accepts, read by a
/// trainer that holds each batch until it has the next: every stream ends, or closes naming
/// the memory a later epoch's batch needs (the open check measures the first epoch's). The
/// slab pool is a buddy allocator and the open check counts bytes: shards held for the next
/// batch, and the batch the trainer held, could leave no free block of a needed shard's class
/// while nothing was in flight and no batch ready; 31 of these 120 streams waited forever.
#[tokio::test(flavor = "multi_thread")]
async fn mixed_shard_sizes_in_the_least_region_never_wedge() {
    use shardwire_protocol::trainer::Shuffle as S;
    let mut rng = 0x5eed_u64;
    let mut next = |n: u64| {
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    };
    let (mut failed, mut ended, mut repacked) = (Vec::new(), 0, 0);
    for case in 0..120 {
        let shards = 5 + next(12) as u32;
        let sizes: Vec<u64> = (0..shards).map(|_| 64 * (1 + next(400))).collect();
        let rows = |i: u32| sizes[i as usize];
        let bytes = |i: u32| {
            (0..rows(i))
                .flat_map(|r| [i as u8, r as u8, 0xab, 0xcd])
                .collect()
        };
        let m = manifest_of(shards, rows, bytes);
        let mut req = StreamRequest::new("d");
        req.seed = next(1000);
        req.epochs = 2;
        let batch = [256, 1024, 4096][next(3) as usize];
        req.batch_size = Some(batch);
        req.shuffle = Some([S::None, S::Shards, S::Block][next(3) as usize]);
        req.drop_last = true;
        let accepts = |region: u64| open::batch_mode(&m, &req, batch, region, false).is_ok();
        let Some(least) = (1u64..=1 << 12).map(|k| k * 4096).find(|&r| accepts(r)) else {
            continue;
        };
        let s = stream_of(Arc::clone(&m), &req, least as usize, least as usize);
        let outcome = run_holding_with(&s, bytes);
        repacked += s
            .supply()
            .counters()
            .shards_repacked
            .load(Ordering::Relaxed);
        if outcome.as_ref().is_ok_and(|&n| n > 0) {
            ended += 1;
        }
        // A close must be one the shards' bytes force: the old rule (the region less the 3
        // batch slabs the open check counts) would have closed there too.
        let class = SlabPool::class_size(batch as usize * ROW as usize) as u64;
        if let Err(e) = outcome
            && slab_bytes_of(&e).is_none_or(|need| need + 3 * class <= least)
        {
            failed.push(format!(
                "case {case}: rows {sizes:?}, batch {batch}, {:?}, {least} bytes: {e}",
                req.shuffle
            ));
        }
    }
    assert!(failed.is_empty(), "{} wedged: {failed:#?}", failed.len());
    assert!(ended >= 100, "only {ended} of 120 streams ran to their end");
    assert!(
        repacked > 0,
        "no stream repacked: the cases no longer wedge the old way"
    );
}

/// Worker 0 of 5, with 2 steps an epoch, reads positions 0, 5 and 10: epochs 0, 2 and 5. Its
/// task loaded at most two epochs past the last one, so after position 5 it loaded epoch 3,
/// skipped all of it and issued nothing for epoch 5 until a later wake: no read-ahead, and a
/// task left with no fetch out and no batch to take slept for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_whose_next_batch_is_epochs_ahead_fetches_its_shards_at_once() {
    let s = stream_with(1 << 20, |r| {
        (r.batch_size, r.epochs) = (Some(24), 6);
        (r.worker, r.num_workers) = (0, 5);
    });
    let Kind::Batches(m) = s.kind() else {
        unreachable!()
    };
    assert_eq!(m.steps(), 2);
    let got = take_batches(&s, usize::MAX, |d| {
        if d.pos >= d.end {
            return;
        }
        let (epoch, _) = s.kind().split(d.pos);
        assert!(
            d.epochs.iter().any(|e| e.epoch == epoch),
            "position {}: epoch {epoch} is not loaded",
            d.pos
        );
        assert!(
            d.to_hold_for_next_batch().is_empty(),
            "position {}: shards of its batch are not fetched",
            d.pos
        );
    });
    let want: Vec<_> = planned(&s).into_iter().step_by(5).collect();
    assert_eq!(want.len(), 3);
    assert_eq!(got, want);
}

/// Prefetched shards given back because no block fit the next batch were held, and fetched,
/// again at the next step, then given back again: one FETCH each per round trip while the
/// trainer kept its batches. Now nothing is held ahead until that batch is assembled.
#[tokio::test(flavor = "multi_thread")]
async fn prefetched_shards_given_back_are_not_fetched_again_before_the_next_batch() {
    let s = stream_with(1 << 20, |r| r.shuffle_block = Some(ROWS));
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    let first = fake.take(); // in flight
    let upto = d.last_index(d.pos);
    assert!(d.live.iter().any(|l| l.first > upto), "units held ahead");
    assert!(d.give_back_prefetch());
    assert!(d.live.iter().all(|l| l.first <= upto));
    settle(&mut d).unwrap();
    let again: Vec<u32> = fake.take().iter().map(|(f, _)| f.shard).collect();
    assert!(again.is_empty(), "fetched again at once: {again:?}");
    assert_refs_match_live(&d);
    // The next batch's shards arrive: it is assembled, and the prefetch goes on.
    for (f, _) in first {
        answer(f);
    }
    settle(&mut d).unwrap();
    assert!(d.pos > 0, "the batch was assembled");
    let ahead = fake.take();
    assert!(!ahead.is_empty(), "prefetching again after the batch");
    for (f, _) in ahead {
        answer(f);
    }
    let got = take_with(&s, &fake, &mut d, usize::MAX, |_| {});
    assert_eq!(got, planned(&s));
}

/// A trainer that left while the task stepped made every slab refused: the task gave its
/// prefetched shards back (counted), and a repack closed the stream `DoesNotFit`, logging an
/// error that told operators to raise stream_memory.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_closed_mid_step_neither_gives_back_nor_blames_memory() {
    let (s, fake, mut d) = driver(1 << 20);
    for (f, _) in fake.take() {
        answer(f);
    }
    while let Some(c) = d.fetches.try_completed() {
        d.completed(c).unwrap();
    }
    let live = d.live.len();
    assert!(d.live.iter().any(|l| l.first > d.last_index(d.pos)));
    s.close(CloseReason::TrainerDisconnected);
    assert!(!d.try_assemble().unwrap());
    let c = s.supply().counters();
    assert_eq!(c.prefetch_given_back.load(Ordering::Relaxed), 0);
    assert_eq!(d.live.len(), live, "nothing given back");
    // A repack whose slabs are refused because the stream closed is no misfit.
    let s = stream(1 << 20);
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(Fake::default()));
    d.load_epoch(0);
    assert!(!d.to_hold_for_next_batch().is_empty());
    s.close(CloseReason::TrainerDisconnected);
    assert!(matches!(d.repack(), Ok(false)));
}

/// A stream resumed from its state delivers exactly the batches not delivered before it,
/// none twice: mid-epoch and inside a unit (blocks of about 12 samples over shards of 8,
/// batches of 4), in the next epoch, for one worker and for each of three. The task's resume path
/// (`Driver::new` from a position past 0, `needed` skipping the units passed) had no unit
/// test; every one started at 0.
#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_stream_delivers_exactly_what_was_not_delivered() {
    for (workers, k) in [(1u32, 5usize), (1, 13), (3, 2), (3, 5)] {
        for w in 0..workers {
            let change = move |r: &mut StreamRequest| {
                (r.worker, r.num_workers) = (w, workers);
                r.shuffle_block = Some(12);
            };
            let s = stream_with(1 << 20, change);
            let want: Vec<_> = planned(&s)
                .into_iter()
                .skip(w as usize)
                .step_by(workers as usize)
                .collect();
            let before = take_batches(&s, k, |_| {});
            assert_eq!(before, want[..k], "worker {w} of {workers}");
            let mut r = request(change);
            r.state = Some(s.state());
            let resumed = stream_of(manifest(), &r, 1 << 20, 1 << 20);
            assert!(start_of(&resumed) > 0);
            let rest = take_batches(&resumed, usize::MAX, |_| {});
            assert_eq!(
                [before, rest].concat(),
                want,
                "worker {w} of {workers} resumed after {k} batches"
            );
        }
    }
    // A worker opened with another's state starts at its own first batch from there.
    let other = |w: u32| {
        move |r: &mut StreamRequest| {
            (r.worker, r.num_workers) = (w, 3);
            r.shuffle_block = Some(12);
        }
    };
    let s = stream_with(1 << 20, other(0));
    take_batches(&s, 2, |_| {});
    let mut r = request(other(1));
    r.state = Some(s.state()); // position 6: worker 1's next is 7
    let resumed = stream_of(manifest(), &r, 1 << 20, 1 << 20);
    let want: Vec<_> = planned(&s).into_iter().skip(7).step_by(3).collect();
    assert_eq!(take_batches(&resumed, usize::MAX, |_| {}), want);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_that_issued_every_unit_is_done_fetching() {
    // Two epochs in a large region: every unit is held (its shards fetched or in flight).
    let (_s, _fake, d) = driver(1 << 20);
    assert!(d.issued_all());
    // Four: the last two are not loaded yet.
    let s = stream_with(1 << 20, |r| r.epochs = 4);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    settle(&mut d).unwrap();
    assert!(!d.issued_all());
}

/// The task's rounds of hints came every [`HINT_EVERY`](crate::stream::hints::HINT_EVERY)
/// fetches, so the hints it sent before it issued its last unit stood (and the sources kept
/// those shards in memory) until its trainer left. Now the step that issues the last unit
/// withdraws them, while the task still runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_that_issued_every_unit_withdraws_its_hints_while_it_runs() {
    // Blocks of one shard in the least region the open accepts: the first step holds the
    // shards of a few units and hints the others.
    let req = request(|r| r.shuffle_block = Some(ROWS));
    let m = manifest();
    let least = (1u64..=1 << 12)
        .map(|k| k * 1024)
        .find(|&region| open::batch_mode(&m, &req, BATCH, region, false).is_ok())
        .expect("some region fits");
    let s = served_stream(&req, least as usize, &["10.0.0.2:1", "10.0.0.3:1"]);
    let fake = Fake::default();
    let mut d = Driver::new(Arc::clone(&s), 0, Box::new(fake.clone()));
    let got = take_with(&s, &fake, &mut d, usize::MAX, |_| {});
    assert_eq!(got, planned(&s), "the stream ran to its end");
    let supply = s.supply();
    assert!(
        !supply.hinted_links().is_empty(),
        "hints were sent while units were left to issue"
    );
    // `d` still lives: what its drop withdraws does not count here.
    assert_eq!(
        supply.standing_hints(),
        Vec::<(usize, usize)>::new(),
        "every link hinted got an empty hint once the last unit was issued"
    );
    drop(d);
}
