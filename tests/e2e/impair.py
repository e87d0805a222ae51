"""Link impairment for end-to-end fault tests: drop, delay, jitter (reordering) and
duplication of matching IPv4 packets, without the netem qdisc (this kernel has none).

How it works: an iptables rule ``-j NFQUEUE --queue-num N`` in the chosen network namespace
sends matching packets to a verdict loop that speaks the nfnetlink_queue protocol directly
over an AF_NETLINK/NETLINK_NETFILTER socket (stdlib ``socket`` + ``struct``, no
libnetfilter_queue). Per packet the loop draws: drop (verdict NF_DROP now), or a delay
(``delay_ms`` +- ``jitter_ms``, uniform, clamped at 0) after which it issues NF_ACCEPT from a
timer heap. The kernel allows verdicts in any order, so packets with different delays leave
out of order: jitter reorders. A duplicated packet is accepted and a copy of it is sent again
through a raw socket with a firewall mark that the rule excludes (so the copy is not queued
again).

The loop runs in a child process (``ip netns exec NS python3 impair.py ...`` or, for the root
namespace, ``python3 impair.py ...``), so the netlink socket and the rule live in that
namespace and the loop does not compete with the test for the GIL. The child speaks JSON lines
on stdout (``ready``, ``stats``, ``final``, ``error``) and reads commands on stdin
(``stats``, ``stop``; EOF = stop, so it stops if the test process dies).

Usage from a test::

    from impair import Impairment

    # impair what namespace ns-b receives from 10.213.88.1 (TCP)
    with Impairment("ns-b", ["-p", "tcp", "-s", "10.213.88.1"], chain="INPUT",
                    drop=0.02, delay_ms=3, jitter_ms=3, duplicate=0.01, seed=1) as imp:
        ...                         # run the traffic
        live = imp.stats()          # counters so far
    print(imp.final)                # counters at stop (also returned by imp.stop())

Where to put the rule: prefer the receiving side (``chain="INPUT"`` in the namespace that
receives, ``netns=None`` for the root namespace) or a router namespace's ``FORWARD``. On the
sender's ``OUTPUT`` chain a held packet is still charged to the sending socket, so TCP Small
Queues throttles the sender to a few packets in flight and a 20 ms delay cuts throughput far
more than a real link would (a few ms is fine). To impair both directions, use two instances
(one per direction; queue numbers are per namespace, free ones are picked).

Counters: ``seen`` (packets queued to the loop), ``accepted``, ``dropped``, ``delayed``
(verdict deferred by > 0 ms), ``reordered`` (accepted after a packet that arrived later had
already been accepted), ``duplicated``, ``overflow`` (accepted at once because ``max_held``
packets were already held), ``flushed`` (held packets accepted at stop), ``enobufs`` (netlink
receive buffer overruns: the kernel dropped queue messages), ``nl_errors``, ``held``,
``max_held_seen``, ``max_late_ms`` (worst timer lateness), and ``kernel_queue_dropped`` /
``kernel_user_dropped`` from /proc/net/netfilter/nfnetlink_queue (packets the kernel dropped
because the queue was full / could not be delivered to the socket).

Fail-closed by design: the rule has no ``--queue-bypass``, so if the loop dies while the rule
is installed, matching packets are dropped rather than passed unimpaired. A test then stalls
and fails visibly instead of "passing" through a link that silently stopped impairing. The
child removes its rule on every exit path it controls (stop, EOF, SIGTERM, exceptions); if
it was killed (SIGKILL), :meth:`Impairment.stop` removes the rule itself and raises
:class:`ImpairmentError`. Held packets are accepted (not dropped) at stop, and at most
``max_held`` packets are held (beyond that they are accepted at once), so the link never
wedges. Only IPv4 (``iptables``); duplication sends IPv4 copies only.
"""

from __future__ import annotations

import argparse
import errno
import heapq
import json
import os
import queue
import random
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Sequence

