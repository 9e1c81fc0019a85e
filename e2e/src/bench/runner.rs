//! Drives the load: the schedule, the HTTP client, per-request measurement and collection.
//!
//! Each request runs on its own task and sends one [`Sample`] to a single collector task
//! that owns the histograms, so recording needs no locks and the progress line can read
//! consistent numbers. Timing uses `tokio::time::Instant` so tests can use paused time.

use std::borrow::Cow;
use std::future::Future;
use std::io::IsTerminal as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde::de::IgnoredAny;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::report::{
    ErrorCounts, LoadMode, Percentiles, Report, RequestCounts, RequestRecord, UpstreamStats,
    new_histogram, round3,
};
use super::sse::{SseEvent, SseParser};
use super::{BenchConfig, BenchError, Target};

/// A request dispatched later than this after its scheduled time counts as late.
const LATE_AFTER: Duration = Duration::from_millis(10);

/// How long an interrupted run waits for in-flight requests.
const INTERRUPT_GRACE: Duration = Duration::from_secs(2);

/// Up-front connect probe timeout.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Error class of a failed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrorClass {
    Connect,
    Timeout,
    Http4xx,
    Http429,
    Http5xx,
    Reset,
    BadResponse,
}

#[derive(Debug, Default)]
struct Success {
    total_us: u64,
    ttft_us: Option<u64>,
    gaps_us: Vec<u64>,
    completion_tokens: u64,
}

impl ErrorClass {
    fn label(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Http4xx => "4xx",
            Self::Http429 => "429",
            Self::Http5xx => "5xx",
            Self::Reset => "reset",
            Self::BadResponse => "bad_response",
        }
    }
}

#[derive(Debug)]
struct Sample {
    index: u64,
    measured: bool,
    late: bool,
    result: Result<Success, ErrorClass>,
    /// Scheduled start to the end (success or failure).
    elapsed_us: u64,
    attempts: Option<u64>,
    provider: Option<String>,
}

/// What every request task needs.
#[derive(Debug)]
struct Shared {
    client: HttpClient,
    endpoint: Uri,
    headers: HeaderMap,
    body: Bytes,
    stream: bool,
    timeout: Duration,
    request_ids: Option<String>,
    tx: mpsc::UnboundedSender<Sample>,
    /// Shared with the collector (which must not hold `tx`, or the channel never closes).
    sent: Arc<AtomicU64>,
}

/// Runs the benchmark to completion.
pub async fn run(cfg: BenchConfig) -> Result<Report, BenchError> {
    run_until(cfg, std::future::pending()).await
}

