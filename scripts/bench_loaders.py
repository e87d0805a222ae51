#!/usr/bin/env python3
"""Data loaders into a torch training loop: steady-state samples/s and the time to the first
batch of shardwire (batch mode, over TCP on loopback) against local-disk loaders over the same
rows: the strongest hand-written local loader (`numpy-mmap-gather`), torch DataLoader with a
batched `__getitems__`, torch DataLoader with per-sample `__getitem__`, MosaicML Streaming
(local MDS) and WebDataset (local tars). Also a shuffle-quality mode and a token mode.

Run through scripts/bench-loaders (it makes .venv-streaming and builds the release binary;
SKIP_BUILD=1 skips the build):

    scripts/bench-loaders [--samples 262144] [--rounds 3] [--seconds 3] [--batch 256] [--shuffle-block 32768]
    scripts/bench-loaders --shuffle-quality [--samples 262144]
    scripts/bench-loaders --tokens [--tok-tokens 32000000] [--seq-len 2048] [--batch 8] [--rounds 3]

One dataset of N samples (int64 `id` = storage position, float32 `x[256]`: 1032 B rows, 1 KiB of
them `x`; the default 262144 samples are 258 MiB of rows, plus the formats' framing), written
once as Arrow IPC files (record batches of --shard-rows rows = shardwire shards), and, when
--loaders has streaming or webdataset, as MDS shards or tar shards of the same rows (only the
forms the chosen loaders read: a run without streaming needs no .venv-streaming). Each loader
runs in its own subprocess per round (Streaming with .venv-streaming's python), rounds
alternate the loaders' order, and every loader's batch goes through the same tiny model step
(Linear(256,256)+ReLU+Linear(256,1), forward, backward, SGD, CPU, torch.set_num_threads(1)).
Every loader runs as many epochs as the windows need
(shardwire: one stream of --epochs epochs; the local loaders: epoch after epoch, each its own
shuffle order, DataLoader workers persistent).

Windows (per loader, per round, in its process):
- first batch, fresh: from opening the loader (shardwire: `connect` + `open_stream`; local: opening
  the files / constructing the dataset and DataLoader, workers included) to the first batch in
  the training loop, in a new process (torch and the loader's modules are imported and the model
  built before the clock starts).
- warm-up: at least --warmup-seconds (default 1 s) after the first batch AND at least --warmup
  batches (default 300), whichever ends later; not timed.
- steady state: then at least --seconds (default 3 s) of wall time AND at least --measure batches
  (default 0); samples/s = samples / that time. The loop's time waiting for the next batch and
  the model step's time are split (loader wait share); the step's on-CPU time
  (`time.thread_time`), the training thread's preemptions (RUSAGE_THREAD involuntary switches)
  and the host's CPU time outside the training process over the window (/proc/stat busy minus
  `time.process_time`: the node's processes, DataLoader workers) are reported per batch.
- first batch, resumed: after the window the loader's position is saved, the loader closed, and
  a new one opened at that position, timed from the open to its first batch:
  shardwire `open_stream(state=stream.state_dict())` (over a new connection); shardwire-torch
  `IterableDataset.load_state_dict(ds.state_dict())` in a new DataLoader; numpy-mmap-gather and
  the torch loaders: re-created at (epoch, batches taken in it) -- files mapped again, the
  epoch's order recomputed and the batches before the offset skipped (their indices only, no
  data); Streaming: a new StreamingDataset + StreamingDataLoader given the old loader's
  `state_dict()`; WebDataset: none (it has no resume; reported as "-").

Loaders:
- shardwire: `open_stream(batch_size, shuffle="block", shuffle_block, drop_last=True)` in the
  training process; the batch's read-only zero-copy view goes to `torch.from_numpy`.
- shardwire-torch: `DataLoader(shardwire.torch.IterableDataset(...), batch_size=None,
  num_workers=0)` (the SDK's copy=True default: one copy per batch).
- numpy-mmap-gather: the strongest local loader we could write, in the training process, no
  DataLoader, no workers. The Arrow IPC files are memory-mapped read-only (mmap(2), all files
  into one contiguous address range so one view spans the dataset) and opened with pyarrow's IPC
  reader over that mapping (`pa.foreign_buffer` + `ipc.open_file`): zero-copy numpy views, and
  per sample the offset of its `x` row and `id` in the mapping. The order is the same kind of
  two-level block shuffle as shardwire's `shuffle="block"`: per epoch (numpy PCG64 seeded with
  (seed, epoch)) the record batches (= shards) are permuted, cut into blocks closed at the first
  shard end at or past --shuffle-block samples, and each block's samples permuted; batches of
  --batch run across block edges, drop_last per epoch (the same work, not the same order). Per
  batch: one numpy fancy-index gather of the x rows (a [batch, 256] float32 array) and one of the
  ids, then `torch.from_numpy`.
- torch-getitems: `DataLoader` over a map-style dataset whose batched `__getitems__(indices)`
  does the same gather (torch >= 2.1 calls it once per batch), `batch_sampler` yielding the same
  block-shuffled index arrays, an identity `collate_fn`, num_workers=0.
  torch-getitems-workers: the same with --workers workers (persistent, each mapping the files).
- torch-arrow: the usual way: map-style dataset over the same Arrow files (pyarrow memory_map,
  zero-copy views per record batch), `__getitem__` returns one row, default collate, a full
  random permutation per epoch (torch.randperm), --workers persistent workers.
- streaming: StreamingDataset(local MDS, shuffle_algo="py1e", shuffle_block_size=--shuffle-block)
  in a StreamingDataLoader with --workers persistent workers.
- webdataset: WebDataset(tars, shardshuffle).shuffle(--shuffle-block).decode().batched(B) in a
  WebLoader with --workers persistent workers.

The summary names the fastest local loader (median steady-state samples/s) and gives shardwire's
ratio to it per round and median (and of the loop's wait per batch), where the time went per
batch (for shardwire also the node's CRC + gather time per batch it assembled, from its metrics
`shardwire_stall_seconds_total{cause="assembly"}` -- the batch gathers and every receiver's
CRC-32C of the bytes it received, summed -- over `shardwire_batches_assembled_total`, read
before and after each loader's process; and the bytes the node received,
`shardwire_bytes_received_total`, per byte of those batches: 8 B `id` + 1 KiB `x` a row),
the time-to-first-batch table
(fresh and resumed), and the CPU model and flags. --node-cpus / --trainer-cpus pin the node's
processes and each loader's process with `taskset -c` (default: unpinned, the CPUs shared).

--tokens: one Megatron dataset (.bin/.idx written by megatron-core's IndexedDatasetBuilder,
uint16, documents of 200..3000 random tokens < 50000 each ending in EOD 0), read as windows
of --seq-len + 1 tokens by megatron-core's GPTDataset in a torch DataLoader (local files,
--workers workers, create_attention_mask=False) and by shardwire's token stream (block
shuffle, and order="megatron"), token_dtype int64. Each batch goes through Embedding(50000,
64) + mean + Linear(64,1) on tokens[:, :-1]; tokens/s = batches * B * (L+1) / time. Token mode
keeps batch-count windows (defaults --warmup 20 --measure 300, no time floor; GPTDataset runs one
epoch). The first batch of order="megatron" is checked equal to GPTDataset's.

SHARDWIRE_BIN overrides the binary; SHARDWIRE_VENV and SHARDWIRE_STREAMING_VENV the venvs
(default .venv and .venv-streaming in the repository). Other SHARDWIRE_* variables are not passed
on: the node runs with memory = "host", receive = "host" and one lane (BENCH_NODE_ENV; tests/e2e
pins only memory = "host"), so a GPU host measures the same host-memory path as the CPU loaders.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
SDK_SRC = REPO / "client" / "python" / "src"
MAIN_PY = pathlib.Path(os.environ.get("SHARDWIRE_VENV") or REPO / ".venv") / "bin" / "python"
STREAMING_PY = pathlib.Path(os.environ.get("SHARDWIRE_STREAMING_VENV") or REPO / ".venv-streaming") / "bin" / "python"
BIN = pathlib.Path(os.environ.get("SHARDWIRE_BIN") or pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "shardwire")
DIM = 256
DATASET = "bench"
SOURCE_READY = re.compile(r"source listening on (\S+)")
SERVE_READY = re.compile(r"node service ready: socket (\S+) admin http://(\S+)")
#: `serve` settings every benchmark node runs with: host memory, host receive, one lane (the
#: e2e tests' nodes get only SHARDWIRE_MEMORY=host, tests/e2e/conftest.py `child_env`).
BENCH_NODE_ENV = {"SHARDWIRE_MEMORY": "host", "SHARDWIRE_RECEIVE": "host", "SHARDWIRE_LANES": "[{}]"}
LOADERS = ["shardwire", "shardwire-torch", "numpy-mmap-gather", "torch-getitems", "torch-getitems-workers", "torch-arrow", "streaming", "webdataset"]
TOK_LOADERS = ["megatron", "shardwire", "shardwire-megatron"]
TOK_DATASET, TOK_PREFIX, VOCAB = "gpt", "corpus_text_document", 50000


# ----------------------------------------------------------------------------- dataset


def prepare(data: pathlib.Path, n: int, shard_rows: int, files: int, forms: set[str]) -> None:
    """Write the on-disk forms once: the Arrow IPC files always, and of `forms` those not
    written yet: "mds" (the MDS shards of the streaming loader, written by .venv-streaming's
    python) and "wds" (the tars of webdataset). A marker file records the parameters and the
    forms written, so a run of other loaders needs neither .venv-streaming nor their time."""
    marker = data / "params.json"
    want = {"n": n, "shard_rows": shard_rows, "files": files, "dim": DIM, "v": 1}
    had = json.loads(marker.read_text()) if marker.exists() else {}
    # A marker without "forms" is older than this choice: every form was written.
    have = set(had.pop("forms", ["mds", "wds"]))
    if had == want and forms <= have:
        return
    if had != want:
        write_arrow(data, n, shard_rows, files)
        have = set()
        marker.write_text(json.dumps({**want, "forms": []}))
    if "mds" in forms - have:
        if not STREAMING_PY.exists():
            raise SystemExit(f"bench-loaders: the streaming loader's MDS shards are written by {STREAMING_PY}, which is missing: "
                             "make it with scripts/streaming-venv (scripts/bench-loaders does), or leave streaming out of --loaders")
        t = time.perf_counter()
        subprocess.run([str(STREAMING_PY), __file__, "--write-mds", str(data), "--shard-rows", str(shard_rows)], check=True)
        print(f"mds: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        have.add("mds")
        marker.write_text(json.dumps({**want, "forms": sorted(have)}))
    if "wds" in forms - have:
        t = time.perf_counter()
        write_wds(data, shard_rows)
        print(f"webdataset: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        have.add("wds")
        marker.write_text(json.dumps({**want, "forms": sorted(have)}))


def write_arrow(data: pathlib.Path, n: int, shard_rows: int, files: int) -> None:
    """The dataset as Arrow IPC files (record batches of `shard_rows` rows = shardwire shards),
    indexed; whatever `data` held before is removed."""
    shutil.rmtree(data, ignore_errors=True)
    (data / "arrow").mkdir(parents=True)
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc

    assert n % shard_rows == 0, "--samples must be a multiple of --shard-rows"
    shards = n // shard_rows
    assert shards % files == 0, "shards must split evenly into --files"
    rng = np.random.default_rng(0)
    schema = pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float32(), DIM))])
    per_file = shards // files
    t = time.perf_counter()
    for f in range(files):
        with ipc.new_file(str(data / "arrow" / f"part-{f:03d}.arrow"), schema) as w:
            for b in range(per_file):
                start = (f * per_file + b) * shard_rows
                ids = np.arange(start, start + shard_rows, dtype=np.int64)
                x = rng.standard_normal((shard_rows, DIM), dtype=np.float32)
                w.write_batch(pa.record_batch([pa.array(ids), pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM)], schema=schema))
    subprocess.run([str(BIN), "index", "--quiet", str(data / "arrow")], check=True)
    print(f"arrow: {n} samples in {files} files, {shards} record batches ({time.perf_counter() - t:.1f} s)", file=sys.stderr)


def forms_for(a: argparse.Namespace) -> set[str]:
    """The on-disk forms besides Arrow that a run reads: MDS for the streaming loader, tars for
    webdataset (the shuffle-quality mode reads neither)."""
    if a.shuffle_quality:
        return set()
    loaders = set(a.loaders.split(","))
    return {f for f, l in (("mds", "streaming"), ("wds", "webdataset")) if l in loaders}


def arrow_batches(data: pathlib.Path):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    for p in sorted((data / "arrow").glob("*.arrow")):
        r = ipc.open_file(pa.memory_map(str(p), "r"))
        for i in range(r.num_record_batches):
            rb = r.get_batch(i)
            yield rb.column("id").to_numpy(), rb.column("x").values.to_numpy(zero_copy_only=True).reshape(-1, DIM)


def write_mds(data: pathlib.Path, shard_rows: int) -> None:
    from streaming import MDSWriter

    out = data / "mds"
    shutil.rmtree(out, ignore_errors=True)
    # size_limit: one shard per `shard_rows` samples (payload 8 + 4*DIM bytes, 4-byte offset each)
    limit = shard_rows * (8 + 4 * DIM + 4) + 64
    with MDSWriter(out=str(out), columns={"id": "int64", "x": f"ndarray:float32:{DIM}"}, size_limit=limit, compression=None) as w:
        for ids, x in arrow_batches(data):
            for i in range(len(ids)):
                w.write({"id": int(ids[i]), "x": x[i]})


def write_wds(data: pathlib.Path, shard_rows: int) -> None:
    import webdataset as wds

    out = data / "wds"
    out.mkdir(exist_ok=True)
    for s, (ids, x) in enumerate(arrow_batches(data)):
        with wds.TarWriter(str(out / f"shard-{s:05d}.tar")) as w:
            for i in range(len(ids)):
                w.write({"__key__": f"{int(ids[i]):09d}", "x.npy": x[i].copy(), "id.cls": int(ids[i])})


def prepare_tokens(d: pathlib.Path, n: int) -> None:
    """Write the Megatron .bin/.idx pair once with megatron-core's builder, then index it."""
    marker = d / "params.json"
    want = {"tokens": n, "vocab": VOCAB, "doc_len": [200, 3000], "dtype": "uint16", "v": 1}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    t = time.perf_counter()
    rng = np.random.default_rng(0)
    b = IndexedDatasetBuilder(str(d / f"{TOK_PREFIX}.bin"), dtype=np.uint16)
    total = docs = 0
    while total < n:
        doc = rng.integers(1, VOCAB, size=int(rng.integers(200, 3001)), dtype=np.int64)
        doc[-1] = 0  # EOD
        b.add_item(torch.from_numpy(doc))
        b.end_document()
        total, docs = total + len(doc), docs + 1
    b.finalize(str(d / f"{TOK_PREFIX}.idx"))
    subprocess.run([str(BIN), "index", "--quiet", str(d)], check=True)
    print(f"megatron: {total} tokens in {docs} documents ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
    marker.write_text(json.dumps(want))


def gpt_dataset(d: pathlib.Path, L: int):
    """megatron-core's GPTDataset over the whole prefix (random_seed 1, one epoch)."""
    import numpy as np
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    class Tok:
        vocab_size, eod, pad, unique_identifiers = 1 << 20, 0, -1, {"class": "bench"}

    cfg = GPTDatasetConfig(random_seed=1, sequence_length=L, tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, create_attention_mask=False, path_to_cache=str(d / "cache"))
    prefix = str(d / TOK_PREFIX)
    ds = IndexedDataset(prefix)
    return GPTDataset(ds, prefix, np.arange(len(ds.sequence_lengths), dtype=np.int32), None, Split.train, cfg)


# ----------------------------------------------------------------------------- one loader, one run


def token_model():
    import torch

    class M(torch.nn.Module):  # Embedding + mean over the sequence + Linear
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 1)

        def forward(self, t):
            return self.head(self.emb(t).mean(dim=1))

    return M()


def mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, 1))


def model_step(make_model=None):
    """The fixed training step (forward, backward, SGD) on a fresh model (default: the MLP over
    x[DIM]); built before any loader opens, so no first-batch time includes it."""
    import torch

    torch.manual_seed(0)
    model = (make_model or mlp)()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()

    return step


def train_loop(batches, a: argparse.Namespace, to_x, step, t_open: float, check=None) -> dict:
    """Runs `step` on every batch of `batches` (opened at `t_open`): the first batch's time, a
    warm-up of at least `a.warmup_seconds` after it and `a.warmup` batches, then a timed window
    of at least `a.seconds` and `a.measure` batches (samples/s over that window)."""
    it = iter(batches)
    perf = time.perf_counter

    def take():
        try:
            return to_x(next(it))
        except StopIteration:
            raise SystemExit("the loader ended before the windows did (more data, or fewer --warmup/--measure/--seconds)") from None

    x = take()
    t_first = perf()
    if check:
        check(x)
    step(x)
    warm = 1
    while warm < a.warmup or perf() - t_first < a.warmup_seconds:
        step(take())
        warm += 1
    t_warm = perf() - t_first
    samples = n = 0
    wait = stepped = step_cpu = 0.0
    cpu = time.thread_time
    (busy0, steal0), ivcsw0, own0 = host_cpu_s(), thread_ivcsw(), time.process_time()
    t0 = c = perf()
    while True:
        b0 = c
        x = take()
        b1 = perf()
        s0 = cpu()
        step(x)
        step_cpu += cpu() - s0
        c = perf()
        wait += b1 - b0
        stepped += c - b1
        samples += x.shape[0]
        n += 1
        if n >= a.measure and c - t0 >= a.seconds:
            break
    el = c - t0
    (busy, steal), ivcsw, own = host_cpu_s(), thread_ivcsw(), time.process_time()
    busy, steal, ivcsw, own = busy - busy0, steal - steal0, ivcsw - ivcsw0, own - own0
    return {"samples": samples, "batches": n, "seconds": el, "samples_per_s": samples / el, "wait_s": wait, "step_s": stepped,
            "step_cpu_s": step_cpu, "host_busy_s": busy, "host_steal_s": steal, "process_cpu_s": own,
            "involuntary_switches": ivcsw,
            "first_batch_s": t_first - t_open, "warmup_batches": warm, "warmup_s": t_warm}


