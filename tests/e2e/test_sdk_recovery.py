"""What a Python socket stream does when a `next` fails part way, against a fake node on a
socketpair (the test plays the node: it reads the requests and writes the replies):

- a malformed reply (one decoded together with the batch before it, or a batch whose tensor
  lies outside the region) raises ProtocolError once and closes the stream: the node sees the
  connection close, which releases every lease (the previous batch's too), and later calls
  raise `closed` at once instead of waiting for an answer that was already read, or raising
  Timeout forever without sending a request;
- a KeyboardInterrupt while `next` waits consumes nothing: the stream stays usable, the
  previous batch is still the trainer's and its lease goes with the next request; one while a
  hand-out releases the previous batch loses no batch (the next call hands it out);
- a connection lost when the stream sends its request ahead of time, after the last batch of a
  group arrived, does not cost that batch: it is handed out (with its resume state), and the
  call after it raises ConnectionClosed;
- `close()` from another thread wakes a `next` that waits and makes it raise `closed`; from a
  signal handler that strikes as a `next` hands out a batch (nothing waits to be woken), that
  call returns its batch and the next one raises `closed`, handing out none of the batches
  that had arrived;
- a timeout longer than one `poll` can wait, or infinite, waits; NaN is refused;
- a stream the trainer drops without `close()` closes its connection at once (no reference
  cycle waits for the garbage collector), unless a batch it handed out is still alive; a batch
  the trainer dropped is still released, a kept one too (with the next request);
- at the end of the stream every release that waited is sent even if the node refuses one;
  closing drops a batch an interrupt left taken, so the region is unmapped at close;
- a KeyboardInterrupt while a request is written: once it went out whole, it stays in flight
  (its answer paired with it, its releases not sent again); before any of it went out, the
  next call sends it; cut short, the stream is closed saying why;
- `state_dict()` after the connection was lost (or close()) still names the batch after the
  last one handed out.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import select
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import sdk_harness  # noqa: F401  (puts the SDK on sys.path)
from conftest import next_in_forked_child, wait_for
import shardwire  # noqa: E402
from shardwire import _binary, _client, _wire  # noqa: E402
from shardwire._errors import ConnectionClosed, ProtocolError  # noqa: E402
from shardwire._types import StreamInfo  # noqa: E402
from test_binary_frames import documented_body, framed  # noqa: E402

REGION = 1 << 16
MORE = _binary.FLAG_MORE


def batch(k: int, flags: int = 0, **kw: Any) -> bytes:
    """The framed binary reply of batch `k` (lease k + 1, index k, its own 4 KiB of the region)."""
    return framed(documented_body(**{"lease": k + 1, "index": k, "offset": k * 4096, "flags": flags, **kw}))


def attached() -> tuple[_client.Stream, socket.socket]:
    """A stream attached (as `Stream._open` leaves it) to a socketpair whose other end the test
    plays the node on; the region is a 64 KiB memfd."""
    a, node = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("region")
    os.ftruncate(fd, REGION)
    region = mmap.mmap(fd, REGION, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    info = StreamInfo(stream=1, region_size=REGION, batches_per_epoch=10, epochs=1, memory="host",
                      state={"epoch": 0, "index": 0, "seed": 1, "fingerprint": "f"})
    return _client.Stream(_wire.Conn(a), region, info), node


@pytest.fixture
def pair() -> Iterator[tuple[_client.Stream, socket.socket]]:
    """An :func:`attached` stream and the node's end, both closed after the test."""
    s, node = attached()
    yield s, node
    s.close()
    node.close()


def requests(node: socket.socket, wait: float = 0.2) -> list[dict[str, Any]] | None:
    """The requests the stream sent, in order, that arrived within `wait` s; None once the
    stream has closed the connection (after the requests before that)."""
    data, closed = b"", False
    while _wire.readable(node, wait):
        got = node.recv(1 << 16)
        if not got:
            closed = True
            break
        data += got
    out, at = [], 0
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        out.append(json.loads(data[at + 4 : at + 4 + n]))
        at += 4 + n
    assert not (closed and out), f"requests {out} before the close"
    return None if closed else out


