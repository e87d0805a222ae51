//! [`Blocking`]: the same operations as [`Store`], blocking, for synchronous callers (the
//! indexer). It owns a small multi-thread tokio runtime, so connections make progress on its
//! workers while the caller's thread handles the bytes (CRC) it is given. Never call it from
//! inside an async runtime (it blocks on its own).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;

use crate::error::StoreError;
use crate::options::StoreOptions;
use crate::store::{ObjectMeta, Store};
use crate::url::StoreUrl;
use crate::window::WindowStatus;

/// Worker threads of the runtime: I/O only, the caller does the CPU work.
const WORKERS: usize = 2;

/// A [`Store`] with blocking methods (cheap to clone).
#[derive(Clone, Debug)]
pub struct Blocking {
    rt: Arc<tokio::runtime::Runtime>,
    store: Store,
}

impl Blocking {
    /// Opens `url` as [`Store::open`] does, with its own runtime.
    pub fn open(url: &StoreUrl, opts: StoreOptions) -> Result<Blocking, StoreError> {
        let rt = runtime(url)?;
        let store = {
            let _guard = rt.enter();
            Store::open(url, opts)?
        };
        Ok(Blocking {
            rt: Arc::new(rt),
            store,
        })
    }

    /// Wraps an opened store with a runtime of its own.
    pub fn new(store: Store) -> Result<Blocking, StoreError> {
        let rt = runtime(store.url())?;
        Ok(Blocking {
            rt: Arc::new(rt),
            store,
        })
    }

    /// The async store underneath.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// See [`Store::url`].
    pub fn url(&self) -> &StoreUrl {
        self.store.url()
    }

    /// See [`Store::options`].
    pub fn options(&self) -> &StoreOptions {
        self.store.options()
    }

    /// See [`Store::window`].
    pub fn window(&self) -> WindowStatus {
        self.store.window()
    }

    /// See [`Store::list`].
    pub fn list(&self) -> Result<Vec<ObjectMeta>, StoreError> {
        self.rt.block_on(self.store.list())
    }

    /// See [`Store::head`].
    pub fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        self.rt.block_on(self.store.head(key))
    }

    /// See [`Store::read`].
    pub fn read(
        &self,
        key: &str,
        range: Range<u64>,
        etag: Option<&str>,
    ) -> Result<Bytes, StoreError> {
        self.rt.block_on(self.store.read(key, range, etag))
    }

    /// See [`Store::read_to`].
    pub fn read_to<F: FnMut(&[u8]) -> std::io::Result<()>>(
        &self,
        key: &str,
        range: Range<u64>,
        etag: Option<&str>,
        sink: F,
    ) -> Result<u64, StoreError> {
        self.rt.block_on(self.store.read_to(key, range, etag, sink))
    }

    /// See [`Store::read_suffix`].
    pub fn read_suffix(&self, key: &str, n: u64, etag: Option<&str>) -> Result<Bytes, StoreError> {
        self.rt.block_on(self.store.read_suffix(key, n, etag))
    }

    /// [`Store::read_ranges`]: each range, in order, handed to `each(index, bytes)` on the
    /// caller's thread while up to `parallel` later ones are being fetched.
    pub fn read_ranges<F: FnMut(usize, Bytes) -> std::io::Result<()>>(
        &self,
        key: &str,
        ranges: Vec<Range<u64>>,
        etag: Option<&str>,
        parallel: usize,
        mut each: F,
    ) -> Result<(), StoreError> {
        let all = ranges.clone();
        self.rt.block_on(async {
            let mut s = std::pin::pin!(self.store.read_ranges(key, ranges, etag, parallel));
            let mut i = 0;
            while let Some(b) = s.next().await {
                each(i, b?).map_err(|source| StoreError::Sink {
                    bucket: self.url().bucket().to_owned(),
                    key: self.url().key(key),
                    range: all[i].clone(),
                    source,
                })?;
                i += 1;
            }
            Ok(())
        })
    }

    /// See [`Store::put`].
    pub fn put(&self, key: &str, body: Bytes) -> Result<(), StoreError> {
        self.rt.block_on(self.store.put(key, body))
    }

    /// See [`Store::put_file`].
    pub fn put_file(&self, key: &str, src: &Path) -> Result<ObjectMeta, StoreError> {
        self.rt.block_on(self.store.put_file(key, src))
    }
}

fn runtime(url: &StoreUrl) -> Result<tokio::runtime::Runtime, StoreError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .thread_name("shardwire-store")
        .enable_all()
        .build()
        .map_err(|e| StoreError::Config {
            url: url.to_string(),
            reason: format!("cannot start the I/O runtime: {e}"),
        })
}
