"""Batch mode (issue "Training batches"): batches of `batch_size` samples shuffled across the
dataset, through real `shardwire source` / `serve` processes and `shardwire consume`, on a
dataset written by pyarrow with an `id` column that identifies every row.

Checked here: every sample exactly once (drop_last) or at least once, byte-exact rows (the
CRC-32C of every batch tensor against the rows the ids name), equal batch counts per rank,
the order as a function of the partitions and not of the world size, locality from the
node's own counters, elastic resume 4 -> 2 and 4 -> 8 at the same global batch, the
refusals (named field and rule), and a stalled trainer's bounded memory."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from conftest import (
    MiB,
    crc32c,
    index_dataset,
    vm_rss,
    wait_for,
    wait_ready,
    write_arrow,
    write_id_dataset,
)

K = 4  # emb width


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """320 record batches (shards) of 40..59 rows over 8 Arrow files; returns (dir, rows by id).
    (Partition cuts split a shard between two ranks: with C partitions about (C-1)/shards of
    the bytes cross twice, so the locality bound needs a few hundred shards.)"""
    d = tmp_path_factory.mktemp("batches") / "ds"
    rows = write_id_dataset(d, [[40 + (f * 40 + i) % 20 for i in range(40)] for f in range(8)], k=K)
    return d, rows


def batches_of(lines: list[dict]) -> list[dict]:
    return [b for b in lines if "tensors" in b]


def ids(b: dict) -> list[int]:
    return next(t for t in b["tensors"] if t["name"] == "id")["values"]


def check_bytes(b: dict, rows: dict) -> None:
    """The batch's `id` and `emb` tensors are exactly the rows its ids name, in order."""
    got = {t["name"]: t for t in b["tensors"]}
    bi = ids(b)
    assert got["id"]["shape"] == [len(bi)] and got["emb"]["shape"] == [len(bi), K], got
    assert got["id"]["crc32c"] == crc32c(b"".join(rows[i][0] for i in bi)), bi
    assert got["emb"]["crc32c"] == crc32c(b"".join(rows[i][1] for i in bi)), bi


def run_ranks(sw, node, world: int, batch: int, **opts) -> list[list[dict]]:
    """`consume` for every rank at once; returns each rank's batches."""
    procs = [
        sw.start_consume(node, "b", rank=r, world_size=world, batch_size=batch, print_values="id", **opts)
        for r in range(world)
    ]
    return [batches_of(p.result(timeout=240)) for p in procs]


def node_source(sw):
    """The source the `node` fixture started."""
    return next(p for p in sw.procs if p.name.endswith("source"))


@pytest.fixture
def node(sw, data):
    d, _ = data
    src = sw.source({"b": d})
    n = sw.serve([src], "--pool-size", "512MiB", "--stream-memory", "32MiB")
    wait_ready(n)
    return n


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_sample_once_byte_exact_and_local(sw, node, data, world):
    _, rows = data
    batch = 64 // world  # the same global batch of 64 at every world size
    before = node.status()["counters"]["bytes_received"]
    ranks = run_ranks(sw, node, world, batch, drop_last=True, seed=5)
    steps = len(rows) // 64
    assert [len(r) for r in ranks] == [steps] * world, "every rank gets the same number of batches"
    seen = collections.Counter(i for r in ranks for b in r for i in ids(b))
    assert max(seen.values()) == 1, "drop_last: each sample at most once"
    assert len(rows) - len(seen) < 64, "fewer than one global batch dropped"
    for r in ranks:
        for b in r:
            check_bytes(b, rows)
    # Locality, from the node's counters: each rank fetched (nearly) only its own shards.
    fetched = node.status()["counters"]["bytes_received"] - before
    payload = 8 + 4 * K  # bytes of one sample in the shards: an int64 id and 4 float32
    delivered = payload * sum(len(ids(b)) for r in ranks for b in r)
    print(f"world size {world}: bytes fetched / delivered = {fetched / delivered:.4f}")
    assert fetched / delivered <= 1.05, f"bytes fetched / delivered = {fetched / delivered:.3f} at world size {world}"


