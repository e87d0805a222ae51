//! Mixture schedules (DESIGN §10, mixing): how many samples of each dataset every global
//! batch holds, and in which slots.
//!
//! Weights are fixed-point ([`ONE`] = 2^40), normalised so they sum to exactly [`ONE`]; all
//! arithmetic is integer, so every rank and every resume computes the same schedule. The
//! `GB` slots of a global batch go to the datasets one by one, earliest deadline first
//! ([`counts`]), and each dataset's lag behind its share is carried to the next batch
//! (Megatron's blending carries its error the same way, sample by sample). So after every
//! slot, and so after `s` batches, each dataset has had `w_d * s * GB` samples within one
//! (strictly), and every batch holds its share within two.
//!
//! Inside a batch the slots interleave the datasets: slot `j` goes to the dataset furthest
//! behind its share of the slots so far (`n_d * (j + 1) - GB * taken_d` largest, ties to the
//! lowest index), so every run of slots holds each share within one. Rank `r` of `W` takes
//! the run `[r * B, (r + 1) * B)` (as Megatron's data-parallel sampler gives each rank a
//! contiguous micro-batch of the global batch), so ranks get near-equal shares too.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Fixed-point one: weights are multiples of 2^-40.
pub const ONE: i128 = 1 << 40;

/// Why weights cannot make a schedule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MixError {
    /// A weight that is not a positive finite number.
    #[error("mix weight {weight} of {dataset:?} must be a positive number")]
    Weight {
        /// The dataset.
        dataset: String,
        /// Its weight.
        weight: f64,
    },
    /// No datasets, or the same one twice.
    #[error("{0}")]
    Datasets(String),
}

/// Most datasets one mixture names: each is a manifest the node fetches and holds while the
/// stream opens.
pub const MAX_MIX_DATASETS: usize = 256;

/// Normalised fixed-point weights (sum exactly [`ONE`]) of positive `weights`.
pub fn fixed_weights(names: &[&str], weights: &[f64]) -> Result<Vec<i128>, MixError> {
    if names.is_empty() {
        return Err(MixError::Datasets("mix names no dataset".into()));
    }
    if names.len() > MAX_MIX_DATASETS {
        return Err(MixError::Datasets(format!(
            "mix names {} datasets; at most {MAX_MIX_DATASETS}",
            names.len()
        )));
    }
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(MixError::Datasets(format!(
                "mix names {n:?} twice; give each dataset once"
            )));
        }
    }
    if names.len() != weights.len() {
        return Err(MixError::Datasets(format!(
            "{} datasets and {} weights",
            names.len(),
            weights.len()
        )));
    }
    for (n, &w) in names.iter().zip(weights) {
        if !(w.is_finite() && w > 0.0) {
            return Err(MixError::Weight {
                dataset: (*n).to_owned(),
                weight: w,
            });
        }
    }
    // Scaled by the largest first, so huge weights cannot overflow the sum.
    let top_w = weights.iter().copied().fold(0.0f64, f64::max);
    let sum: f64 = weights.iter().map(|w| w / top_w).sum();
    let mut q: Vec<i128> = weights
        .iter()
        .map(|w| ((w / top_w / sum) * ONE as f64).round().max(1.0) as i128)
        .collect();
    // Give the rounding error to the largest weight, so the sum is exact.
    let err = ONE - q.iter().sum::<i128>();
    let top = (0..q.len())
        .max_by_key(|&i| (q[i], usize::MAX - i))
        .expect("not empty");
    q[top] += err;
    Ok(q)
}

/// The samples each dataset gets in one global batch of `gb`; updates `carry` (each
/// dataset's lag behind its share so far, in units of 2^-40 samples, summing to 0).
///
/// Slot by slot, earliest deadline first (uniprocessor Pfair scheduling, Baruah et al.): a
/// slot raises every lag by the dataset's weight and goes to the dataset that would soonest
/// fall a whole sample behind, `(ONE - lag) / q` smallest (ties to the lowest index), among
/// those it would not put a whole sample ahead (lag > 0). With weights summing to one this
/// keeps every lag within (-1, 1) after every slot, so at every batch end too. Rounding each
/// batch's quota instead (largest remainders, the carry clamped at zero) could not: three
/// datasets a third of a sample ahead and two 1.009 behind, one slot, leave one of the two
/// more than a sample behind.
pub fn counts(q: &[i128], gb: u64, carry: &mut [i128]) -> Vec<u64> {
    match q.len() {
        1 => vec![gb],
        // Few datasets, or lags that are not a schedule's (they do not sum to 0): the scan.
        // Its i128 compares beat the heap's up to a few dozen datasets (a throwaway probe:
        // 2.1 against 6.3 us a step of 256 slots over 2; 185 against 171 over 32 of 2048;
        // 3330 against 615 over 256 of 4096).
        k if k <= SCAN_AT_MOST || carry.iter().sum::<i128>() != 0 => counts_by_scan(q, gb, carry),
        _ => counts_by_heap(q, gb, carry),
    }
}

