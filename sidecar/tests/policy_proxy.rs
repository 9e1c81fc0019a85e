//! Traffic policy through the real request path over loopback HTTP: the exact cache (hits,
//! streamed replays byte for byte, what splits the key, what is never stored), admission
//! limits (429/503 with the limit named, never retried, reservations settled with the real
//! usage of streams), capability maps (parameters dropped, providers skipped, 400 when none
//! is left) and the tier header.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::BodyExt;

const CHAT: &str = "/v1/chat/completions";

/// POSTs `body` with extra headers; the whole body as bytes.
async fn send(sc: &Sidecar, body: &str, headers: &[(&str, &str)]) -> (Reply, Bytes) {
    let mut req = Request::post(sc.url(CHAT)).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = client().request(req).await.expect("sidecar answers");
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap();
    (
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        },
        bytes,
    )
}

fn request(stream: bool, extra: &str) -> String {
    format!(
        r#"{{"model":"m","stream":{stream},"temperature":0,"messages":[{{"role":"user","content":"What is 2+2?"}}]{extra}}}"#
    )
}

fn cached_route(url: &str, cache: &str) -> String {
    route(
        &[("p", url, 100, 0)],
        &format!("  cache:\n    exact: {{enabled: true{cache}}}\n"),
    )
}

/// A stream of several content chunks, a usage chunk when asked for, and `[DONE]`.
fn stream_script(body: &str) -> Script {
    let mut chunks = vec![
        (Duration::ZERO, sse_chunk("The answer")),
        (Duration::from_millis(5), sse_chunk(" is")),
        (Duration::from_millis(5), sse_chunk(" 4.")),
    ];
    if body.contains("include_usage") {
        chunks.push((Duration::ZERO, sse_usage()));
    }
    chunks.push((Duration::ZERO, DONE.to_owned()));
    Script::Stream {
        first_delay: Duration::ZERO,
        chunks,
        end: StreamEnd::Finish,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_deterministic_request_is_served_from_the_cache() {
    let up = upstream(|n, _| ok(&format!("answer {n}"))).await;
    let sc = sidecar(&cached_route(&up.base_url(), "")).await;

    let (first, first_bytes) = send(&sc, &request(false, ""), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-tailwarden-cache"), "miss");
    // Same request, keys in another order and other whitespace: the same entry.
    let reordered = r#"{ "messages": [{"content":"What is 2+2?","role":"user"}], "temperature": 0.0, "stream": false, "model": "m" }"#;
    let (second, second_bytes) = send(&sc, reordered, &[]).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("x-tailwarden-cache"), "hit");
    assert_eq!(second_bytes, first_bytes, "a hit returns the stored body");
    assert_eq!(second.header("content-type"), first.header("content-type"));
    assert!(!second.header("age").is_empty());
    assert_eq!(up.count(), 1, "the provider saw one request");

    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(metrics.contains(r#"tailwarden_cache_requests_total{result="hit",route="t/test"} 1"#));
    assert!(metrics.contains(r#"tailwarden_cache_requests_total{result="miss",route="t/test"} 1"#));
    tailwarden_sidecar::config::series::sample(&sc.app.metrics, &sc.app.table.load());
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(metrics.contains(r#"tailwarden_cache_entries{route="t/test"} 1"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_hit_replays_the_same_bytes() {
    let up = upstream(|_, body| stream_script(body)).await;
    let sc = sidecar(&cached_route(&up.base_url(), "")).await;
    for extra in ["", r#","stream_options":{"include_usage":true}"#] {
        let body = request(true, extra);
        let (first, first_bytes) = send(&sc, &body, &[]).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.header("x-tailwarden-cache"), "miss");
        assert!(first.body.ends_with(DONE));
        let (second, second_bytes) = send(&sc, &body, &[]).await;
        assert_eq!(second.header("x-tailwarden-cache"), "hit");
        assert_eq!(
            second.header("content-type"),
            "text/event-stream",
            "replayed as SSE"
        );
        assert_eq!(
            second_bytes, first_bytes,
            "the replay is byte-for-byte what the first client got"
        );
        // Usage asked for by the client is in both; asked for by the sidecar, in neither.
        assert_eq!(
            first.body.contains("\"usage\""),
            !extra.is_empty(),
            "{}",
            first.body
        );
    }
    assert_eq!(up.count(), 2, "one upstream call per distinct request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_response_format_and_tier_model_split_the_key() {
    let up = upstream(|n, _| ok(&format!("answer {n}"))).await;
    let sc = sidecar(&cached_route(&up.base_url(), "")).await;
    let variants = [
        request(false, ""),
        request(
            false,
            r#","tools":[{"type":"function","function":{"name":"add","parameters":{"type":"object"}}}]"#,
        ),
        request(false, r#","response_format":{"type":"json_object"}"#),
        request(false, r#","seed":7"#),
    ];
    for v in &variants {
        let (r, _) = send(&sc, v, &[]).await;
        assert_eq!(r.header("x-tailwarden-cache"), "miss", "{v}");
    }
    // Parameters that cannot change the answer share the entry.
    let (r, _) = send(&sc, &request(false, r#","user":"alice","top_p":1"#), &[]).await;
    assert_eq!(r.header("x-tailwarden-cache"), "hit");
    assert_eq!(up.count(), variants.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypass_non_deterministic_errors_and_truncated_streams_are_not_served() {
    let up = upstream(|n, body| {
        if body.contains("fail") {
            status(500)
        } else if body.contains("cut") {
            Script::Stream {
                first_delay: Duration::ZERO,
                chunks: vec![(Duration::ZERO, sse_chunk("partial"))],
                end: StreamEnd::Abort,
            }
        } else {
            ok(&format!("answer {n}"))
        }
    })
    .await;
    let sc = sidecar(&format!(
        "{}  retries: {{maxAttempts: 1}}\n  circuitBreaker: {{enabled: false}}\n",
        cached_route(&up.base_url(), "")
    ))
    .await;

    // Not deterministic: neither looked up nor stored.
    let hot = r#"{"model":"m","temperature":0.7,"messages":[{"role":"user","content":"hi"}]}"#;
    for _ in 0..2 {
        let (r, _) = send(&sc, hot, &[]).await;
        assert_eq!(r.header("x-tailwarden-cache"), "bypass");
        assert_eq!(r.header("x-tailwarden-cache-reason"), "not-deterministic");
    }
    assert_eq!(up.count(), 2);
    // ... unless the client forces it.
    let (r, _) = send(&sc, hot, &[("x-tailwarden-cache", "force")]).await;
    assert_eq!(r.header("x-tailwarden-cache"), "miss");
    let (r, _) = send(&sc, hot, &[("x-tailwarden-cache", "force")]).await;
    assert_eq!(r.header("x-tailwarden-cache"), "hit");
    assert_eq!(up.count(), 3);

    // The client bypasses the lookup; the fresh answer refreshes the entry.
    let body = request(false, "");
    send(&sc, &body, &[]).await;
    let (r, _) = send(&sc, &body, &[("x-tailwarden-cache", "bypass")]).await;
    assert_eq!(r.header("x-tailwarden-cache"), "bypass");
    assert_eq!(up.count(), 5);
    let (r, _) = send(&sc, &body, &[]).await;
    assert_eq!(r.header("x-tailwarden-cache"), "hit");
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "answer 4",
        "the bypassing request's answer replaced the entry"
    );
    // no-store: neither read nor written.
    let fresh = request(false, r#","seed":99"#);
    send(&sc, &fresh, &[("cache-control", "no-store")]).await;
    let (r, _) = send(&sc, &fresh, &[]).await;
    assert_eq!(r.header("x-tailwarden-cache"), "miss");

    // Errors and truncated streams are never stored.
    let failing = request(false, r#","tag":"fail""#);
    for _ in 0..2 {
        let (r, _) = send(&sc, &failing, &[]).await;
        assert_eq!(r.status, 500);
        assert_eq!(r.header("x-tailwarden-cache"), "miss");
    }
    let cut = request(true, r#","tag":"cut""#);
    for _ in 0..2 {
        let (r, _) = send(&sc, &cut, &[]).await;
        assert_eq!(r.header("x-tailwarden-cache"), "miss");
        assert!(r.body.contains("upstream_stream_error"), "{}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_scope_keeps_tenants_apart() {
    let up = upstream(|n, _| ok(&format!("answer {n}"))).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  rateLimit: {tenantHeader: x-tenant, requestsPerSecond: 1000}\n  cache:\n    exact: {enabled: true, scope: tenant}\n",
    ))
    .await;
    let body = request(false, "");
    let (a1, _) = send(&sc, &body, &[("x-tenant", "a")]).await;
    let (b1, _) = send(&sc, &body, &[("x-tenant", "b")]).await;
    let (a2, _) = send(&sc, &body, &[("x-tenant", "a")]).await;
    assert_eq!(a1.header("x-tailwarden-cache"), "miss");
    assert_eq!(b1.header("x-tailwarden-cache"), "miss");
    assert_eq!(a2.header("x-tailwarden-cache"), "hit");
    assert_eq!(up.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_rate_the_sidecar_answers_429_naming_the_limit_and_never_retries() {
    let up = upstream(|_, _| ok("fine")).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  rateLimit: {requestsPerSecond: 2}\n  retries: {maxAttempts: 3}\n",
    ))
    .await;
    let mut statuses = Vec::new();
    let mut rejected = None;
    for _ in 0..4 {
        let r = chat(&sc, false).await;
        statuses.push(r.status);
        if r.status == 429 {
            rejected = Some(r);
        }
    }
    assert_eq!(
        statuses,
        [200, 200, 429, 429],
        "burst of one second's worth"
    );
    let r = rejected.unwrap();
    assert_eq!(r.header("x-tailwarden-limit"), "requests_per_second");
    assert!(r.header("retry-after").parse::<u64>().unwrap() >= 1);
    let error = &r.json()["error"];
    assert_eq!(error["type"], "rate_limit_error");
    assert_eq!(error["code"], "rate_limit_exceeded");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("requests per second") && message.contains("route t/test"),
        "{message}"
    );
    assert_eq!(up.count(), 2, "rejected requests never reach a provider");
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains(r#"tailwarden_rate_limited_total{limit="requests_per_second",route="t/test",scope="route",status="429"} 2"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_reservations_are_settled_with_the_real_usage() {
    // The estimate of each request is prompt/4 + max_tokens ≈ 410 tokens; the stream uses 8
    // (its usage chunk). With 1000 tokens per minute only two requests fit unsettled; settled,
    // all ten do.
    let up = upstream(|_, body| stream_script(body)).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  rateLimit: {tokensPerMinute: 1000}\n",
    ))
    .await;
    let body = r#"{"model":"m","stream":true,"max_tokens":400,"messages":[{"role":"user","content":"hi"}]}"#;
    for i in 0..10 {
        let (r, bytes) = send(&sc, body, &[]).await;
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        assert!(bytes.ends_with(DONE.as_bytes()));
    }
    // A request whose estimate alone is over the remaining minute is refused up front.
    let huge = r#"{"model":"m","stream":true,"max_tokens":5000,"messages":[{"role":"user","content":"hi"}]}"#;
    let (r, _) = send(&sc, huge, &[]).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-tailwarden-limit"), "tokens_per_minute");
    assert_eq!(up.count(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_shed_fast_with_503_while_admitted_requests_complete() {
    let up = upstream(|_, _| Script::Respond {
        delay: Duration::from_millis(400),
        status: 200,
        headers: vec![],
        body: completion("m", "slow"),
    })
    .await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  rateLimit: {maxConcurrent: 2, maxQueued: 1, queueTimeout: 100ms}\n",
    ))
    .await;
    let sc = std::sync::Arc::new(sc);
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let sc = sc.clone();
        tasks.push(tokio::spawn(async move {
            let started = std::time::Instant::now();
            let r = chat(&sc, false).await;
            (r, started.elapsed())
        }));
    }
    let mut ok = 0;
    let mut shed = 0;
    for t in tasks {
        let (r, took) = t.await.unwrap();
        match r.status {
            200 => ok += 1,
            503 => {
                shed += 1;
                assert!(
                    took < Duration::from_millis(350),
                    "shed fast, took {took:?}"
                );
                assert_eq!(r.header("x-tailwarden-limit"), "concurrency");
                assert_eq!(r.json()["error"]["code"], "overloaded");
                assert!(!r.header("retry-after").is_empty());
            }
            other => panic!("unexpected status {other}: {}", r.body),
        }
    }
    assert_eq!(ok, 2, "two slots");
    assert_eq!(shed, 4, "the queue held one for 100 ms, then shed it");
    assert_eq!(up.count(), 2);
    // Slots are returned when responses end: the next request is admitted.
    assert_eq!(chat(&sc, false).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capability_maps_drop_parameters_or_skip_the_provider() {
    let local = upstream(|_, _| ok("local")).await;
    let cloud = upstream(|_, _| ok("cloud")).await;
    let config = format!(
        r#"apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {{name: test, namespace: t}}
spec:
  models: ['*']
  providers:
  - name: local
    baseUrl: '{}'
    priority: 0
    capabilities:
    - {{unsupported: [response_format, logprobs, stream_options], onUnsupported: drop}}
    - {{unsupported: [tools], onUnsupported: reject}}
  - name: cloud
    baseUrl: '{}'
    priority: 1
    capabilities:
    - {{unsupported: [logprobs], onUnsupported: reject}}
"#,
        local.base_url(),
        cloud.base_url()
    );
    let sc = sidecar(&config).await;

    // response_format is dropped for the local provider, which still serves it.
    let (r, _) = send(
        &sc,
        &request(false, r#","response_format":{"type":"json_object"}"#),
        &[],
    )
    .await;
    assert_eq!(r.header("x-tailwarden-provider"), "local");
    let seen = local.seen.lock().unwrap().last().unwrap().body.clone();
    let seen: serde_json::Value = serde_json::from_str(&seen).unwrap();
    assert!(seen.get("response_format").is_none(), "{seen}");
    assert_eq!(seen["temperature"], 0);

    // The sidecar does not add the stream usage request for a provider without
    // stream_options support either (that stream's usage is estimated).
    send(&sc, &request(true, ""), &[]).await;
    let seen = local.seen.lock().unwrap().last().unwrap().body.clone();
    assert!(!seen.contains("stream_options"), "{seen}");

    // tools: the local provider rejects them, so the cloud one takes the request as sent.
    let tools = request(
        false,
        r#","tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#,
    );
    let (r, _) = send(&sc, &tools, &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tailwarden-provider"), "cloud");
    let seen = cloud.seen.lock().unwrap().last().unwrap().body.clone();
    assert!(seen.contains("\"tools\""));

    // tools and logprobs: nobody takes it — a 400 naming the parameters, nothing sent.
    let before = (local.count(), cloud.count());
    let both = request(
        false,
        r#","logprobs":true,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#,
    );
    let (r, _) = send(&sc, &both, &[]).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let error = &r.json()["error"];
    assert_eq!(error["code"], "unsupported_parameter");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("`tools`") && message.contains("`logprobs`"),
        "{message}"
    );
    assert_eq!((local.count(), cloud.count()), before);
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(metrics.contains(
        r#"tailwarden_capability_actions_total{action="dropped",provider="local",route="t/test"} 1"#
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chosen_tier_is_in_the_header_and_the_metrics() {
    let up = upstream(|_, _| ok("fine")).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  tiers:\n  - {name: small, model: mini, when: {maxPromptChars: 100}}\n",
    ))
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.header("x-tailwarden-tier"), "small");
    let seen = up.seen.lock().unwrap().last().unwrap().body.clone();
    assert!(seen.contains(r#""model":"mini""#), "{seen}");
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(metrics.contains(r#"tailwarden_tier_requests_total{route="t/test",tier="small"} 1"#));
}
