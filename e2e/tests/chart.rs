//! The Helm chart, rendered by the real `helm` (built by e2e/controlplane/build.sh) for the
//! value sets users run, with structured assertions on what comes out; `helm lint`; and
//! schema rejections of bad values.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{path::PathBuf, process::Command};

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn helm() -> PathBuf {
    if let Ok(p) = std::env::var("TAILWARDEN_HELM") {
        return PathBuf::from(p);
    }
    let cache = root().join(".cache/controlplane");
    let found = std::fs::read_dir(&cache)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path().join("bin/helm"))
        .find(|p| p.exists());
    found.unwrap_or_else(|| {
        panic!(
            "helm not found: run e2e/controlplane/build.sh (make test does) or set TAILWARDEN_HELM"
        )
    })
}

fn render(args: &[&str]) -> Result<Vec<Value>, String> {
    let out = Command::new(helm())
        .args([
            "template",
            "tw",
            "charts/tailwarden",
            "--namespace",
            "tailwarden-system",
        ])
        .args(args)
        .current_dir(root())
        .output()
        .expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).unwrap();
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).unwrap();
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = find(docs, kind);
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found[0]
}

fn args(deploy: &Value) -> Vec<String> {
    deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn lint_is_clean() {
    let out = Command::new(helm())
        .args(["lint", "--strict", "charts/tailwarden"])
        .current_dir(root())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("0 chart(s) failed"), "{text}");
}

