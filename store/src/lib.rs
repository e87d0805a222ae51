//! `shardwire-store`: object-storage access for shardwire (DESIGN §12). A dataset location is
//! a [`StoreUrl`] (`s3://bucket/prefix`, `gs://`, `az://`, `file:///dir`, read-only
//! `http(s)://`); a [`Store`] opened on it from the standard environment lists, heads, reads
//! byte ranges (one GET each, `If-Match` an ETag) and writes the manifest.
//!
//! - Planned reads: [`plan_requests`] turns pieces (shards) into GETs of at most the request
//!   size, split or merged, never object_store's unbounded `get_ranges` coalescing.
//! - Throttling: one adaptive in-flight window per bucket (halve on 503/429, +1 per window
//!   of successes) on top of a small object_store retry budget; every attempt is seen by an
//!   HTTP tap (metrics, throttles, `Retry-After`).
//! - Errors: [`StoreError`], one variant per cause, each naming bucket, key and range;
//!   [`StoreErrorKind`] is the tag to map to wire codes.
//! - [`Blocking`]: the same operations for synchronous callers (`shardwire index`).
//!
//! Depends on no shardwire crate.

#![forbid(unsafe_code)]

mod backend;
mod blocking;
mod capped;
mod error;
mod etag;
mod local;
pub mod metrics;
mod options;
mod plan;
mod redact;
mod store;
mod tap;
mod url;
mod window;

pub use crate::backend::Described;
pub use crate::blocking::Blocking;
pub use crate::error::{EtagAnswer, StoreError, StoreErrorKind};
pub use crate::etag::{quoted_etag, same_etag};
pub use crate::options::{DEFAULT_REQUEST_SIZE, StoreOptions};
pub use crate::plan::{Piece, Request, plan_requests};
pub use crate::store::{ObjectMeta, Store};
pub use crate::url::{Scheme, StoreUrl, redacted};
pub use crate::window::{Urgency, WindowStatus};
