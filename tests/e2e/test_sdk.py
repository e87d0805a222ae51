"""End-to-end tests of the Python SDK (client/python) against real processes on 127.0.0.1:

    shardwire index DIR -> shardwire source -> shardwire serve -> shardwire (Python SDK)

Datasets are written with real numpy (np.save) and pyarrow (pa.ipc.new_file); every tensor the
SDK yields is compared with np.load / the pyarrow column values.

The SDK is imported from the source tree: client/python/src is put first on sys.path (by
sdk_harness.py) and on PYTHONPATH for the SDK subprocesses. That is more robust than `pip install -e` at session
start: it needs no network (an isolated build would fetch setuptools), never writes into the
shared venv, and cannot pick up a stale installed copy. `test_package_builds_a_wheel` checks
that the package itself builds and installs.

No conftest.py fixtures: the processes are started by the small `Procs` registry of
sdk_harness.py (children are conftest's `Proc`), and every child is killed at teardown, pass or
fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from conftest import http_get
from sdk_harness import (  # the shared harness; puts the SDK on sys.path
    procs,  # noqa: F401 - a fixture
    REPO,
    SDK_SRC,
    SHARDS,
    WAIT,
    Procs,
    Serve,
    child_env,
    expected_tensors,
    index,
    sdk_on_path,
    sequence,
    wait_for,
    write_mix,
)
import shardwire  # noqa: E402
from shardwire._client import _NEXT_COUNT  # noqa: E402
from shardwire.torch import effective_rank, open_at_epoch  # noqa: E402


def test_sdk_is_imported_from_the_source_tree():
    assert pathlib.Path(shardwire.__file__).resolve().is_relative_to(SDK_SRC), shardwire.__file__


# --- helpers ---------------------------------------------------------------------------------


def stream_status(admin: str, stream_id: int) -> dict[str, Any] | None:
    code, body = http_get(admin, "/v1/streams")
    assert code == 200, body
    return next((s for s in json.loads(body)["streams"] if s["id"] == stream_id), None)


def leased(admin: str, stream_id: int) -> int:
    s = stream_status(admin, stream_id)
    assert s is not None, f"stream {stream_id} not in /v1/streams"
    return int(s["leased"])


def assert_batch_matches(b: shardwire.Batch, expected: list[dict[str, np.ndarray]]) -> None:
    exp = expected[b.shard]
    assert sorted(b) == sorted(exp), f"shard {b.shard}: tensors {sorted(b)} != {sorted(exp)}"
    for name, want in exp.items():
        got = b[name]
        assert got.dtype == want.dtype, f"shard {b.shard} {name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"shard {b.shard} {name}: shape {got.shape} != {want.shape}"
        assert np.array_equal(got, want), f"shard {b.shard} {name}: values differ"


@dataclass
class World:
    """The shared cluster of this module: one source serving `mix`, one serve."""

    procs: Procs
    tmp: pathlib.Path
    source: str
    serve: Serve
    mix: pathlib.Path
    expected: list[dict[str, np.ndarray]] = field(default_factory=list)

    def client(self) -> shardwire.Client:
        return shardwire.connect(self.serve.socket)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("sdk")
    procs = Procs(tmp)
    try:
        mix = tmp / "mix"
        write_mix(mix, seed=42)
        manifest = index(mix)
        assert len(manifest["shards"]) == SHARDS
        src = procs.source({"mix": mix})
        serve = procs.serve(src, tmp / "sw.sock")
        yield World(procs, tmp, src, serve, mix, expected_tensors(mix, manifest))
    finally:
        procs.close()


# --- 1. one epoch: values, dtypes, shapes, read-only, zero-copy, exactly once ----------------


def test_one_epoch_values_readonly_zero_copy(world: World):
    with world.client().open_stream("mix", seed=7) as s:
        assert s.info.batches_per_epoch == SHARDS and s.info.epochs == 1 and s.info.memory == "host"
        assert s.info.state["epoch"] == 0 and s.info.state["index"] == 0
        region_u8 = np.frombuffer(s.region, np.uint8)
        assert len(region_u8) == s.info.region_size
        seen = []
        for i, b in enumerate(s):
            assert (b.epoch, b.index) == (0, i)
            assert_batch_matches(b, world.expected)
            for name, arr in b.items():
                assert arr.flags.writeable is False
                with pytest.raises(ValueError):
                    arr[(0,) * arr.ndim] = 1
                with pytest.raises(ValueError):
                    arr.flags.writeable = True
                # zero-copy: the array's memory is the mapped region, reached by its base chain
                assert np.shares_memory(arr, region_u8), f"{name} is not a view of the region"
                base: Any = arr
                while isinstance(base, np.ndarray):
                    base = base.base
                if isinstance(base, memoryview):
                    base = base.obj
                assert isinstance(base, __import__("mmap").mmap), type(base)
            seen.append(b.shard)
        assert sorted(seen) == list(range(SHARDS)), f"shards {seen}: each of 0..{SHARDS - 1} exactly once"
        assert s.next() is None  # still ended


# --- 2. auto-release and keep() ------------------------------------------------------------


def test_auto_release_keep_and_release(world: World):
    admin = world.serve.admin
    # The stream asks ahead of time for up to _NEXT_COUNT batches after the one it hands out,
    # and releases the batches handed out before in that request: the service then holds the
    # trainer's batch, at most one whose release waits for that request, and those asked for.
    with world.client().open_stream("mix", seed=1) as s:
        for _ in range(5):
            b = s.next(timeout=WAIT)
            assert b is not None
            assert leased(admin, s.info.stream) <= 1 + _NEXT_COUNT, "batches were not auto-released"
        assert not b.released
        b.release()
        assert b.released
        # With a `next` in flight the release goes out behind it and is not waited for: the
        # service drops the lease once it has answered that request.
        wait_for(lambda: leased(admin, s.info.stream) <= _NEXT_COUNT, "the released batch's lease to go")
        b.release()  # twice: no-op

    with world.client().open_stream("mix", seed=1) as s:
        # Every shard fetched before the first `next`: its answer then holds exactly
        # _NEXT_COUNT batches (all ready at once), not as many as happen to have arrived.
        wait_for(lambda: stream_status(admin, s.info.stream)["ready"] == SHARDS, "all shards to be ready")
        kept, copies = [], []
        for i in range(5):
            b = s.next(timeout=WAIT)
            assert b is not None
            kept.append(b.keep())
            copies.append({k: np.array(v) for k, v in b.items()})
            # Before the first keep() the stream asked for up to _NEXT_COUNT batches ahead of
            # time (those ready at once came); while batches are kept it asks for nothing ahead.
            assert leased(admin, s.info.stream) == _NEXT_COUNT, "kept batches must stay leased"
        # kept batches' bytes are unchanged while leased
        for b, c in zip(kept, copies):
            assert all(np.array_equal(b[k], c[k]) for k in c)
            assert_batch_matches(b, world.expected)
        # Leased: the five kept and `extra` more of the first answer, not handed out yet.
        # That answer is still being read, so a release goes out behind it and is not
        # waited for: the node drops the lease a moment later.
        extra = _NEXT_COUNT - 5

        def leases_become(n: int) -> None:
            wait_for(lambda: leased(admin, s.info.stream) == n, f"{n} leases")

        kept[0].release()
        kept[1].release()
        kept[1].release()  # releasing twice is a no-op
        leases_become(3 + extra)
        with kept[2] as b:
            assert b.lease == kept[2].lease
        assert kept[2].released
        leases_become(2 + extra)
        nb = s.next(timeout=WAIT)  # takes one more (one of those, or a new one); kept ones are not auto-released
        assert nb is not None
        leases_become(2 + max(extra, 1))
        with pytest.raises(shardwire.ShardwireError):
            kept[0].keep()  # too late: already released
        sid = s.info.stream
    assert kept[3].released and nb.released  # the stream closed: everything is released
    wait_for(lambda: stream_status(admin, sid) is None, f"stream {sid} gone from /v1/streams after close")


# --- 3. resume ------------------------------------------------------------------------------

TAKE_AND_HANG = r"""
import json, sys, time
import shardwire
sock, dataset, seed, epochs, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
s = shardwire.connect(sock).open_stream(dataset, seed=seed, epochs=epochs)
taken = []
for _ in range(k):
    b = s.next(timeout=60)
    taken.append([b.epoch, b.index, b.shard])
