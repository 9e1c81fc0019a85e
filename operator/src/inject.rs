//! Sidecar injection, the pure half of the mutating webhook: [`decide`] whether a pod gets
//! the sidecar, and build the JSON [`patch`] that adds it. No I/O here, so every branch of
//! the truth table and every patch shape is unit-tested without a cluster; `webhook` only
//! parses the AdmissionReview, asks the caches for the namespace's labels and routes, and
//! calls these two functions.
//!
//! # Truth table
//!
//! Rows are checked top to bottom; the first one that matches wins. "Opted in" means the pod
//! has a non-empty `tailwarden.io/routes` annotation or its namespace has the label
//! `tailwarden.io/inject=enabled` (any other label value is ignored).
//!
//! | # | pod `tailwarden.io/routes` | namespace label `tailwarden.io/inject` | pod `tailwarden.io/inject` | already injected | `hostNetwork` | routes in namespace | result |
//! |---|---|---|---|---|---|---|---|
//! | 1 | absent or empty | not `enabled` | any | any | any | any | skip `NotOptedIn` |
//! | 2 | any | any | `disabled` | any | any | any | skip `OptedOut` |
//! | 3 | any | any | not `disabled` | yes | any | any | skip `AlreadyInjected` |
//! | 4 | any | any | not `disabled` | no | `true` | any | skip `HostNetwork` |
//! | 5 | names a route that does not exist | any | not `disabled` | no | `false` | any | skip `UnknownRoute` (the missing names) |
//! | 6 | names only existing routes | any | not `disabled` | no | `false` | any | **inject** the named routes |
//! | 7 | absent or empty | `enabled` | not `disabled` | no | `false` | none | skip `NoRoutes` |
//! | 8 | absent or empty | `enabled` | not `disabled` | no | `false` | one or more | **inject** all of them |
//!
//! "Already injected" means a container or init container is named `tailwarden-sidecar`, or
//! the pod carries the `tailwarden.io/injected-routes` annotation. Row 1 comes first on
//! purpose: a pod nobody asked to inject is not worth an Event, whatever else it looks like.
//! The same table, for users, is in `docs/injection.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::{Container, Pod, ResourceRequirements};
use kube::ResourceExt;
use serde_json::{Value, json};
use tailwarden_crds::InferenceRoute;

use crate::consts::{
    ADMIN_PORT, BASE_URL, CLIENT_PORT, CONFIG_DIR, CONFIG_KEY, CONFIG_VOLUME, DISABLED, ENABLED,
    INJECT_ANNOTATION, INJECT_LABEL, INJECTED_ANNOTATION, INJECTED_LABEL, KEYS_DIR, KEYS_VOLUME,
    PROBE_PORT, ROUTES_ANNOTATION, SET_BASE_URL_ANNOTATION, SIDECAR_CONTAINER, config_map_name,
};
use crate::sidecar_env::{self, OtelConfig, Workload};

/// Environment variable the OpenAI SDKs read for their base URL.
pub const BASE_URL_ENV: &str = "OPENAI_BASE_URL";
/// Environment variable the OpenAI SDKs read for their key: they refuse to start without
/// one, though the sidecar never forwards it and sends the provider's own key.
pub const API_KEY_ENV: &str = "OPENAI_API_KEY";
/// What a container that points at the sidecar and has no key gets as `OPENAI_API_KEY`:
/// obviously not a key, so nobody mistakes it for a leaked secret in a pod spec or a log.
pub const API_KEY_PLACEHOLDER: &str = "tailwarden-injected-placeholder";
/// Name of the sidecar's probe port (`PROBE_PORT`).
pub const PROBE_PORT_NAME: &str = "tw-probe";
/// UID the sidecar runs as: the distroless `nonroot` user.
pub const SIDECAR_UID: i64 = 65532;

