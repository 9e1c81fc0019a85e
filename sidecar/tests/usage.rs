//! Usage and cost on every exit, through the real request path: the usage chunk the sidecar
//! asks for is stripped so the client's stream is byte-identical to what it asked for;
//! streams and bodies without usage are estimated and marked so; a client that leaves
//! mid-stream is still accounted; cost is exact decimal arithmetic from the route's pricing,
//! cached input priced apart. Checked in the access log line and in the metrics.
#![allow(clippy::unwrap_used)]

mod common;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use common::{
    access::{access_line, log_lines},
    *,
};
use http::Request;
use http_body_util::BodyExt;
use serde_json::Value;

async fn send(sc: &Sidecar, id: &str, body: &str) -> (u16, Bytes) {
    let req = Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(http_body_util::Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, bytes)
}

const PRICED: &str = "    pricing:\n    - {model: m, inputPerMTok: \"2.50\", cachedInputPerMTok: \"1.25\", outputPerMTok: \"10.00\"}\n";

fn priced_route(url: &str, extra: &str) -> String {
    format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: test, namespace: t}}\nspec:\n  models: ['*']\n  providers:\n  - name: p\n    baseUrl: '{url}'\n{PRICED}{extra}"
    )
}

fn usage_chunk(prompt: u64, cached: u64, completion: u64) -> String {
    format!(
        "data: {}\n\n",
        serde_json::json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],
            "usage":{"prompt_tokens":prompt,"completion_tokens":completion,"total_tokens":prompt+completion,
                     "prompt_tokens_details":{"cached_tokens":cached}}})
    )
}

fn content() -> Vec<String> {
    vec![sse_chunk("One"), sse_chunk(" two"), sse_chunk(" three")]
}