def first_batch(s: _client.Stream, node: socket.socket) -> shardwire.Batch:
    """Batch 0, taken with the request `next` sends now; the stream then asks ahead (nothing
    to release yet)."""
    node.sendall(batch(0))
    b0 = s.next()
    assert b0.lease == 1
    assert requests(node) == [{"op": "next", "count": 8}, {"op": "next", "count": 8}]
    return b0


def two_kept_and_one_in_flight(s: _client.Stream, node: socket.socket, interrupt) -> tuple[shardwire.Batch, shardwire.Batch]:
    """Batches 0 and 1, both kept, then a `next(timeout=30)` cut short by an interrupt: its
    request stays in flight."""
    b0 = first_batch(s, node).keep()
    node.sendall(batch(1))
    b1 = s.next(timeout=10).keep()  # nothing in flight now: both kept
    interrupt(0.3, node)
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=30)
    return b0, b1


BAD = {
    # Decoded in the same receive as the good batch before it, kept for its turn.
    "decoded-with-the-group": lambda: batch(1, MORE) + framed(documented_body(lease=3, index=2)[:40]),
    # Decoded fine, but its tensor lies outside the region: the Batch cannot be built.
    "outside-the-region": lambda: batch(1, offset=REGION),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_reply_closes_the_stream_and_its_connection(pair, case):
    s, node = pair
    b0 = first_batch(s, node)
    node.sendall(BAD[case]())
    if case == "decoded-with-the-group":
        assert s.next(timeout=10).lease == 2, "the good batch before the malformed one is handed out"
    with pytest.raises(ProtocolError):
        s.next(timeout=10)
    assert s.closed, "a stream whose replies cannot be trusted is closed"
    # Closing the connection is what releases every lease on the node (b0's included).
    assert requests(node, wait=5) is None, "the node sees the connection close"
    assert b0.released
    for call in (lambda: s.next(timeout=0.5), lambda: s.next(), lambda: next(s)):
        with pytest.raises(shardwire.ShardwireError) as e:
            call()
        assert e.value.code == "closed" and "malformed reply" in e.value.message, e.value
    # The position after the last batch handed out is held here: it still resumes.
    assert s.state_dict()["index"] == (2 if case == "decoded-with-the-group" else 1)


def test_a_json_batch_without_its_fields_is_a_protocol_error(pair):
    """A JSON `batch` reply that lacks a field the SDK reads raises ProtocolError naming it
    (not a KeyError), and closes the stream like any malformed reply."""
    s, node = pair
    first_batch(s, node)
    node.sendall(framed(b'{"op":"batch","lease":2,"epoch":0,"index":1,"shard":0,"state":{}}'))
    with pytest.raises(ProtocolError, match="tensors"):
        s.next(timeout=10)
    assert s.closed and requests(node, wait=5) is None


def test_a_json_batch_with_a_negative_dimension_is_a_protocol_error(pair):
    """A JSON shape of [-1, -4] over 16 bytes of float32 passes a product check (4 x 4 bytes)
    but is no shape: numpy would infer the -1, DLPack would carry it to the consumer. The SDK
    refuses it as malformed."""
    s, node = pair
    first_batch(s, node)
    bad = {"op": "batch", "lease": 2, "epoch": 0, "index": 1, "shard": 0, "state": {},
           "tensors": [{"name": "x", "dtype": "float32", "shape": [-1, -4], "offset": 4096, "length": 16}]}
    node.sendall(framed(json.dumps(bad).encode()))
    with pytest.raises(ProtocolError, match="outside 0..2"):
        s.next(timeout=10)
    assert s.closed


@pytest.fixture
def interrupt() -> Iterator[Any]:
    """`arm(t)`: a KeyboardInterrupt in the main thread after `t` s (as Ctrl-C would raise it
    in a trainer waiting in `next`). `arm(t, node)`: `t` s after the SDK's request reaches
    `node` (the fake node's end), so a loaded machine that is slow to send it does not see
    the interrupt before the request was made."""

    def raise_interrupt(*_: Any) -> None:
        raise KeyboardInterrupt("interrupted in the test")

    stop = threading.Event()
    armed: list[threading.Thread] = []

    def arm(t: float, node: socket.socket | None = None) -> None:
        if node is None:
            signal.setitimer(signal.ITIMER_REAL, t)
            return
        main = threading.main_thread().ident
        assert main is not None

        def fire() -> None:
            while not stop.is_set() and not select.select([node], [], [], 0.1)[0]:
                pass
            if not stop.wait(t):
                signal.pthread_kill(main, signal.SIGALRM)

        armed.append(threading.Thread(target=fire, daemon=True))
        armed[-1].start()

    old = signal.signal(signal.SIGALRM, raise_interrupt)
    yield arm
    stop.set()
    for th in armed:
        th.join()
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_an_interrupt_while_waiting_leaves_the_stream_usable(pair, interrupt, timeout):
    s, node = pair
    b0 = first_batch(s, node)
    interrupt(0.3)
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout)
    assert not s.closed and not b0.released, "nothing was consumed: the previous batch is still the trainer's"
    assert requests(node) == [], "the request sent ahead stays in flight; nothing more is sent"
    node.sendall(batch(1))
    b1 = s.next(timeout)
    assert (b1.lease, b1.index) == (2, 1) and b0.released
    assert requests(node) == [{"op": "next", "release": [1], "count": 8}], "b0's lease rides on the next request"
    node.sendall(batch(2))
    assert s.next(timeout).lease == 3
    assert requests(node) == [{"op": "next", "release": [2], "count": 8}]


