//! The simulator's HTTP server: routing, request parsing, fault injection and timing.
//!
//! One hyper connection task per TCP connection, HTTP/1.1 and h2c via the hyper-util auto
//! builder. Every API request gets its own RNG seeded from `--seed` and an atomic request
//! number, so a run with the same seed and the same request order injects the same faults
//! and latencies no matter which worker thread serves which request.
//!
//! Chaos tests also need faults that start and stop *during* a run, for every request at
//! once, the way a real provider fails: [`SimHandle::set_fault`] forces one fault on every
//! new request and [`SimHandle::set_frozen`] freezes every streamed body, in flight or new
//! (a provider hanging after its headers). Both are plain atomics read per request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::body::{Gaps, SimBody, StreamPlan, ms};
use super::fate::{Conditions, Fate};
use super::profile::{BrownoutEffect, CompiledProfile, Fault, Profile, ProfileError};
use super::render::{
    self, Api, StreamRenderer, Usage, completion_json, embeddings_json, error_json, json_string,
};
use super::stats::{Endpoint, Outcome, RequestGuard, Stats, StatsSnapshot};

/// Largest request body accepted (the sidecar's default limit is 16 MiB).
const MAX_BODY: usize = 32 * 1024 * 1024;

/// Largest output a single request may ask for via `x-sim-tokens`.
const MAX_TOKENS: u64 = 1_000_000;

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The profile is unusable.
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address asked for.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
}

/// Returned by the service to make hyper close the connection without a response (the
/// `reset` fault); for HTTP/2 it becomes a stream reset.
#[derive(Debug, thiserror::Error)]
#[error("injected connection reset")]
pub struct ResetConnection;

/// Faults switched on and off while the simulator runs (see [`SimHandle::set_fault`]).
#[derive(Debug, Default)]
struct Chaos {
    /// The forced fault: 0 for none, else [`fault_code`].
    fault: AtomicU8,
    /// While set, streamed bodies send nothing (shared with every stream body).
    frozen: Arc<AtomicBool>,
}

/// The forced-fault codes of [`Chaos::fault`] (0 means "no forced fault").
fn fault_code(fault: Option<Fault>) -> u8 {
    match fault {
        None => 0,
        Some(Fault::None) => 1,
        Some(Fault::Status500) => 2,
        Some(Fault::Status503) => 3,
        Some(Fault::RateLimited) => 4,
        Some(Fault::Reset) => 5,
        Some(Fault::Drop) => 6,
        Some(Fault::Stall) => 7,
        Some(Fault::FailBeforeContent) => 8,
        Some(Fault::StreamFailBeforeContent) => 9,
    }
}

fn fault_from_code(code: u8) -> Option<Fault> {
    Some(match code {
        1 => Fault::None,
        2 => Fault::Status500,
        3 => Fault::Status503,
        4 => Fault::RateLimited,
        5 => Fault::Reset,
        6 => Fault::Drop,
        7 => Fault::Stall,
        8 => Fault::FailBeforeContent,
        9 => Fault::StreamFailBeforeContent,
        _ => return None,
    })
}

impl Chaos {
    fn fault(&self) -> Option<Fault> {
        fault_from_code(self.fault.load(Ordering::Relaxed))
    }

    fn frozen(&self) -> bool {
        self.frozen.load(Ordering::Relaxed)
    }
}

/// Attempt numbers per request key, shared by every simulated provider of one upstream group
/// (see [`super::fate`]): the `k`-th attempt of request `x-request-id: K` that reaches any
/// of them is attempt `k`, whichever provider it lands on.
#[derive(Debug, Default)]
pub struct FateLedger {
    seen: std::sync::Mutex<std::collections::HashMap<String, (u32, Instant)>>,
}

/// Keys kept before old ones are forgotten (a key is a client request; its attempts come
/// within the route's total deadline).
const LEDGER_KEYS: usize = 200_000;
const LEDGER_KEEP: Duration = Duration::from_secs(600);

impl FateLedger {
    /// A new, empty ledger.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Counts one more attempt of `key` and returns its number (1 for the first).
    pub fn next_attempt(&self, key: &str) -> u32 {
        let now = Instant::now();
        let Ok(mut seen) = self.seen.lock() else {
            return 1;
        };
        if seen.len() >= LEDGER_KEYS && !seen.contains_key(key) {
            seen.retain(|_, (_, at)| now.duration_since(*at) < LEDGER_KEEP);
        }
        let entry = seen.entry(key.to_owned()).or_insert((0, now));
        entry.0 = entry.0.saturating_add(1);
        entry.1 = now;
        entry.0
    }
}

