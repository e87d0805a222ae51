//! Megatron-compatible sample order: a pure-Rust reproduction of megatron-core's `GPTDataset`
//! index construction (`megatron/core/datasets/gpt_dataset.py` and `helpers.cpp`,
//! checked against megatron-core 0.16.1), so a shardwire job can hand a trainer exactly the
//! token windows, in exactly the order, that Megatron's own data loader would.
//!
//! Megatron flattens the sequences of a split into one token stream and cuts it into samples
//! of `seq_len + x` tokens (`x = add_extra_token_to_sequence`, 0 or 1) that start every
//! `seq_len` tokens. Three indices describe that ([`MegatronIndex`]):
//! - `document_index`: the sequence ids of all epochs, `num_epochs` copies of `0..S` shuffled
//!   together (or, with a separate final epoch, the first `num_epochs - 1` copies and the last
//!   copy shuffled apart), with numpy's legacy `RandomState(seed)` ([`RandomState`]);
//! - `sample_index`: `n + 1` rows `(position in document_index, token offset)`, where sample
//!   `s` starts (`build_sample_idx` in `helpers.cpp`, no RNG);
//! - `shuffle_index`: a permutation of `0..n` (two blocks with a separate final epoch) drawn
//!   from the same `RandomState` after the document index; dataset item `i` is sample
//!   `shuffle_index[i]`.
//!
//! Quirks kept on purpose: the whole multi-epoch document index is shuffled at once (a
//! sequence can repeat back to back); the final epoch is separated when it contributes fewer
//! than `int(0.80 * samples_per_epoch)` samples; without `drop_last` the sample count is
//! `ceil` of a C++ `float` (f32) division; with `x = 0` a sample ending exactly at a
//! sequence's end starts the next one at offset `len` of that sequence (a zero-length piece).
//! Everything is per sequence and per sample; no per-token array is built.

/// numpy.random.RandomState's legacy MT19937 stream, as far as `shuffle` of a 1-D array uses
/// it: `RandomState(seed)` seeding (`init_genrand`), tempered 32-bit outputs and numpy's
/// masked-rejection `random_interval`.
#[derive(Clone, Debug)]
pub struct RandomState {
    mt: [u32; 624],
    index: usize,
}

const MT_N: usize = 624;
const MT_M: usize = 397;

impl RandomState {
    /// Seeds like `numpy.random.RandomState(seed)` with an integer seed (`init_genrand`).
    pub fn new(seed: u32) -> Self {
        let mut mt = [0u32; MT_N];
        mt[0] = seed;
        for i in 1..MT_N {
            let prev = mt[i - 1];
            mt[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Self { mt, index: MT_N }
    }

    /// Regenerates the 624-word state block (MT19937 twist).
    fn twist(&mut self) {
        for i in 0..MT_N {
            let y = (self.mt[i] & 0x8000_0000) | (self.mt[(i + 1) % MT_N] & 0x7fff_ffff);
            let mut next = self.mt[(i + MT_M) % MT_N] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= 0x9908_b0df;
            }
            self.mt[i] = next;
        }
        self.index = 0;
    }

    /// The next tempered 32-bit output (numpy's `mt19937_next32`, `genrand_int32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= MT_N {
            self.twist();
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A uniform integer in `0..=max`, as numpy's `random_interval`: draw `next_u32` (or two
    /// of them, high word first, when `max > u32::MAX`) masked to `max`'s bit width until
    /// the value is `<= max`. `max == 0` draws nothing.
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> shift;
        }
        if max <= u64::from(u32::MAX) {
            loop {
                let v = u64::from(self.next_u32()) & mask;
                if v <= max {
                    return v;
                }
            }
        }
        loop {
            let hi = u64::from(self.next_u32());
            let v = ((hi << 32) | u64::from(self.next_u32())) & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// Shuffles in place like `RandomState.shuffle` of a 1-D ndarray: for `i` from `n - 1`
    /// down to 1, swap `a[i]` with `a[random_interval(i)]`. The element type does not affect
    /// the draws.
    pub fn shuffle<T>(&mut self, a: &mut [T]) {
        for i in (1..a.len()).rev() {
            // j <= i < a.len(), so the cast back to usize is lossless.
            let j = self.random_interval(i as u64) as usize;
            a.swap(i, j);
        }
    }
}

/// Megatron's inputs for one split of one dataset (the split's sequences are given to
/// [`MegatronIndex::build`] as their lengths, in split order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegatronSpec {
    /// `config.random_seed`: seeds the single `RandomState` used for both shuffles.
    pub seed: u32,
    /// `config.sequence_length` (L): samples start every L tokens.
    pub seq_len: u64,
    /// `config.add_extra_token_to_sequence`: samples hold `L + 1` tokens (the last one only a
    /// label, shared with the next sample) instead of `L`.
    pub add_extra_token: bool,
    /// The requested sample count; `None` means exactly one epoch. More samples than asked
    /// may be built: every sample of the epochs needed is kept.
    pub num_samples: Option<u64>,
    /// Drop the partial sample at the end of the data: true for train and test, and for
    /// validation `drop_last_partial_validation_sequence` (default true).
    pub drop_last: bool,
}

