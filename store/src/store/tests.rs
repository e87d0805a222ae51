//! [`Store`] over object_store's `InMemory` (pure logic: keys, ranges, errors, the window);
//! real S3 behaviour is tested end to end against moto (tests/e2e/test_index_s3.py).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::TryStreamExt;
use object_store::memory::InMemory;

use super::*;
use crate::error::StoreErrorKind;

pub(crate) fn memory() -> Described {
    Described::plain("memory", "memory")
}

fn store(bucket: &str) -> (Store, Arc<InMemory>) {
    let mem = Arc::new(InMemory::new());
    let url = StoreUrl::parse(&format!("s3://{bucket}/pre")).unwrap();
    let opts = StoreOptions {
        max_inflight: 4,
        ..Default::default()
    };
    let s = Store::with_object_store(&url, opts, mem.clone(), memory());
    (s, mem)
}

pub(crate) fn data(n: usize) -> Bytes {
    Bytes::from((0..n).map(|i| (i * 7 % 251) as u8).collect::<Vec<u8>>())
}

#[tokio::test(flavor = "current_thread")]
async fn list_head_read_under_the_prefix() {
    let (s, mem) = store("unit-list");
    mem.put(&Path::from("pre/a.bin"), data(100).into())
        .await
        .unwrap();
    mem.put(&Path::from("pre/sub/b.bin"), data(10).into())
        .await
        .unwrap();
    mem.put(&Path::from("other/c.bin"), data(5).into())
        .await
        .unwrap();
    let mut keys: Vec<(String, u64, bool)> = s
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|o| (o.key, o.size, o.etag.is_some()))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [("a.bin".into(), 100, true), ("sub/b.bin".into(), 10, true)]
    );
    let meta = s.head("a.bin").await.unwrap();
    assert_eq!((meta.key.as_str(), meta.size), ("a.bin", 100));
    let etag = meta.etag.clone();
    assert_eq!(
        s.read("a.bin", 10..30, etag.as_deref()).await.unwrap(),
        data(100).slice(10..30)
    );
    assert_eq!(s.read("a.bin", 5..5, None).await.unwrap().len(), 0);
    assert_eq!(
        s.read_suffix("a.bin", 8, None).await.unwrap(),
        data(100).slice(92..)
    );
    assert_eq!(
        s.read_suffix("sub/b.bin", 64, None).await.unwrap(),
        data(10)
    );
    let mut seen = Vec::new();
    let n = s
        .read_to("a.bin", 0..100, etag.as_deref(), |b| {
            seen.extend_from_slice(b);
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!((n, Bytes::from(seen)), (100, data(100)));
    let parts: Vec<Bytes> = s
        .read_ranges("a.bin", vec![50..60, 0..10, 90..100], None, 2)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(
        parts,
        [
            data(100).slice(50..60),
            data(100).slice(0..10),
            data(100).slice(90..100)
        ]
    );
    assert_eq!(s.window().in_flight, 0);
}

#[tokio::test(flavor = "current_thread")]
async fn errors_name_the_bucket_key_and_cause() {
    let (s, mem) = store("unit-errors");
    mem.put(&Path::from("pre/a.bin"), data(100).into())
        .await
        .unwrap();
    let e = s.read("missing.bin", 0..4, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::NotFound);
    assert!(
        e.to_string()
            .contains("bucket unit-errors, key pre/missing.bin"),
        "{e}"
    );
    let e = s.read("a.bin", 0..4, Some("\"stale\"")).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Changed);
    assert!(e.to_string().contains("\"stale\""), "{e}");
    // A range past the end: the store sends the rest, which is refused as short.
    let e = s.read("a.bin", 90..120, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Short);
    assert!(
        e.to_string().contains("sent 10 bytes for a range of 30"),
        "{e}"
    );
    let e = s
        .read_to("a.bin", 0..10, None, |_| {
            Err(std::io::Error::other("disk full"))
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Sink);
    assert!(e.to_string().contains("disk full"), "{e}");
    let e = s.read("a/../b", 0..1, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Config);
    assert_eq!(s.window().in_flight, 0, "every permit came back");
}

#[tokio::test(flavor = "current_thread")]
async fn put_and_put_file_round_trip() {
    let (s, mem) = store("unit-put");
    s.put("shardwire.manifest.json", Bytes::from_static(b"{}"))
        .await
        .unwrap();
    let got = mem
        .get(&Path::from("pre/shardwire.manifest.json"))
        .await
        .unwrap();
    assert_eq!(got.bytes().await.unwrap(), Bytes::from_static(b"{}"));
    let dir = std::env::temp_dir().join(format!("shardwire-store-put-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("big.arrow");
    let big = data((MIN_PART as usize) * 2 + 123);
    std::fs::write(&file, &big).unwrap();
    let meta = s.put_file("cache/big.arrow", &file).await.unwrap();
    assert_eq!(meta.size, big.len() as u64);
    let back = s
        .read("cache/big.arrow", 0..meta.size, meta.etag.as_deref())
        .await
        .unwrap();
    assert_eq!(back, big);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn http_locations_are_read_only() {
    let url = StoreUrl::parse("http://127.0.0.1:1/ds").unwrap();
    let s = Store::with_object_store(
        &url,
        StoreOptions::default(),
        Arc::new(InMemory::new()),
        memory(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let e = rt.block_on(s.put("m.json", Bytes::new())).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Config);
    assert!(e.to_string().contains("read-only"), "{e}");
}

/// `InMemory` as a server with a quirk: one that ignores `If-Match` (some S3-compatible
/// servers do; it reads whatever object is there now, and says so in the ETag it returns),
/// one whose listing is not confined to the prefix (a proxy that rewrites paths), one that
/// refuses suffix ranges as object_store's Azure client does, or one whose GETs answer
/// slowly (each 20 ms after the one started before it, counted in `slow_gets` when done).
#[derive(Debug, Default)]
pub(crate) struct Quirky {
    pub(crate) mem: InMemory,
    pub(crate) ignores_if_match: bool,
    pub(crate) lists_everything: bool,
    pub(crate) refuses_suffix: bool,
    pub(crate) slow_gets: Option<Arc<AtomicUsize>>,
    pub(crate) started: AtomicUsize,
}

impl std::fmt::Display for Quirky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Quirky")
    }
}

#[async_trait::async_trait]
impl ObjectStore for Quirky {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.mem.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.mem.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        if self.refuses_suffix && matches!(options.range, Some(GetRange::Suffix(_))) {
            return Err(object_store::Error::NotSupported {
                source: "Azure does not support suffix range requests".into(),
            });
        }
        let options = GetOptions {
            if_match: options.if_match.filter(|_| !self.ignores_if_match),
            ..options
        };
        let Some(done) = &self.slow_gets else {
            return self.mem.get_opts(location, options).await;
        };
        let n = self.started.fetch_add(1, Ordering::SeqCst) as u64;
        tokio::time::sleep(std::time::Duration::from_millis(20 * (n + 1))).await;
        let got = self.mem.get_opts(location, options).await;
        done.fetch_add(1, Ordering::SeqCst);
        got
    }

    fn delete_stream(
        &self,
        locations: futures_util::stream::BoxStream<'static, object_store::Result<Path>>,
    ) -> futures_util::stream::BoxStream<'static, object_store::Result<Path>> {
        self.mem.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&Path>,
    ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>
    {
        self.mem.list(prefix.filter(|_| !self.lists_everything))
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.mem.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.mem.copy_opts(from, to, options).await
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_store_that_ignores_if_match_cannot_pass_off_a_changed_object() {
    let os = Arc::new(Quirky {
        ignores_if_match: true,
        ..Default::default()
    });
    let url = StoreUrl::parse("s3://unit-ignores-if-match/pre").unwrap();
    let s = Store::with_object_store(&url, StoreOptions::default(), os.clone(), memory());
    os.put(&Path::from("pre/a.bin"), data(100).into())
        .await
        .unwrap();
    let pinned = s.head("a.bin").await.unwrap().etag;
    assert_eq!(
        s.read("a.bin", 0..10, pinned.as_deref()).await.unwrap(),
        data(100).slice(0..10)
    );
    // The object is replaced; the server serves the new one despite If-Match.
    os.put(&Path::from("pre/a.bin"), Bytes::from(vec![9u8; 100]).into())
        .await
        .unwrap();
    let e = s.read("a.bin", 0..10, pinned.as_deref()).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Changed, "{e}");
    // The error names the ETag the answer carried: a proxy that rewrites ETags of the same
    // bytes is told apart from a changed object.
    let now = os.head(&Path::from("pre/a.bin")).await.unwrap().e_tag;
    let now = now.expect("InMemory names an ETag");
    assert!(
        e.to_string().contains(&format!("answer named ETag {now}")),
        "{e}"
    );
    let e = s
        .read_suffix("a.bin", 10, pinned.as_deref())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Changed, "{e}");
}

/// Folder markers below the prefix (`pre/sub/`, listed by object_store as `pre/sub`, an
/// empty object) are no objects of the dataset when keys lie under them: listed, they were a
/// 0-byte `sub` that no read could find. An empty object with nothing under it stays listed.
#[tokio::test(flavor = "current_thread")]
async fn folder_markers_with_keys_under_them_are_not_objects() {
    let (s, mem) = store("unit-markers");
    for (key, n) in [
        ("pre", 0),
        ("pre/a.bin", 100),
        ("pre/sub", 0),
        ("pre/sub/b.bin", 10),
        ("pre/sub/deeper", 0),
        ("pre/sub/deeper/c.bin", 3),
        ("pre/empty.bin", 0),
        ("pre/subway.bin", 4),
    ] {
        mem.put(&Path::from(key), data(n).into()).await.unwrap();
    }
    let mut keys: Vec<String> = s.list().await.unwrap().into_iter().map(|o| o.key).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "a.bin",
            "empty.bin",
            "sub/b.bin",
            "sub/deeper/c.bin",
            "subway.bin"
        ]
    );
}

