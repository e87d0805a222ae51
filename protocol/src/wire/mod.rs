//! Control-connection messages between a node service and a shard source.
//!
//! Frame: `len: u32 BE | version: u8 | kind: u8 | body`, where `len` counts the version, kind
//! and body bytes. Integers are big-endian; strings are `u16` length + UTF-8; byte blobs are
//! `u32` length + bytes; socket addresses are `family: u8 (4|6) | ip | port: u16`.
//! Every length is checked against a hard limit before anything is allocated, and a decoder
//! given any byte string returns a message, "need more bytes", or a typed [`DecodeError`].
//! The full description is docs/PROTOCOL.md.

use std::net::SocketAddr;

mod decode;
mod encode;
#[cfg(test)]
mod tests;

pub use decode::{DecodeError, Decoded, check_frame_len, decode, decode_frame};
pub use encode::{EncodeError, encode, encode_manifest_head, version_error_frame};

/// The handshake's transcript ([`crate::auth::transcript`]) of a `Hello` and a `Challenge`
/// as they go on the wire: each side encodes both (the one it sent and the one it received;
/// decoding is strict, so both encode to the bytes that were sent).
pub fn handshake_transcript(hello: &Message, challenge: &Message) -> Result<[u8; 32], EncodeError> {
    let (mut h, mut c) = (Vec::new(), Vec::new());
    encode(hello, &mut h)?;
    encode(challenge, &mut c)?;
    Ok(crate::auth::transcript(&h, &c))
}

use crate::auth::NONCE_LEN;

/// The protocol version this build speaks (2: manifest requests carry a request id; Cancel
/// and Ping. 3: `Hint`, the object-storage error codes, `Draining` and `Error::retry_after_ms`;
/// lanes: `Hello` lists every lane's data address and flows, `DataConn` and `Fetch` name the lane;
/// `DataReady`. 4: the handshake's proofs cover the `Hello`, the `Challenge` and the
/// `Welcome`'s idle timeout, not only the nonces: [`crate::auth::transcript`]. 5: a node reports a
/// payload that failed its CRC-32C to the source that sent it, an `Error` with the FETCH's
/// `req` and `ChecksumMismatch`, and the source checks what it served again).
pub const VERSION: u8 = 5;
/// Largest frame body (the manifest is the only large message).
pub const MAX_FRAME: usize = 64 << 20;
/// Largest frame a node ever sends, and the largest a source accepts: a `Hello` with the
/// longest node id and 64 IPv6 lanes is about 5.4 KiB. The node also holds a source to it until the handshake
/// is done, so an unauthenticated peer can make neither side buffer more than this.
pub const MAX_SMALL_FRAME: usize = 8 << 10;
/// Largest string field (dataset names, node ids, error messages).
pub const MAX_STR: usize = 4096;
/// Largest dataset name.
pub const MAX_DATASET_NAME: usize = 255;
/// Largest number of data connections a node may ask for, per lane.
pub const MAX_FLOWS: u16 = 64;
/// Most shards one [`Message::Hint`] names (4 KiB of indices: the hint stays a small frame).
pub const MAX_HINT_SHARDS: usize = 1024;
/// Largest number of lanes a `Hello` may list (data connections are numbered across all of
/// them, at most `MAX_LANES * MAX_FLOWS`).
pub const MAX_LANES: u16 = 64;

/// Most data connections a source dials for one node session, over all of the `Hello`'s
/// lanes (the sum of their `flows`): each is a sender thread and a socket on the source. The
/// wire allows `MAX_LANES * MAX_FLOWS`; a source refuses a `Hello` that asks for more than
/// this, so a node refuses to start with lanes x `flows` above it (its `ServeConfig`
/// validation too, for a `lanes` table: `shardwire_config::MAX_SESSION_FLOWS`, held equal by
/// the node's tests). 8 lanes of 32 flows.
pub const MAX_SESSION_FLOWS: u64 = 256;

