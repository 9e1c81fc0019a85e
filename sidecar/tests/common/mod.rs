//! Test harness: scripted upstream providers and an in-process sidecar, over real loopback HTTP.
#![allow(dead_code)]

/// The real `redis-server` harness, shared with the e2e tests (plain, or TLS with AUTH).
#[path = "../../../e2e/tests/common/redis_server.rs"]
pub mod redis;

pub mod access;

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::{body::Frame, body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use tailwarden_sidecar::{
    app::{App, reload},
    config::{Registries, RouteTable},
    record::metrics::Metrics,
    server,
};
use tokio::net::TcpListener;

/// What a scripted upstream does with one request.
#[derive(Clone, Debug)]
pub enum Script {
    /// A complete response after `delay`.
    Respond {
        delay: Duration,
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Status 200, `text/event-stream`, then each chunk after its delay; then `end`.
    Stream {
        first_delay: Duration,
        chunks: Vec<(Duration, String)>,
        end: StreamEnd,
    },
    /// Close the connection without a response.
    Reset,
    /// Never answer.
    Stall,
}

#[derive(Clone, Copy, Debug)]
pub enum StreamEnd {
    Finish,
    Abort,
    Stall,
}

/// What the upstream saw.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The request's method and path (`POST /v1/responses`).
    pub path: String,
    pub body: String,
    pub headers: http::HeaderMap,
    pub at: Instant,
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub requests: Arc<AtomicUsize>,
    /// Times at which a response (or its stream) was abandoned by the sidecar.
    pub cancelled: Arc<Mutex<Vec<Instant>>>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
    pub fn count(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
    pub fn cancellations(&self) -> Vec<Instant> {
        self.cancelled.lock().unwrap().clone()
    }
}

struct CancelGuard {
    armed: bool,
    cancelled: Arc<Mutex<Vec<Instant>>>,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.cancelled.lock().unwrap().push(Instant::now());
        }
    }
}

type Body = BoxBody<Bytes, std::io::Error>;

fn full(s: String) -> Body {
    http_body_util::Full::new(Bytes::from(s))
        .map_err(|never| match never {})
        .boxed()
}

/// Starts an upstream whose `script(n, body)` decides the answer to its n-th request (0-based).
pub async fn upstream<F>(script: F) -> Upstream
where
    F: Fn(usize, &str) -> Script + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let script = Arc::new(script);
    let (r, c, s) = (requests.clone(), cancelled.clone(), seen.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (r, c, s, script) = (r.clone(), c.clone(), s.clone(), script.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let (r, c, s, script) = (r.clone(), c.clone(), s.clone(), script.clone());
                    async move {
                        let n = r.fetch_add(1, Ordering::SeqCst);
                        let headers = req.headers().clone();
                        let path = format!("{} {}", req.method(), req.uri().path());
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let body = String::from_utf8_lossy(&body).into_owned();
                        s.lock().unwrap().push(Seen {
                            path,
                            body: body.clone(),
                            headers,
                            at: Instant::now(),
                        });
                        let mut guard = CancelGuard {
                            armed: true,
                            cancelled: c.clone(),
                        };
                        match script(n, &body) {
                            Script::Respond {
                                delay,
                                status,
                                headers,
                                body,
                            } => {
                                tokio::time::sleep(delay).await;
                                guard.armed = false;
                                let mut resp = Response::new(full(body));
                                *resp.status_mut() = StatusCode::from_u16(status).unwrap();
                                resp.headers_mut()
                                    .insert("content-type", "application/json".parse().unwrap());
                                for (k, v) in headers {
                                    resp.headers_mut().insert(k, v.parse().unwrap());
                                }
                                Ok::<_, std::io::Error>(resp)
                            }
                            Script::Reset => {
                                guard.armed = false;
                                Err(std::io::Error::other("scripted reset"))
                            }
                            Script::Stall => {
                                std::future::pending::<()>().await;
                                unreachable!()
                            }
                            Script::Stream {
                                first_delay,
                                chunks,
                                end,
                            } => {
                                tokio::time::sleep(first_delay).await;
                                guard.armed = false;
                                let (tx, rx) = tokio::sync::mpsc::channel::<
                                    Result<Frame<Bytes>, std::io::Error>,
                                >(1);
                                let c2 = c.clone();
                                tokio::spawn(async move {
                                    for (delay, chunk) in chunks {
                                        tokio::time::sleep(delay).await;
                                        if tx
                                            .send(Ok(Frame::data(Bytes::from(chunk))))
                                            .await
                                            .is_err()
                                        {
                                            c2.lock().unwrap().push(Instant::now());
                                            return;
                                        }
                                    }
                                    match end {
                                        StreamEnd::Finish => {}
                                        StreamEnd::Abort => {
                                            let _ = tx
                                                .send(Err(std::io::Error::other("scripted abort")))
                                                .await;
                                        }
                                        StreamEnd::Stall => {
                                            tx.closed().await;
                                            c2.lock().unwrap().push(Instant::now());
                                        }
                                    }
                                });
                                let stream = tokio_stream_from(rx);
                                let mut resp = Response::new(StreamBody::new(stream).boxed());
                                resp.headers_mut()
                                    .insert("content-type", "text/event-stream".parse().unwrap());
                                Ok(resp)
                            }
                        }
                    }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Upstream {
        addr,
        requests,
        cancelled,
        seen,
        task,
    }
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// A JSON chat completion body.
pub fn completion(model: &str, text: &str) -> String {
    serde_json::json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    })
    .to_string()
}

