//! [`Root`]: where a dataset's files are: a local directory, or a listed prefix in object
//! storage. The indexer finds, opens and converts files through it, so every format is read
//! the same way from both.

use std::path::PathBuf;

use shardwire_protocol::manifest::{ObjectEntry, ShardEntry};

use crate::error::IndexError;
use crate::parquet::{self, ParquetNote};
use crate::remote::Remote;
use crate::source::Source;
use crate::walk::{self, Candidate, Unused};

/// A dataset's location.
pub(crate) enum Root {
    /// A local directory.
    Local(PathBuf),
    /// An object-store prefix, listed.
    Remote(Remote),
}

impl Root {
    /// The directory, or the URL, for messages.
    pub fn path(&self) -> PathBuf {
        match self {
            Root::Local(dir) => dir.clone(),
            Root::Remote(r) => PathBuf::from(r.store().url().to_string()),
        }
    }

    /// The data files, sorted, and the files not used.
    pub fn collect(&self) -> Result<(Vec<Candidate>, Vec<Unused>), IndexError> {
        match self {
            Root::Local(dir) => {
                if !dir.is_dir() {
                    return Err(IndexError::NotADirectory { dir: dir.clone() });
                }
                walk::collect(dir)
            }
            Root::Remote(r) => Ok(r.collect()),
        }
    }

    /// Opens the file `rel`.
    pub fn open(&self, rel: &str) -> Result<Source, IndexError> {
        match self {
            Root::Local(dir) => Source::open(&dir.join(rel), rel),
            Root::Remote(r) => r.open_file(rel),
        }
    }

    /// The Arrow IPC file converted from the Parquet file `rel` (converted now, or reused).
    pub fn parquet(&mut self, rel: &str) -> Result<(Source, ParquetNote), IndexError> {
        match self {
            Root::Local(dir) => {
                let (path, note) = parquet::cached(dir, &dir.join(rel), rel)?;
                Ok((Source::open(&path, &note.cache)?, note))
            }
            Root::Remote(r) => parquet::remote::cached_remote(r, rel),
        }
    }

    /// For a dataset in object storage, the objects `shards` read (size, ETag); none for a
    /// local directory (so its manifest and digest stay as they were).
    pub fn objects_for(&self, shards: &[ShardEntry]) -> Vec<ObjectEntry> {
        match self {
            Root::Local(_) => Vec::new(),
            Root::Remote(r) => r.objects_for(shards),
        }
    }
}
