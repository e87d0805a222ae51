"""End-to-end tests of the trainer HTTP API (docs/TRAINER_API.md, "HTTP API") through the Python
SDK's HTTP transport (``shardwire.connect_http`` / ``connect(url=...)``), against real
``shardwire source`` / ``serve`` processes on 127.0.0.1:

- values of every tensor equal numpy / pyarrow's reading of the dataset files; arrays are
  private writable copies; leases end as soon as a batch arrived;
- the plan order is the socket's; resume states move between the two transports;
- errors (unknown dataset, state mismatch, bad arguments, bad URLs, unreachable node), the
  timeout of ``next`` while the source stalls, close and the idle timeout, close() from another
  thread while ``next`` waits in a long poll;
- the raw API: status codes and error bodies, unknown fields, the body limit, isolation from
  socket streams.

Self-contained like test_sdk.py: the SDK comes from client/python/src (put first on sys.path),
children are started by the small ``Procs`` registry below and killed at teardown.
"""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

import faults as F
from conftest import next_in_forked_child
from sdk_harness import (  # noqa: E402 - the shared harness; puts the SDK on sys.path
    procs,  # noqa: F401 - a fixture
    world,  # noqa: F401 - a fixture
    Procs,
    Serve,
    SHARDS,
    World,
    assert_batch_matches,
    http,
    http_json,
    index,
    listed,
    sequence,
    wait_for,
)
import shardwire  # noqa: E402
from shardwire._client import _NEXT_COUNT  # noqa: E402

def test_values_are_downloaded_copies_in_the_socket_order(world: World):
    with world.sock().open_stream("mix", seed=11, epochs=2) as s:
        want = sequence(s)
    with world.http().open_stream("mix", seed=11, epochs=2) as s:
        assert isinstance(s, shardwire.HttpStream)
        assert s.info.batches_per_epoch == SHARDS and s.info.epochs == 2
        assert s.info.memory == "http" and s.info.region_size == 0 and s.idle_timeout == 300
        got = []
        for b in s:
            assert isinstance(b, shardwire.HttpBatch)
            assert_batch_matches(b, world.expected)
            for name, arr in b.items():
                base: Any = arr
                while isinstance(base, np.ndarray):
                    base = base.base
                if isinstance(base, memoryview):
                    base = base.obj
                assert isinstance(base, bytearray), type(base)  # the downloaded copy
                assert arr.flags.writeable
                arr[(0,) * arr.ndim] = arr[(0,) * arr.ndim]  # writable: it is ours
            assert {v.name for v in b.views} == set(b) and all(v.offset == -1 for v in b.views)
            assert b.released and b.keep() is b and b.kept
            b.release()  # accepted, nothing to do
            # the lease ended on arrival: nothing of this stream is leased on the service
            assert listed(world.serve.admin, s.info.stream)["leased"] == 0
            got.append((b.epoch, b.index, b.shard))
        assert got == want, "HTTP and the socket deliver the same plan"
        assert s.next() is None


def test_resume_states_cross_transports(world: World):
    with world.http().open_stream("mix", seed=2, epochs=2) as s:
        want = sequence(s)
    with world.http().open_stream("mix", seed=2, epochs=2) as s:
        first = [(b.epoch, b.index, b.shard) for _, b in zip(range(7), s)]
        st = s.state_dict()
    assert (st["epoch"], st["index"]) == (0, 7)
    with world.sock().open_stream("mix", seed=2, epochs=2, state=st) as s:  # HTTP -> socket
        middle = [(b.epoch, b.index, b.shard) for _, b in zip(range(6), s)]
        st2 = s.state_dict()
    with world.http().open_stream("mix", seed=2, epochs=2, state=st2) as s:  # socket -> HTTP
        assert s.info.state == st2
        rest = sequence(s)
    assert first + middle + rest == want


