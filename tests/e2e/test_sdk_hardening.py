"""The Python SDK against fake nodes that misbehave, or trainers that call it from awkward places
(a socketpair or a Unix socket the test plays the node on, or a small HTTP server):

- `state_dict()`, `_snapshot()` and `keep()` from a signal handler that interrupted this
  stream's own `next` (a SIGTERM handler saving a checkpoint) return instead of waiting for
  ever for the lock their own thread holds; over HTTP, where the state takes a request on the
  connection the interrupted call uses, `state_dict()` raises `reentrant` at once;
- a huge `next` timeout (sys.maxsize, 1e306, 2**70 s) saturates at u64::MAX ms, as in Rust;
- a tensor of a kept batch keeps the batch's lease (and its stream) while it lives, after its
  batch was dropped (host numpy tensors and CudaTensors);
- an `attached` reply with a bad `gpu` object, a malformed HTTP batch answer, a JSON reply
  nested too deeply to decode, integer fields that are bools, floats or strings: ProtocolError
  naming the field and value (a socket stream is then closed, its leases released);
- an answer to a `release` that is not `released` closes the stream (as Rust's `broke`);
- a reply trickled a byte at a time fails after FRAME_LIMIT from its first byte (a deadline
  per frame, as Rust's), not FRAME_LIMIT per chunk;
- `state_dict()`, `_snapshot()` and `keep()` in a forked child raise `forked`;
- a stream dropped without `close()` ends on the node at once while a forked child holds a copy
  of its socket; a connect the kernel denies names the socket's real mode and owner, or the
  directory that cannot be searched, or, where the mode allows this process, says that
  something else (a security module, a namespace) denies it; a connect to a node whose backlog stays full (stopped)
  fails after CONNECT_LIMIT instead of waiting for ever;
- a legacy DLPack request (JAX's) for a view that is not C-contiguous gets a capsule of the
  same memory with the view's strides.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
import shardwire  # noqa: E402
from shardwire import _binary, _client, _cuda, _http, _wire  # noqa: E402
from shardwire._errors import ConnectionClosed, ProtocolError  # noqa: E402
from shardwire._types import StreamInfo  # noqa: E402
from test_binary_frames import fake_service, framed  # noqa: E402
from test_sdk_recovery import (  # noqa: E402
    REGION,
    attached,
    batch,
    first_batch,
    interrupt,  # noqa: F401 - a fixture
    no_gc,  # noqa: F401 - a fixture
    pair,  # noqa: F401 - a fixture
    requests,
)

U64_MAX = 2**64 - 1
STATE = {"epoch": 0, "index": 0, "seed": 1, "fingerprint": "f"}


class Hung(Exception):
    """Raised into a call that waits too long (not an OSError, which the SDK would take for a
    failed connection)."""


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raises Hung in the main thread if the block is still running after `seconds`
    (a call that waits for a lock its own thread holds would otherwise hang the test run)."""

    def hung(*_: Any) -> None:
        raise Hung(f"still waiting after {seconds} s: the call hung")

    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    old = signal.signal(signal.SIGUSR1, hung)
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, old)


def closes(node: socket.socket, wait: float = 5.0) -> bool:
    """True once the stream closed its end of the connection (whatever it sent before)."""
    node.settimeout(wait)
    try:
        while node.recv(1 << 16):
            pass
    except OSError:  # a timeout: still open
        return False
    return True


# --- 1. state_dict / keep from a signal handler ---------------------------------------------


