//! [`Store`]: one dataset location's object store. Every request waits for a slot in the
//! bucket's adaptive window, runs under the HTTP tap's [`Call`] (so throttles reach the
//! window and failures get their cause), is timed, and fails with a [`StoreError`] naming the
//! bucket, key and range. Ranged reads are exactly one GET each (`If-Match` when an ETag is
//! given) and never hold more than the range asked for: a body that runs longer is refused
//! at the first extra byte.

use std::ops::Range;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use crate::backend::{self, Described};
use crate::error::{At, EtagAnswer, StoreError, classify, classify_get};
use crate::etag::{if_match, quoted_etag, same_etag};
use crate::metrics as m;
use crate::options::StoreOptions;
use crate::tap::{Call, Tracked};
use crate::url::{Scheme, StoreUrl};
use crate::window::{self, Permit, Urgency, Window, WindowStatus};

/// An object under the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Key relative to the prefix, `/`-separated.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// ETag as the store reports it (S3: with its double quotes).
    pub etag: Option<String>,
}

/// Most objects one listing returns (about 1.5 GB of metadata): a prefix with more is not one
/// dataset ([`StoreError::ListTooLong`]).
pub const MAX_LIST_OBJECTS: usize = 10_000_000;
/// Longest one listing may take (10 million objects at 1000 per page and 100 ms per page take
/// about 17 minutes).
pub const LIST_DEADLINE: Duration = Duration::from_secs(30 * 60);
/// A listing logs its progress every this many objects.
const LIST_PROGRESS: usize = 100_000;

/// Smallest part of a multipart upload S3 accepts.
const MIN_PART: u64 = 5 << 20;
/// Most parts of one multipart upload S3 accepts.
const MAX_PARTS: u64 = 10_000;

/// The part size of a multipart upload of `size` bytes: the request size, at least S3's
/// smallest part, and larger where [`MAX_PARTS`] parts would not hold the file.
fn part_size(request_size: u64, size: u64) -> u64 {
    request_size.max(MIN_PART).max(size.div_ceil(MAX_PARTS))
}
/// Parts of one `put_file` in flight at once.
const PUT_PARTS_IN_FLIGHT: usize = 2;

/// A dataset location's object store (cheap to clone; clones share everything).
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
    /// Whether its requests go before other waiters for the bucket's window
    /// ([`Store::with_urgency`]).
    urgency: Urgency,
}

#[derive(Debug)]
struct Inner {
    os: Arc<dyn ObjectStore>,
    /// The listing's client (`os`, but for http(s): [`backend::Client::lister`]).
    lister: Arc<dyn ObjectStore>,
    /// The uploads' client (`os`, but for S3, GCS and Azure: [`backend::Client::writer`]).
    writer: Arc<dyn ObjectStore>,
    url: StoreUrl,
    opts: StoreOptions,
    described: Described,
    window: Arc<Window>,
}

impl Store {
    /// Opens `url` with credentials and endpoint from the environment and logs (at info) the
    /// credential source, endpoint, region and addressing style, never a secret.
    pub fn open(url: &StoreUrl, opts: StoreOptions) -> Result<Store, StoreError> {
        let client = backend::build(url, &opts)?;
        tracing::info!(url = %url, "object store: {}", client.described);
        Ok(Self::assemble(url, opts, client))
    }

    /// A store over a given object_store client (tests: `InMemory`).
    pub fn with_object_store(
        url: &StoreUrl,
        opts: StoreOptions,
        os: Arc<dyn ObjectStore>,
        described: Described,
    ) -> Store {
        let client = backend::Client {
            os,
            lister: None,
            writer: None,
            described,
            account: None,
        };
        Self::assemble(url, opts, client)
    }

    /// A store over `client`, in the throttling window of the storage it reaches
    /// ([`window_key`]).
    fn assemble(url: &StoreUrl, opts: StoreOptions, client: backend::Client) -> Store {
        let key = window_key(url, client.account.as_deref());
        let window = window::for_bucket(&key, opts.max_inflight);
        let backend::Client {
            os,
            lister,
            writer,
            described,
            ..
        } = client;
        Store {
            inner: Arc::new(Inner {
                lister: lister.unwrap_or_else(|| Arc::clone(&os)),
                writer: writer.unwrap_or_else(|| Arc::clone(&os)),
                os,
                url: url.clone(),
                opts,
                described,
                window,
            }),
            urgency: Urgency::new(false),
        }
    }

