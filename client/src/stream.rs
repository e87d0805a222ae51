//! [`Stream`]: a stream on the node's trainer socket. One request at a time is written and its
//! answers are read in order; `next_after` asks for the following batches ahead of time (up to
//! [`NEXT_COUNT`] per request), so a training loop that releases as it goes finds its next batch
//! already read or on its way (docs/TRAINER_API.md, "Several batches per `next`").

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardwire_protocol::fdpass::{self, FrameIoError, ReadLimits, ReadPhase};
use shardwire_protocol::trainer::{
    self, BatchEncoding, MemoryKind, Request, Response, StreamState, binary,
};

use crate::resume::{ResumeState, with_state, with_unknown_state};
use crate::{Batch, ClientError, Dropped, Mapping, StreamInfo, StreamOptions, check_tensors};

mod connect;

/// Batches a `next` sent ahead of time asks for: the node answers with the first and, in the
/// same write, those already assembled after it, up to this many (it never waits for them).
pub const NEXT_COUNT: u32 = 8;

/// Longest time from an answer's first byte to its last (the node writes each answer whole).
#[cfg(not(test))]
const FRAME_LIMIT: Duration = Duration::from_secs(60);
/// Under test: a fake node writes each frame whole too.
#[cfg(test)]
const FRAME_LIMIT: Duration = Duration::from_secs(1);

/// How much longer than a `next` timeout the client waits for the node's own `timeout` answer.
#[cfg(not(test))]
const NODE_TIMEOUT_SLACK: Duration = Duration::from_secs(5);
/// Under test: a fake node that does not answer a timed request is given up on sooner.
#[cfg(test)]
const NODE_TIMEOUT_SLACK: Duration = Duration::from_millis(300);

/// How often a `next` that waits while the caller holds batches sends the leases of those
/// dropped meanwhile (on other threads) behind its request: the node applies them while the
/// request waits, which may be for their memory.
const HANDOFF_POLL: Duration = Duration::from_millis(100);

/// How long the answers the node sent before it closed the connection are read for, to find
/// its `error` saying why it closed it (they are all there already: nothing is waited for).
const CLOSING_READ: Duration = Duration::from_millis(100);

/// Longest wait for the answer to a `release` (the node answers at once).
#[cfg(not(test))]
const REPLY_LIMIT: Duration = Duration::from_secs(60);
#[cfg(test)]
const REPLY_LIMIT: Duration = Duration::from_millis(300);

/// Longest wait for the answer to `attach`: the node may first wait for its sources (5 s for
/// one to connect, 1 s for the rest), ask them all at once for the manifest (15 s at most)
/// and plan the stream, so this is generous; beyond it the node is stuck.
#[cfg(not(test))]
const ATTACH_LIMIT: Duration = Duration::from_secs(600);
/// Under test: long enough for a fake node's thread on a loaded machine, short for the test
/// of a node that never answers.
#[cfg(test)]
const ATTACH_LIMIT: Duration = Duration::from_secs(2);

/// A request whose answers are still to be read; the node answers in request order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Awaited {
    /// A `next`: one `batch` (or `end`, `error`) per answer, the last without `more`.
    Next,
    /// A `release` sent behind a `next` in flight.
    Release,
}

/// An open stream.
pub struct Stream {
    sock: UnixStream,
    region: Arc<Mapping>,
    reader: fdpass::FrameReader,
    frame: Vec<u8>,
    /// Requests whose answers are still to be read, oldest first.
    awaited: VecDeque<Awaited>,
    /// Leases given back through `next_after` while a `next` was in flight: they ride on the
    /// next request.
    deferred: Vec<u64>,
    /// The state JSON the last batch handed out carried (empty: none handed out yet, and the
    /// state the stream opened at has no fields this client does not know).
    resume: Vec<u8>,
    /// The state JSON of the batch answer read last, which becomes `resume` once that batch
    /// is handed out (a batch refused by its checks does not move the state past it).
    incoming: Vec<u8>,
    /// Batches handed out and not given back (`next_after`, `release`): while the caller
    /// holds any besides the one just handed out, nothing is asked for ahead.
    held: usize,
    /// The failure of the request sent ahead of time after the batch handed out last: that
    /// batch had come whole and was handed out; the next call returns this.
    lost: Option<ClientError>,
    /// Why the connection was closed after an answer that could not be read: every later
    /// call fails with it.
    broken: Option<String>,
    /// Leases of batches the caller dropped without giving them back.
    dropped: Dropped,
    /// The process that opened it: a child forked from it may not use it.
    pid: u32,
    /// Open-time information.
    pub info: StreamInfo,
}

