//! The trainer HTTP API (docs/TRAINER_API.md, "HTTP API") against real `shardwire source` and
//! `shardwire serve` processes on loopback, through the Rust client's `HttpStream`
//! (client/src/http.rs) and raw HTTP requests: bytes equal the dataset files, resume through
//! `state`, the same order as the Unix socket, errors, isolation from socket streams, long
//! polls, the body limit and the idle timeout.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Cluster, TempDir, WAIT, dataset, json, raw, raw_full};
use shardwire_client::http::HttpStream;
use shardwire_client::{ClientError, Stream, StreamOptions};

fn code_of(e: ClientError) -> String {
    match e {
        ClientError::Service { code, .. } => code.to_string(),
        other => panic!("expected a service error, got {other:?}"),
    }
}

fn opts(seed: u64, epochs: u32) -> StreamOptions {
    let mut o = StreamOptions::new("d");
    o.seed = seed;
    o.epochs = epochs;
    o
}

#[test]
fn http_stream_bytes_equal_the_files_and_resume_over_http() {
    let tmp = TempDir::new("bytes");
    let dir = tmp.0.join("ds");
    let sizes = [1000, 4096, 5000, 12_345, 1, 70_000, 333];
    let files = dataset(&dir, &sizes);
    let c = Cluster::start(&dir, &tmp.0, "16MiB");

    // The plan order as the Unix socket delivers it.
    let mut sock = Stream::open(&c.socket, opts(5, 2)).unwrap();
    let mut want = Vec::new();
    while let Some(b) = sock.next().unwrap() {
        want.push((b.epoch, b.index, b.shard));
        sock.release(b).unwrap();
    }
    drop(sock);
    assert_eq!(want.len(), 2 * sizes.len());

    let mut s = HttpStream::open(&c.admin, opts(5, 2)).unwrap();
    assert_eq!(s.info.batches_per_epoch, sizes.len() as u64);
    assert_eq!(s.info.epochs, 2);
    assert_eq!((s.info.state.epoch, s.info.state.index), (0, 0));
    let mut got = Vec::new();
    for _ in 0..9 {
        let b = s.next().unwrap().expect("a batch");
        assert_eq!(b.tensors().len(), 1);
        let t = &b.tensors()[0];
        let data = s.tensor_bytes(&b, &t.name).unwrap();
        assert_eq!(
            data, files[&t.name],
            "tensor {} differs from its file",
            t.name
        );
        assert_eq!(t.shape, vec![data.len() as u64]);
        assert_eq!(t.dtype.name(), "uint8");
        got.push((b.epoch, b.index, b.shard));
        s.release(b).unwrap();
    }
    let state = s.state().unwrap();
    assert_eq!((state.epoch, state.index), (1, 2));
    s.close().unwrap();

    // Resume over HTTP from the saved state: exactly the rest, in order.
    let mut o = opts(5, 2);
    o.state = Some(state.clone());
    let mut s = HttpStream::open(&c.admin, o).unwrap();
    assert_eq!(s.info.state, state);
    while let Some(b) = s.next().unwrap() {
        let name = b.tensors()[0].name.clone();
        assert_eq!(s.tensor_bytes(&b, &name).unwrap(), files[&name]);
        got.push((b.epoch, b.index, b.shard));
        s.release(b).unwrap();
    }
    assert_eq!(
        got, want,
        "HTTP (with a resume) and the socket deliver the same plan"
    );
    // A state from another seed is refused, naming the field.
    let mut o = opts(6, 2);
    o.state = Some(state);
    let e = HttpStream::open(&c.admin, o).unwrap_err();
    let msg = e.to_string();
    assert_eq!(code_of(e), "state_mismatch");
    assert!(msg.contains("seed"), "{msg}");
}

