//! The fetcher task of a stream: keeps its region full of fetch-ahead shards (credits = free
//! slabs), issues each FETCH on a live source (round-robin, avoiding the one that just failed
//! when another is up), and re-issues failed fetches. It wakes on a completion, on a freed
//! slab (the region's free upcall, only while it waits for memory), on the stream closing, and
//! (only while fetches wait for a source to come up) on a short retry timer.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use shardwire_gpu::Slab;
use tokio::sync::mpsc;

use super::assemble;
use super::kind::Kind;
use super::{Ready, Stream};
use crate::fetch::{Completion, Completions, FetchFailure, FetchRequest, InFlight};
use crate::link::SendError;

/// How often fetches that found no live source try again.
const RETRY: Duration = Duration::from_millis(100);

/// A fetch waiting to be issued (again).
pub(super) struct Retry {
    /// The stream position (shard mode) or the shard (batch mode) it is for.
    pub pos: u64,
    /// The shard.
    pub shard: u32,
    /// Its destination.
    pub slab: Slab,
    /// The link that just failed it.
    pub avoid: Option<usize>,
}

/// The link to send a fetch on: the first live one from `rr` on, skipping `avoid` when
/// another is up. `up[i]` says whether candidate `i` is up; returns its index.
pub fn pick_source(up: &[bool], avoid: Option<usize>, rr: usize) -> Option<usize> {
    let n = up.len();
    let order = (0..n).map(|k| (rr + k) % n);
    order
        .clone()
        .find(|&i| up[i] && Some(i) != avoid)
        .or_else(|| order.clone().find(|&i| up[i]))
}

/// Runs a shard-mode stream until it closes.
pub async fn run(s: Arc<Stream>, start: u64) {
    let Kind::Shards(order) = s.kind() else {
        unreachable!("the shard fetcher runs shard-mode streams");
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Completion>();
    let mut next_issue = start;
    let mut retry: VecDeque<Retry> = VecDeque::new();
    let mut rr = 0usize;
    let mut starved_since: Option<Instant> = None;
    loop {
        if s.is_closed() {
            return;
        }
        while let Some(r) = retry.pop_front() {
            if let Err(r) = issue(&s, &tx, r, &mut rr) {
                retry.push_front(r);
                break;
            }
        }
        while retry.is_empty() && next_issue < s.total {
            let shard = order.shard_at(next_issue);
            let len = s.manifest.shards[shard as usize].length as usize;
            // A shard with row tables is assembled behind its payload, in the same block.
            let block = assemble::plan_shard(&s.manifest, shard).map_or(len, |p| p.bytes as usize);
            // Announce the need before trying, so a free between the failed try and the
            // wait below leaves a permit instead of being missed.
            s.wants_memory.store(true, Ordering::SeqCst);
            let Some(mut slab) = s.pool.alloc(block) else {
                starved_since.get_or_insert_with(Instant::now);
                break;
            };
            slab.set_len(len); // the payload's length; within the block by construction
            s.wants_memory.store(false, Ordering::SeqCst);
            if let Some(t) = starved_since.take() {
                s.counters
                    .stall_trainer_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            let r = Retry {
                pos: next_issue,
                shard,
                slab,
                avoid: None,
            };
            next_issue += 1;
            if let Err(r) = issue(&s, &tx, r, &mut rr) {
                retry.push_back(r);
            }
        }
        tokio::select! {
            biased;
            _ = s.closed_notify.notified() => return,
            Some(c) = rx.recv() => completed(&s, c, &mut retry),
            _ = s.freed.notified() => {}
            _ = tokio::time::sleep(RETRY), if !retry.is_empty() => {}
        }
    }
}

/// A fetch ended: a verified shard goes to the stream, a failure is queued again. Once the
/// stream is closed (its cancels come back as failures) the slab is simply freed.
fn completed(s: &Stream, c: Completion, retry: &mut VecDeque<Retry>) {
    if s.is_closed() {
        return;
    }
    match c.result {
        Ok(()) => {
            metrics::histogram!("shardwire_fetch_duration_seconds")
                .record(c.issued.elapsed().as_secs_f64());
            let mut slab = c.slab;
            let tensors = match assemble::plan_shard(&s.manifest, c.shard) {
                None => None,
                Some(plan) => {
                    let filled = tokio::task::block_in_place(|| {
                        assemble::execute_in_place(&plan, &mut slab, s.gpu.as_deref())
                    });
                    if let Err(e) = filled {
                        tracing::error!(shard = c.shard, error = %e, "assembling a shard failed; closing the stream");
                        s.close(&format!("assembling shard {} failed: {e}", c.shard));
                        return;
                    }
                    Some(plan.views)
                }
            };
            s.complete(c.pos, Ready { slab, tensors });
        }
        Err(f) => {
            s.counters.refetches.fetch_add(1, Ordering::Relaxed);
            match &f {
                FetchFailure::Crc { got, want } => {
                    tracing::warn!(shard = c.shard, got, want, "refetching after CRC mismatch")
                }
                other => {
                    tracing::warn!(shard = c.shard, failure = %other, "refetching after a failed fetch")
                }
            }
            retry.push_back(Retry {
                pos: c.pos,
                shard: c.shard,
                slab: c.slab,
                avoid: Some(c.source),
            });
        }
    }
}

/// Sends a fetch on a live source; gives it back when none is up.
pub(super) fn issue(s: &Stream, tx: &Completions, r: Retry, rr: &mut usize) -> Result<(), Retry> {
    let (source, shard) = s.source_of(r.shard);
    let links = &source.candidates;
    let up: Vec<bool> = links.iter().map(|l| l.is_up()).collect();
    let avoid = r
        .avoid
        .and_then(|index| links.iter().position(|l| l.index == index));
    let Some(i) = pick_source(&up, avoid, *rr) else {
        return Err(r);
    };
    *rr = i + 1;
    let link = &links[i];
    let entry = &s.manifest.shards[r.shard as usize];
    let req = FetchRequest {
        slab: r.slab,
        pos: r.pos,
        shard: r.shard,
        length: entry.length,
        crc32c: entry.crc32c,
        stream: s.id,
    };
    let f = InFlight::new(req, link.index, tx.clone());
    let id = s.ids.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::debug!(req = id, shard = r.shard, pos = r.pos, source = %link.addr, "FETCH");
    link.fetch(id, &source.dataset, shard, f).map_err(|failed| {
        let (f, e) = *failed;
        if let SendError::Encode { .. } = e {
            // Names are checked when the stream opens, so this is a bug, not a retry.
            tracing::error!(error = %e, "cannot send a FETCH; closing the stream");
            s.close(&e.to_string());
        }
        Retry {
            pos: f.pos,
            shard: f.shard,
            slab: f.slab,
            avoid: r.avoid,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_over_live_sources() {
        let up = [true, true, true];
        assert_eq!(pick_source(&up, None, 0), Some(0));
        assert_eq!(pick_source(&up, None, 1), Some(1));
        assert_eq!(pick_source(&up, None, 5), Some(2));
        assert_eq!(pick_source(&[false, true, false], None, 2), Some(1));
        assert_eq!(pick_source(&[false, false], None, 0), None);
        assert_eq!(pick_source(&[], None, 0), None);
    }

    #[test]
    fn a_retry_avoids_the_source_that_failed_while_another_is_up() {
        assert_eq!(pick_source(&[true, true], Some(0), 0), Some(1));
        assert_eq!(pick_source(&[true, true, true], Some(1), 1), Some(2));
        // Only the failed one is up: it is tried again rather than waiting forever.
        assert_eq!(pick_source(&[true, false], Some(0), 0), Some(0));
    }
}
