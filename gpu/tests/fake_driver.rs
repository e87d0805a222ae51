//! The CUDA code paths of shardwire-gpu on any machine, against the fake libcuda
//! (`gpu/fakecuda/fake_cuda.c`: a test double of the CUDA driver on host memory, built by
//! `scripts/build-fakecuda`).
//!
//! The dynamic loader reads `LD_LIBRARY_PATH` only when a process starts, so every test here
//! runs a child of this same binary with the fake on that path, which runs ignored tests of
//! this binary, and then checks what the child printed:
//! - the whole GPU suite of `cuda_gpu.rs` (compiled in below, unchanged: on a real GPU
//!   `scripts/gpu-check.sh` runs it), with no driver call failing, nothing leaked;
//! - the `child` tests below: the probe (a pre-Ampere GPU included), the dma-buf fallback (on a GPU
//!   that is cache-coherent with the CPU and on one that is not), the crate refusing bad ranges and
//!   other GPUs' memory before any driver call, regions dropped on threads without a context,
//!   engine calls failing midway (`FAKE_CUDA_FAIL_CALL`), and the fake's own checks (missing
//!   contexts, out-of-bounds copies and kernels, deferred streams, per-device synchronisation on
//!   free, synchronous H2D copies from pageable memory landing in legacy stream order, host
//!   registrations without PORTABLE pinned for their context only).
//!
//! The `child` tests do nothing unless `SHARDWIRE_FAKE_CUDA_CHILD` is set (so `--ignored`
//! on a GPU host, as in `scripts/gpu-check.sh`, passes over them).
#![cfg(feature = "cuda")]

#[path = "cuda_gpu.rs"]
mod cuda_gpu;
#[path = "common/fakecuda.rs"]
mod fakecuda;

use std::process::Command;

const CHILD: &str = "SHARDWIRE_FAKE_CUDA_CHILD";
const FAKE_NAME: &str = "shardwire fake CUDA device (host memory)";

/// What a child printed.
struct Child {
    stdout: String,
    stderr: String,
}

impl Child {
    /// The fake's log lines (`fake libcuda[pid]: ...`).
    fn fake_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| l.starts_with("fake libcuda"))
            .collect()
    }
}

