"""End-to-end tests of the trainer HTTP API (docs/TRAINER_API.md, "HTTP API") through the Python
SDK's HTTP transport (``shardwire.connect_http`` / ``connect(url=...)``), against real
``shardwire source`` / ``serve`` processes on 127.0.0.1:

- values of every tensor equal numpy / pyarrow's reading of the dataset files; arrays are
  private writable copies; leases end as soon as a batch arrived;
- the plan order is the socket's; resume states move between the two transports;
- errors (unknown dataset, state mismatch, bad arguments, bad URLs, unreachable node), the
  timeout of ``next`` while the source stalls, close and the idle timeout;
- the raw API: status codes and error bodies, unknown fields, the body limit, isolation from
  socket streams.

Self-contained like test_sdk.py: the SDK comes from client/python/src (put first on sys.path),
children are started by the small ``Procs`` registry below and killed at teardown.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SDK_SRC = REPO / "client" / "python" / "src"
sys.path.insert(0, str(SDK_SRC))

import shardwire  # noqa: E402

WAIT = 60.0
SOURCE_READY = re.compile(r"source listening on (\S+)")
SERVE_READY = re.compile(r"node service ready: socket (\S+) admin http://(\S+)")
SERVE_OPTS = ("--pool-size", "1GiB", "--stream-memory", "16MiB")
SHARDS = 10


# --- processes -------------------------------------------------------------------------------


def shardwire_bin() -> pathlib.Path:
    b = pathlib.Path(os.environ.get("SHARDWIRE_BIN", REPO / "target" / "debug" / "shardwire"))
    if not (b.is_file() and os.access(b, os.X_OK)):
        pytest.fail(f"shardwire binary not found at {b}; run `cargo build -p shardwire` or set SHARDWIRE_BIN")
    return b


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}
    env.update(RUST_LOG="info", NO_COLOR="1", RUST_BACKTRACE="1")
    return env


class Proc:
    """A child whose stdout lines are collected by a thread; stderr goes to a log file."""

    def __init__(self, name: str, args: list[Any], log_dir: pathlib.Path) -> None:
        self.name = name
        self.args = [str(a) for a in args]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = log_dir / f"{name}.stderr.log"
        self._err = open(self.stderr_path, "wb")
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self.popen = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._err,
            env=child_env(), text=True, bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def describe(self) -> str:
        self._err.flush()
        err = self.stderr_path.read_text(errors="replace")[-4000:] if self.stderr_path.exists() else ""
        rc = self.popen.poll()
        return f"[{self.name}] {'exited ' + str(rc) if rc is not None else 'running'}: {' '.join(self.args)}\n  stdout: {self.lines[-20:]}\n  stderr:\n{err}"

    def wait_line(self, pattern: re.Pattern[str], timeout: float = WAIT) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no stdout line matching {pattern.pattern!r} within {timeout}s\n{self.describe()}")
            try:
                line = self._q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self.popen.wait(timeout=5)
                raise AssertionError(f"process ended before printing {pattern.pattern!r}\n{self.describe()}")
            m = pattern.search(line)
            if m:
                return m

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 5 s; always reaps."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=WAIT)
        self._reader.join(timeout=5)
        self._err.close()


@dataclass
class Serve:
    proc: Proc
    socket: str
    admin: str


class Procs:
    """Starts children and kills every one of them at `close`."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def start(self, kind: str, args: list[Any]) -> Proc:
        p = Proc(f"{len(self.procs):02d}-{kind}", args, self.tmp / "logs")
        self.procs.append(p)
        return p

    def source(self, datasets: dict[str, pathlib.Path], *extra: str) -> str:
        args: list[Any] = [shardwire_bin(), "source", "--listen", "127.0.0.1:0"]
        for name, d in datasets.items():
            args += ["--dataset", f"{name}={d}"]
        return self.start("source", args + list(extra)).wait_line(SOURCE_READY).group(1)

    def serve(self, source: str, socket: pathlib.Path, *extra: str) -> Serve:
        p = self.start("serve", [
            shardwire_bin(), "serve", "--source", source, "--socket", socket,
            "--data-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", *SERVE_OPTS, *extra,
        ])
        m = p.wait_line(SERVE_READY)
        s = Serve(p, m.group(1), m.group(2))
        wait_for(lambda: http(s.admin, "GET", "/readyz")[0] == 200, f"{p.name} /readyz 200", diag=p.describe)
        return s

    def close(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception:  # noqa: BLE001 - teardown must reach every child
                p.popen.kill()


def http(admin: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, lower-case headers) of one request; HTTP errors are returned."""
    req = urllib.request.Request(f"http://{admin}{path}", data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}
    except OSError as e:
        return 0, str(e).encode(), {}


def http_json(admin: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    st, b, _ = http(admin, method, path, None if body is None else json.dumps(body).encode())
    return st, (json.loads(b) if b else None)


def wait_for(pred: Callable[[], Any], what: str, timeout: float = WAIT, diag: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{diag()}" if diag else ""))
        time.sleep(0.05)


def listed(admin: str, stream_id: int) -> dict[str, Any] | None:
    st, v = http_json(admin, "GET", "/v1/streams")
    assert st == 200, v
    return next((s for s in v["streams"] if s["id"] == stream_id), None)


# --- datasets --------------------------------------------------------------------------------


def index(d: pathlib.Path) -> dict[str, Any]:
    r = subprocess.run([shardwire_bin(), "index", str(d)], capture_output=True, text=True, timeout=300, env=child_env())
    assert r.returncode == 0, f"shardwire index {d}: {r.stdout}\n{r.stderr}"
    return json.loads((d / "shardwire.manifest.json").read_text())


def write_mix(d: pathlib.Path) -> None:
    """10 shards: six .npy files of assorted dtypes/shapes and one Arrow IPC file (4 batches)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(7)
    np.save(d / "a_f32.npy", rng.standard_normal((17, 8)).astype(np.float32))
    np.save(d / "b_i64.npy", rng.integers(-(2**40), 2**40, 301, dtype=np.int64))
    np.save(d / "c_u8.npy", rng.integers(0, 256, (3, 5, 7), dtype=np.uint8))
    np.save(d / "d_f16.npy", rng.standard_normal(129).astype(np.float16))
    np.save(d / "e_i16.npy", rng.integers(-(2**15), 2**15, (40, 3), dtype=np.int16))
    np.save(d / "f_f64.npy", rng.standard_normal((9, 2)))
    batches = []
    for n in (3, 11, 1, 20):
        ids = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
        emb = rng.standard_normal((n, 4)).astype(np.float32)
        batches.append(pa.RecordBatch.from_arrays(
            [pa.array(ids, pa.int64()), pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1), pa.float32()), 4)],
            names=["id", "emb"],
        ))
    with pa.ipc.new_file(str(d / "g_table.arrow"), batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)


