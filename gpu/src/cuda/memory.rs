//! A GPU opened for the service: its device (primary context), its loaded kernels and what
//! the probe said of it, after [`super::self_test`] passed.

use std::sync::Arc;

use super::{Device, Engines, self_test};
use crate::error::GpuError;
use crate::report::GpuDevice;

/// A device ready for stream regions: the device, its engines, and what the probe said.
#[derive(Debug)]
pub struct CudaMemory {
    /// The device (its primary context).
    pub device: Arc<Device>,
    /// The loaded kernels.
    pub engines: Engines,
    /// The probe's report for it.
    pub info: GpuDevice,
}

/// Opens `info`'s device, loads the kernels and runs [`self_test`].
pub fn open_for_service(info: &GpuDevice) -> Result<CudaMemory, GpuError> {
    let device = Device::open(info.ordinal)?;
    let engines = Engines::new(&device)?;
    self_test(&device, &engines, info.dma_buf_supported)?;
    Ok(CudaMemory {
        device,
        engines,
        info: info.clone(),
    })
}
