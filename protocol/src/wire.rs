//! Control-connection messages between a node service and a shard source.
//!
//! Frame: `len: u32 BE | version: u8 | kind: u8 | body`, where `len` counts the version, kind
//! and body bytes. Integers are big-endian; strings are `u16` length + UTF-8; byte blobs are
//! `u32` length + bytes; socket addresses are `family: u8 (4|6) | ip | port: u16`.
//! Every length is checked against a hard limit before anything is allocated, and a decoder
//! given any byte string returns a message, "need more bytes", or a typed [`DecodeError`].
//! The full description is docs/PROTOCOL.md.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::auth::NONCE_LEN;

/// The protocol version this build speaks (2: manifest requests carry a request id; Cancel
/// and Ping. 3: `Hint`, the object-storage error codes, `Draining` and `Error::retry_after_ms`;
/// lanes: `Hello` lists every lane's data address and flows, `DataConn` and `Fetch` name the lane;
/// `DataReady`).
pub const VERSION: u8 = 3;
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
}

/// Checks a dataset name: 1..=[`MAX_DATASET_NAME`] bytes of `[A-Za-z0-9._-]`.
pub fn check_dataset_name(name: &str) -> Result<(), DatasetNameError> {
    if name.is_empty() {
        return Err(DatasetNameError::Empty);
    }
    if name.len() > MAX_DATASET_NAME {
        return Err(DatasetNameError::TooLong { len: name.len() });
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
    /// The object store refused the source's credentials.
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
    /// `conn`".
    DataConn {
        /// The lane it was dialled for.
        lane: u16,
        /// Connection number, across all lanes ([`conn_lanes`]).
        conn: u16,
        /// The source's local address of that connection.
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

/// Why bytes did not decode to a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame length is below the 2-byte minimum or above [`MAX_FRAME`].
    #[error("frame length {0} is outside 2..={MAX_FRAME}")]
    FrameLength(usize),
    /// The version byte is not one we speak.
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    Version(u8),
    /// The kind byte names no message.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The body ended before a field did.
    #[error("message kind {kind} is truncated: field `{field}` needs more bytes")]
    Truncated {
        /// Message kind.
        kind: u8,
        /// The field being read.
        field: &'static str,
    },
    /// Bytes were left over after the last field.
    #[error("message kind {kind} has {extra} trailing bytes")]
    Trailing {
        /// Message kind.
        kind: u8,
        /// How many bytes.
        extra: usize,
    },
    /// A length field is above its limit.
    #[error("field `{field}` length {len} exceeds the limit {max}")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Its declared length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A string is not UTF-8.
    #[error("field `{0}` is not valid UTF-8")]
    Utf8(&'static str),
    /// An address family byte is not 4 or 6.
    #[error("address family {0} is not 4 or 6")]
    AddressFamily(u8),
    /// A boolean byte is not 0 or 1.
    #[error("field `{field}` has boolean byte {value}")]
    Bool {
        /// The field.
        field: &'static str,
        /// The byte.
        value: u8,
    },
    /// An error code we do not know.
    #[error("unknown error code {0}")]
    UnknownErrorCode(u16),
    /// A numeric field is out of range.
    #[error("field `{field}` value {value} is out of range")]
    Range {
        /// The field.
        field: &'static str,
        /// The value.
        value: u64,
    },
}

/// Outcome of [`decode`] on a buffer that may hold a partial frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A whole message, and how many bytes of the buffer it used.
    Message(Message, usize),
    /// The buffer holds part of a frame; at least this many more bytes are needed.
    NeedMore(usize),
}

/// Decodes the first frame in `buf`.
pub fn decode(buf: &[u8]) -> Result<Decoded, DecodeError> {
    let Some(hdr) = buf.get(..4) else {
        return Ok(Decoded::NeedMore(4 - buf.len()));
    };
    let len = u32::from_be_bytes(hdr.try_into().expect("4 bytes")) as usize;
    if !(2..=MAX_FRAME).contains(&len) {
        return Err(DecodeError::FrameLength(len));
    }
    let Some(frame) = buf.get(4..4 + len) else {
        return Ok(Decoded::NeedMore(4 + len - buf.len()));
    };
    let msg = decode_frame(frame)?;
    Ok(Decoded::Message(msg, 4 + len))
}

/// Checks a frame header (`len` bytes that follow) without needing the body yet.
pub fn check_frame_len(len: u32) -> Result<usize, DecodeError> {
    let len = len as usize;
    if (2..=MAX_FRAME).contains(&len) {
        Ok(len)
    } else {
        Err(DecodeError::FrameLength(len))
    }
}

/// Decodes one frame body (the bytes after the 4-byte length).
pub fn decode_frame(frame: &[u8]) -> Result<Message, DecodeError> {
    let (&version, rest) = frame.split_first().ok_or(DecodeError::FrameLength(0))?;
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let (&kind, body) = rest.split_first().ok_or(DecodeError::FrameLength(1))?;
    let mut r = Reader { buf: body, kind };
    let msg = match kind {
        K_HELLO => Message::Hello {
            node_id: r.string("node_id", MAX_STR)?,
            nonce: r.array("nonce")?,
            lanes: r.lanes()?,
        },
        K_CHALLENGE => Message::Challenge {
            nonce: r.array("nonce")?,
            auth_required: r.bool("auth_required")?,
        },
        K_AUTH => Message::Auth {
            mac: r.array("mac")?,
        },
        K_WELCOME => Message::Welcome {
            mac: r.array("mac")?,
            idle_timeout_s: match r.u16("idle_timeout_s")? {
                0 => {
                    return Err(DecodeError::Range {
                        field: "idle_timeout_s",
                        value: 0,
                    });
                }
                t => t,
            },
        },
        K_MANIFEST_REQUEST => Message::ManifestRequest {
            req: r.u64("req")?,
            dataset: r.string("dataset", MAX_DATASET_NAME)?,
        },
        K_MANIFEST => Message::Manifest {
            req: r.u64("req")?,
            dataset: r.string("dataset", MAX_DATASET_NAME)?,
            json: r.blob("json", MAX_FRAME)?,
        },
        K_DATA_CONN => Message::DataConn {
            lane: r.u16("lane")?,
            conn: r.u16("conn")?,
            addr: r.addr("addr")?,
        },
        K_FETCH => Message::Fetch {
            req: r.u64("req")?,
            dataset: r.string("dataset", MAX_DATASET_NAME)?,
            shard: r.u32("shard")?,
            lane: r.u16("lane")?,
        },
        K_SHARD => Message::Shard {
            req: r.u64("req")?,
            shard: r.u32("shard")?,
            length: r.u64("length")?,
            crc32c: r.u32("crc32c")?,
            conn: r.u16("conn")?,
            seq: r.u64("seq")?,
        },
        K_ERROR => Message::Error {
            req: r.u64("req")?,
            code: ErrorCode::from_u16(r.u16("code")?)?,
            retry_after_ms: r.u32("retry_after_ms")?,
            message: r.string("message", MAX_STR)?,
        },
        K_CANCEL => Message::Cancel { req: r.u64("req")? },
        K_PING => Message::Ping,
        K_HINT => Message::Hint {
            stream: r.u64("stream")?,
            dataset: r.string("dataset", MAX_DATASET_NAME)?,
            shards: r.u32_list("shards", MAX_HINT_SHARDS)?,
        },
        K_DATA_READY => Message::DataReady {
            conn: r.u16("conn")?,
        },
        other => return Err(DecodeError::UnknownKind(other)),
    };
    if !r.buf.is_empty() {
        return Err(DecodeError::Trailing {
            kind,
            extra: r.buf.len(),
        });
    }
    Ok(msg)
}

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
}

/// Appends the frame for `msg` to `out`.
pub fn encode(msg: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, VERSION]);
    let mut w = Writer { out };
    match msg {
        Message::Hello {
            node_id,
            nonce,
            lanes,
        } => {
            w.kind(K_HELLO);
            w.string("node_id", node_id, MAX_STR)?;
            w.bytes(nonce);
            if lanes.is_empty() || lanes.len() > usize::from(MAX_LANES) {
                return Err(EncodeError::FieldTooLong {
                    field: "lanes",
                    len: lanes.len(),
                    max: usize::from(MAX_LANES),
                });
            }
            w.u16(lanes.len() as u16);
            for l in lanes {
                w.addr(&l.data_addr);
                w.u16(l.flows);
            }
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
            w.u16(*idle_timeout_s);
        }
        Message::ManifestRequest { req, dataset } => {
            w.kind(K_MANIFEST_REQUEST);
            w.u64(*req);
            w.string("dataset", dataset, MAX_DATASET_NAME)?;
        }
        Message::Manifest { req, dataset, json } => {
            w.kind(K_MANIFEST);
            w.u64(*req);
            w.string("dataset", dataset, MAX_DATASET_NAME)?;
            if json.len() > MAX_FRAME - 512 {
                return Err(EncodeError::FieldTooLong {
                    field: "json",
                    len: json.len(),
                    max: MAX_FRAME - 512,
                });
            }
            w.u32(json.len() as u32);
            w.bytes(json);
        }
        Message::DataConn { lane, conn, addr } => {
            w.kind(K_DATA_CONN);
            w.u16(*lane);
            w.u16(*conn);
            w.addr(addr);
        }
        Message::Fetch {
            req,
            dataset,
            shard,
            lane,
        } => {
            w.kind(K_FETCH);
            w.u64(*req);
            w.string("dataset", dataset, MAX_DATASET_NAME)?;
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
            // Truncate rather than fail: an error report must always go out.
            let mut end = message.len().min(MAX_STR);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            w.string("message", &message[..end], MAX_STR)?;
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
            w.string("dataset", dataset, MAX_DATASET_NAME)?;
            if shards.len() > MAX_HINT_SHARDS {
                return Err(EncodeError::FieldTooLong {
                    field: "shards",
                    len: shards.len(),
                    max: MAX_HINT_SHARDS,
                });
            }
            w.u16(shards.len() as u16);
            for &x in shards {
                w.u32(x);
            }
        }
        Message::DataReady { conn } => {
            w.kind(K_DATA_READY);
            w.u16(*conn);
        }
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// The frame that refuses a peer speaking protocol version `theirs`: an `Error{0,
/// UnsupportedVersion}` that names both versions, written with the peer's version byte and in
/// version 2's layout of `Error` (`req`, `code`, `message`; version 3 added `retry_after_ms`
/// after `code`), the layout every version reads a refusal in, so the peer can read it.
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
    out.drain(RETRY_AT..RETRY_AT + 4);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_be_bytes());
    out[4] = theirs;
    out
}

