"""A source serving a dataset from object storage (`--dataset NAME=s3://bucket/prefix`), on a
real S3 API server (moto in IAM mode: every request's SigV4 signature is checked) behind the
fault-injecting proxy, with real source and node processes on 127.0.0.1. Every batch is
checked byte for byte against the local files the dataset was uploaded from.

What is asserted here: planned ranged GETs pinned to the ETag (`If-Match`), parallel parts for
shards larger than the request size, read-ahead by the node's hints, a disk cache that serves
a second epoch without a GET and survives a restart, eviction by the plan on a cache smaller
than the dataset, memory bounds (read-ahead the cache does not admit, and the reads a node's
queued FETCHes start, each within the dataset's budget), and the failures (throttling absorbed, a reset or stalled body read again,
a changed object and a flipped byte never delivered, bad credentials refused by name).
"""

from __future__ import annotations

import json
import pathlib
import re
import socket
import struct
import time
from collections import Counter

import crc32c
import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
import shardwire  # noqa: E402
from conftest import (
    Source,
    assert_byte_exact,
    assert_exactly_once,
    expected_crcs,
    http_get,
    index_dataset,
    load_manifest,
    wait_for,
    wait_ready,
    write_uint8_shards,
)
from faults import DATA_READY, SHARD, control_frame, fetch, handshake_to_data_conn, host_port, next_non_ping

ADMIN = re.compile(r"source admin on http://(\S+)")


def upload(s3, bucket: str, d: pathlib.Path, prefix: str = "ds") -> str:
    """Indexes `d` locally and uploads it with its manifest; returns the dataset URL."""
    index_dataset(d)
    s3.upload_dir(d, bucket, prefix)
    return f"s3://{bucket}/{prefix}"


def run_epochs(sw, url: str, env: dict, *source_flags, epochs: int = 1, **consume):
    """A source on `url` (with its admin endpoint), a node on it, `epochs` epochs consumed."""
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", *source_flags, env=env)
    src.admin = src.wait_line(ADMIN).group(1)
    node = sw.serve([src], "--pool-size", "128MiB", "--stream-memory", "32MiB")
    wait_ready(node)
    batches = sw.consume(node, "ds", epochs=epochs, **consume)
    return src, node, batches


def source_status(src) -> dict:
    code, body = http_get(src.admin, "/v1/status")
    assert code == 200, body
    return json.loads(body)


def reading_shards(src) -> int:
    """Shards the source is reading now (started, not yet in memory)."""
    return source_status(src)["datasets"][0]["object_store"]["reading_shards"]


def cache_entries(src, cache: pathlib.Path) -> list:
    """The cache directory's files, once no cache write is under way: a FETCH does not wait for
    its shard's write (`writing_bytes` in /v1/status counts those under way), and a write
    deletes the files of the entries it evicted (`.NAME.evicted`) and renames its `.NAME.partial`
    into place on its own thread."""
    def settled():
        return source_status(src)["datasets"][0]["object_store"]["cache"]["writing_bytes"] == 0

    wait_for(settled, "the source's cache writes to end")
    return sorted((cache / "ds").iterdir())


def served_counts(src) -> dict:
    """{prefetched|cached|read: n} from the source's /metrics."""
    code, text = http_get(src.admin, "/metrics")
    assert code == 200, text
    return {k: int(float(v)) for k, v in re.findall(r'^shardwire_source_remote_fetches_total\{served="(\w+)"\} (\S+)', text, re.M)}


def gets(proxy, bucket: str) -> list:
    return [e for e in proxy.requests("GET", f"/{bucket}/") if e.range]


def next_payload(ctl, conn) -> tuple[int, int, int, bytes]:
    """The next SHARD announcement on `ctl` and its payload read from `conn`: (req, shard,
    announced CRC-32C, bytes)."""
    kind, body = next_non_ping(ctl)
    assert kind == SHARD, (kind, body[:200])
    req, shard, length, crc = struct.unpack(">QIQI", body[:24])
    payload = bytearray()
    while len(payload) < length:
        chunk = conn.recv(length - len(payload))
        assert chunk, "data connection closed early"
        payload += chunk
    return req, shard, crc, bytes(payload)


