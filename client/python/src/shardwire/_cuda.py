"""CUDA regions (``memory = "cuda"``): the stream's region imported into this process, and its
tensors as zero-copy CUDA arrays (DLPack and ``__cuda_array_interface__``).

A node run with ``memory = "cuda"`` receives shards straight into GPU memory: one CUDA VMM
allocation (``cuMemCreate``) per stream, whose ``attached`` reply carries a POSIX file
descriptor exported with ``cuMemExportToShareableHandle`` and the device
(``gpu: {ordinal, pci_bus_id, granularity}``; docs/TRAINER_API.md). :class:`CudaRegion`
imports that descriptor with cuda-python's driver bindings (``cuda.bindings.driver``):

1. ``cuInit``; the device by PCI bus id (``cuDeviceGetByPCIBusId``: ordinals differ between
   processes with different ``CUDA_VISIBLE_DEVICES``, bus ids do not);
2. the device's primary context (the one PyTorch, CuPy and JAX use) is retained and made
   current only around the driver calls (the caller's current context is left as it was);
3. ``cuMemImportFromShareableHandle`` -> ``cuMemAddressReserve`` (aligned to the
   granularity) -> ``cuMemMap`` -> ``cuMemSetAccess`` -> ``cuMemRelease`` (the mapping keeps
   the allocation alive, so the descriptor may be closed as soon as the import returns).

Access is requested read-only (``CU_MEM_ACCESS_FLAGS_PROT_READ``); where the driver refuses
read-only access to device memory the mapping falls back to read-write
(:attr:`CudaRegion.access` says which). Either way **the contract is read-only**: the service
owns the bytes, and a trainer that writes to a tensor corrupts later batches (or, on a
read-only mapping, faults its CUDA context).

:class:`CudaTensor` is a view ``(device pointer, shape, dtype)`` into the region that keeps the
region mapped while it (or any DLPack consumer of it) is alive. The region is unmapped when the
last reference goes (or on :meth:`CudaRegion.close`), after a ``cuCtxSynchronize`` so that no
queued kernel still reads it.

**Streams.** The service synchronises its copies before it announces a batch, so a batch's
bytes are complete when the trainer sees them: consumers need not wait on any stream, and
``__dlpack__(stream=...)`` ignores its argument (``__cuda_array_interface__`` says
``stream: None``).

Nothing here imports ``cuda.bindings`` (or torch) until a region is imported (or
:meth:`CudaTensor.to_torch` is called); without them :class:`CudaImportError` says what to
install. CUDA cannot be used in a process forked after its parent started CUDA (a DataLoader
worker started with fork): where the parent started it through torch or through this module
(`_devices.forked_after_cuda`), a driver call that fails there says so, and to start the
workers with spawn. A parent that started CUDA otherwise (CuPy, JAX, numba) leaves no trace
this process can see, and the CUDA driver documents no ``cuInit`` result that marks a
forked process, so the error then names the failed call and its result with the usual hint.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import numpy as np

from . import _device as _devices
from ._errors import CudaImportError

__all__ = ["CudaRegion", "CudaTensor"]

#: DLPack device types (``DLDeviceType``).
KDL_CPU = 1
KDL_CUDA = 2

_INSTALL = (
    "install the NVIDIA driver (libcuda.so.1) and cuda-python's driver bindings "
    '(`pip install cuda-python`), or run the node with memory = "host" '
    "(tensors are then host numpy arrays)"
)

_ON_GPU = (
    'lives in GPU memory (the stream\'s region is memory = "cuda"), which numpy and Arrow '
    "cannot read: use torch.from_dlpack(t) (or t.to_torch()), cupy.from_dlpack(t) or "
    "jax.dlpack.from_dlpack(t), and copy to the host from there if you need numpy"
)

#: The hint of a failed driver call in a process forked after its parent started CUDA.
_FORKED = (
    "this process was forked (a DataLoader worker started with fork, the Linux default before "
    "Python 3.14, say) "
    "after its parent had started CUDA, and CUDA cannot be used in such a process: start the "
    'workers with spawn (DataLoader(..., multiprocessing_context="spawn")) or forkserver'
)


# --- the CUDA driver ---------------------------------------------------------------------------


def _driver() -> Any:
    """``cuda.bindings.driver``, or CudaImportError saying what to install."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaImportError(
            f"the stream's region is CUDA memory, but cuda-python's driver bindings are not installed ({e}); {_INSTALL}"
        ) from e
    return driver


