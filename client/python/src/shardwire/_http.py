"""The trainer API over HTTP (docs/TRAINER_API.md, "HTTP API"): for trainers that cannot share
memory with the node service (another host, a container without the socket).

Same streams, plan order and resume states as the Unix socket, and the same Stream/Batch API,
but each tensor is **downloaded**: a batch's arrays are private, writable numpy copies, so the
SDK releases the batch's lease on the service as soon as they have arrived (``keep()`` and
``release()`` are accepted and do nothing more). One kept-alive HTTP/1.1 connection per
stream (``http.client``, standard library).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import ConnectError, ConnectionClosed, ProtocolError, ServiceError, ShardwireError
from ._options import StreamOptions, document
from ._types import StreamInfo, TensorView, _BatchBase, _int, _loads, _sized_dtype, _StreamBase, _tensor_view, _timeout_ms

if TYPE_CHECKING:  # pragma: no cover
    from ._options import StreamKeywords, Unpack

__all__ = ["HttpBatch", "HttpClient", "HttpStream", "connect_http"]

#: A ``next`` without a timeout waits in long polls of this many milliseconds.
POLL_MS = 30_000
#: Socket timeout of requests that do not wait on the stream, in seconds.
IO_TIMEOUT = 120.0
#: Time ``POST .../close`` may take in all, in seconds, from its connect (every address of the
#: host in turn) to the end of the answer: a close that cannot reach the service by then gives
#: up (the service closes the stream after its idle timeout). The host name's lookup runs
#: inside the deadline but is not cut by it (the system resolver's own timeouts bound it): a
#: slow lookup leaves less time to connect.
CLOSE_TIMEOUT = 10.0
#: Largest ``idle_timeout`` the service takes, in seconds (service/src/http/trainer.rs,
#: ``MAX_IDLE_TIMEOUT_S``).
MAX_IDLE_TIMEOUT = 86_400
#: Downloads of one tensor while the node's copy budget stays full (each waits 10 s there).
COPY_ATTEMPTS = 6

# A kept-alive connection the server closed while idle fails the next request with one of
# these before any answer; the request is then sent again on a fresh connection.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


def _split(url: str) -> tuple[str, int, str]:
    """(host, port, "http://host:port") of ``HOST:PORT`` or ``http://HOST:PORT[/]``."""
    u = url if "://" in url else f"http://{url}"
    p = urllib.parse.urlsplit(u)
    if p.scheme != "http":
        raise ValueError(
            f"only http:// URLs are supported (the node's HTTP API is plain HTTP, without TLS: "
            f"http://HOST:PORT of its admin address), not {url!r}"
        )
    if not p.hostname or p.port is None:
        raise ValueError(f"the node's HTTP address must be HOST:PORT or http://HOST:PORT, not {url!r}")
    if p.path not in ("", "/") or p.query:
        raise ValueError(f"give the node's base URL (http://HOST:PORT), not {url!r}")
    host = p.hostname
    netloc = f"[{host}]:{p.port}" if ":" in host else f"{host}:{p.port}"
    return host, p.port, f"http://{netloc}"


def _maybe_json(r: Any) -> Any:
    """The JSON body of reply `r`, or None when it is not JSON."""
    try:
        return r.json()
    except (ValueError, ProtocolError):
        return None


def connect_http(url: str, *, timeout: float = 10.0) -> HttpClient:
    """An :class:`HttpClient` for the node service's HTTP API (its admin address,
    ``--admin``), e.g. ``connect_http("127.0.0.1:7400")`` or ``"http://node7:7400"``.

    Checks that the service answers (``GET /healthz`` within `timeout` seconds).

    Raises:
        ConnectError: nothing answers at `url` (the message names it), or the node refused the
            check (the message holds its code and message: e.g. ``forbidden`` for a request
            from the node's own host addressed to a host name other than ``localhost``).
        ValueError: `url` is not ``HOST:PORT`` / ``http://HOST:PORT`` (``https://`` included:
            the node's HTTP API is plain HTTP).
    """
    host, port, base = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        body = _read_body(r, "GET /healthz")
        if r.status != 200:
            raise ConnectError(base, _health_refusal(_Reply(r.status, r.headers, body)))
    except OSError as e:
        raise ConnectError(base, f"{e.strerror or e} (is `shardwire serve` running with --admin {host}:{port}?)") from e
    except http.client.HTTPException as e:
        raise ConnectError(base, f"not an HTTP server: {e!r}") from e
    except ProtocolError as e:
        raise ConnectError(base, f"GET /healthz: {e}") from e
    finally:
        conn.close()
    return HttpClient(base)


