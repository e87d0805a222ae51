"""Shared fixtures and helpers for the end-to-end tests (real processes on 127.0.0.1).

Nothing here runs at import time or is autouse, so self-contained test modules (such as
test_index.py) are unaffected. Tests opt in by naming the fixtures:

- ``sw``: a :class:`Harness` bound to the test's ``tmp_path``. It starts ``shardwire source``
  and ``shardwire serve`` as subprocesses (:class:`Proc`), waits for their ready lines, runs
  ``shardwire consume --jsonl`` (foreground or background), and kills every child it started
  when the test ends, pass or fail. :class:`Proc` and :class:`Children` are the suite's one
  process helper: sdk_harness.py (the SDK tests' ``Procs``) builds on them too.
- ``s3``, ``s3_bucket``, ``s3_proxy`` (tests/e2e/s3fixtures.py): a moto S3 server that checks
  SigV4 (s3server.py), a fresh bucket per test, and a fault-injecting proxy in front of the
  server (s3fault.py); they skip where moto[server] is not installed.
- Module-level helpers: dataset writers (numpy ``np.save``, pyarrow IPC file/stream),
  ``index_dataset``, ``expected_crcs`` (CRC-32C of each tensor's bytes in the dataset files,
  from the manifest), ``get_status``/``wait_for``/``wait_ready`` for the admin API, and
  ``vm_rss`` / ``open_fds`` for /proc/PID.

The binary is ``$SHARDWIRE_BIN`` or ``<repo>/target/debug/shardwire``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Iterable

import pytest

from pdeathsig import die_with_parent

REPO = pathlib.Path(__file__).resolve().parents[2]
MANIFEST = "shardwire.manifest.json"
#: Default timeout of every wait, in seconds (generous: CI machines are slow).
WAIT = 60.0
#: Seconds :meth:`Proc.stop` waits after its SIGTERM before a second one: a node or source with
#: nothing open exits well within it; one draining open streams or node sessions would wait up
#: to its drain timeout, and ends the drain at once on a second signal.
SECOND_SIGNAL_AFTER = 1.0

SOURCE_READY = re.compile(r"source listening on (\S+)")
SERVE_READY = re.compile(r"node service ready: socket (\S+) admin http://(\S+)")


# --- the binary ------------------------------------------------------------------------------


def shardwire_bin() -> pathlib.Path:
    """Path of the shardwire binary (env SHARDWIRE_BIN, default target/debug/shardwire)."""
    return pathlib.Path(os.environ.get("SHARDWIRE_BIN", REPO / "target" / "debug" / "shardwire"))


def require_bin() -> pathlib.Path:
    b = shardwire_bin()
    if not b.is_file() or not os.access(b, os.X_OK):
        pytest.fail(f"shardwire binary not found at {b}; run `cargo build -p shardwire` or set SHARDWIRE_BIN")
    return b


def child_env(extra: dict | None = None) -> dict:
    """A hermetic environment for children: no inherited SHARDWIRE_* settings, info logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}
    env["RUST_LOG"] = os.environ.get("SHARDWIRE_E2E_RUST_LOG", "info")
    env.setdefault("RUST_BACKTRACE", "1")
    env["NO_COLOR"] = "1"  # plain logs in the stderr files
    # Host memory unless a test asks otherwise (`--memory` beats the environment): the
    # suite checks bytes in host memory, and on a GPU host `auto` would choose CUDA
    # (tests/e2e/test_cuda_e2e.py covers that).
    env["SHARDWIRE_MEMORY"] = "host"
    env.update(extra or {})
    return env