def test_state_dict_snapshot_and_keep_from_a_signal_handler_that_interrupted_next(pair):
    """A SIGALRM handler runs while `next` waits (holding the stream's lock) and takes the
    state, its snapshot, and keeps the previous batch: before, each waited for ever for the
    lock its own thread held. The state is the trainer's (after batch 0); the kept batch
    stays leased after the next hand-out."""
    s, node = pair
    b0 = first_batch(s, node)  # a `next` asked ahead is in flight: the next call only waits
    got: dict[str, Any] = {}

    def on_alarm(*_: Any) -> None:
        got["state"] = s.state_dict()
        got["snapshot"] = s._snapshot()
        got["kept"] = b0.keep()
        raise KeyboardInterrupt("ends the wait, as a handler that saved a checkpoint might")

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with bounded(5):
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                s.next(timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert got["state"] == {"epoch": 0, "index": 1, "seed": 1, "fingerprint": "f"}
    assert json.loads(got["snapshot"]) == got["state"]
    assert got["kept"] is b0 and b0.kept and not b0.released
    assert not s.closed
    node.sendall(batch(1))
    assert s.next(timeout=10).lease == 2
    assert requests(node) == [], "batch 0 was kept in the handler: not released"
    assert s.state_dict()["index"] == 2


def test_the_state_from_a_handler_during_a_hand_out_is_the_trainers(pair):
    """A handler that runs while `next` hands a batch out (after its state arrived, before the
    call returns) gets the state before that batch: the trainer does not have it yet."""
    s, node = pair
    first_batch(s, node)
    seen: list[dict[str, Any]] = []
    real = s._after_take

    def after_take(msg: dict[str, Any], prev: Any) -> None:
        seen.append(s.state_dict())  # as a handler would, with the lock held by this thread
        real(msg, prev)

    s._after_take = after_take  # type: ignore[method-assign]
    node.sendall(batch(1))
    with bounded(5):
        assert s.next(timeout=10).lease == 2
    assert [st["index"] for st in seen] == [1], "batch 1 is not the trainer's until next() returns"
    assert s.state_dict()["index"] == 2


class _Node(BaseHTTPRequestHandler):
    """A small HTTP server's handler playing the node: opens stream 1; `NEXT` is the body of
    every `next` answer (a batch of one uint8[4] tensor `x` with lease 7 by default)."""

    protocol_version = "HTTP/1.1"
    NEXT: bytes = json.dumps({"lease": 7, "epoch": 0, "index": 0, "shard": 0, "tensors": [
        {"name": "x", "dtype": "uint8", "shape": [4], "offset": 0, "length": 4}]}).encode()
    STATE_BODY: bytes = json.dumps(STATE).encode()
    seen: list[str]

    def log_message(self, *a: Any) -> None:
        pass

    def answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            return self.answer(200, b"ok", "text/plain")
        self.seen.append(f"GET {self.path}")
        if self.path.startswith("/v1/streams/1/state"):
            return self.answer(200, self.STATE_BODY)
        return self.answer(200, b"\x01\x02\x03\x04", "application/octet-stream")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(f"POST {self.path}")
        if self.path == "/v1/streams":
            v = {"stream": 1, "batches_per_epoch": 1, "epochs": 1, "state": STATE, "idle_timeout_s": 300}
            return self.answer(201, json.dumps(v).encode())
        if self.path.startswith("/v1/streams/1/next"):
            return self.answer(200, self.NEXT)
        return self.answer(200, b'{"released": true}')


@contextmanager
def http_node(next_body: bytes | None = None,
              state_body: bytes | None = None) -> Iterator[tuple[shardwire.HttpStream, list[str]]]:
    """An HttpStream opened on a fake node (see `_Node`), and the requests the node saw."""
    seen: list[str] = []
    attrs: dict[str, Any] = {"seen": seen}
    if next_body is not None:
        attrs["NEXT"] = next_body
    if state_body is not None:
        attrs["STATE_BODY"] = state_body
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type("Node", (_Node,), attrs))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        s = shardwire.connect_http(f"127.0.0.1:{srv.server_address[1]}").open_stream("d")
        yield s, seen
        s.close()
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("body", [b"[1, 2]", b'"state"', b"7"])
def test_an_http_state_that_is_not_an_object_is_a_protocol_error(body):
    """Before, `dict(r.json())` raised a bare TypeError or ValueError."""
    with http_node(state_body=body) as (s, _):
        with pytest.raises(ProtocolError, match="not a JSON object"):
            s.state_dict()