def host_cpu_s() -> tuple[float, float]:
    """Seconds all CPUs of this host spent busy so far (/proc/stat: user, nice, system, irq,
    softirq) and stolen by the hypervisor (steal)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / hz, f[7] / hz


def thread_ivcsw() -> int:
    """Times the calling thread was preempted so far (involuntary context switches)."""
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Epochs:
    """Endless batches over epochs: `make(epoch, skip)` gives epoch `epoch`'s batches from its
    batch `skip` on. `pos`: (epoch, batches of it taken) after the last batch handed out."""

    def __init__(self, make, pos=(0, 0)):
        self.make, self.pos = make, tuple(pos)

    def __iter__(self):
        e, k = self.pos
        while True:
            for b in self.make(e, k):
                k += 1
                self.pos = (e, k)
                yield b
            e, k = e + 1, 0


def shard_rows(data: pathlib.Path) -> list[int]:
    """Rows per record batch (= shard) of the Arrow files, in storage order (metadata only)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    rows = []
    for p in sorted((data / "arrow").glob("*.arrow")):
        r = ipc.open_file(pa.memory_map(str(p), "r"))
        rows += [r.get_batch(i).num_rows for i in range(r.num_record_batches)]
    return rows


def block_batches(rows: list[int], seed: int, epoch: int, S: int, B: int, skip: int = 0):
    """One epoch of the two-level block shuffle as batches of B global sample indices (storage
    positions), drop_last, from batch `skip` on: numpy PCG64 seeded with (seed, epoch) permutes
    the shards, the permuted shards are cut into blocks closed at the first shard end at or past
    S samples, and each block's samples are permuted; batches run across block edges."""
    import numpy as np

    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    perm = rng.permutation(len(rows))
    todo = skip * B  # samples before the first batch wanted: their blocks are shuffled (the rng is sequential), not yielded
    pending = np.empty(0, np.int64)
    i = 0
    while i < len(perm):
        j, n = i, 0
        while j < len(perm) and n < S:
            n += rows[perm[j]]
            j += 1
        blk = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in perm[i:j]])
        rng.shuffle(blk)
        i = j
        if todo >= len(blk):
            todo -= len(blk)
            continue
        blk, todo = blk[todo:], 0
        pending = np.concatenate([pending, blk]) if len(pending) else blk
        k = 0
        while len(pending) - k >= B:
            yield pending[k:k + B]
            k += B
        pending = pending[k:]


class _Unmap:
    """Owns one mmap(2) region; unmapped when the last buffer over it is gone."""

    def __init__(self, libc, addr: int, size: int):
        self.libc, self.addr, self.size = libc, addr, size

    def __del__(self):
        self.libc.munmap(self.addr, self.size)


