//! Repacking a batch-mode stream's shards: where the shards its next batch reads find no free
//! block of their slab class though their bytes fit, the shards held go back and the slabs of
//! all it reads are taken again, largest class first.
//!
//! The region's slab pool is a buddy allocator. Shards of mixed classes, held and freed in
//! the order the plan reads them, can leave free bytes only in blocks smaller than the class
//! the next shard needs; nothing else frees one (no fetch out, the trainer waiting for the
//! next batch), and the stream waited forever. Batch slabs have a part of the region of their
//! own ([`shardwire_gpu::SlabPool::set_apart`]), so the shards' part then holds only shards:
//! empty, it tiles its length as binary digits, and slabs whose classes (powers of two) add up
//! to at most its bytes always fit it when taken largest first. A repack that does not fit is
//! a batch that never will: the stream closes [`CloseReason::DoesNotFit`], never waits. (A
//! batch past the batches' own slots takes a block among the shards; while one is there, the
//! repack waits for its trainer to let go of it.)

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use shardwire_gpu::{Part, Slab, SlabPool};

use super::Driver;
use crate::stream::error::CloseReason;
use crate::stream::supply::Pending;

impl Driver {
    /// The bytes of the region's shard part, where batch slabs have a part of their own
    /// (None: they share the region).
    pub(super) fn shard_part(&self) -> Option<usize> {
        let pool = self.s.supply().pool();
        let (main, _) = pool.part(Part::Main);
        (main < pool.capacity()).then_some(main)
    }

    /// Takes slabs for the shards the next batch reads that no unit holds yet, largest class
    /// first, kept in `reserved` for [`Driver::hold`]; where they do not all fit, gives back
    /// the prefetched units and every shard held and takes the slabs of all the next batch
    /// reads the same way (the held ones are fetched again). False, and nothing done, while a
    /// fetch holds a slab (its slab comes back first) or where batch slabs share the region.
    pub(super) fn repack(&mut self) -> Result<bool, CloseReason> {
        let Some(main) = self.shard_part() else {
            return Ok(false);
        };
        // Fetches waiting for a shard no unit holds any more only hold its slab.
        let resident = &self.resident;
        self.fetches.drop_waiting(|s| resident.contains_key(&s));
        if self.fetches.busy() {
            return Ok(false);
        }
        self.reserved.clear();
        let mut fresh = self.to_hold_for_next_batch();
        fresh.retain(|s| !self.resident.contains_key(s));
        if let Some(slabs) = self.take_largest_first(&mut fresh) {
            self.reserved.extend(slabs);
            return Ok(true);
        }
        // A batch among the shards (one past the batches' own slots) goes back when its
        // trainer lets go of it: until then the shards' part is not theirs alone, and
        // largest first need not fit it.
        if self.batches_among_shards() {
            return Ok(false);
        }
        self.give_back_prefetch();
        let held: HashSet<u32> = self.resident.keys().copied().collect();
        let mut wanted: Vec<u32> = held.iter().copied().chain(fresh).collect();
        for r in self.resident.values_mut() {
            r.slab = None; // back to the pool
        }
        let Some(slabs) = self.take_largest_first(&mut wanted) else {
            if self.s.supply().is_closed() {
                // The trainer went: every slab is refused now, which says nothing of the fit.
                return Ok(false);
            }
            let m = self.s.supply().manifest();
            let need = wanted
                .iter()
                .map(|&s| SlabPool::class_size(m.shards[s as usize].length as usize) as u64)
                .sum();
            let capacity = self.s.supply().pool().capacity() as u64;
            // The batches' part: shards never take its blocks (`Driver::shard_part`).
            let why = CloseReason::DoesNotFit {
                shards: wanted.len(),
                need,
                reserve: capacity - main as u64,
                capacity,
            };
            tracing::error!(%why, "closing the stream");
            return Err(why);
        };
        tracing::warn!(
            shards = held.len(),
            "the next batch's shards found no free block of their class: fetching them again, largest first (a larger stream_memory avoids it)"
        );
        let c = self.s.supply().counters();
        c.shards_repacked
            .fetch_add(held.len() as u64, Ordering::Relaxed);
        for (shard, slab) in slabs {
            if held.contains(&shard) {
                self.fetches.fetch(Pending::of_shard(shard, slab))?;
            } else {
                self.reserved.insert(shard, slab);
            }
        }
        Ok(true)
    }

    /// Whether a batch slab lies in the shards' part: its bytes in use are more than the
    /// shards' and the reserved slabs' (with no fetch out, those are all the shards hold).
    fn batches_among_shards(&self) -> bool {
        let (_, used) = self.s.supply().pool().part(Part::Main);
        let shards: usize = self
            .resident
            .values()
            .filter_map(|r| r.slab.as_ref())
            .chain(self.reserved.values())
            .map(Slab::capacity)
            .sum();
        used > shards
    }

    /// Slabs for `shards` (sorted and deduplicated here), taken largest class first; None,
    /// with none kept, where one does not fit.
    fn take_largest_first(&mut self, shards: &mut Vec<u32>) -> Option<Vec<(u32, Slab)>> {
        let m = std::sync::Arc::clone(self.s.supply().manifest());
        let len = |s: u32| m.shards[s as usize].length as usize;
        shards.sort_unstable();
        shards.dedup();
        shards.sort_by_key(|&s| std::cmp::Reverse(SlabPool::class_size(len(s))));
        shards
            .iter()
            .map(|&s| self.fetches.alloc(len(s)).map(|slab| (s, slab)))
            .collect()
    }

    /// The shards of the units not held yet (whole or in part) that this worker's next
    /// batch reads.
    pub(super) fn to_hold_for_next_batch(&self) -> Vec<u32> {
        let upto = self.last_index(self.pos);
        self.not_held()
            .take_while(|&(first, _)| first <= upto)
            .flat_map(|(_, shards)| shards.iter().copied())
            .collect()
    }
}
