//! `--compare-crc`: where the CRC-32C of received bytes is computed, measured side by side
//! on the same flows into the stream-sized region. Every way checksums every shard and
//! checks it against the file's CRC (a mismatch is counted), so the figures are for verified
//! bytes. The ways ([`Way`]): straight into the slot with reads of the rest of the slot (the
//! node's `recv` path) or of at most a piece, and the CRC right after each read; through a small
//! cache-hot bounce buffer, checksummed there and then copied into the slot with
//! non-temporal stores or `memcpy`, or with CRC and copy fused; io_uring placing bytes in the
//! slot, each completion checksummed as it lands ([`Way::Uring`] can cap the completions; the
//! runs of `--compare-crc` leave them uncapped); the node's io_uring queue handing whole
//! payloads to the kernel (its path) or pieces with a bounded window ahead of the bytes that
//! arrived.
//!
//! Each way also reports how far the CRC runs behind the copy that landed the bytes: the
//! median, weighted by bytes, of the piece a checksum reads right after it landed, as the
//! power-of-two range it fell in ([`piece_range`]). Pieces well within the L2 cache are read
//! hot; pieces of several MiB are read back from memory.

use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use shardwire_devmem::uring::bench::RecvInto;
use shardwire_devmem::uring::{QUEUE_DEPTH, RecvQueue, StableBuf, Window};
use shardwire_node::bench::{PayloadRead, Plain, copy_nt, lowat_for};
use shardwire_protocol::crc::Crc32c;

/// Where received bytes are checksummed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// `recv` straight into the slot, reads of at most `piece` bytes (0: the rest of the
    /// slot, the node's `recv` path), CRC after each read.
    InPlace {
        /// Largest read (0: no limit).
        piece: usize,
    },
    /// `recv` into a `bounce`-byte buffer, CRC there, then copied into the slot as `copy`
    /// says.
    Bounce {
        /// The buffer's size.
        bounce: usize,
        /// How the checksummed bytes go on into the slot.
        copy: Onward,
    },
    /// io_uring into the slot (the slot is the provided buffer), each completion at most
    /// `cap` bytes (0: uncapped) and checksummed as it lands.
    Uring {
        /// The completion cap.
        cap: u32,
    },
    /// The node's io_uring queue (`RecvQueue`): slots posted ahead as payloads, handed to
    /// the kernel in pieces of `piece` bytes with at most `ahead` bytes outstanding (0:
    /// whole payloads, all at once), each completion checksummed as it lands.
    Queue {
        /// Piece size (0: whole payloads).
        piece: usize,
        /// Bytes handed over ahead of what arrived.
        ahead: usize,
    },
}

/// How [`Way::Bounce`] moves checksummed bytes from its buffer into the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Onward {
    /// The whole read checksummed, then copied with non-temporal stores (the slot's lines
    /// are not read for ownership and do not evict the buffer).
    NonTemporal,
    /// The whole read checksummed, then copied with `memcpy`.
    Plain,
    /// CRC and `memcpy` fused: each 16 KiB step of the read is checksummed and copied
    /// while it is in L1.
    Fused,
}

/// The step of [`Onward::Fused`].
const FUSED_STEP: usize = 16 << 10;

fn kib(n: usize) -> String {
    match n >= 1 << 20 {
        true => format!("{}M", n >> 20),
        false => format!("{}K", n >> 10),
    }
}

impl Way {
    /// The name of a run with this way.
    pub fn label(self) -> String {
        match self {
            Self::InPlace { piece: 0 } => "crc-inplace-whole".to_string(),
            Self::InPlace { piece } => format!("crc-inplace-{}", kib(piece)),
            Self::Bounce { bounce, copy } => {
                let how = match copy {
                    Onward::NonTemporal => "bounce-nt",
                    Onward::Plain => "bounce-copy",
                    Onward::Fused => "fused",
                };
                format!("crc-{how}-{}", kib(bounce))
            }
            Self::Uring { cap: 0 } => "crc-uring".to_string(),
            Self::Uring { cap } => format!("crc-uring-{}", kib(cap as usize)),
            Self::Queue { piece: 0, .. } => "crc-queue".to_string(),
            Self::Queue { piece, ahead } => {
                format!("crc-queue-{}-ahead-{}", kib(piece), kib(ahead))
            }
        }
    }
}

/// What the checksums saw: failures, and the pieces they read, weighted by bytes.
#[derive(Debug, Default)]
pub struct CrcStats {
    /// Shards whose CRC differed from their file's.
    pub failures: AtomicU64,
    /// Shards checked.
    pub checked: AtomicU64,
    /// Bytes checksummed, by the log2 of the piece they came in.
    pieces: Mutex<[u64; 32]>,
}

/// Counts a checksummed piece of `n` bytes in a receiver's own histogram.
fn tally(n: usize, local: &mut [u64; 32]) {
    local[(usize::BITS - 1 - n.max(1).leading_zeros()) as usize] += n as u64;
}

