//! tailwarden sidecar library: the data plane.
pub mod sse;
