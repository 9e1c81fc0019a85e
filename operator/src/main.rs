//! tailwarden-operator binary.
fn main() {}