def retried(src) -> int:
    """GETs object_store sent again after a transport error (a read timeout when moto stalls):
    the source logs each retry, and each may read its range a second time."""
    return src.stderr_text().count("Encountered transport error")


def repeats(exchanges: list) -> list:
    """The exchanges whose (path, range) an earlier one already asked for."""
    seen, again = set(), []
    for e in exchanges:
        key = (e.path, e.range)
        if key in seen:
            again.append(e)
        seen.add(key)
    return again


def test_a_dataset_in_s3_is_served_byte_exact_with_ranged_gets_pinned_to_the_etag(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 6, 3 * 1024 * 1024 + 7, prefix="big", seed=1)  # > 1 MiB: parts
    write_uint8_shards(d, 6, 40_000, prefix="small", seed=2)
    url = upload(s3, s3_bucket, d)
    src, node, batches = run_epochs(sw, url, s3_proxy.env(), "--object-store-request-size", "1MiB")
    m = json.loads((d / "shardwire.manifest.json").read_text())
    assert_exactly_once(batches, len(m["shards"]))
    assert_byte_exact(batches, expected_crcs(d))
    assert node.status()["counters"]["crc_failures"] == 0
    g = gets(s3_proxy, s3_bucket)
    assert g, "no ranged GET reached the store"
    assert all(e.if_match for e in g), [e.range for e in g if not e.if_match]
    assert all(e.signed for e in g)
    sizes = [int(e.range.split("-")[1]) - int(e.range.split("=")[1].split("-")[0]) + 1 for e in g]
    assert max(sizes) <= 1 << 20, f"a GET larger than the request size: {max(sizes)}"
    # Shard data is read once (the manifest and listing aside): no whole-object re-reads; a
    # range asked for again only as a logged retry.
    data = [e for e in g if "manifest" not in e.path]
    assert len(repeats(data)) <= retried(src), [(e.path, e.range) for e in repeats(data)]
    by_range: dict = {}
    for e in data:
        by_range[(e.path, e.range)] = max(by_range.get((e.path, e.range), 0), e.response_bytes)
    data_bytes = sum(by_range.values())
    assert data_bytes == sum(s["length"] for s in m["shards"]), data_bytes
    st = source_status(src)
    ds = st["datasets"][0]
    assert ds["backend"] == "object_store" and ds["object_store"]["url"] == url, ds
    served = served_counts(src)
    assert sum(served.values()) == len(m["shards"]), served
    print("served:", served)


def test_a_second_epoch_is_served_from_the_cache_without_a_get_and_so_is_a_restart(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 8, 512 * 1024, seed=3)
    url = upload(s3, s3_bucket, d)
    cache = tmp_path / "cache"
    flags = ("--cache-dir", cache, "--cache-size", "64MiB")
    src, node, batches = run_epochs(sw, url, s3_proxy.env(), *flags, epochs=2)
    assert len(batches) == 16
    assert_byte_exact(batches, expected_crcs(d))
    first = len(gets(s3_proxy, s3_bucket))
    # (+ the manifest; + any retry the source logged)
    assert 8 <= first <= 9 + retried(src), f"{first} ranged GETs for 8 shards over two epochs"
    entries = [p.name for p in cache_entries(src, cache)]
    assert len(entries) == 8, entries
    node.stop()
    src.stop()
    # A restart keeps the entries (same objects, ETags, ranges) and reads nothing again.
    s3_proxy.reset_log()
    src, node, batches = run_epochs(sw, url, s3_proxy.env(), *flags, epochs=1)
    assert_exactly_once(batches, 8)
    assert_byte_exact(batches, expected_crcs(d))
    again = [e for e in gets(s3_proxy, s3_bucket) if "manifest" not in e.path]
    assert again == [], [(e.path, e.range) for e in again]
    assert [p.name for p in cache_entries(src, cache)] == entries


