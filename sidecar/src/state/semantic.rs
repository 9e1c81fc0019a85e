//! The semantic cache's store and its embeddings call: a request that asks what an earlier
//! one asked, in other words, gets the earlier answer — opt-in per route, strict by default,
//! and never across a "not".
//!
//! What is compared, the exact partition around it and the guards that refuse a near match
//! that would flip the answer are decisions, in [`tailwarden_decide::semantic`]; this module
//! keeps the entries and asks the provider for embeddings.
//!
//! **Store.** Per route, entries live in partitions (tenant + partition key); a lookup
//! compares the query embedding with every live entry of its partition (brute force over
//! unit vectors: a dot product each). Entries are bounded by `maxEntries` and `maxBytes`
//! (responses plus embeddings) overall; the oldest go first, which with one TTL per route is
//! also the entry closest to expiring. Expired entries are skipped on lookup and dropped
//! when the next insert runs, so lookups only take a read lock. Responses are stored as the
//! exact cache's [`Entry`] and replayed with its [`crate::relay::ReplayBody`], streams
//! byte-for-byte.
//!
//! **Embeddings** come from `crate::attempts::embed`: `POST {baseUrl}/embeddings` to the
//! configured provider through the same upstream call as every attempt, bounded by the
//! route's `timeout`; any failure means the request simply goes upstream without the
//! semantic cache.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use http::{HeaderMap, HeaderName, StatusCode};
use tailwarden_crds::{CacheScope, InferenceRouteSpec};
use tokio::time::Instant;

use tailwarden_decide::{
    request::RequestBody,
    semantic::{self, Features, NotComparable, PartitionKey, tenant_of},
};

use super::{
    Registry,
    exact::{Entry, MAX_ENTRY_BYTES},
    fill::{Fill, Sink},
};

pub use tailwarden_decide::semantic::{
    Embedding, GuardRefusal, MAX_DIMENSIONS, MAX_PROMPT_BYTES, Query, cosine,
};

/// `x-tailwarden-cache` value of a response served by the semantic cache.
pub const HIT_HEADER_VALUE: &str = "semantic-hit";
/// Response header with the similarity of a semantic hit (`0.9431`).
pub const SIMILARITY_HEADER: &str = "x-tailwarden-cache-similarity";
/// Near matches checked against the guards per lookup, best first.
const MAX_CANDIDATES: usize = 8;
/// Float slack when comparing a similarity with the threshold (a threshold of 1 must let
/// the same text hit although its dot product with itself rounds to 0.99999994).
const SIMILARITY_EPSILON: f32 = 1e-5;
/// Similarity at or above which an insert replaces an entry with the same guard features
/// (two identical misses filled at once keep one entry).
const DUPLICATE_SIMILARITY: f32 = 0.9999;
/// Bookkeeping counted per entry besides its response and embedding.
const SLOT_OVERHEAD: u64 = 256;

// ---------------------------------------------------------------------------------------
// The engine: settings, store, lookup, fill.
// ---------------------------------------------------------------------------------------

/// Settings of one route's semantic cache.
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticSettings {
    pub threshold: f32,
    pub ttl: Duration,
    pub max_entries: usize,
    pub max_bytes: u64,
    pub scope: CacheScope,
    pub deterministic_only: bool,
    /// Header naming the tenant (the route's `rateLimit.tenantHeader`).
    pub tenant_header: Option<HeaderName>,
    /// The embeddings provider's name in the route.
    pub provider: String,
    /// Its base URL: pointing the same name at another service starts a fresh cache, since
    /// its vectors live in another space.
    pub provider_url: String,
    pub model: String,
    pub timeout: Duration,
}

impl SemanticSettings {
    /// The settings of a route, or `None` when its semantic cache is off (or incomplete,
    /// which validation already refuses).
    pub fn from_spec(spec: &InferenceRouteSpec) -> Option<Self> {
        let s = &spec.cache.semantic;
        if !s.enabled {
            return None;
        }
        let provider = s.embeddings_provider.as_ref()?;
        let model = s.embeddings_model.as_ref()?;
        let url = &spec
            .providers
            .iter()
            .find(|p| &p.name == provider)?
            .base_url;
        let threshold = s
            .threshold
            .as_str()
            .parse::<f32>()
            .ok()
            .filter(|t| *t > 0.0)
            .unwrap_or(0.92)
            .min(1.0);
        let tenant_header = spec
            .rate_limit
            .as_ref()
            .and_then(|r| r.tenant_header.as_deref())
            .and_then(|h| HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).ok());
        Some(Self {
            threshold,
            ttl: s.ttl.get(),
            max_entries: usize::try_from(s.max_entries.max(1)).unwrap_or(usize::MAX),
            max_bytes: s.max_bytes.get().max(1),
            scope: s.scope,
            deterministic_only: s.deterministic_only,
            tenant_header,
            provider: provider.clone(),
            provider_url: url.clone(),
            model: model.clone(),
            timeout: s.timeout.get(),
        })
    }
}

