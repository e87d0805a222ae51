//! [`Source`]: one open data file, with bounded reads, streaming CRC-32C and error helpers.
//!
//! Format readers never load a whole file: they read headers and metadata with
//! [`Source::read_at`] and checksum payloads chunk by chunk with [`Source::crc32c`].

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use shardwire_protocol::crc::Crc32c;
use shardwire_protocol::manifest::{ShardEntry, TensorEntry};

use crate::error::IndexError;

/// Largest metadata block (npy header, IPC message or footer) we read into memory.
pub(crate) const MAX_METADATA: u64 = 256 << 20;
/// Chunk size for checksumming payloads.
const CRC_CHUNK: usize = 1 << 20;

/// An open data file.
pub(crate) struct Source {
    /// Full path (for messages).
    pub path: PathBuf,
    /// Path relative to the dataset directory, '/'-separated (for the manifest).
    pub rel: String,
    /// File length in bytes.
    pub len: u64,
    file: File,
}

impl Source {
    /// Opens `dir/rel`.
    pub fn open(path: &Path, rel: &str) -> Result<Self, IndexError> {
        let file = File::open(path).map_err(|e| IndexError::io(path, e))?;
        let len = file.metadata().map_err(|e| IndexError::io(path, e))?.len();
        Ok(Self {
            path: path.to_path_buf(),
            rel: rel.to_owned(),
            len,
            file,
        })
    }

    /// The file name without its extension (tensor name for `.npy` and `.bin`).
    pub fn stem(&self) -> String {
        Path::new(&self.rel)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Checks that `offset..offset+len` lies inside the file.
    pub fn check_range(&self, what: &str, offset: u64, len: u64) -> Result<(), IndexError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(self.malformed(
                format!(
                    "{what} lies beyond the end of the file ({} bytes)",
                    self.len
                ),
                format!("range {offset}+{len}"),
            )),
        }
    }

    /// Reads `len` bytes at `offset` (bounded by [`MAX_METADATA`]).
    pub fn read_at(&mut self, what: &str, offset: u64, len: u64) -> Result<Vec<u8>, IndexError> {
        self.check_range(what, offset, len)?;
        if len > MAX_METADATA {
            return Err(self.malformed(
                format!("{what} is implausibly large"),
                format!("{len} bytes"),
            ));
        }
        self.read_exact_at(what, offset, len)
    }

    /// Reads `len` bytes at `offset`, bounded only by the file's size (for index arrays
    /// whose size the caller has checked against the file).
    pub fn read_exact_at(
        &mut self,
        what: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, IndexError> {
        self.check_range(what, offset, len)?;
        let mut buf = vec![0u8; len as usize];
        self.file
            .seek(SeekFrom::Start(offset))
            .map_err(|e| IndexError::io(&self.path, e))?;
        self.file
            .read_exact(&mut buf)
            .map_err(|e| IndexError::io(&self.path, e))?;
        Ok(buf)
    }

    /// CRC-32C of `len` bytes at `offset`, read in chunks.
    pub fn crc32c(&mut self, offset: u64, len: u64) -> Result<u32, IndexError> {
        self.check_range("shard payload", offset, len)?;
        self.file
            .seek(SeekFrom::Start(offset))
            .map_err(|e| IndexError::io(&self.path, e))?;
        let mut crc = Crc32c::new();
        let mut buf = vec![0u8; CRC_CHUNK.min(len as usize)];
        let mut left = len;
        while left > 0 {
            let n = (left.min(buf.len() as u64)) as usize;
            self.file
                .read_exact(&mut buf[..n])
                .map_err(|e| IndexError::io(&self.path, e))?;
            crc.update(&buf[..n]);
            left -= n as u64;
        }
        Ok(crc.finish())
    }

    /// Builds a shard over `offset..offset+length`, checksumming the payload.
    pub fn shard(
        &mut self,
        offset: u64,
        length: u64,
        tensors: Vec<TensorEntry>,
    ) -> Result<ShardEntry, IndexError> {
        let crc32c = self.crc32c(offset, length)?;
        Ok(ShardEntry {
            file: self.rel.clone(),
            offset,
            length,
            crc32c,
            tensors,
        })
    }

    /// An [`IndexError::Unsupported`] for this file.
    pub fn unsupported(&self, reason: impl Into<String>, value: impl ToString) -> IndexError {
        IndexError::Unsupported {
            file: self.path.clone(),
            reason: reason.into(),
            value: value.to_string(),
        }
    }

    /// An [`IndexError::Malformed`] for this file.
    pub fn malformed(&self, reason: impl Into<String>, value: impl ToString) -> IndexError {
        IndexError::Malformed {
            file: self.path.clone(),
            reason: reason.into(),
            value: value.to_string(),
        }
    }
}