def test_a_cache_entry_corrupted_on_disk_is_checked_when_the_node_asks_again_and_read_anew(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 6, 256 * 1024, seed=15)
    url = upload(s3, s3_bucket, d)
    cache = tmp_path / "cache"
    src, node, batches = run_epochs(sw, url, s3_proxy.env(), "--cache-dir", cache, "--cache-size", "64MiB")
    assert_exactly_once(batches, 6)
    entries = cache_entries(src, cache)
    assert len(entries) == 6, entries
    # A bit flips on the cache's disk after the entry was written and checked.
    bad = entries[2]
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    bad.write_bytes(raw)
    s3_proxy.reset_log()
    # The node gets the corrupt bytes, finds the CRC wrong and asks again; the source checks
    # the entry then, deletes it and reads the shard from the store (it served the same
    # corrupt file again and again before: the epoch never ended).
    batches = sw.consume(node, "ds", seed=2)
    assert_exactly_once(batches, 6)
    assert_byte_exact(batches, expected_crcs(d))
    shard = int(bad.name[:8])
    again = [e.path for e in gets(s3_proxy, s3_bucket) if "manifest" not in e.path]
    assert again == [f"/{s3_bucket}/ds/s{shard:03d}.npy"], again
    assert "failed its CRC check" in src.stderr_text()


def test_a_cache_smaller_than_the_dataset_keeps_a_stable_slice_instead_of_churning(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 10, 1024 * 1024, seed=4)
    url = upload(s3, s3_bucket, d)
    cache = tmp_path / "cache"
    src, node, batches = run_epochs(sw, url, s3_proxy.env(), "--cache-dir", cache, "--cache-size", "4MiB", epochs=3)
    assert len(batches) == 30
    assert_byte_exact(batches, expected_crcs(d))
    data = [e for e in gets(s3_proxy, s3_bucket) if "manifest" not in e.path]
    # LRU would read all 10 shards in every epoch (30 GETs). Eviction by next use keeps 4
    # shards across epochs: epochs 2 and 3 read at most the other 6 each, and then some: one
    # full run on the loaded 2-core host read 23, one more than that (not reproduced in 14
    # runs of this test alone, 8 of them beside 3 busy loops; the cause is not established:
    # the hints reach the source asynchronously). Two more are allowed; churn would be 30.
    assert len(data) <= 10 + 2 * 6 + 2 + retried(src), [(e.path.rsplit("/", 1)[-1], e.range, round(e.started, 3)) for e in data]
    assert len(cache_entries(src, cache)) == 4
    st = source_status(src)["datasets"][0]["object_store"]["cache"]
    assert st["bytes"] <= 4 << 20 and st["entries"] == 4, st


def test_throttling_resets_and_stalls_lose_nothing(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 8, 600 * 1024, seed=5)
    url = upload(s3, s3_bucket, d)
    # A burst at start (the manifest read) is waited out; then the manifest changes between
    # its HEAD and its GET (as while `shardwire index` rewrites it): it is read again.
    s3_proxy.slowdown(n=3, retry_after=0.2)
    s3_proxy.status(1, 412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold", key="/ds/shardwire.manifest.json")
    src = sw.source({"ds": url}, env=s3_proxy.env())
    assert "the manifest changed while it was read" in src.stderr_text()
    assert s3_proxy.count("GET", status=412) == 1
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "16MiB")
    wait_ready(node)
    # Then on the shards: SlowDown, bodies reset half way, a body that stalls.
    s3_proxy.slowdown(n=6, retry_after=0.2, key="/ds/s")
    s3_proxy.reset_mid_body(n=2, after=100_000, key="/ds/s")
    s3_proxy.stall(n=1, after=10_000, seconds=15, key="/ds/s")
    batches = sw.consume(node, "ds")
    assert_exactly_once(batches, 8)
    assert_byte_exact(batches, expected_crcs(d))
    assert s3_proxy.count("GET", status=503) >= 9
    assert node.status()["counters"]["crc_failures"] == 0


def test_a_flipped_byte_is_read_again_and_never_delivered(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 4, 200_000, seed=6)
    url = upload(s3, s3_bucket, d)
    key = "ds/s002.npy"
    s3_proxy.flip_byte(n=1, offset=1000, key=key)
    src, node, batches = run_epochs(sw, url, s3_proxy.env())
    assert_exactly_once(batches, 4)
    assert_byte_exact(batches, expected_crcs(d))
    assert "reading the shard once more" in src.stderr_text()
    # Flipped every time: the source refuses the shard, naming it; the node ends the stream.
    s3_proxy.flip_byte(n=100, offset=1000, key=key)
    node2 = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "16MiB")
    wait_ready(node2)
    c = sw.start_consume(node2, "ds")
    assert c.wait(timeout=120) != 0
    text = c.describe()
    assert "crc-32c" in text.lower() and "s002.npy" in text, text[-3000:]


