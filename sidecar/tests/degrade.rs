//! Degraded tiers through the real request path over loopback: the manual switch sends
//! requests to the degraded target (its model, its providers) while the opt-out header and
//! a `neverDegrade` tier keep the normal model; a normal tier whose only provider's breaker
//! opens degrades the route, and the failing request itself is retried on the degraded
//! target. The brownout (SLO burn, recovery) runs in `e2e/tests/degrade.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::{Reply, client, ok, route, sidecar, status, upstream};
use http::Request;
use http_body_util::BodyExt;

async fn chat(sc: &common::Sidecar, headers: &[(&str, &str)]) -> Reply {
    let mut req =
        Request::post(sc.url("/v1/chat/completions")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(Bytes::from_static(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = client().request(req).await.expect("sidecar answers");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

fn model_sent(up: &common::Upstream) -> String {
    let seen = up.seen.lock().unwrap();
    let body: serde_json::Value = serde_json::from_str(&seen.last().unwrap().body).unwrap();
    body["model"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn the_manual_switch_degrades_all_but_the_opted_out() {
    let large = upstream(|_, _| ok("large")).await;
    let small = upstream(|_, _| ok("small")).await;
    let yaml = route(
        &[
            ("large", &large.base_url(), 1, 0),
            ("small", &small.base_url(), 1, 0),
        ],
        "  tiers:\n  - {name: vip, model: m, when: {headers: {x-vip: '1'}}, neverDegrade: true}\n  degradation: {model: m-small, providers: [small], manual: true}\n",
    );
    let sc = sidecar(&yaml).await;

    let r = chat(&sc, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-tailwarden-degraded"), "yes");
    assert_eq!(r.header("x-tailwarden-provider"), "small");
    assert_eq!(model_sent(&small), "m-small", "the degraded model");
    assert_eq!(large.count(), 0);

    for opt_out in [
        vec![("x-tailwarden-no-degrade", "true")],
        vec![("x-vip", "1")],
    ] {
        let r = chat(&sc, &opt_out).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-tailwarden-degraded"), "no", "{opt_out:?}");
        assert_eq!(r.header("x-tailwarden-provider"), "large", "{opt_out:?}");
        assert_eq!(model_sent(&large), "m");
    }
    // `false` is not an opt-out.
    let r = chat(&sc, &[("x-tailwarden-no-degrade", "false")]).await;
    assert_eq!(r.header("x-tailwarden-degraded"), "yes");

    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains(r#"tailwarden_route_state{route="t/test",state="degraded"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"tailwarden_degraded_requests_total{route="t/test"} 2"#));
    assert!(metrics.contains(
        r#"tailwarden_route_state_transitions_total{reason="manual",route="t/test",to="degraded"} 1"#
    ));
}

#[tokio::test]
async fn an_unavailable_normal_tier_degrades_and_the_failing_request_is_served_degraded() {
    let large = upstream(|_, _| status(500)).await;
    let small = upstream(|_, _| ok("small")).await;
    let yaml = route(
        &[
            ("large", &large.base_url(), 1, 0),
            ("small", &small.base_url(), 1, 0),
        ],
        "  degradation: {model: m-small, providers: [small]}\n  circuitBreaker: {consecutiveFailures: 1}\n  retries: {maxAttempts: 2, backoff: {base: 1ms, max: 2ms}}\n",
    );
    let sc = sidecar(&yaml).await;

    let r = chat(&sc, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-tailwarden-degraded"), "yes");
    assert_eq!(r.header("x-tailwarden-attempts"), "2");
    assert_eq!((large.count(), small.count()), (1, 1));
    assert_eq!(model_sent(&small), "m-small");

    // The breaker is open: the next request is degraded from the start.
    let r = chat(&sc, &[]).await;
    assert_eq!(r.header("x-tailwarden-degraded"), "yes");
    assert_eq!(r.header("x-tailwarden-attempts"), "1");
    assert_eq!(large.count(), 1);
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains(
            r#"tailwarden_route_state_transitions_total{reason="unavailable",route="t/test",to="degraded"} 1"#
        ),
        "{metrics}"
    );
}
