"""Lanes on one machine without a GPU: a node with two host-memory lanes on two loopback
addresses (127.0.0.1 and 127.0.0.2, each its own data port), the source dialling both, streams
placed on the least loaded lane, each lane's data connections arriving on its own address, and
the refusals: a connection dialled to the other lane's address (the source's fault injection),
a trainer naming a GPU the node does not serve, a protocol version 2 node. Also `shardwire
topology` over the fixture sysfs trees (tests/fixtures/sysfs).

The four-lane test with network namespaces and the fake libcuda is test_lanes_netns.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys

import pytest

from conftest import (
    REPO,
    assert_byte_exact,
    assert_exactly_once,
    child_env,
    expected_crcs,
    get_status,
    http_get,
    index_dataset,
    shardwire_bin,
    wait_for,
    wait_ready,
    write_uint8_shards,
)

FIXTURES = REPO / "tests" / "fixtures" / "sysfs"
SHARDS, SIZE = 10, 300 * 1024


def lanes_toml(path, addrs: list[str]) -> str:
    """A `serve` config file with one host lane per data address."""
    path.write_text("lanes = [" + ", ".join(f'{{ data_listen = "{a}" }}' for a in addrs) + "]\n")
    return str(path)


def established_on(ip: str, port: int) -> int:
    """TCP connections established whose local address is ip:port (/proc/net/tcp)."""
    a, b, c, d = (int(x) for x in ip.split("."))
    want = f"{d:02X}{c:02X}{b:02X}{a:02X}:{port:04X}"
    with open("/proc/net/tcp") as f:
        next(f)
        return sum(1 for line in f if line.split()[1] == want and line.split()[3] == "01")


def metric(admin: str, name: str) -> float:
    code, text = http_get(admin, "/metrics")
    assert code == 200
    lines = [line for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
    assert lines, f"no {name} in /metrics"
    return float(lines[0].split()[-1])


def lanes_opened(node, seed: int) -> list[int]:
    """The lanes of the streams the node logged as opened with `seed` (its "stream opened"
    lines: `lane=N device="-" dataset=ds seed=S rank=...`)."""
    return [int(n) for n in re.findall(rf'\blane=(\d+) device="-" dataset=ds seed={seed} rank=', node.stderr_text())]


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, SHARDS, SIZE, seed=21)
    index_dataset(d)
    return d


def two_lane_node(sw, tmp_path, src, *extra):
    cfg = lanes_toml(tmp_path / "lanes.toml", ["127.0.0.1:0", "127.0.0.2:0"])
    node = sw.serve([src], "--config", cfg, "--flows", "2", "--pool-size", "64MiB", "--stream-memory", "16MiB", *extra)
    wait_ready(node)
    return node


def lanes_up(node, conns: int = 2) -> list[dict]:
    """The node's lanes once each has `conns` data connections."""
    def ready():
        lanes = node.status()["lanes"]
        return lanes if all(l["data_connections"] >= conns for l in lanes) else None

    return wait_for(ready, f"{conns} data connections on every lane", diag=node.describe)


def test_two_host_lanes_on_loopback_each_carry_their_own_streams(sw, tmp_path, dataset):
    expected = expected_crcs(dataset)
    src = sw.source({"ds": dataset})
    node = two_lane_node(sw, tmp_path, src)
    lanes = lanes_up(node)
    assert [l["lane"] for l in lanes] == [0, 1]
    ips = [l["data_addr"].rsplit(":", 1)[0] for l in lanes]
    assert ips == ["127.0.0.1", "127.0.0.2"], lanes
    for l in lanes:
        assert (l["memory"], l["gpu"], l["data_connections_refused"]) == ("host", None, 0), l
        ip, port = l["data_addr"].rsplit(":", 1)
        # The node's ends of the lane's data connections are on the lane's own address.
        assert established_on(ip, int(port)) == 2, l
    # The source was told both lanes and dialled each one.
    assert f"lanes={lanes[0]['data_addr']}x2 {lanes[1]['data_addr']}x2" in src.stderr_text(), src.stderr_text()[-2000:]

    # A trainer holding its stream on lane 0 (least loaded, lowest id) ...
    held = sw.start_consume(node, "ds", limit=1, hold_secs=60)
    wait_for(lambda: [s["lane"] for s in node.status()["streams"]] == [0], "the first stream on lane 0", diag=node.describe)
    # ... so the next one goes to lane 1, the least loaded; each gets every shard byte-exact.
    second = sw.consume(node, "ds", seed=7)
    assert_exactly_once(second, SHARDS)
    assert_byte_exact(second, expected)
    assert "lane=1 device=\"-\" dataset=ds" in node.stderr_text(), node.stderr_text()[-3000:]
    held.kill()
    wait_for(lambda: not node.status()["streams"], "the held stream to close", diag=node.describe)
    third = sw.consume(node, "ds", seed=8)
    assert_exactly_once(third, SHARDS)
    assert_byte_exact(third, expected)
    # Both lanes idle again: the third goes to the lowest id.
    assert lanes_opened(node, 8) == [0], node.stderr_text()[-3000:]

    lanes = node.status()["lanes"]
    total = SHARDS * (SIZE + 128)  # .npy header of a 1-D uint8 array
    assert lanes[1]["bytes_received"] >= SHARDS * SIZE, lanes
    assert lanes[0]["bytes_received"] >= SHARDS * SIZE, lanes
    assert sum(l["bytes_received"] for l in lanes) <= 3 * total, lanes
    assert metric(node.admin, 'shardwire_lane_data_connections_total{lane="1"}') == 2
    assert metric(node.admin, 'shardwire_lane_bytes_received_total{lane="1"}') == lanes[1]["bytes_received"]
    assert metric(node.admin, 'shardwire_lane_data_connections_refused_total{lane="0"}') == 0

    # Two trainers opening at once spread over the lanes: the lane is chosen and its memory
    # reserved in one step, before the stream's manifest is fetched.
    wait_for(lambda: not node.status()["streams"], "no stream open", diag=node.describe)
    held = [sw.start_consume(node, "ds", limit=1, hold_secs=60) for _ in range(2)]
    wait_for(lambda: sorted(s["lane"] for s in node.status()["streams"]) == [0, 1],
             "two streams opened together on lanes 0 and 1", diag=node.describe)
    for h in held:
        h.kill()


