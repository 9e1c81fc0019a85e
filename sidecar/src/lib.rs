//! tailwarden sidecar library: the data plane.
pub mod breaker;
pub mod sse;
