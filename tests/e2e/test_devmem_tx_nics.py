"""Devmem TX on every NIC of a source (issue "Devmem TCP on every lane", item 4): a source in a
network namespace with four veth peers, one per lane subnet, given `--devmem-tx` on all four,
and a node with four host lanes on the other ends (the fixtures of test_lanes_netns.py). Every
data connection must leave by the NIC its lane is routed through, bound to it
(`SO_BINDTODEVICE`, shown by `ss` as `addr%dev`), and send from that NIC's TX ring (the
per-interface counter). No veth can `bind-tx` (the kernel has no netmem TX for it), so
`--devmem-tx-emulate` stands in unbound buffers for the bindings: the NIC choice, the device
binding, the rings and the zerocopy completions are the real path. A veth given without the
emulation is refused at start, naming it (test_devmem_sim.py covers the refusal on one NIC).
"""

from __future__ import annotations

import re
import subprocess

from conftest import assert_byte_exact, assert_exactly_once, expected_crcs, http_get, wait_for, wait_ready
from test_lanes_netns import SHARDS, SIZE, net, node_ip, pytestmark, serve_lanes, setup, source_in  # noqa: F401

ADMIN = re.compile(r"source admin on http://(\S+)")


def tx_bytes(admin: str) -> dict[str, float]:
    """shardwire_source_devmem_tx_bytes_total by interface."""
    code, text = http_get(admin, "/metrics")
    assert code == 200, text
    out = {}
    for m in re.finditer(r'^shardwire_source_devmem_tx_bytes_total\{interface="([^"]+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def bound_devices(ns: str) -> dict[str, set[str]]:
    """Peer address (ip:port) -> the devices the source's established connections to it are
    bound to ("" for a connection bound to none)."""
    r = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tnH", "state", "established"], capture_output=True,
                       text=True, timeout=30, check=True)
    out: dict[str, set[str]] = {}
    for line in r.stdout.splitlines():
        local, peer = line.split()[-2:]
        dev = local.rsplit(":", 1)[0].partition("%")[2]
        out.setdefault(peer, set()).add(dev)
    return out


def data_bindings(ns: str, node) -> list[set[str]]:
    """Per lane, the devices the source's data connections to that lane's address are bound
    to (the control connection, which the node dialled, is not among them)."""
    bound = bound_devices(ns)
    return [bound.get(lane["data_addr"], set()) for lane in node.status()["lanes"]]


def test_each_lane_leaves_by_its_nic_and_sends_from_that_nics_ring(sw, setup, net):
    ns, d, secret, tree, gpus = setup
    peers = [name.replace("sl", "sp", 1) for name in net[1]]
    tx = [a for p in peers for a in ("--devmem-tx", p)]
    src = source_in(sw, ns, d, secret, *tx, "--devmem-tx-emulate", "--devmem-tx-memory", "8MiB",
                    "--admin", "10.214.0.2:0")
    src.admin = src.wait_line(ADMIN).group(1)
    node = serve_lanes(sw, src, secret, tree, "host", {})
    wait_ready(node)
    wait_for(lambda: all(data_bindings(ns, node)), "the source's data connections to every lane", diag=node.describe)
    assert data_bindings(ns, node) == [{p} for p in peers]
    expected = expected_crcs(d)
    for i, gpu in enumerate(gpus):
        before = tx_bytes(src.admin).get(peers[i], 0)
        batches = sw.consume(node, "ds", device=gpu, seed=i)
        assert_exactly_once(batches, SHARDS)
        assert_byte_exact(batches, expected)
        sent = tx_bytes(src.admin)
        assert sent.get(peers[i], 0) - before >= SHARDS * SIZE, (i, sent)
    assert set(tx_bytes(src.admin)) == set(peers), "bytes went out only through the four TX rings"
    assert "devmem TX emulated" in src.stderr_text()
    assert node.status()["counters"]["crc_failures"] == 0


def test_a_lane_routed_through_an_interface_without_a_binding_sends_with_sendfile(sw, setup, net):
    ns, d, secret, tree, gpus = setup
    peers = [name.replace("sl", "sp", 1) for name in net[1]]
    # Bindings on lanes 0 and 1 only: lanes 2 and 3 are reached through peers without one.
    src = source_in(sw, ns, d, secret, "--devmem-tx", peers[0], "--devmem-tx", peers[1], "--devmem-tx-emulate",
                    "--devmem-tx-memory", "8MiB", "--admin", "10.214.0.2:0")
    src.admin = src.wait_line(ADMIN).group(1)
    node = serve_lanes(sw, src, secret, tree, "host", {})
    wait_ready(node)
    wait_for(lambda: all(data_bindings(ns, node)), "the source's data connections to every lane", diag=node.describe)
    assert data_bindings(ns, node) == [{peers[0]}, {peers[1]}, {""}, {""}]
    batches = sw.consume(node, "ds", device=gpus[3], seed=3)
    assert_exactly_once(batches, SHARDS)
    assert_byte_exact(batches, expected_crcs(d))
    assert set(tx_bytes(src.admin)) <= {peers[0], peers[1]}
    text = src.stderr_text()
    assert "reached from an address of no devmem TX interface" in text and node_ip(3) in text, text[-3000:]
