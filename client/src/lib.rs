//! Rust trainer SDK: open a stream on the node service's Unix socket and iterate batches of
//! named tensors that are zero-copy views into the stream's region (mapped read-only).
//!
//! The training loop gives each batch back on the request for the next ones
//! ([`Stream::next_after`]), which the stream sends ahead of time, while the batch in hand is
//! used:
//!
//! ```no_run
//! let mut s = shardwire_client::Stream::open("/run/shardwire/trainer.sock",
//!     shardwire_client::StreamOptions::new("imagenet"))?;
//! let mut next = s.next()?;
//! while let Some(batch) = next {
//!     for t in batch.tensors() {
//!         let bytes: &[u8] = batch.bytes(t);
//!         println!("{} {} {:?} {}", t.name, t.dtype, t.shape, bytes.len());
//!     }
//!     next = s.next_after(batch)?;
//! }
//! let resume_at = s.resume_state()?; // after the last batch handed out
//! # Ok::<(), shardwire_client::ClientError>(())
//! ```
//!
//! A trainer saves that [`ResumeState`] in its checkpoint (it serialises to the JSON object
//! the node wrote, and only to JSON: [`ResumeState::to_json`]) and resumes with
//! [`Stream::open_from`]. Fields of the state this client does not know (a newer node's or
//! SDK's, at its top level or inside its `mix`) are kept and sent back byte for byte, as the
//! Python SDK does: the node judges them (see [`ResumeState`]). [`Stream::state`] gives the
//! [`StreamState`] instead, and refuses a state with such fields
//! ([`ClientError::StateFieldsUnknown`]) rather than drop them.
//!
//! [`Stream::next`] + [`Stream::release`] take one batch per request and ask for nothing
//! ahead (a caller that keeps batches leases no more than it takes). A batch dropped without
//! being given back is given back with the stream's next request.
//!
//! Every answer is checked as it arrives: a tensor whose bytes lie outside the region, or
//! whose shape and dtype do not take its length, is an error, not a batch; after an answer
//! that cannot be read the connection is closed and every later call says why
//! ([`ClientError::Broken`]): open the stream again from its [`Stream::state`].

pub use shardwire_protocol::fdpass;
pub mod http;
mod resume;
mod stream;

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