print("STATE " + json.dumps({"taken": taken, "state": s.state_dict()}), flush=True)
time.sleep(600)
"""
STATE_LINE = re.compile(r"^STATE (.*)$")


def take_in_subprocess_then_sigkill(procs: Procs, sock: str, dataset: str, seed: int, epochs: int, k: int) -> tuple[list[tuple[int, int, int]], dict[str, Any]]:
    """A separate Python process takes `k` batches, prints its state_dict() and is SIGKILLed."""
    p = procs.python(TAKE_AND_HANG, sock, dataset, seed, epochs, k)
    out = json.loads(p.wait_line(STATE_LINE).group(1))
    p.kill()
    p.wait()
    assert p.popen.returncode == -signal.SIGKILL
    return [tuple(t) for t in out["taken"]], out["state"]


@pytest.mark.parametrize("k", [3, 8, 10, 13])
def test_resume_after_sigkill(world: World, procs: Procs, k: int):
    """epochs=2, 10 batches each: k=8 stops near the end of epoch 0, k=10 exactly at the
    boundary, k=13 inside epoch 1."""
    c = world.client()
    with c.open_stream("mix", seed=5, epochs=2) as s:
        full = sequence(s)
    assert len(full) == 2 * SHARDS and [e for e, _, _ in full] == [0] * SHARDS + [1] * SHARDS
    taken, state = take_in_subprocess_then_sigkill(procs, world.serve.socket, "mix", 5, 2, k)
    assert taken == full[:k]
    assert (state["epoch"], state["index"]) == divmod(k, SHARDS)
    with c.open_stream("mix", seed=5, epochs=2, state=state) as s:
        assert s.info.state == state
        rest = []
        for b in s:
            assert_batch_matches(b, world.expected)
            rest.append((b.epoch, b.index, b.shard))
    assert rest == full[k:]


def test_resume_across_a_service_restart(world: World, procs: Procs, tmp_path: pathlib.Path):
    sock = tmp_path / "restart.sock"
    a = procs.serve(world.source, sock)
    c = shardwire.connect(a.socket)
    with c.open_stream("mix", seed=9, epochs=2) as s:
        full = sequence(s)
    taken, state = take_in_subprocess_then_sigkill(procs, a.socket, "mix", 9, 2, 8)
    assert taken == full[:8]
    live = c.open_stream("mix", seed=9, epochs=2)
    first = live.next(timeout=WAIT)
    assert first is not None
    a.proc.kill()  # the node service dies too
    a.proc.wait()
    with pytest.raises(shardwire.ConnectionClosed):
        # Batches that had arrived before it died (asked for ahead of time, up to the SDK's
        # _NEXT_COUNT) are still handed out; the next one after them finds the loss.
        for _ in range(1 + _NEXT_COUNT):
            live.next(timeout=WAIT)
    assert live.closed and first.released
    with pytest.raises(shardwire.ShardwireError, match="lost"):
        live.next()
    b = procs.serve(world.source, sock)  # a new one on the same socket path
    assert b.socket == a.socket
    with shardwire.connect(sock).open_stream("mix", seed=9, epochs=2, state=state) as s:
        rest = sequence(s)
    assert rest == full[8:]


def test_resume_with_another_world_size_is_refused(world: World):
    c = world.client()
    with c.open_stream("mix", seed=2) as s:
        s.next(timeout=WAIT)
        state = s.state_dict()
    json.dumps(state)  # a state dict is JSON-serialisable
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("mix", seed=2, rank=0, world_size=2, state=state)
    assert ei.value.code == "state_mismatch" and "world_size" in ei.value.message, repr(ei.value)


# --- 4. uneven ------------------------------------------------------------------------------


@pytest.mark.parametrize("uneven,per_rank", [("pad", 4), ("drop", 3)])
def test_uneven_world_of_three(world: World, uneven: str, per_rank: int):
    c = world.client()
    streams = [c.open_stream("mix", seed=11, rank=r, world_size=3, uneven=uneven) for r in range(3)]
    try:
        shards = []
        for s in streams:
            assert s.info.batches_per_epoch == per_rank
            got = [b.shard for b in s]
            assert len(got) == per_rank, f"rank got {got}"
            shards += got
    finally:
        for s in streams:
            s.close()
    if uneven == "pad":
        assert set(shards) == set(range(SHARDS)), f"pad must cover every shard: {sorted(shards)}"
        assert len(shards) == 12
    else:
        assert len(set(shards)) == len(shards) == 9, f"drop must not duplicate: {sorted(shards)}"


# --- 5. errors ------------------------------------------------------------------------------


def test_unknown_dataset_and_bad_plan(world: World):
    c = world.client()
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("no-such-dataset")
    assert ei.value.code == "unknown_dataset" and isinstance(ei.value, shardwire.ShardwireError)
    assert "no-such-dataset" in ei.value.message
    with pytest.raises(ValueError, match="rank must be < world_size"):  # before anything is sent
        c.open_stream("mix", rank=3, world_size=3)
    # A plan the node refuses: more ranks than shards, each dropping to none.
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("mix", rank=0, world_size=SHARDS + 1, uneven="drop")
    assert ei.value.code == "bad_plan", repr(ei.value)
    with pytest.raises(ValueError):
        c.open_stream("mix", uneven="spread")  # type: ignore[arg-type]


def test_missing_socket_path(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    missing = str(tmp_path / "nowhere" / "trainer.sock")
    with pytest.raises(shardwire.ShardwireError) as ei:
        shardwire.connect(missing)
    assert isinstance(ei.value, shardwire.ConnectError) and missing in str(ei.value)
    with pytest.raises(shardwire.ConnectError) as ei:
        shardwire.Client(missing).open_stream("mix")  # the connect inside open_stream
    assert missing in str(ei.value)
    monkeypatch.setenv("SHARDWIRE_SOCKET", missing)
    with pytest.raises(shardwire.ConnectError, match=re.escape(missing)):
        shardwire.connect()  # default from $SHARDWIRE_SOCKET
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(shardwire.ConnectError, match="not a Unix socket"):
        shardwire.connect(regular)


def test_next_times_out_when_the_source_stalls(procs: Procs, tmp_path: pathlib.Path):
    big = tmp_path / "big"
    big.mkdir()
    for i in range(2):
        np.save(big / f"s{i}.npy", np.full(3 << 20, i, dtype=np.uint8))  # 3 MiB shards
    index(big)
    src = procs.source({"big": big}, "--rate-limit", "64KiB")  # ~48 s per shard
    serve = procs.serve(src, tmp_path / "stall.sock")
    with shardwire.connect(serve.socket).open_stream("big") as s:
        t0 = time.monotonic()
        with pytest.raises(shardwire.Timeout) as ei:
            s.next(timeout=0.5)
        took = time.monotonic() - t0
        assert ei.value.code == "timeout" and isinstance(ei.value, shardwire.ShardwireError)
        assert 0.4 <= took < 30, took
        with pytest.raises(shardwire.Timeout):
            s.next(timeout=0.2)  # the stream stays usable
        assert s.state_dict()["index"] == 0


def test_a_timeout_with_every_slab_kept_lets_a_release_through(procs: Procs, tmp_path: pathlib.Path):
    """Two kept batches fill a region of two slabs, so `next(timeout=...)` times out; the
    request it sent ends on the node with it, so releasing a kept batch is answered at once
    (not queued behind a request that waits for the memory the release frees) and the next
    batch comes."""
    d = tmp_path / "two"
    d.mkdir()
    for i in range(4):
        np.save(d / f"s{i}.npy", np.full((256 << 10) - 128, i, dtype=np.uint8))  # 256 KiB files
    index(d)
    size = max(f.stat().st_size for f in d.glob("*.npy"))
    serve = procs.serve(procs.source({"two": d}), tmp_path / "two.sock", opts=("--pool-size", "1GiB", "--stream-memory", str(2 * size)))
    with shardwire.connect(serve.socket).open_stream("two") as s:
        b0 = s.next(timeout=WAIT).keep()
        b1 = s.next(timeout=WAIT).keep()
        with pytest.raises(shardwire.Timeout):
            s.next(timeout=0.3)
        assert "next" not in s._inflight, "the node ended the request with its timeout"
        t0 = time.monotonic()
        b0.release()
        assert time.monotonic() - t0 < 5
        b2 = s.next(timeout=20)
        assert b2 is not None and (b1.index, b2.index) == (1, 2)


def stop_process(pid: int) -> None:
    """Stops process `pid` and returns once every thread of it is stopped: `kill` only queues
    SIGSTOP, and until one thread dequeues it the others run on (on a loaded machine, long
    enough to answer a request sent after `kill` returned)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT
    while True:
        states = []
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                # The state follows the command name, which ends at the last ')'.
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, IndexError):
                continue  # a thread that ended
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.01)


