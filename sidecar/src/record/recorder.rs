//! Per-request accounting: metrics, tokens, cost, the spans' outcome and the one JSON log
//! line per request.
//!
//! A [`Recorder`] travels with the response body and records when it is dropped — after the
//! last byte, on a failure, or when the client went away mid-stream — so every exit is
//! counted once, usage included. When the provider sends no usage, tokens are estimated
//! (request bytes / 4 for input, content chunks for output) and marked as estimated.
//! The same usage settles the request's token reservation with the rate limiter.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use rust_decimal::prelude::ToPrimitive;
use tokio::time::Instant;

use tailwarden_decide::{
    context::ContextReport,
    degrade::{Degrader, State},
    sse::SseEvent,
    usage::Price,
};

use super::{metrics::Metrics, telemetry};
use crate::{
    relay::{End, Observer},
    state::limits::AdmissionGuard,
};

pub use tailwarden_decide::usage::Usage;

/// The objectives of a route's `slo` each request is judged against.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SloTargets {
    /// `ttftP99`: streamed requests whose first token came within it met the objective.
    pub ttft: Option<Duration>,
    /// `latencyP99`: successful requests that ended within it met the objective.
    pub latency: Option<Duration>,
    /// `availabilityPercent` as a ratio: requests that did not fail (5xx, a stream error)
    /// met it; requests the client closed are not judged.
    pub availability: Option<f64>,
}

impl SloTargets {
    pub fn of(spec: &tailwarden_crds::InferenceRouteSpec) -> Self {
        let Some(slo) = &spec.slo else {
            return Self::default();
        };
        Self {
            ttft: slo.ttft_p99.as_ref().map(|d| d.get()),
            latency: slo.latency_p99.as_ref().map(|d| d.get()),
            availability: slo
                .availability_percent
                .as_ref()
                .and_then(|p| p.get().to_f64())
                .map(|p| p / 100.0),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ttft.is_none() && self.latency.is_none() && self.availability.is_none()
    }
}

/// What is known about a request when its response starts.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    pub metrics: Arc<Metrics>,
    /// The GenAI operation (`chat`, `text_completion`, `embeddings`).
    pub operation: &'static str,
    /// The workload the sidecar serves.
    pub identity: Arc<super::identity::Identity>,
    /// The route's `tenantHeader` value, when it has one: the caller as the app names it,
    /// apart from the workload.
    pub tenant: Option<String>,
    pub request_id: String,
    pub route: Arc<str>,
    pub model: String,
    pub provider: Arc<str>,
    pub provider_model: String,
    pub tier: Option<Arc<str>>,
    pub stream: bool,
    pub status: u16,
    pub attempts: u32,
    pub hedged: bool,
    pub arrived: Instant,
    pub overhead: Duration,
    pub request_bytes: usize,
    pub price: Option<Price>,
    pub slo: SloTargets,
    /// The request's OpenTelemetry SERVER span ([`tracing::Span::none`] when tracing is off).
    pub span: tracing::Span,
    /// The CLIENT span of the attempt that answered, ended with the request.
    pub attempt_span: tracing::Span,
    /// The exact cache's verdict (`hit`, `miss`, `bypass`) on routes with a cache.
    pub cache: Option<&'static str>,
    /// What the context budget did (routes with a `contextBudget`).
    pub context: Option<ContextReport>,
    /// The concurrency-queue priority (routes with `rateLimit.priority`).
    pub priority: Option<u8>,
    /// A stream request answered by a plain call (`streaming.fallback`).
    pub stream_fallback: bool,
    /// Routes with a `degradation`: the route's state, whether the degraded target served
    /// the request, and the state machine a normal-tier request reports its SLO to.
    pub degrade: Option<DegradeSample>,
}

/// What a request of a route with a `degradation` reports.
#[derive(Debug, Clone)]
pub struct DegradeSample {
    pub state: State,
    pub served: bool,
    pub machine: Arc<Mutex<Degrader>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    InProgress,
    Ok,
    Failed(&'static str),
}

/// Records a request's metrics and log line exactly once, when dropped.
pub struct Recorder {
    info: RequestInfo,
    outcome: Outcome,
    error_type: Option<String>,
    ttft: Option<Duration>,
    usage: Option<Usage>,
    content_chunks: u64,
    done_seen: bool,
    body_bytes: usize,
    /// The `model` the provider reported, for `gen_ai.response.model` (traced requests only).
    response_model: Option<String>,
    /// The rate limiter's hold on this request: settled with the real usage when it ends.
    admission: Option<AdmissionGuard>,
}

impl Recorder {
    pub fn new(info: RequestInfo) -> Self {
        info.metrics
            .in_flight
            .with_label_values(&[&info.route])
            .inc();
        Self {
            info,
            outcome: Outcome::InProgress,
            error_type: None,
            ttft: None,
            usage: None,
            content_chunks: 0,
            done_seen: false,
            body_bytes: 0,
            response_model: None,
            admission: None,
        }
    }

