//! The stand-in for [`cuda`](self) when the crate is built without the `cuda` feature: the
//! same names, so code above builds unchanged, but nothing can be made. Every constructor
//! returns [`GpuError::NotBuilt`], so no value of these types exists and their methods are
//! unreachable (each matches on an uninhabited field). The probe reports "no CUDA support in
//! this build" and touches no library.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::GpuError;
pub use crate::error::StageError;
use crate::kernels::{Frag, Span};
use crate::report::{GpuDevice, GpuProbe};

/// Reports that this build cannot use CUDA.
pub(crate) fn probe_driver() -> GpuProbe {
    GpuProbe {
        driver_present: false,
        driver_version: None,
        devices: Vec::new(),
        usable: false,
        reason: GpuError::NotBuilt.to_string(),
    }
}

/// No value: the types below hold one, so they cannot be constructed.
#[derive(Debug, Clone, Copy)]
enum Never {}

/// A CUDA device (never made in this build).
#[derive(Debug)]
pub struct Device(Never);

impl Device {
    /// Always [`GpuError::NotBuilt`].
    pub fn open(_ordinal: i32) -> Result<Arc<Self>, GpuError> {
        Err(GpuError::NotBuilt)
    }

    /// Unreachable.
    pub fn ordinal(&self) -> i32 {
        match self.0 {}
    }
}

/// A kernel launch's completion (never made in this build).
#[derive(Debug)]
pub struct Event(Never);

impl Event {
    /// Unreachable.
    pub fn wait(&self) -> Result<(), GpuError> {
        match self.0 {}
    }
}

/// A launch in flight (never made in this build).
#[derive(Debug)]
pub struct Launched<'a>(Never, std::marker::PhantomData<&'a ()>);

impl Launched<'_> {
    /// Unreachable.
    pub fn wait(&self) -> Result<(), GpuError> {
        match self.0 {}
    }
}

/// A VMM allocation (never made in this build).
#[derive(Debug)]
pub struct VmmRegion(Never);

impl VmmRegion {
    /// Always [`GpuError::NotBuilt`].
    pub fn new(_dev: &Arc<Device>, _len: usize) -> Result<Self, GpuError> {
        Err(GpuError::NotBuilt)
    }

    /// Unreachable.
    pub fn len(&self) -> usize {
        match self.0 {}
    }

    /// Unreachable.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }

    /// Unreachable.
    pub fn granularity(&self) -> usize {
        match self.0 {}
    }

    /// Unreachable.
    pub fn device(&self) -> &Arc<Device> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn export_fd(&self) -> Result<OwnedFd, GpuError> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn export_dmabuf(&self) -> Result<OwnedFd, GpuError> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn export_dmabuf_noting(&self) -> Result<(OwnedFd, Option<String>), GpuError> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn write(&self, _offset: usize, _bytes: &[u8]) -> Result<(), GpuError> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn read(&self, _offset: usize, _out: &mut [u8]) -> Result<(), GpuError> {
        match self.0 {}
    }
}

/// A span of device-visible memory a kernel may read.
///
/// # Safety
///
/// As in the CUDA build: the range is live device-visible memory while borrowed.
pub unsafe trait DeviceRange {
    /// Device address of byte 0.
    fn device_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: never made in this build.
unsafe impl DeviceRange for VmmRegion {
    fn device_ptr(&self) -> u64 {
        match self.0 {}
    }
    fn len(&self) -> usize {
        match self.0 {}
    }
}

/// Host memory registered with a GPU (never made in this build).
#[derive(Debug)]
pub struct HostMapped(Never);

impl HostMapped {
    /// Always [`GpuError::NotBuilt`].
    ///
    /// # Safety
    ///
    /// None needed here; the signature matches the CUDA build's.
    pub unsafe fn new(_dev: &Arc<Device>, _host: *mut u8, _len: usize) -> Result<Self, GpuError> {
        Err(GpuError::NotBuilt)
    }
}

// SAFETY: never made in this build.
unsafe impl DeviceRange for HostMapped {
    fn device_ptr(&self) -> u64 {
        match self.0 {}
    }
    fn len(&self) -> usize {
        match self.0 {}
    }
}

/// The gather and CRC kernels (never loaded in this build).
#[derive(Debug)]
pub struct Engines(Never);

impl Engines {
    /// Unreachable.
    pub fn gather<'a>(
        &self,
        _src: &'a dyn DeviceRange,
        _dst: &'a VmmRegion,
        _frags: &[Frag],
    ) -> Result<Launched<'a>, GpuError> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn crc32c(&self, _region: &VmmRegion, _spans: &[Span]) -> Result<Vec<u32>, GpuError> {
        match self.0 {}
    }
}

/// Pinned staging buffers (never made in this build).
#[derive(Debug)]
pub struct H2dStager(Never);

impl H2dStager {
    /// Always [`GpuError::NotBuilt`].
    pub fn new(_dev: &Arc<Device>, _slot_len: usize, _slots: usize) -> Result<Self, GpuError> {
        Err(GpuError::NotBuilt)
    }

    /// Unreachable.
    pub fn device(&self) -> &Arc<Device> {
        match self.0 {}
    }

    /// Unreachable.
    pub fn stalls(&self) -> u64 {
        match self.0 {}
    }

    /// Unreachable.
    pub fn copy_from(
        &mut self,
        _src: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>,
        _seen: &mut dyn FnMut(&[u8]),
        _dst: &VmmRegion,
        _offset: usize,
        _len: usize,
    ) -> Result<(), StageError> {
        match self.0 {}
    }
}

/// A GPU opened for the service (never made in this build).
#[derive(Debug)]
pub struct CudaMemory {
    /// The device.
    pub device: Arc<Device>,
    /// The kernels.
    pub engines: Engines,
    /// The probe's report.
    pub info: GpuDevice,
    /// Why its memory cannot be exported as a dma-buf, if it cannot.
    pub dma_buf_refused: Option<String>,
    /// Why its dma-bufs have the driver's default mapping, if so and if that may matter.
    pub dma_buf_default_mapping: Option<String>,
    /// Every region on it is a multiple of these bytes.
    pub region_unit: u64,
}

/// Always [`GpuError::NotBuilt`].
pub fn open_for_service(_info: &GpuDevice) -> Result<CudaMemory, GpuError> {
    Err(GpuError::NotBuilt)
}