def test_an_http_state_dict_from_a_handler_that_interrupted_the_stream_raises_reentrant():
    """Over HTTP the state takes a request, on the connection the interrupted call uses: a
    handler's `state_dict()` raises `reentrant` at once (before, it waited for ever)."""
    with http_node() as (s, seen):
        s._lock.raw.acquire()  # as `next` holds it when the handler interrupts it
        try:
            with bounded(5):
                for call in (s.state_dict, s._snapshot):
                    with pytest.raises(shardwire.ShardwireError) as e:
                        call()
                    assert e.value.code == "reentrant" and "signal handler" in e.value.message, e.value
        finally:
            s._lock.raw.release()
        assert s.state_dict() == STATE, "outside the handler it asks the node"


# --- 2. huge timeouts --------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [sys.maxsize, 1e306, 2**70, U64_MAX / 1000])
def test_a_huge_timeout_saturates_at_u64_max_milliseconds(pair, timeout):
    """Before: sys.maxsize s sent timeout_ms 9223372036854775807000, past u64 (the node answers
    `bad_request` and closes the stream); 1e306 raised OverflowError after the request went."""
    s, node = pair
    node.sendall(batch(0))
    assert s.next(timeout=timeout).lease == 1
    sent = requests(node)
    assert sent[0] == {"op": "next", "timeout_ms": U64_MAX, "count": 8}, sent
    assert not s.closed


def test_timeout_ms_rounds_up_and_saturates():
    from shardwire._types import _timeout_ms

    assert [_timeout_ms(t) for t in (0, 0.0005, 0.002, 1.5, 3e6)] == [0, 1, 2, 1500, 3_000_000_000]
    assert [_timeout_ms(t) for t in (sys.maxsize, 1e306, 2**70, float("inf"), U64_MAX / 1000)] == [U64_MAX] * 5


def test_an_http_next_with_a_huge_timeout_long_polls():
    """Before: OverflowError (`math.ceil(1e306 * 1000)` is ceil(inf))."""
    with http_node() as (s, seen):
        b = s.next(timeout=1e306)
        assert b.lease == 7 and list(b["x"]) == [1, 2, 3, 4]
        assert any(r.startswith("POST /v1/streams/1/next?timeout_ms=30000&") for r in seen), seen


# --- 3. a tensor keeps its batch's lease ---------------------------------------------------------


class _FakeCudaRegion(_cuda.CudaRegion):
    """A CudaRegion without a driver: device pointers that are never dereferenced."""

    def __init__(self, size: int) -> None:  # noqa: D107 - no driver call
        self._closed = False
        self._lock = threading.Lock()
        self.size, self.granularity, self.ptr, self.device = size, size, 1 << 40, 0
        self.pci_bus_id, self.access = "0000:00:00.0", "read"

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True


def attached_to(memory: str) -> tuple[_client.Stream, socket.socket]:
    """:func:`attached` for host memory; for "cuda" the same over a fake CUDA region."""
    if memory == "host":
        return attached()
    a, node = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    info = StreamInfo(stream=1, region_size=REGION, batches_per_epoch=10, epochs=1, memory="cuda", state=dict(STATE))
    return _client.Stream(_wire.Conn(a), _FakeCudaRegion(REGION), info), node


def released(sent: list[dict[str, Any]] | None) -> list[int]:
    """The leases the requests `sent` release (in `next`'s list or on their own)."""
    return [x for r in sent or [] for x in (r.get("release", []) if r["op"] == "next" else [r["lease"]])]


#: What the trainer keeps of a kept batch's tensor `x`: the tensor, a plain-ndarray view of it
#: (numpy would collapse its base past the tensor onto the region's byte array), or what a
#: DLPack consumer makes of it.
KEEP: dict[str, Callable[[Any], Any]] = {"tensor": lambda x: x, "asarray": np.asarray, "dlpack": np.from_dlpack}


