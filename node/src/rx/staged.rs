//! The staged path: CUDA memory without GPU-direct receive. Payload bytes are read into
//! pinned host buffers (from the socket, or the devmem path's host gather), checksummed
//! there, and copied to the slab's GPU asynchronously while the next read runs
//! (`shardwire_gpu::cuda::H2dStager`). Each slab is written through buffers of its own GPU:
//! the stagers are made on first use per device.

use std::io;
use std::sync::atomic::Ordering;

use shardwire_gpu::cuda::H2dStager;

use super::error::RxError;
use super::shared::{CHUNK, Checksum, Pace, PayloadRead, Place, Tally, read_failed};
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
        let mut reads = PacedReads::new(&mut self.src, pace, slab.len());
        let copied = stager.copy_from(
            &mut |buf| reads.read(buf),
            &mut |piece| tally.piece(&mut sum, piece),
            region,
            slab.offset(),
            slab.len(),
        );
        self.counters
            .staging_stalls
            .fetch_add(stager.stalls() - stalls, Ordering::Relaxed);
        if let Some(e) = reads.stop {
            return Err(e);
        }
        copied.map_err(|e| match e {
            shardwire_gpu::cuda::StageError::Io(e) => RxError::io("recv", &e),
            shardwire_gpu::cuda::StageError::Gpu(e) => RxError::gpu("the H2D copy", e),
        })?;
        Ok(sum.finish())
    }
}

/// The reads of one staged payload, kept to the pace. The stager passes a failed read on as
/// an I/O error only, so the typed cause is kept in `stop`.
struct PacedReads<'a, R> {
    src: &'a mut R,
    pace: &'a mut Pace,
    /// Payload bytes read so far.
    got: u64,
    /// The payload's length.
    want: u64,
    /// Why the reads stopped early: the peer closed, nothing arrived within the stall
    /// timeout, or the pace was not kept.
    stop: Option<RxError>,
}

impl<'a, R: PayloadRead> PacedReads<'a, R> {
    fn new(src: &'a mut R, pace: &'a mut Pace, want: usize) -> Self {
        Self {
            src,
            pace,
            got: 0,
            want: want as u64,
            stop: None,
        }
    }

    /// One read into `buf`. End of stream is checked before the pace, as on the `recv` and
    /// devmem paths: a close mid-payload is `Closed`, never a trickle.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match self.src.read_some(buf) {
            Ok(n) => n,
            Err(e) => {
                // A stall is named here: the stager passes on only the bare I/O error.
                if let stalled @ RxError::Stalled { .. } =
                    read_failed("recv", &e, self.got, self.want)
                {
                    self.stop = Some(stalled);
                }
                return Err(e);
            }
        };
        let kept = match n {
            0 => Err(RxError::Closed {
                got: self.got,
                want: self.want,
            }),
            n => {
                self.got += n as u64;
                self.pace.landed_now(n)
            }
        };
        if let Err(e) = kept {
            let kind = match e {
                RxError::Closed { .. } => io::ErrorKind::UnexpectedEof,
                _ => io::ErrorKind::TimedOut,
            };
            self.stop = Some(e);
            return Err(io::Error::from(kind));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::rx::shared::PaceRule;

    /// A window already over on every read: the pace is judged each time.
    fn strict_pace(due: u64) -> Pace {
        let mut pace = Pace::new(PaceRule {
            window: Duration::ZERO,
            floor: 1000,
        });
        pace.due(Instant::now(), due);
        pace
    }

    /// Before, the close ran the pace check with 0 bytes landed, which reported a trickle.
    #[test]
    fn a_close_mid_payload_is_a_close_not_a_trickle() {
        let mut pace = strict_pace(4096);
        let mut src: &[u8] = &[7; 1000];
        let mut buf = [0u8; 4096];
        let mut reads = PacedReads::new(&mut src, &mut pace, 4096);
        assert_eq!(reads.read(&mut buf).unwrap(), 1000, "at the floor");
        let e = reads.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(
            reads.stop,
            Some(RxError::Closed {
                got: 1000,
                want: 4096
            })
        );
        // The pace alone would have called it too slow.
        assert!(matches!(
            pace.check(Instant::now()),
            Err(RxError::TooSlow { got: 0, .. })
        ));
    }

    /// A read that times out (`SO_RCVTIMEO`) is named a stall: the stager passes on only the
    /// bare I/O error, which read "recv: Resource temporarily unavailable" before.
    #[test]
    fn a_read_that_times_out_is_a_stall() {
        struct TimesOut;
        impl PayloadRead for TimesOut {
            fn read_some(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::ErrorKind::WouldBlock.into())
            }
        }
        let mut pace = strict_pace(4096);
        let mut src = TimesOut;
        let mut buf = [0u8; 4096];
        let mut reads = PacedReads::new(&mut src, &mut pace, 4096);
        let e = reads.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(
            reads.stop,
            Some(RxError::Stalled {
                after: crate::rx::shared::DATA_STALL_TIMEOUT,
                got: 0,
                want: 4096,
            })
        );
    }

    #[test]
    fn a_read_below_the_floor_is_too_slow() {
        let mut pace = strict_pace(4096);
        let mut src: &[u8] = &[7; 10];
        let mut buf = [0u8; 4096];
        let mut reads = PacedReads::new(&mut src, &mut pace, 4096);
        let e = reads.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(matches!(reads.stop, Some(RxError::TooSlow { got: 10, .. })));
    }
}
