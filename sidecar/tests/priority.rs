//! Priority shedding through the real request path over loopback HTTP (issue #17): at three
//! times a route's capacity, with a fifth of the requests marked core (`x-priority: 9`),
//! the core requests are all served within the route's `slo.latencyP99` while the batch
//! requests (`0`) are shed first — and the same load through a first-come-first-served
//! queue sheds core requests as often as batch ones. Also: a tier's priority, the
//! `x-tailwarden-priority` header, the shed metric, and a bad priority header's 400. The
//! queue's order on tokio's paused clock is in `limits_local.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::BodyExt;

const CHAT: &str = "/v1/chat/completions";
const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// The provider takes 200 ms per request and the route serves 4 at once: 20 requests a
/// second.
const SERVICE: Duration = Duration::from_millis(200);
const CONCURRENT: u32 = 4;
const CAPACITY_RPS: f64 = CONCURRENT as f64 / 0.2;
const SLO: Duration = Duration::from_secs(1);

async fn send(sc: &Sidecar, headers: &[(&str, &str)]) -> Reply {
    let mut req = Request::post(sc.url(CHAT)).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(Bytes::from_static(
            BODY.as_bytes(),
        )))
        .unwrap();
    let resp = client().request(req).await.expect("sidecar answers");
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

fn config(url: &str, priority: &str) -> String {
    route(
        &[("p", url, 100, 0)],
        &format!(
            "  slo: {{latencyP99: 1s}}\n  rateLimit: {{maxConcurrent: {CONCURRENT}, maxQueued: 8, queueTimeout: 2s{priority}}}\n"
        ),
    )
}

/// One request as the client saw it.
struct Shot {
    core: bool,
    status: u16,
    latency: Duration,
    priority_header: String,
}

/// Open-loop load at `3 ×` capacity for 3 s, every fifth request core (`x-priority: 9`),
/// the rest batch (`0`).
async fn overload(sc: &Arc<Sidecar>) -> Vec<Shot> {
    let rate = 3.0 * CAPACITY_RPS;
    let n = (rate * 3.0) as u64;
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let sc = sc.clone();
        tasks.push(tokio::spawn(async move {
            let core = i % 5 == 0;
            let began = Instant::now();
            let r = send(&sc, &[("x-priority", if core { "9" } else { "0" })]).await;
            Shot {
                core,
                status: r.status,
                latency: began.elapsed(),
                priority_header: r.header("x-tailwarden-priority").to_owned(),
            }
        }));
    }
    let mut shots = Vec::new();
    for t in tasks {
        shots.push(t.await.unwrap());
    }
    shots
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

struct Summary {
    served: usize,
    shed: usize,
    p99: Option<Duration>,
}

