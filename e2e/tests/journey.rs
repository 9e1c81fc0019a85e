//! The user journey on a real node (`make e2e`, part of `make test`), inside
//! `e2e/controlplane/sandbox.sh` (network, mount and PID namespaces of its own): the control
//! plane, containerd + runc + the CNI bridge, kube-proxy and a kubelet v1.33.13, with the
//! images `make images` built imported and nothing pulled.
//!
//! helm install (two operator pods from the operator image, under the chart's
//! ServiceAccount, one of them leader) → what a user types with kubectl (`get ir`, `explain`,
//! an invalid route's CEL message) → a route → an opted-in Deployment whose app is the real
//! OpenAI Python SDK in an image built here, injected with the sidecar image: the sidecar
//! starts first, the app's calls reach the simulator through it → a route change reaches
//! the running sidecar through the kubelet's ConfigMap volume (the `..data` symlink swap)
//! with zero failed requests → a rotated Secret's key is used without a restart → deleting
//! the pod: the app gets SIGTERM first, its in-flight stream completes, the sidecar exits
//! after it (from the containers' own timestamps) → the route's ConfigMap is
//! garbage-collected → the operator image under a ServiceAccount missing one RBAC rule fails
//! visibly → helm uninstall leaves nothing. From outside the sandbox: every sysctl of the
//! machine the same after as before, nothing left. A second test kills a sandbox with a
//! running pod and checks the same.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use serde_json::Value;
use tailwarden_e2e::{
    controlplane::{ControlPlane, repo_root},
    node,
    sim::{Profile, SimServer},
};

const NS: &str = "tailwarden-system";
const APP_NS: &str = "shop";
// Release "tailwarden" of chart "tailwarden": object names are not doubled.
const SA: &str = "tailwarden-operator";
const OPERATOR: &str = "tailwarden-operator";
const SIDECAR: &str = "tailwarden-sidecar";
const KEY_1: &str = "sk-journey-canary-1";
const KEY_2: &str = "sk-journey-canary-2";
/// Tokens per streamed answer; the simulator sends one every 100 ms.
const STREAM_TOKENS: usize = 40;

#[test]
fn the_user_journey_on_a_real_node() {
    if !node::in_sandbox() {
        let run = node::run_in_sandbox("the_user_journey_on_a_real_node", Duration::from_secs(900));
        eprintln!(
            "journey: sandbox finished in {:.1}s; machine sysctls compared: {} changed",
            run.elapsed.as_secs_f64(),
            run.sysctl_changes.len()
        );
        run.assert_clean();
        return;
    }
    journey();
}

#[test]
fn a_killed_node_leaves_nothing_behind() {
    if !node::in_sandbox() {
        let mut child = node::start_in_sandbox("a_killed_node_leaves_nothing_behind");
        assert!(
            child.wait_for_line("node-with-a-pod-running", Duration::from_secs(300)),
            "the sandboxed node never got its pod running"
        );
        let t = Instant::now();
        child.kill();
        let run = child.finish(Duration::from_secs(60));
        assert!(!run.success, "a SIGKILLed sandbox cannot have passed");
        run.assert_nothing_left();
        eprintln!(
            "killed sandbox: nothing left {:.1}s after SIGKILL",
            t.elapsed().as_secs_f64()
        );
        let _ = fs::remove_dir_all(&run.dir);
        return;
    }
    // Inside: a node with a running container (its cgroups, mounts, shim and netns), then
    // wait to be killed from outside.
    let cp = ControlPlane::up_node("killed").unwrap_or_else(|e| panic!("{e}"));
    let pause = image_ref("pause");
    let out = cp.kubectl(
        &[
            "run",
            "idle",
            "--image",
            &pause,
            "--image-pull-policy=Never",
        ],
        None,
    );
    assert!(out.ok, "{}", out.text);
    let out = cp.kubectl(
        &[
            "wait",
            "--for=condition=Ready",
            "pod/idle",
            "--timeout=120s",
        ],
        None,
    );
    assert!(out.ok, "{}", out.text);
    println!("node-with-a-pod-running");
    std::thread::sleep(Duration::from_secs(600));
    panic!("not killed");
}

