"""`shardwire index s3://bucket/prefix` against a real S3 API server (moto in IAM mode, so SigV4
is checked; tests/e2e/s3server.py), with the fault-injecting proxy in front of it where the
requests are counted or faults injected (tests/e2e/s3fault.py).

Every format `index` reads locally is written by its own library (pyarrow, numpy, webdataset,
MosaicML Streaming, megatron-core, a raw token array, pyarrow.parquet), uploaded with boto3 and
indexed both from a local copy and from S3. The S3 manifest's shards must equal the directory's
(file, offset, length, CRC-32C, tensors); its objects must carry the size and ETag boto3's
head_object reports; it must be written beside the data. The proxy's log shows what reading
cost: every GET ranged, at most the request size, with `If-Match` the object's ETag; a few GETs
per object (the counts are printed: run with `-s`). A wrong secret, a missing bucket, a prefix
with no objects, a read-only http(s) location, throttling past the retry budget: each fails
with an error that names the cause and the bucket.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO, arrow_batches, child_env, require_bin, write_arrow

MANIFEST = "shardwire.manifest.json"
MiB = 1 << 20
#: The store's default request size (object_store_request_size).
REQUEST_SIZE = 8 * MiB
PREFIX = "datasets/ds"


# --- dataset writers (each writes `d` and returns extra `shardwire index` flags) -------------


def _arrow(d: pathlib.Path) -> list[str]:
    import pyarrow as pa

    write_arrow(d / "part-0.arrow", arrow_batches([50, 70, 30], seed=1), stream=False)
    write_arrow(d / "part-1.arrows", arrow_batches([40, 40], seed=2, id_start=150), stream=True)
    # 2.4 MB in 20 record batches: metadata spread over the file, read by growing extents.
    write_arrow(d / "big.arrow", arrow_batches([5000] * 20, seed=6, id_start=1000), stream=False)
    rng = np.random.default_rng(3)
    ragged = pa.table({
        "tokens": pa.array([rng.integers(0, 1000, size=i % 9).tolist() for i in range(120)], pa.list_(pa.int32())),
        "text": pa.array(["row %d " % i + "x" * (i % 13) for i in range(120)], pa.string()),
    })
    with pa.ipc.new_file(str(d / "sub" / "ragged.arrow"), ragged.schema) as w:
        for b in ragged.to_batches(max_chunksize=50):
            w.write_batch(b)
    return []


def _npy(d: pathlib.Path) -> list[str]:
    rng = np.random.default_rng(4)
    np.save(d / "emb.npy", rng.standard_normal((300, 16)).astype(np.float32))
    np.save(d / "labels.npy", np.arange(300, dtype=np.int64))
    # Larger than one request: its CRC pass is read in request-size parts.
    np.save(d / "big" / "pixels.npy", rng.integers(0, 256, size=(20, 1024, 1024), dtype=np.uint8))
    return []


def _wds(d: pathlib.Path) -> list[str]:
    wds = pytest.importorskip("webdataset", reason="needs webdataset (tests/e2e/requirements.txt)")
    for s in range(3):
        with wds.TarWriter(str(d / ("shard-%03d.tar" % s))) as w:
            for i in range(s * 80, (s + 1) * 80):
                rng = np.random.default_rng(i)
                w.write({"__key__": "s%05d" % i, "img.npy": rng.standard_normal((4, 3)).astype(np.float32),
                         "cls": i * 7 + 3, "txt": "sample %d " % i + "x" * (i % 17)})
    return []


def _mds(d: pathlib.Path) -> list[str]:
    from test_formats_mds import PY, WRITER

    if not PY.is_file():
        pytest.skip(f"needs MosaicML Streaming: {PY} is missing")
    r = subprocess.run([str(PY), "-c", WRITER, str(d / "mds"), "300", ""], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"needs MosaicML Streaming: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, f"MDSWriter failed:\n{r.stdout}\n{r.stderr}"
    return []


def _megatron(d: pathlib.Path) -> list[str]:
    torch = pytest.importorskip("torch", reason="needs torch (tests/e2e/requirements-frameworks.txt)")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                  reason="needs megatron-core (tests/e2e/requirements-frameworks.txt)")
    prefix = str(d / "corpus_text_document")
    b = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(301):
        rng = np.random.default_rng(i)
        b.add_item(torch.tensor(rng.integers(0, 65536, size=1 + i * 7 % 61).astype(np.int64)))
        if i % 3 == 2 or i == 300:
            b.end_document()
    b.finalize(prefix + ".idx")
    return []


def _tokens(d: pathlib.Path) -> list[str]:
    rng = np.random.default_rng(5)
    toks = rng.integers(1, 50_000, size=6 * MiB, dtype=np.uint16)  # 12 MiB: more than one request
    toks[rng.integers(0, toks.size, size=2000)] = 0
    toks.tofile(d / "train.bin")
    return ["--tokens", "uint16", "--eos", "0"]


def _parquet(d: pathlib.Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(start: int, n: int):
        rng = np.random.default_rng(start)
        ids = list(range(start, start + n))
        return pa.table({
            "id": pa.array(ids, pa.int64()),
            "text": pa.array(["row %d " % i + "x" * (i % 13) for i in ids], pa.string()),
            "tokens": pa.array([rng.integers(0, 30_000, size=i % 11).tolist() for i in ids], pa.list_(pa.int32())),
        })

    pq.write_table(table(0, 180), d / "a.parquet", row_group_size=40)
    pq.write_table(table(1000, 123), d / "sub" / "b.parquet", row_group_size=50, compression="zstd")
    return []


FORMATS = {
    "arrow": _arrow,
    "npy": _npy,
    "wds": _wds,
    "mds": _mds,
    "megatron": _megatron,
    "tokens": _tokens,
    "parquet": _parquet,
}


# --- helpers ---------------------------------------------------------------------------------


def _env(s3_env: dict, **extra: str) -> dict:
    env = {k: v for k, v in child_env().items() if not k.startswith("AWS_")}
    env.update(s3_env)
    env.update(extra)
    return env


def _index(target: str, env: dict, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(require_bin()), "index", "--quiet", *flags, target], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"shardwire index failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def _digest(r: subprocess.CompletedProcess) -> str:
    return r.stdout.split(" digest ")[1].split()[0]


def _write(tmp_path: pathlib.Path, fmt: str) -> tuple[pathlib.Path, list[str]]:
    d = tmp_path / fmt
    for sub in ("", "sub", "big"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    flags = FORMATS[fmt](d)
    for sub in ("sub", "big"):
        if not any((d / sub).iterdir()):
            (d / sub).rmdir()
    return d, flags


def _shards(m: dict) -> list[dict]:
    return [{k: s[k] for k in ("file", "offset", "length", "crc32c", "tensors")} for s in m["shards"]]


def _get_costs(proxy, bucket: str, m: dict) -> dict[str, tuple[int, int]]:
    """Per object key (relative to PREFIX): (GETs, bytes). Checks every GET of an object: ranged,
    at most the request size, with If-Match its listed ETag."""
    etags = {o["file"]: o["etag"] for o in m["objects"]}
    costs: dict[str, tuple[int, int]] = {}
    for ex in proxy.requests(method="GET"):
        assert ex.signed, f"unsigned request {ex.path}"
        if ex.path.rstrip("/") == f"/{bucket}":
            assert "list-type=2" in ex.query, ex.query
            continue
        key = ex.key.removeprefix(PREFIX + "/")
        assert ex.range and ex.range.startswith("bytes="), f"GET {key} without a range"
        first, _, last = ex.range[len("bytes="):].partition("-")
        if first:  # bytes=a-b (a suffix bytes=-n has no first byte)
            assert int(last) - int(first) + 1 <= REQUEST_SIZE, f"GET {key} {ex.range} over the request size"
        else:
            assert int(last) <= REQUEST_SIZE, ex.range
        if key in etags:
            assert ex.if_match == etags[key], f"GET {key}: If-Match {ex.if_match} != {etags[key]}"
        n, b = costs.get(key, (0, 0))
        costs[key] = (n + 1, b + ex.response_bytes)
    return costs


# --- every format ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_indexes_from_s3_as_from_a_directory(tmp_path, s3, s3_bucket, s3_proxy, fmt):
    d, flags = _write(tmp_path, fmt)
    s3.upload_dir(d, s3_bucket, PREFIX, part_size=5 * MiB)  # large files as multipart (ETag "..-N")
    local = _ok(_index(str(d), child_env(), *flags))
    want = json.loads((d / MANIFEST).read_text())
    assert "objects" not in want, "a directory's manifest keeps its old form"

    r = _ok(_index(f"s3://{s3_bucket}/{PREFIX}", _env(s3_proxy.env()), *flags))
    s3_proxy.wait_idle()
    body = s3.client().get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{MANIFEST}")["Body"].read()
    m = json.loads(body)
    assert r.stdout.rstrip().endswith(f"-> s3://{s3_bucket}/{PREFIX}/{MANIFEST}"), r.stdout
    assert _digest(r) == m["digest"] != _digest(local)
    assert _shards(m) == _shards(want), "S3 shards differ from the directory's"
    assert m["total_bytes"] == want["total_bytes"]

    files = sorted({s["file"] for s in m["shards"]})
    # A Parquet dataset's objects list the Parquet objects converted too (their ETags: a
    # changed one is a changed dataset), beside the converted shards.
    sources = sorted(str(p.relative_to(d)) for p in d.rglob("*.parquet")) if fmt == "parquet" else []
    assert [o["file"] for o in m["objects"]] == sorted(files + sources)
    assert fmt != "parquet" or sources, "the parquet dataset has Parquet files"
    for o in m["objects"]:
        head = s3.head(s3_bucket, f"{PREFIX}/{o['file']}")
        assert (o["size"], o["etag"]) == (head["ContentLength"], head["ETag"]), o["file"]

    costs = _get_costs(s3_proxy, s3_bucket, m)
    sizes = {o["file"]: o["size"] for o in m["objects"]}
    lines = []
    for key, (gets, nbytes) in sorted(costs.items()):
        size = sizes.get(key) or s3.head(s3_bucket, f"{PREFIX}/{key}")["ContentLength"]
        parts = math.ceil(size / REQUEST_SIZE)
        lines.append(f"{key}: {size} bytes, {gets} GETs, {nbytes} bytes fetched")
        # Structure (headers, footers, index files, tar headers) costs a few GETs; a shard's
        # bytes are read once (from what structure reads fetched, or by the CRC pass in
        # request-size parts): about the object's size in all, plus a header block.
        assert gets <= parts + 8, f"{key}: {gets} GETs for {size} bytes"
        assert nbytes <= size + 128 * 1024, f"{key}: {nbytes} bytes fetched for {size}"
    print(f"\n[{fmt}] GETs per object:\n  " + "\n  ".join(lines))


def test_a_second_parquet_index_reuses_the_uploaded_conversion(tmp_path, s3, s3_bucket):
    d, _ = _write(tmp_path, "parquet")
    s3.upload_dir(d, s3_bucket, PREFIX)
    url = f"s3://{s3_bucket}/{PREFIX}"
    first = _ok(_index(url, _env(s3.env())))
    assert first.stderr.count("(converted, ") == 2, first.stderr
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert f"{PREFIX}/.shardwire-cache/parquet/a.parquet.arrow" in keys
    assert f"{PREFIX}/.shardwire-cache/parquet/sub/b.parquet.arrow.json" in keys
    second = _ok(_index(url, _env(s3.env())))
    assert second.stderr.count("(reused, ") == 2 and "unchanged at ETag" in second.stderr, second.stderr
    assert _digest(second) == _digest(first)


# --- credentials, locations, output --------------------------------------------------------------


@pytest.fixture
def small(tmp_path, s3, s3_bucket) -> str:
    """A small .npy dataset in the test's bucket; returns its URL."""
    d = tmp_path / "small"
    d.mkdir()
    np.save(d / "x.npy", np.arange(64, dtype=np.float32))
    s3.upload_dir(d, s3_bucket, PREFIX)
    return f"s3://{s3_bucket}/{PREFIX}"