/// The least a data connection carries while payload bytes are due on it: a node drops one
/// that brings fewer than this many bytes in a [`DATA_PACE_WINDOW`] (a source sending at a
/// trickle), and a source warns when its `rate_limit` leaves a connection less.
pub const DATA_PACE_FLOOR: u64 = 1 << 20;
/// The window [`DATA_PACE_FLOOR`] is for.
pub const DATA_PACE_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// The `addr` of a [`Message::DataConn`] for a connection the source could not dial
/// (`0.0.0.0:0`, never the local address of a connected socket): the session goes on with the
/// lane's other connections, and without the lane where it has none. A node of an earlier
/// release takes it for a connection that never arrives and ends the session, as a source of
/// an earlier release would have.
pub const NOT_DIALLED: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::UNSPECIFIED,
    0,
));

/// One lane of a node as its `Hello` lists it: where the source dials it, and how often.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneAddr {
    /// The lane's data address, as the source should dial it.
    pub data_addr: SocketAddr,
    /// How many data connections the source opens to it (1..=[`MAX_FLOWS`]).
    pub flows: u16,
}

/// The data connections of `lanes`, numbered across all of them in lane order: lane 0's are
/// `0..flows0`, lane 1's follow, and so on. Returns the lane of each connection.
pub fn conn_lanes(lanes: &[LaneAddr]) -> Vec<u16> {
    lanes
        .iter()
        .enumerate()
        .flat_map(|(i, l)| std::iter::repeat_n(i as u16, l.flows as usize))
        .collect()
}

/// Why a dataset name cannot be used (the same rule on the source, the node's APIs and the
/// wire, so a name that passes here can always be encoded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DatasetNameError {
    /// The name is empty.
    #[error("field `dataset` is empty; give a dataset name")]
    Empty,
    /// Over [`MAX_DATASET_NAME`] bytes (the name itself is not repeated: it may be huge).
    #[error("field `dataset` is {len} bytes long; the limit is {MAX_DATASET_NAME}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("field `dataset` (`{name}`) has the character {ch:?}; allowed are [A-Za-z0-9._-]")]
    BadChar {
        /// The name.
        name: String,
        /// The first character not allowed.
        ch: char,
    },
    /// `.` or `..`: names of directories (a source keeps a dataset's cache in a directory of
    /// its name).
    #[error(
        "field `dataset` is `{name}`, which names a directory; use a name with a letter or digit"
    )]
    DotName {
        /// The name.
        name: String,
    },
}

/// Checks a dataset name: 1..=[`MAX_DATASET_NAME`] bytes of `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn check_dataset_name(name: &str) -> Result<(), DatasetNameError> {
    if name.is_empty() {
        return Err(DatasetNameError::Empty);
    }
    if name.len() > MAX_DATASET_NAME {
        return Err(DatasetNameError::TooLong { len: name.len() });
    }
    if name == "." || name == ".." {
        return Err(DatasetNameError::DotName { name: name.into() });
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(ch) => Err(DatasetNameError::BadChar {
            name: name.into(),
            ch,
        }),
        None => Ok(()),
    }
}

/// A text field (`node_id`, `message`) holds a control character (a newline, an escape, a
/// DEL): a peer's text is logged and shown to operators, where such a character could forge a
/// line or a terminal command, so the wire carries printable text only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "field `{field}` has the control character U+{code:04X} at byte {at}: the protocol carries printable text only"
)]
pub struct ControlCharError {
    /// The field.
    pub field: &'static str,
    /// The character's code point.
    pub code: u32,
    /// Its byte offset in the field.
    pub at: usize,
}

fn first_control(text: &str) -> Option<(usize, char)> {
    text.char_indices().find(|&(_, c)| is_control(c))
}

/// A control character (C0, DEL, C1), a line or paragraph separator (U+2028, U+2029: line
/// breaks to some log viewers) or a bidirectional override or isolate (U+202A-U+202E,
/// U+2066-U+2069: they reorder what a terminal shows).
fn is_control(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Checks that `text`, the value of `field`, holds no control character.
pub(crate) fn check_printable(field: &'static str, text: &str) -> Result<(), ControlCharError> {
    match first_control(text) {
        Some((at, c)) => Err(ControlCharError {
            field,
            code: c.into(),
            at,
        }),
        None => Ok(()),
    }
}

/// `text` with each control character written as its Rust escape (`\n`, `\u{1b}`), so an
/// error report that quotes a file name or a peer's bytes still goes out, as printable text.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if first_control(text).is_none() {
        return text.into();
    }
    text.chars()
        .map(|c| match is_control(c) {
            true => c.escape_default().to_string(),
            false => c.to_string(),
        })
        .collect::<String>()
        .into()
}

