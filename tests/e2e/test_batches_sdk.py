"""Batch mode through the Python SDK and real torch: `open_stream(batch_size=...)` gives
read-only arrays shaped `[batch_size, ...]`, and `shardwire.torch.IterableDataset` with
torchdata's `StatefulDataLoader` resumes exactly, without replay (the node's delivered
counters prove it), with 0 and with 2 workers."""

from __future__ import annotations

import collections
import mmap
import socket
import struct
import sys

import numpy as np
import pytest

from conftest import REPO, arrow_batches, index_dataset, serve_dataset, wait_for, write_arrow

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402

K = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("bsdk") / "ds"
    rows = {}
    next_id = 0
    for f in range(4):
        sizes = [30 + 7 * i for i in range(10)]
        batches = arrow_batches(sizes, k=K, seed=f + 40, id_start=next_id)
        next_id += sum(sizes)
        write_arrow(d / f"p{f}.arrow", batches, stream=False)
        for b in batches:
            emb = b.column(1).flatten().to_numpy().reshape(-1, K)
            for i, e in zip(b.column(0).to_numpy(), emb):
                rows[int(i)] = e
    index_dataset(d)
    return d, rows


@pytest.fixture
def node(sw, data):
    return serve_dataset(sw, "b", data[0])


def test_batches_are_read_only_arrays_of_batch_size(node, data):
    _, rows = data
    client = shardwire.connect(node.socket)
    seen = collections.Counter()
    with client.open_stream("b", batch_size=32, seed=4, drop_last=True) as s:
        assert s.info.batches_per_epoch == len(rows) // 32
        for b in s:
            assert b.shard is None and b["id"].shape == (32,) and b["emb"].shape == (32, K)
            assert not b["emb"].flags.writeable
            for i, e in zip(b["id"], b["emb"]):
                assert np.array_equal(e, rows[int(i)])
                seen[int(i)] += 1
    assert max(seen.values()) == 1 and len(rows) - len(seen) < 32
    with pytest.raises(ValueError, match="need batch_size"):
        client.open_stream("b", shuffle="none")
    with pytest.raises(shardwire.ServiceError, match="does not fit partitions"):
        client.open_stream("b", batch_size=4, world_size=3, partitions=2)


