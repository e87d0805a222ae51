//! The receivers `shardwire bench --compare-uring` measures the node's own path against:
//! [`MultishotRecv`] (buffers it owns, in either layout of [`Buffers`]) and [`RecvInto`] (the
//! caller's buffer, one payload at a time). The node itself uses [`super::RecvQueue`]. They
//! share the ring, its buffer group and its cancel-before-free rules with it ([`super::Core`]).

use std::io;
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::time::Duration;

use super::{Core, Event, Pages};

/// How the provided buffers are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers {
    /// `count` buffers of `len` bytes, each used for one completion.
    Copy { len: u32, count: u16 },
    /// `count` slots of `len` bytes, each filled by consecutive completions.
    Slots { len: u32, count: u16 },
}

impl Buffers {
    fn shape(self) -> (usize, u16, bool) {
        match self {
            Self::Copy { len, count } => (len as usize, count, false),
            Self::Slots { len, count } => (len as usize, count, true),
        }
    }
}

/// Bytes one completion placed: `data` sits at `offset` in buffer `buf`.
#[derive(Debug)]
pub struct Received<'a> {
    /// Buffer id (0..count).
    pub buf: u16,
    /// Where in the buffer the bytes start (always 0 for `Copy`).
    pub offset: usize,
    /// The bytes.
    pub data: &'a [u8],
}
/// A TCP socket read by one armed multishot receive into buffers it owns.
pub struct MultishotRecv {
    // Declared first: dropped (receive cancelled, group unregistered) before the buffers.
    pub(super) core: Core,
    bufs: ManuallyDrop<Pages>,
    buf_len: usize,
    incremental: bool,
    /// Per buffer: bytes the kernel placed in it since it was last given back.
    filled: Vec<usize>,
    retired: Vec<u16>,
    eof: bool,
}

impl std::fmt::Debug for MultishotRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultishotRecv")
            .field("buf_len", &self.buf_len)
            .field("count", &self.core.count)
            .field("incremental", &self.incremental)
            .field("armed", &self.core.armed)
            .finish_non_exhaustive()
    }
}

