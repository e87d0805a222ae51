"""Shard mode resumes exactly, without replay: `Client.open_stream(state=...)` and
`shardwire.torch.IterableDataset` (no `batch_size`) in torchdata's `StatefulDataLoader` with 0
and with 2 workers, mid-epoch, inside the second epoch of a `set_epoch` + `epochs` stream and
after the last shard. The node's `batches_delivered` counter proves that the resumed run was
handed only the shards not yet yielded. A state of another world size or worker count is
refused with `state_mismatch`, naming the field.

In both modes (shard and batch), through `StatefulDataLoader` with 0 and 2 workers: a
checkpoint saved after an epoch ended and resumed with `set_epoch(e + 1)` delivers that epoch
in full; a checkpoint taken right after a resume, before its first item, keeps the loaded
position; a batch-mode checkpoint at the last batch (each worker's position at the start of
the next epoch, at its own index there) resumes to nothing. A worker that has yielded nothing
since `iter(dataset)` checkpoints the start of its share (not the previous iteration's end, nor
the main process's position); an error in a worker is continued exactly (one persistent
worker by iterating again, two through `loader.load_state_dict(loader.state_dict())`); a
`bad_plan` of the workers' streams and a state of the wrong shape say what is wrong."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

from conftest import REPO, die_with_parent, serve_dataset, wait_for, write_id_dataset

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402
from shardwire._client import _NEXT_COUNT  # noqa: E402

FILES, PER_FILE = 2, 8
SHARDS = FILES * PER_FILE  # one shard per record batch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sresume") / "ds"
    write_id_dataset(d, [[5 + f + 2 * i for i in range(PER_FILE)] for f in range(FILES)])
    return d


@pytest.fixture
def node(sw, data):
    return serve_dataset(sw, "s", data)


def delivered(node) -> int:
    """Batches the node has handed to trainers, over all streams, once none is open (a stream
    still open, e.g. a DataLoader worker not yet gone, could still take one)."""
    wait_for(lambda: node.status()["streams"] == [], "every stream closed")
    return node.status()["counters"]["batches_delivered"]


def ids(item: Any) -> list[int]:
    """A shard's identity: its `id` column (every id is in exactly one shard)."""
    return [int(i) for i in item["id"]]


def test_the_shards_are_the_record_batches(node):
    with shardwire.connect(node.socket).open_stream("s", seed=3) as s:
        assert s.info.batches_per_epoch == SHARDS
        firsts = sorted(ids(b)[0] for b in s)
    assert len(set(firsts)) == SHARDS


def test_open_stream_resumes_at_the_saved_shard(node):
    """A shard-mode `state` (here rank 1 of 2, two epochs) resumes at the next shard, in the
    second epoch too, O(1) on the node: only the remaining shards are delivered; a state saved
    after the last shard resumes to an empty stream."""
    client = shardwire.connect(node.socket)
    opts = dict(seed=3, rank=1, world_size=2, epochs=2)
    per_rank = SHARDS // 2
    with client.open_stream("s", **opts) as s:
        full = [(b.epoch, b.index, ids(b)) for b in s]
    assert [(e, i) for e, i, _ in full] == [(e, i) for e in range(2) for i in range(per_rank)]
    for k in (3, per_rank + 2, 2 * per_rank):  # mid-epoch 0, inside epoch 1, after the last
        with client.open_stream("s", **opts) as s:
            head = [ids(s.next()) for _ in range(k)]
            state = s.state_dict()
        assert (state["epoch"], state["index"]) == divmod(k, per_rank)
        assert set(state) == {"epoch", "index", "seed", "fingerprint"}
        before = delivered(node)
        with client.open_stream("s", **opts, state=state) as s:
            tail = [(b.epoch, b.index, ids(b)) for b in s]
        assert head == [x for _, _, x in full[:k]]
        assert tail == full[k:], f"resumed after {k} shards"
        assert delivered(node) - before == len(full) - k, "nothing was replayed"


@pytest.fixture
def stateful() -> Any:
    """torchdata's `stateful_dataloader` module; the tests that need it (and torch) skip, with
    the reason, where they are missing. The tests above need neither."""
    pytest.importorskip("torch", reason="torch is installed by scripts/test (requirements-frameworks.txt)")
    return pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is installed by scripts/test")


def dataset_states(sd: Any) -> list[dict]:
    """The IterableDataset states inside a StatefulDataLoader state (one per worker, or the
    main process's): every `{"epoch", "stream"}` dict in it."""
    out = []
    if isinstance(sd, dict):
        if set(sd) == {"epoch", "stream"}:
            return [sd]
        for v in sd.values():
            out += dataset_states(v)
    return out


