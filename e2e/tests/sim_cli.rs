//! The `tailwarden-sim` binary: startup line with the real port, and profile errors.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

const SIM: &str = env!("CARGO_BIN_EXE_tailwarden-sim");

/// Kills the child even when an assertion fails.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prints_listening_with_the_real_port_and_serves() {
    let child = Command::new(SIM)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--profile",
            "realistic",
            "--seed",
            "9",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn sim");
    let mut child = Child(child);
    let stdout = child.0.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("a line");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    assert!(!addr.ends_with(":0"), "real port printed: {addr}");

    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}

fn run_with_profile(contents: &str, name: &str) -> (i32, String) {
    let path = std::env::temp_dir().join(format!("tw-sim-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).expect("write profile");
    let out = Command::new(SIM)
        .args(["--listen", "127.0.0.1:0", "--profile"])
        .arg(&path)
        .output()
        .expect("run sim");
    let _ = std::fs::remove_file(&path);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn malformed_profiles_fail_with_one_clear_message() {
    let cases = [
        // (file contents, file name, text the message must contain)
        (
            "ttft: {lognormal: {medianMs: 100, p99MS: 900}}\n",
            "typo.yaml",
            "ttft.lognormal.p99MS",
        ),
        ("itl: {gaussian: {ms: 3}}\n", "kind.yaml", "itl.gaussian"),
        ("error5xxPercent: lots\n", "type.yaml", "error5xxPercent"),
        (
            "ttft: {uniform: {minMs: 9, maxMs: 1}}\n",
            "range.yaml",
            "minMs",
        ),
        (
            "stallPercent: 60\nresetPercent: 60\n",
            "sum.yaml",
            "add up to 120",
        ),
        ("ttft: [\n", "syntax.yaml", "syntax.yaml"),
    ];
    for (contents, name, needle) in cases {
        let (code, stderr) = run_with_profile(contents, name);
        assert_eq!(code, 2, "{name}: exit code, stderr {stderr:?}");
        assert!(stderr.contains(name), "{name}: names the file: {stderr:?}");
        assert!(
            stderr.contains(needle),
            "{name}: names the problem: {stderr:?}"
        );
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "{name}: one line: {stderr:?}"
        );
        assert!(!stderr.contains("panicked"), "{name}: {stderr:?}");
    }
    let out = Command::new(SIM)
        .args(["--listen", "127.0.0.1:0", "--profile", "no-such-profile"])
        .output()
        .expect("run sim");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown profile 'no-such-profile'"),
        "{stderr}"
    );
}
