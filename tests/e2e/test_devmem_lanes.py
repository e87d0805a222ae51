"""Devmem on every lane, over the kernel-faithful emulator: a node with two host lanes on two
loopback addresses (127.0.0.1 and 127.0.0.2) and `--receive devmem-sim`. Each lane gets its own
binding (its own emulated NIC, queues and dma-buf, so its own binding id); each data connection
is steered by a 5-tuple rule to its lane's queues and reads through its lane's binding only,
every frag checked against that binding's id. Every byte exact, every frag in its lane's
binding (per-lane status counters), no steering error, every token back.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import (
    admin_request,
    assert_byte_exact,
    assert_exactly_once,
    child_env,
    expected_crcs,
    http_get,
    index_dataset,
    require_bin,
    wait_for,
    write_uint8_shards,
)
from test_lanes import lanes_opened, lanes_toml, lanes_up, two_lane_node

SHARDS, SIZE = 12, 700_001  # not a multiple of 4 KiB: frags end mid-page


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, SHARDS, SIZE, seed=24)
    index_dataset(d)
    return d


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def settled_lanes(node) -> list[dict]:
    """The node's lanes once every net_iov is back in its lane's pool."""
    def settled():
        ls = node.status()["lanes"]
        return ls if all(l["binding"]["niovs_free"] == l["binding"]["niovs"] for l in ls) else None

    return wait_for(settled, "every net_iov back in its lane's pool", diag=node.describe)


def test_devmem_sim_on_two_lanes_each_lane_its_own_binding(sw, tmp_path, dataset):
    expected = expected_crcs(dataset)
    src = sw.source({"ds": dataset})
    node = two_lane_node(sw, tmp_path, src, "--receive", "devmem-sim", "--devmem-memory", "1MiB")
    lanes = lanes_up(node)
    st = node.status()
    assert st["mode"]["receive"] == "devmem-sim", st["mode"]
    bindings = [l["binding"] for l in lanes]
    assert all(bindings), lanes
    assert [b["lane"] for b in bindings] == [0, 1], bindings
    ids = [b["binding"] for b in bindings]
    assert len(set(ids)) == 2, f"each lane its own dma-buf and id: {bindings}"
    assert [b["interface"] for b in bindings] == ["emu0", "emu1"], bindings

    code, body = http_get(node.admin, "/v1/bindings")
    assert code == 200, body
    listed = json.loads(body)["bindings"]
    assert [(b["lane"], b["binding"]) for b in listed] == [(0, ids[0]), (1, ids[1])], listed

    # A trainer holding its stream on lane 0, then one on lane 1: both lanes carry payloads.
    held = sw.start_consume(node, "ds", limit=1, hold_secs=60)
    wait_for(lambda: [s["lane"] for s in node.status()["streams"]] == [0], "the first stream on lane 0",
             diag=node.describe)
    second = sw.consume(node, "ds", seed=7)
    assert_exactly_once(second, SHARDS)
    assert_byte_exact(second, expected)
    held.kill()
    wait_for(lambda: not node.status()["streams"], "the held stream to close", diag=node.describe)
    third = sw.consume(node, "ds", seed=8)
    assert_exactly_once(third, SHARDS)
    assert_byte_exact(third, expected)
    assert lanes_opened(node, 8) == [0], node.stderr_text()[-3000:]  # both lanes idle: the lowest id

    lanes = settled_lanes(node)
    st = node.status()
    assert st["counters"]["crc_failures"] == 0, st["counters"]
    for l in lanes:
        b = l["binding"]
        print(f"lane {l['lane']}: {l['bytes_received']} bytes, binding {b}")
        # Every payload byte of the lane came out of its own binding's dma-buf as frags.
        assert b["dmabuf_bytes"] == l["bytes_received"] > SIZE, (l["bytes_received"], b)
        assert b["frags"] >= b["dmabuf_bytes"] // 4096, b
        assert b["tokens_returned"] == b["frags"], b
        assert b["steering_errors"] == 0 and b["linear_bytes"] == 0 and b["plain_bytes"] == 0, b

    code, text = http_get(node.admin, "/metrics")
    assert code == 200
    for l in lanes:
        lane = f'{{lane="{l["lane"]}"}}'
        assert _metric(text, "shardwire_devmem_frags_total", lane) == l["binding"]["frags"]
        assert _metric(text, "shardwire_devmem_steering_errors_total", lane) == 0


def test_devmem_sim_on_four_lanes_one_trainer_each(sw, tmp_path, dataset):
    """Four lanes on 127.0.0.1-4, four trainers (each stream on the least loaded lane, so one
    per lane), each holding its stream at the end of its epoch until all are placed."""
    expected = expected_crcs(dataset)
    cfg = lanes_toml(tmp_path / "lanes.toml", [f"127.0.0.{i}:0" for i in range(1, 5)])
    src = sw.source({"ds": dataset})
    node = sw.serve([src], "--config", cfg, "--flows", "2", "--pool-size", "64MiB", "--stream-memory", "16MiB",
                    "--receive", "devmem-sim", "--devmem-memory", "1MiB")
    lanes_up(node)
    # All four at once: the lane is chosen and its memory reserved in one step.
    trainers = [sw.start_consume(node, "ds", seed=i, limit=SHARDS, hold_secs=6) for i in range(4)]
    wait_for(lambda: sorted(s["lane"] for s in node.status()["streams"]) == [0, 1, 2, 3],
             "one stream on each lane", diag=node.describe)
    for t in trainers:
        batches = t.result()
        assert_exactly_once(batches, SHARDS)
        assert_byte_exact(batches, expected)
    lanes = settled_lanes(node)
    ids = {l["binding"]["binding"] for l in lanes}
    assert len(ids) == 4, f"each lane its own binding: {lanes}"
    for l in lanes:
        b = l["binding"]
        assert b["dmabuf_bytes"] == l["bytes_received"] >= SHARDS * SIZE, (l["lane"], l["bytes_received"], b)
        assert b["tokens_returned"] == b["frags"] and b["steering_errors"] == 0, b
    assert node.status()["counters"]["crc_failures"] == 0


def test_frags_of_another_lanes_binding_are_counted_refused_and_refetched(sw, tmp_path, dataset):
    """`fault_misplace = 1`: lane 0's first devmem data connection lands on lane 1's binding, as
    a misplaced steering rule would put it. Its frags name lane 1's binding: the node counts a
    steering error on lane 0, returns the tokens (lane 1's pool comes back full), fails the
    payload and fetches it again; the trainer still gets every shard exactly once, byte-exact."""
    expected = expected_crcs(dataset)
    cfg = tmp_path / "serve.toml"
    cfg.write_text('fault_misplace = 1\nlanes = [{ data_listen = "127.0.0.1:0" }, { data_listen = "127.0.0.2:0" }]\n')
    src = sw.source({"ds": dataset})
    node = sw.serve([src], "--config", str(cfg), "--flows", "2", "--pool-size", "64MiB", "--stream-memory", "16MiB",
                    "--receive", "devmem-sim", "--devmem-memory", "1MiB")
    lanes_up(node)
    batches = sw.consume(node, "ds", seed=3)  # the first stream goes to lane 0
    assert_exactly_once(batches, SHARDS)
    assert_byte_exact(batches, expected)

    lanes = settled_lanes(node)
    b0, b1 = lanes[0]["binding"], lanes[1]["binding"]
    print(f"lane 0 binding {b0}\nlane 1 binding {b1}")
    assert b0["steering_errors"] == 1, b0
    assert b1["steering_errors"] == 0 and b1["frags"] == 0, b1
    assert b0["tokens_returned"] > b0["frags"], f"the refused frags' tokens came back too: {b0}"
    st = node.status()
    assert st["counters"]["refetches"] >= 1, st["counters"]
    assert "a frag of another lane's binding reached this connection" in node.stderr_text()
    code, text = http_get(node.admin, "/metrics")
    assert code == 200
    assert _metric(text, "shardwire_devmem_steering_errors_total", '{lane="0"}') == 1


def test_demo_with_two_devmem_sim_lanes_prints_each_lanes_binding():
    r = subprocess.run([str(require_bin()), "demo", "--lanes", "2", "--receive", "devmem-sim"],
                       capture_output=True, text=True, timeout=120, env=child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CRC failures: 0" in r.stdout, r.stdout
    lines = re.findall(r"^lane (\d) \(127\.0\.0\.(\d):\d+\): 2 data connections, (\d+) bytes received, "
                       r"binding (\d+) on emu\d queues \[[\d, ]+\]: (\d+) frags, (\d+) tokens returned, "
                       r"0 steering errors$", r.stdout, re.M)
    assert [(lane, ip) for lane, ip, *_ in lines] == [("0", "1"), ("1", "2")], r.stdout
    assert lines[0][3] != lines[1][3], f"each lane its own binding: {r.stdout}"
    for _, _, nbytes, _, frags, tokens in lines:
        assert int(nbytes) > 0 and int(frags) > 0 and frags == tokens, r.stdout


def test_two_lanes_sharing_one_nic_bind_disjoint_queue_sets(sw, tmp_path, dataset):
    """Two lanes on one interface (as two GPUs share a NIC) with queue sets of different
    heights: the emulated NIC has every lane's queues, each lane binds its own set with its own
    dma-buf, and a stream on each is byte-exact from its own binding."""
    cfg = tmp_path / "shared.toml"
    cfg.write_text('lanes = [{ interface = "lo", data_listen = "127.0.0.1:0", queues = [8, 9] },'
                   ' { interface = "lo", data_listen = "127.0.0.2:0", queues = [20, 21] }]\n')
    src = sw.source({"ds": dataset})
    node = sw.serve([src], "--config", str(cfg), "--flows", "2", "--pool-size", "64MiB", "--stream-memory", "16MiB",
                    "--receive", "devmem-sim", "--devmem-memory", "1MiB")
    lanes = lanes_up(node)
    bindings = [l["binding"] for l in lanes]
    assert [(b["interface"], b["queues"]) for b in bindings] == [("emu-lo", [8, 9]), ("emu-lo", [20, 21])], bindings
    assert bindings[0]["binding"] != bindings[1]["binding"], bindings
    expected = expected_crcs(dataset)
    held = [sw.start_consume(node, "ds", seed=i, limit=SHARDS, hold_secs=4) for i in range(2)]
    wait_for(lambda: sorted(s["lane"] for s in node.status()["streams"]) == [0, 1], "a stream on each lane",
             diag=node.describe)
    for t in held:
        batches = t.result()
        assert_exactly_once(batches, SHARDS)
        assert_byte_exact(batches, expected)
    for l in settled_lanes(node):
        b = l["binding"]
        assert b["dmabuf_bytes"] == l["bytes_received"] >= SHARDS * SIZE and b["steering_errors"] == 0, (l, b)


def test_a_binding_on_another_nic_than_the_lanes_is_refused_naming_both(sw, tmp_path, dataset):
    token = tmp_path / "admin.token"
    token.write_text("tok\n")
    cfg = tmp_path / "nic.toml"
    cfg.write_text(f'admin_token_file = "{token}"\n'
                   'lanes = [{ interface = "lo", data_listen = "127.0.0.1:0" },'
                   ' { interface = "lo", data_listen = "127.0.0.2:0" }]\n')
    src = sw.source({"ds": dataset})
    node = sw.serve([src], "--config", str(cfg), "--receive", "host", "--pool-size", "64MiB",
                    "--stream-memory", "16MiB")
    lanes_up(node)
    code, body = admin_request(node.admin, "POST", "/v1/bindings", {"interface": "eth0", "lane": 1}, "tok")
    assert code == 404 and body["code"] == "unknown_interface", body
    assert "lane 1 receives through lo, not eth0" in body["message"], body
    assert node.status()["lanes"][1]["binding"] is None
