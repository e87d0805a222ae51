"""MosaicML Streaming MDS datasets, written by Streaming's own `MDSWriter` (in the
`.venv-streaming` interpreter, run as a subprocess) and read back through real
`shardwire index` / `source` / `serve` processes and the Python SDK:

- `id` (int64) arrives as a typed `[n]` tensor, `x` (`ndarray:float32:8`) as a typed
  `[n, 8]` tensor, `txt` (str) and `blob` (bytes) ragged as the stored bytes; every sample
  byte-exact against what the writer was given, matched by `id`, exactly once, in shard mode
  and in batch mode.
- A compressed MDS dataset is refused, naming the shard, the compression and the fix.

Skipped when `.venv-streaming/bin/python` is missing or cannot import `streaming`.
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

N = 300
PY = REPO / ".venv-streaming" / "bin" / "python"

WRITER = r"""
import sys
import numpy as np
from streaming import MDSWriter

out, n, compression = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
cols = {"id": "int64", "x": "ndarray:float32:8", "txt": "str", "blob": "bytes"}
with MDSWriter(out=out, columns=cols, size_limit=4096, compression=compression) as w:
    for i in range(n):
        w.write({"id": i * 7 + 3, "x": np.arange(8, dtype=np.float32) + i,
                 "txt": "sample %d " % i + "\u00e9" * (i % 5) + "x" * (i % 17),
                 "blob": bytes([i % 256]) * (i % 23)})
"""


def _sample(i: int) -> dict:
    return {"id": i * 7 + 3, "x": np.arange(8, dtype=np.float32) + i,
            "txt": "sample %d " % i + "\u00e9" * (i % 5) + "x" * (i % 17),
            "blob": bytes([i % 256]) * (i % 23)}


def _streaming() -> None:
    if not PY.is_file():
        pytest.skip(f"needs MosaicML Streaming: {PY} is missing")
    r = subprocess.run([str(PY), "-c", "import streaming"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"needs MosaicML Streaming: {PY} cannot import streaming: {r.stderr.strip()[-300:]}")


def _write(d, compression: str = "") -> None:
    _streaming()
    r = subprocess.run([str(PY), "-c", WRITER, str(d), str(N), compression], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"MDSWriter failed:\n{r.stdout}\n{r.stderr}"


def _index(d) -> subprocess.CompletedProcess:
    return subprocess.run([str(require_bin()), "index", str(d)], capture_output=True, text=True,
                          timeout=120, env=child_env())


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    """An MDS dataset (in a subdirectory, as `index.json` + several `.mds` shards)."""
    d = tmp_path_factory.mktemp("mds") / "ds"
    _write(d / "train")
    assert len(list((d / "train").glob("*.mds"))) > 2
    r = _index(d)
    assert r.returncode == 0, f"shardwire index failed:\n{r.stdout}\n{r.stderr}"
    assert "not used" not in r.stdout + r.stderr, r.stdout + r.stderr
    return d, {s["id"]: s for s in map(_sample, range(N))}


def _check(b, rows: dict, seen: collections.Counter) -> int:
    assert b["id"].dtype == np.int64 and b["id"].ndim == 1
    ids = [int(i) for i in b["id"]]
    assert b["x"].dtype == np.float32 and b["x"].shape == (len(ids), 8)
    for name in ("txt", "blob"):
        assert b[name].dtype == np.uint8, (name, b[name].dtype)
    texts = [r.tobytes() for r in ragged_rows(b, "txt")]
    blobs = [r.tobytes() for r in ragged_rows(b, "blob")]
    for k, i in enumerate(ids):
        want = rows[i]
        assert b["x"][k].tobytes() == want["x"].tobytes(), i
        assert texts[k] == want["txt"].encode(), i
        assert blobs[k] == want["blob"], i
        seen[i] += 1
    return len(ids)


def test_mds_in_shard_mode_byte_exact_once(sw, mds):
    node = serve_dataset(sw, "mds", mds[0])
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("mds", seed=1) as s:
        for b in s:
            _check(b, mds[1], seen)
    assert sorted(seen) == sorted(mds[1]) and max(seen.values()) == 1


def test_mds_in_batch_mode_byte_exact_once(sw, mds):
    node = serve_dataset(sw, "mds", mds[0])
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("mds", seed=2, batch_size=8, shuffle="block",
                                                   shuffle_block=64, drop_last=True) as s:
        for b in s:
            assert _check(b, mds[1], seen) == 8
    assert max(seen.values()) == 1 and N - len(seen) < 8 and set(seen) <= set(mds[1])


def test_compressed_mds_is_refused_with_the_fix(tmp_path):
    d = tmp_path / "zstd"
    _write(d, "zstd")
    r = _index(d)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "shard.00000.mds.zstd" in out and "zstd" in out and "compression=None" in out, out