def test_without_drop_last_every_sample_at_least_once(sw, node, data):
    _, rows = data
    ranks = run_ranks(sw, node, 2, 48, seed=2)
    steps = -(-len(rows) // 96)
    assert [len(r) for r in ranks] == [steps, steps]
    seen = collections.Counter(i for r in ranks for b in r for i in ids(b))
    assert set(seen) == set(rows), "every sample at least once"
    assert sum(seen.values()) - len(rows) < 96, "fewer than one global batch repeated"
    assert all(len(ids(b)) == 48 for r in ranks for b in r)


def global_steps(ranks: list[list[dict]]) -> list[list[int]]:
    """Per global step, the sorted ids of all ranks' batches at that step."""
    return [sorted(i for r in ranks for i in ids(r[s])) for s in range(len(ranks[0]))]


def test_order_depends_on_partitions_not_on_world_size(sw, node, data):
    a = global_steps(run_ranks(sw, node, 2, 16, partitions=8, seed=9))
    b = global_steps(run_ranks(sw, node, 4, 8, partitions=8, seed=9))
    c = global_steps(run_ranks(sw, node, 8, 4, partitions=8, seed=9))
    assert a == b == c, "same global batch and partitions: the same samples at every step"
    again = run_ranks(sw, node, 2, 16, partitions=8, seed=9)
    assert global_steps(again) == a, "deterministic"
    other = global_steps(run_ranks(sw, node, 2, 16, partitions=8, seed=10))
    assert other != a, "another seed, another order"
    # "none" is storage order, "shards" keeps rows in order within shards.
    (none,) = run_ranks(sw, node, 1, 10, shuffle="none")
    flat = [i for b in none for i in ids(b)]
    assert flat == sorted(flat)


def test_elastic_resume_4_to_2_and_4_to_8(sw, node, data):
    _, rows = data
    full = global_steps(run_ranks(sw, node, 4, 8, partitions=8, seed=3, drop_last=True))
    k = 5
    first = [
        sw.start_consume(node, "b", rank=r, world_size=4, batch_size=8, partitions=8, seed=3,
                         drop_last=True, print_values="id", limit=k, print_state=True)
        for r in range(4)
    ]
    outs = [p.result(timeout=120) for p in first]
    states = [next(l["state"] for l in o if "state" in l) for o in outs]
    assert all(s == states[0] for s in states), "the state is global: every rank's is the same"
    st = states[0]
    assert (st["index"], st["cursor"], st["partitions"]) == (k, k * 32, 8), st
    for world in (2, 8):
        batch = 32 // world
        rest = run_ranks(sw, node, world, batch, seed=3, drop_last=True, state=json.dumps(st))
        assert global_steps(rest) == full[k:], f"resumed on {world} ranks: the same global sequence"
        for r in rest:
            for b in r:
                check_bytes(b, rows)


def test_a_state_resumes_without_repeating_shuffle_block_in_every_order(sw, node, data):
    # shuffle_block is part of every order's fingerprint; the state saved it only for
    # "block", so a "shards" stream opened with shuffle_block=50 could not be resumed from
    # its own state without repeating it ("fingerprint differs in shuffle_block").
    opts = dict(batch_size=8, seed=4, shuffle="shards", print_values="id")
    full = batches_of(sw.start_consume(node, "b", shuffle_block=50, limit=6, **opts).result(timeout=120))
    out = sw.start_consume(node, "b", shuffle_block=50, limit=3, print_state=True, **opts).result(timeout=120)
    st = next(l["state"] for l in out if "state" in l)
    assert st["shuffle_block"] == 50, st
    rest = batches_of(sw.start_consume(node, "b", limit=3, state=json.dumps(st), **opts).result(timeout=120))
    assert [ids(b) for b in rest] == [ids(b) for b in full[3:6]]


def test_refusals_name_the_field_and_the_rule(sw, node, data, tmp_path):
    def refused(**opts) -> str:
        p = sw.start_consume(node, "b", batch_size=8, **opts)
        rc = p.wait(60)
        assert rc != 0, p.describe()
        return p.stderr_text()

    err = refused(world_size=3, rank=0, partitions=4)
    assert "world_size 3 does not fit partitions 4" in err, err
    (st_lines,) = [sw.consume(node, "b", batch_size=8, world_size=2, partitions=2, limit=2, print_state=True)]
    st = next(l["state"] for l in st_lines if "state" in l)
    err = refused(world_size=2, partitions=2, state=json.dumps({**st, "cursor": st["cursor"] + 1}))
    assert "is not step 2 x the global batch 16" in err, err
    err = refused(world_size=4, partitions=2, state=json.dumps(st))  # global batch 32 != 16
    assert "`global_batch`: saved 16, stream has 32" in err, err
    err = refused(world_size=2, partitions=4, state=json.dumps(st))
    assert "`partitions`: saved 2, stream has 4" in err, err
    shard_state = next(l["state"] for l in sw.consume(node, "b", limit=1, print_state=True) if "state" in l)
    err = refused(state=json.dumps(shard_state))
    assert "saved by a shard-mode stream" in err, err
    small = sw.serve([node_source(sw)], "--pool-size", "64MiB", "--stream-memory", "256KiB")
    wait_ready(small)
    p = sw.start_consume(small, "b", batch_size=8, shuffle_block=1_000_000)
    assert p.wait(60) != 0
    err = p.stderr_text()
    assert "batch mode needs stream_memory of at least" in err and "stream_memory is 262144" in err, err
    assert "lower shuffle_block to at most" in err, err


def test_a_stalled_trainer_keeps_memory_bounded(sw, tmp_path):
    import pyarrow as pa

    d = tmp_path / "big"
    rng = np.random.default_rng(3)
    batches = [
        pa.RecordBatch.from_arrays(
            [pa.array(np.arange(i * 256, (i + 1) * 256)),
             pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 256, 256 * 1024, dtype=np.uint8)), 1024)],
            names=["id", "pixels"],
        )
        for i in range(64)
    ]
    write_arrow(d / "big.arrow", batches, stream=False)
    index_dataset(d)
    total = 64 * 256 * (8 + 1024)
    src = sw.source({"b": d}, "--rate-limit", "8MiB")
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "6MiB")
    wait_ready(node)
    # The trainer holds its batch far longer than the samples below take (it is killed after).
    c = sw.start_consume(node, "b", batch_size=32, limit=1, hold_secs=60)
    wait_for(lambda: node.status()["streams"], "the stream to open", diag=sw.logs_of_all)
    samples = []

    def settled():
        st = node.status()
        s = st["streams"][0]
        assert s["region_used"] <= s["region_bytes"], s
        # 6 MiB of stream memory, batch slabs of 64 KiB: 1/16 of the region holds 6.
        assert s["ready_ahead"] == 6 and s["ready"] <= s["ready_ahead"], s
        samples.append((st["counters"]["bytes_received"], vm_rss(node.pid)))
        return len(samples) >= 3 and samples[-1][0] == samples[-3][0]

    # Fetching stops while the trainer holds its batch: two reads 1 s apart agree.
    wait_for(settled, "fetching to stop while the trainer holds its batch", timeout=30, interval=0.5)
    assert samples[-1][0] < total / 2, "the stalled stream did not fetch the whole dataset"
    assert samples[-1][1] < 200 * MiB
    c.kill()
