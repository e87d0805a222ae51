//! Memory for shards: regions shared with trainers, and the slab allocator over them.
//!
//! - [`region`]: a host-memory region (a sealed-size memfd mapped read-write here and
//!   read-only by trainers); CUDA regions join it behind the same interface later.
//! - [`slab`]: the allocator that carves a region into shard-sized slabs.
//!
//! Memory use is bounded by the regions the service creates, never by load.

pub mod region;
pub mod slab;

pub use region::{HostRegion, RegionError};
pub use slab::{Slab, SlabPool};
