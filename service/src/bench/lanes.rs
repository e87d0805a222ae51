//! `shardwire bench --lanes N`: the node with N host-memory lanes on loopback addresses
//! (127.0.0.1 .. 127.0.0.N, each its own data port, the source dialling `--flows` connections
//! to each) and N trainer threads, one stream each; the node places each stream on the least
//! loaded lane, so every lane carries one. As the one-lane bench, every trainer first takes
//! batches for [`super::WARM_UP`]; the window starts when all have (each stream's fetch-ahead
//! at speed, none counting bytes it buffered while the others opened). Prints each lane's
//! goodput to its trainer and the bytes its data connections received, the total, and CPU
//! seconds per GB by role.
//!
//! On loopback every lane shares the same CPUs and memory bandwidth: the figures show what the
//! node's per-lane machinery costs and whether it scales with the cores there are, not what
//! NIC/GPU pairs do (each is limited by its own NIC there; scripts/gpu-check.sh).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use shardwire_client::{Stream, StreamOptions};

use super::BenchArgs;
use super::cpu;
use super::report::gbps;
use crate::demo::Loopback;
use crate::out::outln;

/// Most lanes `--lanes` takes (loopback addresses 127.0.0.1..=127.0.0.N).
pub const MAX_LANES: u8 = 16;

/// One lane's figures over the measured interval.
struct LaneRun {
    lane: u32,
    delivered: u64,
    received: u64,
}

/// Opens `n` streams (the node places each on the least loaded lane when it opens).
fn open_streams(lb: &Loopback, n: u8) -> anyhow::Result<Vec<(u32, Stream)>> {
    let node = &lb.node.handle.node;
    let mut out = Vec::new();
    for i in 0..n {
        let s = Stream::open(
            &lb.node.handle.socket,
            StreamOptions {
                epochs: 1_000_000,
                seed: u64::from(i),
                ..StreamOptions::new("bench")
            },
        )
        .context("opening a bench stream")?;
        let lane = node
            .streams()
            .iter()
            .find(|x| x.id() == s.info.stream)
            .map_or(u32::MAX, |x| x.lane());
        out.push((lane, s));
    }
    Ok(out)
}

/// The run at one end of the trainers' window: when, the bytes each lane had received, and
/// the times of all CPUs and of every thread.
struct Sample {
    at: Instant,
    received: Vec<u64>,
    cpus: Vec<cpu::Jiffies>,
    threads: cpu::ThreadTimes,
}

impl Sample {
    /// `node` and this process now.
    fn now(node: &shardwire_node::Node) -> Self {
        let received = node
            .status()
            .lanes
            .iter()
            .map(|l| l.bytes_received)
            .collect();
        Self {
            at: Instant::now(),
            received,
            cpus: cpu::cpu_times(),
            threads: cpu::thread_times(),
        }
    }
}

/// Where the trainers meet at one end of their window: the last to arrive takes the sample
/// while every trainer thread still runs (a thread that exited is gone from /proc/self/task,
/// and its CPU with it) and, at the start, before any has begun its window; none goes on
/// before that.
struct Gate<T> {
    /// Trainers yet to arrive, and the sample the last one took.
    state: Mutex<(usize, Option<T>)>,
    all_in: Condvar,
}

impl<T> Gate<T> {
    fn new(trainers: usize) -> Self {
        Self {
            state: Mutex::new((trainers, None)),
            all_in: Condvar::new(),
        }
    }