/// A provider that sends the usage chunk exactly when the request asks for it.
fn honest_stream(body: &str) -> Script {
    let mut chunks: Vec<(Duration, String)> =
        content().into_iter().map(|c| (Duration::ZERO, c)).collect();
    if body.contains(r#""include_usage":true"#) {
        chunks.push((Duration::ZERO, usage_chunk(1000, 400, 200)));
    }
    chunks.push((Duration::ZERO, DONE.to_owned()));
    Script::Stream {
        first_delay: Duration::ZERO,
        chunks,
        end: StreamEnd::Finish,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_the_client_did_not_ask_for_is_measured_and_stripped() {
    log_lines();
    let up = upstream(|_, body| honest_stream(body)).await;
    let sc = sidecar(&priced_route(&up.base_url(), "")).await;
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"count"}]}"#;
    let (status, bytes) = send(&sc, "usage-stripped", body).await;
    assert_eq!(status, 200);
    // The sidecar asked the provider for usage on the client's behalf...
    let seen = up.seen.lock().unwrap()[0].body.clone();
    let seen: Value = serde_json::from_str(&seen).unwrap();
    assert_eq!(seen["stream_options"]["include_usage"], true);
    // ... and the client got exactly the stream it asked for: content and [DONE], nothing extra.
    let expected: String = content().concat() + DONE;
    assert_eq!(String::from_utf8(bytes.to_vec()).unwrap(), expected);

    let line = access_line("usage-stripped").await;
    assert_eq!(line["input_tokens"], 1000);
    assert_eq!(line["cached_input_tokens"], 400);
    assert_eq!(line["output_tokens"], 200);
    assert_eq!(line["usage_estimated"], false);
    // 600 × 2.50 + 400 × 1.25 + 200 × 10.00 = 4000 per million.
    assert_eq!(line["cost"], "0.004");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_the_client_asked_for_reaches_it_unchanged() {
    log_lines();
    let up = upstream(|_, body| honest_stream(body)).await;
    let sc = sidecar(&priced_route(&up.base_url(), "")).await;
    let body = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"count"}]}"#;
    let (status, bytes) = send(&sc, "usage-asked", body).await;
    assert_eq!(status, 200);
    let seen = up.seen.lock().unwrap()[0].body.clone();
    assert_eq!(seen, body, "the body went upstream unchanged");
    let expected: String = content().concat() + &usage_chunk(1000, 400, 200) + DONE;
    assert_eq!(String::from_utf8(bytes.to_vec()).unwrap(), expected);
    let line = access_line("usage-asked").await;
    assert_eq!(line["output_tokens"], 200);
    assert_eq!(line["cost"], "0.004");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_sends_no_usage_gets_an_estimate_marked_as_such() {
    log_lines();
    // Ignores include_usage: content and [DONE] only.
    let up = upstream(|_, body| {
        if body.contains(r#""stream":true"#) {
            let mut chunks: Vec<(Duration, String)> =
                content().into_iter().map(|c| (Duration::ZERO, c)).collect();
            chunks.push((Duration::ZERO, DONE.to_owned()));
            Script::Stream {
                first_delay: Duration::ZERO,
                chunks,
                end: StreamEnd::Finish,
            }
        } else {
            Script::Respond {
                delay: Duration::ZERO,
                status: 200,
                headers: vec![],
                body: r#"{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"twelve chars"},"finish_reason":"stop"}]}"#.to_owned(),
            }
        }
    })
    .await;
    let sc = sidecar(&priced_route(&up.base_url(), "")).await;

    let body =
        r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"count to three"}]}"#;
    let (_, bytes) = send(&sc, "usage-none-stream", body).await;
    assert_eq!(
        String::from_utf8(bytes.to_vec()).unwrap(),
        content().concat() + DONE
    );
    let line = access_line("usage-none-stream").await;
    assert_eq!(line["usage_estimated"], true);
    assert_eq!(line["input_tokens"], (body.len() / 4) as u64);
    assert_eq!(line["output_tokens"], 3, "one per content chunk");
    // (input × 2.50 + 3 × 10.00) per million, exact.
    let input = (body.len() / 4) as u64;
    let cost = rust_decimal::Decimal::from(input) * rust_decimal::Decimal::new(250, 2)
        + rust_decimal::Decimal::from(30);
    let cost = cost / rust_decimal::Decimal::from(1_000_000);
    assert_eq!(line["cost"], cost.normalize().to_string());

    let plain = r#"{"model":"m","messages":[{"role":"user","content":"count to three"}]}"#;
    let (_, bytes) = send(&sc, "usage-none-plain", plain).await;
    let line = access_line("usage-none-plain").await;
    assert_eq!(line["usage_estimated"], true);
    assert_eq!(line["output_tokens"], (bytes.len() / 4) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_is_still_accounted() {
    log_lines();
    let up = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: vec![
            (Duration::ZERO, sse_chunk("first")),
            (Duration::from_millis(20), sse_chunk("second")),
        ],
        // Holds the stream open and notes when the sidecar lets go of it.
        end: StreamEnd::Stall,
    })
    .await;
    let sc = sidecar(&priced_route(&up.base_url(), "")).await;
    let req = Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "usage-left")
        .body(http_body_util::Full::new(Bytes::from_static(
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"go"}]}"#,
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("second") {
        let frame = body.frame().await.unwrap().unwrap();
        if let Ok(data) = frame.into_data() {
            got.extend_from_slice(&data);
        }
    }
    drop(body);
    let line = access_line("usage-left").await;
    assert_eq!(line["error_type"], "client_closed");
    assert_eq!(line["usage_estimated"], true);
    assert_eq!(line["output_tokens"], 2, "the two chunks it received");
    assert!(line["cost"].as_str().is_some_and(|c| c != "0"));
    assert!(
        wait_until(Duration::from_secs(5), || up.cancellations().len() == 1).await,
        "the provider's stream was cancelled"
    );
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains(
            r#"tailwarden_tokens_total{model="m",namespace="",provider="p",route="t/test",type="output",workload=""} 2"#
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_usage_and_cost_come_from_the_body() {
    log_lines();
    let up = upstream(|_, _| Script::Respond {
        delay: Duration::ZERO,
        status: 200,
        headers: vec![],
        body: serde_json::json!({
            "id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1234, "completion_tokens": 56, "total_tokens": 1290,
                      "prompt_tokens_details": {"cached_tokens": 1000},
                      "completion_tokens_details": {"reasoning_tokens": 40}}
        })
        .to_string(),
    })
    .await;
    let sc = sidecar(&priced_route(&up.base_url(), "")).await;
    let (status, _) = send(
        &sc,
        "usage-plain",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(status, 200);
    let line = access_line("usage-plain").await;
    assert_eq!(line["input_tokens"], 1234);
    assert_eq!(line["cached_input_tokens"], 1000);
    assert_eq!(line["output_tokens"], 56);
    assert_eq!(line["reasoning_tokens"], 40);
    assert_eq!(line["usage_estimated"], false);
    // 234 × 2.50 + 1000 × 1.25 + 56 × 10.00 = 585 + 1250 + 560 = 2395 per million.
    assert_eq!(line["cost"], "0.002395");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_names_the_workload_the_sidecar_serves() {
    log_lines();
    let up = upstream(|_, _| ok("x")).await;
    let identity = tailwarden_sidecar::record::identity::Identity {
        namespace: Some("shop".into()),
        pod: Some("web-7d9c-x2k4q".into()),
        service_account: Some("web".into()),
        workload_kind: Some("Deployment".into()),
        workload: Some("web".into()),
    };
    let sc = sidecar_with(&route(&[("p", &up.base_url(), 100, 0)], ""), |app| {
        app.identity = Arc::new(identity)
    })
    .await;
    let (status, _) = send(
        &sc,
        "who-1",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(status, 200);
    let line = access_line("who-1").await;
    assert!(
        line.get("tenant").is_none(),
        "no tenantHeader, no tenant: {line}"
    );
    for (key, want) in [
        ("namespace", "shop"),
        ("pod", "web-7d9c-x2k4q"),
        ("service_account", "web"),
        ("workload_kind", "Deployment"),
        ("workload", "web"),
    ] {
        assert_eq!(line[key], want, "{key}: {line}");
    }
    // Outside a cluster the fields are simply absent.
    let plain = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    send(
        &plain,
        "who-2",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    let line = access_line("who-2").await;
    assert!(
        line.get("workload").is_none() && line.get("namespace").is_none(),
        "{line}"
    );
}

/// The sum of a counter's samples in a `/metrics` page whose labels include all of `want`.
fn counter_sum(page: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            want.iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chargeback_cost_per_workload_from_the_metrics_matches_the_hand_computed_sums() {
    log_lines();
    // One route, one provider that reports usage from the prompt: the prompt's length in
    // characters is its input tokens, and every answer has 10 output tokens.
    let up = upstream(|_, body| {
        let v: Value = serde_json::from_str(body).unwrap_or_default();
        let prompt = v["messages"][0]["content"].as_str().unwrap_or_default().len();
        Script::Respond {
            delay: Duration::ZERO,
            status: 200,
            headers: vec![],
            body: serde_json::json!({
                "id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10}
            })
            .to_string(),
        }
    })
    .await;
    let route = priced_route(&up.base_url(), "");
    let workload = |name: &str| tailwarden_sidecar::record::identity::Identity {
        namespace: Some("shop".into()),
        pod: Some(format!("{name}-7d9c-abcde")),
        service_account: Some(name.into()),
        workload_kind: Some("Deployment".into()),
        workload: Some(name.into()),
    };
    // Two workloads, each with its own sidecar, through the same route.
    let web = sidecar_with(&route, |app| app.identity = Arc::new(workload("web"))).await;
    let batch = sidecar_with(&route, |app| app.identity = Arc::new(workload("batch"))).await;
    let prompts: [(&Sidecar, &str); 5] = [
        (&web, "hello"),
        (&web, "a somewhat longer question"),
        (&batch, "x"),
        (&web, "tell me more"),
        (&batch, "summarise this document for me please"),
    ];
    for (n, (sc, prompt)) in prompts.iter().enumerate() {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}]});
        let (status, _) = send(sc, &format!("chargeback-{n}"), &body.to_string()).await;
        assert_eq!(status, 200);
    }
    // By hand, at 2.50 per million input and 10.00 per million output tokens.
    let expected = |who: &str| -> (u64, u64, f64) {
        let input: u64 = prompts
            .iter()
            .filter(|(sc, _)| std::ptr::eq(*sc, if who == "web" { &web } else { &batch }))
            .map(|(_, p)| p.len() as u64)
            .sum();
        let calls = prompts
            .iter()
            .filter(|(sc, _)| std::ptr::eq(*sc, if who == "web" { &web } else { &batch }))
            .count() as u64;
        let output = 10 * calls;
        (
            input,
            output,
            (input as f64 * 2.50 + output as f64 * 10.00) / 1e6,
        )
    };
    let (web_in, web_out, web_cost) = expected("web");
    let (batch_in, batch_out, batch_cost) = expected("batch");
    assert_eq!((web_in, web_out), (5 + 26 + 12, 30));
    assert_eq!((batch_in, batch_out), (1 + 37, 20));
    // Metrics are written just before the access-log line: once every line is there, the
    // fleet's metrics are complete. Summed by workload, as Prometheus would.
    log_lines();
    for n in 0..prompts.len() {
        access_line(&format!("chargeback-{n}")).await;
    }
    let pages: Vec<String> = [&web, &batch]
        .iter()
        .map(|sc| String::from_utf8(sc.app.metrics.render()).unwrap())
        .collect();
    let by = |metric: &str, who: &str, extra: &[(&str, &str)]| -> f64 {
        let mut want = vec![("namespace", "shop"), ("workload", who)];
        want.extend_from_slice(extra);
        pages.iter().map(|p| counter_sum(p, metric, &want)).sum()
    };
    for (who, input, output, cost) in [
        ("web", web_in, web_out, web_cost),
        ("batch", batch_in, batch_out, batch_cost),
    ] {
        assert_eq!(
            by("tailwarden_tokens_total", who, &[("type", "input")]),
            input as f64,
            "{who} input tokens"
        );
        assert_eq!(
            by("tailwarden_tokens_total", who, &[("type", "output")]),
            output as f64,
            "{who} output tokens"
        );
        let got = by("tailwarden_cost_total", who, &[]);
        assert!(
            (got - cost).abs() < 1e-12,
            "{who}: cost {got} from the metrics, {cost} by hand"
        );
    }
    // And the access log charges each request to its workload.
    assert_eq!(access_line("chargeback-2").await["workload"], "batch");
    assert_eq!(access_line("chargeback-3").await["workload"], "web");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_header_is_its_own_field_beside_the_workload() {
    log_lines();
    let up = upstream(|_, _| ok("x")).await;
    let sc = sidecar_with(
        &route(
            &[("p", &up.base_url(), 100, 0)],
            "  rateLimit: {tenantHeader: x-tenant-id}\n",
        ),
        |app| {
            app.identity = Arc::new(tailwarden_sidecar::record::identity::Identity {
                namespace: Some("shop".into()),
                workload: Some("web".into()),
                ..Default::default()
            })
        },
    )
    .await;
    let req = Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "tenant-1")
        .header("x-tenant-id", "acme")
        .body(http_body_util::Full::new(Bytes::from(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    assert_eq!(client().request(req).await.unwrap().status(), 200);
    let line = access_line("tenant-1").await;
    assert_eq!(line["tenant"], "acme");
    assert_eq!(line["workload"], "web");
}