def expected_tensors(d: pathlib.Path, manifest: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """Per shard (manifest order): tensor name -> the array as numpy / pyarrow read it."""
    out: list[dict[str, np.ndarray]] = []
    batch_no: Counter[str] = Counter()
    for s in manifest["shards"]:
        f = d / s["file"]
        if f.suffix == ".npy":
            out.append({f.stem: np.load(f)})
        else:
            rb = pa.ipc.open_file(str(f)).get_batch(batch_no[s["file"]])
            batch_no[s["file"]] += 1
            cols = {}
            for name in rb.schema.names:
                col = rb.column(name)
                if pa.types.is_fixed_size_list(col.type):
                    cols[name] = col.flatten().to_numpy().reshape(len(col), col.type.list_size)
                else:
                    cols[name] = col.to_numpy()
            out.append(cols)
    return out


def assert_batch_matches(b: Any, expected: list[dict[str, np.ndarray]]) -> None:
    exp = expected[b.shard]
    assert sorted(b) == sorted(exp), f"shard {b.shard}: tensors {sorted(b)} != {sorted(exp)}"
    for name, want in exp.items():
        got = b[name]
        assert got.dtype == want.dtype and got.shape == want.shape, f"shard {b.shard} {name}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        assert np.array_equal(got, want), f"shard {b.shard} {name}: values differ"


@dataclass
class World:
    procs: Procs
    tmp: pathlib.Path
    serve: Serve
    expected: list[dict[str, np.ndarray]] = field(default_factory=list)

    def http(self) -> shardwire.HttpClient:
        return shardwire.connect_http(self.serve.admin)

    def sock(self) -> shardwire.Client:
        return shardwire.connect(self.serve.socket)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("http")
    procs = Procs(tmp)
    try:
        mix = tmp / "mix"
        write_mix(mix)
        manifest = index(mix)
        assert len(manifest["shards"]) == SHARDS
        src = procs.source({"mix": mix})
        serve = procs.serve(src, tmp / "sw.sock")
        yield World(procs, tmp, serve, expected_tensors(mix, manifest))
    finally:
        procs.close()


@pytest.fixture
def procs(tmp_path: pathlib.Path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def sequence(stream: Any) -> list[tuple[int, int, int]]:
    return [(b.epoch, b.index, b.shard) for b in stream]


# --- SDK over HTTP ---------------------------------------------------------------------------


def test_values_are_downloaded_copies_in_the_socket_order(world: World):
    with world.sock().open_stream("mix", seed=11, epochs=2) as s:
        want = sequence(s)
    with world.http().open_stream("mix", seed=11, epochs=2) as s:
        assert isinstance(s, shardwire.HttpStream)
        assert s.info.batches_per_epoch == SHARDS and s.info.epochs == 2
        assert s.info.memory == "http" and s.info.region_size == 0 and s.idle_timeout == 300
        got = []
        for b in s:
            assert isinstance(b, shardwire.HttpBatch)
            assert_batch_matches(b, world.expected)
            for name, arr in b.items():
                base: Any = arr
                while isinstance(base, np.ndarray):
                    base = base.base
                if isinstance(base, memoryview):
                    base = base.obj
                assert isinstance(base, bytearray), type(base)  # the downloaded copy
                assert arr.flags.writeable
                arr[(0,) * arr.ndim] = arr[(0,) * arr.ndim]  # writable: it is ours
            assert {v.name for v in b.views} == set(b) and all(v.offset == -1 for v in b.views)
            assert b.released and b.keep() is b and b.kept
            b.release()  # accepted, nothing to do
            # the lease ended on arrival: nothing of this stream is leased on the service
            assert listed(world.serve.admin, s.info.stream)["leased"] == 0
            got.append((b.epoch, b.index, b.shard))
        assert got == want, "HTTP and the socket deliver the same plan"
        assert s.next() is None


def test_resume_states_cross_transports(world: World):
    with world.http().open_stream("mix", seed=2, epochs=2) as s:
        want = sequence(s)
    with world.http().open_stream("mix", seed=2, epochs=2) as s:
        first = [(b.epoch, b.index, b.shard) for _, b in zip(range(7), s)]
        st = s.state_dict()
    assert (st["epoch"], st["index"]) == (0, 7)
    with world.sock().open_stream("mix", seed=2, epochs=2, state=st) as s:  # HTTP -> socket
        middle = [(b.epoch, b.index, b.shard) for _, b in zip(range(6), s)]
        st2 = s.state_dict()
    with world.http().open_stream("mix", seed=2, epochs=2, state=st2) as s:  # socket -> HTTP
        assert s.info.state == st2
        rest = sequence(s)
    assert first + middle + rest == want


def test_connect_forms_and_connect_errors(world: World, tmp_path: pathlib.Path):
    a = world.serve.admin
    for c in (shardwire.connect(url=f"http://{a}"), shardwire.connect(f"http://{a}/"), shardwire.connect_http(a)):
        assert isinstance(c, shardwire.HttpClient) and c.url == f"http://{a}"
    with pytest.raises(ValueError):
        shardwire.connect_http("https://127.0.0.1:1")
    with pytest.raises(ValueError):
        shardwire.connect_http("127.0.0.1")  # no port
    with pytest.raises(ValueError):
        shardwire.connect(str(tmp_path / "x.sock"), url=f"http://{a}")
    import socket as _socket

    with _socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(shardwire.ConnectError) as ei:
        shardwire.connect_http(f"127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in str(ei.value)


def test_service_errors_and_argument_errors(world: World):
    c = world.http()
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("no-such-dataset")
    assert ei.value.code == "unknown_dataset" and "no-such-dataset" in ei.value.message
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("mix", rank=3, world_size=3)
    assert ei.value.code == "bad_plan"
    with c.open_stream("mix", seed=1) as s:
        st = s.state_dict()
    with pytest.raises(shardwire.ServiceError) as ei:
        c.open_stream("mix", seed=1, world_size=2, state=st)
    assert ei.value.code == "state_mismatch" and "world_size" in ei.value.message
    with pytest.raises(ValueError):
        c.open_stream("mix", uneven="spread")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.open_stream("mix", idle_timeout=0)


def test_close_and_idle_timeout(world: World):
    c = world.http()
    s = c.open_stream("mix", seed=4)
    sid = s.info.stream
    assert listed(world.serve.admin, sid) is not None
    assert s.next() is not None
    s.close()
    s.close()  # idempotent
    assert s.closed
    with pytest.raises(shardwire.ShardwireError) as ei:
        s.next()
    assert ei.value.code == "closed"
    wait_for(lambda: listed(world.serve.admin, sid) is None, f"stream {sid} gone after close")

    s = c.open_stream("mix", seed=4, idle_timeout=1)
    assert s.idle_timeout == 1
    sid = s.info.stream
    time.sleep(2.5)
    with pytest.raises(shardwire.ServiceError) as ei:
        s.next()
    assert ei.value.code == "not_found", repr(ei.value)
    wait_for(lambda: listed(world.serve.admin, sid) is None, f"idle stream {sid} gone")
    s.close()  # the service already closed it: still fine


def test_next_times_out_when_the_source_stalls(procs: Procs, tmp_path: pathlib.Path):
    big = tmp_path / "big"
    big.mkdir()
    for i in range(2):
        np.save(big / f"s{i}.npy", np.full(3 << 20, i, dtype=np.uint8))  # 3 MiB shards
    index(big)
    src = procs.source({"big": big}, "--rate-limit", "64KiB")  # ~48 s per shard
    serve = procs.serve(src, tmp_path / "stall.sock")
    with shardwire.connect_http(serve.admin).open_stream("big") as s:
        t0 = time.monotonic()
        with pytest.raises(shardwire.Timeout) as ei:
            s.next(timeout=0.5)
        assert ei.value.code == "timeout" and 0.4 <= time.monotonic() - t0 < 30
        with pytest.raises(shardwire.Timeout):
            s.next(timeout=0.2)  # the stream stays usable
        assert s.state_dict()["index"] == 0
        # the raw API answers 204 No Content on a timeout
        st, body, _ = http(serve.admin, "POST", f"/v1/streams/{s.info.stream}/next?timeout_ms=0", b"")
        assert (st, body) == (204, b"")


# --- the raw API -----------------------------------------------------------------------------


def test_raw_api_codes_headers_and_limits(world: World):
    a = world.serve.admin
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "sede": 1})
    assert st == 400 and v["code"] == "bad_request" and "sede" in v["message"], v
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "uneven": "spread"})
    assert st == 400 and v["code"] == "bad_request" and "spread" in v["message"], v
    st, body, _ = http(a, "POST", "/v1/streams", b"{" + b" " * (70 << 10) + b"}")
    assert st == 413 and json.loads(body)["code"] == "bad_request", body
    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "nope"})
    assert (st, v["code"]) == (404, "unknown_dataset")

    st, v = http_json(a, "POST", "/v1/streams", {"dataset": "mix", "seed": 9})
    assert st == 201 and set(v) == {"stream", "batches_per_epoch", "epochs", "state", "idle_timeout_s"}, v
    sid = v["stream"]
    st, b = http_json(a, "POST", f"/v1/streams/{sid}/next?timeout_ms=10000")
    assert st == 200 and set(b) == {"lease", "epoch", "index", "shard", "tensors"}, b
    exp = world.expected[b["shard"]]
    for t in b["tensors"]:
        st, data, h = http(a, "GET", f"/v1/leases/{b['lease']}/tensors/{t['name']}")
        assert st == 200 and h["content-type"] == "application/octet-stream"
        want = exp[t["name"]]
        assert h["x-shardwire-dtype"] == str(want.dtype) == t["dtype"]
        assert h["x-shardwire-shape"] == ",".join(map(str, want.shape))
        assert int(h["content-length"]) == len(data) == want.nbytes == t["length"]
        assert np.array_equal(np.frombuffer(data, want.dtype).reshape(want.shape), want)
    st, v = http_json(a, "GET", f"/v1/leases/{b['lease']}/tensors/nope")
    assert (st, v["code"]) == (404, "not_found") and "nope" in v["message"]
    assert listed(a, sid)["leased"] == 1
    st, v = http_json(a, "POST", f"/v1/leases/{b['lease']}/release")
    assert (st, v) == (200, {"released": True})
    assert listed(a, sid)["leased"] == 0
    st, v = http_json(a, "POST", f"/v1/leases/{b['lease']}/release")
    assert (st, v["code"]) == (404, "unknown_lease")
    st, v = http_json(a, "GET", f"/v1/streams/{sid}/state")
    assert st == 200 and (v["epoch"], v["index"], v["seed"]) == (0, 1, 9)

    # Socket streams and their leases are not reachable over HTTP.
    with world.sock().open_stream("mix") as s:
        sb = s.next()
        assert sb is not None
        st, v = http_json(a, "POST", f"/v1/streams/{s.info.stream}/next?timeout_ms=0")
        assert (st, v["code"]) == (404, "not_found")
        st, v = http_json(a, "GET", f"/v1/leases/{sb.lease}/tensors/{next(iter(sb))}")
        assert (st, v["code"]) == (404, "unknown_lease")
        st, v = http_json(a, "POST", f"/v1/leases/{sb.lease}/release")
        assert (st, v["code"]) == (404, "unknown_lease")
        assert not sb.released and listed(a, s.info.stream)["leased"] == 1

    st, v = http_json(a, "POST", f"/v1/streams/{sid}/close")
    assert (st, v) == (200, {"stream": sid, "closed": True})
    st, v = http_json(a, "POST", f"/v1/streams/{sid}/next")
    assert (st, v["code"]) == (404, "not_found")
    wait_for(lambda: listed(a, sid) is None, f"stream {sid} gone after close")