class MmapArrow:
    """The Arrow IPC files memory-mapped read-only, zero-copy, with one gather per column per batch.

    All files are mapped (mmap(2), PROT_READ, MAP_SHARED) into one contiguous address range, so
    that one numpy view spans the whole dataset; pyarrow's IPC reader opens each file over its
    part of the range (`pa.foreign_buffer` + `ipc.open_file`) and gives the address of every
    record batch's `id` and `x` buffers. `x` rows (1 KiB each, 4-byte aligned) are addressed
    through an overlapping float32 row view of the range (`as_strided`, row stride 4 bytes), so
    `gather(idx)` is `xrows[xoff[idx]]`: one fancy-index gather of whole rows, whichever shard or
    file each row lives in (plus one of the int64 ids). Linux (mmap with MAP_FIXED)."""

    def __init__(self, data: pathlib.Path):
        import ctypes
        import mmap

        import numpy as np
        import pyarrow as pa
        import pyarrow.ipc as ipc

        paths = sorted((data / "arrow").glob("*.arrow"))
        page = mmap.PAGESIZE
        sizes = [p.stat().st_size for p in paths]
        spans = [-(-s // page) * page for s in sizes]
        total = sum(spans)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        MAP_FIXED, MAP_NORESERVE, PROT_NONE, FAILED = 0x10, 0x4000, 0, ctypes.c_void_p(-1).value
        base = libc.mmap(None, total, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, FAILED):
            raise OSError(ctypes.get_errno(), "mmap: cannot reserve the address range")
        owner = _Unmap(libc, base, total)  # from here the range is unmapped when the buffer goes
        off = 0
        for p, span in zip(paths, spans):
            fd = os.open(p, os.O_RDONLY)
            try:
                if libc.mmap(base + off, span, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0) != base + off:
                    raise OSError(ctypes.get_errno(), f"mmap {p}")
            finally:
                os.close(fd)
            off += span
        whole = pa.foreign_buffer(base, total, base=owner)
        xoff, idoff, self.rows = [], [], []
        off = 0
        for size, span in zip(sizes, spans):
            r = ipc.open_file(whole.slice(off, size))
            for i in range(r.num_record_batches):
                rb = r.get_batch(i)
                ids, x = rb.column("id"), rb.column("x")
                assert ids.null_count == 0 and x.null_count == 0 and x.type.list_size == DIM
                ia = ids.buffers()[1].address + 8 * ids.offset - base
                xa = x.values.buffers()[1].address + 4 * (x.values.offset + DIM * x.offset) - base
                assert ia % 8 == 0 and xa % 4 == 0 and 0 <= xa < total, (ia, xa)
                idoff.append(ia // 8 + np.arange(rb.num_rows, dtype=np.int64))
                xoff.append(xa // 4 + DIM * np.arange(rb.num_rows, dtype=np.int64))
                self.rows.append(rb.num_rows)
            off += span
        self.xoff, self.idoff = np.concatenate(xoff), np.concatenate(idoff)
        u8 = np.frombuffer(whole, dtype=np.uint8)
        f32 = u8.view(np.float32)
        self.ids = u8.view(np.int64)
        self.xrows = np.lib.stride_tricks.as_strided(f32, shape=(len(f32) - DIM + 1, DIM), strides=(4, 4), writeable=False)
        n = len(self.xoff)
        assert self.ids[self.idoff[0]] == 0 and self.ids[self.idoff[n - 1]] == n - 1, "id != storage position"

    def __len__(self) -> int:
        return len(self.xoff)

    def gather(self, idx):
        """(ids [len(idx)] int64, x [len(idx), DIM] float32), new arrays."""
        return self.ids[self.idoff[idx]], self.xrows[self.xoff[idx]]


class Loader:
    """One loader: `open(state)` (None: fresh) gives its endless batches, `state()` the position
    after the last batch taken (None: the loader has no resume), `close()` ends it, `to_x` maps a
    batch to the float32 [B, DIM] tensor of the model step. `imports`: its modules, imported
    before the first-batch clock starts (module imports are process start-up, not opening)."""

    imports = ("numpy", "pyarrow", "pyarrow.ipc", "ctypes", "mmap")

    def __init__(self, a: argparse.Namespace):
        import numpy
        import torch

        self.a, self.data, self.it = a, pathlib.Path(a.data), None
        self.np, self.torch = numpy, torch

    def open(self, state=None):
        raise NotImplementedError

    def state(self):
        return list(self.it.pos) if isinstance(self.it, Epochs) else None

    def close(self):
        self.it = None
        import gc

        gc.collect()

    def to_x(self, b):
        return b["x"]


class Shardwire(Loader):
    imports = ("shardwire",)

    def open(self, state=None):
        import shardwire

        a = self.a
        self.stream = shardwire.connect(a.socket).open_stream(DATASET, seed=1, batch_size=a.batch, shuffle="block", shuffle_block=a.shuffle_block,
                                                              drop_last=True, epochs=a.epochs, state=state)
        return self.stream

    def state(self):
        return self.stream.state_dict()

    def close(self):
        self.stream.close()

    def to_x(self, b):
        return self.torch.from_numpy(self.np.asarray(b["x"]))  # read-only zero-copy view; the model only reads it


class ShardwireTorch(Loader):
    imports = ("shardwire.torch",)

    def open(self, state=None):
        import torch
        from shardwire.torch import IterableDataset

        a = self.a
        self.ds = IterableDataset(DATASET, socket=a.socket, seed=1, batch_size=a.batch, shuffle="block", shuffle_block=a.shuffle_block,
                                  drop_last=True, epochs=a.epochs)
        if state is not None:
            self.ds.load_state_dict(state)
        self.it = iter(torch.utils.data.DataLoader(self.ds, batch_size=None, num_workers=0))
        return self.it

    def state(self):
        return self.ds.state_dict()


class NumpyMmapGather(Loader):
    def open(self, state=None):
        a = self.a
        m = MmapArrow(self.data)

        def epoch(e, skip):
            for idx in block_batches(m.rows, 1, e, a.shuffle_block, a.batch, skip):
                yield m.gather(idx)

        self.it = Epochs(epoch, state or (0, 0))
        return self.it

    def to_x(self, b):
        return self.torch.from_numpy(b[1])


def _identity(b):
    return b


def _getitems_dataset():
    import numpy as np
    import torch

    class GetItems(torch.utils.data.Dataset):
        """Map-style: `__getitems__(indices)` gathers a whole batch (each process maps the files
        on first use); `__getitem__` for one sample."""

        def __init__(self, data: pathlib.Path, n: int):
            self.data, self.n, self.m = data, n, None

        def __len__(self):
            return self.n

        def __getstate__(self):
            return {**self.__dict__, "m": None}

        def __getitems__(self, indices):
            if self.m is None:
                self.m = MmapArrow(self.data)
            ids, x = self.m.gather(np.asarray(indices, dtype=np.int64))
            return {"id": torch.from_numpy(ids), "x": torch.from_numpy(x)}

        def __getitem__(self, i):
            b = self.__getitems__([i])
            return {k: v[0] for k, v in b.items()}

    class BlockBatchSampler(torch.utils.data.Sampler):
        """Batches of block-shuffled indices (`block_batches`), one numpy array per batch."""

        def __init__(self, rows, seed, S, B):
            self.rows, self.seed, self.S, self.B, self.epoch, self.skip = rows, seed, S, B, 0, 0

        def set_epoch(self, epoch, skip=0):
            self.epoch, self.skip = epoch, skip

        def __len__(self):
            return sum(self.rows) // self.B - self.skip

        def __iter__(self):
            return block_batches(self.rows, self.seed, self.epoch, self.S, self.B, self.skip)

    return GetItems, BlockBatchSampler


class TorchGetItems(Loader):
    workers = 0

    def open(self, state=None):
        import torch

        a = self.a
        GetItems, BlockBatchSampler = _getitems_dataset()
        rows = shard_rows(self.data)
        W = a.workers if self.workers else 0
        sampler = BlockBatchSampler(rows, 1, a.shuffle_block, a.batch)
        ds = GetItems(self.data, sum(rows))
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=_identity, num_workers=W, persistent_workers=W > 0)

        def epoch(e, skip):
            sampler.set_epoch(e, skip)
            return iter(loader)

        self.it = Epochs(epoch, state or (0, 0))
        return self.it


class TorchGetItemsWorkers(TorchGetItems):
    workers = 1


class TorchArrow(Loader):
    def open(self, state=None):
        import numpy as np
        import torch

        a, data = self.a, self.data

        class ArrowMap(torch.utils.data.Dataset):
            def __init__(self, rows):
                self.parts = None
                self.starts = np.cumsum([0] + rows)

            def _open(self):  # per process (after the fork): memory-mapped, zero-copy views
                self.parts = list(arrow_batches(data))

            def __len__(self):
                return int(self.starts[-1])

            def __getitem__(self, i):
                if self.parts is None:
                    self._open()
                k = int(np.searchsorted(self.starts, i, side="right")) - 1
                ids, x = self.parts[k]
                j = i - int(self.starts[k])
                return {"id": int(ids[j]), "x": torch.from_numpy(x[j].copy())}

        class PermSampler(torch.utils.data.Sampler):
            """RandomSampler's full permutation, seeded per epoch, from sample `skip` on."""

            def __init__(self, n):
                self.n, self.epoch, self.skip = n, 0, 0

            def __len__(self):
                return self.n - self.skip

            def __iter__(self):
                g = torch.Generator().manual_seed(1_000_003 + self.epoch)
                return iter(torch.randperm(self.n, generator=g)[self.skip:].tolist())

        ds = ArrowMap(shard_rows(data))
        sampler = PermSampler(len(ds))
        W = a.workers
        loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=W, drop_last=True, persistent_workers=W > 0)

        def epoch(e, skip):
            sampler.epoch, sampler.skip = e, skip * a.batch
            return iter(loader)

        self.it = Epochs(epoch, state or (0, 0))
        return self.it


class Streaming(Loader):
    imports = ("streaming", "streaming.base.util")

    def open(self, state=None):
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        a = self.a
        clean_stale_shared_memory()
        self.ds = StreamingDataset(local=str(self.data / "mds"), remote=None, batch_size=a.batch, shuffle=True, shuffle_algo="py1e",
                                   shuffle_block_size=a.shuffle_block, shuffle_seed=1, num_canonical_nodes=1)
        self.loader = StreamingDataLoader(self.ds, batch_size=a.batch, num_workers=a.workers, drop_last=True, persistent_workers=a.workers > 0)
        if state is not None:
            self.loader.load_state_dict(state)
        self.it = Epochs(lambda e, k: iter(self.loader))
        return self.it

    def state(self):
        return self.loader.state_dict()

    def close(self):
        self.loader = self.ds = None
        super().close()


class WebDataset(Loader):
    imports = ("webdataset",)

    def open(self, state=None):
        import webdataset as wds

        a = self.a
        urls = [str(p) for p in sorted((self.data / "wds").glob("*.tar"))]
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=1, empty_check=False)
              .shuffle(a.shuffle_block).decode().to_tuple("x.npy", "id.cls").batched(a.batch, partial=False))
        loader = wds.WebLoader(ds, batch_size=None, num_workers=a.workers, persistent_workers=a.workers > 0)
        self.it = Epochs(lambda e, k: iter(loader))
        return self.it

    def state(self):
        return None  # no resume API

    def to_x(self, b):
        return b[0] if self.torch.is_tensor(b[0]) else self.torch.from_numpy(b[0])


