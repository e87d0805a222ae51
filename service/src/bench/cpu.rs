//! CPU accounting for `shardwire bench`: per-CPU shares from /proc/stat (kperf's per-CPU
//! usr/sys/idle/irq lines, and steal) and CPU seconds per thread of this process from
//! /proc/self/task, grouped by role (the thread names say which part of the pipeline a
//! thread belongs to), to report CPU seconds per GB delivered.

use std::collections::BTreeMap;

use crate::out::outln;

/// The CPU the figures are for: model, and the flags the receive path's speed depends on
/// (CRC-32C kernels, string copies), from /proc/cpuinfo; and the L2 size.
pub fn describe() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    describe_text(&info, cpus, l2_bytes())
}

/// The flags [`describe`] names where the CPU has them: x86 `flags` (SSE4.2 `crc32`, carry-less
/// multiply, wide vectors, fast string copies), then arm64 `Features` (`crc32` instructions,
/// `pmull` and `sha3`'s three-way XOR for folding CRCs, vectors).
const WANTED_FLAGS: [&str; 14] = [
    "sse4_2",
    "pclmulqdq",
    "avx2",
    "avx512f",
    "avx512vl",
    "vpclmulqdq",
    "erms",
    "fsrm",
    "crc32",
    "pmull",
    "sha3",
    "asimd",
    "sve",
    "sve2",
];

/// [`describe`] of a /proc/cpuinfo text: x86 kernels name the model (`model name`,
/// `vendor_id`, `cpu family`, `model`, `flags`); arm64 ones give the MIDR fields instead
/// (`CPU implementer`, `CPU part`, `CPU variant`, `CPU revision`, `Features`).
fn describe_text(info: &str, cpus: usize, l2: Option<usize>) -> String {
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let flags = field("flags")
        .or_else(|| field("Features"))
        .unwrap_or_default();
    let have: Vec<&str> = WANTED_FLAGS
        .iter()
        .copied()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    let l2 = l2.map_or("?".into(), |b| format!("{} KiB", b >> 10));
    let get = |name: &str| field(name).unwrap_or_else(|| "?".into());
    let model = match (field("model name"), field("CPU implementer")) {
        (None, Some(implementer)) => arm_model(&implementer, &get),
        _ => format!(
            "{} (vendor {}, family {} model {})",
            get("model name"),
            get("vendor_id"),
            get("cpu family"),
            get("model")
        ),
    };
    format!(
        "{model}, {cpus} CPUs, L2 {l2} per core, flags {}",
        have.join(" ")
    )
}

/// An arm64 core from its MIDR fields, e.g. `Neoverse-V2 (implementer 0x41 Arm, part 0xd4f,
/// r0p0)`: the cores of the usual server parts by name (`arch/arm64/include/asm/cputype.h`),
/// any other by its numbers.
fn arm_model(implementer: &str, get: &dyn Fn(&str) -> String) -> String {
    let part = get("CPU part");
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let vendor = match hex(implementer) {
        Some(0x41) => "Arm",
        Some(0x4e) => "NVIDIA",
        Some(0x48) => "HiSilicon",
        Some(0x51) => "Qualcomm",
        Some(0x61) => "Apple",
        Some(0xc0) => "Ampere",
        _ => "?",
    };
    let core = match (hex(implementer), hex(part.as_str())) {
        (Some(0x41), Some(0xd0c)) => "Neoverse-N1",
        (Some(0x41), Some(0xd40)) => "Neoverse-V1",
        (Some(0x41), Some(0xd49)) => "Neoverse-N2",
        (Some(0x41), Some(0xd4f)) => "Neoverse-V2",
        (Some(0x41), Some(0xd84)) => "Neoverse-V3",
        (Some(0x41), Some(0xd8e)) => "Neoverse-N3",
        _ => "arm64 core",
    };
    let variant = hex(get("CPU variant").as_str()).map_or("?".into(), |v| v.to_string());
    format!(
        "{core} (implementer {implementer} {vendor}, part {part}, r{variant}p{})",
        get("CPU revision")
    )
}

/// The L2 cache of CPU 0 in bytes (sysfs `cache/index2/size`, e.g. `2048K`).
pub fn l2_bytes() -> Option<usize> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size").ok()?;
    let s = s.trim();
    let (n, mult) = match s.strip_suffix('K') {
        Some(n) => (n, 1 << 10),
        None => match s.strip_suffix('M') {
            Some(n) => (n, 1 << 20),
            None => (s, 1),
        },
    };
    n.parse::<usize>().ok().map(|n| n * mult)
}

