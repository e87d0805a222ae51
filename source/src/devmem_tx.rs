//! Devmem TX in the source (`source --devmem-tx IFNAME`): payloads are sent from a TX-bound
//! dma-buf with `sendmsg(SCM_DEVMEM_DMABUF, MSG_ZEROCOPY)` (reference devmem.md §5).
//!
//! The source binds one udmabuf to the interface at start ([`TxPath::bind`]; the binding's
//! netlink socket lives as long as the source) and gives each data connection a slot of it
//! ([`shardwire_devmem::txbuf`]). Per payload the sender reads the file range into the slot's
//! free space, sends it from there, and reuses space only after the kernel's zerocopy
//! completion for it. Where the data would come from GPU memory (a GPU-resident source) the
//! read is replaced by a device copy into the same buffer; from files it costs one copy that
//! `sendfile` does not, so this path is for NICs and GPUs that do devmem TX, not a default.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardwire_devmem::TxBinding;
use shardwire_devmem::tx::DevmemTx;
use shardwire_devmem::txbuf::{TxBuffer, TxSlot};

/// Largest piece read and sent at once.
pub(crate) const PIECE: usize = 1 << 20;
/// How long a connection that is done waits for the zerocopy completions of its last sends
/// before its slot is given back ([`DevmemSend::finish`]; a slot given back with sends not
/// completed is quarantined).
const FINISH_TIMEOUT: Duration = Duration::from_secs(10);

/// No zerocopy completion came for the socket's send (idle) timeout while the connection's
/// slot was full: the kernel completes a send once the node has acknowledged its bytes, so the
/// node read nothing for that long, as a send that times out says
/// ([`crate::sender::is_send_timeout`] counts both).
#[derive(Debug, thiserror::Error)]
#[error(
    "no zerocopy completion for {waited:?} with {in_flight} bytes in flight: the node read \
     nothing of the payload"
)]
pub(crate) struct NoCompletion {
    /// How long the sender waited: the socket's send timeout.
    pub waited: Duration,
    /// Bytes sent and not completed (the whole slot).
    pub in_flight: u64,
}

/// The source's devmem TX: the bound buffer and its binding.
#[derive(Debug)]
pub struct TxPath {
    /// The TX dma-buf, in per-connection slots.
    pub buffer: Arc<TxBuffer>,
    /// Keeps the binding (its netlink socket) for the life of the source.
    _binding: Option<TxBinding>,
    /// The interface.
    pub ifname: String,
}

/// Why devmem TX could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TxSetupError {
    /// The interface does not exist.
    #[error("devmem TX: no interface named {0}")]
    NoInterface(String),
    /// No TX dma-buf.
    #[error("devmem TX: allocating the TX dma-buf: {0}")]
    Buffer(io::Error),
    /// The kernel refused `bind-tx`.
    #[error("devmem TX on {ifname}: {source}")]
    Bind {
        /// The interface.
        ifname: String,
        /// The kernel's answer.
        #[source]
        source: shardwire_devmem::NetdevError,
    },
}

impl TxPath {
    /// Allocate a udmabuf of `bytes` in `slots` slots and `bind-tx` it to `ifname`.
    pub fn bind(ifname: &str, bytes: usize, slots: usize) -> Result<Self, TxSetupError> {
        let ifindex = ifindex(ifname)?;
        let buffer = TxBuffer::udmabuf(bytes, slots).map_err(TxSetupError::Buffer)?;
        let binding =
            shardwire_devmem::bind_tx(ifindex, buffer.fd().as_raw_fd()).map_err(|source| {
                TxSetupError::Bind {
                    ifname: ifname.into(),
                    source,
                }
            })?;
        buffer.set_binding_id(binding.id());
        Ok(Self {
            buffer,
            _binding: Some(binding),
            ifname: ifname.into(),
        })
    }

