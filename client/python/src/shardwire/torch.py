"""PyTorch integration: ``shardwire.torch.IterableDataset``.

torch is imported lazily: importing ``shardwire`` or ``shardwire.torch`` does not import it;
touching ``shardwire.torch.IterableDataset`` does (and fails with ImportError if torch is not
installed). The rank arithmetic (:func:`effective_rank`) and :func:`open_at_epoch` need no torch.

Usage (batch mode: the node assembles batches of ``batch_size`` samples)::

    from shardwire.torch import IterableDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    ds = IterableDataset("imagenet", seed=1, batch_size=256)   # rank/world from torch.distributed
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    for epoch in range(10):
        ds.set_epoch(epoch)
        for item in loader:              # dict: tensor name -> torch.Tensor [256, ...]
            ...
        ckpt = loader.state_dict()       # resume with loader.load_state_dict(ckpt), no replay

Each item is one service batch as a dict of arrays (batch mode: ``batch_size`` samples; shard
mode, without ``batch_size``: one shard); use ``batch_size=None`` in the DataLoader so it does
not stack batches. Both modes resume through ``StatefulDataLoader`` (any ``num_workers``)
exactly: each process's ``state_dict()`` holds its stream's position after the last item it
yielded, and ``load_state_dict()`` makes the node start there, with nothing replayed (a
checkpoint saved after an epoch ended, resumed with ``set_epoch(epoch + 1)``, starts that
epoch in full; a mixture's from the saved position, which holds every dataset's cursor, and
every later epoch from where the one before ended, where the node takes that position for
the request as it is then: else from a probe, as any other epoch).
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _binary, _device
from ._client import Client, Stream, _is_url, connect
from ._cuda import CudaTensor
from ._errors import ServiceError
from ._http import HttpClient, HttpStream, _idle_timeout_s, _split
from ._options import DATASET_NAMES, DATASET_REFUSED, StreamOptions, _as_int, _is_int, _mix_entries, fill_doc
from ._types import Uneven

if TYPE_CHECKING:  # pragma: no cover
    from ._options import DatasetKeywords, Unpack

__all__ = ["IterableDataset", "effective_rank", "open_at_epoch"]


def effective_rank(rank: int, world_size: int, worker_id: int = 0, num_workers: int = 1) -> tuple[int, int]:
    """The (rank, world size) a DataLoader worker opens its stream with.

    Every DDP rank is split among its DataLoader workers: worker ``w`` of ``n`` on rank ``r``
    of ``W`` is stream rank ``r * n + w`` of ``W * n``. The map is a bijection onto
    ``range(W * n)``, so the service's plan (rank ``k`` takes positions ``k, k + W*n, ...``)
    gives each shard to exactly one worker of one rank, with the uneven policy (pad/drop)
    applied over ``W * n`` streams. Every rank must use the same `num_workers`.

    Raises:
        ValueError: a value out of range.
    """
    if world_size < 1 or num_workers < 1:
        raise ValueError(f"world_size ({world_size}) and num_workers ({num_workers}) must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id {worker_id} is outside 0..{num_workers - 1}")
    return rank * num_workers + worker_id, world_size * num_workers


def open_at_epoch(
    client: Client | HttpClient,
    dataset: str,
    *,
    start_epoch: int,
    epochs: int = 1,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    uneven: Uneven = "pad",
    device: str | int | None = "auto",
    idle_timeout: float | None = None,
) -> Stream | HttpStream:
    """Opens a stream that delivers epochs ``start_epoch .. start_epoch + epochs - 1``.

    Epoch ``e``'s order depends on ``e`` (and the seed), so this is how a loader that is
    iterated once per epoch gets a fresh order each time. For ``start_epoch > 0`` it opens a
    short-lived probe stream to learn the plan's fingerprint, closes it, and resumes at
    ``{epoch: start_epoch, index: 0}``; the probe costs one attach and a little fetch-ahead.
    `idle_timeout` goes to an :class:`shardwire.HttpClient`'s ``open_stream`` (see
    :func:`_transport_keywords`).
    """
    opts: dict[str, Any] = {"seed": seed, "rank": rank, "world_size": world_size, "uneven": uneven, "device": device}
    opts.update(_transport_keywords(client, idle_timeout))
    if start_epoch < 0:
        raise ValueError(f"start_epoch must be >= 0, not {start_epoch}")
    _check_epoch_end("start_epoch", start_epoch, epochs)
    if start_epoch == 0:
        return client.open_stream(dataset, epochs=epochs, **opts)
    with client.open_stream(dataset, epochs=1, **opts) as probe:
        fingerprint = probe.info.state["fingerprint"]
    state = {"epoch": start_epoch, "index": 0, "seed": seed, "fingerprint": fingerprint}
    return client.open_stream(dataset, epochs=start_epoch + epochs, state=state, **opts)


#: A socket stream given ``idle_timeout``: it is the HTTP API's alone.
_IDLE_ON_SOCKET = (
    "idle_timeout={!r} applies to a stream over the node's HTTP API (socket=\"http://HOST:PORT\", "
    "an HttpClient) only: a trainer-socket stream's idle limit is the node's "
    "trainer_idle_timeout_secs (default 3600 s). Leave idle_timeout out, or use the HTTP API"
)


def _transport_keywords(client: Client | HttpClient, idle_timeout: float | None) -> dict[str, Any]:
    """The keywords of `client`'s own transport for ``open_stream``: ``idle_timeout`` for an
    :class:`shardwire.HttpClient` (seconds without a request after which the node closes the
    stream), as :meth:`shardwire.HttpClient.open_stream` takes it.

    Raises:
        ValueError: `idle_timeout` for a socket :class:`Client`, which takes none.
    """
    if idle_timeout is None:
        return {}
    if not isinstance(client, HttpClient):
        raise ValueError(_IDLE_ON_SOCKET.format(idle_timeout))
    return {"idle_timeout": idle_timeout}


def _torch_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Effective (rank, world size) of the calling DataLoader worker (or main process)."""
    from torch.utils.data import get_worker_info

    rank, world_size = _ddp_ranks(rank, world_size)
    info = get_worker_info()
    worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return effective_rank(rank, world_size, worker_id, num_workers)


