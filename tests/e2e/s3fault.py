"""A fault-injecting HTTP/1.1 reverse proxy for the S3 tests (in front of s3server.S3Server).

:class:`FaultProxy` listens on 127.0.0.1 (a free port) and runs in daemon threads of the test
process: one accept thread, one thread per client connection. Each request is forwarded
byte-for-byte (request line, headers including the client's ``Host`` so SigV4 still verifies
at moto, body), and each response comes back byte-for-byte, bodies streamed in chunks of at
most :data:`CHUNK` bytes (never buffered whole). Content-Length, chunked and read-until-close
bodies are handled in both directions, and ``Expect: 100-continue`` is passed through.

Keep-alive: moto (werkzeug) answers every request with ``Connection: close``. With
``keep_alive=True`` (the default) the proxy keeps the *client's* connection open like real S3
does: it drops that hop-by-hop header from delimited responses and opens a new upstream
connection for the next request. Connection headers are the only change it makes to a
forwarded response (it also adds ``Connection: close`` where it will close the client's
connection: an HTTP/1.0 client, a client that asked, a body delimited by the close).
With ``keep_alive=False`` moto's header passes unchanged and clients reconnect every time.

Faults are armed from the test and apply to the next ``n`` matching requests (by method,
default GET; ``None`` = any; optionally a substring of the URL-decoded path, i.e.
``/bucket/key``). The proxy takes, for each request, the first armed fault (in arming order)
that matches and still has requests left. Answered by the proxy, without contacting moto:

- :meth:`FaultProxy.slowdown`: 503 ``SlowDown`` (or 429 ``TooManyRequests``), optional
  ``Retry-After``;
- :meth:`FaultProxy.status`: any S3 error (500 InternalError, 403 AccessDenied, ...).

Applied to moto's real response:

- :meth:`FaultProxy.reset_mid_body`: the head and ``after`` body bytes, then, once the client
  has acknowledged them (at most :data:`RESET_DRAIN` s), a TCP reset (``SO_LINGER`` 0 close);
- :meth:`FaultProxy.stall`: the head and ``after`` body bytes, then nothing for ``seconds``,
  then a plain close;
- :meth:`FaultProxy.flip_byte`: the byte at body offset ``offset`` XOR 0xFF (if the body is
  that long), everything else exact.

Body offsets and byte counts are payload bytes (for chunked bodies, without the framing).

Every request is logged (:class:`Exchange`: method, path, query, headers, range, if-match,
whether it was signed, status, body bytes each way, fault, connection); :meth:`requests`,
:meth:`count`, :meth:`bytes_sent`, :meth:`reset_log`, :meth:`wait_idle`. A record is in the log as soon as the
request head has arrived; its status is set before the response head is sent and its byte
counts before the bytes are sent, so a client that has read a response sees its record final.
"""

from __future__ import annotations

import dataclasses
import email.utils
import fcntl
import itertools
import select
import socket
import struct
import termios
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

#: Largest piece read or written at once (bodies stream through in pieces of at most this).
CHUNK = 256 * 1024
#: How often a blocked thread checks whether the proxy is stopping, in seconds.
POLL = 0.2
#: Bound of every wait on moto (connect excepted) and on a client mid-request, in seconds.
WAIT = 60.0
CONNECT_TIMEOUT = 5.0
#: Longest request or response head the proxy accepts.
MAX_HEAD = 64 * 1024
#: How long reset_mid_body waits for the client to acknowledge the bytes it was sent before
#: the reset (which would discard any still queued in the proxy's socket).
RESET_DRAIN = 10.0
#: How long the proxy waits for moto's ``100 Continue`` before sending the body anyway.
EXPECT_WAIT = 1.0

S3_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "TooManyRequests": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "AccessDenied": "Access Denied",
    "NoSuchKey": "The specified key does not exist.",
}
REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 412: "Precondition Failed", 429: "Too Many Requests",
           500: "Internal Server Error", 502: "Bad Gateway", 503: "Slow Down", 504: "Gateway Timeout"}


class ProxyError(RuntimeError):
    """A problem with the proxy itself (cannot start, bad arguments)."""


class _Closed(Exception):
    """The peer closed, the proxy is stopping, or a wait ran out: drop the connection."""


class _Cut(Exception):
    """A fault ended the response early (reset or stall)."""


