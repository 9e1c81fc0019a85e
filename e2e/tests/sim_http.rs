//! The simulator over real loopback HTTP: OpenAI shapes, usage chunks, faults, fault rates,
//! cancellation counting, header controls and h2c.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{client, post, post_text, sse_payloads, start_sim, wait_stats};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tailwarden_e2e::sim::{Brownout, Profile};

const CHAT: &str =
    r#"{"model":"gpt-test","messages":[{"role":"user","content":"abcdefghijklmnop"}]}"#;

fn chat_url(sim: &tailwarden_e2e::sim::SimHandle) -> String {
    format!("{}/chat/completions", sim.base_url())
}

#[tokio::test]
async fn chat_completion_has_openai_shape_and_usage() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let (status, h, body) = post_text(&c, &chat_url(&sim), CHAT, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "gpt-test");
    assert!(v["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert!(v["created"].as_u64().expect("created") > 1_600_000_000);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // 16 chars of prompt -> 4 tokens; instant profile -> 16 output tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["usage"]["total_tokens"], 20);

    // max_tokens / max_completion_tokens bound the output.
    let capped =
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3}"#;
    let (_, _, body) = post_text(&c, &chat_url(&sim), capped, &[]).await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // Legacy completions.
    let url = format!("{}/completions", sim.base_url());
    let (status, _, body) = post_text(
        &c,
        &url,
        r#"{"model":"m","prompt":"abcd","max_tokens":2}"#,
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn stream_usage_chunk_only_when_asked() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let plain = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}],"max_tokens":5}"#;
    let (status, h, body) = post_text(&c, &chat_url(&sim), plain, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "text/event-stream");
    let (chunks, done) = sse_payloads(&body);
    assert!(done, "ends with [DONE]");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["model"] == "m")
    );
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage without include_usage"
    );
    assert!(
        chunks
            .iter()
            .all(|c| !c["choices"].as_array().expect("choices").is_empty())
    );
    let content: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(content.len(), 5);
    assert_eq!(
        chunks.last().expect("last")["choices"][0]["finish_reason"],
        "length"
    );

    let with_usage = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}],"max_tokens":5}"#;
    let (_, _, body) = post_text(&c, &chat_url(&sim), with_usage, &[]).await;
    let (chunks, done) = sse_payloads(&body);
    assert!(done);
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["choices"].as_array().expect("choices").len(), 0);
    assert_eq!(last["usage"]["completion_tokens"], 5);
    assert_eq!(last["usage"]["prompt_tokens"], 2);
    // Every other chunk carries "usage": null, like OpenAI.
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["usage"].is_null() && c.get("usage").is_some())
    );
    assert_eq!(
        chunks
            .iter()
            .filter(|c| c["choices"].as_array().is_some_and(Vec::is_empty))
            .count(),
        1
    );
}

#[tokio::test]
async fn bad_json_and_unknown_paths_use_the_openai_error_shape() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let (status, _, body) = post_text(&c, &chat_url(&sim), "{not json", &[]).await;
    assert_eq!(status, 400);
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let e = &v["error"];
    assert!(
        e["message"]
            .as_str()
            .expect("message")
            .contains("parse the JSON")
    );
    assert_eq!(e["type"], "invalid_request_error");
    assert!(e.get("param").is_some() && e.get("code").is_some());
    let (status, _, body) = post_text(&c, &format!("{}/nope", sim.base_url()), "{}", &[]).await;
    assert_eq!(status, 404);
    assert!(body.contains("\"error\""));
    assert_eq!(sim.stats().outcome("bad_request"), 1);
}

#[tokio::test]
async fn injected_faults_look_like_the_real_thing() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let url = chat_url(&sim);

    let (status, h, body) = post_text(
        &c,
        &url,
        CHAT,
        &[("x-sim-fault", "429"), ("x-sim-retry-after", "7")],
    )
    .await;
    assert_eq!(status, 429);
    assert_eq!(h["retry-after"], "7");
    assert!(body.contains("rate_limit_exceeded"));
    let (status, _, _) = post_text(&c, &url, CHAT, &[("x-sim-fault", "503")]).await;
    assert_eq!(status, 503);

    // reset: a connection error, never a response.
    let r = post(&c, &url, CHAT, &[("x-sim-fault", "reset")]).await;
    assert!(
        r.is_err(),
        "reset must not produce a response: {:?}",
        r.map(|r| r.status())
    );

    // drop: a 200 whose body fails part-way, after at least one chunk.
    let stream = r#"{"model":"m","stream":true,"messages":[]}"#;
    let resp = post(
        &c,
        &url,
        stream,
        &[("x-sim-fault", "drop"), ("x-sim-tokens", "20")],
    )
    .await
    .expect("headers arrive");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    let err = loop {
        match body.frame().await {
            Some(Ok(f)) => got.extend_from_slice(f.data_ref().map_or(&[][..], |b| &b[..])),
            Some(Err(e)) => break e,
            None => panic!("stream completed despite drop fault"),
        }
    };
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("chat.completion.chunk"),
        "some chunks arrived: {text}"
    );
    assert!(!text.contains("[DONE]"));
    drop(err);

    // invalid control header -> 400, not silently ignored.
    let (status, _, _) = post_text(&c, &url, CHAT, &[("x-sim-ttft-ms", "soon")]).await;
    assert_eq!(status, 400);

    let s = sim.stats();
    assert_eq!(s.outcome("fault_429"), 1);
    assert_eq!(s.outcome("fault_503"), 1);
    assert_eq!(s.outcome("fault_reset"), 1);
    assert_eq!(s.outcome("fault_drop"), 1);
}

