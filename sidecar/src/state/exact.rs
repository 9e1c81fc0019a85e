//! The exact-match response cache: identical deterministic requests get the stored answer,
//! streams included.
//!
//! **Key.** [`tailwarden_decide::cache_key`]: SHA-256 of the canonical form of everything that
//! can change the answer, defaults and members that cannot change it left out.
//!
//! **What is cached.** Only deterministic requests — `temperature: 0`, embeddings — unless
//! the route sets `deterministicOnly: false` or the client sends `x-tailwarden-cache: force`.
//! `x-tailwarden-cache: bypass` or `Cache-Control: no-cache` skips the lookup (the fresh
//! answer still refreshes the entry); `Cache-Control: no-store` skips both. Only complete 2xx
//! responses are stored: a [`Fill`] watching the response body commits when the response
//! ended cleanly, and a stream must also end with `data: [DONE]` and carry no error event.
//!
//! **Store.** `quick_cache` (S3-FIFO: scan-resistant, hit rates on par with TinyLFU),
//! weighted by bytes. Eviction happens inline on insert, so the byte bound holds at every
//! moment and tests are deterministic (no background maintenance, unlike moka), and its
//! dependency tree is small. Entries are bounded by count *and* bytes with one weight:
//! each entry weighs `max(its bytes, maxBytes / maxEntries)` against a capacity of
//! `maxBytes`, which implies both bounds. The TTL is checked on read against an injectable
//! clock (`tokio::time::Instant`, so tests use paused time); expired entries are dropped
//! when read and otherwise age out by eviction.
//!
//! **Streams** are stored as the exact chunks the client received and replayed as the same
//! chunks by [`crate::relay::ReplayBody`], so a streamed hit is byte-for-byte the same SSE
//! events.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use quick_cache::{DefaultHashBuilder, OptionsBuilder, Weighter, sync::Cache};
use tailwarden_crds::CacheScope;
use tokio::time::Instant;

use tailwarden_decide::{
    cache_key::{self, KeyScope, clean_sse},
    request::RequestBody,
    semantic::tenant_of,
};

use super::{
    Registry,
    fill::{Fill, Sink},
    redis::{BackendError, BackendSettings, RedisBackend, RedisTarget},
    shared::SharedCache,
};
use crate::relay::ReplayBody;

pub use tailwarden_decide::cache_key::{CacheKey, Directive, NotCacheable};

/// Longest wait for the shared store (`backend: redis`): past it a lookup is a miss, which
/// costs a provider call, so it is short; a healthy Redis answers in well under 1 ms.
pub const SHARED_LOOKUP_TIMEOUT: Duration = Duration::from_millis(50);

/// Largest single entry: bigger responses are not cached (their [`Fill`] abandons them).
pub const MAX_ENTRY_BYTES: usize = 8 << 20;

/// A stored response.
#[derive(Debug)]
pub struct Entry {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
    /// The body as the client received it: one chunk for a plain response, the relayed
    /// chunks of a stream.
    pub chunks: Vec<Bytes>,
    pub stream: bool,
    pub stored_at: Instant,
    expires_at: Instant,
    bytes: usize,
}

impl Entry {
    /// Body bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The whole body in one piece (non-stream replay).
    pub fn body(&self) -> Bytes {
        if let [one] = self.chunks.as_slice() {
            return one.clone();
        }
        let mut out = Vec::with_capacity(self.bytes);
        for c in &self.chunks {
            out.extend_from_slice(c);
        }
        Bytes::from(out)
    }

    /// Seconds since it was stored, for an `Age` header.
    pub fn age(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.stored_at).as_secs()
    }

    /// A complete response recorded outside this cache (the semantic cache keeps its own
    /// index), or `None` when it must not be stored: by the same rules as
    /// [`Fill::commit`], only 2xx responses, and streams ending cleanly with `[DONE]`.
    pub fn complete(
        status: StatusCode,
        content_type: Option<HeaderValue>,
        chunks: Vec<Bytes>,
        stream: bool,
        ttl: Duration,
    ) -> Option<Arc<Self>> {
        if !status.is_success() || (stream && !clean_sse(&chunks)) {
            return None;
        }
        let now = Instant::now();
        let bytes = chunks.iter().map(Bytes::len).sum();
        Some(Arc::new(Self {
            status,
            content_type,
            chunks,
            stream,
            stored_at: now,
            expires_at: now + ttl,
            bytes,
        }))
    }

    /// A body that yields the stored chunks one by one.
    pub fn replay(self: &Arc<Self>) -> ReplayBody {
        ReplayBody::new(self.chunks.iter().cloned().collect())
    }
}

