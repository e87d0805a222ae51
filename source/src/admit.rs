//! Who may hold a control connection: handshakes under way are capped in all and per peer IP,
//! and node sessions (authenticated) by `max_connections`.
//!
//! A peer that connects and sends nothing holds only a handshake slot, for at most the
//! handshake's 10 s, and one peer (an IPv4 address, an IPv6 /64: what one host has) holds at
//! most [`MAX_HANDSHAKES_PER_IP`] of them: before, every accepted connection took a session
//! slot, so 256 idle connections, re-opened every 10 s by anyone who could reach the port,
//! refused every node, secret or not. When all [`MAX_HANDSHAKES`] are taken, a newcomer
//! evicts the oldest handshake, if that one has been under way for [`EVICT_AFTER`], instead
//! of being refused: a node's handshake takes a few round trips, so such a handshake is a
//! peer that holds its slot on purpose, and eight such peers no longer lock every node out
//! (while a flood of new connections cannot evict a node's handshake in its first second). A refused peer is told why (an `Error` frame)
//! instead of seeing its connection closed, which a node read as a source of another protocol
//! version.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

/// Handshakes under way at once, from all peers.
pub const MAX_HANDSHAKES: usize = 64;

/// Handshakes under way at once from one peer (an IPv4 address, an IPv6 /64).
pub const MAX_HANDSHAKES_PER_IP: usize = 8;

/// How long a handshake is under way before a newcomer may evict it.
pub const EVICT_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Refused connections told why at once (each holds its socket for up to 2 s); past it a
/// refused connection is closed without a word.
pub const MAX_REFUSING: usize = 64;

/// Handshakes under way: per peer, and in the order they began.
#[derive(Debug, Default)]
pub(crate) struct Handshakes {
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    by_peer: HashMap<IpAddr, usize>,
    /// Each handshake under way by when it began: its peer, its eviction notice, and when.
    began: BTreeMap<u64, (IpAddr, Arc<Notify>, Instant)>,
    next: u64,
}

impl Table {
    /// Takes handshake `seq` out of the table; false if it was not in it (evicted).
    fn take(&mut self, seq: u64) -> Option<Arc<Notify>> {
        let (peer, evict, _) = self.began.remove(&seq)?;
        if let Some(n) = self.by_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.by_peer.remove(&peer);
            }
        }
        Some(evict)
    }
}

/// One handshake under way; its slot is given back when it drops.
#[derive(Debug)]
pub(crate) struct HandshakeSlot {
    of: Arc<Handshakes>,
    seq: u64,
    evict: Arc<Notify>,
}

/// The peer `ip` counts as: the address itself (IPv4-mapped IPv6 as IPv4), or its IPv6 /64.
pub(crate) fn peer_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        v4 => v4,
    }
}

/// `peer` as a message names it.
pub(crate) fn named(peer: IpAddr) -> String {
    match peer {
        IpAddr::V6(_) => format!("{peer}/64"),
        v4 => v4.to_string(),
    }
}

impl Handshakes {
    /// A slot for a handshake with `ip`, or why there is none. With every slot taken, the
    /// oldest handshake is evicted ([`HandshakeSlot::evicted`]) for this one.
    pub fn enter(self: &Arc<Self>, ip: IpAddr) -> Result<HandshakeSlot, String> {
        self.enter_at(ip, Instant::now())
    }

    /// [`Handshakes::enter`] at time `now`.
    fn enter_at(self: &Arc<Self>, ip: IpAddr, now: Instant) -> Result<HandshakeSlot, String> {
        let peer = peer_of(ip);
        let mut t = self.table.lock().expect("poisoned");
        let here = t.by_peer.get(&peer).copied().unwrap_or(0);
        if here >= MAX_HANDSHAKES_PER_IP {
            return Err(format!(
                "{here} handshakes from {} are under way already (at most \
                 {MAX_HANDSHAKES_PER_IP} per address): try again when one has ended",
                named(peer)
            ));
        }
        if t.began.len() >= MAX_HANDSHAKES {
            let (&oldest, &(_, _, since)) = t.began.iter().next().expect("full");
            if now.saturating_duration_since(since) < EVICT_AFTER {
                return Err(format!(
                    "{} handshakes are under way already (at most {MAX_HANDSHAKES}): try \
                     again in a few seconds",
                    t.began.len()
                ));
            }
            if let Some(evict) = t.take(oldest) {
                evict.notify_one();
            }
        }
        let (seq, evict) = (t.next, Arc::new(Notify::new()));
        t.next += 1;
        t.began.insert(seq, (peer, Arc::clone(&evict), now));
        *t.by_peer.entry(peer).or_default() += 1;
        Ok(HandshakeSlot {
            of: Arc::clone(self),
            seq,
            evict,
        })
    }

