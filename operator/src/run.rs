//! `tailwarden-operator run`: wires the controller (on the leader only), the admission
//! webhook (on every replica), webhook certificates, leader election and the metrics and
//! health endpoints.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, ResourceExt,
    runtime::{
        WatchStreamExt,
        events::Reporter,
        reflector::{self, Store},
        watcher,
    },
};
use prometheus::{Encoder, Registry, TextEncoder};
use tailwarden_crds::InferenceRoute;
use tokio::sync::watch;

use crate::{
    certs::{self, CertStore},
    controller,
    inject::{InjectConfig, RouteInfo},
    leader::LeaderElector,
    webhook::{InjectionContext, RecorderSink, Webhook},
};

/// Settings of `run`, from the command line (and so from the chart).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The operator's own namespace (its Lease and webhook Secret live there).
    pub namespace: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// Namespaces whose routes are reconciled; empty: all.
    pub watch_namespaces: Vec<String>,
    pub webhook_listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub webhook_config_name: String,
    pub webhook_service: String,
    /// Extra IP SANs for the serving certificate (local tests reach the webhook by IP).
    pub webhook_ip_sans: Vec<IpAddr>,
    pub tls_secret: String,
    /// `self`: the operator makes and renews its CA and certificate and patches the
    /// caBundle. `external`: cert-manager (or someone) fills the Secret and the caBundle.
    pub cert_mode: CertMode,
    pub leader_elect: bool,
    pub inject: InjectConfig,
    /// Namespaces where the operator may read Secrets to check `ResolvedRefs`; nowhere by
    /// default (see `controller::SecretAccess`).
    pub secret_access: controller::SecretAccess,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertMode {
    SelfSigned,
    External,
}

/// Errors that stop the operator.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("kubernetes client: {0}")]
    Kube(#[from] kube::Error),
    #[error("certificates: {0}")]
    Certs(#[from] certs::CertError),
    #[error("webhook: {0}")]
    Webhook(#[from] crate::webhook::WebhookError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("lost leadership; exiting so a fresh process campaigns again")]
    LostLeadership,
}

/// The webhook's view of the cluster: reflector stores of Namespaces and InferenceRoutes,
/// kept on every replica (leader or not) so admission never waits on the API.
struct ClusterContext {
    namespaces: Store<Namespace>,
    routes: Store<InferenceRoute>,
    /// Set once both stores hold a full initial list.
    synced: Arc<std::sync::atomic::AtomicBool>,
}

impl InjectionContext for ClusterContext {
    fn namespace_labels(&self, ns: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces
            .get(&reflector::ObjectRef::new(ns))
            .map(|n| n.labels().clone())
    }

    fn routes(&self, ns: &str) -> Vec<RouteInfo> {
        self.routes
            .state()
            .iter()
            .filter(|r| r.namespace().as_deref() == Some(ns))
            .map(|r| RouteInfo::from_route(r))
            .collect()
    }

    fn is_ready(&self) -> bool {
        self.synced.load(std::sync::atomic::Ordering::Acquire)
    }
}

fn dns_names(service: &str, ns: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{ns}"),
        format!("{service}.{ns}.svc"),
        format!("{service}.{ns}.svc.cluster.local"),
    ]
}

async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: Arc<dyn Fn() -> bool + Send + Sync>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (registry, ready) = (registry.clone(), ready.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let (registry, ready) = (registry.clone(), ready.clone());
                async move {
                    let (status, body) = match req.uri().path() {
                        "/metrics" => {
                            let mut out = Vec::new();
                            let _ = TextEncoder::new().encode(&registry.gather(), &mut out);
                            (StatusCode::OK, Bytes::from(out))
                        }
                        "/healthz" => (StatusCode::OK, Bytes::from_static(b"ok\n")),
                        "/readyz" if ready() => (StatusCode::OK, Bytes::from_static(b"ready\n")),
                        "/readyz" => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            Bytes::from_static(b"caches not synced\n"),
                        ),
                        _ => (StatusCode::NOT_FOUND, Bytes::from_static(b"not found\n")),
                    };
                    let mut r = Response::new(Full::new(body));
                    *r.status_mut() = status;
                    Ok::<_, Infallible>(r)
                }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, RunError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Bind { addr, source })
}

