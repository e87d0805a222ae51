//! CUDA regions: VMM allocations (`cuMemCreate`) that a NIC can write (exported as a
//! dma-buf) and trainers can import (exported as a POSIX fd), mapped read-write here.
//!
//! The allocation asks for a POSIX-fd shareable handle and `gpuDirectRDMACapable`, and its
//! size is rounded up to the device's allocation granularity (and to 2 MiB, the alignment
//! NIC drivers expect of GPU memory). Three owning pieces unwind in reverse order on Drop or
//! on a failed step: the mapping, the address reservation, the physical allocation.

use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::check;
use super::device::{Device, copy_to_device, copy_to_host};
use crate::error::GpuError;

/// Regions are multiples of this (and of the driver's granularity): GPU memory that NICs
/// map is handled in 2 MiB pages.
pub const REGION_ALIGN: usize = 2 << 20;

struct Allocation(sys::CUmemGenericAllocationHandle);
impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuMemCreate; mappings keep their own reference.
        let _ = unsafe { sys::cuMemRelease(self.0) };
    }
}

struct Reservation(sys::CUdeviceptr, usize);
impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: frees exactly the range reserved; it is unmapped first (field order).
        let _ = unsafe { sys::cuMemAddressFree(self.0, self.1) };
    }
}

struct Mapping(sys::CUdeviceptr, usize);
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range mapped in `VmmRegion::new`.
        let _ = unsafe { sys::cuMemUnmap(self.0, self.1) };
    }
}

/// A shareable device-memory region.
pub struct VmmRegion {
    // Drop order = field order: unmap, free the range, release the memory, then the device.
    mapping: Mapping,
    _reservation: Reservation,
    allocation: Allocation,
    granularity: usize,
    dev: Arc<Device>,
}

// SAFETY: the region is device memory named by integers (address, handle); access goes
// through driver calls and kernels, and slabs over it are disjoint by construction.
unsafe impl Send for VmmRegion {}
// SAFETY: as above; `&self` methods only read the handles or copy into caller-named ranges.
unsafe impl Sync for VmmRegion {}

impl Drop for VmmRegion {
    fn drop(&mut self) {
        // The fields' Drops (unmap, free the range) need the device's context current on
        // this thread, which need not be the thread that made the region: a stream's region
        // goes with its last user (a tokio worker, a receiver thread).
        if self.dev.bind().is_ok() {
            // Work that may still read or write the region finishes first: a `Launched`
            // forgotten (`mem::forget`) ends its borrow without waiting for its kernel.
            // SAFETY: a plain driver call on the context just made current.
            let _ = unsafe { sys::cuCtxSynchronize() };
        }
    }
}

impl std::fmt::Debug for VmmRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmRegion")
            .field("device", &self.dev.ordinal())
            .field("ptr", &format_args!("{:#x}", self.mapping.0))
            .field("len", &self.mapping.1)
            .finish()
    }
}

fn allocation_prop(dev: &Device) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
    // "no options" value; the fields that matter are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev.raw();
    prop.allocFlags.gpuDirectRDMACapable = 1;
    prop
}

