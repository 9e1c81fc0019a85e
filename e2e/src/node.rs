//! Tests on a real node — containerd, runc, the CNI bridge, kube-proxy and a kubelet beside
//! the control plane — run inside `e2e/controlplane/sandbox.sh`: network, mount and PID
//! namespaces of their own, so pods, node addresses and the kubelet's mounts exist only there
//! and die with it. A test binary re-runs one of its own tests inside the sandbox
//! ([`run_in_sandbox`]) and, from outside, checks what must hold for the machine: the exit
//! status, every sysctl the same after as before (the kubelet rewrites some machine-wide ones
//! at every start), the sandbox's cgroups gone and no process of it left.
//!
//! ```ignore
//! #[test]
//! fn on_a_real_node() {
//!     if !node::in_sandbox() {
//!         return node::run_in_sandbox("on_a_real_node", Duration::from_secs(600)).assert_clean();
//!     }
//!     let cp = ControlPlane::up_node("mine")?; // …the test itself, inside
//! }
//! ```

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crate::controlplane::repo_root;

/// Set (to `1`) by sandbox.sh for everything inside.
pub const SANDBOX_ENV: &str = "TAILWARDEN_SANDBOX";

/// The machine-wide sysctls the kubelet sets at every start; sandbox.sh shadows them, and
/// the outside watcher checks them all the time the sandbox runs.
pub const KUBELET_TUNABLES: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Whether this process runs inside sandbox.sh.
pub fn in_sandbox() -> bool {
    std::env::var(SANDBOX_ENV).is_ok_and(|v| v == "1")
}

/// Every readable sysctl of the machine (`/proc/sys`, path → value), without the counters
/// that change by themselves (dentry/inode/file counts, the last pid, random UUIDs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sysctls(pub BTreeMap<String, String>);

/// Counters and generated values: they change on an idle machine.
fn volatile(path: &str) -> bool {
    const EXACT: [&str; 9] = [
        "fs/dentry-state",
        "fs/file-nr",
        "fs/inode-nr",
        "fs/inode-state",
        "fs/aio-nr",
        "kernel/ns_last_pid",
        "kernel/pty/nr",
        "net/netfilter/nf_conntrack_count",
        "kernel/tainted",
    ];
    EXACT.contains(&path) || path.starts_with("kernel/random/") || path.starts_with("fs/quota/")
}

impl Sysctls {
    /// Reads every sysctl file under `/proc/sys` that can be read (write-only ones and those
    /// that refuse a read are skipped).
    pub fn snapshot() -> Self {
        let mut out = BTreeMap::new();
        let root = Path::new("/proc/sys");
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                let Ok(kind) = entry.file_type() else {
                    continue;
                };
                if kind.is_dir() {
                    stack.push(path);
                    continue;
                }
                let Ok(rel) = path.strip_prefix(root) else {
                    continue;
                };
                let rel = rel.to_string_lossy().into_owned();
                if volatile(&rel) {
                    continue;
                }
                if let Ok(value) = std::fs::read_to_string(&path) {
                    out.insert(rel, value.trim_end().to_owned());
                }
            }
        }
        Self(out)
    }

    /// Reads just these sysctls (paths under `/proc/sys`).
    pub fn read(paths: &[&str]) -> Self {
        Self(
            paths
                .iter()
                .filter_map(|p| {
                    let v = std::fs::read_to_string(Path::new("/proc/sys").join(p)).ok()?;
                    Some(((*p).to_owned(), v.trim_end().to_owned()))
                })
                .collect(),
        )
    }

    /// `path: before -> after` for every sysctl that differs (or exists in only one).
    pub fn diff(&self, after: &Self) -> Vec<String> {
        let mut out = Vec::new();
        for (k, v) in &self.0 {
            match after.0.get(k) {
                Some(w) if w == v => {}
                Some(w) => out.push(format!("{k}: {v:?} -> {w:?}")),
                None => out.push(format!("{k}: {v:?} -> (gone)")),
            }
        }
        for (k, w) in &after.0 {
            if !self.0.contains_key(k) {
                out.push(format!("{k}: (new) {w:?}"));
            }
        }
        out
    }
}

/// One run of a test inside sandbox.sh, seen from outside.
#[derive(Debug)]
pub struct SandboxRun {
    /// The host directory sandbox.sh was given (logs of the run).
    pub dir: PathBuf,
    /// Whether the test inside passed.
    pub success: bool,
    /// How long the sandboxed run took.
    pub elapsed: Duration,
    /// Machine sysctls that differ between before and after the run.
    pub sysctl_changes: Vec<String>,
    /// Kubelet tunables seen different from their starting value while the run was going on.
    pub tunable_changes_during: Vec<String>,
    /// Cgroups sandbox.sh had made that still exist afterwards.
    pub cgroups_left: Vec<String>,
    /// Processes still in one of the sandbox's namespaces (pods' processes included).
    pub processes_left: Vec<String>,
    /// Mounts of the host that name the sandbox directory.
    pub mounts_left: Vec<String>,
}

