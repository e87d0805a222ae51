//! The crate's error type: every driver call, range and self-test failure, with the value
//! that was wrong. A leaf module: everything else in the crate uses it, it uses nothing.

/// Why GPU work (the probe, or the memory decision) failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A CUDA driver call returned an error status.
    #[cfg(feature = "cuda")]
    #[error("{call} failed: {result:?}")]
    Driver {
        /// Which driver call.
        call: &'static str,
        /// Its status code.
        result: cudarc::driver::sys::CUresult,
    },
    /// This build has no CUDA support.
    #[error("this build has no CUDA support (built without the `cuda` feature)")]
    NotBuilt,
    /// libcuda cannot be loaded.
    #[error("libcuda.so was not found (no NVIDIA driver on this host)")]
    NoDriver,
    /// A device range outside the region it names.
    #[error("bytes {offset}..{offset}+{len} lie outside a {size}-byte buffer")]
    OutOfRange {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The buffer's size.
        size: u64,
    },
    /// A region too large to round up to the allocation granularity.
    #[error(
        "a region of {len} bytes cannot be rounded up to the allocation granularity \
         ({granularity} bytes) and 2 MiB"
    )]
    TooLarge {
        /// The length asked for.
        len: u64,
        /// The driver's allocation granularity.
        granularity: u64,
    },
    /// A region of another GPU than the engines' or the stager's (their work would fault
    /// that GPU, or be refused).
    #[error("{what} is a region of GPU {region}; this work runs on GPU {engines}")]
    WrongDevice {
        /// Which argument.
        what: &'static str,
        /// The region's device ordinal.
        region: i32,
        /// The device ordinal of the engines (or the stager) asked.
        engines: i32,
    },
    /// A device-to-device copy whose source and destination bytes overlap in one region
    /// (`cuMemcpy*` on overlapping ranges is undefined).
    #[error(
        "copy source bytes {src_off}..{src_off}+{len} overlap destination bytes \
         {dst_off}..{dst_off}+{len} of the same region"
    )]
    OverlappingCopy {
        /// Start of the source range in the region.
        src_off: u64,
        /// Start of the destination range in the region.
        dst_off: u64,
        /// Bytes to copy.
        len: u64,
    },
    /// A staged piece longer than one pinned staging buffer.
    #[error(
        "a staged copy of {len} bytes (to offset {offset}) exceeds the {slot_len}-byte \
         staging buffer"
    )]
    ExceedsSlot {
        /// Where in the destination region the piece was to land.
        offset: u64,
        /// Its length.
        len: u64,
        /// Bytes per staging buffer.
        slot_len: u64,
    },
    /// The dma-buf export was refused with the PCIe mapping type and again with the
    /// driver's default mapping: both refusals.
    #[error(
        "the dma-buf export was refused with the PCIe mapping type ({pcie}) and with the \
         default mapping ({fallback})"
    )]
    DmaBufRefused {
        /// The refusal with the PCIe mapping type.
        pcie: Box<GpuError>,
        /// The refusal of the fallback, without the flag.
        fallback: Box<GpuError>,
    },
    /// The GPU self-test at start found a wrong result.
    #[error("GPU self-test failed: {what}")]
    SelfTest {
        /// What differed.
        what: String,
    },
    /// Bad kernel arguments (frags or spans).
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelArgError),
    /// `memory = "cuda"` was configured but this host has no usable CUDA GPU.
    #[error("memory = \"cuda\" was configured, but there is no usable CUDA GPU: {reason}")]
    CudaUnavailable {
        /// What is missing (the probe's reason).
        reason: String,
    },
}

/// Why a staged receive (`cuda::H2dStager::copy_from`) failed: the source, or the GPU.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Reading the source failed.
    #[error(transparent)]
    Io(std::io::Error),
    /// A CUDA call failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}
