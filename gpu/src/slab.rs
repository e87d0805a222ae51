//! The slab allocator: power-of-two size classes over one region, a free list per class,
//! buddy coalescing on free.
//!
//! Alloc and free are O(number of classes) (at most ~30), with no walk over allocations:
//! each class keeps a stack of free blocks plus a bitmap that says which of them are really
//! free (stale stack entries left behind by coalescing are skipped lazily). Coalescing
//! guarantees that a region with nothing live can always serve its largest class again, but
//! not that live slabs of mixed sizes leave a free block of the class a request needs,
//! though their bytes would allow it: a batch-mode stream sets its batch slabs apart
//! ([`SlabPool::set_apart`]) and, where its shards alone leave no block, gives them back and
//! takes them again largest first, which a buddy allocator always fits when their sizes fit
//! (the node's `stream::batcher`). Internal fragmentation is at most 2x per shard; size
//! stream regions with that in mind (docs/OPERATIONS.md).

use std::sync::{Arc, Mutex};

use crate::region::{Region, RegionError};

/// Smallest slab: one 4 KiB page (also the devmem net_iov size).
pub const MIN_BLOCK: usize = 4096;

struct Class {
    stack: Vec<usize>,
    free: Vec<u64>, // bitmap over block indices of this class
}

impl Class {
    fn new(blocks: usize) -> Self {
        Self {
            stack: Vec::new(),
            free: vec![0; blocks.div_ceil(64).max(1)],
        }
    }
    fn is_free(&self, i: usize) -> bool {
        self.free
            .get(i / 64)
            .is_some_and(|w| w >> (i % 64) & 1 == 1)
    }
    fn set(&mut self, i: usize, v: bool) {
        let w = &mut self.free[i / 64];
        if v {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }
    fn push(&mut self, i: usize) {
        self.set(i, true);
        self.stack.push(i);
    }
    fn pop(&mut self) -> Option<usize> {
        while let Some(i) = self.stack.pop() {
            if self.is_free(i) {
                self.set(i, false);
                return Some(i);
            }
        }
        None
    }
}

/// A buddy allocator over `[base, base + len)` of the region: its blocks are aligned
/// relative to `base`, so they tile its length as the binary digits of `len / MIN_BLOCK` do.
struct Arena {
    base: usize,
    len: usize,
    classes: Vec<Class>, // classes[k] holds blocks of MIN_BLOCK << k
    used: usize,
}

impl Arena {
    /// An arena of `len` bytes (a multiple of [`MIN_BLOCK`]) at `base`, all free.
    fn new(base: usize, len: usize) -> Self {
        let mut classes = Vec::new();
        let mut size = MIN_BLOCK;
        while size <= len {
            classes.push(Class::new(len / size));
            size <<= 1;
        }
        // Seed with the largest aligned blocks that tile [0, len).
        let mut off = 0;
        while off < len {
            let mut k = classes.len() - 1;
            while off % (MIN_BLOCK << k) != 0 || off + (MIN_BLOCK << k) > len {
                k -= 1;
            }
            classes[k].push(off / (MIN_BLOCK << k));
            off += MIN_BLOCK << k;
        }
        Self {
            base,
            len,
            classes,
            used: 0,
        }
    }

    /// The offset (in the region) of a free block of class `want`, now taken.
    fn alloc(&mut self, want: usize) -> Option<usize> {
        if want >= self.classes.len() {
            return None;
        }
        let (mut k, mut idx) =
            (want..self.classes.len()).find_map(|k| self.classes[k].pop().map(|i| (k, i)))?;
        while k > want {
            // Split: keep the lower half, free the upper half one class down.
            k -= 1;
            idx *= 2;
            self.classes[k].push(idx + 1);
        }
        self.used += MIN_BLOCK << want;
        Some(self.base + idx * (MIN_BLOCK << want))
    }

