//! The warnings that a peer which never authenticated can cause at will on the control port: a
//! connection refused before its handshake (off loopback without a secret, past the handshake
//! caps), and one dropped before `Welcome` (bytes that are no protocol frame, a wrong secret, a
//! handshake that timed out or was evicted). Each is logged at most once per peer (an IPv4
//! address, an IPv6 /64, as [`crate::admit`] counts them) and cause every
//! [`warn_limit::EVERY`], with the lines left out counted ([`shardwire_protocol::warn_limit`]:
//! the next line of that key says how many, and so does [`Noise::say_left_out`] once its
//! window is over). Before, each was logged once per connection: a connection that fails at
//! once frees its handshake slot at once, so any host that could reach the control port made
//! the source write lines at its accept rate and could fill its log disk. A cause is part of
//! the key, so a scanner's garbage does not hide a node's wrong secret from the same host. A
//! failure after `Welcome` is a node's session's, and is logged every time.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use shardwire_protocol::framing::FrameError;
use shardwire_protocol::warn_limit::{self, WarnLimit};

use crate::admit;
use crate::control::SessionError;

/// A kind of line an unauthenticated peer can cause, with its cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Line {
    /// Refused before its handshake started.
    Refused(&'static str),
    /// Dropped before `Welcome`.
    Dropped(&'static str),
}

impl Line {
    /// What the line says, for the line that counts those left out.
    fn what(self) -> String {
        match self {
            Line::Refused(cause) => format!("refusing a control connection ({cause})"),
            Line::Dropped(cause) => format!("dropped node connection before Welcome ({cause})"),
        }
    }
}

/// The cause of a failure before `Welcome`, as a key of the limit: one of a few.
fn cause(e: &SessionError) -> &'static str {
    use SessionError as E;
    match e {
        E::Frame(FrameError::Decode(_)) => "malformed",
        E::Frame(FrameError::TooLong { .. }) => "frame too long",
        E::Frame(
            FrameError::Closed | FrameError::Truncated { .. } | FrameError::TruncatedLength { .. },
        ) => "closed",
        E::Frame(_) => "io",
        E::Version { .. } => "version",
        E::AuthFailed => "wrong secret",
        E::Unexpected { .. } => "unexpected message",
        E::Timeout(_) => "timeout",
        E::Evicted => "evicted",
        E::NotLoopback(_) => "not on loopback",
        E::Draining => "draining",
        E::TooManySessions(_) => "max_connections",
        E::WriteTimeout(_) => "write timeout",
        _ => "other",
    }
}

/// The lines about unauthenticated control connections logged and left out, by kind, cause
/// and peer.
#[derive(Debug)]
pub(crate) struct Noise(Mutex<WarnLimit<(Line, IpAddr)>>);

impl Default for Noise {
    fn default() -> Self {
        Self(Mutex::new(WarnLimit::new(warn_limit::EVERY)))
    }
}

impl Noise {
    /// Logs that the control connection of `peer` is refused before its handshake (`cause`, a
    /// few words; `why`, what the peer is told), unless such a line about its peer was logged
    /// within the window.
    pub fn refused(&self, peer: SocketAddr, cause: &'static str, why: &str) {
        let Some((host, suppressed)) = self.hit(Line::Refused(cause), peer, Instant::now()) else {
            return;
        };
        let every = warn_limit::EVERY.as_secs();
        tracing::warn!(%peer, %host, suppressed,
            "refusing a control connection: {why} (one such line per peer and cause every {every} s)");
    }

    /// Logs that the control connection of `peer` failed with `e` before `Welcome`, unless
    /// such a line (the same cause) about its peer was logged within the window.
    pub fn dropped(&self, peer: SocketAddr, e: &SessionError) {
        let Some((host, suppressed)) = self.hit(Line::Dropped(cause(e)), peer, Instant::now())
        else {
            return;
        };
        let every = warn_limit::EVERY.as_secs();
        tracing::warn!(%peer, %host, suppressed, error = %e,
            "dropped node connection before its handshake ended (one such line per peer and cause every {every} s)");
    }

    /// Whether a `line` about `peer` at `now` is logged: its peer as a log names it and the
    /// lines of that key left out since its last one; `None`: it is left out (counted).
    fn hit(&self, line: Line, peer: SocketAddr, now: Instant) -> Option<(String, u64)> {
        let host = admit::peer_of(peer.ip());
        let suppressed = self.limit().hit((line, host), now)?;
        Some((admit::named(host), suppressed))
    }

    /// Says the lines left out in windows now over, one line per key.
    pub fn say_left_out(&self) {
        let left = self.limit().flush(Instant::now());
        for ((line, host), suppressed) in left.keys {
            tracing::warn!(host = %admit::named(host), suppressed, what = %line.what(),
                "lines about control connections from this peer left out since its last such line");
        }
        if left.untracked > 0 {
            tracing::warn!(
                suppressed = left.untracked,
                peers_tracked = warn_limit::MAX_KEYS,
                "lines about control connections from peers past those tracked left out"
            );
        }
    }

    fn limit(&self) -> MutexGuard<'_, WarnLimit<(Line, IpAddr)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(peer: &str) -> SocketAddr {
        peer.parse().unwrap()
    }

    /// A flood of one peer logs one line per cause and window; an IPv6 host's /64 is one peer.
    #[test]
    fn one_line_per_peer_cause_and_window() {
        let noise = Noise::default();
        let t0 = Instant::now();
        let garbage = Line::Dropped(cause(&SessionError::Frame(FrameError::TooLong {
            len: 1 << 30,
            max: 8192,
        })));
        let logged = (0..1000u16)
            .filter(|i| {
                let peer = SocketAddr::new("10.0.0.1".parse().unwrap(), 1000 + i);
                let now = t0 + Duration::from_micros(u64::from(*i));
                noise.hit(garbage, peer, now).is_some()
            })
            .count();
        assert_eq!(logged, 1, "one line in the window, not one per connection");
        // A wrong secret from that host is still said once: another cause.
        let auth = Line::Dropped(cause(&SessionError::AuthFailed));
        assert_eq!(noise.hit(auth, at("10.0.0.1:9"), t0).map(|h| h.1), Some(0));
        assert!(noise.hit(auth, at("10.0.0.1:9"), t0).is_none());
        let v6 = |ip: &str| noise.hit(garbage, at(ip), t0);
        assert_eq!(v6("[2001:db8:0:7::1]:9").unwrap().0, "2001:db8:0:7::/64");
        assert!(v6("[2001:db8:0:7:ffff::2]:9").is_none(), "the same /64");
        assert!(v6("[2001:db8:0:8::1]:9").is_some(), "another /64");
        let next = noise.hit(garbage, at("10.0.0.1:1"), t0 + warn_limit::EVERY);
        assert_eq!(
            next,
            Some(("10.0.0.1".into(), 999)),
            "the next line says the rest"
        );
    }
}
