//! The `InferenceRoute` controller: for each route, publish its rendered sidecar config as a
//! ConfigMap it owns (server-side apply, fixed field manager) and report the truth in status.
//!
//! Triggers: route spec changes (generations, so our own status writes do not loop) and the
//! other routes of the namespace those changes may flip (see `triggers`), the route's
//! ConfigMap (edited by hand → put back), the Secrets it references in the namespaces the
//! operator may read Secrets in (created, rotated, deleted → `ResolvedRefs`; see
//! [`SecretAccess`]), and injected pods (→ `injectedPods`).
//! Errors are transient (API trouble: requeue with backoff) or permanent (an invalid spec:
//! conditions False, wait for the next change).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant},
};

use futures_util::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::{
    api::core::v1::{ConfigMap, Pod, Secret},
    apimachinery::pkg::apis::meta::v1::OwnerReference,
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ObjectMeta, PartialObjectMeta, Patch, PatchParams},
    runtime::{
        Controller, WatchStreamExt,
        controller::Action,
        events::{Event, EventType, Recorder, Reporter},
        reflector::{self, ObjectRef, Store},
        utils::Backoff,
        watcher,
    },
};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use tailwarden_crds::InferenceRoute;

use crate::{
    consts,
    render::{self, SecretKeys},
    status::{self, ACCEPTED, Observation, Observed, READY},
    triggers::RouteTriggers,
};

/// Reconcile errors. All are transient: permanent problems (an invalid spec, a missing
/// Secret) are reported in status, not returned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("route has no namespace")]
    NoNamespace,
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("rendering: {0}")]
    Render(#[from] render::RenderError),
}

impl Error {
    fn reason(&self) -> &'static str {
        match self {
            Error::NoNamespace => "no_namespace",
            Error::Kube(kube::Error::Api(_)) => "api_error",
            Error::Kube(_) => "api_unreachable",
            Error::Render(_) => "render",
        }
    }
}

/// Controller metrics.
#[derive(Clone)]
pub struct Metrics {
    pub reconciles: IntCounterVec,
    pub failures: IntCounterVec,
    pub duration: HistogramVec,
}

impl Metrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            reconciles: IntCounterVec::new(
                Opts::new(
                    "tailwarden_operator_reconciles_total",
                    "Route reconciles by result.",
                ),
                &["result"],
            )?,
            failures: IntCounterVec::new(
                Opts::new(
                    "tailwarden_operator_reconcile_failures_total",
                    "Failed reconciles by reason.",
                ),
                &["reason"],
            )?,
            duration: HistogramVec::new(
                HistogramOpts::new(
                    "tailwarden_operator_reconcile_duration_seconds",
                    "Reconcile duration.",
                )
                .buckets(vec![
                    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                ]),
                &[],
            )?,
        };
        registry.register(Box::new(m.reconciles.clone()))?;
        registry.register(Box::new(m.failures.clone()))?;
        registry.register(Box::new(m.duration.clone()))?;
        Ok(m)
    }
}

/// Where the operator may read Secrets. `list` on Secrets returns their values (RBAC has no
/// "metadata only" verb), so by default the operator holds no Secret access outside its own
/// namespace: it renders and publishes routes without looking, and `ResolvedRefs` is
/// `Unknown` (the sidecar skips a provider whose key file is missing either way). Where a
/// platform team opts a namespace in (a RoleBinding there), the operator checks the keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretAccess {
    namespaces: BTreeSet<String>,
}

impl SecretAccess {
    /// Read access in these namespaces only.
    pub fn new(namespaces: impl IntoIterator<Item = String>) -> Self {
        Self {
            namespaces: namespaces.into_iter().collect(),
        }
    }

    /// Whether the operator may read Secrets in `namespace`.
    pub fn readable(&self, namespace: &str) -> bool {
        self.namespaces.contains(namespace)
    }

    /// The namespaces whose Secrets to watch for a controller of `scope` (one namespace, or
    /// all when `None`).
    fn watched(&self, scope: Option<&str>) -> Vec<String> {
        self.namespaces
            .iter()
            .filter(|ns| scope.is_none_or(|s| s == ns.as_str()))
            .cloned()
            .collect()
    }
}

/// What reconcile needs.
pub struct Context {
    pub client: Client,
    pub secret_access: SecretAccess,
    pub routes: Store<InferenceRoute>,
    pub pods: Store<Pod>,
    pub recorder: Recorder,
    pub metrics: Metrics,
}