    /// The stand-in for [`TxPath::bind`] on an interface that cannot do devmem TX
    /// (`devmem_tx_emulate`, for tests): a plain memory buffer with binding id 0, sent from
    /// with the kernel's ordinary `MSG_ZEROCOPY` (a `sendmsg` without the devmem cmsg; same
    /// slots and completions). The interface must exist.
    pub fn emulated(ifname: &str, bytes: usize, slots: usize) -> Result<Self, TxSetupError> {
        ifindex(ifname)?;
        Ok(Self {
            buffer: TxBuffer::memfd(bytes, slots).map_err(TxSetupError::Buffer)?,
            _binding: None,
            ifname: ifname.into(),
        })
    }

    /// [`TxPath::emulated`] on `lo`, for unit tests.
    pub fn unbound_for_tests(bytes: usize, slots: usize) -> io::Result<Self> {
        Self::emulated("lo", bytes, slots).map_err(io::Error::other)
    }

    /// Whether this path is [`TxPath::emulated`] (no `bind-tx` binding).
    pub fn is_emulated(&self) -> bool {
        self._binding.is_none()
    }
}

/// The index of interface `ifname` in this network namespace.
fn ifindex(ifname: &str) -> Result<u32, TxSetupError> {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/ifindex"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| TxSetupError::NoInterface(ifname.into()))
}

/// The pause after a look for zerocopy completions that found some, and after the first that
/// found none: the kernel completes a send within a round trip once the node reads.
const POLL_MIN: Duration = Duration::from_micros(200);
/// The longest pause between two looks: a node that reads nothing for long costs its sender
/// thread about 500 looks a second (30 000 a minute), not 5000, and a node that reads again
/// after a stall finds the wire idle for at most this long (before, 20 ms: after a 15 ms
/// stall, up to 12.8 ms of an idle wire).
const POLL_MAX: Duration = Duration::from_millis(2);

/// The pause after the `quiet`-th look in a row that found no completion (0: the last look
/// found some): [`POLL_MIN`], doubling from the second on, at most [`POLL_MAX`].
fn poll_pause(quiet: u32) -> Duration {
    let doublings = quiet.saturating_sub(1).min(16);
    POLL_MIN.saturating_mul(1 << doublings).min(POLL_MAX)
}

/// Collects `tx`'s zerocopy completions into `slot`; whether there were any.
fn take_completions(tx: &mut DevmemTx<&TcpStream>, slot: &mut TxSlot) -> io::Result<bool> {
    let done = tx.poll_completions().map_err(io::Error::other)?;
    let any = !done.is_empty();
    for c in done {
        slot.complete(c);
    }
    Ok(any)
}

/// Waits until `slot` has room, collecting `tx`'s zerocopy completions, for at most `limit`
/// (the socket's send timeout: before, 10 s, reported as a failure of its own rather than
/// the node's silence); then fails with [`NoCompletion`]. It looks again after pauses that
/// grow while no completion comes ([`poll_pause`]): before, every 200 µs for the whole limit.
fn wait_for_room(
    tx: &mut DevmemTx<&TcpStream>,
    slot: &mut TxSlot,
    limit: Duration,
) -> io::Result<()> {
    let started = Instant::now();
    let mut quiet = 0;
    loop {
        let completed = take_completions(tx, slot)?;
        if slot.in_flight() < slot.capacity() {
            return Ok(());
        }
        let waited = started.elapsed();
        if waited > limit {
            let silent = NoCompletion {
                waited: limit,
                in_flight: slot.in_flight(),
            };
            return Err(io::Error::new(io::ErrorKind::TimedOut, silent));
        }
        quiet = if completed { 0 } else { quiet + 1 };
        // Past the limit by one short pause at most.
        let left = limit - waited + POLL_MIN;
        std::thread::sleep(poll_pause(quiet).min(left));
    }
}

