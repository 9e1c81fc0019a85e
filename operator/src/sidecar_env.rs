//! The injected sidecar's environment, as pure functions: who the sidecar serves (the pod's
//! namespace, name, ServiceAccount and owning workload: the workload identity it puts on its
//! records) and, when the chart turns tracing on, the standard `OTEL_*` variables of its OTLP
//! exporter, with the Kubernetes resource attributes filled in by the downward API.
//!
//! The workload is read from the pod's controller `ownerReference` at admission, without an
//! API call: a ReplicaSet named `<name>-<pod-template-hash>` belongs to Deployment `<name>`
//! (the hash is the pod's `pod-template-hash` label), and a Job named `<name>-<digits>` (8 or
//! more, the scheduled minute) to CronJob `<name>`, the same rules the OpenTelemetry
//! Collector's `k8sattributes` processor applies. Everything else is named as its owner is.
//! Per workload, not per pod: that is what keeps a metric label set of it bounded.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::{Value, json};

use crate::consts::SIDECAR_CONTAINER;

/// The identity variables the sidecar reads.
pub const POD_NAMESPACE_ENV: &str = "TAILWARDEN_POD_NAMESPACE";
pub const POD_NAME_ENV: &str = "TAILWARDEN_POD_NAME";
pub const POD_UID_ENV: &str = "TAILWARDEN_POD_UID";
pub const NODE_NAME_ENV: &str = "TAILWARDEN_NODE_NAME";
pub const SERVICE_ACCOUNT_ENV: &str = "TAILWARDEN_SERVICE_ACCOUNT";
pub const WORKLOAD_KIND_ENV: &str = "TAILWARDEN_WORKLOAD_KIND";
pub const WORKLOAD_NAME_ENV: &str = "TAILWARDEN_WORKLOAD_NAME";

/// The workload a pod belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// `Deployment`, `StatefulSet`, `DaemonSet`, `ReplicaSet`, `Job`, `CronJob`, another
    /// owner's kind, or `Pod` for a pod nothing owns.
    pub kind: String,
    pub name: String,
}

impl Workload {
    /// The OpenTelemetry resource attribute naming this workload (`k8s.deployment.name`, …),
    /// for the kinds the Kubernetes semantic conventions name.
    pub fn attribute(&self) -> Option<&'static str> {
        Some(match self.kind.as_str() {
            "Deployment" => "k8s.deployment.name",
            "ReplicaSet" => "k8s.replicaset.name",
            "StatefulSet" => "k8s.statefulset.name",
            "DaemonSet" => "k8s.daemonset.name",
            "Job" => "k8s.job.name",
            "CronJob" => "k8s.cronjob.name",
            _ => return None,
        })
    }
}

/// The pod's workload (see the module docs).
pub fn workload_of(pod: &Pod) -> Workload {
    let owner = pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .or_else(|| pod.owner_references().first());
    let Some(owner) = owner else {
        // A bare pod: its name (at admission a generated name may not be there yet).
        let name = pod.metadata.name.clone().unwrap_or_else(|| {
            pod.metadata
                .generate_name
                .as_deref()
                .unwrap_or_default()
                .trim_end_matches('-')
                .to_owned()
        });
        return Workload {
            kind: "Pod".to_owned(),
            name,
        };
    };
    let (kind, name) = match owner.kind.as_str() {
        "ReplicaSet" => match pod
            .labels()
            .get("pod-template-hash")
            .and_then(|hash| owner.name.strip_suffix(&format!("-{hash}")))
        {
            Some(deployment) if !deployment.is_empty() => ("Deployment", deployment.to_owned()),
            _ => ("ReplicaSet", owner.name.clone()),
        },
        "Job" => match owner.name.rsplit_once('-') {
            Some((cron, minute))
                if !cron.is_empty()
                    && minute.len() >= 8
                    && minute.bytes().all(|b| b.is_ascii_digit()) =>
            {
                ("CronJob", cron.to_owned())
            }
            _ => ("Job", owner.name.clone()),
        },
        other => (other, owner.name.clone()),
    };
    Workload {
        kind: kind.to_owned(),
        name,
    }
}

