//! Read-ahead hints: a stream tells the sources which shards it will fetch from each of them
//! next (wire `Hint`), so a source that reads from object storage can fetch them before the
//! FETCH comes and keep its cache by them. Each shard is hinted to the source its FETCH will
//! go to ([`super::affinity`]); a hint replaces the stream's previous one at that source, is
//! sent again after every [`HINT_EVERY`] fetches (so a source that reconnected or a horizon
//! that moved is caught up), and is withdrawn (an empty hint) when the stream's task ends or
//! stops sending to that source.

use std::collections::BTreeMap;

use super::supply::Supply;

/// Shards a stream hints ahead of the fetches it issued.
pub const HINT_AHEAD: usize = 256;
/// Fetches between two rounds of hints.
pub const HINT_EVERY: u64 = 32;

/// One stream's hint state.
#[derive(Debug, Default)]
pub struct Hints {
    fetches: u64,
    last: Option<u64>,
    /// (dataset, link index) pairs whose last hint was not empty.
    standing: Vec<(usize, usize)>,
}

impl Hints {
    /// A fetch was issued.
    pub fn fetched(&mut self) {
        self.fetches += 1;
    }

    /// Whether a new round of hints is due.
    pub fn due(&self) -> bool {
        self.last.is_none_or(|l| self.fetches >= l + HINT_EVERY)
    }

    /// Sends a round: the first [`HINT_AHEAD`] shards of `upcoming` (stream manifest indices,
    /// soonest first), each to the link its FETCH would go to now; empty hints to the links
    /// that had one and get none now.
    pub fn send(&mut self, supply: &Supply, upcoming: impl Iterator<Item = u32>) {
        self.last = Some(self.fetches);
        let mut lists: BTreeMap<(usize, usize), Vec<u32>> = BTreeMap::new();
        for shard in upcoming.take(HINT_AHEAD) {
            let (di, source, wire_shard) = supply.dataset_of(shard);
            if let Some(link) = supply.preferred(source, wire_shard, None) {
                lists.entry((di, link)).or_default().push(wire_shard);
            }
        }
        let stale: Vec<(usize, usize)> = self
            .standing
            .iter()
            .filter(|k| !lists.contains_key(k))
            .copied()
            .collect();
        for key in stale {
            send(supply, key, Vec::new());
        }
        self.standing = lists.keys().copied().collect();
        tracing::debug!(
            stream = supply.stream(),
            sources = lists.len(),
            "read-ahead hints"
        );
        for (key, shards) in lists {
            send(supply, key, shards);
        }
    }

    /// Withdraws every standing hint (the stream's task is ending).
    pub fn withdraw(&mut self, supply: &Supply) {
        for key in std::mem::take(&mut self.standing) {
            send(supply, key, Vec::new());
        }
    }
}

/// Sends one hint; a link that is down drops it (the next round reaches it when it is up).
fn send(supply: &Supply, (di, link): (usize, usize), shards: Vec<u32>) {
    let source = supply.dataset(di);
    let l = &source.candidates[link];
    if let Err(e) = l.hint(supply.stream(), &source.dataset, shards) {
        tracing::debug!(source = %l.addr, error = %e, "hint not sent");
    }
}