def test_a_late_timeout_answer_does_not_fail_a_later_next(procs: Procs, tmp_path: pathlib.Path):
    """The node is stopped while `next(timeout=0.1)` waits, so its `timeout` answer comes after
    the SDK gave up (timeout + slack): a later `next()` without a timeout reads that late
    answer, asks again, and gets its batch instead of a Timeout."""
    d = tmp_path / "late"
    d.mkdir()
    for i in range(4):
        np.save(d / f"s{i}.npy", np.full((256 << 10) - 128, i, dtype=np.uint8))
    index(d)
    size = max(f.stat().st_size for f in d.glob("*.npy"))
    serve = procs.serve(procs.source({"late": d}), tmp_path / "late.sock", opts=("--pool-size", "1GiB", "--stream-memory", str(2 * size)))
    with shardwire.connect(serve.socket).open_stream("late") as s:
        b0 = s.next(timeout=WAIT).keep()
        b1 = s.next(timeout=WAIT).keep()  # both slabs held: a next waits
        stop_process(serve.proc.popen.pid)
        try:
            with pytest.raises(shardwire.Timeout):
                s.next(timeout=0.1)
        finally:
            serve.proc.popen.send_signal(signal.SIGCONT)
        assert "next" in s._inflight, "the SDK gave up before the stopped node answered"
        b0.release()
        b2 = s.next()
        assert b2 is not None and (b1.index, b2.index) == (1, 2)


