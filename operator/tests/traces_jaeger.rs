//! The injected sidecar's traces in a real tracing backend: Jaeger v2 (built from the Go
//! module proxy by e2e/jaeger/build.sh, in-memory storage, OTLP receivers and query API on
//! loopback) receives the spans of a `tailwarden-sidecar` process started with exactly the
//! environment the injector renders (`inject::sidecar_container`, the downward-API fields
//! resolved as the kubelet would for a pod of Deployment `web`), and the traces are read
//! back through Jaeger's query API:
//!
//! - the SERVER span is a child of the client's `traceparent`, with one CLIENT span per
//!   attempt under it: a retry after a 503 and a hedge that beat a slow provider;
//! - GenAI attributes with token counts;
//! - each provider saw its own attempt's span in the `traceparent` it received;
//! - the resource: `service.name` = the workload, `k8s.namespace.name`, `k8s.pod.name`,
//!   `k8s.deployment.name`, and a user attribute from the chart.
//!
//! Both OTLP protocols, each with its own sidecar: OTLP/HTTP (http/protobuf, Jaeger's 4318
//! receiver) and OTLP/gRPC (the 4317 receiver).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    client::legacy::Client,
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use serde_json::{Value, json};
use tailwarden_e2e::proc::ChildProc;
use tailwarden_operator::{
    inject::{InjectConfig, sidecar_container},
    sidecar_env::{OtelConfig, OtlpProtocol, Workload},
};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Jaeger, built once (the build script is a no-op when its stamp matches, and waits on its
/// lock while another caller builds).
fn jaeger_bin() -> PathBuf {
    let out = Command::new(root().join("e2e/jaeger/build.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("e2e/jaeger/build.sh runs");
    assert!(out.status.success(), "e2e/jaeger/build.sh failed");
    let path = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(path.lines().last().unwrap().trim())
}

struct Jaeger {
    _proc: ChildProc,
    otlp_http: SocketAddr,
    otlp_grpc: SocketAddr,
    query: SocketAddr,
    log: PathBuf,
}

fn start_jaeger(dir: &Path) -> Jaeger {
    let bin = jaeger_bin();
    let [grpc, http, query, query_grpc] = [free_port(), free_port(), free_port(), free_port()];
    // Only what the test needs: the OTLP receivers, memory storage and the query API. No
    // batch processor (spans are queryable as soon as they arrive), no telemetry port.
    let config = format!(
        r#"service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics: {{level: none}}
    logs: {{level: warn}}
extensions:
  jaeger_storage:
    backends:
      mem: {{memory: {{max_traces: 10000}}}}
  jaeger_query:
    storage: {{traces: mem}}
    http: {{endpoint: "127.0.0.1:{query}"}}
    grpc: {{endpoint: "127.0.0.1:{query_grpc}"}}
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{grpc}"}}
      http: {{endpoint: "127.0.0.1:{http}"}}
exporters:
  jaeger_storage_exporter: {{trace_storage: mem}}
"#
    );
    let path = dir.join("jaeger.yaml");
    std::fs::write(&path, config).unwrap();
    let log = dir.join("jaeger.log");
    let mut cmd = Command::new(bin);
    cmd.arg("--config").arg(&path);
    Jaeger {
        _proc: ChildProc::spawn("jaeger", &cmd, &log).unwrap(),
        otlp_http: SocketAddr::from(([127, 0, 0, 1], http)),
        otlp_grpc: SocketAddr::from(([127, 0, 0, 1], grpc)),
        query: SocketAddr::from(([127, 0, 0, 1], query)),
        log,
    }
}

/// What the kubelet resolves for the downward-API fields of a pod of Deployment `web`.
fn pod_field(path: &str) -> String {
    match path {
        "metadata.namespace" => "shop",
        "metadata.name" => "web-7d9c5b-x2k4q",
        "metadata.uid" => "0b7e1f0e-5d55-4a8e-9d5c-0f3f0f3f0f3f",
        "spec.nodeName" => "node-1",
        "spec.serviceAccountName" => "web",
        other => panic!("the injector asked for a field the test does not resolve: {other}"),
    }
    .to_owned()
}

/// Kubernetes' `$(VAR)` expansion: a reference to a variable defined earlier in the list.
fn expand(value: &str, defined: &[(String, String)]) -> String {
    let mut out = value.to_owned();
    for (k, v) in defined {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// The sidecar container's environment, resolved as the kubelet does.
fn injected_env(otel: OtelConfig) -> Vec<(String, String)> {
    let mut cfg = InjectConfig::new("tailwarden/sidecar:test");
    cfg.otel = Some(otel);
    let workload = Workload {
        kind: "Deployment".into(),
        name: "web".into(),
    };
    let container = sidecar_container(false, &workload, &cfg);
    let mut env: Vec<(String, String)> = Vec::new();
    for e in container["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap().to_owned();
        let value = if let Some(v) = e["value"].as_str() {
            expand(v, &env)
        } else if let Some(path) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            pod_field(path)
        } else {
            panic!("an env source the test does not resolve: {e}");
        };
        env.push((name, value));
    }
    env
}

/// One scripted upstream: answers by call number, records each `traceparent` it saw.
#[derive(Clone)]
struct Upstream {
    addr: SocketAddr,
    traceparents: Arc<Mutex<Vec<String>>>,
}

#[derive(Clone, Copy)]
enum Behaviour {
    Fail503,
    Ok { delay: Duration },
}

fn completion(model: &str, prompt: u64, output: u64) -> String {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
    })
    .to_string()
}

async fn upstream(behaviour: Behaviour) -> Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let traceparents = Arc::new(Mutex::new(Vec::new()));
    let seen = traceparents.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (seen, calls) = (seen.clone(), calls.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let (seen, calls) = (seen.clone(), calls.clone());
                    async move {
                        calls.fetch_add(1, Ordering::SeqCst);
                        if let Some(tp) = req.headers().get("traceparent") {
                            seen.lock()
                                .unwrap()
                                .push(tp.to_str().unwrap_or_default().to_owned());
                        }
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        let model = body
                            .ok()
                            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                            .and_then(|v| v["model"].as_str().map(str::to_owned))
                            .unwrap_or_default();
                        let response = match behaviour {
                            Behaviour::Fail503 => Response::builder()
                                .status(503)
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(
                                    r#"{"error":{"message":"overloaded","type":"server_error"}}"#,
                                ))),
                            Behaviour::Ok { delay } => {
                                tokio::time::sleep(delay).await;
                                Response::builder()
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from(completion(&model, 12, 7))))
                            }
                        };
                        Ok::<_, std::io::Error>(response.unwrap())
                    }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Upstream { addr, traceparents }
}