def test_connect_forms_and_connect_errors(world: World, tmp_path: pathlib.Path):
    a = world.serve.admin
    for c in (shardwire.connect(url=f"http://{a}"), shardwire.connect(f"http://{a}/"), shardwire.connect_http(a)):
        assert isinstance(c, shardwire.HttpClient) and c.url == f"http://{a}"
    with pytest.raises(ValueError):
        shardwire.connect_http("https://127.0.0.1:1")
    with pytest.raises(ValueError):
        shardwire.connect_http("127.0.0.1")  # no port
    with pytest.raises(ValueError):
        shardwire.connect(str(tmp_path / "x.sock"), url=f"http://{a}")
    import socket as _socket

    with _socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(shardwire.ConnectError) as ei:
        shardwire.connect_http(f"127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in str(ei.value)


def test_service_errors_and_argument_errors(world: World):
    c = world.http()
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("no-such-dataset")
    assert ei.value.code == "unknown_dataset" and "no-such-dataset" in ei.value.message
    with pytest.raises(ValueError, match="rank must be < world_size"):  # before anything is sent
        c.open_stream("mix", rank=3, world_size=3)
    # A plan the node refuses: more ranks than shards, each dropping to none.
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("mix", rank=0, world_size=SHARDS + 1, uneven="drop")
    assert ei.value.code == "bad_plan", repr(ei.value)
    with c.open_stream("mix", seed=1) as s:
        st = s.state_dict()
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("mix", seed=1, world_size=2, state=st)
    assert ei.value.code == "state_mismatch" and "world_size" in ei.value.message
    with pytest.raises(ValueError):
        c.open_stream("mix", uneven="spread")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.open_stream("mix", idle_timeout=0)


def test_close_and_idle_timeout(world: World):
    c = world.http()
    s = c.open_stream("mix", seed=4)
    sid = s.info.stream
    assert listed(world.serve.admin, sid) is not None
    assert s.next() is not None
    s.close()
    s.close()  # idempotent
    assert s.closed
    with pytest.raises(shardwire.ShardwireError) as ei:
        s.next()
    assert ei.value.code == "closed"
    wait_for(lambda: listed(world.serve.admin, sid) is None, f"stream {sid} gone after close")

    s = c.open_stream("mix", seed=4, idle_timeout=1)
    assert s.idle_timeout == 1
    sid = s.info.stream
    # Closed 1 to 1.5 s after its last use (the reaper ticks every 500 ms); listing it is no use.
    wait_for(lambda: listed(world.serve.admin, sid) is None, f"idle stream {sid} gone")
    with pytest.raises(shardwire.ServiceError) as ei:
        s.next()
    assert ei.value.code == "not_found", repr(ei.value)
    s.close()  # the service already closed it: still fine


def test_next_times_out_when_the_source_stalls(procs: Procs, tmp_path: pathlib.Path):
    big = tmp_path / "big"
    big.mkdir()
    for i in range(2):
        np.save(big / f"s{i}.npy", np.full(3 << 20, i, dtype=np.uint8))  # 3 MiB shards
    index(big)
    src = procs.source({"big": big}, "--rate-limit", "64KiB")  # ~48 s per shard
    serve = procs.serve(src, tmp_path / "stall.sock")
    with shardwire.connect_http(serve.admin).open_stream("big") as s:
        t0 = time.monotonic()
        with pytest.raises(shardwire.Timeout) as ei:
            s.next(timeout=0.5)
        assert ei.value.code == "timeout" and 0.4 <= time.monotonic() - t0 < 30
        with pytest.raises(shardwire.Timeout):
            s.next(timeout=0.2)  # the stream stays usable
        assert s.state_dict()["index"] == 0
        # the raw API answers 204 No Content on a timeout
        st, body, _ = http(serve.admin, "POST", f"/v1/streams/{s.info.stream}/next?timeout_ms=0", b"")
        assert (st, body) == (204, b"")
        # A `next` behind another one of the same stream keeps its own timeout: it waited out
        # the whole wait of the one in front before.
        path = f"/v1/streams/{s.info.stream}/next"
        front = threading.Thread(target=http, args=(serve.admin, "POST", path + "?timeout_ms=8000", b""), daemon=True)
        front.start()

        def stalled() -> float:
            st, v = http_json(serve.admin, "GET", "/v1/status")
            assert st == 200, v
            return v["counters"]["stall_network_seconds"]

        def queued() -> bool:
            # A `next` that had the stream's turn waited its 500 ms for a batch, which the
            # node counts as a network stall when it ends; one queued behind the front one
            # (which counts its wait only at its own end) never waited for a batch. So the
            # stall counter tells whether the front one had reached the node: until it has,
            # this is tried again.
            before = stalled()
            t0 = time.monotonic()
            st, body, _ = http(serve.admin, "POST", path + "?timeout_ms=500", b"")
            took = time.monotonic() - t0
            assert (st, body) == (204, b"") and took < 3, took
            return stalled() - before < 0.25

        wait_for(queued, "a `next` queued behind the front one (its turn held by it)", timeout=6)
        front.join(15)


def test_close_from_another_thread_wakes_a_long_poll(procs: Procs, tmp_path: pathlib.Path):
    """A watchdog's close() while `next` waits in a long poll (30 s; the source stalls): the
    waiting call raises `closed` at once, and the stream is closed on the service, not left
    to its idle timeout. Before, close() waited for the long poll to end."""
    big = tmp_path / "big"
    big.mkdir()
    np.save(big / "s0.npy", np.zeros(3 << 20, dtype=np.uint8))  # one 3 MiB shard
    index(big)
    src = procs.source({"big": big}, "--rate-limit", "64KiB")  # ~48 s for the shard
    serve = procs.serve(src, tmp_path / "wake.sock")
    s = shardwire.connect_http(serve.admin).open_stream("big")
    sid = s.info.stream
    got: list[BaseException | object] = []

    def wait() -> None:
        try:
            got.append(s.next())
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            got.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    wait_for(s._lock.locked, "next() to hold the stream's lock")
    time.sleep(0.5)  # most likely in its long poll by now; a close before it is woken all the same
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 5, f"close() waited {time.monotonic() - t0:.1f} s for the long poll"
    t.join(5)
    assert not t.is_alive() and len(got) == 1, got
    e = got[0]
    assert isinstance(e, shardwire.ShardwireError) and e.code == "closed", repr(e)
    assert "closed by close() from another thread" in str(e), e
    wait_for(lambda: listed(serve.admin, sid) is None, f"stream {sid} gone after close")  # not its 300 s idle timeout


# --- the raw API -----------------------------------------------------------------------------


def test_raw_api_codes_headers_and_limits(world: World):
    a = world.serve.admin
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "sede": 1})
    assert st == 400 and v["code"] == "bad_request" and "sede" in v["message"], v
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "uneven": "spread"})
    assert st == 400 and v["code"] == "bad_request" and "spread" in v["message"], v
    # An open takes up to 1 MiB (the trainer socket's frame limit), every other route 64 KiB.
    # (The node answers before it reads a body over the limit and closes: streamed, with the
    # pipe's breaking tolerated.)
    over = F.http_streamed_body(a, "/v1/streams", (1 << 20) + 1, (1 << 20) + 1)
    assert over.status == 413 and json.loads(over.body)["code"] == "bad_request", over
    over = F.http_streamed_body(a, "/v1/streams/1/next", 70 << 10, 70 << 10)
    assert over.status == 413 and json.loads(over.body)["code"] == "bad_request", over
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "nope"})
    assert (st, v["code"]) == (404, "unknown_dataset")
    # What a web page can send cross-origin without a preflight: refused, nothing opened.
    body = b'{"dataset": "mix"}'
    web = F.http_raw(a, b"POST /v1/streams HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert web.status == 415 and b"application/json" in web.body, web
    web = F.http_request(a, "POST", "/v1/streams", {"dataset": "mix"}, headers={"Origin": "http://evil.example"})
    assert web.status == 403 and b"evil.example" in web.body, web
    web = F.http_request(a, "POST", "/v1/streams/1/close", headers={"Origin": "null"})
    assert web.status == 403, web
    # A page whose name an attacker rebinds to 127.0.0.1 is same-origin to the browser (no
    # Origin on its GETs): on loopback, only requests addressed to localhost or an IP are served.
    rebound = F.http_raw(a, b"GET /v1/status HTTP/1.1\r\nHost: evil.example:80\r\nConnection: close\r\n\r\n")
    assert rebound.status == 403 and b"evil.example" in rebound.body, rebound
    local = F.http_raw(a, b"GET /v1/status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert local.status == 200, local
    # A chunked body that is not well-formed is a bad request, not one too large; one that
    # grows past 64 KiB (on a route other than an open) is too large.
    head = b"POST /v1/streams HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    bad = F.http_raw(a, head + b"zz\r\n{}\r\n0\r\n\r\n")
    assert bad.status == 400 and b"bad_request" in bad.body, bad
    head = head.replace(b"/v1/streams ", b"/v1/streams/1/next ")
    big = F.http_raw(a, head + b"".join(b"%x\r\n%s\r\n" % (8192, b" " * 8192) for _ in range(9)) + b"0\r\n\r\n")
    assert big.status == 413, big

    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "seed": 9})
    assert st == 201 and set(v) == {"stream", "batches_per_epoch", "epochs", "state", "idle_timeout_s"}, v
    sid = v["stream"]
    # Ids start at a random value per node run (2^21 or more): a handle kept over a restart
    # names nothing of the new run.
    assert sid >= 1 << 21, sid
    st, b = http_json(a, "POST", f"/v1/streams/{sid}/next?timeout_ms=10000")
    assert st == 200 and set(b) == {"lease", "epoch", "index", "shard", "tensors"}, b
    exp = world.expected[b["shard"]]
    for t in b["tensors"]:
        st, data, h = http(a, "GET", f"/v1/leases/{b['lease']}/tensors/{t['name']}")
        assert st == 200 and h["content-type"] == "application/octet-stream"
        want = exp[t["name"]]
        assert h["x-shardwire-dtype"] == str(want.dtype) == t["dtype"]
        assert h["x-shardwire-shape"] == ",".join(map(str, want.shape))
        assert int(h["content-length"]) == len(data) == want.nbytes == t["length"]
        assert np.array_equal(np.frombuffer(data, want.dtype).reshape(want.shape), want)
        # HEAD: GET's headers, no body (and nothing copied: service/src/http/trainer.rs).
        st, none, hh = http(a, "HEAD", f"/v1/leases/{b['lease']}/tensors/{t['name']}")
        assert (st, none) == (200, b"")
        assert {k: hh[k] for k in ("content-type", "content-length", "x-shardwire-dtype", "x-shardwire-shape")} == \
            {k: h[k] for k in ("content-type", "content-length", "x-shardwire-dtype", "x-shardwire-shape")}, (hh, h)
    st, v = http_json(a, "GET", f"/v1/leases/{b['lease']}/tensors/nope")
    assert (st, v["code"]) == (404, "not_found") and "nope" in v["message"]
    assert listed(a, sid)["leased"] == 1
    # Named by another stream, the lease is not released (a late release after a restart).
    st, v = http_json(a, "POST", f"/v1/leases/{b['lease']}/release?stream={sid + 1000}")
    assert (st, v["code"]) == (404, "unknown_lease") and listed(a, sid)["leased"] == 1
    st, v = http_json(a, "POST", f"/v1/leases/{b['lease']}/release?stream={sid}")
    assert (st, v) == (200, {"released": True})
    assert listed(a, sid)["leased"] == 0
    st, v = http_json(a, "POST", f"/v1/leases/{b['lease']}/release")
    assert (st, v["code"]) == (404, "unknown_lease")
    assert http(a, "HEAD", f"/v1/leases/{b['lease']}/tensors/{b['tensors'][0]['name']}")[0] == 404
    st, v = http_json(a, "GET", f"/v1/streams/{sid}/state")
    assert st == 200 and (v["epoch"], v["index"], v["seed"]) == (0, 1, 9)

    # Socket streams and their leases are not reachable over HTTP.
    with world.sock().open_stream("mix") as s:
        sb = s.next()
        assert sb is not None
        st, v = http_json(a, "POST", f"/v1/streams/{s.info.stream}/next?timeout_ms=0")
        assert (st, v["code"]) == (404, "not_found")
        st, v = http_json(a, "GET", f"/v1/leases/{sb.lease}/tensors/{next(iter(sb))}")
        assert (st, v["code"]) == (404, "unknown_lease")
        st, v = http_json(a, "POST", f"/v1/leases/{sb.lease}/release")
        assert (st, v["code"]) == (404, "unknown_lease")
        # 1: the batch taken; more once those asked for ahead of time (up to the SDK's
        # _NEXT_COUNT) have been handed over.
        assert not sb.released and 1 <= listed(a, s.info.stream)["leased"] <= 1 + _NEXT_COUNT

    st, v = http_json(a, "POST", f"/v1/streams/{sid}/close")
    assert (st, v) == (200, {"stream": sid, "closed": True})
    st, v = http_json(a, "POST", f"/v1/streams/{sid}/next")
    assert (st, v["code"]) == (404, "not_found")
    wait_for(lambda: listed(a, sid) is None, f"stream {sid} gone after close")


