//! The resilient data path over real loopback HTTP: retries, fallback, deadlines, hedging,
//! cancellation, Retry-After and the retry budget, against scripted upstreams.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;

const MS: fn(u64) -> Duration = Duration::from_millis;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_503_succeeds_on_another_provider() {
    let primary = upstream(|_, _| status(503)).await;
    let backup = upstream(|_, _| ok("from backup")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "  retries: {maxAttempts: 3, backoff: {base: 1ms, max: 5ms}}\n",
    ))
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    assert_eq!(r.header("x-tailwarden-attempts"), "2");
    assert_eq!(r.json()["choices"][0]["message"]["content"], "from backup");
    assert_eq!(primary.count(), 1);
    assert_eq!(backup.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_retryable_4xx_is_passed_through_once() {
    let primary = upstream(|_, _| status(400)).await;
    let backup = upstream(|_, _| ok("never")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "",
    ))
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["message"], "scripted 400");
    assert_eq!(primary.count(), 1);
    assert_eq!(backup.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_after_first_byte_is_not_retried_and_ends_with_an_sse_error() {
    let primary = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: vec![
            (Duration::ZERO, sse_chunk("Hel")),
            (MS(20), sse_chunk("lo")),
        ],
        end: StreamEnd::Abort,
    })
    .await;
    let backup = upstream(|_, _| ok("never")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "",
    ))
    .await;
    let r = chat(&sc, true).await;
    assert_eq!(r.status, 200);
    assert!(r.body.starts_with(&sse_chunk("Hel")), "{}", r.body);
    assert!(r.body.contains(&sse_chunk("lo")), "{}", r.body);
    let last = r.body.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("data: {\"error\":"),
        "stream must end with an error event: {}",
        r.body
    );
    assert!(last.contains("upstream_stream_error"), "{last}");
    assert_eq!(backup.count(), 0, "no retry after the first byte");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_before_first_byte_is_retried() {
    let primary = upstream(|_, _| Script::Reset).await;
    let backup = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: vec![
            (Duration::ZERO, sse_chunk("ok")),
            (Duration::ZERO, DONE.to_string()),
        ],
        end: StreamEnd::Finish,
    })
    .await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "  retries: {backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let r = chat(&sc, true).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    assert_eq!(r.body, format!("{}{}", sse_chunk("ok"), DONE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_chunk_requested_for_accounting_is_stripped_from_the_client_stream() {
    let primary = upstream(|_, body| {
        assert!(
            body.contains(r#""stream_options":{"include_usage":true}"#),
            "sidecar asks for usage: {body}"
        );
        Script::Stream {
            first_delay: Duration::ZERO,
            chunks: vec![
                (Duration::ZERO, sse_chunk("a")),
                (Duration::ZERO, sse_usage()),
                (Duration::ZERO, DONE.to_string()),
            ],
            end: StreamEnd::Finish,
        }
    })
    .await;
    let sc = sidecar(&route(&[("primary", &primary.base_url(), 100, 0)], "")).await;
    let r = chat(&sc, true).await;
    assert_eq!(
        r.body,
        format!("{}{}", sse_chunk("a"), DONE),
        "usage-only chunk removed"
    );

    // A client that asked for usage gets it.
    let r = post(
        &sc,
        "/v1/chat/completions",
        r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
    )
    .await;
    assert_eq!(r.body, format!("{}{}{}", sse_chunk("a"), sse_usage(), DONE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_byte_deadline_fires_and_falls_back() {
    let primary = upstream(|_, _| Script::Stall).await;
    let backup = upstream(|_, _| ok("backup")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "  timeouts: {firstByte: 200ms, idle: 1s, total: 5s}\n  retries: {backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let t = Instant::now();
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    let took = t.elapsed();
    assert!(took >= MS(200) && took < MS(1500), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_deadline_cuts_a_stalled_stream_with_an_error_event() {
    let primary = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: vec![(Duration::ZERO, sse_chunk("x"))],
        end: StreamEnd::Stall,
    })
    .await;
    let sc = sidecar(&route(
        &[("primary", &primary.base_url(), 100, 0)],
        "  timeouts: {firstByte: 5s, idle: 300ms, total: 10s}\n",
    ))
    .await;
    let t = Instant::now();
    let r = chat(&sc, true).await;
    let took = t.elapsed();
    assert!(took >= MS(300) && took < MS(2000), "took {took:?}");
    assert!(r.body.contains("idle_timeout"), "{}", r.body);
    // The stalled upstream stream was abandoned.
    tokio::time::sleep(MS(100)).await;
    assert_eq!(primary.cancellations().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn total_deadline_bounds_every_request() {
    // A stream that keeps trickling (never idle) is still cut at the total deadline.
    let primary = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: (0..100).map(|_| (MS(50), sse_chunk("."))).collect(),
        end: StreamEnd::Finish,
    })
    .await;
    let sc = sidecar(&route(
        &[("primary", &primary.base_url(), 100, 0)],
        "  timeouts: {connect: 100ms, firstByte: 500ms, idle: 500ms, total: 600ms}\n",
    ))
    .await;
    let t = Instant::now();
    let r = chat(&sc, true).await;
    let took = t.elapsed();
    assert!(took >= MS(550) && took < MS(1500), "took {took:?}");
    assert!(r.body.contains("total_timeout"), "{}", r.body);

    // A provider that never answers: 504 at the total deadline, not later.
    let stall = upstream(|_, _| Script::Stall).await;
    let sc = sidecar(&route(
        &[("stall", &stall.base_url(), 100, 0)],
        "  timeouts: {connect: 100ms, firstByte: 400ms, idle: 400ms, total: 400ms}\n  retries: {maxAttempts: 1}\n",
    ))
    .await;
    let t = Instant::now();
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(t.elapsed() < MS(1500));
    assert_eq!(r.json()["error"]["type"], "server_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_upstream_request_quickly() {
    let primary = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: (0..1000).map(|_| (MS(10), sse_chunk("."))).collect(),
        end: StreamEnd::Finish,
    })
    .await;
    let sc = sidecar(&route(&[("primary", &primary.base_url(), 100, 0)], "")).await;
    let req = http::Request::post(sc.url("/v1/chat/completions"))
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"m","stream":true,"messages":[]}"#,
        )))
        .unwrap();
    let client = client();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    tokio::time::sleep(MS(100)).await;
    let dropped_at = Instant::now();
    drop(resp);
    drop(client);
    let deadline = dropped_at + Duration::from_secs(2);
    while primary.cancellations().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(MS(5)).await;
    }
    let seen = primary.cancellations();
    assert_eq!(seen.len(), 1, "upstream saw the cancellation");
    let lag = seen[0].saturating_duration_since(dropped_at);
    assert!(lag < MS(100), "cancellation reached upstream after {lag:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedge_returns_the_faster_provider_and_cancels_the_slow_one() {
    let slow = upstream(|_, _| Script::Respond {
        delay: Duration::from_secs(5),
        status: 200,
        headers: vec![],
        body: completion("m", "slow"),
    })
    .await;
    let fast = upstream(|_, _| ok("fast")).await;
    // The slow one gets every first attempt; the hedge goes to the next tier.
    let sc = sidecar(&route(
        &[
            ("slow", &slow.base_url(), 100, 0),
            ("fast", &fast.base_url(), 100, 1),
        ],
        "  hedging: {enabled: true, delay: 100ms, maxPercent: 100}\n",
    ))
    .await;
    let t = Instant::now();
    let r = chat(&sc, false).await;
    let took = t.elapsed();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tailwarden-provider"), "fast");
    assert_eq!(r.json()["choices"][0]["message"]["content"], "fast");
    assert!(took >= MS(100) && took < MS(1000), "took {took:?}");
    tokio::time::sleep(MS(100)).await;
    assert_eq!(
        slow.cancellations().len(),
        1,
        "the losing attempt was cancelled"
    );
}

