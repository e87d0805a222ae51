//! Stream admission and the memory budget, under one lock: the open streams, the bytes of
//! each lane's pool (`pool_size` per lane) they reserve, and whether the node is draining. A
//! stream is admitted by a [`Reservation`] on one lane that returns its bytes unless it is
//! committed, so a failed open never leaks budget; removing a stream returns its bytes to its
//! lane exactly once. [`Admission::reserve_least_loaded`] is where a stream without a device goes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Why a stream is not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The node is draining.
    #[error("the node service is draining and accepts no new streams")]
    Draining,
    /// Not enough of the lane's pool left.
    #[error(
        "lane {lane}'s pool is exhausted: {reserved} of pool_size {pool} bytes reserved by its open streams; a stream needs {need} (stream_memory, rounded up to the lane's memory's allocation unit)"
    )]
    Exhausted {
        /// The lane.
        lane: u32,
        /// Bytes reserved by its open streams.
        reserved: u64,
        /// `pool_size`.
        pool: u64,
        /// What the stream needs.
        need: u64,
    },
}

struct Inner<S> {
    /// Stream id -> (stream, bytes, lane).
    streams: HashMap<u64, (Arc<S>, u64, u32)>,
    /// Bytes reserved per lane.
    reserved: Vec<u64>,
    draining: bool,
}

/// The open streams and the budget they hold.
pub struct Admission<S> {
    /// Each lane's pool.
    pools: Vec<u64>,
    /// Each lane's region unit: a stream there takes its bytes rounded up to a multiple of it
    /// (a CUDA region is made of 2 MiB pages; host memory: 1).
    units: Vec<u64>,
    inner: Mutex<Inner<S>>,
}

/// Bytes set aside on a lane for a stream being opened; given back on drop unless committed.
#[must_use = "a reservation is given back when dropped"]
pub struct Reservation<'a, S> {
    adm: &'a Admission<S>,
    lane: u32,
    bytes: u64,
    committed: bool,
}

impl<S> Admission<S> {
    /// No streams; lane `i` has `pools[i]` bytes to give out.
    pub fn new(pools: Vec<u64>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                streams: HashMap::new(),
                reserved: vec![0; pools.len()],
                draining: false,
            }),
            units: vec![1; pools.len()],
            pools,
        }
    }

    /// Lane `i`'s streams take their bytes rounded up to a multiple of `units[i]` (what its
    /// memory allocates: a CUDA region of 64 KiB takes 2 MiB of the GPU).
    pub fn with_units(mut self, units: Vec<u64>) -> Self {
        debug_assert_eq!(units.len(), self.pools.len());
        self.units = units.into_iter().map(|u| u.max(1)).collect();
        self
    }

    /// The lanes where a stream of `bytes` never fits, however empty: its rounded need passes
    /// the lane's whole pool.
    pub fn never_fits(&self, bytes: u64) -> impl Iterator<Item = (usize, u64)> + '_ {
        (0..self.pools.len())
            .map(move |l| (l, self.need(l, bytes)))
            .filter(|&(l, need)| need > self.pools[l])
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<S>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets `bytes` of lane `lane`'s pool aside for a new stream.
    pub fn reserve(&self, lane: u32, bytes: u64) -> Result<Reservation<'_, S>, AdmitError> {
        let mut i = self.lock();
        self.reserve_in(&mut i, lane, bytes)
    }

    /// Sets `bytes` aside on the least loaded lane (first the lanes where `bytes` fit, rounded
    /// up to each lane's unit; then the most bytes free, reservations of streams still opening
    /// included; then the fewest streams, then the lowest id), choosing and reserving under
    /// one lock: streams opened at the same moment spread over the lanes.
    pub fn reserve_least_loaded(&self, bytes: u64) -> Result<Reservation<'_, S>, AdmitError> {
        let mut i = self.lock();
        let lane = self.least_loaded_in(&i, bytes);
        self.reserve_in(&mut i, lane, bytes)
    }

    /// `bytes` rounded up to lane `l`'s unit: what a stream of them takes there.
    fn need(&self, l: usize, bytes: u64) -> u64 {
        let unit = self.units[l];
        bytes.div_ceil(unit).saturating_mul(unit)
    }

    fn reserve_in(
        &self,
        i: &mut Inner<S>,
        lane: u32,
        bytes: u64,
    ) -> Result<Reservation<'_, S>, AdmitError> {
        if i.draining {
            return Err(AdmitError::Draining);
        }
        let l = lane as usize;
        let bytes = self.need(l, bytes);
        if i.reserved[l].saturating_add(bytes) > self.pools[l] {
            return Err(AdmitError::Exhausted {
                lane,
                reserved: i.reserved[l],
                pool: self.pools[l],
                need: bytes,
            });
        }
        i.reserved[l] += bytes;
        Ok(Reservation {
            adm: self,
            lane,
            bytes,
            committed: false,
        })
    }

    /// The lane a stream without a device goes to: the most bytes free (reservations of
    /// streams still opening count), then the fewest streams, then the lowest id (where a
    /// stream's size is known, [`Admission::reserve_least_loaded`] puts the lanes it fits
    /// first).
    pub fn least_loaded(&self) -> u32 {
        let i = self.lock();
        self.least_loaded_in(&i, 1)
    }

    /// First the lanes a stream of `bytes` fits (rounded up to each lane's unit), then the
    /// most bytes free, the fewest streams, the lowest id.
    fn least_loaded_in(&self, i: &Inner<S>, bytes: u64) -> u32 {
        let streams = |lane: usize| i.streams.values().filter(|v| v.2 as usize == lane).count();
        (0..self.pools.len())
            .min_by_key(|&l| {
                let free = self.pools[l].saturating_sub(i.reserved[l]);
                (
                    self.need(l, bytes) > free,
                    std::cmp::Reverse(free),
                    streams(l),
                    l,
                )
            })
            .unwrap_or(0) as u32
    }

    /// Removes stream `id`, returning its budget; `None` if it is not open (closing twice is
    /// harmless).
    pub fn remove(&self, id: u64) -> Option<Arc<S>> {
        let mut i = self.lock();
        let (s, bytes, lane) = i.streams.remove(&id)?;
        i.reserved[lane as usize] -= bytes;
        Some(s)
    }

    /// Stream `id`, if open.
    pub fn get(&self, id: u64) -> Option<Arc<S>> {
        self.lock().streams.get(&id).map(|(s, _, _)| Arc::clone(s))
    }

    /// Every open stream, by id.
    pub fn list(&self) -> Vec<(u64, Arc<S>)> {
        let mut v: Vec<_> = self
            .lock()
            .streams
            .iter()
            .map(|(id, (s, _, _))| (*id, Arc::clone(s)))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// (open streams, bytes reserved), over all lanes.
    pub fn usage(&self) -> (usize, u64) {
        let i = self.lock();
        (i.streams.len(), i.reserved.iter().sum())
    }

    /// (open streams, bytes reserved, pool) of lane `lane`.
    pub fn lane_usage(&self, lane: u32) -> (usize, u64, u64) {
        let i = self.lock();
        let l = lane as usize;
        let n = i.streams.values().filter(|v| v.2 == lane).count();
        (
            n,
            i.reserved.get(l).copied().unwrap_or(0),
            self.pools.get(l).copied().unwrap_or(0),
        )
    }

    /// Refuses new streams from now on; returns how many are open.
    pub fn start_draining(&self) -> usize {
        let mut i = self.lock();
        i.draining = true;
        i.streams.len()
    }

    /// True once draining started.
    pub fn draining(&self) -> bool {
        self.lock().draining
    }
}

