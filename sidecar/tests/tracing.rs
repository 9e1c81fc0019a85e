//! OpenTelemetry traces against a real OTLP/HTTP receiver: an in-test collector decodes the
//! protobuf export requests the sidecar's exporter sends (the same bytes an OpenTelemetry
//! Collector's 4318 port receives), and the tests assert span names, kinds, the parent/child
//! structure (client `traceparent` → SERVER → CLIENT per attempt), the GenAI attributes
//! including token usage of a streamed response, retry/hedge/breaker events, the
//! `traceparent` the provider saw, and that no key ever becomes an attribute.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::*;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse},
    common::v1::{AnyValue, KeyValue, any_value},
};
use prost::Message as _;
use serde_json::{Value, json};
use tailwarden_sidecar::record::telemetry::{self, Telemetry};
use tracing_subscriber::layer::SubscriberExt as _;

const MS: fn(u64) -> Duration = Duration::from_millis;
/// OTLP span kinds and status codes.
const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const STATUS_ERROR: i32 = 2;

/// One received span, flattened.
#[derive(Debug, Clone)]
struct RSpan {
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: i32,
    attrs: BTreeMap<String, Value>,
    events: Vec<(String, BTreeMap<String, Value>)>,
    status: i32,
    start: u64,
    end: u64,
    service: String,
}

impl RSpan {
    fn attr(&self, key: &str) -> &Value {
        self.attrs.get(key).unwrap_or(&Value::Null)
    }
    fn event(&self, name: &str) -> Vec<&BTreeMap<String, Value>> {
        self.events
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, a)| a)
            .collect()
    }
    fn duration(&self) -> Duration {
        Duration::from_nanos(self.end.saturating_sub(self.start))
    }
}

fn value(v: &Option<AnyValue>) -> Value {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => json!(s),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(f)) => json!(f),
        Some(any_value::Value::BoolValue(b)) => json!(b),
        other => json!(format!("{other:?}")),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value(&kv.value)))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

struct Harness {
    /// The receiver's address.
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<RSpan>>>,
    /// Content types of the export requests, to show they are OTLP protobuf.
    content_types: Arc<Mutex<Vec<String>>>,
    telemetry: Telemetry,
}

/// The receiver runs on a thread of its own (each test has its own runtime); the exporter
/// and the global subscriber are installed once per test binary.
fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let content_types = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
        let (s, c) = (spans.clone(), content_types.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let (s, c) = (s.clone(), c.clone());
                    tokio::spawn(async move {
                        let service = service_fn(move |req: Request<Incoming>| {
                            let (s, c) = (s.clone(), c.clone());
                            async move { Ok::<_, std::io::Error>(receive(req, &s, &c).await) }
                        });
                        let _ = auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        });
        let addr = rx.recv().unwrap();
        let (telemetry, layer) = telemetry::layer(&telemetry::Config {
            endpoint: Some(format!("http://{addr}/v1/traces")),
            timeout: Duration::from_secs(5),
            protocol: telemetry::Protocol::HttpProtobuf,
        })
        .unwrap();
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .unwrap();
        assert!(telemetry::enabled());
        Harness {
            addr,
            spans,
            content_types,
            telemetry,
        }
    })
}

async fn receive(
    req: Request<Incoming>,
    spans: &Mutex<Vec<RSpan>>,
    content_types: &Mutex<Vec<String>>,
) -> Response<Full<Bytes>> {
    assert_eq!(req.uri().path(), "/v1/traces");
    let ct = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    content_types.lock().unwrap().push(ct);
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let export = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
    let mut out = spans.lock().unwrap();
    for rs in export.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .and_then(|a| a.get("service.name").cloned())
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(RSpan {
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent: hex(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    attrs: attributes(&s.attributes),
                    events: s
                        .events
                        .iter()
                        .map(|e| (e.name.clone(), attributes(&e.attributes)))
                        .collect(),
                    status: s.status.map_or(0, |st| st.code),
                    start: s.start_time_unix_nano,
                    end: s.end_time_unix_nano,
                    service: service.clone(),
                });
            }
        }
    }
    let mut r = Response::new(Full::new(Bytes::from(
        ExportTraceServiceResponse::default().encode_to_vec(),
    )));
    r.headers_mut()
        .insert("content-type", "application/x-protobuf".parse().unwrap());
    r
}

