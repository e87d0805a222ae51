"""The devmem receive path end to end, over the kernel-faithful emulator (DESIGN §8.4):

    shardwire source  ->  shardwire serve --receive devmem-sim  ->  shardwire consume

With `--receive devmem-sim` every data connection is read through the devmem path: the
emulator lands the real TCP bytes in 4 KiB net_iovs of a memfd "dma-buf" taken from a
freelist and describes them with kernel-format SCM_DEVMEM_DMABUF cmsgs; the node parses
them with its real cmsg parser, gathers the frags into the shard's slab, checks CRC-32C and
returns the tokens with the kernel's SO_DEVMEM_DONTNEED semantics. A small binding
(`--devmem-memory 1MiB`, 256 net_iovs for 4 flows) makes the freelist recycle every page
many times. `--receive devmem` on a machine without a devmem NIC must refuse to start
with the reason, never fall back silently.
"""

from __future__ import annotations

import json
import re

import numpy as np

from conftest import (
    MiB,
    admin_request,
    Proc,
    assert_byte_exact,
    assert_exactly_once,
    expected_crcs,
    http_get,
    index_dataset,
    wait_ready,
    write_npy_dataset,
    write_uint8_shards,
)


def _dataset(d, seed: int) -> dict:
    # Sizes that are not multiples of 4 KiB, so frags end mid-page and cross shard ends.
    write_uint8_shards(d, 10, 3 * MiB + 1234, seed=seed)
    rng = np.random.default_rng(seed)
    write_npy_dataset(d, {f"f{i}.npy": rng.standard_normal((37 + i, 129)).astype(np.float32) for i in range(4)})
    return index_dataset(d)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def test_devmem_sim_two_sources_two_ranks_byte_exact(sw, tmp_path):
    d = tmp_path / "ds"
    m = _dataset(d, seed=21)
    n = len(m["shards"])
    expected = expected_crcs(d)
    a, b = sw.source({"dm": d}), sw.source({"dm": d})
    node = sw.serve([a, b], "--receive", "devmem-sim", "--devmem-memory", "1MiB", "--flows", "2",
                    "--stream-memory", "32MiB", "--pool-size", "64MiB")
    st = wait_ready(node, sources=2)
    assert st["mode"]["receive"] == "devmem-sim", st["mode"]
    assert "NOT GPU-direct" in st["mode"]["reason"], st["mode"]

    r0 = sw.start_consume(node, "dm", seed=5, rank=0, world_size=2)
    r1 = sw.start_consume(node, "dm", seed=5, rank=1, world_size=2)
    batches = r0.result() + r1.result()
    assert_exactly_once(batches, n)
    assert_byte_exact(batches, expected)

    st = node.status()
    dm = st["devmem"]
    print(f"devmem-sim status after the epoch: {dm}")
    assert st["counters"]["crc_failures"] == 0
    assert dm["niovs"] == 256
    assert dm["dmabuf_bytes"] >= m["total_bytes"], dm
    assert dm["frags"] >= m["total_bytes"] // 4096, dm
    assert dm["frags"] > 10 * dm["niovs"], f"the freelist must have recycled the pages: {dm}"
    assert dm["tokens_returned"] == dm["frags"], f"every token comes back: {dm}"
    assert dm["linear_bytes"] == 0 and dm["plain_bytes"] == 0, dm
    assert dm["niovs_free"] == dm["niovs"], f"nothing held once the epoch is consumed: {dm}"

    code, body = http_get(node.admin, "/v1/bindings")
    assert code == 200, body
    listed = json.loads(body)
    assert listed["receive"] == "devmem-sim"
    assert [b["binding"] for b in listed["bindings"]] == [1], listed
    assert listed["bindings"][0]["kind"] == "emulated"

    code, text = http_get(node.admin, "/metrics")
    assert code == 200
    assert _metric(text, "shardwire_devmem_frags_total", '{lane="0"}') == dm["frags"]
    assert _metric(text, "shardwire_devmem_niovs", '{lane="0",state="in_use"}') == 0
    assert _metric(text, "shardwire_devmem_tokens_returned_total", '{lane="0"}') > 0
    assert _metric(text, "shardwire_devmem_steering_errors_total", '{lane="0"}') == 0
    assert 'shardwire_bytes_received_total{mode="devmem-sim"}' in text


def test_devmem_sim_corrupt_payloads_are_refetched_not_delivered(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 8, 200_000, seed=3)
    m = index_dataset(d)
    expected = expected_crcs(d)
    src = sw.source({"c": d}, "--fault-corrupt", "2")
    node = sw.serve([src], "--receive", "devmem-sim", "--devmem-memory", "1MiB",
                    "--stream-memory", "16MiB", "--pool-size", "64MiB")
    wait_ready(node)
    batches = sw.consume(node, "c", seed=1)
    assert_exactly_once(batches, len(m["shards"]))
    assert_byte_exact(batches, expected)
    st = node.status()
    assert st["counters"]["crc_failures"] == 2, st["counters"]
    assert st["counters"]["refetches"] >= 2, st["counters"]
    assert st["devmem"]["niovs_free"] == st["devmem"]["niovs"], st["devmem"]


