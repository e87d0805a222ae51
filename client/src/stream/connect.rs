//! A bounded connect to the node's trainer socket. A Unix `connect` waits for as long as the
//! listener's backlog stays full (a node stopped, e.g. with SIGSTOP, or stuck, with trainers
//! queued); its only bound is the socket's send timeout (SO_SNDTIMEO), set here for the
//! connect and cleared after it, as the Python SDK does (`CONNECT_LIMIT`, 10 s).

use std::io;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::sockopt::{self, Timeout};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::ClientError;

/// Longest wait for the node service to take a connection (the Python SDK's).
#[cfg(not(test))]
pub(super) const CONNECT_LIMIT: Duration = Duration::from_secs(10);
/// Under test: a listener whose backlog is full is given up on sooner.
#[cfg(test)]
pub(super) const CONNECT_LIMIT: Duration = Duration::from_millis(300);

/// A blocking socket connected to `path` within `limit` (above zero), or
/// [`ClientError::Connect`] naming `path`: past `limit`, it says the node's backlog is full.
pub(super) fn connect(path: &Path, limit: Duration) -> Result<UnixStream, ClientError> {
    let err = |source: io::Error| ClientError::Connect {
        path: path.display().to_string(),
        source,
    };
    let addr = SocketAddrUnix::new(path).map_err(|e| err(e.into()))?;
    let (family, kind) = (AddressFamily::UNIX, SocketType::STREAM);
    let fd = rustix::net::socket_with(family, kind, SocketFlags::CLOEXEC, None)
        .map_err(|e| err(e.into()))?;
    let deadline = Instant::now() + limit;
    let mut left = limit;
    loop {
        sockopt::set_socket_timeout(&fd, Timeout::Send, Some(left)).map_err(|e| err(e.into()))?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => break,
            // A signal while waiting for room in the backlog (a bounded wait is not
            // restarted): wait out the rest of the limit. The socket is still unconnected.
            Err(Errno::INTR) => {
                left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(err(backlog_full(limit)));
                }
            }
            Err(Errno::AGAIN) => return Err(err(backlog_full(limit))),
            Err(e) => return Err(err(e.into())),
        }
    }
    // The frames are written blocking, with no send limit (fdpass::send_frame).
    sockopt::set_socket_timeout(&fd, Timeout::Send, None).map_err(|e| err(e.into()))?;
    Ok(UnixStream::from(fd))
}

/// The error of a connect that found no room in the node's backlog within `limit`.
fn backlog_full(limit: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!(
            "the node service took no connection within {limit:?} (its listen backlog is full: \
             is it stopped, e.g. with SIGSTOP, or stuck? see its log and its admin /v1/status)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::sync::mpsc;

    use super::*;
    use crate::{Stream, StreamOptions};

    /// A listener at `path` whose backlog is full (a node that accepts nothing), and the
    /// connections that fill it.
    fn full_listener(path: &Path) -> (OwnedFd, Vec<OwnedFd>) {
        let (family, kind) = (AddressFamily::UNIX, SocketType::STREAM);
        let addr = SocketAddrUnix::new(path).unwrap();
        let l = rustix::net::socket_with(family, kind, SocketFlags::CLOEXEC, None).unwrap();
        rustix::net::bind(&l, &addr).unwrap();
        rustix::net::listen(&l, 0).unwrap();
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        let mut queued = Vec::new();
        for _ in 0..64 {
            let c = rustix::net::socket_with(family, kind, flags, None).unwrap();
            match rustix::net::connect(&c, &addr) {
                Ok(()) => queued.push(c),
                Err(Errno::AGAIN) => return (l, queued),
                Err(e) => panic!("filling the backlog: {e}"),
            }
        }
        panic!("the backlog of a listen(0) socket took 64 connections");
    }

    #[test]
    fn an_open_on_a_node_whose_backlog_is_full_fails_after_the_limit_naming_the_path() {
        let p = std::env::temp_dir().join(format!("sw-client-full-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let _node = full_listener(&p);
        // Before, the connect waited for as long as the backlog stayed full: a channel with
        // its own limit fails the test rather than hang it.
        let (tx, rx) = mpsc::channel();
        let at = p.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = Stream::open(&at, StreamOptions::new("d")).map(|_| ());
            let kind = match &r {
                Err(ClientError::Connect { source, .. }) => Some(source.kind()),
                _ => None,
            };
            let _ = tx.send((kind, r.err().map(|e| e.to_string()), t0.elapsed()));
        });
        let (kind, message, took) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("Stream::open waited on a full backlog with no limit");
        let _ = std::fs::remove_file(&p);
        assert_eq!(kind, Some(io::ErrorKind::TimedOut), "{message:?}");
        let message = message.unwrap();
        assert!(message.contains(&p.display().to_string()), "{message}");
        assert!(message.contains("backlog is full"), "{message}");
        assert!(
            took >= CONNECT_LIMIT / 2,
            "gave up after {took:?}, not after the limit"
        );
    }

    #[test]
    fn a_missing_socket_fails_at_once_naming_the_path() {
        let p = std::env::temp_dir().join(format!("sw-client-none-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let e = connect(&p, CONNECT_LIMIT).unwrap_err();
        let ClientError::Connect { path, source } = &e else {
            panic!("{e}");
        };
        assert_eq!(path, &p.display().to_string());
        assert_eq!(source.kind(), io::ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn a_connected_socket_has_no_send_limit_left() {
        let p = std::env::temp_dir().join(format!("sw-client-ok-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let s = connect(&p, CONNECT_LIMIT).unwrap();
        let _ = std::fs::remove_file(&p);
        assert_eq!(sockopt::socket_timeout(&s, Timeout::Send).unwrap(), None);
    }
}
