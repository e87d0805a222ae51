//! Identifies data connections without in-band bytes (DESIGN §2): a source reports the local
//! address of each data connection on its authenticated control connection ("expected"), and
//! the node matches the peer address of the connections accepted on its data ports. Either can
//! come first. Connections nobody announces within [`UNMATCHED_TIMEOUT`] are dropped, and so
//! are announcements whose connection does not arrive within it (their link's session cannot
//! use that connection; the data plane ends it). At most [`MAX_UNMATCHED`] are held: when the
//! table is full the oldest goes, and one peer host (an IPv4 address, an IPv6 /64: what one
//! host has, as the source's handshake limit counts it; [`host_of`]) holds at most
//! [`MAX_UNMATCHED_PER_IP`], so a host that opens connections and never has them announced
//! cannot keep a source's connections out, not even from a new address of its /64 each time.
//! Addresses are compared in
//! canonical form (an IPv4-mapped IPv6 address as IPv4: a dual-stack listener reports
//! peers so, while sources announce plain IPv4).
//!
//! Each announcement names its lane, whose data address the node advertised (`want`); a
//! connection must have arrived on exactly that address (its `getsockname`, `local`), else it
//! went through another NIC than its lane's (a source that dialled the wrong lane, or a route
//! that does not follow the lane's subnet) and the match is refused as [`Accepted::WrongLane`]
//! / [`Announced::WrongLane`], whichever side comes second.
//!
//! A pure table, generic over the socket and the announcement, so its order races are unit
//! tested without sockets; the data plane owns it and starts a receiver per match.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

/// How long an accepted, unannounced data connection is kept, and how long an announced one
/// is waited for (a source announces a connection once it has dialled it: it arrives at once).
pub const UNMATCHED_TIMEOUT: Duration = Duration::from_secs(10);
/// At most this many unidentified connections are held at once.
pub const MAX_UNMATCHED: usize = 1024;
/// At most this many of them from one peer host ([`host_of`]: an IPv4 address, an IPv6 /64;
/// a source host's data connections to one node: a flow per lane and connection, a few dozen).
pub const MAX_UNMATCHED_PER_IP: usize = 256;

/// The host a peer address counts as: the address itself (an IPv4-mapped IPv6 address as
/// IPv4), or its IPv6 /64 (what one host has: it may connect from any address in it).
pub fn host_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        v4 => v4,
    }
}

/// `host` (a [`host_of`]) as a log names it: `2001:db8:0:1::/64`, or the IPv4 address.
pub fn host_name(host: IpAddr) -> String {
    match host {
        IpAddr::V6(_) => format!("{host}/64"),
        v4 => v4.to_string(),
    }
}

/// A source announced a connection for one lane, but it arrived on another address.
#[derive(Debug)]
pub struct WrongLane<S, E> {
    /// The connection (drop it).
    pub sock: S,
    /// The announcement.
    pub e: E,
    /// Where it arrived (`getsockname`).
    pub local: SocketAddr,
    /// Where its lane is (the address the node advertised for it).
    pub want: SocketAddr,
}

/// What became of an accepted connection.
#[derive(Debug)]
pub enum Accepted<S, E> {
    /// A source had announced it: start its receiver.
    Matched(S, E),
    /// Held until a source announces it (or it times out); the oldest held connection,
    /// from the address given, if it made room for it (drop it).
    Held(Option<(SocketAddr, S)>),
    /// Too many unidentified connections from its peer's host ([`host_of`]): dropped.
    Refused(S),
    /// Announced for a lane whose address it did not arrive on: refuse it.
    WrongLane(WrongLane<S, E>),
}

/// What became of an announcement.
#[derive(Debug)]
pub enum Announced<S, E> {
    /// The connection had been accepted: start its receiver.
    Matched(S, E),
    /// Waiting for the connection.
    Waiting,
    /// The connection had been accepted on another address than its lane's: refuse it.
    WrongLane(WrongLane<S, E>),
    /// Another announcement already expects a connection from this address (of another
    /// link, or the same one twice): this one is refused, the first kept.
    Duplicate(E),
}

/// What [`Matcher::sweep`] dropped.
#[derive(Debug)]
pub struct Swept<S, E> {
    /// Accepted connections nobody announced in time, by peer address (close them).
    pub accepted: Vec<(SocketAddr, S)>,
    /// Announcements whose connection did not arrive in time, by the address announced.
    pub expected: Vec<(SocketAddr, E)>,
}

/// The matcher table: announced addresses and accepted connections waiting for each other.
#[derive(Debug)]
pub struct Matcher<S, E> {
    /// Peer address -> (the lane's address, the announcement, when it came).
    expected: HashMap<SocketAddr, (SocketAddr, E, Instant)>,
    /// Peer address -> (the socket, where it arrived, when).
    accepted: HashMap<SocketAddr, (S, SocketAddr, Instant)>,
}

