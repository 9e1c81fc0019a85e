//! Test and measurement tools for tailwarden.
//!
//! * [`sim`] — `tailwarden-sim`, a fake OpenAI-compatible provider whose latency and faults
//!   follow a profile, so the sidecar can be tested against tails it cannot get on demand
//!   from a real provider.
//! * [`bench`] — `tailwarden-bench`, an open-loop load generator that reports latency, TTFT
//!   and inter-token percentiles measured from each request's *scheduled* start.
//! * [`duration`] — the `10s` / `500ms` / `2m` duration syntax both command lines share.
//!
//! The binaries in `src/bin` are thin wrappers; everything is a library so tests and the
//! future `make demo` program can run both tools in-process.

pub mod bench;
pub mod duration;
pub mod sim;
