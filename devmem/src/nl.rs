//! Minimal generic-netlink transport: one socket, one request at a time, replies, acks,
//! dump completion and extended acks.
//!
//! Message encoding and decoding are `netlink-bindings`' (generated from the kernel YAML
//! specs); this module only frames and exchanges them. It exists because
//! `netlink-socket2` 0.3.5 mis-parses a dump that ends in an error (`NLMSG_DONE` carrying an
//! errno is read as an `NLMSG_ERROR` with an echoed header: "Received packet is too short",
//! errno lost; e.g. `queue-get` dump of an unknown ifindex), hides its socket (no netns
//! control) and turns a failing `socket(2)` into the wrong errno.
//!
//! Framing (include/uapi/linux/netlink.h): `nlmsghdr {len u32, type u16, flags u16, seq u32,
//! pid u32}`; an error/ack is `NLMSG_ERROR` with `{errno i32, echoed nlmsghdr}` (payload not
//! echoed, because we set `NETLINK_CAP_ACK`) followed by extack TLVs when `NLM_F_ACK_TLVS`;
//! a dump ends with `NLMSG_DONE` carrying `{errno i32}` and the same TLVs.
#![forbid(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use crate::sys;

const NLMSG_HDRLEN: usize = 16;
const NLMSG_NOOP: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_OVERRUN: u16 = 4;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSGERR_ATTR_MSG: u16 = 1;
const NLMSGERR_ATTR_OFFS: u16 = 2;
const NLMSGERR_ATTR_MISS_TYPE: u16 = 5;
const NLMSGERR_ATTR_MISS_NEST: u16 = 6;
/// Receive buffer. The kernel sizes dump skbs by the largest recv seen, capped near 32 KiB,
/// so a 32 KiB buffer is never truncated (checked anyway with MSG_TRUNC).
const RECV_BUF: usize = 32 * 1024;
/// `GENL_ID_CTRL`.
pub(crate) const GENL_ID_CTRL: u16 = 0x10;

/// The extended ack of an error.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Extack {
    /// `NLMSGERR_ATTR_MSG`.
    pub msg: Option<String>,
    /// `NLMSGERR_ATTR_OFFS`: offset of the bad attribute from the request's nlmsghdr.
    pub offs: Option<u32>,
    /// `NLMSGERR_ATTR_MISS_TYPE`.
    pub miss_type: Option<u16>,
    /// `NLMSGERR_ATTR_MISS_NEST`: offset of the nest that lacks it.
    pub miss_nest: Option<u32>,
}

/// Transport errors.
#[derive(Debug)]
pub(crate) enum NlError {
    /// send/recv failed.
    Io(io::Error),
    /// The kernel answered with a non-zero errno.
    Kernel { errno: i32, extack: Extack },
    /// A reply did not parse (framing, or the caller's decoder).
    Malformed(String),
}

/// One generic-netlink socket. The network namespace is the one of the thread that opened it.
#[derive(Debug)]
pub(crate) struct GenlSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl GenlSocket {
    pub(crate) fn open() -> io::Result<Self> {
        Ok(Self {
            fd: sys::genl_socket()?,
            seq: 0,
            buf: vec![0; RECV_BUF],
        })
    }

