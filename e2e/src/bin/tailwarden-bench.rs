//! tailwarden-bench
fn main() {}
