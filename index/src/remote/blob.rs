//! [`RemoteBlob`]: one object read through the store, for the format readers.
//!
//! Structure reads (headers, footers, index arrays, tar headers) go through a cache of
//! extents: a miss fetches [`MIN_FETCH`] bytes from the read (a suffix GET near the end, so a
//! footer and its length come in one request), and a miss at most one extent past the end of
//! the last sequential fetch (a tar's headers, MDS sample prefixes, Arrow batch metadata
//! between small bodies) fetches from that end twice as much as last time, up to the request
//! size, stopping where a cached extent begins. So structure costs a few GETs; memory is
//! bounded by [`CACHE_REQUESTS`] request sizes, the oldest extents going first.
//!
//! Shard checksums ([`Blob::crc32c`]) come from what was already fetched when they can: the
//! running CRC-32C of the bytes covered in order from byte 0 (a whole tar or MDS shard, even
//! after its extents are evicted), or the cached extents that hold a shard; the rest is read
//! once with planned GETs (`plan_requests`: adjacent small shards merged, large ones split
//! into request-size parts), a few in flight, each CRC fed as its bytes arrive in order.

use std::ops::Range;

use bytes::Bytes;
use shardwire_protocol::crc::Crc32c;
use shardwire_store::Piece;

use super::object::{MIN_FETCH, Object};
use crate::blob::Blob;
use crate::error::IndexError;

/// Bytes of extents kept, in request sizes (the oldest go first).
const CACHE_REQUESTS: u64 = 2;

/// An object, read with `If-Match: etag`.
pub(crate) struct RemoteBlob {
    obj: Object,
    len: u64,
    /// Fetched extents, oldest first.
    extents: Vec<(u64, Bytes)>,
    /// End and size of the last sequential (not tail) fetch, for growth.
    last: Option<(u64, u64)>,
    /// CRC-32C of bytes `0..end`: the object as far as fetched in order from its start.
    prefix: (u64, Crc32c),
}

impl RemoteBlob {
    pub fn new(obj: Object) -> Self {
        Self {
            len: obj.len,
            obj,
            extents: Vec::new(),
            last: None,
            prefix: (0, Crc32c::new()),
        }
    }

    fn request_size(&self) -> u64 {
        self.obj.request_size()
    }

    /// The extent to fetch for a miss at `offset..offset+len`.
    fn extent_for(&self, offset: u64, len: u64) -> Range<u64> {
        if let Some((end, size)) = self.last
            && offset >= end
            && offset < end + size
        {
            // Sequential: start where the last fetch ended (a small gap is read, keeping the
            // object covered in order), twice as much, and not into a cached extent.
            let size = (size * 2).min(self.request_size()).max(offset + len - end);
            let stop = self
                .extents
                .iter()
                .map(|(s, _)| *s)
                .filter(|&s| s > end && s >= offset + len)
                .fold((end + size).min(self.len), u64::min);
            return end..stop;
        }
        let size = MIN_FETCH.max(len);
        if offset + size > self.len {
            // Near the end (a footer): the tail, as one suffix GET.
            return self.len.saturating_sub(size)..self.len;
        }
        offset..offset + size
    }

    fn fetch(&mut self, r: Range<u64>) -> Result<(), IndexError> {
        let tail = r.end == self.len && r.start > 0;
        let bytes = if tail {
            self.obj.read_suffix(r.end - r.start)?
        } else {
            self.obj.read(r.clone())?
        };
        // A footer read does not end a sequential run.
        if !tail || self.last.is_some_and(|(end, _)| end == r.start) {
            self.last = Some((r.end, r.end - r.start));
        }
        self.extents.push((r.start, bytes));
        self.advance_prefix();
        let budget = CACHE_REQUESTS * self.request_size();
        while self.extents.len() > 1
            && self.extents.iter().map(|e| e.1.len() as u64).sum::<u64>() > budget
        {
            self.extents.remove(0);
        }
        Ok(())
    }

    /// Extends the in-order CRC over every cached extent that continues it.
    fn advance_prefix(&mut self) {
        let (end, crc) = &mut self.prefix;
        while let Some((s, b)) = self
            .extents
            .iter()
            .find(|(s, b)| *s <= *end && *end < s + b.len() as u64)
        {
            crc.update(&b[(*end - s) as usize..]);
            *end = s + b.len() as u64;
        }
    }

    /// CRC-32C of `offset..offset+len` from cached extents, when they hold all of it.
    fn crc_cached(&self, offset: u64, len: u64) -> Option<u32> {
        let mut crc = Crc32c::new();
        let (mut pos, end) = (offset, offset + len);
        while pos < end {
            let (s, b) = self
                .extents
                .iter()
                .find(|(s, b)| *s <= pos && pos < s + b.len() as u64)?;
            let to = end.min(s + b.len() as u64);
            crc.update(&b[(pos - s) as usize..(to - s) as usize]);
            pos = to;
        }
        Some(crc.finish())
    }

    /// `offset..offset+len` from a cached extent.
    fn cached(&self, offset: u64, len: u64) -> Option<Bytes> {
        self.extents.iter().rev().find_map(|(s, b)| {
            (offset >= *s && offset + len <= s + b.len() as u64)
                .then(|| b.slice((offset - s) as usize..(offset - s + len) as usize))
        })
    }

    /// A read larger than one request: planned parts, a few in flight, straight into `buf`.
    fn read_large(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), IndexError> {
        let piece = Piece {
            object: 0,
            offset,
            len: buf.len() as u64,
        };
        self.obj.read_planned(&[piece], |r, b| {
            let at = (r.range.start - offset) as usize;
            buf[at..at + b.len()].copy_from_slice(&b);
        })?;
        Ok(())
    }
}

impl Blob for RemoteBlob {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), IndexError> {
        let len = buf.len() as u64;
        if len == 0 {
            return Ok(());
        }
        if let Some(b) = self.cached(offset, len) {
            buf.copy_from_slice(&b);
            return Ok(());
        }
        if len > self.request_size() {
            return self.read_large(offset, buf);
        }
        let r = self.extent_for(offset, len);
        self.fetch(r)?;
        let b = self
            .cached(offset, len)
            .expect("the extent just fetched covers the read");
        buf.copy_from_slice(&b);
        Ok(())
    }

    fn crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<u32>, IndexError> {
        let whole = (self.prefix.0 == self.len).then(|| self.prefix.1.finish());
        // A whole object covered in order, or a range the cached extents hold (a small file
        // read whole for its header, bodies between metadata read in order), costs no GET.
        let mut out: Vec<Option<u32>> = ranges
            .iter()
            .map(|&(o, l)| {
                whole
                    .filter(|_| (o, l) == (0, self.len))
                    .or_else(|| self.crc_cached(o, l))
            })
            .collect();
        let todo: Vec<usize> = (0..ranges.len()).filter(|&i| out[i].is_none()).collect();
        let pieces: Vec<Piece> = todo
            .iter()
            .map(|&i| Piece {
                object: 0,
                offset: ranges[i].0,
                len: ranges[i].1,
            })
            .collect();
        let mut crcs = vec![Crc32c::new(); pieces.len()];
        self.obj.read_planned(&pieces, |r, bytes| {
            for p in r.pieces.clone() {
                let from = pieces[p].offset.max(r.range.start);
                let to = (pieces[p].offset + pieces[p].len).min(r.range.end);
                let at = (from - r.range.start) as usize;
                crcs[p].update(&bytes[at..at + (to - from) as usize]);
            }
        })?;
        for (k, &i) in todo.iter().enumerate() {
            out[i] = Some(crcs[k].finish());
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}
