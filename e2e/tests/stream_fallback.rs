//! Issue #17's stream-to-non-stream fallback at the process level: the real
//! `tailwarden-sidecar` binary in front of the provider simulator, over loopback HTTP.
//!
//! The simulator is switched to a provider whose streams fail before their first content
//! (an error event first) while its plain answers still work
//! (`stream-fail-before-content`). On the route with `streaming.fallback` the client's
//! stream request is then served by a plain upstream call, replayed as a well-formed
//! chat-completion event stream, marked by `x-tailwarden-stream-fallback: non-stream`, the
//! access log's `stream_fallback` and `tailwarden_stream_fallbacks_total`; a route without
//! it fails as before. Streams that fail after their first content are never replayed,
//! and once the provider streams again a probe ends the fallback. About 3 s.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use common::{client, post_text, sse_payloads, start_sim};
use serde_json::Value;
use tailwarden_e2e::{
    fetch,
    sidecar::Sidecar,
    sim::{Distribution, Fault, Profile},
};

/// The simulator binary of this build; the sidecar sits next to it.
const SIM_BIN: &str = env!("CARGO_BIN_EXE_tailwarden-sim");

fn sidecar_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TAILWARDEN_SIDECAR_BIN") {
        return PathBuf::from(p);
    }
    let path = Path::new(SIM_BIN).with_file_name("tailwarden-sidecar");
    assert!(
        path.is_file(),
        "{} is not built: `cargo build -p tailwarden-sidecar` (make test builds it), or set TAILWARDEN_SIDECAR_BIN",
        path.display()
    );
    path
}

async fn metrics(admin: SocketAddr) -> String {
    tokio::task::spawn_blocking(move || {
        let r = fetch::get(admin, "/metrics", Duration::from_secs(5)).expect("GET /metrics");
        assert_eq!(r.status, 200);
        r.text()
    })
    .await
    .unwrap()
}

const CHAT: &str = r#"{"model":"fb","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;

