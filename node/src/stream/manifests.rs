//! A dataset's manifest, as a stream opens: asked of every source that is up, the first
//! answer chosen, and every answer recorded on its link ([`crate::link::served`]) so the
//! routing knows at once which sources serve that version (a source that serves another
//! version or none takes none of its shards). Sources that are still connecting (a node that
//! just started, a name that just resolved) get a moment first, so two nodes opening the same
//! dataset start from the same set of sources. A mixture's datasets are asked after one such
//! wait, [`AT_ONCE`] at a time: an open costs one wait, and one `MANIFEST_TIMEOUT` per
//! [`AT_ONCE`] datasets at most (longer while a large manifest is arriving:
//! [`crate::link::manifest_limit`]), while the raw JSON held at once stays that of [`AT_ONCE`]
//! datasets from each source (not that of all of a mixture's up to 256). A dataset no source
//! gives is `unknown_dataset` only where a source refused it for good; failures that may pass
//! (no answer in time, a link lost, a store throttled or unavailable) are `unavailable`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
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

/// Datasets of a mixture whose manifests are asked at the same time. Each request holds every
/// source's raw JSON (up to `MAX_FRAME`, 64 MiB) until its slowest source answers: all of a
/// 256-dataset mixture at once could hold tens of GB for one open. 16 keeps the largest
/// mixture (`MAX_MIX_DATASETS`, 256) under the SDKs' 10 min attach limit even with a source
/// that is up and never answers (16 rounds of the 30 s manifest timeout and its one 6 s look
/// again: 5 + 1 + 16 x 36 = 582 s). Not with a source
/// whose manifests arrive slowly: a request waits for a manifest it sees arriving as long as
/// its source may take to write it, 30 s plus 1 s per MiB ([`crate::link::manifest_limit`]),
/// so 16 rounds of large manifests (up to about 94 s each at 64 MiB) can outlast the limit.
pub const AT_ONCE: usize = 16;

/// A link's answer to a manifest request, and the session it asked in.
type Answer = (u64, Result<Vec<u8>, ManifestError>);

/// The manifests of `datasets` from the sources of `roster`, in the order given (request ids
/// from `next_id`): one wait for the sources ([`wait_for_links`]), then the datasets asked
/// [`AT_ONCE`] at a time. On a failure, the error of the first dataset in that order that
/// failed.
pub async fn manifests_of(
    roster: &Roster,
    datasets: &[&str],
    next_id: &(dyn Fn() -> u64 + Sync),
) -> Result<Vec<Arc<Manifest>>, OpenError> {
    wait_for_links(roster).await;
    // Made up front (a future does nothing until polled): a lazy `map` held across the await
    // makes the open's future not `Send` for every lifetime (a closure over `&&str`).
    let mut asked = Vec::with_capacity(datasets.len());
    for &d in datasets {
        asked.push(manifest_of(roster, d, next_id));
    }
    all_in_order(asked, AT_ONCE).await
}

/// Runs `futures`, `at_once` at a time (at least 1), started in the order given, and gives
/// their answers in that order. On a failure, the first in that order, as soon as every future
/// before it has answered (the rest are dropped, or never started: a mixture refused for its
/// first dataset does not wait for its last). Once any has failed no other is started, even
/// while one before it still runs: the outcome is an error either way.
async fn all_in_order<T, E, F>(
    futures: impl IntoIterator<Item = F>,
    at_once: usize,
) -> Result<Vec<T>, E>
where
    F: Future<Output = Result<T, E>>,
{
    let mut waiting = futures.into_iter();
    let mut started_all = false;
    // Index-aligned: a running future (`None` once answered), and its answer.
    let mut running: Vec<Option<Pin<Box<F>>>> = Vec::new();
    let mut done: Vec<Option<Result<T, E>>> = Vec::new();
    let mut in_flight = 0;
    let mut failed = false;
    std::future::poll_fn(|cx| {
        loop {
            while in_flight < at_once.max(1) && !started_all && !failed {
                match waiting.next() {
                    Some(f) => {
                        running.push(Some(Box::pin(f)));
                        done.push(None);
                        in_flight += 1;
                    }
                    None => started_all = true,
                }
            }
            let mut answered = false;
            for (slot, d) in running.iter_mut().zip(done.iter_mut()) {
                let Some(f) = slot.as_mut() else { continue };
                if let Poll::Ready(answer) = f.as_mut().poll(cx) {
                    failed |= answer.is_err();
                    *d = Some(answer);
                    *slot = None;
                    in_flight -= 1;
                    answered = true;
                }
            }
            // Settled once every answer is in, or a failure has every answer before it in.
            match done.iter().find(|d| !matches!(d, Some(Ok(_)))) {
                Some(Some(Err(_))) => return Poll::Ready(()),
                None if started_all => return Poll::Ready(()),
                // Room was made: start the next ones (and poll them, to be woken by them),
                // unless one failed (then only those before it are waited for).
                _ if answered => continue,
                _ => return Poll::Pending,
            }
        }
    })
    .await;
    drop(running); // what still runs after a failure
    // In order up to the first failure, which is the result if there is one.
    done.into_iter().flatten().collect()
}