/// The reference `images/build.sh` wrote for an image (`.cache/images/NAME.ref`).
fn image_ref(name: &str) -> String {
    let path = repo_root().join(format!(".cache/images/{name}.ref"));
    fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (make e2e builds the images)", path.display()))
        .trim()
        .to_owned()
}

/// The `User` of an image's config, read from its OCI archive (index → manifest → config).
fn image_user(name: &str) -> String {
    let archive = repo_root().join(format!(".cache/images/{name}.tar"));
    let blob = |digest: &str| -> Value {
        let path = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
        let out = Command::new("tar")
            .arg("-xOf")
            .arg(&archive)
            .arg(&path)
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let out = Command::new("tar")
        .arg("-xOf")
        .arg(&archive)
        .arg("index.json")
        .output()
        .unwrap();
    let index: Value = serde_json::from_slice(&out.stdout).unwrap();
    let manifest = blob(index["manifests"][0]["digest"].as_str().unwrap());
    let config = blob(manifest["config"]["digest"].as_str().unwrap());
    config["config"]["User"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Seconds since the epoch, from this machine's clock (the containers share it).
fn now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `2026-12-01T09:41:07.123456Z` → seconds since the epoch (UTC only, as tracing writes it).
fn rfc3339(ts: &str) -> Option<f64> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.splitn(3, ':');
    let (h, min) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let s: f64 = t.next()?.parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3_600 + min * 60) as f64 + s)
}

/// The JSON lines of a log file (other lines skipped).
fn json_lines(path: &Path) -> Vec<Value> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The sidecar's log lines with `message`, as (own timestamp, line).
fn sidecar_events(path: &Path, message: &str) -> Vec<(f64, Value)> {
    json_lines(path)
        .into_iter()
        .filter(|l| l["message"] == message || l["fields"]["message"] == message)
        .filter_map(|l| Some((rfc3339(l["timestamp"].as_str()?)?, l)))
        .collect()
}

/// `uid` and whether `/` is mounted read-only, for a process of a container (its /proc is
/// visible from the sandbox's PID namespace).
fn process_identity(cmd_prefix: &str) -> Vec<(u32, u32, bool)> {
    let mut out = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let cmd = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !cmd.starts_with(cmd_prefix.as_bytes()) {
            continue;
        }
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(u32::MAX);
        let root_ro = fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap_or_default()
            .lines()
            .find(|l| l.split_whitespace().nth(4) == Some("/"))
            .is_some_and(|l| {
                l.split_whitespace()
                    .nth(5)
                    .is_some_and(|o| o.split(',').any(|x| x == "ro"))
            });
        out.push((pid, uid, root_ro));
    }
    out
}

struct Journey {
    cp: ControlPlane,
    work: PathBuf,
    started: Instant,
    timings: Vec<(&'static str, f64)>,
}

impl Journey {
    fn step(&self, name: &str) {
        eprintln!("[{:>6.1}s] {name}", self.started.elapsed().as_secs_f64());
    }

    fn time(&mut self, what: &'static str, since: Instant) {
        let s = since.elapsed().as_secs_f64();
        eprintln!("           {what}: {s:.1}s");
        self.timings.push((what, s));
    }

    fn kubectl(&self, args: &[&str]) -> String {
        let out = self.cp.kubectl(args, None);
        assert!(out.ok, "kubectl {}: {}", args.join(" "), out.text);
        out.stdout
    }

