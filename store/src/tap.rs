//! The HTTP tap: an `HttpConnector` around object_store's reqwest connector that sees every
//! attempt (object_store retries inside one call, and its errors hide the status). For each
//! attempt it counts the request by op and status, times the response head, counts retries
//! and throttles, tells the bucket's window about a 503/429 at once (so the window reacts
//! before object_store's retry budget is spent) and keeps the last status and `Retry-After`
//! for [`crate::error::classify`]. The request it belongs to is found through a task-local
//! [`Call`], set by [`Call::run`] around each store operation. A retry is the same request
//! again (a listing's next page is not one), and requests to credential services (instance
//! metadata, STS, OAuth token endpoints), which object_store sends through the same client,
//! are not attributed to the store's call.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::{ClientOptions, MultipartUpload, PutPayload, PutResult, UploadPart};

use crate::capped::{Cap, Capped};
use crate::error::Attempt;
use crate::metrics as m;
use crate::window::Window;

tokio::task_local! {
    static CALL: Arc<Call>;
}

/// One store operation, as the tap sees it across its attempts.
#[derive(Debug)]
pub(crate) struct Call {
    op: &'static str,
    window: Arc<Window>,
    epoch: u64,
    /// The last request sent for it (method and URI): the same again is a retry.
    sent: Mutex<Option<String>>,
    last: Mutex<Option<Attempt>>,
}

impl Call {
    pub fn new(op: &'static str, window: Arc<Window>, epoch: u64) -> Arc<Self> {
        Arc::new(Self {
            op,
            window,
            epoch,
            sent: Mutex::new(None),
            last: Mutex::new(None),
        })
    }

    /// Notes a request about to be sent; true when it repeats the one sent before (a
    /// retry), not when it is the call's next step (a listing's next page, an upload's next
    /// part).
    fn repeats(&self, request: String) -> bool {
        let mut sent = self.sent.lock().unwrap_or_else(|p| p.into_inner());
        sent.replace(request.clone()) == Some(request)
    }

    /// Runs `f` with this call current, so the tap attributes its attempts to it.
    pub async fn run<F: Future>(self: &Arc<Self>, f: F) -> F::Output {
        CALL.scope(Arc::clone(self), f).await
    }

    /// What the last attempt got.
    pub fn last(&self) -> Option<Attempt> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn record(&self, status: Option<u16>, retry_after: Option<Duration>) {
        if matches!(status, Some(429 | 503)) {
            metrics::counter!(m::THROTTLED, "op" => self.op).increment(1);
            self.window.throttle(self.epoch);
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Attempt {
            status,
            retry_after,
            credential: false,
        });
    }

    /// Notes a credential service's answer to a request made for this call: it neither
    /// throttles the bucket's window nor counts as the store's, but a refusal names the
    /// call's failure ([`Attempt::credential`]).
    fn record_credential(&self, status: Option<u16>) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Attempt {
            status,
            retry_after: None,
            credential: true,
        });
    }
}

/// A multipart upload whose requests belong to `call`: its parts too, which object_store's
/// `WriteMultipart` runs as tasks of their own, where the task-local set by [`Call::run`] is
/// not (without this, a part's throttle never reached the bucket's window and a failed part
/// was reported without its status).
#[derive(Debug)]
pub(crate) struct Tracked {
    pub inner: Box<dyn MultipartUpload>,
    pub call: Arc<Call>,
}

#[async_trait]
impl MultipartUpload for Tracked {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        Box::pin(CALL.scope(Arc::clone(&self.call), self.inner.put_part(data)))
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        CALL.scope(Arc::clone(&self.call), self.inner.complete())
            .await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        CALL.scope(Arc::clone(&self.call), self.inner.abort()).await
    }
}

/// Makes reqwest clients wrapped in [`Tap`].
#[derive(Debug, Default)]
pub(crate) struct TapConnector {
    /// Addresses (host, port) of the credential services this store was configured with (an
    /// Azure `IDENTITY_ENDPOINT`, `AWS_CONTAINER_CREDENTIALS_FULL_URI`,
    /// `AWS_ENDPOINT_URL_STS`, `AWS_METADATA_ENDPOINT`, `GCE_METADATA_HOST`): credential
    /// services as much as the well-known ones.
    credential_at: Arc<[(String, u16)]>,
}

