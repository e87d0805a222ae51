//! Gather: turn the frags of one `recvmsg(MSG_SOCK_DEVMEM)` into contiguous stream bytes.
//!
//! The receiver passes the shard's slab (from the current offset on) as the iov. After the
//! call, three kinds of bytes may be present (reference devmem.md §4.4):
//!
//! * ordinary TCP bytes (no cmsg at all: an unbound queue, loopback): already in place;
//! * `SCM_DEVMEM_LINEAR` bytes: copied by the kernel to the *front* of the iov, one after
//!   the other, although in the stream they sit between dma-buf frags;
//! * `SCM_DEVMEM_DMABUF` frags: still in the dma-buf, to be copied out (a memcpy for a host
//!   dma-buf; the CUDA engine does the same for device memory).
//!
//! [`gather`] first moves linear bytes to their stream positions (back to front, so no
//! source is overwritten before it moves: each linear piece's iov position is at or before
//! its stream position), then copies the dma-buf frags into the gaps. Every frag's token is
//! queued for return first, whatever happens next, so an error never leaks tokens.
//! A kernel never mixes ordinary and devmem bytes in one call; if the byte count disagrees
//! with the cmsgs the batch is refused.

use crate::cmsg::Frag;
use crate::mem::{DmabufMem, OutOfRange};
use crate::socket::{RecvBatch, TokenBatcher};

/// What one batch contributed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gathered {
    /// Stream bytes now in place at the front of the destination.
    pub bytes: usize,
    /// Dma-buf frags copied.
    pub dmabuf_frags: usize,
    /// Bytes copied out of the dma-buf.
    pub dmabuf_bytes: u64,
    /// Bytes that arrived linear (header split or steering problem).
    pub linear_bytes: u64,
    /// Bytes that arrived as ordinary TCP (no devmem at all).
    pub plain_bytes: u64,
}

/// A batch that cannot be turned into stream bytes (its tokens are queued regardless).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GatherError {
    /// A frag of another binding reached this socket.
    #[error("frag of dma-buf binding {got} on a socket steered to binding {want}")]
    ForeignBinding {
        /// The frag's `dmabuf_id`.
        got: u32,
        /// Our binding's id.
        want: u32,
    },
    /// A frag outside the mapped dma-buf.
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    /// The return value disagrees with the cmsgs (or the destination is too short).
    #[error(
        "recvmsg returned {bytes} bytes but its cmsgs describe {described} bytes (destination {dst_len} bytes)"
    )]
    Inconsistent {
        /// The call's return value.
        bytes: usize,
        /// Bytes the cmsgs describe.
        described: u64,
        /// The destination length.
        dst_len: usize,
    },
    /// Starting a CPU read of the dma-buf failed.
    #[error("DMA_BUF_IOCTL_SYNC: {0}")]
    Sync(String),
    /// The memory given is one this process writes (the emulator's), and not the memory the
    /// batch's frags lie in: reading it could race with its writer, so it is not read.
    #[error(
        "the batch's frags lie in {}, not in the memory at {given:#x} given to the gather",
        frags_home(.batch)
    )]
    ForeignMemory {
        /// The address of the emulated memory the batch's frags lie in (`None`: a kernel
        /// socket's batch).
        batch: Option<u64>,
        /// The address of the memory given.
        given: u64,
    },
}

/// Where a batch's frags lie, in words ([`GatherError::ForeignMemory`]).
fn frags_home(emulated: &Option<u64>) -> String {
    match emulated {
        Some(addr) => format!("the emulated dma-buf at {addr:#x}"),
        None => "a kernel binding's dma-buf".to_string(),
    }
}

/// Where each byte of one batch belongs, for a gather that does not run on the CPU (the
/// CUDA gather kernel): it cannot move bytes inside the host iov, so it copies linear pieces
/// from their iov positions and dma-buf frags from the dma-buf, each to its stream position.
/// Filled by [`plan`]; reusable (its vectors keep their capacity).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GatherPlan {
    /// Stream bytes the batch holds.
    pub bytes: usize,
    /// The batch is ordinary TCP: `bytes` bytes already in stream order at the iov's front.
    pub plain: bool,
    /// Linear pieces: (position in the iov, stream position, length).
    pub linear: Vec<(usize, usize, usize)>,
    /// Dma-buf frags: (offset in the dma-buf, stream position, length).
    pub dmabuf: Vec<(u64, usize, usize)>,
}

impl GatherPlan {
    /// Bytes that come from dma-buf frags.
    pub fn dmabuf_bytes(&self) -> u64 {
        self.dmabuf.iter().map(|&(_, _, len)| len as u64).sum()
    }

    /// Bytes that arrived linear.
    pub fn linear_bytes(&self) -> u64 {
        self.linear.iter().map(|&(_, _, len)| len as u64).sum()
    }
}

