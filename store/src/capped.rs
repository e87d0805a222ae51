//! A response body whose size hint is not taken at the server's word: object_store collects
//! some bodies (listing pages, error replies, credential answers) into a buffer allocated at
//! the body's size hint, which is the server's `Content-Length`. [`Capped`] passes the bytes
//! through unchanged and reports no hint above [`MAX_HINT`], so a buffer grows with the bytes
//! that arrive instead of being sized by a claim (a reply that says 1 TB and sends 2 bytes).
//! A collected body also fails past its [`Cap`]: an error reply or a credential answer past
//! [`MAX_COLLECTED`] bytes, a listing page (S3, GCS, Azure) past [`MAX_LIST_PAGE`], a WebDAV
//! listing (one `PROPFIND` of the whole tree) past [`MAX_LISTING`]; so an endless answer from
//! a misbehaving proxy is not buffered until the request times out. (A ranged read's body is
//! streamed to its sink, bounded by its range, and has no cap here.)

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::client::{HttpError, HttpErrorKind, HttpResponseBody};

use crate::url::redacted;

/// Largest size hint passed on (a listing page is well under 1 MiB).
pub(crate) const MAX_HINT: u64 = 16 << 20;

/// Most bytes of an error reply or a credential answer (both well under 1 MiB); smaller in
/// unit tests, which send past it.
pub(crate) const MAX_COLLECTED: u64 = if cfg!(test) { 1 << 20 } else { 64 << 20 };

/// Most bytes of one page of an S3, GCS or Azure listing (1000 keys: well under 1 MiB);
/// smaller in unit tests.
pub(crate) const MAX_LIST_PAGE: u64 = if cfg!(test) { 2 << 20 } else { 64 << 20 };

/// Most bytes of a WebDAV listing outside unit tests (0.4-1 KB per file: over a million
/// files); an http(s) store's whole-request limit gives it time to arrive.
pub(crate) const WEBDAV_LISTING_BYTES: u64 = 1 << 30;

/// Most bytes of a WebDAV listing: [`WEBDAV_LISTING_BYTES`]; smaller in unit tests.
pub(crate) const MAX_LISTING: u64 = if cfg!(test) {
    4 << 20
} else {
    WEBDAV_LISTING_BYTES
};

/// Which answer a body is, for its bound and for the error past it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cap {
    /// An error reply or a credential service's answer: [`MAX_COLLECTED`].
    Collected,
    /// A page of an S3, GCS or Azure listing: [`MAX_LIST_PAGE`].
    ListPage,
    /// A WebDAV listing, the whole tree in one answer: [`MAX_LISTING`].
    WebDav,
}

impl Cap {
    /// The most bytes passed on.
    pub fn bytes(self) -> u64 {
        match self {
            Cap::Collected => MAX_COLLECTED,
            Cap::ListPage => MAX_LIST_PAGE,
            Cap::WebDav => MAX_LISTING,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Cap::Collected => "an error reply or a credential answer (well under 1 MiB)",
            Cap::ListPage => {
                "a listing page (1000 keys: well under 1 MiB; a proxy or server that does \
                 not end its answer?)"
            }
            Cap::WebDav => "the listing (one WebDAV PROPFIND answers the whole tree at once)",
        }
    }
}

/// `body` with its size hint capped, and at most its cap's bytes of it passed on.
pub(crate) struct Capped {
    body: HttpResponseBody,
    /// The cap, and the request's URI for the error past it (unredacted: it is redacted only
    /// when an error is made).
    limit: Option<(Cap, http::Uri)>,
    seen: u64,
}

impl Capped {
    /// `body`, the answer to a request to `uri`, wrapped; failing past `cap` (none: never).
    pub fn wrap(body: HttpResponseBody, cap: Option<Cap>, uri: &http::Uri) -> HttpResponseBody {
        HttpResponseBody::new(Capped {
            body,
            limit: cap.map(|c| (c, uri.clone())),
            seen: 0,
        })
    }
}

/// A collected body ran past its cap.
#[derive(Debug, thiserror::Error)]
#[error("{} from {url} ran past {} bytes", cap.what(), cap.bytes())]
pub(crate) struct TooLong {
    /// Which answer it was.
    pub cap: Cap,
    /// The request's URL, redacted (no userinfo, query or fragment: a SAS token).
    pub url: String,
}

