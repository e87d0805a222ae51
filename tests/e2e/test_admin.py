"""Admin API of the node service: bearer-token auth on mutating endpoints, stream inspect and
close, drain (no new streams, readiness off, exit 0 once streams are done), metrics names."""

import json
import os
import signal
import subprocess
import time

from conftest import (
    MiB,
    admin_request,
    consume_args,
    http_get,
    index_dataset,
    require_bin,
    wait_for,
    wait_ready,
    write_uint8_shards,
)


def request(admin: str, method: str, path: str, token: str | None = None) -> tuple[int, dict]:
    return admin_request(admin, method, path, token=token)


def tcp_queues(addr: str) -> tuple[list[int], list[int]]:
    """The established TCP connections to `addr` (IPv4 HOST:PORT), from /proc/net/tcp: (the
    receive queue of each end on `addr`, the send queue of each peer's end). An end on `addr`
    that has a request on its way in and a receive queue of 0 was accepted and read."""
    ip, port = addr.rsplit(":", 1)
    a, b, c, d = (int(x) for x in ip.split("."))
    want = f"{d:02X}{c:02X}{b:02X}{a:02X}:{int(port):04X}"
    ours, peers = [], []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[3] != "01":  # ESTABLISHED
                continue
            tx, rx = (int(x, 16) for x in cols[4].split(":"))
            if cols[1] == want:
                ours.append(rx)
            elif cols[2] == want:
                peers.append(tx)
    return ours, peers


def test_auth_inspect_close_and_drain(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 12, 256 * 1024, seed=3)
    index_dataset(d)
    token = tmp_path / "admin.token"
    token.write_text("s3cret-token\n")
    src = sw.source({"a": d}, "--rate-limit", "512KiB")
    node = sw.serve([src], "--stream-memory", "4MiB", "--pool-size", "16MiB")
    wait_ready(node)
    # Without a token file, mutating endpoints are disabled.
    code, body = request(node.admin, "POST", "/v1/drain", token="x")
    assert code == 403 and body["code"] == "admin_disabled", body

    node2 = sw.serve([src], "--stream-memory", "4MiB", "--pool-size", "16MiB", "--config", write_cfg(tmp_path, token))
    wait_ready(node2)
    consumer = sw.start_consume(node2, "a", limit=1, hold_secs=30)
    st = wait_for(lambda: node2.status() if node2.status()["streams"] else None, "a stream to open")
    sid = st["streams"][0]["id"]

    code, body = request(node2.admin, "DELETE", f"/v1/streams/{sid}")
    assert code == 401 and body["code"] == "unauthorized", body
    code, body = request(node2.admin, "DELETE", f"/v1/streams/{sid}", token="wrong")
    assert code == 403 and body["code"] == "forbidden", body
    code, body = request(node2.admin, "GET", f"/v1/streams/{sid}")
    assert code == 200 and body["id"] == sid and body["dataset"] == "a", body
    code, body = request(node2.admin, "GET", "/v1/streams/999999")
    assert code == 404 and body["code"] == "not_found", body
    assert node2.status()["pool"]["reserved"] == 4 * MiB
    # The trainer holds its batch (it would otherwise exit on the close, while it waits).
    wait_for(lambda: node2.status()["streams"][0]["leased"] >= 1, "the trainer to take its batch", timeout=60)
    code, body = request(node2.admin, "DELETE", f"/v1/streams/{sid}", token="s3cret-token")
    assert code == 200 and body["closed"] == sid, body
    # Its trainer still maps the region: the stream stays listed, closed, and holds its memory
    # budget until the trainer goes (a new stream would otherwise be given memory in use).
    (listed,) = node2.status()["streams"]
    assert listed["id"] == sid and listed["closed"] == "closed by an operator over the admin API", listed
    assert node2.status()["pool"]["reserved"] == 4 * MiB
    code, body = request(node2.admin, "DELETE", f"/v1/streams/{sid}", token="s3cret-token")
    assert code == 200 and body["closed"] == sid, "closing a listed stream again is harmless"
    consumer.kill(signal.SIGKILL)
    wait_for(lambda: node2.status()["streams"] == [], "the closed stream to go with its trainer")
    assert node2.status()["pool"]["reserved"] == 0
    code, body = request(node2.admin, "DELETE", f"/v1/streams/{sid}", token="s3cret-token")
    assert code == 404 and body["code"] == "not_found", body

    code, body = request(node2.admin, "GET", "/v1/nics")
    lo = next(n for n in body["nics"] if n["name"] == "lo")
    assert code == 200 and lo["devmem_capable"] is False and lo["trial_bind"]["error"], lo
    assert "no devmem-capable NIC" in node2.status()["mode"]["reason"], node2.status()["mode"]
    code, body = request(node2.admin, "GET", "/v1/bindings")
    assert code == 200 and body == {"receive": "host", "bindings": []}, body

    metrics = http_get(node2.admin, "/metrics")[1]
    for name in [
        "shardwire_bytes_received_total",
        "shardwire_admin_auth_fails_total",
        "shardwire_stall_seconds",
        "shardwire_pool_bytes_used",
        "shardwire_source_up",
    ]:
        assert name in metrics, name

    # Drain: accepted with the token, readiness turns off, new streams are refused, exit 0.
    code, body = request(node2.admin, "POST", "/v1/drain", token="s3cret-token")
    assert code == 202 and body["draining"] is True, body
    rc = node2.wait(timeout=30)
    assert rc == 0, node2.describe()
    assert "drained" in node2.stderr_text(), node2.stderr_text()[-2000:]