# --- CRC-32C ---------------------------------------------------------------------------------


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, via the PyPI `crc32c` package."""
    import crc32c as _crc32c  # imported lazily so test_index.py never depends on it

    return _crc32c.crc32c(data) & 0xFFFFFFFF


# --- datasets --------------------------------------------------------------------------------


def index_dataset(d: pathlib.Path, *flags: str, timeout: float = 300) -> dict:
    """Runs `shardwire index DIR [FLAGS]`, asserts success and returns the manifest."""
    r = subprocess.run(
        [str(require_bin()), "index", "--quiet", str(d), *flags],
        capture_output=True, text=True, timeout=timeout, env=child_env(),
    )
    assert r.returncode == 0, f"shardwire index {d} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return load_manifest(d)


def write_tokens(d: pathlib.Path, tokens, eos: int | None = None) -> dict:
    """A raw token dataset: `tokens` (a numpy array) as DIR/train.bin, indexed with
    `--tokens DTYPE` (and `--eos EOS`); returns the manifest."""
    d.mkdir(parents=True, exist_ok=True)
    tokens.tofile(d / "train.bin")
    flags = ["--tokens", str(tokens.dtype)] + ([] if eos is None else ["--eos", str(eos)])
    return index_dataset(d, *flags)


def load_manifest(d: pathlib.Path) -> dict:
    return json.loads((pathlib.Path(d) / MANIFEST).read_text())


def write_npy_dataset(d: pathlib.Path, arrays: dict) -> dict:
    """Writes each array as `d/NAME.npy` with np.save; returns {file name: array}."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, a in arrays.items():
        np.save(d / f"{name}.npy", a)
        out[f"{name}.npy"] = a
    return out


def arrow_batches(rows: Iterable[int], k: int = 4, seed: int = 0, id_start: int = 0):
    """Record batches with an int64 column `id` and a fixed_size_list<float32, k> column `emb`."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    batches = []
    next_id = id_start
    for n in rows:
        ids = np.arange(next_id, next_id + n, dtype=np.int64) * 1_000_003 - 7
        next_id += n
        emb = rng.standard_normal((n, k)).astype(np.float32)
        batches.append(
            pa.RecordBatch.from_arrays(
                [pa.array(ids, pa.int64()), pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1), pa.float32()), k)],
                names=["id", "emb"],
            )
        )
    return batches


def write_id_dataset(d: pathlib.Path, sizes: list[list[int]], k: int = 4) -> dict[int, tuple[bytes, bytes]]:
    """An indexed Arrow dataset of record batches from :func:`arrow_batches`: file f holds
    batches of sizes[f] rows (stream format for even f, file format for odd). Returns every
    row by id: (the id's 8 bytes, the emb row's 4k bytes), to check batch tensors against."""
    import struct

    import numpy as np

    rows: dict[int, tuple[bytes, bytes]] = {}
    next_id = 0
    for f, sz in enumerate(sizes):
        batches = arrow_batches(sz, k=k, seed=f, id_start=next_id)
        next_id += sum(sz)
        write_arrow(d / f"part-{f}.arrow", batches, stream=f % 2 == 0)
        for b in batches:
            emb = b.column(1).flatten().to_numpy().reshape(-1, k)
            for i, e in zip(b.column(0).to_numpy(), emb):
                rows[int(i)] = (struct.pack("<q", int(i)), e.astype(np.float32).tobytes())
    index_dataset(d)
    return rows


def write_arrow(path: pathlib.Path, batches, stream: bool) -> None:
    """Writes record batches with pa.ipc.new_stream (stream=True) or pa.ipc.new_file."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)


def arrow_column_numpy(batch, name: str):
    """The numpy view pyarrow gives of column `name` (fixed-size lists as 2-D arrays)."""
    import pyarrow as pa

    col = batch.column(batch.schema.get_field_index(name))
    if pa.types.is_fixed_size_list(col.type):
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    return col.to_numpy(zero_copy_only=False)


