//! Who may hold a control connection: handshakes under way are capped in all and per peer IP,
//! and node sessions (authenticated) by `max_connections`.
//!
//! A peer that connects and sends nothing holds only a handshake slot, for at most the
//! handshake's 10 s, and one IP holds at most [`MAX_HANDSHAKES_PER_IP`] of them: before, every
//! accepted connection took a session slot, so 256 idle connections, re-opened every 10 s by
//! anyone who could reach the port, refused every node, secret or not. A refused peer is told
//! why (an `Error` frame) instead of seeing its connection closed, which a node read as a
//! source of another protocol version.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Handshakes under way at once, from all peers.
pub const MAX_HANDSHAKES: usize = 64;

/// Handshakes under way at once from one IP address.
pub const MAX_HANDSHAKES_PER_IP: usize = 8;

/// Refused connections told why at once (each holds its socket for up to 2 s); past it a
/// refused connection is closed without a word.
pub const MAX_REFUSING: usize = 64;

/// Handshakes under way: per peer IP, and in all.
#[derive(Debug, Default)]
pub(crate) struct Handshakes {
    by_ip: Mutex<(HashMap<IpAddr, usize>, usize)>,
}

/// One handshake under way; its slot is given back when it drops.
#[derive(Debug)]
pub(crate) struct HandshakeSlot {
    of: Arc<Handshakes>,
    ip: IpAddr,
}

impl Handshakes {
    /// A slot for a handshake with `ip`, or why there is none.
    pub fn enter(self: &Arc<Self>, ip: IpAddr) -> Result<HandshakeSlot, String> {
        let ip = ip.to_canonical();
        let mut g = self.by_ip.lock().expect("poisoned");
        let (by_ip, total) = &mut *g;
        let here = by_ip.get(&ip).copied().unwrap_or(0);
        if here >= MAX_HANDSHAKES_PER_IP {
            return Err(format!(
                "{here} handshakes from {ip} are under way already (at most \
                 {MAX_HANDSHAKES_PER_IP} per address): try again when one has ended"
            ));
        }
        if *total >= MAX_HANDSHAKES {
            return Err(format!(
                "{total} handshakes are under way already (at most {MAX_HANDSHAKES}): try \
                 again in a few seconds"
            ));
        }
        by_ip.insert(ip, here + 1);
        *total += 1;
        Ok(HandshakeSlot {
            of: Arc::clone(self),
            ip,
        })
    }

    /// Handshakes under way.
    #[cfg(test)]
    fn under_way(&self) -> usize {
        self.by_ip.lock().expect("poisoned").1
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut g = self.of.by_ip.lock().expect("poisoned");
        let (by_ip, total) = &mut *g;
        *total -= 1;
        if let Some(n) = by_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                by_ip.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_holds_at_most_its_share_and_all_at_most_the_cap() {
        let h = Arc::new(Handshakes::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let held: Vec<_> = (0..MAX_HANDSHAKES_PER_IP)
            .map(|_| h.enter(a).unwrap())
            .collect();
        let e = h.enter(a).unwrap_err();
        assert!(e.contains("8 handshakes from 10.0.0.1"), "{e}");
        // The same address written as IPv4-mapped IPv6 is the same peer.
        assert!(h.enter("::ffff:10.0.0.1".parse().unwrap()).is_err());
        let others: Vec<_> = (0..MAX_HANDSHAKES - MAX_HANDSHAKES_PER_IP)
            .map(|i| h.enter(IpAddr::from([10, 0, 1, i as u8])).unwrap())
            .collect();
        let e = h.enter("10.0.2.1".parse().unwrap()).unwrap_err();
        assert!(e.contains("at most 64"), "{e}");
        drop(held);
        assert_eq!(h.under_way(), MAX_HANDSHAKES - MAX_HANDSHAKES_PER_IP);
        assert!(h.enter(a).is_ok());
        drop(others);
        assert_eq!(h.under_way(), 0);
        assert!(
            h.by_ip.lock().unwrap().0.is_empty(),
            "no address left behind"
        );
    }
}