fn summary(shots: &[Shot], core: bool) -> Summary {
    let of: Vec<&Shot> = shots.iter().filter(|s| s.core == core).collect();
    for s in &of {
        assert!(
            matches!(s.status, 200 | 503),
            "only served or shed, got {}",
            s.status
        );
    }
    let served: Vec<Duration> = of
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| s.latency)
        .collect();
    Summary {
        served: served.len(),
        shed: of.len() - served.len(),
        p99: (!served.is_empty()).then(|| p99(served)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_three_times_capacity_core_requests_keep_their_slo_and_batch_is_shed_first() {
    let up = upstream(|_, _| Script::Respond {
        delay: SERVICE,
        status: 200,
        headers: vec![],
        body: completion("m", "ok"),
    })
    .await;

    let sc = Arc::new(sidecar(&config(&up.base_url(), ", priority: {header: x-priority}")).await);
    let shots = overload(&sc).await;
    let core = summary(&shots, true);
    let batch = summary(&shots, false);
    let shed_metric = |priority: &str, reason: &str| {
        sc.app
            .metrics
            .queue_shed
            .with_label_values(&["t/test", priority, reason])
            .get()
    };

    // The FIFO queue under the same load, for comparison.
    let fifo_sc = Arc::new(sidecar(&config(&up.base_url(), "")).await);
    let fifo = overload(&fifo_sc).await;
    let fifo_core = summary(&fifo, true);
    let fifo_batch = summary(&fifo, false);

    println!(
        "PRIORITY | 3x capacity ({} req/s offered, {CAPACITY_RPS} served), 1/5 core: priority queue: core {} served / {} shed, P99 {:?} (SLO {SLO:?}); batch {} served / {} shed, P99 {:?} | FIFO: core {} served / {} shed, P99 {:?}; batch {} served / {} shed",
        3.0 * CAPACITY_RPS,
        core.served,
        core.shed,
        core.p99,
        batch.served,
        batch.shed,
        batch.p99,
        fifo_core.served,
        fifo_core.shed,
        fifo_core.p99,
        fifo_batch.served,
        fifo_batch.shed,
    );

    // With priorities: every core request served, within the SLO.
    assert_eq!(core.shed, 0, "no core request shed");
    let core_p99 = core.p99.unwrap();
    assert!(core_p99 <= SLO, "core P99 {core_p99:?} within {SLO:?}");
    // The batch requests took the load: most shed, and the shed counter names them.
    assert!(
        batch.shed * 2 > batch.served + batch.shed,
        "most batch requests shed: {} of {}",
        batch.shed,
        batch.served + batch.shed
    );
    let batch_shed_counted: u64 = ["full", "displaced", "timeout"]
        .iter()
        .map(|r| shed_metric("0", r))
        .sum();
    assert_eq!(batch_shed_counted, batch.shed as u64);
    assert!(
        shed_metric("0", "displaced") > 0,
        "core requests took batch places"
    );
    for r in ["full", "displaced", "timeout"] {
        assert_eq!(shed_metric("9", r), 0, "{r}");
    }
    for s in &shots {
        assert_eq!(s.priority_header, if s.core { "9" } else { "0" });
    }
    // The first-come-first-served queue sheds core requests like any other.
    assert!(
        fifo_core.shed * 4 > fifo_core.served + fifo_core.shed,
        "FIFO sheds core requests too: {} of {}",
        fifo_core.shed,
        fifo_core.served + fifo_core.shed
    );
    assert!(
        shots
            .iter()
            .chain(&fifo)
            .all(|s| s.status != 200 || s.latency >= SERVICE)
    );
    assert!(fifo.iter().all(|s| s.priority_header.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_sets_the_priority_and_a_bad_priority_header_is_a_400() {
    let up = upstream(|_, _| ok("fine")).await;
    let config = route(
        &[("p", &up.base_url(), 100, 0)],
        "  tiers:\n  - {name: core, model: m, when: {headers: {x-plan: core}}, priority: 8}\n  rateLimit: {maxConcurrent: 4, priority: {header: x-priority, defaultPriority: 2}}\n",
    );
    let sc = sidecar(&config).await;
    let r = send(&sc, &[]).await;
    assert_eq!((r.status, r.header("x-tailwarden-priority")), (200, "2"));
    let r = send(&sc, &[("x-plan", "core")]).await;
    assert_eq!((r.status, r.header("x-tailwarden-priority")), (200, "8"));
    let r = send(&sc, &[("x-plan", "core"), ("x-priority", "1")]).await;
    assert_eq!((r.status, r.header("x-tailwarden-priority")), (200, "1"));
    assert_eq!(up.count(), 3);

    for bad in ["10", "high", ""] {
        let r = send(&sc, &[("x-priority", bad)]).await;
        assert_eq!(r.status, 400, "{bad:?}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["code"], "invalid_priority");
        assert_eq!(
            e["error"]["message"],
            format!(
                "the x-priority header must be one digit, 0 (least important) to 9; got {bad:?} (spec.rateLimit.priority.header of route t/test)"
            )
        );
    }
    assert_eq!(up.count(), 3, "a bad priority reaches no provider");
}
