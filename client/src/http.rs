//! The trainer API over HTTP (docs/TRAINER_API.md, "HTTP API"): a fallback for trainers that
//! cannot share memory with the node service (another host, a container without the socket).
//! Same streams, plan order, leases and resume states as [`crate::Stream`]; tensor bytes are
//! downloaded (copied) instead of mapped. Plain HTTP/1.1 over one kept-alive
//! [`std::net::TcpStream`]; no extra dependencies.
//!
//! ```no_run
//! use shardwire_client::{StreamOptions, http::HttpStream};
//! let mut s = HttpStream::open("127.0.0.1:7400", StreamOptions::new("imagenet"))?;
//! while let Some(batch) = s.next()? {
//!     for t in batch.tensors() {
//!         let bytes: Vec<u8> = s.tensor_bytes(&batch, &t.name)?;
//!         println!("{} {} {:?} {}", t.name, t.dtype, t.shape, bytes.len());
//!     }
//!     s.release(batch)?;
//! }
//! s.close()?;
//! # Ok::<(), shardwire_client::ClientError>(())
//! ```
//!
//! The service closes an HTTP stream on [`HttpStream::close`] (also sent, best effort, when
//! the stream is dropped; in a process forked after the open, neither sends anything) or
//! after its idle timeout without requests. Either close goes on a new connection (the node
//! closes a kept-alive one idle for 10 s), takes at most 10 s in all, connect included, and is
//! not sent again (as the Python SDK's). A batch dropped (every
//! clone of it) without [`HttpStream::release`] is released before the stream's next `next`,
//! as [`crate::Stream`] gives its dropped batches back.
//!
//! Every request has two limits: each read waits at most its timeout for the next bytes, and
//! from the response's first byte on each window of that timeout must bring at least
//! [`MIN_PROGRESS`] bytes (1 MiB per 120 s for a tensor, about 8.5 KiB/s), so a reply trickled a
//! byte at a time ends too, while a large tensor over a slow shared link that keeps moving is
//! read whole however long it takes, as far as the client goes (the node itself ends a tensor's
//! download at 30 s plus its size at 1 MiB/s: TRAINER_API.md). They fail the request with
//! [`ClientError::NoAnswer`] (no answer began in time) or [`ClientError::Stalled`] (it began
//! and stalled), naming it (`"GET /v1/leases/{lease}/tensors/{name}"`) and the wait, and close
//! the connection; nothing is sent again after a timeout (the node may be
//! stopped: a second wait would only double the first). The wait for an answer's first byte is
//! one deadline, which signals do not start over. A connection that fails otherwise (reset, cut
//! off) is [`ClientError::Http`], naming the request too.

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use shardwire_protocol::trainer::ErrorCode;
use shardwire_protocol::trainer::http::{BatchBody, NextBody, OpenStream, Opened, TensorMeta};

use crate::resume::{ResumeState, with_state, with_unknown_state};
use crate::{ClientError, StreamOptions, StreamState};

mod reply;
mod timed;

use reply::{Fail, Reply, read_reply};
use timed::Timed;