@pytest.mark.parametrize("memory, keep", [("host", "tensor"), ("host", "asarray"), ("host", "dlpack"), ("cuda", "tensor")])
def test_a_tensor_of_a_kept_batch_keeps_its_lease_after_the_batch_is_dropped(memory, keep):
    """`x = stream.next().keep()["x"]`: before, the batch was collected at once and its
    lease released with the next request while `x` still viewed its bytes. Now the lease
    is released once the last tensor (or view of one) is gone too; and a tensor keeps its
    stream open, as a batch does (closing the connection would release every lease)."""
    s, node = attached_to(memory)
    with node:
        node.sendall(batch(0))
        x = KEEP[keep](s.next(timeout=10).keep()["x"])
        if keep == "tensor":
            assert isinstance(x, shardwire.Tensor if memory == "host" else shardwire.CudaTensor)
        gc.collect()
        for k in (1, 2):
            node.sendall(batch(k))
            assert s.next(timeout=10).lease == k + 1
        sent = requests(node)
        assert 1 not in released(sent), f"lease 1 released while a tensor views it: {sent}"
        assert 2 in released(sent)
        # The stream is dropped: the tensor (its only user) keeps it and the lease.
        del s
        gc.collect()
        assert requests(node) == [], "the connection closed while a tensor of a kept batch lives"
        del x
        gc.collect()
        assert requests(node) is None, "the last tensor gone, the stream goes"


def test_the_lease_of_a_kept_batch_goes_with_the_next_request_once_its_tensors_are_gone(pair, no_gc):
    s, node = pair
    node.sendall(batch(0))
    y = s.next(timeout=10).keep()["x"][1:]  # a view of the tensor keeps it too
    node.sendall(batch(1))
    s.next(timeout=10)
    assert 1 not in released(requests(node))
    del y  # reference counts alone free it (no cycle through the batch)
    node.sendall(batch(2))
    s.next(timeout=10)
    assert 1 in released(requests(node))


# --- 4. a bad gpu object -------------------------------------------------------------------------


@pytest.mark.parametrize("gpu, why", [
    ({"ordinal": 0, "pci_bus_id": "0000:19:00.0", "granularity": None}, "the field gpu.granularity is None"),
    ({"ordinal": 0, "pci_bus_id": "0000:19:00.0", "granularity": "2097152"}, "the field gpu.granularity is '2097152'"),
    ({"ordinal": 0, "pci_bus_id": "0000:19:00.0", "granularity": 2097152.0}, r"the field gpu.granularity is 2097152\.0"),
    ({"ordinal": 0, "pci_bus_id": None, "granularity": 2097152}, "the field gpu.pci_bus_id is None"),
])
def test_an_attached_with_a_bad_gpu_object_is_a_protocol_error(tmp_path, gpu, why):
    """docs/TRAINER_API.md: "an `attached` with `memory = "cuda"` but no usable `gpu` object is
    a `ProtocolError`". Before, `"granularity": null` raised a bare TypeError."""
    # A region the granularity divides: the SDK's own check would not tell the bad gpu object.
    reply = {"op": "attached", "stream": 1, "region_size": 2097152, "batches_per_epoch": 3, "epochs": 1,
             "memory": "cuda", "state": STATE, "gpu": gpu}
    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, lambda c, conn: None, attached=reply)
    with pytest.raises(ProtocolError, match=why):
        shardwire.connect(path).open_stream("d")
    t.join(10)
    srv.close()


# --- 5. a malformed HTTP batch answer -----------------------------------------------------------


TENSOR = {"name": "x", "dtype": "uint8", "shape": [4], "offset": 0, "length": 4}


@pytest.mark.parametrize("body, why", [
    ({"lease": 7, "epoch": 0, "index": 0, "shard": 0}, "tensors"),  # KeyError before
    ({"lease": 7, "epoch": 0, "index": 0, "shard": 0, "tensors": [5]}, "an entry of tensors is 5"),  # TypeError
    ([1, 2], "not an object"),  # AttributeError (`v.get`)
    ({"lease": 7, "index": 0, "shard": 0, "tensors": [TENSOR]}, "epoch"),  # KeyError after the download
    ({"lease": 7, "epoch": None, "index": 0, "shard": 0, "tensors": [TENSOR]}, "epoch"),  # TypeError
    ({"lease": 7, "epoch": 0, "index": 0, "shard": 0, "tensors": [{**TENSOR, "shape": None}]}, "shape"),
])
def test_a_malformed_http_batch_answer_is_a_protocol_error(body, why):
    with http_node(json.dumps(body).encode()) as (s, seen):
        with pytest.raises(ProtocolError, match=why):
            s.next(timeout=10)
        assert not any(r.startswith("GET /v1/leases") for r in seen), "nothing downloaded for a malformed batch"


