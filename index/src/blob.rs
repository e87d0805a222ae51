//! [`Blob`]: the bytes of one data file, wherever they live: a local file ([`LocalFile`]) or
//! an object in a store (`remote::RemoteBlob`). [`crate::source::Source`] reads through it,
//! so every format reader works on both.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use shardwire_protocol::crc::Crc32c;

use crate::error::IndexError;

/// Random-access reads and range checksums over one file or object.
pub(crate) trait Blob {
    /// Reads exactly `buf.len()` bytes at `offset` (the caller checked the range).
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), IndexError>;
    /// CRC-32C of each `(offset, length)`, in the order given (the caller checked them).
    fn crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<u32>, IndexError>;
}

/// Chunk size for checksumming local payloads.
const CRC_CHUNK: usize = 1 << 20;

/// An open local file.
pub(crate) struct LocalFile {
    file: File,
    path: PathBuf,
}

impl LocalFile {
    /// Opens `path`; returns it with its length.
    pub fn open(path: &Path) -> Result<(Self, u64), IndexError> {
        let file = File::open(path).map_err(|e| IndexError::io(path, e))?;
        let len = file.metadata().map_err(|e| IndexError::io(path, e))?.len();
        let path = path.to_path_buf();
        Ok((Self { file, path }, len))
    }
}

impl Blob for LocalFile {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), IndexError> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| IndexError::io(&self.path, e))
    }

    fn crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<u32>, IndexError> {
        let most = ranges.iter().map(|r| r.1).max().unwrap_or(0);
        let mut buf = vec![0u8; CRC_CHUNK.min(most as usize)];
        let mut out = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            let mut crc = Crc32c::new();
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                self.read_at(offset + done, &mut buf[..n])?;
                crc.update(&buf[..n]);
                done += n as u64;
            }
            out.push(crc.finish());
        }
        Ok(out)
    }
}