    /// Send one request and feed each reply payload (without nlmsghdr) to `on_reply` until
    /// the ack (do) or `NLMSG_DONE` (dump). A reply `on_reply` refuses fails the request, but
    /// only once the kernel has ended it: a dump left running on the socket answered the
    /// next dump request on it with EBUSY.
    pub(crate) fn request(
        &mut self,
        msg_type: u16,
        flags: u16,
        payload: &[u8],
        on_reply: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), NlError> {
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut msg = Vec::with_capacity(NLMSG_HDRLEN + payload.len());
        let flags = flags | NLM_F_REQUEST | if dump { 0 } else { NLM_F_ACK };
        msg.extend_from_slice(&((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&msg_type.to_ne_bytes());
        msg.extend_from_slice(&flags.to_ne_bytes());
        msg.extend_from_slice(&seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(payload);
        let sent = sys::send(self.fd.as_fd(), &msg).map_err(NlError::Io)?;
        if sent != msg.len() {
            return Err(NlError::Malformed(format!(
                "short send: {sent} of {}",
                msg.len()
            )));
        }
        let mut refused: Option<String> = None;
        let mut each = |p: &[u8]| {
            if refused.is_none()
                && let Err(e) = on_reply(p)
            {
                refused = Some(e);
            }
            Ok(())
        };
        loop {
            let n = sys::recv_trunc(self.fd.as_fd(), &mut self.buf).map_err(NlError::Io)?;
            if n > self.buf.len() {
                return Err(NlError::Malformed(format!(
                    "netlink datagram of {n} bytes truncated to {}",
                    self.buf.len()
                )));
            }
            if let Some(()) = walk(&self.buf[..n], seq, &mut each)? {
                break;
            }
        }
        refused.map_or(Ok(()), |e| Err(NlError::Malformed(e)))
    }
}

/// Process one datagram: `Some(())` when the request is complete.
fn walk(
    mut data: &[u8],
    seq: u32,
    on_reply: &mut dyn FnMut(&[u8]) -> Result<(), String>,
) -> Result<Option<()>, NlError> {
    while !data.is_empty() {
        let hdr = data
            .get(..NLMSG_HDRLEN)
            .ok_or_else(|| NlError::Malformed(format!("{} trailing bytes", data.len())))?;
        let len = u32::from_ne_bytes(hdr[0..4].try_into().unwrap_or_default()) as usize;
        let ty = u16::from_ne_bytes([hdr[4], hdr[5]]);
        let flags = u16::from_ne_bytes([hdr[6], hdr[7]]);
        let mseq = u32::from_ne_bytes(hdr[8..12].try_into().unwrap_or_default());
        if len < NLMSG_HDRLEN || len > data.len() {
            return Err(NlError::Malformed(format!(
                "nlmsg_len {len} with {} bytes left",
                data.len()
            )));
        }
        let payload = &data[NLMSG_HDRLEN..len];
        data = &data[((len + 3) & !3).min(data.len())..];
        if mseq != seq {
            continue; // stale reply of an earlier request
        }
        match ty {
            NLMSG_NOOP => {}
            NLMSG_OVERRUN => return Err(NlError::Malformed("NLMSG_OVERRUN".into())),
            NLMSG_ERROR | NLMSG_DONE => {
                // An error message always carries its (negative) errno; a dump's DONE may not.
                let raw = match payload.get(..4) {
                    Some(b) => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
                    None if ty == NLMSG_DONE => 0,
                    None => {
                        let n = payload.len();
                        return Err(NlError::Malformed(format!("NLMSG_ERROR of {n} bytes")));
                    }
                };
                let errno = raw
                    .checked_neg()
                    .filter(|e| *e >= 0)
                    .ok_or_else(|| NlError::Malformed(format!("errno field {raw}")))?;
                if errno == 0 {
                    return Ok(Some(()));
                }
                let tlv_start = if ty == NLMSG_DONE {
                    4
                } else if flags & NLM_F_CAPPED != 0 {
                    4 + NLMSG_HDRLEN
                } else {
                    // Echoed request: skip it (its own nlmsg_len, aligned).
                    let echo = payload
                        .get(4..8)
                        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize)
                        .unwrap_or(0);
                    4 + ((echo + 3) & !3)
                };
                let extack = if flags & NLM_F_ACK_TLVS != 0 {
                    parse_extack(payload.get(tlv_start..).unwrap_or(&[]))
                } else {
                    Extack::default()
                };
                return Err(NlError::Kernel { errno, extack });
            }
            _ => on_reply(payload).map_err(NlError::Malformed)?,
        }
    }
    Ok(None)
}

/// A generic-netlink family as `CTRL_CMD_GETFAMILY` reports it.
#[derive(Debug, Clone)]
pub(crate) struct Family {
    pub id: u16,
    pub version: u32,
    /// `(cmd, GENL_* flags)` of each op.
    pub ops: Vec<(u32, u32)>,
}

/// Resolve family `name` (ENOENT from the controller means the kernel lacks it).
pub(crate) fn resolve_family(sock: &mut GenlSocket, name: &[u8]) -> Result<Family, NlError> {
    use netlink_bindings::nlctrl;
    use netlink_bindings::traits::NetlinkRequest;
    let mut req = nlctrl::Request::new().op_getfamily_do();
    req.encode().push_family_name_bytes(name);
    let mut fam = None;
    sock.request(GENL_ID_CTRL, req.flags(), req.payload(), &mut |p| {
        let a = nlctrl::OpGetfamilyDo::decode_reply(p);
        let ops = a
            .get_ops()
            .map(|ops| {
                ops.filter_map(|o| Some((o.get_id().ok()?, o.get_flags().unwrap_or(0))))
                    .collect()
            })
            .unwrap_or_default();
        fam = Some(Family {
            id: a.get_family_id().map_err(|e| e.to_string())?,
            version: a.get_version().unwrap_or(0),
            ops,
        });
        Ok(())
    })?;
    fam.ok_or_else(|| NlError::Malformed("CTRL_CMD_GETFAMILY without a reply".into()))
}

fn parse_extack(tlvs: &[u8]) -> Extack {
    let mut e = Extack::default();
    let u32_of = |p: &[u8]| {
        p.get(..4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    };
    for (ty, p) in attrs(tlvs) {
        match ty {
            NLMSGERR_ATTR_MSG => {
                let s = p.split(|&b| b == 0).next().unwrap_or(&[]);
                e.msg = Some(String::from_utf8_lossy(s).into_owned());
            }
            NLMSGERR_ATTR_OFFS => e.offs = u32_of(p),
            NLMSGERR_ATTR_MISS_TYPE => e.miss_type = u32_of(p).map(|v| v as u16),
            NLMSGERR_ATTR_MISS_NEST => e.miss_nest = u32_of(p),
            _ => {}
        }
    }
    e
}

/// Walk netlink attributes: `(type without NLA_F_* flags, payload)`; stops at the first
/// malformed one.
pub(crate) fn attrs(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        let hdr = buf.get(pos..pos + 4)?;
        let len = usize::from(u16::from_ne_bytes([hdr[0], hdr[1]]));
        let ty = u16::from_ne_bytes([hdr[2], hdr[3]]) & 0x3fff;
        let payload = buf.get(pos + 4..pos + len.max(4))?;
        if len < 4 {
            return None;
        }
        pos += (len + 3) & !3;
        Some((ty, payload))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((16 + payload.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(payload);
        while !m.len().is_multiple_of(4) {
            m.push(0);
        }
        m
    }

    fn tlv(ty: u16, p: &[u8]) -> Vec<u8> {
        let mut v = ((4 + p.len()) as u16).to_ne_bytes().to_vec();
        v.extend_from_slice(&ty.to_ne_bytes());
        v.extend_from_slice(p);
        while !v.len().is_multiple_of(4) {
            v.push(0);
        }
        v
    }

    /// A reply refused halfway through a dump fails that request, and the next dump on the
    /// same socket runs: the rest of the first was read off first. Before, the request
    /// returned at the refused reply, and the kernel's dump, still running on the socket,
    /// got the next dump request EBUSY (or its stale replies).
    #[test]
    fn a_refused_reply_in_a_dump_leaves_the_socket_usable() {
        use netlink_bindings::nlctrl;
        use netlink_bindings::traits::NetlinkRequest;
        let mut sock = GenlSocket::open().expect("generic netlink socket");
        // A page-sized buffer: the kernel sizes a dump's datagrams by the largest buffer
        // read with, and the ethtool family's policies take many.
        sock.buf = vec![0; 4096];
        let mut req = nlctrl::Request::new().op_getpolicy_dump();
        req.encode().push_family_name_bytes(b"ethtool");
        let mut seen = 0;
        let first = sock.request(GENL_ID_CTRL, req.flags(), req.payload(), &mut |_| {
            seen += 1;
            Err("refused".to_string())
        });
        assert!(
            matches!(first, Err(NlError::Malformed(ref e)) if e == "refused"),
            "{first:?}"
        );
        assert_eq!(
            seen, 1,
            "the replies after the refused one are not handed on"
        );
        let req = nlctrl::Request::new().op_getfamily_dump();
        let mut families = 0;
        let second = sock.request(GENL_ID_CTRL, req.flags(), req.payload(), &mut |_| {
            families += 1;
            Ok(())
        });
        assert!(second.is_ok(), "{second:?}");
        assert!(families >= 2, "nlctrl and more: {families}");
    }

    #[test]
    fn an_error_message_without_its_errno_or_with_a_wild_one_is_malformed() {
        // Before, a short NLMSG_ERROR read as an ACK (a failed set reported as done), and
        // errno i32::MIN overflowed its negation.
        let nop = &mut |_: &[u8]| Ok(());
        let short = msg(NLMSG_ERROR, 0, 5, &[]);
        assert!(matches!(walk(&short, 5, nop), Err(NlError::Malformed(_))));
        for raw in [i32::MIN, 5] {
            let wild = msg(NLMSG_ERROR, NLM_F_CAPPED, 5, &raw.to_ne_bytes());
            assert!(
                matches!(walk(&wild, 5, nop), Err(NlError::Malformed(_))),
                "{raw}"
            );
        }
        let ack = msg(NLMSG_ERROR, NLM_F_CAPPED, 5, &0i32.to_ne_bytes());
        assert!(matches!(walk(&ack, 5, nop), Ok(Some(()))));
        assert!(matches!(
            walk(&msg(NLMSG_DONE, 0, 5, &[]), 5, nop),
            Ok(Some(()))
        ));
    }

    #[test]
    fn dump_done_with_errno_and_extack() {
        // What netlink-socket2 0.3.5 cannot parse: NLMSG_DONE {errno} + TLVs.
        let mut p = (-libc::ENODEV).to_ne_bytes().to_vec();
        p.extend(tlv(NLMSGERR_ATTR_MSG, b"no such device\0"));
        let d = msg(NLMSG_DONE, NLM_F_ACK_TLVS | 2, 7, &p);
        let mut n = 0;
        match walk(&d, 7, &mut |_| {
            n += 1;
            Ok(())
        }) {
            Err(NlError::Kernel { errno, extack }) => {
                assert_eq!(errno, libc::ENODEV);
                assert_eq!(extack.msg.as_deref(), Some("no such device"));
            }
            other => panic!("{other:?}"),
        }
        // A bare DONE {errno} without TLVs.
        let d = msg(NLMSG_DONE, 2, 7, &(-libc::ENODEV).to_ne_bytes());
        assert!(matches!(
            walk(&d, 7, &mut |_| Ok(())),
            Err(NlError::Kernel {
                errno: libc::ENODEV,
                ..
            })
        ));
    }

    #[test]
    fn capped_error_with_offset_and_missing_type() {
        let mut p = (-libc::EINVAL).to_ne_bytes().to_vec();
        p.extend_from_slice(&[0u8; 16]); // echoed header
        p.extend(tlv(NLMSGERR_ATTR_OFFS, &24u32.to_ne_bytes()));
        p.extend(tlv(NLMSGERR_ATTR_MISS_TYPE, &3u32.to_ne_bytes()));
        let d = msg(NLMSG_ERROR, NLM_F_CAPPED | NLM_F_ACK_TLVS, 1, &p);
        match walk(&d, 1, &mut |_| Ok(())) {
            Err(NlError::Kernel { errno, extack }) => {
                assert_eq!(errno, libc::EINVAL);
                assert_eq!(extack.offs, Some(24));
                assert_eq!(extack.miss_type, Some(3));
                assert_eq!(extack.msg, None);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn replies_then_ack_and_stale_messages() {
        let mut d = msg(20, 0, 4, b"old!");
        d.extend(msg(20, 0, 5, b"data"));
        d.extend(msg(NLMSG_ERROR, NLM_F_CAPPED, 5, &[0u8; 20]));
        let mut got = Vec::new();
        let r = walk(&d, 5, &mut |p| {
            got.push(p.to_vec());
            Ok(())
        });
        assert!(matches!(r, Ok(Some(()))));
        assert_eq!(got, vec![b"data".to_vec()]);
        // A datagram without the terminator asks for more.
        assert!(matches!(
            walk(&msg(20, 2, 5, b"x"), 5, &mut |_| Ok(())),
            Ok(None)
        ));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for d in [&[1u8, 2, 3][..], &[0u8; 16], &[255u8; 40]] {
            let _ = walk(d, 0, &mut |_| Ok(()));
        }
        assert_eq!(attrs(&[8, 0, 1, 0, 1, 2]).count(), 0);
        assert_eq!(attrs(&[2, 0, 1, 0]).count(), 0);
    }
}
