"""`shardwire bench --compare-crc`: every way of checksumming received bytes is run on real
loopback TCP into the stream-sized region, checks every shard against its file's CRC (so a
way that checksummed the wrong bytes or missed some shows failures), and the report names
the CPU and how hot each CRC ran.
"""

from __future__ import annotations

import re
import subprocess

from conftest import shardwire_bin

WAYS = [
    "crc-inplace-whole",
    "crc-queue",
    "crc-inplace-1M",
    "crc-inplace-256K",
    "crc-queue-128K-ahead-256K",
    "crc-queue-256K-ahead-1M",
    "crc-bounce-nt-256K",
    "crc-bounce-copy-256K",
    "crc-fused-64K",
    "crc-uring",
]


def test_every_crc_way_checks_every_shard_and_the_report_names_the_cpu():
    out = subprocess.run(
        [str(shardwire_bin()), "bench", "--flows", "2", "--seconds", "1", "--shard-size", "1MiB",
         "--compare-tcp", "--compare-crc"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert re.search(r"^cpu: .+ \(vendor \S+, family \d+ model \d+\), \d+ CPUs", text, re.M), text[:2000]
    assert re.search(r"^crc: median piece checksummed right after landing \d+ KiB \(L2 ", text, re.M)
    for way in WAYS:
        m = re.search(rf"^  {re.escape(way)}: (\d+) shards checked, (\d+) CRC failures, "
                      rf"median piece checksummed (\d+) KiB", text, re.M)
        assert m, f"{way} missing from the report"
        checked, failures, piece = map(int, m.groups())
        assert checked > 0 and failures == 0, (way, checked, failures)
        assert piece > 0, way
    ratios = re.search(r"^ratio to crc-inplace-whole .*$", text, re.M)
    assert ratios, "no ratio line"
    for way in WAYS[1:]:
        assert f" {way} " in ratios.group(0), way


def test_an_unknown_crc_way_is_refused_by_name():
    out = subprocess.run(
        [str(shardwire_bin()), "bench", "--seconds", "1", "--compare-tcp", "--compare-crc",
         "--crc-way", "crc-sideways"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "crc-sideways" in out.stderr, out.stderr[-2000:]
