//! What every receive path shares: the read sizes and the low-water rule, the stall timeout
//! and the progress floor ([`Pace`]), what payload bytes are read from ([`PayloadRead`]), the loop of the paths that place one
//! payload at a time ([`Place`], [`run`]), the one piece callback (CRC-32C while the bytes are in cache,
//! the time it took, the flow's byte count), and the three ways a fetch ends on a data
//! connection ([`deliver`], [`lost`], [`fail_queued`]). A leaf: it uses no other path.

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use shardwire_gpu::cuda::{CudaMemory, VmmRegion};
use shardwire_protocol::crc::Crc32c;

use super::error::RxError;
use crate::counters::{Counters, FlowStats};
use crate::fetch::{FetchFailure, InFlight};
use crate::link::SourceLink;

/// Largest single read of the paths that read through a buffer of their own (the devmem
/// path's host gather, the staged path's host buffers): large enough to amortise the
/// syscall, small enough that the bytes are still in L2 when they are checksummed. The
/// `recv` path reads the rest of each payload instead (`recv.rs`).
pub const CHUNK: usize = 1 << 20;

/// `SO_RCVLOWAT` of plain-TCP data connections (see
/// [`lowat_for`] for the smaller marks near a payload's end). Measured with `bench` on
/// loopback (docs/BENCHMARKS.md): 256 KiB and 512 KiB raised goodput by about a quarter over
/// the default of 1 byte at a lower CPU per GB; 1 MiB (with 2 MiB reads) was worse than both.
/// A slow link still makes progress: a read that times out returns what has arrived (the
/// io_uring path, whose receive is woken only at the mark, lowers it to 1 when a wait times
/// out with bytes queued: `uring.rs`).
pub const RCVLOWAT: i32 = 256 << 10;

/// Below this a read takes whatever has arrived (`SO_RCVLOWAT` 1).
const MIN_LOWAT: usize = 16 << 10;

/// A payload that stops arriving for this long (a source that is alive on its control
/// connection but stalls a data connection) fails the fetch and resets the link.
pub const DATA_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The least progress a data connection must make while payload bytes are due on it: in
/// every `window`, `floor` bytes, or all that was due if less ([`Pace`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PaceRule {
    /// The window.
    pub window: Duration,
    /// Bytes per window.
    pub floor: u64,
}

impl PaceRule {
    /// 1 MiB a minute (17 KiB/s): far below any link a node reads from (a source's
    /// `rate_limit` gives each connection its share, and the source warns below this), far
    /// above a source that sends a byte just inside every [`DATA_STALL_TIMEOUT`].
    pub const DEFAULT: Self = Self {
        window: shardwire_protocol::wire::DATA_PACE_WINDOW,
        floor: shardwire_protocol::wire::DATA_PACE_FLOOR,
    };
}

/// A data connection's progress over the payloads due on it, judged by a [`PaceRule`]. The
/// stall timeout is per read: alone, it lets a source that sends a byte every 59 s hold a
/// receiver, and every fetch announced on its connection, for ever. A connection below the
/// floor is broken: its fetches are fetched again and its link session reset.
#[derive(Clone, Debug)]
pub struct Pace {
    rule: PaceRule,
    /// The current window's start.
    start: Instant,
    /// Bytes landed in it.
    got: u64,
    /// Bytes still due.
    due: u64,
}

impl Pace {
    /// An idle connection judged by `rule`.
    pub fn new(rule: PaceRule) -> Self {
        Self {
            rule,
            start: Instant::now(),
            got: 0,
            due: 0,
        }
    }

    /// `n` more bytes became due at `now` (a payload begun, or posted behind others); on an
    /// idle connection the first window starts now.
    pub fn due(&mut self, now: Instant, n: u64) {
        if self.due == 0 {
            (self.start, self.got) = (now, 0);
        }
        self.due += n;
    }

    /// `n` bytes landed.
    pub fn landed(&mut self, n: u64) {
        self.got += n;
        self.due = self.due.saturating_sub(n);
    }

    /// Whether the connection kept to the floor, judged at `now`: once a window has passed,
    /// the bytes that landed in it must reach the floor unless nothing is due any more; then
    /// the next window starts.
    pub fn check(&mut self, now: Instant) -> Result<(), RxError> {
        let took = now.saturating_duration_since(self.start);
        if took < self.rule.window {
            return Ok(());
        }
        if self.got < self.rule.floor && self.due > 0 {
            return Err(RxError::TooSlow {
                got: self.got,
                took,
                due: self.due,
                floor: self.rule.floor,
                window: self.rule.window,
            });
        }
        (self.start, self.got) = (now, 0);
        Ok(())
    }

