//! Which source a shard is fetched from: rendezvous (highest-random-weight) hashing of the
//! dataset and shard over the sources that serve it. Every node ranks the sources of a shard
//! the same way, so a shard goes to the same source from every node and that source's cache
//! holds it; when a source is down or leaves, its shards move to their next-ranked source and
//! no other shard moves. The weight is a fixed function of the names (FNV-1a, then the
//! splitmix64 finaliser), the same in every build and process.

/// The weight of `source` for shard `shard` of `dataset`; the highest weight is preferred.
pub fn weight(dataset: &str, shard: u32, source: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    // A separator no name contains keeps ("ab", "c") and ("a", "bc") apart.
    let parts: [&[u8]; 5] = [
        dataset.as_bytes(),
        &[0xff],
        &shard.to_be_bytes(),
        &[0xff],
        source.as_bytes(),
    ];
    for b in parts.into_iter().flatten() {
        h = (h ^ u64::from(*b)).wrapping_mul(PRIME);
    }
    // splitmix64's finaliser: FNV's low bits alone mix poorly.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The source to fetch shard `shard` of `dataset` from: the highest-weighted one of
/// `sources` that is up (`up[i]`), passing over `avoid` (the one that just failed it) while
/// another is up. Returns its index in `sources`.
pub fn pick(
    dataset: &str,
    shard: u32,
    sources: &[&str],
    up: &[bool],
    avoid: Option<usize>,
) -> Option<usize> {
    let best = |skip: Option<usize>| {
        (0..sources.len())
            .filter(|&i| up[i] && Some(i) != skip)
            .max_by_key(|&i| (weight(dataset, shard, sources[i]), std::cmp::Reverse(i)))
    };
    best(avoid).or_else(|| best(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCES: [&str; 4] = ["s0:7500", "s1:7500", "s2:7500", "s3:7500"];

    fn owners(sources: &[&str], up: &[bool], shards: u32) -> Vec<usize> {
        (0..shards)
            .map(|s| pick("web", s, sources, up, None).unwrap())
            .collect()
    }

    #[test]
    fn the_same_names_give_the_same_choice_in_any_order() {
        let a = owners(&SOURCES, &[true; 4], 200);
        let mut rev = SOURCES;
        rev.reverse();
        let b = owners(&rev, &[true; 4], 200);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(SOURCES[*x], rev[*y]);
        }
        // A fixed value: the weight must not change between builds (nodes of different
        // versions must agree).
        assert_eq!(weight("web", 7, "s1:7500"), weight("web", 7, "s1:7500"));
        assert_ne!(weight("web", 7, "s1:7500"), weight("web", 7, "s2:7500"));
        assert_ne!(weight("ab", 7, "c"), weight("a", 7, "bc"));
    }

    #[test]
    fn shards_spread_evenly() {
        let n = 40_000;
        let mut count = [0usize; 4];
        for o in owners(&SOURCES, &[true; 4], n) {
            count[o] += 1;
        }
        for c in count {
            let share = c as f64 / f64::from(n);
            assert!((share - 0.25).abs() < 0.02, "{count:?}");
        }
    }

    #[test]
    fn a_source_that_goes_down_moves_only_its_shards() {
        let all = owners(&SOURCES, &[true; 4], 2000);
        let without = owners(&SOURCES, &[true, true, false, true], 2000);
        for (a, b) in all.iter().zip(&without) {
            if *a != 2 {
                assert_eq!(a, b, "a shard of a live source moved");
            } else {
                assert_ne!(*b, 2);
            }
        }
    }

    #[test]
    fn a_retry_avoids_the_source_that_failed_while_another_is_up() {
        let first = pick("web", 3, &SOURCES, &[true; 4], None).unwrap();
        let retry = pick("web", 3, &SOURCES, &[true; 4], Some(first)).unwrap();
        assert_ne!(first, retry);
        let mut only = [false; 4];
        only[first] = true;
        assert_eq!(pick("web", 3, &SOURCES, &only, Some(first)), Some(first));
        assert_eq!(pick("web", 3, &SOURCES, &[false; 4], None), None);
        assert_eq!(pick("web", 3, &[], &[], None), None);
    }
}
