//! Memory for shards: regions shared with trainers, and the slab allocator over them.
//!
//! - [`region`]: [`Region`], host memory (a sealed-size memfd mapped read-write here and
//!   read-only by trainers) or a CUDA VMM region (trainers import its POSIX fd).
//! - [`slab`]: the allocator that carves a region into shard-sized slabs.
//! - [`kernels`]: the gather and CRC-32C kernels' embedded PTX, argument layouts and CPU
//!   reference; `cuda` (with the `cuda` feature): the driver types, VMM regions, the engines
//!   that launch the kernels, and the H2D staging path.
//! - [`probe`]: the CUDA capability probe and the host/CUDA memory decision. The `cuda`
//!   feature (on by default) loads `libcuda` at run time, so one binary builds and runs
//!   without CUDA and says why it chose host memory; without the feature `cuda` is a stub of
//!   the same names whose constructors all return "built without CUDA".
//!
//! Memory use is bounded by the regions the service creates, never by load.

mod error;
pub mod kernels;
pub mod probe;
pub mod region;
mod report;
pub mod slab;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
pub mod cuda;

pub use probe::{
    GpuDevice, GpuError, GpuProbe, MemoryChoice, MemoryDecision, choose_memory, probe_gpus,
};
pub use region::{HostRegion, Region, RegionError};
pub use slab::{Part, Slab, SlabPool};