impl<S> Reservation<'_, S> {
    /// The lane the bytes are set aside on.
    pub fn lane(&self) -> u32 {
        self.lane
    }

    /// The stream opened: it now holds the bytes until it is removed.
    pub fn commit(mut self, id: u64, s: Arc<S>) {
        self.committed = true;
        self.adm
            .lock()
            .streams
            .insert(id, (s, self.bytes, self.lane));
    }
}

impl<S> Drop for Reservation<'_, S> {
    fn drop(&mut self) {
        if !self.committed {
            self.adm.lock().reserved[self.lane as usize] -= self.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_pool_and_failed_opens_give_back() {
        let a: Admission<&str> = Admission::new(vec![100]);
        let r1 = a.reserve(0, 60).unwrap();
        assert_eq!(
            a.reserve(0, 50).err(),
            Some(AdmitError::Exhausted {
                lane: 0,
                reserved: 60,
                pool: 100,
                need: 50
            })
        );
        drop(r1); // the open failed
        assert_eq!(a.usage(), (0, 0));
        a.reserve(0, 60).unwrap().commit(1, Arc::new("one"));
        a.reserve(0, 40).unwrap().commit(2, Arc::new("two"));
        assert_eq!(a.usage(), (2, 100));
        assert!(a.reserve(0, 1).is_err());
    }

    #[test]
    fn a_lane_of_cuda_memory_reserves_whole_region_units() {
        // Before, a 64 KiB stream_memory reserved 64 KiB of a CUDA lane's pool while its
        // region took 2 MiB of the GPU: a 4 MiB pool admitted 64 streams, 128 MiB of GPU.
        let mib = 1 << 20;
        let a: Admission<u8> = Admission::new(vec![4 * mib, 4 * mib]).with_units(vec![2 * mib, 1]);
        a.reserve(0, 64 << 10).unwrap().commit(1, Arc::new(0));
        a.reserve(0, 64 << 10).unwrap().commit(2, Arc::new(0));
        let e = a.reserve(0, 64 << 10).err().unwrap();
        assert!(
            matches!(e, AdmitError::Exhausted { reserved, need, .. } if reserved == 4 * mib && need == 2 * mib),
            "{e}"
        );
        for id in 3..=66 {
            a.reserve(1, 64 << 10).unwrap().commit(id, Arc::new(1));
        }
        assert!(
            a.reserve(1, 1).is_err(),
            "host lane: 64 streams of 64 KiB fill 4 MiB"
        );
        // A stream without a device goes where it fits.
        let a: Admission<u8> =
            Admission::new(vec![4 * mib, 3 * mib / 2]).with_units(vec![2 * mib, 1]);
        a.reserve(0, 64 << 10).unwrap().commit(1, Arc::new(0));
        assert_eq!(
            a.reserve_least_loaded(64 << 10).unwrap().lane(),
            0,
            "2 MiB free"
        );
        // 1.75 MiB free on the CUDA lane, under its unit; 1 MiB on the host lane: before, the
        // CUDA lane (more free) was chosen and the stream refused.
        let a: Admission<u8> = Admission::new(vec![15 * mib / 4, mib]).with_units(vec![2 * mib, 1]);
        a.reserve(0, 64 << 10).unwrap().commit(1, Arc::new(0));
        assert!(
            a.reserve(0, 1).is_err(),
            "1.75 MiB free: under the 2 MiB unit"
        );
        assert_eq!(a.reserve_least_loaded(64 << 10).unwrap().lane(), 1);
        // A 3 MiB stream takes 4 MiB of the CUDA lane: it never fits a pool of 3.75 MiB.
        let never: Vec<_> = a.never_fits(3 * mib).collect();
        assert_eq!(never, [(0, 4 * mib), (1, 3 * mib)]);
        assert_eq!(a.never_fits(mib / 2).count(), 0);
    }

    #[test]
    fn each_lane_has_its_own_pool() {
        let a: Admission<u8> = Admission::new(vec![100, 100]);
        a.reserve(0, 100).unwrap().commit(1, Arc::new(0));
        let e = a.reserve(0, 1).err().unwrap();
        assert!(
            e.to_string().starts_with("lane 0's pool is exhausted"),
            "{e}"
        );
        a.reserve(1, 100).unwrap().commit(2, Arc::new(0));
        assert_eq!(a.lane_usage(0), (1, 100, 100));
        assert_eq!(a.lane_usage(1), (1, 100, 100));
        assert_eq!(a.usage(), (2, 200));
        a.remove(1);
        assert_eq!(a.lane_usage(0), (0, 0, 100));
    }

    #[test]
    fn the_least_loaded_lane_has_the_most_free_then_the_fewest_streams() {
        let a: Admission<u8> = Admission::new(vec![100, 100, 100]);
        assert_eq!(a.least_loaded(), 0, "all equal: the lowest id");
        a.reserve(0, 10).unwrap().commit(1, Arc::new(0));
        assert_eq!(a.least_loaded(), 1);
        a.reserve(1, 10).unwrap().commit(2, Arc::new(0));
        assert_eq!(a.least_loaded(), 2);
        a.reserve(2, 5).unwrap().commit(3, Arc::new(0));
        a.reserve(2, 5).unwrap().commit(4, Arc::new(0));
        // Equal bytes free (90 each): the fewest streams.
        assert_eq!(a.least_loaded(), 0);
    }

    #[test]
    fn streams_opening_together_spread_over_the_lanes() {
        let a: Admission<u8> = Admission::new(vec![100, 100, 100]);
        // Three reservations still open (none committed): each lands on another lane.
        let r: Vec<_> = (0..3)
            .map(|_| a.reserve_least_loaded(10).unwrap())
            .collect();
        let mut lanes: Vec<u32> = r.iter().map(Reservation::lane).collect();
        lanes.sort();
        assert_eq!(lanes, [0, 1, 2]);
        drop(r);
        assert_eq!(
            a.lane_usage(1),
            (0, 0, 100),
            "dropped reservations give back"
        );
        a.start_draining();
        assert!(matches!(
            a.reserve_least_loaded(10),
            Err(AdmitError::Draining)
        ));
    }

    #[test]
    fn removing_returns_the_budget_once() {
        let a: Admission<u8> = Admission::new(vec![10]);
        a.reserve(0, 7).unwrap().commit(5, Arc::new(0));
        assert!(a.remove(5).is_some());
        assert!(a.remove(5).is_none(), "closing twice is harmless");
        assert_eq!(a.usage(), (0, 0));
        a.reserve(0, 10).unwrap().commit(6, Arc::new(0));
        assert_eq!(a.list().iter().map(|(id, _)| *id).collect::<Vec<_>>(), [6]);
    }

    #[test]
    fn draining_refuses_new_streams_but_keeps_open_ones() {
        let a: Admission<u8> = Admission::new(vec![10]);
        a.reserve(0, 1).unwrap().commit(1, Arc::new(0));
        assert_eq!(a.start_draining(), 1);
        assert_eq!(a.reserve(0, 1).err(), Some(AdmitError::Draining));
        assert!(a.get(1).is_some() && a.draining());
    }
}
