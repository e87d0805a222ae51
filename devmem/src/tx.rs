//! Devmem TX: send payload straight out of a TX-bound dma-buf (reference devmem.md §5).
//!
//! After `bind-tx` ([`crate::bind_tx`]) gives a binding id, a TCP socket with
//! `SO_ZEROCOPY` sends with `sendmsg(MSG_ZEROCOPY)` and an `SCM_DEVMEM_DMABUF` cmsg carrying
//! the id; each iovec's base is an *offset into the dma-buf*, not an address. Completions
//! arrive like any MSG_ZEROCOPY completion on the error queue (`IP_RECVERR` /
//! `IPV6_RECVERR` with a `sock_extended_err` of origin `SO_EE_ORIGIN_ZEROCOPY` and the
//! completed range of send numbers `[ee_info, ee_data]`); a dma-buf range must not be
//! rewritten before its send completed.
//!
//! Kernel checks (tested against the running kernel in `tx/tests.rs`): id 0 is an ordinary
//! MSG_ZEROCOPY send, made without the cmsg so that kernels before 6.16 (which answer the
//! unknown cmsg with EINVAL) take it too; a non-zero id without MSG_ZEROCOPY, or an unknown
//! id (or an RX binding's), is EINVAL; a route through another device is ENODEV.
#![forbid(unsafe_code)]

use std::io;
use std::net::TcpStream;
use std::os::fd::AsFd;

use crate::sys;

