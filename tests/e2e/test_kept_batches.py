"""A trainer that keeps every batch its stream's memory holds, and gives one back while its
`next` waits: on the wire (a `release` sent behind the waiting request is applied at once, its
answer after the batch's), and through the Python SDK from another thread (the waiting `next`
sends the release for it). Before, both waited forever: the node read the release only after
answering the `next`, which waited for the memory the release frees; and the SDK's release
waited for the stream's lock, which the waiting `next` held.

Real processes: `shardwire index`, `shardwire source`, `shardwire serve`, the SDK from the
source tree, Arrow files written by pyarrow."""

from __future__ import annotations

import mmap
import socket
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from conftest import REPO, index_dataset, wait_for, wait_ready, write_arrow

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402
from shardwire import _wire  # noqa: E402

ROWS = 256  # per record batch; rows of 1 KiB + 8 bytes


@pytest.fixture
def node(sw, tmp_path):
    d = tmp_path / "kept"
    rng = np.random.default_rng(5)
    batches = [
        pa.RecordBatch.from_arrays(
            [pa.array(np.arange(i * ROWS, (i + 1) * ROWS)),
             pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 256, ROWS * 1024, dtype=np.uint8)), 1024)],
            names=["id", "pixels"],
        )
        for i in range(32)
    ]
    write_arrow(d / "kept.arrow", batches, stream=False)
    index_dataset(d)
    # 6 MiB of stream memory: room for a few batch slabs of 32 rows only.
    n = sw.serve([sw.source({"k": d})], "--pool-size", "64MiB", "--stream-memory", "6MiB")
    wait_ready(n)
    return n


def leased(node, sid: int) -> int:
    return next(s["leased"] for s in node.status()["streams"] if s["id"] == sid)


def test_a_release_behind_a_waiting_next_is_applied_while_it_waits(node):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(node.socket)
    conn = _wire.Conn(sock)
    try:
        conn.send({"op": "attach", "version": 1, "dataset": "k", "batch_size": 32, "seed": 2, "batch_encoding": "binary"})
        msg, fds = conn.recv(want_fds=True)
        assert msg["op"] == "attached", msg
        mmap.mmap(fds[0], msg["region_size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
        _wire._close_fds(fds)
        # Take batches without releasing any until the stream's memory is full of them.
        held = []
        for _ in range(64):
            # Long enough that only a full memory, not a loaded machine, runs it out.
            conn.send_bytes(_wire.encode_next((), 1, 5000))
            r = conn.recv_reply()
            if r["op"] == "timeout":
                break
            assert r["op"] == "batch", r
            held.append((r["index"], r["lease"]))
        else:
            pytest.fail("the stream's memory never filled: the test's premise is wrong")
        assert len(held) >= 2, held
        assert leased(node, msg["stream"]) == len(held)
        # A `next` that waits as long as it takes, then a release behind it.
        conn.send_bytes(_wire.encode_next((), 1, None))
        time.sleep(0.5)
        conn.send({"op": "release", "lease": held[0][1]})
        t = time.monotonic()
        r = conn.recv_reply()  # the socket's 20 s timeout: before the fix, nothing came
        assert r["op"] == "batch", r
        assert r["index"] == held[-1][0] + 1, "the next batch in plan order"
        assert time.monotonic() - t < 5
        # The release's answer follows the batch's.
        assert conn.recv_reply()["op"] == "released"
        assert leased(node, msg["stream"]) == len(held)  # one released, one taken
        # An unknown lease behind a waiting `next` is answered after it, naming the lease.
        conn.send_bytes(_wire.encode_next((), 1, 1000))
        conn.send({"op": "release", "lease": 987654321})
        assert conn.recv_reply()["op"] == "timeout"
        err = conn.recv_reply()
        assert err["op"] == "error" and err["code"] == "unknown_lease" and "987654321" in err["message"], err
    finally:
        conn.close()


def test_a_kept_batch_released_from_another_thread_frees_a_waiting_next(node):
    with shardwire.connect(node.socket).open_stream("k", batch_size=32, seed=3) as s:
        kept = []
        with pytest.raises(shardwire.Timeout):
            for _ in range(64):
                kept.append(s.next(timeout=1.5).keep())
        assert len(kept) >= 2
        got: list = []
        waited: list[float] = []

        def trainer() -> None:
            t = time.monotonic()
            got.append(s.next(timeout=30))
            waited.append(time.monotonic() - t)

        a = threading.Thread(target=trainer)
        a.start()
        # The `next` is sent and waits (for memory the kept batches hold): the SDK marks it
        # waiting, and a release from another thread is then handed over to it.
        wait_for(lambda: s._waiting, "the other thread's `next` to wait", timeout=10)
        t = time.monotonic()
        kept[0].release()
        released_in = time.monotonic() - t
        a.join(40)
        assert not a.is_alive()
        assert released_in < 2, f"release() waited {released_in:.1f} s for the stream"
        assert got and got[0] is not None, "the waiting next got no batch"
        assert waited[0] < 10, f"the next waited {waited[0]:.1f} s after the release"
        assert got[0].index == kept[-1].index + 1
        assert kept[0].released
        # The lease went: the node holds the other kept batches and the new one.
        wait_for(lambda: leased(node, s.info.stream) == len(kept), "the released lease to go")
        for b in kept[1:]:
            b.release()
        assert s.next(timeout=10) is not None  # the stream goes on as usual
