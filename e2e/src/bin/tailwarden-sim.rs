//! tailwarden-sim
fn main() {}