/// The devmem TX half of a data connection's send path: the connection's TX socket wrapper
/// and its slot of the bound buffer.
pub(crate) struct DevmemSend<'a> {
    tx: DevmemTx<&'a TcpStream>,
    slot: TxSlot,
    /// The interface it sends through (the metric's label).
    pub(crate) ifname: Arc<str>,
    /// The socket's send (idle) timeout: how long a full slot waits for a completion.
    idle: Duration,
}

impl<'a> DevmemSend<'a> {
    /// Sends from `slot` on `stream`, through `ifname`; a slot with no completion for `idle`
    /// (the stream's send timeout) is the node not reading.
    pub(crate) fn new(
        stream: &'a TcpStream,
        slot: TxSlot,
        ifname: Arc<str>,
        idle: Duration,
    ) -> io::Result<Self> {
        let tx = DevmemTx::new(stream, slot.binding_id()).map_err(io::Error::other)?;
        Ok(Self {
            tx,
            slot,
            ifname,
            idle,
        })
    }

    /// Reads up to `want` bytes of `file` at `off` into free room of the slot (flipping the
    /// byte at `flip` if it falls inside), sends them, and collects completions; returns the
    /// bytes sent.
    pub(crate) fn send_piece(
        &mut self,
        file: &std::fs::File,
        off: u64,
        want: usize,
        flip: &mut Option<u64>,
    ) -> io::Result<usize> {
        let want = want.min(PIECE);
        if self.slot.reserve(want).is_none() {
            wait_for_room(&mut self.tx, &mut self.slot, self.idle)?;
        }
        // The read into the dma-buf is bracketed by its CPU write sync (`TxSlot::fill`).
        let filled = self.slot.fill(want, |bytes| {
            let n = rustix::io::pread(file, &mut *bytes, off)?;
            if let Some(at) = flip.filter(|at| (off..off + n as u64).contains(at)) {
                bytes[(at - off) as usize] ^= 0x5a;
                *flip = None;
            }
            Ok(n)
        })?;
        let (iov, n) = filled.expect("room after the wait");
        let mut done = 0;
        while done < n {
            let k = self
                .tx
                .send(&[(iov + done as u64, n - done)])
                .map_err(io::Error::other)?;
            self.slot.sent(k);
            done += k;
        }
        take_completions(&mut self.tx, &mut self.slot)?;
        Ok(n)
    }