/// Runs until SIGTERM/SIGINT (or lost leadership, which is an error: the process restarts).
pub async fn run(
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let client = Client::try_default().await?;
    let registry = Registry::new();
    let reporter = Reporter {
        controller: "tailwarden-operator".into(),
        instance: Some(settings.identity.clone()),
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_flag = stop_rx.clone();
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    // Caches for the webhook, on every replica.
    let (namespaces, ns_writer) = reflector::store();
    let ns_api: Api<Namespace> = Api::all(client.clone());
    tokio::spawn(
        watcher(ns_api, watcher::Config::default())
            .backoff(controller::WatchBackoff::default())
            .reflect(ns_writer)
            .for_each(|_| std::future::ready(())),
    );
    let (routes, routes_writer) = reflector::store();
    let routes_api: Api<InferenceRoute> = Api::all(client.clone());
    tokio::spawn(
        watcher(routes_api, watcher::Config::default())
            .backoff(controller::WatchBackoff::default())
            .reflect(routes_writer)
            .for_each(|_| std::future::ready(())),
    );
    let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let (namespaces, routes, synced) = (namespaces.clone(), routes.clone(), synced.clone());
        tokio::spawn(async move {
            if namespaces.wait_until_ready().await.is_ok()
                && routes.wait_until_ready().await.is_ok()
            {
                synced.store(true, std::sync::atomic::Ordering::Release);
                tracing::info!("webhook caches synced");
            }
        });
    }
    let context = Arc::new(ClusterContext {
        namespaces,
        routes,
        synced,
    });

    // Certificates: a store the TLS server reads on every handshake.
    let cert_store = Arc::new(CertStore::new());
    if settings.cert_mode == CertMode::SelfSigned {
        let mut names = dns_names(&settings.webhook_service, &settings.namespace);
        names.extend(settings.webhook_ip_sans.iter().map(|ip| ip.to_string()));
        let bundle = certs::ensure_secret(
            client.clone(),
            &settings.namespace,
            &settings.tls_secret,
            &names,
        )
        .await?;
        if let Err(e) = certs::patch_ca_bundle(
            client.clone(),
            &settings.webhook_config_name,
            &bundle.ca_pem,
        )
        .await
        {
            tracing::warn!(error = %e, config = %settings.webhook_config_name, "cannot patch the webhook caBundle yet; will keep trying");
        }
        cert_store.load_pem(&bundle.cert_pem, &bundle.key_pem)?;
        // Keep the certificate renewed and the caBundle current (the configuration may be
        // created after us, re-created by `helm upgrade` or edited by hand). Until the
        // caBundle is right the API server cannot call us, which fails open: pods are
        // admitted un-injected.
        tokio::spawn(certs::maintain(
            client.clone(),
            settings.namespace.clone(),
            settings.tls_secret.clone(),
            names,
            settings.webhook_config_name.clone(),
            certs::RENEW_CHECK_INTERVAL,
        ));
    }
    {
        let (client, ns, name, store) = (
            client.clone(),
            settings.namespace.clone(),
            settings.tls_secret.clone(),
            cert_store.clone(),
        );
        tokio::spawn(async move { certs::watch_secret(client, &ns, &name, store).await });
    }

    let webhook = Arc::new(
        Webhook::new(context.clone(), settings.inject.clone(), &registry)?.with_events(Arc::new(
            RecorderSink::new(client.clone(), reporter.clone()),
        )),
    );
    let webhook_listener = bind(settings.webhook_listen).await?;
    let webhook_task = tokio::spawn(webhook.serve(webhook_listener, cert_store, stopped()));

    let metrics_listener = bind(settings.metrics_listen).await?;
    let ready_ctx = context.clone();
    tokio::spawn(serve_metrics(
        metrics_listener,
        registry.clone(),
        Arc::new(move || ready_ctx.is_ready()),
    ));
    tracing::info!(webhook = %settings.webhook_listen, metrics = %settings.metrics_listen, "tailwarden-operator started");

    let metrics = controller::Metrics::register(&registry)?;
    let namespaces: Vec<Option<String>> = if settings.watch_namespaces.is_empty() {
        vec![None]
    } else {
        settings
            .watch_namespaces
            .iter()
            .cloned()
            .map(Some)
            .collect()
    };

    let result = if settings.leader_elect {
        let (leader_tx, mut leader_rx) = watch::channel(false);
        let elector = LeaderElector::new(
            client.clone(),
            settings.namespace.clone(),
            "tailwarden-operator",
            settings.identity.clone(),
        );
        let election = tokio::spawn(elector.run(leader_tx, stopped()));
        let became_leader = tokio::select! {
            r = leader_rx.wait_for(|l| *l) => r.is_ok(),
            () = stopped() => false,
        };
        let mut outcome = Ok(());
        if became_leader {
            tracing::info!(identity = %settings.identity, "became leader; starting the controller");
            let mut lost_rx = leader_rx.clone();
            let stop = stopped();
            let lost_or_stop = async move {
                tokio::select! {
                    _ = lost_rx.wait_for(|l| !*l) => {}
                    () = stop => {}
                }
            };
            run_controllers(
                client.clone(),
                namespaces,
                settings.secret_access.clone(),
                metrics,
                reporter,
                lost_or_stop,
            )
            .await;
            if !*stop_flag.borrow() {
                outcome = Err(RunError::LostLeadership);
            }
        }
        // On shutdown the elector releases the Lease so a standby takes over at once.
        let _ = election.await;
        outcome
    } else {
        run_controllers(
            client.clone(),
            namespaces,
            settings.secret_access.clone(),
            metrics,
            reporter,
            stopped(),
        )
        .await;
        Ok(())
    };
    let _ = webhook_task.await;
    result
}

/// One controller per watched namespace (or one for all), until `until` completes.
async fn run_controllers(
    client: Client,
    namespaces: Vec<Option<String>>,
    secret_access: controller::SecretAccess,
    metrics: controller::Metrics,
    reporter: Reporter,
    until: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let tasks: Vec<_> = namespaces
        .into_iter()
        .map(|ns| {
            let mut rx = tx.subscribe();
            tokio::spawn(controller::run(
                client.clone(),
                ns,
                secret_access.clone(),
                metrics.clone(),
                reporter.clone(),
                async move {
                    let _ = rx.recv().await;
                },
            ))
        })
        .collect();
    until.await;
    let _ = tx.send(());
    for t in tasks {
        let _ = t.await;
    }
}
