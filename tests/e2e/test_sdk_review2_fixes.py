"""Fixes of the second Python SDK review, without a node: no binary, no socket, no GPU, no torch
(a fake ``torch.cuda`` stands in for it where one is needed).

- An explicit ``device=`` ("cuda:N", N, "cuda") and ``"auto"`` resolve in a child forked after
  its parent started CUDA through torch (a DataLoader worker started with fork once the
  trainer ran ``model.cuda()``): from what the parent noted as it forked, never touching CUDA
  there (torch raises "Cannot re-initialize CUDA in forked subprocess"). Without such a note,
  a ValueError names the device and asks for its PCI bus id.
- A failed CUDA driver call in a process forked after its parent started CUDA says so and
  names the fix (spawn), instead of telling the user to install the driver.
- Every SDK error pickles with its class, message and attributes.
- ``HttpClient.open_stream(idle_timeout=...)`` refuses infinity and values over the service's
  86400 s before sending anything, and takes any number ``float()`` takes (``Decimal``);
  ``close()`` ends within its 10 s in all (one deadline across the host's addresses and every
  receive of the answer), not 120 s; a ConnectError for an HTTP URL does not call it a trainer
  socket, and one for a bytes socket path is a ConnectError (not a TypeError).
"""

from __future__ import annotations

import contextlib
import decimal
import enum
import fractions
import http.client
import json
import os
import pathlib
import pickle
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402
from shardwire import _cuda, _device, _http  # noqa: E402
from shardwire._options import StreamOptions  # noqa: E402

#: The bus ids of the fake torch's ordinals 0..3.
BUS = ["0000:19:00.0", "0000:3b:00.0", "0000:5d:00.0", "0000:9a:00.0"]


class FakeCuda:
    """``torch.cuda`` as far as shardwire uses it, with torch's fork rule: once CUDA started in
    a process, a child forked from it is "in a bad fork", where any call that needs CUDA raises
    what torch raises (and `is_initialized` says False, `is_available` still True)."""

    def __init__(self, *, properties_fail: bool = False) -> None:
        self.started_in: int | None = None  # the pid where CUDA started
        self.current = 0
        self.properties_fail = properties_fail

    def _is_in_bad_fork(self) -> bool:
        return self.started_in is not None and self.started_in != os.getpid()

    def _lazy_init(self) -> None:
        if self._is_in_bad_fork():
            raise RuntimeError(
                "Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                "multiprocessing, you must use the 'spawn' start method"
            )
        if self.started_in is None:
            self.started_in = os.getpid()

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.started_in is not None and not self._is_in_bad_fork()

    def device_count(self) -> int:
        return len(BUS)

    def set_device(self, n: int) -> None:
        self._lazy_init()
        self.current = n

    def current_device(self) -> int:
        self._lazy_init()
        return self.current

    def get_device_properties(self, n: int) -> Any:
        self._lazy_init()
        if self.properties_fail:
            raise RuntimeError("no properties here")
        domain, bus, rest = BUS[n].split(":")
        return types.SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16), pci_device_id=int(rest.split(".")[0], 16))


