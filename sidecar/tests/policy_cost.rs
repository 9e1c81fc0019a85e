//! What the traffic-policy engines cost per request, measured with a plain loop. Ignored by
//! default (numbers from a debug build mean little); run in release:
//!
//! ```sh
//! cargo test --release -p tailwarden-sidecar --test policy_cost -- --ignored --nocapture
//! ```
#![allow(clippy::unwrap_used)]

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use http::{HeaderMap, HeaderValue};
use serde_json::json;
use tailwarden_crds::{CacheScope, RateLimit, Tier};
use tailwarden_decide::{request::RequestBody, tiers::TierSet};
use tailwarden_sidecar::state::{
    exact::{CacheSettings, ExactCache},
    limits::{LimiterOptions, RouteLimiter, admit, estimate_tokens},
};

const N: u32 = 200_000;

fn per_call(start: Instant, n: u32) -> Duration {
    start.elapsed() / n
}

fn request() -> String {
    let long = "Explain the difference between a mutex and a semaphore. ".repeat(30);
    json!({"model": "gpt-4.1", "temperature": 0, "max_tokens": 300,
           "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": long}]})
    .to_string()
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "measurement; run in release"]
async fn admit_cost() {
    let spec: RateLimit = serde_json::from_value(json!({
        "requestsPerSecond": 1_000_000_000u64, "tokensPerMinute": 1_000_000_000_000u64,
        "maxConcurrent": 1000, "tenantHeader": "x-tenant-id",
        "perTenant": {"requestsPerSecond": 1_000_000_000u64, "tokensPerMinute": 1_000_000_000_000u64, "maxConcurrent": 100}
    }))
    .unwrap();
    let limiter =
        Arc::new(RouteLimiter::new("shop/chat", &spec, LimiterOptions::default()).unwrap());
    let mut headers = HeaderMap::new();
    headers.insert("x-tenant-id", HeaderValue::from_static("acme"));
    let body = request();
    let parsed = RequestBody::parse(body.as_bytes()).unwrap();

    let start = Instant::now();
    for _ in 0..N {
        std::hint::black_box(estimate_tokens(&parsed));
    }
    println!("estimate_tokens: {:?}", per_call(start, N));

    let start = Instant::now();
    for _ in 0..N {
        let tenant = limiter.tenant_of(&headers);
        let guard = admit(&limiter, tenant.as_deref(), 500).await.unwrap();
        guard.settle(420);
    }
    println!(
        "admit+settle (route and tenant: rps, tpm, concurrency): {:?}",
        per_call(start, N)
    );

    let route_only: RateLimit = serde_json::from_value(json!({
        "requestsPerSecond": 1_000_000_000u64, "tokensPerMinute": 1_000_000_000_000u64}))
    .unwrap();
    let limiter =
        Arc::new(RouteLimiter::new("shop/chat", &route_only, LimiterOptions::default()).unwrap());
    let start = Instant::now();
    for _ in 0..N {
        admit(&limiter, None, 500).await.unwrap().settle(420);
    }
    println!("admit+settle (route: rps, tpm): {:?}", per_call(start, N));
}

#[test]
#[ignore = "measurement; run in release"]
fn tier_and_cache_key_cost() {
    let body = request();
    let parsed = RequestBody::parse(body.as_bytes()).unwrap();
    let tiers: Vec<Tier> = serde_json::from_value(json!([
        {"name": "sql", "model": "coder", "when": {"regex": "(?i)\\bselect\\b.+\\bfrom\\b"}},
        {"name": "small", "model": "mini", "when": {"maxPromptChars": 200, "noneOfKeywords": ["analyse", "design", "explain why"]}},
        {"name": "reasoning", "model": "big", "when": {"anyOfKeywords": ["prove", "step by step", "semaphore"]}},
    ]))
    .unwrap();
    let set = TierSet::compile(&tiers).unwrap();
    let headers = HeaderMap::new();
    let start = Instant::now();
    for _ in 0..N / 10 {
        std::hint::black_box(set.choose_for(&parsed, &headers));
    }
    println!(
        "tier choice ({} bytes of prompt, regex + keywords): {:?}",
        body.len(),
        per_call(start, N / 10)
    );

    let cache = ExactCache::new(
        "shop/chat",
        CacheSettings {
            ttl: Duration::from_secs(300),
            max_entries: 10_000,
            max_bytes: 64 << 20,
            scope: CacheScope::Shared,
            deterministic_only: true,
            tenant_header: None,
            shared: None,
        },
    );
    let start = Instant::now();
    for _ in 0..N / 10 {
        let key = cache
            .key(&parsed, "/chat/completions", "gpt-4.1", &headers)
            .unwrap();
        std::hint::black_box(cache.get(&key));
    }
    println!(
        "cache key + lookup ({} byte request): {:?}",
        body.len(),
        per_call(start, N / 10)
    );
}
