"""``Tensor``: the numpy array type of batch tensors, with DLPack for every consumer.

A batch tensor is a read-only view of the stream's region, which the SDK maps ``PROT_READ``.
numpy exports read-only arrays only through DLPack >= 1.0, whose capsule carries a read-only
flag (consumers that ask with ``max_version=(1, 0)``: numpy >= 2.1, PyTorch >= 2.4). Consumers
that still speak the pre-1.0 protocol (JAX as of 0.10) call ``__dlpack__()`` without
``max_version``; for them numpy raises ``BufferError: Cannot export readonly array``.

:class:`Tensor` is a plain ``numpy.ndarray`` subclass that answers such a legacy request with
a capsule of the *same memory* (no copy, with the view's strides: a slice or a transpose
too), built from a writable alias of the view. The pre-1.0 protocol cannot say "read-only",
so the consumer is trusted not to write: JAX never writes to arrays it imports. A consumer
that did write would fault (``SIGSEGV``) on the read-only mapping, never silently change the
data. Everything else is numpy's behaviour. (JAX 0.10 itself imports only compact strides, a
transpose but not a slice with gaps or a reversed view: copy those first,
``np.ascontiguousarray(t)``.)
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class _Alias(np.ndarray):
    """A writable alias of a read-only tensor's memory; ``_owner`` keeps the mapping alive for
    as long as a DLPack capsule holds the alias."""

    _owner: Any = None


class RegionBytes(np.ndarray):
    """The stream's region as one byte array, the buffer every :class:`Tensor` views. Not a
    plain ``ndarray``: numpy collapses a view's base to the first array of the view's own type
    that owns its data or views a non-array, so a plain-ndarray view of a tensor
    (``np.asarray(t)``, what ``__dlpack__`` exports) would skip past a tensor whose base were a
    plain ndarray, and with it the lease the tensor holds. A base of another type stops the
    collapse at the tensor, which the view then keeps alive."""


class Tensor(np.ndarray):
    """A read-only, zero-copy view of a tensor in the stream's region (a ``numpy.ndarray``).

    It holds the lease of its batch (``_hold``): while it, or any view or DLPack import of it,
    is alive, a kept batch is not released even if the batch itself was dropped."""

    #: What holds its batch's lease (``shardwire._client._Hold``); None for arrays numpy
    #: derives from it (slices, results), which keep it alive through their base instead.
    _hold: Any = None

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> Any:
        legacy = max_version is None or tuple(max_version) < (1, 0)
        if legacy and not self.flags.writeable and copy is not True:
            return _legacy_alias(self).__dlpack__(stream=stream)
        kwargs: dict[str, Any] = {"stream": stream}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if dl_device is not None:
            kwargs["dl_device"] = dl_device
        if copy is not None:
            kwargs["copy"] = copy
        return np.asarray(self).__dlpack__(**kwargs)


def _legacy_alias(t: np.ndarray) -> _Alias:
    """A writable ndarray over `t`'s bytes with `t`'s strides (no copy; DLPack carries strides,
    so a slice, a transpose or a reversed view is exported as it lies) that keeps `t` alive."""
    addr = t.__array_interface__["data"][0]
    low, high = _span(t, addr)
    raw = (ctypes.c_char * max(high - low, 1)).from_address(low)
    alias = np.ndarray(t.shape, t.dtype, buffer=raw, offset=addr - low, strides=t.strides).view(_Alias)
    alias._owner = t
    return alias


def _span(t: np.ndarray, addr: int) -> tuple[int, int]:
    """The lowest address of `t`'s elements (`addr`: its first element's) and one past its
    highest byte; negative strides reach below `addr`."""
    if t.size == 0:
        return addr, addr
    low = high = addr
    for n, stride in zip(t.shape, t.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + t.itemsize
