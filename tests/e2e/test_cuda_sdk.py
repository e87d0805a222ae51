"""The Python SDK's CUDA regions (``memory = "cuda"``, client/python/src/shardwire/_cuda.py).

No Rust binary and no GPU needed for most of it:

- :class:`shardwire.CudaTensor` over a made-up device pointer: its DLPack capsules (legacy and
  versioned) decoded field by field with ctypes, the deleter's ownership rules, the CUDA Array
  Interface, the numpy / Arrow refusals. Only numbers are recorded: no device memory is
  touched.
- The capsule builder checked against real consumers (torch, numpy) on a host buffer: the
  same structs, device kDLCPU, so a layout error would show here.
- Importing a region on a host without the NVIDIA driver: real cuda-bindings, real loader
  failure, the CudaImportError the trainer sees (directly, and through ``open_stream`` against
  a stand-in service that answers ``attach`` with ``memory: "cuda"``).
- With a CUDA GPU (skipped otherwise): a VMM allocation made here with cuda-bindings, exported
  as a POSIX fd, imported through CudaRegion, read by torch without a copy.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import pathlib
import socket
import struct
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402
from shardwire import CudaImportError, CudaRegion, CudaTensor  # noqa: E402
from shardwire import _cuda  # noqa: E402

FAKE_PTR = 0x7F3A_0020_0000  # a device address that is never dereferenced


def _driver_state() -> str:
    """``"no-bindings"``, ``"no-driver"`` (libcuda cannot be loaded), ``"no-device"`` or
    ``"gpu"``."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return "no-bindings"
    try:
        (err,) = driver.cuInit(0)
    except Exception:
        return "no-driver"
    if int(err) != 0:
        return "no-device"
    err, n = driver.cuDeviceGetCount()
    return "gpu" if int(err) == 0 and n > 0 else "no-device"


def _has_cuda_gpu() -> bool:
    if _driver_state() != "gpu":
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# --- ctypes views of a capsule (the test's own, to decode what the SDK built) -----------------

_api = ctypes.PyDLL("python", handle=ctypes.pythonapi._handle)
_get_pointer = _api.PyCapsule_GetPointer
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer.restype = ctypes.c_void_p
_set_name = _api.PyCapsule_SetName
_set_name.argtypes = [ctypes.py_object, ctypes.c_void_p]
_set_name.restype = ctypes.c_int
_get_name = _api.PyCapsule_GetName
_get_name.argtypes = [ctypes.py_object]
_get_name.restype = ctypes.c_char_p
_USED = ctypes.create_string_buffer(b"used_dltensor")  # outlives the capsules renamed to it


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


def _decode(capsule: Any) -> tuple[int, Any]:
    """(address, struct) of the managed tensor in a capsule, by its name. The struct is valid
    while the capsule is alive (or, once consumed, until its deleter is called)."""
    name = _get_name(capsule)
    cls = {b"dltensor": DLManagedTensor, b"dltensor_versioned": DLManagedTensorVersioned}[name]
    addr = _get_pointer(capsule, name)
    return addr, cls.from_address(addr)


def _consume(capsule: Any) -> tuple[int, Any]:
    """What a consumer does: take the pointer and rename the capsule ``used_...`` (so its
    destructor leaves the deleter to the consumer). Returns (address, struct)."""
    addr, m = _decode(capsule)
    assert _set_name(capsule, ctypes.addressof(_USED)) == 0
    return addr, m


# --- CudaTensor: DLPack ------------------------------------------------------------------------


