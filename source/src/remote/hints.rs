//! What the nodes said they will fetch next (wire `Hint`), per stream: the order the source
//! prefetches in, and each shard's next use, by which its cache evicts (what is needed
//! furthest in the future goes first; what no hint names is needed "never" as far as the
//! source knows).

use std::collections::HashMap;

/// A hint's owner: (node session, the node's stream id).
pub type StreamKey = (u64, u64);

/// Most streams of one node session with a standing hint per dataset (a node has a stream per
/// trainer; each hint costs a rerank over all of them): past it, a new stream's hint is
/// refused and the stream is fetched for without one.
pub const MAX_HINTED_STREAMS: usize = 1024;

/// The standing hints of one dataset.
#[derive(Debug, Default)]
pub struct Hints {
    lists: HashMap<StreamKey, Vec<u32>>,
    /// Streams whose hint was refused ([`MAX_HINTED_STREAMS`]), so it is reported once.
    refused: std::collections::HashSet<StreamKey>,
    /// Each hinted shard's smallest position, kept in step with `lists`.
    rank: HashMap<u32, usize>,
}

impl Hints {
    /// Replaces `key`'s hint (an empty list withdraws it). A new stream of a session that
    /// already has [`MAX_HINTED_STREAMS`] hints is refused: `Err` with that count the first
    /// time, `Ok` (and nothing done) after.
    pub fn set(&mut self, key: StreamKey, shards: Vec<u32>) -> Result<(), usize> {
        if shards.is_empty() {
            self.lists.remove(&key);
        } else {
            if !self.lists.contains_key(&key) {
                let of_session = self.lists.keys().filter(|(s, _)| *s == key.0).count();
                if of_session >= MAX_HINTED_STREAMS {
                    // Each refused stream is reported once, up to as many as may hold a
                    // hint; past that the session's new streams are refused silently, so a
                    // node naming ever new stream ids does not grow this set.
                    let of_session_refused =
                        self.refused.iter().filter(|(s, _)| *s == key.0).count();
                    let report =
                        of_session_refused < MAX_HINTED_STREAMS && self.refused.insert(key);
                    return if report { Err(of_session) } else { Ok(()) };
                }
            }
            self.lists.insert(key, shards);
        }
        self.rerank();
        Ok(())
    }

    fn rerank(&mut self) {
        self.rank.clear();
        for l in self.lists.values() {
            for (i, &s) in l.iter().enumerate() {
                let r = self.rank.entry(s).or_insert(i);
                *r = (*r).min(i);
            }
        }
    }

    /// Drops every hint of node session `session` (it ended).
    pub fn forget_session(&mut self, session: u64) {
        self.lists.retain(|(s, _), _| *s != session);
        self.refused.retain(|(s, _)| *s != session);
        self.rerank();
    }

    /// A FETCH of `shard` came for stream `key`: the hint's entries up to and including it
    /// are used up (the stream is past them).
    pub fn consumed(&mut self, key: StreamKey, shard: u32) {
        if let Some(list) = self.lists.get_mut(&key)
            && let Some(at) = list.iter().position(|&s| s == shard)
        {
            list.drain(..=at);
            self.rerank();
        }
    }

    /// A FETCH of `shard` came from node session `session`: the hint of the session's stream
    /// that names it soonest (a FETCH does not name its stream; that one most likely sent it)
    /// is used up to and including it. The session's other streams keep theirs: two trainers
    /// of one node reading one dataset may both need the shard, and draining every hint up to
    /// it dropped the other's nearer shards from the prefetch order and the cache's ranking.
    pub fn consumed_by_session(&mut self, session: u64, shard: u32) {
        let soonest = self
            .lists
            .iter()
            .filter(|((s, _), _)| *s == session)
            .filter_map(|(k, l)| Some((l.iter().position(|&x| x == shard)?, *k)))
            .min();
        let Some((at, key)) = soonest else { return };
        if let Some(list) = self.lists.get_mut(&key) {
            list.drain(..=at);
            if list.is_empty() {
                self.lists.remove(&key);
            }
        }
        self.rerank();
    }

    /// Streams with a standing hint.
    pub fn streams(&self) -> usize {
        self.lists.len()
    }

    /// How soon `shard` is needed: its smallest position in any hint (0 = next), `None`
    /// when no hint names it.
    pub fn next_use(&self, shard: u32) -> Option<usize> {
        self.rank.get(&shard).copied()
    }

