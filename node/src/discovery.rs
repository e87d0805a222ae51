//! Finding sources: a configured `HOST:PORT` is one source for the node's life; a
//! `dns:NAME:PORT` entry stands for every address NAME resolves to (a Kubernetes headless
//! Service), resolved again every `source_resolve_secs` with the system resolver
//! (`getaddrinfo`: `/etc/resolv.conf`, its search domains and `ndots`). A new address gets a
//! link at once; an address that left the answer is retired: no new fetches go to it, and its
//! link stops when its outstanding fetches have ended (or after [`RETIRE_LIMIT`], failing
//! what is left, which the streams fetch again from the shards' next sources). A failed or
//! empty resolution keeps the previous answer (and says so in the log and in `/v1/status`),
//! so a DNS outage never empties the source tier.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use shardwire_config::SourceEntry;
use tokio::sync::watch;

use crate::link::{DataConns, Kick, SourceLink};
use crate::plane::DataPlane;
use crate::roster::{Member, Resolution, Roster};

/// How long one resolution may take before it counts as failed.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often draining sources are checked for an end of their fetches.
pub const TEND_EVERY: Duration = Duration::from_millis(100);
/// How long a retiring link waits for its outstanding fetches before it stops anyway.
pub const RETIRE_LIMIT: Duration = Duration::from_secs(30);

/// Why a name did not resolve.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The resolver failed (no such name, no answer, no server).
    #[error("resolving {name}: {source}")]
    Lookup {
        /// `NAME:PORT`.
        name: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// No answer within [`RESOLVE_TIMEOUT`].
    #[error("resolving {name}: no answer within {after:?}")]
    Timeout {
        /// `NAME:PORT`.
        name: String,
        /// The limit.
        after: Duration,
    },
    /// The name has no address.
    #[error("{name} resolves to no address")]
    Empty {
        /// `NAME:PORT`.
        name: String,
    },
}

/// The identities (`IP:PORT`) `lookup` (`NAME:PORT`) resolves to now, sorted.
pub async fn resolve(lookup: &str) -> Result<BTreeSet<String>, ResolveError> {
    let name = lookup.to_owned();
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(lookup))
        .await
        .map_err(|_| ResolveError::Timeout {
            name: name.clone(),
            after: RESOLVE_TIMEOUT,
        })?
        .map_err(|source| ResolveError::Lookup {
            name: name.clone(),
            source,
        })?;
    let mut set = identities(found);
    if set.is_empty() {
        return Err(ResolveError::Empty { name });
    }
    if set.len() > MAX_ADDRESSES_PER_NAME {
        tracing::warn!(%name, addresses = set.len(), kept = MAX_ADDRESSES_PER_NAME,
            "the name resolves to more addresses than a node links to; the rest are not used");
        set = at_most(set, MAX_ADDRESSES_PER_NAME);
    }
    Ok(set)
}

/// The first `n` of `set` in sorted order: the same on every node that gets the same answer.
fn at_most(set: BTreeSet<String>, n: usize) -> BTreeSet<String> {
    set.into_iter().take(n).collect()
}

/// Most addresses one `dns:` name gives links (each a control connection, its data
/// connections and two tasks): a wildcard or misconfigured record cannot make a node dial
/// thousands of them.
pub const MAX_ADDRESSES_PER_NAME: usize = 1024;

/// A source's identity from a resolved address: `IP:PORT` (`[IPv6]:PORT`), the same string
/// on every node that gets the same answer.
fn identities(addrs: impl IntoIterator<Item = SocketAddr>) -> BTreeSet<String> {
    addrs.into_iter().map(|a| a.to_string()).collect()
}

/// Starts the links of the configured addresses, and for the `dns:` entries a task that
/// resolves them every `every` until `shutdown`.
pub fn spawn(
    plane: &Arc<DataPlane>,
    entries: Vec<SourceEntry>,
    every: Duration,
    shutdown: &watch::Receiver<bool>,
) {
    let roster = &plane.roster;
    let mut names = Vec::new();
    for e in entries {
        match e {
            SourceEntry::Addr(addr) => {
                if let Some((link, stopped)) = roster.add(&addr, "config") {
                    start_link(plane, link, stopped, shutdown.clone());
                }
            }
            dns @ SourceEntry::Dns { .. } => names.push(dns),
        }
    }
    roster.set_resolutions(names.iter().map(Resolution::new).collect());
    tokio::spawn(tend(Arc::clone(plane), names, every, shutdown.clone()));
}

/// Runs a link until its member is stopped (retired) or the node shuts down.
fn start_link(
    plane: &Arc<DataPlane>,
    link: Arc<SourceLink>,
    mut stopped: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        // A sender gone means the same as true: nothing can keep the link alive any more.
        tokio::select! {
            _ = stopped.wait_for(|s| *s) => {}
            _ = shutdown.wait_for(|s| *s) => {}
        }
        let _ = stop.send(true);
    });
    let conns: Arc<dyn DataConns> = Arc::clone(plane) as Arc<dyn DataConns>;
    tokio::spawn(crate::link::run(link, conns, stop_rx));
}