@pytest.mark.parametrize("max_version", [None, (0, 8), (1, 0), (1, 3)])
def test_dlpack_capsule_fields(max_version):
    """data pointer, device (kDLCUDA, ordinal), dtype code/bits/lanes, shape, contiguous
    strides and byte_offset 0; DLPack 1.0 with the read-only flag when the consumer asks for
    >= 1.0, the legacy struct otherwise."""
    t = CudaTensor(FAKE_PTR + 4096, (3, 5, 2), np.dtype("<f4"), device=1)
    assert t.__dlpack_device__() == (2, 1)
    cap = t.__dlpack__(stream=None, max_version=max_version)
    versioned = max_version is not None and max_version >= (1, 0)
    assert _get_name(cap) == (b"dltensor_versioned" if versioned else b"dltensor")
    _, m = _decode(cap)
    if versioned:
        assert (m.major, m.minor) == (1, 0)
        assert m.flags == 1  # DLPACK_FLAG_BITMASK_READ_ONLY
    dl = m.dl_tensor
    assert dl.data == FAKE_PTR + 4096
    assert (dl.device_type, dl.device_id) == (2, 1)
    assert dl.ndim == 3
    assert (dl.code, dl.bits, dl.lanes) == (2, 32, 1)  # kDLFloat
    assert [dl.shape[i] for i in range(3)] == [3, 5, 2]
    assert [dl.strides[i] for i in range(3)] == [10, 2, 1]  # C-contiguous, in elements
    assert dl.byte_offset == 0
    assert m.deleter


@pytest.mark.parametrize(
    "dtype, code, bits",
    [("int8", 0, 8), ("<i2", 0, 16), ("<i4", 0, 32), ("<i8", 0, 64), ("u1", 1, 8), ("<u2", 1, 16),
     ("<u4", 1, 32), ("<u8", 1, 64), ("<f2", 2, 16), ("<f4", 2, 32), ("<f8", 2, 64)],
)
def test_dlpack_dtype_codes(dtype, code, bits):
    """Every dtype the service describes maps to its DLPack (code, bits, lanes)."""
    t = CudaTensor(FAKE_PTR, (7,), np.dtype(dtype), device=0)
    cap = t.__dlpack__(max_version=(1, 0))  # held: the struct lives as long as the capsule
    _, m = _decode(cap)
    assert (m.dl_tensor.code, m.dl_tensor.bits, m.dl_tensor.lanes) == (code, bits, 1)
    assert (m.dl_tensor.ndim, m.dl_tensor.shape[0], m.dl_tensor.strides[0]) == (1, 7, 1)


def test_dlpack_zero_dim_tensor():
    t = CudaTensor(FAKE_PTR, (), np.dtype("<i8"), device=0)
    cap = t.__dlpack__()
    _, m = _decode(cap)
    assert m.dl_tensor.ndim == 0 and m.dl_tensor.data == FAKE_PTR


class _Owner:
    """Stands in for the CudaRegion a tensor keeps alive."""


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_dlpack_deleter_runs_once_and_releases_the_owner(max_version):
    """A consumed capsule keeps the tensor (and so its owner) alive until the consumer calls
    the deleter, exactly once: the capsule's destructor does not call it again."""
    owner = _Owner()
    w_owner = weakref.ref(owner)
    t = CudaTensor(FAKE_PTR, (4,), np.dtype("<f4"), device=0, owner=owner)
    w_t = weakref.ref(t)
    cap = t.__dlpack__(max_version=max_version)
    addr, m = _consume(cap)
    assert addr in _cuda._LIVE
    del t, owner
    gc.collect()
    assert w_t() is not None and w_owner() is not None, "the capsule's consumer still holds the tensor"
    del cap  # a consumed capsule's destructor must leave the deleter to the consumer
    gc.collect()
    assert addr in _cuda._LIVE and w_owner() is not None
    DELETER(m.deleter)(addr)  # the consumer is done
    gc.collect()
    assert addr not in _cuda._LIVE
    assert w_t() is None and w_owner() is None


def test_unconsumed_capsule_releases_the_owner():
    """A capsule nobody imported runs the deleter from its destructor."""
    owner = _Owner()
    w_owner = weakref.ref(owner)
    t = CudaTensor(FAKE_PTR, (2, 2), np.dtype("<i4"), device=0, owner=owner)
    before = len(_cuda._LIVE)
    caps = [t.__dlpack__(), t.__dlpack__(max_version=(1, 0))]
    assert len(_cuda._LIVE) == before + 2
    del t, owner
    gc.collect()
    assert w_owner() is not None
    del caps
    gc.collect()
    assert len(_cuda._LIVE) == before and w_owner() is None