/// Rounds `len` up to a multiple of `granularity` and [`REGION_ALIGN`]; `None` past the
/// address space.
pub fn region_size(len: usize, granularity: usize) -> Option<usize> {
    let g = granularity.max(1);
    let unit = if REGION_ALIGN.is_multiple_of(g) {
        REGION_ALIGN
    } else {
        // Granularity is a power of two in practice; stay correct if it is not.
        (g / gcd(g, REGION_ALIGN)).checked_mul(REGION_ALIGN)?
    };
    len.max(1).div_ceil(unit).checked_mul(unit)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The driver's minimum allocation granularity for regions on `dev` (bound by the caller).
fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize, GpuError> {
    let mut granularity = 0usize;
    // SAFETY: `prop` is a valid, fully initialised property struct; out-pointer live.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granularity)
}

/// What every region on `dev` is a multiple of: [`region_size`] of 1 byte, the bytes a
/// region of up to that many takes (the node reserves its pools in these).
pub fn region_unit(dev: &Arc<Device>) -> Result<usize, GpuError> {
    dev.bind()?;
    unit_for(granularity(&allocation_prop(dev))?)
}

/// [`region_size`] of 1 byte at `granularity`; [`GpuError::TooLarge`] names the byte asked
/// for and the granularity that made it too large.
fn unit_for(granularity: usize) -> Result<usize, GpuError> {
    region_size(1, granularity).ok_or(GpuError::TooLarge {
        len: 1,
        granularity: granularity as u64,
    })
}

impl VmmRegion {
    /// Allocates at least `len` bytes on `dev`, mapped read-write for this device.
    pub fn new(dev: &Arc<Device>, len: usize) -> Result<Self, GpuError> {
        dev.bind()?;
        let prop = allocation_prop(dev);
        let granularity = granularity(&prop)?;
        let size = region_size(len, granularity).ok_or(GpuError::TooLarge {
            len: len as u64,
            granularity: granularity as u64,
        })?;

        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid prop, size a multiple of the granularity, out-pointer live.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        let allocation = Allocation(handle);

        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: reserves a fresh VA range (no fixed address, no flags); out-pointer live.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, REGION_ALIGN.max(granularity), 0, 0)
        })?;
        let reservation = Reservation(ptr, size);

        // SAFETY: maps the whole allocation at offset 0 into the whole reserved range.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        })?;
        let mapping = Mapping(ptr, size);

        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one valid descriptor is passed with count 1.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        })?;
        Ok(Self {
            mapping,
            _reservation: reservation,
            allocation,
            granularity,
            dev: dev.clone(),
        })
    }

    /// Device address of byte 0.
    pub fn device_ptr(&self) -> u64 {
        self.mapping.0
    }

    /// Size in bytes (a multiple of the granularity).
    pub fn len(&self) -> usize {
        self.mapping.1
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The allocation granularity the region was created with.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The device holding the region.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// A new POSIX fd for the allocation, for a trainer to import
    /// (`cuMemImportFromShareableHandle` + map + set access).
    pub fn export_fd(&self) -> Result<OwnedFd, GpuError> {
        self.dev.bind()?;
        let mut fd: c_int = -1;
        // SAFETY: for the POSIX-fd handle type the driver writes an int through the
        // pointer; `fd` is a live local of that type.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                self.allocation.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: on success the driver returned a new fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A dma-buf fd over the whole region, for binding to NIC receive queues. Asks for the
    /// PCIe mapping type (what devmem NICs need) and falls back to the default mapping on a
    /// driver that refuses the flag (`CUDA_ERROR_INVALID_VALUE` from a driver that predates
    /// it, `CUDA_ERROR_NOT_SUPPORTED` from one on a platform without it); when that is
    /// refused too, [`GpuError::DmaBufRefused`] carries both refusals.
    /// On a host-coherent GPU (Grace Hopper, Grace Blackwell), whose default mapping is C2C,
    /// which a NIC may not reach, the fallback is a warning naming the refusal; elsewhere it
    /// is expected and only logged at debug (see [`VmmRegion::export_dmabuf_noting`]).
    pub fn export_dmabuf(&self) -> Result<OwnedFd, GpuError> {
        let (fd, refused) = self.export_dmabuf_noting()?;
        if let Some(why) = refused {
            tracing::warn!("{why}");
        }
        Ok(fd)
    }

    /// [`VmmRegion::export_dmabuf`], without the warning: the fd, and why it has the
    /// driver's default mapping where the PCIe mapping type was refused on a host-coherent
    /// GPU. Drivers refuse the flag for every GPU that is not cache-coherent with the CPU
    /// (`NOT_SUPPORTED`: every PCIe-attached GPU, x86 hosts included), whose default mapping
    /// is PCIe (BAR1) already: there the refusal is logged at debug and noted as `None`.
    pub fn export_dmabuf_noting(&self) -> Result<(OwnedFd, Option<String>), GpuError> {
        self.dev.bind()?;
        let pcie = sys::CUmemRangeFlags::CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE as u64;
        match self.dmabuf_with(pcie) {
            Err(
                e @ GpuError::Driver {
                    result:
                        sys::CUresult::CUDA_ERROR_INVALID_VALUE
                        | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
                    ..
                },
            ) => match self.dmabuf_with(0) {
                Ok(fd) => Ok((fd, self.default_mapping_note(&e))),
                Err(fallback) => Err(GpuError::DmaBufRefused {
                    pcie: Box::new(e),
                    fallback: Box::new(fallback),
                }),
            },
            other => Ok((other?, None)),
        }
    }

    /// Why a dma-buf exported with the driver's default mapping (the PCIe mapping type was
    /// refused with `refusal`) may matter: only on a host-coherent GPU, whose default mapping
    /// is C2C. Elsewhere the refusal is what drivers do (libfabric and NCCL fall back
    /// quietly too): logged at debug, `None`.
    fn default_mapping_note(&self, refusal: &GpuError) -> Option<String> {
        if super::host_coherent(self.dev.raw()) {
            return Some(format!(
                "the driver refused the PCIe mapping type for a dma-buf of GPU memory \
                 ({refusal}) on a GPU that is cache-coherent with the CPU: exported with its \
                 default mapping, which a NIC may not reach where that is not PCIe (Grace \
                 Hopper and Blackwell: C2C)"
            ));
        }
        tracing::debug!(
            "the driver refused the PCIe mapping type for a dma-buf of GPU memory ({refusal}), \
             as drivers do for a GPU that is not cache-coherent with the CPU: exported with \
             the default mapping, which is PCIe there"
        );
        None
    }

    fn dmabuf_with(&self, flags: u64) -> Result<OwnedFd, GpuError> {
        let mut fd: c_int = -1;
        // SAFETY: the range is the whole mapped allocation (exact bounds, 2 MiB aligned);
        // for the dma-buf handle type the driver writes an int through the pointer.
        check("cuMemGetHandleForAddressRange", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast::<c_void>(),
                self.mapping.0,
                self.mapping.1,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                flags,
            )
        })?;
        // SAFETY: on success the driver returned a new fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Copies `bytes` to `offset` (synchronous: a receive's bytes that landed in host memory,
    /// an assembly's zeroes and offsets, setup and tests). The caller writes only bytes it
    /// holds (its slab's); nothing here checks that.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), GpuError> {
        self.range(offset, bytes.len())?;
        // SAFETY: `copy_to_device` asks for device memory of `self.dev` that the caller owns
        // and that nothing else reads or writes meanwhile. The range was checked to lie inside
        // this region: memory this value allocated on `self.dev` (`cuMemCreate`, a device
        // location) and keeps mapped while borrowed, at addresses reserved for it, which only
        // the device may access (`cuMemSetAccess`): no host memory, and no CPU pointer into
        // it exists. That nothing else touches those bytes meanwhile is not checked here (any
        // holder of `&self` may name any range): it is the slab allocator's invariant, kept by
        // the callers, each writing only the slab it holds (a receive the slab it fills; an
        // assembly its output slab, before its gather is launched and after it is done; setup
        // and tests, regions no one uses yet). Broken, it races on device memory that no Rust
        // reference points into: wrong bytes in a batch, not undefined behaviour in this
        // process, as for `Engines::gather` and `Engines::copy`, which write a region through
        // a shared `&VmmRegion` too.
        unsafe { copy_to_device(&self.dev, self.device_ptr() + offset as u64, bytes) }
    }

    /// Copies `out.len()` bytes from `offset` (synchronous: [`crate::slab::Slab::read`], for
    /// the HTTP API, and tests). The caller reads only bytes nothing writes meanwhile (a
    /// leased batch's); nothing here checks that.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        self.range(offset, out.len())?;
        // SAFETY: `copy_to_host` asks for live device memory of `self.dev` that nothing writes
        // meanwhile. The range was checked to lie inside this region, memory of `self.dev`
        // kept mapped while `self` is borrowed; `out`, uniquely borrowed host memory of
        // exactly that length, is what the copy writes. That nothing writes those device bytes
        // meanwhile is not checked here: it is the callers' part. The node reads only a leased
        // batch's slab (`Slab::read`), filled before it was leased and kept from reuse by the
        // slab the copy holds; tests read what they wrote. Broken, it races on device memory
        // that no Rust reference points into (only the device may access the region): `out`
        // gets old or new bytes, each written by the copy, not undefined behaviour in this
        // process.
        unsafe { copy_to_host(&self.dev, out, self.device_ptr() + offset as u64) }
    }

    /// Checks that `[offset, offset + len)` lies inside the region.
    pub fn range(&self, offset: usize, len: usize) -> Result<(), GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(GpuError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: self.len() as u64,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unit_too_large_names_the_length_asked_and_the_granularity() {
        assert_eq!(unit_for(2 << 20).unwrap(), 2 << 20);
        let e = unit_for(usize::MAX).unwrap_err();
        // Before, the granularity was reported as the region's length.
        assert!(
            matches!(
                e,
                GpuError::TooLarge {
                    len: 1,
                    granularity: g
                } if g == usize::MAX as u64
            ),
            "{e}"
        );
    }

    #[test]
    fn sizes_round_to_granularity_and_2mib() {
        assert_eq!(region_size(1, 2 << 20), Some(2 << 20));
        assert_eq!(region_size(0, 2 << 20), Some(2 << 20));
        assert_eq!(region_size((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(region_size(5 << 20, 64 << 10), Some(6 << 20));
        assert_eq!(region_size(1, 4 << 20), Some(4 << 20));
        assert_eq!(region_size(1, 3 << 20), Some(6 << 20));
        // Past the address space: refused, not wrapped (or a panic in debug builds).
        assert_eq!(region_size(usize::MAX, 2 << 20), None);
        assert_eq!(region_size(usize::MAX - (1 << 20), 3 << 20), None);
    }
}
