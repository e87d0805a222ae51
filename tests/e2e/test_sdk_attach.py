"""What the Python SDK does with the node's `attached` reply and the region fd that comes with
it, against a fake node on a Unix socket (it passes a real memfd with SCM_RIGHTS):

- the fd is close-on-exec from the moment it arrives (``socket.recv_fds`` ignores its flags
  before Python 3.12.1, so a child spawned meanwhile inherited the region);
- an exception (a signal handler's, Ctrl-C's) that strikes at any bytecode from the fd's
  receipt to its close leaves it closed, never leaked;
- a malformed reply (a field missing, a region larger than its fd, an unknown memory kind) is a
  ProtocolError that names it, never a KeyError or ValueError (which read as a bad argument),
  and leaves no fd open;
- ``close()`` from a signal handler while ``next`` waits in the same thread (a SIGTERM
  handler) closes the stream at once: before, it waited for the lock its own thread held;
- ``device=N`` for an ordinal the process does not see is a ValueError naming it;
- a ``device="auto"`` lookup slower than the node's connect-to-attach deadline attaches on a
  new connection;
- ``device="auto"`` falls back to an attach without a device only for a node too old for
  ``info`` (it answers ``bad_request``): a refused connection (``too_many_connections``,
  ``forbidden``) raises the refusal, with no second connection.
"""

from __future__ import annotations

import errno
import fcntl
import linecache
import os
import pathlib
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
import shardwire  # noqa: E402
from conftest import REPO  # noqa: E402
from shardwire import _wire  # noqa: E402
from shardwire._errors import ProtocolError  # noqa: E402
from test_binary_frames import fake_service  # noqa: E402

REGION = 1 << 16
GOOD = {"op": "attached", "stream": 1, "region_size": REGION, "batches_per_epoch": 3, "epochs": 1,
        "memory": "host", "state": {"epoch": 0, "index": 0, "seed": 0, "fingerprint": "f"}}


def send_attached(c: socket.socket) -> None:
    """As the node: the `attached` answer GOOD with a REGION-byte region fd sealed against
    shrinking and growing."""
    fd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, REGION)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # as the node's
        socket.send_fds(c, [_wire.encode(GOOD)], [fd])
    finally:
        os.close(fd)


