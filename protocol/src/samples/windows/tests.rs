//! Properties of token windows: they tile one stream of whole documents, storage order for
//! `none`, independent of the world size, covered by the units.

use std::collections::HashMap;

use proptest::prelude::*;

use super::super::{BatchPlan, SampleOrder, SampleRef, Shuffle};
use super::*;

fn spec(docs: &[Vec<u32>], seq_len: u64) -> WindowSpec {
    WindowSpec {
        seq_len,
        column: "tokens".into(),
        doc_tokens: docs.to_vec(),
        megatron: false,
    }
}

fn order(docs: &[Vec<u32>], l: u64, shuffle: Shuffle, block: u64, c: u32) -> Arc<SampleOrder> {
    Arc::new(SampleOrder::windows([3; 32], spec(docs, l), 9, shuffle, block, c).unwrap())
}

/// The tokens of a window as (document, offset) pairs.
fn tokens(w: &[TokenPiece]) -> Vec<(SampleRef, u64)> {
    w.iter()
        .flat_map(|p| (p.start..p.start + p.len).map(move |i| (p.doc, i)))
        .collect()
}

#[test]
fn none_reads_the_documents_in_storage_order_seq_len_apart() {
    let docs = vec![vec![5, 3], vec![7], vec![2, 6]]; // 23 tokens
    let o = order(&docs, 4, Shuffle::None, 1, 1);
    assert_eq!(o.total(), 5, "(23 - 1) / 4 windows");
    let mut stream = Vec::new();
    for (s, rows) in docs.iter().enumerate() {
        for (r, &n) in rows.iter().enumerate() {
            let doc = SampleRef {
                shard: s as u32,
                row: r as u64,
            };
            stream.extend((0..u64::from(n)).map(|i| (doc, i)));
        }
    }
    let ep = o.epoch(0);
    for i in 0..5u64 {
        let got = tokens(&ep.window(i));
        let at = (i * 4) as usize;
        assert_eq!(got, stream[at..at + 5], "window {i}");
    }
}

#[test]
fn bad_specs_are_refused_naming_the_rule() {
    let e = SampleOrder::windows([0; 32], spec(&[vec![4]], 4), 0, Shuffle::None, 1, 1);
    assert!(
        e.unwrap_err()
            .to_string()
            .contains("4 tokens hold no window of seq_len + 1 = 5")
    );
    let e = SampleOrder::windows([0; 32], spec(&[vec![4]], 0), 0, Shuffle::None, 1, 1);
    assert_eq!(e.unwrap_err(), SampleError::SeqLen { seq_len: 0 });
    // Before: refused as "at least 1 token", naming neither the value nor the limit.
    let long = i32::MAX as u64;
    let e = SampleOrder::windows([0; 32], spec(&[vec![4]], long), 0, Shuffle::None, 1, 1);
    let e = e.unwrap_err();
    assert_eq!(e, SampleError::SeqLen { seq_len: long });
    assert!(
        e.to_string().contains("seq_len is 2147483647")
            && e.to_string().contains("below 2147483647"),
        "{e}"
    );
    let e = SampleOrder::windows([0; 32], spec(&[vec![9]], 2), 0, Shuffle::None, 1, 5);
    assert!(matches!(
        e.unwrap_err(),
        SampleError::Partitions {
            partitions: 5,
            samples: 4
        }
    ));
}

