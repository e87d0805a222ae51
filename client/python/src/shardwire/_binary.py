"""The binary form of a ``batch`` reply (attach ``batch_encoding: "binary"``;
protocol/src/trainer/binary.rs, docs/TRAINER_API.md "Binary batch frames").

The fields a training loop needs on every hand-off are fixed-width little-endian words, read
here with a few ``struct`` calls instead of a JSON parse; each tensor's name, dtype and shape
(its ``desc``, the same batch after batch) are parsed once and cached by their bytes; the
resume state stays JSON bytes until a checkpoint asks for it.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ._errors import ProtocolError
from ._types import TensorView, _loads, _sized_dtype

#: First byte of a binary ``batch`` body (a JSON body starts with ``{``).
TAG = 0x01
_HEADER = struct.Struct("<BBHIQQII")  # tag, flags, tensors, state_len, lease, index, epoch, shard
#: `flags` bit: another batch answering the same ``next`` follows.
FLAG_MORE = 0x01
_TENSOR = struct.Struct("<QQH")  # offset, length, desc_len
#: Parsed descs by their bytes: (name, dtype, shape). Bounded; cleared when full.
_DESCS: dict[bytes, tuple[str, str, tuple[int, ...]]] = {}
#: (TensorView, its checked numpy dtype) by (desc, offset, length): a stream reuses a few
#: slabs, so the same views come back batch after batch (TensorView is frozen, so sharing one
#: is safe). Bounded likewise.
_VIEWS: dict[tuple[bytes, int, int], tuple[TensorView, np.dtype[Any]]] = {}
_MAX_DESCS = 1024


def decode_state(raw: bytes) -> dict[str, Any]:
    """The resume state a binary ``batch`` carried as JSON bytes (``state_raw``)."""
    state = _loads(raw, f"state in a binary batch reply {raw[:200]!r}")
    if not isinstance(state, dict):
        raise ProtocolError(f"the state in a binary batch reply is not an object: {raw!r}")
    return state


def _desc(raw: bytes, k: int) -> tuple[str, str, tuple[int, ...]]:
    """Tensor `k`'s (name, dtype, shape) from its desc bytes."""
    try:
        (name_len,) = struct.unpack_from("<H", raw, 0)
        name = raw[2 : 2 + name_len].decode()
        at = 2 + name_len
        dtype_len = raw[at]
        dtype = raw[at + 1 : at + 1 + dtype_len].decode("ascii")
        at += 1 + dtype_len
        ndim = raw[at]
        shape = struct.unpack_from(f"<{ndim}Q", raw, at + 1)
        used = at + 1 + 8 * ndim
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ProtocolError(f"binary batch tensor {k}: malformed desc {raw!r}: {e}") from e
    if used != len(raw):
        raise ProtocolError(f"binary batch tensor {k}: desc of {len(raw)} bytes does not match its fields {raw!r}")
    if len(_DESCS) >= _MAX_DESCS:
        _DESCS.clear()
    d = _DESCS[raw] = (name, dtype, shape)
    return d


def decode(body: bytes) -> dict[str, Any]:
    """A binary ``batch`` body as the reply dict the stream reads: ``op``, ``lease``,
    ``epoch``, ``index``, ``shard``, ``views`` (TensorViews), ``dtypes`` (their numpy dtypes,
    known and checked against each view's length), ``state_raw`` (the state's JSON bytes,
    or None) and ``more`` (truthy when another batch answering the same ``next`` follows).
    ProtocolError names what is malformed."""
    n = len(body)
    if n < _HEADER.size:
        raise ProtocolError(f"binary batch body of {n} bytes, shorter than its {_HEADER.size}-byte header")
    tag, flags, count, state_len, lease, index, epoch, shard = _HEADER.unpack_from(body, 0)
    if tag != TAG:
        raise ProtocolError(f"binary batch body starts with byte {tag:#04x}, expected {TAG:#04x}")
    if flags & ~FLAG_MORE:
        raise ProtocolError(f"binary batch flags {flags:#04x} set bits this SDK does not know (known: {FLAG_MORE:#04x} more)")
    at = _HEADER.size
    views, dtypes = [], []
    for k in range(count):
        if at + _TENSOR.size > n:
            raise ProtocolError(f"binary batch body of {n} bytes ends inside tensor {k} (at byte {at})")
        offset, length, desc_len = _TENSOR.unpack_from(body, at)
        at += _TENSOR.size
        raw = body[at : at + desc_len]
        if len(raw) != desc_len:
            raise ProtocolError(f"binary batch body of {n} bytes ends inside tensor {k}'s desc (at byte {at})")
        at += desc_len
        key = (raw, offset, length)
        vd = _VIEWS.get(key)
        if vd is None:
            name, dtype, shape = _DESCS.get(raw) or _desc(raw, k)
            v = TensorView(name, dtype, shape, offset, length)
            if len(_VIEWS) >= _MAX_DESCS:
                _VIEWS.clear()
            vd = _VIEWS[key] = (v, _sized_dtype(v))
        views.append(vd[0])
        dtypes.append(vd[1])
    if at + state_len != n:
        raise ProtocolError(f"binary batch body of {n} bytes: tensors end at byte {at}, its state of {state_len} bytes does not end the body")
    return {
        "op": "batch",
        "lease": lease,
        "epoch": epoch,
        "index": index,
        "shard": shard,
        "views": views,
        "dtypes": dtypes,
        "state_raw": body[at:] if state_len else None,
        "more": flags & FLAG_MORE,
    }
