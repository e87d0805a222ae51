"""`Stream.next(timeout=...)` of the Python socket SDK at the edges of its timeout:

- `timeout=0` while a batch is kept takes an answer that has already arrived (the one to the
  request the stream asked ahead of time): a polling loop gets its batch. Before, the wait
  while batches are kept checked its deadline before reading, so every such call raised
  Timeout with the batch on the socket, forever;
- a call that reads the node's late `timeout` answer to an earlier call's request asks again
  within what is left of its own timeout (before, with the whole of it again), and its Timeout
  names the timeout the caller gave.

Against a fake node on a socketpair (test_sdk_recovery's harness), and against a real node
(`shardwire source` + `shardwire serve`)."""

from __future__ import annotations

import threading
import time

import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
from conftest import serve_dataset, write_id_dataset
import shardwire  # noqa: E402
from shardwire import _wire  # noqa: E402
from test_binary_frames import framed  # noqa: E402
from test_sdk_recovery import batch, first_batch, interrupt, pair, requests, two_kept_and_one_in_flight  # noqa: E402,F401

TIMEOUT = framed(b'{"op":"timeout"}')


def test_a_zero_timeout_while_a_batch_is_kept_takes_the_answer_already_here(pair):
    s, node = pair
    b0 = first_batch(s, node).keep()  # the request asked ahead of time is in flight
    with pytest.raises(shardwire.Timeout):
        s.next(timeout=0)  # no answer yet: nothing to wait for
    assert requests(node) == [], "the request in flight is not asked again"
    node.sendall(batch(1))
    assert _wire.readable(s._conn.sock, 10), "the answer is on the socket"
    b1 = s.next(timeout=0)
    assert b1 is not None and (b1.lease, b1.index) == (2, 1)
    assert requests(node) == [], "the answer to the request in flight: nothing asked again"
    assert b0.kept and not b0.released


def test_a_late_timeout_answer_asks_again_within_what_is_left_of_the_call(pair, interrupt):
    """An interrupted `next(timeout=30)` leaves its request in flight; the node answers it
    with `timeout` 1 s into a later `next(timeout=2)`. That call asks again for what is left
    of its 2 s (about 1 s; before, 2 s again: a caller's timeout could be overrun by almost
    all of it), and its Timeout names 2 s."""
    s, node = pair
    b0, b1 = two_kept_and_one_in_flight(s, node, interrupt)
    assert requests(node) == [{"op": "next", "timeout_ms": 30000}]
    asked: list[dict] = []

    def play_the_node() -> None:
        time.sleep(1.0)
        node.sendall(TIMEOUT)  # the late answer to the interrupted call's request
        if _wire.readable(node, 10):
            asked.extend(requests(node) or [])  # the request the later call sends again
        node.sendall(TIMEOUT)

    player = threading.Thread(target=play_the_node, daemon=True)
    player.start()
    try:
        with pytest.raises(shardwire.Timeout, match=r"no batch within 2s "):
            s.next(timeout=2)
    finally:
        player.join(20)
    assert [r["op"] for r in asked] == ["next"], asked
    assert 0 <= asked[0]["timeout_ms"] <= 1100, f"asked again with {asked[0]['timeout_ms']} ms, not what was left"
    assert b0.kept and b1.kept and not s.closed


@pytest.fixture
def node(sw, tmp_path):
    d = tmp_path / "t"
    write_id_dataset(d, [[4] * 8, [4] * 8])
    return serve_dataset(sw, "t", d)


def test_a_polling_loop_with_a_kept_batch_gets_the_batch_asked_ahead(node):
    """Against a real node: `next()` hands a batch out and asks ahead; the batch is kept; a loop
    of `next(timeout=0)` gets the next batch once its answer is here (before: Timeout forever)."""
    with shardwire.connect(node.socket).open_stream("t", seed=1) as s:
        b0 = s.next(timeout=30).keep()
        deadline, timeouts = time.monotonic() + 30, 0
        while True:
            try:
                b1 = s.next(timeout=0)
                break
            except shardwire.Timeout:
                timeouts += 1
                assert time.monotonic() < deadline, f"no batch after {timeouts} polls: the answer was never read"
                time.sleep(0.01)
        assert b1 is not None and b1.index == b0.index + 1, (b0.index, b1)
        assert b0.kept and not b0.released
        b0.release()
        assert s.next(timeout=30).index == b1.index + 1  # the stream goes on as usual
