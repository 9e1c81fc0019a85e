//! Per-process counters of the simulator, served at `GET /sim/stats`.
//!
//! Proxy tests read these to prove behaviour the proxy's own client cannot see: that a
//! client disconnect cancelled the upstream request (`cancelled`), how many attempts reached
//! the provider, and which credentials the proxy forwarded (`last_authorization`).
//! Everything is a relaxed atomic except the last Authorization value, because the counters
//! sit on the hot path of a simulator expected to do tens of thousands of requests a second.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use http::HeaderValue;
use serde::{Deserialize, Serialize};

/// Which endpoint a request hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
    /// `POST /v1/responses`
    Responses,
    /// `GET /v1/models`
    Models,
    /// `GET /healthz`
    Healthz,
    /// `POST /v1/moderations`
    Moderations,
    /// `POST /v1/files` (multipart), `GET /v1/files/{id}`
    Files,
    /// `GET`/`DELETE /v1/responses/{id}`, `…/input_items`, `POST …/cancel`
    ResponseObject,
    /// Anything else (404/405).
    Other,
}

impl Endpoint {
    const ALL: [Self; 10] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Embeddings,
        Self::Responses,
        Self::Models,
        Self::Healthz,
        Self::Moderations,
        Self::Files,
        Self::ResponseObject,
        Self::Other,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
            Self::Responses => "responses",
            Self::Models => "models",
            Self::Healthz => "healthz",
            Self::Moderations => "moderations",
            Self::Files => "files",
            Self::ResponseObject => "response_object",
            Self::Other => "other",
        }
    }
}

/// How a request ended (faults are counted when injected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered normally and completely.
    Ok,
    /// 400 (bad JSON or missing fields).
    BadRequest,
    /// 404 / 405.
    NotFound,
    /// Injected 500.
    Fault500,
    /// Injected 503 (including brownout errors).
    Fault503,
    /// Injected 429.
    Fault429,
    /// Injected connection reset.
    FaultReset,
    /// Injected mid-body abort.
    FaultDrop,
    /// Injected stall.
    FaultStall,
}

impl Outcome {
    const ALL: [Self; 9] = [
        Self::Ok,
        Self::BadRequest,
        Self::NotFound,
        Self::Fault500,
        Self::Fault503,
        Self::Fault429,
        Self::FaultReset,
        Self::FaultDrop,
        Self::FaultStall,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::BadRequest => "bad_request",
            Self::NotFound => "not_found",
            Self::Fault500 => "fault_500",
            Self::Fault503 => "fault_503",
            Self::Fault429 => "fault_429",
            Self::FaultReset => "fault_reset",
            Self::FaultDrop => "fault_drop",
            Self::FaultStall => "fault_stall",
        }
    }
}

/// The live counters.
#[derive(Debug)]
pub struct Stats {
    started: Instant,
    requests_total: AtomicU64,
    by_endpoint: [AtomicU64; Endpoint::ALL.len()],
    by_outcome: [AtomicU64; Outcome::ALL.len()],
    in_flight: AtomicI64,
    cancelled: AtomicU64,
    last_authorization: Mutex<Option<HeaderValue>>,
}

/// A point-in-time copy of [`Stats`], as served by `GET /sim/stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Requests to API endpoints (everything except `/sim/*`).
    pub requests_total: u64,
    /// Requests by endpoint name.
    pub by_endpoint: BTreeMap<String, u64>,
    /// Requests by outcome name (`ok`, `fault_500`, ...).
    pub by_outcome: BTreeMap<String, u64>,
    /// Requests currently being served.
    pub in_flight: i64,
    /// Requests whose client went away before the response was complete.
    pub cancelled: u64,
    /// The `Authorization` header of the last API request (`null` when it had none).
    pub last_authorization: Option<String>,
    /// Seconds since the simulator started.
    pub uptime_s: f64,
    /// Whether a brownout window is open right now.
    pub brownout_active: bool,
}

impl StatsSnapshot {
    /// Count for an outcome name, 0 when absent.
    pub fn outcome(&self, name: &str) -> u64 {
        self.by_outcome.get(name).copied().unwrap_or(0)
    }
}

impl Stats {
    /// Fresh counters; `started` anchors brownout windows and uptime.
    pub fn new(started: Instant) -> Self {
        Self {
            started,
            requests_total: AtomicU64::new(0),
            by_endpoint: Default::default(),
            by_outcome: Default::default(),
            in_flight: AtomicI64::new(0),
            cancelled: AtomicU64::new(0),
            last_authorization: Mutex::new(None),
        }
    }

    /// Counts a request to `endpoint` and remembers its Authorization header.
    pub fn record_request(&self, endpoint: Endpoint, authorization: Option<&HeaderValue>) {
        self.requests_total.fetch_add(1, Ordering::Relaxed);
        self.by_endpoint[endpoint as usize].fetch_add(1, Ordering::Relaxed);
        // A poisoned lock only means another request panicked mid-assignment of an Option;
        // the value is still usable.
        let mut last = self
            .last_authorization
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *last = authorization.cloned();
    }

    /// Counts an outcome.
    pub fn record_outcome(&self, outcome: Outcome) {
        self.by_outcome[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Zeroes every counter (not `in_flight`, which tracks live requests).
    pub fn reset(&self) {
        self.requests_total.store(0, Ordering::Relaxed);
        for c in self.by_endpoint.iter().chain(self.by_outcome.iter()) {
            c.store(0, Ordering::Relaxed);
        }
        self.cancelled.store(0, Ordering::Relaxed);
        *self
            .last_authorization
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Copies the counters.
    pub fn snapshot(&self, brownout_active: bool) -> StatsSnapshot {
        let last_authorization = self
            .last_authorization
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        StatsSnapshot {
            requests_total: self.requests_total.load(Ordering::Relaxed),
            by_endpoint: Endpoint::ALL
                .iter()
                .map(|e| {
                    (
                        e.name().to_owned(),
                        self.by_endpoint[*e as usize].load(Ordering::Relaxed),
                    )
                })
                .collect(),
            by_outcome: Outcome::ALL
                .iter()
                .map(|o| {
                    (
                        o.name().to_owned(),
                        self.by_outcome[*o as usize].load(Ordering::Relaxed),
                    )
                })
                .collect(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            last_authorization,
            uptime_s: self.started.elapsed().as_secs_f64(),
            brownout_active,
        }
    }
}

/// Tracks one API request from arrival to completion.
///
/// It lives in the service future and then in the response body, so when hyper drops
/// either because the client went away, `Drop` sees an unfinished request and counts it
/// as cancelled — that is the signal proxy tests use to prove upstream cancellation.
#[derive(Debug)]
pub struct RequestGuard {
    stats: Arc<Stats>,
    finished: bool,
}

impl RequestGuard {
    /// Marks a request in flight.
    pub fn new(stats: Arc<Stats>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        Self {
            stats,
            finished: false,
        }
    }

    /// The request ended on the server's terms; `outcome` is counted when given.
    pub fn finish(&mut self, outcome: Option<Outcome>) {
        if !self.finished {
            self.finished = true;
            if let Some(o) = outcome {
                self.stats.record_outcome(o);
            }
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
