//! The comparisons of `shardwire bench`, each run in every round and summarised over the
//! rounds as medians: shardwire against plain TCP ([`compare_tcp`]), the receive primitives
//! ([`compare_uring`]) and where the CRC is computed ([`compare_crc`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::crc::{Onward, Way, piece_range};
use super::{cpu, tcp};
use crate::out::outln;

/// What one run measured: goodput, CPU seconds per GB over this process's threads (user +
/// system) and over all CPUs (busy time, softirq included).
pub(super) struct Run {
    pub gbps: f64,
    pub cpu_per_gb: f64,
    pub all_per_gb: f64,
}

pub(super) fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 * 8.0 / secs / 1e9
}

/// The median of `v` (of an even count, the mean of the two middle values) and `v` sorted.
fn median(mut v: Vec<f64>) -> (f64, Vec<f64>) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let m = match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    (m, v)
}

/// The node with io_uring over the node with `recv` (goodput, CPU s/GB of the threads),
/// printed; `sw` ran with `io_uring`, `other` the other way.
pub(super) fn node_ratio(io_uring: bool, sw: &Run, other: &Run) -> (f64, f64) {
    let (on, off) = if io_uring { (sw, other) } else { (other, sw) };
    let r = (on.gbps / off.gbps, on.cpu_per_gb / off.cpu_per_gb);
    outln!(
        "ratio shardwire io_uring/recv: {:.3} ({:.3} / {:.3} Gbps), CPU s/GB (threads) {:.3}",
        r.0,
        on.gbps,
        off.gbps,
        r.1
    );
    r
}

/// One round of `--compare-tcp`: plain TCP into a hot buffer and into the region; returns
/// shardwire's ratios (goodput to hot, goodput to region, CPU s/GB threads, all CPUs).
pub(super) fn compare_tcp(
    sw: &Run,
    files: &[std::path::PathBuf],
    plain: &impl Fn(Option<usize>, tcp::Recv) -> tcp::TcpRun,
    region: usize,
) -> anyhow::Result<[f64; 4]> {
    let hot = run_plain(plain(None, tcp::Recv::Read), files)?;
    let placed = run_plain(plain(Some(region), tcp::Recv::Read), files)?;
    outln!(
        "ratio shardwire/tcp: {:.3} ({:.3} / {:.3} Gbps); shardwire/tcp-region: {:.3} ({:.3} Gbps); CPU s/GB shardwire/tcp: threads {:.2} ({:.3} / {:.3}), all CPUs {:.2} ({:.3} / {:.3})",
        sw.gbps / hot.gbps,
        sw.gbps,
        hot.gbps,
        sw.gbps / placed.gbps,
        placed.gbps,
        sw.cpu_per_gb / hot.cpu_per_gb,
        sw.cpu_per_gb,
        hot.cpu_per_gb,
        sw.all_per_gb / hot.all_per_gb,
        sw.all_per_gb,
        hot.all_per_gb
    );
    Ok([
        sw.gbps / hot.gbps,
        sw.gbps / placed.gbps,
        sw.cpu_per_gb / hot.cpu_per_gb,
        sw.all_per_gb / hot.all_per_gb,
    ])
}

pub(super) fn print_tcp_medians(ratios: &[[f64; 4]]) {
    if ratios.len() < 2 {
        return;
    }
    let labels = [
        format!("median ratio shardwire/tcp over {} rounds", ratios.len()),
        "median ratio shardwire/tcp-region".into(),
        "median CPU s/GB shardwire/tcp (this process's threads, user + system)".into(),
        "median CPU s/GB shardwire/tcp (all CPUs busy, softirq included)".into(),
    ];
    for (k, label) in labels.iter().enumerate() {
        let (m, sorted) = median(ratios.iter().map(|r| r[k]).collect());
        let list: Vec<String> = sorted.iter().map(|r| format!("{r:.3}")).collect();
        outln!("{label}: {m:.3} (sorted: {})", list.join(" "));
    }
}

/// A plain-TCP run (see [`tcp`]) with its CPU figures.
fn run_plain(r: tcp::TcpRun, files: &[std::path::PathBuf]) -> anyhow::Result<Run> {
    run_checked(r, files, &Arc::default())
}