/// Runs the benchmark until it completes or `stop` resolves (Ctrl-C); an interrupted run
/// waits up to 2 s for in-flight requests and returns a report marked `partial`.
pub async fn run_until(
    cfg: BenchConfig,
    stop: impl Future<Output = ()>,
) -> Result<Report, BenchError> {
    let target = cfg.validate()?;
    probe(&target).await?;

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(cfg.timeout.min(Duration::from_secs(10))));
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(usize::MAX)
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector);

    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for (n, v) in &cfg.headers {
        // validate() already checked both; skip rather than panic if that ever changes.
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.append(n, v);
        }
    }
    let mut body = serde_json::json!({
        "model": cfg.model,
        "messages": [{"role": "user", "content": cfg.prompt}],
    });
    if cfg.stream {
        body["stream"] = serde_json::Value::Bool(true);
    }
    if let Some(m) = cfg.max_tokens {
        body["max_tokens"] = serde_json::Value::from(m);
    }

    let (tx, rx) = mpsc::unbounded_channel();
    let sent = Arc::new(AtomicU64::new(0));
    let shared = Arc::new(Shared {
        client,
        endpoint: target.endpoint,
        headers,
        body: Bytes::from(body.to_string()),
        stream: cfg.stream,
        timeout: cfg.timeout,
        request_ids: cfg.request_ids.clone(),
        tx,
        sent: sent.clone(),
    });

    let start = Instant::now();
    let measure_from = start + cfg.warmup;
    let end = measure_from + cfg.duration;
    let (stop_tx, stop_rx) = watch::channel(false);
    let collector = tokio::spawn(collect(rx, sent, start, cfg.progress, cfg.record_requests));

    let mut tasks = JoinSet::new();
    let mode;
    let stopped_at;
    tokio::pin!(stop);
    {
        let generate = async {
            match cfg.rate {
                Some(rate) => {
                    open_loop(
                        &shared,
                        &mut tasks,
                        rate,
                        cfg.concurrency,
                        start,
                        measure_from,
                        end,
                    )
                    .await
                }
                None => {
                    closed_loop(
                        &shared,
                        &mut tasks,
                        cfg.concurrency.unwrap_or(1),
                        measure_from,
                        end,
                        stop_rx.clone(),
                    )
                    .await
                }
            }
        };
        mode = if cfg.rate.is_some() {
            LoadMode::OpenLoop
        } else {
            LoadMode::ClosedLoop
        };
        tokio::select! {
            () = generate => { stopped_at = None; }
            () = &mut stop => { stopped_at = Some(Instant::now()); }
        }
    }
    let _ = stop_tx.send(true);

    // Drain: a completed run waits for every request (each bounded by --timeout); an
    // interrupted one — or one interrupted while draining — gives in-flight requests 2 s.
    let mut partial = stopped_at.is_some();
    let mut unfinished = 0;
    if !partial {
        let drain = async { while tasks.join_next().await.is_some() {} };
        tokio::select! {
            () = drain => {}
            () = &mut stop => { partial = true; }
        }
    }
    if partial {
        let _ = tokio::time::timeout(INTERRUPT_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        unfinished = tasks.len() as u64;
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    let window_end = stopped_at.map_or(end, |t| t.min(end));
    let measured_s = window_end
        .saturating_duration_since(measure_from)
        .as_secs_f64();
    drop(shared);
    let collected = collector.await.unwrap_or_default();
    Ok(collected.into_report(&cfg, mode, partial, unfinished, measured_s))
}

/// Opens and closes one TCP connection so an unreachable URL fails fast with one message.
async fn probe(target: &Target) -> Result<(), BenchError> {
    let addr = format!("{}:{}", target.host, target.port);
    let fail = |reason: String| BenchError::Connect {
        target: addr.clone(),
        reason,
    };
    match tokio::time::timeout(
        PROBE_TIMEOUT,
        tokio::net::TcpStream::connect((target.host.as_str(), target.port)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => {
            let msg = e.to_string();
            // "Connection refused (os error 111)" -> "Connection refused".
            let msg = match msg.rfind(" (os error") {
                Some(i) => msg[..i].to_owned(),
                None => msg,
            };
            Err(fail(msg))
        }
        Err(_) => Err(fail(format!(
            "timed out after {}s",
            PROBE_TIMEOUT.as_secs()
        ))),
    }
}

/// Request `i` at `start + i / rate`, whatever earlier requests are doing.
async fn open_loop(
    shared: &Arc<Shared>,
    tasks: &mut JoinSet<()>,
    rate: f64,
    cap: Option<usize>,
    start: Instant,
    measure_from: Instant,
    end: Instant,
) {
    let permits = cap.map(|c| Arc::new(Semaphore::new(c)));
    for i in 0u64.. {
        let sched = start + Duration::from_secs_f64(i as f64 / rate);
        if sched >= end {
            break;
        }
        tokio::time::sleep_until(sched).await;
        let mut waited = false;
        let permit = match &permits {
            None => None,
            Some(sem) => match sem.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    // The safety valve is full: this request cannot start on time. It still
                    // counts from its schedule, so the wait shows in its latency.
                    waited = true;
                    match sem.clone().acquire_owned().await {
                        Ok(p) => Some(p),
                        Err(_) => break,
                    }
                }
            },
        };
        let late = waited || Instant::now().saturating_duration_since(sched) > LATE_AFTER;
        let shared = shared.clone();
        tasks.spawn(async move {
            let sample = one_request(&shared, i, sched, sched >= measure_from, late).await;
            drop(permit);
            let _ = shared.tx.send(sample);
        });
        // Reap finished tasks so the set does not grow with the run length.
        while tasks.try_join_next().is_some() {}
    }
}