/// The result of a lookup.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// Serve this entry (replay it with [`Entry::replay`]).
    Hit { similarity: f32, entry: Arc<Entry> },
    /// Nothing similar enough.
    Miss,
    /// Similar enough, but the guards refused the best match (and every other one).
    Refused {
        similarity: f32,
        reason: GuardRefusal,
    },
}

impl Lookup {
    /// A metric label: `hit`, `miss` or `refused`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Hit { .. } => "hit",
            Self::Miss => "miss",
            Self::Refused { .. } => "refused",
        }
    }
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct SemanticStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Near matches the guards refused.
    pub refused: AtomicU64,
    pub stores: AtomicU64,
    /// Fills dropped: too large, not a clean 2xx, a truncated or failed stream.
    pub abandoned: AtomicU64,
    pub evicted: AtomicU64,
    pub expired: AtomicU64,
}

struct Slot {
    seq: u64,
    embedding: Embedding,
    features: Features,
    entry: Arc<Entry>,
    expires_at: Instant,
    weight: u64,
}

#[derive(Default)]
struct Store {
    partitions: HashMap<PartitionKey, Vec<Slot>>,
    /// Insertion order (= expiry order: one TTL per store): (seq, partition, expiry).
    order: VecDeque<(u64, PartitionKey, Instant)>,
    next_seq: u64,
    len: usize,
    weight: u64,
}

impl Store {
    fn take_slot(&mut self, partition: &PartitionKey, seq: u64) -> bool {
        let Some(slots) = self.partitions.get_mut(partition) else {
            return false;
        };
        let Some(i) = slots.iter().position(|s| s.seq == seq) else {
            return false;
        };
        let slot = slots.swap_remove(i);
        if slots.is_empty() {
            self.partitions.remove(partition);
        }
        self.len -= 1;
        self.weight -= slot.weight;
        true
    }

    fn remove(&mut self, partition: &PartitionKey, seq: u64) {
        if self.take_slot(partition, seq)
            && let Some(k) = self.order.iter().position(|(s, _, _)| *s == seq)
        {
            self.order.remove(k);
        }
    }

    fn pop_oldest(&mut self) -> bool {
        match self.order.pop_front() {
            Some((seq, partition, _)) => self.take_slot(&partition, seq),
            None => false,
        }
    }
}

/// One route's semantic cache.
pub struct SemanticCache {
    route: String,
    settings: SemanticSettings,
    max_entry_bytes: usize,
    store: RwLock<Store>,
    stats: SemanticStats,
}

impl std::fmt::Debug for SemanticCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SemanticCache({})", self.route)
    }
}

impl SemanticCache {
    pub fn new(route: &str, settings: SemanticSettings) -> Arc<Self> {
        let max_entry_bytes = usize::try_from((settings.max_bytes / 16).max(1))
            .unwrap_or(usize::MAX)
            .min(MAX_ENTRY_BYTES);
        Arc::new(Self {
            route: route.to_owned(),
            settings,
            max_entry_bytes,
            store: RwLock::new(Store::default()),
            stats: SemanticStats::default(),
        })
    }

    pub fn settings(&self) -> &SemanticSettings {
        &self.settings
    }

    pub fn stats(&self) -> &SemanticStats {
        &self.stats
    }

    /// Largest response stored.
    pub fn max_entry_bytes(&self) -> usize {
        self.max_entry_bytes
    }

    /// Entries and their total weight in bytes (expired ones included until the next insert).
    pub fn usage(&self) -> (usize, u64) {
        let store = self.store.read().unwrap_or_else(|p| p.into_inner());
        (store.len, store.weight)
    }

