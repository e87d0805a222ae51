//! Which source a shard is fetched from: rendezvous (highest-random-weight) hashing of the
//! dataset and shard over the sources that serve it, weighted and bounded so every source gets
//! an even share of the dataset's bytes. Every node computes the same placement from the same
//! inputs (the dataset's name and shard sizes, and the names of its sources), so a shard goes
//! to the same source from every node and that source's cache holds it. The weight is a fixed
//! function of the names (FNV-1a, then the splitmix64 finaliser), the same in every build.
//!
//! Plain rendezvous balances shard *counts* only in expectation (a source's share of S
//! shards among N sources varies by about sqrt(N / S), more when sizes vary), so [`balance`]
//! first finds one factor per source for a *weighted* rendezvous that evens out the bytes
//! ([`factors`]), then bounds what is left by moves: a source more than [`SLACK_PERCENT`]
//! above an even share gives its weakest claims to their next source with room, and a source
//! more than that below takes its strongest claims from sources that can spare them. Every
//! source then holds an even share of bytes within the slack (when no single shard is larger
//! than it). The price: a change of sources may move a few shards between the sources that
//! stayed, besides the lost (or new) source's slice, where the factors' margins shift; the
//! tests below measure it (on the e2e test's shape of 120 shards, over 200 layouts: 2 % of
//! the bytes on average and at worst 9 % when three sources become five, 1 % and at worst 5 %
//! when five become two; under 1 % at thousands of shards). No function of the set of sources alone can both bound bytes and never move a
//! survivor's shard (that would make each shard's choice independent of the other sources,
//! i.e. plain rendezvous).
//!
//! [`pick`] is the plain ranking, for a source that is down or just failed a fetch: the next
//! in the shard's ranking takes over, so only that source's shards move while it is away.

mod factors;

use std::cmp::Reverse;

/// How far from an even share of a dataset's bytes [`balance`] lets a source be.
pub const SLACK_PERCENT: u128 = 5;
/// [`SLACK_PERCENT`] as a fraction.
#[cfg(test)]
pub const SLACK: f64 = SLACK_PERCENT as f64 / 100.0;
/// Ranks remembered per shard for shedding and raising ([`balance`]'s passes).
const ALTERNATES: usize = 8;

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

/// One shard's best-ranked sources: (weight, index in `sources`), highest weight first.
type Ranking = Vec<(u64, u16)>;

/// The source of every shard (its index in `sources`) so that each source's bytes are within
/// [`SLACK_PERCENT`] of an even share. `sizes` are the dataset's shard sizes in bytes;
/// `sources` must be in the same order on every node (sorted names), since ties go to the
/// lower index.
///
/// Every shard starts at its source under weighted rendezvous ([`factors::owners`]), which
/// is usually within the bounds already; then a source over the cap sheds its *weakest*
/// claims (the shards it holds with the lowest weight) to their next-ranked source with room;
/// then a source under the floor takes the shards it is ranked for that their owners claim
/// weakest. A source that leaves made its shards the survivors' second-ranked ones, which are
/// weaker claims than the survivors' own, so the survivors shed those first and keep their
/// own: in practice only the lost slice moves (measured in the tests below).
pub fn balance(dataset: &str, sizes: &[u64], sources: &[&str]) -> Vec<u16> {
    let n = sources.len();
    assert!(n <= usize::from(u16::MAX), "{n} sources");
    if n <= 1 {
        return vec![0; sizes.len()];
    }
    let total: u128 = sizes.iter().map(|&b| u128::from(b)).sum();
    let share = |percent: u128| total * percent / (100 * n as u128);
    let bounds = (share(100 - SLACK_PERCENT), share(100 + SLACK_PERCENT));
    let ranks: Vec<Ranking> = (0..sizes.len())
        .map(|s| ranking(dataset, s as u32, sources))
        .collect();
    let costs: Vec<Vec<(f64, u16)>> = ranks
        .iter()
        .map(|r| r.iter().map(|&(w, i)| (factors::cost(w), i)).collect())
        .collect();
    let mut owner = factors::owners(sizes, &costs, n, SLACK_PERCENT as f64 / 100.0);
    let mut load = vec![0u128; n];
    for (s, &o) in owner.iter().enumerate() {
        load[usize::from(o)] += u128::from(sizes[s]);
    }
    let mut p = Pass {
        sizes,
        ranks: &ranks,
        owner: &mut owner,
        load: &mut load,
        bounds,
    };
    p.shed_heavy();
    p.raise_light();
    owner
}