/// The content, finish reason and usage chunks of a chat stream, checked to be well formed:
/// every payload a `chat.completion.chunk`, the role first, `[DONE]` last.
fn read_stream(body: &str) -> (String, Option<String>, Vec<Value>) {
    let (chunks, done) = sse_payloads(body);
    assert!(done, "the stream ends with [DONE]: {body}");
    assert!(!chunks.is_empty(), "{body}");
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["role"], "assistant",
        "the first chunk names the role: {body}"
    );
    let mut text = String::new();
    let mut finish = None;
    let mut usage = Vec::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert!(c["id"].as_str().is_some_and(|id| !id.is_empty()), "{c}");
        if c.get("usage").is_some_and(|u| !u.is_null()) {
            assert_eq!(c["choices"], Value::Array(vec![]), "{c}");
            usage.push(c["usage"].clone());
        }
        for choice in c["choices"].as_array().unwrap() {
            text += choice["delta"]["content"].as_str().unwrap_or("");
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
    }
    (text, finish, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_streams_are_served_by_plain_calls_replayed_as_sse() {
    let profile = Profile {
        ttft: Distribution::constant(2.0),
        itl: Distribution::constant(1.0),
        ..Profile::default()
    };
    let sim = start_sim(&profile, 17).await;
    let dir = std::env::temp_dir().join(format!("tw-stream-fallback-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("routes.yaml");
    let route = |name: &str, model: &str, extra: &str| {
        format!(
            "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: {name}}}\nspec:\n  models: [{model}]\n  providers:\n  - {{name: sim, baseUrl: \"{}\"}}\n  retries: {{maxAttempts: 3, backoff: {{base: 1ms, max: 2ms}}}}\n  circuitBreaker: {{enabled: false}}\n{extra}",
            sim.base_url()
        )
    };
    let yaml = [
        route(
            "fb",
            "fb",
            "  streaming:\n    fallback: {afterFailures: 2, probeAfter: 1s}\n",
        ),
        route("plain", "plain", ""),
    ]
    .join("---\n");
    std::fs::write(&config, yaml).unwrap();
    let log = dir.join("sidecar.log");
    let sc = tokio::task::block_in_place(|| Sidecar::start(&sidecar_bin(), &config, &log))
        .unwrap_or_else(|e| panic!("sidecar: {e}"));
    let url = format!("http://{}/v1/chat/completions", sc.listen);
    let c = client();
    let tokens = [("x-sim-tokens", "6")];

    // A healthy provider streams as usual.
    let (status, h, body) = post_text(&c, &url, CHAT, &tokens).await;
    assert_eq!(status, 200, "{body}");
    assert!(h.get("x-tailwarden-stream-fallback").is_none());
    let (text, finish, _) = read_stream(&body);
    assert!(!text.is_empty());
    assert_eq!(finish.as_deref(), Some("stop"));

    // Its streams break before their first content; its plain answers still work.
    sim.set_fault(Some(Fault::StreamFailBeforeContent));
    let before = sim.stats();
    let (status, h, body) = post_text(&c, &url, CHAT, &tokens).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        h.get("x-tailwarden-stream-fallback").unwrap(),
        "non-stream",
        "{h:?}"
    );
    assert_eq!(
        h.get("x-tailwarden-attempts").unwrap(),
        "3",
        "two failed streams (afterFailures: 2), then the plain call"
    );
    assert!(
        h.get("content-type")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let after = sim.stats();
    assert_eq!(after.outcome("fault_500") - before.outcome("fault_500"), 2);
    assert_eq!(
        after.outcome("ok") - before.outcome("ok"),
        1,
        "one plain call answered"
    );
    let (text, finish, usage) = read_stream(&body);
    assert_eq!(text.split_whitespace().count(), 6, "six tokens: {text:?}");
    assert_eq!(finish.as_deref(), Some("stop"));
    assert!(usage.is_empty(), "the client did not ask for usage");

    // The provider is known to fail its streams now: the next stream request goes plain at
    // once, and the usage chunk comes when the client asks for it.
    let with_usage = r#"{"model":"fb","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}]}"#;
    let (status, h, body) = post_text(&c, &url, with_usage, &tokens).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(h.get("x-tailwarden-stream-fallback").unwrap(), "non-stream");
    assert_eq!(h.get("x-tailwarden-attempts").unwrap(), "1");
    let (_, _, usage) = read_stream(&body);
    assert_eq!(usage.len(), 1, "{body}");
    assert_eq!(usage[0]["completion_tokens"], 6);

    // Plain requests are untouched; a route without the fallback fails as before.
    let plain = r#"{"model":"fb","messages":[{"role":"user","content":"hello"}]}"#;
    let (status, h, body) = post_text(&c, &url, plain, &tokens).await;
    assert_eq!(status, 200, "{body}");
    assert!(h.get("x-tailwarden-stream-fallback").is_none());
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["object"],
        "chat.completion"
    );
    let no_fallback = CHAT.replace("\"fb\"", "\"plain\"");
    let (status, h, _) = post_text(&c, &url, &no_fallback, &tokens).await;
    assert!(status >= 500, "no fallback configured: {status}");
    assert!(h.get("x-tailwarden-stream-fallback").is_none());

    let m = metrics(sc.admin).await;
    let labels = ["route=\"default/fb\"", "provider=\"sim\""];
    assert_eq!(
        fetch::prometheus_sum(&m, "tailwarden_stream_fallbacks_total", &labels),
        Some(2.0),
        "{}",
        m.lines()
            .filter(|l| l.contains("stream_fallback"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        fetch::prometheus_sum(&m, "tailwarden_stream_fallback_active", &labels),
        Some(1.0)
    );
    assert_eq!(
        fetch::prometheus_sum(
            &m,
            "tailwarden_stream_fallback_active",
            &["route=\"default/plain\""]
        ),
        None,
        "only routes with the fallback have the gauge"
    );

    // The provider streams again: within probeAfter (1 s) a probe streams, and the
    // fallback ends.
    sim.set_fault(None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut plain_answers = 0;
    loop {
        let (status, h, body) = post_text(&c, &url, CHAT, &tokens).await;
        assert_eq!(status, 200, "{body}");
        read_stream(&body);
        if h.get("x-tailwarden-stream-fallback").is_none() {
            break;
        }
        plain_answers += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "no stream probe within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = metrics(sc.admin).await;
    assert_eq!(
        fetch::prometheus_sum(&m, "tailwarden_stream_fallback_active", &labels),
        Some(0.0)
    );

    // A stream cut after its first content is never replayed: the client already has
    // bytes, so it gets the stream's error event, and the provider is not judged as
    // failing its streams before content.
    sim.set_fault(Some(Fault::Drop));
    let (status, h, body) = post_text(&c, &url, CHAT, &[("x-sim-tokens", "20")]).await;
    assert_eq!(status, 200);
    assert!(h.get("x-tailwarden-stream-fallback").is_none());
    assert!(body.contains("\"error\""), "an error event ends it: {body}");
    sim.set_fault(None);

    // The access log marks the replayed requests.
    drop(sc);
    let lines: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "request" && v["route"] == "default/fb")
        .collect();
    let marked = lines
        .iter()
        .filter(|v| v["stream_fallback"] == "non-stream")
        .count();
    assert_eq!(marked, 2 + plain_answers, "{lines:#?}");
    println!(
        "STREAM-FALLBACK | replayed {} | plain answers before the probe {plain_answers}",
        2 + plain_answers
    );
    let _ = std::fs::remove_dir_all(&dir);
}
