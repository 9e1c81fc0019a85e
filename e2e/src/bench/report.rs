//! The result of a bench run: serialisable numbers plus the human tables.
//!
//! All latencies are recorded in HDR histograms with microsecond resolution (1 µs .. 10 min,
//! 3 significant digits) and reported in milliseconds rounded to 3 decimals, so the JSON is
//! stable and diffable. [`render_side_by_side`] exists for the demo, which runs the same
//! load with and without the sidecar and prints both columns next to each other.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Highest trackable value: 10 minutes in microseconds.
pub const HIST_MAX_US: u64 = 600_000_000;

/// A fresh latency histogram (µs, 1 µs .. 10 min, 3 significant digits).
pub fn new_histogram() -> Histogram<u64> {
    // Constant, valid bounds: this cannot fail.
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("static histogram bounds are valid")
}

/// Rounds to 3 decimals (the report's precision for ms and rates).
pub fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Percentile summary of one histogram, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Number of recorded values.
    pub count: u64,
    /// Smallest value.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest value.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

impl Percentiles {
    /// Summarises a µs histogram; `None` when it is empty.
    pub fn from_histogram(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        let ms = |us: u64| round3(us as f64 / 1000.0);
        Some(Self {
            count: h.len(),
            min: ms(h.min()),
            p50: ms(h.value_at_quantile(0.50)),
            p95: ms(h.value_at_quantile(0.95)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
            mean: round3(h.mean() / 1000.0),
        })
    }
}

/// Failed requests by class.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorCounts {
    /// TCP connect failed.
    pub connect: u64,
    /// `--timeout` expired.
    pub timeout: u64,
    /// 4xx other than 429.
    pub http_4xx: u64,
    /// 429.
    pub http_429: u64,
    /// 5xx.
    pub http_5xx: u64,
    /// Connection closed without a response, body error, or stream cut before `[DONE]`.
    pub reset: u64,
    /// 2xx whose body was not a valid completion / SSE stream.
    pub bad_response: u64,
}

impl ErrorCounts {
    /// Sum of all classes.
    pub fn total(&self) -> u64 {
        self.connect
            + self.timeout
            + self.http_4xx
            + self.http_429
            + self.http_5xx
            + self.reset
            + self.bad_response
    }
}

/// What the sidecar's response headers said.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpstreamStats {
    /// Responses that carried `x-tailwarden-attempts`.
    pub responses_with_attempts: u64,
    /// Sum of `x-tailwarden-attempts`.
    pub attempts_total: u64,
    /// Upstream attempts per request (`attempts_total / responses_with_attempts`).
    pub amplification: Option<f64>,
    /// Responses per `x-tailwarden-provider` value.
    pub providers: BTreeMap<String, u64>,
}

/// Request counters of the measured window.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestCounts {
    /// Requests started.
    pub sent: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests that failed (see `errors`).
    pub errors: u64,
    /// Requests that started more than 10 ms after their scheduled time (or waited for a
    /// `--concurrency` slot). Their latency still counts from the schedule.
    pub late: u64,
    /// Requests still in flight when an interrupted run gave up waiting.
    pub unfinished: u64,
}

/// Open or closed loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMode {
    /// Constant arrival rate; latency measured from each request's scheduled time.
    OpenLoop,
    /// N workers back to back; measures saturation throughput.
    ClosedLoop,
}

/// Everything a run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// True when the run was interrupted (Ctrl-C) before its planned end.
    pub partial: bool,
    /// Load shape.
    pub mode: LoadMode,
    /// Base URL.
    pub url: String,
    /// Model requested.
    pub model: String,
    /// Whether requests were streamed.
    pub stream: bool,
    /// Configured arrival rate (open loop).
    pub offered_rate_rps: Option<f64>,
    /// Concurrency cap (open loop) or worker count (closed loop).
    pub concurrency: Option<usize>,
    /// Length of the measured window actually run, seconds.
    pub duration_s: f64,
    /// Warm-up excluded from the numbers, seconds.
    pub warmup_s: f64,
    /// Counters.
    pub requests: RequestCounts,
    /// Successful requests per second of the measured window.
    pub throughput_rps: f64,
    /// `errors / (ok + errors)` in percent.
    pub error_rate_percent: f64,
    /// Errors by class.
    pub errors: ErrorCounts,
    /// Total latency of successful requests, from scheduled start to last byte.
    pub latency_ms: Option<Percentiles>,
    /// Time to first content frame, from scheduled start (stream mode).
    pub ttft_ms: Option<Percentiles>,
    /// Gaps between successive content frames (stream mode).
    pub inter_token_ms: Option<Percentiles>,
    /// Sum of `usage.completion_tokens` seen.
    pub completion_tokens: u64,
    /// Sidecar response headers.
    pub upstream: UpstreamStats,
    /// One record per measured request, in schedule order (only with `record_requests`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<RequestRecord>,
}