def test_startup_log_names_the_credential_source_endpoint_and_region(s3, small):
    r = _ok(_index(small, _env(s3.env())))
    line = next((ln for ln in r.stderr.splitlines() if "object store: s3:" in ln), "")
    assert "credentials static keys from AWS_ACCESS_KEY_ID" in line, r.stderr
    assert f"endpoint {s3.endpoint}" in line and "region us-east-1" in line, line
    assert "path-style" in line, line
    assert s3.secret_key not in r.stderr + r.stdout, "the secret must never be logged"


def test_a_wrong_secret_is_refused_with_the_credentials_error(s3, s3_bucket, small):
    wrong = s3.secret_key[:-4] + ("AAAA" if not s3.secret_key.endswith("AAAA") else "BBBB")
    r = _index(small, _env(s3.env(), AWS_SECRET_ACCESS_KEY=wrong))
    assert r.returncode != 0, r.stdout
    assert "credentials refused" in r.stderr and f"bucket {s3_bucket}" in r.stderr, r.stderr
    assert "SignatureDoesNotMatch" in r.stderr, r.stderr
    assert wrong not in r.stderr


def test_a_missing_bucket_or_prefix_is_named(s3, s3_bucket, small):
    r = _index("s3://no-such-bucket-shardwire/x", _env(s3.env()))
    assert r.returncode != 0
    assert "bucket no-such-bucket-shardwire" in r.stderr and "not found" in r.stderr, r.stderr
    r = _index(f"s3://{s3_bucket}/no/such/prefix", _env(s3.env()))
    assert r.returncode != 0
    assert f"s3://{s3_bucket}/no/such/prefix: no objects under this prefix" in r.stderr, r.stderr
    r = _index("s4://bucket/x", _env(s3.env()))
    assert r.returncode != 0 and "unsupported scheme `s4`" in r.stderr, r.stderr