pub fn ok(text: &str) -> Script {
    Script::Respond {
        delay: Duration::ZERO,
        status: 200,
        headers: vec![],
        body: completion("m", text),
    }
}

pub fn status(code: u16) -> Script {
    Script::Respond {
        delay: Duration::ZERO,
        status: code,
        headers: vec![],
        body: format!(
            r#"{{"error":{{"message":"scripted {code}","type":"server_error","param":null,"code":null}}}}"#
        ),
    }
}

/// One SSE content chunk.
pub fn sse_chunk(text: &str) -> String {
    format!(
        "data: {}\n\n",
        serde_json::json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"m",
            "choices":[{"index":0,"delta":{"content":text},"finish_reason":null}]})
    )
}

pub fn sse_usage() -> String {
    format!(
        "data: {}\n\n",
        serde_json::json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],
            "usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}})
    )
}

pub const DONE: &str = "data: [DONE]\n\n";

/// A running in-process sidecar.
pub struct Sidecar {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    pub config: std::path::PathBuf,
    _dir: TempDir,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Sidecar {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tailwarden-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts a sidecar on a free port with the given config YAML; reloads every 100 ms.
pub async fn sidecar(config_yaml: &str) -> Sidecar {
    sidecar_with(config_yaml, |_| {}).await
}

/// Like [`sidecar`], with a chance to adjust the app before it starts.
pub async fn sidecar_with(config_yaml: &str, adjust: impl FnOnce(&mut App)) -> Sidecar {
    let dir = TempDir::new();
    let config = dir.0.join("routes.yaml");
    std::fs::write(&config, config_yaml).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let registries = Registries::new(&metrics);
    let (table, hash): (RouteTable, String) =
        reload::load(&registries, &config).expect("test config is valid");
    let mut app = App::new(table, metrics, registries);
    adjust(&mut app);
    let app = Arc::new(app);
    reload::loaded(&app, &config, hash);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tasks = vec![
        tokio::spawn(server::serve(
            listener,
            app.clone(),
            std::future::pending(),
            Duration::from_secs(1),
        )),
        tokio::spawn(reload::watch(
            app.clone(),
            config.clone(),
            Duration::from_millis(100),
        )),
    ];
    Sidecar {
        addr,
        app,
        config,
        _dir: dir,
        tasks,
    }
}

/// A route YAML with the given providers `(name, base_url, weight, priority)` and extra spec.
pub fn route(providers: &[(&str, &str, u32, u32)], extra_spec: &str) -> String {
    let mut out = String::from(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {name: test, namespace: t}\nspec:\n  models: ['*']\n  providers:\n",
    );
    for (name, url, weight, priority) in providers {
        out.push_str(&format!(
            "  - {{name: {name}, baseUrl: '{url}', weight: {weight}, priority: {priority}}}\n"
        ));
    }
    out.push_str(extra_spec);
    out
}

/// A plain reqwest-free HTTP client for tests.
pub fn client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<Bytes>,
> {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new())
}

/// Result of one request: status, headers and the whole body.
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

pub async fn post(sc: &Sidecar, path: &str, body: &str) -> Reply {
    post_with(sc, path, &[], Bytes::from(body.to_owned())).await
}

/// [`post`] of raw bytes, with extra request headers (a `content-encoding`, say).
pub async fn post_with(sc: &Sidecar, path: &str, headers: &[(&str, &str)], body: Bytes) -> Reply {
    let mut req = Request::post(sc.url(path)).header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(http_body_util::Full::new(body)).unwrap();
    let resp = client().request(req).await.expect("sidecar answers");
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

pub async fn chat(sc: &Sidecar, stream: bool) -> Reply {
    post(
        sc,
        "/v1/chat/completions",
        &format!(
            r#"{{"model":"m","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
        ),
    )
    .await
}

/// Polls `cond` every 20 ms until it holds or `limit` passes; returns whether it held.
/// For effects of background work (reloads, key re-reads) whose timing depends on load.
pub async fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
