//! The node's placements: for each dataset version, which source each shard is fetched
//! from ([`affinity::balance`]) over the sources that serve it now. Computed once per change
//! of those sources and shared by every stream of the node, so a scale event costs one pass
//! over the shard sizes, not one per stream and per fetch.

use std::collections::HashMap;
use std::sync::Mutex;

use super::affinity;

/// Placements kept at most (one per dataset version in use; the least recently used goes).
const KEPT: usize = 64;

/// One dataset version's placement over one set of sources.
#[derive(Debug)]
struct Table {
    /// The sources, sorted (every node sorts the same names the same way).
    sources: Vec<String>,
    /// The index in `sources` of each shard's source.
    owner: Vec<u16>,
    /// Last use, for eviction.
    used: u64,
}

/// The tables by (dataset, digest), with the clock their last use is read from.
type Tables = (u64, HashMap<(String, String), Table>);

/// The placements of the datasets the node's streams read.
#[derive(Debug, Default)]
pub struct Placements {
    tables: Mutex<Tables>,
}

impl Placements {
    /// The source of `shard` of dataset `dataset` (version `digest`) among `sources` (sorted
    /// names), as its index there; `sizes` gives the dataset's shard sizes when the placement
    /// must be computed (the first time, or after `sources` changed). `None`: no sources.
    pub fn owner(
        &self,
        (dataset, digest): (&str, &str),
        sources: &[&str],
        shard: u32,
        sizes: impl FnOnce() -> Vec<u64>,
    ) -> Option<usize> {
        if sources.is_empty() {
            return None;
        }
        debug_assert!(sources.is_sorted(), "{sources:?}");
        let key = (dataset.to_owned(), digest.to_owned());
        if let Some(o) = self.lookup(&key, sources, shard) {
            return o;
        }
        // Computed without the lock: other streams keep fetching meanwhile (two streams may
        // compute the same table once each; both get the same answer).
        let sizes = sizes();
        let owner = affinity::balance(dataset, &sizes, sources);
        tracing::info!(%dataset, shards = sizes.len(), sources = ?sources, "placement computed");
        let mut guard = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        let (clock, tables) = &mut *guard;
        *clock += 1;
        if tables.len() >= KEPT && !tables.contains_key(&key) {
            let oldest = tables
                .iter()
                .min_by_key(|(_, t)| t.used)
                .map(|(k, _)| k.clone());
            tables.remove(&oldest.expect("not empty"));
        }
        let got = owner.get(shard as usize).map(|&o| usize::from(o));
        let sources = sources.iter().map(|s| (*s).to_owned()).collect();
        let used = *clock;
        tables.insert(
            key,
            Table {
                sources,
                owner,
                used,
            },
        );
        got
    }

    /// The owner of `shard` from the table of `key` if it was computed over `sources`.
    fn lookup(
        &self,
        key: &(String, String),
        sources: &[&str],
        shard: u32,
    ) -> Option<Option<usize>> {
        let mut guard = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        let (clock, tables) = &mut *guard;
        *clock += 1;
        let t = tables.get_mut(key)?;
        if !t
            .sources
            .iter()
            .map(String::as_str)
            .eq(sources.iter().copied())
        {
            return None;
        }
        t.used = *clock;
        Some(t.owner.get(shard as usize).map(|&o| usize::from(o)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placement_is_computed_once_per_set_of_sources() {
        let p = Placements::default();
        let calls = std::cell::Cell::new(0);
        let sizes = || {
            calls.set(calls.get() + 1);
            vec![100; 50]
        };
        let ab = ["a:1", "b:1"];
        let first: Vec<usize> = (0..50)
            .map(|s| p.owner(("web", "d1"), &ab, s, sizes).unwrap())
            .collect();
        assert_eq!(calls.get(), 1);
        assert!(first.contains(&0) && first.contains(&1));
        // Another set: computed again; the same set again: not.
        p.owner(("web", "d1"), &["a:1", "b:1", "c:1"], 0, sizes);
        p.owner(("web", "d1"), &["a:1", "b:1", "c:1"], 1, sizes);
        assert_eq!(calls.get(), 2);
        // Another version of the dataset has its own placement.
        p.owner(("web", "d2"), &ab, 0, sizes);
        assert_eq!(calls.get(), 3);
        assert_eq!(p.owner(("web", "d1"), &[], 0, sizes), None);
        assert_eq!(p.owner(("web", "d1"), &ab, 50, sizes), None, "out of range");
    }

    #[test]
    fn the_least_recently_used_placement_goes_first() {
        let p = Placements::default();
        for d in 0..KEPT + 1 {
            p.owner(("web", &d.to_string()), &["a:1"], 0, || vec![1]);
        }
        let t = p.tables.lock().unwrap();
        assert_eq!(t.1.len(), KEPT);
        assert!(!t.1.contains_key(&("web".to_string(), "0".to_string())));
    }
}