def test_an_interrupt_before_a_request_sent_now_is_answered(pair, interrupt):
    """While batches are kept nothing is asked ahead: `next` sends its request now (carrying the
    previous batch's release). Interrupted while it waits, the request stays in flight and the
    next call takes its answer without asking again."""
    s, node = pair
    b0 = first_batch(s, node)
    b0.keep()
    node.sendall(batch(1))
    b1 = s.next(timeout=10)
    assert requests(node) == []
    interrupt(0.3, node)
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=30)
    assert requests(node) == [{"op": "next", "timeout_ms": 30000, "release": [2]}]
    assert b1.released and not s.closed
    node.sendall(batch(2))
    assert s.next(timeout=30).lease == 3
    assert requests(node) == [], "the answer was the one in flight: nothing asked again"
    node.sendall(framed(b'{"op":"released"}'))  # read once the release is sent
    b0.release()
    assert requests(node) == [{"op": "release", "lease": 1}]


def test_the_last_batch_of_a_group_is_handed_out_when_the_connection_is_lost(pair):
    """The node answers the request sent ahead with a group of three and goes away. The
    stream hands out all three (the last one too: its request ahead of time fails with EPIPE
    after it arrived), with the state after each, then raises ConnectionClosed and `closed`."""
    s, node = pair
    first_batch(s, node)
    node.sendall(batch(1, MORE) + batch(2, MORE) + batch(3))
    node.close()
    got = []
    for _ in range(3):
        b = s.next(timeout=10)
        got.append((b.lease, s.state_dict()["index"]))
    assert got == [(2, 2), (3, 3), (4, 4)]
    assert not b.released, "the last batch is the trainer's until the next call"
    with pytest.raises(ConnectionClosed):
        s.next(timeout=10)
    assert s.closed and b.released
    with pytest.raises(shardwire.ShardwireError) as e:
        s.next(timeout=10)
    assert e.value.code == "closed" and "lost" in e.value.message


