//! Plan-scale benchmark (issue "Training batches", elastic resume): plans 10^9 samples over
//! 10^6 shards and resumes at pseudo-random positions, printing the plan's memory and the
//! time each resume takes (the order of one epoch, a rank's plan, its units and the first
//! batch's samples: what a node does when a trainer attaches with a saved state).
//!
//!     cargo run --release -p shardwire-protocol --example plan_scale [SHARDS] [ROWS_PER_SHARD]
//!
//! Prints one JSON line per resume and a summary; peak RSS is the process's VmHWM.

use std::sync::Arc;
use std::time::Instant;

use shardwire_protocol::samples::{BatchPlan, SampleOrder, Shuffle};

fn vm_hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let shards: usize = args
        .next()
        .map_or(1_000_000, |a| a.parse().expect("SHARDS"));
    let rows: u64 = args
        .next()
        .map_or(1000, |a| a.parse().expect("ROWS_PER_SHARD"));
    let base = vm_hwm_kib();
    let (batch, world, partitions, block) = (512u32, 8u32, 8u32, 16_000u64);
    let order = Arc::new(
        SampleOrder::new(
            [7; 32],
            vec![rows; shards],
            3,
            Shuffle::Block,
            block,
            partitions,
        )
        .expect("valid order"),
    );
    let mut worst = 0f64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..5 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = Instant::now();
        let epoch = (x % 100) as u32;
        let ep = order.epoch(epoch);
        let rank = (x >> 8) as u32 % world;
        let plan = BatchPlan::new(Arc::clone(&order), batch, world, rank, true).expect("plan");
        let units = plan.units(&ep);
        let step = (x >> 16) % plan.steps();
        let first: Vec<_> = (0..batch).map(|j| plan.sample(&ep, step, j)).collect();
        let secs = t.elapsed().as_secs_f64();
        worst = worst.max(secs);
        println!(
            "{{\"resume\": {i}, \"epoch\": {epoch}, \"rank\": {rank}, \"step\": {step}, \"units\": {}, \"first_shard\": {}, \"seconds\": {secs:.3}, \"plan_bytes\": {}}}",
            units.len(),
            first[0].shard,
            ep.table_bytes() + order.shard_samples().len() * 8,
        );
    }
    let peak_mib = (vm_hwm_kib().saturating_sub(base)) as f64 / 1024.0;
    println!(
        "plan_scale: {} samples over {shards} shards; worst resume {worst:.3} s; peak RSS above start {peak_mib:.1} MiB",
        order.total()
    );
}