/// The manifest of `dataset` from the sources of `roster` that are up now (request ids from
/// `next_id`).
async fn manifest_of(
    roster: &Roster,
    dataset: &str,
    next_id: &(dyn Fn() -> u64 + Sync),
) -> Result<Arc<Manifest>, OpenError> {
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
    // Whether some source's failure may pass (no answer, the link down or not up, a refusal
    // that passes): the dataset is then unknown only once that source has said so.
    let mut passing = false;
    let mut chosen: Option<Arc<Manifest>> = None;
    // Negative answers are recorded only when some source serves the dataset: recorded for a
    // name no source serves (any name a trainer tries), they grew every link's table for ever.
    let mut refused = Vec::new();
    for (l, answer) in links.iter().zip(answers) {
        let Some((generation, got)) = answer else {
            errors.push(format!("{}: the request was lost", l.addr));
            passing = true;
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
                refused.push((l, generation)); // a manifest it cannot read: for good
                errors.push(format!("{}: {e}", l.addr));
            }
            Err(e) => {
                if matches!(e, ManifestError::Refused { .. }) {
                    refused.push((l, generation));
                }
                passing |= !refuses_for_good(&e);
                errors.push(format!("{}: {e}", l.addr));
            }
        }
    }
    if chosen.is_some() {
        for (l, generation) in refused {
            l.served.record(dataset, None, generation);
        }
    }
    if chosen.is_none() && !errors.is_empty() {
        for l in roster.links().iter().filter(|l| !l.is_up()) {
            errors.push(format!("{}: not connected", l.addr));
            passing = true;
        }
    }
    chosen.ok_or_else(|| no_manifest(roster, dataset, &errors, !passing))
}

/// Whether a failed manifest request says the dataset cannot be had from that source (it
/// refused it, or the request cannot be sent or answered right), as opposed to a failure that
/// may pass: no answer in time, the link down, or a refusal that passes (a store throttled
/// or unavailable, a source draining).
fn refuses_for_good(e: &ManifestError) -> bool {
    use shardwire_protocol::wire::ErrorCode as C;
    match e {
        ManifestError::Down { .. } | ManifestError::Timeout { .. } => false,
        ManifestError::Refused { code, .. } => {
            !matches!(code, C::Throttled | C::StorageUnavailable | C::Draining)
        }
        ManifestError::Encode { .. } | ManifestError::WrongDataset { .. } => true,
    }
}