    /// The dataset location.
    pub fn url(&self) -> &StoreUrl {
        &self.inner.url
    }

    /// The options it was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.inner.opts
    }

    /// The backend, credential source, endpoint and region (as logged at open).
    pub fn described(&self) -> &Described {
        &self.inner.described
    }

    /// The bucket's window: current limit, in flight, throttles seen.
    pub fn window(&self) -> WindowStatus {
        self.inner.window.status()
    }

    /// The object path of `key` (relative to the prefix).
    fn path(&self, key: &str) -> Result<(String, Path), StoreError> {
        let full = self.inner.url.key(key);
        let path = Path::parse(&full).map_err(|e| StoreError::Config {
            url: self.inner.url.to_string(),
            reason: format!("key {full:?} is not a valid object path: {e}"),
        })?;
        Ok((full, path))
    }

    /// The same store, whose requests are urgent while `urgency` is: they take the bucket's
    /// next free slot before those of other handles waiting (a read someone waits for now,
    /// against reads ahead), also once raised while they wait ([`Store::raise`]).
    pub fn with_urgency(&self, urgency: Urgency) -> Store {
        Store {
            inner: Arc::clone(&self.inner),
            urgency,
        }
    }

    /// Makes `urgency` urgent: the requests of a store with it that are still waiting for a
    /// slot in the bucket's window go first from now on.
    pub fn raise(&self, urgency: &Urgency) {
        self.inner.window.raise(urgency);
    }

    async fn begin(&self, op: &'static str) -> (Permit, Arc<Call>) {
        let permit = self.inner.window.acquire(&self.urgency).await;
        let call = Call::new(op, Arc::clone(&self.inner.window), permit.epoch());
        (permit, call)
    }

    fn at<'a>(&'a self, key: &'a str, range: Option<Range<u64>>, etag: Option<&'a str>) -> At<'a> {
        let scheme = self.inner.url.scheme();
        At {
            bucket: self.inner.url.bucket(),
            key,
            range,
            etag,
            uncredentialed: matches!(scheme, Scheme::Http | Scheme::Https),
            check: scheme.refusal_check(),
            listing: None,
        }
    }

    /// Every object under the prefix, keys relative to it, in the store's order; at most
    /// `MAX_LIST_OBJECTS` of them, within `LIST_DEADLINE`.
    pub async fn list(&self) -> Result<Vec<ObjectMeta>, StoreError> {
        self.list_within(MAX_LIST_OBJECTS, LIST_DEADLINE).await
    }

    async fn list_within(
        &self,
        max_objects: usize,
        deadline: Duration,
    ) -> Result<Vec<ObjectMeta>, StoreError> {
        let prefix = self.inner.url.prefix();
        let (_, path) = self.path("")?;
        let (mut permit, call) = self.begin("list").await;
        let t0 = Instant::now();
        let base = (!prefix.is_empty()).then_some(&path);
        let mut listed = Vec::new();
        let pages = async {
            let mut objects = self.inner.lister.list(base);
            while let Some(o) = objects.try_next().await? {
                if listed.len() == max_objects {
                    return Ok(Some(format!("more than {max_objects} objects")));
                }
                listed.push(o);
                if listed.len() % LIST_PROGRESS == 0 {
                    tracing::info!(bucket = %self.inner.url.bucket(), prefix, objects = listed.len(), "listing");
                }
            }
            Ok(None)
        };
        let ended = call.run(tokio::time::timeout(deadline, pages)).await;
        let stopped = match ended {
            Err(_) => Some(format!("it took longer than {deadline:?}")),
            // A WebDAV server answers the whole tree at once, collected in memory: past its
            // bound a narrower prefix is the fix. A page or an error reply past its bound is
            // a server or proxy that does not end its answer: unavailable, asked again.
            Ok(Err(ref e)) if let Some(t) = crate::capped::too_long(e) => match t.cap {
                crate::capped::Cap::WebDav => Some(t.to_string()),
                _ => {
                    return Err(StoreError::Unavailable {
                        bucket: self.inner.url.bucket().to_owned(),
                        key: prefix.to_owned(),
                        range: None,
                        reason: t.to_string(),
                    });
                }
            },
            Ok(r) => r.map_err(|e| {
                let url = self.inner.url.to_string();
                let at = At {
                    listing: Some(&url),
                    ..self.at(prefix, None, None)
                };
                classify(e, call.last().as_ref(), at)
            })?,
        };
        if let Some(why) = stopped {
            return Err(StoreError::ListTooLong {
                bucket: self.inner.url.bucket().to_owned(),
                prefix: prefix.to_owned(),
                objects: listed.len(),
                why,
            });
        }
        metrics::histogram!(m::REQUEST_SECONDS, "op" => "list").record(t0.elapsed().as_secs_f64());
        permit.succeeded();
        if self.inner.url.scheme() == crate::url::Scheme::File {
            self.name_dangling_links().await;
        }
        self.relative_metas(listed, prefix)
    }

    /// The listed objects, folder markers left out, keys relative to `prefix`.
    fn relative_metas(
        &self,
        listed: Vec<object_store::ObjectMeta>,
        prefix: &str,
    ) -> Result<Vec<ObjectMeta>, StoreError> {
        let strip = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        let markers = folder_markers(&listed, prefix);
        listed
            .into_iter()
            .zip(markers)
            .filter(|(_, marker)| !marker)
            .map(|(o, _)| {
                // A store lists under the prefix only; a key outside it (a proxy that
                // rewrites paths, a server's own encoding of them) is named, not skipped.
                let Some(key) = o.location.as_ref().strip_prefix(strip.as_str()) else {
                    return Err(StoreError::Rejected {
                        bucket: self.inner.url.bucket().to_owned(),
                        key: o.location.to_string(),
                        reason: format!(
                            " (the listing under prefix {prefix:?} returned this key outside \
                             it: a proxy or server that rewrites paths?)"
                        ),
                        check: self.inner.url.scheme().refusal_check(),
                    });
                };
                Ok(ObjectMeta {
                    key: key.to_owned(),
                    size: o.size,
                    etag: o.e_tag.as_deref().map(quoted_etag),
                })
            })
            .collect()
    }

    /// Warns of the dangling symbolic links under a `file://` dataset, which its listing
    /// passes over without a word.
    async fn name_dangling_links(&self) {
        let root = std::path::PathBuf::from(self.inner.url.bucket());
        let found = tokio::task::spawn_blocking(move || crate::local::dangling_links(&root))
            .await
            .unwrap_or_default();
        if !found.is_empty() {
            let shown: Vec<&str> = found.iter().take(20).map(String::as_str).collect();
            tracing::warn!(dir = %self.inner.url.bucket(), links = found.len(),
                "symbolic links whose targets are missing are not in the dataset (an unmounted volume?): {}{}",
                shown.join(", "), if found.len() > shown.len() { ", ..." } else { "" });
        }
    }

    /// Size and ETag of `key`.
    pub async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        let (full, path) = self.path(key)?;
        let (mut permit, call) = self.begin("head").await;
        let t0 = Instant::now();
        let meta = call.run(self.inner.os.head(&path)).await;
        let meta =
            meta.map_err(|e| classify(e, call.last().as_ref(), self.at(&full, None, None)))?;
        metrics::histogram!(m::REQUEST_SECONDS, "op" => "head").record(t0.elapsed().as_secs_f64());
        permit.succeeded();
        Ok(ObjectMeta {
            key: key.to_owned(),
            size: meta.size,
            etag: meta.e_tag.as_deref().map(quoted_etag),
        })
    }

    /// `range` of `key`: one ranged GET (`If-Match: etag` when given), after a slot in the
    /// bucket's window. An empty range costs no request.
    pub async fn read(
        &self,
        key: &str,
        range: Range<u64>,
        etag: Option<&str>,
    ) -> Result<Bytes, StoreError> {
        let want = range.end.saturating_sub(range.start);
        let mut parts: Vec<Bytes> = Vec::new();
        self.fetch(key, Want::Range(range), etag, |b| {
            parts.push(b);
            Ok(())
        })
        .await?;
        Ok(join(parts, want))
    }

    /// The same GET as [`Store::read`], each chunk handed to `sink` as it arrives; returns
    /// the bytes read. An error from `sink` ends the request as [`StoreError::Sink`].
    pub async fn read_to<F: FnMut(&[u8]) -> std::io::Result<()>>(
        &self,
        key: &str,
        range: Range<u64>,
        etag: Option<&str>,
        mut sink: F,
    ) -> Result<u64, StoreError> {
        let r = range.clone();
        let bucket = self.inner.url.bucket();
        let full = self.inner.url.key(key);
        self.fetch(key, Want::Range(range), etag, |b| {
            sink(&b).map_err(|source| StoreError::Sink {
                bucket: bucket.to_owned(),
                key: full.clone(),
                range: r.clone(),
                source,
            })
        })
        .await
    }

    /// The last `n` bytes of `key` (all of it when shorter): one suffix GET, for footers. On
    /// Azure, which serves no suffix ranges (object_store refuses one before sending it): a
    /// HEAD, then one ranged GET pinned to the ETag given or else to the one the HEAD named
    /// (an object replaced in between is [`StoreError::Changed`], not a wrong tail).
    pub async fn read_suffix(
        &self,
        key: &str,
        n: u64,
        etag: Option<&str>,
    ) -> Result<Bytes, StoreError> {
        if n > 0 && self.inner.url.scheme() == crate::url::Scheme::Azure {
            let meta = self.head(key).await?;
            let pin = etag.or(meta.etag.as_deref());
            return self
                .read(key, meta.size.saturating_sub(n)..meta.size, pin)
                .await;
        }
        let mut parts: Vec<Bytes> = Vec::new();
        let got = self
            .fetch(key, Want::Suffix(n), etag, |b| {
                parts.push(b);
                Ok(())
            })
            .await?;
        Ok(join(parts, got))
    }

    /// `ranges` of `key` read with up to `parallel` GETs in flight (and the window's limit),
    /// yielded in the order given: memory is at most `parallel` ranges.
    pub fn read_ranges<'a>(
        &'a self,
        key: &'a str,
        ranges: Vec<Range<u64>>,
        etag: Option<&'a str>,
        parallel: usize,
    ) -> impl Stream<Item = Result<Bytes, StoreError>> + 'a {
        futures_util::stream::iter(ranges)
            .map(move |r| self.read(key, r, etag))
            .buffered(parallel.max(1))
    }

    /// One GET of `want`; each chunk goes to `on_chunk`; returns the bytes received.
    async fn fetch(
        &self,
        key: &str,
        want: Want,
        etag: Option<&str>,
        on_chunk: impl FnMut(Bytes) -> Result<(), StoreError>,
    ) -> Result<u64, StoreError> {
        let (full, path) = self.path(key)?;
        let (asked, get_range) = match &want {
            Want::Range(r) if r.start > r.end => {
                return Err(StoreError::BadRange {
                    bucket: self.inner.url.bucket().to_owned(),
                    key: full,
                    start: r.start,
                    end: r.end,
                });
            }
            Want::Range(r) if r.is_empty() => return Ok(0),
            Want::Range(r) => (Some(r.clone()), GetRange::Bounded(r.clone())),
            Want::Suffix(0) => return Ok(0),
            Want::Suffix(n) => (None, GetRange::Suffix(*n)),
        };
        let (mut permit, call) = self.begin("get").await;
        let t0 = Instant::now();
        let at = self.at(&full, asked, etag);
        let opts = GetOptions {
            range: Some(get_range),
            if_match: if_match(etag),
            ..Default::default()
        };
        let body = async {
            let res = self.inner.os.get_opts(&path, opts).await;
            let res = res.map_err(|e| classify_get(e, call.last().as_ref(), at.clone()))?;
            check_etag(&at, etag, res.meta.e_tag.as_deref())?;
            let expect = expected(&want, res.range.clone()).map_err(|(r, got)| at.short(r, got))?;
            receive(res, expect, &at, &call, on_chunk).await
        };
        let got = call.run(body).await?;
        metrics::histogram!(m::REQUEST_SECONDS, "op" => "get").record(t0.elapsed().as_secs_f64());
        permit.succeeded();
        Ok(got)
    }

    /// Writes `body` to `key` (the manifest beside the data): one PUT.
    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), StoreError> {
        let (full, path) = self.path(key)?;
        self.writable(&full)?;
        let (mut permit, call) = self.begin("put").await;
        let t0 = Instant::now();
        let res = call
            .run(self.inner.writer.put(&path, PutPayload::from_bytes(body)))
            .await;
        res.map_err(|e| classify(e, call.last().as_ref(), self.at(&full, None, None)))?;
        metrics::histogram!(m::REQUEST_SECONDS, "op" => "put").record(t0.elapsed().as_secs_f64());
        permit.succeeded();
        Ok(())
    }

    /// Uploads the local file `src` to `key` (a multipart upload in request-size parts when
    /// larger than one, or larger parts where S3's part count needs them; memory: about four
    /// parts: two uploading, the one being filled and the read buffer), then returns its size
    /// and ETag (one HEAD).
    pub async fn put_file(&self, key: &str, src: &FsPath) -> Result<ObjectMeta, StoreError> {
        let (full, path) = self.path(key)?;
        self.writable(&full)?;
        let sink_err = |source| StoreError::Sink {
            bucket: self.inner.url.bucket().to_owned(),
            key: full.clone(),
            range: 0..0,
            source,
        };
        let size = std::fs::metadata(src).map_err(sink_err)?.len();
        let part = part_size(self.inner.opts.request_size, size);
        if size <= part {
            let body = tokio::fs::read(src).await.map_err(sink_err)?;
            self.put(key, Bytes::from(body)).await?;
            return self.head(key).await;
        }
        let (mut permit, call) = self.begin("put").await;
        let at = self.at(&full, None, None);
        let upload = async {
            use tokio::io::AsyncReadExt;
            let os_err = |e| classify(e, call.last().as_ref(), at.clone());
            let mut f = tokio::fs::File::open(src).await.map_err(sink_err)?;
            let up = self.inner.writer.put_multipart(&path).await;
            let up = up.map_err(os_err)?;
            let up = Box::new(Tracked {
                inner: up,
                call: Arc::clone(&call),
            });
            let mut w = WriteMultipart::new_with_chunk_size(up, part as usize);
            let mut buf = vec![0u8; part as usize];
            let parts = async {
                loop {
                    let n = f.read(&mut buf).await.map_err(sink_err)?;
                    if n == 0 {
                        return Ok(());
                    }
                    w.wait_for_capacity(PUT_PARTS_IN_FLIGHT)
                        .await
                        .map_err(os_err)?;
                    w.write(&buf[..n]);
                }
            };
            match parts.await {
                Ok(()) => w.finish().await.map_err(os_err),
                Err(e) => {
                    // The store keeps (and bills) the parts of an upload never completed.
                    if let Err(a) = w.abort().await {
                        tracing::warn!(key = %full, error = %crate::error::short(&a), "aborting a failed multipart upload failed; the bucket keeps its parts until a lifecycle rule removes them");
                    }
                    Err(e)
                }
            }
        };
        call.run(upload).await?;
        permit.succeeded();
        drop(permit);
        self.head(key).await
    }

    fn writable(&self, full: &str) -> Result<(), StoreError> {
        if self.inner.url.scheme().writable() {
            return Ok(());
        }
        Err(StoreError::Config {
            url: self.inner.url.to_string(),
            reason: format!("http(s) locations are read-only; cannot write {full}"),
        })
    }
}