/// Names of the Secrets a route references (providers' keys, Redis passwords and
/// certificates), sorted, without repeats.
fn referenced_secrets(route: &InferenceRoute) -> Vec<String> {
    let mut names: Vec<String> = render::secret_refs(route)
        .into_iter()
        .map(|(secret, _)| secret)
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Names and data keys of the Secrets the route references (values are dropped at once).
async fn secret_keys(
    client: &Client,
    ns: &str,
    route: &InferenceRoute,
) -> Result<SecretKeys, Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut out = SecretKeys::new();
    for name in referenced_secrets(route) {
        if let Some(secret) = api.get_opt(&name).await? {
            let keys = secret
                .data
                .iter()
                .flat_map(|d| d.keys().cloned())
                .chain(secret.string_data.iter().flat_map(|d| d.keys().cloned()))
                .collect();
            out.insert(name, keys);
        }
    }
    Ok(out)
}

/// Running pods whose sidecar serves this route.
fn injected_pods(pods: &Store<Pod>, ns: &str, name: &str) -> u32 {
    pods.state()
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns))
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| {
            p.annotations()
                .get(consts::INJECTED_ANNOTATION)
                .is_some_and(|routes| routes.split(',').any(|r| r.trim() == name))
        })
        .count() as u32
}

fn config_map(route: &InferenceRoute, desired: &render::Desired) -> Option<ConfigMap> {
    let name = route.metadata.name.clone()?;
    let owner = OwnerReference {
        api_version: InferenceRoute::api_version(&()).into_owned(),
        kind: InferenceRoute::kind(&()).into_owned(),
        name: name.clone(),
        uid: route.metadata.uid.clone()?,
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    Some(ConfigMap {
        metadata: ObjectMeta {
            name: Some(consts::config_map_name(&name)),
            namespace: route.metadata.namespace.clone(),
            labels: Some(BTreeMap::from([
                (consts::ROUTE_LABEL.to_owned(), name),
                (
                    "app.kubernetes.io/managed-by".to_owned(),
                    "tailwarden-operator".to_owned(),
                ),
            ])),
            annotations: Some(BTreeMap::from([(
                "tailwarden.io/config-hash".to_owned(),
                desired.config_hash.clone(),
            )])),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(
            consts::CONFIG_KEY.to_owned(),
            desired.config_yaml.clone(),
        )])),
        ..ConfigMap::default()
    })
}

/// Reconciles one route.
pub async fn reconcile(route: Arc<InferenceRoute>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&route, &ctx).await;
    ctx.metrics
        .duration
        .with_label_values(&[] as &[&str])
        .observe(started.elapsed().as_secs_f64());
    let label = if result.is_ok() { "ok" } else { "error" };
    ctx.metrics.reconciles.with_label_values(&[label]).inc();
    result
}

