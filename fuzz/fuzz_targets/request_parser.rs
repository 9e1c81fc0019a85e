//! Fuzz target `request_parser`: a client's request body, read the way the proxy reads it.
//!
//! The input is the raw body bytes. A few bits of its length pick the proxy's choices (the
//! provider model, whether the sidecar asks for the usage chunk, whether a capability rule
//! drops parameters), so every corpus file stays a plain, readable request body.
//!
//! Asserted for every input:
//! - `RequestBody::parse` returns a body or a 400 `ApiError`; it never panics.
//! - For a body that parses: `estimate_tokens`, the tier choice (`TierSet::choose_for`), the
//!   capability decision and the exact-cache key (`cache_key::key`) never panic, and a
//!   header-only tier is chosen whenever its header is sent.
//! - Every rewritten body is valid JSON that parses again, with the new model, the same
//!   `stream`, the usage request when the sidecar added it, every other member's raw text
//!   unchanged and in order, dropped parameters gone, the same token estimate, and (when only
//!   the model changed) the same cache key as the original body.

#![no_main]

use std::sync::LazyLock;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;
use tailwarden_crds::{CapabilityRule, Tier};
use tailwarden_decide::{
    cache_key::{self, CacheKey, KeyScope, NotCacheable},
    capabilities::{CapabilityMap, Decision},
    request::{RequestBody, estimate_tokens},
    tiers::TierSet,
};

/// Provider models the rewrite is asked for; `None` keeps the client's model (no model
/// change). The odd ones need escaping in JSON.
const MODELS: [Option<&str>; 4] = [
    None,
    Some("gpt-4.1-mini"),
    Some("azure/\"quoted\" \\ é \u{7f} \u{2028}"),
    Some("m"),
];

/// Tiers like a real route's: a header-only tier first, then prompt-based ones (keywords,
/// a regex, sizes), so `choose_for` parses the prompt.
static TIERS: LazyLock<TierSet> = LazyLock::new(|| {
    let tiers: Vec<Tier> = serde_json::from_value(serde_json::json!([
        {"name": "pinned", "model": "big", "when": {"headers": {"X-Tier": "pinned"}}},
        {"name": "design", "model": "big", "when": {
            "anyOfKeywords": ["design", "explain why", "c++", "über", "İstanbul"],
            "noneOfKeywords": ["simple"], "minMessages": 1}},
        {"name": "sql", "model": "big", "when": {"regex": "(?i)\\bselect\\b.*\\bjoin\\b", "maxPromptChars": 4000}},
        {"name": "small", "model": "small", "when": {"maxPromptChars": 200, "maxMessages": 4}}
    ]))
    .expect("the fixed tiers deserialise");
    TierSet::compile(&tiers).expect("the fixed tiers compile")
});

/// A capability rule that drops common optional parameters, `stream_options` among them.
static CAPABILITIES: LazyLock<CapabilityMap> = LazyLock::new(|| {
    let rules: Vec<CapabilityRule> = serde_json::from_value(serde_json::json!([
        {"unsupported": ["tools", "tool_choice", "response_format", "logprobs", "stream_options", "seed"]}
    ]))
    .expect("the fixed capability rule deserialises");
    CapabilityMap::new(&rules)
});

/// The key a cache that keys every request (not only deterministic ones), shared by all
/// tenants, gives a body: what the sidecar's `ExactCache::key` computes for such a route.
fn cache_key(
    body: &RequestBody<'_>,
    endpoint: &str,
    model: &str,
    headers: &HeaderMap,
) -> Result<CacheKey, NotCacheable> {
    let scope = KeyScope {
        route: "fuzz/route",
        tenant: b"",
        endpoint,
        model,
        deterministic_only: false,
    };
    cache_key::key(&scope, body, headers)
}

fuzz_target!(|data: &[u8]| {
    let Ok(body) = RequestBody::parse(data) else {
        return;
    };
    assert!(!body.model.is_empty(), "a parsed body has a model");

    let tokens = estimate_tokens(&body);

    let no_headers = HeaderMap::new();
    let mut pinned = HeaderMap::new();
    pinned.insert("x-tier", HeaderValue::from_static("pinned"));
    let chosen = TIERS
        .choose_for(&body, &no_headers)
        .map(|t| t.model.clone());
    let pinned_tier = TIERS.choose_for(&body, &pinned).map(|t| &*t.name);
    assert_eq!(
        pinned_tier,
        Some("pinned"),
        "the header-only tier always wins"
    );

    let endpoint = if data.len() & 16 == 0 {
        "/chat/completions"
    } else {
        "/embeddings"
    };
    let model = chosen.as_deref().unwrap_or(&body.model);
    let key = cache_key(&body, endpoint, model, &no_headers);

    let add_usage = data.len() & 1 == 1;
    let new_model = MODELS[(data.len() >> 1) % MODELS.len()].unwrap_or(&body.model);
    let drop = match CAPABILITIES.check("p", new_model, body.members()) {
        Decision::Drop(params) if data.len() & 8 == 8 => params,
        _ => Vec::new(),
    };
    let drop: Vec<&str> = drop.iter().map(String::as_str).collect();

    let change_model = new_model != body.model;
    // A provider that does not support `stream_options` is never asked for usage.
    let change_usage =
        add_usage && body.stream && !body.client_wants_usage && !drop.contains(&"stream_options");
    let Some(out) = body.rewrite_dropping(new_model, add_usage, &drop) else {
        assert!(
            !change_model && !change_usage && drop.is_empty(),
            "a needed rewrite was skipped"
        );
        return;
    };
    if serde_json::from_slice::<IgnoredAny>(&out).is_err() {
        panic!(
            "the rewritten body is not JSON: {:?}",
            String::from_utf8_lossy(&out)
        );
    }
    let again = match RequestBody::parse(&out) {
        Ok(again) => again,
        Err(e) => panic!(
            "the rewritten body does not parse ({}): {:?}",
            e.message,
            String::from_utf8_lossy(&out)
        ),
    };
    assert_eq!(
        again.model, new_model,
        "the rewritten body has the new model"
    );
    assert_eq!(again.stream, body.stream, "`stream` is kept");
    if change_usage {
        assert!(again.client_wants_usage, "the usage chunk was asked for");
    } else if drop.contains(&"stream_options") {
        assert!(
            !again.client_wants_usage,
            "a dropped stream_options is not added back"
        );
    } else {
        assert_eq!(again.client_wants_usage, body.client_wants_usage);
    }

    // Every member but the model and a replaced `stream_options` is copied verbatim, in
    // order; dropped members are gone.
    let mut want: Vec<(&str, &str)> = body
        .members()
        .filter(|(k, _)| !drop.contains(k))
        .filter(|(k, _)| !(change_usage && *k == "stream_options"))
        .map(|(k, v)| (k, v.get()))
        .collect();
    if change_usage {
        want.push(("stream_options", r#"{"include_usage":true}"#));
    }
    let got: Vec<(&str, &str)> = again.members().map(|(k, v)| (k, v.get())).collect();
    assert_eq!(got.len(), want.len(), "members kept");
    for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
        assert_eq!(gk, wk, "member order");
        if *gk != "model" {
            assert_eq!(gv, wv, "member {gk} is copied verbatim");
        }
    }

    if drop.is_empty() {
        assert_eq!(estimate_tokens(&again), tokens, "same token estimate");
        if !change_usage {
            // The cache keys the model separately from the body, so a body whose only change
            // is its model member has the same key.
            assert_eq!(
                cache_key(&again, endpoint, model, &no_headers),
                key,
                "same cache key"
            );
        }
    }
});