/// Fills `out` with the placement of `batch`'s bytes (see [`GatherPlan`]), with the same
/// checks as [`gather`]: the cmsgs must describe exactly the bytes returned, fit in `dst_len`,
/// and name binding `dmabuf_id`. Queues no tokens: the caller returns them once its copies
/// have read the dma-buf.
pub fn plan(
    batch: &RecvBatch<'_>,
    dmabuf_id: u32,
    dst_len: usize,
    out: &mut GatherPlan,
) -> Result<(), GatherError> {
    out.linear.clear();
    out.dmabuf.clear();
    let s = *batch.summary();
    let bytes = batch.bytes();
    out.bytes = bytes;
    out.plain = s.dmabuf_frags == 0 && s.linear_frags == 0;
    if out.plain {
        return Ok(());
    }
    let described = s.dmabuf_bytes + s.linear_bytes;
    if described != bytes as u64 || bytes > dst_len {
        return Err(GatherError::Inconsistent {
            bytes,
            described,
            dst_len,
        });
    }
    let (mut iov_pos, mut pos) = (0usize, 0usize);
    for f in batch.frags() {
        match f {
            Frag::Linear { size } => {
                out.linear.push((iov_pos, pos, size as usize));
                iov_pos += size as usize;
                pos += size as usize;
            }
            Frag::Dmabuf {
                dmabuf_id: got,
                offset,
                size,
                ..
            } => {
                if got != dmabuf_id {
                    return Err(GatherError::ForeignBinding {
                        got,
                        want: dmabuf_id,
                    });
                }
                out.dmabuf.push((offset, pos, size as usize));
                pos += size as usize;
            }
        }
    }
    Ok(())
}

/// Place the bytes of `batch` in stream order at the front of `dst` (the buffer that was
/// passed as the iov), copying dma-buf frags out of `mem`; queue every token in `tokens`.
pub fn gather(
    batch: &RecvBatch<'_>,
    dst: &mut [u8],
    mem: &DmabufMem,
    dmabuf_id: u32,
    tokens: &mut TokenBatcher,
) -> Result<Gathered, GatherError> {
    tokens.push_batch(batch);
    let s = *batch.summary();
    let bytes = batch.bytes();
    if s.dmabuf_frags == 0 && s.linear_frags == 0 {
        // Ordinary TCP data: the kernel already wrote it in place.
        return Ok(Gathered {
            bytes,
            plain_bytes: bytes as u64,
            ..Gathered::default()
        });
    }
    let described = s.dmabuf_bytes + s.linear_bytes;
    if described != bytes as u64 || bytes > dst.len() {
        return Err(GatherError::Inconsistent {
            bytes,
            described,
            dst_len: dst.len(),
        });
    }
    for f in batch.frags() {
        if let Frag::Dmabuf { dmabuf_id: got, .. } = f
            && got != dmabuf_id
        {
            return Err(GatherError::ForeignBinding {
                got,
                want: dmabuf_id,
            });
        }
    }
    if s.linear_frags > 0 {
        place_linear(batch, dst, s.linear_frags);
    }
    if s.dmabuf_frags > 0 {
        copy_dmabuf(batch, dst, mem)?;
    }
    Ok(Gathered {
        bytes,
        dmabuf_frags: s.dmabuf_frags,
        dmabuf_bytes: s.dmabuf_bytes,
        linear_bytes: s.linear_bytes,
        plain_bytes: 0,
    })
}

/// Moves the linear pieces of `batch` (packed at the front of `dst`, where the kernel wrote
/// them) to their stream positions, last first so none overwrites one not yet moved.
fn place_linear(batch: &RecvBatch<'_>, dst: &mut [u8], linear_frags: usize) {
    // (iov position, stream position, len) of each linear piece; a rare, error-path case, so
    // one small allocation per batch is fine.
    let mut moves = Vec::with_capacity(linear_frags);
    let (mut iov_pos, mut pos) = (0usize, 0usize);
    for f in batch.frags() {
        match f {
            Frag::Linear { size } => {
                moves.push((iov_pos, pos, size as usize));
                iov_pos += size as usize;
                pos += size as usize;
            }
            Frag::Dmabuf { size, .. } => pos += size as usize,
        }
    }
    for &(from, to, len) in moves.iter().rev() {
        dst.copy_within(from..from + len, to);
    }
}

/// Copies each dma-buf frag of `batch` out of `mem` to its stream position in `dst`, inside
/// one CPU-access window of the dma-buf.
fn copy_dmabuf(batch: &RecvBatch<'_>, dst: &mut [u8], mem: &DmabufMem) -> Result<(), GatherError> {
    // Memory this process writes (the emulator's) is read only for frags of its own batches:
    // the emulator writes no page a frag of a live batch points into, but any other.
    if mem.written_here() && batch.mem_addr() != Some(mem.addr()) {
        return Err(GatherError::ForeignMemory {
            batch: batch.mem_addr(),
            given: mem.addr(),
        });
    }
    mem.begin_cpu_read()
        .map_err(|e| GatherError::Sync(e.to_string()))?;
    let mut pos = 0usize;
    let mut result = Ok(());
    for f in batch.frags() {
        match f {
            Frag::Linear { size } => pos += size as usize,
            Frag::Dmabuf { offset, size, .. } => {
                let end = pos + size as usize;
                #[allow(unsafe_code)] // copy_out: the frag's token is held (SAFETY below)
                // SAFETY: the frag came with `batch`, which borrows the socket that holds
                // its token (queued in `tokens` by `gather`, returned only after this), so
                // neither the NIC nor the emulator writes those bytes now; `mem` is the
                // memory the frag lies in: the emulator's own (checked above), or memory no
                // thread of this process writes.
                let copied = unsafe { mem.copy_out(offset, &mut dst[pos..end]) };
                if let Err(e) = copied {
                    result = Err(e);
                    break;
                }
                pos = end;
            }
        }
    }
    let _ = mem.end_cpu_read();
    Ok(result?)
}