async fn reconcile_inner(route: &InferenceRoute, ctx: &Context) -> Result<Action, Error> {
    let ns = route.namespace().ok_or(Error::NoNamespace)?;
    let name = route.name_any();
    let client = &ctx.client;

    // Accepted: the spec passes the CRD's own rules (the API server checked them when the
    // CRD was current; this catches routes stored under an older CRD) and claims no model
    // an older route of the namespace already serves.
    let mut problems: Vec<String> = match tailwarden_crds::crd::validate(route) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.iter().map(|e| e.to_string()).collect(),
    };
    let invalid = !problems.is_empty();
    let all = ctx.routes.state();
    problems.extend(render::model_conflicts(
        route,
        all.iter().map(AsRef::as_ref),
    ));
    let accepted = if problems.is_empty() {
        Observed::new(ACCEPTED, true, "Valid", "The route is valid.")
    } else {
        let reason = if invalid { "Invalid" } else { "ModelConflict" };
        Observed::new(ACCEPTED, false, reason, problems.join("; "))
    };

    // Secrets are read only where the operator was granted it; elsewhere nothing is asked
    // (no Forbidden in the audit log per reconcile) and the keys stay unchecked.
    let readable = ctx.secret_access.readable(&ns);
    let secrets = if readable {
        secret_keys(client, &ns, route).await?
    } else {
        SecretKeys::new()
    };
    let desired = render::desired(route, &secrets)?;
    let resolved = status::resolved_refs(&ns, &desired, readable);

    // Publish only an accepted config: otherwise the sidecars keep the last good one.
    let mut published = false;
    if accepted.ok()
        && let Some(cm) = config_map(route, &desired)
    {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
        let params = PatchParams::apply(consts::FIELD_MANAGER).force();
        api.patch(&consts::config_map_name(&name), &params, &Patch::Apply(&cm))
            .await?;
        published = true;
    }
    let ready = match (accepted.ok(), resolved.failed(), published) {
        (true, false, true) => Observed::new(
            READY,
            true,
            "Published",
            format!(
                "Config {} is published in ConfigMap {}.",
                desired.config_hash,
                consts::config_map_name(&name)
            ),
        ),
        (false, _, _) => Observed::new(
            READY,
            false,
            "NotAccepted",
            "The route is not accepted; see Accepted.",
        ),
        (true, true, _) => Observed::new(
            READY,
            false,
            "RefsNotResolved",
            format!(
                "The config is published, but providers without their key are skipped: {}",
                desired.missing.join("; ")
            ),
        ),
        (true, false, false) => Observed::new(
            READY,
            false,
            "NotPublished",
            "The config could not be published.",
        ),
    };

    let observation = Observation {
        generation: route.metadata.generation,
        conditions: vec![accepted, resolved, ready],
        config_hash: published.then(|| desired.config_hash.clone()),
        injected_pods: injected_pods(&ctx.pods, &ns, &name),
    };
    let current = route.status.as_ref();
    let next = status::next_status(current, &observation, Timestamp::now());
    if current != Some(&next) {
        let api: Api<InferenceRoute> = Api::namespaced(client.clone(), &ns);
        let patch = serde_json::json!({ "status": next });
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            // Deleted while we reconciled it: nothing is left to report, and nothing failed
            // (a ConfigMap we may just have written is garbage-collected with its owner).
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
            Err(e) => return Err(e.into()),
        }
        let reference = route.object_ref(&());
        for (kind, truth, reason, message) in status::transitions(current, &next) {
            let event = Event {
                type_: if truth == "False" {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: if truth == "True" {
                    kind
                } else {
                    format!("{kind}{truth}")
                },
                note: Some(format!("{reason}: {message}").chars().take(1000).collect()),
                action: "Reconcile".into(),
                secondary: None,
            };
            if let Err(e) = ctx.recorder.publish(&event, &reference).await {
                tracing::warn!(route = %name, error = %e, "cannot publish event");
            }
        }
    }
    if next.conditions.iter().any(|c| c.status == "False") {
        tracing::info!(namespace = %ns, route = %name, "route not ready: {}", next.conditions.iter().filter(|c| c.status == "False").map(|c| format!("{}={} ({})", c.type_, c.reason, c.message)).collect::<Vec<_>>().join(", "));
    }
    // Periodic resync as a safety net for missed watch events.
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Transient errors: requeue with a delay (the controller also backs off per object).
pub fn error_policy(route: Arc<InferenceRoute>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(route = %route.name_any(), error = %error, "reconcile failed; retrying");
    ctx.metrics
        .failures
        .with_label_values(&[error.reason()])
        .inc();
    Action::requeue(Duration::from_secs(5))
}

