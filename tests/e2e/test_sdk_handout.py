"""A Python socket stream handing out a batch that has arrived, against a fake node on a
socketpair (the test plays the node), when an exception strikes part way or the answer is odd:

- a KeyboardInterrupt (a signal handler's exception) that strikes anywhere in a `next()` that
  hands out a batch that has arrived, from its entry to its return, loses nothing: the call
  raises, the stream's lock is free, `state_dict()` does not name the position after the
  batch, the next `next()` returns that same batch, and no reply is lost, decoded twice or
  paired with the wrong request, no lease released twice or never. CPython raises a handler's
  exception at a Python function's entry and right after a C function returns (3.10 also
  right after a Python function returns); a profile hook raises KeyboardInterrupt at each such
  point of one `next()` (or `__next__()`) in turn, a fresh stream each time: its `call`,
  `return` and `c_return` events, which take in the stream lock's acquire and release (the C
  ``RLock``'s). A batch left taken that way does not hold its stream while it waits. Not
  covered, because not achievable: the return of `next()` itself, where on 3.10 the
  exception lands in the caller's frame (the batch is the caller's then, and lost with that
  frame);
- another thread's close() or next() right after a `next()` let go of the stream's lock,
  before it returned its batch, takes nothing back: the batch stays the one `next()` returns;
- an interrupt anywhere in a call that takes the lock (close() too) leaves a close() that
  closes the connection;
- the release paths an interrupt used to cut between marking a lease and sending it (the
  release of the batch before one handed out while batches are kept, `Batch.release()`, a
  kept batch's release handed over to the call that holds the stream, the releases at the
  end): the lease goes with a later request;
- a batch an interrupt left taken and not handed out does not keep a dropped stream open;
- a `more` flag on an answer to `next` that is not a batch is a ProtocolError that closes the
  stream (before, it left a `next` in flight that the node never answers, and the following
  `next()` waited for ever);
- a JSON batch that carries a `dtypes` field is read as JSON (before, it passed for a binary
  batch and raised KeyError); an `info` answer whose `lanes` is not a list is a ProtocolError.
"""

from __future__ import annotations

import gc
import json
import socket
import sys
import threading
from collections.abc import Callable
from itertools import count
from typing import Any

import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
import shardwire  # noqa: E402
from shardwire import _client, _wire  # noqa: E402
from shardwire._errors import ProtocolError  # noqa: E402
from test_binary_frames import framed  # noqa: E402
from test_sdk_hardening import GOOD, STATE, bounded, closes  # noqa: E402
from test_sdk_recovery import MORE, attached, batch, first_batch, no_gc, pair, requests  # noqa: E402, F401

#: The most interrupt points one `next()` is expected to have (a bound on the sweep).
MAX_POINTS = 5000

#: The profile events where the sweep raises (see the module's docstring).
POINTS = ("call", "return", "c_return")


def json_batch(k: int) -> bytes:
    """The framed JSON reply of batch `k` (as :func:`test_sdk_recovery.batch` lays it out)."""
    tensor = {"name": "x", "dtype": "float32", "shape": [4, 8], "offset": k * 4096, "length": 128}
    body = {**GOOD, "lease": k + 1, "index": k, "tensors": [tensor], "state": {**STATE, "index": k + 1}}
    return framed(json.dumps(body).encode())