/// One CPU's jiffies from a /proc/stat line: (user+nice, system, idle+iowait, irq+softirq,
/// steal, total). The total leaves out guest and guest_nice: the kernel counts them in user
/// and nice already.
pub type Jiffies = [u64; 6];

/// Per-CPU [`Jiffies`] from /proc/stat.
pub fn cpu_times() -> Vec<Jiffies> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(parse_cpu_line)
        .collect()
}

/// [`Jiffies`] of one `cpuN user nice system idle iowait irq softirq steal guest guest_nice`
/// line (fields a kernel does not have count 0).
fn parse_cpu_line(l: &str) -> Jiffies {
    let v: Vec<u64> = l
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let g = |i: usize| v.get(i).copied().unwrap_or(0);
    let total: u64 = (0..8).map(g).sum();
    [g(0) + g(1), g(2), g(3) + g(4), g(5) + g(6), g(7), total]
}

/// The jiffies a CPU worked between two samples: user, nice, system, irq and softirq (not
/// idle or iowait, nor steal: time the hypervisor ran something else).
fn busy(before: &Jiffies, after: &Jiffies) -> u64 {
    [0usize, 1, 3]
        .iter()
        .map(|&k| after[k].saturating_sub(before[k]))
        .sum()
}

/// Prints each CPU's shares between two [`cpu_times`] samples; returns the CPU seconds all
/// CPUs were busy (user, system, irq and softirq: work no thread is charged for, such as
/// loopback's receive processing, included; steal left out).
pub fn print_cpu(before: &[Jiffies], after: &[Jiffies]) -> f64 {
    let mut jiffies = 0u64;
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        let total = a[5].saturating_sub(b[5]).max(1) as f64;
        let pct = |k: usize| a[k].saturating_sub(b[k]) as f64 * 100.0 / total;
        outln!(
            "  CPU{i:3}: usr:{:5.2}% sys:{:5.2}% idle:{:5.2}% irq:{:5.2}% steal:{:5.2}%",
            pct(0),
            pct(1),
            pct(2),
            pct(3),
            pct(4)
        );
        jiffies += busy(b, a);
    }
    jiffies as f64 / rustix::param::clock_ticks_per_second() as f64
}

/// The role of a thread, from its name.
fn role(comm: &str) -> &'static str {
    const ROLES: [(&str, &str); 8] = [
        ("sw-send-", "source send"),
        ("sw-recv-", "node receive"),
        ("sw-trainer", "node trainer socket"),
        ("tokio-rt-worker", "runtime (source + node control)"),
        ("tokio-runtime", "runtime (source + node control)"),
        ("tcp-send-", "tcp send"),
        ("tcp-recv-", "tcp recv"),
        ("bench-trainer", "trainer"),
    ];
    ROLES
        .iter()
        .find(|(p, _)| comm.starts_with(p))
        .map_or("other", |(_, r)| r)
}

/// (user, system) seconds of threads, by role.
pub type ThreadTimes = BTreeMap<&'static str, (f64, f64)>;

/// (user, system) seconds of every thread of this process so far, by role (a thread that
/// exited is gone from /proc/self/task, and its seconds with it).
pub fn thread_times() -> ThreadTimes {
    let tick = rustix::param::clock_ticks_per_second() as f64;
    let mut out = ThreadTimes::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
        let e = out.entry(role(comm.trim())).or_default();
        e.0 += num(11) / tick;
        e.1 += num(12) / tick;
    }
    out
}

