"""The node with CUDA memory end to end (issue 5):

    shardwire source -> shardwire serve --memory auto|cuda -> Python SDK -> torch (GPU)

On a host with a usable GPU, `--memory auto` must choose CUDA and say so, stream regions are
VMM allocations received through pinned staging buffers, and every tensor the SDK yields is a
CudaTensor that torch imports on the GPU without a copy, byte-exact against the dataset file.
On a host without one (CI, this project's build machines) `auto` must choose host memory and
say why; the GPU half skips with its reason (`scripts/gpu-check.sh` runs it on a GPU host).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import child_env, shardwire_bin, MiB, admin_request, crc32c, expected_crcs, http_get, index_dataset, write_id_dataset, write_npy_dataset, write_uint8_shards, write_tokens

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "client" / "python" / "src"))

import shardwire  # noqa: E402
from test_cuda_sdk import _has_cuda_gpu  # noqa: E402


def _dataset(d: pathlib.Path) -> dict:
    write_uint8_shards(d, 6, 3 * MiB + 1234, seed=5)  # not page multiples: staging tails
    rng = np.random.default_rng(5)
    write_npy_dataset(d, {f"f{i}.npy": rng.standard_normal((33 + i, 65)).astype(np.float32) for i in range(3)})
    return index_dataset(d)


def _status(serve) -> dict:
    code, body = admin_request(serve.admin, "GET", "/v1/status")
    assert code == 200, body
    return body


def test_auto_memory_says_what_it_chose(sw, tmp_path):
    d = tmp_path / "ds"
    _dataset(d)
    src = sw.source({"ds": d})
    serve = sw.serve([src], "--memory", "auto")
    mode = _status(serve)["mode"]
    # What the node's own probe sees (a real GPU, the fake libcuda on LD_LIBRARY_PATH, or none).
    probe = json.loads(subprocess.run([shardwire_bin(), "gpus", "--json"], capture_output=True, text=True,
                                      env=child_env(), timeout=60, check=True).stdout)
    if probe["probe"]["usable"]:
        assert mode["memory"] == "cuda", mode
        # One GPU: "auto: GPU 0 (...)"; several: "auto: N GPUs, one lane each: ...".
        assert re.search(r"memory=cuda: auto: (GPU \d|\d+ GPUs, one lane each)", mode["reason"]), mode
    else:
        assert not _has_cuda_gpu()
        assert mode["memory"] == "host", mode
        assert "memory=host: auto: no CUDA driver or usable GPU" in mode["reason"], mode


@pytest.mark.skipif("not _has_cuda_gpu()", reason="needs CUDA GPU")
@pytest.mark.parametrize("receive", ["host", "devmem-sim"])
def test_cuda_memory_end_to_end_into_torch(sw, tmp_path, receive):
    """receive=host: recv into pinned buffers, async H2D, CRC on the CPU. receive=devmem-sim:
    the emulator's frags gathered into the slab by the CUDA kernel (its memory registered with
    CUDA), CRC by the CRC kernel: the bytes never pass through host slabs."""
    import torch

    d = tmp_path / "ds"
    _dataset(d)
    expected = expected_crcs(d)
    src = sw.source({"ds": d})
    serve = sw.serve([src], "--memory", "cuda", "--receive", receive, "--pool-size", "1GiB", "--stream-memory", "64MiB")
    mode = _status(serve)["mode"]
    assert mode["memory"] == "cuda", mode
    if receive == "devmem-sim":
        assert "gathered into GPU memory by the CUDA kernel" in mode["reason"], mode
    client = shardwire.connect(serve.socket)
    seen = []
    with client.open_stream("ds", seed=3) as stream:
        assert stream.info.memory == "cuda"
        while (batch := stream.next(60)) is not None:
            got = []
            for name, t in batch.items():
                assert isinstance(t, shardwire.CudaTensor), type(t)
                g = torch.from_dlpack(t)
                assert g.is_cuda and g.data_ptr() == t.__cuda_array_interface__["data"][0]
                got.append({"name": name, "crc32c": crc32c(g.cpu().numpy().tobytes())})
            want = [{"name": e["name"], "crc32c": e["crc32c"]} for e in expected[batch.shard]]
            assert got == want, f"shard {batch.shard} differs from the dataset file"
            seen.append(batch.shard)
            batch.release()
    assert sorted(seen) == list(range(len(expected)))
    code, metrics = http_get(serve.admin, "/metrics")
    assert code == 200
    assert "shardwire_h2d_staging_stalls_total" in metrics
    if receive == "devmem-sim":
        frags = [l for l in metrics.splitlines() if l.startswith("shardwire_devmem_frags_total")]
        assert frags and float(frags[0].split()[-1]) > 0, frags


def _gpu_count() -> int:
    if not _has_cuda_gpu():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif("_gpu_count() < 2", reason="needs 2 or more CUDA GPUs (one lane each)")
def test_every_gpu_has_its_lane_and_a_stream_lands_on_its_trainers_gpu(sw, tmp_path):
    """Lanes on a multi-GPU host: one per GPU (the real sysfs tree pairs each with its nearest
    NIC); a trainer whose current device is GPU i (device="auto") gets its region on GPU i,
    torch sees every tensor on cuda:i, byte-exact, and lane i's counters grow."""
    import torch

    d = tmp_path / "ds"
    _dataset(d)
    expected = expected_crcs(d)
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "1GiB", "--stream-memory", "64MiB")
    n = torch.cuda.device_count()
    lanes = _status(serve)["lanes"]
    assert len(lanes) == n and all(l["memory"] == "cuda" for l in lanes), lanes
    client = shardwire.connect(serve.socket)
    for i in range(n):
        torch.cuda.set_device(i)
        p = torch.cuda.get_device_properties(i)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        lane = next(l["lane"] for l in lanes if l["gpu"] == bus)
        seen = []
        with client.open_stream("ds", seed=i) as stream:
            assert stream.info.gpu["pci_bus_id"] == bus, (i, stream.info.gpu)
            while (batch := stream.next(60)) is not None:
                got = []
                for name, t in batch.items():
                    g = torch.from_dlpack(t)
                    assert g.is_cuda and g.device.index == i, (name, g.device)
                    got.append({"name": name, "crc32c": crc32c(g.cpu().numpy().tobytes())})
                assert got == [{"name": e["name"], "crc32c": e["crc32c"]} for e in expected[batch.shard]]
                seen.append(batch.shard)
                batch.release()
        assert sorted(seen) == list(range(len(expected)))
        after = _status(serve)["lanes"][lane]
        assert after["bytes_received"] > 0 and after["data_connections"] > 0, after


