"""End-to-end tests of the whole pipeline with real processes on 127.0.0.1:

    shardwire index DIR  ->  shardwire source (1..2)  ->  shardwire serve  ->  shardwire consume (1..3)

Datasets are written with real numpy (np.save) and pyarrow (IPC file and stream). Every
consumed tensor is checked byte-exact: the CRC-32C that `consume` computes over the bytes it
received equals the CRC-32C of the tensor's bytes in the dataset file. Fixtures and helpers
live in conftest.py; every child process is killed at teardown.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import struct
import time

import numpy as np
import pytest

from conftest import (
    MiB,
    arrow_batches,
    arrow_column_numpy,
    assert_byte_exact,
    assert_exactly_once,
    crc32c,
    expected_crcs,
    get_status,
    http_get,
    index_dataset,
    load_manifest,
    vm_rss,
    wait_for,
    wait_ready,
    write_arrow,
    write_npy_dataset,
    write_uint8_shards,
)


def test_crc32c_known_vector():
    assert crc32c(b"123456789") == 0xE3069283


def small_mixed_npy(d: pathlib.Path, shards: int, seed: int = 0) -> dict:
    """`shards` small .npy files of assorted dtypes and shapes (distinct random contents)."""
    rng = np.random.default_rng(seed)
    makers = [
        lambda i: rng.standard_normal((16 + i, 8)).astype(np.float32),
        lambda i: rng.integers(-(2**40), 2**40, 300 + 7 * i, dtype=np.int64),
        lambda i: rng.integers(0, 256, (3, 5 + i, 7), dtype=np.uint8),
        lambda i: rng.standard_normal(129 + i).astype(np.float16),
        lambda i: rng.integers(-(2**15), 2**15, (40 + i, 3), dtype=np.int16),
        lambda i: rng.standard_normal((9, 2 + i)).astype(np.float64),
    ]
    return write_npy_dataset(d, {f"t{i:02d}": makers[i % len(makers)](i) for i in range(shards)})


def orders(runs: list[list[dict]]) -> list[list[int]]:
    return [[b["shard"] for b in r] for r in runs]


def consume_ranks(sw, serve, dataset: str, world: int, seed: int) -> list[list[dict]]:
    """Runs `world` consumers (ranks 0..world-1) concurrently; returns their batches by rank."""
    cs = [sw.start_consume(serve, dataset, seed=seed, rank=r, world_size=world) for r in range(world)]
    return [c.result() for c in cs]


# --- a. two sources, three ranks, determinism ----------------------------------------------


def region_pages() -> str:
    """The page size this host gives host stream regions, by the kernel's shmem settings (the
    2 MiB size's own, unless it inherits the top-level one)."""
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage")
    mode = "unknown"
    for f in (thp / "hugepages-2048kB" / "shmem_enabled", thp / "shmem_enabled"):
        try:
            text = f.read_text()
        except OSError:
            continue
        mode = text[text.index("[") + 1 : text.index("]")]
        if mode != "inherit":
            break
    return "2 MiB" if mode in ("always", "within_size", "advise", "force") else "4 KiB"