/// The most datasets [`counts`] scans; more go through [`counts_by_heap`].
const SCAN_AT_MOST: usize = 32;

/// [`counts`] with each dataset's deadline and release in two heaps: they only move when the
/// dataset takes a slot, so the same choices as [`counts_by_scan`] cost O(log datasets) a
/// slot. `carry` must sum to 0.
fn counts_by_heap(q: &[i128], gb: u64, carry: &mut [i128]) -> Vec<u64> {
    let start: Vec<i128> = carry.to_vec();
    let mut n = vec![0u64; q.len()];
    let release = |d: usize, n: u64| {
        // The first slot t whose raise makes the lag positive: q * (t + 1) > ONE * n - lag.
        let t = (ONE * i128::from(n) - start[d]).div_euclid(q[d]).max(0);
        u64::try_from(t).unwrap_or(u64::MAX)
    };
    let deadline = |d: usize, n: u64| Deadline {
        // The lag reaches a whole sample at slot (ONE * (n + 1) - lag) / q.
        num: ONE * (i128::from(n) + 1) - start[d],
        q: q[d],
        d,
    };
    let mut pending: BinaryHeap<Reverse<(u64, usize)>> =
        (0..q.len()).map(|d| Reverse((release(d, 0), d))).collect();
    let mut ready: BinaryHeap<Reverse<Deadline>> = BinaryHeap::with_capacity(q.len());
    for t in 0..gb {
        while let Some(&Reverse((r, d))) = pending.peek()
            && r <= t
        {
            pending.pop();
            ready.push(Reverse(deadline(d, n[d])));
        }
        let Reverse(Deadline { d, .. }) = ready
            .pop()
            .expect("lags summing to 0 sum to one sample after a slot's raise: one is positive");
        n[d] += 1;
        pending.push(Reverse((release(d, n[d]), d)));
    }
    for d in 0..q.len() {
        carry[d] = start[d] + q[d] * i128::from(gb) - ONE * i128::from(n[d]);
    }
    n
}

/// A dataset's deadline `num / q` (in slots from the batch's start); earliest first, ties to
/// the lowest index.
#[derive(PartialEq, Eq)]
struct Deadline {
    num: i128,
    q: i128,
    d: usize,
}

impl Ord for Deadline {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.num * o.q)
            .cmp(&(o.num * self.q))
            .then(self.d.cmp(&o.d))
    }
}