# (set_epoch, epochs, k): mid-epoch; inside the second epoch of set_epoch(1) + epochs=2 (the
# stream spans epochs 1..2); after the last shard (saved before the loader saw its end).
CASES = {"mid-epoch": (0, 1, 5), "second-epoch": (1, 2, SHARDS + 3), "end": (0, 1, SHARDS)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_shard_mode_exactly_without_replay(node, workers, case, stateful):
    from shardwire.torch import IterableDataset

    start, epochs, k = CASES[case]
    prefetch = 2  # StatefulDataLoader's default prefetch_factor (with workers)

    def loader():
        ds = IterableDataset("s", socket=node.socket, seed=3, epochs=epochs, timeout=60)
        ds.set_epoch(start)
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    full = [ids(item) for item in loader()]
    assert len(full) == epochs * SHARDS and len({x[0] for x in full}) == SHARDS

    before = delivered(node)
    dl = loader()
    it = iter(dl)
    head = [ids(next(it)) for _ in range(k)]
    sd = copy.deepcopy(dl.state_dict())  # a checkpoint
    del it, dl  # stops the workers (joined) and closes the streams
    first = delivered(node) - before

    states = dataset_states(sd)
    assert len(states) == max(workers, 1), sd
    if case == "second-epoch":
        # Every worker's position lies in epoch 2 of the stream that started at epoch 1.
        assert all(s["epoch"] == start and s["stream"]["epoch"] == start + 1 for s in states), states
    if case == "end":
        assert all(s["stream"]["epoch"] == start + epochs and s["stream"]["index"] == 0 for s in states), states

    dl2 = loader()
    dl2.load_state_dict(sd)
    tail = [ids(item) for item in dl2]
    resumed = delivered(node) - before - first

    assert head == full[:k]
    assert tail == full[k:], "the resumed loader continues exactly after item k"
    # The resumed run was handed exactly the items not yet yielded, none of the k again.
    assert resumed == len(full) - k, f"resumed run delivered {resumed}, want {len(full) - k}: replay"
    # The interrupted run was handed the k items it yielded plus what its workers had
    # prefetched: with workers, StatefulDataLoader keeps up to prefetch_factor * num_workers
    # fetches outstanding, each of which may have taken a shard from the node that was never
    # yielded. Those shards are not in the saved state (a worker's state travels with each item
    # it yields, so the checkpoint holds each worker's position after its last *yielded* item),
    # and the resumed run takes them again: that is the bound on what the node delivers twice
    # over the two runs, never an item the trainer saw. With 0 workers the DataLoader prefetches
    # nothing. On top of that each stream (the main process's, or each worker's) has asked the
    # node ahead of time for up to _NEXT_COUNT batches after the one it handed out.
    ahead = prefetch * workers + _NEXT_COUNT * max(workers, 1)
    assert k <= first <= k + ahead, (first, k)
    assert resumed + first - len(full) <= ahead


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_state_of_another_world_size_is_refused(node, workers, stateful):
    """A checkpoint of world size 1 resumed on world size 2: the node refuses the saved
    stream state with `state_mismatch`, naming `world_size`; the loader does not start over."""
    from shardwire.torch import IterableDataset

    def loader(world_size: int):
        ds = IterableDataset("s", socket=node.socket, seed=3, rank=0, world_size=world_size, timeout=60)
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    dl = loader(1)
    it = iter(dl)
    for _ in range(3):
        next(it)
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    before = delivered(node)
    dl2 = loader(2)
    dl2.load_state_dict(sd)
    # In a worker the ServiceError reaches the main process re-raised by torch as a
    # RuntimeError that quotes it.
    with pytest.raises(shardwire.ServiceError if workers == 0 else RuntimeError) as e:
        next(iter(dl2))
    assert "state_mismatch" in str(e.value) and "`world_size`" in str(e.value), str(e.value)
    assert "num_workers" in str(e.value), str(e.value)
    if workers == 0:
        assert e.value.code == "state_mismatch"
    del dl2
    assert delivered(node) == before, "nothing was delivered"


def test_a_worker_state_resumes_only_its_own_stream(node, stateful):
    """A worker's state (stream rank 1 of 2) loaded in the main process (stream rank 0 of 1)
    is refused, naming the field; loaded in the same worker slot it resumes exactly."""
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3)
    dl = stateful.StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(dl)
    for _ in range(4):
        next(it)
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    w1 = sd["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    assert w1["stream"]["index"] == 2, w1
    main = IterableDataset("s", socket=node.socket, seed=3)
    main.load_state_dict(w1)
    with pytest.raises(shardwire.ServiceError, match="state_mismatch: state fingerprint differs in `world_size`") as e:
        next(iter(main))
    assert e.value.code == "state_mismatch"
    # The same state opened as the stream it came from (rank 1 of 2) resumes at its shard 2.
    with shardwire.connect(node.socket).open_stream("s", seed=3, rank=1, world_size=2) as s:
        want = [ids(b) for b in s][2:]
    with shardwire.connect(node.socket).open_stream("s", seed=3, rank=1, world_size=2, state=w1["stream"]) as s:
        assert [ids(b) for b in s] == want


def test_a_checkpoint_after_set_epoch_starts_that_epoch(node, stateful):
    """`set_epoch` forgets the finished iteration's position: with 0 workers (the dataset of
    the main process lives on), a checkpoint taken after epoch 0 ended and `set_epoch(2)`
    resumes at the start of epoch 2, not at the end of epoch 0's stream."""
    from shardwire.torch import IterableDataset

    def loader(epoch: int):
        ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
        ds.set_epoch(epoch)
        return ds, stateful.StatefulDataLoader(ds, batch_size=None, num_workers=0)

    want = [ids(item) for item in loader(2)[1]]
    ds, dl = loader(0)
    assert len(list(dl)) == SHARDS
    ds.set_epoch(2)
    sd = copy.deepcopy(dl.state_dict())
    assert dataset_states(sd) == [{"epoch": 2, "stream": None}], sd
    ds2, dl2 = loader(0)
    dl2.load_state_dict(sd)
    assert [ids(item) for item in dl2] == want


def test_a_batch_mode_checkpoint_after_the_last_batch_resumes_to_nothing(node, stateful):
    """Batch mode, for contrast: a StatefulDataLoader checkpoint taken after the last batch of
    the stream's epochs resumes to an empty stream (it once replayed a whole extra epoch)."""
    from shardwire.torch import IterableDataset

    def loader():
        ds = IterableDataset("s", socket=node.socket, seed=3, batch_size=4, epochs=1, timeout=60)
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=0)

    dl = loader()
    items = [ids(item) for item in dl]
    assert items and all(len(x) == 4 for x in items)
    sd = copy.deepcopy(dl.state_dict())
    before = delivered(node)
    dl2 = loader()
    dl2.load_state_dict(sd)
    assert [ids(item) for item in dl2] == []
    assert delivered(node) == before, "nothing is handed out again"


