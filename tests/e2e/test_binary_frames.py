"""Binary `batch` frames (attach `batch_encoding: "binary"`, docs/TRAINER_API.md "Binary batch
frames") against the real node: the same stream asked for in JSON and in binary describes the
same batches and states; the layout the docs give is what the SDK reads; a malformed binary
reply raises ProtocolError naming what is wrong.

    shardwire index DIR -> shardwire source -> shardwire serve -> raw trainer connections
"""

from __future__ import annotations

import json
import pathlib
import socket
import struct
from collections import deque
from typing import Any

import pytest

from sdk_harness import SHARDS, Procs, index, write_mix  # puts the SDK on sys.path
from shardwire import _binary, _wire  # noqa: E402
from shardwire._errors import ProtocolError  # noqa: E402


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("binary")
    procs = Procs(tmp)
    try:
        mix = tmp / "mix"
        write_mix(mix, seed=3)
        assert len(index(mix)["shards"]) == SHARDS
        serve = procs.serve(procs.source({"mix": mix}), tmp / "sw.sock")
        yield serve.socket
    finally:
        procs.close()


def replies(path: str, encoding: str | None, **fields: Any) -> list[tuple[dict[str, Any], bytes]]:
    """Every batch of one stream over a raw connection: (decoded reply, raw body)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    conn = _wire.Conn(s)
    try:
        req = {"op": "attach", "version": 1, "dataset": "mix", "seed": 5, "epochs": 2, "batch_state": True, **fields}
        if encoding is not None:
            req["batch_encoding"] = encoding
        conn.send(req)
        msg, fds = conn.recv(want_fds=True)
        _wire._close_fds(fds)
        assert msg["op"] == "attached", msg
        out = []
        conn.send_bytes(_wire.encode_next(()))
        while True:
            (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
            body = s.recv(n, socket.MSG_WAITALL)
            msg = _wire._decode(body)
            if msg["op"] == "end":
                return out
            assert msg["op"] == "batch", msg
            out.append((msg, body))
            conn.send_bytes(_wire.encode_next((msg["lease"],)))
    finally:
        conn.close()


def test_binary_and_json_describe_the_same_batches(sock: str):
    """Shard mode, two epochs (batch mode goes through binary frames in every SDK test of
    test_batches_sdk.py, test_tokens.py and test_mix.py)."""
    js = replies(sock, None)
    bs = replies(sock, "binary")
    assert len(js) == len(bs) == 2 * SHARDS
    for (j, jbody), (b, bbody) in zip(js, bs):
        assert jbody[:1] == b"{" and bbody[:1] == bytes([_binary.TAG])
        for k in ("epoch", "index", "shard"):
            assert j[k] == b[k], (k, j, b)
        want = [(t["name"], t["dtype"], tuple(t["shape"]), t["length"]) for t in j["tensors"]]
        got = [(v.name, v.dtype, v.shape, v.length) for v in b["views"]]
        assert got == want
        # The state rides as the same JSON object.
        assert json.loads(b["state_raw"]) == j["state"]
        # Binary is the smaller frame (no field names).
        assert len(bbody) < len(jbody)


def read_reply(s: socket.socket) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
    body = s.recv(n, socket.MSG_WAITALL)
    return _wire._decode(body), body


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_next_with_count_answers_the_ready_batches_in_one_write(sock: str, encoding: str):
    """`next` with `count`: the first batch, then those ready at once, each but the last
    marked `more`; every batch once, in plan order, and the same batches as `count` 1 asks
    for. A count out of range is refused with `bad_request` (the leases it lists are released
    all the same) and the stream goes on."""
    want = [(m["epoch"], m["index"], m["shard"]) for m, _ in replies(sock, encoding)]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sock)
    conn = _wire.Conn(s)
    try:
        attach = {"op": "attach", "version": 1, "dataset": "mix", "seed": 5, "epochs": 2, "batch_state": True}
        conn.send({**attach, "batch_encoding": encoding})
        msg, fds = conn.recv(want_fds=True)
        _wire._close_fds(fds)
        assert msg["op"] == "attached", msg
        for bad in (0, 65):
            conn.send_bytes(_wire.encode_next((), bad))
            err, _ = read_reply(s)
            assert err["op"] == "error" and err["code"] == "bad_request", err
            assert f"next asked for {bad} batches; count is 1 to 64" in err["message"], err
        got, groups, release = [], [], ()
        while True:
            conn.send_bytes(_wire.encode_next(release, 4))
            group = []
            while True:
                msg, body = read_reply(s)
                if msg["op"] == "end":
                    assert not group
                    break
                assert msg["op"] == "batch", msg
                assert body[:1] == (bytes([_binary.TAG]) if encoding == "binary" else b"{")
                group.append(msg)
                if not msg.get("more"):
                    break
            if not group:
                break
            groups.append(len(group))
            got += [(m["epoch"], m["index"], m["shard"]) for m in group]
            release = tuple(m["lease"] for m in group)
            if len(groups) == 1:
                # A refused count still releases the leases the request lists: a second
                # release of one of them finds it gone.
                conn.send_bytes(_wire.encode_next(release, 0))
                err, _ = read_reply(s)
                assert err["op"] == "error" and err["code"] == "bad_request", err
                conn.send({"op": "release", "lease": release[0]})
                err, _ = read_reply(s)
                assert err["op"] == "error" and err["code"] == "unknown_lease", err
                release = ()
        assert got == want
        assert max(groups) <= 4
        # Shard mode keeps the region full of fetched shards: most requests find more ready.
        assert max(groups) > 1, groups
    finally:
        conn.close()


def documented_body(lease: int = 77, index: int = 1, offset: int = 4096, flags: int = 0) -> bytes:
    """One tensor `x` float32 [4, 8] at `offset` (4096) and a state, packed as the docs' table
    says."""
    state = b'{"epoch":0,"index":%d,"seed":1,"fingerprint":"f"}' % (index + 1)
    desc = struct.pack("<H", 1) + b"x" + bytes([7]) + b"float32" + bytes([2]) + struct.pack("<2Q", 4, 8)
    return struct.pack("<BBHIQQII", 1, flags, 1, len(state), lease, index, 0, 9) + struct.pack("<QQH", offset, 128, len(desc)) + desc + state


def test_the_documented_layout_is_what_the_sdk_reads():
    msg = _binary.decode(documented_body())
    assert (msg["lease"], msg["index"], msg["epoch"], msg["shard"]) == (77, 1, 0, 9)
    (v,), (dt,) = msg["views"], msg["dtypes"]
    assert dt == "float32"
    assert (v.name, v.dtype, v.shape, v.offset, v.length) == ("x", "float32", (4, 8), 4096, 128)
    assert json.loads(msg["state_raw"])["index"] == 2


@pytest.mark.parametrize(
    "cut, why",
    [
        (lambda b: b[:20], "shorter than its 32-byte header"),
        (lambda b: b[:40], "ends inside tensor 0"),
        (lambda b: b[:60], "ends inside tensor 0's desc \\(at byte 50\\)"),
        (lambda b: b + b"!", "does not end the body"),
        (lambda b: b[:50] + b"\x09" + b[51:], "desc of 28 bytes does not match its fields"),  # name_len 9
        (lambda b: b"\x02" + b[1:], "starts with byte 0x02"),
        (lambda b: b[:1] + b"\x05" + b[2:], "flags 0x05 set bits this SDK does not know"),
        (lambda b: b[:40] + struct.pack("<Q", 100) + b[48:], "shape \\(4, 8\\) of float32 is 128 bytes, the service says 100"),
    ],
)
def test_malformed_binary_replies_name_what_is_wrong(cut: Any, why: str):
    body = documented_body()
    with pytest.raises(ProtocolError, match=why):
        _binary.decode(cut(body))


def fake_service(path: str, answer: bytes | Any, attach: bool = True, attached: dict[str, Any] | None = None,
                 fd_size: int = 1 << 16):
    """A fake node service at `path` for one connection: it attaches a stream (a 64 KiB region,
    or `attached` with a memfd of `fd_size` bytes) and answers the first request after attach
    with `answer`'s bytes (or, if `answer` is a function, calls it with the connected socket and
    its Conn instead), then waits for the client to close. With `attach=False` it never answers
    the attach. Returns the listening socket and the serving thread (join, then close)."""
    import fcntl
    import os
    import threading

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(30)

    def serve() -> None:
        c, _ = srv.accept()
        conn = _wire.Conn(c)
        while (req := conn.recv()[0])["op"] == "info":
            conn.send_bytes(_wire.encode({"op": "info", "memory": "host", "lanes": []}))
        assert req["op"] == "attach", req
        if not attach:
            c.recv(1)  # until the client closes
            c.close()
            return
        fd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, fd_size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # as the node's
        reply = attached or {"op": "attached", "stream": 1, "region_size": 1 << 16, "batches_per_epoch": 3, "epochs": 1,
                             "memory": "host", "state": {"epoch": 0, "index": 0, "seed": 0, "fingerprint": "f"}}
        socket.send_fds(c, [_wire.encode(reply)], [fd])
        os.close(fd)
        if callable(answer):
            answer(c, conn)
        else:
            conn.recv()
            c.sendall(answer)
        c.recv(1)  # until the client closes
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_a_malformed_binary_reply_fails_the_stream_not_the_trainer(tmp_path: pathlib.Path):
    """A fake service that attaches and then answers `next` with a truncated binary batch: the
    SDK raises ProtocolError from `next` (the trainer's process goes on)."""
    import shardwire

    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, struct.pack("<I", 33) + struct.pack("<BBHIQQII", 1, 0, 1, 0, 1, 0, 0, 0) + b"\0")
    with shardwire.connect(path).open_stream("d") as s:
        with pytest.raises(ProtocolError, match="ends inside tensor 0"):
            s.next(timeout=10)
    t.join(10)
    srv.close()