/// The OTLP protocol of the sidecar's trace exporter (`OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC, a collector's port 4317.
    Grpc,
    /// OTLP/HTTP with protobuf bodies, a collector's port 4318.
    HttpProtobuf,
}

impl OtlpProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::HttpProtobuf => "http/protobuf",
        }
    }
}

/// Where and how injected sidecars export traces; the same for every pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtelConfig {
    /// The collector, e.g. `http://otel-collector.monitoring:4318` (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    /// `(Secret, key)` in the pod's own namespace whose value is `OTEL_EXPORTER_OTLP_HEADERS`
    /// (`api-key=…,x-tenant=…`). Optional in the pod: a namespace without it exports without
    /// headers rather than failing to start.
    pub headers_secret: Option<(String, String)>,
    /// Share of new traces kept, a decimal in `[0, 1]` (`parentbased_traceidratio`); a
    /// client's sampled `traceparent` is always followed. All traces when `None`.
    pub sampling_ratio: Option<String>,
    /// Extra resource attributes; a `service.name` here replaces the workload's name.
    pub resource_attributes: Vec<(String, String)>,
}

impl OtelConfig {
    /// Export to `endpoint` over `protocol`, every trace, no headers, no extra attributes.
    pub fn new(endpoint: impl Into<String>, protocol: OtlpProtocol) -> Self {
        Self {
            endpoint: endpoint.into(),
            protocol,
            headers_secret: None,
            sampling_ratio: None,
            resource_attributes: Vec::new(),
        }
    }
}

/// A sampling ratio: a decimal from 0 to 1 (`0.25`), kept as written.
pub fn parse_sampling_ratio(s: &str) -> Result<String, String> {
    let s = s.trim();
    let valid = !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && s.bytes().filter(|&b| b == b'.').count() <= 1
        && s.parse::<f64>().is_ok_and(|r| (0.0..=1.0).contains(&r));
    if valid {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "sampling ratio {s:?} must be a decimal from 0 to 1, e.g. 0.25"
        ))
    }
}

/// A resource attribute `key=value`. `OTEL_RESOURCE_ATTRIBUTES` is a comma-separated list that
/// not every SDK percent-decodes, so a value must not need it: no `,`, `=`, spaces or control
/// characters.
pub fn parse_resource_attribute(s: &str) -> Result<(String, String), String> {
    let Some((key, value)) = s.split_once('=') else {
        return Err(format!("resource attribute {s:?} must be key=value"));
    };
    let (key, value) = (key.trim(), value.trim());
    let key_ok = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
    if !key_ok {
        return Err(format!(
            "resource attribute key {key:?} may hold only letters, digits and . _ - /"
        ));
    }
    let value_ok = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b',' && b != b'=' && b != b'"' && b != b'\\');
    if !value_ok {
        return Err(format!(
            "resource attribute {key}: value {value:?} must be printable ASCII without spaces, \
             commas, '=', quotes or backslashes"
        ));
    }
    Ok((key.to_owned(), value.to_owned()))
}

fn field(name: &str, path: &str) -> Value {
    json!({ "name": name, "valueFrom": { "fieldRef": { "fieldPath": path } } })
}

fn value(name: &str, value: impl Into<String>) -> Value {
    json!({ "name": name, "value": value.into() })
}

/// `OTEL_SEMCONV_STABILITY_OPT_IN` value that turns on the GenAI conventions' metrics.
pub const GEN_AI_OPT_IN: &str = "gen_ai_latest_experimental";

