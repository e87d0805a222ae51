//! [`StoreError`]: why an object-storage request failed, by cause, each naming the bucket and
//! key (and the byte range where one applies); [`StoreErrorKind`] is its `Copy` tag, which
//! callers map to wire error codes without looking at text.
//!
//! object_store reports most HTTP failures as `Error::Generic` with a private source, so the
//! cause comes from the last attempt the HTTP tap saw ([`Attempt`]: status, `Retry-After`,
//! transport failure) together with the error's variant ([`classify`]).

use std::ops::Range;
use std::time::Duration;

use crate::redact::redact_urls;

/// What went wrong, as a tag (see [`StoreError::kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StoreErrorKind {
    /// The dataset URL is not valid.
    Url,
    /// The store could not be set up (configuration, credentials missing, read-only).
    Config,
    /// 503/429 SlowDown after the retry budget.
    Throttled,
    /// 5xx, timeouts, connection errors after retries, or an unexpected answer.
    Unavailable,
    /// Another 3xx/4xx answer, an invalid key or an operation the store does not support:
    /// not transient, asking again gets the same answer.
    Rejected,
    /// 401/403 from a store given credentials (S3, GCS, Azure): credentials refused.
    Credentials,
    /// 401/403 from an http(s) server, which is sent no credentials: it does not serve the
    /// dataset to this host. Not transient, and no credentials to check.
    Forbidden,
    /// 404: no such object (or bucket): a stale manifest or a wrong prefix.
    NotFound,
    /// 412 on `If-Match`: the object changed since it was indexed.
    Changed,
    /// The body was shorter or longer than the range asked for.
    Short,
    /// The caller's sink refused the bytes (a local write failed).
    Sink,
}

/// How a store answered a read pinned to an ETag that no longer matched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EtagAnswer {
    /// It refused the `If-Match` (412).
    #[error("the store refused If-Match")]
    Refused,
    /// It sent the bytes of an object with this ETag.
    #[error("the store's answer named ETag {0}")]
    Named(String),
    /// It sent bytes and named no ETag.
    #[error("the store's answer named no ETag")]
    Unnamed,
}

