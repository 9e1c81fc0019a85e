//! tailwarden-sidecar binary.
fn main() {}
