"""A Python socket stream handing out a batch that has arrived, against a fake node on a
socketpair (the test plays the node), when an exception strikes part way or the answer is odd:

- a KeyboardInterrupt (a signal handler's exception) that strikes anywhere between the reply's
  receipt and the batch's hand-out consumes nothing: the next `next()` returns that same
  batch, `state_dict()` never names the position after a batch not handed out, and no reply
  is lost, decoded twice or paired with the wrong request. CPython raises a handler's
  exception at a Python function's entry and right after a C function returns; a profile hook
  raises KeyboardInterrupt at each such point of one `next()` in turn (a fresh stream each
  time), which is every place a Ctrl-C could land;
- a `more` flag on an answer to `next` that is not a batch is a ProtocolError that closes the
  stream (before, it left a `next` in flight that the node never answers, and the following
  `next()` waited for ever);
- a JSON batch that carries a `dtypes` field is read as JSON (before, it passed for a binary
  batch and raised KeyError); an `info` answer whose `lanes` is not a list is a ProtocolError.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable
from itertools import count
from typing import Any

import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
import shardwire  # noqa: E402
from shardwire import _client, _wire  # noqa: E402
from shardwire._errors import ProtocolError  # noqa: E402
from test_binary_frames import framed  # noqa: E402
from test_sdk_hardening import GOOD, STATE, bounded  # noqa: E402
from test_sdk_recovery import MORE, attached, batch, first_batch, pair, requests  # noqa: E402, F401

#: The most interrupt points one `next()` is expected to have (a bound on the sweep).
MAX_POINTS = 5000


def json_batch(k: int) -> bytes:
    """The framed JSON reply of batch `k` (as :func:`test_sdk_recovery.batch` lays it out)."""
    tensor = {"name": "x", "dtype": "float32", "shape": [4, 8], "offset": k * 4096, "length": 128}
    body = {**GOOD, "lease": k + 1, "index": k, "tensors": [tensor], "state": {**STATE, "index": k + 1}}
    return framed(json.dumps(body).encode())


def next_interrupted_at(s: _client.Stream, point: int) -> shardwire.Batch | None | str:
    """`s.next(timeout=5)` with a KeyboardInterrupt raised at its `point`-th interrupt point
    (1-based: each Python function entered and each C function returned from, counted from the
    stream's `_take` on). "interrupted" if it struck; else what `next` returned (the call had
    fewer points)."""
    seen = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        if event in ("call", "c_return"):
            seen += 1
            if seen == point:  # raising also removes the hook: one interrupt per call
                raise KeyboardInterrupt(f"injected at point {point}: {event} of {getattr(arg, '__qualname__', frame.f_code.co_name)}")

    real = _client.Stream._take

    def take(self: _client.Stream, timeout: float | None) -> Any:
        sys.setprofile(hook)
        try:
            return real(self, timeout)
        finally:
            sys.setprofile(None)

    _client.Stream._take = take  # type: ignore[method-assign]
    try:
        return s.next(timeout=5)
    except KeyboardInterrupt:
        return "interrupted"
    finally:
        _client.Stream._take = real  # type: ignore[method-assign]


def released_leases(sent: list[dict[str, Any]]) -> list[int]:
    """The leases the requests `sent` release, in `next`'s list or on their own."""
    out = []
    for r in sent:
        out += r.get("release", []) if r["op"] == "next" else [r["lease"]] if r["op"] == "release" else []
    return out


