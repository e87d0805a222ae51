//! The sample order's cost per batch: a batch's samples computed one at a time
//! (`BatchPlan::sample`) against together (`BatchPlan::batch_samples`), alternating in the
//! same run, on the loader benchmark's shape (262144 rows in shards of 4096, `block` shuffle of
//! 32768, batches of 256) unless told otherwise.
//!
//!     cargo run --release -p shardwire-protocol --example order_speed [BATCH] [SHUFFLE_BLOCK]
//!
//! Prints the median over 9 rounds of each way's microseconds per batch, and checks both
//! give the same samples.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use shardwire_protocol::samples::{BatchPlan, SampleOrder, SampleRef, Shuffle};

fn main() {
    let mut args = std::env::args().skip(1);
    let batch: u32 = args.next().map_or(256, |a| a.parse().expect("BATCH"));
    let block: u64 = args
        .next()
        .map_or(32768, |a| a.parse().expect("SHUFFLE_BLOCK"));
    let order = SampleOrder::new([7; 32], vec![4096; 64], 1, Shuffle::Block, block, 1)
        .expect("a valid order");
    let plan = BatchPlan::new(Arc::new(order), batch, 1, 0, true).expect("a valid plan");
    let ep = plan.order.epoch(0);
    let steps = plan.steps();
    let one = |s: u64| -> Vec<SampleRef> { (0..batch).map(|j| plan.sample(&ep, s, j)).collect() };
    for s in 0..steps {
        assert_eq!(one(s), plan.batch_samples(&ep, s), "step {s}");
    }
    let (mut alone, mut together) = (Vec::new(), Vec::new());
    for _ in 0..9 {
        let t = Instant::now();
        for s in 0..steps {
            black_box(one(s));
        }
        alone.push(t.elapsed().as_secs_f64() * 1e6 / steps as f64);
        let t = Instant::now();
        for s in 0..steps {
            black_box(plan.batch_samples(&ep, s));
        }
        together.push(t.elapsed().as_secs_f64() * 1e6 / steps as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b) = (median(&mut alone), median(&mut together));
    println!(
        "order of a batch of {batch} (shuffle_block {block}): one at a time {a:.1} us, together {b:.1} us ({:.2}x)",
        a / b
    );
}