    fn apply(&self, yaml: &str) {
        let out = self.cp.kubectl(&["apply", "-f", "-"], Some(yaml));
        assert!(out.ok, "kubectl apply: {}\n{yaml}", out.text);
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&a)).unwrap()
    }

    /// Polls `check` until it yields, or fails with what the cluster and the node saw.
    fn wait<T>(&self, what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = check() {
                return v;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {limit:?} waiting for: {what}\n{}",
                    self.dump()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn dump(&self) -> String {
        let mut dump = String::new();
        for args in [
            &[
                "get",
                "nodes,inferenceroutes,configmaps,pods,deployments",
                "-A",
                "-o",
                "wide",
            ][..],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
            &["describe", "pods", "-A"][..],
        ] {
            dump.push_str(&self.cp.kubectl(args, None).text);
        }
        for log in ["kubelet", "containerd"] {
            let path = self.cp.dir.join(format!("logs/{log}.log"));
            let text = fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            dump.push_str(&format!("\n--- {log} (tail) ---\n"));
            for l in tail.into_iter().rev() {
                dump.push_str(l);
                dump.push('\n');
            }
        }
        dump
    }

    /// `kubectl logs -f` of one container into a file, until the container exits.
    fn follow(&self, pod: &str, container: &str) -> (Child, PathBuf) {
        let path = self.work.join(format!("{pod}-{container}.log"));
        let file = fs::File::create(&path).unwrap();
        let child = Command::new(self.cp.var("KUBECTL"))
            .args(["logs", "-f", "-n", APP_NS, pod, "-c", container])
            .env("KUBECONFIG", self.cp.var("KUBECONFIG"))
            .stdout(file)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        (child, path)
    }

    /// The one pod of `app=web`, once it is Running and Ready.
    fn web_pod(&self, limit: Duration) -> Value {
        self.wait("the web pod Running and Ready", limit, || {
            let pods = self.json(&["get", "pods", "-n", APP_NS, "-l", "app=web"]);
            let items = pods["items"].as_array()?.clone();
            let live: Vec<Value> = items
                .into_iter()
                .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                .collect();
            let p = live.first()?;
            let ready = p["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            (live.len() == 1 && p["status"]["phase"] == "Running" && ready).then(|| p.clone())
        })
    }

    /// The target of the `..data` symlink of one of the pod's projected volumes, read from
    /// the kubelet's own directory (this test shares the node's mounts).
    fn volume_data_link(&self, pod: &Value, volume: &str) -> String {
        let uid = pod["metadata"]["uid"].as_str().unwrap();
        let dir = format!("/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected/{volume}");
        fs::read_link(format!("{dir}/..data"))
            .unwrap_or_else(|e| panic!("{dir}/..data: {e}"))
            .display()
            .to_string()
    }
}

fn route(provider: &str, sim: &str) -> String {
    format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: {APP_NS}}}\nspec:\n  models: [gpt-4.1]\n  providers:\n  - name: {provider}\n    baseUrl: http://{sim}/v1\n    auth: {{secretRef: {{name: openai, key: apiKey}}}}\n  timeouts: {{firstByte: 10s, total: 60s}}\n"
    )
}

fn secret(key: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: openai, namespace: {APP_NS}}}\nstringData: {{apiKey: {key}}}\n"
    )
}

/// The app's events since `t` (its own clock).
fn app_events(path: &Path, event: &str) -> Vec<Value> {
    json_lines(path)
        .into_iter()
        .filter(|l| l["event"] == event)
        .collect()
}

fn failures(path: &Path) -> Vec<Value> {
    json_lines(path)
        .into_iter()
        .filter(|l| (l["event"] == "request" || l["event"] == "stream") && l["ok"] != true)
        .collect()
}

