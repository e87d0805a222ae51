"""The node with CUDA memory end to end on ANY machine, against the fake libcuda:

    shardwire source -> shardwire serve --memory cuda -> Python SDK (CudaRegion) -> tensor bytes

The fake (gpu/fakecuda/fake_cuda.c, built by scripts/build-fakecuda) is a test double of the
CUDA driver on host memory: device pointers are host addresses, VMM allocations are memfds, the
gather and CRC kernels run on the CPU from their CUDA source, with the driver's documented
checks (contexts, bounds, access, deferred streams). `serve` and the trainer child run with it
on LD_LIBRARY_PATH (read only when a process starts, so the SDK runs in a child of this test,
not in pytest). What this proves without a GPU: the node opens the "GPU" (probe, self-test),
stream regions are VMM allocations filled through pinned staging (receive=host) or by the
gather kernel from the emulator's registered memory with the CRC on the "GPU"
(receive=devmem-sim), the region's POSIX fd crosses to the trainer, the SDK imports and maps
it with cuda-bindings (cuMemImportFromShareableHandle ... cuMemSetAccess), and every tensor
is byte-exact; and no driver call of either process fails, nothing faults or leaks, and the
region is unmapped from the node when the stream closes. (test_cuda_e2e.py is the same on a
real GPU, into torch.)

Without cuda-bindings in the venv the trainer maps the exported memfd itself (the fake's
device memory is host memory) instead of importing it through the driver, and says so.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from conftest import MiB, REPO, admin_request, crc32c, expected_crcs, get_status, http_get, index_dataset, shardwire_bin, wait_for, write_id_dataset, write_npy_dataset, write_uint8_shards, write_tokens

FAKE_NAME = "shardwire fake CUDA device (host memory)"
FAKE_BUS = "0000:fa:00.0"
_FAKE_DIR: list[pathlib.Path] = []


def fake_dir() -> pathlib.Path:
    """The fake libcuda's folder (built by scripts/build-fakecuda next to the binary's target)."""
    if not _FAKE_DIR:
        out = shardwire_bin().resolve().parent.parent / "fakecuda"  # <target>/<profile>/shardwire
        r = subprocess.run(["bash", str(REPO / "scripts" / "build-fakecuda"), str(out)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.fail(f"scripts/build-fakecuda failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        _FAKE_DIR.append(pathlib.Path(r.stdout.strip().splitlines()[-1]))
    return _FAKE_DIR[0]


def fake_env() -> dict:
    """Environment for a child that must see the fake (one device, driver 12.8, the PCIe
    dma-buf flag supported, whatever the caller's environment says) and log its failed calls
    and leaks."""
    old = os.environ.get("LD_LIBRARY_PATH")
    return {
        "LD_LIBRARY_PATH": f"{fake_dir()}:{old}" if old else str(fake_dir()),
        "FAKE_CUDA_LOG": "1",
        "FAKE_CUDA_DEVICES": "1",
        "FAKE_CUDA_NO_PCIE_FLAG": "0",
        "FAKE_CUDA_HOST_COHERENT": "0",
        "FAKE_CUDA_COMPUTE_CAPABILITY": "8.0",
        "FAKE_CUDA_DRIVER_VERSION": "12080",
    }


def fake_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("fake libcuda")]


def has_cuda_bindings() -> bool:
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _dataset(d: pathlib.Path) -> dict:
    write_uint8_shards(d, 5, 3 * MiB + 1234, seed=9)  # not page multiples: staging tails
    rng = np.random.default_rng(9)
    write_npy_dataset(d, {f"f{i}.npy": rng.standard_normal((33 + i, 65)).astype(np.float32) for i in range(3)})
    return index_dataset(d)


def _metric(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(name)]
    assert lines, f"no {name} in /metrics"
    return float(lines[0].split()[-1])


def _vmm_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("fakecuda-vmm" in line for line in f)


def _trainer(serve, **opts) -> subprocess.CompletedProcess:
    """The trainer: a child with the fake on its loader path (see _consume)."""
    return subprocess.run(
        [sys.executable, __file__, "consume", serve.socket, "ds", json.dumps(opts)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **fake_env()},
    )


def _run_trainer(serve, expected: list) -> None:
    """One epoch through the SDK, every tensor byte-exact, no driver call failed or leaked."""
    r = _trainer(serve)
    assert r.returncode == 0, f"trainer failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n{serve.describe()}"
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    info, batches = out[0], out[1:]
    assert info["memory"] == "cuda", info
    assert info["import"] == ("cuda-bindings" if has_cuda_bindings() else "mmap"), info
    if info["import"] == "cuda-bindings":
        assert info["access"] == "read", info  # the fake grants read-only mappings, as asked
    for b in batches:
        want = [{"name": e["name"], "crc32c": e["crc32c"]} for e in expected[b["shard"]]]
        got = [{"name": t["name"], "crc32c": t["crc32c"]} for t in b["tensors"]]
        assert got == want, f"shard {b['shard']} differs from the dataset file"
    assert sorted(b["shard"] for b in batches) == list(range(len(expected)))
    assert fake_lines(r.stderr) == [], r.stderr  # no driver call failed, nothing leaked


def _closed_and_unmapped(serve) -> None:
    """Every stream closed, its region unmapped from the node (whatever thread dropped it), and
    no driver call of the node failed, faulted or leaked."""
    wait_for(lambda: not get_status(serve.admin)["streams"], "the streams to close", diag=serve.describe)
    wait_for(lambda: _vmm_mappings(serve.pid) == 0, "the regions to be unmapped", timeout=15, diag=serve.describe)
    assert fake_lines(serve.stderr_text()) == [], serve.stderr_text()


@pytest.mark.parametrize("receive", ["host", "devmem-sim"])
def test_cuda_memory_end_to_end_on_the_fake_driver(sw, tmp_path, receive):
    d = tmp_path / "ds"
    _dataset(d)
    expected = expected_crcs(d)
    src = sw.source({"ds": d})
    serve = sw.serve([src], "--memory", "cuda", "--receive", receive, "--pool-size", "1GiB", "--stream-memory", "64MiB", env=fake_env())

    status = get_status(serve.admin)
    mode = status["mode"]
    assert mode["memory"] == "cuda", mode
    assert f'memory=cuda: configured (memory = "cuda"): GPU 0 ({FAKE_NAME}, {FAKE_BUS})' in mode["reason"], mode
    if receive == "devmem-sim":
        assert "gathered into GPU memory by the CUDA kernel" in mode["reason"], mode
    assert [g["name"] for g in status["gpus"]["devices"]] == [FAKE_NAME], status["gpus"]

    _run_trainer(serve, expected)

    code, metrics = http_get(serve.admin, "/metrics")
    assert code == 200
    assert _metric(metrics, "shardwire_crc_failures_total") == 0
    if receive == "devmem-sim":
        assert _metric(metrics, "shardwire_devmem_frags_total") > 0

    _closed_and_unmapped(serve)


def test_a_trainer_dying_mid_epoch_leaves_the_gpu_node_clean(sw, tmp_path):
    """A trainer that dies after one batch (fetches into its CUDA region in flight), then a full
    epoch on the same node: byte-exact, and the node's regions all go without a failed call."""
    d = tmp_path / "ds"
    _dataset(d)
    expected = expected_crcs(d)
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "1GiB", "--stream-memory", "64MiB",
                     env=fake_env())
    r = _trainer(serve, limit=1)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert len([line for line in r.stdout.splitlines() if line.startswith('{"shard"')]) == 1, r.stdout
    _run_trainer(serve, expected)
    _closed_and_unmapped(serve)