impl MultishotRecv {
    /// Sets up a ring over `sock` with `layout`'s buffers (count a power of two up to 32768)
    /// and arms one multishot receive.
    pub fn new(sock: TcpStream, layout: Buffers) -> io::Result<Self> {
        let (buf_len, count, incremental) = layout.shape();
        if buf_len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "provided buffers: length 0",
            ));
        }
        let core = Core::new(sock, count, incremental)?;
        let bufs = Pages::new(buf_len * usize::from(count))?;
        let mut me = Self {
            core,
            bufs: ManuallyDrop::new(bufs),
            buf_len,
            incremental,
            filled: vec![0; usize::from(count)],
            retired: Vec::new(),
            eof: false,
        };
        for b in 0..count {
            me.give_back(b);
        }
        me.core.publish();
        me.core.arm()?;
        Ok(me)
    }

    /// Hands buffer `b` (whole) back to the kernel at the next [`Core::publish`].
    fn give_back(&mut self, b: u16) {
        let addr = self.bufs.addr(usize::from(b) * self.buf_len);
        self.core.push(addr, self.buf_len as u32, b);
        self.filled[usize::from(b)] = 0;
    }

    /// Waits for at least one completion and hands every completed piece to `f` in order.
    /// Returns the bytes handed over; 0 means the peer closed the connection. A wait with no
    /// completion for a minute fails (`TimedOut`).
    pub fn wait(&mut self, mut f: impl FnMut(Received<'_>)) -> io::Result<usize> {
        let mut total = 0usize;
        // A wait can bring only a receive ended for want of buffers: wait again.
        while total == 0 && !self.eof {
            total = self.wait_once(&mut f)?;
        }
        Ok(total)
    }

    fn wait_once(&mut self, f: &mut impl FnMut(Received<'_>)) -> io::Result<usize> {
        let mut total = 0usize;
        let (buf_len, incremental, base) = (self.buf_len, self.incremental, self.bufs.ptr);
        let (filled, retired, eof) = (&mut self.filled, &mut self.retired, &mut self.eof);
        let r = self.core.wait(Some(Duration::from_secs(60)), |ev| {
            let Event::Data { buf, n, more } = ev else {
                *eof = true;
                return Ok(());
            };
            let off = if incremental {
                filled[usize::from(buf)]
            } else {
                0
            };
            if off + n > buf_len {
                return Err(io::Error::other(format!(
                    "io_uring placed {n} bytes at {off} of buffer {buf}, past its {buf_len} bytes"
                )));
            }
            let at = base.as_ptr().wrapping_add(usize::from(buf) * buf_len + off);
            // SAFETY: the kernel has finished writing these `n` bytes (their completion is
            // here) and will not write them again until the buffer is given back, which
            // happens after `f` returns.
            let data = unsafe { std::slice::from_raw_parts(at, n) };
            f(Received {
                buf,
                offset: off,
                data,
            });
            total += n;
            if incremental && more {
                filled[usize::from(buf)] = off + n;
            } else {
                retired.push(buf);
            }
            Ok(())
        });
        for i in 0..self.retired.len() {
            self.give_back(self.retired[i]);
        }
        self.retired.clear();
        self.core.publish();
        r?;
        if !self.core.armed && !self.eof {
            self.core.arm()?;
        }
        Ok(total)
    }
}

impl Drop for MultishotRecv {
    fn drop(&mut self) {
        if self.core.disarm(false) {
            // SAFETY: no receive is in flight, so the kernel writes no buffer any more (an
            // unconfirmed cancel leaks them instead).
            unsafe { ManuallyDrop::drop(&mut self.bufs) };
        }
    }
}

/// Receives payloads one at a time straight into the caller's buffer (the node's plain-TCP
/// data connections): the buffer is the ring's one provided buffer for as long as its
/// payload takes, consumed incrementally.
pub struct RecvInto {
    pub(super) core: Core,
    /// A receive ended with the caller's buffer possibly still in the ring: never used again.
    pub(super) poisoned: bool,
}

impl std::fmt::Debug for RecvInto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvInto")
            .field("armed", &self.core.armed)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl RecvInto {
    /// Sets up the ring over `sock` (fails where io_uring is unavailable or lacks
    /// incremental buffers: Linux before 6.12, or a seccomp policy that refuses it).
    pub fn new(sock: TcpStream) -> io::Result<Self> {
        Ok(Self {
            core: Core::new(sock, 1, true)?,
            poisoned: false,
        })
    }

    /// The socket (for socket options).
    pub fn socket(&self) -> &TcpStream {
        &self.core.sock
    }

    /// Caps each completion at `bytes` (0: no cap), as [`super::RecvQueue::set_piece_cap`].
    pub fn set_piece_cap(&mut self, bytes: u32) {
        self.core.cap = bytes;
    }

    /// Fills `dst` with the connection's next `dst.len()` bytes, handing each piece to
    /// `piece` in order as it completes (with the bytes placed before it). A wait with no
    /// completion for `stall` fails; so does a close before `dst` is full. After an error
    /// (or a panic in `piece`) the receiver is unusable: the socket is shut down and the
    /// kernel has let go of `dst` before this returns.
    pub fn recv(
        &mut self,
        dst: &mut [u8],
        stall: Duration,
        mut piece: impl FnMut(usize, &[u8]),
    ) -> io::Result<()> {
        if self.poisoned {
            return Err(io::Error::other(
                "this io_uring receiver failed earlier and is not used again",
            ));
        }
        let len = dst.len();
        let Ok(len32) = u32::try_from(len) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a payload of {len} bytes is over the 4 GiB a provided buffer holds"),
            ));
        };
        if len == 0 {
            return Ok(());
        }
        let base = dst.as_mut_ptr();
        self.core.push(base as u64, len32, 0);
        self.core.publish();
        // `dst` is in the ring now: whatever happens, it leaves the ring before `dst` does.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.fill(base, len, stall, &mut piece)
        }));
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.abandon();
                Err(e)
            }
            Err(panic) => {
                self.abandon();
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// The receive loop of [`Self::recv`] over the posted `len` bytes at `base`.
    fn fill(
        &mut self,
        base: *mut u8,
        len: usize,
        stall: Duration,
        piece: &mut impl FnMut(usize, &[u8]),
    ) -> io::Result<()> {
        let mut filled = 0usize;
        while filled < len {
            if !self.core.armed {
                self.core.arm()?;
            }
            let mut closed = false;
            self.core.wait(Some(stall), |ev| match ev {
                Event::Eof => {
                    closed = true;
                    Ok(())
                }
                // The buffer takes more exactly while the payload is not yet complete.
                Event::Data { n, more, .. } if filled + n > len || more != (filled + n < len) => {
                    Err(io::Error::other(format!(
                        "io_uring placed {n} bytes at {filled} of a {len}-byte payload (buffer kept: {more})"
                    )))
                }
                Event::Data { n, .. } => {
                    // SAFETY: these `n` bytes of the posted buffer are complete (their
                    // completion is here), and the kernel does not write them again.
                    let done = unsafe { std::slice::from_raw_parts(base.add(filled), n) };
                    piece(filled, done);
                    filled += n;
                    Ok(())
                }
            })?;
            if closed && filled < len {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("connection closed after {filled} of {len} payload bytes"),
                ));
            }
        }
        Ok(())
    }

    /// After a failed receive: shut the socket, cancel the receive and make sure the kernel
    /// can no longer write the caller's buffer before it is handed back.
    fn abandon(&mut self) {
        self.poisoned = true;
        if !self.core.disarm(true) || !self.core.unregister() {
            // The kernel might still write a buffer its owner is about to free; nothing
            // safe remains but to stop.
            eprintln!("shardwire: an io_uring receive could not be cancelled; aborting");
            std::process::abort();
        }
    }
}
