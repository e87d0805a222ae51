//! The device engines: the gather and CRC-32C kernels (embedded PTX, see
//! [`crate::kernels`]) loaded into a module and launched on one stream.
//!
//! - [`Engines::gather`] copies a batch of frags into a region with one launch and returns
//!   a [`Launched`] that says when the source bytes have been read (the devmem receiver
//!   returns its tokens to the kernel only after it). It borrows the memory the launch reads
//!   and writes, so neither can be dropped (unmapped) while the launch may run, and dropping
//!   it waits for the launch.
//! - [`Engines::crc32c`] computes the CRC-32C of spans of a region on the device, equal bit
//!   for bit to the CPU's (the kernels' math is checked on the CPU in CI:
//!   `gpu/tests/kernels_on_cpu.rs`).
//!
//! Kernel arguments (frag and span lists) travel through two pinned+device slots used in
//! turn, so staging batch N+1 never waits for batch N's kernel.

use std::ffi::{CString, c_uint, c_void};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::check;
use super::device::{Device, DeviceBuffer, Event, PinnedBuffer, Stream};
use super::hostmap::DeviceRange;
use super::vmm::VmmRegion;
use crate::error::GpuError;
use crate::kernels::{self, Frag, Span};

/// A launch (or async copy) in flight on the engines' stream. It borrows the memory the
/// launch reads and writes for `'a`, so that memory outlives it; dropping it waits for the
/// launch to finish (so the memory is never unmapped under a running kernel).
#[must_use = "dropping it waits for the launch"]
#[derive(Debug)]
pub struct Launched<'a> {
    event: Arc<Event>,
    _memory: PhantomData<&'a ()>,
}

impl Launched<'_> {
    fn new(event: Arc<Event>) -> Self {
        Self {
            event,
            _memory: PhantomData,
        }
    }

    /// Waits until the launch has finished.
    pub fn wait(&self) -> Result<(), GpuError> {
        self.event.wait()
    }

    /// Whether the launch has finished.
    pub fn is_done(&self) -> Result<bool, GpuError> {
        self.event.is_done()
    }
}

impl Drop for Launched<'_> {
    fn drop(&mut self) {
        let _ = self.event.wait();
    }
}

struct Module(sys::CUmodule);
impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: unloads the module loaded in `Engines::new`; the owner synchronised its
        // stream first, so no launch of its functions is in flight.
        let _ = unsafe { sys::cuModuleUnload(self.0) };
    }
}

/// One argument slot: pinned host staging, its device copy, and the event after the last
/// launch that read it.
struct ArgSlot {
    host: PinnedBuffer,
    dev: DeviceBuffer,
    done: Option<Arc<Event>>,
}

struct Scratch {
    slots: [ArgSlot; 2],
    next: usize,
    partials: DeviceBuffer,
    out_dev: DeviceBuffer,
    out_host: PinnedBuffer,
}

/// The loaded kernels and their stream.
pub struct Engines {
    // Field order: the stream is synchronised in Drop, then the module unloads.
    scratch: Mutex<Scratch>,
    stream: Stream,
    gather_fn: sys::CUfunction,
    crc_chunks_fn: sys::CUfunction,
    crc_combine_fn: sys::CUfunction,
    _module: Module,
    dev: Arc<Device>,
}

// SAFETY: CUfunction handles are immutable process-wide handles valid in the device's
// context, which every method makes current; mutable scratch state sits behind a Mutex.
unsafe impl Send for Engines {}
// SAFETY: as above.
unsafe impl Sync for Engines {}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engines")
            .field("device", &self.dev.ordinal())
            .finish()
    }
}

const SLOT_BYTES: usize = 64 << 10;

fn function(module: &Module, name: &str) -> Result<sys::CUfunction, GpuError> {
    let cname = CString::new(name).expect("kernel names have no NUL");
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: a loaded module, a NUL-terminated name, and a live out-pointer.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut f, module.0, cname.as_ptr())
    })?;
    Ok(f)
}