    /// Frees the block of class `class` at `offset` (in the region), coalescing buddies.
    fn free(&mut self, offset: usize, class: usize) {
        self.used -= MIN_BLOCK << class;
        let (mut k, mut idx) = (class, (offset - self.base) / (MIN_BLOCK << class));
        while k + 1 < self.classes.len() && self.classes[k].is_free(idx ^ 1) {
            self.classes[k].set(idx ^ 1, false);
            idx /= 2;
            k += 1;
        }
        self.classes[k].push(idx);
    }
}

struct Inner {
    /// `[shards]`, or `[shards, batches]` once [`SlabPool::set_apart`] split the region.
    arenas: Vec<Arena>,
}

/// Which part of a pool a slab comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The region, or its lower part where [`SlabPool::set_apart`] split it.
    Main,
    /// The part [`SlabPool::set_apart`] set apart at the top (the whole region where it
    /// was not split).
    Apart,
}

/// Hook run after every free (wakes whoever waits for memory).
pub type OnFree = Arc<dyn Fn() + Send + Sync>;

/// A region plus its allocator.
pub struct SlabPool {
    region: Region,
    inner: Mutex<Inner>,
    on_free: Mutex<Option<OnFree>>,
}

impl std::fmt::Debug for SlabPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlabPool")
            .field("len", &self.region.len())
            .field("used", &self.used())
            .finish()
    }
}

impl SlabPool {
    /// Wraps `region`; its usable size is rounded down to a multiple of [`MIN_BLOCK`].
    pub fn new(region: impl Into<Region>) -> Arc<Self> {
        let region = region.into();
        let usable = region.len() / MIN_BLOCK * MIN_BLOCK;
        Arc::new(Self {
            region,
            inner: Mutex::new(Inner {
                arenas: vec![Arena::new(0, usable)],
            }),
            on_free: Mutex::new(None),
        })
    }

    /// Sets the top `bytes` of the region apart (rounded up to [`MIN_BLOCK`]): slabs of
    /// [`Part::Apart`] come from there, the others from below, and no block crosses between
    /// them. Slabs of one size that come and go (a stream's batches) then never split the
    /// blocks that slabs of mixed sizes (its shards) need. False, and no change, while any
    /// slab is live, when already split, or when `bytes` is 0 or not less than the region.
    pub fn set_apart(&self, bytes: usize) -> bool {
        let mut inner = self.inner.lock().expect("poisoned");
        let usable = inner.arenas[0].len;
        let top = bytes.div_ceil(MIN_BLOCK) * MIN_BLOCK;
        if inner.arenas.len() != 1 || inner.arenas[0].used != 0 || top == 0 || top >= usable {
            return false;
        }
        let split = usable - top;
        inner.arenas = vec![Arena::new(0, split), Arena::new(split, top)];
        true
    }

    /// Sets the hook run after each free.
    pub fn set_on_free(&self, f: OnFree) {
        *self.on_free.lock().expect("poisoned") = Some(f);
    }

    /// The slab size (class) a request of `len` bytes takes; the largest power of two for
    /// a request above it (which no pool can serve: [`SlabPool::alloc`] refuses it).
    pub fn class_size(len: usize) -> usize {
        len.max(1)
            .checked_next_power_of_two()
            .unwrap_or(1 << (usize::BITS - 1))
            .max(MIN_BLOCK)
    }

    /// The largest request this pool can ever serve (from [`Part::Main`]).
    pub fn max_alloc(&self) -> usize {
        let n = self.inner.lock().expect("poisoned").arenas[0].classes.len();
        if n == 0 { 0 } else { MIN_BLOCK << (n - 1) }
    }

    /// Bytes held by live slabs (class sizes).
    pub fn used(&self) -> usize {
        let inner = self.inner.lock().expect("poisoned");
        inner.arenas.iter().map(|a| a.used).sum()
    }

    /// Usable bytes.
    pub fn capacity(&self) -> usize {
        self.region.len() / MIN_BLOCK * MIN_BLOCK
    }

    /// Usable bytes of `part`, and those live slabs hold there.
    pub fn part(&self, part: Part) -> (usize, usize) {
        let inner = self.inner.lock().expect("poisoned");
        let a = Self::arena(&inner, part);
        (a.len, a.used)
    }

