//! Parser for the control messages of a `recvmsg(MSG_SOCK_DEVMEM)` call.
//!
//! The kernel describes every received frag with one cmsg at level `SOL_SOCKET`
//! (reference devmem.md §2, §4.4):
//!
//! * `SCM_DEVMEM_DMABUF` (79): a payload frag that stayed in device memory; the payload is a
//!   `struct dmabuf_cmsg` (`include/uapi/linux/uio.h`) with offset, size, token and binding id;
//! * `SCM_DEVMEM_LINEAR` (78): header bytes that stayed in the skb's linear part and were
//!   copied into `msg_iov` (only `frag_size` is set). That only happens when header split did
//!   not separate the payload, so callers treat it as a NIC configuration problem.
//!
//! The layout of one cmsg on 64-bit Linux is `struct cmsghdr { size_t cmsg_len; int
//! cmsg_level; int cmsg_type; }` (16 bytes) followed by the payload, each cmsg padded to
//! `CMSG_ALIGN` (8 bytes). This module is a pure function over the control bytes, with no
//! `unsafe` and no allocation per frag, so it can be unit-tested on synthetic buffers and
//! fuzzed (`devmem/fuzz`). The kernel never truncates devmem cmsgs (`put_cmsg_notrunc`), so
//! any structural problem here is a bug (ours or the kernel's) and is reported as a typed
//! [`CmsgError`], never a panic.
#![forbid(unsafe_code)]

use crate::{SO_DEVMEM_DMABUF, SO_DEVMEM_LINEAR};

/// `sizeof(size_t)`: the width of `cmsg_len` and the `CMSG_ALIGN` unit.
const WORD: usize = std::mem::size_of::<usize>();
/// `sizeof(struct cmsghdr)` = `CMSG_LEN(0)` (16 on 64-bit targets).
pub const CMSG_HDR_LEN: usize = WORD + 4 + 4;
/// `sizeof(struct dmabuf_cmsg)`.
pub const DMABUF_CMSG_LEN: usize = 24;
/// `CMSG_SPACE(sizeof(struct dmabuf_cmsg))`: the control bytes one frag costs (40 on 64-bit).
pub const DMABUF_CMSG_SPACE: usize = cmsg_align(CMSG_HDR_LEN) + cmsg_align(DMABUF_CMSG_LEN);

/// `SOL_SOCKET` on the asm-generic architectures this crate pins (see the const checks in
/// lib.rs).
const SOL_SOCKET: i32 = 1;

#[cfg(target_os = "linux")]
const _: () = {
    assert!(std::mem::size_of::<libc::cmsghdr>() == CMSG_HDR_LEN);
    assert!(std::mem::size_of::<libc::dmabuf_cmsg>() == DMABUF_CMSG_LEN);
    assert!(std::mem::offset_of!(libc::dmabuf_cmsg, frag_offset) == 0);
    assert!(std::mem::offset_of!(libc::dmabuf_cmsg, frag_size) == 8);
    assert!(std::mem::offset_of!(libc::dmabuf_cmsg, frag_token) == 12);
    assert!(std::mem::offset_of!(libc::dmabuf_cmsg, dmabuf_id) == 16);
    assert!(std::mem::offset_of!(libc::dmabuf_cmsg, flags) == 20);
    assert!(libc::SOL_SOCKET == SOL_SOCKET);
};

/// `CMSG_ALIGN(len)`.
pub const fn cmsg_align(len: usize) -> usize {
    (len + WORD - 1) & !(WORD - 1)
}

/// One frag described by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frag {
    /// Payload that stayed in the dma-buf: `size` bytes at `offset` inside binding
    /// `dmabuf_id`. `token` must be handed back with `SO_DEVMEM_DONTNEED` (see
    /// [`crate::socket::TokenBatcher`]) once the bytes have been consumed.
    Dmabuf {
        /// Byte offset of the frag inside the dma-buf.
        offset: u64,
        /// Bytes in the frag.
        size: u32,
        /// Token to return with `SO_DEVMEM_DONTNEED`.
        token: u32,
        /// The binding id (`bind-rx` reply) the frag landed in.
        dmabuf_id: u32,
    },
    /// `size` bytes that were copied into `msg_iov` because they stayed in the skb's linear
    /// part: header split did not separate them (a NIC configuration/steering problem).
    Linear {
        /// Bytes copied into the iov.
        size: u32,
    },
}