    /// Holds the request's admission (concurrency slots, token reservation) until the
    /// response ends, then settles it with the tokens used.
    pub fn set_admission(&mut self, guard: Option<AdmissionGuard>) {
        self.admission = guard;
    }

    /// A response that is complete at creation (errors, buffered bodies).
    pub fn finished(info: RequestInfo, error_type: Option<&str>) -> Self {
        let mut r = Self::new(info);
        r.error_type = error_type.map(str::to_owned);
        r.outcome = if r.info.status < 400 {
            Outcome::Ok
        } else {
            Outcome::Failed("error")
        };
        r
    }

    pub fn set_usage(&mut self, usage: Usage) {
        self.usage = Some(usage);
    }

    pub fn set_response_model(&mut self, model: Option<String>) {
        self.response_model = model;
    }

    pub fn add_body_bytes(&mut self, n: usize) {
        self.body_bytes += n;
    }

    pub fn on_sse_event(&mut self, event: &SseEvent) {
        if event.has_content() {
            if self.ttft.is_none() {
                self.ttft = Some(self.info.arrived.elapsed());
            }
            self.content_chunks += 1;
        }
        if matches!(event, SseEvent::Done) {
            self.done_seen = true;
        }
        if let Some(m) = event.model()
            && self.response_model.is_none()
            && !self.info.span.is_none()
        {
            self.response_model = Some(m.to_owned());
        }
        if let Some(u) = event.usage() {
            self.usage = Some(Usage {
                input: u.prompt_tokens.unwrap_or(0),
                cached_input: u.cached_tokens.unwrap_or(0),
                output: u.completion_tokens.unwrap_or(0),
                reasoning: u.reasoning_tokens.unwrap_or(0),
                estimated: false,
            });
        }
    }

    pub fn fail_mid_stream(&mut self, code: &'static str) {
        self.outcome = Outcome::Failed(code);
        self.error_type = Some(code.to_owned());
    }

    pub fn finish_ok(&mut self) {
        if self.outcome == Outcome::InProgress {
            self.outcome = Outcome::Ok;
        }
    }