/// Weighs an entry by its bytes, never below one "slot" (`maxBytes / maxEntries`), which
/// bounds the entry count by the same capacity.
#[derive(Debug, Clone, Copy)]
struct ByBytes {
    slot: u64,
}

/// Key and bookkeeping overhead counted per entry.
const ENTRY_OVERHEAD: u64 = 160;

impl Weighter<[u8; 32], Arc<Entry>> for ByBytes {
    fn weight(&self, _key: &[u8; 32], val: &Arc<Entry>) -> u64 {
        (val.bytes as u64 + ENTRY_OVERHEAD).max(self.slot)
    }
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub stores: AtomicU64,
    /// Fills dropped: too large, not a clean 2xx, a truncated or failed stream.
    pub abandoned: AtomicU64,
    pub expired: AtomicU64,
}

/// Settings of one route's cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSettings {
    pub ttl: Duration,
    pub max_entries: u64,
    pub max_bytes: u64,
    pub scope: CacheScope,
    pub deterministic_only: bool,
    /// Header naming the tenant (the route's `rateLimit.tenantHeader`).
    pub tenant_header: Option<http::HeaderName>,
    /// The Redis server shared by the route's replicas (`backend: redis`), or why its
    /// address is unusable.
    pub shared: Option<Result<RedisTarget, BackendError>>,
}

impl CacheSettings {
    pub fn from_spec(spec: &tailwarden_crds::ExactCache, tenant_header: Option<&str>) -> Self {
        Self {
            ttl: spec.ttl.get(),
            max_entries: spec.max_entries.max(1),
            max_bytes: spec.max_bytes.get().max(1),
            scope: spec.scope,
            deterministic_only: spec.deterministic_only,
            tenant_header: tenant_header
                .and_then(|h| http::HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).ok()),
            shared: match (spec.backend, &spec.redis) {
                (tailwarden_crds::Backend::Redis, Some(redis)) => {
                    Some(RedisTarget::of_cache(redis))
                }
                _ => None,
            },
        }
    }
}

/// One route's exact cache.
pub struct ExactCache {
    route: String,
    settings: CacheSettings,
    max_entry_bytes: usize,
    store: Cache<[u8; 32], Arc<Entry>, ByBytes, DefaultHashBuilder>,
    stats: CacheStats,
    /// The replicas' shared store behind this one (`backend: redis`).
    shared: Option<Arc<SharedCache>>,
}

impl std::fmt::Debug for ExactCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExactCache({})", self.route)
    }
}

impl ExactCache {
    pub fn new(route: &str, settings: CacheSettings) -> Arc<Self> {
        let max_bytes = settings.max_bytes;
        let max_entry_bytes = usize::try_from((max_bytes / 16).max(1))
            .unwrap_or(usize::MAX)
            .min(MAX_ENTRY_BYTES);
        // quick_cache splits the capacity between shards; keep every shard able to hold at
        // least four of the largest entries.
        let mut shards = (max_bytes / (4 * max_entry_bytes as u64)).clamp(1, 16);
        shards = 1 << (63 - shards.leading_zeros());
        let slot = (max_bytes / settings.max_entries).max(1);
        let options = OptionsBuilder::new()
            .estimated_items_capacity(usize::try_from(settings.max_entries).unwrap_or(usize::MAX))
            .weight_capacity(max_bytes)
            .shards(shards as usize)
            .build();
        let store = match options {
            Ok(options) => Cache::with_options(
                options,
                ByBytes { slot },
                DefaultHashBuilder::default(),
                Default::default(),
            ),
            // The options are all set above; fall back to the plain constructor regardless.
            Err(_) => Cache::with(
                usize::try_from(settings.max_entries).unwrap_or(usize::MAX),
                max_bytes,
                ByBytes { slot },
                DefaultHashBuilder::default(),
                Default::default(),
            ),
        };
        Arc::new(Self {
            route: route.to_owned(),
            settings,
            max_entry_bytes,
            store,
            stats: CacheStats::default(),
            shared: None,
        })
    }

    /// This cache in front of the replicas' shared store.
    pub fn with_shared(
        route: &str,
        settings: CacheSettings,
        shared: Arc<SharedCache>,
    ) -> Arc<Self> {
        let mut cache = Self::new(route, settings);
        if let Some(c) = Arc::get_mut(&mut cache) {
            c.shared = Some(shared);
        }
        cache
    }

    /// The replicas' shared store behind this cache, if the route has one.
    pub fn shared(&self) -> Option<&Arc<SharedCache>> {
        self.shared.as_ref()
    }

    /// On a local miss: the replicas' shared store, if the route has one. A hit there is
    /// kept locally for the rest of its time to live.
    pub async fn get_shared(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        if !key.read {
            return None;
        }
        let shared = self.shared.as_ref()?;
        let (entry, _ttl) = shared.get(key).await?;
        if entry.len() <= self.max_entry_bytes {
            self.store.insert(key.digest(), entry.clone());
        }
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        Some(entry)
    }

