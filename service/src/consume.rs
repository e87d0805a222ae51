//! `shardwire consume`: a trainer stand-in for users and scripts. Prints one line per batch
//! (JSON with `--jsonl`): epoch, index, shard (null in batch mode), and per tensor its name,
//! dtype, shape and the CRC-32C of the bytes as received (`--print-values NAME` adds the
//! values of an integer tensor); `--print-state` ends with a line `{"state": ...}` that
//! resumes where it stopped (`--state`). The state goes through whole, as a [`ResumeState`]:
//! fields this build does not know (a newer node's) are printed and sent back as they came.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use shardwire_client::{Batch, ResumeState, Stream, StreamOptions};
use shardwire_protocol::crc::crc32c;
use shardwire_protocol::plan::Uneven;
use shardwire_protocol::samples::Shuffle;
use shardwire_protocol::trainer::{MixEntry, WindowOrder};

use crate::out::outln;

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
    #[arg(long, required_unless_present = "mix", conflicts_with = "mix")]
    dataset: Option<String>,
    /// A mixture instead of one dataset: `NAME=WEIGHT,...` (e.g. `web=0.7,code=0.3`; batch mode).
    #[arg(long, value_parser = parse_mix)]
    mix: Option<MixArg>,
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
    /// Samples per batch: batch mode (default: one shard per batch).
    #[arg(long)]
    batch_size: Option<u32>,
    /// Batch mode order: block (default), shards or none (needs --batch-size: shard mode
    /// shuffles shards by --seed and refuses it).
    #[arg(long, value_parser = parse_shuffle)]
    shuffle: Option<Shuffle>,
    /// Batch mode: samples per shuffle block (needs --batch-size).
    #[arg(long)]
    shuffle_block: Option<u64>,
    /// Batch mode: canonical partitions (default: the world size; needs --batch-size).
    #[arg(long)]
    partitions: Option<u32>,
    /// Batch mode: drop the last partial global batch (needs --batch-size).
    #[arg(long)]
    drop_last: bool,
    /// Token mode: windows of SEQ_LEN + 1 tokens (needs --batch-size).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Token mode: the documents' tensor, when the dataset has several ragged integer ones.
    #[arg(long)]
    tokens_column: Option<String>,
    /// Token mode: deliver tokens as int32 or int64.
    #[arg(long, value_parser = parse_token_dtype)]
    token_dtype: Option<shardwire_protocol::DType>,
    /// Token mode: also deliver `positions`.
    #[arg(long)]
    boundaries: bool,
    /// Token mode: window order, shardwire (default) or megatron (GPTDataset's).
    #[arg(long, value_parser = parse_order)]
    order: Option<WindowOrder>,
    /// Resume from this state (the JSON of a `{"state": ...}` line or of `state_dict()`).
    #[arg(long)]
    state: Option<String>,
    /// The GPU to be served on (its lane): a PCI bus id (`0000:19:00.0`) or a GPU UUID.
    /// Default: none (the node's least loaded lane). This client maps host regions only.
    #[arg(long)]
    device: Option<String>,
    /// Also print the values of this integer tensor per batch (repeatable).
    #[arg(long = "print-values")]
    print_values: Vec<String>,
    /// Print one JSON object per line.
    #[arg(long)]
    jsonl: bool,
    /// At the end print `{"state": ...}`, the state that resumes after the last batch taken.
    #[arg(long)]
    print_state: bool,
    /// Stop after this many batches (without releasing the last ones: a stalled trainer); at
    /// least 1.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    limit: Option<u64>,
    /// Hold the stream open after `--limit` batches for this many seconds, without reading.
    #[arg(long, default_value_t = 0, requires = "limit")]
    hold_secs: u64,
}

fn parse_shuffle(s: &str) -> Result<Shuffle, String> {
    match s {
        "none" => Ok(Shuffle::None),
        "shards" => Ok(Shuffle::Shards),
        "block" => Ok(Shuffle::Block),
        other => Err(format!("`{other}` is not none, shards or block")),
    }
}

/// The integer values of a tensor as JSON numbers (None for non-integer dtypes).
fn values(t: &shardwire_protocol::trainer::TensorView, bytes: &[u8]) -> Option<Vec<i128>> {
    use shardwire_protocol::DType as D;
    let width = match t.dtype {
        D::Int8 | D::Uint8 => 1,
        D::Int16 | D::Uint16 => 2,
        D::Int32 | D::Uint32 => 4,
        D::Int64 | D::Uint64 => 8,
        _ => return None,
    };
    let signed = matches!(t.dtype, D::Int8 | D::Int16 | D::Int32 | D::Int64);
    Some(
        bytes
            .chunks_exact(width)
            .map(|c| {
                let mut b = [0u8; 16];
                b[..width].copy_from_slice(c);
                if signed && c[width - 1] & 0x80 != 0 {
                    b[width..].fill(0xff);
                }
                i128::from_le_bytes(b)
            })
            .collect(),
    )
}

