//! The Rust client's socket `Stream` asking ahead of time (client/src/stream.rs) against real
//! `shardwire source` and `shardwire serve` processes: `next_after` leaves a request for the
//! next batches in flight, the bytes and the plan order are those of one-at-a-time `next`,
//! `state` is the position after the last batch handed out (not after those asked for ahead),
//! a resume from it is exact by the node's `batches_delivered` counter, and a `next_timeout`
//! or a `release` while a request is in flight (the source stopped) leave the stream usable.
//! The node's side: in a region of two slabs the loop still runs (a waiting `next` frees the
//! slabs it released first), a timed-out request holding every slab lets a release through,
//! and a trainer that closes its connection while its request waits has its stream closed; a
//! late `timeout` answer (the node stopped while a timed `next` waited) does not fail a later
//! `next`.

mod common;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Cluster, TempDir, WAIT, dataset, json, raw};
use rustix::process::{Pid, Signal, kill_process};
use shardwire_client::{Batch, ClientError, NEXT_COUNT, Stream, StreamOptions};
use shardwire_protocol::fdpass;
use shardwire_protocol::trainer::{self, Request, Response};

fn opts(seed: u64, epochs: u32) -> StreamOptions {
    let mut o = StreamOptions::new("d");
    o.seed = seed;
    o.epochs = epochs;
    o
}

type Pos = (u32, u64, u32);
type Files = HashMap<String, Vec<u8>>;

fn pos(b: &Batch) -> Pos {
    (b.epoch, b.index, b.shard)
}

/// The batch's one tensor equals its file.
fn check_bytes(b: &Batch, files: &Files) {
    let t = &b.tensors()[0];
    assert_eq!(b.bytes(t), files[&t.name], "tensor {} differs", t.name);
}

/// The plan order, one `next` + `release` at a time.
fn one_at_a_time(c: &Cluster, o: StreamOptions) -> Vec<Pos> {
    let mut s = Stream::open(&c.socket, o).unwrap();
    let mut out = Vec::new();
    while let Some(b) = s.next().unwrap() {
        out.push(pos(&b));
        s.release(b).unwrap();
    }
    out
}

fn status(c: &Cluster) -> serde_json::Value {
    let (code, body) = raw(&c.admin, "GET", "/v1/status", "");
    assert_eq!(code, 200, "{body}");
    json(&body)
}

fn delivered(c: &Cluster) -> u64 {
    status(c)["counters"]["batches_delivered"].as_u64().unwrap()
}

/// Field `field` of stream `id` in `/v1/streams` (None: the stream is not open).
fn stream_field(c: &Cluster, id: u64, field: &str) -> Option<u64> {
    let (code, body) = raw(&c.admin, "GET", "/v1/streams", "");
    assert_eq!(code, 200, "{body}");
    let v = json(&body);
    let streams = v["streams"].as_array().expect("a streams array").clone();
    streams
        .iter()
        .find(|s| s["id"].as_u64() == Some(id))
        .map(|s| s[field].as_u64().unwrap())
}

/// Leases of stream `id` (None: it is not open).
fn leased(c: &Cluster, id: u64) -> Option<u64> {
    stream_field(c, id, "leased")
}

/// Batches of stream `id` received and waiting for the trainer (0: not open).
fn ready(c: &Cluster, id: u64) -> u64 {
    stream_field(c, id, "ready").unwrap_or(0)
}

/// A node with a region of two slabs over `shards` shards of 256 KiB, and the plan order of a
/// stream with `seed`.
fn two_slabs(tag: &str, shards: usize, seed: u64) -> (TempDir, Cluster, Files, Vec<Pos>) {
    let tmp = TempDir::new(tag);
    let dir = tmp.0.join("ds");
    let files = dataset(&dir, &vec![256 << 10; shards]);
    let c = Cluster::start(&dir, &tmp.0, "512KiB");
    let want = one_at_a_time(&c, opts(seed, 1));
    (tmp, c, files, want)
}