/// Checks that the epoch's windows, chained by their overlap, are one stream in which every
/// document appears once, whole, its tokens in order; returns the stream's documents.
fn check_chain(o: &Arc<SampleOrder>, epoch: u32) -> Result<Vec<SampleRef>, TestCaseError> {
    let ep = o.epoch(epoch);
    let l = o.window_spec().unwrap().seq_len as usize;
    let windows: Vec<_> = (0..o.total()).map(|t| tokens(&ep.window(t))).collect();
    let by_first: HashMap<_, usize> = windows.iter().enumerate().map(|(i, w)| (w[0], i)).collect();
    prop_assert_eq!(
        by_first.len(),
        windows.len(),
        "two windows start at one token"
    );
    prop_assert!(windows.iter().all(|w| w.len() == l + 1));
    // The first window is the one no other window's last token starts.
    let lasts: std::collections::HashSet<_> = windows.iter().map(|w| w[l]).collect();
    let heads: Vec<usize> = (0..windows.len())
        .filter(|&i| !lasts.contains(&windows[i][0]))
        .collect();
    prop_assert_eq!(heads.len(), 1, "the windows form one chain");
    let mut stream = windows[heads[0]].clone();
    let mut at = heads[0];
    for _ in 1..windows.len() {
        at = *by_first
            .get(&windows[at][l])
            .ok_or_else(|| TestCaseError::fail("chain broken"))?;
        stream.extend_from_slice(&windows[at][1..]);
    }
    let mut docs = Vec::new();
    for (i, &(doc, off)) in stream.iter().enumerate() {
        if i == 0 || doc != stream[i - 1].0 {
            prop_assert!(!docs.contains(&doc), "{doc:?} appears twice");
            prop_assert!(i == 0 || off == 0, "{doc:?} entered at {off}");
            docs.push(doc);
        } else {
            prop_assert_eq!(off, stream[i - 1].1 + 1);
        }
    }
    Ok(docs)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]

    /// In every mode and partition count the windows tile one stream of whole documents;
    /// `none` keeps storage order, `block` shuffles documents and differs between epochs.
    #[test]
    fn windows_tile_one_stream_of_whole_documents(
        docs in proptest::collection::vec(proptest::collection::vec(0u32..12, 1..8), 1..12),
        l in 1u64..9, block in 1u64..20, c in 1u32..4, mode in 0usize..3,
    ) {
        let shuffle = [Shuffle::None, Shuffle::Shards, Shuffle::Block][mode];
        let s = spec(&docs, l);
        prop_assume!(s.windows() >= u64::from(c));
        let o = order(&docs, l, shuffle, block, c);
        let d0 = check_chain(&o, 0)?;
        check_chain(&o, 1)?;
        if shuffle == Shuffle::None {
            let mut sorted = d0.clone();
            sorted.sort();
            prop_assert_eq!(d0, sorted);
        }
    }

    /// A global step's windows are the same for every world size, and the units a rank is
    /// given cover every shard its windows read.
    #[test]
    fn window_steps_do_not_depend_on_the_world_size(
        docs in proptest::collection::vec(proptest::collection::vec(1u32..30, 1..6), 4..20),
        l in 1u64..16, block in 1u64..12, drop_last in any::<bool>(), megatron in any::<bool>(),
    ) {
        let mut s = spec(&docs, l);
        prop_assume!(s.windows() >= 8);
        s.megatron = megatron;
        let c = if megatron { 1 } else { 4 };
        let o = Arc::new(SampleOrder::windows([3; 32], s, 9, Shuffle::Block, block, c).unwrap());
        let ep = o.epoch(2);
        let mut by_world = Vec::new();
        for w in [1u32, 2, 4, 8] {
            let b = 8 / w;
            let plans: Vec<BatchPlan> = (0..w).map(|r| BatchPlan::new(Arc::clone(&o), b, w, r, drop_last).unwrap()).collect();
            let mut steps = Vec::new();
            for s in 0..plans[0].steps() {
                let mut set: Vec<_> = plans.iter().flat_map(|p| (0..b).map(move |j| (p, j))).map(|(p, j)| tokens(&p.window(&ep, s, j))).collect();
                set.sort();
                steps.push(set);
            }
            for p in &plans {
                let units = p.units(&ep);
                for i in 0..p.steps() * u64::from(b) {
                    let win = p.window(&ep, i / u64::from(b), (i % u64::from(b)) as u32);
                    for piece in win {
                        prop_assert!(units.iter().any(|u| u.first <= i && i <= u.last && u.shards.contains(&piece.doc.shard)),
                            "rank {} window {i} reads shard {} outside its units", p.rank, piece.doc.shard);
                    }
                }
            }
            by_world.push(steps);
        }
        for w in &by_world[1..] {
            prop_assert_eq!(w, &by_world[0]);
        }
    }
}

#[test]
fn a_rank_reading_many_partitions_keeps_a_block_table_for_each() {
    // 64 shards of 4 documents of 7 tokens, blocks of 4 documents, 32 partitions: a rank of
    // one reads them all, its windows rotating through 32 blocks at a time.
    let docs = vec![vec![7u32; 4]; 64];
    let o = order(&docs, 6, Shuffle::Block, 4, 32);
    let ep = o.epoch(0);
    for t in 0..o.total() {
        ep.window(t);
    }
    let d = ep.docs.as_ref().expect("window mode");
    // Before: 16, fewer than the rotation, so every window rebuilt its block's table.
    assert_eq!(d.cache.lock().unwrap().len(), 64.min(d.blocks.len()));
    assert!(d.blocks.len() >= 64, "{} blocks", d.blocks.len());
}