/// The [`ALTERNATES`] best-ranked sources of `shard`.
fn ranking(dataset: &str, shard: u32, sources: &[&str]) -> Ranking {
    let mut r: Ranking = sources
        .iter()
        .enumerate()
        .map(|(i, name)| (weight(dataset, shard, name), i as u16))
        .collect();
    r.sort_unstable_by_key(|&(w, i)| (Reverse(w), i));
    r.truncate(ALTERNATES);
    r
}

/// The state of [`balance`]'s two passes.
struct Pass<'a> {
    sizes: &'a [u64],
    ranks: &'a [Ranking],
    owner: &'a mut [u16],
    load: &'a mut [u128],
    /// (floor, cap) of a source's bytes.
    bounds: (u128, u128),
}

impl Pass<'_> {
    /// The weight of the owner's claim on shard `s` (0 when it is not among its alternates).
    fn claim(&self, s: usize, source: u16) -> u64 {
        self.ranks[s]
            .iter()
            .find(|&&(_, i)| i == source)
            .map_or(0, |&(w, _)| w)
    }

    fn move_shard(&mut self, s: usize, to: u16) {
        let size = u128::from(self.sizes[s]);
        self.load[usize::from(self.owner[s])] -= size;
        self.load[usize::from(to)] += size;
        self.owner[s] = to;
    }

    /// Each source over the cap (in index order) gives its weakest claims to their next
    /// source with room, until it is within the cap.
    fn shed_heavy(&mut self) {
        let cap = self.bounds.1;
        for h in 0..self.load.len() as u16 {
            if self.load[usize::from(h)] <= cap {
                continue;
            }
            let mut held: Vec<(u64, usize)> = (0..self.owner.len())
                .filter(|&s| self.owner[s] == h)
                .map(|s| (self.claim(s, h), s))
                .collect();
            held.sort_unstable();
            for (_, s) in held {
                if self.load[usize::from(h)] <= cap {
                    break;
                }
                let size = u128::from(self.sizes[s]);
                let to = self.ranks[s]
                    .iter()
                    .map(|&(_, i)| i)
                    .find(|&i| i != h && self.load[usize::from(i)] + size <= cap);
                if let Some(to) = to {
                    self.move_shard(s, to);
                }
            }
        }
    }

    /// Each source under the floor (lightest first) takes, among the shards it is ranked for,
    /// those its owners claim weakest, from owners that stay at or above the floor, while it
    /// stays within the cap.
    fn raise_light(&mut self) {
        let (floor, cap) = self.bounds;
        let mut light: Vec<usize> = (0..self.load.len()).collect();
        light.sort_by_key(|&i| (self.load[i], i));
        for l in light.into_iter().map(|i| i as u16) {
            if self.load[usize::from(l)] >= floor {
                continue;
            }
            // The owners' weakest claims first: a survivor's own shards stay with it.
            let mut offers: Vec<(u64, usize)> = (0..self.owner.len())
                .filter(|&s| self.owner[s] != l && self.ranks[s].iter().any(|&(_, i)| i == l))
                .map(|s| (self.claim(s, self.owner[s]), s))
                .collect();
            offers.sort_unstable();
            for (_, s) in offers {
                if self.load[usize::from(l)] >= floor {
                    break;
                }
                let size = u128::from(self.sizes[s]);
                let o = usize::from(self.owner[s]);
                if self.load[o] >= floor + size && self.load[usize::from(l)] + size <= cap {
                    self.move_shard(s, l);
                }
            }
        }
    }
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

    /// Shard sizes as datasets have them, from a fixed seed (splitmix64; Box-Muller).
    fn sizes(kind: &str, shards: usize, seed: u64) -> Vec<u64> {
        let mut x = seed;
        let mut next = move || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..shards)
            .map(|_| match kind {
                // WebDataset tars / Arrow files written to a target size: all alike.
                "even" => 64 << 20,
                "uniform" => 8192 + (next() * 57_344.0) as u64,
                // Files of documents: sizes spread over a factor of ~10 around the median.
                "lognormal" => {
                    let g = (-2.0 * next().max(1e-12).ln()).sqrt()
                        * (2.0 * std::f64::consts::PI * next()).cos();
                    (100_000.0 * (0.6 * g).exp()) as u64 + 1
                }
                // Mostly small shards and some ten times larger (two sources mixed in one set).
                "bimodal" => {
                    let base = if next() < 0.1 { 1_000_000.0 } else { 100_000.0 };
                    (base * (0.9 + 0.2 * next())) as u64
                }
                other => unreachable!("{other}"),
            })
            .collect()
    }

    fn names(n: usize, salt: usize) -> Vec<String> {
        let mut v: Vec<String> = (0..n)
            .map(|i| format!("10.{salt}.0.{}:7500", i + 2))
            .collect();
        v.sort();
        v
    }

    fn loads(sizes: &[u64], owner: &[u16], n: usize) -> Vec<u64> {
        let mut l = vec![0u64; n];
        for (s, &o) in owner.iter().enumerate() {
            l[usize::from(o)] += sizes[s];
        }
        l
    }

    #[test]
    fn balance_holds_every_source_within_the_slack_over_realistic_sizes() {
        for kind in ["even", "uniform", "lognormal", "bimodal"] {
            for (shards, n) in [
                (64, 2),
                (300, 3),
                (300, 5),
                (2000, 8),
                (2000, 16),
                (20_000, 5),
            ] {
                let sizes = sizes(kind, shards, shards as u64 * 31 + n as u64);
                let names = names(n, shards % 7);
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let owner = balance("web", &sizes, &refs);
                let even = sizes.iter().sum::<u64>() as f64 / n as f64;
                let worst = loads(&sizes, &owner, n)
                    .iter()
                    .map(|&l| (l as f64 / even - 1.0).abs())
                    .fold(0.0, f64::max);
                // The bound holds where no shard is a large part of a share (the issue's "within
                // 10 %" is met with room to spare).
                let largest = *sizes.iter().max().unwrap() as f64 / even;
                if largest <= SLACK / 2.0 {
                    assert!(worst <= SLACK + 1e-9, "{kind} {shards}x{n}: {worst:.4}");
                } else {
                    assert!(worst <= SLACK + largest, "{kind} {shards}x{n}: {worst:.4}");
                }
            }
        }
    }

    /// (bytes of shards that moved between sources that stayed, bytes of the dataset).
    fn moved_between(
        sizes: &[u64],
        (before, a): (&[String], &[u16]),
        (after, b): (&[String], &[u16]),
        changed: &str,
    ) -> (u64, u64) {
        let mut moved = 0;
        for s in 0..sizes.len() {
            let (x, y) = (&before[usize::from(a[s])], &after[usize::from(b[s])]);
            if x != y && x != changed && y != changed {
                moved += sizes[s];
            }
        }
        (moved, sizes.iter().sum())
    }

    #[test]
    fn a_removed_source_gives_up_all_its_shards_and_few_others_move() {
        for (shards, limit) in [(300, 0.10), (2000, 0.05), (20_000, 0.015)] {
            let sizes = sizes("lognormal", shards, 5);
            let five = names(5, 1);
            let four: Vec<String> = five.iter().filter(|n| *n != &five[2]).cloned().collect();
            let r5: Vec<&str> = five.iter().map(String::as_str).collect();
            let r4: Vec<&str> = four.iter().map(String::as_str).collect();
            let (a, b) = (balance("web", &sizes, &r5), balance("web", &sizes, &r4));
            let (moved, total) = moved_between(&sizes, (&five, &a), (&four, &b), &five[2]);
            let share = moved as f64 / total as f64;
            assert!(
                share <= limit,
                "{shards} shards: {share:.4} of the bytes moved between the others"
            );
            // Every shard of the removed source found another.
            assert!(b.iter().all(|&o| usize::from(o) < 4));
        }
    }

    #[test]
    fn an_added_source_takes_about_one_nth_and_few_others_move() {
        let sizes = sizes("uniform", 2000, 9);
        let five = names(5, 2);
        let mut six = five.clone();
        six.push("10.2.0.99:7500".into());
        six.sort();
        let r5: Vec<&str> = five.iter().map(String::as_str).collect();
        let r6: Vec<&str> = six.iter().map(String::as_str).collect();
        let (a, b) = (balance("web", &sizes, &r5), balance("web", &sizes, &r6));
        let total: u64 = sizes.iter().sum();
        let new = six.iter().position(|n| n == "10.2.0.99:7500").unwrap();
        let taken = loads(&sizes, &b, 6)[new] as f64 / total as f64;
        assert!(
            (taken - 1.0 / 6.0).abs() <= SLACK / 6.0 + 1e-9,
            "{taken:.4}"
        );
        let (moved, _) = moved_between(&sizes, (&five, &a), (&six, &b), "10.2.0.99:7500");
        assert!(
            (moved as f64) / (total as f64) <= 0.05,
            "{moved} of {total}"
        );
    }

    #[test]
    fn balance_is_a_function_of_its_inputs_alone() {
        let sizes = sizes("bimodal", 500, 3);
        let n = names(4, 3);
        let r: Vec<&str> = n.iter().map(String::as_str).collect();
        assert_eq!(balance("web", &sizes, &r), balance("web", &sizes, &r));
        assert_ne!(balance("web", &sizes, &r), balance("code", &sizes, &r));
        assert_eq!(balance("web", &sizes, &r[..1]), vec![0; 500]);
        assert!(balance("web", &[], &r).is_empty());
    }

    /// The e2e test's shard sizes (tests/e2e/test_elastic.py): 120 shards of 20-200 KB.
    fn e2e_sizes() -> Vec<u64> {
        sizes("uniform", 120, 7)
            .iter()
            .map(|s| 20_000 + (s - 8192) * 180_000 / 57_344)
            .collect()
    }

    /// The e2e test's sources `127.0.0.2-6:PORT` for layout `k` (PORT = 40000 + k).
    fn e2e_sources(k: u16) -> Vec<String> {
        (2..7)
            .map(|i| format!("127.0.0.{i}:{}", 40_000 + k))
            .collect()
    }

    /// Each shard's source (by name) when `set` serves the dataset.
    fn place(sizes: &[u64], set: &[&String]) -> Vec<String> {
        let mut names: Vec<&str> = set.iter().map(|s| s.as_str()).collect();
        names.sort_unstable();
        let o = balance("ds", sizes, &names);
        o.iter()
            .map(|&i| names[usize::from(i)].to_owned())
            .collect()
    }

    /// The share of the bytes of the shards `pick` selects.
    fn share(sizes: &[u64], pick: impl Fn(usize) -> bool) -> f64 {
        let total = sizes.iter().sum::<u64>() as f64;
        (0..sizes.len())
            .filter(|&s| pick(s))
            .map(|s| sizes[s])
            .sum::<u64>() as f64
            / total
    }

    /// The e2e test's shape over `layouts` ports. Returns per layout (bytes to the two new
    /// sources when three become five, bytes moved between the three, bytes moved between
    /// the two that stay when five become two), as shares of the dataset.
    fn e2e_shape(layouts: u16) -> Vec<(f64, f64, f64)> {
        let sizes = e2e_sizes();
        (0..layouts)
            .map(|k| {
                let all = e2e_sources(k);
                let three = place(&sizes, &all.iter().take(3).collect::<Vec<_>>());
                let five = place(&sizes, &all.iter().collect::<Vec<_>>());
                let two = place(&sizes, &[&all[1], &all[3]]);
                let new = |s: usize| all[3..].contains(&five[s]);
                let to_new = share(&sizes, new);
                let between = share(&sizes, |s| three[s] != five[s] && !new(s));
                let stays = |s: usize| five[s] == all[1] || five[s] == all[3];
                let survivors = share(&sizes, |s| stays(s) && two[s] != five[s]);
                (to_new, between, survivors)
            })
            .collect()
    }

    #[test]
    fn three_of_five_leaving_one_by_one_move_few_shards_between_the_two() {
        // The e2e test's 5 -> 2: the three leave as the node sees each drain, so the
        // placements of every set of the two that stay and some of the three may follow each
        // other; the union of what they move between the two (what the e2e test counts).
        let sizes = e2e_sizes();
        let got: Vec<f64> = (0..100)
            .map(|k| {
                let all = e2e_sources(k);
                let five = place(&sizes, &all.iter().collect::<Vec<_>>());
                let (stay, gone) = ([&all[1], &all[3]], [&all[0], &all[2], &all[4]]);
                let mut moved = vec![false; sizes.len()];
                for subset in 0..7u8 {
                    let mut set: Vec<&String> = stay.to_vec();
                    set.extend((0..3).filter(|b| subset & (1 << b) != 0).map(|b| gone[b]));
                    let t = place(&sizes, &set);
                    for s in 0..sizes.len() {
                        moved[s] |= stay.contains(&&five[s]) && t[s] != five[s];
                    }
                }
                share(&sizes, |s| moved[s])
            })
            .collect();
        let worst = got.iter().copied().fold(0.0, f64::max);
        let mean = got.iter().sum::<f64>() / got.len() as f64;
        eprintln!("5 -> 2 one by one over 100 layouts: mean {mean:.4} worst {worst:.4}");
        // tests/e2e/test_elastic.py asserts <= 0.15 on one layout (measured: mean 3.5 %,
        // worst 12 %).
        assert!(worst <= 0.15 && mean <= 0.05, "{got:?}");
    }

    #[test]
    fn adding_two_sources_to_three_moves_few_shards_between_the_three() {
        let got = e2e_shape(200);
        let worst = |f: fn(&(f64, f64, f64)) -> f64| got.iter().map(f).fold(0.0, f64::max);
        let mean =
            |f: fn(&(f64, f64, f64)) -> f64| got.iter().map(f).sum::<f64>() / got.len() as f64;
        eprintln!(
            "3 -> 5 over 200 layouts: between the three mean {:.4} worst {:.4}; 5 -> 2: between the two mean {:.4} worst {:.4}",
            mean(|r| r.1),
            worst(|r| r.1),
            mean(|r| r.2),
            worst(|r| r.2)
        );
        for (to_new, _, _) in &got {
            assert!((to_new - 0.4).abs() <= 0.05, "{to_new:.4}");
        }
        // tests/e2e/test_elastic.py asserts these bounds on one layout (its port).
        assert!(worst(|r| r.1) <= 0.10 && mean(|r| r.1) <= 0.03, "{got:?}");
        assert!(worst(|r| r.2) <= 0.06 && mean(|r| r.2) <= 0.015, "{got:?}");
    }

    #[test]
    fn scaling_five_to_two_keeps_the_survivors_shards_where_they_were() {
        // The e2e test's shape (tests/e2e/test_elastic.py): 120 shards of 20-200 KB.
        let mut worst = 0.0f64;
        for seed in 0..20 {
            let sizes: Vec<u64> = sizes("uniform", 120, seed).iter().map(|s| s * 3).collect();
            let five = names(5, (seed % 5) as usize);
            let two: Vec<String> = vec![five[1].clone(), five[3].clone()];
            let r5: Vec<&str> = five.iter().map(String::as_str).collect();
            let r2: Vec<&str> = two.iter().map(String::as_str).collect();
            let (a, b) = (balance("ds", &sizes, &r5), balance("ds", &sizes, &r2));
            let mut moved = 0u64;
            for s in 0..sizes.len() {
                let (x, y) = (&five[usize::from(a[s])], &two[usize::from(b[s])]);
                if two.contains(x) && x != y {
                    moved += sizes[s];
                }
            }
            let share = moved as f64 / sizes.iter().sum::<u64>() as f64;
            worst = worst.max(share);
        }
        eprintln!("worst survivor-to-survivor move over 20 datasets: {worst:.4}");
        assert!(worst <= 0.05, "{worst:.4}");
    }
}
