"""A dataset in Azure Blob Storage (`az://CONTAINER/PREFIX`), on Azurite (Azure's own storage
emulator, installed by scripts/test into .azurite; SharedKey signatures checked), with real
`shardwire index`, source and node processes on 127.0.0.1.

Azure lists a blob's ETag unquoted (`0x8D...`) and sends it quoted on GET and HEAD
(`"0x8D..."`); Azurite does the same. The store pins reads to the listed ETag, so before it
compared tags in one form every read of an Azure dataset was refused as "dataset changed".
Asserted here: the index records quoted ETags, every batch is byte-exact, and a blob rewritten
after indexing is refused by name, never delivered.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import time

import pytest

from conftest import (
    WAIT,
    assert_byte_exact,
    assert_exactly_once,
    child_env,
    expected_crcs,
    require_bin,
    wait_ready,
    write_uint8_shards,
)
from pdeathsig import die_with_parent

ROOT = pathlib.Path(__file__).resolve().parents[2]
AZURITE = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
# The emulator's one account and its documented, public key.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(p: subprocess.Popen, port: int, log: pathlib.Path) -> bool:
    """True once 127.0.0.1:PORT accepts a connection and `p` is still running after it (a
    connection to another process that took the port first is followed by Azurite's exit);
    False if `p` exited; fails after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while p.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            assert time.monotonic() < deadline, f"Azurite did not listen on {port} within {WAIT}s:\n{log.read_text()}"
            time.sleep(0.1)
            continue
        time.sleep(0.2)  # (time for a bind that failed to end the process)
        return p.poll() is None
    return False


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """Azurite's blob service on a free loopback port: (its URL, the environment that points
    shardwire at it)."""
    if not AZURITE.exists():
        pytest.skip(f"Azurite is not installed at {AZURITE} (scripts/test installs it with npm)")
    pytest.importorskip("azure.storage.blob", reason="azure-storage-blob (tests/e2e/requirements.txt)")
    data = tmp_path_factory.mktemp("azurite")
    log_path = data / "azurite.log"
    log = open(log_path, "w")
    p = None
    try:
        for attempt in range(3):  # the free port can be taken between probe and bind
            port = free_port()
            p = subprocess.Popen(
                [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data), "--silent", "--skipApiVersionCheck", "--loose"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
            if listening(p, port, log_path):
                break
            assert attempt < 2 and "EADDRINUSE" in log_path.read_text(), f"Azurite exited before listening:\n{log_path.read_text()}"
        url = f"http://127.0.0.1:{port}"
        env = {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT, "AZURITE_BLOB_STORAGE_URL": url, "AZURE_ALLOW_HTTP": "true"}
        yield url, env
    finally:
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        log.close()


def container(url: str, name: str):
    from azure.storage.blob import BlobServiceClient

    conn = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={url}/{ACCOUNT};"
    c = BlobServiceClient.from_connection_string(conn).get_container_client(name)
    c.create_container()
    return c


def upload(c, d: pathlib.Path, prefix: str) -> None:
    for f in sorted(d.iterdir()):
        with open(f, "rb") as fh:
            c.upload_blob(f"{prefix}/{f.name}", fh, overwrite=True)


def indexed_in_place(azurite, d: pathlib.Path, name: str, count: int, size: int, seed: int):
    """`count` shards written to `d`, uploaded to container `name` under `ds/` and indexed there
    by `shardwire index az://NAME/ds`; returns the container client."""
    url, env = azurite
    write_uint8_shards(d, count, size, seed=seed)
    c = container(url, name)
    upload(c, d, "ds")
    r = subprocess.run([str(require_bin()), "index", "--quiet", f"az://{name}/ds"], capture_output=True, text=True, timeout=300, env=child_env(env))
    assert r.returncode == 0, r.stderr
    return c


def test_an_azure_dataset_is_indexed_in_place_and_served_byte_exact(sw, azurite, tmp_path):
    env = azurite[1]
    d = tmp_path / "ds"
    c = indexed_in_place(azurite, d, "train", 5, 300_000, seed=21)
    listed = {b.name: b.etag for b in c.list_blobs(name_starts_with="ds/")}
    assert all(not e.startswith('"') for e in listed.values()), listed  # Azure's listing form
    m = json.loads(c.download_blob("ds/shardwire.manifest.json").readall())
    etags = [o["etag"] for o in m["objects"]] if "objects" in m else []
    assert etags and all(e.startswith('"') and e.endswith('"') for e in etags), etags
    # The local copy's manifest, for the expected bytes.
    (d / "shardwire.manifest.json").write_bytes(json.dumps(m).encode())
    src = sw.source({"ds": "az://train/ds"}, env=env)
    node = sw.serve([src], "--pool-size", "64MiB", "--stream-memory", "16MiB")
    wait_ready(node)
    batches = sw.consume(node, "ds")
    assert_exactly_once(batches, len(m["shards"]))
    assert_byte_exact(batches, expected_crcs(d))
    assert node.status()["counters"]["crc_failures"] == 0


def test_a_blob_rewritten_after_indexing_is_refused_by_name_not_delivered(sw, azurite, tmp_path):
    env = azurite[1]
    d = tmp_path / "ds"
    c = indexed_in_place(azurite, d, "rewritten", 3, 100_000, seed=22)
    first = sorted(p.name for p in d.iterdir() if p.name != "shardwire.manifest.json")[0]
    with open(d / first, "rb") as fh:
        c.upload_blob(f"ds/{first}", fh, overwrite=True)  # same bytes, a new ETag
    p = subprocess.run(
        [str(require_bin()), "source", "--listen", "127.0.0.1:0", "--dataset", "ds=az://rewritten/ds"],
        capture_output=True, text=True, timeout=120, env=child_env(env),
    )
    assert p.returncode != 0, p.stdout
    assert "changed since it was indexed" in p.stderr and first in p.stderr, p.stderr[-2000:]