LOADER_CLASSES = {"shardwire": Shardwire, "shardwire-torch": ShardwireTorch, "numpy-mmap-gather": NumpyMmapGather, "torch-getitems": TorchGetItems,
                  "torch-getitems-workers": TorchGetItemsWorkers, "torch-arrow": TorchArrow, "streaming": Streaming, "webdataset": WebDataset}


def versions() -> dict:
    import numpy
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    for m in ("pyarrow", "streaming", "webdataset"):
        if m in sys.modules:
            v[m] = getattr(sys.modules[m], "__version__", "?")
    return v


def run_loader(name: str, a: argparse.Namespace) -> dict:
    """One loader in this process: fresh open, warm-up, steady-state window, then a resume at the
    position after the window (a new loader object, timed to its first batch)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=".*not writable.*")  # shardwire's read-only views; the model only reads them
    torch.set_num_threads(1)
    cls = LOADER_CLASSES.get(name) or sys.exit(f"unknown loader {name}; known: {', '.join(LOADER_CLASSES)}")
    t_start = time.perf_counter()
    step = model_step()

    def check(x):
        assert x.dtype == torch.float32 and tuple(x.shape) == (a.batch, DIM), (x.dtype, x.shape)

    sys.path.insert(0, str(SDK_SRC))
    for m in cls.imports:
        importlib.import_module(m)
    ld = cls(a)
    t_open = time.perf_counter()
    res = train_loop(ld.open(), a, ld.to_x, step, t_open, check)
    state = ld.state()
    ld.close()
    res["resume_at"] = {k: state[k] for k in ("epoch", "index") if k in state} if isinstance(state, dict) and "index" in state else state
    res["resume_first_batch_s"] = None
    if state is not None:
        ld = cls(a)
        t = time.perf_counter()
        check(ld.to_x(next(iter(ld.open(state)))))
        res["resume_first_batch_s"] = time.perf_counter() - t
        ld.close()
    res.update(loader=name, total_s=time.perf_counter() - t_start, versions=versions())
    return res


def run_token_loader(name: str, a: argparse.Namespace) -> dict:
    """One token loader into the token model; saves its first batch (L+1 tokens) to --first."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    B, L = a.batch, a.seq_len
    first: list = []

    def to_x(t):  # t: [B, L+1] int64
        assert t.dtype == torch.int64 and tuple(t.shape) == (B, L + 1), (t.dtype, t.shape)
        if not first:
            first.append(t.numpy().copy())
        return t[:, :-1]

    t_start = time.perf_counter()
    step = model_step(token_model)
    t_open = time.perf_counter()
    if name == "megatron":
        loader = torch.utils.data.DataLoader(gpt_dataset(pathlib.Path(a.data), L), batch_size=B, num_workers=a.workers, shuffle=False, drop_last=True)
        res = train_loop(loader, a, lambda b: to_x(torch.cat([b["tokens"], b["labels"][:, -1:]], dim=1)), step, t_open)
    elif name in ("shardwire", "shardwire-megatron"):
        sys.path.insert(0, str(SDK_SRC))
        import shardwire

        order = {"order": "megatron"} if name == "shardwire-megatron" else {"shuffle": "block"}
        stream = shardwire.connect(a.socket).open_stream(TOK_DATASET, seed=1, batch_size=B, seq_len=L, drop_last=True, token_dtype="int64", **order)
        import warnings

        warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only zero-copy view; the model only reads it
        res = train_loop(stream, a, lambda b: to_x(torch.from_numpy(np.asarray(b["tokens"]))), step, t_open)
        stream.close()
    else:
        raise SystemExit(f"unknown token loader {name}")
    np.save(a.first, first[0])
    res.update(loader=name, total_s=time.perf_counter() - t_start, tokens_per_s=res["samples_per_s"] * (L + 1))
    return res


# ----------------------------------------------------------------------------- children


class Child:
    def __init__(self, args: list[str], log: pathlib.Path) -> None:
        self.args = args
        self._err = open(log, "wb")
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}
        env.update(RUST_LOG="warn", NO_COLOR="1")
        # BENCH_NODE_ENV pins the node to host memory, host receive and one lane, more than
        # tests/e2e's `child_env` (it pins only SHARDWIRE_MEMORY=host): on a GPU host `auto`
        # would put the streams in GPU memory, make one lane per GPU, and (as root, beside a
        # devmem NIC) set the real NIC up for this loopback run. A source ignores these keys.
        env.update(BENCH_NODE_ENV)
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, pattern: re.Pattern[str], timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = pattern.search(line)
                if m:
                    return m
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"{self.args[1]} did not become ready: {self.lines}\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._err.close()


#: `taskset -c CPUS` prefixes of the node's processes and of each loader's process
#: (`--node-cpus`, `--trainer-cpus`; empty: unpinned, the default).
PIN: dict[str, list[str]] = {"node": [], "trainer": []}