#: What the node sends after batch 0 was handed out (a `next` for 8 in flight), and the
#: leases the stream then hands out in turn (the last with the node's next answer, batch(k)).
SCENARIOS: dict[str, tuple[Callable[[], bytes], list[int]]] = {
    "a reply alone in its receive": (lambda: batch(1), [2, 3]),
    "a group split from one receive": (lambda: batch(1, MORE) + batch(2), [2, 3, 4]),
    "a JSON batch": (lambda: json_batch(1), [2, 3]),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_an_interrupt_anywhere_in_a_hand_out_consumes_nothing(scenario):
    """For each point where a signal handler's exception can land in the `next()` that hands
    out batch 1 (whose answer has arrived): the call raises KeyboardInterrupt and the stream
    still names batch 1 as not taken; the next call hands out batch 1 (lease 2), the batches
    after it follow in order, and no lease is released twice. The one exception is a write
    cut short (the request sent ahead after the batch): the stream is closed then, as
    documented, and its state still names batch 1. Before, an interrupt after the reply's
    receipt lost batch 1 (its state taken, or the reply dropped and the next call waiting for
    ever), or handed a batch out twice."""
    send, leases = SCENARIOS[scenario]
    for point in count(1):
        assert point < MAX_POINTS, "the sweep never ended: a next() without an end"
        s, node = attached()
        try:
            node.sendall(batch(0))
            assert s.next(timeout=5).lease == 1
            node.sendall(send())
            with bounded(20):
                got = next_interrupted_at(s, point)
                if got != "interrupted":
                    assert got.lease == 2, f"point {point}: no interrupt point left, but batch {got} came"
                    break
                where = f"after an interrupt at point {point}"
                assert s.state_dict()["index"] == 1, f"{where}: the state moved past batch 1, not handed out"
                if s.closed:
                    assert _wire.TORN in s._closed_why, f"{where}: closed: {s._closed_why}"
                    continue
                for lease in leases:
                    if lease == leases[-1]:
                        node.sendall(batch(lease - 1))  # the answer to the request now in flight
                    b = s.next(timeout=5)
                    assert (b.lease, b.index) == (lease, lease - 1), f"{where}: {b} came instead of lease {lease}"
                    assert s.state_dict()["index"] == lease, where
            gone = released_leases(requests(node, wait=0))
            assert sorted(set(gone)) == sorted(gone), f"{where}: a lease released twice: {gone}"
            assert set(range(1, leases[-1] - 1)) <= set(gone), f"{where}: leases not released: {gone}"
        finally:
            s.close()
            node.close()
    assert point > 20, f"only {point} interrupt points: the hook did not see the hand-out"


def test_an_interrupt_while_the_batch_is_recorded_as_handed_out_loses_nothing(pair, monkeypatch):
    """The review's case: Ctrl-C lands at `_Held.__init__`, the last step before the hand-out.
    Before, `state_dict()` already named the position after batch 1 and the next call
    returned batch 2."""
    s, node = pair
    b0 = first_batch(s, node)
    real, hits = _client._Held.__init__, []

    def interrupted(self: Any, b: Any) -> None:
        hits.append(b.lease)
        if len(hits) == 1:
            raise KeyboardInterrupt("injected at _Held.__init__")
        real(self, b)

    monkeypatch.setattr(_client._Held, "__init__", interrupted)
    node.sendall(batch(1, MORE) + batch(2))
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)
    assert s.state_dict()["index"] == 1 and not b0.released and not s.closed
    b1 = s.next(timeout=10)
    assert (b1.lease, b1.index) == (2, 1) and s.state_dict()["index"] == 2
    assert s.next(timeout=10).lease == 3
    assert requests(node) == [{"op": "next", "release": [1, 2], "count": 8}]
    node.sendall(batch(3))
    assert s.next(timeout=10).lease == 4


@pytest.mark.parametrize("answer", [
    b'{"op":"error","code":"closed","message":"x","more":true}',
    b'{"op":"timeout","more":true}',
])
def test_more_on_an_answer_that_is_not_a_batch_is_a_protocol_error(pair, answer):
    """Before, the `next` stayed in flight: an error answer raised ServiceError, a timeout
    asked nothing and raised Timeout, and the following `next()` waited for ever for an
    answer the node would never send."""
    s, node = pair
    first_batch(s, node)  # a `next` for 8 in flight
    node.sendall(framed(answer))
    with bounded(10):
        with pytest.raises(ProtocolError, match="`more` set on an answer that is not a batch"):
            s.next(timeout=2)
        assert s.closed and requests(node, wait=5) is None, "the node sees the connection close"
        with pytest.raises(shardwire.ShardwireError) as e:
            s.next()
    assert e.value.code == "closed"
    assert s.state_dict()["index"] == 1


def test_a_json_batch_with_a_dtypes_field_is_read_as_json(pair):
    s, node = pair
    first_batch(s, node)
    body = json.loads(json_batch(1)[4:])
    node.sendall(framed(json.dumps({**body, "dtypes": []}).encode()))
    b1 = s.next(timeout=10)
    assert (b1.lease, b1.index, list(b1), b1["x"].shape) == (2, 1, ["x"], (4, 8))
    assert s.state_dict()["index"] == 2


def test_a_malformed_json_batch_with_a_dtypes_field_is_a_protocol_error(pair):
    """Before: KeyError('views'), the stream left open, its answer and the batch's lease
    consumed."""
    s, node = pair
    first_batch(s, node)
    node.sendall(framed(b'{"op":"batch","lease":2,"epoch":0,"index":1,"shard":0,"state":{},"dtypes":[]}'))
    with pytest.raises(ProtocolError, match="tensors"):
        s.next(timeout=10)
    assert s.closed and requests(node, wait=5) is None


@pytest.mark.parametrize("lanes", [5, "0", {"lane": 0}])
def test_an_info_answer_whose_lanes_is_not_a_list_is_a_protocol_error(lanes):
    a, node = socket.socketpair()
    with a, node:
        node.sendall(framed(json.dumps({"op": "info", "memory": "host", "lanes": lanes}).encode()))
        with pytest.raises(ProtocolError, match="not a list"):
            _client._info(_wire.Conn(a))
