"""Exceptions raised by the shardwire SDK.

Every error is a :class:`ShardwireError` with a stable machine-readable ``code`` and a
human-readable ``message``. Errors the node service reports keep the service's code
(see docs/TRAINER_API.md: ``unknown_dataset``, ``state_mismatch``, ``no_memory``, ...);
errors raised by the SDK itself use the codes below.

Every error pickles (``pickle.loads(pickle.dumps(e))`` is of the same class, with the same
code, message and attributes), so it crosses process boundaries (``multiprocessing.Pool``),
whatever its class's constructor takes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ShardwireError",
    "ServiceError",
    "Timeout",
    "ConnectionClosed",
    "ConnectError",
    "ProtocolError",
    "CudaImportError",
]


class ShardwireError(Exception):
    """Base class of every shardwire SDK error.

    Attributes:
        code: Stable machine-readable code (``"unknown_dataset"``, ``"timeout"``, ...).
        message: Human-readable detail.
    """

    code: str
    message: str

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without `__init__`: the subclasses take other arguments than `args`
        # (``Timeout(message)``, ``ConnectError(path, reason)``), which exceptions' default
        # `__reduce__` would pass them (``cls(*args)``: a TypeError, or a wrong message).
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))


def _rebuild(cls: type[ShardwireError], args: tuple[Any, ...], state: dict[str, Any]) -> ShardwireError:
    """A `cls` error with `args` and the attributes `state` (`ShardwireError.__reduce__`)."""
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class ServiceError(ShardwireError):
    """The node service answered with an ``error`` reply; ``code`` and ``message`` are its own."""


class Timeout(ShardwireError):
    """``Stream.next(timeout=...)`` got no batch in time (code ``"timeout"``). The stream stays
    usable: call ``next`` again to keep waiting."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


class ConnectionClosed(ShardwireError):
    """The connection to the node service ended (code ``"connection_closed"``): the service
    exited or dropped the connection. The stream is closed (later calls raise code
    ``"closed"``, except a socket stream's ``state_dict()``, which returns the position after
    the last batch handed out); the service released its leases."""

    def __init__(self, message: str) -> None:
        super().__init__("connection_closed", message)


class ConnectError(ShardwireError):
    """The trainer socket, or for :func:`shardwire.connect_http` the node's HTTP address,
    could not be reached (code ``"connect"``); the message names the socket path (the URL) and
    the reason.

    Attributes:
        path: The socket path (``bytes`` where one was given as bytes), or the URL
            (``http://HOST:PORT``).
    """

    def __init__(self, path: str | bytes, reason: str) -> None:
        # A bytes socket path (``connect(b"/run/...")``, which os.stat and connect take) is a
        # socket path: `bytes.startswith` would raise TypeError for a str prefix.
        is_url = isinstance(path, str) and path.startswith("http://")
        what = "the shardwire node's HTTP API at" if is_url else "the shardwire trainer socket"
        super().__init__("connect", f"cannot connect to {what} {path!r}: {reason}")
        self.path = path


class ProtocolError(ShardwireError):
    """The service said something this SDK does not understand (code ``"protocol"``): a
    version mismatch between SDK and service, or a bug. A socket stream that reads such a reply
    is closed (which request the replies after it answer can no longer be told): closing its
    connection releases its leases on the service, and later calls raise code ``"closed"``
    naming the fault (``state_dict()`` still returns the position after the last batch handed
    out)."""

    def __init__(self, message: str) -> None:
        super().__init__("protocol", message)


class CudaImportError(ShardwireError):
    """A ``memory = "cuda"`` region could not be imported (code ``"cuda"``): cuda-python or the
    NVIDIA driver is missing, the region's GPU is not visible to this process, or a CUDA driver
    call failed. The message says which and what to do (e.g. run the node with
    ``memory = "host"``).

    Attributes:
        call: The CUDA driver call that failed (``"cuInit"``, ``"cuMemMap"``, ...), or None.
        result: The ``CUresult`` name it returned (``"CUDA_ERROR_INVALID_VALUE"``, ...), or
            None when the call raised instead (e.g. libcuda could not be loaded).
    """

    def __init__(self, message: str, *, call: str | None = None, result: str | None = None) -> None:
        super().__init__("cuda", message)
        self.call = call
        self.result = result
