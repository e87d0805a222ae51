//! Counters of the data path: atomics bumped on the hot path and read by the admin front
//! (status and Prometheus), which never touches the data path's locks.

use std::sync::atomic::AtomicU64;

/// Node-wide counters (also exported as Prometheus metrics).
#[derive(Default, Debug)]
pub struct Counters {
    /// Payload bytes received and verified.
    pub bytes_received: AtomicU64,
    /// Shards received and verified.
    pub shards_received: AtomicU64,
    /// Payloads whose CRC-32C did not match.
    pub crc_failures: AtomicU64,
    /// FETCHes issued again after a failure.
    pub refetches: AtomicU64,
    /// Batches handed to trainers.
    pub batches_delivered: AtomicU64,
    /// Batches of `batch_size` samples assembled (batch mode).
    pub batches_assembled: AtomicU64,
    /// Gather-kernel launches that assembled batches (CUDA memory: one per batch).
    pub batch_gather_launches: AtomicU64,
    /// Nanoseconds trainers waited in `next` for a batch that was not ready (network-bound).
    pub stall_network_ns: AtomicU64,
    /// Nanoseconds fetchers had shards to fetch but no free memory (trainer-bound).
    pub stall_trainer_ns: AtomicU64,
    /// Nanoseconds receivers spent verifying payloads (assembly).
    pub assembly_ns: AtomicU64,
    /// Times a receiver in CUDA memory mode waited for a pinned buffer whose H2D copy had
    /// not finished (the network waited on the GPU copy).
    pub staging_stalls: AtomicU64,
    /// Plain-TCP data connections into host memory received with io_uring
    /// ([`crate::uring_rx`]).
    pub io_uring_connections: AtomicU64,
    /// Plain-TCP data connections into host memory received with `recv`.
    pub recv_connections: AtomicU64,
}

/// Per-data-connection counters (for `shardwire bench`).
#[derive(Debug, Default)]
pub struct FlowStats {
    /// Bytes received on this flow.
    pub bytes: AtomicU64,
}
