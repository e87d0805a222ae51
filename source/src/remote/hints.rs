//! What the nodes said they will fetch next (wire `Hint`), per stream: the order the source
//! prefetches in, and each shard's next use, by which its cache evicts (what is needed
//! furthest in the future goes first; what no hint names is needed "never" as far as the
//! source knows).
//!
//! Every operation costs what it touches, never all standing hints: a `Hint` the length of
//! its list, a FETCH the hints naming its shard and the entries it uses up, the prefetch
//! order what it reads of it. Each hint keeps how many of its entries are used up (`base`),
//! so an entry's position is its index less that, and using entries up moves nothing.

use std::collections::{HashMap, HashSet, VecDeque};

/// A hint's owner: (node session, the node's stream id).
pub type StreamKey = (u64, u64);

/// Most streams of one node session with a standing hint per dataset (a node has a stream per
/// trainer): past it, a new stream's hint is refused and the stream is fetched for without
/// one.
pub const MAX_HINTED_STREAMS: usize = 1024;

/// Most hinted entries one node session holds per dataset, over all its streams (memory: the
/// source keeps about 40 bytes per entry): a hint past it keeps its soonest entries only (the
/// prefetch never reads that far ahead of so many streams).
pub const MAX_HINTED_PER_SESSION: usize = 64 << 10;

/// A place in the prefetch order ([`Hints::order_after`]): a position in each hint, and a
/// stream; ordered as the order goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Place {
    /// The position in the stream's hint (0: its next shard).
    pub depth: usize,
    /// The stream.
    pub stream: StreamKey,
}

/// One stream's hint: the shards it names, soonest first, after the `base` used up.
#[derive(Debug)]
struct Hint {
    base: usize,
    shards: VecDeque<u32>,
}

/// The standing hints of one dataset.
#[derive(Debug, Default)]
pub struct Hints {
    lists: HashMap<StreamKey, Hint>,
    /// Streams whose hint was refused ([`MAX_HINTED_STREAMS`]), so it is reported once.
    refused: HashSet<StreamKey>,
    /// Each hinted shard's entries: (stream, index counted from the hint's start, `base`
    /// included), kept in step with `lists`.
    naming: HashMap<u32, Vec<(StreamKey, usize)>>,
    /// Entries per node session.
    per_session: HashMap<u64, usize>,
    /// Shards whose last entry went since the last [`Hints::take_unnamed`] (some may be named
    /// again since): the dataset looks at those of them in memory (no longer hinted, they may
    /// be dropped), not at every shard in memory.
    unnamed: Vec<u32>,
}

impl Hints {
    /// Replaces `key`'s hint (an empty list withdraws it; a shard named twice counts at its
    /// first place; one past the session's [`MAX_HINTED_PER_SESSION`] keeps its soonest
    /// entries). A new stream of a session that
    /// already has [`MAX_HINTED_STREAMS`] hints is refused: `Err` with that count the first
    /// time, `Ok` (and nothing done) after.
    pub fn set(&mut self, key: StreamKey, mut shards: Vec<u32>) -> Result<(), usize> {
        if !shards.is_empty() && !self.lists.contains_key(&key) {
            let of_session = self.lists.keys().filter(|(s, _)| *s == key.0).count();
            if of_session >= MAX_HINTED_STREAMS {
                // Each refused stream is reported once, up to as many as may hold a hint;
                // past that the session's new streams are refused silently, so a node naming
                // ever new stream ids does not grow this set.
                let of_session_refused = self.refused.iter().filter(|(s, _)| *s == key.0).count();
                let report = of_session_refused < MAX_HINTED_STREAMS && self.refused.insert(key);
                return if report { Err(of_session) } else { Ok(()) };
            }
        }
        self.remove(key);
        // A shard's next use is its first place; a hint naming it again (a node's bug, or
        // `[5; 1024]`) would add an entry to `naming` per repeat, and every later change to
        // the hint would walk them all under the dataset's lock.
        let mut seen = HashSet::with_capacity(shards.len());
        shards.retain(|&s| seen.insert(s));
        let held = self.per_session.get(&key.0).copied().unwrap_or(0);
        shards.truncate(MAX_HINTED_PER_SESSION.saturating_sub(held));
        if shards.is_empty() {
            return Ok(());
        }
        for (i, &s) in shards.iter().enumerate() {
            self.naming.entry(s).or_default().push((key, i));
        }
        *self.per_session.entry(key.0).or_default() += shards.len();
        let shards = shards.into();
        self.lists.insert(key, Hint { base: 0, shards });
        Ok(())
    }