def test_a_changed_object_is_refused_naming_it_and_nothing_of_it_is_delivered(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 4, 100_000, seed=7)
    url = upload(s3, s3_bucket, d)
    src = sw.source({"ds": url}, env=s3_proxy.env())
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "16MiB")
    wait_ready(node)
    # The object changes after the source pinned its ETag.
    s3.put(s3_bucket, "ds/s001.npy", b"\x93NUMPY" + b"x" * 100_000)
    c = sw.start_consume(node, "ds")
    assert c.wait(timeout=120) != 0
    text = c.describe()
    assert "changed" in text.lower() and "s001.npy" in text, text[-3000:]


def test_a_wrong_secret_is_refused_at_start_naming_the_bucket(sw, s3, s3_bucket, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 2, 1000, seed=8)
    url = upload(s3, s3_bucket, d)
    env = dict(s3.env(), AWS_SECRET_ACCESS_KEY="wrong" + s3.secret_key[5:])
    p = sw._start(Source, "source", ["source", "--listen", "127.0.0.1:0", "--dataset", f"ds={url}"], env)
    assert p.wait(timeout=60) != 0
    text = p.describe()
    assert s3_bucket in text and ("credential" in text.lower() or "403" in text), text[-3000:]


def test_the_nodes_hints_let_the_source_read_ahead(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 40, 256 * 1024, seed=9)
    url = upload(s3, s3_bucket, d)
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", env=s3_proxy.env())
    src.admin = src.wait_line(ADMIN).group(1)
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "2MiB")
    wait_ready(node)
    batches = sw.consume(node, "ds", seed=5)
    assert_exactly_once(batches, 40)
    assert_byte_exact(batches, expected_crcs(d))
    served = served_counts(src)
    assert sum(served.values()) == 40, served
    # The region holds a few shards at a time; the hints name the next 256, so the source
    # reads them ahead and most FETCHes find their bytes already in memory.
    # (Not all: moto under a loaded machine answers slower than the node asks; 19 of 40 seen.)
    assert served.get("prefetched", 0) >= 15, served
    # Read ahead in the plan's (shuffled) order: each shard read once, a range asked for
    # again only as a retry the source logged (one full run: moto stalled past the read
    # timeout, 10 retries, 50 GETs for 40 shards).
    data = [e for e in gets(s3_proxy, s3_bucket) if "manifest" not in e.path]
    again = repeats(data)
    assert len(again) <= retried(src), [(e.path, e.range) for e in again]
    per_shard = Counter(e.path for e in data if e not in again)
    assert len(per_shard) == 40 and set(per_shard.values()) == {1}, per_shard


def test_read_ahead_the_cache_does_not_admit_stays_within_the_memory_budget(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 40, 256 * 1024, seed=11)
    url = upload(s3, s3_bucket, d)
    # A cache of 4 shards: read-ahead past them is needed later than all it holds, so the
    # cache refuses it and it stays in memory, which must then keep to the budget:
    # 2 x max_inflight x request_size = 1 MiB (the source once held 7 MiB of them).
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", "--cache-dir", tmp_path / "cache", "--cache-size", "1MiB",
                    "--object-store-request-size", "256KiB", "--object-store-max-inflight", "2", env=s3_proxy.env())
    src.admin = src.wait_line(ADMIN).group(1)
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "2MiB")
    wait_ready(node)
    with shardwire.connect(node.socket).open_stream("ds") as s:
        assert s.next(timeout=30) is not None
        # The node's region is full and its hints name the other shards: the source reads
        # ahead as far as its budget lets it, then waits.
        def prefetched() -> int:
            return source_status(src)["datasets"][0]["object_store"]["prefetched_bytes"]

        peak = wait_for(prefetched, "the source to read ahead", 30)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            peak = max(peak, prefetched())
            time.sleep(0.1)
        assert peak <= 1 << 20, peak
    batches = sw.consume(node, "ds", seed=5)
    assert_exactly_once(batches, 40)
    assert_byte_exact(batches, expected_crcs(d))