def interrupted_at(call: Callable[..., Any], point: int, struck: list[str], **kw: Any) -> Any:
    """`call(**kw)` with a KeyboardInterrupt raised at its `point`-th interrupt point (1-based:
    each Python function entered or returned from and each C function returned from, from the
    call's entry to its return, that return excluded). "interrupted" if it struck (where,
    appended to `struck`); else what the call returned (it had fewer points)."""
    seen = 0
    outer: list[Any] = []  # the call's own frame once entered, then None once it returned

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        if not outer:
            if event != "call":
                return  # setprofile's own return
            outer.append(frame)
        elif event == "return" and frame is outer[0]:
            outer.append(None)  # its return lands in the caller's frame: not counted
        if len(outer) > 1 or event not in POINTS:
            return
        seen += 1
        if seen == point:  # raising also removes the hook: one interrupt per call
            name = getattr(arg, "__qualname__", "?") if event == "c_return" else frame.f_code.co_name
            struck.append(f"{event} of {name}")
            raise KeyboardInterrupt(f"injected at point {point}: {struck[-1]}")

    # No cyclic garbage collection meanwhile: a finalizer it ran (of an object an earlier
    # point left in a cycle) would take the interrupt and swallow it, ending the sweep early.
    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(hook)
    try:
        return call(**kw)
    except KeyboardInterrupt:
        return "interrupted"
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()


def released_leases(sent: list[dict[str, Any]]) -> list[int]:
    """The leases the requests `sent` release, in `next`'s list or on their own."""
    out = []
    for r in sent:
        out += r.get("release", []) if r["op"] == "next" else [r["lease"]] if r["op"] == "release" else []
    return out


def kept(b0: shardwire.Batch) -> None:
    """Batch 0 kept (then dropped: its lease waits in the stream's queue of dropped kept
    batches, which the next call drains)."""
    b0.keep()


#: What the node sends after batch 0 was handed out (a `next` for 8 in flight), the leases the
#: stream then hands out in turn (the last with the node's next answer, batch(k)), and what
#: the test does with batch 0 before it drops it.
SCENARIOS: dict[str, tuple[Callable[[], bytes], list[int], Callable[[shardwire.Batch], None] | None]] = {
    "a reply alone in its receive": (lambda: batch(1), [2, 3], None),
    "a group split from one receive": (lambda: batch(1, MORE) + batch(2), [2, 3, 4], None),
    "a JSON batch": (lambda: json_batch(1), [2, 3], None),
    # The release of a kept batch garbage-collected: drained, and released with the request
    # the hand-out sends ahead (before, an interrupt as `popleft()` returned lost the lease,
    # and left it kept: nothing was asked ahead any more).
    "a kept batch dropped before": (lambda: batch(1), [2, 3], kept),
}


