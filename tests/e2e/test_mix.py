"""Mixtures (`open_stream({"web": 0.7, "code": 0.3}, batch_size=...)`): several datasets served
by a real `shardwire source`, mixed by a real node, read through the Python SDK.

Checked: every global batch holds each dataset's exact share (and fractional shares are
exact over steps, within one sample); the same step sets on 1 and 2 ranks; a resume with the
same weights continues exactly and one with changed weights continues each dataset from its
cursor under the new shares, nothing repeated; a dataset that runs out starts its next epoch
(every sample once per pass); token-window mixtures; refusals naming the difference.
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest

from conftest import REPO, arrow_batches, index_dataset, wait_ready, write_arrow, write_tokens

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402

CODE_START = 1_000_000  # ids of "code" rows start here


def _write(d, sizes: list[list[int]], id_start: int, k: int = 4) -> set[int]:
    """An indexed Arrow dataset (id int64, emb float32[k]); returns its ids."""
    d.mkdir(parents=True)
    ids: set[int] = set()
    at = id_start
    for f, sz in enumerate(sizes):
        batches = arrow_batches(sz, k=k, seed=f + id_start, id_start=at)
        at += sum(sz)
        write_arrow(d / f"part-{f}.arrow", batches, stream=True)
        for b in batches:
            ids.update(int(i) for i in b.column(0).to_numpy())
    index_dataset(d)
    return ids


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    web = _write(root / "web", [[25] * 8 for _ in range(2)], 0)  # 400 rows
    code = _write(root / "code", [[15] * 4], CODE_START)  # 60 rows
    wide = _write(root / "wide", [[10] * 2], 2 * CODE_START, k=8)  # emb of 8: other samples
    return root, web, code, wide


@pytest.fixture
def node(sw, datasets):
    root = datasets[0]
    src = sw.source({"web": root / "web", "code": root / "code", "wide": root / "wide"})
    n = sw.serve([src], "--pool-size", "256MiB", "--stream-memory", "16MiB")
    wait_ready(n)
    return n


def _is_code(i: int) -> bool:
    return CODE_START * 1_000_003 - 7 <= i < 2 * CODE_START * 1_000_003 - 7


def _batches(stream, n: int | None = None) -> list[list[int]]:
    out = []
    while n is None or len(out) < n:
        try:
            b = stream.next(30)
        except TimeoutError:
            raise AssertionError(f"no batch within 30 s after {len(out)}") from None
        if b is None:
            break
        out.append([int(i) for i in b["id"]])
    return out


def test_every_batch_holds_the_exact_shares(node):
    client = shardwire.connect(node.socket)
    with client.open_stream({"web": 0.75, "code": 0.25}, batch_size=8, seed=1) as s:
        batches = _batches(s)
    assert len(batches) == (400 + 60) // 8
    for b in batches:
        assert sum(map(_is_code, b)) == 2, b
    # 0.7 of 4 is 2.8: batches of 2 or 3 "web", exact over the steps (within one).
    with client.open_stream({"web": 0.7, "code": 0.3}, batch_size=4, seed=1) as s:
        batches = _batches(s, 40)
    web = 0
    for step, b in enumerate(batches, 1):
        n = sum(not _is_code(i) for i in b)
        assert n in (2, 3), b
        web += n
        assert abs(web - 0.7 * 4 * step) <= 1.0, (step, web)


def test_steps_are_the_same_set_on_one_and_two_ranks(node):
    client = shardwire.connect(node.socket)
    with client.open_stream({"web": 0.6, "code": 0.4}, batch_size=10, seed=2) as s:
        one = _batches(s)
    halves = []
    for r in range(2):
        with client.open_stream({"web": 0.6, "code": 0.4}, batch_size=5, rank=r, world_size=2, seed=2) as s:
            halves.append(_batches(s))
    assert len(halves[0]) == len(halves[1]) == len(one)
    for i, b in enumerate(one):
        assert sorted(halves[0][i] + halves[1][i]) == sorted(b), i
        # Each rank's half holds its share too (contiguous runs of the interleaved slots).
        assert sum(map(_is_code, halves[0][i])) == 2 and sum(map(_is_code, halves[1][i])) == 2


def test_resume_with_changed_weights_continues_every_cursor(node):
    client = shardwire.connect(node.socket)
    opts = {"batch_size": 8, "seed": 3}
    with client.open_stream({"web": 0.5, "code": 0.5}, **opts) as s:
        first = _batches(s, 5)
        state = s.state_dict()
    # Same weights: exactly where the unbroken stream goes on.
    with client.open_stream({"web": 0.5, "code": 0.5}, **opts) as s:
        unbroken = _batches(s, 8)[5:]
    with client.open_stream({"web": 0.5, "code": 0.5}, state=state, **opts) as s:
        assert _batches(s, 3) == unbroken
    # New weights from the same state: 7 web + 1 code a batch, no web row seen before, and
    # code goes on from its cursor (20 of its 60 rows taken: no repeat within its epoch).
    with client.open_stream({"web": 0.875, "code": 0.125}, state=state, **opts) as s:
        after = _batches(s, 6)
        later = s.state_dict()
    seen = {i for b in first for i in b}
    for b in after:
        assert sum(map(_is_code, b)) == 1, b
        assert not seen & set(b), "a sample repeated after the weights changed"
    assert later["mix"]["cursors"] == [20 + 6 * 7, 20 + 6 * 1], later["mix"]
    assert later["mix"]["datasets"] == ["web", "code"]


def test_a_dataset_that_runs_out_starts_its_next_epoch(node):
    client = shardwire.connect(node.socket)
    with client.open_stream({"web": 0.5, "code": 0.5}, batch_size=10, seed=4, epochs=1) as s:
        batches = _batches(s)
    code = [i for b in batches for i in b if _is_code(i)]
    assert len(code) > 60, "code (60 rows) is taken past its first epoch"
    assert len(set(code[:60])) == 60, "every code row once in its first pass"
    assert len(set(code[60:120])) == len(code[60:120]), "and once per later pass"
    assert code[:60] != code[60:120], "each pass in a fresh order"


def test_datasets_whose_samples_differ_are_refused_naming_the_difference(node):
    client = shardwire.connect(node.socket)
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream({"web": 1, "wide": 1}, batch_size=4).next()
    msg = str(e.value)
    assert "mix:" in msg and "wide/" in msg and "emb" in msg, msg
    with pytest.raises(ValueError, match="mix weight of 'code' must be a positive number"):
        client.open_stream({"web": 1, "code": 0}, batch_size=4)
    with pytest.raises(ValueError, match="needs batch_size"):
        client.open_stream({"web": 1, "code": 1})
    with client.open_stream({"web": 0.5, "code": 0.5}, batch_size=4) as s:
        s.next()
        state = s.state_dict()
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream({"code": 0.5, "web": 0.5}, batch_size=4, state=state).next()
    assert e.value.code == "state_mismatch" and "mix" in str(e.value), e.value
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream("web", batch_size=4, state=state).next()
    assert e.value.code == "state_mismatch", e.value
    # A carry no schedule has (it does not sum to 0) is refused, naming it, not scheduled.
    bent = {**state, "mix": {**state["mix"], "carry": [-(1 << 42), -(1 << 42)]}}
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream({"web": 0.5, "code": 0.5}, batch_size=4, state=bent).next()
    assert e.value.code == "state_mismatch" and "carry" in str(e.value), e.value
    # A cursor past any schedule (its epoch beyond what is counted) likewise, naming it.
    far = {**state, "mix": {**state["mix"], "cursors": [1 << 62, state["mix"]["cursors"][1]]}}
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream({"web": 0.5, "code": 0.5}, batch_size=4, state=far).next()
    assert e.value.code == "state_mismatch" and f"cursor {1 << 62}" in str(e.value), e.value


def test_token_windows_mix_in_exact_shares(sw, tmp_path):
    L = 8
    dirs = {}
    for name, start in (("books", 1), ("math", 40001)):
        dirs[name] = tmp_path / name
        write_tokens(dirs[name], np.arange(start, start + 3000, dtype=np.uint16))
    n = sw.serve([sw.source(dirs)], "--pool-size", "256MiB", "--stream-memory", "16MiB")
    wait_ready(n)
    with shardwire.connect(n.socket).open_stream({"books": 3, "math": 1}, batch_size=4, seq_len=L,
                                                 shuffle="none") as s:
        got = collections.Counter()
        for b in s:
            t = np.asarray(b["tokens"]).astype(np.int64)
            assert t.shape == (4, L + 1)
            for w in t:
                assert np.array_equal(w, np.arange(w[0], w[0] + L + 1)), w  # one stream's run
                got["math" if w[0] > 40000 else "books"] += 1
            assert sum(1 for w in t if w[0] > 40000) == 1
    assert got["books"] == 3 * got["math"]


def test_http_mixture_equals_the_socket_and_states_cross(node):
    opts = {"batch_size": 8, "seed": 5}
    mix = {"web": 0.75, "code": 0.25}
    with shardwire.connect(node.socket).open_stream(mix, **opts) as s:
        want = _batches(s, 10)
    with shardwire.connect_http(node.admin).open_stream(mix, **opts) as s:
        got = _batches(s, 6)
        st = s.state_dict()
    assert got == want[:6]
    with shardwire.connect(node.socket).open_stream(mix, state=st, **opts) as s:  # HTTP -> socket
        assert _batches(s, 4) == want[6:]


def test_a_mixture_dataset_set_to_a_later_epoch_reads_that_epoch(node):
    """shardwire.torch.IterableDataset over a mixture after set_epoch(1): the SDK moves a
    probe's state (the schedule's start) to epoch 1, and the node plays the schedule to it,
    so the batches are the second epoch of a two-epoch stream."""
    pytest.importorskip("torch", reason="torch is installed by scripts/test")
    from shardwire.torch import IterableDataset

    mix = {"web": 0.7, "code": 0.3}
    with shardwire.connect(node.socket).open_stream(mix, batch_size=8, seed=1, epochs=2) as s:
        both = _batches(s)
    per = (400 + 60) // 8
    assert len(both) == 2 * per
    ds = IterableDataset(mix, socket=node.socket, seed=1, batch_size=8)
    ds.set_epoch(1)
    got = [[int(i) for i in b["id"]] for b in ds]
    assert got == both[per:]
    # A state from the schedule's start moved past the stream is still refused.
    with shardwire.connect(node.socket).open_stream(mix, batch_size=8, seed=1) as s:
        st = s.state_dict()
    with pytest.raises(shardwire.ServiceError) as e:
        shardwire.connect(node.socket).open_stream(mix, batch_size=8, seed=1, epochs=2, state={**st, "epoch": 3, "index": 0})
    assert e.value.code == "state_mismatch", e.value


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_a_token_mixture_exactly(sw, tmp_path, workers):
    """shardwire.torch.IterableDataset over a token-window mixture in torchdata's
    StatefulDataLoader (0 and 2 workers): a checkpoint after 5 batches resumes exactly."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata")
    from shardwire.torch import IterableDataset

    dirs = {}
    for name, start in (("books", 1), ("math", 40001)):
        dirs[name] = tmp_path / name
        write_tokens(dirs[name], np.arange(start, start + 4000, dtype=np.uint16))
    n = sw.serve([sw.source(dirs)], "--pool-size", "256MiB", "--stream-memory", "16MiB")
    wait_ready(n)

    def loader():
        ds = IterableDataset({"books": 0.5, "math": 0.5}, socket=n.socket, seed=2, batch_size=4,
                             seq_len=8, shuffle="block", shuffle_block=2)
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    def firsts(b) -> list[int]:
        return [int(w[0]) for w in np.asarray(b["tokens"])]

    full = [firsts(b) for b in loader()]
    assert len(full) == (2 * ((4000 - 1) // 8)) // 4, len(full)  # a mixture epoch: all windows / batch
    dl = loader()
    it = iter(dl)
    head = [firsts(next(it)) for _ in range(5)]
    sd = dl.state_dict()
    del it, dl
    dl2 = loader()
    dl2.load_state_dict(sd)
    assert head + [firsts(b) for b in dl2] == full


def test_a_mixture_naming_too_many_or_the_same_dataset_twice_is_refused_before_any_manifest_is_fetched(node):
    from sdk_harness import http_json

    # 300 entries fit the 64 KiB HTTP body; the node once fetched a manifest per entry,
    # one after another, holding them all (about 37,000 fit a socket frame).
    for mix, says in (
        ([{"dataset": "web", "weight": 1}] * 300, "mix names 300 datasets; at most 256"),
        ([{"dataset": "web", "weight": 1}, {"dataset": "web", "weight": 2}], 'mix names "web" twice'),
        ([{"dataset": "web", "weight": 0}], 'mix weight 0 of "web" must be a positive number'),
    ):
        st, v = http_json(node.admin, "POST", "/v1/streams", {"mix": mix, "batch_size": 8})
        assert st == 400 and v["code"] == "bad_request" and says in v["message"], (st, v)
    # The node serves on.
    with shardwire.connect(node.socket).open_stream({"web": 0.5, "code": 0.5}, batch_size=8) as s:
        assert s.next(timeout=30) is not None