    /// Every hinted shard once, soonest first: position 0 of each hint, then position 1, ...
    /// (ties in stream order, so one stream does not starve another).
    pub fn order(&self) -> Vec<u32> {
        let mut keys: Vec<&StreamKey> = self.lists.keys().collect();
        keys.sort();
        let longest = self.lists.values().map(Vec::len).max().unwrap_or(0);
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for i in 0..longest {
            for k in &keys {
                if let Some(&s) = self.lists[*k].get(i)
                    && seen.insert(s)
                {
                    out.push(s);
                }
            }
        }
        out
    }

    /// True when no hint stands.
    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_use_is_the_soonest_position_over_all_streams() {
        let mut h = Hints::default();
        h.set((1, 1), vec![5, 6, 7]).unwrap();
        h.set((1, 2), vec![7, 8]).unwrap();
        assert_eq!(h.next_use(5), Some(0));
        assert_eq!(h.next_use(7), Some(0));
        assert_eq!(h.next_use(6), Some(1));
        assert_eq!(h.next_use(9), None);
        assert_eq!(h.order(), vec![5, 7, 6, 8]);
    }

    #[test]
    fn a_new_hint_replaces_the_old_and_an_empty_one_withdraws_it() {
        let mut h = Hints::default();
        h.set((1, 1), vec![1, 2]).unwrap();
        h.set((1, 1), vec![3]).unwrap();
        assert_eq!(h.next_use(1), None);
        assert_eq!(h.order(), vec![3]);
        h.set((1, 1), vec![]).unwrap();
        assert!(h.is_empty());
    }

    #[test]
    fn a_session_hints_for_a_bounded_number_of_streams() {
        let mut h = Hints::default();
        for stream in 0..MAX_HINTED_STREAMS as u64 {
            h.set((1, stream), vec![1]).unwrap();
        }
        assert_eq!(h.set((1, 1 << 40), vec![2]), Err(MAX_HINTED_STREAMS));
        assert_eq!(h.set((1, 1 << 40), vec![3]), Ok(()), "reported once");
        assert_eq!(h.next_use(2), None, "the refused hint left no trace");
        assert_eq!(h.next_use(3), None);
        // Its streams may still replace their hints, and other sessions are not limited by it.
        h.set((1, 0), vec![3]).unwrap();
        h.set((2, 0), vec![4]).unwrap();
        assert_eq!((h.next_use(3), h.next_use(4)), (Some(0), Some(0)));
        // Ever new stream ids: reported up to the bound, then refused silently, and the
        // record of them stops growing.
        let base = 1u64 << 41;
        let reported = (0..3 * MAX_HINTED_STREAMS as u64)
            .filter(|&k| h.set((1, base + k), vec![5]).is_err())
            .count();
        assert_eq!(reported, MAX_HINTED_STREAMS - 1, "one was reported above");
        assert_eq!(h.refused.len(), MAX_HINTED_STREAMS);
        assert_eq!(h.next_use(5), None);
    }

    #[test]
    fn fetches_use_up_the_hint_and_sessions_are_forgotten_whole() {
        let mut h = Hints::default();
        h.set((1, 1), vec![1, 2, 3]).unwrap();
        h.set((2, 1), vec![9]).unwrap();
        h.consumed((1, 1), 2);
        assert_eq!(h.order(), vec![3, 9]);
        h.consumed((1, 1), 42); // not hinted: nothing changes
        assert_eq!(h.next_use(3), Some(0));
        h.forget_session(1);
        assert_eq!(h.order(), vec![9]);
        h.set((3, 1), vec![4, 5]).unwrap();
        h.set((3, 2), vec![5, 6]).unwrap();
        h.consumed_by_session(3, 5);
        assert_eq!(
            h.order(),
            vec![9, 4, 6, 5],
            "only (3, 2), which names 5 soonest"
        );
        assert_eq!(h.streams(), 3);
    }

    #[test]
    fn a_fetch_of_one_stream_leaves_another_streams_nearer_shards_hinted() {
        // Two trainers of one node read one dataset: A hints [10, 30], B [5, 6, 30, 40]. A's
        // FETCH of 30 used to drain B's hint up to 30 as well, so 5 and 6 lost their prefetch
        // and their cache ranking (and were read again when B fetched them).
        let mut h = Hints::default();
        h.set((7, 1), vec![10, 30]).unwrap();
        h.set((7, 2), vec![5, 6, 30, 40]).unwrap();
        h.consumed_by_session(7, 10);
        h.consumed_by_session(7, 30);
        assert_eq!(h.order(), vec![5, 6, 30, 40]);
        assert_eq!((h.next_use(5), h.next_use(6)), (Some(0), Some(1)));
        assert_eq!(h.streams(), 1, "A's hint is used up");
        h.consumed_by_session(8, 5); // another session's FETCH: nothing changes
        assert_eq!(h.next_use(5), Some(0));
    }
}