def _dist_ranks() -> tuple[int, int] | None:
    """(rank, world size) of this process's DDP job: from ``torch.distributed`` when it is
    initialised, else from ``RANK`` and ``WORLD_SIZE`` (which torchrun sets, and spawned
    DataLoader workers inherit: ``torch.distributed`` is not initialised in them); None when
    neither says."""
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None  # type: ignore[assignment]
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return None
    if rank is None or world is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise ValueError(f"{missing} is not set but {'WORLD_SIZE' if rank is None else 'RANK'} is: set both (torchrun does) or pass rank= and world_size=")
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ValueError(f"RANK={rank!r} WORLD_SIZE={world!r}: not integers (torchrun sets them)") from None
    if not 0 <= r < w:
        raise ValueError(f"RANK={r} is not below WORLD_SIZE={w}")
    return r, w


def _check_pair(rank: int | None, world_size: int | None) -> None:
    """ValueError when exactly one of `rank` and `world_size` is given: the other would come
    from the DDP job, whose values are the global ones (with tensor or pipeline parallelism,
    a data-parallel rank paired with the global size reads a part of the data only, silently)."""
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"rank={rank!r} and world_size={world_size!r}: pass both (the data-parallel rank and "
            "size) or neither (both from torch.distributed, else RANK and WORLD_SIZE, else 0 "
            "of 1); one alone would be paired with the DDP job's global value"
        )


def _ddp_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size) of this process: the given values, else the DDP job's
    (:func:`_dist_ranks`), else 0 of 1.

    Raises:
        ValueError: only one of the two given (:func:`_check_pair`), or bad RANK/WORLD_SIZE.
    """
    _check_pair(rank, world_size)
    if rank is None or world_size is None:
        rank, world_size = _dist_ranks() or (0, 1)
    return rank, world_size


#: The most epochs a stream counts: its attach request's ``epochs`` (the epoch after its last,
#: ``epoch + epochs`` for an iteration that starts at ``epoch``) is a 32-bit field.
_EPOCHS_END = 2**32 - 1


def _check_epoch_end(what: str, epoch: int, epochs: Any) -> None:
    """ValueError naming `what`, `epoch` and the bound when a stream that starts at `epoch`
    and delivers `epochs` would count past :data:`_EPOCHS_END` (before, ``set_epoch(2**32)``
    was taken, and the first item raised an error about ``epochs``, the keyword left at 1;
    2**63 and more were truncated by the shared epoch's 64 bits); naming `epochs` where it
    alone is past the bound. An `epochs` that is no integer counts as 1 here: the stream's
    open refuses it, naming it. Checked where the epoch is set and again where the stream
    opens: ``ds.epochs`` may be set after the epoch."""
    n = _as_int(epochs) if _is_int(epochs) else 1
    if n > _EPOCHS_END and epoch < _EPOCHS_END:
        # `epochs` alone is past the bound, whatever the epoch (before, the message named a
        # negative epoch as the most allowed).
        raise ValueError(
            f"epochs={n} is more epochs than a stream counts ({what} is {epoch}): epoch + "
            f"epochs must be at most 2**32 - 1 ({_EPOCHS_END}, the attach request's epochs "
            f"field), so epochs at most {_EPOCHS_END - epoch}"
        )
    if epoch + n > _EPOCHS_END:
        raise ValueError(
            f"{what} {epoch} with epochs={n} ends past the last epoch a stream counts: epoch + "
            f"epochs must be at most 2**32 - 1 ({_EPOCHS_END}, the attach request's epochs "
            f"field), so the epoch at most {_EPOCHS_END - n}"
        )


def _epoch_arg(what: str, epoch: Any, epochs: Any = 1) -> int:
    """`epoch` as an int, if it is an integer >= 0 (an int or a numpy integer; not a bool)
    that a stream of `epochs` starting there can count to (:func:`_check_epoch_end`); else
    ValueError naming `what` and the value (before, ``set_epoch(-1)`` opened other epochs,
    and ``set_epoch(1.5)`` epoch 1)."""
    if not _is_int(epoch) or _as_int(epoch) < 0:
        raise ValueError(f"{what} must be an integer >= 0, not {epoch!r}")
    _check_epoch_end(what, _as_int(epoch), epochs)
    return _as_int(epoch)


#: The node's fixed-point one of mixture weights (``ONE`` in protocol/src/samples/mix.rs).
_WEIGHT_ONE = 1 << 40


def _fixed_weights(weights: list[float]) -> list[int]:
    """The node's fixed-point weights of positive `weights` (``fixed_weights`` in
    protocol/src/samples/mix.rs, step by step in the same float arithmetic): what a mixture
    state's ``mix.weights`` holds where it was saved under these weights."""
    top = max(weights)
    total = 0.0
    for w in weights:  # in order, as Rust's sum (Python's sum() of floats compensates)
        total += w / top
    # Rust's round() is half away from zero; x + 0.5 is exact below 2**52.
    q = [max(1, math.floor(w / top / total * float(_WEIGHT_ONE) + 0.5)) for w in weights]
    q[q.index(max(q))] += _WEIGHT_ONE - sum(q)  # the rounding error, to the first largest
    return q


def _resumed_fingerprint(probe: str, saved: str, names: list[str]) -> str:
    """The fingerprint the node computes for a mixture stream opened at a state of fingerprint
    `saved`, where a probe of that request (no state) has `probe`: a dataset whose saved fields
    shuffle blocks (``NAME.shuffle=block``) without naming their keys
    (``NAME.block_keys=global``) resumes with the legacy keys, whose fingerprint does not name
    them (``BlockKeys::of_state``). The node resumes the state only where this equals
    `saved`."""
    fields = saved.split(";")
    legacy = {
        f"{n}.block_keys=global" for n in names
        if f"{n}.shuffle=block" in fields and f"{n}.block_keys=global" not in fields
    }
    return ";".join(kv for kv in probe.split(";") if kv not in legacy)


def _fingerprint_change(saved: Any, now: Any) -> str:
    """What differs between fingerprints `saved` and `now`, as the node names it: the first
    field of `now` that `saved` holds otherwise."""
    if not isinstance(saved, str) or not isinstance(now, str):
        return f"{saved!r} is not the request's {now!r}"
    had = dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in saved.split(";"))
    for kv in now.split(";"):
        key, _, value = kv.partition("=")
        if had.get(key) != value:
            return f"differs in `{key}`: saved {had.get(key, '(missing)')}, the request has {value}"
    return f"`{saved}` is not the request's `{now}`"


