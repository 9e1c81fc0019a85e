//! A real local Kubernetes control plane for tests: kube-apiserver, etcd, controller-manager,
//! scheduler and kwok on loopback (or a real node instead of kwok: [`ControlPlane::up_node`]), brought up by `e2e/controlplane/up.sh` and torn down when
//! the [`ControlPlane`] is dropped — after a panic too, and (through up.sh's reaper) even if
//! the test process is killed. [`ControlPlane::restart_apiserver`] restarts the API server
//! in place, for tests of what survives that.

use std::{
    collections::BTreeMap,
    io::Write,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// Why the control plane could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the control plane did not start (make tools builds it):\n{0}")]
    Up(String),
    #[error("cannot read {path}: {source}")]
    Env {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kube-apiserver restart: {0}")]
    Restart(String),
}

/// How long a restart of the kube-apiserver took, each phase measured.
#[derive(Debug, Clone, Copy)]
pub struct ApiserverRestart {
    /// From SIGTERM until the old process was gone (killed after 5 s).
    pub stop: Duration,
    /// How long it stayed down on purpose before the new process started.
    pub down: Duration,
    /// From starting the new process until `/readyz` answered `ok`.
    pub start: Duration,
}

/// A running control plane. Fields come from up.sh's `env` file (`KUBECONFIG`, `HELM`,
/// `KUBECTL`, `KUBE_APISERVER_URL`, `CA_CERT`, …).
#[derive(Debug)]
pub struct ControlPlane {
    pub dir: PathBuf,
    pub env: BTreeMap<String, String>,
}

/// The repository root (the e2e crate's parent).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Output of a command: whether it succeeded, and stdout followed by stderr.
#[derive(Debug)]
pub struct Output {
    pub ok: bool,
    pub stdout: String,
    pub text: String,
}

impl ControlPlane {
    /// Brings a control plane up in a fresh directory named after `name` and this process.
    /// Uses `TAILWARDEN_CONTROLPLANE_BIN` (set by the Makefile) when present.
    pub fn up(name: &str) -> Result<Self, ControlPlaneError> {
        Self::up_with(name, &[])
    }

    /// A control plane with a real node (containerd, kube-proxy, kubelet; `up.sh --node`)
    /// instead of kwok. Only inside `e2e/controlplane/sandbox.sh` (see [`crate::node`]);
    /// the env file then also has `NODE_NAME`, `NODE_IP`, `NODE_READY_SECONDS`, ….
    pub fn up_node(name: &str) -> Result<Self, ControlPlaneError> {
        Self::up_with(name, &["--node"])
    }

    fn up_with(name: &str, flags: &[&str]) -> Result<Self, ControlPlaneError> {
        // Inside a sandbox pids are small and repeat across sandboxes: use its own directory.
        let base = std::env::var_os("SANDBOX_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
        let dir = base.join(format!("tw-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let script = repo_root().join("e2e/controlplane/up.sh");
        let mut cmd = Command::new(&script);
        cmd.args(flags)
            .args(["--owner-pid", &std::process::id().to_string()])
            .arg(&dir);
        if let Ok(bin) = std::env::var("TAILWARDEN_CONTROLPLANE_BIN") {
            cmd.env("CONTROLPLANE_BIN", bin);
        }
        let out = cmd.output().map_err(|source| ControlPlaneError::Spawn {
            program: script.display().to_string(),
            source,
        })?;
        if !out.status.success() {
            return Err(ControlPlaneError::Up(
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ));
        }
        let env_path = dir.join("env");
        let env = std::fs::read_to_string(&env_path)
            .map_err(|source| ControlPlaneError::Env {
                path: env_path.display().to_string(),
                source,
            })?
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Ok(Self { dir, env })
    }

    /// A value from the env file (empty if missing).
    pub fn var(&self, key: &str) -> &str {
        self.env.get(key).map_or("", String::as_str)
    }

    /// Runs `program args`, with this cluster's KUBECONFIG, feeding `stdin`.
    pub fn run(
        &self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
        kubeconfig: Option<&Path>,
    ) -> Output {
        let kubeconfig =
            kubeconfig.map_or_else(|| PathBuf::from(self.var("KUBECONFIG")), Path::to_path_buf);
        let child = Command::new(program)
            .args(args)
            .current_dir(repo_root())
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                return Output {
                    ok: false,
                    stdout: String::new(),
                    text: format!("cannot run {program}: {e}"),
                };
            }
        };
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            let _ = pipe.write_all(text.as_bytes());
        }
        match child.wait_with_output() {
            Ok(out) => {
                let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                Output {
                    ok: out.status.success(),
                    text: format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)),
                    stdout,
                }
            }
            Err(e) => Output {
                ok: false,
                stdout: String::new(),
                text: e.to_string(),
            },
        }
    }

    /// `kubectl args` as the cluster admin.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        self.run(self.var("KUBECTL"), args, stdin, None)
    }

    /// `helm args` as the cluster admin.
    pub fn helm(&self, args: &[&str]) -> Output {
        self.run(self.var("HELM"), args, None, None)
    }

    /// A kubeconfig that authenticates with `token` (e.g. a ServiceAccount's), written next
    /// to the admin one.
    pub fn token_kubeconfig(&self, name: &str, token: &str) -> Result<PathBuf, std::io::Error> {
        let path = self.dir.join(format!("{name}.kubeconfig"));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: {name}\n  context: {{cluster: local, user: {name}}}\ncurrent-context: {name}\n",
            server = self.var("KUBE_APISERVER_URL"),
            ca = self.var("CA_CERT"),
        );
        std::fs::write(&path, text)?;
        Ok(path)
    }

    /// Restarts the kube-apiserver: SIGTERM to its process group (SIGKILL after 5 s: it stops
    /// listening at once, then would wait up to a minute for open connections to drain), `down`
    /// with no API server at all, then the same command line again — same port, certificates,
    /// flags and etcd — until `/readyz` answers `ok` (within `timeout`). Clients keep their
    /// kubeconfig; their connections and watches break, as in a real control-plane restart.
    /// The new pid replaces the old one in `DIR/pids`, `DIR/env` and [`Self::env`], so drop,
    /// `down.sh` and the reaper stop the new process. The other components are untouched.
    pub fn restart_apiserver(
        &mut self,
        down: Duration,
        timeout: Duration,
    ) -> Result<ApiserverRestart, ControlPlaneError> {
        let fail = |m: String| ControlPlaneError::Restart(m);
        let old: u32 = self
            .var("KUBE_APISERVER_PID")
            .parse()
            .map_err(|_| fail("no KUBE_APISERVER_PID in the env file".into()))?;
        // The exact command line up.sh used (it may have retried on other ports).
        let cmdline = std::fs::read(format!("/proc/{old}/cmdline"))
            .map_err(|e| fail(format!("kube-apiserver (pid {old}) is not running: {e}")))?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let Some((program, args)) = args.split_first() else {
            return Err(fail(format!("empty command line for pid {old}")));
        };

        let t = Instant::now();
        signal_group("TERM", old);
        let deadline = Instant::now() + Duration::from_secs(5);
        while running(old) {
            if Instant::now() > deadline {
                signal_group("KILL", old);
            }
            if Instant::now() > deadline + Duration::from_secs(10) {
                return Err(fail(format!("kube-apiserver (pid {old}) survived SIGKILL")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let stop = t.elapsed();
        std::thread::sleep(down);

        let t = Instant::now();
        let log_path = self.dir.join("logs/kube-apiserver.log");
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log_path)
            .map_err(|e| fail(format!("cannot open {}: {e}", log_path.display())))?;
        let err_log = log
            .try_clone()
            .map_err(|e| fail(format!("cannot open {}: {e}", log_path.display())))?;
        let child = Command::new(program)
            .args(args)
            // Its own process group, like up.sh's setsid: down.sh signals the group.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(|e| fail(format!("cannot start {program}: {e}")))?;
        let new = child.id();
        // Not waited for: it outlives this handle, like every component up.sh starts.
        drop(child);
        self.replace_pid(old, new)?;

        let port = self.var("KUBE_APISERVER_PORT").to_owned();
        let url = format!("https://127.0.0.1:{port}/readyz");
        let deadline = Instant::now() + timeout;
        loop {
            let out = Command::new("curl")
                .args([
                    "-sf",
                    "--max-time",
                    "3",
                    "--cacert",
                    self.var("CA_CERT"),
                    &url,
                ])
                .output();
            if out.is_ok_and(|o| o.status.success() && o.stdout.trim_ascii() == b"ok") {
                break;
            }
            if !running(new) {
                return Err(fail(format!(
                    "the new kube-apiserver (pid {new}) exited; see {}",
                    log_path.display()
                )));
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "not ready after {timeout:?}; see {}",
                    log_path.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(ApiserverRestart {
            stop,
            down,
            start: t.elapsed(),
        })
    }

    /// Records `new` as the kube-apiserver's pid wherever `old` was.
    fn replace_pid(&mut self, old: u32, new: u32) -> Result<(), ControlPlaneError> {
        for (file, from, to) in [
            (
                "pids",
                format!("kube-apiserver {old}"),
                format!("kube-apiserver {new}"),
            ),
            (
                "env",
                format!("KUBE_APISERVER_PID={old}"),
                format!("KUBE_APISERVER_PID={new}"),
            ),
        ] {
            let path = self.dir.join(file);
            let text = std::fs::read_to_string(&path).map_err(|source| ControlPlaneError::Env {
                path: path.display().to_string(),
                source,
            })?;
            let text: String = text
                .lines()
                .map(|l| if l == from { to.as_str() } else { l })
                .flat_map(|l| [l, "\n"])
                .collect();
            std::fs::write(&path, text).map_err(|source| ControlPlaneError::Env {
                path: path.display().to_string(),
                source,
            })?;
        }
        self.env
            .insert("KUBE_APISERVER_PID".into(), new.to_string());
        Ok(())
    }
}

/// Sends SIGsig to the process group `pgid` (falling back to the process alone).
fn signal_group(sig: &str, pgid: u32) {
    let group = Command::new("kill")
        .args([&format!("-{sig}"), "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
    if !group.is_ok_and(|s| s.success()) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &pgid.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

/// Whether `pid` exists and is not a zombie.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
    })
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("e2e/controlplane/down.sh"))
            .arg(&self.dir)
            .output();
    }
}
