"""Tests of the S3 test infrastructure itself: the moto server harness (s3server.py) and the
fault-injecting proxy (s3fault.py), driven with boto3 (path style, no retries, so every fault
is seen as armed) and with raw sockets where exact byte counts matter.

No shardwire binary is needed. The moto tests skip where moto[server] is not installed; the
proxy framing tests (chunked bodies, keep-alive) run against a tiny in-process HTTP server.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import http.server
import os
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import pytest

from s3fault import FaultProxy
from s3server import error_code

MiB = 1 << 20


def _client_error(fn, *args, **kw) -> tuple[int | None, str | None, dict]:
    """Runs a boto3 call that must fail with a ClientError; returns (status, code, headers)."""
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as ei:
        fn(*args, **kw)
    status, code = error_code(ei.value)
    return status, code, ei.value.response["ResponseMetadata"].get("HTTPHeaders", {})


def _blob(n: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def sigv4_headers(s3, method: str, url: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """The headers of a SigV4-signed request (Authorization, X-Amz-Date, X-Amz-Content-SHA256)
    with the harness's key. Header auth, not a presigned URL: moto in IAM mode answers a
    presigned (query-string) request with 500, because it reads the Authorization header."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method=method, url=url, headers=dict(headers or {}))
    S3SigV4Auth(Credentials(s3.access_key, s3.secret_key), "s3", s3.region).add_auth(req)
    return {k: v for k, v in req.headers.items()}


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    error: BaseException | None = None
    seconds: float = 0.0


def raw_get(endpoint: str, target: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> RawResponse:
    """GET `target` over a raw socket; reads the body up to Content-Length or an error, keeping
    every byte that arrived (unlike an HTTP library, which may drop a partial read)."""
    url = urllib.parse.urlsplit(endpoint)
    t0 = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as s:
        lines = [f"GET {target} HTTP/1.1", f"Host: {url.netloc}"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = s.recv(65536)
            assert data, f"connection closed before a response head: {buf!r}"
            buf += data
        head, body = buf.split(b"\r\n\r\n", 1)
        first, *hl = head.decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in hl)}
        want = int(hdrs.get("content-length", "-1"))
        err = None
        try:
            while want < 0 or len(body) < want:
                data = s.recv(65536)
                if not data:
                    break
                body += data
        except OSError as e:
            err = e
        return RawResponse(int(first.split()[1]), hdrs, body, err, time.monotonic() - t0)


# --- moto through the proxy ------------------------------------------------------------------


def test_put_get_roundtrip_20mib(s3, s3_bucket, s3_proxy):
    """A 20 MiB object goes up and comes back byte-exact through the proxy; the log counts the
    bytes both ways, and boto3's Expect: 100-continue passed through."""
    c = s3_proxy.client()
    data = _blob(20 * MiB, 1)
    etag = c.put_object(Bucket=s3_bucket, Key="big/obj.bin", Body=data)["ETag"]
    got = c.get_object(Bucket=s3_bucket, Key="big/obj.bin")
    assert got["ETag"] == etag and got["ContentLength"] == len(data)
    assert got["Body"].read() == data
    s3_proxy.wait_idle()
    [put] = s3_proxy.requests("PUT", key="big/obj.bin")
    [get] = s3_proxy.requests("GET", key="big/obj.bin")
    assert (put.status, put.request_bytes, put.headers.get("expect")) == (200, len(data), "100-continue"), put
    assert (get.status, get.response_bytes, get.fault) == (200, len(data), None), get
    assert put.signed and get.signed and get.key == "big/obj.bin"


