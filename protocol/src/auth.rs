//! Shared-secret challenge-response for control connections.
//!
//! Both sides send a random 32-byte nonce. The node proves knowledge of the secret with
//! `HMAC-SHA256(secret, "shardwire-node" || node_nonce || source_nonce)` and the source
//! answers with the same construction under the label `"shardwire-source"`, so the
//! authentication is mutual and the secret never crosses the wire.

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

/// The proof `role` sends for this pair of nonces.
pub fn proof(
    secret: &[u8],
    role: Role,
    node_nonce: &[u8; NONCE_LEN],
    source_nonce: &[u8; NONCE_LEN],
) -> [u8; 32] {
    let label: &[u8] = match role {
        Role::Node => b"shardwire-node",
        Role::Source => b"shardwire-source",
    };
    hmac_sha256(secret, &[label, node_nonce, source_nonce])
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
    fn roles_and_nonces_matter() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let p = proof(b"s", Role::Node, &a, &b);
        assert_ne!(p, proof(b"s", Role::Source, &a, &b));
        assert_ne!(p, proof(b"s", Role::Node, &b, &a));
        assert_ne!(p, proof(b"t", Role::Node, &a, &b));
        assert!(ct_eq(&p, &proof(b"s", Role::Node, &a, &b)));
    }

    #[test]
    fn secret_file_parsing() {
        assert_eq!(parse_secret(b"  abc\n"), Some(b"abc".to_vec()));
        assert_eq!(parse_secret(b" \n"), None);
    }
}