/// Runs the ignored tests of this binary matching `filter` in a child with the fake libcuda
/// (`FAKE_CUDA_LOG=1`: failed driver calls and leaks are printed) and asserts that they ran
/// `tests` tests and passed.
fn run_child(filter: &str, tests: usize, env: &[(&str, &str)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
    cmd.args([filter, "--ignored", "--test-threads=1", "--nocapture"])
        .env("LD_LIBRARY_PATH", fakecuda::ld_library_path())
        .env(CHILD, "1")
        .env("FAKE_CUDA_LOG", "1")
        .env_remove("FAKE_CUDA_NO_PCIE_FLAG")
        .env_remove("FAKE_CUDA_NO_DMABUF")
        .env_remove("FAKE_CUDA_DEVICES")
        .env_remove("FAKE_CUDA_PCI_BUS_IDS")
        .env_remove("FAKE_CUDA_ALLOC_LOG")
        .env_remove("FAKE_CUDA_DRIVER_VERSION")
        .env_remove("FAKE_CUDA_COMPUTE_CAPABILITY")
        .env_remove("FAKE_CUDA_HOST_COHERENT")
        .env_remove("FAKE_CUDA_FAIL_CALL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the child test process");
    let child = Child {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    let want = format!("test result: ok. {tests} passed; 0 failed");
    assert!(
        out.status.success() && child.stdout.contains(&want),
        "child `{filter}` did not pass {tests} test(s) ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        child.stdout,
        child.stderr
    );
    child
}

#[test]
fn gpu_suite_passes_on_the_fake_driver() {
    let child = run_child("cuda_gpu::", 6, &[]);
    // Not one driver call failed, nothing leaked, no kernel touched a byte it should not.
    assert!(
        child.fake_lines().is_empty(),
        "the fake logged:\n{}",
        child.fake_lines().join("\n")
    );
}

#[test]
fn probe_sees_the_fake_device() {
    run_child("child::probe_reports_the_fake_device", 1, &[]);
}

#[test]
fn probe_explains_an_old_driver_and_no_devices() {
    run_child(
        "child::probe_with_an_old_driver",
        1,
        &[("FAKE_CUDA_DRIVER_VERSION", "12040")],
    );
    let child = run_child(
        "child::probe_without_devices",
        1,
        &[("FAKE_CUDA_DEVICES", "0")],
    );
    assert!(
        child.stderr.contains("cuInit -> CUDA_ERROR_NO_DEVICE"),
        "{}",
        child.stderr
    );
    // A failed cuInit leaves the driver uninitialised, as the real one does (before, the fake
    // counted it as initialised and answered later calls).
    assert!(
        child
            .stderr
            .contains("cuDeviceGetCount -> CUDA_ERROR_NOT_INITIALIZED"),
        "{}",
        child.stderr
    );
}

#[test]
fn probe_refuses_a_gpu_below_compute_capability_8() {
    let child = run_child(
        "child::probe_with_a_pre_ampere_gpu",
        1,
        &[("FAKE_CUDA_COMPUTE_CAPABILITY", "7.5")],
    );
    // The one failed call is the child's own try to load the sm_80 PTX on the 7.5 device.
    let lines = child.fake_lines();
    assert_eq!(lines.len(), 1, "{}", lines.join("\n"));
    assert!(
        lines[0].contains(
            "cuModuleLoadData -> CUDA_ERROR_INVALID_PTX: PTX .target sm_80 needs compute \
             capability 8.0; the device has 7.5"
        ),
        "{}",
        lines[0]
    );
}

/// Bus ids of three fake GPUs in two PCI domains (one bus in upper-case hex as CUDA prints it).
const THREE_GPUS: &str = "0000:03:00.0,0000:1a:00.0,0001:17:00.0";

#[test]
fn several_devices_each_by_bus_id_uuid_and_memory() {
    let log = std::env::temp_dir().join(format!("sw-fake-alloc-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let child = run_child(
        "child::several_devices",
        1,
        &[
            ("FAKE_CUDA_PCI_BUS_IDS", THREE_GPUS),
            (
                "FAKE_CUDA_ALLOC_LOG",
                log.to_str().expect("utf-8 temp path"),
            ),
        ],
    );
    // The two failures are the ones asked for: a bus id no device has, and the copy on
    // device 0 into device 1's region (access is per device).
    let lines = child.fake_lines();
    assert_eq!(lines.len(), 2, "{}", lines.join("\n"));
    assert!(
        lines[0].contains(
            "cuDeviceGetByPCIBusId -> CUDA_ERROR_INVALID_DEVICE: no device at 0000:fa:00.0"
        ),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].contains("cuMemcpyHtoD_v2 -> CUDA_ERROR_INVALID_VALUE: destination")
            && lines[1].contains("device 0 may not write this VMM mapping"),
        "{}",
        lines[1]
    );
    // Every VMM allocation is logged on the device it was made on: the self-test of each
    // device (2 regions of 2 MiB each), its dma-buf check (one more), the 4 MiB region made
    // on device 1 and the 2 MiB one on device 0 its engines gather from.
    let text = std::fs::read_to_string(&log).expect("the allocation log");
    let _ = std::fs::remove_file(&log);
    let creates: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("cuMemCreate "))
        .collect();
    for (dev, bus, n) in [
        (0, "0000:03:00.0", 4),
        (1, "0000:1A:00.0", 3),
        (2, "0001:17:00.0", 3),
    ] {
        let want = format!("dev={dev} pci={bus} size=2097152");
        assert_eq!(
            creates.iter().filter(|l| l.ends_with(&want)).count(),
            n,
            "{want} in:\n{text}"
        );
    }
    assert_eq!(
        creates
            .iter()
            .filter(|l| l.ends_with("dev=1 pci=0000:1A:00.0 size=4194304"))
            .count(),
        1,
        "{text}"
    );
}

#[test]
fn dmabuf_export_falls_back_without_the_pcie_flag() {
    // 1: a driver that predates the flag (INVALID_VALUE); 2: one that knows it but refuses it
    // for a GPU that is not cache-coherent with the CPU (NOT_SUPPORTED: every PCIe-attached
    // GPU; driver 580, an H200 under Firecracker). Each on a PCIe GPU (the refusal is
    // expected: no note) and on a host-coherent one (Grace Hopper: the note is kept).
    for (mode, refusal) in [
        ("1", "CUDA_ERROR_INVALID_VALUE"),
        ("2", "CUDA_ERROR_NOT_SUPPORTED"),
    ] {
        for coherent in ["0", "1"] {
            fallback_child(mode, refusal, coherent);
        }
    }
}

/// One run of the dma-buf fallback child: the driver refuses the PCIe flag as `mode` says,
/// with `refusal`, on a GPU that is cache-coherent with the CPU where `coherent` is "1".
fn fallback_child(mode: &str, refusal: &str, coherent: &str) {
    let child = run_child(
        "child::dmabuf_export_without_the_pcie_flag",
        1,
        &[
            ("FAKE_CUDA_NO_PCIE_FLAG", mode),
            ("FAKE_CUDA_HOST_COHERENT", coherent),
            ("CHILD_EXPECT_REFUSAL", refusal),
        ],
    );
    // The crate asked with the PCIe flag once per export (three exports), was refused, and
    // asked again without it; nothing else failed (asking the device whether it is
    // host-coherent included).
    let lines = child.fake_lines();
    assert_eq!(lines.len(), 3, "{}", lines.join("\n"));
    let want = format!(
        "cuMemGetHandleForAddressRange -> {refusal}: CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE refused"
    );
    assert!(
        lines.iter().all(|l| l.contains(&want)),
        "{}",
        lines.join("\n")
    );
}

#[test]
fn a_refused_dmabuf_export_leaves_the_gpu_usable_and_says_why() {
    let child = run_child(
        "child::dmabuf_refused_is_reported_not_fatal",
        1,
        &[("FAKE_CUDA_NO_DMABUF", "1")],
    );
    // Two exports asked by the check and two by the child (each with the PCIe flag, then
    // without it), all refused; nothing else.
    let lines = child.fake_lines();
    assert_eq!(lines.len(), 4, "{}", lines.join("\n"));
    assert!(
        lines.iter().all(|l| l.contains(
            "cuMemGetHandleForAddressRange -> CUDA_ERROR_NOT_SUPPORTED: dma-buf export refused"
        )),
        "{}",
        lines.join("\n")
    );
}

#[test]
fn bad_ranges_are_refused_before_any_driver_call() {
    let child = run_child(
        "child::bad_ranges_never_reach_the_driver",
        1,
        &[("FAKE_CUDA_LOG", "2")],
    );
    let between: Vec<&str> = child
        .stderr
        .lines()
        .skip_while(|l| !l.contains("BEGIN bad ranges"))
        .take_while(|l| !l.contains("END bad ranges"))
        .filter(|l| l.starts_with("fake libcuda"))
        .collect();
    assert!(
        child.stderr.contains("END bad ranges"),
        "markers missing:\n{}",
        child.stderr
    );
    assert!(
        between.is_empty(),
        "driver calls for refused ranges:\n{}",
        between.join("\n")
    );
}

#[test]
fn regions_dropped_on_other_threads_are_unmapped() {
    let child = run_child(
        "child::regions_dropped_on_a_thread_without_a_context",
        1,
        &[],
    );
    assert!(
        child.fake_lines().is_empty(),
        "the fake logged:\n{}",
        child.fake_lines().join("\n")
    );
}

#[test]
fn a_staged_copy_that_fails_lands_nothing_afterwards() {
    let child = run_child("child::a_failed_staged_copy", 1, &[]);
    assert!(
        child.fake_lines().is_empty(),
        "the fake logged:\n{}",
        child.fake_lines().join("\n")
    );
}

#[test]
fn a_failed_engine_call_leaves_nothing_queued() {
    // The second launch of the first CRC-32C (its combine) is refused; then the first event
    // of a gather (its slot's). Each time the upload of the call's arguments, and a kernel,
    // were already queued.
    for (filter, fail, line) in [
        (
            "child::a_failed_crc_waits_for_its_kernels",
            "cuLaunchKernel:2",
            "cuLaunchKernel -> CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: injected",
        ),
        (
            "child::a_failed_gather_lands_nothing_afterwards",
            "cuEventCreate:1",
            "cuEventCreate -> CUDA_ERROR_OUT_OF_MEMORY: injected",
        ),
    ] {
        let child = run_child(filter, 1, &[("FAKE_CUDA_FAIL_CALL", fail)]);
        // The injected refusal is the only failed call: no kernel faulted afterwards.
        let lines = child.fake_lines();
        assert_eq!(lines.len(), 1, "{}", lines.join("\n"));
        assert!(lines[0].contains(line), "{}", lines[0]);
    }
}

#[test]
fn another_gpus_registration_and_region_are_refused() {
    // A registration read by another GPU's engines; a region written by another GPU's stager.
    let child = run_child("child::other_gpus_", 2, &[("FAKE_CUDA_DEVICES", "2")]);
    // Refused by the crate, before any driver call.
    assert!(
        child.fake_lines().is_empty(),
        "the fake logged:\n{}",
        child.fake_lines().join("\n")
    );
}

#[test]
fn the_fake_synchronises_on_free_per_device_and_not_on_unmap() {
    let child = run_child(
        "child::fake_drains_only_the_freeing_device",
        1,
        &[("FAKE_CUDA_DEVICES", "2")],
    );
    assert!(
        child.fake_lines().is_empty(),
        "the fake logged:\n{}",
        child.fake_lines().join("\n")
    );
}

#[test]
fn the_fake_enforces_contexts_bounds_and_stream_order() {
    let child = run_child("child::fake_checks", 1, &[]);
    let lines = child.fake_lines();
    for want in [
        "cuMemAlloc_v2 -> CUDA_ERROR_INVALID_CONTEXT: no CUDA context is current on this thread",
        "cuMemcpyHtoD_v2 -> CUDA_ERROR_INVALID_VALUE: destination",
        "cuModuleLoadData -> CUDA_ERROR_INVALID_IMAGE: PTX .entry sw_gather parameter 3 is .u64",
        "FAULT on device 0: sw_gather: writes bytes",
        "cuStreamSynchronize -> CUDA_ERROR_ILLEGAL_ADDRESS",
        "cuMemAlloc_v2 -> CUDA_ERROR_ILLEGAL_ADDRESS: the context is unusable",
    ] {
        assert!(
            lines.iter().any(|l| l.contains(want)),
            "no `{want}` in:\n{}",
            lines.join("\n")
        );
    }
}

#[test]
fn the_fake_enforces_vmm_event_and_registration_rules() {
    let child = run_child("child::fake_vmm_event_and_registration_rules", 1, &[]);
    let lines = child.fake_lines();
    for want in [
        "cuMemCreate -> CUDA_ERROR_INVALID_VALUE: size 1048576 is not a positive multiple",
        "cuMemExportToShareableHandle -> CUDA_ERROR_INVALID_VALUE: the allocation was not created with",
        "cuMemcpyHtoD_v2 -> CUDA_ERROR_INVALID_VALUE: destination",
        "cuMemAddressFree -> CUDA_ERROR_INVALID_VALUE: the range is still mapped",
        "cuMemImportFromShareableHandle -> CUDA_ERROR_INVALID_VALUE: fd",
        "cuEventElapsedTime -> CUDA_ERROR_INVALID_HANDLE: an event was created with CU_EVENT_DISABLE_TIMING",
        "cuMemHostRegister_v2 -> CUDA_ERROR_INVALID_VALUE",
    ] {
        assert!(
            lines.iter().any(|l| l.contains(want)),
            "no `{want}` in:\n{}",
            lines.join("\n")
        );
    }
}

#[test]
fn a_pageable_htod_lands_in_legacy_stream_order() {
    // The child asserts what each stream reads; no driver call fails, nothing leaks.
    let child = run_child("child::fake_stages_pageable_htod", 1, &[]);
    assert!(
        child.fake_lines().is_empty(),
        "the fake logged:\n{}",
        child.fake_lines().join("\n")
    );
}

#[test]
fn a_staged_htod_to_unmapped_memory_faults() {
    let child = run_child(
        "child::fake_faults_a_staged_htod_to_unmapped_memory",
        1,
        &[],
    );
    let lines = child.fake_lines();
    for want in [
        "FAULT on device 0: copy destination",
        "cuStreamSynchronize -> CUDA_ERROR_ILLEGAL_ADDRESS",
    ] {
        assert!(
            lines.iter().any(|l| l.contains(want)),
            "no `{want}` in:\n{}",
            lines.join("\n")
        );
    }
    // The copy itself and the unmap succeeded: the fault came when the copy landed.
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("cuMemcpyHtoD_v2 ->") || l.contains("cuMemUnmap ->")),
        "{}",
        lines.join("\n")
    );
}