/// Resolves every name every `every` and applies each answer to the roster; in between,
/// every [`TEND_EVERY`], ends the session of each draining source that has nothing
/// outstanding ([`end_drained`]).
async fn tend(
    plane: Arc<DataPlane>,
    names: Vec<SourceEntry>,
    every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(TEND_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_resolve = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        end_drained(&plane.roster);
        if names.is_empty() || tokio::time::Instant::now() < next_resolve {
            continue;
        }
        next_resolve = tokio::time::Instant::now() + every;
        for (i, entry) in names.iter().enumerate() {
            let Some(lookup) = entry.lookup() else {
                continue;
            };
            // Each name may take up to RESOLVE_TIMEOUT: a shutdown does not wait for them all.
            let answer = tokio::select! {
                a = resolve(&lookup) => a,
                _ = shutdown.wait_for(|s| *s) => return,
            };
            apply(&plane, &names, i, answer, &shutdown);
        }
    }
}

/// Ends the session of every source that said it is draining and has no fetch outstanding:
/// everything it took is in, and the source exits once its nodes have gone. The link then
/// tries to reconnect, which succeeds only if a new source takes the address.
fn end_drained(roster: &Roster) {
    for l in roster.links() {
        if l.is_draining() && l.is_up() && l.outstanding() == 0 {
            tracing::info!(source = %l.addr, fetches = l.fetches.load(std::sync::atomic::Ordering::Relaxed), "draining source has nothing outstanding; closing its session");
            l.kick(Kick::Drained);
        }
    }
}

/// Applies one resolution of `names[i]`: links for new addresses, retirement for addresses
/// no entry names any more. A failure keeps the previous answer.
fn apply(
    plane: &Arc<DataPlane>,
    names: &[SourceEntry],
    i: usize,
    answer: Result<BTreeSet<String>, ResolveError>,
    shutdown: &watch::Receiver<bool>,
) {
    let roster = &plane.roster;
    let entry = names[i].to_string();
    let (before, after) = match answer {
        Ok(set) => roster.resolved(i, Ok(set)),
        Err(e) => {
            let had = roster.resolved(i, Err(e.to_string())).0;
            tracing::warn!(entry = %entry, error = %e, keeping = had.len(), "source name did not resolve; keeping the sources it had");
            return;
        }
    };
    for addr in after.difference(&before) {
        if let Some((link, stopped)) = roster.add(addr, &entry) {
            tracing::info!(source = %addr, found_by = %entry, "source found");
            start_link(plane, link, stopped, shutdown.clone());
        }
    }
    let named = roster.named();
    for addr in before.difference(&after) {
        if named.contains(addr) {
            continue; // another entry still names it
        }
        if let Some(m) = roster.retire(addr) {
            tracing::info!(source = %addr, found_by = %entry, outstanding = m.link.outstanding(), "source left DNS; retiring it");
            tokio::spawn(retire(Arc::clone(roster), m));
        }
    }
}

/// Waits until a retiring link has no outstanding fetch (or [`RETIRE_LIMIT`]), then stops it
/// and takes it out of the roster, unless its address came back meanwhile.
async fn retire(roster: Arc<Roster>, m: Member) {
    let started = tokio::time::Instant::now();
    let link = &m.link;
    while link.is_retiring() && link.outstanding() > 0 && started.elapsed() < RETIRE_LIMIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = link.outstanding();
    if !roster.remove_if_retiring(link.index) {
        return; // its address came back: the link stays
    }
    m.stop();
    let bytes = link.bytes.load(std::sync::atomic::Ordering::Relaxed);
    let fetches = link.fetches.load(std::sync::atomic::Ordering::Relaxed);
    let waited_ms = started.elapsed().as_millis() as u64;
    if left > 0 {
        tracing::warn!(source = %link.addr, left, waited_ms, "retired source still had fetches; they are fetched again elsewhere");
    }
    tracing::info!(source = %link.addr, found_by = %m.found_by, bytes_received = bytes, fetches, waited_ms, "source retired");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_with_too_many_addresses_keeps_the_same_first_ones_everywhere() {
        let a: BTreeSet<String> = (0..2000u32)
            .rev()
            .map(|i| format!("10.{}.{}.1:7500", i / 256, i % 256))
            .collect();
        let kept = at_most(a.clone(), MAX_ADDRESSES_PER_NAME);
        assert_eq!(kept.len(), MAX_ADDRESSES_PER_NAME);
        assert_eq!(kept.first(), a.first());
        assert_eq!(
            kept,
            at_most(a.into_iter().rev().collect(), MAX_ADDRESSES_PER_NAME)
        );
    }

    #[test]
    fn identities_are_ip_and_port_sorted_and_unique() {
        let a: Vec<SocketAddr> = [
            "127.0.0.3:7500",
            "127.0.0.2:7500",
            "127.0.0.3:7500",
            "[::1]:7500",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let ids: Vec<String> = identities(a).into_iter().collect();
        assert_eq!(ids, ["127.0.0.2:7500", "127.0.0.3:7500", "[::1]:7500"]);
    }

    #[tokio::test]
    async fn the_system_resolver_answers_with_ip_and_port() {
        let ids = resolve("localhost:7500").await.expect("localhost resolves");
        assert!(ids.iter().all(|a| a.ends_with(":7500")), "{ids:?}");
        assert!(
            ids.contains("127.0.0.1:7500") || ids.contains("[::1]:7500"),
            "{ids:?}"
        );
        // (A name that does not resolve is tested end to end against a real DNS server,
        // tests/e2e/test_elastic.py: here it would wait for this machine's resolver.)
    }
}
