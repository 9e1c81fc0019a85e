//! tailwarden-sidecar: the data plane. An OpenAI-compatible loopback proxy that enforces
//! `InferenceRoute`s: pooled connections, streaming relay, per-phase deadlines,
//! latency-aware provider choice, safe retries, hedging, circuit breakers and fallback.
//!
//! The folders follow a request in the order it walks the path:
//!
//! | module | what happens there |
//! |---|---|
//! | [`ingress`] | read the body, parse its top level, pick the route and tier; build the response |
//! | [`policy`] | exact cache, admission limits, semantic cache, provider capabilities |
//! | [`attempts`] | the attempt scheduler's driver and the one upstream call (retries, hedges, fallback) |
//! | [`relay`] | the response body: relay, SSE handling, deadlines, and the observers that watch it |
//! | [`record`] | metrics, spans, usage and cost, the access log |
//!
//! Beside the path: [`app`] (the shared state and the per-request context, config
//! reload), [`config`] (routes compiled into immutable tables), [`state`] (what outlives a
//! config: breakers, cool-downs, EWMA, TTFT quantiles, budgets, pools, limiters, caches) and
//! [`server`] (the listeners, the admin port).
//!
//! Every decision is pure code in the `tailwarden-decide` crate (request parsing, tiers,
//! capabilities, cache keys, semantic guards, token buckets, breakers, balancing, retries,
//! hedging, the attempt scheduler, the SSE scanner); this crate is the I/O around it. No
//! top-level module imports one listed above it in this order: server, ingress, policy,
//! attempts, app, config, record, state, relay (`tests/architecture.rs`).

pub mod app;
pub mod attempts;
pub mod config;
pub mod ingress;
pub mod policy;
pub mod record;
pub mod relay;
pub mod server;
pub mod state;