/// The name of the throttling window of `url`'s bucket: the storage its requests reach,
/// however the URL writes it. An Azure container is named with its account (`account`: the
/// one the client resolved, else the URL's), not the URL's host: `az://data` with
/// `AZURE_STORAGE_ACCOUNT_NAME=myacct`, `az://data@myacct.blob.core.windows.net` and
/// `az://data@myacct.dfs.core.windows.net` are one container, and share one window; a
/// container of that name in another account is another bucket.
fn window_key(url: &StoreUrl, account: Option<&str>) -> String {
    let bucket = url.bucket();
    match url.scheme() {
        Scheme::Azure => match account.or(url.account()) {
            Some(account) => format!("az://{bucket}@{account}"),
            None => format!("az://{bucket}"),
        },
        scheme => format!("{}://{bucket}", scheme.as_str()),
    }
}

/// What one GET asks for.
enum Want {
    Range(Range<u64>),
    Suffix(u64),
}

/// Which of `listed` are folder markers (`pre/`, `pre/sub/`: empty objects made by consoles,
/// s3fs, rclone), which object_store names without their slash (`pre`, `pre/sub`): no objects
/// of the dataset. The prefix's own, and any empty one that other keys lie under.
fn folder_markers(listed: &[object_store::ObjectMeta], prefix: &str) -> Vec<bool> {
    let dirs: std::collections::BTreeSet<&str> =
        listed.iter().map(|o| o.location.as_ref()).collect();
    let is_marker = |o: &object_store::ObjectMeta| {
        let loc = o.location.as_ref();
        let under = format!("{loc}/");
        (!prefix.is_empty() && loc == prefix)
            || (o.size == 0
                && dirs
                    .range(under.as_str()..)
                    .next()
                    .is_some_and(|k| k.starts_with(&under)))
    };
    listed.iter().map(is_marker).collect()
}

