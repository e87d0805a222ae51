//! Decoding control frames: every length is checked against its limit before anything is
//! allocated, and any byte string gives a message, "need more bytes", or a [`DecodeError`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::*;

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
    #[error(
        "message kind {kind} is truncated: field `{field}` needs {need} bytes, {left} are left"
    )]
    Truncated {
        /// Message kind.
        kind: u8,
        /// The field being read.
        field: &'static str,
        /// Bytes the field needs.
        need: usize,
        /// Bytes left in the body.
        left: usize,
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
    #[error("field `{field}` is not valid UTF-8 after its first {valid_up_to} bytes")]
    Utf8 {
        /// The field.
        field: &'static str,
        /// How many bytes of it are valid UTF-8.
        valid_up_to: usize,
    },
    /// A text field holds a control character (see [`ControlCharError`]).
    #[error("{0}")]
    ControlChar(ControlCharError),
    /// An address family byte is not 4 or 6.
    #[error("field `{field}` of message kind {kind} has address family {family}, not 4 or 6")]
    AddressFamily {
        /// Message kind.
        kind: u8,
        /// The field.
        field: &'static str,
        /// The family byte.
        family: u8,
    },
    /// A dataset name no source serves (see [`check_dataset_name`]).
    #[error("{0}")]
    DatasetName(DatasetNameError),
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
            dataset: r.dataset()?,
        },
        K_MANIFEST => Message::Manifest {
            req: r.u64("req")?,
            dataset: r.dataset()?,
            json: r.blob("json", crate::manifest::MAX_MANIFEST_BYTES)?,
        },
        K_DATA_CONN => Message::DataConn {
            lane: r.u16("lane")?,
            conn: r.u16("conn")?,
            addr: r.addr("addr")?,
        },
        K_FETCH => Message::Fetch {
            req: r.u64("req")?,
            dataset: r.dataset()?,
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
            dataset: r.dataset()?,
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
                need: n,
                left: self.buf.len(),
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
        let text = std::str::from_utf8(bytes).map_err(|e| DecodeError::Utf8 {
            field,
            valid_up_to: e.valid_up_to(),
        })?;
        check_printable(field, text).map_err(DecodeError::ControlChar)?;
        Ok(text.to_owned())
    }
    /// A dataset name, checked as the source checks the names it serves.
    fn dataset(&mut self) -> Result<String, DecodeError> {
        let name = self.string("dataset", MAX_DATASET_NAME)?;
        check_dataset_name(&name).map_err(DecodeError::DatasetName)?;
        Ok(name)
    }
    fn blob(&mut self, field: &'static str, max: usize) -> Result<Vec<u8>, DecodeError> {
        let len = self.u32(field)? as usize;
        if len > max {
            return Err(DecodeError::FieldTooLong { field, len, max });
        }
        Ok(self.take(len, field)?.to_vec())
    }
    /// A `Hello`'s lanes: a count (1..=[`MAX_LANES`]), then per lane an address and its
    /// flows (1..=[`MAX_FLOWS`]). Room is made for the lanes as they decode, whatever the
    /// count claims: a count past the bytes fails as truncated.
    fn lanes(&mut self) -> Result<Vec<LaneAddr>, DecodeError> {
        let n = self.u16("lanes")?;
        if n == 0 || n > MAX_LANES {
            return Err(DecodeError::Range {
                field: "lanes",
                value: n.into(),
            });
        }
        // Grows with the lanes decoded, not with the count claimed.
        let mut out = Vec::new();
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
            family => {
                return Err(DecodeError::AddressFamily {
                    kind: self.kind,
                    field,
                    family,
                });
            }
        };
        Ok(SocketAddr::new(ip, self.u16(field)?))
    }
}