def test_close_from_another_thread_wakes_a_waiting_next_which_raises_closed(pair):
    import threading
    import time

    s, node = pair
    got: list[BaseException | object] = []

    def wait() -> None:
        try:
            got.append(s.next())  # the node never answers
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            got.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    # The request came, so the `next` holds the lock and waits for its answer.
    ready, _, _ = select.select([node], [], [], 30)
    assert ready, "the next() sent no request"
    wait_for(s._lock.locked, "next() to hold the stream's lock")
    # A watchdog's close: it waited for the `next` holding the stream's lock before, forever.
    closer = threading.Thread(target=s.close, daemon=True)
    t0 = time.monotonic()
    closer.start()
    closer.join(5)
    t.join(5)
    assert not closer.is_alive(), "close() waited for the next() holding the lock"
    assert time.monotonic() - t0 < 4.5, time.monotonic() - t0
    assert not t.is_alive() and len(got) == 1, got
    e = got[0]
    assert isinstance(e, shardwire.ShardwireError) and e.code == "closed", repr(e)
    assert "closed by close() from another thread" in str(e), e
    assert s.closed
    node.settimeout(5)
    assert node.recv(65536) is not None  # the request came; then the connection closed


#: Where a signal handler's close() strikes a `next` that is handing out a batch, and what the
#: test answers the request sent ahead with: the rest of a group the handler finds built from
#: answers already here, or the request ahead sent after a group's last batch (its write then
#: fails on the connection close() shut down).
HANDLER_STRIKES = {
    "as a group is built": ((_client.Stream, "_build_ahead"), batch(1, MORE) + batch(2, MORE) + batch(3)),
    "as the request ahead is sent": ((_wire.Conn, "send_bytes"), batch(1)),
}


@pytest.mark.parametrize("where", list(HANDLER_STRIKES))
def test_close_from_a_signal_handler_during_a_hand_out_closes_the_stream_at_the_next_call(pair, monkeypatch, where):
    """A SIGTERM handler calls `close()` (as the README recommends) while `next` hands out a
    batch that had arrived, not waiting on the socket: close() shuts the connection down and
    returns at once, and the interrupted call returns its batch. Before, the stream stayed
    open: the next calls handed out the batches of the group already received (up to 7 more
    training steps), then raised ConnectionClosed (`connection_closed`, not `closed`); with the
    request ahead cut off, the next call raised that ConnectionClosed. Now the next call closes
    the stream and raises `closed`, and the state resumes after the batch returned."""
    s, node = pair
    first_batch(s, node)  # batch 0; a next for 8 in flight
    (owner, name), answer = HANDLER_STRIKES[where]
    fired: list[bool] = []

    def handler(*_: Any) -> None:
        s.close()
        fired.append(True)

    real = getattr(owner, name)

    def strike(*args: Any) -> Any:
        if not fired:
            signal.raise_signal(signal.SIGUSR1)  # its handler runs before this returns
        return real(*args)

    monkeypatch.setattr(owner, name, strike)
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        node.sendall(answer)
        b1 = s.next(timeout=10)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert fired, "the handler never ran"
    assert b1.lease == 2 and s.state_dict()["index"] == 2, "the interrupted call returns its batch"
    with pytest.raises(shardwire.ShardwireError) as e:
        s.next(timeout=10)
    assert type(e.value) is shardwire.ShardwireError and e.value.code == "closed", repr(e.value)
    assert "signal handler" in e.value.message, e.value
    assert s.closed and b1.released
    assert s.state_dict()["index"] == 2, "a new stream resumes after the batch returned"
    assert requests(node) is None, "the connection is closed"