    /// [`Self::landed`], then [`Self::check`] now.
    pub fn landed_now(&mut self, n: usize) -> Result<(), RxError> {
        self.landed(n as u64);
        self.check(Instant::now())
    }
}

/// The `SO_RCVLOWAT` for a read that may take `len` more bytes of a payload: [`RCVLOWAT`],
/// or half of `len` if that is less (1 below [`MIN_LOWAT`]). The kernel wakes a blocked
/// reader on the socket's mark, not on the read's length, so the mark stays at most half of
/// what is still on its way: the receive window (which the queued bytes fill) never has to
/// hold all of it.
pub fn lowat_for(len: usize) -> i32 {
    let half = len / 2;
    match half < MIN_LOWAT {
        true => 1,
        false => half.min(RCVLOWAT as usize) as i32,
    }
}

/// The GPUs the node opened (none: host memory); a path that writes a CUDA slab uses the one
/// that holds it.
#[derive(Clone, Debug, Default)]
pub struct Gpus(Arc<[Arc<CudaMemory>]>);

impl Gpus {
    /// These GPUs.
    pub fn new(gpus: Vec<Arc<CudaMemory>>) -> Self {
        Self(gpus.into())
    }

    /// True on a host-memory node.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The GPU that holds `region`.
    pub fn of(&self, region: &VmmRegion) -> Option<&Arc<CudaMemory>> {
        let ordinal = region.device().ordinal();
        self.0.iter().find(|g| g.device.ordinal() == ordinal)
    }
}

/// Something payload bytes can be read from.
pub trait PayloadRead {
    /// Reads some bytes into `dst` (0 at end of stream).
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize>;
}

impl PayloadRead for &[u8] {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        io::Read::read(self, dst)
    }
}

/// Puts one payload into its slab and returns the CRC-32C of what arrived.
pub trait Place {
    /// Receives `f`'s payload into `f.slab`, noting each read's bytes in `pace` and keeping
    /// to it; an error means the connection is broken.
    fn place(
        &mut self,
        f: &mut InFlight,
        tally: &mut Tally<'_>,
        pace: &mut Pace,
    ) -> Result<u32, RxError>;
}

/// Which data connection a receive loop serves: its number, and the link session that
/// announced it (a broken connection resets that session only, never a newer one).
#[derive(Clone, Copy, Debug)]
pub struct ConnAt {
    /// The connection number.
    pub conn: u16,
    /// The link session (generation) it belongs to.
    pub generation: u64,
}

/// Receives the payloads announced for one connection, one at a time, until its queue
/// closes, each at `rule`'s pace or better; a broken connection fails its payload and every
/// later one.
pub fn run<P: Place>(
    mut path: P,
    link: &SourceLink,
    at: ConnAt,
    queue: &Receiver<InFlight>,
    flow: &FlowStats,
    c: &Counters,
    rule: PaceRule,
) {
    let mut misses = Mismatches::default();
    let mut pace = Pace::new(rule);
    while let Ok(mut f) = queue.recv() {
        // One span per fetch: the receive and the verification happen inside it.
        let span = tracing::debug_span!("fetch", req = f.req, shard = f.shard, source = %link.addr);
        let _entered = span.enter();
        let mut tally = Tally::new(flow, link);
        pace.due(Instant::now(), f.length);
        let placed = path.place(&mut f, &mut tally, &mut pace);
        tally.flush(c);
        match placed {
            Ok(got) => {
                let payload = (f.shard, f.crc32c);
                misses.note(payload, deliver(f, got, link, c));
                if let Err(cause) = misses.check() {
                    return broken([], queue, link, at, cause);
                }
            }
            Err(cause) => return broken([f], queue, link, at, cause),
        }
    }
}

/// CRC mismatches in a row on one connection, of different shards: one is a damaged payload
/// (fetched again), [`MAX_MISMATCHES_IN_A_ROW`] are a connection whose payloads no longer
/// start where they were announced to, which is dropped before it fails every payload after
/// them. A shard whose stored bytes are bad fails again and again, on whatever connection:
/// its mismatches in a row count once (the stream closes it `Corrupt` after its own limit).
#[derive(Debug, Default)]
pub struct Mismatches {
    in_a_row: u32,
    /// The payload (shard, CRC-32C) of the last mismatch, while the run lasts: streams of
    /// several datasets share a connection, and their shard numbers are their own.
    last: Option<(u32, u32)>,
}

