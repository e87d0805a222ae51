//! A fetch in flight and the one way it ends.
//!
//! An [`InFlight`] fetch has exactly one owner at a time: the link's pending table from the
//! FETCH until the source announces it (`Shard`), then the receiver of the announced data
//! connection until the payload is in. Whoever holds it ends it with [`InFlight::finish`],
//! which hands the slab back to the stream's fetcher with a typed outcome. So a slab is never
//! re-issued while a receiver may still write into it, and every failure has one shape. A
//! fetch dropped without an outcome (a receiver thread that panicked, a path that forgot it)
//! still hands its slab back, as [`FetchFailure::Abandoned`]: its stream fetches it again
//! instead of waiting for that position forever (a stream already closed is not told: the
//! slab goes back to the pool). A payload that fails its CRC-32C is also reported to the source
//! that sent it, on the control connection of the session that sent its FETCH ([`Held`]).

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use shardwire_gpu::Slab;
use shardwire_protocol::framing::encode_frame;
use shardwire_protocol::wire::{self, Message};
use tokio::sync::mpsc;

use crate::rx::error::RxError;

/// Why a fetch did not produce a verified shard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchFailure {
    /// The link to the source went down (or broke the protocol) before the payload came.
    #[error("the link to source {source_addr} went down: {reason}")]
    LinkDown {
        /// The source.
        source_addr: String,
        /// Why.
        reason: String,
    },
    /// The payload arrived but its CRC-32C is wrong.
    #[error("CRC-32C {got:08x} of the received bytes differs from the manifest's {want:08x}")]
    Crc {
        /// CRC of the bytes received.
        got: u32,
        /// CRC from the manifest.
        want: u32,
    },
    /// The source refused the FETCH.
    #[error("the source refused it: {code:?}: {message}")]
    Refused {
        /// The source's error code.
        code: wire::ErrorCode,
        /// The source's advice: ask again no sooner than this (ms; 0: none).
        retry_after_ms: u32,
        /// Its message.
        message: String,
    },
    /// The data connection carrying the payload failed.
    #[error("data connection {conn} from {source_addr} failed: {cause}")]
    ConnectionLost {
        /// The source.
        source_addr: String,
        /// The data connection.
        conn: u16,
        /// What happened (the I/O error, or the earlier failure of this connection).
        cause: RxError,
    },
    /// The source dropped it on the node's request (its stream closed).
    #[error("cancelled: its stream closed")]
    Cancelled,
    /// Whoever held it let go without an outcome (a node bug: a receiver that panicked);
    /// the bytes in its slab are not trusted and it is fetched again.
    #[error("abandoned without an outcome by the node's {holder}")]
    Abandoned {
        /// Who held it last, as far as the fetch knows.
        holder: &'static str,
    },
}

/// The longest pause a source's `retry_after_ms` sets before a fetch is tried again (a
/// source pauses a throttled store's reads for at most a minute itself).
pub const MAX_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// What to do about a failed fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryClass {
    /// Fetch it again (from another source when one is up): the bytes were damaged or the
    /// connection went away.
    Refetch,
    /// Another attempt gets the same answer (the source does not have the shard or refuses
    /// the request): the stream ends with the reason.
    Fail,
}

impl FetchFailure {
    /// How long the source asked to wait before the next attempt (a throttled store), at
    /// most [`MAX_RETRY_AFTER`]: the wire allows 49 days.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Self::Refused { retry_after_ms, .. } if *retry_after_ms > 0 => Some(
                std::time::Duration::from_millis(u64::from(*retry_after_ms)).min(MAX_RETRY_AFTER),
            ),
            _ => None,
        }
    }

    /// Whether another attempt can succeed.
    pub fn retry_class(&self) -> RetryClass {
        use wire::ErrorCode as C;
        match self {
            Self::Refused {
                code:
                    C::UnknownDataset
                    | C::UnknownShard
                    | C::BadRequest
                    | C::DatasetChanged
                    | C::ObjectNotFound
                    | C::StorageAuth
                    | C::ChecksumMismatch,
                ..
            } => RetryClass::Fail,
            Self::LinkDown { .. }
            | Self::Crc { .. }
            | Self::Refused { .. }
            | Self::ConnectionLost { .. }
            | Self::Cancelled
            | Self::Abandoned { .. } => RetryClass::Refetch,
        }
    }
}

