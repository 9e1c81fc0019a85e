//! Prometheus metrics over real loopback HTTP: series that exist from config load (breaker
//! state, SLO objectives), SLO outcomes per objective, time per output token, connection
//! slots sampled at scrape, and label cardinality that requests cannot grow.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::{BodyExt, Full};

const MS: fn(u64) -> Duration = Duration::from_millis;

fn scrape(sc: &Sidecar) -> String {
    tailwarden_sidecar::config::series::sample(&sc.app.metrics, &sc.app.table.load());
    String::from_utf8(sc.app.metrics.render()).unwrap()
}

/// The value of the series `name{labels…}` (labels in any order, others allowed).
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                (rest.starts_with('{') || rest.starts_with(' '))
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Series lines (not comments) in a scrape.
fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_config_series_exist_before_any_request() {
    let sc = sidecar(&route(
        &[
            ("a", "http://127.0.0.1:9/v1", 100, 0),
            ("b", "http://127.0.0.1:9/v1", 100, 1),
        ],
        "  slo: {ttftP99: 2s, latencyP99: 20s, availabilityPercent: '99.5'}\n",
    ))
    .await;
    let text = scrape(&sc);
    for p in ["a", "b"] {
        let labels = [("route", "t/test"), ("provider", p)];
        assert_eq!(
            value(&text, "tailwarden_circuit_breaker_state", &labels),
            Some(0.0),
            "{text}"
        );
        assert_eq!(
            value(&text, "tailwarden_upstream_connections_in_use", &labels),
            Some(0.0)
        );
        assert_eq!(
            value(&text, "tailwarden_upstream_connections_max", &labels),
            Some(100.0)
        );
    }
    for (objective, target) in [("ttft", 0.99), ("latency", 0.99), ("availability", 0.995)] {
        let labels = [("route", "t/test"), ("objective", objective)];
        assert_eq!(
            value(&text, "tailwarden_slo_objective_ratio", &labels),
            Some(target),
            "{objective}"
        );
        for outcome in ["met", "missed"] {
            let labels = [
                ("route", "t/test"),
                ("objective", objective),
                ("outcome", outcome),
            ];
            assert_eq!(
                value(&text, "tailwarden_slo_requests_total", &labels),
                Some(0.0)
            );
        }
    }

    // A reload that drops a provider and the slo drops their series.
    std::fs::write(
        &sc.config,
        route(&[("a", "http://127.0.0.1:9/v1", 100, 0)], ""),
    )
    .unwrap();
    let app = sc.app.clone();
    assert!(
        wait_until(Duration::from_secs(10), || app.table.load().routes[0]
            .upstreams
            .len()
            == 1)
        .await
    );
    let text = scrape(&sc);
    assert!(
        value(
            &text,
            "tailwarden_circuit_breaker_state",
            &[("provider", "b")]
        )
        .is_none()
    );
    assert!(value(&text, "tailwarden_slo_objective_ratio", &[]).is_none());
    assert!(
        value(
            &text,
            "tailwarden_upstream_connections_max",
            &[("provider", "b")]
        )
        .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_outcomes_are_counted_per_objective_and_tpot_per_stream() {
    // Request 0: fast stream (TTFT and latency met); 1: first token after 300 ms (TTFT
    // missed, latency met); 2: a 503 (availability missed, not judged on latency).
    let up = upstream(|n, _| match n {
        0 => Script::Stream {
            first_delay: Duration::ZERO,
            chunks: vec![
                (Duration::ZERO, sse_chunk("a")),
                (MS(40), sse_chunk("b")),
                (MS(40), sse_chunk("c")),
                (Duration::ZERO, sse_usage()),
                (Duration::ZERO, DONE.to_owned()),
            ],
            end: StreamEnd::Finish,
        },
        1 => Script::Stream {
            first_delay: MS(300),
            chunks: vec![
                (Duration::ZERO, sse_chunk("late")),
                (Duration::ZERO, DONE.to_owned()),
            ],
            end: StreamEnd::Finish,
        },
        _ => status(503),
    })
    .await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  retries: {maxAttempts: 1}\n  slo: {ttftP99: 200ms, latencyP99: 2s, availabilityPercent: '99.9'}\n",
    ))
    .await;
    assert_eq!(chat(&sc, true).await.status, 200);
    assert_eq!(chat(&sc, true).await.status, 200);
    assert_eq!(chat(&sc, false).await.status, 503);
    let count = |text: &str, objective: &str, outcome: &str| {
        value(
            text,
            "tailwarden_slo_requests_total",
            &[("objective", objective), ("outcome", outcome)],
        )
        .unwrap()
    };
    let mut text = String::new();
    // The last request's recorder may drop just after the client has its body.
    assert!(
        wait_until(Duration::from_secs(5), || {
            text = scrape(&sc);
            count(&text, "availability", "missed") == 1.0
        })
        .await,
        "{text}"
    );
    assert_eq!(count(&text, "availability", "met"), 2.0);
    assert_eq!(count(&text, "ttft", "met"), 1.0);
    assert_eq!(count(&text, "ttft", "missed"), 1.0);
    assert_eq!(count(&text, "latency", "met"), 2.0);
    assert_eq!(count(&text, "latency", "missed"), 0.0);

    // Time per output token: only the first stream reports usage (3 output tokens), two
    // 40 ms gaps after its first token: about 40 ms per token.
    let labels = [("route", "t/test"), ("provider", "p")];
    assert_eq!(
        value(
            &text,
            "tailwarden_time_per_output_token_seconds_count",
            &labels
        ),
        Some(1.0),
        "{text}"
    );
    let sum = value(
        &text,
        "tailwarden_time_per_output_token_seconds_sum",
        &labels,
    )
    .unwrap();
    assert!((0.035..0.5).contains(&sum), "tpot {sum}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_slots_in_use_are_sampled_at_scrape() {
    let up = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: vec![(Duration::ZERO, sse_chunk("held"))],
        end: StreamEnd::Stall,
    })
    .await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    let req = Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    let labels = [("route", "t/test"), ("provider", "p")];
    let in_use = |text: &str| value(text, "tailwarden_upstream_connections_in_use", &labels);
    assert_eq!(in_use(&scrape(&sc)), Some(1.0));
    drop(body);
    assert!(
        wait_until(Duration::from_secs(5), || in_use(&scrape(&sc)) == Some(0.0)).await,
        "the slot is released when the client goes away"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_requests_with_random_tenant_headers_add_no_series() {
    let up = upstream(|_, _| ok("x")).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  slo: {ttftP99: 2s, latencyP99: 20s, availabilityPercent: '99.9'}\n",
    ))
    .await;
    let http = client();
    let send = |sc: &Sidecar, i: u64| {
        let url = sc.url("/v1/chat/completions");
        let http = http.clone();
        async move {
            let req = Request::post(url)
                .header("content-type", "application/json")
                .header("x-tenant", format!("tenant-{i:x}"))
                .header("x-user-id", format!("user-{}", i.wrapping_mul(2_654_435_761)))
                .header("x-request-id", format!("req-{i}"))
                .header("openai-organization", format!("org-{i}"))
                .body(Full::new(Bytes::from(format!(
                    r#"{{"model":"m","user":"u{i}","messages":[{{"role":"user","content":"hi {i}"}}]}}"#
                ))))
                .unwrap();
            let resp = http.request(req).await.unwrap();
            let status = resp.status().as_u16();
            resp.into_body().collect().await.unwrap();
            status
        }
    };
    // Warm up: every series a successful request creates.
    for i in 0..10 {
        assert_eq!(send(&sc, i).await, 200);
    }
    let before = scrape(&sc);
    let stream = futures_util::stream::iter(10..10_010u64).map(|i| send(&sc, i));
    use futures_util::StreamExt as _;
    let statuses: Vec<u16> = stream.buffer_unordered(32).collect().await;
    assert!(statuses.iter().all(|s| *s == 200));
    let after = scrape(&sc);
    assert_eq!(
        series(&before),
        series(&after),
        "requests added series:\n{after}"
    );
    assert_eq!(
        value(
            &after,
            "tailwarden_requests_total",
            &[("status_class", "2xx")]
        ),
        Some(10_010.0)
    );
    assert!(!after.contains("tenant-") && !after.contains("user-") && !after.contains("org-"));
}