def test_very_long_and_infinite_timeouts_wait_and_nan_is_refused(pair):
    s, node = pair
    with pytest.raises(ValueError):
        s.next(timeout=float("nan"))
    node.sendall(batch(0))
    # Beyond what one poll() takes (2^31 - 1 ms): OverflowError before, after the request
    # had gone; `inf` failed in the request's own encoding.
    assert s.next(timeout=3e6).lease == 1
    node.sendall(batch(1))
    assert s.next(timeout=float("inf")).lease == 2
    assert not s.closed


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the test: only reference counts free objects."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_dropped_stream_closes_its_connection_without_the_garbage_collector(no_gc):
    """The stream is dropped with batches built ahead of their turn and the last one handed
    out: the node sees the connection close at once (before, the stream and its batches held
    each other, and the connection, the node's leases and its stream memory waited for the
    garbage collector). A batch still alive keeps its stream (it is a lease on it)."""
    s, node = attached()
    with node:
        first_batch(s, node)
        node.sendall(batch(1, MORE) + batch(2, MORE) + batch(3))
        b1 = s.next(timeout=10)
        assert b1.lease == 2 and not b1.released
        del s
        assert requests(node) == [], "the batch in the trainer's hands keeps its stream open"
        assert not b1.released and list(b1) == ["x"]
        del b1
        assert requests(node) is None, "the connection stayed open after the stream was dropped"


def test_a_batch_the_trainer_dropped_is_released_with_the_next_request(pair, no_gc):
    s, node = pair
    first_batch(s, node)  # batch 0 (lease 1) is dropped at once
    node.sendall(batch(1))
    b1 = s.next(timeout=10)
    assert b1.lease == 2
    assert requests(node) == [{"op": "next", "release": [1], "count": 8}]


def test_a_kept_batch_dropped_without_release_is_released_with_the_next_request(pair, no_gc):
    """A kept batch holds its lease until release(); one the trainer drops (garbage) before
    that went on holding it, and kept the stream from asking ahead, until the stream closed."""
    s, node = pair
    b0 = first_batch(s, node).keep()
    node.sendall(batch(1))
    b1 = s.next(timeout=10)
    assert b1.lease == 2
    assert requests(node) == [], "nothing released or asked ahead while batch 0 is kept"
    del b0
    node.sendall(batch(2))
    assert s.next(timeout=10).lease == 3
    # Lease 1 (dropped) and lease 2 (taken over) go with the request sent now, which asks for
    # a group again; then the request ahead of time.
    assert requests(node) == [
        {"op": "next", "timeout_ms": 10000, "release": [1, 2], "count": 8},
        {"op": "next", "count": 8},
    ]
    # Kept, then released, then dropped: released once (its finalizer is detached).
    node.sendall(batch(3))
    b3 = s.next(timeout=10).keep()
    b3.release()
    del b3
    assert requests(node) == [{"op": "next", "release": [3], "count": 8}, {"op": "release", "lease": 4}]
    assert not s._dropped and not s._kept_leases


def test_a_dropped_batch_is_released_once_while_another_is_kept(pair, no_gc):
    """Batch 1 is dropped at once while batch 0 is kept: the request sent for batch 2 carries
    its lease, and handing batch 2 out must not release it a second time (the node refuses a
    lease it no longer knows: `unknown_lease`, and the `next` failed)."""
    s, node = pair
    b0 = first_batch(s, node).keep()
    node.sendall(batch(1))
    assert s.next(timeout=10).lease == 2  # dropped at once
    assert requests(node) == []
    node.sendall(batch(2))
    b2 = s.next(timeout=10)
    assert b2.lease == 3
    assert requests(node) == [{"op": "next", "timeout_ms": 10000, "release": [2]}]
    node.sendall(framed(b'{"op":"released"}'))  # the answer to the release below
    b0.release()
    assert requests(node) == [{"op": "release", "lease": 1}]


def test_an_error_answer_to_an_earlier_release_loses_no_batch_and_no_lease(pair, interrupt):
    """A release sent behind a request in flight is answered with an error (here: a lease the
    node does not know). The error is raised by the call that reads it, and nothing is lost:
    neither the batch handed out with it nor the release of a kept batch that follows (before,
    `release()` marked the batch released, then raised on the earlier answer: its lease was
    never sent)."""
    s, node = pair
    b0, b1 = two_kept_and_one_in_flight(s, node, interrupt)
    b0.release()  # sent behind it
    assert requests(node) == [{"op": "next", "timeout_ms": 30000}, {"op": "release", "lease": 1}]
    node.sendall(batch(2) + framed(b'{"op":"error","code":"unknown_lease","message":"lease 1"}'))
    b2 = s.next(timeout=10)
    assert b2.lease == 3 and requests(node) == []
    with pytest.raises(shardwire.ServiceError) as e:
        b1.release()  # reads the error answer first
    assert e.value.code == "unknown_lease"
    assert not b1.released, "the error was not this release's: b1 is still the trainer's"
    node.sendall(framed(b'{"op":"released"}'))
    b1.release()
    assert b1.released and requests(node) == [{"op": "release", "lease": 2}]