def test_ranged_get_if_match(s3, s3_bucket, s3_proxy):
    """Ranged GET with the right If-Match: 206 and exactly those bytes; a wrong one: 412.
    The log records method, range, If-Match and the Authorization header's presence."""
    data = _blob(1 * MiB, 2)
    etag = s3.put(s3_bucket, "r/x.bin", data)
    assert etag.startswith('"') and etag.endswith('"'), etag
    c = s3_proxy.client()
    r = c.get_object(Bucket=s3_bucket, Key="r/x.bin", Range="bytes=1000-66535", IfMatch=etag)
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert r["ContentRange"] == f"bytes 1000-66535/{len(data)}"
    assert r["Body"].read() == data[1000:66536]
    status, code, _ = _client_error(c.get_object, Bucket=s3_bucket, Key="r/x.bin", Range="bytes=0-9", IfMatch='"0123"')
    assert (status, code) == (412, "PreconditionFailed")
    s3_proxy.wait_idle()
    ok, bad = s3_proxy.requests("GET", key="r/x.bin")
    assert (ok.method, ok.range, ok.if_match, ok.signed, ok.status) == ("GET", "bytes=1000-66535", etag, True, 206)
    assert ok.response_bytes == 65536
    assert (bad.range, bad.if_match, bad.status) == ("bytes=0-9", '"0123"', 412)
    assert s3_proxy.count("GET") == 2 and s3_proxy.count(key="r/x.bin", status=412) == 1
    s3_proxy.reset_log()
    assert s3_proxy.count() == 0


def test_slowdown(s3, s3_bucket, s3_proxy):
    """slowdown: 503 SlowDown with Retry-After, or 429 TooManyRequests, for exactly the armed
    number of matching requests; PUTs too (the body is consumed or, with Expect, never sent)."""
    s3.put(s3_bucket, "s/a", b"a" * 100)
    c = s3_proxy.client()
    f = s3_proxy.slowdown(2, retry_after=3)
    for _ in range(2):
        status, code, hdrs = _client_error(c.get_object, Bucket=s3_bucket, Key="s/a")
        assert (status, code, hdrs.get("retry-after")) == (503, "SlowDown", "3")
    assert f.applied == 2 and s3_proxy.armed() == []
    assert c.get_object(Bucket=s3_bucket, Key="s/a")["Body"].read() == b"a" * 100
    s3_proxy.slowdown(1, status=429)
    status, code, hdrs = _client_error(c.get_object, Bucket=s3_bucket, Key="s/a")
    assert (status, code, "retry-after" in hdrs) == (429, "TooManyRequests", False)
    # A PUT: boto3 sends Expect: 100-continue for bodies over 1 MiB, not for small ones.
    s3_proxy.slowdown(2, method="PUT")
    assert _client_error(c.put_object, Bucket=s3_bucket, Key="s/b", Body=b"b" * 1000)[:2] == (503, "SlowDown")
    assert _client_error(c.put_object, Bucket=s3_bucket, Key="s/c", Body=b"c" * (2 * MiB))[:2] == (503, "SlowDown")
    c.put_object(Bucket=s3_bucket, Key="s/b", Body=b"b" * 1000)
    assert c.get_object(Bucket=s3_bucket, Key="s/b")["Body"].read() == b"b" * 1000
    s3_proxy.wait_idle()
    faults = [(e.method, e.status, e.fault is not None) for e in s3_proxy.requests()]
    assert faults == [("GET", 503, True)] * 2 + [("GET", 200, False), ("GET", 429, True)] + [("PUT", 503, True)] * 2 + [
        ("PUT", 200, False), ("GET", 200, False)]


def test_status_faults_match_key_in_order(s3, s3_bucket, s3_proxy):
    """status(): any S3 error, matched by key substring; faults are taken in arming order."""
    for k in ("k/one", "k/two"):
        s3.put(s3_bucket, k, k.encode())
    c = s3_proxy.client()
    s3_proxy.status(1, 500, "InternalError", key="k/two")
    s3_proxy.status(1, 403, "AccessDenied")
    s3_proxy.status(1, 404, "NoSuchKey")
    assert _client_error(c.get_object, Bucket=s3_bucket, Key="k/two")[:2] == (500, "InternalError")
    assert _client_error(c.get_object, Bucket=s3_bucket, Key="k/two")[:2] == (403, "AccessDenied")
    assert _client_error(c.get_object, Bucket=s3_bucket, Key="k/one")[:2] == (404, "NoSuchKey")
    assert c.get_object(Bucket=s3_bucket, Key="k/one")["Body"].read() == b"k/one"
    assert c.head_object(Bucket=s3_bucket, Key="k/two")["ContentLength"] == 5  # HEAD never matched GET faults
    s3_proxy.status(1, 500, "InternalError", method="HEAD")
    assert _client_error(c.head_object, Bucket=s3_bucket, Key="k/two")[0] == 500
    s3_proxy.status(5, 500, "InternalError")
    s3_proxy.clear()
    assert c.get_object(Bucket=s3_bucket, Key="k/two")["Body"].read() == b"k/two"