/// A lone 429 is about that request: it is retried on another provider at once, and its
/// provider stays in rotation for the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_429_is_retried_elsewhere_and_keeps_its_provider_in_rotation() {
    let primary = upstream(|n, _| {
        if n == 0 {
            Script::Respond {
                delay: Duration::ZERO,
                status: 429,
                headers: vec![("retry-after", "2".into())],
                body: "{}".into(),
            }
        } else {
            ok("primary")
        }
    })
    .await;
    let backup = upstream(|_, _| ok("backup")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        // A backoff of 60 s × jitter: one the retry waited for would (in 11 of 12 draws)
        // show as seconds, or be past the 30 s deadline and not happen at all.
        "  retries: {backoff: {base: 60s, max: 60s}}\n  timeouts: {total: 30s}\n",
    ))
    .await;
    let started = Instant::now();
    let r = chat(&sc, false).await;
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    assert!(
        started.elapsed() < MS(5000),
        "retried at once, not after a backoff: {:?}",
        started.elapsed()
    );
    assert_eq!(backup.count(), 1);
    let r = chat(&sc, false).await;
    assert_eq!(
        r.header("x-tailwarden-provider"),
        "primary",
        "still in rotation"
    );
    assert_eq!(primary.count(), 2);
}

/// A provider-wide 429 (the account is spent: `x-ratelimit-remaining-requests: 0`) takes
/// its provider out of rotation for the `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_keeps_the_provider_out_of_rotation() {
    let primary = upstream(|n, _| {
        if n == 0 {
            Script::Respond {
                delay: Duration::ZERO,
                status: 429,
                headers: vec![
                    ("retry-after", "2".into()),
                    ("x-ratelimit-remaining-requests", "0".into()),
                ],
                body: "{}".into(),
            }
        } else {
            ok("primary")
        }
    })
    .await;
    let backup = upstream(|_, _| ok("backup")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "  retries: {backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let cooled_at = Instant::now();
    let r = chat(&sc, false).await;
    // The 429 came between the two instants: the cool-down ends between cooled_at + 2 s
    // and answered + 2 s, however long a loaded machine took to answer.
    let answered = Instant::now();
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    // Requests that start well within the 2 s all go to the backup.
    while cooled_at.elapsed() < MS(1500) {
        let r = chat(&sc, false).await;
        assert_eq!(r.header("x-tailwarden-provider"), "backup");
        tokio::time::sleep(MS(100)).await;
    }
    assert_eq!(primary.count(), 1);
    tokio::time::sleep(MS(2300).saturating_sub(answered.elapsed())).await;
    let r = chat(&sc, false).await;
    assert_eq!(
        r.header("x-tailwarden-provider"),
        "primary",
        "back in rotation after Retry-After"
    );
}

