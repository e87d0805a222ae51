"""Arrow export of batches (the Arrow PyCapsule protocol), built lazily with pyarrow.

A batch becomes one Arrow record batch: each tensor is a column with one row per element of
its leading dimension.

- 1-D tensor ``[n]``: a primitive column (``int64``, ``float32``, ...).
- N-D tensor ``[n, *rest]``: an ``arrow.fixed_shape_tensor`` extension column
  (``pa.fixed_shape_tensor(value_type, rest)``) whose storage is a ``FixedSizeList`` of
  ``prod(rest)`` values per row.

The columns are **zero-copy**: their value buffers are the tensors' own memory (for a socket
batch, the stream's mapped region), wrapped with ``pa.py_buffer`` and ``pa.Array.from_buffers``;
Arrow keeps the numpy arrays (and so the mapping) alive. The lifetime rules of the batch apply
unchanged: after the batch is released the bytes may change under the Arrow arrays too.

All tensors must have the same leading dimension (a record batch has one row count); otherwise
``ValueError`` names each tensor's shape; ``Batch.arrow_columns()`` gives every tensor as its
own Arrow array in that case. 0-D tensors have no rows and are refused the same way.

pyarrow is optional for the SDK: it is imported only here, on first use, and its absence
raises ``ImportError`` with a message that says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

__all__ = ["ArrowExport", "require_pyarrow", "column", "columns", "record_batch"]


def require_pyarrow() -> Any:
    """The pyarrow module, or ImportError explaining that Arrow export needs it."""
    try:
        import pyarrow
    except ImportError as e:
        raise ImportError(
            "shardwire: Arrow export (Batch.to_arrow, pa.record_batch(batch), __arrow_c_array__) "
            "needs pyarrow >= 14, which the shardwire SDK does not install: pip install pyarrow"
        ) from e
    return pyarrow


def column(name: str, arr: np.ndarray) -> pa.Array:
    """Tensor `arr` as an Arrow array sharing its memory (see the module docstring)."""
    pa = require_pyarrow()
    if arr.ndim == 0:
        raise ValueError(f"tensor {name!r} is 0-dimensional: it has no rows to make an Arrow column of")
    if not arr.flags.c_contiguous:
        raise ValueError(f"tensor {name!r} is not C-contiguous; Arrow export needs contiguous memory")
    value_type = pa.from_numpy_dtype(arr.dtype)
    flat = arr.reshape(-1)  # a view: the array is contiguous
    values = pa.Array.from_buffers(value_type, flat.size, [None, pa.py_buffer(flat)])
    if arr.ndim == 1:
        return values
    rest = [int(d) for d in arr.shape[1:]]
    row = math.prod(rest)
    if not 0 < row < 2**31:
        # Arrow's fixed-size lists hold 1 .. 2^31 - 1 values each (a size of 0 is refused, or
        # crashes pyarrow when given as a type).
        raise ValueError(
            f"tensor {name!r} of shape {tuple(arr.shape)}: its rows hold {row} values, and an Arrow "
            "fixed-shape tensor column needs 1 .. 2^31 - 1; read it as numpy (batch[name])"
        )
    storage = pa.FixedSizeListArray.from_arrays(values, row)
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(value_type, rest), storage)


def columns(tensors: Mapping[str, np.ndarray]) -> dict[str, pa.Array]:
    """Every tensor as its own zero-copy Arrow array (any leading dimensions)."""
    return {name: column(name, a) for name, a in tensors.items()}


def record_batch(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> pa.RecordBatch:
    """All tensors as one zero-copy record batch; ValueError unless their leading dimensions
    agree."""
    pa = require_pyarrow()
    shapes = {name: tuple(a.shape) for name, a in tensors.items()}
    for name, s in shapes.items():
        if not s:
            raise ValueError(f"tensor {name!r} is 0-dimensional: it has no rows to make an Arrow column of")
    rows = {s[0] for s in shapes.values()}
    if len(rows) > 1:
        desc = ", ".join(f"{n}{list(s)}" for n, s in shapes.items())
        raise ValueError(
            "the batch's tensors have different leading dimensions, so they cannot be rows of one "
            f"Arrow record batch: {desc}; use batch.arrow_columns() for one Arrow array per tensor"
        )
    cols = columns(tensors)
    schema = pa.schema([pa.field(n, c.type, nullable=False) for n, c in cols.items()], metadata=dict(metadata or {}))
    return pa.RecordBatch.from_arrays(list(cols.values()), schema=schema)


class ArrowExport:
    """Arrow export for a batch class: it provides ``_tensors`` (name -> numpy array), the
    ``epoch``/``index``/``shard`` attributes and an ``_arrow_rb`` slot initialised to None."""

    __slots__ = ()

    _tensors: dict[str, np.ndarray]
    _arrow_rb: Any
    epoch: int
    index: int
    shard: int

    def to_arrow(self) -> pa.RecordBatch:
        """The batch as a zero-copy ``pyarrow.RecordBatch`` (built once, then cached): one
        column per tensor, one row per element of the leading dimension; N-D tensors are
        ``arrow.fixed_shape_tensor`` columns. Schema metadata: ``shardwire.epoch``,
        ``shardwire.index``, ``shardwire.shard``.

        Raises:
            ImportError: pyarrow is not installed.
            ValueError: the tensors' leading dimensions differ (see :meth:`arrow_columns`),
                or a tensor is 0-dimensional.
        """
        if self._arrow_rb is None:
            meta = {"shardwire.epoch": str(self.epoch), "shardwire.index": str(self.index), "shardwire.shard": str(self.shard)}
            self._arrow_rb = record_batch(self._tensors, meta)
        return self._arrow_rb

    def arrow_columns(self) -> dict[str, pa.Array]:
        """Every tensor as its own zero-copy Arrow array (works whatever the leading
        dimensions; 0-D tensors raise ValueError)."""
        return columns(self._tensors)

    def __arrow_c_schema__(self) -> Any:
        """Arrow PyCapsule protocol: the schema of :meth:`to_arrow`."""
        return self.to_arrow().schema.__arrow_c_schema__()

    def __arrow_c_array__(self, requested_schema: Any = None) -> tuple[Any, Any]:
        """Arrow PyCapsule protocol: ``pa.record_batch(batch)`` (or any Arrow consumer)
        imports the batch without copying."""
        return self.to_arrow().__arrow_c_array__(requested_schema)
