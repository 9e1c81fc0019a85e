//! Child processes that the demo and the benchmark start: the sidecar and the peer proxies.
//!
//! Every child runs in its own process group, so stopping it also stops whatever it forked
//! (nginx workers, uvicorn, node helpers), and [`ChildProc`] stops the group when it is
//! dropped, so an error or a panic in the orchestrator leaves nothing listening on a port.
//! When util-linux `setpriv` is installed the child is also started with a parent-death
//! signal, which covers the one case a destructor cannot: the orchestrator being killed with
//! SIGKILL. Signals go through the system `kill` command because the workspace forbids
//! `unsafe` code (and with it `libc::kill` and `pre_exec`).
//!
//! The API is synchronous on purpose: starting and stopping a handful of processes is not on
//! any measured path, and spawning from the main thread keeps the parent-death signal tied
//! to a thread that lives as long as the program (it fires when the *spawning thread* exits).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How long a stopping child gets between SIGTERM and SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(3);

/// Where util-linux's `setpriv` lives on Debian.
const SETPRIV: &str = "/usr/bin/setpriv";

/// Why a child could not be started or did not become ready.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The program could not be executed.
    #[error("cannot start {name} ({program}): {source}")]
    Spawn {
        /// Human name of the child.
        name: String,
        /// Program path.
        program: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The stderr log file could not be created.
    #[error("cannot create log file {path}: {source}")]
    Log {
        /// Path of the log.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The child exited while we waited for it to become ready.
    #[error("{name} exited with {status} before it was ready; last lines of {log}:\n{tail}")]
    Exited {
        /// Human name of the child.
        name: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its log file.
        log: String,
        /// The end of its log.
        tail: String,
    },
    /// The child did not become ready in time.
    #[error("{name} was not ready after {waited:?} ({what}); last lines of {log}:\n{tail}")]
    NotReady {
        /// Human name of the child.
        name: String,
        /// What we waited for.
        what: String,
        /// How long we waited.
        waited: Duration,
        /// Its log file.
        log: String,
        /// The end of its log.
        tail: String,
    },
}

/// A running child process in its own process group; dropping it stops the group.
#[derive(Debug)]
pub struct ChildProc {
    name: String,
    child: Child,
    lines: Receiver<String>,
    log: PathBuf,
    stopped: bool,
}

impl ChildProc {
    /// Starts `cmd` as `name`: its own process group, stdin closed, stdout read line by line
    /// (see [`ChildProc::wait_for_line`]), stderr appended to `log`.
    pub fn spawn(name: &str, cmd: &Command, log: &Path) -> Result<Self, ProcError> {
        let stderr = File::create(log).map_err(|source| ProcError::Log {
            path: log.display().to_string(),
            source,
        })?;
        let program = cmd.get_program().to_string_lossy().into_owned();
        // Rebuild the command, optionally behind `setpriv --pdeathsig KILL`, which execs the
        // program in place (same pid), so the pid and process group stay the child's own.
        let mut real = if Path::new(SETPRIV).exists() {
            let mut c = Command::new(SETPRIV);
            c.args(["--pdeathsig", "KILL", "--"]).arg(cmd.get_program());
            c
        } else {
            Command::new(cmd.get_program())
        };
        real.args(cmd.get_args());
        if let Some(dir) = cmd.get_current_dir() {
            real.current_dir(dir);
        }
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => real.env(k, v),
                None => real.env_remove(k),
            };
        }
        real.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .process_group(0);
        let mut child = real.spawn().map_err(|source| ProcError::Spawn {
            name: name.to_owned(),
            program: program.clone(),
            source,
        })?;
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            // Drain stdout for the child's whole life so it can never block on a full pipe.
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        // Nobody listens any more; keep draining.
                        continue;
                    }
                }
            });
        }
        Ok(Self {
            name: name.to_owned(),
            child,
            lines: rx,
            log: log.to_owned(),
            stopped: false,
        })
    }

    /// The child's pid (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Human name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The stderr log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Waits for a stdout line for which `pick` returns a value.
    pub fn wait_for_line<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pick: impl FnMut(&str) -> Option<T>,
    ) -> Result<T, ProcError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.not_ready(what, timeout));
            }
            match self
                .lines
                .recv_timeout(left.min(Duration::from_millis(100)))
            {
                Ok(line) => {
                    if let Some(v) = pick(&line) {
                        return Ok(v);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // stdout closed: the child is exiting; let check_alive report it.
                    std::thread::sleep(Duration::from_millis(50));
                    self.check_alive()?;
                }
            }
        }
    }

    /// Waits until `ready` returns true (polled every 100 ms), failing early if the child exits.
    pub fn wait_until(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), ProcError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if ready() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.not_ready(what, timeout));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until a TCP connection to `addr` succeeds.
    pub fn wait_for_port(&mut self, addr: SocketAddr, timeout: Duration) -> Result<(), ProcError> {
        self.wait_until(&format!("accepting connections on {addr}"), timeout, || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        })
    }

    fn check_alive(&mut self) -> Result<(), ProcError> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.stopped = true;
                Err(ProcError::Exited {
                    name: self.name.clone(),
                    status,
                    log: self.log.display().to_string(),
                    tail: log_tail(&self.log, 15),
                })
            }
            _ => Ok(()),
        }
    }

    fn not_ready(&self, what: &str, waited: Duration) -> ProcError {
        ProcError::NotReady {
            name: self.name.clone(),
            what: what.to_owned(),
            waited,
            log: self.log.display().to_string(),
            tail: log_tail(&self.log, 15),
        }
    }

    /// Resident memory of the whole process group in KiB (the sum of `VmRSS` of every
    /// process in it, so nginx's workers and a Python server's children count too).
    pub fn group_rss_kib(&self) -> Option<u64> {
        group_rss_kib(self.pid())
    }

    /// Number of processes in the group.
    pub fn group_size(&self) -> usize {
        group_members(self.pid()).len()
    }

    /// SIGTERM to the group, up to 3 s to exit, then SIGKILL; reaps the child.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let pgid = self.pid();
        signal_group(pgid, "TERM");
        let deadline = Instant::now() + TERM_GRACE;
        loop {
            let leader_done = matches!(self.child.try_wait(), Ok(Some(_)));
            if leader_done && group_members(pgid).is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        signal_group(pgid, "KILL");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends `sig` (a name such as `TERM`) to process group `pgid`, ignoring failures (the group
/// may already be gone).
fn signal_group(pgid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args(["-s", sig, "--", &format!("-{pgid}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Pids of the live processes whose process group is `pgid` (from `/proc/PID/stat`).
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| parse_stat_pgrp_state(&stat))
                // Zombies hold no memory and are about to be reaped.
                .is_some_and(|(pgrp, state)| pgrp == pgid && state != 'Z')
        })
        .collect()
}

/// `(pgrp, state)` from the text of `/proc/PID/stat`. The command name (field 2) may contain
/// spaces and parentheses, so fields are counted after the *last* `)`.
fn parse_stat_pgrp_state(stat: &str) -> Option<(u32, char)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((pgrp, state))
}

/// `VmRSS` of one process in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    process_status_field(pid, "VmRSS:")
}