# The IterableDataset keywords of each mode: one shard per item, or batches of 4 samples.
MODES = {"shard": {}, "batch": {"batch_size": 4}}


def mode_loader(node, stateful, mode: str, workers: int, epoch: int | None = None) -> tuple[Any, Any]:
    """(dataset, StatefulDataLoader) of dataset `s` in `mode`, `set_epoch(epoch)` if given."""
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60, **MODES[mode])
    if epoch is not None:
        ds.set_epoch(epoch)
    return ds, stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_after_the_epoch_ended_resumes_at_the_next_epoch_in_full(node, stateful, mode, workers):
    """The usual loop: `set_epoch(e)`, iterate the loader to its end, save a checkpoint; after a
    restart, `load_state_dict` and `set_epoch(e + 1)`. The saved stream lies at the end of its
    iteration ({epoch: 1, index: 0}), so the epoch `set_epoch` names wins and is delivered in
    full (with 0 workers StatefulDataLoader loads the dataset's state after `set_epoch`; it
    once reset the epoch to 0 and resumed epoch 0's finished stream: nothing). Resumed with
    `set_epoch(0)`, the saved epoch itself, the finished epoch is not replayed (0 workers:
    the dataset sees the state; with workers StatefulDataLoader drops a finished iteration's
    state, so that case is left out)."""
    want = [ids(item) for item in mode_loader(node, stateful, mode, workers, epoch=1)[1]]
    if mode == "batch":
        assert want and all(len(x) == 4 for x in want)
    else:
        assert len(want) == SHARDS
    _, dl = mode_loader(node, stateful, mode, workers, epoch=0)
    epoch0 = [ids(item) for item in dl]
    assert epoch0 and epoch0 != want
    sd = copy.deepcopy(dl.state_dict())
    del dl
    if workers == 0:
        (state,) = dataset_states(sd)
        assert state["epoch"] == 0 and (state["stream"]["epoch"], state["stream"]["index"]) == (1, 0), state

    before = delivered(node)
    ds2, dl2 = mode_loader(node, stateful, mode, workers)
    dl2.load_state_dict(sd)
    ds2.set_epoch(1)
    assert [ids(item) for item in dl2] == want
    del dl2
    resumed = delivered(node) - before
    if workers:
        # StatefulDataLoader starts a set of workers with the saved states and drops them
        # unused (the saved iteration had ended), after it gave each its prefetch of indices
        # (2): each may have opened its stream of epoch 1 and fetched up to 2 items, its
        # stream asking the node for up to _NEXT_COUNT batches ahead of them.
        assert len(want) <= resumed <= len(want) + workers * (2 + _NEXT_COUNT), resumed
    else:
        assert resumed == len(want), "epoch 1 once, nothing of epoch 0 again"
        ds3, dl3 = mode_loader(node, stateful, mode, workers)
        dl3.load_state_dict(sd)
        ds3.set_epoch(0)
        assert [ids(item) for item in dl3] == [], "the finished epoch 0 is not replayed"
        ds3.set_epoch(1)
        assert [ids(item) for item in dl3] == want


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_taken_before_the_first_item_of_a_resumed_loader_keeps_the_position(node, stateful, mode, workers):
    """A checkpoint saved right after resuming (`load_state_dict`, `iter`), before the first
    item, holds the loaded position (it once held `stream: None`, and resuming from it
    restarted the epoch): resumed from it, the loader continues after the first run's items."""
    full = [ids(item) for item in mode_loader(node, stateful, mode, workers)[1]]
    k = 5
    _, dl = mode_loader(node, stateful, mode, workers)
    it = iter(dl)
    head = [ids(next(it)) for _ in range(k)]
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    _, dl2 = mode_loader(node, stateful, mode, workers)
    dl2.load_state_dict(sd)
    it2 = iter(dl2)
    sd2 = copy.deepcopy(dl2.state_dict())
    del it2, dl2
    assert dataset_states(sd2) == dataset_states(sd)
    _, dl3 = mode_loader(node, stateful, mode, workers)
    dl3.load_state_dict(sd2)
    assert head + [ids(item) for item in dl3] == full


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_mode_checkpoint_at_the_last_batch_resumes_to_nothing(node, stateful, workers):
    """A batch-mode checkpoint taken while the last batch is in use (the loader has not seen its
    end yet) resumes to nothing. With 2 workers, worker `w` takes the rank's batches `w, w + 2,
    ...`, so after the epoch its position is the start of the next epoch at index `w`: worker
    1's (index 1) was once taken for a position inside that epoch and resumed a whole epoch's
    share of extra batches."""
    full = [ids(item) for item in mode_loader(node, stateful, "batch", workers)[1]]
    _, dl = mode_loader(node, stateful, "batch", workers)
    it = iter(dl)
    assert [ids(next(it)) for _ in range(len(full))] == full
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    ends = sorted((s["stream"]["epoch"], s["stream"]["index"]) for s in dataset_states(sd))
    assert ends == [(1, w) for w in range(max(workers, 1))], ends
    before = delivered(node)
    _, dl2 = mode_loader(node, stateful, "batch", workers)
    dl2.load_state_dict(sd)
    assert [ids(item) for item in dl2] == []
    del dl2
    assert delivered(node) == before, "nothing is handed out again"


