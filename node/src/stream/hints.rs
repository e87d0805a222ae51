//! Read-ahead hints: a stream tells the sources which shards it will fetch from each of them
//! next (wire `Hint`), so a source that reads from object storage can fetch them before the
//! FETCH comes and keep its cache by them. Each shard is hinted to the source its FETCH will
//! go to ([`super::affinity`]); a hint replaces the stream's previous one at that source, is
//! sent again after every [`HINT_EVERY`] fetches (so a source that reconnected or a horizon
//! that moved is caught up), and is withdrawn (an empty hint) when the stream's task ends,
//! stops sending to that source, or will fetch nothing more (a source keeps the shards a
//! standing hint names in memory: a stream that fetched its last shard but stays attached
//! pinned them until its trainer left).

use std::collections::BTreeMap;

/// Shards a stream hints ahead of the fetches it issued.
pub const HINT_AHEAD: usize = 256;
/// Fetches between two rounds of hints.
pub const HINT_EVERY: u64 = 32;

/// Where hints go: the stream's datasets and their links ([`super::supply::Supply`]).
pub trait HintTarget {
    /// The stream's id.
    fn stream(&self) -> u64;
    /// The dataset of manifest shard `shard` (its position in the stream) and the shard's
    /// index in it.
    fn locate(&self, shard: u32) -> (usize, u32);
    /// The link (its id) its FETCH of `wire_shard` of dataset `di` would go to now.
    fn link_for(&self, di: usize, wire_shard: u32) -> Option<usize>;
    /// Sends one hint; a link that is down drops it (the next round reaches it when it is up).
    fn send_hint(&self, di: usize, link: usize, shards: Vec<u32>);
}

/// One stream's hint state.
#[derive(Debug, Default)]
pub struct Hints {
    fetches: u64,
    last: Option<u64>,
    /// (dataset, link) pairs whose last hint was not empty.
    standing: Vec<(usize, usize)>,
}

impl Hints {
    /// A fetch was issued.
    pub fn fetched(&mut self) {
        self.fetches += 1;
    }

    /// Whether a new round of hints is due: every [`HINT_EVERY`] fetches, and at once when
    /// the stream will fetch nothing more (`done`) while a hint stands, so that round (with
    /// nothing upcoming) withdraws it.
    pub fn due(&self, done: bool) -> bool {
        self.last.is_none_or(|l| self.fetches >= l + HINT_EVERY)
            || (done && !self.standing.is_empty())
    }

    /// Sends a round: the first [`HINT_AHEAD`] shards of `upcoming` (stream manifest indices,
    /// soonest first), each to the link its FETCH would go to now; empty hints to the links
    /// that had one and get none now.
    pub fn send(&mut self, to: &dyn HintTarget, upcoming: impl Iterator<Item = u32>) {
        self.last = Some(self.fetches);
        let mut lists: BTreeMap<(usize, usize), Vec<u32>> = BTreeMap::new();
        for shard in upcoming.take(HINT_AHEAD) {
            let (di, wire_shard) = to.locate(shard);
            if let Some(link) = to.link_for(di, wire_shard) {
                lists.entry((di, link)).or_default().push(wire_shard);
            }
        }
        for &(di, link) in self.standing.iter().filter(|k| !lists.contains_key(k)) {
            to.send_hint(di, link, Vec::new());
        }
        self.standing = lists.keys().copied().collect();
        tracing::debug!(
            stream = to.stream(),
            sources = lists.len(),
            "read-ahead hints"
        );
        for ((di, link), shards) in lists {
            to.send_hint(di, link, shards);
        }
    }

    /// Withdraws every standing hint (the stream's task is ending).
    pub fn withdraw(&mut self, to: &dyn HintTarget) {
        for (di, link) in std::mem::take(&mut self.standing) {
            to.send_hint(di, link, Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// Two datasets of 100 shards each; shard s of a dataset goes to link s % 2.
    #[derive(Default)]
    struct Sent(RefCell<Vec<(usize, usize, Vec<u32>)>>);

    impl HintTarget for Sent {
        fn stream(&self) -> u64 {
            7
        }
        fn locate(&self, shard: u32) -> (usize, u32) {
            ((shard / 100) as usize, shard % 100)
        }
        fn link_for(&self, _di: usize, wire_shard: u32) -> Option<usize> {
            Some((wire_shard % 2) as usize)
        }
        fn send_hint(&self, di: usize, link: usize, shards: Vec<u32>) {
            self.0.borrow_mut().push((di, link, shards));
        }
    }

    #[test]
    fn each_link_gets_its_shards_in_order_and_stale_hints_are_withdrawn() {
        let to = Sent::default();
        let mut h = Hints::default();
        assert!(h.due(false));
        h.send(&to, [1, 2, 3, 104].into_iter());
        assert_eq!(
            to.0.take(),
            vec![(0, 0, vec![2]), (0, 1, vec![1, 3]), (1, 0, vec![4])]
        );
        assert!(!h.due(false));
        for _ in 0..HINT_EVERY {
            h.fetched();
        }
        assert!(h.due(false));
        // Dataset 1 is done and link 0 of dataset 0 gets nothing now: both withdrawn.
        h.send(&to, [5, 7].into_iter());
        assert_eq!(
            to.0.take(),
            vec![(0, 0, vec![]), (1, 0, vec![]), (0, 1, vec![5, 7])]
        );
        h.withdraw(&to);
        assert_eq!(to.0.take(), vec![(0, 1, vec![])]);
    }

    /// A stream that issued its last fetch sent no more rounds (one comes every
    /// [`HINT_EVERY`] fetches), so its last hints stood until its trainer left.
    #[test]
    fn a_stream_that_will_fetch_nothing_more_withdraws_its_hints_at_once() {
        let to = Sent::default();
        let mut h = Hints::default();
        h.send(&to, [1, 2].into_iter());
        to.0.take();
        h.fetched();
        h.fetched();
        assert!(!h.due(false), "two fetches: no round yet");
        assert!(h.due(true), "done with a hint standing: a round now");
        h.send(&to, std::iter::empty());
        assert_eq!(to.0.take(), vec![(0, 0, vec![]), (0, 1, vec![])]);
        assert!(!h.due(true), "nothing stands: no more rounds");
    }

    #[test]
    fn at_most_hint_ahead_shards_go_out() {
        let to = Sent::default();
        Hints::default().send(&to, 0..10_000);
        let n: usize = to.0.take().iter().map(|(_, _, s)| s.len()).sum();
        assert_eq!(n, HINT_AHEAD);
    }
}