#[test]
fn block_mode_shuffles_documents_and_windows_within_bounded_blocks() {
    // 40 shards of 10 documents of 7 tokens; blocks of 20 documents = 2 shards.
    let docs = vec![vec![7u32; 10]; 40];
    let o = order(&docs, 10, Shuffle::Block, 20, 1);
    let ep = o.epoch(0);
    let shards: Vec<Vec<u32>> = (0..o.total())
        .map(|t| ep.window(t).iter().map(|p| p.doc.shard).collect())
        .collect();
    // Windows of one block (about 140 / 10 of them) read at most 3 shards together.
    for run in shards.chunks(13) {
        let mut s: Vec<u32> = run.iter().flatten().copied().collect();
        s.sort_unstable();
        s.dedup();
        assert!(s.len() <= 6, "{s:?}");
    }
    let first = |t| ep.window(t)[0];
    let in_order = (1..o.total())
        .filter(|&t| first(t).doc == first(t - 1).doc)
        .count();
    assert!(in_order < 60, "windows barely shuffled: {in_order}");
    assert_ne!(
        (0..o.total()).map(first).collect::<Vec<_>>(),
        {
            let e1 = o.epoch(1);
            (0..o.total()).map(|t| e1.window(t)[0]).collect::<Vec<_>>()
        },
        "epochs differ"
    );
}

#[test]
fn megatron_order_reads_gptdataset_items_and_refuses_what_it_cannot_reproduce() {
    let docs = vec![vec![6, 4, 9], vec![3, 8, 5, 7], vec![2, 10, 4]]; // the research vectors' lengths
    let mut s = spec(&docs, 4);
    s.megatron = true;
    let o = Arc::new(SampleOrder::windows([3; 32], s.clone(), 1234, Shuffle::Block, 1, 1).unwrap());
    let ep = o.epoch(0);
    let lengths: Vec<u32> = docs.iter().flatten().copied().collect();
    let spec0 = super::super::megatron::MegatronSpec {
        seed: 1234,
        seq_len: 4,
        add_extra_token: true,
        num_samples: None,
        drop_last: true,
    };
    let index = super::super::megatron::MegatronIndex::build(&lengths, &spec0).unwrap();
    assert_eq!(o.total(), index.len());
    assert_eq!(
        index.shuffle_index[..4],
        [3, 13, 2, 1],
        "GPTDataset's first items for seed 1234"
    );
    let starts = [0u32, 3, 7];
    for t in 0..o.total() {
        let want: Vec<(u32, u32, u32)> = index.pieces(&lengths, t);
        let got: Vec<(u32, u32, u32)> = ep
            .window(t)
            .iter()
            .map(|p| {
                (
                    starts[p.doc.shard as usize] + p.doc.row as u32,
                    p.start as u32,
                    p.len as u32,
                )
            })
            .collect();
        assert_eq!(got, want, "item {t}");
    }
    let e = SampleOrder::windows([3; 32], s.clone(), 1234, Shuffle::Block, 1, 2).unwrap_err();
    assert!(e.to_string().contains("partitions must be 1, not 2"), "{e}");
    let e = SampleOrder::windows([3; 32], s, 1 << 33, Shuffle::Block, 1, 1).unwrap_err();
    assert!(e.to_string().contains("32-bit seed"), "{e}");
}

#[test]
fn a_megatron_index_over_its_size_limit_is_refused_at_open_not_at_its_first_epoch() {
    // 32 documents of 2^32 - 1 tokens, seq_len 1: 1.4e11 windows, an index of terabytes.
    // Before, the order was made and its first epoch panicked ("checked by ...").
    let mut s = spec(&[vec![u32::MAX; 32]], 1);
    s.megatron = true;
    let e = SampleOrder::windows([0; 32], s, 1, Shuffle::Block, 1, 1).unwrap_err();
    assert!(
        matches!(e, SampleError::MegatronLimit(_)) && e.to_string().contains("over the limit"),
        "{e}"
    );
}
