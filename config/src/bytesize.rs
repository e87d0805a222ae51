//! Byte sizes written as integers or strings with a unit: `1048576`, `"64MiB"`, `"1G"`.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

/// How a size is written, for parse errors.
const SIZE_EXAMPLES: &str = "e.g. 1048576, 64MiB, 2G";

/// The multiplier of a size unit (any case, spaces around it ignored): B, K/KB/KiB, M/MB/MiB,
/// G/GB/GiB, T/TB/TiB. KB, MB, GB and TB are binary units, as KiB... are (1KB = 1024 bytes);
/// `None` for anything else.
fn unit_multiplier(unit: &str) -> Option<u64> {
    Some(match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        "t" | "tib" | "tb" => 1 << 40,
        _ => return None,
    })
}

/// The bytes of `whole`.`frac` `unit` (`1`, `5`, `GiB`) when they are a whole number that fits
/// 64 bits.
fn exact_bytes(whole: &str, frac: &str, unit: &str) -> Option<u64> {
    let mult = u128::from(unit_multiplier(unit)?);
    let scale = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    let n: u128 = format!("{whole}{frac}").parse().ok()?;
    let bytes = n.checked_mul(mult)?;
    if bytes % scale != 0 {
        return None;
    }
    u64::try_from(bytes / scale).ok()
}

/// The error for `s`, a size with a fraction: `whole` before the point, `rest` after it
/// (`1`, `5GiB` for `1.5GiB`). Where it is a whole number of bytes, the same size in the
/// largest unit that writes it whole is suggested.
fn fraction_error(s: &str, whole: &str, rest: &str) -> String {
    let end = rest
        .find(|c: char| !c.is_ascii_digit() && c != '_')
        .unwrap_or(rest.len());
    let (frac, unit) = rest.split_at(end);
    let hint = match exact_bytes(&whole.replace('_', ""), &frac.replace('_', ""), unit) {
        Some(b) => format!("write {}", ByteSize(b)),
        None => "write it as a whole number of a smaller unit, or of bytes".to_owned(),
    };
    format!("`{s}` has a fraction: a size is a whole number of bytes or of a unit; {hint}")
}

/// The error for `s`, a size past 64 bits.
fn too_large(s: &str) -> String {
    format!(
        "`{s}` is too large: a size is at most {} bytes (64 bits)",
        u64::MAX
    )
}

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !c.is_ascii_digit() && c != '_')
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if let Some(rest) = unit.strip_prefix('.') {
            return Err(fraction_error(s, num, rest));
        }
        let n: u64 = num
            .replace('_', "")
            .parse()
            .map_err(|e: std::num::ParseIntError| match e.kind() {
                std::num::IntErrorKind::PosOverflow => too_large(s),
                _ => format!("`{s}` is not a byte size ({SIZE_EXAMPLES})"),
            })?;
        let Some(mult) = unit_multiplier(unit) else {
            return Err(format!(
                "unknown size unit `{}` in `{s}` (use B, KiB, MiB, GiB, TiB)",
                unit.trim().to_ascii_lowercase()
            ));
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| too_large(s))
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0;
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if b >= 1 << shift && b.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", b >> shift);
            }
        }
        write!(f, "{b}")
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// Reads a size from a non-negative integer or a string; anything else is an error that
/// names the value and the forms a size takes (an untagged enum said only "data did not
/// match any variant of untagged enum Raw").
struct SizeVisitor;

/// How a size is written, for errors.
const SIZE_FORMS: &str = "a size is a number of bytes (a non-negative integer) or a string with a unit, such as \"64MiB\"";

impl serde::de::Visitor<'_> for SizeVisitor {
    type Value = ByteSize;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a number of bytes or a string with a unit, such as \"64MiB\"")
    }

    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
        Ok(ByteSize(n))
    }

    fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
        u64::try_from(n)
            .map(ByteSize)
            .map_err(|_| E::custom(format!("{n} is not a size: {SIZE_FORMS}")))
    }

    fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<ByteSize, E> {
        Err(E::custom(format!("{n} is not a size: {SIZE_FORMS}")))
    }

    fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<ByteSize, E> {
        Err(E::custom(format!("{b} is not a size: {SIZE_FORMS}")))
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
        s.parse().map_err(E::custom)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use figment::providers::{Format, Toml};

    use super::*;

    #[test]
    fn parse_and_display() {
        assert_eq!("64MiB".parse::<ByteSize>().unwrap(), ByteSize(64 << 20));
        assert_eq!("1_024".parse::<ByteSize>().unwrap(), ByteSize(1024));
        assert_eq!("2 g".parse::<ByteSize>().unwrap(), ByteSize(2 << 30));
        assert!(
            "12 parsecs"
                .parse::<ByteSize>()
                .unwrap_err()
                .contains("parsecs")
        );
        assert_eq!(ByteSize(3 << 20).to_string(), "3MiB");
        // Before: "data did not match any variant of untagged enum Raw", naming nothing.
        for (toml, bad) in [("s = -1", "-1"), ("s = 1.5", "1.5"), ("s = true", "true")] {
            #[derive(Debug, Deserialize)]
            struct T {
                #[allow(dead_code)] // read by the deserializer only
                s: ByteSize,
            }
            let e = figment::Figment::from(Toml::string(toml))
                .extract::<T>()
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad) && e.contains("\"64MiB\""), "{toml}: {e}");
        }
        let t: std::collections::BTreeMap<String, ByteSize> =
            figment::Figment::from(Toml::string("a = 4096\nb = \"2MiB\""))
                .extract()
                .unwrap();
        assert_eq!((t["a"], t["b"]), (ByteSize(4096), ByteSize(2 << 20)));
        assert_eq!(ByteSize(1000).to_string(), "1000");
    }

    #[test]
    fn a_fraction_and_an_overflow_are_named() {
        // Before: "unknown size unit `.5gib`" and "is not a byte size".
        for (s, hint) in [
            ("1.5GiB", "write 1536MiB"),
            ("0.5 KiB", "write 512"),
            ("2.25G", "write 2304MiB"),
            ("1.5", "whole number of a smaller unit"),
            ("1.0000000001GiB", "whole number of a smaller unit"),
        ] {
            let e = s.parse::<ByteSize>().unwrap_err();
            assert!(
                e.contains(&format!("`{s}` has a fraction")) && e.contains(hint),
                "{s}: {e}"
            );
        }
        for s in [
            "99999999999999999999",
            "18446744073709551616",
            "16777216TiB",
        ] {
            let e = s.parse::<ByteSize>().unwrap_err();
            assert!(
                e.contains("too large") && e.contains("18446744073709551615"),
                "{s}: {e}"
            );
        }
        assert_eq!(
            "18446744073709551615".parse::<ByteSize>(),
            Ok(ByteSize(u64::MAX))
        );
        assert!(
            "GiB"
                .parse::<ByteSize>()
                .unwrap_err()
                .contains("not a byte size")
        );
    }

    #[test]
    fn decimal_looking_units_are_binary() {
        // KB, MB, GB and TB mean KiB... (docs/CONFIGURATION.md says so): kept as they were.
        for (s, n) in [
            ("1KB", 1u64 << 10),
            ("1kb", 1 << 10),
            ("3MB", 3 << 20),
            ("2GB", 2 << 30),
            ("1TB", 1 << 40),
            ("2GiB", 2 << 30),
        ] {
            assert_eq!(s.parse::<ByteSize>(), Ok(ByteSize(n)), "{s}");
        }
    }
}
