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

use crate::{ByteSize, ConfigError, interfaces, invalid};

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

/// Highest device number on a PCI bus (5 bits).
const MAX_PCI_DEVICE: u8 = 0x1f;

/// Highest function number of a PCI device (3 bits).
const MAX_PCI_FUNCTION: u8 = 7;

/// A PCI bus id's numbers, as written (device and function not yet checked against their
/// ranges).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PciId {
    /// The PCI domain (segment); 0 when the id has none.
    domain: u32,
    /// The bus.
    bus: u8,
    /// The device on the bus (at most [`MAX_PCI_DEVICE`] on a valid id).
    device: u8,
    /// The function of the device (at most [`MAX_PCI_FUNCTION`] on a valid id).
    function: u8,
}

impl PciId {
    /// Why the device or function number cannot be, if it cannot.
    fn range_error(self) -> Option<String> {
        let what = if self.device > MAX_PCI_DEVICE {
            format!("device {:02x} is past {MAX_PCI_DEVICE:02x}", self.device)
        } else if self.function > MAX_PCI_FUNCTION {
            format!("function {:x} is past {MAX_PCI_FUNCTION}", self.function)
        } else {
            return None;
        };
        Some(format!(
            "{what}: a PCI bus id is dddd:bb:dd.f with device dd 00 to 1f and function f 0 to 7; \
             copy it from `shardwire topology` or `nvidia-smi --query-gpu=pci.bus_id`"
        ))
    }

