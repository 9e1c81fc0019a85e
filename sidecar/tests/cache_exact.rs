//! The exact cache: what the key includes and ignores, which requests are cached, hit / miss /
//! TTL on tokio's paused clock, eviction by bytes and by count, and streams stored and
//! replayed byte-for-byte — never errors, oversized or truncated ones.
#![allow(clippy::unwrap_used)]

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;
use tailwarden_crds::CacheScope;
use tailwarden_decide::{cache_key::canonical_json, request::RequestBody};
use tailwarden_sidecar::state::exact::{CacheKey, CacheSettings, ExactCache, NotCacheable};
use tokio::time::advance;

fn settings() -> CacheSettings {
    CacheSettings {
        ttl: Duration::from_secs(60),
        max_entries: 1000,
        max_bytes: 16 << 20,
        scope: CacheScope::Tenant,
        deterministic_only: true,
        tenant_header: Some(http::HeaderName::from_static("x-tenant-id")),
        shared: None,
    }
}

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, HeaderValue::from_static(v));
    }
    h
}

fn key_of(
    cache: &ExactCache,
    body: &str,
    model: &str,
    h: &HeaderMap,
) -> Result<CacheKey, NotCacheable> {
    let parsed = RequestBody::parse(body.as_bytes()).unwrap();
    cache.key(&parsed, "/chat/completions", model, h)
}

fn key(cache: &ExactCache, body: &str) -> CacheKey {
    key_of(cache, body, "gpt-4.1", &HeaderMap::new()).unwrap()
}

const BASE: &str =
    r#"{"model":"gpt-4.1","temperature":0,"messages":[{"role":"user","content":"What is 2+2?"}]}"#;

#[test]
fn the_key_ignores_what_cannot_change_the_answer() {
    let cache = ExactCache::new("shop/chat", settings());
    let base = key(&cache, BASE);
    let same = [
        // JSON whitespace and member order.
        r#"{ "messages" : [ { "content" : "What is 2+2?", "role" : "user" } ] , "temperature" : 0.0, "model":"gpt-4.1" }"#,
        // Default-valued parameters and nulls.
        r#"{"model":"gpt-4.1","temperature":0,"top_p":1,"n":1,"presence_penalty":0,"frequency_penalty":0.0,"stop":null,"seed":null,"logprobs":false,"response_format":{"type":"text"},"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        // tool_choice "none" without tools is the default.
        r#"{"model":"gpt-4.1","temperature":0,"tool_choice":"none","messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        // Members that do not change the answer.
        r#"{"model":"gpt-4.1","temperature":0,"user":"u-17","metadata":{"k":"v"},"store":false,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        // String escapes: \u0032 is "2".
        r#"{"model":"gpt-4.1","temperature":0,"messages":[{"role":"user","content":"What is \u0032+2?"}]}"#,
        // The requested model does not matter, the model after tier choice does.
        r#"{"model":"alias","temperature":0,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
    ];
    for body in same {
        assert_eq!(key(&cache, body), base, "{body}");
    }
}

