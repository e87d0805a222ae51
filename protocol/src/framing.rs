//! Reading and writing control frames on async streams (the I/O half of the sans-I/O
//! protocol crate). Shared by the source and the node service.
//!
//! A frame's buffer grows with the bytes that actually arrive, never to the length a peer
//! claims up front, and every read takes the largest frame the caller accepts in its state
//! (an unauthenticated peer gets [`wire::MAX_SMALL_FRAME`]).

use crate::wire::{self, DecodeError, EncodeError, Message};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A reused frame buffer above this capacity is given back after its frame.
const KEEP_CAPACITY: usize = 1 << 20;

/// Why a control frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("control connection I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("peer closed the control connection")]
    Closed,
    /// The peer closed the connection in the middle of a frame.
    #[error("peer closed the control connection after {got} of {len} frame bytes")]
    Truncated {
        /// Bytes of the frame that arrived.
        got: usize,
        /// The frame's length prefix.
        len: usize,
    },
    /// The frame is longer than this side accepts in its current state.
    #[error("control frame of {len} bytes is over the limit of {max} bytes here")]
    TooLong {
        /// The frame's length prefix.
        len: usize,
        /// The limit in this state.
        max: usize,
    },
    /// The peer sent bytes that are not a valid message.
    #[error("malformed control message: {0}")]
    Decode(#[from] DecodeError),
    /// We tried to send something too large.
    #[error("cannot encode control message: {0}")]
    Encode(#[from] EncodeError),
}

/// Reads one message of at most `max` frame bytes; `buf` is reused between calls.
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<Message, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = wire::check_frame_len(u32::from_be_bytes(len))?;
    if len > max {
        return Err(FrameError::TooLong { len, max });
    }
    if buf.capacity() > KEEP_CAPACITY {
        *buf = Vec::new();
    }
    buf.clear();
    // `read_to_end` grows the buffer as bytes arrive (doubling), so memory follows what the
    // peer really sent, not what its length prefix claims.
    let got = r.take(len as u64).read_to_end(buf).await?;
    if got < len {
        return Err(FrameError::Truncated { got, len });
    }
    Ok(wire::decode_frame(buf)?)
}

/// Encodes one message as a whole frame.
pub fn encode_frame(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64);
    wire::encode(msg, &mut out)?;
    Ok(out)
}

/// Writes one message.
pub async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Message,
) -> Result<(), FrameError> {
    w.write_all(&encode_frame(msg)?).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_huge_length_prefix_costs_only_the_bytes_that_came() {
        // 64 MiB claimed, 10 bytes sent, then EOF: an error, and the buffer stayed small.
        let mut input: &[u8] = &[&(64u32 << 20).to_be_bytes()[..], &[1u8; 10][..]].concat();
        let mut buf = Vec::new();
        let e = read_message(&mut input, &mut buf, wire::MAX_FRAME)
            .await
            .unwrap_err();
        assert!(
            matches!(e, FrameError::Truncated { got: 10, len } if len == 64 << 20),
            "{e}"
        );
        assert!(buf.capacity() < 4096, "capacity {}", buf.capacity());
    }

    #[tokio::test]
    async fn frames_over_the_state_limit_are_refused_before_reading() {
        let mut input: &[u8] = &(9000u32).to_be_bytes();
        let e = read_message(&mut input, &mut Vec::new(), wire::MAX_SMALL_FRAME)
            .await
            .unwrap_err();
        assert!(
            matches!(e, FrameError::TooLong { len: 9000, max } if max == wire::MAX_SMALL_FRAME)
        );
    }

    #[tokio::test]
    async fn round_trip_and_clean_close() {
        let frame = encode_frame(&Message::Ping).unwrap();
        let mut input: &[u8] = &frame;
        let mut buf = Vec::new();
        let m = read_message(&mut input, &mut buf, wire::MAX_SMALL_FRAME)
            .await
            .unwrap();
        assert_eq!(m, Message::Ping);
        let e = read_message(&mut input, &mut buf, wire::MAX_SMALL_FRAME)
            .await
            .unwrap_err();
        assert!(matches!(e, FrameError::Closed));
    }
}
