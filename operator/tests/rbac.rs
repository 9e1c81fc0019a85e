//! Least privilege for Secrets on a real kube-apiserver + etcd, with the chart's own RBAC
//! (rendered by the real helm, applied as the cluster admin) and the operator running under
//! the chart's ServiceAccount (a token from the TokenRequest API):
//!
//! - the ServiceAccount cannot get or list a Secret in a namespace that was not opted in, nor
//!   list Secrets cluster-wide (the API server answers 403);
//! - in the opted-in namespace (`operator.secretAccess.namespaces`) a route goes
//!   `ResolvedRefs=False SecretMissing` → `True AllResolved` when its Secret appears;
//! - in any other namespace a route whose Secret exists is still published and `Ready`, with
//!   `ResolvedRefs=Unknown NotChecked`, and the operator never asked for that Secret;
//! - the operator still manages its webhook TLS Secret, by name, in its own namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::{
    Api, Client, Config,
    api::{ListParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::json;
use tailwarden_crds::InferenceRoute;
use tailwarden_e2e::{
    controlplane::{ControlPlane, repo_root},
    proc::ChildProc,
};

const NS: &str = "tailwarden-system";
const SA: &str = "tailwarden-operator";
const CANARY: &str = "sk-rbac-canary-never-read";

async fn client(kubeconfig: &Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(kubeconfig).unwrap();
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

fn kubectl(cp: &ControlPlane, args: &[&str], stdin: Option<&str>) -> String {
    let out = cp.kubectl(args, stdin);
    assert!(out.ok, "kubectl {args:?}: {}", out.text);
    out.stdout
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn eventually<T, F, Fut>(what: &str, log: &Path, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!("timed out waiting for: {what}\n--- operator log ---\n{log}");
        }
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

fn route(namespace: &str, secret: &str) -> String {
    format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: {namespace}}}\nspec:\n  models: [gpt-4.1]\n  providers:\n  - name: primary\n    baseUrl: https://api.openai.com/v1\n    auth: {{secretRef: {{name: {secret}, key: apiKey}}}}\n"
    )
}

