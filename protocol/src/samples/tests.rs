//! Properties of the sample order and the batch plans.

use std::collections::{BTreeMap, HashMap, HashSet};

use proptest::prelude::*;

use super::*;

fn order(sizes: &[u64], shuffle: Shuffle, block: u64, c: u32) -> Arc<SampleOrder> {
    Arc::new(SampleOrder::new([5; 32], sizes.to_vec(), 77, shuffle, block, c).unwrap())
}

fn all_samples(sizes: &[u64]) -> Vec<SampleRef> {
    let mut v = Vec::new();
    for (s, &n) in sizes.iter().enumerate() {
        for row in 0..n {
            v.push(SampleRef {
                shard: s as u32,
                row,
            });
        }
    }
    v
}

/// The epoch's global sequence.
fn global(o: &Arc<SampleOrder>, epoch: u32) -> Vec<SampleRef> {
    let ep = o.epoch(epoch);
    (0..o.total()).map(|t| ep.sample(t)).collect()
}

#[test]
fn none_is_storage_order_and_shards_keeps_rows_in_order() {
    let sizes = [3, 1, 4, 2];
    assert_eq!(
        global(&order(&sizes, Shuffle::None, 1, 1), 0),
        all_samples(&sizes)
    );
    let g = global(&order(&sizes, Shuffle::Shards, 1, 1), 0);
    for w in g.windows(2) {
        if w[0].shard == w[1].shard {
            assert_eq!(w[1].row, w[0].row + 1, "{g:?}");
        }
    }
    let runs = g.windows(2).filter(|w| w[0].shard != w[1].shard).count();
    assert_eq!(runs, sizes.len() - 1, "each shard is one run: {g:?}");
}

