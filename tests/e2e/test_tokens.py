"""Token mode (`seq_len`): windows of `seq_len + 1` tokens cut from documents, through real
`shardwire index` / `source` / `serve` processes and the Python SDK, on datasets written by
the real libraries:

- megatron-core's own `IndexedDatasetBuilder` (.bin/.idx): windows in storage order byte-exact
  against the concatenated sequences, `positions` exact, `token_dtype` widening; `block`
  windows tile one stream of whole documents and every global step is the same set for world
  sizes 1, 2 and 4; `order="megatron"` equals megatron-core's `GPTDataset` item by item;
- HF `datasets` with a tokenized `input_ids` column (chosen with `tokens_column`);
- raw `uint16` token files (`index --tokens uint16 --eos 0`).

Skipped when torch / megatron-core / datasets (tests/e2e/requirements-frameworks.txt) cannot
be imported.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import REPO, index_dataset, serve_dataset, write_tokens

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402

torch = pytest.importorskip("torch", reason="needs torch (tests/e2e/requirements-frameworks.txt)")
indexed = pytest.importorskip(
    "megatron.core.datasets.indexed_dataset",
    reason="needs megatron-core (tests/e2e/requirements-frameworks.txt)",
)

L = 16


def _lengths(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(v) for v in rng.integers(1, 60, size=n)]


def _megatron_dir(tmp_path_factory, name: str, dtype, lengths: list[int]):
    """A Megatron dataset whose tokens are 1, 2, 3, ... in storage order (every token unique);
    returns (dir, prefix, the concatenated stream, each token's position in its sequence)."""
    d = tmp_path_factory.mktemp(name) / "ds"
    d.mkdir(parents=True)
    prefix = str(d / "corpus_text_document")
    b = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    at = 1
    for n in lengths:
        b.add_item(torch.arange(at, at + n, dtype=torch.int64))
        b.end_document()
        at += n
    b.finalize(prefix + ".idx")
    index_dataset(d)
    stream = np.arange(1, at, dtype=np.int64)
    pos = np.concatenate([np.arange(n) for n in lengths])
    return d, prefix, stream, pos


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """int32 tokens, 300 sequences of 1..59 tokens (several 64 KiB shards are not needed:
    the order is checked, the shard cut is the index's)."""
    return _megatron_dir(tmp_path_factory, "gpt", np.int32, _lengths(300, 5))


def _windows(stream) -> list[np.ndarray]:
    out = []
    for b in stream:
        t = np.asarray(b["tokens"])
        assert t.ndim == 2 and t.shape[1] == L + 1, t.shape
        out.extend(t[i].astype(np.int64) for i in range(t.shape[0]))
    return out


def test_storage_order_windows_and_positions_are_exact(sw, gpt):
    d, _, stream, pos = gpt
    node = serve_dataset(sw, "gpt", d)
    n = (len(stream) - 1) // L
    got = []
    with shardwire.connect(node.socket).open_stream(
        "gpt", batch_size=4, seq_len=L, shuffle="none", boundaries=True, drop_last=True
    ) as s:
        for b in s:
            assert b["tokens"].dtype == np.int32 and b["positions"].dtype == np.int32
            assert b["positions"].shape == b["tokens"].shape == (4, L + 1)
            for i in range(4):
                k = len(got)
                assert np.array_equal(b["tokens"][i], stream[k * L: k * L + L + 1]), k
                assert np.array_equal(b["positions"][i], pos[k * L: k * L + L + 1]), k
                got.append(k)
    assert len(got) == n // 4 * 4, (len(got), n)


def test_token_dtype_widens_uint16_to_int64(sw, tmp_path_factory):
    d, _, stream, _ = _megatron_dir(tmp_path_factory, "gpt16", np.uint16, _lengths(100, 6))
    node = serve_dataset(sw, "g16", d)
    with shardwire.connect(node.socket).open_stream(
        "g16", batch_size=2, seq_len=L, shuffle="none", token_dtype="int64"
    ) as s:
        b = s.next()
        assert b["tokens"].dtype == np.int64
        assert np.array_equal(b["tokens"][1], stream[L: 2 * L + 1])


def _steps(socket: str, world: int, gb: int, seed: int = 3) -> list[list[tuple]]:
    """Every global step of one epoch as a sorted list of windows, read by `world` ranks."""
    client = shardwire.connect(socket)
    per_rank = []
    for r in range(world):
        with client.open_stream("gpt", seed=seed, rank=r, world_size=world, batch_size=gb // world,
                                seq_len=L, shuffle="block", shuffle_block=40, partitions=4,
                                drop_last=True) as s:
            per_rank.append([[tuple(w) for w in np.asarray(b["tokens"]).tolist()] for b in s])
    return [sorted(sum((per_rank[r][i] for r in range(world)), [])) for i in range(len(per_rank[0]))]


def test_block_windows_tile_whole_documents_on_any_world_size(sw, gpt):
    d, _, stream, pos = gpt
    node = serve_dataset(sw, "gpt", d)
    one = _steps(node.socket, 1, 8)
    assert _steps(node.socket, 2, 8) == one
    assert _steps(node.socket, 4, 8) == one
    windows = [w for step in one for w in step]
    n = (len(stream) - 1) // L
    assert len(windows) == n // 8 * 8
    # Chained by their shared last/first token, the windows are one stream in which each
    # document (a run of consecutive token ids starting at position 0) appears whole.
    by_first = {w[0]: w for w in windows}
    assert len(by_first) == len(windows), "two windows start at one token"
    tokens = [t for w in windows for t in w[:-1]]
    assert len(set(tokens)) == len(tokens), "a token appears in two windows"
    start_of = {int(t): int(t) - int(p) for t, p in zip(stream, pos)}  # token -> its document's first
    for w in windows:
        for a, b in zip(w, w[1:]):
            # Inside a document ids follow on; across documents the next starts at position 0.
            assert b == a + 1 or start_of[b] == b, (a, b)
    in_order = sum(1 for x, y in zip(windows, windows[1:]) if y[0] == x[-1])
    assert in_order < len(windows) // 2, f"windows barely shuffled: {in_order}"


class _Tokenizer:
    """The tokenizer object GPTDataset needs: ids only, pad -1 (no padding happens with
    drop_last)."""

    vocab_size = 1 << 20
    eod = 0
    pad = -1
    unique_identifiers = {"class": "shardwire-test"}


def test_order_megatron_equals_gptdataset(sw, gpt, tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split

    d, prefix, stream, _ = gpt
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=L, tokenizer=_Tokenizer(),
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    ds = indexed.IndexedDataset(prefix)
    ref = GPTDataset(ds, prefix, np.arange(len(ds.sequence_lengths), dtype=np.int32), None,
                     Split.train, cfg)
    n = len(ref)
    assert n == (len(stream) - 1) // L
    node = serve_dataset(sw, "gpt", d)
    with shardwire.connect(node.socket).open_stream("gpt", seed=1234, batch_size=5, seq_len=L,
                                                   order="megatron", drop_last=True) as s:
        got = _windows(s)
    assert len(got) == n // 5 * 5
    for i, w in enumerate(got):
        item = ref[i]
        want = np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])
        assert np.array_equal(w, want), f"item {i}: {w[:4]} vs GPTDataset {want[:4]}"


