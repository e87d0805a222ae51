"""A small attack library for the end-to-end fault tests (tests/e2e/test_fault_layer.py).

Each function hits one port (a TCP ``HOST:PORT`` or a Unix socket path) with one kind of bad
input and returns what happened (:class:`Outcome`, :class:`HttpOutcome`, :class:`Flood`,
:class:`Drip`). Every function is bounded: a connect timeout, a wall-clock limit on reading
the answer (``wait``), a cap on what it keeps of the answer, and a bounded number of
connections or bytes. Nothing here asserts; the tests decide what is acceptable.

Wire formats (docs/PROTOCOL.md, docs/TRAINER_API.md):

- control frames (source control port): ``u32 BE len | version u8 (=3) | kind u8 | body``,
  ``len = 2 + len(body)``; ``str`` = ``u16 BE`` length + UTF-8, ``addr`` = family ``u8``
  (4|6), the address bytes, ``port u16``;
- trainer frames (Unix socket): ``u32 LE len | JSON``;
- the admin and trainer HTTP API: HTTP/1.1 on the admin address.
"""

from __future__ import annotations

import json
import random
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Union

Target = Union[str, tuple]  # "HOST:PORT", (host, port) or a Unix socket path ("/...")

#: What an outcome keeps of the bytes the peer sent back.
KEEP = 64 * 1024
PROTOCOL_VERSION = 5
#: Control message kinds (docs/PROTOCOL.md, "Messages").
HELLO, CHALLENGE, AUTH, WELCOME, MANIFEST_REQUEST, MANIFEST, DATA_CONN, FETCH, SHARD, ERROR, CANCEL, PING, HINT, DATA_READY = range(1, 15)


# --- connections -----------------------------------------------------------------------------


def host_port(addr: Target) -> tuple[str, int]:
    if isinstance(addr, tuple):
        return addr[0], int(addr[1])
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def connect(target: Target, timeout: float = 5.0) -> socket.socket:
    """A connected socket: AF_UNIX for a path starting with '/', TCP otherwise."""
    if isinstance(target, str) and target.startswith("/"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(target)
        except BaseException:
            s.close()
            raise
        return s
    return socket.create_connection(host_port(target), timeout=timeout)


@dataclass
class Outcome:
    """What one connection saw: the bytes the peer sent (at most KEEP), how it ended
    (``eof``, ``reset``, ``open`` = still open when we gave up, ``refused`` = could not
    connect, ``send_failed`` = the peer closed while we were still sending) and when."""

    closed: str
    reply: bytes = b""
    elapsed: float = 0.0
    error: str = ""

    @property
    def closed_by_peer(self) -> bool:
        return self.closed in ("eof", "reset", "send_failed")


def read_until_closed(s: socket.socket, wait: float, t0: float | None = None) -> Outcome:
    """Reads until the peer closes or `wait` seconds pass; keeps at most KEEP bytes."""
    t0 = time.monotonic() if t0 is None else t0
    deadline = time.monotonic() + wait
    got = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Outcome("open", bytes(got), time.monotonic() - t0)
        s.settimeout(min(left, 0.5))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError) as e:
            return Outcome("reset", bytes(got), time.monotonic() - t0, repr(e))
        if not chunk:
            return Outcome("eof", bytes(got), time.monotonic() - t0)
        if len(got) < KEEP:
            got += chunk[: KEEP - len(got)]


def send_and_read(target: Target, payload: bytes, wait: float = 5.0, shut_wr: bool = False) -> Outcome:
    """One connection: send `payload`, then read until the peer closes (at most `wait` s).
    `shut_wr` half-closes our side after sending (a peer then sees EOF mid-frame)."""
    t0 = time.monotonic()
    try:
        s = connect(target)
    except OSError as e:
        return Outcome("refused", b"", time.monotonic() - t0, repr(e))
    with s:
        try:
            s.sendall(payload)
            if shut_wr:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError) as e:
            out = read_until_closed(s, 0.5, t0)
            return Outcome("send_failed", out.reply, time.monotonic() - t0, repr(e))
        return read_until_closed(s, wait, t0)


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# --- slowloris and floods --------------------------------------------------------------------