/// The sidecar's environment: the identity variables (downward API first, so the later ones
/// can refer to them as `$(TAILWARDEN_POD_NAME)`), the log filter, the GenAI metrics opt-in,
/// and the `OTEL_*` variables when `otel` is set.
pub fn env(
    workload: &Workload,
    log_filter: Option<&str>,
    gen_ai_metrics: bool,
    otel: Option<&OtelConfig>,
) -> Vec<Value> {
    let mut env = vec![
        field(POD_NAMESPACE_ENV, "metadata.namespace"),
        field(POD_NAME_ENV, "metadata.name"),
        field(POD_UID_ENV, "metadata.uid"),
        field(NODE_NAME_ENV, "spec.nodeName"),
        field(SERVICE_ACCOUNT_ENV, "spec.serviceAccountName"),
        value(WORKLOAD_KIND_ENV, workload.kind.clone()),
        value(WORKLOAD_NAME_ENV, workload.name.clone()),
    ];
    if let Some(filter) = log_filter {
        env.push(value("TAILWARDEN_LOG", filter));
    }
    if gen_ai_metrics {
        env.push(value("OTEL_SEMCONV_STABILITY_OPT_IN", GEN_AI_OPT_IN));
    }
    let Some(otel) = otel else {
        return env;
    };
    env.push(value("OTEL_EXPORTER_OTLP_ENDPOINT", otel.endpoint.clone()));
    env.push(value("OTEL_EXPORTER_OTLP_PROTOCOL", otel.protocol.as_str()));
    if let Some((secret, key)) = &otel.headers_secret {
        env.push(json!({
            "name": "OTEL_EXPORTER_OTLP_HEADERS",
            "valueFrom": { "secretKeyRef": { "name": secret, "key": key, "optional": true } },
        }));
    }
    if let Some(ratio) = &otel.sampling_ratio {
        env.push(value("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"));
        env.push(value("OTEL_TRACES_SAMPLER_ARG", ratio.clone()));
    }
    env.push(value(
        "OTEL_RESOURCE_ATTRIBUTES",
        resource_attributes(workload, &otel.resource_attributes),
    ));
    env
}

