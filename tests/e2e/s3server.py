"""A real S3 API server on 127.0.0.1 for the object-storage tests: ``moto_server`` in IAM mode.

:class:`S3Server` starts ``moto_server`` (moto[server], from the venv of the running Python) on
a free loopback port with ``INITIAL_NO_AUTH_ACTION_COUNT`` = :data:`SETUP_ACTIONS`. moto lets
that many actions through unchecked and checks every later request as AWS would: a SigV4
signature from a known IAM key, and an IAM policy allowing the action. The harness spends the
free actions on its own set-up (create an IAM user, an access key for it, an inline policy
allowing ``s3:*``), then proves that the key works and that a wrong secret is refused
(``SignatureDoesNotMatch``) before it hands the server out. Without IAM mode moto accepts any
signature (docs: /work/shared/reference/object-storage.md, section 4).

Children (the shard source) get the server through :meth:`S3Server.env`; tests talk to it with
:meth:`S3Server.client` (boto3, path-style addressing, no retries). Nothing here touches a
real AWS endpoint: every request goes to the loopback endpoint with the harness's own keys.

boto3/botocore are imported lazily, so importing this module never fails where moto is not
installed; :func:`missing_reason` says what is missing (the fixtures in s3fixtures.py skip).
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any, Mapping

from pdeathsig import die_with_parent

#: Default bound of every wait, in seconds (the suite's conftest.WAIT).
WAIT = 60.0
REGION = "us-east-1"
#: Actions moto lets through before it starts checking signatures: the harness's set-up calls
#: (create_user, create_access_key, put_user_policy). Any other unsigned call before them
#: would eat one, so the readiness probe uses /moto-api/, which is not an action.
SETUP_ACTIONS = 3
IAM_USER = "shardwire-e2e"
ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
#: Why the fixtures skip where moto is absent (scripts/test installs tests/e2e/requirements.txt).
SKIP_REASON = "moto[server] not installed (scripts/test installs it)"


class S3HarnessError(RuntimeError):
    """The S3 server could not be started or set up (the message says why, with its stderr)."""


def moto_server_bin() -> pathlib.Path:
    """The ``moto_server`` script of the venv that runs this Python."""
    return pathlib.Path(sys.executable).parent / "moto_server"


def missing_reason() -> str | None:
    """None when moto[server] and boto3 are usable from this Python, else what is missing."""
    for mod in ("moto", "boto3", "flask", "werkzeug"):
        if importlib.util.find_spec(mod) is None:
            return f"{SKIP_REASON}: no module {mod!r}"
    if not os.access(moto_server_bin(), os.X_OK):
        return f"{SKIP_REASON}: no {moto_server_bin()}"
    return None


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_client(endpoint: str, access_key: str, secret_key: str, *, region: str = REGION, attempts: int = 1,
              connect_timeout: float = 5.0, read_timeout: float = WAIT, max_pool: int = 64, **config: Any):
    """A boto3 S3 client for `endpoint`: path-style addressing, SigV4, `attempts` tries per call
    (1 = no retries, so injected faults surface), checksums only where an API requires them (no
    CRC headers on PUT, no checksum validation on GET: the bytes arrive exactly as sent), the
    given timeouts. `config`: more botocore Config arguments."""
    import boto3
    from botocore.config import Config

    cfg = Config(
        region_name=region,
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"total_max_attempts": attempts, "mode": "standard"},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_pool,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **config,
    )
    session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region)
    return session.client("s3", endpoint_url=endpoint, config=cfg)


def error_code(exc: BaseException) -> tuple[int | None, str | None]:
    """(HTTP status, S3 error code) of a botocore ClientError; (None, None) for anything else."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return None, None
    return resp.get("ResponseMetadata", {}).get("HTTPStatusCode"), resp.get("Error", {}).get("Code")