@dataclass
class Drip:
    """A slowloris connection: how many bytes went out before it ended, how it ended (see
    :class:`Outcome`), after how long, and what the peer answered."""

    sent: int
    closed: str
    elapsed: float
    reply: bytes = b""

    @property
    def closed_by_peer(self) -> bool:
        return self.closed in ("eof", "reset", "send_failed")


def slowloris(target: Target, payload: bytes, interval: float = 1.0, limit: float = 15.0, head: bytes = b"") -> Drip:
    """Sends `head` at once, then `payload` one byte every `interval` seconds (repeating it
    if it runs out) until the peer closes the connection or `limit` seconds pass; reads what
    the peer answers."""
    t0 = time.monotonic()
    try:
        s = connect(target)
    except OSError:
        return Drip(0, "refused", time.monotonic() - t0)
    got = bytearray()
    sent = 0
    with s:
        if head:
            s.sendall(head)
        while True:
            left = t0 + limit - time.monotonic()
            if left <= 0:
                return Drip(sent, "open", time.monotonic() - t0, bytes(got))
            try:
                s.sendall(payload[sent % len(payload) : sent % len(payload) + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                return Drip(sent, "send_failed", time.monotonic() - t0, bytes(got))
            # Wait one interval, reading: the peer closing ends the drip at once.
            until = min(time.monotonic() + interval, t0 + limit)
            while (left := until - time.monotonic()) > 0:
                s.settimeout(left)
                try:
                    chunk = s.recv(65536)
                except socket.timeout:
                    break
                except ConnectionResetError:
                    return Drip(sent, "reset", time.monotonic() - t0, bytes(got))
                if not chunk:
                    return Drip(sent, "eof", time.monotonic() - t0, bytes(got))
                if len(got) < KEEP:
                    got += chunk[: KEEP - len(got)]


@dataclass
class Flood:
    """`count` connections opened at once: how many connected, how many the peer closed
    (or refused) while we held them, and the first bytes each peer-side answer carried."""

    count: int
    connected: int = 0
    connect_failed: int = 0
    closed_by_peer: int = 0
    replies: list = field(default_factory=list)
    elapsed: float = 0.0


def flood(target: Target, count: int = 300, payload: bytes = b"", hold: float = 3.0, keep: int = 512) -> Flood:
    """Opens `count` connections as fast as it can (each optionally sends `payload`), holds
    them for `hold` seconds while watching which the peer closes, then closes all of them.
    Bounded: `count` sockets, one connect timeout each, `hold` seconds of watching."""
    t0 = time.monotonic()
    res = Flood(count)
    socks: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    replies: dict[int, bytearray] = {}
    try:
        for _ in range(count):
            try:
                s = connect(target, timeout=2.0)
            except OSError:
                res.connect_failed += 1
                continue
            res.connected += 1
            socks.append(s)
            if payload:
                try:
                    s.sendall(payload)
                except OSError:
                    pass
            s.setblocking(False)
            replies[s.fileno()] = bytearray()
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + hold
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=min(left, 0.2)):
                s = key.fileobj
                try:
                    chunk = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    buf = replies[s.fileno()]
                    if len(buf) < keep:
                        buf += chunk[: keep - len(buf)]
                    continue
                sel.unregister(s)
                res.closed_by_peer += 1
        res.replies = [bytes(b) for b in replies.values() if b]
    finally:
        sel.close()
        for s in socks:
            s.close()
    res.elapsed = time.monotonic() - t0
    return res


def run_parallel(jobs: dict[str, Callable[[], object]], limit: float) -> dict[str, object]:
    """Runs each job in its own thread; returns {name: result or the exception it raised}.
    Threads still running after `limit` seconds are reported as TimeoutError (each job is
    itself bounded, so this only guards against a bug here)."""
    results: dict[str, object] = {}

    def wrap(name, fn):
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[name] = e

    threads = [threading.Thread(target=wrap, args=(n, f), name=f"fault-{n}", daemon=True) for n, f in jobs.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for n in jobs:
        results.setdefault(n, TimeoutError(f"fault job {n!r} still running after {limit}s"))
    return results


# --- control frames (source control port) ----------------------------------------------------


def control_frame(kind: int, body: bytes = b"", version: int = PROTOCOL_VERSION) -> bytes:
    return struct.pack(">IBB", 2 + len(body), version, kind) + body


def wire_str(s: Union[str, bytes]) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(b)) + b


def wire_addr(host: str, port: int, family: int = 4) -> bytes:
    return struct.pack(">B", family) + socket.inet_aton(host) + struct.pack(">H", port)


def hello(node_id: Union[str, bytes] = "fault-node", data_addr: tuple = ("127.0.0.1", 9), flows: int = 1,
          nonce: bytes = b"\x01" * 32, family: int = 4, lanes: int = 1) -> bytes:
    """A Hello (version 3 layout, unchanged in 4 and 5): the node id, the nonce, then `lanes` lanes (u16 count), each the
    data address and its flows."""
    lane = wire_addr(data_addr[0], data_addr[1], family) + struct.pack(">H", flows)
    body = wire_str(node_id) + nonce + struct.pack(">H", lanes) + lane * lanes
    return control_frame(HELLO, body)


def fetch(req: int, dataset: Union[str, bytes], shard: int, lane: int = 0) -> bytes:
    return control_frame(FETCH, struct.pack(">Q", req) + wire_str(dataset) + struct.pack(">IH", shard, lane))


def read_control_frame(s: socket.socket) -> tuple[int, bytes]:
    """One control frame from `s` (blocking, within its timeout): (kind, body)."""
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = s.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    (n,) = struct.unpack(">I", exact(4))
    frame = exact(n)
    assert frame[0] == PROTOCOL_VERSION, frame[:2]
    return frame[1], frame[2:]


def next_non_ping(ctl: socket.socket) -> tuple[int, bytes]:
    """The next control frame that is not a Ping."""
    while True:
        kind, body = read_control_frame(ctl)
        if kind != PING:
            return kind, body


def handshake_to_data_conn(addr, data: socket.socket) -> tuple[socket.socket, socket.socket, bytes]:
    """A loopback node's control connection through Welcome (no secret), the source's data
    connection (accepted on `data`) after its DataConn announcement, and the Welcome's body."""
    ctl = socket.create_connection(addr, timeout=10)
    ctl.sendall(hello("test-node", data.getsockname(), nonce=b"\x00" * 32))
    kind, _ = read_control_frame(ctl)
    assert kind == CHALLENGE, kind
    ctl.sendall(control_frame(AUTH, b"\x00" * 32))  # no secret: zeros
    kind, welcome = read_control_frame(ctl)
    assert kind == WELCOME, kind
    conn, _ = data.accept()  # the source dials the data port
    kind, _ = read_control_frame(ctl)
    assert kind == DATA_CONN, kind
    return ctl, conn, welcome


def manifest_request(req: int, dataset: Union[str, bytes]) -> bytes:
    return control_frame(MANIFEST_REQUEST, struct.pack(">Q", req) + wire_str(dataset))


def control_malformed(seed: int = 0) -> dict[str, bytes]:
    """Byte strings that are not valid first frames of a node (each should drop the
    connection at once): garbage, over-long and cut frames, bad versions, kinds and fields.
    (A frame that is merely unfinished waits for its bytes: see :func:`slowloris`.)"""
    good = hello()
    return {
        "random 4 KiB": random_bytes(4096, seed),
        "http request": b"GET / HTTP/1.1\r\nHost: shardwire\r\n\r\n",
        "length 0xFFFFFFFF": b"\xff\xff\xff\xff" + bytes([PROTOCOL_VERSION]) + b"\x01" + b"\x00" * 64,
        "length 64 MiB": struct.pack(">I", 64 << 20) + bytes([PROTOCOL_VERSION, 1]) + b"\x00" * 64,
        "length just over 8 KiB": struct.pack(">I", 8 * 1024 + 1) + bytes([PROTOCOL_VERSION, 1]) + b"\x00" * 64,
        "length 0": b"\x00\x00\x00\x00",
        "length 1": b"\x00\x00\x00\x01" + bytes([PROTOCOL_VERSION]),
        "bad version 1": control_frame(HELLO, good[6:], version=1),
        "bad version 255": control_frame(HELLO, good[6:], version=255),
        "unknown kind 200": control_frame(200, b"\x00" * 16),
        "kind 0": control_frame(0, b""),
        "truncated hello (cut body)": control_frame(HELLO, good[6:20]),
        "hello with trailing bytes": control_frame(HELLO, good[6:] + b"\x00\x00"),
        "hello flows 0": hello(flows=0),
        "hello flows 65": hello(flows=65),
        "hello flows 65535": hello(flows=65535),
        "hello bad address family": hello(family=7),
        "hello 0 lanes": hello(lanes=0),
        "hello 65 lanes": hello(lanes=65),
        "hello node_id over 4096 bytes": hello(node_id="n" * 5000),
        "hello node_id bad utf-8": hello(node_id=b"\xff\xfe\xfd"),
        "hello string length past the frame": control_frame(HELLO, b"\xff\xff" + b"x" * 10),
        "auth before hello": control_frame(AUTH, b"\x00" * 32),
        "welcome from a node": control_frame(WELCOME, b"\x00" * 32 + b"\x00\x05"),
        "ping before hello": control_frame(PING),
    }


def read_control(s: socket.socket, wait: float) -> tuple[int, bytes] | str:
    """The next control frame as (kind, body), or 'eof' / 'reset' / 'timeout'."""
    deadline = time.monotonic() + wait

    def exact(n: int) -> bytes | str:
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            s.settimeout(left)
            try:
                chunk = s.recv(n - len(buf))
            except socket.timeout:
                return "timeout"
            except ConnectionResetError:
                return "reset"
            if not chunk:
                return "eof"
            buf += chunk
        return buf

    hdr = exact(4)
    if isinstance(hdr, str):
        return hdr
    (n,) = struct.unpack(">I", hdr)
    if n < 2 or n > 1 << 20:
        return f"bad length {n}"
    rest = exact(n)
    if isinstance(rest, str):
        return rest
    return rest[1], rest[2:]


def error_code(body: bytes) -> tuple[int, int, str]:
    """(req, code, message) of an Error body (req u64, code u16, retry_after_ms u32, message)."""
    req, code = struct.unpack(">QH", body[:10])
    (ln,) = struct.unpack(">H", body[14:16])
    return req, code, body[16 : 16 + ln].decode(errors="replace")


def control_session_attack(source: Target, wait: float = 5.0) -> dict:
    """Plays a node against a source without a secret (loopback): a real handshake whose
    data address is a listener of our own, then requests with absurd values. Returns
    {'welcome': bool, 'data_conns': n, 'replies': [(what, answer)], 'final': how the
    connection ended after an over-long length prefix}. Bounded by `wait` per step."""
    out: dict = {"welcome": False, "data_conns": 0, "replies": [], "final": None}
    lst = socket.create_server(("127.0.0.1", 0))
    lst.settimeout(wait)
    accepted: list[socket.socket] = []
    try:
        s = connect(source)
        with s:
            s.sendall(hello(node_id="fault-session", data_addr=lst.getsockname(), flows=1))
            ch = read_control(s, wait)
            if not isinstance(ch, tuple) or ch[0] != CHALLENGE:
                out["final"] = f"no Challenge: {ch!r}"
                return out
            s.sendall(control_frame(AUTH, b"\x00" * 32))
            w = read_control(s, wait)
            if not isinstance(w, tuple) or w[0] != WELCOME:
                out["final"] = f"no Welcome: {w!r}"
                return out
            out["welcome"] = True
            try:
                c, _ = lst.accept()
                accepted.append(c)
                out["data_conns"] += 1
            except socket.timeout:
                pass
            dc = read_control(s, wait)  # the DataConn announcing that connection
            out["data_conn_announced"] = isinstance(dc, tuple) and dc[0] == DATA_CONN
            asks = [
                ("fetch shard 2**32-1", fetch(1, "f", 2**32 - 1)),
                ("fetch unknown dataset", fetch(2, "no-such-dataset", 0)),
                ("fetch on a lane the node does not have", fetch(4, "f", 0, lane=7)),
                ("manifest of an unknown dataset", manifest_request(3, "zz" * 100)),
                ("cancel an unknown request", control_frame(CANCEL, struct.pack(">Q", 2**64 - 1))),
                ("ping", control_frame(PING)),
            ]
            for what, frame in asks:
                s.sendall(frame)
                if what in ("cancel an unknown request", "ping"):
                    continue  # nothing is answered
                r = read_control(s, wait)
                while isinstance(r, tuple) and r[0] == PING:  # keepalives may interleave
                    r = read_control(s, wait)
                out["replies"].append((what, error_code(r[1]) if isinstance(r, tuple) and r[0] == ERROR else r))
            # Over the 8 KiB limit after authentication: the source drops the session.
            s.sendall(b"\x7f\xff\xff\xff" + bytes([PROTOCOL_VERSION, 8]) + b"\x00" * 32)
            t0 = time.monotonic()
            o = read_until_closed(s, wait, t0)
            out["final"] = o.closed
    finally:
        for c in accepted:
            c.close()
        lst.close()
    return out


# --- trainer frames (Unix socket) ------------------------------------------------------------


def trainer_frame(msg: Union[dict, bytes, str]) -> bytes:
    body = msg if isinstance(msg, bytes) else (msg.encode() if isinstance(msg, str) else json.dumps(msg).encode())
    return struct.pack("<I", len(body)) + body


def parse_trainer_frames(data: bytes) -> list:
    """The JSON objects in a byte string of trainer frames (a trailing partial frame or a
    body that is not JSON is returned as the string 'partial' / 'not json')."""
    out: list = []
    while data:
        if len(data) < 4:
            out.append("partial")
            break
        (n,) = struct.unpack("<I", data[:4])
        if len(data) < 4 + n:
            out.append("partial")
            break
        try:
            out.append(json.loads(data[4 : 4 + n]))
        except ValueError:
            out.append("not json")
        data = data[4 + n :]
    return out


def attach(dataset: str = "f", **fields) -> dict:
    return {"op": "attach", "version": 1, "dataset": dataset, **fields}


def trainer_malformed(seed: int = 0) -> dict[str, bytes]:
    """Frames that are not valid requests: the node answers `bad_request` and closes."""
    return {
        "random 4 KiB": random_bytes(4096, seed),
        "invalid json": trainer_frame(b"{not json!"),
        "json array": trainer_frame(b"[1,2,3]"),
        "unknown op": trainer_frame({"op": "frobnicate"}),
        "no op": trainer_frame({"dataset": "f"}),
        "unknown field": trainer_frame(attach(bogus=1)),
        "epochs 2**40": trainer_frame(attach(epochs=2**40)),
        "negative seed": trainer_frame(attach(seed=-1)),
        "seed 2**70": trainer_frame(attach(seed=2**70)),
        "rank -1": trainer_frame(attach(rank=-1)),
        "uneven sideways": trainer_frame(attach(uneven="sideways")),
        "state garbage": trainer_frame(attach(state={"epoch": "x"})),
        "huge length prefix": b"\xff\xff\xff\xff{}",
        "length 1 MiB + 1": struct.pack("<I", (1 << 20) + 1) + b"{}",
        "nul bytes": trainer_frame(b"\x00" * 64),
        "bad utf-8": trainer_frame(b'{"op":"attach","dataset":"\xff\xfe"}'),
    }


def trainer_refused_attaches() -> dict[str, tuple[dict, str]]:
    """Well-formed attaches with absurd values: (request, expected error code)."""
    return {
        "world_size 0": (attach(world_size=0), "bad_plan"),
        "rank == world_size": (attach(rank=4, world_size=4), "bad_plan"),
        "rank 2**32-1 of 3": (attach(rank=2**32 - 1, world_size=3), "bad_plan"),
        "epochs 0": (attach(epochs=0), "bad_request"),
        "version 99": (attach(version=99), "unsupported_version"),
        "unknown dataset": (attach("no-such-dataset"), "unknown_dataset"),
        "dataset 5000 bytes": (attach("d" * 5000), "bad_request"),
        "dataset with a slash": (attach("../etc/passwd"), "bad_request"),
        "next before attach": ({"op": "next", "timeout_ms": 2**64 - 1}, "not_attached"),
        "release before attach": ({"op": "release", "lease": 2**64 - 1}, "not_attached"),
    }


def trainer_exchange(path: str, requests: list, wait: float = 5.0, shut_wr: bool = False) -> Outcome:
    """Sends each request as a frame (dicts are encoded, bytes go as they are), then reads
    until the node closes the connection or `wait` seconds pass (`shut_wr`: half-close
    after the requests, so the node closes once it has answered them)."""
    payload = b"".join(r if isinstance(r, bytes) else trainer_frame(r) for r in requests)
    return send_and_read(path, payload, wait, shut_wr=shut_wr)


# --- HTTP ------------------------------------------------------------------------------------


@dataclass
class HttpOutcome:
    status: int | None
    body: bytes
    closed: str
    elapsed: float
    headers: dict = field(default_factory=dict)

    @property
    def closed_by_peer(self) -> bool:
        return self.closed in ("eof", "reset", "send_failed")

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def parse_http(raw: bytes) -> tuple[int | None, dict, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1."):
        return None, {}, raw
    lines = head.decode(errors="replace").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return None, {}, raw
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return status, headers, body


def http_raw(admin: Target, raw: bytes, wait: float = 5.0) -> HttpOutcome:
    """Sends raw bytes to the HTTP server and reads until it closes (or `wait` s)."""
    o = send_and_read(admin, raw, wait)
    status, headers, body = parse_http(o.reply)
    return HttpOutcome(status, body, o.closed, o.elapsed, headers)


def http_request(admin: Target, method: str, path: str, body: Union[bytes, dict, list, None] = None,
                 content_length: int | None = None, headers: dict | None = None, wait: float = 5.0) -> HttpOutcome:
    """One request with `Connection: close`; `content_length` may lie about the body."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    body = body or b""
    n = len(body) if content_length is None else content_length
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", f"Content-Length: {n}"]
    if body:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    return http_raw(admin, raw, wait)


def http_streamed_body(admin: Target, path: str, content_length: int, send: int, wait: float = 5.0) -> HttpOutcome:
    """A POST that claims `content_length` bytes and streams `send` bytes of body as fast as
    the server takes them (the server may answer and close before all went out)."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {content_length}\r\n\r\n"
    t0 = time.monotonic()
    try:
        s = connect(admin)
    except OSError as e:
        return HttpOutcome(None, repr(e).encode(), "refused", 0.0)
    with s:
        try:
            s.sendall(head.encode())
            chunk = b"x" * 16384
            left = send
            while left > 0 and time.monotonic() - t0 < wait:
                s.sendall(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        o = read_until_closed(s, wait, t0)
    status, headers, body = parse_http(o.reply)
    return HttpOutcome(status, body, o.closed, o.elapsed, headers)


def http_head_drip(admin: Target, interval: float = 1.0, limit: float = 10.0) -> Drip:
    """Slowloris on the request head: 1 byte per `interval` of a never-ending header."""
    return slowloris(admin, b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096, interval, limit)


def http_body_drip(admin: Target, interval: float = 0.5, limit: float = 10.0) -> Drip:
    """Slowloris on a request body: a complete head promising 1000 bytes at once, then the
    body 1 byte per `interval`."""
    head = b"POST /v1/streams HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
    return slowloris(admin, b"{" * 1000, interval, limit, head=head)
