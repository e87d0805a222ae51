//! PCI addresses (bus ids, "BDF"s): `dddd:bb:dd.f`.
//!
//! Parsing accepts the spellings the tools around us print: sysfs and RxDM (lower-case,
//! 4-digit domain), CUDA (`0000:0A:00.0`, upper-case), NVML (`00000000:0A:00.0`, 8-digit
//! domain) and `lspci` without a domain (`0a:00.0`, domain 0). Display is always the sysfs
//! spelling, so a GPU named by any of them compares equal to the one found in sysfs.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A PCI function address. Ordered by domain, bus, device, function (sysfs listing order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddr {
    /// PCI domain (segment). Usually 0; VMD and some hypervisors use others (e.g. `10000`).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0..=0x1f.
    pub device: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

/// A string that is not a PCI address; carries the input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a PCI address ({reason}; expected hex dddd:bb:dd.f or bb:dd.f)")]
pub struct PciAddrError {
    /// The string given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// `s` as hex if it has `min..=max` hex digits and nothing else (`from_str_radix` alone
/// would also take a sign).
fn hex_digits(s: &str, min: usize, max: usize) -> Option<u32> {
    let ok = (min..=max).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| u32::from_str_radix(s, 16).ok()).flatten()
}

impl FromStr for PciAddr {
    type Err = PciAddrError;

    fn from_str(s: &str) -> Result<Self, PciAddrError> {
        let err = |reason| PciAddrError {
            input: s.to_owned(),
            reason,
        };
        let (domain, rest) = match s.split(':').count() {
            3 => s.split_once(':').ok_or_else(|| err("no domain"))?,
            2 => ("0000", s),
            _ => return Err(err("wrong number of `:`")),
        };
        // 4 digits (sysfs, CUDA), 8 (NVML); 5 appears for VMD domains such as `10000`.
        let domain =
            hex_digits(domain, 4, 8).ok_or_else(|| err("domain is not 4 to 8 hex digits"))?;
        let (bus, rest) = rest.split_once(':').ok_or_else(|| err("no bus"))?;
        let (device, function) = rest.split_once('.').ok_or_else(|| err("no `.function`"))?;
        let bus = hex_digits(bus, 2, 2).ok_or_else(|| err("bus is not 2 hex digits"))?;
        let device = hex_digits(device, 2, 2)
            .filter(|d| *d <= 0x1f)
            .ok_or_else(|| err("device is not 2 hex digits up to 1f"))?;
        let function = hex_digits(function, 1, 1)
            .filter(|f| *f <= 7)
            .ok_or_else(|| err("function is not a digit 0-7"))?;
        // The filters above bound every field, so the narrowing casts below cannot truncate.
        Ok(Self {
            domain,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl Serialize for PciAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `s` is a full sysfs device name (`dddd:bb:dd.f`, domain required): path components such
/// as `pci0000:00` or `net` are not.
pub(crate) fn parse_sysfs_name(s: &str) -> Option<PciAddr> {
    (s.split(':').count() == 3)
        .then(|| s.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(domain: u32, bus: u8, device: u8, function: u8) -> PciAddr {
        PciAddr {
            domain,
            bus,
            device,
            function,
        }
    }

    #[test]
    fn parses_every_spelling_to_the_same_address() {
        let want = addr(0, 0x0a, 0, 0);
        for s in [
            "0000:0a:00.0",
            "0000:0A:00.0",
            "00000000:0A:00.0",
            "0a:00.0",
            "0A:00.0",
        ] {
            assert_eq!(s.parse::<PciAddr>(), Ok(want), "{s}");
        }
        assert_eq!("0001:17:1f.7".parse(), Ok(addr(1, 0x17, 0x1f, 7)));
        assert_eq!("10000:e1:00.0".parse(), Ok(addr(0x10000, 0xe1, 0, 0)));
        assert_eq!(
            "FFFFFFFF:FF:1F.7".parse(),
            Ok(addr(u32::MAX, 0xff, 0x1f, 7))
        );
    }

    #[test]
    fn displays_lower_case_with_at_least_four_domain_digits() {
        assert_eq!(addr(0, 0x0a, 0x1f, 3).to_string(), "0000:0a:1f.3");
        assert_eq!(addr(0x10000, 0xe1, 0, 0).to_string(), "10000:e1:00.0");
        for s in [
            "0000:00:00.0",
            "0001:80:02.1",
            "abcd:ef:1f.7",
            "10000:e1:00.0",
        ] {
            assert_eq!(
                s.parse::<PciAddr>().map(|a| a.to_string()).as_deref(),
                Ok(s)
            );
        }
    }

    #[test]
    fn refuses_other_shapes_and_keeps_the_input() {
        for s in [
            "",
            "0000:0a:00",
            "000:0a:00.0",
            "000000000:0a:00.0",
            "0000:a:00.0",
            "0000:0a:0.0",
            "0000:0a:20.0",
            "0000:0a:00.8",
            "0000:0a:00.00",
            "0000:0g:00.0",
            "+000:0a:00.0",
            "0000:0a:00.0 ",
            "0000:00:0a:00.0",
            "pci0000:00",
            "0a.00.0",
        ] {
            let e = s.parse::<PciAddr>().expect_err(s);
            assert_eq!(e.input, s);
            assert!(e.to_string().contains(&format!("`{s}`")), "{e}");
        }
    }

    #[test]
    fn orders_by_domain_first() {
        let mut v: Vec<PciAddr> = [
            "0001:00:00.0",
            "0000:80:00.0",
            "0000:05:00.1",
            "0000:05:00.0",
        ]
        .iter()
        .map(|s| s.parse().expect("valid"))
        .collect();
        v.sort();
        let shown: Vec<String> = v.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "0000:05:00.0",
                "0000:05:00.1",
                "0000:80:00.0",
                "0001:00:00.0"
            ]
        );
    }

    #[test]
    fn serde_uses_the_string() {
        let a = addr(0, 0x0a, 0, 0);
        let json = serde_json::to_string(&a).expect("serialize");
        assert_eq!(json, "\"0000:0a:00.0\"");
        let back: PciAddr = serde_json::from_str("\"00000000:0A:00.0\"").expect("deserialize");
        assert_eq!(back, a);
        assert!(serde_json::from_str::<PciAddr>("\"0a-00\"").is_err());
    }

    #[test]
    fn sysfs_names_need_a_domain() {
        assert_eq!(parse_sysfs_name("0000:0a:00.0"), Some(addr(0, 0x0a, 0, 0)));
        assert_eq!(parse_sysfs_name("0a:00.0"), None);
        assert_eq!(parse_sysfs_name("pci0000:00"), None);
        assert_eq!(parse_sysfs_name("net"), None);
    }
}