def test_a_batch_whose_answer_never_arrived_is_answered_again(world: World):
    # A `next` answered with a batch whose answer the caller never got (the connection broke
    # as it came) skipped that batch: the stream had moved on. With `after` (the lease of the
    # last batch received), the node answers with it again.
    a = world.serve.admin
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "seed": 4})
    assert st == 201, v
    sid = v["stream"]
    nxt = lambda after: http_json(a, "POST", f"/v1/streams/{sid}/next?timeout_ms=10000&after={after}")[1]
    first = nxt(0)
    assert nxt(0) == first, "not received: the same batch again"
    second = nxt(first["lease"])
    assert second["lease"] != first["lease"] and second["index"] == first["index"] + 1, second
    assert nxt(first["lease"]) == second
    # Released, it is not answered again (the caller had it).
    assert http_json(a, "POST", f"/v1/leases/{second['lease']}/release")[0] == 200
    third = nxt(first["lease"])
    assert third["index"] == second["index"] + 1, third
    # Another caller (naming another `after`) gets the following batch, not this one's.
    fourth = nxt(third["lease"] + 1000)
    assert fourth["index"] == third["index"] + 1, fourth
    # Without `after` (older clients) nothing is answered twice.
    fifth = http_json(a, "POST", f"/v1/streams/{sid}/next?timeout_ms=10000")[1]
    assert fifth["index"] == fourth["index"] + 1, fifth
    assert http_json(a, "POST", f"/v1/streams/{sid}/close")[0] == 200