/// A malformed control buffer. Offsets are byte offsets into the control buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CmsgError {
    /// Fewer bytes than a `cmsghdr` are left where the next cmsg should start.
    #[error(
        "truncated cmsg header at offset {offset}: {remaining} bytes left, a header needs {CMSG_HDR_LEN}"
    )]
    TruncatedHeader {
        /// Where the header should start.
        offset: usize,
        /// Bytes left in the buffer.
        remaining: usize,
    },
    /// `cmsg_len` is smaller than the header itself.
    #[error(
        "cmsg at offset {offset} has cmsg_len {len}, smaller than the {CMSG_HDR_LEN}-byte header"
    )]
    LenTooSmall {
        /// Where the cmsg starts.
        offset: usize,
        /// Its `cmsg_len`.
        len: usize,
    },
    /// `cmsg_len` runs past the end of the control buffer.
    #[error("cmsg at offset {offset} has cmsg_len {len} but only {remaining} bytes are left")]
    RunsPastEnd {
        /// Where the cmsg starts.
        offset: usize,
        /// Its `cmsg_len`.
        len: usize,
        /// Bytes left from `offset`.
        remaining: usize,
    },
    /// The control length is not a multiple of `CMSG_ALIGN`: the kernel always consumes
    /// `CMSG_SPACE` per cmsg, so trailing bytes after the last cmsg mean a bad length.
    #[error("control length {len} is not a multiple of {WORD} (misaligned trailing bytes)")]
    Misaligned {
        /// The control length.
        len: usize,
    },
    /// A devmem cmsg whose payload is shorter than `struct dmabuf_cmsg`.
    #[error(
        "devmem cmsg type {cmsg_type} at offset {offset} carries {len} payload bytes, expected at least {DMABUF_CMSG_LEN}"
    )]
    ShortPayload {
        /// Where the cmsg starts.
        offset: usize,
        /// `SCM_DEVMEM_DMABUF` or `SCM_DEVMEM_LINEAR`.
        cmsg_type: i32,
        /// Payload bytes present.
        len: usize,
    },
}

/// Iterator over the frags of a control buffer. Cmsgs of other levels or types are skipped
/// and counted ([`CmsgIter::skipped`]). After the first error the iterator is finished.
#[derive(Debug, Clone)]
pub struct CmsgIter<'a> {
    buf: &'a [u8],
    pos: usize,
    skipped: usize,
    failed: bool,
}

impl<'a> CmsgIter<'a> {
    /// Iterate over `control`, the first `msg_controllen` bytes of the control buffer.
    pub fn new(control: &'a [u8]) -> Self {
        Self {
            buf: control,
            pos: 0,
            skipped: 0,
            failed: false,
        }
    }

    /// Cmsgs of another level or type skipped so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    fn step(&mut self) -> Result<Option<Frag>, CmsgError> {
        loop {
            let remaining = self.buf.len() - self.pos;
            if remaining == 0 {
                return Ok(None);
            }
            let offset = self.pos;
            if remaining < CMSG_HDR_LEN {
                return Err(if !self.buf.len().is_multiple_of(WORD) {
                    CmsgError::Misaligned {
                        len: self.buf.len(),
                    }
                } else {
                    CmsgError::TruncatedHeader { offset, remaining }
                });
            }
            let hdr = &self.buf[offset..offset + CMSG_HDR_LEN];
            let len = usize::from_ne_bytes(word(hdr, 0));
            let level = i32::from_ne_bytes(four(hdr, WORD));
            let cmsg_type = i32::from_ne_bytes(four(hdr, WORD + 4));
            if len < CMSG_HDR_LEN {
                return Err(CmsgError::LenTooSmall { offset, len });
            }
            if len > remaining {
                return Err(CmsgError::RunsPastEnd {
                    offset,
                    len,
                    remaining,
                });
            }
            // The padding of the last cmsg may be missing only if the buffer is misaligned;
            // `min` keeps the cursor in bounds, the next round reports it.
            self.pos = offset + cmsg_align(len).min(remaining);
            if self.pos != offset + cmsg_align(len) {
                return Err(CmsgError::Misaligned {
                    len: self.buf.len(),
                });
            }
            let data = &self.buf[offset + CMSG_HDR_LEN..offset + len];
            if level != SOL_SOCKET
                || (cmsg_type != SO_DEVMEM_DMABUF && cmsg_type != SO_DEVMEM_LINEAR)
            {
                self.skipped += 1;
                continue;
            }
            if data.len() < DMABUF_CMSG_LEN {
                return Err(CmsgError::ShortPayload {
                    offset,
                    cmsg_type,
                    len: data.len(),
                });
            }
            // Extra payload bytes beyond the 24 of today's struct are ignored: UAPI structs
            // only grow at the end.
            let size = u32::from_ne_bytes(four(data, 8));
            return Ok(Some(if cmsg_type == SO_DEVMEM_LINEAR {
                Frag::Linear { size }
            } else {
                Frag::Dmabuf {
                    offset: u64::from_ne_bytes(eight(data, 0)),
                    size,
                    token: u32::from_ne_bytes(four(data, 12)),
                    dmabuf_id: u32::from_ne_bytes(four(data, 16)),
                }
            }));
        }
    }
}