impl TapConnector {
    /// A connector that also counts the addresses of `urls` (the configured credential
    /// endpoints; `None` where one is not set) as credential services, except one that is
    /// also the store's own (`store`: its configured endpoints; MinIO and LocalStack serve
    /// STS at the S3 endpoint, whose answers stay the store's).
    pub(crate) fn with_credential_urls(
        urls: impl IntoIterator<Item = Option<String>>,
        store: &[Option<String>],
    ) -> Self {
        let own: Vec<(String, u16)> = store.iter().flatten().filter_map(|u| address(u)).collect();
        let credential_at = urls
            .into_iter()
            .flatten()
            .filter_map(|u| address(&u))
            .filter(|a| !own.contains(a))
            .collect();
        TapConnector { credential_at }
    }

    /// Whether `url`'s address is one of the configured credential services (tests of the
    /// builders that configure them).
    #[cfg(test)]
    pub(crate) fn counts_as_credential(&self, url: &str) -> bool {
        address(url).is_some_and(|a| self.credential_at.contains(&a))
    }
}

/// The (lowercase host, port) a URL names; the scheme's port when it names none.
fn address(url: &str) -> Option<(String, u16)> {
    let uri = url.parse::<http::Uri>().ok()?;
    address_of(&uri)
}

/// [`address`] of a request's URI.
fn address_of(uri: &http::Uri) -> Option<(String, u16)> {
    let host = uri.host()?.to_ascii_lowercase();
    let port = uri
        .port_u16()
        .unwrap_or(if uri.scheme_str() == Some("http") {
            80
        } else {
            443
        });
    Some((host, port))
}

impl HttpConnector for TapConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Tap {
            inner,
            credential_at: Arc::clone(&self.credential_at),
        }))
    }
}

/// An `HttpService` that observes each attempt on its way through.
#[derive(Debug)]
struct Tap {
    inner: HttpClient,
    credential_at: Arc<[(String, u16)]>,
}

impl Tap {
    /// Whether a request to `uri` goes to a credential service rather than the store: a
    /// well-known one, a configured one, or an STS call (`Action=AssumeRole...`) wherever it
    /// goes (MinIO and LocalStack serve STS at their S3 endpoint).
    fn credential(&self, uri: &http::Uri) -> bool {
        credential_host(uri.host().unwrap_or(""))
            || address_of(uri).is_some_and(|a| self.credential_at.contains(&a))
            || uri
                .query()
                .is_some_and(|q| q.split('&').any(|kv| kv.starts_with("Action=AssumeRole")))
    }
}

#[async_trait]
impl HttpService for Tap {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        // A credential service's answers are not the bucket's: they neither throttle its
        // window nor count as the store's; only a refusal names the call's failure.
        let current = CALL.try_with(Arc::clone).ok();
        if self.credential(req.uri()) {
            let uri = req.uri().clone();
            let res = self
                .inner
                .execute(req)
                .await
                .map(|r| r.map(|b| Capped::wrap(b, Some(Cap::Collected), &uri)));
            let status = res.as_ref().ok().map(|r| r.status().as_u16());
            let label = status.map_or_else(|| "error".to_owned(), |s| s.to_string());
            metrics::counter!(m::REQUESTS, "op" => "credentials", "status" => label).increment(1);
            if let Some(c) = &current {
                c.record_credential(status);
            }
            return res;
        }
        let call = current;
        let op = call.as_ref().map_or("other", |c| c.op);
        let again = call
            .as_ref()
            .is_some_and(|c| c.repeats(format!("{} {}", req.method(), req.uri())));
        let t0 = Instant::now();
        // Every body is wrapped: its size hint capped (object_store sizes some buffers by
        // it), and a body object_store collects whole bounded ([`cap_of`]).
        let (method, uri) = (req.method().clone(), req.uri().clone());
        let res = self.inner.execute(req).await.map(|r| {
            let cap = cap_of(&method, &uri, r.status().is_success());
            r.map(|b| Capped::wrap(b, cap, &uri))
        });
        if again {
            metrics::counter!(m::RETRIES, "op" => op).increment(1);
        }
        match &res {
            Ok(r) => {
                let status = r.status().as_u16();
                metrics::counter!(m::REQUESTS, "op" => op, "status" => status.to_string())
                    .increment(1);
                metrics::histogram!(m::FIRST_BYTE, "op" => op).record(t0.elapsed().as_secs_f64());
                let after = r
                    .headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| retry_after(v, chrono::Utc::now()));
                if let Some(c) = &call {
                    c.record(Some(status), after);
                }
            }
            Err(_) => {
                metrics::counter!(m::REQUESTS, "op" => op, "status" => "error").increment(1);
                if let Some(c) = &call {
                    c.record(None, None);
                }
            }
        }
        res
    }
}

