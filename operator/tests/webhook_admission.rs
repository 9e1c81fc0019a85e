//! The admission webhook over real HTTPS: a server on 127.0.0.1:0 with a certificate from
//! `certs::generate`, a fake `InjectionContext` and a recording `EventSink`; AdmissionReview
//! JSON as the API server sends it, through a hyper client trusting only the test CA.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::{Event, EventType};
use serde_json::{Value, json};
use tailwarden_operator::certs::{self, Bundle, CertStore};
use tailwarden_operator::inject::{InjectConfig, RouteInfo};
use tailwarden_operator::webhook::{EventSink, InjectionContext, Webhook};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

struct FakeCluster {
    namespaces: BTreeMap<String, BTreeMap<String, String>>,
    routes: BTreeMap<String, Vec<RouteInfo>>,
    ready: AtomicBool,
}

impl InjectionContext for FakeCluster {
    fn namespace_labels(&self, ns: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces.get(ns).cloned()
    }
    fn routes(&self, ns: &str) -> Vec<RouteInfo> {
        self.routes.get(ns).cloned().unwrap_or_default()
    }
    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

#[derive(Default)]
struct RecordedEvents(Mutex<Vec<(EventType, String, String, ObjectReference)>>);

impl EventSink for RecordedEvents {
    fn publish(&self, event: Event, regarding: ObjectReference) {
        self.0.lock().unwrap().push((
            event.type_,
            event.reason,
            event.note.unwrap_or_default(),
            regarding,
        ));
    }
}

struct Harness {
    addr: SocketAddr,
    bundle: Bundle,
    certs: Arc<CertStore>,
    cluster: Arc<FakeCluster>,
    events: Arc<RecordedEvents>,
    registry: prometheus::Registry,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

fn test_bundle(ca: &str) -> Bundle {
    certs::generate(
        ca,
        &["localhost".to_owned()],
        &[IpAddr::V4(Ipv4Addr::LOCALHOST)],
    )
    .unwrap()
}

async fn start() -> Harness {
    let bundle = test_bundle("webhook-test-ca");
    let certs = Arc::new(CertStore::new());
    certs.load_pem(&bundle.cert_pem, &bundle.key_pem).unwrap();
    let cluster = Arc::new(FakeCluster {
        namespaces: BTreeMap::from([
            ("shop".to_owned(), BTreeMap::new()),
            (
                "enabled".to_owned(),
                BTreeMap::from([("tailwarden.io/inject".to_owned(), "enabled".to_owned())]),
            ),
        ]),
        routes: BTreeMap::from([(
            "shop".to_owned(),
            vec![RouteInfo::new(
                "chat",
                vec![("openai".to_owned(), "apiKey".to_owned())],
            )],
        )]),
        ready: AtomicBool::new(true),
    });
    let events = Arc::new(RecordedEvents::default());
    let registry = prometheus::Registry::new();
    let webhook = Webhook::new(
        cluster.clone(),
        InjectConfig::new("ghcr.io/tailwarden/sidecar:test"),
        &registry,
    )
    .unwrap()
    .with_events(events.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn({
        let certs = certs.clone();
        async move {
            Arc::new(webhook)
                .serve(listener, certs, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        }
    });
    Harness {
        addr,
        bundle,
        certs,
        cluster,
        events,
        registry,
        stop: Some(stop),
        server,
    }
}

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// A client trusting only `ca_pem`, over HTTP/2 or HTTP/1.1 as ALPN decides.
fn client(ca_pem: &str, http2: bool) -> HttpsClient {
    let mut roots = rustls::RootCertStore::empty();
    for der in rustls::pki_types::pem::PemObject::pem_slice_iter(ca_pem.as_bytes()) {
        let der: rustls::pki_types::CertificateDer<'static> = der.unwrap();
        roots.add(der).unwrap();
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1();
    let connector = if http2 {
        builder.enable_http2().build()
    } else {
        builder.build()
    };
    Client::builder(TokioExecutor::new()).build(connector)
}

impl Harness {
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<(StatusCode, Bytes), hyper_util::client::legacy::Error> {
        self.send_with(&client(&self.bundle.ca_pem, true), method, path, body)
            .await
    }

    async fn send_with(
        &self,
        client: &HttpsClient,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<(StatusCode, Bytes), hyper_util::client::legacy::Error> {
        let req = Request::builder()
            .method(method)
            .uri(format!("https://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(body.into()))
            .unwrap();
        let response = client.request(req).await?;
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Ok((status, body))
    }

    async fn admit(&self, review: &Value) -> Value {
        let (status, body) = self
            .send(
                Method::POST,
                "/mutate-pods?timeout=10s",
                serde_json::to_vec(review).unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }

    fn counter(&self, result: &str, reason: &str) -> u64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == "tailwarden_injections_total")
            .flat_map(|f| f.get_metric())
            .find(|m| {
                let labels: BTreeMap<&str, &str> = m
                    .get_label()
                    .iter()
                    .map(|l| (l.name(), l.value()))
                    .collect();
                labels.get("result") == Some(&result) && labels.get("reason") == Some(&reason)
            })
            .map_or(0, |m| m.get_counter().get_value() as u64)
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(15), self.server)
            .await
            .unwrap()
            .unwrap();
    }
}

/// An AdmissionReview v1 for a Pod CREATE, shaped like the API server's (the object has
/// no name when the pod comes from `generateName`; the namespace is on the request).
fn review(uid: &str, ns: &str, pod: Value, dry_run: bool) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": { "group": "", "version": "v1", "kind": "Pod" },
            "resource": { "group": "", "version": "v1", "resource": "pods" },
            "requestKind": { "group": "", "version": "v1", "kind": "Pod" },
            "requestResource": { "group": "", "version": "v1", "resource": "pods" },
            "name": "",
            "namespace": ns,
            "operation": "CREATE",
            "userInfo": { "username": "system:serviceaccount:kube-system:replicaset-controller", "groups": ["system:serviceaccounts"] },
            "object": pod,
            "oldObject": null,
            "dryRun": dry_run,
            "options": { "kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1" },
        },
    })
}

fn deployment_pod(routes: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "web-5c7f8d9b4-",
            "namespace": "shop",
            "labels": { "app": "web", "pod-template-hash": "5c7f8d9b4" },
            "annotations": { "tailwarden.io/routes": routes },
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5c7f8d9b4",
                "uid": "6f1c8a3e-2b1d-4c5e-9f0a-1b2c3d4e5f60", "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "containers": [{
                "name": "web", "image": "web:1", "imagePullPolicy": "IfNotPresent",
                "resources": {}, "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "volumeMounts": [{ "name": "kube-api-access-x", "readOnly": true, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount" }],
            }],
            "volumes": [{ "name": "kube-api-access-x", "projected": { "sources": [{ "serviceAccountToken": { "path": "token" } }] } }],
            "restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "serviceAccountName": "default",
            "securityContext": {}, "schedulerName": "default-scheduler", "enableServiceLinks": true,
        },
        "status": {},
    })
}