impl Iterator for CmsgIter<'_> {
    type Item = Result<Frag, CmsgError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.step() {
            Ok(frag) => frag.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

impl std::iter::FusedIterator for CmsgIter<'_> {}

/// Totals over one control buffer, computed in one pass without allocating.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CmsgSummary {
    /// `SCM_DEVMEM_DMABUF` frags.
    pub dmabuf_frags: usize,
    /// Bytes in those frags.
    pub dmabuf_bytes: u64,
    /// `SCM_DEVMEM_LINEAR` frags.
    pub linear_frags: usize,
    /// Bytes in those frags (copied into the iov).
    pub linear_bytes: u64,
    /// Cmsgs of other levels/types that were skipped.
    pub skipped: usize,
}

/// Validate a whole control buffer and total its frags.
pub fn summarize(control: &[u8]) -> Result<CmsgSummary, CmsgError> {
    let mut it = CmsgIter::new(control);
    let mut s = CmsgSummary::default();
    for frag in it.by_ref() {
        match frag? {
            Frag::Dmabuf { size, .. } => {
                s.dmabuf_frags += 1;
                s.dmabuf_bytes += u64::from(size);
            }
            Frag::Linear { size } => {
                s.linear_frags += 1;
                s.linear_bytes += u64::from(size);
            }
        }
    }
    s.skipped = it.skipped();
    Ok(s)
}

// Fixed-size reads; the callers have checked the bounds, and a short slice would panic in
// `try_into` only through a bug in this module (the fuzz target and proptest cover it).
fn four(b: &[u8], at: usize) -> [u8; 4] {
    let mut out = [0; 4];
    out.copy_from_slice(&b[at..at + 4]);
    out
}
fn eight(b: &[u8], at: usize) -> [u8; 8] {
    let mut out = [0; 8];
    out.copy_from_slice(&b[at..at + 8]);
    out
}
fn word(b: &[u8], at: usize) -> [u8; WORD] {
    let mut out = [0; WORD];
    out.copy_from_slice(&b[at..at + WORD]);
    out
}

/// Builders for synthetic control buffers, shared by the unit tests, the proptests and the
/// fuzz target's seed corpus. They write exactly what the kernel writes (`put_cmsg`).
pub mod synth {
    use super::{CMSG_HDR_LEN, DMABUF_CMSG_LEN, SOL_SOCKET, cmsg_align};
    use crate::{SO_DEVMEM_DMABUF, SO_DEVMEM_LINEAR};

    /// Append one cmsg with an explicit `cmsg_len` (may lie) and payload, padded to
    /// `CMSG_ALIGN` of the payload actually written.
    pub fn push_raw(buf: &mut Vec<u8>, cmsg_len: usize, level: i32, cmsg_type: i32, data: &[u8]) {
        buf.extend_from_slice(&cmsg_len.to_ne_bytes());
        buf.extend_from_slice(&level.to_ne_bytes());
        buf.extend_from_slice(&cmsg_type.to_ne_bytes());
        buf.extend_from_slice(data);
        let end = cmsg_align(CMSG_HDR_LEN + data.len());
        buf.resize(buf.len() + end - CMSG_HDR_LEN - data.len(), 0);
    }

    /// Append a well-formed cmsg.
    pub fn push(buf: &mut Vec<u8>, level: i32, cmsg_type: i32, data: &[u8]) {
        push_raw(buf, CMSG_HDR_LEN + data.len(), level, cmsg_type, data);
    }

    /// The 24-byte `struct dmabuf_cmsg`.
    pub fn dmabuf_cmsg(
        offset: u64,
        size: u32,
        token: u32,
        dmabuf_id: u32,
    ) -> [u8; DMABUF_CMSG_LEN] {
        let mut d = [0u8; DMABUF_CMSG_LEN];
        d[0..8].copy_from_slice(&offset.to_ne_bytes());
        d[8..12].copy_from_slice(&size.to_ne_bytes());
        d[12..16].copy_from_slice(&token.to_ne_bytes());
        d[16..20].copy_from_slice(&dmabuf_id.to_ne_bytes());
        d
    }