/// The datasets and weights of `--mix`.
#[derive(Clone, Debug)]
struct MixArg(Vec<MixEntry>);

/// `--mix web=0.7,code=0.3`.
fn parse_mix(s: &str) -> Result<MixArg, String> {
    s.split(',')
        .map(|part| {
            let (name, w) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not NAME=WEIGHT"))?;
            let weight: f64 = w
                .parse()
                .map_err(|_| format!("weight `{w}` of `{name}` is not a number"))?;
            Ok(MixEntry {
                dataset: name.to_owned(),
                weight,
            })
        })
        .collect::<Result<_, _>>()
        .map(MixArg)
}

fn parse_token_dtype(s: &str) -> Result<shardwire_protocol::DType, String> {
    match s {
        "int32" => Ok(shardwire_protocol::DType::Int32),
        "int64" => Ok(shardwire_protocol::DType::Int64),
        other => Err(format!("`{other}` is not int32 or int64")),
    }
}

fn parse_order(s: &str) -> Result<WindowOrder, String> {
    match s {
        "shardwire" => Ok(WindowOrder::Shardwire),
        "megatron" => Ok(WindowOrder::Megatron),
        other => Err(format!("`{other}` is not shardwire or megatron")),
    }
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
    let mut s = open_stream(&a)?;
    let (mut n, mut bytes) = (0u64, 0u64);
    let mut window = Window::start();
    let mut kept = Vec::new();
    while let Some(b) = s.next()? {
        let tensors = describe(&b, &a.print_values, &mut bytes);
        outln!("{}", batch_line(&b, &tensors, a.jsonl));
        // A reader that went away (`| head -5`) ends the stream here (`crate::out`).
        crate::out::check()?;
        n += 1;
        if a.limit.is_some_and(|l| n >= l) {
            window.end();
            kept.push(b);
            std::thread::sleep(std::time::Duration::from_secs(a.hold_secs));
            break;
        }
        s.release(b)?;
    }
    window.end();
    if a.print_state {
        outln!("{}", state_line(&s.resume_state()?));
    }
    drop(kept);
    if !a.jsonl {
        let secs = window.secs();
        outln!(
            "{n} batches, {bytes} tensor bytes in {secs:.2} s ({:.3} Gbit/s)",
            bytes as f64 * 8.0 / secs / 1e9
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The time the summary line's throughput is over: from the start until the last batch came,
/// so that a `--hold-secs` pause after it is not counted.
struct Window {
    started: std::time::Instant,
    ended: Option<std::time::Duration>,
}

impl Window {
    fn start() -> Self {
        Self {
            started: std::time::Instant::now(),
            ended: None,
        }
    }

    /// Ends the window now, unless it has ended already.
    fn end(&mut self) {
        let started = self.started;
        self.ended.get_or_insert_with(|| started.elapsed());
    }

    /// The window's length in seconds (up to now while it has not ended).
    fn secs(&self) -> f64 {
        self.ended
            .unwrap_or_else(|| self.started.elapsed())
            .as_secs_f64()
    }
}

/// Opens the stream the arguments ask for, from `--state` when given (with `open_from`, which
/// sends the state's fields this build does not know back to the node as they came).
fn open_stream(a: &ConsumeArgs) -> anyhow::Result<Stream> {
    let from = a.state.as_deref().map(parse_state).transpose()?;
    let o = options(a);
    match &from {
        Some(state) => Stream::open_from(&a.socket, o, state),
        None => Stream::open(&a.socket, o),
    }
    .with_context(|| format!("opening a stream on {}", a.socket.display()))
}

/// What was wrong with `--state`.
#[derive(Debug, thiserror::Error)]
enum StateArgError {
    /// Not JSON at all.
    #[error(
        "--state is not JSON: {source} (give the `{{\"state\": ...}}` line `--print-state` \
         printed, or the state in it)"
    )]
    NotJson { source: serde_json::Error },
    /// JSON, but not a resume state (a known field missing, of the wrong type, given twice).
    #[error(
        "--state is not a stream state: {source} (give the `{{\"state\": ...}}` line \
         `--print-state` printed, or the state in it, unchanged)"
    )]
    NotAState { source: serde_json::Error },
}

/// `--state`: a resume state, or an object with one under `state` (as `--print-state` prints
/// it). Fields this build does not know are kept, each value as it came, to go back to the
/// node; the known ones are checked, and one that is wrong is named.
fn parse_state(text: &str) -> Result<ResumeState, StateArgError> {
    /// The `--print-state` line: decoded straight from the text (not through a `Value`,
    /// which would rewrite the unknown fields' values).
    #[derive(serde::Deserialize)]
    struct Wrapped {
        state: ResumeState,
    }
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|source| StateArgError::NotJson { source })?;
    let parsed = if v.get("state").is_some() {
        serde_json::from_str::<Wrapped>(text).map(|w| w.state)
    } else {
        ResumeState::from_json(text)
    };
    parsed.map_err(|source| StateArgError::NotAState { source })
}

