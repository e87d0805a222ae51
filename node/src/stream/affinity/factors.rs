//! Weighted rendezvous: one factor per source, found so that each shard's best *weighted*
//! source gives every source an even share of the dataset's bytes.
//!
//! A shard's cost at a source is `-ln(u)`, where `u` in (0, 1) is the shard's rendezvous
//! weight for that source; with factor `c`, the shard goes to the source of least
//! `-ln(u) / c` (the weighted rendezvous of Schindelhauer and Schomaker: a source's expected
//! share is proportional to its factor). All factors 1 is plain rendezvous. Starting there,
//! each round raises the factor of a source below an even share and lowers it above, by
//! [`STEP`] of the gap, until every source is within the slack or the rounds run out; the
//! best round is kept.
//!
//! Why factors and not moves: a source that holds more than its share under one set of sources
//! (its hash luck with this dataset's shards) still does after another source joins or leaves,
//! so its factor comes out about the same and the same marginal shards leave it. Shards then
//! move between the sources that stayed only near those margins, about half as much as when
//! each set's excess is shed shard by shard (measured on the e2e test's shape:
//! `adding_two_sources_to_three_moves_few_shards_between_the_three`).
//!
//! Every operation is an IEEE-754 add, multiply or divide (the logarithm is a fixed series, not
//! the platform's libm), so every node computes the same factors and the same placement.

/// Fraction of a source's gap to an even share its factor moves by per round.
const STEP: f64 = 0.1;
/// Rounds at most.
const ROUNDS: usize = 300;
/// Shard-source costs evaluated at most over all rounds (bounds the time on huge datasets;
/// a function of the shard and source counts only, so every node stops at the same round).
const WORK: usize = 64 << 20;

/// `-ln(u)` for the rendezvous weight `w`, with `u = (top 52 bits of w + 1/2) / 2^52`.
pub fn cost(w: u64) -> f64 {
    // 52 bits: (2^52 - 1/2) / 2^52 is below 1 in f64, so the cost is never 0.
    let u = ((w >> 12) as f64 + 0.5) / (1u64 << 52) as f64;
    -ln(u)
}

/// The natural logarithm of `x > 0` from IEEE basic operations only: `x = m * 2^e` with `m` in
/// [sqrt(1/2), sqrt(2)), then `ln m = 2 atanh((m - 1) / (m + 1))` by its series (|t| < 0.172:
/// 12 terms reach the last bit).
fn ln(x: f64) -> f64 {
    debug_assert!(x > 0.0 && x.is_finite(), "{x}");
    const LN2: f64 = std::f64::consts::LN_2;
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & ((1 << 52) - 1)) | (1023 << 52));
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        e += 1;
    }
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut sum = 0.0;
    for k in (0..12).rev() {
        sum = sum * t2 + 1.0 / f64::from(2 * k + 1);
    }
    2.0 * t * sum + e as f64 * LN2
}

/// The owner of every shard under weighted rendezvous with factors chosen so that each
/// source's bytes are within `slack` (a fraction) of an even share if the rounds allow.
/// `costs[s]` are shard `s`'s (cost, source index) over its best-ranked sources; `n` sources.
pub fn owners(sizes: &[u64], costs: &[Vec<(f64, u16)>], n: usize, slack: f64) -> Vec<u16> {
    let total: f64 = sizes.iter().map(|&b| b as f64).sum();
    let even = total / n as f64;
    let per_round = costs.iter().map(Vec::len).sum::<usize>().max(1);
    let rounds = (WORK / per_round).clamp(1, ROUNDS);
    let mut factor = vec![1.0f64; n];
    let mut owner = vec![0u16; sizes.len()];
    let mut best: (f64, Vec<u16>) = (f64::INFINITY, Vec::new());
    let mut load = vec![0.0f64; n];
    for _ in 0..rounds {
        load.iter_mut().for_each(|l| *l = 0.0);
        for (s, c) in costs.iter().enumerate() {
            let o = c
                .iter()
                .map(|&(cost, i)| (cost / factor[usize::from(i)], i))
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
                .map_or(0, |(_, i)| i);
            owner[s] = o;
            load[usize::from(o)] += sizes[s] as f64;
        }
        let worst = load
            .iter()
            .map(|&l| (l / even - 1.0).abs())
            .fold(0.0, f64::max);
        if worst < best.0 {
            best = (worst, owner.clone());
        }
        if worst <= slack {
            break;
        }
        for (f, &l) in factor.iter_mut().zip(&load) {
            let gap = (even / l.max(even / 4.0)).min(4.0) - 1.0;
            *f *= 1.0 + STEP * gap;
        }
        let mean = factor.iter().sum::<f64>() / n as f64;
        factor.iter_mut().for_each(|f| *f /= mean);
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ln_matches_the_platform_within_a_few_ulps() {
        for x in [
            1e-300, 1e-16, 0.001, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 7.0, 1e10,
        ] {
            let (a, b) = (ln(x), f64::ln(x));
            assert!(
                (a - b).abs() <= 4.0 * f64::EPSILON * b.abs().max(1.0),
                "{x}: {a} vs {b}"
            );
        }
        assert_eq!(ln(1.0), 0.0);
    }

    #[test]
    fn costs_are_positive_and_order_like_the_weights() {
        assert!(cost(u64::MAX) > 0.0 && cost(0).is_finite());
        assert!(cost(u64::MAX) < cost(1 << 63) && cost(1 << 63) < cost(1 << 20));
    }

    #[test]
    fn factors_even_out_a_skewed_start() {
        // 400 shards of one size; source 0 costs half as much (plain rendezvous gives it about
        // two thirds).
        let sizes = vec![10u64; 400];
        let w = |s: u64, k: u64| (s * 2 + k + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let costs: Vec<Vec<(f64, u16)>> = (0..400)
            .map(|s| vec![(cost(w(s, 0)) / 2.0, 0), (cost(w(s, 1)), 1)])
            .collect();
        let plain = costs.iter().filter(|c| c[0].0 < c[1].0).count();
        assert!(plain > 240, "{plain}");
        let o = owners(&sizes, &costs, 2, 0.05);
        let at0 = o.iter().filter(|&&x| x == 0).count();
        assert!((190..=210).contains(&at0), "{at0}");
        // Source 0 keeps the shards it is relatively cheapest for: a margin, not a scatter.
        let ratio = |s: usize| costs[s][0].0 / costs[s][1].0;
        let kept = (0..400)
            .filter(|&s| o[s] == 0)
            .map(ratio)
            .fold(0.0, f64::max);
        let given = (0..400)
            .filter(|&s| o[s] == 1)
            .map(ratio)
            .fold(f64::MAX, f64::min);
        assert!(kept < given, "{kept} {given}");
    }
}
