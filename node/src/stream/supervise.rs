//! The watch over a stream's task (its fetcher or batcher): what happens to the stream when
//! the task ends.

use std::sync::Arc;

use super::{CloseReason, Stream};

/// Waits for stream `s`'s task to end. A task that panicked closes its stream with the panic
/// for a reason (a trainer waiting gets `internal`, not a wait without end); a stream its task
/// closed (a shard that cannot be fetched, a failed assembly) has the fetches still queued
/// for it at the sources cancelled, as a close by its trainer does. Its region stays reserved
/// until its trainer lets go (it may still ask for `state`).
pub(crate) async fn supervise(task: tokio::task::JoinHandle<()>, s: Arc<Stream>) {
    if let Err(e) = task.await
        && e.is_panic()
    {
        let p = e.into_panic();
        let what = p
            .downcast_ref::<&str>()
            .map(|m| m.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        tracing::error!(stream = s.id(), panic = %what, "the stream's task panicked; closing the stream");
        s.close(CloseReason::Internal(format!(
            "the stream's task panicked ({what}): a bug in the node; please report it"
        )));
    }
    if s.is_closed() {
        let cancelled: usize = s.links().iter().map(|l| l.cancel_stream(s.id())).sum();
        if cancelled > 0 {
            tracing::info!(
                stream = s.id(),
                cancelled,
                "fetches of a closed stream cancelled at the sources"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::Next;

    #[tokio::test]
    async fn a_task_that_panics_closes_its_stream_with_the_panic_for_a_reason() {
        let s = crate::stream::tests::stream(4, 0);
        let task = tokio::spawn(async { panic!("position 7 out of range") });
        supervise(task, Arc::clone(&s)).await;
        let why = s.closed_reason().expect("closed");
        assert_eq!(why.code(), shardwire_protocol::trainer::ErrorCode::Internal);
        assert!(why.to_string().contains("position 7 out of range"), "{why}");
        assert!(
            matches!(s.next(None), Next::Closed(_)),
            "a waiting trainer is told"
        );
    }

    #[tokio::test]
    async fn a_task_that_ends_leaves_an_open_stream_open() {
        let s = crate::stream::tests::stream(4, 0);
        supervise(tokio::spawn(async {}), Arc::clone(&s)).await;
        assert!(!s.is_closed());
    }
}