/// What happened to one request, for comparing two runs request by request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the schedule (the `i` of `x-request-id: {prefix}{i}`).
    pub index: u64,
    /// Whether it succeeded.
    pub ok: bool,
    /// Scheduled start to last byte (to the failure for errors), ms.
    pub latency_ms: f64,
    /// Scheduled start to first content, ms (streams).
    pub ttft_ms: Option<f64>,
    /// Error class of a failure (`5xx`, `429`, `reset`, `timeout`, ...).
    pub error: Option<String>,
    /// `x-tailwarden-attempts` of the response.
    pub attempts: Option<u64>,
    /// `x-tailwarden-provider` of the response.
    pub provider: Option<String>,
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"))
}

fn percentile_row(out: &mut String, name: &str, p: Option<&Percentiles>) {
    match p {
        Some(p) => {
            let _ = writeln!(
                out,
                "{name:<16}{:>11.3}{:>11.3}{:>11.3}{:>11.3}{:>11.3}{:>11.3}{:>9}",
                p.p50, p.p95, p.p99, p.p999, p.max, p.mean, p.count
            );
        }
        None => {
            let _ = writeln!(out, "{name:<16}{:>11}", "-");
        }
    }
}

impl Report {
    /// The human-readable table printed at the end of a run.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let shape = match self.mode {
            LoadMode::OpenLoop => format!(
                "open loop at {} req/s{}",
                fmt_opt(self.offered_rate_rps),
                self.concurrency
                    .map(|c| format!(" (max {c} in flight)"))
                    .unwrap_or_default()
            ),
            LoadMode::ClosedLoop => {
                format!("closed loop with {} workers", self.concurrency.unwrap_or(0))
            }
        };
        let _ = writeln!(
            out,
            "tailwarden-bench{}: {shape}, {:.3} s measured{}, {} -> {}",
            if self.partial {
                " (PARTIAL: interrupted)"
            } else {
                ""
            },
            self.duration_s,
            if self.warmup_s > 0.0 {
                format!(" after {:.3} s warm-up", self.warmup_s)
            } else {
                String::new()
            },
            if self.stream { "stream" } else { "non-stream" },
            self.url
        );
        let r = &self.requests;
        let _ = writeln!(
            out,
            "requests: sent {}, ok {}, errors {} ({:.3} %), late {}, unfinished {}",
            r.sent, r.ok, r.errors, self.error_rate_percent, r.late, r.unfinished
        );
        let _ = writeln!(
            out,
            "throughput: {:.3} req/s completed",
            self.throughput_rps
        );
        let _ = writeln!(
            out,
            "{:<16}{:>11}{:>11}{:>11}{:>11}{:>11}{:>11}{:>9}",
            "(ms)", "p50", "p95", "p99", "p99.9", "max", "mean", "n"
        );
        percentile_row(&mut out, "latency", self.latency_ms.as_ref());
        if self.stream {
            percentile_row(&mut out, "ttft", self.ttft_ms.as_ref());
            percentile_row(&mut out, "inter-token", self.inter_token_ms.as_ref());
        }
        let e = &self.errors;
        let _ = writeln!(
            out,
            "errors: connect {}, timeout {}, http_4xx {}, http_429 {}, http_5xx {}, reset {}, bad_response {}",
            e.connect, e.timeout, e.http_4xx, e.http_429, e.http_5xx, e.reset, e.bad_response
        );
        let u = &self.upstream;
        if u.responses_with_attempts > 0 || !u.providers.is_empty() {
            let providers: Vec<String> = u
                .providers
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = writeln!(
                out,
                "upstream: attempts/request {} (over {} responses); providers: {}",
                fmt_opt(u.amplification),
                u.responses_with_attempts,
                if providers.is_empty() {
                    "-".to_owned()
                } else {
                    providers.join(", ")
                }
            );
        }
        if self.completion_tokens > 0 {
            let _ = writeln!(out, "completion tokens: {}", self.completion_tokens);
        }
        out
    }
}