@dataclass
class Fault:
    """One armed fault: applies to the next `remaining` requests matching `method`/`key`.
    `applied` counts the requests it has hit (read it from the test)."""

    kind: str
    remaining: int
    method: str | None
    key: str | None
    params: dict[str, Any]
    applied: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (self.key is None or self.key in path)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.kind}({args})" if args else self.kind


@dataclass
class Exchange:
    """One request through the proxy and what came of it.

    `path` is the URL-decoded path (``/bucket/key``), `query` the raw query string, `headers`
    the request headers (lower-case names; repeated ones joined with ", "), `status` the
    status sent to the client (None if none was), `request_bytes` / `response_bytes` the body
    payload bytes received from the client / sent to it, `fault` the applied fault's
    description, `error` what went wrong in the proxy (upstream unreachable, client gone, ...),
    `conn` the client connection's serial number and `seq` the request's number on it (from 1),
    `done` whether the proxy has finished with it."""

    id: int
    conn: int
    seq: int
    method: str
    path: str
    query: str
    headers: dict[str, str]
    status: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    fault: str | None = None
    error: str | None = None
    done: bool = False
    started: float = 0.0
    ended: float | None = None

    @property
    def range(self) -> str | None:
        return self.headers.get("range")

    @property
    def if_match(self) -> str | None:
        return self.headers.get("if-match")

    @property
    def signed(self) -> bool:
        """Whether the request carried an ``Authorization`` header."""
        return "authorization" in self.headers

    @property
    def key(self) -> str:
        """The object key of a path-style request (the path after ``/bucket/``)."""
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) == 2 else ""


class _Stream:
    """A socket with a read buffer. Every blocking call polls every :data:`POLL` seconds,
    gives up with :class:`_Closed` when the proxy stops or after its limit."""

    def __init__(self, sock: socket.socket, stop: threading.Event, what: str):
        self.sock = sock
        self.stop = stop
        self.what = what
        self.buf = bytearray()
        sock.settimeout(POLL)

    def _fill(self, limit: float) -> bool:
        """Reads more into the buffer; False at EOF. Raises _Closed on stop or timeout."""
        deadline = time.monotonic() + limit
        while True:
            if self.stop.is_set():
                raise _Closed("proxy stopping")
            try:
                data = self.sock.recv(CHUNK)
            except socket.timeout:
                if time.monotonic() >= deadline:
                    raise _Closed(f"{self.what}: nothing received for {limit:.0f}s") from None
                continue
            except OSError as e:
                raise _Closed(f"{self.what}: {e!r}") from None
            if not data:
                return False
            self.buf += data
            return True

    def read_head(self, limit: float) -> bytes | None:
        """Bytes up to and including the blank line ending an HTTP head; None at a clean EOF
        before any byte."""
        start = 0
        while True:
            end = self.buf.find(b"\r\n\r\n", start)
            if end >= 0:
                head = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return head
            if len(self.buf) > MAX_HEAD:
                raise _Closed(f"{self.what}: head longer than {MAX_HEAD} bytes")
            start = max(0, len(self.buf) - 3)
            if not self._fill(limit):
                if self.buf:
                    raise _Closed(f"{self.what}: closed in the middle of a head")
                return None

    def readline(self, limit: float) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[: end + 1])
                del self.buf[: end + 1]
                return line
            if len(self.buf) > MAX_HEAD:
                raise _Closed(f"{self.what}: line longer than {MAX_HEAD} bytes")
            if not self._fill(limit):
                raise _Closed(f"{self.what}: closed in the middle of a line")

    def read_some(self, n: int, limit: float, eof_ok: bool = False) -> bytes:
        """Up to `n` (> 0) bytes, at least one; b"" at EOF only if `eof_ok`."""
        if not self.buf and not self._fill(limit):
            if eof_ok:
                return b""
            raise _Closed(f"{self.what}: closed in the middle of a body")
        take = bytes(self.buf[:n])
        del self.buf[:n]
        return take

    def readable_now(self) -> bool:
        if self.buf:
            return True
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(r)

    def wait_readable(self, limit: float) -> bool:
        if self.buf:
            return True
        try:
            r, _, _ = select.select([self.sock], [], [], limit)
        except (OSError, ValueError):
            return True
        return bool(r)

    def send(self, data: bytes | memoryview, limit: float = WAIT) -> None:
        """Sends everything; raises _Closed if the peer is gone, the proxy stops, or the peer
        accepts nothing for `limit` seconds."""
        mv = memoryview(data)
        deadline = time.monotonic() + limit
        while mv:
            if self.stop.is_set():
                raise _Closed("proxy stopping")
            try:
                n = self.sock.send(mv[:CHUNK])
            except socket.timeout:
                if time.monotonic() >= deadline:
                    raise _Closed(f"{self.what}: accepted nothing for {limit:.0f}s") from None
                continue
            except OSError as e:
                raise _Closed(f"{self.what}: {e!r}") from None
            mv = mv[n:]
            deadline = time.monotonic() + limit

    def drain(self, limit: float) -> bool:
        """Waits (up to `limit` seconds) until the peer has acknowledged every byte sent, so that
        a reset right after cannot discard data still queued here. True once drained."""
        deadline = time.monotonic() + limit
        while not self.stop.is_set():
            try:
                queued = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:
                return False
            if queued == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return False

    def close(self, reset: bool = False) -> None:
        try:
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
        except OSError:
            pass


