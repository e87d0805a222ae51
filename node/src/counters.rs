//! Counters of the data path: atomics bumped on the hot path and read by the admin front
//! (status and Prometheus), which never touches the data path's locks.
//!
//! Each node-wide counter is named once, in the [`counters!`] table below: its atomic field,
//! its name in `/v1/status` `counters`, its Prometheus family and label, and the family's
//! help. The macro makes [`Counters`], the [`CounterStatus`] snapshot and [`COUNTERS`] from
//! it, so the status document and the metrics cannot drift apart.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// How a counter's value is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// A count (bytes, shards, events).
    Count,
    /// Nanoseconds in the atomic, seconds in status and metrics.
    Seconds,
}

/// The label a counter's series carries in its family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Label {
    /// None.
    None,
    /// `mode`: the receive mode in effect (`host`, `devmem`, `devmem-sim`).
    Mode,
    /// A fixed `key="value"` (several counters share one family).
    Fixed(&'static str, &'static str),
}

/// One counter of the table.
#[derive(Debug, Clone, Copy)]
pub struct CounterDef {
    /// Its name in `/v1/status` `counters`.
    pub status: &'static str,
    /// Its Prometheus family.
    pub metric: &'static str,
    /// Its label in the family.
    pub label: Label,
    /// The family's help.
    pub help: &'static str,
    /// How it is shown.
    pub unit: Unit,
}

/// The Rust type of a status field of a unit.
macro_rules! status_type {
    (Count) => {
        u64
    };
    (Seconds) => {
        f64
    };
}

/// A status value from an atomic of a unit.
macro_rules! status_value {
    (Count, $a:expr) => {
        $a.load(Ordering::Relaxed)
    };
    (Seconds, $a:expr) => {
        $a.load(Ordering::Relaxed) as f64 / 1e9
    };
}

