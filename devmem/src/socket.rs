//! Devmem receive on a TCP socket: `recvmsg(MSG_SOCK_DEVMEM)` and token return.
//!
//! Kernel interface (reference devmem.md §4.4, §4.5): `recvmsg` with `MSG_SOCK_DEVMEM`
//! describes each frag in a cmsg (parsed by [`crate::cmsg`]); the payload stays in the
//! dma-buf and each frag's token must be returned with
//! `setsockopt(SOL_SOCKET, SO_DEVMEM_DONTNEED, struct dmabuf_token[], n * 8)`, whose positive
//! return value is the number of frags freed.
//!
//! Steering/header-split problems are reported, not hidden: bytes copied into the iov
//! (`SCM_DEVMEM_LINEAR` frags, or ordinary TCP data with no devmem cmsg at all, which is what
//! an unbound queue or loopback produces) are counted in the [`RecvBatch`] and
//! [`RecvBatch::check_devmem_only`] turns them into [`DevmemError::NotDevmem`]. They are a
//! flag rather than an error of `recv_frags` itself because the same batch can also carry
//! devmem frags whose tokens must still be returned; failing the call would leak them until
//! the socket closes.
#![forbid(unsafe_code)]

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};

use crate::cmsg::{CmsgError, CmsgIter, CmsgSummary, Frag};
use crate::{MAX_DONTNEED_FRAGS, MAX_DONTNEED_TOKENS, sys};

/// `ETOOSMALL` (include/linux/errno.h): a kernel-internal errno that reaches userspace when
/// not even one devmem cmsg fits in the control buffer.
pub const ETOOSMALL: i32 = 525;

/// Default control buffer: 64 KiB, about 1600 frags at 40 bytes each (kperf uses 64 KiB,
/// ncdevmem 80000 bytes).
pub const DEFAULT_CONTROL_LEN: usize = 64 * 1024;

/// Errors of devmem receive and token return.
#[derive(Debug, thiserror::Error)]
pub enum DevmemError {
    /// `recvmsg` failed with `ETOOSMALL`: the control buffer cannot hold even one cmsg.
    #[error(
        "recvmsg(MSG_SOCK_DEVMEM): control buffer too small ({capacity} bytes) for even one devmem cmsg (ETOOSMALL)"
    )]
    ControlBufferTooSmall {
        /// The control buffer size used.
        capacity: usize,
    },
    /// A syscall failed.
    #[error("{call}: {source}")]
    Syscall {
        /// The call, e.g. `recvmsg(MSG_SOCK_DEVMEM)`.
        call: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The control buffer the kernel returned did not parse.
    #[error("malformed devmem control messages: {0}")]
    Cmsg(#[from] CmsgError),
    /// `SO_DEVMEM_DONTNEED` freed fewer (or more) frags than were returned: tokens that
    /// were unknown to the socket, returned twice, or beyond the kernel's per-call limit.
    #[error("SO_DEVMEM_DONTNEED freed {freed} frags, expected {requested}")]
    DontneedMismatch {
        /// Frags handed back.
        requested: usize,
        /// Frags the kernel reported freed.
        freed: usize,
    },
    /// Data arrived outside device memory: header split or flow steering is not set up.
    #[error(
        "{linear_bytes} bytes in SCM_DEVMEM_LINEAR frags and {plain_bytes} bytes of ordinary TCP data arrived in host memory: check header split (ethtool -G <if> tcp-data-split on, hds-thresh 0) and that the flow is steered to a bound queue"
    )]
    NotDevmem {
        /// Bytes of `SCM_DEVMEM_LINEAR` frags.
        linear_bytes: u64,
        /// Bytes with no devmem cmsg at all (unbound queue, loopback).
        plain_bytes: u64,
    },
}

impl DevmemError {
    /// True for `EAGAIN`/`EWOULDBLOCK` on a non-blocking socket.
    pub fn is_would_block(&self) -> bool {
        matches!(self, Self::Syscall { source, .. } if source.kind() == io::ErrorKind::WouldBlock)
    }

