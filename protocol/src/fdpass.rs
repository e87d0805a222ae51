//! Length-prefixed trainer frames over a Unix stream socket, with file descriptors passed
//! as SCM_RIGHTS on the same `sendmsg`. Used by the node (sending) and the client
//! (receiving); tested over a socketpair.

use std::io::{IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::trainer::{self, TrainerDecodeError};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

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
    /// File descriptors sent with a frame did not all fit (`MSG_CTRUNC`): the kernel
    /// closed the rest, most often because this process is at its open-files limit.
    #[error(
        "file descriptors sent with a frame were cut off (MSG_CTRUNC): this process may be at its open-files limit (ulimit -n)"
    )]
    FdsTruncated,
    /// More fds were given to [`send_frame`] than one frame carries.
    #[error("a frame carries at most {MAX_FDS} file descriptors; {0} were given")]
    TooManyFds(usize),
    /// Nothing arrived within the time allowed.
    #[error("{phase}: nothing arrived within {limit:?}")]
    Timeout {
        /// What was being waited for.
        phase: ReadPhase,
        /// The limit.
        limit: Duration,
    },
}

/// What a timed read waited for when it timed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPhase {
    /// The first byte of the next frame.
    Idle,
    /// The rest of a frame that had started.
    Frame,
}

impl std::fmt::Display for ReadPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Idle => "waiting for the next request",
            Self::Frame => "waiting for the rest of a request",
        })
    }
}

/// The most fds one frame carries (what a reader's control buffer holds).
pub const MAX_FDS: usize = 4;

/// Time limits of [`FrameReader::read_data_timed`].
#[derive(Clone, Copy, Debug)]
pub struct ReadLimits {
    /// Longest wait for a frame to start (`None`: forever).
    pub idle: Option<Duration>,
    /// Longest time from a frame's first byte to its last.
    pub frame: Duration,
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
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if fds.len() > MAX_FDS || !anc.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(FrameIoError::TooManyFds(fds.len()));
    }
    let n = loop {
        match rustix::net::sendmsg(sock, &[IoSlice::new(frame)], &mut anc, SendFlags::NOSIGNAL) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r.map_err(std::io::Error::from)?,
        }
    };
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
    /// The receive timeout last set on the socket by a timed read (to skip unchanged ones).
    rcvtimeo: Option<Option<Duration>>,
}

/// The reader's buffer; frames up to this size need no growth.
const INITIAL_BUFFER: usize = 64 << 10;

impl Default for FrameReader {
    fn default() -> Self {
        Self {
            buf: vec![0; INITIAL_BUFFER],
            start: 0,
            end: 0,
            rcvtimeo: None,
        }
    }
}

impl FrameReader {
    /// An empty reader with a 64 KiB buffer (grown for larger frames).
    pub fn new() -> Self {
        Self::default()
    }

    /// True when a whole frame (or a length prefix the next read refuses) is buffered: the
    /// next read returns without a syscall, whether the socket is readable or not.
    pub fn has_frame(&self) -> bool {
        let avail = self.end - self.start;
        avail >= 4
            && trainer::check_len(
                self.buf[self.start..self.start + 4]
                    .try_into()
                    .expect("4 bytes"),
            )
            .map_or(true, |len| avail >= 4 + len)
    }