def attach_once(path: str, attached: dict[str, Any], fd_size: int = REGION) -> threading.Thread:
    """A fake node at `path` that answers one attach with `attached` and a memfd of `fd_size`
    bytes, then waits for the client to close."""
    srv, t = fake_service(path, lambda c, conn: None, attached=attached, fd_size=fd_size)

    def closing() -> None:
        t.join(30)
        srv.close()

    closer = threading.Thread(target=closing, daemon=True)
    closer.start()
    return closer


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_the_region_fd_is_close_on_exec_as_it_arrives(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    path = str(tmp_path / "node.sock")
    t = attach_once(path, GOOD)
    seen: list[bool] = []
    close_fds = _wire._close_fds

    def check_then_close(fds: list[int]) -> None:
        seen.extend(bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for fd in fds)
        close_fds(fds)

    monkeypatch.setattr(_wire, "_close_fds", check_then_close)
    s = shardwire.connect(path).open_stream("d")
    s.close()
    t.join(30)
    assert seen == [True], seen


MALFORMED = {
    "no stream id": ({k: v for k, v in GOOD.items() if k != "stream"}, REGION, "stream"),
    "region larger than its fd": (GOOD, REGION // 2, "the region's fd holds 32768 bytes"),
    "unknown memory kind": ({**GOOD, "memory": "gpu"}, REGION, "memory 'gpu'"),
    "state not an object": ({**GOOD, "state": 5}, REGION, "attached reply"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_attached_reply_is_a_protocol_error_naming_it(tmp_path: pathlib.Path, case: str):
    attached, fd_size, names = MALFORMED[case]
    path = str(tmp_path / "node.sock")
    t = attach_once(path, attached, fd_size)
    before = open_fds()
    with pytest.raises(ProtocolError) as e:
        shardwire.connect(path).open_stream("d")
    assert names in str(e.value), e.value
    t.join(30)
    assert open_fds() <= before, "the region's fd and the connection were closed"


SIGTERM_CLOSE = """
import signal, socket, sys, threading
sys.path.insert(0, sys.argv[1])
import shardwire
from shardwire import _wire

path = sys.argv[2]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(1)

def node():
    import fcntl
    import os
    c, _ = srv.accept()
    conn = _wire.Conn(c)
    while (req := conn.recv()[0])["op"] == "info":
        conn.send_bytes(_wire.encode({"op": "info", "memory": "host", "lanes": []}))
    fd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 16)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # as the node's
    socket.send_fds(c, [_wire.encode(%(attached)r)], [fd])
    os.close(fd)
    while c.recv(1 << 16):  # never answers `next`
        pass

threading.Thread(target=node, daemon=True).start()
s = shardwire.connect(path).open_stream("d")
signal.signal(signal.SIGALRM, lambda *_: s.close())  # a trainer's SIGTERM handler, say
signal.setitimer(signal.ITIMER_REAL, 0.5)
try:
    s.next()
except shardwire.ShardwireError as e:
    print("raised", e.code, s.closed)
"""


def test_close_from_a_signal_handler_while_next_waits_closes_the_stream(tmp_path: pathlib.Path):
    script = SIGTERM_CLOSE % {"attached": GOOD}
    sdk = str(REPO / "client" / "python" / "src")
    r = subprocess.run([sys.executable, "-c", script, sdk, str(tmp_path / "node.sock")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "raised closed True", (r.stdout, r.stderr)


def test_a_cuda_ordinal_this_process_does_not_see_is_a_value_error_naming_it():
    """``device=7`` on a host whose torch sees one GPU: torch's own check is an
    ``AssertionError("Invalid device id")``; the SDK promises a ValueError naming the device.
    This machine has no CUDA, so an object standing in for ``torch.cuda`` (its two calls, as
    torch documents them) plays a one-GPU host."""
    from shardwire import _device

    class OneGpu:
        def device_count(self) -> int:
            return 1

        def get_device_properties(self, ordinal: int) -> Any:
            assert ordinal == 0, "torch raises AssertionError('Invalid device id') here"
            return type("Props", (), {"pci_domain_id": 0, "pci_bus_id": 0x19, "pci_device_id": 0})()

    assert _device._by_torch(OneGpu(), 0) == "0000:19:00.0"
    with pytest.raises(ValueError, match=r"device cuda:7: this process sees 1 CUDA device\(s\)"):
        _device._by_torch(OneGpu(), 7)


def test_a_region_that_could_shrink_is_refused_not_mapped():
    """A region fd not sealed against shrinking: a read after a peer shrank it would kill the
    trainer with SIGBUS. Before, it was mapped; now it is a ProtocolError naming the seal (the
    node seals every region it sends)."""
    from shardwire._client import _map_host

    fd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(ProtocolError, match="F_SEAL_SHRINK"):
            _map_host(fd, 1 << 16)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        region = _map_host(fd, 1 << 16)
        assert len(region) == 1 << 16
        region.close()
    finally:
        os.close(fd)


def test_a_slow_device_lookup_attaches_on_a_new_connection(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """``device="auto"`` on a node that serves CUDA memory looks the current device up between
    ``info`` and ``attach``, and the lookup may initialise CUDA (seconds). The node closes a
    connection that has not attached within trainer_request_timeout_secs, with a `timeout`
    error (here once the lookup has begun, which returns only after that): before, the attach
    went to that closed connection and the open failed; now it goes on a new one, with the
    device. Events, not clocks, order the two sides."""
    import time

    from shardwire import _device

    looking, timed_out = threading.Event(), threading.Event()

    def slow_lookup() -> str:
        looking.set()
        assert timed_out.wait(10), "the node never timed the connection out"
        return "0000:3b:00.0"

    monkeypatch.setattr(_device, "current", slow_lookup)
    path = str(tmp_path / "node.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(2)
    srv.settimeout(10)
    seen: list[list[dict[str, Any]]] = []

    def node() -> None:
        while True:
            c, _ = srv.accept()
            conn, deadline, got = _wire.Conn(c), time.monotonic() + 10.0, []
            seen.append(got)
            while _wire.readable(c, max(0.0, deadline - time.monotonic())):
                req = conn.recv()[0]
                got.append(req)
                if req["op"] == "info":
                    conn.send({"op": "info", "memory": "cuda", "lanes": []})
                    # As the node when no attach comes in time: the lookup is under way.
                    assert looking.wait(10), "the client never looked its device up"
                    break
                send_attached(c)
                c.recv(1)  # until the client closes
                c.close()
                return
            conn.send({"op": "error", "code": "timeout", "message": "no attach within 1 s of connecting"})
            c.close()
            timed_out.set()

    t = threading.Thread(target=node, daemon=True)
    t.start()
    s = shardwire.connect(path).open_stream("d")
    s.close()
    t.join(10)
    srv.close()
    assert [[r["op"] for r in got] for got in seen] == [["info"], ["attach"]], seen
    assert seen[1][0]["device"] == "0000:3b:00.0"


class Interrupt(KeyboardInterrupt):
    """Ctrl-C's KeyboardInterrupt, raised by the test (so a real one still ends the run)."""


def test_an_interrupt_as_the_region_fd_is_stored_closes_it():
    """An exception (a signal handler's) that strikes after ``recvmsg`` returned, before the
    fds are in the caller's list: they are closed, not leaked. Before, the fd was only ever in
    the ancillary data and a local array, and stayed open for the life of the process."""
    a, node = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("region")
    socket.send_fds(node, [_wire.encode(GOOD)], [fd])
    os.close(fd)

    class Refusing(list):  # type: ignore[type-arg]
        """The caller's list, where an interrupt strikes as the fds are being stored."""

        offered: list[int] = []

        def extend(self, fds: Any) -> None:
            self.offered = list(fds)
            raise Interrupt

    fds = Refusing()
    try:
        with pytest.raises(Interrupt):
            _wire._recv_fds(a, 4, fds)
        assert fds.offered and not fds, fds.offered
        for got in fds.offered:
            with pytest.raises(OSError) as e:
                os.fstat(got)
            assert e.value.errno == errno.EBADF, f"the received fd {got} is still open"
    finally:
        a.close()
        node.close()


class InterruptAt:
    """A trace function that raises Interrupt at the `at`-th bytecode the SDK runs from the
    call that receives the region fd (`_wire._recv_fds`) to the line where the stream closes
    it (``_close_fds(fds)`` in a ``finally``: no Python code guards the start of a ``finally``),
    as a signal handler's exception would (CPython runs them between bytecodes); then tracing
    stops, as after a real handler's. `struck` tells whether it did."""

    SDK = {"shardwire._wire", "shardwire._client"}

    def __init__(self, at: int) -> None:
        self.at, self.seen, self.on, self.struck = at, 0, False, False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_globals.get("__name__") not in self.SDK:
            return None
        if event == "call" and frame.f_code.co_name == "_recv_fds":
            self.on = True
        frame.f_trace_opcodes = True
        return self.step

    def step(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and "_close_fds(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            self.on = False
        if event == "opcode" and self.on:
            if self.seen == self.at:
                self.struck = True
                raise Interrupt(f"at bytecode {self.at} after the region fd's receipt began")
            self.seen += 1
        return self.step


def attach_and_wait(path: str) -> threading.Thread:
    """A fake node at `path` that answers one `attach` with `GOOD` and a sealed memfd, then
    waits for the client to close (which may reset the connection: the client can close it
    before it read the reply) and closes every fd it opened."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(30)

    def serve() -> None:
        with srv, srv.accept()[0] as c:
            conn = _wire.Conn(c)
            while conn.recv()[0]["op"] == "info":
                conn.send({"op": "info", "memory": "host", "lanes": []})
            send_attached(c)
            try:
                c.recv(1)
            except ConnectionResetError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_an_interrupt_at_any_bytecode_from_the_region_fds_receipt_leaves_no_fd_open(tmp_path: pathlib.Path):
    """`open_stream` with an exception struck at each bytecode in turn, from the call that
    receives the region fd to the `finally` that closes it: whichever it struck at, no fd is
    left open (the region's, the connection's). Before, an exception right after ``recvmsg``
    returned, or as `Conn.recv` returned the fds to `_open`, lost the fd."""
    old = sys.gettrace()
    # CPython 3.12 sends no `opcode` events to frames that set `f_trace_opcodes` in their trace
    # function unless the instruction events were turned on before `settrace` (gh-103615,
    # gh-114480): setting it on this frame first does that; elsewhere it is harmless (this
    # frame is not traced).
    sys._getframe().f_trace_opcodes = True
    for at in range(20_000):
        path = str(tmp_path / f"node{at}.sock")
        before = open_fds()
        node = attach_and_wait(path)
        client = shardwire.connect(path)
        tracer = InterruptAt(at)
        s = None
        sys.settrace(tracer)
        try:
            s = client.open_stream("d")
        except Interrupt:
            pass
        finally:
            sys.settrace(old)
        if s is not None:
            s.close()
        node.join(30)
        assert open_fds() <= before, f"an fd leaked when an exception struck at bytecode {at}"
        if not tracer.struck:
            assert tracer.seen > 50, (
                f"the trace function saw {tracer.seen} opcode events from the region fd's receipt "
                f"to its close: too few to have tried every bytecode (does Python "
                f"{sys.version.split()[0]} send `opcode` events to a trace function?)"
            )
            assert s is not None and at > 50, at  # every bytecode was tried
            return
    raise AssertionError("the receipt never ended")


def late_node(path: str, late: int, attach: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Thread, list[list[str]]]:
    """A fake node at `path` that times its first `late` connections out as the node does
    when no attach came within trainer_request_timeout_secs, while the client is held up
    between `info` and its attach (as by a long garbage collection), then, if `attach`,
    answers one attach; the ops each connection got are recorded. Events, not clocks, order
    the two sides."""
    from shardwire import _client

    asked, timed_out = threading.Event(), threading.Event()
    auto_device = _client._auto_device

    def held_up(conn: _wire.Conn, where: str) -> Any:
        got = auto_device(conn, where)
        if len(seen) <= late:
            asked.set()
            assert timed_out.wait(10), "the node never timed the connection out"
            timed_out.clear()
        return got

    monkeypatch.setattr(_client, "_auto_device", held_up)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(10)
    seen: list[list[str]] = []

    def node() -> None:
        with srv:
            for n in range(late + attach):
                c, _ = srv.accept()
                conn, got = _wire.Conn(c), []
                seen.append(got)
                while True:
                    req = conn.recv()[0]
                    got.append(req["op"])
                    if req["op"] == "info":
                        conn.send({"op": "info", "memory": "host", "lanes": []})
                        if n < late:
                            assert asked.wait(10), "the client never asked for info"
                            asked.clear()
                            conn.send({"op": "error", "code": "timeout",
                                       "message": "no attach within 10 s of connecting (trainer_request_timeout_secs)"})
                            c.close()
                            timed_out.set()
                            break
                        continue
                    send_attached(c)
                    c.recv(1)  # until the client closes
                    c.close()
                    return

    t = threading.Thread(target=node, daemon=True)
    t.start()
    return t, seen


def test_an_attach_the_node_timed_out_goes_again_on_a_new_connection(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """A trainer held up between connecting and attaching (a garbage collection that frees a
    DataLoader iterator joins its workers, 5 s each) finds the connection closed by the node
    (trainer_request_timeout_secs): before, the open failed with a broken pipe or the node's
    `timeout`; no stream existed, so now the attach goes again, once, on a new connection."""
    path = str(tmp_path / "node.sock")
    t, seen = late_node(path, 1, True, monkeypatch)
    s = shardwire.connect(path).open_stream("d")
    s.close()
    t.join(10)
    assert seen == [["info"], ["info", "attach"]], seen


def test_an_attach_timed_out_twice_fails_with_the_nodes_reason(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """Once only: a node that times the new connection out too is answered with its error."""
    path = str(tmp_path / "node.sock")
    t, seen = late_node(path, 2, False, monkeypatch)
    with pytest.raises((shardwire.ServiceError, shardwire.ConnectionClosed)) as e:
        shardwire.connect(path).open_stream("d")
    assert isinstance(e.value, shardwire.ConnectionClosed) or e.value.code == "timeout", e.value
    t.join(10)
    assert seen == [["info"], ["info"]], seen


#: What each fake node sends on its first connection: (the error, whether it reads the `info`
#: first). An old node reads it, answers that it knows no such op, and closes the connection;
#: a refusing node sends its refusal as it accepts, in place of any answer, and closes it.
FIRST_ANSWER = {
    "old node": ({"code": "bad_request", "message": "unknown variant `info`, expected one of `attach`, `next`, "
                  "`release`, `state`"}, True),
    "too_many_connections": ({"code": "too_many_connections", "message": "this node serves at most 1 trainer "
                              "connections at once (trainer_max_connections)"}, False),
    "forbidden": ({"code": "forbidden", "message": "uid 1000 / gid 1000 is not allowed to use this node"}, False),
}


@pytest.mark.parametrize("case", list(FIRST_ANSWER))
def test_only_an_old_node_gets_an_attach_without_the_device(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, case: str):
    """``device="auto"`` (the default) asks ``info`` first, to know whether to name the
    trainer's GPU. Before, any error answer was taken for an old node's: the SDK attached again
    on a new connection without the device, so a node at trainer_max_connections that had a
    slot free by then (here: the fake node's second connection) put the stream on its least
    loaded lane, maybe another GPU's, and a `forbidden` peer made two refused connections. Now
    only `bad_request` (an old node's answer) falls back; a refusal raises as the node sent
    it, and no second connection is made. Events, not clocks, order the two sides."""
    from shardwire import _device

    monkeypatch.setattr(_device, "current", lambda: "0000:3b:00.0")  # a CUDA trainer, were it asked
    error, reads_info = FIRST_ANSWER[case]
    path = str(tmp_path / "node.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(2)
    srv.settimeout(0.1)
    done = threading.Event()
    seen: list[list[dict[str, Any]]] = []

    def first(c: socket.socket) -> None:
        got: list[dict[str, Any]] = []
        seen.append(got)
        if reads_info:
            got.append(_wire.Conn(c).recv()[0])
        c.sendall(_wire.encode({"op": "error", **error}))
        c.close()  # as the node: the error, then the connection dropped

    def second(c: socket.socket) -> None:
        conn, got = _wire.Conn(c), []
        seen.append(got)
        while (req := conn.recv()[0])["op"] == "info":
            got.append(req)
            conn.send({"op": "info", "memory": "cuda", "lanes": []})
        got.append(req)
        send_attached(c)
        c.recv(1)  # until the client closes
        c.close()

    def node() -> None:
        with srv:
            for serve in (first, second):
                while True:
                    try:
                        c, _ = srv.accept()
                        break
                    except socket.timeout:
                        if done.is_set():
                            return
                serve(c)

    t = threading.Thread(target=node, daemon=True)
    t.start()
    client = shardwire.connect(path)
    try:
        if reads_info:
            client.open_stream("d").close()
        else:
            with pytest.raises(shardwire.ServiceError) as e:
                client.open_stream("d").close()
            assert (e.value.code, e.value.message) == (error["code"], error["message"])
    finally:
        done.set()
        t.join(10)
    ops = [[r["op"] for r in got] for got in seen]
    if reads_info:
        assert ops == [["info"], ["attach"]], seen
        assert "device" not in seen[1][0], "an old node cannot say what it serves: no device"
    else:
        assert ops == [[]], f"one connection, refused; no attach without the device: {seen}"


@pytest.mark.parametrize("device", ["auto", None])
def test_a_refusal_that_closed_the_connection_before_the_first_request_raises(tmp_path: pathlib.Path,
                                                                              monkeypatch: pytest.MonkeyPatch, device: Any):
    """The node sends its refusal as it accepts and drops the connection at once, so the
    trainer's first request (``info``, or ``attach`` with no device) may meet a closed
    connection: the write fails (EPIPE) with the refusal already received. Before, that was a
    broken pipe: the SDK tried again on new connections (``info``'s fallback, then the
    attach's retry: four connections with ``device="auto"``) and raised ConnectionClosed,
    hiding the retryable ``too_many_connections``. Now the refusal raises, after one
    connection. Events, not clocks, order the two sides."""
    from shardwire import _client

    path = str(tmp_path / "node.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(0.1)
    refused, done = threading.Event(), threading.Event()
    accepted: list[int] = []
    connect = _client._connect

    def connect_then_wait(where: str) -> socket.socket:
        sock = connect(where)
        assert refused.wait(10), "the node never refused the connection"
        refused.clear()
        return sock

    monkeypatch.setattr(_client, "_connect", connect_then_wait)

    def node() -> None:
        with srv:
            while not done.is_set():
                try:
                    c, _ = srv.accept()
                except socket.timeout:
                    continue
                accepted.append(1)
                c.sendall(_wire.encode({"op": "error", "code": "too_many_connections", "message": "at most 1 (trainer_max_connections)"}))
                c.close()
                refused.set()

    t = threading.Thread(target=node, daemon=True)
    t.start()
    try:
        with pytest.raises(shardwire.ServiceError) as e:
            shardwire.connect(path).open_stream("d", device=device)
    finally:
        done.set()
        t.join(10)
    assert e.value.code == "too_many_connections", e.value
    assert len(accepted) == 1, f"{len(accepted)} connections"