/// How a simulator is wired beyond its profile and seed.
#[derive(Debug, Clone, Default)]
pub struct SimOptions {
    /// Keyed fates: requests carrying `x-request-id` meet the fate of their attempt number in
    /// this ledger ([`super::fate`]) instead of a draw from the arrival counter.
    pub ledger: Option<Arc<FateLedger>>,
    /// Time zero of the profile's windows and account-limit windows (default: bind time), so
    /// the simulators of two runs that are compared start their windows together.
    pub epoch: Option<Instant>,
}

/// The account-limit window in use: its number since the epoch and the answers given in it.
#[derive(Debug, Default)]
struct AccountWindow {
    index: u64,
    used: u32,
}

/// Shared state of one simulator process.
#[derive(Debug)]
struct SimState {
    profile: CompiledProfile,
    seed: u64,
    counter: AtomicU64,
    stats: Arc<Stats>,
    /// Bind time; the epoch is `base + epoch_ns` (see [`SimHandle::restart_clock`]).
    base: Instant,
    epoch_ns: AtomicU64,
    models_body: Bytes,
    chaos: Chaos,
    ledger: Option<Arc<FateLedger>>,
    account: std::sync::Mutex<AccountWindow>,
}

/// The account limit's verdict on one request.
enum Account {
    /// No limit configured.
    Unmetered,
    /// Admitted: the headers to send with the answer.
    Admitted {
        limit: u32,
        remaining: u32,
        reset: Duration,
    },
    /// Out of requests until `reset`.
    Exhausted { limit: u32, reset: Duration },
}

impl SimState {
    fn brownout(&self) -> BrownoutEffect {
        if self.profile.has_brownouts() {
            self.profile.brownout_at(self.elapsed())
        } else {
            BrownoutEffect {
                latency_multiplier: 1.0,
                error_percent: 0.0,
                active: false,
            }
        }
    }

    fn snapshot(&self) -> StatsSnapshot {
        self.stats.snapshot(self.brownout().active)
    }

    /// Time since the epoch (zero before it).
    fn elapsed(&self) -> Duration {
        let epoch = self.base + Duration::from_nanos(self.epoch_ns.load(Ordering::Relaxed));
        epoch.elapsed()
    }

    fn conditions(&self) -> Conditions {
        if self.profile.has_windows() {
            self.profile.conditions_at(self.elapsed())
        } else {
            Conditions::CALM
        }
    }

    /// Meters one request against the account limit (rejected requests use nothing).
    fn meter(&self) -> Account {
        let Some(limit) = &self.profile.account_limit else {
            return Account::Unmetered;
        };
        let window = limit.window_s;
        let t = self.elapsed().as_secs_f64();
        let index = (t / window).floor() as u64;
        let reset = Duration::from_secs_f64(((index + 1) as f64 * window - t).max(0.0));
        let Ok(mut w) = self.account.lock() else {
            return Account::Unmetered;
        };
        if w.index != index {
            *w = AccountWindow { index, used: 0 };
        }
        if w.used >= limit.requests {
            return Account::Exhausted {
                limit: limit.requests,
                reset,
            };
        }
        w.used += 1;
        Account::Admitted {
            limit: limit.requests,
            remaining: limit.requests - w.used,
            reset,
        }
    }
}

/// OpenAI's `x-ratelimit-reset-*` format: `250ms`, `1.5s`, `1m30s`.
fn reset_text(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let text = format!("{:.3}", d.as_secs_f64());
        format!("{}s", text.trim_end_matches('0').trim_end_matches('.'))
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

fn ratelimit_headers(h: &mut HeaderMap, limit: u32, remaining: u32, reset: Duration) {
    h.insert("x-ratelimit-limit-requests", HeaderValue::from(limit));
    h.insert(
        "x-ratelimit-remaining-requests",
        HeaderValue::from(remaining),
    );
    if let Ok(v) = HeaderValue::from_str(&reset_text(reset)) {
        h.insert("x-ratelimit-reset-requests", v);
    }
}

/// The 429 of an exhausted account: `Retry-After` is the time to the reset, rounded up.
fn account_exhausted(limit: u32, reset: Duration) -> Response<SimBody> {
    let mut resp = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        "Rate limit reached for requests per window on this account. Please try again after the reset.",
        "requests",
        Some("rate_limit_exceeded"),
    );
    let h = resp.headers_mut();
    let secs = reset.as_secs() + u64::from(reset.subsec_nanos() > 0);
    h.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
    ratelimit_headers(h, limit, 0, reset);
    resp
}

/// A bound, not yet running simulator.
#[derive(Debug)]
pub struct SimServer {
    listener: TcpListener,
    state: Arc<SimState>,
}

/// A simulator running on the current tokio runtime; dropping it stops accepting.
#[derive(Debug)]
pub struct SimHandle {
    addr: SocketAddr,
    state: Arc<SimState>,
    task: JoinHandle<()>,
}

