//! Stream admission and the memory budget, under one lock: the open streams, the bytes of
//! `pool_size` they reserve, and whether the node is draining. A stream is admitted by a
//! [`Reservation`] that returns its bytes unless it is committed, so a failed open never
//! leaks budget; removing a stream returns its bytes exactly once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Why a stream is not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The node is draining.
    #[error("the node service is draining and accepts no new streams")]
    Draining,
    /// Not enough of the pool left.
    #[error(
        "pool exhausted: {reserved} of pool_size {pool} bytes reserved by open streams; a stream needs stream_memory {need}"
    )]
    Exhausted {
        /// Bytes reserved by open streams.
        reserved: u64,
        /// `pool_size`.
        pool: u64,
        /// What the stream needs.
        need: u64,
    },
}

struct Inner<S> {
    streams: HashMap<u64, (Arc<S>, u64)>,
    reserved: u64,
    draining: bool,
}

/// The open streams and the budget they hold.
pub struct Admission<S> {
    pool: u64,
    inner: Mutex<Inner<S>>,
}

/// Bytes set aside for a stream being opened; given back on drop unless committed.
#[must_use = "a reservation is given back when dropped"]
pub struct Reservation<'a, S> {
    adm: &'a Admission<S>,
    bytes: u64,
    committed: bool,
}

impl<S> Admission<S> {
    /// No streams, `pool` bytes to give out.
    pub fn new(pool: u64) -> Self {
        Self {
            pool,
            inner: Mutex::new(Inner {
                streams: HashMap::new(),
                reserved: 0,
                draining: false,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<S>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets `bytes` aside for a new stream.
    pub fn reserve(&self, bytes: u64) -> Result<Reservation<'_, S>, AdmitError> {
        let mut i = self.lock();
        if i.draining {
            return Err(AdmitError::Draining);
        }
        if i.reserved + bytes > self.pool {
            return Err(AdmitError::Exhausted {
                reserved: i.reserved,
                pool: self.pool,
                need: bytes,
            });
        }
        i.reserved += bytes;
        Ok(Reservation {
            adm: self,
            bytes,
            committed: false,
        })
    }

    /// Removes stream `id`, returning its budget; `None` if it is not open (closing twice is
    /// harmless).
    pub fn remove(&self, id: u64) -> Option<Arc<S>> {
        let mut i = self.lock();
        let (s, bytes) = i.streams.remove(&id)?;
        i.reserved -= bytes;
        Some(s)
    }

    /// Stream `id`, if open.
    pub fn get(&self, id: u64) -> Option<Arc<S>> {
        self.lock().streams.get(&id).map(|(s, _)| Arc::clone(s))
    }

    /// Every open stream, by id.
    pub fn list(&self) -> Vec<(u64, Arc<S>)> {
        let mut v: Vec<_> = self
            .lock()
            .streams
            .iter()
            .map(|(id, (s, _))| (*id, Arc::clone(s)))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// (open streams, bytes reserved).
    pub fn usage(&self) -> (usize, u64) {
        let i = self.lock();
        (i.streams.len(), i.reserved)
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
    /// The stream opened: it now holds the bytes until it is removed.
    pub fn commit(mut self, id: u64, s: Arc<S>) {
        self.committed = true;
        self.adm.lock().streams.insert(id, (s, self.bytes));
    }
}

impl<S> Drop for Reservation<'_, S> {
    fn drop(&mut self) {
        if !self.committed {
            self.adm.lock().reserved -= self.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_pool_and_failed_opens_give_back() {
        let a: Admission<&str> = Admission::new(100);
        let r1 = a.reserve(60).unwrap();
        assert_eq!(
            a.reserve(50).err(),
            Some(AdmitError::Exhausted {
                reserved: 60,
                pool: 100,
                need: 50
            })
        );
        drop(r1); // the open failed
        assert_eq!(a.usage(), (0, 0));
        a.reserve(60).unwrap().commit(1, Arc::new("one"));
        a.reserve(40).unwrap().commit(2, Arc::new("two"));
        assert_eq!(a.usage(), (2, 100));
        assert!(a.reserve(1).is_err());
    }

    #[test]
    fn removing_returns_the_budget_once() {
        let a: Admission<u8> = Admission::new(10);
        a.reserve(7).unwrap().commit(5, Arc::new(0));
        assert!(a.remove(5).is_some());
        assert!(a.remove(5).is_none(), "closing twice is harmless");
        assert_eq!(a.usage(), (0, 0));
        a.reserve(10).unwrap().commit(6, Arc::new(0));
        assert_eq!(a.list().iter().map(|(id, _)| *id).collect::<Vec<_>>(), [6]);
    }

    #[test]
    fn draining_refuses_new_streams_but_keeps_open_ones() {
        let a: Admission<u8> = Admission::new(10);
        a.reserve(1).unwrap().commit(1, Arc::new(0));
        assert_eq!(a.start_draining(), 1);
        assert_eq!(a.reserve(1).err(), Some(AdmitError::Draining));
        assert!(a.get(1).is_some() && a.draining());
    }
}
