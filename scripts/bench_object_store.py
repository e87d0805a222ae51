"""Goodput to a trainer from object storage against the same dataset from a local directory,
in one run (scripts/bench-object-store; results in docs/BENCHMARKS.md).

One dataset (--shards .npy shards of --shard-size random bytes, indexed once) is uploaded to a
moto S3 server on 127.0.0.1 (tests/e2e/s3server.py: IAM mode, every request signed and
checked). For each way a source serves it, a fresh `shardwire source` + `shardwire serve`
pair runs --epochs epochs of it in shard mode into a Python SDK trainer (the shardwire package
of .venv, each batch viewed and released, nothing copied):

- local:        the directory (`sendfile` from the page cache), the baseline;
- s3:           `--dataset ds=s3://bucket/ds`, no disk cache (every epoch read from the store);
- s3-cache:     the same with `--cache-dir` (a cache larger than the dataset): epoch 1 fills
                it (cold), later epochs are served from it (warm);
- boto3-threads: no shardwire: every object fetched whole by boto3 from 32 threads, each pass
                timed: what the store itself delivers on this host (the ceiling of the s3 way).

Per way: Gbit/s of each epoch (epoch 1 apart: it includes the first reads), the steady-state
median of the later epochs, and from the source's /metrics the GETs it sent, GETs per GB read
from the store and the estimated request cost per TB read at S3 Standard's GET price
($0.0004 per 1,000). moto is a Python server that copies each object per GET: the s3 figures
measure the source's pipeline against a slow store on this host, not S3's throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "client" / "python" / "src"))

from bench_loaders import Child, cpu_model  # noqa: E402

# The binary scripts/bench-object-store just built: cargo puts it under CARGO_TARGET_DIR when set
# (relative to the repository, where the wrapper runs cargo), as bench_loaders.py finds it.
BIN = pathlib.Path(os.environ.get("SHARDWIRE_BIN") or ROOT / os.environ.get("CARGO_TARGET_DIR", "target") / "release" / "shardwire")
SOURCE_READY = re.compile(r"source listening on (\S+)")
ADMIN = re.compile(r"source admin on http://(\S+)")
SERVE_READY = re.compile(r"node service ready: socket (\S+) admin http://(\S+)")
GET_PRICE = 0.0004 / 1000  # S3 Standard, per GET


def size(s: str) -> int:
    m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)?", s)
    if not m:
        raise argparse.ArgumentTypeError(f"{s}: a size such as 4MiB")
    return int(m.group(1)) << {None: 0, "KiB": 10, "MiB": 20, "GiB": 30}[m.group(2)]


def write_dataset(d: pathlib.Path, shards: int, shard_size: int) -> int:
    import numpy as np

    d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i in range(shards):
        np.save(d / f"s{i:04d}.npy", rng.integers(0, 256, shard_size, dtype=np.uint8))
    subprocess.run([str(BIN), "index", str(d)], check=True, capture_output=True)
    return json.loads((d / "shardwire.manifest.json").read_text())["total_bytes"]


def metrics(admin: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, labels, v in re.findall(r"^(shardwire_source_[a-z_]+)(\{[^}]*\})? (\S+)$", text, re.M):
        out[name + (labels or "")] = out.get(name + (labels or ""), 0.0) + float(v)
    return out


def gets(m: dict[str, float]) -> int:
    return int(sum(v for k, v in m.items() if k.startswith("shardwire_source_store_requests_total") and 'op="get"' in k))


def run_way(name: str, spec: str, extra: list[str], env: dict, a, total: int, tmp: pathlib.Path) -> dict:
    import shardwire

    children: list[Child] = []
    os.environ.update(env)
    try:
        src = Child([str(BIN), "source", "--listen", "127.0.0.1:0", "--dataset", spec, "--admin", "127.0.0.1:0",
                     "--object-store-request-size", str(a.request_size), *extra], tmp / f"{name}-source.log")
        children.append(src)
        addr = src.wait(SOURCE_READY).group(1)
        admin = src.wait(ADMIN).group(1)
        serve = Child([str(BIN), "serve", "--source", addr, "--socket", str(tmp / f"{name}.sock"), "--data-listen", "127.0.0.1:0",
                       "--admin", "127.0.0.1:0", "--pool-size", "1GiB", "--stream-memory", str(a.stream_memory)], tmp / f"{name}-serve.log")
        children.append(serve)
        sock = serve.wait(SERVE_READY).group(1)
        time.sleep(0.5)
        stream = shardwire.connect(sock).open_stream("ds", epochs=a.epochs)
        per_epoch, seen, t0 = [], 0, time.perf_counter()
        first = None
        for b in stream:
            if first is None:
                first = time.perf_counter() - t0
            seen += 1
            if seen % a.shards == 0:
                now = time.perf_counter()
                per_epoch.append(total * 8 / (now - t0) / 1e9)
                t0 = now
            del b
        m = metrics(admin)
    finally:
        for c in reversed(children):
            c.stop()
    n = gets(m)
    fetched = m.get("shardwire_source_store_shard_bytes_total", 0.0)
    row = {"way": name, "epochs_gbps": [round(x, 3) for x in per_epoch], "first_batch_s": round(first or 0, 3),
           "gets": n, "store_gb": round(fetched / 1e9, 3)}
    if fetched:
        row["gets_per_gb"] = round(n / (fetched / 1e9), 1)
        row["usd_per_tb_read"] = round(n / (fetched / 1e12) * GET_PRICE, 4)
    served = {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("shardwire_source_remote_fetches_total{")}
    if served:
        row["served"] = served
    return row


def boto3_ceiling(s3, bucket: str, keys: list[str], total: int, threads: int, epochs: int) -> dict:
    """The store's ceiling on this host: every object fetched whole with boto3 from `threads`
    threads at once (a careful hand-written downloader), `epochs` times; Gbit/s per pass."""
    from concurrent.futures import ThreadPoolExecutor

    client = s3.client()
    out = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(lambda k: len(client.get_object(Bucket=bucket, Key=k)["Body"].read()), keys))
        assert got == total, (got, total)
        out.append(round(total * 8 / (time.perf_counter() - t0) / 1e9, 3))
    return {"way": "boto3-threads", "epochs_gbps": out, "threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--shard-size", type=size, default=4 << 20)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--request-size", type=size, default=8 << 20)
    p.add_argument("--stream-memory", type=size, default=64 << 20)
    a = p.parse_args()
    from s3server import S3Server

    # A SIGTERM (a `kill`, a runner's timeout) would end Python without its `finally` blocks and
    # leave `shardwire source` and `serve` running: exit through them instead (moto dies with
    # this process on its own), as bench_loaders.py does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with tempfile.TemporaryDirectory(prefix="sw-bench-s3-") as t:
        tmp = pathlib.Path(t)
        data = tmp / "ds"
        total = write_dataset(data, a.shards, a.shard_size)
        with S3Server(tmp / "moto") as s3:
            bucket = s3.make_bucket("bench")
            s3.upload_dir(data, bucket, "ds")
            env = s3.env()
            url = f"s3://{bucket}/ds"
            keys = [f"ds/{p.name}" for p in sorted(data.glob("*.npy"))]
            object_bytes = sum(p.stat().st_size for p in data.glob("*.npy"))
            rows = [
                boto3_ceiling(s3, bucket, keys, object_bytes, 32, a.epochs),
                run_way("local", f"ds={data}", [], {}, a, total, tmp),
                run_way("s3", f"ds={url}", [], env, a, total, tmp),
                run_way("s3-cache", f"ds={url}", ["--cache-dir", str(tmp / "cache"), "--cache-size", str(2 * total)], env, a, total, tmp),
            ]
    local = statistics.median(rows[1]["epochs_gbps"][1:] or rows[1]["epochs_gbps"])
    print(f"cpu: {cpu_model()}; dataset {a.shards} x {a.shard_size} B = {total} B; epochs {a.epochs}; request size {a.request_size}")
    for r in rows:
        steady = statistics.median(r["epochs_gbps"][1:] or r["epochs_gbps"])
        r["steady_gbps"] = round(steady, 3)
        r["steady_vs_local"] = round(steady / local, 3)
        r["epoch1_vs_local"] = round(r["epochs_gbps"][0] / local, 3)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