def test_one_epoch_two_sources_three_ranks(sw, tmp_path):
    d = tmp_path / "ds"
    shards = 12
    small_mixed_npy(d, shards)
    m = index_dataset(d)
    assert len(m["shards"]) == shards
    expected = expected_crcs(d)

    a = sw.source({"mixed": d})
    b = sw.source({"mixed": d})
    node = sw.serve([a, b], "--stream-memory", "64MiB", "--pool-size", "256MiB")
    wait_ready(node, sources=2)

    world = 3
    run1 = consume_ranks(sw, node, "mixed", world, seed=7)
    for rank, batches in enumerate(run1):
        assert len(batches) == shards // world, f"rank {rank} got {len(batches)} batches: {orders(run1)}"
        assert [(x["epoch"], x["index"]) for x in batches] == [(0, i) for i in range(shards // world)]
    all_batches = [x for r in run1 for x in r]
    assert_exactly_once(all_batches, shards)
    assert_byte_exact(all_batches, expected)

    st = node.status()
    assert st["counters"]["crc_failures"] == 0
    assert f"host stream regions get {region_pages()} pages" in node.stderr_text(), "the node says which pages regions get"
    assert st["counters"]["batches_delivered"] >= shards
    for s in st["sources"]:
        assert s["up"], st["sources"]
        assert s["bytes_received"] > 0, f"source {s['addr']} delivered nothing: {st['sources']}"
    assert sum(s["bytes_received"] for s in st["sources"]) >= m["total_bytes"]

    # Same seed: the same order per rank. Another seed: a different one.
    run2 = consume_ranks(sw, node, "mixed", world, seed=7)
    assert orders(run2) == orders(run1), "same seed must give the same per-rank order"
    assert_byte_exact([x for r in run2 for x in r], expected)
    run3 = consume_ranks(sw, node, "mixed", world, seed=8)
    assert_exactly_once([x for r in run3 for x in r], shards)
    assert orders(run3) != orders(run1), "another seed must give another order"


# --- b. pyarrow (file and stream) and numpy round trips ------------------------------------


def _truth_by_shard(d: pathlib.Path, truth: dict) -> dict:
    """Maps manifest shard index -> {tensor name: ndarray} from truth[file][k] (k-th shard of file)."""
    m = load_manifest(d)
    seen: dict[str, int] = {}
    out = {}
    for i, s in enumerate(m["shards"]):
        k = seen.get(s["file"], 0)
        seen[s["file"]] = k + 1
        assert s["file"] in truth, f"unexpected file in manifest: {s['file']}"
        out[i] = truth[s["file"]][k]
    for f, parts in truth.items():
        assert seen.get(f) == len(parts), f"{f}: {seen.get(f)} shards in the manifest, expected {len(parts)}"
    return out


def _write_kind(d: pathlib.Path, kind: str) -> dict:
    """Writes the dataset for `kind`; returns {file: [ {tensor name: ndarray} per shard ]}."""
    if kind in ("arrow-file", "arrow-stream"):
        stream = kind == "arrow-stream"
        truth = {}
        for n, (rows, k) in enumerate([([5, 17, 1, 32], 3), ([64, 9], 16)]):
            name = f"part{n}.arrows" if stream else f"part{n}.arrow"
            batches = arrow_batches(rows, k=k, seed=n, id_start=1000 * n)
            write_arrow(d / name, batches, stream=stream)
            truth[name] = [{c: arrow_column_numpy(b, c) for c in ("id", "emb")} for b in batches]
        return truth
    rng = np.random.default_rng(5)
    arrays = {
        "f32": rng.standard_normal((33, 7)).astype(np.float32),
        "f64": rng.standard_normal(50),
        "f16": rng.standard_normal((4, 4, 4)).astype(np.float16),
        "i8": rng.integers(-128, 128, 99, dtype=np.int8),
        "i16": rng.integers(-(2**15), 2**15, (10, 3), dtype=np.int16),
        "i32": rng.integers(-(2**31), 2**31, 77, dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, (5, 2), dtype=np.int64),
        "u8": rng.integers(0, 256, (2, 3, 4, 5), dtype=np.uint8),
        "u16": rng.integers(0, 2**16, 31, dtype=np.uint16),
        "u32": rng.integers(0, 2**32, 12, dtype=np.uint32),
        "u64": rng.integers(0, 2**63, 6, dtype=np.uint64),
        "scalar": np.float64(2.5),
    }
    files = write_npy_dataset(d, arrays)
    return {f: [{f[: -len(".npy")]: np.asarray(a)}] for f, a in files.items()}


@pytest.mark.parametrize("kind", ["arrow-file", "arrow-stream", "npy"])
def test_round_trip_byte_exact(sw, tmp_path, kind):
    d = tmp_path / "ds"
    d.mkdir()
    truth = _write_kind(d, kind)
    m = index_dataset(d)
    by_shard = _truth_by_shard(d, truth)
    expected = expected_crcs(d)

    src = sw.source({"rt": d})
    node = sw.serve([src], "--stream-memory", "16MiB", "--pool-size", "64MiB")
    wait_ready(node)
    batches = sw.consume(node, "rt", seed=3)

    assert len(batches) == len(m["shards"])
    assert_exactly_once(batches, len(m["shards"]))
    assert_byte_exact(batches, expected)
    for b in batches:
        want = by_shard[b["shard"]]
        assert sorted(t["name"] for t in b["tensors"]) == sorted(want), b
        for t in b["tensors"]:
            a = np.asarray(want[t["name"]])  # tobytes() is C order; keeps 0-d shapes
            ctx = f"{kind} shard {b['shard']} tensor {t['name']}"
            assert t["dtype"] == a.dtype.name, ctx
            assert list(t["shape"]) == list(a.shape), ctx
            assert t["crc32c"] == crc32c(a.tobytes()), f"{ctx}: bytes differ from what numpy/pyarrow hold"
    st = node.status()
    assert st["counters"]["crc_failures"] == 0
    assert st["counters"]["shards_received"] >= len(m["shards"])


# --- c. a source killed mid-shard -----------------------------------------------------------


def test_source_killed_mid_shard(sw, tmp_path):
    d = tmp_path / "ds"
    shards = 16
    write_uint8_shards(d, shards, 2 * MiB, seed=1)
    m = index_dataset(d)
    expected = expected_crcs(d)

    slow = sw.source({"big": d}, "--rate-limit", "4MiB")
    fast = sw.source({"big": d})
    node = sw.serve([slow, fast], "--stream-memory", "64MiB", "--pool-size", "128MiB")
    wait_ready(node, sources=2)

    consumer = sw.start_consume(node, "big", seed=11)

    def slow_link():
        return next(s for s in node.status()["sources"] if s["addr"] == slow.addr)

    def slow_busy():
        # bytes_received counts verified shards; once the first ones are in, the next shard
        # on each of the slow source's data connections is partway through (4 MiB/s pacing).
        s = slow_link()
        return s if s["bytes_received"] > 0 else None

    busy = wait_for(slow_busy, "the rate-limited source to deliver its first shards", interval=0.02, diag=sw.logs_of_all)
    slow.kill(signal.SIGKILL)
    slow.wait()
    assert busy["bytes_received"] < m["total_bytes"] // 2, f"the slow source was already done: {busy}"

    batches = consumer.result(timeout=180)
    assert len(batches) == shards
    assert_exactly_once(batches, shards)
    assert_byte_exact(batches, expected)

    st = node.status()
    print(f"killed the slow source at {busy}; node counters after the epoch: {st['counters']}")
    assert st["counters"]["refetches"] >= 1, st["counters"]
    assert st["counters"]["crc_failures"] == 0, st["counters"]
    assert not slow_link()["up"]

    # The same seed without the failure (only the fast source is left): the plan order.
    again = sw.consume(node, "big", seed=11)
    assert [b["shard"] for b in batches] == [b["shard"] for b in again], "a refetch must not change the plan order"
    assert [b["index"] for b in batches] == list(range(shards))
    assert_byte_exact(again, expected)


# --- d. corrupted payloads ------------------------------------------------------------------


def test_corrupted_payloads_are_refetched(sw, tmp_path):
    d = tmp_path / "ds"
    shards = 8
    write_uint8_shards(d, shards, 64 * 1024, seed=2)
    small_mixed_npy(d, 4, seed=9)  # adds t00..t03 (non-uint8 tensors)
    m = index_dataset(d)
    expected = expected_crcs(d)
    n = len(m["shards"])

    src = sw.source({"c": d}, "--fault-corrupt", "3")
    node = sw.serve([src], "--stream-memory", "16MiB", "--pool-size", "64MiB")
    wait_ready(node)
    batches = sw.consume(node, "c", seed=4)
    assert len(batches) == n
    assert_exactly_once(batches, n)
    assert_byte_exact(batches, expected)

    st = node.status()
    crc = st["counters"]["crc_failures"]
    # The first 3 FETCHes are corrupted. Where two of them follow each other on one data
    # connection, the node takes two mismatches of different shards in a row for a lost
    # framing and drops the connection: the third corrupted payload then never arrives whole
    # to be checked (it is fetched again all the same).
    framing = "lost its framing" in node.stderr_text()
    assert crc == 3 or (crc == 2 and framing), (st["counters"], framing)
    assert st["counters"]["refetches"] >= 3, st["counters"]
    assert src.stderr_text().count("fault injection") == 3, src.stderr_text()[-3000:]

    # A second epoch on the same node is clean.
    batches = sw.consume(node, "c", seed=5)
    assert_exactly_once(batches, n)
    assert_byte_exact(batches, expected)
    assert node.status()["counters"]["crc_failures"] == crc


def test_a_shard_whose_stored_bytes_differ_from_the_manifest_closes_the_stream_naming_it(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 4, 64 * 1024, seed=6)
    m = index_dataset(d)
    # One byte of shard 2's file changes after indexing (same size): a copy the source sends
    # fails the node's CRC check. The node fetched it again forever before, and the trainer
    # waited without a word; then the stream closed after 5 CRC failures; now the node's report
    # makes the source check the file, and it refuses the shard (ReadFailed: a node would
    # fetch it from another source) naming the file and both CRCs, and with this source
    # alone the stream closes after a few refusals, naming it.
    f = d / m["shards"][2]["file"]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01
    f.write_bytes(raw)
    src = sw.source({"c": d})
    node = sw.serve([src], "--stream-memory", "16MiB", "--pool-size", "64MiB")
    wait_ready(node)
    c = sw.start_consume(node, "c", seed=4)
    assert c.wait(timeout=60) != 0
    text = c.describe()
    for says in ["shard 2 of dataset c", "ReadFailed", f"shard file {f.name}", "fail the manifest's CRC-32C"]:
        assert says in text, (says, text[-3000:])
    assert 1 <= node.status()["counters"]["crc_failures"] < 5


def test_a_source_with_more_files_than_the_soft_open_file_limit_starts(tmp_path):
    import resource
    import subprocess

    from conftest import child_env, die_with_parent, require_bin

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1024: no room above a soft limit of 64")
    d = tmp_path / "many"
    write_npy_dataset(d, {f"f{i:03d}": np.full(16, i % 256, np.uint8) for i in range(300)})
    index_dataset(d)
    # The source keeps every file open: under a soft limit of 64 it stopped at start with
    # "Too many open files"; it now raises its soft limit to the hard one.
    p = subprocess.Popen(
        [str(require_bin()), "source", "--listen", "127.0.0.1:0", "--dataset", f"many={d}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        preexec_fn=lambda: (die_with_parent(), resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))),
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("source listening on"), (line, p.stderr.read() if p.poll() is not None else "")
    finally:
        p.kill()
        p.communicate(timeout=10)


# --- e. a trainer that stops reading: memory stays bounded ----------------------------------


def test_stalled_trainer_memory_is_bounded(sw, tmp_path):
    d = tmp_path / "ds"
    shards, size = 50, 4 * MiB
    write_uint8_shards(d, shards, size, seed=3)
    m = index_dataset(d)
    assert m["total_bytes"] == shards * size
    expected = expected_crcs(d)

    src = sw.source({"huge": d})
    node = sw.serve([src], "--stream-memory", "32MiB", "--pool-size", "32MiB")
    wait_ready(node)
    time.sleep(0.5)
    baseline = vm_rss(node.pid)
    limit = baseline + 32 * MiB + 24 * MiB

    # 10 s outlasts the sampling (5.5 s, plus one sample's read of /proc and /v1/status and its
    # 0.5 s sleep) with room for a busy machine; `consumer.alive()` below fails the test if not.
    consumer = sw.start_consume(node, "huge", seed=1, limit=1, hold_secs=10)
    consumer.wait_line(re.compile(r"^\{"))
    t0 = time.monotonic()
    samples = []
    while time.monotonic() - t0 < 5.5:
        rss = vm_rss(node.pid)
        st = node.status()
        samples.append((rss, st))
        time.sleep(0.5)
    assert consumer.alive(), "consume should still be holding its batch"
    batches = consumer.result()
    assert len(batches) == 1
    assert_byte_exact(batches, expected)

    max_rss = max(r for r, _ in samples)
    print(f"serve RSS baseline {baseline / MiB:.1f} MiB, max during the hold {max_rss / MiB:.1f} MiB")
    report = [(round(r / MiB, 1), s["counters"]["bytes_received"] // MiB) for r, s in samples]
    assert max_rss < limit, (
        f"serve RSS {max_rss / MiB:.1f} MiB exceeds baseline {baseline / MiB:.1f} MiB + 32 MiB region + 24 MiB slack; "
        f"samples (RSS MiB, received MiB): {report}"
    )
    for _, st in samples:
        streams = st["streams"]
        assert len(streams) == 1, streams
        s = streams[0]
        assert s["region_bytes"] <= 32 * MiB, s
        assert s["region_used"] <= s["region_bytes"], s
        assert st["counters"]["bytes_received"] < m["total_bytes"], f"the whole dataset was received: {st['counters']}"
    last = samples[-1][1]
    assert last["counters"]["bytes_received"] <= 32 * MiB + size, f"received more than the stream can hold: {last['counters']}"
    assert last["streams"][0]["delivered"] == 1


# --- f. malformed control messages and wrong secrets ----------------------------------------


def _host_port(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _closed_by_peer(sock: socket.socket, timeout: float) -> str:
    """Reads until the peer closes: 'eof' or 'reset'; raises on timeout."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sock.recv(65536) == b"":
                return "eof"
    except ConnectionResetError:
        return "reset"
    except socket.timeout:
        pass
    raise AssertionError(f"peer did not close the connection within {timeout}s")


def _send_raw(addr: str, payload: bytes, timeout: float = 5.0) -> str:
    with socket.create_connection(_host_port(addr), timeout=10) as s:
        s.sendall(payload)
        return _closed_by_peer(s, timeout)


def _frame(version: int, kind: int, body: bytes = b"") -> bytes:
    return struct.pack(">IBB", 2 + len(body), version, kind) + body


MALFORMED = {
    "garbage": b"GET / HTTP/1.1\r\nHost: shardwire\r\n\r\n" + bytes(range(256)),
    "bad version": _frame(9, 1, b"\x00" * 40),
    "length 0xFFFFFFFF": b"\xff\xff\xff\xff" + b"\x01\x01" + b"\x00" * 64,
    "unknown kind": _frame(2, 99, b"\x00\x01\x02\x03"),
    "truncated hello": _frame(2, 1, b"\x00\x05gpu"),
    "zero length": b"\x00\x00\x00\x00",
}


def test_malformed_messages_and_wrong_secrets(sw, tmp_path):
    d = tmp_path / "ds"
    shards = 24
    write_uint8_shards(d, shards, 256 * 1024, seed=4)
    index_dataset(d)
    expected = expected_crcs(d)
    good, bad = tmp_path / "good.secret", tmp_path / "bad.secret"
    good.write_text("correct horse battery staple\n")
    bad.write_text("not the right secret\n")
    os.chmod(good, 0o600)
    os.chmod(bad, 0o600)

    # ~6 s of streaming at 1 MiB/s, so the attacks happen while the healthy node streams.
    src = sw.source({"f": d}, "--secret-file", good, "--rate-limit", "1MiB")
    node = sw.serve([src], "--secret-file", good, "--stream-memory", "16MiB", "--pool-size", "64MiB")
    st = wait_ready(node)
    data_addr = st["data_addr"]
    consumer = sw.start_consume(node, "f", seed=21)
    wait_for(lambda: node.status()["streams"], "the healthy stream to open", diag=sw.logs_of_all)

    # (4) A stranger on the node's data port: its bytes go nowhere, and it is dropped.
    stranger = socket.create_connection(_host_port(data_addr), timeout=10)
    stranger_opened = time.monotonic()
    stranger.sendall(os.urandom(64 * 1024))

    # (1) Malformed frames on the source's control port: each connection is closed promptly
    # (well before the source's 10 s handshake timeout).
    outcomes = {}
    for what, payload in MALFORMED.items():
        try:
            outcomes[what] = _send_raw(src.addr, payload, timeout=5.0)
        except AssertionError as e:
            outcomes[what] = f"NOT CLOSED: {e}"
    assert all(v in ("eof", "reset") for v in outcomes.values()), f"source kept malformed connections open: {outcomes}"

    # (3) A garbage frame on the trainer socket: an error reply and/or a closed connection.
    for payload in (struct.pack("<I", 9) + b"not json!", b"\xff\xff\xff\xff" + b"{}", struct.pack("<I", 13) + b'{"op":"nope"}'):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as t:
            t.settimeout(10)
            t.connect(node.socket)
            t.sendall(payload)
            hdr = b""
            try:
                while len(hdr) < 4:
                    chunk = t.recv(4 - len(hdr))
                    if not chunk:
                        break
                    hdr += chunk
            except ConnectionResetError:
                hdr = b""
            if len(hdr) == 4:
                (n,) = struct.unpack("<I", hdr)
                assert n <= 1 << 20, f"absurd reply length {n}"
                body = b""
                while len(body) < n:
                    chunk = t.recv(n - len(body))
                    assert chunk, "reply cut short"
                    body += chunk
                reply = json.loads(body)
                assert reply.get("op") == "error", f"garbage on the trainer socket got {reply}"
                assert reply.get("code"), reply
            _closed_by_peer(t, 5.0)

    # (2) A node with the wrong secret: refused, not ready, and it says why.
    bad_node = sw.serve([src], "--secret-file", bad)

    def bad_reason():
        s = get_status(bad_node.admin)["sources"][0]
        return s if s["last_error"] else None

    s = wait_for(bad_reason, "the wrong-secret node to record why the source refused it", diag=sw.logs_of_all)
    assert not s["up"], s
    assert re.search(r"(?i)auth|secret", s["last_error"]), s
    code, body = http_get(bad_node.admin, "/readyz")
    assert code == 503, (code, body)
    time.sleep(1.0)
    assert not get_status(bad_node.admin)["sources"][0]["up"]
    assert http_get(bad_node.admin, "/readyz")[0] == 503

    # Throughout: the healthy node's epoch completes byte-exact.
    batches = consumer.result(timeout=180)
    assert_exactly_once(batches, shards)
    assert_byte_exact(batches, expected)
    assert node.status()["counters"]["crc_failures"] == 0
    assert wait_ready(node)["sources"][0]["up"]

    # The source says why it dropped the malformed connections and the wrong-secret node.
    log = src.stderr_text()
    assert "dropped node connection" in log, log[-4000:]
    assert "malformed" in log, log[-4000:]
    assert re.search(r"(?i)authentication failed|wrong secret", log), log[-4000:]

    # And the healthy node still serves a full, byte-exact epoch afterwards.
    batches = sw.consume(node, "f", seed=22)
    assert_exactly_once(batches, shards)
    assert_byte_exact(batches, expected)
    st = node.status()
    assert st["counters"]["crc_failures"] == 0
    assert st["sources"][0]["up"]

    # Last (it may wait): the stranger on the data port is dropped. The matcher drops data
    # connections that no authenticated source announced within 10 s (UNMATCHED_TIMEOUT).
    left = max(1.0, 30.0 - (time.monotonic() - stranger_opened))
    try:
        _closed_by_peer(stranger, left)
    except AssertionError:
        pytest.fail(
            f"a connection to the node's data port {data_addr} that no source announced, which sent 64 KiB, "
            f"was still open {time.monotonic() - stranger_opened:.0f} s later (expected: dropped after the "
            "matcher's 10 s UNMATCHED_TIMEOUT)"
        )
    finally:
        stranger.close()
