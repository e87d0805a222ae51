//! GPU capability probe and the host/CUDA memory decision (DESIGN §4-5).
//!
//! [`probe_gpus`] reports the driver version and, per device, dma-buf and VMM support;
//! [`choose_memory`] turns the configured [`MemoryChoice`] and that report into a
//! [`MemoryDecision`] that says what was chosen and why. A silent fallback is a bug: every
//! path carries a reason, and `memory = "cuda"` without a usable GPU is an error.
//!
//! Nothing here panics on a host without an NVIDIA driver.

use serde::{Deserialize, Serialize};
use shardwire_protocol::trainer::MemoryKind;

use crate::cuda as backend;
pub use crate::error::GpuError;
pub use crate::report::{
    GpuDevice, GpuProbe, MIN_COMPUTE_CAPABILITY, MIN_DRIVER_VERSION, device_text,
};

/// The configured `memory` mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryChoice {
    /// CUDA if usable, else host; the decision says which and why.
    #[default]
    Auto,
    /// Host memory (memfd regions).
    Host,
    /// CUDA device memory; refuse to start without it.
    Cuda,
}

/// What memory the service uses, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryDecision {
    /// Host or CUDA.
    pub memory: MemoryKind,
    /// Why, in words for the startup log and the status endpoint.
    pub reason: String,
    /// For `"cuda"`: the device chosen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<GpuDevice>,
}

/// Probes the CUDA driver and devices. Without a driver (or without the `cuda` feature)
/// this returns a report with `driver_present: false`; it never panics.
pub fn probe_gpus() -> GpuProbe {
    backend::probe_driver()
}

