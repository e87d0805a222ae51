//! The host-receive plus GPU-memory path, for GPUs without a devmem NIC: bytes are received
//! into pinned host buffers and copied to the region asynchronously, several buffers in
//! turn, so the network fills one buffer while earlier ones are still being copied.
//!
//! [`H2dStager::buffer`] hands out the next pinned buffer (waiting only if the copy that
//! last used it is still running, which [`H2dStager::stalls`] counts), [`H2dStager::submit`]
//! queues its copy, and [`H2dStager::flush`] waits for all of them (before a shard is
//! handed to trainers).

use std::sync::Arc;

use cudarc::driver::sys;

use super::check;
use super::device::{Device, Event, PinnedBuffer, Stream};
use super::vmm::VmmRegion;
use crate::error::{GpuError, StageError};

struct Slot {
    buf: PinnedBuffer,
    /// Recorded after the slot's copy; re-recorded on each use (no event per copy).
    copied: Event,
    /// A copy from `buf` was queued and not yet seen complete.
    pending: bool,
}

/// Pinned staging buffers and the stream their copies run on.
pub struct H2dStager {
    // The stream is synchronised in Drop before the buffers go.
    slots: Vec<Slot>,
    next: usize,
    stalls: u64,
    stream: Stream,
}

impl std::fmt::Debug for H2dStager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2dStager")
            .field("slots", &self.slots.len())
            .field("slot_len", &self.slot_len())
            .field("stalls", &self.stalls)
            .finish()
    }
}

impl H2dStager {
    /// `slots` pinned buffers (at least 2: double buffering) of `slot_len` bytes each.
    pub fn new(dev: &Arc<Device>, slot_len: usize, slots: usize) -> Result<Self, GpuError> {
        let slots = (0..slots.max(2))
            .map(|_| {
                Ok(Slot {
                    buf: PinnedBuffer::new(dev, slot_len.max(1))?,
                    copied: Event::new(dev, false)?,
                    pending: false,
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(Self {
            slots,
            next: 0,
            stalls: 0,
            stream: Stream::new(dev)?,
        })
    }

    /// The device the copies go to.
    pub fn device(&self) -> &Arc<Device> {
        self.stream.device()
    }

    /// Bytes per buffer.
    pub fn slot_len(&self) -> usize {
        self.slots[0].buf.as_slice().len()
    }

    /// How many times [`Self::buffer`] had to wait for a copy (the network waited on the
    /// GPU). Zero when the copies keep up.
    pub fn stalls(&self) -> u64 {
        self.stalls
    }

    /// The next buffer to fill. Calling it again before [`Self::submit`] returns the same
    /// buffer.
    pub fn buffer(&mut self) -> Result<&mut [u8], GpuError> {
        let slot = &mut self.slots[self.next];
        if slot.pending {
            if !slot.copied.is_done()? {
                self.stalls += 1;
                slot.copied.wait()?;
            }
            slot.pending = false;
        }
        Ok(slot.buf.as_mut_slice())
    }

    /// Queues the copy of the first `len` bytes of the current buffer to `dst` at
    /// `offset`, and moves to the next buffer. Internal: nothing ties the queued copy to
    /// `dst`'s lifetime, so only [`Self::copy_from`], which waits for its copies on every
    /// exit, queues them.
    fn submit(&mut self, len: usize, dst: &VmmRegion, offset: usize) -> Result<(), GpuError> {
        self.same_device(dst)?;
        dst.range(offset, len)?;
        fits_slot(offset, len, self.slot_len())?;
        let slot = &mut self.slots[self.next];
        if std::mem::take(&mut slot.pending) {
            slot.copied.wait()?; // submit without buffer(): still never overwrite a busy buffer
        }
        self.stream.device().bind()?;
        // SAFETY: the destination range was checked to lie in a live region of this
        // device (`same_device`, `range`); the pinned source holds `len` bytes and is not
        // handed out again until the event recorded below completes.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.device_ptr() + offset as u64,
                slot.buf.as_ptr().cast(),
                len,
                self.stream.raw(),
            )
        })?;
        slot.copied.record(&self.stream)?;
        slot.pending = true;
        self.next = (self.next + 1) % self.slots.len();
        Ok(())
    }

    /// Refuses a region of another GPU than the stager's: its copies run in this GPU's
    /// context, which may not write another GPU's region (as [`super::Engines`] refuse it).
    fn same_device(&self, dst: &VmmRegion) -> Result<(), GpuError> {
        let (region, stager) = (dst.device().ordinal(), self.device().ordinal());
        if region != stager {
            return Err(GpuError::WrongDevice {
                what: "the staged copy's destination",
                region,
                engines: stager,
            });
        }
        Ok(())
    }

    /// Waits until every submitted copy has landed.
    pub fn flush(&mut self) -> Result<(), GpuError> {
        self.stream.synchronize()?;
        for slot in &mut self.slots {
            slot.pending = false;
        }
        Ok(())
    }

    /// Reads exactly `len` bytes from `src` into `dst` at `offset` through the buffers,
    /// calling `seen` on each piece while it is in host memory (for the CRC), and waits
    /// for the copies, also when it fails: nothing it queued lands in `dst` after it
    /// returns (the caller may hand that memory out again at once).
    pub fn copy_from(
        &mut self,
        src: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>,
        seen: &mut dyn FnMut(&[u8]),
        dst: &VmmRegion,
        offset: usize,
        len: usize,
    ) -> Result<(), StageError> {
        // Refused before anything is queued (nothing to wait for).
        self.same_device(dst)?;
        dst.range(offset, len)?;
        let copied = self.queue_from(src, seen, dst, offset, len);
        let flushed = self.flush();
        copied?;
        Ok(flushed?)
    }

    /// [`Self::copy_from`] without the final wait.
    fn queue_from(
        &mut self,
        src: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>,
        seen: &mut dyn FnMut(&[u8]),
        dst: &VmmRegion,
        offset: usize,
        len: usize,
    ) -> Result<(), StageError> {
        let mut done = 0;
        while done < len {
            let want = (len - done).min(self.slot_len());
            let buf = self.buffer()?;
            let mut filled = 0;
            while filled < want {
                match src(&mut buf[filled..want]) {
                    Ok(0) => {
                        return Err(StageError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!(
                                "connection closed after {} of {len} payload bytes",
                                done + filled
                            ),
                        )));
                    }
                    Ok(n) => {
                        seen(&buf[filled..filled + n]);
                        filled += n;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(StageError::Io(e)),
                }
            }
            self.submit(want, dst, offset + done)?;
            done += want;
        }
        Ok(())
    }
}

impl Drop for H2dStager {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

/// A copy of `len` bytes (to `offset` in the destination) must fit one staging buffer of
/// `slot_len` bytes.
fn fits_slot(offset: usize, len: usize, slot_len: usize) -> Result<(), GpuError> {
    if len > slot_len {
        return Err(GpuError::ExceedsSlot {
            offset: offset as u64,
            len: len as u64,
            slot_len: slot_len as u64,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_piece_names_its_destination_offset() {
        assert!(fits_slot(12_345, 4096, 4096).is_ok());
        let e = fits_slot(12_345, 4097, 4096).unwrap_err();
        // Before, the offset was reported as 0 whatever the destination.
        assert!(
            matches!(
                e,
                GpuError::ExceedsSlot {
                    offset: 12_345,
                    len: 4097,
                    slot_len: 4096
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("12345"), "{e}");
    }
}
