"""Generate Megatron GPTDataset index test vectors from the real megatron-core (0.16.1).

Builds a real IndexedDataset (IndexedDatasetBuilder) and a real GPTDataset per case, and
records document/sample/shuffle indices plus the raw text windows of the first 8 items.
Run: .venv/bin/python scripts/megatron/gen_vectors.py (writes vectors.json next to this file; the
"generated" cases of protocol/src/samples/megatron_vectors.json came from it, merged with four
hand-checked toy cases).
"""
import json, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split


class Stub:
    def __init__(self):
        self.vocab_size = 4096
        self.eod = 0
        self.pad = -1
        self.unique_identifiers = {"class": "stub"}


def tokens_of(d, n):
    # Distinct, >= 1 (0 is reserved for "pad" after Megatron's pad->0 rewrite), < 4096.
    return [1 + (d * 61 + j) % 4000 for j in range(n)]


def per_epoch(T, L, x):
    return (T - x) // L


def build_case(rng, name, S, maxlen, L, seed, x, epochs, sep_want, split):
    lengths = [int(v) for v in rng.integers(1, maxlen + 1, size=S)]
    T = sum(lengths)
    if T - x < L:  # need at least one sample
        lengths[0] += L
        T = sum(lengths)
    pe = per_epoch(T, L, x)
    if epochs is None:
        num_samples = None
    else:
        # Samples that need `epochs` epochs; sep_want picks a small or large final fraction.
        lo = ((epochs - 1) * T - x) // L  # samples that fit in E-1 epochs
        if sep_want == "edge":  # exactly at the 0.80 threshold: not separated
            num_samples = lo + int(0.80 * pe)
        elif sep_want == "edge-1":  # one below: separated
            num_samples = lo + int(0.80 * pe) - 1
        elif sep_want:
            num_samples = lo + max(1, pe // 5)
        else:
            num_samples = lo + max(1, (pe * 9) // 10)
        num_samples = min(num_samples, (epochs * T - x) // L)
    seqs = [tokens_of(d, n) for d, n in enumerate(lengths)]
    tmp = tempfile.mkdtemp(prefix="mgv_")
    prefix = os.path.join(tmp, "data")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for s in seqs:
        b.add_item(torch.tensor(s, dtype=torch.int64))
        b.end_document()
    b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert list(ds.sequence_lengths) == lengths
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=L, tokenizer=Stub(),
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=os.path.join(tmp, "cache"),
                           add_extra_token_to_sequence=bool(x),
                           drop_last_partial_validation_sequence=(split == Split.train))
    gpt = GPTDataset(ds, prefix, numpy.arange(len(ds.sequence_lengths), dtype=numpy.int32),
                     num_samples, split, cfg)
    texts = []
    for i in range(min(8, len(gpt))):
        item = gpt[i]
        tok = item["tokens"].tolist(); lab = item["labels"].tolist()
        if x == 1:
            assert tok[1:] == lab[:-1]
            text = tok + [lab[-1]]
        else:
            assert lab[:-1] == tok[1:]
            text = tok
        texts.append(text)
    # Also the very last sample (covers the drop_last=False end-of-data padding).
    # The item whose sample is the final one (padded at the end of data when drop_last=False).
    last = None
    tail_i = None
    if len(gpt) > 0:
        tail_i = int(numpy.nonzero(gpt.shuffle_index == len(gpt) - 1)[0][0])
        item = gpt[tail_i]
        tok = item["tokens"].tolist(); lab = item["labels"].tolist()
        last = tok + [lab[-1]] if x == 1 else tok
    di = gpt.document_index.tolist(); si = gpt.sample_index.tolist(); sh = gpt.shuffle_index.tolist()
    E = gpt._get_num_epochs(T) if hasattr(gpt, "_get_num_epochs") else None
    sep = None
    if num_samples is not None and E is not None and E > 1:
        sans = ((E - 1) * T - x) // L
        sep = (num_samples - sans) < int(0.80 * pe)
    elif E is not None:
        sep = False
    return name, {
        "lengths": lengths, "sequences": seqs, "seq_len": L, "seed": seed, "add_extra_token": bool(x),
        "num_samples": num_samples, "drop_last": split == Split.train,
        "num_epochs": E, "separate_final_epoch": sep,
        "document_index": di, "sample_index": si, "shuffle_index": sh,
        "first_texts": texts, "tail_text": last, "tail_dataset_index": tail_i,
    }


def mt_vectors():
    out = []
    for seed, n in [(0, 1), (0, 2), (1, 10), (1234, 100), (7, 1000), (2**32 - 1, 37), (42, 70000), (123456789, 65537)]:
        a = numpy.arange(n, dtype=numpy.int64)
        numpy.random.RandomState(seed).shuffle(a)
        a = a.tolist()
        if n <= 100:
            out.append({"seed": seed, "n": n, "full": a})
        else:
            step = max(1, n // 40)
            pos = sorted(set(list(range(0, 16)) + list(range(n - 16, n)) + list(range(0, n, step))))
            chk = sum((i + 1) * v for i, v in enumerate(a)) % (2**61 - 1)
            out.append({"seed": seed, "n": n, "positions": pos, "values": [a[p] for p in pos], "checksum_mod_2_61_1": chk})
    raw = []
    for seed in [0, 5489, 1234]:
        rs = numpy.random.RandomState(seed)
        raw.append({"seed": seed, "u32": rs.randint(0, 2**32, size=8, dtype=numpy.uint64 if False else numpy.uint32).tolist()})
    return out, raw


def main():
    rng = numpy.random.default_rng(20261201)
    cases = [
        # name, S, maxlen, L, seed, x, epochs(None=num_samples None), sep_want, split
        ("g01_S1_L1_x1", 1, 5, 1, 3, 1, None, False, Split.train),
        ("g02_S5_L3_x0", 5, 10, 3, 99, 0, None, False, Split.train),
        ("g03_S12_L7_x1_e2sep", 12, 20, 7, 1234, 1, 2, True, Split.train),
        ("g04_S20_L16_x1_e3nosep", 20, 50, 16, 5, 1, 3, False, Split.train),
        ("g05_S30_L8_x0_e4sep", 30, 12, 8, 2024, 0, 4, True, Split.train),
        ("g06_S40_L16_x1_e2nosep", 40, 30, 16, 77, 1, 2, False, Split.train),
        ("g07_S8_L2_x0_e3sep", 8, 6, 2, 31337, 0, 3, True, Split.train),
        ("g08_S25_L11_x1_none", 25, 50, 11, 4000000000, 1, None, False, Split.train),
        ("g09_S17_L5_x1_valid_nodrop", 17, 9, 5, 8, 1, None, False, Split.valid),
        ("g10_S13_L6_x0_valid_nodrop", 13, 11, 6, 9, 0, None, False, Split.valid),
        ("g11_S3_L16_x1_e4sep", 3, 50, 16, 1, 1, 4, True, Split.train),
        ("g12_S35_L4_x0_x0edge", 35, 8, 4, 1234, 0, 2, True, Split.train),
        ("g13_S10_L9_x1_valid_nodrop_e2", 10, 15, 9, 11, 1, 2, True, Split.valid),
        ("g14_S14_L7_x0_valid_nodrop_e3", 14, 13, 7, 12, 0, 3, False, Split.valid),
        ("g15_S9_L3_x1_thr_edge", 9, 20, 3, 55, 1, 2, "edge", Split.train),
        ("g16_S9_L3_x1_thr_edge_minus1", 9, 20, 3, 55, 1, 2, "edge-1", Split.train),
    ]
    out = {}
    for c in cases:
        name, v = build_case(rng, *c)
        out[name] = v
        print(name, "E", v["num_epochs"], "sep", v["separate_final_epoch"], "n", len(v["shuffle_index"]), file=sys.stderr)
    shuffles, raw = mt_vectors()
    out["_mt_shuffle"] = shuffles
    out["_mt_raw_u32"] = raw
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(path, os.path.getsize(path), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