def write_uint8_shards(d: pathlib.Path, count: int, size: int, prefix: str = "s", seed: int = 0) -> None:
    """`count` .npy files of `size` random uint8 bytes each (one shard per file)."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.save(d / f"{prefix}{i:03d}.npy", rng.integers(0, 256, size, dtype=np.uint8))


def expected_crcs(d: pathlib.Path) -> list[list[dict]]:
    """Per shard (manifest order), per tensor: name, dtype, shape and the CRC-32C of the
    tensor's bytes read from the dataset file at the manifest's absolute offset."""
    d = pathlib.Path(d)
    m = load_manifest(d)
    out = []
    for s in m["shards"]:
        with open(d / s["file"], "rb") as f:
            tensors = []
            for t in s["tensors"]:
                f.seek(t["offset"])
                data = f.read(t["length"])
                assert len(data) == t["length"], f"{s['file']}: tensor {t['name']} runs past the end of the file"
                tensors.append({"name": t["name"], "dtype": t["dtype"], "shape": list(t["shape"]), "crc32c": crc32c(data)})
        out.append(tensors)
    return out


def assert_byte_exact(batches: list[dict], expected: list[list[dict]]) -> None:
    """Every consumed batch's tensors equal the dataset file's (name, dtype, shape, crc32c)."""
    for b in batches:
        shard = b["shard"]
        assert 0 <= shard < len(expected), f"shard {shard} out of range: {b}"
        got = [{k: t[k] for k in ("name", "dtype", "shape", "crc32c")} for t in b["tensors"]]
        got = [dict(t, shape=list(t["shape"])) for t in got]
        assert got == expected[shard], f"batch {b['epoch']}/{b['index']} (shard {shard}) differs from the dataset file"


def assert_exactly_once(batches: list[dict], shards: int) -> None:
    seen = sorted(b["shard"] for b in batches)
    assert seen == list(range(shards)), f"shards delivered (sorted) {seen}, expected each of 0..{shards - 1} once"


# --- processes -------------------------------------------------------------------------------


class Proc:
    """A child process whose stdout is read line by line (by a thread) and whose stderr goes
    to a log file. `wait_line(regex)` waits for a stdout line; `stop()` kills it."""

    def __init__(self, name: str, args: list, log_dir: pathlib.Path, env: dict | None = None):
        self.name = name
        self.args = [str(a) for a in args]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = log_dir / f"{name}.stderr.log"
        self._err = open(self.stderr_path, "wb")
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self.popen = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._err,
            env=child_env(env), text=True, bufsize=1, preexec_fn=die_with_parent,
        )
        self.pid = self.popen.pid
        self._reader = threading.Thread(target=self._read, name=f"stdout-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)  # EOF

    def stderr_text(self) -> str:
        self._err.flush()
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe(self, tail: int = 4000) -> str:
        rc = self.popen.poll()
        err = self.stderr_text()
        return (
            f"[{self.name}] pid {self.pid} {'exited ' + str(rc) if rc is not None else 'running'}\n"
            f"  cmd: {' '.join(self.args)}\n  stdout: {self.lines[-20:]}\n"
            f"  stderr ({self.stderr_path}):\n{err[-tail:]}"
        )

    def wait_line(self, pattern: re.Pattern, timeout: float = WAIT) -> re.Match:
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
                self._reader.join(timeout=5)
                self.popen.wait(timeout=5)
                raise AssertionError(f"process ended before printing {pattern.pattern!r}\n{self.describe()}")
            m = pattern.search(line)
            if m:
                return m

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = WAIT) -> int:
        rc = self.popen.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc

    def _exits_by(self, deadline: float) -> bool:
        """Waits for the child to exit until `deadline` (time.monotonic); True if it did."""
        try:
            self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM; if the child still runs after :data:`SECOND_SIGNAL_AFTER` seconds, SIGTERM
        again (a node or source draining open streams or sessions ends the drain at once on a
        second signal: docs/CONFIGURATION.md, `drain_timeout_secs`); SIGKILL once `grace`
        seconds have passed since the first. Always reaps the child."""
        if self.alive():
            deadline = time.monotonic() + grace
            self.kill(signal.SIGTERM)
            if not self._exits_by(min(deadline, time.monotonic() + SECOND_SIGNAL_AFTER)):
                self.kill(signal.SIGTERM)
                if not self._exits_by(deadline):
                    self.kill(signal.SIGKILL)
                    self.popen.wait(timeout=WAIT)
        self._reader.join(timeout=5)
        if self.popen.stdout:
            self.popen.stdout.close()
        self._err.close()


class Source(Proc):
    """`shardwire source`; `.addr` is the control address it printed."""

    addr: str


class Serve(Proc):
    """`shardwire serve`; `.socket`, `.admin` (HOST:PORT) from its ready line."""

    socket: str
    admin: str

    def status(self) -> dict:
        return get_status(self.admin)


