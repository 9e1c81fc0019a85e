//! `tailwarden-bench`: load generator for OpenAI-compatible chat endpoints.
//!
//! Its main mode is *open loop*: request `i` is scheduled at `start + i / rate` whatever
//! happened to earlier requests, and latency is measured from that scheduled time. A
//! closed-loop tool (or an open-loop one timing from the actual send) stops sending while the
//! server stalls and so never records the requests that would have waited — coordinated
//! omission — which hides exactly the tail the sidecar exists to fix. Closed loop
//! (`--concurrency` without `--rate`) is kept for measuring saturation throughput.
//!
//! [`run`] is a library function so the demo can run two configurations in-process and
//! print them with [`render_side_by_side`].

mod report;
mod runner;
mod sse;

use std::time::Duration;

use http::Uri;
use http::header::{HeaderName, HeaderValue};

pub use report::{
    ErrorCounts, HIST_MAX_US, LoadMode, Percentiles, Report, RequestCounts, RequestRecord,
    UpstreamStats, new_histogram, render_side_by_side, round3,
};
pub use runner::{run, run_until};
pub use sse::{SseEvent, SseParser};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `--url` is not a usable `http://` URL.
    #[error("invalid --url '{url}': {reason}")]
    InvalidUrl {
        /// What was given.
        url: String,
        /// Why it is unusable.
        reason: String,
    },
    /// `--rate` is not a positive finite number.
    #[error("--rate must be a number > 0, got {0}")]
    InvalidRate(f64),
    /// `--duration` is zero.
    #[error("--duration must be > 0")]
    InvalidDuration,
    /// `--concurrency` is zero.
    #[error("--concurrency must be >= 1")]
    InvalidConcurrency,
    /// `--timeout` is zero.
    #[error("--timeout must be > 0")]
    InvalidTimeout,
    /// Neither `--rate` nor `--concurrency`.
    #[error("give --rate R (open loop) or --concurrency C without --rate (closed loop)")]
    NoLoadShape,
    /// A `--header` is not `Name: value`.
    #[error("invalid --header '{0}': expected 'Name: value' with a valid header name and value")]
    InvalidHeader(String),
    /// The up-front connection probe failed.
    #[error("cannot connect to {target}: {reason}")]
    Connect {
        /// `host:port`.
        target: String,
        /// OS error without the `(os error N)` suffix.
        reason: String,
    },
}

/// How to load the endpoint.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Base URL, e.g. `http://127.0.0.1:15080/v1`; requests go to `{url}/chat/completions`.
    pub url: String,
    /// Arrival rate (requests/s) for open loop.
    pub rate: Option<f64>,
    /// Measured duration.
    pub duration: Duration,
    /// Send `"stream": true` and measure TTFT and inter-token gaps.
    pub stream: bool,
    /// With `rate`: cap on in-flight requests. Without: closed-loop worker count.
    pub concurrency: Option<usize>,
    /// `model` of every request.
    pub model: String,
    /// Load before the measured window, excluded from the numbers.
    pub warmup: Duration,
    /// `max_tokens` of every request.
    pub max_tokens: Option<u32>,
    /// Extra request headers (`Authorization`, `x-sim-*`, ...), as `(name, value)`.
    pub headers: Vec<(String, String)>,
    /// Per-request timeout, from the actual send.
    pub timeout: Duration,
    /// The user message.
    pub prompt: String,
    /// Print a progress line to stderr.
    pub progress: bool,
    /// When set, request `i` of the schedule carries `x-request-id: {prefix}{i}`, so an
    /// upstream with keyed fates gives it the same fate in every run (see `sim::fate`).
    pub request_ids: Option<String>,
    /// Keep one [`RequestRecord`] per measured request in the report (for paired
    /// comparisons of two runs, request by request).
    pub record_requests: bool,
}

