//! The IPv4 address of a network interface (`SIOCGIFADDR`), for a lane's data address: the
//! address of the NIC paired with its GPU (DESIGN §11). IPv4 only, as TCPX/TCPXO steer tcp4.
//! And an interface's index and name, both ways, and the devices it is stacked on (what
//! [`crate::ingress`] compares).
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

/// Stacked devices are followed at most this deep.
const MAX_LOWER_DEPTH: usize = 8;

/// The ifindexes of the devices `ifname` is stacked on (a VLAN's, macvlan's, ipvlan's or
/// bond's lower devices, and theirs in turn), from the `lower_*` links of
/// `/sys/class/net/<ifname>` (the sysfs of the caller's network namespace, where it mounted
/// one); empty for a device on none, or one sysfs does not show. A packet such a device
/// receives came in on a lower one: its NAPI id is the lower device's.
pub fn lower_ifindexes(ifname: &str) -> Vec<u32> {
    lowers_in(std::path::Path::new("/sys/class/net"), ifname)
}

/// [`lower_ifindexes`] under `root` (a `/sys/class/net`).
fn lowers_in(root: &std::path::Path, ifname: &str) -> Vec<u32> {
    let mut found: Vec<u32> = Vec::new();
    let mut names = vec![ifname.to_owned()];
    let mut seen = std::collections::BTreeSet::from([ifname.to_owned()]);
    for _ in 0..MAX_LOWER_DEPTH {
        let mut next = Vec::new();
        for name in &names {
            let Ok(dir) = std::fs::read_dir(root.join(name)) else {
                continue;
            };
            for entry in dir.flatten() {
                let entry = entry.file_name();
                let Some(lower) = entry.to_str().and_then(|e| e.strip_prefix("lower_")) else {
                    continue;
                };
                if seen.insert(lower.to_owned()) {
                    next.push(lower.to_owned());
                }
            }
        }
        for name in &next {
            let index = std::fs::read_to_string(root.join(name).join("ifindex"));
            if let Some(i) = index.ok().and_then(|s| s.trim().parse().ok()) {
                found.push(i);
            }
        }
        if next.is_empty() {
            break;
        }
        names = next;
    }
    found
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

    /// A macvlan's lower device is found through sysfs, and so is a lower's lower (a tree
    /// laid out as sysfs does); a device on none, or one sysfs lacks, has none.
    #[test]
    fn lower_devices_are_followed_down() {
        let tag = format!("swl{}", std::process::id() % 100_000);
        let (veth, peer, mv) = (format!("{tag}a"), format!("{tag}b"), format!("{tag}m"));
        let ip = |args: &[&str]| crate::testutil::run("ip", args);
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
        let made = std::process::Command::new("ip")
            .args(["link", "add", "link", &veth, "name", &mv, "type", "macvlan"])
            .status();
        let got = lower_ifindexes(&mv);
        let want = ifindex(&veth).unwrap();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &veth])
            .status();
        assert!(made.unwrap().success(), "ip link add ... type macvlan");
        assert_eq!(got, vec![want]);
        assert!(lower_ifindexes("lo").is_empty());
        assert!(lower_ifindexes("sw-no-such0").is_empty());

        let root = std::env::temp_dir().join(format!("{tag}-sysfs"));
        let _ = std::fs::remove_dir_all(&root);
        for (dev, index, lowers) in [
            ("vlan", 9, &["bond"][..]),
            ("bond", 8, &["p0", "p1"]),
            ("p0", 2, &[]),
            ("p1", 3, &[]),
        ] {
            std::fs::create_dir_all(root.join(dev)).unwrap();
            std::fs::write(root.join(dev).join("ifindex"), format!("{index}\n")).unwrap();
            for l in lowers {
                std::fs::write(root.join(dev).join(format!("lower_{l}")), "").unwrap();
            }
        }
        let mut got = lowers_in(&root, "vlan");
        got.sort();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(got, vec![2, 3, 8]);
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
