"""The node's io_uring receive path (`io_uring = true`, the default) against `recv`, with
real processes on 127.0.0.1: both deliver every shard byte-exact, `/v1/status` and
`/metrics` say which primitive each data connection uses, and where the kernel refuses
io_uring (the real `kernel.io_uring_disabled` sysctl, as a seccomp policy would) the node
falls back to `recv` and says so in its log: never silently.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import (
    IO_URING_NOTE,
    assert_byte_exact,
    assert_exactly_once,
    expected_crcs,
    http_get,
    index_dataset,
    wait_ready,
    write_uint8_shards,
)

SYSCTL = pathlib.Path("/proc/sys/kernel/io_uring_disabled")


def shards_of_many_sizes(d: pathlib.Path) -> None:
    """Shards of 1 MiB + 5, 4097 and 300 KiB + 17 bytes (distinct random contents)."""
    write_uint8_shards(d, 6, 1024 * 1024 + 5, prefix="a", seed=1)
    write_uint8_shards(d, 6, 4097, prefix="b", seed=2)
    write_uint8_shards(d, 6, 300 * 1024 + 17, prefix="c", seed=3)


def run_epoch(sw, d: pathlib.Path, env: dict | None = None):
    """One node over one source with 2 flows; one epoch consumed and checked byte-exact."""
    m = index_dataset(d)
    expected = expected_crcs(d)
    src = sw.source({"u": d})
    node = sw.serve([src], "--flows", "2", "--stream-memory", "16MiB", "--pool-size", "64MiB", env=env)
    wait_ready(node)
    batches = sw.consume(node, "u", seed=11)
    assert_exactly_once(batches, len(m["shards"]))
    assert_byte_exact(batches, expected)
    st = node.status()
    assert st["counters"]["crc_failures"] == 0
    return node, st["counters"]


def connections_metric(node) -> dict:
    text = http_get(node.admin, "/metrics")[1]
    return {k: int(v) for k, v in re.findall(r'^shardwire_data_connections_total\{recv="(\w+)"\} (\d+)', text, re.M)}


def test_io_uring_is_the_default_receive_and_is_counted(sw, tmp_path):
    d = tmp_path / "ds"
    shards_of_many_sizes(d)
    node, c = run_epoch(sw, d)
    assert (c["data_connections_io_uring"], c["data_connections_recv"]) == (2, 0), c
    assert connections_metric(node) == {"io_uring": 2, "recv": 0}
    assert "io_uring multishot receive is unavailable" not in node.stderr_text()


def test_io_uring_false_reads_with_recv(sw, tmp_path):
    d = tmp_path / "ds"
    shards_of_many_sizes(d)
    node, c = run_epoch(sw, d, env={"SHARDWIRE_IO_URING": "false"})
    assert (c["data_connections_io_uring"], c["data_connections_recv"]) == (0, 2), c
    assert connections_metric(node) == {"io_uring": 0, "recv": 2}


@pytest.fixture
def io_uring_disabled_by_the_kernel():
    """`kernel.io_uring_disabled = 2` (io_uring_setup fails with EPERM) for one test."""
    try:
        before = SYSCTL.read_text()
        IO_URING_NOTE.write_text(before)  # a run killed before the restore: undone by the next
        SYSCTL.write_text("2")
    except OSError as e:
        pytest.skip(f"cannot set {SYSCTL} (needs root and Linux 6.6+): {e}")
    try:
        yield
    finally:
        SYSCTL.write_text(before)
        IO_URING_NOTE.unlink(missing_ok=True)


def test_a_kernel_that_refuses_io_uring_falls_back_to_recv_and_says_so(sw, tmp_path, io_uring_disabled_by_the_kernel):
    d = tmp_path / "ds"
    shards_of_many_sizes(d)
    node, c = run_epoch(sw, d)
    assert (c["data_connections_io_uring"], c["data_connections_recv"]) == (0, 2), c
    log = node.stderr_text()
    assert log.count("io_uring multishot receive is unavailable") == 1, log[-3000:]
    assert "Operation not permitted" in log, log[-3000:]