    /// The errno, for syscall failures (525 for `ControlBufferTooSmall`).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::ControlBufferTooSmall { .. } => Some(ETOOSMALL),
            Self::Syscall { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Map a failed `recvmsg(MSG_SOCK_DEVMEM)` to our error (ETOOSMALL gets its own variant).
fn recv_error(source: io::Error, capacity: usize) -> DevmemError {
    if source.raw_os_error() == Some(ETOOSMALL) {
        DevmemError::ControlBufferTooSmall { capacity }
    } else {
        DevmemError::Syscall {
            call: "recvmsg(MSG_SOCK_DEVMEM)",
            source,
        }
    }
}

/// A TCP socket used for devmem receive, with its control buffer (allocated once).
/// `S` is `TcpStream` (owning) or `&TcpStream` (borrowing), or any other `AsFd` TCP socket.
pub struct DevmemSocket<S: AsFd = TcpStream> {
    sock: S,
    control: Box<[u8]>,
}

impl<S: AsFd> std::fmt::Debug for DevmemSocket<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevmemSocket")
            .field("fd", &self.sock.as_fd())
            .field("control_len", &self.control.len())
            .finish()
    }
}

impl<S: AsFd> DevmemSocket<S> {
    /// Wrap `sock` with a [`DEFAULT_CONTROL_LEN`] control buffer.
    pub fn new(sock: S) -> Self {
        Self::with_control_len(sock, DEFAULT_CONTROL_LEN)
    }

    /// Wrap `sock` with a control buffer of `len` bytes, rounded down to a multiple of 8
    /// (`CMSG_ALIGN`): the kernel cuts a cmsg that does not fit at the buffer's end, and one
    /// cut at an unaligned length cannot be parsed (the frags before it would be lost).
    pub fn with_control_len(sock: S, len: usize) -> Self {
        Self {
            sock,
            control: vec![0u8; len & !7].into_boxed_slice(),
        }
    }

    /// The socket.
    pub fn get_ref(&self) -> &S {
        &self.sock
    }

    /// Unwrap the socket.
    pub fn into_inner(self) -> S {
        self.sock
    }

    /// One `recvmsg(MSG_SOCK_DEVMEM)`. The length of `iov_buf` caps the bytes received in
    /// this call (devmem bytes included); only linear or ordinary bytes are written into it.
    /// Blocks or not according to the socket's mode (see [`DevmemError::is_would_block`]).
    /// The returned batch borrows the control buffer; hand its tokens to a
    /// [`TokenBatcher`] before the next call.
    pub fn recv_frags(&mut self, iov_buf: &mut [u8]) -> Result<RecvBatch<'_>, DevmemError> {
        let capacity = self.control.len();
        let out = sys::recvmsg_devmem(self.sock.as_fd(), iov_buf, &mut self.control, 0)
            .map_err(|e| recv_error(e, capacity))?;
        RecvBatch::parse(
            out.bytes,
            &self.control[..out.control_len],
            out.msg_flags & libc::MSG_CTRUNC != 0,
        )
    }

    /// Return the tokens collected in `batcher` on this socket (see [`TokenBatcher::flush`]).
    pub fn return_tokens(&self, batcher: &mut TokenBatcher) -> Result<usize, DevmemError> {
        batcher.flush(self.sock.as_fd())
    }
}

/// A devmem receive endpoint: the real kernel socket ([`DevmemSocket`]) or the emulator
/// ([`crate::emu::EmuSocket`]). The receive path (gather, token return) is written against
/// this, so the same code runs on hardware and in tests.
pub trait DevmemRecv {
    /// One `recvmsg(MSG_SOCK_DEVMEM)` of at most `iov_buf.len()` bytes (see
    /// [`DevmemSocket::recv_frags`]).
    fn recv_frags(&mut self, iov_buf: &mut [u8]) -> Result<RecvBatch<'_>, DevmemError>;
    /// Return the tokens pending in `batcher` with `SO_DEVMEM_DONTNEED`.
    fn return_tokens(&mut self, batcher: &mut TokenBatcher) -> Result<usize, DevmemError>;
}

