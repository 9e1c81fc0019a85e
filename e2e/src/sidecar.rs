//! Running the real `tailwarden-sidecar` binary as a child process, as users run it
//! standalone: `tailwarden-sidecar --config FILE --listen 127.0.0.1:0 --admin 127.0.0.1:0`.
//!
//! The demo and the benchmark measure the shipped binary rather than the library in-process,
//! so its own runtime, allocator and logging are what gets measured. Ports are chosen by the
//! OS (port 0) and read back from the `listening on ADDR admin ADDR` line on stdout.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::fetch;
use crate::proc::{ChildProc, ProcError};

/// The binary's file name.
pub const SIDECAR_BIN: &str = "tailwarden-sidecar";

/// Why the sidecar could not be found or started.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    /// No binary next to the running executable (nor where `--sidecar` pointed).
    #[error(
        "cannot find the sidecar binary at {0}: build it first (`cargo build --release -p tailwarden-sidecar`) or pass --sidecar PATH"
    )]
    NotFound(String),
    /// Starting or waiting failed.
    #[error(transparent)]
    Proc(#[from] ProcError),
}

/// Where the sidecar binary is: `explicit` if given, else next to the current executable
/// (cargo puts all binaries of a profile in the same folder, e.g. `target/release/`).
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf, SidecarError> {
    let path = match explicit {
        Some(p) => p.to_owned(),
        None => std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join(SIDECAR_BIN)))
            .unwrap_or_else(|| PathBuf::from(SIDECAR_BIN)),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(SidecarError::NotFound(path.display().to_string()))
    }
}

/// A running sidecar; dropping it stops the process.
#[derive(Debug)]
pub struct Sidecar {
    proc: ChildProc,
    /// Client listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
}

impl Sidecar {
    /// Starts `binary` with `config`, logs (JSON) to `log`, and waits until it is ready
    /// (`/readyz` answers 200).
    pub fn start(binary: &Path, config: &Path, log: &Path) -> Result<Self, SidecarError> {
        Self::start_with_env(binary, config, log, &[])
    }

    /// [`Sidecar::start`] with extra environment variables.
    pub fn start_with_env(
        binary: &Path,
        config: &Path,
        log: &Path,
        env: &[(&str, &str)],
    ) -> Result<Self, SidecarError> {
        let mut cmd = Command::new(binary);
        cmd.envs(env.iter().copied());
        cmd.arg("--config")
            .arg(config)
            .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--log-format", "json"]);
        let mut proc = ChildProc::spawn("tailwarden-sidecar", &cmd, log)?;
        let (listen, admin) = proc.wait_for_line(
            "the `listening on ADDR admin ADDR` line",
            Duration::from_secs(15),
            parse_listening_line,
        )?;
        proc.wait_until(
            &format!("GET http://{admin}/readyz to answer 200"),
            Duration::from_secs(15),
            || fetch::get(admin, "/readyz", Duration::from_secs(1)).is_ok_and(|r| r.status == 200),
        )?;
        Ok(Self {
            proc,
            listen,
            admin,
        })
    }

    /// Base URL for OpenAI clients.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.listen)
    }

    /// The Prometheus text of `/metrics`, when it can be read.
    pub fn metrics(&self) -> Option<String> {
        fetch::get(self.admin, "/metrics", Duration::from_secs(2))
            .ok()
            .filter(|r| r.status == 200)
            .map(|r| r.text())
    }

    /// The underlying process (pid, RSS).
    pub fn process(&self) -> &ChildProc {
        &self.proc
    }

    /// Stops the process (SIGTERM, then SIGKILL after 3 s).
    pub fn stop(&mut self) {
        self.proc.stop();
    }
}

/// Parses `listening on 127.0.0.1:15080 admin 127.0.0.1:15090`.
pub fn parse_listening_line(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let rest = line.trim().strip_prefix("listening on ")?;
    let (listen, admin) = rest.split_once(" admin ")?;
    Some((listen.trim().parse().ok()?, admin.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_addresses() {
        let (l, a) = parse_listening_line("listening on 127.0.0.1:40001 admin 127.0.0.1:40002\n")
            .expect("parsed");
        assert_eq!(l.port(), 40001);
        assert_eq!(a.port(), 40002);
        assert!(parse_listening_line("listening on 127.0.0.1:1").is_none());
        assert!(parse_listening_line("started").is_none());
    }
}