/// Runs `f` on a thread and fails the test if it has not returned within `limit` (a hang).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|e| panic!("no result within {limit:?} ({e}): a hang"))
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn next_after_asks_ahead_and_a_resume_from_its_state_is_exact() {
    let tmp = TempDir::new("ahead");
    let dir = tmp.0.join("ds");
    let sizes: Vec<usize> = (0..12).map(|i| 3000 + 517 * i).collect();
    let files = dataset(&dir, &sizes);
    let c = Cluster::start(&dir, &tmp.0, "64MiB");
    let want = one_at_a_time(&c, opts(7, 2));
    assert_eq!(want.len(), 2 * sizes.len());

    let before = delivered(&c);
    let mut s = Stream::open(&c.socket, opts(7, 2)).unwrap();
    let id = s.info.stream;
    let mut got = Vec::new();
    let mut b = s.next().unwrap().expect("a batch");
    check_bytes(&b, &files);
    got.push(pos(&b));
    let k = 9;
    let mut most_leased = 0;
    while got.len() < k {
        b = s.next_after(b).unwrap().expect("a batch");
        check_bytes(&b, &files);
        got.push(pos(&b));
        // The request for the next batches is in flight (or answered) while this one is held.
        most_leased = most_leased.max(leased(&c, id).unwrap());
    }
    assert!(
        most_leased > 1,
        "next_after left no request ahead: the stream never held more than the batch in hand"
    );
    assert!(most_leased <= 1 + u64::from(NEXT_COUNT), "{most_leased}");
    // Holding the k-th batch and calling nothing, the stream still gets leases: a request was
    // sent ahead of time.
    wait_for("the request sent ahead to be answered", || {
        leased(&c, id).unwrap() > 1
    });
    let state = s.state().unwrap();
    // The state is the position after the k-th batch handed out, not after those asked ahead.
    let (e, i, _) = want[k];
    assert_eq!(
        (state.epoch, state.index),
        (e, i),
        "state after {k} batches"
    );
    drop(s);
    wait_for("the stream to close", || leased(&c, id).is_none());
    let first = delivered(&c) - before;
    assert!(first >= k as u64, "{first}");

    let mut o = opts(7, 2);
    o.state = Some(state);
    let mut s = Stream::open(&c.socket, o).unwrap();
    let id = s.info.stream;
    let mut next = s.next().unwrap();
    while let Some(b) = next {
        check_bytes(&b, &files);
        got.push(pos(&b));
        next = s.next_after(b).unwrap();
    }
    assert_eq!(got, want, "the same plan, asked ahead, across a resume");
    let end = s.state().unwrap();
    assert_eq!(
        (end.epoch, end.index),
        (2, 0),
        "the state after the last batch"
    );
    drop(s);
    wait_for("the stream to close", || leased(&c, id).is_none());
    let resumed = delivered(&c) - before - first;
    assert_eq!(
        resumed,
        (want.len() - k) as u64,
        "the resumed stream replayed nothing"
    );
}

/// Sends `sig` to process `pid`.
fn signal(sig: Signal, pid: u32) {
    let p = Pid::from_raw(i32::try_from(pid).unwrap()).expect("a child's pid is not 0");
    kill_process(p, sig).unwrap_or_else(|e| panic!("signal {sig:?} to {pid}: {e}"));
}

/// Stops process `pid` and returns once every thread of it is stopped. `kill` only queues
/// SIGSTOP: the group stop begins when one thread dequeues it, and until then the others run
/// on (on a loaded machine, long enough to answer a request sent after `kill` returned).
fn stop(pid: u32) {
    signal(Signal::STOP, pid);
    wait_for("every thread of the stopped process to stop", || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads");
        tasks.flatten().all(|t| {
            // The state is the field after the command name, which ends at the last ')'.
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
            state.is_some_and(|s| s.starts_with('T') || s.starts_with('t'))
        })
    });
}

/// Continues process `pid` after [`stop`].
fn cont(pid: u32) {
    signal(Signal::CONT, pid);
}