#[tokio::test]
async fn injects_over_https_with_a_base64_json_patch_that_applies() {
    let h = start().await;
    let pod = deployment_pod("chat");
    let answer = h.admit(&review("uid-1", "shop", pod.clone(), false)).await;
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    let response = &answer["response"];
    assert_eq!(response["uid"], "uid-1");
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    // The patch is a base64 string (Go's []byte), holding an RFC 6902 patch.
    assert!(response["patch"].is_string(), "{response}");
    let bytes: ByteString = serde_json::from_value(response["patch"].clone()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes.0).unwrap();
    let mut doc = pod;
    json_patch::patch(&mut doc, &patch).unwrap();
    let patched: Pod = serde_json::from_value(doc).unwrap();
    let spec = patched.spec.unwrap();
    let sidecar = &spec.init_containers.unwrap()[0];
    assert_eq!(sidecar.name, "tailwarden-sidecar");
    assert_eq!(
        sidecar.image.as_deref(),
        Some("ghcr.io/tailwarden/sidecar:test")
    );
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    let env = spec.containers[0].env.as_ref().unwrap();
    assert_eq!(env[0].name, "OPENAI_BASE_URL");
    // The SDKs refuse to start without a key; the sidecar supplies the real one.
    assert_eq!(env[1].name, "OPENAI_API_KEY");
    assert_eq!(
        env[1].value.as_deref(),
        Some("tailwarden-injected-placeholder")
    );
    let volumes: Vec<String> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(
        volumes,
        ["kube-api-access-x", "tailwarden-config", "tailwarden-keys"]
    );
    let meta = patched.metadata;
    assert_eq!(meta.generate_name.as_deref(), Some("web-5c7f8d9b4-"));
    assert_eq!(
        meta.annotations.unwrap()["tailwarden.io/injected-routes"],
        "chat"
    );
    assert_eq!(meta.labels.unwrap()["tailwarden.io/injected"], "true");

    assert_eq!(h.counter("injected", "Injected"), 1);
    assert!(
        h.events.0.lock().unwrap().is_empty(),
        "no Event for an injection"
    );
    h.stop().await;
}

