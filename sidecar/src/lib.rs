//! tailwarden-sidecar: the data plane. An OpenAI-compatible loopback proxy that enforces
//! `InferenceRoute`s: pooled connections, streaming relay, per-phase deadlines,
//! latency-aware provider choice, safe retries, hedging, circuit breakers and fallback.
//!
//! Decisions are pure modules (`sse`, `breaker`, `balance`, `retry`, `hedge`, `request`);
//! I/O lives in `proxy`, `body`, `upstream`, `server`, `admin` and `reload`.

pub mod accounting;
pub mod admin;
pub mod balance;
pub mod body;
pub mod breaker;
pub mod cache;
pub mod capabilities;
pub mod dns;
pub mod error;
pub mod hedge;
pub mod limits;
pub mod metrics;
pub mod proxy;
pub mod redis_backend;
pub mod reload;
pub mod request;
pub mod retry;
pub mod routes;
pub mod semantic;
pub mod server;
pub mod shared_cache;
pub mod sse;
pub mod telemetry;
pub mod tiers;
pub mod upstream;