@pytest.mark.skipif("not _has_cuda_gpu()", reason="needs CUDA GPU")
def test_batch_mode_into_torch_one_gather_launch_per_batch(sw, tmp_path):
    """Batch mode on the GPU: shuffled batches assembled in the stream's VMM region by one
    gather launch each, imported by torch without a copy, every row byte-exact."""
    import torch

    d = tmp_path / "ds"
    rows = write_id_dataset(d, [[30 + (7 * i + f) % 17 for i in range(8)] for f in range(3)])
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "1GiB", "--stream-memory", "64MiB")
    client = shardwire.connect(serve.socket)
    seen = []
    with client.open_stream("ds", seed=3, batch_size=16, shuffle="block", shuffle_block=100, drop_last=True) as stream:
        assert stream.info.memory == "cuda"
        while (batch := stream.next(60)) is not None:
            ids_t, emb_t = torch.from_dlpack(batch["id"]), torch.from_dlpack(batch["emb"])
            assert ids_t.is_cuda and tuple(ids_t.shape) == (16,) and tuple(emb_t.shape) == (16, 4)
            ids = ids_t.cpu().tolist()
            assert crc32c(emb_t.cpu().numpy().tobytes()) == crc32c(b"".join(rows[i][1] for i in ids)), ids
            seen += ids
            batch.release()
    assert len(set(seen)) == len(seen) and len(rows) - len(seen) < 16
    c = _status(serve)["counters"]
    assert c["batch_gather_launches"] == c["batches_assembled"] >= len(seen) // 16, c


@pytest.mark.skipif("not _has_cuda_gpu()", reason="needs CUDA GPU")
def test_token_windows_widened_on_the_gpu_into_torch(sw, tmp_path):
    """Token mode on the GPU: uint16 windows widened to int64 in each batch's gather launch,
    imported by torch without a copy, every window exact against the raw token file."""
    import torch

    d = tmp_path / "tok"
    rng = np.random.default_rng(4)
    stream = np.concatenate([np.append(rng.integers(1, 65535, size=n), 0) for n in rng.integers(5, 80, size=60)]).astype(np.uint16)
    write_tokens(d, stream, eos=0)
    serve = sw.serve([sw.source({"ds": d})], "--memory", "cuda", "--pool-size", "1GiB", "--stream-memory", "64MiB")
    L, k = 16, 0
    with shardwire.connect(serve.socket).open_stream("ds", batch_size=4, seq_len=L, shuffle="none",
                                                     token_dtype="int64", drop_last=True) as s:
        assert s.info.memory == "cuda"
        while (batch := s.next(60)) is not None:
            t = torch.from_dlpack(batch["tokens"])
            assert t.is_cuda and t.dtype == torch.int64 and tuple(t.shape) == (4, L + 1)
            for w in t.cpu().numpy():
                assert np.array_equal(w, stream[k * L: k * L + L + 1]), k
                k += 1
            batch.release()
    assert k == (len(stream) - 1) // L // 4 * 4