/// Why an object-storage operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The dataset URL is not valid.
    #[error("{url}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong and what to write instead.
        reason: String,
    },
    /// The store could not be set up or does not allow the operation.
    #[error("{url}: {reason}")]
    Config {
        /// The dataset URL.
        url: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The store kept answering 503/429 (SlowDown) after the retry budget.
    #[error(
        "bucket {bucket}, key {key}{}: throttled by the store (503/429 SlowDown) after retries{}; \
         lower object_store_max_inflight or try again later",
        at(range),
        after(retry_after)
    )]
    Throttled {
        /// Bucket.
        bucket: String,
        /// Full key (or the prefix, for a listing).
        key: String,
        /// Byte range asked for.
        range: Option<Range<u64>>,
        /// The store's `Retry-After`, when it sent one.
        retry_after: Option<Duration>,
    },
    /// 5xx, timeouts or connection errors after retries.
    #[error(
        "bucket {bucket}, key {key}{}: storage unavailable: {reason}",
        at(range)
    )]
    Unavailable {
        /// Bucket.
        bucket: String,
        /// Full key (or the prefix, for a listing).
        key: String,
        /// Byte range asked for.
        range: Option<Range<u64>>,
        /// What happened (status and the store's message, or the transport error).
        reason: String,
    },
    /// The store refused the request for good (another 3xx/4xx: a wrong region or
    /// endpoint, a range it cannot serve), the operation is not supported, or a key under
    /// the prefix is not a valid object path.
    #[error(
        "bucket {bucket}, key {key}: refused by the store{reason}; this is not transient \
         (check {check})"
    )]
    Rejected {
        /// Bucket.
        bucket: String,
        /// Full key (or the prefix, for a listing).
        key: String,
        /// The HTTP status, when the store answered, and its answer: ` (HTTP 400): ...`.
        reason: String,
        /// What to check, for this kind of store (`Scheme::refusal_check`).
        check: &'static str,
    },
    /// 401/403.
    #[error(
        "bucket {bucket}, key {key}: credentials refused: {reason} (the startup log names the \
         credential source; check the AWS_*/GOOGLE_*/AZURE_* environment)"
    )]
    Credentials {
        /// Bucket.
        bucket: String,
        /// Full key (or the prefix, for a listing).
        key: String,
        /// The store's answer.
        reason: String,
    },
    /// 401/403 from an http(s) server (an http(s) dataset is read without a login).
    #[error(
        "bucket {bucket}, key {key}: refused by the server{}: {reason}; this is not transient: \
         shardwire reads an http(s) dataset without a login, so the server must let this host \
         read it without one{}",
        http(*status),
        if *listing { LISTING_HINT } else { "" }
    )]
    Forbidden {
        /// Bucket (the server).
        bucket: String,
        /// Full key (or the prefix, for the listing).
        key: String,
        /// 401 or 403, when the answer named it.
        status: Option<u16>,
        /// The server's answer.
        reason: String,
        /// Whether the refused request was the listing (a WebDAV `PROPFIND`).
        listing: bool,
    },
    /// 405 or 501 to an http(s) dataset's listing: a server without WebDAV.
    #[error(
        "{url}: the server refused the listing (HTTP {status}): {reason}; this is not \
         transient: an http(s) dataset is listed with one WebDAV PROPFIND of the whole tree \
         (`Depth: infinity`), which this server does not answer; serve the dataset from a \
         WebDAV server (Apache mod_dav with `DavDepthInfinity On`, `rclone serve webdav`)"
    )]
    NoWebDav {
        /// The dataset URL listed.
        url: String,
        /// 405 Method Not Allowed or 501 Not Implemented.
        status: u16,
        /// The server's answer.
        reason: String,
    },
    /// 404.
    #[error(
        "bucket {bucket}, key {key}: not found (no such bucket or object): a wrong prefix, or a \
         stale manifest (re-run `shardwire index`)"
    )]
    NotFound {
        /// Bucket.
        bucket: String,
        /// Full key.
        key: String,
    },
    /// A listing that ran past its bound on objects (10 million) or time (30 minutes).
    #[error(
        "bucket {bucket}, prefix {prefix:?}: the listing stopped after {objects} objects: {why}; \
         point the dataset at a narrower prefix (one dataset per prefix)"
    )]
    ListTooLong {
        /// Bucket.
        bucket: String,
        /// The prefix listed.
        prefix: String,
        /// Objects listed before it stopped.
        objects: usize,
        /// Which bound it hit.
        why: String,
    },
    /// 412 on `If-Match`, or an answer naming another version of the object.
    #[error(
        "bucket {bucket}, key {key}: dataset changed: the object's ETag is no longer {etag} \
         ({sent}); re-run `shardwire index`{}",
        match **sent {
            EtagAnswer::Refused => "",
            _ => " (if the bytes are the same, something between the store and this host \
                   rewrites ETags, e.g. a compressing proxy)",
        }
    )]
    Changed {
        /// Bucket.
        bucket: String,
        /// Full key.
        key: String,
        /// The ETag the manifest recorded (sent as `If-Match`).
        etag: String,
        /// What the store answered instead (boxed: the error stays small).
        sent: Box<EtagAnswer>,
    },
    /// A read of a range that ends before it starts (a corrupt offset in a manifest or a
    /// file's header): nothing is asked of the store, and no empty bytes are passed on.
    #[error(
        "bucket {bucket}, key {key}: range {start}..{end} ends before it starts (a corrupt \
         offset or length in the manifest or the file's header)"
    )]
    BadRange {
        /// Bucket.
        bucket: String,
        /// Full key.
        key: String,
        /// The range's start.
        start: u64,
        /// Its end.
        end: u64,
    },
    /// The body did not have the length of the range asked for.
    #[error(
        "bucket {bucket}, key {key}{}: the store sent {got} bytes for a range of {} bytes",
        at(&Some(range.clone())), range.end - range.start
    )]
    Short {
        /// Bucket.
        bucket: String,
        /// Full key.
        key: String,
        /// Byte range asked for.
        range: Range<u64>,
        /// Bytes received (counting up to the first byte too many).
        got: u64,
    },
    /// The sink given to `read_to` failed.
    #[error("bucket {bucket}, key {key}{}: writing the fetched bytes failed: {source}", at(&Some(range.clone())))]
    Sink {
        /// Bucket.
        bucket: String,
        /// Full key.
        key: String,
        /// Byte range being read.
        range: Range<u64>,
        /// The sink's error.
        #[source]
        source: std::io::Error,
    },
}