def _health_refusal(r: _Reply) -> str:
    """Why ``GET /healthz`` answered `r`, not 200: the node's own code and message where the
    body is its JSON error (a ``403 forbidden`` naming the Host it does not serve), else the
    status with a guess (something other than a node answers there)."""
    e = r.error()
    if isinstance(e, ServiceError):
        return f"GET /healthz answered HTTP {r.status} {e.code}: {e.message}"
    return f"GET /healthz answered HTTP {r.status}: is this a shardwire node's admin address?"


class HttpClient:
    """A node service's HTTP API. Cheap: it remembers the URL; every :meth:`open_stream` makes
    its own connection, so streams are independent (and may be used from different threads)."""

    def __init__(self, url: str) -> None:
        host, port, base = _split(url)
        #: Base URL, ``http://HOST:PORT``.
        self.url = base
        self._host, self._port = host, port

    def __repr__(self) -> str:
        return f"shardwire.HttpClient({self.url!r})"

    @document
    def open_stream(
        self, dataset: str | Mapping[str, float], *, idle_timeout: float | None = None, **options: Unpack[StreamKeywords]
    ) -> HttpStream:
        """Opens a stream of `dataset` for this rank: the same stream keywords as
        :meth:`shardwire.Client.open_stream` (the fields of :class:`shardwire.StreamOptions`,
        listed below from there; the HTTP body is the socket's ``attach`` fields), plus
        `idle_timeout`.

        Args:
            dataset: Dataset name, or a mixture (a mapping of dataset names to weights), as in
                :meth:`shardwire.Client.open_stream`.
            idle_timeout: Seconds without a request after which the service closes the
                stream (default: the service's, 300 s; at most ``MAX_IDLE_TIMEOUT``, 86400,
                rounded up to whole seconds). A stream that is not closed
                explicitly (``close()``, ``with``) lingers on the service until then.
            <stream keywords>

        Raises:
            TypeError: a keyword that is none of these (the message names it).
            ValueError: a value out of range, or a keyword without the one it needs (nothing
                is sent; the message names them).
            ConnectError: the service cannot be reached.
            ServiceError: the service refused (``unknown_dataset``, ``state_mismatch``, ...).
        """
        body = StreamOptions.of(options, "HttpClient.open_stream").attach_fields(dataset)
        if idle_timeout is not None:
            body["idle_timeout_s"] = _idle_timeout_s(idle_timeout)
        return HttpStream._open(self, body)


def _idle_timeout_s(idle_timeout: float) -> int:
    """`idle_timeout` as the whole seconds the service takes (rounded up): any number
    ``float()`` takes (int, float, ``Decimal``, ``Fraction``, a numpy scalar or 0-d array), but
    not a bool or a string.

    Raises:
        ValueError: not such a number, or not in ``(0, MAX_IDLE_TIMEOUT]`` (NaN and infinity
            included).
    """
    at_most = f"idle_timeout must be at most {MAX_IDLE_TIMEOUT} seconds (a day, the service's limit), not {idle_timeout!r}"
    if isinstance(idle_timeout, (bool, np.bool_, str, bytes, bytearray)):
        raise ValueError(f"idle_timeout must be a number of seconds, not {idle_timeout!r}")
    try:
        seconds = float(idle_timeout)
    except OverflowError:  # an int or a Decimal beyond float's range
        raise ValueError(at_most) from None
    except (TypeError, ValueError) as e:  # not a number; a signalling Decimal NaN
        raise ValueError(f"idle_timeout must be a number of seconds, not {idle_timeout!r}") from e
    if not seconds > 0:
        raise ValueError(f"idle_timeout must be > 0 seconds, not {idle_timeout!r}")
    if not seconds <= MAX_IDLE_TIMEOUT:
        raise ValueError(at_most)
    return max(1, math.ceil(seconds))


