"""The SDK with the frameworks trainers use: PyTorch (DataLoader workers x DDP ranks through
`shardwire.torch.IterableDataset`, `torch.from_dlpack`) and JAX (`jax.dlpack.from_dlpack`),
against a real `shardwire source` + `serve` and a dataset written with numpy and pyarrow.

torch and jax come from tests/e2e/requirements-frameworks.txt (scripts/test installs them);
where that install failed, these tests are skipped and say why.
"""

from __future__ import annotations

import collections
import importlib.util
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from conftest import child_env
from sdk_harness import (
    SHARDS,
    World,
    sdk_on_path,
    world,  # noqa: F401 - a fixture
)


def _need(module: str) -> Any:
    return pytest.importorskip(module, reason=f"{module} is not installed (tests/e2e/requirements-frameworks.txt; scripts/test installs it)")


def _which_shard(world: World, item: dict[str, np.ndarray]) -> int:
    hits = [
        i for i, e in enumerate(world.expected)
        if sorted(e) == sorted(item) and all(np.array_equal(e[k], np.asarray(item[k])) for k in e)
    ]
    assert len(hits) == 1, f"item matches shards {hits}"
    return hits[0]


def test_torch_dataloader_workers_times_ranks_cover_every_shard(world: World):
    """2 DDP ranks x a DataLoader with 2 worker processes each: every shard arrives, byte-exact,
    as torch tensors; 10 shards over 4 effective ranks with `pad` gives 3 items each."""
    torch = _need("torch")
    from torch.utils.data import DataLoader

    from shardwire.torch import IterableDataset

    for epoch in (0, 1):
        seen: list[int] = []
        per_rank = []
        for rank in (0, 1):
            ds = IterableDataset("mix", socket=world.serve.socket, seed=5, rank=rank, world_size=2, timeout=60)
            ds.set_epoch(epoch)
            loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
            got = []
            for item in loader:
                assert all(isinstance(v, torch.Tensor) for v in item.values()), {k: type(v) for k, v in item.items()}
                got.append(_which_shard(world, {k: v.numpy() for k, v in item.items()}))
            per_rank.append(got)
            seen += got
        assert [len(g) for g in per_rank] == [6, 6], per_rank
        assert set(seen) == set(range(SHARDS)), seen
        assert max(collections.Counter(seen).values()) <= 2, f"padding repeats at most once: {seen}"


def test_torch_from_dlpack_is_zero_copy(world: World):
    torch = _need("torch")
    with world.sock().open_stream("mix", seed=2) as s:
        n = 0
        for b in s:
            for name, t in b.items():
                x = torch.from_dlpack(t)
                assert x.data_ptr() == t.__array_interface__["data"][0], f"shard {b.shard} {name}: copied"
                assert tuple(x.shape) == t.shape
                assert torch.equal(x, torch.from_numpy(np.array(t))), f"shard {b.shard} {name}"
                n += 1
        assert n >= SHARDS


# Run in a child: XLA starts threads, and a later test's fork() in this process (DataLoader
# workers) could then deadlock on a lock one of them held.
JAX_FROM_DLPACK = """
import sys
import jax
import jax.numpy as jnp
import numpy as np
import shardwire

# Without x64 JAX narrows int64/float64 to 32 bits on import (a converting copy); the
# dataset has both, so turn it on as a JAX user with such data would.
jax.config.update("jax_enable_x64", True)
copies = zero_copy = 0
with shardwire.connect(sys.argv[1]).open_stream("mix", seed=3) as s:
    for b in s:
        for name, t in b.items():
            y = jax.dlpack.from_dlpack(t)
            assert y.shape == t.shape and y.dtype == jnp.dtype(t.dtype), f"shard {b.shard} {name}"
            assert np.array_equal(np.asarray(y), t), f"shard {b.shard} {name}"
            addr = t.__array_interface__["data"][0]
            same = y.unsafe_buffer_pointer() == addr
            # XLA on CPU imports in place only 64-byte aligned buffers (and copies others);
            # pyarrow aligns IPC buffers to 8 bytes, numpy's .npy data to 64.
            assert same == (addr % 64 == 0), f"shard {b.shard} {name}: address {addr:#x}, zero-copy {same}"
            zero_copy += same
            copies += not same
print(f"jax: {zero_copy} tensors imported zero-copy, {copies} copied by XLA (not 64-byte aligned)")
"""


def test_jax_from_dlpack(world: World):
    if importlib.util.find_spec("jax") is None:  # not imported here (see above)
        pytest.skip("jax is not installed (tests/e2e/requirements-frameworks.txt; scripts/test installs it)")
    out = subprocess.run(
        [sys.executable, "-c", JAX_FROM_DLPACK, world.serve.socket],
        env=child_env(sdk_on_path()), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    m = re.search(r"jax: (\d+) tensors imported zero-copy, (\d+) copied", out.stdout)
    assert m, out.stdout
    print(m.group(0))
    assert int(m.group(1)) >= 8, "the .npy tensors are 64-byte aligned and must be imported zero-copy"