pub use http::{HttpBatch, HttpStream};
pub use resume::ResumeState;
use rustix::mm::{MapFlags, ProtFlags};
use shardwire_protocol::manifest::DType;
use shardwire_protocol::trainer::{ErrorCode, StreamRequest};
pub use shardwire_protocol::trainer::{StreamState, TensorView};
pub use stream::{NEXT_COUNT, Stream};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Could not reach the socket (for [`Stream`], also when the node took no connection
    /// within 10 s: its listen backlog full, the error's kind `TimedOut`).
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Frame I/O on the trainer socket (HTTP requests fail with [`ClientError::Http`]).
    #[error(transparent)]
    Frame(#[from] fdpass::FrameIoError),
    /// A batch given back to a stream that did not hand it out (its own stream gives it back
    /// when it is dropped).
    #[error(
        "batch of lease {lease} was handed out by another stream, not stream {stream}: give it back to its own"
    )]
    NotThisStream {
        /// The batch's lease.
        lease: u64,
        /// The stream it was given to.
        stream: u64,
    },
    /// A stream used in a process forked after it was opened: the child shares its
    /// connection, so it would take answers meant for the parent (and a close would end
    /// the parent's stream). Open a stream in the child instead.
    #[error(
        "this stream was opened in process {opened} and is used in process {now}, forked from it: open a stream in the child instead"
    )]
    Forked {
        /// The process that opened it.
        opened: u32,
        /// The process using it.
        now: u32,
    },
    /// The service answered with an error.
    #[error("service error {code}: {message}")]
    Service {
        /// Stable code.
        code: ErrorCode,
        /// Detail.
        message: String,
    },
    /// The service answered something unexpected.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Mapping the region failed.
    #[error("cannot map the stream region ({len} bytes): {source}")]
    Map {
        /// Region size.
        len: u64,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The stream's region is in memory this client cannot map.
    #[error(
        "the stream's region is {memory} memory{device}; this client maps host regions only \
         (use the Python SDK for CUDA regions, or run the node with memory = \"host\")"
    )]
    UnsupportedMemory {
        /// The memory kind the service announced.
        memory: String,
        /// Where it lies, e.g. " on GPU 0000:19:00.0".
        device: String,
    },
    /// `next` with a timeout got nothing.
    #[error("no batch within {0:?}")]
    Timeout(Duration),
    /// A batch names a tensor whose bytes lie outside the stream's region. The connection
    /// is closed (the node then closes the stream).
    #[error(
        "tensor {name:?} of a batch lies outside the stream's region: bytes {offset}..+{length} of {region}; the connection is closed"
    )]
    TensorOutsideRegion {
        /// The tensor.
        name: String,
        /// Its offset in the region.
        offset: u64,
        /// Its length.
        length: u64,
        /// The region's size.
        region: u64,
    },
    /// A batch names a tensor whose shape and dtype do not take its length. The connection
    /// is closed.
    #[error(
        "tensor {name:?} of a batch: shape {shape:?} of {dtype} does not take the {length} bytes the node says; the connection is closed"
    )]
    TensorLength {
        /// The tensor.
        name: String,
        /// Its element type.
        dtype: String,
        /// Its shape.
        shape: Vec<u64>,
        /// The length the node gave it.
        length: u64,
    },
    /// An earlier answer from the node could not be read (malformed, or cut off), so the
    /// connection was closed: nothing after it could be matched to its request. Open the
    /// stream again from its [`Stream::state`].
    #[error(
        "the stream's connection was closed after an answer it could not read ({cause}); open the stream again from its state"
    )]
    Broken {
        /// What was wrong with that answer.
        cause: String,
    },
    /// The node service did not answer a request it answers at once (or `attach`, within
    /// its generous limit); the stream's connection is closed, since a late answer would be
    /// read as the answer to the next request.
    #[error(
        "the node service did not answer {request} within {after:?} (is it stopped or \
         overloaded? see its log and its admin /v1/status); the connection is closed"
    )]
    NoAnswer {
        /// The request: `attach` or `release`, or an HTTP route such as
        /// `GET /v1/leases/{lease}/tensors/{name}`.
        request: &'static str,
        /// The limit it waited.
        after: Duration,
    },
    /// An HTTP answer began but then brought fewer than `floor` bytes in a `window` (a
    /// reply trickled in, a link too slow to be of use); the connection is closed.
    #[error(
        "the node service's answer to {request} stalled: fewer than {floor} bytes in {window:?} \
         (an overloaded node, or a link too slow for it); the connection is closed"
    )]
    Stalled {
        /// The HTTP route, such as `GET /v1/leases/{lease}/tensors/{name}`.
        request: &'static str,
        /// The least bytes each window had to bring.
        floor: u64,
        /// The window (the request's read timeout).
        window: Duration,
    },
    /// An answer from the node on the trainer socket began, and its rest did not come within
    /// `after` (a node stopped or stuck halfway through writing it, or trickling it); the
    /// connection is closed.
    #[error(
        "the node service's answer stopped after its first bytes: the rest did not come within \
         {after:?} (is it stopped or overloaded? see its log and its admin /v1/status); the \
         connection is closed"
    )]
    AnswerStalled {
        /// The longest time from an answer's first byte to its last.
        after: Duration,
    },
    /// An HTTP request to the node service failed on its connection (reset, or the answer
    /// cut off); the connection is closed.
    #[error(
        "HTTP request {request} to the node service failed: {source}; the connection is closed"
    )]
    Http {
        /// The HTTP route, such as `POST /v1/streams/{id}/next`.
        request: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// [`http::HttpStream::tensor_bytes`] named a tensor the batch does not have (nothing was
    /// asked of the node).
    #[error(
        "the batch of lease {lease} has no tensor `{name}`; its tensors are {tensors:?} \
         (HttpBatch::tensors)"
    )]
    NoSuchTensor {
        /// The batch's lease.
        lease: u64,
        /// The name asked for.
        name: String,
        /// The batch's tensors.
        tensors: Vec<String>,
    },
    /// A resume state with fields this client does not know (written by a newer node or
    /// SDK), asked for as a [`StreamState`], which has no room for them: dropped, the stream
    /// could resume somewhere else. Take it as a [`ResumeState`] instead, which keeps them.
    #[error(
        "the stream's resume state has fields this client does not know ({fields:?}), written by \
         a newer node or SDK: a StreamState would drop them and the stream could resume \
         elsewhere; take it with `resume_state()` (a ResumeState, which keeps them) and resume \
         with `open_from`"
    )]
    StateFieldsUnknown {
        /// The fields.
        fields: Vec<String>,
    },
    /// The node's HTTP address is not `HOST:PORT` or `http://HOST:PORT`.
    #[error(
        "the node's HTTP address must be HOST:PORT or http://HOST:PORT (its admin address), not `{0}`"
    )]
    Address(String),
    /// An HTTP stream's idle timeout of zero or above a day, refused before anything is sent
    /// (as the Python SDK refuses them; the service refuses both).
    #[error(
        "idle_timeout must be above 0 and at most 86400 s, not {0:?}: pass None for the \
         service's default (300 s), or the time without requests after which it may close the \
         stream (1 s to 86400 s)"
    )]
    IdleTimeout(Duration),
}

