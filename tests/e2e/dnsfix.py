"""Name resolution under the test's control, for nodes that find sources by DNS (`dns:NAME:PORT`).

Debian's `dnsmasq` answers from a hosts file on a loopback address of its own (127.0.53.X, port
53); :meth:`Dns.set` rewrites the file and sends SIGHUP, then asks the server until it gives the
new answer. A node started through :meth:`Dns.wrap` runs in a mount namespace of its own in
which `/etc/resolv.conf` names only that server, so it resolves through the real system resolver
(getaddrinfo, as in a Kubernetes pod) and nothing else on the machine is affected. Why a real
server and not a resolver hook in the node: the product's resolution path (glibc, resolv.conf,
TTL 0, a changing answer) is what is tested, with no test-only code in the node.

`dnsmasq` is installed by scripts/test's setup phase (package `dnsmasq-base`); where it is
missing the fixture skips with that reason.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import socket
import struct
import subprocess
import time

import pytest

from pdeathsig import die_with_parent

NAME = "sources.shardwire.test"


def query_a(server: str, name: str, timeout: float = 1.0) -> list[str]:
    """The A records `server` (port 53) gives for `name` (a minimal RFC 1035 query)."""
    qid = random.randrange(1 << 16)
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(q, (server, 53))
        data, _ = s.recvfrom(4096)
    rid, _flags, _qd, an, _ns, _ar = struct.unpack(">HHHHHH", data[:12])
    assert rid == qid, (rid, qid)
    at = len(q)  # the question is echoed back
    out = []
    for _ in range(an):
        at += 2 if data[at] & 0xC0 == 0xC0 else data.index(b"\0", at) + 1 - at
        rtype, _cls, _ttl, rdlen = struct.unpack(">HHIH", data[at:at + 10])
        at += 10
        if rtype == 1 and rdlen == 4:
            out.append(socket.inet_ntoa(data[at:at + 4]))
        at += rdlen
    return sorted(out)


class Dns:
    """A dnsmasq on 127.0.53.X answering for :data:`NAME` from a hosts file."""

    def __init__(self, tmp: pathlib.Path):
        self.addr = f"127.0.53.{random.randrange(2, 250)}"
        self.hosts = tmp / "dns.hosts"
        self.hosts.write_text("")
        self.resolv = tmp / "resolv.conf"
        self.resolv.write_text(f"nameserver {self.addr}\noptions timeout:1 attempts:2\n")
        self.log = open(tmp / "dnsmasq.log", "wb")
        # `--group=root` too: its default group (dip) would change its gid, which clears the
        # parent-death signal (die_with_parent).
        self.proc = subprocess.Popen(
            ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             f"--addn-hosts={self.hosts}", f"--listen-address={self.addr}", "--bind-interfaces",
             "--port=53", "--local-ttl=0", "--no-negcache", "--user=root", "--group=root", "--pid-file=",
             "--log-facility=-"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, preexec_fn=die_with_parent,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    query_a(self.addr, NAME, timeout=0.2)
                    break
                except OSError:
                    assert self.proc.poll() is None, f"dnsmasq exited: {(tmp / 'dnsmasq.log').read_text()}"
                    assert time.monotonic() < deadline, f"dnsmasq did not answer within 10 s: {(tmp / 'dnsmasq.log').read_text()}"
                    time.sleep(0.05)
        except BaseException:
            self.close()  # the fixture never gets it: stop dnsmasq here
            raise

    def set(self, ips: list[str], name: str = NAME) -> None:
        """Makes `name` resolve to `ips` (SIGHUP re-reads the file) and waits for the answer."""
        self.hosts.write_text("".join(f"{ip} {name}\n" for ip in ips))
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while query_a(self.addr, name) != sorted(ips):
            assert time.monotonic() < deadline, f"dnsmasq did not answer {ips} within 10 s"
            time.sleep(0.02)

    def wrap(self, argv: list) -> list:
        """`argv` run in a mount namespace whose /etc/resolv.conf names this server only."""
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(self.resolv), *argv]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def dns(tmp_path):
    """A :class:`Dns`; skips (with the reason) where dnsmasq or unshare is missing."""
    for tool in ("dnsmasq", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (scripts/test installs dnsmasq-base and util-linux)")
    if os.geteuid() != 0:
        pytest.skip("needs root: the node's mount namespace binds its own /etc/resolv.conf")
    d = Dns(tmp_path)
    yield d
    d.close()
