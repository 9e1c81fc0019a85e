//! Names shared by the controller, the webhook, the chart and the sidecar: annotations,
//! labels, object names, ports and paths. One place, so the parts cannot disagree.

/// Pod annotation listing the routes (InferenceRoute names in the pod's namespace) the
/// sidecar serves: `tailwarden.io/routes: chat,other`.
pub const ROUTES_ANNOTATION: &str = "tailwarden.io/routes";
/// Pod annotation `tailwarden.io/inject: disabled` opts a pod out even in an enabled namespace.
pub const INJECT_ANNOTATION: &str = "tailwarden.io/inject";
/// Namespace label `tailwarden.io/inject=enabled`: every pod gets the namespace's routes.
pub const INJECT_LABEL: &str = "tailwarden.io/inject";
/// The value of [`INJECT_LABEL`] / [`INJECT_ANNOTATION`] that opts in / out.
pub const ENABLED: &str = "enabled";
pub const DISABLED: &str = "disabled";
/// Pod annotation `tailwarden.io/set-base-url: "false"` keeps `OPENAI_BASE_URL` untouched.
pub const SET_BASE_URL_ANNOTATION: &str = "tailwarden.io/set-base-url";
/// Annotation the webhook sets on pods it injected (value: the routes).
pub const INJECTED_ANNOTATION: &str = "tailwarden.io/injected-routes";
/// Label the webhook sets on injected pods, so the controller can count them cheaply.
pub const INJECTED_LABEL: &str = "tailwarden.io/injected";

/// Name of the injected sidecar container (a native sidecar: an init container with
/// `restartPolicy: Always`).
pub const SIDECAR_CONTAINER: &str = "tailwarden-sidecar";
/// Volume holding the rendered route configs (a projected volume of the routes' ConfigMaps).
pub const CONFIG_VOLUME: &str = "tailwarden-config";
/// Mount path of [`CONFIG_VOLUME`]; the sidecar's `--config` points at this directory.
pub const CONFIG_DIR: &str = "/etc/tailwarden/routes";
/// Volume holding the provider keys (a projected volume of the referenced Secret keys).
pub const KEYS_VOLUME: &str = "tailwarden-keys";
/// Mount path of [`KEYS_VOLUME`]; a key `apiKey` of Secret `openai` is at
/// `{KEYS_DIR}/openai/apiKey`, which is what the rendered config's `auth.file` names.
pub const KEYS_DIR: &str = "/var/run/tailwarden/keys";

/// The client port apps talk to, on loopback.
pub const CLIENT_PORT: u16 = 15080;
/// The admin port (`/config`, `/metrics`, …), on loopback.
pub const ADMIN_PORT: u16 = 15090;
/// The probe port on the pod IP: only `/healthz`, `/readyz` and `/metrics`, for kubelet
/// probes and Prometheus.
pub const PROBE_PORT: u16 = 15091;
/// What app containers get as `OPENAI_BASE_URL`.
pub const BASE_URL: &str = "http://127.0.0.1:15080/v1";

/// Field manager for server-side apply.
pub const FIELD_MANAGER: &str = "tailwarden-operator";
/// Key of the rendered route inside its ConfigMap.
pub const CONFIG_KEY: &str = "route.yaml";
/// Label on ConfigMaps the operator owns, with the route name as value.
pub const ROUTE_LABEL: &str = "tailwarden.io/route";

/// ConfigMap holding a route's rendered sidecar config.
pub fn config_map_name(route: &str) -> String {
    format!("tailwarden-route-{route}")
}

/// Path of a Secret key inside the sidecar.
pub fn key_path(secret: &str, key: &str) -> String {
    format!("{KEYS_DIR}/{secret}/{key}")
}
