//! [`RemoteBlob`]: one object read through the store, for the format readers.
//!
//! Structure reads (headers, footers, index arrays, tar headers) go through a small cache of
//! extents: a miss fetches [`MIN_FETCH`] bytes from the read (a suffix GET near the end, so a
//! footer and its length come in one request), and a miss right after the last extent
//! (sequential reading: a tar's headers, MDS sample prefixes) fetches twice as much as last
//! time, up to the request size. So structure costs a few GETs, and memory is bounded
//! ([`EXTENTS`] extents). When the extents happen to cover the object from its first byte to
//! its last, in order, their running CRC-32C is the whole object's, and a whole-object shard
//! (a tar, an MDS shard) needs no second read.
//!
//! Shard checksums ([`Blob::crc32c`]) are read once with planned GETs (`plan_requests`:
//! adjacent small shards merged, large ones split into request-size parts), a few in flight,
//! each CRC fed as its bytes arrive in order.

use std::ops::Range;

use bytes::Bytes;
use shardwire_protocol::crc::Crc32c;
use shardwire_store::Piece;

use super::object::{MIN_FETCH, Object};
use crate::blob::Blob;
use crate::error::IndexError;

/// Extents kept (the oldest goes first).
const EXTENTS: usize = 4;

/// An object, read with `If-Match: etag`.
pub(crate) struct RemoteBlob {
    obj: Object,
    len: u64,
    /// Fetched extents, oldest first.
    extents: Vec<(u64, Bytes)>,
    /// End and size of the last fetch (for sequential growth).
    last: Option<(u64, u64)>,
    /// CRC-32C of bytes `0..end`, while the extents fetched so far cover them in order.
    prefix: Option<(u64, Crc32c)>,
}

impl RemoteBlob {
    pub fn new(obj: Object) -> Self {
        Self {
            len: obj.len,
            obj,
            extents: Vec::new(),
            last: None,
            prefix: Some((0, Crc32c::new())),
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
            // object covered in order), and fetch twice as much.
            let size = (size * 2).min(self.request_size()).max(offset + len - end);
            return end..(end + size).min(self.len);
        }
        let size = MIN_FETCH.max(len);
        if offset + size > self.len {
            // Near the end (a footer): the tail, as one suffix GET.
            return self.len.saturating_sub(size)..self.len;
        }
        offset..offset + size
    }

    fn fetch(&mut self, r: Range<u64>) -> Result<(), IndexError> {
        let bytes = if r.end == self.len && r.start > 0 {
            self.obj.read_suffix(r.end - r.start)?
        } else {
            self.obj.read(r.clone())?
        };
        if let Some((end, crc)) = &mut self.prefix {
            if r.start > *end {
                self.prefix = None;
            } else if r.end > *end {
                crc.update(&bytes[(*end - r.start) as usize..]);
                *end = r.end;
            }
        }
        self.last = Some((r.end, r.end - r.start));
        if self.extents.len() >= EXTENTS {
            self.extents.remove(0);
        }
        self.extents.push((r.start, bytes));
        Ok(())
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
        let whole = self
            .prefix
            .as_ref()
            .filter(|(end, _)| *end == self.len)
            .map(|(_, c)| c.finish());
        // A whole object covered in order, or a range inside an extent still cached (a small
        // file read whole for its header), costs no second read.
        let mut out: Vec<Option<u32>> = ranges
            .iter()
            .map(|&(o, l)| {
                whole.filter(|_| (o, l) == (0, self.len)).or_else(|| {
                    self.cached(o, l)
                        .map(|b| shardwire_protocol::crc::crc32c(&b))
                })
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