def framed(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def test_replies_that_arrive_together_are_read_in_turn_and_a_bad_one_raises_in_its_turn():
    """Several replies in one receive (a `next` with `count` is answered in one write): the
    Conn decodes them together and hands them out one per call, in order; a malformed one
    raises ProtocolError when its turn comes, not before the good ones ahead of it."""
    a, b = socket.socketpair()
    try:
        conn = _wire.Conn(a)
        b.sendall(framed(documented_body(lease=1)) + framed(b'{"op":"released"}') + framed(documented_body()[:40])
                  + framed(documented_body(lease=3)))
        assert conn.recv_reply()["lease"] == 1
        assert conn.pending()
        assert conn.recv_reply() == {"op": "released"}
        with pytest.raises(ProtocolError, match="ends inside tensor 0"):
            conn.recv_reply()
        assert conn.recv_reply()["lease"] == 3, "the reply after the malformed one is still read"
        assert not conn.pending()
        b.sendall(framed(b'{"op":"released"}') + struct.pack("<I", _wire.MAX_FRAME + 1))
        assert conn.recv_reply() == {"op": "released"}
        with pytest.raises(ProtocolError, match="exceeds the frame limit"):
            conn.recv_reply()
    finally:
        a.close()
        b.close()


def test_a_bad_batch_in_a_group_raises_in_its_turn_after_the_good_ones(tmp_path: pathlib.Path):
    """A fake service answers one `next` with three binary batches in one write: a good one, one
    whose tensor lies outside the region, and a truncated one. The SDK builds the batches of a
    group together, but hands out the good one first, then raises for the bad one in its turn;
    that closes the stream (its replies can no longer be trusted: tests/e2e/test_sdk_recovery.py),
    so the call after it raises `closed` naming the fault."""
    import shardwire

    more = _binary.FLAG_MORE
    group = (framed(documented_body(lease=1, index=0, flags=more)) + framed(documented_body(lease=2, index=1, offset=1 << 16, flags=more))
             + framed(documented_body(lease=3, index=2)[:40]))
    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, group)
    with shardwire.connect(path).open_stream("d") as s:
        first = s.next(timeout=10)
        assert (first.lease, first.index, first["x"].shape) == (1, 0, (4, 8))
        with pytest.raises(ProtocolError, match="outside the region"):
            s.next(timeout=10)
        with pytest.raises(shardwire.ShardwireError, match="closed: .*malformed reply .*outside the region"):
            s.next(timeout=10)
    t.join(10)
    srv.close()


