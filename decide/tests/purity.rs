//! "Pure" is a fact the build checks: nothing `tailwarden-decide` depends on, directly or
//! through other crates, is an HTTP stack, an async runtime, a Redis client or a metrics
//! library — asked of cargo itself (`cargo tree -p tailwarden-decide -e normal`), which
//! resolves the dependencies and features this crate builds with.

use std::process::Command;

/// Crates that would mean I/O or a runtime in the decision code.
const FORBIDDEN: &[&str] = &[
    "hyper",
    "hyper-util",
    "h2",
    "tokio",
    "mio",
    "redis",
    "prometheus",
    "opentelemetry",
];

#[test]
fn the_decision_crate_depends_on_no_io_runtime_or_metrics_crate() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "tailwarden-decide",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--no-dedupe",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for forbidden in FORBIDDEN {
        assert!(
            !crates.contains(forbidden),
            "tailwarden-decide depends on {forbidden}:\n{tree}"
        );
    }
    // The tree is the real one (the command printed this crate's dependencies).
    for expected in ["tailwarden-decide", "serde", "http", "tailwarden-crds"] {
        assert!(crates.contains(&expected), "{expected} missing:\n{tree}");
    }
}