@pytest.fixture
def fresh_device_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_device`'s per-process notes as in a fresh process (restored after the test)."""
    for name in ("_at_fork", "_bus_ids", "_cuda_pid", "_inherited"):
        if hasattr(_device, name):
            monkeypatch.setattr(_device, name, None)


def fake_torch(monkeypatch: pytest.MonkeyPatch, cuda: FakeCuda) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


def in_forked_child(calls: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Each of `calls` in a child forked now: its result, or ``TypeName: message``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(r)
        try:
            said = {}
            for name, call in calls.items():
                try:
                    said[name] = str(call())
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    said[name] = f"{type(e).__name__}: {e}"
            os.write(w, json.dumps(said).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


# --- #1: an explicit device in a worker forked after the trainer started CUDA ---------------------


def test_a_device_resolves_in_a_child_forked_after_torch_started_cuda(monkeypatch, fresh_device_state):
    cuda = FakeCuda()
    fake_torch(monkeypatch, cuda)
    cuda.set_device(2)  # the trainer: torch.cuda.set_device(local_rank); model.cuda()
    assert _device.resolve("cuda:1") == BUS[1], "the parent resolves as before"
    said = in_forked_child({
        "cuda:1": lambda: _device.resolve("cuda:1"),
        "3": lambda: _device.resolve(3),
        "cuda": lambda: _device.resolve("cuda"),
        "auto": _device.current,
        "attach": lambda: StreamOptions(device="cuda:3").attach_fields("d")["device"],
        "cuda:9": lambda: _device.resolve("cuda:9"),
        "bus id": lambda: _device.resolve("0000:5D:00.0"),
    })
    assert said["cuda:1"] == BUS[1], said  # before: RuntimeError "Cannot re-initialize CUDA ..."
    assert said["3"] == BUS[3], said
    assert said["cuda"] == BUS[2] and said["auto"] == BUS[2], ("the parent's current device", said)
    assert said["attach"] == BUS[3], said
    assert said["cuda:9"].startswith("ValueError: device cuda:9: this process sees 4 CUDA device(s)"), said
    assert said["bus id"] == BUS[2], said
    assert _device._at_fork == (os.getpid(), 2, tuple(BUS)), ("noted here, as the parent forked", _device._at_fork)


def test_a_device_without_the_parent_s_note_asks_for_its_bus_id(monkeypatch, fresh_device_state):
    # The parent's note failed (its properties could not be read): the child cannot resolve an
    # ordinal, and says so with a ValueError naming the device, not torch's RuntimeError.
    cuda = FakeCuda(properties_fail=True)
    fake_torch(monkeypatch, cuda)
    cuda.set_device(1)
    said = in_forked_child({
        "cuda:1": lambda: _device.resolve("cuda:1"),
        "cuda": lambda: _device.resolve("cuda"),
        "auto": _device.current,
    })
    assert said["cuda:1"].startswith("ValueError: device cuda:1: this process was forked after its parent started CUDA"), said
    assert "PCI bus id" in said["cuda:1"] and 'multiprocessing_context="spawn"' in said["cuda:1"], said
    assert said["cuda"].startswith("ValueError: device 'cuda' (the current device)") and "PCI bus id" in said["cuda"], said
    assert said["auto"] == "None", "auto falls back to the node's choice"


def test_a_child_forked_before_cuda_started_looks_its_device_up_itself(monkeypatch, fresh_device_state):
    cuda = FakeCuda()
    fake_torch(monkeypatch, cuda)  # CUDA not started in the parent: nothing noted
    said = in_forked_child({"cuda:2": lambda: _device.resolve("cuda:2"), "forked": _device.forked_after_cuda})
    assert said == {"cuda:2": BUS[2], "forked": "False"}, said
    assert cuda.started_in is None, "the parent's fork started no CUDA"


# --- #3: a CUDA region in a worker forked after CUDA started ---------------------------------------


class _Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100


class FakeDriver:
    """``cuda.bindings.driver``'s cuInit, which succeeds in the process that called it first
    and fails in a child forked after that (what the driver does)."""

    CUresult = _Result

    def __init__(self) -> None:
        self.started_in: int | None = None

    def cuInit(self, flags: int) -> tuple[_Result]:
        if self.started_in is not None and self.started_in != os.getpid():
            return (_Result.CUDA_ERROR_NOT_INITIALIZED,)
        self.started_in = os.getpid()
        return (_Result.CUDA_SUCCESS,)


def test_cuinit_failing_in_a_child_forked_after_cuda_started_names_fork_and_spawn(monkeypatch, fresh_device_state):
    drv = FakeDriver()
    _cuda._init(drv)  # the trainer imported a region: CUDA started here
    said = in_forked_child({"init": lambda: _cuda._init(drv)})["init"]
    assert said.startswith("CudaImportError: cuda: cuInit failed: CUDA_ERROR_NOT_INITIALIZED"), said
    assert "forked" in said and 'multiprocessing_context="spawn"' in said, said
    assert "install the NVIDIA driver" not in said, said  # before: the install hint only


def test_cuinit_failing_in_a_child_of_a_torch_trainer_names_fork(monkeypatch, fresh_device_state):
    cuda = FakeCuda()
    fake_torch(monkeypatch, cuda)
    cuda.set_device(0)
    drv = FakeDriver()
    drv.started_in = os.getpid()  # torch's CUDA runtime started the driver here
    said = in_forked_child({"init": lambda: _cuda._init(drv)})["init"]
    assert "forked" in said and 'multiprocessing_context="spawn"' in said, said


def test_cuinit_failing_without_a_fork_still_says_to_install_the_driver(fresh_device_state):
    drv = FakeDriver()
    drv.started_in = -1  # "another process": fails here, with no fork behind it
    with pytest.raises(shardwire.CudaImportError) as e:
        _cuda._init(drv)
    assert "install the NVIDIA driver" in str(e.value) and "forked" not in str(e.value)


# --- #6: errors pickle -----------------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    shardwire.Timeout("no batch within 1s"),
    shardwire.ConnectionClosed("the node went away"),
    shardwire.ProtocolError("a field missing"),
    shardwire.CudaImportError("cuMemMap failed", call="cuMemMap", result="CUDA_ERROR_INVALID_VALUE"),
    shardwire.ConnectError("/run/shardwire/trainer.sock", "no such file"),
    shardwire.ConnectError("http://node7:7400", "connection refused"),
    shardwire.ServiceError("unknown_dataset", "no dataset 'x'"),
    shardwire.ShardwireError("closed", "stream 3 is closed"),
], ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_class_message_and_attributes(error):
    back = pickle.loads(pickle.dumps(error))  # before: TypeError for the one-argument classes
    assert type(back) is type(error)
    assert (back.code, back.message, str(back), back.args) == (error.code, error.message, str(error), error.args)
    assert vars(back) == vars(error)  # .call/.result, .path


# --- #7 and #5: HTTP arguments, messages and the close timeout --------------------------------------


@pytest.fixture
def http_sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The bodies `HttpClient.open_stream` would POST (nothing is sent)."""
    bodies: list[dict[str, Any]] = []
    monkeypatch.setattr(_http.HttpStream, "_open", classmethod(lambda cls, client, body: bodies.append(body)))
    return bodies


@pytest.mark.parametrize("value, message", [
    (float("inf"), "idle_timeout must be at most 86400 seconds"),
    (86_400.5, "idle_timeout must be at most 86400 seconds"),
    (10**6, "idle_timeout must be at most 86400 seconds"),
    (float("nan"), "idle_timeout must be > 0 seconds, not nan"),
    (-1, "idle_timeout must be > 0 seconds, not -1"),
])
def test_idle_timeout_out_of_range_is_refused_before_sending(http_sent, value, message):
    with pytest.raises(ValueError) as e:  # before: OverflowError (inf), or sent (86400.5, 10**6)
        _http.HttpClient("127.0.0.1:9").open_stream("d", idle_timeout=value)
    assert message in str(e.value), e.value
    assert http_sent == []


def test_idle_timeout_up_to_a_day_is_sent_in_whole_seconds(http_sent):
    c = _http.HttpClient("127.0.0.1:9")
    c.open_stream("d", idle_timeout=86_400)
    c.open_stream("d", idle_timeout=0.2)
    assert [b["idle_timeout_s"] for b in http_sent] == [86_400, 1]


def test_idle_timeout_takes_any_number_float_takes(http_sent):
    c = _http.HttpClient("127.0.0.1:9")
    for value in (decimal.Decimal("30"), decimal.Decimal("0.2"), fractions.Fraction(5, 2), np.float32(2.5), np.array(7.0)):
        c.open_stream("d", idle_timeout=value)  # before: ValueError for Decimal and a 0-d array
    assert [b["idle_timeout_s"] for b in http_sent] == [30, 1, 3, 3, 7]


@pytest.mark.parametrize("value, message", [
    (decimal.Decimal("NaN"), "idle_timeout must be > 0 seconds"),
    (decimal.Decimal("sNaN"), "idle_timeout must be a number of seconds"),
    (decimal.Decimal("Infinity"), "idle_timeout must be at most 86400 seconds"),
    (decimal.Decimal("1e400"), "idle_timeout must be at most 86400 seconds"),
    (10**400, "idle_timeout must be at most 86400 seconds"),
    (decimal.Decimal("-5"), "idle_timeout must be > 0 seconds"),
    ("30", "idle_timeout must be a number of seconds, not '30'"),
    (True, "idle_timeout must be a number of seconds, not True"),
    (np.bool_(True), "idle_timeout must be a number of seconds"),
    (object(), "idle_timeout must be a number of seconds"),
], ids=repr)
def test_idle_timeout_that_is_no_usable_number_is_refused(http_sent, value, message):
    with pytest.raises(ValueError) as e:
        _http.HttpClient("127.0.0.1:9").open_stream("d", idle_timeout=value)
    assert message in str(e.value), e.value
    assert http_sent == []


def test_a_connect_error_for_a_url_names_the_http_api():
    port = _closed_port()
    with pytest.raises(shardwire.ConnectError) as e:
        shardwire.connect_http(f"127.0.0.1:{port}", timeout=5)
    msg = str(e.value)
    assert "trainer socket" not in msg and f"the shardwire node's HTTP API at 'http://127.0.0.1:{port}'" in msg, msg
    sock = shardwire.ConnectError("/run/shardwire/trainer.sock", "no such file")
    assert "cannot connect to the shardwire trainer socket '/run/shardwire/trainer.sock'" in str(sock)


def test_a_missing_bytes_socket_path_raises_connect_error(tmp_path):
    path = os.fsencode(tmp_path / "missing.sock")  # os.stat and connect take bytes paths
    with pytest.raises(shardwire.ConnectError) as e:  # before: TypeError from bytes.startswith
        shardwire.connect(path)
    assert e.value.path == path, e.value.path
    assert f"cannot connect to the shardwire trainer socket {path!r}: no such file" in str(e.value), e.value


def _closed_port() -> int:
    """A loopback port nothing listens on (refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _dropping_syns() -> Iterator[int]:
    """A loopback port whose listen queue is full, so the kernel drops new SYNs: a connect there
    waits out its timeout, as to a host that went down (and nothing can hang on it)."""
    with socket.socket() as srv, socket.socket() as queued:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        queued.connect(("127.0.0.1", port))  # fills the queue; never accepted
        yield port


def _http_stream(url: str) -> _http.HttpStream:
    info = shardwire.StreamInfo(stream=7, region_size=0, batches_per_epoch=1, epochs=1, memory="http")
    return _http.HttpStream(_http.HttpClient(url), info, 300, conn=None)  # type: ignore[arg-type]


def test_close_connects_to_every_address_within_one_close_timeout(monkeypatch):
    # A host name with several addresses (AAAA and A) whose host drops packets: the connect
    # to each waited CLOSE_TIMEOUT of its own (socket.create_connection), 4 x 0.5 s here.
    monkeypatch.setattr(_http, "CLOSE_TIMEOUT", 0.5)
    with _dropping_syns() as port:
        addresses = [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))] * 4
        monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kw: addresses)
        s = _http_stream(f"node7:{port}")
        start = time.monotonic()
        s.close()  # the failure to reach the service is ignored
        took = time.monotonic() - start
    assert s.closed
    assert 0.4 < took < 1.5, f"close() took {took:.2f} s for a CLOSE_TIMEOUT of 0.5 s"  # before: 2 s


def test_close_ends_within_close_timeout_while_the_answer_trickles_in(monkeypatch):
    # A service that answers a byte every 0.1 s: each receive came within the socket timeout,
    # so close() waited as long as the bytes kept coming (here until the server stops, 3 s).
    monkeypatch.setattr(_http, "CLOSE_TIMEOUT", 0.5)
    stop = threading.Event()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(5)

        def trickle() -> None:
            with contextlib.suppress(OSError), srv.accept()[0] as conn:
                conn.recv(65536)
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: .....":  # 30 bytes
                    if stop.wait(0.1):
                        break
                    conn.sendall(bytes([byte]))

        server = threading.Thread(target=trickle, daemon=True)
        server.start()
        s = _http_stream(f"127.0.0.1:{srv.getsockname()[1]}")
        start = time.monotonic()
        s.close()
        took = time.monotonic() - start
        stop.set()
        server.join(10)
    assert s.closed
    assert 0.4 < took < 1.5, f"close() took {took:.2f} s for a CLOSE_TIMEOUT of 0.5 s"  # before: about 3 s


def test_open_s_close_after_an_unreadable_answer_connects_within_10_s(monkeypatch):
    # An open answered 201 with a body the SDK cannot read, on a connection the service then
    # closed: the stream is closed (best effort) on a new connection, within 10 s.
    calls: list[tuple[str, float, float | None]] = []

    def call(conn: http.client.HTTPConnection, method: str, path: str, body: Any, timeout: float, **kw: Any) -> Any:
        calls.append((path, timeout, conn.timeout))
        if path == "/v1/streams":
            return _http._Reply(201, http.client.HTTPMessage(), b'{"stream": 5}')
        raise TimeoutError("timed out")

    monkeypatch.setattr(_http, "_call", call)
    with pytest.raises(shardwire.ProtocolError):
        _http.HttpClient("127.0.0.1:9").open_stream("d")
    assert calls[1][0] == "/v1/streams/5/close", calls
    assert calls[1][1] <= 10 and calls[1][2] is not None and calls[1][2] <= 10, calls  # before: connect 120 s
