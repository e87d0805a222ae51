"""`next` with `count` against the real node, shard mode with shards that are a large part of
the stream's region: the answer adds ready shards after the one asked for only while the
stream's leases take at most a quarter of the region. A trainer keeps an answer's batches
leased until its next request, so without that bound one answer could hold the whole region
and stop the fetch-ahead (docs/TRAINER_API.md, "Several batches per `next`").

    shardwire index DIR -> shardwire source -> shardwire serve -> a raw trainer connection
"""

from __future__ import annotations

import socket
import sys

import numpy as np

from conftest import REPO, index_dataset, wait_for, wait_ready, write_npy_dataset

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

from shardwire import _wire  # noqa: E402

SHARDS = 16


def attach(node, dataset: str) -> _wire.Conn:
    """A raw trainer connection attached to a shard-mode stream of `dataset` (one epoch)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(node.socket))
    conn = _wire.Conn(s)
    conn.send({"op": "attach", "version": 1, "dataset": dataset, "epochs": 1})
    msg, fds = conn.recv(want_fds=True)
    _wire._close_fds(fds)
    assert msg["op"] == "attached", msg
    return conn


def answer(conn: _wire.Conn) -> list[dict]:
    """Every batch of one answer: up to the first without `more`."""
    group = [conn.recv_reply()]
    while group[-1]["op"] == "batch" and group[-1].get("more"):
        group.append(conn.recv_reply())
    return group


def test_an_answer_stops_adding_shards_once_leases_take_a_quarter_of_the_region(sw, tmp_path):
    d = tmp_path / "big"
    # Shards of 900 KiB: slabs of 1 MiB, eight of them fill the 8 MiB region.
    write_npy_dataset(d, {f"s{i:02d}": np.full(900 * 1024, i, np.uint8) for i in range(SHARDS)})
    index_dataset(d)
    node = sw.serve([sw.source({"big": d})], "--pool-size", "64MiB", "--stream-memory", "8MiB")
    wait_ready(node)
    conn = attach(node, "big")
    try:
        seen, release = [], ()
        while True:
            # Let the fetch-ahead fill the region before each request: every slab the last
            # answer does not still lease (8 less 3), or all the shards that are left. Once
            # the region is full nothing is in flight, so the ready shards are the next ones
            # in plan order.
            left = SHARDS - len(seen)
            wait_for(lambda: node.status()["streams"][0]["ready"] >= min(left, 8 - len(release)),
                     "the fetch-ahead to fill the region", diag=sw.logs_of_all)
            conn.send_bytes(_wire.encode_next(release, 8))
            group = answer(conn)
            if group[-1]["op"] == "end":
                assert len(group) == 1, group
                break
            assert all(m["op"] == "batch" for m in group), group
            # The first, then more while the leased slabs, the one being added counted, take at
            # most 2 MiB of 8: two at most.
            assert 1 <= len(group) <= 2, [m["shard"] for m in group]
            if left >= 2:
                assert len(group) == 2, [m["shard"] for m in group]
            seen += [m["shard"] for m in group]
            release = tuple(m["lease"] for m in group)
        assert sorted(seen) == list(range(SHARDS))
    finally:
        conn.close()


def test_a_release_list_with_an_unknown_lease_releases_every_held_one_and_names_the_unknown(sw, tmp_path):
    d = tmp_path / "small"
    write_npy_dataset(d, {f"s{i:02d}": np.full(1000, i, np.uint8) for i in range(6)})
    index_dataset(d)
    node = sw.serve([sw.source({"small": d})], "--pool-size", "64MiB", "--stream-memory", "8MiB")
    wait_ready(node)
    conn = attach(node, "small")
    try:
        # Every shard ready (ready counts arrived ones in any order: three of them need not be
        # the first three, and `next` hands out only what comes in order).
        wait_for(lambda: node.status()["streams"][0]["ready"] >= 6, "all six shards ready", diag=sw.logs_of_all)
        conn.send_bytes(_wire.encode_next((), 3))
        group = answer(conn)
        held = [m["lease"] for m in group]
        assert len(held) == 3, group
        # The node once stopped at the unknown lease: the ones after it stayed leased while
        # the trainer took them for released, and the answer echoed the whole list.
        conn.send_bytes(_wire.encode_next((held[0], 999_999, held[1], held[2]), 1))
        err = conn.recv_reply()
        assert err["op"] == "error" and err["code"] == "unknown_lease", err
        assert "[999999] are not held by this stream; the other 3 of the 4 released were released" in err["message"], err
        wait_for(lambda: node.status()["streams"][0]["leased"] == 0, "every held lease released", diag=sw.logs_of_all)
    finally:
        conn.close()