/// `make images` builds `ghcr.io/tailwarden/{operator,sidecar}:<appVersion>` (the journey runs
/// those very names on a real node); `image.registry` moves both to a user's registry.
#[test]
fn image_registry_moves_the_operator_and_the_sidecar_images() {
    for (registry, prefix) in [
        (None, "ghcr.io/"),
        (
            Some("registry.example.com:5000/team"),
            "registry.example.com:5000/team/",
        ),
        (Some("registry.example.com/"), "registry.example.com/"),
        (Some(""), ""),
    ] {
        let set = registry.map(|r| format!("image.registry={r}"));
        let extra: Vec<&str> = set.iter().flat_map(|s| ["--set", s.as_str()]).collect();
        let docs = render(&extra).unwrap();
        let deploy = one(&docs, "Deployment");
        let c = &deploy["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["image"], format!("{prefix}tailwarden/operator:0.1.0"));
        let a = args(deploy);
        assert!(
            a.contains(&format!("--sidecar-image={prefix}tailwarden/sidecar:0.1.0")),
            "{a:?}"
        );
    }
    let err = render(&["--set", "image.registry=not a registry"]).unwrap_err();
    assert!(err.contains("/image/registry"), "{err}");
}

#[test]
fn defaults_render_a_hardened_operator_with_least_privilege() {
    let docs = render(&[]).unwrap();
    let deploy = one(&docs, "Deployment");
    let spec = &deploy["spec"]["template"]["spec"];
    assert_eq!(deploy["spec"]["replicas"], 2);
    let c = &spec["containers"][0];
    assert_eq!(c["image"], "ghcr.io/tailwarden/operator:0.1.0");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert!(c["resources"]["limits"]["memory"].is_string());
    let a = args(deploy);
    assert!(a.contains(&"--cert-mode=self".to_owned()), "{a:?}");
    assert!(a.contains(&"--leader-elect=true".to_owned()));
    assert!(a.contains(&"--sidecar-image=ghcr.io/tailwarden/sidecar:0.1.0".to_owned()));
    assert!(
        a.contains(&"--sidecar-max-connections=2000".to_owned()),
        "{a:?}"
    );
    assert!(
        a.iter().any(|x| x.starts_with("--sidecar-resources={")),
        "{a:?}"
    );
    assert!(!a.iter().any(|x| x.starts_with("--watch-namespaces")));
    // The operator's own pods opt out of injection.
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]["tailwarden.io/inject"],
        "disabled"
    );

    let pdb = one(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);

    // What the operator writes at run time, created empty by the chart so that it belongs to
    // the release and `helm uninstall` removes it (the journey checks nothing is left).
    let tls = one(&docs, "Secret");
    assert_eq!(tls["metadata"]["name"], "tw-tailwarden-webhook-tls");
    assert_eq!(tls["type"], "kubernetes.io/tls");
    assert_eq!(
        one(&docs, "Lease")["metadata"]["name"],
        "tailwarden-operator"
    );

    let hook = one(&docs, "MutatingWebhookConfiguration");
    let w = &hook["webhooks"][0];
    assert_eq!(w["failurePolicy"], "Ignore", "never blocks pod creation");
    assert_eq!(w["clientConfig"]["service"]["path"], "/mutate-pods");
    assert_eq!(w["rules"][0]["operations"][0], "CREATE");
    let excluded: Vec<&str> = w["namespaceSelector"]["matchExpressions"][0]["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        excluded.contains(&"kube-system") && excluded.contains(&"tailwarden-system"),
        "{excluded:?}"
    );

    // RBAC: one ClusterRole; no Secret access at all; ConfigMaps never deleted; the webhook
    // configuration patchable only by name.
    let role = one(&docs, "ClusterRole");
    let rules = role["rules"].as_array().unwrap();
    let verbs = |group: &str, resource: &str| -> Vec<String> {
        rules
            .iter()
            .filter(|r| {
                r["apiGroups"][0] == group
                    && r["resources"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|x| x == resource)
            })
            .flat_map(|r| {
                r["verbs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_owned())
            })
            .collect()
    };
    assert!(
        verbs("", "secrets").is_empty(),
        "no cluster-wide Secret access"
    );
    assert!(!a.iter().any(|x| x.starts_with("--secret-namespaces")));
    assert!(
        !a.iter().any(|x| x.starts_with("--sidecar-otel")),
        "tracing off by default"
    );
    assert!(!verbs("", "configmaps").contains(&"delete".to_owned()));
    assert_eq!(verbs("", "pods"), ["list", "watch"]);
    assert_eq!(
        verbs("tailwarden.io", "inferenceroutes/status"),
        ["get", "patch", "update"]
    );
    let mwc = rules
        .iter()
        .find(|r| r["resources"][0] == "mutatingwebhookconfigurations")
        .expect("caBundle rule");
    assert_eq!(mwc["resourceNames"][0], "tw-tailwarden");
    assert!(
        rules
            .iter()
            .all(|r| r["verbs"].as_array().unwrap().iter().all(|v| v != "*"))
    );
    // Leases and the TLS Secret only in the release namespace.
    let self_role = find(&docs, "Role")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "tw-tailwarden-operator-self")
        .unwrap();
    assert_eq!(self_role["metadata"]["namespace"], "tailwarden-system");
    // ... and there, Secrets only by the TLS Secret's name (create cannot be limited).
    let secret_rules: Vec<&Value> = self_role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["resources"][0] == "secrets")
        .collect();
    assert_eq!(secret_rules.len(), 2, "{secret_rules:?}");
    assert_eq!(secret_rules[0]["verbs"], serde_json::json!(["create"]));
    assert_eq!(
        secret_rules[1]["resourceNames"],
        serde_json::json!(["tw-tailwarden-webhook-tls"])
    );
    // No Role anywhere else reads Secrets by default.
    assert!(
        find(&docs, "Role")
            .iter()
            .all(|r| r["metadata"]["name"] == "tw-tailwarden-operator-self")
    );
    // Monitoring is off by default (it needs prometheus-operator's CRDs).
    for kind in [
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
        "Certificate",
        "Issuer",
    ] {
        assert!(find(&docs, kind).is_empty(), "{kind} rendered by default");
    }
}

#[test]
fn cert_manager_mode_delegates_the_certificate() {
    let docs = render(&["--set", "webhook.certManager.enabled=true"]).unwrap();
    let cert = one(&docs, "Certificate");
    assert_eq!(cert["spec"]["secretName"], "tw-tailwarden-webhook-tls");
    // cert-manager writes that Secret; the chart does not template one.
    assert!(find(&docs, "Secret").is_empty());
    assert_eq!(
        cert["spec"]["dnsNames"][0],
        "tw-tailwarden-webhook.tailwarden-system.svc"
    );
    assert_eq!(
        one(&docs, "Issuer")["spec"]["selfSigned"],
        serde_json::json!({})
    );
    let hook = one(&docs, "MutatingWebhookConfiguration");
    assert_eq!(
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "tailwarden-system/tw-tailwarden-webhook"
    );
    assert!(args(one(&docs, "Deployment")).contains(&"--cert-mode=external".to_owned()));
    // The operator no longer needs to patch the webhook configuration.
    let role = one(&docs, "ClusterRole");
    assert!(
        !role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["resources"][0] == "mutatingwebhookconfigurations")
    );
    // With an existing issuer, no Issuer is created.
    let docs = render(&[
        "--set",
        "webhook.certManager.enabled=true",
        "--set",
        "webhook.certManager.issuerRef.name=corp-ca",
        "--set",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
    ])
    .unwrap();
    assert!(find(&docs, "Issuer").is_empty());
    assert_eq!(
        one(&docs, "Certificate")["spec"]["issuerRef"]["kind"],
        "ClusterIssuer"
    );
}