/// Why an index cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MegatronError {
    /// The split holds no tokens (no sequences, or all of length 0); Megatron would loop
    /// forever looking for enough epochs.
    #[error("the split holds no tokens")]
    NoTokens,
    /// The epochs built hold too few tokens for a single sample.
    #[error("{tokens} tokens make no sample of {need} tokens")]
    TooFewTokens {
        /// Tokens in all epochs built.
        tokens: u64,
        /// Tokens one sample needs (`seq_len + x`).
        need: u64,
    },
    /// `seq_len` is 0, or `seq_len + x` does not fit the C++ `int32` Megatron keeps it in.
    #[error("sequence length {0} is out of range (1..2^31-1)")]
    SeqLen(u64),
    /// More sequences than Megatron's `int32` document index can name.
    #[error("{0} sequences exceed Megatron's int32 document index")]
    TooManySequences(usize),
    /// An intermediate count (epochs, tokens, samples) overflows.
    #[error("the requested sample count overflows")]
    Overflow,
    /// With `drop_last = false` and `x = 1`, the data ends in a sequence of length 0: Megatron
    /// would record the offset -1, which has no meaning.
    #[error("the data ends in an empty sequence, which Megatron cannot index without drop_last")]
    EmptyFinalSequence,
    /// The three indices would take more than [`MAX_INDEX_BYTES`] (or more than this host
    /// can allocate): a request must not size the node's memory past that.
    #[error(
        "the Megatron index of {samples} samples needs {bytes} bytes, over the limit of \
         {MAX_INDEX_BYTES} or this host's memory (a longer seq_len makes fewer samples)"
    )]
    IndexTooLarge {
        /// Samples in the index.
        samples: u64,
        /// Bytes its three arrays take (or, when an allocation failed, that array's).
        bytes: u64,
    },
}

/// What [`MegatronIndex::sizes`] found: sequences, epochs, the separate final epoch, tokens
/// over all epochs and in one, and samples.
struct Sizes {
    count: u32,
    num_epochs: u32,
    separate: bool,
    stream: u64,
    tokens: u64,
    n: u64,
}

/// Most bytes the three indices of one split may take (the node holds them per stream).
pub const MAX_INDEX_BYTES: u64 = 8 << 30;

/// The three indices of a Megatron `GPTDataset` split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MegatronIndex {
    /// Number of passes over the split's sequences.
    pub num_epochs: u32,
    /// Whether the final epoch was shuffled apart (it adds fewer than 80% of an epoch).
    pub separate_final_epoch: bool,
    /// [`MegatronSpec::add_extra_token`], kept so [`MegatronIndex::pieces`] knows each
    /// sample's `x`.
    pub add_extra_token: bool,
    /// Sequence ids (positions in the split), `num_epochs` copies, shuffled.
    pub document_index: Vec<u32>,
    /// `n + 1` rows: where sample `s` starts, as (index into `document_index`, token offset in
    /// that sequence); sample `s` ends where sample `s + 1` starts, plus `x` tokens.
    pub sample_index: Vec<(u64, u32)>,
    /// Dataset item `i` is sample `shuffle_index[i]`.
    pub shuffle_index: Vec<u64>,
}