def test_hf_input_ids_column_with_tokens_column(sw, tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs HF datasets")
    lengths = _lengths(120, 7)
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50000, size=n).tolist() for n in lengths]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "attention_mask": datasets.Sequence(datasets.Value("int8")),
                                  "labels": datasets.Sequence(datasets.Value("int64")),
                                  "text": datasets.Value("string")})
    hf = datasets.Dataset.from_dict({"input_ids": docs, "attention_mask": [[1] * len(x) for x in docs],
                                     "labels": docs, "text": [f"doc {i}" for i in range(len(docs))]},
                                    features=features)
    d = tmp_path / "hf"
    hf.save_to_disk(str(d))
    index_dataset(d)
    node = serve_dataset(sw, "hf", d)
    client = shardwire.connect(node.socket)
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream("hf", batch_size=2, seq_len=L).next()
    # input_ids and labels are both token-like (text and attention_mask are 8-bit: not chosen).
    assert '["input_ids", "labels"]; name the documents with tokens_column' in str(e.value), e.value
    stream = np.concatenate([np.asarray(x, dtype=np.int64) for x in docs])
    with client.open_stream("hf", batch_size=3, seq_len=L, shuffle="none",
                            tokens_column="input_ids", drop_last=True) as s:
        got = _windows(s)
    assert len(got) == (len(stream) - 1) // L // 3 * 3
    for k, w in enumerate(got):
        assert np.array_equal(w, stream[k * L: k * L + L + 1]), k