async fn get_json(url: &str) -> Option<Value> {
    let client: Client<_, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client.get(url.parse().ok()?).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&body).ok()
}

async fn post_chat(listen: &str, model: &str, traceparent: &str) -> (u16, String) {
    let client: Client<_, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    let req = Request::post(format!("http://{listen}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("traceparent", traceparent)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// One span from Jaeger's query API (`/api/traces/{id}`), with its process (resource).
#[derive(Debug)]
struct JSpan {
    span_id: String,
    parent: Option<String>,
    name: String,
    tags: BTreeMap<String, Value>,
    service: String,
    resource: BTreeMap<String, Value>,
}

impl JSpan {
    fn tag(&self, key: &str) -> &Value {
        self.tags.get(key).unwrap_or(&Value::Null)
    }
    fn kind(&self) -> &str {
        self.tag("span.kind").as_str().unwrap_or_default()
    }
}

fn tags(list: &Value) -> BTreeMap<String, Value> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|t| (t["key"].as_str().unwrap().to_owned(), t["value"].clone()))
        .collect()
}

/// The trace's spans, once Jaeger has at least `want` of them.
async fn jaeger_trace(jaeger: &Jaeger, trace_id: &str, want: usize) -> Vec<JSpan> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let url = format!("http://{}/api/traces/{trace_id}", jaeger.query);
        if let Some(v) = get_json(&url).await {
            let trace = &v["data"][0];
            let spans: Vec<JSpan> = trace["spans"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| {
                    let process = &trace["processes"][s["processID"].as_str().unwrap()];
                    JSpan {
                        span_id: s["spanID"].as_str().unwrap().to_owned(),
                        parent: s["references"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .find(|r| r["refType"] == "CHILD_OF")
                            .map(|r| r["spanID"].as_str().unwrap().to_owned()),
                        name: s["operationName"].as_str().unwrap().to_owned(),
                        tags: tags(&s["tags"]),
                        service: process["serviceName"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                        resource: tags(&process["tags"]),
                    }
                })
                .collect();
            if spans.len() >= want {
                return spans;
            }
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(&jaeger.log).unwrap_or_default();
            panic!("Jaeger has no trace {trace_id} with {want} spans after 30 s\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn client_traceparent() -> (String, String, String) {
    let trace_id = format!("{:032x}", rand_u128());
    let parent = format!("{:016x}", rand_u128() as u64 | 1);
    let tp = format!("00-{trace_id}-{parent}-01");
    (trace_id, parent, tp)
}

fn rand_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let s = std::collections::hash_map::RandomState::new();
    let mut h = s.build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    let a = h.finish();
    h.write_u64(a);
    (u128::from(a) << 64) | u128::from(h.finish())
}

fn sidecar_bin() -> PathBuf {
    if let Ok(p) = std::env::var("TAILWARDEN_SIDECAR_BIN") {
        return PathBuf::from(p);
    }
    let path =
        Path::new(env!("CARGO_BIN_EXE_tailwarden-operator")).with_file_name("tailwarden-sidecar");
    assert!(
        path.exists(),
        "{} is not built: `cargo build -p tailwarden-sidecar` (make test builds it), or set TAILWARDEN_SIDECAR_BIN",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jaeger_receives_the_injected_sidecars_spans_over_otlp_http_and_grpc() {
    let dir = std::env::temp_dir().join(format!("tw-jaeger-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jaeger = start_jaeger(&dir);
    for protocol in [OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc] {
        let endpoint = match protocol {
            OtlpProtocol::HttpProtobuf => format!("http://{}", jaeger.otlp_http),
            OtlpProtocol::Grpc => format!("http://{}", jaeger.otlp_grpc),
        };
        let dir = dir.join(protocol.as_str().replace('/', "-"));
        std::fs::create_dir_all(&dir).unwrap();
        traced_through_jaeger(&jaeger, &dir, OtelConfig::new(endpoint, protocol)).await;
    }
    drop(jaeger);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One sidecar exporting with `otel`: a retried and a hedged request, read back from Jaeger.
async fn traced_through_jaeger(jaeger: &Jaeger, dir: &Path, mut otel: OtelConfig) {
    let what = otel.protocol.as_str();

    let flaky = upstream(Behaviour::Fail503).await;
    let backup = upstream(Behaviour::Ok {
        delay: Duration::ZERO,
    })
    .await;
    let slow = upstream(Behaviour::Ok {
        delay: Duration::from_secs(3),
    })
    .await;
    let fast = upstream(Behaviour::Ok {
        delay: Duration::ZERO,
    })
    .await;
    let provider = |name: &str, up: &Upstream, priority: u32| {
        format!(
            "  - {{name: {name}, baseUrl: 'http://{}/v1', priority: {priority}}}\n",
            up.addr
        )
    };
    let config = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: shop}}\nspec:\n  models: [m]\n  providers:\n{}{}  retries: {{maxAttempts: 3, backoff: {{base: 1ms, max: 5ms}}}}\n---\napiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: hedged, namespace: shop}}\nspec:\n  models: [h]\n  providers:\n{}{}  hedging: {{enabled: true, delay: 100ms, maxPercent: 100}}\n",
        provider("flaky", &flaky, 0),
        provider("backup", &backup, 1),
        provider("slow", &slow, 0),
        provider("fast", &fast, 1),
    );
    let config_path = dir.join("routes.yaml");
    std::fs::write(&config_path, config).unwrap();

    // The environment the injector renders for tracing to this Jaeger.
    otel.resource_attributes = vec![("deployment.environment.name".into(), "test".into())];
    let env = injected_env(otel);
    let env_names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    assert!(
        env_names.contains(&"OTEL_EXPORTER_OTLP_ENDPOINT")
            && env_names.contains(&"OTEL_RESOURCE_ATTRIBUTES"),
        "{env_names:?}"
    );
    assert!(env.contains(&("OTEL_EXPORTER_OTLP_PROTOCOL".to_owned(), what.to_owned())));

    let listen = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(sidecar_bin());
    cmd.args(["--config", config_path.to_str().unwrap()]).args([
        "--listen",
        &listen,
        "--admin",
        &admin,
        "--log-format",
        "json",
    ]);
    // Nothing of this process's own OTEL_*/TAILWARDEN_* settings: only what was injected.
    for (k, _) in std::env::vars() {
        if k.starts_with("OTEL_") || k.starts_with("TAILWARDEN_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let _sidecar = ChildProc::spawn("tailwarden-sidecar", &cmd, &dir.join("sidecar.log")).unwrap();
    let ready = Instant::now() + Duration::from_secs(30);
    while get_json(&format!("http://{admin}/config")).await.is_none() {
        assert!(Instant::now() < ready, "the sidecar did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A retry: flaky answers 503, backup serves.
    let (trace_id, client_span, tp) = client_traceparent();
    let (status, body) = post_chat(&listen, "m", &tp).await;
    assert_eq!(status, 200, "{body}");
    let spans = jaeger_trace(jaeger, &trace_id, 3).await;
    assert_eq!(spans.len(), 3, "{what}: {spans:#?}");
    let server: Vec<&JSpan> = spans.iter().filter(|s| s.kind() == "server").collect();
    assert_eq!(server.len(), 1, "{spans:#?}");
    let server = server[0];
    assert_eq!(server.parent.as_deref(), Some(client_span.as_str()));
    assert_eq!(server.name, "chat m");
    let mut attempts: Vec<&JSpan> = spans.iter().filter(|s| s.kind() == "client").collect();
    attempts.sort_by_key(|s| s.tag("tailwarden.attempt").as_i64());
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    for a in &attempts {
        assert_eq!(a.parent.as_deref(), Some(server.span_id.as_str()), "{a:#?}");
        assert_eq!(a.tag("gen_ai.operation.name"), "chat");
        assert_eq!(a.tag("gen_ai.request.model"), "m");
    }
    assert_eq!(attempts[0].tag("gen_ai.provider.name"), "flaky");
    assert_eq!(attempts[0].tag("http.response.status_code"), 503);
    assert_eq!(attempts[0].tag("error.type"), "status_5xx");
    assert_eq!(attempts[1].tag("gen_ai.provider.name"), "backup");
    assert_eq!(attempts[1].tag("http.response.status_code"), 200);
    // GenAI attributes with the token counts the provider reported.
    assert_eq!(server.tag("gen_ai.provider.name"), "backup");
    assert_eq!(server.tag("gen_ai.response.model"), "m");
    assert_eq!(server.tag("gen_ai.usage.input_tokens"), 12);
    assert_eq!(server.tag("gen_ai.usage.output_tokens"), 7);
    // Each provider saw its own attempt as the parent.
    assert_eq!(
        flaky.traceparents.lock().unwrap()[0],
        format!("00-{trace_id}-{}-01", attempts[0].span_id)
    );
    assert_eq!(
        backup.traceparents.lock().unwrap()[0],
        format!("00-{trace_id}-{}-01", attempts[1].span_id)
    );
    // The resource: the workload identity from the downward API and the chart's attribute.
    for s in &spans {
        assert_eq!(s.service, "web", "service.name is the workload");
        for (key, want) in [
            ("k8s.namespace.name", "shop"),
            ("k8s.pod.name", "web-7d9c5b-x2k4q"),
            ("k8s.pod.uid", "0b7e1f0e-5d55-4a8e-9d5c-0f3f0f3f0f3f"),
            ("k8s.node.name", "node-1"),
            ("k8s.deployment.name", "web"),
            ("k8s.container.name", "tailwarden-sidecar"),
            (
                "service.instance.id",
                "shop.web-7d9c5b-x2k4q.tailwarden-sidecar",
            ),
            ("deployment.environment.name", "test"),
        ] {
            assert_eq!(
                s.resource.get(key),
                Some(&json!(want)),
                "{key}: {:#?}",
                s.resource
            );
        }
    }

    // A hedge: slow takes 3 s, the hedge to fast after 100 ms wins.
    let (trace_id, client_span, tp) = client_traceparent();
    let (status, body) = post_chat(&listen, "h", &tp).await;
    assert_eq!(status, 200, "{body}");
    let spans = jaeger_trace(jaeger, &trace_id, 3).await;
    assert_eq!(spans.len(), 3, "{what}: {spans:#?}");
    let server = spans.iter().find(|s| s.kind() == "server").unwrap();
    assert_eq!(server.parent.as_deref(), Some(client_span.as_str()));
    assert_eq!(server.tag("tailwarden.hedged"), true);
    let attempts: Vec<&JSpan> = spans.iter().filter(|s| s.kind() == "client").collect();
    assert_eq!(attempts.len(), 2);
    let by = |p: &str| {
        *attempts
            .iter()
            .find(|a| a.tag("gen_ai.provider.name") == p)
            .unwrap_or_else(|| panic!("no attempt to {p}: {attempts:#?}"))
    };
    let (lost, won) = (by("slow"), by("fast"));
    assert_eq!(lost.tag("error.type"), "cancelled");
    assert_eq!(won.tag("tailwarden.hedge"), true);
    for a in [lost, won] {
        assert_eq!(a.parent.as_deref(), Some(server.span_id.as_str()));
    }
    assert_eq!(server.tag("gen_ai.usage.output_tokens"), 7);
    assert_eq!(
        fast.traceparents.lock().unwrap()[0],
        format!("00-{trace_id}-{}-01", won.span_id)
    );
}
