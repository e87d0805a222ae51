//! The `lanes` key of `serve` (DESIGN §11): `"auto"` (the default: the node discovers its
//! GPUs and NICs and pairs them) or an array of tables, one per lane, every field optional:
//!
//! ```toml
//! lanes = [
//!   { gpu = "0000:19:00.0", interface = "eth1", data_listen = "10.0.1.5:7401",
//!     queues = [8, 9, 10, 11], devmem_memory = "256MiB" },
//! ]
//! ```
//!
//! What is checked here is what needs no knowledge of the host: the shape of each field,
//! ranges, and relations between lanes (no GPU twice, no queue of one interface in two
//! lanes). That a GPU or an interface exists is checked by the node when it starts.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::{ByteSize, ConfigError, invalid};

/// Most lanes a node runs (the wire carries at most this many data addresses).
pub const MAX_LANES: usize = 64;

/// One configured lane; every field is optional.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LaneConfig {
    /// The GPU: a PCI bus id (`0000:19:00.0`) or a GPU UUID (`GPU-...`); none: a lane in host
    /// memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// The NIC (interface name); none: the NIC paired with `gpu`, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// Where sources dial this lane; none: the interface's IPv4 address with the port of the
    /// node's `data_listen`, or `data_listen` itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_listen: Option<SocketAddr>,
    /// The interface's RX queues this lane binds for devmem; empty: the paired share.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub queues: Vec<u32>,
    /// Size of this lane's RX dma-buf for devmem; none: the node's `devmem_memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devmem_memory: Option<ByteSize>,
}

/// How the node finds its lanes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Lanes {
    /// Discovered from the sysfs PCI tree and the CUDA devices (`lanes = "auto"`).
    #[default]
    Auto,
    /// As configured, in this order (lane `i` is the `i`-th table).
    Table(Vec<LaneConfig>),
}

