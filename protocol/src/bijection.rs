//! A keyed permutation of `0..n` that costs O(1) memory and O(1) expected time per element:
//! a balanced Feistel network over the smallest even-width power of two ≥ n, with cycle
//! walking to stay below n. Used to shuffle the samples of a block without a per-sample
//! array; fully specified here (SplitMix64 round function), so an order never changes with a
//! dependency upgrade.

/// Feistel rounds: 4 make a pseudo-random permutation from pseudo-random round functions.
const ROUNDS: u64 = 4;

/// A permutation of `0..n`, fixed by `key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bijection {
    n: u64,
    half: u32,
    key: u64,
}

/// SplitMix64's finaliser: a fast, well-mixed 64-bit hash.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Bijection {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Self {
        // Width: the smallest even number of bits covering n - 1 (at least 2).
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        let half = bits.div_ceil(2);
        Self { n, half, key }
    }

    /// Size of the domain.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// True for the empty domain.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half) - 1;
        let (mut l, mut r) = (x >> self.half, x & mask);
        for round in 0..ROUNDS {
            let f = mix(self.key ^ mix(r ^ (round << 56))) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half) | r
    }

    /// The image of `x` (which must be below `n`).
    pub fn apply(&self, x: u64) -> u64 {
        debug_assert!(x < self.n, "{x} outside 0..{}", self.n);
        if self.n <= 1 {
            return x;
        }
        // The domain is at most 4n, so this walks fewer than 4 steps on average.
        let mut y = self.feistel(x);
        while y >= self.n {
            y = self.feistel(y);
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn small_domains_are_permutations() {
        for n in 0..300u64 {
            let b = Bijection::new(n, 0xfeed ^ n);
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = b.apply(x) as usize;
                assert!(!seen[y], "n={n}: {y} twice");
                seen[y] = true;
            }
        }
    }

    #[test]
    fn it_actually_shuffles_and_keys_differ() {
        let (a, b) = (Bijection::new(10_000, 1), Bijection::new(10_000, 2));
        let fixed = (0..10_000).filter(|&x| a.apply(x) == x).count();
        assert!(fixed < 20, "{fixed} fixed points");
        let same = (0..10_000).filter(|&x| a.apply(x) == b.apply(x)).count();
        assert!(same < 20, "{same} agreements between keys");
    }

    proptest! {
        #[test]
        fn any_domain_is_a_permutation(n in 1u64..5000, key in any::<u64>()) {
            let b = Bijection::new(n, key);
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = b.apply(x);
                prop_assert!(y < n);
                prop_assert!(!seen[y as usize]);
                seen[y as usize] = true;
            }
        }
    }
}
