//! The Responses API (`POST /v1/responses`) through the real request path: routed like
//! chat, sent to the provider's `/responses` unchanged (no `stream_options` added), a stream
//! committed only at its first content event — so `response.failed`, an `error` or a reset
//! after `response.created` still fails over to the other provider and the client sees one
//! complete stream — and a failure after content ends the stream with a well-formed
//! `error` event numbered after the last one. Usage from every terminal event (completed,
//! incomplete, failed) and estimated for a client that leaves; the exact cache only for
//! stateless requests.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{
    access::{access_line, log_lines},
    *,
};
use http::Request;
use http_body_util::BodyExt;
use serde_json::{Value, json};

/// One Responses SSE event.
fn ev(kind: &str, seq: u64, extra: Value) -> String {
    let mut data = json!({"type": kind, "sequence_number": seq});
    if let (Value::Object(d), Value::Object(e)) = (&mut data, extra) {
        d.extend(e);
    }
    format!("event: {kind}\ndata: {data}\n\n")
}

fn created(seq: u64) -> String {
    ev(
        "response.created",
        seq,
        json!({"response": {"id": "resp_a", "object": "response", "model": "m", "status": "in_progress", "output": [], "usage": null}}),
    )
}

fn delta(seq: u64, text: &str) -> String {
    ev(
        "response.output_text.delta",
        seq,
        json!({"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": text}),
    )
}