class HttpBatch(_BatchBase):
    """One batch taken over HTTP: a read-only mapping from tensor name to numpy array.

    Unlike a socket :class:`shardwire.Batch`, the arrays are **copies** downloaded from the
    service: writable, owned by this process and valid for as long as you keep them. The
    batch's lease was already released when :meth:`HttpStream.next` returned, so
    :attr:`released` is True, and :meth:`keep` / :meth:`release` / ``with batch:`` do nothing
    (they exist so code written for socket batches runs unchanged). Code that must run on
    both transports should not write to the arrays (socket arrays are read-only).

    ``pyarrow.record_batch(batch)`` works as for socket batches, zero-copy over these arrays.

    Attributes:
        lease: Lease id the service used (already released).
        epoch: Epoch of this batch.
        index: Index of this batch within its epoch (for this rank).
        shard: Shard index in the dataset's manifest.
        views: Name, dtype, shape and length of each tensor (``offset`` is -1: no region).
    """

    __slots__ = ()

    _NAME = "HttpBatch"

    @property
    def released(self) -> bool:
        """Always True: the lease ends as soon as the tensors are downloaded."""
        return True

    def keep(self) -> HttpBatch:
        """Accepted for API compatibility; the arrays are copies and stay valid anyway."""
        return super().keep()

    def release(self) -> None:
        """A no-op: the lease was released when the batch arrived."""


class _Reply:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes | bytearray) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return _loads(self.body, f"HTTP {self.status} answer {bytes(self.body[:200])!r} (expected JSON)")

    def error(self) -> ShardwireError:
        try:
            v = _loads(self.body, "error")
            return ServiceError(str(v["code"]), str(v["message"]))
        except (ProtocolError, KeyError, TypeError):
            return ProtocolError(f"HTTP {self.status}: {bytes(self.body[:200])!r}")


