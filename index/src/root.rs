//! [`Root`]: where a dataset's files are: a local directory, or a listed prefix in object
//! storage. The indexer finds, opens and converts files through it, so every format is read
//! the same way from both.

use std::path::PathBuf;

use shardwire_protocol::manifest::{ObjectEntry, ShardEntry};

use crate::error::{BatchAt, IndexError};
use crate::parquet::{self, ParquetNote};
use crate::remote::{Remote, RemoteChunks};
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

    /// The Arrow IPC file converted from the Parquet file `rel` (converted now, or reused),
    /// open as a source whose messages about the data name `rel` (its `origin`), and those
    /// about the cached file's own bytes (a read, its structure) the cached file; its `rel`
    /// is the cached file's, which the shards name.
    pub fn parquet(&mut self, rel: &str) -> Result<(Source, ParquetNote), IndexError> {
        match self {
            Root::Local(dir) => {
                let parquet = dir.join(rel);
                let (path, note) = parquet::cached(dir, &parquet, rel)?;
                let mut src = Source::open(&path, &note.cache)?;
                src.origin = Some(parquet);
                Ok((src, note))
            }
            Root::Remote(r) => parquet::remote::cached_remote(r, rel),
        }
    }

    /// `e`, an error about the Arrow file converted from the Parquet file `rel`: a column
    /// error (which names `rel` already: [`Source::data_file`]) has the record batch it names
    /// told as the row group and rows of `rel` it holds (as it is when the footer of `rel`
    /// cannot be read again); any other error is passed on as it is.
    pub fn in_row_group(&self, rel: &str, e: IndexError) -> IndexError {
        let (file, index, column, reason, value) = match e {
            IndexError::Column {
                file,
                batch: Some(b),
                column,
                reason,
                value,
            } if let BatchAt::Batch(index) = *b => (file, index, column, reason, value),
            other => return other,
        };
        let at = match self {
            Root::Local(dir) => std::fs::File::open(dir.join(rel))
                .ok()
                .and_then(|f| parquet::batch_at(&f, index)),
            Root::Remote(r) => r
                .meta(rel)
                .and_then(|m| parquet::batch_at(&RemoteChunks::new(r.object(m)), index)),
        };
        IndexError::Column {
            file,
            batch: Some(Box::new(at.unwrap_or(BatchAt::Batch(index)))),
            column,
            reason,
            value,
        }
    }

    /// For a dataset in object storage, the objects `shards` read and the Parquet objects
    /// `parquet` converted (size, ETag: a record of what was converted, which no source
    /// checks, as it reads only the cache); none for a local directory (so its manifest and
    /// digest stay as they were).
    pub fn objects_for(&self, shards: &[ShardEntry], parquet: &[ParquetNote]) -> Vec<ObjectEntry> {
        match self {
            Root::Local(_) => Vec::new(),
            Root::Remote(r) => r.objects_for(shards, parquet.iter().map(|p| p.source.as_str())),
        }
    }
}