impl Engines {
    /// JIT-loads the embedded PTX on `dev` and prepares the stream and scratch space.
    pub fn new(dev: &Arc<Device>) -> Result<Self, GpuError> {
        dev.bind()?;
        let ptx = CString::new(kernels::PTX).expect("PTX text has no NUL");
        let mut raw: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image that lives across the call; out-pointer live.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut raw, ptx.as_ptr().cast())
        })?;
        let module = Module(raw);
        let slot = || -> Result<ArgSlot, GpuError> {
            Ok(ArgSlot {
                host: PinnedBuffer::new(dev, SLOT_BYTES)?,
                dev: DeviceBuffer::new(dev, SLOT_BYTES)?,
                done: None,
            })
        };
        Ok(Self {
            scratch: Mutex::new(Scratch {
                slots: [slot()?, slot()?],
                next: 0,
                partials: DeviceBuffer::new(dev, 4 << 10)?,
                out_dev: DeviceBuffer::new(dev, 4 << 10)?,
                out_host: PinnedBuffer::new(dev, 4 << 10)?,
            }),
            stream: Stream::new(dev)?,
            gather_fn: function(&module, kernels::GATHER)?,
            crc_chunks_fn: function(&module, kernels::CRC_CHUNKS)?,
            crc_combine_fn: function(&module, kernels::CRC_COMBINE)?,
            _module: module,
            dev: dev.clone(),
        })
    }

    /// The stream the engines launch on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Copies every frag from `src` into `dst` with one kernel launch. Returns the launch,
    /// borrowing both: once it is done, `src` may be reused. `src` and `dst` may be the same
    /// region (batches assembled from resident shards) when no frag reads bytes that a frag
    /// writes. An error after work was queued waits for it first: nothing the failed call
    /// queued runs after it returns.
    pub fn gather<'a>(
        &self,
        src: &'a dyn DeviceRange,
        dst: &'a VmmRegion,
        frags: &[Frag],
    ) -> Result<Launched<'a>, GpuError> {
        self.same_device("the gather's destination", dst)?;
        self.same_device("the gather's source", src)?;
        kernels::check_frags(frags, src.len() as u64, dst.len() as u64)?;
        let (s0, d0) = (src.device_ptr(), dst.device_ptr());
        if s0 < d0 + dst.len() as u64 && d0 < s0 + src.len() as u64 {
            kernels::check_reads_unwritten(frags, s0, d0)?;
        }
        let mut scratch = self.scratch.lock().expect("engine scratch poisoned");
        let args = self.stage(&mut scratch, as_bytes(frags))?;
        // The upload is queued: until the slot's event is recorded, every exit waits for it.
        let queued = Queued::new(&self.stream);
        if !frags.is_empty() {
            let (mut s, mut d, mut a) = (src.device_ptr(), dst.device_ptr(), args);
            let mut n = frags.len() as c_uint;
            let mut params = [
                (&mut s as *mut u64).cast::<c_void>(),
                (&mut d as *mut u64).cast(),
                (&mut a as *mut u64).cast(),
                (&mut n as *mut c_uint).cast(),
            ];
            let grid = kernels::gather_grid(n);
            self.launch(
                self.gather_fn,
                (grid, 1),
                kernels::GATHER_BLOCK,
                &mut params,
            )?;
        }
        let event = self.finish_slot(&mut scratch)?;
        queued.recorded();
        Ok(Launched::new(event))
    }

    /// Device-to-device copy on the engines' stream (the baseline the gather is measured
    /// against); the copy borrows both regions, as [`Engines::gather`]. Source and
    /// destination bytes must not overlap (`cuMemcpy*` on overlapping ranges is undefined):
    /// [`GpuError::OverlappingCopy`].
    pub fn copy<'a>(
        &self,
        src: &'a VmmRegion,
        src_off: usize,
        dst: &'a VmmRegion,
        dst_off: usize,
        len: usize,
    ) -> Result<Launched<'a>, GpuError> {
        self.same_device("the copy's source", src)?;
        self.same_device("the copy's destination", dst)?;
        src.range(src_off, len)?;
        dst.range(dst_off, len)?;
        let (from, to) = (
            src.device_ptr() + src_off as u64,
            dst.device_ptr() + dst_off as u64,
        );
        // Regions never share addresses, so only ranges of one region can overlap.
        if len > 0 && from < to + len as u64 && to < from + len as u64 {
            return Err(GpuError::OverlappingCopy {
                src_off: src_off as u64,
                dst_off: dst_off as u64,
                len: len as u64,
            });
        }
        self.dev.bind()?;
        // SAFETY: both ranges were checked to lie inside live regions of this device, and
        // not to overlap.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(to, from, len, self.stream.raw())
        })?;
        // Queued: an exit without its event waits for it (it borrows the regions no longer).
        let queued = Queued::new(&self.stream);
        let event = Arc::new(self.stream.record()?);
        queued.recorded();
        Ok(Launched::new(event))
    }

    /// CRC-32C of each span of `region`, computed on the device (blocks until done, also
    /// when it fails: no kernel reads `region` after it returns).
    pub fn crc32c(&self, region: &VmmRegion, spans: &[Span]) -> Result<Vec<u32>, GpuError> {
        self.same_device("the checksummed region", region)?;
        kernels::check_spans(spans, region.len() as u64)?;
        if spans.is_empty() {
            return Ok(Vec::new());
        }
        let max_chunks = kernels::check_crc_chunks(spans, kernels::CRC_CHUNK)?;
        let mut scratch = self.scratch.lock().expect("engine scratch poisoned");
        let out_bytes = spans.len() * 4;
        self.reserve_crc(
            &mut scratch,
            spans.len() * max_chunks as usize * 4,
            out_bytes,
        )?;
        let args = self.stage(&mut scratch, as_bytes(spans))?;
        // The upload is queued: every exit from here waits for the stream.
        let queued = Queued::new(&self.stream);
        let geometry = CrcGeometry {
            base: region.device_ptr(),
            args,
            spans: spans.len() as c_uint,
            max_chunks,
        };
        self.queue_crc(&mut scratch, &geometry, out_bytes)?;
        self.finish_slot(&mut scratch)?;
        self.stream.synchronize()?;
        queued.recorded();
        Ok(scratch.out_host.as_slice()[..out_bytes]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    }

    /// Grows the CRC scratch buffers to `partial_bytes` of partials and `out_bytes` of
    /// results (after the stream is idle: queued kernels may still use the old ones).
    fn reserve_crc(
        &self,
        scratch: &mut Scratch,
        partial_bytes: usize,
        out_bytes: usize,
    ) -> Result<(), GpuError> {
        if scratch.partials.len() < partial_bytes {
            self.stream.synchronize()?;
            scratch.partials = DeviceBuffer::new(&self.dev, partial_bytes)?;
        }
        if scratch.out_dev.len() < out_bytes || scratch.out_host.as_slice().len() < out_bytes {
            self.stream.synchronize()?;
            // Both made before either is replaced: one that fails leaves the pair as it was
            // (before, a failed host buffer left a larger device one, and the next copy ran
            // past the smaller host buffer).
            let (dev, host) = (
                DeviceBuffer::new(&self.dev, out_bytes)?,
                PinnedBuffer::new(&self.dev, out_bytes)?,
            );
            (scratch.out_dev, scratch.out_host) = (dev, host);
        }
        Ok(())
    }

    /// Queues both CRC kernels over the staged spans and the copy of the `out_bytes` of
    /// results to the pinned output buffer (sized by [`Engines::reserve_crc`]).
    fn queue_crc(
        &self,
        scratch: &mut Scratch,
        g: &CrcGeometry,
        out_bytes: usize,
    ) -> Result<(), GpuError> {
        let (mut base, mut a, mut partials, mut out) = (
            g.base,
            g.args,
            scratch.partials.ptr(),
            scratch.out_dev.ptr(),
        );
        let (mut n, mut c, mut m) = (g.spans, kernels::CRC_CHUNK as c_uint, g.max_chunks);
        let mut chunk_params = [
            (&mut base as *mut u64).cast::<c_void>(),
            (&mut a as *mut u64).cast(),
            (&mut n as *mut c_uint).cast(),
            (&mut c as *mut c_uint).cast(),
            (&mut partials as *mut u64).cast(),
            (&mut m as *mut c_uint).cast(),
        ];
        let grid_x = m.div_ceil(kernels::CRC_BLOCK);
        self.launch(
            self.crc_chunks_fn,
            (grid_x, n),
            kernels::CRC_BLOCK,
            &mut chunk_params,
        )?;
        let mut combine_params = [
            (&mut a as *mut u64).cast::<c_void>(),
            (&mut n as *mut c_uint).cast(),
            (&mut c as *mut c_uint).cast(),
            (&mut partials as *mut u64).cast(),
            (&mut m as *mut c_uint).cast(),
            (&mut out as *mut u64).cast(),
        ];
        let grid = n.div_ceil(kernels::CRC_BLOCK);
        self.launch(
            self.crc_combine_fn,
            (grid, 1),
            kernels::CRC_BLOCK,
            &mut combine_params,
        )?;
        // SAFETY: the pinned buffer and the device buffer hold at least `out_bytes`
        // (`reserve_crc`); the caller synchronises the stream before the host reads it.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                scratch.out_host.as_mut_slice().as_mut_ptr().cast(),
                out,
                out_bytes,
                self.stream.raw(),
            )
        })
    }

    /// Refuses `region` of another GPU than these engines' (a launch on it would fault this
    /// GPU's context for good: every stream of it would fail until a restart).
    fn same_device(&self, what: &'static str, range: &dyn DeviceRange) -> Result<(), GpuError> {
        let engines = self.dev.ordinal();
        let Some(region) = range.device_ordinal().filter(|&r| r != engines) else {
            return Ok(()); // this GPU's, or a range that names no GPU
        };
        Err(GpuError::WrongDevice {
            what,
            region,
            engines,
        })
    }

    /// Copies `bytes` into the next argument slot (growing it if needed) and queues its
    /// upload; returns the device address of the arguments.
    fn stage(&self, scratch: &mut Scratch, bytes: &[u8]) -> Result<u64, GpuError> {
        let i = scratch.next;
        let slot = &mut scratch.slots[i];
        if let Some(done) = &slot.done {
            done.wait()?; // the launch that last read this slot has finished
        }
        // Forgotten only once seen complete: a failed wait keeps it for the next user.
        slot.done = None;
        if slot.host.as_slice().len() < bytes.len() || slot.dev.len() < bytes.len() {
            let len = bytes.len().next_power_of_two();
            // Both made before either is replaced (see `reserve_crc`): a device buffer that
            // could not be made left a larger host one, and the next upload ran past the
            // device one.
            let (host, dev) = (
                PinnedBuffer::new(&self.dev, len)?,
                DeviceBuffer::new(&self.dev, len)?,
            );
            (slot.host, slot.dev) = (host, dev);
        }
        slot.host.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        self.dev.bind()?;
        // SAFETY: the pinned source holds `bytes.len()` bytes and is not rewritten until
        // this slot's event completes; the device buffer is at least as large.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                slot.dev.ptr(),
                slot.host.as_ptr().cast(),
                bytes.len(),
                self.stream.raw(),
            )
        })?;
        Ok(slot.dev.ptr())
    }

    /// Records the event after the launches that used the current slot and moves on.
    fn finish_slot(&self, scratch: &mut Scratch) -> Result<Arc<Event>, GpuError> {
        let i = scratch.next;
        let event = Arc::new(self.stream.record()?);
        scratch.slots[i].done = Some(event.clone());
        scratch.next = (i + 1) % scratch.slots.len();
        Ok(event)
    }

    fn launch(
        &self,
        f: sys::CUfunction,
        (grid_x, grid_y): (u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), GpuError> {
        self.dev.bind()?;
        // SAFETY: `f` belongs to the loaded module; `params` has one pointer per kernel
        // parameter, in order and of the types the kernel declares (see the contract in
        // `kernels.rs`), each pointing at a live local of the caller; the device addresses
        // in them were bounds-checked (check_frags / check_spans).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                grid_x,
                grid_y,
                1,
                block,
                1,
                1,
                0,
                self.stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        // Nothing may still read the scratch buffers or run module code when they go.
        let _ = self.stream.synchronize();
    }
}