# --- 6. JSON nested too deeply -------------------------------------------------------------------


@pytest.mark.parametrize("depth", [60_000, 200_000])  # one receive (the fast path), or several
def test_a_reply_nested_too_deeply_is_a_protocol_error_and_closes_the_stream(pair, depth):
    """Before: RecursionError, and the reply's bytes stayed buffered, so every later call
    raised it again."""
    s, node = pair
    b0 = first_batch(s, node)
    node.sendall(framed(b"[" * depth))
    with pytest.raises(ProtocolError, match="nested too deeply"):
        s.next(timeout=10)
    assert s.closed and b0.released and requests(node, wait=5) is None
    with pytest.raises(shardwire.ShardwireError) as e:
        s.next(timeout=1)
    assert e.value.code == "closed" and "nested too deeply" in e.value.message


def test_a_state_or_http_answer_nested_too_deeply_is_a_protocol_error():
    deep = b"[" * 200_000
    with pytest.raises(ProtocolError, match="nested too deeply"):
        _binary.decode_state(deep)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        _http._Reply(200, None, deep).json()  # type: ignore[arg-type]
    assert isinstance(_http._Reply(500, None, deep).error(), ProtocolError)  # type: ignore[arg-type]


def attach_service(path: str, attach: Callable[[socket.socket], None]) -> tuple[socket.socket, threading.Thread]:
    """A fake node at `path` for one connection: it answers `info` (host memory), then calls
    `attach` with the socket to answer the `attach`, then waits for the client to close."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(30)

    def serve() -> None:
        c, _ = srv.accept()
        conn = _wire.Conn(c)
        while conn.recv()[0]["op"] == "info":
            conn.send({"op": "info", "memory": "host", "lanes": []})
        attach(c)
        c.recv(1)
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_an_attached_nested_too_deeply_is_a_protocol_error(tmp_path):
    path = str(tmp_path / "fake.sock")
    srv, t = attach_service(path, lambda c: c.sendall(framed(b"[" * 200_000)))
    with pytest.raises(ProtocolError, match="nested too deeply"):
        shardwire.connect(path).open_stream("d")
    t.join(10)
    srv.close()


# --- 7. strict integers ----------------------------------------------------------------------------


GOOD = {"op": "batch", "lease": 2, "epoch": 0, "index": 1, "shard": 0, "state": STATE,
        "tensors": [{"name": "x", "dtype": "float32", "shape": [4, 8], "offset": 4096, "length": 128}]}


@pytest.mark.parametrize("field, value", [
    ("lease", True), ("epoch", 0.0), ("index", "1"), ("shard", False),
    ("shape", ["4", 8]), ("shape", [4.0, 8]), ("offset", 4096.0), ("length", True),
])
def test_json_batch_integers_that_are_bools_floats_or_strings_are_protocol_errors(pair, field, value):
    """Before, `int()` took them: `"lease": true` became lease 1."""
    s, node = pair
    first_batch(s, node)
    bad = json.loads(json.dumps(GOOD))
    if field in bad:
        bad[field] = value
    else:
        bad["tensors"][0][field] = value
    node.sendall(framed(json.dumps(bad).encode()))
    with pytest.raises(ProtocolError, match=field) as e:
        s.next(timeout=10)
    assert repr(value if field != "shape" else value[0]) in e.value.message, e.value
    assert s.closed


@pytest.mark.parametrize("field, value", [("stream", True), ("region_size", 65536.0), ("epochs", "1")])
def test_attached_integers_that_are_bools_floats_or_strings_are_protocol_errors(tmp_path, field, value):
    reply = {"op": "attached", "stream": 1, "region_size": 1 << 16, "batches_per_epoch": 3, "epochs": 1,
             "memory": "host", "state": STATE, field: value}
    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, lambda c, conn: None, attached=reply)
    with pytest.raises(ProtocolError, match=field) as e:
        shardwire.connect(path).open_stream("d")
    assert repr(value) in e.value.message
    t.join(10)
    srv.close()


# --- 8. an unexpected answer to a release ------------------------------------------------------


def test_an_unexpected_answer_to_a_release_closes_the_stream(pair):
    """`release()` with nothing in flight waits for its answer; an `end` instead cannot be
    matched to any request: ProtocolError, and (now) the stream is closed, as for any reply it
    cannot read. Before, the stream went on, reading later answers as the wrong requests'."""
    s, node = pair
    b0 = first_batch(s, node).keep()
    node.sendall(batch(1))
    s.next(timeout=10).keep()
    assert requests(node) == []
    node.sendall(framed(b'{"op":"end"}'))
    with pytest.raises(ProtocolError, match="unexpected answer to release"):
        b0.release()
    assert s.closed and closes(node)
    with pytest.raises(shardwire.ShardwireError) as e:
        s.next(timeout=1)
    assert e.value.code == "closed" and "unexpected answer to release" in e.value.message


