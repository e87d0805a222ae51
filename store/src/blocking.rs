//! [`Blocking`]: the same operations as [`Store`], blocking, for synchronous callers (the
//! indexer). It owns a small multi-thread tokio runtime, so connections make progress on its
//! workers while the caller's thread handles the bytes (CRC) it is given: the GETs of
//! [`Blocking::read_ranges`] run as tasks there, not in a future the caller's thread polls
//! between its callbacks. Never call it from inside an async runtime (it blocks on its own).

use std::collections::VecDeque;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

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
    /// caller's thread while up to `parallel` later ones are being fetched, as tasks on the
    /// runtime's workers (so their bodies keep arriving while `each` runs). Memory: at most
    /// `parallel` ranges in flight and the one `each` holds. On an error the GETs still in
    /// flight are cancelled.
    pub fn read_ranges<F: FnMut(usize, Bytes) -> std::io::Result<()>>(
        &self,
        key: &str,
        ranges: Vec<Range<u64>>,
        etag: Option<&str>,
        parallel: usize,
        mut each: F,
    ) -> Result<(), StoreError> {
        let mut todo = ranges.into_iter();
        let mut flight = InFlight(VecDeque::new());
        for i in 0.. {
            while flight.0.len() < parallel.max(1)
                && let Some(r) = todo.next()
            {
                flight
                    .0
                    .push_back((r.clone(), self.spawn_read(key, r, etag)));
            }
            let Some((range, task)) = flight.0.pop_front() else {
                return Ok(());
            };
            let bytes = match self.rt.block_on(task) {
                Ok(read) => read?,
                // A panic in the read is the caller's, as it was when the read ran here.
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => {
                    return Err(StoreError::Unavailable {
                        bucket: self.url().bucket().to_owned(),
                        key: self.url().key(key),
                        range: Some(range),
                        reason: format!("the read's task was cancelled: {e}"),
                    });
                }
            };
            // The next one starts now, not after `each`: `parallel` stay in flight while the
            // callback runs (and `parallel` while a read is waited for).
            if let Some(r) = todo.next() {
                flight
                    .0
                    .push_back((r.clone(), self.spawn_read(key, r, etag)));
            }
            each(i, bytes).map_err(|source| StoreError::Sink {
                bucket: self.url().bucket().to_owned(),
                key: self.url().key(key),
                range,
                source,
            })?;
        }
        Ok(())
    }

    /// [`Store::read`] of `range` as a task on the runtime.
    fn spawn_read(&self, key: &str, range: Range<u64>, etag: Option<&str>) -> Read {
        let (store, key, etag) = (self.store.clone(), key.to_owned(), etag.map(str::to_owned));
        self.rt
            .spawn(async move { store.read(&key, range, etag.as_deref()).await })
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

/// A read running as a task.
type Read = tokio::task::JoinHandle<Result<Bytes, StoreError>>;

/// The reads of one [`Blocking::read_ranges`] in flight, in order; cancelled when it returns
/// early (a dropped `JoinHandle` would leave its task running, holding a window slot).
struct InFlight(VecDeque<(Range<u64>, Read)>);

impl Drop for InFlight {
    fn drop(&mut self) {
        for (_, task) in &self.0 {
            task.abort();
        }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::store::tests::{Quirky, data, memory};

    /// Before, the GETs ran in a future the caller's thread polled between callbacks: while
    /// `each` handled one range, no other GET made progress.
    #[test]
    fn later_gets_run_while_the_callback_handles_a_range() {
        let done = Arc::new(AtomicUsize::new(0));
        let os = Arc::new(Quirky {
            slow_gets: Some(Arc::clone(&done)),
            ..Default::default()
        });
        let url = StoreUrl::parse("s3://unit-blocking-ranges/pre").unwrap();
        let store = Store::with_object_store(&url, StoreOptions::default(), os, memory());
        let b = Blocking::new(store).unwrap();
        b.put("a.bin", data(30)).unwrap();
        let mut got = Vec::new();
        let mut done_in_first = 0;
        b.read_ranges("a.bin", vec![0..10, 10..20, 20..30], None, 3, |i, bytes| {
            if i == 0 {
                // The other two answer 20 and 40 ms after this one, if they run at all.
                let t0 = Instant::now();
                let waited = || t0.elapsed() > Duration::from_secs(5);
                while done.load(Ordering::SeqCst) < 3 && !waited() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                done_in_first = done.load(Ordering::SeqCst);
            }
            got.push((i, bytes));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            done_in_first, 3,
            "the other GETs ran while the first was handled"
        );
        let all = data(30);
        let want: Vec<(usize, Bytes)> = (0..3)
            .map(|i| (i, all.slice(i * 10..i * 10 + 10)))
            .collect();
        assert_eq!(got, want, "in the order given");
    }

    #[test]
    fn a_failed_range_ends_the_reads_and_names_it() {
        let store = Store::with_object_store(
            &StoreUrl::parse("s3://unit-blocking-fail/pre").unwrap(),
            StoreOptions::default(),
            Arc::new(Quirky::default()),
            memory(),
        );
        let b = Blocking::new(store).unwrap();
        b.put("a.bin", data(30)).unwrap();
        let mut calls = 0;
        let e = b
            .read_ranges("a.bin", vec![0..10, 10..20, 20..30], None, 2, |i, _| {
                calls += 1;
                if i == 1 {
                    return Err(std::io::Error::other("disk full"));
                }
                Ok(())
            })
            .unwrap_err();
        assert_eq!(calls, 2);
        assert!(
            matches!(&e, StoreError::Sink { range, .. } if *range == (10..20)),
            "{e}"
        );
        // The read left in flight is aborted (or done): its slot in the window comes back.
        let t0 = Instant::now();
        while b.window().in_flight > 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(b.window().in_flight, 0);
    }
}