def fail_the_nth_next(m: pytest.MonkeyPatch, n: int) -> None:
    """Makes `Stream.next` raise a Timeout at its `n`-th call (within the context `m`)."""
    from shardwire import _client

    real, calls = _client.Stream.next, {"n": 0}

    def flaky(self, timeout=None):
        calls["n"] += 1
        if calls["n"] == n:
            raise shardwire.Timeout("injected: no batch in time")
        return real(self, timeout)

    m.setattr(_client.Stream, "next", flaky)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_an_iteration_ended_by_an_error_is_continued_by_the_next_not_replayed(node, monkeypatch, batch_size):
    """A training loop that catches a `Timeout` (or a lost node) and iterates the dataset
    again gets the items after the last one it took, not the epoch from its start: the next
    iteration opens where `state_dict` says it stopped. Before, the stream's position was
    dropped with the stream, so the epoch's first items came a second time. Leaving the loop
    early (`break`) still starts the epoch over on the next iteration."""
    from shardwire.torch import IterableDataset

    kw = {} if batch_size is None else {"batch_size": batch_size}
    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60, **kw)
    with monkeypatch.context() as m:
        fail_the_nth_next(m, 4)
        got: list[list[int]] = []
        with pytest.raises(shardwire.Timeout):
            for item in ds:
                got.append(ids(item))
        assert len(got) == 3
        saved = ds.state_dict()
        got += [ids(item) for item in ds]  # the loop goes round again after the error
    with shardwire.connect(node.socket).open_stream("s", seed=3, **kw) as s:
        want = [ids(b) for b in s]
    assert got == want, "each item once, in order"
    assert saved["stream"] is not None
    # `break` is not an error: the next iteration starts the epoch again.
    for item in ds:
        first = ids(item)
        break
    assert first == want[0]
    assert [ids(item) for item in ds] == want


