//! [`StoreOptions`]: request size, the window's ceiling, timeouts and the retry budget.

use std::time::Duration;

/// How a [`crate::Store`] talks to its store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// Largest ranged GET (source key `object_store_request_size`), default 8 MiB.
    pub request_size: u64,
    /// Ceiling of the bucket's adaptive in-flight window (`object_store_max_inflight`).
    pub max_inflight: usize,
    /// Limit on connecting (TCP + TLS).
    pub connect_timeout: Duration,
    /// Limit on the wait for the response's head, counted from sending the request (so it
    /// covers connecting, sending the request's body and the server's time to answer), then on
    /// each read of the body (catches a stalled body). Uploads are held to `request_timeout`
    /// instead: sending a part takes longer than a GET takes to start answering.
    pub read_timeout: Duration,
    /// Limit on one attempt, connect to the end of the body (see [`StoreOptions::sized`]);
    /// also an upload's (a PUT, one part of a multipart upload).
    pub request_timeout: Duration,
    /// object_store's retries per request (kept small: the window, not the retries, absorbs
    /// throttling).
    pub max_retries: usize,
}

/// Default request size: 8 MiB (AWS's guidance: 8-16 MB ranged GETs).
pub const DEFAULT_REQUEST_SIZE: u64 = 8 << 20;

/// The slowest a GET's body may arrive on average before the whole-request limit ends it:
/// with `max_inflight` GETs sharing a link, each gets a share (32 GETs of 1 GiB on a 2.3 Gbit/s
/// link get 9 MB/s each). A body that stops arriving is caught by `read_timeout` much sooner.
pub const MIN_REQUEST_RATE: u64 = 1 << 20;

impl StoreOptions {
    /// The defaults with GETs of up to `request_size` bytes and at most `max_inflight` at
    /// once: the whole-request limit is the default 60 s, or the time to receive
    /// `request_size` at [`MIN_REQUEST_RATE`] if that is longer (a fixed 60 s failed every GET
    /// of a 1 GiB `object_store_request_size` slower than 17 MiB/s).
    pub fn sized(request_size: u64, max_inflight: usize) -> Self {
        let d = Self::default();
        Self {
            request_size,
            max_inflight,
            request_timeout: d
                .request_timeout
                .max(Duration::from_secs(request_size / MIN_REQUEST_RATE)),
            ..d
        }
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            request_size: DEFAULT_REQUEST_SIZE,
            max_inflight: 32,
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            max_retries: 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_limit_grows_with_the_request_size() {
        assert_eq!(
            StoreOptions::sized(DEFAULT_REQUEST_SIZE, 32).request_timeout,
            Duration::from_secs(60)
        );
        let big = StoreOptions::sized(1 << 30, 8);
        assert_eq!(big.request_timeout, Duration::from_secs(1024));
        assert_eq!((big.request_size, big.max_inflight), (1 << 30, 8));
        assert_eq!(big.read_timeout, StoreOptions::default().read_timeout);
    }
}