def test_closing_a_stream_unmaps_its_region_with_batches_built_ahead(tmp_path: pathlib.Path):
    """A group of three batches: the first is handed out, the other two are built ahead. Once
    the trainer drops the first and closes the stream, the region is unmapped: nothing the SDK
    built ahead keeps it mapped."""
    import shardwire

    more = _binary.FLAG_MORE
    group = b"".join(framed(documented_body(lease=k + 1, index=k, offset=k * 4096, flags=more if k < 2 else 0)) for k in range(3))
    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, group)
    s = shardwire.connect(path).open_stream("d")
    first = s.next(timeout=10)
    assert first.index == 0 and s._conn.pending(), "two more replies came with it"
    mapping = s._mmap
    del first
    s.close()
    assert mapping.closed, "the region is unmapped"
    assert s._mmap is None and s.region is None, "and the stream keeps no reference to it"
    t.join(10)
    srv.close()


def test_a_tensor_kept_past_close_stays_readable(tmp_path: pathlib.Path):
    """The SDK's promise (Stream.close): arrays of its batches stay mapped until they are
    garbage-collected. A trainer keeps a tensor, closes the stream, then reads the tensor: it
    reads the region's bytes, it does not crash on an unmapped page. In a child process, so a
    crash fails this test instead of the test run."""
    import subprocess
    import sys

    script = f"""
import sys
sys.path[:0] = [{str(pathlib.Path(__file__).parent)!r}]
import test_binary_frames as T
import shardwire
srv, t = T.fake_service({str(tmp_path / "fake.sock")!r}, T.framed(T.documented_body(lease=1, index=0, offset=0)))
s = shardwire.connect({str(tmp_path / "fake.sock")!r}).open_stream("d")
x = s.next(timeout=10)["x"]
s.close()
print("sum", float(x.sum()), "writeable", x.flags.writeable, flush=True)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode} (a negative rc is a signal: -11 is SIGSEGV)\n{r.stdout}\n{r.stderr[-2000:]}"
    assert "sum 0.0 writeable False" in r.stdout, r.stdout


def test_a_send_the_node_closed_says_the_nodes_closing_error():
    """A node that ends a connection (its idle timeout, a bad request) sends an ``error``
    first, then closes: the trainer's next send fails with a broken pipe, and the
    ConnectionClosed it raises names the node's code and message (before: only "Broken
    pipe"). The replies stay unread for whoever reads them."""
    from shardwire._errors import ConnectionClosed

    a, b = socket.socketpair()
    try:
        conn = _wire.Conn(a)
        closing = {"op": "error", "code": "timeout", "message": "no request for 3600 s"}
        b.sendall(framed(json.dumps(closing).encode()))
        b.close()
        with pytest.raises(ConnectionClosed, match="closed the connection: timeout: no request for 3600 s"):
            conn.send_bytes(framed(b'{"op":"next"}'))  # the peer is closed: EPIPE at once
        assert conn.recv_reply() == closing
    finally:
        a.close()


