//! The metric names this crate records (through the `metrics` facade; the process installs
//! the recorder). Labels: `op` is `get`, `head`, `list` or `put`; `status` is the HTTP
//! status of an attempt, or `error` when no response came (timeout, connection); `bucket`
//! is `scheme://bucket`.

/// Counter: HTTP attempts, `{op, status}` (retries included).
pub const REQUESTS: &str = "shardwire_source_store_requests_total";
/// Histogram: seconds from sending an attempt to its response head, `{op}`.
pub const FIRST_BYTE: &str = "shardwire_source_store_first_byte_seconds";
/// Histogram: seconds of a whole request including retries and the body, `{op}`.
pub const REQUEST_SECONDS: &str = "shardwire_source_store_request_seconds";
/// Counter: body bytes received, `{op}`.
pub const BYTES: &str = "shardwire_source_store_bytes_total";
/// Counter: attempts after the first of a request (object_store's retries), `{op}`.
pub const RETRIES: &str = "shardwire_source_store_retries_total";
/// Counter: 503/429 answers, `{op}`.
pub const THROTTLED: &str = "shardwire_source_store_throttled_total";
/// Gauge: the in-flight limit of a bucket's adaptive window, `{bucket}`.
pub const WINDOW: &str = "shardwire_source_store_window";
/// Gauge: requests in flight to a bucket, `{bucket}`.
pub const INFLIGHT: &str = "shardwire_source_store_inflight";

/// Every name above, for registration and documentation checks.
pub const ALL: [&str; 8] = [
    REQUESTS,
    FIRST_BYTE,
    REQUEST_SECONDS,
    BYTES,
    RETRIES,
    THROTTLED,
    WINDOW,
    INFLIGHT,
];

/// Registers help texts with the installed recorder (call once after installing it).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        REQUESTS,
        "object-store HTTP attempts by operation and status"
    );
    describe_histogram!(
        FIRST_BYTE,
        Unit::Seconds,
        "time to an attempt's response head"
    );
    describe_histogram!(
        REQUEST_SECONDS,
        Unit::Seconds,
        "time of a whole request, body included"
    );
    describe_counter!(BYTES, Unit::Bytes, "object-store body bytes received");
    describe_counter!(
        RETRIES,
        "object-store attempts after the first of a request"
    );
    describe_counter!(THROTTLED, "object-store 503/429 SlowDown answers");
    describe_gauge!(WINDOW, "in-flight limit of the bucket's adaptive window");
    describe_gauge!(INFLIGHT, "object-store requests in flight to the bucket");
}