/// The cap on the body of the answer to `method uri` (`ok`: a 2xx), which object_store
/// collects whole unless it is a ranged read: a listing page (S3 and GCS `list-type=2`, Azure
/// `comp=list`) or a WebDAV listing (a PROPFIND) by a listing's cap; an error reply or any
/// other answer but a GET's by a small one. A successful ranged GET is streamed to its sink
/// and bounded by its range check: `None`.
fn cap_of(method: &http::Method, uri: &http::Uri, ok: bool) -> Option<Cap> {
    let listing = || {
        uri.query().is_some_and(|q| {
            q.split('&')
                .any(|kv| kv == "list-type=2" || kv == "comp=list")
        })
    };
    match method.as_str() {
        "GET" if ok && listing() => Some(Cap::ListPage),
        "GET" if ok => None,
        "PROPFIND" if ok => Some(Cap::WebDav),
        _ => Some(Cap::Collected),
    }
}

/// Whether `host` is a credential service (instance metadata, STS, OAuth token endpoints)
/// rather than the store: object_store fetches credentials through the same HTTP client.
fn credential_host(host: &str) -> bool {
    const EXACT: [&str; 10] = [
        "169.254.169.254",
        "[fd00:ec2::254]",
        "169.254.170.2",
        // EKS Pod Identity's agent.
        "169.254.170.23",
        "[fd00:ec2::23]",
        "metadata.google.internal",
        "oauth2.googleapis.com",
        // ADC user credentials (`gcloud auth application-default login`) refresh here.
        "accounts.google.com",
        "login.microsoftonline.com",
        "sts.amazonaws.com",
    ];
    EXACT.contains(&host) || (host.starts_with("sts.") && host.ends_with(".amazonaws.com"))
}

