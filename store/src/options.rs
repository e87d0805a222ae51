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
    /// Limit on any one read of the response (catches a stalled body).
    pub read_timeout: Duration,
    /// Limit on one attempt, connect to the end of the body.
    pub request_timeout: Duration,
    /// object_store's retries per request (kept small: the window, not the retries, absorbs
    /// throttling).
    pub max_retries: usize,
}

/// Default request size: 8 MiB (AWS's guidance: 8-16 MB ranged GETs).
pub const DEFAULT_REQUEST_SIZE: u64 = 8 << 20;

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