def test_reset_mid_body(s3, s3_bucket, s3_proxy):
    """reset_mid_body: the client gets the head and exactly `after` body bytes, then ECONNRESET;
    boto3 sees a streaming error."""
    from botocore.exceptions import BotoCoreError
    from urllib3.exceptions import HTTPError

    data = _blob(4 * MiB, 3)
    s3.put(s3_bucket, "m/x.bin", data)
    c = s3_proxy.client()
    target = f"/{s3_bucket}/m/x.bin"
    s3_proxy.reset_mid_body(1, after=300_001)
    r = raw_get(s3_proxy.endpoint, target, sigv4_headers(s3, "GET", s3_proxy.endpoint + target))
    assert r.status == 200 and int(r.headers["content-length"]) == len(data)
    assert len(r.body) == 300_001 and r.body == data[:300_001]
    assert isinstance(r.error, ConnectionResetError), r.error

    s3_proxy.reset_mid_body(1, after=1 * MiB)
    got = bytearray()
    body = c.get_object(Bucket=s3_bucket, Key="m/x.bin")["Body"]
    with pytest.raises((BotoCoreError, HTTPError, OSError)):
        while chunk := body.read(64 * 1024):
            got += chunk
    assert len(got) <= 1 * MiB and bytes(got) == data[: len(got)]
    s3_proxy.wait_idle()
    resets = s3_proxy.requests("GET", status=200)
    assert [(e.response_bytes, e.fault) for e in resets] == [(300_001, "reset_mid_body(after=300001)"),
                                                            (1 * MiB, "reset_mid_body(after=1048576)")]
    assert c.get_object(Bucket=s3_bucket, Key="m/x.bin")["Body"].read() == data


def test_stall_is_a_read_timeout(s3, s3_bucket, s3_proxy):
    """stall: head and `after` bytes, then silence: a client with a 1 s read timeout fails in
    about 1 s, long before the stall ends."""
    from botocore.exceptions import ReadTimeoutError
    from urllib3.exceptions import ReadTimeoutError as Urllib3ReadTimeout

    data = _blob(1 * MiB, 4)
    s3.put(s3_bucket, "st/x.bin", data)
    c = s3_proxy.client(read_timeout=1.0)
    s3_proxy.stall(1, after=10_000, seconds=8)
    got = bytearray()
    t0 = time.monotonic()
    body = c.get_object(Bucket=s3_bucket, Key="st/x.bin")["Body"]
    with pytest.raises((ReadTimeoutError, Urllib3ReadTimeout)):
        while chunk := body.read(4096):
            got += chunk
    took = time.monotonic() - t0
    assert 0.9 <= took < 5, took
    assert len(got) <= 10_000 and bytes(got) == data[: len(got)]
    [e] = s3_proxy.requests("GET")
    assert (e.status, e.response_bytes, e.done) == (200, 10_000, False)
    # A stall before the first body byte: the head comes back, then the read times out.
    s3_proxy.stall(1, after=0, seconds=8)
    body = c.get_object(Bucket=s3_bucket, Key="st/x.bin")["Body"]
    with pytest.raises((ReadTimeoutError, Urllib3ReadTimeout)):
        body.read()


def test_flip_byte(s3, s3_bucket, s3_proxy):
    """flip_byte: exactly one byte differs, at the armed offset, XOR 0xFF; in ranged GETs too."""
    data = _blob(3 * MiB, 5)
    etag = s3.put(s3_bucket, "f/x.bin", data)
    c = s3_proxy.client()
    s3_proxy.flip_byte(1, offset=2 * MiB + 7)
    got = c.get_object(Bucket=s3_bucket, Key="f/x.bin")["Body"].read()
    diff = [i for i in range(len(data)) if got[i] != data[i]] if len(got) == len(data) else None
    assert diff == [2 * MiB + 7] and got[2 * MiB + 7] == data[2 * MiB + 7] ^ 0xFF
    s3_proxy.flip_byte(1, offset=0)
    got = c.get_object(Bucket=s3_bucket, Key="f/x.bin", Range="bytes=100-199", IfMatch=etag)["Body"].read()
    assert got[0] == data[100] ^ 0xFF and got[1:] == data[101:200]
    assert c.get_object(Bucket=s3_bucket, Key="f/x.bin")["Body"].read() == data


