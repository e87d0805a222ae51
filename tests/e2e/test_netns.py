"""Two hosts on one machine: a shard source in its own network namespace, joined to the node
by a veth pair. Checks what loopback cannot: a source without a secret refuses a non-loopback
node, a shared secret admits it, and the node's wildcard data port is advertised with the
address the source can reach (its local address of the control connection)."""

import os
import pathlib
import shutil
import subprocess
import uuid

import pytest

from conftest import (
    IO_URING_NOTE,
    SERVE_READY,
    SOURCE_READY,
    Serve,
    Source,
    assert_byte_exact,
    assert_exactly_once,
    expected_crcs,
    index_dataset,
    remove_leftovers,
    wait_for,
    wait_ready,
    write_uint8_shards,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to create a network namespace and a veth pair",
)

NODE_IP, SOURCE_IP = "10.213.77.1", "10.213.77.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns():
    """A namespace `ns` with one end of a veth pair at SOURCE_IP; the other end, in the root
    namespace, at NODE_IP. Removed afterwards (deleting the namespace deletes the pair)."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"swsrc-{tag}", f"swn{tag}", f"sws{tag}"
    ip("netns", "add", ns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{NODE_IP}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{SOURCE_IP}/30", "dev", ns_if)
        ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def source_in(sw, ns: str, datasets: dict, *extra) -> Source:
    args = ["ip", "netns", "exec", ns, sw.bin, "source", "--listen", f"{SOURCE_IP}:0"]
    for name, d in datasets.items():
        args += ["--dataset", f"{name}={d}"]
    p = Source(sw._name("source"), args + [str(a) for a in extra], sw.logs)
    sw.procs.append(p)
    p.addr = p.wait_line(SOURCE_READY).group(1)
    return p


def serve_wildcard(sw, src: Source, *extra) -> Serve:
    """`serve` with a wildcard data port (the harness's `serve` pins it to loopback)."""
    name = sw._name("serve")
    args = [sw.bin, "serve", "--socket", sw.tmp / f"{name}.sock", "--data-listen", "0.0.0.0:0",
            "--admin", "127.0.0.1:0", "--source", src.addr, *[str(a) for a in extra]]
    p = Serve(name, args, sw.logs)
    sw.procs.append(p)
    m = p.wait_line(SERVE_READY)
    p.socket, p.admin = m.group(1), m.group(2)
    return p


def test_non_loopback_needs_a_secret_and_data_crosses_the_veth(sw, tmp_path, netns):
    d = tmp_path / "ds"
    write_uint8_shards(d, 9, 512 * 1024, seed=5)
    index_dataset(d)
    expected = expected_crcs(d)

    # Without a secret the source refuses a peer that is not on loopback.
    open_src = source_in(sw, netns, {"v": d})
    node = serve_wildcard(sw, open_src)
    wait_for(lambda: "not on loopback" in open_src.stderr_text() or None, "the source to refuse the node",
             diag=open_src.stderr_text)
    src_status = node.status()["sources"][0]
    assert src_status["up"] is False, src_status
    open_src.stop()
    node.stop()

    # With the same secret on both sides the node is admitted and data crosses the veth.
    secret = tmp_path / "secret"
    secret.write_text("veth-secret\n")
    src = source_in(sw, netns, {"v": d}, "--secret-file", secret)
    node = serve_wildcard(sw, src, "--secret-file", secret, "--flows", "3")
    wait_ready(node)
    batches = sw.consume(node, "v", seed=3)
    assert_exactly_once(batches, 9)
    assert_byte_exact(batches, expected)
    st = node.status()
    assert st["sources"][0]["bytes_received"] == 9 * 512 * 1024, st["sources"]
    # The wildcard data port was advertised as NODE_IP (what the source could reach).
    assert f"lanes={NODE_IP}:" in node.stderr_text(), node.stderr_text()[-2000:]


def test_a_killed_runs_leftovers_are_removed():
    """What a run killed before its clean-up leaves (a namespace and veth of the fixture above,
    an impairment's NFQUEUE rule, the io_uring sysctl note) is removed by the next run's first
    step, and nothing else."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"swsrc-{tag}", f"swn{tag}", f"sws{tag}"
    ip("netns", "add", ns)
    ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
    # Matches nothing this suite sends (an address no test uses).
    rule = ["INPUT", "-p", "tcp", "-s", "10.213.99.99", "-m", "mark", "!", "--mark", "0x1e5eed",
            "-j", "NFQUEUE", "--queue-num", "777"]
    if shutil.which("iptables"):
        subprocess.run(["iptables", "-w", "5", "-I", *rule], check=True, capture_output=True, timeout=30)
    sysctl = pathlib.Path("/proc/sys/kernel/io_uring_disabled")
    IO_URING_NOTE.write_text(sysctl.read_text())  # the value now: restoring it changes nothing
    done = remove_leftovers()
    assert f"namespace {ns}" in done and not IO_URING_NOTE.exists(), done
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    assert host_if not in links, links
    if shutil.which("iptables"):
        rules = subprocess.run(["iptables", "-w", "5", "-S"], capture_output=True, text=True, timeout=30).stdout
        assert "10.213.99.99" not in rules, rules
