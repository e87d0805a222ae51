//! What the GPU probe reports ([`GpuProbe`], [`GpuDevice`]) and how a report is judged.
//! Shared by the driver backends (`cuda`, `dummy_cuda`) and [`crate::probe`], which picks the
//! backend: the types live here so that neither depends on the other.

use serde::Serialize;

/// The oldest driver whose API has `cuMemGetHandleForAddressRange` with
/// `CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE` (CUDA 12.8), encoded as the driver does.
pub const MIN_DRIVER_VERSION: i32 = 12080;

/// What the probe found on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuProbe {
    /// `libcuda` could be loaded.
    pub driver_present: bool,
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8; `None` without a driver.
    pub driver_version: Option<i32>,
    /// Every device the driver lists.
    pub devices: Vec<GpuDevice>,
    /// The driver is new enough and at least one device has dma-buf and VMM support.
    pub usable: bool,
    /// Why the probe judged the host usable or not, for logs and the status endpoint.
    pub reason: String,
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuDevice {
    /// The CUDA ordinal.
    pub ordinal: i32,
    /// `cuDeviceGetName`, e.g. "NVIDIA H200".
    pub name: String,
    /// `cuDeviceGetPCIBusId` in lower case as sysfs spells it, e.g. "0000:19:00.0" (the
    /// driver prints upper-case hex, "0000:1A:00.0").
    pub pci_bus_id: String,
    /// `cuDeviceGetUuid_v2` as `nvidia-smi -L` prints it (`GPU-xxxxxxxx-xxxx-...`); `None`
    /// when the driver cannot say.
    pub uuid: Option<String>,
    /// Bytes of device memory.
    pub total_memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub gpu_direct_rdma_with_cuda_vmm_supported: bool,
}

impl GpuDevice {
    /// The device can hold shareable regions that a NIC can reach (dma-buf export of a
    /// VMM allocation).
    pub fn usable(&self) -> bool {
        self.dma_buf_supported && self.vmm_supported
    }
}

/// Judges a driver that loaded: usable when it is new enough and a device has dma-buf and
/// VMM support.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn judge(
    driver_present: bool,
    driver_version: Option<i32>,
    devices: Vec<GpuDevice>,
) -> GpuProbe {
    let (usable, reason) = match (driver_version, devices.iter().find(|d| d.usable())) {
        (None, _) => (
            false,
            "the CUDA driver did not report its version".to_owned(),
        ),
        (Some(v), _) if v < MIN_DRIVER_VERSION => (
            false,
            format!(
                "CUDA driver {} is older than {} (needs cuMemGetHandleForAddressRange with the \
                 PCIe flag)",
                version_text(v),
                version_text(MIN_DRIVER_VERSION)
            ),
        ),
        (Some(_), None) if devices.is_empty() => {
            (false, "the CUDA driver lists no devices".to_owned())
        }
        (Some(_), None) => (
            false,
            format!(
                "none of the {} CUDA device(s) supports both dma-buf export and VMM",
                devices.len()
            ),
        ),
        (Some(v), Some(d)) => (
            true,
            format!(
                "CUDA driver {} with {} usable",
                version_text(v),
                device_text(d)
            ),
        ),
    };
    GpuProbe {
        driver_present,
        driver_version,
        devices,
        usable,
        reason,
    }
}

/// 12080 -> "12.8".
fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// "GPU 0 (NVIDIA H200, 0000:19:00.0)".
pub fn device_text(d: &GpuDevice) -> String {
    format!("GPU {} ({}, {})", d.ordinal, d.name, d.pci_bus_id)
}