def test_a_connection_dialled_to_the_other_lane_is_refused_and_counted(sw, tmp_path, dataset):
    expected = expected_crcs(dataset)
    src = sw.source({"ds": dataset}, "--fault-wrong-lane", "1")
    node = two_lane_node(sw, tmp_path, src)
    wait_for(lambda: node.status()["lanes"][0]["data_connections_refused"] == 1, "the misdialled connection to be refused",
             diag=node.describe)
    # Counted before it is logged: the line may come a moment after the count.
    wait_for(lambda: "refusing a data connection that arrived on another address than its lane's"
             in node.stderr_text(), "the refusal to be logged", diag=lambda: node.stderr_text()[-3000:])
    # The session starts over and the next one dials correctly: data flows, byte-exact.
    lanes_up(node)
    batches = sw.consume(node, "ds", seed=2)
    assert_exactly_once(batches, SHARDS)
    assert_byte_exact(batches, expected)
    lanes = node.status()["lanes"]
    assert [l["data_connections_refused"] for l in lanes] == [1, 0], lanes
    assert metric(node.admin, 'shardwire_lane_data_connections_refused_total{lane="0"}') == 1


def test_a_gpu_the_node_does_not_serve_is_refused_naming_it(sw, tmp_path, dataset):
    node = two_lane_node(sw, tmp_path, sw.source({"ds": dataset}))
    r = subprocess.run(
        [str(shardwire_bin()), "consume", "--socket", node.socket, "--dataset", "ds", "--device", "0000:99:00.0"],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )
    assert r.returncode != 0
    assert "unknown_device" in r.stderr and "device 0000:99:00.0 is not a GPU this node serves" in r.stderr, r.stderr
    assert "its lanes are host memory without a GPU" in r.stderr, r.stderr
    sys.path.insert(0, str(REPO / "client" / "python" / "src"))
    import shardwire

    client = shardwire.connect(node.socket)
    with pytest.raises(shardwire.ServiceError) as e:
        client.open_stream("ds", device="0000:99:00.0")
    assert e.value.code == "unknown_device" and "0000:99:00.0" in str(e.value)
    with pytest.raises(ValueError, match="names no GPU"):
        client.open_stream("ds", device="nic0")
    # `info` says what the node serves; a host-memory node's trainers name no GPU by default.
    info = client.info()
    assert info["memory"] == "host" and [l["lane"] for l in info["lanes"]] == [0, 1], info
    with client.open_stream("ds") as s:
        assert s.next(60) is not None
    # The torch dataset passes `device` on in shard mode too (it was dropped: the stream
    # opened on "auto"), at epoch 0 and at a later epoch (through the probe).
    pytest.importorskip("torch", reason="torch is installed by scripts/test")
    from shardwire.torch import IterableDataset

    for epoch in (0, 1):
        ds = IterableDataset("ds", socket=node.socket, device="0000:99:00.0")
        ds.set_epoch(epoch)
        with pytest.raises(shardwire.ServiceError) as e:
            next(iter(ds))
        assert e.value.code == "unknown_device", (epoch, e.value)