def test_dlpack_refusals():
    t = CudaTensor(FAKE_PTR, (4,), np.dtype("<f4"), device=3)
    with pytest.raises(BufferError, match="clone"):
        t.__dlpack__(max_version=(1, 0), copy=True)
    with pytest.raises(BufferError, match=r"\(2, 3\)"):
        t.__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    # the tensor's own device, copy=False and any stream are fine
    assert _get_name(t.__dlpack__(stream=7, max_version=(1, 0), dl_device=(2, 3), copy=False)) == b"dltensor_versioned"
    assert _get_name(t.__dlpack__(stream=-1)) == b"dltensor"
    with pytest.raises(BufferError, match="DLPack"):
        _cuda._capsule(FAKE_PTR, (4,), np.dtype(">f4"), (2, 0), None, versioned=True)


# --- CudaTensor: CUDA Array Interface, numpy, repr ---------------------------------------------


def test_cuda_array_interface():
    t = CudaTensor(FAKE_PTR + 256, (8, 3), np.dtype("<u2"), device=0)
    assert t.__cuda_array_interface__ == {
        "shape": (8, 3),
        "typestr": "<u2",
        "data": (FAKE_PTR + 256, True),
        "strides": None,
        "version": 3,
        "stream": None,
    }
    assert (t.ptr, t.shape, t.dtype, t.nbytes, t.device, t.ndim, t.size) == (FAKE_PTR + 256, (8, 3), np.dtype("<u2"), 48, 0, 2, 24)
    assert "cuda:0" in repr(t) and "uint16[8, 3]" in repr(t)


def test_numpy_conversion_is_refused_with_a_hint():
    t = CudaTensor(FAKE_PTR, (4,), np.dtype("<f4"), device=0)
    for convert in (np.asarray, np.array):
        with pytest.raises(TypeError, match=r"GPU memory.*torch\.from_dlpack"):
            convert(t)


# --- the capsule builder against real consumers (host memory, kDLCPU) ---------------------------


class _HostView:
    """A DLPack producer over a numpy array's memory, built with the SDK's capsule code."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return _cuda._capsule(self.a.ctypes.data, self.a.shape, self.a.dtype, (1, 0), self, versioned=versioned)


@pytest.mark.parametrize("versioned", [False, True])
def test_capsules_import_into_torch_without_a_copy(versioned):
    """torch reads the structs the SDK builds (both layouts): same values, same address, and
    freeing the torch tensor calls the deleter, which lets the producer go."""
    torch = pytest.importorskip("torch")
    a = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    producer = _HostView(a)
    w = weakref.ref(producer)
    cap = producer.__dlpack__(max_version=(1, 0) if versioned else None)
    del producer
    x = torch.from_dlpack(cap)
    del cap
    assert x.dtype == torch.int16 and tuple(x.shape) == (2, 3, 4) and x.stride() == (12, 4, 1)
    assert x.data_ptr() == a.ctypes.data
    assert np.array_equal(x.numpy(), a)
    gc.collect()
    assert w() is not None
    del x
    gc.collect()
    assert w() is None


@pytest.mark.skipif(tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 1), reason="numpy < 2.1 asks for legacy capsules only")
def test_versioned_capsule_is_read_only_for_numpy():
    """numpy honours the DLPack 1.0 read-only flag the SDK sets."""
    a = np.linspace(0, 1, 10, dtype=np.float64)
    got = np.from_dlpack(_HostView(a))
    assert np.array_equal(got, a) and got.ctypes.data == a.ctypes.data
    assert not got.flags.writeable


# --- importing on a host without the driver ---------------------------------------------------


def _memfd(size: int) -> int:
    fd = os.memfd_create("not-cuda", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # as the node's
    return fd


def test_import_without_the_driver_says_what_to_install():
    """Real cuda-bindings, real loader failure: CudaImportError names the driver, what to
    install, and memory = "host"; the caller's fd is left open (the caller closes it)."""
    state = _driver_state()
    if state in ("gpu", "no-device"):
        pytest.skip(f"the NVIDIA driver is installed here ({state}); this checks a host without it")
    fd = _memfd(2 << 20)
    try:
        with pytest.raises(CudaImportError) as ei:
            CudaRegion(fd, 2 << 20, pci_bus_id="0000:19:00.0", granularity=2 << 20)
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    e = ei.value
    assert isinstance(e, shardwire.ShardwireError) and e.code == "cuda"
    msg = str(e)
    assert "pip install cuda-python" in msg and 'memory = "host"' in msg, msg
    if state == "no-driver":
        assert e.call == "cuInit" and e.result is None
        assert "NVIDIA driver (libcuda.so.1) could not be loaded" in msg, msg
        assert "NVIDIA display driver" in msg, msg  # cuda-bindings' own reason, kept
    else:
        assert "cuda-python's driver bindings are not installed" in msg, msg


