//! shardwire's shared vocabulary, without any I/O.
//!
//! - [`wire`]: the control-connection messages between a node service and a shard source
//!   (length-prefixed, versioned, with hard limits on every length field);
//! - [`auth`]: the shared-secret challenge-response (HMAC-SHA256, no secret on the wire);
//! - [`manifest`]: the dataset manifest written by `shardwire index`;
//! - [`plan`]: the deterministic per-rank shard order (shard mode);
//! - [`samples`]: the sample-level order and every rank's batches (batch mode), with
//!   [`bijection`], the keyed permutation it shuffles blocks with;
//! - [`trainer`]: the messages of the trainer Unix socket;
//! - [`crc`]: CRC-32C, the integrity check used everywhere;
//! - [`warn_limit`]: at most one line per peer host and kind every 10 s for the warnings any
//!   peer can cause (the node's data port, the source's control port);
//! - `framing` (feature `io`): control frames on async streams (tokio);
//! - `fdpass` (feature `unix`): trainer frames with fds over a Unix socket.
//!
//! Everything but the two I/O features is pure: it is unit-tested, property-tested and shared
//! by the source, the node service, the clients and the tests.
#![forbid(unsafe_code)]

pub mod auth;
pub mod bijection;
pub mod crc;
#[cfg(feature = "unix")]
pub mod fdpass;
#[cfg(feature = "io")]
pub mod framing;
pub mod manifest;
pub mod plan;
pub mod samples;
pub mod trainer;
pub mod warn_limit;
pub mod wire;

pub use manifest::{DType, Manifest, ManifestError, ShardEntry, TensorEntry};
pub use wire::{DecodeError, ErrorCode, Message};