/// What a refused http(s) listing adds: most often a WebDAV server that refuses `PROPFIND`
/// with `Depth: infinity` (Apache mod_dav answers 403 unless `DavDepthInfinity On`).
const LISTING_HINT: &str = "; the listing is one WebDAV PROPFIND of the whole tree \
                            (`Depth: infinity`), which the server must allow (Apache mod_dav: \
                            `DavDepthInfinity On`)";

fn at(range: &Option<Range<u64>>) -> String {
    range
        .as_ref()
        .map(|r| format!(", bytes {}..{}", r.start, r.end))
        .unwrap_or_default()
}

fn after(d: &Option<Duration>) -> String {
    d.map(|d| format!(" (Retry-After {:.1} s)", d.as_secs_f64()))
        .unwrap_or_default()
}

impl StoreError {
    /// The cause, as a tag.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            Self::Url { .. } => StoreErrorKind::Url,
            Self::Config { .. } | Self::ListTooLong { .. } => StoreErrorKind::Config,
            Self::Throttled { .. } => StoreErrorKind::Throttled,
            Self::Unavailable { .. } => StoreErrorKind::Unavailable,
            Self::Rejected { .. } | Self::NoWebDav { .. } => StoreErrorKind::Rejected,
            Self::Credentials { .. } => StoreErrorKind::Credentials,
            Self::Forbidden { .. } => StoreErrorKind::Forbidden,
            Self::NotFound { .. } => StoreErrorKind::NotFound,
            Self::Changed { .. } => StoreErrorKind::Changed,
            Self::BadRange { .. } => StoreErrorKind::Rejected,
            Self::Short { .. } => StoreErrorKind::Short,
            Self::Sink { .. } => StoreErrorKind::Sink,
        }
    }

    /// The store's `Retry-After` of a [`StoreError::Throttled`].
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Throttled { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// What the HTTP tap saw of one attempt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Attempt {
    /// The response status, when a response came.
    pub status: Option<u16>,
    /// The parsed `Retry-After`.
    pub retry_after: Option<Duration>,
    /// The response came from a credential service (instance metadata, STS, an OAuth token
    /// endpoint), which object_store asked before the store: its refusal is a credentials
    /// failure, though object_store reports it without a status.
    pub credential: bool,
}

/// [`classify`] for a ranged GET (every GET of the store asks for a range or a suffix): a
/// last answer of `200 OK` is the whole object, from a server that ignores `Range`
/// (object_store refuses it as not partial), and asking again cannot help.
pub(crate) fn classify_get(
    e: object_store::Error,
    last: Option<&Attempt>,
    at: At<'_>,
) -> StoreError {
    if last.is_some_and(|a| a.status == Some(200) && !a.credential) {
        return StoreError::Rejected {
            bucket: at.bucket.to_owned(),
            key: at.key.to_owned(),
            reason: " (HTTP 200 to a range request: the server does not serve byte ranges, and \
                     shardwire reads shards by range; serve the dataset from a server that \
                     honours `Range`)"
                .into(),
            check: at.check,
        };
    }
    classify(e, last, at)
}

/// Where a request went: for the error's fields.
#[derive(Clone, Debug)]
pub(crate) struct At<'a> {
    pub bucket: &'a str,
    pub key: &'a str,
    pub range: Option<Range<u64>>,
    pub etag: Option<&'a str>,
    /// The store takes no credentials (http(s)): a 401/403 from it is no credentials
    /// failure ([`uncredentialed`]).
    pub uncredentialed: bool,
    /// What a refusal tells the user to check, for this kind of store
    /// (`Scheme::refusal_check`).
    pub check: &'static str,
    /// The dataset URL, when the request is its listing (not a GET or HEAD of one object).
    pub listing: Option<&'a str>,
}

impl At<'_> {
    /// A [`StoreError::Short`] here: `got` bytes came for `range`.
    pub fn short(&self, range: Range<u64>, got: u64) -> StoreError {
        StoreError::Short {
            bucket: self.bucket.to_owned(),
            key: self.key.to_owned(),
            range,
            got,
        }
    }
}