def test_batch_mode_assembles_each_batch_with_one_gather_launch(sw, tmp_path):
    """Batch mode in CUDA memory: the stream's resident shards are VMM memory (staged H2D), and
    each batch of samples shuffled across shards is one gather-kernel launch into one slab
    (the node's counters: launches == batches assembled == batches the trainer got); every
    sample once, every tensor byte-exact against the rows its ids name, nothing leaked."""
    d = tmp_path / "ds"
    rows = write_id_dataset(d, [[30 + (7 * i + f) % 17 for i in range(8)] for f in range(3)])
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "1GiB", "--stream-memory", "64MiB",
                     env=fake_env())
    r = _trainer(serve, batch_size=16, shuffle="block", shuffle_block=100, drop_last=True)
    assert r.returncode == 0, f"trainer failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n{serve.describe()}"
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert out[0]["memory"] == "cuda", out[0]
    got = out[1:]
    assert len(got) == len(rows) // 16
    seen = [i for b in got for i in b["ids"]]
    assert len(set(seen)) == len(seen) and len(rows) - len(seen) < 16, "each sample once, under a batch dropped"
    assert seen != sorted(seen), "samples are shuffled across shards"
    for b in got:
        t = {x["name"]: x for x in b["tensors"]}
        assert b["shard"] is None and t["id"]["shape"] == [16] and t["emb"]["shape"] == [16, 4], b
        assert t["id"]["crc32c"] == crc32c(b"".join(rows[i][0] for i in b["ids"])), b["ids"]
        assert t["emb"]["crc32c"] == crc32c(b"".join(rows[i][1] for i in b["ids"])), b["ids"]
    assert fake_lines(r.stderr) == [], r.stderr
    c = get_status(serve.admin)["counters"]
    assert c["batch_gather_launches"] == c["batches_assembled"] >= len(got), c
    assert c["batches_delivered"] == len(got), c
    code, metrics = http_get(serve.admin, "/metrics")
    assert code == 200 and _metric(metrics, "shardwire_batch_gather_launches_total") == c["batch_gather_launches"]
    _closed_and_unmapped(serve)