class HttpStream(_StreamBase[HttpBatch]):
    """A stream over HTTP: iterate it for :class:`HttpBatch` objects in plan order.

    Create with :meth:`HttpClient.open_stream`. :meth:`close` (or leaving ``with stream:``)
    closes it on the service; a stream that is never closed is closed by the service after
    its idle timeout (``info``: see :meth:`HttpClient.open_stream`). Methods are thread-safe
    (one request at a time on the stream's connection).

    Attributes:
        info: What the service said at open (``region_size`` is 0 and ``memory`` is
            ``"http"``: there is no shared region).
        idle_timeout: Seconds without a request after which the service closes the stream.
    """

    _NAME = "HttpStream"

    def __init__(self, client: HttpClient, info: StreamInfo, idle_timeout: int, conn: http.client.HTTPConnection) -> None:
        super().__init__(info)
        self._client = client
        self._conn: http.client.HTTPConnection | None = conn
        self.idle_timeout = idle_timeout
        # The lease of the last batch received (0: none yet), sent with every `next` as
        # `after`: a batch the node answered with that never arrived is answered again.
        self._received = 0
        #: A batch whose tensors are in but whose release an interrupt (or an error) struck:
        #: the node may have applied the release, and would then not answer it again; the
        #: next call releases it (again) and hands it out.
        self._unclaimed: HttpBatch | None = None

    @classmethod
    def _open(cls, client: HttpClient, body: dict[str, Any]) -> HttpStream:
        conn = http.client.HTTPConnection(client._host, client._port, timeout=IO_TIMEOUT)
        try:
            r = _call(conn, "POST", "/v1/streams", json.dumps(body).encode(), IO_TIMEOUT, retry=False)
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise ConnectError(client.url, str(e)) from e
        if r.status != 201:
            conn.close()
            raise r.error()
        try:
            v = r.json()
            info = StreamInfo(
                stream=_int(v["stream"], "stream"),
                region_size=0,
                batches_per_epoch=_int(v["batches_per_epoch"], "batches_per_epoch"),
                epochs=_int(v["epochs"], "epochs"),
                memory="http",
                state=dict(v["state"]),
            )
            idle = _int(v.get("idle_timeout_s", 300), "idle_timeout_s")
        except (KeyError, TypeError, ValueError, AttributeError, ProtocolError) as e:
            # A stream that opened, maybe: closed (best effort), as it cannot be used.
            conn.close()
            if isinstance(v := _maybe_json(r), dict) and isinstance(v.get("stream"), int):
                _close_on_service(client, v["stream"])
            raise ProtocolError(f"an answer to open this SDK cannot read ({e!r}): {r.body[:200]!r}") from e
        return cls(client, info, idle, conn)

    # --- requests ----------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, timeout: float, body: bytes | None = None, into: int | None = None, again: bool = False
    ) -> _Reply:
        """One request on the stream's connection (lock held). A failure to reach the service
        closes the stream, here and on the service (ConnectionClosed; see `_broken`). `again`: a request whose answer may be asked for twice (a `next` naming the
        last batch received) is sent once more on a new connection first."""
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._client._host, self._client._port, timeout=IO_TIMEOUT)
            try:
                # Not sent (again) once close() from another thread ended the connection.
                return _call(self._conn, method, path, body, timeout, into=into, stop=lambda: self._interrupted)
            except (OSError, http.client.HTTPException) as e:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if self._interrupted:
                    # close() ended the connection to wake this call, which closes the stream
                    # (on the service too) for it: a close() from a signal handler in this
                    # thread has returned already; one in another thread then finds it closed.
                    self._close_locked()
                    raise self._woken() from e
                if again and attempt == 0:
                    continue
                self._broken(f"the connection to the node service failed: {e}")
                raise ConnectionClosed(f"{self._client.url}: {e!r} ({method} {path})") from e
        raise AssertionError("unreachable: the second attempt returns or raises")

    def next(self, timeout: float | None = None) -> HttpBatch | None:
        """The next batch in plan order (its tensors downloaded), or None when every epoch was
        delivered.

        Args:
            timeout: Seconds to wait for the batch (None: as long as it takes, in long polls).

        Raises:
            Timeout: no batch within `timeout` (the stream stays usable).
            ServiceError: e.g. code ``"closed"`` if the service closed the stream,
                ``"not_found"`` if it was closed for being idle.
            ConnectionClosed: the service could not be reached (twice): the stream is closed,
                and the SDK has sent its close to the service (see ``close``).
        """
        return super().next(timeout)

    def _take(self, timeout: float | None) -> HttpBatch | None:
        if self._unclaimed is not None:
            return self._claim(self._unclaimed)
        left = None if timeout is None else _timeout_ms(timeout)
        while True:
            if self._interrupted:  # close() meanwhile, between two long polls
                self._close_locked()
                raise self._woken()
            wait = POLL_MS if left is None else min(left, POLL_MS)
            path = f"/v1/streams/{self.info.stream}/next?timeout_ms={wait}&after={self._received}"
            # Sent again once if the answer is lost: `after` gets the same batch back.
            r = self._request("POST", path, wait / 1000 + IO_TIMEOUT, again=True)
            if r.status == 204:
                if left is not None:
                    left -= wait
                    if left <= 0:
                        raise self._timeout(timeout)
                continue
            if r.status != 200:
                raise r.error()
            v = r.json()
            if not isinstance(v, dict):
                raise ProtocolError(f"an answer to next that is not an object: {r.body[:200]!r}")
            if v.get("end"):
                self._ended = True
                return None
            return self._download(v)

    def _download(self, v: dict[str, Any]) -> HttpBatch:
        lease, epoch, index, shard, views = _batch_fields(v)
        tensors: dict[str, np.ndarray] = {}
        # Until its tensors are in and its lease released, the batch is not received: an error
        # or an interrupt leaves the lease held and `after` naming the batch before it, so the
        # next `next` gets this batch again and loses nothing (releasing it would skip it).
        for tv in views:
            dt = _sized_dtype(tv)
            path = f"/v1/leases/{lease}/tensors/{urllib.parse.quote(tv.name, safe='')}"
            r = self._get_tensor(path, tv.length)
            if r.status != 200:
                raise r.error()
            if len(r.body) != tv.length:
                raise ProtocolError(f"tensor {tv.name!r}: {len(r.body)} bytes arrived, the batch says {tv.length}")
            tensors[tv.name] = np.frombuffer(r.body, dtype=dt).reshape(tv.shape)
        self._unclaimed = HttpBatch(lease, epoch, index, shard, views, tensors)
        return self._claim(self._unclaimed)

    def _claim(self, b: HttpBatch) -> HttpBatch:
        """Releases the downloaded batch `b` and hands it out. Its release is sent again once
        on a new connection if the answer is lost, and a release the node applied already (then,
        or before an interrupt struck) answers `unknown_lease`: it is released. Until the
        release is answered, `b` stays unclaimed for the next call."""
        # `stream`: a release sent again late (after an interrupt, across a node restart, when
        # lease numbers start again) never releases another stream's lease.
        path = f"/v1/leases/{b.lease}/release?stream={self.info.stream}"
        r = self._request("POST", path, IO_TIMEOUT, again=True)
        if r.status != 200:
            e = r.error()
            if not (isinstance(e, ServiceError) and e.code == "unknown_lease"):
                raise e
        self._received, self._unclaimed = b.lease, None
        return b

    def _get_tensor(self, path: str, length: int) -> Any:
        """A tensor's download. The node's copy budget full (`503` `unavailable`, after it
        waited 10 s for room: other clients read slowly) is tried again, up to
        COPY_ATTEMPTS times in all: failing the batch would lose it, since the node has
        moved past it."""
        # A GET is asked again once on a new connection when its answer is lost (a reset,
        # a body cut off): before, one lost answer closed the stream here.
        for _ in range(COPY_ATTEMPTS - 1):
            r = self._request("GET", path, IO_TIMEOUT, into=length, again=True)
            if r.status != 503:
                return r
            e = r.error()
            if not isinstance(e, ServiceError) or e.code != "unavailable":
                return r
        return self._request("GET", path, IO_TIMEOUT, into=length, again=True)

    def _state(self) -> dict[str, Any]:
        # `after`: a batch answered but not yet handed out (its download failed, or an
        # interrupt struck while it was released) is not counted as taken.
        path = f"/v1/streams/{self.info.stream}/state?after={self._received}"
        r = self._request("GET", path, IO_TIMEOUT, again=True)
        if r.status != 200:
            raise r.error()
        state = r.json()
        if not isinstance(state, dict):
            raise ProtocolError(f"the stream's state is {state!r}, not a JSON object")
        return state

    def _broken(self, why: str) -> None:
        """A request failed on both of its attempts: the stream is closed here and, unlike the
        socket's (whose connection is the stream), on the service too. The node is usually
        still reachable (a download cut on a slow link, a proxy's reset): left open there, the
        stream would hold its memory and leased batch until its idle timeout, beside the one
        that resumes it from a saved state (which the node could then refuse, ``no_memory``).
        The close goes on a connection of its own within CLOSE_TIMEOUT, a failure ignored
        (then the service closes it after its idle timeout). Lock held."""
        self._closed_why = why
        self._close_locked(notify=True)

    def close(self) -> None:
        """Closes the stream on the service (``POST /v1/streams/{id}/close``). Idempotent;
        batches already taken stay valid (they are copies). A failure to reach the service
        within ``CLOSE_TIMEOUT`` (10 s in all: connecting, to each of the host's addresses in
        turn, sending and reading the answer; a slow host-name lookup eats into it, though the
        resolver's own timeouts, not this one, bound the lookup) is
        ignored: it closes the stream after its idle timeout. A request that could not reach
        the service (``ConnectionClosed``) has sent this close already, the same way; a close()
        after it does nothing more."""
        super().close()

    def _drop_in_child(self) -> None:
        if self._conn is not None:
            self._conn.close()  # this process's socket only; the service is not told
            self._conn = None

    def _interrupt(self) -> None:
        # A call waiting for an answer (a long poll of up to POLL_MS) sees its connection end
        # at once and raises `closed`; close() then tells the service on a new connection.
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _shutdown(self, notify: bool) -> None:
        self._interrupted = False  # the call `_interrupt` woke has let go: this holds the lock
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if notify:
            # On a connection of its own, which no `_interrupt` can shut down (another close()
            # meanwhile), never stopped: the close must reach the service.
            _close_on_service(self._client, self.info.stream)

    def _repr_where(self) -> str:
        return f" {self._client.url}"


