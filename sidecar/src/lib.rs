//! tailwarden sidecar library: the data plane.
pub mod balance;
pub mod breaker;
pub mod hedge;
pub mod retry;
pub mod sse;