/// The frame of the attach request `o`, resuming from `from` when given (in place of
/// `o.state`): its fields this client does not know go to the node as they came.
fn attach_frame(mut o: StreamOptions, from: Option<&ResumeState>) -> Vec<u8> {
    let mut frame = Vec::new();
    let Some(from) = from else {
        trainer::encode(&Request::Attach(Box::new(o)), &mut frame);
        return frame;
    };
    o.state = Some(from.known().clone());
    trainer::encode(&with_state(&Request::Attach(Box::new(o)), from), &mut frame);
    frame
}

/// Sends the attach request `frame` on `sock` and reads the answer's body (its fds pushed
/// onto `fds`). The answer may wait for the dataset's manifests (ATTACH_LIMIT); once it
/// starts, it arrives whole within FRAME_LIMIT, as every later frame (a node that stalls
/// halfway is not waited for ten minutes, or for ever a byte at a time).
fn attach<'a>(
    sock: &UnixStream,
    frame: &[u8],
    reader: &'a mut fdpass::FrameReader,
    fds: &mut Vec<OwnedFd>,
) -> Result<&'a [u8], ClientError> {
    // A node that refuses this trainer (peer allowlist) answers and closes; if the close wins
    // the race with our write, the write fails (EPIPE) but the refusal is still there to
    // read, and it is the better error.
    let sent = fdpass::send_frame(sock, frame, &[]);
    let limits = ReadLimits {
        idle: Some(ATTACH_LIMIT),
        frame: FRAME_LIMIT,
    };
    match (reader.read_timed(sock, fds, limits), sent) {
        (Ok(body), _) => Ok(body),
        (
            Err(FrameIoError::Timeout {
                phase: ReadPhase::Idle,
                ..
            }),
            Ok(()),
        ) => Err(ClientError::NoAnswer {
            request: "attach",
            after: ATTACH_LIMIT,
        }),
        (Err(_), Err(send_error)) => Err(send_error.into()),
        (Err(e), Ok(())) => Err(read_error(e)),
    }
}

/// A failed read of an answer as the client's error: a frame that began and did not end
/// within its limit is the node's answer stalled ([`ClientError::AnswerStalled`]; the frame
/// error's own words are the node's, "waiting for the rest of a request").
fn read_error(e: FrameIoError) -> ClientError {
    match e {
        FrameIoError::Timeout {
            phase: ReadPhase::Frame,
            limit,
        } => ClientError::AnswerStalled { after: limit },
        e => e.into(),
    }
}

/// Whether a send failed because the node closed the connection (or shut its reading side).
fn closed_by_node(e: &FrameIoError) -> bool {
    matches!(e, FrameIoError::Io(io) if matches!(
        io.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    ))
}

impl Stream {
    /// Connects to the node's trainer socket and opens a stream. Every batch reply carries
    /// its resume state (`batch_state`), in the binary encoding, whatever `o` says about
    /// those two: [`Stream::state`] reads it from there. A node that takes no connection
    /// within 10 s (its listen backlog full: stopped or stuck) fails it with
    /// [`ClientError::Connect`], as the Python SDK's `connect` does.
    pub fn open(path: impl AsRef<Path>, o: StreamOptions) -> Result<Self, ClientError> {
        Self::connect(path.as_ref(), o, None)
    }

    /// Like [`Stream::open`], resuming from `state` (a [`Stream::resume_state`] saved earlier,
    /// in place of `o.state`): the fields of it this client does not know are sent back to the
    /// node as they came (a node that does not know them either refuses the state, naming
    /// them).
    pub fn open_from(
        path: impl AsRef<Path>,
        o: StreamOptions,
        state: &ResumeState,
    ) -> Result<Self, ClientError> {
        Self::connect(path.as_ref(), o, Some(state))
    }

