//! tailwarden-sidecar: the data plane. An OpenAI-compatible loopback proxy that enforces
//! `InferenceRoute`s: pooled connections, streaming relay, per-phase deadlines,
//! latency-aware provider choice, safe retries, hedging, circuit breakers and fallback.
//!
//! Decisions are pure code in the `tailwarden-decide` crate (request parsing, tiers,
//! capabilities, cache keys, semantic guards, token buckets, breakers, balancing, retries,
//! hedging, the SSE scanner); this crate is the I/O around them.

pub mod accounting;
pub mod admin;
pub mod body;
pub mod cache;
pub mod dns;
pub mod limits;
pub mod metrics;
pub mod proxy;
pub mod redis_backend;
pub mod reload;
pub mod routes;
pub mod semantic;
pub mod server;
pub mod shared_cache;
pub mod state;
pub mod telemetry;
pub mod upstream;