/// Epoch count and separate-final-epoch flag (`_get_num_epochs` and the 0.80 rule).
fn epochs(tokens: u64, spec: &MegatronSpec, x: u64) -> Result<(u32, bool), MegatronError> {
    let Some(requested) = spec.num_samples else {
        return Ok((1, false));
    };
    let need = u128::from(requested) * u128::from(spec.seq_len) + u128::from(x);
    let e = need.div_ceil(u128::from(tokens)).max(1);
    let e = u32::try_from(e).map_err(|_| MegatronError::Overflow)?;
    if e == 1 {
        return Ok((1, false));
    }
    let before =
        (u128::from(e - 1) * u128::from(tokens) - u128::from(x)) / u128::from(spec.seq_len);
    let from_last = u128::from(requested).saturating_sub(before);
    let per_epoch = (tokens - x) / spec.seq_len;
    // Python: `from_last < int(0.80 * per_epoch)`, a float64 product truncated.
    let threshold = (0.80f64 * per_epoch as f64) as u128;
    Ok((e, from_last < threshold))
}

/// `_build_document_index`: `epochs` copies of `0..count` shuffled as one array, or with
/// `separate` the first `epochs - 1` copies and then the last copy, each shuffled alone.
fn document_index(count: u32, epochs: u32, separate: bool, rs: &mut RandomState) -> Vec<u32> {
    let tiled = |e: u32| (0..e).flat_map(|_| 0..count).collect::<Vec<u32>>();
    if !separate || epochs == 1 {
        let mut d = tiled(epochs);
        rs.shuffle(&mut d);
        return d;
    }
    let mut d = tiled(epochs - 1);
    rs.shuffle(&mut d);
    let mut last = tiled(1);
    rs.shuffle(&mut last);
    d.extend(last);
    d
}

/// `build_sample_idx`'s sample count: floor without `drop_last`, else the C++
/// `ceil(float(E*T - x) / L)`, a single-precision division.
fn sample_count(stream_minus_x: u64, seq_len: u64, drop_last: bool) -> u64 {
    if drop_last {
        stream_minus_x / seq_len
    } else {
        ((stream_minus_x as f32) / (seq_len as f32)).ceil() as u64
    }
}

/// `build_sample_idx` (helpers.cpp): `n + 1` sample start rows over the stream of
/// `document_index`'s sequences.
fn sample_index(
    lengths: &[u32],
    doc: &[u32],
    seq_len: u64,
    x: u64,
    n: u64,
) -> Result<Vec<(u64, u32)>, MegatronError> {
    let cap = usize::try_from(n).map_err(|_| MegatronError::Overflow)?;
    let mut out = Vec::new();
    out.try_reserve_exact(cap.saturating_add(1))
        .map_err(|_| MegatronError::IndexTooLarge {
            samples: n,
            bytes: (n + 1).saturating_mul(16),
        })?;
    out.push((0u64, 0u32));
    let size = |di: usize| i64::from(lengths[doc[di] as usize]);
    let last = doc.len() - 1;
    let (mut di, mut off) = (0usize, 0i64);
    // seq_len + x <= i32::MAX was checked, so these i64 values cannot overflow.
    let (window, x) = ((seq_len + x) as i64, x as i64);
    for _ in 0..n {
        let mut rem = window;
        while rem != 0 {
            let dl = size(di) - off;
            rem -= dl;
            if rem <= 0 {
                off += rem + dl - x;
                rem = 0;
            } else if di == last {
                off = size(di) - x;
                break;
            } else {
                di += 1;
                off = 0;
            }
        }
        let off = u32::try_from(off).map_err(|_| MegatronError::EmptyFinalSequence)?;
        out.push((di as u64, off));
    }
    Ok(out)
}

/// `_build_shuffle_index(num, total)`: `0..num` shuffled, then `num..total` shuffled apart.
fn shuffle_index(num: u64, total: u64, rs: &mut RandomState) -> Vec<u64> {
    let mut a: Vec<u64> = (0..num).collect();
    rs.shuffle(&mut a);
    if num != total {
        let mut b: Vec<u64> = (num..total).collect();
        rs.shuffle(&mut b);
        a.extend(b);
    }
    a
}

