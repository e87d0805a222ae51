//! The trainer's credentials (`SO_PEERCRED`), read into plain integers, and its supplementary
//! groups (`SO_PEERGROUPS`), which `allowed_gids` matches as well as its primary gid.
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

/// The most supplementary groups a process may have (the kernel's `NGROUPS_MAX`).
const MAX_GROUPS: usize = 65_536;

/// The supplementary groups the kernel recorded for the peer of `sock` when it connected
/// (mapped into this user namespace; its primary gid is [`PeerCred::gid`]). Needs Linux 4.13+:
/// older kernels answer `ENOPROTOOPT`.
pub fn peer_groups(sock: &impl AsFd) -> io::Result<Vec<u32>> {
    peer_groups_from(sock, 64)
}

/// [`peer_groups`], asking first with room for `room` groups; a peer with more is asked again
/// with room for the count the kernel gives (at most [`MAX_GROUPS`]).
fn peer_groups_from(sock: &impl AsFd, room: usize) -> io::Result<Vec<u32>> {
    const GID: usize = std::mem::size_of::<libc::gid_t>();
    let mut groups: Vec<libc::gid_t> = vec![0; room];
    loop {
        let mut len = (groups.len() * GID) as libc::socklen_t;
        // SAFETY: the fd is borrowed for the call; `groups` is a writable buffer of `len`
        // bytes (whole gid_t), the most SO_PEERGROUPS writes (it answers ERANGE, writing only
        // `len`, when the groups do not fit), and `len` is a live socklen_t the kernel updates.
        let rc = unsafe {
            libc::getsockopt(
                sock.as_fd().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / GID;
        if rc == 0 {
            groups.truncate(n.min(groups.len()));
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        // ERANGE: too little room, and `len` is what the groups need.
        if e.raw_os_error() != Some(libc::ERANGE) || n <= groups.len() || n > MAX_GROUPS {
            return Err(e);
        }
        groups.resize(n, 0);
    }
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

    /// This process's supplementary groups.
    fn own_groups() -> Vec<u32> {
        // SAFETY: a size of 0 with a null list only counts the groups.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        let mut groups: Vec<libc::gid_t> = vec![0; usize::try_from(n).unwrap()];
        // SAFETY: `groups` has room for the `n` gids asked for.
        let got = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
        groups.truncate(usize::try_from(got).unwrap());
        groups.sort_unstable();
        groups
    }

    #[test]
    fn a_socket_pair_gives_this_process_supplementary_groups() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut got = peer_groups(&a).unwrap();
        got.sort_unstable();
        assert_eq!(got, own_groups());
        // Asked with too little room (none), it asks again with the room the kernel names.
        let mut again = peer_groups_from(&a, 0).unwrap();
        again.sort_unstable();
        assert_eq!(again, own_groups());
    }

    #[test]
    fn pid_zero_is_none_not_a_panic() {
        // A socket with no peer process: the kernel answers pid 0, as it does for a peer in a
        // pid namespace this one cannot see (tests/e2e/test_stalled_peers.py runs that case).
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(peer_cred(&udp).unwrap().pid, None);
    }
}