@dataclass
class _Link:
    """The upstream connection of one client connection (None between connections)."""

    up: _Stream | None = None


@dataclass
class _Head:
    raw: bytes
    first: str
    headers: list[tuple[str, str]] = field(default_factory=list)

    def get(self, name: str) -> str | None:
        vals = [v for k, v in self.headers if k.lower() == name]
        return ", ".join(vals) if vals else None

    def tokens(self, name: str) -> set[str]:
        v = self.get(name)
        return {t.strip().lower() for t in v.split(",")} if v else set()

    def framing(self) -> tuple[str, int]:
        """("chunked", 0), ("length", n) or ("none", 0) for a request body."""
        te = self.get("transfer-encoding")
        if te and te.split(",")[-1].strip().lower() == "chunked":
            return "chunked", 0
        cl = self.get("content-length")
        if cl is not None:
            try:
                n = int(cl.split(",")[0].strip())
            except ValueError:
                raise _Closed(f"bad Content-Length {cl!r}") from None
            return "length", n
        return "none", 0

    def without_connection_close(self) -> bytes:
        """The raw head without ``Connection: close`` lines (everything else byte-exact)."""
        lines = self.raw[:-4].split(b"\r\n")
        kept = [lines[0]] + [ln for ln in lines[1:] if not (ln.split(b":", 1)[0].strip().lower() == b"connection"
                                                           and ln.split(b":", 1)[-1].strip().lower() == b"close")]
        return b"\r\n".join(kept) + b"\r\n\r\n"


def _parse_head(raw: bytes, what: str) -> _Head:
    lines = raw[:-4].decode("latin-1").split("\r\n")
    head = _Head(raw=raw, first=lines[0])
    for ln in lines[1:]:
        if ":" not in ln:
            raise _Closed(f"{what}: malformed header line {ln!r}")
        k, v = ln.split(":", 1)
        head.headers.append((k.strip(), v.strip()))
    return head


def _s3_error(status: int, code: str, message: str, resource: str, retry_after: float | None = None,
              close: bool = False, head_only: bool = False) -> tuple[bytes, bytes]:
    """(head, body) of an S3-style XML error response."""
    rid = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{_xml(code)}</Code><Message>{_xml(message)}</Message><Resource>{_xml(resource)}</Resource>"
        f"<RequestId>{rid}</RequestId><HostId>shardwire-s3fault</HostId></Error>"
    ).encode()
    hdrs = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
        "Content-Type: application/xml",
        f"Content-Length: {len(body)}",
        f"Date: {email.utils.formatdate(usegmt=True)}",
        "Server: AmazonS3",
        f"x-amz-request-id: {rid}",
        "x-amz-id-2: shardwire-s3fault",
    ]
    if retry_after is not None:
        hdrs.append(f"Retry-After: {retry_after:g}")
    if close:
        hdrs.append("Connection: close")
    return ("\r\n".join(hdrs) + "\r\n\r\n").encode(), (b"" if head_only else body)


