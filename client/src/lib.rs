//! Rust trainer SDK: open a stream on the node service's Unix socket and iterate batches of
//! named tensors that are zero-copy views into the stream's region (mapped read-only).
//!
//! ```no_run
//! let mut s = shardwire_client::Stream::open("/run/shardwire/trainer.sock",
//!     shardwire_client::StreamOptions::new("imagenet"))?;
//! while let Some(batch) = s.next()? {
//!     for t in batch.tensors() {
//!         let bytes: &[u8] = batch.bytes(t);
//!         println!("{} {} {:?} {}", t.name, t.dtype, t.shape, bytes.len());
//!     }
//!     s.release(batch)?;
//! }
//! # Ok::<(), shardwire_client::ClientError>(())
//! ```

pub use shardwire_protocol::fdpass;
pub mod http;

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

pub use http::{HttpBatch, HttpStream};
use rustix::mm::{MapFlags, ProtFlags};
use shardwire_protocol::trainer::{self, ErrorCode, MemoryKind, Request, Response, StreamRequest};
pub use shardwire_protocol::trainer::{StreamState, TensorView};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Could not reach the socket.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Frame I/O.
    #[error(transparent)]
    Frame(#[from] fdpass::FrameIoError),
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
}

/// What to open: the attach fields, defined once in the protocol crate
/// ([`StreamRequest::new`] gives the defaults: seed 0, rank 0 of 1, one epoch, pad).
pub type StreamOptions = StreamRequest;

/// The stream region, mapped read-only.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a read-only shared mapping owned by this value; reading it from any thread is fine.
unsafe impl Send for Mapping {}
// SAFETY: as above; only shared reads are ever made.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: &OwnedFd, len: u64) -> Result<Self, ClientError> {
        let err = |source: std::io::Error| ClientError::Map { len, source };
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
    /// Lease id.
    pub lease: u64,
    /// Epoch.
    pub epoch: u32,
    /// Index within the epoch.
    pub index: u64,
    /// Shard index.
    pub shard: u32,
    tensors: Vec<TensorView>,
    region: Arc<Mapping>,
}

impl Batch {
    /// Tensor descriptions.
    pub fn tensors(&self) -> &[TensorView] {
        &self.tensors
    }
    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorView> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// The bytes of a tensor of this batch (zero-copy).
    pub fn bytes(&self, t: &TensorView) -> &[u8] {
        self.region.slice(t.offset, t.length)
    }
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
    /// State it started from.
    pub state: StreamState,
}

/// An open stream.
pub struct Stream {
    sock: UnixStream,
    region: Arc<Mapping>,
    reader: fdpass::FrameReader,
    frame: Vec<u8>,
    /// Open-time information.
    pub info: StreamInfo,
}