/// A range that ends before it starts (a corrupt offset) is an error naming it, not an
/// empty read passed on as the bytes.
#[tokio::test(flavor = "current_thread")]
async fn a_reversed_range_is_refused_not_read_as_empty() {
    let (s, mem) = store("unit-reversed");
    mem.put(&Path::from("pre/a.bin"), data(100).into())
        .await
        .unwrap();
    #[allow(clippy::reversed_empty_ranges)]
    let e = s.read("a.bin", 30..10, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected);
    assert!(
        e.to_string().contains("range 30..10 ends before it starts"),
        "{e}"
    );
    assert!(s.read("a.bin", 30..30, None).await.unwrap().is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn a_listed_key_outside_the_prefix_is_named_not_skipped() {
    let os = Arc::new(Quirky {
        lists_everything: true,
        ..Default::default()
    });
    let url = StoreUrl::parse("s3://unit-lists-everything/pre").unwrap();
    let s = Store::with_object_store(&url, StoreOptions::default(), os.clone(), memory());
    os.put(&Path::from("pre/a.bin"), data(1).into())
        .await
        .unwrap();
    assert_eq!(s.list().await.unwrap().len(), 1);
    // The prefix's folder marker (`pre/`, listed as `pre`) is no object of the dataset.
    os.put(&Path::from("pre"), Bytes::new().into())
        .await
        .unwrap();
    assert_eq!(s.list().await.unwrap().len(), 1);
    // Before: `other/c.bin` was dropped without a word.
    os.put(&Path::from("other/c.bin"), data(1).into())
        .await
        .unwrap();
    let e = s.list().await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("other/c.bin") && msg.contains("outside"),
        "{msg}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_listing_past_its_object_bound_stops_and_says_so() {
    let (s, mem) = store("unit-list-bound");
    for i in 0..5 {
        mem.put(&Path::from(format!("pre/{i}.bin")), data(1).into())
            .await
            .unwrap();
    }
    let day = std::time::Duration::from_secs(86_400);
    assert_eq!(s.list_within(5, day).await.unwrap().len(), 5);
    let e = s.list_within(3, day).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Config);
    let msg = e.to_string();
    assert!(
        msg.contains("after 3 objects: more than 3 objects") && msg.contains("narrower prefix"),
        "{msg}"
    );
}

#[test]
fn a_file_of_any_size_fits_the_part_count() {
    assert_eq!(part_size(8 << 20, 1 << 30), 8 << 20);
    assert_eq!(
        part_size(64 << 10, 1 << 30),
        MIN_PART,
        "at least S3's smallest part"
    );
    for size in [78u64 << 30, 100 << 30, 5 << 40] {
        let part = part_size(8 << 20, size);
        assert!(
            size.div_ceil(part) <= MAX_PARTS,
            "{size} bytes in parts of {part}"
        );
    }
}

/// A plain HTTP server on loopback that answers every request, whatever it asks, with
/// `answer` (its head read and dropped, the connection closed after).
fn answers_every_request_with(answer: Vec<u8>) -> std::net::SocketAddr {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            while head.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let _ = conn.write_all(&answer);
        }
    });
    addr
}