#[test]
fn a_registration_without_portable_is_pinned_for_its_context_only() {
    let child = run_child(
        "child::fake_non_portable_registration",
        1,
        &[("FAKE_CUDA_DEVICES", "2")],
    );
    // The two refusals asked for (device 1 naming device 0's registration), nothing else.
    let lines = child.fake_lines();
    assert_eq!(lines.len(), 2, "{}", lines.join("\n"));
    assert!(
        lines[0].contains("cuMemHostGetDevicePointer_v2 -> CUDA_ERROR_INVALID_VALUE")
            && lines[0].contains("without PORTABLE"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].contains("cuMemcpyDtoH_v2 -> CUDA_ERROR_INVALID_VALUE: source")
            && lines[1].contains("device 1 may not read this host registration"),
        "{}",
        lines[1]
    );
}

/// The tests the parents above run in a child process with the fake libcuda loaded.
mod child {
    use std::ffi::{CString, c_uint, c_void};
    use std::os::fd::AsRawFd;

    use cudarc::driver::sys;
    use shardwire_gpu::cuda::device::{copy_to_device, copy_to_host};
    use shardwire_gpu::cuda::{
        Device, DeviceBuffer, DeviceRange, Engines, H2dStager, HostMapped, PinnedBuffer,
        StageError, VmmRegion, open_for_service,
    };
    use shardwire_gpu::kernels::{self, Frag, Span};
    use shardwire_gpu::{GpuError, MemoryChoice, choose_memory, probe_gpus};

    use super::{CHILD, FAKE_NAME};

    /// False (and the test passes) outside a child of the tests above.
    fn in_child() -> bool {
        let yes = std::env::var_os(CHILD).is_some();
        if !yes {
            println!("runs only in a child with the fake libcuda (see fake_driver.rs)");
        }
        yes
    }