/// The [`StoreError`] for object_store's `e`, given the last attempt the tap saw.
pub(crate) fn classify(e: object_store::Error, last: Option<&Attempt>, at: At<'_>) -> StoreError {
    let status = last.and_then(|a| a.status);
    // The last answer came from a credential service, not the store: whatever its status
    // would mean from the store (404 not found, 503 slow down), it is about credentials; a
    // refusal is for good, unless it says the service is busy ([`credential_transient`]).
    if last.is_some_and(|a| a.credential) {
        let (bucket, key) = (at.bucket.to_owned(), at.key.to_owned());
        return match status {
            Some(code @ 400..=499) if !credential_transient(code, &e) => StoreError::Credentials {
                bucket,
                key,
                reason: short(&e),
            },
            _ => StoreError::Unavailable {
                bucket,
                key,
                range: at.range,
                reason: format!("the credential service: {}", short(&e)),
            },
        };
    }
    let (plain, listing) = (at.uncredentialed, at.listing);
    if let (true, Some(url), Some(code @ (405 | 501))) = (plain, listing, status) {
        return StoreError::NoWebDav {
            url: url.to_owned(),
            status: code,
            reason: short(&e),
        };
    }
    let e = from_store(e, status, last.and_then(|a| a.retry_after), at);
    if plain {
        uncredentialed(e, status, listing.is_some())
    } else {
        e
    }
}

/// `e` from a store that takes no credentials (http(s): none in the URL, none from the
/// environment): a 401/403 is the server's refusal for good ([`StoreError::Forbidden`]), not
/// credentials to check in the `AWS_*`/`GOOGLE_*`/`AZURE_*` environment; of the `listing`,
/// most often a WebDAV server that refuses `PROPFIND` with `Depth: infinity`.
fn uncredentialed(e: StoreError, status: Option<u16>, listing: bool) -> StoreError {
    match e {
        StoreError::Credentials {
            bucket,
            key,
            reason,
        } => StoreError::Forbidden {
            bucket,
            key,
            status,
            reason,
            listing,
        },
        e => e,
    }
}

/// [`classify`] of an answer from the store itself (`status`: its last status, when one
/// came; `retry_after`: its `Retry-After`).
fn from_store(
    e: object_store::Error,
    status: Option<u16>,
    retry_after: Option<Duration>,
    at: At<'_>,
) -> StoreError {
    use object_store::Error as E;
    let (bucket, key) = (at.bucket.to_owned(), at.key.to_owned());
    match (&e, status) {
        (E::NotFound { .. }, _) | (E::Generic { .. }, Some(404)) => {
            StoreError::NotFound { bucket, key }
        }
        (E::Precondition { .. }, _) | (E::Generic { .. }, Some(412)) => StoreError::Changed {
            bucket,
            key,
            etag: at.etag.unwrap_or("").to_owned(),
            sent: Box::new(EtagAnswer::Refused),
        },
        (E::PermissionDenied { .. } | E::Unauthenticated { .. }, _)
        | (E::Generic { .. }, Some(401 | 403)) => StoreError::Credentials {
            bucket,
            key,
            reason: short(&e),
        },
        (_, Some(429 | 503)) => StoreError::Throttled {
            bucket,
            key,
            range: at.range,
            retry_after,
        },
        (E::NotSupported { .. } | E::NotImplemented { .. }, _) => StoreError::Rejected {
            bucket,
            key,
            reason: format!(
                "{}: not supported by this store: {}",
                http(status),
                short(&e)
            ),
            check: at.check,
        },
        (E::InvalidPath { .. }, _) => StoreError::Rejected {
            bucket,
            key,
            reason: format!(
                ": a key under it is not a valid object path (`//`, a `.` or `..` segment, or a \
                 control character): rename that object or point the dataset at a narrower \
                 prefix ({})",
                short(&e)
            ),
            check: at.check,
        },
        (E::Generic { .. }, Some(400)) if token_refused(&e) => StoreError::Credentials {
            bucket,
            key,
            reason: short(&e),
        },
        (E::Generic { .. }, Some(code @ 300..=499)) if !transient(code, &e) => {
            StoreError::Rejected {
                bucket,
                key,
                reason: format!("{}: {}", http(status), short(&e)),
                check: at.check,
            }
        }
        _ => StoreError::Unavailable {
            bucket,
            key,
            range: at.range,
            reason: short(&e),
        },
    }
}

