//! `shardwire bench --lanes N`: the node with N host-memory lanes on loopback addresses
//! (127.0.0.1 .. 127.0.0.N, each its own data port, the source dialling `--flows` connections
//! to each) and N trainer threads, one stream each; the node places each stream on the least
//! loaded lane, so every lane carries one. Prints each lane's goodput to its trainer and the
//! bytes its data connections received, the total, and CPU seconds per GB by role.
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

/// Most lanes `--lanes` takes (loopback addresses 127.0.0.1..=127.0.0.N).
pub const MAX_LANES: u8 = 16;

/// One lane's figures over the measured interval.
struct LaneRun {
    lane: u32,
    delivered: u64,
    received: u64,
}

/// Opens `n` streams (the node places each on the least loaded lane), warmed up by one batch.
fn open_streams(lb: &Loopback, n: u8) -> anyhow::Result<Vec<(u32, Stream)>> {
    let node = &lb.node.handle.node;
    let mut out = Vec::new();
    for i in 0..n {
        let mut s = Stream::open(
            &lb.node.handle.socket,
            StreamOptions {
                epochs: 1_000_000,
                seed: u64::from(i),
                ..StreamOptions::new("bench")
            },
        )
        .context("opening a bench stream")?;
        if let Some(b) = s.next()? {
            s.release(b)?;
        }
        let lane = node
            .streams()
            .iter()
            .find(|x| x.id() == s.info.stream)
            .map_or(u32::MAX, |x| x.lane());
        out.push((lane, s));
    }
    Ok(out)
}

/// Bytes received per lane so far.
fn lane_bytes(lb: &Loopback) -> Vec<u64> {
    lb.node
        .handle
        .node
        .status()
        .lanes
        .iter()
        .map(|l| l.bytes_received)
        .collect()
}

/// The end of the trainers' window: its seconds, and the samples of all CPUs and of every
/// thread.
type EndSample = (f64, Vec<cpu::Jiffies>, cpu::ThreadTimes);

/// Where the trainers meet at the end of their window: the last to arrive takes the
/// [`EndSample`] while every trainer thread still runs (a thread that exited is gone from
/// /proc/self/task, and its CPU with it), and none goes on before that.
struct EndGate {
    /// Trainers yet to arrive, and the sample the last one took.
    state: Mutex<(usize, Option<EndSample>)>,
    all_in: Condvar,
}

impl EndGate {
    fn new(trainers: usize) -> Self {
        Self {
            state: Mutex::new((trainers, None)),
            all_in: Condvar::new(),
        }
    }

    /// `n` trainers are done (or never started): the last one in calls `sample`, and each
    /// caller waits for that.
    fn arrive(&self, n: usize, sample: impl FnOnce() -> EndSample) {
        let mut g = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        g.0 = g.0.saturating_sub(n);
        if g.0 == 0 && g.1.is_none() {
            g.1 = Some(sample());
            self.all_in.notify_all();
        }
        while g.1.is_none() {
            g = self.all_in.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn into_sample(self) -> Option<EndSample> {
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

/// Runs the trainers for `seconds`; returns (lane, bytes delivered) each, and the
/// [`EndSample`] taken before any trainer thread exited.
fn drive(
    streams: Vec<(u32, Stream)>,
    seconds: u64,
) -> anyhow::Result<(Vec<(u32, u64)>, EndSample)> {
    let t0 = Instant::now();
    let gate = EndGate::new(streams.len());
    let end = move || {
        (
            t0.elapsed().as_secs_f64(),
            cpu::cpu_times(),
            cpu::thread_times(),
        )
    };
    let per: Vec<anyhow::Result<(u32, u64)>> = std::thread::scope(|sc| {
        let gate = &gate;
        let spawned: Vec<_> = streams
            .into_iter()
            .map(|(lane, mut s)| {
                std::thread::Builder::new()
                    .name(format!("bench-trainer-{lane}"))
                    .spawn_scoped(sc, move || -> anyhow::Result<(u32, u64)> {
                        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            train(&mut s, t0, seconds)
                        }));
                        gate.arrive(1, end);
                        let delivered = r.map_err(|_| anyhow::anyhow!("a trainer panicked"))??;
                        Ok((lane, delivered)) // the stream goes now, after the end sample
                    })
                    .context("spawning a trainer thread")
            })
            .collect();
        let unstarted = spawned.iter().filter(|h| h.is_err()).count();
        if unstarted > 0 {
            gate.arrive(unstarted, end);
        }
        spawned
            .into_iter()
            .map(|h| -> anyhow::Result<(u32, u64)> {
                h?.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a trainer thread panicked")))
            })
            .collect()
    });
    let end = gate
        .into_sample()
        .context("the trainers' end sample was never taken")?;
    Ok((per.into_iter().collect::<anyhow::Result<_>>()?, end))
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
    println!("== Source {} -> lanes {}", lb.source_addr, addrs.join(" "));
    let streams = open_streams(&lb, n)?;
    let placed: Vec<u32> = streams.iter().map(|(l, _)| *l).collect();
    println!("streams on lanes {placed:?}");
    let received0 = lane_bytes(&lb);
    let (cpu0, threads0) = (cpu::cpu_times(), cpu::thread_times());
    let (per, (secs, cpu1, threads1)) = drive(streams, a.seconds)?;
    let received1 = lane_bytes(&lb);
    let crc = node.counters().crc_failures.load(Ordering::Relaxed);
    lb.stop();
    let runs: Vec<LaneRun> = per
        .iter()
        .map(|&(lane, delivered)| LaneRun {
            lane,
            delivered,
            received: received1.get(lane as usize).copied().unwrap_or(0)
                - received0.get(lane as usize).copied().unwrap_or(0),
        })
        .collect();
    for r in &runs {
        println!(
            "  lane {}: {:8.3} Gbps delivered to its trainer, {:8.3} Gbps received on its {} data connections",
            r.lane,
            gbps(r.delivered, secs),
            gbps(r.received, secs),
            a.flows
        );
    }
    let total: u64 = runs.iter().map(|r| r.delivered).sum();
    let busy = cpu::print_cpu(&cpu0, &cpu1);
    cpu::print_per_gb(&threads0, &threads1, total);
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    println!(
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
        let (gate, running) = (EndGate::new(3), AtomicUsize::new(2));
        let sample = || {
            let n = running.load(Ordering::SeqCst) as f64;
            (n, Vec::new(), cpu::ThreadTimes::new())
        };
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    gate.arrive(1, sample);
                    running.fetch_sub(1, Ordering::SeqCst);
                });
            }
            gate.arrive(1, sample);
        });
        // Before, the end sample came after the trainers were joined: none still ran.
        assert_eq!(gate.into_sample().map(|s| s.0), Some(2.0));
    }
}