    /// The next frame's body (valid until the next call); fds that came with it are pushed.
    ///
    /// Reads no byte past the frame: one `recvmsg` would return a later frame's bytes and its
    /// fds with this one's (the kernel merges plain bytes before a message that carries fds),
    /// and those fds would be handed out with the wrong frame.
    pub fn read<'a>(
        &'a mut self,
        sock: &UnixStream,
        fds: &mut Vec<OwnedFd>,
    ) -> Result<&'a [u8], FrameIoError> {
        let mut cut = false;
        let body = self.read_range(Ahead::No, |buf, _| recv_with_fds(sock, buf, fds, &mut cut))?;
        if cut {
            return Err(FrameIoError::FdsTruncated);
        }
        Ok(&self.buf[body])
    }

    /// Like [`FrameReader::read`] with the time limits of [`FrameReader::read_data_timed`].
    pub fn read_timed<'a>(
        &'a mut self,
        sock: &UnixStream,
        fds: &mut Vec<OwnedFd>,
        limits: ReadLimits,
    ) -> Result<&'a [u8], FrameIoError> {
        let mut cut = false;
        let body = self.timed_range(sock, limits, Ahead::No, |buf| {
            recv_with_fds(sock, buf, fds, &mut cut)
        })?;
        if cut {
            return Err(FrameIoError::FdsTruncated);
        }
        Ok(&self.buf[body])
    }

    /// Like [`FrameReader::read`] for a peer that sends no fds: a plain `recv` without a
    /// control buffer (any fd that came anyway is closed by the kernel, unseen).
    pub fn read_data<'a>(&'a mut self, sock: &UnixStream) -> Result<&'a [u8], FrameIoError> {
        let body = self.read_range(Ahead::Yes, |buf, _| {
            rustix::net::recv(sock, buf, RecvFlags::empty()).map(|(n, _)| n)
        })?;
        Ok(&self.buf[body])
    }

    /// Like [`FrameReader::read_data`] with time limits: a frame must start within
    /// `limits.idle` and, once started, end within `limits.frame`. Sets the socket's receive
    /// timeout (only when it changes: a frame that arrives whole costs no extra syscall).
    pub fn read_data_timed<'a>(
        &'a mut self,
        sock: &UnixStream,
        limits: ReadLimits,
    ) -> Result<&'a [u8], FrameIoError> {
        let body = self.timed_range(sock, limits, Ahead::Yes, |buf| {
            rustix::net::recv(sock, buf, RecvFlags::empty()).map(|(n, _)| n)
        })?;
        Ok(&self.buf[body])
    }

    /// [`Self::read_range`] with `recv` under the socket receive timeouts `limits` asks for.
    fn timed_range(
        &mut self,
        sock: &UnixStream,
        limits: ReadLimits,
        ahead: Ahead,
        mut recv: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>,
    ) -> Result<std::ops::Range<usize>, FrameIoError> {
        let mut started: Option<Instant> = None;
        let mut idle_since: Option<Instant> = None;
        let mut current = self.rcvtimeo;
        let mut phase = ReadPhase::Idle;
        let r = self.read_range(ahead, |buf, buffered| {
            let want = if buffered {
                phase = ReadPhase::Frame;
                let t0 = *started.get_or_insert_with(Instant::now);
                let left = limits.frame.saturating_sub(t0.elapsed());
                if left.is_zero() {
                    return Err(rustix::io::Errno::AGAIN);
                }
                // Rounded up to whole milliseconds so repeated reads of one frame do not set
                // a new value every time.
                Some(Duration::from_millis(left.as_millis() as u64 + 1))
            } else {
                phase = ReadPhase::Idle;
                // Only a `recv` a signal cut short (EINTR) comes back here with nothing
                // buffered: it waits out what is left of the limit, not the whole limit again.
                let want = idle_wait(limits.idle, idle_since.map(|t0| t0.elapsed()))?;
                if idle_since.is_none() {
                    idle_since = Some(Instant::now());
                }
                want
            };
            if current != Some(want) {
                rustix::net::sockopt::set_socket_timeout(
                    sock,
                    rustix::net::sockopt::Timeout::Recv,
                    want,
                )?;
                current = Some(want);
            }
            recv(buf)
        });
        self.rcvtimeo = current;
        match r {
            Err(FrameIoError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let limit = match phase {
                    ReadPhase::Idle => limits.idle.unwrap_or_default(),
                    ReadPhase::Frame => limits.frame,
                };
                Err(FrameIoError::Timeout { phase, limit })
            }
            r => r,
        }
    }

    /// The next frame's place in the buffer, filling it with `recv` (given the free space and
    /// whether bytes of the frame are already buffered; returns bytes received, 0 at end of
    /// stream). The buffer grows only when it is full of a frame's real bytes (doubling), never
    /// to the length a prefix claims. With [`Ahead::No`], `recv` is given room for no byte past
    /// the frame (its prefix first, then the rest of its body).
    fn read_range(
        &mut self,
        ahead: Ahead,
        mut recv: impl FnMut(&mut [u8], bool) -> rustix::io::Result<usize>,
    ) -> Result<std::ops::Range<usize>, FrameIoError> {
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
                    return Ok(body);
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
            if self.end == self.buf.len() && self.buf.len() < need {
                let grown = (self.buf.len() * 2).min(need);
                self.buf.resize(grown, 0);
            }
            let buffered = self.end > self.start;
            let room = match ahead {
                Ahead::Yes => self.buf.len(),
                Ahead::No => self.buf.len().min(self.start + need),
            };
            let n = match recv(&mut self.buf[self.end..room], buffered) {
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

/// The receive timeout of a `recv` waiting for a frame to start, within a wait of at most
/// `limit` (`None`: for ever) of which `elapsed` has passed (`None`: this is its first `recv`).
/// A `recv` under `SO_RCVTIMEO` is never restarted after a signal, even with `SA_RESTART`
/// (signal(7)): it fails with EINTR and is made again, given only what is left of the limit,
/// so a signal every few milliseconds (a sampling profiler's SIGPROF) does not make the wait
/// start over each time and never end. The first waits the whole limit (at least one clock
/// tick: a zero receive timeout is "forever" to the kernel, and refused by rustix, so a zero
/// limit still takes a frame already there); one made again with nothing left fails with
/// `AGAIN`, the timeout.
fn idle_wait(
    limit: Option<Duration>,
    elapsed: Option<Duration>,
) -> rustix::io::Result<Option<Duration>> {
    match (limit, elapsed) {
        (None, _) => Ok(None),
        (Some(limit), None) => Ok(Some(limit.max(Duration::from_micros(1)))),
        (Some(limit), Some(elapsed)) => match limit.saturating_sub(elapsed) {
            left if left.is_zero() => Err(rustix::io::Errno::AGAIN),
            left => Ok(Some(left)),
        },
    }
}

/// One `recvmsg` into `buf`, its fds pushed onto `fds` and `cut` set when the kernel cut
/// them off (`MSG_CTRUNC`).
fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    cut: &mut bool,
) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut anc,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    *cut |= r.flags.contains(rustix::net::ReturnFlags::CTRUNC);
    for m in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    Ok(r.bytes)
}

