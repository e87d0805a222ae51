//! The stream's bounded waits, against a fake node on a real Unix socket that answers some
//! requests and then goes silent (the limits are milliseconds in tests).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

use shardwire_protocol::trainer::{ErrorCode, StreamState, TensorView};

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

/// Closes the client's stream, waits for the fake node to see it go and removes its socket.
fn close(s: Stream, node: JoinHandle<()>, at: &PathBuf) {
    drop(s);
    node.join().unwrap();
    let _ = std::fs::remove_file(at);
}

fn state() -> StreamState {
    serde_json::from_str(r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f"}"#).unwrap()
}

/// The fake node's side of an attach: reads it, answers with a 64 KiB host region.
fn answer_attach(c: &mut UnixStream) {
    answer_attach_with(c, 1);
}

/// A 64 KiB region sealed as the node seals its regions (the client refuses one that could
/// shrink).
fn region() -> OwnedFd {
    let flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
    let fd = rustix::fs::memfd_create("region", flags).unwrap();
    rustix::fs::ftruncate(&fd, 1 << 16).unwrap();
    rustix::fs::fcntl_add_seals(
        &fd,
        rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW,
    )
    .unwrap();
    fd
}

/// The `attached` answer of [`answer_attach`].
fn attached() -> Response {
    Response::Attached {
        stream: 1,
        region_size: 1 << 16,
        batches_per_epoch: 2,
        epochs: 1,
        memory: MemoryKind::Host,
        gpu: None,
        state: state(),
    }
}

/// [`answer_attach`] with the region's fd sent `copies` times.
fn answer_attach_with(c: &mut UnixStream, copies: usize) {
    assert_eq!(request(c)["op"], "attach");
    let fd = region();
    let mut frame = Vec::new();
    attached().encode(&mut frame);
    fdpass::send_frame(c, &frame, &vec![fd.as_fd(); copies]).unwrap();
}

/// The fake node's side of an attach answered with the JSON `body` and the region; returns
/// the attach request.
fn answer_attach_raw(c: &mut UnixStream, body: &str) -> serde_json::Value {
    let attach = request(c);
    assert_eq!(attach["op"], "attach");
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(body.as_bytes());
    fdpass::send_frame(c, &frame, &[region().as_fd()]).unwrap();
    attach
}

#[test]
fn an_attach_answered_with_other_than_one_fd_is_refused() {
    for copies in [0, 2] {
        let at = path(&format!("fds-{copies}"));
        let node = fake(&at, move |c| answer_attach_with(c, copies));
        let e = Stream::open(&at, StreamOptions::new("d"))
            .err()
            .expect("refused");
        assert!(
            matches!(&e, ClientError::Protocol(m) if m.contains(&format!("came with {copies} file descriptors"))),
            "{e}"
        );
        node.join().unwrap();
        let _ = std::fs::remove_file(&at);
    }
}

/// Sends the answer `r` (one frame, no fds).
fn send_response(c: &mut UnixStream, r: &Response) {
    let mut frame = Vec::new();
    r.encode(&mut frame);
    fdpass::send_frame(c, &frame, &[]).unwrap();
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

/// An `attached` answer that starts and then comes a byte at a time: the attach fails once
/// the frame has taken FRAME_LIMIT. Before, each read waited up to ATTACH_LIMIT, so a node
/// trickling bytes held `open` for ever; and then the error said, from the node's side,
/// "waiting for the rest of a request".
#[test]
fn an_attach_answer_that_trickles_fails_after_the_frame_limit() {
    let at = path("attach-trickle");
    let node = fake(&at, |c| {
        assert_eq!(request(c)["op"], "attach");
        let _ = c.write_all(&100u32.to_le_bytes());
        for _ in 0..20 {
            std::thread::sleep(ATTACH_LIMIT / 3);
            if c.write_all(b"{").is_err() {
                return;
            }
        }
    });
    let t0 = Instant::now();
    let e = Stream::open(&at, StreamOptions::new("d"))
        .err()
        .expect("a frame that never ends is an error");
    assert!(
        matches!(e, ClientError::AnswerStalled { after } if after == FRAME_LIMIT),
        "{e}"
    );
    let message = e.to_string();
    assert!(
        message.contains("answer stopped after its first bytes"),
        "{message}"
    );
    assert!(!message.contains("request"), "{message}");
    assert!(t0.elapsed() < FRAME_LIMIT * 4, "{:?}", t0.elapsed());
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
    close(s, node, &at);
}

/// A `release` the node never answers while a signal arrives every 20 ms (a sampling
/// profiler's SIGPROF): it still fails after REPLY_LIMIT. Before, each `recv` a signal cut
/// short (EINTR: one under SO_RCVTIMEO is never restarted) waited the whole limit again, and
/// the release never returned while the signals came.
#[test]
fn a_release_never_answered_fails_after_its_limit_under_signals() {
    let at = path("release-signals");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        assert_eq!(request(c)["op"], "release", "then silence");
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    let every = Duration::from_millis(20);
    let r = crate::tests::under_signals(every, Duration::from_secs(5), move || {
        let t0 = Instant::now();
        let r = s.release(b);
        (s, r, t0.elapsed())
    });
    let (s, r, took) = r.expect("the release returned while the signals came");
    assert!(
        matches!(
            r,
            Err(ClientError::NoAnswer {
                request: "release",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(took < REPLY_LIMIT * 3, "{took:?}");
    close(s, node, &at);
}

/// The node ends a connection (here for its idle timeout) with an `error` saying why, then
/// closes it: the next request's send fails (EPIPE), and the call returns that error. Before,
/// it returned "trainer socket I/O: Broken pipe", the node's reason left unread.
#[test]
fn a_connection_the_node_ended_returns_the_nodes_error_not_a_broken_pipe() {
    let at = path("ended");
    let (ended_tx, ended) = std::sync::mpsc::channel();
    let why = "waiting for the next request: nothing arrived within 3600s \
               (trainer_idle_timeout_secs)";
    let node = fake(&at, move |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        let error = Response::Error {
            code: ErrorCode::Timeout,
            message: why.into(),
        };
        send_response(c, &error);
        c.shutdown(std::net::Shutdown::Both).unwrap();
        ended_tx.send(()).unwrap();
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    ended.recv().unwrap();
    let e = s
        .next_after(b)
        .err()
        .expect("the node ended the connection");
    assert!(
        matches!(&e, ClientError::Service { code: ErrorCode::Timeout, message } if message == why),
        "{e}"
    );
    let e = s.next().err().expect("the stream is broken");
    assert!(
        matches!(&e, ClientError::Broken { cause } if cause.contains("trainer_idle_timeout_secs")),
        "{e}"
    );
    close(s, node, &at);
}

/// A fake node that answers two `next`s with batches 7 and 8, reads the `next` asked ahead
/// after 8, sends `then` (the answers to it, and what follows them) and closes the
/// connection; `ended` hears of it. The client's side is at batch 8, that `next` in flight.
fn ended_after(at: &PathBuf, then: Vec<Response>) -> (Stream, Batch, JoinHandle<()>) {
    let (ended_tx, ended) = std::sync::mpsc::channel();
    let node = fake(at, move |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 8);
        assert_eq!(request(c)["op"], "next", "asked ahead");
        for r in &then {
            send_response(c, r);
        }
        c.shutdown(std::net::Shutdown::Both).unwrap();
        ended_tx.send(()).unwrap();
    });
    let mut s = Stream::open(at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    let b = s.next_after(b).expect("a batch").expect("not the end");
    ended.recv().unwrap();
    (s, b, node)
}

/// An `error` that answers the request in flight (here its release list refused,
/// `unknown_lease`), then a node that dies without a word: the send after it returns the
/// broken pipe, not that answer. Before, the last `error` unread was taken for the node's
/// reason to close: the release returned `unknown_lease`, which a caller may take as
/// harmless, and carried on.
#[test]
fn an_error_that_answers_a_request_is_not_taken_for_the_reason_of_a_close() {
    let at = path("answer-not-reason");
    let refused = Response::Error {
        code: ErrorCode::UnknownLease,
        message: "lease(s) [7] are not held by this stream".into(),
    };
    let (mut s, b, node) = ended_after(&at, vec![refused]);
    let e = s.release(b).expect_err("the node is gone");
    let closed = |io: &std::io::Error| {
        matches!(
            io.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )
    };
    assert!(
        matches!(&e, ClientError::Frame(FrameIoError::Io(io)) if closed(io)),
        "{e}"
    );
    close(s, node, &at);
}

/// The node's closing `error` comes behind the answers to the requests in flight (here two
/// batches answering the `next` asked ahead, the first marked `more`): it is found past them.
#[test]
fn the_closing_error_is_found_behind_the_answers_in_flight() {
    let at = path("reason-behind");
    let batch = |lease, more| Response::Batch {
        lease,
        epoch: 0,
        index: lease,
        shard: 0,
        tensors: Vec::new(),
        state: Some(state()),
        more,
    };
    let why = "nothing arrived within 3600s (trainer_idle_timeout_secs)";
    let closing = Response::Error {
        code: ErrorCode::Timeout,
        message: why.into(),
    };
    let (mut s, b, node) = ended_after(&at, vec![batch(9, true), batch(10, false), closing]);
    let e = s.release(b).expect_err("the node ended the connection");
    assert!(
        matches!(&e, ClientError::Service { code: ErrorCode::Timeout, message } if message == why),
        "{e}"
    );
    close(s, node, &at);
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
    close(s, node, &at);
}

/// Sends a batch of lease `lease` with these tensors and state.
fn send_batch_with(
    c: &mut UnixStream,
    lease: u64,
    tensors: Vec<TensorView>,
    st: Option<StreamState>,
) {
    let batch = Response::Batch {
        lease,
        epoch: 0,
        index: lease,
        shard: 0,
        tensors,
        state: st,
        more: false,
    };
    let mut frame = Vec::new();
    batch.encode(&mut frame);
    fdpass::send_frame(c, &frame, &[]).unwrap();
}

fn tensor(offset: u64, shape: Vec<u64>, length: u64) -> TensorView {
    TensorView {
        name: "x".into(),
        dtype: shardwire_protocol::manifest::DType::Uint16,
        shape,
        offset,
        length,
    }
}

#[test]
fn an_answer_that_cannot_be_read_closes_the_connection_and_every_later_call_says_so() {
    let at = path("malformed");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        let body = br#"{"op":"batch","lease":1,"surprise":true}"#;
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(body);
        fdpass::send_frame(c, &frame, &[]).unwrap();
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let e = s.next().err().expect("a malformed answer");
    assert!(matches!(e, ClientError::Frame(_)), "{e}");
    // Before, the next call waited forever for an answer to the request already answered.
    let e = s
        .next_timeout(Duration::from_secs(2))
        .err()
        .expect("broken");
    assert!(
        matches!(&e, ClientError::Broken { cause } if cause.contains("surprise")),
        "{e}"
    );
    assert!(matches!(s.next(), Err(ClientError::Broken { .. })));
    close(s, node, &at);
}

#[test]
fn tensors_outside_the_region_or_of_the_wrong_length_are_refused_not_handed_out() {
    let cases = [
        // 64 KiB region: the last byte past its end.
        (
            tensor(65_001, vec![268], 536),
            "outside the stream's region",
        ),
        // 3 x 2 u16 are 12 bytes, not 10.
        (tensor(0, vec![3, 2], 10), "shape [3, 2] of uint16"),
        // A shape whose size overflows.
        (tensor(0, vec![u64::MAX, 2], 4), "does not take"),
    ];
    for (i, (t, want)) in cases.into_iter().enumerate() {
        let at = path(&format!("tensor{i}"));
        let node = fake(&at, move |c| {
            answer_attach(c);
            assert_eq!(request(c)["op"], "next");
            send_batch_with(c, 3, vec![t], Some(state()));
        });
        let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
        let e = match s.next() {
            Err(e) => e,
            Ok(b) => panic!("case {i} handed out: {:?}", b.map(|b| b.tensors().to_vec())),
        };
        assert!(
            matches!(
                e,
                ClientError::TensorOutsideRegion { .. } | ClientError::TensorLength { .. }
            ),
            "{e}"
        );
        assert!(e.to_string().contains(want), "{e}");
        assert!(matches!(s.next(), Err(ClientError::Broken { .. })));
        close(s, node, &at);
    }
}

#[test]
fn a_batch_without_its_state_leaves_the_last_state_as_it_was() {
    let at = path("nostate");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        let mut st = state();
        st.index = 1;
        send_batch_with(c, 1, Vec::new(), Some(st));
        assert_eq!(request(c)["op"], "next");
        send_batch_with(c, 2, Vec::new(), None);
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    assert_eq!(s.state().unwrap().index, 1);
    drop(b);
    assert!(s.next().is_err(), "a batch without its state");
    // Before, the state went back to where the stream opened (index 0).
    assert_eq!(s.state().unwrap().index, 1);
    close(s, node, &at);
}

#[test]
fn a_dropped_batch_is_given_back_with_the_next_request() {
    let at = path("dropped");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        let next = request(c);
        assert_eq!(next["op"], "next");
        assert_eq!(next["release"], serde_json::json!([7]), "{next}");
        send_batch(c, 8);
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    drop(b);
    let b = s.next().expect("a batch").expect("not the end");
    assert_eq!(b.lease, 8);
    assert_eq!(s.held, 1, "the dropped batch is no longer counted as held");
    close(s, node, &at);
}

#[test]
fn a_batch_refused_by_its_checks_does_not_move_the_state_past_it() {
    let at = path("refusedstate");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        let mut st = state();
        st.index = 1;
        send_batch_with(c, 1, Vec::new(), Some(st.clone()));
        assert_eq!(request(c)["op"], "next");
        st.index = 2;
        send_batch_with(c, 2, vec![tensor(0, vec![3, 2], 10)], Some(st));
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    drop(b);
    let e = s.next().err().expect("a refused batch");
    assert!(matches!(e, ClientError::TensorLength { .. }), "{e}");
    // Its error says to open the stream again from its state: that must name the refused
    // batch, not the one after it (before, it named index 2 and the batch was skipped).
    assert_eq!(s.state().unwrap().index, 1);
    close(s, node, &at);
}

#[test]
fn a_zero_timeout_with_a_request_in_flight_is_a_timeout_not_a_broken_stream() {
    let at = path("zerowait");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 1);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 2);
        assert_eq!(request(c)["op"], "next"); // asked ahead: never answered
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    let b = s.next_after(b).expect("a batch").expect("not the end");
    assert_eq!(b.lease, 2);
    for wait in [Duration::ZERO, Duration::from_millis(50)] {
        match s.next_timeout(wait) {
            Err(ClientError::Timeout(t)) => assert_eq!(t, wait),
            other => panic!("{wait:?}: {:?}", other.map(|b| b.map(|b| b.lease))),
        }
    }
    assert!(s.broken.is_none(), "{:?}", s.broken);
    close(s, node, &at);
}

/// A zero timeout while a batch is held takes an answer that is already here. Before, it
/// checked its deadline before any read: a polling loop never got the batch asked ahead.
#[test]
fn a_zero_timeout_takes_a_batch_already_here_while_another_is_held() {
    let at = path("zeroready");
    let node = fake(&at, |c| {
        answer_attach(c);
        // The third `next` goes out ahead of time, while batch 2 is held.
        for lease in 1..=3 {
            assert_eq!(request(c)["op"], "next");
            send_batch(c, lease);
        }
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    let held = s.next_after(b).expect("a batch").expect("not the end");
    assert_eq!(held.lease, 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let third = loop {
        match s.next_timeout(Duration::ZERO) {
            Ok(Some(b)) => break b,
            Err(ClientError::Timeout(_)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            other => panic!("{:?}", other.map(|b| b.map(|b| b.lease))),
        }
    };
    assert_eq!(third.lease, 3);
    drop((held, third));
    close(s, node, &at);
}

/// A late `timeout` answer (to a timed request an earlier call gave up on), then a timeout
/// of the request this call sends again: the error names the caller's timeout, and the
/// request asks only for what is left of it. Before, the error named what was left.
#[test]
fn a_late_timeout_answer_then_a_timeout_names_the_callers_timeout() {
    let at = path("late-timeout");
    let (gave_up, given_up) = std::sync::mpsc::channel::<()>();
    let node = fake(&at, move |c| {
        answer_attach(c);
        let first = request(c);
        assert_eq!(first["timeout_ms"], 50, "{first}");
        // Not answered in time: the first call gives up; the answer comes during the second.
        given_up.recv().unwrap();
        std::thread::sleep(Duration::from_millis(600));
        send_response(c, &Response::Timeout {});
        let again = request(c);
        assert_eq!(again["op"], "next");
        let left = again["timeout_ms"].as_u64().expect("a timed request");
        // About 400 ms is left; room for a descheduled thread on a loaded machine (the old
        // code asked for the whole second again).
        assert!(left <= 700, "asks for what is left of 1 s: {again}");
        // Answered a little early, so that the client reads it before its slack runs out.
        std::thread::sleep(Duration::from_millis(left.saturating_sub(100)));
        send_response(c, &Response::Timeout {});
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let first = Duration::from_millis(50);
    match s.next_timeout(first) {
        Err(ClientError::Timeout(t)) => assert_eq!(t, first),
        other => panic!("{:?}", other.map(|b| b.map(|b| b.lease))),
    }
    gave_up.send(()).unwrap();
    let timeout = Duration::from_secs(1);
    let t0 = Instant::now();
    match s.next_timeout(timeout) {
        Err(ClientError::Timeout(t)) => assert_eq!(t, timeout, "the caller's own"),
        other => panic!("{:?}", other.map(|b| b.map(|b| b.lease))),
    }
    // The node's answer may come up to NODE_TIMEOUT_SLACK late; a little room for the clock.
    let most = timeout + NODE_TIMEOUT_SLACK + Duration::from_millis(200);
    assert!(t0.elapsed() < most, "{:?}", t0.elapsed());
    assert!(s.broken.is_none(), "{:?}", s.broken);
    close(s, node, &at);
}

#[test]
fn a_batch_dropped_on_another_thread_while_next_waits_is_released_behind_it() {
    let at = path("handoff");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        let next = request(c);
        assert_eq!(next["op"], "next");
        assert!(next.get("release").is_none(), "7 is still held: {next}");
        // As the node does now: the memory batch 8 needs comes with the release behind the
        // waiting request; the release's answer follows the batch.
        let release = request(c);
        assert_eq!(release, serde_json::json!({"op": "release", "lease": 7}));
        send_batch(c, 8);
        send_response(c, &Response::Released {});
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    let dropper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(b);
    });
    let t = Instant::now();
    let b = s
        .next_timeout(Duration::from_secs(10))
        .expect("a batch")
        .expect("not the end");
    assert_eq!(b.lease, 8);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    dropper.join().unwrap();
    assert_eq!(s.held, 1, "batch 8 only");
    s.settle().expect("the release's answer");
    assert!(s.awaited.is_empty());
    close(s, node, &at);
}

#[test]
fn a_batch_given_back_to_another_stream_is_refused_and_goes_back_to_its_own() {
    let (at_a, at_b) = (path("own-a"), path("own-b"));
    let node_a = fake(&at_a, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        let next = request(c);
        assert_eq!(
            next["release"],
            serde_json::json!([7]),
            "its own stream gives it back: {next}"
        );
        send_batch(c, 8);
    });
    let node_b = fake(&at_b, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 1);
    });
    let mut a = Stream::open(&at_a, StreamOptions::new("d")).expect("attached");
    let mut b = Stream::open(&at_b, StreamOptions::new("d")).expect("attached");
    let from_a = a.next().expect("a batch").expect("not the end");
    let e = b.release(from_a).expect_err("not b's batch");
    assert!(
        matches!(e, ClientError::NotThisStream { lease: 7, .. }),
        "{e}"
    );
    let own = b.next().expect("a batch").expect("not the end");
    assert_eq!((own.lease, b.held), (1, 1));
    assert_eq!(a.next().expect("a batch").expect("not the end").lease, 8);
    close(b, node_b, &at_b);
    close(a, node_a, &at_a);
}

#[test]
fn a_timeout_past_what_the_clock_holds_waits_as_long_as_it_takes() {
    // While a batch is held, the wait polls for batches dropped on other threads: its
    // deadline was `now + timeout`, which panicked for `Duration::MAX` after the request was
    // sent.
    let at = path("forever");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch(c, 7);
        assert_eq!(request(c)["op"], "next");
        std::thread::sleep(Duration::from_millis(300));
        send_batch(c, 8);
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    let b2 = s
        .next_timeout(Duration::MAX)
        .expect("a batch")
        .expect("not the end");
    assert_eq!((b.lease, b2.lease), (7, 8));
    drop((b, b2));
    close(s, node, &at);
}

#[test]
fn bytes_of_a_view_that_is_not_the_batchs_own_panics() {
    // Before, any view inside the region was read: bytes of slabs leased to nobody (or to
    // another batch, given back meanwhile) that the node may be writing.
    let at = path("views");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        send_batch_with(c, 7, vec![tensor(0, vec![4], 8)], Some(state()));
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    assert_eq!(b.bytes(&b.tensors()[0]).len(), 8);
    let other = tensor(4096, vec![4], 8);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.bytes(&other).len()));
    let msg = r.expect_err("panics");
    let msg = msg
        .downcast_ref::<String>()
        .map(String::as_str)
        .unwrap_or("");
    assert!(msg.contains("not one of this batch's (lease 7)"), "{msg}");
    drop(b);
    close(s, node, &at);
}

#[test]
fn a_refused_release_at_the_end_does_not_keep_the_releases_after_it() {
    // Batches 7 and 8 and the end answer one request; both batches are dropped before the end
    // is read, so their releases go at the end. The node refuses the first: the second is
    // still sent (before, the first refusal returned and lease 8 stayed held).
    let at = path("end-refused");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        for lease in [7, 8] {
            let batch = Response::Batch {
                lease,
                epoch: 0,
                index: lease,
                shard: 0,
                tensors: Vec::new(),
                state: Some(state()),
                more: true,
            };
            send_response(c, &batch);
        }
        send_response(c, &Response::End {});
        let first = request(c);
        assert_eq!(
            (first["op"].as_str(), first["lease"].as_u64()),
            (Some("release"), Some(7))
        );
        let refusal = Response::Error {
            code: ErrorCode::UnknownLease,
            message: "lease 7".into(),
        };
        send_response(c, &refusal);
        let second = request(c);
        assert_eq!(
            (second["op"].as_str(), second["lease"].as_u64()),
            (Some("release"), Some(8))
        );
        send_response(c, &Response::Released {});
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b7 = s.next().expect("a batch").expect("not the end");
    let b8 = s.next().expect("a batch").expect("not the end");
    drop((b7, b8));
    let Err(e) = s.next() else {
        panic!("the refusal")
    };
    assert!(
        matches!(
            e,
            ClientError::Service {
                code: ErrorCode::UnknownLease,
                ..
            }
        ),
        "{e}"
    );
    close(s, node, &at);
}

/// Sends an empty binary batch of lease `lease` (index `lease` too) carrying the JSON `state`.
fn send_binary_batch(c: &mut UnixStream, lease: u64, state: &str) {
    let mut body = vec![binary::BINARY_BATCH_TAG, 0];
    body.extend_from_slice(&0u16.to_le_bytes()); // tensors
    body.extend_from_slice(&(state.len() as u32).to_le_bytes());
    body.extend_from_slice(&lease.to_le_bytes());
    body.extend_from_slice(&lease.to_le_bytes()); // index
    body.extend_from_slice(&[0; 8]); // epoch, shard
    body.extend_from_slice(state.as_bytes());
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    fdpass::send_frame(c, &frame, &[]).unwrap();
}

/// The `attached` answer of [`answer_attach`] as JSON whose state has a field this client
/// does not know (a newer node's), `added`.
fn attached_with_added(added: &str) -> String {
    let mut attached = serde_json::to_value(attached()).unwrap();
    attached["state"]["added"] = added.into();
    attached.to_string()
}

/// A state with a field this client does not know (a newer node's): before, an `attached`
/// answer carrying one failed the open, and `state()` refused a batch's; now the client keeps
/// it whole, sends it back on the attach that resumes from it, and `state()`, which has no
/// room for it, refuses it by name.
#[test]
fn a_state_with_fields_this_client_does_not_know_is_kept_and_sent_back() {
    let at = path("newer-state");
    let node = fake(&at, |c| {
        answer_attach_raw(c, &attached_with_added("a"));
        assert_eq!(request(c)["op"], "next");
        let st = r#"{"epoch":0,"index":1,"seed":0,"fingerprint":"f","added":"b"}"#;
        send_binary_batch(c, 1, st);
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    assert_eq!(s.info.state, state(), "its known fields");
    let opened = serde_json::to_value(s.resume_state().unwrap()).unwrap();
    assert_eq!(opened["added"], "a", "{opened}");
    let b = s.next().expect("a batch").expect("not the end");
    let st = s.resume_state().unwrap();
    assert_eq!(
        (st.known().index, st.unknown_fields()),
        (1, vec!["added".to_string()])
    );
    let e = s.state().unwrap_err();
    assert!(
        matches!(&e, ClientError::StateFieldsUnknown { fields } if fields == &["added"]),
        "{e}"
    );
    drop(b);
    close(s, node, &at);

    let at = path("newer-resume");
    let (tx, rx) = std::sync::mpsc::channel();
    let node = fake(&at, move |c| {
        tx.send(answer_attach_raw(c, &attached_with_added("b")))
            .unwrap();
    });
    let s = Stream::open_from(&at, StreamOptions::new("d"), &st).expect("attached");
    let attach = rx.recv().unwrap();
    assert_eq!(
        attach["state"]["added"], "b",
        "sent back as it came: {attach}"
    );
    assert_eq!(attach["state"]["index"], 1, "{attach}");
    assert_eq!(attach["batch_state"], true, "{attach}");
    close(s, node, &at);
}

/// A JSON batch (one too large for the binary form) whose state has a field this client does
/// not know: before, the answer was refused and the connection closed.
#[test]
fn a_json_batch_whose_state_has_an_unknown_field_is_handed_out_with_it() {
    let at = path("newer-json-batch");
    let node = fake(&at, |c| {
        answer_attach(c);
        assert_eq!(request(c)["op"], "next");
        let mut batch = serde_json::to_value(Response::Batch {
            lease: 4,
            epoch: 0,
            index: 0,
            shard: 0,
            tensors: Vec::new(),
            state: Some(state()),
            more: false,
        })
        .unwrap();
        batch["state"]["added"] = 9.into();
        let body = batch.to_string();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(body.as_bytes());
        fdpass::send_frame(c, &frame, &[]).unwrap();
    });
    let mut s = Stream::open(&at, StreamOptions::new("d")).expect("attached");
    let b = s.next().expect("a batch").expect("not the end");
    assert_eq!(b.lease, 4);
    let st = serde_json::to_value(s.resume_state().unwrap()).unwrap();
    assert_eq!(st["added"], 9, "{st}");
    drop(b);
    close(s, node, &at);
}
