//! A dataset's manifest, as a stream opens: asked of every source that is up, the first
//! answer chosen, and every answer recorded on its link ([`crate::link::served`]) so the
//! routing knows at once which sources serve that version (a source that serves another
//! version or none takes none of its shards). Sources that are still connecting (a node that
//! just started, a name that just resolved) get a moment first, so two nodes opening the same
//! dataset start from the same set of sources.

use std::sync::Arc;
use std::time::Duration;

use shardwire_protocol::Manifest;
use shardwire_protocol::trainer::ErrorCode;

use super::error::OpenError;
use crate::link::{ManifestError, SourceLink};
use crate::roster::Roster;

/// How long an open waits for a first source to be up.
pub const FIRST_UP: Duration = Duration::from_secs(5);
/// How long it then waits for the other known sources to be up.
pub const ALL_UP: Duration = Duration::from_secs(1);

/// A link's answer to a manifest request, and the session it asked in.
type Answer = (u64, Result<Vec<u8>, ManifestError>);

/// The manifest of `dataset` from the sources of `roster` (request ids from `next_id`).
pub async fn manifest_of(
    roster: &Roster,
    dataset: &str,
    next_id: &(dyn Fn() -> u64 + Sync),
) -> Result<Arc<Manifest>, OpenError> {
    wait_for_links(roster).await;
    let links: Vec<Arc<SourceLink>> = roster.links().into_iter().filter(|l| l.is_up()).collect();
    // Asked all at once: one source that keeps its session up but never answers costs an
    // open one MANIFEST_TIMEOUT, not one per source asked after it.
    let mut asked = tokio::task::JoinSet::new();
    for (i, l) in links.iter().enumerate() {
        let (l, req, dataset) = (Arc::clone(l), next_id(), dataset.to_owned());
        asked.spawn(async move {
            let generation = l.generation();
            (i, generation, l.request_manifest(req, &dataset).await)
        });
    }
    let mut answers: Vec<Option<Answer>> = links.iter().map(|_| None).collect();
    while let Some(done) = asked.join_next().await {
        if let Ok((i, generation, got)) = done {
            answers[i] = Some((generation, got));
        }
    }
    let mut errors = Vec::new();
    let mut chosen: Option<Arc<Manifest>> = None;
    // Negative answers are recorded only when some source serves the dataset: recorded for a
    // name no source serves (any name a trainer tries), they grew every link's table for ever.
    let mut refused = Vec::new();
    for (l, answer) in links.iter().zip(answers) {
        let Some((generation, got)) = answer else {
            errors.push(format!("{}: the request was lost", l.addr));
            continue;
        };
        match got.map(|json| Manifest::from_json(&json)) {
            Ok(Ok(m)) => {
                l.served.record(dataset, Some(m.digest.clone()), generation);
                match &chosen {
                    None => chosen = Some(Arc::new(m)),
                    Some(c) if c.digest == m.digest => {}
                    Some(c) => {
                        tracing::warn!(source = %l.addr, %dataset, theirs = %m.digest, ours = %c.digest, "source serves a different version of the dataset; not using it for this stream")
                    }
                }
            }
            Ok(Err(e)) => {
                refused.push((l, generation));
                errors.push(format!("{}: {e}", l.addr));
            }
            Err(e) => {
                if matches!(e, ManifestError::Refused { .. }) {
                    refused.push((l, generation));
                }
                errors.push(format!("{}: {e}", l.addr));
            }
        }
    }
    if chosen.is_some() {
        for (l, generation) in refused {
            l.served.record(dataset, None, generation);
        }
    }
    match chosen {
        Some(m) => Ok(m),
        None if errors.is_empty() => {
            let all: Vec<String> = roster.links().iter().map(|l| l.addr.clone()).collect();
            Err(OpenError::new(
                ErrorCode::Unavailable,
                format!("no source is connected (known: {})", all.join(", ")),
            ))
        }
        None => Err(OpenError::new(
            ErrorCode::UnknownDataset,
            format!(
                "dataset `{dataset}` is not available: {}",
                errors.join("; ")
            ),
        )),
    }
}

/// Waits up to [`FIRST_UP`] for a source to be up, then up to [`ALL_UP`] for the rest.
async fn wait_for_links(roster: &Roster) {
    let step = Duration::from_millis(50);
    let deadline = tokio::time::Instant::now() + FIRST_UP;
    while !roster.links().iter().any(|l| l.is_up()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(step).await;
    }
    let deadline = tokio::time::Instant::now() + ALL_UP;
    while !roster.links().iter().all(|l| l.is_up()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(step).await;
    }
}