/// What to open: the attach fields, defined once in the protocol crate
/// ([`StreamRequest::new`] gives the defaults: seed 0, rank 0 of 1, one epoch, pad).
pub type StreamOptions = StreamRequest;

/// The stream region, mapped read-only.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a read-only shared mapping owned by this value; reading it from any thread is fine.
unsafe impl Send for Mapping {}
// SAFETY: as above; only shared reads are ever made.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn new(fd: &OwnedFd, len: u64) -> Result<Self, ClientError> {
        let err = |source: std::io::Error| ClientError::Map { len, source };
        // A region that could shrink later would fault (SIGBUS) at a read past its new end:
        // the node's regions are memfds sealed against it (F_SEAL_SHRINK). Checked first: a
        // seal is never taken off, so the size read next stays true.
        let sealed = rustix::fs::fcntl_get_seals(fd)
            .is_ok_and(|s| s.contains(rustix::fs::SealFlags::SHRINK));
        if !sealed {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the region the node sent is not sealed against shrinking (F_SEAL_SHRINK): a read after it shrank would crash this process (SIGBUS); the node seals its regions, so this peer is not a shardwire node",
            )));
        }
        // One shorter than the node says would fault the same way on the first read past
        // its end: refuse it here, as an error.
        let size = rustix::fs::fstat(fd).map_err(|e| err(e.into()))?.st_size;
        if u64::try_from(size).map_or(true, |size| size < len) {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the region the node sent is {size} bytes, shorter than it said"),
            )));
        }
        // SAFETY: a fresh read-only shared mapping of the region fd the service sent; it
        // aliases nothing in this process and lives until Drop.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len as usize,
                ProtFlags::READ,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| err(e.into()))?;
        Ok(Self {
            ptr: NonNull::new(raw.cast()).expect("mmap success is non-null"),
            len: len as usize,
        })
    }
    /// Its size in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    fn slice(&self, off: u64, len: u64) -> &[u8] {
        let (off, len) = (off as usize, len as usize);
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "tensor range outside the region"
        );
        // SAFETY: the range was checked to lie inside the live mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our mapping; batches hold an Arc, so none outlives it.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One leased batch.
pub struct Batch {
    /// Lease id: read-only ([`Batch::lease`]), since the stream gives back the lease the
    /// batch names, and a changed one would free another batch's bytes under it.
    lease: u64,
    /// Epoch.
    pub epoch: u32,
    /// Index within the epoch.
    pub index: u64,
    /// Shard index.
    pub shard: u32,
    pub(crate) tensors: Vec<TensorView>,
    pub(crate) region: Arc<Mapping>,
    /// Where the lease goes when the batch is dropped without being given back (`None`
    /// once given back through [`Stream::release`] or [`Stream::next_after`]).
    pub(crate) dropped: Option<Dropped>,
    /// The process of its stream: dropped in a child forked from it, it touches nothing
    /// (the parent may have held the `dropped` lock at the fork: locking it would hang).
    pub(crate) pid: u32,
}

/// Leases of batches dropped without being given back: the stream gives them back with its
/// next request (as the Python SDK's finalizer does), so a dropped batch never holds the
/// stream's memory until it closes.
pub(crate) type Dropped = Arc<std::sync::Mutex<Vec<u64>>>;

impl Drop for Batch {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            return;
        }
        if let Some(d) = self.dropped.take() {
            d.lock().unwrap_or_else(|e| e.into_inner()).push(self.lease);
        }
    }
}