    fn status_class(&self) -> &'static str {
        match self.outcome {
            Outcome::InProgress => "client_closed",
            Outcome::Failed(_) if self.info.status < 400 => "stream_error",
            _ => match self.info.status {
                200..=299 => "2xx",
                400..=499 => "4xx",
                _ => "5xx",
            },
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let i = &self.info;
        let m = &i.metrics;
        m.in_flight.with_label_values(&[&i.route]).dec();
        let total = i.arrived.elapsed();
        let class = self.status_class();
        // Prometheus drops empty label values, which would give these series a different
        // label set: requests no provider served are labelled `none` (`cache` for hits).
        let provider: &str = if i.provider.is_empty() {
            "none"
        } else {
            &i.provider
        };
        let served_upstream = !i.provider.is_empty() && i.cache != Some("hit");
        m.requests
            .with_label_values(&[&i.route, provider, &i.model, class])
            .inc();
        m.request_duration
            .with_label_values(&[&i.route, provider, &i.model, class])
            .observe(total.as_secs_f64());
        m.overhead
            .with_label_values(&[&i.route])
            .observe(i.overhead.as_secs_f64());
        if let Some(ttft) = self.ttft {
            m.ttft
                .with_label_values(&[&i.route, provider, &i.model])
                .observe(ttft.as_secs_f64());
        }
        // Usage: exact when the provider sent it, else an estimate for successful bodies.
        let usage = self.usage.or_else(|| {
            (i.status < 400 && served_upstream).then_some(Usage {
                input: (i.request_bytes / 4) as u64,
                cached_input: 0,
                output: if i.stream {
                    self.content_chunks
                } else {
                    (self.body_bytes / 4) as u64
                },
                reasoning: 0,
                estimated: true,
            })
        });
        if let Some(guard) = self.admission.take() {
            // A request that failed before any provider answered charged nothing; one that
            // was answered (even cut short) charged what it used, estimated if not reported.
            guard.settle(usage.map_or(0, |u| u.input.saturating_add(u.output)));
        }
        let mut cost = None;
        // Empty outside a cluster (Prometheus then shows no such label).
        let namespace = i.identity.namespace.as_deref().unwrap_or_default();
        let workload = i.identity.workload.as_deref().unwrap_or_default();
        if let Some(u) = &usage {
            for (kind, n) in [
                ("input", u.input),
                ("cached_input", u.cached_input),
                ("output", u.output),
                ("reasoning", u.reasoning),
            ] {
                if n > 0 {
                    m.tokens
                        .with_label_values(&[
                            &i.route, provider, &i.model, kind, namespace, workload,
                        ])
                        .inc_by(n);
                }
            }
            if let Some(price) = &i.price {
                let c = price.cost(u);
                m.cost
                    .with_label_values(&[&i.route, provider, &i.model, namespace, workload])
                    .inc_by(c.to_f64().unwrap_or(0.0));
                cost = Some(c);
            }
        }
        // What the context budget saved: the trimmed tokens at the serving provider's
        // input price (a request no provider served saved nothing).
        if let (Some(ctx), Some(price), true) = (&i.context, &i.price, served_upstream)
            && ctx.trimmed > 0
        {
            let saved = price.cost(&Usage {
                input: ctx.trimmed,
                cached_input: 0,
                output: 0,
                reasoning: 0,
                estimated: false,
            });
            m.cost_saved
                .with_label_values(&[
                    &i.route,
                    provider,
                    &i.model,
                    "context_trim",
                    namespace,
                    workload,
                ])
                .inc_by(saved.to_f64().unwrap_or(0.0));
        }
        // Time per output token: streams that ended well, from the first token on.
        if let (Some(ttft), Some(u), "2xx") = (self.ttft, &usage, class)
            && i.stream
            && u.output > 1
        {
            let per_token = total.saturating_sub(ttft).as_secs_f64() / (u.output - 1) as f64;
            m.tpot
                .with_label_values(&[&i.route, provider, &i.model])
                .observe(per_token);
        }
        if !i.slo.is_empty() {
            self.judge_slo(class, total);
        }
        if let Some(d) = &i.degrade
            && d.served
            && served_upstream
        {
            m.degraded_requests.with_label_values(&[&i.route]).inc();
        }
        // The normal tier's requests feed the degradation's SLO window: failures count as
        // misses; the client's own errors and departures say nothing about the tier.
        if let Some(d) = &i.degrade
            && !d.served
            && served_upstream
            && i.attempts > 0
            && !matches!(class, "client_closed" | "4xx")
        {
            let ttft_ok = match (i.slo.ttft, self.ttft) {
                (Some(target), Some(ttft)) => ttft <= target,
                _ => true,
            };
            let met = !matches!(class, "5xx" | "stream_error")
                && ttft_ok
                && i.slo.latency.is_none_or(|t| total <= t);
            d.machine
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(std::time::Instant::now(), met);
        }
        let error_type = match (self.outcome, &self.error_type) {
            (Outcome::InProgress, _) => Some("client_closed"),
            (_, Some(e)) => Some(e.as_str()),
            _ => None,
        };
        if !i.span.is_none() {
            telemetry::finish(
                &i.span,
                &i.attempt_span,
                &telemetry::Finish {
                    status: i.status,
                    provider: &i.provider,
                    response_model: self.response_model.as_deref(),
                    usage,
                    ttft: self.ttft,
                    attempts: i.attempts,
                    hedged: i.hedged,
                    error_type,
                    failed: matches!(class, "5xx" | "stream_error"),
                },
            );
        }
        let logged = super::access_log::emit("request", |l| {
            l.str("request_id", &i.request_id);
            l.str("route", &i.route);
            l.str("model", &i.model);
            l.str("provider", provider);
            l.str("provider_model", &i.provider_model);
            l.str("tier", i.tier.as_deref().unwrap_or(""));
            l.bool("stream", i.stream);
            l.u64("status", u64::from(i.status));
            l.u64("attempts", u64::from(i.attempts));
            l.bool("hedged", i.hedged);
            l.opt_f64("ttft_ms", self.ttft.map(|t| t.as_secs_f64() * 1000.0));
            l.f64("total_ms", total.as_secs_f64() * 1000.0);
            l.u64(
                "overhead_us",
                u64::try_from(i.overhead.as_micros()).unwrap_or(u64::MAX),
            );
            l.opt_u64("input_tokens", usage.map(|u| u.input));
            l.opt_u64("cached_input_tokens", usage.map(|u| u.cached_input));
            l.opt_u64("output_tokens", usage.map(|u| u.output));
            l.opt_u64("reasoning_tokens", usage.map(|u| u.reasoning));
            l.opt_bool("usage_estimated", usage.map(|u| u.estimated));
            l.opt_str("cost", cost.map(|c| c.normalize().to_string()).as_deref());
            l.opt_str("error_type", error_type);
            l.opt_str("cache", i.cache);
            l.opt_str("tenant", i.tenant.as_deref());
            l.opt_str("namespace", i.identity.namespace.as_deref());
            l.opt_str("pod", i.identity.pod.as_deref());
            l.opt_str("service_account", i.identity.service_account.as_deref());
            l.opt_str("workload_kind", i.identity.workload_kind.as_deref());
            l.opt_str("workload", i.identity.workload.as_deref());
            l.opt_u64("context_tokens", i.context.map(|c| c.tokens));
            l.opt_u64("context_trimmed_tokens", i.context.map(|c| c.trimmed));
            l.opt_u64(
                "context_dropped_messages",
                i.context.map(|c| c.dropped as u64),
            );
            l.opt_str("context_tokenizer", i.context.map(|c| c.tokenizer));
            l.opt_u64("priority", i.priority.map(u64::from));
            if let Some(d) = &i.degrade {
                l.bool("degraded", d.served);
                l.str("route_state", d.state.as_str());
            }
            if i.stream_fallback {
                l.str("stream_fallback", "non-stream");
            }
        });
        if !logged {
            m.access_log_dropped.inc();
        }
        // The GenAI client metrics describe calls to a provider: not cache hits or requests
        // refused before any attempt.
        if let Some(g) = &m.gen_ai
            && i.attempts > 0
            && i.cache != Some("hit")
        {
            let op = [i.operation, provider, i.model.as_str()];
            g.operation_duration
                .with_label_values(&[op[0], op[1], op[2], error_type.unwrap_or("")])
                .observe(total.as_secs_f64());
            if let (true, Some(ttft)) = (i.stream, self.ttft) {
                g.time_to_first_chunk
                    .with_label_values(&op)
                    .observe(ttft.as_secs_f64());
            }
            if let Some(u) = &usage {
                for (kind, n) in [("input", u.input), ("output", u.output)] {
                    g.token_usage
                        .with_label_values(&[op[0], op[1], op[2], kind])
                        .observe(n as f64);
                }
            }
        }
        // End the attempt's CLIENT span before the request's SERVER span.
        drop(std::mem::replace(
            &mut self.info.attempt_span,
            tracing::Span::none(),
        ));
    }
}

/// The recorder watches the response body: TTFT, usage and the model from the stream's
/// events, bytes for the estimate of a body without usage, and how the body ended.
impl Observer for Recorder {
    fn on_event(&mut self, event: &SseEvent) {
        self.on_sse_event(event);
    }

    fn on_chunk(&mut self, chunk: &bytes::Bytes) {
        self.add_body_bytes(chunk.len());
    }

    fn on_end(&mut self, end: End) {
        match end {
            End::Complete => self.finish_ok(),
            End::Failed(code) => self.fail_mid_stream(code),
        }
    }
}

impl Recorder {
    /// Counts the request against each objective of the route's `slo`.
    fn judge_slo(&self, class: &str, total: Duration) {
        let i = &self.info;
        let count = |objective: &str, met: bool| {
            i.metrics
                .slo_requests
                .with_label_values(&[&*i.route, objective, if met { "met" } else { "missed" }])
                .inc();
        };
        if i.slo.availability.is_some() && class != "client_closed" {
            count("availability", !matches!(class, "5xx" | "stream_error"));
        }
        if let (Some(target), Some(ttft)) = (i.slo.ttft, self.ttft) {
            count("ttft", ttft <= target);
        }
        if let (Some(target), "2xx") = (i.slo.latency, class) {
            count("latency", total <= target);
        }
    }
}