/// Prints CPU seconds per GB delivered, by role, between two [`thread_times`] samples, and
/// returns the total over this process's threads.
pub fn print_per_gb(
    before: &BTreeMap<&'static str, (f64, f64)>,
    after: &BTreeMap<&'static str, (f64, f64)>,
    bytes: u64,
) -> f64 {
    let gb = bytes as f64 / 1e9;
    let mut total = 0.0;
    for (role, &(u1, s1)) in after {
        let (u0, s0) = before.get(role).copied().unwrap_or_default();
        let (u, s) = (u1 - u0, s1 - s0);
        if u + s < 0.005 {
            continue;
        }
        total += u + s;
        outln!(
            "  {role:32} usr {u:6.2} s  sys {s:6.2} s  {:6.3} CPU s/GB",
            (u + s) / gb.max(1e-9)
        );
    }
    outln!(
        "  {:32} {total:.2} CPU s  {:6.3} CPU s/GB",
        "all threads",
        total / gb.max(1e-9)
    );
    total / gb.max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_come_from_thread_names() {
        assert_eq!(role("sw-recv-0-3"), "node receive");
        assert_eq!(role("sw-send-1"), "source send");
        assert_eq!(role("tokio-rt-worker"), "runtime (source + node control)");
        assert_eq!(role("bench-trainer"), "trainer");
        assert_eq!(role("whatever"), "other");
    }

    /// The start of /proc/cpuinfo on an NVIDIA Grace (Neoverse-V2) host, as printed there.
    const GRACE: &str = "processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm sb paca \
pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm \
bf16 dgh bti
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 0

processor\t: 1
BogoMIPS\t: 2000.00
";

    #[test]
    fn an_arm64_cpu_is_described_from_its_midr_fields_and_features() {
        // Before: "? (vendor ?, family ? model ?), 72 CPUs, L2 1024 KiB per core, flags ".
        assert_eq!(
            describe_text(GRACE, 72, Some(1 << 20)),
            "Neoverse-V2 (implementer 0x41 Arm, part 0xd4f, r0p0), 72 CPUs, L2 1024 KiB per \
             core, flags crc32 pmull sha3 asimd sve sve2"
        );
        // A part not named here is given by its numbers.
        let other = describe_text(&GRACE.replace("0xd4f", "0xabc"), 1, None);
        let want = "arm64 core (implementer 0x41 Arm, part 0xabc, r0p0), 1 CPUs, L2 ? per core";
        assert!(other.starts_with(want), "{other}");
    }

    #[test]
    fn an_x86_cpu_is_described_as_before() {
        let info = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: \
                    AMD EPYC 9R14\nflags\t\t: fpu sse4_2 pclmulqdq avx2 vpclmulqdq erms\n";
        assert_eq!(
            describe_text(info, 2, Some(1 << 20)),
            "AMD EPYC 9R14 (vendor AuthenticAMD, family 25 model 17), 2 CPUs, L2 1024 KiB per \
             core, flags sse4_2 pclmulqdq avx2 vpclmulqdq erms"
        );
    }

    #[test]
    fn busy_time_is_user_system_and_irq_not_steal_or_guest() {
        //          user nice system idle iowait irq softirq steal guest guest_nice
        let b = parse_cpu_line("cpu0 100 10 50 1000 20 5 15 0 0 0");
        let a = parse_cpu_line("cpu0 200 20 100 1100 40 10 30 400 80 8");
        assert_eq!(b, [110, 50, 1020, 20, 0, 1200]);
        // Guest time is in user and nice already: the total counts it once.
        assert_eq!(a[5], 200 + 20 + 100 + 1100 + 40 + 10 + 30 + 400);
        // 100 user + 10 nice + 50 system + 5 irq + 15 softirq; before, total - idle -
        // iowait: 668, with the 400 of steal and the 88 of guest counted again.
        assert_eq!(busy(&b, &a), 180);
        assert_eq!(a[4] - b[4], 400);
        // A kernel with fewer fields: the missing ones count 0.
        assert_eq!(parse_cpu_line("cpu1 1 2 3 4"), [3, 3, 4, 0, 0, 10]);
    }

    #[test]
    fn this_thread_shows_up_with_its_cpu() {
        // A thread with a role's name (no other test names one so), spinning until its CPU
        // time shows up under that role: a loaded machine only makes that take longer.
        let spin = std::thread::Builder::new().name("bench-trainer-test".into());
        let cpu = spin
            .spawn(|| {
                let cpu = || thread_times().get("trainer").map_or(0.0, |(u, s)| u + s);
                let (before, t) = (cpu(), std::time::Instant::now());
                let mut x = 0u64;
                while cpu() <= before {
                    assert!(
                        t.elapsed() < std::time::Duration::from_secs(60),
                        "no CPU time"
                    );
                    for _ in 0..100_000 {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    }
                    std::hint::black_box(x);
                }
                cpu()
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(cpu > 0.0);
    }
}
