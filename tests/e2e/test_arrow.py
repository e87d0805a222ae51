"""End-to-end tests of the Arrow export of batches (Arrow PyCapsule protocol,
client/python/src/shardwire/_arrow.py) with real pyarrow, against real ``shardwire source`` /
``serve`` processes on 127.0.0.1:

- ``pa.record_batch(batch)`` imports a socket batch: values equal the dataset files, 1-D tensors
  are primitive columns, N-D tensors ``arrow.fixed_shape_tensor`` columns of the right value
  type and shape, and every buffer lies inside the stream's mapped region (zero-copy);
- HTTP batches export the same way, over their downloaded arrays;
- tensors with different leading dimensions, 0-D tensors, pyarrow missing: clear errors;
- Arrow arrays keep the mapping alive after the stream closed (no crash).

Self-contained like test_sdk.py (the SDK from client/python/src; children killed at teardown).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sdk_harness import (  # noqa: E402 - the shared harness; puts the SDK on sys.path
    procs,  # noqa: F401 - a fixture
    world,  # noqa: F401 - a fixture
    SDK_SRC,
    WAIT,
    World,
    child_env,
)
import shardwire  # noqa: E402
from shardwire import _arrow  # noqa: E402

def region_range(stream: shardwire.Stream) -> tuple[int, int]:
    base = np.frombuffer(stream.region, np.uint8).__array_interface__["data"][0]
    return base, base + len(stream.region)


def buffers_of(arr: pa.Array) -> list[pa.Buffer]:
    """Every buffer of `arr` and its children (extension arrays through their storage)."""
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    out = [b for b in arr.buffers() if b is not None]
    return out


def assert_columns_match(rb: pa.RecordBatch, batch: Any, expected: dict[str, np.ndarray]) -> None:
    assert rb.schema.names == list(batch), (rb.schema.names, list(batch))
    for name, want in expected.items():
        col = rb.column(name)
        assert len(col) == want.shape[0] == rb.num_rows
        vt = pa.from_numpy_dtype(want.dtype)
        if want.ndim == 1:
            assert col.type == vt, (name, col.type)
            assert np.array_equal(col.to_numpy(zero_copy_only=True), want)
        else:
            assert col.type == pa.fixed_shape_tensor(vt, list(want.shape[1:])), (name, col.type)
            assert col.type.extension_name == "arrow.fixed_shape_tensor"
            assert col.type.shape == list(want.shape[1:]) and col.type.value_type == vt
            assert isinstance(col, pa.FixedShapeTensorArray)
            assert col.storage.type == pa.list_(vt, int(np.prod(want.shape[1:])))
            got = col.to_numpy_ndarray()
            assert got.shape == want.shape and np.array_equal(got, want), name
        assert not rb.schema.field(name).nullable


# --- socket batches --------------------------------------------------------------------------


def test_record_batch_is_zero_copy_over_the_region(world: World):
    seen_tensor_column = seen_multi = False
    with world.sock().open_stream("mix", seed=5) as s:
        lo, hi = region_range(s)
        for b in s:
            exp = world.expected[b.shard]
            rb = pa.record_batch(b)  # the Arrow PyCapsule protocol (__arrow_c_array__)
            assert isinstance(rb, pa.RecordBatch)
            assert_columns_match(rb, b, exp)
            md = {k.decode(): v.decode() for k, v in rb.schema.metadata.items()}
            assert md == {"shardwire.epoch": str(b.epoch), "shardwire.index": str(b.index), "shardwire.shard": str(b.shard)}
            for name in b:
                for buf in buffers_of(rb.column(name)):
                    assert lo <= buf.address and buf.address + buf.size <= hi, f"{name}: buffer at {buf.address:#x} is outside the region [{lo:#x}, {hi:#x})"
                # exactly the tensor's bytes in the region
                view = next(v for v in b.views if v.name == name)
                (data,) = buffers_of(rb.column(name))
                assert data.address == lo + view.offset and data.size == view.length
            assert pa.schema(b) == rb.schema  # __arrow_c_schema__
            assert b.to_arrow().equals(rb)
            seen_tensor_column |= any(a.ndim > 1 for a in exp.values())
            seen_multi |= len(exp) > 1
    assert seen_tensor_column and seen_multi


def test_requested_schema_and_table(world: World):
    with world.sock().open_stream("mix", seed=6) as s:
        rbs = []
        for b in s:
            if "emb" in b:
                schema = b.__arrow_c_schema__()
                rbs.append(pa.record_batch(b.keep()))
                sc, ac = b.__arrow_c_array__(requested_schema=schema)
                assert type(sc).__name__ == type(ac).__name__ == "PyCapsule"
        assert len(rbs) == 4
        t = pa.Table.from_batches(rbs)  # four Arrow IPC record batches, back as one table
        assert t.num_rows == 3 + 11 + 1 + 20
        assert t.schema.field("emb").type == pa.fixed_shape_tensor(pa.float32(), [4])


def test_arrow_arrays_outlive_the_stream_safely(world: World):
    s = world.sock().open_stream("mix", seed=5)
    b = s.next()
    assert b is not None
    rb = b.to_arrow()
    want = {n: np.array(a) for n, a in b.items()}
    s.close()  # the mapping stays while Arrow (through numpy) still references it
    del b
    for name, a in want.items():
        col = rb.column(name)
        got = col.to_numpy_ndarray() if isinstance(col, pa.FixedShapeTensorArray) else col.to_numpy()
        assert got.shape == a.shape  # readable, no crash (contents are only guaranteed while leased)


# --- HTTP batches ----------------------------------------------------------------------------


def test_http_batches_export_their_downloaded_arrays(world: World):
    with world.http().open_stream("mix", seed=5) as s:
        for b in s:
            rb = pa.record_batch(b)
            assert_columns_match(rb, b, world.expected[b.shard])
            for name, arr in b.items():
                (data,) = buffers_of(rb.column(name))
                assert data.address == arr.__array_interface__["data"][0], f"{name}: copied"


# --- errors ----------------------------------------------------------------------------------


def test_different_leading_dimensions_and_0d_tensors_are_refused():
    tensors = {"x": np.zeros((4, 3), np.float32), "y": np.arange(5, dtype=np.int64)}
    with pytest.raises(ValueError, match=r"different leading dimensions.*x\[4, 3\].*y\[5\].*arrow_columns"):
        _arrow.record_batch(tensors)
    cols = _arrow.columns(tensors)  # each tensor on its own still works
    assert cols["x"].type == pa.fixed_shape_tensor(pa.float32(), [3]) and len(cols["x"]) == 4
    assert cols["y"].type == pa.int64() and len(cols["y"]) == 5
    with pytest.raises(ValueError, match="0-dimensional"):
        _arrow.record_batch({"s": np.float32(1.0).reshape(())})
    with pytest.raises(ValueError, match="contiguous"):
        _arrow.column("t", np.zeros((4, 4))[:, ::2])
    rb = _arrow.record_batch({"a": np.zeros((2, 2, 2), np.float16), "b": np.ones(2, np.uint8)})
    assert rb.num_rows == 2 and rb.schema.field("a").type == pa.fixed_shape_tensor(pa.float16(), [2, 2])
    # Rows of no values (an .npy of shape (n, 0)): before, Arrow's own error naming nothing.
    with pytest.raises(ValueError, match=r"tensor 'e' of shape \(3, 0\): its rows hold 0 values"):
        _arrow.column("e", np.zeros((3, 0), np.float32))


def test_pyarrow_is_optional():
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "import shardwire, numpy as np\n"
        "from shardwire import _arrow\n"
        "try:\n"
        "    _arrow.record_batch({'x': np.zeros(3)})\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR', e)\n"
    )
    env = child_env()
    env["PYTHONPATH"] = str(SDK_SRC)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=WAIT)
    assert r.returncode == 0, r.stderr
    assert "IMPORT-ERROR" in r.stdout and "needs pyarrow" in r.stdout and "pip install pyarrow" in r.stdout, r.stdout
    code = "import sys, shardwire; assert 'pyarrow' not in sys.modules, 'pyarrow imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=WAIT)
    assert r.returncode == 0, r.stderr