impl SandboxRun {
    /// Panics, with everything found, unless the run passed and left the machine as it was.
    pub fn assert_clean(&self) {
        assert!(
            self.success,
            "the sandboxed test failed (its output is above; logs in {})",
            self.dir.display()
        );
        self.assert_nothing_left();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Panics unless the machine is as it was before the run (whether the run passed or not).
    pub fn assert_nothing_left(&self) {
        assert!(
            self.sysctl_changes.is_empty(),
            "machine sysctls changed across the run:\n{}",
            self.sysctl_changes.join("\n")
        );
        assert!(
            self.tunable_changes_during.is_empty(),
            "the kubelet's tunables changed on the machine during the run:\n{}",
            self.tunable_changes_during.join("\n")
        );
        assert!(
            self.cgroups_left.is_empty(),
            "cgroups left behind: {:?}",
            self.cgroups_left
        );
        assert!(
            self.processes_left.is_empty(),
            "processes left behind: {:?}",
            self.processes_left
        );
        assert!(
            self.mounts_left.is_empty(),
            "mounts left behind: {:?}",
            self.mounts_left
        );
    }
}

/// Only one sandbox per test binary at a time: each runs a control plane and a node on 2
/// cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A sandboxed run in progress (see [`start_in_sandbox`]).
pub struct SandboxChild {
    child: Child,
    dir: PathBuf,
    before: Sysctls,
    started: Instant,
    watching: Arc<AtomicBool>,
    watcher: Option<std::thread::JoinHandle<Vec<String>>>,
    lines: std::sync::mpsc::Receiver<String>,
    _guard: std::sync::MutexGuard<'static, ()>,
}

impl std::fmt::Debug for SandboxChild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxChild")
            .field("pid", &self.child.id())
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Starts `test` of this test binary inside sandbox.sh (its output is copied to stderr and
/// also handed to [`SandboxChild::wait_for_line`]). `TAILWARDEN_SANDBOX_KEEP` is passed on.
pub fn start_in_sandbox(test: &str) -> SandboxChild {
    let guard = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = std::env::temp_dir().join(format!("tw-sandbox-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let before = Sysctls::snapshot();
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let watching = watching.clone();
        let start = Sysctls::read(&KUBELET_TUNABLES);
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while watching.load(Ordering::Relaxed) {
                let now = Sysctls::read(&KUBELET_TUNABLES);
                for change in start.diff(&now) {
                    if !seen.contains(&change) {
                        seen.push(change);
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            seen
        })
    };
    let mut child = Command::new(repo_root().join("e2e/controlplane/sandbox.sh"))
        .arg(&dir)
        .arg("--")
        .arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run e2e/controlplane/sandbox.sh: {e}"));
    let (tx, lines) = std::sync::mpsc::channel();
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                eprintln!("{line}");
                let _ = tx.send(line);
            }
        });
    }
    SandboxChild {
        child,
        dir,
        before,
        started: Instant::now(),
        watching,
        watcher: Some(watcher),
        lines,
        _guard: guard,
    }
}

impl SandboxChild {
    /// The pid of sandbox.sh itself (the process whose death tears the sandbox down).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the sandboxed test prints a line containing `needle`; false on timeout or
    /// when its output ended.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    /// Sends SIGKILL to sandbox.sh (not to anything inside: what follows is up to the kernel
    /// and the reaper).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
    }

    /// Waits for the run to end (killing it after `timeout`), then looks for what it left.
    pub fn finish(mut self, timeout: Duration) -> SandboxRun {
        let deadline = Instant::now() + timeout;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() > deadline => {
                    eprintln!("sandbox: no result after {timeout:?}; killing it");
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(100)),
                Err(_) => break None,
            }
        };
        let elapsed = self.started.elapsed();
        let cgroups_list = self.dir.join(".sandbox-cgroups");
        // The reaper (or sandbox.sh itself) removes the cgroups; give it a few seconds.
        let cgroups_left = wait_until_empty(Duration::from_secs(20), || {
            std::fs::read_to_string(&cgroups_list)
                .unwrap_or_default()
                .lines()
                .filter(|c| Path::new(c).exists())
                .map(str::to_owned)
                .collect()
        });
        let namespaces: Vec<String> = std::fs::read_to_string(self.dir.join(".sandbox-ns"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        let processes_left =
            wait_until_empty(Duration::from_secs(10), || processes_in(&namespaces));
        let dir_text = self.dir.display().to_string();
        let mounts_left: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&dir_text))
            .map(str::to_owned)
            .collect();
        self.watching.store(false, Ordering::Relaxed);
        let tunable_changes_during = self
            .watcher
            .take()
            .and_then(|w| w.join().ok())
            .unwrap_or_default();
        let sysctl_changes = self.before.diff(&Sysctls::snapshot());
        SandboxRun {
            dir: self.dir.clone(),
            success: status.is_some_and(|s| s.success()),
            elapsed,
            sysctl_changes,
            tunable_changes_during,
            cgroups_left,
            processes_left,
            mounts_left,
        }
    }
}

/// Runs `test` of this test binary inside sandbox.sh and waits for it (at most `timeout`).
pub fn run_in_sandbox(test: &str, timeout: Duration) -> SandboxRun {
    start_in_sandbox(test).finish(timeout)
}

fn wait_until_empty(limit: Duration, mut f: impl FnMut() -> Vec<String>) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = f();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `pid cmdline` of every live process in one of `namespaces` (lines `pid pid:[4026…]`
/// as sandbox.sh records them).
fn processes_in(namespaces: &[String]) -> Vec<String> {
    let wanted: Vec<(&str, &str)> = namespaces
        .iter()
        .filter_map(|l| l.split_once(' '))
        .collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            wanted.iter().any(|(kind, id)| {
                std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
                    .is_ok_and(|link| link.to_string_lossy() == *id)
            })
        })
        .filter(|pid| {
            // Zombies hold nothing.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(") ")
                    .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
            })
        })
        .map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd: Vec<String> = cmd
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            format!("{pid} {}", cmd.join(" "))
        })
        .collect()
}
