//! Reading shards from object storage: the GETs [`shardwire_store::plan_requests`] plans for
//! a group of shards (large ones split into parts read in parallel, adjacent small ones of one
//! object merged up to the request size), every GET pinned to the ETag the manifest recorded,
//! and each shard's bytes checked against its CRC-32C before anything else sees them. A shard
//! whose bytes do not match is read once more, alone; a second mismatch is an error. The
//! failures a node sees are [`Failure`]s: a wire error code, the store's retry advice and a
//! message naming bucket, key and range.

use std::ops::Range;

use bytes::Bytes;
use futures_util::future::join_all;
use shardwire_protocol::crc::Crc32c;
use shardwire_protocol::wire::ErrorCode;
use shardwire_store::{Piece, Store, StoreError, StoreErrorKind, plan_requests};

/// Why a shard could not be read, as a node is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The wire code.
    pub code: ErrorCode,
    /// The store's advice (throttled), in milliseconds; 0 without.
    pub retry_after_ms: u32,
    /// What happened, naming bucket, key and range.
    pub message: String,
}

impl From<&StoreError> for Failure {
    fn from(e: &StoreError) -> Self {
        let code = match e.kind() {
            StoreErrorKind::Throttled => ErrorCode::Throttled,
            // Refused for good by the store (an http(s) server's 401/403 too): the node
            // ends the stream at once instead of fetching it again.
            StoreErrorKind::Credentials | StoreErrorKind::Forbidden => ErrorCode::StorageAuth,
            StoreErrorKind::NotFound => ErrorCode::ObjectNotFound,
            StoreErrorKind::Changed => ErrorCode::DatasetChanged,
            StoreErrorKind::Unavailable | StoreErrorKind::Short => ErrorCode::StorageUnavailable,
            StoreErrorKind::Url
            | StoreErrorKind::Config
            | StoreErrorKind::Sink
            | StoreErrorKind::Rejected => ErrorCode::ReadFailed,
        };
        let retry_after_ms = e
            .retry_after()
            .map_or(0, |d| d.as_millis().min(u128::from(u32::MAX)) as u32);
        Failure {
            code,
            retry_after_ms,
            message: e.to_string(),
        }
    }
}

/// An object the manifest's shards live in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Object {
    /// Key relative to the dataset's prefix.
    pub key: String,
    /// Size at indexing.
    pub size: u64,
    /// ETag at indexing (every GET sends `If-Match` with it).
    pub etag: String,
}

/// One shard to read: where its bytes are and what they must hash to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    /// The shard.
    pub shard: u32,
    /// Index of its object.
    pub object: usize,
    /// Its range in the object.
    pub range: Range<u64>,
    /// CRC-32C from the manifest.
    pub crc32c: u32,
}

/// What reading one shard came to.
pub type Read = (u32, Result<Vec<Bytes>, Failure>);

/// Reads `wants` (in this order, adjacent ones merged as planned) in GETs of at most
/// `store.options().request_size`, all in flight at once within the bucket's window; each
/// shard checked, re-read alone once on a mismatch.
pub async fn read_shards(store: &Store, objects: &[Object], wants: &[Want]) -> Vec<Read> {
    let mut out = read_planned(store, objects, wants).await;
    for (i, (shard, got)) in out.iter_mut().enumerate() {
        if let Err(f) = got
            && f.code == ErrorCode::ChecksumMismatch
        {
            metrics::counter!("shardwire_source_origin_crc_failures_total").increment(1);
            tracing::warn!(shard = *shard, failure = %f.message, "reading the shard once more");
            let again = read_planned(store, objects, std::slice::from_ref(&wants[i])).await;
            *got = again.into_iter().next().expect("one want, one read").1;
        }
    }
    out
}

/// One planned pass over `wants`, without the second chance.
async fn read_planned(store: &Store, objects: &[Object], wants: &[Want]) -> Vec<Read> {
    let pieces: Vec<Piece> = wants
        .iter()
        .map(|w| Piece {
            object: w.object,
            offset: w.range.start,
            len: w.range.end - w.range.start,
        })
        .collect();
    let requests = plan_requests(&pieces, store.options().request_size);
    let gets = requests.iter().map(|r| {
        let o = &objects[r.object];
        store.read(&o.key, r.range.clone(), Some(o.etag.as_str()))
    });
    let bodies = join_all(gets).await;
    let mut parts: Vec<Result<Vec<Bytes>, Failure>> = vec![Ok(Vec::new()); wants.len()];
    for (r, body) in requests.iter().zip(bodies) {
        match body {
            Err(e) => {
                let f = Failure::from(&e);
                for p in r.pieces.clone() {
                    parts[p] = Err(f.clone());
                }
            }
            Ok(b) => {
                for p in r.pieces.clone() {
                    if let Ok(v) = &mut parts[p] {
                        let at = (pieces[p].offset.max(r.range.start) - r.range.start) as usize;
                        let end = ((pieces[p].offset + pieces[p].len).min(r.range.end)
                            - r.range.start) as usize;
                        v.push(b.slice(at..end));
                    }
                }
            }
        }
    }
    wants
        .iter()
        .zip(parts)
        .map(|(w, p)| {
            (
                w.shard,
                p.and_then(|v| check(store, &objects[w.object], w, v)),
            )
        })
        .collect()
}

/// The shard's bytes if their CRC-32C is the manifest's.
fn check(store: &Store, o: &Object, w: &Want, parts: Vec<Bytes>) -> Result<Vec<Bytes>, Failure> {
    let mut crc = Crc32c::new();
    let mut len = 0u64;
    for p in &parts {
        crc.update(p);
        len += p.len() as u64;
    }
    let got = crc.finish();
    if got == w.crc32c && len == w.range.end - w.range.start {
        return Ok(parts);
    }
    Err(Failure {
        code: ErrorCode::ChecksumMismatch,
        retry_after_ms: 0,
        message: format!(
            "bucket {}, key {}, bytes {}..{} (shard {}, ETag {}): CRC-32C of the {len} bytes read is {got:#010x}, the manifest says {:#010x}",
            store.url().bucket(),
            store.url().key(&o.key),
            w.range.start,
            w.range.end,
            w.shard,
            o.etag,
            w.crc32c
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http_servers_refusal_ends_the_stream_at_once() {
        // Before: `ReadFailed`, which a node fetches again (ten times, about 45 s, a warning
        // each) before its stream ends; a permanent 403 of every shard in flight.
        let e = StoreError::Forbidden {
            bucket: "files.example".into(),
            key: "ds/a.tar".into(),
            status: Some(403),
            reason: "Server returned non-2xx status code: 403 Forbidden".into(),
            listing: false,
        };
        let f = Failure::from(&e);
        assert_eq!(f.code, ErrorCode::StorageAuth, "{}", f.message);
        assert!(f.message.contains("(HTTP 403)"), "{}", f.message);
        assert!(!f.message.contains("credentials"), "{}", f.message);
    }
}