def test_signatures_are_checked(s3, s3_bucket, s3_proxy):
    """IAM mode: a wrong secret gets 403 SignatureDoesNotMatch and an unknown key 403
    InvalidAccessKeyId, straight at moto and through the proxy (which keeps Host, so the
    right key still verifies through it)."""
    s3.put(s3_bucket, "a/x", b"x")
    for endpoint in (s3.endpoint, s3_proxy.endpoint):
        wrong = s3.client(endpoint, secret_key="A" * 40)
        assert _client_error(wrong.get_object, Bucket=s3_bucket, Key="a/x")[:2] == (403, "SignatureDoesNotMatch")
        unknown = s3.client(endpoint, access_key="AKIAIOSFODNN7EXAMPLE", secret_key="A" * 40)
        assert _client_error(unknown.get_object, Bucket=s3_bucket, Key="a/x")[:2] == (403, "InvalidAccessKeyId")
        assert s3.client(endpoint).get_object(Bucket=s3_bucket, Key="a/x")["Body"].read() == b"x"
    s3_proxy.wait_idle()
    assert [e.status for e in s3_proxy.requests("GET")] == [403, 403, 200]


def test_concurrent_ranged_gets(s3, s3_bucket, s3_proxy):
    """50 concurrent ranged GETs with If-Match through the proxy: every one 206 and exact."""
    data = _blob(4 * MiB, 6)  # moto copies the whole object for every GET: keep it small
    etag = s3.put(s3_bucket, "c/x.bin", data)
    c = s3_proxy.client(max_pool=50)
    step = len(data) // 50

    def get(i: int) -> bytes:
        lo, hi = i * step + i, (i + 1) * step + 1000
        r = c.get_object(Bucket=s3_bucket, Key="c/x.bin", Range=f"bytes={lo}-{hi - 1}", IfMatch=etag)
        return r["Body"].read() == data[lo:hi]

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        results = list(pool.map(get, range(50)))
    assert all(results), [i for i, ok in enumerate(results) if not ok]
    s3_proxy.wait_idle()
    gets = s3_proxy.requests("GET", key="c/x.bin")
    assert len(gets) == 50 and all(e.status == 206 and e.if_match == etag for e in gets)
    assert s3_proxy.bytes_sent("GET", key="c/x.bin") == sum(min(len(data), (i + 1) * step + 1000) - (i * step + i)
                                                           for i in range(50))


def test_keep_alive_and_env(s3, s3_bucket, s3_proxy):
    """Client connections stay open across requests (moto closes its side each time); env()
    points AWS_ENDPOINT_URL at the proxy and carries the harness's key."""
    s3.put(s3_bucket, "ka/x", b"12345")
    c = s3_proxy.client(max_pool=1)
    for _ in range(4):
        assert c.get_object(Bucket=s3_bucket, Key="ka/x", Range="bytes=1-2")["Body"].read() == b"23"
    s3_proxy.wait_idle()
    gets = s3_proxy.requests("GET")
    assert len({e.conn for e in gets}) == 1 and [e.seq for e in gets] == [1, 2, 3, 4]
    with FaultProxy(s3, keep_alive=False) as plain:  # moto's Connection: close passes through
        c = plain.client(max_pool=1)
        for _ in range(2):
            assert c.get_object(Bucket=s3_bucket, Key="ka/x")["Body"].read() == b"12345"
        plain.wait_idle()
        assert [(e.conn, e.seq) for e in plain.requests("GET")] == [(1, 1), (2, 1)]
    env = s3_proxy.env()
    assert env["AWS_ENDPOINT_URL"] == s3_proxy.endpoint and s3.env()["AWS_ENDPOINT_URL"] == s3.endpoint
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (s3.access_key, s3.secret_key)
    assert env["AWS_ALLOW_HTTP"] == "true" and env["AWS_REGION"] == "us-east-1"
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"


