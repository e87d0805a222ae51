"""Proves tests/e2e/impair.py impairs a link: a TCP transfer of 16 MiB of random bytes between
two network namespaces (joined by a veth pair) crosses a link with drops, delay, jitter
(reordering) and duplication, arrives intact (sha256), and both the loop's counters and the
kernel's TCP counters (retransmissions at the sender, out-of-order segments at the receiver)
show that the link was impaired. Also checks the bounds: the held-packet limit, and that the
rule is removed when the loop is killed (it fails closed until then).

Needs root, iproute2 and iptables (scripts/test installs iptables; by hand:
`apt-get install -y iptables`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from impair import Impairment, ImpairmentError
from pdeathsig import die_with_parent

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces and iptables rules"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2 (`ip`) to create network namespaces"),
    pytest.mark.skipif(
        shutil.which("iptables") is None,
        reason="needs iptables for the NFQUEUE rule: install it (`apt-get install -y iptables`; scripts/test does)",
    ),
]

#: Sender (namespace A) and receiver (namespace B) ends of the veth pair. Both ends live in
#: namespaces this test creates, so the addresses cannot clash with anything outside.
A_IP, B_IP = "10.213.88.1", "10.213.88.2"
MiB = 1 << 20
TRANSFER_TIMEOUT = 25.0


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}"


@pytest.fixture
def two_ns():
    """Namespaces (A, B) joined by a veth pair: A at A_IP, B at B_IP. Removed afterwards."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"swimpa-{tag}", f"swimpb-{tag}"
    ip("netns", "add", a)
    try:
        ip("netns", "add", b)
        ip("link", "add", f"swia{tag}", "netns", a, "type", "veth", "peer", "name", f"swib{tag}", "netns", b)
        for ns, dev, addr in ((a, f"swia{tag}", A_IP), (b, f"swib{tag}", B_IP)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


RECEIVER = r"""
import hashlib, json, socket, sys
addr, timeout = sys.argv[1], float(sys.argv[2])
s = socket.socket()
s.bind((addr, 0))
s.listen(1)
print(json.dumps({"port": s.getsockname()[1]}), flush=True)
s.settimeout(timeout)
c, _ = s.accept()
c.settimeout(timeout)
h, n = hashlib.sha256(), 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    h.update(b)
    n += len(b)
c.close()
print(json.dumps({"bytes": n, "sha256": h.hexdigest()}), flush=True)
"""

SENDER = r"""
import json, socket, sys, time
addr, port, path, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
t0 = time.monotonic()
s = socket.create_connection((addr, port), timeout=timeout)
with open(path, "rb") as f:
    s.sendfile(f)
s.shutdown(socket.SHUT_WR)
while s.recv(65536):
    pass
s.close()
print(json.dumps({"elapsed_s": time.monotonic() - t0}), flush=True)
"""


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def transfer(a: str, b: str, data: bytes, tmp_path, timeout: float = TRANSFER_TIMEOUT) -> tuple[dict, dict]:
    """Sends `data` over TCP from namespace `a` to B_IP in namespace `b`; returns the
    receiver's {"bytes", "sha256"} and the sender's {"elapsed_s"}."""
    path = tmp_path / "payload.bin"
    path.write_bytes(data)
    rx = subprocess.Popen(in_ns(b, sys.executable, "-c", RECEIVER, B_IP, str(timeout)),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    try:
        first = rx.stdout.readline()
        assert first, f"receiver exited before listening: {rx.stderr.read()}"
        port = json.loads(first)["port"]
        try:
            tx = subprocess.run(in_ns(a, sys.executable, "-c", SENDER, B_IP, str(port), str(path), str(timeout)),
                                capture_output=True, text=True, timeout=timeout + 5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the sender did not finish within {timeout + 5}s") from None
        assert tx.returncode == 0, f"sender failed ({tx.returncode}): {tx.stderr[-3000:]}"
        out, err = rx.communicate(timeout=timeout)
        assert rx.returncode == 0, f"receiver failed ({rx.returncode}): {err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1]), json.loads(tx.stdout.strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(timeout=10)


def tcp_counters(ns: str) -> dict[str, int]:
    """The namespace's /proc/net/snmp and /proc/net/netstat as {"Tcp.RetransSegs": n, ...}."""
    r = subprocess.run(in_ns(ns, "cat", "/proc/net/snmp", "/proc/net/netstat"), capture_output=True, text=True,
                       timeout=30, check=True)
    out: dict[str, int] = {}
    lines = r.stdout.splitlines()
    for head, vals in zip(lines[0::2], lines[1::2]):
        proto, names = head.split(":", 1)
        _, values = vals.split(":", 1)
        for k, v in zip(names.split(), values.split()):
            try:
                out[f"{proto}.{k}"] = int(v)
            except ValueError:
                pass
    return out


def nfqueue_rules(ns: str) -> list[str]:
    r = subprocess.run(in_ns(ns, "iptables", "-S"), capture_output=True, text=True, timeout=30, check=True)
    return [line for line in r.stdout.splitlines() if "NFQUEUE" in line]


def test_tcp_transfer_survives_drop_delay_reorder_and_duplication(two_ns, tmp_path):
    a, b = two_ns
    data = os.urandom(16 * MiB)
    before_a, before_b = tcp_counters(a), tcp_counters(b)
    imp = Impairment(b, ["-p", "tcp", "-s", A_IP], chain="INPUT", drop=0.02, delay_ms=3, jitter_ms=3,
                     duplicate=0.01, seed=7)
    with imp:
        assert imp.rule_present(), f"the NFQUEUE rule is not installed in {b}: {nfqueue_rules(b)}"
        got, sent = transfer(a, b, data, tmp_path)
        live = imp.stats()
    c = imp.final
    assert c is not None
    after_a, after_b = tcp_counters(a), tcp_counters(b)
    print(f"\nimpairment counters: {c}\nsender: {sent}")

    assert got["bytes"] == len(data), f"received {got['bytes']} bytes, sent {len(data)}"
    assert got["sha256"] == hashlib.sha256(data).hexdigest(), "the bytes arrived corrupted"

    # The loop saw the whole data direction (16 MiB in <= 1448-byte segments, plus retransmits).
    assert live["seen"] <= c["seen"]
    assert c["seen"] >= len(data) // 1500, f"too few packets went through the queue: {c}"
    assert c["dropped"] > 0 and c["delayed"] > 0 and c["reordered"] > 0 and c["duplicated"] > 0, c
    assert 0.005 < c["dropped"] / c["seen"] < 0.05, f"drop rate far from the 2% asked for: {c}"
    assert c["delayed"] > 0.8 * c["seen"], f"most packets should have been delayed: {c}"
    assert c["accepted"] + c["dropped"] == c["seen"], f"every packet gets exactly one verdict: {c}"
    assert c["held"] == 0 and c["nl_errors"] == 0 and c["dup_errors"] == 0, c

    # The kernel agrees: the sender retransmitted, the receiver queued out-of-order segments.
    retrans = after_a["Tcp.RetransSegs"] - before_a["Tcp.RetransSegs"]
    ofo = after_b["TcpExt.TCPOFOQueue"] - before_b["TcpExt.TCPOFOQueue"]
    print(f"sender RetransSegs +{retrans}, receiver TCPOFOQueue +{ofo}")
    assert retrans > 0, "no TCP retransmissions: the drops had no effect"
    assert ofo > 0, "no out-of-order segments at the receiver: nothing was reordered or dropped"

    # Stopped: the rule is gone and the link is clean.
    assert nfqueue_rules(b) == [], f"the NFQUEUE rule outlived the impairment: {nfqueue_rules(b)}"
    got2, _ = transfer(a, b, data[:MiB], tmp_path, timeout=10)
    assert got2["sha256"] == hashlib.sha256(data[:MiB]).hexdigest()


def test_held_packets_are_bounded(two_ns, tmp_path):
    a, b = two_ns
    data = os.urandom(2 * MiB)
    with Impairment(b, ["-p", "tcp", "-s", A_IP], chain="INPUT", delay_ms=20, max_held=16, seed=3) as imp:
        got, _ = transfer(a, b, data, tmp_path)
    c = imp.final
    print(f"\nimpairment counters: {c}")
    assert got["sha256"] == hashlib.sha256(data).hexdigest()
    assert c["max_held_seen"] <= 16, c
    assert c["overflow"] > 0 and c["delayed"] > 0, c
    assert c["dropped"] == 0 and c["accepted"] == c["seen"], c


def test_killed_loop_fails_closed_and_stop_removes_the_rule(two_ns, tmp_path):
    a, b = two_ns
    imp = Impairment(a, ["-p", "tcp", "-d", B_IP]).start()
    try:
        assert imp.rule_present()
        imp.popen.kill()  # the loop dies with its rule installed (no cleanup of its own)
        imp.popen.wait(timeout=10)
        assert imp.rule_present(), "the rule should survive a SIGKILL of the loop"
        # No --queue-bypass: with no loop bound to the queue, matching packets are dropped.
        probe = subprocess.run(
            in_ns(a, sys.executable, "-c",
                  f"import socket; socket.create_connection(({B_IP!r}, 9), timeout=1)"),
            capture_output=True, text=True, timeout=30,
        )
        assert "timed out" in probe.stderr, f"expected the SYN to be dropped (fail closed): {probe.stderr[-500:]}"
        with pytest.raises(ImpairmentError, match="ended before"):
            imp.stop()
        assert not imp.rule_present(), f"stop() left the rule behind: {nfqueue_rules(a)}"
    finally:
        if imp.popen.poll() is None:
            imp.popen.kill()
        imp.remove_leftover_rule()
