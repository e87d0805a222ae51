//! A GPU opened for the service: its device (primary context), its loaded kernels and what
//! the probe said of it, after [`super::self_test`] passed, and whether its memory exports as
//! a dma-buf ([`super::selftest::check_dma_buf`]).

use std::sync::Arc;

use super::selftest::check_dma_buf;
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
    /// Why its memory cannot be exported as a dma-buf, if it cannot: then streams still land
    /// in it (pinned staging, a mapped host dma-buf), but no NIC queue can be bound to it.
    pub dma_buf_refused: Option<String>,
    /// Why its dma-bufs have the driver's default mapping, not the PCIe one a NIC reads
    /// through, if so and if that may matter (the driver refused the PCIe mapping type on a
    /// GPU that is cache-coherent with the CPU; on any other GPU the refusal is expected and
    /// the default mapping is PCIe: `None`).
    pub dma_buf_default_mapping: Option<String>,
    /// Every region on it is a multiple of these bytes ([`super::vmm::region_unit`]: 2 MiB,
    /// or the driver's granularity where larger): a stream's region takes its
    /// `stream_memory` rounded up to it.
    pub region_unit: u64,
}

/// Opens `info`'s device, loads the kernels, runs [`self_test`] and tries a dma-buf export.
pub fn open_for_service(info: &GpuDevice) -> Result<CudaMemory, GpuError> {
    let device = Device::open(info.ordinal)?;
    let engines = Engines::new(&device)?;
    self_test(&device, &engines)?;
    let dma_buf = check_dma_buf(&device, info.dma_buf_supported)?;
    let region_unit = super::vmm::region_unit(&device)? as u64;
    Ok(CudaMemory {
        device,
        engines,
        info: info.clone(),
        dma_buf_refused: dma_buf.refused,
        dma_buf_default_mapping: dma_buf.default_mapping,
        region_unit,
    })
}