/// `next` without a timeout polls in waits of this length.
const POLL_MS: u64 = 30_000;
/// Read timeout of requests that do not wait on the stream.
const IO_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest wait for a TCP connection to the node.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest time a close takes in all, connect included (the Python SDK's `CLOSE_TIMEOUT`):
/// the service's idle timeout covers a close that does not arrive.
#[cfg(not(test))]
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Under test: a node that does not answer the close is given up on sooner.
#[cfg(test)]
const CLOSE_TIMEOUT: Duration = Duration::from_millis(300);
/// Largest body of an answer other than a tensor's bytes (as the Python SDK's): the node's
/// JSON answers are far smaller; a server streaming more is not the node.
const ANSWER_LIMIT: u64 = 64 << 20;
/// Largest body of an error answer where a tensor's bytes were asked for.
const ANSWER_LIMIT_ERROR: u64 = 1 << 20;
/// Downloads of one tensor while the node's copy budget stays full (`503` `unavailable`,
/// each after the node waited 10 s for room), as the Python SDK's.
const COPY_ATTEMPTS: usize = 6;
/// The least bytes a response must bring in each window of its read timeout, from its first
/// byte on (over [`IO_TIMEOUT`]: about 8.5 KiB/s). A link that keeps moving at any useful rate
/// (a share of a saturated link: 16 trainers' workers on 100 Mbit/s get ~0.75 MiB/s each)
/// passes the client's check however long a large tensor takes (the node's own copy floor,
/// 1 MiB/s after 30 s, still ends a download slower than that); a reply trickled a byte every few seconds is
/// stalled, not slow, and ends after a window. No whole-response deadline: a tensor that needs
/// longer than any fixed bound would fail on every try, as the stream answers it again.
const MIN_PROGRESS: u64 = 1 << 20;

/// Whether a read failed because its timeout passed (`SO_RCVTIMEO`: `WouldBlock` on Linux).
fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// One tensor of an [`HttpBatch`] (its bytes are fetched with [`HttpStream::tensor_bytes`]).
pub type HttpTensor = TensorMeta;

/// One batch leased over HTTP.
#[derive(Clone, Debug)]
pub struct HttpBatch {
    /// Lease id.
    pub lease: u64,
    /// Epoch.
    pub epoch: u32,
    /// Index within the epoch.
    pub index: u64,
    /// Shard index.
    pub shard: u32,
    tensors: Vec<HttpTensor>,
    /// Alive while a copy of the batch is: the stream releases the lease once none is.
    held: Arc<()>,
}

impl HttpBatch {
    /// Tensor descriptions.
    pub fn tensors(&self) -> &[HttpTensor] {
        &self.tensors
    }
    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&HttpTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// What the service said when the stream opened.
pub type HttpStreamInfo = Opened;

impl From<BatchBody> for HttpBatch {
    fn from(b: BatchBody) -> Self {
        Self {
            lease: b.lease,
            epoch: b.epoch,
            index: b.index,
            shard: b.shard,
            tensors: b.tensors,
            held: Arc::new(()),
        }
    }
}

fn bad(what: impl Into<String>) -> ClientError {
    ClientError::Protocol(what.into())
}

/// Percent-encodes a path segment (RFC 3986 unreserved characters stay as they are).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `HOST:PORT` of the node's HTTP address `HOST:PORT` or `http://HOST:PORT[/]` (as the
/// Python SDK's): another scheme, a path or no port is refused here, by name, rather than
/// failing at the resolver.
fn base_address(url: &str) -> Result<String, ClientError> {
    let bad = || ClientError::Address(url.to_owned());
    let rest = match url.split_once("://") {
        Some(("http", rest)) => rest,
        Some(_) => return Err(bad()),
        None => url,
    };
    let hostport = rest.strip_suffix('/').unwrap_or(rest);
    if hostport.contains(['/', '?', '#', '@', ' ']) {
        return Err(bad());
    }
    let (host, port) = hostport.rsplit_once(':').ok_or_else(bad)?;
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if host.is_empty() || (host.contains(':') && !bracketed) || port.parse::<u16>().is_err() {
        return Err(bad());
    }
    Ok(hostport.to_owned())
}

/// Longest idle timeout the node takes, in seconds (a day; it refuses more by name).
const MAX_IDLE_TIMEOUT_S: u64 = 86_400;

/// The idle timeout asked for, in whole seconds: rounded up (as the Python SDK's). Zero and
/// more than [`MAX_IDLE_TIMEOUT_S`] are refused before anything is sent, as the Python SDK
/// refuses them (the node refuses both; this client once sent zero as one second, which
/// closed the stream during the first model step longer than that).
fn idle_timeout_s(t: Duration) -> Result<u64, ClientError> {
    let s = t.as_secs().saturating_add(u64::from(t.subsec_nanos() > 0));
    if t.is_zero() || s > MAX_IDLE_TIMEOUT_S {
        return Err(ClientError::IdleTimeout(t));
    }
    Ok(s)
}

/// The body of `POST /v1/streams` for `o`, resuming from `from` when given (in place of
/// `o.state`): its fields this client does not know go to the node as they came. An
/// `idle_timeout` of zero or over a day is refused ([`idle_timeout_s`]).
fn open_body(
    mut o: StreamOptions,
    idle_timeout: Option<Duration>,
    from: Option<&ResumeState>,
) -> Result<Vec<u8>, ClientError> {
    if let Some(from) = from {
        o.state = Some(from.known().clone());
    }
    let req = OpenStream {
        stream: o,
        idle_timeout_s: idle_timeout.map(idle_timeout_s).transpose()?,
    };
    let Some(from) = from else {
        return Ok(req.to_json());
    };
    let body: serde_json::Value =
        serde_json::from_slice(&req.to_json()).expect("an open body is JSON");
    Ok(with_state(&body, from).get().as_bytes().to_vec())
}

/// Whether a release's outcome lets go of the lease here: it was released, or had ended
/// already (`unknown_lease`). Any other failure leaves it to be tried again.
fn lease_gone(r: &Result<(), ClientError>) -> bool {
    matches!(
        r,
        Ok(())
            | Err(ClientError::Service {
                code: ErrorCode::UnknownLease,
                ..
            })
    )
}

/// Whether an error is one of the connection itself (it could not be reached, the request or
/// its answer was lost on it, or no answer came in time), rather than an answer that was read.
fn transport_error(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Http { .. }
            | ClientError::Connect { .. }
            | ClientError::NoAnswer { .. }
            | ClientError::Stalled { .. }
    )
}

/// A minimal HTTP/1.1 client on one kept-alive connection.
struct Conn {
    addr: String,
    sock: Option<BufReader<Timed>>,
    /// The read timeout of requests that do not wait on the stream ([`IO_TIMEOUT`]; tests
    /// shorten it).
    io_timeout: Duration,
    /// The least bytes each read-timeout window of a response brings ([`MIN_PROGRESS`]; tests
    /// lower it).
    min_progress: u64,
}

impl Conn {
    /// A new connection to the node, tried on each address the name resolves to, each within
    /// CONNECT_TIMEOUT (a plain connect waits for the kernel's SYN retries, minutes, on an
    /// address that drops packets), none past `end` when given.
    fn connect(&self, end: Option<Instant>) -> Result<BufReader<Timed>, ClientError> {
        let err = |source| ClientError::Connect {
            path: format!("http://{}", self.addr),
            source,
        };
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        let mut connected = None;
        for a in std::net::ToSocketAddrs::to_socket_addrs(&self.addr).map_err(err)? {
            let left = end.map_or(CONNECT_TIMEOUT, |end| {
                CONNECT_TIMEOUT.min(end.saturating_duration_since(Instant::now()))
            });
            if left.is_zero() {
                let why = "no time left of the request's limit to connect in";
                last = std::io::Error::new(std::io::ErrorKind::TimedOut, why);
                break;
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    connected = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let s = connected.ok_or(last).map_err(err)?;
        s.set_nodelay(true).map_err(err)?;
        Ok(BufReader::with_capacity(64 << 10, Timed::new(s)))
    }

    /// Sends a request and reads the whole response, of at most [`ANSWER_LIMIT`] bytes.
    /// `route` is the request's method and path pattern (`"POST /v1/streams/{id}/next"`), as
    /// errors name it; `path` the path sent. A kept-alive connection that the server closed
    /// before answering is replaced and the request sent again once; a request whose answer
    /// did not come in time ([`ClientError::NoAnswer`]) is not.
    fn call(
        &mut self,
        route: &'static str,
        path: &str,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Reply, ClientError> {
        self.call_at_most(route, path, body, timeout, ANSWER_LIMIT)
    }

    /// [`Conn::call`] for a response body of at most `max` bytes: each read waits at most
    /// `timeout`, and from the response's first byte on each `timeout`-long window brings at
    /// least `min_progress` bytes (else [`ClientError::NoAnswer`] or [`ClientError::Stalled`],
    /// after `timeout`).
    fn call_at_most(
        &mut self,
        route: &'static str,
        path: &str,
        body: Option<&[u8]>,
        timeout: Duration,
        max: u64,
    ) -> Result<Reply, ClientError> {
        self.exchange(route, path, body, (timeout, None), max)
    }

    /// A request without a body sent once, on a new connection, and answered within `limit`
    /// in all, connect included (as the Python SDK's close, which opens a connection of its
    /// own). For the close, which must not hold up the caller (or a drop). Never on the
    /// kept-alive connection: the node closes one idle past its `http_header_timeout_secs`
    /// (10 s by default, less than many a training step), and a request written to it then is
    /// lost. A new connection the node closes unanswered had the request: not sent again.
    fn call_within(
        &mut self,
        route: &'static str,
        path: &str,
        limit: Duration,
    ) -> Result<Reply, ClientError> {
        let end = Instant::now().checked_add(limit);
        self.sock = None;
        self.exchange(route, path, None, (limit, end), ANSWER_LIMIT)
    }

    /// [`Conn::call_at_most`] with each read's `timeout`; with an `end`, nothing (connect
    /// included) waits past it, and the request is sent once only (the caller starts it on a
    /// new connection: [`Conn::call_within`]).
    fn exchange(
        &mut self,
        route: &'static str,
        path: &str,
        body: Option<&[u8]>,
        (timeout, end): (Duration, Option<Instant>),
        max: u64,
    ) -> Result<Reply, ClientError> {
        let method = route.split_once(' ').map_or(route, |(method, _)| method);
        let req = request_text(method, path, &self.addr, body);
        for attempt in 0..2 {
            let reused = self.sock.is_some();
            let mut sock = match self.sock.take() {
                Some(s) => s,
                None => self.connect(end)?,
            };
            sock.get_mut().arm(timeout, self.min_progress, end);
            let r = match sock.get_mut().write_all(req.as_bytes()) {
                Ok(()) => read_reply(&mut sock, method == "HEAD", max),
                Err(e) => Err(Fail::Unanswered(e)),
            };
            let slow = sock.get_mut().disarm();
            let no_answer = || ClientError::NoAnswer {
                request: route,
                after: timeout,
            };
            let stalled = || ClientError::Stalled {
                request: route,
                floor: self.min_progress,
                window: timeout,
            };
            match r {
                Ok((reply, keep)) => {
                    if keep {
                        self.sock = Some(sock);
                    }
                    return Ok(reply);
                }
                Err(_) if slow => return Err(stalled()),
                Err(Fail::Unanswered(e) | Fail::Io(e)) if timed_out(&e) => {
                    return Err(no_answer());
                }
                Err(Fail::Unanswered(_)) if reused && attempt == 0 && end.is_none() => continue,
                Err(Fail::Unanswered(e) | Fail::Io(e)) => {
                    return Err(ClientError::Http {
                        request: route,
                        source: e,
                    });
                }
                Err(Fail::Protocol(m)) => return Err(bad(m)),
            }
        }
        unreachable!("the second attempt returns")
    }
}

/// The text of a request: `method path`, its headers and `body` (JSON; a POST always says
/// its length).
fn request_text(method: &str, path: &str, host: &str, body: Option<&[u8]>) -> String {
    let body = String::from_utf8_lossy(body.unwrap_or_default());
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nAccept: */*\r\n");
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    req
}

/// A stream opened over the node service's HTTP API.
pub struct HttpStream {
    conn: Conn,
    closed: bool,
    /// The lease of the last batch received (0: none yet), sent with every `next` as
    /// `after`: a batch the node answered with that never arrived (a broken connection, a
    /// timeout as it came) is answered again, not skipped.
    received: u64,
    /// The lease of the batch the last `next` answered with (0: none yet). Only a failed
    /// download of that batch sets `received` back: an older batch's is none of the node's
    /// "answer again" (it answers the batch after `after`, the one it answered last).
    last_answered: u64,
    /// The `after` of the `next` that answered `last_answered`: a download of that batch that
    /// fails sets `received` back to it, so that the next `next` answers the batch again.
    received_after: u64,
    /// The batch whose failed download set `received` back (always `last_answered`): one of
    /// its downloads that then succeeds (the caller tried again) sets it forward again.
    rolled_back: Option<u64>,
    /// Leases handed out and not released, each with a handle that dies when the caller has
    /// dropped every copy of its batch ([`HttpStream::release_dropped`]).
    leased: Vec<(u64, Weak<()>)>,
    /// The process that opened it: a child forked from it may not use it (its drop closes
    /// nothing on the node).
    pid: u32,
    /// Open-time information (of its state, the fields this client knows:
    /// [`HttpStream::resume_state`] has them all).
    pub info: HttpStreamInfo,
}

impl std::fmt::Debug for HttpStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStream")
            .field("addr", &self.conn.addr)
            .field("info", &self.info)
            .field("closed", &self.closed)
            .finish()
    }
}

impl HttpStream {
    /// Opens a stream on the node service at `admin_addr` (its admin/HTTP address,
    /// `HOST:PORT` or `http://HOST:PORT`).
    pub fn open(admin_addr: &str, o: StreamOptions) -> Result<Self, ClientError> {
        Self::open_with_idle_timeout(admin_addr, o, None)
    }

    /// Like [`HttpStream::open`], asking the service to close the stream after
    /// `idle_timeout` without requests (`None`: its default, 300 s; rounded up to whole
    /// seconds). An `idle_timeout` of zero, or of more than 86400 s (a day) once rounded up,
    /// fails with [`ClientError::IdleTimeout`] before anything is sent.
    pub fn open_with_idle_timeout(
        admin_addr: &str,
        o: StreamOptions,
        idle_timeout: Option<Duration>,
    ) -> Result<Self, ClientError> {
        Self::open_inner(admin_addr, open_body(o, idle_timeout, None)?)
    }

    /// Like [`HttpStream::open_with_idle_timeout`], resuming from `state` (a
    /// [`HttpStream::resume_state`] or [`crate::Stream::resume_state`] saved earlier, in place
    /// of `o.state`): the fields of it this client does not know are sent back to the node as
    /// they came (a node that does not know them either refuses the state, naming them).
    pub fn open_from(
        admin_addr: &str,
        o: StreamOptions,
        state: &ResumeState,
        idle_timeout: Option<Duration>,
    ) -> Result<Self, ClientError> {
        Self::open_inner(admin_addr, open_body(o, idle_timeout, Some(state))?)
    }

    fn open_inner(admin_addr: &str, body: Vec<u8>) -> Result<Self, ClientError> {
        let addr = base_address(admin_addr)?;
        let mut conn = Conn {
            addr,
            sock: None,
            io_timeout: IO_TIMEOUT,
            min_progress: MIN_PROGRESS,
        };
        let r = conn.call("POST /v1/streams", "/v1/streams", Some(&body), IO_TIMEOUT)?;
        if r.status != 201 {
            return Err(r.error());
        }
        // An open answer whose state has fields this client does not know: `info.state` holds
        // its known ones (`resume_state` asks the node for the whole state).
        let opened = r.json::<Opened>().or_else(|e| {
            with_unknown_state::<Opened>(&r.body)
                .map(|(info, _)| info)
                .ok_or(e)
        });
        let info = match opened {
            Ok(info) => info,
            Err(e) => {
                // Opened on the node all the same: closed there, best effort, if its id can
                // be read, so its memory is not held until the idle timeout.
                #[derive(serde::Deserialize)]
                struct Id {
                    stream: u64,
                }
                if let Ok(Id { stream }) = serde_json::from_slice::<Id>(&r.body) {
                    let path = format!("/v1/streams/{stream}/close");
                    let route = "POST /v1/streams/{id}/close";
                    let _ = conn.call_within(route, &path, CLOSE_TIMEOUT);
                }
                return Err(e);
            }
        };
        Ok(Self {
            conn,
            closed: false,
            received: 0,
            last_answered: 0,
            received_after: 0,
            rolled_back: None,
            leased: Vec::new(),
            pid: std::process::id(),
            info,
        })
    }

    /// Fails in a process forked after the open. (A closed stream is never used again:
    /// [`HttpStream::close`] takes it, and `closed` only keeps its drop from closing it twice.)
    fn check_open(&self) -> Result<(), ClientError> {
        crate::same_process(self.pid)
    }

    /// The next batch in plan order, or `None` when every epoch was delivered.
    #[allow(clippy::should_implement_trait)] // fallible, like `Stream::next`
    pub fn next(&mut self) -> Result<Option<HttpBatch>, ClientError> {
        loop {
            if let Some(r) = self.poll(POLL_MS)? {
                return Ok(r);
            }
        }
    }

    /// Like [`HttpStream::next`], failing with [`ClientError::Timeout`] after `timeout`.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<HttpBatch>, ClientError> {
        let mut left = crate::timeout_ms(timeout);
        loop {
            let wait = left.min(POLL_MS);
            if let Some(r) = self.poll(wait)? {
                return Ok(r);
            }
            left -= wait;
            if left == 0 {
                return Err(ClientError::Timeout(timeout));
            }
        }
    }

    /// Releases the leases of batches the caller dropped (best effort): `unknown_lease` (the
    /// lease ended already) counts as released; a lease whose release failed otherwise (the
    /// node refused it, or its answer was not the node's, e.g. a proxy's HTML page) is kept,
    /// to be tried again before the next `next`. Only an error of the connection itself is
    /// returned (the leases not tried yet are kept too). The batch a failed download set back
    /// stays leased: the next `next` answers it again.
    fn release_dropped(&mut self) -> Result<(), ClientError> {
        let again = self.rolled_back;
        let (dropped, held): (Vec<_>, Vec<_>) = std::mem::take(&mut self.leased)
            .into_iter()
            .partition(|(lease, h)| h.strong_count() == 0 && Some(*lease) != again);
        self.leased = held;
        let mut dropped = dropped.into_iter();
        while let Some((lease, handle)) = dropped.next() {
            let r = self.release_lease(lease);
            if lease_gone(&r) {
                continue;
            }
            self.leased.push((lease, handle));
            if let Err(e) = r
                && transport_error(&e)
            {
                self.leased.extend(dropped);
                return Err(e);
            }
        }
        Ok(())
    }

    /// One long poll: Some(answer), or None on timeout.
    fn poll(&mut self, ms: u64) -> Result<Option<Option<HttpBatch>>, ClientError> {
        self.check_open()?;
        self.release_dropped()?;
        let path = format!(
            "/v1/streams/{}/next?timeout_ms={ms}&after={}",
            self.info.stream, self.received
        );
        let wait = Duration::from_millis(ms) + self.conn.io_timeout;
        let r = self
            .conn
            .call("POST /v1/streams/{id}/next", &path, None, wait)?;
        match r.status {
            204 => Ok(None),
            200 => match r.json::<NextBody>()? {
                NextBody::Batch(b) => {
                    self.received_after = self.received;
                    self.received = b.lease;
                    self.last_answered = b.lease;
                    self.rolled_back = None;
                    let b = HttpBatch::from(b);
                    self.leased.retain(|(lease, _)| *lease != b.lease);
                    self.leased.push((b.lease, Arc::downgrade(&b.held)));
                    Ok(Some(Some(b)))
                }
                NextBody::End(_) => Ok(Some(None)),
            },
            _ => Err(r.error()),
        }
    }

    /// Downloads the bytes of tensor `name` of `batch` (a copy; the batch must still be
    /// leased). A download of the batch [`HttpStream::next`] returned last that fails (the
    /// connection, the node's answer) leaves that batch to the next `next`, which answers it
    /// again while it is leased: dropped after the failure, it is not skipped. A failed
    /// download of an older batch moves nothing (the node answers again only the batch it
    /// answered last).
    pub fn tensor_bytes(&mut self, batch: &HttpBatch, name: &str) -> Result<Vec<u8>, ClientError> {
        self.check_open()?;
        let t = batch
            .tensor(name)
            .ok_or_else(|| ClientError::NoSuchTensor {
                lease: batch.lease,
                name: name.to_owned(),
                tensors: batch.tensors.iter().map(|t| t.name.clone()).collect(),
            })?;
        crate::check_length(&t.name, t.dtype, &t.shape, t.length)?;
        let r = self.download(batch.lease, t);
        match &r {
            Err(_) if batch.lease == self.last_answered && self.rolled_back.is_none() => {
                self.received = self.received_after;
                self.rolled_back = Some(batch.lease);
            }
            Ok(_) if self.rolled_back == Some(batch.lease) => {
                self.received = batch.lease;
                self.rolled_back = None;
            }
            _ => {}
        }
        r
    }

    /// The bytes of tensor `t` of lease `lease`, checked against what the batch says.
    fn download(&mut self, lease: u64, t: &HttpTensor) -> Result<Vec<u8>, ClientError> {
        let name = &t.name;
        let path = format!("/v1/leases/{lease}/tensors/{}", encode_segment(name));
        // The tensor's bytes, or an error answer. The node's copy budget full is tried again:
        // failing would lose the batch, since the stream has moved past it.
        let max = t.length.max(ANSWER_LIMIT_ERROR);
        let mut attempt = 1;
        let r = loop {
            let r = self.get_asking_again(&path, max)?;
            if r.status == 200 {
                break r;
            }
            let e = r.error();
            match e {
                ClientError::Service {
                    code: ErrorCode::Unavailable,
                    ..
                } if attempt < COPY_ATTEMPTS => attempt += 1,
                e => return Err(e),
            }
        };
        if r.body.len() as u64 != t.length {
            return Err(bad(format!(
                "tensor `{name}`: {} bytes arrived, the batch says {}",
                r.body.len(),
                t.length
            )));
        }
        if let Some(d) = r.header("x-shardwire-dtype")
            && d != t.dtype.name()
        {
            return Err(bad(format!(
                "tensor `{name}`: dtype {d} in the response, {} in the batch",
                t.dtype
            )));
        }
        Ok(r.body)
    }

    /// A GET of at most `max` bytes, asked once more on a new connection when its answer is
    /// lost on the way (the connection reset, the body cut off): a GET changes nothing on the
    /// node, so asking again is safe (as the Python SDK's `_get_tensor`). Not after a timeout
    /// ([`ClientError::NoAnswer`]): a node that did not answer in time (stopped, or a proxy
    /// holding the request) would only be waited for as long again.
    fn get_asking_again(&mut self, path: &str, max: u64) -> Result<Reply, ClientError> {
        const ROUTE: &str = "GET /v1/leases/{lease}/tensors/{name}";
        let timeout = self.conn.io_timeout;
        match self.conn.call_at_most(ROUTE, path, None, timeout, max) {
            Err(ClientError::Http { .. }) => {
                // The failed call dropped its connection already: this one starts afresh.
                self.conn.sock = None;
                self.conn.call_at_most(ROUTE, path, None, timeout, max)
            }
            r => r,
        }
    }

    /// Gives a batch's memory back to the service. A release that fails other than with
    /// `unknown_lease` (the lease ended already) is tried again before the next `next`.
    pub fn release(&mut self, batch: HttpBatch) -> Result<(), ClientError> {
        self.check_open()?;
        let r = self.release_lease(batch.lease);
        if lease_gone(&r) {
            self.leased.retain(|(lease, _)| *lease != batch.lease);
        }
        // Otherwise its entry stays: `batch` ends here, so (its clones gone too) the next
        // `next` finds it dropped and sends its release again.
        r
    }

    fn release_lease(&mut self, lease: u64) -> Result<(), ClientError> {
        let path = format!("/v1/leases/{lease}/release?stream={}", self.info.stream);
        let route = "POST /v1/leases/{lease}/release";
        let r = self.conn.call(route, &path, None, self.conn.io_timeout)?;
        match r.status {
            200 => Ok(()),
            _ => Err(r.error()),
        }
    }

    /// The state to resume from (the next batch not yet taken). A state with fields this
    /// client does not know (a newer node's) is refused ([`ClientError::StateFieldsUnknown`]):
    /// [`HttpStream::resume_state`] keeps them.
    pub fn state(&mut self) -> Result<StreamState, ClientError> {
        self.resume_state()?.into_known()
    }

    /// The state to resume from, as [`HttpStream::state`], whole: fields this client does not
    /// know are kept, to go back to the node with [`HttpStream::open_from`] (or
    /// [`crate::Stream::open_from`]). What a trainer saves in its checkpoint.
    pub fn resume_state(&mut self) -> Result<ResumeState, ClientError> {
        self.check_open()?;
        // `after`: a batch whose download failed is not counted as taken.
        let path = format!(
            "/v1/streams/{}/state?after={}",
            self.info.stream, self.received
        );
        let route = "GET /v1/streams/{id}/state";
        let r = self.conn.call(route, &path, None, self.conn.io_timeout)?;
        match r.status {
            200 => r.json::<ResumeState>(),
            _ => Err(r.error()),
        }
    }

    /// Closes the stream on the service (every lease it holds ends). Sent on a new connection
    /// (the kept-alive one may have been closed by the node while idle), takes at most 10 s in
    /// all, connect included, and is not sent again (as the Python SDK's `close`): an error
    /// says the close may not have arrived, and the service then closes the stream after its
    /// idle timeout.
    pub fn close(mut self) -> Result<(), ClientError> {
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<(), ClientError> {
        if self.closed {
            return Ok(());
        }
        if crate::same_process(self.pid).is_err() {
            // A child's copy: let go of its socket only; the stream is the parent's.
            self.closed = true;
            self.conn.sock = None;
            return Ok(());
        }
        self.closed = true;
        let path = format!("/v1/streams/{}/close", self.info.stream);
        let route = "POST /v1/streams/{id}/close";
        let r = self.conn.call_within(route, &path, CLOSE_TIMEOUT)?;
        self.conn.sock = None;
        match r.status {
            200 => Ok(()),
            _ => Err(r.error()),
        }
    }
}

impl Drop for HttpStream {
    fn drop(&mut self) {
        // Best effort, within CLOSE_TIMEOUT: the idle timeout covers a close that does not
        // arrive.
        let _ = self.close_inner();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// One request read off a fake node's connection (its body skipped): its method and
    /// path, or None at the end of the connection.
    fn read_request(r: &mut BufReader<TcpStream>) -> Option<String> {
        use std::io::{BufRead, Read};
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        let target = line.split(' ').take(2).collect::<Vec<_>>().join(" ");
        let mut length = 0;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
        }
        r.by_ref()
            .take(length)
            .read_to_end(&mut Vec::new())
            .unwrap();
        Some(target)
    }

    /// A fake node's HTTP side: answers each request with `answer(method and path)` (status,
    /// extra headers, body), over one kept-alive connection and then the close's own; returns
    /// the requests it saw once it answered a `/close` ([`fake_node_raw`]).
    fn fake_node(
        answer: impl Fn(&str) -> (u16, &'static str, Vec<u8>) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<Vec<String>>) {
        fake_node_raw(move |target| {
            let (status, headers, body) = answer(target);
            (raw_answer(status, headers, &body), false)
        })
    }

    const OPENED: &str = r#"{"stream":1,"batches_per_epoch":1,"epochs":1,"idle_timeout_s":300,
        "state":{"epoch":0,"index":0,"seed":0,"fingerprint":"f"}}"#;

    fn batch(shape: &str) -> Vec<u8> {
        format!(
            r#"{{"lease":5,"epoch":0,"index":0,"shard":0,
            "tensors":[{{"name":"x","dtype":"uint8","shape":{shape},"length":4}}]}}"#
        )
        .into_bytes()
    }

    #[test]
    fn a_full_copy_budget_is_tried_again_and_the_tensor_arrives() {
        let busy = std::sync::atomic::AtomicUsize::new(0);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => (200, "", batch("[4]")),
            "GET /v1/leases/5/tensors/x" => {
                if busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 {
                    let e = br#"{"code":"unavailable","message":"copies in flight"}"#;
                    (503, "", e.to_vec())
                } else {
                    (200, "x-shardwire-dtype: uint8\r\n", b"abcd".to_vec())
                }
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b = s.next().unwrap().expect("a batch");
        // Before, the first 503 was returned and the batch lost (the stream moved past it).
        assert_eq!(s.tensor_bytes(&b, "x").unwrap(), b"abcd");
        drop(s);
        let seen = node.join().unwrap();
        let gets = seen.iter().filter(|t| t.starts_with("GET")).count();
        assert_eq!(gets, 3, "{seen:?}");
    }

    #[test]
    fn a_tensor_whose_shape_does_not_take_its_length_is_refused() {
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => (200, "", batch("[3]")),
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b = s.next().unwrap().expect("a batch");
        let e = s.tensor_bytes(&b, "x").unwrap_err();
        assert!(
            matches!(e, ClientError::TensorLength { length: 4, .. }),
            "{e}"
        );
        drop(s);
        let seen = node.join().unwrap();
        assert!(!seen.iter().any(|t| t.starts_with("GET")), "{seen:?}");
    }

    #[test]
    fn every_next_names_the_last_batch_received() {
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => (200, "", batch("[4]")),
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        s.next().unwrap().expect("a batch");
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen = node.join().unwrap();
        let nexts: Vec<&String> = seen.iter().filter(|t| t.contains("/next")).collect();
        assert!(nexts[0].ends_with("&after=0"), "{seen:?}");
        assert!(nexts[1].ends_with("&after=5"), "{seen:?}");
    }

    #[test]
    fn a_batch_whose_download_failed_is_answered_again_by_the_next_next() {
        // Before, the next `next` named the failed batch as received: the node answered the
        // batch after it, and the failed one was skipped (its lease held until the close).
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => (200, "", batch("[4]")),
            "GET /v1/leases/5/tensors/x" => {
                let e = br#"{"code":"data_unavailable","message":"cut"}"#;
                (502, "", e.to_vec())
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b = s.next().unwrap().expect("a batch");
        assert!(s.tensor_bytes(&b, "x").is_err());
        // A caller's own mistake is no failed download: nothing moves back. It is the
        // client's error, not the service's (before, "service error not_found").
        let e = s.tensor_bytes(&b, "nope").unwrap_err();
        assert!(
            matches!(&e, ClientError::NoSuchTensor { lease: 5, name, tensors }
                if name == "nope" && tensors == &["x"]),
            "{e}"
        );
        drop(b);
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen = node.join().unwrap();
        let nexts: Vec<&String> = seen.iter().filter(|t| t.contains("/next")).collect();
        assert!(nexts[1].ends_with("&after=0"), "{seen:?}");
    }

    #[test]
    fn a_batch_dropped_unreleased_is_released_before_the_next_next() {
        // Before, a dropped HttpBatch kept its lease on the node until the close or the
        // idle timeout: the region filled and `next` waited forever.
        let leases = std::sync::atomic::AtomicU64::new(4);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => {
                let n = leases.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                let b = String::from_utf8(batch("[4]")).unwrap();
                (
                    200,
                    "",
                    b.replace("\"lease\":5", &format!("\"lease\":{n}"))
                        .into_bytes(),
                )
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b5 = s.next().unwrap().expect("a batch");
        let kept = b5.clone();
        drop(b5);
        let b6 = s.next().unwrap().expect("a batch");
        drop(b6);
        drop(kept);
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen: Vec<String> = node.join().unwrap().into_iter().skip(1).collect();
        let want = [
            "POST /v1/streams/1/next?timeout_ms=30000&after=0",
            "POST /v1/streams/1/next?timeout_ms=30000&after=5",
            "POST /v1/leases/5/release?stream=1",
            "POST /v1/leases/6/release?stream=1",
            "POST /v1/streams/1/next?timeout_ms=30000&after=6",
            "POST /v1/streams/1/close",
        ];
        assert_eq!(seen, want, "a clone kept lease 5 until it was dropped");
    }

    /// A state with a field this client does not know (a newer node's): before, an open
    /// answer carrying one failed the open, and `state()` refused the node's state answer;
    /// now `resume_state` keeps it whole and `state`, which has no room for it, refuses it by
    /// name.
    #[test]
    fn a_state_with_fields_this_client_does_not_know_is_kept() {
        let newer = r#"{"epoch":0,"index":3,"seed":0,"fingerprint":"f","added":[1]}"#;
        let opened = OPENED.replace(r#""f"}"#, r#""f","added":[1]}"#);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", opened.clone().into_bytes()),
            t if t.contains("/state") => (200, "", newer.as_bytes().to_vec()),
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        assert_eq!(s.info.state.fingerprint, "f");
        let st = s.resume_state().unwrap();
        assert_eq!(
            (st.known().index, st.unknown_fields()),
            (3, vec!["added".to_string()])
        );
        let whole = serde_json::to_value(&st).unwrap();
        assert_eq!(whole["added"], serde_json::json!([1]), "{whole}");
        let e = s.state().unwrap_err();
        assert!(
            matches!(&e, ClientError::StateFieldsUnknown { fields } if fields == &["added"]),
            "{e}"
        );
        drop(s);
        node.join().unwrap();
    }

    /// Resuming sends the state's fields this client does not know back as they came: a node
    /// that knows them resumes there, one that does not refuses the state naming them (as the
    /// protocol's decoder of the open body does).
    #[test]
    fn resuming_sends_a_states_unknown_fields_back_for_the_node_to_judge() {
        let newer = r#"{"epoch":1,"index":2,"seed":0,"fingerprint":"f","added":true}"#;
        let st: ResumeState = serde_json::from_str(newer).unwrap();
        let idle = Some(Duration::from_secs(5));
        let body = open_body(StreamOptions::new("d"), idle, Some(&st)).unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(sent["state"]["added"], true, "{sent}");
        assert_eq!(sent["state"]["index"], 2, "{sent}");
        assert_eq!(sent["idle_timeout_s"], 5, "{sent}");
        let e = OpenStream::from_json(&body).unwrap_err().to_string();
        assert!(e.contains("added"), "{e}");
        // A state of this client's own version opens as `o.state` would.
        let known = st.known().clone();
        let body = open_body(StreamOptions::new("d"), None, Some(&known.clone().into())).unwrap();
        let open = OpenStream::from_json(&body).unwrap();
        assert_eq!(open.stream.state, Some(known));
    }

    #[test]
    fn an_open_answer_that_cannot_be_read_closes_the_stream_it_opened() {
        // Before, the stream stayed open on the node, its memory held until the idle timeout.
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", br#"{"stream":7}"#.to_vec()),
            _ => (200, "", b"{}".to_vec()),
        });
        let e = HttpStream::open(&addr, StreamOptions::new("d")).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e}");
        let seen = node.join().unwrap();
        assert_eq!(seen, ["POST /v1/streams", "POST /v1/streams/7/close"]);
    }

    #[test]
    fn a_stream_dropped_in_a_forked_child_is_not_closed_on_the_node() {
        // Before, the child's drop sent the close on the parent's connection: the parent's
        // stream ended on the node.
        let state = br#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f"}"#;
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.contains("/state") => (200, "", state.to_vec()),
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        // SAFETY: the child only drops the stream (its own copy of the socket) and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            let refused = matches!(s.state(), Err(ClientError::Forked { .. }));
            drop(s);
            // SAFETY: _exit ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if refused { 0 } else { 3 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child's use was not refused"
        );
        s.state().unwrap();
        drop(s);
        let seen = node.join().unwrap();
        let closes = seen.iter().filter(|t| t.ends_with("/close")).count();
        assert_eq!(closes, 1, "the parent's close only: {seen:?}");
    }

    #[test]
    fn the_base_address_is_host_port_or_an_http_url_of_one() {
        for ok in [
            "127.0.0.1:7400",
            "http://node7:7400",
            "http://node7:7400/",
            "[::1]:7400",
        ] {
            assert!(base_address(ok).is_ok(), "{ok}");
        }
        assert_eq!(base_address("http://n:1/").unwrap(), "n:1");
        // Before, each reached the resolver and failed with a confusing connect error.
        for bad in [
            "https://node7:7400",
            "http://node7:7400/v1",
            "node7",
            "node7:http",
            "::1:7400",
        ] {
            assert!(
                matches!(base_address(bad), Err(ClientError::Address(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_download_tried_again_that_succeeds_names_the_batch_received_again() {
        // The first GET fails, the caller tries again and it succeeds: the batch is the
        // caller's, so the next `next` names it (before, it stayed set back: the node answered
        // the same batch again).
        let gets = std::sync::atomic::AtomicUsize::new(0);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => (200, "", batch("[4]")),
            "GET /v1/leases/5/tensors/x" => {
                if gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    (
                        502,
                        "",
                        br#"{"code":"data_unavailable","message":"cut"}"#.to_vec(),
                    )
                } else {
                    (200, "x-shardwire-dtype: uint8\r\n", b"abcd".to_vec())
                }
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b = s.next().unwrap().expect("a batch");
        assert!(s.tensor_bytes(&b, "x").is_err());
        assert_eq!(s.tensor_bytes(&b, "x").unwrap(), b"abcd");
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen = node.join().unwrap();
        let nexts: Vec<&String> = seen.iter().filter(|t| t.contains("/next")).collect();
        assert!(nexts[1].ends_with("&after=5"), "{seen:?}");
    }

    /// A fake node's HTTP side over any number of connections, one after the other: answers
    /// each request with `answer(method and path)` (the raw response, and whether to close
    /// the connection after it); returns the requests it saw once it answered a `/close`.
    fn fake_node_raw(
        answer: impl Fn(&str) -> (Vec<u8>, bool) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<Vec<String>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let mut seen = Vec::new();
            loop {
                let (s, _) = l.accept().unwrap();
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut w = s;
                while let Some(target) = read_request(&mut r) {
                    let (raw, close) = answer(&target);
                    let _ = w.write_all(&raw);
                    let last = target.ends_with("/close");
                    seen.push(target);
                    if last {
                        return seen;
                    }
                    if close {
                        break;
                    }
                }
            }
        });
        (addr, t)
    }

    /// A whole response of `status` with `headers` (each ending in CRLF) and `body`.
    fn raw_answer(status: u16, headers: &str, body: &[u8]) -> Vec<u8> {
        let head = format!(
            "HTTP/1.1 {status} X\r\nContent-Length: {}\r\n{headers}\r\n",
            body.len()
        );
        [head.as_bytes(), body].concat()
    }

    /// A `next` answer with lease `n` (one tensor `x` of 4 bytes).
    fn batch_of_lease(n: u64) -> Vec<u8> {
        String::from_utf8(batch("[4]"))
            .unwrap()
            .replace("\"lease\":5", &format!("\"lease\":{n}"))
            .into_bytes()
    }

    #[test]
    fn a_tensor_whose_answer_was_cut_off_is_asked_again_on_a_new_connection() {
        // Before, the body cut off failed the download (as Python's `_get_tensor` does not).
        let gets = std::sync::atomic::AtomicUsize::new(0);
        let (addr, node) = fake_node_raw(move |target| match target {
            "POST /v1/streams" => (raw_answer(201, "", OPENED.as_bytes()), false),
            t if t.starts_with("POST /v1/streams/1/next") => {
                (raw_answer(200, "", &batch("[4]")), false)
            }
            "GET /v1/leases/5/tensors/x" => {
                if gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    let cut = b"HTTP/1.1 200 X\r\nContent-Length: 4\r\n\r\nab";
                    (cut.to_vec(), true)
                } else {
                    let dtype = "x-shardwire-dtype: uint8\r\n";
                    (raw_answer(200, dtype, b"abcd"), false)
                }
            }
            _ => (raw_answer(200, "", b"{}"), false),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b = s.next().unwrap().expect("a batch");
        assert_eq!(s.tensor_bytes(&b, "x").unwrap(), b"abcd");
        drop(s);
        let seen = node.join().unwrap();
        let gets = seen.iter().filter(|t| t.starts_with("GET")).count();
        assert_eq!(gets, 2, "{seen:?}");
    }

    /// A node that takes the close and never answers: `close()` returns within CLOSE_TIMEOUT
    /// (10 s; shorter under test), as the Python SDK's. Before, it waited the read timeout of
    /// every request (120 s), and longer where it had to connect first.
    #[test]
    fn a_close_the_node_never_answers_ends_within_the_close_limit() {
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let (addr, node) = fake_node_raw(move |target| match target {
            "POST /v1/streams" => (raw_answer(201, "", OPENED.as_bytes()), false),
            t if t.ends_with("/close") => {
                let _ = held.recv_timeout(Duration::from_secs(10));
                (Vec::new(), false)
            }
            _ => (raw_answer(200, "", b"{}"), false),
        });
        let s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = s.close();
            let _ = tx.send((r, t0.elapsed()));
        });
        let closed = rx.recv_timeout(Duration::from_secs(5));
        drop(hold);
        let (r, took) = closed.expect("close() returned");
        assert!(
            matches!(
                r,
                Err(ClientError::NoAnswer {
                    request: "POST /v1/streams/{id}/close",
                    after,
                }) if after == CLOSE_TIMEOUT
            ),
            "{r:?}"
        );
        assert!(took < CLOSE_TIMEOUT * 3, "{took:?}");
        let seen = node.join().unwrap();
        assert_eq!(seen, ["POST /v1/streams", "POST /v1/streams/1/close"]);
    }

    /// A close that the node takes and cuts off unanswered is not sent again (the wait twice
    /// over): it went on a new connection, so the node had it.
    #[test]
    fn a_close_cut_off_unanswered_is_sent_once_only() {
        let (addr, node) = fake_node_raw(move |target| match target {
            "POST /v1/streams" => (raw_answer(201, "", OPENED.as_bytes()), false),
            t if t.ends_with("/close") => (Vec::new(), true),
            _ => (raw_answer(200, "", b"{}"), false),
        });
        let s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let e = s.close().unwrap_err();
        let seen = node.join().unwrap();
        assert!(
            matches!(
                e,
                ClientError::Http {
                    request: "POST /v1/streams/{id}/close",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(seen, ["POST /v1/streams", "POST /v1/streams/1/close"]);
    }

    /// The node closes the kept-alive connection while the trainer is busy (its 10 s idle
    /// keep-alive, here at once after the `next`): the close still arrives and succeeds, on a
    /// new connection. Before, it was written to the closed connection, never sent again, and
    /// `close()` failed with the stream left open on the node until its idle timeout.
    #[test]
    fn a_close_after_the_node_closed_the_idle_connection_arrives() {
        let (addr, node) = fake_node_raw(move |target| match target {
            "POST /v1/streams" => (raw_answer(201, "", OPENED.as_bytes()), false),
            t if t.starts_with("POST /v1/streams/1/next") => {
                (raw_answer(200, "", &batch("[4]")), true)
            }
            _ => (raw_answer(200, "", b"{}"), false),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        s.next().unwrap().expect("a batch");
        // The node's side is closed by now (or its close crosses the request): either way,
        // a request written to the kept-alive connection would be lost.
        std::thread::sleep(Duration::from_millis(50));
        let r = s.close();
        // Checked before the join: a close that never arrives leaves the node waiting.
        assert!(r.is_ok(), "{r:?}");
        let seen = node.join().unwrap();
        assert_eq!(
            seen.last().map(String::as_str),
            Some("POST /v1/streams/1/close")
        );
    }

    /// A connection that fails under a request names the request. Before, it read as a Unix
    /// socket's failure: "trainer socket I/O: ...".
    #[test]
    fn a_connection_that_fails_under_a_request_names_it() {
        let (addr, node) = fake_node_raw(move |target| match target {
            "POST /v1/streams" => (raw_answer(201, "", OPENED.as_bytes()), false),
            t if t.starts_with("POST /v1/streams/1/next") => (
                b"HTTP/1.1 200 X\r\nContent-Length: 100\r\n\r\n{".to_vec(),
                true,
            ),
            _ => (raw_answer(200, "", b"{}"), false),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let e = s.next().unwrap_err();
        assert!(
            matches!(
                e,
                ClientError::Http {
                    request: "POST /v1/streams/{id}/next",
                    ..
                }
            ),
            "{e}"
        );
        let message = e.to_string();
        assert!(message.contains("POST /v1/streams/{id}/next"), "{message}");
        assert!(!message.contains("trainer socket"), "{message}");
        drop(s);
        node.join().unwrap();
    }

    #[test]
    fn a_failed_download_of_an_older_batch_leaves_the_set_back_batch_leased() {
        // B5, B6 taken; B6's download fails (set back: `after` names B5); then B5's fails.
        // Before, the second failure set back to B5 in B6's place: B6 was released with the
        // dropped batches and the node's answer to `after=5` skipped it.
        let leases = std::sync::atomic::AtomicU64::new(4);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => {
                let n = leases.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                (200, "", batch_of_lease(n))
            }
            t if t.starts_with("GET") => {
                let e = br#"{"code":"data_unavailable","message":"cut"}"#;
                (502, "", e.to_vec())
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b5 = s.next().unwrap().expect("a batch");
        let b6 = s.next().unwrap().expect("a batch");
        assert!(s.tensor_bytes(&b6, "x").is_err());
        assert!(s.tensor_bytes(&b5, "x").is_err());
        drop((b5, b6));
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen: Vec<String> = node.join().unwrap().into_iter().skip(1).collect();
        let want = [
            "POST /v1/streams/1/next?timeout_ms=30000&after=0",
            "POST /v1/streams/1/next?timeout_ms=30000&after=5",
            "GET /v1/leases/6/tensors/x",
            "GET /v1/leases/5/tensors/x",
            "POST /v1/leases/5/release?stream=1",
            "POST /v1/streams/1/next?timeout_ms=30000&after=5",
            "POST /v1/streams/1/close",
        ];
        assert_eq!(seen, want, "B6 stays leased, to be answered again");
    }

    #[test]
    fn a_release_that_failed_is_sent_again_before_the_next_next() {
        // Before, the lease was forgotten before its release was sent: a failed release left
        // it held on the node until the close or the idle timeout.
        let releases = std::sync::atomic::AtomicUsize::new(0);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => (200, "", batch("[4]")),
            "POST /v1/leases/5/release?stream=1" => {
                if releases.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    let e = br#"{"code":"unavailable","message":"busy"}"#;
                    (503, "", e.to_vec())
                } else {
                    (200, "", br#"{"released":true}"#.to_vec())
                }
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let b = s.next().unwrap().expect("a batch");
        assert!(s.release(b).is_err());
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen: Vec<String> = node.join().unwrap().into_iter().skip(1).collect();
        let want = [
            "POST /v1/streams/1/next?timeout_ms=30000&after=0",
            "POST /v1/leases/5/release?stream=1",
            "POST /v1/leases/5/release?stream=1",
            "POST /v1/streams/1/next?timeout_ms=30000&after=5",
            "POST /v1/streams/1/close",
        ];
        assert_eq!(seen, want);
    }

    #[test]
    fn a_dropped_batch_whose_release_gets_no_node_answer_does_not_block_next() {
        // A proxy's HTML 502 is no `{code, message}` (a protocol error). Before, it failed
        // `next` before the `next` was sent, and every later `next` the same way.
        let releases = std::sync::atomic::AtomicUsize::new(0);
        let leases = std::sync::atomic::AtomicU64::new(4);
        let (addr, node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => {
                let n = leases.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                (200, "", batch_of_lease(n))
            }
            "POST /v1/leases/5/release?stream=1" => {
                if releases.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    (502, "", b"<html>Bad Gateway</html>".to_vec())
                } else {
                    (200, "", br#"{"released":true}"#.to_vec())
                }
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        drop(s.next().unwrap().expect("a batch"));
        let b6 = s
            .next()
            .unwrap()
            .expect("the release of lease 5 failing is no error");
        assert_eq!(b6.lease, 6);
        drop(b6);
        s.next().unwrap().expect("a batch");
        drop(s);
        let seen: Vec<String> = node.join().unwrap().into_iter().skip(1).collect();
        let want = [
            "POST /v1/streams/1/next?timeout_ms=30000&after=0",
            "POST /v1/leases/5/release?stream=1",
            "POST /v1/streams/1/next?timeout_ms=30000&after=5",
            "POST /v1/leases/5/release?stream=1",
            "POST /v1/leases/6/release?stream=1",
            "POST /v1/streams/1/next?timeout_ms=30000&after=6",
            "POST /v1/streams/1/close",
        ];
        assert_eq!(
            seen, want,
            "lease 5 is released again before the next `next`"
        );
    }

    #[test]
    fn an_end_that_is_false_is_a_protocol_error_not_the_end() {
        // Before, `{"end": false}` was taken as the end: `next` returned None early.
        let (addr, _node) = fake_node(move |target| match target {
            "POST /v1/streams" => (201, "", OPENED.into()),
            t if t.starts_with("POST /v1/streams/1/next") => {
                (200, "", br#"{"end":false}"#.to_vec())
            }
            _ => (200, "", b"{}".to_vec()),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let e = s.next().unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e}");
    }

    #[test]
    fn the_idle_timeout_is_rounded_up_to_whole_seconds() {
        // Before, 1.5 s was sent as 1 (rounded down); the Python SDK sends ceil.
        assert_eq!(idle_timeout_s(Duration::from_millis(1500)).unwrap(), 2);
        assert_eq!(idle_timeout_s(Duration::from_millis(1)).unwrap(), 1);
        assert_eq!(idle_timeout_s(Duration::from_secs(7)).unwrap(), 7);
        assert_eq!(idle_timeout_s(Duration::from_secs(86_400)).unwrap(), 86_400);
    }

    #[test]
    fn an_idle_timeout_above_a_day_is_refused_before_anything_is_sent() {
        // Before, it was sent and the node answered 400.
        for t in [
            Duration::from_millis(86_400_001),
            Duration::from_secs(90_000),
            Duration::MAX,
        ] {
            let e = idle_timeout_s(t).unwrap_err();
            assert!(matches!(e, ClientError::IdleTimeout(x) if x == t), "{e}");
            assert!(e.to_string().contains("86400"), "{e}");
        }
    }

    #[test]
    fn a_zero_idle_timeout_is_refused_before_anything_is_sent() {
        // Before, zero was sent as 1 s: the node closed the stream during the first model
        // step longer than that. The address has nothing listening: a refusal that came
        // from a connect would be ClientError::Connect.
        let e = HttpStream::open_with_idle_timeout(
            "127.0.0.1:1",
            StreamOptions::new("d"),
            Some(Duration::ZERO),
        )
        .unwrap_err();
        assert!(
            matches!(e, ClientError::IdleTimeout(t) if t.is_zero()),
            "{e}"
        );
        assert!(e.to_string().contains("pass None"), "{e}");
        let st: ResumeState =
            serde_json::from_str(r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f"}"#).unwrap();
        let e = HttpStream::open_from(
            "127.0.0.1:1",
            StreamOptions::new("d"),
            &st,
            Some(Duration::ZERO),
        )
        .unwrap_err();
        assert!(matches!(e, ClientError::IdleTimeout(_)), "{e}");
    }

    #[test]
    fn a_download_without_an_answer_names_the_request_and_is_not_asked_again() {
        // Before: after the read timeout the GET was sent again on a new connection (the wait
        // twice over, 240 s), then failed as "trainer socket I/O: Resource temporarily
        // unavailable (os error 11)", naming neither the request nor the wait.
        let (addr, node) = fake_node_raw(move |target| match target {
            "POST /v1/streams" => (raw_answer(201, "", OPENED.as_bytes()), false),
            t if t.starts_with("POST /v1/streams/1/next") => {
                (raw_answer(200, "", &batch("[4]")), false)
            }
            t if t.starts_with("GET") => (Vec::new(), false),
            _ => (raw_answer(200, "", b"{}"), false),
        });
        let mut s = HttpStream::open(&addr, StreamOptions::new("d")).unwrap();
        let wait = Duration::from_millis(300);
        s.conn.io_timeout = wait;
        let b = s.next().unwrap().expect("a batch");
        let t0 = Instant::now();
        let e = s.tensor_bytes(&b, "x").unwrap_err();
        assert!(
            matches!(
                e,
                ClientError::NoAnswer {
                    request: "GET /v1/leases/{lease}/tensors/{name}",
                    after,
                } if after == wait
            ),
            "{e}"
        );
        assert!(t0.elapsed() < wait * 3, "{:?}", t0.elapsed());
        drop(b);
        drop(s);
        let seen = node.join().unwrap();
        let gets = seen.iter().filter(|t| t.starts_with("GET")).count();
        assert_eq!(gets, 1, "{seen:?}");
    }

    /// A node for one request on one connection: after reading it, sends `pieces` of the
    /// raw answer `every` apart (a write that fails ends it).
    fn paced_node(pieces: Vec<Vec<u8>>, every: Duration) -> (String, std::thread::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let node = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            read_request(&mut BufReader::new(s.try_clone().unwrap()));
            let mut w = s;
            for piece in pieces {
                if w.write_all(&piece).is_err() {
                    return;
                }
                std::thread::sleep(every);
            }
        });
        (addr, node)
    }

    fn conn_to(addr: String, min_progress: u64) -> Conn {
        Conn {
            addr,
            sock: None,
            io_timeout: IO_TIMEOUT,
            min_progress,
        }
    }

    #[test]
    fn a_reply_trickled_a_byte_at_a_time_ends_after_a_window_short_of_its_floor() {
        // Each byte comes well within the read timeout; without a floor, one byte every 119 s
        // would keep the request waiting for ever.
        let bytes = raw_answer(200, "", b"{}").into_iter().map(|b| vec![b]);
        let (addr, node) = paced_node(bytes.collect(), Duration::from_millis(50));
        let mut conn = conn_to(addr, MIN_PROGRESS);
        let timeout = Duration::from_millis(400);
        let t0 = Instant::now();
        let r = conn.call_at_most("GET /v1/status", "/v1/status", None, timeout, 16);
        let took = t0.elapsed();
        let Err(e) = r else {
            panic!("the trickled reply was read whole, after {took:?}");
        };
        assert!(
            matches!(
                e,
                ClientError::Stalled {
                    request: "GET /v1/status",
                    floor: MIN_PROGRESS,
                    window,
                } if window == timeout
            ),
            "{e}"
        );
        // The whole reply takes 40 bytes x 50 ms = 2 s; the first window ends 400 ms after
        // the first byte.
        assert!(took >= timeout && took < timeout * 3, "{took:?}");
        assert!(conn.sock.is_none(), "the connection is closed");
        node.join().unwrap();
    }

    #[test]
    fn a_large_answer_over_a_slow_link_that_keeps_moving_is_read_whole() {
        // 8 KiB in 256-byte pieces 25 ms apart, about 0.8 s: every 200 ms window brings some
        // 2 KiB against a floor of 256 bytes. Before, the whole response had to arrive within
        // its timeout plus its body at 1 MiB/s (208 ms here): a tensor over a slow shared link
        // failed on every try.
        let body = vec![7u8; 8 << 10];
        let head = raw_answer(200, "", &[]);
        let head = String::from_utf8(head)
            .unwrap()
            .replace("Content-Length: 0", "Content-Length: 8192");
        let pieces = std::iter::once(head.into_bytes()).chain(body.chunks(256).map(<[u8]>::to_vec));
        let (addr, node) = paced_node(pieces.collect(), Duration::from_millis(25));
        let mut conn = conn_to(addr, 256);
        let timeout = Duration::from_millis(200);
        let t0 = Instant::now();
        let route = "GET /v1/leases/{lease}/tensors/{name}";
        let r = conn.call_at_most(route, "/v1/leases/5/tensors/x", None, timeout, 8 << 10);
        let took = t0.elapsed();
        let reply = r.unwrap_or_else(|e| panic!("{e} after {took:?}"));
        assert_eq!(reply.body, body);
        assert!(took > timeout * 3, "it took several windows: {took:?}");
        node.join().unwrap();
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(encode_segment("img_0.x-y~"), "img_0.x-y~");
        assert_eq!(encode_segment("a b/c%é"), "a%20b%2Fc%25%C3%A9");
    }
}