impl<S: AsFd> DevmemRecv for DevmemSocket<S> {
    fn recv_frags(&mut self, iov_buf: &mut [u8]) -> Result<RecvBatch<'_>, DevmemError> {
        DevmemSocket::recv_frags(self, iov_buf)
    }

    fn return_tokens(&mut self, batcher: &mut TokenBatcher) -> Result<usize, DevmemError> {
        DevmemSocket::return_tokens(self, batcher)
    }
}

/// What one `recvmsg(MSG_SOCK_DEVMEM)` returned. The control bytes have been validated.
#[derive(Debug, Clone, Copy)]
pub struct RecvBatch<'a> {
    bytes: usize,
    control: &'a [u8],
    summary: CmsgSummary,
    ctrunc: bool,
    /// The address of the emulator's memory its frags lie in ([`RecvBatch::in_mem`]);
    /// `None` for the kernel's.
    mem: Option<u64>,
}

impl<'a> RecvBatch<'a> {
    /// Validate `control` (the bytes the kernel wrote) and describe the call.
    pub(crate) fn parse(
        bytes: usize,
        control: &'a [u8],
        ctrunc: bool,
    ) -> Result<Self, DevmemError> {
        let summary = crate::cmsg::summarize(control)?;
        Ok(Self {
            bytes,
            control,
            summary,
            ctrunc,
            mem: None,
        })
    }

    /// This batch's frags lie in the emulator's memory mapped at `addr`
    /// ([`crate::mem::DmabufMem::addr`]): the only memory the gather reads them from, since
    /// the emulator writes any other page of it meanwhile.
    pub(crate) fn in_mem(self, addr: u64) -> Self {
        Self {
            mem: Some(addr),
            ..self
        }
    }

    /// See [`RecvBatch::in_mem`].
    pub(crate) fn mem_addr(&self) -> Option<u64> {
        self.mem
    }

    /// The return value of `recvmsg`: linear + ordinary + devmem bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// End of stream: nothing received and no cmsg.
    pub fn is_eof(&self) -> bool {
        self.bytes == 0 && self.control.is_empty()
    }

    /// The frags, in order. Validated already, so the iterator yields only frags.
    pub fn frags(&self) -> impl Iterator<Item = Frag> + 'a {
        CmsgIter::new(self.control).filter_map(Result::ok)
    }

    /// Totals over the cmsgs (frag counts and bytes, skipped foreign cmsgs).
    pub fn summary(&self) -> &CmsgSummary {
        &self.summary
    }

    /// Bytes in `SCM_DEVMEM_LINEAR` frags, copied into the iov.
    pub fn linear_bytes(&self) -> u64 {
        self.summary.linear_bytes
    }

    /// Bytes received without any devmem cmsg (ordinary TCP: an unbound queue or loopback),
    /// copied into the iov.
    pub fn plain_bytes(&self) -> u64 {
        (self.bytes as u64).saturating_sub(self.summary.dmabuf_bytes + self.summary.linear_bytes)
    }

    /// `MSG_CTRUNC` was set: a non-devmem cmsg did not fit (devmem cmsgs are never truncated).
    pub fn control_truncated(&self) -> bool {
        self.ctrunc
    }

    /// Err([`DevmemError::NotDevmem`]) if any byte landed in host memory (LINEAR frags or
    /// ordinary data): the header-split / flow-steering check of the caller-facing API.
    /// Return the batch's tokens first either way.
    pub fn check_devmem_only(&self) -> Result<(), DevmemError> {
        let (linear_bytes, plain_bytes) = (self.linear_bytes(), self.plain_bytes());
        if linear_bytes == 0 && plain_bytes == 0 {
            Ok(())
        } else {
            Err(DevmemError::NotDevmem {
                linear_bytes,
                plain_bytes,
            })
        }
    }
}

/// Collects frag tokens and returns them with `SO_DEVMEM_DONTNEED`, in calls of at most
/// [`MAX_DONTNEED_TOKENS`] ranges and [`MAX_DONTNEED_FRAGS`] frags. Only truly consecutive
/// token values are coalesced into one `(start, count)` range (tokens of one `recvmsg` are
/// usually, but not always, consecutive).
#[derive(Debug, Default, Clone)]
pub struct TokenBatcher {
    /// Pending ranges; each holds at most MAX_DONTNEED_FRAGS tokens.
    ranges: Vec<libc::dmabuf_token>,
    frags: usize,
}