/// The arguments of one CRC-32C call's kernels (besides the scratch buffers).
struct CrcGeometry {
    /// Device address of the checksummed region.
    base: u64,
    /// Device address of the staged spans.
    args: u64,
    /// How many spans.
    spans: c_uint,
    /// Most chunks of any span ([`kernels::check_crc_chunks`]).
    max_chunks: c_uint,
}

/// Work queued on the engines' stream that reads an argument slot and the caller's regions,
/// before the event that tracks it is recorded. Dropped without [`Queued::recorded`] (an
/// error after the work was queued), it waits for the stream: the slot is then free for its
/// next user, and nothing the failed call queued still runs when it returns.
struct Queued<'a> {
    stream: &'a Stream,
    armed: bool,
}

impl<'a> Queued<'a> {
    fn new(stream: &'a Stream) -> Self {
        Self {
            stream,
            armed: true,
        }
    }

    /// The slot's event is recorded (or the stream waited for): nothing to wait for here.
    fn recorded(mut self) {
        self.armed = false;
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.armed {
            // An error already goes back to the caller; a stream that cannot be waited for
            // is one whose context faulted, which runs nothing more.
            let _ = self.stream.synchronize();
        }
    }
}

/// Kernel argument structs that may be viewed as bytes.
trait KernelArg: Copy {}
impl KernelArg for Frag {}
impl KernelArg for Span {}

/// The bytes of a slice of plain `repr(C)` argument structs.
fn as_bytes<T: KernelArg>(items: &[T]) -> &[u8] {
    // SAFETY: the KernelArg types are repr(C) structs of u64 fields only (no padding, no
    // pointers); reading them as bytes for the lifetime of the borrow is sound.
    unsafe { std::slice::from_raw_parts(items.as_ptr().cast::<u8>(), std::mem::size_of_val(items)) }
}