    /// One spelling per id: `dddd:bb:dd.f`, lowercase, the domain as a number (so `19:00.0`,
    /// `0000:19:00.0` and `00000000:19:00.0` are one GPU).
    fn canonical(self) -> String {
        format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// `s` read as a PCI bus id, `dddd:bb:dd.f` or `bb:dd.f` (hex, any case; a domain of 4 to 8
/// digits); `None` when it does not have that shape. The ranges of device and function are
/// [`PciId::range_error`]'s (the node parses the id fully; this catches what plainly is not
/// one).
fn parse_pci(s: &str) -> Option<PciId> {
    let hex = |p: &str, lens: &[usize]| {
        if lens.contains(&p.len()) && p.bytes().all(|b| b.is_ascii_hexdigit()) {
            u32::from_str_radix(p, 16).ok()
        } else {
            None
        }
    };
    let byte = |p: &str, len: usize| hex(p, &[len]).and_then(|v| u8::try_from(v).ok());
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, rest) = match parts.as_slice() {
        [d, b, r] => (Some(*d), *b, *r),
        [b, r] => (None, *b, *r),
        _ => return None,
    };
    let (dev, func) = rest.split_once('.')?;
    Some(PciId {
        domain: match domain {
            Some(d) => hex(d, &[4, 5, 6, 7, 8])?,
            None => 0,
        },
        bus: byte(bus, 2)?,
        device: byte(dev, 2)?,
        function: byte(func, 1)?,
    })
}

/// The shape of a PCI bus id with its device and function in range.
fn looks_like_pci(s: &str) -> bool {
    parse_pci(s).is_some_and(|p| p.range_error().is_none())
}

/// The 32 hex digits of a GPU UUID, lowercase, when `s` has the shape of one: optional `GPU-`
/// (any case), then 32 hex digits (dashes anywhere).
fn uuid_digits(s: &str) -> Option<String> {
    let body = s
        .get(..4)
        .filter(|p| p.eq_ignore_ascii_case("gpu-"))
        .map_or(s, |_| &s[4..]);
    let hex: String = body
        .chars()
        .filter(|c| *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect();
    (hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hex)
}

/// The shape of a GPU UUID: optional `GPU-`, then 32 hex digits (dashes anywhere).
fn looks_like_uuid(s: &str) -> bool {
    uuid_digits(s).is_some()
}

/// True if `s` has the shape of a GPU name a lane or a trainer may use.
pub fn is_gpu_name(s: &str) -> bool {
    looks_like_pci(s) || looks_like_uuid(s)
}

/// One spelling per GPU name, for finding a GPU named twice: a PCI bus id as
/// [`PciId::canonical`], a UUID as its 32 hex digits (no `GPU-`, no dashes), lowercase.
fn gpu_key(s: &str) -> String {
    match parse_pci(s) {
        Some(p) => p.canonical(),
        None => uuid_digits(s).unwrap_or_else(|| s.to_ascii_lowercase()),
    }
}

/// The checks of lane `i` on its own: the shape of `gpu` (device and function in range) and
/// of `interface` (a name Linux takes), and the range of `devmem_memory`.
fn check_lane(i: usize, lane: &LaneConfig) -> Result<(), ConfigError> {
    if let Some(g) = &lane.gpu {
        if let Some(why) = parse_pci(g).and_then(PciId::range_error) {
            return Err(invalid("lanes", format!("lanes[{i}].gpu = {g:?}"), why));
        }
        if !is_gpu_name(g) {
            return Err(invalid(
                "lanes",
                format!("lanes[{i}].gpu = {g:?}"),
                "must be a PCI bus id (dddd:bb:dd.f, as in `shardwire topology`) or a GPU UUID (GPU-...)",
            ));
        }
    }
    if let Some(n) = &lane.interface
        && !interfaces::is_valid_name(n)
    {
        return Err(invalid(
            "lanes",
            format!("lanes[{i}].interface = {n:?}"),
            interfaces::NAME_RULES,
        ));
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
    Ok(())
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
            check_lane(i, lane)?;
            if let Some(g) = &lane.gpu
                && let Some(j) = gpus.insert(gpu_key(g), i)
            {
                let first = t[j].gpu.as_deref().unwrap_or_default();
                return Err(invalid(
                    "lanes",
                    format!("lanes[{j}].gpu and lanes[{i}].gpu = {first:?} and {g:?}"),
                    "name one GPU: a GPU can be in one lane only (however its id is spelled)",
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

    #[test]
    fn one_gpu_spelled_two_ways_is_named_twice() {
        // Before, the check compared the strings (lowercased): each pair loaded as two lanes
        // on one GPU.
        for (a, b) in [
            ("0000:19:00.0", "19:00.0"),
            ("0000:19:00.0", "00000000:19:00.0"),
            ("0000:0a:00.0", "0A:00.0"),
            (
                "GPU-8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
                "8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
            ),
            (
                "gpu-8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
                "8F6D7C3A1B2C4D5E8F90A1B2C3D4E5F6",
            ),
        ] {
            let e = table(&format!("lanes = [{{ gpu = {a:?} }}, {{ gpu = {b:?} }}]")).unwrap_err();
            assert!(
                e.contains("lanes[0].gpu and lanes[1].gpu") && e.contains(a) && e.contains(b),
                "{a} {b}: {e}"
            );
        }
        // Different domains, buses, devices or functions are different GPUs.
        let two = concat!(
            "lanes = [{ gpu = \"0001:19:00.0\" }, { gpu = \"19:00.0\" },",
            " { gpu = \"19:01.0\" }, { gpu = \"19:00.1\" }]"
        );
        assert!(table(two).is_ok(), "{:?}", table(two));
    }

    #[test]
    fn pci_ids_past_the_device_and_function_ranges_are_refused_naming_the_part() {
        // Before, both passed as GPU names: a PCI device number has 5 bits, a function 3.
        for (gpu, part) in [("0000:19:20.0", "device 20"), ("19:00.8", "function 8")] {
            assert!(!is_gpu_name(gpu), "{gpu}");
            let e = table(&format!("lanes = [{{ gpu = {gpu:?} }}]")).unwrap_err();
            assert!(
                e.contains(&format!("lanes[0].gpu = {gpu:?}")) && e.contains(part),
                "{gpu}: {e}"
            );
            assert!(e.contains("00 to 1f") && e.contains("0 to 7"), "{e}");
        }
        assert!(is_gpu_name("0000:19:1f.7"));
    }

    #[test]
    fn a_lane_interface_linux_would_refuse_is_refused_naming_the_lane() {
        // Before, each loaded; the bind then failed at start naming no key.
        for name in ["", "eth1 ", "eth\t1", ".", "..", "a-very-long-interface"] {
            let e = table(&format!("lanes = [{{}}, {{ interface = {name:?} }}]")).unwrap_err();
            assert!(
                e.contains(&format!("lanes[1].interface = {name:?}"))
                    && e.contains("not an interface name"),
                "{name:?}: {e}"
            );
        }
        assert!(table("lanes = [{ interface = \"enp25s0f1np1\" }]").is_ok());
    }
}