@pytest.mark.parametrize("call", ["next", "__next__"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_an_interrupt_anywhere_in_a_hand_out_consumes_nothing(scenario, call):
    """For each point where a signal handler's exception can land in the `next()` that hands
    out batch 1 (whose answer has arrived): the call raises KeyboardInterrupt, the stream's
    lock is free and the stream still names batch 1 as not taken; the next call hands out
    batch 1 (lease 2), the batches after it follow in order, and no lease is released twice
    or never. The one exception is a write cut short (the request sent ahead after the
    batch): the stream is closed then, as documented, and its state still names batch 1.

    Before: an interrupt after the reply's receipt lost batch 1 (its state taken, or the reply
    dropped and the next call waiting for ever), or handed a batch out twice; one as
    `_consume` returned (3.10) lost it; one at the stream lock's Python ``__exit__`` left the
    lock held (every later call raised RuntimeError, ``close()`` left the stream open) and
    ``state_dict()`` past batch 1; one as ``RLock.__exit__`` returned lost batch 1; one as
    `_next` returned into `next` (3.10) left batch 1 holding its stream (a stream dropped
    then kept its connection until the garbage collector ran)."""
    send, leases, setup = SCENARIOS[scenario]
    struck: list[str] = []
    for point in count(1):
        assert point < MAX_POINTS, "the sweep never ended: a next() without an end"
        s, node = attached()
        try:
            node.sendall(batch(0))
            b0 = s.next(timeout=5)
            assert b0.lease == 1
            if setup is not None:
                setup(b0)
            del b0
            assert list(s._dropped) == ([1] if setup is not None else []), "a kept batch dropped is queued"
            node.sendall(send())
            with bounded(20):
                kw = {"timeout": 5} if call == "next" else {}
                got = interrupted_at(getattr(s, call), point, struck, **kw)
                if got != "interrupted":
                    assert got.lease == 2, f"point {point}: no interrupt point left, but batch {got} came"
                    assert s._unclaimed is None and s.state_dict()["index"] == 2
                    break
                where = f"after an interrupt at point {point} ({struck[-1]})"
                assert not s._lock.locked(), f"{where}: the stream's lock is still held"
                assert s.state_dict()["index"] == 1, f"{where}: the state moved past batch 1, not handed out"
                left = s._unclaimed
                assert left is None or left.batch._stream is None, f"{where}: the batch left taken holds its stream"
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
    points = ["c_return of RLock.acquire", "c_return of RLock.release", "return of _take", "return of _hand_out"]
    for what in points + ["return of _next"] * (call == "next"):
        assert what in struck, f"the sweep never struck at the {what}: {sorted(set(struck))}"


@pytest.mark.parametrize("call", ["state_dict", "keep", "release", "close"])
def test_an_interrupt_anywhere_in_a_call_that_takes_the_lock_leaves_it_free(call):
    """For each interrupt point of a call that takes the stream's lock: once it raised, the lock
    is free and `close()` closes the stream and its connection. Before, one as the lock's
    acquire returned inside the Python ``__enter__`` (or a Python ``acquire``) left it held:
    the thread's every later call was refused as a second wait, and its `close()` returned
    with the stream open; and a `close()` struck after it marked the stream closed, before it
    closed the connection, left the connection open for good (a later `close()` returned at
    once)."""
    struck: list[str] = []
    for point in count(1):
        assert point < MAX_POINTS, "the sweep never ended"
        s, node = attached()
        try:
            node.sendall(batch(0))
            b0 = s.next(timeout=5)  # a `next` for 8 asked ahead: a release goes behind it
            if call == "release":
                b0.keep()  # released by its own request
            target = {"state_dict": s.state_dict, "keep": b0.keep, "release": b0.release, "close": s.close}[call]
            with bounded(20):
                if interrupted_at(target, point, struck) != "interrupted":
                    break
                where = f"after an interrupt at point {point} ({struck[-1]})"
                assert not s._lock.locked(), f"{where}: the stream's lock is still held"
                s.close()
                assert s.closed, f"{where}: close() left the stream open"
                assert closes(node, wait=2), f"{where}: close() left the connection open"
        finally:
            s.close()
            node.close()
    assert any("acquire" in w or "__exit__" in w for w in struck), f"the sweep never struck at the lock: {sorted(set(struck))}"


# B re-hands a batch A left without `_after_take`: "interrupted" has no point to strike there.
_CASES = [(o, r) for o in ("close", "next", "fails") for r in (False, True)] + [("interrupted", False)]


@pytest.mark.parametrize("other,a_raises", _CASES, ids=[f"{o}-{'raises' if r else 'returns'}" for o, r in _CASES])
def test_another_threads_call_as_next_lets_go_of_the_lock_takes_nothing_back(other, a_raises, monkeypatch):
    """Thread A's `next()` takes batch 1 and is paused right after it let go of the stream's
    lock (a profile hook at the lock's release: a thread switch there); thread B (the test)
    then calls close(), next(), or a next() that raises at once (a bad timeout).

    Where A returns batch 1, batch 1 stays A's: after close(), `state_dict()` names the
    position after it; B's `next()` gets batch 2; B's failed call leaves A's batch alone.
    Before, close() rolled the state back to before batch 1 (a resume delivered it twice),
    B's `next()` handed batch 1 out a second time, and B's failed call took the stream from
    A's batch (its keep() and release() then failed). Where A raises (an interrupt after the
    hand-out, here at `_build_ahead`'s entry), batch 1 is not A's: close() rolls the state
    back to before it, and B's `next()` (the next one, after a failed call) gets it.

    "interrupted": B's `next()` takes batch 2 and is interrupted after recording it (at
    `_after_take`'s entry), then A goes on: A must not clear B's record (before, it did, and
    batch 2 was never delivered while `state_dict()` named the position after it)."""
    s, node = attached()
    try:
        node.sendall(batch(0))
        assert s.next(timeout=5).lease == 1
        if a_raises:
            interrupt_once(monkeypatch, _client.Stream, "_build_ahead")
            node.sendall(batch(1, MORE) + batch(2))  # the first of a group: the rest is built
        else:
            node.sendall(batch(1) + batch(2))  # batch 2: the answer to the request A sends ahead
        raw, paused, go, got = s._lock.raw, threading.Event(), threading.Event(), []

        def hook(frame: Any, event: str, arg: Any) -> None:
            # The lock's release returned (`release`; a `with`'s `__exit__` before): B runs.
            released = event == "c_return" and getattr(arg, "__self__", None) is raw
            if released and arg.__name__ in ("release", "__exit__") and not paused.is_set():
                paused.set()
                go.wait(10)

        def thread_a() -> None:
            sys.setprofile(hook)
            try:
                got.append(s.next(timeout=5))
            except KeyboardInterrupt:
                got.append(None)
            finally:
                sys.setprofile(None)

        a = threading.Thread(target=thread_a)
        a.start()
        try:
            assert paused.wait(10), "thread A never let go of the stream's lock"
            with bounded(20):
                if other == "close":
                    s.close()
                elif other == "next":
                    b = s.next(timeout=5)
                elif other == "interrupted":
                    interrupt_once(monkeypatch, _client.Stream, "_after_take")
                    with pytest.raises(KeyboardInterrupt):
                        s.next(timeout=5)
                else:
                    with pytest.raises(ValueError):
                        s.next(timeout=-1)
        finally:
            go.set()
            a.join(10)
        assert not a.is_alive() and len(got) == 1, f"thread A's next() did not end: {got}"
        if not a_raises:
            assert (got[0].lease, got[0].index) == (2, 1), f"thread A got {got[0]}"
            assert got[0]._stream is s, "B's call took the stream from A's batch"
        else:
            assert got == [None], "A's next() raised"
        if other == "close":
            want = 1 if a_raises else 2
            assert s.state_dict()["index"] == want, f"state_dict() after close() is not at index {want}"
            return
        if other in ("fails", "interrupted"):
            b = s.next(timeout=5)
        want = (2, 1) if a_raises else (3, 2)  # batch 1 if A left it, else batch 2
        assert (b.lease, b.index) == want, f"thread B got {b}, not lease {want[0]}"
        assert b._stream is s and s._unclaimed is None and s.state_dict()["index"] == want[1] + 1
    finally:
        s.close()
        node.close()


def interrupt_once(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
    """A KeyboardInterrupt at the entry of the first call of `cls.name` (as Ctrl-C lands at a
    Python function's entry); the calls after it run as they would."""
    real, calls = getattr(cls, name), [0]

    def interrupted(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt(f"injected at the entry of {name}")
        return real(*args, **kw)

    monkeypatch.setattr(cls, name, interrupted)


def test_an_interrupt_before_the_release_with_a_hand_out_went_out_leaves_it_to_the_next_request(pair, monkeypatch):
    """While batches are kept nothing is asked ahead, so handing out the last batch of a group
    releases the one before it on its own request. An interrupt before that request went out
    (here at `_send`'s entry) leaves the lease to the next request. Before, the lease was
    marked released and never sent: held on the node until the stream closed."""
    s, node = pair
    node.sendall(batch(0, MORE) + batch(1, MORE) + batch(2))
    b0 = s.next(timeout=10).keep()
    b1 = s.next(timeout=10)
    assert requests(node) == [{"op": "next", "timeout_ms": 10000, "count": 8}]
    interrupt_once(monkeypatch, _client.Stream, "_send")
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)  # batch 2 taken; the release of batch 1 did not go out
    assert requests(node) == [] and b1.released and s.state_dict()["index"] == 2
    b2 = s.next(timeout=10)
    assert (b2.lease, s.state_dict()["index"]) == (3, 3) and requests(node) == []
    node.sendall(batch(3))
    assert s.next(timeout=10).lease == 4
    assert requests(node) == [{"op": "next", "release": [2, 3], "timeout_ms": 10000}], "count 1 while one is kept"
    assert b0.kept and not b0.released


def test_an_interrupt_before_a_release_went_out_leaves_it_to_the_next_request(pair, monkeypatch):
    """`Batch.release()` struck after the batch was marked released, before its request went
    out (here at `_send`'s entry): the lease goes with the next request. Before, it was lost
    (held on the node until the stream closed)."""
    s, node = pair
    b0 = first_batch(s, node).keep()
    node.sendall(batch(1))
    assert s.next(timeout=10).lease == 2 and requests(node) == [], "nothing asked ahead: a batch is kept"
    interrupt_once(monkeypatch, _client.Stream, "_send")
    with pytest.raises(KeyboardInterrupt):
        b0.release()
    assert b0.released and requests(node) == []
    node.sendall(batch(2))
    assert s.next(timeout=10).lease == 3
    sent = requests(node)
    assert sent[0] == {"op": "next", "release": [1, 2], "timeout_ms": 10000, "count": 8}, sent
    assert sent[1:] == [{"op": "next", "count": 8}], "none kept: asked ahead again"


def test_an_interrupt_while_a_kept_batch_is_handed_over_leaves_its_lease_queued(pair, monkeypatch):
    """A kept batch released while the stream's own call holds its lock (from a signal handler
    that interrupted it, or another thread while it waits) is handed over to that call. One
    that strikes right after the batch was marked released (here at `_let_go`'s entry) left
    its lease neither released nor queued, and the stream never asked ahead again (a batch
    still counted as kept). Now the lease goes with the next request."""
    s, node = pair
    b0 = first_batch(s, node).keep()
    interrupt_once(monkeypatch, _client.Batch, "_let_go")
    s._lock.raw.acquire()  # as the interrupted call holds it
    try:
        with pytest.raises(KeyboardInterrupt):
            b0.release()
    finally:
        s._lock.raw.release()
    assert b0.released and list(s._dropped) == [1]
    node.sendall(batch(1))
    assert s.next(timeout=10).lease == 2
    assert requests(node) == [{"op": "next", "release": [1], "count": 8}], "asked ahead, releasing it"


def test_an_interrupt_in_the_releases_at_the_end_leaves_them_to_the_next_call(pair, monkeypatch):
    """At the `end` answer the batch before goes on its own request. An interrupt before it was
    claimed (here at `_defer_release`'s entry) leaves it to the next call, which returns None
    and releases it. Before, it was dropped from the stream's books unreleased (held on the
    node until the stream closed)."""
    s, node = pair
    first_batch(s, node)  # batch 0 the trainer's; a `next` for 8 in flight
    node.sendall(framed(b'{"op":"end"}') + framed(b'{"op":"released"}'))
    interrupt_once(monkeypatch, _client.Stream, "_defer_release")
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)
    assert requests(node) == []
    assert s.next(timeout=10) is None
    assert requests(node) == [{"op": "release", "lease": 1}]
    assert s.next(timeout=10) is None and not s._inflight and requests(node) == [], "its answer read, once"


def test_a_stream_dropped_after_an_interrupted_hand_out_closes_at_once(no_gc, monkeypatch):
    """A batch an interrupt left taken and not handed out does not hold its stream: dropped
    without close(), the stream's connection closes at once. Before, that batch and the stream
    held each other, and the connection (the node's leases, its stream memory) waited for the
    garbage collector."""
    s, node = attached()
    with node:
        first_batch(s, node)
        interrupt_once(monkeypatch, _client.Stream, "_build_ahead")
        node.sendall(batch(1, MORE) + batch(2))
        try:
            s.next(timeout=10)
        except KeyboardInterrupt:
            pass
        assert s._unclaimed is not None
        del s
        assert closes(node, wait=2), "the node saw no end of the dropped stream"


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
