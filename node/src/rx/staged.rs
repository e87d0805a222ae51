//! The staged path: CUDA memory without GPU-direct receive. Payload bytes are read into
//! pinned host buffers (from the socket, or the devmem path's host gather), checksummed
//! there, and copied to the slab's GPU asynchronously while the next read runs
//! (`shardwire_gpu::cuda::H2dStager`). Each slab is written through buffers of its own GPU:
//! the stagers are made on first use per device.

use std::io;
use std::sync::atomic::Ordering;

use shardwire_gpu::cuda::H2dStager;

use super::error::RxError;
use super::shared::{CHUNK, Checksum, Pace, PayloadRead, Place, Tally};
use crate::counters::Counters;
use crate::fetch::InFlight;

/// Pinned buffers per stager: while one is copied to the GPU the socket fills the next; four
/// absorb a copy that runs late without stalling the reads.
const STAGING_BUFFERS: usize = 4;

/// Places payloads read from `R` into slabs in CUDA memory through pinned buffers.
pub struct Staged<'c, R> {
    src: R,
    /// One stager per GPU written so far, by CUDA ordinal.
    stagers: Vec<H2dStager>,
    counters: &'c Counters,
}

impl<'c, R: PayloadRead> Staged<'c, R> {
    /// Reads from `src`; stalls of the copies are counted in `counters`.
    pub fn new(src: R, counters: &'c Counters) -> Self {
        Self {
            src,
            stagers: Vec::new(),
            counters,
        }
    }
}

impl<R: PayloadRead> Place for Staged<'_, R> {
    /// Receives a payload into its slab through the pinned buffers of the slab's GPU,
    /// returning the CRC-32C computed while each piece was in host memory. The copies have
    /// landed when this returns.
    fn place(
        &mut self,
        f: &mut InFlight,
        tally: &mut Tally<'_>,
        pace: &mut Pace,
    ) -> Result<u32, RxError> {
        let slab = f.slab();
        let region = slab.region().cuda().ok_or(RxError::WrongMemory {
            path: "staged",
            found: "host",
        })?;
        let device = region.device();
        let i = match self
            .stagers
            .iter()
            .position(|s| s.device().ordinal() == device.ordinal())
        {
            Some(i) => i,
            None => {
                let s = H2dStager::new(device, CHUNK, STAGING_BUFFERS)
                    .map_err(|e| RxError::gpu("pinned staging buffers", e))?;
                self.stagers.push(s);
                self.stagers.len() - 1
            }
        };
        let stager = &mut self.stagers[i];
        let stalls = stager.stalls();
        let mut sum = Checksum::new();
        let src = &mut self.src;
        // A read below the pace ends the copy (as a read error the stager passes on); the
        // typed cause is kept here.
        let mut slow = None;
        let copied = stager.copy_from(
            &mut |buf| {
                let n = src.read_some(buf)?;
                if let Err(e) = pace.landed_now(n) {
                    slow = Some(e);
                    return Err(io::Error::from(io::ErrorKind::TimedOut));
                }
                Ok(n)
            },
            &mut |piece| tally.piece(&mut sum, piece),
            region,
            slab.offset(),
            slab.len(),
        );
        self.counters
            .staging_stalls
            .fetch_add(stager.stalls() - stalls, Ordering::Relaxed);
        if let Some(e) = slow {
            return Err(e);
        }
        copied.map_err(|e| match e {
            shardwire_gpu::cuda::StageError::Io(e) => RxError::io("recv", &e),
            shardwire_gpu::cuda::StageError::Gpu(e) => RxError::gpu("the H2D copy", e),
        })?;
        Ok(sum.finish())
    }
}
