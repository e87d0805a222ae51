"""End-to-end test of `shardwire index DIR` on files written by real pyarrow and numpy.

Runs the CLI binary (env SHARDWIRE_BIN, default <repo>/target/debug/shardwire), then checks
that every tensor in the manifest points at exactly the bytes numpy/pyarrow hold for it, that
dtypes and shapes match, and that each shard's CRC-32C matches the file. Unsupported inputs
(nulls, LZ4 compression, Fortran order, object arrays) must fail with a useful message.

Self-contained: no conftest.py, only pytest's built-in `tmp_path` fixture.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pyarrow as pa
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("SHARDWIRE_BIN", REPO / "target" / "debug" / "shardwire"))
MANIFEST = "shardwire.manifest.json"


# --- helpers -------------------------------------------------------------------------------


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bitwise-table implementation (test files are small)."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def test_crc32c_helper_known_vector():
    assert crc32c(b"123456789") == 0xE3069283


def run_index(d: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    if not BIN.is_file():
        pytest.fail(f"shardwire binary not found at {BIN}; run `cargo build -p shardwire` or set SHARDWIRE_BIN")
    return subprocess.run([str(BIN), "index", *flags, str(d)], capture_output=True, text=True, timeout=300)


def index_ok(d: pathlib.Path) -> dict:
    r = run_index(d)
    assert r.returncode == 0, f"shardwire index failed ({r.returncode}): {r.stderr}"
    path = d / MANIFEST
    assert path.is_file(), "manifest not written"
    m = json.loads(path.read_text())
    check_integrity(d, m)
    return m


def index_fails(d: pathlib.Path, *needles: str) -> str:
    r = run_index(d)
    assert r.returncode != 0, f"expected failure, got success: {r.stdout}"
    for n in needles:
        assert n in r.stderr, f"stderr lacks {n!r}: {r.stderr}"
    assert not (d / MANIFEST).exists(), "no manifest may be written on failure"
    return r.stderr


def check_integrity(d: pathlib.Path, m: dict) -> None:
    """Shard CRCs, tensor ranges inside shards, lengths consistent with shape x dtype."""
    assert m["format"] == 1
    assert m["total_bytes"] == sum(s["length"] for s in m["shards"])
    for s in m["shards"]:
        assert not s["file"].startswith("/") and "\\" not in s["file"]
        with open(d / s["file"], "rb") as f:
            f.seek(s["offset"])
            payload = f.read(s["length"])
        assert len(payload) == s["length"]
        assert crc32c(payload) == s["crc32c"], f"crc mismatch in {s['file']}@{s['offset']}"
        for t in s["tensors"]:
            assert s["offset"] <= t["offset"]
            assert t["offset"] + t["length"] <= s["offset"] + s["length"]
            assert t["length"] == int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize


def tensor_parts(d: pathlib.Path, m: dict, file: str, name: str):
    """(dtype, shape, bytes) of every tensor `name` in shards of `file`, in shard order."""
    out = []
    for s in m["shards"]:
        if s["file"] != file:
            continue
        for t in s["tensors"]:
            if t["name"] == name:
                with open(d / file, "rb") as f:
                    f.seek(t["offset"])
                    out.append((t["dtype"], t["shape"], f.read(t["length"])))
    return out


def assert_tensor(d: pathlib.Path, m: dict, file: str, name: str, expected: np.ndarray, rows=None):
    """The tensors `name` of `file` (one per shard) concatenated equal `expected`."""
    parts = tensor_parts(d, m, file, name)
    assert parts, f"no tensor {name!r} in {file}"
    expected = np.ascontiguousarray(expected)
    for dtype, shape, _ in parts:
        assert dtype == expected.dtype.name, (name, dtype, expected.dtype)
        assert list(shape[1:]) == list(expected.shape[1:]), (name, shape, expected.shape)
    if rows is not None:
        assert [p[1][0] for p in parts] == rows
    assert sum(p[1][0] for p in parts) == expected.shape[0]
    assert b"".join(p[2] for p in parts) == expected.tobytes(), f"bytes of {name!r} in {file}"


# --- Arrow ---------------------------------------------------------------------------------

ROWS = [7, 1, 12]  # record batch sizes


def arrow_columns(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "i64": rng.integers(-(2**40), 2**40, n, dtype=np.int64),
        "f32": rng.standard_normal(n).astype(np.float32),
        "f16": rng.standard_normal(n).astype(np.float16),
        "u8": rng.integers(0, 256, n, dtype=np.uint8),
        "vec": rng.standard_normal((n, 4)).astype(np.float32),
        "img": rng.standard_normal((n, 2, 3)).astype(np.float32),
    }


def arrow_batch(cols: dict) -> pa.RecordBatch:
    vec = pa.FixedSizeListArray.from_arrays(pa.array(cols["vec"].reshape(-1)), 4)
    img = pa.FixedShapeTensorArray.from_numpy_ndarray(cols["img"])
    assert img.type == pa.fixed_shape_tensor(pa.float32(), [2, 3])
    return pa.RecordBatch.from_arrays(
        [pa.array(cols["i64"]), pa.array(cols["f32"]), pa.array(cols["f16"]), pa.array(cols["u8"]), vec, img],
        names=["i64", "f32", "f16", "u8", "vec", "img"],
    )


def write_arrow(path: pathlib.Path, batches, stream: bool, options=None) -> None:
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), batches[0].schema, options=options) as w:
        for b in batches:
            w.write_batch(b)


def make_arrow(path: pathlib.Path, stream: bool, seed: int) -> dict:
    parts = [arrow_columns(n, seed + i) for i, n in enumerate(ROWS)]
    write_arrow(path, [arrow_batch(p) for p in parts], stream)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_arrow_ipc(tmp_path, stream):
    name = "data.arrows" if stream else "data.arrow"
    expected = make_arrow(tmp_path / name, stream, seed=1)
    m = index_ok(tmp_path)
    assert len(m["shards"]) == len(ROWS), "one shard per record batch"
    shapes = {t["name"]: (t["dtype"], t["shape"]) for t in m["shards"][0]["tensors"]}
    assert shapes == {
        "i64": ("int64", [7]),
        "f32": ("float32", [7]),
        "f16": ("float16", [7]),
        "u8": ("uint8", [7]),
        "vec": ("float32", [7, 4]),
        "img": ("float32", [7, 2, 3]),
    }
    for col, values in expected.items():
        assert_tensor(tmp_path, m, name, col, values, rows=ROWS)


def test_mixed_directory_is_deterministic(tmp_path):
    (tmp_path / "sub").mkdir()
    arrow_expected = make_arrow(tmp_path / "sub" / "t.arrow", stream=False, seed=7)
    feat = np.arange(35, dtype=np.float32).reshape(5, 7) / 3
    lab = np.array([-3, 0, 7, 300, -32768, 32767, 1, 2, 3, 4, 5], dtype=np.int16)
    vol = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    np.save(tmp_path / "feat.npy", feat)
    np.save(tmp_path / "lab.npy", lab)
    np.save(tmp_path / "vol.npy", vol)
    np.save(tmp_path / "scalar.npy", np.float64(2.5))
    (tmp_path / "raw.bin").write_bytes(bytes(range(256)) * 3)
    (tmp_path / "README.txt").write_text("ignored")
    (tmp_path / ".hidden.npy").write_bytes(b"ignored")

    m = index_ok(tmp_path)
    files = [s["file"] for s in m["shards"]]
    # Sorted by relative path: "sub/" sorts before "vol.npy".
    assert files == [
        "feat.npy", "lab.npy", "raw.bin", "scalar.npy", "sub/t.arrow", "sub/t.arrow", "sub/t.arrow", "vol.npy"
    ]
    assert_tensor(tmp_path, m, "feat.npy", "feat", feat)
    assert_tensor(tmp_path, m, "lab.npy", "lab", lab)
    assert_tensor(tmp_path, m, "raw.bin", "raw", np.frombuffer(bytes(range(256)) * 3, dtype=np.uint8))
    for col, values in arrow_expected.items():
        assert_tensor(tmp_path, m, "sub/t.arrow", col, values, rows=ROWS)
    (scalar,) = tensor_parts(tmp_path, m, "scalar.npy", "scalar")
    assert scalar[:2] == ("float64", []) and np.frombuffer(scalar[2], np.float64)[0] == 2.5
    assert_tensor(tmp_path, m, "vol.npy", "vol", vol)

    # Re-indexing ignores the manifest itself and yields the same digest.
    digest = m["digest"]
    assert index_ok(tmp_path)["digest"] == digest


# --- numpy ---------------------------------------------------------------------------------


def test_npy_arrays(tmp_path):
    a = np.linspace(-1, 1, 60, dtype=np.float32).reshape(6, 10)
    b = np.arange(-500, 500, 7, dtype=np.int16)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    m = index_ok(tmp_path)
    assert [(s["file"], s["tensors"][0]["shape"]) for s in m["shards"]] == [("a.npy", [6, 10]), ("b.npy", [len(b)])]
    assert_tensor(tmp_path, m, "a.npy", "a", a)
    assert_tensor(tmp_path, m, "b.npy", "b", b)


def test_npy_fortran_order_is_rejected(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    index_fails(tmp_path, "f.npy", "Fortran")


def test_npy_object_array_is_rejected(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}, "x", 3], dtype=object), allow_pickle=True)
    index_fails(tmp_path, "o.npy", "object")


# --- Arrow rejections ----------------------------------------------------------------------


def test_arrow_nulls_are_rejected(tmp_path):
    t = pa.table({"ok": pa.array([1, 2, 3], pa.int64()), "label": pa.array([1.0, None, 3.0], pa.float32())})
    write_arrow(tmp_path / "n.arrow", t.to_batches(), stream=False)
    index_fails(tmp_path, "n.arrow", "label", "nulls")


def test_arrow_lz4_is_rejected(tmp_path):
    cols = arrow_columns(100, seed=3)
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    write_arrow(tmp_path / "c.arrow", [arrow_batch(cols)], stream=False, options=options)
    index_fails(tmp_path, "c.arrow", "compressed")


def test_an_unsupported_column_names_its_type_and_the_flags_that_get_past_it(tmp_path):
    """A struct column cannot be served: the error names the file, the column, its pyarrow
    type and both flags; `--skip-unsupported` indexes the rest and names what it skipped;
    `--columns` keeps only the named columns. (Strings are served, ragged: test_formats.py.)"""
    meta = pa.array([{"a": 1, "b": 2.0}, {"a": 3, "b": 4.0}])
    t = pa.table({"x": pa.array([1, 2], pa.int32()), "name": pa.array(["a", "b"]), "meta": meta})
    write_arrow(tmp_path / "s.arrow", t.to_batches(), stream=True)
    err = index_fails(tmp_path, "s.arrow", "meta", "struct<a: int64, b: double>", "--skip-unsupported", "--columns")
    r = run_index(tmp_path, "--skip-unsupported")
    assert r.returncode == 0 and "meta" in r.stderr and "struct<a: int64, b: double>" in r.stderr, (r.stderr, err)
    names = [t["name"] for t in json.loads((tmp_path / MANIFEST).read_text())["shards"][0]["tensors"]]
    assert names == ["x", "name"], names
    r = run_index(tmp_path, "--columns", "x")
    assert r.returncode == 0, r.stderr
    names = [t["name"] for t in json.loads((tmp_path / MANIFEST).read_text())["shards"][0]["tensors"]]
    assert names == ["x"], names


def test_view_columns_are_stepped_over_when_not_served_and_refused_with_the_fix(tmp_path):
    """polars writes strings as string_view (pyarrow >= 16 on request): a view column not
    served is stepped over, its data buffers counted from the record batch's
    variadicBufferCounts as pyarrow's C++ writer wrote them; served, it is refused naming the
    column, its type and how to write it instead."""
    if not hasattr(pa, "string_view"):
        pytest.skip(f"pyarrow {pa.__version__} cannot write string_view (16 and later can)")
    x = np.arange(5, dtype=np.int32) * 7 - 3
    y = np.arange(5, dtype=np.int64) * -1000
    long = [f"a value longer than twelve bytes, row {i}" for i in range(5)]
    blobs = [b"short", b"a binary value past twelve bytes", b"", b"z", b"0123456789abcdef"]
    # Two chunks concatenated: `s` keeps both data buffers.
    s = pa.concat_arrays([pa.array(long[:2], pa.string_view()), pa.array(long[2:], pa.string_view())])
    t = pa.table({"s": s, "x": pa.array(x), "b": pa.array(blobs, pa.binary_view()), "y": pa.array(y)})
    batches = t.to_batches(max_chunksize=3)
    # `s` has more data buffers than `b` in each batch (variadic counts [2, 1]): counts taken
    # in the wrong order, or one count for both, would shift `x` and `y`.
    for rb in batches:
        assert len(rb.column("s").buffers()) > len(rb.column("b").buffers()) > 2, rb
    write_arrow(tmp_path / "v.arrow", batches, stream=False)
    index_fails(tmp_path, "v.arrow", "column `s`", "(found: string_view)", "large_string", "--skip-unsupported")
    for flags in (["--columns", "x,y"], ["--skip-unsupported"]):
        r = run_index(tmp_path, *flags)
        assert r.returncode == 0, (flags, r.stderr)
        if "--skip-unsupported" in flags:
            assert "s (string_view" in r.stderr and "b (binary_view" in r.stderr, r.stderr
        m = json.loads((tmp_path / MANIFEST).read_text())
        check_integrity(tmp_path, m)
        assert_tensor(tmp_path, m, "v.arrow", "x", x, rows=[3, 2])
        assert_tensor(tmp_path, m, "v.arrow", "y", y, rows=[3, 2])
        (tmp_path / MANIFEST).unlink()


def test_empty_directory_fails_naming_it(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing to index")
    index_fails(tmp_path, str(tmp_path))