    /// `n` trainers are here (or never started): the last one in calls `sample`, and each
    /// caller waits for that, then gets `read` of the sample.
    fn arrive<R>(&self, n: usize, sample: impl FnOnce() -> T, read: impl FnOnce(&T) -> R) -> R {
        let mut g = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        g.0 = g.0.saturating_sub(n);
        if g.0 == 0 && g.1.is_none() {
            g.1 = Some(sample());
            self.all_in.notify_all();
        }
        loop {
            if let Some(taken) = &g.1 {
                return read(taken);
            }
            g = self.all_in.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn into_sample(self) -> Option<T> {
        self.state
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .1
    }
}

/// One trainer's loop on `s` until `seconds` after `t0`, each batch given back on the request
/// for the next ones (which the stream sends ahead of time); the bytes delivered.
pub(super) fn train(s: &mut Stream, t0: Instant, seconds: u64) -> anyhow::Result<u64> {
    let mut delivered = 0u64;
    let mut next = s.next()?;
    while let Some(b) = next {
        delivered += b.tensors().iter().map(|t| t.length).sum::<u64>();
        if t0.elapsed() >= Duration::from_secs(seconds) {
            break; // its lease goes with the stream
        }
        next = s.next_after(b)?;
    }
    Ok(delivered)
}

/// The gates at the start and the end of the trainers' window, and how to take a sample.
type Gates<'a> = (
    &'a Gate<Sample>,
    &'a Gate<Sample>,
    &'a (dyn Fn() -> Sample + Sync),
);

/// One trainer on `s`: warms it up for [`super::WARM_UP`], meets the others at the start of
/// the window, trains until `seconds` after it and meets them at its end (on an error or a
/// panic too, so that none waits for it); the stream goes after that.
fn trainer(
    lane: u32,
    mut s: Stream,
    seconds: u64,
    (start, end, sample): Gates<'_>,
) -> anyhow::Result<(u32, u64)> {
    let warmed = std::panic::catch_unwind(AssertUnwindSafe(|| super::warm_up(&mut s)));
    let t0 = start.arrive(1, sample, |x| x.at);
    let r = match warmed {
        Ok(Ok(())) => std::panic::catch_unwind(AssertUnwindSafe(|| train(&mut s, t0, seconds))),
        Ok(Err(e)) => Ok(Err(e.context("warming a bench stream up"))),
        Err(panic) => Err(panic),
    };
    end.arrive(1, sample, |_| ());
    let delivered = r.map_err(|_| anyhow::anyhow!("a trainer panicked"))??;
    Ok((lane, delivered))
}

/// What [`drive`] measured: (lane, bytes delivered in the window) each, and the window's start
/// and end samples.
type Driven = (Vec<(u32, u64)>, Sample, Sample);

/// Runs the trainers (each warmed up, then for `seconds` from when all were); returns (lane,
/// bytes delivered in the window) each, and the window's start and end samples, the end one
/// taken before any trainer thread exited.
fn drive(
    streams: Vec<(u32, Stream)>,
    seconds: u64,
    sample: &(dyn Fn() -> Sample + Sync),
) -> anyhow::Result<Driven> {
    let (start, end) = (Gate::new(streams.len()), Gate::new(streams.len()));
    let per: Vec<anyhow::Result<(u32, u64)>> = std::thread::scope(|sc| {
        let gates: Gates<'_> = (&start, &end, sample);
        let spawned: Vec<_> = streams
            .into_iter()
            .map(|(lane, s)| {
                std::thread::Builder::new()
                    .name(format!("bench-trainer-{lane}"))
                    .spawn_scoped(sc, move || trainer(lane, s, seconds, gates))
                    .context("spawning a trainer thread")
            })
            .collect();
        let unstarted = spawned.iter().filter(|h| h.is_err()).count();
        if unstarted > 0 {
            start.arrive(unstarted, sample, |_| ());
            end.arrive(unstarted, sample, |_| ());
        }
        spawned
            .into_iter()
            .map(|h| -> anyhow::Result<(u32, u64)> {
                h?.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a trainer thread panicked")))
            })
            .collect()
    });
    let never = |at: &str| anyhow::anyhow!("the trainers' {at} sample was never taken");
    let start = start.into_sample().ok_or_else(|| never("start"))?;
    let end = end.into_sample().ok_or_else(|| never("end"))?;
    Ok((per.into_iter().collect::<anyhow::Result<_>>()?, start, end))
}

/// Runs the lanes benchmark.
pub fn run(
    a: &BenchArgs,
    data: &std::path::Path,
    dir: &std::path::Path,
    stream_memory: u64,
    rate: u64,
) -> anyhow::Result<()> {
    let n = a.lanes;
    let lb = Loopback::start(
        "bench",
        data,
        dir.join("trainer.sock"),
        (a.flows, rate, n),
        stream_memory,
        (a.mode, a.io_uring),
    )?;
    let node = &lb.node.handle.node;
    let addrs: Vec<String> = node
        .status()
        .lanes
        .iter()
        .map(|l| l.data_addr.clone())
        .collect();
    outln!("== Source {} -> lanes {}", lb.source_addr, addrs.join(" "));
    let streams = open_streams(&lb, n)?;
    let placed: Vec<u32> = streams.iter().map(|(l, _)| *l).collect();
    outln!("streams on lanes {placed:?}");
    crate::out::check()?; // its reader gone (`| head`): stop before the measured run
    let (per, t0, t1) = drive(streams, a.seconds, &|| Sample::now(node))?;
    let secs = t1.at.saturating_duration_since(t0.at).as_secs_f64();
    let crc = node.counters().crc_failures.load(Ordering::Relaxed);
    lb.stop();
    let received = |s: &Sample, lane: u32| s.received.get(lane as usize).copied().unwrap_or(0);
    let runs: Vec<LaneRun> = per
        .iter()
        .map(|&(lane, delivered)| LaneRun {
            lane,
            delivered,
            received: received(&t1, lane).saturating_sub(received(&t0, lane)),
        })
        .collect();
    for r in &runs {
        outln!(
            "  lane {}: {:8.3} Gbps delivered to its trainer, {:8.3} Gbps received on its {} data connections",
            r.lane,
            gbps(r.delivered, secs),
            gbps(r.received, secs),
            a.flows
        );
    }
    let total: u64 = runs.iter().map(|r| r.delivered).sum();
    let busy = cpu::print_cpu(&t0.cpus, &t1.cpus);
    cpu::print_per_gb(&t0.threads, &t1.threads, total);
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    outln!(
        "shardwire lanes: {n} lanes, {:.3} Gbps delivered in total ({total} bytes in {secs:.2} s), all CPUs {:.3} busy s/GB, CRC failures: {crc}; {cores} CPUs on this host: lanes share them on loopback",
        gbps(total, secs),
        busy / (total as f64 / 1e9).max(1e-9)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn the_end_sample_is_taken_while_every_trainer_still_runs() {
        // Two trainers, each counting itself out once past the gate, and one that never
        // started (its count given back by the caller, as `drive` does).
        let (gate, running) = (Gate::new(3), AtomicUsize::new(2));
        let sample = || running.load(Ordering::SeqCst);
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    assert_eq!(gate.arrive(1, sample, |n| *n), 2, "every caller reads it");
                    running.fetch_sub(1, Ordering::SeqCst);
                });
            }
            gate.arrive(1, sample, |_| ());
        });
        // Before, the end sample came after the trainers were joined: none still ran.
        assert_eq!(gate.into_sample(), Some(2));
    }
}