/// Decides host or CUDA memory from the configured choice and the probe.
///
/// `Cuda` without a usable GPU is an error naming what is missing; the service refuses to
/// start with it. `Auto` takes the first usable GPU, else host, and says why. (The service
/// then opens the device and runs a short self-test; see `cuda::self_test`.)
pub fn choose_memory(
    requested: MemoryChoice,
    probe: &GpuProbe,
) -> Result<MemoryDecision, GpuError> {
    let usable_device = probe
        .devices
        .iter()
        .find(|d| d.usable())
        .filter(|_| probe.usable);
    match (requested, usable_device) {
        (MemoryChoice::Host, _) => Ok(MemoryDecision {
            memory: MemoryKind::Host,
            reason: "configured (memory = \"host\")".to_owned(),
            device: None,
        }),
        (MemoryChoice::Cuda, None) => Err(GpuError::CudaUnavailable {
            reason: probe.reason.clone(),
        }),
        (MemoryChoice::Cuda, Some(d)) => Ok(MemoryDecision {
            memory: MemoryKind::Cuda,
            reason: format!("configured (memory = \"cuda\"): {}", device_text(d)),
            device: Some(d.clone()),
        }),
        (MemoryChoice::Auto, Some(d)) => Ok(MemoryDecision {
            memory: MemoryKind::Cuda,
            reason: format!("auto: {} has dma-buf and VMM support", device_text(d)),
            device: Some(d.clone()),
        }),
        (MemoryChoice::Auto, None) => Ok(MemoryDecision {
            memory: MemoryKind::Host,
            reason: format!("auto: no CUDA driver or usable GPU ({})", probe.reason),
            device: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::judge;

    fn h200(ordinal: i32, dma_buf: bool, vmm: bool) -> GpuDevice {
        GpuDevice {
            ordinal,
            name: "NVIDIA H200".to_owned(),
            pci_bus_id: "0000:19:00.0".to_owned(),
            uuid: None,
            total_memory: 150_754_820_096,
            compute_capability: (9, 0),
            dma_buf_supported: dma_buf,
            vmm_supported: vmm,
            gpu_direct_rdma_with_cuda_vmm_supported: vmm,
        }
    }

    fn no_driver() -> GpuProbe {
        GpuProbe {
            driver_present: false,
            driver_version: None,
            devices: Vec::new(),
            usable: false,
            reason: "libcuda.so was not found (no NVIDIA driver on this host)".to_owned(),
        }
    }

    /// Runs on every host; on a GPU-less one (CI, this machine) it must report no driver.
    #[test]
    fn probe_never_panics_and_reports_a_reason() {
        let probe = probe_gpus();
        println!("{}", serde_json::to_string_pretty(&probe).unwrap());
        assert!(!probe.reason.is_empty());
        if !probe.driver_present {
            assert!(!probe.usable);
            assert!(probe.devices.is_empty());
            assert_eq!(probe.driver_version, None);
            #[cfg(feature = "cuda")]
            assert!(probe.reason.contains("libcuda"), "{}", probe.reason);
            #[cfg(not(feature = "cuda"))]
            assert!(probe.reason.contains("`cuda` feature"), "{}", probe.reason);
        }
        // Probing twice is fine (no global state is poisoned).
        assert_eq!(probe_gpus().driver_present, probe.driver_present);
    }

    #[test]
    #[ignore = "needs CUDA GPU"]
    fn probe_finds_a_vmm_capable_gpu() {
        let probe = probe_gpus();
        println!("{}", serde_json::to_string_pretty(&probe).unwrap());
        assert!(probe.driver_present, "{}", probe.reason);
        assert!(!probe.devices.is_empty(), "{}", probe.reason);
        assert!(probe.devices.iter().any(|d| d.vmm_supported), "{probe:#?}");
        assert!(
            probe
                .devices
                .iter()
                .all(|d| d.total_memory > 0 && !d.name.is_empty())
        );
        let decision = choose_memory(MemoryChoice::Auto, &probe).unwrap();
        println!("auto -> {decision:?}");
    }

    #[test]
    fn judge_classifies_drivers_and_devices() {
        let ok = judge(
            true,
            Some(12080),
            vec![h200(0, false, true), h200(1, true, true)],
        );
        assert!(ok.usable, "{}", ok.reason);
        assert!(
            ok.reason.contains("12.8") && ok.reason.contains("GPU 1"),
            "{}",
            ok.reason
        );

        let old = judge(true, Some(12040), vec![h200(0, true, true)]);
        assert!(!old.usable);
        assert!(
            old.reason.contains("CUDA driver 12.4 is older than 12.8"),
            "{}",
            old.reason
        );

        let none = judge(true, Some(12090), Vec::new());
        assert!(
            !none.usable && none.reason.contains("no devices"),
            "{}",
            none.reason
        );

        let no_dmabuf = judge(true, Some(13000), vec![h200(0, false, true)]);
        assert!(
            !no_dmabuf.usable && no_dmabuf.reason.contains("dma-buf"),
            "{}",
            no_dmabuf.reason
        );

        assert!(!judge(true, None, vec![h200(0, true, true)]).usable);
    }

    /// A Tesla T4 (Turing, 7.5) with dma-buf and VMM support: the sm_80 PTX cannot load on
    /// it, so it is not usable, and the reason says so (before, it was judged usable and
    /// failed later in `cuModuleLoadData`, with advice to update the driver).
    fn t4(ordinal: i32) -> GpuDevice {
        GpuDevice {
            name: "Tesla T4".to_owned(),
            compute_capability: (7, 5),
            ..h200(ordinal, true, true)
        }
    }

    #[test]
    fn a_gpu_below_compute_capability_8_is_not_usable_and_says_why() {
        assert!(!t4(0).usable());
        let why = "GPU 0 (Tesla T4, 0000:19:00.0): compute capability 7.5 is below 8.0 (the \
                   kernels are sm_80 PTX: Ampere or later)";
        let probe = judge(true, Some(12080), vec![t4(0)]);
        assert!(!probe.usable, "{probe:?}");
        assert!(probe.reason.contains(why), "{}", probe.reason);

        let auto = choose_memory(MemoryChoice::Auto, &probe).unwrap();
        assert_eq!(auto.memory, MemoryKind::Host);
        assert!(auto.reason.contains(why), "{}", auto.reason);
        let e = choose_memory(MemoryChoice::Cuda, &probe).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");

        // Every missing capability of a device is named, not only the first.
        let old_and_bare = GpuDevice {
            dma_buf_supported: false,
            ..t4(0)
        };
        let why = old_and_bare.unusable_because().unwrap();
        assert!(
            why.contains("compute capability 7.5") && why.contains("no dma-buf export"),
            "{why}"
        );

        // 8.0 (A100) and later are usable; a T4 beside an H200 is passed over.
        for cc in [(8, 0), (8, 6), (9, 0), (10, 0)] {
            let d = GpuDevice {
                compute_capability: cc,
                ..t4(0)
            };
            assert!(d.usable(), "{cc:?}");
        }
        let mixed = judge(true, Some(12080), vec![t4(0), h200(1, true, true)]);
        let d = choose_memory(MemoryChoice::Auto, &mixed).unwrap();
        assert_eq!(d.device.map(|d| d.ordinal), Some(1));
    }

    #[test]
    fn host_is_always_honoured() {
        for probe in [
            no_driver(),
            judge(true, Some(12080), vec![h200(0, true, true)]),
        ] {
            let d = choose_memory(MemoryChoice::Host, &probe).unwrap();
            assert_eq!(d.memory, MemoryKind::Host);
            assert!(d.reason.contains("configured"));
        }
    }

    #[test]
    fn auto_says_why_it_chose_host() {
        let d = choose_memory(MemoryChoice::Auto, &no_driver()).unwrap();
        assert_eq!(d.memory, MemoryKind::Host);
        assert!(
            d.reason.contains("no CUDA driver") && d.reason.contains("libcuda"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn auto_and_cuda_take_the_first_usable_gpu() {
        let gpu = judge(
            true,
            Some(12080),
            vec![h200(0, false, true), h200(1, true, true)],
        );
        for choice in [MemoryChoice::Auto, MemoryChoice::Cuda] {
            let d = choose_memory(choice, &gpu).unwrap();
            assert_eq!(d.memory, MemoryKind::Cuda);
            assert_eq!(d.device.as_ref().map(|d| d.ordinal), Some(1));
            assert!(d.reason.contains("GPU 1 (NVIDIA H200"), "{}", d.reason);
        }
    }

    #[test]
    fn cuda_without_a_usable_gpu_is_an_error_naming_what_is_missing() {
        let e = choose_memory(MemoryChoice::Cuda, &no_driver()).unwrap_err();
        assert!(matches!(e, GpuError::CudaUnavailable { .. }));
        let msg = e.to_string();
        assert!(
            msg.contains("memory = \"cuda\"") && msg.contains("libcuda.so was not found"),
            "{msg}"
        );

        let old = judge(true, Some(12040), vec![h200(0, true, true)]);
        let msg = choose_memory(MemoryChoice::Cuda, &old)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("older than 12.8"), "{msg}");

        // A hand-built report that says usable but lists no usable device is not trusted.
        let inconsistent = GpuProbe {
            usable: true,
            ..no_driver()
        };
        assert!(choose_memory(MemoryChoice::Cuda, &inconsistent).is_err());
    }

    #[test]
    fn memory_choice_parses_lowercase_and_reports_serialize() {
        let c: MemoryChoice = serde_json::from_str("\"cuda\"").unwrap();
        assert_eq!(c, MemoryChoice::Cuda);
        let json =
            serde_json::to_value(judge(true, Some(12080), vec![h200(0, true, true)])).unwrap();
        assert_eq!(json["devices"][0]["vmm_supported"], true);
        assert_eq!(
            json["devices"][0]["compute_capability"],
            serde_json::json!([9, 0])
        );
        assert_eq!(json["driver_version"], 12080);
    }
}