fn forbidden<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: want 403 Forbidden, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_reads_no_secret_outside_the_namespaces_opted_in() {
    let cp = ControlPlane::up("op-rbac").unwrap_or_else(|e| panic!("{e}"));
    let admin = client(Path::new(cp.var("KUBECONFIG"))).await;
    kubectl(
        &cp,
        &[
            "apply",
            "--server-side",
            "-f",
            repo_root()
                .join("crds/inferenceroute.yaml")
                .to_str()
                .unwrap(),
        ],
        None,
    );
    for ns in [NS, "shop", "other"] {
        kubectl(&cp, &["create", "namespace", ns], None);
    }
    kubectl(
        &cp,
        &[
            "wait",
            "--for=condition=Established",
            "crd/inferenceroutes.tailwarden.io",
            "--timeout=30s",
        ],
        None,
    );

    // The chart's ServiceAccount, RBAC and webhook configuration, shop opted in.
    let port = free_port();
    let rendered = Command::new(cp.var("HELM"))
        .args(["template", "tailwarden", "charts/tailwarden", "-n", NS])
        .args(["-s", "templates/serviceaccount.yaml"])
        .args(["-s", "templates/rbac.yaml"])
        .args(["-s", "templates/webhook.yaml"])
        .args(["--set", &format!("webhook.url=https://127.0.0.1:{port}")])
        .args(["--set", "operator.secretAccess.namespaces={shop}"])
        .current_dir(repo_root())
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    kubectl(
        &cp,
        &["apply", "-f", "-"],
        Some(&String::from_utf8_lossy(&rendered.stdout)),
    );

    // A credential in a namespace nobody opted in.
    let secret = |ns: &str, name: &str| -> Secret {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "stringData": {"apiKey": CANARY}
        }))
        .unwrap()
    };
    Api::<Secret>::namespaced(admin.clone(), "other")
        .create(&PostParams::default(), &secret("other", "creds"))
        .await
        .unwrap();

    let token = kubectl(
        &cp,
        &["create", "token", SA, "-n", NS, "--duration=1h"],
        None,
    );
    let sa_kubeconfig = cp.token_kubeconfig(SA, token.trim()).unwrap();
    let sa = client(&sa_kubeconfig).await;

    // The ServiceAccount cannot read that Secret, nor list any Secret outside shop.
    let other: Api<Secret> = Api::namespaced(sa.clone(), "other");
    forbidden("get a Secret in other", other.get("creds").await);
    forbidden(
        "list Secrets in other",
        other.list(&ListParams::default()).await,
    );
    forbidden(
        "list Secret metadata in other",
        other.list_metadata(&ListParams::default()).await,
    );
    forbidden(
        "list Secrets cluster-wide",
        Api::<Secret>::all(sa.clone())
            .list(&ListParams::default())
            .await,
    );
    forbidden(
        "watch Secret metadata cluster-wide",
        Api::<Secret>::all(sa.clone())
            .list_metadata(&ListParams::default())
            .await,
    );
    // In its own namespace it may not read other Secrets either (only its TLS Secret).
    Api::<Secret>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &secret(NS, "unrelated"))
        .await
        .unwrap();
    forbidden(
        "get another Secret in the release namespace",
        Api::<Secret>::namespaced(sa.clone(), NS)
            .get("unrelated")
            .await,
    );
    // In the opted-in namespace it may.
    Api::<Secret>::namespaced(sa.clone(), "shop")
        .list_metadata(&ListParams::default())
        .await
        .expect("shop is opted in");

    // The operator under that ServiceAccount, as the chart runs it.
    let log = cp.dir.join("rbac-operator.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tailwarden-operator"));
    cmd.args([
        "run",
        "--leader-elect=false",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .args(["--webhook-listen", &format!("127.0.0.1:{port}")])
    .args(["--webhook-config-name", "tailwarden"])
    .args(["--webhook-service", "tailwarden-webhook"])
    .args(["--tls-secret", "tailwarden-webhook-tls"])
    .args(["--webhook-ip-san", "127.0.0.1"])
    .args(["--sidecar-image", "tailwarden/sidecar:test"])
    .args(["--secret-namespaces", "shop"])
    .env("KUBECONFIG", &sa_kubeconfig)
    .env("POD_NAMESPACE", NS)
    .env("POD_NAME", "rbac-operator");
    let _operator = ChildProc::spawn("tailwarden-operator", &cmd, &log).unwrap();

    // Opted in: the missing Secret is named, then its creation resolves the route.
    kubectl(&cp, &["apply", "-f", "-"], Some(&route("shop", "openai")));
    let shop: Api<InferenceRoute> = Api::namespaced(admin.clone(), "shop");
    let r = eventually("shop: ResolvedRefs=False", &log, || async {
        let r = shop.get("chat").await.ok()?;
        (condition(&r, "ResolvedRefs")?.0 == "False").then_some(r)
    })
    .await;
    assert_eq!(
        condition(&r, "ResolvedRefs").unwrap(),
        (
            "False".into(),
            "SecretMissing".into(),
            "provider primary: Secret openai does not exist".into()
        )
    );
    assert_eq!(condition(&r, "Ready").unwrap().1, "RefsNotResolved");
    Api::<Secret>::namespaced(admin.clone(), "shop")
        .create(&PostParams::default(), &secret("shop", "openai"))
        .await
        .unwrap();
    let r = eventually("shop: ResolvedRefs=True", &log, || async {
        let r = shop.get("chat").await.ok()?;
        (condition(&r, "ResolvedRefs")?.0 == "True").then_some(r)
    })
    .await;
    assert_eq!(condition(&r, "ResolvedRefs").unwrap().1, "AllResolved");
    assert_eq!(condition(&r, "Ready").unwrap().0, "True");

    // Not opted in: published and Ready, the keys reported as not checked.
    kubectl(&cp, &["apply", "-f", "-"], Some(&route("other", "creds")));
    let other_routes: Api<InferenceRoute> = Api::namespaced(admin.clone(), "other");
    let r = eventually("other: ResolvedRefs=Unknown", &log, || async {
        let r = other_routes.get("chat").await.ok()?;
        (condition(&r, "ResolvedRefs")?.0 == "Unknown").then_some(r)
    })
    .await;
    let (_, reason, message) = condition(&r, "ResolvedRefs").unwrap();
    assert_eq!(reason, "NotChecked");
    assert!(
        message.contains("namespace other") && message.contains("creds/apiKey"),
        "{message}"
    );
    let (ready, ready_reason, _) = condition(&r, "Ready").unwrap();
    assert_eq!(
        (ready.as_str(), ready_reason.as_str()),
        ("True", "Published")
    );
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), "other")
        .get("tailwarden-route-chat")
        .await
        .unwrap();
    assert!(cm.data.unwrap()["route.yaml"].contains("file: /var/run/tailwarden/keys/creds/apiKey"));

    // Its own webhook TLS Secret, made under the name-limited Role.
    let tls = Api::<Secret>::namespaced(admin.clone(), NS)
        .get("tailwarden-webhook-tls")
        .await
        .expect("the operator created its TLS Secret");
    assert_eq!(tls.type_.as_deref(), Some("kubernetes.io/tls"));

    // It never asked for a Secret it may not read, and never logged a value.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.to_lowercase().contains("forbidden"), "{text}");
    assert!(!text.contains(CANARY), "a Secret value reached the log");
}