impl MegatronIndex {
    /// Builds the three indices of a split whose sequences (in split order, ids `0..S`) have
    /// `sequence_lengths` tokens, exactly as megatron-core's `GPTDataset` does.
    pub fn build(sequence_lengths: &[u32], spec: &MegatronSpec) -> Result<Self, MegatronError> {
        let Sizes {
            count,
            num_epochs,
            separate,
            stream,
            tokens,
            n,
        } = Self::sizes(sequence_lengths, spec)?;
        let x = u64::from(spec.add_extra_token);
        let mut rs = RandomState::new(spec.seed);
        let document_index = document_index(count, num_epochs, separate, &mut rs);
        let sample_index = sample_index(sequence_lengths, &document_index, spec.seq_len, x, n)?;
        let shuffle_index = if separate {
            let before = (stream - tokens).saturating_sub(x) / spec.seq_len;
            shuffle_index(before, n, &mut rs)
        } else {
            shuffle_index(n, n, &mut rs)
        };
        Ok(Self {
            num_epochs,
            separate_final_epoch: separate,
            add_extra_token: spec.add_extra_token,
            document_index,
            sample_index,
            shuffle_index,
        })
    }

    /// Whether [`MegatronIndex::build`] can build the index of `sequence_lengths` under
    /// `spec` (every check it makes before it allocates: counts, tokens, and the indices'
    /// size against [`MAX_INDEX_BYTES`]), without building it.
    pub fn check(sequence_lengths: &[u32], spec: &MegatronSpec) -> Result<(), MegatronError> {
        Self::sizes(sequence_lengths, spec).map(|_| ())
    }

    /// The index's sizes, checked.
    fn sizes(sequence_lengths: &[u32], spec: &MegatronSpec) -> Result<Sizes, MegatronError> {
        let x = u64::from(spec.add_extra_token);
        if spec.seq_len == 0 || spec.seq_len + x > i32::MAX as u64 {
            return Err(MegatronError::SeqLen(spec.seq_len));
        }
        let count = u32::try_from(sequence_lengths.len())
            .ok()
            .filter(|&c| c <= i32::MAX as u32)
            .ok_or(MegatronError::TooManySequences(sequence_lengths.len()))?;
        let tokens: u64 = sequence_lengths.iter().map(|&l| u64::from(l)).sum();
        if tokens == 0 {
            return Err(MegatronError::NoTokens);
        }
        let (num_epochs, separate) = epochs(tokens, spec, x)?;
        let stream = u64::from(num_epochs)
            .checked_mul(tokens)
            .ok_or(MegatronError::Overflow)?;
        let n = sample_count(stream.saturating_sub(x), spec.seq_len, spec.drop_last);
        if n == 0 {
            let need = spec.seq_len + x;
            return Err(MegatronError::TooFewTokens {
                tokens: stream,
                need,
            });
        }
        let docs = u64::from(num_epochs)
            .checked_mul(u64::from(count))
            .filter(|&len| usize::try_from(len).is_ok())
            .ok_or(MegatronError::Overflow)?;
        // document index u32s, sample index (u64, u32) pairs, shuffle index u64s.
        let bytes = u128::from(docs) * 4 + (u128::from(n) + 1) * 16 + u128::from(n) * 8;
        if bytes > u128::from(MAX_INDEX_BYTES) {
            let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
            return Err(MegatronError::IndexTooLarge { samples: n, bytes });
        }
        Ok(Sizes {
            count,
            num_epochs,
            separate,
            stream,
            tokens,
            n,
        })
    }

    /// Number of samples (`len(GPTDataset)`).
    pub fn len(&self) -> u64 {
        self.shuffle_index.len() as u64
    }