def test_token_windows_widen_in_the_batch_gather_launch(sw, tmp_path):
    """Token mode in CUDA memory: uint16 windows widened to int64 by the batch's one gather
    launch (a frag per token into zeroed cells): every window exact against the raw token
    file, launches == batches, no driver call failed."""
    d = tmp_path / "tok"
    rng = np.random.default_rng(4)
    stream = np.concatenate([np.append(rng.integers(1, 65535, size=n), 0) for n in rng.integers(5, 80, size=60)]).astype(np.uint16)
    write_tokens(d, stream, eos=0)
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "1GiB", "--stream-memory", "64MiB",
                     env=fake_env())
    L = 16
    r = _trainer(serve, batch_size=4, seq_len=L, shuffle="none", token_dtype="int64", drop_last=True)
    assert r.returncode == 0, f"trainer failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n{serve.describe()}"
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")][1:]
    assert len(got) == (len(stream) - 1) // L // 4
    for k, b in enumerate(got):
        assert b["tokens"]["typestr"] == "<i8", b["tokens"]["typestr"]
        w = np.array(b["tokens"]["values"]).reshape(4, L + 1)
        for i in range(4):
            j = (4 * k + i) * L
            assert np.array_equal(w[i], stream[j: j + L + 1]), (k, i)
    assert fake_lines(r.stderr) == [], r.stderr
    c = get_status(serve.admin)["counters"]
    assert c["batch_gather_launches"] == c["batches_assembled"] >= len(got), c
    _closed_and_unmapped(serve)