impl PartialOrd for Deadline {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// [`counts`] slot by slot, scanning every dataset: the rule as stated (the reference the
/// heap form is tested against), and the fallback for lags that do not sum to 0.
fn counts_by_scan(q: &[i128], gb: u64, carry: &mut [i128]) -> Vec<u64> {
    let mut n = vec![0u64; q.len()];
    for _ in 0..gb {
        for (c, w) in carry.iter_mut().zip(q) {
            *c += w;
        }
        let soonest = (0..q.len()).filter(|&d| carry[d] > 0).min_by(|&a, &b| {
            // (ONE - lag_a) / q_a against (ONE - lag_b) / q_b, without dividing.
            ((ONE - carry[a]) * q[b])
                .cmp(&((ONE - carry[b]) * q[a]))
                .then(a.cmp(&b))
        });
        // Lags that sum to 0 (see `carry_is_valid`) sum to one sample after the raise, so one
        // is positive; otherwise the slot goes to the dataset furthest behind.
        let d = soonest.unwrap_or_else(|| {
            (0..q.len())
                .max_by_key(|&d| (carry[d], usize::MAX - d))
                .expect("at least one dataset")
        });
        carry[d] -= ONE;
        n[d] += 1;
    }
    n
}

/// Whether `carry` can be a schedule's lags for `n` datasets: one per dataset, summing to 0,
/// each within a few samples (this scheduler keeps them within one; earlier releases' within
/// two). A resume state's carry is checked with it before use.
pub fn carry_is_valid(carry: &[i64], n: usize) -> bool {
    carry.len() == n
        && carry.iter().map(|&c| i128::from(c)).sum::<i128>() == 0
        && carry.iter().all(|&c| i128::from(c).abs() < 4 * ONE)
}

/// The dataset of each slot of a batch holding `n[d]` samples of dataset `d`.
pub fn interleave(n: &[u64]) -> Vec<u16> {
    let gb: u64 = n.iter().sum();
    let mut taken = vec![0u64; n.len()];
    let mut out = Vec::with_capacity(gb as usize);
    for j in 0..gb {
        let d = (0..n.len())
            .filter(|&d| taken[d] < n[d])
            .max_by_key(|&d| (lead(n[d], j, gb, taken[d]), usize::MAX - d))
            .expect("a dataset with slots left");
        taken[d] += 1;
        out.push(d as u16);
    }
    out
}

/// How far a dataset of `n_d` of a batch's `gb` slots, `taken` of them so far, is behind its
/// share of slots `0..=j`, in units of 1/gb slot: `n_d * (j + 1) - gb * taken`, multiplied in
/// 128 bits (`gb * taken` wraps in 64 once a batch passes 2^32 slots; both products stay
/// below 2^124, as a batch's slot list of 2-byte entries is below 2^62 slots).
fn lead(n_d: u64, j: u64, gb: u64, taken: u64) -> i128 {
    i128::from(n_d) * i128::from(j + 1) - i128::from(gb) * i128::from(taken)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_lead_past_2_64_is_exact() {
        // Before, `gb * taken` was a u64 product: 2^34 * 2^32 wrapped (a panic in debug).
        assert_eq!(lead(1 << 33, 1 << 33, 1 << 34, 1 << 32), 1 << 33);
        assert_eq!(lead(1, u64::MAX - 1, u64::MAX, 1), 0);
    }

    #[test]
    fn shares_are_exact_per_batch_and_carried_across_batches() {
        let q = fixed_weights(&["web", "code"], &[0.7, 0.3]).unwrap();
        let mut carry = vec![0; 2];
        // 0.7 * 10 = 7 exactly: every batch.
        for _ in 0..50 {
            assert_eq!(counts(&q, 10, &mut carry), vec![7, 3]);
        }
        // 0.7 * 4 = 2.8: batches of 3 and 2, the sum over 5 batches exactly 14.
        let mut carry = vec![0; 2];
        let n: Vec<Vec<u64>> = (0..5).map(|_| counts(&q, 4, &mut carry)).collect();
        assert_eq!(n.iter().map(|c| c[0]).sum::<u64>(), 14, "{n:?}");
        assert!(n.iter().all(|c| c[0] == 2 || c[0] == 3), "{n:?}");
    }

    #[test]
    fn small_shares_ahead_do_not_push_a_large_one_a_sample_behind() {
        // Rounding each batch's quota left dataset 4 here 1.009 samples behind at batch 24 (and
        // dataset 2 of the second mix at batch 76): cumulative within one, every slot.
        for w in [
            &[0.3, 0.3, 0.3, 5.0, 5.0][..],
            &[0.01, 0.1, 1.0, 1.0],
            &[0.3, 1.0, 10.0, 10.0],
        ] {
            for gb in [1u64, 3, 5] {
                let names: Vec<String> = (0..w.len()).map(|i| format!("d{i}")).collect();
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let q = fixed_weights(&names, w).unwrap();
                let (mut carry, mut total) = (vec![0; w.len()], vec![0u64; w.len()]);
                for s in 1..=500u64 {
                    for (t, n) in total.iter_mut().zip(counts(&q, gb, &mut carry)) {
                        *t += n;
                    }
                    for d in 0..w.len() {
                        let cum = q[d] as f64 / ONE as f64 * (s * gb) as f64;
                        let off = (total[d] as f64 - cum).abs();
                        assert!(off < 1.0, "{w:?} gb {gb} batch {s} dataset {d}: {off}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_heap_form_breaks_ties_as_the_scan_does() {
        // Equal weights tie at every deadline: the lowest index first, in both forms.
        for w in [
            vec![1.0; 40],
            (0..40).map(|i| f64::from(1 + i % 3)).collect(),
        ] {
            let names: Vec<String> = (0..w.len()).map(|i| format!("d{i}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let q = fixed_weights(&names, &w).unwrap();
            let (mut a, mut b) = (vec![0; w.len()], vec![0; w.len()]);
            for gb in [1u64, 7, 64, 333] {
                assert_eq!(
                    counts_by_heap(&q, gb, &mut a),
                    counts_by_scan(&q, gb, &mut b)
                );
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn a_carry_must_sum_to_zero_and_stay_within_a_few_samples() {
        assert!(carry_is_valid(&[0, 0], 2));
        assert!(carry_is_valid(&[1 << 39, -(1 << 39)], 2));
        assert!(!carry_is_valid(&[0, 0], 3), "one per dataset");
        assert!(!carry_is_valid(&[1, 0], 2), "sums to 0");
        assert!(
            !carry_is_valid(&[i64::MAX, i64::MIN + 1], 2),
            "within a few samples"
        );
        // Lags that do not sum to 0 still schedule every slot (no panic).
        let q = fixed_weights(&["a", "b"], &[1.0, 1.0]).unwrap();
        let mut carry = vec![-5 * ONE, -5 * ONE];
        assert_eq!(counts(&q, 4, &mut carry).iter().sum::<u64>(), 4);
    }

    #[test]
    fn bad_weights_are_refused_naming_the_dataset() {
        let e = fixed_weights(&["a", "b"], &[1.0, 0.0]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "mix weight 0 of \"b\" must be a positive number"
        );
        assert!(
            fixed_weights(&["a", "a"], &[1.0, 1.0])
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        assert!(fixed_weights(&[], &[]).is_err());
        let many: Vec<String> = (0..=MAX_MIX_DATASETS).map(|i| format!("d{i}")).collect();
        let names: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = fixed_weights(&names, &vec![1.0; names.len()]).unwrap_err();
        assert_eq!(e.to_string(), "mix names 257 datasets; at most 256");
        assert!(fixed_weights(&names[1..], &vec![1.0; names.len() - 1]).is_ok());
        // Huge weights keep their proportions.
        let q = fixed_weights(&["a", "b"], &[1e308, 1e308]).unwrap();
        assert_eq!(q, vec![ONE / 2, ONE / 2]);
    }

    #[test]
    fn slots_interleave_in_proportion() {
        assert_eq!(interleave(&[2, 1]), vec![0, 1, 0]);
        assert_eq!(interleave(&[4, 4]), vec![0, 1, 0, 1, 0, 1, 0, 1]);
        let s = interleave(&[6, 2]);
        assert_eq!(s.iter().filter(|&&d| d == 1).count(), 2);
        // Rank 0 and rank 1 of two (each a contiguous half) get one slot of dataset 1 each.
        for half in s.chunks(4) {
            assert_eq!(half.iter().filter(|&&d| d == 1).count(), 1, "{s:?}");
        }
    }

    proptest! {
        /// Every batch sums to GB and holds each share within one; the cumulative counts
        /// stay within one of `w * s * GB`.
        /// The heap form makes the same choices as the slot-by-slot scan, from any lags
        /// summing to 0 (a resume's carry, up to 4 samples each way).
        #[test]
        fn the_heap_form_equals_the_scan(w in proptest::collection::vec(0.01f64..10.0, 2..48), gb in 1u64..400,
                                         shift in proptest::collection::vec(-(3 * ONE)..(3 * ONE), 48)) {
            let names: Vec<String> = (0..w.len()).map(|i| format!("d{i}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let q = fixed_weights(&names, &w).unwrap();
            // Lags summing to 0: each minus the mean, the remainder on the first.
            let mut a: Vec<i128> = shift[..w.len()].to_vec();
            let mean = a.iter().sum::<i128>() / w.len() as i128;
            a.iter_mut().for_each(|c| *c -= mean);
            a[0] -= a.iter().sum::<i128>();
            let mut b = a.clone();
            for _ in 0..5 {
                prop_assert_eq!(counts_by_heap(&q, gb, &mut a), counts_by_scan(&q, gb, &mut b));
                prop_assert_eq!(&a, &b);
            }
        }

        #[test]
        fn cumulative_shares_stay_within_one(w in proptest::collection::vec(0.01f64..10.0, 1..6), gb in 1u64..300) {
            let names: Vec<String> = (0..w.len()).map(|i| format!("d{i}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let q = fixed_weights(&names, &w).unwrap();
            prop_assert_eq!(q.iter().sum::<i128>(), ONE);
            let mut carry = vec![0; w.len()];
            let mut total = vec![0u64; w.len()];
            for s in 1..=200u64 {
                let n = counts(&q, gb, &mut carry);
                prop_assert_eq!(n.iter().sum::<u64>(), gb);
                prop_assert_eq!(interleave(&n).len() as u64, gb);
                for d in 0..w.len() {
                    let exact = q[d] as f64 / ONE as f64 * gb as f64;
                    prop_assert!((n[d] as f64 - exact).abs() < 2.0, "batch share {} vs {exact}", n[d]);
                    total[d] += n[d];
                    let cum = q[d] as f64 / ONE as f64 * (s * gb) as f64;
                    prop_assert!((total[d] as f64 - cum).abs() <= 1.0 + 1e-9, "after {s}: {} vs {cum}", total[d]);
                }
            }
        }
    }
}