/// Mismatches in a row that drop a connection.
pub const MAX_MISMATCHES_IN_A_ROW: u32 = 2;

impl Mismatches {
    /// Notes a delivered payload (its shard and the CRC-32C it should have): whether its
    /// CRC matched.
    pub fn note(&mut self, payload: (u32, u32), matched: bool) {
        if matched {
            (self.in_a_row, self.last) = (0, None);
        } else if self.last != Some(payload) {
            (self.in_a_row, self.last) = (self.in_a_row + 1, Some(payload));
        }
    }

    /// `Err` once the connection should be dropped.
    pub fn check(&self) -> Result<(), RxError> {
        if self.in_a_row >= MAX_MISMATCHES_IN_A_ROW {
            return Err(RxError::Misframed {
                in_a_row: self.in_a_row,
            });
        }
        Ok(())
    }
}

/// The checksum of one payload as its pieces land.
#[derive(Debug)]
pub struct Checksum(Crc32c);

impl Checksum {
    /// Nothing seen yet.
    pub fn new() -> Self {
        Self(Crc32c::new())
    }

    /// The CRC-32C of the bytes seen.
    pub fn finish(&self) -> u32 {
        self.0.finish()
    }
}

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

/// The one piece callback of every host-visible path: each piece that lands is checksummed
/// right away (in cache for a `recv` piece; an io_uring completion of several MiB may have
/// left L2, docs/ARCHITECTURE.md §12), the time that takes is summed (the node's assembly
/// counter), and the flow and the link count its bytes (the link's count tells its stall
/// check that the source is at work: `crate::link::stall`).
#[derive(Debug)]
pub struct Tally<'a> {
    flow: &'a FlowStats,
    link: &'a SourceLink,
    spent: Duration,
}

impl<'a> Tally<'a> {
    /// A tally for `flow`, a data connection of `link`.
    pub fn new(flow: &'a FlowStats, link: &'a SourceLink) -> Self {
        Self {
            flow,
            link,
            spent: Duration::ZERO,
        }
    }

