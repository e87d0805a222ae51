//! The `devmem_tx` key: the interfaces a source sends devmem TX through, written as one name
//! (`devmem_tx = "eth1"`, as before) or a list (`devmem_tx = ["eth1", "eth2"]`, one TX binding
//! per NIC), and the checks on those names.

use serde::Deserializer;

use crate::{ConfigError, invalid};

/// Longest interface name Linux accepts (`IFNAMSIZ` - 1).
const MAX_IFNAME: usize = 15;

/// Reads one interface name or a list of them; anything else is an error naming the
/// value (an untagged enum said only "data did not match any variant").
struct OneOrMany;

impl<'de> serde::de::Visitor<'de> for OneOrMany {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an interface name, \"eth1\", or a list of them, [\"eth1\", \"eth2\"]")
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Vec<String>, E> {
        Ok(vec![s.to_owned()])
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
        let mut names = Vec::new();
        while let Some(n) = seq.next_element::<String>()? {
            names.push(n);
        }
        Ok(names)
    }
}

/// Reads one interface name or a list of them.
pub(crate) fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    d.deserialize_any(OneOrMany)
}

/// What a Linux interface name is, for errors (the kernel's `dev_valid_name`).
pub(crate) const NAME_RULES: &str = "is not an interface name: Linux takes 1 to 15 bytes, \
     not \".\" or \"..\", with no '/', ':', whitespace or NUL (write it as `ip link` shows it)";

/// True if Linux would accept `n` as an interface name: what the kernel's `dev_valid_name`
/// accepts (1 to `IFNAMSIZ` - 1 bytes, not `.` or `..`, no `/`, `:` or whitespace), and no
/// NUL, which no name can carry.
pub(crate) fn is_valid_name(n: &str) -> bool {
    // The kernel's `isspace`: space, \t \n \v \f \r, and 0xa0 (its ctype table is Latin-1),
    // byte by byte.
    let refused = |b: u8| {
        matches!(
            b,
            b'/' | b':' | b'\0' | b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | 0xa0
        )
    };
    !n.is_empty() && n.len() <= MAX_IFNAME && n != "." && n != ".." && !n.bytes().any(refused)
}

/// Each name is a possible interface name and none is named twice (a NIC gets one TX
/// binding).
pub(crate) fn check(key: &'static str, names: &[String]) -> Result<(), ConfigError> {
    for (i, n) in names.iter().enumerate() {
        if !is_valid_name(n) {
            return Err(invalid(key, format!("{n:?}"), NAME_RULES));
        }
        if names[..i].contains(n) {
            return Err(invalid(
                key,
                n,
                "is named twice: each interface gets one TX binding",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Deserialize)]
    struct T {
        #[serde(deserialize_with = "one_or_many")]
        devmem_tx: Vec<String>,
    }

    fn parse(text: &str) -> Option<T> {
        use figment::providers::Format;
        let f = figment::Figment::from(figment::providers::Toml::string(text));
        f.extract().ok()
    }

    #[test]
    fn one_name_or_a_list() {
        assert_eq!(parse(r#"devmem_tx = "eth1""#).unwrap().devmem_tx, ["eth1"]);
        let t = parse(r#"devmem_tx = ["eth1", "eth2"]"#).unwrap();
        assert_eq!(t.devmem_tx, ["eth1", "eth2"]);
        assert!(parse("devmem_tx = 3").is_none());
        // The error names the value and the forms the key takes.
        use figment::providers::Format;
        let e = figment::Figment::from(figment::providers::Toml::string("devmem_tx = 3"))
            .extract::<T>()
            .err()
            .expect("a number is refused")
            .to_string();
        assert!(e.contains('3') && e.contains("an interface name"), "{e}");
    }

    #[test]
    fn bad_and_repeated_names_are_refused_naming_them() {
        assert!(check("devmem_tx", &["eth1".into(), "eth2".into()]).is_ok());
        let e = check("devmem_tx", &["eth1".into(), "eth1".into()]).unwrap_err();
        assert!(
            e.to_string().contains("eth1") && e.to_string().contains("twice"),
            "{e}"
        );
        let e = check("devmem_tx", &["a-very-long-interface".into()]).unwrap_err();
        assert!(e.to_string().contains("a-very-long-interface"), "{e}");
        assert!(check("devmem_tx", &[String::new()]).is_err());
    }

    #[test]
    fn names_linux_refuses_are_refused_and_those_it_takes_pass() {
        // Before, a tab, a newline, "." and ".." passed: the kernel refuses each
        // (`dev_valid_name`), so the bind failed at start naming no key.
        for bad in [
            "",
            ".",
            "..",
            "eth1 ",
            "eth\t1",
            "eth1\n",
            "eth\u{b}1",
            "eth/1",
            "eth:1",
            "eth\u{0}1",
            "eth\u{a0}1",
            "sixteen-bytes-xx",
        ] {
            let e = check("devmem_tx", &[bad.to_owned()])
                .expect_err(bad)
                .to_string();
            let named = e.contains(&format!("{bad:?}"));
            assert!(
                e.contains("devmem_tx") && e.contains("1 to 15 bytes") && named,
                "{bad:?}: {e}"
            );
        }
        for ok in [
            "eth1",
            "enp25s0f1np1",
            "fifteen-bytes-x",
            "...",
            "lo",
            "ib0.8001",
            "vlan@x",
        ] {
            assert!(is_valid_name(ok), "{ok}");
        }
    }
}
