"""Stream-churn soak: several clients open a stream, take every batch of an epoch over the raw
trainer socket (one `next` per batch, releasing the previous lease), close it and start
again, while nobody scrapes /metrics. The node's RSS is sampled once a second and the slope
of its anonymous part (RssAnon: heap and private maps, where a leak like that one grows) is
fitted (Theil-Sen) after a warm-up: memory must stay flat whether or not anyone scrapes
(the Prometheus recorder once kept every histogram sample until a scrape). The slab pool is
shared memory (a memfd, at most `--pool-size`) whose resident pages swing as slabs come and
go (0.8 to 4.1 MiB within one minute of this churn, measured), so VmRSS is printed but not
fitted.

Used by tests/e2e/test_soak.py (a short run in CI) and by `scripts/soak SECONDS` (the long
run, printing the figures). Run directly: `python tests/e2e/soak.py --seconds 600`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from conftest import MiB, Harness, index_dataset, vm_rss, wait_ready, write_uint8_shards  # noqa: E402


def rss_anon(pid: int) -> int:
    """Anonymous resident memory of `pid` in bytes (RssAnon of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                parts = line.split()
                assert parts[2] == "kB", line
                return int(parts[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack("<I", len(body)) + body


class _Reader:
    def __init__(self, s: socket.socket):
        self.s, self.buf = s, b""

    def frame(self) -> dict:
        while True:
            if len(self.buf) >= 4:
                (n,) = struct.unpack_from("<I", self.buf)
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
                    return json.loads(body)
            chunk = self.s.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the node closed the trainer socket")
            self.buf += chunk


def one_epoch(sock_path: str, dataset: str, seed: int) -> int:
    """Opens a stream, takes every batch of one epoch, closes it; returns the batch count."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(sock_path)
        r = _Reader(s)
        s.sendall(_frame({"op": "attach", "version": 1, "dataset": dataset, "seed": seed}))
        a = r.frame()
        if a.get("op") != "attached":
            raise RuntimeError(f"attach refused: {a}")
        n, release = 0, []
        while True:
            s.sendall(_frame({"op": "next", "release": release}))
            b = r.frame()
            if b["op"] == "end":
                return n
            if b["op"] != "batch":
                raise RuntimeError(f"next answered {b}")
            release, n = [b["lease"]], n + 1


@dataclass
class SoakResult:
    seconds: float
    streams: int
    batches: int
    #: (seconds since the start, VmRSS bytes, RssAnon bytes)
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def slope_mib_per_min(self, warmup: float) -> float:
        """RssAnon's trend after `warmup` seconds: the Theil-Sen slope (the median of the
        slopes between every pair of samples), which the allocator's swings of a few hundred
        KiB around a plateau do not tilt the way they tilt a least-squares line over a short
        window, while a leak's steady climb shows in full."""
        pts = [(t, a / MiB) for t, _, a in self.samples if t >= warmup]
        if len(pts) < 3:
            raise ValueError(f"only {len(pts)} RSS samples after the {warmup} s warm-up")
        slopes = sorted(
            (r2 - r1) / (t2 - t1)
            for i, (t1, r1) in enumerate(pts)
            for t2, r2 in pts[i + 1:]
            if t2 > t1
        )
        return slopes[len(slopes) // 2] * 60.0

    def summary(self, warmup: float) -> str:
        rss = [r for _, r, _ in self.samples]
        anon = [a for _, _, a in self.samples]
        return (f"{self.seconds:.0f} s, {self.streams} streams, {self.batches} batches "
                f"({self.batches / self.seconds:.0f}/s), RSS {rss[0] / MiB:.1f} -> {rss[-1] / MiB:.1f} MiB "
                f"(max {max(rss) / MiB:.1f}), RssAnon {anon[0] / MiB:.1f} -> {anon[-1] / MiB:.1f} MiB, "
                f"RssAnon slope after {warmup:.0f} s warm-up: "
                f"{self.slope_mib_per_min(warmup):+.3f} MiB/min, errors: {len(self.errors)}")


def warmup_end(samples: list[tuple[float, int, int]], quiet: float, least: float, most: float) -> float | None:
    """When RssAnon's warm-up ended in `samples` (as :attr:`SoakResult.samples`): the first
    sample at `least` seconds or later by which RssAnon had set no new maximum for `quiet`
    seconds, or the first at `most` seconds or later if none did before; None while neither.
    A leak sets a new maximum at every sample, so it runs the warm-up to `most`."""
    peak, peak_t = -1, 0.0
    for t, _, anon in samples:
        if anon > peak:
            peak, peak_t = anon, t
        if (t >= least and t - peak_t >= quiet) or t >= most:
            return t
    return None


def churn(
    node_pid: int,
    sock_path: str,
    dataset: str,
    seconds: float,
    clients: int = 4,
    done: Callable[[list[tuple[float, int, int]]], bool] | None = None,
) -> SoakResult:
    """Runs `clients` churning threads, sampling the node's RSS every second, for `seconds` or
    until `done(samples)` (called after each sample) is true, whichever comes first.
    `SoakResult.seconds` is the time it sampled for."""
    res = SoakResult(seconds=seconds, streams=0, batches=0)
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()
    deadline = t0 + seconds

    def client(k: int) -> None:
        seed = k * 1_000_003
        while not stop.is_set():
            seed += 1
            try:
                n = one_epoch(sock_path, dataset, seed)
            except (OSError, RuntimeError) as e:
                with lock:
                    res.errors.append(f"client {k}: {e}")
                time.sleep(0.2)
                continue
            with lock:
                res.streams += 1
                res.batches += n

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        while time.monotonic() < deadline:
            res.samples.append((time.monotonic() - t0, vm_rss(node_pid), rss_anon(node_pid)))
            if done is not None and done(res.samples):
                break
            time.sleep(1.0)
    finally:  # the node gone mid-soak (sampling raises) stops the clients too
        res.seconds = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(90)
    return res


def soak_dataset(d: pathlib.Path) -> pathlib.Path:
    """256 tiny shards: an epoch is 256 `next`s, so the churn is dominated by hand-offs."""
    write_uint8_shards(d, 256, 1024, seed=11)
    index_dataset(d)
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=30)
    ap.add_argument("--max-slope", type=float, default=0.5, help="MiB/min; exit 1 above it")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardwire-soak-") as tmp:
        h = Harness(pathlib.Path(tmp))
        try:
            d = soak_dataset(pathlib.Path(tmp) / "soak")
            src = h.source({"soak": d})
            node = h.serve([src], "--stream-memory", "4MiB", "--pool-size", "64MiB")
            wait_ready(node)
            res = churn(node.pid, node.socket, "soak", a.seconds, a.clients)
        finally:
            h.close()
    slope = res.slope_mib_per_min(a.warmup)
    print(f"soak: {res.summary(a.warmup)}")
    for e in res.errors[:5]:
        print(f"  error: {e}")
    ok = slope < a.max_slope and not res.errors
    print(f"soak: {'PASS' if ok else 'FAIL'} (slope limit {a.max_slope} MiB/min, no client errors)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