/// Why no manifest of `dataset` was chosen, given every source's failure (`errors`): no
/// source is up (none), every source refused it for good (`for_good`: `unknown_dataset`), or
/// some source's failure may pass (`unavailable`, which a trainer retries: it was
/// `unknown_dataset`, which says the name is wrong, though that source may serve it).
fn no_manifest(roster: &Roster, dataset: &str, errors: &[String], for_good: bool) -> OpenError {
    if errors.is_empty() {
        let all: Vec<String> = roster.links().iter().map(|l| l.addr.clone()).collect();
        return OpenError::new(
            ErrorCode::Unavailable,
            format!("no source is connected (known: {})", all.join(", ")),
        );
    }
    let errors = errors.join("; ");
    match for_good {
        true => OpenError::new(
            ErrorCode::UnknownDataset,
            format!("dataset `{dataset}` is not available: {errors}"),
        ),
        false => OpenError::new(
            ErrorCode::Unavailable,
            format!(
                "dataset `{dataset}`: no source gave its manifest, and not every source refused it for good ({errors}); attach again"
            ),
        ),
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

#[cfg(test)]
mod tests {
    use std::future::pending;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Barrier;
    use tokio::time::{Instant, sleep, timeout};

    use super::*;
    use crate::link::LinkConfig;

    fn roster(addrs: &[&str]) -> Roster {
        let r = Roster::new(LinkConfig {
            secret: None,
            lanes: vec![shardwire_protocol::wire::LaneAddr {
                data_addr: "127.0.0.1:1".parse().unwrap(),
                flows: 1,
            }],
        });
        for a in addrs {
            r.add(a, "config").unwrap();
        }
        r
    }

    /// Parts run at once (up to [`AT_ONCE`]): three parts that each wait for all three finish
    /// (asked one after another, the first waited for the others for ever), in the order given
    /// although they answer in reverse, in the time of the slowest.
    #[tokio::test(start_paused = true)]
    async fn parts_are_asked_at_once_and_answered_in_order() {
        let all_started = &Barrier::new(3);
        let parts = (0..3u64).map(|i| async move {
            all_started.wait().await;
            sleep(Duration::from_secs(10 * (3 - i))).await;
            Ok::<u64, String>(i)
        });
        let t = Instant::now();
        let got = timeout(Duration::from_secs(600), all_in_order(parts, AT_ONCE)).await;
        assert_eq!(got, Ok(Ok(vec![0, 1, 2])), "one after another never ends");
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(31),
            "the slowest part's 30 s, not {took:?}"
        );
    }

    /// The failure of the first part in order is the answer, not the first to come in, and it
    /// comes without waiting for parts after it (one that never answers, here).
    #[tokio::test(start_paused = true)]
    async fn the_first_failure_in_order_wins_without_waiting_for_later_parts() {
        type Part = Pin<Box<dyn Future<Output = Result<u32, &'static str>>>>;
        fn part(f: impl Future<Output = Result<u32, &'static str>> + 'static) -> Part {
            Box::pin(f)
        }
        let parts = vec![
            part(async { Ok(0) }),
            part(async {
                sleep(Duration::from_secs(5)).await;
                Err("second")
            }),
            part(async { Err("third") }),
            part(pending()),
        ];
        let t = Instant::now();
        let got = timeout(Duration::from_secs(600), all_in_order(parts, AT_ONCE)).await;
        assert_eq!(got, Ok(Err("second")));
        let took = t.elapsed();
        assert!(took < Duration::from_secs(6), "{took:?}");
    }

    /// A mixture's datasets were all asked at once: 256 of them, each holding up to 64 MiB of
    /// JSON per source until its slowest source answered. Now [`AT_ONCE`] run at a time, the
    /// next started as one answers, still answered in the order given; after a failure the
    /// parts not started yet never are.
    #[tokio::test(start_paused = true)]
    async fn at_most_at_once_parts_run_and_answer_in_order() {
        const AT: usize = 4; // fewer than the 10 parts (AT_ONCE is more)
        let (now, most) = (&AtomicUsize::new(0), &AtomicUsize::new(0));
        let parts = (0..10u64).map(|i| async move {
            let n = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(n, Ordering::SeqCst);
            sleep(Duration::from_secs(10 - i)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            Ok::<u64, String>(i)
        });
        let got = timeout(Duration::from_secs(600), all_in_order(parts, AT)).await;
        assert_eq!(got, Ok(Ok((0..10).collect::<Vec<u64>>())));
        assert_eq!(most.load(Ordering::SeqCst), AT, "all 10 at once before");
        let started = &AtomicUsize::new(0);
        let parts = (0..10u64).map(|i| async move {
            started.fetch_add(1, Ordering::SeqCst);
            sleep(Duration::from_secs(if i == 0 { 1 } else { 2 })).await;
            if i == 0 { Err(i) } else { Ok(i) }
        });
        let got = timeout(Duration::from_secs(600), all_in_order(parts, AT)).await;
        assert_eq!(got, Ok(Err(0)));
        assert_eq!(started.load(Ordering::SeqCst), AT, "none started after it");
    }

    /// A failure while a part before it still ran: the slots later answers freed kept
    /// starting parts (each a manifest request to every source) whose answers were thrown
    /// away. Now none starts once a failure is known, and the failure is the answer once the
    /// part before it is in.
    #[tokio::test(start_paused = true)]
    async fn no_part_starts_once_one_has_failed() {
        const AT: usize = 4;
        let started = &AtomicUsize::new(0);
        let parts = (0..20u64).map(|i| async move {
            started.fetch_add(1, Ordering::SeqCst);
            // Part 0 still runs when part 1 fails at once; the others answer after 1 s,
            // freeing slots.
            match i {
                0 => sleep(Duration::from_secs(30)).await,
                1 => return Err(i),
                _ => sleep(Duration::from_secs(1)).await,
            }
            Ok(i)
        });
        let t = Instant::now();
        let got = timeout(Duration::from_secs(600), all_in_order(parts, AT)).await;
        assert_eq!(got, Ok(Err(1)));
        assert_eq!(
            started.load(Ordering::SeqCst),
            AT,
            "only those started before the failure"
        );
        let took = t.elapsed();
        assert!(
            took >= Duration::from_secs(30),
            "waits for part 0: {took:?}"
        );
        assert!(took < Duration::from_secs(31), "{took:?}");
    }

    /// A mixture waits for its sources once, not once per dataset: with a source that never
    /// comes up, three datasets cost FIRST_UP + ALL_UP (three times that before).
    #[tokio::test(start_paused = true)]
    async fn a_mixture_waits_for_its_sources_once() {
        let r = roster(&["10.0.0.2:7500"]);
        let t = Instant::now();
        let e = manifests_of(&r, &["a", "b", "c"], &|| 1u64)
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable, "{}", e.message);
        let waited = t.elapsed();
        assert!(waited >= FIRST_UP + ALL_UP, "{waited:?}");
        assert!(
            waited < FIRST_UP + ALL_UP + Duration::from_secs(1),
            "{waited:?}"
        );
    }

    /// Datasets no source could be asked for: the error names the first in mix order. The
    /// link is up but has no control connection, so every request fails `Down`, which may
    /// pass: `unavailable` (retryable). Before: `unknown_dataset`, which says the name is wrong.
    #[tokio::test(start_paused = true)]
    async fn a_failed_mixture_names_its_first_dataset_and_a_lost_link_is_unavailable() {
        let r = roster(&["10.0.0.2:7500"]);
        r.links()[0].force_up(true);
        let e = manifests_of(&r, &["first", "second"], &|| 1u64)
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable, "{}", e.message);
        assert!(e.message.contains("`first`"), "{}", e.message);
        assert!(e.message.contains("not connected"), "{}", e.message);
    }

    /// A source that is not up when the others fail may serve the dataset: it is named, and
    /// the answer is `unavailable`, not `unknown_dataset` (as if every source had refused it).
    #[tokio::test(start_paused = true)]
    async fn a_source_not_up_makes_a_failed_manifest_unavailable_naming_it() {
        let r = roster(&["10.0.0.2:7500", "10.0.0.3:7500"]);
        r.links()[0].force_up(true);
        let e = manifests_of(&r, &["web"], &|| 1u64).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable, "{}", e.message);
        assert!(
            e.message.contains("10.0.0.3:7500: not connected"),
            "{}",
            e.message
        );
    }

    /// Only a refusal that does not pass (or a manifest that cannot be read) makes a dataset
    /// `unknown_dataset`; no answer in time, a link gone, or a passing refusal leave it
    /// `unavailable`.
    #[tokio::test]
    async fn only_a_refusal_for_good_makes_a_dataset_unknown() {
        use shardwire_protocol::wire::ErrorCode as C;
        let refused = |code| ManifestError::Refused {
            code,
            message: "m".into(),
        };
        let addr = "10.0.0.2:7500".to_owned();
        assert!(refuses_for_good(&refused(C::UnknownDataset)));
        let passing = [
            refused(C::Throttled),
            refused(C::StorageUnavailable),
            refused(C::Draining),
            ManifestError::Timeout {
                addr: addr.clone(),
                after: Duration::from_secs(30),
            },
            ManifestError::Down {
                addr: addr.clone(),
                reason: "the link went down".into(),
            },
        ];
        for e in &passing {
            assert!(!refuses_for_good(e), "{e}");
        }
        let r = roster(&[addr.as_str()]);
        let timed_out = [format!("{addr}: source {addr} did not answer within 30s")];
        let e = no_manifest(&r, "web", &timed_out, false);
        assert_eq!(e.code, ErrorCode::Unavailable, "{}", e.message);
        assert!(e.code.retryable());
        assert!(
            e.message.contains("not every source refused it"),
            "{}",
            e.message
        );
        let e = no_manifest(&r, "web", &timed_out, true);
        assert_eq!(e.code, ErrorCode::UnknownDataset, "{}", e.message);
    }
}