/// serde_json's message for `e` with each control character escaped ([`printable`]): it may
/// quote a peer's key or tag (a trainer's message, a source's manifest) with its JSON escapes
/// decoded, whose `\n` or `\r` would otherwise start a forged line in a text log.
pub(crate) fn json_error_text(e: &serde_json::Error) -> String {
    printable(&e.to_string()).into_owned()
}

/// Error codes carried by [`Message::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// The peer speaks a protocol version we do not.
    UnsupportedVersion = 1,
    /// Authentication failed or was required and missing.
    AuthFailed = 2,
    /// The dataset is not served here.
    UnknownDataset = 3,
    /// The shard index is out of range.
    UnknownShard = 4,
    /// A message arrived that is not valid in the current state.
    BadRequest = 5,
    /// The source could not read the shard from its storage.
    ReadFailed = 6,
    /// Anything else; the message says what.
    Internal = 7,
    /// The request was cancelled by the node before the source sent anything for it.
    Cancelled = 8,
    /// The object store throttled the source's reads (503 SlowDown / 429) after its retry
    /// budget; `Error::retry_after_ms` says when to ask again.
    Throttled = 9,
    /// The object store failed or timed out after the source's retries.
    StorageUnavailable = 10,
    /// The object store refused the source's credentials, or an http(s) server refused
    /// access (401/403).
    StorageAuth = 11,
    /// An object the manifest names does not exist (a stale manifest).
    ObjectNotFound = 12,
    /// An object changed since it was indexed (its ETag differs): nothing of it is sent.
    DatasetChanged = 13,
    /// The bytes read from the store do not match the manifest's CRC-32C (after one more read).
    ChecksumMismatch = 14,
    /// The source is draining (it got SIGTERM): it takes no new FETCH and finishes the ones it
    /// queued. With `req` 0 it tells the node once, so the node sends it nothing new; for a
    /// FETCH that crossed that notice it refuses that FETCH, to be fetched from another source.
    Draining = 15,
}

impl ErrorCode {
    fn from_u16(v: u16) -> Result<Self, DecodeError> {
        Ok(match v {
            1 => Self::UnsupportedVersion,
            2 => Self::AuthFailed,
            3 => Self::UnknownDataset,
            4 => Self::UnknownShard,
            5 => Self::BadRequest,
            6 => Self::ReadFailed,
            7 => Self::Internal,
            8 => Self::Cancelled,
            9 => Self::Throttled,
            10 => Self::StorageUnavailable,
            11 => Self::StorageAuth,
            12 => Self::ObjectNotFound,
            13 => Self::DatasetChanged,
            14 => Self::ChecksumMismatch,
            15 => Self::Draining,
            other => return Err(DecodeError::UnknownErrorCode(other)),
        })
    }
}