struct Reader<'a> {
    buf: &'a [u8],
    kind: u8,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated {
                kind: self.kind,
                field,
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        Ok(self.take(N, field)?.try_into().expect("length checked"))
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }
    /// A `u16` count, checked against `max` before anything is allocated, then the `u32`s.
    fn u32_list(&mut self, field: &'static str, max: usize) -> Result<Vec<u32>, DecodeError> {
        let len = self.u16(field)? as usize;
        if len > max {
            return Err(DecodeError::FieldTooLong { field, len, max });
        }
        let raw = self.take(len * 4, field)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
    fn bool(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(DecodeError::Bool { field, value }),
        }
    }
    fn string(&mut self, field: &'static str, max: usize) -> Result<String, DecodeError> {
        let len = self.u16(field)? as usize;
        if len > max {
            return Err(DecodeError::FieldTooLong { field, len, max });
        }
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| DecodeError::Utf8(field))
    }
    fn blob(&mut self, field: &'static str, max: usize) -> Result<Vec<u8>, DecodeError> {
        let len = self.u32(field)? as usize;
        if len > max {
            return Err(DecodeError::FieldTooLong { field, len, max });
        }
        Ok(self.take(len, field)?.to_vec())
    }
    /// A `Hello`'s lanes: a count (1..=[`MAX_LANES`]), then per lane an address and its
    /// flows (1..=[`MAX_FLOWS`]). At most [`MAX_LANES`] entries are allocated, whatever the
    /// bytes claim: a count past the bytes fails as truncated.
    fn lanes(&mut self) -> Result<Vec<LaneAddr>, DecodeError> {
        let n = self.u16("lanes")?;
        if n == 0 || n > MAX_LANES {
            return Err(DecodeError::Range {
                field: "lanes",
                value: n.into(),
            });
        }
        let mut out = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            let data_addr = self.addr("data_addr")?;
            let flows = self.u16("flows")?;
            if flows == 0 || flows > MAX_FLOWS {
                return Err(DecodeError::Range {
                    field: "flows",
                    value: flows.into(),
                });
            }
            out.push(LaneAddr { data_addr, flows });
        }
        Ok(out)
    }

    fn addr(&mut self, field: &'static str) -> Result<SocketAddr, DecodeError> {
        let ip = match self.u8(field)? {
            4 => IpAddr::V4(Ipv4Addr::from(self.array::<4>(field)?)),
            6 => IpAddr::V6(Ipv6Addr::from(self.array::<16>(field)?)),
            other => return Err(DecodeError::AddressFamily(other)),
        };
        Ok(SocketAddr::new(ip, self.u16(field)?))
    }
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
        if s.len() > max {
            return Err(EncodeError::FieldTooLong {
                field,
                len: s.len(),
                max,
            });
        }
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
        Ok(())
    }
    fn addr(&mut self, a: &SocketAddr) {
        match a.ip() {
            IpAddr::V4(ip) => {
                self.out.push(4);
                self.bytes(&ip.octets());
            }
            IpAddr::V6(ip) => {
                self.out.push(6);
                self.bytes(&ip.octets());
            }
        }
        self.u16(a.port());
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello {
                node_id: "gpu-7".into(),
                nonce: [9; 32],
                lanes: vec![
                    LaneAddr {
                        data_addr: "127.0.0.1:7401".parse().unwrap(),
                        flows: 4,
                    },
                    LaneAddr {
                        data_addr: "[fd00::2]:7401".parse().unwrap(),
                        flows: 1,
                    },
                ],
            },
            Message::Challenge {
                nonce: [3; 32],
                auth_required: true,
            },
            Message::Auth { mac: [1; 32] },
            Message::Welcome {
                mac: [2; 32],
                idle_timeout_s: 60,
            },
            Message::ManifestRequest {
                req: 5,
                dataset: "imagenet".into(),
            },
            Message::Manifest {
                req: 5,
                dataset: "d".into(),
                json: b"{}".to_vec(),
            },
            Message::DataConn {
                lane: 1,
                conn: 3,
                addr: "[::1]:40000".parse().unwrap(),
            },
            Message::Fetch {
                req: 77,
                dataset: "d".into(),
                shard: 12,
                lane: 2,
            },
            Message::Shard {
                req: 77,
                shard: 12,
                length: 1 << 33,
                crc32c: 0xdead_beef,
                conn: 1,
                seq: 5,
            },
            Message::Error {
                req: 0,
                code: ErrorCode::AuthFailed,
                retry_after_ms: 0,
                message: "nope".into(),
            },
            Message::Error {
                req: 9,
                code: ErrorCode::Throttled,
                retry_after_ms: 1500,
                message: "s3://b/k bytes 0..8: SlowDown".into(),
            },
            Message::Error {
                req: 0,
                code: ErrorCode::Draining,
                retry_after_ms: 0,
                message: "draining".into(),
            },
            Message::Cancel { req: 9 },
            Message::Ping,
            Message::DataReady { conn: 77 },
            Message::Hint {
                stream: 4,
                dataset: "d".into(),
                shards: vec![3, 1, 4, 1, 5],
            },
            Message::Hint {
                stream: 5,
                dataset: "d".into(),
                shards: (0..MAX_HINT_SHARDS as u32).collect(),
            },
        ]
    }

    #[test]
    fn round_trip_every_kind() {
        for m in samples() {
            let mut buf = Vec::new();
            encode(&m, &mut buf).unwrap();
            assert_eq!(
                decode(&buf).unwrap(),
                Decoded::Message(m.clone(), buf.len())
            );
            // Every strict prefix asks for more bytes instead of failing.
            for cut in 0..buf.len() {
                assert!(matches!(decode(&buf[..cut]).unwrap(), Decoded::NeedMore(n) if n > 0));
            }
        }
    }

    #[test]
    fn rejects_bad_headers() {
        assert_eq!(decode(&[0, 0, 0, 1, 1]), Err(DecodeError::FrameLength(1)));
        assert_eq!(
            decode(&[0xff, 0xff, 0xff, 0xff]),
            Err(DecodeError::FrameLength(u32::MAX as usize))
        );
        assert_eq!(decode(&[0, 0, 0, 2, 9, 1]), Err(DecodeError::Version(9)));
        assert_eq!(
            decode(&[0, 0, 0, 2, VERSION, 99]),
            Err(DecodeError::UnknownKind(99))
        );
    }

    #[test]
    fn rejects_trailing_and_truncated_fields() {
        let mut buf = Vec::new();
        encode(&Message::Auth { mac: [0; 32] }, &mut buf).unwrap();
        buf.push(0);
        let len = (buf.len() - 4) as u32;
        buf[..4].copy_from_slice(&len.to_be_bytes());
        assert_eq!(
            decode(&buf),
            Err(DecodeError::Trailing {
                kind: K_AUTH,
                extra: 1
            })
        );
        assert_eq!(
            decode(&[0, 0, 0, 4, VERSION, K_AUTH, 0, 0]),
            Err(DecodeError::Truncated {
                kind: K_AUTH,
                field: "mac"
            })
        );
    }

    #[test]
    fn rejects_oversized_strings_and_zero_flows() {
        let mut body = vec![VERSION, K_MANIFEST_REQUEST];
        body.extend_from_slice(&1u64.to_be_bytes());
        body.extend_from_slice(&300u16.to_be_bytes());
        body.extend_from_slice(&[b'a'; 300]);
        assert_eq!(
            decode_frame(&body),
            Err(DecodeError::FieldTooLong {
                field: "dataset",
                len: 300,
                max: MAX_DATASET_NAME
            })
        );
        let lane = |flows| LaneAddr {
            data_addr: "127.0.0.1:1".parse().unwrap(),
            flows,
        };
        let hello = |lanes| Message::Hello {
            node_id: String::new(),
            nonce: [0; 32],
            lanes,
        };
        let mut buf = Vec::new();
        encode(&hello(vec![lane(1), lane(0)]), &mut buf).unwrap();
        assert_eq!(
            decode(&buf),
            Err(DecodeError::Range {
                field: "flows",
                value: 0
            })
        );
        // No lanes, or more than MAX_LANES: refused on both sides.
        assert!(encode(&hello(vec![]), &mut Vec::new()).is_err());
        assert!(encode(&hello(vec![lane(1); 65]), &mut Vec::new()).is_err());
        let mut buf = Vec::new();
        encode(&hello(vec![lane(1)]), &mut buf).unwrap();
        let count_at = buf.len() - (1 + 4 + 2) - 2 - 2; // lanes u16 before one v4 lane
        for (n, want) in [
            (
                0u16,
                Err(DecodeError::Range {
                    field: "lanes",
                    value: 0,
                }),
            ),
            (
                65,
                Err(DecodeError::Range {
                    field: "lanes",
                    value: 65,
                }),
            ),
            (
                2,
                Err(DecodeError::Truncated {
                    kind: K_HELLO,
                    field: "data_addr",
                }),
            ),
        ] {
            buf[count_at..count_at + 2].copy_from_slice(&n.to_be_bytes());
            assert_eq!(decode(&buf), want, "lanes = {n}");
        }
    }

    #[test]
    fn connections_are_numbered_across_lanes() {
        let l = |flows| LaneAddr {
            data_addr: "127.0.0.1:1".parse().unwrap(),
            flows,
        };
        assert_eq!(conn_lanes(&[l(2), l(1), l(3)]), [0, 0, 1, 2, 2, 2]);
        assert_eq!(conn_lanes(&[]), [] as [u16; 0]);
    }

    #[test]
    fn an_older_peer_is_refused_in_its_own_version() {
        let frame = version_error_frame(2, "source");
        assert_eq!(frame[4], 2, "written with the peer's version byte");
        // Read as a version 2 peer reads it: len, version, kind, req, code, message.
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4, "the length covers the body");
        assert_eq!(frame[5], K_ERROR);
        let req = u64::from_be_bytes(frame[6..14].try_into().unwrap());
        let code = u16::from_be_bytes(frame[14..16].try_into().unwrap());
        let n = u16::from_be_bytes(frame[16..18].try_into().unwrap()) as usize;
        assert_eq!(18 + n, frame.len(), "nothing after the message");
        let message = std::str::from_utf8(&frame[18..]).unwrap();
        assert_eq!((req, code), (0, ErrorCode::UnsupportedVersion as u16));
        assert!(
            message.contains("version 3") && message.contains("sent version 2"),
            "{message}"
        );
        assert_eq!(decode(&frame), Err(DecodeError::Version(2)));
    }

    #[test]
    fn dataset_names_are_checked_with_the_reason() {
        assert_eq!(check_dataset_name("web-2024.v1_a"), Ok(()));
        assert_eq!(check_dataset_name(""), Err(DatasetNameError::Empty));
        let long = "x".repeat(256);
        let e = check_dataset_name(&long).unwrap_err();
        assert_eq!(e, DatasetNameError::TooLong { len: 256 });
        assert_eq!(
            e.to_string(),
            "field `dataset` is 256 bytes long; the limit is 255"
        );
        assert!(check_dataset_name(&"y".repeat(255)).is_ok());
        assert_eq!(
            check_dataset_name("a/b"),
            Err(DatasetNameError::BadChar {
                name: "a/b".into(),
                ch: '/'
            })
        );
    }

    #[test]
    fn hints_over_the_limit_are_refused_before_allocating() {
        let mut body = vec![VERSION, K_HINT];
        body.extend_from_slice(&1u64.to_be_bytes());
        body.extend_from_slice(&1u16.to_be_bytes());
        body.push(b'd');
        body.extend_from_slice(&u16::MAX.to_be_bytes());
        assert_eq!(
            decode_frame(&body),
            Err(DecodeError::FieldTooLong {
                field: "shards",
                len: u16::MAX as usize,
                max: MAX_HINT_SHARDS
            })
        );
        let m = Message::Hint {
            stream: 1,
            dataset: "d".into(),
            shards: vec![0; MAX_HINT_SHARDS + 1],
        };
        assert!(matches!(
            encode(&m, &mut Vec::new()),
            Err(EncodeError::FieldTooLong {
                field: "shards",
                ..
            })
        ));
        // The largest hint with the longest name stays a small frame.
        let mut buf = Vec::new();
        let big = Message::Hint {
            stream: u64::MAX,
            dataset: "x".repeat(MAX_DATASET_NAME),
            shards: vec![u32::MAX; MAX_HINT_SHARDS],
        };
        encode(&big, &mut buf).unwrap();
        assert!(buf.len() <= MAX_SMALL_FRAME, "{}", buf.len());
    }

    #[test]
    fn a_peer_of_the_previous_version_is_refused_naming_both() {
        let e = decode(&[0, 0, 0, 2, 2, K_PING]).unwrap_err();
        assert_eq!(e, DecodeError::Version(2));
        assert_eq!(
            e.to_string(),
            "unsupported protocol version 2 (this build speaks 3)"
        );
    }

    #[test]
    fn encode_refuses_long_dataset_names() {
        let m = Message::ManifestRequest {
            req: 1,
            dataset: "x".repeat(256),
        };
        assert!(matches!(
            encode(&m, &mut Vec::new()),
            Err(EncodeError::FieldTooLong {
                field: "dataset",
                ..
            })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// Any byte string decodes to a message, a request for more bytes or a typed error.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        /// Same, with a plausible header so the body parsers are exercised.
        #[test]
        fn arbitrary_bodies_never_panic(kind in 0u8..15, body in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut frame = vec![VERSION, kind];
            frame.extend_from_slice(&body);
            if let Ok(m) = decode_frame(&frame) {
                // Whatever decodes re-encodes to the same bytes.
                let mut buf = Vec::new();
                encode(&m, &mut buf).unwrap();
                prop_assert_eq!(&buf[4..], &frame[..]);
            }
        }

        #[test]
        fn fetch_and_shard_round_trip(req in any::<u64>(), shard in any::<u32>(), length in any::<u64>(),
                                      crc in any::<u32>(), conn in any::<u16>(), seq in any::<u64>(),
                                      ds in "[a-z0-9_-]{0,40}") {
            for m in [Message::Fetch { req, dataset: ds.clone(), shard, lane: conn },
                      Message::Shard { req, shard, length, crc32c: crc, conn, seq }] {
                let mut buf = Vec::new();
                encode(&m, &mut buf).unwrap();
                prop_assert_eq!(decode(&buf).unwrap(), Decoded::Message(m, buf.len()));
            }
        }
    }
}
