//! The mutating admission webhook: an HTTPS server (hyper 1 + tokio-rustls) answering
//! `POST /mutate-pods` with AdmissionReview v1, plus `GET /healthz` and `GET /readyz`.
//!
//! It never denies a pod. Whatever goes wrong — a review it cannot read, a pod it cannot
//! parse, a patch that would not apply — the pod is allowed unchanged, the problem is
//! logged and counted (`tailwarden_injections_total{result="error"}`), and the workload
//! runs without the sidecar rather than not at all. The patch is applied to the submitted
//! object before it is returned: a patch the API server failed to apply would reject the
//! pod, whatever the `failurePolicy`.
//!
//! The webhook learns about namespaces and routes through [`InjectionContext`] and
//! reports skips through [`EventSink`], both traits, so it runs in tests without a cluster.
//! Events are fire-and-forget and never delay the admission response. The serving
//! certificate comes from a [`CertStore`] read on every handshake, so a renewed
//! certificate applies without a restart.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::Client;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus::{IntCounterVec, Opts, Registry};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::certs::CertStore;
use crate::inject::{self, Decision, InjectConfig, RouteInfo, SkipReason};

/// Path of the mutating webhook (the MutatingWebhookConfiguration's `service.path`).
pub const MUTATE_PATH: &str = "/mutate-pods";
/// Largest AdmissionReview accepted. Pods are far smaller; the API server's own request
/// limit is 3 MiB, and the review wraps the object.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Longest time a client may take to send request headers (slowloris protection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest time a client may take to send the body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long in-flight reviews get to finish on shutdown.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// At most this many Event writes in flight; more are dropped (and logged), so a burst of
/// skipped pods cannot pile up tasks or load the API server.
pub const MAX_EVENTS_IN_FLIGHT: usize = 32;

/// The counter of admission outcomes.
pub const INJECTIONS_METRIC: &str = "tailwarden_injections_total";

/// Errors setting up or running the server. Per-request problems are not errors: they end
/// in an allowed response.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("the request is not an AdmissionReview: {0}")]
    BadReview(String),
}

/// Why a review ended in an allowed response without a decision (the `reason` label of
/// `result="error"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorReason {
    /// The body is not an AdmissionReview.
    InvalidReview,
    /// Not a Pod CREATE (the webhook's rules are wider than they should be).
    UnsupportedRequest,
    /// The object is not a valid Pod.
    InvalidPod,
    /// The caches of namespaces and routes are not synced yet.
    NotReady,
    /// The patch would not apply to the submitted pod (a bug: see the logs).
    PatchInvalid,
    /// The body was over [`MAX_BODY_BYTES`].
    BodyTooLarge,
    /// The body did not arrive within [`BODY_READ_TIMEOUT`].
    BodyTimeout,
}

impl ErrorReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidReview => "InvalidReview",
            Self::UnsupportedRequest => "UnsupportedRequest",
            Self::InvalidPod => "InvalidPod",
            Self::NotReady => "NotReady",
            Self::PatchInvalid => "PatchInvalid",
            Self::BodyTooLarge => "BodyTooLarge",
            Self::BodyTimeout => "BodyTimeout",
        }
    }
}

/// What the webhook needs from the cluster, answered from caches (reflector stores):
/// admission must not wait on API calls.
pub trait InjectionContext: Send + Sync {
    /// Labels of namespace `ns`; `None` when it is not (yet) known.
    fn namespace_labels(&self, ns: &str) -> Option<BTreeMap<String, String>>;
    /// Every InferenceRoute of namespace `ns`.
    fn routes(&self, ns: &str) -> Vec<RouteInfo>;
    /// Whether the caches are synced. Until then reviews are allowed unchanged (reason
    /// `NotReady`) rather than decided on missing data (which would skip with a false
    /// `UnknownRoute`), and `/readyz` fails.
    fn is_ready(&self) -> bool {
        true
    }
}

/// Where skip Events go. `publish` is called on the admission path, so it must return at
/// once; [`RecorderSink`] hands the write to a task.
pub trait EventSink: Send + Sync {
    /// Publish `event` about `regarding` (the pod's owner).
    fn publish(&self, event: Event, regarding: ObjectReference);
}