def test_a_node_that_queues_many_fetches_makes_the_source_read_only_its_budget_ahead(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 24, 256 * 1024, seed=12)
    url = upload(s3, s3_bucket, d)
    # Budget: 2 x max_inflight x request_size = 1 MiB, four of these shards.
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", "--object-store-request-size", "256KiB",
                    "--object-store-max-inflight", "2", env=s3_proxy.env())
    src.admin = src.wait_line(ADMIN).group(1)
    data = socket.create_server(("127.0.0.1", 0))
    data.settimeout(10)
    ctl, conn, _ = handshake_to_data_conn(host_port(src.addr), data)
    s3_proxy.reset_log()
    # A raw node queues a FETCH for every shard and reads nothing yet (no DataReady): the
    # source once read all 24 into memory for it; now it reads 4 and the rest wait, queued.
    for shard in range(24):
        ctl.sendall(fetch(shard + 1, "ds", shard))

    def read_shards():
        return {e.path for e in gets(s3_proxy, s3_bucket)}

    wait_for(lambda: len(read_shards()) >= 3, "the first reads", 10)
    # The reads the budget lets start have ended; the rest wait (a read over the budget would
    # have started with them: every FETCH was queued at once).
    wait_for(lambda: reading_shards(src) == 0, "the reads within the budget to end", 30)
    assert len(read_shards()) <= 4, sorted(read_shards())
    # Once payloads go out, the waiting reads start: every shard arrives, byte exact.
    ctl.sendall(control_frame(DATA_READY, struct.pack(">H", 0)))
    want, got = [sh["crc32c"] for sh in load_manifest(d)["shards"]], {}
    conn.settimeout(30)
    ctl.settimeout(30)
    while len(got) < 24:
        req, shard, crc, payload = next_payload(ctl, conn)
        assert crc32c.crc32c(payload) == crc == want[shard] and req == shard + 1
        got[shard] = crc
    assert sorted(got) == list(range(24))
    for sock in (ctl, conn, data):
        sock.close()


def test_many_nodes_that_queue_fetches_make_the_source_read_at_most_four_budgets_ahead(
        sw, s3, s3_bucket, s3_proxy, tmp_path):
    """Each session's reads keep to the dataset's memory budget; six sessions held six
    budgets, so enough nodes that queue FETCHes and read slowly ran the source out of memory.
    Now all sessions together hold at most four budgets (SOURCE_READ_BUDGETS)."""
    d = tmp_path / "ds"
    write_uint8_shards(d, 24, 256 * 1024, seed=14)
    url = upload(s3, s3_bucket, d)
    # Budget: 2 x max_inflight x request_size = 1 MiB, four of these shards; four budgets: 16.
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", "--object-store-request-size", "256KiB",
                    "--object-store-max-inflight", "2", env=s3_proxy.env())
    src.admin = src.wait_line(ADMIN).group(1)
    nodes = []
    for _ in range(6):
        data = socket.create_server(("127.0.0.1", 0))
        data.settimeout(10)
        ctl, conn, _ = handshake_to_data_conn(host_port(src.addr), data)
        nodes.append((ctl, conn, data))
    s3_proxy.reset_log()
    # Each raw node queues FETCHes for four shards of its own and reads nothing yet.
    for k, (ctl, _, _) in enumerate(nodes):
        for shard in range(4 * k, 4 * k + 4):
            ctl.sendall(fetch(shard + 1, "ds", shard))

    def read_shards():
        return {e.path for e in gets(s3_proxy, s3_bucket)}

    wait_for(lambda: len(read_shards()) >= 12, "the first reads", 10)
    # The reads the budgets let start have ended; the rest wait (a read over them would have
    # started with them: every FETCH was queued at once).
    wait_for(lambda: reading_shards(src) == 0, "the reads within the budgets to end", 30)
    # Four budgets (16 shards), plus at most one shard for each session that holds no read
    # and waited STARVED_PATIENCE (1 s: two of the six here, on a machine slow enough that
    # the reads within the budgets took that long). Before, every shard was read (24).
    assert len(read_shards()) <= 16 + 2, sorted(read_shards())
    # Once payloads go out, the waiting reads start: every shard arrives, byte exact.
    want = [sh["crc32c"] for sh in load_manifest(d)["shards"]]
    for ctl, _, _ in nodes:
        ctl.sendall(control_frame(DATA_READY, struct.pack(">H", 0)))
    for k, (ctl, conn, _) in enumerate(nodes):
        conn.settimeout(30)
        ctl.settimeout(30)
        for _ in range(4):
            _, shard, crc, payload = next_payload(ctl, conn)
            assert crc32c.crc32c(payload) == crc == want[shard] and shard // 4 == k
    for node in nodes:
        for sock in node:
            sock.close()