/// One numeric field of `/proc/PID/status`.
fn process_status_field(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&status, field)
}

/// A numeric field of the text of `/proc/PID/status` (`VmRSS:`, `RssAnon:`, `Threads:`), in
/// the unit the file gives it (kB for memory).
pub fn status_field(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Sum of `VmRSS` over process group `pgid`, in KiB; `None` when no member could be read.
pub fn group_rss_kib(pgid: u32) -> Option<u64> {
    sum_over_group(pgid, rss_kib)
}

/// `RssAnon` of one process in KiB: the memory it allocated itself (heap, stacks), as opposed
/// to pages of mapped files (its code), which every process running the same binary from the
/// same file shares through the page cache.
pub fn anon_rss_kib(pid: u32) -> Option<u64> {
    process_status_field(pid, "RssAnon:")
}

/// Sum of `RssAnon` over process group `pgid`, in KiB; `None` when no member could be read.
pub fn group_anon_rss_kib(pgid: u32) -> Option<u64> {
    sum_over_group(pgid, anon_rss_kib)
}

fn sum_over_group(pgid: u32, per_process: fn(u32) -> Option<u64>) -> Option<u64> {
    let values: Vec<u64> = group_members(pgid)
        .into_iter()
        .filter_map(per_process)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The last `n` lines of a log file (empty when unreadable).
pub fn log_tail(path: &Path, n: usize) -> String {
    let Ok(text) = std::fs::read_to_string(path) else {
        return String::new();
    };
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Resolves on SIGINT, SIGTERM or SIGHUP: for the orchestrators all three mean "stop the
/// load, stop the children, print what you have". Without signal support it never resolves
/// (the default actions then apply, and the parent-death signal still stops the children).
pub async fn termination_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        _ = hup.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_a_tricky_command_name() {
        let stat = "1234 (my (odd) prog) S 1 1234 1234 0 -1 4194560 100";
        assert_eq!(parse_stat_pgrp_state(stat), Some((1234, 'S')));
        assert_eq!(parse_stat_pgrp_state("garbage"), None);
    }

    #[test]
    fn vmrss_is_read_in_kib() {
        let status = "Name:\tnginx\nVmPeak:\t  10000 kB\nVmRSS:\t    5120 kB\nThreads:\t1\n";
        assert_eq!(status_field(status, "VmRSS:"), Some(5120));
        assert_eq!(status_field("Name: x\n", "VmRSS:"), None);
        let status = "VmRSS:\t   17000 kB\nRssAnon:\t    4100 kB\nRssFile:\t   12900 kB\n";
        assert_eq!(status_field(status, "RssAnon:"), Some(4100));
        assert_eq!(status_field(status, "RssFile:"), Some(12900));
    }

    #[test]
    fn a_stopped_group_leaves_no_process() {
        // `sh` forks a `sleep` into the same group: stopping must take both down.
        let dir = std::env::temp_dir();
        let log = dir.join(format!("tw-proc-test-{}.log", std::process::id()));
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 30 & echo ready; wait"]);
        let mut p = ChildProc::spawn("sh", &cmd, &log).expect("spawn");
        p.wait_for_line("ready", Duration::from_secs(5), |l| {
            (l == "ready").then_some(())
        })
        .expect("ready line");
        let pgid = p.pid();
        assert!(group_members(pgid).len() >= 2, "sh and sleep in the group");
        assert!(p.group_rss_kib().is_some_and(|kib| kib > 0));
        drop(p);
        assert!(group_members(pgid).is_empty(), "group gone after drop");
        let _ = std::fs::remove_file(&log);
    }
}