# --- 6. DLPack ------------------------------------------------------------------------------


def test_dlpack_export_is_zero_copy(world: World):
    """numpy >= 2.1 exports read-only arrays with DLPack 1.0 (read-only flag): zero-copy.
    Older numpy cannot (documented in client/python/README.md with the workaround: copy)."""
    versioned = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 1)
    with world.client().open_stream("mix", seed=3) as s:
        b = s.next(timeout=WAIT)
        assert b is not None and len(b) >= 1
        for name, t in b.items():
            assert t.__dlpack_device__() == (1, 0)  # kDLCPU, device 0
            if not versioned:
                with pytest.raises(BufferError):
                    np.from_dlpack(t)
                y = np.from_dlpack(np.array(t))  # the documented workaround: a copy
                assert np.array_equal(y, t)
                continue
            y = np.from_dlpack(t)
            assert np.array_equal(y, t) and y.dtype == t.dtype and y.shape == t.shape
            assert y.__array_interface__["data"][0] == t.__array_interface__["data"][0], f"{name}: copied"
            assert y.flags.writeable is False  # the read-only flag travels with DLPack >= 1.0


# --- 7. torch helpers (torch itself is not needed) -------------------------------------------


def test_effective_rank_is_a_bijection():
    for world_size in range(1, 5):
        for workers in range(1, 5):
            got = [effective_rank(r, world_size, w, workers) for r in range(world_size) for w in range(workers)]
            assert all(ew == world_size * workers for _, ew in got)
            assert sorted(er for er, _ in got) == list(range(world_size * workers))
    assert effective_rank(1, 2, 3, 4) == (7, 8)
    assert effective_rank(0, 1) == (0, 1)
    for bad in [(2, 2, 0, 1), (0, 0, 0, 1), (0, 1, 1, 1), (0, 1, 0, 0), (-1, 2, 0, 1)]:
        with pytest.raises(ValueError):
            effective_rank(*bad)


