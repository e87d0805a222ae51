//! One thread per data connection: sends queued shard payloads back to back, in announcement
//! order: from files with `sendfile` (page cache -> socket, no copy through user space) or
//! with devmem TX from a dma-buf ([`crate::devmem_tx`]); bytes read from object storage and
//! not cached are written from memory.

use std::fs::File;
use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Where a payload's bytes are.
pub(crate) enum Body {
    /// `len` bytes of `file` from `offset`: a local dataset's file or a cache entry.
    File {
        /// The file.
        file: Arc<File>,
        /// Where the payload starts.
        offset: u64,
    },
    /// Verified bytes read from object storage, in order.
    Memory(Vec<bytes::Bytes>),
}

/// One payload to send.
pub(crate) struct Job {
    pub body: Body,
    pub len: u64,
    /// Fault injection: flip a byte of this payload.
    pub corrupt: bool,
    /// Its bytes in its session's read budget (object storage), given back once sent.
    pub held: Held,
}

/// Bytes of a session's read budget that a payload holds until it is sent (or dropped, when
/// the session ends): a node that reads its data connections slowly cannot make the source
/// hold more than the budget in memory for it, whatever it has queued.
#[derive(Debug, Default)]
pub(crate) struct Held(Option<(Vec<Arc<AtomicU64>>, u64)>);

impl Held {
    /// `n` bytes counted in each of `budgets` (already added there).
    pub fn new(budgets: &[&Arc<AtomicU64>], n: u64) -> Self {
        Self((n > 0).then(|| (budgets.iter().map(|b| Arc::clone(b)).collect(), n)))
    }

    /// Gives the bytes back now (once).
    pub fn release(&mut self) {
        if let Some((budgets, n)) = self.0.take() {
            for b in budgets {
                b.fetch_sub(n, Ordering::AcqRel);
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release();
    }
}

/// What a sender thread has left to do, shared with the control task, which hands it a new
/// payload only when fewer than [`DEPTH`] are queued (so FETCHes not yet handed out can still
/// be cancelled).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// Bytes queued and not yet sent.
    pub bytes: AtomicU64,
    /// Payloads queued or being sent.
    pub jobs: AtomicU64,
    /// Notified each time a payload has been sent (one per session, shared by its senders).
    pub done: Arc<Notify>,
}

impl Progress {
    /// An empty queue whose completions notify `done`.
    pub fn with_notify(done: Arc<Notify>) -> Self {
        Self {
            done,
            ..Self::default()
        }
    }

    /// A payload of `len` bytes has been sent.
    pub fn sent(&self, len: u64) {
        self.bytes.fetch_sub(len, Ordering::Relaxed);
        self.jobs.fetch_sub(1, Ordering::Release);
        self.done.notify_one();
    }
}

/// How a session hears that one of its data connections failed: woken, and told which
/// connection and why (the first failure is kept, and the node is told it).
#[derive(Debug, Default)]
pub(crate) struct ConnFailed {
    /// Notified once a connection has failed ([`ConnFailed::fail`]).
    notify: Notify,
    /// The first failure: the connection and what went wrong.
    first: Mutex<Option<(u16, String)>>,
}

impl ConnFailed {
    /// Data connection `conn` failed with `why`: kept if it is the first, and the session is
    /// woken.
    pub fn fail(&self, conn: u16, why: String) {
        self.lock().get_or_insert((conn, why));
        self.notify.notify_one();
    }

    /// The first failure, if a connection failed.
    pub fn first(&self) -> Option<(u16, String)> {
        self.lock().clone()
    }

