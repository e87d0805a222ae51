"""What the Python SDK's `next` costs a training loop per batch, without a node: the socket
is a stand-in that answers every receive with one group of eight binary `batch` replies (the
layout of docs/TRAINER_API.md "Binary batch frames", as a `next` with `count` 8 is answered)
and takes every send. Each call is timed with the loop's `torch.from_numpy(np.asarray(b["x"]))`,
"cold" right after the benchmark's model step (forward, backward, SGD over [256, 256]; it
pushes the SDK's code and objects out of the CPU's caches, as in training) and "warm" back to
back. With --baseline DIR (another checkout's client/python/src) that SDK runs too, in the
same process, interleaved with this one in blocks of 160 calls, so the host's noise falls on
both alike.

    .venv/bin/python scripts/bench_sdk_next.py [--rounds 30] [--baseline /tmp/old/client/python/src]

Prints, per SDK and mode, the mean and median microseconds per batch, and the mean per position
in the group of eight (the first call receives and decodes the group).
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import os
import pathlib
import struct
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "client" / "python" / "src"))

GROUP = 8
BATCH_BYTES = 256 * 256 * 4
REGION = 64 << 20
BLOCK = 160


def reply(lease: int, index: int, offset: int, more: bool) -> bytes:
    """One framed binary batch reply: tensor x float32 [256, 256] at `offset`, a state."""
    state = b'{"epoch":0,"index":%d,"seed":1,"fingerprint":"0123456789abcdef0123456789abcdef"}' % (index + 1)
    desc = struct.pack("<H", 1) + b"x" + bytes([7]) + b"float32" + bytes([2]) + struct.pack("<2Q", 256, 256)
    body = (struct.pack("<BBHIQQII", 1, 1 if more else 0, 1, len(state), lease, index, 0, 0xFFFF_FFFF)
            + struct.pack("<QQH", offset, BATCH_BYTES, len(desc)) + desc + state)
    return struct.pack("<I", len(body)) + body


class Node:
    """The socket's stand-in: each receive is the next group of eight replies."""

    def __init__(self) -> None:
        self.n = 0

    def recv(self, _size: int, *_flags: int) -> bytes:
        g = []
        for k in range(GROUP):
            i = self.n + k
            g.append(reply(i + 1, i, (i % 32) * BATCH_BYTES, k < GROUP - 1))
        self.n += GROUP
        return b"".join(g)

    def sendall(self, _data: bytes, *_flags: int) -> None:
        pass

    def send(self, data: bytes, *_flags: int) -> int:
        return len(data)

    def close(self) -> None:
        pass

    def shutdown(self, _how: int) -> None:
        pass


def load_sdk(name: str, src: pathlib.Path):
    """The SDK package under `src` imported as `name` (two copies can live in one process)."""
    pkg = src / "shardwire"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    assert spec is not None and spec.loader is not None, f"no SDK package at {pkg}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def stream_of(sdk, region: mmap.mmap):
    client = sys.modules[sdk.__name__ + "._client"]
    wire = sys.modules[sdk.__name__ + "._wire"]
    types = sys.modules[sdk.__name__ + "._types"]
    info = types.StreamInfo(stream=1, region_size=REGION, batches_per_epoch=1 << 40, epochs=1, memory="host", state={})
    return iter(client.Stream(wire.Conn(Node()), region, info))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30, help="blocks of 160 calls per SDK and mode")
    p.add_argument("--baseline", type=pathlib.Path, help="another SDK's client/python/src, run interleaved")
    a = p.parse_args()
    import numpy as np
    import torch

    import bench_loaders

    torch.set_num_threads(1)
    region = mmap.mmap(-1, REGION)
    sdks = {"this": load_sdk("shardwire", REPO / "client" / "python" / "src")}
    if a.baseline:
        sdks["baseline"] = load_sdk("shardwire_baseline", a.baseline)
    streams = {k: stream_of(m, region) for k, m in sdks.items()}
    step, x0 = bench_loaders.model_step(), torch.randn(256, 256)
    times: dict[tuple[str, str], list[int]] = {(k, mode): [] for k in sdks for mode in ("cold", "warm")}
    clock = time.perf_counter_ns
    for _ in range(a.rounds):
        for mode in ("cold", "warm"):
            for k, it in streams.items():
                for i in range(BLOCK):
                    if mode == "cold":
                        step(x0)
                    t = clock()
                    b = next(it)
                    torch.from_numpy(np.asarray(b["x"]))
                    dt = clock() - t
                    if i >= 2 * GROUP:  # each block's first groups: the other SDK ran just before
                        times[(k, mode)].append(dt)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {np.__version__}; {os.cpu_count()} CPUs")
    for (k, mode), v in times.items():
        us = np.array(v) / 1e3
        pos = us[: len(us) // GROUP * GROUP].reshape(-1, GROUP).mean(axis=0)
        print(f"{k:8s} {mode}: mean {us.mean():5.1f} us, median {np.median(us):5.1f} us per batch; "
              f"by position in the group: {' '.join(f'{x:.0f}' for x in pos)}")


if __name__ == "__main__":
    main()