def _answer_once(raw: bytes) -> tuple[int, Any]:
    """A one-shot TCP server on 127.0.0.1 that reads a request head, writes `raw` and closes:
    a service that answers badly, for the SDK's response reader."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            buf = b""
            while b"\r\n\r\n" not in buf:
                got = c.recv(4096)
                if not got:
                    return
                buf += got
            c.sendall(raw)
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def test_tensor_download_refuses_a_length_the_batch_does_not_say():
    """A tensor answer's Content-Length must equal the batch's tensor length; a huge claim is
    refused before anything is allocated, and a short body fails as incomplete."""
    import http.client

    from shardwire import _http

    port, t = _answer_once(b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\nabcdefgh")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises(shardwire.ProtocolError, match="Content-Length is 1099511627776, the batch says 8 bytes"):
        _http._call(conn, "GET", "/v1/leases/1/tensors/x", None, 10, into=8)
    t.join(10)

    # 3 MiB said and sent in full: read into a bytearray that grew from 1 MiB as bytes came.
    body = bytes(range(256)) * (3 << 12)
    port, t = _answer_once(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    r = _http._call(conn, "GET", "/v1/leases/1/tensors/x", None, 10, into=len(body))
    assert isinstance(r.body, bytearray) and r.body == body
    t.join(10)

    port, t = _answer_once(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nabc")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises(http.client.IncompleteRead):
        _http._call(conn, "GET", "/v1/leases/1/tensors/x", None, 10, into=8)
    t.join(10)


def test_json_answers_grow_with_their_bytes_not_their_claims():
    """Any other answer is read in pieces: a Content-Length over the limit is refused before
    reading, a chunk size of 1 TiB followed by 3 bytes fails as incomplete (no 1 TiB
    allocation), and a normal chunked answer is read whole."""
    import http.client

    from shardwire import _http

    port, t = _answer_once(b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n{}")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises(shardwire.ProtocolError, match="Content-Length is 1099511627776"):
        _http._call(conn, "GET", "/v1/streams/1/state", None, 10)
    assert conn.sock is None, "the spent connection is closed"
    t.join(10)

    port, t = _answer_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffff\r\nabc")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises(http.client.IncompleteRead):
        _http._call(conn, "GET", "/v1/streams/1/state", None, 10)
    t.join(10)

    port, t = _answer_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n5\r\n\": 1}\r\n0\r\n\r\n")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert _http._call(conn, "GET", "/v1/streams/1/state", None, 10).json() == {"a": 1}
    t.join(10)


class _FakeNode(BaseHTTPRequestHandler):
    """A small HTTP server's handler playing the node (subclasses answer the requests)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def answer(self, status: int, body: bytes, kind: str = "application/json", close: bool = False):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