    /// Handshakes under way.
    #[cfg(test)]
    pub(crate) fn under_way(&self) -> usize {
        self.table.lock().expect("poisoned").began.len()
    }
}

impl HandshakeSlot {
    /// Completes once this handshake was evicted for a newer one (every slot was taken and it
    /// was the oldest): the handshake must end.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.of.table.lock().expect("poisoned").take(self.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_holds_at_most_its_share() {
        let h = Arc::new(Handshakes::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let held: Vec<_> = (0..MAX_HANDSHAKES_PER_IP)
            .map(|_| h.enter(a).unwrap())
            .collect();
        let e = h.enter(a).unwrap_err();
        assert!(e.contains("8 handshakes from 10.0.0.1"), "{e}");
        // The same address written as IPv4-mapped IPv6 is the same peer.
        assert!(h.enter("::ffff:10.0.0.1".parse().unwrap()).is_err());
        // One IPv6 host has a /64: its addresses are one peer.
        let v6: Vec<_> = (0..MAX_HANDSHAKES_PER_IP)
            .map(|i| {
                h.enter(IpAddr::from([0x2001, 0xdb8, 0, 7, 0, 0, 0, i as u16]))
                    .unwrap()
            })
            .collect();
        let e = h
            .enter("2001:db8:0:7:ffff::1".parse().unwrap())
            .unwrap_err();
        assert!(e.contains("from 2001:db8:0:7::/64"), "{e}");
        assert!(h.enter("2001:db8:0:8::1".parse().unwrap()).is_ok());
        drop((held, v6));
        assert_eq!(h.under_way(), 0);
        assert!(h.enter(a).is_ok());
    }

    /// Every slot taken by silent peers (eight addresses, eight each): a newcomer evicts the
    /// oldest instead of being refused, and the evicted slot is given back once only.
    #[tokio::test(flavor = "current_thread")]
    async fn a_full_table_evicts_its_oldest_handshake_for_a_newcomer() {
        let h = Arc::new(Handshakes::default());
        let t0 = Instant::now();
        let squatters: Vec<_> = (0..MAX_HANDSHAKES)
            .map(|i| {
                let ip = IpAddr::from([10, 0, (i / MAX_HANDSHAKES_PER_IP) as u8, 1]);
                h.enter_at(ip, t0).unwrap()
            })
            .collect();
        // Within EVICT_AFTER of the oldest's start: refused (a flood cannot evict a node's
        // handshake in its first second).
        let e = h.enter_at("10.9.9.9".parse().unwrap(), t0).unwrap_err();
        assert!(e.contains("64 handshakes are under way"), "{e}");
        let later = t0 + EVICT_AFTER;
        let node = h
            .enter_at("10.9.9.9".parse().unwrap(), later)
            .expect("a slot by eviction");
        assert_eq!(h.under_way(), MAX_HANDSHAKES);
        tokio::time::timeout(std::time::Duration::from_secs(1), squatters[0].evicted())
            .await
            .expect("the oldest is told");
        let second = tokio::time::timeout(std::time::Duration::ZERO, squatters[1].evicted());
        assert!(second.await.is_err(), "only the oldest");
        // The evicted one's peer has room for another handshake again.
        let again = h.enter_at("10.0.0.1".parse().unwrap(), later).unwrap();
        drop(squatters);
        assert_eq!(h.under_way(), 2, "the newcomer and the re-entered one");
        drop((node, again));
        let t = h.table.lock().unwrap();
        assert!(
            t.by_peer.is_empty() && t.began.is_empty(),
            "nothing left behind"
        );
    }
}