class S3Server:
    """``moto_server`` on ``127.0.0.1:<free port>`` in IAM mode, with one IAM user whose key may
    do anything in S3. Use as a context manager or call :meth:`start` / :meth:`stop`.

    After :meth:`start` returns: the server answers, :attr:`access_key`/:attr:`secret_key` are
    valid, every request is SigV4-checked (a wrong secret got ``SignatureDoesNotMatch``), and the
    server's stderr goes to ``log_dir/<name>.stderr.log``."""

    def __init__(self, log_dir: pathlib.Path, name: str = "moto", region: str = REGION, wait: float = WAIT):
        self.log_dir = pathlib.Path(log_dir)
        self.name = name
        self.region = region
        self.wait = wait
        self.port = 0
        self.access_key = ""
        self.secret_key = ""
        self.popen: subprocess.Popen | None = None
        self.stderr_path = self.log_dir / f"{name}.stderr.log"
        self._client = None

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3Server":
        """Starts moto, sets up IAM and checks that signatures are enforced (bounded by `wait`).
        Raises :class:`S3HarnessError` (with the stderr tail) on failure; leaves nothing running."""
        reason = missing_reason()
        if reason:
            raise S3HarnessError(reason)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for attempt in range(3):  # the free port can be taken between probe and bind
                self._spawn()
                if self._wait_ready():
                    break
                if attempt == 2 or "already in use" not in self.stderr_tail():
                    raise S3HarnessError(f"moto_server exited before answering\n{self.describe()}")
            self._setup_iam()
            self._check_auth()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_ACTIONS)
        env["AWS_EC2_METADATA_DISABLED"] = "true"
        with open(self.stderr_path, "ab") as err:
            self.popen = subprocess.Popen(
                [str(moto_server_bin()), "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, preexec_fn=die_with_parent,
            )

    def _wait_ready(self) -> bool:
        """True once moto answers GET /moto-api/data.json (not an action: costs no free call);
        False if it exited; raises after `wait` seconds."""
        assert self.popen is not None
        deadline = time.monotonic() + self.wait
        last = ""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                return False
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/moto-api/data.json")
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    return True
                last = f"HTTP {resp.status}"
            except OSError as e:
                last = repr(e)
            finally:
                conn.close()
            time.sleep(0.05)
        raise S3HarnessError(f"moto_server did not answer on {self.endpoint} within {self.wait}s (last: {last})\n{self.describe()}")

    def _setup_iam(self) -> None:
        """The :data:`SETUP_ACTIONS` free calls: user, access key, allow-all-S3 inline policy.
        The dummy credentials are never checked (these calls are inside the free count)."""
        import boto3
        from botocore.config import Config

        iam = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup", region_name=self.region).client(
            "iam", endpoint_url=self.endpoint,
            config=Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=self.wait),
        )
        try:
            iam.create_user(UserName=IAM_USER)
            key = iam.create_access_key(UserName=IAM_USER)["AccessKey"]
            iam.put_user_policy(UserName=IAM_USER, PolicyName="allow-s3", PolicyDocument=json.dumps(ALLOW_S3))
        except Exception as e:
            raise S3HarnessError(f"IAM set-up on moto failed: {e!r}\n{self.describe()}") from e
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def _check_auth(self) -> None:
        """The key works and a wrong secret is refused: IAM mode is really on."""
        try:
            self.client().list_buckets()
        except Exception as e:
            raise S3HarnessError(f"the harness's own key was refused: {e!r}\n{self.describe()}") from e
        wrong = self.client(secret_key=self.secret_key[:-4] + "XXXX")
        try:
            wrong.list_buckets()
        except Exception as e:
            status, code = error_code(e)
            if (status, code) == (403, "SignatureDoesNotMatch"):
                return
            raise S3HarnessError(f"a wrong secret got {status} {code} ({e!r}), not 403 SignatureDoesNotMatch\n{self.describe()}") from e
        raise S3HarnessError(f"moto accepted a wrong secret: signatures are not checked (IAM mode off?)\n{self.describe()}")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always reaps. Idempotent."""
        p, self.popen = self.popen, None
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=self.wait)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- diagnostics -----------------------------------------------------------------------

    def stderr_tail(self, chars: int = 4000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def describe(self, chars: int = 4000) -> str:
        p = self.popen
        state = "not running" if p is None else (f"exited {p.returncode}" if p.poll() is not None else f"pid {p.pid} running")
        return f"[{self.name}] {self.endpoint} {state}\n  stderr ({self.stderr_path}):\n{self.stderr_tail(chars)}"

    # --- clients ---------------------------------------------------------------------------

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a child needs to reach this server with the harness's key (merge it
        into the child's environment): `endpoint` (default: the server itself; a proxy passes
        its own), plain HTTP allowed, path-style, the region, the static key, and no instance
        metadata, config or credentials files (so nothing reaches real AWS). object_store's
        ``AmazonS3Builder::from_env`` reads all of these."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def client(self, endpoint: str | None = None, *, access_key: str | None = None, secret_key: str | None = None, **kw: Any):
        """A boto3 S3 client (see :func:`s3_client`: path style, no retries) for this server or
        `endpoint` (a proxy in front of it), with the harness's key unless given others."""
        return s3_client(endpoint or self.endpoint, access_key or self.access_key, secret_key or self.secret_key,
                         region=self.region, **kw)

    def _admin(self):
        if self._client is None:
            self._client = self.client(attempts=3)
        return self._client

    def make_bucket(self, name: str) -> str:
        """Creates bucket `name` (3-63 chars: lower-case letters, digits, '-', '.'); returns it."""
        self._admin().create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """One PutObject; returns the ETag as S3 sends it (with its double quotes)."""
        return self._admin().put_object(Bucket=bucket, Key=key, Body=data)["ETag"]

    def head(self, bucket: str, key: str) -> dict:
        """HeadObject's answer (``ETag`` quoted, ``ContentLength``, ...)."""
        return self._admin().head_object(Bucket=bucket, Key=key)

    def upload_dir(self, local_dir: pathlib.Path, bucket: str, prefix: str = "", part_size: int | None = None) -> list[str]:
        """Uploads every file under `local_dir` (recursively, sorted) to `bucket` as
        ``prefix/relative/path`` (just ``relative/path`` for an empty prefix); returns the keys.
        One PutObject per file (ETag = MD5 of the file), or, where `part_size` is given, a
        multipart upload in `part_size` parts (>= 5 MiB; ETag ``"<md5>-<parts>"``) for files
        larger than `part_size`."""
        local_dir = pathlib.Path(local_dir)
        if not local_dir.is_dir():
            raise FileNotFoundError(f"upload_dir: {local_dir} is not a directory")
        if part_size is not None and part_size < 5 * 1024 * 1024:
            raise ValueError(f"part_size {part_size} is below S3's 5 MiB minimum part")
        keys = []
        pre = prefix.strip("/")
        for f in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = f.relative_to(local_dir).as_posix()
            key = f"{pre}/{rel}" if pre else rel
            if part_size is not None and f.stat().st_size > part_size:
                self._put_multipart(bucket, key, f, part_size)
            else:
                self._admin().put_object(Bucket=bucket, Key=key, Body=f.read_bytes())
            keys.append(key)
        return keys

    def _put_multipart(self, bucket: str, key: str, f: pathlib.Path, part_size: int) -> None:
        c = self._admin()
        up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        parts = []
        try:
            with open(f, "rb") as fh:
                n = 1
                while chunk := fh.read(part_size):
                    etag = c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=n, Body=chunk)["ETag"]
                    parts.append({"PartNumber": n, "ETag": etag})
                    n += 1
            c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})
        except BaseException:
            c.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=up)
            raise


def scrubbed_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) without any AWS_* variable: start a child's environment from
    this and add :meth:`S3Server.env`, so an inherited AWS_SESSION_TOKEN or profile cannot mix in."""
    return {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AWS_")}