def test_a_tensor_download_refused_for_a_full_copy_budget_is_tried_again():
    """A node whose copy budget stays full answers a tensor download `503` `unavailable` after
    waiting for room: the SDK asks again (the node has moved past the batch, so failing it
    would lose it), and gives up with that error only after COPY_ATTEMPTS. Against a small
    HTTP server playing the node."""
    from shardwire import _http

    def serve(refusals: int):
        seen: list[str] = []

        class Node(_FakeNode):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append(f"POST {self.path.split('?')[0]}")
                if "after=" in self.path:
                    seen.append(f"POST {self.path.split('?')[0]}?after={self.path.split('after=')[1]}")
                if self.path == "/v1/streams":
                    v = {"stream": 1, "batches_per_epoch": 1, "epochs": 1, "state": {}, "idle_timeout_s": 300}
                    return self.answer(201, json.dumps(v).encode())
                if self.path.startswith("/v1/streams/1/next"):
                    v = {"lease": 7, "epoch": 0, "index": 0, "shard": 0,
                         "tensors": [{"name": "x", "dtype": "uint8", "shape": [4], "offset": 0, "length": 4}]}
                    return self.answer(200, json.dumps(v).encode())
                if self.path == "/v1/leases/7/release":
                    return self.answer(200, b'{"released": true}')
                return self.answer(200, b"{}")

            def do_GET(self):
                if self.path == "/healthz":
                    return self.answer(200, b"ok", "text/plain")
                seen.append(f"GET {self.path}")
                if sum(s.startswith("GET ") for s in seen) <= refusals:
                    return self.answer(503, b'{"code": "unavailable", "message": "the copy budget stayed full for 10 s"}')
                return self.answer(200, b"\x01\x02\x03\x04", "application/octet-stream")

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Node)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv, seen

    srv, seen = serve(refusals=2)
    try:
        s = shardwire.connect_http(f"http://127.0.0.1:{srv.server_address[1]}").open_stream("d")
        b = s.next(timeout=10)
        assert b is not None and list(b["x"]) == [1, 2, 3, 4]
        assert seen.count("GET /v1/leases/7/tensors/x") == 3 and seen.count("POST /v1/leases/7/release") == 1, seen
    finally:
        srv.shutdown()
    srv, seen = serve(refusals=1000)
    try:
        s = shardwire.connect_http(f"http://127.0.0.1:{srv.server_address[1]}").open_stream("d")
        with pytest.raises(shardwire.ServiceError) as e:
            s.next(timeout=10)
        assert e.value.code == "unavailable", e.value
        assert seen.count("GET /v1/leases/7/tensors/x") == _http.COPY_ATTEMPTS, seen
        assert "POST /v1/leases/7/release" not in seen, "the batch not received keeps its lease"
    finally:
        srv.shutdown()
    # Refused COPY_ATTEMPTS times, then served: the failed `next` took nothing, so the next
    # one names the same `after` (0), which the node answers with that batch again.
    srv, seen = serve(refusals=_http.COPY_ATTEMPTS)
    try:
        s = shardwire.connect_http(f"http://127.0.0.1:{srv.server_address[1]}").open_stream("d")
        with pytest.raises(shardwire.ServiceError):
            s.next(timeout=10)
        b = s.next(timeout=10)
        assert b is not None and b.lease == 7 and list(b["x"]) == [1, 2, 3, 4]
        nexts = [p for p in seen if "after=" in p]
        assert nexts == ["POST /v1/streams/1/next?after=0"] * 2, seen
        assert seen.count("POST /v1/leases/7/release") == 1, seen
    finally:
        srv.shutdown()