/// A plain-TCP run whose `Recv::Crc` receivers check against `check`.
fn run_checked(
    r: tcp::TcpRun,
    files: &[std::path::PathBuf],
    check: &Arc<tcp::CrcCheck>,
) -> anyhow::Result<Run> {
    crate::out::check()?; // its reader gone (`| head`): stop before the measured run
    let mut samples = Vec::new();
    let m = tcp::run(r, files, check, || {
        samples.push((cpu::cpu_times(), cpu::thread_times()))
    })?;
    let [(c0, t0), (c1, t1)] =
        <[_; 2]>::try_from(samples).map_err(|_| anyhow::anyhow!("two CPU samples"))?;
    match r.region {
        None => outln!(
            "== plain TCP, same flows and threads (sendfile -> {} into one hot buffer, no CRC, no trainer)",
            r.recv.label()
        ),
        Some(b) => outln!(
            "== plain TCP ({}) into a rotating region of {b} bytes (shard-sized slots in turn, as the stream's region)",
            r.recv.label()
        ),
    }
    let busy = cpu::print_cpu(&c0, &c1);
    let cpu_per_gb = cpu::print_per_gb(&t0, &t1, m.bytes);
    let all_per_gb = busy / (m.bytes as f64 / 1e9);
    let g = gbps(m.bytes, m.secs);
    let name = match (r.region, r.recv) {
        (None, tcp::Recv::Read) => "tcp".to_string(),
        (Some(_), tcp::Recv::Read) => "tcp-region".to_string(),
        (_, recv) => format!("tcp-{}", recv.label()),
    };
    outln!(
        "{name}: {g:.3} Gbps ({} bytes in {:.2} s), all CPUs {all_per_gb:.3} busy s/GB",
        m.bytes,
        m.secs
    );
    Ok(Run {
        gbps: g,
        cpu_per_gb,
        all_per_gb,
    })
}

/// The primitives `--compare-uring` measures, the node's reader first (the reference).
const URING_RUNS: [tcp::Recv; 5] = [
    tcp::Recv::Node,
    tcp::Recv::ReadLowat,
    tcp::Recv::UringInto,
    tcp::Recv::UringCopy { lowat: false },
    tcp::Recv::UringSlots { lowat: true },
];

/// One round of `--compare-uring`: each primitive into the region; returns (goodput,
/// CPU s/GB of the threads) ratios to the node's reader, in [`URING_RUNS`] order.
pub(super) fn compare_uring(
    files: &[std::path::PathBuf],
    plain: &impl Fn(Option<usize>, tcp::Recv) -> tcp::TcpRun,
    region: usize,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let mut runs = Vec::new();
    for recv in URING_RUNS {
        runs.push(run_plain(plain(Some(region), recv), files)?);
    }
    let base = &runs[0];
    let row: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (r.gbps / base.gbps, r.cpu_per_gb / base.cpu_per_gb))
        .collect();
    let cells: Vec<String> = URING_RUNS
        .iter()
        .zip(&runs)
        .zip(&row)
        .skip(1)
        .map(|((recv, r), (g, c))| {
            format!(
                "{} {g:.3} ({:.3} Gbps, CPU s/GB {c:.2})",
                recv.label(),
                r.gbps
            )
        })
        .collect();
    outln!(
        "ratio to node-recv ({:.3} Gbps, {:.3} s/GB): {}",
        base.gbps,
        base.cpu_per_gb,
        cells.join("; ")
    );
    Ok(row)
}

pub(super) fn print_uring_medians(rows: &[Vec<(f64, f64)>]) {
    if rows.len() < 2 {
        return;
    }
    // Column 0: the node with io_uring over the node with recv; then the primitives.
    let labels = std::iter::once("shardwire io_uring/recv".to_string()).chain(
        URING_RUNS
            .iter()
            .skip(1)
            .map(|r| format!("{}/node-recv", r.label())),
    );
    for (k, label) in labels.enumerate() {
        let k = if k == 0 { 0 } else { k + 1 };
        let (goodput, _) = median(rows.iter().map(|r| r[k].0).collect());
        let (cpu, _) = median(rows.iter().map(|r| r[k].1).collect());
        outln!(
            "median {label} over {} rounds: goodput {goodput:.3}, CPU s/GB (threads) {cpu:.3}",
            rows.len()
        );
    }
}

