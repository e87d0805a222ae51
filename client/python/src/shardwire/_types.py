"""What the socket and HTTP transports share (``_client.py``, ``_http.py``): the plain types of
the trainer API (:class:`TensorView`, :class:`StreamInfo`, ``Uneven``, ``Shuffle``), the dtype
table, and the base classes of their streams and batches. The keywords of ``open_stream`` and
the fields of ``attach`` they give are defined in ``_options.py``.

:class:`_StreamBase` holds what a stream is on either transport (the open/closed/ended state
under one lock, the iteration and context-manager protocols, ``state_dict``); a transport adds
how to take a batch, fetch the state and shut down. :class:`_BatchBase` holds what a batch is
(a read-only mapping of tensor name to array, its lease fields, ``keep()`` and ``with batch:``);
a transport adds what releasing it means.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Generic, Literal, TypeVar

import numpy as np

from ._arrow import ArrowExport
from ._errors import ProtocolError, ShardwireError, Timeout

Uneven = Literal["pad", "drop"]

# Element types the service describes (numpy names; all little-endian on the wire).
_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in {
        "int8": "i1",
        "int16": "<i2",
        "int32": "<i4",
        "int64": "<i8",
        "uint8": "u1",
        "uint16": "<u2",
        "uint32": "<u4",
        "uint64": "<u8",
        "float16": "<f2",
        "float32": "<f4",
        "float64": "<f8",
    }.items()
}


@dataclass(frozen=True)
class TensorView:
    """Where one tensor of a batch lies in the stream's region (the service's description)."""

    #: Tensor name (Arrow column name, or the ``.npy``/``.bin`` file stem).
    name: str
    #: numpy dtype name, e.g. ``"float32"`` (little-endian).
    dtype: str
    #: Shape.
    shape: tuple[int, ...]
    #: Byte offset in the region.
    offset: int
    #: Byte length.
    length: int


@dataclass(frozen=True)
class StreamInfo:
    """What the service said when the stream opened (the ``attached`` reply)."""

    #: Stream id (as in the admin API's ``/v1/streams``).
    stream: int
    #: Size of the mapped region in bytes.
    region_size: int
    #: Batches per epoch for this rank.
    batches_per_epoch: int
    #: Epochs the stream delivers (counting from epoch 0, including any skipped by a resume).
    epochs: int
    #: Memory kind of the region: ``"host"`` (numpy tensors) or ``"cuda"`` (CudaTensor).
    memory: str
    #: The state the stream starts from: ``{epoch, index, seed, fingerprint}``.
    state: dict[str, Any] = field(default_factory=dict)
    #: For ``memory = "cuda"``: the region's device ``{ordinal, pci_bus_id, granularity}`` as
    #: the service names it (its ordinal, not necessarily this process's).
    gpu: dict[str, Any] | None = None

    @property
    def total_batches(self) -> int:
        """Batches over all epochs (``batches_per_epoch * epochs``), from epoch 0."""
        return self.batches_per_epoch * self.epochs


#: ``shard`` of a batch that holds samples of many shards (batch mode) on the wire.
NO_SHARD = 0xFFFF_FFFF

#: The ``shuffle`` modes of batch mode.
Shuffle = Literal["none", "shards", "block"]


def _loads(raw: bytes | bytearray, what: str) -> Any:
    """`raw` decoded as JSON; ProtocolError naming `what` if it is not JSON, or is nested too
    deeply to decode (``json`` raises RecursionError, which must not escape as a bug of the
    caller)."""
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ProtocolError(f"malformed {what}: {e}") from e
    except RecursionError as e:
        raise ProtocolError(f"malformed {what}: nested too deeply to decode ({len(raw)} bytes)") from e


def _int(value: Any, field: str) -> int:
    """`value`, a JSON integer field of the service's named `field`; ProtocolError naming both
    if it is anything else (``int()`` would take ``true`` as 1, ``2.5`` as 2, ``"7"`` as 7)."""
    if type(value) is not int:
        raise ProtocolError(f"the field {field} is {value!r}, not an integer")
    return value


def _tensor_view(t: Mapping[str, Any], offset: int | None = None) -> TensorView:
    """The :class:`TensorView` of one entry of a batch's ``tensors``; `offset` replaces the
    entry's own (HTTP batches have no region)."""
    if not isinstance(t, Mapping):
        raise ProtocolError(f"an entry of tensors is {t!r}, not an object")
    shape = t["shape"]
    if not isinstance(shape, list):
        raise ProtocolError(f"the field shape of tensor {t.get('name')!r} is {shape!r}, not a list")
    return TensorView(
        str(t["name"]),
        str(t["dtype"]),
        tuple(_int(d, "shape") for d in shape),
        _int(t["offset"], "offset") if offset is None else offset,
        _int(t["length"], "length"),
    )