def _ended(*replies: bytes) -> tuple[_wire.Conn, socket.socket]:
    """A connection with one request sent (a ``next`` in flight), whose node then sends
    `replies` (framed bodies, in one write) and closes it."""
    a, b = socket.socketpair()
    conn = _wire.Conn(a)
    conn.send_bytes(framed(b'{"op":"next"}'))
    b.sendall(b"".join(replies))
    b.close()
    return conn, a


def _send_error(conn: _wire.Conn, owed: int) -> str:
    """The message of the ConnectionClosed a send on `conn`, which the node closed, raises;
    `owed`: the requests sent before whose last answer is not taken yet (as a Stream's
    ``_inflight`` says)."""
    from shardwire._errors import ConnectionClosed

    conn.owed = owed
    with pytest.raises(ConnectionClosed) as e:
        conn.send_bytes(framed(b'{"op":"next"}'))
    return str(e.value)


def test_an_error_that_answers_a_request_is_not_taken_for_the_reason_of_a_close():
    """An ``error`` that answers the request in flight (its releases refused,
    ``unknown_lease``), then a node that dies without a word: the send after it says the
    connection failed, not that answer (before: "closed the connection: unknown_lease", which a
    caller may take as harmless)."""
    refused = {"op": "error", "code": "unknown_lease", "message": "lease(s) [7] are not held"}
    conn, a = _ended(framed(json.dumps(refused).encode()))
    try:
        message = _send_error(conn, owed=1)
        assert "unknown_lease" not in message, message
        assert "failed while sending" in message, message
        assert conn.recv_reply() == refused, "the answer stays for whoever reads it"
    finally:
        a.close()