/// Whether a read may take bytes past the frame it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ahead {
    /// As many as there are room for (fewer syscalls; only for peers that send no fds).
    Yes,
    /// None: later frames, and the fds that came with them, stay in the socket.
    No,
}

/// Convenience: borrowed fd of anything that has one.
pub fn borrow<F: AsFd>(f: &F) -> BorrowedFd<'_> {
    f.as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fds_cut_off_by_the_kernel_are_an_error_not_a_short_count() {
        // More fds than the reader's control buffer holds: the kernel sets MSG_CTRUNC and
        // closes the rest. Before, the frame came with 4 fds and no word of the others.
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let mut frame = Vec::new();
        trainer::encode(&trainer::Request::State {}, &mut frame);
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        let eight = [file.as_fd(); 8];
        assert!(anc.push(SendAncillaryMessage::ScmRights(&eight)));
        rustix::net::sendmsg(&a, &[IoSlice::new(&frame)], &mut anc, SendFlags::NOSIGNAL).unwrap();
        let (mut r, mut fds) = (FrameReader::new(), Vec::new());
        let e = r.read(&b, &mut fds).unwrap_err();
        assert!(matches!(e, FrameIoError::FdsTruncated), "{e}");
        assert!(e.to_string().contains("ulimit -n"), "{e}");
    }

    /// Frame A without fds, then frame B with one, both queued before the first read: one
    /// `recvmsg` would return both frames' bytes and B's fd, which was then handed out with A.
    #[test]
    fn fds_stay_with_their_frame_when_frames_queue_up() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let (mut first, mut second) = (Vec::new(), Vec::new());
        trainer::encode(&trainer::Request::State {}, &mut first);
        trainer::encode(&trainer::Request::Info {}, &mut second);
        send_frame(&a, &first, &[]).unwrap();
        send_frame(&a, &second, &[file.as_fd()]).unwrap();
        let (mut r, mut fds) = (FrameReader::new(), Vec::new());
        let body = r.read(&b, &mut fds).unwrap().to_vec();
        assert_eq!(body, first[4..]);
        assert!(
            fds.is_empty(),
            "the first frame came with {} fds",
            fds.len()
        );
        let body = r.read(&b, &mut fds).unwrap().to_vec();
        assert_eq!(body, second[4..]);
        assert_eq!(fds.len(), 1, "the second frame's fd");
    }

    #[test]
    fn frame_and_fd_cross_a_socketpair() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let mut frame = Vec::new();
        trainer::encode(&trainer::Request::State {}, &mut frame);
        send_frame(&a, &frame, &[file.as_fd()]).unwrap();
        send_frame(&a, &frame, &[]).unwrap();
        // A frame larger than the reader's buffer, split over many reads.
        let big =
            trainer::Request::Attach(Box::new(trainer::StreamRequest::new("x".repeat(200_000))));
        let mut big_frame = Vec::new();
        trainer::encode(&big, &mut big_frame);
        let writer = std::thread::spawn(move || send_frame(&a, &big_frame, &[]).map(|_| a));
        let (mut r, mut fds) = (FrameReader::new(), Vec::new());
        let body = r.read(&b, &mut fds).unwrap();
        assert_eq!(
            trainer::decode::<trainer::Request>(body).unwrap(),
            trainer::Request::State {}
        );
        assert_eq!(fds.len(), 1);
        let meta = rustix::fs::fstat(&fds[0]).unwrap();
        assert_eq!(meta.st_ino, rustix::fs::fstat(&file).unwrap().st_ino);
        let body = r.read(&b, &mut fds).unwrap();
        assert_eq!(
            trainer::decode::<trainer::Request>(body).unwrap(),
            trainer::Request::State {}
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
    fn a_zero_idle_limit_times_out_at_once() {
        let (_a, b) = UnixStream::pair().unwrap();
        let mut r = FrameReader::new();
        let limits = ReadLimits {
            idle: Some(Duration::ZERO),
            frame: Duration::from_secs(1),
        };
        let t = Instant::now();
        let e = r.read_data_timed(&b, limits).unwrap_err();
        assert!(
            matches!(
                e,
                FrameIoError::Timeout {
                    phase: ReadPhase::Idle,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    /// A signal while waiting for a frame to start (EINTR: a `recv` under SO_RCVTIMEO is
    /// never restarted, even with SA_RESTART) resumes the wait with what is left of the limit.
    /// Before, each `recv` after one waited the whole limit again: under a signal every few
    /// milliseconds (a sampling profiler's SIGPROF) the wait never ended. Each `recv` here is
    /// cut short by a signal 10 ms in.
    #[test]
    fn signals_while_waiting_for_a_frame_do_not_restart_the_wait() {
        let (_a, b) = UnixStream::pair().unwrap();
        let limit = Duration::from_millis(100);
        let limits = ReadLimits {
            idle: Some(limit),
            frame: Duration::from_secs(1),
        };
        let mut r = FrameReader::new();
        let mut calls = 0;
        let t = Instant::now();
        let e = r
            .timed_range(
                &b,
                limits,
                Ahead::Yes,
                |_: &mut [u8]| -> rustix::io::Result<usize> {
                    calls += 1;
                    if calls > 100 {
                        // A wait still going after a second (the old code's): fail, not hang.
                        return Err(rustix::io::Errno::TIMEDOUT);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    Err(rustix::io::Errno::INTR)
                },
            )
            .unwrap_err();
        assert!(
            matches!(e, FrameIoError::Timeout { phase: ReadPhase::Idle, limit: l } if l == limit),
            "{e} after {calls} recvs"
        );
        // Ten recvs of at least 10 ms each use up the 100 ms.
        assert!(calls <= 10, "{calls} recvs");
        assert!(
            t.elapsed() < Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_wait_for_a_frame_made_again_gets_what_is_left_of_its_limit() {
        let ms = Duration::from_millis;
        assert_eq!(idle_wait(None, Some(ms(5))), Ok(None), "no limit");
        assert_eq!(idle_wait(Some(ms(100)), None), Ok(Some(ms(100))));
        assert_eq!(
            idle_wait(Some(Duration::ZERO), None),
            Ok(Some(Duration::from_micros(1))),
            "a zero limit still reads once"
        );
        assert_eq!(idle_wait(Some(ms(100)), Some(ms(30))), Ok(Some(ms(70))));
        for elapsed in [ms(100), ms(250)] {
            assert_eq!(
                idle_wait(Some(ms(100)), Some(elapsed)),
                Err(rustix::io::Errno::AGAIN)
            );
        }
        assert_eq!(
            idle_wait(Some(Duration::ZERO), Some(Duration::ZERO)),
            Err(rustix::io::Errno::AGAIN),
            "a zero limit reads once only"
        );
    }

    #[test]
    fn has_frame_says_whether_a_whole_frame_is_buffered() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut frame = Vec::new();
        trainer::encode(&trainer::Request::State {}, &mut frame);
        let mut r = FrameReader::new();
        assert!(!r.has_frame());
        // Two frames in one write: the first read buffers both.
        let two = [frame.clone(), frame.clone()].concat();
        (&a).write_all(&two).unwrap();
        r.read_data(&b).unwrap();
        assert!(r.has_frame(), "the second frame came with the first");
        r.read_data(&b).unwrap();
        assert!(!r.has_frame());
        // A frame and most of the next: the rest of it is not a frame yet.
        let (head, tail) = frame.split_at(frame.len() - 1);
        (&a).write_all(&[frame.as_slice(), head].concat()).unwrap();
        r.read_data(&b).unwrap();
        assert!(!r.has_frame(), "part of a frame is buffered");
        (&a).write_all(tail).unwrap();
        r.read_data(&b).unwrap();
        assert!(!r.has_frame());
    }

    #[test]
    fn a_claimed_length_does_not_size_the_buffer() {
        let (a, b) = UnixStream::pair().unwrap();
        // A prefix claiming 1 MiB (the limit) and 10 bytes: the buffer stays at its start size.
        let mut bytes = ((1u32 << 20) - 4).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[b'x'; 10]);
        send_frame(&a, &bytes, &[]).unwrap();
        drop(a);
        let mut r = FrameReader::new();
        assert!(matches!(r.read_data(&b), Err(FrameIoError::Closed)));
        assert_eq!(r.buf.len(), INITIAL_BUFFER);
    }

    #[test]
    fn timed_reads_bound_the_wait_for_a_frame_and_for_its_rest() {
        let limits = ReadLimits {
            idle: Some(Duration::from_millis(100)),
            frame: Duration::from_millis(150),
        };
        let (a, b) = UnixStream::pair().unwrap();
        let mut r = FrameReader::new();
        let t = Instant::now();
        let e = r.read_data_timed(&b, limits).unwrap_err();
        assert!(
            matches!(
                e,
                FrameIoError::Timeout {
                    phase: ReadPhase::Idle,
                    ..
                }
            ),
            "{e}"
        );
        assert!(t.elapsed() >= Duration::from_millis(90));
        // A frame that starts but never ends times out in the frame phase even while bytes
        // keep trickling in.
        let mut frame = Vec::new();
        trainer::encode(&trainer::Request::State {}, &mut frame);
        // The first byte goes now: the read starts in the frame phase however late the
        // trickling thread first runs.
        send_frame(&a, &frame[..1], &[]).unwrap();
        let trickle = std::thread::spawn(move || {
            for byte in &frame[1..frame.len() - 1] {
                send_frame(&a, &[*byte], &[]).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            a
        });
        let e = r.read_data_timed(&b, limits).unwrap_err();
        assert!(
            matches!(
                e,
                FrameIoError::Timeout {
                    phase: ReadPhase::Frame,
                    ..
                }
            ),
            "{e}"
        );
        drop(trickle.join().unwrap());
    }

    #[test]
    fn read_data_takes_frames_and_drops_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let mut frames = Vec::new();
        trainer::encode(&trainer::Request::State {}, &mut frames);
        trainer::encode(&trainer::Request::Release { lease: 3 }, &mut frames);
        send_frame(&a, &frames, &[file.as_fd()]).unwrap();
        // Split mid-prefix and mid-body: the reader waits for the rest.
        let mut next = Vec::new();
        trainer::encode_next(Some(5), &[1, 2], 1, &mut next);
        send_frame(&a, &next[..2], &[]).unwrap();
        let mut r = FrameReader::new();
        let body = r.read_data(&b).unwrap();
        assert_eq!(
            trainer::Request::decode(body).unwrap(),
            trainer::Request::State {}
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
                release: vec![1, 2],
                count: 1,
            }
        );
        writer.join().unwrap();
        assert!(matches!(r.read_data(&b), Err(FrameIoError::Closed)));
    }
}
