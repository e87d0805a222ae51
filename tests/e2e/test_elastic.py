"""An elastic source tier (issue 26): nodes find sources by DNS (`dns:NAME:PORT`, a dnsmasq on
loopback whose answer the test changes: tests/e2e/dnsfix.py), place each shard on one source by
bounded rendezvous hashing, and lose and duplicate nothing while sources come, drain and die.

Sources listen on 127.0.0.2-8 at one port, so the DNS answer is all that tells them apart. Which
source served which shard is read from the node's debug log (`FETCH ... shard=S ... source=A`),
bytes per source from `/v1/status` `sources[].bytes_received`.
"""

from __future__ import annotations

import collections
import random
import re
import signal
import socket
import time

import numpy as np
import pytest

from conftest import SERVE_READY, Serve, expected_crcs, assert_byte_exact, index_dataset, wait_for
from dnsfix import NAME, dns  # noqa: F401 - the fixture

SHARDS = 120
WORLD = 4
IPS = [f"127.0.0.{i}" for i in range(2, 9)]
FETCH = re.compile(r"FETCH req=\d+ shard=(\d+) pos=\d+ source=(\S+)")
NODE_LOG = {"RUST_LOG": "info,shardwire_node::stream::supply=debug"}


def free_port() -> int:
    """A port free on every one of IPS (the sources all take it, each on its own address):
    one free on 127.0.0.2, bound briefly on each of the others too; another is tried where
    one of them has it taken."""
    for _ in range(10):
        with socket.socket() as s:
            s.bind((IPS[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in IPS:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port free on all of {IPS} in 10 tries")


def write_dataset(d, seed: int = 7) -> list[int]:
    """SHARDS .npy shards of 20-200 KB (uniform); returns their manifest lengths."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(SHARDS):
        np.save(d / f"s{i:03d}.npy", rng.integers(0, 256, int(rng.integers(20_000, 200_000)), dtype=np.uint8))
    return [s["length"] for s in index_dataset(d)["shards"]]


class Tier:
    """Sources at IPS[i]:port, started and stopped by index."""

    def __init__(self, sw, d, port: int, *flags):
        self.sw, self.d, self.port, self.flags = sw, d, port, flags
        self.procs: dict[int, object] = {}

    def addr(self, i: int) -> str:
        return f"{IPS[i]}:{self.port}"

    def start(self, i: int):
        self.procs[i] = self.sw.source({"ds": self.d}, "--drain-timeout-secs", "20", *self.flags, listen=self.addr(i))
        return self.procs[i]


def serve_dns(sw, dns, *extra) -> Serve:
    """`shardwire serve --source dns:NAME:PORT` resolving through `dns`, ready."""
    name = sw._name("serve")
    args = [sw.bin, "serve", "--socket", sw.tmp / f"{name}.sock", "--data-listen", "127.0.0.1:0",
            "--admin", "127.0.0.1:0", "--source-resolve-secs", "1", "--pool-size", "256MiB",
            "--stream-memory", "2MiB", *extra]
    p = Serve(name, dns.wrap([str(a) for a in args]), sw.logs, NODE_LOG)
    sw.procs.append(p)
    m = p.wait_line(SERVE_READY)
    p.socket, p.admin = m.group(1), m.group(2)
    return p


def wait_sources(node: Serve, addrs: list[str]) -> dict:
    """Waits until exactly `addrs` are listed, all up and found by DNS."""
    def ok():
        st = node.status()
        got = sorted(s["addr"] for s in st["sources"])
        return st if got == sorted(addrs) and all(s["up"] for s in st["sources"]) else None
    return wait_for(ok, f"sources {addrs} up on {node.name}", diag=lambda: str(node.status()["sources"]))


def bytes_by_source(node: Serve) -> dict[str, int]:
    return {s["addr"]: s["bytes_received"] for s in node.status()["sources"]}


def fetch_map(node: Serve, since: int) -> tuple[dict[int, str], int]:
    """{shard: source} of the FETCHes logged after byte `since` of the node's log, and the end."""
    text = node.stderr_text()
    m = {}
    for shard, source in FETCH.findall(text[since:]):
        m[int(shard)] = source
    return m, len(text)


def epochs(sw, node: Serve, n: int, seed: int = 1, on_progress=None) -> list[dict]:
    """`n` epochs over WORLD ranks at once; `on_progress(batches so far)` is polled meanwhile.
    Asserts every rank's batches: each shard exactly once per epoch over the ranks."""
    cs = [sw.start_consume(node, "ds", seed=seed, rank=r, world_size=WORLD, epochs=n) for r in range(WORLD)]
    while on_progress and any(c.alive() for c in cs):
        on_progress(sum(len(c.batches()) for c in cs))
        time.sleep(0.05)
    batches = [b for c in cs for b in c.result()]
    per_epoch = collections.defaultdict(list)
    for b in batches:
        per_epoch[b["epoch"]].append(b["shard"])
    assert sorted(per_epoch) == list(range(n)), sorted(per_epoch)
    for e, shards in per_epoch.items():
        assert sorted(shards) == list(range(SHARDS)), f"epoch {e}: lost {set(range(SHARDS)) - set(shards)}, duplicated {[s for s, k in collections.Counter(shards).items() if k > 1]}"
    return batches


def stable_epoch(sw, node: Serve, addrs: list[str], lengths: list[int], seed: int) -> dict[int, str]:
    """One epoch with a fixed set of sources: bytes per source within 10 % of even, each
    shard from one source; returns {shard: source}."""
    before, since = bytes_by_source(node), len(node.stderr_text())
    epochs(sw, node, 1, seed=seed)
    after = bytes_by_source(node)
    got = {a: after[a] - before.get(a, 0) for a in addrs}
    even = sum(lengths) / len(addrs)
    spread = {a: round(b / even - 1, 4) for a, b in got.items()}
    print(f"{len(addrs)} sources: bytes per source vs even: {spread}")
    assert sum(got.values()) == sum(lengths), (got, sum(lengths))
    assert all(abs(v) <= 0.10 for v in spread.values()), spread
    m, _ = fetch_map(node, since)
    assert len(m) == SHARDS and set(m.values()) == set(addrs), collections.Counter(m.values())
    return m


def moved_bytes(a: dict[int, str], b: dict[int, str], stayed: set[str], lengths) -> float:
    """Share of the dataset's bytes on a source in `stayed` under `a` that is elsewhere under `b`."""
    return sum(lengths[s] for s in a if a[s] in stayed and b[s] != a[s]) / sum(lengths)


def test_three_sources_scale_to_five_then_two_during_epochs(sw, dns, tmp_path):
    lengths = write_dataset(tmp_path / "ds")
    tier = Tier(sw, tmp_path / "ds", free_port(), "--rate-limit", "4MiB")
    for i in range(5):
        tier.start(i)
    dns.set(IPS[:3])
    node = serve_dns(sw, dns, "--source", f"dns:{NAME}:{tier.port}")
    st = wait_sources(node, [tier.addr(i) for i in range(3)])
    assert {s["found_by"] for s in st["sources"]} == {f"dns:{NAME}:{tier.port}"}, st["sources"]
    assert st["discovery"][0]["addresses"] == [tier.addr(i) for i in range(3)], st["discovery"]
    three = stable_epoch(sw, node, [tier.addr(i) for i in range(3)], lengths, seed=11)

    # Up to five while four ranks read three epochs: early in the first, so that the new
    # sources (found within the 1 s re-resolve, then a handshake) have most of them to join.
    def grow(n):
        if n >= 20 and not grow.done:
            grow.done = True
            dns.set(IPS[:5])
    grow.done = False
    epochs(sw, node, 3, seed=12, on_progress=grow)
    assert grow.done
    got = bytes_by_source(node)
    assert all(got.get(tier.addr(i), 0) > 0 for i in (3, 4)), f"the new sources took no part in the running epochs: {got}"
    wait_sources(node, [tier.addr(i) for i in range(5)])
    five = stable_epoch(sw, node, [tier.addr(i) for i in range(5)], lengths, seed=13)
    new = {tier.addr(3), tier.addr(4)}
    to_new = sum(lengths[s] for s in five if five[s] in new) / sum(lengths)
    between_old = moved_bytes(three, five, {tier.addr(i) for i in range(3)}, lengths) - to_new
    print(f"3 -> 5: {to_new:.3f} of the bytes moved to the new sources, {between_old:.3f} between the old")
    assert 0.35 <= to_new <= 0.45, to_new  # 2/5, within the balance slack
    # Balancing 120 shards within 5 % moves a few between the sources that stayed, where the
    # weighted rendezvous' margins shift: 2 % on average over 200 port layouts of this shape,
    # 9 % at worst (node/src/stream/affinity.rs, adding_two_sources_to_three_...).
    assert between_old <= 0.10, between_old

    # Down to two (sources 1 and 3 stay) while four ranks read two epochs: the three others
    # leave the DNS answer and drain (SIGTERM) a quarter of the way in.
    gone = [0, 2, 4]
    def shrink(n):
        if n >= 60 and not shrink.done:
            shrink.done = True
            dns.set([IPS[1], IPS[3]])
            for i in gone:
                tier.procs[i].kill(signal.SIGTERM)
    shrink.done = False
    since = len(node.stderr_text())
    epochs(sw, node, 2, seed=14, on_progress=shrink)
    assert shrink.done
    # While they left, a shard whose source stayed was fetched from that source.
    during = re.findall(FETCH, node.stderr_text()[since:])
    stay = {tier.addr(1), tier.addr(3)}
    rehomed = {int(sh) for sh, src in during if five[int(sh)] in stay and src != five[int(sh)]}
    print(f"5 -> 2, during the epochs: {len(rehomed)} shards of the sources that stayed fetched elsewhere")
    # The three leave one by one as the node sees them drain, so up to six placements follow
    # each other (every set of the two that stay and some of the three); each may move a few
    # shards between the two. Over 100 port layouts of this shape, with every intermediate
    # set taken, the union of those moves averaged 3.5 % of the bytes and was 12 % at worst
    # (node/src/stream/affinity.rs, three_of_five_leaving_one_by_one_...).
    assert sum(lengths[s] for s in rehomed) <= 0.15 * sum(lengths), sorted(rehomed)
    for i in gone:
        assert tier.procs[i].wait(30) == 0, tier.procs[i].describe()
        assert "drained: every node session has ended" in tier.procs[i].stderr_text(), tier.procs[i].describe()
    stay = sorted(stay)
    wait_sources(node, stay)
    two = stable_epoch(sw, node, stay, lengths, seed=15)
    survivors = moved_bytes(five, two, set(stay), lengths)
    print(f"5 -> 2: {survivors:.3f} of the bytes moved between the two sources that stayed")
    assert survivors <= 0.06, survivors  # 1 % on average, 5 % at worst over 200 layouts
    log = node.stderr_text()
    for i in gone:
        assert re.search(rf"source retired.*source={re.escape(tier.addr(i))}|source={re.escape(tier.addr(i))}.*source retired", log), f"{tier.addr(i)} not retired"
    assert node.status()["counters"]["crc_failures"] == 0


def test_two_nodes_fetch_every_shard_from_the_same_source(sw, dns, tmp_path):
    lengths = write_dataset(tmp_path / "ds", seed=3)
    tier = Tier(sw, tmp_path / "ds", free_port())
    for i in range(3):
        tier.start(i)
    dns.set(IPS[:3])
    addrs = [tier.addr(i) for i in range(3)]
    nodes = [serve_dns(sw, dns, "--source", f"dns:{NAME}:{tier.port}") for _ in range(2)]
    for n in nodes:
        wait_sources(n, addrs)
    maps = [stable_epoch(sw, n, addrs, lengths, seed=21 + k) for k, n in enumerate(nodes)]
    differ = [s for s in range(SHARDS) if maps[0][s] != maps[1][s]]
    assert differ == [], f"{len(differ)} shards fetched from different sources: {differ[:10]}"
    print("per source:", collections.Counter(maps[0].values()))


def test_chaos_sources_killed_and_started_under_a_changing_dns_answer(sw, dns, tmp_path):
    write_dataset(tmp_path / "ds", seed=5)
    tier = Tier(sw, tmp_path / "ds", free_port(), "--rate-limit", "1MiB")
    pool = list(range(5))
    for i in pool:
        tier.start(i)
    dns.set([IPS[i] for i in pool])
    node = serve_dns(sw, dns, "--source", f"dns:{NAME}:{tier.port}")
    wait_sources(node, [tier.addr(i) for i in pool])
    rng = random.Random(26)
    events = []

    def chaos(_n):
        if time.monotonic() < chaos.next_at:
            return
        # (every 0.3 s on average over two epochs: as many events as every 0.6 s over four)
        chaos.next_at = time.monotonic() + rng.uniform(0.15, 0.45)
        alive = [i for i in pool if tier.procs[i].alive()]
        kind = rng.choice(["kill", "term", "start", "dns"])
        if kind in ("kill", "term") and len(alive) > 1:
            i = rng.choice(alive)
            tier.procs[i].kill(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            events.append(f"{kind} {i}")
        elif kind == "start":
            dead = [i for i in pool if not tier.procs[i].alive()]
            if dead:
                i = rng.choice(dead)
                tier.procs[i].wait(30)
                tier.start(i)
                events.append(f"start {i}")
        else:
            answer = sorted(rng.sample(pool, rng.randint(1, len(pool))))
            # Never an answer of only dead sources: then nothing could serve.
            if not any(tier.procs[i].alive() for i in answer):
                answer.append(rng.choice(alive))
            dns.set([IPS[i] for i in sorted(set(answer))])
            events.append(f"dns {sorted(set(answer))}")
    chaos.next_at = time.monotonic() + 0.5
    batches = epochs(sw, node, 2, seed=31, on_progress=chaos)
    print("events:", events)
    assert len(events) >= 8, events
    assert_byte_exact(batches, expected_crcs(tmp_path / "ds"))
    st = node.status()
    assert st["counters"]["crc_failures"] == 0, st["counters"]
    print("refetches:", st["counters"]["refetches"])