/// Longest `Retry-After` taken at its word.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Parses a `Retry-After` value: seconds (`2`, `0.5`) or an HTTP date, relative to `now`.
pub(crate) fn retry_after(v: &str, now: chrono::DateTime<chrono::Utc>) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::from_secs_f64(secs.min(MAX_RETRY_AFTER.as_secs_f64())));
    }
    let when = chrono::DateTime::parse_from_rfc2822(v).ok()?;
    let d = when.signed_duration_since(now).to_std().unwrap_or_default();
    Some(d.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upload whose parts note the call they run under.
    #[derive(Debug, Default)]
    struct Notes(Arc<Mutex<Vec<Option<&'static str>>>>);

    #[async_trait]
    impl MultipartUpload for Notes {
        fn put_part(&mut self, _data: PutPayload) -> UploadPart {
            let notes = Arc::clone(&self.0);
            Box::pin(async move {
                notes.lock().unwrap().push(CALL.try_with(|c| c.op).ok());
                Ok(())
            })
        }

        async fn complete(&mut self) -> object_store::Result<PutResult> {
            self.0.lock().unwrap().push(CALL.try_with(|c| c.op).ok());
            Ok(PutResult {
                e_tag: None,
                version: None,
                extensions: Default::default(),
            })
        }

        async fn abort(&mut self) -> object_store::Result<()> {
            Ok(())
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_uploads_parts_run_as_tasks_of_their_own_belong_to_its_call() {
        let notes = Notes::default();
        let seen = Arc::clone(&notes.0);
        let call = Call::new("put", Arc::new(Window::new("test://parts", 4)), 0);
        let mut up = Tracked {
            inner: Box::new(notes),
            call: Arc::clone(&call),
        };
        // As `WriteMultipart` does: each part spawned.
        let part = tokio::spawn(up.put_part(PutPayload::from_static(b"part")));
        part.await.unwrap().unwrap();
        up.complete().await.unwrap();
        assert_eq!(*seen.lock().unwrap(), [Some("put"), Some("put")]);
    }

    fn call() -> Arc<Call> {
        Call::new("list", Arc::new(Window::new("test://tap", 4)), 0)
    }

    #[test]
    fn only_the_same_request_again_is_a_retry() {
        let c = call();
        assert!(!c.repeats("GET http://s3/b?list-type=2".into()));
        assert!(
            !c.repeats("GET http://s3/b?list-type=2&continuation-token=x".into()),
            "the next page"
        );
        assert!(
            c.repeats("GET http://s3/b?list-type=2&continuation-token=x".into()),
            "that page again"
        );
    }

    #[test]
    fn configured_credential_endpoints_are_credential_services() {
        crate::backend::install_tls(); // a client is made below, whichever test runs first
        // Before: an Azure `IDENTITY_ENDPOINT` on localhost answering 404 was counted as the
        // store's own 404 (a `NotFound` naming the dataset, not a credentials failure).
        let c = TapConnector::with_credential_urls(
            [
                Some("http://LOCALHOST:42356/msi/token".to_owned()),
                None,
                Some("https://vpce-1.sts.us-east-1.vpce.example".to_owned()),
                Some("not a url".to_owned()),
                // MinIO's STS is its S3 endpoint: the store's answers stay the store's.
                Some("http://minio:9000".to_owned()),
            ],
            &[Some("http://minio:9000/".to_owned()), None],
        );
        let tap = Tap {
            inner: ReqwestConnector::default()
                .connect(&ClientOptions::default())
                .unwrap(),
            credential_at: Arc::clone(&c.credential_at),
        };
        let at = |u: &str| tap.credential(&u.parse().unwrap());
        assert!(at("http://localhost:42356/msi/token?x=1"));
        assert!(at("https://vpce-1.sts.us-east-1.vpce.example/"));
        assert!(
            !at("http://localhost:9000/bucket/key"),
            "another port of the host"
        );
        assert!(
            !at("http://minio:9000/bucket/key"),
            "the store's own endpoint"
        );
        assert!(
            at("http://minio:9000/?Action=AssumeRoleWithWebIdentity&DurationSeconds=3600"),
            "an STS call at the store's endpoint"
        );
        assert!(
            at("http://169.254.169.254/latest"),
            "the well-known ones still"
        );
        assert!(!at("http://127.0.0.1/") && !at("https://bkt.s3.example/"));
    }

    #[test]
    fn listing_pages_are_capped_ranged_reads_are_not() {
        let get = http::Method::GET;
        let cap = |m: &http::Method, u: &str, ok| cap_of(m, &u.parse().unwrap(), ok);
        // Before: every successful GET was uncapped, a listing page too.
        for u in [
            "https://s3.us-east-1.amazonaws.com/bkt?list-type=2&prefix=ds%2F",
            "https://storage.googleapis.com/bkt?list-type=2&continuation-token=x",
            "https://acct.blob.core.windows.net/c?restype=container&comp=list&sig=s",
        ] {
            assert_eq!(cap(&get, u, true), Some(Cap::ListPage), "{u}");
        }
        assert_eq!(cap(&get, "https://s3.example/bkt/ds/a.bin", true), None);
        assert_eq!(
            cap(&get, "https://s3.example/bkt/ds/list-type=2", true),
            None,
            "a key, not a query"
        );
        assert_eq!(
            cap(&get, "https://h/c/b?comp=blocklist", true),
            None,
            "another Azure query"
        );
        assert_eq!(
            cap(&get, "https://h/b?list-type=2", false),
            Some(Cap::Collected)
        );
        let propfind = http::Method::from_bytes(b"PROPFIND").unwrap();
        assert_eq!(cap(&propfind, "http://h/ds/", true), Some(Cap::WebDav));
        assert_eq!(
            cap(&http::Method::PUT, "https://h/b/k", true),
            Some(Cap::Collected)
        );
    }

    #[test]
    fn credential_services_are_not_the_store() {
        for h in [
            "169.254.169.254",
            "169.254.170.23",
            "sts.us-east-1.amazonaws.com",
            "metadata.google.internal",
            "accounts.google.com",
        ] {
            assert!(credential_host(h), "{h}");
        }
        for h in [
            "s3.us-east-1.amazonaws.com",
            "bkt.s3.amazonaws.com",
            "127.0.0.1",
            "storage.googleapis.com",
        ] {
            assert!(!credential_host(h), "{h}");
        }
    }

    #[test]
    fn retry_after_in_seconds_or_as_a_date() {
        let now = chrono::DateTime::parse_from_rfc2822("Sun, 06 Nov 1994 08:49:37 GMT")
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert_eq!(retry_after("2", now), Some(Duration::from_secs(2)));
        assert_eq!(retry_after(" 0.5 ", now), Some(Duration::from_millis(500)));
        assert_eq!(
            retry_after("Sun, 06 Nov 1994 08:49:40 GMT", now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            retry_after("Sun, 06 Nov 1994 08:49:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("1e9", now), Some(MAX_RETRY_AFTER));
        assert_eq!(retry_after("-1", now), None);
        assert_eq!(retry_after("soon", now), None);
    }
}