from pdeathsig import die_with_parent

__all__ = ["Impairment", "ImpairmentError", "iptables_available"]

# --- netlink / nfnetlink_queue constants (linux/netlink.h, linux/netfilter/nfnetlink*.h) ---

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
SO_MARK = 36

NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4

NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2

NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3

NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_CFG_CMD_PF_BIND = 3
NFQNL_CFG_CMD_PF_UNBIND = 4

NFQNL_COPY_META = 1
NFQNL_COPY_PACKET = 2

NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_PAYLOAD = 10

NF_DROP = 0
NF_ACCEPT = 1

NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED / NLA_F_NET_BYTEORDER

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (res_id in network order)
NLATTR = struct.Struct("=HH")

DEFAULT_MARK = 0x1E5EED
PROC_QUEUES = "/proc/net/netfilter/nfnetlink_queue"


class ImpairmentError(RuntimeError):
    """The impairment loop could not start, failed, or died."""


def iptables_available(iptables: str = "iptables") -> bool:
    """True if the iptables binary is on PATH (tests skip otherwise)."""
    return shutil.which(iptables) is not None


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def _attr(atype: int, payload: bytes) -> bytes:
    a = NLATTR.pack(NLATTR.size + len(payload), atype) + payload
    return a + b"\0" * (_pad4(len(a)) - len(a))


def _nfq_msg(msg: int, queue_num: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = NFGENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(queue_num)) + attrs
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def rule_spec(chain: str, match: Sequence[str], queue_num: int, mark: int) -> list[str]:
    """The iptables rule (after -I/-D) that the loop installs."""
    return [chain, *match, "-m", "mark", "!", "--mark", hex(mark), "-j", "NFQUEUE", "--queue-num", str(queue_num)]