impl SimHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL for OpenAI clients, e.g. `http://127.0.0.1:40123/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.state.snapshot()
    }

    /// Forces `fault` on every API request that arrives from now on, whatever the profile
    /// draws or the `x-sim-fault` header asks; `None` goes back to those. Requests already
    /// being answered are not affected (see [`SimHandle::set_frozen`] for those).
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.state
            .chaos
            .fault
            .store(fault_code(fault), Ordering::Relaxed);
    }

    /// Restarts the clock of the profile's windows and account limit at `epoch` (not before
    /// the bind): two runs that are compared start their windows with their loads.
    pub fn restart_clock(&self, epoch: Instant) {
        let ns = epoch.saturating_duration_since(self.state.base).as_nanos();
        self.state
            .epoch_ns
            .store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
        if let Ok(mut w) = self.state.account.lock() {
            *w = AccountWindow::default();
        }
    }

    /// Freezes (`true`) or thaws every streamed response: while frozen, streams in flight
    /// stop where they are and new ones send their headers and nothing else, and
    /// non-streamed responses that become ready are sent as headers only, then silence (as
    /// the `stall` fault). Thawed streams carry on where they stopped.
    pub fn set_frozen(&self, frozen: bool) {
        self.state.chaos.frozen.store(frozen, Ordering::Relaxed);
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SimServer {
    /// Validates the profile and binds `addr` (port 0 picks a free port).
    pub async fn bind(addr: SocketAddr, profile: &Profile, seed: u64) -> Result<Self, SimError> {
        Self::bind_with(addr, profile, seed, SimOptions::default()).await
    }

    /// [`SimServer::bind`] with keyed fates and/or a chosen epoch.
    pub async fn bind_with(
        addr: SocketAddr,
        profile: &Profile,
        seed: u64,
        options: SimOptions,
    ) -> Result<Self, SimError> {
        let compiled = profile.compile("(in-memory profile)")?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| SimError::Bind { addr, source })?;
        let started = options.epoch.unwrap_or_else(Instant::now);
        let models_body = render::models_json(&compiled.models);
        Ok(Self {
            listener,
            state: Arc::new(SimState {
                profile: compiled,
                seed,
                counter: AtomicU64::new(0),
                stats: Arc::new(Stats::new(started)),
                base: started,
                epoch_ns: AtomicU64::new(0),
                models_body,
                chaos: Chaos::default(),
                ledger: options.ledger,
                account: std::sync::Mutex::new(AccountWindow::default()),
            }),
        })
    }

    /// The bound address (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        // A bound TcpListener always has a local address; fall back to unspecified rather
        // than panic if the OS ever says otherwise.
        self.listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// Serves forever.
    pub async fn run(self) {
        serve(self.listener, self.state).await;
    }

    /// Serves on a background task of the current runtime.
    pub fn spawn(self) -> SimHandle {
        let addr = self.local_addr();
        let state = self.state.clone();
        let task = tokio::spawn(serve(self.listener, self.state));
        SimHandle { addr, state, task }
    }
}

async fn serve(listener: TcpListener, state: Arc<SimState>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(_) => {
                // Typically EMFILE under an overload test; back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(state.clone(), req));
            // Errors here are client disconnects and injected faults; nothing to report.
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn json_response(status: StatusCode, body: Bytes) -> Response<SimBody> {
    let mut resp = Response::new(SimBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error_response(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response<SimBody> {
    json_response(status, error_json(message, kind, None, code))
}

async fn handle(
    state: Arc<SimState>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ResetConnection> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let endpoint = match path.as_str() {
        "/v1/chat/completions" => Endpoint::ChatCompletions,
        "/v1/completions" => Endpoint::Completions,
        "/v1/embeddings" => Endpoint::Embeddings,
        "/v1/responses" => Endpoint::Responses,
        "/v1/models" => Endpoint::Models,
        "/healthz" => Endpoint::Healthz,
        "/v1/moderations" => Endpoint::Moderations,
        "/v1/files" => Endpoint::Files,
        p if p.starts_with("/v1/files/") => Endpoint::Files,
        p if p.starts_with("/v1/responses/") => Endpoint::ResponseObject,
        "/sim/stats" if method == Method::GET => {
            let body = serde_json::to_vec(&state.snapshot()).unwrap_or_default();
            return Ok(json_response(StatusCode::OK, Bytes::from(body)));
        }
        "/sim/reset" if method == Method::POST => {
            state.stats.reset();
            return Ok(json_response(StatusCode::OK, Bytes::from_static(b"{}")));
        }
        _ => Endpoint::Other,
    };
    state
        .stats
        .record_request(endpoint, req.headers().get(AUTHORIZATION));
    let wanted = match endpoint {
        Endpoint::Models | Endpoint::Healthz => Method::GET,
        // Their own methods, checked by `objects`.
        Endpoint::Files | Endpoint::ResponseObject => method.clone(),
        _ => Method::POST,
    };
    if endpoint == Endpoint::Other {
        state.stats.record_outcome(Outcome::NotFound);
        let msg = format!("Invalid URL ({} {})", method, req.uri().path());
        return Ok(error_response(
            StatusCode::NOT_FOUND,
            &msg,
            "invalid_request_error",
            None,
        ));
    }
    if method != wanted {
        state.stats.record_outcome(Outcome::NotFound);
        let msg = format!("Method {} not allowed for {}", method, req.uri().path());
        return Ok(error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &msg,
            "invalid_request_error",
            None,
        ));
    }
    match endpoint {
        Endpoint::Healthz => {
            state.stats.record_outcome(Outcome::Ok);
            let mut resp = Response::new(SimBody::full(Bytes::from_static(b"ok\n")));
            resp.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            Ok(resp)
        }
        Endpoint::Models => {
            state.stats.record_outcome(Outcome::Ok);
            Ok(json_response(StatusCode::OK, state.models_body.clone()))
        }
        Endpoint::ChatCompletions => generate(&state, req, Api::Chat).await,
        Endpoint::Completions => generate(&state, req, Api::Completion).await,
        Endpoint::Responses => generate(&state, req, Api::Responses).await,
        Endpoint::Embeddings => embeddings(&state, req).await,
        Endpoint::Moderations | Endpoint::Files | Endpoint::ResponseObject => {
            objects(&state, endpoint, &method, &path, req).await
        }
        Endpoint::Other => Ok(Response::new(SimBody::empty())),
    }
}

/// Enough of the rest of the API to test a pass-through: moderations (never flagged),
/// file uploads (multipart, streamed and counted, never stored: `bytes` is what arrived),
/// and a stored response by id (always completed, empty output). No faults, no latency.
async fn objects(
    state: &SimState,
    endpoint: Endpoint,
    method: &Method,
    path: &str,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ResetConnection> {
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let ok = |body: serde_json::Value| {
        state.stats.record_outcome(Outcome::Ok);
        Ok(json_response(StatusCode::OK, Bytes::from(body.to_string())))
    };
    let not_allowed = || {
        state.stats.record_outcome(Outcome::NotFound);
        Ok(error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("Method {method} not allowed for {path}"),
            "invalid_request_error",
            None,
        ))
    };
    match (endpoint, method.clone()) {
        (Endpoint::Moderations, _) => {
            let body = match read_body(req).await {
                Ok(b) => b,
                Err(Some(resp)) => return Ok(resp),
                Err(None) => return Err(ResetConnection),
            };
            let parsed: serde_json::Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => return Ok(bad_json(&e)),
            };
            let inputs = match &parsed["input"] {
                serde_json::Value::Array(items) => items.len().max(1),
                _ => 1,
            };
            let result = serde_json::json!({"flagged": false, "categories": {}, "category_scores": {}, "category_applied_input_types": {}});
            ok(serde_json::json!({
                "id": format!("modr-sim-{n}"),
                "model": parsed["model"].as_str().unwrap_or("omni-moderation-latest"),
                "results": vec![result; inputs],
            }))
        }
        (Endpoint::Files, Method::POST) if path == "/v1/files" => {
            // Streamed: counted as it arrives, never held.
            let mut body = req.into_body();
            let mut bytes = 0u64;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => bytes += f.data_ref().map_or(0, |d| d.len() as u64),
                    Err(_) => return Err(ResetConnection),
                }
            }
            ok(serde_json::json!({
                "id": format!("file-sim-{n}"), "object": "file", "bytes": bytes,
                "created_at": 0, "filename": "upload", "purpose": "batch", "status": "processed",
            }))
        }
        (Endpoint::Files, Method::GET) if path != "/v1/files" => {
            let id = path.trim_start_matches("/v1/files/");
            ok(serde_json::json!({
                "id": id, "object": "file", "bytes": 0, "created_at": 0,
                "filename": "upload", "purpose": "batch", "status": "processed",
            }))
        }
        (Endpoint::ResponseObject, m) => {
            let rest = path.trim_start_matches("/v1/responses/");
            let (id, sub) = rest.split_once('/').unwrap_or((rest, ""));
            let response = serde_json::json!({
                "id": id, "object": "response", "created_at": 0, "status": "completed",
                "model": "sim", "output": [], "parallel_tool_calls": true, "tool_choice": "auto",
                "tools": [], "error": null, "incomplete_details": null, "instructions": null,
                "metadata": {}, "temperature": 1.0, "top_p": 1.0,
            });
            match (m, sub) {
                (Method::GET, "") => ok(response),
                (Method::POST, "cancel") => ok(response),
                (Method::GET, "input_items") => ok(serde_json::json!({
                    "object": "list", "data": [], "first_id": null, "last_id": null, "has_more": false,
                })),
                (Method::DELETE, "") => {
                    ok(serde_json::json!({"id": id, "object": "response", "deleted": true}))
                }
                _ => not_allowed(),
            }
        }
        _ => not_allowed(),
    }
}

/// Per-request overrides from `x-sim-*` headers.
#[derive(Debug, Default)]
struct Overrides {
    fault: Option<Fault>,
    ttft_ms: Option<u64>,
    itl_ms: Option<u64>,
    tokens: Option<u64>,
    retry_after: Option<u64>,
}

impl Overrides {
    fn from_headers(h: &HeaderMap) -> Result<Self, String> {
        fn num(h: &HeaderMap, name: &str) -> Result<Option<u64>, String> {
            match h.get(name) {
                None => Ok(None),
                Some(v) => v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .map(Some)
                    .ok_or_else(|| {
                        format!("invalid {name} header: expected a non-negative integer")
                    }),
            }
        }
        let fault = match h.get("x-sim-fault") {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(Fault::from_header)
                    .ok_or_else(|| {
                        "invalid x-sim-fault header: expected none|500|503|429|reset|drop|stall|fail-before-content|stream-fail-before-content"
                            .to_owned()
                    })?,
            ),
        };
        Ok(Self {
            fault,
            ttft_ms: num(h, "x-sim-ttft-ms")?,
            itl_ms: num(h, "x-sim-itl-ms")?,
            tokens: num(h, "x-sim-tokens")?.map(|t| t.clamp(1, MAX_TOKENS)),
            retry_after: num(h, "x-sim-retry-after")?,
        })
    }
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: Option<serde_json::Value>,
}

/// The fields of a chat or legacy completion request the simulator looks at.
#[derive(Debug, Deserialize)]
struct GenRequest {
    model: String,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<serde_json::Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    /// Responses API: the input (a string or a list of items).
    #[serde(default)]
    input: Option<serde_json::Value>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    model: String,
    input: serde_json::Value,
    #[serde(default)]
    dimensions: Option<usize>,
}

/// Characters of text in a message `content` or a `prompt`/`input` value.
fn text_chars(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::String(s) => s.chars().count(),
        serde_json::Value::Array(items) => items.iter().map(text_chars).sum(),
        // Content parts: {"type":"text","text":"..."}; token arrays count 4 chars per token.
        serde_json::Value::Object(o) => o.get("text").map_or(0, text_chars),
        serde_json::Value::Number(_) => 4,
        _ => 0,
    }
}

/// The prompt-token estimate the brief fixes: characters / 4, at least 1.
fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4).max(1)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Mixes the seed and request number into a well-spread RNG seed (splitmix64 finaliser).
fn request_seed(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reads the request body; `Err(None)` means the client went away mid-body.
async fn read_body(req: Request<Incoming>) -> Result<Bytes, Option<Response<SimBody>>> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(Some(error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Request body too large",
            "invalid_request_error",
            None,
        ))),
        Err(_) => Err(None),
    }
}

fn bad_json(e: &serde_json::Error) -> Response<SimBody> {
    let msg = format!("We could not parse the JSON body of your request: {e}");
    error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error", None)
}

/// Answers a fault that ends the request before any body; `None` for faults that need one.
fn fault_response(
    state: &SimState,
    fault: Fault,
    ov: &Overrides,
    guard: &mut RequestGuard,
) -> Option<Result<Response<SimBody>, ResetConnection>> {
    match fault {
        Fault::Status500 => {
            guard.finish(Some(Outcome::Fault500));
            Some(Ok(error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The server had an error while processing your request. Sorry about that!",
                "server_error",
                None,
            )))
        }
        Fault::Status503 => {
            guard.finish(Some(Outcome::Fault503));
            Some(Ok(error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "The engine is currently overloaded, please try again later.",
                "server_error",
                None,
            )))
        }
        Fault::RateLimited => {
            guard.finish(Some(Outcome::Fault429));
            let secs = ov.retry_after.unwrap_or(state.profile.retry_after_seconds);
            let mut resp = error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "Rate limit reached for requests. Please try again later.",
                "requests",
                Some("rate_limit_exceeded"),
            );
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
            Some(Ok(resp))
        }
        Fault::Reset => {
            guard.finish(Some(Outcome::FaultReset));
            Some(Err(ResetConnection))
        }
        Fault::None
        | Fault::Drop
        | Fault::Stall
        | Fault::FailBeforeContent
        | Fault::StreamFailBeforeContent => None,
    }
}

/// A response that sends headers and then nothing (the `stall` fault).
fn stall_response(
    content_type: &'static str,
    renderer: StreamRenderer,
    guard: RequestGuard,
) -> Response<SimBody> {
    let plan = StreamPlan {
        renderer,
        tokens: 1,
        word_offset: 0,
        ttft: Duration::ZERO,
        gaps: Gaps::Zero,
        drop_after: None,
        stall: true,
        finish_reason: "stop",
        usage: Usage {
            prompt: 0,
            completion: 0,
        },
        frozen: None,
    };
    let mut resp = Response::new(SimBody::stream(plan, guard));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

async fn generate(
    state: &SimState,
    req: Request<Incoming>,
    api: Api,
) -> Result<Response<SimBody>, ResetConnection> {
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let mut rng = SmallRng::seed_from_u64(request_seed(state.seed, n));
    let mut guard = RequestGuard::new(state.stats.clone());
    let ov = match Overrides::from_headers(req.headers()) {
        Ok(o) => o,
        Err(msg) => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(error_response(
                StatusCode::BAD_REQUEST,
                &msg,
                "invalid_request_error",
                None,
            ));
        }
    };
    // Keyed fates: the attempt is numbered when it arrives, before anything can fail.
    let keyed = state.ledger.as_ref().and_then(|ledger| {
        let key = req.headers().get("x-request-id")?.to_str().ok()?.to_owned();
        let attempt = ledger.next_attempt(&key);
        Some((key, attempt))
    });
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(Some(resp)) => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(resp);
        }
        // Client vanished while sending: the guard counts it as cancelled.
        Err(None) => return Err(ResetConnection),
    };
    let parsed: GenRequest = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(bad_json(&e));
        }
    };
    let prompt_chars = match api {
        Api::Chat => match &parsed.messages {
            Some(m) => m
                .iter()
                .map(|m| m.content.as_ref().map_or(0, text_chars))
                .sum(),
            None => {
                guard.finish(Some(Outcome::BadRequest));
                return Ok(error_response(
                    StatusCode::BAD_REQUEST,
                    "Missing required parameter: 'messages'.",
                    "invalid_request_error",
                    Some("missing_required_parameter"),
                ));
            }
        },
        Api::Responses => match &parsed.input {
            Some(i) => text_chars(i),
            None => {
                guard.finish(Some(Outcome::BadRequest));
                return Ok(error_response(
                    StatusCode::BAD_REQUEST,
                    "Missing required parameter: 'input'.",
                    "invalid_request_error",
                    Some("missing_required_parameter"),
                ));
            }
        },
        Api::Completion => match &parsed.prompt {
            Some(p) => text_chars(p),
            None => {
                guard.finish(Some(Outcome::BadRequest));
                return Ok(error_response(
                    StatusCode::BAD_REQUEST,
                    "Missing required parameter: 'prompt'.",
                    "invalid_request_error",
                    Some("missing_required_parameter"),
                ));
            }
        },
    };

    let profile = &state.profile;
    let cap = parsed
        .max_completion_tokens
        .or(parsed.max_tokens)
        .or(parsed.max_output_tokens)
        .map(|c| c.max(1));
    let cond = state.conditions();
    let fate = keyed
        .as_ref()
        .map(|(key, attempt)| Fate::draw(profile, state.seed, key, *attempt, &cond, cap));
    let account = state.meter();
    let drawn = match &fate {
        Some(f) => f.fault,
        None if cond.down => Fault::Reset,
        None => profile.pick_fault(&mut rng, &state.brownout()),
    };
    let fault = state.chaos.fault().or(ov.fault).unwrap_or(drawn);
    if let Account::Exhausted { limit, reset } = account {
        guard.finish(Some(Outcome::Fault429));
        return Ok(account_exhausted(limit, reset));
    }
    let ov = Overrides {
        retry_after: ov.retry_after.or(fate.as_ref().map(|f| f.retry_after_s)),
        ..ov
    };
    if let Some(mut resp) = fault_response(state, fault, &ov, &mut guard) {
        if let (
            Account::Admitted {
                limit,
                remaining,
                reset,
            },
            Ok(r),
        ) = (&account, &mut resp)
        {
            ratelimit_headers(r.headers_mut(), *limit, *remaining, *reset);
        }
        return resp;
    }

    let mult = cond.latency_multiplier;
    let (tokens, finish_reason, ttft, mut gaps, drop_at) = match fate {
        Some(f) => {
            let gaps = match ov.itl_ms {
                Some(0) => Gaps::Zero,
                Some(v) => Gaps::Fixed(Duration::from_millis(v)),
                None => Gaps::Planned(f.gaps_ms.iter().map(|g| ms(*g)).collect()),
            };
            let ttft = ov
                .ttft_ms
                .map_or_else(|| ms(f.ttft_ms), Duration::from_millis);
            let (tokens, finish) = match ov.tokens {
                Some(t) => (usize::try_from(t).unwrap_or(usize::MAX), "stop"),
                None => (f.tokens, if f.capped { "length" } else { "stop" }),
            };
            (tokens, finish, ttft, gaps, Some(f.drop_after))
        }
        None => {
            let sampled = profile.tokens.sample(&mut rng).round().max(1.0) as u64;
            let wanted = ov.tokens.unwrap_or(sampled);
            let (tokens, finish_reason) = match cap {
                Some(c) if wanted > c => (c, "length"),
                _ => (wanted, "stop"),
            };
            let tokens = usize::try_from(tokens).unwrap_or(usize::MAX);
            let ttft = match ov.ttft_ms {
                Some(v) => Duration::from_millis(v),
                None if profile.ttft.is_zero() => Duration::ZERO,
                None => ms(profile.ttft.sample(&mut rng) * mult),
            };
            let gaps = match ov.itl_ms {
                Some(0) => Gaps::Zero,
                Some(v) => Gaps::Fixed(Duration::from_millis(v)),
                None if profile.itl.is_zero() => Gaps::Zero,
                None => Gaps::Sampled {
                    sampler: profile.itl.clone(),
                    rng: Box::new(SmallRng::seed_from_u64(rng.random())),
                    multiplier: mult,
                },
            };
            (tokens, finish_reason, ttft, gaps, None)
        }
    };
    let word_offset = rng.random_range(0..render::WORDS.len());
    let usage = Usage {
        prompt: estimate_tokens(prompt_chars),
        completion: tokens as u64,
    };
    let id = match api {
        Api::Chat => format!("chatcmpl-sim{n:012x}"),
        Api::Completion => format!("cmpl-sim{n:012x}"),
        Api::Responses => format!("resp_sim{n:012x}"),
    };
    let created = unix_now();
    let model_json = json_string(&parsed.model);
    let stream = parsed.stream.unwrap_or(false);

    if stream {
        let include_usage = parsed
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let mut renderer = StreamRenderer::new(api, &id, created, &model_json, include_usage);
        if matches!(
            fault,
            Fault::FailBeforeContent | Fault::StreamFailBeforeContent
        ) {
            state.stats.record_outcome(Outcome::Fault500);
            guard.finish(None);
            let mut out = bytes::BytesMut::new();
            renderer.fail_before_content(&mut out, usage);
            let mut resp = Response::new(SimBody::full(out.freeze()));
            let h = resp.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            return Ok(resp);
        }
        if fault == Fault::Stall {
            state.stats.record_outcome(Outcome::FaultStall);
            return Ok(stall_response("text/event-stream", renderer, guard));
        }
        let drop_after = (fault == Fault::Drop).then(|| {
            state.stats.record_outcome(Outcome::FaultDrop);
            match drop_at {
                Some(at) => at.min(tokens.saturating_sub(1)).max(1),
                None if tokens >= 2 => rng.random_range(1..tokens),
                None => 1,
            }
        });
        let plan = StreamPlan {
            renderer,
            tokens,
            word_offset,
            ttft,
            gaps,
            drop_after,
            stall: false,
            finish_reason,
            usage,
            frozen: Some(state.chaos.frozen.clone()),
        };
        let mut resp = Response::new(SimBody::stream(plan, guard));
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        finish_headers(h, &account, keyed.as_ref());
        return Ok(resp);
    }

    if fault == Fault::Stall {
        state.stats.record_outcome(Outcome::FaultStall);
        let renderer = StreamRenderer::new(api, &id, created, &model_json, false);
        return Ok(stall_response("application/json", renderer, guard));
    }
    if fault == Fault::FailBeforeContent {
        guard.finish(Some(Outcome::Fault500));
        return Ok(error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The server had an error while processing your request. Sorry about that!",
            "server_error",
            None,
        ));
    }
    // A non-streamed answer arrives when the last token would have been generated.
    let mut total = ttft;
    if !matches!(gaps, Gaps::Zero) {
        for _ in 1..tokens {
            total += gaps.next_gap();
        }
    }
    if !total.is_zero() {
        // If the client leaves during this sleep hyper drops this future, and with it the
        // guard, which records the cancellation.
        tokio::time::sleep(total).await;
    }
    if state.chaos.frozen() {
        // A frozen provider hangs after the headers of non-streamed answers too.
        state.stats.record_outcome(Outcome::FaultStall);
        let renderer = StreamRenderer::new(api, &id, created, &model_json, false);
        return Ok(stall_response("application/json", renderer, guard));
    }
    let meta = render::Meta {
        api,
        id: &id,
        created,
        model_json: &model_json,
    };
    let body = completion_json(meta, word_offset, tokens, finish_reason, usage);
    if fault == Fault::Drop {
        state.stats.record_outcome(Outcome::FaultDrop);
        guard.finish(None);
        let half = body.slice(..body.len() / 2);
        let mut resp = Response::new(SimBody::cut(half));
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        return Ok(resp);
    }
    guard.finish(Some(Outcome::Ok));
    let mut resp = json_response(StatusCode::OK, body);
    finish_headers(resp.headers_mut(), &account, keyed.as_ref());
    Ok(resp)
}

/// The account's `x-ratelimit-*` headers and, for keyed fates, the attempt number the
/// request was given (`x-sim-attempt`, for reading logs of a compared run).
fn finish_headers(h: &mut HeaderMap, account: &Account, keyed: Option<&(String, u32)>) {
    if let Account::Admitted {
        limit,
        remaining,
        reset,
    } = account
    {
        ratelimit_headers(h, *limit, *remaining, *reset);
    }
    if let Some((_, attempt)) = keyed {
        h.insert("x-sim-attempt", HeaderValue::from(*attempt));
    }
}

/// Deterministic unit vector for `text`: same text, same seed, same vector.
fn embed(text: &str, seed: u64, dims: usize) -> Vec<f32> {
    // FNV-1a so the vector depends on the content only, not on request order.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut rng = SmallRng::seed_from_u64(request_seed(seed, h));
    let mut v: Vec<f32> = (0..dims).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

async fn embeddings(
    state: &SimState,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ResetConnection> {
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let mut rng = SmallRng::seed_from_u64(request_seed(state.seed, n));
    let mut guard = RequestGuard::new(state.stats.clone());
    let ov = match Overrides::from_headers(req.headers()) {
        Ok(o) => o,
        Err(msg) => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(error_response(
                StatusCode::BAD_REQUEST,
                &msg,
                "invalid_request_error",
                None,
            ));
        }
    };
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(Some(resp)) => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(resp);
        }
        Err(None) => return Err(ResetConnection),
    };
    let parsed: EmbeddingRequest = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(bad_json(&e));
        }
    };
    let inputs: Vec<String> = match &parsed.input {
        serde_json::Value::String(s) => vec![s.clone()],
        serde_json::Value::Array(items) if !items.is_empty() => {
            items.iter().map(|i| i.to_string()).collect()
        }
        _ => {
            guard.finish(Some(Outcome::BadRequest));
            return Ok(error_response(
                StatusCode::BAD_REQUEST,
                "'input' must be a non-empty string or array",
                "invalid_request_error",
                None,
            ));
        }
    };
    let dims = parsed
        .dimensions
        .unwrap_or(state.profile.embedding_dims)
        .clamp(1, 65_536);

    let brownout = state.brownout();
    let drawn = state.profile.pick_fault(&mut rng, &brownout);
    let fault = state.chaos.fault().or(ov.fault).unwrap_or(drawn);
    if let Some(resp) = fault_response(state, fault, &ov, &mut guard) {
        return resp;
    }
    if fault == Fault::Stall {
        state.stats.record_outcome(Outcome::FaultStall);
        let renderer = StreamRenderer::new(Api::Chat, "emb", 0, "\"\"", false);
        return Ok(stall_response("application/json", renderer, guard));
    }
    let delay = match ov.ttft_ms {
        Some(v) => Duration::from_millis(v),
        None if state.profile.ttft.is_zero() => Duration::ZERO,
        None => ms(state.profile.ttft.sample(&mut rng) * brownout.latency_multiplier),
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let vectors: Vec<Vec<f32>> = inputs.iter().map(|t| embed(t, state.seed, dims)).collect();
    let chars = text_chars(&parsed.input);
    let body = embeddings_json(
        &json_string(&parsed.model),
        &vectors,
        estimate_tokens(chars),
    );
    if fault == Fault::Drop {
        state.stats.record_outcome(Outcome::FaultDrop);
        guard.finish(None);
        let half = body.slice(..body.len() / 2);
        return Ok(Response::new(SimBody::cut(half)));
    }
    guard.finish(Some(Outcome::Ok));
    Ok(json_response(StatusCode::OK, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_seeds_differ_and_repeat() {
        assert_eq!(request_seed(42, 7), request_seed(42, 7));
        assert_ne!(request_seed(42, 7), request_seed(42, 8));
        assert_ne!(request_seed(42, 7), request_seed(43, 7));
    }

    #[test]
    fn prompt_estimate_is_chars_over_four() {
        let v: serde_json::Value =
            serde_json::json!([{"type": "text", "text": "abcdefgh"}, {"type": "image_url"}]);
        assert_eq!(text_chars(&v), 8);
        assert_eq!(estimate_tokens(8), 2);
        assert_eq!(estimate_tokens(9), 3);
        assert_eq!(estimate_tokens(0), 1);
    }

    #[test]
    fn forced_fault_codes_round_trip() {
        let all = [
            None,
            Some(Fault::None),
            Some(Fault::Status500),
            Some(Fault::Status503),
            Some(Fault::RateLimited),
            Some(Fault::Reset),
            Some(Fault::Drop),
            Some(Fault::Stall),
            Some(Fault::FailBeforeContent),
            Some(Fault::StreamFailBeforeContent),
        ];
        for f in all {
            assert_eq!(fault_from_code(fault_code(f)), f);
        }
        assert_eq!(fault_from_code(200), None);
    }

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embed("hello", 42, 8);
        assert_eq!(a, embed("hello", 42, 8));
        assert_ne!(a, embed("world", 42, 8));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4);
    }
}