impl Batch {
    /// Lease id.
    pub fn lease(&self) -> u64 {
        self.lease
    }
    /// Tensor descriptions.
    pub fn tensors(&self) -> &[TensorView] {
        &self.tensors
    }
    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorView> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// The bytes of a tensor of this batch (zero-copy), which stay as they are while the
    /// batch is held. Every tensor the node names was checked to lie inside the region when
    /// the batch arrived.
    ///
    /// # Panics
    /// If `t` is not one of [`Batch::tensors`]: other bytes of the region are not this
    /// batch's, and the node may be writing them.
    pub fn bytes(&self, t: &TensorView) -> &[u8] {
        assert!(
            self.tensors.iter().any(|own| own == t),
            "tensor `{}` at {}+{} is not one of this batch's (lease {})",
            t.name,
            t.offset,
            t.length,
            self.lease
        );
        self.region.slice(t.offset, t.length)
    }

    /// The lease, to give back: the batch no longer gives it back when dropped.
    pub(crate) fn into_lease(mut self) -> u64 {
        self.dropped = None;
        self.lease
    }
}

/// Checks the tensors of a batch against a region of `region` bytes: each one's bytes lie
/// inside it, and its shape and dtype take exactly its length.
pub(crate) fn check_tensors(tensors: &[TensorView], region: u64) -> Result<(), ClientError> {
    for t in tensors {
        if t.offset
            .checked_add(t.length)
            .is_none_or(|end| end > region)
        {
            return Err(ClientError::TensorOutsideRegion {
                name: t.name.clone(),
                offset: t.offset,
                length: t.length,
                region,
            });
        }
        check_length(&t.name, t.dtype, &t.shape, t.length)?;
    }
    Ok(())
}

/// [`ClientError::Forked`] when this is not process `opened`.
pub(crate) fn same_process(opened: u32) -> Result<(), ClientError> {
    let now = std::process::id();
    if now != opened {
        return Err(ClientError::Forked { opened, now });
    }
    Ok(())
}

/// Checks that a tensor's shape and dtype take exactly its `length` bytes, each dimension
/// below 2^63.
pub(crate) fn check_length(
    name: &str,
    dtype: DType,
    shape: &[u64],
    length: u64,
) -> Result<(), ClientError> {
    // As the manifest and numpy count a shape (`shape_elements`): a zero dimension makes 0
    // bytes whatever the order, and a dimension or product past i64 is no array's.
    let size = shardwire_protocol::manifest::shape_elements(shape)
        .and_then(|n| n.checked_mul(dtype.size()));
    if size != Some(length) {
        return Err(ClientError::TensorLength {
            name: name.to_string(),
            dtype: dtype.to_string(),
            shape: shape.to_vec(),
            length,
        });
    }
    Ok(())
}

/// What the service said when the stream opened.
#[derive(Clone, Debug)]
pub struct StreamInfo {
    /// Stream id.
    pub stream: u64,
    /// Batches per epoch for this rank.
    pub batches_per_epoch: u64,
    /// Epochs.
    pub epochs: u32,
    /// Memory kind.
    pub memory: String,
    /// State it started from (its known fields: [`Stream::resume_state`] has them all
    /// until a batch is handed out).
    pub state: StreamState,
}