    /// Drops `key`'s hint, if any.
    fn remove(&mut self, key: StreamKey) {
        let Some(h) = self.lists.remove(&key) else {
            return;
        };
        for (i, &s) in h.shards.iter().enumerate() {
            unname(&mut self.naming, &mut self.unnamed, s, (key, h.base + i));
        }
        self.count_off(key.0, h.shards.len());
    }

    /// `n` entries of `session` are gone.
    fn count_off(&mut self, session: u64, n: usize) {
        if let Some(c) = self.per_session.get_mut(&session) {
            *c -= n.min(*c);
            if *c == 0 {
                self.per_session.remove(&session);
            }
        }
    }

    /// Uses up `key`'s entries up to and including position `at`; a hint used up goes.
    fn use_up(&mut self, key: StreamKey, at: usize) {
        let Some(h) = self.lists.get_mut(&key) else {
            return;
        };
        let n = (at + 1).min(h.shards.len());
        for s in h.shards.drain(..n) {
            unname(&mut self.naming, &mut self.unnamed, s, (key, h.base));
            h.base += 1;
        }
        if h.shards.is_empty() {
            self.lists.remove(&key);
        }
        self.count_off(key.0, n);
    }

    /// Drops every hint of node session `session` (it ended).
    pub fn forget_session(&mut self, session: u64) {
        let keys: Vec<StreamKey> = self
            .lists
            .keys()
            .filter(|(s, _)| *s == session)
            .copied()
            .collect();
        for k in keys {
            self.remove(k);
        }
        self.refused.retain(|(s, _)| *s != session);
    }

    /// A FETCH of `shard` came for stream `key`: the hint's entries up to and including it
    /// are used up (the stream is past them).
    pub fn consumed(&mut self, key: StreamKey, shard: u32) {
        if let Some(at) = self.position(shard, |k| k == key) {
            self.use_up(key, at.0);
        }
    }

    /// A FETCH of `shard` came from node session `session`: the hint of the session's stream
    /// that names it soonest (a FETCH does not name its stream; that one most likely sent it)
    /// is used up to and including it. The session's other streams keep theirs: two trainers
    /// of one node reading one dataset may both need the shard, and draining every hint up to
    /// it dropped the other's nearer shards from the prefetch order and the cache's ranking.
    pub fn consumed_by_session(&mut self, session: u64, shard: u32) {
        if let Some((at, key)) = self.position(shard, |k| k.0 == session) {
            self.use_up(key, at);
        }
    }

    /// `shard`'s soonest position in the hints of the streams `of` picks, and that stream.
    fn position(&self, shard: u32, of: impl Fn(StreamKey) -> bool) -> Option<(usize, StreamKey)> {
        self.naming
            .get(&shard)?
            .iter()
            .filter(|(k, _)| of(*k))
            .map(|&(k, i)| (i - self.lists[&k].base, k))
            .min()
    }

    /// Streams with a standing hint.
    pub fn streams(&self) -> usize {
        self.lists.len()
    }

    /// How soon `shard` is needed: its smallest position in any hint (0 = next), `None`
    /// when no hint names it.
    pub fn next_use(&self, shard: u32) -> Option<usize> {
        self.position(shard, |_| true).map(|(at, _)| at)
    }

    /// Every hinted shard once, soonest first: position 0 of each hint, then position 1, ...
    /// (ties in stream order, so one stream does not starve another). Lazy: the prefetch
    /// reads only as far as its budget goes.
    pub fn order(&self) -> impl Iterator<Item = u32> + '_ {
        let mut seen = HashSet::new();
        self.order_after(None)
            .map(|(_, s)| s)
            .filter(move |&s| seen.insert(s))
    }

    /// Every entry of every hint in [`Self::order`]'s order, with its place, strictly after
    /// `after` (from the start with `None`); a shard several hints name comes once for each.
    /// Costs the number of streams to start and one step per entry: a hint used up leaves
    /// the rounds (counting every position up to the longest hint of every stream cost
    /// streams x longest, most of them empty, when hints differ in length).
    pub fn order_after(&self, after: Option<Place>) -> impl Iterator<Item = (Place, u32)> + '_ {
        let mut depth = after.map_or(0, |p| p.depth);
        let mut lists: Vec<(StreamKey, &VecDeque<u32>)> = self
            .lists
            .iter()
            .filter(|(_, h)| h.shards.len() > depth)
            .map(|(&k, h)| (k, &h.shards))
            .collect();
        lists.sort_unstable_by_key(|&(k, _)| k);
        // The round at `depth` goes on with the streams after `after`'s.
        let mut i = after.map_or(0, |p| lists.partition_point(|&(k, _)| k <= p.stream));
        std::iter::from_fn(move || {
            if i == lists.len() {
                depth += 1;
                lists.retain(|(_, l)| l.len() > depth);
                i = 0;
            }
            let &(stream, l) = lists.get(i)?;
            i += 1;
            Some((Place { depth, stream }, l[depth]))
        })
    }

    /// True when no hint stands.
    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }

    /// The shards whose last entry went since the last call (a hint replaced or withdrawn, a
    /// session forgotten, entries used up), each as often as that happened; some may be named
    /// again since (a hint replaced by one that names them too): ask [`Self::next_use`].
    pub fn take_unnamed(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.unnamed)
    }
}

