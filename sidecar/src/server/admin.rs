//! The admin port (loopback by default): `/healthz`, `/readyz`, `/metrics`, `/config`.
//!
//! `/config` shows the effective routes as loaded (API keys are never part of them: routes
//! only name the env var, file or Secret holding a key), the config hash, and the last
//! reload error, so "why is my change not live?" has an answer.

use std::{convert::Infallible, future::Future, sync::Arc, sync::atomic::Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use tokio::net::TcpListener;

use crate::{app::App, config::series};

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

/// Which endpoints a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// Everything, `/config` included: the loopback admin port.
    Full,
    /// Only `/healthz`, `/readyz` and `/metrics`: the port kubelet probes and Prometheus
    /// reach on the pod IP. `/config` stays on loopback.
    ProbesAndMetrics,
}

fn route(app: &App, req: &Request<Incoming>, exposure: Exposure) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    let path = req.uri().path();
    if exposure == Exposure::ProbesAndMetrics
        && !matches!(path, "/healthz" | "/readyz" | "/metrics")
    {
        return reply(StatusCode::NOT_FOUND, "text/plain", "not found\n");
    }
    match path {
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            if app.draining.load(Ordering::Relaxed) {
                reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "draining\n")
            } else if app.table.load().routes.is_empty() {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "no routes loaded\n",
                )
            } else {
                reply(StatusCode::OK, "text/plain", "ready\n")
            }
        }
        "/metrics" => {
            series::sample(&app.metrics, &app.table.load());
            reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                app.metrics.render(),
            )
        }
        "/config" => {
            let table = app.table.load();
            let status = app.config_status();
            let body = serde_json::json!({
                "file": status.file,
                "configHash": status.hash,
                "loadedAt": status.loaded_at,
                "lastError": status.last_error,
                "routes": table.source,
            });
            reply(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec_pretty(&body).unwrap_or_default(),
            )
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// Serves the admin endpoints until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    exposure: Exposure,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let app = app.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let response = route(&app, &req, exposure);
                        async move { Ok::<_, Infallible>(response) }
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            () = &mut shutdown => return,
        }
    }
}