/// A metric-per-row table comparing several runs (e.g. direct vs through the sidecar).
pub fn render_side_by_side(runs: &[(&str, &Report)]) -> String {
    type Getter = fn(&Report) -> String;
    let rows: Vec<(&str, Getter)> = vec![
        ("throughput req/s", |r| format!("{:.3}", r.throughput_rps)),
        ("error rate %", |r| format!("{:.3}", r.error_rate_percent)),
        ("latency p50 ms", |r| {
            fmt_opt(r.latency_ms.as_ref().map(|p| p.p50))
        }),
        ("latency p95 ms", |r| {
            fmt_opt(r.latency_ms.as_ref().map(|p| p.p95))
        }),
        ("latency p99 ms", |r| {
            fmt_opt(r.latency_ms.as_ref().map(|p| p.p99))
        }),
        ("latency p99.9 ms", |r| {
            fmt_opt(r.latency_ms.as_ref().map(|p| p.p999))
        }),
        ("latency max ms", |r| {
            fmt_opt(r.latency_ms.as_ref().map(|p| p.max))
        }),
        ("ttft p50 ms", |r| {
            fmt_opt(r.ttft_ms.as_ref().map(|p| p.p50))
        }),
        ("ttft p99 ms", |r| {
            fmt_opt(r.ttft_ms.as_ref().map(|p| p.p99))
        }),
        ("inter-token p99 ms", |r| {
            fmt_opt(r.inter_token_ms.as_ref().map(|p| p.p99))
        }),
        ("attempts/request", |r| fmt_opt(r.upstream.amplification)),
    ];
    let width = runs.iter().map(|(l, _)| l.len()).max().unwrap_or(0).max(12) + 2;
    let mut out = String::new();
    let _ = write!(out, "{:<20}", "");
    for (label, _) in runs {
        let _ = write!(out, "{label:>width$}");
    }
    out.push('\n');
    for (name, get) in rows {
        let _ = write!(out, "{name:<20}");
        for (_, r) in runs {
            let _ = write!(out, "{:>width$}", get(r));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_values() {
        let mut h = new_histogram();
        // 1 ms .. 1000 ms, one value each: the p-th percentile is p * 10 ms.
        for ms in 1..=1000u64 {
            h.record(ms * 1000).expect("in range");
        }
        let p = Percentiles::from_histogram(&h).expect("non-empty");
        assert_eq!(p.count, 1000);
        let close = |got: f64, want: f64| (got - want).abs() <= want * 0.001 + 0.001;
        assert!(close(p.p50, 500.0), "p50 {}", p.p50);
        assert!(close(p.p95, 950.0), "p95 {}", p.p95);
        assert!(close(p.p99, 990.0), "p99 {}", p.p99);
        assert!(close(p.p999, 999.0), "p99.9 {}", p.p999);
        assert!(close(p.max, 1000.0), "max {}", p.max);
        assert!(close(p.min, 1.0), "min {}", p.min);
        assert!(close(p.mean, 500.5), "mean {}", p.mean);
    }

    #[test]
    fn a_single_outlier_moves_max_not_median() {
        let mut h = new_histogram();
        for _ in 0..999 {
            h.record(2_000).expect("in range");
        }
        h.record(3_000_000).expect("in range");
        let p = Percentiles::from_histogram(&h).expect("non-empty");
        assert!((p.p50 - 2.0).abs() < 0.01);
        assert!((p.p99 - 2.0).abs() < 0.01);
        assert!((p.max - 3000.0).abs() < 3.0);
        assert!(Percentiles::from_histogram(&new_histogram()).is_none());
    }

    #[test]
    fn ms_are_rounded_to_three_decimals() {
        assert_eq!(round3(1.23456), 1.235);
        let mut h = new_histogram();
        h.record(1_234).expect("in range");
        let p = Percentiles::from_histogram(&h).expect("non-empty");
        assert_eq!(p.p50, 1.234);
        let json = serde_json::to_string(&p).expect("json");
        assert!(json.contains("\"p50\":1.234"), "{json}");
    }
}