/// 2000 requests at 10 % 5xx: the rate is within tolerance and, seeded, exactly repeatable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_rates_are_seeded_and_within_tolerance() {
    let profile = Profile {
        error5xx_percent: 10.0,
        ..Profile::default()
    };
    let mut counts = Vec::new();
    for _ in 0..2 {
        let sim = start_sim(&profile, 1234).await;
        let c = client();
        let url = chat_url(&sim);
        // Eight concurrent lanes: which request gets which number varies, but the set of
        // request numbers (and so the set of faults) does not.
        let mut lanes = Vec::new();
        for _ in 0..8 {
            let (c, url) = (c.clone(), url.clone());
            lanes.push(tokio::spawn(async move {
                let mut five = 0u32;
                for _ in 0..250 {
                    let (status, _, _) = post_text(&c, &url, CHAT, &[]).await;
                    if status >= 500 {
                        five += 1;
                    }
                }
                five
            }));
        }
        let mut five = 0;
        for l in lanes {
            five += l.await.expect("lane");
        }
        let s = sim.stats();
        assert_eq!(s.requests_total, 2000);
        assert_eq!(
            u64::from(five),
            s.outcome("fault_500") + s.outcome("fault_503")
        );
        counts.push(five);
    }
    assert!(
        (150..=250).contains(&counts[0]),
        "5xx count {} not ~200",
        counts[0]
    );
    assert_eq!(counts[0], counts[1], "same seed, same faults");
}

#[tokio::test]
async fn client_disconnects_are_counted_as_cancelled() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let url = chat_url(&sim);

    // A stream the client abandons after its first chunk.
    let stream = r#"{"model":"m","stream":true,"messages":[]}"#;
    let resp = post(
        &c,
        &url,
        stream,
        &[("x-sim-itl-ms", "200"), ("x-sim-tokens", "50")],
    )
    .await
    .expect("headers");
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a frame").expect("ok");
    assert!(first.is_data());
    assert_eq!(sim.stats().in_flight, 1);
    drop(body);
    let s = wait_stats(&sim, |s| s.cancelled == 1).await;
    assert_eq!(s.cancelled, 1, "abandoned stream counted: {s:?}");

    // A non-streamed request given up during its time-to-first-token.
    let slow = tokio::time::timeout(
        Duration::from_millis(200),
        post(&c, &url, CHAT, &[("x-sim-ttft-ms", "5000")]),
    )
    .await;
    assert!(slow.is_err(), "request should still be waiting");
    let s = wait_stats(&sim, |s| s.cancelled == 2 && s.in_flight == 0).await;
    assert_eq!((s.cancelled, s.in_flight), (2, 0), "{s:?}");

    // A stall the client gives up on.
    let stalled = post(&c, &url, stream, &[("x-sim-fault", "stall")])
        .await
        .expect("headers");
    assert_eq!(stalled.status(), 200);
    let mut body = stalled.into_body();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), body.frame())
            .await
            .is_err(),
        "stall sends nothing"
    );
    drop(body);
    let s = wait_stats(&sim, |s| s.cancelled == 3).await;
    assert_eq!(s.cancelled, 3);
    assert_eq!(s.outcome("fault_stall"), 1);
    // Completed requests are not cancellations.
    let _ = post_text(&c, &url, CHAT, &[]).await;
    assert_eq!(wait_stats(&sim, |s| s.in_flight == 0).await.cancelled, 3);
}

#[tokio::test]
async fn stats_report_authorization_and_endpoints() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let _ = post_text(
        &c,
        &chat_url(&sim),
        CHAT,
        &[("authorization", "Bearer sk-test-1")],
    )
    .await;
    assert_eq!(
        sim.stats().last_authorization.as_deref(),
        Some("Bearer sk-test-1")
    );
    let _ = post_text(&c, &chat_url(&sim), CHAT, &[]).await;
    assert_eq!(sim.stats().last_authorization, None);

    // Same stats over HTTP.
    let resp = c
        .get(
            format!("http://{}/sim/stats", sim.addr())
                .parse()
                .expect("uri"),
        )
        .await
        .expect("stats");
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(v["by_endpoint"]["chat_completions"], 2);
    assert_eq!(v["requests_total"], 2);
    for key in ["by_outcome", "in_flight", "cancelled", "last_authorization"] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
}