def test_a_next_whose_answer_is_lost_is_asked_again_naming_the_last_batch_received():
    """The node's answer to a `next` never arrives (the connection breaks as it would come):
    the SDK asks once more on a new connection, with `after` naming the last batch it received,
    so the node answers with the same batch (the raw behaviour is checked above) and none is
    skipped. Against a small HTTP server playing the node."""
    nexts: list[str] = []

    class Node(_FakeNode):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/v1/streams":
                v = {"stream": 1, "batches_per_epoch": 2, "epochs": 1, "state": {}, "idle_timeout_s": 300}
                # Closed after: the first `next` goes on a new connection, where the HTTP
                # layer's own resend of a request on a stale kept-alive one does not apply.
                self.close_connection = True
                return self.answer(201, json.dumps(v).encode(), close=True)
            if self.path.startswith("/v1/streams/1/next"):
                nexts.append(self.path.split("&", 1)[1])
                if len(nexts) == 1:
                    self.close_connection = True  # the answer is lost half way
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    self.wfile.write(b'{"lease": 7')
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                lease = 7 if nexts[-1] == "after=0" else 8
                v = {"lease": lease, "epoch": 0, "index": lease - 7, "shard": 0,
                     "tensors": [{"name": "x", "dtype": "uint8", "shape": [1], "offset": 0, "length": 1}]}
                return self.answer(200, json.dumps(v).encode())
            return self.answer(200, b'{"released": true}')

        def do_GET(self):
            return self.answer(200, b"\x05", "application/octet-stream")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Node)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        s = shardwire.connect_http(f"http://127.0.0.1:{srv.server_address[1]}").open_stream("d")
        b = s.next(timeout=10)
        assert b is not None and b.lease == 7 and not s.closed
        assert nexts == ["after=0", "after=0"], "asked again, naming no batch received"
        assert s.next(timeout=10).lease == 8
        assert nexts[2] == "after=7", nexts
    finally:
        srv.shutdown()


BIG_TENSOR = 48 << 20


def serve_big_tensor(procs: Procs, tmp_path: pathlib.Path) -> Serve:
    """A node on a source of dataset `big`: one shard of one 48 MiB uint8 tensor (its bytes
    the low bytes of 0, 1, 2, ...), in streams of 128 MiB."""
    big = tmp_path / "big"
    big.mkdir()
    np.save(big / "s0.npy", np.arange(BIG_TENSOR, dtype=np.uint64).astype(np.uint8))
    index(big)
    src = procs.source({"big": big})
    return procs.serve(src, tmp_path / "big.sock", opts=("--pool-size", "1GiB", "--stream-memory", "128MiB"))