/// A wait as the node takes it, in whole milliseconds rounded up: a wait of 0.5 ms is 1 ms,
/// not 0 (which would ask for an answer at once).
pub(crate) fn timeout_ms(t: Duration) -> u64 {
    u64::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;

    use super::*;

    /// The SIGUSR1 handler of [`under_signals`]: does nothing.
    extern "C" fn nothing(_: libc::c_int) {}

    /// Runs `f` on a thread of its own while another thread sends it SIGUSR1 (a handler that
    /// does nothing, installed without SA_RESTART) every `every`, as a sampling profiler's
    /// SIGPROF interrupts a training loop: what `f` returned, or None when it had not returned
    /// within `limit` (a wait that signals make start over never ends; the thread is left to
    /// end once the signals stop).
    pub(crate) fn under_signals<T: Send + 'static>(
        every: Duration,
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        // SAFETY: a zeroed sigaction with an empty mask and a handler that does nothing (and so
        // is async-signal-safe) for SIGUSR1, which nothing else in this crate uses.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = nothing as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        }
        let (id_tx, id_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let (stopped_tx, stopped_rx) = mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            let _ = id_tx.send(unsafe { libc::pthread_self() });
            let _ = done_tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
            // Alive until the signals stop (a panic of `f` too): signalling a thread that has
            // ended is undefined.
            let _ = stopped_rx.recv();
        });
        let id = id_rx.recv().expect("the thread's id");
        let stop = Arc::new(AtomicBool::new(false));
        let signaller = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    // SAFETY: `id` is the worker's, which lives until `stopped_tx` drops,
                    // after this thread is joined.
                    assert_eq!(unsafe { libc::pthread_kill(id, libc::SIGUSR1) }, 0);
                    std::thread::sleep(every);
                }
            })
        };
        let r = done_rx.recv_timeout(limit).ok();
        stop.store(true, Ordering::SeqCst);
        signaller.join().expect("the signalling thread");
        drop(stopped_tx);
        let r = r?;
        worker.join().expect("the thread signalled");
        Some(r.unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    }

    #[test]
    fn a_wait_rounds_up_to_whole_milliseconds() {
        assert_eq!(timeout_ms(Duration::ZERO), 0);
        assert_eq!(timeout_ms(Duration::from_micros(500)), 1);
        assert_eq!(timeout_ms(Duration::from_millis(2)), 2);
        assert_eq!(timeout_ms(Duration::from_nanos(2_000_001)), 3);
        assert_eq!(timeout_ms(Duration::MAX), u64::MAX);
    }

    /// A frame sent to a peer that has gone (the node) fails with `EPIPE` and raises no
    /// SIGPIPE, which would kill a host process that does not ignore it (std's socket writes
    /// and `send_frame`'s `sendmsg` pass `MSG_NOSIGNAL`): with the
    /// signal blocked in the sending thread, one raised would stay pending there (a blocked
    /// signal is queued even while its action is to ignore it, as a Rust binary's is).
    #[test]
    fn a_peer_that_has_gone_is_an_error_not_a_signal() {
        std::thread::spawn(|| {
            // SAFETY: plain libc calls on a local signal set; only this thread's mask changes.
            let pending = || unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigpending(&mut set);
                libc::sigismember(&set, libc::SIGPIPE) == 1
            };
            // SAFETY: as above.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                assert_eq!(
                    libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()),
                    0
                );
            }
            let file = std::fs::File::open("/proc/self/exe").unwrap();
            for fds in [&[][..], &[file.as_fd()][..]] {
                let (a, b) = UnixStream::pair().unwrap();
                drop(b);
                match fdpass::send_frame(&a, b"\x04\0\0\0abcd", fds) {
                    Err(fdpass::FrameIoError::Io(e)) => {
                        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}")
                    }
                    other => panic!("{other:?}"),
                }
                assert!(!pending(), "SIGPIPE raised ({} fds)", fds.len());
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_dimension_past_i64_is_refused_in_any_order() {
        let big = 1u64 << 63;
        for shape in [vec![0, big], vec![big, 0]] {
            assert!(
                check_length("x", DType::Uint8, &shape, 0).is_err(),
                "{shape:?}"
            );
        }
        assert!(check_length("x", DType::Uint8, &[0, big - 1], 0).is_ok());
        // Before, a product overflowing before the 0 was refused whatever the order: now as
        // numpy (what the Python SDK views a tensor with) takes a shape.
        assert!(check_length("x", DType::Uint8, &[1 << 40, 4, 0], 0).is_ok());
        assert!(check_length("x", DType::Uint8, &[0, 1 << 40, 4], 0).is_ok());
        assert!(check_length("x", DType::Uint8, &[1 << 62, 4, 0], 0).is_err());
    }

    /// A region file shorter than the length the node states is refused, not mapped (a read
    /// past its end would be SIGBUS).
    #[test]
    fn a_region_shorter_than_stated_is_an_error() {
        let flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
        let fd = rustix::fs::memfd_create("region", flags).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        // Before, a region that could shrink after the check was mapped: a read after it
        // shrank was SIGBUS.
        let e = Mapping::new(&fd, 4096)
            .err()
            .expect("an unsealed region is refused");
        assert!(e.to_string().contains("F_SEAL_SHRINK"), "{e}");
        rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK).unwrap();
        let e = Mapping::new(&fd, 8192)
            .err()
            .expect("a short region is refused");
        assert!(
            matches!(&e, ClientError::Map { len: 8192, source } if source.to_string().contains("4096 bytes")),
            "{e}"
        );
        let m = Mapping::new(&fd, 4096).expect("a region of the stated size maps");
        assert_eq!(m.slice(0, 4096), &[0u8; 4096][..]);
    }
}
