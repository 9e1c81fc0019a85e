//! Tier selection and capability maps, table-driven: which tier a request falls in (prompt
//! length, message counts, keywords any/none with word boundaries, regex, headers), how bad
//! regexes are rejected at config load, and what a provider's capability rules decide.
#![allow(clippy::unwrap_used)]

use http::{HeaderMap, HeaderValue};
use serde_json::json;
use tailwarden_crds::{CapabilityRule, Tier};
use tailwarden_decide::{
    capabilities::{CapabilityMap, Decision, no_provider_supports},
    request::RequestBody,
    tiers::{Prompt, TierError, TierSet},
};

fn tiers(value: serde_json::Value) -> Vec<Tier> {
    serde_json::from_value(value).unwrap()
}

fn chat(messages: &[&str]) -> String {
    let msgs: Vec<_> = messages
        .iter()
        .map(|m| json!({"role": "user", "content": m}))
        .collect();
    json!({"model": "big", "messages": msgs}).to_string()
}

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, HeaderValue::from_static(v));
    }
    h
}

/// The tiers every row of the table is checked against, in order.
fn route_tiers() -> TierSet {
    TierSet::compile(&tiers(json!([
        {"name": "free-plan", "model": "small", "when": {"headers": {"X-Plan": "free"}}},
        {"name": "sql", "model": "coder", "when": {"regex": "(?i)\\b(select|insert|update)\\b.+\\b(from|into|set)\\b"}},
        {"name": "long-chat", "model": "big", "when": {"minMessages": 6}},
        {"name": "tiny", "model": "small", "when": {
            "maxPromptChars": 40, "maxMessages": 2,
            "noneOfKeywords": ["analyse", "design", "explain why", "c++"]}},
        {"name": "reasoning", "model": "big", "when": {
            "minPromptChars": 20, "anyOfKeywords": ["prove", "step by step"]}},
    ])))
    .unwrap()
}