/// One control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// node -> source, first message: who we are, and per lane where to dial data
    /// connections and how many.
    Hello {
        /// Free-form node identity for logs.
        node_id: String,
        /// The node's challenge.
        nonce: [u8; NONCE_LEN],
        /// The node's lanes, lane `i` at index `i` (1..=[`MAX_LANES`]).
        lanes: Vec<LaneAddr>,
    },
    /// source -> node: the source's challenge, and whether it checks the secret.
    Challenge {
        /// The source's challenge.
        nonce: [u8; NONCE_LEN],
        /// False when the source runs without a secret (loopback-only).
        auth_required: bool,
    },
    /// node -> source: proof of the secret (all zeros when the node has none).
    Auth {
        /// `auth::proof(secret, Node, ..)`.
        mac: [u8; 32],
    },
    /// source -> node: handshake accepted, with the source's proof.
    Welcome {
        /// `auth::proof(secret, Source, ..)`, zeros without a secret.
        mac: [u8; 32],
        /// Each side drops the connection when it has heard nothing for this many seconds
        /// (at least 1); each sends `Ping` when it has been quiet for a third of it.
        idle_timeout_s: u16,
    },
    /// node -> source: send me this dataset's manifest.
    ManifestRequest {
        /// Request id chosen by the node, echoed in the `Manifest` or `Error` answer.
        req: u64,
        /// Dataset name.
        dataset: String,
    },
    /// source -> node: the manifest JSON as written by `shardwire index`.
    Manifest {
        /// Request id of the `ManifestRequest`.
        req: u64,
        /// Dataset name.
        dataset: String,
        /// The manifest file's bytes.
        json: Vec<u8>,
    },
    /// source -> node: "I dialled lane `lane`'s data address from `addr`; call it connection
    /// `conn`". With `addr` [`NOT_DIALLED`]: "I could not dial connection `conn` of lane
    /// `lane`; this session goes on without it" (an `Error{req 0}` before it says why).
    DataConn {
        /// The lane it was dialled for.
        lane: u16,
        /// Connection number, across all lanes ([`conn_lanes`]).
        conn: u16,
        /// The source's local address of that connection, or [`NOT_DIALLED`].
        addr: SocketAddr,
    },
    /// node -> source: send shard `shard` of `dataset` on a data connection of lane `lane`.
    Fetch {
        /// Request id chosen by the node, echoed in the announcement.
        req: u64,
        /// Dataset name.
        dataset: String,
        /// Shard index in the manifest.
        shard: u32,
        /// The lane whose connections must carry the payload.
        lane: u16,
    },
    /// source -> node: the payload of `req` follows on data connection `conn`, as its
    /// `seq`-th payload on that connection, `length` bytes with CRC-32C `crc32c`.
    Shard {
        /// Request id of the FETCH.
        req: u64,
        /// Shard index.
        shard: u32,
        /// Payload length in bytes.
        length: u64,
        /// CRC-32C of the payload, from the manifest.
        crc32c: u32,
        /// Data connection carrying the bytes.
        conn: u16,
        /// Position of this payload on that connection, from 0.
        seq: u64,
    },
    /// Either direction: something went wrong; `req` is 0 when not about a request.
    Error {
        /// The request this is about, or 0.
        req: u64,
        /// What kind of failure.
        code: ErrorCode,
        /// Ask again no sooner than this many milliseconds from now (0: no advice; set with
        /// [`ErrorCode::Throttled`]).
        retry_after_ms: u32,
        /// Human-readable detail.
        message: String,
    },
    /// node -> source: drop FETCH `req` if its payload has not been announced yet (the
    /// stream it was for is gone). The source answers `Error{req, Cancelled}` when it
    /// dropped it; a FETCH already announced is sent in full as announced.
    Cancel {
        /// Request id of the FETCH.
        req: u64,
    },
    /// Either direction: keepalive, sent when a side has sent nothing else for a while, so
    /// that each side can time out a peer that went silent.
    Ping,
    /// node -> source: the shards of `dataset` that stream `stream` will FETCH from this
    /// source next, in the order it will ask (at most [`MAX_HINT_SHARDS`]). It replaces the
    /// stream's previous hint for the dataset; an empty list withdraws it. A source that reads
    /// from object storage prefetches in this order and keeps its cache by it; one that does
    /// not may ignore it. A hint asks for nothing: only a `Fetch` is answered.
    Hint {
        /// The node's stream id (scopes the hint; hints of other streams stand).
        stream: u64,
        /// Dataset name.
        dataset: String,
        /// Shard indices, soonest first.
        shards: Vec<u32>,
    },
    /// node -> source: data connection `conn` is identified and ready for payloads (on a
    /// devmem lane, its flow is steered to its lane's queues). The source announces and sends
    /// no payload on a connection before this (TCPX's CONN_OK gate): bytes that arrived
    /// before the steering rule could land in another GPU's memory.
    DataReady {
        /// The connection number (across lanes, as in `DataConn`).
        conn: u16,
    },
}

const K_HELLO: u8 = 1;
const K_CHALLENGE: u8 = 2;
const K_AUTH: u8 = 3;
const K_WELCOME: u8 = 4;
const K_MANIFEST_REQUEST: u8 = 5;
const K_MANIFEST: u8 = 6;
const K_DATA_CONN: u8 = 7;
const K_FETCH: u8 = 8;
const K_SHARD: u8 = 9;
const K_ERROR: u8 = 10;
const K_CANCEL: u8 = 11;
const K_PING: u8 = 12;
const K_HINT: u8 = 13;
const K_DATA_READY: u8 = 14;
