//! Reading and writing control frames on async streams (the I/O half of the sans-I/O
//! protocol crate). Shared by the source and the node service.

use shardwire_protocol::wire::{self, DecodeError, EncodeError, Message};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why a control frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("control connection I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("peer closed the control connection")]
    Closed,
    /// The peer sent bytes that are not a valid message.
    #[error("malformed control message: {0}")]
    Decode(#[from] DecodeError),
    /// We tried to send something too large.
    #[error("cannot encode control message: {0}")]
    Encode(#[from] EncodeError),
}

/// Reads one message; `buf` is reused between calls.
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Message, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = wire::check_frame_len(u32::from_be_bytes(len))?;
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    Ok(wire::decode_frame(buf)?)
}

/// Writes one message.
pub async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Message,
) -> Result<(), FrameError> {
    let mut out = Vec::with_capacity(64);
    wire::encode(msg, &mut out)?;
    w.write_all(&out).await?;
    Ok(())
}