/// The range a GET of `want` must deliver, from the range the store says it sends: exactly
/// the range asked, or for a suffix at most `n` bytes. Err: (the range, the bytes said) for
/// a short or wrong answer.
fn expected(want: &Want, sent: Range<u64>) -> Result<Range<u64>, (Range<u64>, u64)> {
    let said = sent.end - sent.start;
    match want {
        Want::Range(r) if sent != *r => Err((r.clone(), said)),
        Want::Range(r) => Ok(r.clone()),
        Want::Suffix(n) if said > *n => Err((sent, said)),
        Want::Suffix(_) => Ok(sent),
    }
}

/// Refuses the answer to a GET pinned to `asked` that names another ETag (`sent`) or none:
/// a store that ignored `If-Match` still names the object it read, and another one's bytes
/// (or bytes it names no version of) are never passed on as the ones asked for.
fn check_etag(at: &At<'_>, asked: Option<&str>, sent: Option<&str>) -> Result<(), StoreError> {
    let Some(asked) = asked else {
        return Ok(());
    };
    if sent.is_some_and(|sent| same_etag(asked, sent)) {
        return Ok(());
    }
    Err(StoreError::Changed {
        bucket: at.bucket.to_owned(),
        key: at.key.to_owned(),
        etag: asked.to_owned(),
        sent: Box::new(match sent {
            Some(t) => EtagAnswer::Named(t.to_owned()),
            None => EtagAnswer::Unnamed,
        }),
    })
}