impl BenchConfig {
    /// Defaults for everything but the URL.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            rate: None,
            duration: Duration::from_secs(10),
            stream: false,
            concurrency: None,
            model: "gpt-4.1-mini".to_owned(),
            warmup: Duration::ZERO,
            max_tokens: None,
            headers: Vec::new(),
            timeout: Duration::from_secs(60),
            prompt: "Say hello in one short sentence.".to_owned(),
            progress: false,
            request_ids: None,
            record_requests: false,
        }
    }

    /// Parses a `Name: value` (or `Name:value`) header argument.
    pub fn parse_header(arg: &str) -> Result<(String, String), BenchError> {
        let (name, value) = arg
            .split_once(':')
            .ok_or_else(|| BenchError::InvalidHeader(arg.to_owned()))?;
        let (name, value) = (name.trim(), value.trim());
        if HeaderName::from_bytes(name.as_bytes()).is_err() || HeaderValue::from_str(value).is_err()
        {
            return Err(BenchError::InvalidHeader(arg.to_owned()));
        }
        Ok((name.to_owned(), value.to_owned()))
    }

    /// Checks every field; returns the endpoint and `host:port` to probe.
    pub(crate) fn validate(&self) -> Result<Target, BenchError> {
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(BenchError::InvalidRate(r));
        }
        if self.duration.is_zero() {
            return Err(BenchError::InvalidDuration);
        }
        if self.timeout.is_zero() {
            return Err(BenchError::InvalidTimeout);
        }
        if self.concurrency == Some(0) {
            return Err(BenchError::InvalidConcurrency);
        }
        if self.rate.is_none() && self.concurrency.is_none() {
            return Err(BenchError::NoLoadShape);
        }
        for (n, v) in &self.headers {
            if HeaderName::from_bytes(n.as_bytes()).is_err() || HeaderValue::from_str(v).is_err() {
                return Err(BenchError::InvalidHeader(format!("{n}: {v}")));
            }
        }
        if let Some(prefix) = &self.request_ids
            && HeaderValue::from_str(&format!("{prefix}0")).is_err()
        {
            return Err(BenchError::InvalidHeader(format!(
                "x-request-id: {prefix}0"
            )));
        }
        Target::parse(&self.url)
    }
}

/// Where requests go.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub endpoint: Uri,
    pub host: String,
    pub port: u16,
}

impl Target {
    fn parse(url: &str) -> Result<Self, BenchError> {
        let bad = |reason: &str| BenchError::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let base: Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        match base.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(bad(
                    "https is not supported; point the bench at a plain-HTTP listener such as the sidecar's",
                ));
            }
            Some(other) => return Err(bad(&format!("unsupported scheme '{other}', use http://"))),
            None => {
                return Err(bad(
                    "missing scheme, expected e.g. http://127.0.0.1:15080/v1",
                ));
            }
        }
        let authority = base.authority().ok_or_else(|| bad("missing host"))?;
        let host = authority.host().trim_matches(['[', ']']).to_owned();
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        let port = authority.port_u16().unwrap_or(80);
        let path = format!("{}/chat/completions", base.path().trim_end_matches('/'));
        let endpoint = Uri::builder()
            .scheme("http")
            .authority(authority.as_str())
            .path_and_query(path)
            .build()
            .map_err(|e| bad(&e.to_string()))?;
        Ok(Self {
            endpoint,
            host,
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_becomes_chat_endpoint() {
        let t = Target::parse("http://127.0.0.1:15080/v1/").expect("valid");
        assert_eq!(
            t.endpoint.to_string(),
            "http://127.0.0.1:15080/v1/chat/completions"
        );
        assert_eq!((t.host.as_str(), t.port), ("127.0.0.1", 15080));
        let t = Target::parse("http://localhost/v1").expect("valid");
        assert_eq!(t.port, 80);
    }

    #[test]
    fn bad_inputs_have_clear_messages() {
        let msg = |cfg: &BenchConfig| cfg.validate().expect_err("invalid").to_string();
        let mut cfg = BenchConfig::new("http://127.0.0.1:1/v1");
        cfg.rate = Some(0.0);
        assert_eq!(msg(&cfg), "--rate must be a number > 0, got 0");
        cfg.rate = Some(10.0);
        cfg.duration = Duration::ZERO;
        assert_eq!(msg(&cfg), "--duration must be > 0");
        cfg.duration = Duration::from_secs(1);
        cfg.url = "not a url".to_owned();
        assert!(msg(&cfg).starts_with("invalid --url 'not a url'"));
        cfg.url = "https://api.openai.com/v1".to_owned();
        assert!(msg(&cfg).contains("https is not supported"));
        cfg.url = "127.0.0.1:8080/v1".to_owned();
        assert!(msg(&cfg).starts_with("invalid --url"), "{}", msg(&cfg));
        cfg.url = "http://127.0.0.1:1/v1".to_owned();
        cfg.rate = None;
        assert!(msg(&cfg).contains("--rate R"));
        assert!(BenchConfig::parse_header("Authorization: Bearer x").is_ok());
        assert!(BenchConfig::parse_header("no colon").is_err());
        assert!(BenchConfig::parse_header("bad name: x").is_err());
    }
}