def write_cfg(tmp_path, token) -> str:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'admin_token_file = "{token}"\ndrain_timeout_secs = 20\n')
    return str(cfg)


def _draining_with_a_held_stream(sw, tmp_path, drain_secs: int):
    """A node with one stream held open by a stalled trainer, sent SIGTERM and draining
    (readiness off): (node, the trainer)."""
    d = tmp_path / "ds"
    write_uint8_shards(d, 6, 64 * 1024, seed=4)
    index_dataset(d)
    src = sw.source({"a": d})
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f"drain_timeout_secs = {drain_secs}\n")
    node = sw.serve([src], "--config", str(cfg))
    wait_ready(node)
    holder = sw.start_consume(node, "a", limit=1, hold_secs=300)
    wait_for(lambda: node.status()["streams"] or None, "a stream to open")
    node.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: http_get(node.admin, "/readyz")[0] == 503 or None, "readiness to turn off")
    return node, holder


def test_sigterm_right_after_the_ready_line_drains(sw, tmp_path):
    """The signal handlers were installed after the ready lines were printed: a SIGTERM sent
    as soon as a harness (or the kubelet) saw `source listening` or `node service ready`
    could kill the process by the signal's default action (143) instead of draining (0)."""
    d = tmp_path / "a"
    write_uint8_shards(d, 2, 4096)
    index_dataset(d)
    for _ in range(15):
        src = sw.source({"a": d})
        src.kill(signal.SIGTERM)
        assert src.wait(30) == 0, src.describe()
    src = sw.source({"a": d})
    for _ in range(10):
        node = sw.serve([src])
        node.kill(signal.SIGTERM)
        assert node.wait(30) == 0, node.describe()