def test_manifest_out_writes_locally_and_not_beside_the_data(tmp_path, s3, s3_bucket, small):
    out = tmp_path / "out" / "m.json"
    out.parent.mkdir()
    r = _ok(_index(small, _env(s3.env()), "--manifest-out", str(out)))
    assert r.stdout.rstrip().endswith(f"-> {out}"), r.stdout
    m = json.loads(out.read_text())
    assert _digest(r) == m["digest"] and m["objects"][0]["file"] == "x.npy"
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert keys == [f"{PREFIX}/x.npy"], "nothing written to the bucket"


def test_http_locations_need_manifest_out():
    # Refused before any request: nothing listens on port 9 of loopback.
    r = _index("http://127.0.0.1:9/ds", child_env())
    assert r.returncode != 0
    assert "read-only" in r.stderr and "--manifest-out" in r.stderr, r.stderr


def test_file_urls_index_a_local_directory(tmp_path):
    d = tmp_path / "f"
    d.mkdir()
    np.save(d / "x.npy", np.arange(100, dtype=np.int32))
    local = _ok(_index(str(d), child_env()))
    want = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).unlink()
    r = _ok(_index(f"file://{d}", child_env()))
    m = json.loads((d / MANIFEST).read_text())
    assert _shards(m) == _shards(want)
    assert m["objects"][0]["file"] == "x.npy" and m["objects"][0]["size"] == (d / "x.npy").stat().st_size
    assert _digest(r) != _digest(local), "the objects' ETags are in the digest"