#[test]
fn block_mode_shuffles_within_blocks_of_whole_shards() {
    let sizes = vec![10u64; 20];
    let o = order(&sizes, Shuffle::Block, 30, 1);
    let ep = o.epoch(0);
    let g: Vec<_> = (0..o.total()).map(|t| ep.sample(t)).collect();
    // Every run of 30 samples (a block of three 10-sample shards) uses exactly 3 shards;
    // the last block has the 20 left.
    for b in g.chunks(30) {
        let shards: HashSet<u32> = b.iter().map(|s| s.shard).collect();
        assert_eq!(shards.len(), b.len() / 10, "{b:?}");
    }
    let in_order = g
        .windows(2)
        .filter(|w| w[0].shard == w[1].shard && w[1].row == w[0].row + 1)
        .count();
    assert!(
        in_order < 40,
        "barely shuffled: {in_order} consecutive pairs"
    );
    assert_ne!(
        g,
        global(&order(&sizes, Shuffle::Block, 30, 1), 1),
        "epochs differ"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every epoch's G is a permutation of all samples, for every mode and partition count.
    #[test]
    fn each_epoch_is_a_permutation(sizes in proptest::collection::vec(1u64..40, 1..30),
                                   c in 1u32..9, block in 1u64..60, mode in 0u8..3, epoch in 0u32..3) {
        let total: u64 = sizes.iter().sum();
        prop_assume!(u64::from(c) <= total);
        let shuffle = [Shuffle::None, Shuffle::Shards, Shuffle::Block][mode as usize];
        let mut g = global(&order(&sizes, shuffle, block, c), epoch);
        g.sort();
        prop_assert_eq!(g, all_samples(&sizes));
    }

    /// A batch's samples computed together are each sample computed alone, for every mode,
    /// partition count, world size, rank and step (the last step wrapping without drop_last).
    #[test]
    fn batch_samples_are_each_sample(sizes in proptest::collection::vec(1u64..300, 1..30),
                                     c in 1u32..5, world_mul in 1u32..3, block in 1u64..400,
                                     mode in 0u8..3, batch in 1u32..300, drop_last in any::<bool>()) {
        prop_assume!(u64::from(c) <= sizes.iter().sum::<u64>()); // a partition per sample at most
        let shuffle = [Shuffle::None, Shuffle::Shards, Shuffle::Block][mode as usize];
        let o = order(&sizes, shuffle, block, c);
        let w = c * world_mul;
        prop_assume!(o.total() >= u64::from(w * batch));
        let ep = o.epoch(2);
        for rank in [0, w - 1] {
            let plan = BatchPlan::new(Arc::clone(&o), batch, w, rank, drop_last).unwrap();
            for step in [0, plan.steps() / 2, plan.steps() - 1] {
                let each: Vec<SampleRef> = (0..batch).map(|j| plan.sample(&ep, step, j)).collect();
                prop_assert_eq!(plan.batch_samples(&ep, step), each, "rank {} step {}", rank, step);
            }
        }
    }

    /// A global step's set of samples is the same for every world size that fits, and every
    /// rank gets the same number of batches; the units a rank is given cover its samples.
    #[test]
    fn steps_do_not_depend_on_the_world_size(sizes in proptest::collection::vec(1u64..30, 4..40),
                                              block in 1u64..50, drop_last in any::<bool>()) {
        let o = order(&sizes, Shuffle::Block, block, 4);
        prop_assume!(o.total() >= 8);
        let ep = o.epoch(1);
        let gb = 8u64;
        let mut by_world: Vec<Vec<Vec<SampleRef>>> = Vec::new();
        for w in [1u32, 2, 4, 8] {
            let b = (gb / u64::from(w)) as u32;
            let plans: Vec<BatchPlan> = (0..w).map(|r| BatchPlan::new(Arc::clone(&o), b, w, r, drop_last).unwrap()).collect();
            let steps = plans[0].steps();
            prop_assert!(plans.iter().all(|p| p.steps() == steps));
            let mut per_step = Vec::new();
            for s in 0..steps {
                let mut set: Vec<SampleRef> = plans.iter().flat_map(|p| (0..b).map(move |j| (p, j))).map(|(p, j)| p.sample(&ep, s, j)).collect();
                set.sort();
                per_step.push(set);
            }
            for p in &plans {
                let units = p.units(&ep);
                for i in 0..steps * u64::from(b) {
                    let s = p.sample(&ep, i / u64::from(b), (i % u64::from(b)) as u32);
                    prop_assert!(units.iter().any(|u| u.first <= i && i <= u.last && u.shards.contains(&s.shard)),
                        "rank {} sample {i} ({s:?}) is in no unit", p.rank);
                }
                prop_assert!(units.windows(2).all(|u| u[0].first <= u[1].first));
            }
            by_world.push(per_step);
        }
        for w in &by_world[1..] {
            prop_assert_eq!(w, &by_world[0]);
        }
    }
}

/// The epoch's tail as it was computed before it was bounded: every index of it, one by one.
fn tail_index_by_index(p: &BatchPlan, ep: &EpochOrder) -> Option<Unit> {
    let (first, end) = (p.regular_limit(), p.steps() * u64::from(p.batch_size));
    let mut shards: Vec<u32> = (first..end)
        .flat_map(|i| ep.shards_at(p.position(i)))
        .collect();
    shards.sort_unstable();
    shards.dedup();
    (first < end).then(|| Unit {
        first,
        last: end - 1,
        shards,
    })
}

#[test]
fn a_tail_longer_than_the_epoch_reads_it_once() {
    // 30 and 31 samples (one shard empty; 31 splits unevenly) in 3 partitions, over world
    // sizes below, at and above the partition count.
    for sizes in [[5u64, 0, 7, 3, 9, 6], [5, 0, 7, 3, 9, 7]] {
        let o = order(&sizes, Shuffle::Block, 4, 3);
        let ep = o.epoch(1);
        for (b, w, drop_last) in [
            (7, 1, false),
            (4, 3, true),
            (11, 3, false),
            (1000, 3, false),
            (3, 6, false),
            (2, 6, true),
            (40, 6, false),
        ] {
            for r in 0..w {
                let p = BatchPlan::new(Arc::clone(&o), b, w, r, drop_last).unwrap();
                assert_eq!(
                    p.tail(&ep),
                    tail_index_by_index(&p, &ep),
                    "{sizes:?}: batch {b} world {w} rank {r}"
                );
            }
        }
    }
    let sizes = [5u64, 0, 7, 3, 9, 6];
    let o = order(&sizes, Shuffle::Block, 4, 3);
    let ep = o.epoch(1);
    // A batch of 2^32 - 1 is one step holding the epoch over 143 million times. Before: 2^32
    // shard lookups and a 16 GiB list at attach; now one pass of 30.
    let p = BatchPlan::new(Arc::clone(&o), u32::MAX, 1, 0, false).unwrap();
    let tail = p.tail(&ep).expect("the wrap is a tail");
    assert_eq!((tail.first, tail.last), (30, u64::from(u32::MAX) - 1));
    assert_eq!(tail.shards, vec![0, 2, 3, 4, 5]);
}

#[test]
fn drop_last_drops_less_than_a_global_batch_and_otherwise_repeats_less() {
    let sizes = vec![7u64; 9]; // 63 samples
    let o = order(&sizes, Shuffle::Block, 10, 2);
    let ep = o.epoch(0);
    for (drop_last, steps) in [(true, 3u64), (false, 4)] {
        let plans: Vec<_> = (0..2)
            .map(|r| BatchPlan::new(Arc::clone(&o), 8, 2, r, drop_last).unwrap())
            .collect();
        assert_eq!(plans[0].steps(), steps);
        let mut count: HashMap<SampleRef, u32> = HashMap::new();
        for p in &plans {
            for s in 0..p.steps() {
                for j in 0..8 {
                    *count.entry(p.sample(&ep, s, j)).or_default() += 1;
                }
            }
        }
        let seen = count.len() as u64;
        if drop_last {
            assert!(count.values().all(|&c| c == 1));
            assert!(63 - seen < 16 && seen == 48);
        } else {
            assert_eq!(seen, 63, "every sample at least once");
            let repeats: u32 = count.values().map(|c| c - 1).sum();
            assert_eq!(repeats, 64 - 63);
        }
    }
    let e = BatchPlan::new(Arc::clone(&o), 40, 2, 0, true).unwrap_err();
    assert!(e.to_string().contains("leaves no batch"), "{e}");
}

#[test]
fn world_sizes_that_do_not_fit_are_refused_and_others_read_whole_partitions() {
    let sizes = vec![20u64; 32];
    let o = order(&sizes, Shuffle::Block, 40, 4);
    let e = BatchPlan::new(Arc::clone(&o), 4, 3, 0, false).unwrap_err();
    assert_eq!(
        e,
        SampleError::DoesNotFit {
            world_size: 3,
            partitions: 4
        }
    );
    let ep = o.epoch(0);
    // W = C: each rank's shards are (apart from shards split at a partition cut) its own.
    let mut owner: BTreeMap<u32, HashSet<u32>> = BTreeMap::new();
    for r in 0..4 {
        let p = BatchPlan::new(Arc::clone(&o), 4, 4, r, true).unwrap();
        for u in p.units(&ep) {
            for s in u.shards {
                owner.entry(s).or_default().insert(r);
            }
        }
    }
    let shared = owner.values().filter(|r| r.len() > 1).count();
    assert_eq!(
        shared, 0,
        "640 samples cut at 160s: partitions end at shard ends"
    );
}

#[test]
fn a_billion_samples_over_a_million_shards_plan_in_little_memory() {
    let sizes = vec![1000u64; 1_000_000];
    let o = Arc::new(SampleOrder::new([9; 32], sizes, 3, Shuffle::Block, 16_000, 8).unwrap());
    assert_eq!(o.total(), 1_000_000_000);
    let ep = o.epoch(5);
    let bytes = ep.table_bytes() + o.shard_samples().len() * 8;
    assert!(bytes < 100 << 20, "{bytes} bytes of plan");
    // Resuming anywhere is arithmetic: a few positions deep into the epoch.
    let p = BatchPlan::new(Arc::clone(&o), 512, 8, 3, true).unwrap();
    let step = p.steps() * 2 / 3;
    let a = p.sample(&ep, step, 0);
    assert_eq!(a, ep.sample(p.position(step * 512)));
    assert!(u64::from(a.shard) < 1_000_000 && a.row < 1000);
}

#[test]
fn partitions_are_capped_whatever_the_dataset_holds() {
    // 2^31 samples in one shard: the sample count alone would allow 2^31 partitions.
    let ok = SampleOrder::new(
        [1; 32],
        vec![1 << 31],
        0,
        Shuffle::Block,
        1 << 20,
        MAX_PARTITIONS,
    );
    assert!(ok.is_ok());
    let e = SampleOrder::new(
        [1; 32],
        vec![1 << 31],
        0,
        Shuffle::Block,
        1 << 20,
        MAX_PARTITIONS + 1,
    )
    .unwrap_err();
    assert_eq!(
        e,
        SampleError::Partitions {
            partitions: MAX_PARTITIONS + 1,
            samples: 1 << 31
        }
    );
    assert!(e.to_string().contains("at most 1048576"), "{e}");
}

#[test]
fn partition_cuts_of_a_huge_dataset_do_not_wrap() {
    // total * i passed 2^64: partition starts wrapped (overlapping partitions, samples twice).
    let (total, c) = (u64::MAX / 2, 1u64 << 20);
    let starts: Vec<u64> = (0..=c).map(|i| super::cut_at(total, i, c)).collect();
    assert!(starts.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!((starts[0], starts[c as usize]), (0, total));
    assert_eq!(super::cut_at(10, 3, 4), 7);
}

/// Sample counts that add up past 2^64 - 1 (zero-byte rows let a manifest claim any count) are
/// refused, not summed with a wrap that leaves an unsorted prefix table.
#[test]
fn sample_counts_past_u64_are_refused() {
    let huge = [1u64 << 62; 4];
    let sizes: Vec<u64> = huge.iter().copied().chain([5]).collect();
    let e = SampleOrder::new([5; 32], sizes, 7, Shuffle::Block, 64, 1).unwrap_err();
    assert!(
        matches!(e, SampleError::TooManySamples { shards: 5 }),
        "{e}"
    );
    // Just below the limit is fine.
    let ok = vec![u64::MAX / 2, u64::MAX / 2];
    assert!(SampleOrder::new([5; 32], ok, 7, Shuffle::Block, 64, 1).is_ok());
}

/// The row order each block (here: each shard, blocks and shards of 16 rows) gets, over every
/// partition of epoch 0 under `keys`.
fn block_orders(keys: BlockKeys) -> Vec<Vec<u64>> {
    let mut o = SampleOrder::new([5; 32], vec![16; 32], 77, Shuffle::Block, 16, 4).unwrap();
    o.block_keys = keys;
    let o = Arc::new(o);
    let ep = o.epoch(0);
    let mut rows: Vec<Vec<u64>> = vec![Vec::new(); 32];
    for t in 0..o.total() {
        let r = ep.sample(t);
        rows[r.shard as usize].push(r.row);
    }
    rows
}

/// Every block is shuffled by a permutation of its own. Before, a block's key was its
/// partition's first block plus its offset in samples: blocks of different partitions shared
/// keys, and so the same row order.
#[test]
fn blocks_of_different_partitions_get_permutations_of_their_own() {
    let distinct = |v: &[Vec<u64>]| v.iter().collect::<HashSet<_>>().len();
    let legacy = block_orders(BlockKeys::Legacy);
    assert!(
        distinct(&legacy) <= 24,
        "the old keys collide: {}",
        distinct(&legacy)
    );
    let global = block_orders(BlockKeys::Global);
    assert_eq!(distinct(&global), 32, "one permutation per block");
    for rows in &global {
        let mut sorted = rows.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..16).collect::<Vec<_>>(), "each row once");
    }
}