/// The `--print-state` line, `{"state": ...}`: the state whole, fields this build does not know
/// included, as the node wrote them.
fn state_line(state: &ResumeState) -> String {
    format!("{{\"state\":{}}}", state.to_json())
}

/// The stream options the arguments ask for, without a state: `--state` goes to
/// [`Stream::open_from`], which sets the options' state from it.
fn options(a: &ConsumeArgs) -> StreamOptions {
    StreamOptions {
        seed: a.seed,
        rank: a.rank,
        world_size: a.world_size,
        epochs: a.epochs,
        uneven: a.uneven,
        batch_size: a.batch_size,
        shuffle: a.shuffle,
        shuffle_block: a.shuffle_block,
        partitions: a.partitions,
        drop_last: a.drop_last,
        seq_len: a.seq_len,
        tokens_column: a.tokens_column.clone(),
        token_dtype: a.token_dtype,
        boundaries: a.boundaries,
        order: a.order,
        mix: a.mix.as_ref().map(|m| m.0.clone()),
        device: a.device.clone(),
        ..StreamOptions::new(a.dataset.clone().unwrap_or_default())
    }
}

/// Each tensor of `b` as JSON (name, dtype, shape, CRC-32C; its values when asked for), adding
/// their lengths to `bytes`.
fn describe(b: &Batch, print_values: &[String], bytes: &mut u64) -> Vec<serde_json::Value> {
    b.tensors()
        .iter()
        .map(|t| {
            *bytes += t.length;
            let mut v = json!({"name": t.name, "dtype": t.dtype, "shape": t.shape, "crc32c": crc32c(b.bytes(t))});
            if print_values.contains(&t.name) {
                v["values"] = json!(values(t, b.bytes(t)));
            }
            v
        })
        .collect()
}

/// The line for batch `b` (without its newline): JSON (`--jsonl`) or a summary.
fn batch_line(b: &Batch, tensors: &[serde_json::Value], jsonl: bool) -> String {
    let shard = (b.shard != u32::MAX).then_some(b.shard);
    if jsonl {
        json!({"epoch": b.epoch, "index": b.index, "shard": shard, "tensors": tensors}).to_string()
    } else {
        let shard = shard.map_or("-".to_string(), |s| s.to_string());
        format!(
            "epoch {} batch {} shard {shard}: {} tensors",
            b.epoch,
            b.index,
            tensors.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_throughput_window_ends_with_the_last_batch_not_the_hold() {
        // Before: the summary divided by the time including `--hold-secs`.
        let mut w = Window::start();
        w.end();
        std::thread::sleep(std::time::Duration::from_millis(200));
        w.end(); // after the loop: the window stays ended where the limit ended it
        assert!(w.secs() < 0.2, "{} s", w.secs());
    }

    /// A newer node's state: `added` (with a value JSON would rewrite: `1.10`) is a field this
    /// build does not know.
    const NEWER: &str = r#"{"epoch":1,"index":7,"seed":3,"fingerprint":"f","added":[1.10,2]}"#;

    #[test]
    fn a_state_is_taken_bare_or_wrapped_its_unknown_fields_kept() {
        // Before, `--state` was read into a StreamState, which refuses a field it does not know.
        let wrapped = format!(r#"{{"state": {NEWER}}}"#);
        for text in [NEWER, wrapped.as_str()] {
            let st = parse_state(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((st.known().epoch, st.known().index), (1, 7), "{text}");
            assert_eq!(st.unknown_fields(), ["added"], "{text}");
            assert!(
                st.to_json().contains(r#""added":[1.10,2]"#),
                "{}",
                st.to_json()
            );
        }
        // What `--print-state` prints is what `--state` takes back, whole.
        let st = parse_state(NEWER).unwrap();
        let line = state_line(&st);
        assert!(line.starts_with(r#"{"state":{"#), "{line}");
        assert_eq!(parse_state(&line).unwrap(), st);
    }

    #[test]
    fn a_bad_state_is_refused_naming_what_was_wrong() {
        let e = parse_state("{epoch").unwrap_err();
        assert!(matches!(e, StateArgError::NotJson { .. }), "{e}");
        assert!(e.to_string().starts_with("--state is not JSON: "), "{e}");
        let bad = r#"{"epoch":0,"index":"x","seed":0,"fingerprint":"f","added":1}"#;
        for text in [bad.to_string(), format!(r#"{{"state":{bad}}}"#)] {
            let e = parse_state(&text).unwrap_err();
            assert!(matches!(e, StateArgError::NotAState { .. }), "{e}");
            let msg = e.to_string();
            assert!(
                msg.starts_with("--state is not a stream state: ") && msg.contains("`index`"),
                "{msg}"
            );
        }
    }
}