def test_nodes_that_leave_with_reads_queued_give_the_sources_budget_back(sw, s3, s3_bucket, s3_proxy, tmp_path):
    """Reads started for FETCHes still queued when their session ends stayed counted in the
    source-wide budget for ever: a few nodes that left with full queues stopped every read of
    the source. Their bytes go back when the session ends."""
    d = tmp_path / "ds"
    write_uint8_shards(d, 24, 256 * 1024, seed=16)
    url = upload(s3, s3_bucket, d)
    src = sw.source({"ds": url}, "--object-store-request-size", "256KiB", "--object-store-max-inflight", "2",
                    env=s3_proxy.env())
    for k in range(6):
        data = socket.create_server(("127.0.0.1", 0))
        data.settimeout(10)
        ctl, conn, _ = handshake_to_data_conn(host_port(src.addr), data)
        for shard in range(4 * k, 4 * k + 4):
            ctl.sendall(fetch(shard + 1, "ds", shard))
        time.sleep(0.5)  # its reads start, and it leaves without reading a byte
        for sock in (ctl, conn, data):
            sock.close()
    data = socket.create_server(("127.0.0.1", 0))
    data.settimeout(10)
    ctl, conn, _ = handshake_to_data_conn(host_port(src.addr), data)
    ctl.sendall(fetch(1, "ds", 5) + control_frame(DATA_READY, struct.pack(">H", 0)))
    ctl.settimeout(20)
    kind, body = next_non_ping(ctl)
    assert kind == SHARD and struct.unpack(">Q", body[:8])[0] == 1, (kind, body[:60])
    for sock in (ctl, conn, data):
        sock.close()


def test_a_failed_read_is_answered_while_its_lane_has_no_room(sw, s3, s3_bucket, s3_proxy, tmp_path):
    """A FETCH whose read failed waited, unanswered, behind a read that had finished but had
    no data connection with room (here: the node has not said DataReady), until one had
    room. It is answered at once now; the finished one still waits for room."""
    import faults as F

    d = tmp_path / "ds"
    write_uint8_shards(d, 4, 64 * 1024, seed=15)
    url = upload(s3, s3_bucket, d)
    src = sw.source({"ds": url}, env=s3_proxy.env())
    data = socket.create_server(("127.0.0.1", 0))
    data.settimeout(10)
    ctl, conn, _ = handshake_to_data_conn(host_port(src.addr), data)
    s3_proxy.reset_log()
    s3_proxy.status(n=20, code=404, s3_code="NoSuchKey", key="/ds/s001.npy")
    ctl.sendall(fetch(1, "ds", 0))
    wait_for(lambda: any("s000" in e.path for e in gets(s3_proxy, s3_bucket)), "shard 0's read", 10)
    time.sleep(0.5)  # read and settled, waiting for room
    ctl.sendall(fetch(2, "ds", 1))
    ctl.settimeout(10)
    kind, body = next_non_ping(ctl)
    assert kind == F.ERROR, (kind, body[:200])
    req, _, message = F.error_code(body)
    assert req == 2, (req, message)
    # The node says its connection is ready: shard 0 goes out.
    ctl.sendall(control_frame(DATA_READY, struct.pack(">H", 0)))
    kind, body = next_non_ping(ctl)
    assert kind == SHARD and struct.unpack(">Q", body[:8])[0] == 1, (kind, body[:40])
    for sock in (ctl, conn, data):
        sock.close()