def test_ranks_times_workers_cover_every_shard(world: World):
    """2 DDP ranks x 5 workers = 10 streams over 10 shards: each shard exactly once."""
    c = world.client()
    shards = []
    for r in range(2):
        for w in range(5):
            er, ew = effective_rank(r, 2, w, 5)
            with c.open_stream("mix", seed=4, rank=er, world_size=ew) as s:
                shards += [b.shard for b in s]
    assert sorted(shards) == list(range(SHARDS))


def test_open_at_epoch_delivers_that_epoch(world: World):
    c = world.client()
    with c.open_stream("mix", seed=6, epochs=3) as s:
        full = sequence(s)
    with open_at_epoch(c, "mix", start_epoch=1, epochs=1, seed=6) as s:
        assert sequence(s) == full[SHARDS : 2 * SHARDS]
    with open_at_epoch(c, "mix", start_epoch=0, epochs=2, seed=6) as s:
        assert sequence(s) == full[: 2 * SHARDS]


def test_dataset_iteration_without_torch(world: World, monkeypatch: pytest.MonkeyPatch):
    """The body of shardwire.torch.IterableDataset (its torch-free mixin), with torch's
    rank/worker lookup replaced by 2 DDP ranks x 2 workers: together they cover every shard;
    copy=True yields writable copies, copy=False the read-only views; set_epoch works."""
    import shardwire.torch as swt

    c = world.client()
    for copy in (True, False):
        for epoch in (0, 1):
            got: list[int] = []
            for r in range(2):
                for w in range(2):
                    er, ew = effective_rank(r, 2, w, 2)
                    with c.open_stream("mix", seed=8, rank=er, world_size=ew, epochs=epoch + 1) as s:
                        want = [sh for e, _, sh in sequence(s) if e == epoch]
                    monkeypatch.setattr(swt, "_torch_ranks", lambda rank, world_size, r=r, w=w: effective_rank(r, 2, w, 2))
                    ds = swt._DatasetMixin("mix", socket=world.serve.socket, seed=8, copy=copy, timeout=WAIT)
                    ds.set_epoch(epoch)
                    mine = []
                    for item in ds:
                        assert all(a.flags.writeable is copy for a in item.values())
                        (shard,) = [i for i, e in enumerate(world.expected) if sorted(e) == sorted(item) and all(np.array_equal(e[k], item[k]) for k in e)]
                        mine.append(shard)
                    assert mine == want, f"rank {r} worker {w} epoch {epoch}"
                    got += mine
            # 10 shards over 4 streams, pad: 3 items each, every shard at least once
            assert len(got) == 12 and set(got) == set(range(SHARDS)), got