/// OpenAI's precise headers set the cool-down: `retry-after-ms` over `Retry-After`, and a
/// 429 with neither takes the reset of its exhausted limit (`x-ratelimit-reset-requests`
/// when no requests remain), not the other limit's much later reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_ms_and_rate_limit_resets_set_the_cool_down() {
    for headers in [
        vec![
            ("retry-after-ms", "700".to_string()),
            ("retry-after", "30".to_string()),
            // Provider-wide, so that it cools the provider at all (a lone 429 does not).
            ("x-ratelimit-remaining-requests", "0".to_string()),
        ],
        vec![
            ("x-ratelimit-remaining-requests", "0".to_string()),
            ("x-ratelimit-reset-requests", "700ms".to_string()),
            ("x-ratelimit-remaining-tokens", "90000".to_string()),
            ("x-ratelimit-reset-tokens", "30s".to_string()),
        ],
    ] {
        let scripted = headers.clone();
        let primary = upstream(move |n, _| {
            if n == 0 {
                Script::Respond {
                    delay: Duration::ZERO,
                    status: 429,
                    headers: scripted.clone(),
                    body: "{}".into(),
                }
            } else {
                ok("primary")
            }
        })
        .await;
        let backup = upstream(|_, _| ok("backup")).await;
        let sc = sidecar(&route(
            &[
                ("primary", &primary.base_url(), 100, 0),
                ("backup", &backup.base_url(), 100, 1),
            ],
            "  retries: {backoff: {base: 1ms, max: 2ms}}\n",
        ))
        .await;
        let cooled_at = Instant::now();
        let r = chat(&sc, false).await;
        // The 429 came between the two instants (see retry_after_keeps_the_provider_out_of_rotation).
        let answered = Instant::now();
        assert_eq!(r.header("x-tailwarden-provider"), "backup", "{headers:?}");
        if cooled_at.elapsed() < MS(400) {
            let r = chat(&sc, false).await;
            assert_eq!(r.header("x-tailwarden-provider"), "backup", "{headers:?}");
        }
        tokio::time::sleep(MS(1000).saturating_sub(answered.elapsed())).await;
        let r = chat(&sc, false).await;
        assert_eq!(
            r.header("x-tailwarden-provider"),
            "primary",
            "back after 700 ms, not 30 s: {headers:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_and_traffic_moves_to_the_fallback() {
    let primary = upstream(|_, _| status(500)).await;
    let backup = upstream(|_, _| ok("backup")).await;
    let sc = sidecar(&route(
        &[("primary", &primary.base_url(), 100, 0), ("backup", &backup.base_url(), 100, 1)],
        "  retries: {backoff: {base: 1ms, max: 2ms}, budgetPercent: 100}\n  circuitBreaker: {consecutiveFailures: 3, openFor: 30s}\n",
    ))
    .await;
    for _ in 0..10 {
        let r = chat(&sc, false).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(
        primary.count(),
        3,
        "after 3 failures the breaker stops traffic to primary"
    );
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains("tailwarden_circuit_breaker_transitions_total"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_budget_caps_retries_in_a_failure_storm() {
    let a = upstream(|_, _| status(503)).await;
    let b = upstream(|_, _| status(503)).await;
    let sc = sidecar(&route(
        &[("a", &a.base_url(), 100, 0), ("b", &b.base_url(), 100, 0)],
        "  retries: {maxAttempts: 3, backoff: {base: 1ms, max: 1ms}, budgetPercent: 20, minRetriesPerSecond: 1}\n  circuitBreaker: {enabled: false}\n",
    ))
    .await;
    let n = 200;
    for _ in 0..n {
        let r = chat(&sc, false).await;
        assert_eq!(r.status, 503);
    }
    let upstream_requests = a.count() + b.count();
    let retries = upstream_requests - n;
    // 20 % of 200 plus the per-second floor over the test's few seconds.
    assert!(retries <= 40 + 10, "retries {retries} exceed the budget");
    assert!(retries >= 1, "some retries happen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_provider_available_is_a_clear_503() {
    let sc = sidecar(&route(&[("keyless", "http://127.0.0.1:9/v1", 100, 0)], "")).await;
    // Give the provider a key from an unset env var: unusable.
    std::fs::write(
        &sc.config,
        route(&[("keyless", "http://127.0.0.1:9/v1", 100, 0)], "").replace(
            "priority: 0}",
            "priority: 0, auth: {env: TAILWARDEN_TEST_UNSET_KEY}}",
        ),
    )
    .unwrap();
    let app = sc.app.clone();
    assert!(
        wait_until(Duration::from_secs(10), || app
            .table
            .load()
            .routes
            .iter()
            .all(|r| r.upstreams.iter().all(|u| !u.usable())))
        .await,
        "the new config was loaded"
    );
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 503, "{}", r.body);
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("keyless (environment variable TAILWARDEN_TEST_UNSET_KEY is not set)"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failure_everywhere_is_a_502_naming_the_provider() {
    let sc = sidecar(&route(
        &[("down", "http://127.0.0.1:9/v1", 100, 0)],
        "  retries: {maxAttempts: 2, backoff: {base: 1ms, max: 1ms}}\n",
    ))
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("Provider down failed after 2 attempt(s)"),
        "{}",
        r.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_map_rewrites_only_the_model_and_auth_comes_from_env() {
    // SAFETY-free: set_var is safe in edition 2024 only in unsafe; use a file key instead.
    let dir = TempDir::new();
    let key = dir.0.join("key");
    std::fs::write(&key, "sk-test-canary\n").unwrap();
    let primary = upstream(|_, _| ok("x")).await;
    let yaml = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: t}}\nspec:\n  models: [gpt-4.1]\n  providers:\n  - name: p\n    baseUrl: '{}'\n    auth: {{file: '{}'}}\n    modelMap: {{gpt-4.1: gpt-4.1-2025-04-14}}\n",
        primary.base_url(),
        key.display()
    );
    let sc = sidecar(&yaml).await;
    let body =
        r#"{"messages":[{"role":"user","content":"hi"}],"model":"gpt-4.1","temperature":0.70}"#;
    let r = post(&sc, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = primary.seen.lock().unwrap()[0].clone();
    assert_eq!(
        seen.body,
        r#"{"messages":[{"role":"user","content":"hi"}],"model":"gpt-4.1-2025-04-14","temperature":0.70}"#
    );
    assert_eq!(
        seen.headers.get("authorization").unwrap(),
        "Bearer sk-test-canary"
    );

    // Rotating the key file applies without a restart.
    std::fs::write(&key, "sk-rotated").unwrap();
    let app = sc.app.clone();
    assert!(
        wait_until(Duration::from_secs(10), || {
            app.table.load().routes[0].upstreams[0]
                .auth_value()
                .is_some_and(|v| v.as_bytes() == b"Bearer sk-rotated")
        })
        .await,
        "the rotated key was read"
    );
    let r = post(&sc, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200);
    let seen = primary.seen.lock().unwrap()[1].clone();
    assert_eq!(
        seen.headers.get("authorization").unwrap(),
        "Bearer sk-rotated"
    );
    // Unknown models are 404 in OpenAI's shape.
    let r = post(
        &sc,
        "/v1/chat/completions",
        r#"{"model":"nope","messages":[]}"#,
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_slow_stream_alive_and_fallback_still_works() {
    // The primary answers 503 only after 1.3 s: heartbeats have gone out by then, yet the
    // client has seen only comments, so falling back to the backup is still invisible.
    let primary = upstream(|_, _| Script::Respond {
        delay: MS(1300),
        status: 503,
        headers: vec![],
        body: "{}".into(),
    })
    .await;
    let backup = upstream(|_, _| Script::Stream {
        first_delay: MS(200),
        chunks: vec![
            (Duration::ZERO, sse_chunk("late")),
            (Duration::ZERO, DONE.to_string()),
        ],
        end: StreamEnd::Finish,
    })
    .await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "  streaming: {heartbeatInterval: 1s}\n  retries: {backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let r = chat(&sc, true).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), "text/event-stream");
    assert!(r.body.starts_with(": ping\n\n"), "{}", r.body);
    assert!(
        r.body.ends_with(&format!("{}{}", sse_chunk("late"), DONE)),
        "{}",
        r.body
    );

    // When every provider fails after the heartbeats began, the error arrives as an event.
    let sc = sidecar(&route(
        &[("primary", &primary.base_url(), 100, 0)],
        "  streaming: {heartbeatInterval: 1s}\n  retries: {maxAttempts: 1}\n",
    ))
    .await;
    let r = chat(&sc, true).await;
    assert_eq!(r.status, 200);
    assert!(r.body.starts_with(": ping\n\n"), "{}", r.body);
    let last = r
        .body
        .trim_end()
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned();
    assert!(last.starts_with("data: {"), "{}", r.body);

    // A fast stream never sees a heartbeat.
    let sc = sidecar(&route(
        &[("backup", &backup.base_url(), 100, 0)],
        "  streaming: {heartbeatInterval: 1s}\n",
    ))
    .await;
    let r = chat(&sc, true).await;
    assert_eq!(r.body, format!("{}{}", sse_chunk("late"), DONE));
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_and_hostname_upstreams_work() {
    let up = upstream(|_, _| ok("over h2c")).await;
    // A host name, not an IP: exercises the caching resolver.
    let base = format!("http://localhost:{}/v1", up.addr.port());
    let sc = sidecar(&route(&[("p", &base, 100, 0)], "")).await;
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    for _ in 0..3 {
        let req = http::Request::post(sc.url("/v1/chat/completions"))
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                br#"{"model":"m","messages":[]}"#,
            )))
            .unwrap();
        let resp = h2.request(req).await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(up.count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_tiers_pick_the_model_by_regex_keywords_and_headers() {
    let up = upstream(|_, _| ok("x")).await;
    let yaml = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: t}}\nspec:\n  models: [big, small, batch]\n  providers: [{{name: p, baseUrl: '{}'}}]\n  tiers:\n  - name: greeting\n    model: small\n    when: {{regex: '^(?i)(hi|hello)\\b', maxPromptChars: 100, noneOfKeywords: [analyse]}}\n  - name: offline\n    model: batch\n    when: {{headers: {{x-priority: low}}}}\n",
        up.base_url()
    );
    let sc = sidecar(&yaml).await;
    let ask = |text: &str| {
        format!(r#"{{"model":"big","messages":[{{"role":"user","content":"{text}"}}]}}"#)
    };
    let r = post(&sc, "/v1/chat/completions", &ask("Hello, how are you?")).await;
    assert_eq!(r.header("x-tailwarden-tier"), "greeting");
    let r2 = post(
        &sc,
        "/v1/chat/completions",
        &ask("hello, analyse this contract"),
    )
    .await;
    assert_eq!(
        r2.header("x-tailwarden-tier"),
        "",
        "a none-of keyword keeps the requested model"
    );
    let req = http::Request::post(sc.url("/v1/chat/completions"))
        .header("x-priority", "low")
        .body(http_body_util::Full::new(bytes::Bytes::from(ask(
            "Summarise the report",
        ))))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.headers()["x-tailwarden-tier"], "offline");
    let seen: Vec<String> = up
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.body.clone())
        .collect();
    assert!(seen[0].contains(r#""model":"small""#), "{}", seen[0]);
    assert!(seen[1].contains(r#""model":"big""#), "{}", seen[1]);
    assert!(seen[2].contains(r#""model":"batch""#), "{}", seen[2]);
}
