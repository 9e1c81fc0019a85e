//! The `tailwarden-demo` binary in a shortened run against the real sidecar binary: it prints
//! the side-by-side table, the sidecar phase has fewer errors than the direct one, and
//! Ctrl-C leaves no sidecar process behind.
//!
//! The sidecar binary must sit next to the demo binary (as `make demo` arranges); these tests
//! build it with the same profile and target folder first, which is a no-op when it is
//! up to date. `TAILWARDEN_SIDECAR_BIN=PATH` uses that binary instead and skips the build.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DEMO: &str = env!("CARGO_BIN_EXE_tailwarden-demo");

/// Builds `tailwarden-sidecar` next to the demo binary and returns its path.
fn sidecar_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TAILWARDEN_SIDECAR_BIN") {
        return PathBuf::from(p);
    }
    let demo = Path::new(DEMO);
    let profile_dir = demo.parent().expect("binary folder");
    let target_dir = profile_dir.parent().expect("target folder");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "-q",
        "-p",
        "tailwarden-sidecar",
        "--bin",
        "tailwarden-sidecar",
    ])
    .arg("--target-dir")
    .arg(target_dir);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "building tailwarden-sidecar failed");
    let bin = profile_dir.join("tailwarden-sidecar");
    assert!(bin.is_file(), "{} missing after the build", bin.display());
    bin
}

fn workdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tw-demo-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s[i + 1..].split_whitespace().next().map(str::to_owned))
        })
        .is_some_and(|state| state != "Z")
}

#[test]
fn short_demo_prints_the_table_and_the_sidecar_has_fewer_errors() {
    let sidecar = sidecar_binary();
    let dir = workdir("short");
    let json = dir.join("out.json");
    let started = Instant::now();
    let out = Command::new(DEMO)
        .args([
            "--duration",
            "3s",
            "--rate",
            "40",
            "--timeout",
            "5s",
            "--quiet",
        ])
        .arg("--sidecar")
        .arg(&sidecar)
        .arg("--workdir")
        .arg(&dir)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed: {stderr}\n{stdout}");
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "took {:?}",
        started.elapsed()
    );
    for row in [
        "(a) direct",
        "(b) sidecar",
        "latency P50",
        "latency P99.9",
        "TTFT P99",
        "error rate",
        "throughput (ok)",
        "upstream amplification",
        "seed 42",
        "tailwarden-demo --rate 40 --duration 3s --seed 42",
    ] {
        assert!(stdout.contains(row), "missing {row:?} in:\n{stdout}");
    }

    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
            .expect("valid json");
    let errors = |phase: &str| {
        v[phase]["report"]["requests"]["errors"]
            .as_u64()
            .unwrap_or_else(|| panic!("{phase} errors in {v}"))
    };
    let sent = |phase: &str| v[phase]["report"]["requests"]["sent"].as_u64().unwrap_or(0);
    assert_eq!(sent("direct"), 120);
    assert_eq!(sent("sidecar"), 120);
    assert!(
        errors("sidecar") < errors("direct"),
        "sidecar {} errors vs direct {}:\n{stdout}",
        errors("sidecar"),
        errors("direct")
    );
    // The simulators counted the sidecar's upstream requests: at least one per request.
    let upstream: u64 = v["sidecar"]["upstream"]
        .as_array()
        .expect("upstream list")
        .iter()
        .filter_map(|e| e[1].as_u64())
        .sum();
    assert!(upstream >= 120, "upstream {upstream}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ctrl_c_prints_partial_results_and_leaves_no_sidecar() {
    let sidecar = sidecar_binary();
    let dir = workdir("sigint");
    let mut child = Command::new(DEMO)
        .args(["--duration", "3s", "--rate", "20", "--timeout", "60s"])
        .arg("--sidecar")
        .arg(&sidecar)
        .arg("--workdir")
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the demo");
    // Phase (b) announces the sidecar's pid; with a 60 s client timeout the demo then waits
    // for phase (a)'s stalled requests, which is where we interrupt it.
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut pid = None;
    for line in lines.by_ref() {
        let line = line.expect("read stderr");
        if let Some(rest) = line.split("(pid ").nth(1) {
            pid = rest
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|p| p.parse::<u32>().ok());
            if line.starts_with("phase (b)") {
                break;
            }
        }
    }
    let pid = pid.expect("phase (b) line with the sidecar pid");
    assert!(process_alive(pid), "sidecar {pid} running during phase (b)");
    std::thread::sleep(Duration::from_millis(300));
    let status = Command::new("kill")
        .args(["-s", "INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    // Keep draining stderr so the demo never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let deadline = Instant::now() + Duration::from_secs(15);
    let code = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s.code();
        }
        assert!(Instant::now() < deadline, "demo did not exit after SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut out, &mut stdout);
    }
    assert_eq!(code, Some(130), "exit code after SIGINT; stdout:\n{stdout}");
    assert!(
        stdout.contains("INTERRUPTED"),
        "partial table printed:\n{stdout}"
    );
    assert!(
        !process_alive(pid),
        "sidecar {pid} still alive after the demo exited"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
