//! Length-prefixed trainer frames over a Unix stream socket, with file descriptors passed
//! as SCM_RIGHTS on the same `sendmsg`. Used by the node (sending) and the client
//! (receiving); tested over a socketpair.

use std::io::{IoSlice, IoSliceMut, Write};
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

/// Reads frames with as few syscalls as possible: one `recvmsg` fills a buffer that may hold
/// a whole frame (or several), and any fds that arrive are collected. One reader per socket.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self {
            buf: vec![0; 64 << 10],
            start: 0,
            end: 0,
        }
    }
}

impl FrameReader {
    /// An empty reader with a 64 KiB buffer (grown for larger frames).
    pub fn new() -> Self {
        Self::default()
    }

    /// The next frame's body (valid until the next call); fds that came with it are pushed.
    pub fn read<'a>(
        &'a mut self,
        sock: &UnixStream,
        fds: &mut Vec<OwnedFd>,
    ) -> Result<&'a [u8], FrameIoError> {
        self.read_with(|buf| {
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut anc = RecvAncillaryBuffer::new(&mut space);
            let r = rustix::net::recvmsg(
                sock,
                &mut [IoSliceMut::new(buf)],
                &mut anc,
                RecvFlags::CMSG_CLOEXEC,
            )?;
            for m in anc.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = m {
                    fds.extend(rights);
                }
            }
            Ok(r.bytes)
        })
    }

    /// Like [`FrameReader::read`] for a peer that sends no fds: a plain `recv` without a
    /// control buffer (any fd that came anyway is closed by the kernel, unseen).
    pub fn read_data<'a>(&'a mut self, sock: &UnixStream) -> Result<&'a [u8], FrameIoError> {
        self.read_with(|buf| rustix::net::recv(sock, buf, RecvFlags::empty()).map(|(n, _)| n))
    }

    /// The next frame, filling the buffer with `recv` (bytes received; 0 at end of stream).
    fn read_with(
        &mut self,
        mut recv: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>,
    ) -> Result<&[u8], FrameIoError> {
        loop {
            let avail = self.end - self.start;
            let need = if avail >= 4 {
                let len = trainer::check_len(
                    self.buf[self.start..self.start + 4]
                        .try_into()
                        .expect("4 bytes"),
                )?;
                if avail >= 4 + len {
                    let body = self.start + 4..self.start + 4 + len;
                    self.start += 4 + len;
                    return Ok(&self.buf[body]);
                }
                4 + len
            } else {
                4
            };
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            } else if self.buf.len() - self.start < need {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, avail);
            }
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
            let n = match recv(&mut self.buf[self.end..]) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(std::io::Error::from(e).into()),
            };
            if n == 0 {
                return Err(FrameIoError::Closed);
            }
            self.end += n;
        }
    }
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
        // A frame larger than the reader's buffer, split over many reads.
        let big = trainer::Request::Attach {
            version: 1,
            dataset: "x".repeat(200_000),
            seed: 0,
            rank: 0,
            world_size: 1,
            epochs: 1,
            uneven: Default::default(),
            state: None,
        };
        let mut big_frame = Vec::new();
        trainer::encode(&big, &mut big_frame);
        let writer = std::thread::spawn(move || send_frame(&a, &big_frame, &[]).map(|_| a));
        let (mut r, mut fds) = (FrameReader::new(), Vec::new());
        let body = r.read(&b, &mut fds).unwrap();
        assert_eq!(
            trainer::decode::<trainer::Request>(body).unwrap(),
            trainer::Request::State
        );
        assert_eq!(fds.len(), 1);
        let meta = rustix::fs::fstat(&fds[0]).unwrap();
        assert_eq!(meta.st_ino, rustix::fs::fstat(&file).unwrap().st_ino);
        let body = r.read(&b, &mut fds).unwrap();
        assert_eq!(
            trainer::decode::<trainer::Request>(body).unwrap(),
            trainer::Request::State
        );
        assert_eq!(fds.len(), 1, "no fd on the second frame");
        assert_eq!(
            trainer::decode::<trainer::Request>(r.read(&b, &mut fds).unwrap()).unwrap(),
            big
        );
        drop(writer.join().unwrap().unwrap());
        assert!(matches!(r.read(&b, &mut fds), Err(FrameIoError::Closed)));
    }

    #[test]
    fn read_data_takes_frames_and_drops_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let mut frames = Vec::new();
        trainer::encode(&trainer::Request::State, &mut frames);
        trainer::encode(&trainer::Request::Release { lease: 3 }, &mut frames);
        send_frame(&a, &frames, &[file.as_fd()]).unwrap();
        // Split mid-prefix and mid-body: the reader waits for the rest.
        let mut next = Vec::new();
        trainer::encode_next(Some(5), &[1, 2], &mut next);
        send_frame(&a, &next[..2], &[]).unwrap();
        let mut r = FrameReader::new();
        let body = r.read_data(&b).unwrap();
        assert_eq!(
            trainer::Request::decode(body).unwrap(),
            trainer::Request::State
        );
        let body = r.read_data(&b).unwrap();
        assert_eq!(
            trainer::Request::decode(body).unwrap(),
            trainer::Request::Release { lease: 3 }
        );
        let rest = next.split_off(2);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            send_frame(&a, &rest[..10], &[]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
            send_frame(&a, &rest[10..], &[]).unwrap();
        });
        assert_eq!(
            trainer::Request::decode(r.read_data(&b).unwrap()).unwrap(),
            trainer::Request::Next {
                timeout_ms: Some(5),
                release: vec![1, 2]
            }
        );
        writer.join().unwrap();
        assert!(matches!(r.read_data(&b), Err(FrameIoError::Closed)));
    }
}
