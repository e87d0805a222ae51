"""The stream keywords of the Python SDK (client/python/src/shardwire/_options.py), without a
node: no binary, no socket, no torch needed.

- The one definition (:class:`shardwire.StreamOptions`) and its typing mirrors
  (``StreamKeywords``, ``DatasetKeywords``) name the same keywords with the same types.
- The three entry points (``Client.open_stream``, ``HttpClient.open_stream``,
  ``shardwire.torch.IterableDataset``) take exactly those keywords (the dataset less the three
  it sets itself), refuse any other naming it, and document each one.
- The request each entry point sends (captured where it would go out) is, field for field and
  in order, what the SDK sent before the keywords were defined once: the dicts below were
  written out from the old ``_attach_fields`` and the old torch dataset.
- The torch dataset refuses, as open_stream does, the keywords shard mode would ignore; in a
  DataLoader worker it names the parent's CUDA device and keeps the epoch it loads to itself.
- An integer keyword takes a numpy integer, a mixture weight a numpy float (sent as int and
  float); ``rank >= world_size`` and ``worker >= num_workers`` are ValueErrors before sending.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import pickle
import sys
import typing
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402
import shardwire.torch as swt  # noqa: E402
from shardwire import _client, _http, _options  # noqa: E402
from shardwire._options import DATASET_NAMES, DATASET_REFUSED, DatasetKeywords, StreamKeywords, StreamOptions  # noqa: E402

NAMES = [f.name for f in dataclasses.fields(StreamOptions)]
STATE = {"epoch": 1, "index": 2, "seed": 7, "fingerprint": "v1;x"}
#: One valid value for every keyword (batch and token mode together).
EVERY = {
    "seed": 3, "rank": 1, "world_size": 2, "epochs": 2, "uneven": "drop", "state": STATE,
    "batch_size": 4, "shuffle": "shards", "shuffle_block": 100, "partitions": 2, "drop_last": True,
    "worker": 1, "num_workers": 3, "seq_len": 8, "tokens_column": "ids", "token_dtype": "int64",
    "boundaries": True, "order": "megatron", "device": "0000:19:00.0",
}


class Sent(Exception):
    """Raised where the request would go out, carrying it."""

    def __init__(self, req: dict[str, Any]) -> None:
        super().__init__(req)
        self.req = req


class FakeStream:
    """What the torch dataset needs of a stream: a context manager with a state, a
    fingerprint (open_at_epoch's probe) and no batches."""

    info = shardwire.StreamInfo(stream=1, region_size=0, batches_per_epoch=0, epochs=1, memory="host", state={"fingerprint": "v1;fp"})

    def next(self, timeout: float | None = None) -> None:
        return None

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": 0, "index": 0, "cursor": 0, "partitions": 1, "shuffle_block": 100, "seed": 8, "fingerprint": "b1;fp"}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Socket attach requests (without `batch_state` and `batch_encoding`, checked) and HTTP open bodies,
    captured instead of sent: the socket's are recorded and answered with a FakeStream, the
    HTTP ones raise Sent."""
    reqs: list[dict[str, Any]] = []

    def sock_open(cls: Any, path: str, req: dict[str, Any], auto_device: bool = False) -> FakeStream:
        # The socket client always asks for the state in each batch reply (it asks for the
        # next batch ahead of time), in the binary form; the stream keywords are the rest,
        # compared below.
        assert req.pop("batch_state") is True, req
        assert req.pop("batch_encoding") == "binary", req
        reqs.append(req)
        return FakeStream()

    def http_open(cls: Any, client: Any, body: dict[str, Any]) -> Any:
        raise Sent(body)

    monkeypatch.setattr(_client.Stream, "_open", classmethod(sock_open))
    monkeypatch.setattr(_http.HttpStream, "_open", classmethod(http_open))
    return reqs


def client() -> shardwire.Client:
    return shardwire.Client("/nonexistent/trainer.sock")


def http() -> shardwire.HttpClient:
    return shardwire.HttpClient("127.0.0.1:1")


def http_body(dataset: Any, **kw: Any) -> dict[str, Any]:
    with pytest.raises(Sent) as e:
        http().open_stream(dataset, **kw)
    return e.value.req


# --- the one definition ------------------------------------------------------------------------


def _type_text(t: Any) -> str:
    return t.__forward_arg__ if isinstance(t, typing.ForwardRef) else str(t)


def test_the_typed_dicts_mirror_the_definition():
    assert NAMES == ["seed", "rank", "world_size", "epochs", "uneven", "state", "batch_size", "shuffle", "shuffle_block", "partitions",
                     "drop_last", "worker", "num_workers", "seq_len", "tokens_column", "token_dtype", "boundaries", "order", "device"]
    types = {f.name: f.type for f in dataclasses.fields(StreamOptions)}
    assert {k: _type_text(t) for k, t in StreamKeywords.__annotations__.items()} == types
    assert {k: _type_text(t) for k, t in DatasetKeywords.__annotations__.items()} == {k: types[k] for k in DATASET_NAMES}
    assert StreamKeywords.__total__ is False and DatasetKeywords.__total__ is False
    # The dataset: its own rank/world_size, refuses what it sets; together every keyword.
    own = {"rank", "world_size"}
    assert set(DATASET_REFUSED) == {"state", "worker", "num_workers"}
    assert set(DATASET_NAMES) | own | set(DATASET_REFUSED) == set(NAMES)
    assert not set(DATASET_NAMES) & (own | set(DATASET_REFUSED))
    # Every field is documented and defaults to what open_stream's keywords defaulted to.
    assert all(f.metadata["doc"] for f in dataclasses.fields(StreamOptions))
    assert StreamOptions().keywords() == {
        "seed": 0, "rank": 0, "world_size": 1, "epochs": 1, "uneven": "pad", "state": None, "batch_size": None, "shuffle": None,
        "shuffle_block": None, "partitions": None, "drop_last": False, "worker": None, "num_workers": None, "seq_len": None,
        "tokens_column": None, "token_dtype": None, "boundaries": False, "order": None, "device": "auto",
    }
    assert set(EVERY) == set(NAMES)


def test_entry_point_signatures_take_the_keywords_through_the_definition():
    def params(fn: Any) -> dict[str, inspect.Parameter]:
        return dict(inspect.signature(fn).parameters)

    sock = params(shardwire.Client.open_stream)
    assert list(sock) == ["self", "dataset", "options"] and sock["options"].kind is inspect.Parameter.VAR_KEYWORD
    assert sock["options"].annotation == "Unpack[StreamKeywords]"
    web = params(shardwire.HttpClient.open_stream)
    assert list(web) == ["self", "dataset", "idle_timeout", "options"]
    assert web["idle_timeout"].kind is inspect.Parameter.KEYWORD_ONLY and web["options"].annotation == "Unpack[StreamKeywords]"
    ds = params(swt._DatasetMixin.__init__)
    assert list(ds) == ["self", "dataset", "socket", "copy", "timeout", "rank", "world_size", "idle_timeout", "options"]
    assert ds["options"].annotation == "Unpack[DatasetKeywords]"
    assert (ds["rank"].default, ds["world_size"].default, ds["copy"].default) == (None, None, True)


def test_every_keyword_is_documented_on_every_entry_point():
    docs = {
        "Client.open_stream": inspect.getdoc(shardwire.Client.open_stream) or "",
        "HttpClient.open_stream": inspect.getdoc(shardwire.HttpClient.open_stream) or "",
        "StreamOptions": inspect.getdoc(shardwire.StreamOptions) or "",
        "IterableDataset": inspect.cleandoc(_options.fill_doc(swt._DOC, DATASET_NAMES)),
    }
    for where, doc in docs.items():
        assert _options.MARK not in doc, where
        names = NAMES if where != "IterableDataset" else list(DATASET_NAMES)
        for name in names:
            entry = f"\n    {name} ({StreamOptions.__dataclass_fields__[name].type}, default "
            assert entry in doc, f"{where} does not document {name}"
    assert "Shuffle seed; every rank of a job must use the same one." in docs["Client.open_stream"]
    assert "idle_timeout:" in docs["HttpClient.open_stream"]
    for name in DATASET_REFUSED:
        assert f"\n    {name} (" not in docs["IterableDataset"]


# --- the three entry points take the same keywords ----------------------------------------------


def test_all_three_entry_points_take_every_stream_keyword(sent, monkeypatch: pytest.MonkeyPatch):
    client().open_stream("d", **EVERY)
    (req,) = sent
    assert req == {"op": "attach", **StreamOptions(**EVERY).attach_fields("d")}
    assert list(req)[1:] == list(http_body("d", **EVERY))  # the HTTP body: the same fields
    assert http_body("d", **EVERY) == StreamOptions(**EVERY).attach_fields("d")
    # The torch dataset: every keyword it passes on, its own rank/world_size; the rest it sets.
    mine = {k: v for k, v in EVERY.items() if k in DATASET_NAMES}
    ds = swt._DatasetMixin("d", socket="/nonexistent", rank=1, world_size=2, **mine)
    assert ds.options == StreamOptions(**mine)
    for k, v in mine.items():
        assert getattr(ds, k) == v  # still attributes of the dataset
    monkeypatch.setattr(swt, "_ddp_ranks", lambda rank, world_size: (rank, world_size))
    monkeypatch.setattr(swt, "_worker", lambda: (1, 3))
    sent.clear()
    ds._open_batches(client(), *ds._start())
    (req,) = sent
    assert req == {"op": "attach", **StreamOptions(**{**EVERY, "state": None}).attach_fields("d")}


@pytest.mark.parametrize("kw", ["bogus", "idle_timeout", "socket", "dataset_name"])
def test_an_unknown_keyword_is_refused_naming_it(sent, kw):
    if kw == "idle_timeout":
        entry_points = [client().open_stream]  # HTTP only
    elif kw == "socket":
        entry_points = [client().open_stream, http().open_stream]  # the torch dataset's own
    else:
        entry_points = [client().open_stream, http().open_stream, lambda d, **o: swt._DatasetMixin(d, **o)]
    for fn in entry_points:
        with pytest.raises(TypeError, match=rf"got an unexpected keyword argument '{kw}'"):
            fn("d", seed=1, **{kw: 1})
    with pytest.raises(TypeError, match=r"Client\.open_stream\(\) got unexpected keyword arguments 'x', 'y'"):
        client().open_stream("d", x=1, y=2)
    assert sent == []


@pytest.mark.parametrize("kw", sorted(DATASET_REFUSED))
def test_the_dataset_refuses_what_it_sets_itself_saying_why(kw):
    with pytest.raises(TypeError, match=rf"IterableDataset\(\) got an unexpected keyword argument '{kw}' \(the dataset "):
        swt._DatasetMixin("d", **{kw: 1})


def test_positional_stream_keywords_are_refused():
    with pytest.raises(TypeError):
        client().open_stream("d", 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        http().open_stream("d", 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        swt._DatasetMixin("d", "sock")  # type: ignore[misc]


# --- the requests are the ones sent before --------------------------------------------------


#: (dataset, keywords, the attach fields the old `_attach_fields` produced), written out.
CASES: list[tuple[Any, dict[str, Any], dict[str, Any]]] = [
    ("a", {}, {"version": 1, "dataset": "a", "seed": 0, "rank": 0, "world_size": 1, "epochs": 1, "uneven": "pad", "state": None}),
    (
        "a",
        {"seed": 7, "rank": 1, "world_size": 4, "epochs": 3, "uneven": "drop", "state": STATE},
        {"version": 1, "dataset": "a", "seed": 7, "rank": 1, "world_size": 4, "epochs": 3, "uneven": "drop", "state": STATE},
    ),
    (
        "b",
        {"seed": 1, "world_size": 2, "epochs": 2, "batch_size": 16, "shuffle": "shards", "shuffle_block": 100, "partitions": 8,
         "drop_last": True, "worker": 1, "num_workers": 3},
        {"version": 1, "dataset": "b", "seed": 1, "rank": 0, "world_size": 2, "epochs": 2, "uneven": "pad", "state": None,
         "batch_size": 16, "shuffle_block": 100, "partitions": 8, "worker": 1, "num_workers": 3, "shuffle": "shards", "drop_last": True},
    ),
    (
        "g",
        {"batch_size": 4, "shuffle": None, "shuffle_block": None, "partitions": None, "drop_last": False, "worker": None,
         "num_workers": None, "seq_len": 8, "tokens_column": "ids", "token_dtype": "int64", "boundaries": True, "order": "megatron"},
        {"version": 1, "dataset": "g", "seed": 0, "rank": 0, "world_size": 1, "epochs": 1, "uneven": "pad", "state": None,
         "batch_size": 4, "seq_len": 8, "tokens_column": "ids", "token_dtype": "int64", "boundaries": True, "order": "megatron"},
    ),
    (
        {"web": 0.7, "code": 3},
        {"seed": 2, "batch_size": 4, "seq_len": 8, "drop_last": False, "boundaries": False},
        {"version": 1, "dataset": "", "seed": 2, "rank": 0, "world_size": 1, "epochs": 1, "uneven": "pad", "state": None,
         "batch_size": 4, "seq_len": 8, "mix": [{"dataset": "web", "weight": 0.7}, {"dataset": "code", "weight": 3.0}]},
    ),
]


@pytest.mark.parametrize("dataset,kw,want", CASES)
def test_attach_fields_are_those_sent_before(sent, dataset, kw, want):
    client().open_stream(dataset, **kw)
    (req,) = sent
    assert list(req.items()) == list({"op": "attach", **want}.items())  # same keys, values and order
    assert list(http_body(dataset, **kw).items()) == list(want.items())
    assert http_body(dataset, idle_timeout=2.5, **kw) == {**want, "idle_timeout_s": 3}
    assert StreamOptions.of(kw, "t").attach_fields(dataset) == want


def test_the_torch_dataset_sends_what_it_sent_before(sent, monkeypatch: pytest.MonkeyPatch):
    """Batch mode from epoch 0, from epoch 2 (a probe first), after load_state_dict, token mode
    and shard mode (through open_at_epoch), each request written out from the old dataset."""
    monkeypatch.setattr(swt, "_ddp_ranks", lambda rank, world_size: (0 if rank is None else rank, 1 if world_size is None else world_size))
    monkeypatch.setattr(swt, "_worker", lambda: (0, 1))
    head = {"op": "attach", "version": 1}
    batch = {"batch_size": 16, "shuffle_block": 50, "partitions": 2, "worker": 0, "num_workers": 1, "shuffle": "block", "drop_last": True}
    b = {**head, "dataset": "b", "seed": 8, "rank": 0, "world_size": 1}
    probe_state = {**FakeStream().state_dict(), "epoch": 2}
    resume = {"epoch": 3, "index": 5, "cursor": 80, "partitions": 2, "shuffle_block": 50, "seed": 8, "fingerprint": "b1;fp"}
    ds = swt._DatasetMixin("b", socket="/nonexistent", seed=8, batch_size=16, drop_last=True, shuffle="block", shuffle_block=50, partitions=2)
    ds._open_batches(client(), *ds._start())
    ds.set_epoch(2)
    ds._open_batches(client(), *ds._start())
    ds.load_state_dict({"epoch": 3, "stream": resume})
    ds._open_batches(client(), *ds._start())
    no_workers = {k: v for k, v in batch.items() if k not in ("worker", "num_workers")}
    assert [list(r.items()) for r in sent] == [
        list(x.items())
        for x in [
            {**b, "epochs": 1, "uneven": "pad", "state": None, **batch},
            {**b, "epochs": 1, "uneven": "pad", "state": None, **no_workers},  # the probe
            {**b, "epochs": 3, "uneven": "pad", "state": probe_state, **batch},
            {**b, "epochs": 4, "uneven": "pad", "state": resume, **batch},
        ]
    ]
    sent.clear()
    ds = swt._DatasetMixin("g", socket="/nonexistent", rank=1, world_size=2, batch_size=4, seq_len=8, tokens_column="ids",
                           token_dtype="int32", boundaries=True, order="shardwire", epochs=2)
    ds._open_batches(client(), *ds._start())
    assert list(sent[0].items()) == list({
        **head, "dataset": "g", "seed": 0, "rank": 1, "world_size": 2, "epochs": 2, "uneven": "pad", "state": None, "batch_size": 4,
        "worker": 0, "num_workers": 1, "seq_len": 8, "tokens_column": "ids", "token_dtype": "int32", "boundaries": True,
        "order": "shardwire",
    }.items())
    sent.clear()
    monkeypatch.setattr(swt, "_torch_ranks", lambda rank, world_size: (3, 8))
    monkeypatch.setattr(swt, "connect", lambda socket: client())
    ds = swt._DatasetMixin("a", socket="/nonexistent", seed=5, epochs=2, uneven="drop")
    assert list(ds) == []
    ds.set_epoch(1)
    assert list(ds) == []
    a = {**head, "dataset": "a", "seed": 5, "rank": 3, "world_size": 8}
    assert sent == [
        {**a, "epochs": 2, "uneven": "drop", "state": None},
        {**a, "epochs": 1, "uneven": "drop", "state": None},  # open_at_epoch's probe
        {**a, "epochs": 3, "uneven": "drop", "state": {"epoch": 1, "index": 0, "seed": 5, "fingerprint": "v1;fp"}},
    ]


# --- values are checked as before -----------------------------------------------------------


def test_one_worker_of_one_needs_no_batch_mode(sent):
    # Values that split nothing are accepted in shard mode, as the node accepts them.
    assert "num_workers" in shardwire.StreamOptions(worker=0, num_workers=1).attach_fields("d")


@pytest.mark.parametrize("kw,message", [
    ({"uneven": "spread"}, "uneven must be 'pad' or 'drop', not 'spread'"),
    ({"seed": -1}, "seed must be an integer >= 0, not -1"),
    ({"world_size": True}, "world_size must be an integer >= 1, not True"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, not 0"),
    ({"batch_size": 2, "worker": -1}, "worker must be an integer >= 0, not -1"),
    # Before: sent, and the node, which cannot decode the request, dropped the connection.
    ({"seed": 2**64}, "seed must be below 2**64 (its field in the attach request), not 18446744073709551616"),
    ({"world_size": 2**32}, "world_size must be below 2**32 (its field in the attach request), not 4294967296"),
    ({"batch_size": 2, "shuffle": "rows"}, "shuffle must be 'none', 'shards' or 'block', not 'rows'"),
    ({"shuffle": "none", "drop_last": True}, "shuffle, drop_last need batch_size (batch mode)"),
    # Before: accepted, and ignored by the node: every worker got the rank's whole stream.
    ({"worker": 1, "num_workers": 2}, "worker, num_workers need batch_size (batch mode); in shard mode give each "
                                      "DataLoader worker its own rank (shardwire.torch.effective_rank)"),
    ({"batch_size": 2, "boundaries": True}, "boundaries need seq_len (token mode)"),
    ({"seq_len": 8}, "seq_len needs batch_size: token windows are delivered in batches"),
    ({"batch_size": 2, "seq_len": 8, "token_dtype": "int16"}, "token_dtype must be 'int32' or 'int64', not 'int16'"),
    ({"batch_size": 2, "seq_len": 8, "order": "random"}, "order must be 'shardwire' or 'megatron', not 'random'"),
])
def test_bad_values_raise_the_same_value_errors(sent, kw, message):
    for fn in (client().open_stream, http().open_stream):
        with pytest.raises(ValueError) as e:
            fn("d", **kw)
        assert str(e.value) == message
    with pytest.raises(ValueError, match="mix weight of 'code' must be a positive number, not 0"):
        client().open_stream({"web": 1, "code": 0}, batch_size=4)
    with pytest.raises(ValueError, match=r"a mixture \(a mapping of datasets to weights\) needs batch_size \(batch mode\)"):
        http().open_stream({"web": 1, "code": 1})
    with pytest.raises(ValueError, match="idle_timeout must be > 0 seconds, not 0"):
        http().open_stream("d", idle_timeout=0)
    assert sent == []


def test_numpy_integers_and_floats_are_taken_where_numbers_are(sent, monkeypatch: pytest.MonkeyPatch):
    """A seed drawn with numpy (``rng.integers(2**31)``), ranks from an array, weights computed
    with numpy: before, each was refused with a message that contradicted itself ("seed must be
    an integer >= 0, not 1234"). Now they are taken, and sent as JSON's int and float."""
    import json

    import numpy as np

    kw = {"seed": np.int64(1234), "rank": np.int32(1), "world_size": np.uint16(4), "epochs": np.int8(2),
          "batch_size": np.int64(8), "shuffle_block": np.uint64(100), "partitions": np.int16(2),
          "worker": np.int64(1), "num_workers": np.uint8(2), "seq_len": np.int32(16)}
    mix = {"web": np.float32(0.5), "code": np.float64(0.25), "books": np.int64(1)}
    want = {"version": 1, "dataset": "", "seed": 1234, "rank": 1, "world_size": 4, "epochs": 2, "uneven": "pad", "state": None,
            "batch_size": 8, "shuffle_block": 100, "partitions": 2, "worker": 1, "num_workers": 2, "seq_len": 16,
            "mix": [{"dataset": "web", "weight": 0.5}, {"dataset": "code", "weight": 0.25}, {"dataset": "books", "weight": 1.0}]}
    client().open_stream(mix, **kw)
    (req,) = sent
    body = http_body(mix, **kw)
    for got in (req, body):
        assert {k: v for k, v in got.items() if k != "op"} == want
        assert all(type(got[k]) is int for k in kw), {k: type(got[k]) for k in kw}
        assert all(type(m["weight"]) is float for m in got["mix"])
        json.dumps(got)  # a numpy scalar would not encode
    # A CUDA ordinal too: resolved as the int it is (torch's own check takes no numpy integer).
    monkeypatch.setattr(_options._device, "resolve", lambda device: f"{type(device).__name__} {device}")
    assert StreamOptions(device=np.int64(3)).attach_fields("d")["device"] == "int 3"
    for bad in (np.bool_(True), np.float64(1.0), 1.0):
        with pytest.raises(ValueError, match="seed must be an integer >= 0"):
            client().open_stream("d", seed=bad)
    with pytest.raises(ValueError, match="mix weight of 'web' must be a positive number"):
        client().open_stream({"web": np.bool_(True)}, batch_size=4)
    with pytest.raises(ValueError, match="mix weight of 'web' must be a positive number"):
        client().open_stream({"web": np.float32("nan")}, batch_size=4)


@pytest.mark.parametrize("kw,message", [
    ({"rank": 8, "world_size": 8}, "rank must be < world_size (ranks are 0 to world_size - 1): rank 8, world_size 8"),
    ({"rank": 1}, "rank must be < world_size (ranks are 0 to world_size - 1): rank 1, world_size 1"),
    ({"batch_size": 2, "worker": 2, "num_workers": 2},
     "worker must be < num_workers (workers are 0 to num_workers - 1): worker 2, num_workers 2"),
    ({"batch_size": 2, "worker": 1}, "worker 1 needs num_workers > 1 (without it there is one worker, 0)"),
])
def test_a_rank_or_worker_out_of_range_is_a_value_error_before_sending(sent, kw, message):
    """The documented ``0 <= rank < world_size`` (and a worker below num_workers, 1 when not
    given): before, only the lower bounds were checked here, and these went to the node, which
    refused them as `bad_plan` (a ServiceError after a connection and an attach), not the
    documented ValueError with nothing sent."""
    for fn in (client().open_stream, http().open_stream):
        with pytest.raises(ValueError) as e:
            fn("d", **kw)
        assert str(e.value) == message
    assert sent == []


def test_the_dataset_pickles_with_its_options():
    ds = swt._DatasetMixin("b", socket="/s", seed=8, batch_size=16, drop_last=True, rank=1, world_size=2, timeout=3.0)
    ds.set_epoch(2)
    ds.batch_size = 8  # attributes write through to the options
    assert ds.options.batch_size == 8
    back = pickle.loads(pickle.dumps(ds))
    assert back.options == ds.options == StreamOptions(seed=8, batch_size=8, drop_last=True)
    assert (back.dataset, back.socket, back.rank, back.world_size, back.timeout, back.copy, back.epoch) == ("b", "/s", 1, 2, 3.0, True, 2)
    assert back.state_dict() == {"epoch": 2, "stream": None}


def test_the_torch_class_takes_the_same_keywords():
    pytest.importorskip("torch")
    cls = swt.IterableDataset
    mine = {k: v for k, v in EVERY.items() if k in DATASET_NAMES}
    ds = cls("d", socket="/s", rank=0, world_size=1, **mine)
    assert ds.options == StreamOptions(**mine) and type(pickle.loads(pickle.dumps(ds))) is cls
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        cls("d", bogus=1)
    doc = inspect.getdoc(cls) or ""
    assert all(f"\n    {name} (" in doc for name in DATASET_NAMES) and _options.MARK not in doc


def test_a_reply_cut_short_by_a_stalled_node_fails_within_the_frame_limit(monkeypatch):
    """The rest of a reply whose first bytes came is waited for at most FRAME_LIMIT seconds
    (the Rust SDK's limit too): a node stopped mid-write fails the call, never hangs it, even
    for a ``next`` without a timeout. A reply split across writes still arrives whole."""
    import json
    import socket
    import struct
    import threading
    import time

    from shardwire import _wire

    monkeypatch.setattr(_wire, "FRAME_LIMIT", 0.5)
    a, b = socket.socketpair()
    with a, b:
        conn = _wire.Conn(a)
        body = json.dumps({"op": "state", "state": {}}).encode()
        frame = struct.pack("<I", len(body)) + body
        b.sendall(frame[:6])
        t0 = time.monotonic()
        with pytest.raises(shardwire.ConnectionClosed, match="part of a reply and not the rest within 0.5 s"):
            conn.recv_reply()
        assert time.monotonic() - t0 < 5.0

    monkeypatch.setattr(_wire, "FRAME_LIMIT", 5.0)  # the rest comes after 0.2 s: a wide margin
    a, b = socket.socketpair()
    with a, b:
        conn = _wire.Conn(a)
        b.sendall(frame[:3])
        later = threading.Timer(0.2, lambda: b.sendall(frame[3:]))
        later.start()
        assert conn.recv_reply() == {"op": "state", "state": {}}
        later.join()


# --- the torch dataset in its DataLoader workers ------------------------------------------------


def test_a_worker_started_with_spawn_names_the_parent_s_device(monkeypatch: pytest.MonkeyPatch):
    """torchrun's rank r calls torch.cuda.set_device(r); a DataLoader worker started with
    spawn is a fresh interpreter whose current device is 0, so with ``device="auto"`` every
    rank's workers named GPU 0. The dataset pickled for a worker by a process that uses CUDA
    carries that process's current device, which a DataLoader worker then names (still only
    when the node serves CUDA memory: the option stays "auto"); a device given as an ordinal is
    resolved in the parent. A process spawned otherwise (torch.multiprocessing.spawn's ranks,
    pickled by a launcher that never started CUDA) looks up its own."""
    import multiprocessing.context

    from shardwire import _device

    monkeypatch.setattr(_device, "_inherited", None)  # restored after the test
    own_lookup = _device.current
    monkeypatch.setattr(_device, "current", lambda: "0000:3b:00.0")  # the parent's: cuda:1, say
    monkeypatch.setattr(_device, "_current_ordinal", lambda: 1)
    monkeypatch.setattr(_device, "_ordinal", lambda n: f"0000:{0x3a + n:02x}:00.0")
    monkeypatch.setattr(multiprocessing.context, "get_spawning_popen", lambda: object())  # pickled for a process
    # A launcher that never started CUDA passes nothing on.
    monkeypatch.setattr(swt, "_cuda_in_use", lambda: False)
    launcher = swt._DatasetMixin("d", socket="/s").__getstate__()
    assert "_worker_device" not in launcher
    monkeypatch.setattr(swt, "_cuda_in_use", lambda: True)
    auto = swt._DatasetMixin("d", socket="/s", rank=1, world_size=2).__getstate__()
    given = swt._DatasetMixin("d", socket="/s", device="cuda").__getstate__()
    assert given["_worker_device"] == "0000:3b:00.0", "cuda (the current device) resolved in the parent"
    # In the worker: its own lookup would say device 0 (or nothing, on this machine).
    monkeypatch.setattr(_device, "current", own_lookup)
    monkeypatch.setattr(swt, "_in_worker", lambda: False)
    rank = swt._DatasetMixin.__new__(swt._DatasetMixin)
    rank.__setstate__(auto)
    rank._take_device()
    assert _device._inherited is None, "not a DataLoader worker: its own device"
    monkeypatch.setattr(swt, "_in_worker", lambda: True)
    worker = swt._DatasetMixin.__new__(swt._DatasetMixin)
    worker.__setstate__(auto)
    worker._take_device()
    assert worker.options.device == "auto" and (worker.rank, worker.world_size) == (1, 2)
    assert _device.current() == "0000:3b:00.0", "the worker's auto device is the parent's"
    explicit = swt._DatasetMixin.__new__(swt._DatasetMixin)
    explicit.__setstate__(given)
    explicit._take_device()
    assert explicit.options.device == "0000:3b:00.0"


@pytest.mark.parametrize("kw,message", [
    ({"seq_len": 2048}, "seq_len needs batch_size: token windows are delivered in batches"),
    ({"shuffle": "none"}, "shuffle need batch_size (batch mode)"),
    ({"drop_last": True, "partitions": 4}, "partitions, drop_last need batch_size (batch mode)"),
    ({"boundaries": True}, "boundaries need seq_len (token mode)"),
])
def test_shard_mode_refuses_the_keywords_it_would_ignore(sent, monkeypatch: pytest.MonkeyPatch, kw, message):
    """Without ``batch_size`` the dataset opens shard-mode streams, which take none of the
    batch- or token-mode keywords: before, it dropped them silently (``seq_len=2048`` with
    ``batch_size`` forgotten delivered whole shards). Now it refuses them as open_stream does,
    when it is made, and when a keyword set since as an attribute reaches the next iteration."""
    with pytest.raises(ValueError) as e:
        swt._DatasetMixin("d", socket="/nonexistent", **kw)
    assert str(e.value) == message
    ds = swt._DatasetMixin("d", socket="/nonexistent", **{"batch_size": 4, "seq_len": 8, **kw})
    ds.batch_size = None
    monkeypatch.setattr(swt, "_torch_ranks", lambda rank, world_size: (0, 1))
    with pytest.raises(ValueError, match="need"):
        ds._open_shards(client(), *ds._start())
    assert sent == []


def test_load_state_dict_in_a_worker_leaves_the_shared_epoch_alone():
    """The epoch is shared with the DataLoader's workers (so that `set_epoch` reaches a
    persistent one). `load_state_dict` in a worker (StatefulDataLoader loads each worker's own
    state there) overwrote it for the main process and the other workers; now the worker keeps
    its loaded epoch, until the main process names another."""
    import os
    import select
    import signal

    ds = swt._DatasetMixin("d", socket="/nonexistent")
    ds.set_epoch(1)
    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.close(parent_writes)  # so that a parent gone (a failed assert) ends the wait below
            ds.load_state_dict({"epoch": 0, "stream": {"epoch": 0, "index": 3, "seed": 0, "fingerprint": "f"}})
            os.write(child_writes, repr((ds.epoch, ds.state_dict()["epoch"], ds._resume is not None)).encode())
            os.read(child_reads, 1)  # the main process's set_epoch(2) came
            os.write(child_writes, repr(ds.epoch).encode())
        finally:
            os._exit(0)
    os.close(child_reads)
    os.close(child_writes)

    def child_says() -> bytes:
        # A child that hangs (a lock another thread held at the fork) fails the test, in time.
        assert select.select([parent_reads], [], [], 10)[0], "the forked worker did not answer"
        return os.read(parent_reads, 100)

    try:
        assert child_says() == b"(0, 0, True)", "the worker resumes its own epoch"
        assert ds.epoch == 1, "the main process's epoch is its own"
        ds.set_epoch(2)
        os.write(parent_writes, b"!")
        assert child_says() == b"2", "a later epoch of the main process wins"
    finally:
        os.close(parent_writes)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os.close(parent_reads)
    ds.load_state_dict({"epoch": 0, "stream": None})  # in the main process: the shared epoch
    assert ds.epoch == 0 and ds._epoch.value == 0