#[tokio::test]
async fn namespace_opt_in_over_http1() {
    let h = start().await;
    // Namespace `enabled` has no routes: a skip with a reason, an Event and a warning.
    let mut pod = deployment_pod("");
    pod["metadata"]["annotations"] = json!({});
    let http1 = client(&h.bundle.ca_pem, false);
    let body = serde_json::to_vec(&review("uid-2", "enabled", pod, false)).unwrap();
    let (status, body) = h
        .send_with(&http1, Method::POST, "/mutate-pods", body)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    assert_eq!(h.counter("skipped", "NoRoutes"), 1);
    let events = h.events.0.lock().unwrap().clone();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, EventType::Warning);
    assert_eq!(events[0].1, "NoRoutes");
    h.stop().await;
}

#[tokio::test]
async fn skips_have_a_reason_an_event_on_the_owner_and_a_metric() {
    let h = start().await;
    let answer = h
        .admit(&review(
            "uid-3",
            "shop",
            deployment_pod("chat, ghost"),
            false,
        ))
        .await;
    let response = &answer["response"];
    assert_eq!(response["uid"], "uid-3");
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());
    let warning = response["warnings"][0].as_str().unwrap();
    assert!(warning.contains("ghost"), "{warning}");
    assert_eq!(h.counter("skipped", "UnknownRoute"), 1);
    {
        let events = h.events.0.lock().unwrap();
        assert_eq!(events.len(), 1);
        let (kind, reason, note, regarding) = &events[0];
        assert_eq!(*kind, EventType::Warning);
        assert_eq!(reason, "UnknownRoute");
        assert!(
            note.contains("web-5c7f8d9b4-*") && note.contains("ghost"),
            "{note}"
        );
        assert_eq!(regarding.kind.as_deref(), Some("ReplicaSet"));
        assert_eq!(regarding.name.as_deref(), Some("web-5c7f8d9b4"));
        assert_eq!(regarding.namespace.as_deref(), Some("shop"));
        assert_eq!(
            regarding.uid.as_deref(),
            Some("6f1c8a3e-2b1d-4c5e-9f0a-1b2c3d4e5f60")
        );
    }

    // A dry run: same answer, no Event (sideEffects: NoneOnDryRun).
    let answer = h
        .admit(&review("uid-4", "shop", deployment_pod("ghost"), true))
        .await;
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(h.counter("skipped", "UnknownRoute"), 2);
    assert_eq!(h.events.0.lock().unwrap().len(), 1);

    // Not opted in: counted, but no Event and no warning.
    let mut plain = deployment_pod("");
    plain["metadata"]["annotations"] = json!({});
    let answer = h.admit(&review("uid-5", "shop", plain, false)).await;
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("warnings").is_none());
    assert_eq!(h.counter("skipped", "NotOptedIn"), 1);
    assert_eq!(h.events.0.lock().unwrap().len(), 1);

    // Already injected (a reinvocation): a Normal Event, no patch.
    let first = h
        .admit(&review("uid-6", "shop", deployment_pod("chat"), false))
        .await;
    let bytes: ByteString = serde_json::from_value(first["response"]["patch"].clone()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes.0).unwrap();
    let mut injected = deployment_pod("chat");
    json_patch::patch(&mut injected, &patch).unwrap();
    let again = h.admit(&review("uid-7", "shop", injected, false)).await;
    assert!(again["response"].get("patch").is_none());
    assert_eq!(h.counter("skipped", "AlreadyInjected"), 1);
    assert_eq!(h.events.0.lock().unwrap()[1].0, EventType::Normal);
    h.stop().await;
}

