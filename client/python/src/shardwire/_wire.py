"""Frames of the trainer socket (docs/TRAINER_API.md, protocol/src/trainer.rs).

A frame is ``len: u32 little-endian`` followed by ``len`` bytes of JSON (at most 1 MiB).
The ``attached`` reply carries the stream's region as one file descriptor (SCM_RIGHTS)
attached to the frame's first byte, so the prefix is read with ``socket.recv_fds``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

from ._errors import ConnectionClosed, ProtocolError

#: Protocol version this SDK speaks (``TRAINER_VERSION``).
VERSION = 1
#: Largest frame either side may send (``MAX_TRAINER_FRAME``).
MAX_FRAME = 1 << 20
#: Most fds accepted with one frame (the service sends exactly one, with ``attached``).
_MAX_FDS = 4
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_CTRUNC = getattr(socket, "MSG_CTRUNC", 0)
# EPIPE instead of SIGPIPE when the service is gone, even in hosts that do not ignore SIGPIPE.
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)

Message = dict[str, Any]


def encode(msg: Message) -> bytes:
    """One framed message: u32 LE length, then compact JSON."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"request of {len(body)} bytes exceeds the frame limit {MAX_FRAME}")
    return struct.pack("<I", len(body)) + body


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
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

    def send(self, *msgs: Message) -> None:
        """Sends one or more requests in one write (the service answers them in order)."""
        data = b"".join(encode(m) for m in msgs)
        try:
            self.sock.sendall(data, _NOSIGNAL)
        except OSError as e:
            raise ConnectionClosed(f"the node service connection failed while sending: {e}") from e

    def recv(self, want_fds: bool = False) -> tuple[Message, list[int]]:
        """Reads one reply; returns it and the fds that came with it (only if `want_fds`;
        the caller owns and must close them)."""
        fds: list[int] = []
        try:
            prefix = bytearray()
            while len(prefix) < 4:
                if want_fds:
                    data, got, flags, _ = socket.recv_fds(self.sock, 4 - len(prefix), _MAX_FDS, _CLOEXEC)
                    fds.extend(got)
                    if flags & _CTRUNC:
                        raise ProtocolError("file descriptors were truncated on receipt (too many fds, or the fd limit is reached)")
                else:
                    data = self.sock.recv(4 - len(prefix))
                if not data:
                    raise ConnectionClosed("the node service closed the connection")
                prefix += data
            (n,) = struct.unpack("<I", prefix)
            if n > MAX_FRAME:
                raise ProtocolError(f"reply of {n} bytes exceeds the frame limit {MAX_FRAME}")
            body = bytearray(n)
            view = memoryview(body)
            got_bytes = 0
            while got_bytes < n:
                k = self.sock.recv_into(view[got_bytes:])
                if k == 0:
                    raise ConnectionClosed("the node service closed the connection in the middle of a reply")
                got_bytes += k
        except OSError as e:
            _close_fds(fds)
            raise ConnectionClosed(f"the node service connection failed: {e}") from e
        except BaseException:
            _close_fds(fds)
            raise
        try:
            msg = json.loads(body)
        except ValueError as e:
            _close_fds(fds)
            raise ProtocolError(f"malformed reply from the node service: {e}") from e
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            _close_fds(fds)
            raise ProtocolError(f"reply without an op: {msg!r}")
        return msg, fds

    def close(self) -> None:
        """Closes the socket (the service then closes the stream and releases its leases)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
