//! The user journey on a real control plane (`make e2e`): helm install the chart → run the
//! operator under the chart's own ServiceAccount (so the chart's RBAC is what is tested) →
//! kubectl apply a route → Ready → a Deployment opts in → its pods come back injected →
//! the sidecar, fed exactly what the pod would get, serves the OpenAI SDK → a route change
//! reaches the sidecar → deleting the route garbage-collects its ConfigMap → helm uninstall
//! leaves nothing. Also: the operator under a ServiceAccount missing one RBAC rule fails
//! visibly. Every wait has a timeout and, on failure, dumps what it saw.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use tailwarden_e2e::{
    controlplane::{ControlPlane, repo_root},
    fetch,
    proc::{ChildProc, log_tail},
    sidecar::Sidecar,
    sim::{Profile, SimServer},
};

const NS: &str = "tailwarden-system";
// Release "tailwarden" of chart "tailwarden": object names are not doubled.
const SA: &str = "tailwarden-operator";

fn bin(name: &str) -> PathBuf {
    // Workspace binaries sit next to the test's deps/ folder.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} not built (cargo test --workspace builds it)",
        path.display()
    );
    path
}

struct Journey {
    cp: ControlPlane,
    work: PathBuf,
    started: Instant,
}

impl Journey {
    fn step(&self, name: &str) {
        eprintln!("[{:>6.1}s] {name}", self.started.elapsed().as_secs_f64());
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

    /// Polls `check` until it yields, or fails with `dump` output.
    fn wait<T>(
        &self,
        what: &str,
        limit: Duration,
        operator: Option<&ChildProc>,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = check() {
                return v;
            }
            if Instant::now() > deadline {
                let mut dump = String::new();
                for args in [
                    &[
                        "get",
                        "inferenceroutes,configmaps,pods,replicasets,deployments",
                        "-A",
                        "-o",
                        "wide",
                    ][..],
                    &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
                ] {
                    dump.push_str(&self.cp.kubectl(args, None).text);
                }
                if let Some(op) = operator {
                    dump.push_str("\n--- operator log (tail) ---\n");
                    dump.push_str(&log_tail(op.log_path(), 40));
                }
                panic!("timed out after {limit:?} waiting for: {what}\n{dump}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// A kubeconfig for a ServiceAccount of the release namespace.
    fn sa_kubeconfig(&self, sa: &str) -> PathBuf {
        let token = self.kubectl(&["create", "token", sa, "-n", NS, "--duration=1h"]);
        self.cp.token_kubeconfig(sa, token.trim()).unwrap()
    }

    fn operator(&self, kubeconfig: &Path, webhook_port: u16, log: &str) -> ChildProc {
        let mut cmd = Command::new(bin("tailwarden-operator"));
        cmd.args([
            "run",
            "--leader-elect=true",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--webhook-listen", &format!("127.0.0.1:{webhook_port}")])
        .args(["--webhook-config-name", "tailwarden"])
        .args(["--webhook-service", "tailwarden-webhook"])
        .args(["--tls-secret", "tailwarden-webhook-tls"])
        .args([
            "--webhook-ip-san",
            "127.0.0.1",
            "--sidecar-image",
            "ghcr.io/tailwarden/sidecar:0.1.0",
            // The chart's default.
            "--sidecar-max-connections=2000",
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAMESPACE", NS)
        .env("POD_NAME", format!("host-{log}"));
        ChildProc::spawn(
            "tailwarden-operator",
            &cmd,
            &self.work.join(format!("{log}.log")),
        )
        .unwrap()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn route(sim: &str, weight: u32) -> String {
    format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: shop}}\nspec:\n  models: [gpt-4.1]\n  providers:\n  - name: sim\n    baseUrl: http://{sim}/v1\n    weight: {weight}\n    auth: {{secretRef: {{name: openai, key: apiKey}}}}\n  timeouts: {{firstByte: 10s, total: 60s}}\n"
    )
}

#[test]
fn the_user_journey_on_a_real_control_plane() {
    let started = Instant::now();
    let cp = ControlPlane::up("journey").unwrap_or_else(|e| panic!("{e}"));
    let work = cp.dir.join("journey");
    std::fs::create_dir_all(&work).unwrap();
    let j = Journey { cp, work, started };
    j.step("control plane up");

    // The provider: tailwarden-sim on loopback, in-process on its own runtime.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sim = rt
        .block_on(async {
            SimServer::bind(
                "127.0.0.1:0".parse().unwrap(),
                &Profile::builtin("instant").unwrap(),
                42,
            )
            .await
        })
        .unwrap();
    let sim_addr = sim.local_addr().to_string();
    let sim_handle = rt.block_on(async { sim.spawn() });

    // helm install, the webhook pointed at the host-process operator.
    let port = free_port();
    let out = j.cp.helm(&[
        "install",
        "tailwarden",
        "charts/tailwarden",
        "--namespace",
        NS,
        "--create-namespace",
        "--set",
        &format!("webhook.url=https://127.0.0.1:{port}"),
        "--set",
        "webhook.ipSans={127.0.0.1}",
        "--wait=false",
    ]);
    assert!(out.ok, "helm install: {}", out.text);
    j.kubectl(&[
        "wait",
        "--for=condition=Established",
        "crd/inferenceroutes.tailwarden.io",
        "--timeout=60s",
    ]);
    j.step("helm install done");

    // RBAC can fail: a ServiceAccount with everything but ConfigMap writes cannot publish.
    j.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n");
    let secret = "apiVersion: v1\nkind: Secret\nmetadata: {name: openai, namespace: shop}\nstringData: {apiKey: sk-journey-canary}\n";
    j.apply(secret);
    j.apply(&route(&sim_addr, 100));
    let crippled = j.json(&["get", "clusterrole", "tailwarden-operator"]);
    let mut rules: Vec<Value> = crippled["rules"].as_array().unwrap().clone();
    rules.retain(|r| r["resources"][0] != "configmaps");
    let limited = serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "tailwarden-limited"}, "rules": rules
    });
    j.apply(&limited.to_string());
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
    let limited_op = j.operator(&j.sa_kubeconfig("limited"), free_port(), "limited");
    j.wait(
        "the RBAC failure to be logged",
        Duration::from_secs(60),
        Some(&limited_op),
        || {
            let log = std::fs::read_to_string(limited_op.log_path()).ok()?;
            (log.contains("forbidden") && log.contains("configmaps")).then_some(())
        },
    );
    let cm = j.cp.kubectl(
        &["get", "configmap", "tailwarden-route-chat", "-n", "shop"],
        None,
    );
    assert!(!cm.ok, "no ConfigMap without the RBAC rule");
    drop(limited_op);
    j.kubectl(&[
        "delete",
        "lease",
        "tailwarden-operator",
        "-n",
        NS,
        "--ignore-not-found",
    ]);
    j.step("a missing RBAC rule fails visibly");

    // The operator under the chart's own ServiceAccount.
    let operator = j.operator(&j.sa_kubeconfig(SA), port, "operator");
    let ready = j.wait(
        "route Ready",
        Duration::from_secs(90),
        Some(&operator),
        || {
            let r = j.json(&["get", "inferenceroute", "chat", "-n", "shop"]);
            let conds = r["status"]["conditions"].as_array()?.clone();
            conds
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                .then_some(r)
        },
    );
    let hash = ready["status"]["configHash"].as_str().unwrap().to_owned();
    j.step("route Ready under the chart's ServiceAccount");

    // A Deployment opts in; the controller-manager makes pods; the webhook injects them.
    j.apply("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: shop}\nspec:\n  replicas: 2\n  selector: {matchLabels: {app: web}}\n  template:\n    metadata:\n      labels: {app: web}\n      annotations: {tailwarden.io/routes: chat}\n    spec:\n      containers: [{name: web, image: example/web:1}]\n");
    let pod = j.wait(
        "injected, running pods",
        Duration::from_secs(90),
        Some(&operator),
        || {
            let pods = j.json(&["get", "pods", "-n", "shop", "-l", "app=web"]);
            let items = pods["items"].as_array()?.clone();
            let ready = items
                .iter()
                .filter(|p| p["status"]["phase"] == "Running")
                .count();
            (items.len() == 2 && ready == 2).then(|| items[0].clone())
        },
    );
    let init = &pod["spec"]["initContainers"][0];
    assert_eq!(init["name"], "tailwarden-sidecar");
    assert_eq!(init["restartPolicy"], "Always");
    assert_eq!(init["image"], "ghcr.io/tailwarden/sidecar:0.1.0");
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
    let volumes = pod["spec"]["volumes"].as_array().unwrap();
    let config_vol = volumes
        .iter()
        .find(|v| v["name"] == "tailwarden-config")
        .unwrap();
    assert_eq!(
        config_vol["projected"]["sources"][0]["configMap"]["name"],
        "tailwarden-route-chat"
    );
    let keys_vol = volumes
        .iter()
        .find(|v| v["name"] == "tailwarden-keys")
        .unwrap();
    assert_eq!(
        keys_vol["projected"]["sources"][0]["secret"]["name"],
        "openai"
    );
    j.wait(
        "injectedPods = 2",
        Duration::from_secs(60),
        Some(&operator),
        || {
            let r = j.json(&["get", "inferenceroute", "chat", "-n", "shop"]);
            (r["status"]["injectedPods"] == 2).then_some(())
        },
    );
    j.step("pods injected");

    // The sidecar as the pod would run it: the ConfigMap's file in a config directory, the
    // Secret's key under the keys directory (the one change: a temp root instead of
    // /var/run/tailwarden/keys, since this is a host process).
    let config_dir = j.work.join("routes");
    let keys_root = j.work.join("keys");
    std::fs::create_dir_all(config_dir.clone()).unwrap();
    std::fs::create_dir_all(keys_root.join("openai")).unwrap();
    let write_config = |j: &Journey| {
        let cm = j.json(&["get", "configmap", "tailwarden-route-chat", "-n", "shop"]);
        let text = cm["data"]["route.yaml"]
            .as_str()
            .unwrap()
            .replace("/var/run/tailwarden/keys", keys_root.to_str().unwrap());
        let tmp = config_dir.join(".chat.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, config_dir.join("chat.yaml")).unwrap();
    };
    write_config(&j);
    // What the kubelet would project from the Secret created above.
    std::fs::write(keys_root.join("openai/apiKey"), "sk-journey-canary").unwrap();
    let sidecar = Sidecar::start(
        &bin("tailwarden-sidecar"),
        &config_dir,
        &j.work.join("sidecar.log"),
    )
    .unwrap();
    let status = fetch::get(sidecar.admin, "/config", Duration::from_secs(2)).unwrap();
    assert!(
        status.text().contains("\"lastError\": null"),
        "{}",
        status.text()
    );

    // The real OpenAI Python SDK, configured by its base URL only.
    let python = repo_root().join(".cache/venv/bin/python");
    let sdk = Command::new(&python)
        .args(["-c", "import openai; c = openai.OpenAI(max_retries=0); r = c.chat.completions.with_raw_response.create(model='gpt-4.1', messages=[{'role':'user','content':'hi'}]); print(r.headers['x-tailwarden-provider'], r.parse().choices[0].message.content[:20])"])
        .env("OPENAI_BASE_URL", sidecar.base_url())
        .env("OPENAI_API_KEY", "unused-by-the-sidecar")
        .output()
        .expect("python from `make sdk-deps`");
    assert!(
        sdk.status.success(),
        "OpenAI SDK: {}",
        String::from_utf8_lossy(&sdk.stderr)
    );
    assert!(
        String::from_utf8_lossy(&sdk.stdout).starts_with("sim "),
        "{}",
        String::from_utf8_lossy(&sdk.stdout)
    );
    let stats = rt.block_on(async { sim_handle.stats() });
    assert_eq!(
        stats.last_authorization.as_deref(),
        Some("Bearer sk-journey-canary")
    );
    j.step("the OpenAI SDK got an answer through the sidecar");

    // A route change: new ConfigMap, new status hash, and the sidecar picks it up.
    j.apply(&route(&sim_addr, 50).replace("total: 60s", "total: 45s"));
    let new_hash = j.wait(
        "a new configHash",
        Duration::from_secs(60),
        Some(&operator),
        || {
            let r = j.json(&["get", "inferenceroute", "chat", "-n", "shop"]);
            let h = r["status"]["configHash"].as_str()?.to_owned();
            (h != hash && r["status"]["observedGeneration"] == 2).then_some(h)
        },
    );
    write_config(&j);
    j.wait("the sidecar reloads", Duration::from_secs(30), None, || {
        let c = fetch::get(sidecar.admin, "/config", Duration::from_secs(2)).ok()?;
        c.text().contains("\"total\": \"45s\"").then_some(())
    });
    assert_ne!(new_hash, hash);
    j.step("route change reached the sidecar");

    // Deleting the route garbage-collects its ConfigMap.
    j.kubectl(&["delete", "inferenceroute", "chat", "-n", "shop"]);
    j.wait(
        "ConfigMap garbage-collected",
        Duration::from_secs(60),
        Some(&operator),
        || {
            (!j.cp
                .kubectl(
                    &["get", "configmap", "tailwarden-route-chat", "-n", "shop"],
                    None,
                )
                .ok)
                .then_some(())
        },
    );
    j.step("route deleted, ConfigMap collected");

    // helm uninstall leaves nothing of the release behind (the CRD stays, by Helm's design).
    drop(operator);
    let out =
        j.cp.helm(&["uninstall", "tailwarden", "--namespace", NS, "--wait"]);
    assert!(out.ok, "helm uninstall: {}", out.text);
    j.wait(
        "no release objects left",
        Duration::from_secs(60),
        None,
        || {
            let left = j.cp.kubectl(
                &[
                    "get",
                    "deployments,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets",
                    "-n",
                    NS,
                    "-l",
                    "app.kubernetes.io/instance=tailwarden",
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
            (left.ok
                && left.stdout.trim().is_empty()
                && cluster.ok
                && cluster.stdout.trim().is_empty())
            .then_some(())
        },
    );
    j.step("helm uninstall left nothing");

    // No key in any log.
    for log in ["operator.log", "sidecar.log", "limited.log"] {
        let text = std::fs::read_to_string(j.work.join(log)).unwrap_or_default();
        assert!(
            !text.contains("sk-journey-canary"),
            "the API key appeared in {log}"
        );
    }
    drop(sidecar);
}
