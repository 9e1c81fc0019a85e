//! The operator on a real kube-apiserver + etcd (+ controller-manager, scheduler and kwok),
//! brought up on loopback by e2e/controlplane/up.sh: CEL rejections by the API server,
//! reconcile to a ConfigMap and status, Secrets appearing, spec changes, hand edits put
//! back, injection through the real admission chain, and admission with the webhook down.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::core::v1::{ConfigMap, Namespace, Pod, Secret},
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, Config, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::json;
use tailwarden_crds::InferenceRoute;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shared harness (e2e/src/controlplane.rs), plus a kube client and a `kubectl` that
/// returns (success, output).
struct ControlPlane(tailwarden_e2e::controlplane::ControlPlane);

impl ControlPlane {
    fn up() -> Self {
        match tailwarden_e2e::controlplane::ControlPlane::up("op-cluster") {
            Ok(cp) => Self(cp),
            Err(e) => panic!("{e}"),
        }
    }

    async fn client(&self) -> Client {
        let kubeconfig = Kubeconfig::read_from(self.0.var("KUBECONFIG")).unwrap();
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap();
        Client::try_from(config).unwrap()
    }

    fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> (bool, String) {
        let out = self.0.kubectl(args, stdin);
        (out.ok, out.text)
    }

    fn var(&self, key: &str) -> &str {
        self.0.var(key)
    }
}

/// The operator binary, killed on drop.
struct Operator(Child);