/// The sidecar settings the chart passes to the operator; the same for every injected pod.
#[derive(Clone, Debug, PartialEq)]
pub struct InjectConfig {
    /// Sidecar image, e.g. `ghcr.io/tailwarden/sidecar:0.1.0`.
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never`; the cluster default when `None`.
    pub image_pull_policy: Option<String>,
    /// Requests and limits of the sidecar container.
    pub resources: Option<ResourceRequirements>,
    /// `json` or `text` (the sidecar's `--log-format`).
    pub log_format: String,
    /// The sidecar's log filter (`TAILWARDEN_LOG`), e.g. `info`; the sidecar's default when `None`.
    pub log_filter: Option<String>,
    /// The sidecar's `--max-connections`: client connections it serves at once. Each idle one
    /// holds 16-25 KiB, so this is what keeps a connection-leaking app from pushing the
    /// sidecar past its memory limit. The sidecar's default (10 000) when `None`.
    pub max_connections: Option<u32>,
    /// OpenTelemetry trace export of the sidecars; off when `None`.
    pub otel: Option<OtelConfig>,
    /// Export the OpenTelemetry GenAI client metrics beside `tailwarden_*`
    /// (`OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`).
    pub gen_ai_metrics: bool,
}

impl InjectConfig {
    /// A config with the given image and the defaults: JSON logs, no resources.
    pub fn new(image: impl Into<String>) -> Self {
        Self {
            image: image.into(),
            image_pull_policy: None,
            resources: None,
            log_format: "json".to_owned(),
            log_filter: None,
            max_connections: None,
            otel: None,
            gen_ai_metrics: false,
        }
    }
}

/// What the injector needs to know about one `InferenceRoute`: its name and the Secret keys
/// its sidecar reads, so the pod can mount them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteInfo {
    /// The route's name (in the pod's namespace).
    pub name: String,
    /// `(secret name, key)` pairs, in provider order.
    pub secret_keys: Vec<(String, String)>,
}

impl RouteInfo {
    /// A route that reads the given Secret keys.
    pub fn new(name: impl Into<String>, secret_keys: Vec<(String, String)>) -> Self {
        Self {
            name: name.into(),
            secret_keys,
        }
    }

    /// What the injector needs from an `InferenceRoute`: every Secret key its sidecar reads
    /// (provider keys, Redis passwords, CA bundles, client certificates).
    pub fn from_route(route: &InferenceRoute) -> Self {
        Self {
            name: route.name_any(),
            secret_keys: crate::render::secret_refs(route),
        }
    }
}

/// Why a pod was not injected. [`SkipReason::as_str`] is the machine-readable form used in
/// the metric label and as the Event reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Neither the pod annotation nor the namespace label asks for the sidecar.
    NotOptedIn,
    /// The pod says `tailwarden.io/inject: disabled`.
    OptedOut,
    /// The pod uses the node's network namespace: the sidecar's loopback ports would be the
    /// node's, shared with every other host-network pod there.
    HostNetwork,
    /// The pod already has the sidecar (a reinvocation, or a copied spec).
    AlreadyInjected,
    /// The pod annotation names routes that do not exist in the namespace (the names).
    UnknownRoute(Vec<String>),
    /// The namespace is enabled but has no routes.
    NoRoutes,
}

impl SkipReason {
    /// Stable, machine-readable name (CamelCase, like Kubernetes reasons).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotOptedIn => "NotOptedIn",
            Self::OptedOut => "OptedOut",
            Self::HostNetwork => "HostNetwork",
            Self::AlreadyInjected => "AlreadyInjected",
            Self::UnknownRoute(_) => "UnknownRoute",
            Self::NoRoutes => "NoRoutes",
        }
    }

    /// Whether the skip points at a mistake the user probably wants to fix (a `Warning`
    /// Event) rather than a deliberate or harmless outcome (a `Normal` one).
    pub fn is_warning(&self) -> bool {
        matches!(
            self,
            Self::HostNetwork | Self::UnknownRoute(_) | Self::NoRoutes
        )
    }
}

impl fmt::Display for SkipReason {
    /// A sentence for Events and logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotOptedIn => write!(
                f,
                "not opted in: no {ROUTES_ANNOTATION} annotation and the namespace is not labelled {INJECT_LABEL}={ENABLED}"
            ),
            Self::OptedOut => write!(
                f,
                "the pod opted out with the annotation {INJECT_ANNOTATION}: {DISABLED}"
            ),
            Self::HostNetwork => write!(
                f,
                "the pod uses hostNetwork: the sidecar's ports would be shared with the node, so it is not injected"
            ),
            Self::AlreadyInjected => write!(
                f,
                "the pod already has the {SIDECAR_CONTAINER} container or the {INJECTED_ANNOTATION} annotation"
            ),
            Self::UnknownRoute(missing) => write!(
                f,
                "the {ROUTES_ANNOTATION} annotation names InferenceRoutes that do not exist in the namespace: {}",
                missing.join(", ")
            ),
            Self::NoRoutes => write!(
                f,
                "the namespace is labelled {INJECT_LABEL}={ENABLED} but has no InferenceRoutes"
            ),
        }
    }
}

/// The outcome of [`decide`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Inject the sidecar serving these routes (in annotation order, or by name for a
    /// namespace opt-in).
    Inject {
        /// The routes, resolved to what the patch needs.
        routes: Vec<RouteInfo>,
    },
    /// Leave the pod alone.
    Skip(SkipReason),
}

/// The route names of the pod annotation: split on `,`, trimmed, empty entries dropped,
/// duplicates dropped (first occurrence kept, so the order is the user's).
pub fn requested_routes(pod: &Pod) -> Vec<String> {
    let Some(value) = pod.annotations().get(ROUTES_ANNOTATION) else {
        return Vec::new();
    };
    let mut seen = BTreeSet::new();
    value
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty() && seen.insert(*name))
        .map(str::to_owned)
        .collect()
}

/// Whether the pod already carries the sidecar (see the module docs).
pub fn is_injected(pod: &Pod) -> bool {
    let has_sidecar = pod.spec.as_ref().is_some_and(|spec| {
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .any(|c| c.name == SIDECAR_CONTAINER)
    });
    has_sidecar || pod.annotations().contains_key(INJECTED_ANNOTATION)
}

/// Apply the truth table of the module docs.
pub fn decide(
    pod: &Pod,
    namespace_labels: &BTreeMap<String, String>,
    routes_in_namespace: &[RouteInfo],
) -> Decision {
    let requested = requested_routes(pod);
    let namespace_enabled = namespace_labels
        .get(INJECT_LABEL)
        .is_some_and(|v| v == ENABLED);

    if requested.is_empty() && !namespace_enabled {
        return Decision::Skip(SkipReason::NotOptedIn);
    }
    if pod
        .annotations()
        .get(INJECT_ANNOTATION)
        .is_some_and(|v| v == DISABLED)
    {
        return Decision::Skip(SkipReason::OptedOut);
    }
    if is_injected(pod) {
        return Decision::Skip(SkipReason::AlreadyInjected);
    }
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
    {
        return Decision::Skip(SkipReason::HostNetwork);
    }

    if requested.is_empty() {
        // Opted in by the namespace: every route there, in a stable order.
        if routes_in_namespace.is_empty() {
            return Decision::Skip(SkipReason::NoRoutes);
        }
        let mut routes = routes_in_namespace.to_vec();
        routes.sort_by(|a, b| a.name.cmp(&b.name));
        routes.dedup_by(|a, b| a.name == b.name);
        return Decision::Inject { routes };
    }

    let mut routes = Vec::with_capacity(requested.len());
    let mut missing = Vec::new();
    for name in requested {
        match routes_in_namespace.iter().find(|r| r.name == name) {
            Some(route) => routes.push(route.clone()),
            None => missing.push(name),
        }
    }
    if missing.is_empty() {
        Decision::Inject { routes }
    } else {
        Decision::Skip(SkipReason::UnknownRoute(missing))
    }
}

/// `(secret, keys)` referenced by the routes, deduplicated and sorted, so the same routes
/// always produce the same volume.
fn secrets_of(routes: &[RouteInfo]) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut secrets: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (secret, key) in routes.iter().flat_map(|r| &r.secret_keys) {
        secrets.entry(secret).or_default().insert(key);
    }
    secrets
}

/// The sidecar container (a native sidecar: `restartPolicy: Always` on an init container,
/// so it starts before and stops after the app containers) of a pod of `workload`.
pub fn sidecar_container(has_keys: bool, workload: &Workload, cfg: &InjectConfig) -> Value {
    let probe = |path: &str| json!({ "httpGet": { "path": path, "port": PROBE_PORT } });
    let mut startup = probe("/readyz");
    // Up to two minutes for the first config load (the route's ConfigMap may still be being
    // written when the pod starts); app containers wait for this probe.
    startup["periodSeconds"] = json!(1);
    startup["failureThreshold"] = json!(120);
    let mut readiness = probe("/readyz");
    readiness["periodSeconds"] = json!(5);
    let mut liveness = probe("/healthz");
    liveness["periodSeconds"] = json!(10);
    liveness["failureThreshold"] = json!(3);

    let mut mounts =
        vec![json!({ "name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": true })];
    if has_keys {
        mounts.push(json!({ "name": KEYS_VOLUME, "mountPath": KEYS_DIR, "readOnly": true }));
    }

    let mut args = vec![
        "--config".to_owned(),
        CONFIG_DIR.to_owned(),
        "--listen".to_owned(),
        format!("127.0.0.1:{CLIENT_PORT}"),
        "--admin".to_owned(),
        format!("127.0.0.1:{ADMIN_PORT}"),
        "--probe-listen".to_owned(),
        format!("0.0.0.0:{PROBE_PORT}"),
        "--log-format".to_owned(),
        cfg.log_format.clone(),
    ];
    if let Some(max) = cfg.max_connections {
        args.extend(["--max-connections".to_owned(), max.to_string()]);
    }
    let mut container = json!({
        "name": SIDECAR_CONTAINER,
        "image": cfg.image,
        "restartPolicy": "Always",
        "args": args,
        "ports": [{ "name": PROBE_PORT_NAME, "containerPort": PROBE_PORT, "protocol": "TCP" }],
        "startupProbe": startup,
        "readinessProbe": readiness,
        "livenessProbe": liveness,
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "privileged": false,
            "capabilities": { "drop": ["ALL"] },
            "seccompProfile": { "type": "RuntimeDefault" },
        },
        "volumeMounts": mounts,
    });
    if let Some(policy) = &cfg.image_pull_policy {
        container["imagePullPolicy"] = json!(policy);
    }
    // Serialising k8s-openapi types cannot fail (string keys only); `ok()` keeps this
    // function infallible without an unwrap.
    if let Some(resources) = cfg
        .resources
        .as_ref()
        .and_then(|r| serde_json::to_value(r).ok())
    {
        container["resources"] = resources;
    }
    container["env"] = Value::Array(sidecar_env::env(
        workload,
        cfg.log_filter.as_deref(),
        cfg.gen_ai_metrics,
        cfg.otel.as_ref(),
    ));
    container
}

/// The projected volume of the routes' ConfigMaps: `<route>.yaml` each. `optional` so a pod
/// created before its route's ConfigMap exists still starts; the sidecar picks the file up
/// when the kubelet projects it.
fn config_volume(routes: &[RouteInfo]) -> Value {
    let sources: Vec<Value> = routes
        .iter()
        .map(|r| {
            json!({ "configMap": {
                "name": config_map_name(&r.name),
                "items": [{ "key": CONFIG_KEY, "path": format!("{}.yaml", r.name) }],
                "optional": true,
            }})
        })
        .collect();
    json!({ "name": CONFIG_VOLUME, "projected": { "sources": sources } })
}

/// The projected volume of the referenced Secret keys: `<secret>/<key>` each, the layout
/// `consts::key_path` names. A Secret volume (not `secretKeyRef` env) so a rotated key
/// reaches the running sidecar without a restart.
fn keys_volume(secrets: &BTreeMap<&str, BTreeSet<&str>>) -> Value {
    let sources: Vec<Value> = secrets
        .iter()
        .map(|(secret, keys)| {
            let items: Vec<Value> = keys
                .iter()
                .map(|key| json!({ "key": key, "path": format!("{secret}/{key}") }))
                .collect();
            json!({ "secret": { "name": secret, "items": items, "optional": true } })
        })
        .collect();
    json!({ "name": KEYS_VOLUME, "projected": { "sources": sources } })
}

fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        // `from_tokens` escapes `/` and `~` (`tailwarden.io~1injected-routes`).
        path: PointerBuf::from_tokens(tokens.iter().copied()),
        value,
    })
}

/// Add `key: value` to the map at `path` (`metadata.annotations` or `.labels`), creating the
/// map when the pod has none: a JSON patch `add` into a missing parent fails.
fn add_to_map(ops: &mut Vec<PatchOperation>, exists: bool, path: &[&str], key: &str, value: &str) {
    if exists {
        let mut tokens = path.to_vec();
        tokens.push(key);
        ops.push(add(&tokens, json!(value)));
    } else {
        ops.push(add(path, json!({ key: value })));
    }
}

/// The JSON patch (RFC 6902) that injects the sidecar serving `routes` into `pod`, written
/// against the pod exactly as submitted: lists and maps that are absent are created whole,
/// existing ones are appended to (or, for init containers, prepended to). Only call it for
/// [`Decision::Inject`]; the decision is what makes injection idempotent.
pub fn patch(pod: &Pod, routes: &[RouteInfo], cfg: &InjectConfig) -> Patch {
    let spec = pod.spec.as_ref();
    let secrets = secrets_of(routes);
    let has_keys = !secrets.is_empty();
    let mut ops = Vec::new();

    // The sidecar goes first among the init containers: init containers start in order, and
    // a native sidecar only runs alongside the ones after it. First, it is up before any
    // other init container that might call a model.
    let sidecar = sidecar_container(has_keys, &sidecar_env::workload_of(pod), cfg);
    match spec.and_then(|s| s.init_containers.as_ref()) {
        Some(_) => ops.push(add(&["spec", "initContainers", "0"], sidecar)),
        None => ops.push(add(&["spec", "initContainers"], json!([sidecar]))),
    }

    let mut volumes = vec![config_volume(routes)];
    if has_keys {
        volumes.push(keys_volume(&secrets));
    }
    match spec.and_then(|s| s.volumes.as_ref()) {
        Some(_) => {
            for volume in volumes {
                ops.push(add(&["spec", "volumes", "-"], volume));
            }
        }
        None => ops.push(add(&["spec", "volumes"], Value::Array(volumes))),
    }

    let set_base_url = pod
        .annotations()
        .get(SET_BASE_URL_ANNOTATION)
        .is_none_or(|v| v.trim() != "false");
    for (i, container) in spec
        .map(|s| s.containers.as_slice())
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let vars = app_env(container, set_base_url);
        if vars.is_empty() {
            continue;
        }
        let index = i.to_string();
        if container.env.is_some() {
            // First in the list, so later variables can refer to them as $(OPENAI_BASE_URL).
            for (at, var) in vars.into_iter().enumerate() {
                let at = at.to_string();
                ops.push(add(&["spec", "containers", &index, "env", &at], var));
            }
        } else {
            ops.push(add(
                &["spec", "containers", &index, "env"],
                Value::Array(vars),
            ));
        }
    }

    let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
    add_to_map(
        &mut ops,
        pod.metadata.annotations.is_some(),
        &["metadata", "annotations"],
        INJECTED_ANNOTATION,
        &names.join(","),
    );
    add_to_map(
        &mut ops,
        pod.metadata.labels.is_some(),
        &["metadata", "labels"],
        INJECTED_LABEL,
        "true",
    );
    Patch(ops)
}

/// The variables an app container gets, in order: `OPENAI_BASE_URL` pointing at the sidecar
/// unless the pod opted out (`set_base_url` false) or the container sets its own in `env`,
/// and, only with that base URL, a placeholder `OPENAI_API_KEY` when its `env` has none —
/// the SDKs refuse to start without a key, and the sidecar supplies the real one. A
/// container that keeps its own base URL talks to something else and keeps its own key.
/// Only `env` is checked: what an `envFrom` ConfigMap or Secret holds is not known at
/// admission, and an injected `env` entry takes precedence over it (docs/injection.md).
pub fn app_env(container: &Container, set_base_url: bool) -> Vec<Value> {
    let env = container.env.as_deref().unwrap_or_default();
    let sets = |name: &str| env.iter().any(|e| e.name == name);
    if !set_base_url || sets(BASE_URL_ENV) {
        return Vec::new();
    }
    let mut vars = vec![json!({ "name": BASE_URL_ENV, "value": BASE_URL })];
    if !sets(API_KEY_ENV) {
        vars.push(json!({ "name": API_KEY_ENV, "value": API_KEY_PLACEHOLDER }));
    }
    vars
}

/// The sidecar as a typed container, for callers that want to inspect it (the chart's
/// docs, tests).
pub fn sidecar_container_typed(
    has_keys: bool,
    workload: &Workload,
    cfg: &InjectConfig,
) -> Result<Container, serde_json::Error> {
    serde_json::from_value(sidecar_container(has_keys, workload, cfg))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn cfg() -> InjectConfig {
        InjectConfig {
            image: "ghcr.io/tailwarden/sidecar:0.1.0".to_owned(),
            image_pull_policy: Some("IfNotPresent".to_owned()),
            resources: serde_json::from_value(json!({
                "requests": { "cpu": "50m", "memory": "32Mi" },
                "limits": { "memory": "128Mi" },
            }))
            .unwrap(),
            log_format: "json".to_owned(),
            log_filter: None,
            max_connections: Some(2000),
            otel: None,
            gen_ai_metrics: false,
        }
    }

    fn chat() -> RouteInfo {
        RouteInfo::new("chat", vec![("openai".to_owned(), "apiKey".to_owned())])
    }

    fn embed() -> RouteInfo {
        RouteInfo::new(
            "embed",
            vec![
                ("openai".to_owned(), "apiKey".to_owned()),
                ("azure".to_owned(), "key".to_owned()),
            ],
        )
    }

    fn labels(enabled: Option<&str>) -> BTreeMap<String, String> {
        enabled
            .map(|v| BTreeMap::from([(INJECT_LABEL.to_owned(), v.to_owned())]))
            .unwrap_or_default()
    }

    // ---- the truth table, every combination ------------------------------------------

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum RoutesAnn {
        Absent,
        /// `" , "`: present but naming nothing, which counts as absent.
        Empty,
        /// `"chat, chat"`: an existing route (when the namespace has routes), duplicated.
        Known,
        /// `"chat,ghost"`: one that never exists.
        Unknown,
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum NsLabel {
        Absent,
        Enabled,
        /// `disabled`, or anything else that is not `enabled`.
        Other,
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum InjectAnn {
        Absent,
        Disabled,
        /// `enabled`: not an opt-in by itself, and not an opt-out.
        Other,
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Injected {
        No,
        Container,
        InitContainer,
        Annotation,
    }

    #[derive(Clone, Copy, Debug)]
    struct Case {
        routes: RoutesAnn,
        ns: NsLabel,
        inject: InjectAnn,
        injected: Injected,
        host_network: bool,
        ns_has_routes: bool,
    }

    #[derive(Debug, PartialEq)]
    enum Expect {
        Skip(&'static str),
        Inject(&'static [&'static str]),
    }

    /// The table of the module docs, row for row; the first row that matches wins.
    #[allow(clippy::type_complexity)]
    fn table() -> Vec<(u8, fn(&Case) -> bool, fn(&Case) -> Expect)> {
        use RoutesAnn as R;
        vec![
            (
                1,
                |c| matches!(c.routes, R::Absent | R::Empty) && c.ns != NsLabel::Enabled,
                |_| Expect::Skip("NotOptedIn"),
            ),
            (
                2,
                |c| c.inject == InjectAnn::Disabled,
                |_| Expect::Skip("OptedOut"),
            ),
            (
                3,
                |c| c.injected != Injected::No,
                |_| Expect::Skip("AlreadyInjected"),
            ),
            (4, |c| c.host_network, |_| Expect::Skip("HostNetwork")),
            (
                5,
                |c| c.routes == R::Unknown || (c.routes == R::Known && !c.ns_has_routes),
                |_| Expect::Skip("UnknownRoute"),
            ),
            (6, |c| c.routes == R::Known, |_| Expect::Inject(&["chat"])),
            (7, |c| !c.ns_has_routes, |_| Expect::Skip("NoRoutes")),
            (8, |_| true, |_| Expect::Inject(&["chat", "embed"])),
        ]
    }

    fn pod_for(c: &Case) -> Pod {
        let mut annotations = serde_json::Map::new();
        match c.routes {
            RoutesAnn::Absent => {}
            RoutesAnn::Empty => {
                annotations.insert(ROUTES_ANNOTATION.into(), json!(" , "));
            }
            RoutesAnn::Known => {
                annotations.insert(ROUTES_ANNOTATION.into(), json!("chat, chat"));
            }
            RoutesAnn::Unknown => {
                annotations.insert(ROUTES_ANNOTATION.into(), json!("chat,ghost"));
            }
        }
        match c.inject {
            InjectAnn::Absent => {}
            InjectAnn::Disabled => {
                annotations.insert(INJECT_ANNOTATION.into(), json!(DISABLED));
            }
            InjectAnn::Other => {
                annotations.insert(INJECT_ANNOTATION.into(), json!(ENABLED));
            }
        }
        if c.injected == Injected::Annotation {
            annotations.insert(INJECTED_ANNOTATION.into(), json!("chat"));
        }
        let mut pod = json!({
            "metadata": { "generateName": "app-", "annotations": annotations },
            "spec": {
                "hostNetwork": c.host_network,
                "containers": [{ "name": "app", "image": "app:1" }],
            },
        });
        match c.injected {
            Injected::Container => {
                pod["spec"]["containers"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({ "name": SIDECAR_CONTAINER }));
            }
            Injected::InitContainer => {
                pod["spec"]["initContainers"] = json!([{ "name": SIDECAR_CONTAINER }]);
            }
            Injected::No | Injected::Annotation => {}
        }
        serde_json::from_value(pod).unwrap()
    }

    #[test]
    fn truth_table_every_combination() {
        let mut cases = 0;
        let mut rows_hit = BTreeSet::new();
        for routes in [
            RoutesAnn::Absent,
            RoutesAnn::Empty,
            RoutesAnn::Known,
            RoutesAnn::Unknown,
        ] {
            for ns in [NsLabel::Absent, NsLabel::Enabled, NsLabel::Other] {
                for inject in [InjectAnn::Absent, InjectAnn::Disabled, InjectAnn::Other] {
                    for injected in [
                        Injected::No,
                        Injected::Container,
                        Injected::InitContainer,
                        Injected::Annotation,
                    ] {
                        for host_network in [false, true] {
                            for ns_has_routes in [false, true] {
                                let c = Case {
                                    routes,
                                    ns,
                                    inject,
                                    injected,
                                    host_network,
                                    ns_has_routes,
                                };
                                let (row, _, expect) = table()
                                    .into_iter()
                                    .find(|(_, matches, _)| matches(&c))
                                    .unwrap();
                                rows_hit.insert(row);
                                let ns_labels = labels(match ns {
                                    NsLabel::Absent => None,
                                    NsLabel::Enabled => Some(ENABLED),
                                    NsLabel::Other => Some(DISABLED),
                                });
                                // Unsorted on purpose: namespace opt-in sorts by name.
                                let ns_routes = if ns_has_routes {
                                    vec![embed(), chat()]
                                } else {
                                    vec![]
                                };
                                let got = match decide(&pod_for(&c), &ns_labels, &ns_routes) {
                                    Decision::Skip(reason) => Expect::Skip(reason.as_str()),
                                    Decision::Inject { routes } => {
                                        let names: Vec<&str> =
                                            routes.iter().map(|r| r.name.as_str()).collect();
                                        if names == ["chat"] {
                                            Expect::Inject(&["chat"])
                                        } else if names == ["chat", "embed"] {
                                            Expect::Inject(&["chat", "embed"])
                                        } else {
                                            panic!("{c:?}: unexpected routes {names:?}")
                                        }
                                    }
                                };
                                assert_eq!(got, expect(&c), "row {row}, case {c:?}");
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 4 * 3 * 3 * 4 * 2 * 2);
        assert_eq!(
            rows_hit,
            (1..=8).collect(),
            "every row of the table is reachable"
        );
    }

    #[test]
    fn unknown_route_names_exactly_the_missing_ones() {
        let pod = pod_for(&Case {
            routes: RoutesAnn::Unknown,
            ns: NsLabel::Absent,
            inject: InjectAnn::Absent,
            injected: Injected::No,
            host_network: false,
            ns_has_routes: true,
        });
        let decision = decide(&pod, &labels(None), &[chat(), embed()]);
        let reason = SkipReason::UnknownRoute(vec!["ghost".to_owned()]);
        assert_eq!(decision, Decision::Skip(reason.clone()));
        assert!(reason.to_string().contains("ghost"), "{reason}");
        assert!(reason.is_warning());
        assert!(!SkipReason::NotOptedIn.is_warning());
    }

    #[test]
    fn routes_annotation_is_trimmed_deduplicated_and_keeps_order() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "annotations": { ROUTES_ANNOTATION: " embed ,chat,, embed ,chat " } },
            "spec": { "containers": [] },
        }))
        .unwrap();
        assert_eq!(requested_routes(&pod), ["embed", "chat"]);
        let Decision::Inject { routes } = decide(&pod, &labels(None), &[chat(), embed()]) else {
            panic!("not injected");
        };
        assert_eq!(routes, [embed(), chat()]);
    }

    #[test]
    fn route_info_from_an_inference_route() {
        let route: InferenceRoute = serde_json::from_value(json!({
            "apiVersion": "tailwarden.io/v1alpha1",
            "kind": "InferenceRoute",
            "metadata": { "name": "chat", "namespace": "shop" },
            "spec": {
                "models": ["gpt-4o"],
                "providers": [
                    { "name": "openai", "baseUrl": "https://api.openai.com/v1",
                      "auth": { "secretRef": { "name": "openai", "key": "apiKey" } } },
                    { "name": "local", "baseUrl": "http://vllm:8000/v1" },
                    { "name": "env", "baseUrl": "https://example.com/v1", "auth": { "env": "KEY" } },
                ],
            },
        }))
        .unwrap();
        assert_eq!(RouteInfo::from_route(&route), chat());
    }

    #[test]
    fn the_redis_password_ca_and_client_certificate_are_mounted_into_the_sidecar() {
        let route: InferenceRoute = serde_json::from_value(json!({
            "apiVersion": "tailwarden.io/v1alpha1",
            "kind": "InferenceRoute",
            "metadata": { "name": "limited", "namespace": "shop" },
            "spec": {
                "models": ["m"],
                "providers": [{ "name": "p", "baseUrl": "http://p/v1" }],
                "rateLimit": { "tokensPerMinute": 1000, "backend": "redis", "redis": {
                    "address": "rediss://redis.shop:6380",
                    "auth": { "password": { "secretRef": { "name": "redis", "key": "password" } } },
                    "tls": { "ca": { "secretRef": { "name": "redis-ca", "key": "ca.crt" } },
                             "clientCertificate": { "secretName": "redis-client" } } } },
                "cache": { "exact": { "enabled": true, "backend": "redis", "redis": {
                    "address": "redis.shop:6379",
                    "auth": { "username": "cache", "password": { "env": "REDIS_PASSWORD" } } } } },
            },
        }))
        .unwrap();
        let info = RouteInfo::from_route(&route);
        let pod = json!({
            "metadata": { "name": "app", "annotations": { ROUTES_ANNOTATION: "limited" } },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        let got = inject_into(pod, &labels(None), &[info], &cfg());
        let keys = got["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == KEYS_VOLUME)
            .expect("a keys volume");
        // Each Secret's keys, at the paths the rendered config names (render.rs tests them);
        // the env source needs nothing mounted.
        assert_eq!(
            keys["projected"]["sources"],
            json!([
                { "secret": { "name": "redis", "items": [{ "key": "password", "path": "redis/password" }], "optional": true } },
                { "secret": { "name": "redis-ca", "items": [{ "key": "ca.crt", "path": "redis-ca/ca.crt" }], "optional": true } },
                { "secret": { "name": "redis-client", "items": [
                    { "key": "tls.crt", "path": "redis-client/tls.crt" },
                    { "key": "tls.key", "path": "redis-client/tls.key" },
                ], "optional": true } },
            ])
        );
        assert_eq!(
            got["spec"]["initContainers"][0]["volumeMounts"],
            expected_sidecar(true)["volumeMounts"],
            "the keys volume is mounted read-only"
        );
    }

    // ---- the patch, applied to fixture pods -------------------------------------------

    /// Decide, patch, apply the patch to the JSON as submitted, and check the result is a
    /// valid Pod.
    fn inject_into(
        pod: Value,
        ns_labels: &BTreeMap<String, String>,
        routes: &[RouteInfo],
        cfg: &InjectConfig,
    ) -> Value {
        let typed: Pod = serde_json::from_value(pod.clone()).unwrap();
        let Decision::Inject { routes } = decide(&typed, ns_labels, routes) else {
            panic!("not injected: {:?}", decide(&typed, ns_labels, routes));
        };
        let patch = patch(&typed, &routes, cfg);
        let mut doc = pod;
        json_patch::patch(&mut doc, &patch).unwrap();
        let patched: Pod = serde_json::from_value(doc.clone()).unwrap();
        // Injecting twice is impossible: the result is recognised as injected.
        assert_eq!(
            decide(&patched, ns_labels, &routes),
            Decision::Skip(SkipReason::AlreadyInjected)
        );
        doc
    }

    /// The identity variables of a bare pod named `app` (sidecar_env has every case).
    fn identity_env() -> Value {
        json!([
            {"name": "TAILWARDEN_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "TAILWARDEN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "TAILWARDEN_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "TAILWARDEN_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "TAILWARDEN_SERVICE_ACCOUNT", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {"name": "TAILWARDEN_WORKLOAD_KIND", "value": "Pod"},
            {"name": "TAILWARDEN_WORKLOAD_NAME", "value": "app"},
        ])
    }

    fn expected_sidecar(mounts_keys: bool) -> Value {
        let mut mounts = vec![
            json!({ "name": "tailwarden-config", "mountPath": "/etc/tailwarden/routes", "readOnly": true }),
        ];
        if mounts_keys {
            mounts.push(json!({ "name": "tailwarden-keys", "mountPath": "/var/run/tailwarden/keys", "readOnly": true }));
        }
        json!({
            "name": "tailwarden-sidecar",
            "image": "ghcr.io/tailwarden/sidecar:0.1.0",
            "imagePullPolicy": "IfNotPresent",
            "restartPolicy": "Always",
            "args": [
                "--config", "/etc/tailwarden/routes",
                "--listen", "127.0.0.1:15080",
                "--admin", "127.0.0.1:15090",
                "--probe-listen", "0.0.0.0:15091",
                "--log-format", "json",
                "--max-connections", "2000",
            ],
            "ports": [{ "name": "tw-probe", "containerPort": 15091, "protocol": "TCP" }],
            "startupProbe": { "httpGet": { "path": "/readyz", "port": 15091 }, "periodSeconds": 1, "failureThreshold": 120 },
            "readinessProbe": { "httpGet": { "path": "/readyz", "port": 15091 }, "periodSeconds": 5 },
            "livenessProbe": { "httpGet": { "path": "/healthz", "port": 15091 }, "periodSeconds": 10, "failureThreshold": 3 },
            "resources": { "requests": { "cpu": "50m", "memory": "32Mi" }, "limits": { "memory": "128Mi" } },
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "readOnlyRootFilesystem": true,
                "allowPrivilegeEscalation": false,
                "privileged": false,
                "capabilities": { "drop": ["ALL"] },
                "seccompProfile": { "type": "RuntimeDefault" },
            },
            "volumeMounts": mounts,
            "env": identity_env(),
        })
    }

    #[test]
    fn plain_pod_gets_exactly_the_expected_fields() {
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": "app", "namespace": "shop" },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        let got = inject_into(pod, &labels(Some(ENABLED)), &[chat()], &cfg());
        let want = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "app",
                "namespace": "shop",
                "annotations": { "tailwarden.io/injected-routes": "chat" },
                "labels": { "tailwarden.io/injected": "true" },
            },
            "spec": {
                "initContainers": [expected_sidecar(true)],
                "containers": [{
                    "name": "app",
                    "image": "app:1",
                    "env": [
                        { "name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:15080/v1" },
                        { "name": "OPENAI_API_KEY", "value": "tailwarden-injected-placeholder" },
                    ],
                }],
                "volumes": [
                    { "name": "tailwarden-config", "projected": { "sources": [
                        { "configMap": { "name": "tailwarden-route-chat", "optional": true,
                          "items": [{ "key": "route.yaml", "path": "chat.yaml" }] } },
                    ] } },
                    { "name": "tailwarden-keys", "projected": { "sources": [
                        { "secret": { "name": "openai", "optional": true,
                          "items": [{ "key": "apiKey", "path": "openai/apiKey" }] } },
                    ] } },
                ],
            },
        });
        assert_eq!(got, want, "{}", serde_json::to_string_pretty(&got).unwrap());
        // The key lands where the rendered config says it is.
        assert_eq!(
            crate::consts::key_path("openai", "apiKey"),
            "/var/run/tailwarden/keys/openai/apiKey"
        );
    }

    #[test]
    fn generate_name_pod_with_existing_labels_and_annotations() {
        let pod = json!({
            "metadata": {
                "generateName": "app-7d9c-",
                "labels": { "app": "web" },
                "annotations": { ROUTES_ANNOTATION: "chat" },
                "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "app-7d9c", "uid": "u1" }],
            },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        let got = inject_into(pod, &labels(None), &[chat()], &cfg());
        assert!(got["metadata"].get("name").is_none());
        assert_eq!(got["metadata"]["generateName"], "app-7d9c-");
        assert_eq!(
            got["metadata"]["labels"],
            json!({ "app": "web", "tailwarden.io/injected": "true" })
        );
        assert_eq!(
            got["metadata"]["annotations"],
            json!({ ROUTES_ANNOTATION: "chat", INJECTED_ANNOTATION: "chat" })
        );
    }

    #[test]
    fn existing_init_containers_volumes_and_env() {
        let pod = json!({
            "metadata": {
                "name": "app",
                "annotations": { ROUTES_ANNOTATION: "embed,chat", "example.com/other": "x" },
            },
            "spec": {
                "initContainers": [{ "name": "migrate", "image": "migrate:1" }],
                "containers": [
                    { "name": "app", "image": "app:1",
                      "env": [{ "name": "OPENAI_BASE_URL", "value": "http://proxy:8080/v1" }] },
                    { "name": "worker", "image": "worker:1",
                      "env": [{ "name": "URL", "value": "$(OPENAI_BASE_URL)/chat" }] },
                ],
                "volumes": [{ "name": "data", "emptyDir": {} }],
            },
        });
        let got = inject_into(pod, &labels(None), &[chat(), embed()], &cfg());
        let spec = &got["spec"];
        // The sidecar is first; the existing init container follows, unchanged (no env).
        assert_eq!(spec["initContainers"][0], expected_sidecar(true));
        assert_eq!(
            spec["initContainers"][1],
            json!({ "name": "migrate", "image": "migrate:1" })
        );
        // An app's own OPENAI_BASE_URL wins; another app gets ours first, so it can refer to it.
        assert_eq!(
            spec["containers"][0]["env"],
            json!([{ "name": "OPENAI_BASE_URL", "value": "http://proxy:8080/v1" }])
        );
        assert_eq!(
            spec["containers"][1]["env"],
            json!([
                { "name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:15080/v1" },
                { "name": "OPENAI_API_KEY", "value": "tailwarden-injected-placeholder" },
                { "name": "URL", "value": "$(OPENAI_BASE_URL)/chat" },
            ])
        );
        // Existing volumes kept; one config source per route (annotation order); one
        // secret source per Secret, keys deduplicated.
        assert_eq!(
            spec["volumes"][0],
            json!({ "name": "data", "emptyDir": {} })
        );
        assert_eq!(
            spec["volumes"][1]["projected"]["sources"],
            json!([
                { "configMap": { "name": "tailwarden-route-embed", "optional": true,
                  "items": [{ "key": "route.yaml", "path": "embed.yaml" }] } },
                { "configMap": { "name": "tailwarden-route-chat", "optional": true,
                  "items": [{ "key": "route.yaml", "path": "chat.yaml" }] } },
            ])
        );
        assert_eq!(
            spec["volumes"][2]["projected"]["sources"],
            json!([
                { "secret": { "name": "azure", "optional": true, "items": [{ "key": "key", "path": "azure/key" }] } },
                { "secret": { "name": "openai", "optional": true, "items": [{ "key": "apiKey", "path": "openai/apiKey" }] } },
            ])
        );
        assert_eq!(spec["volumes"].as_array().unwrap().len(), 3);
        assert_eq!(
            got["metadata"]["annotations"],
            json!({ ROUTES_ANNOTATION: "embed,chat", "example.com/other": "x", INJECTED_ANNOTATION: "embed,chat" })
        );
    }

    #[test]
    fn base_url_opt_out_and_routes_without_secrets() {
        let pod = json!({
            "metadata": { "name": "app", "annotations": { ROUTES_ANNOTATION: "local", SET_BASE_URL_ANNOTATION: "false" } },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        let mut config = cfg();
        config.image_pull_policy = None;
        config.resources = None;
        config.log_filter = Some("debug".to_owned());
        config.max_connections = None;
        let got = inject_into(
            pod,
            &labels(None),
            &[RouteInfo::new("local", vec![])],
            &config,
        );
        assert_eq!(
            got["spec"]["containers"],
            json!([{ "name": "app", "image": "app:1" }])
        );
        // No Secret: no keys volume and no mount.
        assert_eq!(got["spec"]["volumes"].as_array().unwrap().len(), 1);
        let sidecar = &got["spec"]["initContainers"][0];
        assert_eq!(sidecar["volumeMounts"].as_array().unwrap().len(), 1);
        assert!(sidecar.get("imagePullPolicy").is_none() && sidecar.get("resources").is_none());
        // No cap configured: the sidecar's own default applies.
        assert!(
            !sidecar["args"]
                .as_array()
                .unwrap()
                .contains(&json!("--max-connections"))
        );
        let mut env = identity_env();
        env.as_array_mut()
            .unwrap()
            .push(json!({ "name": "TAILWARDEN_LOG", "value": "debug" }));
        assert_eq!(sidecar["env"], env);
    }

    #[test]
    fn the_otel_settings_and_the_pods_workload_reach_the_sidecar() {
        let pod = json!({
            "metadata": {
                "generateName": "web-7d9c-",
                "labels": { "app": "web", "pod-template-hash": "7d9c" },
                "annotations": { ROUTES_ANNOTATION: "chat" },
                "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9c",
                                      "uid": "u1", "controller": true }],
            },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        let mut config = cfg();
        let mut otel = OtelConfig::new(
            "http://collector:4318",
            sidecar_env::OtlpProtocol::HttpProtobuf,
        );
        otel.sampling_ratio = Some("0.5".to_owned());
        config.otel = Some(otel);
        let got = inject_into(pod, &labels(None), &[chat()], &config);
        let env = got["spec"]["initContainers"][0]["env"]
            .as_array()
            .unwrap()
            .clone();
        let get = |n: &str| {
            env.iter()
                .find(|e| e["name"] == n)
                .map(|e| e["value"].clone())
        };
        assert_eq!(get("TAILWARDEN_WORKLOAD_KIND"), Some(json!("Deployment")));
        assert_eq!(get("TAILWARDEN_WORKLOAD_NAME"), Some(json!("web")));
        assert_eq!(
            get("OTEL_EXPORTER_OTLP_ENDPOINT"),
            Some(json!("http://collector:4318"))
        );
        assert_eq!(get("OTEL_TRACES_SAMPLER_ARG"), Some(json!("0.5")));
        let attrs = get("OTEL_RESOURCE_ATTRIBUTES").unwrap();
        assert!(
            attrs.as_str().unwrap().contains("k8s.deployment.name=web,"),
            "{attrs}"
        );
        // The app container is not given any of it.
        assert_eq!(
            got["spec"]["containers"][0]["env"],
            json!([
                { "name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:15080/v1" },
                { "name": "OPENAI_API_KEY", "value": "tailwarden-injected-placeholder" },
            ])
        );
    }

    fn container(env: Value) -> Container {
        serde_json::from_value(json!({ "name": "app", "image": "app:1", "env": env })).unwrap()
    }

    fn names(vars: &[Value]) -> Vec<&str> {
        vars.iter().map(|v| v["name"].as_str().unwrap()).collect()
    }

    #[test]
    fn app_env_adds_the_base_url_and_a_placeholder_key_only_where_both_are_missing() {
        // Nothing set: both, base URL first.
        let vars = app_env(&container(Value::Null), true);
        assert_eq!(
            vars,
            [
                json!({ "name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:15080/v1" }),
                json!({ "name": "OPENAI_API_KEY", "value": "tailwarden-injected-placeholder" }),
            ]
        );
        // The app's own key (or a reference to a Secret) is kept: only the base URL.
        for key in [
            json!({ "name": "OPENAI_API_KEY", "value": "sk-app" }),
            json!({ "name": "OPENAI_API_KEY", "valueFrom": { "secretKeyRef": { "name": "s", "key": "k" } } }),
        ] {
            let vars = app_env(&container(json!([key])), true);
            assert_eq!(names(&vars), ["OPENAI_BASE_URL"]);
        }
        // A container with its own base URL talks to something else: nothing, not even a key.
        let own = container(json!([{ "name": "OPENAI_BASE_URL", "value": "http://proxy/v1" }]));
        assert!(app_env(&own, true).is_empty());
        // The pod opted out of the base URL: nothing.
        assert!(app_env(&container(Value::Null), false).is_empty());
        // envFrom is not looked into: the placeholder is still added (an env entry wins over
        // envFrom, and the sidecar never forwards the app's key anyway).
        let mut from = container(Value::Null);
        from.env_from = Some(vec![
            serde_json::from_value(json!({ "secretRef": { "name": "openai" } })).unwrap(),
        ]);
        assert_eq!(
            names(&app_env(&from, true)),
            ["OPENAI_BASE_URL", "OPENAI_API_KEY"]
        );
    }

    #[test]
    fn the_placeholder_is_obviously_not_a_key() {
        assert!(!API_KEY_PLACEHOLDER.starts_with("sk-"));
        assert!(API_KEY_PLACEHOLDER.contains("placeholder"));
    }

    #[test]
    fn opting_out_of_the_base_url_adds_no_placeholder_key() {
        let pod = json!({
            "metadata": { "name": "app", "annotations": { ROUTES_ANNOTATION: "chat", SET_BASE_URL_ANNOTATION: "false" } },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        let got = inject_into(pod, &labels(None), &[chat()], &cfg());
        assert!(got["spec"]["containers"][0].get("env").is_none(), "{got}");
    }

    #[test]
    fn already_injected_and_host_network_pods_are_left_alone() {
        let plain = json!({
            "metadata": { "name": "app", "annotations": { ROUTES_ANNOTATION: "chat" } },
            "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
        });
        // `inject_into` asserts that the injected result decides AlreadyInjected.
        inject_into(plain.clone(), &labels(None), &[chat()], &cfg());

        let mut host = plain;
        host["spec"]["hostNetwork"] = json!(true);
        let pod: Pod = serde_json::from_value(host).unwrap();
        assert_eq!(
            decide(&pod, &labels(None), &[chat()]),
            Decision::Skip(SkipReason::HostNetwork)
        );
    }

    #[test]
    fn sidecar_is_a_valid_native_sidecar_container() {
        let workload = Workload {
            kind: "Deployment".into(),
            name: "web".into(),
        };
        let c = sidecar_container_typed(true, &workload, &cfg()).unwrap();
        assert_eq!(c.restart_policy.as_deref(), Some("Always"));
        let sc = c.security_context.unwrap();
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.capabilities.unwrap().drop.unwrap(), ["ALL"]);
        assert_eq!(c.startup_probe.unwrap().failure_threshold, Some(120));
    }

    #[test]
    fn annotation_keys_are_escaped_in_pointers() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "annotations": {}, "labels": {} },
            "spec": { "containers": [] },
        }))
        .unwrap();
        let p = serde_json::to_value(patch(&pod, &[chat()], &cfg())).unwrap();
        let paths: Vec<&str> = p
            .as_array()
            .unwrap()
            .iter()
            .map(|op| op["path"].as_str().unwrap())
            .collect();
        assert!(
            paths.contains(&"/metadata/annotations/tailwarden.io~1injected-routes"),
            "{paths:?}"
        );
        assert!(
            paths.contains(&"/metadata/labels/tailwarden.io~1injected"),
            "{paths:?}"
        );
    }
}