    /// `bytes` landed on the connection.
    fn landed(&self, bytes: usize) {
        self.flow.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.link.landed.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// A piece of a payload landed.
    pub fn piece(&mut self, sum: &mut Checksum, piece: &[u8]) {
        let t = Instant::now();
        sum.0.update(piece);
        self.spent += t.elapsed();
        self.landed(piece.len());
        self.flow.crc_piece(piece.len());
    }

    /// Bytes that landed where the CPU does not checksum them (GPU memory).
    pub fn unseen(&mut self, bytes: usize) {
        self.landed(bytes);
    }

    /// Time spent on a check done elsewhere (the CRC kernel).
    pub fn spent(&mut self, d: Duration) {
        self.spent += d;
    }

    /// Adds the time spent to the node's counters.
    pub fn flush(self, c: &Counters) {
        c.assembly_ns
            .fetch_add(self.spent.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The error of a payload read (call `op`) that failed after `got` of `want` bytes: one that
/// timed out (`SO_RCVTIMEO` at [`DATA_STALL_TIMEOUT`]: `WouldBlock`, or `TimedOut`) is
/// [`RxError::Stalled`], not the OS's "Resource temporarily unavailable".
pub fn read_failed(op: &'static str, e: &io::Error, got: u64, want: u64) -> RxError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => RxError::Stalled {
            after: DATA_STALL_TIMEOUT,
            got,
            want,
        },
        _ => RxError::io(op, e),
    }
}

/// The failure of a fetch whose connection broke.
pub fn lost(link: &SourceLink, conn: u16, cause: RxError) -> FetchFailure {
    FetchFailure::ConnectionLost {
        source_addr: link.addr.clone(),
        conn,
        cause,
    }
}

/// Ends a received fetch: counts it when its CRC-32C (`got`) matches, warns when not (the
/// stream fetches it again). Returns whether it matched.
pub fn deliver(f: InFlight, got: u32, link: &SourceLink, c: &Counters) -> bool {
    let matched = got == f.crc32c;
    if matched {
        c.bytes_received.fetch_add(f.length, Ordering::Relaxed);
        c.shards_received.fetch_add(1, Ordering::Relaxed);
        link.bytes.fetch_add(f.length, Ordering::Relaxed);
    } else {
        c.crc_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(source = %link.addr, shard = f.shard, got = format!("{got:08x}"), want = format!("{:08x}", f.crc32c),
            "CRC-32C mismatch: the shard will be fetched again");
    }
    f.verified(got);
    matched
}

/// A connection broke inside the payloads of `failed` (or before any): fails them, resets
/// the link session it belongs to, and fails every payload still announced on the
/// connection until its queue closes.
pub fn broken(
    failed: impl IntoIterator<Item = InFlight>,
    queue: &Receiver<InFlight>,
    link: &SourceLink,
    at: ConnAt,
    cause: RxError,
) {
    let conn = at.conn;
    for f in failed {
        f.finish(Err(lost(link, conn, cause.clone())));
    }
    link.kick_if(
        at.generation,
        &format!("data connection {conn} from {} failed: {cause}", link.addr),
    );
    fail_queued(queue, link, conn, &cause);
}

/// After a connection broke: fails every payload still announced on it until its queue
/// closes.
pub fn fail_queued(queue: &Receiver<InFlight>, link: &SourceLink, conn: u16, cause: &RxError) {
    while let Ok(f) = queue.recv() {
        f.finish(Err(lost(
            link,
            conn,
            RxError::Earlier(Box::new(cause.clone())),
        )));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mismatches_in_a_row_drop_the_connection_one_does_not() {
        let mut m = Mismatches::default();
        m.note((1, 11), false);
        assert!(m.check().is_ok());
        m.note((2, 22), true);
        m.note((3, 33), false);
        assert!(
            m.check().is_ok(),
            "a match in between starts the count again"
        );
        m.note((3, 33), false);
        m.note((3, 33), false);
        assert!(
            m.check().is_ok(),
            "one bad shard fetched again is no framing loss"
        );
        m.note((4, 44), false);
        assert!(matches!(m.check(), Err(RxError::Misframed { in_a_row: 2 })));
        // Shard 3 of another dataset on the connection (another CRC) is another payload.
        let mut m = Mismatches::default();
        m.note((3, 33), false);
        m.note((3, 99), false);
        assert!(matches!(m.check(), Err(RxError::Misframed { in_a_row: 2 })));
    }

    /// The floor is judged once a window has passed, on what landed in it, while bytes are
    /// due; an idle connection starts its next window when a payload begins.
    #[test]
    fn a_window_below_the_floor_while_bytes_are_due_is_too_slow() {
        let rule = PaceRule {
            window: Duration::from_secs(60),
            floor: 1000,
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut p = Pace::new(rule);
        p.due(at(0), 5000);
        p.landed(999);
        assert!(p.check(at(59)).is_ok(), "the window has not passed");
        match p.check(at(61)) {
            Err(RxError::TooSlow {
                got: 999,
                due: 4001,
                floor: 1000,
                took,
                ..
            }) => assert_eq!(took, Duration::from_secs(61)),
            other => panic!("{other:?}"),
        }
        // At the floor, the next window starts where the check was made.
        let mut p = Pace::new(rule);
        p.due(at(0), 5000);
        p.landed(1000);
        assert!(p.check(at(61)).is_ok());
        p.landed(10);
        assert!(p.check(at(120)).is_ok(), "the second window runs to 121 s");
        assert!(matches!(
            p.check(at(122)),
            Err(RxError::TooSlow { got: 10, .. })
        ));
        // The last bytes of a payload may come slowly: nothing is due after them.
        let mut p = Pace::new(rule);
        p.due(at(0), 500);
        p.landed(500);
        assert!(p.check(at(300)).is_ok());
        // Idle for hours, then a payload: its window starts when it is due.
        p.due(at(10_000), 2000);
        assert!(p.check(at(10_030)).is_ok());
        p.landed(2000);
        // Posted behind others: more becomes due in the same window.
        let mut p = Pace::new(rule);
        p.due(at(0), 100);
        p.due(at(30), 100_000);
        p.landed(900);
        assert!(matches!(
            p.check(at(60)),
            Err(RxError::TooSlow {
                got: 900,
                due: 99_200,
                ..
            })
        ));
    }

    #[test]
    fn the_mark_is_at_most_half_of_what_is_due() {
        assert_eq!(lowat_for(0), 1);
        assert_eq!(lowat_for(2 * MIN_LOWAT - 1), 1);
        assert_eq!(lowat_for(2 * MIN_LOWAT), MIN_LOWAT as i32);
        assert_eq!(lowat_for(300 << 10), 150 << 10);
        assert_eq!(lowat_for(64 << 20), RCVLOWAT);
    }
}