/// What a fetch came to; the slab always comes back.
#[derive(Debug)]
pub struct Completion {
    /// The stream position it was for.
    pub pos: u64,
    /// The shard.
    pub shard: u32,
    /// The slab (holding the verified payload on success).
    pub slab: Slab,
    /// Index of the link that served it.
    pub source: usize,
    /// When the FETCH was issued.
    pub issued: Instant,
    /// Success, or why not.
    pub result: Result<(), FetchFailure>,
}

/// Where a stream's fetch outcomes go.
pub type Completions = mpsc::UnboundedSender<Completion>;

/// A shard fetch in flight. Dropping it ends it: with the outcome given to
/// [`InFlight::finish`], else as [`FetchFailure::Abandoned`].
#[derive(Debug)]
pub struct InFlight {
    /// Destination slab (exactly `length` bytes); taken out only when the fetch ends.
    slab: ManuallyDrop<Slab>,
    /// Stream position it is for.
    pub pos: u64,
    /// Shard index in the stream's manifest.
    pub shard: u32,
    /// Shard index in its dataset, as the FETCH names it (differs from `shard` in a mixture,
    /// whose manifest holds several datasets' shards).
    pub wire_shard: u32,
    /// Payload length from the manifest.
    pub length: u64,
    /// CRC-32C from the manifest.
    pub crc32c: u32,
    /// Index of the link that serves it.
    pub source: usize,
    /// The stream it is for (to cancel it when the stream closes).
    pub stream: u64,
    /// The stream's lane: the payload must come on one of its data connections.
    pub lane: u16,
    /// Request id (set when the FETCH is sent).
    pub req: u64,
    /// When the FETCH was issued (for the fetch latency histogram).
    pub issued: Instant,
    /// Counts it among its link's outstanding fetches until it ends, and reaches the session
    /// that sent its FETCH.
    pub held: Option<Held>,
    done: Completions,
    end: End,
}

/// How far an [`InFlight`] got to its end.
#[derive(Debug)]
enum End {
    /// Not ended: dropping it now abandons it.
    Open,
    /// Ended with this outcome (sent when it drops).
    Finished(Result<(), FetchFailure>),
    /// Its slab went back to the caller unsent ([`InFlight::unsent`]): nothing to report.
    Unsent,
}

/// One fetch counted among a link's outstanding ones (a retiring link waits for none to be
/// left); the count goes down when it is dropped, however the fetch ends. It also holds the
/// control writer of the session that sent the FETCH, to report a payload that failed its
/// CRC-32C to the source that sent it.
#[derive(Debug)]
pub struct Held {
    count: Arc<AtomicUsize>,
    /// Weak, so a report for a session that has ended is dropped: never sent on its
    /// successor, whose request ids it does not know.
    report: Option<mpsc::WeakUnboundedSender<Vec<u8>>>,
}