def test_an_interrupt_while_a_hand_out_releases_the_previous_batch_loses_no_batch(pair, interrupt):
    """While batches are kept, handing out the last batch of a group releases the previous
    one at once (no request goes ahead to carry it) and waits for its answer. Interrupted
    there, the batch taken was lost (the stream had moved past it, its state too): now the
    state names it as not taken and the next call hands it out."""
    s, node = pair
    first_batch(s, node)  # asks ahead for 8
    node.sendall(batch(1, MORE) + batch(2, MORE) + batch(3))
    b1 = s.next(timeout=10).keep()  # lease 2 kept: nothing is asked ahead any more
    assert s.next(timeout=10).lease == 3
    assert requests(node) == []
    interrupt(0.3, node)
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)  # batch 3 taken; the release of batch 2 waits for its answer
    assert requests(node) == [{"op": "release", "lease": 3}]
    assert s.state_dict()["index"] == 3, "batch 3 is not taken yet"
    b3 = s.next(timeout=10)
    assert (b3.lease, b3.index) == (4, 3) and s.state_dict()["index"] == 4
    assert requests(node) == [], "handed out without asking again"
    node.sendall(framed(b'{"op":"released"}') + batch(4))
    assert s.next(timeout=10).lease == 5
    assert b1.kept and not b1.released


def test_a_refused_release_at_the_end_does_not_keep_the_releases_after_it(pair):
    """At the `end` answer the releases that waited for a request go on their own. One the
    node refuses (here: a lease it does not know) raises, but only after the others were sent
    and answered: before, the first refusal stopped the loop and the leases after it stayed
    held on the node until the stream closed."""
    s, node = pair
    first_batch(s, node)  # asks ahead for 8
    node.sendall(batch(1, MORE))
    assert s.next(timeout=10).lease == 2  # more answers due: b0's release waits
    unknown = framed(b'{"op":"error","code":"unknown_lease","message":"lease 1"}')
    node.sendall(framed(b'{"op":"end"}') + unknown + framed(b'{"op":"released"}'))
    with pytest.raises(shardwire.ServiceError) as e:
        s.next(timeout=10)
    assert e.value.code == "unknown_lease"
    assert requests(node) == [{"op": "release", "lease": 1}, {"op": "release", "lease": 2}]
    assert s.next(timeout=10) is None and not s.closed


def test_closing_after_an_interrupted_hand_out_unmaps_the_region(pair, interrupt):
    """The batch an interrupt left taken and not handed out holds views of the region; closing
    the stream drops it, so the mapping goes at close, not when the stream object does."""
    s, node = pair
    first_batch(s, node)
    node.sendall(batch(1, MORE) + batch(2, MORE) + batch(3))
    b1 = s.next(timeout=10).keep()
    assert s.next(timeout=10).lease == 3
    interrupt(0.3, node)
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)  # batch 3 taken; the release of batch 2 waits for its answer
    assert s._unclaimed is not None
    del b1
    gc.collect()
    region = s._mmap
    s.close()
    assert region.closed, "the region is still mapped after close"