/// Runs the controller for one namespace (`Some`) or all (`None`) until `shutdown`.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    secret_access: SecretAccess,
    metrics: Metrics,
    reporter: Reporter,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let (routes_store, routes_writer) = reflector::store();
    let routes_api: Api<InferenceRoute> = api_for(&client, namespace.as_deref());
    let cm_api: Api<PartialObjectMeta<ConfigMap>> = match namespace.as_deref() {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let pod_api: Api<Pod> = api_for(&client, namespace.as_deref());

    let (pods, pods_writer) = reflector::store();
    let injected = watcher::Config::default().labels(&format!("{}=true", consts::INJECTED_LABEL));
    let pod_stream = watcher(pod_api, injected)
        .backoff(WatchBackoff::default())
        .reflect(pods_writer)
        .touched_objects();

    // A route's own spec changes, and the routes whose acceptance they may flip (see
    // `triggers`), looked up in the cache the reflector has just updated.
    let mut triggers = RouteTriggers::default();
    let triggers_store = routes_store.clone();
    let route_stream = watcher(routes_api, watcher::Config::default())
        .backoff(WatchBackoff::default())
        .reflect(routes_writer)
        .map_ok(move |event| {
            let refs = triggers.on_event(&event, || triggers_store.state());
            let routes: Vec<_> = refs
                .iter()
                .filter_map(|r| triggers_store.get(r))
                .map(|r| Ok((*r).clone()))
                .collect();
            futures_util::stream::iter(routes)
        })
        .try_flatten();

    // Secrets only in the namespaces the operator may read them in, one watch each, and
    // metadata only: a changed Secret is all the controller needs to know.
    let secret_watches: Vec<_> = secret_access
        .watched(namespace.as_deref())
        .into_iter()
        .map(|ns| {
            let api: Api<PartialObjectMeta<Secret>> = Api::namespaced(client.clone(), &ns);
            watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::default())
                .touched_objects()
                .boxed()
        })
        .collect();
    // The route's ConfigMap: edited or deleted by someone else → reconcile its owner.
    let owned = watcher::Config::default().labels(consts::ROUTE_LABEL);
    let cm_stream = watcher(cm_api, owned)
        .backoff(WatchBackoff::default())
        .touched_objects();

    let ctx = Arc::new(Context {
        client: client.clone(),
        secret_access,
        routes: routes_store.clone(),
        pods: pods.clone(),
        recorder: Recorder::new(client.clone(), reporter),
        metrics,
    });
    let mut controller =
        Controller::for_stream(without_errors("routes", route_stream), routes_store)
            .owns_stream(without_errors("configmaps", cm_stream));
    if !secret_watches.is_empty() {
        let secrets_index = ctx.routes.clone();
        let secret_stream = futures_util::stream::select_all(secret_watches);
        controller =
            controller.watches_stream(without_errors("secrets", secret_stream), move |secret| {
                let ns = secret.metadata.namespace.clone();
                let name = secret.metadata.name.clone().unwrap_or_default();
                secrets_index
                    .state()
                    .iter()
                    .filter(|r| r.metadata.namespace == ns && referenced_secrets(r).contains(&name))
                    .map(|r| ObjectRef::from_obj(&**r))
                    .collect::<Vec<_>>()
            });
    }
    controller
        .watches_stream(without_errors("pods", pod_stream), |pod: Pod| {
            let ns = pod.metadata.namespace.clone().unwrap_or_default();
            pod.annotations()
                .get(consts::INJECTED_ANNOTATION)
                .map(|routes| {
                    routes
                        .split(',')
                        .map(|r| ObjectRef::<InferenceRoute>::new(r.trim()).within(&ns))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
}

/// Backoff of every watch the operator keeps: 0.5 s, doubling, at most 5 s, reset by the
/// first event after an error. kube's default (client-go's: up to 30 s, plus jitter) is
/// meant for thousands of kubelets hitting one API server; for a handful of operator
/// watches it only delays recovery: after an API server restart a watch could sleep 30 s
/// and then, on the `410 Gone` its resumed watch gets, another 30 s before re-listing.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    pub const FIRST: Duration = Duration::from_millis(500);
    pub const MAX: Duration = Duration::from_secs(5);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (delay * 2).min(Self::MAX);
        Some(delay)
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// A trigger stream with its errors logged and dropped. Each watch already backs off on
/// its own errors ([`WatchBackoff`]); an error reaching the `Controller` would also put its
/// one shared trigger backoff to sleep — every watch at once, for up to 30 s per error.
/// After an API server restart each watch reports an error or two, and a route created
/// then was not reconciled within 45 s (`tests/churn.rs`).
fn without_errors<T>(
    watch: &'static str,
    stream: impl Stream<Item = Result<T, watcher::Error>>,
) -> impl Stream<Item = Result<T, watcher::Error>> {
    stream.filter_map(move |item| {
        std::future::ready(match item {
            Ok(obj) => Some(Ok(obj)),
            Err(e) => {
                tracing::warn!(watch, error = %e, "watch failed; retrying");
                None
            }
        })
    })
}

fn api_for<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_readable_and_watched_only_where_granted() {
        let none = SecretAccess::default();
        assert!(!none.readable("shop"));
        assert!(none.watched(None).is_empty());
        let some = SecretAccess::new(["shop".to_owned(), "ml".to_owned()]);
        assert!(some.readable("shop") && !some.readable("other"));
        assert_eq!(some.watched(None), ["ml", "shop"]);
        assert_eq!(some.watched(Some("shop")), ["shop"]);
        assert!(some.watched(Some("other")).is_empty());
    }

    #[test]
    fn watch_backoff_doubles_to_five_seconds_and_resets() {
        let mut b = WatchBackoff::default();
        let ms: Vec<u128> = b.by_ref().take(6).map(|d| d.as_millis()).collect();
        assert_eq!(ms, [500, 1000, 2000, 4000, 5000, 5000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(500)));
    }
}