def test_import_without_cuda_python(monkeypatch):
    """No cuda-bindings at all (``import cuda.bindings`` fails): the same error, saying so."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(CudaImportError, match=r"cuda-python's driver bindings are not installed.*pip install cuda-python.*memory = \"host\""):
        CudaRegion(0, 2 << 20, pci_bus_id="0000:19:00.0", granularity=2 << 20)


def test_region_argument_checks():
    with pytest.raises(ValueError, match="power of two"):
        CudaRegion(0, 3 << 20, pci_bus_id="0000:19:00.0", granularity=3 << 20)
    with pytest.raises(ValueError, match="multiple"):
        CudaRegion(0, (2 << 20) + 4096, pci_bus_id="0000:19:00.0", granularity=2 << 20)


class _StandIn:
    """A one-connection stand-in for the node service: answers ``info`` (the memory of `reply`),
    then ``attach`` with `reply` and a memfd as the region fd, then records whether the trainer
    closed the connection."""

    def __init__(self, path: pathlib.Path, reply: dict[str, Any]) -> None:
        self.path = str(path)
        self.reply = reply
        self.request: dict[str, Any] | None = None
        self.closed_by_peer = threading.Event()
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _recv_exact(self, conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            while True:
                (n,) = struct.unpack("<I", self._recv_exact(conn, 4))
                self.request = json.loads(self._recv_exact(conn, n))
                if self.request.get("op") != "info":
                    break
                # The SDK asks what the node serves first (device="auto"): a node with one lane.
                info = json.dumps({"op": "info", "memory": self.reply.get("memory", "host"), "lanes": [{"lane": 0, "gpu": None, "uuid": None}]}).encode()
                conn.sendall(struct.pack("<I", len(info)) + info)
            body = json.dumps(self.reply).encode()
            fd = _memfd(2 << 20)
            try:
                socket.send_fds(conn, [struct.pack("<I", len(body)) + body], [fd])
            finally:
                os.close(fd)
            conn.settimeout(30)
            if conn.recv(1) == b"":
                self.closed_by_peer.set()

    def close(self) -> None:
        self.srv.close()


def _attached(**over: Any) -> dict[str, Any]:
    msg = {
        "op": "attached", "stream": 7, "region_size": 2 << 20, "batches_per_epoch": 3, "epochs": 1,
        "memory": "cuda", "gpu": {"ordinal": 0, "pci_bus_id": "0000:19:00.0", "granularity": 2 << 20},
        "state": {"epoch": 0, "index": 0, "seed": 0, "fingerprint": "0"},
    }
    msg.update(over)
    return msg


def test_open_stream_on_a_cuda_node_without_the_driver(tmp_path):
    """``open_stream`` against a node that answers memory = "cuda": the SDK imports instead of
    mapping, fails with CudaImportError (no driver here; on a GPU host the stand-in's memfd is
    no CUDA allocation, which fails too) and closes the connection, so the node drops the
    stream."""
    svc = _StandIn(tmp_path / "trainer.sock", _attached())
    try:
        with pytest.raises(CudaImportError) as ei:
            shardwire.connect(svc.path).open_stream("ds")
        assert svc.closed_by_peer.wait(30), "the trainer kept the connection of a failed attach"
    finally:
        svc.close()
    assert svc.request is not None and svc.request["op"] == "attach"
    if _driver_state() in ("no-driver", "no-bindings"):
        assert "pip install cuda-python" in str(ei.value) and 'memory = "host"' in str(ei.value)


@pytest.mark.parametrize("gpu", [None, {"ordinal": 0, "pci_bus_id": "0000:19:00.0"}, {"ordinal": 0, "pci_bus_id": "x", "granularity": 3}])
def test_open_stream_cuda_without_a_usable_gpu_field_is_a_protocol_error(tmp_path, gpu):
    reply = _attached(gpu=gpu)
    if gpu is None:
        del reply["gpu"]
    svc = _StandIn(tmp_path / "trainer.sock", reply)
    try:
        with pytest.raises(shardwire.ProtocolError, match="gpu"):
            shardwire.connect(svc.path).open_stream("ds")
        assert svc.closed_by_peer.wait(30)
    finally:
        svc.close()


# --- with a CUDA GPU ---------------------------------------------------------------------------


def _ok(result: Any) -> Any:
    err, *out = result
    assert int(err) == 0, f"{err!r}"
    return None if not out else out[0] if len(out) == 1 else tuple(out)


@pytest.fixture
def exported_region():
    """A VMM allocation of 2 granules on device 0, made here: filled with known bytes through
    the test's own read-write mapping, exported as a POSIX fd. Yields (fd, size, bus id,
    granularity, expected bytes)."""
    from cuda.bindings import driver as d

    _ok(d.cuInit(0))
    dev = _ok(d.cuDeviceGet(0))
    ctx = _ok(d.cuDevicePrimaryCtxRetain(dev))
    _ok(d.cuCtxPushCurrent(ctx))
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(dev)
    prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    gran = int(_ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    size = 2 * gran
    handle = _ok(d.cuMemCreate(size, prop, 0))
    ptr = int(_ok(d.cuMemAddressReserve(size, gran, 0, 0)))
    _ok(d.cuMemMap(ptr, size, 0, handle, 0))
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = int(dev)
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(d.cuMemSetAccess(ptr, size, [desc], 1))
    data = (np.arange(size // 4, dtype=np.int64) * 2654435761 % (1 << 31)).astype("<i4").view(np.uint8)
    _ok(d.cuMemcpyHtoD(ptr, data, size))
    _ok(d.cuCtxSynchronize())
    fd = int(_ok(d.cuMemExportToShareableHandle(handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
    bus = _cuda._bus_str(_ok(d.cuDeviceGetPCIBusId(32, dev)))
    try:
        yield fd, size, bus, gran, data
    finally:
        os.close(fd)
        _ok(d.cuMemUnmap(ptr, size))
        _ok(d.cuMemAddressFree(ptr, size))
        _ok(d.cuMemRelease(handle))
        d.cuCtxPopCurrent()
        d.cuDevicePrimaryCtxRelease(dev)


@pytest.mark.skipif("not _has_cuda_gpu()", reason="needs CUDA GPU")
def test_gpu_region_import_and_zero_copy_torch(exported_region):
    """CudaRegion imports the exported fd; a CudaTensor of it goes to torch by DLPack and by
    the CUDA Array Interface without a copy, with the bytes written before the export."""
    import torch

    fd, size, bus, gran, data = exported_region
    region = CudaRegion(fd, size, pci_bus_id=bus, granularity=gran)
    w_region = weakref.ref(region)
    assert region.size == size and region.device == 0 and region.access in ("read", "readwrite")
    assert region.ptr % gran == 0

    offset, shape = gran - 4096, (64, 32)  # straddles the two granules
    t = region.tensor(offset, 64 * 32 * 4, np.dtype("<i4"), shape)
    assert t.ptr == region.ptr + offset and t.__dlpack_device__() == (2, 0)
    expected = data[offset : offset + t.nbytes].view("<i4").reshape(shape)

    x = torch.from_dlpack(t)
    assert x.device == torch.device("cuda", 0) and x.dtype == torch.int32 and tuple(x.shape) == shape
    assert x.data_ptr() == t.ptr  # zero copy
    assert np.array_equal(x.cpu().numpy(), expected)
    assert t.to_torch().data_ptr() == t.ptr

    # __cuda_array_interface__ says read-only, as the contract is. torch refuses a read-only
    # interface ("the read only flag is not supported", torch 2.11 on an H200): torch users
    # import by DLPack (above); CuPy and Numba take the interface, zero copy.
    assert t.__cuda_array_interface__["data"] == (t.ptr, True)
    with pytest.raises(TypeError, match="read only"):
        torch.as_tensor(t, device="cuda")
    y = None
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        y = cupy.asarray(t)
        assert y.data.ptr == t.ptr and y.shape == shape
        assert np.array_equal(cupy.asnumpy(y), expected)
    assert int(x.sum(dtype=torch.int64)) == int(expected.astype(np.int64).sum())

    del region
    gc.collect()
    assert w_region() is not None, "tensors and torch's imports keep the region mapped"
    del t, x, y
    gc.collect()
    torch.cuda.synchronize()
    assert w_region() is None, "the last reference unmapped the region"


@pytest.mark.skipif("not _has_cuda_gpu()", reason="needs CUDA GPU")
def test_gpu_region_close_and_unknown_bus_id(exported_region):
    fd, size, bus, gran, _ = exported_region
    with CudaRegion(fd, size, pci_bus_id=bus, granularity=gran) as region:
        region.synchronize()
    assert region.closed
    region.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        region.tensor(0, 4, np.dtype("<f4"), (1,))
    with pytest.raises(CudaImportError) as ei:
        CudaRegion(fd, size, pci_bus_id="0000:ff:1f.7", granularity=gran)
    assert ei.value.call == "cuDeviceGetByPCIBusId"
    assert "0000:ff:1f.7" in str(ei.value) and "CUDA_VISIBLE_DEVICES" in str(ei.value) and bus in str(ei.value)


def test_a_consumer_tensor_alive_at_interpreter_exit_exits_cleanly():
    """A torch tensor imported from one of the SDK's capsules, still alive when the interpreter
    exits (a module global, as `x = batch["x"].to_torch()` at top level would be): torch frees
    it after CPython has cleared the SDK's modules, and its deleter must still find the
    SDK's callback and table alive (it crashed the exit with SIGSEGV before). In child
    processes (a crash fails the test, not the run); three times, as the crash depended on
    what the freed memory held."""
    pytest.importorskip("torch", reason="torch is installed by scripts/test (requirements-frameworks.txt)")
    import subprocess

    script = f"""
import sys
sys.path.insert(0, {str(REPO / "client" / "python" / "src")!r})
import numpy as np, torch
from shardwire import _cuda
src = np.arange(8, dtype=np.int64)
class W:
    def __init__(s, c): s.c = c
    def __dlpack__(s, **k): return s.c
    def __dlpack_device__(s): return (1, 0)
def main():
    global last
    for i in range(3):
        last = torch.from_dlpack(W(_cuda._capsule(src.ctypes.data, (8,), src.dtype, (1, 0), src, versioned=True)))
    print("read", int(last.sum()), flush=True)
main()
"""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "read 28" in r.stdout, f"rc {r.returncode} (-11: SIGSEGV)\n{r.stdout}\n{r.stderr[-2000:]}"
