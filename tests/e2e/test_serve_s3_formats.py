"""Every format, served from object storage, delivers exactly what the same dataset served
from a local directory delivers: each dataset (written by its own library, the writers of
test_index_s3.py) is uploaded to moto (IAM mode), indexed from s3://, and one source serves it
twice, `local=DIR` and `remote=s3://...`; one node consumes both with the same seed, in shard
mode and in batch (or token) mode, and the batches must be identical, tensor for tensor.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from conftest import child_env, index_dataset, require_bin, wait_ready
from test_index_s3 import FORMATS

# Batch-mode options per format (None: shard mode only).
BATCH = {
    "arrow": None,  # its files hold different columns: shard mode only
    "wds": {"batch_size": 16, "shuffle": "none"},
    "mds": {"batch_size": 16, "shuffle": "none"},
    "parquet": {"batch_size": 16, "shuffle": "none"},
    "tokens": {"batch_size": 4, "seq_len": 128, "shuffle": "none"},
    "megatron": {"batch_size": 4, "seq_len": 64, "shuffle": "none"},
    "npy": None,
}


def tensors(batches: list[dict], shard_mode: bool) -> list:
    """Each batch's tensors (name, dtype, shape, CRC-32C): in shard order for shard mode (the
    shuffled order depends on the manifest's digest, which covers the ETags an s3 index
    records), in delivery order for batch mode (run unshuffled)."""
    if shard_mode:
        batches = sorted(batches, key=lambda b: b["shard"])
    return [[(t["name"], t["dtype"], list(t["shape"]), t["crc32c"]) for t in b["tensors"]] for b in batches]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_format_served_from_s3_delivers_what_the_directory_delivers(fmt, sw, s3, s3_bucket, tmp_path):
    d = tmp_path / fmt
    for sub in ("sub", "big"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    flags = FORMATS[fmt](d)
    for sub in ("sub", "big"):
        if not any((d / sub).iterdir()):
            (d / sub).rmdir()
    s3.upload_dir(d, s3_bucket, "ds")
    url = f"s3://{s3_bucket}/ds"
    r = subprocess.run([str(require_bin()), "index", "--quiet", *flags, url], capture_output=True, text=True,
                       timeout=300, env=child_env(s3.env()))
    assert r.returncode == 0, r.stderr[-3000:]
    index_dataset(d, *flags)
    src = sw.source({"local": d, "remote": url}, env=s3.env())
    node = sw.serve([src], "--pool-size", "256MiB", "--stream-memory", "64MiB")
    wait_ready(node)
    modes = [{}] + ([BATCH[fmt]] if BATCH[fmt] else [])
    for opts in modes:
        local = sw.consume(node, "local", seed=3, **opts)
        remote = sw.consume(node, "remote", seed=3, **opts)
        assert local, f"{fmt} {opts}: no batches"
        shard_mode = not opts
        assert tensors(remote, shard_mode) == tensors(local, shard_mode), f"{fmt} {opts}: the s3 dataset delivered other bytes"
    assert node.status()["counters"]["crc_failures"] == 0