/// [`EventSink`] writing `events.k8s.io/v1` Events with kube's [`Recorder`] (which merges
/// repeats into a series), from spawned tasks.
#[derive(Clone)]
pub struct RecorderSink {
    recorder: Recorder,
    in_flight: Arc<Semaphore>,
}

impl RecorderSink {
    /// A sink reporting as `reporter` (controller `tailwarden-operator`, instance: the pod).
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            recorder: Recorder::new(client, reporter),
            in_flight: Arc::new(Semaphore::new(MAX_EVENTS_IN_FLIGHT)),
        }
    }
}

impl EventSink for RecorderSink {
    fn publish(&self, event: Event, regarding: ObjectReference) {
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            tracing::warn!(reason = %event.reason, "too many Event writes in flight; dropping one");
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let recorder = self.recorder.clone();
        runtime.spawn(async move {
            if let Err(e) = recorder.publish(&event, &regarding).await {
                tracing::warn!(error = %e, reason = %event.reason, "could not publish an Event");
            }
            drop(permit);
        });
    }
}

/// `tailwarden_injections_total{result, reason}`: `result` is `injected` (reason
/// `Injected`), `skipped` (reason: [`SkipReason::as_str`]) or `error` (reason:
/// [`ErrorReason::as_str`]).
#[derive(Clone, Debug)]
pub struct WebhookMetrics {
    injections: IntCounterVec,
}

impl WebhookMetrics {
    /// Register the counters into `registry`, with every known label pair at zero so the
    /// series exist before the first event.
    pub fn register(registry: &Registry) -> Result<Self, WebhookError> {
        let injections = IntCounterVec::new(
            Opts::new(
                INJECTIONS_METRIC,
                "Pod admissions by the injection webhook, by result (injected, skipped, error) and reason.",
            ),
            &["result", "reason"],
        )?;
        registry.register(Box::new(injections.clone()))?;
        let metrics = Self { injections };
        metrics
            .injections
            .with_label_values(&["injected", "Injected"]);
        for reason in [
            SkipReason::NotOptedIn,
            SkipReason::OptedOut,
            SkipReason::HostNetwork,
            SkipReason::AlreadyInjected,
            SkipReason::UnknownRoute(Vec::new()),
            SkipReason::NoRoutes,
        ] {
            metrics
                .injections
                .with_label_values(&["skipped", reason.as_str()]);
        }
        Ok(metrics)
    }

    fn injected(&self) {
        self.injections
            .with_label_values(&["injected", "Injected"])
            .inc();
    }

    fn skipped(&self, reason: &SkipReason) {
        self.injections
            .with_label_values(&["skipped", reason.as_str()])
            .inc();
    }

    fn error(&self, reason: ErrorReason) {
        self.injections
            .with_label_values(&["error", reason.as_str()])
            .inc();
    }
}

/// The webhook: decides and patches AdmissionReviews, and serves them over HTTPS.
pub struct Webhook {
    ctx: Arc<dyn InjectionContext>,
    cfg: InjectConfig,
    metrics: WebhookMetrics,
    events: Option<Arc<dyn EventSink>>,
}

impl Webhook {
    /// A webhook injecting `cfg`'s sidecar, its counters registered into `registry`.
    pub fn new(
        ctx: Arc<dyn InjectionContext>,
        cfg: InjectConfig,
        registry: &Registry,
    ) -> Result<Self, WebhookError> {
        Ok(Self {
            ctx,
            cfg,
            metrics: WebhookMetrics::register(registry)?,
            events: None,
        })
    }

    /// Publish skip Events to `sink` (without one, skips are only logged and counted).
    pub fn with_events(mut self, sink: Arc<dyn EventSink>) -> Self {
        self.events = Some(sink);
        self
    }