def _close_on_service(client: HttpClient, stream: int) -> None:
    """``POST /v1/streams/{stream}/close`` on a connection of its own that ends within
    CLOSE_TIMEOUT in all: a host that drops packets, or answers a byte at a time, must not hold
    close() (and the exception leaving ``with stream:``) longer. A failure is ignored: the
    service closes the stream after its idle timeout."""
    conn = _DeadlineConnection(client._host, client._port, CLOSE_TIMEOUT)
    try:
        _call(conn, "POST", f"/v1/streams/{stream}/close", b"", CLOSE_TIMEOUT, retry=False)
    except (OSError, http.client.HTTPException, ShardwireError):
        pass
    finally:
        conn.close()


class _DeadlineSocket(socket.socket):
    """A socket whose sends and receives all end by its `deadline` (``time.monotonic()``): each
    waits only for the time left, so bytes trickling in cannot stretch the wait as a
    per-receive timeout lets them (``http.client`` reads an answer in many receives)."""

    deadline: float | None = None

    def _wait_left(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self.settimeout(left)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._wait_left()
        super().sendall(data, flags)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._wait_left()
        return super().recv_into(buffer, nbytes, flags)


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection that connects, sends and reads within `seconds` in all (from its
    creation). ``socket.create_connection`` would wait the timeout for each address of the host
    in turn (an IPv6 and an IPv4 one: twice), and the socket timeout applies to each receive."""

    def __init__(self, host: str, port: int, seconds: float) -> None:
        super().__init__(host, port, timeout=seconds)
        self._deadline = time.monotonic() + seconds

    def connect(self) -> None:
        self.sock = _connect_by(self.host, self.port, self._deadline)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _connect_by(host: str, port: int, deadline: float) -> _DeadlineSocket:
    """A TCP connection to `host`:`port` made by `deadline` (``time.monotonic()``), trying each
    address the name resolves to in turn with the time left; its later sends and receives end
    by `deadline` too. The error of the last attempt, or TimeoutError once no time is left."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        left = deadline - time.monotonic()
        if left <= 0:
            error = TimeoutError(f"no connection to {host}:{port} in the time allowed")
            break
        sock = _DeadlineSocket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
        except OSError as e:
            sock.close()
            error = e
            continue
        sock.deadline = deadline
        return sock
    raise error if error is not None else OSError(f"{host}:{port} resolves to no address")


def _batch_fields(v: dict[str, Any]) -> tuple[int, int, int, int, list[TensorView]]:
    """(lease, epoch, index, shard, views) of a batch answer `v`, read before any download; a
    field missing or of the wrong type is a ProtocolError naming it (as on the socket)."""
    try:
        lease, epoch, index, shard = (_int(v[k], k) for k in ("lease", "epoch", "index", "shard"))
        tensors = v["tensors"]
        if not isinstance(tensors, list):
            raise ProtocolError(f"the field tensors is {tensors!r}, not a list")
        return lease, epoch, index, shard, [_tensor_view(t, offset=-1) for t in tensors]
    except KeyError as e:
        raise ProtocolError(f"a batch answer without the field {e}: {v!r}") from e
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"a batch answer with a field this SDK cannot read ({e}): {v!r}") from e