/// The ways `--compare-crc` measures, the node's `recv` path first (the reference) and its
/// io_uring path second.
pub(super) const CRC_RUNS: [Way; 10] = [
    Way::InPlace { piece: 0 },
    Way::Queue { piece: 0, ahead: 0 },
    Way::InPlace { piece: 1 << 20 },
    Way::InPlace { piece: 256 << 10 },
    Way::Queue {
        piece: 128 << 10,
        ahead: 256 << 10,
    },
    Way::Queue {
        piece: 256 << 10,
        ahead: 1 << 20,
    },
    Way::Bounce {
        bounce: 256 << 10,
        copy: Onward::NonTemporal,
    },
    Way::Bounce {
        bounce: 256 << 10,
        copy: Onward::Plain,
    },
    Way::Bounce {
        bounce: 64 << 10,
        copy: Onward::Fused,
    },
    Way::Uring { cap: 0 },
];

/// One round of `--compare-crc`: each way into the region with CRC on; returns (goodput,
/// CPU s/GB of the threads) ratios to the node's `recv` path, in [`CRC_RUNS`] order.
pub(super) fn compare_crc(
    files: &[std::path::PathBuf],
    plain: &impl Fn(Option<usize>, tcp::Recv) -> tcp::TcpRun,
    region: usize,
    crcs: &[u32],
    ways: &[Way],
) -> anyhow::Result<Vec<(f64, f64)>> {
    let mut runs = Vec::new();
    for &way in ways {
        let check = Arc::new(tcp::CrcCheck {
            crcs: crcs.to_vec(),
            stats: Default::default(),
        });
        let r = run_checked(plain(Some(region), tcp::Recv::Crc(way)), files, &check)?;
        let s = &check.stats;
        outln!(
            "  {}: {} shards checked, {} CRC failures, median piece checksummed {}",
            way.label(),
            s.checked.load(Ordering::Relaxed),
            s.failures.load(Ordering::Relaxed),
            piece_range(s.median_piece())
        );
        anyhow::ensure!(
            s.failures.load(Ordering::Relaxed) == 0,
            "{}: CRC mismatches in a plain-TCP run (a bug in the way)",
            way.label()
        );
        runs.push(r);
    }
    let base = &runs[0];
    let row: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (r.gbps / base.gbps, r.cpu_per_gb / base.cpu_per_gb))
        .collect();
    let cells: Vec<String> = ways
        .iter()
        .zip(&runs)
        .zip(&row)
        .skip(1)
        .map(|((w, r), (g, c))| {
            format!("{} {g:.3} ({:.3} Gbps, CPU s/GB {c:.2})", w.label(), r.gbps)
        })
        .collect();
    outln!(
        "ratio to {} ({:.3} Gbps, {:.3} s/GB): {}",
        ways[0].label(),
        base.gbps,
        base.cpu_per_gb,
        cells.join("; ")
    );
    Ok(row)
}

/// The ways named in `only` (by label, in that order), or all of [`CRC_RUNS`]; an unknown
/// name is an error that lists the known ones.
pub(super) fn crc_ways(only: &[String]) -> anyhow::Result<Vec<Way>> {
    if only.is_empty() {
        return Ok(CRC_RUNS.to_vec());
    }
    only.iter()
        .map(|name| {
            CRC_RUNS
                .iter()
                .copied()
                .find(|w| w.label() == *name)
                .ok_or_else(|| {
                    let known: Vec<String> = CRC_RUNS.iter().map(|w| w.label()).collect();
                    anyhow::anyhow!("--crc-way {name}: not one of {}", known.join(", "))
                })
        })
        .collect()
}

/// The medians of [`compare_crc`]'s rows.
pub(super) fn print_crc_medians(rows: &[Vec<(f64, f64)>], ways: &[Way]) {
    if rows.len() < 2 {
        return;
    }
    for (k, way) in ways.iter().enumerate().skip(1) {
        let (goodput, _) = median(rows.iter().map(|r| r[k].0).collect());
        let (cpu, _) = median(rows.iter().map(|r| r[k].1).collect());
        outln!(
            "median {}/{} over {} rounds: goodput {goodput:.3}, CPU s/GB (threads) {cpu:.3}",
            way.label(),
            ways[0].label(),
            rows.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        // Before: the upper one (with --rounds 2, the better of two goodput ratios).
        assert_eq!(median(vec![3.0, 1.0]).0, 2.0);
        assert_eq!(median(vec![5.0, 1.0, 3.0]).0, 3.0);
        assert_eq!(
            median(vec![4.0, 1.0, 3.0, 2.0]),
            (2.5, vec![1.0, 2.0, 3.0, 4.0])
        );
    }
}