def _worker() -> tuple[int, int]:
    """(worker id, workers) of the calling DataLoader worker; (0, 1) in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _copy(view: Any) -> Any:
    """A writable copy of one batch tensor: a numpy array for host regions, a torch tensor
    on the same GPU for CUDA regions (``memory = "cuda"``)."""
    if isinstance(view, CudaTensor):
        return view.to_torch().clone()
    return np.array(view)


def _cuda_in_use() -> bool:
    """Whether this process imported torch and started CUDA through it."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:
        return False


def _in_worker() -> bool:
    """Whether this process is a DataLoader worker."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


class _DatasetMixin:
    """The torch-independent body of :class:`IterableDataset` (see its docstring).

    Attributes:
        options: The stream keywords (:class:`shardwire.StreamOptions`); ``rank``,
            ``world_size``, ``worker``, ``num_workers`` and ``state`` are set when a stream
            opens. Each keyword the dataset takes is also an attribute (``ds.batch_size``,
            ``ds.seed``, ...), read and written through `options`.
    """

    # Defaults for a copy pickled by an SDK that predates them (see `__init__`).
    _gens = 0
    _pos_owner = 0
    _named = 0
    _finished: tuple[dict[str, Any], tuple[int, int]] | None = None
    _started: tuple[dict[str, Any], tuple[int, int]] | None = None
    idle_timeout: float | None = None

    def __init__(
        self,
        dataset: str,
        *,
        socket: str | None = None,
        copy: bool = True,
        timeout: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        idle_timeout: float | None = None,
        **options: Unpack[DatasetKeywords],
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.socket = socket
        _check_pair(rank, world_size)  # here, not only in a DataLoader worker
        self.rank = rank
        self.world_size = world_size
        self.copy = copy
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.options = StreamOptions.of(options, "IterableDataset", DATASET_REFUSED)
        self._check_options()
        self._check_idle_timeout()
        # The epoch, in memory shared with the DataLoader's workers: a persistent worker keeps
        # its copy of the dataset from one iteration to the next, and `set_epoch` in the main
        # process must reach it (before, it delivered its first epoch again, silently).
        self._epoch: Any = multiprocessing.RawValue("q", 0)
        # The process that owns `_epoch`; the DataLoader's workers, which share it, never write
        # it: the epoch `load_state_dict` loads in a worker, with the shared epoch then, stays
        # here, the worker's until the main process names another (see `epoch`).
        self._owner = os.getpid()
        self._own_epoch: tuple[int, int] | None = None
        # The epoch `_resume` was saved in (a persistent worker's copy keeps it across a
        # `set_epoch` of the main process, which a later epoch must win over, as there), and
        # the one `_stream_state` belongs to (the iteration's first epoch).
        self._resume_epoch = 0
        self._state_epoch = 0
        # The stream state after the last item yielded (its JSON bytes until a checkpoint
        # decodes them), and one to resume from.
        self._stream_state: dict[str, Any] | bytes | None = None
        self._resume: dict[str, Any] | None = None
        # A mixture's position at an epoch's start that an iteration of this process reached
        # (its end: the start of the next epoch), and the one an iteration started at (this
        # epoch's again, after a `break` or a full pass), each with the (worker, workers) of
        # that process (see `_finished_at`). Two slots: a second pass over an epoch starts at
        # its start, not from a probe whose replay would end at other cursors (before, those
        # replaced the first pass's end, which later epochs continue from). Not `_resume`,
        # which the next iteration takes whatever its epoch: the same epoch again would resume
        # at its end, to nothing.
        self._finished = None
        self._started = None
        # Iterations are numbered by `iter(dataset)` (`_gens`, the latest's number); the
        # position (`_stream_state`, and `_resume` after an error) is that of `_pos_owner`: the
        # latest, until another yields an item (a peek `next(iter(ds))` inside a loop must
        # not freeze the loop's checkpoints, nor a loop still taken from reset a new one's).
        self._gens = 0
        self._pos_owner = 0
        # How many times `set_epoch` or `load_state_dict` named where to start: an iteration
        # made before the latest of those rereads its start at its first item.
        self._named = 0

    @property
    def epoch(self) -> int:
        """The epoch the next iteration starts at (see :meth:`set_epoch`)."""
        shared, own = int(self._epoch.value), self._own_epoch
        return own[0] if own is not None and own[1] == shared else shared

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.value = _epoch_arg("IterableDataset.epoch", value, self.options.epochs)

    def __getstate__(self) -> dict[str, Any]:
        """The dataset as a DataLoader sends it to a worker process: with its DDP rank and
        world size filled in from this process when they were left to ``torch.distributed``
        (a worker started with spawn or forkserver is a fresh interpreter where it is not
        initialised: before, every rank's workers opened rank 0 of 1, the same data), and
        this process's CUDA device (see `_pass_device`)."""
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            # Pickled other than to start a process (a copy, torch.save): the epoch as a plain
            # value (shared memory travels only to a process being started; `__setstate__`
            # makes it shared again), and the ranks left to the process that loads it.
            state["_epoch"] = _Epoch(self.epoch)
            return state
        self._pass_device(state)
        # Both given, or both left to the DDP job: one alone (set as an attribute since the
        # dataset was made) is refused here, before any worker starts (before, the other was
        # filled in from the job, its global value).
        _check_pair(state["rank"], state["world_size"])
        if state["rank"] is None:
            try:
                found = _dist_ranks()
            except ValueError:
                found = None  # said by the worker's own `__iter__`
            if found is not None:
                state["rank"], state["world_size"] = found
        return state

    def _pass_device(self, state: dict[str, Any]) -> None:
        """Puts this process's CUDA device in `state`, for a DataLoader worker being started
        with spawn or forkserver: a fresh interpreter whose current device is 0, where
        torchrun's rank ``r`` called ``torch.cuda.set_device(r)`` (before, every rank's
        workers named GPU 0). Only where this process already uses CUDA: a launcher that
        spawns the ranks themselves (``torch.multiprocessing.spawn``) has not, and each rank
        must look up its own device (a lookup here would also start CUDA in the launcher).
        ``"auto"`` is this process's current device; a device given (``"cuda"``, ``"cuda:1"``)
        is resolved here, where its ordinal means what the trainer meant; one that names no
        GPU is left to the worker's open to refuse. Used only in a DataLoader worker
        (``_take_device``)."""
        device = self.options.device
        if device is None or not _cuda_in_use():
            return
        try:
            bus = _device.current() if device == _device.AUTO else _device.resolve(device)
        except (ValueError, RuntimeError):
            return  # raised again by the worker's own open, naming the device
        if bus is not None:
            state["_worker_device"] = bus

    def _take_device(self) -> None:
        """In a DataLoader worker, the device the process that started it passed on
        (``_pass_device``): ``"auto"`` names it as this process's current device (still only
        when the node serves CUDA memory), a device given is replaced by its bus id."""
        bus = getattr(self, "_worker_device", None)
        if bus is None or not _in_worker():
            return
        if self.options.device == _device.AUTO:
            _device.inherit(bus)
        else:
            self.options = self.options.replace(device=bus)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if isinstance(self._epoch, _Epoch):
            epoch, self._epoch = self._epoch.value, multiprocessing.RawValue("q", 0)
            self._epoch.value = epoch
            self._owner, self._own_epoch = os.getpid(), None  # its epoch is this process's own

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at `epoch` (its own shuffle order), like
        ``DistributedSampler.set_epoch``. Call it before iterating the loader each epoch.

        It forgets the position of the previous iteration, so a ``state_dict()`` taken before
        the next item resumes at the start of `epoch` (a mixture's: the position where this
        process's iteration before reached it, if it ran to its end there, which holds every
        dataset's cursor; see :meth:`_keeps`; opened at only where the node takes it for the
        request as it is then, else from a probe: :meth:`_takes`). ``StatefulDataLoader``
        loads a saved state after ``set_epoch`` (with ``num_workers=0``, even the state of an
        iteration that had ended): see :meth:`load_state_dict` for which of the two the next
        iteration follows.

        Raises:
            ValueError: `epoch` is not an integer >= 0, or ``epoch + epochs`` is past
                ``2**32 - 1`` (the most epochs a stream counts).
        """
        epoch = _epoch_arg("set_epoch's epoch", epoch, self.options.epochs)
        if epoch != self.epoch or self._resume is None:
            # Another epoch wins over where this one stopped; a mixture's starts where this
            # process reached it (`_finished_at`), which a checkpoint taken now names too.
            self._move_resume(epoch)
        self._named += 1
        self._own_epoch = None
        self.epoch = epoch
        # What `state_dict` says until the next item: where the next iteration starts (the
        # same epoch named again keeps a resume point, which a checkpoint must name too).
        self._stream_state, self._state_epoch = self._resume, self._resume_epoch

    def state_dict(self) -> dict[str, Any]:
        """torchdata's Stateful protocol (batch and shard mode): ``{"epoch", "stream"}``, the
        epoch the iteration started at and the stream state after the last item this process
        (main process or DataLoader worker) yielded; before the first, the state
        :meth:`load_state_dict` loaded for the next iteration, else None (the start of
        ``epoch``). Small and JSON-serialisable."""
        if isinstance(self._stream_state, bytes):
            self._stream_state = _binary.decode_state(self._stream_state)
        # A persistent worker's copy keeps the position of its last iteration while the
        # epoch (shared) is already the next one's: that position is not the next epoch's.
        stream = self._stream_state if self._state_epoch == self.epoch else None
        return {"epoch": self.epoch, "stream": stream}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the next iteration right after the last item of `state` (a
        :meth:`state_dict`): the stream opens with ``state=`` that position and the node starts
        there; nothing is replayed or skipped here. A state saved after the last item of its
        iteration resumes to nothing (its epochs are done), unless :meth:`set_epoch` has named
        a later epoch: then that epoch wins and is delivered in full (the usual loop saves
        after an epoch ends and resumes with ``set_epoch(e + 1)``, in either order). A
        mixture's state that lies exactly at the start of that epoch is kept and resumed
        from: it holds every dataset's cursor, so each dataset continues from it (under the
        weights given now, if they changed), and each later epoch from where the one before
        ended; see :meth:`_keeps` (where the node would refuse such a state for the request as
        it is when the epoch opens, the epoch opens from a probe: :meth:`_takes`). Until the
        next item, :meth:`state_dict` returns the position loaded here. In shard mode the saved
        stream is this process's own (one rank of ``world_size * num_workers``): resume with the
        same world size and ``num_workers``, or the node refuses (``ServiceError``
        ``state_mismatch``, naming the field) when the next iteration opens the stream.

        Raises:
            ValueError: `state` is not a dict with keys ``"epoch"`` and ``"stream"`` (e.g. a
                stream's own ``Stream.state_dict()``), or its ``"epoch"`` is not an integer
                >= 0 (or ``state["epoch"] + epochs`` is past ``2**32 - 1``).
        """
        if not isinstance(state, dict) or "epoch" not in state or "stream" not in state:
            got = f"a dict of keys {list(state)}" if isinstance(state, dict) else f"a {type(state).__name__}"
            raise ValueError(
                f"IterableDataset.load_state_dict takes what IterableDataset.state_dict() returns, "
                f"{{'epoch': int, 'stream': dict | None}}, not {got}: a Stream.state_dict() "
                "({epoch, index, seed, fingerprint}) resumes a stream through "
                "Client.open_stream(state=...), or goes here as {'epoch': <the epoch the "
                "iteration started at>, 'stream': <it>}"
            )
        epoch = _epoch_arg("load_state_dict's state['epoch']", state["epoch"], self.options.epochs)
        stream = state["stream"]
        self._named += 1
        # The loaded position replaces where this process got to.
        self._finished = self._started = None
        if stream is not None and self.epoch > epoch and self._ended(epoch, stream):
            # StatefulDataLoader (num_workers=0) loads the state of a finished iteration too,
            # after `set_epoch` named the next one: that epoch starts whole, from this state
            # where it is a mixture's at that epoch's start (its cursors), else from a probe.
            kept = stream if self._keeps(self.epoch, stream) else None
            self._resume = self._stream_state = kept
            self._resume_epoch = self._state_epoch = self.epoch
            return
        if os.getpid() == self._owner:
            self.epoch = epoch
        else:
            # A DataLoader worker: the shared epoch is the main process's and the other
            # workers' (each loads its own state), so this one's stays here (before, it
            # overwrote theirs).
            self._own_epoch = (epoch, int(self._epoch.value))
        self._resume_epoch = self._state_epoch = epoch
        self._resume = self._stream_state = stream

    def _check_options(self) -> None:
        """The ValueError ``open_stream`` raises for these keywords, now: shard mode passes on
        only those it uses, and silently ignored the rest (``seq_len`` without
        ``batch_size``, ``shuffle``, ...). The device is checked when the stream opens (an
        ordinal is looked up with CUDA)."""
        self.options.replace(device=None).attach_fields(self.dataset)

    def _check_idle_timeout(self) -> None:
        """The ValueError the stream's open would raise for ``idle_timeout``, now: out of
        range (as :meth:`shardwire.HttpClient.open_stream` checks it), or given with a socket
        that is not an ``http://`` URL (a trainer socket takes none; ``https://`` and other
        schemes are refused as :func:`shardwire.connect_http` refuses them)."""
        if self.idle_timeout is None:
            return
        _idle_timeout_s(self.idle_timeout)
        socket = self.socket
        if not _is_url(socket):
            raise ValueError(_IDLE_ON_SOCKET.format(self.idle_timeout))
        _split(socket)  # before, an https:// URL was refused only in a DataLoader worker

    def _keeps(self, epoch: int, stream: Any) -> bool:
        """True if `stream`, a position saved in an iteration of another epoch, is kept as the
        start of `epoch`, the epoch :meth:`set_epoch` named (which otherwise wins over it, and
        opens from a probe's ``{epoch, index: 0}``): a mixture's position exactly at that
        epoch's start (index below the worker count, none of the epoch taken), of the
        datasets this one mixes, in its order. It holds every dataset's cursor, and the node
        resumes each dataset from it (under the weights given now, if they changed); from a
        probe's state the node replays the schedule from its start under the weights given
        now, which repeats and skips samples where they changed, then or in any earlier epoch
        (``{web: .5, code: .5}`` for an epoch, then ``.75 / .25``: web's second quarter never
        comes, code's second half twice). Other states are not kept: a probe gives the same
        start for them, and leaves free what such a state pins at an epoch boundary (the
        seed, the dataset's shards; in shard mode the world size and ``num_workers``; the
        datasets of a mixture: another mixture, or one dataset, opens from a probe). A kept
        state is opened at only where the node takes it for the request as it is then
        (:meth:`_takes`: the seed, global batch, ... it pins may have changed since)."""
        return (
            isinstance(stream, dict)
            and isinstance(stream.get("mix"), dict)
            and self.options.batch_size is not None
            and self._mixes(stream["mix"])
            and _is_int(stream.get("epoch"))
            and _as_int(stream["epoch"]) == epoch
            and not self._inside(stream)
        )

    def _mixes(self, mix: dict[str, Any]) -> bool:
        """True if this dataset is a mixture of the datasets a state's `mix` names, in the same
        order (the names it sends, ``str(name)``): the node resumes a mixture's state only
        so, and refuses another (``state_mismatch``) where a probe opens it."""
        names = mix.get("datasets")
        return isinstance(self.dataset, Mapping) and names == [str(name) for name in self.dataset]

    def _finished_at(self, epoch: int) -> dict[str, Any] | None:
        """The position at an epoch's start this process reached (`_finished`) or started an
        iteration at (`_started`), whichever :meth:`_keeps` keeps as the start of `epoch`,
        where this is the process (the DataLoader worker, of as many) it was reached in; else
        None."""
        for kept in (self._finished, self._started):
            if kept is not None and kept[1] == _worker() and self._keeps(epoch, kept[0]):
                return kept[0]
        return None

    def _move_resume(self, epoch: int) -> None:
        """Makes `_resume` that of the next iteration, which starts at `epoch`, another epoch
        than the one it was saved in, or none: kept where :meth:`_keeps` says, else the
        position this process reached at that epoch's start (:meth:`_finished_at`: a
        mixture, once its weights changed, goes on from its cursors in every later epoch,
        not only the first after the change), else dropped."""
        if self._resume is None or not self._keeps(epoch, self._resume):
            self._resume = self._finished_at(epoch)
        self._resume_epoch = epoch

    def _takes(self, state: dict[str, Any], fingerprint: Any) -> bool:
        """True if the node takes `state`, a mixture's position kept as the start of an epoch
        (:meth:`_keeps`), for the stream this process opens now, whose probe has
        `fingerprint`. The node refuses (``state_mismatch``) a state of another fingerprint:
        another seed or global batch (``batch_size`` times the world size), ``seq_len``,
        ``tokens_column``, ``order``, ``shuffle``, ``shuffle_block`` or ``partitions``, a
        dataset re-indexed; and new weights in a DataLoader worker's state, or saved weights
        that make no schedule. Where it would refuse it, the epoch opens from the probe, as
        every epoch did before such states were kept (before, ``ds.batch_size = 16`` between
        two epochs, or an elastic resume on another global batch, failed at the first item),
        and a warning: a probe's start holds no cursors, so the node replays the schedule to
        the epoch under the request as it is now, which reaches the cursors the run is at only
        if nothing that shapes the schedule (weights, global batch, ...) changed before: a
        state saved after a weight change carries the new weights, so the SDK cannot tell a
        replay that repeats and skips samples from one that does not, and says so every time
        (before, it warned only where the state's weights differed from the request's)."""
        mix, saved = state["mix"], state.get("fingerprint")
        names = [str(name) for name in self.dataset]
        if isinstance(saved, str) and isinstance(fingerprint, str):
            fingerprint = _resumed_fingerprint(fingerprint, saved, names)
        same = isinstance(saved, str) and saved == fingerprint
        weights = mix.get("weights")
        asked = _fixed_weights([e["weight"] for e in _mix_entries(self.dataset)])
        if same and weights == asked:
            return True
        valid = (
            isinstance(weights, list)
            and len(weights) == len(asked)
            and all(_is_int(w) and w >= 1 for w in weights)
            and sum(weights) == _WEIGHT_ONE
        )
        at_start = mix.get("step") == 0 and not any(mix.get("cursors") or [])
        if same and valid and (_worker()[1] == 1 or at_start):
            return True
        why = f"its fingerprint {_fingerprint_change(saved, fingerprint)}" if not same else (
            "its weights make no schedule" if not valid else
            "a DataLoader worker's state takes no new weights (use num_workers=0)"
        )
        replay = (
            f"Its weights {weights} are not the request's {asked} (fixed point, 2**40 = 1), so the "
            "node replays the schedule under the new weights"
            if weights != asked
            else "The node replays the schedule to this epoch under the request as it is now, which "
            "reaches the run's cursors only if nothing that shapes it (weights, global batch) "
            "changed earlier in the run"
        )
        warnings.warn(
            f"epoch {state.get('epoch')} of the mixture {names} opens from a probe, not at the "
            f"saved position that holds every dataset's cursor: {why}. {replay}: samples may "
            "repeat or be skipped",
            RuntimeWarning,
            stacklevel=2,
        )
        return False

    def _ended(self, epoch: int, stream: dict[str, Any]) -> bool:
        """True if `stream`, a position saved in the iteration that started at `epoch`, lies at
        its end: at (or past) the start of the epoch after its ``epochs``, none of that epoch
        taken."""
        after, at = epoch + self.options.epochs, int(stream["epoch"])
        return at > after or (at == after and not self._inside(stream))

    def _inside(self, stream: dict[str, Any]) -> bool:
        """True if this process's stream has taken some of the batches of the epoch that
        position `stream` lies in. A batch-mode DataLoader worker ``w`` of ``n`` takes the
        rank's batches ``w, w + n, ...``, so its position at an epoch's start is an index below
        ``n`` (0 in the main process, ``n = 1``); in shard mode every process's stream starts
        each epoch at 0."""
        first = _worker()[1] if self.options.batch_size is not None else 1
        return int(stream.get("index", 0)) >= first

    def _items(self, stream: Stream | HttpStream, epoch: int, gen: int) -> Iterator[dict[str, np.ndarray]]:
        """The items of `stream`, an iteration that started at `epoch`, the `gen`-th."""
        while True:
            batch = stream.next(self.timeout)
            if batch is None:
                return
            if self.copy:
                # Writable copies. The batch is released by the next `next` (its lease rides
                # on the stream's next request; an explicit release would cost a send per item).
                item = {k: _copy(v) for k, v in batch.items()}
            else:
                item = dict(batch)  # views: valid until the next item is taken
            # The position after this item, once it exists (a copy that fails, out of memory,
            # leaves the position before it) and before it is yielded: a state taken while
            # the item is in use resumes after it.
            self._pos_owner = gen
            self._stream_state, self._state_epoch = stream._snapshot(), epoch
            yield item

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The items of the next iteration. A plain method, not a generator: `state_dict` names
        where this iteration starts as soon as ``iter(dataset)`` returns, not only from its
        first item on. torchdata's ``StatefulDataLoader`` asks each worker for its state right
        after ``iter(dataset)``, and keeps it for a worker that yields nothing before a
        checkpoint; before, that was the previous iteration's position (a persistent worker's,
        resumed to nothing; or the main process's, copied into the worker, of another world
        size). A second ``iter(dataset)`` takes the position over until the earlier one, if
        still taken from, yields again: the position is the last item's, of whichever."""
        self._gens += 1
        self._pos_owner = self._gens
        start, epoch = self._start()
        self._stream_state, self._state_epoch = start, epoch
        return self._iterate(self._gens, start, epoch, self._named)

    def _start(self) -> tuple[dict[str, Any] | None, int]:
        """Where the next iteration starts (None: its epoch's start, from a probe) and its
        epoch."""
        if self._resume is None or self._resume_epoch != self.epoch:
            # Saved before `set_epoch` named another epoch; or none (a mixture then starts
            # where this process reached that epoch's start, if it did).
            self._move_resume(self.epoch)
        return self._resume, self.epoch

    def _iterate(
        self, gen: int, start: dict[str, Any] | None, epoch: int, named: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """`__iter__`'s generator (the `gen`-th, starting at `start` of `epoch`, made after
        `named` calls that name a start): the stream opens at the first item."""
        self._take_device()
        client = connect(self.socket)
        if self._named != named:
            # A `set_epoch` or `load_state_dict` since `iter(dataset)` wins (a
            # StatefulDataLoader's `state_dict()` before the loop calls `iter(dataset)`); an
            # error of another iteration does not.
            start, epoch = self._start()
        if gen == self._pos_owner:
            self._stream_state, self._state_epoch = start, epoch
        if start is not None and self._keeps(epoch, start):
            self._started = (start, _worker())  # this epoch again starts here
        taken = start is not None and start is self._resume
        if taken:
            self._resume = None  # taken by this iteration
        took = False
        try:
            opened = self._open_shards if self.options.batch_size is None else self._open_batches
            with opened(client, start, epoch) as stream:
                for item in self._items(stream, epoch, gen):
                    took = True
                    yield item
        except (Exception, KeyboardInterrupt):
            # An iteration that ended in an error (a `Timeout`, a lost node) is continued by
            # the next iteration of this copy of the dataset, from the position `state_dict`
            # names: after the last item it yielded, else where it started. Starting the epoch
            # over would deliver its items again. That covers the main process (num_workers=0)
            # and one persistent worker; with several workers, the DataLoader closes the
            # generators of those that did not raise (GeneratorExit, as for `break`) and drops
            # what they prefetched, so they start their share over: there
            # `loader.load_state_dict(loader.state_dict())` before iterating again resumes
            # exactly. (Leaving the loop early, `break`, ends the generator otherwise: the next
            # iteration starts the epoch, as with any DataLoader.)
            if gen == self._pos_owner:
                if took and isinstance(self._stream_state, bytes):
                    self._stream_state = _binary.decode_state(self._stream_state)
                self._resume = self._stream_state if took else start
                self._resume_epoch = epoch
            elif taken and not took and self._resume is None:
                self._resume, self._resume_epoch = start, epoch  # not taken after all
            raise
        if gen == self._pos_owner:
            self._finish()

    def _finish(self) -> None:
        """Keeps the position of a mixture's iteration that ran to its end (the start of the
        epoch after it) in `_finished`: the next epoch starts there, every dataset at its
        cursor (see :meth:`_keeps`); before, it opened from a probe, and a run whose weights
        had changed (on a resume, or ``ds.dataset = {...}`` between epochs) repeated and
        skipped samples from the second epoch after the change on."""
        if not isinstance(self.dataset, Mapping) or self.options.batch_size is None:
            return
        state = self._stream_state
        if isinstance(state, bytes):
            state = self._stream_state = _binary.decode_state(state)
        if isinstance(state, dict) and isinstance(state.get("mix"), dict):
            self._finished = (state, _worker())

    def _open_shards(self, client: Client | HttpClient, state: dict[str, Any] | None, epoch: int) -> Stream | HttpStream:
        """The shard-mode stream of this process: stream rank ``effective_rank(rank,
        world_size, worker, num_workers)`` of ``world_size * num_workers``, delivering epochs
        ``epoch .. epoch + epochs - 1``; with a saved `state`, that same stream opened at it
        (O(1) on the node: no probe, no replay)."""
        self._check_options()  # keywords set as attributes since the dataset was made
        o = self.options
        # `ds.epochs` set since the epoch was (a saved `state` is checked nowhere else).
        _check_epoch_end("the dataset's epoch", epoch, o.epochs)
        rank, world = _torch_ranks(self.rank, self.world_size)
        try:
            if state is None:
                return open_at_epoch(
                    client, self.dataset, start_epoch=epoch, epochs=o.epochs, seed=o.seed,
                    rank=rank, world_size=world, uneven=o.uneven, device=o.device,
                    idle_timeout=self.idle_timeout,
                )
            # The stream of the saved iteration ends at epoch + epochs, as open_at_epoch's
            # does; a state saved after its last item (epoch + epochs, index 0) resumes to an
            # empty stream.
            return client.open_stream(
                self.dataset, epochs=epoch + o.epochs, seed=o.seed, rank=rank,
                world_size=world, uneven=o.uneven, state=state, device=o.device,
                **_transport_keywords(client, self.idle_timeout),
            )
        except ServiceError as e:
            said = _shard_open_error(e, rank, world, o.uneven)
            if said is e:
                raise
            raise said from e

    def _open_batches(self, client: Client | HttpClient, state: dict[str, Any] | None, epoch: int) -> Stream | HttpStream:
        """The batch-mode stream of this process: the DDP rank's batches, split among the
        DataLoader's workers (worker ``w`` of ``n`` takes the rank's batches ``w, w + n, ...``,
        the order in which the DataLoader polls them). A mixture's position kept as the
        epoch's start (:meth:`_keeps`) is opened at only where the node takes it for the
        request as it is now (:meth:`_takes`); else the epoch opens from a probe."""
        # `ds.epochs` set since the epoch was: before, the open raised about the sum.
        _check_epoch_end("the dataset's epoch", epoch, self.options.epochs)
        rank, world = _ddp_ranks(self.rank, self.world_size)
        worker, workers = _worker()
        opts = self.options.replace(rank=rank, world_size=world, worker=worker, num_workers=workers)
        extra = _transport_keywords(client, self.idle_timeout)
        end = epoch + opts.epochs
        kept = state is not None and self._keeps(epoch, state)
        if kept or (state is None and epoch > 0):
            # Epoch e's order needs the plan's fingerprint: learn it from a short-lived probe
            # (a kept state's too: whether the node takes it for this request).
            probe_opts = opts.replace(epochs=1, worker=None, num_workers=None)
            with client.open_stream(self.dataset, **probe_opts.keywords(), **extra) as probe:
                base = probe.state_dict()
            if not (kept and self._takes(state, base.get("fingerprint"))):
                state = {**base, "epoch": epoch, "index": 0, "cursor": 0} if epoch > 0 else None
        if state is not None:
            # The stream must reach the saved position: its epoch, and past it when the
            # position lies inside that epoch. A state at the end of the last epoch (the
            # start of the epoch after: index 0, or a worker's first index there) resumes to
            # nothing rather than another epoch.
            end = max(end, int(state["epoch"]) + self._inside(state))
        return client.open_stream(self.dataset, **opts.replace(epochs=end, state=state).keywords(), **extra)


def _shard_open_error(e: ServiceError, rank: int, world: int, uneven: str) -> ServiceError:
    """`e`, raised opening the shard-mode stream rank `rank` of `world` of this process, with
    what that stream is: a DataLoader worker's world size is ``world_size * num_workers``, not
    the one the trainer set, and a plan (``bad_plan``) or a saved state (``state_mismatch``)
    that names it says so."""
    worker, workers = _worker()
    where = (
        f"shard mode: this DataLoader process opens stream rank {rank} of {world}, "
        f"effective_rank(rank, world_size, worker={worker}, num_workers={workers})"
    )
    if e.code == "state_mismatch":
        return ServiceError(e.code, (
            f"{e.message} ({where}; a shard-mode state resumes only the same stream: the same "
            "world size, rank and num_workers, dataset, seed and uneven, and epochs that reach "
            "the saved position)"
        ))
    if e.code == "bad_plan" and workers > 1 and uneven == "drop":
        return ServiceError(e.code, (
            f"{e.message} ({where}: the DataLoader's workers split each rank, so the shards are "
            "planned over world_size * num_workers streams, not world_size; where the shards are "
            "fewer than those, use fewer workers or uneven=\"pad\")"
        ))
    return e


class _Epoch:
    """The epoch of a dataset pickled other than to start a DataLoader worker: a plain value
    with the interface of the shared one (``.value``)."""

    def __init__(self, value: int) -> None:
        self.value = value


def _option(name: str) -> property:
    """The attribute `name` of the dataset: its stream keyword, in ``options``."""

    def get(self: _DatasetMixin) -> Any:
        return getattr(self.options, name)

    def put(self: _DatasetMixin, value: Any) -> None:
        self.options = self.options.replace(**{name: value})

    return property(get, put, doc=f"The stream keyword ``{name}`` (in ``options``).")


for _name in DATASET_NAMES:
    setattr(_DatasetMixin, _name, _option(_name))
del _name


if TYPE_CHECKING:  # pragma: no cover - for type checkers only

    import torch.utils.data

    class IterableDataset(_DatasetMixin, torch.utils.data.IterableDataset[dict[str, np.ndarray]]):
        """See the module docstring."""

_CLASS: type | None = None

_DOC = """A ``torch.utils.data.IterableDataset`` of one shardwire dataset.

    Each item is one service batch (one shard): ``dict[str, numpy.ndarray]`` by tensor name.

    Args:
        dataset: Dataset name (or a mixture, as in ``Client.open_stream``).
        socket: Trainer socket (default ``$SHARDWIRE_SOCKET``, else /run/shardwire/trainer.sock);
            or the node's HTTP API, ``"http://HOST:PORT"`` (its admin address: see
            ``shardwire.connect_http``), where each item's tensors are downloaded and each
            item costs one request more than ``HttpStream.next`` (the stream's state, ``GET
            /v1/streams/{id}/state``, kept for ``state_dict()``).
        rank, world_size: the **data-parallel** rank and size: ranks given the same rank get
            the same items. Give both or neither (one alone raises ValueError: the other
            would be the DDP job's global value). Default from ``torch.distributed`` if
            initialised, else from ``RANK`` and ``WORLD_SIZE`` (torchrun's), else 0 of 1: the
            global rank, right for plain DDP/FSDP only. With tensor or pipeline parallelism
            the ranks of one model-parallel group must see the same batch: pass the
            data-parallel ones (e.g. Megatron's ``mpu.get_data_parallel_rank()`` and
            ``mpu.get_data_parallel_world_size()``, or your device mesh's ``"dp"`` dimension),
            else each such rank gets other samples and nothing says so. DataLoader workers
            started with spawn or forkserver get those of the process that started them, and
            its CUDA device (``device``: ``"auto"`` names that process's current device).
            Workers forked after that process started CUDA through torch resolve ``device``
            from what it noted of its GPUs as it forked (they cannot use CUDA themselves).
        idle_timeout: over HTTP only (``socket="http://..."``; else ValueError): seconds
            without a request after which the node closes the stream, as
            ``HttpClient.open_stream`` takes it (default the node's, 300 s; at most 86400).
            A generator paused longer than that between items (an evaluation pass, a long
            checkpoint save, a DataLoader worker waiting on its index queue) finds its stream
            gone: the next item raises ``ServiceError`` ``not_found``. Set it above your
            longest pause.
        copy: True (default): yield writable copies (``np.array(view)``; on a node with
            ``memory = "cuda"``, a torch tensor cloned on the GPU, already there: leave the
            DataLoader's ``pin_memory`` False, as torch cannot pin a CUDA tensor and raises
            RuntimeError on the first item), the batch released with
            the stream's next request; needed whenever several items are alive together
            (``batch_size`` not None, prefetching, ``num_workers > 0``, where the DataLoader
            pickles items across processes anyway). False: yield the read-only zero-copy
            views themselves; each is valid only until the next item is taken
            (auto-release), so use it only with ``num_workers=0, batch_size=None`` and
            consume each item before the next. The DataLoader passes these views through
            as numpy arrays (``shardwire.Tensor``; it converts only plain ``ndarray``).
            ``torch.from_numpy`` shares their memory, and torch has no read-only tensors:
            an in-place write through one kills the process (SIGSEGV, the mapping is
            read-only); ``.clone()`` a tensor you will write to.
        timeout: seconds per ``next`` (raises ``shardwire.Timeout``); None waits.
        <stream keywords>

    The stream keywords are those of ``Client.open_stream`` (the fields of
    ``shardwire.StreamOptions``; all ranks must agree on them) except ``state``, ``worker`` and
    ``num_workers``, which the dataset sets itself (``load_state_dict``, the DataLoader's
    workers). In batch mode every item is ``batch_size`` samples; in token mode ``tokens``
    ``[batch_size, seq_len + 1]``.

    Batch mode: the global order depends only on (dataset, seed, epoch, shuffle,
    shuffle_block, partitions); each DDP rank takes its share of every global step, and its
    DataLoader workers split the rank's batches round robin (worker ``w`` of ``n`` takes
    ``w, w + n, ...`` counted from the first epoch's start, the order the DataLoader yields
    them in), so the sequence of items does not depend on ``num_workers`` (after the first
    epoch, only when the rank's batches per epoch are a multiple of ``num_workers``; else each
    round of ``n`` comes rotated, nothing lost or repeated). ``state_dict()`` / ``load_state_dict()`` follow torchdata's
    Stateful protocol: ``StatefulDataLoader`` checkpoints and resumes the dataset in each
    worker (or in the main process with ``num_workers=0``) exactly, and the node starts at the
    saved position: nothing is replayed. Note that with ``n`` workers each worker's stream
    reads the rank's blocks, so the node fetches them ``n`` times; the node already runs
    ahead of the trainer, so ``num_workers=0`` is usually best.

    Shard mode (no ``batch_size``): in ``__iter__`` (i.e. in each DataLoader worker) the stream
    rank is ``effective_rank(rank, world_size, worker_id, num_workers)``: workers split each
    DDP rank, so no shard is duplicated or dropped beyond what the uneven policy does over
    ``world_size * num_workers`` streams. ``set_epoch(e)`` makes the next iteration deliver
    epochs ``e .. e + epochs - 1``. ``state_dict()`` / ``load_state_dict()`` work as in batch
    mode: each worker (or the main process) saves its own stream's position after the last
    shard it yielded (``{epoch, index, seed, fingerprint}``, inside any of those epochs, or
    their end), and the resumed stream starts at the next shard: nothing is replayed. The
    saved stream is one rank of ``world_size * num_workers``, so resume with the same world
    size and ``num_workers`` (and dataset, seed, uneven); otherwise the first item raises
    ``ServiceError`` ``state_mismatch`` naming the field (from a DataLoader worker, torch
    re-raises it as a ``RuntimeError`` quoting it).
    """


def _dataset_class() -> type:
    global _CLASS
    if _CLASS is None:
        import torch.utils.data

        doc = fill_doc(_DOC, DATASET_NAMES)
        cls = type("IterableDataset", (_DatasetMixin, torch.utils.data.IterableDataset), {"__doc__": doc, "__module__": __name__})
        cls.__qualname__ = "IterableDataset"  # picklable as shardwire.torch.IterableDataset
        _CLASS = cls
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "IterableDataset":
        return _dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
