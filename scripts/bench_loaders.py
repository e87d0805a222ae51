#!/usr/bin/env python3
"""Data loaders into a torch training loop: samples/s of shardwire (batch mode, over TCP on
loopback) against local-disk peers: torch DataLoader over a memory-mapped Arrow IPC file,
MosaicML Streaming (local MDS) and WebDataset (local tars). Also a shuffle-quality mode.

Run through scripts/bench-loaders (it makes .venv-streaming and builds the release binary):

    scripts/bench-loaders [--samples 262144] [--rounds 3] [--batch 256] [--shuffle-block 32768]
    scripts/bench-loaders --shuffle-quality [--samples 262144]
    scripts/bench-loaders --tokens [--tok-tokens 32000000] [--seq-len 2048] [--batch 8] [--rounds 3]

One dataset of N samples (int64 `id` = storage position, float32 `x[256]`), written once as
Arrow IPC files (record batches of --shard-rows rows = shardwire shards), as MDS shards and as
tar shards of the same rows. Each loader runs in its own subprocess per round (Streaming with
.venv-streaming's python), rounds alternate the loaders, and every loader's batch goes through
the same tiny model step (Linear(256,256)+ReLU+Linear(256,1), forward, backward, SGD, CPU,
torch.set_num_threads(1)). samples/s counts --measure batches after --warmup batches.

--tokens: one Megatron dataset (.bin/.idx written by megatron-core's IndexedDatasetBuilder,
uint16, documents of 200..3000 random tokens < 50000 each ending in EOD 0), read as windows
of --seq-len + 1 tokens by megatron-core's GPTDataset in a torch DataLoader (local files,
--workers workers, create_attention_mask=False) and by shardwire's token stream (block
shuffle, and order="megatron"), token_dtype int64. Each batch goes through Embedding(50000,
64) + mean + Linear(64,1) on tokens[:, :-1]; tokens/s = batches * B * (L+1) / time. The first
batch of order="megatron" is checked equal to GPTDataset's. SHARDWIRE_BIN overrides the binary.
"""

from __future__ import annotations

import argparse
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
MAIN_PY = REPO / ".venv" / "bin" / "python"
STREAMING_PY = REPO / ".venv-streaming" / "bin" / "python"
BIN = pathlib.Path(os.environ.get("SHARDWIRE_BIN") or pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "shardwire")
DIM = 256
DATASET = "bench"
SOURCE_READY = re.compile(r"source listening on (\S+)")
SERVE_READY = re.compile(r"node service ready: socket (\S+) admin http://(\S+)")
LOADERS = ["shardwire", "shardwire-torch", "torch-arrow", "streaming", "webdataset"]
TOK_LOADERS = ["megatron", "shardwire", "shardwire-megatron"]
TOK_DATASET, TOK_PREFIX, VOCAB = "gpt", "corpus_text_document", 50000


# ----------------------------------------------------------------------------- dataset


