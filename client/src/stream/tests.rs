//! The stream's bounded waits, against a fake node on a real Unix socket that answers some
//! requests and then goes silent (the limits are milliseconds in tests).

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

use shardwire_protocol::trainer::StreamState;

use super::*;

/// A socket path of this test's own.
fn path(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("sw-client-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// Reads one request frame (length prefix and body) from the fake node's side.
fn request(c: &mut UnixStream) -> serde_json::Value {
    let mut len = [0u8; 4];
    c.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    c.read_exact(&mut body).unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// A fake node at `at` for one connection: `then` runs with the accepted socket; afterwards
/// it reads until the client closes.
fn fake(at: &PathBuf, then: impl FnOnce(&mut UnixStream) + Send + 'static) -> JoinHandle<()> {
    let l = UnixListener::bind(at).unwrap();
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        then(&mut c);
        let mut sink = [0u8; 4096];
        while c.read(&mut sink).is_ok_and(|n| n > 0) {}
    })
}

fn state() -> StreamState {
    serde_json::from_str(r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f"}"#).unwrap()
}

/// The fake node's side of an attach: reads it, answers with a 64 KiB host region.
fn answer_attach(c: &mut UnixStream) {
    assert_eq!(request(c)["op"], "attach");
    let fd = rustix::fs::memfd_create("region", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 1 << 16).unwrap();
    let attached = Response::Attached {
        stream: 1,
        region_size: 1 << 16,
        batches_per_epoch: 2,
        epochs: 1,
        memory: MemoryKind::Host,
        gpu: None,
        state: state(),
    };
    let mut frame = Vec::new();
    attached.encode(&mut frame);
    fdpass::send_frame(c, &frame, &[fd.as_fd()]).unwrap();
}

/// Sends an empty batch of lease `lease` (the last answer to its request).
fn send_batch(c: &mut UnixStream, lease: u64) {
    let batch = Response::Batch {
        lease,
        epoch: 0,
        index: lease,
        shard: 0,
        tensors: Vec::new(),
        state: Some(state()),
        more: false,
    };
    let mut frame = Vec::new();
    batch.encode(&mut frame);
    fdpass::send_frame(c, &frame, &[]).unwrap();
}

#[test]
fn an_attach_the_node_never_answers_fails_after_the_limit() {
    let at = path("attach");
    let node = fake(&at, |c| assert_eq!(request(c)["op"], "attach"));
    let t0 = Instant::now();
    let e = Stream::open(&at, StreamOptions::new("d"))
        .err()
        .expect("no answer is an error");
    assert!(
        matches!(e, ClientError::NoAnswer { request: "attach", after } if after == ATTACH_LIMIT),
        "{e}"
    );
    assert!(e.to_string().contains("did not answer attach"), "{e}");
    assert!(t0.elapsed() < ATTACH_LIMIT * 20, "{:?}", t0.elapsed());
    node.join().unwrap();
    let _ = std::fs::remove_file(&at);
}

#[test]
fn a_release_the_node_never_answers_fails_after_the_limit_and_closes_the_stream() {
    let at = path("release");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        assert_eq!(request(c)["op"], "release", "then silence");
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    assert_eq!(b.lease, 7);
    let e = s.release(b).expect_err("no answer is an error");
    assert!(
        matches!(e, ClientError::NoAnswer { request: "release", after } if after == REPLY_LIMIT),
        "{e}"
    );
    assert!(
        s.next().is_err(),
        "the connection is closed: a late answer is never read as another's"
    );
    drop(s);
    node.join().unwrap();
    let _ = std::fs::remove_file(&at);
}

#[test]
fn a_batch_that_came_whole_is_handed_out_though_the_request_after_it_finds_the_node_gone() {
    let at = path("gone");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        // The loop's `next_after`: read it, stop reading (a write to this socket now fails
        // with EPIPE), then answer it; the request the client sends ahead after it fails.
        assert_eq!(request(c)["op"], "next");
        c.shutdown(std::net::Shutdown::Read).unwrap();
        send_batch(c, 8);
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    // Before, the failed request sent ahead of time after it cost the batch itself.
    let b = s
        .next_after(b)
        .expect("the batch that came")
        .expect("not the end");
    assert_eq!(b.lease, 8);
    assert!(s.lost.is_some(), "the request sent ahead after it failed");
    assert!(s.next_after(b).is_err(), "then the lost connection");
    drop(s);
    node.join().unwrap();
    let _ = std::fs::remove_file(&at);
}
