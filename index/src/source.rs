//! [`Source`]: one data file (local or in object storage, through a [`Blob`]), with bounded
//! reads, checksums and error helpers.
//!
//! Format readers never load a whole file: they read headers and metadata with
//! [`Source::read_at`] (or stream a tar through [`Source::reader`]) and describe shards with
//! [`Source::shard`]; [`Source::checksum`] then fills in every shard's CRC-32C in one pass
//! (for an object: planned ranged GETs, adjacent small shards merged, large ones split).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use shardwire_protocol::manifest::{ShardEntry, TensorEntry};

use crate::blob::{Blob, LocalFile};
use crate::error::IndexError;

/// Largest metadata block (npy header, IPC message or footer) we read into memory.
pub(crate) const MAX_METADATA: u64 = 256 << 20;
/// Bytes [`Reader`] asks for at once.
const READER_CHUNK: u64 = 64 << 10;
/// Bytes [`Source::first_nonzero`] reads at once.
const ZERO_SCAN_CHUNK: u64 = 1 << 20;

/// An open data file.
pub(crate) struct Source {
    /// Full path or URL (for messages about its bytes: reads, structure, offsets).
    pub path: PathBuf,
    /// The file its data was converted from, where there is one (the Parquet file of a
    /// converted Arrow file): messages about the data (columns, values) name it
    /// ([`Source::data_file`]), those about this file's own bytes `path`.
    pub origin: Option<PathBuf>,
    /// Path relative to the dataset directory, '/'-separated (for the manifest).
    pub rel: String,
    /// File length in bytes.
    pub len: u64,
    blob: Box<dyn Blob>,
}

impl Source {
    /// Opens the local file `path` (`rel` inside its dataset).
    pub fn open(path: &Path, rel: &str) -> Result<Self, IndexError> {
        let (file, len) = LocalFile::open(path)?;
        Ok(Self::new(path.to_path_buf(), rel, len, Box::new(file)))
    }

    /// A source over any blob of `len` bytes.
    pub fn new(path: PathBuf, rel: &str, len: u64, blob: Box<dyn Blob>) -> Self {
        Self {
            path,
            origin: None,
            rel: rel.to_owned(),
            len,
            blob,
        }
    }

    /// The file messages about the data (columns, values, the shards they make) name: the
    /// one it was converted from, if any, else this one.
    pub fn data_file(&self) -> &Path {
        self.origin.as_deref().unwrap_or(&self.path)
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
        self.blob.read_at(offset, &mut buf)?;
        Ok(buf)
    }

    /// The offset of the first byte that is not zero from `from` to the end of the file
    /// (`None` when all are zero, as is padding), read in chunks, stopping at the first found.
    pub fn first_nonzero(&mut self, what: &str, from: u64) -> Result<Option<u64>, IndexError> {
        let mut at = from;
        while at < self.len {
            let n = ZERO_SCAN_CHUNK.min(self.len - at);
            let buf = self.read_at(what, at, n)?;
            if let Some(i) = buf.iter().position(|&b| b != 0) {
                return Ok(Some(at + i as u64));
            }
            at += n;
        }
        Ok(None)
    }

    /// A shard over `offset..offset+length` of this file; its CRC-32C is filled in by
    /// [`Source::checksum`].
    pub fn shard(
        &mut self,
        offset: u64,
        length: u64,
        tensors: Vec<TensorEntry>,
    ) -> Result<ShardEntry, IndexError> {
        self.check_range("shard payload", offset, length)?;
        Ok(ShardEntry {
            file: self.rel.clone(),
            offset,
            length,
            crc32c: 0,
            tensors,
        })
    }

    /// Fills in the CRC-32C of every shard of this file among `shards`, reading their
    /// payloads once.
    pub fn checksum(&mut self, shards: &mut [ShardEntry]) -> Result<(), IndexError> {
        let mine: Vec<usize> = (0..shards.len())
            .filter(|&i| shards[i].file == self.rel)
            .collect();
        let ranges: Vec<(u64, u64)> = mine
            .iter()
            .map(|&i| (shards[i].offset, shards[i].length))
            .collect();
        for &(o, l) in &ranges {
            self.check_range("shard payload", o, l)?;
        }
        let crcs = self.blob.crc32c(&ranges)?;
        for (&i, crc) in mine.iter().zip(crcs) {
            shards[i].crc32c = crc;
        }
        Ok(())
    }

