"""pytest fixtures for the object-storage tests: a moto S3 server, a fresh bucket per test and
a fault-injecting proxy in front of the server (s3server.py, s3fault.py).

conftest.py imports the fixtures, so every test module can name them:

- ``s3``: one :class:`s3server.S3Server` for the whole session (IAM mode: signatures are
  checked); stderr in the session's temporary directory. Skips the test with
  ``moto[server] not installed (scripts/test installs it)`` where moto is missing.
- ``s3_bucket``: the name of a new, empty bucket, unique to the test.
- ``s3_proxy``: a :class:`s3fault.FaultProxy` over ``s3``, started for the test and stopped
  after it (faults and log start empty); ``s3_proxy.env()`` points ``AWS_ENDPOINT_URL`` at it.
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:  # imported lazily below: importing this module needs neither moto nor boto3
    from s3fault import FaultProxy
    from s3server import S3Server


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[S3Server]:
    """A moto S3 server in IAM mode for the session (see s3server.S3Server)."""
    from s3server import SKIP_REASON, S3Server, missing_reason

    if missing_reason():
        pytest.skip(SKIP_REASON)
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3, request) -> str:
    """A new bucket named after the test (``sw-<test>-<random>``, valid S3 name)."""
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-") or "t"
    return s3.make_bucket(f"sw-{stem}-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def s3_proxy(s3) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of ``s3`` for this test (see s3fault.FaultProxy)."""
    from s3fault import FaultProxy

    with FaultProxy(s3) as proxy:
        yield proxy