/// `SO_EE_ORIGIN_ZEROCOPY` (include/uapi/linux/errqueue.h).
pub const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED`: the kernel fell back to copying for this range.
pub const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;
/// `sizeof(struct sock_extended_err)`.
const SOCK_EXTENDED_ERR_LEN: usize = 16;
const WORD: usize = std::mem::size_of::<usize>();
const CMSG_HDR_LEN: usize = WORD + 8;

/// Errors of devmem TX.
#[derive(Debug, thiserror::Error)]
pub enum TxError {
    /// A syscall failed; `hint` explains the devmem-specific errnos.
    #[error("{call}: {source}{hint}")]
    Syscall {
        /// The call.
        call: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
        /// What that errno means for devmem TX (may be empty).
        hint: &'static str,
    },
    /// An error-queue message that is not a zerocopy completion, or is malformed.
    #[error("unexpected error-queue message: {0}")]
    Completion(String),
}

fn hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EINVAL) => {
            " (devmem TX: the id is not a TX binding of this netns, or SO_ZEROCOPY / MSG_ZEROCOPY is missing, or an iovec lies outside the dma-buf)"
        }
        Some(libc::ENODEV) => {
            " (devmem TX: the socket's route leaves through a device other than the bound one; bind the socket to it with SO_BINDTODEVICE)"
        }
        Some(libc::EHOSTUNREACH) => " (devmem TX: the route could not be rebuilt)",
        _ => "",
    }
}

/// One zerocopy completion: sends `lo..=hi` (numbered from 0 per socket) are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// First completed send.
    pub lo: u32,
    /// Last completed send.
    pub hi: u32,
    /// The kernel copied instead of sending from the buffer (always on loopback).
    pub copied: bool,
}

/// Parse the control bytes of one `MSG_ERRQUEUE` message. `Ok(None)` when it holds no
/// `IP_RECVERR`/`IPV6_RECVERR` cmsg at all.
pub fn parse_completion(control: &[u8]) -> Result<Option<Completion>, TxError> {
    let bad = |m: String| TxError::Completion(m);
    let mut off = 0;
    while off + CMSG_HDR_LEN <= control.len() {
        let mut w = [0u8; WORD];
        w.copy_from_slice(&control[off..off + WORD]);
        let len = usize::from_ne_bytes(w);
        let level = i32::from_ne_bytes(control[off + WORD..off + WORD + 4].try_into().expect("4"));
        let ty = i32::from_ne_bytes(
            control[off + WORD + 4..off + CMSG_HDR_LEN]
                .try_into()
                .expect("4"),
        );
        if len < CMSG_HDR_LEN || off + len > control.len() {
            return Err(bad(format!(
                "cmsg_len {len} at offset {off} of {}",
                control.len()
            )));
        }
        let is_recverr = (level == libc::SOL_IP && ty == libc::IP_RECVERR)
            || (level == libc::SOL_IPV6 && ty == libc::IPV6_RECVERR);
        if is_recverr {
            let d = &control[off + CMSG_HDR_LEN..off + len];
            if d.len() < SOCK_EXTENDED_ERR_LEN {
                return Err(bad(format!("sock_extended_err of {} bytes", d.len())));
            }
            let ee_errno = u32::from_ne_bytes(d[0..4].try_into().expect("4"));
            let (origin, code) = (d[4], d[6]);
            if origin != SO_EE_ORIGIN_ZEROCOPY || ee_errno != 0 {
                return Err(bad(format!(
                    "origin {origin}, errno {ee_errno} (not a zerocopy completion)"
                )));
            }
            let lo = u32::from_ne_bytes(d[8..12].try_into().expect("4"));
            let hi = u32::from_ne_bytes(d[12..16].try_into().expect("4"));
            return Ok(Some(Completion {
                lo,
                hi,
                copied: code & SO_EE_CODE_ZEROCOPY_COPIED != 0,
            }));
        }
        off += (len + WORD - 1) & !(WORD - 1);
    }
    Ok(None)
}

/// A TCP socket that sends from a TX-bound dma-buf.
#[derive(Debug)]
pub struct DevmemTx<S: AsFd = TcpStream> {
    sock: S,
    dmabuf_id: u32,
    /// Zerocopy sends made (the kernel numbers them from 0).
    sent: u32,
    /// Sends known complete (counted, not the highest number seen: completions may come
    /// out of order on retransmission and teardown, msg_zerocopy.rst).
    completed: u32,
    control: [u8; 128],
    /// An error met after completions were read in the same poll: returned by the next one,
    /// so those completions reach the caller first.
    deferred: Option<TxError>,
}

impl<S: AsFd> DevmemTx<S> {
    /// Enable `SO_ZEROCOPY` on `sock` and send from binding `dmabuf_id`.
    pub fn new(sock: S, dmabuf_id: u32) -> Result<Self, TxError> {
        sys::set_zerocopy(sock.as_fd()).map_err(|source| TxError::Syscall {
            call: "setsockopt(SO_ZEROCOPY)",
            hint: hint(&source),
            source,
        })?;
        Ok(Self {
            sock,
            dmabuf_id,
            sent: 0,
            completed: 0,
            control: [0; 128],
            deferred: None,
        })
    }

    /// The socket.
    pub fn get_ref(&self) -> &S {
        &self.sock
    }

    /// Send the dma-buf ranges `(offset, len)` in order; returns the bytes accepted (may be
    /// short, as any send). The ranges must not be rewritten until [`DevmemTx::pending`]
    /// says every send so far completed.
    pub fn send(&mut self, ranges: &[(u64, usize)]) -> Result<usize, TxError> {
        self.send_flags(ranges, libc::MSG_ZEROCOPY)
    }

    /// [`DevmemTx::send`] with explicit flags (tests use it to check the kernel's rules).
    pub fn send_flags(&mut self, ranges: &[(u64, usize)], flags: i32) -> Result<usize, TxError> {
        // Id 0 goes without the cmsg ([`sys::sendmsg_dmabuf`]): no devmem hint applies.
        let plain = self.dmabuf_id == 0;
        let n = sys::sendmsg_dmabuf(self.sock.as_fd(), ranges, self.dmabuf_id, flags).map_err(
            |source| TxError::Syscall {
                call: match plain {
                    true => "sendmsg(MSG_ZEROCOPY)",
                    false => "sendmsg(SCM_DEVMEM_DMABUF, MSG_ZEROCOPY)",
                },
                hint: if plain { "" } else { hint(&source) },
                source,
            },
        )?;
        if n > 0 && flags & libc::MSG_ZEROCOPY != 0 {
            self.sent = self.sent.wrapping_add(1);
        }
        Ok(n)
    }

    /// Zerocopy sends not yet completed.
    pub fn pending(&self) -> u32 {
        self.sent.wrapping_sub(self.completed)
    }

    /// Counts the sends of completion `c` (`lo..=hi`, wrapping) complete.
    fn count(&mut self, c: &Completion) {
        let n = c.hi.wrapping_sub(c.lo).wrapping_add(1);
        self.completed = self.completed.wrapping_add(n);
    }

    /// Drain the error queue without blocking; returns the completions read. A message
    /// that is not a completion (or a failed read) ends the poll: with completions read
    /// before it, those are returned and the error comes from the next poll, so the caller
    /// frees their bytes first; the message itself is consumed.
    pub fn poll_completions(&mut self) -> Result<Vec<Completion>, TxError> {
        self.drain(|sock, control| sys::recv_errqueue(sock.as_fd(), control))
    }

    /// [`DevmemTx::poll_completions`] over `recv`, which reads one error-queue message of
    /// the socket, its control bytes into the buffer it is given, and returns their length.
    fn drain(
        &mut self,
        mut recv: impl FnMut(&S, &mut [u8]) -> io::Result<usize>,
    ) -> Result<Vec<Completion>, TxError> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        let mut out = Vec::new();
        loop {
            let parsed = match recv(&self.sock, &mut self.control) {
                Ok(n) => parse_completion(&self.control[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(out),
                Err(source) => Err(TxError::Syscall {
                    call: "recvmsg(MSG_ERRQUEUE)",
                    hint: "",
                    source,
                }),
            };
            match parsed {
                Ok(Some(c)) => {
                    self.count(&c);
                    out.push(c);
                }
                Ok(None) => {}
                Err(e) if out.is_empty() => return Err(e),
                Err(e) => {
                    // Counted already: the caller must get them, or their bytes stay in use.
                    self.deferred = Some(e);
                    return Ok(out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
