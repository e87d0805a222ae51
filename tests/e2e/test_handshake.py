"""The control handshake's proofs (docs/PROTOCOL.md, "Handshake and authentication"), checked
by a second implementation (Python's hmac and hashlib) against a real source: both proofs
cover the handshake's transcript (the `Hello` and the `Challenge` as encoded) and the source's
the `Welcome`'s idle timeout too, so a relay cannot rewrite what a node said."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import faults as F
from conftest import index_dataset, write_uint8_shards

SECRET = b"correct horse battery staple"
AUTH_FAILED = 2


def _transcript(hello: bytes, challenge: bytes) -> bytes:
    h = hashlib.sha256(b"shardwire-handshake-v4")
    for frame in (hello, challenge):
        h.update(struct.pack(">Q", len(frame)))
        h.update(frame)
    return h.digest()


def _mac(label: bytes, *parts: bytes) -> bytes:
    return hmac.new(SECRET, label + b"".join(parts), hashlib.sha256).digest()


def _challenge(ctl: socket.socket, hello: bytes) -> bytes:
    """Sends `hello`; the source's Challenge frame as it was encoded."""
    ctl.sendall(hello)
    kind, body = F.read_control(ctl, 5.0)
    assert kind == F.CHALLENGE, (kind, body)
    return F.control_frame(F.CHALLENGE, body)


def test_a_proof_made_for_another_hello_is_refused_and_a_true_one_welcomed(sw, tmp_path):
    """A relay that rewrites a node's Hello (its lanes: where the source sends the dataset),
    keeping the nonce, and forwards the node's proof: refused `AuthFailed`. Before protocol
    version 4 the proofs covered the nonces only, and the relayed Hello was welcomed (the source
    then dialled the relay's data address). The node's own Hello with its proof is welcomed, and
    the source's proof checks out over the same transcript and the Welcome's idle timeout."""
    d = tmp_path / "ds"
    write_uint8_shards(d, 1, 4096, seed=1)
    index_dataset(d)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    os.chmod(secret, 0o600)
    src = sw.source({"f": d}, "--secret-file", secret)

    node_hello = F.hello(node_id="proof-node", data_addr=("127.0.0.1", 9))
    relayed = F.hello(node_id="proof-node", data_addr=("127.0.0.2", 9))  # same nonce, other lane
    with F.connect(src.addr) as ctl:
        challenge = _challenge(ctl, relayed)
        # The proof the real node made, over the Hello it sent and this Challenge.
        ctl.sendall(F.control_frame(F.AUTH, _mac(b"shardwire-node", _transcript(node_hello, challenge))))
        r = F.read_control(ctl, 5.0)
        assert isinstance(r, tuple) and r[0] == F.ERROR, f"a relayed Hello was not refused: {r}"
        assert F.error_code(r[1])[1] == AUTH_FAILED, F.error_code(r[1])

    with F.connect(src.addr) as ctl:
        t = _transcript(node_hello, _challenge(ctl, node_hello))
        ctl.sendall(F.control_frame(F.AUTH, _mac(b"shardwire-node", t)))
        kind, body = F.read_control(ctl, 5.0)
        assert kind == F.WELCOME, (kind, body)
        mac, (idle,) = body[:32], struct.unpack(">H", body[32:34])
        assert idle >= 1
        assert hmac.compare_digest(mac, _mac(b"shardwire-source", t, struct.pack(">H", idle))), "the source's proof"
        assert not hmac.compare_digest(mac, _mac(b"shardwire-source", t, struct.pack(">H", idle + 1)))