    /// The file as a `Read + Seek` stream (for the tar reader), reading in small chunks
    /// through the blob (whose cache makes them few requests for an object).
    pub fn reader(&mut self) -> Reader<'_> {
        Reader {
            src: self,
            pos: 0,
            buf: Vec::new(),
            buf_at: 0,
            error: None,
        }
    }

    /// An [`IndexError::Unsupported`] for this file.
    pub fn unsupported(&self, reason: impl Into<String>, value: impl ToString) -> IndexError {
        IndexError::Unsupported {
            file: self.path.clone(),
            reason: reason.into(),
            value: value.to_string(),
        }
    }

    /// An [`IndexError::Unsupported`] about the data (columns, values, the shards they make),
    /// naming [`Source::data_file`].
    pub fn unsupported_data(&self, reason: impl Into<String>, value: impl ToString) -> IndexError {
        IndexError::Unsupported {
            file: self.data_file().to_path_buf(),
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

/// A buffered `Read + Seek` view of a [`Source`]. A read error is kept ([`Reader::error`]),
/// so the caller can report it as it was (a store error stays a store error).
pub(crate) struct Reader<'a> {
    src: &'a mut Source,
    pos: u64,
    buf: Vec<u8>,
    buf_at: u64,
    error: Option<IndexError>,
}

impl Reader<'_> {
    /// The error behind the last failed read, if any.
    pub fn error(&mut self) -> Option<IndexError> {
        self.error.take()
    }
}

impl Read for Reader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let end = self.buf_at + self.buf.len() as u64;
        if self.pos < self.buf_at || self.pos >= end {
            let n = READER_CHUNK.min(self.src.len.saturating_sub(self.pos));
            if n == 0 {
                return Ok(0);
            }
            self.buf.resize(n as usize, 0);
            if let Err(e) = self.src.blob.read_at(self.pos, &mut self.buf) {
                let msg = e.to_string();
                self.buf.clear();
                self.error = Some(e);
                return Err(std::io::Error::other(msg));
            }
            self.buf_at = self.pos;
        }
        let from = (self.pos - self.buf_at) as usize;
        let n = out.len().min(self.buf.len() - from);
        out[..n].copy_from_slice(&self.buf[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Reader<'_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let target = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            SeekFrom::End(d) => self.src.len.checked_add_signed(d),
        };
        let target = target.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        self.pos = target;
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::temp_dir;

    #[test]
    fn reader_reads_and_seeks_like_the_file() {
        let dir = temp_dir("source-reader");
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(dir.join("f.bin"), &data).unwrap();
        let mut src = Source::open(&dir.join("f.bin"), "f.bin").unwrap();
        let mut r = src.reader();
        let mut head = [0u8; 10];
        r.read_exact(&mut head).unwrap();
        assert_eq!(head, data[..10]);
        r.seek(SeekFrom::Start(150_000)).unwrap();
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, data[150_000..]);
        r.seek(SeekFrom::End(-3)).unwrap();
        r.read_exact(&mut head[..3]).unwrap();
        assert_eq!(head[..3], data[data.len() - 3..]);
        assert!(r.seek(SeekFrom::Current(-1_000_000)).is_err());
        let mut shards = vec![
            src.shard(5, 100_000, Vec::new()).unwrap(),
            src.shard(0, 200_000, Vec::new()).unwrap(),
        ];
        assert!(src.shard(1, 200_000, Vec::new()).is_err(), "past the end");
        src.checksum(&mut shards).unwrap();
        let crc = shardwire_protocol::crc::crc32c;
        assert_eq!(shards[0].crc32c, crc(&data[5..100_005]));
        assert_eq!(shards[1].crc32c, crc(&data));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn data_errors_name_the_origin_and_the_files_own_errors_name_it() {
        // A converted file: its data was the Parquet file's, its bytes are its own.
        let dir = temp_dir("source-origin");
        std::fs::write(dir.join("a.arrow"), b"0123").unwrap();
        let mut src = Source::open(&dir.join("a.arrow"), "a.arrow").unwrap();
        assert_eq!(
            src.data_file(),
            dir.join("a.arrow"),
            "none: the file itself"
        );
        src.origin = Some(dir.join("a.parquet"));
        let data = src.unsupported_data("too many tensors", "x");
        assert!(
            matches!(&data, IndexError::Unsupported { file, .. } if *file == dir.join("a.parquet")),
            "{data:?}"
        );
        let own = src.read_at("footer", 2, 10).unwrap_err();
        assert!(
            matches!(&own, IndexError::Malformed { file, .. } if *file == dir.join("a.arrow")),
            "{own:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn first_nonzero_finds_the_first_past_a_read_and_none_in_zeros() {
        let dir = temp_dir("source-zeros");
        let chunk = ZERO_SCAN_CHUNK as usize;
        let mut data = vec![0u8; chunk + 10];
        data[chunk + 3] = 9;
        data[chunk + 7] = 1;
        std::fs::write(dir.join("z.bin"), &data).unwrap();
        let mut src = Source::open(&dir.join("z.bin"), "z.bin").unwrap();
        let at = |src: &mut Source, from: u64| src.first_nonzero("tail", from).unwrap();
        assert_eq!(at(&mut src, 0), Some(ZERO_SCAN_CHUNK + 3));
        assert_eq!(at(&mut src, ZERO_SCAN_CHUNK + 4), Some(ZERO_SCAN_CHUNK + 7));
        assert_eq!(at(&mut src, ZERO_SCAN_CHUNK + 8), None);
        let end = src.len;
        assert_eq!(at(&mut src, end), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
