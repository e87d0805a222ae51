"""Fixes of the review of the Python SDK's torch integration and HTTP transport, against real
``shardwire source`` / ``serve`` processes on 127.0.0.1:

- An HTTP stream whose request failed on both of its attempts (a connection cut on the way, the
  node itself still reachable) is closed on the node too: the SDK sends its close on a
  connection of its own. Before, it was closed on this side only and stayed on the node, with
  its memory and leased batch, until its idle timeout (300 s), beside the stream that resumed
  it. Where the node cannot be reached either, the close's failure is ignored and the call
  still raises ``ConnectionClosed``, at once.
- ``connect_http`` names the node's refusal of its health check (code and message: here the
  ``403 forbidden`` of a request over loopback addressed to a host name other than localhost),
  not "is this a shardwire node's admin address?"; an ``https://`` address is refused as such
  (``ValueError``: the API is plain HTTP) by ``connect`` too, which took it for a socket path
  ("no such file").
- ``shardwire.torch.IterableDataset(socket="http://...", idle_timeout=...)`` passes
  ``idle_timeout`` to every stream it opens (shard mode's ``open_at_epoch``, batch mode's probe
  and stream), as ``HttpClient.open_stream`` takes it; with a trainer socket it is a
  ``ValueError`` naming the node's own setting. Before, the keyword was a ``TypeError``.

A small TCP forwarder in front of the node's admin address (:class:`Cutter`) breaks the
connections; torch comes from tests/e2e/requirements-frameworks.txt (the dataset tests are
skipped, saying why, where it is not installed).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import WAIT, arrow_batches, wait_for, write_arrow
from sdk_harness import (  # noqa: E402 - the shared harness; puts the SDK on sys.path
    Procs,
    World,
    expected_tensors,
    http,
    http_json,
    index,
    listed,
    sequence,
    write_mix,
)
import shardwire  # noqa: E402
from shardwire import _http  # noqa: E402

#: Rows of the batch-mode dataset `rows` (one Arrow file), and its batch size.
ROWS, BATCH = 160, 16
#: The idle timeout the dataset tests give their streams, in seconds.
IDLE = 2
#: A host name that resolves (in this process only, see `test_connect_http_names_...`) to
#: 127.0.0.1 and is neither localhost nor an IP address.
NAME = "node.shardwire.test"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A source serving `mix` (sdk_harness's 10 assorted shards) and `rows` (ROWS rows of
    `id`/`emb` record batches, for batch mode), and a node on it."""
    tmp = tmp_path_factory.mktemp("httprev")
    procs = Procs(tmp)
    try:
        mix = tmp / "mix"
        write_mix(mix)
        manifest = index(mix)
        rows = tmp / "rows"
        write_arrow(rows / "p0.arrow", arrow_batches([ROWS // 4] * 4, seed=3), stream=False)
        index(rows)
        src = procs.source({"mix": mix, "rows": rows})
        serve = procs.serve(src, tmp / "sw.sock")
        yield World(procs, tmp, serve, expected_tensors(mix, manifest))
    finally:
        procs.close()


class Cutter:
    """A TCP forwarder on 127.0.0.1 in front of `target` (``HOST:PORT``). A connection whose
    next request starts with `cut` (bytes: ``b"GET /v1/leases/"``) is ended before the node
    sees it, both ways: a connection broken on the way (a proxy's reset, a download given up),
    the node itself still reachable. :attr:`requests` holds the first line of every request
    that came through (or was cut); :meth:`stop` leaves nothing listening on :attr:`addr`."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.cut: bytes | None = None
        self.cuts = 0
        self.requests: list[bytes] = []
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=WAIT)
            except OSError:
                down.close()
                continue
            down.settimeout(None)
            up.settimeout(None)
            with self._lock:
                self._socks += [down, up]
                for args in ((down, up, True), (up, down, False)):
                    t = threading.Thread(target=self._pump, args=args, daemon=True)
                    self._threads.append(t)
                    t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if requests:
                    # http.client sends one request at a time, its head in one send: a chunk
                    # from the client starts with a request line.
                    with self._lock:
                        self.requests.append(data.split(b"\r\n", 1)[0])
                    if self.cut is not None and data.startswith(self.cut):
                        with self._lock:
                            self.cuts += 1
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        """Stops listening and ends every connection (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._accepting.join(WAIT)
        self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(WAIT)
        for s in socks:
            s.close()


def _ids(admin: str) -> set[int]:
    """The ids of the streams the node lists."""
    st, v = http_json(admin, "GET", "/v1/streams")
    assert st == 200, v
    return {s["id"] for s in v["streams"]}


# --- finding 1: a broken HTTP stream is closed on the node -------------------------------------


def test_a_broken_http_stream_is_closed_on_the_node_too(node: World):
    """Every tensor download cut on the way (the request and its retry on a new connection)
    while the node is up: ``ConnectionClosed``, and the node no longer lists the stream (the
    SDK sent ``POST .../close``, once); ``close()`` then sends nothing more, and a stream
    resumed from the state saved before goes on from there. Before, the stream stayed on the
    node for its idle timeout (300 s), and close() did nothing."""
    a = node.serve.admin
    cutter = Cutter(a)
    try:
        s = shardwire.connect_http(cutter.addr).open_stream("mix", seed=5)
        sid = s.info.stream
        first = s.next(timeout=WAIT)
        assert first is not None
        saved = s.state_dict()
        assert listed(a, sid) is not None
        cutter.cut = b"GET /v1/leases/"
        with pytest.raises(shardwire.ConnectionClosed):
            s.next(timeout=WAIT)
        assert cutter.cuts >= 2 and s.closed, cutter.requests
        close = b"POST /v1/streams/%d/close " % sid
        assert sum(r.startswith(close) for r in cutter.requests) == 1, cutter.requests
        # Gone well before the 300 s idle timeout that removed it before.
        wait_for(lambda: listed(a, sid) is None, f"stream {sid} closed on the node", timeout=10)
        s.close()  # already closed: nothing more is sent
        assert sum(r.startswith(close) for r in cutter.requests) == 1, cutter.requests
        with pytest.raises(shardwire.ShardwireError) as ei:
            s.state_dict()
        assert ei.value.code == "closed", repr(ei.value)
    finally:
        cutter.stop()
    with shardwire.connect_http(a).open_stream("mix", seed=5, state=saved) as r:
        rest = sequence(r)
    with shardwire.connect_http(a).open_stream("mix", seed=5) as w:
        want = sequence(w)
    assert [(first.epoch, first.index, first.shard), *rest] == want


def test_a_broken_http_stream_whose_node_is_unreachable_still_raises_connection_closed(node: World):
    """Nothing answers at the stream's address any more (the forwarder stopped: the request,
    its retry and the close are all refused): the close's failure is ignored and the call
    raises ``ConnectionClosed`` at once, well within the close's 10 s bound."""
    a = node.serve.admin
    cutter = Cutter(a)
    sid = None
    try:
        s = shardwire.connect_http(cutter.addr).open_stream("mix", seed=6)
        sid = s.info.stream
        assert s.next(timeout=WAIT) is not None
        cutter.stop()
        t0 = time.monotonic()
        with pytest.raises(shardwire.ConnectionClosed):
            s.next(timeout=WAIT)
        assert time.monotonic() - t0 < _http.CLOSE_TIMEOUT, "a refused close is given up at once"
        assert s.closed
        s.close()
    finally:
        cutter.stop()
        if sid is not None:
            http(a, "POST", f"/v1/streams/{sid}/close")  # the node never heard of the break


# --- finding 2: connect_http's refusals ---------------------------------------------------------


def test_connect_http_names_the_nodes_refusal_of_its_health_check(node: World, monkeypatch: pytest.MonkeyPatch):
    """Over loopback the node serves requests addressed to localhost or an IP address only;
    one addressed to another name that resolves here (the host's own name on Debian's
    127.0.1.1) is refused ``403 forbidden``. The ConnectError carries the node's code and
    message. Before, it said only "answered HTTP 403: is this a shardwire node's admin
    address?"."""
    port = node.serve.admin.rsplit(":", 1)[1]
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kw: Any) -> Any:
        return real("127.0.0.1" if host == NAME else host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(shardwire.ConnectError) as ei:
        shardwire.connect_http(f"{NAME}:{port}")
    m = ei.value.message
    assert "HTTP 403 forbidden" in m and "localhost or an IP address only" in m, m
    assert "is this a shardwire node" not in m, m
    # The same node, addressed by its IP: fine.
    assert shardwire.connect_http(f"127.0.0.1:{port}").url == f"http://127.0.0.1:{port}"


def test_an_https_address_is_refused_as_such_by_connect_and_connect_http(node: World):
    """``https://`` is refused with a ValueError saying the API is plain HTTP, by
    ``connect_http`` and by ``connect`` (positional, as ``IterableDataset(socket=...)`` passes
    it). Before, ``connect`` took it for a socket path: ``ConnectError`` "no such file"."""
    port = node.serve.admin.rsplit(":", 1)[1]
    for call in (shardwire.connect, shardwire.connect_http):
        with pytest.raises(ValueError, match="only http:// URLs are supported") as ei:
            call(f"https://127.0.0.1:{port}")
        assert "plain HTTP" in str(ei.value), ei.value
    assert isinstance(shardwire.connect(f"http://127.0.0.1:{port}"), shardwire.HttpClient)


# --- finding 3: the torch dataset's idle_timeout over HTTP ------------------------------------


def _need_torch() -> None:
    pytest.importorskip("torch", reason="torch is not installed (tests/e2e/requirements-frameworks.txt; scripts/test installs it)")


def _which_shard(world: World, item: dict[str, np.ndarray]) -> int:
    hits = [
        i for i, e in enumerate(world.expected)
        if sorted(e) == sorted(item) and all(np.array_equal(e[k], np.asarray(item[k])) for k in e)
    ]
    assert len(hits) == 1, f"item matches shards {hits}"
    return hits[0]


def _first_then_reaped(ds: Any, admin: str) -> tuple[Any, Any]:
    """Takes `ds`'s first item, then waits (paused at the item, as a training loop in an
    evaluation pass) until every stream the iteration opened is gone from the node, which only
    an idle timeout of IDLE seconds does this soon; returns (the item, the iterator)."""
    before = _ids(admin)
    it = iter(ds)
    first = next(it)
    opened = _ids(admin) - before
    assert opened, "the iteration opened a stream on the node"
    # The node's default, 300 s, would keep them far longer than this wait.
    wait_for(lambda: not opened & _ids(admin), f"streams {opened} reaped after {IDLE} s idle", timeout=IDLE + 15)
    return first, it


def test_the_torch_dataset_over_http_passes_idle_timeout_in_shard_mode(node: World):
    """Shard mode over HTTP with ``idle_timeout=2``: paused past it, the stream is reaped and
    the next item raises ``not_found``; the next iteration (also with the keyword) resumes after
    the last item yielded, in the socket's order. Before, ``idle_timeout`` was a TypeError."""
    _need_torch()
    from shardwire.torch import IterableDataset

    a = node.serve.admin
    ds = IterableDataset("mix", socket=f"http://{a}", rank=0, world_size=1, seed=3, idle_timeout=IDLE)
    assert ds.idle_timeout == IDLE
    first, it = _first_then_reaped(ds, a)
    with pytest.raises(shardwire.ServiceError) as ei:
        next(it)
    assert ei.value.code == "not_found", repr(ei.value)
    got = [_which_shard(node, first)] + [_which_shard(node, item) for item in ds]
    with shardwire.connect(node.serve.socket).open_stream("mix", seed=3) as s:
        want = [b.shard for b in s]
    assert got == want


def test_the_torch_dataset_over_http_passes_idle_timeout_in_batch_mode(node: World):
    """Batch mode over HTTP at epoch 1 (through the probe that learns the plan's fingerprint)
    with ``idle_timeout=2``: the stream is reaped after the pause, and the next iteration
    resumes the epoch after the first batch, as the socket orders it."""
    _need_torch()
    from shardwire.torch import IterableDataset

    a = node.serve.admin
    ds = IterableDataset("rows", socket=f"http://{a}", rank=0, world_size=1, seed=2, batch_size=BATCH, idle_timeout=IDLE)
    ds.set_epoch(1)
    first, it = _first_then_reaped(ds, a)
    assert first["id"].shape == (BATCH,)
    with pytest.raises(shardwire.ServiceError) as ei:
        next(it)
    assert ei.value.code == "not_found", repr(ei.value)
    got = [first["id"]] + [item["id"] for item in ds]
    with shardwire.connect(node.serve.socket).open_stream("rows", seed=2, batch_size=BATCH, epochs=2) as s:
        want = [b["id"].copy() for b in s if b.epoch == 1]
    assert len(got) == len(want) == ROWS // BATCH
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_the_torch_dataset_refuses_idle_timeout_with_a_trainer_socket(node: World):
    """``idle_timeout`` is the HTTP API's: with a trainer socket (given, or the default) a
    ValueError names the node's own setting; out of range it is refused as
    ``HttpClient.open_stream`` refuses it; both when the dataset is made."""
    _need_torch()
    from shardwire.torch import IterableDataset

    for sock in (node.serve.socket, None):
        with pytest.raises(ValueError, match="trainer_idle_timeout_secs"):
            IterableDataset("mix", socket=sock, idle_timeout=60)
    with pytest.raises(ValueError, match="at most 86400"):
        IterableDataset("mix", socket=f"http://{node.serve.admin}", idle_timeout=86_401)
    # Another scheme than http:// is refused when the dataset is made, not in a worker.
    for url in ("https://127.0.0.1:1", "ftp://127.0.0.1:1"):
        with pytest.raises(ValueError, match="only http://"):
            IterableDataset("mix", socket=url, idle_timeout=60)
    # Set on a socket dataset afterwards: refused when the stream opens, naming it the same.
    ds = IterableDataset("mix", socket=node.serve.socket, seed=1)
    ds.idle_timeout = 60
    with pytest.raises(ValueError, match="trainer_idle_timeout_secs"):
        next(iter(ds))