#: The largest wait a request may name: ``timeout_ms`` is a u64 on the wire.
_U64_MAX = 2**64 - 1


def _timeout_ms(timeout: float) -> int:
    """`timeout` seconds (>= 0, maybe infinite) in whole milliseconds rounded up, as the node
    takes a wait (0.5 ms is 1 ms, not 0, which would ask for an answer at once); saturated at
    u64::MAX, like the Rust SDK's ``timeout_ms`` (``sys.maxsize`` s or ``1e306`` s wait as
    long as it takes instead of being refused or overflowing)."""
    timeout = float(timeout)  # a numpy integer would wrap around in `timeout * 1000`
    if timeout >= _U64_MAX / 1000:
        return _U64_MAX
    return min(_U64_MAX, max(0, math.ceil(timeout * 1000)))


def _dtype(v: TensorView) -> np.dtype[Any]:
    """The numpy dtype of `v`; ProtocolError if this SDK does not know it."""
    dt = _DTYPES.get(v.dtype)
    if dt is None:
        raise ProtocolError(f"tensor {v.name!r} has dtype {v.dtype!r}, unknown to this SDK")
    return dt


def _sized_dtype(v: TensorView) -> np.dtype[Any]:
    """The numpy dtype of `v`, checked against its length; ProtocolError if this SDK does not
    know it or its shape does not take `v.length` bytes."""
    dt = _dtype(v)
    if any(not 0 <= d < 1 << 63 for d in v.shape):
        # A JSON shape may say -1 (numpy would infer it, DLPack would carry it as is); a dim
        # past int64 wraps negative in DLPack's int64_t.
        raise ProtocolError(f"tensor {v.name!r}: shape {v.shape} has a dimension outside 0..2**63")
    size = math.prod(v.shape) * dt.itemsize
    if size != v.length:
        raise ProtocolError(f"tensor {v.name!r}: shape {v.shape} of {v.dtype} is {size} bytes, the service says {v.length}")
    return dt


_B = TypeVar("_B", bound="_BatchBase")
_S = TypeVar("_S", bound="_StreamBase[Any]")
_BatchT = TypeVar("_BatchT", bound="_BatchBase")
_T = TypeVar("_T")


class _BatchBase(ArrowExport, Mapping[str, np.ndarray]):
    """A batch of either transport: a read-only mapping from tensor name to array, with the
    lease it came under (see :class:`shardwire.Batch` and :class:`shardwire.HttpBatch`).

    A subclass says what releasing means (:attr:`released`, :meth:`release`) and names
    itself in ``repr`` (``_NAME``, ``_repr_state``)."""

    __slots__ = ("_tensors", "_kept", "_arrow_rb", "lease", "epoch", "index", "shard", "views", "__weakref__")

    #: The class name ``repr`` shows, ``<shardwire.NAME ...>``.
    _NAME: ClassVar[str]

    # A batch is a lease: identity semantics (Mapping's value comparison would compare arrays).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self, lease: int, epoch: int, index: int, shard: int, views: list[TensorView], tensors: dict[str, np.ndarray]) -> None:
        self.lease = lease
        self.epoch = epoch
        self.index = index
        #: The shard this batch is (shard mode); None in batch mode, where a batch holds
        #: samples of many shards.
        self.shard: int | None = None if shard == NO_SHARD else shard
        self.views = tuple(views)
        self._tensors = tensors
        self._kept = False
        self._arrow_rb: Any = None

    # --- Mapping -----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        ts = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in self._tensors.items())
        return f"<shardwire.{self._NAME} epoch={self.epoch} index={self.index} shard={self.shard}{self._repr_state()} {{{ts}}}>"

    def _repr_state(self) -> str:
        """What ``repr`` shows between the shard and the tensors (nothing by default)."""
        return ""

    # --- lifetime ----------------------------------------------------------------------------

    @property
    def released(self) -> bool:
        """True once the batch's lease has ended."""
        raise NotImplementedError

    @property
    def kept(self) -> bool:
        """True if :meth:`keep` was called (a socket batch is then exempt from auto-release;
        for an HTTP batch it changes nothing: the copies stay valid)."""
        return self._kept

    def keep(self: _B) -> _B:
        """Marks the batch kept (:attr:`kept`) and returns it."""
        self._kept = True
        return self

    def release(self) -> None:
        """Gives the batch's lease back to the service. A no-op if already released."""
        raise NotImplementedError

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