impl Serialize for Lanes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Table(t) => t.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Lanes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lanes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\" or an array of lane tables ({ gpu, interface, data_listen, queues, devmem_memory })")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Lanes, E> {
                match v {
                    "auto" => Ok(Lanes::Auto),
                    other => Err(E::invalid_value(de::Unexpected::Str(other), &self)),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Lanes, A::Error> {
                let mut out = Vec::new();
                while let Some(lane) = seq.next_element::<LaneConfig>()? {
                    if out.len() == MAX_LANES {
                        return Err(de::Error::invalid_length(
                            MAX_LANES + 1,
                            &"at most 64 lanes",
                        ));
                    }
                    out.push(lane);
                }
                Ok(Lanes::Table(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// The shape of a PCI bus id: `dddd:bb:dd.f` or `bb:dd.f`, hex, any case (the node parses
/// it fully; this only catches what is plainly not one).
fn looks_like_pci(s: &str) -> bool {
    let hex = |p: &str, lens: &[usize]| {
        lens.contains(&p.len()) && p.bytes().all(|b| b.is_ascii_hexdigit())
    };
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, rest) = match parts.as_slice() {
        [d, b, r] => (Some(*d), *b, *r),
        [b, r] => (None, *b, *r),
        _ => return false,
    };
    let Some((dev, func)) = rest.split_once('.') else {
        return false;
    };
    domain.is_none_or(|d| hex(d, &[4, 5, 6, 7, 8]))
        && hex(bus, &[2])
        && hex(dev, &[2])
        && hex(func, &[1])
}

/// The shape of a GPU UUID: optional `GPU-`, then 32 hex digits (dashes anywhere).
fn looks_like_uuid(s: &str) -> bool {
    let body = s
        .get(..4)
        .filter(|p| p.eq_ignore_ascii_case("gpu-"))
        .map_or(s, |_| &s[4..]);
    let hex: Vec<u8> = body.bytes().filter(|b| *b != b'-').collect();
    hex.len() == 32 && hex.iter().all(u8::is_ascii_hexdigit)
}

/// True if `s` has the shape of a GPU name a lane or a trainer may use.
pub fn is_gpu_name(s: &str) -> bool {
    looks_like_pci(s) || looks_like_uuid(s)
}

impl Lanes {
    /// Checks each table and the relations between them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Self::Table(t) = self else {
            return Ok(());
        };
        if t.is_empty() {
            return Err(invalid(
                "lanes",
                "[]",
                "give at least one lane table, or \"auto\" to discover them",
            ));
        }
        let mut gpus: BTreeMap<String, usize> = BTreeMap::new();
        // (interface, or the lane itself without one, queue) -> lane.
        let mut queues: BTreeMap<(Option<&str>, usize, u32), usize> = BTreeMap::new();
        for (i, lane) in t.iter().enumerate() {
            if let Some(g) = &lane.gpu {
                if !is_gpu_name(g) {
                    return Err(invalid(
                        "lanes",
                        format!("lanes[{i}].gpu = {g:?}"),
                        "must be a PCI bus id (dddd:bb:dd.f, as in `shardwire topology`) or a GPU UUID (GPU-...)",
                    ));
                }
                if let Some(j) = gpus.insert(g.to_ascii_lowercase(), i) {
                    return Err(invalid(
                        "lanes",
                        format!("lanes[{j}].gpu and lanes[{i}].gpu = {g:?}"),
                        "a GPU can be in one lane only",
                    ));
                }
            }
            if let Some(m) = lane.devmem_memory
                && !(1 << 20..=crate::MAX_SIZE).contains(&m.0)
            {
                return Err(invalid(
                    "lanes",
                    format!("lanes[{i}].devmem_memory = {m}"),
                    format!(
                        "must be at least 1MiB and at most {}",
                        ByteSize(crate::MAX_SIZE)
                    ),
                ));
            }
            // Lanes without an `interface` are paired with their NICs later, maybe different
            // ones: their queues are compared within the lane only here (the node refuses an
            // overlap on one NIC when it binds).
            let ifname = lane.interface.as_deref();
            let owner = if ifname.is_some() { usize::MAX } else { i };
            for &q in &lane.queues {
                if let Some(j) = queues.insert((ifname, owner, q), i) {
                    let what = match (j == i, ifname) {
                        (false, Some(n)) => {
                            format!("lanes[{j}] and lanes[{i}] both list queue {q} of {n}")
                        }
                        _ => format!("lanes[{i}].queues lists queue {q} twice"),
                    };
                    return Err(invalid(
                        "lanes",
                        what,
                        "each RX queue of an interface belongs to one lane",
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(toml: &str) -> Result<Lanes, String> {
        #[derive(Deserialize)]
        struct Doc {
            lanes: Lanes,
        }
        let doc: Doc = figment::Figment::from(figment::providers::Serialized::defaults(
            serde_json::json!({}),
        ))
        .merge(<figment::providers::Toml as figment::providers::Format>::string(toml))
        .extract()
        .map_err(|e| e.to_string())?;
        doc.lanes.validate().map_err(|e| e.to_string())?;
        Ok(doc.lanes)
    }

    #[test]
    fn auto_and_tables_parse() {
        assert_eq!(table("lanes = \"auto\"").unwrap(), Lanes::Auto);
        let t = table(
            r#"lanes = [
                { gpu = "0000:19:00.0", interface = "eth1", data_listen = "10.0.1.5:7401", queues = [8, 9, 10, 11], devmem_memory = "256MiB" },
                { data_listen = "127.0.0.2:0" },
            ]"#,
        )
        .unwrap();
        let Lanes::Table(t) = t else {
            panic!("a table")
        };
        assert_eq!(t[0].gpu.as_deref(), Some("0000:19:00.0"));
        assert_eq!(t[0].queues, [8, 9, 10, 11]);
        assert_eq!(t[0].devmem_memory, Some(ByteSize(256 << 20)));
        assert_eq!(
            t[1],
            LaneConfig {
                data_listen: Some("127.0.0.2:0".parse().unwrap()),
                ..LaneConfig::default()
            }
        );
        assert_eq!(serde_json::to_value(Lanes::Auto).unwrap(), "auto");
    }

    #[test]
    fn bad_tables_name_the_lane_and_the_field() {
        let e = table("lanes = \"manual\"").unwrap_err();
        assert!(e.contains("\"auto\" or an array of lane tables"), "{e}");
        let e = table("lanes = [{ gpu = \"gpu5\" }]").unwrap_err();
        assert!(
            e.contains("lanes[0].gpu = \"gpu5\"") && e.contains("PCI bus id"),
            "{e}"
        );
        let e =
            table("lanes = [{ gpu = \"0000:19:00.0\" }, { gpu = \"0000:19:00.0\" }]").unwrap_err();
        assert!(e.contains("lanes[0].gpu and lanes[1].gpu"), "{e}");
        let e = table("lanes = [{ interface = \"eth1\", queues = [8] }, { interface = \"eth1\", queues = [8] }]")
            .unwrap_err();
        assert!(
            e.contains("lanes[0] and lanes[1] both list queue 8 of eth1"),
            "{e}"
        );
        // Without `interface`, two lanes may list one queue number (they may pair with two
        // NICs); one lane listing it twice is still refused.
        let two = "lanes = [{ gpu = \"0000:19:00.0\", queues = [8] }, { gpu = \"0000:29:00.0\", queues = [8] }]";
        assert!(table(two).is_ok());
        let e = table("lanes = [{ queues = [8, 8] }]").unwrap_err();
        assert!(e.contains("lanes[0].queues lists queue 8 twice"), "{e}");
        let e = table("lanes = [{ devmem_memory = \"4KiB\" }]").unwrap_err();
        assert!(e.contains("lanes[0].devmem_memory = 4KiB"), "{e}");
        let e = table("lanes = [{ gpus = \"0000:19:00.0\" }]").unwrap_err();
        assert!(e.contains("gpus"), "{e}");
        let e = table("lanes = []").unwrap_err();
        assert!(e.contains("at least one lane"), "{e}");
    }

    #[test]
    fn gpu_names_are_pci_ids_or_uuids() {
        for ok in [
            "0000:19:00.0",
            "0000:0A:00.0",
            "19:00.0",
            "00000000:19:00.0",
            "GPU-8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
            "8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
        ] {
            assert!(is_gpu_name(ok), "{ok}");
        }
        for bad in [
            "",
            "cuda:0",
            "0000:19:00",
            "0000:19:0.0",
            "GPU-123",
            "0000:1g:00.0",
        ] {
            assert!(!is_gpu_name(bad), "{bad}");
        }
    }
}
