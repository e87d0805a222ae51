//! Small owning types over the CUDA driver: a device with its retained primary context,
//! streams, events, device buffers and pinned host buffers. Each wraps one driver object,
//! frees it on Drop, and makes the device's context current before every driver call
//! (tokio moves work between threads, and a CUDA context is per thread).

use std::ffi::{c_uint, c_void};
use std::sync::Arc;

use cudarc::driver::sys;

use super::check;
use crate::error::GpuError;

/// One CUDA device and its retained primary context (shared with every other user of the
/// device in this process, e.g. PyTorch in the same process).
#[derive(Debug)]
pub struct Device {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: i32,
}

// SAFETY: a CUdevice is an integer and a primary CUcontext is a process-wide handle that the
// driver allows any thread to make current; the struct holds no thread-affine state.
unsafe impl Send for Device {}
// SAFETY: as above; every method only passes the handles to thread-safe driver calls.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `ordinal`. Checks that libcuda can be loaded first: cudarc panics
    /// instead of returning an error when it cannot.
    pub fn open(ordinal: i32) -> Result<Arc<Self>, GpuError> {
        // SAFETY: only dlopens the candidate names and drops what it opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // SAFETY: libcuda is loaded; 0 is the only valid flag.
        check("cuInit", unsafe { sys::cuInit(0) })?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: the driver is initialised; the out-pointer is a live local.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device; the out-pointer is a live local. Released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let device = Arc::new(Self { dev, ctx, ordinal });
        device.bind()?;
        Ok(device)
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The raw device handle.
    pub(crate) fn raw(&self) -> sys::CUdevice {
        self.dev
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the retained primary context, alive until Drop.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; every object made in this context holds
        // an Arc<Device>, so none outlives it.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// A non-blocking stream (does not synchronise with the legacy default stream).
#[derive(Debug)]
pub struct Stream {
    dev: Arc<Device>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream handle may be used from any thread whose current context owns it;
// every method binds the context first.
unsafe impl Send for Stream {}
// SAFETY: as above; driver stream calls are thread-safe.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream on `dev`.
    pub fn new(dev: &Arc<Device>) -> Result<Self, GpuError> {
        dev.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the context is current; the out-pointer is a live local.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
            )
        })?;
        Ok(Self {
            dev: dev.clone(),
            raw,
        })
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The device this stream runs on.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.dev.bind()?;
        // SAFETY: `raw` is a live stream of the current context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Records a new event at the current end of the stream.
    pub fn record(&self) -> Result<Event, GpuError> {
        let event = Event::new(&self.dev, false)?;
        event.record(self)?;
        Ok(event)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: a live stream of this context; queued work still completes.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// A CUDA event: a point in a stream that the host can poll or wait for.
#[derive(Debug)]
pub struct Event {
    dev: Arc<Device>,
    raw: sys::CUevent,
}

// SAFETY: event handles are valid from any thread of the process; methods bind first.
unsafe impl Send for Event {}
// SAFETY: as above; cuEventQuery/Synchronize are thread-safe.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event; `timing` enables `elapsed_ms` (slower to record).
    pub fn new(dev: &Arc<Device>, timing: bool) -> Result<Self, GpuError> {
        dev.bind()?;
        let flags = if timing {
            0
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint
        };
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current; the out-pointer is a live local.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Self {
            dev: dev.clone(),
            raw,
        })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), GpuError> {
        self.dev.bind()?;
        // SAFETY: both handles are live and belong to the current context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw())
        })
    }

    /// True once the work before the event has finished.
    pub fn is_done(&self) -> Result<bool, GpuError> {
        self.dev.bind()?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| true),
        }
    }

    /// Blocks until the work before the event has finished.
    pub fn wait(&self) -> Result<(), GpuError> {
        self.dev.bind()?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Milliseconds between `start` and this event (both made with `timing`).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32, GpuError> {
        self.dev.bind()?;
        let mut ms = 0f32;
        // SAFETY: live events; the out-pointer is a live local.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime(&mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: a live event; the driver defers destruction until it completes.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

/// Plain device memory from `cuMemAlloc` (scratch space: kernel arguments, partial CRCs).
/// Not shareable; shared regions are [`super::VmmRegion`]s.
#[derive(Debug)]
pub struct DeviceBuffer {
    dev: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: a device address is a number; access happens through driver calls and kernels.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1).
    pub fn new(dev: &Arc<Device>, len: usize) -> Result<Self, GpuError> {
        dev.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; the out-pointer is a live local.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1))
        })?;
        Ok(Self {
            dev: dev.clone(),
            ptr,
            len,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: frees the allocation made in `new`; users hold `&self` only while
            // their stream work is queued, and owners synchronise before dropping.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): the source of asynchronous H2D copies.
#[derive(Debug)]
pub struct PinnedBuffer {
    dev: Arc<Device>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: ordinary host memory owned by this value; `&mut self` guards writes.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&self` only reads.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (at least 1) of pinned, zeroed host memory.
    pub fn new(dev: &Arc<Device>, len: usize) -> Result<Self, GpuError> {
        dev.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the context is current; the out-pointer is a live local.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut ptr, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        // SAFETY: the driver returned `len` writable bytes at `ptr`.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(Self {
            dev: dev.clone(),
            ptr: ptr.cast(),
            len,
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by self, borrowed immutably.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` initialised bytes owned by self, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: frees the allocation from `new`; owners wait for in-flight copies
            // from it before dropping.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

/// Synchronous H2D copy (tests, setup; hot paths use streams).
///
/// # Safety
///
/// `dst..dst + src.len()` must be device memory of `dev` the caller owns and nothing else
/// reads or writes meanwhile (with unified addressing a device address can also name host
/// memory: this writes it).
pub unsafe fn copy_to_device(dev: &Device, dst: u64, src: &[u8]) -> Result<(), GpuError> {
    dev.bind()?;
    // SAFETY: `src` is a live host slice; the caller names a device range of at least
    // `src.len()` bytes it owns (this function's contract).
    check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
    })?;
    // From pageable memory the call returns once the bytes are staged, "the DMA to final
    // destination may not have completed" (the driver API's synchronization notes), and the
    // engines' non-blocking stream is not ordered after it: wait for the legacy default
    // stream, which ran the copy, so that a gather launched next reads (or overwrites) the
    // bytes this wrote.
    let legacy: sys::CUstream = std::ptr::without_provenance_mut(1); // CU_STREAM_LEGACY
    // SAFETY: CU_STREAM_LEGACY is a handle every context accepts.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(legacy)
    })
}

