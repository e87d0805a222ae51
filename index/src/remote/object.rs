//! [`Object`]: one listed object as the readers use it: its key, size and ETag (sent as
//! `If-Match` on every GET), and planned reads of pieces of it.

use std::ops::Range;

use bytes::Bytes;
use shardwire_store::{Blocking, Piece, Request, StoreError, plan_requests};

/// Smallest fetch of a structure read (and the tail kept for a footer).
pub(crate) const MIN_FETCH: u64 = 64 << 10;
/// GETs in flight during a planned read.
pub(crate) const PARALLEL: usize = 4;

/// An object of `len` bytes at `key` (relative to the dataset prefix).
#[derive(Clone)]
pub(crate) struct Object {
    store: Blocking,
    pub key: String,
    etag: Option<String>,
    pub len: u64,
}

impl Object {
    pub fn new(store: Blocking, key: &str, etag: Option<String>, len: u64) -> Self {
        Self {
            store,
            key: key.to_owned(),
            etag,
            len,
        }
    }

    /// The largest GET (the store's request size, at least [`MIN_FETCH`]).
    pub fn request_size(&self) -> u64 {
        self.store.options().request_size.max(MIN_FETCH)
    }

    /// One ranged GET.
    pub fn read(&self, r: Range<u64>) -> Result<Bytes, StoreError> {
        self.store.read(&self.key, r, self.etag.as_deref())
    }

    /// The last `n` bytes of the listed length: one ranged GET, checked like any other (the
    /// store sends exactly that range, or the read fails), so an object that changed size
    /// cannot put a footer at the wrong offset.
    pub fn read_suffix(&self, n: u64) -> Result<Bytes, StoreError> {
        self.read(self.len.saturating_sub(n)..self.len)
    }

    /// Reads `pieces` with planned GETs (adjacent small pieces merged, large ones split),
    /// [`PARALLEL`] in flight, handing each request and its bytes to `each` in order.
    pub fn read_planned(
        &self,
        pieces: &[Piece],
        mut each: impl FnMut(&Request, Bytes),
    ) -> Result<(), StoreError> {
        let reqs = plan_requests(pieces, self.request_size());
        let ranges: Vec<Range<u64>> = reqs.iter().map(|r| r.range.clone()).collect();
        let etag = self.etag.as_deref();
        self.store
            .read_ranges(&self.key, ranges, etag, PARALLEL, |i, b| {
                each(&reqs[i], b);
                Ok(())
            })
    }
}