/// Flushes the exporter until the spans of `trace_id` satisfy `done` (or 10 s pass).
async fn trace(trace_id: &str, done: impl Fn(&[RSpan]) -> bool) -> Vec<RSpan> {
    let h = harness();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        tokio::task::spawn_blocking(|| harness().telemetry.flush())
            .await
            .unwrap();
        let spans: Vec<RSpan> = h
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect();
        if done(&spans) || Instant::now() >= deadline {
            return spans;
        }
        tokio::time::sleep(MS(50)).await;
    }
}

fn one(spans: &[RSpan], kind: i32) -> &RSpan {
    let found: Vec<&RSpan> = spans.iter().filter(|s| s.kind == kind).collect();
    assert_eq!(found.len(), 1, "one span of kind {kind}: {spans:#?}");
    found[0]
}

fn clients(spans: &[RSpan]) -> Vec<&RSpan> {
    let mut c: Vec<&RSpan> = spans.iter().filter(|s| s.kind == CLIENT).collect();
    c.sort_by_key(|s| s.attr("tailwarden.attempt").as_i64());
    c
}

/// A fresh trace id and the client's `traceparent` (parent span `00f067aa0ba902b7`).
fn client_trace() -> (String, String) {
    static N: AtomicU32 = AtomicU32::new(1);
    let trace = format!(
        "4bf92f3577b34da6{:08x}{:08x}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    let tp = format!("00-{trace}-00f067aa0ba902b7-01");
    (trace, tp)
}

const CLIENT_PARENT: &str = "00f067aa0ba902b7";

async fn send(
    sc: &Sidecar,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, String) {
    let mut req =
        Request::post(sc.url("/v1/chat/completions")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client()
        .request(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    (status, h, String::from_utf8_lossy(&b).into_owned())
}

fn chunk(model: &str, text: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"id":"c","object":"chat.completion.chunk","created":1,"model":model,
            "choices":[{"index":0,"delta":{"content":text},"finish_reason":null}]})
    )
}

fn usage_chunk(model: &str, input: u64, output: u64) -> String {
    format!(
        "data: {}\n\n",
        json!({"id":"c","object":"chat.completion.chunk","created":1,"model":model,"choices":[],
            "usage":{"prompt_tokens":input,"completion_tokens":output,"total_tokens":input+output}})
    )
}