def start_node(data: pathlib.Path, tmp: pathlib.Path, children: list[Child], stream_memory: int = 256 << 20, spec: str | None = None) -> tuple[str, str]:
    import http.client

    pin = PIN["node"]
    src = Child([*pin, str(BIN), "source", "--listen", "127.0.0.1:0", "--dataset", spec or f"{DATASET}={data / 'arrow'}"], tmp / "source.log")
    children.append(src)
    addr = src.wait(SOURCE_READY).group(1)
    serve = Child([*pin, str(BIN), "serve", "--source", addr, "--socket", str(tmp / "sw.sock"), "--data-listen", "127.0.0.1:0",
                   "--admin", "127.0.0.1:0", "--pool-size", str(4 * stream_memory), "--stream-memory", str(stream_memory)], tmp / "serve.log")
    children.append(serve)
    m = serve.wait(SERVE_READY)
    sock, admin = m.group(1), m.group(2)
    deadline = time.monotonic() + 60
    while True:
        c = http.client.HTTPConnection(admin, timeout=10)
        c.request("GET", "/v1/status")
        st = json.loads(c.getresponse().read())
        c.close()
        if any(s["up"] for s in st["sources"]):
            break
        if time.monotonic() > deadline:
            raise SystemExit("the source never came up")
        time.sleep(0.05)
    print(f"node: serve pid {serve.p.pid}, source pid {src.p.pid}, socket {sock}", file=sys.stderr)
    return sock, admin


def run_one(py: pathlib.Path, loader: str, args: list[str]) -> dict:
    """One loader in its own process (`--one LOADER`); its last JSON line."""
    pin = PIN["trainer"]
    r = subprocess.run([*pin, str(py), __file__, "--one", loader, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{loader} failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])


def cpu_model() -> str:
    return next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())


CPU_FLAGS = ("sse4_2", "pclmulqdq", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "vpclmulqdq", "erms", "fsrm", "amx_tile",
             "asimd", "sve", "hypervisor")


def cpu_line() -> str:
    """The CPU model, CPU count, the flags that matter to numpy/torch (SIMD) and to the node
    (CRC-32C: sse4_2, pclmulqdq, vpclmulqdq; copies: erms, fsrm), and the load."""
    flags: set[str] = set()
    for l in open("/proc/cpuinfo"):
        if l.startswith(("flags", "Features")):
            flags = set(l.split(":", 1)[1].split())
            break
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, flags {' '.join(f for f in CPU_FLAGS if f in flags) or '-'}; load average {load}"


# ----------------------------------------------------------------------------- shuffle quality