    /// Answer one AdmissionReview body with the AdmissionReview to send back (JSON).
    /// `Err` only when the body is not a review with a `request.uid` to answer to — the
    /// caller replies 400, which the API server treats as a failed call and, with
    /// `failurePolicy: Ignore`, admits the pod.
    pub fn admit(&self, body: &[u8]) -> Result<Vec<u8>, WebhookError> {
        let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
            Ok(review) => review,
            Err(e) => {
                self.metrics.error(ErrorReason::InvalidReview);
                // Salvage the uid if there is one: an allowed answer is better than a 400.
                let salvaged = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
                    let uid = v.pointer("/request/uid")?.as_str()?.to_owned();
                    let api_version = v
                        .get("apiVersion")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    Some((uid, api_version))
                });
                let Some((uid, api_version)) = salvaged else {
                    tracing::warn!(error = %e, "unreadable AdmissionReview");
                    return Err(WebhookError::BadReview(e.to_string()));
                };
                tracing::warn!(error = %e, %uid, "unreadable AdmissionReview; allowing the object unchanged");
                let mut response = AdmissionResponse::invalid(e.to_string());
                response.uid = uid;
                response.allowed = true;
                response.result = Default::default();
                let mut review = response.into_review();
                if let Some(v) = api_version {
                    review.types.api_version = v;
                }
                return encode(review);
            }
        };
        let request: AdmissionRequest<DynamicObject> = match review.try_into() {
            Ok(request) => request,
            Err(e) => {
                self.metrics.error(ErrorReason::InvalidReview);
                tracing::warn!(error = %e, "AdmissionReview without a request");
                return Err(WebhookError::BadReview(e.to_string()));
            }
        };
        encode(self.respond(&request).into_review())
    }

    /// The response to one request: allowed, with a patch when the pod is injected.
    pub fn respond(&self, request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
        let allowed = AdmissionResponse::from(request);
        if request.operation != Operation::Create
            || request.kind.kind != "Pod"
            || request.sub_resource.is_some()
        {
            self.metrics.error(ErrorReason::UnsupportedRequest);
            tracing::warn!(kind = %request.kind.kind, operation = ?request.operation, "not a Pod CREATE; check the webhook's rules");
            return allowed;
        }
        let parsed = request
            .object
            .as_ref()
            .ok_or_else(|| "the request has no object".to_owned())
            .and_then(|object| serde_json::to_value(object).map_err(|e| e.to_string()))
            .and_then(|raw| {
                let pod = serde_json::from_value::<Pod>(raw.clone()).map_err(|e| e.to_string())?;
                Ok((raw, pod))
            });
        let (raw, pod) = match parsed {
            Ok(parsed) => parsed,
            Err(e) => {
                self.metrics.error(ErrorReason::InvalidPod);
                tracing::warn!(uid = %request.uid, error = %e, "cannot read the pod; allowing it unchanged");
                return allowed;
            }
        };
        let ns = request
            .namespace
            .clone()
            .or_else(|| pod.metadata.namespace.clone())
            .unwrap_or_default();
        let pod_name = display_name(&pod);

        if !self.ctx.is_ready() {
            self.metrics.error(ErrorReason::NotReady);
            tracing::warn!(namespace = %ns, pod = %pod_name, "namespace and route caches not synced yet; allowing the pod unchanged");
            return allowed;
        }
        let labels = self.ctx.namespace_labels(&ns).unwrap_or_else(|| {
            tracing::debug!(namespace = %ns, "namespace not in the cache; assuming no labels");
            BTreeMap::new()
        });
        let routes = self.ctx.routes(&ns);

        match inject::decide(&pod, &labels, &routes) {
            Decision::Inject { routes } => {
                let patch = inject::patch(&pod, &routes, &self.cfg);
                if let Err(e) = check_patch(&raw, &patch) {
                    self.metrics.error(ErrorReason::PatchInvalid);
                    tracing::error!(namespace = %ns, pod = %pod_name, error = %e, "the injection patch does not apply to this pod; allowing it unchanged");
                    return allowed;
                }
                match allowed.clone().with_patch(patch) {
                    Ok(response) => {
                        self.metrics.injected();
                        let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
                        tracing::info!(namespace = %ns, pod = %pod_name, routes = %names.join(","), "injecting the sidecar");
                        response
                    }
                    Err(e) => {
                        self.metrics.error(ErrorReason::PatchInvalid);
                        tracing::error!(namespace = %ns, pod = %pod_name, error = %e, "cannot serialise the patch; allowing the pod unchanged");
                        allowed
                    }
                }
            }
            Decision::Skip(reason) => {
                self.metrics.skipped(&reason);
                if reason == SkipReason::NotOptedIn {
                    tracing::debug!(namespace = %ns, pod = %pod_name, "not opted in");
                    return allowed;
                }
                tracing::info!(namespace = %ns, pod = %pod_name, reason = reason.as_str(), "not injecting: {reason}");
                // sideEffects: NoneOnDryRun — a dry run must leave no Event behind.
                if !request.dry_run {
                    self.publish_skip(&pod, &ns, &pod_name, &reason);
                }
                if reason.is_warning() {
                    // Shown by kubectl to whoever created the pod directly.
                    let mut response = allowed;
                    response.warnings = Some(vec![format!("tailwarden: {reason}")]);
                    return response;
                }
                allowed
            }
        }
    }

    fn publish_skip(&self, pod: &Pod, ns: &str, pod_name: &str, reason: &SkipReason) {
        let Some(sink) = &self.events else { return };
        let Some(regarding) = owner_reference(pod, ns) else {
            tracing::debug!(namespace = %ns, pod = %pod_name, "no owner and no name to put the Event on");
            return;
        };
        let mut note = format!("pod {pod_name}: {reason}");
        // The Events API caps notes at 1 kB.
        if note.len() > 1000 {
            let mut end = 1000;
            while !note.is_char_boundary(end) {
                end -= 1;
            }
            note.truncate(end);
        }
        sink.publish(
            Event {
                type_: if reason.is_warning() {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: reason.as_str().to_owned(),
                note: Some(note),
                action: "InjectSidecar".to_owned(),
                secondary: None,
            },
            regarding,
        );
    }

    /// Serve HTTPS on `listener` until `shutdown` completes, then drain for up to
    /// [`DRAIN_TIMEOUT`]. Handshakes fail until `certs` holds a certificate.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        certs: Arc<CertStore>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), WebhookError> {
        let acceptor = TlsAcceptor::from(Arc::new(tls_config(certs.clone())?));
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_buf_size(64 * 1024);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(256)
            .max_pending_accept_reset_streams(Some(64));
        let graceful = GracefulShutdown::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(s) => s,
                        Err(e) => {
                            // EMFILE and friends: back off briefly instead of spinning.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let acceptor = acceptor.clone();
                    let builder = builder.clone();
                    let watcher = graceful.watcher();
                    let webhook = self.clone();
                    let certs = certs.clone();
                    tokio::spawn(async move {
                        let tls = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                            Ok(Ok(tls)) => tls,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return;
                            }
                        };
                        let service = service_fn(move |req: Request<Incoming>| {
                            let webhook = webhook.clone();
                            let certs = certs.clone();
                            async move { Ok::<_, Infallible>(webhook.handle(&certs, req).await) }
                        });
                        let conn = builder.serve_connection(TokioIo::new(tls), service).into_owned();
                        if let Err(e) = watcher.watch(conn).await {
                            tracing::debug!(%peer, error = %e, "webhook connection ended with an error");
                        }
                    });
                }
                () = &mut shutdown => break,
            }
        }
        drop(listener);
        tokio::select! {
            () = graceful.shutdown() => {}
            () = tokio::time::sleep(DRAIN_TIMEOUT) => tracing::warn!("webhook drain timed out; closing remaining connections"),
        }
        Ok(())
    }

    async fn handle(&self, certs: &CertStore, req: Request<Incoming>) -> Response<Full<Bytes>> {
        match (req.method(), req.uri().path()) {
            (&Method::POST, MUTATE_PATH) => {
                let limited = Limited::new(req.into_body(), MAX_BODY_BYTES);
                let body = match tokio::time::timeout(BODY_READ_TIMEOUT, limited.collect()).await {
                    Ok(Ok(collected)) => collected.to_bytes(),
                    Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                        self.metrics.error(ErrorReason::BodyTooLarge);
                        return text(StatusCode::PAYLOAD_TOO_LARGE, "AdmissionReview too large\n");
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "reading an AdmissionReview failed");
                        return text(StatusCode::BAD_REQUEST, "cannot read the body\n");
                    }
                    Err(_) => {
                        self.metrics.error(ErrorReason::BodyTimeout);
                        return text(StatusCode::REQUEST_TIMEOUT, "body read timed out\n");
                    }
                };
                match self.admit(&body) {
                    Ok(json) => Response::builder()
                        .status(StatusCode::OK)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from(json)))
                        .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "")),
                    Err(e) => text(StatusCode::BAD_REQUEST, &format!("{e}\n")),
                }
            }
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") => {
                if !certs.is_loaded() {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no serving certificate yet\n",
                    )
                } else if !self.ctx.is_ready() {
                    text(StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n")
                } else {
                    text(StatusCode::OK, "ok\n")
                }
            }
            (_, MUTATE_PATH | "/healthz" | "/readyz") => {
                text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
            }
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}