    /// Whether there are no samples (never true for an index [`MegatronIndex::build`] made).
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// The pieces of dataset item `i` (sample `shuffle_index[i]`), as `GPTDataset.__getitem__`
    /// reads them: (sequence id, token start, token count), in order. The counts sum to
    /// `seq_len + x`, or less for the last sample at the end of the data with
    /// `drop_last = false` (Megatron pads it with `pad`). Zero-length pieces (the `x = 0`
    /// sample that starts at a sequence's end, or empty sequences) are left out; the tokens
    /// are the same. Empty for `i >= len()` or lengths that do not match the index.
    pub fn pieces(&self, sequence_lengths: &[u32], i: u64) -> Vec<(u32, u32, u32)> {
        let x = u32::from(self.add_extra_token);
        let rows = usize::try_from(i)
            .ok()
            .and_then(|i| self.shuffle_index.get(i))
            .and_then(|&j| usize::try_from(j).ok())
            .and_then(|j| Some((*self.sample_index.get(j)?, *self.sample_index.get(j + 1)?)));
        let Some(((b, bo), (e, eo))) = rows else {
            return Vec::new();
        };
        let seq = |k: u64| {
            let id = *usize::try_from(k)
                .ok()
                .and_then(|k| self.document_index.get(k))?;
            Some((id, *sequence_lengths.get(id as usize)?))
        };
        let mut out = Vec::new();
        let mut push = |id: u32, start: u32, count: u32| {
            if count > 0 {
                out.push((id, start, count));
            }
        };
        if b == e {
            if let Some((id, len)) = seq(b) {
                push(
                    id,
                    bo,
                    (eo.saturating_add(x).saturating_sub(bo)).min(len.saturating_sub(bo)),
                );
            }
            return out;
        }
        for k in b..=e {
            let Some((id, len)) = seq(k) else {
                return Vec::new();
            };
            match k {
                _ if k == b => push(id, bo, len.saturating_sub(bo)),
                _ if k == e => push(id, 0, eo.saturating_add(x).min(len)),
                _ => push(id, 0, len),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn vectors() -> Value {
        serde_json::from_str(include_str!("megatron_vectors.json")).unwrap()
    }

    fn u64s(v: &Value) -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    }

    fn u32s(v: &Value) -> Vec<u32> {
        u64s(v).into_iter().map(|x| x as u32).collect()
    }

    fn rows(v: &Value) -> Vec<(u64, u32)> {
        let rows = v.as_array().unwrap();
        rows.iter()
            .map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap() as u32))
            .collect()
    }

    /// The raw text of item `i` from `pieces`, padded with 0 (Megatron's pad -1, rewritten
    /// to 0 in `tokens`/`labels`) to `seq_len + x`.
    fn text(ix: &MegatronIndex, seqs: &[Vec<u64>], spec: &MegatronSpec, i: u64) -> Vec<u64> {
        let lengths: Vec<u32> = seqs.iter().map(|s| s.len() as u32).collect();
        let mut t = Vec::new();
        for (id, start, count) in ix.pieces(&lengths, i) {
            let s = &seqs[id as usize];
            t.extend_from_slice(&s[start as usize..(start + count) as usize]);
        }
        let full = (spec.seq_len + u64::from(spec.add_extra_token)) as usize;
        assert!(t.len() <= full);
        t.resize(full, 0);
        t
    }

    /// Every piece list sums to the full window, except the final sample without drop_last.
    fn check_piece_sums(ix: &MegatronIndex, lengths: &[u32], spec: &MegatronSpec) {
        let full = spec.seq_len + u64::from(spec.add_extra_token);
        for i in 0..ix.len() {
            let sum: u64 = ix.pieces(lengths, i).iter().map(|p| u64::from(p.2)).sum();
            let tail = ix.shuffle_index[i as usize] + 1 == ix.len();
            if spec.drop_last || !tail {
                assert_eq!(sum, full, "item {i}");
            } else {
                assert!(sum <= full && sum > 0, "item {i}");
            }
        }
    }

    #[test]
    fn mt19937_raw_outputs_match_numpy() {
        // The MT19937 reference value for the default seed 5489.
        assert_eq!(RandomState::new(5489).next_u32(), 3_499_211_612);
        for case in vectors()["mt_raw_u32"].as_array().unwrap() {
            let mut rs = RandomState::new(case["seed"].as_u64().unwrap() as u32);
            let got: Vec<u64> = (0..8).map(|_| u64::from(rs.next_u32())).collect();
            assert_eq!(got, u64s(&case["u32"]));
        }
    }