#[test]
fn tier_selection_table() {
    let set = route_tiers();
    let long = "x".repeat(200);
    let cases: Vec<(&str, String, HeaderMap, Option<&str>)> = vec![
        ("short prompt", chat(&["hi there"]), HeaderMap::new(), Some("tiny")),
        ("exactly at max chars", chat(&[&"a".repeat(40)]), HeaderMap::new(), Some("tiny")),
        ("one char over max", chat(&[&"a".repeat(41)]), HeaderMap::new(), None),
        ("chars counted across messages", chat(&[&"a".repeat(20), &"b".repeat(21)]), HeaderMap::new(), None),
        ("chars are characters, not bytes", chat(&[&"é".repeat(40)]), HeaderMap::new(), Some("tiny")),
        ("too many messages for tiny", chat(&["a", "b", "c"]), HeaderMap::new(), None),
        ("none-of keyword blocks", chat(&["please design it"]), HeaderMap::new(), None),
        ("none-of is case-insensitive", chat(&["Please DESIGN it"]), HeaderMap::new(), None),
        ("word boundary: designer is not design", chat(&["ask the designer"]), HeaderMap::new(), Some("tiny")),
        ("phrase across a newline", chat(&["explain\nwhy"]), HeaderMap::new(), None),
        ("phrase needs all words", chat(&["explain it"]), HeaderMap::new(), Some("tiny")),
        ("symbol keyword", chat(&["write c++ code"]), HeaderMap::new(), None),
        ("symbol keyword inside a word", chat(&["abc++ code"]), HeaderMap::new(), Some("tiny")),
        ("any-of keyword with min chars", chat(&[&format!("Prove that {long}")]), HeaderMap::new(), Some("reasoning")),
        ("any-of phrase", chat(&["think step  by step about the answer here"]), HeaderMap::new(), Some("reasoning")),
        ("any-of needs a whole word", chat(&["improved results everywhere, really, truly"]), HeaderMap::new(), None),
        ("any-of but too short", chat(&["prove it"]), HeaderMap::new(), Some("tiny")),
        ("regex", chat(&["SELECT name FROM users"]), HeaderMap::new(), Some("sql")),
        ("regex beats later tiers", chat(&["select 1 from t; prove it"]), HeaderMap::new(), Some("sql")),
        ("regex no match", chat(&["selection of products"]), HeaderMap::new(), Some("tiny")),
        ("min messages", chat(&["a", "b", "c", "d", "e", "f"]), HeaderMap::new(), Some("long-chat")),
        ("header equals (name case-insensitive)", chat(&[&long]), headers(&[("x-plan", "free")]), Some("free-plan")),
        ("header value is exact", chat(&["hi"]), headers(&[("x-plan", "Free")]), Some("tiny")),
        ("header among several values", chat(&[&long]), headers(&[("x-plan", "pro"), ("x-plan", "free")]), Some("free-plan")),
        ("no text at all", json!({"model": "big", "messages": []}).to_string(), HeaderMap::new(), Some("tiny")),
        ("text parts count, images do not", json!({"model": "big", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "design"}, {"type": "image_url", "image_url": {"url": "https://x/design.png"}}]}]}).to_string(),
            HeaderMap::new(), None),
        ("completions prompt", json!({"model": "big", "prompt": "hello"}).to_string(), HeaderMap::new(), Some("tiny")),
        ("embeddings input list", json!({"model": "big", "input": ["a", "b", "c"]}).to_string(), HeaderMap::new(), None),
    ];
    let mut failures = Vec::new();
    for (name, body, hdrs, want) in &cases {
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let got = set.choose_for(&parsed, hdrs).map(|t| &*t.name);
        if got != *want {
            failures.push(format!("{name}: want {want:?}, got {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn chosen_tier_carries_its_model() {
    let set = route_tiers();
    let t = set
        .choose(&Prompt::text("hello"), &HeaderMap::new())
        .unwrap();
    assert_eq!((&*t.name, t.model.as_str()), ("tiny", "small"));
    assert!(set.needs_prompt());
    let header_only = TierSet::compile(&tiers(
        json!([{"name": "h", "model": "m", "when": {"headers": {"x-a": "1"}}}]),
    ))
    .unwrap();
    assert!(
        !header_only.needs_prompt(),
        "header-only tiers never parse messages"
    );
    assert!(
        TierSet::default()
            .choose_for(
                &RequestBody::parse(b"{\"model\":\"m\"}").unwrap(),
                &HeaderMap::new()
            )
            .is_none()
    );
}

#[test]
fn bad_regexes_are_rejected_naming_the_field() {
    let err = TierSet::compile(&tiers(json!([
        {"name": "ok", "model": "m", "when": {"regex": "fine"}},
        {"name": "bad", "model": "m", "when": {"regex": "(unclosed"}},
    ])))
    .unwrap_err();
    assert!(matches!(err, TierError::Regex { index: 1, .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with("spec.tiers[1].when.regex: invalid regular expression: "),
        "{text}"
    );
    assert!(!text.contains('\n'), "one line: {text}");

    // Look-around is not RE2: rejected, not silently different.
    let err = TierSet::compile(&tiers(
        json!([{"name": "la", "model": "m", "when": {"regex": "a(?=b)"}}]),
    ))
    .unwrap_err();
    assert!(err.to_string().contains("look-around"), "{err}");

    // A pattern that compiles to a huge program is refused by the size limit.
    let err = TierSet::compile(&tiers(
        json!([{"name": "huge", "model": "m", "when": {"regex": "\\w{1000}{1000}"}}]),
    ))
    .unwrap_err();
    assert!(
        matches!(err, TierError::RegexTooBig { index: 0, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("too large"), "{err}");
}

#[test]
fn the_config_loader_rejects_a_bad_regex_with_route_and_field() {
    let dir = std::env::temp_dir().join(format!("tw-tiers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("route.yaml");
    std::fs::write(
        &path,
        r#"apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: chat, namespace: shop}
spec:
  models: [big, small]
  providers: [{name: p, baseUrl: "http://127.0.0.1:9/v1"}]
  tiers:
  - {name: t, model: small, when: {regex: "[z-a]"}}
"#,
    )
    .unwrap();
    let registries = tailwarden_sidecar::config::Registries::default();
    let err = match tailwarden_sidecar::app::reload::load(&registries, &path) {
        Ok(_) => panic!("an invalid regex must not load"),
        Err(e) => e,
    };
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        err.starts_with("route shop/chat: spec.tiers[0].when.regex: invalid regular expression"),
        "{err}"
    );
}

fn rules(value: serde_json::Value) -> CapabilityMap {
    let rules: Vec<CapabilityRule> = serde_json::from_value(value).unwrap();
    CapabilityMap::new(&rules)
}

#[test]
fn capability_map_table() {
    let map = rules(json!([
        {"unsupported": ["response_format", "logprobs"]},
        {"models": ["llama-3"], "unsupported": ["tools", "tool_choice"], "onUnsupported": "reject"},
        {"models": ["qwen"], "unsupported": ["tools", "tool_choice"], "onUnsupported": "drop"},
    ]));
    let drop = |v: &[&str]| Decision::Drop(v.iter().map(|s| (*s).to_owned()).collect());
    // Raw bodies: member order matters (drops are listed in request order).
    let cases: Vec<(&str, &str, &str, Decision)> = vec![
        (
            "nothing unsupported",
            "llama-3",
            r#"{"model": "m", "messages": []}"#,
            Decision::Keep,
        ),
        (
            "dropped for every model",
            "gpt",
            r#"{"model": "m", "response_format": {"type": "json_object"}, "logprobs": true}"#,
            drop(&["response_format", "logprobs"]),
        ),
        (
            "tools fine on another model",
            "gpt",
            r#"{"model": "m", "tools": [{"type": "function"}]}"#,
            Decision::Keep,
        ),
        (
            "tools dropped on qwen",
            "qwen",
            r#"{"model": "m", "tools": [], "tool_choice": "auto", "seed": 1}"#,
            drop(&["tools", "tool_choice"]),
        ),
        (
            "null counts as absent: dropped, never rejected",
            "llama-3",
            r#"{"model": "m", "tools": null}"#,
            drop(&["tools"]),
        ),
    ];
    for (name, model, text, want) in cases {
        let parsed = RequestBody::parse(text.as_bytes()).unwrap();
        assert_eq!(map.check("vllm", model, parsed.members()), want, "{name}");
    }

    let text = r#"{"model": "m", "tools": [{"type": "function"}], "tool_choice": "auto", "response_format": {}}"#;
    let parsed = RequestBody::parse(text.as_bytes()).unwrap();
    match map.check("vllm", "llama-3", parsed.members()) {
        Decision::Reject { params, message } => {
            assert_eq!(params, ["tools", "tool_choice"]);
            assert_eq!(
                message,
                "Provider vllm (model llama-3) does not support the parameters `tools`, `tool_choice`; the route rejects such requests for it (spec.providers[].capabilities)."
            );
            let e = no_provider_supports("shop/chat", &params, std::slice::from_ref(&message));
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
            assert_eq!(e.code, Some("unsupported_parameter"));
            assert!(e.message.starts_with(
                "No provider of route shop/chat supports the parameters `tools`, `tool_choice` (spec.providers[].capabilities). Remove them from the request."
            ), "{}", e.message);
        }
        other => panic!("want reject, got {other:?}"),
    }
    assert!(CapabilityMap::default().is_empty());
    assert_eq!(
        CapabilityMap::default().check("p", "m", parsed.members()),
        Decision::Keep
    );
}