def test_auto_memory_chooses_the_fake_gpu_and_falls_back_to_the_default_dmabuf(sw, tmp_path):
    """`shardwire gpus` and `serve --memory auto` see the fake as a usable GPU; with a driver that
    refuses the dma-buf PCIe mapping flag (FAKE_CUDA_NO_PCIE_FLAG=1) the node's self-test
    exports the dma-buf without it, starts on CUDA memory, and says so (reason and log)."""
    # A GPU cache-coherent with the CPU (Grace): elsewhere the refusal is expected (the
    # default mapping is PCIe) and nothing is said.
    env = {**fake_env(), "FAKE_CUDA_NO_PCIE_FLAG": "1", "FAKE_CUDA_HOST_COHERENT": "1"}
    r = subprocess.run([str(shardwire_bin()), "gpus", "--json"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    gpus = json.loads(r.stdout)
    assert gpus["auto"]["memory"] == "cuda" and gpus["probe"]["driver_version"] == 12080, gpus
    assert gpus["probe"]["devices"][0]["name"] == FAKE_NAME, gpus
    d = tmp_path / "ds"
    write_uint8_shards(d, 1, 4096)
    index_dataset(d)
    serve = sw.serve([sw.source({"ds": d})], "--memory", "auto", env=env)
    mode = get_status(serve.admin)["mode"]
    assert mode["memory"] == "cuda", mode
    # Said in the reason and the log, not silent (before: "has dma-buf and VMM support" only).
    assert f"memory=cuda: auto: GPU 0 ({FAKE_NAME}, {FAKE_BUS}) (dma-buf with the driver's default mapping:" in mode["reason"], mode
    assert "has dma-buf and VMM support" in mode["reason"], mode
    assert "refused the PCIe mapping type for a dma-buf of GPU memory" in serve.stderr_text(), serve.stderr_text()[-3000:]
    refused = "cuMemGetHandleForAddressRange -> CUDA_ERROR_INVALID_VALUE: CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE refused"
    lines = fake_lines(serve.stderr_text())
    assert lines and all(refused in line for line in lines), lines


def test_a_gpu_that_refuses_the_dmabuf_export_still_serves_streams_and_says_so(sw, tmp_path):
    """A driver whose device attribute says dma-buf is supported but which refuses every export
    (seen on an H200 under Firecracker; FAKE_CUDA_NO_DMABUF=1 here): `auto` still chooses CUDA
    memory, says that no devmem receive can bind it, warns once, and a trainer gets every shard
    byte-exact through pinned staging."""
    d = tmp_path / "ds"
    _dataset(d)
    expected = expected_crcs(d)
    env = {**fake_env(), "FAKE_CUDA_NO_DMABUF": "1"}
    serve = sw.serve([sw.source({"ds": d})], "--memory", "auto", "--pool-size", "1GiB", "--stream-memory", "64MiB",
                     env=env)
    mode = get_status(serve.admin)["mode"]
    assert mode["memory"] == "cuda", mode
    assert f"memory=cuda: auto: GPU 0 ({FAKE_NAME}, {FAKE_BUS}) (no dma-buf export, so no devmem receive into it: " \
           "the driver refused the dma-buf export: cuMemGetHandleForAddressRange failed: CUDA_ERROR_NOT_SUPPORTED) " \
           "has VMM support" in mode["reason"], mode
    err = serve.stderr_text()
    assert "the GPU's memory does not export as a dma-buf" in err and 'receive = "devmem" cannot bind it' in err, err
    # The check's two exports (with the PCIe flag, then without) are the only failed calls.
    lines = fake_lines(err)
    assert len(lines) == 2 and all("dma-buf export refused (FAKE_CUDA_NO_DMABUF=1)" in line for line in lines), lines
    _run_trainer(serve, expected)


# --- the trainer child ---------------------------------------------------------------------------


def _consume(socket: str, dataset: str, limit: int | None = None, **batch) -> None:
    """Consumes one epoch; prints {memory, import, access}, then per batch {shard, tensors:
    [{name, crc32c, shape}]} with the CRC-32C of each tensor's bytes read at its device
    pointer (and `ids`, the int64 `id` tensor's values, when there is one). With `limit`, dies
    (os._exit, nothing released or closed) after that many batches; `batch` are open_stream's
    batch-mode keywords."""
    sys.path.insert(0, str(REPO / "client" / "python" / "src"))
    import shardwire
    from shardwire import _client, _cuda

    how = "cuda-bindings"
    if not has_cuda_bindings():
        how = "mmap"

        class MappedRegion(_cuda.CudaRegion):
            """The fake's device memory is a memfd: map the exported fd read-only ourselves."""

            def __init__(self, fd: int, size: int, pci_bus_id: str, granularity: int) -> None:
                import mmap

                self._closed = True
                self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                self._bytes = np.frombuffer(self._map, np.uint8)
                self.size, self.pci_bus_id, self.granularity, self.device = size, pci_bus_id, granularity, 0
                self.ptr, self.access = self._bytes.ctypes.data, "read"
                self._closed = False

            def synchronize(self) -> None:
                pass

            def close(self) -> None:
                self._closed = True

        _client.CudaRegion = MappedRegion  # type: ignore[misc]

    client = shardwire.connect(socket)
    with client.open_stream(dataset, seed=3, **batch) as stream:
        region = stream.region
        print(json.dumps({"memory": stream.info.memory, "import": how, "access": region.access}), flush=True)
        while (batch := stream.next(60)) is not None:
            tensors, out = [], {"shard": batch.shard}
            for name, t in batch.items():
                assert isinstance(t, shardwire.CudaTensor), type(t)
                ptr = t.__cuda_array_interface__["data"][0]
                assert region.ptr <= ptr and ptr + t.nbytes <= region.ptr + region.size
                data = ctypes.string_at(ptr, t.nbytes)
                tensors.append({"name": name, "crc32c": crc32c(data), "shape": list(t.shape)})
                if name == "id":
                    out["ids"] = np.frombuffer(data, np.int64).tolist()
                if name == "tokens":
                    typestr = t.__cuda_array_interface__["typestr"]
                    out["tokens"] = {"typestr": typestr, "values": np.frombuffer(data, np.dtype(typestr)).tolist()}
            print(json.dumps({**out, "tensors": tensors}), flush=True)
            if limit is not None and (limit := limit - 1) == 0:
                os._exit(0)
            del t
            batch.release()
    region.close()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "consume":
    _consume(sys.argv[2], sys.argv[3], **json.loads(sys.argv[4]))


def test_a_cuda_lane_counts_each_stream_as_its_whole_region_against_pool_size(sw, tmp_path):
    """A CUDA region is made of 2 MiB pages: a stream_memory of 64 KiB takes 2 MiB of the GPU.
    The pool counts what the regions take, so pool_size 4 MiB admits two such streams, and the
    third is refused `no_memory` naming the 2 MiB. Before, it counted 64 KiB a stream and
    admitted 64 of them (128 MiB of GPU memory under a 4 MiB pool)."""
    d = tmp_path / "ds"
    write_uint8_shards(d, 2, 4096, seed=2)
    index_dataset(d)
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "4MiB", "--stream-memory", "64KiB",
                     env=fake_env())
    opened = [admin_request(serve.admin, "POST", "/v1/streams", {"dataset": "ds"}) for _ in range(3)]
    assert [code for code, _ in opened[:2]] == [201, 201], opened
    code, body = opened[2]
    assert code != 201 and body.get("code") == "no_memory", opened[2]
    assert "needs 2097152" in body.get("message", ""), body
    lane = get_status(serve.admin)["lanes"][0]
    assert lane["pool_reserved"] == 4 * MiB, lane