    pub fn settings(&self) -> &CacheSettings {
        &self.settings
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Largest response stored.
    pub fn max_entry_bytes(&self) -> usize {
        self.max_entry_bytes
    }

    /// Entries and their total weight (bytes, with each entry counted at least one slot).
    pub fn usage(&self) -> (usize, u64) {
        (self.store.len(), self.store.weight())
    }

    /// The key of a request to `endpoint` (`/chat/completions`, …) for `model` (after tier
    /// choice), or why it is not cached.
    pub fn key(
        &self,
        body: &RequestBody<'_>,
        endpoint: &str,
        model: &str,
        headers: &HeaderMap,
    ) -> Result<CacheKey, NotCacheable> {
        let tenant = tenant_of(
            self.settings.scope,
            self.settings.tenant_header.as_ref(),
            headers,
        );
        cache_key::key(
            &KeyScope {
                route: &self.route,
                tenant,
                endpoint,
                model,
                deterministic_only: self.settings.deterministic_only,
            },
            body,
            headers,
        )
    }

    /// The stored response, if fresh. Misses are counted only for readable keys.
    pub fn get(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        if !key.read {
            return None;
        }
        let found = self.store.get(&key.digest());
        match found {
            Some(entry) if Instant::now() < entry.expires_at => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                Some(entry)
            }
            Some(_) => {
                self.store.remove(&key.digest());
                self.stats.expired.fetch_add(1, Ordering::Relaxed);
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
            None => {
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Starts recording a response for `key`; `None` when it cannot be stored (not a 2xx).
    pub fn fill(
        self: &Arc<Self>,
        key: &CacheKey,
        status: StatusCode,
        headers: &HeaderMap,
        stream: bool,
    ) -> Option<Fill> {
        Fill::new(
            status,
            headers,
            stream,
            Sink::Exact {
                cache: self.clone(),
                digest: key.digest(),
            },
        )
    }

    /// Stores a complete response recorded by a [`Fill`] (here and, with `backend: redis`,
    /// in the replicas' shared store).
    pub(crate) fn put(&self, digest: [u8; 32], entry: Arc<Entry>) {
        if let Some(shared) = &self.shared {
            shared.put(
                &CacheKey::from_digest(digest, true),
                &entry,
                self.settings.ttl,
            );
        }
        self.store.insert(digest, entry);
        self.stats.stores.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a response recorded for this cache that was not stored.
    pub(crate) fn abandoned(&self) {
        self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
    }
}

/// Route caches kept across config reloads: a route whose cache settings did not change
/// keeps its entries.
#[derive(Default)]
pub struct Caches {
    routes: Registry<String, CacheSettings, Arc<ExactCache>>,
    /// Redis connections of shared caches, by server and credentials' sources.
    backends: Registry<RedisTarget, (), Arc<RedisBackend>>,
    errors_counter: Option<prometheus::IntCounterVec>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Caches")
    }
}

impl Caches {
    /// `errors_counter` counts failed calls to shared-cache backends.
    pub fn new(errors_counter: Option<prometheus::IntCounterVec>) -> Self {
        Self {
            errors_counter,
            ..Self::default()
        }
    }

    /// The cache of a route, reused when its settings are unchanged; `None` when disabled.
    /// `tenant_header` is the route's `rateLimit.tenantHeader` (for the `tenant` scope).
    pub fn for_route(
        &self,
        route: &str,
        spec: &tailwarden_crds::ExactCache,
        tenant_header: Option<&str>,
    ) -> Result<Option<Arc<ExactCache>>, BackendError> {
        let key = route.to_owned();
        if !spec.enabled {
            self.routes.remove(&key);
            return Ok(None);
        }
        let settings = CacheSettings::from_spec(spec, tenant_header);
        self.routes
            .get_or_try_build(&key, &settings, || {
                Ok(match &settings.shared {
                    None => ExactCache::new(route, settings.clone()),
                    Some(target) => {
                        let target = target.clone()?;
                        let backend = self.backends.get_or_try_build(&target, &(), || {
                            Ok::<_, BackendError>(Arc::new(RedisBackend::with_target(
                                target.clone(),
                                BackendSettings::default(),
                                self.errors_counter.clone(),
                            )))
                        })?;
                        let shared = Arc::new(SharedCache::new(backend, route));
                        ExactCache::with_shared(route, settings.clone(), shared)
                    }
                })
            })
            .map(Some)
    }

    /// Forgets routes no longer in the config.
    pub fn retain(&self, routes: &[&str]) {
        self.routes.retain(|name| routes.contains(&name.as_str()));
    }
}
