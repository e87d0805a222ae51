"""scripts/bench_loaders.py, where the issue's loader figures come from: the local baseline's
two-level block shuffle resumes at a batch (`block_batches(skip=k)` is the tail of the whole
epoch, so its time to the first batch resumed is measured at the right place), and a short run
of shardwire against numpy-mmap-gather completes and reports the steady-state ratio and the
times to the first batch, fresh and resumed, writing only the on-disk forms its loaders read
(no MDS, so no .venv-streaming)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, require_bin

SCRIPT = REPO / "scripts" / "bench_loaders.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_loaders", SCRIPT)
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("skip", [0, 1, 5, 17])
def test_the_local_block_shuffle_resumes_at_a_batch(skip):
    pytest.importorskip("numpy", reason="numpy is installed by scripts/test")
    m = bench_module()
    rows = [37, 64, 5, 128, 90, 64, 1, 33]  # uneven shards; blocks close at a shard end past S
    n, batch = sum(rows), 16
    full = [b.tolist() for b in m.block_batches(rows, 4, 2, 100, batch)]
    assert len(full) == n // batch, "batches run across block edges, the last partial one dropped"
    flat = [x for b in full for x in b]
    assert len(set(flat)) == len(flat) and all(0 <= x < n for x in flat)
    assert full != [b.tolist() for b in m.block_batches(rows, 5, 2, 100, batch)], "the seed matters"
    tail = [b.tolist() for b in m.block_batches(rows, 4, 2, 100, batch, skip=skip)]
    assert tail == full[skip:]


def test_a_batch_counts_its_ids_and_the_cpu_line_names_the_crc_flags():
    m = bench_module()
    # The node assembles both columns: 8 B of id and 1 KiB of x a row (before: 1 KiB only).
    assert m.batch_bytes(256) == 256 * 1032
    assert {"sse4_2", "pclmulqdq", "vpclmulqdq", "erms", "fsrm"} <= set(m.CPU_FLAGS)


def test_only_the_forms_the_loaders_read_are_written(tmp_path, monkeypatch):
    m = bench_module()

    def forms(loaders, quality=False):
        return m.forms_for(argparse.Namespace(loaders=loaders, shuffle_quality=quality))

    assert forms("shardwire,numpy-mmap-gather") == set()
    assert forms("shardwire,streaming") == {"mds"}
    assert forms(",".join(m.LOADERS)) == {"mds", "wds"}
    assert forms(",".join(m.LOADERS), quality=True) == set()
    # A marker from before the forms were recorded stands for every form written: nothing is
    # written again (a missing streaming interpreter would say so).
    monkeypatch.setattr(m, "STREAMING_PY", tmp_path / "missing" / "python")
    data = tmp_path / "data"
    data.mkdir()
    params = {"n": 8, "shard_rows": 4, "files": 1, "dim": m.DIM, "v": 1}
    (data / "params.json").write_text(json.dumps(params))
    m.prepare(data, 8, 4, 1, {"mds", "wds"})
    # One that records Arrow alone asks for the MDS shards, which need that interpreter.
    (data / "params.json").write_text(json.dumps({**params, "forms": []}))
    with pytest.raises(SystemExit, match="streaming-venv"):
        m.prepare(data, 8, 4, 1, {"mds"})


def test_a_short_run_reports_the_ratio_and_the_first_batch(tmp_path):
    pytest.importorskip("torch", reason="torch is installed by scripts/test (requirements-frameworks.txt)")
    pytest.importorskip("pyarrow", reason="pyarrow is installed by scripts/test")
    # Neither loader reads MDS or tars: the run needs no .venv-streaming (before, it always
    # wrote MDS with it, and failed where scripts/streaming-venv could not make it).
    env = dict(os.environ, SHARDWIRE_BIN=str(require_bin()), SHARDWIRE_STREAMING_VENV=str(tmp_path / "no-streaming-venv"))
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--samples", "16384", "--shard-rows", "1024",
         "--files", "2", "--shuffle-block", "4096", "--warmup", "20", "--warmup-seconds", "0.2",
         "--seconds", "1.0", "--loaders", "shardwire,numpy-mmap-gather", "--data", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert not (tmp_path / "data" / "mds").exists() and not (tmp_path / "data" / "wds").exists()
    report = json.loads(next(line for line in r.stdout.splitlines() if line.startswith('{"bench": "loaders"')))
    assert report["fastest_local"] == "numpy-mmap-gather"
    ratio = report["shardwire_vs_fastest_local"]["shardwire"]
    assert len(ratio["per_round"]) == 1 and ratio["per_round"][0] > 0
    assert 0 < ratio["first_batch_s"] < 60 and 0 < ratio["resume_first_batch_s"] < 60
    run = report["runs"]["shardwire"][0]
    assert run["seconds"] >= 1.0 and run["batches"] > 0 and run["warmup_batches"] >= 20
    assert 0 < run["node_gather_s_per_batch"] < 1, "the node's CRC + gather time per batch, from its metrics"
    assert report["runs"]["numpy-mmap-gather"][0]["node_gather_s_per_batch"] is None
    # The node received rows for what it assembled: the first epoch is always fetched; this
    # 16 MiB dataset (16384 rows of 1032 B) then stays resident in the 256 MiB region, so later
    # epochs fetch nothing. Below 1 once the run assembled more than the epoch it fetched: a 1 s
    # window does on a loaded 2-core machine (a 0.3 s one once assembled 0.8 of an epoch: 1.25).
    assert 0 < run["node_received_per_assembled"] < 1, "bytes received per byte assembled, from its metrics"
    assert report["runs"]["numpy-mmap-gather"][0]["node_received_per_assembled"] is None
    assert "numpy-mmap-gather" in r.stdout and "first batch" in r.stdout
    assert "| node CRC+gather, us |" in r.stdout, "the assembly counter holds the receivers' CRC too"
