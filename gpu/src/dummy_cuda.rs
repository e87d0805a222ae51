//! The stand-in for `cuda.rs` when the crate is built without the `cuda` feature: the
//! probe reports "no CUDA support in this build" and touches no library.

use crate::report::GpuProbe;

/// Reports that this build cannot use CUDA.
pub(crate) fn probe_driver() -> GpuProbe {
    GpuProbe {
        driver_present: false,
        driver_version: None,
        devices: Vec::new(),
        usable: false,
        reason: "this build has no CUDA support (built without the `cuda` feature)".to_owned(),
    }
}
