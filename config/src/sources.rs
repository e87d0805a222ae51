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
    /// The DNS name has characters or labels a host name cannot have.
    #[error(
        "`{entry}`: `{name}` is not a DNS name (labels of letters, digits and '-', 1-63 bytes each, 253 at most)"
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
        match host.strip_prefix("dns:") {
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
            None => Ok(Self::Addr(s.to_owned())),
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
}
