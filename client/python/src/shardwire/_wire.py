"""Frames of the trainer socket (docs/TRAINER_API.md, protocol/src/trainer.rs).

A frame is ``len: u32 little-endian`` followed by ``len`` bytes of JSON (at most 1 MiB).
The ``attached`` reply carries the stream's region as one file descriptor (SCM_RIGHTS)
attached to the frame's first byte, so the prefix is read with ``recvmsg`` (`_recv_fds`).
"""

from __future__ import annotations

import array
import json
import math
import operator
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from . import _binary
from ._errors import ConnectionClosed, ProtocolError
from ._types import _loads

#: Protocol version this SDK speaks (``TRAINER_VERSION``).
VERSION = 1
#: Largest frame either side may send (``MAX_TRAINER_FRAME``).
MAX_FRAME = 1 << 20
#: Most fds accepted with one frame (the service sends exactly one, with ``attached``).
_MAX_FDS = 4
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
#: Room for the ancillary data of `_MAX_FDS` fds.
_FD_SPACE = socket.CMSG_SPACE(_MAX_FDS * 4)
_CTRUNC = getattr(socket, "MSG_CTRUNC", 0)
# EPIPE instead of SIGPIPE when the service is gone, even in hosts that do not ignore SIGPIPE.
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
# Writes that never block: the wait for room is a `poll` (see `Conn.send_bytes`).
_SEND_FLAGS = _NOSIGNAL | getattr(socket, "MSG_DONTWAIT", 0)
#: Most bytes of replies `Conn._closing_error` looks through for the node's closing error.
_CLOSING_PEEK = 4 * MAX_FRAME
#: How a binary `batch` body starts (see :mod:`shardwire._binary`).
#: Longest wait for the rest of a reply whose first bytes came, from its first bytes to its
#: last (the Rust SDK's limit too, one deadline per frame): a node stopped in the middle of a
#: write, or trickling one, fails the call instead of hanging it.
FRAME_LIMIT = 60.0
#: Longest wait for the answer to a request the node answers at once (``info``, a ``release``
#: with nothing ahead of it): a node that stopped answering fails the call, not hangs it.
REPLY_LIMIT = 60.0
#: Longest wait for the answer to ``attach``: the node may first wait for its sources (5 s for
#: one to connect, 1 s for the rest), ask them all at once for the dataset's manifest (15 s
#: at most) and plan the stream, so this is generous; beyond it the node is stuck.
ATTACH_LIMIT = 600.0


#: Why a stream whose request was cut short (`Conn.torn`) was closed.
TORN = ("an exception (a signal handler's, such as Ctrl-C's) struck while a request was being sent, and part of "
        "it may have gone out: the node would take the next request for its rest, so the stream was closed; "
        "open it again from its state_dict()")


class NoAnswer(ConnectionClosed):
    """The node did not answer a request within its limit (`Conn.await_reply`). Not a sign of
    an old node (which closes the connection on a request it does not know): nothing falls
    back on it."""

_BINARY_TAG = bytes([_binary.TAG])
_LEN = struct.Struct("<I")
#: One `recv` of what has arrived, called from C (see `_recv_fds` and `Conn._recv_into`).
_RECV = operator.methodcaller("recv", 1 << 16)
_NEXT_ALONE = _LEN.pack(13) + b'{"op":"next"}'

Message = dict[str, Any]

#: The key `_decode` marks the dict of a binary ``batch`` reply with (its value True). Not a
#: string, so no JSON reply can carry it, whatever its fields (a JSON batch with a ``"dtypes"``
#: field once passed for binary). A key, not a dict subclass: that costs a copy, and slower
#: lookups, per batch. (Typed Any: a Message's keys are strings.)
BINARY: Any = ("binary",)


def readable(sock: socket.socket, timeout: float | None) -> bool:
    """True once `sock` has bytes to read (or is closed), False after `timeout` seconds (None:
    waits as long as it takes). `poll`, not `select`: a process with many open files (a
    DataLoader's) may hold this socket at an fd above 1023, which `select` cannot watch."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    if timeout is None or math.isinf(timeout):
        return bool(p.poll(None))
    # poll takes at most 2^31 - 1 ms (about 24.8 days) at a time.
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        # `left` bounded first: a wait of 1e306 s is inf ms, which ceil() cannot take.
        if p.poll(min(_POLL_MAX_MS, math.ceil(min(left, _POLL_MAX_MS / 1000) * 1000))):
            return True
        if left <= _POLL_MAX_MS / 1000:
            return False


#: The longest wait one `poll` call takes (its argument is a C int of milliseconds).
_POLL_MAX_MS = 2**31 - 1


def _wait_writable(sock: socket.socket, limit: float) -> bool:
    """Waits up to `limit` seconds until `sock` has room for more bytes, or is closed (the next
    write then fails); False when the time ran out."""
    p = select.poll()
    p.register(sock, select.POLLOUT)
    return bool(p.poll(int(limit * 1000)))


def encode(msg: Message) -> bytes:
    """One framed message: u32 LE length, then compact JSON."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"request of {len(body)} bytes exceeds the frame limit {MAX_FRAME}")
    return struct.pack("<I", len(body)) + body