    /// The connection is done: lets the last sends complete before the slot is reused.
    pub(crate) fn finish(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + FINISH_TIMEOUT;
        let mut quiet = 0;
        while self.slot.in_flight() > 0 {
            let completed = take_completions(&mut self.tx, &mut self.slot)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if self.slot.in_flight() == 0 || left.is_zero() {
                break;
            }
            quiet = if completed { 0 } else { quiet + 1 };
            std::thread::sleep(poll_pause(quiet).min(left));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;

    use super::*;
    use crate::sender::{Job, Sender, is_send_timeout};

    /// The whole TX path on loopback with binding id 0 (an ordinary MSG_ZEROCOPY sendmsg
    /// without the devmem cmsg, same completions): 64 KiB slots force the sender to
    /// wait for completions again and again; the bytes arrive exact, the corrupt flag flips
    /// exactly one byte, and the slot is free again when the connection ends.
    #[test]
    fn payloads_cross_loopback_from_the_tx_ring() {
        let path = TxPath::unbound_for_tests(2 * 64 * 1024, 2).unwrap();
        let dir = std::env::temp_dir().join(format!("sw-tx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let f = dir.join("shard.bin");
        std::fs::File::create(&f).unwrap().write_all(&data).unwrap();
        let file = Arc::new(std::fs::File::open(&f).unwrap());

        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        let s = Sender::spawn(out, 0, 0, Arc::default(), Some(&path), Default::default()).unwrap();
        assert!(
            path.buffer.slot().is_some(),
            "one of two slots is still free"
        );
        let jobs = [
            (0u64, 1_000_000u64, false),
            (1_000_000, 1_500_000, true),
            (2_500_000, 500_000, false),
        ];
        for (offset, len, corrupt) in jobs {
            assert!(s.push(Job {
                body: crate::sender::Body::File {
                    file: Arc::clone(&file),
                    offset,
                },
                len,
                corrupt,
                held: Default::default(),
            }));
        }
        let mut got = vec![0u8; data.len()];
        peer.read_exact(&mut got).unwrap();
        let diff: Vec<usize> = (0..data.len()).filter(|&i| got[i] != data[i]).collect();
        assert_eq!(
            diff,
            [1_000_000 + 750_000],
            "exactly the corrupted byte differs"
        );
        drop(s); // the sender thread ends, its slot comes back
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut free = 0;
        while Instant::now() < deadline {
            let a = path.buffer.slot();
            let b = path.buffer.slot();
            free = usize::from(a.is_some()) + usize::from(b.is_some());
            if free == 2 {
                break;
            }
            drop((a, b));
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(free, 2, "both slots free after the connection ended");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A full slot whose sends never complete (counted as sent, never given to the kernel):
    /// the wait gives up after the limit it is given (the socket's send timeout) with an
    /// error that says the node read nothing.
    #[test]
    fn a_slot_that_gets_no_completion_for_the_send_timeout_is_the_nodes_silence() {
        let path = TxPath::unbound_for_tests(64 * 1024, 1).unwrap();
        let mut slot = path.buffer.slot().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let _peer = l.accept().unwrap();
        let mut tx = DevmemTx::new(&out, slot.binding_id()).unwrap();
        let cap = slot.capacity() as usize;
        slot.reserve(cap).expect("an empty slot");
        slot.sent(cap);
        let limit = Duration::from_millis(300);
        let t0 = Instant::now();
        let e = wait_for_room(&mut tx, &mut slot, limit).expect_err("no room comes");
        assert!(t0.elapsed() >= limit, "waited {:?}", t0.elapsed());
        // Before, it waited a fixed 10 s and was logged as a failure of its own.
        assert!(is_send_timeout(&e), "{e}");
        assert!(e.to_string().contains("no zerocopy completion"), "{e}");
    }

    /// Looks for completions grow from 200 µs to 2 ms apart while none comes, and start
    /// over when one does: before, every 200 µs for the whole send timeout (60 s and more).
    #[test]
    fn looks_for_completions_back_off_while_none_comes() {
        let pauses: Vec<u128> = (0..8).map(|q| poll_pause(q).as_micros()).collect();
        assert_eq!(pauses, [200, 200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(poll_pause(u32::MAX), POLL_MAX);
        // A minute of silence: about 30 000 looks, not 300 000.
        let (mut quiet, mut slept) = (0, Duration::ZERO);
        while slept < Duration::from_secs(60) {
            quiet += 1;
            slept += poll_pause(quiet);
        }
        assert!(quiet <= 30_010, "{quiet} looks");
        // A node that stalls 15 ms, then reads: the next look comes within 2 ms of it.
        // Before (at most 20 ms apart), 10.4 ms later: the wire sat idle that long.
        let stall = Duration::from_millis(15);
        let (mut quiet, mut at) = (0, Duration::ZERO);
        while at < stall {
            quiet += 1;
            at += poll_pause(quiet);
        }
        let idle = at - stall;
        assert!(idle <= Duration::from_millis(2), "{idle:?} idle");
    }

    #[test]
    fn binding_a_missing_interface_names_it() {
        let e = TxPath::bind("nosuch0", 1 << 20, 2).unwrap_err();
        assert!(e.to_string().contains("no interface named nosuch0"), "{e}");
        // lo exists; this machine has no udmabuf or no netmem TX driver: either is named.
        let e = TxPath::bind("lo", 1 << 20, 2).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("/dev/udmabuf") || s.contains("EOPNOTSUPP"),
            "{s}"
        );
    }
}