def test_the_closing_error_is_found_behind_the_answers_in_flight():
    """The node's closing ``error`` behind the answers to the request in flight (two batches
    answering one ``next``, the first marked ``more``) is the one named."""
    more = {"op": "batch", "lease": 9, "more": True}
    last = {"op": "batch", "lease": 10}
    closing = {"op": "error", "code": "timeout", "message": "no request for 3600 s"}
    conn, a = _ended(*(framed(json.dumps(m).encode()) for m in (more, last, closing)))
    try:
        assert "closed the connection: timeout: no request for 3600 s" in _send_error(conn, owed=1)
    finally:
        a.close()


def test_the_closing_error_is_found_among_replies_already_decoded():
    """The answer in flight and the closing error came in one write, both decoded when the
    first was read: the closing error is found among the decoded replies (before, only the
    bytes not yet decoded were looked through: the message was the bare broken pipe)."""
    refused = {"op": "error", "code": "unknown_lease", "message": "lease(s) [7] are not held"}
    closing = {"op": "error", "code": "timeout", "message": "no request for 3600 s"}
    conn, a = _ended(framed(json.dumps(refused).encode()), framed(json.dumps(closing).encode()))
    try:
        assert conn.recv_reply() == refused  # the `next` answered and its answer taken
        assert "closed the connection: timeout: no request for 3600 s" in _send_error(conn, owed=0)
    finally:
        a.close()


def test_a_reply_nested_too_deeply_among_those_unread_still_gives_connection_closed():
    """A reply nested too deeply for ``json`` to decode (a RecursionError), still unread when
    the send fails: the send raises ConnectionClosed with the closing error behind it (before,
    the RecursionError escaped from ``send_bytes``)."""
    nested = b"[" * 20_000  # far past the recursion limit; small enough for one write
    closing = {"op": "error", "code": "timeout", "message": "no request for 3600 s"}
    conn, a = _ended(framed(nested), framed(json.dumps(closing).encode()))
    try:
        assert "closed the connection: timeout" in _send_error(conn, owed=1)
    finally:
        a.close()


class _StrikeAfterAppend(deque):  # type: ignore[type-arg]
    """A ``Conn._ready`` whose first ``append`` raises KeyboardInterrupt once the reply is in:
    a Ctrl-C that strikes right after the C call returns, as CPython may raise it."""

    struck = False

    def append(self, msg: Any) -> None:
        super().append(msg)
        if not self.struck:
            self.struck = True
            raise KeyboardInterrupt


def test_an_interrupt_as_a_reply_is_stored_costs_no_later_closing_error(tmp_path: pathlib.Path):
    """A Ctrl-C that strikes as a reply goes into ``_ready``, caught by the training loop, which
    goes on; later the node sends its closing ``error`` and closes, and the send after it fails.
    The ConnectionClosed names the node's error. Before, a separate count of answers received
    missed the interrupted reply and stayed one low for the rest of the connection: the closing
    error was taken for an answer still owed, and the message was the bare broken pipe."""
    import threading

    import shardwire
    from shardwire._errors import ConnectionClosed

    closing = {"op": "error", "code": "timeout", "message": "no request for 3600 s"}
    closed = threading.Event()

    def answer(c: socket.socket, conn: _wire.Conn) -> None:
        conn.recv()  # the first `next`
        c.sendall(framed(documented_body(lease=1, index=0)))
        conn.recv()  # the `next` asked ahead of time once batch 1 was handed out
        c.sendall(framed(documented_body(lease=2, index=1)) + framed(json.dumps(closing).encode()))
        c.shutdown(socket.SHUT_RDWR)  # the node closes: the client's next send fails (EPIPE)
        closed.set()

    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, answer)
    with shardwire.connect(path).open_stream("d") as s:
        s._conn._ready = _StrikeAfterAppend()
        with pytest.raises(KeyboardInterrupt):
            s.next(timeout=10)
        assert s.next(timeout=10).lease == 1, "the interrupted reply is handed out by the next call"
        assert closed.wait(10)
        assert s.next(timeout=10).lease == 2  # its request ahead of time finds the node gone
        with pytest.raises(ConnectionClosed, match="closed the connection: timeout: no request for 3600 s"):
            s.next(timeout=10)
    t.join(10)
    srv.close()