/// ` (HTTP 400)`, or nothing without a status.
fn http(status: Option<u16>) -> String {
    status.map(|s| format!(" (HTTP {s})")).unwrap_or_default()
}

/// Whether a 3xx/4xx answer may pass if asked again: 408 Request Timeout, 409 Conflict,
/// 425 Too Early, and S3's `400 RequestTimeout` (the connection idled, a slow network).
fn transient(status: u16, e: &object_store::Error) -> bool {
    matches!(status, 408 | 409 | 425)
        || (status == 400 && s3_error_code(&e.to_string()).as_deref() == Some("RequestTimeout"))
}

/// Whether a credential service's 4xx may pass if asked again: 408 Request Timeout, 429 Too
/// Many Requests (instance metadata and the GCE metadata server throttle with it), and STS's
/// `400` with error code `Throttling` (rate exceeded) or `IDPCommunicationError` (STS could
/// not reach the identity provider). object_store retries these itself first; what is left
/// is an outage of the credential service, not refused credentials.
fn credential_transient(status: u16, e: &object_store::Error) -> bool {
    matches!(status, 408 | 429)
        || (status == 400
            && matches!(
                s3_error_code(&e.to_string()).as_deref(),
                Some("Throttling" | "IDPCommunicationError")
            ))
}

/// Whether a `400` is S3 refusing the request's session token (`ExpiredToken`,
/// `InvalidToken`, `TokenRefreshRequired`): a credentials failure, not a bad request.
fn token_refused(e: &object_store::Error) -> bool {
    matches!(
        s3_error_code(&e.to_string()).as_deref(),
        Some("ExpiredToken" | "InvalidToken" | "TokenRefreshRequired")
    )
}

/// The `<Code>` of an S3 XML error body in `s`.
fn s3_error_code(s: &str) -> Option<String> {
    let from = s.find("<Code>")? + "<Code>".len();
    let to = s[from..].find("</Code>")? + from;
    Some(s[from..to].to_owned())
}

