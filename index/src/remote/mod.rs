//! [`Remote`]: a dataset in object storage: the store, and what listing its prefix found
//! (every object's size and ETag). Files open as [`Source`]s over a [`RemoteBlob`]; the
//! manifest records the objects its shards read, and the Parquet objects converted
//! ([`Remote::objects_for`]).

mod blob;
mod chunks;
mod object;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::PathBuf;

use shardwire_protocol::manifest::{ObjectEntry, ShardEntry};
use shardwire_store::{Blocking, Described, ObjectMeta, StoreError, StoreOptions, StoreUrl};

pub(crate) use self::blob::RemoteBlob;
pub(crate) use self::chunks::RemoteChunks;
pub(crate) use self::object::Object;
use crate::error::IndexError;
use crate::source::Source;
use crate::walk::{self, Candidate, Unused};

/// A listed dataset prefix.
pub(crate) struct Remote {
    store: Blocking,
    objects: HashMap<String, ObjectMeta>,
}

impl Remote {
    /// Opens `url` (credentials and endpoint from the environment) and lists its prefix; a
    /// prefix with no objects is an error naming it.
    pub fn open(url: &StoreUrl, opts: StoreOptions) -> Result<Self, IndexError> {
        Self::with_store(Blocking::open(url, opts)?)
    }

    /// Lists the prefix of an opened store.
    pub fn with_store(store: Blocking) -> Result<Self, IndexError> {
        let listed = store.list()?;
        if listed.is_empty() {
            return Err(IndexError::NoObjects {
                url: store.url().to_string(),
            });
        }
        let objects = listed.into_iter().map(|o| (o.key.clone(), o)).collect();
        Ok(Self { store, objects })
    }

    /// The store.
    pub fn store(&self) -> &Blocking {
        &self.store
    }

    /// The store's backend, credential source, endpoint and region.
    pub fn described(&self) -> &Described {
        self.store.store().described()
    }

    /// `s3://bucket/prefix/REL`, for messages.
    pub fn display(&self, rel: &str) -> PathBuf {
        PathBuf::from(format!("{}/{rel}", self.store.url()))
    }

    /// The data files and the files not used, by the rules of a directory walk.
    pub fn collect(&self) -> (Vec<Candidate>, Vec<Unused>) {
        let listing = self.objects.values().map(|o| (o.key.as_str(), o.size));
        walk::from_listing(listing, |rel| self.display(rel))
    }

    /// What the listing says of `rel`.
    pub fn meta(&self, rel: &str) -> Option<&ObjectMeta> {
        self.objects.get(rel)
    }

    /// Records an object written while indexing (a converted Parquet file).
    pub fn insert(&mut self, meta: ObjectMeta) {
        self.objects.insert(meta.key.clone(), meta);
    }

    /// The listed object `meta`, for reading.
    pub fn object(&self, meta: &ObjectMeta) -> Object {
        Object::new(self.store.clone(), &meta.key, meta.etag.clone(), meta.size)
    }

    /// Opens the listed object `rel`.
    pub fn open_file(&self, rel: &str) -> Result<Source, IndexError> {
        let meta = self.meta(rel).ok_or_else(|| StoreError::NotFound {
            bucket: self.store.url().bucket().to_owned(),
            key: self.store.url().key(rel),
        })?;
        let blob = RemoteBlob::new(self.object(meta));
        Ok(Source::new(
            self.display(rel),
            rel,
            meta.size,
            Box::new(blob),
        ))
    }

    /// The object entries (size, ETag) of the files `shards` read, and of the objects
    /// `also` names (the Parquet objects converted: no shard reads them, and no source checks
    /// their entries, which record what was converted; a changed one is converted again at
    /// the next index, whose sidecar check sees the new size or ETag).
    pub fn objects_for<'a>(
        &self,
        shards: &'a [ShardEntry],
        also: impl Iterator<Item = &'a str>,
    ) -> Vec<ObjectEntry> {
        let mut files: Vec<&str> = shards.iter().map(|s| s.file.as_str()).collect();
        files.extend(also);
        files.sort_unstable();
        files.dedup();
        files
            .into_iter()
            .filter_map(|f| self.meta(f))
            .map(|o| ObjectEntry {
                file: o.key.clone(),
                size: o.size,
                etag: o.etag.clone(),
            })
            .collect()
    }
}