def _xml(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class _BodyTap:
    """Counts, and for faults alters or cuts, the payload of a response body on its way to
    the client."""

    def __init__(self, fault: Fault | None, record: Callable[[int], None]):
        self.pos = 0
        self.flip = fault.params["offset"] if fault is not None and fault.kind == "flip_byte" else None
        self.cut = fault.params["after"] if fault is not None and fault.kind in ("reset_mid_body", "stall") else None
        self.record = record

    def emit(self, data: bytes, out: _Stream) -> None:
        """Sends payload `data`; raises _Cut once the cut point is reached."""
        if self.cut is not None and self.pos + len(data) >= self.cut:
            data = data[: self.cut - self.pos]
            if data:
                self._send(data, out)
            raise _Cut()
        self._send(data, out)

    def _send(self, data: bytes, out: _Stream) -> None:
        if self.flip is not None and self.pos <= self.flip < self.pos + len(data):
            b = bytearray(data)
            b[self.flip - self.pos] ^= 0xFF
            data = bytes(b)
        self.pos += len(data)
        self.record(len(data))
        out.send(data)


class FaultProxy:
    """The proxy (see the module docstring). `upstream` is an :class:`s3server.S3Server`
    (then :meth:`env` and :meth:`client` work) or an ``http://HOST:PORT`` endpoint.
    `keep_alive`: keep client connections open although moto closes its side; `idle_timeout`:
    seconds an idle client connection is kept."""

    def __init__(self, upstream: Any, *, keep_alive: bool = True, idle_timeout: float = 600.0):
        self.server = None if isinstance(upstream, str) else upstream
        url = urllib.parse.urlsplit(upstream if isinstance(upstream, str) else upstream.endpoint)
        if url.scheme != "http" or not url.hostname or not url.port:
            raise ProxyError(f"upstream must be http://HOST:PORT, not {upstream!r}")
        self.upstream_addr = (url.hostname, url.port)
        self.keep_alive = keep_alive
        self.idle_timeout = idle_timeout
        self.port = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._socks: set[socket.socket] = set()
        self._faults: list[Fault] = []
        self._log: list[Exchange] = []
        self._ids = itertools.count(1)
        self._conns = itertools.count(1)
        self._accept_thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        if self._listener is not None:
            raise ProxyError("proxy already started")
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", 0))
        ls.listen(512)
        ls.settimeout(POLL)
        self._listener = ls
        self.port = ls.getsockname()[1]
        self._stop.clear()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"s3fault-accept-{self.port}", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops accepting, closes every connection and joins the threads (bounded by
        `timeout`). Idempotent."""
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        with self._lock:
            socks = list(self._socks)
            threads = list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads + ([self._accept_thread] if self._accept_thread else []):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            left, self._socks = list(self._socks), set()
        for s in left:  # threads that did not finish in time: their sockets close anyway
            try:
                s.close()
            except OSError:
                pass
        self._listener = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- clients ---------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The server's :meth:`S3Server.env` with ``AWS_ENDPOINT_URL`` pointing at the proxy."""
        if self.server is None:
            raise ProxyError("env() needs a proxy made over an S3Server")
        return self.server.env(endpoint=self.endpoint)

    def client(self, **kw: Any):
        """The server's boto3 client (path style, no retries) through the proxy."""
        if self.server is None:
            raise ProxyError("client() needs a proxy made over an S3Server")
        return self.server.client(endpoint=self.endpoint, **kw)

    # --- faults ----------------------------------------------------------------------------

    def _arm(self, kind: str, n: int, method: str | None, key: str | None, **params: Any) -> Fault:
        if n < 1:
            raise ProxyError(f"{kind}: n must be >= 1, not {n}")
        f = Fault(kind, n, method.upper() if method else None, key, params)
        with self._lock:
            self._faults.append(f)
        return f

    def slowdown(self, n: int = 1, status: int = 503, retry_after: float | None = None, *,
                 method: str | None = "GET", key: str | None = None) -> Fault:
        """The next `n` matching requests get 503 ``SlowDown`` (or, with ``status=429``, 429
        ``TooManyRequests``), with ``Retry-After: retry_after`` if given; moto never sees them."""
        if status not in (503, 429):
            raise ProxyError(f"slowdown: status must be 503 or 429, not {status}")
        code = "SlowDown" if status == 503 else "TooManyRequests"
        return self._arm("slowdown", n, method, key, status=status, code=code, retry_after=retry_after)

    def status(self, n: int, code: int, s3_code: str, message: str | None = None, *,
               method: str | None = "GET", key: str | None = None) -> Fault:
        """The next `n` matching requests get HTTP `code` with S3 error `s3_code` (e.g. 500
        InternalError, 403 AccessDenied, 404 NoSuchKey); moto never sees them."""
        return self._arm("status", n, method, key, status=code, code=s3_code,
                         message=message or S3_MESSAGES.get(s3_code, s3_code))

    def reset_mid_body(self, n: int = 1, after: int = 0, *, method: str | None = "GET", key: str | None = None) -> Fault:
        """The next `n` matching requests are forwarded; the client gets the response head and
        the first `after` body bytes (all of them, if it reads them within :data:`RESET_DRAIN`
        seconds), then a TCP reset. A body of at most `after` bytes arrives whole, then the reset."""
        return self._arm("reset_mid_body", n, method, key, after=int(after))

    def stall(self, n: int = 1, after: int = 0, seconds: float = 5.0, *, method: str | None = "GET",
              key: str | None = None) -> Fault:
        """The next `n` matching requests are forwarded; the client gets the head and `after`
        body bytes, then nothing for `seconds`, then the connection closes (FIN). A body of at
        most `after` bytes arrives whole; the stall and close follow it."""
        return self._arm("stall", n, method, key, after=int(after), seconds=float(seconds))

    def flip_byte(self, n: int = 1, offset: int = 0, *, method: str | None = "GET", key: str | None = None) -> Fault:
        """The next `n` matching requests are forwarded with the response body byte at
        `offset` XOR 0xFF (no change if the body is shorter)."""
        return self._arm("flip_byte", n, method, key, offset=int(offset))

    def clear(self) -> None:
        """Disarms every fault."""
        with self._lock:
            self._faults.clear()

    def armed(self) -> list[Fault]:
        with self._lock:
            return [dataclasses.replace(f) for f in self._faults]

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.remaining > 0 and f.matches(method, path):
                    f.remaining -= 1
                    f.applied += 1
                    if f.remaining == 0:
                        self._faults.remove(f)
                    return f
        return None

    # --- the log ---------------------------------------------------------------------------

    def requests(self, method: str | None = None, key: str | None = None, status: int | None = None) -> list[Exchange]:
        """Copies of the logged exchanges, oldest first, filtered by method, a substring of the
        decoded path, and status."""
        with self._lock:
            out = [dataclasses.replace(e, headers=dict(e.headers)) for e in self._log]
        return [e for e in out if (method is None or e.method == method.upper())
                and (key is None or key in e.path) and (status is None or e.status == status)]

    def count(self, method: str | None = None, key: str | None = None, status: int | None = None) -> int:
        return len(self.requests(method, key, status))

    def bytes_sent(self, method: str | None = None, key: str | None = None) -> int:
        """Response body bytes sent to clients, over the matching logged exchanges."""
        return sum(e.response_bytes for e in self.requests(method, key))

    def reset_log(self) -> None:
        with self._lock:
            self._log.clear()

    def wait_idle(self, timeout: float = WAIT) -> None:
        """Waits until every logged exchange is done (raises AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = [e for e in self._log if not e.done]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"proxy still busy after {timeout}s with {busy}")
            time.sleep(0.01)

    def _update(self, ex: Exchange, **kw: Any) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(ex, k, v)

    def _add(self, ex: Exchange, field_name: str, n: int) -> None:
        with self._lock:
            setattr(ex, field_name, getattr(ex, field_name) + n)

    # --- the connection loop ---------------------------------------------------------------

    def _accept_loop(self) -> None:
        ls = self._listener
        assert ls is not None
        while not self._stop.is_set():
            try:
                s, _ = ls.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(s, next(self._conns)), name=f"s3fault-{self.port}", daemon=True)
            with self._lock:
                if self._stop.is_set():
                    s.close()
                    break
                self._socks.add(s)
                self._threads.add(t)
            t.start()

    def _serve(self, csock: socket.socket, conn: int) -> None:
        client = _Stream(csock, self._stop, "client")
        link = _Link()
        reset = False
        try:
            for seq in itertools.count(1):
                raw = client.read_head(self.idle_timeout)
                if raw is None:
                    return
                req = _parse_head(raw, "client")
                parts = req.first.split(" ")
                if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                    client.send(_s3_error(400, "BadRequest", "Malformed request line", "", close=True)[0])
                    return
                method, target, version = parts
                split = urllib.parse.urlsplit(target)
                ex = Exchange(
                    id=next(self._ids), conn=conn, seq=seq, method=method, path=urllib.parse.unquote(split.path),
                    query=split.query, headers={k.lower(): v for k, v in _merged(req.headers).items()}, started=time.monotonic(),
                )
                with self._lock:
                    self._log.append(ex)
                fault = self._take_fault(method, ex.path)
                if fault is not None:
                    self._update(ex, fault=fault.describe())
                try:
                    keep, reset = self._exchange(client, link, req, method, version, ex, fault)
                except _Closed as e:
                    self._update(ex, error=str(e))
                    return
                finally:
                    self._update(ex, done=True, ended=time.monotonic())
                if not keep:
                    return
        except _Closed:
            return
        finally:
            self._drop(link)
            self._forget(csock)
            client.close(reset=reset)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _drop(self, link: _Link) -> None:
        """Closes the upstream connection of `link`, if any."""
        if link.up is not None:
            self._forget(link.up.sock)
            link.up.close()
            link.up = None

    def _forget(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.discard(s)

    def _connect(self) -> _Stream:
        try:
            s = socket.create_connection(self.upstream_addr, timeout=CONNECT_TIMEOUT)
        except OSError as e:
            raise ConnectionError(f"upstream {self.upstream_addr[0]}:{self.upstream_addr[1]}: {e!r}") from None
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks.add(s)
        return _Stream(s, self._stop, "upstream")

    def _exchange(self, client: _Stream, link: _Link, req: _Head, method: str, version: str,
                  ex: Exchange, fault: Fault | None) -> tuple[bool, bool]:
        """Handles one request; returns (keep the client connection, reset it on close).
        `link.up` is the upstream connection (None: connect), kept there for the next request
        or closed and set to None."""
        framing, length = req.framing()
        expect = "100-continue" in req.tokens("expect")
        client_keep = version == "HTTP/1.1" and "close" not in req.tokens("connection")
        record_in: Callable[[int], None] = lambda n: self._add(ex, "request_bytes", n)  # noqa: E731

        if fault is not None and fault.kind in ("slowdown", "status"):
            p = fault.params
            if expect:
                client_keep = False  # the client never sends the body: close after the answer
            else:
                _pump_body(client, None, framing, length, record_in)
            head, body = _s3_error(p["status"], p["code"], p.get("message") or S3_MESSAGES[p["code"]], ex.path,
                                   retry_after=p.get("retry_after"), close=not client_keep, head_only=method == "HEAD")
            self._update(ex, status=p["status"])
            client.send(head)
            if body:
                self._add(ex, "response_bytes", len(body))
                client.send(body)
            return client_keep, False

        body_pending = framing != "none" and (framing == "chunked" or length > 0)
        resp: _Head | None = None
        for attempt in (1, 2):
            if link.up is not None and link.up.readable_now():  # the server closed it (moto always does)
                self._drop(link)
            reused = link.up is not None
            if link.up is None:
                try:
                    link.up = self._connect()
                except ConnectionError as e:
                    self._update(ex, error=str(e), status=502)
                    head, body = _s3_error(502, "BadGateway", "The proxy could not reach the server", ex.path,
                                           close=True, head_only=method == "HEAD")
                    client.send(head + body)
                    return False, False
            if body_pending or not reused:
                link.up.send(req.raw)
                break
            # A body-less request on a reused connection: if the server closed it meanwhile,
            # send the request again on a new one.
            try:
                link.up.send(req.raw)
                resp = self._read_response_head(link.up)
                break
            except _Closed:
                if attempt == 2 or self._stop.is_set():
                    raise
                self._drop(link)
        if body_pending and expect:
            if link.up.wait_readable(EXPECT_WAIT):
                resp = self._read_response_head(link.up)
                if _status_of(resp) == 100:
                    client.send(resp.raw)
                    resp = None
                else:  # a final answer before the body: the client will not send it
                    client_keep = False
                    body_pending = False
        if body_pending:
            _pump_body(client, link.up, framing, length, record_in)
        while resp is None or 100 <= _status_of(resp) < 200:
            if resp is not None:
                client.send(resp.raw)  # interim responses pass through
            resp = self._read_response_head(link.up)
        status = _status_of(resp)

        # How the response body is delimited.
        if method == "HEAD" or status in (204, 304):
            rframing, rlength = "none", 0
        else:
            rframing, rlength = resp.framing()
            if rframing == "none":
                rframing = "eof"
        up_keep = resp.first.startswith("HTTP/1.1") and "close" not in resp.tokens("connection") and rframing != "eof"
        if rframing == "eof":
            client_keep = False
        head = resp.raw
        if not self.keep_alive and "close" in resp.tokens("connection"):
            client_keep = False
        if self.keep_alive and client_keep and "close" in resp.tokens("connection"):
            head = resp.without_connection_close()
        elif not client_keep and "close" not in resp.tokens("connection"):
            head = head[:-2] + b"Connection: close\r\n\r\n"

        tap = _BodyTap(fault, lambda n: self._add(ex, "response_bytes", n))
        self._update(ex, status=status)
        client.send(head)
        try:
            _pump_response(link.up, client, rframing, rlength, tap)
            if tap.cut is not None:  # the body was no longer than `after`: cut after all of it
                raise _Cut()
        except _Cut:
            self._drop(link)
            assert fault is not None
            if fault.kind == "stall":
                self._stop.wait(fault.params["seconds"])
                return False, False
            client.drain(RESET_DRAIN)
            return False, True
        if not up_keep:
            self._drop(link)
        return client_keep, False

    def _read_response_head(self, up: _Stream) -> _Head:
        raw = up.read_head(WAIT)
        if raw is None:
            raise _Closed("upstream closed without answering")
        head = _parse_head(raw, "upstream")
        if not head.first.startswith("HTTP/1."):
            raise _Closed(f"upstream sent {head.first!r}")
        return head


def _merged(headers: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers:
        k = k.lower()
        out[k] = f"{out[k]}, {v}" if k in out else v
    return out


def _status_of(head: _Head) -> int:
    try:
        return int(head.first.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise _Closed(f"bad status line {head.first!r}") from None


def _pump_body(src: _Stream, dst: _Stream | None, framing: str, length: int, record: Callable[[int], None]) -> None:
    """Copies a request body from `src` to `dst` byte-for-byte (to nowhere if dst is None)."""
    if framing == "length":
        left = length
        while left > 0:
            data = src.read_some(min(left, CHUNK), WAIT)
            left -= len(data)
            record(len(data))
            if dst is not None:
                dst.send(data)
    elif framing == "chunked":
        while True:
            line = src.readline(WAIT)
            if dst is not None:
                dst.send(line)
            size = _chunk_size(line)
            if size == 0:
                while True:  # trailers, up to the blank line
                    t = src.readline(WAIT)
                    if dst is not None:
                        dst.send(t)
                    if t in (b"\r\n", b"\n"):
                        return
            left = size
            while left > 0:
                data = src.read_some(min(left, CHUNK), WAIT)
                left -= len(data)
                record(len(data))
                if dst is not None:
                    dst.send(data)
            crlf = src.readline(WAIT)
            if crlf.strip():
                raise _Closed(f"client: chunk not followed by CRLF: {crlf[:20]!r}")
            if dst is not None:
                dst.send(crlf)


def _pump_response(src: _Stream, dst: _Stream, framing: str, length: int, tap: _BodyTap) -> None:
    """Copies a response body to `dst` byte-for-byte; the payload goes through `tap` (chunk size
    lines and CRLFs of a chunked body are passed as they are)."""
    if framing == "length":
        left = length
        while left > 0:
            data = src.read_some(min(left, CHUNK), WAIT)
            left -= len(data)
            tap.emit(data, dst)
    elif framing == "eof":
        while True:
            data = src.read_some(CHUNK, WAIT, eof_ok=True)
            if not data:
                return
            tap.emit(data, dst)
    elif framing == "chunked":
        while True:
            line = src.readline(WAIT)
            size = _chunk_size(line)
            dst.send(line)
            if size == 0:
                while True:  # trailers, up to the blank line
                    t = src.readline(WAIT)
                    dst.send(t)
                    if t in (b"\r\n", b"\n"):
                        return
            left = size
            while left > 0:
                data = src.read_some(min(left, CHUNK), WAIT)
                left -= len(data)
                tap.emit(data, dst)
            crlf = src.readline(WAIT)
            if crlf.strip():
                raise _Closed(f"upstream: chunk not followed by CRLF: {crlf[:20]!r}")
            dst.send(crlf)


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0].strip(), 16)
    except ValueError:
        raise _Closed(f"bad chunk size line {line[:40]!r}") from None