def prepare(data: pathlib.Path, n: int, shard_rows: int, files: int) -> None:
    """Write the three on-disk forms once (a marker file records the parameters)."""
    marker = data / "params.json"
    want = {"n": n, "shard_rows": shard_rows, "files": files, "dim": DIM, "v": 1}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return
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
    t = time.perf_counter()
    subprocess.run([str(STREAMING_PY), __file__, "--write-mds", str(data), "--shard-rows", str(shard_rows)], check=True)
    print(f"mds: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    write_wds(data, shard_rows)
    print(f"webdataset: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    marker.write_text(json.dumps(want))


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


def train_loop(batches, warmup: int, measure: int, to_x, make_model=None) -> dict:
    """Runs the fixed model step on every batch; times `measure` batches after `warmup`.
    `make_model` (default: the MLP over x[DIM]) builds the model `to_x`'s tensors go into."""
    import torch

    torch.manual_seed(0)
    model = make_model() if make_model else torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    it = iter(batches)
    samples = 0
    wait = step = 0.0
    t0 = None
    ids_seen = 0
    for i in range(warmup + measure):
        if i == warmup:
            t0 = time.perf_counter()
            wait = step = 0.0
            samples = 0
        a = time.perf_counter()
        b = next(it)
        x = to_x(b)
        c = time.perf_counter()
        assert make_model or (x.dtype == torch.float32 and x.shape[1] == DIM), (x.dtype, x.shape)
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        d = time.perf_counter()
        wait += c - a
        step += d - c
        samples += x.shape[0]
        ids_seen += 1
    el = time.perf_counter() - t0
    return {"samples": samples, "seconds": el, "samples_per_s": samples / el, "wait_s": wait, "step_s": step}


def run_loader(name: str, a: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    data = pathlib.Path(a.data)
    B, S, W = a.batch, a.shuffle_block, a.workers
    t_start = time.perf_counter()
    if name == "shardwire":
        sys.path.insert(0, str(SDK_SRC))
        import shardwire

        client = shardwire.connect(a.socket)
        stream = client.open_stream(DATASET, seed=1, batch_size=B, shuffle="block", shuffle_block=S, drop_last=True, epochs=a.epochs)

        def to_x(b):
            return torch.from_numpy(np.asarray(b["x"]))  # read-only zero-copy view; the model only reads it

        import warnings

        warnings.filterwarnings("ignore", message=".*not writable.*")
        res = train_loop(stream, a.warmup, a.measure, to_x)
        stream.close()
    elif name == "shardwire-torch":
        sys.path.insert(0, str(SDK_SRC))
        os.environ["SHARDWIRE_SOCKET"] = a.socket
        from shardwire.torch import IterableDataset

        ds = IterableDataset(DATASET, seed=1, batch_size=B, shuffle="block", shuffle_block=S, drop_last=True, epochs=a.epochs)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
        res = train_loop(loader, a.warmup, a.measure, lambda b: b["x"])
    elif name == "torch-arrow":

        class ArrowMap(torch.utils.data.Dataset):
            def __init__(self, paths):
                self.paths = paths
                self.parts = None
                import pyarrow.ipc as ipc
                import pyarrow as pa

                self.rows = []
                for p in paths:
                    r = ipc.open_file(pa.memory_map(str(p), "r"))
                    self.rows += [r.get_batch(i).num_rows for i in range(r.num_record_batches)]
                self.starts = np.cumsum([0] + self.rows)

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

        ds = ArrowMap(sorted((data / "arrow").glob("*.arrow")))
        g = torch.Generator().manual_seed(1)
        loader = torch.utils.data.DataLoader(ds, batch_size=B, shuffle=True, num_workers=W, drop_last=True, generator=g, persistent_workers=False)
        res = train_loop(loader, a.warmup, a.measure, lambda b: b["x"])
    elif name == "streaming":
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = StreamingDataset(local=str(data / "mds"), remote=None, batch_size=B, shuffle=True, shuffle_algo="py1e",
                              shuffle_block_size=S, shuffle_seed=1, num_canonical_nodes=1)
        loader = torch.utils.data.DataLoader(ds, batch_size=B, num_workers=W, drop_last=True)
        res = train_loop(loader, a.warmup, a.measure, lambda b: b["x"])
    elif name == "webdataset":
        import webdataset as wds

        urls = [str(p) for p in sorted((data / "wds").glob("*.tar"))]
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=1, empty_check=False)
              .shuffle(S).decode().to_tuple("x.npy", "id.cls").batched(B, partial=False))
        loader = wds.WebLoader(ds, batch_size=None, num_workers=W)
        res = train_loop(loader, a.warmup, a.measure, lambda b: b[0] if torch.is_tensor(b[0]) else torch.from_numpy(b[0]))
    else:
        raise SystemExit(f"unknown loader {name}")
    res.update(loader=name, total_s=time.perf_counter() - t_start)
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
    if name == "megatron":
        loader = torch.utils.data.DataLoader(gpt_dataset(pathlib.Path(a.data), L), batch_size=B, num_workers=a.workers, shuffle=False, drop_last=True)
        res = train_loop(loader, a.warmup, a.measure, lambda b: to_x(torch.cat([b["tokens"], b["labels"][:, -1:]], dim=1)), token_model)
    elif name in ("shardwire", "shardwire-megatron"):
        sys.path.insert(0, str(SDK_SRC))
        import shardwire

        order = {"order": "megatron"} if name == "shardwire-megatron" else {"shuffle": "block"}
        stream = shardwire.connect(a.socket).open_stream(TOK_DATASET, seed=1, batch_size=B, seq_len=L, drop_last=True, token_dtype="int64", **order)
        import warnings

        warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only zero-copy view; the model only reads it
        res = train_loop(stream, a.warmup, a.measure, lambda b: to_x(torch.from_numpy(np.asarray(b["tokens"]))), token_model)
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


def start_node(data: pathlib.Path, tmp: pathlib.Path, children: list[Child], stream_memory: int = 256 << 20, spec: str | None = None) -> tuple[str, str]:
    import http.client

    src = Child([str(BIN), "source", "--listen", "127.0.0.1:0", "--dataset", spec or f"{DATASET}={data / 'arrow'}"], tmp / "source.log")
    children.append(src)
    addr = src.wait(SOURCE_READY).group(1)
    serve = Child([str(BIN), "serve", "--source", addr, "--socket", str(tmp / "sw.sock"), "--data-listen", "127.0.0.1:0",
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
    r = subprocess.run([str(py), __file__, "--one", loader, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{loader} failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])


def cpu_model() -> str:
    return next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())


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
              "--warmup", str(a.warmup), "--measure", str(a.measure), "--socket", sock]
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
          f"{a.workers} DataLoader workers for megatron, {a.measure} batches timed after {a.warmup}; {cpu_model()}, {os.cpu_count()} CPUs")
    print("| loader | " + " | ".join(f"round {i + 1}" for i in range(a.rounds)) + " | median tokens/s | loader wait share | vs megatron |")
    print("|---|" + "---:|" * (a.rounds + 3))
    for l in loaders:
        v = results[l]
        share = statistics.median(r["wait_s"] / (r["wait_s"] + r["step_s"]) for r in v)
        print(f"| {l} | " + " | ".join(f"{r['tokens_per_s']:.0f}" for r in v) + f" | {med[l]:.0f} | {share:.0%} | {med[l] / med['megatron']:.3f} |")
    print(json.dumps({"bench": "loaders-tokens", "cpu": cpu_model(), "seq_len": a.seq_len, "batch": a.batch, "median_tokens_per_s": med,
                      "ratios_vs_megatron": {l: med[l] / med["megatron"] for l in loaders}, "runs": results}))