/// Removes entry `entry` of `shard` from `naming`; `shard` goes to `unnamed` if that was its
/// last.
fn unname(
    naming: &mut HashMap<u32, Vec<(StreamKey, usize)>>,
    unnamed: &mut Vec<u32>,
    shard: u32,
    entry: (StreamKey, usize),
) {
    if let Some(v) = naming.get_mut(&shard) {
        if let Some(p) = v.iter().position(|e| *e == entry) {
            v.swap_remove(p);
        }
        if v.is_empty() {
            naming.remove(&shard);
            unnamed.push(shard);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(h: &Hints) -> Vec<u32> {
        h.order().collect()
    }

    #[test]
    fn next_use_is_the_soonest_position_over_all_streams() {
        let mut h = Hints::default();
        h.set((1, 1), vec![5, 6, 7]).unwrap();
        h.set((1, 2), vec![7, 8]).unwrap();
        assert_eq!(h.next_use(5), Some(0));
        assert_eq!(h.next_use(7), Some(0));
        assert_eq!(h.next_use(6), Some(1));
        assert_eq!(h.next_use(9), None);
        assert_eq!(order(&h), vec![5, 7, 6, 8]);
    }

    /// Each change lists the shards that lost their last entry, so the dataset looks at those
    /// in memory only (before, its prefetch task looked at every shard in memory at each wake).
    #[test]
    fn the_shards_that_lose_their_last_entry_are_listed() {
        let mut h = Hints::default();
        h.set((1, 1), vec![1, 2, 3]).unwrap();
        h.set((1, 2), vec![3, 4]).unwrap();
        assert!(h.take_unnamed().is_empty(), "nothing named went");
        h.set((1, 1), vec![2, 5]).unwrap();
        let mut gone = h.take_unnamed();
        gone.retain(|&s| h.next_use(s).is_none());
        assert_eq!(gone, [1], "2 is named again, 3 by the other stream");
        h.consumed_by_session(1, 5);
        assert_eq!(h.take_unnamed(), [2, 5], "used up");
        h.forget_session(1);
        assert_eq!(h.take_unnamed(), [3, 4]);
        assert!(h.take_unnamed().is_empty(), "taken");
    }

    #[test]
    fn a_new_hint_replaces_the_old_and_an_empty_one_withdraws_it() {
        let mut h = Hints::default();
        h.set((1, 1), vec![1, 2]).unwrap();
        h.set((1, 1), vec![3]).unwrap();
        assert_eq!(h.next_use(1), None);
        assert_eq!(order(&h), vec![3]);
        h.set((1, 1), vec![]).unwrap();
        assert!(h.is_empty());
    }

    #[test]
    fn a_shard_named_twice_in_a_hint_counts_once_at_its_first_place() {
        let mut h = Hints::default();
        h.set((1, 1), vec![5; 1024]).unwrap();
        assert_eq!(h.naming[&5].len(), 1, "entries naming shard 5");
        assert_eq!(h.per_session[&1], 1);
        h.set((1, 2), vec![6, 7, 6, 8, 7]).unwrap();
        assert_eq!(order(&h), vec![5, 6, 7, 8]);
        assert_eq!((h.next_use(6), h.next_use(8)), (Some(0), Some(2)));
        h.consumed((1, 2), 6);
        assert_eq!(h.next_use(6), None, "its only entry is used up");
        assert_eq!(h.next_use(8), Some(1));
    }

    #[test]
    fn the_order_goes_on_after_a_place_and_skips_used_up_hints() {
        let mut h = Hints::default();
        h.set((1, 1), vec![1, 2, 3, 4]).unwrap();
        h.set((1, 2), vec![9]).unwrap();
        h.set((2, 1), vec![5, 6, 9]).unwrap();
        let all: Vec<(Place, u32)> = h.order_after(None).collect();
        let shards: Vec<u32> = all.iter().map(|&(_, s)| s).collect();
        assert_eq!(shards, [1, 9, 5, 2, 6, 3, 9, 4], "every entry, repeats too");
        assert_eq!(order(&h), [1, 9, 5, 2, 6, 3, 4]);
        assert!(all.windows(2).all(|w| w[0].0 < w[1].0), "places ascend");
        for (k, &(at, _)) in all.iter().enumerate() {
            let rest: Vec<(Place, u32)> = h.order_after(Some(at)).collect();
            assert_eq!(rest, all[k + 1..], "after {at:?}");
        }
        // A place past a used-up hint's end, or of a stream that has gone, still goes on.
        let gone = Place {
            depth: 1,
            stream: (1, 5),
        };
        let rest: Vec<u32> = h.order_after(Some(gone)).map(|(_, s)| s).collect();
        assert_eq!(rest, [6, 3, 9, 4]);
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
        assert_eq!(order(&h), vec![3, 9]);
        h.consumed((1, 1), 42); // not hinted: nothing changes
        assert_eq!(h.next_use(3), Some(0));
        h.forget_session(1);
        assert_eq!(order(&h), vec![9]);
        h.set((3, 1), vec![4, 5]).unwrap();
        h.set((3, 2), vec![5, 6]).unwrap();
        h.consumed_by_session(3, 5);
        assert_eq!(
            order(&h),
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
        assert_eq!(order(&h), vec![5, 6, 30, 40]);
        assert_eq!((h.next_use(5), h.next_use(6)), (Some(0), Some(1)));
        assert_eq!(h.streams(), 1, "A's hint is used up");
        h.consumed_by_session(8, 5); // another session's FETCH: nothing changes
        assert_eq!(h.next_use(5), Some(0));
    }

    #[test]
    fn a_session_holds_a_bounded_number_of_entries() {
        let mut h = Hints::default();
        let long: Vec<u32> = (0..1024).collect();
        for stream in 0..(MAX_HINTED_PER_SESSION / 1024) as u64 {
            h.set((1, stream), long.clone()).unwrap();
        }
        // Full: another stream's hint keeps nothing, a replaced one what it had room for.
        h.set((1, 1 << 20), vec![5000]).unwrap();
        assert_eq!(h.next_use(5000), None);
        h.set((1, 0), (2000..3000).collect()).unwrap();
        assert_eq!(h.next_use(2999), Some(999));
        // Used up or withdrawn entries make room again; other sessions are not limited.
        h.consumed_by_session(1, 2499);
        h.set((1, 1 << 20), vec![5000, 5001]).unwrap();
        assert_eq!(h.next_use(5001), Some(1));
        h.set((2, 0), vec![6000]).unwrap();
        assert_eq!(h.next_use(6000), Some(0));
        h.forget_session(1);
        assert_eq!(h.per_session.get(&1), None);
        assert_eq!((h.streams(), h.naming.len()), (1, 1));
    }

    /// The positions kept up to date as entries are used up agree with positions counted
    /// from scratch over every hint (the old rerank), under random hints and fetches.
    #[test]
    fn positions_agree_with_a_recount_from_scratch() {
        let mut h = Hints::default();
        let mut model: HashMap<StreamKey, Vec<u32>> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..4000 {
            let key = (next(3), next(4));
            match next(4) {
                0 => {
                    let mut list: Vec<u32> = (0..next(12)).map(|_| next(20) as u32).collect();
                    h.set(key, list.clone()).unwrap();
                    // A shard named again counts at its first place only.
                    let mut seen = HashSet::new();
                    list.retain(|&s| seen.insert(s));
                    model.remove(&key);
                    if !list.is_empty() {
                        model.insert(key, list);
                    }
                }
                1 | 2 => {
                    let shard = next(20) as u32;
                    h.consumed_by_session(key.0, shard);
                    let soonest = model
                        .iter()
                        .filter(|((s, _), _)| *s == key.0)
                        .filter_map(|(k, l)| Some((l.iter().position(|&x| x == shard)?, *k)))
                        .min();
                    if let Some((at, k)) = soonest {
                        let l = model.get_mut(&k).unwrap();
                        l.drain(..=at);
                        if l.is_empty() {
                            model.remove(&k);
                        }
                    }
                }
                _ if next(10) == 0 => {
                    h.forget_session(key.0);
                    model.retain(|(s, _), _| *s != key.0);
                }
                _ => {}
            }
            for shard in 0..20 {
                let want = model
                    .values()
                    .filter_map(|l| l.iter().position(|&x| x == shard))
                    .min();
                assert_eq!(h.next_use(shard), want, "shard {shard}");
            }
            assert_eq!(h.streams(), model.len());
        }
        let entries: usize = model.values().map(Vec::len).sum();
        assert_eq!(h.per_session.values().sum::<usize>(), entries);
        assert_eq!(h.naming.values().map(Vec::len).sum::<usize>(), entries);
    }
}