def test_a_copy_that_fails_leaves_the_position_before_its_item(node, monkeypatch):
    """The position moves past an item only once its copy exists: a copy that fails (out of
    memory, an interrupt) leaves it to the next iteration. Before, the position had moved
    first, and the item was skipped by the continuation and by any checkpoint after it."""
    from shardwire import torch as swt

    ds = swt.IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    real, calls = swt._copy, {"n": 0}

    def failing(view):
        calls["n"] += 1
        if calls["n"] == 3:  # the 2nd item's copy (one tensor per item)
            raise MemoryError("injected: no memory for the copy")
        return real(view)

    got: list[list[int]] = []
    with monkeypatch.context() as m:
        m.setattr(swt, "_copy", failing)
        with pytest.raises(MemoryError):
            for item in ds:
                got.append(ids(item))
    got += [ids(item) for item in ds]
    with shardwire.connect(node.socket).open_stream("s", seed=3) as s:
        want = [ids(b) for b in s]
    assert got == want, "each item once, in order"


def test_set_epoch_naming_the_same_epoch_keeps_the_resume_point_in_the_state(node, monkeypatch):
    """After an error mid-epoch, `set_epoch` naming the same epoch keeps the resume point, and
    `state_dict()` says so: before, it said the epoch's start while the next iteration went on
    from the resume point, so a checkpoint then replayed the epoch's first items."""
    from shardwire import _client
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    real, calls = _client.Stream.next, {"n": 0}

    def flaky(self, timeout=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise shardwire.Timeout("injected")
        return real(self, timeout)

    with monkeypatch.context() as m:
        m.setattr(_client.Stream, "next", flaky)
        with pytest.raises(shardwire.Timeout):
            for _ in ds:
                pass
    saved = ds.state_dict()["stream"]
    assert saved is not None and saved["index"] == 3
    ds.set_epoch(0)
    assert ds.state_dict()["stream"] == saved
    ds.set_epoch(1)
    assert ds.state_dict()["stream"] is None


def test_persistent_workers_follow_set_epoch(node):
    """A persistent DataLoader worker keeps its copy of the dataset from one epoch to the next;
    `set_epoch` in the main process reaches it (the epoch lives in shared memory). Before, the
    worker delivered its first epoch again, in the same order, every epoch."""
    torch = pytest.importorskip("torch", reason="torch is not installed (tests/e2e/requirements-frameworks.txt)")
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True,
                                         multiprocessing_context="fork")
    epochs = []
    for e in (0, 1):
        ds.set_epoch(e)
        epochs.append([ids(item) for item in loader])
    del loader
    client = shardwire.connect(node.socket)
    for e, got in enumerate(epochs):
        with swt_open_at(client, e) as s:
            assert got == [ids(b) for b in s], f"epoch {e}"
    assert epochs[0] != epochs[1]


def swt_open_at(client, epoch):
    from shardwire.torch import open_at_epoch

    return open_at_epoch(client, "s", start_epoch=epoch, seed=3)


def _rank_script(socket: str, rank: int | None, world: int | None, init: bool) -> str:
    return f"""
import json, os, sys
sys.path.insert(0, {str(REPO / "client" / "python" / "src")!r})
import torch, torch.distributed as dist
from shardwire.torch import IterableDataset
if {init!r}:
    dist.init_process_group("gloo", rank={rank}, world_size={world})
ds = IterableDataset("s", socket={socket!r}, seed=3, timeout=60)
loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
print(json.dumps([[int(i) for i in item["id"]] for item in loader]))
if {init!r}:
    dist.destroy_process_group()
"""