/// A plain HTTP server on loopback that ignores `Range`: every request gets `200 OK` and the
/// whole 10-byte object (as a static file server without range support would).
fn serves_whole_objects_only() -> std::net::SocketAddr {
    answers_every_request_with(
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nETag: \"v1\"\r\n\
          Connection: close\r\n\r\n0123456789"
            .to_vec(),
    )
}

/// A WebDAV server on loopback that answers every request with a `207` listing of `files`
/// files under `/ds` (one PROPFIND of the whole tree, as nginx and Apache answer it).
fn webdav_listing(files: usize) -> std::net::SocketAddr {
    let mut body = String::from(r#"<?xml version="1.0"?><D:multistatus xmlns:D="DAV:">"#);
    for i in 0..files {
        body.push_str(&format!(
            "<D:response><D:href>/ds/shard-{i:08}.bin</D:href><D:propstat><D:prop>\
             <D:getlastmodified>Mon, 01 Jan 2024 00:00:00 GMT</D:getlastmodified>\
             <D:getcontentlength>10</D:getcontentlength><D:resourcetype/>\
             <D:getetag>\"e{i}\"</D:getetag></D:prop><D:status>HTTP/1.1 200 OK</D:status>\
             </D:propstat></D:response>"
        ));
    }
    body.push_str("</D:multistatus>");
    answers_every_request_with(
        format!(
            "HTTP/1.1 207 Multi-Status\r\nContent-Type: application/xml\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

/// A WebDAV listing is one answer of the whole tree: it was capped as if it were an error
/// reply, so a dataset of more files than fit (64 MiB: 65k-170k files) failed to list, as
/// `Unavailable`, retried. Now it has a cap of its own, and past it the listing is too long.
#[tokio::test(flavor = "current_thread")]
async fn a_webdav_listing_is_capped_as_a_listing_not_as_an_error_reply() {
    let files = (2 * crate::capped::MAX_COLLECTED / 280) as usize;
    let url = StoreUrl::parse(&format!("http://{}/ds", webdav_listing(files))).unwrap();
    let s = Store::open(&url, StoreOptions::default()).unwrap();
    let listed = s.list().await.unwrap();
    assert_eq!(listed.len(), files);
    assert_eq!(listed[7].key, "shard-00000007.bin");
    let files = (crate::capped::MAX_LISTING / 280) as usize + 1000;
    let url = StoreUrl::parse(&format!("http://{}/ds", webdav_listing(files))).unwrap();
    let s = Store::open(&url, StoreOptions::default()).unwrap();
    let e = s.list().await.unwrap_err();
    assert!(matches!(e, StoreError::ListTooLong { .. }), "{e}");
    assert!(e.to_string().contains("WebDAV PROPFIND"), "{e}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_server_that_ignores_range_is_refused_not_retried_as_unavailable() {
    let addr = serves_whole_objects_only();
    let url = StoreUrl::parse(&format!("http://{addr}/ds")).unwrap();
    let s = Store::open(&url, StoreOptions::default()).unwrap();
    // Before: `Unavailable` (transient), so every read of the dataset was retried.
    let e = s.read("a.bin", 0..4, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
    assert!(e.to_string().contains("does not serve byte ranges"), "{e}");
    let e = s.read_suffix("a.bin", 4, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
}

/// A listing page that does not end (a proxy answering `?list-type=2` with a 200 and an
/// endless body) was buffered until the attempt timed out: now it is cut at the page cap,
/// and the error names the URL (redacted) and the bound.
#[tokio::test(flavor = "current_thread")]
async fn an_s3_listing_page_past_its_cap_is_refused_naming_the_url_and_the_bound() {
    crate::backend::install_tls();
    let cap = crate::capped::MAX_LIST_PAGE;
    let page = cap as usize + (1 << 20);
    let mut answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: {page}\r\n\
         Connection: close\r\n\r\n"
    )
    .into_bytes();
    answer.resize(answer.len() + page, b' ');
    let addr = answers_every_request_with(answer);
    let os = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(format!("http://{addr}"))
        .with_allow_http(true)
        .with_bucket_name("unit-page")
        .with_region("us-east-1")
        .with_access_key_id("AKIAEXAMPLE")
        .with_secret_access_key("secret")
        .with_http_connector(crate::tap::TapConnector::default())
        .build()
        .unwrap();
    let url = StoreUrl::parse("s3://unit-page/ds").unwrap();
    let s = Store::with_object_store(&url, StoreOptions::default(), Arc::new(os), memory());
    let e = s.list().await.unwrap_err();
    // A server or proxy that does not end its page: unavailable (asked again), not a prefix
    // to narrow.
    assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("listing page")
            && msg.contains(&format!("http://{addr}/unit-page?..."))
            && msg.contains(&format!("ran past {cap} bytes")),
        "{msg}"
    );
}

/// object_store's Azure client refuses a suffix range before sending it: `read_suffix` was
/// `Rejected` there ("not supported by this store"). Now it is a HEAD and a ranged GET.
#[tokio::test(flavor = "current_thread")]
async fn a_suffix_read_on_azure_is_a_head_and_a_pinned_ranged_get() {
    let os = Arc::new(Quirky {
        refuses_suffix: true,
        ..Default::default()
    });
    os.put(&Path::from("pre/a.bin"), data(100).into())
        .await
        .unwrap();
    let url = StoreUrl::parse("az://unit-azure-suffix/pre").unwrap();
    let az = Store::with_object_store(&url, StoreOptions::default(), os.clone(), memory());
    let tail = az.read_suffix("a.bin", 8, None).await.unwrap();
    assert_eq!(tail, data(100).slice(92..));
    assert_eq!(az.read_suffix("a.bin", 500, None).await.unwrap(), data(100));
    assert!(az.read_suffix("a.bin", 0, None).await.unwrap().is_empty());
    // Elsewhere the suffix GET is still sent (and this server refuses it, as Azure's would).
    let url = StoreUrl::parse("s3://unit-azure-suffix-s3/pre").unwrap();
    let s3 = Store::with_object_store(&url, StoreOptions::default(), os.clone(), memory());
    let e = s3.read_suffix("a.bin", 8, None).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
    // Pinned to the ETag given: an object replaced since is a change, not another tail.
    let pinned = az.head("a.bin").await.unwrap().etag;
    os.put(&Path::from("pre/a.bin"), Bytes::from(vec![9u8; 100]).into())
        .await
        .unwrap();
    let e = az
        .read_suffix("a.bin", 8, pinned.as_deref())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Changed, "{e}");
}

/// One Azure container reached through three spellings of its URL. Before, the window was
/// named by the URL's text (`az://data`, `az://data@myacct.blob...`, `az://data@myacct.dfs...`):
/// three windows, each up to `max_inflight` GETs, against one container.
#[test]
fn one_azure_container_has_one_window_however_its_url_is_written() {
    let client = |account: Option<&str>| backend::Client {
        os: Arc::new(InMemory::new()),
        lister: None,
        writer: None,
        described: memory(),
        account: account.map(str::to_owned),
    };
    let open = |url: &str, account| {
        let url = StoreUrl::parse(url).unwrap();
        Store::assemble(&url, StoreOptions::default(), client(account))
    };
    // The account from AZURE_STORAGE_ACCOUNT_NAME, as the client resolved it.
    let env = open("az://unit-one-window/x", Some("unitacct"));
    let blob = open(
        "az://unit-one-window@unitacct.blob.core.windows.net/y",
        Some("unitacct"),
    );
    let dfs = open(
        "az://unit-one-window@unitacct.dfs.core.windows.net/z",
        Some("unitacct"),
    );
    assert!(Arc::ptr_eq(&env.inner.window, &blob.inner.window));
    assert!(Arc::ptr_eq(&env.inner.window, &dfs.inner.window));
    // Without a resolved account (a client given to `with_object_store`): the URL's account,
    // not its host.
    let url = StoreUrl::parse("az://c@unitacct.dfs.core.windows.net/p").unwrap();
    assert_eq!(window_key(&url, None), "az://c@unitacct");
    // Another account's container of that name is another bucket.
    let other = open("az://unit-one-window/x", Some("otheracct"));
    assert!(!Arc::ptr_eq(&env.inner.window, &other.inner.window));
    assert_eq!(
        window_key(&StoreUrl::parse("s3://bkt/p").unwrap(), None),
        "s3://bkt"
    );
}

/// An http(s) store lists with its own client (a longer whole-request limit) and reads with
/// the other; before, one client with the listing's limit served both.
#[tokio::test(flavor = "current_thread")]
async fn the_listing_uses_the_listing_client_and_reads_the_other() {
    let os = Arc::new(InMemory::new());
    let lister = Arc::new(InMemory::new());
    os.put(&Path::from("ds/a.bin"), data(10).into())
        .await
        .unwrap();
    lister
        .put(&Path::from("ds/listed.bin"), data(4).into())
        .await
        .unwrap();
    let client = backend::Client {
        os: os.clone(),
        lister: Some(lister.clone() as Arc<dyn ObjectStore>),
        writer: None,
        described: memory(),
        account: None,
    };
    let url = StoreUrl::parse("https://unit-lister.example/ds").unwrap();
    let s = Store::assemble(&url, StoreOptions::default(), client);
    let listed = s.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, "listed.bin");
    assert_eq!(s.read("a.bin", 0..10, None).await.unwrap(), data(10));
    assert_eq!(s.head("a.bin").await.unwrap().size, 10);
}

/// Uploads go through the upload client (its read limit is the whole request's), reads and
/// the HEAD after an upload through the other. Before, one client with the 10 s read limit,
/// which also runs while a body is sent, served both.
#[tokio::test(flavor = "current_thread")]
async fn uploads_use_the_upload_client_and_reads_the_other() {
    let os = Arc::new(InMemory::new());
    let writer = Arc::new(InMemory::new());
    let client = backend::Client {
        os: os.clone(),
        lister: None,
        writer: Some(writer.clone() as Arc<dyn ObjectStore>),
        described: memory(),
        account: None,
    };
    let url = StoreUrl::parse("s3://unit-writer/pre").unwrap();
    let s = Store::assemble(&url, StoreOptions::default(), client);
    s.put("m.json", Bytes::from_static(b"{}")).await.unwrap();
    assert!(writer.head(&Path::from("pre/m.json")).await.is_ok());
    assert!(os.head(&Path::from("pre/m.json")).await.is_err());
    let dir = std::env::temp_dir().join(format!("shardwire-store-writer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("big.arrow");
    let big = data((MIN_PART as usize) * 2 + 1);
    std::fs::write(&file, &big).unwrap();
    // The multipart upload reaches the upload client; the HEAD that follows asks the read
    // client, which here is another store and has no such object.
    let e = s.put_file("big.arrow", &file).await.unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(e.kind(), StoreErrorKind::NotFound, "{e}");
    let up = writer.head(&Path::from("pre/big.arrow")).await.unwrap();
    assert_eq!(up.size, big.len() as u64);
}
