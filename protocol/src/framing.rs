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
/// The least room a frame's buffer grows by.
const MIN_ROOM: usize = 4 << 10;

/// Why a control frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("control connection I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("peer closed the control connection")]
    Closed,
    /// The peer closed the connection in the middle of a frame's 4-byte length prefix.
    #[error("peer closed the control connection after {got} of the 4 bytes of a frame's length")]
    TruncatedLength {
        /// Bytes of the prefix that arrived (1..=3).
        got: usize,
    },
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

/// Reads one message of at most `max` frame bytes.
///
/// `buf` holds the bytes of the frame read so far, and must be the same buffer on every call
/// on one connection: a read dropped mid-frame (a `select!` branch that lost, a timeout)
/// leaves them there and the next call goes on from them, so this is cancel-safe. Only whole
/// frames leave `buf`, and no more than a frame is ever read from `r`.
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<Message, FrameError> {
    loop {
        let want = match frame_len(buf, max)? {
            None => 4 - buf.len(),
            Some(len) if buf.len() == 4 + len => break,
            Some(len) => 4 + len - buf.len(),
        };
        // The buffer grows, when full, by as much as it holds (at least MIN_ROOM): memory
        // follows the bytes that arrived, never the length the prefix claims, and a large
        // frame is copied O(log n) times.
        let grow = growth(buf.len(), buf.capacity(), want);
        if grow > 0 {
            buf.reserve_exact(grow);
        }
        let room = want.min(buf.capacity() - buf.len());
        // Cancel-safe: dropped while pending, `read_buf` has appended nothing.
        if r.take(room as u64).read_buf(buf).await? == 0 {
            return Err(match frame_len(buf, max)? {
                None if buf.is_empty() => FrameError::Closed,
                None => FrameError::TruncatedLength { got: buf.len() },
                Some(len) => FrameError::Truncated {
                    got: buf.len() - 4,
                    len,
                },
            });
        }
    }
    let msg = wire::decode_frame(&buf[4..]);
    buf.clear();
    if buf.capacity() > KEEP_CAPACITY {
        *buf = Vec::new();
    }
    Ok(msg?)
}

/// How many bytes a frame buffer of `len` bytes (of `capacity`) grows by before the next
/// read, `want` bytes of the frame still to come: none while it has room, else as much as it
/// holds (at least [`MIN_ROOM`], at most `want`).
fn growth(len: usize, capacity: usize, want: usize) -> usize {
    if capacity > len {
        0
    } else {
        want.min(len.max(MIN_ROOM))
    }
}

/// The length of the frame whose first bytes are `buf`, once its 4-byte prefix is there,
/// checked against `max`.
fn frame_len(buf: &[u8], max: usize) -> Result<Option<usize>, FrameError> {
    let Some(prefix) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let len = wire::check_frame_len(u32::from_be_bytes(*prefix))?;
    if len > max {
        return Err(FrameError::TooLong { len, max });
    }
    Ok(Some(len))
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
        assert!(
            buf.capacity() <= 2 * MIN_ROOM,
            "capacity {}",
            buf.capacity()
        );
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

    /// A read dropped mid-frame, as a `select!` drops the branch that lost, loses no byte:
    /// the next read with the same buffer returns the whole message, wherever the cut was.
    #[tokio::test]
    async fn a_read_dropped_mid_frame_loses_nothing() {
        use tokio::io::AsyncWriteExt;
        let msg = Message::Fetch {
            req: 7,
            dataset: "imagenet".into(),
            shard: 3,
            lane: 1,
        };
        let frame = encode_frame(&msg).unwrap();
        let (mut tx, mut rx) = tokio::io::duplex(4096);
        let mut buf = Vec::new();
        for cut in [1, 2, 4, 5, frame.len() - 1] {
            tx.write_all(&frame[..cut]).await.unwrap();
            let read = read_message(&mut rx, &mut buf, wire::MAX_SMALL_FRAME);
            let waited = tokio::time::timeout(std::time::Duration::from_millis(20), read).await;
            assert!(
                waited.is_err(),
                "a partial frame (cut at {cut}) is not a message"
            );
            tx.write_all(&frame[cut..]).await.unwrap();
            let m = read_message(&mut rx, &mut buf, wire::MAX_SMALL_FRAME).await;
            assert_eq!(m.unwrap(), msg, "cut at {cut}");
            assert!(buf.is_empty());
        }
        // Two frames in one write: the first read takes only the first.
        tx.write_all(&[frame.clone(), encode_frame(&Message::Ping).unwrap()].concat())
            .await
            .unwrap();
        let m = read_message(&mut rx, &mut buf, wire::MAX_SMALL_FRAME).await;
        assert_eq!(m.unwrap(), msg);
        let m = read_message(&mut rx, &mut buf, wire::MAX_SMALL_FRAME).await;
        assert_eq!(m.unwrap(), Message::Ping);
        drop(tx);
        let e = read_message(&mut rx, &mut buf, wire::MAX_SMALL_FRAME).await;
        assert!(matches!(e, Err(FrameError::Closed)));
    }

    /// A frame of 64 MiB arriving in 16 KiB pieces: its buffer is reallocated a logarithmic
    /// number of times, never holds more than twice what arrived (plus MIN_ROOM), and each
    /// read asks for no more than the frame still needs.
    #[test]
    fn a_large_frame_in_small_pieces_grows_its_buffer_by_doubling() {
        let (frame, piece) = (64usize << 20, 16usize << 10);
        let (mut len, mut cap, mut reallocs) = (0usize, 0usize, 0);
        while len < frame {
            let want = frame - len;
            let g = growth(len, cap, want);
            if g > 0 {
                cap = len + g;
                reallocs += 1;
            }
            let room = want.min(cap - len);
            assert!(room > 0 && room <= want);
            len += room.min(piece);
            assert!(
                cap <= 2 * len + MIN_ROOM,
                "{cap} bytes held for {len} arrived"
            );
        }
        assert!(reallocs <= 16, "{reallocs} reallocations");
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

    #[tokio::test]
    async fn a_close_inside_the_length_prefix_is_not_a_clean_close() {
        let mut buf = Vec::new();
        let e = read_message(&mut &[0u8, 0][..], &mut buf, wire::MAX_SMALL_FRAME)
            .await
            .unwrap_err();
        assert!(matches!(e, FrameError::TruncatedLength { got: 2 }), "{e}");
        let e = read_message(&mut &[][..], &mut Vec::new(), wire::MAX_SMALL_FRAME)
            .await
            .unwrap_err();
        assert!(matches!(e, FrameError::Closed), "{e}");
    }
}