#: The first allocation of a body read with `_read_exactly`; it doubles as bytes arrive.
_FIRST_READ = 1 << 20


def _read_exactly(r: http.client.HTTPResponse, n: int) -> bytearray:
    """The `n` bytes of `r`'s body in a writable bytearray that grows as they arrive (at most
    twice what arrived so far): a length the service claims is not allocated ahead of its bytes."""
    data = bytearray(min(n, _FIRST_READ))
    got = 0
    while got < n:
        if got == len(data):
            data.extend(bytes(min(len(data), n - len(data))))
        with memoryview(data) as whole, whole[got:] as rest:  # released before `data` grows
            k = r.readinto(rest)
        if not k:
            raise http.client.IncompleteRead(bytes(data[:got]), n - got)
        got += k
    return data


#: The largest answer other than a tensor's bytes (JSON, an error, the metrics text).
_MAX_REPLY = 64 << 20


def _read_body(r: http.client.HTTPResponse, what: str) -> bytes:
    """`r`'s whole body (at most `_MAX_REPLY` bytes) read in pieces of at most 64 KiB, so
    memory follows the bytes that arrive (``r.read()`` would first allocate what the
    Content-Length or a chunk size claims)."""
    n = r.getheader("Content-Length")
    if n is not None and n.isdigit() and int(n) > _MAX_REPLY:
        r.close()
        raise ProtocolError(f"{what}: the answer's Content-Length is {n}; at most {_MAX_REPLY} bytes are expected")
    body = bytearray()
    while piece := r.read(1 << 16):
        body += piece
        if len(body) > _MAX_REPLY:
            r.close()
            raise ProtocolError(f"{what}: the answer is over {_MAX_REPLY} bytes")
    if n is not None and n.isdigit() and len(body) < int(n):
        # The connection ended inside the answer (http.client's read(amt) does not say so):
        # a broken connection, not a malformed answer.
        raise http.client.IncompleteRead(bytes(body), int(n) - len(body))
    return bytes(body)


