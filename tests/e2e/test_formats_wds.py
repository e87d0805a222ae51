"""WebDataset tars (issue "formats"), written by webdataset's own `TarWriter` and read back
through real `shardwire index` / `source` / `serve` processes and the Python SDK:

- `img.npy` (float32 arrays of one shape) arrives as a fixed-shape `[n, 4, 3]` tensor; `cls`
  and `txt` arrive ragged (`c` and `c.offsets`) as the members' raw bytes; every sample
  byte-exact against what the writer was given, matched by `cls`, exactly once, in shard
  mode and in batch mode.
- `img.npy` of varying shapes arrives ragged as the raw `.npy` member bytes.
- A `.tar.gz` is refused, naming the file, the reason and the fix.
"""

from __future__ import annotations

import collections
import gzip
import io
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, child_env, require_bin, ragged_rows, serve_dataset

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402

wds = pytest.importorskip("webdataset", reason="needs webdataset (tests/e2e/requirements.txt)")

N = 200
SHARDS = 4


def _sample(i: int, ragged_img: bool = False) -> dict:
    rng = np.random.default_rng(i)
    shape = (1 + i % 5, 3) if ragged_img else (4, 3)
    return {
        "__key__": "s%05d" % i,
        "img.npy": rng.standard_normal(shape).astype(np.float32),
        "cls": i * 7 + 3,
        "txt": "sample %d " % i + "é" * (i % 5) + "x" * (i % 17),
    }


def _index(d) -> subprocess.CompletedProcess:
    return subprocess.run([str(require_bin()), "index", str(d)], capture_output=True, text=True,
                          timeout=120, env=child_env())


def _write(d, ragged_img: bool) -> dict:
    d.mkdir(parents=True)
    rows = {}
    per = N // SHARDS
    for s in range(SHARDS):
        with wds.TarWriter(str(d / ("shard-%03d.tar" % s))) as w:
            for i in range(s * per, (s + 1) * per):
                x = _sample(i, ragged_img)
                w.write(x)
                rows[x["cls"]] = x
    r = _index(d)
    assert r.returncode == 0, f"shardwire index failed:\n{r.stdout}\n{r.stderr}"
    return rows


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    """WebDataset tars with fixed-shape `img.npy`; returns (dir, samples by cls)."""
    d = tmp_path_factory.mktemp("wds") / "ds"
    return d, _write(d, ragged_img=False)


@pytest.fixture(scope="module")
def ragged_tars(tmp_path_factory):
    """WebDataset tars whose `img.npy` shapes vary; returns (dir, samples by cls)."""
    d = tmp_path_factory.mktemp("wds-ragged") / "ds"
    return d, _write(d, ragged_img=True)


def _ragged(b, name: str) -> list[bytes]:
    assert b[name].dtype == np.uint8, (name, b[name].dtype)
    return [r.tobytes() for r in ragged_rows(b, name)]


def _check(b, rows: dict, seen: collections.Counter, ragged_img: bool = False) -> int:
    classes = [int(c) for c in _ragged(b, "cls")]
    texts = _ragged(b, "txt")
    if ragged_img:
        imgs = [np.load(io.BytesIO(x)) for x in _ragged(b, "img.npy")]
    else:
        assert b["img.npy"].dtype == np.float32 and b["img.npy"].shape == (len(classes), 4, 3)
        imgs = list(b["img.npy"])
    for k, c in enumerate(classes):
        want = rows[c]
        assert texts[k].decode() == want["txt"], c
        assert imgs[k].dtype == np.float32 and imgs[k].tobytes() == want["img.npy"].tobytes(), c
        seen[c] += 1
    return len(classes)


def _shard_mode(node, rows: dict, ragged_img: bool) -> None:
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("wds", seed=1) as s:
        for b in s:
            _check(b, rows, seen, ragged_img)
    assert sorted(seen) == sorted(rows) and max(seen.values()) == 1


def _batch_mode(node, rows: dict, ragged_img: bool) -> None:
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("wds", seed=2, batch_size=8, shuffle="block",
                                                   shuffle_block=64, drop_last=True) as s:
        for b in s:
            assert b["cls.offsets"].shape == (9,)
            assert _check(b, rows, seen, ragged_img) == 8
    assert max(seen.values()) == 1 and N - len(seen) < 8 and set(seen) <= set(rows)


def test_wds_in_shard_mode_byte_exact_once(sw, tars):
    _shard_mode(serve_dataset(sw, "wds", tars[0]), tars[1], ragged_img=False)


def test_wds_in_batch_mode_byte_exact_once(sw, tars):
    _batch_mode(serve_dataset(sw, "wds", tars[0]), tars[1], ragged_img=False)


def test_wds_ragged_npy_in_shard_mode(sw, ragged_tars):
    _shard_mode(serve_dataset(sw, "wds", ragged_tars[0]), ragged_tars[1], ragged_img=True)


def test_wds_ragged_npy_in_batch_mode(sw, ragged_tars):
    _batch_mode(serve_dataset(sw, "wds", ragged_tars[0]), ragged_tars[1], ragged_img=True)


def test_tar_gz_is_refused_with_the_fix(tmp_path):
    d = tmp_path / "gz"
    d.mkdir()
    buf = io.BytesIO()
    with wds.TarWriter(buf) as w:
        w.write(_sample(0))
    (d / "shard-000.tar.gz").write_bytes(gzip.compress(buf.getvalue()))
    r = _index(d)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "shard-000.tar.gz" in out and "byte range" in out and "gunzip" in out, out