#[tokio::test]
async fn bad_requests_never_deny_and_never_crash() {
    let h = start().await;
    // Not JSON at all: 400 (the API server counts a failed call; failurePolicy Ignore admits).
    let (status, _) = h
        .send(Method::POST, "/mutate-pods", "{not json")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // JSON but no request: 400.
    let (status, _) = h
        .send(
            Method::POST,
            "/mutate-pods",
            r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
        )
        .await
        .unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // A request with a uid but a broken body: allowed, uid echoed.
    let broken = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": { "uid": "uid-b", "operation": 42 },
    });
    let answer = h.admit(&broken).await;
    assert_eq!(answer["response"]["uid"], "uid-b");
    assert_eq!(answer["response"]["allowed"], true);
    // A Pod that is not a Pod (containers is a string): allowed unchanged.
    let mut pod = deployment_pod("chat");
    pod["spec"]["containers"] = json!("oops");
    let answer = h.admit(&review("uid-c", "shop", pod, false)).await;
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    // A pod without a spec would make a patch that cannot apply: allowed unchanged.
    let mut pod = deployment_pod("chat");
    pod.as_object_mut().unwrap().remove("spec");
    let answer = h.admit(&review("uid-d", "shop", pod, false)).await;
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    assert_eq!(h.counter("error", "PatchInvalid"), 1);
    // Not a Pod CREATE: allowed.
    let mut update = review("uid-e", "shop", deployment_pod("chat"), false);
    update["request"]["operation"] = json!("UPDATE");
    let answer = h.admit(&update).await;
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    // Over the body limit: 413.
    let (status, _) = h
        .send(
            Method::POST,
            "/mutate-pods",
            vec![b' '; 4 * 1024 * 1024 + 1],
        )
        .await
        .unwrap();
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(h.counter("error", "BodyTooLarge"), 1);
    assert!(h.counter("error", "InvalidReview") >= 3);
    assert_eq!(h.counter("error", "InvalidPod"), 1);
    assert_eq!(h.counter("error", "UnsupportedRequest"), 1);
    // Other paths and methods.
    let (status, _) = h.send(Method::GET, "/nope", "").await.unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = h.send(Method::GET, "/mutate-pods", "").await.unwrap();
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    // Still serving after all that.
    let (status, body) = h.send(Method::GET, "/healthz", "").await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok\n"[..]));
    h.stop().await;
}

#[tokio::test]
async fn caches_not_ready_allow_unchanged_and_fail_readiness() {
    let h = start().await;
    let (status, _) = h.send(Method::GET, "/readyz", "").await.unwrap();
    assert_eq!(status, StatusCode::OK);
    h.cluster.ready.store(false, Ordering::SeqCst);
    let (status, _) = h.send(Method::GET, "/readyz", "").await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let answer = h
        .admit(&review("uid-n", "shop", deployment_pod("ghost"), false))
        .await;
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    assert_eq!(h.counter("error", "NotReady"), 1);
    assert!(
        h.events.0.lock().unwrap().is_empty(),
        "no Event from missing data"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let h = start().await;
    let old_ca = client(&h.bundle.ca_pem, true);
    h.send_with(&old_ca, Method::GET, "/healthz", "")
        .await
        .unwrap();

    let renewed = test_bundle("renewed-ca");
    h.certs
        .load_pem(&renewed.cert_pem, &renewed.key_pem)
        .unwrap();
    // New connections get the new certificate: a client trusting only the new CA gets in,
    // a fresh client trusting only the old one does not.
    let (status, _) = h
        .send_with(&client(&renewed.ca_pem, true), Method::GET, "/healthz", "")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(
        h.send_with(&client(&h.bundle.ca_pem, true), Method::GET, "/healthz", "")
            .await
            .is_err()
    );
    h.stop().await;
}
