//! The raw syscalls of this crate, each behind a small safe function.
//!
//! This is the only module that contains `unsafe` (lib.rs denies it everywhere else). Each
//! function wraps exactly one syscall, borrows its fds (`BorrowedFd`, so they cannot be closed
//! underneath) and returns `io::Result` with the errno of that call. Higher layers name the
//! call in their error types (STYLE rule 7).
//!
//! Not done (STYLE rule 2): an enum-dispatched `syscall()` with a test override. The devmem
//! calls are tested against the real kernel instead (root, loopback TCP, netns), and the
//! pure parts (cmsg parsing, token batching) take closures or byte slices.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::{MSG_SOCK_DEVMEM, SO_DEVMEM_DONTNEED};

/// What one `recvmsg` returned.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvOut {
    /// The return value: bytes received (linear + devmem).
    pub bytes: usize,
    /// `msg_controllen` after the call: valid control bytes.
    pub control_len: usize,
    /// `msg_flags` after the call (MSG_CTRUNC, ...).
    pub msg_flags: i32,
}

/// `recvmsg(fd, {iov: [iov_buf], control}, MSG_SOCK_DEVMEM | extra_flags)`.
pub(crate) fn recvmsg_devmem(
    fd: BorrowedFd<'_>,
    iov_buf: &mut [u8],
    control: &mut [u8],
    extra_flags: i32,
) -> io::Result<RecvOut> {
    let mut iov = libc::iovec {
        iov_base: iov_buf.as_mut_ptr().cast(),
        iov_len: iov_buf.len(),
    };
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value (null name,
    // no iov, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    loop {
        // SAFETY: `fd` is a live borrowed fd; `msg` points at one iovec that describes
        // `iov_buf` (valid for writes of iov_len bytes) and at `control` (valid for writes of
        // msg_controllen bytes); all three outlive the call, and the kernel writes only
        // within those lengths.
        let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, MSG_SOCK_DEVMEM | extra_flags) };
        if n >= 0 {
            return Ok(RecvOut {
                bytes: n as usize,
                control_len: (msg.msg_controllen as usize).min(control.len()),
                msg_flags: msg.msg_flags,
            });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `setsockopt(fd, SOL_SOCKET, SO_DEVMEM_DONTNEED, tokens, n * 8)`; returns the kernel's
/// positive return value, the number of frags freed.
pub(crate) fn dontneed(fd: BorrowedFd<'_>, tokens: &[libc::dmabuf_token]) -> io::Result<usize> {
    let len = std::mem::size_of_val(tokens);
    // SAFETY: `tokens` is a live slice of `#[repr(C)]` dmabuf_token, readable for `len`
    // bytes; the kernel only reads optlen bytes; `fd` is a live borrowed fd.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_DEVMEM_DONTNEED,
            tokens.as_ptr().cast(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, bytes)`: blocking reads wait for `bytes` (or
/// the read's length, if smaller) before returning.
pub fn set_rcvlowat(fd: BorrowedFd<'_>, bytes: i32) -> io::Result<()> {
    // SAFETY: `bytes` is a live c_int read by the kernel for optlen bytes; `fd` is live.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `setsockopt(fd, SOL_SOCKET, SO_ZEROCOPY, 1)`.
pub(crate) fn set_zerocopy(fd: BorrowedFd<'_>) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `one` is a live c_int read by the kernel for optlen bytes; `fd` is live.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ZEROCOPY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `sendmsg(fd, {iov: ranges, control: SOL_SOCKET/SCM_DEVMEM_DMABUF = dmabuf_id}, flags)`.
/// For a non-zero `dmabuf_id` each `(base, len)` is an offset into the TX-bound dma-buf,
/// which the kernel resolves itself; with id 0 the kernel treats the bases as ordinary user
/// addresses (reads them), so callers pass 0 only with addresses of live buffers.
///
/// Id 0 is sent with no control message at all: kernels before 6.16 (no devmem TX) answer
/// an `SCM_DEVMEM_DMABUF` cmsg with EINVAL (`__sock_cmsg_send` rejects the unknown type),
/// and from 6.16 a missing cmsg and id 0 are the same ordinary MSG_ZEROCOPY send.
pub(crate) fn sendmsg_dmabuf(
    fd: BorrowedFd<'_>,
    ranges: &[(u64, usize)],
    dmabuf_id: u32,
    flags: i32,
) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = ranges
        .iter()
        .map(|&(base, len)| libc::iovec {
            iov_base: base as usize as *mut libc::c_void,
            iov_len: len,
        })
        .collect();
    // CMSG_SPACE(4) = 16 + 8 on 64-bit; a u64 array keeps the buffer cmsghdr-aligned.
    let mut control = [0u64; 3];
    let space = std::mem::size_of_val(&control);
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    if dmabuf_id != 0 {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` describes `control` (space bytes, aligned), so CMSG_FIRSTHDR returns
        // a pointer inside it with room for a header and 4 data bytes (CMSG_SPACE(4) <= space).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = crate::SO_DEVMEM_DMABUF;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u32>(), dmabuf_id);
        }
    }
    loop {
        // SAFETY: `fd` is live; `msg` points at `iov` and (with a non-zero id) at `control`,
        // both alive across the call; with id 0 its control is null with length 0. The kernel
        // reads iovec entries and the control buffer; with a non-zero id the bases are
        // dma-buf offsets that the kernel never dereferences in our address space.
        let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recvmsg(fd, {control}, MSG_ERRQUEUE | MSG_DONTWAIT)`: one error-queue message (zerocopy
/// completions); returns the control bytes written.
pub(crate) fn recv_errqueue(fd: BorrowedFd<'_>, control: &mut [u8]) -> io::Result<usize> {
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    loop {
        // SAFETY: `fd` is live; `msg` has no iov and points at `control`, valid for writes of
        // msg_controllen bytes across the call.
        let n = unsafe {
            libc::recvmsg(
                fd.as_raw_fd(),
                &mut msg,
                libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok((msg.msg_controllen as usize).min(control.len()));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `setsockopt(fd, level, name, bytes, bytes.len())` with arbitrary option bytes; returns
/// the raw (possibly positive) return value. Used to probe the kernel's validation.
#[cfg(test)]
pub(crate) fn setsockopt_bytes(
    fd: BorrowedFd<'_>,
    level: i32,
    name: i32,
    bytes: &[u8],
) -> io::Result<i32> {
    // SAFETY: `bytes` is readable for its length, the kernel reads at most optlen bytes;
    // `fd` is a live borrowed fd.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            bytes.as_ptr().cast(),
            bytes.len() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// `if_indextoname(ifindex)`, in the calling thread's network namespace.
pub(crate) fn if_indextoname(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has IF_NAMESIZE bytes, the size if_indextoname requires; on success it
    // holds a NUL-terminated name.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success `buf` holds a NUL-terminated string within its IF_NAMESIZE bytes.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// `setns(fd, CLONE_NEWNET)`: move the calling *thread* into the network namespace `fd`.
pub(crate) fn setns_net(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain syscall on a live borrowed fd; it changes only the calling thread's
    // network namespace and touches no memory of ours.
    let r = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Run `f` on a short-lived thread inside the network namespace at `netns` (e.g.
/// `/var/run/netns/NAME`); the caller's thread never changes namespace. Sockets `f` creates
/// stay in that namespace. Errors opening or entering the namespace come back as `Err`.
pub(crate) fn in_netns<T: Send>(
    netns: &std::path::Path,
    f: impl FnOnce() -> T + Send,
) -> io::Result<T> {
    let ns = std::fs::File::open(netns)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", netns.display())))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            use std::os::fd::AsFd;
            setns_net(ns.as_fd()).map_err(|e| io::Error::new(e.kind(), format!("setns: {e}")))?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Drop capability `cap` from the effective and permitted sets of the calling *thread* only
/// (raw `capset`, which acts on one task; glibc's set*id would broadcast to every thread).
/// The thread cannot regain it. Used by tests to check admin-gated netlink ops.
#[cfg(test)]
pub(crate) fn drop_thread_capability(cap: u32) -> io::Result<()> {
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget with a v3 header writes two CapData entries, which `data` provides;
    // pid 0 means the calling thread.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let (word, bit) = ((cap / 32) as usize, 1u32 << (cap % 32));
    data[word].effective &= !bit;
    data[word].permitted &= !bit;
    // SAFETY: capset with a v3 header reads two CapData entries from `data`; pid 0 is the
    // calling thread, so only this thread's credentials change.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A generic-netlink socket (`AF_NETLINK`, `NETLINK_GENERIC`) in the calling thread's
/// network namespace, with extended acks on and capped acks (the kernel does not echo the
/// request back; we keep our own copy for the extack offsets).
pub(crate) fn genl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call with constant arguments; no pointers.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_GENERIC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    for opt in [libc::NETLINK_EXT_ACK, libc::NETLINK_CAP_ACK] {
        let one: libc::c_int = 1;
        // SAFETY: `one` is a live c_int and optlen is its size; `fd` is owned above.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_NETLINK,
                opt,
                (&raw const one).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// `send(fd, buf, 0)` of one whole datagram.
pub(crate) fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is readable for its length; `fd` is a live borrowed fd.
        let r = unsafe { libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), 0) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recv(fd, buf, MSG_TRUNC)`: returns the datagram's full length, which exceeds
/// `buf.len()` if it was truncated.
pub(crate) fn recv_trunc(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is writable for its length and the kernel writes at most that much
        // (MSG_TRUNC only changes the return value); `fd` is a live borrowed fd.
        let r = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_TRUNC,
            )
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recv(fd, buf, buf.len(), MSG_PEEK | MSG_TRUNC)` of a TCP socket: waits as a read of
/// `buf.len()` bytes would (for `min(SO_RCVLOWAT, buf.len())` bytes, within `SO_RCVTIMEO`,
/// not at all with `O_NONBLOCK`), and returns how many it found, up to `buf.len()` (0 at
/// EOF), consuming nothing and copying nothing into `buf`. A signal restarts the wait.
///
/// That is the kernel's `tcp_recvmsg_locked` (net/ipv4/tcp.c): the target is
/// `sock_rcvlowat(sk, flags & MSG_WAITALL, len)`; `MSG_PEEK` counts in a private `peek_seq`,
/// so `copied_seq` stays and no skb is eaten; `MSG_TRUNC` skips `skb_copy_datagram_msg` and
/// still counts the bytes in `copied` (tcp(7): with `MSG_TRUNC` the data is not passed back).
/// `buf` is still whole and writable (uninitialized, never read by the caller): another
/// socket's `recvmsg` (kTLS, a BPF sockmap) may ignore `MSG_TRUNC` and copy into it.
pub(crate) fn peek_trunc(
    fd: BorrowedFd<'_>,
    buf: &mut [std::mem::MaybeUninit<u8>],
) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes (uninitialized bytes may be
        // written; the caller reads none) and the kernel writes at most that many; `fd` is a
        // live borrowed fd.
        let r = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_PEEK | libc::MSG_TRUNC,
            )
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recvmsg(fd, {iov: bufs}, flags)` without control data: a vectored receive with flags
/// (the emulator's "NIC DMA" of TCP bytes into net_iov pages).
pub(crate) fn recv_vectored(
    fd: BorrowedFd<'_>,
    bufs: &mut [io::IoSliceMut<'_>],
    flags: i32,
) -> io::Result<usize> {
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSliceMut` is guaranteed ABI-compatible with `iovec` on Unix.
    msg.msg_iov = bufs.as_mut_ptr().cast();
    msg.msg_iovlen = bufs.len() as _;
    loop {
        // SAFETY: `fd` is live; `msg` points at `bufs.len()` iovecs, each describing a live
        // slice valid for writes of its length, all outliving the call; no control buffer.
        let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT)`: the bytes a blocking read of at least that
/// length waits for (the kernel keeps it at 1 or more).
pub(crate) fn rcvlowat(fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` is a live c_int writable for `len` bytes and `len` a live socklen_t, both
    // outliving the call; the kernel writes at most `len` bytes to `v`; `fd` is live.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(v.max(1) as usize)
    }
}

/// `getsockopt(SO_INCOMING_NAPI_ID)`: the id of the NAPI instance that received the socket's
/// last packet; 0 when there was none with an id (loopback, a device without NAPI: the
/// kernel turns every non-NAPI value into 0). A kernel built without
/// `CONFIG_NET_RX_BUSY_POLL` has no such option: ENOPROTOOPT.
pub(crate) fn incoming_napi_id(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut v: libc::c_uint = 0;
    let mut len = std::mem::size_of::<libc::c_uint>() as libc::socklen_t;
    // SAFETY: `v` is a live c_uint writable for `len` bytes and `len` a live socklen_t, both
    // outliving the call; the kernel writes at most `len` bytes to `v`; `fd` is live.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_INCOMING_NAPI_ID,
            (&mut v as *mut libc::c_uint).cast(),
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(v)
    }
}

/// `fcntl(fd, F_GETFL) & O_NONBLOCK`: whether reads on `fd` never wait.
pub(crate) fn is_nonblocking(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: F_GETFL takes no argument and touches no memory of ours; `fd` is live.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r & libc::O_NONBLOCK != 0)
    }
}

/// `poll(fd, POLLIN, 0)`: the events `fd` reports now (tests look for `POLLERR`).
#[cfg(test)]
pub(crate) fn poll_now(fd: BorrowedFd<'_>) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd, valid for reads and writes across the call (nfds 1);
    // `fd` is a live borrowed fd; a timeout of 0 returns at once.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(p.revents)
    }
}

/// A datagram socket for `SIOCETHTOOL` ioctls, in the calling thread's network namespace.
pub(crate) fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory arguments; a non-negative return is a fresh fd.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An `ifreq` naming `ifname` (all other fields zero), or `InvalidInput` for a name the
/// kernel cannot take.
fn ifreq_for(ifname: &str) -> io::Result<libc::ifreq> {
    let name = ifname.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad interface name {ifname:?}"),
        ));
    }
    // SAFETY: ifreq is a plain C struct (name array + union) for which all-zero is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    Ok(ifr)
}

/// `ioctl(fd, SIOCGIFADDR, {ifr_name: ifname})`: the interface's primary IPv4 address;
/// `None` when it has none (`EADDRNOTAVAIL`); `ENODEV` when there is no such interface.
pub(crate) fn ipv4_of(fd: BorrowedFd<'_>, ifname: &str) -> io::Result<Option<std::net::Ipv4Addr>> {
    let mut ifr = ifreq_for(ifname)?;
    // SAFETY: `ifr` is a valid ifreq that lives across the call; SIOCGIFADDR writes a
    // sockaddr into its union, which is large enough for one.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFADDR, &mut ifr) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EADDRNOTAVAIL) => Ok(None),
            _ => Err(e),
        };
    }
    // SAFETY: on success the kernel wrote an AF_INET sockaddr_in into ifru_addr.
    let sin: libc::sockaddr_in = unsafe {
        std::ptr::read_unaligned((&raw const ifr.ifr_ifru.ifru_addr).cast::<libc::sockaddr_in>())
    };
    Ok(Some(std::net::Ipv4Addr::from(u32::from_be(
        sin.sin_addr.s_addr,
    ))))
}

/// The index of interface `ifname` in the network namespace of socket `fd`
/// (`SIOCGIFINDEX`); `NotFound` when no interface has that name there.
pub(crate) fn ifindex_of(fd: BorrowedFd<'_>, ifname: &str) -> io::Result<u32> {
    let mut ifr = ifreq_for(ifname)?;
    // SAFETY: `ifr` is a valid ifreq naming the interface; SIOCGIFINDEX writes only its
    // ifru_ifindex member.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFINDEX, &mut ifr) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENODEV) => io::Error::new(io::ErrorKind::NotFound, e),
            _ => e,
        });
    }
    // SAFETY: on success the kernel filled the union's ifindex member.
    let index = unsafe { ifr.ifr_ifru.ifru_ifindex };
    u32::try_from(index).map_err(|_| io::Error::other(format!("ifindex {index}")))
}

/// The bytes the kernel reads and writes for the ethtool command encoded in `cmd` (its
/// first word, and the counts inside it), for the commands this crate sends; `None` for
/// any other command. include/uapi/linux/ethtool.h: `ethtool_value` is 8 bytes,
/// `ethtool_rxfh_indir` 8 plus 4 per entry, `ethtool_rxnfc` 192 (`ETHTOOL_GRXCLSRLALL`:
/// and 4 per listed rule from offset 188).
fn ethtool_len(cmd: &[u8]) -> Option<usize> {
    let word = |at: usize| Some(u32::from_ne_bytes(cmd.get(at..at + 4)?.try_into().ok()?));
    let len = match word(0)? {
        0x25 | 0x26 => 8,                                 // G/SFLAGS
        0x38 | 0x39 => 8 + 4 * word(4)? as usize,         // G/SRXFHINDIR
        0x2d..=0x2f | 0x31 | 0x32 => 192, // GRXRINGS, GRXCLSRLCNT, GRXCLSRULE, SRXCLSRLDEL/INS
        0x30 => (188 + 4 * word(184)? as usize).max(192), // GRXCLSRLALL
        _ => return None,
    };
    Some(len)
}

/// `ioctl(fd, SIOCETHTOOL, {ifr_name: ifname, ifr_data: cmd})`: the legacy ethtool ioctl
/// with the command struct `cmd` (read and written by the kernel in place). `InvalidInput`
/// when `cmd` is not a command [`ethtool_len`] knows or is shorter than its struct.
pub(crate) fn ethtool_ioctl(fd: BorrowedFd<'_>, ifname: &str, cmd: &mut [u8]) -> io::Result<()> {
    let refused = |what: String| Err(io::Error::new(io::ErrorKind::InvalidInput, what));
    match ethtool_len(cmd) {
        Some(len) if len <= cmd.len() => {}
        Some(len) => {
            return refused(format!(
                "an ethtool command of {} bytes, its struct needs {len}",
                cmd.len()
            ));
        }
        None => {
            let head = cmd
                .get(..4)
                .map(|w| u32::from_ne_bytes(w.try_into().expect("4")));
            return refused(format!(
                "ethtool command {} is not one this crate sends",
                head.map_or("(none: under 4 bytes)".into(), |c| format!("{c:#x}"))
            ));
        }
    }
    let mut ifr = ifreq_for(ifname)?;
    ifr.ifr_ifru.ifru_data = cmd.as_mut_ptr().cast();
    // SAFETY: `ifr` is a valid ifreq whose ifr_data points at `cmd`, which lives across the
    // call and holds at least the bytes the kernel reads and writes for the command encoded
    // in it (checked above: `ethtool_len` of its cmd word and counts).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCETHTOOL, &mut ifr) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    fn cmd(words: &[(usize, u32)], len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        for &(at, v) in words {
            b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        }
        b
    }

    /// A TCP peek with `MSG_TRUNC` waits for `min(SO_RCVLOWAT, len)` bytes as a read of `len`
    /// would, and says how many it found without copying them out or consuming them (the
    /// emulator's wait for bytes: before, it copied them into a zeroed buffer of that length).
    #[test]
    fn a_tcp_peek_with_msg_trunc_waits_for_the_mark_and_copies_nothing() {
        use std::io::{Read, Write};
        use std::mem::MaybeUninit;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        peer.write_all(b"hello").unwrap();
        let mut buf = [MaybeUninit::new(0xABu8); 64];
        let t = std::time::Instant::now();
        while peek_trunc(s.as_fd(), &mut buf).unwrap() < 5 {
            assert!(t.elapsed().as_secs() < 10, "5 bytes never arrived");
        }
        // SAFETY: every byte of `buf` was initialized above, and the kernel writes only
        // initialized bytes.
        let after: Vec<u8> = buf.iter().map(|b| unsafe { b.assume_init() }).collect();
        assert!(
            after.iter().all(|&b| b == 0xAB),
            "nothing copied: {after:?}"
        );
        // A mark above what is there: waited for until SO_RCVTIMEO, then what came is told.
        set_rcvlowat(s.as_fd(), 8).unwrap();
        let timeout = std::time::Duration::from_millis(300);
        s.set_read_timeout(Some(timeout)).unwrap();
        let t = std::time::Instant::now();
        assert_eq!(peek_trunc(s.as_fd(), &mut buf).unwrap(), 5);
        let slack = std::time::Duration::from_millis(20); // SO_RCVTIMEO counts in jiffies
        assert!(t.elapsed() + slack >= timeout, "waited {:?}", t.elapsed());
        // Nothing was consumed.
        let mut got = [0u8; 5];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
    }

    #[test]
    fn an_ethtool_command_shorter_than_what_the_kernel_writes_is_refused_before_the_call() {
        // Before, the length was the caller's word: a rule list asking for 100 locations in
        // a 192-byte buffer let the kernel write 212 bytes past its end.
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut list = cmd(&[(0, 0x30), (184, 100)], 192);
        let e = ethtool_ioctl(sock.as_fd(), "lo", &mut list).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("its struct needs 588"), "{e}");
        let mut indir = cmd(&[(0, 0x38), (4, 64)], 8);
        assert!(ethtool_ioctl(sock.as_fd(), "lo", &mut indir).is_err());
        let mut unknown = cmd(&[(0, 0x1)], 4096);
        let e = ethtool_ioctl(sock.as_fd(), "lo", &mut unknown).unwrap_err();
        assert!(e.to_string().contains("command 0x1 is not one"), "{e}");
        assert_eq!(ethtool_len(&cmd(&[(0, 0x30)], 192)), Some(192));
        assert_eq!(ethtool_len(&cmd(&[(0, 0x25)], 8)), Some(8));
        assert_eq!(
            ethtool_len(&[0x25, 0]),
            None,
            "too short to hold its cmd word"
        );
    }

    #[test]
    fn every_ethtool_command_the_crate_sends_reaches_the_kernel() {
        // Before, ETHTOOL_GRXCLSRULE (0x2f, added with the journal's rule checks) was missing
        // here: every check of a steering rule failed before the call, and a NIC with ntuple
        // rules could never be restored. And this test listed the commands by hand, apart
        // from those the code sends: it did not see that one was missing.
        use crate::nic::steer::{READS, SENT};
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for c in SENT {
            assert!(
                ethtool_len(&cmd(&[(0, c)], 192)).is_some(),
                "command {c:#x}"
            );
        }
        // The reads, sent: `lo` has no rules, so the kernel answers (an errno), not this
        // crate's refusal. (The writes are not sent, even to `lo`.)
        for c in READS {
            assert!(SENT.contains(&c), "read {c:#x} not in SENT");
            let mut b = cmd(&[(0, c)], 192);
            if let Err(e) = ethtool_ioctl(sock.as_fd(), "lo", &mut b) {
                assert!(e.raw_os_error().is_some(), "command {c:#x}: {e}");
            }
        }
    }

    #[test]
    fn every_ethtool_command_declared_is_listed_as_sent() {
        // The commands are the `const ETHTOOL_*` of the steering module: one declared there
        // but not in its `SENT` would escape the test above.
        use crate::nic::steer::SENT;
        let source = include_str!("nic/steer.rs");
        let declared: Vec<(&str, u32)> = source
            .lines()
            .filter_map(|l| {
                let (name, value) = l.split_once("const ETHTOOL_")?.1.split_once(": u32 = ")?;
                let hex = value.trim_end_matches(';').trim_start_matches("0x");
                Some((name, u32::from_str_radix(hex, 16).expect(name)))
            })
            .collect();
        assert_eq!(declared.len(), SENT.len(), "{declared:?}");
        for (name, value) in declared {
            assert!(
                SENT.contains(&value),
                "ETHTOOL_{name} ({value:#x}) is not in SENT"
            );
        }
    }
}