/// The W3C traceparent an upstream request carried.
fn seen_traceparent(u: &Upstream, n: usize) -> String {
    u.seen.lock().unwrap()[n]
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_is_a_server_span_under_the_client_and_a_client_span_per_attempt() {
    harness();
    let dir = TempDir::new();
    let key = dir.0.join("key");
    std::fs::write(&key, "sk-provider-canary-7f3a\n").unwrap();
    let provider_model = "gpt-4.1-2025-04-14";
    let up = upstream(move |_, _| Script::Stream {
        first_delay: MS(20),
        chunks: vec![
            (Duration::ZERO, chunk(provider_model, "Hel")),
            (MS(150), chunk(provider_model, "lo")),
            (MS(150), usage_chunk(provider_model, 11, 7)),
            (Duration::ZERO, DONE.to_owned()),
        ],
        end: StreamEnd::Finish,
    })
    .await;
    let sc = sidecar(&format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: traced, namespace: t}}\nspec:\n  models: ['*']\n  providers:\n  - name: openai\n    baseUrl: '{}'\n    auth: {{file: '{}'}}\n    modelMap: {{gpt-4.1: {provider_model}}}\n",
        up.base_url(),
        key.display()
    ))
    .await;
    let (trace_id, tp) = client_trace();
    let (status, _, body) = send(
        &sc,
        r#"{"model":"gpt-4.1","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        &[
            ("traceparent", &tp),
            ("authorization", "Bearer sk-client-canary-91bd"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Hel") && body.ends_with(DONE), "{body}");

    let spans = trace(&trace_id, |s| s.len() >= 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let server = one(&spans, SERVER);
    let attempt = one(&spans, CLIENT);

    // Names and structure: client → SERVER → CLIENT.
    assert_eq!(server.name, "chat gpt-4.1");
    assert_eq!(attempt.name, format!("chat {provider_model}"));
    assert_eq!(
        server.parent, CLIENT_PARENT,
        "SERVER is the client span's child"
    );
    assert_eq!(
        attempt.parent, server.span_id,
        "CLIENT is the SERVER's child"
    );
    assert_eq!(server.service, "tailwarden-sidecar");

    // GenAI attributes, with the usage of the streamed response's last chunk.
    for (span, request_model) in [(server, "gpt-4.1"), (attempt, provider_model)] {
        assert_eq!(span.attr("gen_ai.operation.name"), "chat", "{span:#?}");
        assert_eq!(span.attr("gen_ai.provider.name"), "openai", "{span:#?}");
        assert_eq!(
            span.attr("gen_ai.request.model"),
            request_model,
            "{span:#?}"
        );
        assert_eq!(
            span.attr("gen_ai.response.model"),
            provider_model,
            "{span:#?}"
        );
        assert_eq!(span.attr("gen_ai.usage.input_tokens"), 11, "{span:#?}");
        assert_eq!(span.attr("gen_ai.usage.output_tokens"), 7, "{span:#?}");
        assert_eq!(span.attr("http.response.status_code"), 200, "{span:#?}");
        assert_eq!(span.attr("tailwarden.route"), "t/traced", "{span:#?}");
        assert!(!span.attrs.contains_key("error.type"), "{span:#?}");
        assert_ne!(span.status, STATUS_ERROR);
    }
    assert_eq!(attempt.attr("server.address"), "127.0.0.1");
    assert_eq!(attempt.attr("server.port"), i64::from(up.addr.port()));
    assert_eq!(attempt.attr("tailwarden.attempt"), 1);
    assert_eq!(attempt.attr("tailwarden.hedge"), false);
    assert!(
        server
            .attr("gen_ai.response.time_to_first_chunk")
            .as_f64()
            .unwrap()
            > 0.0
    );

    // The spans end with the body (two 150 ms gaps after the headers), not at the headers.
    assert!(server.duration() >= MS(290), "{:?}", server.duration());
    assert!(attempt.duration() >= MS(290), "{:?}", attempt.duration());
    assert!(attempt.start >= server.start && attempt.end <= server.end);

    // The provider saw our CLIENT span as its parent, in the client's trace.
    assert_eq!(
        seen_traceparent(&up, 0),
        format!("00-{trace_id}-{}-01", attempt.span_id)
    );

    // Keys never become attributes or events.
    let all = format!("{spans:?}");
    assert!(!all.contains("canary"), "{all}");
    assert!(!all.to_ascii_lowercase().contains("authorization"), "{all}");

    // OTLP/HTTP with protobuf bodies.
    assert!(
        harness()
            .content_types
            .lock()
            .unwrap()
            .iter()
            .all(|c| c == "application/x-protobuf")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_and_a_breaker_transition_are_events_and_each_attempt_has_its_span() {
    harness();
    let primary = upstream(|_, _| status(503)).await;
    let backup = upstream(|_, _| ok("from backup")).await;
    let sc = sidecar(&route(
        &[
            ("primary", &primary.base_url(), 100, 0),
            ("backup", &backup.base_url(), 100, 1),
        ],
        "  retries: {maxAttempts: 3, backoff: {base: 1ms, max: 5ms}}\n  circuitBreaker: {consecutiveFailures: 1, openFor: 30s}\n",
    ))
    .await;
    let (trace_id, tp) = client_trace();
    let (status, _, body) = send(
        &sc,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        &[("traceparent", &tp)],
    )
    .await;
    assert_eq!(status, 200, "{body}");

    let spans = trace(&trace_id, |s| s.len() >= 3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let server = one(&spans, SERVER);
    let attempts = clients(&spans);
    assert_eq!(attempts.len(), 2);
    let (first, second) = (attempts[0], attempts[1]);

    assert_eq!(server.name, "chat m");
    assert_eq!(server.attr("gen_ai.provider.name"), "backup");
    assert_eq!(server.attr("tailwarden.attempts"), 2);
    assert_eq!(server.attr("gen_ai.usage.output_tokens"), 2);
    assert_eq!(server.attr("gen_ai.response.model"), "m");

    for a in [first, second] {
        assert_eq!(a.parent, server.span_id, "{a:#?}");
        assert_eq!(a.name, "chat m");
    }
    assert_eq!(first.attr("tailwarden.attempt"), 1);
    assert_eq!(first.attr("gen_ai.provider.name"), "primary");
    assert_eq!(first.attr("http.response.status_code"), 503);
    assert_eq!(first.attr("error.type"), "status_5xx");
    assert_eq!(first.status, STATUS_ERROR);
    assert_eq!(second.attr("tailwarden.attempt"), 2);
    assert_eq!(second.attr("gen_ai.provider.name"), "backup");
    assert_eq!(second.attr("http.response.status_code"), 200);
    assert!(!second.attrs.contains_key("error.type"));

    let retries = server.event("retry");
    assert_eq!(retries.len(), 1, "{server:#?}");
    assert_eq!(retries[0]["tailwarden.retry.reason"], "status_5xx");
    assert_eq!(retries[0]["gen_ai.provider.name"], "primary");
    assert_eq!(retries[0]["tailwarden.attempt"], 1);
    let breaker = server.event("breaker");
    assert!(
        breaker
            .iter()
            .any(|e| e["gen_ai.provider.name"] == "primary"
                && e["tailwarden.breaker.to"] == "open"
                && e["tailwarden.breaker.reason"] == "consecutive_failures"),
        "{server:#?}"
    );

    // Each provider saw its own attempt's span as the parent.
    assert_eq!(
        seen_traceparent(&primary, 0),
        format!("00-{trace_id}-{}-01", first.span_id)
    );
    assert_eq!(
        seen_traceparent(&backup, 0),
        format!("00-{trace_id}-{}-01", second.span_id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_is_an_event_and_the_losing_attempt_is_cancelled() {
    harness();
    let slow = upstream(|_, _| Script::Respond {
        delay: Duration::from_secs(3),
        status: 200,
        headers: vec![],
        body: completion("m", "slow"),
    })
    .await;
    let fast = upstream(|_, _| ok("fast")).await;
    let sc = sidecar(&route(
        &[
            ("slow", &slow.base_url(), 100, 0),
            ("fast", &fast.base_url(), 100, 1),
        ],
        "  hedging: {enabled: true, delay: 100ms, maxPercent: 100}\n",
    ))
    .await;
    let (trace_id, tp) = client_trace();
    let (status, _, _) = send(
        &sc,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        &[("traceparent", &tp)],
    )
    .await;
    assert_eq!(status, 200);
    let spans = trace(&trace_id, |s| s.len() >= 3).await;
    let server = one(&spans, SERVER);
    let attempts = clients(&spans);
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    assert_eq!(attempts[0].attr("gen_ai.provider.name"), "slow");
    assert_eq!(attempts[0].attr("error.type"), "cancelled");
    assert_eq!(attempts[1].attr("gen_ai.provider.name"), "fast");
    assert_eq!(attempts[1].attr("tailwarden.hedge"), true);
    let outcomes: Vec<&Value> = server
        .event("hedge")
        .iter()
        .map(|e| &e["tailwarden.hedge.outcome"])
        .collect();
    assert_eq!(outcomes, [&json!("started"), &json!("won")], "{server:#?}");
    assert_eq!(server.attr("tailwarden.hedged"), true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_client_traceparent_the_server_span_is_a_root_and_starts_the_trace() {
    harness();
    let up = upstream(|_, _| ok("x")).await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    let model = "root-span-model";
    let (status, _, _) = send(
        &sc,
        &format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let tp = seen_traceparent(&up, 0);
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "the provider got a traceparent: {tp:?}");
    let spans = trace(parts[1], |s| s.len() >= 2).await;
    let server = one(&spans, SERVER);
    let attempt = one(&spans, CLIENT);
    assert_eq!(server.name, format!("chat {model}"));
    assert_eq!(server.parent, "", "a root span");
    assert_eq!(attempt.parent, server.span_id);
    assert_eq!(parts[2], attempt.span_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_stream_ends_the_spans_as_client_closed() {
    harness();
    let up = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: vec![(Duration::ZERO, chunk("m", "first"))],
        end: StreamEnd::Stall,
    })
    .await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    let (trace_id, tp) = client_trace();
    let req = Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("traceparent", &tp)
        .body(Full::new(Bytes::from(
            r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert!(
        String::from_utf8_lossy(frame.data_ref().unwrap()).contains("first"),
        "{frame:?}"
    );
    drop(body);
    let spans = trace(&trace_id, |s| s.len() >= 2).await;
    let server = one(&spans, SERVER);
    assert_eq!(server.attr("error.type"), "client_closed", "{server:#?}");
    assert_ne!(server.status, STATUS_ERROR, "not the sidecar's failure");
    assert_eq!(server.attr("http.response.status_code"), 200);
    assert_eq!(one(&spans, CLIENT).parent, server.span_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_carry_error_type_and_error_status() {
    harness();
    let up = upstream(|_, _| status(503)).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  retries: {maxAttempts: 2, backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let (trace_id, tp) = client_trace();
    let (status, _, _) = send(
        &sc,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        &[("traceparent", &tp)],
    )
    .await;
    assert_eq!(status, 503);
    let spans = trace(&trace_id, |s| s.len() >= 3).await;
    let server = one(&spans, SERVER);
    assert_eq!(server.attr("error.type"), "status_5xx");
    assert_eq!(server.status, STATUS_ERROR);
    assert_eq!(server.attr("http.response.status_code"), 503);
    assert_eq!(clients(&spans).len(), 2);

    // Refused before a provider is chosen: the span is named after the operation alone.
    let (trace_id, tp) = client_trace();
    let (status, _, _) = send(&sc, "{not json", &[("traceparent", &tp)]).await;
    assert_eq!(status, 400);
    let spans = trace(&trace_id, |s| !s.is_empty()).await;
    let server = one(&spans, SERVER);
    assert_eq!(server.name, "chat");
    assert_eq!(server.attr("http.response.status_code"), 400);
    assert_eq!(server.attr("error.type"), "invalid_request_error");
    assert_eq!(server.parent, CLIENT_PARENT);
}

/// Starts the real binary with extra environment; returns it and its client address.
fn start_binary(config: &std::path::Path, env: &[(&str, String)]) -> (std::process::Child, String) {
    use std::io::BufRead as _;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tailwarden-sidecar"));
    cmd.arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .env("TAILWARDEN_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    for var in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_TRACES_SAMPLER",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let listen = line.split_whitespace().nth(2).unwrap().to_owned();
    (child, listen)
}

async fn send_to(listen: &str, tp: &str) -> u16 {
    let req = Request::post(format!("http://{listen}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("traceparent", tp)
        .body(Full::new(Bytes::from_static(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    resp.into_body().collect().await.unwrap();
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reads_the_otel_environment_and_flushes_its_spans_on_sigterm() {
    let h = harness();
    let up = upstream(|_, _| ok("x")).await;
    let dir = TempDir::new();
    let config = dir.0.join("routes.yaml");
    std::fs::write(&config, route(&[("p", &up.base_url(), 100, 0)], "")).unwrap();
    // The generic endpoint (the exporter appends /v1/traces), a service name, and batches
    // that would wait a minute: only the shutdown flush can deliver the spans in time.
    let (mut child, listen) = start_binary(
        &config,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{}", h.addr)),
            ("OTEL_SERVICE_NAME", "checkout-sidecar".to_owned()),
            ("OTEL_BSP_SCHEDULE_DELAY", "60000".to_owned()),
        ],
    );
    let (trace_id, tp) = client_trace();
    assert_eq!(send_to(&listen, &tp).await, 200);
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let exited = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(exited.success(), "{exited:?}");
    let spans = trace(&trace_id, |s| s.len() >= 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    assert!(spans.iter().all(|s| s.service == "checkout-sidecar"));
    let server = one(&spans, SERVER);
    assert_eq!(server.parent, CLIENT_PARENT);
    assert_eq!(
        seen_traceparent(&up, 0),
        format!("00-{trace_id}-{}-01", one(&spans, CLIENT).span_id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_the_binary_traces_nothing_and_forwards_the_traceparent() {
    let h = harness();
    let up = upstream(|_, _| ok("x")).await;
    let dir = TempDir::new();
    let config = dir.0.join("routes.yaml");
    std::fs::write(&config, route(&[("p", &up.base_url(), 100, 0)], "")).unwrap();
    // A service name alone does not turn tracing on; an endpoint with the SDK disabled
    // neither.
    for env in [
        vec![("OTEL_SERVICE_NAME", "nothing".to_owned())],
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{}", h.addr)),
            ("OTEL_SDK_DISABLED", "true".to_owned()),
        ],
    ] {
        let (mut child, listen) = start_binary(&config, &env);
        let (trace_id, tp) = client_trace();
        let before = up.count();
        assert_eq!(send_to(&listen, &tp).await, 200);
        assert_eq!(seen_traceparent(&up, before), tp, "forwarded unchanged");
        // SIGTERM: a traced binary would flush its spans now.
        std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        tokio::time::sleep(MS(200)).await;
        assert!(trace(&trace_id, |_| true).await.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_is_logged_and_requests_are_unaffected() {
    let up = upstream(|_, _| ok("x")).await;
    let dir = TempDir::new();
    let config = dir.0.join("routes.yaml");
    std::fs::write(&config, route(&[("p", &up.base_url(), 100, 0)], "")).unwrap();
    let log = dir.0.join("stderr.log");
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tailwarden-sidecar"))
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .env(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            format!("http://{closed}/v1/traces"),
        )
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "500")
        .env_remove("OTEL_SDK_DISABLED")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let listen = line.split_whitespace().nth(2).unwrap().to_owned();
    for _ in 0..3 {
        let (_, tp) = client_trace();
        assert_eq!(send_to(&listen, &tp).await, 200);
    }
    let logged = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("BatchSpanProcessor.ExportError"))
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(logged, "{text}");
    assert!(text.contains("OpenTelemetry tracing on"), "{text}");
}