def test_a_refused_release_in_flight_at_the_end_does_not_keep_the_releases_after_it(pair, interrupt, no_gc):
    """A release sent behind the `next` that the node answers with `end` is refused (here: a
    lease it does not know). The releases that waited for a request are still sent at the end,
    and the refusal raises after them: before, the refusal, read first, stopped them."""
    s, node = pair
    b0, b1 = two_kept_and_one_in_flight(s, node, interrupt)
    b0.release()  # sent behind it
    assert requests(node) == [{"op": "next", "timeout_ms": 30000}, {"op": "release", "lease": 1}]
    del b1  # dropped while kept: its lease goes with the next request (there is none: at the end)
    unknown = framed(b'{"op":"error","code":"unknown_lease","message":"lease 1"}')
    node.sendall(framed(b'{"op":"end"}') + unknown + framed(b'{"op":"released"}'))
    with pytest.raises(shardwire.ServiceError) as e:
        s.next(timeout=10)
    assert e.value.code == "unknown_lease"
    assert requests(node) == [{"op": "release", "lease": 2}]
    assert s.next(timeout=10) is None


def test_an_interrupt_while_a_group_is_built_releases_the_previous_batch_later(pair, monkeypatch):
    """Ctrl-C strikes while the batches that came with the one taken are built: the batch
    taken is handed out by the next call, and the batch before it is still released (with the
    next request). Before, that one stayed leased until the stream closed."""
    s, node = pair
    b0 = first_batch(s, node)  # batch 0 (lease 1) held; a next for 8 in flight
    real, hits = _client.Stream._build_ahead, {"n": 0}

    def interrupted(self):
        hits["n"] += 1
        if hits["n"] == 1:
            raise KeyboardInterrupt("injected while the group is built")
        return real(self)

    monkeypatch.setattr(_client.Stream, "_build_ahead", interrupted)
    node.sendall(batch(1, MORE) + batch(2))
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)
    assert not b0.released, "the batch before stays the trainer's until the next hand-out"
    assert s.next(timeout=10).lease == 2, "the batch taken is handed out"
    assert s.next(timeout=10).lease == 3
    node.sendall(batch(3))
    assert s.next(timeout=10).lease == 4
    sent = requests(node)
    released = [r["lease"] for r in sent if r.get("op") == "release"] + [
        lease for r in sent if r.get("op") == "next" for lease in r.get("release", [])
    ]
    assert 1 in released and 2 in released, sent


def test_a_stream_used_in_a_forked_child_refuses_naming_both_processes(pair):
    """A child forked after the open shares the stream's connection: its `next` would read
    answers the parent asked for (and the parent lose them). It is refused, naming both
    processes; the parent goes on."""
    s, node = pair
    first_batch(s, node)
    # The child's close() lets go of its copy only (a shutdown of the shared connection
    # would end the parent's stream).
    said = next_in_forked_child(s)
    assert said.startswith("forked: ") and f"process {os.getpid()}" in said, said
    node.sendall(batch(1))
    assert s.next(timeout=10).lease == 2, "the parent's stream goes on"


# --- an interrupt while a request is written ---------------------------------------------------


class CutSocket:
    """The stream's socket, whose next write (``send``, or ``sendall``, which the SDK used
    before) is `write(sock, data)` instead: what a signal handler that raises does to it."""

    def __init__(self, sock: socket.socket, write: Any) -> None:
        self._sock, self._write = sock, write

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def send(self, data: Any, flags: int = 0) -> int:
        write, self._write = self._write, None
        return self._sock.send(data, flags) if write is None else write(self._sock, bytes(data))

    def sendall(self, data: Any, flags: int = 0) -> None:
        write, self._write = self._write, None
        if write is None:
            self._sock.sendall(data, flags)
        else:
            write(self._sock, bytes(data))


