//! The value formats of sysfs attribute files (cpulists such as `0-23,48-71`, hex ids such
//! as `0x10de`, `numa_node` with `-1` for unknown) and their JSON spellings.

use serde::Serializer;

/// The most CPUs one range of a cpulist may name: a corrupt or hostile file such as
/// `0-4294967295` must not allocate gigabytes. Far above any real host.
const MAX_RANGE: u32 = 1 << 16;

/// Parses a kernel cpulist (`0-23,48-71`, `3`, empty for none). `None` when malformed.
pub fn parse_cpulist(s: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<u32>().ok()?, hi.parse::<u32>().ok()?),
            None => {
                let one = part.parse::<u32>().ok()?;
                (one, one)
            }
        };
        if hi < lo || hi - lo >= MAX_RANGE {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// The kernel's spelling of a set of CPUs (or queue ids): sorted, runs as `a-b`, `,`-joined;
/// empty for none.
pub fn format_ranges(ids: &[u32]) -> String {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// Parses an id file's content (`0x10de`).
pub fn parse_hex16(s: &str) -> Option<u16> {
    let digits = s.trim().strip_prefix("0x")?;
    let ok =
        !digits.is_empty() && digits.len() <= 4 && digits.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| u16::from_str_radix(digits, 16).ok()).flatten()
}

/// Parses `numa_node` (`-1` when the platform does not say).
pub fn parse_numa(s: &str) -> Option<u32> {
    s.trim().parse::<u32>().ok()
}

/// An id as sysfs writes it: `0x10de`.
pub fn hex16(id: u16) -> String {
    format!("0x{id:04x}")
}

/// Serde: an id as `"0x10de"`.
pub(crate) fn ser_hex16<S: Serializer>(id: &u16, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&hex16(*id))
}

/// Serde: an optional id as `"0x10de"` or `null`.
pub(crate) fn ser_opt_hex16<S: Serializer>(id: &Option<u16>, s: S) -> Result<S::Ok, S::Error> {
    match id {
        Some(id) => s.serialize_str(&hex16(*id)),
        None => s.serialize_none(),
    }
}

/// Serde: CPUs as a cpulist string (`"0-23,48-71"`), compact for hosts with 200 CPUs.
pub(crate) fn ser_cpulist<S: Serializer>(cpus: &[u32], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_ranges(cpus))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse_and_print() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("\n"), Some(vec![]));
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        for bad in ["a", "3-1", "1-", "-1", "0-4294967295", "1,,x"] {
            assert_eq!(parse_cpulist(bad), None, "{bad}");
        }
        assert_eq!(format_ranges(&[48, 0, 1, 2, 49, 7]), "0-2,7,48-49");
        assert_eq!(format_ranges(&[]), "");
        let list = "0-51,104-155";
        assert_eq!(format_ranges(&parse_cpulist(list).expect("valid")), list);
    }

    #[test]
    fn ids_and_numa() {
        assert_eq!(parse_hex16("0x10de\n"), Some(0x10de));
        assert_eq!(parse_hex16("0x15B3"), Some(0x15b3));
        assert_eq!(parse_hex16("10de"), None);
        assert_eq!(parse_hex16("0x"), None);
        assert_eq!(parse_hex16("0x12345"), None);
        assert_eq!(hex16(0x2330), "0x2330");
        assert_eq!(parse_numa("1\n"), Some(1));
        assert_eq!(parse_numa("-1\n"), None);
        assert_eq!(parse_numa(""), None);
    }
}
