//! Host memory the GPU reads directly: a page-locked registration
//! (`cuMemHostRegister(DEVICEMAP)`) of memory someone else owns, with its device address.
//! Used for the devmem emulator's dma-buf when the node has CUDA memory, so the gather
//! kernel reads the emulated frags over PCIe exactly as it reads a NIC-bound GPU dma-buf.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::check;
use super::device::Device;
use crate::error::GpuError;

/// A span of device-visible memory a kernel may read: its device address and length.
///
/// # Safety
///
/// Kernels read `device_ptr()..device_ptr() + len()` trusting it: an implementor promises
/// that this range is live device-visible memory for as long as the value is borrowed.
pub unsafe trait DeviceRange {
    /// Device address of byte 0.
    fn device_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The ordinal of the one GPU that may read it: engines of another GPU refuse it
    /// ([`GpuError::WrongDevice`]). `None` only for a range whose owner waits for every GPU
    /// of the process before it goes away.
    fn device_ordinal(&self) -> Option<i32> {
        None
    }
}

// SAFETY: the region's own mapping, live while it is borrowed (unmapped on Drop).
unsafe impl DeviceRange for super::VmmRegion {
    fn device_ptr(&self) -> u64 {
        super::VmmRegion::device_ptr(self)
    }
    fn len(&self) -> usize {
        super::VmmRegion::len(self)
    }
    fn device_ordinal(&self) -> Option<i32> {
        Some(self.device().ordinal())
    }
}

/// A registration of host memory with the GPU; unregistered on Drop.
///
/// Only the registering GPU's engines read it ([`DeviceRange::device_ordinal`] names that
/// GPU): Drop waits for that GPU's work alone before unregistering, so a kernel of another GPU
/// could still be reading the memory then.
#[derive(Debug)]
pub struct HostMapped {
    host: *mut u8,
    len: usize,
    device_ptr: u64,
    dev: Arc<Device>,
}

// SAFETY: holds addresses only; the registration is process-wide and the driver calls on it
// are thread-safe.
unsafe impl Send for HostMapped {}
// SAFETY: as above; `&self` only reads the addresses.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    /// Registers `len` bytes at `host` and maps them for `dev`.
    ///
    /// # Safety
    ///
    /// `host..host + len` must be a live, page-aligned mapping of this process that stays
    /// mapped until the returned value is dropped (keep its owner alive alongside).
    pub unsafe fn new(dev: &Arc<Device>, host: *mut u8, len: usize) -> Result<Self, GpuError> {
        dev.bind()?;
        // SAFETY: the caller guarantees a live mapping of `len` bytes at `host`.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(
                host.cast::<c_void>(),
                len,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        })?;
        // From here on Drop unregisters, also when the next call fails.
        let mut registered = Self {
            host,
            len,
            device_ptr: 0,
            dev: dev.clone(),
        };
        // SAFETY: `host` was just registered with DEVICEMAP; out-pointer live; flags 0.
        check("cuMemHostGetDevicePointer_v2", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut registered.device_ptr, host.cast(), 0)
        })?;
        Ok(registered)
    }
}

// SAFETY: the registration's device address and length, live until Drop unregisters it.
unsafe impl DeviceRange for HostMapped {
    fn device_ptr(&self) -> u64 {
        self.device_ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> Option<i32> {
        // The registering GPU alone: Drop synchronises only its context (before, `None` let
        // every GPU's engines read it, and one of them could still be reading at Drop).
        Some(self.dev.ordinal())
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: a plain driver call on the context just made current: work that may
            // still read the registered memory (a forgotten `Launched`) finishes first. Only
            // this device's engines read it (`device_ordinal`), so no other GPU's work does.
            let _ = unsafe { sys::cuCtxSynchronize() };
            // SAFETY: unregisters the registration made in `new`; no queued work reads it
            // any more (synchronised above).
            let _ = unsafe { sys::cuMemHostUnregister(self.host.cast()) };
        }
    }
}