def test_reads_for_a_node_that_leaves_are_stopped(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 8, 256 * 1024, seed=13)
    url = upload(s3, s3_bucket, d)
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", "--object-store-request-size", "256KiB",
                    "--object-store-max-inflight", "2", env=s3_proxy.env())
    src.admin = src.wait_line(ADMIN).group(1)
    data = socket.create_server(("127.0.0.1", 0))
    data.settimeout(10)
    ctl, conn, _ = handshake_to_data_conn(host_port(src.addr), data)
    # Every GET stalls after 10 KB (30 s; object_store's read timeout is 10 s, then it retries).
    s3_proxy.stall(n=100, after=10_000, seconds=30, key="/ds/s")
    for shard in range(8):
        ctl.sendall(fetch(shard + 1, "ds", shard))

    def reading():
        return source_status(src)["datasets"][0]["object_store"]["reading_shards"]

    wait_for(lambda: reading() > 0, "the reads to start", 10)
    # The node leaves: its queued FETCHes' reads are stopped, not left to run their course.
    for sock in (ctl, conn, data):
        sock.close()
    # Well under the 30 s stall (reads left to run their course would take that long).
    wait_for(lambda: reading() == 0, "the reads to stop", 15)
    s3_proxy.clear()


def test_a_hinted_shard_the_store_refuses_is_not_read_again_and_again_ahead_of_its_fetch(sw, s3, s3_bucket, s3_proxy, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 30, 256 * 1024, seed=14)
    url = upload(s3, s3_bucket, d)
    # Budget 2 x 4 x 256 KiB = 2 MiB: the prefetch reads about 8 shards past what the node holds.
    src = sw.source({"ds": url}, "--admin", "127.0.0.1:0", "--object-store-request-size", "256KiB",
                    "--object-store-max-inflight", "4", env=s3_proxy.env())
    src.admin = src.wait_line(ADMIN).group(1)
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "2MiB")
    wait_ready(node)
    with shardwire.connect(node.socket).open_stream("ds", seed=3) as s:
        order = [b.shard for b in s]
    assert sorted(order) == list(range(30)), order
    # The shard 12th in the plan's order changes after the source pinned its ETag: every GET
    # of it is refused (412, If-Match).
    name = f"ds/s{order[12]:03d}.npy"
    s3.put(s3_bucket, name, b"\x93NUMPY" + b"x" * 1000)
    with shardwire.connect(node.socket).open_stream("ds", seed=3) as s:
        assert s.next(timeout=30) is not None
        # The trainer pauses: the node's hints name the shard ahead of its FETCH; the
        # prefetch tries it and is refused. It may try again later, not back to back (the
        # source once sent hundreds of GETs a second for it).
        def tries():
            return s3_proxy.requests("GET", f"/{name}", status=412)

        wait_for(tries, "the prefetch's first try of the changed shard", 30)
        time.sleep(5)  # retried after 1 and 3 s (the pause doubles), next after 7 s
        assert len(tries()) <= 5, len(tries())
    assert f"shard={order[12]}" in src.stderr_text()


def test_a_dataset_indexed_from_s3_is_served_and_an_object_changed_since_is_refused_at_start(sw, s3, s3_bucket, s3_proxy, tmp_path):
    import subprocess

    from conftest import child_env, require_bin

    d = tmp_path / "ds"
    write_uint8_shards(d, 5, 300_000, seed=10)
    s3.upload_dir(d, s3_bucket, "ds")
    url = f"s3://{s3_bucket}/ds"
    r = subprocess.run([str(require_bin()), "index", url], capture_output=True, text=True, timeout=120, env=child_env(s3.env()))
    assert r.returncode == 0, r.stderr[-2000:]
    index_dataset(d)  # the local index, for the expected bytes
    src, node, batches = run_epochs(sw, url, s3_proxy.env())
    assert_exactly_once(batches, 5)
    assert_byte_exact(batches, expected_crcs(d))
    assert "records no ETags" not in src.stderr_text()
    node.stop()
    src.stop()
    # The object changes after indexing: the source refuses the dataset at start, naming it.
    s3.put(s3_bucket, "ds/s003.npy", (d / "s003.npy").read_bytes()[:-1] + b"!")
    p = sw._start(Source, "source", ["source", "--listen", "127.0.0.1:0", "--dataset", f"ds={url}"], s3.env())
    assert p.wait(timeout=60) != 0
    text = p.stderr_text()
    assert "s003.npy" in text and "changed since it was indexed" in text, text[-2000:]