def test_an_unexpected_answer_to_a_release_sent_behind_a_next_closes_the_stream(pair, interrupt):
    """The release rides behind a `next` in flight; its answer, read later by another
    release, is a batch: ProtocolError and the stream is closed."""
    s, node = pair
    b0 = first_batch(s, node).keep()
    node.sendall(batch(1))
    b1 = s.next(timeout=10).keep()
    interrupt(0.3, node)
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=30)  # its request stays in flight
    b0.release()  # sent behind it
    assert requests(node) == [{"op": "next", "timeout_ms": 30000}, {"op": "release", "lease": 1}]
    node.sendall(batch(2) + batch(3))  # the second answers the release
    assert s.next(timeout=10).lease == 3
    with pytest.raises(ProtocolError, match="unexpected answer to release"):
        b1.release()  # reads the release's answer first
    assert s.closed and closes(node)


# --- 9. one deadline per frame ---------------------------------------------------------------------


def trickle(sock: socket.socket, data: bytes, pieces: int, every: float) -> threading.Thread:
    """Sends `data` in `pieces` pieces, one every `every` s (until the peer goes)."""

    def run() -> None:
        step = -(-len(data) // pieces)
        try:
            for k in range(0, len(data), step):
                if k:
                    time.sleep(every)
                sock.sendall(data[k : k + step])
        except OSError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_reply_trickled_piece_by_piece_fails_after_the_frame_limit(pair, monkeypatch):
    """A batch reply that takes 2.75 s to arrive, in 12 pieces 0.25 s apart, with FRAME_LIMIT
    1 s: before, each wait was under the limit and the batch was handed out; now the frame
    fails 1 s after its first bytes (ConnectionClosed) and the stream is closed."""
    monkeypatch.setattr(_wire, "FRAME_LIMIT", 1.0)
    s, node = pair
    first_batch(s, node)
    t = trickle(node, batch(1), 12, 0.25)
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="not the rest within 1 s"):
        s.next(timeout=30)
    # (the trickle itself ends after 2.75 s: a batch handed out then fails the raises above;
    # this bound is loose for a loaded machine, and still far under the 30 s timeout)
    assert time.monotonic() - t0 < 10
    assert s.closed
    t.join(10)


def test_an_attached_trickled_piece_by_piece_fails_after_the_frame_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(_wire, "FRAME_LIMIT", 1.0)
    path = str(tmp_path / "fake.sock")
    reply = _wire.encode({"op": "attached", "stream": 1, "region_size": 1 << 16, "batches_per_epoch": 3,
                          "epochs": 1, "memory": "host", "state": STATE})
    done: list[threading.Thread] = []

    def attach(c: socket.socket) -> None:
        fd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 16)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # as the node's
        socket.send_fds(c, [reply[:6]], [fd])
        os.close(fd)
        done.append(trickle(c, reply[6:], 12, 0.25))
        done[0].join()

    srv, t = attach_service(path, attach)
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="not the rest within 1 s"):
        shardwire.connect(path).open_stream("d")
    assert time.monotonic() - t0 < 10  # loose, for a loaded machine: the raises above is the check
    t.join(30)
    srv.close()


