//! A response body whose size hint is not taken at the server's word: object_store collects
//! some bodies (listing pages, error replies, credential answers) into a buffer allocated at
//! the body's size hint, which is the server's `Content-Length`. [`Capped`] passes the bytes
//! through unchanged and reports no hint above [`MAX_HINT`], so a buffer grows with the bytes
//! that arrive instead of being sized by a claim (a reply that says 1 TB and sends 2 bytes).
//! An error reply, or the answer to another request than a GET (a credential service's),
//! also fails past [`MAX_COLLECTED`] bytes: an error reply of gigabytes from a misbehaving
//! proxy is not buffered until the request times out. A WebDAV listing (one `PROPFIND` of the
//! whole tree, which object_store collects) fails past [`MAX_LISTING`]. (A successful GET's
//! body is a ranged read streamed to its sink, bounded by the range, or a listing page.)

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::client::{HttpError, HttpErrorKind, HttpResponseBody};

/// Largest size hint passed on (a listing page is well under 1 MiB).
pub(crate) const MAX_HINT: u64 = 16 << 20;

/// Most bytes of an error reply or a credential answer (both well under 1 MiB); smaller in
/// unit tests, which send past it.
pub(crate) const MAX_COLLECTED: u64 = if cfg!(test) { 1 << 20 } else { 64 << 20 };

/// Most bytes of a WebDAV listing (0.4-1 KB per file: over a million files); smaller in unit
/// tests.
pub(crate) const MAX_LISTING: u64 = if cfg!(test) { 4 << 20 } else { 1 << 30 };

/// `body` with its size hint capped, and at most `limit` bytes of it passed on.
pub(crate) struct Capped {
    body: HttpResponseBody,
    limit: Option<u64>,
    seen: u64,
}

impl Capped {
    /// `body`, wrapped; with `collected` (an error reply, a credential answer) it fails past
    /// [`MAX_COLLECTED`] bytes.
    pub fn wrap(body: HttpResponseBody, collected: bool) -> HttpResponseBody {
        Self::wrap_within(body, collected.then_some(MAX_COLLECTED))
    }

    /// `body`, wrapped, failing past `limit` bytes (none: never).
    pub fn wrap_within(body: HttpResponseBody, limit: Option<u64>) -> HttpResponseBody {
        HttpResponseBody::new(Capped {
            body,
            limit,
            seen: 0,
        })
    }
}

/// A collected body ran past [`MAX_COLLECTED`].
#[derive(Debug, thiserror::Error)]
#[error(
    "the store's answer ran past {limit} bytes, more than any error reply, credential \
         answer or listing"
)]
pub(crate) struct TooLong {
    pub limit: u64,
}

/// Whether `e` (or an error it wraps) is a body that ran past its limit.
pub(crate) fn too_long(e: &(dyn std::error::Error + 'static)) -> Option<u64> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<TooLong>() {
            return Some(t.limit);
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
            if let Some(limit) = self.limit.filter(|&l| self.seen > l) {
                let e = HttpError::new(HttpErrorKind::Decode, TooLong { limit });
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

    #[test]
    fn a_claimed_length_past_the_cap_is_not_passed_on() {
        assert_eq!(Capped::wrap(liar(1 << 40), true).size_hint().lower(), 0);
        assert_eq!(Capped::wrap(liar(1 << 40), true).size_hint().upper(), None);
        assert_eq!(Capped::wrap(liar(4), true).size_hint().exact(), Some(4));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_bytes_pass_through_unchanged() {
        // Uncapped, collecting this body would first reserve the terabyte it claims.
        let got = Capped::wrap(liar(1 << 40), true).bytes().await.unwrap();
        assert_eq!(&got[..], b"abcd");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_collected_body_fails_past_its_limit_a_streamed_one_does_not() {
        // Before, an error reply of gigabytes was buffered until the request timed out.
        let big = || {
            let chunk = Bytes::from(vec![0u8; 1 << 20]);
            let n = (MAX_COLLECTED >> 20) as usize + 1;
            HttpResponseBody::new(Liar {
                claim: 0,
                chunks: std::iter::repeat_n(chunk, n).collect(),
            })
        };
        let e = Capped::wrap(big(), true).bytes().await.unwrap_err();
        assert!(e.to_string().contains("ran past"), "{e}");
        let got = Capped::wrap(big(), false).bytes().await.unwrap();
        assert_eq!(got.len() as u64, MAX_COLLECTED + (1 << 20));
    }
}