# ----------------------------------------------------------------------------- driver


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=262144)
    p.add_argument("--shard-rows", type=int, default=4096)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="default 256 (8 with --tokens)")
    p.add_argument("--shuffle-block", type=int, default=32768)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=20, help="batches")
    p.add_argument("--measure", type=int, default=300, help="batches")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--data", default=os.environ.get("BENCH_LOADERS_DATA", "/tmp/sw-bench-loaders-data"))
    p.add_argument("--shuffle-quality", action="store_true")
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    p.add_argument("--tokens", action="store_true", help="token mode: megatron GPTDataset vs shardwire token stream")
    p.add_argument("--tok-tokens", type=int, default=32_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--first", help=argparse.SUPPRESS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--write-mds", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.batch = a.batch or (8 if a.tokens else 256)
    if a.write_mds:
        write_mds(pathlib.Path(a.write_mds), a.shard_rows)
        return
    if a.one:
        print(json.dumps((run_token_loader if a.tokens else run_loader)(a.one, a)), flush=True)
        return

    if not a.tokens:
        prepare(pathlib.Path(a.data), a.samples, a.shard_rows, a.files)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sw-bench-loaders-"))
    children: list[Child] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if a.tokens:
            tokens_bench(a, tmp, children)
            return
        if a.shuffle_quality:
            shuffle_quality(a, tmp, children)
            return
        sock, _ = start_node(pathlib.Path(a.data), tmp, children)
        loaders = a.loaders.split(",")
        results: dict[str, list[dict]] = {l: [] for l in loaders}
        common = ["--data", a.data, "--batch", str(a.batch), "--shuffle-block", str(a.shuffle_block), "--workers", str(a.workers),
                  "--warmup", str(a.warmup), "--measure", str(a.measure), "--epochs", str(a.epochs), "--socket", sock]
        for rnd in range(a.rounds):
            order = loaders if rnd % 2 == 0 else loaders[::-1]
            for l in order:
                py = STREAMING_PY if l == "streaming" else MAIN_PY
                res = run_one(py, l, common)
                res["round"] = rnd + 1
                results[l].append(res)
                print(f"round {rnd + 1} {l:16s} {res['samples_per_s']:10.0f} samples/s  (loader wait {res['wait_s']:.2f} s, "
                      f"model {res['step_s']:.2f} s, process {res['total_s']:.1f} s)", file=sys.stderr, flush=True)
        med = {l: statistics.median(r["samples_per_s"] for r in v) for l, v in results.items()}
        local = [l for l in loaders if not l.startswith("shardwire")]
        best = max(local, key=lambda l: med[l]) if local else None
        print(f"\n{a.samples} samples x {DIM} float32, shards of {a.shard_rows}, batch {a.batch}, shuffle_block {a.shuffle_block}, "
              f"{a.workers} workers for local loaders, {a.measure} batches timed after {a.warmup}; {cpu_model()}, {os.cpu_count()} CPUs")
        print("| loader | " + " | ".join(f"round {i + 1}" for i in range(a.rounds)) + " | median samples/s | loader wait share | vs fastest local |")
        print("|---|" + "---:|" * (a.rounds + 3))
        for l in loaders:
            v = results[l]
            share = statistics.median(r["wait_s"] / (r["wait_s"] + r["step_s"]) for r in v)
            ratio = f"{med[l] / med[best]:.3f}" if best else "-"
            print(f"| {l} | " + " | ".join(f"{r['samples_per_s']:.0f}" for r in v) + f" | {med[l]:.0f} | {share:.0%} | {ratio} |")
        # per-round ratio against the fastest local peer of that round
        if best:
            for l in loaders:
                if l.startswith("shardwire"):
                    rr = [results[l][i]["samples_per_s"] / max(results[x][i]["samples_per_s"] for x in local) for i in range(a.rounds)]
                    print(f"{l} / fastest local peer per round: {', '.join(f'{x:.3f}' for x in rr)} (median {statistics.median(rr):.3f})")
        print(json.dumps({"bench": "loaders", "cpu": cpu_model(), "median_samples_per_s": med, "fastest_local": best,
                          "ratios_vs_fastest_local": {l: med[l] / med[best] for l in loaders} if best else {}, "runs": results}))
    finally:
        for c in reversed(children):
            c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
