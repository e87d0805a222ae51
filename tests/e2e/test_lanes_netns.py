"""Four lanes on one machine: four veth pairs (one /24 each) between the root network namespace,
where the node runs, and a namespace of its own, where the source runs; a fake sysfs tree
(tests/fixtures/sysfs/generate.py `gpu_nic_pairs`) that puts one GPU and one of the node's veth
ends ("NICs") under each of four PCIe switches, two per socket; and, with `memory = cuda`, the
fake libcuda with four devices at those GPUs' bus ids (gpu/fakecuda, FAKE_CUDA_PCI_BUS_IDS).

The node pairs each GPU with the NIC on its switch, listens on each NIC's address, and the
source dials every lane. Four trainers, each naming another GPU (by bus id, by UUID, as
`cuda:2`, and as its current CUDA device), each get their stream on that GPU's lane: the
region on that GPU (the fake's allocation log), the shards through that lane's connections
(each accepted on its own address), every batch byte-exact, the lane's counters, its receiver
threads on the CPUs of its NIC's NUMA node. A trainer naming a GPU the node does not serve is
refused, and a connection the source dials to another lane's address (its fault injection) is
refused and counted. With `memory = host` the same lanes hold host memory placed on their NUMA
node where the kernel has it (numa_maps), and the source's route to lane 3's address goes
through lane 2's veth: the node receives those connections, counts each on lane 3 as on another
NIC and names the veth it came in on (read off the socket: the node's veth ends receive through
NAPI, GRO on, as real NICs do; every other connection is checked and on its own NIC).

What the doubles cannot show: a devmem NIC's steering and DMA into GPU memory (veth carries
plain TCP), or real PCIe distances (the tree is fake): scripts/gpu-check.sh on a GPU host.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import (
    MiB,
    REPO,
    SERVE_READY,
    SOURCE_READY,
    Serve,
    Source,
    assert_byte_exact,
    assert_exactly_once,
    child_env,
    crc32c,
    expected_crcs,
    index_dataset,
    shardwire_bin,
    wait_for,
    wait_ready,
    write_uint8_shards,
)
from test_cuda_fake import fake_env, fake_lines
from test_lanes import established_on, metric
from test_netns import ip

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ethtool") is None,
    reason="needs root, iproute2 (network namespaces, veth pairs) and ethtool (NAPI on the veths; scripts/test installs both)",
)

LANES = 4
SHARDS, SIZE = 8, 1 * MiB + 4321
STREAM_MEMORY = 16 * MiB


def node_ip(i: int) -> str:
    return f"10.214.{i}.1"


def remove_stale_lanes() -> None:
    """Deletes the namespaces (and with them the veth pairs) of an earlier run that was killed
    before its clean-up: their 10.214.i.1 addresses would shadow this run's routes."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if re.fullmatch(r"swls-[0-9a-f]{5}", name):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def ethtool(*args: str) -> None:
    subprocess.run(["ethtool", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def net():
    """A namespace for the source and LANES veth pairs: lane i's end `sl<tag><i>` in the root
    namespace at 10.214.i.1/24, its peer in the namespace at 10.214.i.2/24. The root ends
    receive through NAPI as a real NIC does, so a socket names the one it came in on (GRO on;
    and TSO off on the peers: a veth passes TSO frames around its NAPI), with loose
    reverse-path filtering (a lane's address reached through another veth is let in)."""
    remove_stale_lanes()
    tag = uuid.uuid4().hex[:5]
    ns, ifs = f"swls-{tag}", [f"sl{tag}{i}" for i in range(LANES)]
    ip("netns", "add", ns)
    try:
        for i, name in enumerate(ifs):
            peer = f"sp{tag}{i}"
            ip("link", "add", name, "type", "veth", "peer", "name", peer)
            ip("link", "set", peer, "netns", ns)
            ip("addr", "add", f"{node_ip(i)}/24", "dev", name)
            ip("link", "set", name, "up")
            ethtool("-K", name, "gro", "on")
            pathlib.Path(f"/proc/sys/net/ipv4/conf/{name}/rp_filter").write_text("2\n")
            ip("netns", "exec", ns, "ip", "addr", "add", f"10.214.{i}.2/24", "dev", peer)
            ip("netns", "exec", ns, "ip", "link", "set", peer, "up")
            ip("netns", "exec", ns, "ethtool", "-K", peer, "tso", "off")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, ifs
    finally:
        for name in ifs:
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def sysfs_tree(root: pathlib.Path, ifnames: list[str]) -> list[str]:
    """The fake tree (one GPU + one NIC per switch, NUMA nodes 0 and 1 with CPUs 0 and 1);
    returns the GPUs' bus ids."""
    spec = importlib.util.spec_from_file_location("sysfs_generate", REPO / "tests" / "fixtures" / "sysfs" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen.gpu_nic_pairs(root, ifnames)


def fake_uuid(bus: str) -> str:
    """The fake libcuda's UUID of the GPU at `bus` (a function of the bus id only)."""
    dom, b, rest = bus.split(":")
    dev, fn = rest.split(".")
    return f"GPU-5a77fa4e-{int(dom, 16):04x}-40{int(b, 16):02x}-80{int(dev, 16):02x}-{int(fn) << 4:02x}0000000000"


def source_in(sw, ns: str, d, secret, *extra) -> Source:
    args = ["ip", "netns", "exec", ns, sw.bin, "source", "--listen", "10.214.0.2:0", "--dataset", f"ds={d}",
            "--secret-file", secret, *extra]
    p = Source(sw._name("source"), [str(a) for a in args], sw.logs)
    sw.procs.append(p)
    p.addr = p.wait_line(SOURCE_READY).group(1)
    return p


def serve_lanes(sw, src, secret, tree, memory: str, env: dict, receive: str = "host") -> Serve:
    name = sw._name("serve")
    args = [sw.bin, "serve", "--socket", sw.tmp / f"{name}.sock", "--data-listen", "0.0.0.0:0", "--admin", "127.0.0.1:0",
            "--source", src.addr, "--secret-file", secret, "--sysfs-root", tree, "--memory", memory, "--receive", receive,
            "--nic-state-file", sw.tmp / f"{name}.nic-state.json",
            "--flows", "2", "--pool-size", "64MiB", "--stream-memory", str(STREAM_MEMORY)]
    p = Serve(name, [str(a) for a in args], sw.logs, env)
    sw.procs.append(p)
    m = p.wait_line(SERVE_READY)
    p.socket, p.admin = m.group(1), m.group(2)
    return p


def on_own_address(lane: dict) -> int:
    """The lane's data connections established on its own address (the node's end)."""
    host, port = lane["data_addr"].rsplit(":", 1)
    return established_on(host, int(port))


def lanes_connected(node) -> list[dict]:
    def ready():
        lanes = node.status()["lanes"]
        return lanes if all(on_own_address(l) == 2 for l in lanes) else None

    return wait_for(ready, "2 data connections established on every lane's address", diag=node.describe)


def recv_thread_cpus(pid: int) -> dict[int, set[str]]:
    """Lane -> the Cpus_allowed_list of its receiver threads (named sw-recv-LANE-SOURCE-CONN)."""
    out: dict[int, set[str]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = pathlib.Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = pathlib.Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        m = re.match(r"sw-recv-(\d+)-", comm)
        if m:
            cpus = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M).group(1)
            out.setdefault(int(m.group(1)), set()).add(cpus)
    return out


@pytest.fixture
def setup(sw, tmp_path, net):
    ns, ifs = net
    d = tmp_path / "ds"
    write_uint8_shards(d, SHARDS, SIZE, seed=33)
    index_dataset(d)
    secret = tmp_path / "secret"
    secret.write_text("lanes-secret\n")
    tree = tmp_path / "sys"
    gpus = sysfs_tree(tree, ifs)
    return ns, d, secret, tree, gpus


def nic_checks(node, wrong: int | None = None) -> list[dict]:
    """Waits until every identified data connection's NIC was checked (every lane is on its
    NIC's address), then asserts: lane `wrong`'s all came in on another NIC, every other
    lane's on its own, none unknown (every veth names itself)."""

    def checked():
        lanes = node.status()["lanes"]
        counts = [(l["data_connections_on_nic"], l["data_connections_wrong_nic"], l["data_connections_nic_unknown"]) for l in lanes]
        done = all(l["data_connections"] >= 2 and sum(c) == l["data_connections"] for l, c in zip(lanes, counts))
        return (lanes, counts) if done else None

    lanes, counts = wait_for(checked, "every lane's connections checked", diag=node.describe)
    want = [(0, l["data_connections"], 0) if l["lane"] == wrong else (l["data_connections"], 0, 0) for l in lanes]
    assert counts == want, lanes
    return lanes


def check_lanes(node, gpus: list[str], ifs: list[str], memory: str) -> list[dict]:
    """The four lanes as planned: GPU i with NIC i (PIX), on NIC i's address, each with its
    two data connections accepted there; receivers on their NIC's NUMA node's CPU."""
    lanes = lanes_connected(node)
    got = [(l["lane"], l["gpu"], l["nic"], l["distance"], l["data_addr"].rsplit(":", 1)[0], l["memory"]) for l in lanes]
    assert got == [(i, gpus[i], ifs[i], "PIX", node_ip(i), memory) for i in range(LANES)], lanes
    assert [l["numa_node"] for l in lanes] == [0, 0, 1, 1]
    assert [l["cpus"] for l in lanes] == ["0", "0", "1", "1"], lanes
    threads = recv_thread_cpus(node.pid)
    assert threads == {0: {"0"}, 1: {"0"}, 2: {"1"}, 3: {"1"}}, threads
    return lanes


def check_refusals(node, sw, src) -> None:
    """The misdialled connection was refused and counted on its lane; a GPU the node does not
    serve is refused naming the node's GPUs."""
    lanes = node.status()["lanes"]
    assert [l["data_connections_refused"] for l in lanes] == [1, 0, 0, 0], lanes
    assert "arrived on another address than its lane's" in node.stderr_text()
    assert "fault injection: dialling lane 0's data connection to lane 1" in src.stderr_text()
    r = subprocess.run([str(shardwire_bin()), "consume", "--socket", node.socket, "--dataset", "ds", "--device", "0000:99:00.0"],
                       capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode != 0 and "unknown_device" in r.stderr, r.stderr
    assert "its GPUs: 0000:12:00.0 (lane 0), 0000:22:00.0 (lane 1), 0000:92:00.0 (lane 2), 0000:a2:00.0 (lane 3)" in r.stderr, r.stderr


def test_four_gpu_lanes_on_four_veth_pairs_with_the_fake_libcuda(sw, setup, net):
    ns, d, secret, tree, gpus = setup
    ifs = net[1]
    expected = expected_crcs(d)
    alloc_log = sw.tmp / "alloc.log"
    env = {**fake_env(), "FAKE_CUDA_DEVICES": str(LANES), "FAKE_CUDA_PCI_BUS_IDS": ",".join(gpus),
           "FAKE_CUDA_ALLOC_LOG": str(alloc_log)}
    src = source_in(sw, ns, d, secret, "--fault-wrong-lane", "1")
    node = serve_lanes(sw, src, secret, tree, "cuda", env)
    wait_ready(node)
    check_lanes(node, gpus, ifs, "cuda")
    nic_checks(node)
    assert "came in on another NIC" not in node.stderr_text()
    assert "4 GPUs, one lane each" in node.status()["mode"]["reason"]

    # Four trainers, each on another GPU, each named another way.
    names = [gpus[0], fake_uuid(gpus[1]), "cuda:2", "ctx:3"]
    for i, how in enumerate(names):
        r = subprocess.run([sys.executable, __file__, "train", node.socket, how], capture_output=True, text=True,
                           timeout=180, env={**os.environ, **env})
        assert r.returncode == 0, f"trainer {how} failed:\n{r.stdout}\n{r.stderr}\n{node.describe()}"
        out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        info, batches = out[0], out[1:]
        assert (info["memory"], info["gpu"], info["sent"]) == ("cuda", gpus[i], gpus[i] if i != 1 else fake_uuid(gpus[1])), (how, info)
        assert_exactly_once(batches, SHARDS)
        for b in batches:
            assert b["tensors"] == [{"name": t["name"], "crc32c": t["crc32c"]} for t in expected[b["shard"]]], b["shard"]
        assert fake_lines(r.stderr) == [], r.stderr
        log = alloc_log.read_text()
        # The node made exactly one stream region, on the trainer's GPU; the trainer imported it there.
        regions = [line for line in log.splitlines() if line.startswith(f"cuMemCreate pid={node.pid} ") and line.endswith(f"size={STREAM_MEMORY}")]
        assert len(regions) == i + 1 and f"dev={i} pci={gpus[i].upper()} " in regions[-1], log
        assert f"cuMemImport pid={info['pid']} dev={i} pci={gpus[i].upper()} size={STREAM_MEMORY}" in log, log
        lane = node.status()["lanes"][i]
        assert lane["bytes_received"] >= SHARDS * SIZE, lane

    check_refusals(node, sw, src)
    assert fake_lines(node.stderr_text()) == [], node.stderr_text()


def numa_nodes() -> set[int]:
    return {int(n[4:]) for n in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", n)}


def test_four_host_lanes_place_streams_by_gpu_and_memory_by_numa_node(sw, setup, net):
    ns, d, secret, tree, gpus = setup
    ifs = net[1]
    expected = expected_crcs(d)
    # The source reaches lane 3's address through lane 2's veth (on-link, with lane 2's veth's
    # MAC for it: whatever the host's arp_ignore).
    via = f"sp{ifs[2][2:-1]}2"
    mac = pathlib.Path(f"/sys/class/net/{ifs[2]}/address").read_text().strip()
    ip("netns", "exec", ns, "ip", "route", "add", f"{node_ip(3)}/32", "dev", via)
    ip("netns", "exec", ns, "ip", "neigh", "replace", node_ip(3), "lladdr", mac, "dev", via, "nud", "permanent")
    src = source_in(sw, ns, d, secret, "--fault-wrong-lane", "1")
    node = serve_lanes(sw, src, secret, tree, "host", {})
    wait_ready(node)
    lanes = check_lanes(node, gpus, ifs, "host")
    nic_checks(node, wrong=3)
    assert metric(node.admin, 'shardwire_lane_data_connections_wrong_nic_total{lane="3"}') >= 2
    assert metric(node.admin, 'shardwire_lane_data_connections_wrong_nic_total{lane="2"}') == 0
    warned = [line for line in node.stderr_text().splitlines() if "came in on another NIC" in line]
    assert warned and all("lane=3" in line and f"nic={ifs[3]}" in line and f"arrived_on={ifs[2]}" in line for line in warned), warned
    have = numa_nodes()
    for l in lanes:
        placed = l["numa_node"] in have
        assert any("not placed on NUMA node" in n for n in l["notes"]) != placed, (have, l)
    for i, gpu in enumerate(gpus):
        held = sw.start_consume(node, "ds", device=gpu, limit=1, hold_secs=30)
        wait_for(lambda: [s["lane"] for s in node.status()["streams"]] == [i], f"the stream on lane {i}", diag=node.describe)
        stream = node.status()["streams"][0]["id"]
        maps = pathlib.Path(f"/proc/{node.pid}/numa_maps").read_text()
        region = [line for line in maps.splitlines() if f"shardwire-stream-{stream}" in line]
        assert region, maps
        if lanes[i]["numa_node"] in have:
            assert f"prefer:{lanes[i]['numa_node']}" in region[0], region
        held.kill()
        wait_for(lambda: not node.status()["streams"], "the stream to close", diag=node.describe)
        batches = sw.consume(node, "ds", device=gpu, seed=i)
        assert_exactly_once(batches, SHARDS)
        assert_byte_exact(batches, expected)
        assert node.status()["lanes"][i]["bytes_received"] >= SHARDS * SIZE
    check_refusals(node, sw, src)


# --- the trainer child (run with the fake libcuda on its loader path) -----------------------------


def _train(socket: str, how: str) -> None:
    """One epoch on the GPU `how` names (a bus id, a UUID, "cuda:N", or "ctx:N": device N's
    primary context made current and the default device="auto"); prints {memory, gpu, sent,
    pid}, then per batch {shard, tensors: [{name, crc32c}]} read at the device pointers."""
    import ctypes

    sys.path.insert(0, str(REPO / "client" / "python" / "src"))
    import shardwire
    from shardwire import _client

    sent: list[str] = []
    opts, retained = {}, None
    if how.startswith("ctx:"):
        from cuda.bindings import driver

        driver.cuInit(0)
        _, retained = driver.cuDeviceGet(int(how[4:]))
        _, ctx = driver.cuDevicePrimaryCtxRetain(retained)
        driver.cuCtxSetCurrent(ctx)
    else:
        opts["device"] = how
    orig_send = _client._wire.Conn.send

    def send(self, *msgs):
        for m in msgs:
            if isinstance(m, dict) and m.get("op") == "attach":
                sent.append(m.get("device"))
        return orig_send(self, *msgs)

    _client._wire.Conn.send = send
    client = shardwire.connect(socket)
    with client.open_stream("ds", seed=5, **opts) as stream:
        region = stream.region
        print(json.dumps({"memory": stream.info.memory, "gpu": stream.info.gpu["pci_bus_id"], "sent": sent[0], "pid": os.getpid()}), flush=True)
        while (batch := stream.next(60)) is not None:
            tensors = []
            for name, t in batch.items():
                ptr = t.__cuda_array_interface__["data"][0]
                assert region.ptr <= ptr and ptr + t.nbytes <= region.ptr + region.size
                tensors.append({"name": name, "crc32c": crc32c(ctypes.string_at(ptr, t.nbytes))})
            print(json.dumps({"shard": batch.shard, "tensors": tensors}), flush=True)
            del t
            batch.release()
    region.close()
    if retained is not None:
        driver.cuCtxSetCurrent(None)
        driver.cuDevicePrimaryCtxRelease(retained)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "train":
    _train(sys.argv[2], sys.argv[3])


def test_devmem_on_lanes_whose_nics_cannot_is_refused_naming_each_nic(sw, setup, net):
    """The real kernel's answer per NIC: veths have no queue management ops, so no lane can bind
    devmem. `receive = host` says so per NIC in the mode's reason; `receive = devmem` refuses to
    start, naming every lane's NIC and the kernel's reason; nothing is left changed on them."""
    ns, d, secret, tree, gpus = setup
    ifs = net[1]
    src = source_in(sw, ns, d, secret)
    node = serve_lanes(sw, src, secret, tree, "host", {})
    st = wait_ready(node)
    for name in ifs:
        assert f"{name}: EOPNOTSUPP" in st["mode"]["reason"], st["mode"]["reason"]
    node.stop()
    r = subprocess.run([str(shardwire_bin()), "serve", "--socket", str(sw.tmp / "devmem.sock"), "--data-listen",
                        "0.0.0.0:0", "--admin", "127.0.0.1:0", "--source", src.addr, "--secret-file", str(secret),
                        "--sysfs-root", str(tree), "--memory", "host", "--receive", "devmem",
                        "--nic-state-file", str(sw.tmp / "nic-state.json")],
                       capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode != 0, r.stdout
    assert "receive=devmem is not possible here" in r.stderr, r.stderr
    for name in ifs:
        assert f"{name}: EOPNOTSUPP" in r.stderr, r.stderr
    assert not (sw.tmp / "nic-state.json").exists(), "nothing was changed on any NIC, so nothing to restore"
    assert not list(sw.tmp.glob("nic-state.*.json")), "no NIC's journal either"
    # receive=auto: plain TCP on every lane (never a mix), each lane and its NIC named.
    node = serve_lanes(sw, src, secret, tree, "host", {}, receive="auto")
    reason = wait_ready(node)["mode"]["reason"]
    assert "receive=auto chose host (plain TCP) on every lane" in reason, reason
    for lane, name in enumerate(ifs):
        assert f"lane {lane} ({name}: EOPNOTSUPP" in reason, reason
    assert not list(sw.tmp.glob("*nic-state*.json")), "nothing journaled"
