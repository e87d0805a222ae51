"""PyTorch integration: ``shardwire.torch.IterableDataset``.

torch is imported lazily: importing ``shardwire`` or ``shardwire.torch`` does not import it;
touching ``shardwire.torch.IterableDataset`` does (and fails with ImportError if torch is not
installed). The rank arithmetic (:func:`effective_rank`) and :func:`open_at_epoch` need no torch.

Usage::

    from shardwire.torch import IterableDataset
    ds = IterableDataset("imagenet", seed=1)            # rank/world from torch.distributed
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4)
    for epoch in range(10):
        ds.set_epoch(epoch)
        for item in loader:                             # dict: tensor name -> torch.Tensor
            ...

Each item is one shard (one service batch) as a dict of arrays; use ``batch_size=None`` so the
DataLoader does not stack several shards (or pass a ``collate_fn`` that knows how).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ._client import Client, Stream, Uneven, connect
from ._cuda import CudaTensor

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
    client: Client,
    dataset: str,
    *,
    start_epoch: int,
    epochs: int = 1,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    uneven: Uneven = "pad",
) -> Stream:
    """Opens a stream that delivers epochs ``start_epoch .. start_epoch + epochs - 1``.

    Epoch ``e``'s order depends on ``e`` (and the seed), so this is how a loader that is
    iterated once per epoch gets a fresh order each time. For ``start_epoch > 0`` it opens a
    short-lived probe stream to learn the plan's fingerprint, closes it, and resumes at
    ``{epoch: start_epoch, index: 0}``; the probe costs one attach and a little fetch-ahead.
    """
    opts: dict[str, Any] = {"seed": seed, "rank": rank, "world_size": world_size, "uneven": uneven}
    if start_epoch < 0:
        raise ValueError(f"start_epoch must be >= 0, not {start_epoch}")
    if start_epoch == 0:
        return client.open_stream(dataset, epochs=epochs, **opts)
    with client.open_stream(dataset, epochs=1, **opts) as probe:
        fingerprint = probe.info.state["fingerprint"]
    state = {"epoch": start_epoch, "index": 0, "seed": seed, "fingerprint": fingerprint}
    return client.open_stream(dataset, epochs=start_epoch + epochs, state=state, **opts)


def _torch_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Effective (rank, world size) of the calling DataLoader worker (or main process)."""
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    info = get_worker_info()
    worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return effective_rank(rank, world_size, worker_id, num_workers)


def _copy(view: Any) -> Any:
    """A writable copy of one batch tensor: a numpy array for host regions, a torch tensor
    on the same GPU for CUDA regions (``memory = "cuda"``)."""
    if isinstance(view, CudaTensor):
        return view.to_torch().clone()
    return np.array(view)


class _DatasetMixin:
    """The torch-independent body of :class:`IterableDataset` (see its docstring)."""

    def __init__(
        self,
        dataset: str,
        *,
        socket: str | None = None,
        seed: int = 0,
        epochs: int = 1,
        uneven: Uneven = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        copy: bool = True,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.socket = socket
        self.seed = seed
        self.epochs = epochs
        self.uneven: Uneven = uneven
        self.rank = rank
        self.world_size = world_size
        self.copy = copy
        self.timeout = timeout
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at `epoch` (its own shuffle order), like
        ``DistributedSampler.set_epoch``. Call it before iterating the loader each epoch."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        rank, world = _torch_ranks(self.rank, self.world_size)
        client = connect(self.socket)
        with open_at_epoch(
            client, self.dataset, start_epoch=self.epoch, epochs=self.epochs,
            seed=self.seed, rank=rank, world_size=world, uneven=self.uneven,
        ) as stream:
            while True:
                batch = stream.next(self.timeout)
                if batch is None:
                    return
                if self.copy:
                    item = {k: _copy(v) for k, v in batch.items()}  # writable copies
                    batch.release()  # free the region at once
                else:
                    item = dict(batch)  # views: valid until the next item is taken
                yield item


if TYPE_CHECKING:  # pragma: no cover - for type checkers only

    import torch.utils.data

    class IterableDataset(_DatasetMixin, torch.utils.data.IterableDataset[dict[str, np.ndarray]]):
        """See the module docstring."""

_CLASS: type | None = None

_DOC = """A ``torch.utils.data.IterableDataset`` of one shardwire dataset.

    Each item is one service batch (one shard): ``dict[str, numpy.ndarray]`` by tensor name.

    Args:
        dataset: Dataset name.
        socket: Trainer socket (default ``$SHARDWIRE_SOCKET``, else /run/shardwire/trainer.sock).
        seed, epochs, uneven: as in ``Client.open_stream`` (all ranks must agree).
        rank, world_size: default from ``torch.distributed`` if initialised, else 0 of 1.
        copy: True (default): yield writable copies (``np.array(view)``; on a node with
            ``memory = "cuda"``, a torch tensor cloned on the GPU) and release the batch
            at once; needed whenever several items are alive together (``batch_size`` not None,
            prefetching, ``num_workers > 0``, where the DataLoader pickles items across
            processes anyway). False: yield the read-only zero-copy views themselves; each is
            valid only until the next item is taken (auto-release), so use it only with
            ``num_workers=0, batch_size=None`` and consume each item before the next. torch
            warns about read-only arrays when it converts them.
        timeout: seconds per ``next`` (raises ``shardwire.Timeout``); None waits.

    In ``__iter__`` (i.e. in each DataLoader worker) the stream rank is
    ``effective_rank(rank, world_size, worker_id, num_workers)``: workers split each DDP rank,
    so no shard is duplicated or dropped beyond what the uneven policy does over
    ``world_size * num_workers`` streams. ``set_epoch(e)`` makes the next iteration deliver
    epochs ``e .. e + epochs - 1``. Resuming from a state dict is not supported here (each
    worker has its own stream); use ``Client.open_stream(..., state=...)`` directly.
    """


def _dataset_class() -> type:
    global _CLASS
    if _CLASS is None:
        import torch.utils.data

        cls = type("IterableDataset", (_DatasetMixin, torch.utils.data.IterableDataset), {"__doc__": _DOC, "__module__": __name__})
        cls.__qualname__ = "IterableDataset"  # picklable as shardwire.torch.IterableDataset
        _CLASS = cls
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "IterableDataset":
        return _dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