/// The [`TooLong`] that `e` is or wraps.
pub(crate) fn too_long<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a TooLong> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<TooLong>() {
            return Some(t);
        }
        cur = err.source();
    }
    None
}

impl Body for Capped {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &polled
            && let Some(data) = f.data_ref()
        {
            self.seen += data.len() as u64;
            if let Some((cap, uri)) = &self.limit
                && self.seen > cap.bytes()
            {
                let url = redacted(&uri.to_string());
                let e = HttpError::new(HttpErrorKind::Decode, TooLong { cap: *cap, url });
                return Poll::Ready(Some(Err(e)));
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let hint = self.body.size_hint();
        if hint.lower() > MAX_HINT {
            SizeHint::default()
        } else {
            hint
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A body that claims `claim` bytes and sends `chunks`.
    struct Liar {
        claim: u64,
        chunks: VecDeque<Bytes>,
    }

    impl Body for Liar {
        type Data = Bytes;
        type Error = HttpError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
            Poll::Ready(self.chunks.pop_front().map(|b| Ok(Frame::data(b))))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.claim)
        }
    }

    fn liar(claim: u64) -> HttpResponseBody {
        let chunks = VecDeque::from([Bytes::from_static(b"ab"), Bytes::from_static(b"cd")]);
        HttpResponseBody::new(Liar { claim, chunks })
    }

    fn uri() -> http::Uri {
        "http://u:pw@store.example:9000/bkt?list-type=2&sig=tok3n"
            .parse()
            .unwrap()
    }

    fn capped(body: HttpResponseBody, cap: Option<Cap>) -> HttpResponseBody {
        Capped::wrap(body, cap, &uri())
    }

    #[test]
    fn a_claimed_length_past_the_cap_is_not_passed_on() {
        let c = Some(Cap::Collected);
        assert_eq!(capped(liar(1 << 40), c).size_hint().lower(), 0);
        assert_eq!(capped(liar(1 << 40), c).size_hint().upper(), None);
        assert_eq!(capped(liar(4), c).size_hint().exact(), Some(4));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_bytes_pass_through_unchanged() {
        // Uncapped, collecting this body would first reserve the terabyte it claims.
        let got = capped(liar(1 << 40), Some(Cap::Collected))
            .bytes()
            .await
            .unwrap();
        assert_eq!(&got[..], b"abcd");
    }

    /// A body of `mib` chunks of 1 MiB that claims no length.
    fn big(mib: u64) -> HttpResponseBody {
        let chunk = Bytes::from(vec![0u8; 1 << 20]);
        HttpResponseBody::new(Liar {
            claim: 0,
            chunks: std::iter::repeat_n(chunk, mib as usize).collect(),
        })
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_collected_body_fails_past_its_limit_a_streamed_one_does_not() {
        // Before, an error reply of gigabytes was buffered until the request timed out.
        let n = (MAX_COLLECTED >> 20) + 1;
        let e = capped(big(n), Some(Cap::Collected))
            .bytes()
            .await
            .unwrap_err();
        assert!(e.to_string().contains("ran past"), "{e}");
        let got = capped(big(n), None).bytes().await.unwrap();
        assert_eq!(got.len() as u64, MAX_COLLECTED + (1 << 20));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_listing_page_past_its_cap_names_the_url_redacted_and_the_bound() {
        // Before, a successful GET of a listing page had no cap at all.
        let e = capped(big((MAX_LIST_PAGE >> 20) + 1), Some(Cap::ListPage))
            .bytes()
            .await
            .unwrap_err();
        let t = too_long(&e).expect("a TooLong under the HttpError");
        assert_eq!(t.cap, Cap::ListPage);
        let msg = t.to_string();
        assert!(
            msg.contains("listing page (")
                && msg.contains("from http://***@store.example:9000/bkt?...")
                && msg.contains(&format!("ran past {MAX_LIST_PAGE} bytes")),
            "{msg}"
        );
        assert!(!msg.contains("tok3n") && !msg.contains("pw"), "{msg}");
        let got = capped(big(MAX_LIST_PAGE >> 20), Some(Cap::ListPage))
            .bytes()
            .await
            .unwrap();
        assert_eq!(got.len() as u64, MAX_LIST_PAGE, "up to the cap passes");
    }
}