def _call(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None,
    timeout: float,
    retry: bool = True,
    into: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> _Reply:
    """Sends a request on `conn` and reads the whole answer (with `into`, a successful answer
    must be that many bytes, read into a writable bytearray). A kept-alive connection found
    closed is reopened and the request sent once more (if `retry`). Once `stop` returns true
    (another thread ended the connection to wake this call) the request is not sent, nor sent
    again: ConnectionAbortedError."""
    for attempt in (0, 1):
        reused = conn.sock is not None
        try:
            if conn.sock is None:
                conn.connect()
            if stop is not None and stop():
                # Checked after the connection exists: whoever set it, then shut down the
                # connection it found, either saw this one or is seen here.
                conn.close()
                raise ConnectionAbortedError("the request was stopped before it was sent")
            assert conn.sock is not None
            conn.sock.settimeout(timeout)
            headers = {"Content-Type": "application/json"} if body is not None or method == "POST" else {}
            conn.request(method, path, body=body if body is not None else (b"" if method == "POST" else None), headers=headers)
            r = conn.getresponse()
        except _STALE:
            conn.close()
            if retry and reused and attempt == 0 and not (stop is not None and stop()):
                continue
            raise
        data: bytes | bytearray
        if into is not None and r.status == 200:
            n = r.getheader("Content-Length")
            if n != str(into):
                conn.close()  # the rest of this answer is not read: the connection is spent
                raise ProtocolError(f"{method} {path}: the answer's Content-Length is {n}, the batch says {into} bytes")
            data = _read_exactly(r, into)
            r.read()  # completes the response so the connection can be reused
        else:
            try:
                data = _read_body(r, f"{method} {path}")
            except ProtocolError:
                conn.close()  # the rest of this answer is not read: the connection is spent
                raise
        if r.will_close:
            conn.close()
        return _Reply(r.status, r.headers, data)
    raise AssertionError("unreachable")