# --- 10. a forked child -----------------------------------------------------------------------------


def in_forked_child(call: Callable[[], object]) -> str:
    """`call()` in a child forked now: ``served`` or the error's ``code: message``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(r)
        try:
            call()
            os.write(w, b"served")
        except BaseException as e:  # noqa: BLE001 - reported to the parent, whatever it is
            os.write(w, f"{getattr(e, 'code', type(e).__name__)}: {getattr(e, 'message', e)}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    said = os.read(r, 4096).decode()
    os.close(r)
    return said


def test_state_dict_snapshot_and_keep_in_a_forked_child_refuse(pair):
    s, node = pair
    b0 = first_batch(s, node)
    for call in (s.state_dict, s._snapshot, b0.keep):
        said = in_forked_child(call)
        assert said.startswith("forked: ") and f"process {os.getpid()}" in said, (call, said)
    node.sendall(batch(1))
    assert s.next(timeout=10).lease == 2 and s.state_dict()["index"] == 2, "the parent's stream goes on"


def test_the_stream_locks_owner_is_known_the_moment_it_is_taken():
    """A signal handler that runs right after the stream's lock was taken (between the acquire
    and the next bytecode) must see that its own thread holds it: with the owner kept beside
    a plain lock, set a few bytecodes later, its state_dict()/keep()/close() waited for ever."""
    from shardwire._types import _OwnedLock

    lock = _OwnedLock()
    lock.raw.acquire()  # the acquire itself, as a handler that runs right after it sees it
    assert lock.held_here() and lock.locked()
    with pytest.raises(RuntimeError, match="taken twice"):
        lock.refuse_here()  # a second wait would never end (or take the RLock twice)
    lock.raw.release()
    assert not lock.locked() and not lock.raw._is_owned(), "locked() took nothing"
    lock.refuse_here()  # not held: nothing to refuse

    def other() -> None:
        with lock.raw:
            seen.append((lock.held_here(), lock.locked()))

    seen: list[tuple[bool, bool]] = []
    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert seen == [(True, True)] and not lock.held_here() and not lock.locked()


# --- a legacy DLPack consumer and a view that is not contiguous ---------------------------------


@pytest.mark.parametrize("view", ["every other column", "transposed", "rows reversed"])
def test_a_legacy_dlpack_import_of_a_non_contiguous_view_shares_its_memory(view):
    """JAX (0.10) calls ``__dlpack__()`` without ``max_version``: the SDK answers with a capsule
    of the same memory, which it built only for C-contiguous tensors; a slice, a transpose or a
    reversed view raised numpy's ``BufferError: Cannot export readonly array``. DLPack carries
    strides: the capsule has the view's. (numpy reads it here, as JAX would.)"""
    from shardwire._tensor import Tensor

    region = np.arange(24, dtype=np.float32).tobytes()  # read-only, as the mapped region
    t = Tensor((4, 6), np.float32, buffer=region)
    v = {"every other column": lambda: t[:, ::2], "transposed": lambda: t.T, "rows reversed": lambda: t[::-1, 1:]}[view]()
    assert not v.flags.writeable and not v.flags.c_contiguous
    capsule = v.__dlpack__()  # the legacy request

    class Legacy:
        def __dlpack__(self, **_: Any) -> Any:
            return capsule

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    got = np.from_dlpack(Legacy())
    assert np.array_equal(got, v) and got.strides == v.strides
    assert got.__array_interface__["data"][0] == v.__array_interface__["data"][0], "no copy"


# --- 11. connecting, and dropping a stream a forked child holds a copy of -----------------------


def test_a_dropped_stream_ends_on_the_node_while_a_forked_child_holds_its_socket(no_gc):
    """A DataLoader worker forked after the open holds a copy of the stream's socket. Dropping
    the stream without close() still ends it on the node at once (its connection is shut down,
    not only this process's copy closed); before, the node saw no end (its leases and stream
    memory stayed held) until the child exited. A child that drops its own copy of the stream
    leaves the parent's alone."""
    s, node = attached()
    with node:
        node.sendall(batch(0))
        assert s.next(timeout=10).lease == 1
        pid = os.fork()
        if pid == 0:  # the child drops its copy of the stream
            del s
            os._exit(0)
        os.waitpid(pid, 0)
        node.sendall(batch(1))
        assert s.next(timeout=10).lease == 2, "the child's drop ended the parent's stream"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child holds its copy of the socket until told to go
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
        try:
            del s
            assert closes(node, wait=2), "the node saw no end of the dropped stream while the child lived"
        finally:
            os.close(w)
            os.waitpid(pid, 0)


