//! CUDA through cudarc's raw driver bindings (`cudarc::driver::sys`): the probe (here),
//! owning types over driver objects ([`device`]), shareable VMM regions ([`vmm`]), the
//! gather and CRC engines ([`engine`]) and the H2D staging path ([`staging`]).
//!
//! cudarc loads `libcuda.so` lazily and **panics** when it (or one symbol) is missing, so
//! `probe_driver` first asks [`sys::is_culib_present`] and touches no other cudarc
//! function when that says no. Every driver call goes through `check`, the one seam
//! where a `CUresult` becomes a [`GpuError`].

pub mod device;
pub mod engine;
pub mod hostmap;
pub mod memory;
pub mod selftest;
pub mod staging;
pub mod vmm;

pub use crate::error::StageError;
pub use device::{Device, DeviceBuffer, Event, PinnedBuffer, Stream};
pub use engine::{Engines, Launched};
pub use hostmap::{DeviceRange, HostMapped};
pub use memory::{CudaMemory, open_for_service};
pub use selftest::self_test;
pub use staging::H2dStager;
pub use vmm::VmmRegion;

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::sys;

use crate::error::GpuError;
use crate::report::{GpuDevice, GpuProbe, judge};

/// The one seam: a driver status code becomes `Ok` or a [`GpuError::Driver`] naming the call.
pub(crate) fn check(call: &'static str, result: sys::CUresult) -> Result<(), GpuError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        result => Err(GpuError::Driver { call, result }),
    }
}

/// Probes the CUDA driver and its devices; never panics on a host without a driver.
pub(crate) fn probe_driver() -> GpuProbe {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names and
    // drops what it opened; it reads no global cudarc state.
    if !unsafe { sys::is_culib_present() } {
        return GpuProbe {
            driver_present: false,
            driver_version: None,
            devices: Vec::new(),
            usable: false,
            reason: "libcuda.so was not found (no NVIDIA driver on this host)".to_owned(),
        };
    }
    // The library loads, so cudarc's lazy loader will not hit `panic_no_lib_found`. A
    // symbol missing from a broken install would still panic in the loader; contain it.
    match std::panic::catch_unwind(query_driver) {
        Ok((driver_version, Ok(devices))) => judge(true, driver_version, devices),
        Ok((driver_version, Err(e))) => GpuProbe {
            driver_present: true,
            driver_version,
            devices: Vec::new(),
            usable: false,
            reason: format!("the CUDA driver is present but the probe failed: {e}"),
        },
        Err(_) => GpuProbe {
            driver_present: true,
            driver_version: None,
            devices: Vec::new(),
            usable: false,
            reason: "libcuda loads but lacks a driver entry point the probe needs (a broken or \
                     very old driver install)"
                .to_owned(),
        },
    }
}

/// The driver version (asked before `cuInit`, which it does not need, so a failed init
/// still reports it) and the devices.
fn query_driver() -> (Option<i32>, Result<Vec<GpuDevice>, GpuError>) {
    let mut version: c_int = 0;
    // SAFETY: libcuda is loaded (checked by the caller); the out-pointer is a live local.
    let version_result = unsafe { sys::cuDriverGetVersion(&mut version) };
    let driver_version = check("cuDriverGetVersion", version_result)
        .ok()
        .map(|()| version);
    (driver_version, query_devices())
}

fn query_devices() -> Result<Vec<GpuDevice>, GpuError> {
    // SAFETY: libcuda is loaded; `cuInit` takes no pointers and 0 is the only valid flag.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; the out-pointer is a live local.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    (0..count).map(query_device).collect()
}

fn query_device(ordinal: c_int) -> Result<GpuDevice, GpuError> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver is initialised, `ordinal` < the device count, and the
    // out-pointer is a live local.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;

    let mut name: [c_char; 256] = [0; 256];
    // SAFETY: `dev` is a valid device handle; the driver writes at most `len` bytes,
    // NUL-terminated, into the buffer, whose length we pass.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
    })?;
    let mut bus_id: [c_char; 64] = [0; 64];
    // SAFETY: as above; the PCI bus id ("dddd:bb:dd.f") needs 13 bytes, the buffer has 64.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(bus_id.as_mut_ptr(), bus_id.len() as c_int, dev)
    })?;
    let mut total_memory: usize = 0;
    // SAFETY: `dev` is a valid device handle; the out-pointer is a live local.
    check("cuDeviceTotalMem_v2", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total_memory, dev)
    })?;

    use sys::CUdevice_attribute as A;
    Ok(GpuDevice {
        ordinal,
        name: c_string(&name),
        // The driver prints upper-case hex; sysfs, RxDM and the lanes spell it lower-case.
        pci_bus_id: c_string(&bus_id).to_ascii_lowercase(),
        uuid: uuid(dev),
        total_memory: total_memory as u64,
        compute_capability: (
            int_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            int_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        dma_buf_supported: flag(dev, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?,
        vmm_supported: flag(
            dev,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )?,
        gpu_direct_rdma_with_cuda_vmm_supported: flag(
            dev,
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        )?,
    })
}

/// `cuDeviceGetUuid_v2` as `GPU-8-4-4-4-12` lower-case hex; `None` if the driver refuses.
fn uuid(dev: sys::CUdevice) -> Option<String> {
    let mut raw = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `dev` is a valid device handle; the out-pointer is a live local of the
    // driver's 16-byte struct.
    check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(&mut raw, dev)
    })
    .ok()?;
    Some(uuid_text(raw.bytes.map(|b| b as u8)))
}

/// 16 UUID bytes as `nvidia-smi -L` prints them.
pub(crate) fn uuid_text(b: [u8; 16]) -> String {
    let hex: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex[..4].concat(),
        hex[4..6].concat(),
        hex[6..8].concat(),
        hex[8..10].concat(),
        hex[10..].concat()
    )
}

/// A boolean device attribute. A driver older than the attribute answers
/// `CUDA_ERROR_INVALID_VALUE`: that means "not supported", not a failed probe.
fn flag(dev: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Result<bool, GpuError> {
    let mut value: c_int = 0;
    // SAFETY: `dev` is a valid device handle, `attribute` a valid enum value, and the
    // out-pointer is a live local.
    match unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, dev) } {
        sys::CUresult::CUDA_ERROR_INVALID_VALUE => Ok(false),
        result => check("cuDeviceGetAttribute", result).map(|()| value != 0),
    }
}

/// An integer device attribute that every driver knows (the compute capability).
fn int_attribute(dev: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Result<i32, GpuError> {
    let mut value: c_int = 0;
    // SAFETY: `dev` is a valid device handle, `attribute` a valid enum value, and the
    // out-pointer is a live local.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, dev)
    })?;
    Ok(value)
}

/// The device's memory is cache-coherent with the CPU (Grace Hopper, Grace Blackwell: C2C),
/// by `CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST` or
/// `CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED`. Only on such a device can a dma-buf's
/// default mapping be other than PCIe. An attribute the driver fails to answer counts as
/// coherent, so that a refusal that may matter is never hidden.
pub(crate) fn host_coherent(dev: sys::CUdevice) -> bool {
    use sys::CUdevice_attribute as A;
    [
        A::CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST,
        A::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED,
    ]
    .into_iter()
    .any(|a| flag(dev, a).unwrap_or(true))
}

/// Text from a NUL-terminated buffer the driver filled (lossy; a missing NUL gives "").
fn c_string(buf: &[c_char]) -> String {
    // SAFETY: `c_char` and `u8` have the same size and alignment; the slice stays borrowed.
    let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), buf.len()) };
    CStr::from_bytes_until_nul(bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}
