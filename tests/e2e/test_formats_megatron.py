"""Megatron-LM indexed datasets (`NAME.bin` + `NAME.idx`), written by megatron-core's own
`IndexedDatasetBuilder` and read back through real `shardwire index` / `source` / `serve`
processes and the Python SDK:

- `tokens` (uint16) arrives ragged (`tokens` + `tokens.offsets`), one row per sequence; every
  sequence byte-exact against megatron's own `IndexedDataset(prefix)[i]`, matched by its first
  token (its index), exactly once, in shard mode and in batch mode.

Skipped when megatron-core (tests/e2e/requirements-frameworks.txt) cannot be imported.
"""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, child_env, ragged_rows, require_bin, serve_dataset

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402

torch = pytest.importorskip("torch", reason="needs torch (tests/e2e/requirements-frameworks.txt)")
indexed = pytest.importorskip(
    "megatron.core.datasets.indexed_dataset",
    reason="needs megatron-core (tests/e2e/requirements-frameworks.txt)",
)

N = 203
BATCH = 4


def _sequence(i: int) -> np.ndarray:
    """Sequence `i`: its first token is `i`, then 0..60 pseudo-random tokens."""
    rng = np.random.default_rng(i)
    rest = rng.integers(0, 65536, size=i * 7 % 61, dtype=np.uint16)
    return np.concatenate([np.array([i], dtype=np.uint16), rest])


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """A Megatron dataset `corpus` (N sequences in documents of 1..5 sequences); returns
    (dir, megatron's own reading of every sequence by index)."""
    d = tmp_path_factory.mktemp("megatron") / "ds"
    d.mkdir(parents=True)
    prefix = str(d / "corpus_text_document")
    b = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    i = 0
    while i < N:
        for _ in range(1 + i % 5):
            if i == N:
                break
            b.add_item(torch.tensor(_sequence(i).astype(np.int64)))
            i += 1
        b.end_document()
    b.finalize(prefix + ".idx")
    r = subprocess.run([str(require_bin()), "index", str(d)], capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert r.returncode == 0, f"shardwire index failed:\n{r.stdout}\n{r.stderr}"
    ds = indexed.IndexedDataset(prefix)
    assert len(ds) == N
    want = {}
    for k in range(N):
        seq = np.asarray(ds[k])
        assert seq.dtype == np.uint16 and np.array_equal(seq, _sequence(k)), k
        want[k] = seq.tobytes()
    return d, want


def _check(b, want: dict, seen: collections.Counter) -> int:
    assert b["tokens"].dtype == np.uint16, b["tokens"].dtype
    rows = ragged_rows(b, "tokens")
    for row in rows:
        k = int(row[0])
        assert row.tobytes() == want[k], k
        seen[k] += 1
    return len(rows)


def test_megatron_in_shard_mode_byte_exact_once(sw, megatron):
    d, want = megatron
    node = serve_dataset(sw, "gpt", d)
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("gpt", seed=1) as s:
        for b in s:
            _check(b, want, seen)
    assert sorted(seen) == sorted(want) and max(seen.values()) == 1


def test_megatron_in_batch_mode_byte_exact_once(sw, megatron):
    d, want = megatron
    node = serve_dataset(sw, "gpt", d)
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("gpt", seed=2, batch_size=BATCH, shuffle="block",
                                                   drop_last=True) as s:
        for b in s:
            assert b["tokens.offsets"].shape == (BATCH + 1,)
            assert _check(b, want, seen) == BATCH
    assert max(seen.values()) == 1 and N - len(seen) < BATCH and set(seen) <= set(want)
