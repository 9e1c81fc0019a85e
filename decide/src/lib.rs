//! tailwarden-decide: every decision of the sidecar's request path as pure code.
//!
//! Nothing in this crate does I/O, reads a clock or owns a runtime: time comes in as
//! `std::time::Instant` arguments, randomness as fractions or an `Rng` the caller passes, and
//! every answer is a value. The sidecar (`tailwarden-sidecar`) is the I/O around it. That
//! "pure" is a fact the compiler checks: this crate depends on no HTTP client or server, no
//! async runtime, no Redis client and no metrics library (`tests/purity.rs`).
//!
//! In the order a request meets them:
//!
//! | module | decides |
//! |---|---|
//! | [`encoding`] | which `Content-Encoding` of a request body is decoded; 415/400/413 otherwise |
//! | [`request`] | what the client's JSON body says (top level only) and how to rewrite it |
//! | [`passthrough`] | the rest of `/v1`: safe paths, where each request goes, what may be resent |
//! | [`error`] | the OpenAI-shaped error a refused request gets (plain data) |
//! | [`tiers`] | which content tier (and so which model) a request falls in |
//! | [`context`] | which turns of a chat fit its token budget (real BPE counts for OpenAI models) |
//! | [`cache_key`] | the exact cache's key and the client's cache directives |
//! | [`semantic`] | what the semantic cache compares, and the guards against a flipped answer |
//! | [`bucket`] | token buckets (GCRA) of the admission limits |
//! | [`priority`] | who gets the next concurrency slot and who is shed (priorities, starvation bound) |
//! | [`capabilities`] | which parameters a provider takes, drops or refuses |
//! | [`schedule`] | the attempt scheduler: when to start, retry, hedge, wait or give up |
//! | [`degrade`] | when a route serves its degraded target: SLO burn window, Healthy → Degraded → Recovering with hysteresis |
//! | [`route`] | the route's providers as the scheduler sees them, and what attempts teach |
//! | [`balance`] | which provider an attempt goes to (tiers, weights, P2C over peak-EWMA) |
//! | [`breaker`] | whether a provider is in rotation (Closed → Open → HalfOpen) |
//! | [`retry`] | which failures are retried, backoff, `Retry-After`, retry budgets |
//! | [`hedge`] | the hedge delay, its budget, and the TTFT quantiles it learns from |
//! | [`sse`] | what a stream says as it passes (TTFT, usage, errors, `[DONE]`), the commit rule |
//! | [`stream_fallback`] | when a provider's failing streams are served by plain calls, and that answer as a stream |
//! | [`responses`] | the Responses API's events: content, terminal events, usage, ids, error events |
//! | [`usage`] | tokens and cost of a response |

pub mod balance;
pub mod breaker;
pub mod bucket;
pub mod cache_key;
pub mod capabilities;
pub mod context;
pub mod degrade;
pub mod encoding;
pub mod error;
pub mod hedge;
pub mod passthrough;
pub mod priority;
pub mod request;
pub mod responses;
pub mod retry;
pub mod route;
pub mod schedule;
pub mod semantic;
pub mod sse;
pub mod stream_fallback;
pub mod tiers;
pub mod usage;
