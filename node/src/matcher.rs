//! Identifies data connections without in-band bytes (DESIGN §2): a source reports the local
//! address of each data connection on its authenticated control connection ("expected"), and
//! the node matches the peer address of the connections accepted on its data port. Either can
//! come first. Connections nobody announces within [`UNMATCHED_TIMEOUT`] are dropped, and at
//! most [`MAX_UNMATCHED`] are held.
//!
//! A pure table, generic over the socket and the announcement, so its order races are unit
//! tested without sockets; the data plane owns it and starts a receiver per match.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long an accepted, unannounced data connection is kept.
pub const UNMATCHED_TIMEOUT: Duration = Duration::from_secs(10);
/// At most this many unidentified connections are held at once.
pub const MAX_UNMATCHED: usize = 1024;

/// What became of an accepted connection.
#[derive(Debug)]
pub enum Accepted<S, E> {
    /// A source had announced it: start its receiver.
    Matched(S, E),
    /// Held until a source announces it (or it times out).
    Held,
    /// Too many unidentified connections: dropped.
    Refused(S),
}

/// The matcher table: announced addresses and accepted connections waiting for each other.
#[derive(Debug)]
pub struct Matcher<S, E> {
    expected: HashMap<SocketAddr, E>,
    accepted: HashMap<SocketAddr, (S, Instant)>,
}

impl<S, E> Default for Matcher<S, E> {
    fn default() -> Self {
        Self {
            expected: HashMap::new(),
            accepted: HashMap::new(),
        }
    }
}

impl<S, E> Matcher<S, E> {
    /// A source announced a data connection from `addr`: the connection, if it was accepted
    /// already.
    pub fn expect(&mut self, addr: SocketAddr, e: E) -> Option<(S, E)> {
        match self.accepted.remove(&addr) {
            Some((sock, _)) => Some((sock, e)),
            None => {
                self.expected.insert(addr, e);
                None
            }
        }
    }

    /// A connection from `peer` was accepted at `now`.
    pub fn accepted(&mut self, peer: SocketAddr, sock: S, now: Instant) -> Accepted<S, E> {
        if let Some(e) = self.expected.remove(&peer) {
            return Accepted::Matched(sock, e);
        }
        if self.accepted.len() >= MAX_UNMATCHED {
            return Accepted::Refused(sock);
        }
        self.accepted.insert(peer, (sock, now));
        Accepted::Held
    }

    /// Removes the announcements `gone` selects (their link went down) and returns them.
    pub fn forget(&mut self, gone: impl Fn(&E) -> bool) -> Vec<E> {
        let keys: Vec<SocketAddr> = self
            .expected
            .iter()
            .filter(|(_, e)| gone(e))
            .map(|(k, _)| *k)
            .collect();
        keys.iter()
            .filter_map(|k| self.expected.remove(k))
            .collect()
    }

    /// Removes accepted connections nobody announced within [`UNMATCHED_TIMEOUT`] of `now`.
    pub fn sweep(&mut self, now: Instant) -> Vec<(SocketAddr, S)> {
        let old: Vec<SocketAddr> = self
            .accepted
            .iter()
            .filter(|(_, (_, t))| now.duration_since(*t) >= UNMATCHED_TIMEOUT)
            .map(|(a, _)| *a)
            .collect();
        old.into_iter()
            .filter_map(|a| self.accepted.remove(&a).map(|(s, _)| (a, s)))
            .collect()
    }

    /// (announced and waiting, accepted and waiting).
    #[cfg(test)]
    pub fn waiting(&self) -> (usize, usize) {
        (self.expected.len(), self.accepted.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn announcement_first_then_accept() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        assert!(m.expect(addr(1), 7).is_none());
        let now = Instant::now();
        assert!(matches!(
            m.accepted(addr(2), "stranger", now),
            Accepted::Held
        ));
        assert!(matches!(
            m.accepted(addr(1), "sock", now),
            Accepted::Matched("sock", 7)
        ));
        assert_eq!(m.waiting(), (0, 1));
    }

    #[test]
    fn accept_first_then_announcement() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        assert!(matches!(
            m.accepted(addr(1), "sock", Instant::now()),
            Accepted::Held
        ));
        assert_eq!(m.expect(addr(1), 3), Some(("sock", 3)));
        assert_eq!(m.waiting(), (0, 0));
    }

    #[test]
    fn unannounced_connections_time_out_and_are_bounded() {
        let mut m: Matcher<u32, u16> = Matcher::default();
        let t0 = Instant::now();
        for i in 0..MAX_UNMATCHED {
            assert!(matches!(
                m.accepted(addr(i as u16 + 1), i as u32, t0),
                Accepted::Held
            ));
        }
        assert!(matches!(
            m.accepted(addr(60000), 9, t0),
            Accepted::Refused(9)
        ));
        assert!(m.sweep(t0 + UNMATCHED_TIMEOUT / 2).is_empty());
        assert_eq!(m.sweep(t0 + UNMATCHED_TIMEOUT).len(), MAX_UNMATCHED);
        assert_eq!(m.waiting(), (0, 0));
    }

    #[test]
    fn a_link_going_down_forgets_only_its_announcements() {
        let mut m: Matcher<(), (usize, u64)> = Matcher::default();
        m.expect(addr(1), (0, 1));
        m.expect(addr(2), (0, 2));
        m.expect(addr(3), (1, 1));
        let mut gone = m.forget(|&(link, generation)| link == 0 && generation == 1);
        gone.sort();
        assert_eq!(gone, vec![(0, 1)]);
        assert_eq!(m.waiting(), (2, 0));
    }
}