# --- throttling ----------------------------------------------------------------------------------


def test_throttling_is_retried_then_reported_with_the_retry_after(s3, s3_bucket, s3_proxy, small):
    env = _env(s3_proxy.env())
    # Two SlowDowns: within object_store's retry budget; the window is halved (logged).
    s3_proxy.slowdown(n=2, key="x.npy")
    r = _ok(_index(small, env))
    assert "in-flight window halved" in r.stderr, r.stderr
    assert s3_proxy.count(method="GET", status=503) == 2
    # More than the budget: a typed error naming bucket, key, range and the Retry-After.
    s3_proxy.clear()
    s3_proxy.reset_log()
    s3_proxy.slowdown(n=50, retry_after=3, key="x.npy")
    r = _index(small, env)
    assert r.returncode != 0
    assert "throttled by the store" in r.stderr and f"bucket {s3_bucket}, key {PREFIX}/x.npy" in r.stderr, r.stderr
    assert "bytes 0.." in r.stderr and "Retry-After 3.0 s" in r.stderr, r.stderr
    assert s3_proxy.count(method="GET", status=503) == 3, "one try and object_store's 2 retries"


def test_a_connection_reset_mid_body_is_retried_and_the_crcs_stay_right(tmp_path, s3, s3_bucket, s3_proxy):
    d = tmp_path / "reset"
    d.mkdir()
    data = np.random.default_rng(7).integers(0, 256, size=12 * MiB, dtype=np.uint8)
    data.tofile(d / "blob.bin")
    s3.upload_dir(d, s3_bucket, PREFIX)
    want = json.loads(_ok(_index(str(d), child_env())) and (d / MANIFEST).read_text())
    # The first GET of the object to reach the proxy is cut after 1 MiB with a TCP reset;
    # object_store asks for the rest of that range, still with If-Match, and the CRC covers the
    # bytes once. The index reads the object in two ranges at once (8 MiB, then the last 4 MiB),
    # so either may be the one cut.
    s3_proxy.reset_mid_body(n=1, after=MiB, key="blob.bin")
    r = _ok(_index(f"s3://{s3_bucket}/{PREFIX}", _env(s3_proxy.env())))
    m = json.loads(s3.client().get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{MANIFEST}")["Body"].read())
    assert _shards(m) == _shards(want), r.stderr
    gets = [(ex.range, ex.fault, ex.if_match) for ex in s3_proxy.requests(method="GET", key="blob.bin")]
    etag = m["objects"][0]["etag"]
    assert sorted(g[0] for g in gets if g[0] in ("bytes=0-8388607", "bytes=8388608-12582911")) == [
        "bytes=0-8388607", "bytes=8388608-12582911"], gets
    cut = [g for g in gets if g[1] == f"reset_mid_body(after={MiB})"]
    assert len(cut) == 1 and cut[0][2] == etag, gets
    first, last = map(int, cut[0][0].removeprefix("bytes=").split("-"))
    assert (f"bytes={first + MiB}-{last}", None, etag) in gets, gets
