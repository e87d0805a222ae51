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
    #[error("a region of {len} bytes cannot be rounded up to the allocation granularity")]
    TooLarge {
        /// The length asked for.
        len: u64,
    },
    /// A region of another GPU than the engines' (their launches would fault that GPU).
    #[error("{what} is a region of GPU {region}; these engines run on GPU {engines}")]
    WrongDevice {
        /// Which argument.
        what: &'static str,
        /// The region's device ordinal.
        region: i32,
        /// The engines' device ordinal.
        engines: i32,
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
