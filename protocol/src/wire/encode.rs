//! Encoding control frames, refusing any field over the limit its decoder checks.

use std::net::SocketAddr;

use super::*;

/// Why a message could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A field is longer than the protocol allows.
    #[error("field `{field}` length {len} exceeds the limit {max}")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A numeric field is outside the range its decoder accepts.
    #[error("field `{field}` value {value} is outside {range}")]
    Range {
        /// The field.
        field: &'static str,
        /// The value.
        value: u64,
        /// The range the decoder accepts.
        range: &'static str,
    },
    /// A dataset name no source serves (see [`check_dataset_name`]).
    #[error("{0}")]
    DatasetName(DatasetNameError),
    /// A text field holds a control character, which the decoder refuses.
    #[error("{0}")]
    ControlChar(ControlCharError),
    /// An IPv6 address with a scope id (a link-local `fe80::1%eth0`): the wire carries no
    /// scope, and a peer could not dial the address without one.
    #[error(
        "field `{field}` address {addr} has a scope id, which the protocol cannot carry: use an address a peer can dial without one (not link-local)"
    )]
    ScopedAddress {
        /// The field.
        field: &'static str,
        /// The address.
        addr: SocketAddr,
    },
}

/// Appends the frame for `msg` to `out`; on an error `out` is left as it was.
pub fn encode(msg: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, VERSION]);
    if let Err(e) = encode_body(msg, &mut Writer { out }) {
        out.truncate(start);
        return Err(e);
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// Appends the frame of [`Message::Manifest`] up to its `json` bytes, which follow it on the
/// wire as they are (`json_len` of them): a manifest of tens of MiB is written from where it
/// is kept, not copied into a new frame for every node that asks. On an error `out` is left
/// as it was.
pub fn encode_manifest_head(
    req: u64,
    dataset: &str,
    json_len: usize,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, VERSION]);
    if let Err(e) = manifest_head(req, dataset, json_len, &mut Writer { out }) {
        out.truncate(start);
        return Err(e);
    }
    let len = (out.len() - start - 4 + json_len) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// The kind and fields of a `Manifest` up to the `json` blob's length.
fn manifest_head(
    req: u64,
    dataset: &str,
    json_len: usize,
    w: &mut Writer<'_>,
) -> Result<(), EncodeError> {
    w.kind(K_MANIFEST);
    w.u64(req);
    w.dataset(dataset)?;
    check_len("json", json_len, crate::manifest::MAX_MANIFEST_BYTES)?;
    w.u32(json_len as u32);
    Ok(())
}

/// Appends the kind and fields of `msg`.
fn encode_body(msg: &Message, w: &mut Writer<'_>) -> Result<(), EncodeError> {
    match msg {
        Message::Hello {
            node_id,
            nonce,
            lanes,
        } => {
            w.kind(K_HELLO);
            w.string("node_id", node_id, MAX_STR)?;
            w.bytes(nonce);
            w.lanes(lanes)?;
        }
        Message::Challenge {
            nonce,
            auth_required,
        } => {
            w.kind(K_CHALLENGE);
            w.bytes(nonce);
            w.out.push(u8::from(*auth_required));
        }
        Message::Auth { mac } => {
            w.kind(K_AUTH);
            w.bytes(mac);
        }
        Message::Welcome {
            mac,
            idle_timeout_s,
        } => {
            w.kind(K_WELCOME);
            w.bytes(mac);
            if *idle_timeout_s == 0 {
                return Err(EncodeError::Range {
                    field: "idle_timeout_s",
                    value: 0,
                    range: "1..=65535",
                });
            }
            w.u16(*idle_timeout_s);
        }
        Message::ManifestRequest { req, dataset } => {
            w.kind(K_MANIFEST_REQUEST);
            w.u64(*req);
            w.dataset(dataset)?;
        }
        Message::Manifest { req, dataset, json } => {
            manifest_head(*req, dataset, json.len(), w)?;
            w.bytes(json);
        }
        Message::DataConn { lane, conn, addr } => {
            w.kind(K_DATA_CONN);
            w.u16(*lane);
            w.u16(*conn);
            w.addr("addr", addr)?;
        }
        Message::Fetch {
            req,
            dataset,
            shard,
            lane,
        } => {
            w.kind(K_FETCH);
            w.u64(*req);
            w.dataset(dataset)?;
            w.u32(*shard);
            w.u16(*lane);
        }
        Message::Shard {
            req,
            shard,
            length,
            crc32c,
            conn,
            seq,
        } => {
            w.kind(K_SHARD);
            w.u64(*req);
            w.u32(*shard);
            w.u64(*length);
            w.u32(*crc32c);
            w.u16(*conn);
            w.u64(*seq);
        }
        Message::Error {
            req,
            code,
            retry_after_ms,
            message,
        } => {
            w.kind(K_ERROR);
            w.u64(*req);
            w.u16(*code as u16);
            w.u32(*retry_after_ms);
            // Escaped and truncated rather than refused: an error report must always go out.
            let message = printable(message);
            w.string("message", truncated(&message, MAX_STR), MAX_STR)?;
        }
        Message::Cancel { req } => {
            w.kind(K_CANCEL);
            w.u64(*req);
        }
        Message::Ping => w.kind(K_PING),
        Message::Hint {
            stream,
            dataset,
            shards,
        } => {
            w.kind(K_HINT);
            w.u64(*stream);
            w.dataset(dataset)?;
            w.u32_list("shards", shards, MAX_HINT_SHARDS)?;
        }
        Message::DataReady { conn } => {
            w.kind(K_DATA_READY);
            w.u16(*conn);
        }
    }
    Ok(())
}

