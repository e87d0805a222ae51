//! The trainer's credentials (`SO_PEERCRED`), read into plain integers.
//!
//! rustix's `UCred` holds the pid as a non-zero type, but the kernel answers pid 0 for a peer
//! whose process this pid namespace cannot see: a trainer pod beside the node's DaemonSet pod,
//! sharing only the socket's host path. Read through that type, every such trainer was
//! refused ("SO_PEERCRED failed ... os error 0"). Here pid 0 is `None`.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// Who is on the other end of a Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's pid as this pid namespace sees it; `None` where it cannot see the process.
    pub pid: Option<u32>,
    /// The peer's uid (mapped into this user namespace).
    pub uid: u32,
    /// The peer's gid (mapped into this user namespace).
    pub gid: u32,
}

/// The credentials the kernel recorded for the peer of `sock` when it connected.
pub fn peer_cred(sock: &impl AsFd) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the fd is borrowed for the call; `cred` is a writable `ucred` of `len` bytes,
    // the size SO_PEERCRED writes, and `len` is a live socklen_t the kernel updates.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("SO_PEERCRED returned {len} bytes, not a struct ucred"),
        ));
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).ok().filter(|&p| p > 0),
        uid: cred.uid,
        gid: cred.gid,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_socket_pair_names_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = peer_cred(&a).unwrap();
        assert_eq!(cred.pid, Some(std::process::id()));
        // SAFETY: plain getters without arguments.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        assert_eq!((cred.uid, cred.gid), (uid, gid));
    }

    #[test]
    fn pid_zero_is_none_not_a_panic() {
        // A socket with no peer process: the kernel answers pid 0, as it does for a peer in a
        // pid namespace this one cannot see (tests/e2e/test_stalled_peers.py runs that case).
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(peer_cred(&udp).unwrap().pid, None);
    }
}