def test_raw_uint16_tokens_with_eos(sw, tmp_path):
    lengths = _lengths(80, 8)
    rng = np.random.default_rng(2)
    docs = [np.concatenate([rng.integers(1, 65535, size=n), [0]]).astype(np.uint16) for n in lengths]
    stream = np.concatenate(docs)
    d = tmp_path / "raw"
    write_tokens(d, stream, eos=0)
    pos = np.concatenate([np.arange(len(x)) for x in docs])
    node = serve_dataset(sw, "raw", d)
    with shardwire.connect(node.socket).open_stream("raw", batch_size=4, seq_len=L, shuffle="none",
                                                   boundaries=True, drop_last=True) as s:
        k = 0
        for b in s:
            assert b["tokens"].dtype == np.uint16
            for i in range(4):
                assert np.array_equal(b["tokens"][i], stream[k * L: k * L + L + 1]), k
                assert np.array_equal(b["positions"][i], pos[k * L: k * L + L + 1]), k
                k += 1
    assert k == (len(stream) - 1) // L // 4 * 4


def test_token_mode_refusals_name_the_field(sw, gpt):
    d, _, stream, _ = gpt
    node = serve_dataset(sw, "gpt", d)
    client = shardwire.connect(node.socket)
    with pytest.raises(ValueError, match="boundaries need seq_len"):
        client.open_stream("gpt", batch_size=2, boundaries=True)
    with pytest.raises(ValueError, match="seq_len needs batch_size"):
        client.open_stream("gpt", seq_len=8)
    big = len(stream)
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream("gpt", batch_size=2, seq_len=big).next()
    assert f"hold no window of seq_len + 1 = {big + 1}" in str(e.value), e.value
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream("gpt", batch_size=2, seq_len=8, order="megatron", partitions=2).next()
    assert "partitions must be 1, not 2" in str(e.value), e.value


def test_elastic_resume_of_windows_at_the_same_global_batch(sw, gpt):
    """A state taken on 2 ranks after 3 steps resumes on 4 ranks (global batch 8 kept): every
    later step holds the windows an unbroken run's step holds."""
    d = gpt[0]
    node = serve_dataset(sw, "gpt", d)
    client = shardwire.connect(node.socket)
    opts = dict(seed=9, seq_len=L, shuffle="block", shuffle_block=40, partitions=4, drop_last=True)
    unbroken = _steps(node.socket, 1, 8, seed=9)
    states = []
    for r in range(2):
        with client.open_stream("gpt", rank=r, world_size=2, batch_size=4, **opts) as s:
            for _ in range(3):
                s.next()
            states.append(s.state_dict())
    assert states[0] == states[1], "the state is global"
    per_rank = []
    for r in range(4):
        with client.open_stream("gpt", rank=r, world_size=4, batch_size=2, state=states[0], **opts) as s:
            per_rank.append([[tuple(w) for w in np.asarray(b["tokens"]).tolist()] for b in s])
    resumed = [sorted(sum((per_rank[r][i] for r in range(4)), [])) for i in range(len(per_rank[0]))]
    assert resumed == unbroken[3:]