/// A `block` order's fingerprint names its keys; a state saved without them resumes with the
/// legacy keys (same order as when it was saved), and a mixture's dataset is read by its name.
#[test]
fn the_fingerprint_names_the_block_keys_and_old_states_keep_theirs() {
    let o = Arc::new(SampleOrder::new([5; 32], vec![16; 8], 1, Shuffle::Block, 16, 2).unwrap());
    let plan = BatchPlan::new(Arc::clone(&o), 4, 1, 0, false).unwrap();
    let f = plan.fingerprint(&[5; 32]);
    assert!(f.ends_with(";block_keys=global"), "{f}");
    assert_eq!(BlockKeys::of_state(&f, ""), BlockKeys::Global);
    let old = f.trim_end_matches(";block_keys=global");
    assert_eq!(BlockKeys::of_state(old, ""), BlockKeys::Legacy);
    let mut legacy = SampleOrder::new([5; 32], vec![16; 8], 1, Shuffle::Block, 16, 2).unwrap();
    legacy.block_keys = BlockKeys::Legacy;
    let legacy = BatchPlan::new(Arc::new(legacy), 4, 1, 0, false).unwrap();
    assert_eq!(
        legacy.fingerprint(&[5; 32]),
        old,
        "the old state's fingerprint matches"
    );
    // Orders without block permutations name no keys.
    let shards =
        Arc::new(SampleOrder::new([5; 32], vec![16; 8], 1, Shuffle::Shards, 16, 2).unwrap());
    let f = BatchPlan::new(shards, 4, 1, 0, false)
        .unwrap()
        .fingerprint(&[5; 32]);
    assert!(!f.contains("block_keys"), "{f}");
    assert_eq!(BlockKeys::of_state(&f, ""), BlockKeys::Global);
    // A mixture's fields carry the dataset's name.
    let mix = "v2;mix=a+b;a.shuffle=block;a.block_keys=global;b.shuffle=block";
    assert_eq!(BlockKeys::of_state(mix, "a."), BlockKeys::Global);
    assert_eq!(BlockKeys::of_state(mix, "b."), BlockKeys::Legacy);
}