def test_a_roomy_region_keeps_eight_batches_ready_for_one_next(node, data):
    """Batch mode keeps up to 8 assembled batches waiting where the region has room (here 16
    MiB for batches of a few hundred bytes), so one `next` with `count` 8, sent after a pause,
    is answered with 8 batches in one write, each but the last marked `more`, in plan order."""
    from shardwire import _wire

    with shardwire.connect(node.socket).open_stream("b", batch_size=8, seed=6) as s:
        want = [b["id"].copy() for _, b in zip(range(9), s)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(node.socket)
    conn = _wire.Conn(sock)
    try:
        conn.send({"op": "attach", "version": 1, "dataset": "b", "batch_size": 8, "seed": 6, "batch_encoding": "binary"})
        msg, fds = conn.recv(want_fds=True)
        assert msg["op"] == "attached", msg
        region = np.frombuffer(mmap.mmap(fds[0], msg["region_size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), np.uint8)
        _wire._close_fds(fds)
        conn.send_bytes(_wire.encode_next(()))
        first = conn.recv_reply()
        assert first["op"] == "batch" and not first["more"], first

        def ids(m):
            (v,) = [v for v in m["views"] if v.name == "id"]
            return region[v.offset : v.offset + v.length].view(np.int64).tolist()

        got = [ids(first)]  # before its release: then the node may reuse its bytes

        def ready() -> int:
            return next(x["ready"] for x in node.status()["streams"] if x["id"] == msg["stream"])

        wait_for(lambda: ready() == 8, "the node to fill its ready-ahead queue")
        conn.send_bytes(_wire.encode_next((first["lease"],), 8))
        group = [conn.recv_reply()]
        while group[-1]["more"]:
            group.append(conn.recv_reply())
        assert len(group) == 8, [m["index"] for m in group]
        assert [m["index"] for m in group] == list(range(1, 9))
        got += [ids(m) for m in group]
        assert got == [w.tolist() for w in want]
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            struct.unpack("<I", sock.recv(4))  # nothing beyond the count came
    finally:
        conn.close()


def test_a_state_from_any_rank_resumes_every_rank(node, data):
    client = shardwire.connect(node.socket)
    full = []
    for r in range(2):
        with client.open_stream("b", batch_size=8, world_size=2, rank=r, seed=1) as s:
            full.append([b["id"].copy() for b in s])
    with client.open_stream("b", batch_size=8, world_size=2, rank=1, seed=1) as s:
        for _ in range(3):
            s.next().release()
        st = s.state_dict()
    assert st["index"] == 3 and st["cursor"] == 48
    # The state came from rank 1; it resumes rank 0 too, and on one rank with batch 16.
    with client.open_stream("b", batch_size=8, world_size=2, rank=0, seed=1, state=st) as s:
        assert [b["id"].tolist() for b in s] == [x.tolist() for x in full[0][3:]]
    with client.open_stream("b", batch_size=16, world_size=1, seed=1, partitions=2, state=st) as s:
        got = [sorted(b["id"].tolist()) for b in s]
    want = [sorted(np.concatenate([full[0][k], full[1][k]]).tolist()) for k in range(3, len(full[0]))]
    assert got == want


torch = pytest.importorskip("torch", reason="torch is installed by scripts/test (requirements-frameworks.txt)")
stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is installed by scripts/test")


def delivered(node) -> int:
    """Batches the node has handed to trainers, once no stream is open: a stream still open
    (a DataLoader worker not yet gone, or a batch asked for ahead of time and not yet
    answered) could still take one."""
    wait_for(lambda: node.status()["streams"] == [], "every stream closed")
    return node.status()["counters"]["batches_delivered"]


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly_without_replay(node, data, workers):
    from shardwire.torch import IterableDataset

    def loader(ds):
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    def dataset():
        return IterableDataset("b", socket=node.socket, seed=8, batch_size=16, drop_last=True)

    full = [b["id"].tolist() for b in loader(dataset())]
    assert len(full) == len(data[1]) // 16 and all(len(x) == 16 for x in full)
    k = 5
    dl = loader(dataset())
    it = iter(dl)
    head = [next(it)["id"].tolist() for _ in range(k)]
    sd = dl.state_dict()
    del it, dl
    before = delivered(node)
    dl2 = loader(dataset())
    dl2.load_state_dict(sd)
    tail = [b["id"].tolist() for b in dl2]
    del dl2
    assert head + tail == full, "the resumed loader continues exactly where the checkpoint was"
    assert delivered(node) - before == len(full) - k, "nothing was replayed: the node delivered only the rest"


def test_http_batches_equal_the_socket_and_states_cross(node, data):
    """The trainer HTTP API in batch mode: the same batches as the Unix socket (ids and rows),
    and a state saved over one transport resumes over the other."""
    _, rows = data
    opts = dict(batch_size=16, seed=6, shuffle="block", shuffle_block=64, drop_last=True)
    with shardwire.connect(node.socket).open_stream("b", **opts) as s:
        want = [b["id"].tolist() for b in s]
    http = shardwire.connect_http(node.admin)
    with http.open_stream("b", **opts) as s:
        assert isinstance(s, shardwire.HttpStream) and s.info.batches_per_epoch == len(want)
        got = []
        for b in s:
            assert b.shard is None and b["id"].shape == (16,) and b["emb"].shape == (16, K)
            for i, e in zip(b["id"], b["emb"]):
                assert np.array_equal(e, rows[int(i)])
            got.append(b["id"].tolist())
            if len(got) == 5:
                st = s.state_dict()
                break
    assert got == want[:5]
    with shardwire.connect(node.socket).open_stream("b", **opts, state=st) as s:  # HTTP -> socket
        middle = [s.next()["id"].tolist() for _ in range(4)]
        st2 = s.state_dict()
    with http.open_stream("b", **opts, state=st2) as s:  # socket -> HTTP
        rest = [b["id"].tolist() for b in s]
    assert got + middle + rest == want


def test_http_takes_worker_and_num_workers_like_the_socket(node, data):
    """`worker`/`num_workers` (a DataLoader worker's share) over HTTP: worker w of 3 gets the
    rank's batches w, w + 3, ..., as over the socket."""
    opts = dict(batch_size=16, seed=6, drop_last=True)
    with shardwire.connect(node.socket).open_stream("b", **opts) as s:
        want = [b["id"].tolist() for b in s]
    http = shardwire.connect_http(node.admin)
    for w in range(3):
        with http.open_stream("b", **opts, worker=w, num_workers=3) as s:
            got = [b["id"].tolist() for b in s]
        with shardwire.connect(node.socket).open_stream("b", **opts, worker=w, num_workers=3) as s:
            assert [b["id"].tolist() for b in s] == got
        assert got == want[w::3], f"worker {w}"


def test_a_program_that_exits_mid_epoch_exits_quietly(node, data):
    """A training script that stops early and exits, its DataLoader iterator and a stream's
    iterator unfinished: the streams are closed by generators finalised at interpreter exit,
    after the SDK modules' globals are gone. Nothing may be printed (an earlier SDK printed
    "Exception ignored in: <generator ...> AttributeError ... SHUT_RDWR")."""
    import subprocess

    from conftest import REPO

    code = f"""
import sys
sys.path.insert(0, {str(REPO / "client" / "python" / "src")!r})
import torch
import shardwire
from shardwire.torch import IterableDataset
it = iter(torch.utils.data.DataLoader(IterableDataset("b", socket={str(node.socket)!r}, batch_size=8, epochs=3), batch_size=None))
for _ in range(3):
    next(it)
g = iter(shardwire.connect({str(node.socket)!r}).open_stream("b", batch_size=8, epochs=3))
next(g)
print("stopping early")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "stopping early", (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stderr == "", r.stderr[-3000:]