#[test]
fn the_key_includes_everything_that_can_change_the_answer() {
    let cache = ExactCache::new("shop/chat", settings());
    let base = key(&cache, BASE);
    let different = [
        (
            "whitespace inside content",
            r#"{"model":"gpt-4.1","temperature":0,"messages":[{"role":"user","content":"What is  2+2?"}]}"#,
        ),
        (
            "a system message",
            r#"{"model":"gpt-4.1","temperature":0,"messages":[{"role":"system","content":"Be terse"},{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "tools",
            r#"{"model":"gpt-4.1","temperature":0,"tools":[{"type":"function","function":{"name":"add"}}],"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "response_format",
            r#"{"model":"gpt-4.1","temperature":0,"response_format":{"type":"json_object"},"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "tool_choice",
            r#"{"model":"gpt-4.1","temperature":0,"tool_choice":"required","messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "seed",
            r#"{"model":"gpt-4.1","temperature":0,"seed":7,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "max_tokens",
            r#"{"model":"gpt-4.1","temperature":0,"max_tokens":5,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "top_p",
            r#"{"model":"gpt-4.1","temperature":0,"top_p":0.5,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "stop",
            r#"{"model":"gpt-4.1","temperature":0,"stop":["\n"],"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "n",
            r#"{"model":"gpt-4.1","temperature":0,"n":2,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "an unknown parameter",
            r#"{"model":"gpt-4.1","temperature":0,"reasoning_effort":"high","messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
        (
            "stream",
            r#"{"model":"gpt-4.1","temperature":0,"stream":true,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
        ),
    ];
    let mut seen = vec![base];
    for (what, body) in different {
        let k = key(&cache, body);
        assert!(!seen.contains(&k), "{what} must change the key");
        seen.push(k);
    }
    // Tools with tool_choice "auto" (its default with tools) key like tools alone.
    let tools = r#"{"model":"gpt-4.1","temperature":0,"tools":[{"type":"function","function":{"name":"add"}}],"messages":[{"role":"user","content":"What is 2+2?"}]}"#;
    let tools_auto = r#"{"model":"gpt-4.1","temperature":0,"tool_choice":"auto","tools":[{"function":{"name":"add"},"type":"function"}],"messages":[{"role":"user","content":"What is 2+2?"}]}"#;
    assert_eq!(key(&cache, tools), key(&cache, tools_auto));

    // The model after tier choice, the endpoint, the route and the tenant all split keys.
    let h = HeaderMap::new();
    assert_ne!(key_of(&cache, BASE, "gpt-4.1-mini", &h).unwrap(), base);
    let parsed = RequestBody::parse(BASE.as_bytes()).unwrap();
    assert_ne!(
        cache.key(&parsed, "/completions", "gpt-4.1", &h).unwrap(),
        base
    );
    let other_route = ExactCache::new("shop/other", settings());
    assert_ne!(key(&other_route, BASE), base);
    let acme = key_of(
        &cache,
        BASE,
        "gpt-4.1",
        &headers(&[("x-tenant-id", "acme")]),
    )
    .unwrap();
    let globex = key_of(
        &cache,
        BASE,
        "gpt-4.1",
        &headers(&[("x-tenant-id", "globex")]),
    )
    .unwrap();
    assert_ne!(acme, globex);
    assert_ne!(acme, base);
    let shared = ExactCache::new(
        "shop/chat",
        CacheSettings {
            scope: CacheScope::Shared,
            ..settings()
        },
    );
    assert_eq!(
        key_of(
            &shared,
            BASE,
            "gpt-4.1",
            &headers(&[("x-tenant-id", "acme")])
        )
        .unwrap(),
        key_of(
            &shared,
            BASE,
            "gpt-4.1",
            &headers(&[("x-tenant-id", "globex")])
        )
        .unwrap(),
    );
}

#[test]
fn canonical_json_sorts_keys_and_normalises_numbers_only() {
    let v = json!({"b": [1.0, 2.5, {"y": " a  b ", "x": 1e3}], "a": 0.0});
    assert_eq!(
        canonical_json(&v),
        r#"{"a":0,"b":[1,2.5,{"x":1000,"y":" a  b "}]}"#
    );
}

#[test]
fn only_deterministic_requests_are_cached_unless_forced() {
    let cache = ExactCache::new("shop/chat", settings());
    let h = HeaderMap::new();
    let warm = r#"{"model":"m","temperature":0.7,"messages":[]}"#;
    let unset = r#"{"model":"m","messages":[]}"#;
    assert_eq!(
        key_of(&cache, warm, "m", &h),
        Err(NotCacheable::NotDeterministic)
    );
    assert_eq!(
        key_of(&cache, unset, "m", &h),
        Err(NotCacheable::NotDeterministic)
    );
    assert_eq!(
        NotCacheable::NotDeterministic.to_string(),
        "not-deterministic"
    );
    let force = headers(&[("x-tailwarden-cache", "force")]);
    assert!(key_of(&cache, warm, "m", &force).unwrap().read);
    let anything = ExactCache::new(
        "shop/chat",
        CacheSettings {
            deterministic_only: false,
            ..settings()
        },
    );
    assert!(key_of(&anything, warm, "m", &h).is_ok());
    // Embeddings are deterministic.
    let parsed = RequestBody::parse(br#"{"model":"e","input":"hi"}"#).unwrap();
    assert!(cache.key(&parsed, "/embeddings", "e", &h).is_ok());
    // no-store: neither read nor written.
    let no_store = headers(&[("cache-control", "private, no-store")]);
    assert_eq!(
        key_of(&cache, BASE, "m", &no_store),
        Err(NotCacheable::NoStore)
    );
}

fn store(cache: &Arc<ExactCache>, k: &CacheKey, body: &[u8]) -> bool {
    let mut h = HeaderMap::new();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    let mut fill = cache.fill(k, StatusCode::OK, &h, false).unwrap();
    fill.push(&Bytes::copy_from_slice(body));
    fill.commit()
}

#[tokio::test(start_paused = true)]
async fn hit_miss_ttl_and_client_bypass() {
    let cache = ExactCache::new("shop/chat", settings());
    let k = key(&cache, BASE);
    assert!(cache.get(&k).is_none(), "miss first");
    assert!(store(
        &cache,
        &k,
        br#"{"choices":[{"message":{"content":"4"}}]}"#
    ));
    let hit = cache.get(&k).unwrap();
    assert_eq!(hit.status, StatusCode::OK);
    assert_eq!(hit.content_type.as_ref().unwrap(), "application/json");
    assert_eq!(
        &hit.body()[..],
        br#"{"choices":[{"message":{"content":"4"}}]}"#
    );
    advance(Duration::from_secs(59)).await;
    assert_eq!(cache.get(&k).unwrap().age(tokio::time::Instant::now()), 59);

    // bypass / no-cache: no read, but the fresh response refreshes the entry.
    let bypass = key_of(
        &cache,
        BASE,
        "gpt-4.1",
        &headers(&[("x-tailwarden-cache", "bypass")]),
    )
    .unwrap();
    assert!(!bypass.read);
    assert!(cache.get(&bypass).is_none());
    let no_cache = key_of(
        &cache,
        BASE,
        "gpt-4.1",
        &headers(&[("cache-control", "no-cache")]),
    )
    .unwrap();
    assert!(!no_cache.read);
    assert!(store(&cache, &bypass, b"{\"fresh\":true}"));

    advance(Duration::from_secs(59)).await;
    assert_eq!(&cache.get(&k).unwrap().body()[..], b"{\"fresh\":true}");
    advance(Duration::from_secs(1)).await;
    assert!(cache.get(&k).is_none(), "expired after the TTL");
    let stats = cache.stats();
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(
        (
            stats.hits.load(Relaxed),
            stats.misses.load(Relaxed),
            stats.stores.load(Relaxed),
            stats.expired.load(Relaxed)
        ),
        (3, 2, 2, 1)
    );
}

fn distinct(cache: &ExactCache, i: usize) -> CacheKey {
    key(
        cache,
        &format!(
            r#"{{"model":"m","temperature":0,"messages":[{{"role":"user","content":"question {i}"}}]}}"#
        ),
    )
}

#[test]
fn eviction_keeps_the_cache_within_its_bytes() {
    let max_bytes = 64 << 10;
    let cache = ExactCache::new(
        "shop/chat",
        CacheSettings {
            max_bytes,
            max_entries: 10_000,
            ..settings()
        },
    );
    assert_eq!(cache.max_entry_bytes(), 4 << 10);
    let body = vec![b'x'; 3_000];
    for i in 0..200 {
        assert!(store(&cache, &distinct(&cache, i), &body));
        let (_, weight) = cache.usage();
        assert!(
            weight <= max_bytes,
            "weight {weight} over {max_bytes} after {i}"
        );
    }
    let (entries, _) = cache.usage();
    assert!(
        entries <= (max_bytes / 3_000) as usize,
        "{entries} entries of 3000 bytes in 64 KiB"
    );
    assert!(
        entries >= 10,
        "the cache should still hold entries: {entries}"
    );
    let hits = (0..200)
        .filter(|&i| cache.get(&distinct(&cache, i)).is_some())
        .count();
    assert_eq!(hits, entries, "what is counted is what can be read");
    assert!(
        cache.get(&distinct(&cache, 199)).is_some(),
        "the newest entry is kept"
    );

    // An entry over the largest entry size is never stored.
    let big = vec![b'y'; cache.max_entry_bytes() + 1];
    assert!(!store(&cache, &distinct(&cache, 1_000), &big));
    assert!(cache.get(&distinct(&cache, 1_000)).is_none());
}

#[test]
fn eviction_keeps_the_cache_within_its_entry_count() {
    let cache = ExactCache::new(
        "shop/chat",
        CacheSettings {
            max_bytes: 1 << 20,
            max_entries: 10,
            ..settings()
        },
    );
    for i in 0..100 {
        assert!(store(&cache, &distinct(&cache, i), b"{}"));
    }
    let (entries, _) = cache.usage();
    assert!(
        (1..=10).contains(&entries),
        "{entries} entries, at most 10 allowed"
    );
}

/// A real-looking chat stream, cut at odd places as a network would deliver it.
fn sse_chunks() -> Vec<Bytes> {
    [
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"Two plus\"}}]}\n\ndata: {\"id\":\"c1\",",
        "\"choices\":[{\"delta\":{\"content\":\" two is  four.\"}}]}\n\n",
        ": keep-alive comment\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    ]
    .iter()
    .map(|s| Bytes::from_static(s.as_bytes()))
    .collect()
}

fn stream_key(cache: &ExactCache) -> CacheKey {
    key(
        cache,
        r#"{"model":"gpt-4.1","temperature":0,"stream":true,"messages":[{"role":"user","content":"What is 2+2?"}]}"#,
    )
}

fn sse_headers() -> HeaderMap {
    headers(&[("content-type", "text/event-stream")])
}

#[tokio::test]
async fn a_streamed_hit_replays_the_same_sse_byte_for_byte() {
    let cache = ExactCache::new("shop/chat", settings());
    let k = stream_key(&cache);
    let mut fill = cache
        .fill(&k, StatusCode::OK, &sse_headers(), true)
        .unwrap();
    for c in sse_chunks() {
        fill.push(&c);
    }
    assert!(fill.commit());
    let hit = cache.get(&k).unwrap();
    assert!(hit.stream);
    assert_eq!(hit.content_type.as_ref().unwrap(), "text/event-stream");
    let mut body = hit.replay();
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        frames.push(frame.unwrap().into_data().unwrap());
    }
    assert_eq!(frames, sse_chunks(), "same chunks, same bytes, same order");
    // The non-stream request is another entry.
    assert!(cache.get(&key(&cache, BASE)).is_none());
}

#[test]
fn errors_and_truncated_or_failed_streams_are_never_stored() {
    let cache = ExactCache::new("shop/chat", settings());
    let k = stream_key(&cache);
    assert!(
        cache
            .fill(&k, StatusCode::TOO_MANY_REQUESTS, &sse_headers(), true)
            .is_none()
    );
    assert!(
        cache
            .fill(
                &k,
                StatusCode::INTERNAL_SERVER_ERROR,
                &HeaderMap::new(),
                false
            )
            .is_none()
    );

    // Truncated: no [DONE].
    let mut fill = cache
        .fill(&k, StatusCode::OK, &sse_headers(), true)
        .unwrap();
    for c in &sse_chunks()[..4] {
        fill.push(c);
    }
    assert!(!fill.commit());

    // Cut inside the final event.
    let mut fill = cache
        .fill(&k, StatusCode::OK, &sse_headers(), true)
        .unwrap();
    for c in &sse_chunks()[..5] {
        fill.push(c);
    }
    fill.push(&Bytes::from_static(b"data: [DO"));
    assert!(!fill.commit());

    // An error event after content (what the relay sends when the provider fails mid-stream).
    let mut fill = cache
        .fill(&k, StatusCode::OK, &sse_headers(), true)
        .unwrap();
    for c in &sse_chunks()[..2] {
        fill.push(c);
    }
    fill.push(&Bytes::from_static(
        b"\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"upstream reset\"}}\n\n",
    ));
    fill.push(&Bytes::from_static(b"data: [DONE]\n\n"));
    assert!(!fill.commit());

    // Abandoned: the client went away, the fill is dropped without commit.
    let mut fill = cache
        .fill(&k, StatusCode::OK, &sse_headers(), true)
        .unwrap();
    for c in sse_chunks() {
        fill.push(&c);
    }
    drop(fill);

    assert!(cache.get(&k).is_none());
    let stats = cache.stats();
    assert_eq!(stats.stores.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(
        stats.abandoned.load(std::sync::atomic::Ordering::Relaxed),
        4
    );
}

#[test]
fn caches_survive_reloads_when_unchanged() {
    use tailwarden_sidecar::state::exact::Caches;
    let caches = Caches::default();
    let mut spec: tailwarden_crds::ExactCache =
        serde_json::from_value(json!({"enabled": true})).unwrap();
    let a = caches
        .for_route("shop/chat", &spec, Some("x-tenant-id"))
        .unwrap()
        .unwrap();
    let k = key(&a, BASE);
    assert!(store(&a, &k, b"{}"));
    let again = caches
        .for_route("shop/chat", &spec, Some("x-tenant-id"))
        .unwrap()
        .unwrap();
    assert!(Arc::ptr_eq(&a, &again));
    assert!(again.get(&k).is_some(), "a reload keeps the entries");
    spec.ttl = "1m".parse().unwrap();
    let changed = caches
        .for_route("shop/chat", &spec, Some("x-tenant-id"))
        .unwrap()
        .unwrap();
    assert!(!Arc::ptr_eq(&a, &changed));
    spec.enabled = false;
    assert!(
        caches
            .for_route("shop/chat", &spec, None)
            .unwrap()
            .is_none()
    );
    caches.retain(&[]);
}