impl TokenBatcher {
    /// An empty batcher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queue one token.
    pub fn push(&mut self, token: u32) {
        self.frags += 1;
        if let Some(last) = self.ranges.last_mut()
            && (last.token_count as usize) < MAX_DONTNEED_FRAGS
            && last.token_start.checked_add(last.token_count) == Some(token)
        {
            last.token_count += 1;
            return;
        }
        self.ranges.push(libc::dmabuf_token {
            token_start: token,
            token_count: 1,
        });
    }

    /// Queue the tokens of every DMABUF frag of `batch`.
    pub fn push_batch(&mut self, batch: &RecvBatch<'_>) {
        for f in batch.frags() {
            if let Frag::Dmabuf { token, .. } = f {
                self.push(token);
            }
        }
    }

    /// Tokens pending.
    pub fn pending_frags(&self) -> usize {
        self.frags
    }

    /// `(start, count)` ranges pending.
    pub fn pending_ranges(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.ranges.iter().map(|r| (r.token_start, r.token_count))
    }

    /// True when a flush would fill at least one whole call; a natural point to flush.
    pub fn should_flush(&self) -> bool {
        self.ranges.len() >= MAX_DONTNEED_TOKENS || self.frags >= MAX_DONTNEED_FRAGS
    }

    /// Forget every pending token (they are released when the socket closes anyway).
    pub fn clear(&mut self) {
        self.ranges.clear();
        self.frags = 0;
    }

    /// Return every pending token on `sock` (the socket that received them). Returns the
    /// frags freed. Checks each call's return value against the frags it handed back; a
    /// mismatch is reported as [`DevmemError::DontneedMismatch`] (with totals) after all
    /// calls were made. On a syscall error the tokens of that call and later ones stay
    /// pending.
    pub fn flush(&mut self, sock: BorrowedFd<'_>) -> Result<usize, DevmemError> {
        self.flush_with(|tokens| sys::dontneed(sock, tokens))
    }

    /// [`TokenBatcher::flush`] with the syscall supplied by the caller (tests use a fake).
    pub fn flush_with(
        &mut self,
        mut dontneed: impl FnMut(&[libc::dmabuf_token]) -> io::Result<usize>,
    ) -> Result<usize, DevmemError> {
        let empty = libc::dmabuf_token {
            token_start: 0,
            token_count: 0,
        };
        let mut call = [empty; MAX_DONTNEED_TOKENS];
        let (mut requested, mut freed) = (0usize, 0usize);
        // Cursor: range index and how many tokens of that range are already sent.
        let (mut idx, mut used) = (0usize, 0u32);
        while idx < self.ranges.len() {
            let (call_start, call_used) = (idx, used);
            let (mut n, mut frags) = (0usize, 0usize);
            while idx < self.ranges.len() && n < MAX_DONTNEED_TOKENS && frags < MAX_DONTNEED_FRAGS {
                let r = self.ranges[idx];
                let left = r.token_count - used;
                let take = left.min((MAX_DONTNEED_FRAGS - frags) as u32);
                call[n] = libc::dmabuf_token {
                    token_start: r.token_start + used,
                    token_count: take,
                };
                n += 1;
                frags += take as usize;
                if take == left {
                    idx += 1;
                    used = 0;
                } else {
                    used += take;
                }
            }
            match dontneed(&call[..n]) {
                Ok(got) => {
                    requested += frags;
                    freed += got;
                }
                Err(source) => {
                    // Keep what was not acknowledged: from this call on.
                    self.ranges.drain(..call_start);
                    if let Some(first) = self.ranges.first_mut() {
                        first.token_start += call_used;
                        first.token_count -= call_used;
                    }
                    self.frags = self.ranges.iter().map(|r| r.token_count as usize).sum();
                    return Err(DevmemError::Syscall {
                        call: "setsockopt(SO_DEVMEM_DONTNEED)",
                        source,
                    });
                }
            }
        }
        self.clear();
        if requested == freed {
            Ok(freed)
        } else {
            Err(DevmemError::DontneedMismatch { requested, freed })
        }
    }
}

#[cfg(test)]
mod tests;
