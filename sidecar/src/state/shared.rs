//! The exact cache shared by all replicas of a route through Redis (`cache.exact.backend:
//! redis`): a response stored by one sidecar is a hit in every other.
//!
//! Each sidecar still keeps its own in-memory cache in front (a local hit costs no round
//! trip); Redis is asked only on a local miss, and a Redis hit is copied into the local
//! cache for the rest of its time to live. Stores happen in the background after the
//! response was sent, so Redis is never on the path of a miss's bytes. Entries expire in
//! Redis by `PX` (the route's `ttl`). Redis being slow or down only costs hits: a lookup
//! that takes longer than `SHARED_LOOKUP_TIMEOUT` (50 ms) is a miss, and a failed call
//! (counted in `tailwarden_cache_backend_errors_total`) makes lookups fail fast for a second
//! rather than each waiting.
//!
//! The value is a small binary envelope, versioned so that a format change reads as a miss
//! rather than garbage: magic `TWC1`, status (u16), flags (bit 0: stream), content type
//! (u16 length + bytes), chunk count (u32), then each chunk (u32 length + bytes); integers
//! big-endian. Chunks are kept so a streamed hit replays the same SSE bytes.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};

use super::{
    exact::{CacheKey, Entry, SHARED_LOOKUP_TIMEOUT},
    redis::RedisBackend,
};

const MAGIC: &[u8; 4] = b"TWC1";
/// Largest value decoded: bounds what a corrupted or foreign key can make us allocate.
const MAX_VALUE_BYTES: usize = 64 << 20;

/// One route's view of the shared cache.
#[derive(Debug)]
pub struct SharedCache {
    backend: Arc<RedisBackend>,
    /// `tailwarden:cache:{route}:`, then the key's hex digest.
    prefix: String,
}

impl SharedCache {
    pub fn new(backend: Arc<RedisBackend>, route: &str) -> Self {
        Self {
            backend,
            prefix: format!("tailwarden:cache:{route}:"),
        }
    }

    /// The Redis connection (its state, its counters).
    pub fn backend(&self) -> &Arc<RedisBackend> {
        &self.backend
    }

    fn redis_key(&self, key: &CacheKey) -> String {
        format!("{}{}", self.prefix, key.hex())
    }

    /// The stored response, if another replica (or this one) stored it and it has not
    /// expired. Failures are misses.
    pub async fn get(&self, key: &CacheKey) -> Option<(Arc<Entry>, Duration)> {
        // The call runs as its own task: when the lookup gives up after
        // `SHARED_LOOKUP_TIMEOUT`, a connection being set up (or a slow answer) still
        // completes for the next request, instead of being abandoned every time.
        let backend = self.backend.clone();
        let redis_key = self.redis_key(key);
        let call = tokio::spawn(async move { backend.get_bytes(&redis_key).await });
        let (value, ttl) = tokio::time::timeout(SHARED_LOOKUP_TIMEOUT, call)
            .await
            .ok()?
            .ok()?
            .ok()??;
        if ttl.is_zero() {
            return None;
        }
        let entry = decode(&value, ttl)?;
        Some((entry, ttl))
    }

    /// Stores `entry` for `ttl` in the background.
    pub fn put(self: &Arc<Self>, key: &CacheKey, entry: &Entry, ttl: Duration) {
        let value = encode(entry);
        let redis_key = self.redis_key(key);
        let this = self.clone();
        tokio::spawn(async move {
            // A failure is counted and logged by the backend; the entry stays local only.
            let _ = this.backend.set_bytes(&redis_key, &value, ttl).await;
        });
    }
}

/// The envelope of a stored response (see the module doc).
pub fn encode(entry: &Entry) -> Vec<u8> {
    encode_parts(
        entry.status,
        entry.stream,
        entry.content_type.as_ref(),
        &entry.chunks,
    )
}