def test_sigterm_drains_and_refuses_new_streams(sw, tmp_path):
    # Long enough for the refused consume below to start and connect on a loaded machine.
    node, holder = _draining_with_a_held_stream(sw, tmp_path, 10)
    out = subprocess.run(
        [str(require_bin()), *consume_args(node.socket, "a")], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0 and "draining" in out.stderr, out.stderr
    # The held stream keeps the node up until the drain timeout, then it exits 0.
    t = time.monotonic()
    assert node.wait(timeout=30) == 0
    assert "drain timeout" in node.stderr_text(), node.stderr_text()[-2000:]
    assert time.monotonic() - t < 25
    holder.kill(signal.SIGKILL)


def test_a_second_signal_ends_a_drain_at_once(sw, tmp_path):
    node, holder = _draining_with_a_held_stream(sw, tmp_path, 120)
    # Before: the second signal was swallowed, and the node waited out the 120 s drain.
    t = time.monotonic()
    node.popen.send_signal(signal.SIGINT)
    assert node.wait(timeout=30) == 0
    assert time.monotonic() - t < 10
    assert "a second signal: closing the remaining streams now" in node.stderr_text(), node.stderr_text()[-2000:]
    holder.kill(signal.SIGKILL)


def test_a_signal_during_a_drain_the_api_began_is_the_first(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 4, 64 * 1024, seed=9)
    index_dataset(d)
    token = tmp_path / "admin.token"
    token.write_text("s3cret-token\n")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'admin_token_file = "{token}"\ndrain_timeout_secs = 120\n')
    node = sw.serve([sw.source({"a": d})], "--config", str(cfg))
    wait_ready(node)
    holder = sw.start_consume(node, "a", limit=1, hold_secs=300)
    wait_for(lambda: node.status()["streams"] or None, "a stream to open")
    code, body = request(node.admin, "POST", "/v1/drain", token="s3cret-token")
    assert code == 202, body
    # A rollout's SIGTERM during that drain drains on (before the fix: closed every stream).
    node.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: "another one closes the remaining streams now" in node.stderr_text() or None, "the first signal's line")
    assert node.popen.poll() is None and node.status()["streams"], "still draining"
    t = time.monotonic()
    node.popen.send_signal(signal.SIGINT)
    assert node.wait(timeout=30) == 0 and time.monotonic() - t < 10
    assert "a second signal: closing the remaining streams now" in node.stderr_text(), node.stderr_text()[-2000:]
    holder.kill(signal.SIGKILL)