class Consumer(Proc):
    """`shardwire consume --jsonl` running in the background."""

    def batches(self) -> list[dict]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]

    def result(self, timeout: float = WAIT * 2) -> list[dict]:
        """Waits for exit, asserts exit 0, returns the parsed JSON lines."""
        try:
            rc = self.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"consume did not finish within {timeout}s\n{self.describe()}") from None
        assert rc == 0, f"consume failed\n{self.describe()}"
        return self.batches()


def consume_args(socket: str, dataset: str, **opts) -> list[str]:
    """`consume` flags: keyword `world_size=3` -> `--world-size 3`; True -> bare flag."""
    args = ["consume", "--socket", str(socket), "--dataset", dataset, "--jsonl"]
    for k, v in opts.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, str(v)]
    return args


class Children:
    """The children (:class:`Proc`) started for one test or module; :meth:`close` stops every
    one of them, the last started first (SIGKILL where stopping fails)."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def logs_of_all(self) -> str:
        return "\n".join(p.describe() for p in self.procs)

    def close(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception:  # noqa: BLE001 - teardown must reach every child
                p.kill(signal.SIGKILL)


class Harness(Children):
    """Starts children for one test and kills all of them at teardown."""

    def __init__(self, tmp_path: pathlib.Path):
        super().__init__()
        self.tmp = tmp_path
        self.logs = tmp_path / "logs"
        self._n = 0
        self.bin = require_bin()

    def _name(self, kind: str) -> str:
        self._n += 1
        return f"{self._n:02d}-{kind}"

    def _start(self, cls, kind: str, args: list, env: dict | None = None):
        p = cls(self._name(kind), [self.bin, *args], self.logs, env)
        self.procs.append(p)
        return p

    def source(self, datasets: dict, *extra, listen: str = "127.0.0.1:0", env: dict | None = None) -> Source:
        """Starts `shardwire source --listen ... --dataset NAME=DIR ...` (DIR may be a URL such
        as s3://bucket/prefix; `env`: extra environment, e.g. the S3 server's) and waits until
        ready."""
        args = ["source", "--listen", listen]
        for name, d in datasets.items():
            args += ["--dataset", f"{name}={d}"]
        p = self._start(Source, "source", args + [str(a) for a in extra], env)
        p.addr = p.wait_line(SOURCE_READY).group(1)
        return p

    def serve(self, sources: list, *extra, socket: pathlib.Path | None = None, env: dict | None = None) -> Serve:
        """Starts `shardwire serve` on ephemeral loopback ports and waits for its ready line
        (`env`: extra environment variables for it)."""
        name = self._name("serve")
        sock = socket or (self.tmp / f"{name}.sock")
        args = ["serve", "--socket", sock, "--data-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
        for s in sources:
            args += ["--source", s.addr if isinstance(s, Source) else s]
        p = Serve(name, [self.bin, *args, *extra], self.logs, env)
        self.procs.append(p)
        m = p.wait_line(SERVE_READY)
        p.socket, p.admin = m.group(1), m.group(2)
        return p

    def start_consume(self, serve: Serve | str, dataset: str, **opts) -> Consumer:
        sock = serve.socket if isinstance(serve, Serve) else serve
        return self._start(Consumer, "consume", consume_args(sock, dataset, **opts))

    def consume(self, serve: Serve | str, dataset: str, timeout: float = WAIT * 2, **opts) -> list[dict]:
        """Runs `consume` to completion; returns its JSON lines."""
        return self.start_consume(serve, dataset, **opts).result(timeout)


# A test still running after this long is hung (the slowest take about 75 s): every thread's
# stack is written to stderr and the run ends, rather than a hung run saying nothing until
# CI's own limit. It ends with `_exit`, without teardown: the children die with it all the same
# (each long-running one is started with `preexec_fn=die_with_parent`, pdeathsig.py).
HANG_LIMIT = 600


#: Where tests/e2e/test_uring.py notes `kernel.io_uring_disabled`'s value while it has set it to
#: 2 (removed when it restores it): a run killed in between is undone by the next.
IO_URING_NOTE = pathlib.Path("/run/shardwire-e2e-io_uring_disabled")


def remove_leftovers() -> list[str]:
    """Undoes what a run killed before its tests' clean-up left on the machine (the hang guard
    exits without teardown; a session's processes may be killed): the netns tests' namespaces
    and veths (their addresses shadow this run's routes), an impairment's NFQUEUE rule in the
    root namespace (it has no bypass: it drops the traffic it matches), and
    `kernel.io_uring_disabled` left at 2. Returns what it undid."""
    done = []
    run = lambda *a: subprocess.run(list(a), capture_output=True, text=True, timeout=30)  # noqa: E731
    if shutil.which("ip"):
        for line in run("ip", "netns", "list").stdout.splitlines():
            name = (line.split() or [""])[0]
            if re.fullmatch(r"swsrc-[0-9a-f]{6}", name):
                run("ip", "netns", "del", name)
                done.append(f"namespace {name}")
        for name in re.findall(r"^\d+: (swn[0-9a-f]{6})[@:]", run("ip", "-o", "link", "show").stdout, re.M):
            run("ip", "link", "del", name)
            done.append(f"link {name}")
    if shutil.which("iptables"):
        for rule in run("iptables", "-w", "5", "-S").stdout.splitlines():
            if rule.startswith("-A ") and "NFQUEUE" in rule and "0x1e5eed" in rule.lower():
                run("iptables", "-w", "5", "-D", *shlex.split(rule)[1:])
                done.append(f"iptables rule {rule}")
    if IO_URING_NOTE.exists():
        before = IO_URING_NOTE.read_text().strip()
        pathlib.Path("/proc/sys/kernel/io_uring_disabled").write_text(before)
        IO_URING_NOTE.unlink()
        done.append(f"kernel.io_uring_disabled back to {before}")
    return done


def in_xdist_worker(config) -> bool:
    """True in a pytest-xdist worker process (not in its controller or a plain run)."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    """:func:`remove_leftovers`, once before the first test (as root; said on stderr). Under
    pytest-xdist only the controller does it, before its workers start: a worker doing it would
    delete what the other worker's running test made."""
    if os.geteuid() == 0 and not in_xdist_worker(session.config):
        for what in remove_leftovers():
            print(f"e2e: removed a killed run's leftover: {what}", file=sys.stderr)


#: Test modules that run in the serial pass (`pytest -m serial`, no other test beside them):
#: `scripts/test` runs every other module under pytest-xdist, two at a time (`-m "not serial"`).
#: Each is here because it changes machine-wide state or measures what a neighbour would skew.
SERIAL_MODULES = {
    "test_netns.py": "a root-namespace veth with fixed addresses; its leftovers test removes every run's namespaces, NFQUEUE rules and the io_uring sysctl note",
    "test_fault_layer.py": "the netns fixture's fixed addresses, a fail-closed NFQUEUE rule in the root namespace, fd/RSS baselines and timing bounds under floods",
    "test_lanes_netns.py": "root-namespace veths with fixed addresses; its fixture deletes every swls-* namespace",
    "test_devmem_tx_nics.py": "test_lanes_netns.py's namespaces and veths",
    "test_uring.py": "sets kernel.io_uring_disabled machine-wide (every node started meanwhile would fall back to recv)",
    "test_soak.py": "an RSS slope bound and a throughput floor over 45-60 s of churn",
    "test_impair.py": "the userspace verdict loop must keep up with the link (delay and drop ratios)",
    "test_bench_crc.py": "keeps both cores busy for its whole run, which would skew a neighbour's timing bounds",
    "test_sdk_review2_fixes.py": "close() timing bounds with about 1 s of slack",
    "test_sdk_recovery.py": "recovery timing bounds with little slack",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: runs in the serial pass, never beside another test (conftest.SERIAL_MODULES)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the tests of :data:`SERIAL_MODULES` ``serial`` (before ``-m`` selects)."""
    for item in items:
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A pytest-xdist worker fails a ``serial`` test before its fixtures are set up (it would
    run beside another test): run them with ``-m serial`` and no ``-n``."""
    if item.get_closest_marker("serial") is not None and in_xdist_worker(item.config):
        pytest.fail(
            f"{item.path.name} must not run beside other tests ({SERIAL_MODULES.get(item.path.name, 'marked serial')}): "
            'select the parallel tests with -m "not serial" under -n, and run -m serial without -n (as scripts/test does)',
            pytrace=False,
        )


def next_in_forked_child(stream) -> str:
    """In a child forked now: `stream.next(timeout=1)`, then `stream.close()` (as a `with`
    block's exit would); returns what the child saw: ``served``, or the error's
    ``code: message``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(r)
        try:
            stream.next(timeout=1)
            os.write(w, b"served")
        except Exception as e:  # noqa: BLE001 - reported to the parent, whatever it is
            os.write(w, f"{getattr(e, 'code', type(e).__name__)}: {getattr(e, 'message', e)}".encode())
        finally:
            stream.close()
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    said = os.read(r, 4096).decode()
    os.close(r)
    return said


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(HANG_LIMIT, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def sw(tmp_path, request):
    """A :class:`Harness`; every child it started is killed when the test ends."""
    h = Harness(tmp_path)
    request.addfinalizer(h.close)
    yield h
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print("\n--- child processes ---\n" + h.logs_of_all())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        item.rep_call = rep
    return rep


# --- admin API -------------------------------------------------------------------------------


def http_get(admin: str, path: str, timeout: float = 10) -> tuple[int, str]:
    """(status code, body) of GET http://ADMIN/PATH; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(f"http://{admin}{path}", timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def admin_request(admin: str, method: str, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    """(status, JSON body) of an admin API call, with an optional JSON body and bearer token;
    HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{admin}{path}", method=method, data=data)
    if data is not None:
        req.add_header("content-type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_status(admin: str) -> dict:
    code, body = http_get(admin, "/v1/status")
    assert code == 200, f"/v1/status answered {code}: {body}"
    return json.loads(body)


def wait_for(
    pred: Callable[[], object],
    what: str,
    timeout: float = WAIT,
    interval: float = 0.1,
    diag: Callable[[], str] | None = None,
):
    """Polls `pred` until it returns something truthy (returned); fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            extra = f"\n{diag()}" if diag else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def wait_ready(serve: Serve, sources: int = 1, timeout: float = WAIT) -> dict:
    """Waits for /readyz 200 and `sources` sources up in /v1/status; returns the status."""
    wait_for(lambda: http_get(serve.admin, "/readyz")[0] == 200, f"{serve.name} /readyz 200", timeout, diag=serve.describe)

    def enough_up():
        st = serve.status()
        return st if sum(1 for s in st["sources"] if s["up"]) >= sources else None

    return wait_for(enough_up, f"{sources} source(s) up on {serve.name}", timeout, diag=serve.describe)


def ragged_rows(b, name: str) -> list:
    """The rows of ragged tensor `name` of batch `b` (`name` + `name.offsets`, int64 from 0)."""
    values, offs = b[name], b[name + ".offsets"]
    assert offs.dtype == "int64" and offs[0] == 0 and offs[-1] == len(values), (name, offs[:3], len(values))
    return [values[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]


def serve_dataset(sw, name: str, d: pathlib.Path, pool: str = "256MiB", stream_memory: str = "16MiB") -> Serve:
    """A source serving dataset `name` from `d` and a node on it, ready."""
    n = sw.serve([sw.source({name: d})], "--pool-size", pool, "--stream-memory", stream_memory)
    wait_ready(n)
    return n


# --- /proc -----------------------------------------------------------------------------------


def vm_rss(pid: int) -> int:
    """Resident set size of `pid` in bytes (VmRSS of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                parts = line.split()
                assert parts[2] == "kB", line
                return int(parts[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def open_fds(pid: int) -> int:
    """Number of open file descriptors of `pid` (entries of /proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


MiB = 1 << 20


# --- object storage (S3) ---------------------------------------------------------------------
# Fixtures `s3`, `s3_bucket`, `s3_proxy` (tests/e2e/s3fixtures.py; they skip where moto is absent).
from s3fixtures import s3, s3_bucket, s3_proxy  # noqa: E402,F401