def test_spawned_workers_take_their_ddp_rank_from_the_parent(node, tmp_path):
    """Two DDP ranks (gloo, torch.distributed initialised) whose DataLoaders start 2 workers
    with spawn, a fresh interpreter where torch.distributed is not initialised: each rank's
    workers still open that rank's share, so the ranks' shards are disjoint and cover the
    dataset. Before, every rank's workers opened rank 0 of 1: both ranks read every shard.
    Without an initialised group, workers take RANK and WORLD_SIZE (as torchrun sets them)."""
    pytest.importorskip("torch", reason="torch is not installed (tests/e2e/requirements-frameworks.txt)")
    import json
    import os
    import socket as so
    import subprocess

    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    procs = [subprocess.Popen([sys.executable, "-c", _rank_script(node.socket, r, 2, True)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:  # one rank that died leaves the other waiting in gloo's init
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    ranks = [{tuple(x) for x in json.loads(o[0])} for o in outs]
    assert not ranks[0] & ranks[1], "the two ranks read the same shards"
    assert len(ranks[0] | ranks[1]) == SHARDS
    # torchrun's variables, no process group.
    env1 = {**env, "RANK": "1", "WORLD_SIZE": "2"}
    p = subprocess.run([sys.executable, "-c", _rank_script(node.socket, None, None, False)], env=env1,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert {tuple(x) for x in json.loads(p.stdout)} == ranks[1]


def test_a_persistent_workers_checkpoint_right_after_set_epoch_names_the_new_epochs_start(node, stateful):
    """Epoch 0 cut short (`break`), `set_epoch(1)`, and a checkpoint before the first item of
    epoch 1: with persistent workers torchdata reports each worker's state from when its
    iteration began, and the worker's copy still held epoch 0's position while the shared epoch
    already said 1. Before, that checkpoint paired epoch 1 with epoch 0's position, and the
    resumed run delivered the rest of epoch 0, then epoch 1."""
    from shardwire.torch import IterableDataset, open_at_epoch

    def loader(ds):
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True,
                                           multiprocessing_context="fork")

    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    dl = loader(ds)
    ds.set_epoch(0)
    it = iter(dl)
    for _ in range(3):
        next(it)
    del it  # the loop left early
    ds.set_epoch(1)
    it = iter(dl)
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    ds2 = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    dl2 = loader(ds2)
    ds2.set_epoch(1)
    dl2.load_state_dict(sd)
    got = [ids(item) for item in dl2]
    del dl2
    with open_at_epoch(shardwire.connect(node.socket), "s", start_epoch=1, seed=3) as s:
        want = [ids(b) for b in s]
    assert got == want, "epoch 1 in full, nothing of epoch 0"


def fork_loader(stateful, ds, workers: int = 2, persistent: bool = False) -> Any:
    """A StatefulDataLoader of `ds` whose workers are forked (they inherit the test's patches)."""
    return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent,
                                       multiprocessing_context="fork")


def mode_dataset(node, mode: str) -> Any:
    from shardwire.torch import IterableDataset

    return IterableDataset("s", socket=node.socket, seed=3, timeout=60, **MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_persistent_worker_that_yielded_nothing_since_a_repeated_epoch_began_resumes_its_share(node, stateful, mode):
    """Epoch 0 to its end with 2 persistent workers, then again (no `set_epoch`), and a
    checkpoint after 1 item: worker 1 has yielded nothing in the new iteration, so torchdata
    keeps the state its dataset reported right after `iter(dataset)`. `__iter__` was a
    generator, which reset the state only at its first item: that state was the position where
    the previous iteration ended, and the resumed run skipped worker 1's whole share."""
    full = [ids(item) for item in fork_loader(stateful, mode_dataset(node, mode))]
    dl = fork_loader(stateful, mode_dataset(node, mode), persistent=True)
    assert [ids(item) for item in dl] == full  # epoch 0, to the end
    it = iter(dl)  # epoch 0 again: the persistent workers' datasets hold where it ended
    head = [ids(next(it))]
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    w1 = sd["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    assert w1 == {"epoch": 0, "stream": None}, "worker 1's state is the start of its share"
    dl2 = fork_loader(stateful, mode_dataset(node, mode))
    dl2.load_state_dict(sd)
    assert head + [ids(item) for item in dl2] == full, "each item once, worker 1's too"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_worker_does_not_checkpoint_the_position_of_the_main_processs_iteration(node, stateful, mode):
    """The main process peeks at the dataset (`next(iter(ds))`: stream rank 0 of 1), then a
    DataLoader with 2 workers takes 1 item and saves a checkpoint. Worker 1, which yielded
    nothing, reported the position of the main process's iteration it was forked with (a
    state of world size 1): resumed, it was refused with `state_mismatch` on `world_size`."""
    full = [ids(item) for item in fork_loader(stateful, mode_dataset(node, mode))]
    ds = mode_dataset(node, mode)
    assert ids(next(iter(ds)))  # the peek: the main process's own stream, one item taken
    dl = fork_loader(stateful, ds)
    it = iter(dl)
    head = [ids(next(it))]
    sd = copy.deepcopy(dl.state_dict())
    del it, dl
    assert sd["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"] == {"epoch": 0, "stream": None}
    dl2 = fork_loader(stateful, mode_dataset(node, mode))
    dl2.load_state_dict(sd)
    assert head + [ids(item) for item in dl2] == full


# (num_workers, persistent_workers, reload): how a loop continues after an error in a worker.
AFTER_ERROR = {"one-persistent": (1, True, False), "two-persistent": (2, True, True), "two": (2, False, True)}


@pytest.mark.parametrize("case", list(AFTER_ERROR))
def test_an_error_in_a_worker_is_continued_exactly(node, stateful, tmp_path, monkeypatch, case):
    """The last worker's 3rd `next` raises Timeout once. One persistent worker continues where
    it stopped when the loop iterates again (its dataset is the copy that raised). With two
    workers the other one's iteration is closed and its prefetched items dropped, so the
    README says to resume the loader from its own state first,
    `loader.load_state_dict(loader.state_dict())`: that continues exactly, each item once."""
    from torch.utils.data import get_worker_info

    from shardwire import _client

    workers, persistent, reload = AFTER_ERROR[case]
    full = [ids(item) for item in fork_loader(stateful, mode_dataset(node, "shard"), workers)]
    raised, real, calls = tmp_path / "raised", _client.Stream.next, {"n": 0}

    def flaky(self, timeout=None):
        info = get_worker_info()
        if info is not None and info.id == workers - 1:
            calls["n"] += 1  # this worker's own count (forked)
            if calls["n"] == 3 and not raised.exists():
                raised.touch()
                raise shardwire.Timeout("injected: no batch in time")
        return real(self, timeout)

    monkeypatch.setattr(_client.Stream, "next", flaky)
    dl = fork_loader(stateful, mode_dataset(node, "shard"), workers, persistent)
    got: list[list[int]] = []
    with pytest.raises(shardwire.Timeout):  # torch re-raises the worker's Timeout as one
        for item in dl:
            got.append(ids(item))
    assert raised.exists() and 0 < len(got) < len(full)
    if reload:
        dl.load_state_dict(dl.state_dict())
    got += [ids(item) for item in dl]
    assert got == full, "each item once, in order"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_after_the_loop_finished_resumed_without_set_epoch(node, stateful, mode, workers):
    """What the README says of a checkpoint taken after the loop finished and resumed without
    `set_epoch(e + 1)`: with 0 workers the dataset's state says the epoch is done (nothing);
    with workers torchdata discards a finished iteration's worker states, so the epoch the
    dataset is set to comes again in full."""
    _, dl = mode_loader(node, stateful, mode, workers)
    full = [ids(item) for item in dl]
    sd = copy.deepcopy(dl.state_dict())
    del dl
    _, dl2 = mode_loader(node, stateful, mode, workers)
    dl2.load_state_dict(sd)
    assert [ids(item) for item in dl2] == ([] if workers == 0 else full)


def test_a_plan_of_the_workers_streams_that_leaves_nothing_names_the_workers(node, stateful):
    """Shard mode, rank 0 of 5, 4 workers, `uneven="drop"`: 20 streams over 16 shards give
    every stream 0 shards. The node's `bad_plan` names world_size 20, which the trainer never
    set; the error says it is world_size * num_workers and what to change."""
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3, rank=0, world_size=5, uneven="drop", timeout=60)
    with pytest.raises(RuntimeError) as e:  # torch re-raises a worker's ServiceError so
        next(iter(fork_loader(stateful, ds, workers=4)))
    msg = str(e.value)
    assert "bad_plan" in msg and "world_size 20" in msg, msg
    assert "num_workers=4" in msg and "world_size * num_workers" in msg and "uneven" in msg, msg


def test_load_state_dict_refuses_a_state_that_is_not_the_datasets(stateful):
    """A stream's own state (`Stream.state_dict()`, `{epoch, index, seed, fingerprint}`) was
    taken for the dataset's: its `epoch` read, its position dropped, and the iteration
    restarted. It is refused, naming the shape expected."""
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", seed=3)
    stream_state = {"epoch": 0, "index": 3, "seed": 3, "fingerprint": "v1;x"}
    with pytest.raises(ValueError, match=r"\{'epoch': int, 'stream': dict \| None\}") as e:
        ds.load_state_dict(stream_state)
    assert "open_stream(state=" in str(e.value) and "'index'" in str(e.value)
    with pytest.raises(ValueError):
        ds.load_state_dict(None)  # type: ignore[arg-type]
    ds.load_state_dict({"epoch": 0, "stream": None})  # the dataset's own shape
    assert ds.state_dict() == {"epoch": 0, "stream": None}


@pytest.mark.parametrize("batch_size", [None, 2])
def test_the_position_is_that_of_the_iteration_that_yielded_last(node, monkeypatch, batch_size):
    """Two iterations of one dataset at once (a peek `next(iter(ds))` inside a loop): the
    position is the last item's, of whichever iteration yielded it, and an error sets the
    resume point only in the iteration that owns the position. Before, a second iter(ds)
    reset the shared flag of the first, whose Timeout then made the next iteration replay
    from where the first had started."""
    from shardwire import _client
    from shardwire.torch import IterableDataset

    kw = {} if batch_size is None else {"batch_size": batch_size}
    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60, **kw)
    with shardwire.connect(node.socket).open_stream("s", seed=3, **kw) as s:
        want = [ids(b) for b in s]
    loop = iter(ds)
    assert [ids(next(loop)) for _ in range(2)] == want[:2]
    peek = iter(ds)
    assert ds.state_dict()["stream"] is None, "a new iteration starts the epoch"
    assert ids(next(peek)) == want[0]
    assert ids(next(loop)) == want[2]
    saved = ds.state_dict()
    assert saved["stream"] is not None, "the loop's position, after its third item"
    # A checkpoint taken after the peek resumes the loop, not the peek.
    again = IterableDataset("s", socket=node.socket, seed=3, timeout=60, **kw)
    again.load_state_dict(saved)
    assert [ids(item) for item in again] == want[3:]
    # The peek yields last, then the loop fails: the loop owns no position, sets no resume.
    assert ids(next(peek)) == want[1]
    with monkeypatch.context() as m:
        real = _client.Stream.next

        def failing(self, timeout=None):
            raise shardwire.Timeout("injected: no batch in time")

        m.setattr(_client.Stream, "next", failing)
        with pytest.raises(shardwire.Timeout):
            next(loop)
        m.setattr(_client.Stream, "next", real)
    assert ds._resume is None, "the loop's error set a resume point"
    assert [ids(item) for item in peek] == want[2:], "the peek goes on"
    assert [ids(item) for item in ds] == want, "the next iteration starts the epoch"


def test_a_resume_point_is_taken_by_the_iteration_that_opens_at_it(node, monkeypatch):
    """An error leaves a resume point; an iteration that opens at it takes it, even one that
    is not the latest `iter(ds)` (before, only the iteration owning the position cleared it,
    so a loop after one that ran to the end resumed at the old point again)."""
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    with shardwire.connect(node.socket).open_stream("s", seed=3) as s:
        want = [ids(b) for b in s]
    with monkeypatch.context() as m:
        fail_the_nth_next(m, 4)
        with pytest.raises(shardwire.Timeout):
            for _ in ds:
                pass
    older, latest = iter(ds), iter(ds)
    assert [ids(item) for item in older] == want[3:], "resumed after the error"
    del latest  # never advanced
    assert [ids(item) for item in ds] == want, "the next loop starts the epoch"


def test_another_iterations_error_is_not_taken_by_an_iteration_made_before_it(node, monkeypatch):
    """A peek made inside a loop that then fails: the peek opens where it was made (the
    epoch's start), not at the loop's resume point, and the loop's retry resumes after the
    loop's items. And an iteration that takes a resume point but fails before its first item
    gives it back. (Before: the peek took the loop's point, so the retry replayed the epoch;
    and a point taken by a failed open was lost.)"""
    from shardwire.torch import IterableDataset

    ds = IterableDataset("s", socket=node.socket, seed=3, timeout=60)
    with shardwire.connect(node.socket).open_stream("s", seed=3) as s:
        want = [ids(b) for b in s]
    loop = iter(ds)
    assert ids(next(loop)) == want[0]
    peek = iter(ds)
    assert ids(next(loop)) == want[1]
    with monkeypatch.context() as m:
        fail_the_nth_next(m, 1)
        with pytest.raises(shardwire.Timeout):
            next(loop)
    assert ids(next(peek)) == want[0], "the peek starts where it was made"
    del peek
    # The resume point (after the loop's two items) survives an iteration that takes it and
    # fails before its first item.
    older, latest = iter(ds), iter(ds)
    with monkeypatch.context() as m:
        fail_the_nth_next(m, 1)
        with pytest.raises(shardwire.Timeout):
            next(older)
    del latest
    assert [ids(item) for item in ds] == want[2:], "the retry resumes after the loop's items"
