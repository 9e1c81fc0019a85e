//! Prometheus metrics of the data plane, served on the admin port.
//!
//! Labels are bounded: route, provider, model (client-facing, from the config), status
//! class and small enums. Nothing per request or per tenant, so cardinality stays fixed.
//! Tokens and cost also carry the workload the sidecar serves (`namespace`, `workload`: one
//! value per sidecar, per workload rather than per pod), so cost can be charged back.
//! Latency buckets run from 5 ms to 600 s because LLM calls routinely take minutes.

use prometheus::{
    CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use tailwarden_decide::breaker::State;

/// `tailwarden_circuit_breaker_state`: 0 closed, 1 half-open, 2 open.
pub fn breaker_gauge(state: State) -> i64 {
    match state {
        State::Closed => 0,
        State::HalfOpen => 1,
        State::Open => 2,
    }
}

/// Buckets for request, attempt and time-to-first-token durations.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];
/// Buckets for the sidecar's own overhead: microseconds to tens of milliseconds.
pub const OVERHEAD_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,
];

/// Buckets for the time per output token of a stream (after the first): 1 ms to 2.5 s,
/// the OpenTelemetry GenAI advice with a finer low end for fast models.
pub const TPOT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];

/// `gen_ai.client.token.usage` buckets, the OpenTelemetry GenAI conventions' advice.
pub const GEN_AI_TOKEN_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];
/// `gen_ai.client.operation.duration` and `…time_to_first_chunk` buckets, the conventions'
/// advice.
pub const GEN_AI_DURATION_BUCKETS: &[f64] = &[
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// The value of `OTEL_SEMCONV_STABILITY_OPT_IN` that asks for the GenAI conventions' current
/// (experimental) metrics.
pub const GEN_AI_OPT_IN: &str = "gen_ai_latest_experimental";

/// Whether `OTEL_SEMCONV_STABILITY_OPT_IN` (a comma-separated list) opts in to them.
pub fn gen_ai_opted_in(opt_in: Option<&str>) -> bool {
    opt_in.is_some_and(|v| v.split(',').any(|c| c.trim() == GEN_AI_OPT_IN))
}

/// The OpenTelemetry GenAI client metrics, in Prometheus form, exported beside the
/// `tailwarden_*` ones when opted in. Labels are the conventions' attributes the sidecar
/// knows from its config (never the provider-sent response model, which is unbounded).
pub struct GenAiMetrics {
    /// `gen_ai.client.token.usage`: tokens per call, by `gen_ai.token.type`.
    pub token_usage: HistogramVec,
    /// `gen_ai.client.operation.duration`, with `error.type` on failures.
    pub operation_duration: HistogramVec,
    /// `gen_ai.client.operation.time_to_first_chunk`: streamed calls only.
    pub time_to_first_chunk: HistogramVec,
}

impl GenAiMetrics {
    fn new() -> prometheus::Result<Self> {
        const OP: &[&str] = &[
            "gen_ai_operation_name",
            "gen_ai_provider_name",
            "gen_ai_request_model",
        ];
        Ok(Self {
            token_usage: histogram(
                "gen_ai_client_token_usage",
                "Tokens used per GenAI call, by gen_ai_token_type (input includes cached input); OpenTelemetry gen_ai.client.token.usage.",
                &[OP, &["gen_ai_token_type"]].concat(),
                GEN_AI_TOKEN_BUCKETS,
            )?,
            operation_duration: histogram(
                "gen_ai_client_operation_duration_seconds",
                "GenAI call duration, arrival to the last byte; OpenTelemetry gen_ai.client.operation.duration.",
                &[OP, &["error_type"]].concat(),
                GEN_AI_DURATION_BUCKETS,
            )?,
            time_to_first_chunk: histogram(
                "gen_ai_client_operation_time_to_first_chunk_seconds",
                "Arrival to the first content chunk of a streamed GenAI call; OpenTelemetry gen_ai.client.operation.time_to_first_chunk.",
                OP,
                GEN_AI_DURATION_BUCKETS,
            )?,
        })
    }
}

/// All metrics of one sidecar process.
pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub ttft: HistogramVec,
    pub tpot: HistogramVec,
    pub attempt_duration: HistogramVec,
    pub overhead: HistogramVec,
    pub retries: IntCounterVec,
    pub hedges: IntCounterVec,
    pub breaker_state: IntGaugeVec,
    pub breaker_transitions: IntCounterVec,
    pub tokens: IntCounterVec,
    pub cost: CounterVec,
    pub in_flight: IntGaugeVec,
    pub slo_requests: IntCounterVec,
    pub slo_objective: GaugeVec,
    pub connections_in_use: IntGaugeVec,
    pub connections_max: IntGaugeVec,
    pub config_reloads: IntCounterVec,
    pub config_valid: IntGauge,
    pub tier_requests: IntCounterVec,
    pub capability_actions: IntCounterVec,
    pub admission_rejected: IntCounterVec,
    pub queue_wait: HistogramVec,
    pub queue_shed: IntCounterVec,
    pub stream_fallbacks: IntCounterVec,
    pub route_state: IntGaugeVec,
    pub route_state_transitions: IntCounterVec,
    pub degraded_requests: IntCounterVec,
    pub stream_fallback_active: IntGaugeVec,
    /// By `reason` ([`crate::state::redis::BackendError::reason`]).
    pub limit_backend_errors: IntCounterVec,
    pub cache_backend_errors: IntCounterVec,
    /// Access-log lines dropped because stderr did not keep up ([`super::access_log`]).
    pub access_log_dropped: IntCounter,
    pub cache_requests: IntCounterVec,
    pub semantic_requests: IntCounterVec,
    pub cache_entries: IntGaugeVec,
    pub cache_bytes: IntGaugeVec,
    pub passthrough_requests: IntCounterVec,
    pub passthrough_duration: HistogramVec,
    /// The GenAI conventions' metrics, when `OTEL_SEMCONV_STABILITY_OPT_IN` asks for them.
    pub gen_ai: Option<GenAiMetrics>,
    pub context_requests: IntCounterVec,
    pub context_trimmed_tokens: IntCounterVec,
    pub cost_saved: CounterVec,
    /// Serialises the per-config series' reset-and-set against each other
    /// ([`crate::config::series`]).
    pub series_lock: std::sync::Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn histogram(
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> prometheus::Result<HistogramVec> {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
}

/// A shared backend's failure counter by `reason`, every reason exported from the start (at
/// 0), so alerts and dashboards see the series before the first failure.
fn backend_errors(name: &str, help: &str) -> prometheus::Result<IntCounterVec> {
    let vec = IntCounterVec::new(Opts::new(name, help), &["reason"])?;
    for reason in crate::state::redis::BackendError::REASONS {
        vec.with_label_values(&[reason]);
    }
    Ok(vec)
}

impl Metrics {
    /// The metrics, with the GenAI ones when `OTEL_SEMCONV_STABILITY_OPT_IN` opts in.
    pub fn new() -> prometheus::Result<Self> {
        let opt_in = std::env::var("OTEL_SEMCONV_STABILITY_OPT_IN").ok();
        Self::with_gen_ai(gen_ai_opted_in(opt_in.as_deref()))
    }

    /// The metrics, with or without the GenAI conventions' ones.
    pub fn with_gen_ai(gen_ai: bool) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new("tailwarden_requests_total", "Client requests by outcome."),
                &["route", "provider", "model", "status_class"],
            )?,
            request_duration: histogram(
                "tailwarden_request_duration_seconds",
                "Client request duration, from arrival to the last byte of the response.",
                &["route", "provider", "model", "status_class"],
                LATENCY_BUCKETS,
            )?,
            ttft: histogram(
                "tailwarden_time_to_first_token_seconds",
                "Time from arrival to the first content token of a streamed response.",
                &["route", "provider", "model"],
                LATENCY_BUCKETS,
            )?,
            tpot: histogram(
                "tailwarden_time_per_output_token_seconds",
                "Time per output token of a streamed response after the first: (total - TTFT) / (output tokens - 1).",
                &["route", "provider", "model"],
                TPOT_BUCKETS,
            )?,
            attempt_duration: histogram(
                "tailwarden_upstream_attempt_duration_seconds",
                "Duration of each upstream attempt until its first byte or failure.",
                &["route", "provider", "outcome"],
                LATENCY_BUCKETS,
            )?,
            overhead: histogram(
                "tailwarden_overhead_seconds",
                "Time the sidecar itself spent on a request: parsing, routing and relaying, excluding waiting on providers.",
                &["route"],
                OVERHEAD_BUCKETS,
            )?,
            retries: IntCounterVec::new(
                Opts::new(
                    "tailwarden_retries_total",
                    "Retried attempts by the failure that caused them.",
                ),
                &["route", "provider", "reason"],
            )?,
            hedges: IntCounterVec::new(
                Opts::new(
                    "tailwarden_hedges_total",
                    "Hedged attempts by outcome (started, won, lost).",
                ),
                &["route", "outcome"],
            )?,
            breaker_state: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_circuit_breaker_state",
                    "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
                ),
                &["route", "provider"],
            )?,
            breaker_transitions: IntCounterVec::new(
                Opts::new(
                    "tailwarden_circuit_breaker_transitions_total",
                    "Circuit breaker transitions.",
                ),
                &["route", "provider", "to", "reason"],
            )?,
            tokens: IntCounterVec::new(
                Opts::new(
                    "tailwarden_tokens_total",
                    "Tokens by type (input, cached_input, output, reasoning), and the workload the sidecar serves.",
                ),
                &[
                    "route",
                    "provider",
                    "model",
                    "type",
                    "namespace",
                    "workload",
                ],
            )?,
            cost: CounterVec::new(
                Opts::new(
                    "tailwarden_cost_total",
                    "Cost of requests in the pricing's currency units, and the workload the sidecar serves.",
                ),
                &["route", "provider", "model", "namespace", "workload"],
            )?,
            in_flight: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_in_flight_requests",
                    "Client requests in progress.",
                ),
                &["route"],
            )?,
            slo_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_slo_requests_total",
                    "Requests judged against each objective of the route's slo (ttft, latency, availability), by outcome (met, missed).",
                ),
                &["route", "objective", "outcome"],
            )?,
            slo_objective: GaugeVec::new(
                Opts::new(
                    "tailwarden_slo_objective_ratio",
                    "Share of requests that must meet each objective of the route's slo: 0.99 for the P99 targets, availabilityPercent / 100.",
                ),
                &["route", "objective"],
            )?,
            connections_in_use: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_upstream_connections_in_use",
                    "Requests holding one of the provider's maxConnections slots (for HTTP/1, its connections in use); sampled at scrape.",
                ),
                &["route", "provider"],
            )?,
            connections_max: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_upstream_connections_max",
                    "The provider's maxConnections.",
                ),
                &["route", "provider"],
            )?,
            config_reloads: IntCounterVec::new(
                Opts::new(
                    "tailwarden_config_reloads_total",
                    "Config file loads by result (ok, invalid).",
                ),
                &["result"],
            )?,
            config_valid: IntGauge::new(
                "tailwarden_config_last_load_valid",
                "1 when the last config file load was valid, 0 when the sidecar kept an older config.",
            )?,
            tier_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_tier_requests_total",
                    "Requests by the tier their content selected (spec.tiers).",
                ),
                &["route", "tier"],
            )?,
            capability_actions: IntCounterVec::new(
                Opts::new(
                    "tailwarden_capability_actions_total",
                    "Attempts whose parameters a provider's capability rules changed: dropped (sent without them) or rejected (not sent to that provider).",
                ),
                &["route", "provider", "action"],
            )?,
            admission_rejected: IntCounterVec::new(
                Opts::new(
                    "tailwarden_rate_limited_total",
                    "Requests refused by the route's admission limits, by limit (requests_per_second, tokens_per_minute, concurrency, backend), scope (route, tenant) and status (429 over a rate, 503 shed for overload).",
                ),
                &["route", "limit", "scope", "status"],
            )?,
            queue_shed: IntCounterVec::new(
                Opts::new(
                    "tailwarden_queue_shed_total",
                    "Requests of routes with rateLimit.priority refused by a concurrency queue, by their priority and why: full (the queue held only requests at least as important), displaced (gave its place to a more important request), timeout (no slot within queueTimeout).",
                ),
                &["route", "priority", "reason"],
            )?,
            route_state: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_route_state",
                    "The degradation state of routes with a degradation: 1 for the current state (healthy, degraded, recovering), 0 for the others.",
                ),
                &["route", "state"],
            )?,
            route_state_transitions: IntCounterVec::new(
                Opts::new(
                    "tailwarden_route_state_transitions_total",
                    "Degradation state changes of routes, by the state entered and why (slo_burn, unavailable, manual; recovered for the way back).",
                ),
                &["route", "to", "reason"],
            )?,
            degraded_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_degraded_requests_total",
                    "Requests served by the route's degradation target (its degraded model and providers).",
                ),
                &["route"],
            )?,
            stream_fallbacks: IntCounterVec::new(
                Opts::new(
                    "tailwarden_stream_fallbacks_total",
                    "Stream requests answered by a plain (non-stream) call replayed as an event stream, because the provider's streams kept failing before their first content (streaming.fallback).",
                ),
                &["route", "provider"],
            )?,
            stream_fallback_active: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_stream_fallback_active",
                    "1 while a provider's stream requests are served by plain calls (streaming.fallback), else 0; routes with the fallback only.",
                ),
                &["route", "provider"],
            )?,
            queue_wait: histogram(
                "tailwarden_queue_wait_seconds",
                "Time admitted requests waited for a concurrency slot (rateLimit.maxConcurrent).",
                &["route"],
                OVERHEAD_BUCKETS,
            )?,
            limit_backend_errors: backend_errors(
                "tailwarden_rate_limit_backend_errors_total",
                "Failed calls to the shared rate-limit backend (Redis), by reason; requests then follow rateLimit.redis.failMode.",
            )?,
            cache_backend_errors: backend_errors(
                "tailwarden_cache_backend_errors_total",
                "Failed or timed-out calls to the shared cache backend (Redis), by reason; lookups then miss.",
            )?,
            access_log_dropped: IntCounter::new(
                "tailwarden_access_log_dropped_total",
                "Access-log lines dropped because stderr did not keep up.",
            )?,
            cache_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_cache_requests_total",
                    "Requests of routes with a cache, by result: hit, miss, bypass (not cacheable or the client opted out).",
                ),
                &["route", "result"],
            )?,
            semantic_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_semantic_cache_requests_total",
                    "Requests of routes with a semantic cache that reached it, by result: hit, miss, refused (a near match the guards turned down), error (the embeddings call failed).",
                ),
                &["route", "result"],
            )?,
            passthrough_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_passthrough_requests_total",
                    "Requests to the rest of /v1 (files, batches, audio, images, ...) passed through to a provider, by endpoint family and status class.",
                ),
                &["route", "provider", "endpoint", "status_class"],
            )?,
            passthrough_duration: histogram(
                "tailwarden_passthrough_duration_seconds",
                "Time from a passed-through request's arrival to the provider's response headers, by endpoint family.",
                &["route", "endpoint"],
                LATENCY_BUCKETS,
            )?,
            cache_entries: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_cache_entries",
                    "Responses held in the route's cache; sampled at scrape.",
                ),
                &["route"],
            )?,
            cache_bytes: IntGaugeVec::new(
                Opts::new(
                    "tailwarden_cache_bytes",
                    "Weight of the route's cache entries in bytes (at least maxBytes / maxEntries each); sampled at scrape.",
                ),
                &["route"],
            )?,
            gen_ai: gen_ai.then(GenAiMetrics::new).transpose()?,
            context_requests: IntCounterVec::new(
                Opts::new(
                    "tailwarden_context_requests_total",
                    "Chat requests of routes with a contextBudget, by what the budget did: within, trimmed, rejected (400).",
                ),
                &["route", "result"],
            )?,
            context_trimmed_tokens: IntCounterVec::new(
                Opts::new(
                    "tailwarden_context_trimmed_tokens_total",
                    "Input tokens the context budget trimmed from chat histories before they went upstream.",
                ),
                &["route"],
            )?,
            cost_saved: CounterVec::new(
                Opts::new(
                    "tailwarden_cost_saved_total",
                    "Cost avoided, in the pricing's currency units, by reason (context_trim: trimmed input tokens at the serving provider's input price), and the workload the sidecar serves.",
                ),
                &[
                    "route",
                    "provider",
                    "model",
                    "reason",
                    "namespace",
                    "workload",
                ],
            )?,
            series_lock: std::sync::Mutex::new(()),
            registry,
        };
        if let Some(g) = &m.gen_ai {
            m.registry.register(Box::new(g.token_usage.clone()))?;
            m.registry
                .register(Box::new(g.operation_duration.clone()))?;
            m.registry
                .register(Box::new(g.time_to_first_chunk.clone()))?;
        }
        m.registry.register(Box::new(m.requests.clone()))?;
        m.registry
            .register(Box::new(m.passthrough_requests.clone()))?;
        m.registry
            .register(Box::new(m.passthrough_duration.clone()))?;
        m.registry.register(Box::new(m.request_duration.clone()))?;
        m.registry.register(Box::new(m.ttft.clone()))?;
        m.registry.register(Box::new(m.tpot.clone()))?;
        m.registry.register(Box::new(m.attempt_duration.clone()))?;
        m.registry.register(Box::new(m.overhead.clone()))?;
        m.registry.register(Box::new(m.retries.clone()))?;
        m.registry.register(Box::new(m.hedges.clone()))?;
        m.registry.register(Box::new(m.breaker_state.clone()))?;
        m.registry
            .register(Box::new(m.breaker_transitions.clone()))?;
        m.registry.register(Box::new(m.tokens.clone()))?;
        m.registry.register(Box::new(m.cost.clone()))?;
        m.registry.register(Box::new(m.in_flight.clone()))?;
        m.registry.register(Box::new(m.slo_requests.clone()))?;
        m.registry.register(Box::new(m.slo_objective.clone()))?;
        m.registry
            .register(Box::new(m.connections_in_use.clone()))?;
        m.registry.register(Box::new(m.connections_max.clone()))?;
        m.registry.register(Box::new(m.config_reloads.clone()))?;
        m.registry.register(Box::new(m.config_valid.clone()))?;
        m.registry.register(Box::new(m.tier_requests.clone()))?;
        m.registry
            .register(Box::new(m.capability_actions.clone()))?;
        m.registry
            .register(Box::new(m.admission_rejected.clone()))?;
        m.registry.register(Box::new(m.queue_wait.clone()))?;
        m.registry.register(Box::new(m.queue_shed.clone()))?;
        m.registry.register(Box::new(m.stream_fallbacks.clone()))?;
        m.registry.register(Box::new(m.route_state.clone()))?;
        m.registry
            .register(Box::new(m.route_state_transitions.clone()))?;
        m.registry.register(Box::new(m.degraded_requests.clone()))?;
        m.registry
            .register(Box::new(m.stream_fallback_active.clone()))?;
        m.registry
            .register(Box::new(m.limit_backend_errors.clone()))?;
        m.registry.register(Box::new(m.cache_requests.clone()))?;
        m.registry.register(Box::new(m.semantic_requests.clone()))?;
        m.registry
            .register(Box::new(m.cache_backend_errors.clone()))?;
        m.registry
            .register(Box::new(m.access_log_dropped.clone()))?;
        m.registry.register(Box::new(m.cache_entries.clone()))?;
        m.registry.register(Box::new(m.cache_bytes.clone()))?;
        m.registry.register(Box::new(m.context_requests.clone()))?;
        m.registry
            .register(Box::new(m.context_trimmed_tokens.clone()))?;
        m.registry.register(Box::new(m.cost_saved.clone()))?;
        Ok(m)
    }

    /// The text exposition format.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 * 1024);
        // Encoding into a Vec only fails on inconsistent metric families, which
        // registration already rules out; an empty page is the safe answer then.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_gen_ai_metrics_are_exported_only_when_opted_in() {
        assert!(!gen_ai_opted_in(None));
        assert!(!gen_ai_opted_in(Some("http")));
        assert!(gen_ai_opted_in(Some("gen_ai_latest_experimental")));
        assert!(gen_ai_opted_in(Some("http, gen_ai_latest_experimental")));
        let off = Metrics::with_gen_ai(false).unwrap();
        assert!(off.gen_ai.is_none());
        let on = Metrics::with_gen_ai(true).unwrap();
        let g = on.gen_ai.as_ref().unwrap();
        g.token_usage
            .with_label_values(&["chat", "openai", "gpt-4.1", "input"])
            .observe(12.0);
        g.operation_duration
            .with_label_values(&["chat", "openai", "gpt-4.1", ""])
            .observe(0.5);
        g.time_to_first_chunk
            .with_label_values(&["chat", "openai", "gpt-4.1"])
            .observe(0.1);
        let text = String::from_utf8(on.render()).unwrap();
        for name in [
            "# TYPE gen_ai_client_token_usage histogram",
            "# TYPE gen_ai_client_operation_duration_seconds histogram",
            "# TYPE gen_ai_client_operation_time_to_first_chunk_seconds histogram",
            "gen_ai_client_token_usage_bucket{gen_ai_operation_name=\"chat\",gen_ai_provider_name=\"openai\",gen_ai_request_model=\"gpt-4.1\",gen_ai_token_type=\"input\",le=\"16\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing:\n{text}");
        }
        assert!(!String::from_utf8(off.render()).unwrap().contains("gen_ai_"));
    }
}