fn encode_parts(
    status: StatusCode,
    stream: bool,
    content_type: Option<&HeaderValue>,
    chunks: &[Bytes],
) -> Vec<u8> {
    let content_type = content_type.map(HeaderValue::as_bytes).unwrap_or_default();
    let content_type = &content_type[..content_type.len().min(u16::MAX as usize)];
    let body: usize = chunks.iter().map(Bytes::len).sum();
    let mut out = Vec::with_capacity(16 + content_type.len() + body + 4 * chunks.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&status.as_u16().to_be_bytes());
    out.push(u8::from(stream));
    out.extend_from_slice(&(content_type.len() as u16).to_be_bytes());
    out.extend_from_slice(content_type);
    out.extend_from_slice(&(chunks.len() as u32).to_be_bytes());
    for chunk in chunks {
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

/// Reads an envelope back; `None` for anything malformed, foreign, or not storable (a
/// non-2xx status, a stream that does not end cleanly).
pub fn decode(value: &[u8], ttl: Duration) -> Option<Arc<Entry>> {
    if value.len() > MAX_VALUE_BYTES {
        return None;
    }
    let mut r = Reader(value);
    if r.take(4)? != MAGIC {
        return None;
    }
    let status = StatusCode::from_u16(u16::from_be_bytes(r.array()?)).ok()?;
    let stream = match r.take(1)? {
        [0] => false,
        [1] => true,
        _ => return None,
    };
    let ct_len = u16::from_be_bytes(r.array()?) as usize;
    let content_type = match r.take(ct_len)? {
        [] => None,
        ct => Some(HeaderValue::from_bytes(ct).ok()?),
    };
    let count = u32::from_be_bytes(r.array()?) as usize;
    // Each chunk needs at least its 4-byte length: a count beyond that is corrupt.
    if count > r.0.len() / 4 {
        return None;
    }
    let mut chunks = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32::from_be_bytes(r.array()?) as usize;
        chunks.push(Bytes::copy_from_slice(r.take(len)?));
    }
    if !r.0.is_empty() {
        return None;
    }
    Entry::complete(status, content_type, chunks, stream, ttl)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn entry(stream: bool) -> Arc<Entry> {
        let chunks = if stream {
            vec![
                Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ]
        } else {
            vec![Bytes::from_static(b"{\"choices\":[]}")]
        };
        let ct = if stream {
            "text/event-stream"
        } else {
            "application/json"
        };
        Entry::complete(
            StatusCode::OK,
            Some(HeaderValue::from_static(ct)),
            chunks,
            stream,
            Duration::from_secs(60),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn round_trip_keeps_status_type_and_chunks() {
        for stream in [false, true] {
            let e = entry(stream);
            let back = decode(&encode(&e), Duration::from_secs(5)).unwrap();
            assert_eq!(back.status, e.status);
            assert_eq!(back.content_type, e.content_type);
            assert_eq!(back.chunks, e.chunks);
            assert_eq!(back.stream, stream);
        }
    }

    #[tokio::test]
    async fn malformed_values_are_misses() {
        let good = encode(&entry(true));
        assert!(decode(b"", Duration::from_secs(1)).is_none());
        assert!(decode(b"TWC2", Duration::from_secs(1)).is_none());
        // Every truncation, and trailing garbage.
        for cut in 0..good.len() {
            assert!(
                decode(&good[..cut], Duration::from_secs(1)).is_none(),
                "{cut}"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert!(decode(&long, Duration::from_secs(1)).is_none());
        // A huge chunk count with no chunks behind it allocates nothing.
        let mut lying = good[..good.len()].to_vec();
        let count_at = 4 + 2 + 1 + 2 + "text/event-stream".len();
        lying[count_at..count_at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&lying, Duration::from_secs(1)).is_none());
    }

    #[tokio::test]
    async fn errors_and_streams_that_did_not_end_cleanly_are_refused() {
        let e = entry(true);
        let ct = e.content_type.as_ref();
        let cut = &e.chunks[..1];
        let partial = encode_parts(StatusCode::OK, true, ct, cut);
        assert!(decode(&partial, Duration::from_secs(1)).is_none());
        let error = encode_parts(StatusCode::INTERNAL_SERVER_ERROR, false, ct, &e.chunks);
        assert!(decode(&error, Duration::from_secs(1)).is_none());
    }
}