def encode_next(release: Sequence[int], count: int = 1, timeout_ms: int | None = None) -> bytes:
    """A ``next`` request releasing `release` and asking for up to `count` batches (those
    ready at once after the first), which the node ends after `timeout_ms` (None: it waits as
    long as it takes): the bytes :func:`encode` writes, without the generic encoder (one per
    batch or fewer on the training loop's path)."""
    if not release and count == 1 and timeout_ms is None:
        return _NEXT_ALONE
    body = b'{"op":"next"'
    if timeout_ms is not None:
        body += b',"timeout_ms":%d' % int(timeout_ms)
    if release:
        body += b',"release":[%s]' % b",".join(b"%d" % int(x) for x in release)
    if count != 1:
        body += b',"count":%d' % int(count)
    body += b"}"
    return _LEN.pack(len(body)) + body


def _decode(body: bytes) -> Message:
    """A reply body: JSON, or a binary ``batch`` (see :mod:`shardwire._binary`), marked so
    (`BINARY`)."""
    if body[:1] == _BINARY_TAG:
        msg = _binary.decode(body)
        msg[BINARY] = True
        return msg
    msg = _loads(body, "reply from the node service")
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError(f"reply without an op: {msg!r}")
    return msg


def _ends(msg: Message | ProtocolError) -> int:
    """1 when `msg`, a reply (or the ProtocolError decoding it raised), is the last answer to
    its request: anything but a batch marked ``more`` (another batch answering the same
    ``next`` follows); else 0."""
    return 0 if isinstance(msg, dict) and msg.get("more") else 1


def _close_fds(fds: list[int]) -> None:
    """Closes every fd in `fds` (received ones: see `Conn.recv_fds`)."""
    for fd in fds:
        _close_quietly(fd)


def _close_quietly(fd: int) -> None:
    """Closes `fd`; an error is not raised (Linux releases the fd even when close fails)."""
    try:
        os.close(fd)
    except OSError:
        pass