def test_a_slow_tensor_download_keeps_its_stream_from_the_idle_reaper(procs: Procs, tmp_path: pathlib.Path):
    """A stream is in use while a tensor of it downloads, not only while the handler that
    started the download runs: a client reading a 48 MiB tensor slowly (here: not at all for
    5 s, then all of it) on a stream of idle_timeout_s=2 keeps the stream, its lease and its
    position. Before, the reaper closed it 1 to 1.5 s (idle_timeout_s=1) after the handler
    returned, mid-download:
    the release after it answered `not_found` and the batch's position was lost."""
    serve = serve_big_tensor(procs, tmp_path)
    # 2 s (not 1): the release and the listing after the download must reach the node within
    # it on a loaded machine; the 5 s without a read still outlast it and the reaper's tick.
    st, v = http_json(serve.admin, "POST", "/v1/streams", {"dataset": "big", "idle_timeout_s": 2})
    assert st == 201, v
    sid = v["stream"]
    st, b = http_json(serve.admin, "POST", f"/v1/streams/{sid}/next?timeout_ms=30000")
    assert st == 200, b
    (t,) = b["tensors"]
    head = f"GET /v1/leases/{b['lease']}/tensors/{t['name']} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    with F.connect(serve.admin, timeout=30) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        c.sendall(head.encode())
        time.sleep(5)  # reads nothing: the answer waits in the node
        got = bytearray()
        while chunk := c.recv(1 << 20):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200") and len(got) > 48 << 20, got[:200]
    st, v = http_json(serve.admin, "POST", f"/v1/leases/{b['lease']}/release")
    assert st == 200 and v == {"released": True}, v
    assert listed(serve.admin, sid) is not None