#[test]
fn monitoring_on_renders_monitors_rules_and_dashboards() {
    let docs = render(&[
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.prometheusRule.availabilityObjective=99.5",
        "--set",
        "monitoring.dashboards.enabled=true",
    ])
    .unwrap();
    assert_eq!(
        one(&docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"],
        "metrics"
    );
    let pm = one(&docs, "PodMonitor");
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"]["tailwarden.io/injected"],
        "true"
    );
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "tw-probe");
    let rule = one(&docs, "PrometheusRule");
    let text = serde_json::to_string(&rule["spec"]).unwrap();
    assert!(
        text.contains("(14.4 * 0.005)"),
        "budget from the objective: {text}"
    );
    let alerts: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert!(
        alerts.contains(&"TailwardenErrorBudgetBurnFast"),
        "{alerts:?}"
    );
    let cms = find(&docs, "ConfigMap");
    let dash = cms
        .iter()
        .find(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
        .expect("dashboard ConfigMap");
    let json: Value =
        serde_json::from_str(dash["data"]["tailwarden-routes.json"].as_str().unwrap()).unwrap();
    assert!(json["panels"].as_array().unwrap().len() >= 8);
}

#[test]
fn two_watched_namespaces_get_roles_instead_of_cluster_wide_rights() {
    let docs = render(&["--set", "operator.watchNamespaces={shop,ml}"]).unwrap();
    let roles: Vec<&Value> = find(&docs, "Role")
        .into_iter()
        .filter(|r| r["metadata"]["name"] == "tw-tailwarden-operator")
        .collect();
    let ns: Vec<&str> = roles
        .iter()
        .map(|r| r["metadata"]["namespace"].as_str().unwrap())
        .collect();
    assert_eq!(ns, ["shop", "ml"]);
    assert!(
        roles[0]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["resources"][0] == "configmaps")
    );
    let cluster = one(&docs, "ClusterRole");
    assert!(
        !cluster["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["resources"][0] == "configmaps" || r["resources"][0] == "secrets"),
        "no cluster-wide ConfigMap/Secret access"
    );
    assert_eq!(find(&docs, "RoleBinding").len(), 3);
    assert!(args(one(&docs, "Deployment")).contains(&"--watch-namespaces=shop,ml".to_owned()));
    let hook = one(&docs, "MutatingWebhookConfiguration");
    let exprs = hook["webhooks"][0]["namespaceSelector"]["matchExpressions"]
        .as_array()
        .unwrap();
    assert_eq!(exprs[1]["operator"], "In");
    assert_eq!(exprs[1]["values"], serde_json::json!(["shop", "ml"]));
}

#[test]
fn secret_access_is_a_role_in_each_opted_in_namespace_only() {
    let docs = render(&["--set", "operator.secretAccess.namespaces={shop,ml}"]).unwrap();
    let roles: Vec<&Value> = find(&docs, "Role")
        .into_iter()
        .filter(|r| r["metadata"]["name"] == "tw-tailwarden-operator-secrets")
        .collect();
    let ns: Vec<&str> = roles
        .iter()
        .map(|r| r["metadata"]["namespace"].as_str().unwrap())
        .collect();
    assert_eq!(ns, ["shop", "ml"]);
    assert_eq!(
        roles[0]["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch"]}])
    );
    let bindings: Vec<&Value> = find(&docs, "RoleBinding")
        .into_iter()
        .filter(|r| r["metadata"]["name"] == "tw-tailwarden-operator-secrets")
        .collect();
    assert_eq!(bindings.len(), 2);
    assert_eq!(bindings[1]["subjects"][0]["name"], "tw-tailwarden-operator");
    assert_eq!(bindings[1]["subjects"][0]["namespace"], "tailwarden-system");
    assert!(args(one(&docs, "Deployment")).contains(&"--secret-namespaces=shop,ml".to_owned()));
    // Still nothing cluster-wide.
    let cluster = one(&docs, "ClusterRole");
    assert!(
        !cluster["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["resources"][0] == "secrets")
    );
}

