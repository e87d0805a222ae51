//! Byte sizes written as integers or strings with a unit: `1048576`, `"64MiB"`, `"1G"`.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !c.is_ascii_digit() && c != '_')
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .replace('_', "")
            .parse()
            .map_err(|_| format!("`{s}` is not a byte size (e.g. 1048576, 64MiB, 2G)"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" | "kb" => 1 << 10,
            "m" | "mib" | "mb" => 1 << 20,
            "g" | "gib" | "gb" => 1 << 30,
            "t" | "tib" | "tb" => 1 << 40,
            other => {
                return Err(format!(
                    "unknown size unit `{other}` in `{s}` (use B, KiB, MiB, GiB, TiB)"
                ));
            }
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("`{s}` overflows 64 bits"))
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
}
