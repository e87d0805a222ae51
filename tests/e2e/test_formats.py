"""The formats users already have (issue "formats"), written by their own libraries and read
back through real `shardwire index` / `source` / `serve` processes and the Python SDK:

- HF `datasets` (`save_to_disk`): an int64 id, a string column, a tokenized `Sequence(int32)`
  column and an `Array2D` column. Strings and sequences arrive ragged (`c` and `c.offsets`,
  int64 from 0), the Array2D as a fixed-shape tensor; every row byte-exact against what the
  writer was given, matched by id, exactly once, in shard mode and in batch mode. HF's own
  JSON files are named as metadata by `shardwire index`, never skipped silently.
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

datasets = pytest.importorskip("datasets", reason="needs HF datasets (tests/e2e/requirements.txt)")

N = 300


def _rows(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "id": i * 7 + 3,
        "text": "sample %d " % i + "é" * (i % 5) + "x" * (i % 17),
        "input_ids": rng.integers(0, 50_000, size=i % 23, dtype=np.int32).tolist(),
        "img": rng.integers(0, 256, size=(4, 3), dtype=np.uint8).tolist(),
    }


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """An HF dataset saved with save_to_disk in 3 shards; returns (dir, rows by id, index output)."""
    feats = datasets.Features({
        "id": datasets.Value("int64"),
        "text": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "img": datasets.Array2D(shape=(4, 3), dtype="uint8"),
    })
    rows = [_rows(i) for i in range(N)]
    ds = datasets.Dataset.from_list(rows, features=feats)
    d = tmp_path_factory.mktemp("hf") / "ds"
    ds.save_to_disk(str(d), num_shards=3)
    r = subprocess.run([str(require_bin()), "index", str(d)], capture_output=True, text=True, timeout=120,
                       env=child_env())
    assert r.returncode == 0, f"shardwire index failed:\n{r.stdout}\n{r.stderr}"
    return d, {x["id"]: x for x in rows}, r.stdout + r.stderr


@pytest.fixture
def node(sw, hf):
    return serve_dataset(sw, "hf", hf[0])


def _check(b, rows: dict, seen: collections.Counter) -> None:
    ids = b["id"].tolist()
    texts, toks = ragged_rows(b, "text"), ragged_rows(b, "input_ids")
    assert b["text"].dtype == np.uint8 and b["input_ids"].dtype == np.int32
    assert b["img"].dtype == np.uint8 and b["img"].shape == (len(ids), 4, 3)
    for k, i in enumerate(ids):
        want = rows[i]
        assert texts[k].tobytes().decode() == want["text"], i
        assert toks[k].tolist() == want["input_ids"], i
        assert b["img"][k].tolist() == want["img"], i
        seen[i] += 1


def test_index_names_the_hf_metadata(hf):
    _, _, out = hf
    assert "dataset_info.json" in out and "state.json" in out and "HF datasets metadata" in out, out


def test_hf_dataset_in_shard_mode_byte_exact_once(node, hf):
    _, rows, _ = hf
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("hf", seed=1) as s:
        for b in s:
            _check(b, rows, seen)
    assert sorted(seen) == sorted(rows) and max(seen.values()) == 1


def test_hf_dataset_in_batch_mode_byte_exact_once(node, hf):
    _, rows, _ = hf
    seen: collections.Counter = collections.Counter()
    with shardwire.connect(node.socket).open_stream("hf", seed=2, batch_size=16, shuffle="block",
                                                   shuffle_block=64, drop_last=True) as s:
        for b in s:
            assert b["id"].shape == (16,) and b["text.offsets"].shape == (17,)
            _check(b, rows, seen)
    assert max(seen.values()) == 1 and N - len(seen) < 16


def _index(d) -> subprocess.CompletedProcess:
    return subprocess.run([str(require_bin()), "index", str(d)], capture_output=True, text=True, timeout=120,
                          env=child_env())


def test_a_second_save_to_disk_into_the_same_folder_serves_only_its_own_files(sw, tmp_path):
    """`save_to_disk` into a folder that holds an earlier save deletes nothing: with fewer
    shards, the earlier save's Arrow files stay beside the new ones, and `load_from_disk` reads
    only those its `state.json` lists. shardwire does the same and names the others unused;
    before, it served both saves (old rows and new, the row count their sum)."""
    feats = datasets.Features({"id": datasets.Value("int64")})
    d = tmp_path / "ds"
    datasets.Dataset.from_dict({"id": list(range(1000, 1400))}, features=feats).save_to_disk(str(d), num_shards=4)
    new = datasets.Dataset.from_dict({"id": list(range(100))}, features=feats)
    new.save_to_disk(str(d), num_shards=2)
    assert len(list(d.glob("*.arrow"))) == 6, "the earlier save's files are still there"
    assert len(datasets.load_from_disk(str(d))) == 100
    r = _index(d)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "data-00000-of-00004.arrow" in out and "not listed in state.json" in out, out
    node = serve_dataset(sw, "hf2", d)
    with shardwire.connect(node.socket).open_stream("hf2") as s:
        ids = sorted(i for b in s for i in b["id"].tolist())
    assert ids == list(range(100))


def test_a_dataset_dict_of_splits_is_refused_naming_a_split(tmp_path):
    """A `DatasetDict` saved whole (one folder per split under `dataset_dict.json`): indexing
    its top would merge `test` into `train`; refused, naming a split's folder to index."""
    feats = datasets.Features({"id": datasets.Value("int64")})
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"id": list(range(50))}, features=feats),
        "test": datasets.Dataset.from_dict({"id": list(range(10))}, features=feats),
    })
    d = tmp_path / "dd"
    dd.save_to_disk(str(d))
    r = _index(d)
    assert r.returncode != 0 and "DatasetDict" in r.stderr and str(d / "train") in r.stderr, r.stderr
    r = _index(d / "train")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_batch_too_large_to_describe_in_one_answer_fails_its_stream_naming_why(sw, tmp_path):
    """A shard of 4000 tensors with 250-character names: the answer that hands out its batch
    is over the 1 MiB a trainer reads. The node closes the stream with `bad_plan` saying so
    (and what to do); before, it sent the answer, which the SDK refused as a broken frame,
    and a resume met the same batch again, without a word of why."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    d = tmp_path / "wide"
    d.mkdir()
    cols = {("c%04d_" % i) + "x" * 244: pa.array(np.arange(4, dtype=np.int8)) for i in range(4000)}
    table = pa.table(cols)
    with ipc.new_stream(d / "wide.arrow", table.schema) as w:
        w.write_table(table)
    r = _index(d)
    assert r.returncode == 0, r.stderr[-2000:]
    node = serve_dataset(sw, "wide", d)
    with shardwire.connect(node.socket).open_stream("wide") as s:
        with pytest.raises(shardwire.ServiceError) as e:
            s.next(timeout=60)
    assert e.value.code == "bad_plan" and "--columns" in str(e.value) and "shard 0" in str(e.value), e.value
