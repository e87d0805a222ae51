//! The task of a shard-mode stream: keeps its region full of fetch-ahead shards (credits =
//! free slabs) through its [`Fetches`], and hands each verified shard to the stream (after
//! assembling its row tables, for shards that have them). It wakes on a completion, on a
//! freed slab (the region's free upcall, only while it waits for memory), on the stream
//! closing, and (only while fetches wait for a source to come up) on a short retry timer.

use std::sync::Arc;
use std::time::Duration;

use super::assemble;
use super::error::CloseReason;
use super::kind::Kind;
use super::supply::{Fetches, Links, Pending};
use super::{Ready, Stream};
use crate::fetch::Completion;

/// How often fetches that found no live source try again.
const RETRY: Duration = Duration::from_millis(100);

/// Runs a shard-mode stream until it closes.
pub async fn run(s: Arc<Stream>, start: u64) {
    let mut f = Fetches::new(Arc::clone(s.supply()), Box::new(Links));
    let mut next_issue = start;
    loop {
        if s.is_closed() {
            return;
        }
        if let Err(why) = f.reissue().and_then(|()| fill(&s, &mut f, &mut next_issue)) {
            s.close(why);
            return;
        }
        let supply = Arc::clone(s.supply());
        let retry = f.has_waiting();
        tokio::select! {
            biased;
            _ = s.closed() => return,
            Some(c) = f.completed() => {
                if let Err(why) = completed(&s, &mut f, c) {
                    s.close(why);
                    return;
                }
            }
            _ = supply.freed() => {}
            _ = tokio::time::sleep(RETRY), if retry => {}
        }
    }
}

/// Issues the next positions while memory allows and no earlier fetch waits for a source.
fn fill(s: &Stream, f: &mut Fetches, next_issue: &mut u64) -> Result<(), CloseReason> {
    let Kind::Shards(order) = s.kind() else {
        unreachable!("the shard fetcher runs shard-mode streams");
    };
    let manifest = Arc::clone(s.supply().manifest());
    while !f.has_waiting() && *next_issue < s.total() {
        let shard = order.shard_at(*next_issue);
        let len = manifest.shards[shard as usize].length as usize;
        // A shard with row tables is assembled behind its payload, in the same block.
        let block = assemble::plan_shard(&manifest, shard).map_or(len, |p| p.bytes as usize);
        let Some(mut slab) = f.alloc(block) else {
            break;
        };
        slab.set_len(len); // the payload's length; within the block by construction
        let pos = *next_issue;
        *next_issue += 1;
        f.fetch(Pending {
            pos,
            shard,
            slab,
            avoid: None,
            refused: Box::default(),
            not_before: None,
        })?;
    }
    // Done once every position is issued and none waits: its standing hints go.
    let done = *next_issue >= s.total() && !f.has_waiting();
    if f.hint_due(done) {
        let end = s.total();
        f.hint((*next_issue..end).map(|p| order.shard_at(p)));
    }
    Ok(())
}

/// A fetch ended: a verified shard goes to the stream, a failure waits to be fetched again.
/// Once the stream is closed (its cancels come back as failures) the slab is simply freed.
fn completed(s: &Stream, f: &mut Fetches, c: Completion) -> Result<(), CloseReason> {
    if s.is_closed() {
        return Ok(());
    }
    let (pos, shard) = (c.pos, c.shard);
    let Some(mut slab) = f.sort(c)? else {
        return Ok(());
    };
    let tensors = match assemble::plan_shard(s.supply().manifest(), shard) {
        None => None,
        Some(plan) => {
            tokio::task::block_in_place(|| assemble::execute_in_place(&plan, &mut slab, s.gpu()))
                .map_err(|error| {
                tracing::error!(shard, %error, "assembling a shard failed; closing the stream");
                CloseReason::Assembly {
                    what: format!("shard {shard}"),
                    error,
                }
            })?;
            Some(plan.views)
        }
    };
    s.complete(pos, Ready { slab, tensors });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::Next;
    use crate::stream::tests::{Fake, served_stream};

    /// The task's last round of hints came every [`super::super::hints::HINT_EVERY`]
    /// fetches, so the hints it sent before its last fetch stood (and the sources kept those
    /// shards in memory) until its trainer left. Now the fill that issues the last position
    /// withdraws them, while the task still runs.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_stream_that_issued_its_last_fetch_withdraws_its_hints_while_it_runs() {
        // 4 shards, 2 epochs, room for 2: the first fill hints the 6 positions after it.
        let s = served_stream(4, 2 * 4096, &["10.0.0.2:1", "10.0.0.3:1"]);
        let fake = Fake::default();
        let mut f = Fetches::new(Arc::clone(s.supply()), Box::new(fake.clone()));
        let (mut next_issue, mut ended) = (0, false);
        for _ in 0..100 {
            fill(&s, &mut f, &mut next_issue).unwrap();
            for (fetch, _) in fake.take() {
                let crc = fetch.crc32c;
                fetch.verified(crc);
            }
            while let Some(c) = f.try_completed() {
                completed(&s, &mut f, c).unwrap();
            }
            match s.next(Some(Duration::ZERO)) {
                Next::Batch(b) => assert!(s.release(b.lease)),
                Next::End => {
                    ended = true;
                    break;
                }
                Next::Timeout => {}
                Next::Closed(why) => panic!("closed: {why}"),
            }
        }
        assert!(ended, "the stream ended");
        let supply = s.supply();
        assert!(
            !supply.hinted_links().is_empty(),
            "hints were sent while fetches were left to issue"
        );
        // `f` still lives: what its drop withdraws does not count here.
        assert_eq!(
            supply.standing_hints(),
            Vec::<(usize, usize)>::new(),
            "every link hinted got an empty hint once the last fetch was issued"
        );
        drop(f);
    }
}
