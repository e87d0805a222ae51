//! The IPv4 address of a network interface (`SIOCGIFADDR`), for a lane's data address: the
//! address of the NIC paired with its GPU (DESIGN §11). IPv4 only, as TCPX/TCPXO steer tcp4.
//! And an interface's index and name, both ways (what [`crate::ingress`] compares).
#![forbid(unsafe_code)]

use std::net::Ipv4Addr;
use std::os::fd::AsFd;

/// Why an interface's address could not be read.
#[derive(Debug, thiserror::Error)]
pub enum IfAddrError {
    /// No interface of that name in this network namespace.
    #[error("no network interface named {0} here (ip link)")]
    NoSuchInterface(String),
    /// The ioctl failed otherwise.
    #[error("reading the IPv4 address of {ifname}: {source}")]
    Ioctl {
        /// The interface.
        ifname: String,
        /// The error of `ioctl(SIOCGIFADDR)`.
        #[source]
        source: std::io::Error,
    },
}

/// The primary IPv4 address of `ifname` in the caller's network namespace; `None` when it
/// has none.
pub fn ipv4(ifname: &str) -> Result<Option<Ipv4Addr>, IfAddrError> {
    let err = |source: std::io::Error| match source.raw_os_error() {
        Some(libc::ENODEV) => IfAddrError::NoSuchInterface(ifname.to_owned()),
        _ => IfAddrError::Ioctl {
            ifname: ifname.to_owned(),
            source,
        },
    };
    let sock = crate::sys::ioctl_socket().map_err(err)?;
    crate::sys::ipv4_of(sock.as_fd(), ifname).map_err(err)
}

/// The ifindex of `ifname` in the caller's network namespace.
pub fn ifindex(ifname: &str) -> Result<u32, IfAddrError> {
    let err = |source: std::io::Error| match source.kind() {
        std::io::ErrorKind::NotFound => IfAddrError::NoSuchInterface(ifname.to_owned()),
        _ => IfAddrError::Ioctl {
            ifname: ifname.to_owned(),
            source,
        },
    };
    let sock = crate::sys::ioctl_socket().map_err(err)?;
    crate::sys::ifindex_of(sock.as_fd(), ifname).map_err(err)
}

/// The name of the interface `ifindex` in the caller's network namespace; `None` when there
/// is none (it went).
pub fn name_of(ifindex: u32) -> Option<String> {
    crate::sys::if_indextoname(ifindex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_has_127_0_0_1_and_missing_interfaces_are_named() {
        assert_eq!(ipv4("lo").unwrap(), Some(Ipv4Addr::LOCALHOST));
        let e = ipv4("sw-no-such0").unwrap_err();
        assert!(matches!(e, IfAddrError::NoSuchInterface(_)), "{e}");
        assert!(e.to_string().contains("sw-no-such0"), "{e}");
        assert!(ipv4("").is_err());
    }

    #[test]
    fn loopback_ifindex_and_name_round_trip() {
        let lo = ifindex("lo").unwrap();
        assert_eq!(name_of(lo).as_deref(), Some("lo"));
        let e = ifindex("sw-no-such0").unwrap_err();
        assert!(matches!(e, IfAddrError::NoSuchInterface(_)), "{e}");
        assert_eq!(name_of(u32::MAX), None);
    }
}