fn terminal(kind: &str, seq: u64, id: &str) -> String {
    let status = kind.trim_start_matches("response.");
    ev(
        kind,
        seq,
        json!({"response": {"id": id, "object": "response", "model": "m", "status": status,
            "usage": {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 3},
                      "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 16}}}),
    )
}

fn stream(chunks: Vec<String>, end: StreamEnd) -> Script {
    Script::Stream {
        first_delay: Duration::ZERO,
        chunks: chunks.into_iter().map(|c| (Duration::ZERO, c)).collect(),
        end,
    }
}

fn complete_stream(id: &str) -> Vec<String> {
    vec![
        created(0).replace("resp_a", id),
        delta(1, "Hel"),
        delta(2, "lo"),
        terminal("response.completed", 3, id),
    ]
}

async fn send(sc: &Sidecar, id: &str, body: &Value) -> (u16, http::HeaderMap, String) {
    let req = Request::post(sc.url("/v1/responses"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        status,
        parts.headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// The `data:` payloads of an SSE body.
fn events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn two_providers(a: &Upstream, b: &Upstream, extra: &str) -> String {
    route(
        &[("a", &a.base_url(), 1, 0), ("b", &b.base_url(), 1, 1)],
        &format!("  retries: {{maxAttempts: 3, backoff: {{base: 1ms, max: 2ms}}}}\n{extra}"),
    )
}

#[tokio::test]
async fn non_stream_goes_to_the_providers_responses_unchanged() {
    log_lines();
    let body = json!({"id": "resp_n", "object": "response", "status": "completed", "model": "m",
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi", "annotations": []}]}],
        "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}});
    let text = body.to_string();
    let a = upstream(move |_, _| Script::Respond {
        delay: Duration::ZERO,
        status: 200,
        headers: vec![],
        body: text.clone(),
    })
    .await;
    let sc = sidecar(&route(&[("a", &a.base_url(), 1, 0)], "")).await;
    let request = json!({"model": "m", "input": "hi", "stream": false});
    let (status, headers, reply) = send(&sc, "resp-ns", &request).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(serde_json::from_str::<Value>(&reply).unwrap(), body);
    assert_eq!(headers["x-tailwarden-provider"], "a");
    let seen = a.seen.lock().unwrap()[0].clone();
    assert_eq!(seen.path, "POST /v1/responses");
    assert_eq!(
        serde_json::from_str::<Value>(&seen.body).unwrap(),
        request,
        "forwarded as sent"
    );
    let line = access_line("resp-ns").await;
    assert_eq!(line["input_tokens"], 7);
    assert_eq!(line["output_tokens"], 2);
    assert_eq!(line["usage_estimated"], false);
}

#[tokio::test]
async fn a_stream_is_not_asked_for_a_usage_chunk() {
    let a = upstream(|_, _| stream(complete_stream("resp_s"), StreamEnd::Finish)).await;
    let sc = sidecar(&route(&[("a", &a.base_url(), 1, 0)], "")).await;
    let request = json!({"model": "m", "input": "hi", "stream": true});
    let (status, headers, body) = send(&sc, "resp-s", &request).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(body, complete_stream("resp_s").concat(), "byte for byte");
    let seen = a.seen.lock().unwrap()[0].clone();
    assert_eq!(serde_json::from_str::<Value>(&seen.body).unwrap(), request);
}

/// `response.failed`, an `error` event, or a reset after `response.created` but before any
/// content: the client gets one complete stream, from the other provider.
#[tokio::test]
async fn failures_before_content_fail_over() {
    log_lines();
    let cases: [(&str, Vec<String>, StreamEnd); 3] = [
        (
            "failed",
            vec![
                created(0),
                ev(
                    "response.in_progress",
                    1,
                    json!({"response": {"id": "resp_a"}}),
                ),
                terminal("response.failed", 2, "resp_a"),
            ],
            StreamEnd::Finish,
        ),
        (
            "error",
            vec![
                created(0),
                ev(
                    "error",
                    1,
                    json!({"code": "insufficient_quota", "message": "quota", "param": null}),
                ),
            ],
            StreamEnd::Finish,
        ),
        ("reset", vec![created(0)], StreamEnd::Abort),
    ];
    for (name, first, end) in cases {
        let a = upstream(move |_, _| stream(first.clone(), end)).await;
        let b = upstream(|_, _| stream(complete_stream("resp_b"), StreamEnd::Finish)).await;
        let sc = sidecar(&two_providers(&a, &b, "")).await;
        let id = format!("failover-{name}");
        let (status, headers, body) = send(
            &sc,
            &id,
            &json!({"model": "m", "input": "hi", "stream": true}),
        )
        .await;
        assert_eq!(status, 200, "{name}");
        assert_eq!(headers["x-tailwarden-provider"], "b", "{name}");
        assert_eq!(headers["x-tailwarden-attempts"], "2", "{name}");
        assert_eq!(
            body,
            complete_stream("resp_b").concat(),
            "{name}: only b's stream, whole"
        );
        assert_eq!((a.count(), b.count()), (1, 1), "{name}");
        let line = access_line(&id).await;
        assert_eq!(line["provider"], "b");
        assert_eq!(line["input_tokens"], 11, "{name}");
    }
}

/// After content the client is committed: a reset, a stall past the idle timeout and a
/// clean close without a terminal event each end the stream with an `error` event
/// numbered after the last one the client saw — never a silent cut — and nothing is
/// retried.
#[tokio::test]
async fn failures_after_content_end_with_an_error_event() {
    let cases = [
        ("reset", StreamEnd::Abort, "upstream_stream_error"),
        ("closed", StreamEnd::Finish, "upstream_stream_error"),
        ("stalled", StreamEnd::Stall, "idle_timeout"),
    ];
    for (name, end, code) in cases {
        let a = upstream(move |_, _| stream(vec![created(0), delta(1, "Hel")], end)).await;
        let b = upstream(|_, _| stream(complete_stream("resp_b"), StreamEnd::Finish)).await;
        let sc = sidecar(&two_providers(&a, &b, "  timeouts: {idle: 300ms}\n")).await;
        let (status, _, body) = send(
            &sc,
            &format!("after-{name}"),
            &json!({"model": "m", "input": "hi", "stream": true}),
        )
        .await;
        assert_eq!(status, 200);
        assert!(
            body.starts_with(&[created(0), delta(1, "Hel")].concat()),
            "{name}: {body}"
        );
        let last = events(&body).pop().unwrap();
        assert_eq!(last["type"], "error", "{name}: {body}");
        assert_eq!(last["code"], code, "{name}");
        assert_eq!(last["sequence_number"], 2, "{name}");
        assert!(last["param"].is_null() && last["message"].is_string());
        assert!(body.contains("event: error\ndata: "), "{name}");
        assert!(body.ends_with("\n\n"), "{name}");
        assert_eq!(b.count(), 0, "{name}: never retried after content");
    }
}

/// Usage from the terminal event whichever it is; estimated, and the upstream cancelled,
/// when the client leaves mid-stream.
#[tokio::test]
async fn usage_on_every_end() {
    log_lines();
    for kind in [
        "response.completed",
        "response.incomplete",
        "response.failed",
    ] {
        let chunks = vec![created(0), delta(1, "x"), terminal(kind, 2, "resp_u")];
        let a = upstream(move |_, _| stream(chunks.clone(), StreamEnd::Finish)).await;
        let sc = sidecar(&format!(
            "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: test, namespace: t}}\nspec:\n  models: ['*']\n  providers:\n  - name: a\n    baseUrl: '{}'\n    pricing:\n    - {{model: m, inputPerMTok: \"2.00\", cachedInputPerMTok: \"1.00\", outputPerMTok: \"10.00\"}}\n",
            a.base_url()
        ))
        .await;
        let id = format!("usage-{kind}");
        let (status, _, body) = send(
            &sc,
            &id,
            &json!({"model": "m", "input": "hi", "stream": true}),
        )
        .await;
        assert_eq!(status, 200);
        assert!(body.ends_with(&terminal(kind, 2, "resp_u")), "{kind}");
        let line = access_line(&id).await;
        assert_eq!(line["input_tokens"], 11, "{kind}");
        assert_eq!(line["cached_input_tokens"], 3, "{kind}");
        assert_eq!(line["output_tokens"], 5, "{kind}");
        assert_eq!(line["reasoning_tokens"], 2, "{kind}");
        assert_eq!(line["usage_estimated"], false, "{kind}");
        // 8 × 2 + 3 × 1 + 5 × 10 = 69 per million.
        assert_eq!(line["cost"], "0.000069", "{kind}");
    }

    // The client reads the first content event and leaves.
    let a = upstream(|_, _| stream(vec![created(0), delta(1, "Hel")], StreamEnd::Stall)).await;
    let sc = sidecar(&route(&[("a", &a.base_url(), 1, 0)], "")).await;
    let req = Request::post(sc.url("/v1/responses"))
        .header("content-type", "application/json")
        .header("x-request-id", "usage-left")
        .body(http_body_util::Full::new(Bytes::from(
            json!({"model": "m", "input": "hi", "stream": true}).to_string(),
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    let mut seen = String::new();
    while !seen.contains("response.output_text.delta") {
        let frame = body.frame().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap()));
    }
    drop(body);
    let line = access_line("usage-left").await;
    assert_eq!(line["error_type"], "client_closed");
    assert_eq!(line["usage_estimated"], true);
    assert_eq!(line["output_tokens"], 1, "one content event counted");
    assert!(
        wait_until(Duration::from_secs(5), || !a.cancellations().is_empty()).await,
        "the upstream stream is cancelled"
    );
}

#[tokio::test]
async fn only_stateless_requests_are_cached() {
    let a = upstream(|n, _| Script::Respond {
        delay: Duration::ZERO,
        status: 200,
        headers: vec![],
        body: json!({"id": format!("resp_{n}"), "object": "response", "status": "completed", "output": []}).to_string(),
    })
    .await;
    let sc = sidecar(&route(
        &[("a", &a.base_url(), 1, 0)],
        "  cache:\n    exact: {enabled: true, deterministicOnly: false}\n",
    ))
    .await;
    let stateless = json!({"model": "m", "input": "hi", "store": false});
    let (_, h1, _) = send(&sc, "c1", &stateless).await;
    let (_, h2, b2) = send(&sc, "c2", &stateless).await;
    assert_eq!(h1["x-tailwarden-cache"], "miss");
    assert_eq!(h2["x-tailwarden-cache"], "hit");
    assert!(b2.contains("resp_0"));
    for stateful in [
        json!({"model": "m", "input": "hi"}),
        json!({"model": "m", "input": "hi", "store": false, "previous_response_id": "resp_0"}),
        json!({"model": "m", "input": "hi", "store": false, "conversation": "conv_1"}),
    ] {
        let (_, h, _) = send(&sc, "c3", &stateful).await;
        let (_, h4, _) = send(&sc, "c4", &stateful).await;
        assert_eq!(h["x-tailwarden-cache"], "bypass", "{stateful}");
        assert_eq!(h4["x-tailwarden-cache-reason"], "stateful", "{stateful}");
    }
    assert_eq!(a.count(), 7);
}

fn stored_response(id: &str) -> Script {
    Script::Respond {
        delay: Duration::ZERO,
        status: 200,
        headers: vec![],
        body: json!({"id": id, "object": "response", "status": "completed", "model": "m", "output": []})
            .to_string(),
    }
}

/// Two equal providers: a follow-up (`previous_response_id`, `conversation`) goes to the
/// provider that created the response, every time, however the balancer would choose.
#[tokio::test]
async fn follow_ups_go_to_the_owner() {
    let a = upstream(|n, _| stored_response(&format!("resp_a{n}"))).await;
    let b = upstream(|n, _| stored_response(&format!("resp_b{n}"))).await;
    let sc = sidecar(&route(
        &[("a", &a.base_url(), 1, 0), ("b", &b.base_url(), 1, 0)],
        "",
    ))
    .await;
    let (status, headers, body) = send(
        &sc,
        "owner-0",
        &json!({"model": "m", "input": "hi", "conversation": "conv_1"}),
    )
    .await;
    assert_eq!(status, 200);
    let owner = headers["x-tailwarden-provider"]
        .to_str()
        .unwrap()
        .to_owned();
    let id = serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    for i in 0..12 {
        let follow_up = if i % 2 == 0 {
            json!({"model": "m", "input": "and?", "previous_response_id": id})
        } else {
            json!({"model": "m", "input": "and?", "conversation": {"id": "conv_1"}})
        };
        let (status, headers, _) = send(&sc, &format!("owner-{}", i + 1), &follow_up).await;
        assert_eq!(status, 200);
        assert_eq!(
            headers["x-tailwarden-provider"],
            owner.as_str(),
            "follow-up {i}"
        );
    }
    let other = if owner == "a" { &b } else { &a };
    assert_eq!(other.count(), 0, "the other provider never saw a follow-up");
    // An id the sidecar does not know (made before a restart, or elsewhere) is routed as
    // usual: the provider answers for it.
    let (status, _, _) = send(
        &sc,
        "unknown-id",
        &json!({"model": "m", "input": "and?", "previous_response_id": "resp_elsewhere"}),
    )
    .await;
    assert_eq!(status, 200);
}

/// The owner's breaker is open: the follow-up gets a clear 503 naming the owner and the
/// reason, and the other provider never sees it.
#[tokio::test]
async fn a_follow_up_whose_owner_is_down_is_refused_not_rerouted() {
    let a = upstream(|n, _| {
        if n == 0 {
            stream(complete_stream("resp_own"), StreamEnd::Finish)
        } else {
            status(500)
        }
    })
    .await;
    let b = upstream(|_, _| stream(complete_stream("resp_b"), StreamEnd::Finish)).await;
    let sc = sidecar(&two_providers(
        &a,
        &b,
        "  circuitBreaker: {consecutiveFailures: 3, openFor: 60s}\n",
    ))
    .await;
    let (status_code, headers, _) = send(
        &sc,
        "down-0",
        &json!({"model": "m", "input": "hi", "stream": true}),
    )
    .await;
    assert_eq!(
        (status_code, &headers["x-tailwarden-provider"]),
        (200, &"a".parse::<http::HeaderValue>().unwrap())
    );
    // Three requests fail on a (and are answered by b): a's breaker opens.
    for i in 1..=3 {
        let (s, h, _) = send(
            &sc,
            &format!("down-{i}"),
            &json!({"model": "m", "input": "x", "stream": true}),
        )
        .await;
        assert_eq!(
            (s, h["x-tailwarden-provider"].to_str().unwrap()),
            (200, "b")
        );
    }
    assert_eq!(a.count(), 4);
    let before_b = b.count();
    let (s, _, body) = send(
        &sc,
        "down-follow-up",
        &json!({"model": "m", "input": "and?", "stream": true, "previous_response_id": "resp_own"}),
    )
    .await;
    assert_eq!(s, 503, "{body}");
    let error = &serde_json::from_str::<Value>(&body).unwrap()["error"];
    assert_eq!(error["code"], "owner_unavailable");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("resp_own") && message.contains("provider a"),
        "{message}"
    );
    assert!(message.contains("circuit breaker open"), "{message}");
    assert_eq!(a.count(), 4, "the open breaker keeps a out");
    assert_eq!(b.count(), before_b, "b never saw the follow-up");
    assert!(
        b.seen
            .lock()
            .unwrap()
            .iter()
            .all(|s| !s.body.contains("resp_own")),
        "nothing with the owner's id reached b"
    );
}

async fn call(sc: &Sidecar, method: &str, path: &str) -> (u16, http::HeaderMap, String) {
    let req = Request::builder()
        .method(method)
        .uri(sc.url(path))
        .header("authorization", "Bearer client-key")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        status,
        parts.headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// `GET`, `cancel`, `input_items` and `DELETE` of a response go to the provider that created
/// it (here b, the primary), not to the home provider (a, listed first); once deleted, the
/// id is forgotten and goes to the home provider like any unknown id.
#[tokio::test]
async fn retrieve_cancel_items_and_delete_go_to_the_owner() {
    let a = upstream(|_, _| stored_response("resp_home")).await;
    let b = upstream(|n, _| stored_response(&format!("resp_b{n}"))).await;
    let sc = sidecar(&route(
        &[("a", &a.base_url(), 1, 1), ("b", &b.base_url(), 1, 0)],
        "",
    ))
    .await;
    let (status, headers, _) = send(&sc, "own-0", &json!({"model": "m", "input": "hi"})).await;
    assert_eq!(
        (status, headers["x-tailwarden-provider"].to_str().unwrap()),
        (200, "b")
    );
    for (method, path) in [
        ("GET", "/v1/responses/resp_b0"),
        ("GET", "/v1/responses/resp_b0/input_items"),
        ("POST", "/v1/responses/resp_b0/cancel"),
        ("DELETE", "/v1/responses/resp_b0"),
    ] {
        let (status, headers, _) = call(&sc, method, path).await;
        assert_eq!(status, 200, "{method} {path}");
        assert_eq!(headers["x-tailwarden-provider"], "b", "{method} {path}");
    }
    assert_eq!(a.count(), 0, "the home provider saw none of them");
    let seen: Vec<String> = b
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.path.clone())
        .collect();
    assert_eq!(
        seen,
        [
            "POST /v1/responses",
            "GET /v1/responses/resp_b0",
            "GET /v1/responses/resp_b0/input_items",
            "POST /v1/responses/resp_b0/cancel",
            "DELETE /v1/responses/resp_b0",
        ]
    );
    for s in b.seen.lock().unwrap().iter() {
        assert!(s.headers.get("authorization").is_none(), "{}", s.path);
    }
    let (status, headers, _) = call(&sc, "GET", "/v1/responses/resp_b0").await;
    assert_eq!(
        (status, headers["x-tailwarden-provider"].to_str().unwrap()),
        (200, "a")
    );
}

/// The owner's breaker is open: retrieving the response is a 503 naming the owner and the
/// reason, and the other provider never sees the request.
#[tokio::test]
async fn retrieving_from_an_owner_that_is_down_is_refused() {
    let a = upstream(|n, _| {
        if n == 0 {
            stored_response("resp_gone")
        } else {
            status(500)
        }
    })
    .await;
    let b = upstream(|_, _| stored_response("resp_b")).await;
    let sc = sidecar(&two_providers(
        &a,
        &b,
        "  circuitBreaker: {consecutiveFailures: 3, openFor: 60s}\n",
    ))
    .await;
    let (s, h, _) = send(&sc, "gone-0", &json!({"model": "m", "input": "hi"})).await;
    assert_eq!(
        (s, h["x-tailwarden-provider"].to_str().unwrap()),
        (200, "a")
    );
    for i in 1..=3 {
        let (s, _, _) = send(
            &sc,
            &format!("gone-{i}"),
            &json!({"model": "m", "input": "x"}),
        )
        .await;
        assert_eq!(s, 200);
    }
    let before = (a.count(), b.count());
    let (s, _, body) = call(&sc, "GET", "/v1/responses/resp_gone").await;
    assert_eq!(s, 503, "{body}");
    let error = &serde_json::from_str::<Value>(&body).unwrap()["error"];
    assert_eq!(error["code"], "owner_unavailable");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("resp_gone") && message.contains("circuit breaker open"),
        "{message}"
    );
    assert_eq!((a.count(), b.count()), before, "nobody saw the request");
}