#[test]
fn the_otel_values_reach_the_operator_flags() {
    let docs = render(&[
        "--set",
        "sidecar.otel.endpoint=http://otel-collector.monitoring:4317",
        "--set",
        "sidecar.otel.protocol=grpc",
        "--set",
        "sidecar.otel.headersSecret.name=otlp-auth",
        "--set",
        "sidecar.otel.samplingRatio=0.25",
        "--set",
        "sidecar.otel.resourceAttributes.deployment\\.environment\\.name=prod",
        "--set",
        "sidecar.genAiMetrics=true",
    ])
    .unwrap();
    let a = args(one(&docs, "Deployment"));
    assert!(
        a.contains(&"--sidecar-gen-ai-metrics=true".to_owned()),
        "{a:?}"
    );
    let otel: Vec<&str> = a
        .iter()
        .filter(|x| x.starts_with("--sidecar-otel"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        otel,
        [
            "--sidecar-otel-endpoint=http://otel-collector.monitoring:4317",
            "--sidecar-otel-protocol=grpc",
            "--sidecar-otel-headers-secret=otlp-auth",
            "--sidecar-otel-headers-key=headers",
            "--sidecar-otel-sampling-ratio=0.25",
            "--sidecar-otel-resource-attribute=deployment.environment.name=prod",
        ]
    );
}

#[test]
fn the_sidecar_connection_cap_reaches_the_operator_as_an_integer() {
    // Helm reads numbers as floats: without `int` a million would render as 1e+06, which the
    // operator's flag parser rejects.
    let docs = render(&["--set", "sidecar.maxConnections=1000000"]).unwrap();
    let a = args(one(&docs, "Deployment"));
    assert!(
        a.contains(&"--sidecar-max-connections=1000000".to_owned()),
        "{a:?}"
    );
}

#[test]
fn bad_values_are_rejected_by_the_schema_with_a_clear_message() {
    let cases = [
        (
            vec!["--set", "operator.replicas=two"],
            "at '/operator/replicas': got string, want integer",
        ),
        (
            vec!["--set", "operator.replica=2"],
            "additional properties 'replica' not allowed",
        ),
        (
            vec!["--set", "webhook.failurePolicy=Sometimes"],
            "/webhook/failurePolicy",
        ),
        (
            vec!["--set", "sidecar.image.pullPolicy=Maybe"],
            "/sidecar/image/pullPolicy",
        ),
        (
            vec!["--set", "operator.watchNamespaces={Bad_NS}"],
            "/operator/watchNamespaces/0",
        ),
        (
            vec![
                "--set",
                "monitoring.prometheusRule.availabilityObjective=101",
            ],
            "availabilityObjective",
        ),
        (
            vec!["--set", "sidecar.maxConnections=0"],
            "/sidecar/maxConnections",
        ),
        (
            vec!["--set", "operator.secretAccess.namespaces={Bad_NS}"],
            "/operator/secretAccess/namespaces/0",
        ),
        (
            vec!["--set", "sidecar.otel.protocol=udp"],
            "/sidecar/otel/protocol",
        ),
        (
            vec!["--set", "sidecar.otel.samplingRatio=1.5"],
            "/sidecar/otel/samplingRatio",
        ),
        (
            vec!["--set", "sidecar.otel.endpoint=collector:4317"],
            "/sidecar/otel/endpoint",
        ),
        (
            vec!["--set", "sidecar.otel.resourceAttributes.team=a b"],
            "/sidecar/otel/resourceAttributes/team",
        ),
    ];
    for (args, want) in cases {
        let err = render(&args).expect_err("rejected");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn the_chart_ships_the_generated_crd() {
    let chart =
        std::fs::read_to_string(root().join("charts/tailwarden/crds/inferenceroute.yaml")).unwrap();
    let generated = std::fs::read_to_string(root().join("crds/inferenceroute.yaml")).unwrap();
    assert!(
        chart == generated,
        "charts/tailwarden/crds is stale: run `make crds`"
    );
}
