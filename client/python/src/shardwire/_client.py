"""Client, streams and batches of the trainer socket (docs/TRAINER_API.md).

Mirrors the Rust SDK (client/src/lib.rs): one Unix connection per stream, the stream's region
mapped read-only, batches of named tensors that are zero-copy views of that region. A
``memory = "cuda"`` region is imported with the CUDA driver instead (``_cuda.py``) and its
tensors are :class:`shardwire.CudaTensor` views in GPU memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import socket
import stat
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard, overload

import numpy as np

from . import _binary, _device, _wire
from ._arrow import ArrowExport
from ._cuda import _ON_GPU, CudaRegion, CudaTensor
from ._errors import ConnectError, ConnectionClosed, ProtocolError, ServiceError, ShardwireError
from ._options import StreamOptions, document
from ._tensor import RegionBytes, Tensor
from ._types import _WOKEN, StreamInfo, TensorView, _BatchBase, _int, _sized_dtype, _StreamBase, _tensor_view, _timeout_ms

if TYPE_CHECKING:  # pragma: no cover
    from ._http import HttpClient
    from ._options import StreamKeywords, Unpack

__all__ = [
    "DEFAULT_SOCKET",
    "SOCKET_ENV",
    "Batch",
    "Client",
    "Stream",
    "StreamInfo",
    "TensorView",
    "connect",
]

#: Socket path used when neither an argument nor ``$SHARDWIRE_SOCKET`` names one.
DEFAULT_SOCKET = "/run/shardwire/trainer.sock"
#: Environment variable naming the trainer socket.
SOCKET_ENV = "SHARDWIRE_SOCKET"

@overload
def connect(path: str | os.PathLike[str] | None = None) -> Client: ...
@overload
def connect(path: None = None, *, url: str) -> HttpClient: ...


def connect(path: str | os.PathLike[str] | None = None, *, url: str | None = None) -> Client | HttpClient:
    """A :class:`Client` for the node service's trainer socket, or with `url` an
    :class:`shardwire.HttpClient` for its HTTP API (see :func:`shardwire.connect_http`).

    Args:
        path: Socket path; default ``$SHARDWIRE_SOCKET``, else ``/run/shardwire/trainer.sock``.
        url: The node's HTTP (admin) address, ``http://HOST:PORT``: tensors are then
            downloaded copies instead of shared memory. A `path` that is a URL
            (``SCHEME://...``) is taken as `url`.

    Raises:
        ConnectError: nothing at `path`, or it is not a Unix socket (the message names the path);
            or nothing answers at `url`, or the node refused its health check (the message
            holds the node's code and message).
        ValueError: a URL other than ``http://HOST:PORT`` (``https://`` included: the node's
            HTTP API is plain HTTP), or both a `path` and `url`.

    No connection is made here for a socket: each :meth:`Client.open_stream` opens its own.
    """
    if url is None and _is_url(path):
        url, path = path, None  # any scheme: `connect_http` refuses all but http:// by name
    if url is not None:
        if path is not None:
            raise ValueError("give either a socket path or url=, not both")
        from ._http import connect_http

        return connect_http(url)
    if path is None:
        path = os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConnectError(path, f"no such file (is `shardwire serve` running with --socket {os.fsdecode(path)}? set ${SOCKET_ENV} or pass the path)") from None
    except PermissionError:
        raise ConnectError(path, _denied(path)) from None
    except OSError as e:
        raise ConnectError(path, e.strerror or str(e)) from e
    if not stat.S_ISSOCK(st.st_mode):
        raise ConnectError(path, "not a Unix socket")
    return Client(path)


#: The start of a URL, ``SCHEME://`` (RFC 3986's scheme).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _is_url(path: object) -> TypeGuard[str]:
    """Whether `path` (a socket path as given) is a URL rather than a socket path: before, an
    ``https://node:7400`` was looked up as a file and refused as "no such file"."""
    return isinstance(path, str) and _URL.match(path) is not None


class Client:
    """A node service's trainer socket. Cheap: it only remembers the path; every
    :meth:`open_stream` makes its own connection (the protocol is one stream per connection),
    so streams are independent and may be used from different threads."""

    def __init__(self, path: str) -> None:
        #: The trainer socket path.
        self.path = path

    def __repr__(self) -> str:
        return f"shardwire.Client({self.path!r})"

    @document
    def open_stream(self, dataset: str | Mapping[str, float], **options: Unpack[StreamKeywords]) -> Stream:
        """Opens a stream of `dataset` for this rank.

        The keywords (all optional, keyword-only) are the fields of
        :class:`shardwire.StreamOptions`, listed below from there; the HTTP client
        (:meth:`shardwire.HttpClient.open_stream`) takes the same ones.

        Args:
            dataset: Dataset name, as the source serves it (``--dataset NAME=DIR``); or, for a
                **mixture** (batch mode), a mapping of dataset names to weights, e.g.
                ``{"web": 0.7, "code": 0.3}``: every global batch holds each dataset's exact
                share (rounded, the remainder carried to the next batch), each dataset read
                in its own order from its own cursor; the state resumes with the same or
                changed weights (see docs/TRAINER_API.md, "Mixtures").
            <stream keywords>

        Raises:
            TypeError: a keyword that is none of these (the message names it).
            ValueError: a value out of range, or a keyword without the one it needs (nothing
                is sent; the message names them).
            ConnectError: the socket cannot be reached.
            ServiceError: the service refused (``unknown_dataset``, ``unavailable``,
                ``bad_plan``, ``state_mismatch``, ``no_memory``, ...).
        """
        opts = StreamOptions.of(options, "Client.open_stream")
        req = {"op": "attach", **opts.attach_fields(dataset)}
        # Every batch reply then carries the state that resumes after it: the stream asks for
        # its next batch ahead of time (see Stream) and still knows the state of this one.
        req["batch_state"] = True
        # Batch replies in the binary form: read with a few struct calls, no JSON parse on
        # the training loop's path (the state stays JSON bytes until a checkpoint asks).
        req["batch_encoding"] = "binary"
        return Stream._open(self.path, req, auto_device=opts.device == _device.AUTO)

    def info(self) -> dict[str, Any]:
        """What the node serves: ``{"memory": "host" | "cuda", "lanes": [{"lane", "gpu",
        "uuid"}, ...]}`` (the trainer socket's ``info``; docs/TRAINER_API.md)."""
        conn = _wire.Conn(_connect(self.path))
        try:
            return _info(conn)
        finally:
            conn.close()


class _Hold:
    """What holds a kept batch's lease: the batch and each of its tensors refer to it, so a
    tensor kept after its batch is dropped (``x = stream.next().keep()["x"]``) still holds the
    lease its bytes lie in. A kept batch's lease is released (with the stream's next request)
    when this is collected: once the batch and the last of its tensors (and views of them,
    DLPack imports included) are gone. While the batch is kept it holds the stream too: a
    tensor, like its batch, keeps the stream, whose connection holds the lease, open. Nothing
    refers back to it, so no reference cycle waits for the garbage collector."""

    __slots__ = ("stream", "__weakref__")

    def __init__(self) -> None:
        #: The stream, from keep() to release().
        self.stream: Stream | None = None


def _tensor(region: np.ndarray | CudaRegion, v: TensorView, dt: np.dtype[Any] | None = None, hold: _Hold | None = None) -> Any:
    """A read-only numpy view of tensor `v` in `region` (the stream's region as one byte array,
    no copy); a CudaTensor for a CUDA region. `dt`: `v`'s dtype already checked against its
    length (see ``_sized_dtype``). `hold`: what holds the lease of the tensor's batch, kept by
    the tensor (see `_Hold`)."""
    if dt is None:
        dt = _sized_dtype(v)
    if v.offset < 0 or v.offset + v.length > len(region):
        raise ProtocolError(f"tensor {v.name!r}: bytes {v.offset}..{v.offset + v.length} lie outside the region of {len(region)} bytes")
    t: Tensor | CudaTensor
    try:
        if isinstance(region, CudaRegion):
            t = region.tensor(v.offset, v.length, dt, v.shape)
        else:
            # One constructor call: read-only because the region's buffer is. Its base is the
            # byte array, which holds the mapping's buffer export (numpy does not hold one for
            # an array made this way): while the tensor lives, the stream cannot unmap the
            # region. (A RegionBytes: see there why not a plain ndarray.)
            t = Tensor(v.shape, dt, buffer=region, offset=v.offset)
    except ValueError as e:  # a shape numpy cannot make (more than 64 dims, too big)
        raise ProtocolError(f"tensor {v.name!r}: shape {list(v.shape)} of {dt} cannot be viewed: {e}") from e
    t._hold = hold
    return t


#: The request :meth:`Stream._send_next` records as in flight (its bytes are encoded apart).
_NEXT = {"op": "next"}
#: Batches one ``next`` asks for: the service answers with the first and those ready at once
#: after it (in batch mode it keeps 2 to 8 assembled ahead, as the stream's memory allows), so
#: a loop pays one request and one receive per several batches; the leases of the batches
#: handed out meanwhile go with the next request.
_NEXT_COUNT = 8
#: How much longer than a `next` timeout the SDK waits for the node's own `timeout` answer.
_NODE_TIMEOUT_SLACK = 5.0
#: How often a `next` that waits while batches are kept sends the releases other threads
#: handed it (see `Stream._release`), and how often such a release looks for that wait.
_HANDOFF_POLL = 0.1
#: Why a stream whose connection was lost is closed (later calls raise ``closed`` saying so).
_LOST = "the connection to the node service was lost"


class Batch(_BatchBase):
    """One leased batch (one shard): a read-only mapping from tensor name to numpy array.

    Each array is a zero-copy, read-only view of the stream's mapped region
    (``arr.flags.writeable`` is False; assigning raises ``ValueError``), of type
    :class:`shardwire.Tensor` (an ``ndarray`` subclass) so that DLPack works for every consumer
    without a copy: ``np.from_dlpack``, ``torch.from_dlpack``, ``jax.dlpack.from_dlpack``.
    torch has no read-only tensors: an in-place write through a tensor made from one of these
    arrays without a copy kills the process (SIGSEGV; the mapping is read-only): ``.clone()``
    first.

    **Lifetime (auto-release policy).** A batch holds a lease on its bytes in the region. When
    the trainer takes the next batch from the stream (``next`` or the next loop iteration), the
    previous batch is released automatically, unless :meth:`keep` was called on it; a kept batch
    stays leased until :meth:`release` (or leaving a ``with batch:`` block, or closing the
    stream). Releasing twice is a no-op.

    **Using a released batch is a user error**: numpy views cannot be revoked, so its arrays
    stay readable, but the service reuses the bytes for later shards and they may change at
    any time. Copy what you need to keep (``np.array(arr)``), or :meth:`keep` the batch.

    **CUDA regions** (``stream.info.memory == "cuda"``): the tensors are
    :class:`shardwire.CudaTensor` views in GPU memory instead (``torch.from_dlpack(t)``,
    ``cupy.from_dlpack(t)``, ...; numpy and Arrow export raise TypeError). Releasing such a
    batch first waits for the GPU work queued so far (``cuCtxSynchronize``), so that no kernel
    still reads its bytes when the service reuses them.

    **Arrow.** ``pyarrow.record_batch(batch)`` (Arrow PyCapsule protocol) or
    :meth:`to_arrow` gives the batch as a record batch that shares the region's memory (no
    copy): one column per tensor, one row per element of the leading dimension, N-D tensors as
    ``arrow.fixed_shape_tensor`` columns. Needs pyarrow (optional). The lifetime rules above
    apply to the Arrow arrays too. See ``shardwire._arrow``.

    Attributes:
        lease: Lease id (as the service knows it).
        epoch: Epoch of this batch.
        index: Index of this batch within its epoch (for this rank).
        shard: Shard index in the dataset's manifest.
        views: Where each tensor lies in the region.
    """

    __slots__ = ("_stream", "_released", "_on_drop", "_hold")

    _NAME = "Batch"

    #: The stream that handed this batch out; None while it is built ahead of its turn (a
    #: batch the stream still holds must not hold the stream: see ``Stream._held``).
    _stream: Stream

    def __init__(self, stream: Stream | None, lease: int, epoch: int, index: int, shard: int, views: list[TensorView],
                 region: np.ndarray | CudaRegion, dtypes: list[np.dtype[Any]] | None = None) -> None:
        self._stream = stream  # type: ignore[assignment]  # set at hand-out when None
        self._released = False
        #: Once kept: releases the lease when the batch and its tensors are all garbage-collected
        #: before release() (a finalizer of `_hold`).
        self._on_drop: weakref.finalize | None = None
        #: What holds the lease once kept, with every tensor (see `_Hold`).
        self._hold = hold = _Hold()
        if dtypes is None:
            tensors = {v.name: _tensor(region, v, None, hold) for v in views}
        else:
            tensors = {v.name: _tensor(region, v, dt, hold) for v, dt in zip(views, dtypes)}
        super().__init__(lease, epoch, index, shard, views, tensors)

    def _repr_state(self) -> str:
        state = "released" if self.released else ("kept" if self._kept else "leased")
        return f" lease={self.lease} {state}"

    # --- Arrow (host memory only) -------------------------------------------------------------

    def to_arrow(self) -> Any:
        self._require_host("Arrow export")
        return super().to_arrow()

    to_arrow.__doc__ = ArrowExport.to_arrow.__doc__

    def arrow_columns(self) -> Any:
        self._require_host("Arrow export")
        return super().arrow_columns()

    arrow_columns.__doc__ = ArrowExport.arrow_columns.__doc__

    def _require_host(self, what: str) -> None:
        if self._stream.info.memory == "cuda":
            raise TypeError(f"{what} of batch {self.epoch}/{self.index}: its tensors {_ON_GPU}")

    # --- lifetime ----------------------------------------------------------------------------

    @property
    def released(self) -> bool:
        """True once released (explicitly, automatically, or because the stream closed)."""
        # (A batch built ahead of its turn has no stream yet: not released.)
        return self._released or (self._stream is not None and self._stream.closed)

    def keep(self) -> Batch:
        """Exempts this batch from auto-release: it stays leased (its bytes valid) until
        :meth:`release`. Returns the batch. Kept batches occupy stream memory: a trainer that
        keeps too many stalls its stream (the service fetches ahead only into free memory). A
        kept batch that is dropped (garbage-collected) without :meth:`release` is released with
        the stream's next request, once its tensors (and the views and DLPack imports of them)
        are gone too: a tensor keeps its batch's lease.

        Safe from a signal handler that interrupted this stream's own ``next`` in the same
        thread (``keep()`` a batch you read in a handler): that call does not release it then."""
        s = self._stream
        s._check_process()
        if s._in_handler():
            # The lock would never come (this thread's own call holds it). Marking the batch
            # without it is safe: the call claims the batch for release by checking `_kept`
            # both before and after it marks it released (see `Stream._defer_release`).
            return self._keep()
        return s._lock.run(self._keep)  # not while another thread's `next` releases it

    def _keep(self) -> Batch:
        s = self._stream
        if self.released:
            raise ShardwireError("released", f"batch {self.epoch}/{self.index} (lease {self.lease}) was already released; keep() must come before the next batch is taken")
        if self.lease not in s._kept_leases:
            s._kept_leases.add(self.lease)
            # The callback holds the stream's queue only (not the stream, nor this batch): it
            # may run anywhere, also inside the stream's own calls, so it only appends.
            self._on_drop = weakref.finalize(self._hold, s._dropped.append, self.lease)
            self._hold.stream = s
        return super().keep()

    def _let_go(self) -> None:
        """Once a kept batch is released: neither its finalizer nor its tensors' hold on the
        stream is needed any more."""
        if self._on_drop is not None:
            self._on_drop.detach()
        self._hold.stream = None

    def release(self) -> None:
        """Gives the batch's memory back to the service. A no-op if already released (also
        when another thread's ``next`` released it automatically at the same time)."""
        self._stream._release(self)


def _import_cuda(gpu: Any, fd: int, size: int) -> CudaRegion:
    """The ``memory = "cuda"`` region of an ``attached`` reply, imported (see ``_cuda.py``)."""
    if not isinstance(gpu, Mapping):
        raise ProtocolError(f"attached with memory \"cuda\" but gpu = {gpu!r}")
    try:
        bus_id, granularity = gpu["pci_bus_id"], _int(gpu["granularity"], "gpu.granularity")
        if not isinstance(bus_id, str):
            raise ProtocolError(f"the field gpu.pci_bus_id is {bus_id!r}, not a string")
        return CudaRegion(fd, size, pci_bus_id=bus_id, granularity=granularity)
    except (KeyError, ValueError, ProtocolError) as e:
        why = e.message if isinstance(e, ProtocolError) else f"{type(e).__name__}: {e}"
        raise ProtocolError(f"attached with memory \"cuda\": bad gpu {dict(gpu)!r}: {why}") from e


#: Longest wait for the node service to take a connection: a Unix `connect` waits only while
#: the listener's backlog is full (a node stopped, e.g. SIGSTOP, or wedged, with connections
#: queued), and beyond this it fails with ConnectError instead of hanging.
CONNECT_LIMIT = 10.0


def _send_timeout(sock: socket.socket, seconds: float) -> None:
    """Sets `sock`'s SO_SNDTIMEO (0: none), which bounds a blocking Unix `connect` (Python's
    ``settimeout`` does not: with it a full backlog fails at once, EAGAIN)."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", whole, int((seconds - whole) * 1e6)))


def _connect(path: str) -> socket.socket:
    """A connected trainer socket, or ConnectError saying what is wrong with `path`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _send_timeout(sock, CONNECT_LIMIT)
        sock.connect(path)
        _send_timeout(sock, 0)  # the writes are non-blocking anyway (see `_wire.Conn.send_bytes`)
    except FileNotFoundError:
        sock.close()
        raise ConnectError(path, f"no such file (is `shardwire serve` running with --socket {os.fsdecode(path)}?)") from None
    except ConnectionRefusedError:
        sock.close()
        raise ConnectError(path, "connection refused (a stale socket file: no node service is listening)") from None
    except PermissionError:
        sock.close()
        raise ConnectError(path, _denied(path)) from None
    except BlockingIOError:  # EAGAIN: SO_SNDTIMEO ran out with the backlog still full
        sock.close()
        raise ConnectError(path, (
            f"the node service took no connection within {CONNECT_LIMIT:g} s (its backlog is full: "
            "is it stopped, e.g. with SIGSTOP, or stuck? see its log and its admin /v1/status)"
        )) from None
    except OSError as e:
        sock.close()
        raise ConnectError(path, e.strerror or str(e)) from e
    except BaseException:
        # A KeyboardInterrupt in the blocking connect (up to CONNECT_LIMIT), or any other
        # exception: the socket is no caller's yet, so it is closed here (before, it stayed
        # open while the traceback held it, and a connection the node had taken sat there
        # unattached until its request timeout).
        sock.close()
        raise
    return sock


#: Whether `os.access` can check with the effective ids (as `connect` is checked).
_EFFECTIVE = os.access in os.supports_effective_ids


def _dirs_above(path: str) -> list[str]:
    """The directories `path` lies in, from the root down."""
    out: list[str] = []
    d = os.path.dirname(os.path.abspath(path))
    while True:
        out.append(d)
        if os.path.dirname(d) == d:
            return out[::-1]
        d = os.path.dirname(d)


def _denied(path: str) -> str:
    """Why connecting to `path` was denied: the socket's real mode and owner (connecting takes
    write permission on it), or the directory on the way this process cannot search; or, when
    the mode lets this process write, that something else refused it."""
    who = f"this process runs as uid {os.geteuid()}, gid {os.getegid()}"
    try:
        st = os.stat(path)
    except OSError:
        blocked = next((d for d in _dirs_above(path) if not os.access(d, os.X_OK, effective_ids=_EFFECTIVE)), None)
        where = f"the directory {blocked}" if blocked is not None else "a directory on the way to it"
        return f"permission denied: {where} cannot be searched ({who}; it needs x permission there)"
    said = f"the socket is mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, group gid {st.st_gid}; {who}"
    if os.access(path, os.W_OK, effective_ids=_EFFECTIVE):
        # Not the mode: an SELinux or AppArmor policy, a seccomp filter (EPERM), or a
        # container whose namespace keeps it from the node's socket.
        return (f"permission denied ({said}): the mode allows this process, so a security module "
                "(SELinux/AppArmor), a seccomp filter or the container's namespace may deny it: see "
                "the audit log (e.g. `ausearch -m avc`, or `dmesg`) and the container's policy")
    return (f"permission denied ({said}; connecting needs write permission on it: run as a user or group "
            "it lets write, or set socket_mode in the node's config)")


def _attached_info(msg: dict[str, Any]) -> StreamInfo:
    """The stream an ``attached`` reply describes; ProtocolError naming what is missing or
    malformed (never a KeyError or a ValueError, which would read as a bad argument)."""
    try:
        info = StreamInfo(
            stream=_int(msg["stream"], "stream"),
            region_size=_int(msg["region_size"], "region_size"),
            batches_per_epoch=_int(msg["batches_per_epoch"], "batches_per_epoch"),
            epochs=_int(msg["epochs"], "epochs"),
            memory=str(msg["memory"]),
            state=dict(msg["state"]),
            gpu=dict(msg["gpu"]) if msg.get("gpu") is not None else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"attached reply without a well-formed {e!s}: {msg!r}") from e
    if info.region_size <= 0:
        raise ProtocolError(f"attached with region_size {info.region_size}")
    if info.memory not in ("host", "cuda"):
        raise ProtocolError(f"attached with memory {info.memory!r}, neither 'host' nor 'cuda'")
    return info


def _map_host(fd: int, size: int) -> mmap.mmap:
    """The host region the node passed (`fd`), `size` bytes, read-only."""
    # One that could shrink later would crash this process (SIGBUS) at a read past its new end:
    # the node's regions are memfds sealed against it. Checked first: a seal is never taken
    # off, so the size read next stays true.
    try:
        sealed = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        sealed = False
    if not sealed:
        raise ProtocolError("the region the node sent is not sealed against shrinking (F_SEAL_SHRINK): a read "
                            "after it shrank would crash this process (SIGBUS); the node seals its regions, so "
                            "this peer is not a shardwire node")
    try:
        have = os.fstat(fd).st_size
    except OSError as e:
        raise ShardwireError("map", f"cannot inspect the stream region's fd: {e}") from e
    if have < size:
        raise ProtocolError(f"attached with region_size {size}, but the region's fd holds {have} bytes")
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError as e:
        raise ShardwireError("map", f"cannot map the stream region ({size} bytes): {e}") from e


def _info(conn: _wire.Conn) -> dict[str, Any]:
    """The node's ``info`` answer on `conn` (ServiceError if it refuses)."""
    _send_unattached(conn, {"op": "info"})
    conn.await_reply(_wire.REPLY_LIMIT, "info")
    msg, _ = conn.recv()
    if msg.get("op") == "error":
        raise _service_error(msg)
    if msg.get("op") != "info":
        raise ProtocolError(f"unexpected answer to info: {msg!r}")
    if "memory" not in msg:
        raise ProtocolError(f"the node's info answer has no memory field: {msg!r}")
    lanes = msg.get("lanes", [])
    if not isinstance(lanes, list):
        raise ProtocolError(f"the node's info answer has lanes {lanes!r}, not a list: {msg!r}")
    return {"memory": str(msg["memory"]), "lanes": list(lanes)}


#: The error a node older than ``info`` answers it with (an op it does not know makes a
#: malformed request), before it closes the connection.
_OLD_NODE = "bad_request"


def _send_unattached(conn: _wire.Conn, req: dict[str, Any]) -> None:
    """Sends `req` (``info``, ``attach``) on `conn`, a connection with no stream yet. A node
    that refuses a new connection (``too_many_connections``, ``forbidden``), or closes one that
    did not attach in time (``timeout``), sends its error and closes it, so the send may fail
    (EPIPE) with that error already here: it is what raises (a ServiceError), not the broken
    pipe."""
    try:
        conn.send(req)
    except ConnectionClosed:
        if _wire.readable(conn.sock, 0):
            try:
                msg, _ = conn.recv()
            except ShardwireError:
                msg = {}
            if msg.get("op") == "error":
                raise _service_error(msg) from None
        raise


def _auto_device(conn: _wire.Conn, path: str) -> tuple[_wire.Conn, str | None]:
    """``device="auto"``: asks the node what it serves on `conn`; when it serves CUDA memory,
    the current CUDA device's bus id. A node too old for ``info`` answers it with
    ``bad_request`` and closes the connection: then a new one, and no device. Any other error
    raises as it came: a refusal the node sends on a new connection in place of any answer
    (``too_many_connections``, ``forbidden``), its ``timeout``, a connection that ended with no
    answer (`Stream._open` tries those two once more, asking ``info`` again), or none in time.
    Attaching without the device then would put the stream on another GPU's lane. The
    connection to attach on is returned."""
    try:
        info = _info(conn)
    except ServiceError as e:
        conn.close()
        if e.code != _OLD_NODE:
            raise
        return _wire.Conn(_connect(path)), None
    except BaseException:
        conn.close()  # a stuck node (NoAnswer) or one gone is not an old one: no fallback
        raise
    if info["memory"] != "cuda":
        return conn, None
    device = _device.current()
    if _wire.readable(conn.sock, 0):
        # The lookup may initialise CUDA (seconds), and the node closes a connection that has
        # not attached within trainer_request_timeout_secs (10 s by default), with a `timeout`
        # error: nothing else comes before the attach. Attach on a new connection then.
        conn.close()
        conn = _wire.Conn(_connect(path))
    return conn, device


class _AttachLate(Exception):
    """The node closed a connection before its attach arrived (`Stream._open`)."""


def _closed_unattached(e: ServiceError | ConnectionClosed) -> bool:
    """Whether `e`, raised before the attach was sent, says the node closed the connection
    for being late (its ``timeout``) or with no answer: then the attach may go again on a new
    connection. Not a refusal (``too_many_connections``, ...), nor a node that did not answer
    (``_wire.NoAnswer``: stuck, not closed)."""
    if isinstance(e, ServiceError):
        return e.code == "timeout"
    return not isinstance(e, _wire.NoAnswer)


def _service_error(msg: Mapping[str, Any]) -> ServiceError:
    """The ServiceError of an ``error`` message."""
    return ServiceError(str(msg.get("code")), str(msg.get("message")))


class _Held:
    """The batch a stream handed out last, until it is released: its lease, and the batch held
    weakly. A batch holds its stream (its bytes are a lease on it), so a stream holding its
    batches back would make a reference cycle, and a stream the trainer dropped without
    ``close()`` would keep its connection (and with it the node's leases and stream memory)
    until the garbage collector found the cycle. The lease is kept apart: a batch the trainer
    dropped is still released, once (`done`: a live batch says so itself, `Batch._released`)."""

    __slots__ = ("ref", "lease", "done")

    def __init__(self, b: Batch) -> None:
        self.ref = weakref.ref(b)
        self.lease = b.lease
        self.done = False


class _Taken:
    """A batch a `next` took and has not returned yet (``Stream._unclaimed``)."""

    __slots__ = ("batch", "before", "prev", "thread", "out")

    def __init__(self, b: Batch, before: tuple[dict[str, Any], bytes | None], prev: _Held | None) -> None:
        self.batch = b
        #: The stream's (`_resume`, `_resume_raw`) before it.
        self.before = before
        #: The batch handed out before it: the trainer's until this one is handed out.
        self.prev = prev
        #: The thread whose call takes it.
        self.thread = threading.get_ident()
        #: Set as that call has taken it whole, with the lock held: from then on it returns
        #: the batch (unless an exception strikes on the way, see `Stream._left`).
        self.out = False


def _shut_dropped(sock: socket.socket, pid: int, _how: int = socket.SHUT_RDWR) -> None:
    """The finalizer of a stream dropped without close(): shuts its connection down, so the
    node sees it end at once even while a process forked since holds a copy of the socket (a
    DataLoader worker's; a plain close of this process's copy would not end it). Only in the
    process that opened the stream: a forked child's copy must not end the parent's stream.
    (`_how` bound when the module loads, as in ``_wire.Conn.close``.)"""
    if os.getpid() == pid:
        try:
            sock.shutdown(_how)
        except OSError:
            pass


class Stream(_StreamBase[Batch]):
    """An open stream: iterate it for :class:`Batch` objects in plan order.

    Create with :meth:`Client.open_stream`. One stream is one Unix connection; closing it (or
    the process exiting, or dropping the last reference to it and to the batches it handed
    out: a batch, and a tensor of a kept batch, keeps its stream open) closes the stream on the
    service and releases all its leases.

    Iterating (``for batch in stream``) calls :meth:`next` until the stream ends. Taking a
    batch releases the previous one unless it was kept (see :class:`Batch`). Methods are
    thread-safe (one request at a time on the connection), but batches come in one order:
    iterate from one thread. A kept batch may be released from another thread while
    :meth:`next` waits (for instance for the memory that batch holds): the waiting call sends
    the release behind its request at once, and the service applies it while the request
    waits.

    **Ahead of time.** As soon as :meth:`next` returns a batch, the stream asks the service for
    the following one (releasing the previous batch in the same request), so the service
    answers while the trainer works on this batch and the next :meth:`next` finds the answer
    waiting: the hand-off costs no round trip on the training loop's critical path. Each
    request asks for up to ``_NEXT_COUNT`` batches, and the service adds to the first those
    ready at once, in one write; the stream asks again when it hands out the last of them,
    releasing the ones handed out before in that request. So a training loop pays one
    request and one receive per few batches, and the service holds up to that many leases
    beyond the trainer's. While the trainer keeps batches (:meth:`Batch.keep`) nothing is
    asked for ahead. Each batch reply carries the state that resumes after it, so
    :meth:`state_dict` needs no request. If the connection is lost, the batches whose
    answers had already arrived are still handed out; the :meth:`next` after them raises
    ConnectionClosed.

    Attributes:
        info: What the service said at open (stream id, batches per epoch, epochs, memory).
    """

    _NAME = "Stream"

    def __init__(self, conn: _wire.Conn, region: mmap.mmap | CudaRegion, info: StreamInfo) -> None:
        super().__init__(info)
        self._conn = conn
        self._mmap = region if isinstance(region, mmap.mmap) else None
        self._cuda = region if isinstance(region, CudaRegion) else None
        self._region: memoryview | CudaRegion | None = region if self._cuda is not None else memoryview(region)
        #: What batch tensors are views of: the host region as one byte array (it holds the
        #: buffer export that keeps the mapping while any tensor lives), or the CudaRegion.
        self._base: np.ndarray | CudaRegion | None = (
            self._cuda if self._cuda is not None else np.frombuffer(self._region, np.uint8).view(RegionBytes)
        )
        #: The batch handed out last, until it is released (see `_Held`).
        self._held: _Held | None = None
        #: Requests sent whose replies are not read yet ("next" asked ahead, "release"), in order.
        self._inflight: deque[str] = deque()
        #: The state that resumes after the last batch handed to the trainer; while
        #: `_resume_raw` is set, that state is its JSON, decoded when asked for.
        self._resume: dict[str, Any] = dict(info.state)
        self._resume_raw: bytes | None = None
        #: Leases of kept batches not yet released: while there are any, no batch is asked
        #: for ahead of time (a trainer that keeps batches may fill the stream's memory, and
        #: the batches asked for would wait for its releases).
        self._kept_leases: set[int] = set()
        #: True while a `next` waits with batches kept (`_next_answer_polling`).
        self._waiting = False
        #: Marks a batch released once, whichever thread releases it.
        self._mark = threading.Lock()
        #: Leases of kept batches garbage-collected before release() (appended by their
        #: finalizers, at any moment), or released from another thread while a `next` waited
        #: (`_hand_over`): released with the next request, or sent behind the waiting one
        #: (`_drain_dropped`).
        self._dropped: deque[int] = deque()
        #: Leases of batches the trainer is done with (auto-released) whose release rides on
        #: the next request: sent while more answers to the one in flight are still coming.
        self._pending: list[int] = []
        #: The connection loss that the request sent ahead of time after the last batch of an
        #: answer met: that batch was handed out; the next call raises this (see `_ask_ahead`).
        self._lost: ConnectionClosed | None = None
        #: The batch a call took (`_hand_out`) and has not returned yet. Set as the batch is
        #: taken (its state is then `_resume`), cleared as `next` returns it
        #: (`_StreamBase.next`). An exception that strikes in between (an interrupt while the
        #: release that goes with it is sent, or as the lock is let go) leaves it here: the
        #: next call hands it out, and until then the trainer's state is the one before it
        #: (`_trainer_state`). The batch before it is the trainer's until then (released with
        #: that hand-out unless it was).
        self._unclaimed: _Taken | None = None
        #: Shuts the connection down if the stream is dropped without close() (see
        #: `_shut_dropped`); detached at close.
        self._finalizer = weakref.finalize(self, _shut_dropped, conn.sock, self._pid)

    @classmethod
    def _open(cls, path: str, req: dict[str, Any], auto_device: bool = False) -> Stream:
        """Opens a stream (see `_open_once`); once more, on a new connection, where the node
        closed the first before its attach arrived: it allows trainer_request_timeout_secs
        (10 s by default) from connecting, and this process may be held up meanwhile (a
        garbage collection that frees a DataLoader iterator joins its workers, 5 s each). No
        stream exists then, so the attach is safe to send again."""
        try:
            return cls._open_once(path, req, auto_device, late_ok=True)
        except _AttachLate:
            return cls._open_once(path, req, auto_device, late_ok=False)

    @classmethod
    def _open_once(cls, path: str, req: dict[str, Any], auto_device: bool, late_ok: bool) -> Stream:
        """Connects, attaches and maps the stream's region. With `late_ok`, a node that closed
        the connection before the attach (a send fails, or the answer is its ``timeout``
        error: the only one it gives an unattached connection it accepted) raises
        `_AttachLate`."""
        conn = _wire.Conn(_connect(path))
        fds: list[int] = []
        try:
            try:
                if auto_device:
                    conn, device = _auto_device(conn, path)
                    if device is not None:
                        req = {**req, "device": device}
                _send_unattached(conn, req)
            except (ServiceError, ConnectionClosed) as e:
                if late_ok and _closed_unattached(e):
                    raise _AttachLate from e
                raise
            conn.await_reply(_wire.ATTACH_LIMIT, "attach")
            msg = conn.recv_fds(fds)  # into `fds` as they arrive: closed below, whatever strikes
            op = msg["op"]
            if op == "error":
                err = _service_error(msg)
                if late_ok and err.code == "timeout":
                    raise _AttachLate from err
                raise err
            if op != "attached":
                raise ProtocolError(f"unexpected answer to attach: {msg!r}")
            if len(fds) != 1:
                raise ProtocolError(f"attached came with {len(fds)} file descriptors, expected the region's one")
            info = _attached_info(msg)
            region: mmap.mmap | CudaRegion
            if info.memory == "cuda":
                region = _import_cuda(info.gpu, fds[0], info.region_size)
            else:
                region = _map_host(fds[0], info.region_size)
        except BaseException:
            conn.close()
            raise
        finally:
            _wire._close_fds(fds)  # the mapping keeps the memfd (or CUDA allocation) alive
        return cls(conn, region, info)

    # --- requests ----------------------------------------------------------------------------

    def _answer(self, op: str) -> dict[str, Any]:
        """The next answer, to a request `op` the node answers at once, taken (`_consume`). A
        lost connection, or no answer within ``_wire.REPLY_LIMIT``, ends the stream (see
        ``_broken``) and raises ConnectionClosed."""
        reply = self._read(_wire.REPLY_LIMIT)
        if reply is None:
            why = f"the node service did not answer {op} within {_wire.REPLY_LIMIT:g} s"
            self._broken(why)
            raise ConnectionClosed(why)
        self._consume()
        return reply[1]

    def _send(self, req: dict[str, Any], data: bytes | None = None) -> None:
        """Sends `req` (already encoded as `data`, if given); its answer is read, in order,
        by :meth:`_read`. A lost connection ends the stream (see ``_broken``) and raises
        ConnectionClosed."""
        try:
            self._post(req, data)
        except ConnectionClosed as e:
            if self._interrupted:  # close() shut the connection down: not a lost one
                raise self._closed_meanwhile() from e
            self._broken(f"{_LOST}: {e}")
            raise

    def _post(self, req: dict[str, Any], data: bytes | None = None) -> None:
        """`_send` without ending the stream when the connection is lost (ConnectionClosed
        raises all the same): for a caller that ends it later (see `_ask_ahead`).

        The request is in flight from before its first byte goes out. An exception (a signal
        handler's, Ctrl-C's) that strikes while the stream waits for room to write, before
        any of it went out, takes it back; one that strikes during a write (where CPython
        raises a signal handler's exception, before the count of bytes written is known), or
        after part of it went out, ends the stream (``_wire.TORN``): the node would take the
        next request for the rest of a request cut short. Only one that strikes after a write
        is counted leaves the request in flight, its answer paired with it."""
        data = data if data is not None else _wire.encode(req)
        conn = self._conn
        conn.unsent = len(data)  # none of it out yet (not the 0 the last request left)
        before = len(self._inflight)
        conn.owed = before  # the requests ahead of this one whose last answer is still to come
        try:
            self._inflight.append(req["op"])
            conn.send_bytes(data)
        except BaseException as e:
            # A failed connection (ConnectionClosed) is ended by the caller, naming its cause.
            if conn.torn and not isinstance(e, ConnectionClosed):
                self._broken(_wire.TORN)
            elif conn.unsent:
                while len(self._inflight) > before:
                    self._inflight.pop()
            raise

    def _sent(self, before: int) -> bool:
        """True when the request a `_send` or `_post` began when ``_inflight`` held `before`
        requests went out: its record is still there, even after an exception (see `_post`)."""
        return len(self._inflight) > before

    def _read(self, timeout: float | None) -> tuple[str, dict[str, Any]] | None:
        """The next answer and the op of the request it answers, or None if none came within
        `timeout` (None: wait as long as it takes). Both stay where they are (the answer on
        the connection, the op in ``_inflight``) until the caller takes them (`_consume`) as
        it acts on the answer: an exception that strikes before (a signal handler's) loses
        neither, and the next call reads the same answer."""
        try:
            ready = timeout is None or self._conn.pending()
            if not ready and not _wire.readable(self._conn.sock, timeout):
                return None
            msg = self._conn.peek_reply()
        except ConnectionClosed as e:
            if self._interrupted:
                raise self._closed_meanwhile() from e
            self._broken(_LOST)
            raise
        except OSError as e:
            if self._interrupted:
                raise self._closed_meanwhile() from e
            self._broken(f"the connection to the node service failed: {e}")
            raise ConnectionClosed(f"the node service connection failed: {e}") from e
        except ProtocolError as e:
            self._malformed(e)
            raise
        if not self._inflight:
            stray = ProtocolError(f"an answer to no request: {msg!r}")
            self._malformed(stray)
            raise stray
        return self._inflight[0], msg

    def _consume(self, more: bool = False) -> None:
        """Takes the answer `_read` returned off the connection and, unless `more` answers to
        the same request follow, its request off ``_inflight``. Two deletions and no call:
        CPython raises a signal handler's exception at a function's entry or right after a C
        call returns, so one that strikes here strikes before both (and the answer is read
        again), never between them (which would pair later answers with the wrong requests).
        On 3.10 one can also strike as this returns (there a Python call's return checks for
        signals): where what follows must not be lost then (a batch's hand-out, the end), the
        caller writes the deletions inline, directly before its stores."""
        del self._conn._ready[0]  # the answer `_wire.Conn.peek_reply` left there
        if not more:
            del self._inflight[0]

    def _interrupt(self) -> None:
        # A call waiting on the socket sees it end at once (shutdown wakes a blocked recv).
        try:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _closed_meanwhile(self) -> ShardwireError:
        """The error of a call woken by :meth:`close` from another thread or a signal handler,
        or that finds it came (the stream is closed here too; the connection is shut down
        already, so the node is not told)."""
        self._broken(_WOKEN)
        return self._woken()

    def _malformed(self, e: ProtocolError) -> None:
        """A reply this SDK cannot read (`e`): which request the replies after it answer can no
        longer be told, so the stream ends here; closing the connection releases every lease
        it holds on the node (the batch in the trainer's hands too). Later calls raise
        ``closed`` naming `e`. Call with the lock held."""
        if not self._closed:
            self._broken(f"a malformed reply from the node service closed it ({e.message})")

    def _settle(self) -> None:
        """Reads the answers of releases sent while a `next` was in flight (an error among
        them raises). Stops at a `next` still in flight."""
        while self._inflight and self._inflight[0] == "release":
            self._check_released(self._answer("release"))

    def _check_released(self, msg: dict[str, Any]) -> None:
        """Checks the answer `msg` to a ``release``: ``released``; an ``error`` raises
        ServiceError; anything else closes the stream (see `_unexpected`)."""
        if msg["op"] != "released":
            raise _service_error(msg) if msg["op"] == "error" else self._unexpected("release", msg)

    def _unexpected(self, op: str, msg: dict[str, Any], why: str = "") -> ProtocolError:
        """The error of an answer `msg` that the request `op` never has (`why`: what is wrong
        with it, when not its op). Which request the answers after it answer can no longer be
        told, so the stream is closed first (as for a reply that cannot be read, `_malformed`;
        the Rust SDK's ``broke``)."""
        e = ProtocolError(f"unexpected answer to {op}{f' ({why})' if why else ''}: {msg!r}")
        self._malformed(e)
        return e

    def next(self, timeout: float | None = None) -> Batch | None:
        """The next batch in plan order, or None when every epoch was delivered.

        Releases the previous batch unless it was kept (see :class:`Batch`), in the next
        request that asks for batches ahead (see "Ahead of time" above).

        Args:
            timeout: Seconds to wait for the batch (None: wait as long as it takes; 0: take
                a batch that is ready, else raise Timeout without waiting).

        Raises:
            Timeout: no batch within `timeout`. The stream stays usable: a request this call
                sent is ended by the service; one the stream had sent ahead of time stays in
                flight, and a later ``next`` takes its answer. A request this call sent carried
                the previous batch's release, so that batch is released even though no batch
                came (``keep()`` it first to go on using it).
            ServiceError: e.g. code ``"closed"`` if the service closed the stream.
            ConnectionClosed: the service went away. Batches whose answers had arrived before
                are handed out first (each with its state); the call after the last of them
                raises, and the stream is closed.
            ProtocolError: a reply this SDK cannot read. The stream is closed: its connection
                is, which releases every lease it held on the node (the previous batch's
                too); later calls raise code ``"closed"`` naming the reply's fault, but
                :meth:`state_dict`, after either error, returns the position after the last
                batch handed out (to resume from).

        A KeyboardInterrupt (or another exception raised into the wait, e.g. by a signal
        handler) consumes nothing: the stream stays usable and a request already sent stays in
        flight for a later ``next`` to take its answer. The previous batch stays the trainer's
        (released with a later request) unless this call sent a request of its own (the first
        call, one after a timeout, or while batches are kept), which carried its release, as
        for a timeout: ``keep()`` it first to go on using it. One that strikes while a batch
        that has arrived is handed out, up to this call's return, consumes nothing either: the
        next call returns that batch, and :meth:`state_dict` does not name the position after
        it until then (one that strikes in the caller's frame as this returns, where Python
        3.10 checks for signals, is the caller's: the batch is lost there). A release it cuts
        short before its request went out goes with a later request. One that strikes while a
        request is being written consumes nothing either, unless the request
        may have gone out in part: then the stream is closed (code ``"closed"``;
        :meth:`state_dict` still resumes).
        """
        # `_StreamBase.next`'s steps, not a call of it: on 3.10 an exception can strike as a
        # Python call returns, and `_unclaimed` is cleared (or left) in the frame that returns
        # to the caller (see there).
        try:
            b = self._next(timeout)
            if self._owns(b):  # not another thread's record, made since this call let go
                self._unclaimed = None  # then no call until the return
        except BaseException:
            self._left()
            raise
        return b

    def _owns(self, b: Any) -> bool:
        taken = self._unclaimed
        return taken is not None and taken.batch is b

    def _take(self, timeout: float | None) -> Batch | None:
        """The next batch, on an open stream that has not ended (lock held); it stays
        `_unclaimed` until `next` returns it."""
        taken = self._unclaimed
        if taken is not None and not self._returned(taken):
            # Taken by a call that raised before it returned it: handed out now (its state is
            # `_resume` already). The batch before it goes too, unless it was released
            # already (a second claim is a no-op, see `_defer_release`).
            taken.thread = threading.get_ident()  # this call's: a late `_left` of the other leaves it be
            self._defer_release(taken.prev)
            taken.batch._stream = self  # let go of while it waited (see `_left`)
            taken.out = True
            return taken.batch
        self._unclaimed = None  # (a batch another thread's call is returning: that call's)
        if self._lost is not None:
            # The request ahead of time after the batch handed out last could not be sent.
            lost, self._lost = self._lost, None
            self._broken(_LOST)
            raise lost
        try:
            return self._take_answer(timeout)
        except ProtocolError as e:
            self._malformed(e)
            raise

    def _take_answer(self, timeout: float | None) -> Batch | None:
        """`_take` on a healthy connection. The previous batch (``_held``) stays the trainer's
        until a batch is handed out or the stream ends: whatever raises before that (a timeout,
        an error answer, an interrupt while waiting) leaves it to a later call."""
        started, left = time.monotonic(), timeout
        while True:
            if self._inflight and self._inflight[0] == "release":
                self._settle()
            self._drain_dropped()
            wait = left
            sent_now = "next" not in self._inflight
            if sent_now:
                # A request sent now carries the timeout: the node ends it, so nothing stays in
                # flight (a release after a timeout is then answered at once, not queued behind
                # a request that may wait for the memory it frees). The read waits a little
                # longer. It carries the previous batch's release too (unless kept).
                self._send_next(self._held, left)
                wait = None if left is None else left + _NODE_TIMEOUT_SLACK
            msg = self._next_answer(wait, timeout)  # not taken yet (see `_read`)
            kind = msg["op"]
            if kind == "batch":
                return self._hand_out(msg)
            if msg.get("more"):
                # Only a batch has answers after it. Honoured here, `more` would leave a `next`
                # in flight that the node never answers: the next call would wait for ever.
                raise self._unexpected("next", msg, "`more` set on an answer that is not a batch")
            if kind == "end":
                self._end()
                return None
            self._consume()
            if kind == "timeout" and not sent_now:
                # The node's late answer to a timed request an earlier call gave up waiting
                # for: this call asks again, within what is left of its own timeout (a Timeout
                # still names the timeout the caller gave).
                if timeout is not None:
                    left = max(0.0, timeout - (time.monotonic() - started))
                continue
            if kind == "timeout":
                raise self._timeout(timeout)
            if kind == "error":
                raise _service_error(msg)
            raise self._unexpected("next", msg)

    def _next_answer(self, wait: float | None, timeout: float | None) -> dict[str, Any]:
        """The next answer to the `next` in flight, after those to the releases sent before
        it; Timeout (naming `timeout`) if none came within `wait` (it stays in flight)."""
        if self._kept_leases:
            return self._next_answer_polling(wait, timeout)
        while True:
            reply = self._read(wait)
            if reply is None:
                raise self._timeout(timeout)
            if (msg := self._next_reply(reply)) is not None:
                return msg

    def _next_answer_polling(self, wait: float | None, timeout: float | None) -> dict[str, Any]:
        """`_next_answer` while batches are kept: another thread may release one, and the
        request may be waiting for the memory it holds. Every ``_HANDOFF_POLL`` s the releases
        handed over meanwhile (`_release`) are sent behind the request; the service applies
        them while the request waits."""
        deadline = None if wait is None else time.monotonic() + wait
        self._waiting = True
        try:
            while True:
                if self._dropped:
                    self._drain_dropped()
                    self._send_pending()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                # At least one read, even with no time left (a zero timeout): an answer already
                # here is taken (before, a loop of `next(timeout=0)` never got the batch asked
                # ahead of time).
                reply = self._read(_HANDOFF_POLL if left is None else min(left, _HANDOFF_POLL))
                if reply is None:
                    if left == 0:
                        raise self._timeout(timeout)
                    continue
                if (msg := self._next_reply(reply)) is not None:
                    return msg
        finally:
            self._waiting = False

    def _next_reply(self, reply: tuple[str, dict[str, Any]]) -> dict[str, Any] | None:
        """The answer `reply` if it answers the `next` in flight, not taken yet (`_take_answer`
        takes it as it acts on it); None for the answer to a release sent before it, taken (an
        error among those raises)."""
        op, msg = reply
        if op == "next":
            return msg
        self._consume()
        self._check_released(msg)
        return None

    def _send_pending(self) -> None:
        """Sends the releases that wait for a request as requests of their own, behind the
        `next` in flight (their answers come after its own)."""
        if not self._pending:
            return
        self._gpu_done()
        while self._pending:
            self._send_release(0)

    def _send_release(self, at: int) -> None:
        """Sends the release of ``_pending[at]`` as a request of its own, behind those in
        flight (after the GPU's wait, which the caller did). It leaves `_pending` as it goes
        out; an exception before any of it went out puts it back (see `_send_next`)."""
        lease, before = self._pending[at], len(self._inflight)
        del self._pending[at]  # the request's from here (see `_send_next`)
        try:
            self._send({"op": "release", "lease": lease})
        except BaseException:
            if not self._sent(before):
                self._pending[at:at] = [lease]
            raise

    def _hand_out(self, msg: dict[str, Any]) -> Batch:
        """The batch of answer `msg`, now the trainer's; the previous one is released (unless
        kept) with the next request, or now when none goes ahead of time.

        All or nothing, whatever exception strikes (a signal handler's, Ctrl-C's): the batch is
        taken whole (its answer off the connection, its state the stream's, the batch
        `_unclaimed` until `next` returns it, else the next call hands it out) or not at all
        (its answer is read again by the next call). `state_dict()` never names the position
        after a batch `next` did not return."""
        self._drain_dropped()  # first: a kept batch dropped may be `prev`
        # Everything that can raise comes first and changes nothing of the stream's: the
        # answer stays on the connection (see `_read`).
        b, state = self._batch(msg)
        held, more = _Held(b), bool(msg.get("more"))
        taken = _Taken(b, (self._resume, self._resume_raw), self._held)
        # The hand-out: the answer taken (the `next` too unless `more` answers follow), then
        # stores only, with no call from the first deletion to the last store (not even
        # `_consume`'s return, where 3.10 checks for signals): no handler's exception lands in
        # between.
        del self._conn._ready[0]  # the answer `_wire.Conn.peek_reply` left there
        if not more:
            del self._inflight[0]
        self._resume, self._resume_raw = state
        self._held = held
        b._stream = self  # from now on the batch holds the stream
        self._unclaimed = taken
        # What strikes from here until `next` returns `b` (an interrupt while a release is
        # answered, the answer's error, or as the lock is let go) leaves it `_unclaimed`: the
        # next call hands it out. Nor does it cost `taken`'s batch before it (`prev`): struck
        # before it was claimed (while the group was built), it stays the trainer's until `b`
        # is handed out, and is released then (claimed already, it is done: nothing more).
        self._after_take(msg, taken.prev)
        taken.out = True  # taken whole: `next` returns it from here (see `_Taken.out`)
        return b

    def _after_take(self, msg: dict[str, Any], prev: _Held | None) -> None:
        """What handing out the batch of `msg` sets off: the rest of its group built, and
        `prev` released (unless kept) with the next request, or now when none goes ahead."""
        if "batch" not in msg:  # the first of the replies that came together: build the rest
            self._build_ahead()
        if "next" in self._inflight:
            self._defer_release(prev)  # more answers are on their way: no request yet
        elif not self._kept_leases:
            self._ask_ahead(prev)
        else:
            queued = len(self._pending)
            self._defer_release(prev)
            # Answers to releases sent behind the last request still due: the next call reads
            # them (and raises an error among them, not this call); the lease goes with its
            # request. Else no request ahead carries it: it goes now, on its own. It waits in
            # `_pending` until it went out: an exception before leaves it to the next request.
            if not self._inflight and len(self._pending) > queued:
                self._gpu_done()
                self._send_release(queued)
                self._settle()

    def _batch(self, msg: dict[str, Any]) -> tuple[Batch, tuple[dict[str, Any], bytes | None]]:
        """The Batch of a `batch` answer, and the state that resumes after it (as `_resume`,
        `_resume_raw`), which `_hand_out` makes the stream's; nothing of the stream changes
        here. A binary answer is the one `_wire` marked so (``_wire.BINARY``)."""
        if _wire.BINARY not in msg:
            return self._json_batch(msg)
        b = msg.get("batch")  # binary (see shardwire._binary): built ahead (`_build_ahead`), or now
        if b is None:
            b = self._binary_batch(msg)
        if msg["state_raw"] is None:
            raise ProtocolError("a batch without its state: the node service is older than this SDK")
        return b, (self._resume, msg["state_raw"])

    def _json_batch(self, msg: dict[str, Any]) -> tuple[Batch, tuple[dict[str, Any], bytes | None]]:
        """The Batch of a JSON `batch` answer (the node sends one where the binary form cannot
        hold it); a field missing or of the wrong type is a ProtocolError naming it."""
        if "state" not in msg:
            raise ProtocolError("a batch without its state: the node service is older than this SDK")
        try:
            views = [_tensor_view(t) for t in msg["tensors"]]
            lease, epoch, index, shard = (_int(msg[k], k) for k in ("lease", "epoch", "index", "shard"))
            b = Batch(None, lease, epoch, index, shard, views, self._base)
            state = dict(msg["state"])
        except KeyError as e:
            raise ProtocolError(f"a batch answer without the field {e}: {msg!r}") from e
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"a batch answer with a field this SDK cannot read ({e}): {msg!r}") from e
        return b, (state, None)

    def _end(self) -> None:
        """The `end` answer: taken, the stream ended, and the releases that wait go now
        (`_release_at_end`)."""
        # Deletions and a store, with no call between them (see `_consume`).
        del self._conn._ready[0]
        del self._inflight[0]
        self._ended = True
        self._release_at_end()

    def _after_end(self) -> None:
        # What an exception left of `_release_at_end`, or kept batches dropped since the end.
        if self._held is not None or self._pending or self._dropped or self._inflight:
            self._release_at_end()

    def _release_at_end(self) -> None:
        """After the `end` answer: the previous batch and those whose release waited go now
        (nothing follows to carry them), every one of them even if the node refuses one (the
        first refusal raises after the last is answered). Each lease waits in `_pending` until
        it went out: what an exception leaves undone, the next call does (`_after_end`)."""
        self._drain_dropped()
        self._defer_release(self._held)
        self._held = None  # claimed (or kept): nothing more to do for it
        # All are sent before any answer is read: one refused must not stop the others.
        self._send_pending()
        refused: ServiceError | None = None
        while self._inflight and self._inflight[0] == "release":  # only releases, after the end
            try:
                self._settle()
            except ServiceError as e:
                refused = refused or e
        if refused is not None:
            raise refused

    def _binary_batch(self, msg: dict[str, Any]) -> Batch:
        """The Batch of a decoded binary reply, without its stream (see `_Held`), which
        `_hand_out` sets when it hands it out."""
        return Batch(None, msg["lease"], msg["epoch"], msg["index"], msg["shard"], msg["views"], self._base, msg["dtypes"])

    def _build_ahead(self) -> None:
        """Builds the Batch of each binary batch reply already decoded behind this one (see
        ``_wire.Conn.recv_reply``), now, while this code is in the CPU's caches: the calls that
        hand them out come each after a model step, and then only take them. Only an
        optimisation: a batch that cannot be built now is built (or raises) in its turn."""
        for msg in self._conn.ready():
            if _wire.BINARY in msg:
                try:
                    msg["batch"] = self._binary_batch(msg)
                except Exception:
                    return

    def _defer_release(self, held: _Held | None) -> None:
        """Marks `held`'s batch released unless it was kept or released already; its lease
        goes with the next request (`_pending`). A batch the trainer dropped is released
        unless it was kept. Claiming it twice is a no-op.

        From the mark to the lease in `_pending`: stores only, no call (nor a return, where
        3.10 checks for signals): a lease marked and not queued would never be released."""
        if held is None or held.done:
            return
        b = held.ref()
        if b is None:
            if held.lease in self._kept_leases:
                return  # kept: its finalizer queues it (`_drain_dropped`)
        elif b._kept or b._released:
            return
        else:
            b._released = True
            if b._kept:
                # keep() from a signal handler that interrupted this call (it takes no lock)
                # between the check and the mark: the batch is kept after all.
                b._released = False
                return
        held.done = True
        self._pending += [held.lease]

    def _drain_dropped(self) -> None:
        """Kept batches garbage-collected before release(), or released from another thread
        while this stream was busy: their leases go with the next request, and no longer keep
        the stream from asking ahead.

        One lease at a time, with no call from reading it to deleting it (`+=`, ``-=`` and
        ``del`` are no calls): a handler's exception lands between two leases only. Before, one
        that struck as ``popleft()`` returned lost the lease, and left it kept: the stream
        never asked ahead again."""
        while self._dropped:
            lease = self._dropped[0]
            if lease in self._kept_leases:  # else released meanwhile (or the stream closed)
                self._kept_leases -= {lease}
                if self._held is not None and self._held.lease == lease:
                    self._held = None  # its release is this one
                self._pending += [lease]
            del self._dropped[0]

    def _send_next(self, prev: _Held | None, timeout: float | None = None, *, ahead: bool = False) -> None:
        """Asks for the next batches, releasing `prev` (unless it was kept) and the batches
        whose release waited for a request, in the same request, which the node ends after
        `timeout` seconds (None: it waits as long as it takes). `ahead`: a lost connection
        raises without ending the stream (see `_ask_ahead`)."""
        self._defer_release(prev)
        if self._pending and self._cuda is not None:
            self._gpu_done()
        count = 1 if self._kept_leases else _NEXT_COUNT
        timeout_ms = None if timeout is None else _timeout_ms(timeout)
        data, before = _wire.encode_next(self._pending, count, timeout_ms), len(self._inflight)
        # The releases are the request's from here (a store, no call: an interrupt cannot
        # land between the request going out and them leaving `_pending`, or the next
        # request would carry them again and the node refuse a lease it freed).
        leases, self._pending = self._pending, []
        try:
            (self._post if ahead else self._send)(_NEXT, data)
        except BaseException:
            if not self._sent(before):  # it did not go out: the next request carries them
                self._pending[:0] = leases
            raise

    def _ask_ahead(self, prev: _Held | None) -> None:
        """Sends the next request ahead of time (`_send_next`; `prev` is then the trainer's no
        more), once the last answer to the one before has been taken. A connection lost by
        then does not cost the batch just taken: it came whole and is handed out, like the
        batches that arrived before the loss (its state too: ``state_dict`` names the position
        after it); the next call raises the ConnectionClosed and ends the stream."""
        try:
            self._send_next(prev, ahead=True)
        except ConnectionClosed as e:
            self._lost = e.with_traceback(None)  # its frames would hold this stream

    def _release(self, batch: Batch) -> None:
        self._check_process()
        # A `next` in another thread may wait, holding the stream, for the memory a kept batch
        # holds: while it does, it takes the release over (`_next_answer_polling`).
        raw = self._lock.raw
        while True:
            if raw._is_owned():  # type: ignore[attr-defined]
                # A signal handler that interrupted this thread's own call: waiting would never
                # end. A kept batch goes through that call; one not kept is released with the
                # next request anyway.
                if batch._kept:
                    self._hand_over(batch)
                return
            # A bounded wait: not `run` (see `_types._OwnedLock`), so a lock the acquire took
            # as an exception struck its return is let go here.
            try:
                taken = raw.acquire(True, _HANDOFF_POLL)
            except BaseException:
                if raw._is_owned():  # type: ignore[attr-defined]
                    raw.release()
                raise
            if taken:
                break
            if batch._kept and self._waiting:
                self._hand_over(batch)
                return
        try:
            self._release_locked(batch)
        finally:
            raw.release()

    def _hand_over(self, batch: Batch) -> None:
        """Releases kept `batch` through the `next` that waits in another thread (it sends the
        release, after the GPU work queued so far, see `_send_pending`)."""
        with self._mark:
            if batch._released:
                return
            batch._released = True
            # Still kept: `_drain_dropped` releases it. Queued with the mark (the append is
            # the last call here): an interrupt between the two would lose the lease.
            self._dropped.append(batch.lease)
        batch._let_go()

    def _release_locked(self, batch: Batch) -> None:
        if batch._released:
            return
        if self._interrupted and not self._closed:
            # close() from a signal handler shut the connection down as a call handed a batch
            # out: closed now, as the next call would (the connection's end releases the lease).
            self._closed_meanwhile()
        if not self._closed:
            # What can fail goes before the batch is marked: an error answer to an earlier
            # release, the GPU's wait (it would leave the lease marked and never sent).
            if "next" not in self._inflight:
                self._settle()
            self._gpu_done()
        lease = batch.lease
        with self._mark:
            # Checked and marked here: a `next` in another thread may be releasing it
            # automatically, or may have taken it over (a lease released twice would be
            # refused as unknown). From the mark to the lease in `_pending`: stores only, no
            # call (a lease marked and not queued would never be released).
            if batch._released:
                return
            batch._released = True
            self._kept_leases -= {lease}
            # The auto-release of the batch handed out last, or of the one before a batch
            # taken and not handed out, must not release it again (once it is dropped too).
            if self._held is not None and self._held.lease == lease:
                self._held.done = True
            if (taken := self._unclaimed) is not None and taken.prev is not None and taken.prev.lease == lease:
                taken.prev.done = True
            if not self._closed:
                self._pending += [lease]  # until it went out: else the next request carries it
        batch._let_go()
        if self._closed or lease not in self._pending:
            return  # closing the connection released it
        self._send_release(self._pending.index(lease))
        if "next" not in self._inflight:
            self._settle()  # its answer (behind a request in flight, read when it comes)

    def _gpu_done(self) -> None:
        """Before a CUDA batch is released: wait for the GPU work queued so far, which may
        still read its bytes (the service reuses them once released)."""
        if self._cuda is not None:
            self._cuda.synchronize()

    def _state(self) -> dict[str, Any]:
        # The state after the last batch handed to the trainer (or the one attach started
        # from), as the batch replies carry it: no request.
        if self._unclaimed is not None:
            return self._state_in_handler()  # the state before the batch not yet returned
        if self._resume_raw is not None:
            self._resume, self._resume_raw = _binary.decode_state(self._resume_raw), None
        return dict(self._resume)

    def _state_snapshot(self) -> dict[str, Any] | bytes:
        # The state's JSON bytes while they are not decoded yet: a copy of a position, kept
        # per batch by shardwire.torch, decoded only when a checkpoint asks for it.
        if self._unclaimed is not None:
            return self._snapshot_in_handler()
        return self._resume_raw if self._resume_raw is not None else dict(self._resume)

    def _state_in_handler(self) -> dict[str, Any]:
        # No request: the state is here. Decoded without storing it (the interrupted call may
        # be setting it), and the trainer's: the one before a batch not yet returned.
        resume, raw = self._trainer_state()
        return _binary.decode_state(raw) if raw is not None else dict(resume)

    def _state_when_closed(self) -> dict[str, Any]:
        # Held here, not asked of the node: exact after a lost connection or a reply that could
        # not be read too (a batch taken and not returned is not counted, see `_unclaimed`).
        return self._state_in_handler()

    def _snapshot_in_handler(self) -> dict[str, Any] | bytes:
        resume, raw = self._trainer_state()
        return raw if raw is not None else dict(resume)

    def _trainer_state(self) -> tuple[dict[str, Any], bytes | None]:
        """(`_resume`, `_resume_raw`) of the last batch handed to the trainer: while a batch
        is taken and not yet returned (`_unclaimed`), as they were before it."""
        taken = self._unclaimed
        return taken.before if taken is not None else (self._resume, self._resume_raw)

    def _returned(self, taken: _Taken) -> bool:
        """True when another thread's `next` has taken `taken` whole and is returning it (it let
        go of the lock, and has not cleared `_unclaimed` yet): the trainer's. Not in this
        thread: a signal handler that interrupted its own `next` on the way out."""
        return taken.out and taken.thread != threading.get_ident()

    def _left(self) -> None:
        # Only a batch this thread's call took: another thread's may be returning its own.
        taken = self._unclaimed
        if taken is not None and taken.thread == threading.get_ident():
            taken.out = False  # not returned: the next call hands it out
            # It lets go of its stream while it waits (`_take` sets it again): held by the
            # stream, it would make a reference cycle, and a stream dropped now would keep its
            # connection until the garbage collector found it.
            taken.batch._stream = None  # type: ignore[assignment]

    @property
    def region(self) -> Any:
        """The stream's whole region, mapped read-only (every tensor is a view of it): a
        ``memoryview``, or for ``memory = "cuda"`` the :class:`shardwire.CudaRegion` (None once
        the stream is closed)."""
        return self._region

    def close(self) -> None:
        """Closes the stream: the service releases every lease it holds. Arrays of its batches
        stay mapped (memory-safe) until they are garbage-collected, but their contents are no
        longer guaranteed. Idempotent; one an exception cut short (a KeyboardInterrupt) is
        finished by the next. In a process forked after the open it closes only this
        process's copy of the connection (a shutdown would end the parent's stream)."""
        super().close()

    def _drop_in_child(self) -> None:
        self._finalizer.detach()
        self._conn.sock.close()  # no shutdown: the parent's connection stays

    def _shutdown(self, notify: bool) -> None:
        # Closing the connection is what tells the service (when it is still there). Each step
        # is a no-op when run again (after an exception cut a close() short).
        self._held = None
        # A batch taken and not handed out holds views of the region: dropped, so that the
        # mapping goes now (unless the trainer still holds batches of its own), and the state
        # is the one before it. No local holds it: the release below would find views alive.
        # One another thread's `next` is returning is the trainer's: its state stays.
        if self._unclaimed is not None:
            if not self._returned(self._unclaimed):
                self._resume, self._resume_raw = self._unclaimed.before
            self._unclaimed = None
        self._inflight.clear()
        self._pending.clear()
        self._conn.close()
        self._finalizer.detach()  # after the close: a stream dropped before it still shuts down
        if self._region is None:
            return  # unmapped already (run again)
        if self._cuda is not None:
            # Unmapped when the last CudaTensor (or DLPack consumer of one) is gone, not now.
            self._cuda = self._region = self._base = None
            return
        assert isinstance(self._region, memoryview) and self._mmap is not None
        self._base = None  # the byte array goes now unless a batch tensor still holds it
        try:
            self._region.release()
            self._mmap.close()
        except BufferError:
            pass  # numpy views are alive: the mapping goes when the last one does
        # Not kept by this object either way: a closed stream that stays referenced does not
        # keep the mapping once its last view is gone.
        self._region = self._mmap = None