/// The body of `res`, which must be exactly `expect`: each chunk to `on_chunk`, refused at
/// the first byte past it or when it ends short; returns its length.
async fn receive(
    res: object_store::GetResult,
    expect: Range<u64>,
    at: &At<'_>,
    call: &Call,
    mut on_chunk: impl FnMut(Bytes) -> Result<(), StoreError>,
) -> Result<u64, StoreError> {
    let len = expect.end - expect.start;
    let mut stream = res.into_stream();
    let mut got = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| classify(e, call.last().as_ref(), at.clone()))?;
        got += chunk.len() as u64;
        if got > len {
            return Err(at.short(expect, got));
        }
        metrics::counter!(m::BYTES, "op" => "get").increment(chunk.len() as u64);
        on_chunk(chunk)?;
    }
    if got != len {
        return Err(at.short(expect, got));
    }
    Ok(got)
}

/// The chunks of one body as one buffer (no copy when it came in one chunk).
fn join(mut parts: Vec<Bytes>, len: u64) -> Bytes {
    if parts.len() == 1 {
        return parts.pop().unwrap_or_default();
    }
    // `len` is what the caller asked for and the body was checked against it.
    let mut out = BytesMut::with_capacity(len as usize);
    for p in parts {
        out.extend_from_slice(&p);
    }
    out.freeze()
}

#[cfg(test)]
pub(crate) mod tests;