def test_importing_shardwire_does_not_import_torch():
    code = "import sys, shardwire, shardwire.torch; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(sdk_on_path()), timeout=WAIT)
    assert r.returncode == 0, r.stderr
    if importlib.util.find_spec("torch") is None:
        import shardwire.torch as swt

        with pytest.raises(ImportError):
            swt.IterableDataset  # noqa: B018 - touching it imports torch


# --- packaging ------------------------------------------------------------------------------


def test_pyproject_declares_numpy_only():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pkg = REPO / "client" / "python"
    project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    assert project["name"] == "shardwire" and project["requires-python"] == ">=3.10"
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["numpy"]
    assert (pkg / "src" / "shardwire" / "py.typed").is_file()


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("wheel") is None,
                    reason="an offline wheel build needs setuptools and wheel in this interpreter")
def test_package_builds_a_wheel(tmp_path: pathlib.Path):
    """`pip wheel` of a copy of client/python, offline (--no-build-isolation uses this
    interpreter's setuptools; the copy keeps build/ and *.egg-info out of the source tree)."""
    src = tmp_path / "pkg"
    shutil.copytree(REPO / "client" / "python", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("shardwire-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for f in ["__init__.py", "_client.py", "_errors.py", "_wire.py", "torch.py", "py.typed"]:
        assert f"shardwire/{f}" in names, sorted(names)
