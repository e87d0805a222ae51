//! Which NIC a TCP connection came in on (DESIGN §11: a lane's data comes through its own
//! NIC). The kernel marks a socket with the NAPI instance (one NIC queue's poll context) that
//! received its last packet, `SO_INCOMING_NAPI_ID` (at accept: the handshake's last ACK), and
//! netdev's `napi-get` names the device that instance belongs to.
//!
//! Why a connection's destination address does not settle it: Linux takes a packet for any
//! of its addresses on any interface (the weak host model), so with loose or no reverse-path
//! filtering, a source whose only route to a lane's subnet is its default gateway brings the
//! lane's traffic in on the management NIC, addressed to the lane.
//!
//! Not every device marks an id: loopback and a veth without GRO (or whose peer sends it TSO
//! frames) leave 0, and then the NIC is not known ([`Ingress::NoNapiId`]); the drivers of real
//! NICs receive through NAPI. A kernel built without `CONFIG_NET_RX_BUSY_POLL` has no such
//! option at all ([`Ingress::NoBusyPoll`]). A packet a stacked device (VLAN, macvlan, bond)
//! receives keeps the id of the lower device it came in on: the caller compares against
//! those too ([`crate::ifaddr::lower_ifindexes`]).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io;
use std::os::fd::BorrowedFd;

use crate::netdev::{NetdevClient, NetdevError};

/// At most this many NAPI ids are remembered (a host has a few per NIC queue); past it the
/// memory starts over.
const MAX_KNOWN: usize = 4096;

/// Where a connection came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingress {
    /// On the device of this ifindex.
    Nic(u32),
    /// The socket carries no NAPI id (see the module doc): the device is not known.
    NoNapiId,
    /// This kernel has no `SO_INCOMING_NAPI_ID` (ENOPROTOOPT: built without
    /// `CONFIG_NET_RX_BUSY_POLL`).
    NoBusyPoll,
    /// The kernel no longer has the NAPI instance of this id (its device went, or was set up
    /// anew, since the packet came).
    NapiGone(u32),
}

/// Why [`IngressProbe::ingress`] could not tell.
#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    /// `getsockopt(SO_INCOMING_NAPI_ID)` failed.
    #[error("reading SO_INCOMING_NAPI_ID of a data connection: {0}")]
    Sockopt(#[source] io::Error),
    /// The netdev family could not be opened or asked (a kernel before 6.8 has no
    /// `napi-get`).
    #[error("asking netdev (napi-get) which device NAPI instance {napi} is on: {source}")]
    Netdev {
        /// The NAPI id asked about.
        napi: u32,
        /// What netdev answered.
        #[source]
        source: NetdevError,
    },
}

/// Tells the NIC sockets came in on. Remembers the device of each NAPI id it asked about:
/// the kernel counts ids up and never gives one to an instance of another device while the
/// first lives (a driver that keeps its instances' ids across a reconfiguration keeps them
/// on the same device).
#[derive(Debug, Default)]
pub struct IngressProbe {
    /// The netdev socket (opened at the first id to resolve, in the caller's network
    /// namespace; dropped after a failure, so the next ask opens a fresh one).
    client: Option<NetdevClient>,
    /// NAPI id -> ifindex.
    known: HashMap<u32, u32>,
}

impl IngressProbe {
    /// A probe that opens its netdev socket when first needed.
    pub fn new() -> Self {
        Self::default()
    }

    /// A probe that asks through `client` (e.g. one opened in another network namespace).
    pub fn with_client(client: NetdevClient) -> Self {
        Self {
            client: Some(client),
            known: HashMap::new(),
        }
    }

    /// Where the TCP socket `sock` came in.
    pub fn ingress(&mut self, sock: BorrowedFd<'_>) -> Result<Ingress, IngressError> {
        let napi = match crate::sys::incoming_napi_id(sock) {
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
                return Ok(Ingress::NoBusyPoll);
            }
            got => got.map_err(IngressError::Sockopt)?,
        };
        if napi == 0 {
            return Ok(Ingress::NoNapiId);
        }
        if let Some(&ifindex) = self.known.get(&napi) {
            return Ok(Ingress::Nic(ifindex));
        }
        let netdev = |source| IngressError::Netdev { napi, source };
        let client = match &mut self.client {
            Some(c) => c,
            None => self.client.insert(NetdevClient::open().map_err(netdev)?),
        };
        match client.napi_get(napi) {
            Ok(Some(n)) => {
                if self.known.len() >= MAX_KNOWN {
                    self.known.clear();
                }
                self.known.insert(napi, n.ifindex);
                Ok(Ingress::Nic(n.ifindex))
            }
            Ok(None) => Ok(Ingress::NapiGone(napi)),
            Err(e) => {
                self.client = None;
                Err(netdev(e))
            }
        }
    }
}

#[cfg(test)]
mod tests;