    /// Prepares a request to `endpoint` (`/chat/completions`, `/completions`) for `model`
    /// (after tier choice), or says why it does not use the semantic cache.
    pub fn query(
        &self,
        body: &RequestBody<'_>,
        endpoint: &str,
        model: &str,
        headers: &HeaderMap,
    ) -> Result<Query, NotComparable> {
        let tenant = tenant_of(
            self.settings.scope,
            self.settings.tenant_header.as_ref(),
            headers,
        );
        semantic::query(
            body,
            endpoint,
            model,
            tenant,
            self.settings.deterministic_only,
            headers,
        )
    }

    /// The best live entry of the query's partition with a similarity at or above the
    /// threshold whose guards agree. Counts hits, misses and refusals (not for unreadable
    /// queries, which always miss).
    pub fn lookup(&self, query: &Query, embedding: &Embedding) -> Lookup {
        if !query.read {
            return Lookup::Miss;
        }
        let now = Instant::now();
        let threshold = self.settings.threshold - SIMILARITY_EPSILON;
        let result = {
            let store = self.store.read().unwrap_or_else(|p| p.into_inner());
            let mut near: Vec<(f32, &Slot)> = store
                .partitions
                .get(&query.partition)
                .map(|slots| {
                    slots
                        .iter()
                        .filter(|s| s.expires_at > now)
                        .map(|s| (s.embedding.similarity(embedding), s))
                        .filter(|(sim, _)| *sim >= threshold)
                        .collect()
                })
                .unwrap_or_default();
            near.sort_by(|a, b| b.0.total_cmp(&a.0));
            let mut refused = None;
            let mut hit = None;
            for (similarity, slot) in near.into_iter().take(MAX_CANDIDATES) {
                match query.features().allow(&slot.features) {
                    Ok(()) => {
                        hit = Some(Lookup::Hit {
                            similarity: similarity.min(1.0),
                            entry: slot.entry.clone(),
                        });
                        break;
                    }
                    Err(reason) if refused.is_none() => {
                        refused = Some(Lookup::Refused {
                            similarity: similarity.min(1.0),
                            reason,
                        });
                    }
                    Err(_) => {}
                }
            }
            hit.or(refused).unwrap_or(Lookup::Miss)
        };
        let counter = match &result {
            Lookup::Hit { .. } => &self.stats.hits,
            Lookup::Miss => &self.stats.misses,
            Lookup::Refused { .. } => &self.stats.refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// Stores a response for the query. Returns whether it was stored (not when it alone
    /// exceeds the per-entry limit, or the embedding has another dimension count than the
    /// entries it would be compared with — a model change rebuilds the cache anyway).
    pub fn insert(&self, query: &Query, embedding: &Embedding, entry: Arc<Entry>) -> bool {
        let weight = entry.len() as u64
            + 4 * embedding.dims() as u64
            + query.features().weight()
            + SLOT_OVERHEAD;
        if entry.len() > self.max_entry_bytes || weight > self.settings.max_bytes {
            self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let now = Instant::now();
        let mut store = self.store.write().unwrap_or_else(|p| p.into_inner());
        // Expired entries are at the front: drop them first.
        while store.order.front().is_some_and(|(_, _, at)| *at <= now) {
            if store.pop_oldest() {
                self.stats.expired.fetch_add(1, Ordering::Relaxed);
            }
        }
        // An entry this query would certainly hit is replaced, not duplicated.
        let duplicates: Vec<u64> = store
            .partitions
            .get(&query.partition)
            .map(|slots| {
                slots
                    .iter()
                    .filter(|s| {
                        s.features == *query.features()
                            && s.embedding.similarity(embedding) >= DUPLICATE_SIMILARITY
                    })
                    .map(|s| s.seq)
                    .collect()
            })
            .unwrap_or_default();
        for seq in duplicates {
            store.remove(&query.partition, seq);
        }
        let seq = store.next_seq;
        store.next_seq += 1;
        let expires_at = now + self.settings.ttl;
        store
            .partitions
            .entry(query.partition)
            .or_default()
            .push(Slot {
                seq,
                embedding: embedding.clone(),
                features: query.features().clone(),
                entry,
                expires_at,
                weight,
            });
        store.order.push_back((seq, query.partition, expires_at));
        store.len += 1;
        store.weight += weight;
        while store.len > self.settings.max_entries || store.weight > self.settings.max_bytes {
            if !store.pop_oldest() {
                break;
            }
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.stores.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Starts recording the response to a query whose embedding is known; `None` when it
    /// cannot be stored (not a 2xx).
    pub fn fill(
        self: &Arc<Self>,
        query: &Query,
        embedding: &Embedding,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> Option<Fill> {
        Fill::new(
            status,
            headers,
            query.stream,
            Sink::Semantic {
                cache: self.clone(),
                query: query.clone(),
                embedding: embedding.clone(),
            },
        )
    }

    /// Counts a response recorded for this cache that was not stored.
    pub(crate) fn abandoned(&self) {
        self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
    }
}

/// Semantic caches kept across config reloads: a route whose settings did not change keeps
/// its entries; a changed threshold, model, provider URL, bound or scope starts afresh.
#[derive(Default)]
pub struct SemanticCaches {
    routes: Registry<String, SemanticSettings, Arc<SemanticCache>>,
}

impl std::fmt::Debug for SemanticCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SemanticCaches")
    }
}

impl SemanticCaches {
    /// The semantic cache of a route (its qualified name), reused when its settings are
    /// unchanged; `None` when disabled.
    pub fn for_route(&self, route: &str, spec: &InferenceRouteSpec) -> Option<Arc<SemanticCache>> {
        let key = route.to_owned();
        let Some(settings) = SemanticSettings::from_spec(spec) else {
            self.routes.remove(&key);
            return None;
        };
        Some(self.routes.get_or_build(&key, &settings, || {
            SemanticCache::new(route, settings.clone())
        }))
    }

    /// Forgets routes no longer in the config.
    pub fn retain(&self, routes: &[&str]) {
        self.routes.retain(|name| routes.contains(&name.as_str()));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::HeaderValue;

    /// A deterministic bag-of-words embedding: each lowercase word hashed (FNV-1a) into one
    /// of 1536 dimensions. Two texts that differ by one extra word out of seven have a
    /// cosine of 6/√42 ≈ 0.926 — above the default threshold, as real embeddings of a
    /// negated question are.
    fn bow(text: &str) -> Embedding {
        let mut v = vec![0f32; 1536];
        for word in text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in word.to_lowercase().bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            v[(h % 1536) as usize] += 1.0;
        }
        Embedding::new(v).unwrap()
    }

    fn settings() -> SemanticSettings {
        SemanticSettings {
            threshold: 0.92,
            ttl: Duration::from_secs(60),
            max_entries: 100,
            max_bytes: 16 << 20,
            scope: CacheScope::Tenant,
            deterministic_only: true,
            tenant_header: Some(HeaderName::from_static("x-tenant-id")),
            provider: "emb".into(),
            provider_url: "http://127.0.0.1:1/v1".into(),
            model: "text-embedding-3-small".into(),
            timeout: Duration::from_secs(2),
        }
    }

    fn chat(question: &str) -> String {
        serde_json::json!({"model": "gpt-4.1", "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question}]})
        .to_string()
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn query_of(cache: &SemanticCache, body: &str, h: &HeaderMap) -> Query {
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        cache
            .query(&parsed, "/chat/completions", "gpt-4.1", h)
            .unwrap()
    }

    fn answer(text: &str) -> Arc<Entry> {
        Entry::complete(
            StatusCode::OK,
            Some(HeaderValue::from_static("application/json")),
            vec![Bytes::from(format!(r#"{{"answer":"{text}"}}"#))],
            false,
            Duration::from_secs(60),
        )
        .unwrap()
    }

    /// Stores `question` → `reply` and returns the query used.
    fn store(cache: &SemanticCache, question: &str, reply: &str) -> Query {
        let q = query_of(cache, &chat(question), &HeaderMap::new());
        assert!(cache.insert(&q, &bow(&q.text), answer(reply)));
        q
    }

    fn ask(cache: &SemanticCache, question: &str) -> Lookup {
        ask_with(cache, question, &HeaderMap::new())
    }

    fn ask_with(cache: &SemanticCache, question: &str, h: &HeaderMap) -> Lookup {
        let q = query_of(cache, &chat(question), h);
        cache.lookup(&q, &bow(&q.text))
    }

    fn hit_body(l: &Lookup) -> Option<String> {
        match l {
            Lookup::Hit { entry, .. } => Some(String::from_utf8_lossy(&entry.body()).into_owned()),
            _ => None,
        }
    }

    #[test]
    fn requests_that_cannot_be_compared_say_why() {
        let cache = SemanticCache::new("shop/chat", settings());
        let why = |body: &str, endpoint: &str, h: &HeaderMap| {
            let parsed = RequestBody::parse(body.as_bytes()).unwrap();
            cache.query(&parsed, endpoint, "gpt-4.1", h).err()
        };
        let none = HeaderMap::new();
        let user = r#"{"role":"user","content":"What is the weather in Paris?"}"#;
        let cases: Vec<(String, &str, HeaderMap, NotComparable)> = vec![
            (
                format!(
                    r#"{{"model":"m","temperature":0,"tools":[{{"type":"function","function":{{"name":"w"}}}}],"messages":[{user}]}}"#
                ),
                "/chat/completions",
                none.clone(),
                NotComparable::Tools,
            ),
            (
                format!(
                    r#"{{"model":"m","temperature":0,"messages":[{{"role":"assistant","tool_calls":[]}},{{"role":"tool","content":"x"}},{user}]}}"#
                ),
                "/chat/completions",
                none.clone(),
                NotComparable::Tools,
            ),
            (
                format!(
                    r#"{{"model":"m","temperature":0,"messages":[{{"role":"user","content":[{{"type":"input_audio"}}]}},{user}]}}"#
                ),
                "/chat/completions",
                none.clone(),
                NotComparable::NonText,
            ),
            (
                format!(r#"{{"model":"m","messages":[{user}]}}"#),
                "/chat/completions",
                none.clone(),
                NotComparable::NotDeterministic,
            ),
            (
                format!(r#"{{"model":"m","temperature":0.7,"messages":[{user}]}}"#),
                "/chat/completions",
                none.clone(),
                NotComparable::NotDeterministic,
            ),
            (
                format!(r#"{{"model":"m","temperature":0,"messages":[{user}]}}"#),
                "/embeddings",
                none.clone(),
                NotComparable::Endpoint,
            ),
            (
                format!(r#"{{"model":"m","temperature":0,"messages":[{user}]}}"#),
                "/chat/completions",
                headers(&[("cache-control", "no-store")]),
                NotComparable::NoStore,
            ),
            (
                chat(&"word ".repeat(2000)),
                "/chat/completions",
                none.clone(),
                NotComparable::TooLong,
            ),
        ];
        for (body, endpoint, h, want) in cases {
            assert_eq!(why(&body, endpoint, &h), Some(want), "{body}");
        }
        // force makes a non-deterministic request comparable; bypass keeps it but unreadable.
        let body = format!(r#"{{"model":"m","temperature":0.7,"messages":[{user}]}}"#);
        assert_eq!(
            why(
                &body,
                "/chat/completions",
                &headers(&[("x-tailwarden-cache", "force")])
            ),
            None
        );
        let body = chat("hi");
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let q = cache
            .query(
                &parsed,
                "/chat/completions",
                "m",
                &headers(&[("x-tailwarden-cache", "bypass")]),
            )
            .unwrap();
        assert!(!q.read);
        assert!(matches!(cache.lookup(&q, &bow("hi")), Lookup::Miss));
        assert_eq!(
            cache.stats().misses.load(Ordering::Relaxed),
            0,
            "unreadable lookups are not counted"
        );
    }

    #[test]
    fn a_paraphrase_hits_and_a_negation_is_refused() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "Is Paris the capital of France?", "yes");
        let hit = ask(&cache, "is paris the capital of france");
        assert_eq!(hit_body(&hit).as_deref(), Some(r#"{"answer":"yes"}"#));
        match ask(&cache, "Is Paris not the capital of France?") {
            Lookup::Refused { similarity, reason } => {
                assert!(similarity > 0.92, "{similarity}");
                assert_eq!(reason, GuardRefusal::Negation);
            }
            other => panic!("wanted a refusal, got {other:?}"),
        }
        assert!(matches!(
            ask(&cache, "How tall is the Eiffel Tower?"),
            Lookup::Miss
        ));
        let s = cache.stats();
        assert_eq!(
            [&s.hits, &s.refused, &s.misses].map(|c| c.load(Ordering::Relaxed)),
            [1, 1, 1]
        );
    }

    #[test]
    fn a_refused_best_match_does_not_hide_a_good_second_one() {
        let cache = SemanticCache::new(
            "shop/chat",
            SemanticSettings {
                threshold: 0.85,
                ..settings()
            },
        );
        store(&cache, "Is Paris not the capital of France?", "no");
        store(&cache, "Is Paris the capital city of France please?", "yes");
        let got = ask(&cache, "Is Paris the capital of France?");
        assert_eq!(
            hit_body(&got).as_deref(),
            Some(r#"{"answer":"yes"}"#),
            "{got:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn entries_expire_after_the_ttl() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "What is the capital of France?", "Paris");
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(matches!(
            ask(&cache, "what is the capital of france?"),
            Lookup::Hit { .. }
        ));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(matches!(
            ask(&cache, "what is the capital of france?"),
            Lookup::Miss
        ));
        // The next insert drops the expired entry.
        assert_eq!(cache.usage().0, 1);
        store(&cache, "How tall is the Eiffel Tower?", "330 m");
        assert_eq!(cache.usage().0, 1);
        assert_eq!(cache.stats().expired.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_oldest_entries_are_evicted_first() {
        let cache = SemanticCache::new(
            "shop/chat",
            SemanticSettings {
                max_entries: 3,
                ..settings()
            },
        );
        let questions = [
            "What is the capital of France?",
            "How tall is the Eiffel Tower?",
            "Who wrote Hamlet?",
            "What is the boiling point of water?",
        ];
        for q in questions {
            store(&cache, q, q);
        }
        assert_eq!(cache.usage().0, 3);
        assert!(matches!(ask(&cache, questions[0]), Lookup::Miss));
        for q in &questions[1..] {
            assert!(matches!(ask(&cache, q), Lookup::Hit { .. }), "{q}");
        }
        assert_eq!(cache.stats().evicted.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_byte_bound_holds() {
        // Each entry weighs its 1536 × 4 bytes of embedding plus a small answer.
        let max_bytes = 14_000;
        let cache = SemanticCache::new(
            "shop/chat",
            SemanticSettings {
                max_bytes,
                ..settings()
            },
        );
        for q in [
            "Who wrote Hamlet?",
            "Who painted the Mona Lisa?",
            "Who built the Eiffel Tower?",
            "Who discovered penicillin?",
        ] {
            store(&cache, q, "someone");
            assert!(cache.usage().1 <= max_bytes);
        }
        assert_eq!(cache.usage().0, 2);
        assert!(matches!(ask(&cache, "Who wrote Hamlet?"), Lookup::Miss));
        assert!(matches!(
            ask(&cache, "Who discovered penicillin?"),
            Lookup::Hit { .. }
        ));
        // A response over the per-entry limit (max_bytes / 16) is not stored.
        let q = query_of(&cache, &chat("Big?"), &HeaderMap::new());
        let big = Entry::complete(
            StatusCode::OK,
            None,
            vec![Bytes::from(vec![b'x'; 2000])],
            false,
            Duration::from_secs(60),
        )
        .unwrap();
        assert!(!cache.insert(&q, &bow("Big?"), big));
    }

    #[test]
    fn tenants_do_not_share_unless_the_scope_is_shared() {
        let acme = headers(&[("x-tenant-id", "acme")]);
        let globex = headers(&[("x-tenant-id", "globex")]);
        for (scope, shared) in [(CacheScope::Tenant, false), (CacheScope::Shared, true)] {
            let cache = SemanticCache::new(
                "shop/chat",
                SemanticSettings {
                    scope,
                    ..settings()
                },
            );
            let q = query_of(&cache, &chat("What is the capital of France?"), &acme);
            assert!(cache.insert(&q, &bow(&q.text), answer("Paris")));
            assert!(matches!(
                ask_with(&cache, "what is the capital of France", &acme),
                Lookup::Hit { .. }
            ));
            let other = ask_with(&cache, "what is the capital of France", &globex);
            assert_eq!(
                matches!(other, Lookup::Hit { .. }),
                shared,
                "{scope:?}: {other:?}"
            );
        }
    }

    #[test]
    fn partitions_are_never_compared() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "What is the capital of France?", "Paris");
        let other_system = serde_json::json!({"model": "gpt-4.1", "temperature": 0, "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "What is the capital of France?"}]})
        .to_string();
        let q = query_of(&cache, &other_system, &HeaderMap::new());
        assert!(matches!(cache.lookup(&q, &bow(&q.text)), Lookup::Miss));
        // Another model after tier choice.
        let body = chat("What is the capital of France?");
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let q = cache
            .query(
                &parsed,
                "/chat/completions",
                "gpt-4.1-mini",
                &HeaderMap::new(),
            )
            .unwrap();
        assert!(matches!(cache.lookup(&q, &bow(&q.text)), Lookup::Miss));
        // Another embedding size (another model's vector) never matches.
        let q = query_of(
            &cache,
            &chat("What is the capital of France?"),
            &HeaderMap::new(),
        );
        assert!(matches!(
            cache.lookup(&q, &Embedding::new(vec![1.0; 8]).unwrap()),
            Lookup::Miss
        ));
    }

    #[test]
    fn a_repeated_fill_replaces_its_entry() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "What is the capital of France?", "old");
        store(&cache, "What is the capital of France?", "new");
        assert_eq!(cache.usage().0, 1);
        assert_eq!(
            hit_body(&ask(&cache, "What is the capital of France?")).as_deref(),
            Some(r#"{"answer":"new"}"#)
        );
    }

    #[test]
    fn fills_store_only_clean_complete_responses() {
        let cache = SemanticCache::new("shop/chat", settings());
        let q = query_of(&cache, &chat("Who wrote Hamlet?"), &HeaderMap::new());
        let e = bow(&q.text);
        let json = headers(&[("content-type", "application/json")]);
        assert!(
            cache
                .fill(&q, &e, StatusCode::INTERNAL_SERVER_ERROR, &json)
                .is_none()
        );
        // Dropped without commit: nothing stored, counted as abandoned.
        let mut fill = cache.fill(&q, &e, StatusCode::OK, &json).unwrap();
        fill.push(&Bytes::from_static(b"{\"partial\""));
        drop(fill);
        assert_eq!(cache.usage().0, 0);
        assert_eq!(cache.stats().abandoned.load(Ordering::Relaxed), 1);
        // A stream without [DONE] is not stored; a clean one is, chunk for chunk.
        let sse = headers(&[("content-type", "text/event-stream")]);
        let body = serde_json::json!({"model": "gpt-4.1", "temperature": 0, "stream": true,
            "messages": [{"role": "user", "content": "Who wrote Hamlet?"}]})
        .to_string();
        let qs = query_of(&cache, &body, &HeaderMap::new());
        let chunk = Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Shakespeare\"}}]}\n\n",
        );
        let mut fill = cache.fill(&qs, &e, StatusCode::OK, &sse).unwrap();
        fill.push(&chunk);
        assert!(!fill.commit());
        let mut fill = cache.fill(&qs, &e, StatusCode::OK, &sse).unwrap();
        fill.push(&chunk);
        fill.push(&Bytes::from_static(b"data: [DONE]\n\n"));
        assert!(fill.commit());
        match cache.lookup(&qs, &e) {
            Lookup::Hit { entry, similarity } => {
                assert!(similarity > 0.999);
                assert!(entry.stream);
                assert_eq!(entry.chunks.len(), 2);
                assert_eq!(entry.chunks[0], chunk);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_registry_keeps_a_cache_while_its_settings_hold() {
        let yaml = |threshold: &str, enabled: bool| {
            format!(
                "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: shop}}\nspec:\n  models: ['*']\n  providers: [{{name: emb, baseUrl: 'http://127.0.0.1:1/v1'}}]\n  cache: {{semantic: {{enabled: {enabled}, embeddingsProvider: emb, embeddingsModel: e, threshold: '{threshold}'}}}}\n"
            )
        };
        let spec = |t: &str, on: bool| {
            tailwarden_crds::load_str("r.yaml", &yaml(t, on))
                .unwrap()
                .remove(0)
                .spec
        };
        let caches = SemanticCaches::default();
        let a = caches.for_route("shop/chat", &spec("0.92", true)).unwrap();
        assert_eq!(a.settings().threshold, 0.92);
        assert_eq!(a.settings().ttl, Duration::from_secs(300));
        assert_eq!(a.settings().max_entries, 1000);
        let b = caches.for_route("shop/chat", &spec("0.92", true)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = caches.for_route("shop/chat", &spec("0.95", true)).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert!(
            caches
                .for_route("shop/chat", &spec("0.95", false))
                .is_none()
        );
        let d = caches.for_route("shop/chat", &spec("0.95", true)).unwrap();
        assert!(!Arc::ptr_eq(&c, &d), "disabling forgets the entries");
        caches.retain(&[]);
        let e = caches.for_route("shop/chat", &spec("0.95", true)).unwrap();
        assert!(!Arc::ptr_eq(&d, &e));
    }
}