def test_an_interrupt_after_a_request_went_out_keeps_it_paired_with_its_answer(pair):
    """Ctrl-C strikes once the request asked ahead (carrying batch 0's release) went out whole
    (CPython runs signal handlers at the end of a send). Before, the request was never
    recorded in flight: its answer was taken for the next request's, and batch 0's lease was
    sent again. Now the stream goes on as if nothing happened."""
    s, node = pair
    first_batch(s, node)
    send_bytes = s._conn.send_bytes

    def then_interrupt(data: bytes) -> None:
        del s._conn.send_bytes  # once
        send_bytes(data)
        raise KeyboardInterrupt("struck after the request's last byte")

    s._conn.send_bytes = then_interrupt
    node.sendall(batch(1))
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)
    assert requests(node) == [{"op": "next", "release": [1], "count": 8}]
    got = [s.next(timeout=10).index]  # batch 1, taken before the interrupt
    assert requests(node) == [], "the request in flight is the one that went out"
    for k in (2, 3):
        node.sendall(batch(k))  # the answers to the requests in flight, in turn
        got.append(s.next(timeout=10).index)
        assert requests(node) == [{"op": "next", "release": [k], "count": 8}], "each lease released once"
    node.sendall(framed(b'{"op":"end"}') + framed(b'{"op":"released"}'))
    assert s.next(timeout=10) is None
    assert got == [1, 2, 3] and requests(node) == [{"op": "release", "lease": 4}]


def test_an_interrupt_before_a_request_went_out_leaves_it_to_the_next_call(pair, monkeypatch):
    """Ctrl-C strikes while the stream waits for room to write its request (nothing of it went
    out): the stream stays usable, and the next request carries batch 0's release."""
    s, node = pair
    first_batch(s, node)

    def full(sock: socket.socket, data: bytes) -> int:
        raise BlockingIOError(11, "no room")

    def interrupted(sock: Any, limit: float) -> bool:
        raise KeyboardInterrupt("struck while waiting for room")

    s._conn.sock = CutSocket(s._conn.sock, full)
    monkeypatch.setattr(_wire, "_wait_writable", interrupted)
    node.sendall(batch(1))
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)
    monkeypatch.undo()
    assert not s.closed and requests(node) == []
    assert s.next(timeout=10).index == 1
    node.sendall(batch(2))
    assert s.next(timeout=10).index == 2
    assert requests(node) == [{"op": "next", "timeout_ms": 10000, "release": [1, 2], "count": 8},
                              {"op": "next", "count": 8}], "each lease released once"


def test_a_request_cut_short_by_an_interrupt_closes_the_stream(pair):
    """Ctrl-C strikes when half of a request went out: the node would read the next request as
    its rest, so the stream is closed (its connection too), saying why; its state still names
    the batch after the last one handed out."""
    s, node = pair
    first_batch(s, node)
    request = _wire.encode_next([1], 8)

    def half(sock: socket.socket, data: bytes) -> int:
        assert data == request
        sock.sendall(data[: len(data) // 2])
        raise KeyboardInterrupt("struck in the middle of the request")

    s._conn.sock = CutSocket(s._conn.sock, half)
    node.sendall(batch(1))
    with pytest.raises(KeyboardInterrupt):
        s.next(timeout=10)
    assert s.closed
    node.settimeout(10)
    got = b""
    while chunk := node.recv(1 << 16):
        got += chunk
    assert got == request[: len(request) // 2], "half a request, then the connection closed"
    with pytest.raises(shardwire.ShardwireError) as e:
        s.next(timeout=10)
    assert e.value.code == "closed" and _wire.TORN in e.value.message, e.value
    assert s.state_dict()["index"] == 1, "batch 1 was not handed out"


def test_state_dict_after_the_connection_was_lost_names_the_next_batch(pair):
    """Three batches taken, then the node goes away: `next` raises ConnectionClosed and the
    stream is closed, but its state, held here, still resumes after the third (before,
    `state_dict()` raised `closed`). After close() too."""
    s, node = pair
    first_batch(s, node)
    node.sendall(batch(1, MORE) + batch(2))
    assert [s.next(timeout=10).index for _ in range(2)] == [1, 2]
    node.close()
    with pytest.raises(ConnectionClosed):
        s.next(timeout=10)
    assert s.closed and s.state_dict()["index"] == 3
    s.close()
    assert s.state_dict() == {"epoch": 0, "index": 3, "seed": 1, "fingerprint": "f"}
