//! The node's `sources` entries: a fixed address (`HOST:PORT`), or a DNS name that stands for
//! every address it resolves to (`dns:NAME:PORT`, e.g. a Kubernetes headless Service), which
//! the node resolves again every `source_resolve_secs`.

use std::fmt;

/// One entry of `sources`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SourceEntry {
    /// `HOST:PORT`: one source, dialled by this name.
    Addr(String),
    /// `dns:NAME:PORT`: every address `NAME` resolves to, each at `PORT`.
    Dns {
        /// The name to resolve.
        name: String,
        /// The sources' control port.
        port: u16,
    },
}

/// Why a `sources` entry is not valid; the message says what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceEntryError {
    /// Not `HOST:PORT` or `dns:NAME:PORT`.
    #[error("`{0}` is neither HOST:PORT nor dns:NAME:PORT")]
    Shape(String),
    /// The port is not a number in 1..=65535.
    #[error("`{entry}`: port `{port}` is not a number in 1..=65535")]
    Port {
        /// The entry.
        entry: String,
        /// The port text.
        port: String,
    },
    /// The host of a `HOST:PORT` entry is neither an IP address nor a host name.
    #[error(
        "`{entry}`: `{host}` is neither an IP address ([v6] in brackets) nor a host name; a DNS name standing for several sources is written dns:NAME:PORT"
    )]
    Host {
        /// The entry.
        entry: String,
        /// The host text.
        host: String,
    },
    /// The host would be dialled as another address than written, or never reached
    /// ([`numeric_host_error`]).
    #[error("`{entry}`: {why}")]
    NumericHost {
        /// The entry.
        entry: String,
        /// Why, and how to write it.
        why: String,
    },
    /// The DNS name has characters or labels a host name cannot have.
    #[error(
        "`{entry}`: `{name}` is not a DNS name (labels of letters, digits, '-' and '_', 1-63 bytes each, 253 at most)"
    )]
    Name {
        /// The entry.
        entry: String,
        /// The name.
        name: String,
    },
}

impl SourceEntry {
    /// Parses one entry.
    pub fn parse(s: &str) -> Result<Self, SourceEntryError> {
        let entry = Self::parse_shape(s)?;
        match numeric_host_error(&entry) {
            Some(why) => Err(SourceEntryError::NumericHost {
                entry: s.to_owned(),
                why,
            }),
            None => Ok(entry),
        }
    }

    /// [`Self::parse`] but for the numeric-host rule: the entry's shape, port and names.
    fn parse_shape(s: &str) -> Result<Self, SourceEntryError> {
        let shape = || SourceEntryError::Shape(s.to_owned());
        let (host, port) = s.rsplit_once(':').ok_or_else(shape)?;
        let port_num =
            port.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| SourceEntryError::Port {
                    entry: s.to_owned(),
                    port: port.to_owned(),
                })?;
        let dns = host
            .get(..4)
            .filter(|p| p.eq_ignore_ascii_case("dns:"))
            .map(|_| &host[4..]);
        match dns {
            Some(name) => {
                let name = name.trim_end_matches('.');
                if !is_dns_name(name) {
                    return Err(SourceEntryError::Name {
                        entry: s.to_owned(),
                        name: name.to_owned(),
                    });
                }
                Ok(Self::Dns {
                    name: name.to_owned(),
                    port: port_num,
                })
            }
            None if host.is_empty() => Err(shape()),
            None if is_address_host(host) => Ok(Self::Addr(s.to_owned())),
            None => Err(SourceEntryError::Host {
                entry: s.to_owned(),
                host: host.to_owned(),
            }),
        }
    }

    /// `name:port` of a DNS entry, as a resolver takes it.
    pub fn lookup(&self) -> Option<String> {
        match self {
            Self::Addr(_) => None,
            Self::Dns { name, port } => Some(format!("{name}:{port}")),
        }
    }
}

impl fmt::Display for SourceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Addr(a) => f.write_str(a),
            Self::Dns { name, port } => write!(f, "dns:{name}:{port}"),
        }
    }
}

/// Why a `sources` entry's host would be dialled as another address than written, or never
/// reached, if it would. A host whose last label is all digits (no top-level domain is, RFC
/// 1123 2.1) must be a dotted quad: getaddrinfo reads a host of numbers and dots as IPv4
/// shorthand (`10.1.5` is 10.1.0.5, `167772165` is 10.0.0.5, `010.0.0.5` octal), so a
/// mistyped address dials some other host, or none (`10.0.0.300`, looked up in DNS) for ever;
/// a name such as `src.123` goes to DNS, where it never resolves (`0xa.1.5` is hex shorthand;
/// only `/etc/hosts` could name such a host). A dotted quad with a trailing
/// dot is refused in `HOST:PORT`, which the node dials as written: getaddrinfo does not read
/// `10.0.0.5.` as an address but looks it up in DNS (a `dns:` NAME is stored without the dot).
/// An IPv6 address (in brackets) has no labels.
fn numeric_host_error(entry: &SourceEntry) -> Option<String> {
    let written = match entry {
        SourceEntry::Addr(a) => a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h),
        SourceEntry::Dns { name, .. } => name.as_str(),
    };
    if written.starts_with('[') {
        return None;
    }
    let host = written.trim_end_matches('.');
    if host.parse::<std::net::Ipv4Addr>().is_ok() {
        if host == written {
            return None;
        }
        return Some(format!(
            "`{written}` is an IPv4 address with a trailing dot, which the system resolver does \
             not read as an address but looks up in DNS, where it never resolves: write it \
             without the dot ({host})"
        ));
    }
    let last = host.rsplit('.').next().unwrap_or(host);
    if last.is_empty() || !last.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Some(format!(
            "`{host}` is all numbers but not an IPv4 address, which the system resolver reads \
             as shorthand for another address (10.1.5 is 10.1.0.5, 010 is octal 8) or, where \
             it cannot, looks up in DNS, where it never resolves: write an address as four \
             numbers 0 to 255 without leading zeros (e.g. 10.1.0.5)"
        ));
    }
    Some(format!(
        "`{host}` ends in an all-digit label, which no DNS host name does (a top-level domain \
         is never all digits, RFC 1123 2.1), and which the system resolver may read as an \
         address in another notation (0xa.1.5 is 10.1.0.5): a host name's last label has a \
         letter (name a host of /etc/hosts so too); an IPv4 address is four decimal numbers \
         0 to 255 (e.g. 10.1.0.5)"
    ))
}