def run_iptables(iptables: str, table: str, op: str, spec: list[str], netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = [iptables, "-w", "5", "-t", table, op, *spec]
    if op == "-I":
        cmd = [iptables, "-w", "5", "-t", table, "-I", spec[0], "1", *spec[1:]]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


# --- the verdict loop (runs in the child process) --------------------------------------------


class _Stop(Exception):
    pass


class VerdictLoop:
    """The nfnetlink_queue verdict loop. Runs in the target namespace (the child process)."""

    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.rng = random.Random(args.seed)
        self.drop_p: float = args.drop
        self.delay_s: float = args.delay_ms / 1000.0
        self.jitter_s: float = args.jitter_ms / 1000.0
        self.dup_p: float = args.duplicate
        self.max_held: int = args.max_held
        self.copy_packet = self.dup_p > 0
        self.sock: socket.socket | None = None
        self.raw: socket.socket | None = None
        self.queue_num: int | None = None
        self.spec: list[str] | None = None
        self.rule_installed = False
        self.seq = 0
        self.arrivals = 0
        self.max_released = -1
        # heap of (deadline, arrival, packet id, copy payload or None)
        self.heap: list[tuple[float, int, int, bytes | None]] = []
        self.started = time.monotonic()
        self.c: dict[str, Any] = dict(
            seen=0, accepted=0, dropped=0, delayed=0, reordered=0, duplicated=0, dup_errors=0,
            overflow=0, flushed=0, enobufs=0, nl_errors=0, held=0, max_held_seen=0, max_late_ms=0.0,
        )
        self.first_nl_error: str | None = None
        self.buf = bytearray(1 << 18)
        # NETLINK_NO_ENOBUFS is deliberately not set: an overrun must show up (as ENOBUFS,
        # counted) since the kernel drops the queue messages it could not deliver.
        self.stopping = False
        self.out = sys.stdout

    # --- output ---

    def emit(self, event: str, **kw: Any) -> None:
        self.out.write(json.dumps({"event": event, **kw}) + "\n")
        self.out.flush()

    def counters(self) -> dict[str, Any]:
        c = dict(self.c)
        c["held"] = len(self.heap)
        c["max_late_ms"] = round(c["max_late_ms"], 3)
        c["elapsed_s"] = round(time.monotonic() - self.started, 3)
        c["queue_num"] = self.queue_num
        c.update(self.kernel_counters())
        return c

    def kernel_counters(self) -> dict[str, int]:
        """queue_dropped / user_dropped of our queue from /proc/net/netfilter/nfnetlink_queue."""
        try:
            with open(PROC_QUEUES) as f:
                for line in f:
                    p = line.split()
                    if len(p) >= 7 and int(p[0]) == self.queue_num:
                        return {"kernel_queue_total": int(p[2]), "kernel_queue_dropped": int(p[5]), "kernel_user_dropped": int(p[6])}
        except (OSError, ValueError):
            pass
        return {}

    # --- netlink ---

    def _config(self, queue_num: int, attrs: bytes) -> None:
        """Sends one NFQNL_MSG_CONFIG with NLM_F_ACK and raises OSError on a netlink error."""
        assert self.sock is not None
        self.seq += 1
        self.sock.send(_nfq_msg(NFQNL_MSG_CONFIG, queue_num, attrs, NLM_F_REQUEST | NLM_F_ACK, self.seq))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                n = self.sock.recv_into(self.buf)
            except socket.timeout:
                break
            finally:
                self.sock.settimeout(None)
            off = 0
            while off + NLMSGHDR.size <= n:
                ln, typ, _fl, seq, _pid = NLMSGHDR.unpack_from(self.buf, off)
                if ln < NLMSGHDR.size:
                    break
                if typ == NLMSG_ERROR and seq == self.seq:
                    (err,) = struct.unpack_from("=i", self.buf, off + NLMSGHDR.size)
                    if err != 0:
                        raise OSError(-err, f"nfnetlink_queue config failed: {os.strerror(-err)}")
                    return
                off += _pad4(ln)
        raise OSError(errno.ETIMEDOUT, "no netlink ACK for nfnetlink_queue config")

    def _cmd(self, queue_num: int, cmd: int, pf: int = socket.AF_INET) -> None:
        self._config(queue_num, _attr(NFQA_CFG_CMD, struct.pack("!BxH", cmd, pf)))

    def open(self) -> None:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock = s
        s.bind((0, 0))
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        # PF_UNBIND/PF_BIND are no-ops since Linux 3.8; sent for old kernels, errors ignored.
        for cmd in (NFQNL_CFG_CMD_PF_UNBIND, NFQNL_CFG_CMD_PF_BIND):
            try:
                self._cmd(0, cmd)
            except OSError:
                pass
        candidates = [self.a.queue] if self.a.queue is not None else [random.randrange(1024, 65535) for _ in range(32)]
        last: OSError | None = None
        for q in candidates:
            try:
                self._cmd(q, NFQNL_CFG_CMD_BIND)
            except OSError as e:  # EPERM/EBUSY: the queue number is bound by another socket
                last = e
                continue
            self.queue_num = q
            break
        if self.queue_num is None:
            raise ImpairmentError(f"could not bind an nfnetlink queue ({candidates[:3]}...): {last}")
        mode, rng_ = (NFQNL_COPY_PACKET, 0xFFFF) if self.copy_packet else (NFQNL_COPY_META, 0)
        self._config(self.queue_num, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", rng_, mode)))
        self._config(self.queue_num, _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", self.a.maxlen)))
        if self.copy_packet:
            self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
            self.raw.setsockopt(socket.SOL_SOCKET, SO_MARK, self.a.mark)
        s.setblocking(False)

    def verdict(self, pid: int, v: int) -> None:
        assert self.sock is not None
        attrs = NLATTR.pack(12, NFQA_VERDICT_HDR) + struct.pack("!II", v, pid)
        msg = _nfq_msg(NFQNL_MSG_VERDICT, self.queue_num or 0, attrs)
        while True:
            try:
                self.sock.send(msg)
                return
            except BlockingIOError:
                time.sleep(0.0005)
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.c["enobufs"] += 1
                    time.sleep(0.0005)
                    continue
                raise

    def accept(self, arrival: int, pid: int, copy: bytes | None) -> None:
        self.verdict(pid, NF_ACCEPT)
        self.c["accepted"] += 1
        if arrival < self.max_released:
            self.c["reordered"] += 1
        else:
            self.max_released = arrival
        if copy is not None:
            self.send_copy(copy)

    def send_copy(self, pkt: bytes) -> None:
        if self.raw is None or len(pkt) < 20 or pkt[0] >> 4 != 4:
            self.c["dup_errors"] += 1
            return
        try:
            self.raw.sendto(pkt, (socket.inet_ntoa(pkt[16:20]), 0))
            self.c["duplicated"] += 1
        except OSError:
            self.c["dup_errors"] += 1

    def on_packet(self, pid: int, payload: bytes | None) -> None:
        self.c["seen"] += 1
        arrival = self.arrivals
        self.arrivals += 1
        if self.stopping:
            self.accept(arrival, pid, None)
            return
        r = self.rng
        if self.drop_p > 0 and r.random() < self.drop_p:
            self.verdict(pid, NF_DROP)
            self.c["dropped"] += 1
            return
        copy = payload if (self.dup_p > 0 and payload is not None and r.random() < self.dup_p) else None
        d = self.delay_s
        if self.jitter_s > 0:
            d += r.uniform(-self.jitter_s, self.jitter_s)
        if d <= 0:
            self.accept(arrival, pid, copy)
            return
        if len(self.heap) >= self.max_held:
            self.c["overflow"] += 1
            self.accept(arrival, pid, copy)
            return
        heapq.heappush(self.heap, (time.monotonic() + d, arrival, pid, copy))
        self.c["delayed"] += 1
        if len(self.heap) > self.c["max_held_seen"]:
            self.c["max_held_seen"] = len(self.heap)

    def parse(self, n: int) -> None:
        buf = self.buf
        off = 0
        while off + NLMSGHDR.size <= n:
            ln, typ, _fl, _seq, _pid = NLMSGHDR.unpack_from(buf, off)
            if ln < NLMSGHDR.size or off + ln > n:
                break
            if typ == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                pid: int | None = None
                payload: bytes | None = None
                a = off + NLMSGHDR.size + NFGENMSG.size
                end = off + ln
                while a + NLATTR.size <= end:
                    alen, atype = NLATTR.unpack_from(buf, a)
                    if alen < NLATTR.size:
                        break
                    atype &= NLA_TYPE_MASK
                    if atype == NFQA_PACKET_HDR:
                        (pid,) = struct.unpack_from("!I", buf, a + NLATTR.size)
                    elif atype == NFQA_PAYLOAD:
                        payload = bytes(buf[a + NLATTR.size:a + alen])
                    a += _pad4(alen)
                if pid is not None:
                    self.on_packet(pid, payload)
            elif typ == NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", buf, off + NLMSGHDR.size)
                if err != 0:
                    self.c["nl_errors"] += 1
                    if self.first_nl_error is None:
                        self.first_nl_error = os.strerror(-err)
                        print(f"impair: netlink error: {self.first_nl_error}", file=sys.stderr, flush=True)
            off += _pad4(ln)

    def drain(self, limit: int = 512) -> int:
        """Reads up to `limit` queued packets without blocking; returns how many reads."""
        assert self.sock is not None
        k = 0
        while k < limit:
            try:
                n = self.sock.recv_into(self.buf, len(self.buf), socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # receive buffer overran: messages were lost
                    self.c["enobufs"] += 1
                    continue
                raise
            self.parse(n)
            k += 1
        return k

    def release_due(self) -> None:
        now = time.monotonic()
        h = self.heap
        while h and h[0][0] <= now:
            deadline, arrival, pid, copy = heapq.heappop(h)
            late = (now - deadline) * 1000.0
            if late > self.c["max_late_ms"]:
                self.c["max_late_ms"] = late
            self.accept(arrival, pid, copy)

    # --- lifecycle ---

    def install_rule(self) -> None:
        assert self.queue_num is not None
        self.spec = rule_spec(self.a.chain, json.loads(self.a.match_json), self.queue_num, self.a.mark)
        r = run_iptables(self.a.iptables, self.a.table, "-I", self.spec)
        if r.returncode != 0:
            raise ImpairmentError(f"iptables -I {' '.join(self.spec)} failed ({r.returncode}): {r.stderr.strip()}")
        self.rule_installed = True

    def remove_rule(self) -> None:
        if self.rule_installed and self.spec is not None:
            r = run_iptables(self.a.iptables, self.a.table, "-D", self.spec)
            if r.returncode != 0:
                print(f"impair: iptables -D {' '.join(self.spec)} failed: {r.stderr.strip()}", file=sys.stderr, flush=True)
            else:
                self.rule_installed = False

    def shutdown(self) -> None:
        """Removes the rule, accepts everything held or still queued, unbinds, closes."""
        self.stopping = True
        try:
            self.remove_rule()
        finally:
            if self.sock is not None:
                try:
                    while self.heap:
                        _d, arrival, pid, copy = heapq.heappop(self.heap)
                        self.c["flushed"] += 1
                        self.accept(arrival, pid, copy)
                    # Packets queued before the rule went away: accept them (stopping=True).
                    quiet_until = time.monotonic() + 0.05
                    while time.monotonic() < quiet_until:
                        if self.drain():
                            quiet_until = time.monotonic() + 0.05
                        else:
                            time.sleep(0.005)
                    self.sock.setblocking(True)
                    if self.queue_num is not None:
                        try:
                            self._cmd(self.queue_num, NFQNL_CFG_CMD_UNBIND)
                        except OSError:
                            pass
                finally:
                    self.sock.close()
            if self.raw is not None:
                self.raw.close()

    def run(self) -> int:
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the wakeup fd tells the loop
        sel = selectors.DefaultSelector()
        stdin_buf = b""
        try:
            self.open()
            self.install_rule()
            assert self.sock is not None
            sel.register(self.sock, selectors.EVENT_READ, "nl")
            sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
            sel.register(rfd, selectors.EVENT_READ, "signal")
            self.emit("ready", queue_num=self.queue_num, rule=self.spec, table=self.a.table)
            while True:
                self.release_due()
                timeout = max(0.0, self.heap[0][0] - time.monotonic()) if self.heap else 1.0
                for key, _ in sel.select(timeout):
                    if key.data == "nl":
                        self.drain()
                        self.release_due()
                    elif key.data == "signal":
                        raise _Stop()
                    else:
                        chunk = os.read(key.fd, 4096)
                        if not chunk:
                            raise _Stop()
                        stdin_buf += chunk
                        while b"\n" in stdin_buf:
                            line, stdin_buf = stdin_buf.split(b"\n", 1)
                            cmd = line.strip().decode()
                            if cmd == "stats":
                                self.emit("stats", **self.counters())
                            elif cmd == "stop":
                                raise _Stop()
                            elif cmd:
                                print(f"impair: unknown command {cmd!r}", file=sys.stderr, flush=True)
        except _Stop:
            self.shutdown()
            self.emit("final", **self.counters())
            return 0
        except BaseException as e:
            try:
                self.shutdown()
            finally:
                self.emit("error", error=f"{type(e).__name__}: {e}", **self.counters())
            if not isinstance(e, (ImpairmentError, OSError)):
                raise
            return 1
        finally:
            sel.close()


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="nfnetlink_queue impairment loop (run by impair.Impairment)")
    p.add_argument("--match-json", required=True, help='iptables match as a JSON list, e.g. ["-p","tcp"]')
    p.add_argument("--chain", default="OUTPUT")
    p.add_argument("--table", default="filter")
    p.add_argument("--queue", type=int, default=None)
    p.add_argument("--drop", type=float, default=0.0)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--duplicate", type=float, default=0.0)
    p.add_argument("--max-held", type=int, default=4096)
    p.add_argument("--maxlen", type=int, default=16384)
    p.add_argument("--mark", type=lambda s: int(s, 0), default=DEFAULT_MARK)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--iptables", default="iptables")
    return VerdictLoop(p.parse_args(argv)).run()


# --- the test-side handle ----------------------------------------------------------------------


class Impairment:
    """Impairs packets matching `match` in namespace `netns` (None: the root namespace).

    `match` is a list of iptables match arguments (e.g. ``["-p", "tcp", "-s", "10.213.88.1"]``)
    for `chain` (``INPUT``: packets this namespace receives, preferred; ``OUTPUT``: packets it
    sends, see the module docstring on TCP Small Queues).
    `drop`, `duplicate`: probabilities per packet. `delay_ms` +- `jitter_ms`: uniform delay,
    clamped at 0 (jitter > 0 reorders). `max_held`: packets held at most (more are accepted
    at once). `seed`: for a reproducible sequence of draws. `queue_num`: None picks a free one.
    """

    def __init__(
        self,
        netns: str | None,
        match: Sequence[str],
        *,
        chain: str = "OUTPUT",
        table: str = "filter",
        drop: float = 0.0,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        duplicate: float = 0.0,
        max_held: int = 4096,
        queue_maxlen: int = 16384,
        queue_num: int | None = None,
        seed: int | None = None,
        mark: int = DEFAULT_MARK,
        iptables: str = "iptables",
        python: str = sys.executable,
        start_timeout: float = 15.0,
    ):
        for name, p in (("drop", drop), ("duplicate", duplicate)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        if delay_ms < 0 or jitter_ms < 0:
            raise ValueError(f"delay_ms and jitter_ms must be >= 0, got {delay_ms}, {jitter_ms}")
        if max_held < 0:
            raise ValueError(f"max_held must be >= 0, got {max_held}")
        self.netns = netns
        self.match = list(match)
        self.chain = chain
        self.table = table
        self.mark = mark
        self.iptables = iptables
        self.start_timeout = start_timeout
        args = [
            python, os.path.abspath(__file__), "--match-json", json.dumps(self.match), "--chain", chain,
            "--table", table, "--drop", repr(drop), "--delay-ms", repr(delay_ms), "--jitter-ms", repr(jitter_ms),
            "--duplicate", repr(duplicate), "--max-held", str(max_held), "--maxlen", str(queue_maxlen),
            "--mark", hex(mark), "--iptables", iptables,
        ]
        if queue_num is not None:
            args += ["--queue", str(queue_num)]
        if seed is not None:
            args += ["--seed", str(seed)]
        self.args = ["ip", "netns", "exec", netns, *args] if netns is not None else args
        self.popen: subprocess.Popen | None = None
        self.queue_num: int | None = None
        self.rule: list[str] | None = None
        self.final: dict[str, Any] | None = None
        self._lines: queue.Queue = queue.Queue()
        self._stderr: IO[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    # --- child I/O ---

    def _read(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def describe(self) -> str:
        rc = self.popen.poll() if self.popen else None
        where = f"netns {self.netns}" if self.netns else "the root namespace"
        return (f"impairment in {where} ({self.chain} {' '.join(self.match)}), "
                f"{'exited ' + str(rc) if rc is not None else 'running'}\n  stderr: {self.stderr_text()[-3000:]}")

    def _event(self, want: set[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ImpairmentError(f"no {'/'.join(sorted(want))} from the impairment loop within {timeout}s\n{self.describe()}")
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                if self.popen is not None:
                    try:
                        self.popen.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                raise ImpairmentError(f"the impairment loop ended before {'/'.join(sorted(want))}\n{self.describe()}")
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "error":
                raise ImpairmentError(f"the impairment loop failed: {ev.get('error')}\n{self.describe()}")
            if ev.get("event") in want:
                return ev

    def _send(self, cmd: str) -> None:
        assert self.popen is not None and self.popen.stdin is not None
        self.popen.stdin.write(cmd + "\n")
        self.popen.stdin.flush()

    # --- API ---

    def start(self) -> "Impairment":
        """Starts the loop; returns once the queue is bound and the rule installed."""
        if self.popen is not None:
            raise ImpairmentError("already started")
        if not iptables_available(self.iptables):
            raise ImpairmentError(f"{self.iptables} not found on PATH (install the iptables package)")
        self._stderr = tempfile.TemporaryFile()
        self.popen = subprocess.Popen(
            self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1,
            preexec_fn=die_with_parent,
        )
        self._reader = threading.Thread(target=self._read, name="impair-stdout", daemon=True)
        self._reader.start()
        try:
            ev = self._event({"ready"}, self.start_timeout)
        except BaseException:
            self._kill_and_cleanup()
            raise
        self.queue_num = ev["queue_num"]
        self.rule = ev["rule"]
        return self

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The loop's counters so far (see the module docstring)."""
        with self._lock:
            if self.final is not None:
                return dict(self.final)
            if self.popen is None:
                raise ImpairmentError("not started")
            try:
                self._send("stats")
            except (BrokenPipeError, OSError) as e:
                raise ImpairmentError(f"the impairment loop is gone ({e})\n{self.describe()}") from None
            return self._event({"stats"}, timeout)

    def stop(self, timeout: float = 15.0) -> dict[str, Any]:
        """Stops the loop (rule removed, held packets accepted); returns the final counters.
        Idempotent. Raises ImpairmentError if the loop had died (after removing its rule)."""
        with self._lock:
            if self.final is not None:
                return dict(self.final)
            if self.popen is None:
                raise ImpairmentError("not started")
            try:
                try:
                    self._send("stop")
                except (BrokenPipeError, OSError):
                    pass
                ev = self._event({"final"}, timeout)
            except BaseException:
                self._kill_and_cleanup()
                raise
            self.popen.wait(timeout=timeout)
            self._close_pipes()
            self.final = {k: v for k, v in ev.items() if k != "event"}
            return dict(self.final)

    def _close_pipes(self) -> None:
        assert self.popen is not None
        for f in (self.popen.stdin, self.popen.stdout):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _kill_and_cleanup(self) -> None:
        """Kills the child and removes its rule if it is still there (fail-closed otherwise)."""
        assert self.popen is not None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self.remove_leftover_rule()
        self._close_pipes()

    def remove_leftover_rule(self) -> bool:
        """Deletes this loop's rule if it is still installed; True if one was deleted."""
        if self.queue_num is None:
            return False
        spec = rule_spec(self.chain, self.match, self.queue_num, self.mark)
        removed = False
        for _ in range(4):
            if run_iptables(self.iptables, self.table, "-D", spec, self.netns).returncode != 0:
                break
            removed = True
        return removed

    def rule_present(self) -> bool:
        """Whether this loop's rule is installed (iptables -C)."""
        if self.queue_num is None:
            return False
        spec = rule_spec(self.chain, self.match, self.queue_num, self.mark)
        return run_iptables(self.iptables, self.table, "-C", spec, self.netns).returncode == 0

    def __enter__(self) -> "Impairment":
        return self.start()

    def __exit__(self, et, ev, tb) -> None:
        try:
            self.stop()
        except ImpairmentError as e:
            if ev is None:
                raise
            ev.add_note(f"also, stopping the impairment failed: {e}")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