def _check(call: str, result: Any, hint: str = "") -> Any:
    """The outputs of a ``cuda.bindings.driver`` call (which returns ``(CUresult, *outputs)``),
    or CudaImportError naming the call and the CUresult. Every driver call goes through here,
    except the clean-up calls after an error (their results cannot help). In a process forked
    after its parent started CUDA, the hint is that cause and its fix, whatever `hint` was."""
    err, *out = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", None) or f"CUresult {int(err)}"
        if _devices.forked_after_cuda():
            hint = _FORKED
        raise CudaImportError(f"{call} failed: {name}{_describe(err)}{'; ' + hint if hint else ''}", call=call, result=name)
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


def _describe(err: Any) -> str:
    """`` (the driver's description)`` of a CUresult, or nothing if the driver cannot say."""
    try:
        from cuda.bindings import driver

        e, s = driver.cuGetErrorString(err)
        return f" ({s.decode()})" if int(e) == 0 and s else ""
    except Exception:
        return ""


def _visible_devices_hint() -> str:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is not set" if env is None else f"CUDA_VISIBLE_DEVICES={env!r} may hide it"


def _init(drv: Any) -> None:
    """``cuInit(0)``; CudaImportError if libcuda cannot be loaded or sees no device (in a
    process forked after its parent started CUDA, where cuInit fails, `_check` names that)."""
    try:
        result = drv.cuInit(0)
    except Exception as e:  # cuda-bindings raises (not returns) when it cannot load libcuda
        raise CudaImportError(
            f"the stream's region is CUDA memory, but the NVIDIA driver (libcuda.so.1) could not be loaded ({str(e).rstrip('.')}); {_INSTALL}",
            call="cuInit",
        ) from e
    if int(result[0]) == int(drv.CUresult.CUDA_ERROR_NO_DEVICE):
        _check("cuInit", result, f"this process sees no CUDA device ({_visible_devices_hint()})")
    _check("cuInit", result, _INSTALL)
    _devices.note_cuda_init()


def _bus_ids(drv: Any) -> list[str]:
    """PCI bus ids of the devices this process sees (best effort, for error messages)."""
    try:
        n = _check("cuDeviceGetCount", drv.cuDeviceGetCount())
        ids = []
        for i in range(n):
            dev = _check("cuDeviceGet", drv.cuDeviceGet(i))
            ids.append(_bus_str(_check("cuDeviceGetPCIBusId", drv.cuDeviceGetPCIBusId(32, dev))))
        return ids
    except Exception:
        return []


def _bus_str(v: Any) -> str:
    """A PCI bus id as the driver returns it (a NUL-padded buffer) as text."""
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).split(b"\0")[0].decode()
    return str(v).split("\0")[0]


def _device(drv: Any, pci_bus_id: str) -> Any:
    """The CUdevice with that PCI bus id, or CudaImportError naming it and what may hide it."""
    result = drv.cuDeviceGetByPCIBusId(pci_bus_id.encode())
    if int(result[0]) != 0:
        seen = ", ".join(_bus_ids(drv)) or "none"
        _check(
            "cuDeviceGetByPCIBusId",
            result,
            f"the region lies on the GPU with PCI bus id {pci_bus_id}, which this process does not see "
            f"(visible: {seen}; {_visible_devices_hint()}); run the trainer where that GPU is visible",
        )
    return _check("cuDeviceGetByPCIBusId", result)


@contextlib.contextmanager
def _current(drv: Any, ctx: Any) -> Iterator[None]:
    """`ctx` is current on this thread inside the block; the previous context is restored."""
    _check("cuCtxPushCurrent", drv.cuCtxPushCurrent(ctx))
    try:
        yield
    finally:
        drv.cuCtxPopCurrent()


def _set_access(drv: Any, ptr: int, size: int, device: int) -> str:
    """Grants `device` access to the mapping: read-only if the driver allows it, else
    read-write. Returns ``"read"`` or ``"readwrite"``."""
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    try:
        _check("cuMemSetAccess", drv.cuMemSetAccess(ptr, size, [desc], 1))
        return "read"
    except CudaImportError:
        pass  # read-only access to device memory is not supported by every driver
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _check("cuMemSetAccess", drv.cuMemSetAccess(ptr, size, [desc], 1))
    return "readwrite"