/// Whether `host` (of a `HOST:PORT` entry) is an IPv4 address, an IPv6 address in brackets,
/// or a host name (a `dsn:` or `http://` typo, a space, is none of them).
fn is_address_host(host: &str) -> bool {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            host.parse::<std::net::Ipv4Addr>().is_ok() || is_dns_name(host.trim_end_matches('.'))
        }
    }
}

/// Whether `name` is a host name: dot-separated labels of ASCII letters, digits, '-' and
/// '_' (SRV-style and some cluster names use it), none empty or longer than 63 bytes.
fn is_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names_parse() {
        assert_eq!(
            SourceEntry::parse("10.0.0.1:7500"),
            Ok(SourceEntry::Addr("10.0.0.1:7500".into()))
        );
        assert_eq!(
            SourceEntry::parse("[::1]:7500"),
            Ok(SourceEntry::Addr("[::1]:7500".into()))
        );
        // The numeric-host rule holds for every caller of `parse` (the node's start too, not
        // only a configuration's validation).
        for bad in ["10.1.5:7500", "10.0.0.5.:7500", "dns:10.1.5:7500"] {
            let e = SourceEntry::parse(bad).unwrap_err();
            assert!(
                matches!(e, SourceEntryError::NumericHost { .. }),
                "{bad}: {e}"
            );
        }
        let dns = SourceEntry::parse("dns:shardwire-source.ml.svc:7500").unwrap();
        assert_eq!(
            dns,
            SourceEntry::Dns {
                name: "shardwire-source.ml.svc".into(),
                port: 7500
            }
        );
        assert_eq!(dns.to_string(), "dns:shardwire-source.ml.svc:7500");
        assert_eq!(
            dns.lookup().as_deref(),
            Some("shardwire-source.ml.svc:7500")
        );
        // A fully qualified name's final dot is dropped.
        assert_eq!(
            SourceEntry::parse("dns:src.example.:1")
                .unwrap()
                .to_string(),
            "dns:src.example:1"
        );
    }

    #[test]
    fn bad_entries_name_the_problem() {
        assert!(matches!(
            SourceEntry::parse("source-0"),
            Err(SourceEntryError::Shape(_))
        ));
        assert!(matches!(
            SourceEntry::parse(":7500"),
            Err(SourceEntryError::Shape(_))
        ));
        let e = SourceEntry::parse("dns:src:http").unwrap_err();
        assert!(e.to_string().contains("port `http`"), "{e}");
        assert!(matches!(
            SourceEntry::parse("src:0"),
            Err(SourceEntryError::Port { .. })
        ));
        for bad in [
            "dns::7500",
            "dns:a..b:1",
            "dns:-a:1",
            "dns:a b:1",
            "dns:a/b:1",
        ] {
            assert!(
                matches!(SourceEntry::parse(bad), Err(SourceEntryError::Name { .. })),
                "{bad}"
            );
        }
        let long = format!("dns:{}:1", "a".repeat(64));
        assert!(SourceEntry::parse(&long).is_err());
    }

    #[test]
    fn typos_of_an_entry_are_refused_not_dialled_forever() {
        // Before, each was a HOST:PORT whose host never resolves: the node retried it for
        // ever and /readyz never turned 200, with no word naming the entry.
        for bad in [
            "dsn:src.ml.svc:7500",
            "http://10.0.0.5:7500",
            "10.0.0.5 :7500",
            "[::1:7500",
            "a/b:1",
        ] {
            let e = SourceEntry::parse(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    SourceEntryError::Host { .. } | SourceEntryError::Shape(_)
                ),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(bad), "{e}");
        }
        // `DNS:` is `dns:`.
        assert_eq!(
            SourceEntry::parse("DNS:src.ml.svc:7500")
                .unwrap()
                .to_string(),
            "dns:src.ml.svc:7500"
        );
        for good in [
            "src-0.src.ml.svc.cluster.local:7500",
            "localhost:1",
            "[fe80::1]:7500",
            "host.:2",
        ] {
            assert!(
                matches!(SourceEntry::parse(good), Ok(SourceEntry::Addr(_))),
                "{good}"
            );
        }
    }
}
