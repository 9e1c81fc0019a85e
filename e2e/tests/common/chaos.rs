//! The chaos harness: the real `tailwarden-sidecar` and `tailwarden-sim` binaries as child
//! processes, in-process simulators whose faults are switched during a run, an open-loop
//! load generator that judges every response, and the checks every chaos scenario shares.
//!
//! A request *ends well* when it is a complete success (a stream ending in `[DONE]`, a JSON
//! completion) or a *clear* failure: an error status with OpenAI's error body, or a stream
//! that ends with an OpenAI-shaped error event — what an SDK turns into a typed exception.
//! Anything else — a transport error, a body cut without an error, a stream that stops
//! without `[DONE]` or an error, a request still running long after its deadline — is
//! *lost*: the app cannot tell what happened. No scenario may lose a request, and every
//! clear failure must be one the injected fault explains.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use serde_json::Value;
use tailwarden_e2e::{
    fetch,
    proc::{ChildProc, ProcError, log_tail},
    sidecar::parse_listening_line,
    sim::{Profile, SimHandle, SimServer},
};
use tokio::task::JoinHandle;

/// The simulator binary of this build.
pub const SIM_BIN: &str = env!("CARGO_BIN_EXE_tailwarden-sim");

/// The in-flight gauge the sidecar keeps per route (sidecar/src/metrics.rs).
pub const IN_FLIGHT: &str = "tailwarden_in_flight_requests";

/// The route every scenario's timings are judged against (`timeouts.total`).
pub const TOTAL_DEADLINE: Duration = Duration::from_secs(4);

/// Allowance between the sidecar's own deadline and the client seeing the end: loopback
/// hops plus scheduling on a small shared machine. The observed maximum is reported.
pub const DEADLINE_SLACK: Duration = Duration::from_millis(1000);

/// The scenarios share one machine and their timings are the point: run one at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs one scenario on its own multi-threaded runtime, after the previous one finished.
pub fn scenario<F: std::future::Future<Output = ()>>(f: F) {
    let _one_at_a_time = serial();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
        .block_on(f);
}