    /// The arena of `part`: the last for [`Part::Apart`] (the only one where not split).
    fn arena(inner: &Inner, part: Part) -> &Arena {
        match part {
            Part::Main => &inner.arenas[0],
            Part::Apart => inner.arenas.last().expect("one arena at least"),
        }
    }

    /// The region (its kind, size and shareable fd).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// A slab of at least `len` bytes from [`Part::Main`], or None when no block is free
    /// right now.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<Slab> {
        self.alloc_in(Part::Main, len)
    }

    /// A slab of at least `len` bytes from `part`, or None when no block is free there now.
    pub fn alloc_in(self: &Arc<Self>, part: Part, len: usize) -> Option<Slab> {
        let class = Self::class_size(len);
        let want = class.trailing_zeros() as usize - MIN_BLOCK.trailing_zeros() as usize;
        // `len > class`: a request past the largest power of two (a peer's claimed length).
        if len > class {
            return None;
        }
        let mut inner = self.inner.lock().expect("poisoned");
        let arena = match part {
            Part::Main => 0,
            Part::Apart => inner.arenas.len() - 1,
        };
        let offset = inner.arenas[arena].alloc(want)?;
        debug_assert!(
            len <= MIN_BLOCK << want,
            "a slab's bytes lie inside its block"
        );
        Some(Slab {
            pool: Arc::clone(self),
            offset,
            class: want,
            arena,
            len,
        })
    }

    fn free(&self, offset: usize, class: usize, arena: usize) {
        self.inner.lock().expect("poisoned").arenas[arena].free(offset, class);
        // Called with the lock let go: a hook that frees a slab of this pool (or sets the
        // hook) would otherwise wait for itself.
        let hook = self.on_free.lock().expect("poisoned").clone();
        if let Some(f) = hook {
            f();
        }
    }
}

/// Exclusive ownership of `len` bytes at `offset` of a pool's region; freed on drop.
pub struct Slab {
    pool: Arc<SlabPool>,
    offset: usize,
    class: usize,
    /// The arena of the pool it came from.
    arena: usize,
    len: usize,
}

