"""shardwire: the Python trainer SDK of the shardwire node service.

The node service (``shardwire serve``) hands dataset shards to trainers over a Unix socket;
each stream's memory region is passed as a file descriptor and mapped read-only here, and
every tensor is a zero-copy, read-only numpy view of that mapping::

    import shardwire

    client = shardwire.connect()            # $SHARDWIRE_SOCKET or /run/shardwire/trainer.sock
    with client.open_stream("imagenet", seed=1, rank=0, world_size=8, epochs=2) as stream:
        for batch in stream:                # the previous batch is released automatically
            x = batch["image"]              # numpy, read-only, no copy
            ...
            ckpt = stream.state_dict()      # resume later with open_stream(..., state=ckpt)

Trainers that cannot share memory with the node use its HTTP API instead, with the same
Stream/Batch API (tensors are then downloaded copies)::

    client = shardwire.connect_http("127.0.0.1:7400")   # the node's --admin address

Batches export Arrow zero-copy (``pyarrow.record_batch(batch)``; pyarrow is optional).

A node run with ``memory = "cuda"`` keeps shards in GPU memory: its regions are imported with
cuda-python's driver bindings (:class:`CudaRegion`) and batch tensors are :class:`CudaTensor`
views on the GPU (``torch.from_dlpack(t)``, ``cupy.from_dlpack(t)``; no copy), see the README.

The keywords of ``open_stream`` (seed, rank, world_size, epochs, batch mode, token mode, ...)
are the fields of :class:`StreamOptions`, their one definition.

See :class:`Batch` for the lifetime rules (auto-release, ``keep()``), ``shardwire.torch`` for a
PyTorch ``IterableDataset`` (torch is imported only when that is used), and the README.
"""

from __future__ import annotations

from ._client import DEFAULT_SOCKET, SOCKET_ENV, Batch, Client, Stream, StreamInfo, TensorView, connect
from ._cuda import CudaRegion, CudaTensor
from ._errors import ConnectError, ConnectionClosed, CudaImportError, ProtocolError, ServiceError, ShardwireError, Timeout
from ._http import HttpBatch, HttpClient, HttpStream, connect_http
from ._options import StreamOptions
from ._tensor import Tensor

__version__ = "0.1.0"

__all__ = [
    "Tensor",
    "DEFAULT_SOCKET",
    "SOCKET_ENV",
    "Batch",
    "Client",
    "ConnectError",
    "ConnectionClosed",
    "CudaImportError",
    "CudaRegion",
    "CudaTensor",
    "HttpBatch",
    "HttpClient",
    "HttpStream",
    "ProtocolError",
    "ServiceError",
    "ShardwireError",
    "Stream",
    "StreamInfo",
    "StreamOptions",
    "TensorView",
    "Timeout",
    "connect",
    "connect_http",
]