    /// Waits for a connection to fail; returns the first failure. Cancel-safe: nothing is
    /// awaited between taking the wake-up and reading the failure.
    pub async fn wait(&self) -> (u16, String) {
        loop {
            self.notify.notified().await;
            if let Some(f) = self.first() {
                return f;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(u16, String)>> {
        self.first.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Payloads a data connection holds at most (one being sent, one waiting behind it, so the
/// connection never idles between payloads).
pub(crate) const DEPTH: u64 = 2;

/// The control task's handle on a sender thread.
pub(crate) struct Sender {
    tx: mpsc::Sender<Job>,
    /// The connection, to end it when the session ends ([`Drop`]).
    conn: Option<TcpStream>,
    /// Its queue, shared with the thread.
    pub progress: Arc<Progress>,
    /// Next announcement sequence number on this connection.
    pub seq: u64,
    /// Held while `conn` is open (dropped after it, [`Drop`] closing `conn` first): see
    /// `TxSlot::tie`.
    _open: Arc<dyn Send + Sync>,
}

impl Sender {
    /// Starts the thread for data connection `conn`. `failed` is told if it dies. With
    /// `devmem` it sends from a slot of that NIC's TX buffer (devmem TX); without a free slot
    /// it says so and uses `sendfile`. Fails when no thread can be started (a process or pid
    /// limit): the session ends, the source goes on.
    pub fn spawn(
        stream: TcpStream,
        conn: u16,
        rate: u64,
        failed: Arc<ConnFailed>,
        devmem: Option<&crate::devmem_tx::TxPath>,
        progress: Arc<Progress>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let q = Arc::clone(&progress);
        let conn_end = stream.try_clone().ok();
        let ifname: Arc<str> = devmem.map_or("".into(), |p| p.ifname.as_str().into());
        // Held wherever a descriptor of the socket is open (this thread's, the session's):
        // a devmem TX slot dropped with sends not completed is reused only once both are
        // closed, since an open socket still sends its queued bytes from the slot's pages.
        let alive: Arc<dyn Send + Sync> = Arc::new(());
        let open_here = Arc::clone(&alive);
        let slot = devmem.and_then(|p| {
            let mut s = p.buffer.slot();
            match &mut s {
                Some(s) => s.tie(Arc::downgrade(&alive)),
                None => tracing::warn!(
                    conn,
                    "every devmem TX slot is in use: this data connection sends with sendfile"
                ),
            }
            s
        });
        std::thread::Builder::new()
            .name(format!("sw-send-{conn}"))
            .spawn(move || {
                let _told = TellOnPanic(Arc::clone(&failed), conn);
                let path = match slot {
                    Some(slot) => crate::devmem_tx::DevmemSend::new(
                        &stream,
                        slot,
                        ifname,
                        send_timeout(&stream),
                    )
                    .map(|d| SendPath::DevmemTx(Box::new(d))),
                    None => Ok(SendPath::Sendfile(&stream)),
                };
                let sent = path.and_then(|p| send_loop(p, &stream, &rx, &q, rate, MIN_SEND_RATE));
                if let Err(e) = sent {
                    let why = failure_text(&e);
                    tracing::warn!(conn, "data connection failed: {why}");
                    // Closed with a reset: the kernel drops what is still queued instead of
                    // sending it (from a devmem TX slot that is free again) to a peer that
                    // may read it later.
                    let _ = rustix::net::sockopt::set_socket_linger(&stream, Some(Duration::ZERO));
                    failed.fail(conn, why);
                }
                let _ = stream.shutdown(std::net::Shutdown::Both);
                drop(stream);
                drop(open_here);
            })?;
        Ok(Self {
            tx,
            conn: conn_end,
            progress,
            seq: 0,
            _open: alive,
        })
    }

    /// Whether the connection can take another payload now.
    pub fn has_room(&self) -> bool {
        self.progress.jobs.load(Ordering::Acquire) < DEPTH
    }

    /// Queues a payload; false if the thread is gone.
    pub fn push(&self, job: Job) -> bool {
        self.progress.bytes.fetch_add(job.len, Ordering::Relaxed);
        self.progress.jobs.fetch_add(1, Ordering::Release);
        self.tx.send(job).is_ok()
    }
}

/// What a session and its node are told of a data connection's failure `e`: a send timeout
/// says that the node read nothing for the idle timeout.
fn failure_text(e: &std::io::Error) -> String {
    if is_send_timeout(e) {
        format!(
            "the node read nothing of the payload for the idle timeout (idle_timeout_secs): {e}"
        )
    } else {
        e.to_string()
    }
}

/// Tells the session that its data connection failed if the sender thread ends in a panic:
/// otherwise the session learnt of it only at its next payload for the connection (never,
/// when none came), and the lane stalled.
struct TellOnPanic(Arc<ConnFailed>, u16);

impl Drop for TellOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(conn = self.1, "a sender thread panicked: its session ends");
            let why = "its sender thread panicked (a bug: see the source's log)".to_string();
            self.0.fail(self.1, why);
        }
    }
}

impl Drop for Sender {
    /// The session ended: its queued payloads are not sent, and one being sent stops (with a
    /// reset, so nothing queued in the kernel goes either). Otherwise a node that closed its
    /// control connection and reads its data connections slowly would hold this thread, the
    /// socket and the payload past the session (and its `max_connections` slot).
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            let _ = rustix::net::sockopt::set_socket_linger(&c, Some(Duration::ZERO));
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Writes `parts` in order in pieces of at most `piece` bytes (flipping the byte at offset
/// `flip` of the payload: fault injection), calling `paced` after each piece.
fn send_memory(
    stream: &TcpStream,
    parts: &[bytes::Bytes],
    mut flip: Option<u64>,
    piece: usize,
    paced: &mut impl FnMut(usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut at = 0u64;
    for part in parts {
        for chunk in part.chunks(piece.max(1)) {
            let end = at + chunk.len() as u64;
            match flip.filter(|f| (at..end).contains(f)) {
                Some(f) => {
                    let mut copy = chunk.to_vec();
                    copy[(f - at) as usize] ^= 0x5a;
                    flip = None;
                    write_paced(stream, &copy, paced)?;
                }
                None => write_paced(stream, chunk, paced)?,
            }
            at = end;
        }
    }
    Ok(())
}

/// Writes all of `bytes`, calling `paced` after each write (which may end the send).
fn write_paced(
    mut stream: &TcpStream,
    mut bytes: &[u8],
    paced: &mut impl FnMut(usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let n = match stream.write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        bytes = &bytes[n..];
        paced(n)?;
    }
    Ok(())
}

/// The slowest a payload may go out on average, after the idle timeout's grace (or half the
/// session's rate limit, when that is lower): a node that reads a few bytes every few seconds
/// kept each send within `SO_SNDTIMEO` and held the sender thread, its file or its memory, and
/// its session's slot for days.
pub(crate) const MIN_SEND_RATE: u64 = 1 << 20;

/// How long a payload of `len` bytes may take: `idle`, plus `len` at the lower of `min_rate`
/// and half of `rate` (0: unlimited).
fn payload_limit(len: u64, idle: Duration, rate: u64, min_rate: u64) -> Duration {
    let floor = match rate {
        0 => min_rate,
        r => min_rate.min(r / 2),
    }
    .max(1);
    idle + Duration::from_secs_f64(len as f64 / floor as f64)
}

/// The largest piece a data connection sends at once without a rate limit: the payload's time
/// limit ([`payload_limit`]) is checked between pieces. `sendfile` applies `SO_SNDTIMEO` to
/// each ~64 KiB it moves, not to the call, so one call for a whole payload (up to 1 GiB) let a
/// node that read a trickle, each 64 KiB within the idle timeout, hold the sender thread, the
/// file and its session's slot for hours; now the limit is overrun by one piece's time at
/// most (its 16 chunks of 64 KiB, each within the send timeout).
const UNPACED_PIECE: u64 = 1 << 20;

/// The error of a payload that went out slower than its limit.
fn too_slow(len: u64, limit: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the node took more than {limit:?} to read a payload of {len} bytes (it reads at a \
             trickle, or not at all): the connection is given up"
        ),
    )
}

/// How far ahead of its line a paced sender may get after waiting for work: a connection idle
/// for a while resumes at its rate, not with a burst of everything its idle time would allow.
const BURST: Duration = Duration::from_millis(50);

/// Paces a sender to `rate` bytes/s (0: unlimited): the bytes sent since the line's start stay
/// within `rate`, and idle time banks at most [`BURST`] of credit.
pub(crate) struct Pacer {
    rate: u64,
    start: Instant,
    sent: u64,
}

impl Pacer {
    /// A line starting now.
    pub(crate) fn new(rate: u64) -> Self {
        Self {
            rate,
            start: Instant::now(),
            sent: 0,
        }
    }

    /// Counts `n` bytes just sent, sleeping as long as they put the sender ahead of its line.
    pub(crate) fn sent(&mut self, n: usize) {
        if self.rate == 0 {
            return;
        }
        let now = Instant::now();
        let due = self.due(self.sent);
        if now.duration_since(self.start) > due + BURST {
            // Idle: restart the line so that at most BURST of credit is left.
            self.start = now.checked_sub(BURST).unwrap_or(now);
            self.sent = 0;
        }
        self.sent += n as u64;
        if let Some(wait) = self
            .due(self.sent)
            .checked_sub(now.duration_since(self.start))
        {
            std::thread::sleep(wait);
        }
    }

    /// When `bytes` are due on the line, from its start.
    fn due(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.rate as f64)
    }
}

/// How a data connection's payloads go out.
enum SendPath<'a> {
    /// `sendfile` from the page cache.
    Sendfile(&'a TcpStream),
    /// devmem TX from a slot of the bound buffer (boxed: it is much larger than a reference).
    DevmemTx(Box<crate::devmem_tx::DevmemSend<'a>>),
}

impl SendPath<'_> {
    /// The largest piece to send at once: without a rate limit, [`UNPACED_PIECE`] (the time
    /// limit is checked between pieces); with one, pieces small enough to pace.
    fn piece(&self, rate: u64) -> u64 {
        let limit = match self {
            Self::Sendfile(_) => UNPACED_PIECE,
            Self::DevmemTx(_) => UNPACED_PIECE.min(crate::devmem_tx::PIECE as u64),
        };
        if rate == 0 {
            limit
        } else {
            (rate / 20).clamp(4096, 1 << 20).min(limit)
        }
    }

    /// Sends up to `want` bytes of `file` at `off` (flipping the byte at `flip` if it falls
    /// inside: fault injection); returns the bytes sent, 0 if the file ended.
    fn send(
        &mut self,
        file: &File,
        off: u64,
        want: u64,
        flip: &mut Option<u64>,
    ) -> std::io::Result<usize> {
        match self {
            Self::DevmemTx(d) => d.send_piece(file, off, want as usize, flip),
            Self::Sendfile(stream) => match flip.filter(|at| (off..off + want).contains(at)) {
                Some(at) => {
                    let mut buf = vec![0u8; want as usize];
                    let n = rustix::io::pread(file, &mut buf, off)?;
                    if at < off + n as u64 {
                        buf[(at - off) as usize] ^= 0x5a;
                        *flip = None;
                    }
                    (&**stream).write_all(&buf[..n])?;
                    Ok(n)
                }
                None => {
                    let mut o = off;
                    Ok(rustix::fs::sendfile(
                        *stream,
                        file,
                        Some(&mut o),
                        want as usize,
                    )?)
                }
            },
        }
    }

    /// The connection is done.
    fn finish(&mut self) -> std::io::Result<()> {
        match self {
            Self::DevmemTx(d) => d.finish(),
            Self::Sendfile(_) => Ok(()),
        }
    }
}

/// Whether a send failed because its socket's send timeout ran out (`SO_SNDTIMEO`: EAGAIN
/// on a blocking socket), on the `sendfile` path or inside a devmem TX error, or because no
/// zerocopy completion came for as long ([`crate::devmem_tx::NoCompletion`]): the node read
/// nothing for the idle timeout.
pub(crate) fn is_send_timeout(e: &std::io::Error) -> bool {
    if e.kind() == std::io::ErrorKind::WouldBlock {
        return true;
    }
    let inner = e.get_ref();
    if inner.is_some_and(|i| i.is::<crate::devmem_tx::NoCompletion>()) {
        return true;
    }
    matches!(
        inner.and_then(|inner| inner.downcast_ref::<shardwire_devmem::tx::TxError>()),
        Some(shardwire_devmem::tx::TxError::Syscall { source, .. })
            if source.kind() == std::io::ErrorKind::WouldBlock
    )
}

/// Sends bytes `range` of `file` in pieces of at most `piece` bytes (flipping the byte at
/// `flip`: fault injection), calling `paced` after each. Never past `range.end`, so a file
/// that grew sends what was announced.
///
/// A file that ends before `range.end` (cut short after its FETCH was last checked, while the
/// payload waited in this queue) is warned of and the rest sent as zeros: the connection keeps
/// its framing, the node's CRC check fails and it fetches the shard again, and the source
/// refuses that FETCH as `DatasetChanged`. Failing the send instead ended the node's whole
/// session, every lane and stream of it, over one file.
fn send_file(
    path: &mut SendPath<'_>,
    stream: &TcpStream,
    file: &File,
    range: std::ops::Range<u64>,
    mut flip: Option<u64>,
    piece: u64,
    paced: &mut impl FnMut(usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let (mut off, end) = (range.start, range.end);
    while off < end {
        let n = match path.send(file, off, (end - off).min(piece), &mut flip) {
            Ok(n) => n,
            // A send on a socket with a send timeout is not restarted after a signal
            // (SIGSTOP/SIGCONT of the process, signal(7)): send again.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            tracing::warn!(
                file = %file_name(file),
                offset = off,
                announced_end = end,
                "a shard file (or cache entry) ended before its announced length: the rest is \
                 sent as zeros, so the node's CRC check fails and it fetches the shard again \
                 (a local dataset's file changed since the source opened it: re-run \
                 `shardwire index` and restart the source)"
            );
            return send_zeros(stream, end - off, paced);
        }
        off += n as u64;
        paced(n)?;
    }
    Ok(())
}

/// The path of an open file, for a log line (the fd's number if `/proc` cannot tell).
fn file_name(file: &File) -> String {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_or_else(|_| format!("fd {fd}"), |p| p.display().to_string())
}

/// Zeros sent in place of a file's missing tail ([`send_zeros`]): one fixed buffer, however
/// long the tail.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// Writes `len` zero bytes, calling `paced` after each write.
fn send_zeros(
    stream: &TcpStream,
    mut len: u64,
    paced: &mut impl FnMut(usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    while len > 0 {
        let n = len.min(ZEROS.len() as u64) as usize;
        write_paced(stream, &ZEROS[..n], paced)?;
        len -= n as u64;
    }
    Ok(())
}

/// The send (idle) timeout of a data connection: its `SO_SNDTIMEO`, set to the session's idle
/// timeout when it was dialled (60 s if it has none).
pub(crate) fn send_timeout(stream: &TcpStream) -> Duration {
    stream
        .write_timeout()
        .ok()
        .flatten()
        .unwrap_or(Duration::from_secs(60))
}

/// Sends queued payloads back to back, paced to `rate` bytes/s (0: unlimited).
fn send_loop(
    mut path: SendPath<'_>,
    stream: &TcpStream,
    rx: &mpsc::Receiver<Job>,
    progress: &Progress,
    rate: u64,
    min_rate: u64,
) -> std::io::Result<()> {
    let mut pacer = Pacer::new(rate);
    let piece = path.piece(rate);
    let idle = send_timeout(stream);
    while let Ok(mut job) = rx.recv() {
        let limit = payload_limit(job.len, idle, rate, min_rate);
        let started = Instant::now();
        let mut paced = |n: usize| {
            pacer.sent(n);
            match started.elapsed() > limit {
                true => Err(too_slow(job.len, limit)),
                false => Ok(()),
            }
        };
        match &job.body {
            Body::File { file, offset } => {
                let flip = job.corrupt.then_some(offset + job.len / 2);
                let range = *offset..offset + job.len;
                send_file(&mut path, stream, file, range, flip, piece, &mut paced)?;
            }
            Body::Memory(parts) => {
                let flip = job.corrupt.then_some(job.len / 2);
                send_memory(stream, parts, flip, piece as usize, &mut paced)?;
            }
        }
        if job.corrupt {
            tracing::warn!(
                bytes = job.len,
                "fault injection: sent a payload with one byte flipped"
            );
        }
        metrics::counter!("shardwire_source_bytes_sent_total").increment(job.len);
        metrics::counter!("shardwire_source_shards_sent_total").increment(1);
        if let SendPath::DevmemTx(d) = &path {
            let interface = d.ifname.to_string();
            metrics::counter!("shardwire_source_devmem_tx_bytes_total", "interface" => interface)
                .increment(job.len);
        }
        // Before the session hears of it: it may start a read with these bytes.
        job.held.release();
        progress.sent(job.len);
    }
    path.finish()
}

#[cfg(test)]
mod tests {
    use std::io;

    use shardwire_devmem::tx::TxError;

    use std::time::{Duration, Instant};

    use super::{Arc, AtomicU64, Body, Held, Job, Notify, Ordering, Progress, Sender, TcpStream};
    use super::{BURST, ConnFailed, Pacer, TellOnPanic, is_send_timeout};

    #[test]
    fn a_payloads_bytes_stay_in_the_budget_until_it_is_sent_or_dropped() {
        let budget = Arc::new(AtomicU64::new(300));
        let mut sent = Held::new(&[&budget], 100);
        let dropped = Held::new(&[&budget], 200);
        assert_eq!(
            budget.load(Ordering::Acquire),
            300,
            "handed over: still held"
        );
        sent.release();
        sent.release(); // once
        assert_eq!(budget.load(Ordering::Acquire), 200);
        drop(sent);
        assert_eq!(budget.load(Ordering::Acquire), 200);
        drop(dropped); // a queued payload of a session that ended
        assert_eq!(budget.load(Ordering::Acquire), 0);
        drop(Held::new(&[&budget], 0));
        assert_eq!(budget.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_sender_gives_its_payloads_bytes_back_once_it_has_sent_them() {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        let done = Arc::new(Notify::new());
        let progress = Arc::new(Progress::with_notify(Arc::clone(&done)));
        let s = Sender::spawn(out, 0, 0, Arc::default(), None, Arc::clone(&progress)).unwrap();
        let budget = Arc::new(AtomicU64::new(16 << 20));
        let body = Body::Memory(vec![bytes::Bytes::from(vec![7u8; 16 << 20])]);
        let held = Held::new(&[&budget], 16 << 20);
        assert!(s.push(Job {
            body,
            len: 16 << 20,
            corrupt: false,
            held,
        }));
        // Nothing read yet: the payload is queued or partly sent, its bytes still held.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(budget.load(Ordering::Acquire), 16 << 20);
        let mut got = vec![0u8; 16 << 20];
        peer.read_exact(&mut got).unwrap();
        let t = Instant::now();
        while progress.jobs.load(Ordering::Acquire) > 0 {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            budget.load(Ordering::Acquire),
            0,
            "given back before the session hears"
        );
    }

    #[test]
    fn a_file_cut_short_in_the_queue_is_padded_and_the_connection_goes_on() {
        use std::io::Read;

        use rustix::net::sockopt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap(); // a hang fails
        // Small buffers: the first payload holds the sender until the node reads it.
        sockopt::set_socket_send_buffer_size(&out, 64 << 10).unwrap();
        sockopt::set_socket_recv_buffer_size(&peer, 64 << 10).unwrap();
        let failed = Arc::new(ConnFailed::default());
        let progress = Arc::new(Progress::with_notify(Arc::new(Notify::new())));
        let s = Sender::spawn(out, 0, 0, Arc::clone(&failed), None, Arc::clone(&progress)).unwrap();
        let memory = |byte: u8, len: usize| Job {
            body: Body::Memory(vec![bytes::Bytes::from(vec![byte; len])]),
            len: len as u64,
            corrupt: false,
            held: Held::default(),
        };
        let path = std::env::temp_dir().join(format!("sw-sender-short-{}", std::process::id()));
        std::fs::write(&path, vec![0xabu8; 1 << 20]).unwrap();
        let file = Arc::new(std::fs::File::open(&path).unwrap());
        let (offset, len, kept) = (4096u64, 512usize << 10, 100_000usize);
        assert!(s.push(memory(1, 4 << 20)));
        assert!(s.push(Job {
            body: Body::File { file, offset },
            len: len as u64,
            corrupt: false,
            held: Held::default(),
        }));
        // Cut short while its payload waits behind the first.
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        w.set_len(offset + kept as u64).unwrap();
        let mut first = vec![0u8; 4 << 20];
        peer.read_exact(&mut first).unwrap();
        let mut got = vec![0u8; len];
        peer.read_exact(&mut got)
            .expect("the announced length arrives");
        std::fs::remove_file(&path).unwrap();
        assert!(got[..kept].iter().all(|&b| b == 0xab), "the file's bytes");
        assert!(got[kept..].iter().all(|&b| b == 0), "then zeros");
        // The connection (and the session) goes on.
        assert!(s.push(memory(9, 1000)));
        let mut next = vec![0u8; 1000];
        peer.read_exact(&mut next).unwrap();
        assert!(next.iter().all(|&b| b == 9));
        let t = Instant::now();
        while progress.jobs.load(Ordering::Acquire) > 0 {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(5));
        }
        let notified = failed.notify.notified();
        tokio::pin!(notified);
        assert!(
            !notified.as_mut().enable(),
            "the session was not told of a failure"
        );
        assert_eq!(failed.first(), None);
    }

    #[test]
    fn idle_time_banks_at_most_a_burst_of_credit() {
        // 1 MB/s; after 400 ms idle, 200 KB take at least 200 ms less the burst (without the
        // cap the 400 ms idle would have let them all out at once). Only lower bounds: a
        // loaded machine makes sleeps longer, never shorter.
        let mut p = Pacer::new(1_000_000);
        std::thread::sleep(Duration::from_millis(400));
        let t = Instant::now();
        for _ in 0..4 {
            p.sent(50_000);
        }
        let least = Duration::from_millis(200) - BURST;
        assert!(t.elapsed() >= least, "{:?} < {least:?}", t.elapsed());
    }

    #[test]
    fn an_unlimited_pacer_never_sleeps() {
        let mut p = Pacer::new(0);
        let t = Instant::now();
        p.sent(1 << 30);
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_payload_may_take_the_idle_timeout_plus_its_size_at_the_minimum_rate() {
        use super::payload_limit;
        let idle = Duration::from_secs(60);
        assert_eq!(payload_limit(0, idle, 0, 1 << 20), idle);
        assert_eq!(
            payload_limit(8 << 20, idle, 0, 1 << 20),
            idle + Duration::from_secs(8)
        );
        // A session paced below twice the minimum gets half its own rate.
        assert_eq!(
            payload_limit(1 << 20, idle, 1 << 20, 1 << 20),
            idle + Duration::from_secs(2)
        );
    }

    #[test]
    fn a_node_that_reads_a_payload_at_a_trickle_loses_the_connection() {
        use std::io::Read;
        use std::sync::mpsc;

        use super::{SendPath, send_loop};
        use rustix::net::sockopt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        out.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        // Small buffers, so the kernel wakes the sender every few KiB the node reads.
        sockopt::set_socket_send_buffer_size(&out, 64 << 10).unwrap();
        sockopt::set_socket_recv_buffer_size(&peer, 64 << 10).unwrap();
        // The node reads 4 KiB every 50 ms: every send makes progress within the idle
        // timeout, so SO_SNDTIMEO never fires, but 4 MiB would take about a minute.
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = peer.read(&mut buf) {
                if n == 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (tx, rx) = mpsc::channel();
        let budget = Arc::new(AtomicU64::new(4 << 20));
        tx.send(Job {
            body: Body::Memory(vec![bytes::Bytes::from(vec![1u8; 4 << 20])]),
            len: 4 << 20,
            corrupt: false,
            held: Held::new(&[&budget], 4 << 20),
        })
        .unwrap();
        drop(tx);
        let progress = Progress::with_notify(Arc::new(Notify::new()));
        let t0 = Instant::now();
        // A minimum of 2 MiB/s: 2 s + 2 s for the 4 MiB.
        let e = send_loop(SendPath::Sendfile(&out), &out, &rx, &progress, 0, 2 << 20)
            .expect_err("given up");
        let took = t0.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("reads at a trickle"), "{e}");
        assert!(
            took >= Duration::from_secs(4) && took < Duration::from_secs(15),
            "{took:?}"
        );
        drop(out);
        reader.join().unwrap();
    }

    #[test]
    fn send_timeouts_are_told_apart_from_other_failures() {
        assert!(is_send_timeout(&io::ErrorKind::WouldBlock.into()));
        let devmem = TxError::Syscall {
            call: "sendmsg",
            source: io::ErrorKind::WouldBlock.into(),
            hint: "",
        };
        assert!(is_send_timeout(&io::Error::other(devmem)));
        // No zerocopy completion for the idle timeout: the node read nothing either (before,
        // it was told apart, and logged as some other failure).
        let silent = crate::devmem_tx::NoCompletion {
            waited: Duration::from_secs(60),
            in_flight: 1 << 20,
        };
        assert!(is_send_timeout(&io::Error::new(
            io::ErrorKind::TimedOut,
            silent
        )));
        assert!(!is_send_timeout(&io::Error::new(
            io::ErrorKind::TimedOut,
            "something else timed out"
        )));
        assert!(!is_send_timeout(&io::ErrorKind::BrokenPipe.into()));
    }

    #[test]
    fn a_sender_thread_that_panics_tells_its_session() {
        let failed = Arc::new(ConnFailed::default());
        let told = TellOnPanic(Arc::clone(&failed), 3);
        let t = std::thread::spawn(move || {
            let _told = told;
            panic!("a bug in the sender");
        });
        assert!(t.join().is_err());
        let notified = failed.notify.notified();
        tokio::pin!(notified);
        assert!(
            notified.as_mut().enable(),
            "the session is told (a permit is stored for it)"
        );
        let (conn, why) = failed.first().expect("and why");
        assert_eq!(conn, 3);
        assert!(why.contains("panicked"), "{why}");
        // A thread that ends without a panic says nothing.
        let quiet = Arc::new(ConnFailed::default());
        drop(TellOnPanic(Arc::clone(&quiet), 4));
        let notified = quiet.notify.notified();
        tokio::pin!(notified);
        assert!(!notified.as_mut().enable());
        assert_eq!(quiet.first(), None);
    }

    #[test]
    fn a_failed_connection_tells_its_session_which_and_why_and_the_first_failure_is_kept() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        // The node goes away: the sender's writes fail (a reset, then a broken pipe).
        rustix::net::sockopt::set_socket_linger(&peer, Some(Duration::ZERO)).unwrap();
        drop(peer);
        let failed = Arc::new(ConnFailed::default());
        let progress = Arc::new(Progress::default());
        let s = Sender::spawn(out, 5, 0, Arc::clone(&failed), None, progress).unwrap();
        assert!(s.push(Job {
            body: Body::Memory(vec![bytes::Bytes::from(vec![1u8; 8 << 20])]),
            len: 8 << 20,
            corrupt: false,
            held: Held::default(),
        }));
        let t = Instant::now();
        while failed.first().is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "not told in 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Before, the session (and its node) heard only that some connection failed.
        let (conn, why) = failed.first().unwrap();
        assert_eq!(conn, 5);
        assert!(
            why.contains("reset") || why.contains("pipe"),
            "the socket's error: {why}"
        );
        failed.fail(6, "a later failure".into());
        assert_eq!(failed.first().map(|(c, _)| c), Some(5), "the first is kept");
    }

    #[test]
    fn a_node_that_reads_a_file_payload_at_a_trickle_loses_the_connection() {
        use std::io::Read;
        use std::sync::mpsc;

        use super::{SendPath, send_loop};
        use rustix::net::sockopt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        out.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        sockopt::set_socket_send_buffer_size(&out, 64 << 10).unwrap();
        sockopt::set_socket_recv_buffer_size(&peer, 64 << 10).unwrap();
        // The node reads 4 KiB every 10 ms (about 400 KB/s): each 64 KiB that `sendfile`
        // moves gets through well within the idle timeout, but 32 MiB take over a minute.
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = peer.read(&mut buf) {
                if n == 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let path = std::env::temp_dir().join(format!("sw-sender-trickle-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(32 << 20).unwrap(); // sparse: reads as zeros
        drop(f);
        let file = Arc::new(std::fs::File::open(&path).unwrap());
        std::fs::remove_file(&path).unwrap(); // the open file stays readable
        let (tx, rx) = mpsc::channel();
        tx.send(Job {
            body: Body::File { file, offset: 0 },
            len: 32 << 20,
            corrupt: false,
            held: Held::default(),
        })
        .unwrap();
        drop(tx);
        let progress = Progress::with_notify(Arc::new(Notify::new()));
        let t0 = Instant::now();
        // A minimum of 16 MiB/s: 2 s + 2 s for the 32 MiB, checked after each 1 MiB piece
        // (about 2.6 s each at this pace).
        let e = send_loop(SendPath::Sendfile(&out), &out, &rx, &progress, 0, 16 << 20)
            .expect_err("given up");
        let took = t0.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("reads at a trickle"), "{e}");
        // Before, the whole payload went in one `sendfile` call, and the limit was looked at
        // only once it returned, over a minute later.
        assert!(
            took >= Duration::from_secs(4) && took < Duration::from_secs(25),
            "{took:?}"
        );
        drop(out);
        reader.join().unwrap();
    }
}