def test_upload_dir(s3, s3_bucket, tmp_path):
    """upload_dir: every file under the directory, keyed prefix/relative/path; multipart above
    part_size (ETag "<md5>-<parts>")."""
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.bin").write_bytes(b"a" * 10)
    (tmp_path / "d" / "sub" / "b.bin").write_bytes(_blob(6 * MiB, 7))
    keys = s3.upload_dir(tmp_path / "d", s3_bucket, "pre/fix/", part_size=5 * MiB)
    assert keys == ["pre/fix/a.bin", "pre/fix/sub/b.bin"]
    listed = s3.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert sorted((o["Key"], o["Size"]) for o in listed) == [("pre/fix/a.bin", 10), ("pre/fix/sub/b.bin", 6 * MiB)]
    assert s3.head(s3_bucket, "pre/fix/sub/b.bin")["ETag"].endswith('-2"')


# --- proxy framing against a plain HTTP server (no moto needed) ------------------------------


@dataclass
class _Seen:
    bodies: list[bytes] = field(default_factory=list)
    peers: list[tuple] = field(default_factory=list)


@pytest.fixture
def echo_upstream():
    """An in-process HTTP/1.1 keep-alive server: PUT echoes the body back chunked (1000-byte
    chunks); GET /n/<N> sends N bytes (i % 251) with Content-Length."""
    seen = _Seen()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10  # bound every read of a request

        def log_message(self, *a):  # quiet
            pass

        def do_PUT(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = b""
                while (n := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    body += self.rfile.read(n)
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
            else:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.bodies.append(body)
            seen.peers.append(self.client_address)
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 1000):
                piece = body[i:i + 1000]
                self.wfile.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

        def do_GET(self):
            n = int(self.path.rsplit("/", 1)[1])
            seen.peers.append(self.client_address)
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            self.wfile.write(bytes(i % 251 for i in range(n)))

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def test_chunked_both_ways_and_upstream_keep_alive(echo_upstream):
    """A chunked request body arrives intact upstream, a chunked response comes back intact
    (and with flip_byte, one byte flipped across chunk boundaries); a keep-alive upstream
    connection is reused; stop() ends every thread."""
    endpoint, seen = echo_upstream
    payload = os.urandom(50_000)
    with FaultProxy(endpoint) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        try:
            conn.request("PUT", "/echo", body=iter([payload[:12_345], payload[12_345:]]), encode_chunked=True)
            r = conn.getresponse()
            assert (r.status, r.getheader("transfer-encoding"), r.read()) == (200, "chunked", payload)
            proxy.flip_byte(1, offset=1500, method="PUT")
            conn.request("PUT", "/echo", body=payload, headers={"Content-Length": str(len(payload))})
            got = conn.getresponse().read()
            assert [i for i in range(len(payload)) if got[i] != payload[i]] == [1500]
            conn.request("GET", "/n/100000")
            assert conn.getresponse().read() == bytes(i % 251 for i in range(100_000))
        finally:
            conn.close()
        proxy.wait_idle()
        ex = proxy.requests()
        assert [(e.method, e.conn, e.request_bytes, e.response_bytes) for e in ex] == [
            ("PUT", 1, 50_000, 50_000), ("PUT", 1, 50_000, 50_000), ("GET", 1, 0, 100_000)]
        assert ex[0].headers["transfer-encoding"] == "chunked" and ex[1].fault == "flip_byte(offset=1500)"
        # A body shorter than reset_mid_body's `after` arrives whole, then the connection resets.
        proxy.reset_mid_body(1, after=10**6)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"GET /n/1000 HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            with pytest.raises(ConnectionResetError):
                while data := s.recv(65536):
                    got += data
        assert got.endswith(b"\r\n\r\n" + bytes(i % 251 for i in range(1000)))
    assert seen.bodies == [payload, payload]
    assert len(set(seen.peers[:3])) == 1, seen.peers  # one upstream connection for the first three
    assert not [t for t in threading.enumerate() if t.name.startswith("s3fault-") and str(proxy.port) in t.name]
