//! The value formats of sysfs attribute files (cpulists such as `0-23,48-71`, hex ids such
//! as `0x10de`, `numa_node` with `-1` for unknown) and their JSON spellings.

use serde::Serializer;

/// One past the highest CPU id a cpulist may name, so also the most CPUs it may name. The
/// kernel numbers CPUs below its `NR_CPUS`, 8192 in its largest configurations (x86-64 with
/// `CONFIG_MAXSMP`), so this leaves room to spare. The whole list is gathered in a set of
/// this many bits (8 KiB), not range by range: a corrupt or hostile file such as
/// `0-4294967295`, or `0-65535,` repeated 65 536 times (512 KiB, 2^32 ids), must not allocate
/// gigabytes.
pub const MAX_CPUS: u32 = 1 << 16;

/// Why a cpulist is none the kernel writes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpulistError {
    /// A part is not `N` or `LO-HI` with `LO <= HI` (its first 32 characters).
    #[error("`{0}` is not a CPU number or range such as `3` or `0-23`")]
    Malformed(String),
    /// A CPU id at or past [`MAX_CPUS`].
    #[error("it names CPU {0}, and no kernel numbers CPUs past {max}", max = MAX_CPUS - 1)]
    CpuTooLarge(u32),
    /// The file is longer than this many bytes, which no kernel writes for a cpulist.
    #[error("it is longer than {0} bytes, more than a kernel writes for one")]
    TooLong(usize),
}

/// Parses a kernel cpulist (`0-23,48-71`, `3`, empty for none): the CPUs, sorted, each once.
pub fn parse_cpulist(s: &str) -> Result<Vec<u32>, CpulistError> {
    const WORDS: usize = (MAX_CPUS / 64) as usize;
    let mut set = vec![0u64; WORDS];
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = parse_cpu_range(part)?;
        // Word by word, so a wide range costs at most WORDS steps.
        for w in lo / 64..=hi / 64 {
            let first = lo.max(w * 64) - w * 64;
            let last = hi.min(w * 64 + 63) - w * 64;
            set[w as usize] |= (u64::MAX >> (63 - last)) & (u64::MAX << first);
        }
    }
    let mut cpus = Vec::new();
    for (w, &word) in (0u32..).zip(&set) {
        let mut bits = word;
        while bits != 0 {
            cpus.push(w * 64 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    Ok(cpus)
}

/// One part of a cpulist (`3`, `0-23`) as its first and last CPU.
fn parse_cpu_range(part: &str) -> Result<(u32, u32), CpulistError> {
    let malformed = || CpulistError::Malformed(part.chars().take(32).collect());
    let num = |t: &str| t.parse::<u32>().map_err(|_| malformed());
    let (lo, hi) = match part.split_once('-') {
        Some((lo, hi)) => (num(lo)?, num(hi)?),
        None => {
            let one = num(part)?;
            (one, one)
        }
    };
    if hi < lo {
        return Err(malformed());
    }
    if hi >= MAX_CPUS {
        return Err(CpulistError::CpuTooLarge(hi));
    }
    Ok((lo, hi))
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
            Ok(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Ok(vec![]));
        assert_eq!(parse_cpulist("\n"), Ok(vec![]));
        assert_eq!(parse_cpulist("5"), Ok(vec![5]));
        assert_eq!(parse_cpulist("3,1-2,2"), Ok(vec![1, 2, 3]));
        for bad in ["a", "3-1", "1-", "-1", "1,,x"] {
            assert!(
                matches!(parse_cpulist(bad), Err(CpulistError::Malformed(_))),
                "{bad}"
            );
        }
        assert_eq!(
            parse_cpulist("0-4294967295"),
            Err(CpulistError::CpuTooLarge(u32::MAX))
        );
        assert_eq!(format_ranges(&[48, 0, 1, 2, 49, 7]), "0-2,7,48-49");
        assert_eq!(format_ranges(&[]), "");
        let list = "0-51,104-155";
        assert_eq!(format_ranges(&parse_cpulist(list).expect("valid")), list);
    }

    #[test]
    fn a_cpulist_is_bounded_as_a_whole_not_range_by_range() {
        // Before, each range was bounded by its width only and all were gathered before the
        // dedup: `0-65535,` repeated 65 536 times gathered 2^32 ids (16 GiB), and a CPU id
        // past any kernel's (65536-65599, a narrow range) was taken.
        assert_eq!(
            parse_cpulist("65536-65599"),
            Err(CpulistError::CpuTooLarge(65599))
        );
        assert_eq!(
            parse_cpulist("1000000"),
            Err(CpulistError::CpuTooLarge(1_000_000))
        );
        let top = MAX_CPUS - 1;
        let hostile = format!("0-{top},").repeat(1024);
        let cpus = parse_cpulist(&hostile).expect("ids in range");
        assert_eq!(cpus.len(), MAX_CPUS as usize);
        assert_eq!((cpus[0], cpus[cpus.len() - 1]), (0, top));
        // Ranges across word edges and single CPUs of the same words.
        assert_eq!(
            parse_cpulist("62-65,127,128,64"),
            Ok(vec![62, 63, 64, 65, 127, 128])
        );
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
