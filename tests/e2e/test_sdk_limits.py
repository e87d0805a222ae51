"""The Python SDK's waits for answers the node gives at once are bounded: a node that accepted
the connection and then stopped answering fails the call with ConnectionClosed naming the
request and the limit, instead of hanging the trainer (`_wire.ATTACH_LIMIT` for attach,
`_wire.REPLY_LIMIT` for release and info; `next` waits as its `timeout` says). Against fake
services that answer some requests and then go silent (the limits lowered for the test).
"""

from __future__ import annotations

import pathlib
import time

import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
from shardwire import _wire  # noqa: E402
from shardwire._errors import ConnectionClosed  # noqa: E402
from test_binary_frames import documented_body, fake_service, framed  # noqa: E402


def test_an_attach_the_node_never_answers_fails_after_the_limit(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    import shardwire

    monkeypatch.setattr(_wire, "ATTACH_LIMIT", 0.5)
    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, b"", attach=False)
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="did not answer attach within 0.5 s"):
        shardwire.connect(path).open_stream("d")
    assert time.monotonic() - t0 < 10
    t.join(10)
    srv.close()


def test_a_release_the_node_never_answers_fails_after_the_limit(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """Two batches, one per `next`; the release the trainer sent behind the second `next` is
    never answered: the `next` that must first read that answer fails after REPLY_LIMIT, and
    the stream is closed saying why."""
    import shardwire

    monkeypatch.setattr(_wire, "REPLY_LIMIT", 0.5)

    def answer(c, conn) -> None:
        for k in range(2):
            assert conn.recv()[0]["op"] == "next"
            c.sendall(framed(documented_body(lease=k + 1, index=k, offset=k * 4096)))
        while c.recv(1 << 16):  # reads the release and what follows, answers nothing
            pass

    path = str(tmp_path / "fake.sock")
    srv, t = fake_service(path, answer)
    s = shardwire.connect(path).open_stream("d")
    first = s.next(timeout=10)
    first.release()  # behind the `next` the SDK sent ahead: answered after it
    assert s.next(timeout=10).index == 1
    with pytest.raises(ConnectionClosed, match="did not answer release within 0.5 s"):
        s.next(timeout=10)
    with pytest.raises(shardwire.ShardwireError, match="did not answer release"):
        s.next(timeout=10)
    s.close()
    t.join(10)
    srv.close()


def test_an_info_the_node_never_answers_is_not_taken_for_an_old_node(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """`device="auto"` asks `info` first; a node too old for it closes the connection, and the
    SDK then attaches without a device. A node that does not answer at all is stuck, not old:
    the SDK raises instead of falling back (it would attach without the device it wanted)."""
    import socket as socketlib
    import threading

    import shardwire

    monkeypatch.setattr(_wire, "REPLY_LIMIT", 0.5)
    monkeypatch.setattr(_wire, "ATTACH_LIMIT", 0.5)  # a fallback would fail on attach instead
    path = str(tmp_path / "fake.sock")
    srv = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    srv.bind(path)
    srv.listen(2)
    srv.settimeout(30)
    accepted: list[str] = []

    def serve() -> None:
        c, _ = srv.accept()
        accepted.append(_wire.Conn(c).recv()[0]["op"])
        while c.recv(1 << 16):  # answers nothing
            pass
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with pytest.raises(ConnectionClosed, match="did not answer info within 0.5 s"):
        shardwire.connect(path).open_stream("d", device="auto")
    t.join(10)
    srv.close()
    assert accepted == ["info"], "one connection, no second attempt without the device"


def test_a_socket_above_fd_1023_is_waited_on(tmp_path: pathlib.Path):
    """A trainer process with many open files (a DataLoader's) may get its stream's socket at an
    fd above 1023, which `select` cannot watch (ValueError): the SDK waits with `poll`."""
    import os
    import resource

    import shardwire
    from test_binary_frames import documented_body, fake_service, framed

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 2048: cannot open a socket above fd 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    # Every free fd up to 1100 taken (earlier tests may have left holes below, and objects
    # the collector has yet to close sockets of): the socket's is the next one.
    import gc

    gc.collect()
    held = [os.open(os.devnull, os.O_RDONLY)]
    while held[-1] < 1100:
        held.append(os.open(os.devnull, os.O_RDONLY))
    try:
        path = str(tmp_path / "fake.sock")
        srv, t = fake_service(path, framed(documented_body(lease=1, index=0, offset=0)))
        with shardwire.connect(path).open_stream("d") as s:
            assert s._conn.sock.fileno() > 1023
            b = s.next(timeout=10)  # sent now, with a timeout: the SDK waits on the socket
            assert (b.lease, b.index) == (1, 0)
        t.join(10)
        srv.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
