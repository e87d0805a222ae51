//! `shardwire consume`: a trainer stand-in for users and scripts. Prints one line per batch
//! (JSON with `--jsonl`): epoch, index, shard, and per tensor its name, dtype, shape and the
//! CRC-32C of the bytes as received.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use shardwire_client::{Stream, StreamOptions};
use shardwire_protocol::crc::crc32c;
use shardwire_protocol::plan::Uneven;

/// Flags of `shardwire consume`.
#[derive(Args, Debug)]
pub struct ConsumeArgs {
    /// Trainer socket of the node service.
    #[arg(
        long,
        env = "SHARDWIRE_SOCKET",
        default_value = "/run/shardwire/trainer.sock"
    )]
    socket: PathBuf,
    /// Dataset name.
    #[arg(long)]
    dataset: String,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// This trainer's rank.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// Number of ranks.
    #[arg(long, default_value_t = 1)]
    world_size: u32,
    /// Epochs.
    #[arg(long, default_value_t = 1)]
    epochs: u32,
    /// Uneven-dataset policy: pad or drop.
    #[arg(long, default_value = "pad", value_parser = parse_uneven)]
    uneven: Uneven,
    /// Print one JSON object per line.
    #[arg(long)]
    jsonl: bool,
    /// Stop after this many batches (without releasing the last ones: a stalled trainer).
    #[arg(long)]
    limit: Option<u64>,
    /// Hold the stream open after `--limit` batches for this many seconds, without reading.
    #[arg(long, default_value_t = 0)]
    hold_secs: u64,
}

fn parse_uneven(s: &str) -> Result<Uneven, String> {
    match s {
        "pad" => Ok(Uneven::Pad),
        "drop" => Ok(Uneven::Drop),
        other => Err(format!("`{other}` is not pad or drop")),
    }
}

/// Runs the consumer.
pub fn run(a: ConsumeArgs) -> anyhow::Result<ExitCode> {
    let opts = StreamOptions {
        seed: a.seed,
        rank: a.rank,
        world_size: a.world_size,
        epochs: a.epochs,
        uneven: a.uneven,
        ..StreamOptions::new(&a.dataset)
    };
    let mut s = Stream::open(&a.socket, opts)
        .with_context(|| format!("opening a stream on {}", a.socket.display()))?;
    let out = std::io::stdout();
    let mut out = out.lock();
    let (mut n, mut bytes) = (0u64, 0u64);
    let started = std::time::Instant::now();
    let mut kept = Vec::new();
    while let Some(b) = s.next()? {
        let tensors: Vec<_> = b
            .tensors()
            .iter()
            .map(|t| {
                bytes += t.length;
                json!({"name": t.name, "dtype": t.dtype, "shape": t.shape, "crc32c": crc32c(b.bytes(t))})
            })
            .collect();
        if a.jsonl {
            writeln!(
                out,
                "{}",
                json!({"epoch": b.epoch, "index": b.index, "shard": b.shard, "tensors": tensors})
            )?;
        } else {
            writeln!(
                out,
                "epoch {} batch {} shard {}: {} tensors",
                b.epoch,
                b.index,
                b.shard,
                tensors.len()
            )?;
        }
        n += 1;
        if a.limit.is_some_and(|l| n >= l) {
            kept.push(b);
            out.flush()?;
            std::thread::sleep(std::time::Duration::from_secs(a.hold_secs));
            break;
        }
        s.release(b)?;
    }
    drop(kept);
    if !a.jsonl {
        let secs = started.elapsed().as_secs_f64();
        writeln!(
            out,
            "{n} batches, {bytes} tensor bytes in {secs:.2} s ({:.3} Gbit/s)",
            bytes as f64 * 8.0 / secs / 1e9
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
