//! [`RemoteChunks`]: a Parquet object as the `parquet` crate's `ChunkReader`, so a remote
//! Parquet file is converted without being downloaded first. The footer (and its length)
//! come from one suffix GET of the tail, kept; every other read is a ranged GET (split into
//! request-size parts, a few in flight), allocated only after the range is checked against
//! the object's listed size.

use std::io::Read;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use parquet::errors::ParquetError;
use parquet::file::reader::{ChunkReader, Length};
use shardwire_store::{Piece, StoreError};

use super::object::{MIN_FETCH, Object};

/// A Parquet object.
#[derive(Clone)]
pub(crate) struct RemoteChunks {
    obj: Object,
    /// The object's last bytes (footer), once fetched.
    tail: Arc<Mutex<Option<Bytes>>>,
}

impl RemoteChunks {
    pub fn new(obj: Object) -> Self {
        Self {
            obj,
            tail: Arc::default(),
        }
    }

    fn err(e: StoreError) -> ParquetError {
        ParquetError::External(Box::new(e))
    }

    /// `range` from the cached tail, fetching it on first use, when the range lies in it.
    fn in_tail(&self, range: &Range<u64>) -> Result<Option<Bytes>, ParquetError> {
        let tail_len = MIN_FETCH.min(self.obj.len);
        let tail_start = self.obj.len - tail_len;
        if range.start < tail_start {
            return Ok(None);
        }
        let mut tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        if tail.is_none() {
            *tail = Some(self.obj.read_suffix(tail_len).map_err(Self::err)?);
        }
        let b = tail.as_ref().map(|t| {
            t.slice((range.start - tail_start) as usize..(range.end - tail_start) as usize)
        });
        Ok(b)
    }

    fn range(&self, start: u64, length: usize) -> Result<Bytes, ParquetError> {
        let end = start
            .checked_add(length as u64)
            .filter(|&e| e <= self.obj.len);
        let Some(end) = end else {
            return Err(ParquetError::EOF(format!(
                "{}: bytes {start}+{length} lie beyond the object's {} bytes",
                self.obj.key, self.obj.len
            )));
        };
        let range = start..end;
        if let Some(b) = self.in_tail(&range)? {
            return Ok(b);
        }
        if (length as u64) <= self.obj.request_size() {
            return self.obj.read(range).map_err(Self::err);
        }
        let piece = Piece {
            object: 0,
            offset: start,
            len: length as u64,
        };
        // Checked against the listed size above; the parts are checked as they arrive, and
        // the buffer grows with them past its first request's worth (the listed size is the
        // store's claim, not bytes that came).
        let mut out = BytesMut::with_capacity(length.min(self.obj.request_size() as usize));
        self.obj
            .read_planned(&[piece], |_, b| out.extend_from_slice(&b))
            .map_err(Self::err)?;
        Ok(out.freeze())
    }
}

impl Length for RemoteChunks {
    fn len(&self) -> u64 {
        self.obj.len
    }
}

impl ChunkReader for RemoteChunks {
    type T = ChunkRead;

    fn get_read(&self, start: u64) -> Result<ChunkRead, ParquetError> {
        Ok(ChunkRead {
            chunks: self.clone(),
            pos: start,
            buf: Bytes::new(),
        })
    }

    fn get_bytes(&self, start: u64, length: usize) -> Result<Bytes, ParquetError> {
        self.range(start, length)
    }
}

/// Sequential reads from an offset, a request-size GET at a time.
pub(crate) struct ChunkRead {
    chunks: RemoteChunks,
    pos: u64,
    buf: Bytes,
}

impl Read for ChunkRead {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.buf.is_empty() {
            let rs = self.chunks.obj.request_size();
            let n = rs.min(self.chunks.obj.len.saturating_sub(self.pos)) as usize;
            if n == 0 {
                return Ok(0);
            }
            self.buf = self
                .chunks
                .range(self.pos, n)
                .map_err(std::io::Error::other)?;
            self.pos += n as u64;
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        Ok(n)
    }
}
