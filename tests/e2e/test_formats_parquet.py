"""Parquet (issue "formats"): files written by `pyarrow.parquet.write_table` (snappy, its
default, and zstd; small row groups so there are several) are converted once by
`shardwire index` into `.shardwire-cache/parquet/<path>.arrow` and served from there.

Every row is read back through real `shardwire` processes and the Python SDK, in shard mode
and in batch mode, and compared with `pyarrow.parquet.read_table`, matched by id, exactly
once. Strings and lists arrive ragged (`c` + `c.offsets`), the fixed-size list dense. A
second `shardwire index` reuses the cache and says so.
"""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, child_env, require_bin, ragged_rows, serve_dataset

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N_A, N_B = 180, 123


def _table(start: int, n: int) -> "pa.Table":
    rng = np.random.default_rng(start)
    ids = list(range(start, start + n))
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "text": pa.array(["row %d " % i + "é" * (i % 4) + "x" * (i % 13) for i in ids], pa.string()),
        "tokens": pa.array([rng.integers(0, 30_000, size=i % 11).tolist() for i in ids], pa.list_(pa.int32())),
        "emb": pa.array([rng.standard_normal(4).astype(np.float32).tolist() for _ in ids],
                        pa.list_(pa.float32(), 4)),
    })


def _index(d) -> str:
    r = subprocess.run([str(require_bin()), "index", str(d)], capture_output=True, text=True, timeout=120,
                       env=child_env())
    assert r.returncode == 0, f"shardwire index failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def pqds(tmp_path_factory):
    """Two Parquet files; returns (dir, rows by id from read_table, first and second index output)."""
    d = tmp_path_factory.mktemp("pq") / "ds"
    (d / "sub").mkdir(parents=True)
    pq.write_table(_table(0, N_A), d / "a.parquet", row_group_size=40)
    pq.write_table(_table(1000, N_B), d / "sub" / "b.parquet", row_group_size=50, compression="zstd")
    first, second = _index(d), _index(d)
    rows = {}
    for f in ("a.parquet", "sub/b.parquet"):
        for r in pq.read_table(d / f).to_pylist():
            rows[r["id"]] = r
    assert len(rows) == N_A + N_B
    return d, rows, first, second


@pytest.fixture
def node(sw, pqds):
    return serve_dataset(sw, "pq", pqds[0])


def test_index_names_the_conversion_and_the_cache(pqds):
    d, _, first, second = pqds
    assert "parquet: a.parquet -> .shardwire-cache/parquet/a.parquet.arrow (converted, 5 row groups)" in first, first
    assert ("parquet: sub/b.parquet -> .shardwire-cache/parquet/sub/b.parquet.arrow (converted, 3 row groups)"
            in first), first
    assert second.count("(reused, ") == 2 and "unchanged since" in second, second
    assert (d / ".shardwire-cache" / "parquet" / "sub" / "b.parquet.arrow").is_file()


def _check(b, rows: dict, seen: collections.Counter) -> None:
    ids = b["id"].tolist()
    texts, toks = ragged_rows(b, "text"), ragged_rows(b, "tokens")
    assert b["id"].dtype == np.int64 and b["text"].dtype == np.uint8 and b["tokens"].dtype == np.int32
    assert b["emb"].dtype == np.float32 and b["emb"].shape == (len(ids), 4)
    for k, i in enumerate(ids):
        want = rows[i]
        assert texts[k].tobytes().decode() == want["text"], i
        assert toks[k].tolist() == want["tokens"], i
        assert b["emb"][k].tobytes() == np.asarray(want["emb"], np.float32).tobytes(), i
        seen[i] += 1


def test_parquet_in_shard_mode_exact_once(node, pqds):
    _, rows, _, _ = pqds
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("pq", seed=1) as s:
        for b in s:
            _check(b, rows, seen)
    assert sorted(seen) == sorted(rows) and max(seen.values()) == 1


def test_parquet_in_batch_mode_exact_once(node, pqds):
    _, rows, _, _ = pqds
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("pq", seed=2, batch_size=8, shuffle="block",
                                                   drop_last=True) as s:
        for b in s:
            assert b["id"].shape == (8,) and b["text.offsets"].shape == (9,)
            _check(b, rows, seen)
    assert max(seen.values()) == 1 and len(rows) - len(seen) < 8