    fn ok(call: &str, r: sys::CUresult) {
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn probe_reports_the_fake_device() {
        if !in_child() {
            return;
        }
        let probe = probe_gpus();
        assert!(probe.driver_present && probe.usable, "{probe:?}");
        assert_eq!(probe.driver_version, Some(12080));
        assert_eq!(probe.devices.len(), 1);
        let d = &probe.devices[0];
        assert_eq!(d.name, FAKE_NAME);
        assert_eq!(
            d.pci_bus_id, "0000:fa:00.0",
            "the probe spells it as sysfs does"
        );
        assert_eq!(
            d.uuid.as_deref(),
            Some("GPU-5a77fa4e-0000-40fa-8000-000000000000")
        );
        assert!(
            d.dma_buf_supported && d.vmm_supported && d.gpu_direct_rdma_with_cuda_vmm_supported
        );
        assert_eq!(d.compute_capability, (8, 0));
        assert!(d.total_memory > 0);
        let decision = choose_memory(MemoryChoice::Auto, &probe).unwrap();
        assert_eq!(
            decision.memory,
            shardwire_protocol::trainer::MemoryKind::Cuda
        );
        assert!(
            decision
                .reason
                .contains("GPU 0 (shardwire fake CUDA device (host memory), 0000:fa:00.0)"),
            "{}",
            decision.reason
        );
        let mem = open_for_service(decision.device.as_ref().unwrap()).expect("self-test");
        assert_eq!(mem.info.name, FAKE_NAME);
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn several_devices() {
        if !in_child() {
            return;
        }
        let probe = probe_gpus();
        assert!(probe.usable, "{probe:?}");
        let ids: Vec<&str> = probe
            .devices
            .iter()
            .map(|d| d.pci_bus_id.as_str())
            .collect();
        assert_eq!(ids, ["0000:03:00.0", "0000:1a:00.0", "0001:17:00.0"]);
        // The driver itself prints upper-case hex, as the real one does.
        let mut raw = [0 as std::ffi::c_char; 32];
        let dev1 = Device::open(1).unwrap();
        // SAFETY: the fake is loaded; the buffer is live and its length is passed.
        ok("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(raw.as_mut_ptr(), raw.len() as i32, 1)
        });
        // SAFETY: the driver NUL-terminated the string within the buffer.
        let printed = unsafe { std::ffi::CStr::from_ptr(raw.as_ptr()) };
        assert_eq!(printed.to_str().unwrap(), "0000:1A:00.0");
        drop(dev1);
        let uuids: Vec<&str> = probe
            .devices
            .iter()
            .map(|d| d.uuid.as_deref().expect("a UUID"))
            .collect();
        assert_eq!(
            uuids,
            [
                "GPU-5a77fa4e-0000-4003-8000-000000000000",
                "GPU-5a77fa4e-0000-401a-8000-000000000000",
                "GPU-5a77fa4e-0001-4017-8000-000000000000"
            ]
        );
        // Found by bus id in any case, with or without the domain.
        for (bus, want) in [("0000:1a:00.0", 1), ("1A:00.0", 1), ("0001:17:00.0", 2)] {
            let mut dev: sys::CUdevice = -1;
            let c = CString::new(bus).unwrap();
            // SAFETY: the fake is loaded and initialised (by the probe); live out-pointer.
            ok("cuDeviceGetByPCIBusId", unsafe {
                sys::cuDeviceGetByPCIBusId(&mut dev, c.as_ptr())
            });
            assert_eq!(dev, want, "{bus}");
        }
        let mut missing: sys::CUdevice = -1;
        let c = CString::new("0000:fa:00.0").unwrap();
        // SAFETY: as above.
        let r = unsafe { sys::cuDeviceGetByPCIBusId(&mut missing, c.as_ptr()) };
        assert_eq!(r, sys::CUresult::CUDA_ERROR_INVALID_DEVICE);
        // Each device opens for the service (self-test on its own memory).
        let mems: Vec<_> = probe
            .devices
            .iter()
            .map(|d| open_for_service(d).expect("self-test"))
            .collect();
        // The current context's device is the one bound last.
        mems[2].device.bind().unwrap();
        let mut cur: sys::CUdevice = -1;
        // SAFETY: a context is current on this thread; live out-pointer.
        ok("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut cur) });
        assert_eq!(cur, 2);
        // A region on device 1 takes writes through device 1, not through device 0.
        let region = VmmRegion::new(&mems[1].device, 4 << 20).unwrap();
        region.write(0, b"lane one").unwrap();
        mems[0].device.bind().unwrap();
        let bytes = [7u8; 16];
        // SAFETY: device 0's context is current; the source is a live host buffer.
        let r = unsafe {
            sys::cuMemcpyHtoD_v2(region.device_ptr(), bytes.as_ptr().cast::<c_void>(), 16)
        };
        assert_eq!(r, sys::CUresult::CUDA_ERROR_INVALID_VALUE);
        let mut back = [0u8; 8];
        region.read(0, &mut back).unwrap();
        assert_eq!(&back, b"lane one");
        // Device 0's engines refuse device 1's region before any driver call: a launch on it
        // would fault device 0's context for good (before, nothing compared the devices).
        let engines = Engines::new(&mems[0].device).unwrap();
        let own = VmmRegion::new(&mems[0].device, 2 << 20).unwrap();
        let frag = [Frag {
            src_off: 0,
            dst_off: 0,
            len: 8,
        }];
        let Err(e) = engines.gather(&own, &region, &frag) else {
            panic!("refused")
        };
        assert!(
            matches!(
                e,
                GpuError::WrongDevice {
                    region: 1,
                    engines: 0,
                    ..
                }
            ),
            "{e}"
        );
        let Err(e) = engines.gather(&region, &own, &frag) else {
            panic!("refused")
        };
        assert!(
            matches!(
                e,
                GpuError::WrongDevice {
                    what: "the gather's source",
                    ..
                }
            ),
            "{e}"
        );
        let Err(e) = engines.copy(&region, 0, &own, 0, 8) else {
            panic!("refused")
        };
        assert!(matches!(e, GpuError::WrongDevice { .. }), "{e}");
        let span = [Span { off: 0, len: 8 }];
        let Err(e) = engines.crc32c(&region, &span) else {
            panic!("refused")
        };
        assert!(matches!(e, GpuError::WrongDevice { .. }), "{e}");
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn probe_with_a_pre_ampere_gpu() {
        if !in_child() {
            return;
        }
        let probe = probe_gpus();
        let d = &probe.devices[0];
        assert_eq!(d.compute_capability, (7, 5), "read from the driver");
        assert!(d.dma_buf_supported && d.vmm_supported, "{d:?}");
        assert!(!d.usable() && !probe.usable, "{probe:?}");
        let why = format!(
            "GPU 0 ({FAKE_NAME}, 0000:fa:00.0): compute capability 7.5 is below 8.0 (the \
             kernels are sm_80 PTX: Ampere or later)"
        );
        assert!(probe.reason.contains(&why), "{}", probe.reason);
        let auto = choose_memory(MemoryChoice::Auto, &probe).unwrap();
        assert_eq!(auto.memory, shardwire_protocol::trainer::MemoryKind::Host);
        assert!(auto.reason.contains(&why), "{}", auto.reason);
        let e = choose_memory(MemoryChoice::Cuda, &probe).unwrap_err();
        assert!(e.to_string().contains(&why), "{e}");
        // What the probe now spares the node: the kernels cannot load on this device.
        let dev = Device::open(0).unwrap();
        assert!(matches!(
            Engines::new(&dev),
            Err(GpuError::Driver {
                call: "cuModuleLoadData",
                result: sys::CUresult::CUDA_ERROR_INVALID_PTX
            })
        ));
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn probe_with_an_old_driver() {
        if !in_child() {
            return;
        }
        let probe = probe_gpus();
        assert!(!probe.usable, "{probe:?}");
        assert!(
            probe.reason.contains("CUDA driver 12.4 is older than 12.8"),
            "{}",
            probe.reason
        );
        let e = choose_memory(MemoryChoice::Cuda, &probe).unwrap_err();
        assert!(e.to_string().contains("older than 12.8"), "{e}");
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn probe_without_devices() {
        if !in_child() {
            return;
        }
        let probe = probe_gpus();
        assert!(probe.driver_present && !probe.usable, "{probe:?}");
        assert!(
            probe.reason.contains("CUDA_ERROR_NO_DEVICE"),
            "{}",
            probe.reason
        );
        let d = choose_memory(MemoryChoice::Auto, &probe).unwrap();
        assert_eq!(
            d.memory,
            shardwire_protocol::trainer::MemoryKind::Host,
            "{}",
            d.reason
        );
        // cuInit failed, so the driver is not initialised: it answers NOT_INITIALIZED, not a
        // count of 0 (the probe loaded libcuda).
        let mut count = -1;
        // SAFETY: libcuda is loaded; the out-pointer is a live local.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        assert_eq!(r, sys::CUresult::CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(count, -1);
        // Opening a device says why: cuInit's own error, again.
        assert!(matches!(
            Device::open(0),
            Err(GpuError::Driver {
                call: "cuInit",
                result: sys::CUresult::CUDA_ERROR_NO_DEVICE
            })
        ));
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn dmabuf_export_without_the_pcie_flag() {
        if !in_child() {
            return;
        }
        let dev = Device::open(0).unwrap();
        let r = VmmRegion::new(&dev, 1).unwrap();
        let fd = r
            .export_dmabuf()
            .expect("falls back to the default mapping type");
        assert!(fd.as_raw_fd() >= 0);
        // The flag itself is refused, as the parent's driver mode says.
        let mut raw: i32 = -1;
        // SAFETY: the region is mapped; the driver writes an int through the pointer.
        let result = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut raw as *mut i32).cast(),
                r.device_ptr(),
                r.len(),
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                sys::CUmemRangeFlags::CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE as u64,
            )
        };
        let want = match std::env::var("CHILD_EXPECT_REFUSAL").as_deref() {
            Ok("CUDA_ERROR_NOT_SUPPORTED") => sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
            _ => sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        };
        assert_eq!(result, want);
        // And the service's self-test and dma-buf check still pass.
        let engines = Engines::new(&dev).unwrap();
        shardwire_gpu::cuda::self_test(&dev, &engines).unwrap();
        let check = shardwire_gpu::cuda::selftest::check_dma_buf(&dev, true).unwrap();
        assert_eq!(check.refused, None);
        if std::env::var("FAKE_CUDA_HOST_COHERENT").as_deref() != Ok("1") {
            // A PCIe GPU: the refusal is what drivers do there and the default mapping is
            // PCIe, so nothing to say (before, every lane warned that a NIC may not reach it).
            assert_eq!(check.default_mapping, None);
            return;
        }
        // Grace Hopper: the default mapping is C2C. Said, not silent.
        let why = check
            .default_mapping
            .expect("the default mapping is reported");
        let refusal = std::env::var("CHILD_EXPECT_REFUSAL").unwrap();
        assert!(
            why.contains("refused the PCIe mapping type")
                && why.contains(&refusal)
                && why.contains("cache-coherent with the CPU"),
            "{why}"
        );
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn dmabuf_refused_is_reported_not_fatal() {
        if !in_child() {
            return;
        }
        let probe = shardwire_gpu::probe_gpus();
        let info = &probe.devices[0];
        assert!(info.dma_buf_supported, "the attribute still says supported");
        let mem = shardwire_gpu::cuda::open_for_service(info).expect("the GPU opens");
        let why = mem.dma_buf_refused.expect("the refusal is reported");
        assert!(
            why.contains("refused the dma-buf export")
                && why.contains("cuMemGetHandleForAddressRange")
                && why.contains("CUDA_ERROR_NOT_SUPPORTED"),
            "{why}"
        );
        // Both refusals are kept: with the PCIe mapping type, and without it (before, only
        // the second).
        let region = VmmRegion::new(&mem.device, 1).unwrap();
        let Err(GpuError::DmaBufRefused { pcie, fallback }) = region.export_dmabuf() else {
            panic!("both exports are refused");
        };
        for e in [*pcie, *fallback] {
            assert!(
                matches!(
                    e,
                    GpuError::Driver {
                        call: "cuMemGetHandleForAddressRange",
                        result: sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                    }
                ),
                "{e}"
            );
        }
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn bad_ranges_never_reach_the_driver() {
        if !in_child() {
            return;
        }
        let dev = Device::open(0).unwrap();
        let engines = Engines::new(&dev).unwrap();
        let r = VmmRegion::new(&dev, 1).unwrap();
        let other = VmmRegion::new(&dev, 1).unwrap();
        let mut stager = H2dStager::new(&dev, 4096, 2).unwrap();
        let len = r.len();
        eprintln!("BEGIN bad ranges");
        assert!(matches!(
            r.read(len - 10, &mut [0; 11]),
            Err(GpuError::OutOfRange { .. })
        ));
        assert!(matches!(
            r.write(len, &[1]),
            Err(GpuError::OutOfRange { .. })
        ));
        assert!(matches!(
            r.read(usize::MAX, &mut [0; 2]),
            Err(GpuError::OutOfRange { .. })
        ));
        let past = Frag {
            src_off: len as u64 - 4,
            dst_off: 0,
            len: 8,
        };
        assert!(matches!(
            engines.gather(&r, &other, &[past]),
            Err(GpuError::Kernel(_))
        ));
        let span = Span {
            off: 1,
            len: len as u64,
        };
        assert!(matches!(
            engines.crc32c(&r, &[span]),
            Err(GpuError::Kernel(_))
        ));
        assert!(matches!(
            engines.copy(&r, len - 1, &other, 0, 2),
            Err(GpuError::OutOfRange { .. })
        ));
        // Overlapping bytes of one region (cuMemcpy on them is undefined), either way round.
        assert!(matches!(
            engines.copy(&r, 0, &r, 100, 200),
            Err(GpuError::OverlappingCopy {
                src_off: 0,
                dst_off: 100,
                len: 200
            })
        ));
        assert!(matches!(
            engines.copy(&r, 300, &r, 100, 201),
            Err(GpuError::OverlappingCopy {
                src_off: 300,
                dst_off: 100,
                len: 201
            })
        ));
        let mut fill = |b: &mut [u8]| Ok(b.len());
        assert!(
            stager
                .copy_from(&mut fill, &mut |_| {}, &r, len - 4095, 4096)
                .is_err()
        );
        eprintln!("END bad ranges");
        // In range, the same calls go through.
        r.write(len - 11, &[7; 11]).unwrap();
        let mut back = [0; 11];
        r.read(len - 11, &mut back).unwrap();
        assert_eq!(back, [7; 11]);
        // Adjacent ranges of one region do not overlap: copied.
        r.write(0, b"hello world").unwrap();
        engines.copy(&r, 0, &r, 11, 11).unwrap().wait().unwrap();
        r.read(11, &mut back).unwrap();
        assert_eq!(&back, b"hello world");
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn regions_dropped_on_a_thread_without_a_context() {
        if !in_child() {
            return;
        }
        let vmm_mappings = || {
            std::fs::read_to_string("/proc/self/maps")
                .unwrap()
                .lines()
                .filter(|l| l.contains("fakecuda-vmm"))
                .count()
        };
        let dev = Device::open(0).unwrap();
        let region = VmmRegion::new(&dev, 4 << 20).unwrap();
        region.write(0, b"shard bytes").unwrap();
        assert!(vmm_mappings() > 0);
        // Stream regions are dropped wherever their last user is (a tokio worker, a receiver
        // thread) which may never have made the context current.
        std::thread::spawn(move || drop(region)).join().unwrap();
        assert_eq!(vmm_mappings(), 0, "the region's mapping outlived it");
        // The fake logs any failed call or leak to stderr; the parent checks there are none.
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn a_failed_staged_copy_lands_nothing_afterwards() {
        if !in_child() {
            return;
        }
        // The fake runs queued copies only when the host waits: before, a copy that failed
        // after two buffers left them queued, and they landed over what was written next
        // (the slab refetched into the same memory) when the stager next waited.
        let dev = Device::open(0).unwrap();
        let region = VmmRegion::new(&dev, 4 << 20).unwrap();
        let mut stager = H2dStager::new(&dev, 4096, 4).unwrap();
        let mut calls = 0;
        let failed = stager.copy_from(
            &mut |buf: &mut [u8]| {
                calls += 1;
                match calls {
                    1 | 2 => {
                        buf.fill(0xAA);
                        Ok(buf.len())
                    }
                    _ => Err(std::io::Error::other("connection reset")),
                }
            },
            &mut |_| {},
            &region,
            0,
            4 * 4096,
        );
        assert!(failed.is_err());
        region.write(0, &[0x55; 8192]).unwrap();
        drop(stager); // waits for anything still queued
        let mut back = vec![0; 8192];
        region.read(0, &mut back).unwrap();
        let stale = back.iter().filter(|&&b| b != 0x55).count();
        assert_eq!(
            stale, 0,
            "bytes of the failed copy landed after it returned"
        );
    }

    /// The fake's own checks, with raw driver calls (what the crate must never do).
    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn fake_checks() {
        if !in_child() {
            return;
        }
        let dev = Device::open(0).unwrap();
        // No context on a fresh thread: CUDA_ERROR_INVALID_CONTEXT.
        let on_fresh_thread = std::thread::spawn(|| {
            let mut p = 0;
            // SAFETY: a live out-pointer.
            unsafe { sys::cuMemAlloc_v2(&mut p, 16) }
        })
        .join()
        .unwrap();
        assert_eq!(on_fresh_thread, sys::CUresult::CUDA_ERROR_INVALID_CONTEXT);

        // A copy past the end of an allocation: CUDA_ERROR_INVALID_VALUE.
        let buf = DeviceBuffer::new(&dev, 4096).unwrap();
        assert!(matches!(
            // SAFETY: the fake checks device bounds (what this asserts); nothing else uses
            // the buffer.
            unsafe { copy_to_device(&dev, buf.ptr() + 4000, &[0; 97]) },
            Err(GpuError::Driver {
                result: sys::CUresult::CUDA_ERROR_INVALID_VALUE,
                ..
            })
        ));
        // SAFETY: inside the test's own live device buffer, which nothing else uses.
        unsafe { copy_to_device(&dev, buf.ptr() + 4000, &[0; 96]).unwrap() };

        // Streams are deferred: a pinned source rewritten before the stream ran is what lands.
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the context is current; live out-pointer.
        ok("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, 1)
        });
        // SAFETY: inside the test's own live device buffer, which nothing else uses.
        unsafe { copy_to_device(&dev, buf.ptr(), &[0; 4096]).unwrap() };
        let mut pinned = PinnedBuffer::new(&dev, 4096).unwrap();
        pinned.as_mut_slice().fill(1);
        // SAFETY: 4096 pinned bytes to a 4096-byte device buffer.
        ok("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(buf.ptr(), pinned.as_slice().as_ptr().cast(), 4096, stream)
        });
        pinned.as_mut_slice().fill(2); // a bug: the copy's event was not waited for
        let mut back = vec![0u8; 4096];
        // SAFETY: inside the test's own live device buffer, which nothing else uses.
        unsafe { copy_to_host(&dev, &mut back, buf.ptr()).unwrap() };
        assert!(
            back.iter().all(|&b| b == 0),
            "the copy ran before the host waited"
        );
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream)
        });
        // SAFETY: inside the test's own live device buffer, which nothing else uses.
        unsafe { copy_to_host(&dev, &mut back, buf.ptr()).unwrap() };
        assert!(back.iter().all(|&b| b == 2));

        // A PTX whose entry does not match the compiled-in kernel is refused.
        let stale = kernels::PTX.replace(
            ".param .u32 sw_gather_param_3",
            ".param .u64 sw_gather_param_3",
        );
        let stale = CString::new(stale).unwrap();
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: NUL-terminated text; live out-pointer.
        let r = unsafe { sys::cuModuleLoadData(&mut module, stale.as_ptr().cast()) };
        assert_eq!(r, sys::CUresult::CUDA_ERROR_INVALID_IMAGE);

        // A gather that writes past its destination: the launch is accepted, the stream
        // faults (CUDA_ERROR_ILLEGAL_ADDRESS) and the context stays unusable.
        let ptx = CString::new(kernels::PTX).unwrap();
        // SAFETY: as above.
        ok("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast())
        });
        let mut gather: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        ok("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut gather, module, c"sw_gather".as_ptr())
        });
        let src = DeviceBuffer::new(&dev, 4096).unwrap();
        let frags = DeviceBuffer::new(&dev, 24).unwrap();
        let frag = Frag {
            src_off: 0,
            dst_off: 4000,
            len: 200,
        };
        // SAFETY: Frag is repr(C) of three u64.
        let bytes = unsafe { std::slice::from_raw_parts((&frag as *const Frag).cast::<u8>(), 24) };
        // SAFETY: inside the test's own live device buffer, which nothing else uses.
        unsafe { copy_to_device(&dev, frags.ptr(), bytes).unwrap() };
        let (mut s, mut d, mut f, mut n) = (src.ptr(), buf.ptr(), frags.ptr(), 1 as c_uint);
        let mut params = [
            (&mut s as *mut u64).cast::<c_void>(),
            (&mut d as *mut u64).cast(),
            (&mut f as *mut u64).cast(),
            (&mut n as *mut c_uint).cast(),
        ];
        // SAFETY: four parameters of the types sw_gather declares.
        ok("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                gather,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        });
        // SAFETY: a live stream.
        let synced = unsafe { sys::cuStreamSynchronize(stream) };
        assert_eq!(synced, sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        let mut p = 0;
        // SAFETY: live out-pointer.
        let after = unsafe { sys::cuMemAlloc_v2(&mut p, 16) };
        assert_eq!(after, sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        // The last release of the primary context resets it (the fake reports what was
        // still alive then as a leak; the parent does not check that here).
        drop((buf, src, frags, pinned, dev));
    }

    /// The fake's VMM, event and host-registration rules, with raw driver calls.
    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn fake_vmm_event_and_registration_rules() {
        if !in_child() {
            return;
        }
        use sys::CUresult::{
            CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_READY,
        };
        let _dev = Device::open(0).unwrap(); // its context is current here until the end
        const G: usize = 2 << 20;
        // SAFETY: all-zero is a valid CUmemAllocationProp; the fields that matter are set.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: every call below gets valid arguments and live out-pointers, and the
        // context is current on this thread.
        unsafe {
            // Sizes are multiples of the granularity; only requested handle types export.
            assert_eq!(
                sys::cuMemCreate(&mut h, G / 2, &prop, 0),
                CUDA_ERROR_INVALID_VALUE
            );
            ok("cuMemCreate", sys::cuMemCreate(&mut h, G, &prop, 0));
            let mut fd: i32 = -1;
            assert_eq!(
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut i32).cast(),
                    h,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0
                ),
                CUDA_ERROR_INVALID_VALUE
            );
            // Mapped memory is not accessible until cuMemSetAccess.
            let mut ptr = 0;
            ok(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, G, G, 0, 0),
            );
            assert_eq!(ptr % G as u64, 0);
            ok("cuMemMap", sys::cuMemMap(ptr, G, 0, h, 0));
            let bytes = [5u8; 64];
            assert_eq!(
                sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), 64),
                CUDA_ERROR_INVALID_VALUE
            );
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok("cuMemSetAccess", sys::cuMemSetAccess(ptr, G, &access, 1));
            ok(
                "cuMemcpyHtoD_v2",
                sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), 64),
            );
            // The handle may go while mapped (the mapping keeps the memory); the range may
            // not be freed while mapped.
            ok("cuMemRelease", sys::cuMemRelease(h));
            let mut back = [0u8; 64];
            ok(
                "cuMemcpyDtoH_v2",
                sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), ptr, 64),
            );
            assert_eq!(back, bytes);
            assert_eq!(sys::cuMemAddressFree(ptr, G), CUDA_ERROR_INVALID_VALUE);
            ok("cuMemUnmap", sys::cuMemUnmap(ptr, G));
            ok("cuMemAddressFree", sys::cuMemAddressFree(ptr, G));

            // Only CUDA shareable handles import.
            let file = std::fs::File::open("/proc/self/maps").unwrap();
            let raw = file.as_raw_fd() as isize as *mut c_void;
            assert_eq!(
                sys::cuMemImportFromShareableHandle(
                    &mut h,
                    raw,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ),
                CUDA_ERROR_INVALID_VALUE
            );

            // Elapsed time needs timing events that completed.
            let mut stream: sys::CUstream = std::ptr::null_mut();
            ok("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));
            let (mut a, mut b, mut untimed) = (
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            ok("cuEventCreate", sys::cuEventCreate(&mut a, 0));
            ok("cuEventCreate", sys::cuEventCreate(&mut b, 0));
            ok("cuEventCreate", sys::cuEventCreate(&mut untimed, 2));
            ok("cuEventRecord", sys::cuEventRecord(a, stream));
            ok("cuEventRecord", sys::cuEventRecord(b, stream));
            ok("cuEventRecord", sys::cuEventRecord(untimed, stream));
            let mut ms = -1f32;
            assert_eq!(sys::cuEventElapsedTime(&mut ms, a, b), CUDA_ERROR_NOT_READY);
            assert_eq!(sys::cuEventQuery(untimed), CUDA_ERROR_NOT_READY); // and it runs
            ok("cuEventQuery", sys::cuEventQuery(untimed));
            ok("cuEventElapsedTime", sys::cuEventElapsedTime(&mut ms, a, b));
            assert!(ms >= 0.0, "{ms}");
            assert_eq!(
                sys::cuEventElapsedTime(&mut ms, a, untimed),
                CUDA_ERROR_INVALID_HANDLE
            );
            for e in [a, b, untimed] {
                ok("cuEventDestroy_v2", sys::cuEventDestroy_v2(e));
            }
            ok("cuStreamDestroy_v2", sys::cuStreamDestroy_v2(stream));

            // A read-only mapping registers only with CU_MEMHOSTREGISTER_READ_ONLY.
            let len = 1 << 16;
            let ro = rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::PRIVATE,
            )
            .unwrap();
            let devicemap = sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            assert_eq!(
                sys::cuMemHostRegister_v2(ro, len, devicemap),
                CUDA_ERROR_INVALID_VALUE
            );
            let read_only = devicemap | sys::CU_MEMHOSTREGISTER_READ_ONLY;
            ok(
                "cuMemHostRegister_v2",
                sys::cuMemHostRegister_v2(ro, len, read_only),
            );
            let mut dptr = 0;
            ok(
                "cuMemHostGetDevicePointer_v2",
                sys::cuMemHostGetDevicePointer_v2(&mut dptr, ro, 0),
            );
            assert_eq!(dptr, ro as u64);
            ok("cuMemHostUnregister", sys::cuMemHostUnregister(ro));
            rustix::mm::munmap(ro, len).unwrap();
        }
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn a_failed_crc_waits_for_its_kernels() {
        if !in_child() {
            return;
        }
        // The parent makes the second launch fail: this CRC's combine, after its spans were
        // uploaded from argument slot 0 and its chunks kernel queued.
        let dev = Device::open(0).unwrap();
        let engines = Engines::new(&dev).unwrap();
        let src = VmmRegion::new(&dev, 2 << 20).unwrap();
        let dst = VmmRegion::new(&dev, 4 << 20).unwrap();
        let end = src.len() as u64;
        src.write(0, &[1; 4096]).unwrap();
        src.write(src.len() - 16, b"the last sixteen").unwrap();
        let spans = [Span { off: 0, len: 4096 }];
        let Err(e) = engines.crc32c(&src, &spans) else {
            panic!("the combine launch is refused");
        };
        assert!(
            matches!(
                e,
                GpuError::Driver {
                    call: "cuLaunchKernel",
                    result: sys::CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
                }
            ),
            "{e}"
        );
        // The next call stages into the same slot. Before, the failed call's upload and
        // chunks kernel were still queued and read this gather's frag as their span
        // ({off: end - 16, len: 1 MiB}): a read past `src`, which faulted the context.
        let frag = [Frag {
            src_off: end - 16,
            dst_off: 1 << 20,
            len: 16,
        }];
        engines.gather(&src, &dst, &frag).unwrap().wait().unwrap();
        let mut back = [0u8; 16];
        dst.read(1 << 20, &mut back).unwrap();
        assert_eq!(&back, b"the last sixteen");
        // And the CRC works again.
        let crc = engines.crc32c(&src, &spans).unwrap();
        assert_eq!(
            crc,
            [crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, &[1; 4096]) as u32]
        );
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn a_failed_gather_lands_nothing_afterwards() {
        if !in_child() {
            return;
        }
        // The parent makes the first cuEventCreate fail: the gather's slot event, after its
        // kernel was queued.
        let dev = Device::open(0).unwrap();
        let engines = Engines::new(&dev).unwrap();
        let src = VmmRegion::new(&dev, 1).unwrap();
        let dst = VmmRegion::new(&dev, 1).unwrap();
        src.write(0, &[0xAA; 4096]).unwrap();
        let frag = [Frag {
            src_off: 0,
            dst_off: 0,
            len: 4096,
        }];
        let Err(e) = engines.gather(&src, &dst, &frag) else {
            panic!("the slot's event is refused");
        };
        assert!(
            matches!(
                e,
                GpuError::Driver {
                    call: "cuEventCreate",
                    result: sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
                }
            ),
            "{e}"
        );
        // The caller owns `dst` again and rewrites it. Before, the failed gather was still
        // queued and landed over these bytes when the stream next ran.
        dst.write(0, &[0x55; 4096]).unwrap();
        engines.stream().synchronize().unwrap();
        let mut back = vec![0u8; 4096];
        dst.read(0, &mut back).unwrap();
        let stale = back.iter().filter(|&&b| b != 0x55).count();
        assert_eq!(
            stale, 0,
            "bytes of the failed gather landed after it returned"
        );
        // The slots are usable: the same gather goes through now.
        engines.gather(&src, &dst, &frag).unwrap().wait().unwrap();
        dst.read(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0xAA));
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn other_gpus_registration_is_refused() {
        if !in_child() {
            return;
        }
        let (dev0, dev1) = (Device::open(0).unwrap(), Device::open(1).unwrap());
        let len = 1 << 16;
        // SAFETY: a fresh private anonymous mapping, unmapped at the end after the
        // registration over it is dropped.
        let host = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .unwrap();
        // SAFETY: `host` is the live, page-aligned mapping of `len` bytes just made; nothing
        // else uses it.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0x3C, len) };
        // SAFETY: as above; it stays mapped until after `mapped` is dropped.
        let mapped = unsafe { HostMapped::new(&dev0, host.cast(), len) }.unwrap();
        // The registration names the GPU that registered it: only its engines read it,
        // since its Drop waits for that GPU alone (before: `None`, any GPU's engines).
        assert_eq!(mapped.device_ordinal(), Some(0));
        let frag = [Frag {
            src_off: 0,
            dst_off: 0,
            len: 64,
        }];
        let engines1 = Engines::new(&dev1).unwrap();
        let dst1 = VmmRegion::new(&dev1, 1).unwrap();
        let Err(e) = engines1.gather(&mapped, &dst1, &frag) else {
            panic!("GPU 1's engines refuse GPU 0's registration");
        };
        assert!(
            matches!(
                e,
                GpuError::WrongDevice {
                    what: "the gather's source",
                    region: 0,
                    engines: 1
                }
            ),
            "{e}"
        );
        let engines0 = Engines::new(&dev0).unwrap();
        let dst0 = VmmRegion::new(&dev0, 1).unwrap();
        engines0
            .gather(&mapped, &dst0, &frag)
            .unwrap()
            .wait()
            .unwrap();
        let mut back = [0u8; 64];
        dst0.read(0, &mut back).unwrap();
        assert_eq!(back, [0x3C; 64]);
        drop(mapped);
        // SAFETY: the mapping made above; its registration is gone.
        unsafe { rustix::mm::munmap(host, len) }.unwrap();
    }

    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn other_gpus_region_is_refused_by_a_stager() {
        if !in_child() {
            return;
        }
        let (dev0, dev1) = (Device::open(0).unwrap(), Device::open(1).unwrap());
        let dst1 = VmmRegion::new(&dev1, 1).unwrap();
        // A stager of GPU 0 refuses GPU 1's region before it reads a byte of the source
        // (before, its copy reached the driver, which refused it).
        let mut stager = H2dStager::new(&dev0, 4096, 2).unwrap();
        let mut reads = 0;
        let refused = stager.copy_from(
            &mut |buf: &mut [u8]| {
                reads += 1;
                Ok(buf.len())
            },
            &mut |_| {},
            &dst1,
            0,
            100,
        );
        assert!(
            matches!(
                refused,
                Err(StageError::Gpu(GpuError::WrongDevice {
                    what: "the staged copy's destination",
                    region: 1,
                    engines: 0
                }))
            ),
            "{refused:?}"
        );
        assert_eq!(reads, 0);
    }

    /// The fake's implicit synchronisation, with raw driver calls: freeing memory runs the
    /// queued work of the memory's device only, unmapping runs none.
    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn fake_drains_only_the_freeing_device() {
        if !in_child() {
            return;
        }
        const G: usize = 2 << 20;
        let (dev0, dev1) = (Device::open(0).unwrap(), Device::open(1).unwrap());
        let buf = DeviceBuffer::new(&dev0, 4096).unwrap();
        // SAFETY: the test's own live device buffer, which nothing else uses.
        unsafe { copy_to_device(&dev0, buf.ptr(), &[0; 4096]).unwrap() };
        let mut pinned = PinnedBuffer::new(&dev0, 4096).unwrap();
        pinned.as_mut_slice().fill(9);
        let landed = || {
            let mut back = vec![0u8; 4096];
            // SAFETY: the test's own live device buffer; the pending copy is on a
            // non-blocking stream, which this synchronous copy does not wait for.
            unsafe { copy_to_host(&dev0, &mut back, buf.ptr()).unwrap() };
            back.iter().all(|&b| b == 9)
        };
        dev0.bind().unwrap();
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: every call below gets valid arguments and live out-pointers, with the
        // context of the device named current.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));
            ok(
                "cuMemcpyHtoDAsync_v2",
                sys::cuMemcpyHtoDAsync_v2(
                    buf.ptr(),
                    pinned.as_slice().as_ptr().cast(),
                    4096,
                    stream,
                ),
            );
            // Unmapping a VMM range of device 0 runs nothing (none is documented).
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            let mut ptr: sys::CUdeviceptr = 0;
            ok("cuMemCreate", sys::cuMemCreate(&mut h, G, &prop, 0));
            ok(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, G, G, 0, 0),
            );
            ok("cuMemMap", sys::cuMemMap(ptr, G, 0, h, 0));
            ok("cuMemUnmap", sys::cuMemUnmap(ptr, G));
            ok("cuMemAddressFree", sys::cuMemAddressFree(ptr, G));
            ok("cuMemRelease", sys::cuMemRelease(h));
        }
        assert!(!landed(), "cuMemUnmap ran queued work");
        // Freeing device 1's memory runs device 1's work, not device 0's.
        drop(DeviceBuffer::new(&dev1, 16).unwrap());
        drop(PinnedBuffer::new(&dev1, 16).unwrap());
        assert!(!landed(), "freeing device 1's memory ran device 0's work");
        // Freeing device 0's memory runs it.
        drop(DeviceBuffer::new(&dev0, 16).unwrap());
        assert!(landed(), "freeing device 0's memory did not run its work");
        dev0.bind().unwrap();
        // SAFETY: the live stream made above, of the current context; its work has run.
        ok("cuStreamDestroy_v2", unsafe {
            sys::cuStreamDestroy_v2(stream)
        });
    }

    /// CU_STREAM_LEGACY, a handle every context accepts.
    fn legacy_stream() -> sys::CUstream {
        std::ptr::without_provenance_mut(1)
    }

    /// A synchronous H2D copy from pageable memory, with raw driver calls: the driver's
    /// "API synchronization behavior" notes say it returns once the bytes are staged, "but the
    /// DMA to final destination may not have completed". The copy is legacy-stream work: a
    /// blocking stream, a legacy-stream sync or a synchronous copy waits for it, a
    /// CU_STREAM_NON_BLOCKING stream (the engines') does not, and may read the OLD bytes (the
    /// real driver allows it; the fake does it every time). So the crate's `copy_to_device`
    /// synchronises the legacy stream after the copy.
    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn fake_stages_pageable_htod() {
        if !in_child() {
            return;
        }
        const N: usize = 4096;
        let dev = Device::open(0).unwrap();
        let engines = Engines::new(&dev).unwrap();
        let src = VmmRegion::new(&dev, 1).unwrap();
        let dst = VmmRegion::new(&dev, 1).unwrap();
        let frag = [Frag {
            src_off: 0,
            dst_off: 0,
            len: N as u64,
        }];
        // The gather (a kernel) writes dst[0..N), the copy (cuMemcpyDtoDAsync) dst[N..2N),
        // both on the engines' non-blocking stream; then the host reads what they read.
        let engines_read = || -> [Vec<u8>; 2] {
            engines.gather(&src, &dst, &frag).unwrap().wait().unwrap();
            engines.copy(&src, 0, &dst, N, N).unwrap().wait().unwrap();
            let (mut a, mut b) = (vec![0u8; N], vec![0u8; N]);
            dst.read(0, &mut a).unwrap();
            dst.read(N, &mut b).unwrap();
            [a, b]
        };
        fn all(bytes: &[u8], v: u8) -> bool {
            bytes.iter().all(|&b| b == v)
        }
        src.write(0, &[1; N]).unwrap();
        dst.write(0, &[0; 2 * N]).unwrap();
        let mut host = vec![2u8; N];

        // (a) No legacy sync: the non-blocking stream reads the old bytes.
        dev.bind().unwrap();
        // SAFETY: N pageable bytes into the test's own live region of the current context.
        ok("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(src.device_ptr(), host.as_ptr().cast(), N)
        });
        host.fill(0xEE); // staged at the call: the host buffer is the caller's again
        for (what, bytes) in ["gather", "async copy"].iter().zip(engines_read()) {
            assert!(
                all(&bytes, 1),
                "the {what} on a non-blocking stream saw the unsynchronised H2D copy"
            );
        }
        // The synchronous D2H copies above waited for the legacy stream: the staged bytes
        // landed (the ones of the call, not the host buffer's later ones).
        let mut back = vec![0u8; N];
        src.read(0, &mut back).unwrap();
        assert!(
            all(&back, 2),
            "the staged copy did not land at a legacy sync"
        );

        // With cuStreamSynchronize(CU_STREAM_LEGACY) in between: the new bytes.
        host.fill(3);
        dev.bind().unwrap();
        // SAFETY: as above.
        ok("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(src.device_ptr(), host.as_ptr().cast(), N)
        });
        host.fill(0xEE);
        // SAFETY: the legacy stream of the current context.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(legacy_stream())
        });
        for (what, bytes) in ["gather", "async copy"].iter().zip(engines_read()) {
            assert!(
                all(&bytes, 3),
                "the {what} missed the synchronised H2D copy"
            );
        }

        // A blocking stream (flags 0) synchronises with the legacy stream implicitly.
        host.fill(4);
        dev.bind().unwrap();
        let mut blocking: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid arguments and live out-pointers; the context is current; both ranges
        // lie inside the test's own regions.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut blocking, 0));
            ok(
                "cuMemcpyHtoD_v2",
                sys::cuMemcpyHtoD_v2(src.device_ptr(), host.as_ptr().cast(), N),
            );
            ok(
                "cuMemcpyDtoDAsync_v2",
                sys::cuMemcpyDtoDAsync_v2(dst.device_ptr(), src.device_ptr(), N, blocking),
            );
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(blocking));
            ok("cuStreamDestroy_v2", sys::cuStreamDestroy_v2(blocking));
        }
        dst.read(0, &mut back).unwrap();
        assert!(
            all(&back, 4),
            "a blocking stream ran before the legacy stream's copy"
        );

        // (b) The crate's copy_to_device, then the engines: the new bytes (it synchronises
        // the legacy stream).
        // SAFETY: inside the test's own live region, which nothing else uses meanwhile.
        unsafe { copy_to_device(&dev, src.device_ptr(), &[5; N]) }.unwrap();
        for (what, bytes) in ["gather", "async copy"].iter().zip(engines_read()) {
            assert!(all(&bytes, 5), "the {what} missed copy_to_device's bytes");
        }
    }

    /// A staged H2D copy whose destination is unmapped before it lands faults when it lands
    /// (cuMemUnmap documents no synchronisation), like any queued work.
    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn fake_faults_a_staged_htod_to_unmapped_memory() {
        if !in_child() {
            return;
        }
        const G: usize = 2 << 20;
        let _dev = Device::open(0).unwrap(); // its context is current here until the end
        let bytes = [7u8; 64];
        // SAFETY: every call below gets valid arguments and live out-pointers, and the
        // context is current on this thread.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            let mut ptr: sys::CUdeviceptr = 0;
            ok("cuMemCreate", sys::cuMemCreate(&mut h, G, &prop, 0));
            ok(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, G, G, 0, 0),
            );
            ok("cuMemMap", sys::cuMemMap(ptr, G, 0, h, 0));
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok("cuMemSetAccess", sys::cuMemSetAccess(ptr, G, &access, 1));
            ok(
                "cuMemcpyHtoD_v2",
                sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), bytes.len()),
            );
            ok("cuMemUnmap", sys::cuMemUnmap(ptr, G));
            assert_eq!(
                sys::cuStreamSynchronize(legacy_stream()),
                sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            );
            // The context is unusable now (sticky); the handle goes without one.
            let _ = sys::cuMemAddressFree(ptr, G);
            ok("cuMemRelease", sys::cuMemRelease(h));
        }
    }

    /// A host registration without CU_MEMHOSTREGISTER_PORTABLE is pinned and mapped for the
    /// registering context only (the crate always passes PORTABLE), with raw driver calls.
    #[test]
    #[ignore = "run by fake_driver.rs in a child with the fake libcuda"]
    fn fake_non_portable_registration() {
        if !in_child() {
            return;
        }
        use sys::CUresult::CUDA_ERROR_INVALID_VALUE;
        const N: usize = 4096;
        let (dev0, dev1) = (Device::open(0).unwrap(), Device::open(1).unwrap());
        let (buf0, buf1) = (
            DeviceBuffer::new(&dev0, N).unwrap(),
            DeviceBuffer::new(&dev1, N).unwrap(),
        );
        let len = 1 << 16;
        // SAFETY: a fresh private anonymous mapping, unmapped at the end after its
        // registrations are gone.
        let host = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .unwrap();
        let fill = |v: u8| {
            // SAFETY: `host` is the live mapping of `len` >= N bytes made above; the driver
            // reads it only while a stream the test then waits for runs.
            unsafe { std::ptr::write_bytes(host.cast::<u8>(), v, N) }
        };
        let mut back = vec![0u8; N];
        let (mut s0, mut s1): (sys::CUstream, sys::CUstream) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        let mut dptr: sys::CUdeviceptr = 0;
        dev0.bind().unwrap();
        // SAFETY: here and in the blocks below, valid arguments and live out-pointers, with
        // the context of the device named current; device ranges inside the test's buffers.
        unsafe {
            ok(
                "cuMemHostRegister_v2",
                sys::cuMemHostRegister_v2(host, len, sys::CU_MEMHOSTREGISTER_DEVICEMAP),
            );
            ok(
                "cuMemHostGetDevicePointer_v2",
                sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0),
            );
            assert_eq!(dptr, host as u64);
            // Pinned for device 0's context: its async copy reads the host bytes when the
            // stream runs (the rewrite before the wait is what lands).
            ok("cuStreamCreate", sys::cuStreamCreate(&mut s0, 1));
            fill(0x3C);
            ok(
                "cuMemcpyHtoDAsync_v2",
                sys::cuMemcpyHtoDAsync_v2(buf0.ptr(), host, N, s0),
            );
            fill(0x3D);
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(s0));
            ok("cuStreamDestroy_v2", sys::cuStreamDestroy_v2(s0));
        }
        // SAFETY: the test's own buffer; its copy has completed.
        unsafe { copy_to_host(&dev0, &mut back, buf0.ptr()) }.unwrap();
        assert!(back.iter().all(|&b| b == 0x3D), "pinned memory was staged");
        dev1.bind().unwrap();
        // SAFETY: as above.
        unsafe {
            // To device 1's context it is neither mapped nor pinned.
            assert_eq!(
                sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0),
                CUDA_ERROR_INVALID_VALUE
            );
            assert_eq!(
                sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), host as u64, N),
                CUDA_ERROR_INVALID_VALUE
            );
            // Pageable: the async copy stages the bytes at the call.
            ok("cuStreamCreate", sys::cuStreamCreate(&mut s1, 1));
            fill(0x3C);
            ok(
                "cuMemcpyHtoDAsync_v2",
                sys::cuMemcpyHtoDAsync_v2(buf1.ptr(), host, N, s1),
            );
            fill(0x3D);
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(s1));
            ok("cuStreamDestroy_v2", sys::cuStreamDestroy_v2(s1));
        }
        // SAFETY: the test's own buffer; its copy has completed.
        unsafe { copy_to_host(&dev1, &mut back, buf1.ptr()) }.unwrap();
        assert!(
            back.iter().all(|&b| b == 0x3C),
            "another context's registration was pinned"
        );
        dev0.bind().unwrap();
        // SAFETY: as above.
        unsafe {
            ok("cuMemHostUnregister", sys::cuMemHostUnregister(host));
            // PORTABLE: pinned and mapped for every context.
            ok(
                "cuMemHostRegister_v2",
                sys::cuMemHostRegister_v2(
                    host,
                    len,
                    sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
                ),
            );
        }
        dev1.bind().unwrap();
        // SAFETY: as above.
        unsafe {
            ok(
                "cuMemHostGetDevicePointer_v2",
                sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0),
            );
            ok(
                "cuMemcpyDtoH_v2",
                sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), host as u64, N),
            );
            ok("cuMemHostUnregister", sys::cuMemHostUnregister(host));
            rustix::mm::munmap(host, len).unwrap();
        }
        assert!(back.iter().all(|&b| b == 0x3D));
    }
}