#: Why a call woken by close() from another thread or a signal handler ended (`_woken`).
_WOKEN = "closed by close() from another thread or a signal handler"


class _OwnedLock:
    """A lock that knows which thread holds it. A signal handler runs in the thread it
    interrupted, which may hold the stream's lock (waiting in ``next``): a ``close()`` or
    ``release()`` there must not wait for a lock its own thread holds, which would never come
    back (see :meth:`_StreamBase.close`).

    An ``RLock`` (:attr:`raw`) for its owner, which CPython records inside the acquire
    itself: an owner kept beside a plain lock was set a few bytecodes after the acquire
    returned, and a handler that ran in between waited for ever. It is never taken twice by
    one thread: :meth:`refuse_here` comes first, and refuses a second wait (which hung on a
    plain lock, and would take an ``RLock`` again: two calls at once on one connection).

    **Taken with** :meth:`run`: the RLock's own C ``acquire`` in a ``try`` whose ``except``
    lets go of a lock it took as an exception struck its return, then the call, then the C
    ``release`` in a ``finally``. CPython raises a signal handler's exception at a Python
    function's entry and right after a C call returns (3.10 also right after a Python call
    returns). A Python ``__enter__`` struck right after its acquire returned left the lock
    held (the ``with`` never entered, so never left); a Python ``__exit__`` struck at its
    entry did too: every later call of that thread was refused as a second wait, and its
    ``close()`` only shut the socket down. A ``with lock.raw:`` is not
    safe either: CPython 3.14 before the fix of gh-148874 calls the C ``__enter__`` through
    an ordinary call, checking for signals as it returns, outside the ``with``'s handler. A
    wait that is not :meth:`run` (a try without waiting, a bounded wait) releases the lock in
    its ``except`` when the acquire's own return was struck, as :meth:`run` does.

    What remains: an exception can land as the release returns (the lock is free then; a
    batch the call took stays the stream's, see ``_StreamBase.next``)."""

    __slots__ = ("raw",)

    def __init__(self) -> None:
        #: The lock itself: take it with :meth:`run`.
        self.raw = threading.RLock()

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` with the lock held, after :meth:`refuse_here`."""
        self.refuse_here()
        raw = self.raw
        try:
            raw.acquire()
        except BaseException:
            if raw._is_owned():  # type: ignore[attr-defined]  # struck as the acquire returned
                raw.release()
            raise
        try:
            return fn(*args)
        finally:
            raw.release()

    def refuse_here(self) -> None:
        """RuntimeError when the calling thread holds the lock already: a signal handler that
        interrupted its own call. The wait would never end on a plain lock, and would take
        the RLock a second time."""
        if self.raw._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("the stream's lock is taken twice by one thread")

    def held_here(self) -> bool:
        """True when the calling thread holds it."""
        return self.raw._is_owned()  # type: ignore[attr-defined]

    def locked(self) -> bool:
        """True when any thread holds it."""
        raw = self.raw
        if raw._is_owned():  # type: ignore[attr-defined]
            return True
        try:
            free = raw.acquire(False)
        except BaseException:
            # Struck as the acquire returned: if it took the lock (this thread did not hold it
            # before), it is let go.
            if raw._is_owned():  # type: ignore[attr-defined]
                raw.release()
            raise
        if free:
            raw.release()
        return not free


class _StreamBase(Generic[_BatchT]):
    """A stream of either transport: iterate it for batches in plan order (see
    :class:`shardwire.Stream` and :class:`shardwire.HttpStream`).

    Holds the stream's state (open, closed and why, ended) under one lock: one request at a
    time. A subclass takes the next batch (``_take``), fetches the state (``_state``) and shuts
    its transport down (``_shutdown``), each called with the lock held on an open stream, and
    names itself in ``repr`` (``_NAME``, ``_repr_where``).

    Attributes:
        info: What the service said at open.
    """

    #: The class name ``repr`` shows, ``<shardwire.NAME ...>``.
    _NAME: ClassVar[str]

    def __init__(self, info: StreamInfo) -> None:
        self._lock = _OwnedLock()
        #: Set by a :meth:`close` from another thread (or a signal handler) while a call held
        #: the lock.
        self._interrupted = False
        self._closed = False
        #: True once `_shutdown` ran to its end (`_closed` is set before it starts): until
        #: then a close() finishes it (see `close`).
        self._shut_down = False
        self._closed_why = "the stream was closed"
        self._ended = False
        #: A batch a call took and has not returned yet (a transport's record of it, or None):
        #: an exception that strikes before the call returns leaves it here, and the next call
        #: hands it out. `next` clears it as it returns (see there).
        self._unclaimed: Any = None
        self.info = info
        #: The process that opened it (see `_check_process`).
        self._pid = os.getpid()

    # --- requests ----------------------------------------------------------------------------

    def _check_process(self) -> None:
        """Refuses a use from a process forked after the open: the child would take the
        parent's batches (the socket's answers, or the service's HTTP stream state) and both
        would miss some. Checked before the lock, which a thread of the parent may have held
        when the child was forked."""
        if os.getpid() != self._pid:
            raise ShardwireError("forked", (
                f"this stream was opened in process {self._pid} and is used in its forked child "
                f"{os.getpid()}: open a stream in the child (shardwire.torch.IterableDataset opens "
                "one in each DataLoader worker)"
            ))

    def _in_handler(self) -> bool:
        """True when this thread holds the stream's lock: a signal handler that interrupted
        this stream's own call in this thread (a SIGTERM handler while ``next`` waits). Waiting
        for the lock there would never end (see :meth:`close`)."""
        return self._lock.held_here()

    def _refuse_in_handler(self, what: str) -> ShardwireError:
        """The error of `what`, which cannot run from a signal handler that interrupted this
        stream's own call (see `_in_handler`)."""
        return ShardwireError("reentrant", (
            f"stream {self.info.stream}: {what} was called from a signal handler that interrupted this "
            "stream's own call in the same thread; it needs the connection that call is using. Call it "
            "after that call returns (e.g. set a flag in the handler and save the checkpoint in the loop)"
        ))

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _closed_error(self) -> ShardwireError:
        """The error of a call on a closed stream, saying why it closed."""
        return ShardwireError("closed", f"stream {self.info.stream}: {self._closed_why}")

    def _broken(self, why: str) -> None:
        """The connection to the service failed: the stream is over here (on the socket its
        leases are gone with the connection, and there is nobody to tell); later calls raise
        ``closed`` saying `why`. Call with the lock held. ``HttpStream`` overrides it to close
        the stream on the service too, which is usually still reachable there."""
        self._closed_why = why
        self._close_locked(notify=False)

    def _timeout(self, timeout: float | None) -> Timeout:
        return Timeout(f"no batch within {timeout}s (stream {self.info.stream})")

    def next(self, timeout: float | None = None) -> _BatchT | None:
        """The next batch in plan order, or None when every epoch was delivered.

        An exception can strike after the batch was taken: as a call returns (3.10), or as
        the lock's release returns. Caught here, in the frame that returns the batch (on 3.10
        one that strikes as `_next` returns lands here, not in `_next`), it leaves the batch
        `_unclaimed` (`_left`), and the next call hands it out (``state_dict()`` names the
        position before it until then). Unavoidable: one that strikes in the caller's frame as
        :meth:`next` returns (3.10, where the return of a Python call checks for signals; or a
        call through the C ``builtins.next``) loses the batch the stream handed out."""
        try:
            b = self._next(timeout)
            if self._owns(b):  # not another thread's record, made since this call let go
                self._unclaimed = None  # the caller's from here: a store, then the return
        except BaseException:
            self._left()
            raise
        return b

    def _owns(self, b: Any) -> bool:
        """Whether the `_unclaimed` record is of `b`, which this call took: once the lock is
        let go another thread's `next` may have made its own, which must stay. Here the record
        is the batch itself (`HttpStream`, which claims it under the lock, so this is False
        for a batch it returns); `Stream` records a `_Taken`, and an interrupt as its `_owns`
        returns leaves the record to the next call, which hands `b` out again."""
        return self._unclaimed is b

    def _next(self, timeout: float | None) -> _BatchT | None:
        """:meth:`next` but its last step: the batch, still `_unclaimed`."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be >= 0, not {timeout!r}")
        if timeout is not None and math.isinf(timeout):
            timeout = None  # waits as long as it takes
        self._check_process()
        return self._lock.run(self._next_locked, timeout)

    def _next_locked(self, timeout: float | None) -> _BatchT | None:
        """`_next` with the lock held."""
        self._check_open()
        if self._interrupted:
            # A close() from a signal handler that struck this thread's last call as it was
            # handing a batch out (not waiting, so nothing woke): that call returned its batch,
            # this one closes the stream and hands out none of those already here.
            raise self._closed_meanwhile()
        if self._ended:
            self._after_end()
            return None
        return self._take(timeout)

    def _take(self, timeout: float | None) -> _BatchT | None:
        """The next batch, or None (setting ``_ended``) at the end; `timeout` as in :meth:`next`."""
        raise NotImplementedError

    def _after_end(self) -> None:
        """A call after the end (lock held): what an exception left undone of the end's work
        (nothing by default)."""

    def _left(self) -> None:
        """A `next` raised, maybe leaving a batch it took `_unclaimed` (lock released):
        nothing by default."""

    def state_dict(self) -> dict[str, Any]:
        """The resumable position: the service's ``state`` reply ``{epoch, index, seed,
        fingerprint}``, naming the next batch not yet taken. Pass it to
        ``open_stream(..., state=...)`` (same dataset, seed, rank, world size, uneven) to
        continue exactly there, on either transport. JSON-serialisable.

        Batches already taken count as consumed: save the state after you have finished
        with them (e.g. after the optimizer step), not while they are still to be trained on.

        From a signal handler that interrupted this stream's own call in the same thread (a
        SIGTERM handler while ``next`` waits), a socket stream returns the state at once: the
        position after the last batch ``next`` returned (not one the interrupted call is
        taking). An HTTP stream, whose state takes a request, raises ``ShardwireError`` code
        ``reentrant`` instead of waiting for ever for that call.

        Once the stream is closed (by :meth:`close`, or because the connection was lost or a
        reply could not be read), a socket stream still returns the position after the last
        batch ``next`` returned, which it holds: where a new stream resumes. An HTTP stream,
        whose state is the node's, raises ``ShardwireError`` code ``closed``.
        """
        self._check_process()
        if self._in_handler():
            return self._state_when_closed() if self._closed else self._state_in_handler()
        return self._lock.run(self._state_locked)

    def _state_locked(self) -> dict[str, Any]:
        return self._state_when_closed() if self._closed else self._state()

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _state_when_closed(self) -> dict[str, Any]:
        """:meth:`state_dict` of a closed stream: ``closed``, unless the transport holds the
        state without a request."""
        raise self._closed_error()

    def _state_in_handler(self) -> dict[str, Any]:
        """:meth:`state_dict` from a signal handler that interrupted this stream's own call
        (see `_in_handler`), without the lock: ``reentrant`` unless the transport holds the
        state without a request."""
        raise self._refuse_in_handler("state_dict()")

    def _snapshot(self) -> dict[str, Any] | bytes:
        """What :meth:`state_dict` would return now, as cheaply as the transport holds it: the
        dict, or its JSON bytes not decoded yet (``_binary.decode_state``). For code that keeps
        the position after every batch but reads it only at a checkpoint (``shardwire.torch``)."""
        self._check_process()
        if self._in_handler():
            self._check_open()
            return self._snapshot_in_handler()
        return self._lock.run(self._snapshot_locked)

    def _snapshot_locked(self) -> dict[str, Any] | bytes:
        self._check_open()
        return self._state_snapshot()

    def _state_snapshot(self) -> dict[str, Any] | bytes:
        return self._state()

    def _snapshot_in_handler(self) -> dict[str, Any] | bytes:
        """`_snapshot` from a signal handler (see `_state_in_handler`)."""
        return self._state_in_handler()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def close(self) -> None:
        """Closes the stream on the service. Idempotent. Safe from another thread while a call
        waits on the stream (a watchdog's close): that call is woken at once and raises
        ``closed``. From a signal handler that interrupted a call of this stream in its own
        thread (a SIGTERM handler while ``next`` waits), it wakes that call and returns at once;
        the woken call closes the stream and raises ``closed`` (a call it struck as it handed
        out a batch that had arrived returns that batch, and the next call closes the stream
        and raises ``closed``). In a process forked after the
        open it lets go of this process's copy of the connection only: telling the service
        would end the parent's stream.

        A close() an exception cut short (a KeyboardInterrupt) leaves the stream closed, and
        the next close() finishes shutting it down."""
        if self._shut_down:
            return  # idempotent (closed and not shut down: one cut short, finished here)
        if os.getpid() != self._pid:
            self._closed = True
            self._drop_in_child()
            return
        raw = self._lock.raw
        if raw._is_owned():  # type: ignore[attr-defined]
            # A signal handler that interrupted this thread's own call: waiting would never
            # end. That call is woken, and closes the stream (a close() finishes itself).
            self._interrupted = True
            self._interrupt()
            return
        try:
            free = raw.acquire(False)
        except BaseException:
            if raw._is_owned():  # type: ignore[attr-defined]  # struck as the acquire returned
                raw.release()
            raise
        if free:
            try:
                self._close_locked()
            finally:
                raw.release()
            return
        # Another thread's call holds it: woken, it ends at once.
        self._interrupted = True
        self._interrupt()
        try:
            self._lock.run(self._close_locked)
        except BaseException:
            if not self._closed:
                self._interrupted = False  # a KeyboardInterrupt while waiting: still open
            raise

    def _drop_in_child(self) -> None:
        """Closes this (forked) process's copy of the connection, telling the service nothing
        (see :meth:`close`)."""
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Wakes a call that waits on the transport, from another thread (see :meth:`close`).
        Nothing by default."""

    def _woken(self) -> ShardwireError:
        """The error a call raises when :meth:`close` from another thread or a signal handler
        woke it, or came while it held the lock."""
        return ShardwireError("closed", f"stream {self.info.stream}: {_WOKEN}")

    def _closed_meanwhile(self) -> ShardwireError:
        """Closes the stream for a :meth:`close` from another thread or a signal handler that
        found the lock held (lock held now), and returns the error of the call that finds it
        so: ``closed``, saying so."""
        self._closed_why = _WOKEN
        self._close_locked()
        return self._woken()

    def _close_locked(self, notify: bool = True) -> None:
        if self._shut_down:
            return
        self._closed = True
        self._shutdown(notify)  # run again after one an exception cut short
        self._shut_down = True

    def _shutdown(self, notify: bool) -> None:
        """Ends the transport once the stream is marked closed; `notify` is False when the
        socket's connection to the service has failed (there is nobody to tell). Run again where an
        exception cut it short: a step done already is a no-op the second time."""
        raise NotImplementedError

    # --- protocols ---------------------------------------------------------------------------

    def __iter__(self: _S) -> _S:
        return self

    def __next__(self) -> _BatchT:
        # `next()` without its argument check: once per step of a training loop. As `_next`
        # and `next` together (the same steps: see there).
        self._check_process()
        try:
            b = self._lock.run(self._next_locked, None)
            if b is not None and self._owns(b):  # not another thread's record (see `next`)
                self._unclaimed = None  # the caller's from here
        except BaseException:
            self._left()
            raise
        if b is None:
            raise StopIteration
        return b

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<shardwire.{self._NAME} {self.info.stream}{self._repr_where()} {'closed' if self._closed else 'open'} "
            f"batches_per_epoch={self.info.batches_per_epoch} epochs={self.info.epochs}>"
        )

    def _repr_where(self) -> str:
        """What ``repr`` shows after the stream id (nothing by default)."""
        return ""
