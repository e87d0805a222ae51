"""`shardwire bench --compare-crc`: every way of checksumming received bytes is run on real
loopback TCP into the stream-sized region, checks every shard against its file's CRC (so a
way that checksummed the wrong bytes or missed some shows failures), and the report names
the CPU and how hot each CRC ran.
"""

from __future__ import annotations

import re
import subprocess

from conftest import shardwire_bin

SHARD = 1 << 20  # --shard-size 1MiB: the slot, the most any way reads at once

# Each way and the largest piece it checksums at once (bytes): its cap, or the slot.
WAYS = {
    "crc-inplace-whole": SHARD,
    "crc-queue": SHARD,
    "crc-inplace-1M": 1 << 20,
    "crc-inplace-256K": 256 << 10,
    "crc-queue-128K-ahead-256K": 128 << 10,
    "crc-queue-256K-ahead-1M": 256 << 10,
    "crc-bounce-nt-256K": 256 << 10,
    "crc-bounce-copy-256K": 256 << 10,
    "crc-fused-64K": 64 << 10,
    "crc-uring": SHARD,
}

# A median piece as printed: the power-of-two range it fell in, e.g. "256-512 KiB".
RANGE = r"(\d+)-(\d+) (KiB|B)"


def piece_range(m: re.Match, at: int) -> tuple[int, int]:
    """The range (lo, hi) in bytes of the match's groups `at`..`at + 2`."""
    unit = 1024 if m.group(at + 2) == "KiB" else 1
    lo, hi = int(m.group(at)) * unit, int(m.group(at + 1)) * unit
    assert 0 < lo and hi == 2 * lo, m.group(0)
    return lo, hi


def test_every_crc_way_checks_every_shard_and_the_report_names_the_cpu():
    out = subprocess.run(
        # (no --compare-tcp: nothing here reads its plain-TCP runs, two more seconds of bench;
        # the unknown-way test below still passes that flag)
        [str(shardwire_bin()), "bench", "--flows", "2", "--seconds", "1", "--shard-size", "1MiB",
         "--compare-crc"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert re.search(r"^cpu: .+ \(vendor \S+, family \d+ model \d+\), \d+ CPUs", text, re.M), text[:2000]
    node = re.search(rf"^crc: median piece checksummed right after landing {RANGE} \(L2 ", text, re.M)
    assert node, text[:3000]
    assert piece_range(node, 1)[0] <= SHARD, node.group(0)
    for way, cap in WAYS.items():
        m = re.search(rf"^  {re.escape(way)}: (\d+) shards checked, (\d+) CRC failures, "
                      rf"median piece checksummed {RANGE}", text, re.M)
        assert m, f"{way} missing from the report"
        checked, failures = int(m.group(1)), int(m.group(2))
        assert checked > 0 and failures == 0, (way, checked, failures)
        # The median piece is at most the cap, so the range it fell in starts at or below it
        # (pieces of exactly the cap print as cap-2cap).
        lo, _ = piece_range(m, 3)
        assert lo <= cap, (way, m.group(0), cap)
    ratios = re.search(r"^ratio to crc-inplace-whole .*$", text, re.M)
    assert ratios, "no ratio line"
    for way in list(WAYS)[1:]:
        assert f" {way} " in ratios.group(0), way


def test_an_unknown_crc_way_is_refused_by_name():
    out = subprocess.run(
        [str(shardwire_bin()), "bench", "--seconds", "1", "--compare-tcp", "--compare-crc",
         "--crc-way", "crc-sideways"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "crc-sideways" in out.stderr, out.stderr[-2000:]