/// The server's TLS config: certificates from `certs` at every handshake, HTTP/2 and
/// HTTP/1.1 by ALPN.
pub fn tls_config(certs: Arc<CertStore>) -> Result<rustls::ServerConfig, WebhookError> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_cert_resolver(certs);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain"),
    );
    response
}

/// Serialise a review for the API server, with the patch as the base64 string Go's
/// `[]byte` expects (kube serialises it as an array of numbers, which Go also accepts,
/// but base64 is the documented wire form and what other tools expect to read).
fn encode(review: AdmissionReview<DynamicObject>) -> Result<Vec<u8>, WebhookError> {
    let patch = review.response.as_ref().and_then(|r| r.patch.clone());
    let mut value =
        serde_json::to_value(&review).map_err(|e| WebhookError::BadReview(e.to_string()))?;
    if let (Some(patch), Some(slot)) = (patch, value.pointer_mut("/response/patch")) {
        *slot = serde_json::to_value(ByteString(patch))
            .map_err(|e| WebhookError::BadReview(e.to_string()))?;
    }
    serde_json::to_vec(&value).map_err(|e| WebhookError::BadReview(e.to_string()))
}

/// Apply `patch` to a copy of the submitted object and read the result back as a Pod: what
/// the API server will do, minus its validation.
fn check_patch(raw: &Value, patch: &json_patch::Patch) -> Result<(), String> {
    let mut doc = raw.clone();
    json_patch::patch(&mut doc, patch).map_err(|e| e.to_string())?;
    serde_json::from_value::<Pod>(doc).map_err(|e| e.to_string())?;
    Ok(())
}

/// `name`, or `generateName*` for pods not yet named.
fn display_name(pod: &Pod) -> String {
    match (&pod.metadata.name, &pod.metadata.generate_name) {
        (Some(name), _) if !name.is_empty() => name.clone(),
        (_, Some(prefix)) => format!("{prefix}*"),
        _ => "<unnamed>".to_owned(),
    }
}

/// The object an Event about this pod goes on: its first owner (a ReplicaSet, Job, …),
/// since the pod itself does not exist yet and, made from `generateName`, has no name;
/// a bare pod with a name gets it on itself.
fn owner_reference(pod: &Pod, ns: &str) -> Option<ObjectReference> {
    if let Some(owner) = pod
        .metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.first())
    {
        return Some(ObjectReference {
            api_version: Some(owner.api_version.clone()),
            kind: Some(owner.kind.clone()),
            name: Some(owner.name.clone()),
            namespace: Some(ns.to_owned()),
            uid: Some(owner.uid.clone()),
            ..ObjectReference::default()
        });
    }
    let name = pod.metadata.name.as_ref().filter(|n| !n.is_empty())?;
    Some(ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Pod".to_owned()),
        name: Some(name.clone()),
        namespace: Some(ns.to_owned()),
        ..ObjectReference::default()
    })
}