    #[test]
    fn shuffle_matches_numpy() {
        for case in vectors()["mt_shuffle"].as_array().unwrap() {
            let (seed, n) = (
                case["seed"].as_u64().unwrap() as u32,
                case["n"].as_u64().unwrap(),
            );
            let mut a: Vec<u64> = (0..n).collect();
            RandomState::new(seed).shuffle(&mut a);
            if let Some(full) = case.get("full") {
                assert_eq!(a, u64s(full), "seed {seed} n {n}");
                continue;
            }
            for (p, v) in u64s(&case["positions"])
                .into_iter()
                .zip(u64s(&case["values"]))
            {
                assert_eq!(a[p as usize], v, "seed {seed} n {n} pos {p}");
            }
            let m = (1u128 << 61) - 1;
            let chk = a
                .iter()
                .enumerate()
                .fold(0u128, |s, (i, &v)| (s + (i as u128 + 1) * v as u128) % m);
            assert_eq!(chk as u64, case["checksum_mod_2_61_1"].as_u64().unwrap());
        }
    }

    #[test]
    fn research_vectors_match() {
        let v = vectors();
        let seqs: Vec<Vec<u64>> = v["toy"]["docs"]
            .as_array()
            .unwrap()
            .iter()
            .map(u64s)
            .collect();
        let lengths: Vec<u32> = seqs.iter().map(|s| s.len() as u32).collect();
        for (name, c) in v["research"].as_object().unwrap() {
            // Keys are L{L}_seed{seed}_ns{N}_extra{x}.
            let f: Vec<&str> = name.split('_').collect();
            let spec = MegatronSpec {
                seed: f[1].trim_start_matches("seed").parse().unwrap(),
                seq_len: f[0].trim_start_matches('L').parse().unwrap(),
                add_extra_token: f[3] == "extra1",
                num_samples: f[2].trim_start_matches("ns").parse().ok(),
                drop_last: true,
            };
            let ix = matches_vector(name, c, &seqs, &lengths, &spec, "first_samples");
            check_piece_sums(&ix, &lengths, &spec);
        }
    }