impl Stream {
    /// Connects to the node's trainer socket and opens a stream.
    pub fn open(path: impl AsRef<Path>, o: StreamOptions) -> Result<Self, ClientError> {
        let path = path.as_ref();
        let sock = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        let req = Request::Attach(Box::new(o));
        let mut frame = Vec::new();
        trainer::encode(&req, &mut frame);
        // A node that refuses this trainer (peer allowlist) answers and closes; if the close
        // wins the race with our write, the write fails (EPIPE) but the refusal is still
        // there to read, and it is the better error.
        let sent = fdpass::send_frame(&sock, &frame, &[]);
        let (mut reader, mut fds) = (fdpass::FrameReader::new(), Vec::new());
        let body = match (reader.read(&sock, &mut fds), sent) {
            (Ok(body), _) => body,
            (Err(_), Err(send_error)) => return Err(send_error.into()),
            (Err(read_error), Ok(())) => return Err(read_error.into()),
        };
        let answer = trainer::decode::<Response>(body).map_err(fdpass::FrameIoError::from)?;
        match answer {
            Response::Attached {
                stream,
                region_size,
                batches_per_epoch,
                epochs,
                memory,
                gpu,
                state,
            } => {
                if memory != MemoryKind::Host {
                    return Err(ClientError::UnsupportedMemory {
                        memory: memory.to_string(),
                        device: gpu
                            .map_or_else(String::new, |g| format!(" on GPU {}", g.pci_bus_id)),
                    });
                }
                let fd = fds
                    .pop()
                    .ok_or_else(|| ClientError::Protocol("attached without a region fd".into()))?;
                let region = Arc::new(Mapping::new(&fd, region_size)?);
                Ok(Self {
                    sock,
                    region,
                    reader,
                    frame: Vec::with_capacity(256),
                    info: StreamInfo {
                        stream,
                        batches_per_epoch,
                        epochs,
                        memory: memory.to_string(),
                        state,
                    },
                })
            }
            Response::Error { code, message } => Err(ClientError::Service { code, message }),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to attach: {other:?}"
            ))),
        }
    }

    /// Sends one request frame, written by `encode` into the reused frame buffer.
    fn send(&mut self, encode: impl FnOnce(&mut Vec<u8>)) -> Result<(), ClientError> {
        self.frame.clear();
        encode(&mut self.frame);
        fdpass::send_frame(&self.sock, &self.frame, &[])?;
        Ok(())
    }

    /// Reads the answer to the request just sent (no fd rides on any answer but `attached`).
    fn answer(&mut self) -> Result<Response, ClientError> {
        let body = self.reader.read_data(&self.sock)?;
        match Response::decode(body).map_err(fdpass::FrameIoError::from)? {
            Response::Error { code, message } => Err(ClientError::Service { code, message }),
            r => Ok(r),
        }
    }

    fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        self.send(|frame| req.encode(frame))?;
        self.answer()
    }

    /// The next batch in plan order, or `None` when every epoch was delivered.
    #[allow(clippy::should_implement_trait)] // fallible: an Iterator would have to hide errors
    pub fn next(&mut self) -> Result<Option<Batch>, ClientError> {
        self.next_inner(None, None)
    }

    /// Like [`Stream::next`], failing with [`ClientError::Timeout`] after `timeout`.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<Batch>, ClientError> {
        self.next_inner(Some(timeout), None)
    }

    /// Releases `done` and takes the next batch in one round trip (the usual training loop).
    pub fn next_after(&mut self, done: Batch) -> Result<Option<Batch>, ClientError> {
        self.next_inner(None, Some(done))
    }

    fn next_inner(
        &mut self,
        timeout: Option<Duration>,
        done: Option<Batch>,
    ) -> Result<Option<Batch>, ClientError> {
        let timeout_ms = timeout.map(|t| t.as_millis() as u64);
        let release = done.as_ref().map(|b| b.lease);
        self.send(|frame| trainer::encode_next(timeout_ms, release.as_slice(), 1, frame))?;
        // Freed while the node works on the answer instead of after it.
        drop(done);
        match self.answer()? {
            Response::Batch {
                lease,
                epoch,
                index,
                shard,
                tensors,
                ..
            } => Ok(Some(Batch {
                lease,
                epoch,
                index,
                shard,
                tensors,
                region: Arc::clone(&self.region),
            })),
            Response::End => Ok(None),
            Response::Timeout => Err(ClientError::Timeout(timeout.unwrap_or_default())),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to next: {other:?}"
            ))),
        }
    }

    /// Gives a batch's memory back to the service.
    pub fn release(&mut self, batch: Batch) -> Result<(), ClientError> {
        let req = Request::Release { lease: batch.lease };
        self.send(|frame| req.encode(frame))?;
        drop(batch); // freed while the node works on the answer
        match self.answer()? {
            Response::Released => Ok(()),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to release: {other:?}"
            ))),
        }
    }

    /// The state to resume from (the next batch not yet taken).
    pub fn state(&mut self) -> Result<StreamState, ClientError> {
        match self.call(&Request::State)? {
            Response::State { state } => Ok(state),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to state: {other:?}"
            ))),
        }
    }
}
