"""The stream keywords of ``open_stream``, defined once: :class:`StreamOptions`.

Every keyword that says which stream to open (``seed``, ``rank``, ..., ``order``) is one field
of :class:`StreamOptions`, with its type, its default and its documentation; the class also
holds the checks on their values and their conversion to the fields of ``attach`` (the socket
message; ``POST /v1/streams`` takes the same fields plus ``idle_timeout_s``). The entry points
take them through it:

- :meth:`shardwire.Client.open_stream` ``(dataset, **options)``;
- :meth:`shardwire.HttpClient.open_stream` ``(dataset, *, idle_timeout=None, **options)``;
- :class:`shardwire.torch.IterableDataset` ``(dataset, *, socket=None, copy=True,
  timeout=None, rank=None, world_size=None, idle_timeout=None, **options)``: its own
  keywords (``idle_timeout`` over HTTP only), then the stream
  keywords except those it sets itself (``state``, ``worker``, ``num_workers``; a field's
  ``metadata["dataset"]`` says why).

Their docstrings list the keywords generated from these fields (:func:`document`,
:func:`fill_doc`), so ``help(shardwire.Client.open_stream)`` shows each one.

**Static typing.** ``**options`` is annotated ``Unpack[StreamKeywords]`` (PEP 692), so type
checkers know each keyword's name and type. A TypedDict cannot hold defaults or documentation,
so :class:`DatasetKeywords` and :class:`StreamKeywords` repeat the names and types of the
fields, nothing else: importing this module fails if their names differ from the fields', and
tests/e2e/test_sdk_options.py compares the types. ``Unpack`` is imported for type checkers only
(``typing`` from Python 3.11, ``typing_extensions`` on 3.10, which every type checker ships);
at run time the annotations stay strings (``from __future__ import annotations``), so the
package needs neither.

**Adding a keyword** (e.g. ``device``): a field here (type, default, doc), the same name and
type in :class:`StreamKeywords` (or :class:`DatasetKeywords` if the torch dataset passes it
on), and its wire field in :meth:`StreamOptions.attach_fields`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from . import _device, _wire
from ._types import Shuffle, Uneven

if TYPE_CHECKING:  # pragma: no cover - re-exported for the entry points' annotations
    import sys

    if sys.version_info >= (3, 11):
        from typing import Unpack as Unpack
    else:
        from typing_extensions import Unpack as Unpack

__all__ = ["DatasetKeywords", "StreamKeywords", "StreamOptions", "document", "fill_doc"]


def _opt(default: Any, doc: str, *, dataset: str | None = None) -> Any:
    """A keyword's field: its default, its documentation (``metadata["doc"]``) and, for a
    keyword the torch dataset does not pass on as given, why (``metadata["dataset"]``)."""
    return field(default=default, metadata={"doc": inspect.cleandoc(doc), "dataset": dataset})


#: ``metadata["dataset"]`` of the keywords the torch dataset takes as its own (default from
#: torch.distributed) rather than in ``**options``.
OWN = "own"


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """The keywords of ``open_stream`` (:meth:`shardwire.Client.open_stream`,
    :meth:`shardwire.HttpClient.open_stream`, :class:`shardwire.torch.IterableDataset`): one
    field each, with its default. Build one with :meth:`of`; :meth:`attach_fields` checks the
    values and gives the request's fields.

    Attributes:
        <stream keywords>
    """

    seed: int = _opt(0, "Shuffle seed; every rank of a job must use the same one.")
    rank: int = _opt(
        0,
        "This trainer's rank, ``0 <= rank < world_size``.",
        dataset=OWN,
    )
    world_size: int = _opt(1, "Number of ranks sharing the dataset.", dataset=OWN)
    epochs: int = _opt(1, "Epochs to deliver.")
    uneven: Uneven = _opt(
        "pad",
        """
        When the shard count is not a multiple of `world_size`: ``"pad"`` repeats shards from
        the start of the epoch's order, ``"drop"`` drops the tail; either way every rank gets
        the same number of batches per epoch. No effect in batch mode.
        """,
    )
    state: Mapping[str, Any] | None = _opt(
        None,
        """
        A :meth:`Stream.state_dict` saved earlier, to resume exactly at the batch after the
        last one taken. Shard mode: dataset, seed, world size, rank and uneven policy must
        match. Batch mode: the state is global (any rank's resumes every rank); dataset, seed,
        shuffle, shuffle_block, partitions, drop_last and the global batch (``batch_size *
        world_size``) must match, and the world size must divide the partitions or be a
        multiple of them. Otherwise :class:`ServiceError` code ``"state_mismatch"`` or
        ``"bad_plan"``, naming the field and the rule.
        """,
        dataset="the dataset resumes from load_state_dict()",
    )
    batch_size: int | None = _opt(
        None,
        """
        Samples per batch for this rank: **batch mode**. Every batch tensor is shaped
        ``[batch_size, ...]``; global step ``s`` takes ``batch_size * world_size`` samples.
        None (default): shard mode, one shard per batch.
        """,
    )
    shuffle: Shuffle | None = _opt(
        None,
        """
        Batch mode: ``"block"`` (default: shards permuted, samples shuffled within blocks of
        about `shuffle_block` samples), ``"shards"`` (shard order shuffled, rows in order) or
        ``"none"`` (storage order).
        """,
    )
    shuffle_block: int | None = _opt(
        None,
        """
        Batch mode, ``"block"``: samples per shuffle block (default: the samples of 8 average
        shards). Larger mixes better and keeps more shards resident on the node.
        """,
    )
    partitions: int | None = _opt(
        None,
        """
        Batch mode: canonical partitions (default: `world_size`, or the resume state's). The
        order depends on them, never on the world size; a job may resume on any world size
        that divides them or is a multiple of them.
        """,
    )
    drop_last: bool = _opt(
        False,
        """
        Batch mode: drop the last partial global batch (each sample at most once per epoch);
        default False completes it with samples from the start of the epoch (each sample at
        least once).
        """,
    )
    worker: int | None = _opt(
        None,
        """
        Batch mode, with `num_workers`: deliver only this rank's batches ``worker, worker +
        num_workers, ...`` (a DataLoader worker's share; see
        :class:`shardwire.torch.IterableDataset`). None: 0.
        """,
        dataset="the dataset sets it for each DataLoader worker",
    )
    num_workers: int | None = _opt(
        None,
        "Batch mode: how many workers split this rank's batches (see `worker`). None: 1.",
        dataset="the dataset sets it for each DataLoader worker",
    )
    seq_len: int | None = _opt(
        None,
        """
        **Token mode** (needs `batch_size`): each sample is a window of ``seq_len + 1`` tokens
        of the documents (the rows of the dataset's ragged integer tensor: a Megatron
        ``.bin/.idx``, ``shardwire index --tokens``, an ``input_ids`` column); consecutive
        windows start `seq_len` tokens apart and overlap by one. Each batch is ``tokens``
        ``[batch_size, seq_len + 1]``. `shuffle` applies to documents and windows within
        bounded blocks.
        """,
    )
    tokens_column: str | None = _opt(
        None,
        """
        Token mode: the documents' tensor when the dataset has several ragged integer
        tensors; other tensors are not delivered.
        """,
    )
    token_dtype: str | None = _opt(
        None,
        """
        Token mode: ``"int32"`` or ``"int64"``: widen ``tokens`` during assembly (default: the
        dataset's dtype).
        """,
    )
    boundaries: bool = _opt(
        False,
        """
        Token mode: also deliver ``positions`` (int32, same shape: each token's position in its
        document, 0 at every document start).
        """,
    )
    order: str | None = _opt(
        None,
        """
        Token mode: ``"megatron"`` delivers the windows of megatron-core's ``GPTDataset`` for
        this seed and seq_len (partitions 1; epoch ``e`` uses ``random_seed = seed + e``);
        default ``"shardwire"`` (blocks, elastic).
        """,
    )

    device: str | int | None = _opt(
        "auto",
        """
        The trainer's GPU, so that the node serves the stream on that GPU's lane (its region
        on that GPU when the node serves CUDA memory, its shards through the NIC nearest to
        it): ``"cuda:3"`` or ``3`` (an ordinal of this process), a PCI bus id
        (``"0000:19:00.0"``) or a GPU UUID (``"GPU-..."``). ``"auto"`` (default): when the node
        serves CUDA memory, this process's current CUDA device (torch's when torch is imported,
        else cuda-python's); otherwise none (and none for a node too old to say, which answers
        ``info`` with ``bad_request``; any other refusal raises as the node sent it). None: no
        GPU; the node picks its least loaded lane. A GPU the node does not serve is refused
        (``ServiceError`` code ``"unknown_device"``, naming it and the node's GPUs).
        """,
    )

    @classmethod
    def of(cls, options: Mapping[str, Any], caller: str, refused: Mapping[str, str] | None = None) -> StreamOptions:
        """The options of `caller`'s ``**options``. Values are checked by
        :meth:`attach_fields`, when the stream opens.

        Raises:
            TypeError: a keyword that is not a field, or one of `refused` (keyword -> why),
                named as Python names an unexpected keyword argument.
        """
        refused = refused or {}
        bad = [k for k in options if k not in _NAMES or k in refused]
        if bad:
            named = [f"{k!r} ({refused[k]})" if k in refused else repr(k) for k in bad]
            if len(bad) == 1:
                raise TypeError(f"{caller}() got an unexpected keyword argument {named[0]}")
            raise TypeError(f"{caller}() got unexpected keyword arguments {', '.join(named)}")
        return cls(**options)

    def replace(self, **changes: Any) -> StreamOptions:
        """A copy with `changes` (field names)."""
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """Every field by name, as keywords for ``open_stream(dataset, **keywords)``."""
        return {name: getattr(self, name) for name in _NAMES}

    def attach_fields(self, dataset: str | Mapping[str, float]) -> dict[str, Any]:
        """The fields of ``attach`` (and of the HTTP ``POST /v1/streams`` body) for `dataset`,
        a name or a mixture (a mapping of dataset names to weights): the protocol version, the
        dataset, seed, rank, world_size, epochs, uneven and state always (state None is sent
        as null), every other field only when it is not its default (None, False, ``device``
        ``"auto"``: the caller fills it, it needs the node's memory kind).

        An integer keyword takes any integer (an ``int``, a numpy integer, any
        ``numbers.Integral``; not a bool), sent as an ``int``.

        Raises:
            ValueError: a value out of range (``rank >= world_size``, ``worker >= num_workers``
                included), or a keyword without the one it needs (nothing is sent); the
                message names them.
        """
        if self.uneven not in ("pad", "drop"):
            raise ValueError(f"uneven must be 'pad' or 'drop', not {self.uneven!r}")
        fields: dict[str, Any] = {"version": _wire.VERSION, "dataset": "" if isinstance(dataset, Mapping) else str(dataset)}
        for name, lo in (("seed", 0), ("rank", 0), ("world_size", 1), ("epochs", 1)):
            fields[name] = _int_at_least(name, getattr(self, name), lo)
        if fields["rank"] >= fields["world_size"]:
            raise ValueError(f"rank must be < world_size (ranks are 0 to world_size - 1): rank {fields['rank']}, "
                             f"world_size {fields['world_size']}")
        fields["uneven"] = self.uneven
        fields["state"] = dict(self.state) if self.state is not None else None
        for name, lo in (("batch_size", 1), ("shuffle_block", 1), ("partitions", 1), ("worker", 0), ("num_workers", 1), ("seq_len", 1)):
            v = getattr(self, name)
            if v is not None:
                fields[name] = _int_at_least(name, v, lo)
        if self.shuffle is not None:
            if self.shuffle not in ("none", "shards", "block"):
                raise ValueError(f"shuffle must be 'none', 'shards' or 'block', not {self.shuffle!r}")
            fields["shuffle"] = self.shuffle
        if self.drop_last:
            fields["drop_last"] = True
        if self.device is not None and self.device != _device.AUTO:
            fields["device"] = _device.resolve(_as_int(self.device) if _is_int(self.device) else self.device)
        self._token_fields(fields)
        if isinstance(dataset, Mapping):
            fields["mix"] = _mix_entries(dataset)
            if "batch_size" not in fields:
                raise ValueError("a mixture (a mapping of datasets to weights) needs batch_size (batch mode)")
        if "batch_size" not in fields:
            # `worker=0` and `num_workers=1` ask for nothing more than one stream: as the node.
            split = [k for k, alone in (("worker", 0), ("num_workers", 1)) if fields.get(k, alone) != alone]
            given = [k for k in ("shuffle", "shuffle_block", "partitions", "drop_last") if k in fields] + split
            if given:
                hint = ""
                if "worker" in given or "num_workers" in given:
                    hint = "; in shard mode give each DataLoader worker its own rank (shardwire.torch.effective_rank)"
                raise ValueError(f"{', '.join(given)} need batch_size (batch mode){hint}")
        _check_worker(fields)
        return fields

    def _token_fields(self, fields: dict[str, Any]) -> None:
        """Adds the token-mode fields (``tokens_column``, ``token_dtype``, ``boundaries``,
        ``order``) to `fields`, checked; they need ``seq_len``, which needs ``batch_size``."""
        if self.tokens_column is not None:
            fields["tokens_column"] = str(self.tokens_column)
        if self.token_dtype is not None:
            if self.token_dtype not in ("int32", "int64"):
                raise ValueError(f"token_dtype must be 'int32' or 'int64', not {self.token_dtype!r}")
            fields["token_dtype"] = self.token_dtype
        if self.boundaries:
            fields["boundaries"] = True
        if self.order is not None:
            if self.order not in ("shardwire", "megatron"):
                raise ValueError(f"order must be 'shardwire' or 'megatron', not {self.order!r}")
            fields["order"] = self.order
        if "seq_len" not in fields:
            given = [k for k in ("tokens_column", "token_dtype", "boundaries", "order") if k in fields]
            if given:
                raise ValueError(f"{', '.join(given)} need seq_len (token mode)")
        elif "batch_size" not in fields:
            raise ValueError("seq_len needs batch_size: token windows are delivered in batches")


def _is_int(v: Any) -> bool:
    """Whether `v` is an integer: an int, a numpy integer, any ``numbers.Integral``; not a
    bool (numpy's ``bool_`` is no Integral)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _as_int(v: Any) -> int:
    """The int of integer `v` (see `_is_int`): what JSON encodes (a numpy integer it refuses)."""
    return int(operator.index(v))


#: The wire's width of each integer keyword (the node's attach request): 64-bit unsigned for
#: these, 32-bit for the rest. A larger value is refused here, not by the node (which drops
#: the connection on a request it cannot decode).
_U64 = frozenset({"seed", "shuffle_block", "seq_len"})


def _int_at_least(name: str, v: Any, lo: int) -> int:
    """`v` as an int, if it is an integer (see `_is_int`) >= `lo` and within its field's
    width on the wire; else ValueError naming it."""
    bits = 64 if name in _U64 else 32
    if not _is_int(v) or _as_int(v) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, not {v!r}")
    if _as_int(v) >= 1 << bits:
        raise ValueError(f"{name} must be below 2**{bits} (its field in the attach request), not {v!r}")
    return _as_int(v)


def _check_worker(fields: Mapping[str, Any]) -> None:
    """ValueError unless ``worker < num_workers`` (a worker given alone is one of 1)."""
    worker, of = fields.get("worker", 0), fields.get("num_workers")
    if worker >= (1 if of is None else of):
        if of is None:
            raise ValueError(f"worker {worker} needs num_workers > {worker} (without it there is one worker, 0)")
        raise ValueError(f"worker must be < num_workers (workers are 0 to num_workers - 1): worker {worker}, num_workers {of}")


def _mix_entries(mix: Mapping[str, float]) -> list[dict[str, Any]]:
    """The ``mix`` field of a mapping of dataset names to weights: positive, finite real
    numbers (int, float, a numpy scalar, any ``numbers.Real``; not a bool), sent as floats."""
    if not mix:
        raise ValueError("a mixture needs at least one dataset")
    out = []
    for name, w in mix.items():
        real = isinstance(w, numbers.Real) and not isinstance(w, bool)
        try:
            weight = float(w) if real else math.nan
        except OverflowError:  # an int or Fraction beyond float's range
            weight = math.inf
        if not 0 < weight < math.inf:
            raise ValueError(f"mix weight of {name!r} must be a positive number, not {w!r}")
        out.append({"dataset": str(name), "weight": weight})
    return out


_FIELDS = dataclasses.fields(StreamOptions)
#: Every stream keyword, in definition order.
_NAMES = tuple(f.name for f in _FIELDS)
#: The keywords the torch dataset takes in ``**options`` (passed on as given).
DATASET_NAMES = tuple(f.name for f in _FIELDS if f.metadata["dataset"] is None)
#: The keywords the torch dataset refuses in ``**options``, and why (it sets them itself).
DATASET_REFUSED = {f.name: str(f.metadata["dataset"]) for f in _FIELDS if f.metadata["dataset"] not in (None, OWN)}


# --- static typing: the names and types of the fields, as TypedDicts (see the module docstring)


class DatasetKeywords(TypedDict, total=False):
    """The stream keywords the torch dataset takes in ``**options``: the fields of
    :class:`StreamOptions` whose ``metadata["dataset"]`` is None (for type checkers)."""

    seed: int
    epochs: int
    uneven: Uneven
    batch_size: int | None
    shuffle: Shuffle | None
    shuffle_block: int | None
    partitions: int | None
    drop_last: bool
    seq_len: int | None
    tokens_column: str | None
    token_dtype: str | None
    boundaries: bool
    order: str | None
    device: str | int | None


class StreamKeywords(DatasetKeywords, total=False):
    """Every stream keyword: the fields of :class:`StreamOptions` (for type checkers)."""

    rank: int
    world_size: int
    state: Mapping[str, Any] | None
    worker: int | None
    num_workers: int | None


def _check_typed_dicts() -> None:
    """The TypedDicts name exactly the fields (a keyword added to one only fails here, at
    import, not silently)."""
    for td, names in ((StreamKeywords, _NAMES), (DatasetKeywords, DATASET_NAMES)):
        if set(td.__annotations__) != set(names):
            raise AssertionError(f"shardwire._options: {td.__name__} names {sorted(td.__annotations__)}, StreamOptions {sorted(names)}")


_check_typed_dicts()


# --- documentation ------------------------------------------------------------------------

#: The line of a docstring that :func:`fill_doc` replaces with the keywords' entries.
MARK = "<stream keywords>"


def fill_doc(doc: str, names: tuple[str, ...] = _NAMES) -> str:
    """`doc` with its :data:`MARK` line replaced by one ``Args`` entry per keyword of `names`
    (``name (type, default D):`` and the field's doc below it), indented as the mark."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == MARK:
            pad = line[: len(line) - len(line.lstrip())]
            entries = []
            for f in _FIELDS:
                if f.name in names:
                    entries.append(f"{pad}{f.name} ({f.type}, default {f.default!r}):")
                    entries += [f"{pad}    {t}" if t else "" for t in f.metadata["doc"].splitlines()]
            return "\n".join([*lines[:i], *entries, *lines[i + 1 :]]) + ("\n" if doc.endswith("\n") else "")
    raise ValueError(f"no {MARK!r} line in the docstring")


_F = TypeVar("_F", bound=Callable[..., Any])


def document(fn: _F) -> _F:
    """Fills the :data:`MARK` line of `fn`'s docstring with every stream keyword (no-op when
    docstrings are stripped, ``python -OO``)."""
    if fn.__doc__:
        fn.__doc__ = fill_doc(fn.__doc__)
    return fn


if StreamOptions.__doc__:  # None under python -OO
    StreamOptions.__doc__ = fill_doc(StreamOptions.__doc__)