/// The frame that refuses a peer speaking protocol version `theirs`: an `Error{0,
/// UnsupportedVersion}` that names both versions, written with the peer's version byte and in
/// the layout of `Error` that version reads: version 2's (`req`, `code`, `message`) for 2 and
/// older, with `retry_after_ms` after `code` for 3 and later (versions 4 and 5 changed no message's
/// layout), so the peer can read it.
pub fn version_error_frame(theirs: u8, who: &str) -> Vec<u8> {
    let message = format!(
        "this {who} speaks shardwire protocol version {VERSION}; the peer sent version {theirs}: run the same release on nodes and sources"
    );
    let mut out = Vec::with_capacity(64 + message.len());
    encode(
        &Message::Error {
            req: 0,
            code: ErrorCode::UnsupportedVersion,
            retry_after_ms: 0,
            message,
        },
        &mut out,
    )
    .expect("an error message is truncated to fit");
    // len u32, version u8, kind u8, req u64, code u16, then the 4 bytes of retry_after_ms.
    const RETRY_AT: usize = 4 + 1 + 1 + 8 + 2;
    if theirs <= 2 {
        out.drain(RETRY_AT..RETRY_AT + 4);
    }
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_be_bytes());
    out[4] = theirs;
    out
}

struct Writer<'a> {
    out: &'a mut Vec<u8>,
}

impl Writer<'_> {
    fn kind(&mut self, k: u8) {
        self.out.push(k);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_be_bytes());
    }
    fn string(&mut self, field: &'static str, s: &str, max: usize) -> Result<(), EncodeError> {
        check_len(field, s.len(), max)?;
        check_printable(field, s).map_err(EncodeError::ControlChar)?;
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
        Ok(())
    }
    /// A dataset name, checked as the decoder checks it.
    fn dataset(&mut self, name: &str) -> Result<(), EncodeError> {
        check_len("dataset", name.len(), MAX_DATASET_NAME)?;
        check_dataset_name(name).map_err(EncodeError::DatasetName)?;
        self.string("dataset", name, MAX_DATASET_NAME)
    }
    /// A `u16` count (at most `max`), then the `u32`s.
    fn u32_list(&mut self, field: &'static str, xs: &[u32], max: usize) -> Result<(), EncodeError> {
        check_len(field, xs.len(), max)?;
        self.u16(xs.len() as u16);
        for &x in xs {
            self.u32(x);
        }
        Ok(())
    }
    /// A `Hello`'s lanes: a count (1..=[`MAX_LANES`]), then per lane its address and flows.
    fn lanes(&mut self, lanes: &[LaneAddr]) -> Result<(), EncodeError> {
        // An empty list is refused as the decoder refuses it (a node has at least one lane).
        if lanes.is_empty() || lanes.len() > usize::from(MAX_LANES) {
            return Err(EncodeError::FieldTooLong {
                field: "lanes",
                len: lanes.len(),
                max: usize::from(MAX_LANES),
            });
        }
        self.u16(lanes.len() as u16);
        for l in lanes {
            self.addr("data_addr", &l.data_addr)?;
            if l.flows == 0 || l.flows > MAX_FLOWS {
                return Err(EncodeError::Range {
                    field: "flows",
                    value: l.flows.into(),
                    range: "1..=64 (MAX_FLOWS)",
                });
            }
            self.u16(l.flows);
        }
        Ok(())
    }
    fn addr(&mut self, field: &'static str, a: &SocketAddr) -> Result<(), EncodeError> {
        match a {
            SocketAddr::V4(v4) => {
                self.out.push(4);
                self.bytes(&v4.ip().octets());
            }
            SocketAddr::V6(v6) if v6.scope_id() != 0 => {
                return Err(EncodeError::ScopedAddress { field, addr: *a });
            }
            SocketAddr::V6(v6) => {
                self.out.push(6);
                self.bytes(&v6.ip().octets());
            }
        }
        self.u16(a.port());
        Ok(())
    }
}

/// `len` within `max`, or the error that names `field`.
fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), EncodeError> {
    if len > max {
        return Err(EncodeError::FieldTooLong { field, len, max });
    }
    Ok(())
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn truncated(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_whole_characters() {
        // "é" is 2 bytes: a cut at 3 bytes of "aéé" (5 bytes) falls inside the second one.
        assert_eq!(truncated("aéé", 3), "aé");
        assert_eq!(truncated("aéé", 2), "a");
        assert_eq!(truncated("abc", 10), "abc");
    }

    #[test]
    fn a_long_error_message_goes_out_truncated_not_refused() {
        let message = "é".repeat(MAX_STR); // 2 * MAX_STR bytes
        let mut out = Vec::new();
        let msg = Message::Error {
            req: 1,
            code: ErrorCode::Internal,
            retry_after_ms: 0,
            message,
        };
        encode(&msg, &mut out).expect("an error message always encodes");
        let Ok(Decoded::Message(Message::Error { message, .. }, _)) = decode(&out) else {
            panic!("the truncated error frame does not decode");
        };
        assert_eq!(message.len(), MAX_STR);
        assert!(message.chars().all(|c| c == 'é'));
    }
}