def test_trainer_http_off_refuses_the_trainer_routes_and_keeps_the_admin_ones(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 2, 4096, seed=7)
    index_dataset(d)
    src = sw.source({"a": d})
    cfg = tmp_path / "serve.toml"
    cfg.write_text("trainer_http = false\n")
    node = sw.serve([src], "--config", str(cfg))
    wait_ready(node)
    code, body = admin_request(node.admin, "POST", "/v1/streams", {"dataset": "a"})
    assert code == 403 and body["code"] == "forbidden" and "trainer_http" in body["message"], body
    code, body = admin_request(node.admin, "POST", "/v1/leases/1/release")
    assert code == 403 and "trainer_http" in body["message"], body
    # The admin routes and the socket are unchanged.
    assert request(node.admin, "GET", "/v1/streams")[0] == 200
    assert http_get(node.admin, "/v1/status")[0] == 200
    out = subprocess.run(
        [str(require_bin()), *consume_args(node.socket, "a"), "--limit", "1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_trainer_peer_allowlist_and_socket_mode(sw, tmp_path):
    d = tmp_path / "ds"
    write_uint8_shards(d, 3, 4096, seed=6)
    index_dataset(d)
    src = sw.source({"a": d})
    cfg = tmp_path / "serve.toml"
    # Root (uid 0) is not in the list: refused with `forbidden`, naming the uid.
    cfg.write_text('socket_mode = "0600"\nallowed_uids = [12345]\nallowed_gids = [54321]\n')
    node = sw.serve([src], "--config", str(cfg))
    wait_ready(node)
    assert oct(os.stat(node.socket).st_mode & 0o777) == "0o600"
    out = subprocess.run(
        [str(require_bin()), *consume_args(node.socket, "a")], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0 and "forbidden" in out.stderr and "uid 0" in out.stderr, out.stderr
    # Allowing gid 0 lets the same trainer in.
    cfg2 = tmp_path / "serve2.toml"
    cfg2.write_text("allowed_gids = [0]\n")
    node2 = sw.serve([src], "--config", str(cfg2))
    wait_ready(node2)
    assert len(sw.consume(node2, "a")) == 3


def test_an_http_stream_closed_by_an_operator_frees_its_memory_and_answers_404_with_why(sw, tmp_path):
    """`DELETE /v1/streams/{id}` on a stream opened over HTTP: the node stops counting its
    memory at once, so the HTTP API must let the region go too (it kept it until the stream's
    idle timeout, up to a day, while new streams were given that memory), and the id answers
    404 saying why."""
    d = tmp_path / "ds"
    write_uint8_shards(d, 4, 64 * 1024, seed=5)
    index_dataset(d)
    token = tmp_path / "admin.token"
    token.write_text("s3cret-token\n")
    node = sw.serve([sw.source({"a": d})], "--stream-memory", "4MiB", "--pool-size", "16MiB",
                    "--config", write_cfg(tmp_path, token))
    wait_ready(node)
    code, body = admin_request(node.admin, "POST", "/v1/streams", body={"dataset": "a", "idle_timeout_s": 3600})
    assert code == 201, body
    sid = body["stream"]
    regions = lambda: [p for p in (os.readlink(f"/proc/{node.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{node.pid}/fd"))
                       if f"memfd:shardwire-stream-{sid} " in p]
    assert regions(), "the stream's region is open in the node"
    code, body = request(node.admin, "DELETE", f"/v1/streams/{sid}", token="s3cret-token")
    assert code == 200 and body["closed"] == sid, body
    wait_for(lambda: not regions(), "the closed HTTP stream's region to be freed", timeout=10)
    code, body = request(node.admin, "GET", f"/v1/streams/{sid}/state")
    assert code == 404 and body["code"] == "not_found", body
    assert "was closed: closed by an operator over the admin API" in body["message"], body
    assert node.status()["pool"]["reserved"] == 0


def test_trainers_long_polls_cannot_starve_the_probes_and_the_admin(sw, tmp_path):
    """With every one of `http_max_connections` held by a `next` waiting for a batch (the source
    sends 1 KiB/s), `/healthz` and the admin API are still served (on a reserve connection,
    where a trainer route answers `503 unavailable`); once a probe got no answer at all."""
    import http.client
    import threading
    import urllib.request

    d = tmp_path / "slow"
    write_uint8_shards(d, 2, 256 * 1024, seed=5)
    index_dataset(d)
    cfg = tmp_path / "serve.toml"
    cfg.write_text("http_max_connections = 2\n")
    node = sw.serve([sw.source({"a": d}, "--rate-limit", "1KiB")], "--config", str(cfg))
    wait_ready(node)
    code, body = admin_request(node.admin, "POST", "/v1/streams", body={"dataset": "a"})
    assert code == 201, body
    sid = body["stream"]
    answers = []
    sent = []

    def long_poll():
        host, port = node.admin.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", f"/v1/streams/{sid}/next?timeout_ms=8000")
            sent.append(True)
            answers.append(conn.getresponse().status)
        finally:
            conn.close()

    polls = [threading.Thread(target=long_poll) for _ in range(2)]
    for t in polls:
        t.start()
    # Both connections taken, both polls waiting. Not probed over HTTP: a third connection
    # while a poll still connects could take the poll's place and send it to a reserve slot
    # (503). Seen from the kernel instead: both requests sent, and read by the node, so it
    # accepted both connections (taking a connection slot for each).
    def both_taken():
        ours, peers = tcp_queues(node.admin)
        return len(sent) == 2 and len(ours) == len(peers) == 2 and not any(ours) and not any(peers)

    try:
        wait_for(both_taken, "the node to accept and read both long polls", timeout=6,
                 diag=lambda: f"sent {len(sent)}, queues {tcp_queues(node.admin)}\n{node.describe()}")
        with urllib.request.urlopen(f"http://{node.admin}/healthz", timeout=3) as r:
            assert r.status == 200
        code, body = request(node.admin, "GET", "/v1/status")
        assert code == 200 and body["streams"], body
        code, body = admin_request(node.admin, "POST", f"/v1/streams/{sid}/next?timeout_ms=0")
        assert code == 503 and body["code"] == "unavailable" and "http_max_connections" in body["message"], body
        # A keep-alive client is not kept on a reserve connection: the answer closes it.
        import faults as F
        out = F.http_raw(node.admin, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", wait=3.0)
        assert out.status == 200 and out.headers.get("connection") == "close" and out.closed_by_peer, out
    finally:
        for t in polls:
            t.join(timeout=30)
    assert answers == [204, 204], answers  # the polls ran out their own timeouts


def test_unknown_routes_and_methods_answer_the_json_error(sw, tmp_path):
    """A path no route serves, or a method a route does not take, is answered with the JSON
    error body every other refusal has ({"code", "message"}, naming what was asked); a body
    that is not JSON to POST /v1/bindings is 415, as to POST /v1/streams. Before: empty 404
    and 405 bodies (the SDKs reported a parse failure instead), and 400 for the content type."""
    import urllib.error
    import urllib.request

    d = tmp_path / "ds"
    write_uint8_shards(d, 2, 1024, seed=3)
    index_dataset(d)
    token = tmp_path / "admin.token"
    token.write_text("tok\n")
    node = sw.serve([sw.source({"a": d})], "--config", write_cfg(tmp_path, token))
    wait_ready(node)
    code, body = request(node.admin, "GET", "/v1/nope")
    assert code == 404 and body["code"] == "not_found" and "GET /v1/nope" in body["message"], body
    for method, path in [("PUT", "/v1/drain"), ("GET", "/v1/streams/1/close"), ("DELETE", "/v1/status")]:
        code, body = request(node.admin, method, path)
        assert code == 405 and body["code"] == "bad_request" and method in body["message"] and path in body["message"], body
    req = urllib.request.Request(f"http://{node.admin}/v1/bindings", method="POST", data=b'{"interface": "emulator"}',
                                 headers={"Content-Type": "text/plain", "Authorization": "Bearer tok"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("a text/plain body was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 415 and json.loads(e.read())["code"] == "bad_request"


def _serve_fails(sw, tmp_path, src, sock, admin="127.0.0.1:0") -> subprocess.CompletedProcess:
    args = [str(require_bin()), "serve", "--source", src.addr, "--socket", str(sock), "--admin", admin,
            "--data-listen", "127.0.0.1:0", "--pool-size", "16MiB", "--stream-memory", "4MiB"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stderr[-2000:]
    return r


def test_a_socket_path_in_use_or_not_a_socket_is_refused_not_removed(sw, tmp_path):
    """The trainer socket replaces only a stale socket (one nobody listens on). A regular file
    at the path, or the socket of a node that runs, is refused, naming the path; before, both
    were removed ("a stale trainer socket"), the running node's trainers locked out. An admin
    address that is taken fails the start before the node has made its socket."""
    import socket as so

    d = tmp_path / "ds"
    write_uint8_shards(d, 2, 64 * 1024, seed=5)
    index_dataset(d)
    src = sw.source({"a": d})
    path = tmp_path / "trainer.sock"
    path.write_text("my notes\n")
    r = _serve_fails(sw, tmp_path, src, path)
    assert "is not a socket" in r.stderr and str(path) in r.stderr, r.stderr[-2000:]
    assert path.read_text() == "my notes\n"
    path.unlink()
    node = sw.serve([src], "--stream-memory", "4MiB", "--pool-size", "16MiB", socket=path)
    wait_ready(node)
    r = _serve_fails(sw, tmp_path, src, path)
    assert "another node service listens" in r.stderr, r.stderr[-2000:]
    assert sw.consume(node, "a"), "the running node's socket still works"
    # A stale socket (bound, nobody listening) is replaced.
    stale = tmp_path / "stale.sock"
    s = so.socket(so.AF_UNIX)
    s.bind(str(stale))
    s.close()
    node2 = sw.serve([src], "--stream-memory", "4MiB", "--pool-size", "16MiB", socket=stale)
    assert sw.consume(node2, "a")
    # A taken admin address: refused before the node made its socket.
    taken = so.create_server(("127.0.0.1", 0))
    sock3 = tmp_path / "third.sock"
    r = _serve_fails(sw, tmp_path, src, sock3, admin="127.0.0.1:%d" % taken.getsockname()[1])
    taken.close()
    assert "cannot bind the admin API" in r.stderr, r.stderr[-2000:]
    assert not sock3.exists(), "the node started (and made its socket) before the admin bind failed"