/// `OTEL_RESOURCE_ATTRIBUTES`: the Kubernetes attributes (pod fields by reference to the
/// identity variables), `service.name` = the workload unless the user names it, then the
/// user's own attributes.
fn resource_attributes(workload: &Workload, extra: &[(String, String)]) -> String {
    let mut attrs: Vec<(String, String)> = vec![
        (
            "k8s.namespace.name".into(),
            format!("$({POD_NAMESPACE_ENV})"),
        ),
        ("k8s.pod.name".into(), format!("$({POD_NAME_ENV})")),
        ("k8s.pod.uid".into(), format!("$({POD_UID_ENV})")),
        ("k8s.node.name".into(), format!("$({NODE_NAME_ENV})")),
        ("k8s.container.name".into(), SIDECAR_CONTAINER.into()),
    ];
    if let Some(key) = workload.attribute() {
        attrs.push((key.into(), workload.name.clone()));
    }
    attrs.push((
        "service.instance.id".into(),
        format!("$({POD_NAMESPACE_ENV}).$({POD_NAME_ENV}).{SIDECAR_CONTAINER}"),
    ));
    if !extra.iter().any(|(k, _)| k == "service.name") {
        attrs.push(("service.name".into(), workload.name.clone()));
    }
    for (k, v) in extra {
        // The user's value wins over ours for the same key.
        attrs.retain(|(key, _)| key != k);
        attrs.push((k.clone(), v.clone()));
    }
    attrs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn pod(owner: Option<(&str, &str)>, hash: Option<&str>) -> Pod {
        let mut p = json!({ "metadata": { "generateName": "web-7d9c-", "labels": {} } });
        if let Some(h) = hash {
            p["metadata"]["labels"]["pod-template-hash"] = json!(h);
        }
        if let Some((kind, name)) = owner {
            p["metadata"]["ownerReferences"] = json!([{
                "apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "u", "controller": true,
            }]);
        }
        serde_json::from_value(p).unwrap()
    }

    fn w(kind: &str, name: &str) -> Workload {
        Workload {
            kind: kind.into(),
            name: name.into(),
        }
    }

    #[test]
    fn the_workload_comes_from_the_controller_owner() {
        let cases = [
            (
                pod(Some(("ReplicaSet", "web-7d9c")), Some("7d9c")),
                w("Deployment", "web"),
            ),
            // A hash that is not the name's suffix: a bare ReplicaSet.
            (
                pod(Some(("ReplicaSet", "web-7d9c")), Some("abcd")),
                w("ReplicaSet", "web-7d9c"),
            ),
            (
                pod(Some(("ReplicaSet", "web-7d9c")), None),
                w("ReplicaSet", "web-7d9c"),
            ),
            (
                pod(Some(("StatefulSet", "db")), None),
                w("StatefulSet", "db"),
            ),
            (
                pod(Some(("DaemonSet", "agent")), None),
                w("DaemonSet", "agent"),
            ),
            (
                pod(Some(("Job", "nightly-29400120")), None),
                w("CronJob", "nightly"),
            ),
            (pod(Some(("Job", "migrate-2")), None), w("Job", "migrate-2")),
            (pod(Some(("Job", "batch")), None), w("Job", "batch")),
            (
                pod(Some(("Rollout", "canary")), None),
                w("Rollout", "canary"),
            ),
            // Nothing owns it: its (generated) name.
            (pod(None, None), w("Pod", "web-7d9c")),
        ];
        for (p, want) in cases {
            assert_eq!(workload_of(&p), want);
        }
        let named: Pod =
            serde_json::from_value(json!({ "metadata": { "name": "debug" } })).unwrap();
        assert_eq!(workload_of(&named), w("Pod", "debug"));
        assert_eq!(
            w("Deployment", "x").attribute(),
            Some("k8s.deployment.name")
        );
        assert_eq!(w("CronJob", "x").attribute(), Some("k8s.cronjob.name"));
        assert_eq!(w("Pod", "x").attribute(), None);
        assert_eq!(w("Rollout", "x").attribute(), None);
    }

    #[test]
    fn without_tracing_the_sidecar_gets_only_its_identity() {
        let env = env(&w("Deployment", "web"), None, false, None);
        assert_eq!(
            env,
            vec![
                json!({"name": "TAILWARDEN_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
                json!({"name": "TAILWARDEN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
                json!({"name": "TAILWARDEN_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}),
                json!({"name": "TAILWARDEN_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}),
                json!({"name": "TAILWARDEN_SERVICE_ACCOUNT", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}}),
                json!({"name": "TAILWARDEN_WORKLOAD_KIND", "value": "Deployment"}),
                json!({"name": "TAILWARDEN_WORKLOAD_NAME", "value": "web"}),
            ]
        );
        assert!(!serde_json::to_string(&env).unwrap().contains("OTEL_"));
    }

    #[test]
    fn with_tracing_every_otel_setting_becomes_its_standard_variable() {
        let mut otel = OtelConfig::new("http://collector.monitoring:4317", OtlpProtocol::Grpc);
        otel.headers_secret = Some(("otlp".into(), "headers".into()));
        otel.sampling_ratio = Some("0.25".into());
        otel.resource_attributes = vec![("deployment.environment.name".into(), "prod".into())];
        let env = env(&w("Deployment", "web"), Some("debug"), true, Some(&otel));
        let names: Vec<&str> = env.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(
            names[5..],
            [
                "TAILWARDEN_WORKLOAD_KIND",
                "TAILWARDEN_WORKLOAD_NAME",
                "TAILWARDEN_LOG",
                "OTEL_SEMCONV_STABILITY_OPT_IN",
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_PROTOCOL",
                "OTEL_EXPORTER_OTLP_HEADERS",
                "OTEL_TRACES_SAMPLER",
                "OTEL_TRACES_SAMPLER_ARG",
                "OTEL_RESOURCE_ATTRIBUTES",
            ]
        );
        let get = |n: &str| env.iter().find(|e| e["name"] == n).unwrap().clone();
        assert_eq!(get("OTEL_EXPORTER_OTLP_PROTOCOL")["value"], "grpc");
        assert_eq!(
            get("OTEL_SEMCONV_STABILITY_OPT_IN")["value"],
            "gen_ai_latest_experimental"
        );
        assert_eq!(
            get("OTEL_EXPORTER_OTLP_HEADERS")["valueFrom"],
            json!({"secretKeyRef": {"name": "otlp", "key": "headers", "optional": true}})
        );
        assert_eq!(
            get("OTEL_TRACES_SAMPLER")["value"],
            "parentbased_traceidratio"
        );
        assert_eq!(get("OTEL_TRACES_SAMPLER_ARG")["value"], "0.25");
        assert_eq!(
            get("OTEL_RESOURCE_ATTRIBUTES")["value"],
            "k8s.namespace.name=$(TAILWARDEN_POD_NAMESPACE),k8s.pod.name=$(TAILWARDEN_POD_NAME),\
             k8s.pod.uid=$(TAILWARDEN_POD_UID),k8s.node.name=$(TAILWARDEN_NODE_NAME),\
             k8s.container.name=tailwarden-sidecar,k8s.deployment.name=web,\
             service.instance.id=$(TAILWARDEN_POD_NAMESPACE).$(TAILWARDEN_POD_NAME).tailwarden-sidecar,\
             service.name=web,deployment.environment.name=prod"
        );
        // Every $(VAR) the attributes use is defined earlier in the list, as Kubernetes
        // requires for the reference to expand.
        let attrs_at = names
            .iter()
            .position(|n| *n == "OTEL_RESOURCE_ATTRIBUTES")
            .unwrap();
        for var in [POD_NAMESPACE_ENV, POD_NAME_ENV, POD_UID_ENV, NODE_NAME_ENV] {
            assert!(names.iter().position(|n| *n == var).unwrap() < attrs_at);
        }
    }

    #[test]
    fn a_user_service_name_replaces_the_workload_and_plain_pods_name_no_workload() {
        let mut otel = OtelConfig::new("http://c:4318", OtlpProtocol::HttpProtobuf);
        otel.resource_attributes = vec![("service.name".into(), "checkout".into())];
        let env = env(&w("Pod", "debug"), None, false, Some(&otel));
        let attrs = env.last().unwrap()["value"].as_str().unwrap().to_owned();
        assert!(attrs.ends_with(",service.name=checkout"), "{attrs}");
        assert_eq!(attrs.matches("service.name=").count(), 1, "{attrs}");
        assert!(!attrs.contains("k8s.deployment.name"), "{attrs}");
        assert!(!env.iter().any(|e| e["name"] == "OTEL_TRACES_SAMPLER"));
        assert!(
            !env.iter()
                .any(|e| e["name"] == "OTEL_EXPORTER_OTLP_HEADERS")
        );
        assert_eq!(env[env.len() - 2]["value"], "http/protobuf");
    }

    #[test]
    fn bad_ratios_and_attributes_are_refused_with_the_reason() {
        for ok in ["0", "1", "0.25", "1.0", " 0.5 "] {
            assert!(parse_sampling_ratio(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1.5", "-0.1", "abc", "1e-3", "0.2.5", "NaN"] {
            let e = parse_sampling_ratio(bad).unwrap_err();
            assert!(e.contains("from 0 to 1"), "{bad}: {e}");
        }
        assert_eq!(
            parse_resource_attribute("deployment.environment.name=prod").unwrap(),
            ("deployment.environment.name".into(), "prod".into())
        );
        for (bad, why) in [
            ("novalue", "key=value"),
            ("=x", "letters, digits"),
            ("k=", "printable"),
            ("k=a,b", "commas"),
            ("k=a b", "spaces"),
            ("k=a=b", "'='"),
        ] {
            let e = parse_resource_attribute(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