def memfd_bytes(pid: int) -> int:
    """Bytes of `pid`'s mappings of memfds (its host regions), from /proc/PID/maps."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def test_a_stream_closed_during_a_tensor_download_frees_its_region_at_once(procs: Procs, tmp_path: pathlib.Path):
    """The close of an HTTP stream frees its region while a tensor download of it is still
    under way (the download holds its own copy of the bytes), and the download ends whole.
    Before, the download's busy mark held the stream, so its region stayed mapped until the
    download ended, while its budget was already back in the pool: a client closing and
    opening streams under slow downloads held a region beyond pool_size each time."""
    serve = serve_big_tensor(procs, tmp_path)
    pid = serve.proc.popen.pid
    st, v = http_json(serve.admin, "POST", "/v1/streams", {"dataset": "big"})
    assert st == 201, v
    sid = v["stream"]
    st, b = http_json(serve.admin, "POST", f"/v1/streams/{sid}/next?timeout_ms=30000")
    assert st == 200, b
    (t,) = b["tensors"]
    mapped = memfd_bytes(pid)
    assert mapped >= 128 << 20, f"the stream's region is not a mapped memfd: {mapped} bytes"
    head = f"GET /v1/leases/{b['lease']}/tensors/{t['name']} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    with F.connect(serve.admin, timeout=30) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        c.sendall(head.encode())
        # The answer has begun (its bytes copied out of the region) and waits in the node:
        # its status line is peeked at, nothing is read.
        assert c.recv(12, socket.MSG_PEEK | socket.MSG_WAITALL) == b"HTTP/1.1 200"
        st, v = http_json(serve.admin, "POST", f"/v1/streams/{sid}/close")
        assert st == 200, v
        deadline = time.monotonic() + 5
        while memfd_bytes(pid) > mapped - (128 << 20) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = memfd_bytes(pid)
        assert left <= mapped - (128 << 20), f"{mapped} bytes of memfds mapped before the close, {left} after"
        got = bytearray()
        while chunk := c.recv(1 << 20):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200") and len(got) > 48 << 20, got[:200]
    body = bytes(got[got.index(b"\r\n\r\n") + 4:])
    assert body == np.arange(BIG_TENSOR, dtype=np.uint64).astype(np.uint8).tobytes(), "the download ended whole"


def test_a_tensor_download_or_release_whose_answer_is_lost_is_asked_again(world: World, monkeypatch):
    """A connection reset while a tensor's bytes arrive, or while the release's answer does:
    each is asked once more on a new connection (the release's answer then `unknown_lease`,
    the node having applied it: released), and the stream goes on with the same batch
    sequence. Before, one lost answer closed the stream on this side (`closed` from then on,
    `state_dict()` too) and left it open on the node until its idle timeout."""
    from shardwire import _http

    real_read, real_call, cut = _http._read_exactly, _http._call, {"read": 0, "release": 0}

    def flaky_read(r, n):
        cut["read"] += 1
        if cut["read"] == 2:
            raise ConnectionResetError("injected: reset while the body arrived")
        return real_read(r, n)

    def flaky_call(conn, method, path, *a, **kw):
        out = real_call(conn, method, path, *a, **kw)
        if "/release" in path:
            cut["release"] += 1
            if cut["release"] == 2:
                raise ConnectionResetError("injected: the release's answer was lost")
        return out

    monkeypatch.setattr(_http, "_read_exactly", flaky_read)
    monkeypatch.setattr(_http, "_call", flaky_call)
    got = []
    with world.http().open_stream("mix", seed=4) as s:
        for b in s:
            got.append((b.epoch, b.index))
        assert s.state_dict()["epoch"] == 1, "usable to the end: the state after the last batch"
    with world.sock().open_stream("mix", seed=4) as s:
        want = [(b.epoch, b.index) for b in s]
    assert got == want and cut["read"] > 2 and cut["release"] > 2


def test_an_interrupt_while_a_release_is_answered_loses_no_batch(world: World, monkeypatch):
    """Ctrl-C (or a signal handler's exception) strikes after the node applied a batch's
    release, before its answer was read: the batch, downloaded already, is handed out by the
    next call (its release sent again, answered `unknown_lease`: released). Before, the next
    `next` named the batch before it as received, the node (its lease gone) answered the one
    after it, and the batch was skipped."""
    from shardwire import _http

    real, hits = _http.HttpStream._request, {"n": 0}

    def interrupted(self, method, path, *a, **kw):
        out = real(self, method, path, *a, **kw)
        if "/release" in path:
            hits["n"] += 1
            if hits["n"] == 3:
                raise KeyboardInterrupt("injected after the release was applied")
        return out

    got = []
    with world.http().open_stream("mix", seed=4) as s:
        monkeypatch.setattr(_http.HttpStream, "_request", interrupted)
        while True:
            try:
                b = s.next(timeout=30)
            except KeyboardInterrupt:
                # A checkpoint now resumes at the batch not yet handed out, not after it.
                assert s.state_dict()["index"] == len(got), s.state_dict()
                continue
            if b is None:
                break
            got.append((b.epoch, b.index))
    with world.sock().open_stream("mix", seed=4) as s:
        want = [(b.epoch, b.index) for b in s]
    assert got == want and hits["n"] > 3


def test_an_open_answer_without_its_fields_is_a_protocol_error_and_the_stream_is_closed():
    """A `201` whose body lacks a field (a node of another release, a proxy): ProtocolError
    naming it, and the stream the node may have opened is closed. Before, a KeyError, and the
    stream held its memory on the node until its idle timeout."""
    closes: list[str] = []

    class Node(_FakeNode):
        def do_GET(self):
            return self.answer(200, b"ok\n", "text/plain")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/v1/streams":
                return self.answer(201, b'{"stream": 9, "epochs": 1}')
            closes.append(self.path)
            return self.answer(200, b'{"stream": 9, "closed": true}')

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Node)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = shardwire.connect_http(f"http://127.0.0.1:{srv.server_address[1]}")
        with pytest.raises(shardwire.ProtocolError) as e:
            c.open_stream("d")
        assert "batches_per_epoch" in str(e.value)
        assert closes == ["/v1/streams/9/close"]
    finally:
        srv.shutdown()


def test_an_interrupt_while_a_socket_reply_is_decoded_loses_no_batch(world: World, monkeypatch):
    """Ctrl-C (or a signal handler's exception) strikes while a reply that arrived whole is
    decoded: the reply is taken by the next call. Before, its bytes were gone while the
    request stayed waiting for them: the next call waited for an answer already read."""
    from shardwire import _wire

    real, hits = _wire._decode, {"n": 0}

    def interrupted(body):
        hits["n"] += 1
        if hits["n"] % 3 == 0:
            raise KeyboardInterrupt("injected while decoding a reply")
        return real(body)

    got = []
    with world.sock().open_stream("mix", seed=5) as s:
        monkeypatch.setattr(_wire, "_decode", interrupted)
        while True:
            try:
                b = s.next(timeout=30)
            except KeyboardInterrupt:
                continue
            if b is None:
                break
            got.append((b.epoch, b.index))
    monkeypatch.setattr(_wire, "_decode", real)
    with world.sock().open_stream("mix", seed=5) as s:
        want = [(b.epoch, b.index) for b in s]
    assert got == want and hits["n"] > 3


def test_an_http_stream_used_in_a_forked_child_refuses_and_its_close_leaves_the_parents(world: World):
    """The fork check of both transports: over HTTP the child would take the parent's batches
    from the service's stream, and its close() would close that stream on the service."""
    with world.http().open_stream("mix", seed=6) as s:
        first = s.next(timeout=30)
        said = next_in_forked_child(s)
        assert said.startswith("forked: "), said
        rest = [(b.epoch, b.index) for b in s]
    with world.sock().open_stream("mix", seed=6) as t:
        want = [(b.epoch, b.index) for b in t]
    assert [(first.epoch, first.index)] + rest == want, "the parent's stream went on, whole"