def quality(order, shard_of, B: int) -> dict:
    import numpy as np

    n = len(order)
    pos = np.arange(n)
    disp = float(np.abs(order - pos).mean() / n)
    sh = shard_of[order]
    m = (n // B) * B
    per_batch = sh[:m].reshape(-1, B)
    srt = np.sort(per_batch, axis=1)
    distinct = float((1 + (np.diff(srt, axis=1) != 0).sum(axis=1)).mean())
    adj = float((sh[1:] == sh[:-1]).mean())
    return {"mean_abs_displacement": disp, "distinct_shards_per_batch": distinct, "same_shard_adjacent": adj}


def shuffle_quality(a: argparse.Namespace, tmp: pathlib.Path, children: list[Child]) -> None:
    import numpy as np

    if not STREAMING_PY.exists():
        raise SystemExit(f"bench-loaders: --shuffle-quality compares with Streaming's shuffle, run by {STREAMING_PY}, which "
                         "is missing: make it with scripts/streaming-venv (scripts/bench-loaders does)")

    data = pathlib.Path(a.data)
    n, R, B = a.samples, a.shard_rows, a.batch
    shard_sizes = np.full(n // R, R, dtype=np.int64)
    shard_of = np.repeat(np.arange(len(shard_sizes)), shard_sizes)
    # room for the largest block (1 KiB samples) plus prefetch and slabs
    sock, _ = start_node(data, tmp, children, stream_memory=max(256 << 20, 4 * max(a.blocks) * (8 + 4 * DIM)))
    rows = []
    for S in a.blocks:
        out = subprocess.run([str(BIN), "consume", "--socket", sock, "--dataset", DATASET, "--seed", "1", "--batch-size", str(B),
                              "--shuffle", "block", "--shuffle-block", str(S), "--drop-last", "--print-values", "id", "--jsonl"],
                             check=True, capture_output=True, text=True, timeout=600).stdout
        sw = np.array([v for line in out.splitlines() if line.startswith("{")
                       for t in json.loads(line)["tensors"] if t["name"] == "id" for v in t["values"]], dtype=np.int64)
        assert len(sw) == n and len(np.unique(sw)) == n, f"shardwire epoch: {len(sw)} ids, {len(np.unique(sw))} distinct"
        r = subprocess.run([str(STREAMING_PY), "-c",
                            "import sys, numpy as np; from streaming.base.shuffle import get_shuffle_py1e as f; "
                            f"o = f(np.full({len(shard_sizes)}, {R}, dtype=np.int64), 1, 1, 0, {S}); np.save(sys.argv[1], o)",
                            str(tmp / "py1e.npy")], check=True, capture_output=True, text=True)
        py1e = np.load(tmp / "py1e.npy")
        assert len(py1e) == n and len(np.unique(py1e)) == n
        rows.append({"shuffle_block": S, "order": "shardwire block", **quality(sw, shard_of, B)})
        rows.append({"shuffle_block": S, "order": "streaming py1e", **quality(py1e, shard_of, B)})
    rng = np.random.default_rng(0)
    rows.append({"shuffle_block": n, "order": "uniform permutation", **quality(rng.permutation(n), shard_of, B)})
    print(f"\nshuffle quality: {n} samples, {len(shard_sizes)} shards of {R}, batch {B}, seed 1, epoch 0, 1 partition / canonical node")
    print("| shuffle_block (samples) | order | mean |new-old|/N | distinct shards / batch | adjacent same shard |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shuffle_block']} | {r['order']} | {r['mean_abs_displacement']:.4f} | {r['distinct_shards_per_batch']:.2f} | {r['same_shard_adjacent']:.4f} |")
    print(json.dumps({"shuffle_quality": rows}))


# ----------------------------------------------------------------------------- tokens


def tokens_bench(a: argparse.Namespace, tmp: pathlib.Path, children: list[Child]) -> None:
    import numpy as np

    d = pathlib.Path(a.data + "-tokens")
    if a.tok_tokens // a.seq_len // a.batch < a.warmup + a.measure:
        raise SystemExit(f"--tok-tokens {a.tok_tokens} holds fewer than --warmup + --measure batches of {a.batch} x {a.seq_len}")
    prepare_tokens(d, a.tok_tokens)
    sock, _ = start_node(d, tmp, children, spec=f"{TOK_DATASET}={d}")
    loaders = TOK_LOADERS
    results: dict[str, list[dict]] = {l: [] for l in loaders}
    common = ["--tokens", "--data", str(d), "--batch", str(a.batch), "--seq-len", str(a.seq_len), "--workers", str(a.workers),
              "--warmup", str(a.warmup), "--measure", str(a.measure), "--warmup-seconds", str(a.warmup_seconds), "--seconds", str(a.seconds),
              "--socket", sock]
    for rnd in range(a.rounds):
        for l in (loaders if rnd % 2 == 0 else loaders[::-1]):
            first = tmp / f"first-{l}.npy"
            res = run_one(MAIN_PY, l, ["--first", str(first), *common])
            res["round"] = rnd + 1
            results[l].append(res)
            print(f"round {rnd + 1} {l:18s} {res['tokens_per_s']:12.0f} tokens/s  (loader wait {res['wait_s']:.2f} s, "
                  f"model {res['step_s']:.2f} s, process {res['total_s']:.1f} s)", file=sys.stderr, flush=True)
        if rnd == 0:
            assert np.array_equal(np.load(tmp / "first-megatron.npy"), np.load(tmp / "first-shardwire-megatron.npy")), "order=megatron != GPTDataset"
            print("order=megatron matches GPTDataset: first batch equal", file=sys.stderr)
    med = {l: statistics.median(r["tokens_per_s"] for r in v) for l, v in results.items()}
    print(f"\n{a.tok_tokens} tokens (uint16, documents of 200..3000), seq_len {a.seq_len}, batch {a.batch}, token_dtype int64, "
          f"{a.workers} DataLoader workers for megatron, {a.measure} batches timed after {a.warmup}; {cpu_line()}")
    print("| loader | " + " | ".join(f"round {i + 1}" for i in range(a.rounds)) + " | median tokens/s | loader wait share | vs megatron |")
    print("|---|" + "---:|" * (a.rounds + 3))
    for l in loaders:
        v = results[l]
        share = statistics.median(r["wait_s"] / (r["wait_s"] + r["step_s"]) for r in v)
        print(f"| {l} | " + " | ".join(f"{r['tokens_per_s']:.0f}" for r in v) + f" | {med[l]:.0f} | {share:.0%} | {med[l] / med['megatron']:.3f} |")
    print(json.dumps({"bench": "loaders-tokens", "cpu": cpu_model(), "seq_len": a.seq_len, "batch": a.batch, "median_tokens_per_s": med,
                      "ratios_vs_megatron": {l: med[l] / med["megatron"] for l in loaders}, "runs": results}))


def ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def batch_bytes(batch: int) -> int:
    """The bytes of one assembled batch of `batch` rows: the int64 `id` and the 256 float32 of `x`."""
    return batch * (8 + DIM * 4)


def node_gather(admin: str) -> tuple[float, int, float]:
    """The node's assembly time so far (`shardwire_stall_seconds_total{cause="assembly"}`: the
    batch gathers and its receivers' CRC-32C of the received bytes, seconds), its batches
    assembled and the bytes it received from sources (`shardwire_bytes_received_total`), from
    its metrics."""
    import http.client

    c = http.client.HTTPConnection(admin, timeout=10)
    c.request("GET", "/metrics")
    body = c.getresponse().read().decode()
    c.close()
    secs, batches, received = 0.0, 0, 0.0
    for line in body.splitlines():
        if line.startswith("shardwire_stall_seconds_total") and 'cause="assembly"' in line:
            secs += float(line.split()[-1])
        elif line.startswith("shardwire_batches_assembled_total"):
            batches += int(float(line.split()[-1]))
        elif line.startswith("shardwire_bytes_received_total"):
            received += float(line.split()[-1])
    return secs, batches, received


def gather_us(v: list[dict]) -> str:
    """The median over rounds of the node's CRC + gather time per batch it assembled while a
    loader ran (its whole process: warm-up and first batches too; `node_gather_s_per_batch`,
    named before it was known to hold the CRC too), microseconds; "-" for a local one."""
    g = [r["node_gather_s_per_batch"] for r in v if r.get("node_gather_s_per_batch") is not None]
    return f"{statistics.median(g) * 1e6:.0f}" if g else "-"


def received_ratio(v: list[dict]) -> str:
    """The median over rounds of the bytes the node received per byte of the batches it
    assembled while a loader ran; "-" for a local one."""
    g = [r["node_received_per_assembled"] for r in v if r.get("node_received_per_assembled") is not None]
    return f"{statistics.median(g):.2f}" if g else "-"


def loaders_bench(a: argparse.Namespace, tmp: pathlib.Path, children: list[Child]) -> None:
    """The loaders, each in its own process per round; per-round lines on stderr, the summary
    (steady state, time to the first batch, shardwire against the fastest local loader) and one
    JSON line on stdout."""
    sock, admin = start_node(pathlib.Path(a.data), tmp, children, stream_memory=a.stream_memory << 20)
    loaders = a.loaders.split(",")
    unknown = [l for l in loaders if l not in LOADER_CLASSES]
    if unknown:
        raise SystemExit(f"unknown loader(s) {', '.join(unknown)}; known: {', '.join(LOADER_CLASSES)}")
    results: dict[str, list[dict]] = {l: [] for l in loaders}
    common = ["--data", a.data, "--batch", str(a.batch), "--shuffle-block", str(a.shuffle_block), "--workers", str(a.workers),
              "--warmup", str(a.warmup), "--measure", str(a.measure), "--warmup-seconds", str(a.warmup_seconds), "--seconds", str(a.seconds),
              "--epochs", str(a.epochs), "--socket", sock]
    print(cpu_line(), file=sys.stderr, flush=True)
    for rnd in range(a.rounds):
        for l in (loaders if rnd % 2 == 0 else loaders[::-1]):
            before = node_gather(admin)
            res = run_one(STREAMING_PY if l == "streaming" else MAIN_PY, l, common)
            res["round"] = rnd + 1
            after = node_gather(admin)
            batches = after[1] - before[1]
            # The node's CRC + gather time per batch (the key is older than the knowledge that the
            # assembly counter holds the receivers' CRC too; kept for readers of the JSON).
            res["node_gather_s_per_batch"] = (after[0] - before[0]) / batches if l.startswith("shardwire") and batches else None
            # Bytes the node received per byte of the batches it assembled (rows of an int64 id
            # and 256 float32): near 1 when every epoch fetches the rows again, near 0 once they
            # stay resident.
            assembled = batches * batch_bytes(a.batch)
            res["node_received_per_assembled"] = (after[2] - before[2]) / assembled if l.startswith("shardwire") and batches else None
            results[l].append(res)
            print(f"round {rnd + 1} {l:22s} {res['samples_per_s']:10.0f} samples/s over {res['seconds']:.1f} s ({res['batches']} batches; "
                  f"loader wait {res['wait_s']:.2f} s, model {res['step_s']:.2f} s ({res['step_cpu_s']:.2f} s on CPU, "
                  f"{res['involuntary_switches']} preemptions); host busy {res['host_busy_s']:.2f} s, steal {res['host_steal_s']:.2f} s; warm-up {res['warmup_batches']} batches "
                  f"{res['warmup_s']:.1f} s); first batch {ms(res['first_batch_s'])} ms fresh, {ms(res['resume_first_batch_s'])} ms resumed; "
                  f"process {res['total_s']:.1f} s", file=sys.stderr, flush=True)
    R = a.rounds
    med = {l: statistics.median(r["samples_per_s"] for r in v) for l, v in results.items()}

    def med_of(l, k):
        v = [r[k] for r in results[l] if r[k] is not None]
        return statistics.median(v) if v else None

    local = [l for l in loaders if not l.startswith("shardwire")]
    best = max(local, key=lambda l: med[l]) if local else None
    vers = {k: v for rs in results.values() for r in rs for k, v in r.get("versions", {}).items()}
    print(f"\nsteady state: {a.samples} samples x {DIM} float32 + int64 id (1032 B rows), shards of {a.shard_rows}, batch {a.batch}, shuffle_block "
          f"{a.shuffle_block}, {a.workers} workers where a loader has workers; each window at least {a.seconds:g} s and {a.measure} "
          f"batches after a warm-up of at least {a.warmup_seconds:g} s and {a.warmup} batches; {R} rounds")
    print(cpu_line() + "; " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    vs = f"vs fastest local ({best})" if best else "vs fastest local"
    print("| loader | " + " | ".join(f"round {i + 1}" for i in range(R)) + f" | median samples/s | loader wait share | {vs} |")
    print("|---|" + "---:|" * (R + 3))
    for l in loaders:
        v = results[l]
        share = statistics.median(r["wait_s"] / (r["wait_s"] + r["step_s"]) for r in v)
        ratio = f"{med[l] / med[best]:.3f}" if best else "-"
        print(f"| {l} | " + " | ".join(f"{r['samples_per_s']:.0f}" for r in v) + f" | {med[l]:.0f} | {share:.0%} | {ratio} |")
    print("\nwhere the time went, per batch (medians of the rounds): the loop's wait for the batch and the model step (wall and "
          "on-CPU), the training thread's preemptions, and CPU spent outside the training process (the node's processes, "
          "DataLoader workers, anything else on the host)")
    print("| loader | wait, us | model step, us | step on CPU, us | preemptions | CPU outside the trainer, us | node CRC+gather, us "
          "| bytes the node received / assembled |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for l in loaders:
        v = results[l]

        def per(f):
            return statistics.median(f(r) / r["batches"] for r in v)

        print(f"| {l} | {per(lambda r: r['wait_s']) * 1e6:.0f} | {per(lambda r: r['step_s']) * 1e6:.0f} | "
              f"{per(lambda r: r['step_cpu_s']) * 1e6:.0f} | {per(lambda r: r['involuntary_switches']):.2f} | "
              f"{per(lambda r: r['host_busy_s'] - r['process_cpu_s']) * 1e6:.0f} | {gather_us(v)} | {received_ratio(v)} |")
    print("\ntime to the first batch, ms (fresh: open/attach -> first batch in a new process; resumed: re-opened at the position "
          "saved after the window -> first batch)")
    print("| loader | " + " | ".join(f"fresh r{i + 1}" for i in range(R)) + " | median fresh | "
          + " | ".join(f"resumed r{i + 1}" for i in range(R)) + " | median resumed |")
    print("|---|" + "---:|" * (2 * R + 2))
    for l in loaders:
        v = results[l]
        print(f"| {l} | " + " | ".join(ms(r["first_batch_s"]) for r in v) + f" | {ms(med_of(l, 'first_batch_s'))} | "
              + " | ".join(ms(r["resume_first_batch_s"]) for r in v) + f" | {ms(med_of(l, 'resume_first_batch_s'))} |")
    summary: dict[str, dict] = {}
    if best:
        print(f"\nfastest local loader (median steady-state samples/s): {best}, {med[best]:.0f} samples/s")
        for l in loaders:
            if not l.startswith("shardwire"):
                continue
            rr = [results[l][i]["samples_per_s"] / results[best][i]["samples_per_s"] for i in range(R)]
            fastest = [max(local, key=lambda x: results[x][i]["samples_per_s"]) for i in range(R)]
            rf = [results[l][i]["samples_per_s"] / results[fastest[i]][i]["samples_per_s"] for i in range(R)]
            summary[l] = {"vs": best, "per_round": rr, "median": statistics.median(rr), "ratio_of_medians": med[l] / med[best],
                          "per_round_vs_round_fastest": rf, "round_fastest": fastest,
                          "first_batch_s": med_of(l, "first_batch_s"), "resume_first_batch_s": med_of(l, "resume_first_batch_s")}
            print(f"{l} / {best} steady state per round: {', '.join(f'{x:.3f}' for x in rr)} (median {statistics.median(rr):.3f}; "
                  f"ratio of medians {med[l] / med[best]:.3f}); against each round's fastest local: "
                  + ", ".join(f"{x:.3f} ({f})" for x, f in zip(rf, fastest)))
            wait = [results[l][i]["wait_s"] / results[l][i]["batches"] / (results[best][i]["wait_s"] / results[best][i]["batches"])
                    for i in range(R)]
            summary[l]["wait_per_batch_vs_best"] = wait
            print(f"{l} / {best} loader wait per batch, per round: {', '.join(f'{x:.2f}' for x in wait)} "
                  f"(median {statistics.median(wait):.2f}; below 1: the trainer waited less for {l})")
            print(f"{l} first batch: {ms(med_of(l, 'first_batch_s'))} ms fresh, {ms(med_of(l, 'resume_first_batch_s'))} ms resumed "
                  f"(medians; {best}: {ms(med_of(best, 'first_batch_s'))} ms fresh, {ms(med_of(best, 'resume_first_batch_s'))} ms resumed)")
    print(json.dumps({"bench": "loaders", "cpu": cpu_model(), "cpu_line": cpu_line(), "versions": vers,
                      "params": {k: getattr(a, k) for k in ("samples", "shard_rows", "files", "batch", "shuffle_block", "workers", "warmup",
                                                            "warmup_seconds", "measure", "seconds", "rounds")},
                      "median_samples_per_s": med, "fastest_local": best,
                      "ratios_vs_fastest_local": {l: med[l] / med[best] for l in loaders} if best else {},
                      "shardwire_vs_fastest_local": summary,
                      "median_first_batch_s": {l: med_of(l, "first_batch_s") for l in loaders},
                      "median_resume_first_batch_s": {l: med_of(l, "resume_first_batch_s") for l in loaders}, "runs": results}))


# ----------------------------------------------------------------------------- driver


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring (scripts/bench_loaders.py) for the "
                                "method: windows, loaders, resume.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=262144)
    p.add_argument("--shard-rows", type=int, default=4096)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="default 256 (8 with --tokens)")
    p.add_argument("--shuffle-block", type=int, default=32768)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of torch-getitems-workers, torch-arrow, streaming, webdataset "
                   "(and megatron with --tokens)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up: at least this many batches (default 300; 20 with --tokens)")
    p.add_argument("--warmup-seconds", type=float, default=None, help="warm-up: and at least this long after the first batch "
                   "(default 1; 0 with --tokens)")
    p.add_argument("--measure", type=int, default=None, help="timed window: at least this many batches (default 0; 300 with --tokens)")
    p.add_argument("--seconds", type=float, default=None, help="timed window: and at least this long (default 3; 0 with --tokens)")
    p.add_argument("--epochs", type=int, default=10000, help="epochs of the shardwire streams (the windows run as many as they need)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loaders", default=",".join(LOADERS), help="comma-separated, of: %(default)s")
    p.add_argument("--data", default=os.environ.get("BENCH_LOADERS_DATA", "/tmp/sw-bench-loaders-data"))
    p.add_argument("--shuffle-quality", action="store_true")
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    p.add_argument("--tokens", action="store_true", help="token mode: megatron GPTDataset vs shardwire token stream")
    p.add_argument("--tok-tokens", type=int, default=32_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--stream-memory", type=int, default=256, help="the shardwire stream's region, MiB (default 256, a little "
                   "under the default dataset's 258 MiB of rows plus framing: rows that do not stay resident are fetched "
                   "again each epoch)")
    p.add_argument("--node-cpus", help="run the node's processes on these CPUs (taskset -c list; default: unpinned)")
    p.add_argument("--trainer-cpus", help="run each loader's process on these CPUs (taskset -c list; default: unpinned)")
    p.add_argument("--first", help=argparse.SUPPRESS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--write-mds", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.batch = a.batch or (8 if a.tokens else 256)
    for k, samples_mode, tokens_mode in (("warmup", 300, 20), ("warmup_seconds", 1.0, 0.0), ("measure", 0, 300), ("seconds", 3.0, 0.0)):
        if getattr(a, k) is None:
            setattr(a, k, tokens_mode if a.tokens else samples_mode)
    PIN["node"] = ["taskset", "-c", a.node_cpus] if a.node_cpus else []
    PIN["trainer"] = ["taskset", "-c", a.trainer_cpus] if a.trainer_cpus else []
    if a.write_mds:
        write_mds(pathlib.Path(a.write_mds), a.shard_rows)
        return
    if a.one:
        print(json.dumps((run_token_loader if a.tokens else run_loader)(a.one, a)), flush=True)
        return

    if not a.tokens:
        prepare(pathlib.Path(a.data), a.samples, a.shard_rows, a.files, forms_for(a))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sw-bench-loaders-"))
    children: list[Child] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if a.tokens:
            tokens_bench(a, tmp, children)
        elif a.shuffle_quality:
            shuffle_quality(a, tmp, children)
        else:
            loaders_bench(a, tmp, children)
    finally:
        for c in reversed(children):
            c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