@pytest.fixture
def open_dir() -> Iterator[str]:
    """A directory any user may search (pytest's tmp_path is in one only its owner may)."""
    d = tempfile.mkdtemp(prefix="shardwire-perm-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def connect_as_nobody(path: str) -> str:
    """What `_client._connect(path)` raises in a child that dropped to user and group 65534
    (``code: message``), where the kernel checks the permissions this root test bypasses."""

    def connect() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        _client._connect(path)

    return in_forked_child(connect)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to drop to another user in a child")
@pytest.mark.parametrize("where", ["the socket's mode", "a directory above it"])
def test_a_denied_connect_says_what_denies_it(open_dir, where):
    """Before, the message always said the socket was mode 0660 and to run as the service's
    user or group, whatever its mode (``socket_mode = "0600"``) or a directory on the way."""
    sub = os.path.join(open_dir, "run")
    os.mkdir(sub)
    path = os.path.join(sub, "trainer.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with srv:
        srv.bind(path)
        srv.listen(1)
        os.chmod(path, 0o600)
        os.chmod(sub, 0o755 if where == "the socket's mode" else 0o700)
        said = connect_as_nobody(path)
    assert said.startswith("connect: ") and "permission denied" in said and "0660" not in said, said
    if where == "the socket's mode":
        assert "mode 0600, owner uid 0, group gid 0" in said and "uid 65534" in said, said
        assert "set socket_mode" in said and "the mode allows" not in said, said
    else:
        assert f"the directory {sub} cannot be searched" in said, said


def test_a_connect_denied_where_the_mode_allows_it_does_not_blame_the_mode(open_dir, monkeypatch):
    """A security module (SELinux, AppArmor), a seccomp filter or a namespace refuses the
    connect of a socket whose mode lets this process write (mode 0666; the refusal made here
    by the connect failing with EACCES). Before, the message said to run as a user or group
    the mode lets write, or to change socket_mode: a mode that already allowed it."""
    path = os.path.join(open_dir, "trainer.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with srv:
        srv.bind(path)
        srv.listen(1)
        os.chmod(path, 0o666)

        def refused(self: socket.socket, address: Any) -> None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(socket.socket, "connect", refused)
        with pytest.raises(shardwire.ConnectError) as e:
            _client._connect(path)
    said = e.value.message
    assert "permission denied" in said and "mode 0666" in said and f"uid {os.geteuid()}" in said, said
    assert "the mode allows this process" in said and "SELinux/AppArmor" in said, said
    assert "run as a user or group" not in said and "set socket_mode" not in said, said


def test_a_connect_the_node_does_not_take_fails_after_the_connect_limit(tmp_path, monkeypatch):
    """A node that takes no connections (stopped with SIGSTOP, or stuck) with its listen
    backlog full: the connect fails after CONNECT_LIMIT, saying so. Before, it waited for
    ever (no ConnectError, no NoAnswer)."""
    path = str(tmp_path / "stopped.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    queued = []
    try:
        while True:  # fill the backlog: connections the node never takes
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            queued.append(c)
        monkeypatch.setattr(_client, "CONNECT_LIMIT", 0.3)
        started = time.monotonic()
        with bounded(10), pytest.raises(shardwire.ConnectError, match="took no connection within 0.3 s"):
            _client._connect(path)
        assert time.monotonic() - started >= 0.25, "it did not wait for the node"
        srv.accept()[0].close()  # room in the backlog: the next connect goes through, unbounded
        sock = _client._connect(path)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.calcsize("@ll")) == bytes(struct.calcsize("@ll"))
        sock.close()
    finally:
        for c in queued:
            c.close()
        srv.close()
