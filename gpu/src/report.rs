//! What the GPU probe reports ([`GpuProbe`], [`GpuDevice`]) and how a report is judged.
//! Shared by the driver backends (`cuda`, `dummy_cuda`) and [`crate::probe`], which picks the
//! backend: the types live here so that neither depends on the other.

use serde::Serialize;

/// The oldest driver whose API has `cuMemGetHandleForAddressRange` with
/// `CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE` (CUDA 12.8), encoded as the driver does.
pub const MIN_DRIVER_VERSION: i32 = 12080;

/// The oldest compute capability the kernels run on, `(major, minor)`: they are embedded as
/// `.target sm_80` PTX (`kernels::PTX`), which no driver can JIT for an older GPU (Turing,
/// Volta: `cuModuleLoadData` fails).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// What the probe found on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuProbe {
    /// `libcuda` could be loaded.
    pub driver_present: bool,
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8; `None` without a driver.
    pub driver_version: Option<i32>,
    /// Every device the driver lists.
    pub devices: Vec<GpuDevice>,
    /// The driver is new enough and at least one device is [`GpuDevice::usable`].
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
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` and `_MINOR`, e.g. `(9, 0)` for an H100
    /// or H200 (serialized as `[9, 0]`).
    pub compute_capability: (i32, i32),
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub gpu_direct_rdma_with_cuda_vmm_supported: bool,
}

impl GpuDevice {
    /// The device can hold shareable regions that a NIC can reach (dma-buf export of a
    /// VMM allocation) and run the kernels (compute capability [`MIN_COMPUTE_CAPABILITY`]
    /// or later).
    pub fn usable(&self) -> bool {
        self.unusable_because().is_none()
    }

    /// Why the device is not [`usable`](Self::usable), every reason, in words; `None` when
    /// it is.
    pub fn unusable_because(&self) -> Option<String> {
        let mut why = Vec::new();
        if self.compute_capability < MIN_COMPUTE_CAPABILITY {
            let (major, minor) = MIN_COMPUTE_CAPABILITY;
            why.push(format!(
                "compute capability {} is below {} (the kernels are sm_{major}{minor} PTX: \
                 Ampere or later)",
                capability_text(self.compute_capability),
                capability_text(MIN_COMPUTE_CAPABILITY)
            ));
        }
        if !self.dma_buf_supported {
            why.push("no dma-buf export (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0)".to_owned());
        }
        if !self.vmm_supported {
            why.push(
                "no VMM support (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)"
                    .to_owned(),
            );
        }
        (!why.is_empty()).then(|| why.join(", "))
    }
}

/// Judges a driver that loaded: usable when it is new enough and a device is
/// [`GpuDevice::usable`]; otherwise the reason names what each device lacks.
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
                "none of the {} CUDA device(s) is usable: {}",
                devices.len(),
                unusable_text(&devices)
            ),
        ),
        (Some(v), Some(d)) => (true, usable_text(v, d, &devices)),
    };
    GpuProbe {
        driver_present,
        driver_version,
        devices,
        usable,
        reason,
    }
}

/// "CUDA driver 12.8 with GPU 1 (...) usable", and each device of `devices` that is not,
/// with what it lacks: the node gives such a GPU no CUDA memory (a lane of it, with
/// `memory = "host"`, or none beside usable ones), and this says why.
fn usable_text(version: i32, usable: &GpuDevice, devices: &[GpuDevice]) -> String {
    let mut text = format!(
        "CUDA driver {} with {} usable",
        version_text(version),
        device_text(usable)
    );
    let others = unusable_text(devices);
    if !others.is_empty() {
        text.push_str("; not usable, so left out of CUDA memory: ");
        text.push_str(&others);
    }
    text
}

/// "GPU 0 (Tesla T4, 0000:19:00.0): compute capability 7.5 is below 8.0 (...)", each
/// unusable device, joined by "; ".
fn unusable_text(devices: &[GpuDevice]) -> String {
    let each: Vec<String> = devices
        .iter()
        .filter_map(|d| {
            d.unusable_because()
                .map(|why| format!("{}: {why}", device_text(d)))
        })
        .collect();
    each.join("; ")
}

/// (7, 5) -> "7.5".
fn capability_text((major, minor): (i32, i32)) -> String {
    format!("{major}.{minor}")
}

/// 12080 -> "12.8".
fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// "GPU 0 (NVIDIA H200, 0000:19:00.0)".
pub fn device_text(d: &GpuDevice) -> String {
    format!("GPU {} ({}, {})", d.ordinal, d.name, d.pci_bus_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe's floor follows the embedded PTX: a PTX regenerated for another target
    /// must move [`MIN_COMPUTE_CAPABILITY`] with it.
    #[test]
    fn the_minimum_compute_capability_is_the_ptx_target() {
        let (major, minor) = MIN_COMPUTE_CAPABILITY;
        let target = format!(".target sm_{major}{minor}\n");
        assert!(crate::kernels::PTX.contains(&target), "{target}");
    }

    fn device(ordinal: i32, name: &str, compute_capability: (i32, i32)) -> GpuDevice {
        GpuDevice {
            ordinal,
            name: name.to_owned(),
            pci_bus_id: format!("0000:1{ordinal}:00.0"),
            uuid: None,
            total_memory: 16 << 30,
            compute_capability,
            dma_buf_supported: true,
            vmm_supported: true,
            gpu_direct_rdma_with_cuda_vmm_supported: true,
        }
    }

    /// A T4 beside an A100: the probe is usable, and its reason names the T4 and what it
    /// lacks. Before, it named the A100 only, and the T4 was dropped without a word.
    #[test]
    fn a_usable_report_names_the_devices_left_out() {
        let t4 = device(0, "Tesla T4", (7, 5));
        let a100 = device(1, "NVIDIA A100", (8, 0));
        let mixed = judge(true, Some(12080), vec![t4, a100.clone()]);
        assert!(mixed.usable, "{}", mixed.reason);
        let want = "CUDA driver 12.8 with GPU 1 (NVIDIA A100, 0000:11:00.0) usable; not usable, \
                    so left out of CUDA memory: GPU 0 (Tesla T4, 0000:10:00.0): compute capability 7.5 is below \
                    8.0";
        assert!(mixed.reason.starts_with(want), "{}", mixed.reason);
        let alone = judge(true, Some(12080), vec![a100]);
        assert_eq!(
            alone.reason,
            "CUDA driver 12.8 with GPU 1 (NVIDIA A100, 0000:11:00.0) usable"
        );
    }
}
