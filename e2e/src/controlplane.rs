//! A real local Kubernetes control plane for tests: kube-apiserver, etcd, controller-manager,
//! scheduler and kwok on loopback, brought up by `e2e/controlplane/up.sh` and torn down when
//! the [`ControlPlane`] is dropped — after a panic too, and (through up.sh's reaper) even if
//! the test process is killed.

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
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
        let dir = std::env::temp_dir().join(format!("tw-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let script = repo_root().join("e2e/controlplane/up.sh");
        let mut cmd = Command::new(&script);
        cmd.args(["--owner-pid", &std::process::id().to_string()])
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
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("e2e/controlplane/down.sh"))
            .arg(&self.dir)
            .output();
    }
}