/// `workers` loops sending back to back until `end` (saturation throughput).
async fn closed_loop(
    shared: &Arc<Shared>,
    tasks: &mut JoinSet<()>,
    workers: usize,
    measure_from: Instant,
    end: Instant,
    stop: watch::Receiver<bool>,
) {
    let next = Arc::new(AtomicU64::new(0));
    for _ in 0..workers {
        let shared = shared.clone();
        let stop = stop.clone();
        let next = next.clone();
        tasks.spawn(async move {
            loop {
                let now = Instant::now();
                if now >= end || *stop.borrow() {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let sample = one_request(&shared, i, now, now >= measure_from, false).await;
                let _ = shared.tx.send(sample);
            }
        });
    }
    tokio::time::sleep_until(end).await;
}

#[derive(Deserialize)]
struct UsageOut {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Completion {
    #[allow(dead_code)]
    choices: Vec<IgnoredAny>,
    #[serde(default)]
    usage: Option<UsageOut>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ChunkChoice<'a> {
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChunkChoice<'a>>,
    #[serde(default)]
    usage: Option<UsageOut>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

fn elapsed_us(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Sends request `index` of the schedule and measures it from `sched`.
async fn one_request(
    shared: &Shared,
    index: u64,
    sched: Instant,
    measured: bool,
    late: bool,
) -> Sample {
    shared.sent.fetch_add(1, Ordering::Relaxed);
    let mut sample = Sample {
        index,
        measured,
        late,
        result: Err(ErrorClass::BadResponse),
        elapsed_us: 0,
        attempts: None,
        provider: None,
    };
    let r = tokio::time::timeout(shared.timeout, exchange(shared, index, sched, &mut sample)).await;
    sample.result = r.unwrap_or(Err(ErrorClass::Timeout));
    sample.elapsed_us = elapsed_us(sched);
    sample
}

async fn exchange(
    shared: &Shared,
    index: u64,
    sched: Instant,
    sample: &mut Sample,
) -> Result<Success, ErrorClass> {
    let mut req = Request::post(shared.endpoint.clone())
        .body(Full::new(shared.body.clone()))
        .map_err(|_| ErrorClass::BadResponse)?;
    *req.headers_mut() = shared.headers.clone();
    if let Some(prefix) = &shared.request_ids
        && let Ok(v) = HeaderValue::from_str(&format!("{prefix}{index}"))
    {
        req.headers_mut().insert("x-request-id", v);
    }
    let resp = shared.client.request(req).await.map_err(|e| {
        if e.is_connect() {
            ErrorClass::Connect
        } else {
            ErrorClass::Reset
        }
    })?;
    let h = resp.headers();
    sample.attempts = h
        .get("x-tailwarden-attempts")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    sample.provider = h
        .get("x-tailwarden-provider")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status = resp.status();
    if !status.is_success() {
        // Drain so the connection can be reused; the body content does not matter.
        let _ = resp.into_body().collect().await;
        return Err(match status.as_u16() {
            429 => ErrorClass::Http429,
            400..=499 => ErrorClass::Http4xx,
            500..=599 => ErrorClass::Http5xx,
            _ => ErrorClass::BadResponse,
        });
    }
    let mut body = resp.into_body();
    if !shared.stream {
        let bytes = body
            .collect()
            .await
            .map_err(|_| ErrorClass::Reset)?
            .to_bytes();
        let parsed: Completion =
            serde_json::from_slice(&bytes).map_err(|_| ErrorClass::BadResponse)?;
        return Ok(Success {
            total_us: elapsed_us(sched),
            completion_tokens: parsed.usage.and_then(|u| u.completion_tokens).unwrap_or(0),
            ..Success::default()
        });
    }

    let mut parser = SseParser::default();
    let mut out = Success::default();
    let mut last_content: Option<Instant> = None;
    let mut done = false;
    let mut bad = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ErrorClass::Reset)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        parser.feed(&data, |event| match event {
            SseEvent::Done => done = true,
            SseEvent::Data(payload) => match serde_json::from_slice::<Chunk<'_>>(payload) {
                Ok(chunk) if chunk.error.is_none() => {
                    let has_content = chunk.choices.iter().any(|c| {
                        c.delta
                            .as_ref()
                            .and_then(|d| d.content.as_ref())
                            .is_some_and(|s| !s.is_empty())
                            || c.text.as_ref().is_some_and(|s| !s.is_empty())
                    });
                    if let Some(t) = chunk.usage.and_then(|u| u.completion_tokens) {
                        out.completion_tokens = t;
                    }
                    if has_content {
                        match last_content {
                            None => {
                                out.ttft_us = Some(
                                    u64::try_from(now.duration_since(sched).as_micros())
                                        .unwrap_or(u64::MAX),
                                )
                            }
                            Some(prev) => out.gaps_us.push(
                                u64::try_from(now.duration_since(prev).as_micros())
                                    .unwrap_or(u64::MAX),
                            ),
                        }
                        last_content = Some(now);
                    }
                }
                _ => bad = true,
            },
        });
        if bad {
            return Err(ErrorClass::BadResponse);
        }
    }
    if !done {
        // The stream ended cleanly at the HTTP level but without `[DONE]`: cut short.
        return Err(ErrorClass::Reset);
    }
    out.total_us = elapsed_us(sched);
    Ok(out)
}

/// Histograms and counters, owned by the collector task.
#[derive(Debug)]
struct Collected {
    total: Histogram<u64>,
    ttft: Histogram<u64>,
    itl: Histogram<u64>,
    counts: RequestCounts,
    errors: ErrorCounts,
    upstream: UpstreamStats,
    completion_tokens: u64,
    /// Done (measured or not), for the progress line.
    done_all: u64,
    errors_all: u64,
    /// Per-request records, when asked for.
    records: Option<Vec<RequestRecord>>,
}

impl Default for Collected {
    fn default() -> Self {
        Self {
            total: new_histogram(),
            ttft: new_histogram(),
            itl: new_histogram(),
            counts: RequestCounts::default(),
            errors: ErrorCounts::default(),
            upstream: UpstreamStats::default(),
            completion_tokens: 0,
            done_all: 0,
            errors_all: 0,
            records: None,
        }
    }
}

impl Collected {
    fn add(&mut self, s: Sample) {
        self.done_all += 1;
        if s.result.is_err() {
            self.errors_all += 1;
        }
        if !s.measured {
            return;
        }
        self.counts.sent += 1;
        if s.late {
            self.counts.late += 1;
        }
        if let Some(records) = &mut self.records {
            let ms = |us: u64| us as f64 / 1000.0;
            records.push(RequestRecord {
                index: s.index,
                ok: s.result.is_ok(),
                latency_ms: match &s.result {
                    Ok(ok) => ms(ok.total_us),
                    Err(_) => ms(s.elapsed_us),
                },
                ttft_ms: s.result.as_ref().ok().and_then(|ok| ok.ttft_us).map(ms),
                error: s.result.as_ref().err().map(|e| e.label().to_owned()),
                attempts: s.attempts,
                provider: s.provider.clone(),
            });
        }
        if let Some(a) = s.attempts {
            self.upstream.responses_with_attempts += 1;
            self.upstream.attempts_total += a;
        }
        if let Some(p) = s.provider {
            *self.upstream.providers.entry(p).or_insert(0) += 1;
        }
        match s.result {
            Ok(ok) => {
                self.counts.ok += 1;
                self.total.saturating_record(ok.total_us.max(1));
                if let Some(t) = ok.ttft_us {
                    self.ttft.saturating_record(t.max(1));
                }
                for g in ok.gaps_us {
                    self.itl.saturating_record(g.max(1));
                }
                self.completion_tokens += ok.completion_tokens;
            }
            Err(class) => {
                self.counts.errors += 1;
                let e = &mut self.errors;
                *match class {
                    ErrorClass::Connect => &mut e.connect,
                    ErrorClass::Timeout => &mut e.timeout,
                    ErrorClass::Http4xx => &mut e.http_4xx,
                    ErrorClass::Http429 => &mut e.http_429,
                    ErrorClass::Http5xx => &mut e.http_5xx,
                    ErrorClass::Reset => &mut e.reset,
                    ErrorClass::BadResponse => &mut e.bad_response,
                } += 1;
            }
        }
    }

    fn into_report(
        mut self,
        cfg: &BenchConfig,
        mode: LoadMode,
        partial: bool,
        unfinished: u64,
        measured_s: f64,
    ) -> Report {
        self.counts.unfinished = unfinished;
        // Requests aborted after the grace period were started but never reported.
        self.counts.sent += unfinished;
        let finished = self.counts.ok + self.counts.errors;
        let mut records = self.records.take().unwrap_or_default();
        records.sort_by_key(|r| r.index);
        self.upstream.amplification = (self.upstream.responses_with_attempts > 0).then(|| {
            round3(
                self.upstream.attempts_total as f64 / self.upstream.responses_with_attempts as f64,
            )
        });
        Report {
            partial,
            mode,
            url: cfg.url.clone(),
            model: cfg.model.clone(),
            stream: cfg.stream,
            offered_rate_rps: cfg.rate.map(round3),
            concurrency: cfg.concurrency,
            duration_s: round3(measured_s),
            warmup_s: round3(cfg.warmup.as_secs_f64()),
            throughput_rps: if measured_s > 0.0 {
                round3(self.counts.ok as f64 / measured_s)
            } else {
                0.0
            },
            error_rate_percent: if finished > 0 {
                round3(self.counts.errors as f64 * 100.0 / finished as f64)
            } else {
                0.0
            },
            requests: self.counts,
            errors: self.errors,
            latency_ms: Percentiles::from_histogram(&self.total),
            ttft_ms: Percentiles::from_histogram(&self.ttft),
            inter_token_ms: Percentiles::from_histogram(&self.itl),
            completion_tokens: self.completion_tokens,
            upstream: self.upstream,
            records,
        }
    }
}

/// Receives samples until every sender is gone; prints progress while it runs.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<Sample>,
    sent: Arc<AtomicU64>,
    start: Instant,
    progress: bool,
    record: bool,
) -> Collected {
    let tty = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut c = Collected {
        records: record.then(Vec::new),
        ..Collected::default()
    };
    let mut printed_tty = false;
    let mut ticks = 0u64;
    loop {
        tokio::select! {
            s = rx.recv() => match s {
                Some(s) => c.add(s),
                None => break,
            },
            _ = tick.tick(), if progress => {
                ticks += 1;
                // A TTY gets an in-place line every second; logs get a line every 5 s.
                if tty || ticks.is_multiple_of(5) {
                    let p99 = if c.total.is_empty() {
                        "-".to_owned()
                    } else {
                        format!("{:.1}ms", c.total.value_at_quantile(0.99) as f64 / 1000.0)
                    };
                    let line = format!(
                        "[{:>6.1}s] sent {} done {} errors {} p99 {}",
                        start.elapsed().as_secs_f64(),
                        sent.load(Ordering::Relaxed),
                        c.done_all,
                        c.errors_all,
                        p99
                    );
                    if tty {
                        eprint!("\r{line}\x1b[K");
                        printed_tty = true;
                    } else {
                        eprintln!("{line}");
                    }
                }
            }
        }
    }
    if printed_tty {
        eprintln!();
    }
    c
}