impl Held {
    /// Counts one more fetch on `count`; a CRC failure is reported on `report` (encoded
    /// frames for a session's writer), if given.
    pub fn new(
        count: &Arc<AtomicUsize>,
        report: Option<mpsc::WeakUnboundedSender<Vec<u8>>>,
    ) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self {
            count: Arc::clone(count),
            report,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a stream asks for.
#[derive(Debug)]
pub struct FetchRequest {
    /// Destination slab.
    pub slab: Slab,
    /// Stream position.
    pub pos: u64,
    /// Shard index.
    pub shard: u32,
    /// Payload length (the manifest's).
    pub length: u64,
    /// CRC-32C (the manifest's).
    pub crc32c: u32,
    /// The stream.
    pub stream: u64,
    /// The stream's lane.
    pub lane: u16,
}

impl InFlight {
    /// A fetch of `r` from link `source`, reporting to `done`.
    pub fn new(r: FetchRequest, source: usize, done: Completions) -> Self {
        Self {
            slab: ManuallyDrop::new(r.slab),
            pos: r.pos,
            shard: r.shard,
            wire_shard: r.shard,
            length: r.length,
            crc32c: r.crc32c,
            source,
            stream: r.stream,
            lane: r.lane,
            req: 0,
            issued: Instant::now(),
            held: None,
            done,
            end: End::Open,
        }
    }

    /// The destination slab.
    pub fn slab(&self) -> &Slab {
        &self.slab
    }

    /// The destination slab, to write the payload into.
    pub fn slab_mut(&mut self) -> &mut Slab {
        &mut self.slab
    }

    /// Ends the fetch: the slab and the outcome go back to the stream's fetcher (which may be
    /// gone, when its stream closed: then the slab is simply freed).
    pub fn finish(mut self, result: Result<(), FetchFailure>) {
        self.end = End::Finished(result);
    }

    /// Takes the slab back for a FETCH that was never sent (its caller issues it again):
    /// nothing is reported.
    pub fn unsent(mut self) -> Slab {
        // SAFETY: `slab` is taken at most once: `end` becomes `Unsent` right after, and
        // `drop` takes it only while `end` is not `Unsent`.
        let slab = unsafe { ManuallyDrop::take(&mut self.slab) };
        self.end = End::Unsent;
        slab
    }

    /// Checks the payload's CRC-32C against the manifest's and ends the fetch with the result;
    /// a mismatch is also reported to the source that sent it.
    pub fn verified(self, got: u32) {
        let want = self.crc32c;
        if got == want {
            return self.finish(Ok(()));
        }
        self.report_crc(got, want);
        self.finish(Err(FetchFailure::Crc { got, want }));
    }

    /// Tells the source of a payload that failed its CRC-32C (`Error{req, ChecksumMismatch}`,
    /// protocol 5), so it checks what it served. Best effort and never blocking (receive
    /// threads call this): dropped when the session that sent the FETCH has ended.
    fn report_crc(&self, got: u32, want: u32) {
        let report = self.held.as_ref().and_then(|h| h.report.as_ref());
        let Some(ctl) = report.and_then(mpsc::WeakUnboundedSender::upgrade) else {
            return;
        };
        let (req, wire_shard) = (self.req, self.wire_shard);
        let msg = Message::Error {
            req,
            code: wire::ErrorCode::ChecksumMismatch,
            retry_after_ms: 0,
            message: format!(
                "the payload of shard {wire_shard} (FETCH {req}) has CRC-32C {got:#010x}, the manifest says {want:#010x}"
            ),
        };
        match encode_frame(&msg) {
            // An unbounded queue: never full; a writer that is gone drops it.
            Ok(frame) => {
                let _ = ctl.send(frame);
            }
            Err(e) => tracing::debug!(req, error = %e, "CRC report not encoded; not sent"),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let end = std::mem::replace(&mut self.end, End::Unsent);
        if matches!(end, End::Unsent) {
            return; // `unsent` took the slab
        }
        // SAFETY: `end` was not `Unsent`, so `unsent` never took the slab, and this is the
        // only other place that takes it (once: `end` is `Unsent` now).
        let slab = unsafe { ManuallyDrop::take(&mut self.slab) };
        let result = match end {
            End::Finished(result) => result,
            // Its stream is gone (closed, or the node shutting down): nobody waits for it,
            // and the slab just goes back to the pool.
            _ if self.done.is_closed() => return,
            _ => {
                let holder = if self.req == 0 {
                    "fetcher"
                } else {
                    "link or receiver"
                };
                tracing::error!(
                    req = self.req,
                    shard = self.shard,
                    holder,
                    "a fetch was dropped without an outcome; fetching it again"
                );
                Err(FetchFailure::Abandoned { holder })
            }
        };
        let _ = self.done.send(Completion {
            pos: self.pos,
            shard: self.shard,
            slab,
            source: self.source,
            issued: self.issued,
            result,
        });
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use shardwire_gpu::{HostRegion, SlabPool};

    use super::*;

    /// A pool of host memory for tests.
    pub(crate) fn pool(bytes: usize) -> Arc<SlabPool> {
        SlabPool::new(HostRegion::new("shardwire-test", bytes).unwrap())
    }

    /// A fetch of `len` bytes with CRC `crc` whose completion goes to the returned receiver.
    pub(crate) fn in_flight(
        pool: &Arc<SlabPool>,
        pos: u64,
        len: usize,
        crc: u32,
    ) -> (InFlight, mpsc::UnboundedReceiver<Completion>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let r = FetchRequest {
            slab: pool.alloc(len).expect("room in the test pool"),
            pos,
            shard: pos as u32,
            length: len as u64,
            crc32c: crc,
            stream: 1,
            lane: 0,
        };
        (InFlight::new(r, 0, tx), rx)
    }

    #[test]
    fn finish_hands_the_slab_back_with_the_outcome() {
        let p = pool(1 << 20);
        let (f, mut rx) = in_flight(&p, 3, 4096, 7);
        assert!(p.used() >= 4096);
        f.verified(8);
        let c = rx.try_recv().unwrap();
        assert_eq!((c.pos, c.shard), (3, 3));
        assert_eq!(c.result, Err(FetchFailure::Crc { got: 8, want: 7 }));
        drop(c);
        assert_eq!(p.used(), 0, "the slab returned to the pool");
    }

    #[test]
    fn refusals_that_cannot_change_fail_and_the_rest_are_fetched_again() {
        let refused = |code| FetchFailure::Refused {
            code,
            retry_after_ms: 0,
            message: "no".into(),
        };
        for code in [
            wire::ErrorCode::UnknownShard,
            wire::ErrorCode::UnknownDataset,
            wire::ErrorCode::BadRequest,
            wire::ErrorCode::DatasetChanged,
            wire::ErrorCode::ObjectNotFound,
            wire::ErrorCode::StorageAuth,
            wire::ErrorCode::ChecksumMismatch,
        ] {
            assert_eq!(refused(code).retry_class(), RetryClass::Fail, "{code:?}");
        }
        for code in [
            wire::ErrorCode::ReadFailed,
            wire::ErrorCode::Throttled,
            wire::ErrorCode::StorageUnavailable,
        ] {
            assert_eq!(refused(code).retry_class(), RetryClass::Refetch, "{code:?}");
        }
        assert_eq!(refused(wire::ErrorCode::Throttled).retry_after(), None);
        let throttled = FetchFailure::Refused {
            code: wire::ErrorCode::Throttled,
            retry_after_ms: 1500,
            message: "SlowDown".into(),
        };
        assert_eq!(
            throttled.retry_after(),
            Some(std::time::Duration::from_millis(1500))
        );
        assert_eq!(
            FetchFailure::Crc { got: 1, want: 2 }.retry_class(),
            RetryClass::Refetch
        );
    }

    #[test]
    fn a_held_fetch_counts_until_it_ends() {
        let p = pool(1 << 20);
        let count = Arc::new(AtomicUsize::new(0));
        let (mut f, _rx) = in_flight(&p, 0, 4096, 1);
        f.held = Some(Held::new(&count, None));
        assert_eq!(count.load(Ordering::Acquire), 1);
        f.finish(Err(FetchFailure::Cancelled));
        assert_eq!(count.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_fetch_dropped_without_an_outcome_comes_back_abandoned_with_its_slab() {
        let p = pool(1 << 20);
        let count = Arc::new(AtomicUsize::new(0));
        let (mut f, mut rx) = in_flight(&p, 5, 4096, 1);
        f.req = 9;
        f.held = Some(Held::new(&count, None));
        // A receiver thread that panics drops the fetch it was placing.
        let r = std::thread::spawn(move || {
            let _f = f;
            panic!("test: a receiver panicked");
        })
        .join();
        assert!(r.is_err());
        let c = rx.try_recv().expect("an outcome came back");
        assert_eq!(c.pos, 5);
        assert_eq!(
            c.result,
            Err(FetchFailure::Abandoned {
                holder: "link or receiver"
            })
        );
        assert_eq!(c.result.unwrap_err().retry_class(), RetryClass::Refetch);
        assert_eq!(
            c.slab.len(),
            4096,
            "the slab came back to be fetched into again"
        );
        assert_eq!(count.load(Ordering::Acquire), 0, "no longer outstanding");
        drop(c.slab);
        assert_eq!(p.used(), 0);
    }

    #[test]
    fn a_fetch_dropped_after_its_stream_closed_frees_its_slab_quietly() {
        let p = pool(1 << 20);
        let (f, rx) = in_flight(&p, 1, 4096, 1);
        drop(rx); // the stream closed (or the node is shutting down)
        drop(f);
        assert_eq!(p.used(), 0, "the slab went back to the pool");
    }

    #[test]
    fn an_unsent_fetch_gives_its_slab_back_and_reports_nothing() {
        let p = pool(1 << 20);
        let (f, mut rx) = in_flight(&p, 2, 4096, 1);
        let slab = f.unsent();
        assert!(rx.try_recv().is_err(), "no outcome for a FETCH never sent");
        assert_eq!(slab.len(), 4096);
        drop(slab);
        assert_eq!(p.used(), 0);
    }

    /// A payload that fails its CRC-32C is reported on the control writer of the session that
    /// sent its FETCH (`Error{req, ChecksumMismatch}`); a good one is not, and a session that
    /// has ended gets nothing (and nothing blocks). Before, the source never heard of it.
    #[test]
    fn a_payload_that_fails_its_crc_is_reported_to_the_session_that_fetched_it() {
        let p = pool(1 << 20);
        let count = Arc::new(AtomicUsize::new(0));
        let (ctl, mut frames) = mpsc::unbounded_channel::<Vec<u8>>();
        let fetch = |pos, crc| {
            let (mut f, rx) = in_flight(&p, pos, 4096, crc);
            (f.req, f.wire_shard) = (9 + pos, 3);
            f.held = Some(Held::new(&count, Some(ctl.downgrade())));
            (f, rx)
        };
        let (good, _rx) = fetch(0, 7);
        good.verified(7);
        assert!(frames.try_recv().is_err(), "a good payload is not reported");
        let (bad, _rx) = fetch(1, 7);
        bad.verified(8);
        let frame = frames.try_recv().expect("a report");
        match wire::decode_frame(&frame[4..]).unwrap() {
            Message::Error {
                req, code, message, ..
            } => {
                assert_eq!((req, code), (10, wire::ErrorCode::ChecksumMismatch));
                assert_eq!(
                    message,
                    "the payload of shard 3 (FETCH 10) has CRC-32C 0x00000008, the manifest says 0x00000007"
                );
            }
            other => panic!("{other:?}"),
        }
        let (late, _rx) = fetch(2, 7);
        drop(ctl); // the session ended
        late.verified(8);
        assert!(
            frames.try_recv().is_err(),
            "nothing for a session that ended"
        );
    }

    #[test]
    fn a_fetch_whose_stream_is_gone_frees_its_slab() {
        let p = pool(1 << 20);
        let (f, rx) = in_flight(&p, 0, 4096, 1);
        drop(rx);
        f.verified(1);
        assert_eq!(p.used(), 0);
    }
}
