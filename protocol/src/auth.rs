//! Shared-secret challenge-response for control connections.
//!
//! Both sides send a random 32-byte nonce (the node's in its `Hello`, the source's in its
//! `Challenge`). Each proof is an HMAC-SHA256 under the secret over the handshake's
//! [`transcript`] (a hash of the `Hello` and the `Challenge` as encoded: both nonces, the
//! node's lanes and id, `auth_required`): the node's under the label `"shardwire-node"`, the
//! source's under `"shardwire-source"` with the `Welcome`'s `idle_timeout_s`. So the
//! authentication is mutual, the secret never crosses the wire, and a relay between a node and
//! a source cannot change what either said (before protocol version 4 only the nonces were
//! covered: a relay could rewrite the `Hello`'s lanes and have the source send a dataset to its
//! own data addresses with the node's valid proof).

use sha2::{Digest, Sha256};

/// Length of nonces and MACs.
pub const NONCE_LEN: usize = 32;

/// Which side computes the proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The node service (the dialler of the control connection).
    Node,
    /// The shard source.
    Source,
}

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
pub fn hmac_sha256(key: &[u8], msg: &[&[u8]]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for part in msg {
        inner.update(part);
    }
    let inner = inner.finalize();
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner);
    outer.finalize().into()
}

/// The handshake's transcript: SHA-256 over a label and the `Hello` and `Challenge` frames as
/// encoded (`wire::encode`, length-prefixed here), which both proofs cover.
pub fn transcript(hello: &[u8], challenge: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"shardwire-handshake-v4");
    for frame in [hello, challenge] {
        h.update((frame.len() as u64).to_be_bytes());
        h.update(frame);
    }
    h.finalize().into()
}

/// The proof `role` sends for handshake `transcript`; the source's covers the `Welcome`'s
/// `idle_timeout_s` too (`idle` is ignored for the node's).
pub fn proof(secret: &[u8], role: Role, transcript: &[u8; 32], idle: u16) -> [u8; 32] {
    match role {
        Role::Node => hmac_sha256(secret, &[b"shardwire-node", transcript]),
        Role::Source => hmac_sha256(
            secret,
            &[b"shardwire-source", transcript, &idle.to_be_bytes()],
        ),
    }
}

/// Constant-time equality for MACs and tokens.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads a secret file: its content with surrounding whitespace removed; empty is an error.
pub fn parse_secret(content: &[u8]) -> Option<Vec<u8>> {
    let s = content.trim_ascii();
    (!s.is_empty()).then(|| s.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn rfc4231_case_2() {
        let mac = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            hex(&mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn rfc4231_case_6_long_key() {
        let key = [0xaau8; 131];
        let mac = hmac_sha256(
            &key,
            &[b"Test Using Larger Than Block-Size Key - Hash Key First"],
        );
        assert_eq!(
            hex(&mac),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn roles_transcripts_and_the_idle_timeout_matter() {
        let (hello, challenge) = (b"hello-frame".as_slice(), b"challenge-frame".as_slice());
        let t = transcript(hello, challenge);
        let p = proof(b"s", Role::Node, &t, 0);
        assert_ne!(p, proof(b"s", Role::Source, &t, 0));
        assert_ne!(p, proof(b"t", Role::Node, &t, 0));
        assert!(
            ct_eq(&p, &proof(b"s", Role::Node, &t, 9)),
            "the node's ignores idle"
        );
        // Before, only the nonces were covered: a Hello with other lanes and the same nonce
        // had the same proof.
        let relayed = transcript(b"hello-frame with other lanes", challenge);
        assert_ne!(p, proof(b"s", Role::Node, &relayed, 0));
        // The frames are delimited: moving bytes between them changes the transcript.
        assert_ne!(t, transcript(b"hello-framec", b"hallenge-frame"));
        let w = proof(b"s", Role::Source, &t, 300);
        assert_ne!(
            w,
            proof(b"s", Role::Source, &t, 1),
            "the Welcome's idle timeout"
        );
    }

    #[test]
    fn secret_file_parsing() {
        assert_eq!(parse_secret(b"  abc\n"), Some(b"abc".to_vec()));
        assert_eq!(parse_secret(b" \n"), None);
    }
}