impl Operator {
    fn start(cp: &ControlPlane, webhook_port: u16, log: &Path) -> Self {
        let log_file = std::fs::File::create(log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tailwarden-operator"))
            .args([
                "run",
                "--webhook-listen",
                &format!("127.0.0.1:{webhook_port}"),
                "--metrics-listen",
                "127.0.0.1:0",
                "--leader-elect=false",
                "--sidecar-image",
                "tailwarden/sidecar:test",
                "--webhook-ip-san",
                "127.0.0.1",
                // Opted in: the keys of routes in shop are checked (tests/rbac.rs has the
                // default, no Secret access, under the chart's own RBAC).
                "--secret-namespaces",
                "shop",
            ])
            .env("KUBECONFIG", cp.var("KUBECONFIG"))
            .env("POD_NAMESPACE", "tailwarden-system")
            .env("POD_NAME", "test-operator")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap();
        Self(child)
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An operator replica with leader election on.
struct LeaderOperator(Child);

impl LeaderOperator {
    fn start(cp: &ControlPlane, identity: &str, log: &Path) -> Self {
        let log_file = std::fs::File::create(log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tailwarden-operator"))
            .args([
                "run",
                "--webhook-listen",
                &format!("127.0.0.1:{}", free_port()),
                "--metrics-listen",
                "127.0.0.1:0",
                "--leader-elect=true",
                "--sidecar-image",
                "tailwarden/sidecar:test",
            ])
            .env("KUBECONFIG", cp.var("KUBECONFIG"))
            .env("POD_NAMESPACE", "tailwarden-system")
            .env("POD_NAME", identity)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap();
        Self(child)
    }

    fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

impl Drop for LeaderOperator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn condition(route: &InferenceRoute, kind: &str) -> Option<(String, String, String)> {
    route
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

const ROUTE: &str = r#"
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: chat, namespace: shop}
spec:
  models: [gpt-4.1]
  providers:
  - name: primary
    baseUrl: https://api.openai.com/v1
    auth: {secretRef: {name: openai, key: apiKey}}
  - name: local
    baseUrl: http://vllm.shop.svc:8000/v1
    priority: 1
  timeouts: {firstByte: 10s, total: 60s}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_on_a_real_api_server() {
    let cp = ControlPlane::up();
    let client = cp.client().await;
    let logs = tempdir();

    // The generated CRD installs and is established.
    let (ok, out) = cp.kubectl(
        &[
            "apply",
            "--server-side",
            "-f",
            root().join("crds/inferenceroute.yaml").to_str().unwrap(),
        ],
        None,
    );
    assert!(ok, "{out}");
    let (ok, out) = cp.kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "crd/inferenceroutes.tailwarden.io",
            "--timeout=30s",
        ],
        None,
    );
    assert!(ok, "{out}");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    assert!(crds.get("inferenceroutes.tailwarden.io").await.is_ok());
    for ns in ["shop", "tailwarden-system", "plain"] {
        let ns_obj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns_obj)
            .await
            .unwrap();
    }

    // Invalid routes are rejected by the API server with our CEL messages.
    for (edit, message) in [
        (
            ("total: 60s", "total: 5s"),
            "spec.timeouts.firstByte: Invalid value: \"object\": firstByte must not exceed total",
        ),
        (
            ("name: local", "name: primary"),
            "provider names must be unique",
        ),
        (
            ("priority: 1", "priority: 1\n    weight: 150"),
            "spec.providers[1].weight: Invalid value: \"object\": weight must be between 0 and 100",
        ),
        (
            (
                "https://api.openai.com/v1",
                "https://user:pw@api.openai.com/v1",
            ),
            "baseUrl must be an http:// or https:// URL with no user name, password, query or fragment",
        ),
    ] {
        let bad = ROUTE
            .replace(edit.0, edit.1)
            .replace("name: chat", "name: bad");
        let (ok, out) = cp.kubectl(&["apply", "-f", "-"], Some(&bad));
        assert!(!ok, "accepted: {bad}");
        assert!(out.contains(message), "wanted {message:?} in: {out}");
    }

    // The webhook configuration, pointed at the operator on loopback.
    let port = free_port();
    let helm = cp.var("HELM");
    let rendered = Command::new(helm)
        .args([
            "template",
            "tailwarden",
            "charts/tailwarden",
            "-n",
            "tailwarden-system",
            "-s",
            "templates/webhook.yaml",
        ])
        .args(["--set", &format!("webhook.url=https://127.0.0.1:{port}")])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let (ok, out) = cp.kubectl(
        &["apply", "-f", "-"],
        Some(&String::from_utf8_lossy(&rendered.stdout)),
    );
    assert!(ok, "{out}");

    let operator = Operator::start(&cp, port, &logs.join("operator.log"));

    // A valid route whose Secret is missing: published, but ResolvedRefs and Ready say why.
    let (ok, out) = cp.kubectl(&["apply", "-f", "-"], Some(ROUTE));
    assert!(ok, "{out}");
    let routes: Api<InferenceRoute> = Api::namespaced(client.clone(), "shop");
    let route = eventually("ResolvedRefs=False", Duration::from_secs(60), || async {
        let r = routes.get("chat").await.ok()?;
        (condition(&r, "ResolvedRefs")?.0 == "False").then_some(r)
    })
    .await;
    assert_eq!(
        condition(&route, "ResolvedRefs").unwrap(),
        (
            "False".into(),
            "SecretMissing".into(),
            "provider primary: Secret openai does not exist".into()
        )
    );
    assert_eq!(condition(&route, "Accepted").unwrap().0, "True");
    assert_eq!(condition(&route, "Ready").unwrap().1, "RefsNotResolved");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "shop");
    let cm = cms.get("tailwarden-route-chat").await.unwrap();
    let config = cm.data.as_ref().unwrap()["route.yaml"].clone();
    assert!(
        config.contains("file: /var/run/tailwarden/keys/openai/apiKey"),
        "{config}"
    );
    assert_eq!(cm.owner_references()[0].name, "chat");
    // The rendered config is what the sidecar accepts.
    tailwarden_crds::load_str("route.yaml", &config).unwrap();

    // The Secret appears: the Secret watch brings the route to Ready.
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "openai", "namespace": "shop"},
        "stringData": {"apiKey": "sk-canary-never-logged"}
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let route = eventually("Ready=True", Duration::from_secs(60), || async {
        let r = routes.get("chat").await.ok()?;
        (condition(&r, "Ready")?.0 == "True").then_some(r)
    })
    .await;
    let status = route.status.clone().unwrap();
    assert_eq!(status.observed_generation, Some(1));
    let hash = status.config_hash.clone().unwrap();
    assert_eq!(cm.annotations()["tailwarden.io/config-hash"], hash);