def test_a_version_2_node_is_refused_naming_both_versions(sw, dataset):
    src = sw.source({"ds": dataset})
    host, port = src.addr.rsplit(":", 1)
    node_id = b"an-old-node"
    body = bytes([2, 1]) + struct.pack(">H", len(node_id)) + node_id + bytes(32)
    body += bytes([4, 127, 0, 0, 1]) + struct.pack(">HH", 7401, 2)  # v2 Hello: data_addr, flows
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(struct.pack(">I", len(body)) + body)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        frame = s.recv(n, socket.MSG_WAITALL)
        assert s.recv(1) == b"", "the source closes the connection"
    version, kind = frame[0], frame[1]
    assert (version, kind) == (2, 10), "an Error frame in the node's own version"
    req, code, mlen = struct.unpack(">QHH", frame[2:14])
    message = frame[14:14 + mlen].decode()
    assert (req, code) == (0, 1), "UnsupportedVersion"
    assert "speaks shardwire protocol version 5" in message and "sent version 2" in message, message
    wait_for(lambda: "protocol version 2, this source 5" in src.stderr_text(), "the source to log both versions",
             diag=src.stderr_text)


def topology(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(shardwire_bin()), "topology", *args], capture_output=True, text=True, timeout=60,
                       env={**child_env(), **(env or {})})
    assert r.returncode == 0, r.stderr
    return r


def test_topology_shows_the_lanes_of_the_fixture_trees():
    r = topology("--sysfs-root", str(FIXTURES / "a3-8gpu-8nic"), "--json")
    doc = json.loads(r.stdout)
    assert sorted(doc) == ["gpus", "lanes", "nics"]
    assert len(doc["gpus"]) == 8 and len([n for n in doc["nics"] if not n["virtual"]]) == 9
    lanes = doc["lanes"]
    assert [l["lane"] for l in lanes] == list(range(8))
    assert {l["distance"] for l in lanes} == {"PIX"}
    assert sorted(l["nic"] for l in lanes) == [f"eth{i}" for i in range(1, 9)], "one NIC each, the host NIC eth0 never"
    for l in lanes:
        for key in ("gpu", "nic", "nic_pci", "distance", "numa_node", "queues", "data_addr"):
            assert key in l, (key, l)
    # Two GPUs per NIC: disjoint queue halves, both PIX.
    text = topology("--sysfs-root", str(FIXTURES / "8gpu-4nic")).stdout
    assert "Lanes: 8" in text
    assert "0000:04:00.0  eth1  PIX   0     8-11" in text and "0000:05:00.0  eth1  PIX   0     12-15" in text, text
    # A GPU whose only NIC is across sockets: SYS, marked, with the warning line.
    text = topology("--sysfs-root", str(FIXTURES / "cross-socket")).stdout
    assert "  !  0     0000:03:00.0  eth1  SYS" in text and "cross a CPU" in text, text
    # The sysfs root from the environment, as serve takes it.
    doc = json.loads(topology("--json", env={"SHARDWIRE_SYSFS_ROOT": str(FIXTURES / "two-domains")}).stdout)
    assert [(l["gpu"], l["nic"]) for l in doc["lanes"]] == [("0001:17:00.0", "eth1")], doc["lanes"]
    # memory = "cuda" on a host without a usable GPU: `serve` refuses to start, and so does
    # the plan (it showed host lanes that would never run).
    r = subprocess.run([str(shardwire_bin()), "topology", "--sysfs-root", str(FIXTURES / "8gpu-4nic")],
                       capture_output=True, text=True, timeout=60, env=child_env({"SHARDWIRE_MEMORY": "cuda"}))
    if r.returncode != 0:
        assert "`serve` would refuse to start" in r.stderr and 'memory = "cuda"' in r.stderr, r.stderr
    else:  # a host with a usable GPU (the GPU check): its lanes are planned
        assert "Lanes:" in r.stdout, r.stdout


def test_bench_lanes_reports_every_lane_and_the_total():
    r = subprocess.run([str(shardwire_bin()), "bench", "--lanes", "2", "--seconds", "1", "--flows", "1",
                        "--shard-size", "1MiB"], capture_output=True, text=True, timeout=180, env=child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    per_lane = [line for line in r.stdout.splitlines() if line.strip().startswith("lane ")]
    assert [line.split(":")[0].strip() for line in per_lane] == ["lane 0", "lane 1"], r.stdout
    for line in per_lane:
        delivered = float(line.split(":")[1].split()[0])
        assert delivered > 0, line
    total = [line for line in r.stdout.splitlines() if line.startswith("shardwire lanes: 2 lanes")]
    assert total and "CRC failures: 0" in total[0], r.stdout
    # Comparisons are single-lane only: asked with lanes, it says so.
    r = subprocess.run([str(shardwire_bin()), "bench", "--lanes", "2", "--compare-tcp"], capture_output=True,
                       text=True, timeout=60, env=child_env())
    assert r.returncode != 0 and "--lanes runs no comparisons" in r.stderr, r.stderr