fn journey() {
    let started = Instant::now();
    let cp = ControlPlane::up_node("journey").unwrap_or_else(|e| panic!("{e}"));
    let work = cp.dir.join("journey");
    fs::create_dir_all(&work).unwrap();
    let mut j = Journey {
        cp,
        work,
        started,
        timings: Vec::new(),
    };
    let node_ready: f64 = j.cp.var("NODE_READY_SECONDS").parse().unwrap_or(f64::NAN);
    j.timings.push((
        "node Ready (containerd, images, kube-proxy, kubelet)",
        node_ready,
    ));
    j.time("control plane + node up", started);
    j.step("control plane and node up");

    // kubectl is the one build.sh built from the same modules.
    let version = j.json(&["version", "--client"]);
    assert_eq!(version["clientVersion"]["gitVersion"], "v1.33.13");
    let nodes = j.json(&["get", "nodes"]);
    let node = &nodes["items"][0];
    assert_eq!(node["status"]["nodeInfo"]["kubeletVersion"], "v1.33.13");
    assert!(
        node["status"]["nodeInfo"]["containerRuntimeVersion"]
            .as_str()
            .unwrap()
            .starts_with("containerd://"),
        "{node}"
    );

    // The provider: tailwarden-sim on the node address, where pods reach it. Streams are
    // 40 tokens, one every 100 ms.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let profile = Profile::from_yaml(
        "ttft: {constant: {ms: 20}}\nitl: {constant: {ms: 100}}\noutputTokens: {constant: {value: 40}}\n",
        "journey",
    )
    .unwrap();
    let node_ip = j.cp.var("NODE_IP").to_owned();
    let sim = rt
        .block_on(async {
            SimServer::bind(format!("{node_ip}:0").parse().unwrap(), &profile, 42).await
        })
        .unwrap();
    let sim_addr = sim.local_addr().to_string();
    let sim = rt.block_on(async { sim.spawn() });

    // Each product image runs `--version` under containerd as its own user: no runAsUser
    // here, so the kubelet's runAsNonRoot check reads the image's USER (65532, from the
    // image config in the archive) and refuses root.
    for (name, binary) in [("operator", OPERATOR), ("sidecar", SIDECAR)] {
        let reference = image_ref(name);
        assert_eq!(image_user(name), "65532:65532", "{reference}");
        let pod = format!("version-{name}");
        j.apply(
            &serde_json::json!({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {"restartPolicy": "Never", "containers": [{
                    "name": name, "image": reference, "imagePullPolicy": "Never",
                    "args": ["--version"],
                    "securityContext": {"runAsNonRoot": true, "readOnlyRootFilesystem": true,
                                        "allowPrivilegeEscalation": false,
                                        "capabilities": {"drop": ["ALL"]}}}]}
            })
            .to_string(),
        );
        j.wait(&format!("{pod} Succeeded"), Duration::from_secs(60), || {
            let p = j.json(&["get", "pod", &pod]);
            (p["status"]["phase"] == "Succeeded").then_some(())
        });
        let version = j.kubectl(&["logs", &pod]);
        assert_eq!(version.trim(), format!("{binary} 0.1.0"), "{reference}");
        j.kubectl(&["delete", "pod", &pod]);
    }
    j.step("both images run --version under containerd as their own non-root user");

    // helm install with the chart's defaults: its image names are what `make images` built
    // and imported, so the pods start from them (nothing can be pulled here).
    let operator_image = image_ref("operator");
    let sidecar_image = image_ref("sidecar");
    let t = Instant::now();
    let out = j.cp.helm(&[
        "install",
        "tailwarden",
        "charts/tailwarden",
        "--namespace",
        NS,
        "--create-namespace",
        "--wait",
        "--timeout",
        "5m",
    ]);
    assert!(out.ok, "helm install: {}\n{}", out.text, j.dump());
    j.time("helm install --wait (two operator pods Ready)", t);
    let deploy = j.json(&["get", "deployment", OPERATOR, "-n", NS]);
    assert_eq!(deploy["status"]["readyReplicas"], 2, "{deploy}");
    let pods = j.json(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/component=operator",
    ]);
    let names: Vec<String> = pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert_eq!(p["spec"]["serviceAccountName"], SA);
            assert_eq!(p["spec"]["containers"][0]["image"], operator_image.as_str());
            assert_eq!(p["status"]["phase"], "Running");
            p["metadata"]["name"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(names.len(), 2, "{pods}");
    let lease = j.wait(
        "an operator pod holding the Lease",
        Duration::from_secs(60),
        || {
            let l = j.json(&["get", "lease", OPERATOR, "-n", NS]);
            let holder = l["spec"]["holderIdentity"].as_str()?.to_owned();
            names.contains(&holder).then_some(holder)
        },
    );
    let procs = process_identity("/usr/bin/tailwarden-operator\0run");
    assert_eq!(procs.len(), 2, "operator processes: {procs:?}");
    for (pid, uid, ro) in &procs {
        assert_eq!(*uid, 65532, "operator pid {pid} runs as uid {uid}");
        assert!(ro, "operator pid {pid}: / is not read-only");
    }
    j.step(&format!(
        "two operator pods from {operator_image} as uid 65532 on a read-only root; leader {lease}"
    ));

    // What a user types.
    let explain = j.kubectl(&["explain", "inferenceroute.spec.retries"]);
    assert!(explain.contains("FIELD: retries"), "{explain}");
    // kubectl re-wraps descriptions to the terminal: compare words.
    let words: Vec<&str> = explain.split_whitespace().collect();
    assert!(
        words
            .join(" ")
            .contains("Retries happen only before the first response byte reaches the client."),
        "{explain}"
    );
    assert!(words.contains(&"maxAttempts"), "{explain}");
    j.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {APP_NS}}}\n"
    ));
    let invalid = route("sim-a", &sim_addr).replace("total: 60s", "total: 5s");
    let out = j.cp.kubectl(&["apply", "-f", "-"], Some(&invalid));
    assert!(!out.ok, "an invalid route was accepted");
    assert!(
        out.text.contains("firstByte must not exceed total"),
        "{}",
        out.text
    );
    j.apply(&secret(KEY_1));
    j.apply(&route("sim-a", &sim_addr));
    j.wait("route Ready", Duration::from_secs(60), || {
        let r = j.json(&["get", "ir", "chat", "-n", APP_NS]);
        r["status"]["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
            .then_some(())
    });
    let table = j.kubectl(&["get", "ir", "-n", APP_NS]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "READY", "PROVIDERS", "TTFT", "SLO", "AGE"],
        "{table}"
    );
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&row[..3], ["chat", "True", "sim-a"], "{table}");
    j.step("kubectl explain, an invalid route's CEL message, route Ready in kubectl get ir");

    // A Deployment opts in; the webhook (called by the apiserver through the webhook
    // Service) injects the sidecar; the app is the real OpenAI SDK.
    let app_image = image_ref("openai-app");
    let t = Instant::now();
    j.apply(&format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: web, namespace: {APP_NS}}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: web}}}}\n  template:\n    metadata:\n      labels: {{app: web}}\n      annotations: {{tailwarden.io/routes: chat}}\n    spec:\n      containers:\n      - name: app\n        image: {app_image}\n        imagePullPolicy: Never\n        env:\n        - {{name: OPENAI_API_KEY, value: unused-the-sidecar-holds-the-key}}\n        - {{name: APP_STREAM_TOKENS, value: \"{STREAM_TOKENS}\"}}\n        securityContext: {{runAsNonRoot: true, readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities: {{drop: [ALL]}}}}\n"
    ));
    let pod = j.web_pod(Duration::from_secs(120));
    j.time("Deployment applied → injected pod Running and Ready", t);
    let pod_name = pod["metadata"]["name"].as_str().unwrap().to_owned();
    let init = &pod["spec"]["initContainers"][0];
    assert_eq!(init["name"], SIDECAR);
    assert_eq!(init["restartPolicy"], "Always");
    assert_eq!(init["image"], sidecar_image.as_str());
    assert_eq!(init["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(init["startupProbe"]["httpGet"]["path"], "/readyz");
    let sidecar_args = init["args"].as_array().unwrap();
    assert!(
        sidecar_args
            .windows(2)
            .any(|w| w[0] == "--max-connections" && w[1] == "2000"),
        "{sidecar_args:?}"
    );
    let env = pod["spec"]["containers"][0]["env"].as_array().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == "OPENAI_BASE_URL" && e["value"] == "http://127.0.0.1:15080/v1")
    );
    let sidecar_status = &pod["status"]["initContainerStatuses"][0];
    assert_eq!(sidecar_status["name"], SIDECAR);
    assert_eq!(sidecar_status["ready"], true, "{sidecar_status}");
    let sidecar_id = sidecar_status["containerID"].as_str().unwrap().to_owned();
    let procs = process_identity("/usr/bin/tailwarden-sidecar\0");
    assert_eq!(procs.len(), 1, "sidecar processes: {procs:?}");
    assert_eq!(procs[0].1, 65532, "the sidecar runs as uid {}", procs[0].1);
    assert!(procs[0].2, "the sidecar's / is not read-only");

    let (mut app_follow, app_log) = j.follow(&pod_name, "app");
    let (mut sidecar_follow, sidecar_log) = j.follow(&pod_name, SIDECAR);
    j.wait(
        "the app's calls answered by sim-a",
        Duration::from_secs(60),
        || {
            let ok = app_events(&app_log, "request")
                .iter()
                .filter(|r| r["ok"] == true && r["provider"] == "sim-a")
                .count();
            let streams = app_events(&app_log, "stream")
                .iter()
                .filter(|s| s["ok"] == true)
                .count();
            (ok >= 5 && streams >= 1).then_some(())
        },
    );
    // The sidecar was serving before the app started (its own log clock and the app's).
    let sidecar_started = sidecar_events(&sidecar_log, "tailwarden-sidecar started");
    let app_started = app_events(&app_log, "start");
    assert_eq!(sidecar_started.len(), 1, "{sidecar_started:?}");
    let app_t = app_started[0]["t"].as_f64().unwrap();
    assert!(
        sidecar_started[0].0 < app_t,
        "sidecar started at {}, app at {app_t}",
        sidecar_started[0].0
    );
    assert!(failures(&app_log).is_empty(), "{:?}", failures(&app_log));
    assert_eq!(
        sim.stats().last_authorization.as_deref(),
        Some(format!("Bearer {KEY_1}").as_str())
    );
    j.step("the sidecar started first; the OpenAI SDK's calls reach the simulator through it");

    // A route change: the operator rewrites the ConfigMap, the kubelet swaps the volume's
    // ..data symlink, the sidecar reloads; the app never sees an error.
    let config_link = j.volume_data_link(&pod, "tailwarden-config");
    let reloads_before = sidecar_events(&sidecar_log, "config reloaded").len();
    j.apply(&route("sim-b", &sim_addr));
    let t_cm = j.wait("the ConfigMap rewritten", Duration::from_secs(60), || {
        let cm = j.json(&["get", "configmap", "tailwarden-route-chat", "-n", APP_NS]);
        cm["data"]["route.yaml"]
            .as_str()?
            .contains("name: sim-b")
            .then(now)
    });
    let (t_reload, _) = j.wait(
        "the sidecar reloaded from the volume",
        Duration::from_secs(90),
        || {
            sidecar_events(&sidecar_log, "config reloaded")
                .into_iter()
                .nth(reloads_before)
        },
    );
    j.wait("the app answered by sim-b", Duration::from_secs(30), || {
        app_events(&app_log, "request")
            .iter()
            .any(|r| r["ok"] == true && r["provider"] == "sim-b")
            .then_some(())
    });
    let new_link = j.volume_data_link(&pod, "tailwarden-config");
    assert_ne!(config_link, new_link, "the ..data symlink was not swapped");
    assert!(failures(&app_log).is_empty(), "{:?}", failures(&app_log));
    let reload_delay = t_reload - t_cm;
    eprintln!("           ConfigMap change → sidecar reloaded: {reload_delay:.1}s");
    j.timings
        .push(("ConfigMap change → sidecar reloaded", reload_delay));
    j.step(&format!(
        "route change reached the running sidecar ({config_link} → {new_link}), zero failed requests"
    ));

    // Secret rotation: the new key reaches the running sidecar through its Secret volume.
    let keys_link = j.volume_data_link(&pod, "tailwarden-keys");
    let t = Instant::now();
    j.apply(&secret(KEY_2));
    j.wait(
        "the rotated key used upstream",
        Duration::from_secs(90),
        || {
            (sim.stats().last_authorization.as_deref() == Some(format!("Bearer {KEY_2}").as_str()))
                .then_some(())
        },
    );
    j.time("Secret rotated → new key used upstream", t);
    assert_ne!(keys_link, j.volume_data_link(&pod, "tailwarden-keys"));
    let pod_now = j.json(&["get", "pod", &pod_name, "-n", APP_NS]);
    let status = &pod_now["status"]["initContainerStatuses"][0];
    assert_eq!(status["restartCount"], 0, "{status}");
    assert_eq!(status["containerID"], sidecar_id.as_str(), "{status}");
    assert!(failures(&app_log).is_empty(), "{:?}", failures(&app_log));
    j.step("a rotated Secret's key is used without a restart");

    // Deleting the pod while a stream is in flight.
    let streams_done = app_events(&app_log, "stream").len();
    j.wait("a stream under way", Duration::from_secs(30), || {
        (app_events(&app_log, "stream").len() > streams_done).then_some(())
    });
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    j.kubectl(&["delete", "pod", &pod_name, "-n", APP_NS, "--wait=false"]);
    j.wait("the pod gone", Duration::from_secs(90), || {
        (!j.cp
            .kubectl(&["get", "pod", &pod_name, "-n", APP_NS], None)
            .ok)
            .then_some(())
    });
    j.time("pod deleted → gone", t);
    let _ = app_follow.wait();
    let _ = sidecar_follow.wait();
    let sigterm = app_events(&app_log, "sigterm");
    assert_eq!(sigterm.len(), 1, "{sigterm:?}");
    let t_sigterm = sigterm[0]["t"].as_f64().unwrap();
    let in_flight = sigterm[0]["in_flight"]
        .as_u64()
        .expect("a stream in flight at SIGTERM");
    let last_stream = app_events(&app_log, "stream")
        .into_iter()
        .find(|s| s["id"] == in_flight)
        .expect("the in-flight stream's result");
    assert_eq!(last_stream["ok"], true, "{last_stream}");
    assert_eq!(last_stream["chunks"], STREAM_TOKENS, "{last_stream}");
    let t_stream_done = last_stream["t"].as_f64().unwrap();
    let exit = app_events(&app_log, "exit");
    assert_eq!(exit.len(), 1, "the app did not exit cleanly");
    assert_eq!(exit[0]["failed"], 0, "{}", exit[0]);
    let t_app_exit = exit[0]["t"].as_f64().unwrap();
    let drain = sidecar_events(&sidecar_log, "shutdown requested: draining");
    let stopped = sidecar_events(&sidecar_log, "stopped");
    assert_eq!(drain.len(), 1, "the sidecar never got SIGTERM");
    assert_eq!(stopped.len(), 1, "the sidecar never stopped");
    let (t_sidecar_term, t_sidecar_stop) = (drain[0].0, stopped[0].0);
    assert!(
        t_sigterm < t_stream_done
            && t_stream_done <= t_app_exit
            && t_app_exit < t_sidecar_term
            && t_sidecar_term <= t_sidecar_stop,
        "termination order: app SIGTERM {t_sigterm}, its stream done {t_stream_done}, app exit \
         {t_app_exit}, sidecar SIGTERM {t_sidecar_term}, sidecar stopped {t_sidecar_stop}"
    );
    j.step(&format!(
        "delete: app SIGTERM → its stream finished {:.2}s later → app exit → sidecar SIGTERM {:.2}s after the app exited → sidecar stopped",
        t_stream_done - t_sigterm,
        t_sidecar_term - t_app_exit
    ));
    let replacement = j.web_pod(Duration::from_secs(120));
    assert_ne!(replacement["metadata"]["name"], pod_name.as_str());
    j.kubectl(&["delete", "deployment", "web", "-n", APP_NS, "--wait=true"]);

    // Deleting the route garbage-collects its ConfigMap.
    j.kubectl(&["delete", "ir", "chat", "-n", APP_NS]);
    j.wait(
        "ConfigMap garbage-collected",
        Duration::from_secs(60),
        || {
            (!j.cp
                .kubectl(
                    &["get", "configmap", "tailwarden-route-chat", "-n", APP_NS],
                    None,
                )
                .ok)
                .then_some(())
        },
    );
    j.step("route deleted, its ConfigMap collected");

    // The operator logs, kept before uninstall for the key check below.
    let mut operator_logs = String::new();
    for name in &names {
        operator_logs.push_str(&j.kubectl(&["logs", "-n", NS, name]));
    }

    // RBAC can fail, visibly: the operator image under a ServiceAccount with everything but
    // ConfigMap writes (the chart's operators scaled away so it can lead).
    j.kubectl(&["scale", "deployment", OPERATOR, "-n", NS, "--replicas=0"]);
    j.wait("the operator pods gone", Duration::from_secs(60), || {
        let pods = j.json(&[
            "get",
            "pods",
            "-n",
            NS,
            "-l",
            "app.kubernetes.io/component=operator",
        ]);
        pods["items"].as_array()?.is_empty().then_some(())
    });
    j.kubectl(&["delete", "lease", OPERATOR, "-n", NS, "--ignore-not-found"]);
    let role = j.json(&["get", "clusterrole", OPERATOR]);
    let mut rules: Vec<Value> = role["rules"].as_array().unwrap().clone();
    rules.retain(|r| r["resources"][0] != "configmaps");
    j.apply(
        &serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "tailwarden-limited"}, "rules": rules
        })
        .to_string(),
    );
    j.kubectl(&["create", "serviceaccount", "limited", "-n", NS]);
    j.kubectl(&[
        "create",
        "clusterrolebinding",
        "tailwarden-limited",
        "--clusterrole=tailwarden-limited",
        &format!("--serviceaccount={NS}:limited"),
    ]);
    j.kubectl(&[
        "create",
        "rolebinding",
        "tailwarden-limited-self",
        "-n",
        NS,
        "--role=tailwarden-operator-self",
        &format!("--serviceaccount={NS}:limited"),
    ]);
    j.apply(&route("sim-a", &sim_addr));
    j.apply(&serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "limited", "namespace": NS},
        "spec": {
            "serviceAccountName": "limited",
            "securityContext": {"runAsNonRoot": true},
            "containers": [{
                "name": "operator", "image": operator_image, "imagePullPolicy": "Never",
                "args": ["run", "--leader-elect=true", "--webhook-listen=0.0.0.0:9443",
                         "--metrics-listen=0.0.0.0:8080", "--webhook-config-name=tailwarden",
                         "--webhook-service=tailwarden-webhook",
                         "--tls-secret=tailwarden-webhook-tls",
                         format!("--sidecar-image={sidecar_image}")],
                "env": [
                    {"name": "POD_NAMESPACE", "value": NS},
                    {"name": "POD_NAME", "value": "limited"}],
                "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false}
            }]
        }
    })
    .to_string());
    let limited_log = j.wait(
        "the RBAC failure in the limited operator's log",
        Duration::from_secs(90),
        || {
            let out = j.cp.kubectl(&["logs", "-n", NS, "limited"], None);
            (out.ok && out.stdout.contains("forbidden") && out.stdout.contains("configmaps"))
                .then_some(out.stdout)
        },
    );
    let cm = j.cp.kubectl(
        &["get", "configmap", "tailwarden-route-chat", "-n", APP_NS],
        None,
    );
    assert!(!cm.ok, "no ConfigMap without the RBAC rule");
    j.kubectl(&["delete", "pod", "limited", "-n", NS, "--wait=true"]);
    j.kubectl(&["delete", "ir", "chat", "-n", APP_NS]);
    for obj in [
        "clusterrolebinding/tailwarden-limited",
        "clusterrole/tailwarden-limited",
    ] {
        j.kubectl(&["delete", obj]);
    }
    j.kubectl(&[
        "delete",
        "rolebinding/tailwarden-limited-self",
        "serviceaccount/limited",
        "-n",
        NS,
    ]);
    j.step("a missing RBAC rule fails visibly");

    // helm uninstall leaves nothing of the release behind (the CRD stays, by Helm's design;
    // so does the namespace --create-namespace made).
    let t = Instant::now();
    let out =
        j.cp.helm(&["uninstall", "tailwarden", "--namespace", NS, "--wait"]);
    assert!(out.ok, "helm uninstall: {}", out.text);
    j.wait("nothing of the release left", Duration::from_secs(60), || {
        let left = j.cp.kubectl(
            &[
                "get",
                "all,configmaps,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,leases",
                "-n",
                NS,
                "-o",
                "name",
            ],
            None,
        );
        let cluster = j.cp.kubectl(
            &[
                "get",
                "clusterroles,clusterrolebindings,mutatingwebhookconfigurations",
                "-l",
                "app.kubernetes.io/instance=tailwarden",
                "-o",
                "name",
            ],
            None,
        );
        let left: Vec<&str> = left
            .stdout
            .lines()
            .filter(|l| {
                // What Kubernetes itself keeps in every namespace.
                *l != "configmap/kube-root-ca.crt" && *l != "serviceaccount/default"
            })
            .collect();
        (left.is_empty() && cluster.ok && cluster.stdout.trim().is_empty()).then_some(())
    });
    j.time("helm uninstall → nothing left", t);
    j.step("helm uninstall left nothing");

    // No key in any log.
    let sidecar_text = fs::read_to_string(&sidecar_log).unwrap_or_default();
    let app_text = fs::read_to_string(&app_log).unwrap_or_default();
    for (name, text) in [
        ("operator", &operator_logs),
        ("sidecar", &sidecar_text),
        ("app", &app_text),
        ("limited operator", &limited_log),
    ] {
        for key in [KEY_1, KEY_2] {
            assert!(
                !text.contains(key),
                "the API key appeared in the {name} log"
            );
        }
    }

    eprintln!("journey timings:");
    for (what, s) in &j.timings {
        eprintln!("  {what:<55} {s:>6.1}s");
    }
    eprintln!(
        "  {:<55} {:>6.1}s",
        "whole journey",
        started.elapsed().as_secs_f64()
    );
}