class Conn:
    """A trainer connection: sends requests and reads replies, in order.

    Not thread-safe by itself; :class:`shardwire.Stream` serialises its use with a lock.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: Bytes received past the last reply read (replies come back to back).
        self._buf = bytearray()
        #: Replies received and decoded, not yet taken (or the ProtocolError decoding one
        #: raised, raised when its turn comes); the head is the one `peek_reply` returns.
        self._ready: deque[Message | ProtocolError] = deque()
        #: Bytes of the requests `send_bytes` is sending, or sent last, not known to have gone
        #: out: 0 once all of them did.
        self.unsent = 0
        #: True once requests were cut short, or may have been (see `send_bytes`).
        self.torn = False
        #: Requests sent before those `send_bytes` sends whose last answer is still to come
        #: (not yet taken off ``_ready``), set by the caller before each send from its own
        #: record: a Stream's ``_inflight`` before the request joins it, as the Rust SDK's
        #: ``awaited.len()``; 0 on a connection whose every answer was read (``info``,
        #: ``attach``). `_closing_error` looks for the node's closing error only behind their
        #: answers. Not a count kept here: one updated beside each reply's store missed the
        #: reply an interrupt struck between the two, and stayed one low for good.
        self.owed = 0

    def send(self, *msgs: Message) -> None:
        """Sends one or more requests together (the service answers them in order)."""
        self.send_bytes(b"".join(encode(m) for m in msgs))

    def send_bytes(self, data: bytes) -> None:
        """Sends encoded requests, whole (`owed`: the requests sent before them whose last
        answer is still to come).

        An exception that strikes meanwhile (a signal handler's, such as Ctrl-C's: CPython runs
        them inside a blocked socket call and right after one returns) leaves `unsent` telling
        what went out: every byte (0), none (all of them), or part, which sets `torn`: the node
        would read the next request as the rest of this one. Each write is non-blocking and the
        wait for room a `poll`, so a count is lost only to an exception that strikes just as a
        write returns; that sets `torn` too, whatever the write sent. (``sendall`` runs the
        handlers after its last write: an exception there hid whether anything had gone out.)
        """
        view = memoryview(data)
        self.unsent, writing = len(view), False
        try:
            while self.unsent:
                writing = True
                try:
                    self.unsent -= self.sock.send(view[len(view) - self.unsent :], _SEND_FLAGS)
                except BlockingIOError:
                    writing = False
                    if not _wait_writable(self.sock, REPLY_LIMIT):
                        self.torn = self.unsent != len(view)
                        raise ConnectionClosed(
                            f"the node service took no bytes of a request for {REPLY_LIMIT:.0f} s: it is stuck"
                        ) from None
                writing = False
        except OSError as e:
            # The node, gone, answers none of these: `owed` are all it still answers.
            raise ConnectionClosed(self._send_failed(e)) from e
        except BaseException:
            self.torn = self.unsent != 0 and (writing or self.unsent != len(view))
            raise

    def _send_failed(self, e: OSError) -> str:
        """Why a send failed with `e`. A node that ends a connection (its
        ``trainer_idle_timeout_secs`` passed, a bad request) first sends an ``error`` saying
        why, then closes it: the send finds it closed (EPIPE, ECONNRESET) with that error still
        unread, behind the answers to the requests in flight, and its code and message say why
        where the broken pipe alone would not (as the Rust SDK's)."""
        why = f"the node service connection failed while sending: {e}"
        if not isinstance(e, (BrokenPipeError, ConnectionResetError)):
            return why
        err = self._closing_error()
        if err is None:
            return why
        return f"the node service closed the connection: {err.get('code')}: {err.get('message')}"

    def _closing_error(self) -> Message | None:
        """The ``error`` the node sent after the last answers to the requests sent before
        (`owed`), before it closed the connection. Looked for in the replies
        decoded and not yet taken (``_ready``), then those received and not yet decoded
        (``_buf``) and those still in the socket, peeked at without waiting. Nothing is taken:
        the replies stay for whoever reads them (see ``_send_unattached``). An ``error`` among
        the answers answers its request (a release's ``unknown_lease``): it is no reason for the
        close, which may have been a crash that sent none (then None: the broken pipe stands),
        as the Rust SDK's."""
        owed = self.owed  # counted off from the head of `_ready`: its replies are untaken
        for msg in self._ready:
            if owed <= 0 and isinstance(msg, dict) and msg.get("op") == "error":
                return msg
            owed -= _ends(msg)
        try:
            queued = self.sock.recv(_CLOSING_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing there (BlockingIOError), or the reset
            queued = b""
        data, at = bytes(self._buf) + queued, 0
        while len(data) - at >= 4:
            (n,) = _LEN.unpack_from(data, at)
            body = data[at + 4 : at + 4 + n]
            if n > MAX_FRAME or len(body) < n:
                break
            at += 4 + n
            if body[:1] == _BINARY_TAG:
                owed -= 0 if len(body) > 1 and body[1] & _binary.FLAG_MORE else 1
                continue
            try:
                reply = _loads(body, "reply from the node service")
            except ProtocolError:  # not JSON, or nested too deeply: an answer all the same
                owed -= 1
                continue
            if owed <= 0 and isinstance(reply, dict) and reply.get("op") == "error":
                return reply
            owed -= _ends(reply)
        return None

    def pending(self) -> bool:
        """True when bytes of a reply have already been received (no wait needed to read)."""
        return bool(self._ready or self._buf)

    def await_reply(self, limit: float, what: str) -> None:
        """Waits up to `limit` seconds for the first bytes of the answer to `what` (at once if
        they have come); ConnectionClosed, naming `what` and the limit, if none came."""
        if self.pending() or readable(self.sock, limit):
            return
        raise NoAnswer(f"the node service did not answer {what} within {limit:g} s "
                       "(is it stopped or overloaded? see its log and its admin /v1/status)")

    def recv(self, want_fds: bool = False) -> tuple[Message, list[int]]:
        """Reads one reply; returns it and the fds that came with it (only if `want_fds`;
        the caller owns and must close them). A caller that must not lose them to an exception
        that strikes as this returns (a signal handler's) passes its own list to `recv_fds`."""
        if not want_fds:
            return self.recv_reply(), []
        fds: list[int] = []
        try:
            return self.recv_fds(fds), fds
        except BaseException:
            _close_fds(fds)
            raise

    def recv_fds(self, fds: list[int]) -> Message:
        """Reads one reply that may carry file descriptors (``attached``). They are appended to
        `fds` as they arrive (see `_recv_fds`): from then on the caller owns them, and closes
        them whatever this returns or raises, so no exception (a signal handler's, Ctrl-C's)
        that strikes between their receipt and the caller's ``finally`` leaks one."""
        if self._buf or self._ready:
            raise ProtocolError("a reply with file descriptors after buffered bytes")
        deadline = math.inf  # FRAME_LIMIT after the frame's first bytes (see `_wait_rest`)
        try:
            prefix = bytearray()
            while len(prefix) < 4:
                if prefix:
                    self._wait_rest(deadline)  # the rest of a length prefix that has begun
                data, flags = _recv_fds(self.sock, 4 - len(prefix), fds)
                if flags & _CTRUNC:
                    raise ProtocolError("file descriptors were truncated on receipt (too many fds, or the fd limit is reached)")
                if not data:
                    raise ConnectionClosed("the node service closed the connection")
                prefix += data
                deadline = min(deadline, time.monotonic() + FRAME_LIMIT)
            (n,) = struct.unpack("<I", prefix)
            if n > MAX_FRAME:
                raise ProtocolError(f"reply of {n} bytes exceeds the frame limit {MAX_FRAME}")
            body = bytearray(n)
            view = memoryview(body)
            got_bytes = 0
            while got_bytes < n:
                self._wait_rest(deadline)
                k = self.sock.recv_into(view[got_bytes:])
                if k == 0:
                    raise ConnectionClosed("the node service closed the connection in the middle of a reply")
                got_bytes += k
        except OSError as e:
            raise ConnectionClosed(f"the node service connection failed: {e}") from e
        return _decode(bytes(body))

    def recv_reply(self) -> Message:
        """Reads one reply that carries no file descriptors (every reply but ``attached``):
        `peek_reply`, and the reply taken (a malformed one too, so that the replies after it
        can still be read)."""
        msg = self._peek()
        del self._ready[0]
        if isinstance(msg, ProtocolError):
            raise msg
        return msg

    def peek_reply(self) -> Message:
        """The next reply that carries no file descriptors, left at the head of ``_ready``
        until the caller takes it (``del conn._ready[0]``, see ``Stream._consume``): an
        exception (a signal handler's, Ctrl-C's) that strikes before then loses no reply. A
        malformed one raises its ProtocolError (and stays: the caller closes the connection).

        Reads as much as has arrived per call (usually the whole reply in one `recv`, or
        several: a ``next`` with ``count`` is answered in one write). A binary ``batch`` body
        (see :mod:`shardwire._binary`) comes back as the same kind of dict.

        Replies that arrive together are decoded together, the later ones kept for the next
        calls: in a training loop each call comes right after a model step, which has pushed
        this code out of the CPU's caches, and decoding eight replies in one warm pass costs
        less than eight cold ones (docs/BENCHMARKS.md, "The gather's prefetch into L2, the
        batcher without `block_in_place`, the SDK's reply groups")."""
        msg = self._peek()
        if isinstance(msg, ProtocolError):
            raise msg
        return msg

    def _peek(self) -> Message | ProtocolError:
        """The head of ``_ready``, received and decoded first if there is none. Every byte
        received is, at every moment, in ``_buf`` or decoded in ``_ready``, never only in a
        local variable: an exception that strikes anywhere here loses nothing, and decodes
        nothing twice (see `_recv_alone`, `_recv_into`, `_split`)."""
        if self._ready:
            return self._ready[0]
        try:
            if self._buf or not self._recv_alone():
                deadline = None  # FRAME_LIMIT after the first wait for the rest of a reply begun
                while not self._split():
                    if deadline is None:
                        deadline = time.monotonic() + FRAME_LIMIT
                    self._wait_rest(deadline)
                    if not self._recv_into():
                        raise ConnectionClosed(
                            "the node service closed the connection" + (" in the middle of a reply" if self._buf else "")
                        )
        except OSError as e:
            raise ConnectionClosed(f"the node service connection failed: {e}") from e
        return self._ready[0]

    def _recv_alone(self) -> bool:
        """The usual case on a training loop's path (``_buf`` and ``_ready`` empty): one
        `recv` is exactly one reply, decoded into ``_ready`` without going through ``_buf``.
        True if it was; otherwise what came is in ``_buf``."""
        got: list[bytes] = []
        try:
            # Stored by C (`list.extend` over a `map`): an exception raised as a plain call
            # returned would drop the bytes (see `_recv_fds`).
            got.extend(map(_RECV, (self.sock,)))
            data = got[0]
            if len(data) >= 4 and _LEN.unpack_from(data)[0] == len(data) - 4:
                try:
                    msg: Message | ProtocolError = _decode(data[4:])
                except ProtocolError as e:
                    msg = e  # raised in its turn, as `_split` does
                self._ready.append(msg)  # one C call: the reply is in `_ready` or still in `got`
                return True
            if not data:
                raise ConnectionClosed("the node service closed the connection")
            return False
        finally:
            # Not decoded into `_ready` (a reply in parts, or an interrupt while decoding): the
            # bytes go to `_buf`, for this call's split or the next call's.
            if got and not self._ready:
                self._buf += got[0]

    def _recv_into(self) -> int:
        """Receives what has arrived into ``_buf``; how many bytes (0: the node closed the
        connection). Stored by C, and into ``_buf`` whatever strikes (see `_recv_alone`)."""
        got: list[bytes] = []
        try:
            got.extend(map(_RECV, (self.sock,)))
        finally:
            if got:
                self._buf += got[0]
        return len(got[0])

    def _split(self) -> bool:
        """Decodes every whole reply at the head of the buffer into ``_ready`` (a malformed
        one as its ProtocolError, ending the split); True if there was at least one."""
        buf, at, end = self._buf, 0, len(self._buf)
        try:
            while end - at >= 4:
                (n,) = _LEN.unpack_from(buf, at)
                if n > MAX_FRAME:
                    if not self._ready:
                        raise ProtocolError(f"reply of {n} bytes exceeds the frame limit {MAX_FRAME}")
                    break  # raised once the replies before it are taken
                if end - at < 4 + n:
                    break
                try:
                    msg: Message | ProtocolError = _decode(bytes(buf[at + 4 : at + 4 + n]))
                except ProtocolError as e:
                    msg = e
                # `at` first: an exception raised as `append` returns finds the reply counted
                # (deleted from `buf` below) and in `_ready`, not in both.
                at += 4 + n
                self._ready.append(msg)
                if isinstance(msg, ProtocolError):
                    break
        finally:
            del buf[:at]  # what is in `_ready` (even if something else interrupted the split)
        return bool(self._ready)

    def ready(self) -> list[Message]:
        """The replies already decoded and not yet taken, in order (see `peek_reply`)."""
        return [m for m in self._ready if not isinstance(m, ProtocolError)]

    def _wait_rest(self, deadline: float) -> None:
        """Waits, until `deadline` (``time.monotonic()``, FRAME_LIMIT s after the reply began),
        for more bytes of a reply that has begun: one deadline per frame, so a node that
        trickles a reply fails the call as one that stopped does."""
        if not readable(self.sock, max(0.0, deadline - time.monotonic())):
            raise ConnectionClosed(f"the node service sent part of a reply and not the rest within {FRAME_LIMIT:g} s")

    def close(self, _how: int = socket.SHUT_RDWR) -> None:
        """Closes the socket (the service then closes the stream and releases its leases).
        (`_how` is bound when the module loads: a stream closed by a generator finalised at
        interpreter exit runs after this module's globals are gone.)"""
        self._ready.clear()  # their Batches (if built) would keep the region mapped
        self._buf.clear()
        try:
            self.sock.shutdown(_how)
        except OSError:
            pass
        self.sock.close()


def _recv_fds(sock: socket.socket, n: int, fds: list[int]) -> tuple[bytes, int]:
    """Receives up to `n` bytes and the fds that come with them (appended to `fds`, which the
    caller closes), close-on-exec from the moment they arrive: ``socket.recv_fds`` drops its
    flags argument before Python 3.12.1 (gh-107898), so a child process spawned meanwhile
    would inherit the region's fd. Returns the bytes and the message flags.

    No exception leaks a received fd: CPython runs signal handlers between bytecodes, and
    right as a call returns, so a handler's exception (Ctrl-C's KeyboardInterrupt) can strike
    anywhere from the receipt to the fds being in `fds`. The reply is stored into `got` by C
    (``list.extend`` over a ``map``, no bytecode in between: an exception raised as a plain
    call returned would drop the reply with its fds), and until `fds` holds them, an exception
    closes every fd the reply brought that `fds` does not hold."""
    got: list[tuple[bytes, list[tuple[int, int, bytes]], int, Any]] = []
    try:
        got.extend(map(operator.methodcaller("recvmsg", n, _FD_SPACE, _CLOEXEC), (sock,)))
        data, ancdata, flags, _ = got[0]
        fds.extend(_fds_in(ancdata))  # one C call: every fd, or none, is in `fds`
    except BaseException:
        for fd in _fds_in(got[0][1]) if got else ():
            if fd not in fds:
                _close_quietly(fd)
        raise
    return data, flags


def _fds_in(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors in `ancdata` (``recvmsg``'s ancillary data: SCM_RIGHTS)."""
    out: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
            out.extend(got)
    return out