/// The error's message, an S3 XML error body in it cut to its code and message (a
/// `SignatureDoesNotMatch` body also carries the access key id, the string to sign and the
/// canonical request, none of which belongs in logs), each URL in it redacted
/// ([`redact_urls`]), at most 600 characters.
pub(crate) fn short(e: &object_store::Error) -> String {
    let s = redact_urls(&s3_error_summary(&e.to_string()));
    match s.char_indices().nth(600) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// `s` with an S3 `<Error>...</Error>` body in it replaced by `S3 error CODE: MESSAGE`.
fn s3_error_summary(s: &str) -> String {
    let (Some(start), Some(end)) = (s.find("<Error>"), s.find("</Error>")) else {
        return s.to_owned();
    };
    if end < start {
        return s.to_owned();
    }
    let body = &s[start..end];
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let from = body.find(&open)? + open.len();
        let to = body[from..].find(&format!("</{name}>"))? + from;
        Some(body[from..to].to_owned())
    };
    let code = tag("Code").unwrap_or_else(|| "?".into());
    let message = tag("Message").unwrap_or_default();
    let rest = &s[end + "</Error>".len()..];
    let head = &s[..start];
    let head = head.rfind("<?xml").map_or(head, |i| &head[..i]);
    format!("{head}S3 error {code}: {message}{rest}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_s3_error_body_is_cut_to_its_code_and_message() {
        let body = "Server returned non-2xx status code: 403 Forbidden: <?xml version=\"1.0\"?>\
                    <Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we \
                    calculated does not match</Message><AWSAccessKeyId>AKIAEXAMPLEKEY</AWSAccessKeyId>\
                    <StringToSign>AWS4-HMAC-SHA256 secretish</StringToSign></Error> (retried)";
        let got = s3_error_summary(body);
        assert_eq!(
            got,
            "Server returned non-2xx status code: 403 Forbidden: S3 error SignatureDoesNotMatch: \
             The request signature we calculated does not match (retried)"
        );
        assert!(!got.contains("AKIA") && !got.contains("StringToSign"));
        assert_eq!(s3_error_summary("connection reset"), "connection reset");
    }

    fn at() -> At<'static> {
        At {
            bucket: "bkt",
            key: "p/a.bin",
            range: Some(0..8),
            etag: Some("\"e1\""),
            uncredentialed: false,
            check: "the dataset URL, AWS_REGION and the endpoint",
            listing: None,
        }
    }

    fn generic() -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: "Server returned non-2xx status code".into(),
        }
    }

    fn with(status: u16, retry_after: Option<Duration>) -> Attempt {
        Attempt {
            status: Some(status),
            retry_after,
            credential: false,
        }
    }

    #[test]
    fn a_credential_service_that_refuses_is_a_credentials_failure_not_an_outage() {
        let from_sts = |status| Attempt {
            status,
            retry_after: None,
            credential: true,
        };
        // 404: an instance without a role (IMDS); a store's 404 would be "not found".
        for status in [400, 401, 403, 404] {
            let e = classify(generic(), Some(&from_sts(Some(status))), at());
            assert_eq!(e.kind(), StoreErrorKind::Credentials, "{status}: {e}");
        }
        // Not reached, failing itself or busy: may pass; the node asks again (a 503 or 429
        // from it does not throttle the bucket). Before, a 429 (instance metadata throttling)
        // and 408 were credentials refused: the source exited at start, a node's stream ended.
        for status in [None, Some(500), Some(503), Some(429), Some(408)] {
            let e = classify(generic(), Some(&from_sts(status)), at());
            assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{status:?}: {e}");
            assert!(e.to_string().contains("the credential service"), "{e}");
        }
        // STS answers throttling, and a failure to reach the identity provider, with a 400
        // and its error code; other codes of a 400 are refusals.
        let sts = |code: &str| object_store::Error::Generic {
            store: "S3",
            source: format!(
                "Server returned non-2xx status code: 400 Bad Request: <ErrorResponse><Error>\
                 <Type>Sender</Type><Code>{code}</Code><Message>m</Message></Error></ErrorResponse>"
            )
            .into(),
        };
        for (code, kind) in [
            ("Throttling", StoreErrorKind::Unavailable),
            ("IDPCommunicationError", StoreErrorKind::Unavailable),
            ("IDPRejectedClaim", StoreErrorKind::Credentials),
            ("InvalidIdentityToken", StoreErrorKind::Credentials),
        ] {
            let e = classify(sts(code), Some(&from_sts(Some(400))), at());
            assert_eq!(e.kind(), kind, "{code}: {e}");
        }
        // The same 400 from the store itself is no credentials failure.
        let e = classify(generic(), Some(&with(400, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
    }

    #[test]
    fn permanent_refusals_are_rejected_not_an_outage() {
        // Before, all of these were `Unavailable`: retried at start and sent to nodes as
        // StorageUnavailable, so a wrong region looked like an outage.
        for status in [301, 400, 405, 416] {
            let e = classify(generic(), Some(&with(status, None)), at());
            assert_eq!(e.kind(), StoreErrorKind::Rejected, "{status}: {e}");
            assert!(e.to_string().contains(&format!("(HTTP {status})")), "{e}");
            assert!(e.to_string().contains("not transient"), "{e}");
        }
        let region = object_store::Error::Generic {
            store: "S3",
            source: "400 Bad Request: <Error><Code>AuthorizationHeaderMalformed</Code>\
                     <Message>the region 'us-east-1' is wrong</Message></Error>"
                .into(),
        };
        let e = classify(region, Some(&with(400, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
        assert!(
            e.to_string().contains("AuthorizationHeaderMalformed"),
            "{e}"
        );
        // Transient 4xx stay `Unavailable`.
        let idle = object_store::Error::Generic {
            store: "S3",
            source: "400: <Error><Code>RequestTimeout</Code><Message>idle</Message></Error>".into(),
        };
        let e = classify(idle, Some(&with(400, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
        // An expired session token is S3's 400, and a credentials failure.
        for code in ["ExpiredToken", "InvalidToken", "TokenRefreshRequired"] {
            let expired = object_store::Error::Generic {
                store: "S3",
                source: format!("400: <Error><Code>{code}</Code><Message>m</Message></Error>")
                    .into(),
            };
            let e = classify(expired, Some(&with(400, None)), at());
            assert_eq!(e.kind(), StoreErrorKind::Credentials, "{code}: {e}");
        }
        for status in [408, 409, 500] {
            let e = classify(generic(), Some(&with(status, None)), at());
            assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{status}: {e}");
        }
        // A key object_store cannot parse in a listing names the fix.
        let bad = object_store::Error::InvalidPath {
            source: object_store::path::Error::EmptySegment {
                path: "ds/logs//run.txt".into(),
            },
        };
        let e = classify(bad, None, at());
        assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
        assert!(e.to_string().contains("narrower prefix"), "{e}");
        assert!(e.to_string().contains("ds/logs//run.txt"), "{e}");
    }

    #[test]
    fn variants_and_statuses_map_to_kinds() {
        let nf = object_store::Error::NotFound {
            path: "p/a.bin".into(),
            source: "404".into(),
        };
        let e = classify(nf, None, at());
        assert_eq!(e.kind(), StoreErrorKind::NotFound);
        assert!(e.to_string().contains("bucket bkt, key p/a.bin"), "{e}");
        let pre = object_store::Error::Precondition {
            path: "p/a.bin".into(),
            source: "412".into(),
        };
        let e = classify(pre, Some(&with(412, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Changed);
        assert!(e.to_string().contains("no longer \"e1\""), "{e}");
        let denied = object_store::Error::PermissionDenied {
            path: "p/a.bin".into(),
            source: "SignatureDoesNotMatch".into(),
        };
        let e = classify(denied, Some(&with(403, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Credentials);
        assert!(e.to_string().contains("SignatureDoesNotMatch"), "{e}");
        let e = classify(generic(), Some(&with(401, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Credentials);
        let e = classify(generic(), Some(&with(500, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Unavailable);
        assert!(e.to_string().contains("bytes 0..8"), "{e}");
        let e = classify(generic(), None, at());
        assert_eq!(e.kind(), StoreErrorKind::Unavailable);
    }

    #[test]
    fn a_refusal_from_an_http_server_is_no_credentials_failure() {
        // Before: "credentials refused ... check the AWS_*/GOOGLE_*/AZURE_* environment"
        // (`StorageAuth`), from a dataset that carries no credentials, for a WebDAV server
        // that refuses `PROPFIND` with `Depth: infinity` (Apache's default).
        let listing = At {
            uncredentialed: true,
            check: "the dataset URL and what the server serves there",
            listing: Some("https://files.example/ds"),
            range: None,
            ..at()
        };
        let denied = || object_store::Error::PermissionDenied {
            path: "ds".into(),
            source: "403 Forbidden".into(),
        };
        let e = classify(denied(), Some(&with(403, None)), listing);
        assert_eq!(e.kind(), StoreErrorKind::Forbidden, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("(HTTP 403)")
                && msg.contains("403 Forbidden")
                && msg.contains("not transient")
                && msg.contains("`DavDepthInfinity On`"),
            "{msg}"
        );
        assert!(
            !msg.contains("credentials") && !msg.contains("AWS_"),
            "{msg}"
        );
        // A GET (or HEAD) refused after the listing worked: no word of PROPFIND. Before, the
        // hint came with every refusal, and the kind was `Rejected` (`ReadFailed`): a node
        // fetched a permanent 403 ten times before its stream ended.
        let get = At {
            uncredentialed: true,
            check: "the dataset URL and what the server serves there",
            ..at()
        };
        for status in [401, 403] {
            let e = classify(generic(), Some(&with(status, None)), get.clone());
            assert_eq!(e.kind(), StoreErrorKind::Forbidden, "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("(HTTP {status})")), "{msg}");
            assert!(
                !msg.contains("PROPFIND") && !msg.contains("credentials"),
                "{msg}"
            );
        }
        // Its other answers keep their kinds; a cloud store's 403 is still credentials.
        let e = classify(generic(), Some(&with(404, None)), get);
        assert_eq!(e.kind(), StoreErrorKind::NotFound, "{e}");
        let e = classify(denied(), Some(&with(403, None)), at());
        assert_eq!(e.kind(), StoreErrorKind::Credentials, "{e}");
    }

    #[test]
    fn a_server_without_webdav_is_told_apart_from_a_wrong_region_or_an_outage() {
        // Before: a 405 (nginx, Caddy) was "refused by the store ... check AWS_REGION and the
        // endpoint", a 501 (`python3 -m http.server`) "storage unavailable", asked again for
        // 20 s at source start; neither said the server must answer WebDAV PROPFIND.
        let listing = At {
            uncredentialed: true,
            check: "the dataset URL and what the server serves there",
            listing: Some("http://files.example:8000/ds"),
            range: None,
            etag: None,
            ..at()
        };
        for status in [405, 501] {
            let e = classify(generic(), Some(&with(status, None)), listing.clone());
            assert_eq!(e.kind(), StoreErrorKind::Rejected, "{status}: {e}");
            let msg = e.to_string();
            assert!(
                msg.starts_with("http://files.example:8000/ds: ")
                    && msg.contains(&format!("(HTTP {status})"))
                    && msg.contains("WebDAV PROPFIND")
                    && msg.contains("not transient"),
                "{msg}"
            );
            assert!(!msg.contains("AWS_REGION"), "{msg}");
        }
        // A GET or HEAD of one object, and a cloud store's listing, keep their kinds.
        let get = At {
            uncredentialed: true,
            check: "the dataset URL and what the server serves there",
            ..at()
        };
        let e = classify(generic(), Some(&with(501, None)), get.clone());
        assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
        let e = classify(generic(), Some(&with(405, None)), get);
        assert!(!e.to_string().contains("PROPFIND"), "{e}");
        // Before: every refusal for good said "check the dataset URL, AWS_REGION and the
        // endpoint", to a user of an http(s) server, which has no region.
        assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
        assert!(
            !e.to_string().contains("AWS_") && e.to_string().contains("what the server serves"),
            "{e}"
        );
        let e = classify(generic(), Some(&with(400, None)), at());
        assert!(e.to_string().contains("AWS_REGION"), "{e}");
        let s3_listing = At {
            listing: Some("s3://bkt/ds"),
            ..at()
        };
        let e = classify(generic(), Some(&with(501, None)), s3_listing);
        assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
    }

    #[test]
    fn throttling_keeps_the_retry_after() {
        let wait = Some(Duration::from_millis(2500));
        for status in [503, 429] {
            let e = classify(generic(), Some(&with(status, wait)), at());
            assert_eq!(e.kind(), StoreErrorKind::Throttled);
            assert_eq!(e.retry_after(), wait);
            let msg = e.to_string();
            assert!(
                msg.contains("Retry-After 2.5 s") && msg.contains("bytes 0..8"),
                "{msg}"
            );
        }
    }

    #[test]
    fn urls_in_an_object_store_error_are_redacted() {
        // object_store's RetryError names the request's whole URI, userinfo and query
        // included; reqwest's error repeats it in parentheses.
        let e = object_store::Error::Generic {
            store: "S3",
            source: "Error performing GET http://user:secret@proxy:9000/b/k in 10s, after 3 \
                     retries - HTTP error: error sending request for url \
                     (http://user:secret@proxy:9000/b/k?X-Amz-Signature=sig123) \
                     \"https://u:p@h/x\""
                .into(),
        };
        let err = classify(e, None, at());
        let msg = err.to_string();
        // Before, the error repeated them as they came.
        assert!(
            !msg.contains("secret") && !msg.contains("sig123") && !msg.contains("u:p@"),
            "{msg}"
        );
        assert!(
            msg.contains("GET http://***@proxy:9000/b/k in 10s")
                && msg.contains("(http://***@proxy:9000/b/k?...")
                && msg.contains("\"https://***@h/x\""),
            "{msg}"
        );
        // A URL with nothing secret in it, and text with no URL, are left as they are.
        let plain = "Error performing GET https://b.s3.amazonaws.com/p/a.bin in 1s";
        assert_eq!(redact_urls(plain), plain);
        assert_eq!(redact_urls("a:// b (x://"), "a:// b (x://");
        assert_eq!(redact_urls("(1s3://k:v@b/p)"), "(1s3://***@b/p)");
    }

    #[test]
    fn long_messages_are_cut() {
        let e = object_store::Error::Generic {
            store: "S3",
            source: "x".repeat(5000).into(),
        };
        let msg = classify(e, None, at()).to_string();
        assert!(msg.len() < 800 && msg.ends_with("..."), "{}", msg.len());
    }
}