macro_rules! counters {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident => $status:ident: $unit:ident, $metric:literal, $label:expr, $help:expr;
    )*) => {
        /// Node-wide counters (also exported as Prometheus metrics; see [`COUNTERS`]).
        #[derive(Default, Debug)]
        pub struct Counters {
            $(
                $(#[doc = $doc])*
                pub $field: AtomicU64,
            )*
        }

        /// The counters as `/v1/status` shows them.
        #[derive(Debug, Clone, Serialize)]
        pub struct CounterStatus {
            $(
                $(#[doc = $doc])*
                pub $status: status_type!($unit),
            )*
        }

        /// Every counter: status name, metric family, label, help, unit.
        pub const COUNTERS: &[CounterDef] = &[$(
            CounterDef {
                status: stringify!($status),
                metric: $metric,
                label: $label,
                help: $help,
                unit: Unit::$unit,
            },
        )*];

        impl Counters {
            /// A snapshot for the status document.
            pub fn snapshot(&self) -> CounterStatus {
                CounterStatus {
                    $($status: status_value!($unit, self.$field),)*
                }
            }
        }

        impl CounterStatus {
            /// Each counter with its value (seconds as seconds), in [`COUNTERS`] order.
            pub fn values(&self) -> Vec<(&'static CounterDef, f64)> {
                let values = [$(self.$status as f64),*];
                COUNTERS.iter().zip(values).collect()
            }
        }
    };
}

/// The help of `shardwire_stall_seconds_total` (three counters, one family).
const STALL_HELP: &str = "Seconds spent stalled, by cause: network (a trainer waited for a batch that had not arrived), trainer (fetchers had work but no free memory), assembly (receivers verifying and assembling payloads)";
/// The help of `shardwire_data_connections_total` (two counters, one family).
const CONNECTIONS_HELP: &str =
    "Plain-TCP data connections by receive primitive (recv=\"io_uring\" or \"recv\")";

counters! {
    /// Payload bytes received and verified.
    bytes_received => bytes_received: Count, "shardwire_bytes_received_total", Label::Mode,
        "Payload bytes received and verified, by receive mode";
    /// Shards received and verified.
    shards_received => shards_received: Count, "shardwire_shards_received_total", Label::Mode,
        "Shards received and verified, by receive mode";
    /// Payloads whose CRC-32C did not match.
    crc_failures => crc_failures: Count, "shardwire_crc_failures_total", Label::None,
        "Payloads whose CRC-32C did not match the manifest (each is fetched again, never delivered)";
    /// FETCHes issued again after a failure.
    refetches => refetches: Count, "shardwire_refetches_total", Label::None,
        "FETCHes issued again after a failure";
    /// Times a batch-mode stream gave back prefetched shards for lack of a free block for its
    /// next batch or its shards.
    prefetch_given_back => prefetch_given_back: Count, "shardwire_prefetch_given_back_total", Label::None,
        "Times a batch-mode stream gave back shards it had prefetched because no free block of the region fit its next batch or the shards it reads (the region was fragmented; they are fetched again; a larger stream_memory avoids it)";
    /// Shards a batch-mode stream gave back and fetched again to take their slabs largest
    /// first.
    shards_repacked => shards_repacked: Count, "shardwire_shards_repacked_total", Label::None,
        "Shards a batch-mode stream gave back and fetched again to take the slabs of what its next batch reads largest first (the resident shards left no free block of a needed shard's class; a larger stream_memory avoids it)";
    /// Batches handed to trainers.
    batches_delivered => batches_delivered: Count, "shardwire_batches_delivered_total", Label::None,
        "Batches handed to trainers";
    /// Batches of `batch_size` samples assembled (batch mode).
    batches_assembled => batches_assembled: Count, "shardwire_batches_assembled_total", Label::None,
        "Batches of batch_size samples assembled from resident shards (batch mode)";
    /// Gather-kernel launches that assembled batches (CUDA memory: one per batch).
    batch_gather_launches => batch_gather_launches: Count, "shardwire_batch_gather_launches_total", Label::None,
        "Gather-kernel launches that assembled batches in CUDA memory (one per batch)";
    /// Time trainers waited in `next` for a batch that was not ready (network-bound).
    stall_network_ns => stall_network_seconds: Seconds, "shardwire_stall_seconds_total", Label::Fixed("cause", "network"),
        STALL_HELP;
    /// Time fetchers had shards to fetch but no free memory (trainer-bound).
    stall_trainer_ns => stall_trainer_seconds: Seconds, "shardwire_stall_seconds_total", Label::Fixed("cause", "trainer"),
        STALL_HELP;
    /// Time receivers spent verifying payloads and tasks assembling batches.
    assembly_ns => stall_assembly_seconds: Seconds, "shardwire_stall_seconds_total", Label::Fixed("cause", "assembly"),
        STALL_HELP;
    /// Times a receiver in CUDA memory mode waited for a pinned buffer whose H2D copy had not
    /// finished (the network waited on the GPU copy).
    staging_stalls => h2d_staging_stalls: Count, "shardwire_h2d_staging_stalls_total", Label::None,
        "Times a receiver waited for a pinned staging buffer whose host-to-GPU copy had not finished";
    /// Plain-TCP data connections into host memory received with io_uring multishot receive.
    io_uring_connections => data_connections_io_uring: Count, "shardwire_data_connections_total", Label::Fixed("recv", "io_uring"),
        CONNECTIONS_HELP;
    /// Plain-TCP data connections into host memory received with `recv` (`io_uring = false`,
    /// or io_uring could not be set up: the log says why). CUDA memory's staged connections
    /// are in neither count.
    recv_connections => data_connections_recv: Count, "shardwire_data_connections_total", Label::Fixed("recv", "recv"),
        CONNECTIONS_HELP;
}

/// Per-data-connection counters (for `shardwire bench`).
#[derive(Debug, Default)]
pub struct FlowStats {
    /// Bytes received on this flow.
    pub bytes: AtomicU64,
    /// Bytes checksummed on the CPU, by the log2 of the piece they landed in just before
    /// (how far the CRC reads behind the copy that placed them: small pieces are read from
    /// cache).
    pub crc_pieces: [AtomicU64; 32],
}

impl FlowStats {
    /// Counts `n` bytes checksummed right after landing in one piece.
    pub fn crc_piece(&self, n: usize) {
        let k = (usize::BITS - 1 - n.max(1).leading_zeros()) as usize;
        self.crc_pieces[k.min(31)].fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The lower bound `lo` of the power-of-two range `[lo, 2 lo)` of piece sizes that holds
    /// the median checksummed byte, over `flows` (at least half of the bytes landed in pieces
    /// below `2 lo`: judge by that bound, not `lo`); `None` when nothing was checksummed on the
    /// CPU.
    pub fn median_crc_piece<'a>(flows: impl IntoIterator<Item = &'a Self>) -> Option<usize> {
        let mut sum = [0u64; 32];
        for f in flows {
            for (s, a) in sum.iter_mut().zip(&f.crc_pieces) {
                *s += a.load(Ordering::Relaxed);
            }
        }
        let total: u64 = sum.iter().sum();
        let mut seen = 0;
        sum.iter()
            .position(|b| {
                seen += b;
                total > 0 && seen * 2 >= total
            })
            .map(|k| 1 << k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_crc_piece_weighs_bytes() {
        let (a, b) = (FlowStats::default(), FlowStats::default());
        assert_eq!(FlowStats::median_crc_piece([&a, &b]), None);
        for _ in 0..10 {
            a.crc_piece(4096); // 40 KiB in 4 KiB pieces
        }
        b.crc_piece(3 << 20); // 3 MiB in one piece
        assert_eq!(FlowStats::median_crc_piece([&a, &b]), Some(2 << 20));
        a.crc_piece(0);
        assert_eq!(a.crc_pieces[0].load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_snapshot_shows_each_counter_under_its_status_name() {
        let c = Counters::default();
        c.crc_failures.store(3, Ordering::Relaxed);
        c.stall_network_ns.store(1_500_000_000, Ordering::Relaxed);
        c.recv_connections.store(2, Ordering::Relaxed);
        let st = c.snapshot();
        let json = serde_json::to_value(&st).unwrap();
        assert_eq!(json["crc_failures"], 3);
        assert_eq!(json["stall_network_seconds"], 1.5);
        assert_eq!(json["data_connections_recv"], 2);
        let fields = json.as_object().unwrap();
        assert_eq!(fields.len(), COUNTERS.len());
        for (def, v) in st.values() {
            assert_eq!(json[def.status].as_f64(), Some(v), "{}", def.status);
            assert!(def.metric.starts_with("shardwire_") && def.metric.ends_with("_total"));
        }
    }
}