#[tokio::test]
async fn embeddings_models_and_h2c() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let url = format!("{}/embeddings", sim.base_url());
    let body = r#"{"model":"e","input":["alpha","beta"]}"#;
    let (status, _, a) = post_text(&c, &url, body, &[]).await;
    assert_eq!(status, 200);
    let (_, _, b) = post_text(&c, &url, body, &[]).await;
    assert_eq!(a, b, "deterministic vectors");
    let v: serde_json::Value = serde_json::from_str(&a).expect("json");
    assert_eq!(v["data"].as_array().expect("data").len(), 2);
    assert_eq!(v["data"][0]["embedding"].as_array().expect("vec").len(), 8);
    let (_, _, d) = post_text(&c, &url, r#"{"model":"e","input":"x","dimensions":3}"#, &[]).await;
    let v: serde_json::Value = serde_json::from_str(&d).expect("json");
    assert_eq!(v["data"][0]["embedding"].as_array().expect("vec").len(), 3);

    // h2c (prior knowledge) works too.
    let h2: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let resp = h2
        .get(format!("{}/models", sim.base_url()).parse().expect("uri"))
        .await
        .expect("h2 response");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(v["object"], "list");
    assert!(!v["data"].as_array().expect("data").is_empty());
}

#[tokio::test]
async fn brownout_windows_raise_errors() {
    let profile = Profile {
        brownouts: vec![Brownout {
            start_s: 0.0,
            duration_s: 3600.0,
            every_s: None,
            latency_multiplier: Some(2.0),
            error_percent: Some(100.0),
            rate_limit_percent: None,
            retry_after_seconds: None,
        }],
        ..Profile::default()
    };
    let sim = start_sim(&profile, 42).await;
    let c = client();
    for _ in 0..5 {
        let (status, _, _) = post_text(&c, &chat_url(&sim), CHAT, &[]).await;
        assert_eq!(status, 503);
    }
    let s = sim.stats();
    assert!(s.brownout_active);
    assert_eq!(s.outcome("fault_503"), 5);
}

/// `/v1/responses`: a whole response, a typed event stream ending in `response.completed`
/// (no `[DONE]`), `response.incomplete` at the output cap, and the faults before content
/// (`fail-before-content`: created, in progress, then `response.failed`) and after it
/// (`drop`: the stream is cut after some deltas).
#[tokio::test]
async fn responses_api_stream_and_not_with_faults() {
    let sim = start_sim(&Profile::default(), 42).await;
    let c = client();
    let url = format!("{}/responses", sim.base_url());
    let (status, h, body) = post_text(
        &c,
        &url,
        r#"{"model":"m","input":"hello there","max_output_tokens":3}"#,
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "incomplete");
    assert!(v["id"].as_str().expect("id").starts_with("resp_"));
    assert_eq!(v["usage"]["output_tokens"], 3);
    assert_eq!(v["usage"]["input_tokens"], 3, "11 chars / 4");

    let stream = r#"{"model":"m","input":"hello","stream":true,"max_output_tokens":50}"#;
    let (status, h, body) = post_text(&c, &url, stream, &[("x-sim-tokens", "4")]).await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "text/event-stream");
    let types: Vec<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| {
            let v: serde_json::Value = serde_json::from_str(d).expect("json");
            v["type"].as_str().expect("type").to_owned()
        })
        .collect();
    assert_eq!(types.first().map(String::as_str), Some("response.created"));
    assert_eq!(types.last().map(String::as_str), Some("response.completed"));
    assert_eq!(
        types
            .iter()
            .filter(|t| *t == "response.output_text.delta")
            .count(),
        4
    );
    assert!(!body.contains("[DONE]"));

    let (status, _, body) =
        post_text(&c, &url, stream, &[("x-sim-fault", "fail-before-content")]).await;
    assert_eq!(status, 200);
    assert!(body.contains("event: response.failed"));
    assert!(!body.contains("output_text.delta"));

    let resp = common::post(
        &c,
        &url,
        stream,
        &[("x-sim-fault", "drop"), ("x-sim-tokens", "6")],
    )
    .await
    .expect("response");
    assert_eq!(resp.status(), 200);
    let mut body_stream = resp.into_body();
    let mut body = String::new();
    let mut cut = false;
    while let Some(frame) = http_body_util::BodyExt::frame(&mut body_stream).await {
        match frame {
            Ok(f) => body.push_str(&String::from_utf8_lossy(&f.into_data().unwrap_or_default())),
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    assert!(cut, "the body ends in an error");
    assert!(
        body.contains("response.output_text.delta"),
        "content came first"
    );
    assert!(!body.contains("response.completed"), "then the cut");
    assert_eq!(sim.stats().outcome("fault_drop"), 1);
}