#[test]
fn http_errors_limits_and_isolation_from_socket_streams() {
    let tmp = TempDir::new("errors");
    let dir = tmp.0.join("ds");
    let files = dataset(&dir, &[3000, 3000, 3000]);
    let c = Cluster::start(&dir, &tmp.0, "16MiB");
    let a = c.admin.as_str();

    let e = HttpStream::open(a, StreamOptions::new("nope")).unwrap_err();
    assert_eq!(code_of(e), "unknown_dataset");

    let (st, body) = raw(a, "POST", "/v1/streams", r#"{"dataset":"d","bogus":1}"#);
    assert_eq!(st, 400, "{body}");
    assert_eq!(json(&body)["code"], "bad_request");
    assert!(body.contains("bogus"), "{body}");
    let (st, body) = raw(
        a,
        "POST",
        "/v1/streams",
        r#"{"dataset":"d","rank":3,"world_size":2}"#,
    );
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (400, Some("bad_plan")),
        "{body}"
    );
    let (st, body) = raw(a, "POST", "/v1/streams", r#"{"dataset":"d","version":9}"#);
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (400, Some("unsupported_version"))
    );
    let big = format!(r#"{{"dataset":"{}"}}"#, "x".repeat(1 << 20));
    let (st, body) = raw(a, "POST", "/v1/streams", &big);
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (413, Some("bad_request")),
        "{body}"
    );

    // A socket stream and its lease are invisible over HTTP.
    let mut sock = Stream::open(&c.socket, StreamOptions::new("d")).unwrap();
    let sb = sock.next().unwrap().unwrap();
    let sid = sock.info.stream;
    let name = sb.tensors()[0].name.clone();
    for (m, p) in [
        ("POST", format!("/v1/streams/{sid}/next?timeout_ms=0")),
        ("GET", format!("/v1/streams/{sid}/state")),
        ("POST", format!("/v1/streams/{sid}/close")),
    ] {
        let (st, body) = raw(a, m, &p, "");
        assert_eq!(
            (st, json(&body)["code"].as_str()),
            (404, Some("not_found")),
            "{m} {p}: {body}"
        );
    }
    for (m, p) in [
        ("GET", format!("/v1/leases/{}/tensors/{name}", sb.lease())),
        ("POST", format!("/v1/leases/{}/release", sb.lease())),
    ] {
        let (st, body) = raw(a, m, &p, "");
        assert_eq!(
            (st, json(&body)["code"].as_str()),
            (404, Some("unknown_lease")),
            "{m} {p}: {body}"
        );
    }
    assert_eq!(
        sock.next().unwrap().unwrap().index,
        1,
        "the socket stream is untouched"
    );

    // Raw protocol: batch JSON, tensor headers, errors on a live HTTP stream.
    let (st, body) = raw(a, "POST", "/v1/streams", r#"{"dataset":"d","seed":1}"#);
    assert_eq!(st, 201, "{body}");
    let id = json(&body)["stream"].as_u64().unwrap();
    let (st, body) = raw(
        a,
        "POST",
        &format!("/v1/streams/{id}/next?timeout_ms=10000"),
        "",
    );
    assert_eq!(st, 200, "{body}");
    let b = json(&body);
    let lease = b["lease"].as_u64().unwrap();
    let t = &b["tensors"][0];
    let tname = t["name"].as_str().unwrap();
    assert_eq!(t["dtype"], "uint8");
    assert_eq!(t["shape"], serde_json::json!([3000]));
    assert_eq!(t["length"], 3000);
    assert!(
        t.get("offset").is_none(),
        "no region offsets over HTTP: {t}"
    );
    let (st, headers, data) = raw_full(
        a,
        "GET",
        &format!("/v1/leases/{lease}/tensors/{tname}"),
        b"",
    );
    assert_eq!(st, 200);
    let h = |k: &str| {
        headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(h("content-type"), Some("application/octet-stream"));
    assert_eq!(h("x-shardwire-dtype"), Some("uint8"));
    assert_eq!(h("x-shardwire-shape"), Some("3000"));
    assert_eq!(h("content-length"), Some("3000"));
    assert_eq!(data, files[tname]);
    let (st, body) = raw(a, "GET", &format!("/v1/leases/{lease}/tensors/missing"), "");
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    let (st, body) = raw(
        a,
        "POST",
        &format!("/v1/streams/{id}/next?timeout_ms=999999999"),
        "",
    );
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (400, Some("bad_request")),
        "{body}"
    );
    let (st, body) = raw(a, "POST", &format!("/v1/streams/{id}/next?wait=1"), "");
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("wait"), "{body}");
    let (st, body) = raw(a, "POST", "/v1/streams/x/next", "");
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (400, Some("bad_request")),
        "{body}"
    );
    let (st, body) = raw(a, "POST", &format!("/v1/leases/{lease}/release"), "");
    assert_eq!(
        (st, json(&body)["released"].as_bool()),
        (200, Some(true)),
        "{body}"
    );
    let (st, body) = raw(a, "POST", &format!("/v1/leases/{lease}/release"), "");
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (404, Some("unknown_lease")),
        "{body}"
    );
    let (st, body) = raw(a, "GET", &format!("/v1/leases/{lease}/tensors/{tname}"), "");
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (404, Some("unknown_lease")),
        "{body}"
    );
    // The HTTP stream is a node stream like any other (admin listing), until it is closed.
    let listed = |id: u64| {
        let (_, body) = raw(a, "GET", "/v1/streams", "");
        json(&body)["streams"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == id)
    };
    assert!(listed(id));
    let (st, body) = raw(a, "POST", &format!("/v1/streams/{id}/close"), "");
    assert_eq!(st, 200, "{body}");
    let (st, body) = raw(a, "GET", &format!("/v1/streams/{id}/state"), "");
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    let deadline = Instant::now() + WAIT;
    while listed(id) {
        assert!(
            Instant::now() < deadline,
            "stream {id} still listed after close"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    sock.release(sb).unwrap();
}

#[test]
fn http_long_poll_end_and_idle_timeout() {
    let tmp = TempDir::new("poll");
    let dir = tmp.0.join("ds");
    // 20 KB shards take 32 KiB slabs: a 64 KiB stream region holds two.
    dataset(&dir, &[20_000, 20_000, 20_000, 20_000]);
    let c = Cluster::start(&dir, &tmp.0, "64KiB");
    let a = c.admin.clone();

    let mut s = HttpStream::open(&a, opts(0, 1)).unwrap();
    let b1 = s.next().unwrap().unwrap();
    let b2 = s.next().unwrap().unwrap();
    // Both slabs are leased: nothing can arrive, so `next` times out (HTTP 204).
    let t = Instant::now();
    match s.next_timeout(Duration::from_millis(300)) {
        Err(ClientError::Timeout(_)) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_millis(300));
    let path = format!("/v1/streams/{}/next?timeout_ms=0", s.info.stream);
    let (st, body) = raw(&a, "POST", &path, "");
    assert_eq!((st, body.as_str()), (204, ""));
    // A long poll waiting on another connection gets the batch a release makes room for.
    let path = format!("/v1/streams/{}/next?timeout_ms=20000", s.info.stream);
    let a2 = a.clone();
    let poll = std::thread::spawn(move || raw(&a2, "POST", &path, ""));
    std::thread::sleep(Duration::from_millis(300));
    s.release(b1).unwrap();
    let (st, body) = poll.join().unwrap();
    assert_eq!(st, 200, "{body}");
    let b3 = json(&body);
    assert_eq!(b3["index"], 2);
    // b2 and b3 hold both slabs. A caller that gives up while its poll waits loses nothing:
    // the batch the poll took is kept for the next `next`, and `state` still points at it.
    let mut gone = TcpStream::connect(&a).unwrap();
    let path = format!("/v1/streams/{}/next?timeout_ms=20000", s.info.stream);
    let req = format!("POST {path} HTTP/1.1\r\nHost: {a}\r\nContent-Length: 0\r\n\r\n");
    gone.write_all(req.as_bytes()).unwrap();
    // Time for the node to start the poll's wait, then to see its caller leave (nothing
    // observable marks either: generous for a loaded machine).
    std::thread::sleep(Duration::from_secs(1));
    drop(gone);
    std::thread::sleep(Duration::from_secs(1));
    s.release(b2).unwrap(); // room for index 3, which the abandoned poll takes
    // The node did deliver index 3 (to the poll that was abandoned) ...
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, body) = raw(&a, "GET", "/v1/streams", "");
        let listed = json(&body)["streams"][0].clone();
        let got = (listed["delivered"].as_u64(), listed["leased"].as_u64());
        if got == (Some(4), Some(2)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "index 3 never delivered: {listed}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // ... yet the stream's state and its next `next` still name it.
    let state = s.state().unwrap();
    assert_eq!((state.epoch, state.index), (0, 3));
    let b4 = s.next().unwrap().unwrap();
    assert_eq!(b4.index, 3);
    s.release(b4).unwrap();
    let (st, _) = raw(
        &a,
        "POST",
        &format!("/v1/leases/{}/release", b3["lease"]),
        "",
    );
    assert_eq!(st, 200);
    assert!(s.next().unwrap().is_none(), "the end");
    let path = format!("/v1/streams/{}/next", s.info.stream);
    let (st, body) = raw(&a, "POST", &path, "");
    assert_eq!(
        (st, json(&body)["end"].as_bool()),
        (200, Some(true)),
        "{body}"
    );
    s.close().unwrap();

    // An HTTP stream nobody asks about closes after its idle timeout; the budget returns.
    let body = r#"{"dataset":"d","idle_timeout_s":1}"#;
    let (st, body) = raw(&a, "POST", "/v1/streams", body);
    assert_eq!(st, 201, "{body}");
    let id = json(&body)["stream"].as_u64().unwrap();
    assert_eq!(json(&body)["idle_timeout_s"], 1);
    let (st, _) = raw(&a, "GET", &format!("/v1/streams/{id}/state"), "");
    assert_eq!(st, 200);
    // Closed 1 to 1.5 s after its last use (the reaper ticks every 500 ms); the listing
    // does not count as a use.
    let t = Instant::now();
    while stream_listed(&a, id) {
        assert!(
            t.elapsed() < WAIT,
            "stream {id} still open after {:?}",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    let (st, body) = raw(&a, "GET", &format!("/v1/streams/{id}/state"), "");
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, body) = raw(&a, "GET", "/v1/status", "");
        let v = json(&body);
        if v["streams"].as_array().unwrap().is_empty() && v["pool"]["reserved"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "idle stream not cleaned up: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (st, body) = raw(
        &a,
        "POST",
        "/v1/streams",
        r#"{"dataset":"d","idle_timeout_s":0}"#,
    );
    assert_eq!(
        (st, json(&body)["code"].as_str()),
        (400, Some("bad_request")),
        "{body}"
    );
}

/// Whether stream `id` is in the node's `/v1/streams` listing.
fn stream_listed(admin: &str, id: u64) -> bool {
    let (st, body) = raw(admin, "GET", "/v1/streams", "");
    assert_eq!(st, 200, "{body}");
    json(&body)["streams"]
        .as_array()
        .expect("a streams array")
        .iter()
        .any(|s| s["id"].as_u64() == Some(id))
}