    /// Builds the index for `spec` and checks it against vector `c` (megatron-core's
    /// arrays and the token texts of its first items, under `texts`).
    fn matches_vector(
        name: &str,
        c: &Value,
        seqs: &[Vec<u64>],
        lengths: &[u32],
        spec: &MegatronSpec,
        texts: &str,
    ) -> MegatronIndex {
        let ix = MegatronIndex::build(lengths, spec).unwrap();
        assert_eq!(
            u64::from(ix.num_epochs),
            c["num_epochs"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            ix.separate_final_epoch,
            c["separate_final_epoch"].as_bool().unwrap(),
            "{name}"
        );
        assert_eq!(ix.document_index, u32s(&c["document_index"]), "{name}");
        assert_eq!(ix.sample_index, rows(&c["sample_index"]), "{name}");
        assert_eq!(ix.shuffle_index, u64s(&c["shuffle_index"]), "{name}");
        for (i, t) in c[texts].as_array().unwrap().iter().enumerate() {
            assert_eq!(text(&ix, seqs, spec, i as u64), u64s(t), "{name} item {i}");
        }
        ix
    }

    #[test]
    fn generated_vectors_match() {
        let v = vectors();
        for (name, c) in v["generated"].as_object().unwrap() {
            let seqs: Vec<Vec<u64>> = c["sequences"]
                .as_array()
                .unwrap()
                .iter()
                .map(u64s)
                .collect();
            let lengths = u32s(&c["lengths"]);
            let spec = MegatronSpec {
                seed: c["seed"].as_u64().unwrap() as u32,
                seq_len: c["seq_len"].as_u64().unwrap(),
                add_extra_token: c["add_extra_token"].as_bool().unwrap(),
                num_samples: c["num_samples"].as_u64(),
                drop_last: c["drop_last"].as_bool().unwrap(),
            };
            let ix = matches_vector(name, c, &seqs, &lengths, &spec, "first_texts");
            let tail = c["tail_dataset_index"].as_u64().unwrap();
            assert_eq!(
                text(&ix, &seqs, &spec, tail),
                u64s(&c["tail_text"]),
                "{name} tail"
            );
            check_piece_sums(&ix, &lengths, &spec);
        }
    }

    #[test]
    fn f32_ceil_sample_count() {
        // Expected values from numpy: ceil(float32(num) / float32(L)).
        assert_eq!(sample_count(16_777_217, 1, false), 16_777_216);
        assert_eq!(sample_count(16_777_219, 1, false), 16_777_220);
        assert_eq!(sample_count(33_554_433, 2, false), 16_777_216);
        assert_eq!(sample_count(16_777_221, 3, false), 5_592_407);
        assert_eq!(sample_count(16_777_217, 1, true), 16_777_217);
        assert_eq!(sample_count(10, 4, false), 3);
    }

    #[test]
    fn zero_length_piece_at_sequence_end() {
        // x = 0, lengths 4 and 4, L = 4: sample 1 starts at (0, 4), the end of sequence 0.
        let spec = MegatronSpec {
            seed: 1,
            seq_len: 4,
            add_extra_token: false,
            num_samples: None,
            drop_last: true,
        };
        let ix = MegatronIndex::build(&[4, 4], &spec).unwrap();
        assert_eq!(ix.sample_index, vec![(0, 0), (0, 4), (1, 4)]);
        for i in 0..2 {
            let p = ix.pieces(&[4, 4], i);
            assert_eq!(p.len(), 1);
            assert_eq!(p[0].2, 4);
        }
    }

    #[test]
    fn errors() {
        let spec = MegatronSpec {
            seed: 0,
            seq_len: 4,
            add_extra_token: true,
            num_samples: None,
            drop_last: true,
        };
        assert_eq!(
            MegatronIndex::build(&[], &spec),
            Err(MegatronError::NoTokens)
        );
        assert_eq!(
            MegatronIndex::build(&[0, 0], &spec),
            Err(MegatronError::NoTokens)
        );
        assert_eq!(
            MegatronIndex::build(&[2, 2], &spec),
            Err(MegatronError::TooFewTokens { tokens: 4, need: 5 })
        );
        // Asking for samples adds epochs instead.
        let more = MegatronSpec {
            num_samples: Some(3),
            ..spec
        };
        let ix = MegatronIndex::build(&[2, 2], &more).unwrap();
        assert_eq!(ix.num_epochs, 4);
        assert!(ix.len() >= 3);
        let zero = MegatronSpec { seq_len: 0, ..spec };
        assert_eq!(
            MegatronIndex::build(&[5], &zero),
            Err(MegatronError::SeqLen(0))
        );
        // seq_len 1 over 2^31 tokens: an index of 2^31 samples (48 GiB) is refused, not built.
        let one = MegatronSpec { seq_len: 1, ..spec };
        let huge = vec![u32::MAX / 2 + 1; 1];
        match MegatronIndex::build(&huge, &one) {
            Err(MegatronError::IndexTooLarge { samples, bytes }) => {
                assert_eq!(samples, (1 << 31) - 1);
                assert!(bytes > MAX_INDEX_BYTES, "{bytes}");
            }
            other => panic!("expected IndexTooLarge, got {other:?}"),
        }
        // drop_last = false, x = 1, data ending in an empty sequence: Megatron's offset -1.
        for seed in 0..8 {
            let nodrop = MegatronSpec {
                seed,
                drop_last: false,
                ..spec
            };
            let ends_empty = MegatronIndex::build(
                &[6, 0],
                &MegatronSpec {
                    drop_last: true,
                    ..nodrop
                },
            )
            .unwrap()
            .document_index
            .ends_with(&[1]);
            let got = MegatronIndex::build(&[6, 0], &nodrop);
            assert_eq!(got.is_err(), ends_empty, "seed {seed}");
            if ends_empty {
                assert_eq!(got, Err(MegatronError::EmptyFinalSequence));
            }
        }
        assert!(ix.pieces(&[2, 2], ix.len()).is_empty());
    }
}