    // A spec change: new ConfigMap content and observedGeneration.
    let patch = json!({"spec": {"timeouts": {"firstByte": "5s", "total": "30s"}}});
    routes
        .patch("chat", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    eventually("observedGeneration 2", Duration::from_secs(60), || async {
        let r = routes.get("chat").await.ok()?;
        (r.status?.observed_generation == Some(2)).then_some(())
    })
    .await;
    let config = cms
        .get("tailwarden-route-chat")
        .await
        .unwrap()
        .data
        .unwrap()["route.yaml"]
        .clone();
    assert!(config.contains("total: 30s"), "{config}");

    // A hand edit of the ConfigMap is put back.
    let vandal = json!({"data": {"route.yaml": "garbage"}});
    cms.patch(
        "tailwarden-route-chat",
        &PatchParams::default(),
        &Patch::Merge(&vandal),
    )
    .await
    .unwrap();
    eventually("ConfigMap restored", Duration::from_secs(60), || async {
        let cm = cms.get("tailwarden-route-chat").await.ok()?;
        (cm.data?["route.yaml"] == config).then_some(())
    })
    .await;

    // Injection through the real admission chain, per the truth table.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    let pod = |name: &str, annotations: serde_json::Value, host_network: bool| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"generateName": format!("{name}-"), "namespace": "shop", "annotations": annotations},
            "spec": {"hostNetwork": host_network, "containers": [{"name": "app", "image": "example/app:1"}]}
        }))
        .unwrap()
    };
    // The webhook's caches and certificate need a moment after start.
    let injected = eventually(
        "a pod comes back injected",
        Duration::from_secs(60),
        || async {
            let created = pods
                .create(
                    &PostParams::default(),
                    &pod("opted", json!({"tailwarden.io/routes": "chat"}), false),
                )
                .await
                .ok()?;
            let injected = created
                .spec
                .as_ref()?
                .init_containers
                .as_ref()
                .is_some_and(|c| c.iter().any(|c| c.name == "tailwarden-sidecar"));
            if !injected {
                let _ = pods
                    .delete(&created.name_any(), &DeleteParams::default())
                    .await;
            }
            injected.then_some(created)
        },
    )
    .await;
    let spec = injected.spec.clone().unwrap();
    let sidecar = &spec.init_containers.as_ref().unwrap()[0];
    assert_eq!(sidecar.name, "tailwarden-sidecar");
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    assert_eq!(sidecar.image.as_deref(), Some("tailwarden/sidecar:test"));
    let sc = sidecar.security_context.clone().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.run_as_non_root, Some(true));
    let env = spec.containers[0].env.clone().unwrap();
    assert!(
        env.iter().any(|e| e.name == "OPENAI_BASE_URL"
            && e.value.as_deref() == Some("http://127.0.0.1:15080/v1"))
    );
    assert!(
        env.iter().any(|e| e.name == "OPENAI_API_KEY"
            && e.value.as_deref() == Some("tailwarden-injected-placeholder")),
        "{env:?}"
    );
    let volumes: Vec<String> = spec
        .volumes
        .unwrap()
        .iter()
        .map(|v| v.name.clone())
        .collect();
    assert!(
        volumes.contains(&"tailwarden-config".into())
            && volumes.contains(&"tailwarden-keys".into()),
        "{volumes:?}"
    );
    assert_eq!(injected.labels()["tailwarden.io/injected"], "true");

    let not_injected = |p: &Pod| {
        !p.spec
            .as_ref()
            .unwrap()
            .init_containers
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c.name == "tailwarden-sidecar"))
    };
    for (name, annotations, host) in [
        ("plain", json!({}), false),
        (
            "optout",
            json!({"tailwarden.io/routes": "chat", "tailwarden.io/inject": "disabled"}),
            false,
        ),
        ("hostnet", json!({"tailwarden.io/routes": "chat"}), true),
        ("unknown", json!({"tailwarden.io/routes": "nope"}), false),
    ] {
        let created = pods
            .create(&PostParams::default(), &pod(name, annotations, host))
            .await
            .unwrap();
        assert!(not_injected(&created), "{name} must not be injected");
    }
    // A namespace label opts every pod in.
    let label = json!({"metadata": {"labels": {"tailwarden.io/inject": "enabled"}}});
    Api::<Namespace>::all(client.clone())
        .patch("shop", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    eventually(
        "namespace label honoured",
        Duration::from_secs(30),
        || async {
            let created = pods
                .create(&PostParams::default(), &pod("bylabel", json!({}), false))
                .await
                .ok()?;
            (!not_injected(&created)).then_some(())
        },
    )
    .await;

    // injectedPods counts the running injected pods (kwok runs them).
    eventually("injectedPods >= 2", Duration::from_secs(60), || async {
        let r = routes.get("chat").await.ok()?;
        (r.status?.injected_pods? >= 2).then_some(())
    })
    .await;

    // A Deployment naming a route that does not exist: its pods are admitted un-injected
    // and the skip is an Event (reason UnknownRoute) on their owner, the ReplicaSet.
    let (ok, out) = cp.kubectl(&["apply", "-f", "-"], Some(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: typo, namespace: plain}\nspec:\n  replicas: 1\n  selector: {matchLabels: {app: typo}}\n  template:\n    metadata:\n      labels: {app: typo}\n      annotations: {tailwarden.io/routes: chatt}\n    spec:\n      containers: [{name: app, image: example/app:1}]\n",
    ));
    assert!(ok, "{out}");
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), "plain");
    let event = eventually(
        "UnknownRoute Event on the ReplicaSet",
        Duration::from_secs(60),
        || async {
            let list = events.list(&Default::default()).await.ok()?;
            list.items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("UnknownRoute"))
        },
    )
    .await;
    assert_eq!(
        event.regarding.as_ref().and_then(|r| r.kind.as_deref()),
        Some("ReplicaSet")
    );
    assert!(
        event.note.as_deref().unwrap_or_default().contains("chatt"),
        "{event:?}"
    );

    // With the webhook down, pods are still admitted, un-injected.
    drop(operator);
    let created = pods
        .create(
            &PostParams::default(),
            &pod("down", json!({"tailwarden.io/routes": "chat"}), false),
        )
        .await
        .unwrap();
    assert!(not_injected(&created));

    // The provider key was never logged.
    let log = std::fs::read_to_string(logs.join("operator.log")).unwrap();
    assert!(
        !log.contains("sk-canary-never-logged"),
        "the API key appeared in the operator log"
    );
    assert!(
        log.contains("reconcil") || log.contains("route"),
        "operator logged nothing useful: {log}"
    );

    // Leader election over a real Lease: two replicas, one reconciles; when it goes away the
    // other takes over.
    let mut a = LeaderOperator::start(&cp, "replica-a", &logs.join("a.log"));
    let lease_api: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "tailwarden-system");
    let holder =
        |l: k8s_openapi::api::coordination::v1::Lease| l.spec.and_then(|s| s.holder_identity);
    eventually(
        "replica-a holds the Lease",
        Duration::from_secs(60),
        || async {
            (holder(lease_api.get("tailwarden-operator").await.ok()?)? == "replica-a").then_some(())
        },
    )
    .await;
    let b = LeaderOperator::start(&cp, "replica-b", &logs.join("b.log"));
    let second = ROUTE
        .replace("name: chat", "name: second")
        .replace("[gpt-4.1]", "[gpt-5]");
    let (ok, out) = cp.kubectl(&["apply", "-f", "-"], Some(&second));
    assert!(ok, "{out}");
    eventually(
        "route reconciled by the leader",
        Duration::from_secs(60),
        || async { condition(&routes.get("second").await.ok()?, "Ready").map(|_| ()) },
    )
    .await;
    // SIGTERM: replica-a releases the Lease on the way out, replica-b takes over.
    a.terminate();
    eventually(
        "replica-b holds the Lease",
        Duration::from_secs(30),
        || async {
            (holder(lease_api.get("tailwarden-operator").await.ok()?)? == "replica-b").then_some(())
        },
    )
    .await;
    let third = ROUTE
        .replace("name: chat", "name: third")
        .replace("[gpt-4.1]", "[o3]");
    let (ok, out) = cp.kubectl(&["apply", "-f", "-"], Some(&third));
    assert!(ok, "{out}");
    eventually(
        "route reconciled by the new leader",
        Duration::from_secs(60),
        || async { condition(&routes.get("third").await.ok()?, "Ready").map(|_| ()) },
    )
    .await;
    drop(b);

    // Deleting the route garbage-collects its ConfigMap (the controller-manager's GC).
    routes
        .delete("chat", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "ConfigMap garbage-collected",
        Duration::from_secs(60),
        || async {
            cms.get_opt("tailwarden-route-chat")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tw-op-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