/// The sidecar binary: `TAILWARDEN_SIDECAR_BIN`, else the one next to the simulator
/// (`cargo test --workspace`, hence `make test`, builds every workspace binary into the
/// same profile folder).
pub fn sidecar_bin() -> PathBuf {
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

/// A scratch folder for configs and logs; kept (and named) when the scenario fails.
pub struct Workdir {
    pub path: PathBuf,
}

impl Workdir {
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("tw-chaos-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("chaos: logs and configs kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Sends `sig` (e.g. `KILL`, `TERM`) to one process.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args(["-s", sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -s {sig} {pid} failed");
}

/// The real sidecar binary, started as users run it standalone.
pub struct SidecarProc {
    proc: ChildProc,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
}

impl SidecarProc {
    /// Starts the sidecar on `listen` (`127.0.0.1:0` for any port) with a 100 ms reload
    /// interval, and waits until `/readyz` answers 200.
    pub fn start(dir: &Workdir, config: &Path, listen: &str, drain: &str, tag: &str) -> Self {
        let log = dir.join(&format!("sidecar-{tag}.log"));
        let mut cmd = Command::new(sidecar_bin());
        cmd.arg("--config")
            .arg(config)
            .args(["--listen", listen, "--admin", "127.0.0.1:0"])
            .args(["--log-format", "json", "--reload-interval", "100ms"])
            .args(["--drain-timeout", drain]);
        let mut proc = ChildProc::spawn("tailwarden-sidecar", &cmd, &log).unwrap();
        let (listen, admin) = proc
            .wait_for_line(
                "the `listening on ADDR admin ADDR` line",
                Duration::from_secs(20),
                parse_listening_line,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        proc.wait_until(
            &format!("GET http://{admin}/readyz to answer 200"),
            Duration::from_secs(20),
            || fetch::get(admin, "/readyz", Duration::from_secs(1)).is_ok_and(|r| r.status == 200),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Self {
            proc,
            listen,
            admin,
            log,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.listen)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Waits up to `limit` for the process to exit; its exit status, or `None` if it runs on.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        match self.proc.wait_until("exit", limit, || false) {
            Err(ProcError::Exited { status, .. }) => Some(status),
            _ => None,
        }
    }

    /// The end of its log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

/// A `tailwarden-sim` process (so it can really be killed: its port closes, its
/// connections die with it).
pub struct SimProc {
    proc: ChildProc,
    pub addr: SocketAddr,
}

impl SimProc {
    /// Starts the `instant` profile (requests pace themselves with `x-sim-*` headers) on
    /// `listen`; binding the port a killed simulator just left is retried for a while.
    pub fn start(dir: &Workdir, listen: &str, tag: &str) -> Self {
        let log = dir.join(&format!("sim-{tag}.log"));
        let mut last = String::new();
        for _ in 0..50 {
            let mut cmd = Command::new(SIM_BIN);
            cmd.args(["--listen", listen, "--profile", "instant", "--threads", "2"]);
            let mut proc = ChildProc::spawn("tailwarden-sim", &cmd, &log).unwrap();
            let addr = proc.wait_for_line("listening on ADDR", Duration::from_secs(10), |l| {
                l.strip_prefix("listening on ")?.trim().parse().ok()
            });
            match addr {
                Ok(addr) => return Self { proc, addr },
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("tailwarden-sim did not start on {listen}: {last}");
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// SIGKILL: no goodbye, every connection of the provider dies at once.
    pub fn kill(self) {
        signal(self.proc.pid(), "KILL");
        drop(self.proc); // reaps it
    }
}

/// An in-process simulator (`instant` profile) whose faults the scenario switches.
pub async fn sim() -> SimHandle {
    SimServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        &Profile::builtin("instant").unwrap(),
        7,
    )
    .await
    .unwrap()
    .spawn()
}

/// A provider of a chaos route.
pub struct Provider<'a> {
    pub name: &'a str,
    pub base_url: String,
    pub weight: u32,
}

impl<'a> Provider<'a> {
    pub fn new(name: &'a str, base_url: impl Into<String>) -> Self {
        Self {
            name,
            base_url: base_url.into(),
            weight: 100,
        }
    }
}

/// The chaos route: every timeout short enough that a run stays short, 3 attempts with a
/// short backoff, a breaker that opens after 5 failures for 1 s, and room for 400
/// concurrent requests per provider (the SIGTERM scenario holds 200 streams open).
pub fn route_yaml(providers: &[Provider<'_>]) -> String {
    let mut out = String::from(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {name: chaos}\nspec:\n  models: [\"*\"]\n  providers:\n",
    );
    for p in providers {
        out.push_str(&format!(
            "  - {{name: {}, baseUrl: \"{}\", weight: {}, maxConnections: 400}}\n",
            p.name, p.base_url, p.weight
        ));
    }
    out.push_str(
        "  timeouts: {connect: 500ms, firstByte: 1s, idle: 1s, total: 4s}\n  retries: {maxAttempts: 3, backoff: {base: 25ms, max: 250ms}}\n  circuitBreaker: {consecutiveFailures: 5, openFor: 1s, maxOpenFor: 2s}\n",
    );
    out
}

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// `GET` on the admin port: status and body (status 0 when the port does not answer).
pub async fn admin_get(client: &HttpClient, admin: SocketAddr, path: &str) -> (u16, String) {
    let req = Request::get(format!("http://{admin}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let exchange = async {
        let resp = client.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or((0, String::new()))
}

/// Sum of every sample of metric `name` (all label sets) in Prometheus text; `None` when
/// the metric is absent.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue; // a longer name with this prefix
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Sum of the samples of `name` whose label set contains every `labels` pair.
pub fn metric_with(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name).is_some_and(|r| r.starts_with('{'))
                && labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// Waits until the in-flight gauge reads 0 on every route; how long that took. Panics
/// with the last reading when it does not within `limit`: a request (and its task) leaked.
pub async fn wait_in_flight_zero(
    client: &HttpClient,
    admin: SocketAddr,
    limit: Duration,
) -> Duration {
    let started = Instant::now();
    let mut last = None;
    while started.elapsed() < limit {
        let (status, text) = admin_get(client, admin, "/metrics").await;
        if status == 200 {
            last = metric_sum(&text, IN_FLIGHT);
            if last.unwrap_or(0.0) == 0.0 {
                return started.elapsed();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{IN_FLIGHT} did not return to 0 within {limit:?}: last reading {last:?}");
}

/// Waits until the simulator reports no request in flight (the sidecar cancelled or
/// finished every upstream request it started).
pub async fn wait_sim_idle(sim: &SimHandle, name: &str, limit: Duration) {
    let started = Instant::now();
    while sim.stats().in_flight != 0 {
        assert!(
            started.elapsed() < limit,
            "provider {name} still has {} requests in flight {limit:?} after the load: the sidecar did not cancel them",
            sim.stats().in_flight
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Requests a `tailwarden-sim` process is serving right now (`GET /sim/stats`).
pub fn sim_proc_in_flight(addr: SocketAddr) -> Option<i64> {
    let r = fetch::get(addr, "/sim/stats", Duration::from_secs(2)).ok()?;
    serde_json::from_slice::<Value>(&r.body).ok()?["in_flight"].as_i64()
}

/// How a request is shaped: streamed or not, and the provider's pacing (sent as `x-sim-*`
/// headers, which the sidecar forwards like any custom header).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub stream: bool,
    pub ttft_ms: u64,
    pub itl_ms: u64,
    pub tokens: u64,
}

impl Shape {
    /// A stream of `tokens` tokens, 30 ms to the first and `itl_ms` between the others.
    pub fn stream(tokens: u64, itl_ms: u64) -> Self {
        Self {
            stream: true,
            ttft_ms: 30,
            itl_ms,
            tokens,
        }
    }

    /// A non-streamed completion answered after `ttft_ms`.
    pub fn whole(ttft_ms: u64) -> Self {
        Self {
            stream: false,
            ttft_ms,
            itl_ms: 0,
            tokens: 16,
        }
    }
}

/// A clear failure: what the client was told.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The error arrived as an SSE error event after a 200 (the stream had started).
    pub mid_stream: bool,
    /// OpenAI's `error.code`, else `error.type`.
    pub code: String,
    pub message: String,
    /// The `Retry-After` header of an error response.
    pub retry_after: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Ok,
    Failed(Failure),
    /// No clear outcome, with what was seen.
    Lost(String),
}

/// One request as the client saw it; times are from the scenario's epoch.
#[derive(Debug, Clone)]
pub struct Record {
    pub id: usize,
    pub stream: bool,
    pub start: Duration,
    pub end: Duration,
    pub status: u16,
    /// `x-tailwarden-provider`.
    pub provider: Option<String>,
    pub verdict: Verdict,
}

impl Record {
    pub fn ok(&self) -> bool {
        self.verdict == Verdict::Ok
    }

    pub fn failure(&self) -> Option<&Failure> {
        match &self.verdict {
            Verdict::Failed(f) => Some(f),
            _ => None,
        }
    }

    pub fn took(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }

    pub fn from(&self, provider: &str) -> bool {
        self.provider.as_deref() == Some(provider)
    }
}

fn snippet(text: &str) -> String {
    text.chars().take(200).collect()
}

/// `(code, message)` of an OpenAI error object `{"error": {"message", "type", "code"}}`.
fn openai_error(v: &Value) -> Option<(String, String)> {
    let e = v.get("error")?;
    let message = e.get("message")?.as_str()?.to_owned();
    let kind = e.get("type")?.as_str()?;
    let code = e.get("code").and_then(Value::as_str).unwrap_or(kind);
    (!message.is_empty()).then(|| (code.to_owned(), message))
}

/// Judges an SSE body: complete (`[DONE]` after content), clearly failed (an error event,
/// nothing after it) or lost.
pub fn judge_sse(text: &str) -> Verdict {
    let mut done = false;
    let mut chunks = 0;
    let mut error: Option<(String, String)> = None;
    for line in text.lines() {
        if line.is_empty() || line.starts_with(':') {
            continue; // frame separators and `: ping` heartbeats
        }
        let Some(data) = line.strip_prefix("data:") else {
            return Verdict::Lost(format!("unexpected SSE line {:?}", snippet(line)));
        };
        let data = data.trim_start();
        if done || error.is_some() {
            return Verdict::Lost(format!("data after the end of the stream: {data:?}"));
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return Verdict::Lost(format!("SSE data is not JSON: {:?}", snippet(data)));
        };
        if let Some(e) = openai_error(&v) {
            error = Some(e);
        } else if v.get("object").and_then(Value::as_str) == Some("chat.completion.chunk") {
            chunks += 1;
        } else {
            return Verdict::Lost(format!("unexpected SSE event {:?}", snippet(data)));
        }
    }
    match (done, error) {
        (_, Some((code, message))) => Verdict::Failed(Failure {
            mid_stream: true,
            code,
            message,
            retry_after: None,
        }),
        (true, None) if chunks > 0 => Verdict::Ok,
        _ => Verdict::Lost(format!(
            "stream ended after {chunks} chunks without [DONE] or an error event"
        )),
    }
}

/// Judges a complete response.
pub fn judge(status: u16, sse: bool, body: &[u8], retry_after: Option<String>) -> Verdict {
    let Ok(text) = std::str::from_utf8(body) else {
        return Verdict::Lost(format!("status {status}: body is not UTF-8"));
    };
    if status == 200 && sse {
        return judge_sse(text);
    }
    let Ok(json) = serde_json::from_str::<Value>(text) else {
        return Verdict::Lost(format!(
            "status {status}: body is not JSON: {:?}",
            snippet(text)
        ));
    };
    if status == 200 {
        return if json["choices"][0]["message"]["content"].is_string() {
            Verdict::Ok
        } else {
            Verdict::Lost(format!("200 without a completion: {}", snippet(text)))
        };
    }
    match openai_error(&json) {
        Some((code, message)) => Verdict::Failed(Failure {
            mid_stream: false,
            code,
            message,
            retry_after,
        }),
        None => Verdict::Lost(format!(
            "status {status} without an OpenAI-shaped error: {}",
            snippet(text)
        )),
    }
}

/// The whole error chain of a client error (hyper's top-level message is vague).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// One chat completion through the sidecar, judged.
async fn exchange(client: &HttpClient, base: &str, shape: Shape) -> (u16, Option<String>, Verdict) {
    let body: &'static [u8] = if shape.stream {
        br#"{"model":"gpt-4.1","stream":true,"messages":[{"role":"user","content":"chaos"}]}"#
    } else {
        br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"chaos"}]}"#
    };
    let req = Request::post(format!("{base}/chat/completions"))
        .header("content-type", "application/json")
        .header("x-sim-ttft-ms", shape.ttft_ms.to_string())
        .header("x-sim-itl-ms", shape.itl_ms.to_string())
        .header("x-sim-tokens", shape.tokens.to_string())
        .body(Full::new(Bytes::from_static(body)))
        .unwrap();
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            return (
                0,
                None,
                Verdict::Lost(format!("no response: {}", chain(&e))),
            );
        }
    };
    let status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let provider = header("x-tailwarden-provider");
    let retry_after = header("retry-after");
    let sse = header("content-type").is_some_and(|v| v.starts_with("text/event-stream"));
    match resp.into_body().collect().await {
        Ok(b) => (
            status,
            provider,
            judge(status, sse, &b.to_bytes(), retry_after),
        ),
        Err(e) => (
            status,
            provider,
            Verdict::Lost(format!("body cut without an error: {}", chain(&e))),
        ),
    }
}

/// Sends one request now and records it. A request still running 5 s past the route's
/// total deadline is recorded as lost (and abandoned), so a hang cannot hang the test.
pub fn send(
    client: &HttpClient,
    base: &str,
    epoch: Instant,
    id: usize,
    shape: Shape,
) -> JoinHandle<Record> {
    let (client, base) = (client.clone(), base.to_owned());
    tokio::spawn(async move {
        let start = epoch.elapsed();
        let limit = TOTAL_DEADLINE + Duration::from_secs(5);
        let (status, provider, verdict) =
            match tokio::time::timeout(limit, exchange(&client, &base, shape)).await {
                Ok(r) => r,
                Err(_) => (
                    0,
                    None,
                    Verdict::Lost(format!("still running {limit:?} after it started")),
                ),
            };
        Record {
            id,
            stream: shape.stream,
            start,
            end: epoch.elapsed(),
            status,
            provider,
            verdict,
        }
    })
}

/// Open-loop load: `rate` requests per second from now until `until` after `epoch`, each
/// shaped by `shape(i)`, sent on schedule whatever happens to earlier ones (a stall cannot
/// slow the load down and hide itself). Resolves to every request's record.
pub fn open_loop(
    client: &HttpClient,
    base: &str,
    epoch: Instant,
    rate: f64,
    until: Duration,
    shape: impl Fn(usize) -> Shape + Send + 'static,
) -> JoinHandle<Vec<Record>> {
    let (client, base) = (client.clone(), base.to_owned());
    tokio::spawn(async move {
        let begin = tokio::time::Instant::now();
        let gap = Duration::from_secs_f64(1.0 / rate);
        let mut tasks = Vec::new();
        let mut i = 0usize;
        while epoch.elapsed() < until {
            tasks.push(send(&client, &base, epoch, i, shape(i)));
            i += 1;
            tokio::time::sleep_until(begin + gap * u32::try_from(i).unwrap_or(u32::MAX)).await;
        }
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// Sleeps until `at` after `epoch`.
pub async fn at(epoch: Instant, at: Duration) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(epoch + at)).await;
}

/// Checks the rules every scenario shares and returns the tally: no request lost, every
/// failure clear *and* explained by the fault (`explained`), every request over within the
/// total deadline (plus [`DEADLINE_SLACK`]).
pub fn check(name: &str, records: &[Record], explained: impl Fn(&Record) -> bool) -> Tally {
    let mut problems = Vec::new();
    for r in records {
        match &r.verdict {
            Verdict::Lost(why) => problems.push(format!("LOST {r:?}: {why}")),
            Verdict::Failed(_) if !explained(r) => {
                problems.push(format!("FAILED, and the fault does not explain it: {r:?}"));
            }
            _ => {}
        }
        if r.took() > TOTAL_DEADLINE + DEADLINE_SLACK {
            problems.push(format!(
                "took {:?}, over the {TOTAL_DEADLINE:?} deadline: {r:?}",
                r.took()
            ));
        }
    }
    let tally = Tally::of(records);
    assert!(
        problems.is_empty(),
        "{name}: {} problem(s) in {} requests ({tally:?}):\n{}",
        problems.len(),
        records.len(),
        problems
            .iter()
            .take(15)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    tally
}

/// The numbers of a run, for the chaos table in docs/reliability.md.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    pub lost: usize,
    pub max_took: Duration,
    /// Failures by code.
    pub codes: std::collections::BTreeMap<String, usize>,
}

impl Tally {
    pub fn of(records: &[Record]) -> Self {
        let mut t = Self {
            sent: records.len(),
            ..Self::default()
        };
        for r in records {
            match &r.verdict {
                Verdict::Ok => t.ok += 1,
                Verdict::Failed(f) => {
                    t.failed += 1;
                    *t.codes.entry(f.code.clone()).or_default() += 1;
                }
                Verdict::Lost(_) => t.lost += 1,
            }
            t.max_took = t.max_took.max(r.took());
        }
        t
    }

    /// One line per scenario on stderr (`--nocapture` shows them): the table's numbers.
    pub fn print(&self, fault: &str, recovery: Option<Duration>, notes: &str) {
        let recovery = recovery.map_or_else(|| "-".to_owned(), |d| format!("{} ms", d.as_millis()));
        eprintln!(
            "CHAOS | {fault} | sent {} | ok {} | failed by the fault {} {:?} | lost {} | max {} ms (deadline {} ms) | recovery {recovery} | {notes}",
            self.sent,
            self.ok,
            self.failed,
            self.codes,
            self.lost,
            self.max_took.as_millis(),
            TOTAL_DEADLINE.as_millis(),
        );
    }
}

/// Time from `clear` (the fault's end) to the end of the first success served by
/// `provider` that started after it: how long the sidecar took to use the provider again.
pub fn recovery_of(records: &[Record], provider: &str, clear: Duration) -> Option<Duration> {
    records
        .iter()
        .filter(|r| r.ok() && r.from(provider) && r.start >= clear)
        .map(|r| r.end.saturating_sub(clear))
        .min()
}

/// Shared handle to a simulator for the fault timeline tasks.
pub type SharedSim = Arc<SimHandle>;