    fn connect(
        path: &Path,
        mut o: StreamOptions,
        from: Option<&ResumeState>,
    ) -> Result<Self, ClientError> {
        let sock = connect::connect(path, connect::CONNECT_LIMIT)?;
        o.batch_state = true;
        o.batch_encoding = BatchEncoding::Binary;
        let (mut reader, mut fds) = (fdpass::FrameReader::new(), Vec::new());
        let body = attach(&sock, &attach_frame(o, from), &mut reader, &mut fds)?;
        let (answer, opened_at) = decode_json(body)?;
        let Response::Attached {
            stream,
            region_size,
            batches_per_epoch,
            epochs,
            memory,
            gpu,
            state,
        } = answer
        else {
            return Err(match answer {
                Response::Error { code, message } => ClientError::Service { code, message },
                other => ClientError::Protocol(format!("unexpected answer to attach: {other:?}")),
            });
        };
        if memory != MemoryKind::Host {
            return Err(ClientError::UnsupportedMemory {
                memory: memory.to_string(),
                device: gpu.map_or_else(String::new, |g| format!(" on GPU {}", g.pci_bus_id)),
            });
        }
        let fd = region_fd(fds)?;
        if region_size == 0 {
            // As the Python SDK: a reply the node never sends, named (mmap would say EINVAL).
            return Err(ClientError::Protocol(
                "attached with a region of 0 bytes".into(),
            ));
        }
        let region = Arc::new(Mapping::new(&fd, region_size)?);
        Ok(Self {
            sock,
            region,
            reader,
            frame: Vec::with_capacity(256),
            awaited: VecDeque::new(),
            deferred: Vec::new(),
            // A state with fields this client does not know: kept whole for `resume_state`.
            resume: opened_at.map_or_else(Vec::new, |st| st.to_json().into_bytes()),
            incoming: Vec::new(),
            held: 0,
            lost: None,
            broken: None,
            dropped: Dropped::default(),
            pid: std::process::id(),
            info: StreamInfo {
                stream,
                batches_per_epoch,
                epochs,
                memory: memory.to_string(),
                state,
            },
        })
    }

    /// The next batch in plan order, or `None` when every epoch was delivered. Asks for one
    /// batch and nothing ahead (a caller that keeps batches leases no more than it takes),
    /// unless answers asked for ahead of time by [`Stream::next_after`] are still to come:
    /// then it takes the next of those.
    #[allow(clippy::should_implement_trait)] // fallible: an Iterator would have to hide errors
    pub fn next(&mut self) -> Result<Option<Batch>, ClientError> {
        self.take(None, false)
    }