def _map(drv: Any, fd: int, size: int, granularity: int, device: int) -> tuple[int, str]:
    """Imports `fd` and maps it; returns ``(device pointer, access)``. On failure every step
    done so far is undone."""
    posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handle = _check("cuMemImportFromShareableHandle", drv.cuMemImportFromShareableHandle(fd, posix_fd))
    with contextlib.ExitStack() as undo:
        undo.callback(drv.cuMemRelease, handle)
        ptr = int(_check("cuMemAddressReserve", drv.cuMemAddressReserve(size, granularity, 0, 0)))
        undo.callback(drv.cuMemAddressFree, ptr, size)
        _check("cuMemMap", drv.cuMemMap(ptr, size, 0, handle, 0))
        undo.callback(drv.cuMemUnmap, ptr, size)
        access = _set_access(drv, ptr, size, device)
        # The mapping holds the allocation from here on; the handle is no longer needed.
        _check("cuMemRelease", drv.cuMemRelease(handle))
        undo.pop_all()
    return ptr, access


# --- the region ------------------------------------------------------------------------------


class CudaRegion:
    """A stream's CUDA region, imported and mapped into this process.

    Args:
        fd: The POSIX file descriptor of the ``attached`` reply. Not taken over: the caller
            closes it (it may do so as soon as the constructor returns).
        size: ``region_size`` (a multiple of `granularity`).
        pci_bus_id: ``gpu.pci_bus_id`` of the reply, e.g. ``"0000:19:00.0"``.
        granularity: ``gpu.granularity`` of the reply (a power of two).

    Raises:
        CudaImportError: no cuda-python, no driver, the device is not visible, or a driver
            call failed (the message names it).
        ValueError: `size` / `granularity` are not a valid pair.

    Attributes:
        ptr: Device pointer of the region's first byte (in this process).
        size: Region size in bytes.
        device: CUDA ordinal of the region's device in this process (as torch's ``cuda:N``).
        pci_bus_id: The device's PCI bus id.
        access: ``"read"`` or ``"readwrite"``: what the driver granted (the contract is
            read-only either way).

    The region stays mapped while any :class:`CudaTensor` of it is alive; :meth:`close` (or
    leaving ``with region:``) unmaps it at once, so call it only when no tensor of it is used
    any more.
    """

    def __init__(self, fd: int, size: int, pci_bus_id: str, granularity: int) -> None:
        self._closed = True  # until the import succeeds (__del__ may run after a failure)
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity {granularity} is not a power of two")
        if size <= 0 or size % granularity:
            raise ValueError(f"region_size {size} is not a positive multiple of the granularity {granularity}")
        self.size = size
        self.pci_bus_id = pci_bus_id
        self.granularity = granularity
        self._lock = threading.Lock()
        drv = self._drv = _driver()
        _init(drv)
        self._dev = _device(drv, pci_bus_id)
        self.device = int(self._dev)
        self._ctx = _check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))
        try:
            with _current(drv, self._ctx):
                self.ptr, self.access = _map(drv, fd, size, granularity, self.device)
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(self._dev)
            raise
        self._closed = False

    def tensor(self, offset: int, length: int, dtype: Any, shape: tuple[int, ...]) -> CudaTensor:
        """A :class:`CudaTensor` of bytes ``offset .. offset + length`` (no copy)."""
        dt = np.dtype(dtype)
        if math.prod(shape) * dt.itemsize != length:
            raise ValueError(f"shape {shape} of {dt} is {math.prod(shape) * dt.itemsize} bytes, not {length}")
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"bytes {offset}..{offset + length} lie outside the region of {self.size} bytes")
        if self._closed:
            raise ValueError("the CUDA region is closed")
        return CudaTensor(self.ptr + offset, shape, dt, self.device, owner=self)

    def synchronize(self) -> None:
        """Waits until the GPU work queued in the device's primary context is done (so that
        nothing reads a batch's bytes any more once it is released). A no-op once closed."""
        if self._closed:
            return
        with _current(self._drv, self._ctx):
            _check("cuCtxSynchronize", self._drv.cuCtxSynchronize())

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def close(self) -> None:
        """Waits for queued GPU work, unmaps the region, frees its address range and releases
        the primary context. Idempotent. Tensors of the region must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        drv = self._drv
        errors: list[CudaImportError] = []
        try:
            with _current(drv, self._ctx):
                for call, args in (("cuCtxSynchronize", ()), ("cuMemUnmap", (self.ptr, self.size)), ("cuMemAddressFree", (self.ptr, self.size))):
                    try:
                        _check(call, getattr(drv, call)(*args))
                    except CudaImportError as e:
                        errors.append(e)  # still unmap and free what can be
        finally:
            drv.cuDevicePrimaryCtxRelease(self._dev)
        if errors:
            raise errors[0]

    def __len__(self) -> int:
        return self.size

    def __enter__(self) -> CudaRegion:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # e.g. the driver is already shut down at interpreter exit

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ptr=0x{self.ptr:x} access={self.access}"
        return f"<shardwire.CudaRegion {self.size} bytes on cuda:{getattr(self, 'device', '?')} ({self.pci_bus_id}) {state}>"


# --- tensors ---------------------------------------------------------------------------------


class CudaTensor:
    """A read-only, zero-copy tensor in GPU memory: ``(ptr, shape, dtype)`` on device
    ``cuda:device``, C-contiguous.

    Import it with any CUDA array library: ``torch.from_dlpack(t)`` (or :meth:`to_torch`),
    ``cupy.from_dlpack(t)`` / ``cupy.asarray(t)`` (``__cuda_array_interface__``),
    ``jax.dlpack.from_dlpack(t)``, ``numba.cuda.as_cuda_array(t)`` (not
    ``torch.as_tensor(t)``: torch refuses a read-only CUDA Array Interface). The result shares the
    region's memory; **do not write to it** (see the module docstring). numpy conversion
    raises TypeError: the bytes are not in host memory.

    The tensor keeps its owner (the :class:`CudaRegion`) alive, and the lease of its batch (a
    kept batch is not released while the tensor lives, even if the batch was dropped); every
    DLPack capsule keeps the tensor alive until its consumer calls the capsule's deleter (e.g.
    when the torch tensor is freed). The batch lifetime rules still apply: after the batch is
    released the service reuses the bytes.

    Attributes:
        ptr: Device pointer of the first element.
        shape: Shape.
        dtype: numpy dtype (little-endian).
        nbytes: Byte length.
        device: CUDA ordinal in this process.
    """

    __slots__ = ("ptr", "shape", "dtype", "nbytes", "device", "_owner", "_hold", "__weakref__")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: Any, device: int, owner: Any = None) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.device = int(device)
        self._owner = owner
        #: What holds its batch's lease (``shardwire._client._Hold``), set by the stream: a
        #: kept batch stays leased while this tensor (or a DLPack import of it) lives.
        self._hold: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3: read-only, C-contiguous (``strides`` None), no stream to
        wait on (``stream`` None: the bytes are complete when the batch is handed out)."""
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, True),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device)

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> Any:
        """A DLPack capsule of this tensor (no copy).

        ``max_version >= (1, 0)`` (PyTorch, CuPy, numpy >= 2.1) gets a ``dltensor_versioned``
        capsule (DLPack 1.0) with the read-only flag; older consumers (JAX) a legacy
        ``dltensor`` capsule, which cannot say read-only. `stream` is accepted and ignored: the
        data is complete before the batch is handed out, so there is nothing to wait for.

        Raises:
            BufferError: ``copy=True`` (copy after importing, e.g. ``torch.from_dlpack(t).clone()``),
                or a `dl_device` other than this tensor's.
        """
        if copy:
            raise BufferError("shardwire.CudaTensor exports in place only (copy=True): import it, then copy, e.g. torch.from_dlpack(t).clone()")
        if dl_device is not None and tuple(int(x) for x in dl_device) != self.__dlpack_device__():
            raise BufferError(f"shardwire.CudaTensor lives on {self.__dlpack_device__()} (kDLCUDA, ordinal); it cannot be exported to {tuple(dl_device)}")
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return _capsule(self.ptr, self.shape, self.dtype, (KDL_CUDA, self.device), self, versioned=versioned)

    def to_torch(self) -> Any:
        """``torch.from_dlpack(self)``: a ``torch.Tensor`` on ``cuda:device`` sharing this
        memory (torch is imported here, not before). Do not write to it."""
        import torch

        return torch.from_dlpack(self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        raise TypeError(f"shardwire.CudaTensor {self.dtype}{list(self.shape)} {_ON_GPU}")

    def __repr__(self) -> str:
        return f"<shardwire.CudaTensor {self.dtype}{list(self.shape)} cuda:{self.device} ptr=0x{self.ptr:x}>"


# --- DLPack capsules, built with ctypes --------------------------------------------------------
#
# The host tensors (_tensor.py) let numpy build their capsules; device memory has no numpy
# array to lend one, so the structs of dlpack.h are declared here.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


#: ``void (*deleter)(DLManagedTensor*)`` (the versioned struct's deleter has the same ABI).
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    """Legacy (pre-1.0) ``DLManagedTensor``, capsule name ``dltensor``."""

    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    """DLPack 1.0 ``DLManagedTensorVersioned``, capsule name ``dltensor_versioned``."""

    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_DLPACK_FLAG_BITMASK_READ_ONLY = 1
# numpy dtype kind -> DLDataTypeCode (kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool).
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
_NAME = ctypes.create_string_buffer(b"dltensor")
_NAME_VERSIONED = ctypes.create_string_buffer(b"dltensor_versioned")

#: Exports not yet given back: address of the managed struct -> (struct, shape, strides, owner).
#: The consumer's deleter call (or the destructor of a capsule nobody consumed) removes the
#: entry, which releases the owner.
_LIVE: dict[int, tuple[Any, ...]] = {}


def _delete(addr: int | None, _pop: Any = _LIVE.pop) -> None:
    # `_pop` is bound now: a consumer may call this deleter at interpreter exit, after this
    # module's globals were cleared.
    if addr is not None:
        _pop(addr, None)


# ctypes callbacks take the GIL themselves, so consumers may call the deleter from any thread.
_deleter = _Deleter(_delete)

_api = ctypes.PyDLL("python", handle=ctypes.pythonapi._handle)  # own prototypes, not pythonapi's
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = _api.PyCapsule_New
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _Destructor]
_capsule_new.restype = ctypes.py_object
_capsule_is_valid = _api.PyCapsule_IsValid
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_capsule_is_valid.restype = ctypes.c_int
_capsule_pointer = _api.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_capsule_pointer.restype = ctypes.c_void_p