/// `a` with an IPv4-mapped IPv6 address written as IPv4 (a dual-stack listener reports them so).
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
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
    /// A source announced a data connection from `addr` for a lane at `want`, at `now`: the
    /// connection, if it was accepted already (on `want`, or refused as the wrong lane). An
    /// address that an announcement expects already is refused: overwritten, the first
    /// announcement was lost without a word and its link's connection matched the other's.
    pub fn expect(
        &mut self,
        addr: SocketAddr,
        want: SocketAddr,
        e: E,
        now: Instant,
    ) -> Announced<S, E> {
        let (addr, want) = (canonical(addr), canonical(want));
        match self.accepted.remove(&addr) {
            Some((sock, local, _)) if local == want => Announced::Matched(sock, e),
            Some((sock, local, _)) => Announced::WrongLane(WrongLane {
                sock,
                e,
                local,
                want,
            }),
            None if self.expected.contains_key(&addr) => Announced::Duplicate(e),
            None => {
                self.expected.insert(addr, (want, e, now));
                Announced::Waiting
            }
        }
    }

    /// A connection from `peer` was accepted on `local` at `now`.
    pub fn accepted(
        &mut self,
        peer: SocketAddr,
        local: SocketAddr,
        sock: S,
        now: Instant,
    ) -> Accepted<S, E> {
        let (peer, local) = (canonical(peer), canonical(local));
        if let Some((want, e, _)) = self.expected.remove(&peer) {
            if want == local {
                return Accepted::Matched(sock, e);
            }
            return Accepted::WrongLane(WrongLane {
                sock,
                e,
                local,
                want,
            });
        }
        let host = host_of(peer.ip());
        let same_host = self
            .accepted
            .keys()
            .filter(|a| host_of(a.ip()) == host)
            .count();
        if same_host >= MAX_UNMATCHED_PER_IP {
            return Accepted::Refused(sock);
        }
        let evicted = match self.accepted.len() >= MAX_UNMATCHED {
            true => self
                .oldest()
                .and_then(|a| self.accepted.remove(&a).map(|(s, _, _)| (a, s))),
            false => None,
        };
        // The same peer address again: its earlier connection is gone, and closes here.
        self.accepted.insert(peer, (sock, local, now));
        Accepted::Held(evicted)
    }

    /// The peer address of the connection held longest.
    fn oldest(&self) -> Option<SocketAddr> {
        self.accepted
            .iter()
            .min_by_key(|(_, (_, _, t))| *t)
            .map(|(a, _)| *a)
    }

    /// Removes the announcements `gone` selects (their link went down) and returns them.
    pub fn forget(&mut self, gone: impl Fn(&E) -> bool) -> Vec<E> {
        let keys: Vec<SocketAddr> = self
            .expected
            .iter()
            .filter(|(_, (_, e, _))| gone(e))
            .map(|(k, _)| *k)
            .collect();
        keys.iter()
            .filter_map(|k| self.expected.remove(k).map(|(_, e, _)| e))
            .collect()
    }

    /// Removes accepted connections nobody announced, and announcements whose connection did
    /// not arrive, within [`UNMATCHED_TIMEOUT`] of `now`. Without the second, a fetch queued
    /// on a connection that never came waited for ever (its source's pings kept the session
    /// alive).
    pub fn sweep(&mut self, now: Instant) -> Swept<S, E> {
        let late = |t: &Instant| now.duration_since(*t) >= UNMATCHED_TIMEOUT;
        let old: Vec<SocketAddr> = (self.accepted.iter())
            .filter(|(_, (_, _, t))| late(t))
            .map(|(a, _)| *a)
            .collect();
        let accepted = (old.into_iter())
            .filter_map(|a| self.accepted.remove(&a).map(|(s, _, _)| (a, s)))
            .collect();
        let unmet: Vec<SocketAddr> = (self.expected.iter())
            .filter(|(_, (_, _, t))| late(t))
            .map(|(a, _)| *a)
            .collect();
        let expected = (unmet.into_iter())
            .filter_map(|a| self.expected.remove(&a).map(|(_, e, _)| (a, e)))
            .collect();
        Swept { accepted, expected }
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

    /// Lane 0's data address.
    fn lane0() -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], 7401))
    }

    /// Lane 1's data address.
    fn lane1() -> SocketAddr {
        SocketAddr::from(([10, 0, 1, 1], 7401))
    }

    #[test]
    fn announcement_first_then_accept() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        assert!(matches!(
            m.expect(addr(1), lane0(), 7, Instant::now()),
            Announced::Waiting
        ));
        let now = Instant::now();
        assert!(matches!(
            m.accepted(addr(2), lane0(), "stranger", now),
            Accepted::Held(None)
        ));
        assert!(matches!(
            m.accepted(addr(1), lane0(), "sock", now),
            Accepted::Matched("sock", 7)
        ));
        assert_eq!(m.waiting(), (0, 1));
    }

    /// A second announcement of an address already expected is refused and the first kept:
    /// it replaced the first, whose link then never got its connection (nor a word why).
    #[test]
    fn a_second_announcement_of_an_expected_address_is_refused() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        assert!(matches!(
            m.expect(addr(1), lane0(), 1, Instant::now()),
            Announced::Waiting
        ));
        assert!(matches!(
            m.expect(addr(1), lane0(), 2, Instant::now()),
            Announced::Duplicate(2)
        ));
        assert!(matches!(
            m.accepted(addr(1), lane0(), "sock", Instant::now()),
            Accepted::Matched("sock", 1)
        ));
    }

    #[test]
    fn accept_first_then_announcement() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        assert!(matches!(
            m.accepted(addr(1), lane1(), "sock", Instant::now()),
            Accepted::Held(None)
        ));
        assert!(matches!(
            m.expect(addr(1), lane1(), 3, Instant::now()),
            Announced::Matched("sock", 3)
        ));
        assert_eq!(m.waiting(), (0, 0));
    }

    #[test]
    fn a_connection_on_another_lane_is_refused_either_way_round() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        // Announced for lane 1, arrived on lane 0's address.
        assert!(matches!(
            m.expect(addr(1), lane1(), 5, Instant::now()),
            Announced::Waiting
        ));
        match m.accepted(addr(1), lane0(), "sock", Instant::now()) {
            Accepted::WrongLane(w) => {
                assert_eq!(
                    (w.sock, w.e, w.local, w.want),
                    ("sock", 5, lane0(), lane1())
                );
            }
            other => panic!("{other:?}"),
        }
        // Arrived first, announced second.
        assert!(matches!(
            m.accepted(addr(2), lane0(), "late", Instant::now()),
            Accepted::Held(None)
        ));
        match m.expect(addr(2), lane1(), 6, Instant::now()) {
            Announced::WrongLane(w) => {
                assert_eq!((w.sock, w.local, w.want), ("late", lane0(), lane1()))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(m.waiting(), (0, 0));
        // A dual-stack listener's IPv4-mapped local address is the IPv4 one.
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:7401".parse().unwrap();
        assert!(matches!(
            m.expect(addr(3), lane0(), 7, Instant::now()),
            Announced::Waiting
        ));
        assert!(matches!(
            m.accepted(addr(3), mapped, "v6", Instant::now()),
            Accepted::Matched("v6", 7)
        ));
    }

    /// Port `i` of host `h` (10.9.h.x).
    fn host(h: u8, i: usize) -> SocketAddr {
        SocketAddr::from(([10, 9, h, (i / 60000) as u8], (i % 60000) as u16 + 1))
    }

    #[test]
    fn unannounced_connections_time_out_and_one_host_cannot_fill_the_table() {
        let mut m: Matcher<u32, u16> = Matcher::default();
        let t0 = Instant::now();
        for i in 0..MAX_UNMATCHED_PER_IP {
            let t = t0 + Duration::from_micros(i as u64);
            assert!(matches!(
                m.accepted(addr(i as u16 + 1), lane0(), i as u32, t),
                Accepted::Held(None)
            ));
        }
        // The flooding host's next one is refused; another host's is held.
        assert!(matches!(
            m.accepted(addr(60000), lane0(), 9, t0),
            Accepted::Refused(9)
        ));
        // Other hosts fill the table; then the oldest connection goes for each new one, so
        // a source's connection is held (and matched) whoever holds the rest.
        let others = MAX_UNMATCHED - MAX_UNMATCHED_PER_IP;
        for i in 0..others {
            let h = 1 + (i / MAX_UNMATCHED_PER_IP) as u8;
            let t = t0 + Duration::from_millis(1 + i as u64);
            assert!(matches!(
                m.accepted(host(h, i), lane0(), 1000 + i as u32, t),
                Accepted::Held(None)
            ));
        }
        let source = SocketAddr::from(([10, 8, 0, 1], 40000));
        match m.accepted(source, lane0(), 7, t0 + Duration::from_secs(1)) {
            Accepted::Held(Some((old, 0))) => assert_eq!(old, addr(1), "the oldest"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            m.expect(source, lane0(), 3, Instant::now()),
            Announced::Matched(7, 3)
        ));
        assert!(m.sweep(t0 + UNMATCHED_TIMEOUT / 2).accepted.is_empty());
        assert_eq!(
            m.sweep(t0 + UNMATCHED_TIMEOUT + Duration::from_secs(2))
                .accepted
                .len(),
            MAX_UNMATCHED - 1
        );
        assert_eq!(m.waiting(), (0, 0));
    }

    /// One IPv6 host may connect from any address of its /64: its connections count together,
    /// as one IPv4 address's do. Before, each address was counted apart, so a host that
    /// connected from a new address each time was never refused and, once the table was full,
    /// evicted a source's held connection with every new one.
    #[test]
    fn one_ipv6_64_is_one_host_and_ipv4_stays_per_address() {
        let mut m: Matcher<u32, u16> = Matcher::default();
        let t0 = Instant::now();
        let in_64 = |net: u16, i: usize| {
            let ip = Ipv6Addr::new(0x2001, 0xdb8, 0, net, 0, 0, (i >> 16) as u16, i as u16);
            SocketAddr::new(IpAddr::V6(ip), 40000)
        };
        for i in 0..MAX_UNMATCHED_PER_IP {
            assert!(matches!(
                m.accepted(in_64(1, i), lane0(), i as u32, t0),
                Accepted::Held(None)
            ));
        }
        let next = in_64(1, MAX_UNMATCHED_PER_IP);
        assert!(
            matches!(m.accepted(next, lane0(), 1, t0), Accepted::Refused(1)),
            "another address of the same /64 is the same host"
        );
        assert!(matches!(
            m.accepted(in_64(2, 0), lane0(), 2, t0),
            Accepted::Held(None)
        ));
        // IPv4: one address is one host (a /24 is not), a mapped one the same as plain.
        let v4 = |last: u8, port: u16| SocketAddr::from(([10, 7, 0, last], port));
        for i in 0..MAX_UNMATCHED_PER_IP {
            let a = v4(1, i as u16 + 1);
            assert!(matches!(
                m.accepted(a, lane0(), 3, t0),
                Accepted::Held(None)
            ));
        }
        let mapped: SocketAddr = "[::ffff:10.7.0.1]:60000".parse().unwrap();
        assert!(matches!(
            m.accepted(mapped, lane0(), 4, t0),
            Accepted::Refused(4)
        ));
        assert!(matches!(
            m.accepted(v4(2, 1), lane0(), 5, t0),
            Accepted::Held(None)
        ));
        assert_eq!(host_name(host_of(next.ip())), "2001:db8:0:1::/64");
        assert_eq!(host_name(host_of(mapped.ip())), "10.7.0.1");
    }

    /// An announcement whose connection never arrives goes after the timeout, handed back so
    /// the fetches queued on it fail. Before, it stayed for ever, and so did they.
    #[test]
    fn an_announced_connection_that_never_arrives_times_out() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        let t0 = Instant::now();
        assert!(matches!(
            m.expect(addr(1), lane0(), 7, t0),
            Announced::Waiting
        ));
        let early = m.sweep(t0 + UNMATCHED_TIMEOUT / 2);
        assert!(early.expected.is_empty() && early.accepted.is_empty());
        assert_eq!(m.waiting(), (1, 0));
        let swept = m.sweep(t0 + UNMATCHED_TIMEOUT * 100);
        assert_eq!(swept.expected, vec![(addr(1), 7)]);
        assert!(swept.accepted.is_empty());
        assert_eq!(m.waiting(), (0, 0));
        // Its connection, arriving after all, is only held as unannounced.
        assert!(matches!(
            m.accepted(addr(1), lane0(), "late", t0 + UNMATCHED_TIMEOUT * 100),
            Accepted::Held(None)
        ));
    }

    #[test]
    fn an_ipv4_mapped_peer_matches_its_plain_ipv4_announcement_either_way_round() {
        let mut m: Matcher<&str, u16> = Matcher::default();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:5".parse().unwrap();
        assert!(matches!(
            m.accepted(mapped, lane0(), "first", Instant::now()),
            Accepted::Held(None)
        ));
        assert!(matches!(
            m.expect(addr(5), lane0(), 1, Instant::now()),
            Announced::Matched("first", 1)
        ));
        assert!(matches!(
            m.expect(mapped, lane0(), 2, Instant::now()),
            Announced::Waiting
        ));
        assert!(matches!(
            m.accepted(addr(5), lane0(), "second", Instant::now()),
            Accepted::Matched("second", 2)
        ));
    }

    #[test]
    fn a_link_going_down_forgets_only_its_announcements() {
        let mut m: Matcher<(), (usize, u64)> = Matcher::default();
        m.expect(addr(1), lane0(), (0, 1), Instant::now());
        m.expect(addr(2), lane0(), (0, 2), Instant::now());
        m.expect(addr(3), lane1(), (1, 1), Instant::now());
        let mut gone = m.forget(|&(link, generation)| link == 0 && generation == 1);
        gone.sort();
        assert_eq!(gone, vec![(0, 1)]);
        assert_eq!(m.waiting(), (2, 0));
    }
}
