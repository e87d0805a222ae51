//! A FETCH's payload while it waits in its session's queue: ready (a local file's range),
//! still being read from object storage by a task that fills it in and wakes the session, or
//! not started yet (its session's reads already hold as many bytes as it may: `session.rs`).

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::remote::read::Failure;
use crate::remote::{Served, Wanted};
use crate::sender::Body;

type Slot = Arc<Mutex<Option<Result<Body, Failure>>>>;

/// Where a queued FETCH's bytes are.
pub(crate) enum Payload {
    /// Ready to send.
    Ready(Body),
    /// Being read; the slot is filled when done. Dropping it (the FETCH was cancelled, or
    /// its session ended) stops the read.
    Reading(Slot, ReadTask),
    /// To be read from its dataset once the session's bound on reads allows (the FETCH
    /// counts as wanted meanwhile).
    Later(Wanted),
}

/// What a queued payload can do now.
pub(crate) enum Now {
    /// Send it.
    Send(Body),
    /// Answer the FETCH with this error.
    Fail(Failure),
    /// Wait.
    Wait(Payload),
}

impl Payload {
    /// Starts reading the shard of FETCH `wanted` for node session `session`; `progress` is
    /// notified when it is done.
    pub fn read(wanted: Wanted, session: u64, progress: Arc<Notify>) -> Self {
        let slot: Slot = Arc::default();
        let out = Arc::clone(&slot);
        let task = tokio::spawn(async move {
            let started = std::time::Instant::now();
            let got = wanted.get(session).await;
            let outcome = match got {
                Ok((body, served)) => {
                    let how = match served {
                        Served::Prefetched => "prefetched",
                        Served::Cached => "cached",
                        Served::Read => "read",
                    };
                    metrics::counter!("shardwire_source_remote_fetches_total", "served" => how)
                        .increment(1);
                    metrics::histogram!("shardwire_source_remote_fetch_wait_seconds")
                        .record(started.elapsed().as_secs_f64());
                    Ok(body)
                }
                Err(f) => Err(f),
            };
            *out.lock().expect("poisoned") = Some(outcome);
            progress.notify_one();
        });
        Payload::Reading(slot, ReadTask(task.abort_handle()))
    }

    /// Whether it can be sent, failed, or must wait.
    pub fn now(self) -> Now {
        match self {
            Payload::Ready(b) => Now::Send(b),
            Payload::Reading(slot, task) => {
                let taken = slot.lock().expect("poisoned").take();
                match taken {
                    Some(Ok(b)) => Now::Send(b),
                    Some(Err(f)) => Now::Fail(f),
                    None => Now::Wait(Payload::Reading(slot, task)),
                }
            }
            later @ Payload::Later(_) => Now::Wait(later),
        }
    }

    /// Whether it is ready or failed (without taking it).
    pub fn settled(&self) -> bool {
        match self {
            Payload::Ready(_) => true,
            Payload::Reading(slot, _) => slot.lock().expect("poisoned").is_some(),
            Payload::Later(_) => false,
        }
    }
}

/// The task reading a queued FETCH's shard: aborted when the FETCH no longer needs it (a
/// finished task is unaffected), so a node that cancels or leaves stops costing the store
/// requests. A read other FETCHes wait on is then read again by one of them.
pub(crate) struct ReadTask(tokio::task::AbortHandle);

impl Drop for ReadTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}