/// Synchronous D2H copy.
///
/// # Safety
///
/// `src..src + dst.len()` must be live device memory of `dev` that nothing writes
/// meanwhile.
pub unsafe fn copy_to_host(dev: &Device, dst: &mut [u8], src: u64) -> Result<(), GpuError> {
    dev.bind()?;
    // SAFETY: `dst` is a live, uniquely borrowed host slice; the caller names a device
    // range of at least `dst.len()` bytes (this function's contract).
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs everywhere: on a host without a driver (CI) opening a device is an error, not
    /// cudarc's panic; on a GPU host it opens device 0.
    #[test]
    fn open_without_a_driver_is_an_error_not_a_panic() {
        let probe = crate::probe_gpus();
        match Device::open(0) {
            Err(GpuError::NoDriver) => assert!(!probe.driver_present, "{probe:?}"),
            Err(e) => assert!(probe.driver_present, "{e}"),
            Ok(dev) => assert_eq!(dev.ordinal(), 0),
        }
        if !probe.driver_present {
            let e = crate::cuda::open_for_service(&crate::GpuDevice {
                ordinal: 0,
                name: "absent".into(),
                pci_bus_id: "0000:00:00.0".into(),
                uuid: None,
                total_memory: 0,
                compute_capability: (9, 0),
                dma_buf_supported: true,
                vmm_supported: true,
                gpu_direct_rdma_with_cuda_vmm_supported: true,
            })
            .unwrap_err();
            assert!(e.to_string().contains("libcuda.so was not found"), "{e}");
        }
    }
}
