"""Naming the trainer's GPU for the node's lanes (docs/TRAINER_API.md, "Lanes: which GPU").

A node serves every GPU of its host, one *lane* per GPU; a stream's region lies on the GPU its
trainer names in ``attach`` (field ``device``), and its shards travel through that GPU's NIC. A
GPU is named by its PCI bus id (lower-case ``dddd:bb:dd.f``) or its UUID, never by a CUDA
ordinal: ordinals are per process (``CUDA_VISIBLE_DEVICES``), the node has its own.

- :func:`resolve` turns what a trainer passes as ``device=`` into that name: ``"cuda:3"`` or
  ``3`` (an ordinal of *this* process) or a ``torch.device`` is looked up through torch (when
  it is imported and sees CUDA) or cuda-python's driver bindings; a PCI bus id in any spelling
  (``0000:1A:00.0``, ``1a:00.0``) is written as the node writes it; a UUID (``GPU-...``) is
  passed on.
- :func:`current` is the bus id of this process's current CUDA device, for ``device="auto"``
  (the default): torch's ``current_device()`` when torch is imported and sees CUDA, else the
  device of cuda-python's current context, else device 0 (what the CUDA runtime uses when
  nothing was set). None when neither can tell (no driver, a forked worker, ...): the node then
  places the stream on its least loaded lane. In a DataLoader worker started with spawn or
  forkserver, a fresh interpreter whose current device is 0 whatever its rank's, it is the
  device of the process that started it, which ``shardwire.torch`` passes on (:func:`inherit`).

Nothing here imports torch or cuda-python that the trainer has not imported (torch) or that is
not installed (cuda-python).
"""

from __future__ import annotations

import re
import sys
from typing import Any

__all__ = ["AUTO", "current", "inherit", "resolve"]

#: ``device="auto"``: the current CUDA device when the node serves CUDA memory.
AUTO = "auto"

_BDF = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_UUID = re.compile(r"^(?:GPU-)?[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$", re.IGNORECASE)
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def _bdf(domain: int, bus: int, dev: int, fn: int = 0) -> str:
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


def _pci(text: str) -> str | None:
    """A PCI bus id in any spelling, as sysfs writes it; None if `text` is not one."""
    m = _BDF.match(text.split("\0")[0].strip())
    if not m:
        return None
    domain, bus, dev, fn = m.groups()
    return _bdf(int(domain or "0", 16), int(bus, 16), int(dev, 16), int(fn))


def _torch_cuda() -> Any:
    """``torch.cuda`` when the trainer imported torch and it sees a CUDA device, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:
        return None


def _by_torch(cuda: Any, ordinal: int) -> str:
    count = int(cuda.device_count())
    if not 0 <= ordinal < count:
        # torch itself raises AssertionError("Invalid device id") here.
        raise ValueError(f"device cuda:{ordinal}: this process sees {count} CUDA device(s) (0..{count - 1}); check CUDA_VISIBLE_DEVICES")
    p = cuda.get_device_properties(ordinal)
    return _bdf(int(p.pci_domain_id), int(p.pci_bus_id), int(p.pci_device_id))


def _driver() -> Any:
    """cuda-python's driver bindings, initialised; None when missing or without a device."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    try:
        if int(driver.cuInit(0)[0]) != 0:
            return None
    except Exception:  # the bindings raise when libcuda.so.1 cannot be loaded
        return None
    return driver


def _by_driver(driver: Any, dev: Any) -> str | None:
    err, raw = driver.cuDeviceGetPCIBusId(32, dev)
    if int(err) != 0:
        return None
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).split(b"\0")[0].decode()
    return _pci(str(raw))


def _ordinal(ordinal: int) -> str:
    """The bus id of this process's CUDA device `ordinal`."""
    cuda = _torch_cuda()
    if cuda is not None:
        return _by_torch(cuda, ordinal)
    driver = _driver()
    if driver is None:
        raise ValueError(f"device cuda:{ordinal}: neither torch (imported, with CUDA) nor cuda-python can say which GPU that is; give its PCI bus id")
    err, dev = driver.cuDeviceGet(ordinal)
    bus = _by_driver(driver, dev) if int(err) == 0 else None
    if bus is None:
        raise ValueError(f"device cuda:{ordinal}: this process has no such CUDA device")
    return bus


def resolve(device: Any) -> str:
    """The name the node takes for `device` (see the module docstring).

    Raises:
        ValueError: `device` names no GPU, or an ordinal this process cannot look up.
    """
    if isinstance(device, bool):
        raise ValueError(f"device must be a GPU (\"cuda:N\", a PCI bus id, a UUID), not {device!r}")
    if isinstance(device, int):
        return _ordinal(device)
    if type(device).__name__ == "device" and getattr(device, "type", None) == "cuda":  # torch.device
        return _ordinal(device.index if device.index is not None else _current_ordinal())
    text = str(device)
    m = _CUDA.match(text)
    if m:
        return _ordinal(int(m.group(1)) if m.group(1) else _current_ordinal())
    bus = _pci(text)
    if bus is not None:
        return bus
    if _UUID.match(text):
        return text
    raise ValueError(f"device {device!r} names no GPU: give \"cuda:N\", a PCI bus id (0000:19:00.0) or a GPU UUID (GPU-...)")


def _current_ordinal() -> int:
    cuda = _torch_cuda()
    return int(cuda.current_device()) if cuda is not None else 0


#: The current device of the process that started this one, when it passed it on (`inherit`).
_inherited: str | None = None


def inherit(bus: str) -> None:
    """Makes `bus`, the current device of the process that started this one, this process's
    :func:`current` device: a DataLoader worker started with spawn or forkserver would name
    device 0 (a fresh CUDA runtime's) for every rank, where torchrun's rank ``r`` called
    ``torch.cuda.set_device(r)``."""
    global _inherited
    _inherited = bus


def current() -> str | None:
    """The bus id of this process's current CUDA device, or None (see the module docstring)."""
    if _inherited is not None:
        return _inherited
    try:
        cuda = _torch_cuda()
        if cuda is not None:
            return _by_torch(cuda, int(cuda.current_device()))
        driver = _driver()
        if driver is None:
            return None
        err, ctx = driver.cuCtxGetCurrent()
        if int(err) == 0 and int(ctx) != 0:
            err, dev = driver.cuCtxGetDevice()
        else:
            err, dev = driver.cuDeviceGet(0)
        return _by_driver(driver, dev) if int(err) == 0 else None
    except Exception:  # a forked DataLoader worker, a broken driver: the node picks a lane
        return None
