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
  nothing was set). None when neither can tell (no driver, ...): the node then places the
  stream on its least loaded lane. In a DataLoader worker started with spawn or forkserver, a
  fresh interpreter whose current device is 0 whatever its rank's, it is the device of the
  process that started it, which ``shardwire.torch`` passes on (:func:`inherit`).

**Fork.** A process forked after its parent started CUDA (a DataLoader worker started with
fork, the Linux default before Python 3.14, once the trainer ran ``model.cuda()``) cannot use
CUDA: torch raises "Cannot re-initialize CUDA in forked subprocess", ``cuInit`` fails. So
before every fork of a process that started CUDA through torch, :func:`_before_fork`
(``os.register_at_fork``) notes the bus id of each of its ordinals and its current one; a
forked child resolves ``"cuda:N"``, ``N``, ``"cuda"`` and ``"auto"`` from that note, as its
parent would have, and never touches CUDA. Where there is no note (CUDA started other than
through torch), an ordinal there raises ValueError asking for the GPU's PCI bus id.
:func:`forked_after_cuda` says whether this process is such a child (for ``_cuda``'s errors).

Nothing here imports torch or cuda-python that the trainer has not imported (torch) or that is
not installed (cuda-python).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

__all__ = ["AUTO", "current", "forked_after_cuda", "inherit", "note_cuda_init", "resolve"]

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


# --- fork: what a child forked after CUDA started knows of its parent's GPUs ------------------

#: Noted by `_before_fork` in a process whose torch had started CUDA, for the children it
#: forks: (that process's pid, its current ordinal then, the bus id of each of its ordinals).
#: A child inherits it; in the process that noted it (same pid) it is never read.
_at_fork: tuple[int, int, tuple[str, ...]] | None = None
#: The bus ids of this process's ordinals, looked up once (`_before_fork`): they do not change.
_bus_ids: tuple[str, ...] | None = None
#: The pid of the process where cuda-python's ``cuInit`` last succeeded (`note_cuda_init`);
#: a child forked after it inherits it.
_cuda_pid: int | None = None


def _torch_started_cuda() -> Any:
    """``torch.cuda`` when the trainer imported torch and it has started CUDA in this process
    (not in a forked child: there torch says it has not), else None. Starts nothing."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda if torch is not None and torch.cuda.is_initialized() else None
    except Exception:
        return None


def _before_fork() -> None:
    """``os.register_at_fork(before=...)``: where torch has started CUDA here, notes this
    process's GPUs for the child (`_at_fork`). Never raises: a fork must not fail for this."""
    global _at_fork, _bus_ids
    cuda = _torch_started_cuda()
    if cuda is None:
        return  # no CUDA here, or a forked child that keeps its parent's note for its own
    try:
        if _bus_ids is None:
            _bus_ids = tuple(_by_torch(cuda, i) for i in range(int(cuda.device_count())))
        _at_fork = (os.getpid(), int(cuda.current_device()), _bus_ids)
    except Exception:
        _at_fork = None  # the child then asks for the bus id (`_forked_ordinal`)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


def note_cuda_init() -> None:
    """Records that cuda-python's ``cuInit`` succeeded in this process (`forked_after_cuda`)."""
    global _cuda_pid
    _cuda_pid = os.getpid()


def forked_after_cuda() -> bool:
    """Whether this process was forked from one that had started CUDA (through torch or
    cuda-python): CUDA cannot be used here."""
    pid = os.getpid()
    if (_at_fork is not None and _at_fork[0] != pid) or (_cuda_pid is not None and _cuda_pid != pid):
        return True
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda._is_in_bad_fork())
    except Exception:
        return False


def _forked_note(device: str) -> tuple[int, tuple[str, ...]]:
    """(current ordinal, bus ids) of the parent of this forked child, or a ValueError for
    `device` when there is none."""
    note = _at_fork
    if note is None or note[0] == os.getpid():
        raise ValueError(
            f"device {device}: this process was forked after its parent started CUDA, so CUDA "
            "cannot say here which GPU that is; pass the GPU's PCI bus id (device=\"0000:19:00.0\", "
            "see nvidia-smi --query-gpu=pci.bus_id --format=csv) or its UUID, or start the "
            "DataLoader's workers with multiprocessing_context=\"spawn\""
        )
    return note[1], note[2]


def _forked_ordinal(ordinal: int) -> str:
    """In a child forked after CUDA started: the bus id its parent noted for `ordinal`."""
    ids = _forked_note(f"cuda:{ordinal}")[1]
    if not 0 <= ordinal < len(ids):
        raise ValueError(f"device cuda:{ordinal}: this process sees {len(ids)} CUDA device(s) (0..{len(ids) - 1}); check CUDA_VISIBLE_DEVICES")
    return ids[ordinal]


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
    note_cuda_init()
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
    if forked_after_cuda():
        return _forked_ordinal(ordinal)
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
    if forked_after_cuda():
        return _forked_note("'cuda' (the current device)")[0]
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
        if forked_after_cuda():
            current, ids = _forked_note("auto")
            return ids[current] if 0 <= current < len(ids) else None
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
    except Exception:  # a broken driver, a forked child without its parent's note: no device
        return None