def _destroy(capsule: int | None, _names: Any = (_NAME, _NAME_VERSIONED), _valid: Any = _capsule_is_valid,
             _pointer: Any = _capsule_pointer, _address: Any = ctypes.addressof, _del: Any = _delete) -> None:
    """Capsule destructor: a capsule still named ``dltensor[_versioned]`` was never consumed,
    so its deleter is ours to run. (The capsule is being freed: it is passed as a raw pointer,
    never as a Python object. What it calls is bound now, as in `_delete`.)"""
    for name in _names:
        if _valid(capsule, _address(name)):
            _del(_pointer(capsule, _address(name)))


_destructor = _Destructor(_destroy)

# A consumer (torch, JAX) may free an imported tensor at interpreter exit, after CPython has
# cleared this module: its deleter then calls through `_deleter` into `_delete`, which pops
# `_LIVE`, and an unconsumed capsule's destructor reads the names. Freed by then, those would
# be freed memory called into (SIGSEGV at exit). They live as long as the process instead.
for _o in (_LIVE, _deleter, _destructor, _NAME, _NAME_VERSIONED):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_o))
del _o


def _capsule(ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any], device: tuple[int, int], owner: Any, *,
             versioned: bool, read_only: bool = True) -> Any:
    """A DLPack capsule of the C-contiguous tensor at `ptr` on `device` that keeps `owner`
    alive until the consumer calls its deleter (or the unconsumed capsule is freed)."""
    code = _DL_CODES.get(dtype.kind)
    if code is None or dtype.byteorder == ">":
        raise BufferError(f"dtype {dtype} has no DLPack equivalent")
    ndim = len(shape)
    shp = (ctypes.c_int64 * ndim)(*shape)
    strides = (ctypes.c_int64 * ndim)(*_c_strides(shape))
    m: _DLManagedTensor | _DLManagedTensorVersioned
    if versioned:
        m = _DLManagedTensorVersioned()
        m.version = _DLPackVersion(1, 0)
        m.flags = _DLPACK_FLAG_BITMASK_READ_ONLY if read_only else 0
    else:
        m = _DLManagedTensor()
    t = m.dl_tensor  # a view into m
    t.data = ptr
    t.device = _DLDevice(*device)
    t.ndim = ndim
    t.dtype = _DLDataType(code, dtype.itemsize * 8, 1)
    t.shape = ctypes.cast(shp, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    m.deleter = _deleter
    addr = ctypes.addressof(m)
    _LIVE[addr] = (m, shp, strides, owner)
    try:
        return _capsule_new(addr, ctypes.addressof(_NAME_VERSIONED if versioned else _NAME), _destructor)
    except BaseException:
        _LIVE.pop(addr, None)
        raise


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides in elements."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return strides[::-1]
