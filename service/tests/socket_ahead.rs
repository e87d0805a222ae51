//! The Rust client's socket `Stream` asking ahead of time (client/src/stream.rs) against real
//! `shardwire source` and `shardwire serve` processes: `next_after` leaves a request for the
//! next batches in flight, the bytes and the plan order are those of one-at-a-time `next`,
//! `state` is the position after the last batch handed out (not after those asked for ahead),
//! a resume from it is exact by the node's `batches_delivered` counter, and a `next_timeout`
//! or a `release` while a request is in flight (the source stopped) leave the stream usable.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, TempDir, WAIT, dataset, json, raw};
use shardwire_client::{Batch, ClientError, NEXT_COUNT, Stream, StreamOptions};

fn opts(seed: u64, epochs: u32) -> StreamOptions {
    let mut o = StreamOptions::new("d");
    o.seed = seed;
    o.epochs = epochs;
    o
}

type Pos = (u32, u64, u32);

fn pos(b: &Batch) -> Pos {
    (b.epoch, b.index, b.shard)
}

/// The batch's one tensor equals its file.
fn check_bytes(b: &Batch, files: &HashMap<String, Vec<u8>>) {
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

/// Leases of the one open stream (None: no stream open).
fn leased(c: &Cluster) -> Option<u64> {
    let (code, body) = raw(&c.admin, "GET", "/v1/streams", "");
    assert_eq!(code, 200, "{body}");
    let v = json(&body);
    let streams = v["streams"].as_array().expect("a streams array").clone();
    streams.first().map(|s| s["leased"].as_u64().unwrap())
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
        most_leased = most_leased.max(leased(&c).unwrap());
    }
    assert!(
        most_leased > 1,
        "next_after left no request ahead: the stream never held more than the batch in hand"
    );
    assert!(most_leased <= 1 + u64::from(NEXT_COUNT), "{most_leased}");
    // Holding the k-th batch and calling nothing, the stream still gets leases: a request was
    // sent ahead of time.
    wait_for("the request sent ahead to be answered", || {
        leased(&c).unwrap() > 1
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
    wait_for("the stream to close", || leased(&c).is_none());
    let first = delivered(&c) - before;
    assert!(first >= k as u64, "{first}");

    let mut o = opts(7, 2);
    o.state = Some(state);
    let mut s = Stream::open(&c.socket, o).unwrap();
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
    wait_for("the stream to close", || leased(&c).is_none());
    let resumed = delivered(&c) - before - first;
    assert_eq!(
        resumed,
        (want.len() - k) as u64,
        "the resumed stream replayed nothing"
    );
}

/// Runs `kill -SIG pid`.
fn signal(sig: &str, pid: u32) {
    let st = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

#[test]
fn a_timeout_or_a_release_with_a_request_in_flight_leave_the_stream_usable() {
    let tmp = TempDir::new("inflight");
    let dir = tmp.0.join("ds");
    // 24 shards of 192 KiB in a 1 MiB region: the node holds at most a few ahead, so with the
    // source stopped the stream runs dry.
    let sizes = vec![192 << 10; 24];
    let files = dataset(&dir, &sizes);
    let c = Cluster::start(&dir, &tmp.0, "1MiB");
    let want = one_at_a_time(&c, opts(3, 1));

    let mut s = Stream::open(&c.socket, opts(3, 1)).unwrap();
    let mut got = Vec::new();
    let mut b = s.next().unwrap().expect("a batch");
    for _ in 0..3 {
        check_bytes(&b, &files);
        got.push(pos(&b));
        b = s.next_after(b).unwrap().expect("a batch");
    }
    signal("-STOP", c.source_pid());
    // Hold `b`; take what the node has ready until a request waits for the stopped source.
    let held = b;
    check_bytes(&held, &files);
    got.push(pos(&held));
    let timed_out = loop {
        match s.next_timeout(Duration::from_millis(300)) {
            Ok(Some(b)) => {
                check_bytes(&b, &files);
                got.push(pos(&b));
                s.release(b).unwrap();
            }
            Ok(None) => panic!("the stream ended with its source stopped"),
            Err(ClientError::Timeout(t)) => break t,
            Err(e) => panic!("{e}"),
        }
        assert!(
            got.len() < want.len(),
            "every batch came with the source stopped"
        );
    };
    assert_eq!(timed_out, Duration::from_millis(300));
    // A release behind the request in flight returns without waiting for that request.
    let t = Instant::now();
    s.release(held).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    signal("-CONT", c.source_pid());
    // The request in flight answers now; then the usual loop to the end.
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
    // Every lease went back: the release read behind the answers, the last ones at the end.
    wait_for("the stream's leases to go back", || leased(&c) == Some(0));
}