    /// Like [`Stream::next`], failing with [`ClientError::Timeout`] when no batch came within
    /// `timeout`. A request sent by this call carries the timeout, so the node ends it and
    /// nothing stays in flight; when a request sent ahead of time is in flight, this waits
    /// `timeout` for its answer, and a later call takes it.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<Batch>, ClientError> {
        self.take(Some(timeout), false)
    }

    /// Gives `done` back and takes the next batch: the usual training loop. Asks ahead of
    /// time: once the batches already asked for are handed out, it sends the next request
    /// (for up to [`NEXT_COUNT`] batches, carrying the leases given back since the last one)
    /// before returning, so the node answers while the caller works on the batch. Besides the
    /// batch in hand, the node then holds up to `NEXT_COUNT` leases for this stream; closing
    /// the stream (dropping it) releases them, also while that request waits for data (the
    /// node looks at the connection about every 100 ms while it waits, and applies releases
    /// sent behind the request then). Nothing is asked for ahead while the caller holds other
    /// batches (taken with [`Stream::next`] and not released): they may fill the stream's
    /// memory, and the batches asked for would then wait for the caller's releases.
    pub fn next_after(&mut self, done: Batch) -> Result<Option<Batch>, ClientError> {
        self.own(&done)?;
        self.held = self.held.saturating_sub(1);
        self.deferred.push(done.into_lease());
        self.take(None, true)
    }

    /// Gives a batch's memory back to the service. With a request in flight (asked ahead of
    /// time) the release is sent behind it and its answer read later.
    pub fn release(&mut self, batch: Batch) -> Result<(), ClientError> {
        self.own(&batch)?;
        let lease = batch.into_lease();
        self.held = self.held.saturating_sub(1);
        if let Err(e) = self.usable().and_then(|()| self.settle()) {
            // Not sent: it rides on the next request, if there is one.
            self.deferred.push(lease);
            return Err(e);
        }
        self.send(&Request::Release { lease })?;
        if self.awaited.contains(&Awaited::Next) {
            self.awaited.push_back(Awaited::Release);
            return Ok(());
        }
        let answer = self.answer_at_once("release");
        self.released(answer)
    }

    /// The state to resume from: right after the last batch handed out (or the state the
    /// stream opened at), as the batch replies carry it: no request, and batches asked for
    /// ahead of time but not handed out are not counted. A state with fields this client
    /// does not know (a newer node's) is refused ([`ClientError::StateFieldsUnknown`]):
    /// [`Stream::resume_state`] keeps them.
    pub fn state(&mut self) -> Result<StreamState, ClientError> {
        self.resume_state()?.into_known()
    }

    /// The state to resume from, as [`Stream::state`], whole: fields this client does not
    /// know are kept, to go back to the node with [`Stream::open_from`]. What a trainer saves
    /// in its checkpoint.
    pub fn resume_state(&mut self) -> Result<ResumeState, ClientError> {
        if self.resume.is_empty() {
            return Ok(self.info.state.clone().into());
        }
        serde_json::from_slice(&self.resume)
            .map_err(|e| ClientError::Protocol(format!("a batch's resume state: {e}")))
    }

    /// One batch for the caller: from answers still to come, or from a new request (`ahead`:
    /// for up to NEXT_COUNT, and the next request goes out as soon as these are handed out).
    fn take(
        &mut self,
        timeout: Option<Duration>,
        ahead: bool,
    ) -> Result<Option<Batch>, ClientError> {
        let started = Instant::now();
        crate::same_process(self.pid)?;
        if let Some(e) = self.lost.take() {
            // The connection is gone: every later call fails with it too.
            return Err(self.broke(e));
        }
        self.usable()?;
        self.settle()?;
        self.take_dropped();
        let ahead = ahead && self.held == 0;
        let sent_now = self.awaited.front() != Some(&Awaited::Next);
        if sent_now {
            // It carries the caller's timeout: the node ends it, so nothing stays in flight.
            self.send_next(if ahead { NEXT_COUNT } else { 1 }, timeout)?;
        }
        // The node's own `timeout` answer ends a request sent now; the read waits a little
        // longer for it (if even that passes, the request stays in flight like one sent ahead).
        let wait = match sent_now {
            true => timeout.map(|t| t.saturating_add(NODE_TIMEOUT_SLACK)),
            false => timeout,
        };
        let answer = match self.next_answer(wait) {
            Ok(a) => a,
            Err(ClientError::Timeout(_)) => {
                return Err(ClientError::Timeout(timeout.unwrap_or_default()));
            }
            Err(e) => {
                if matches!(e, ClientError::Service { .. }) {
                    self.awaited.pop_front(); // an error is a request's last answer
                }
                return Err(e);
            }
        };
        let more = matches!(answer, Response::Batch { more: true, .. });
        if !more {
            self.awaited.pop_front();
        }
        match answer {
            Response::Batch {
                lease,
                epoch,
                index,
                shard,
                tensors,
                ..
            } => {
                let b = self.hand_out((lease, epoch, index, shard), tensors, ahead && !more)?;
                Ok(Some(b))
            }
            Response::End {} => {
                self.release_deferred()?;
                Ok(None)
            }
            // The node's late answer to a timed request an earlier call gave up waiting for:
            // this call asks again, within what is left of its own timeout (a timeout then is
            // still this call's, and names the timeout it was given).
            Response::Timeout {} if !sent_now => {
                let left = timeout.map(|t| t.saturating_sub(started.elapsed()));
                match self.take(left, ahead) {
                    Err(ClientError::Timeout(_)) => {
                        Err(ClientError::Timeout(timeout.unwrap_or_default()))
                    }
                    other => other,
                }
            }
            Response::Timeout {} => Err(ClientError::Timeout(timeout.unwrap_or_default())),
            // Which request the answers after it answer can no longer be told.
            other => Err(self.broke(unexpected("next", &other))),
        }
    }

    /// The next answer to the `next` in flight, within `wait` (None: as long as it takes).
    /// While the caller holds batches, another thread may drop one, and the request may wait
    /// for its memory: every [`HANDOFF_POLL`] the leases dropped meanwhile are sent behind the
    /// request, and the node applies them while it waits.
    fn next_answer(&mut self, wait: Option<Duration>) -> Result<Response, ClientError> {
        if self.held == 0 {
            return self.answer(wait);
        }
        // A wait past what the clock can hold (`Duration::MAX`) is a wait as long as it takes.
        let deadline = wait.and_then(|w| Instant::now().checked_add(w));
        loop {
            self.release_dropped_behind()?;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // At least one read, even with no time left: an answer already here is taken.
            match self.answer(Some(left.map_or(HANDOFF_POLL, |l| l.min(HANDOFF_POLL)))) {
                Err(ClientError::Timeout(_)) if left != Some(Duration::ZERO) => continue,
                Err(ClientError::Timeout(_)) => {
                    return Err(ClientError::Timeout(wait.unwrap_or_default()));
                }
                other => return other,
            }
        }
    }

    /// Sends the leases of batches dropped since the last request (and any others waiting for
    /// one) as releases of their own, behind the `next` in flight (their answers come after
    /// its own).
    fn release_dropped_behind(&mut self) -> Result<(), ClientError> {
        self.take_dropped();
        for lease in std::mem::take(&mut self.deferred) {
            self.send(&Request::Release { lease })?;
            self.awaited.push_back(Awaited::Release);
        }
        Ok(())
    }

    /// The batch of an answer (lease, epoch, index, shard) for the caller, its tensors checked
    /// against the region; `ask_ahead`: the next request goes out now, ahead of time.
    fn hand_out(
        &mut self,
        (lease, epoch, index, shard): (u64, u32, u64, u32),
        tensors: Vec<trainer::TensorView>,
        ask_ahead: bool,
    ) -> Result<Batch, ClientError> {
        if let Err(e) = check_tensors(&tensors, self.region.len()) {
            return Err(self.broke(e));
        }
        // Handed out: the state now resumes after it.
        std::mem::swap(&mut self.resume, &mut self.incoming);
        let b = Batch {
            lease,
            epoch,
            index,
            shard,
            tensors,
            region: Arc::clone(&self.region),
            dropped: Some(Arc::clone(&self.dropped)),
            pid: self.pid,
        };
        self.held += 1;
        // Answers to releases sent behind the request just finished are read, in order,
        // before the next one's. A connection lost by now does not cost this batch, which
        // came whole: the next call returns the error.
        if ask_ahead && let Err(e) = self.send_next(NEXT_COUNT, None) {
            self.lost = Some(e);
        }
        Ok(b)
    }

    /// At the end of the stream: nothing follows to carry the deferred releases, so one
    /// request each (at most NEXT_COUNT, once per stream).
    fn release_deferred(&mut self) -> Result<(), ClientError> {
        // Every release goes, even after one the node refuses (nothing follows to carry the
        // rest); the first refusal is returned once the last is answered. A connection that
        // fails ends it at once.
        let mut refused = None;
        while self.awaited.front() == Some(&Awaited::Release) {
            let answer = self.answer_at_once("release");
            self.awaited.pop_front();
            first_refusal(self.released(answer), &mut refused)?;
        }
        self.take_dropped();
        for lease in std::mem::take(&mut self.deferred) {
            self.send(&Request::Release { lease })?;
            let answer = self.answer_at_once("release");
            first_refusal(self.released(answer), &mut refused)?;
        }
        refused.map_or(Ok(()), Err)
    }

    /// Sends a `next` for up to `count` batches that the node ends after `timeout` (None:
    /// waits as long as it takes), carrying the deferred releases.
    fn send_next(&mut self, count: u32, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.frame.clear();
        let timeout_ms = timeout.map(crate::timeout_ms);
        trainer::encode_next(timeout_ms, &self.deferred, count, &mut self.frame);
        self.send_frame()?;
        self.deferred.clear();
        self.awaited.push_back(Awaited::Next);
        Ok(())
    }

    /// Gives back, with the next request, the leases of batches the caller dropped.
    fn take_dropped(&mut self) {
        let dropped = std::mem::take(&mut *self.dropped.lock().unwrap_or_else(|e| e.into_inner()));
        self.held = self.held.saturating_sub(dropped.len());
        self.deferred.extend(dropped);
    }

    /// Fails for a batch another stream handed out (the node would refuse its lease as
    /// unknown, and its own stream would never give it back); it goes back to its own stream
    /// when dropped.
    fn own(&self, batch: &Batch) -> Result<(), ClientError> {
        match Arc::ptr_eq(&batch.region, &self.region) {
            true => Ok(()),
            false => Err(ClientError::NotThisStream {
                lease: batch.lease,
                stream: self.info.stream,
            }),
        }
    }

    /// Fails in a process forked after the open ([`ClientError::Forked`]) and when an
    /// earlier answer could not be read ([`ClientError::Broken`]).
    fn usable(&self) -> Result<(), ClientError> {
        crate::same_process(self.pid)?;
        match &self.broken {
            Some(cause) => Err(ClientError::Broken {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Closes the connection after an answer that could not be read (`e`), so that nothing
    /// read later is taken for the answer to another request; returns `e`.
    fn broke(&mut self, e: ClientError) -> ClientError {
        if crate::same_process(self.pid).is_err() {
            return e; // the connection is the parent's too: a child must not shut it
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.broken = Some(e.to_string());
        e
    }

    /// Sends one request frame.
    fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        self.frame.clear();
        req.encode(&mut self.frame);
        self.send_frame()
    }

    /// Sends the request frame in `self.frame`. A node that ends the connection (its
    /// `trainer_idle_timeout_secs` passed, a bad request) first sends an `error` saying why,
    /// then closes it: the send finds it closed (EPIPE, ECONNRESET) with that error still to
    /// be read, behind the answers to the requests in flight. It is returned
    /// ([`ClientError::Service`]) in place of the broken pipe, which says nothing of why, as
    /// `attach` returns a refusal; either way the stream is broken.
    fn send_frame(&mut self) -> Result<(), ClientError> {
        let e = match fdpass::send_frame(&self.sock, &self.frame, &[]) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if !closed_by_node(&e) {
            return Err(e.into());
        }
        let why = self.closing_error().unwrap_or_else(|| e.into());
        Err(self.broke(why))
    }

    /// The `error` the node sent after the answers to every request in flight (`awaited`),
    /// before it closed the connection, read without waiting for more. An `error` among those
    /// answers answers its request (a release's `unknown_lease`): it is no reason for the
    /// close, which may have been a crash that sent none (then None: the broken pipe stands).
    /// Where the node closed in place of answering (more failed releases than it takes behind
    /// a `next`), its error answers the `next` and the releases stay unanswered: None too.
    fn closing_error(&mut self) -> Option<ClientError> {
        let limits = ReadLimits {
            idle: Some(Duration::ZERO),
            frame: CLOSING_READ,
        };
        let until = Instant::now() + CLOSING_READ;
        let mut unanswered = self.awaited.len();
        while Instant::now() < until {
            let Ok(body) = self.reader.read_data_timed(&self.sock, limits) else {
                break; // the close (or nothing more yet)
            };
            if unanswered > 0 {
                unanswered -= usize::from(ends_request(body));
                continue;
            }
            if body.first() == Some(&binary::BINARY_BATCH_TAG) {
                continue;
            }
            if let Ok(Response::Error { code, message }) = Response::decode(body) {
                return Some(ClientError::Service { code, message });
            }
        }
        None
    }

    /// Reads the answers of releases at the head of the awaited requests (an error among them
    /// is returned). Stops at a `next` still in flight.
    fn settle(&mut self) -> Result<(), ClientError> {
        while self.awaited.front() == Some(&Awaited::Release) {
            let answer = self.answer_at_once("release");
            self.awaited.pop_front();
            self.released(answer)?;
        }
        Ok(())
    }

    /// The answer to a request the node answers at once (`request`), within [`REPLY_LIMIT`];
    /// none in time: [`ClientError::NoAnswer`], and the connection is shut down, so that a
    /// late answer is never read as the answer to a later request.
    fn answer_at_once(&mut self, request: &'static str) -> Result<Response, ClientError> {
        match self.answer(Some(REPLY_LIMIT)) {
            Err(ClientError::Timeout(_)) => Err(self.broke(ClientError::NoAnswer {
                request,
                after: REPLY_LIMIT,
            })),
            other => other,
        }
    }

    /// The answer to a `release`: `released`, or the error it is; anything else closes the
    /// connection (which request the answers after it answer can no longer be told).
    fn released(&mut self, answer: Result<Response, ClientError>) -> Result<(), ClientError> {
        match answer? {
            Response::Released {} => Ok(()),
            other => Err(self.broke(unexpected("release", &other))),
        }
    }

    /// Reads one answer within `timeout` (None: as long as it takes); a batch's state JSON is
    /// kept undecoded, for [`Stream::state`] once that batch is handed out; an `error` answer
    /// is returned as the error.
    fn answer(&mut self, timeout: Option<Duration>) -> Result<Response, ClientError> {
        let limits = ReadLimits {
            idle: timeout,
            frame: FRAME_LIMIT,
        };
        let body = match self.reader.read_data_timed(&self.sock, limits) {
            Ok(body) => body,
            Err(FrameIoError::Timeout {
                phase: ReadPhase::Idle,
                ..
            }) => return Err(ClientError::Timeout(timeout.unwrap_or_default())),
            // Cut off, too large, or the connection gone: no answer after it can be matched.
            Err(e) => return Err(self.broke(read_error(e))),
        };
        match Self::decode(body, &mut self.incoming) {
            Ok(Response::Error { code, message }) => Err(ClientError::Service { code, message }),
            Ok(r) => Ok(r),
            Err(e) => Err(self.broke(e)),
        }
    }

    /// Decodes one answer; a batch's state JSON goes to `resume`, undecoded (and only once
    /// the whole answer has decoded).
    fn decode(body: &[u8], resume: &mut Vec<u8>) -> Result<Response, ClientError> {
        let older = || {
            ClientError::Protocol(
                "a batch without its state: the node service is older than this client".into(),
            )
        };
        if body.first() == Some(&binary::BINARY_BATCH_TAG) {
            let (batch, state) = binary::decode_batch_raw_state(body)
                .map_err(|e| ClientError::Protocol(format!("a binary batch: {e}")))?;
            let state = state.ok_or_else(older)?;
            resume.clear();
            resume.extend_from_slice(state);
            Ok(batch)
        } else {
            // JSON: every other answer, and a batch that does not fit the binary form.
            let (mut answer, whole) = decode_json(body)?;
            if let Response::Batch { state, .. } = &mut answer {
                let state = state.take().ok_or_else(older)?;
                resume.clear();
                match whole {
                    Some(whole) => serde_json::to_writer(&mut *resume, &whole),
                    None => serde_json::to_writer(&mut *resume, &state),
                }
                .expect("a stream state serialises");
            }
            Ok(answer)
        }
    }
}

/// Whether `body`, an answer, is its request's last: anything but a batch marked `more`
/// (another batch answering the same `next` follows). One that cannot be read counts as an
/// answer of its own.
fn ends_request(body: &[u8]) -> bool {
    let answer = match body.first() == Some(&binary::BINARY_BATCH_TAG) {
        true => binary::decode_batch(body).ok(),
        false => decode_json(body).ok().map(|(answer, _)| answer),
    };
    !matches!(answer, Some(Response::Batch { more: true, .. }))
}

/// Decodes a JSON answer; one whose state has fields this client does not know decodes with
/// its known ones, and that whole state is returned beside it (None: the answer has it all).
fn decode_json(body: &[u8]) -> Result<(Response, Option<ResumeState>), ClientError> {
    match Response::decode(body) {
        Ok(answer) => Ok((answer, None)),
        Err(e) => match with_unknown_state::<Response>(body) {
            Some((answer, whole)) => Ok((answer, Some(whole))),
            None => Err(FrameIoError::from(e).into()),
        },
    }
}

/// The region's fd from an `attached` answer, which carries exactly that one (any others
/// close when `fds` drops).
fn region_fd(mut fds: Vec<OwnedFd>) -> Result<OwnedFd, ClientError> {
    match (fds.pop(), fds.is_empty()) {
        (Some(fd), true) => Ok(fd),
        (last, _) => Err(ClientError::Protocol(format!(
            "attached came with {} file descriptors, expected the region's one",
            fds.len() + usize::from(last.is_some())
        ))),
    }
}

/// `r`, but a refusal by the node (`Service`) kept in `first` (the first one) instead.
fn first_refusal(
    r: Result<(), ClientError>,
    first: &mut Option<ClientError>,
) -> Result<(), ClientError> {
    match r {
        Err(e @ ClientError::Service { .. }) => {
            first.get_or_insert(e);
            Ok(())
        }
        other => other,
    }
}

fn unexpected(op: &str, answer: &Response) -> ClientError {
    ClientError::Protocol(format!("unexpected answer to {op}: {answer:?}"))
}

#[cfg(test)]
mod tests;