    /// Append an `SCM_DEVMEM_DMABUF` cmsg.
    pub fn push_dmabuf(buf: &mut Vec<u8>, offset: u64, size: u32, token: u32, dmabuf_id: u32) {
        push(
            buf,
            SOL_SOCKET,
            SO_DEVMEM_DMABUF,
            &dmabuf_cmsg(offset, size, token, dmabuf_id),
        );
    }

    /// Append an `SCM_DEVMEM_LINEAR` cmsg.
    pub fn push_linear(buf: &mut Vec<u8>, size: u32) {
        push(
            buf,
            SOL_SOCKET,
            SO_DEVMEM_LINEAR,
            &dmabuf_cmsg(0, size, 0, 0),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::synth::*;
    use super::*;

    fn frags(buf: &[u8]) -> (Vec<Result<Frag, CmsgError>>, usize) {
        let mut it = CmsgIter::new(buf);
        let v: Vec<_> = it.by_ref().collect();
        (v, it.skipped())
    }

    #[test]
    fn layout_matches_the_kernel() {
        assert_eq!(CMSG_HDR_LEN, 16);
        assert_eq!(DMABUF_CMSG_SPACE, 40);
        let mut b = Vec::new();
        push_dmabuf(&mut b, 1, 2, 3, 4);
        assert_eq!(b.len(), 40);
        assert_eq!(&b[..8], &40usize.to_ne_bytes());
        assert_eq!(&b[8..12], &1i32.to_ne_bytes());
        assert_eq!(&b[12..16], &79i32.to_ne_bytes());
    }

    #[test]
    fn several_dmabuf_frags() {
        let mut b = Vec::new();
        push_dmabuf(&mut b, 0, 4096, 1, 7);
        push_dmabuf(&mut b, 4096, 4096, 2, 7);
        push_dmabuf(&mut b, 1 << 40, 100, 0x7fff_ffff, 8);
        let (v, skipped) = frags(&b);
        assert_eq!(skipped, 0);
        assert_eq!(
            v,
            vec![
                Ok(Frag::Dmabuf {
                    offset: 0,
                    size: 4096,
                    token: 1,
                    dmabuf_id: 7
                }),
                Ok(Frag::Dmabuf {
                    offset: 4096,
                    size: 4096,
                    token: 2,
                    dmabuf_id: 7
                }),
                Ok(Frag::Dmabuf {
                    offset: 1 << 40,
                    size: 100,
                    token: 0x7fff_ffff,
                    dmabuf_id: 8
                }),
            ]
        );
        let s = summarize(&b).unwrap();
        assert_eq!(s.dmabuf_frags, 3);
        assert_eq!(s.dmabuf_bytes, 8292);
    }

    #[test]
    fn linear_frag() {
        let mut b = Vec::new();
        push_linear(&mut b, 66);
        push_dmabuf(&mut b, 0, 1000, 5, 1);
        let (v, _) = frags(&b);
        assert_eq!(v[0], Ok(Frag::Linear { size: 66 }));
        let s = summarize(&b).unwrap();
        assert_eq!((s.linear_frags, s.linear_bytes), (1, 66));
        assert_eq!((s.dmabuf_frags, s.dmabuf_bytes), (1, 1000));
    }

    #[test]
    fn unknown_types_and_levels_are_skipped_and_counted() {
        let mut b = Vec::new();
        // TCP_INQ-like cmsg (level IPPROTO_TCP=6, type 36, a 4-byte int: padded to 24).
        push(&mut b, 6, 36, &5i32.to_ne_bytes());
        assert_eq!(b.len(), 24);
        push_dmabuf(&mut b, 0, 10, 1, 1);
        // SOL_SOCKET with an unrelated type (SO_TIMESTAMP_OLD = 29).
        push(&mut b, 1, 29, &[0u8; 16]);
        // A devmem type number on another level is not a devmem cmsg.
        push(&mut b, 6, 79, &dmabuf_cmsg(0, 1, 1, 1));
        push_dmabuf(&mut b, 10, 20, 2, 1);
        let (v, skipped) = frags(&b);
        assert_eq!(v.len(), 2);
        assert!(v.iter().all(Result::is_ok));
        assert_eq!(skipped, 3);
        assert_eq!(summarize(&b).unwrap().skipped, 3);
    }

    #[test]
    fn empty_buffer_has_no_frags() {
        assert_eq!(summarize(&[]).unwrap(), CmsgSummary::default());
    }

    #[test]
    fn truncated_header() {
        let mut b = Vec::new();
        push_dmabuf(&mut b, 0, 10, 1, 1);
        b.extend_from_slice(&[0u8; 8]);
        let (v, _) = frags(&b);
        assert!(v[0].is_ok());
        assert_eq!(
            v[1],
            Err(CmsgError::TruncatedHeader {
                offset: 40,
                remaining: 8
            })
        );
        assert_eq!(v.len(), 2, "iterator stops after an error");
    }

    #[test]
    fn len_smaller_than_header() {
        for len in [0usize, 1, 15] {
            let mut b = Vec::new();
            push_raw(&mut b, len, 1, 79, &dmabuf_cmsg(0, 1, 1, 1));
            assert_eq!(
                summarize(&b),
                Err(CmsgError::LenTooSmall { offset: 0, len })
            );
        }
    }

    #[test]
    fn len_running_past_the_buffer() {
        let mut b = Vec::new();
        push_dmabuf(&mut b, 0, 10, 1, 1);
        push_raw(&mut b, 41, 1, 79, &dmabuf_cmsg(0, 1, 1, 1));
        assert_eq!(
            summarize(&b),
            Err(CmsgError::RunsPastEnd {
                offset: 40,
                len: 41,
                remaining: 40
            })
        );
        let mut b = Vec::new();
        push_raw(&mut b, usize::MAX, 1, 79, &dmabuf_cmsg(0, 1, 1, 1));
        assert!(matches!(summarize(&b), Err(CmsgError::RunsPastEnd { .. })));
    }

    #[test]
    fn misaligned_trailing_bytes() {
        let mut b = Vec::new();
        push_dmabuf(&mut b, 0, 10, 1, 1);
        b.extend_from_slice(&[0u8; 3]);
        assert_eq!(summarize(&b), Err(CmsgError::Misaligned { len: 43 }));
        // A last cmsg whose padding is cut off (cmsg_len 20, buffer ends at 20).
        let mut b = Vec::new();
        push(&mut b, 6, 36, &1i32.to_ne_bytes());
        b.truncate(20);
        assert_eq!(summarize(&b), Err(CmsgError::Misaligned { len: 20 }));
    }

    #[test]
    fn short_devmem_payload() {
        let mut b = Vec::new();
        push(&mut b, 1, 79, &[0u8; 20]);
        assert_eq!(
            summarize(&b),
            Err(CmsgError::ShortPayload {
                offset: 0,
                cmsg_type: 79,
                len: 20
            })
        );
        let mut b = Vec::new();
        push(&mut b, 1, 78, &[]);
        assert!(matches!(
            summarize(&b),
            Err(CmsgError::ShortPayload { cmsg_type: 78, .. })
        ));
    }

    #[test]
    fn longer_payload_is_accepted() {
        let mut b = Vec::new();
        let mut d = dmabuf_cmsg(8, 9, 10, 11).to_vec();
        d.extend_from_slice(&[0xff; 8]);
        push(&mut b, 1, 79, &d);
        assert_eq!(
            CmsgIter::new(&b).next(),
            Some(Ok(Frag::Dmabuf {
                offset: 8,
                size: 9,
                token: 10,
                dmabuf_id: 11
            }))
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                let _ = summarize(&bytes);
                let mut it = CmsgIter::new(&bytes);
                let n = it.by_ref().count();
                prop_assert!(n <= bytes.len() / CMSG_HDR_LEN + 1);
            }

            #[test]
            fn well_formed_buffers_round_trip(
                frags in proptest::collection::vec((any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<bool>()), 0..64),
                junk in proptest::collection::vec((any::<i32>(), 0usize..40), 0..8),
            ) {
                let mut b = Vec::new();
                let mut expect = Vec::new();
                for (i, (off, size, tok, id, linear)) in frags.iter().copied().enumerate() {
                    if let Some((ty, n)) = junk.get(i) {
                        push(&mut b, 41, *ty, &vec![0xa5; *n]);
                    }
                    if linear {
                        push_linear(&mut b, size);
                        expect.push(Frag::Linear { size });
                    } else {
                        push_dmabuf(&mut b, off, size, tok, id);
                        expect.push(Frag::Dmabuf { offset: off, size, token: tok, dmabuf_id: id });
                    }
                }
                let got: Result<Vec<_>, _> = CmsgIter::new(&b).collect();
                prop_assert_eq!(got.unwrap(), expect);
            }

            #[test]
            fn corrupting_a_valid_buffer_never_panics(
                n in 1usize..8, at in any::<proptest::sample::Index>(), byte in any::<u8>(), cut in any::<proptest::sample::Index>()
            ) {
                let mut b = Vec::new();
                for i in 0..n {
                    push_dmabuf(&mut b, i as u64, 1, i as u32, 1);
                }
                let i = at.index(b.len());
                b[i] = byte;
                let c = cut.index(b.len() + 1);
                let _ = summarize(&b[..c]);
            }
        }
    }
}