def test_devmem_receive_without_a_devmem_nic_refuses_to_start(sw, tmp_path):
    p = sw._start(Proc, "serve", ["serve", "--source", "127.0.0.1:1", "--socket", tmp_path / "x.sock",
                                            "--data-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                                            "--receive", "devmem"])
    rc = p.wait(30)
    err = p.stderr_text()
    assert rc != 0, err
    assert "receive=devmem is not possible here" in err, err
    assert "EOPNOTSUPP" in err and "devmem-sim" in err, err


def test_devmem_receive_on_a_named_interface_names_why_it_cannot(sw, tmp_path):
    def serve_fails(*extra) -> str:
        p = sw._start(Proc, "serve", ["serve", "--source", "127.0.0.1:1", "--socket", tmp_path / "y.sock",
                                      "--data-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                                      "--receive", "devmem", *extra])
        rc = p.wait(30)
        assert rc != 0, p.stderr_text()
        return p.stderr_text()

    err = serve_fails("--devmem-interface", "lo")
    assert "lo cannot do devmem" in err and "no queue management ops" in err, err
    err = serve_fails("--devmem-interface", "nosuch0")
    assert "devmem_interface nosuch0 does not exist" in err, err


def _call(admin: str, method: str, path: str, body: dict | None = None, token: str | None = "tok") -> tuple[int, dict]:
    return admin_request(admin, method, path, body, token)


def test_bindings_are_created_and_deleted_over_the_admin_api(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 12, 300_000, seed=8)
    m = index_dataset(d)
    n = len(m["shards"])
    expected = expected_crcs(d)
    token = tmp_path / "admin.token"
    token.write_text("tok\n")
    src = sw.source({"b": d})
    node = sw.serve([src], "--receive", "host", "--stream-memory", "16MiB", "--pool-size", "64MiB",
                    "--config", _cfg(tmp_path, token))
    wait_ready(node)

    def epoch(seed):
        batches = sw.consume(node, "b", seed=seed)
        assert_exactly_once(batches, n)
        assert_byte_exact(batches, expected)

    epoch(1)
    assert node.status()["mode"]["receive"] == "host"

    # Bad requests name what is wrong; nothing changes.
    assert _call(node.admin, "POST", "/v1/bindings", {"interface": "emulator"}, token=None)[0] == 401
    code, body = _call(node.admin, "POST", "/v1/bindings", {"interface": "emulator", "bogus": 1})
    assert code == 400 and "bogus" in body["message"], body
    code, body = _call(node.admin, "POST", "/v1/bindings", {"interface": "nosuch0"})
    assert code == 404 and body["code"] == "unknown_interface", body
    code, body = _call(node.admin, "POST", "/v1/bindings", {"interface": "lo"})
    assert code == 409 and body["code"] == "not_capable" and "EOPNOTSUPP" in body["message"], body
    code, body = _call(node.admin, "POST", "/v1/bindings", {"interface": "emulator", "memory": "1KiB"})
    assert code == 400 and "1MiB" in body["message"], body
    # Queues the emulator would not use are refused, not dropped (before: 201, queues ignored).
    code, body = _call(node.admin, "POST", "/v1/bindings", {"interface": "emulator", "queues": [6, 7]})
    assert code == 400 and "queues [6, 7]" in body["message"], body

    # Create: the links reconnect and the next epoch arrives through the devmem path.
    code, body = _call(node.admin, "POST", "/v1/bindings", {"interface": "emulator", "memory": "2MiB"})
    assert code == 201 and body["kind"] == "emulated" and body["niovs"] == 512, body
    bid = body["binding"]
    code, again = _call(node.admin, "POST", "/v1/bindings", {"interface": "emulator"})
    assert code == 409 and again["code"] == "binding_exists", again
    st = wait_ready(node)
    assert st["mode"]["receive"] == "devmem-sim" and "admin API" in st["mode"]["reason"], st["mode"]
    epoch(2)
    frags = node.status()["devmem"]["frags"]
    assert frags >= m["total_bytes"] // 4096, node.status()["devmem"]
    assert 'shardwire_devmem_frags_total{lane="0"}' in _metrics(node), "the binding's series while it is bound"

    # Delete: waits for the readers, unbinds; the next epoch is plain TCP again.
    code, body = _call(node.admin, "DELETE", f"/v1/bindings/{bid}")
    assert code == 200 and body["deleted"] == bid and body["readers_left"] == 0, body
    assert _call(node.admin, "DELETE", f"/v1/bindings/{bid}")[0] == 404
    st = wait_ready(node)
    assert st["mode"]["receive"] == "host" and st["devmem"] is None, st["mode"]
    # The deleted binding's series are gone from /metrics, not left at their last values.
    left = [l for l in _metrics(node).splitlines() if l.startswith("shardwire_devmem_")]
    assert not left, left
    epoch(3)
    assert node.status()["counters"]["crc_failures"] == 0


def _metrics(node) -> str:
    code, body = http_get(node.admin, "/metrics")
    assert code == 200, body
    return body


def _cfg(tmp_path, token) -> str:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'admin_token_file = "{token}"\ndrain_timeout_secs = 20\n')
    return str(cfg)


def test_source_devmem_tx_without_a_capable_nic_refuses_to_start(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 2, 4096, seed=1)
    index_dataset(d)
    for iface, want in (("nosuch0", "no interface named nosuch0"), ("lo", "devmem TX")):
        p = sw._start(Proc, "source", ["source", "--listen", "127.0.0.1:0", "--dataset", f"t={d}", "--devmem-tx", iface])
        rc = p.wait(30)
        err = p.stderr_text()
        assert rc != 0, err
        assert want in err, err
        if iface == "lo":  # no udmabuf here, or a driver without netmem TX: either is named
            assert "/dev/udmabuf" in err or "EOPNOTSUPP" in err, err
