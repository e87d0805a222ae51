//! The reorder buffer: fetches complete in any order, trainers take batches in plan order.
//! Positions below the next one to deliver, past the end, or already held are refused, so a
//! late duplicate (a refetch racing its original) can never be delivered twice.

use std::collections::BTreeMap;

/// Items keyed by stream position, released in position order.
#[derive(Debug)]
pub struct Reorder<T> {
    ready: BTreeMap<u64, T>,
    next: u64,
    total: u64,
}

impl<T> Reorder<T> {
    /// Delivery starts at `next` and ends before `total`.
    pub fn new(next: u64, total: u64) -> Self {
        Self {
            ready: BTreeMap::new(),
            next,
            total,
        }
    }

    /// Holds `item` for `pos`; gives it back when `pos` is not awaited.
    pub fn insert(&mut self, pos: u64, item: T) -> Result<(), T> {
        if pos < self.next || pos >= self.total || self.ready.contains_key(&pos) {
            return Err(item);
        }
        self.ready.insert(pos, item);
        Ok(())
    }

    /// The item at the next position, if it is there (and advances).
    pub fn take(&mut self) -> Option<(u64, T)> {
        let item = self.ready.remove(&self.next)?;
        let pos = self.next;
        self.next += 1;
        Some((pos, item))
    }

    /// The item at the next position, if it is there (nothing advances).
    pub fn peek(&self) -> Option<&T> {
        self.ready.get(&self.next)
    }

    /// The next position to deliver.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Every position was delivered.
    pub fn done(&self) -> bool {
        self.next >= self.total
    }

    /// Items held ahead of the next position.
    pub fn held(&self) -> usize {
        self.ready.len()
    }

    /// Drops every held item (the stream closed).
    pub fn clear(&mut self) -> BTreeMap<u64, T> {
        std::mem::take(&mut self.ready)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_order_completions_come_out_in_order() {
        let mut r = Reorder::new(0, 4);
        r.insert(2, "c").unwrap();
        r.insert(1, "b").unwrap();
        assert_eq!(r.take(), None, "position 0 has not arrived");
        assert_eq!(r.peek(), None);
        r.insert(0, "a").unwrap();
        assert_eq!(r.peek(), Some(&"a"));
        assert_eq!(r.take(), Some((0, "a")));
        assert_eq!(r.take(), Some((1, "b")));
        assert_eq!(r.take(), Some((2, "c")));
        assert_eq!(r.take(), None);
        assert!(!r.done());
        r.insert(3, "d").unwrap();
        assert_eq!(r.take(), Some((3, "d")));
        assert!(r.done());
    }

    #[test]
    fn duplicates_stale_and_out_of_range_positions_are_refused() {
        let mut r = Reorder::new(5, 8);
        assert_eq!(r.insert(4, 'x'), Err('x'), "before the resume point");
        assert_eq!(r.insert(8, 'y'), Err('y'), "past the end");
        r.insert(6, 'a').unwrap();
        assert_eq!(r.insert(6, 'b'), Err('b'), "already held");
        assert_eq!(r.held(), 1);
        assert_eq!(r.clear().len(), 1);
        assert_eq!(r.next(), 5);
    }
}