impl CrcStats {
    fn merge(&self, local: &[u64; 32]) {
        let mut p = self.pieces.lock().expect("poisoned");
        for (a, b) in p.iter_mut().zip(local) {
            *a += b;
        }
    }

    /// The lower bound `lo` of the power-of-two range `[lo, 2 lo)` of piece sizes that holds
    /// the median checksummed byte (at least half of the bytes came in pieces below `2 lo`);
    /// 0 when nothing was checksummed. [`piece_range`] prints the range.
    pub fn median_piece(&self) -> usize {
        let p = self.pieces.lock().expect("poisoned");
        let total: u64 = p.iter().sum();
        let mut seen = 0;
        for (k, b) in p.iter().enumerate() {
            seen += b;
            if total > 0 && seen * 2 >= total {
                return 1 << k;
            }
        }
        0
    }
}

/// The power-of-two range `[lo, 2 lo)` of a median piece of lower bound `lo` (as
/// [`CrcStats::median_piece`] and the node's `FlowStats::median_crc_piece` give it), e.g.
/// `512-1024 KiB`; in bytes below 1 KiB, `none` for 0.
pub fn piece_range(lo: usize) -> String {
    let hi = lo.saturating_mul(2);
    match lo {
        0 => "none".to_string(),
        1..1024 => format!("{lo}-{hi} B"),
        _ => format!("{}-{} KiB", lo >> 10, hi >> 10),
    }
}

/// What a receiver of flow `flow` expects: the files' CRCs, sent from `flow` on in turn.
pub struct Check<'a> {
    /// CRC-32C of each file, in the order the senders cycle through them.
    pub crcs: &'a [u32],
    /// The flow (its sender starts at this file).
    pub flow: usize,
    /// Where the results go.
    pub stats: &'a CrcStats,
}

/// Fills one slot, checksumming into the CRC and tallying pieces; false at the peer's close.
type Fill<'a> = dyn FnMut(&mut [u8], &mut Crc32c, &mut [u64; 32]) -> std::io::Result<bool> + 'a;

/// Receives shards on `conn` into `slots` slots of `shard` bytes in turn as `way` says,
/// checking each, until the peer closes or `stop`.
pub fn receive(
    conn: TcpStream,
    way: Way,
    shard: usize,
    slots: usize,
    check: &Check<'_>,
    stop: &AtomicBool,
    received: &AtomicU64,
) -> std::io::Result<()> {
    if let Way::Queue { piece, ahead } = way {
        return queued(conn, (piece, ahead), (shard, slots), check, stop, received);
    }
    let mut region = vec![0u8; slots * shard];
    let mut local = [0u64; 32];
    let mut fill: Box<Fill<'_>> = match way {
        Way::InPlace { piece } => {
            let mut r = Plain::new(conn);
            Box::new(move |slot, crc, local| in_place(&mut r, piece, slot, crc, local, received))
        }
        Way::Bounce { bounce, copy } => {
            let (mut r, mut buf) = (Plain::new(conn), vec![0u8; bounce]);
            Box::new(move |slot, crc, local| {
                bounced(&mut r, (&mut buf, copy), slot, crc, local, received)
            })
        }
        Way::Queue { .. } => unreachable!("queued above"),
        Way::Uring { cap } => {
            shardwire_devmem::set_rcvlowat(conn.as_fd(), lowat_for(shard))?;
            let mut rx = RecvInto::new(conn)?;
            rx.set_piece_cap(cap);
            Box::new(move |slot, crc, local| {
                let r = rx.recv(slot, Duration::from_secs(60), |_, p| {
                    crc.update(p);
                    tally(p.len(), local);
                    received.fetch_add(p.len() as u64, Ordering::Relaxed);
                });
                match r {
                    Ok(()) => Ok(true),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
                    Err(e) => Err(e),
                }
            })
        }
    };
    let mut k = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let slot = &mut region[(k % slots) * shard..(k % slots + 1) * shard];
        let mut crc = Crc32c::new();
        if !fill(slot, &mut crc, &mut local)? {
            break;
        }
        let want = check.crcs[(check.flow + k) % check.crcs.len()];
        if crc.finish() != want {
            check.stats.failures.fetch_add(1, Ordering::Relaxed);
        }
        check.stats.checked.fetch_add(1, Ordering::Relaxed);
        k += 1;
    }
    check.stats.merge(&local);
    Ok(())
}

/// One shard straight into `slot`, reads of at most `piece`; false at the peer's close.
fn in_place(
    r: &mut Plain,
    piece: usize,
    slot: &mut [u8],
    crc: &mut Crc32c,
    local: &mut [u64; 32],
    received: &AtomicU64,
) -> std::io::Result<bool> {
    let mut at = 0;
    while at < slot.len() {
        let end = match piece {
            0 => slot.len(),
            piece => (at + piece).min(slot.len()),
        };
        let n = r.read_some(&mut slot[at..end])?;
        if n == 0 {
            return Ok(false);
        }
        crc.update(&slot[at..at + n]);
        tally(n, local);
        received.fetch_add(n as u64, Ordering::Relaxed);
        at += n;
    }
    Ok(true)
}

