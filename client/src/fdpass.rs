//! Length-prefixed trainer frames over a Unix stream socket, with file descriptors passed
//! as SCM_RIGHTS on the same `sendmsg`. Used by the node (sending) and the client
//! (receiving); tested over a socketpair.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use shardwire_protocol::trainer::{self, TrainerDecodeError};

/// Why a trainer frame could not be moved.
#[derive(Debug, thiserror::Error)]
pub enum FrameIoError {
    /// Socket error.
    #[error("trainer socket I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Peer closed.
    #[error("the peer closed the trainer socket")]
    Closed,
    /// Bad frame.
    #[error(transparent)]
    Decode(#[from] TrainerDecodeError),
}

/// Sends one frame, with `fds` attached to its first byte.
pub fn send_frame(
    sock: &UnixStream,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), FrameIoError> {
    if fds.is_empty() {
        (&*sock).write_all(frame)?;
        return Ok(());
    }
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    let ok = anc.push(SendAncillaryMessage::ScmRights(fds));
    assert!(ok, "ancillary buffer sized for 4 fds");
    let n = rustix::net::sendmsg(sock, &[IoSlice::new(frame)], &mut anc, SendFlags::NOSIGNAL)
        .map_err(std::io::Error::from)?;
    // The fds went with the first byte; the rest is plain data.
    (&*sock).write_all(&frame[n..])?;
    Ok(())
}

/// Receives one frame body into `buf`, collecting any fds that arrive with it.
pub fn recv_frame(
    sock: &UnixStream,
    buf: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
) -> Result<(), FrameIoError> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let r = rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut prefix[got..])],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if r.bytes == 0 {
            return Err(FrameIoError::Closed);
        }
        got += r.bytes;
    }
    let len = trainer::check_len(prefix)?;
    buf.clear();
    buf.resize(len, 0);
    (&*sock).read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FrameIoError::Closed
        } else {
            e.into()
        }
    })?;
    Ok(())
}

/// Convenience: borrowed fd of anything that has one.
pub fn borrow<F: AsFd>(f: &F) -> BorrowedFd<'_> {
    f.as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_and_fd_cross_a_socketpair() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let mut frame = Vec::new();
        trainer::encode(&trainer::Request::State, &mut frame);
        send_frame(&a, &frame, &[file.as_fd()]).unwrap();
        send_frame(&a, &frame, &[]).unwrap();
        let (mut buf, mut fds) = (Vec::new(), Vec::new());
        recv_frame(&b, &mut buf, &mut fds).unwrap();
        assert_eq!(
            trainer::decode::<trainer::Request>(&buf).unwrap(),
            trainer::Request::State
        );
        assert_eq!(fds.len(), 1);
        let meta = rustix::fs::fstat(&fds[0]).unwrap();
        assert_eq!(meta.st_ino, rustix::fs::fstat(&file).unwrap().st_ino);
        recv_frame(&b, &mut buf, &mut fds).unwrap();
        assert_eq!(fds.len(), 1, "no fd on the second frame");
        drop(a);
        assert!(matches!(
            recv_frame(&b, &mut buf, &mut fds),
            Err(FrameIoError::Closed)
        ));
    }
}