#[test]
fn a_timeout_or_a_release_with_a_request_in_flight_leave_the_stream_usable() {
    // A region of two slabs: with one batch leased and the next one ready, the node can fetch
    // nothing more until the trainer gives one back.
    let (_tmp, c, files, want) = two_slabs("inflight", 8, 3);

    let mut s = Stream::open(&c.socket, opts(3, 1)).unwrap();
    let id = s.info.stream;
    let b0 = s.next().unwrap().expect("a batch");
    check_bytes(&b0, &files);
    let mut got = vec![pos(&b0)];
    wait_for("the second batch to be ready", || ready(&c, id) == 1);
    stop(c.source_pid());
    // The release of b0 rides on this request, which b1 answers; the request sent ahead
    // then waits for b2, which the stopped source cannot send.
    let b1 = s.next_after(b0).unwrap().expect("a batch");
    check_bytes(&b1, &files);
    got.push(pos(&b1));
    match s.next_timeout(Duration::from_millis(300)) {
        Err(ClientError::Timeout(t)) => assert_eq!(t, Duration::from_millis(300)),
        other => panic!(
            "expected a timeout, got {:?}",
            other.map(|b| b.map(|b| pos(&b)))
        ),
    }
    // A release behind that request returns at once; its answer is read after the request's.
    let t = Instant::now();
    s.release(b1).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Behind the waiting request, the release is read and applied while it waits (the batch
    // it waits for may need that memory): b1's lease goes now, not when b2 comes.
    wait_for(
        "the release behind the waiting request to be applied",
        || leased(&c, id) == Some(0),
    );
    cont(c.source_pid());
    let mut next = s.next_timeout(WAIT).unwrap();
    while let Some(b) = next {
        check_bytes(&b, &files);
        got.push(pos(&b));
        next = s.next_after(b).unwrap();
    }
    assert_eq!(
        got, want,
        "the same plan through a timeout and a release in flight"
    );
    // Every lease went back: the release read behind the answer, the last ones at the end.
    wait_for("the stream's leases to go back", || {
        leased(&c, id) == Some(0)
    });
}

#[test]
fn a_region_of_two_slabs_runs_the_ahead_loop_to_the_end() {
    let (_tmp, c, files, want) = two_slabs("twoslabs", 10, 5);
    let socket = c.socket.clone();
    // The trainer holds one slab and the request sent ahead waits for the other, which the
    // request released: the node frees it before waiting (else this loop never ends).
    let got = within(WAIT, move || {
        let mut s = Stream::open(&socket, opts(5, 1)).unwrap();
        let mut got = Vec::new();
        let mut next = s.next().unwrap();
        while let Some(b) = next {
            check_bytes(&b, &files);
            got.push(pos(&b));
            next = s.next_after(b).unwrap();
        }
        got
    });
    assert_eq!(got, want);
}

#[test]
fn a_timeout_with_every_slab_held_lets_the_release_through() {
    let (_tmp, c, files, want) = two_slabs("fullregion", 6, 2);
    let mut s = Stream::open(&c.socket, opts(2, 1)).unwrap();
    let b0 = s.next().unwrap().expect("a batch");
    let b1 = s.next().unwrap().expect("a batch");
    // Both slabs are held: the next batch has nowhere to land.
    match s.next_timeout(Duration::from_millis(300)) {
        Err(ClientError::Timeout(t)) => assert_eq!(t, Duration::from_millis(300)),
        other => panic!(
            "expected a timeout, got {:?}",
            other.map(|b| b.map(|b| pos(&b)))
        ),
    }
    // The timed-out request ended on the node, so this release is answered now, not queued
    // behind a request that waits for the memory it frees.
    s.release(b0).unwrap();
    let b2 = s
        .next_timeout(Duration::from_secs(20))
        .unwrap()
        .expect("a batch");
    check_bytes(&b2, &files);
    assert_eq!([pos(&b1), pos(&b2)], [want[1], want[2]]);
}

#[test]
fn a_trainer_that_hangs_up_while_its_next_waits_has_its_stream_closed() {
    let tmp = TempDir::new("hangup");
    let dir = tmp.0.join("ds");
    // More than the 1 MiB region holds: with the source stopped the stream runs dry.
    dataset(&dir, &[64 << 10; 40]);
    let c = Cluster::start(&dir, &tmp.0, "1MiB");
    let sock = UnixStream::connect(&c.socket).unwrap();
    let (mut frame, mut reader, mut fds) = (Vec::new(), fdpass::FrameReader::new(), Vec::new());
    trainer::encode(&Request::Attach(Box::new(opts(1, 1))), &mut frame);
    fdpass::send_frame(&sock, &frame, &[]).unwrap();
    let answer = trainer::decode::<Response>(reader.read(&sock, &mut fds).unwrap()).unwrap();
    let Response::Attached { stream: id, .. } = answer else {
        panic!("not attached: {answer:?}");
    };
    stop(c.source_pid());
    // Take what the node has until a `next` of 2 s times out (a shorter one could time out
    // while a loaded node still checks shards the source wrote before it stopped).
    let mut release = Vec::new();
    loop {
        frame.clear();
        trainer::encode_next(Some(2000), &release, 1, &mut frame);
        fdpass::send_frame(&sock, &frame, &[]).unwrap();
        match Response::decode(reader.read_data(&sock).unwrap()).unwrap() {
            Response::Batch { lease, .. } => release = vec![lease],
            Response::Timeout {} => break,
            other => panic!("unexpected answer: {other:?}"),
        }
    }
    // A `next` that waits (a request sent ahead of time looks like this), then a hang-up.
    frame.clear();
    trainer::encode_next(None, &[], 1, &mut frame);
    fdpass::send_frame(&sock, &frame, &[]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        leased(&c, id),
        Some(0),
        "the stream is open and its next waits"
    );
    drop((sock, fds));
    let t = Instant::now();
    while leased(&c, id).is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the stream of a trainer that hung up stayed open"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    cont(c.source_pid());
}

#[test]
fn a_late_timeout_answer_does_not_fail_a_later_next() {
    let (_tmp, c, files, want) = two_slabs("late", 4, 4);
    let mut s = Stream::open(&c.socket, opts(4, 1)).unwrap();
    let b0 = s.next().unwrap().expect("a batch");
    let b1 = s.next().unwrap().expect("a batch"); // both slabs held: a next waits
    // The node is stopped, so its own `timeout` answer comes after the client gave up.
    stop(c.serve_pid());
    let t = Instant::now();
    let e = s.next_timeout(Duration::from_millis(100));
    cont(c.serve_pid());
    assert!(
        matches!(e, Err(ClientError::Timeout(t)) if t == Duration::from_millis(100)),
        "{:?}",
        e.map(|b| b.map(|b| pos(&b)))
    );
    assert!(
        t.elapsed() >= Duration::from_secs(5),
        "waited {:?} for the node",
        t.elapsed()
    );
    s.release(b0).unwrap();
    // The late `timeout` answers the request that call sent; this call asks again.
    let b2 = s.next().unwrap().expect("a batch");
    check_bytes(&b2, &files);
    assert_eq!([pos(&b1), pos(&b2)], [want[1], want[2]]);
}