impl std::fmt::Debug for Slab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slab")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Slab {
    /// Offset in the region.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Requested length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a zero-length request.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes the slab's block holds (its size class): the most [`Slab::set_len`] takes.
    pub fn capacity(&self) -> usize {
        MIN_BLOCK << self.class
    }
    /// Changes the length within the block (a payload received into its head, then a
    /// larger view assembled behind it); false, and no change, beyond [`Slab::capacity`].
    pub fn set_len(&mut self, len: usize) -> bool {
        let fits = len <= self.capacity();
        if fits {
            self.len = len;
        }
        fits
    }
    /// The region the slab lies in.
    pub fn region(&self) -> &Region {
        &self.pool.region
    }
    /// The bytes, read-only, when the slab is in host memory (`None` for device memory).
    pub fn host_slice(&self) -> Option<&[u8]> {
        let host = self.pool.region.host()?;
        // SAFETY: [offset, offset+len) lies inside the live mapping (the pool's region,
        // kept alive by our Arc) and no other slab covers it (allocator invariant).
        Some(unsafe { std::slice::from_raw_parts(host.base().add(self.offset), self.len) })
    }
    /// The bytes, writable, when the slab is in host memory: only the owner of the slab
    /// can write them.
    pub fn host_slice_mut(&mut self) -> Option<&mut [u8]> {
        let host = self.pool.region.host()?;
        // SAFETY: as in `host_slice`, and `&mut self` makes this the only live reference.
        Some(unsafe { std::slice::from_raw_parts_mut(host.base().add(self.offset), self.len) })
    }
    /// A copy of `len` bytes from `start` (relative to the slab), from either memory.
    pub fn read(&self, start: usize, len: usize) -> Result<Vec<u8>, RegionError> {
        let end =
            start
                .checked_add(len)
                .filter(|&e| e <= self.len)
                .ok_or(RegionError::OutOfSlab {
                    start,
                    len,
                    slab: self.len,
                })?;
        match &self.pool.region {
            Region::Host(_) => Ok(self.host_slice().expect("host slab")[start..end].to_vec()),
            Region::Cuda(cuda) => {
                let mut out = vec![0; len];
                cuda.read(self.offset + start, &mut out)?;
                Ok(out)
            }
        }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        self.pool.free(self.offset, self.class, self.arena);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn pool(len: usize) -> Arc<SlabPool> {
        SlabPool::new(crate::HostRegion::new("slab-test", len).unwrap())
    }

    #[test]
    fn a_request_past_the_largest_power_of_two_is_refused() {
        // Before, `next_power_of_two` wrapped to 0 in release builds: a 4 KiB block handed
        // out as a slab of 2^63 + 1 bytes (a source's claimed shard length).
        let p = pool(1 << 20);
        for len in [(1usize << 63) + 1, usize::MAX] {
            assert_eq!(SlabPool::class_size(len), 1 << 63);
            assert!(p.alloc(len).is_none(), "{len}");
        }
        assert!(p.alloc((1 << 20) + 1).is_none());
        assert_eq!(p.alloc(1 << 20).unwrap().capacity(), 1 << 20);
    }

    #[test]
    fn set_len_stays_within_the_block() {
        let p = pool(1 << 20);
        let mut a = p.alloc(5000).unwrap();
        assert_eq!(a.capacity(), 8192);
        assert!(a.set_len(3000) && a.len() == 3000 && a.host_slice().unwrap().len() == 3000);
        assert!(a.set_len(8192) && a.host_slice_mut().unwrap().len() == 8192);
        assert!(!a.set_len(8193) && a.len() == 8192);
    }

    #[test]
    fn alloc_split_and_coalesce() {
        let p = pool(1 << 20);
        assert_eq!(p.max_alloc(), 1 << 20);
        let a = p.alloc(5000).unwrap(); // 8 KiB class
        assert_eq!(p.used(), 8192);
        let b = p.alloc(512 << 10).unwrap();
        assert!(p.alloc(512 << 10).is_none(), "the other half is split");
        drop(a);
        assert!(p.alloc(512 << 10).is_some_and(|s| s.offset() != b.offset()));
        drop(b);
        assert_eq!(p.used(), 0);
        assert!(p.alloc(1 << 20).is_some(), "everything coalesced back");
        assert!(p.alloc((1 << 20) + 1).is_none());
    }

    #[test]
    fn slabs_are_disjoint_and_writable() {
        let p = pool(256 << 10);
        let mut slabs: Vec<Slab> = (0..16).map(|_| p.alloc(10_000).unwrap()).collect();
        assert!(p.alloc(1).is_none());
        for (i, s) in slabs.iter_mut().enumerate() {
            s.host_slice_mut().unwrap().fill(i as u8);
        }
        for (i, s) in slabs.iter().enumerate() {
            assert!(s.host_slice().unwrap().iter().all(|&b| b == i as u8));
        }
    }

    #[test]
    fn odd_region_size_is_tiled() {
        let p = pool(3 * 4096 + 100);
        assert_eq!(p.capacity(), 3 * 4096);
        let a = p.alloc(8192).unwrap();
        let b = p.alloc(4096).unwrap();
        assert!(p.alloc(4096).is_none());
        assert_ne!(a.offset(), b.offset());
    }

    #[test]
    fn on_free_hook_runs() {
        let p = pool(64 << 10);
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = Arc::clone(&hits);
        p.set_on_free(Arc::new(move || {
            h.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }));
        drop(p.alloc(1).unwrap());
        assert_eq!(hits.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn a_hook_that_frees_a_slab_of_its_pool_does_not_wait_for_itself() {
        // Before, the hook ran with its lock held: freeing a slab inside it locked it again
        // on the same thread, and the drop never returned.
        let p = pool(64 << 10);
        let stash: Arc<std::sync::Mutex<Option<Slab>>> = Arc::default();
        let s = Arc::clone(&stash);
        p.set_on_free(Arc::new(move || {
            let held = s.lock().unwrap().take();
            drop(held);
        }));
        *stash.lock().unwrap() = Some(p.alloc(4096).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let p2 = Arc::clone(&p);
        std::thread::spawn(move || {
            drop(p2.alloc(1).unwrap());
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the free returned");
        assert!(stash.lock().unwrap().is_none());
    }

    #[test]
    fn a_part_set_apart_serves_its_slabs_and_no_block_crosses_into_it() {
        let p = pool((172 << 10) + 100); // 172 KiB usable: 128 + 32 + 8 + 4
        let held = p.alloc(1).unwrap();
        assert!(!p.set_apart(48 << 10), "refused while a slab is live");
        drop(held);
        assert!(!p.set_apart(0) && !p.set_apart(172 << 10));
        assert!(p.set_apart(48 << 10));
        assert!(!p.set_apart(16 << 10), "split once");
        assert_eq!(p.part(Part::Main), (124 << 10, 0));
        assert_eq!(p.part(Part::Apart), (48 << 10, 0));
        // Three 16 KiB batch slabs fill the part set apart, whatever the shards do.
        let batches: Vec<Slab> = (0..3)
            .map(|_| p.alloc_in(Part::Apart, 16 << 10).unwrap())
            .collect();
        assert!(p.alloc_in(Part::Apart, 1).is_none());
        assert!(batches.iter().all(|b| b.offset() >= 124 << 10));
        // The main part still holds its 64 + 32 + 16 + 8 + 4 KiB blocks.
        let shards: Vec<Slab> = [64, 32, 16, 8, 4].map(|k| p.alloc(k << 10).unwrap()).into();
        assert!(
            shards
                .iter()
                .all(|s| s.offset() + s.capacity() <= 124 << 10)
        );
        assert_eq!(p.used(), (48 + 124) << 10);
        drop(batches);
        drop(shards);
        assert_eq!(p.used(), 0);
        assert!(
            p.alloc(65 << 10).is_none(),
            "no block of the main part grows past it"
        );
    }

    proptest! {
        /// Slabs whose classes add up to at most a part's bytes all fit it when taken largest
        /// first (each part's blocks tile its length as binary digits, and classes divide
        /// each other): what the batcher's repacking relies on.
        #[test]
        fn classes_that_fit_in_bytes_fit_largest_first(
            main_pages in 1usize..200,
            sizes in proptest::collection::vec(1usize..200_000, 1..40),
        ) {
            let p = pool((main_pages + 5) * MIN_BLOCK);
            prop_assert!(p.set_apart(5 * MIN_BLOCK));
            let (cap, _) = p.part(Part::Main);
            let mut classes: Vec<usize> = sizes.iter().map(|&n| SlabPool::class_size(n)).collect();
            classes.sort_unstable_by(|a, b| b.cmp(a));
            let mut total = 0;
            classes.retain(|&c| {
                let keep = total + c <= cap;
                total += if keep { c } else { 0 };
                keep
            });
            let live: Vec<Slab> = classes.iter().map(|&c| p.alloc(c)).collect::<Option<_>>()
                .expect("every class fits largest first");
            prop_assert_eq!(p.part(Part::Main).1, total);
            drop(live);
        }

        /// Random alloc/free sequences never overlap, never exceed capacity, and end empty.
        #[test]
        fn random_workload(ops in proptest::collection::vec((any::<bool>(), 1usize..70_000), 1..200)) {
            let p = pool(512 << 10);
            let mut live: Vec<Slab> = Vec::new();
            for (alloc, size) in ops {
                if alloc || live.is_empty() {
                    if let Some(s) = p.alloc(size) {
                        let (a0, a1) = (s.offset(), s.offset() + SlabPool::class_size(size));
                        for o in &live {
                            let (b0, b1) = (o.offset(), o.offset() + SlabPool::class_size(o.len()));
                            prop_assert!(a1 <= b0 || b1 <= a0, "overlap");
                        }
                        prop_assert!(a1 <= p.capacity());
                        live.push(s);
                    }
                } else {
                    live.swap_remove(size % live.len());
                }
                prop_assert!(p.used() <= p.capacity());
            }
            live.clear();
            prop_assert_eq!(p.used(), 0);
            prop_assert!(p.alloc(512 << 10).is_some());
        }
    }
}
