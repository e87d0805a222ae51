//! A response body whose size hint is not taken at the server's word: object_store collects
//! some bodies (listing pages, error replies, credential answers) into a buffer allocated at
//! the body's size hint, which is the server's `Content-Length`. [`Capped`] passes the bytes
//! through unchanged and reports no hint above [`MAX_HINT`], so a buffer grows with the bytes
//! that arrive instead of being sized by a claim (a reply that says 1 TB and sends 2 bytes).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::client::{HttpError, HttpResponseBody};

/// Largest size hint passed on (a listing page is well under 1 MiB).
pub(crate) const MAX_HINT: u64 = 16 << 20;

/// `body` with its size hint capped.
pub(crate) struct Capped(pub HttpResponseBody);

impl Capped {
    /// `body`, wrapped.
    pub fn wrap(body: HttpResponseBody) -> HttpResponseBody {
        HttpResponseBody::new(Capped(body))
    }
}

impl Body for Capped {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let hint = self.0.size_hint();
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
        assert_eq!(Capped(liar(1 << 40)).size_hint().lower(), 0);
        assert_eq!(Capped(liar(1 << 40)).size_hint().upper(), None);
        assert_eq!(Capped(liar(4)).size_hint().exact(), Some(4));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_bytes_pass_through_unchanged() {
        // Uncapped, collecting this body would first reserve the terabyte it claims.
        let got = Capped::wrap(liar(1 << 40)).bytes().await.unwrap();
        assert_eq!(&got[..], b"abcd");
    }
}