/// One shard through the bounce buffer `buf` into `slot`, copied on as `copy` says; false
/// at the peer's close.
fn bounced(
    r: &mut Plain,
    (buf, copy): (&mut [u8], Onward),
    slot: &mut [u8],
    crc: &mut Crc32c,
    local: &mut [u64; 32],
    received: &AtomicU64,
) -> std::io::Result<bool> {
    let mut at = 0;
    while at < slot.len() {
        let want = buf.len().min(slot.len() - at);
        let n = r.read_some(&mut buf[..want])?;
        if n == 0 {
            return Ok(false);
        }
        let (dst, src) = (&mut slot[at..at + n], &buf[..n]);
        match copy {
            Onward::NonTemporal => {
                crc.update(src);
                copy_nt(dst, src);
            }
            Onward::Plain => {
                crc.update(src);
                dst.copy_from_slice(src);
            }
            Onward::Fused => {
                for (d, s) in dst.chunks_mut(FUSED_STEP).zip(src.chunks(FUSED_STEP)) {
                    crc.update(s);
                    d.copy_from_slice(s);
                }
            }
        }
        tally(n, local);
        received.fetch_add(n as u64, Ordering::Relaxed);
        at += n;
    }
    Ok(true)
}

/// A slot of the region posted to a [`RecvQueue`], with its running CRC.
struct Slot {
    at: *mut u8,
    len: usize,
    k: usize,
    crc: Crc32c,
}

// SAFETY: the bytes are a slot of the receiver's region, which is neither moved nor freed
// while the queue holds slots (the queue is dropped before it, in `queued`); every call
// returns the same span. The tally is the slot's own CRC field, not the region.
unsafe impl StableBuf for Slot {
    type Tally = Crc32c;
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `at..at + len` is a slot of the live region; the queue is the only user
        // of it while it is posted.
        unsafe { std::slice::from_raw_parts_mut(self.at, self.len) }
    }
    fn tally(&mut self) -> &mut Crc32c {
        &mut self.crc
    }
}

/// [`Way::Queue`]: slots posted to the node's io_uring queue, checked as they complete.
fn queued(
    conn: TcpStream,
    (piece, ahead): (usize, usize),
    (shard, slots): (usize, usize),
    check: &Check<'_>,
    stop: &AtomicBool,
    received: &AtomicU64,
) -> std::io::Result<()> {
    let mut region = vec![0u8; slots * shard];
    let base = region.as_mut_ptr();
    let window = match piece {
        0 => Window::WHOLE,
        _ => Window { piece, ahead },
    };
    shardwire_devmem::set_rcvlowat(conn.as_fd(), lowat_for(shard))?;
    let mut q = RecvQueue::<Slot>::with_window(conn, window)?;
    let mut local = [0u64; 32];
    let (mut next, depth) = (0usize, slots.min(usize::from(QUEUE_DEPTH)));
    let r = (|| {
        while !stop.load(Ordering::Relaxed) {
            while q.len() < depth {
                let at = base.wrapping_add((next % slots) * shard);
                let slot = Slot {
                    at,
                    len: shard,
                    k: next,
                    crc: Crc32c::new(),
                };
                q.post(slot).map_err(|(_, e)| e)?;
                next += 1;
            }
            let waited = q.wait(
                Duration::from_secs(60),
                |crc, _, p| {
                    crc.update(p);
                    tally(p.len(), &mut local);
                    received.fetch_add(p.len() as u64, Ordering::Relaxed);
                },
                |s| {
                    let want = check.crcs[(check.flow + s.k) % check.crcs.len()];
                    if s.crc.finish() != want {
                        check.stats.failures.fetch_add(1, Ordering::Relaxed);
                    }
                    check.stats.checked.fetch_add(1, Ordering::Relaxed);
                },
            );
            match waited {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })();
    drop(q); // the kernel lets go of the slots before the region goes
    drop(region);
    check.stats.merge(&local);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_piece_is_the_range_it_fell_in() {
        let s = CrcStats::default();
        assert_eq!(
            (s.median_piece(), piece_range(s.median_piece())),
            (0, "none".into())
        );
        let mut local = [0u64; 32];
        for piece in [300 << 10, 300 << 10, 256 << 10, 4 << 10] {
            tally(piece, &mut local);
        }
        s.merge(&local);
        // The median byte came in a piece of 300 KiB: the range 256-512 KiB. Before, the
        // report said "256 KiB", below it.
        assert_eq!(s.median_piece(), 256 << 10);
        assert_eq!(piece_range(s.median_piece()), "256-512 KiB");
        assert_eq!(piece_range(512), "512-1024 B");
        assert_eq!(piece_range(2 << 20), "2048-4096 KiB");
    }
}
