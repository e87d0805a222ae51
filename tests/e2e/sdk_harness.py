"""Shared harness of the SDK end-to-end tests (test_sdk.py, test_http.py, test_arrow.py,
test_frameworks.py): the SDK from client/python/src first on sys.path, real `shardwire source` /
`serve` children (killed at teardown), a module-wide dataset written with numpy and pyarrow,
and the helpers to compare what arrives with what the files hold.

The children are conftest's :class:`conftest.Proc` (as are the binary, the children's
environment, the waits and the teardown of :class:`conftest.Children`); this module adds the
small :class:`Procs` registry the SDK tests use, which starts a source and a serve with the SDK
tests' options."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from conftest import REPO, SERVE_READY, SOURCE_READY, WAIT, Children, Proc, child_env, require_bin, wait_for

SDK_SRC = REPO / "client" / "python" / "src"
sys.path.insert(0, str(SDK_SRC))

import shardwire  # noqa: E402

SERVE_OPTS = ("--pool-size", "1GiB", "--stream-memory", "16MiB")
SHARDS = 10


# --- processes -------------------------------------------------------------------------------


def sdk_on_path() -> dict[str, str]:
    """The environment entry that makes the SDK importable from the source tree in a Python
    child (client/python/src first on PYTHONPATH); for :func:`child_env` or a :class:`Proc`."""
    return {"PYTHONPATH": os.pathsep.join([str(SDK_SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}


@dataclass
class Serve:
    proc: Proc
    socket: str
    admin: str


class Procs(Children):
    """Starts children and kills every one of them at `close`."""

    def __init__(self, tmp: pathlib.Path) -> None:
        super().__init__()
        self.tmp = tmp

    def start(self, kind: str, args: list[Any], env: dict[str, str] | None = None) -> Proc:
        """A :class:`Proc` of `args` (`env`: extra environment variables for it)."""
        p = Proc(f"{len(self.procs):02d}-{kind}", args, self.tmp / "logs", env)
        self.procs.append(p)
        return p

    def source(self, datasets: dict[str, pathlib.Path], *extra: str) -> str:
        """`shardwire source --listen 127.0.0.1:0 --dataset N=DIR ...`; returns its address."""
        args: list[Any] = [require_bin(), "source", "--listen", "127.0.0.1:0"]
        for name, d in datasets.items():
            args += ["--dataset", f"{name}={d}"]
        return self.start("source", args + list(extra)).wait_line(SOURCE_READY).group(1)

    def serve(self, source: str, socket: pathlib.Path, *extra: str, opts: tuple[str, ...] = SERVE_OPTS) -> Serve:
        """`shardwire serve` on ephemeral loopback ports (with `opts`, the pool and stream
        memory by default, then `extra`); waits for the ready line and /readyz."""
        p = self.start("serve", [
            require_bin(), "serve", "--source", source, "--socket", socket,
            "--data-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", *opts, *extra,
        ])
        m = p.wait_line(SERVE_READY)
        s = Serve(p, m.group(1), m.group(2))
        wait_for(lambda: http(s.admin, "GET", "/readyz")[0] == 200, f"{p.name} /readyz 200", diag=p.describe)
        return s

    def python(self, code: str, *args: Any) -> Proc:
        """`python -c CODE ARGS...` with the SDK importable."""
        return self.start("python", [sys.executable, "-c", code, *args], sdk_on_path())

    describe = Children.logs_of_all


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


def listed(admin: str, stream_id: int) -> dict[str, Any] | None:
    st, v = http_json(admin, "GET", "/v1/streams")
    assert st == 200, v
    return next((s for s in v["streams"] if s["id"] == stream_id), None)


# --- datasets --------------------------------------------------------------------------------


def index(d: pathlib.Path) -> dict[str, Any]:
    r = subprocess.run([require_bin(), "index", str(d)], capture_output=True, text=True, timeout=300, env=child_env())
    assert r.returncode == 0, f"shardwire index {d}: {r.stdout}\n{r.stderr}"
    return json.loads((d / "shardwire.manifest.json").read_text())


def write_mix(d: pathlib.Path, seed: int = 7) -> None:
    """10 shards: six .npy files of assorted dtypes/shapes and one Arrow IPC file (4 batches),
    random values from `seed`."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
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
