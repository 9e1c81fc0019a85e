//! The rest of `/v1` (files, uploads, batches, audio, images, moderations, vector stores,
//! fine-tuning, `models/{id}`, the Responses objects' `GET`/`DELETE`/`cancel`/`input_items`,
//! and whatever OpenAI adds) passed through to a provider, so an injected app never meets a
//! 404 for an endpoint the sidecar has no policy for.
//!
//! Where each request goes is [`tailwarden_decide::passthrough::classify`]'s rule: an object
//! the sidecar saw created goes to its owner ([`crate::state::affinity`]) and, when the owner
//! cannot take it, the answer is a 503 naming the reason — never another provider; the
//! stateless families go by their JSON body's `model`; everything else goes to the *home
//! provider*: the first provider of the `*` route, else of the first route.
//!
//! The client chooses only the path below `/v1` (checked by
//! [`tailwarden_decide::passthrough::check_path`]), appended to the provider's configured
//! base URL. Its credentials are never forwarded; the provider's key is injected. Bodies
//! stream both ways: a request body the sidecar does not need to read (multipart uploads,
//! files) is sent on as it arrives, up to [`MAX_STREAMED_BYTES`], and a response body is
//! relayed chunk by chunk, ended by the route's idle timeout if it stalls. A request is sent
//! again only where that is safe: after a connection failure when its body is still in hand,
//! and after a reset or a 502/503/504 only for idempotent methods.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use tailwarden_decide::{
    encoding,
    error::ApiError,
    passthrough::{self, Kind},
};
use tokio::{
    sync::OwnedSemaphorePermit,
    time::{Instant, Sleep},
};

use super::decode;
use crate::{
    app::App,
    attempts::{
        provider_down,
        upstream::{copy_response_headers, error_chain, passable},
    },
    config::{Route, Upstream},
    record::access_log,
    relay::{BodyError, IntoResponse, ProxyBody},
    state::{affinity::Owner, pool::UpstreamBody},
};

/// Largest request body streamed through (OpenAI's limit for one uploaded file). Bodies the
/// sidecar reads (JSON with a `model`) keep the route's `limits.maxBodyBytes`.
pub const MAX_STREAMED_BYTES: u64 = 512 << 20;
/// A created conversation's JSON is read (to remember its owner) up to this size.
const CREATED_BODY_LIMIT: usize = 1 << 20;

/// Where a request goes.
enum Target {
    /// This provider only: an object's owner, or the home provider.
    Fixed(Arc<Route>, usize),
    /// Any available provider of the route, in order (stateless families).
    Any(Arc<Route>),
}

/// The request's body: read (and so resendable) or still arriving.
enum Outgoing {
    Held(Bytes),
    Streaming(Option<Incoming>),
}

/// What was passed through, for the metrics and the access log.
struct Passed {
    response: Response<ProxyBody>,
    route: Arc<str>,
    provider: Arc<str>,
    attempts: u32,
}

/// Entry point for `/v1/…` paths the sidecar has no endpoint of its own for.
pub async fn handle(
    app: Arc<App>,
    req: Request<Incoming>,
    arrived: Instant,
) -> Response<ProxyBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let rest = path.strip_prefix("/v1").unwrap_or(&path).to_owned();
    let family = passthrough::family(&rest);
    let request_id = app.request_id(req.headers());
    let (response, route, provider, attempts) =
        match forward(&app, req, &method, &rest, arrived, &request_id).await {
            Ok(p) => (p.response, p.route, p.provider, p.attempts),
            Err(e) => (e.into_response(), Arc::from(""), Arc::from(""), 0),
        };
    let status = response.status().as_u16();
    let class = match status {
        200..=299 => "2xx",
        400..=499 => "4xx",
        _ => "5xx",
    };
    let elapsed = arrived.elapsed();
    let m = &app.metrics;
    m.passthrough_requests
        .with_label_values(&[&*route, &*provider, family, class])
        .inc();
    m.passthrough_duration
        .with_label_values(&[&*route, family])
        .observe(elapsed.as_secs_f64());
    let logged = access_log::emit("passthrough", |l| {
        l.str("request_id", &request_id);
        l.str("route", &route);
        l.str("provider", &provider);
        l.str("method", method.as_str());
        l.str("endpoint", family);
        l.str("path", &path);
        l.u64("status", u64::from(status));
        l.u64("attempts", u64::from(attempts));
        l.f64("headers_ms", elapsed.as_secs_f64() * 1000.0);
        l.opt_str("namespace", app.identity.namespace.as_deref());
        l.opt_str("workload", app.identity.workload.as_deref());
    });
    if !logged {
        m.access_log_dropped.inc();
    }
    response
}

async fn forward(
    app: &Arc<App>,
    req: Request<Incoming>,
    method: &Method,
    rest: &str,
    arrived: Instant,
    request_id: &str,
) -> Result<Passed, ApiError> {
    passthrough::check_path(rest)
        .map_err(|e| ApiError::bad_request(format!("Invalid path /v1{rest}: {}.", e.0)))?;
    let table = app.table.load_full();
    let home = || -> Result<Target, ApiError> {
        table
            .home()
            .map(|r| Target::Fixed(r.clone(), 0))
            .ok_or_else(|| ApiError::upstream_unavailable("No route is configured."))
    };
    let mut owned = None;
    let mut body = None;
    let mut routed_model = None;
    let (parts, incoming) = req.into_parts();
    let mut incoming = Some(incoming);
    let target = match passthrough::classify(method, rest) {
        Kind::Model(id) => {
            let id = passthrough::percent_decode(id);
            if table.lists(&id) {
                return Ok(Passed {
                    response: model_object(&id),
                    route: Arc::from(""),
                    provider: Arc::from(""),
                    attempts: 0,
                });
            }
            // A `*` route serves any model: its provider knows whether this one exists.
            match table.route_for(&id) {
                Some(route) => Target::Fixed(route.clone(), 0),
                None => return Err(ApiError::model_not_found(&id)),
            }
        }
        Kind::Owned { id, deletes } => {
            let id = passthrough::percent_decode(id);
            match app.registries.affinity.owner(&id) {
                Some(owner) => {
                    let target = owner_target(&table.routes, &owner, &id)?;
                    owned = Some((id, deletes));
                    target
                }
                None => home()?,
            }
        }
        Kind::ByModel if is_json(&parts.headers) => {
            let Some(json) = incoming.take() else {
                return Err(ApiError::bad_request("The request body could not be read."));
            };
            let bytes = read_json(app, &parts.headers, json, table.max_body_bytes).await?;
            // A compressed body is decoded only to read its `model` (the decoded size bounded
            // like the request path's); it is forwarded as the client sent it, header and
            // all. One the sidecar cannot decode has no model it can see: the home provider.
            let decoded = match encoding::request_coding(&parts.headers) {
                Ok(None) => Some(bytes.clone()),
                Ok(Some(coding)) => {
                    match decode::decode(coding, bytes.clone(), table.max_body_bytes).await {
                        Ok(decoded) => Some(decoded),
                        Err(e) if e.status == StatusCode::PAYLOAD_TOO_LARGE => return Err(e),
                        Err(_) => None,
                    }
                }
                Err(_) => None,
            };
            let model = decoded
                .as_deref()
                .and_then(|d| serde_json::from_slice::<ModelOnly>(d).ok())
                .and_then(|m| m.model)
                .filter(|m| !m.is_empty());
            let decoded_len = decoded.as_ref().map_or(bytes.len(), Bytes::len);
            let target = match model {
                Some(model) => {
                    let route = table
                        .route_for(&model)
                        .ok_or_else(|| ApiError::model_not_found(&model))?
                        .clone();
                    if decoded_len as u64 > route.settings.max_body_bytes {
                        return Err(ApiError::too_large(route.settings.max_body_bytes));
                    }
                    routed_model = Some(model);
                    Target::Any(route)
                }
                None => home()?,
            };
            body = Some(Outgoing::Held(bytes));
            target
        }
        Kind::ByModel | Kind::Home => home()?,
    };
    let body = match body {
        Some(b) => b,
        None => {
            let declared = parts
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > MAX_STREAMED_BYTES) {
                return Err(upload_too_large());
            }
            match incoming.take() {
                Some(incoming) if !incoming.is_end_stream() => Outgoing::Streaming(Some(incoming)),
                _ => Outgoing::Held(Bytes::new()),
            }
        }
    };
    let (route, candidates) = match target {
        Target::Fixed(route, i) => {
            if owned.is_none()
                && let Some(why) = provider_down(&route, i, Instant::now().into_std())
            {
                return Err(ApiError::upstream_unavailable(format!(
                    "Provider {} of route {} cannot take the request ({why}); requests to /v1{rest} go only to it (the route's home provider).",
                    route.upstreams[i].name, route.name
                )));
            }
            (route, vec![i])
        }
        Target::Any(route) => {
            let now = Instant::now().into_std();
            let up: Vec<usize> = (0..route.upstreams.len())
                .filter(|&i| provider_down(&route, i, now).is_none())
                .collect();
            if up.is_empty() {
                let reasons: Vec<String> = (0..route.upstreams.len())
                    .map(|i| {
                        format!(
                            "{} ({})",
                            route.upstreams[i].name,
                            provider_down(&route, i, now).unwrap_or_default()
                        )
                    })
                    .collect();
                return Err(ApiError::upstream_unavailable(format!(
                    "No provider of route {} is available: {}.",
                    route.name,
                    reasons.join(", ")
                )));
            }
            (route, up)
        }
    };
    let query = parts.uri.query().map(str::to_owned);
    let send = Forward {
        method,
        rest,
        query: query.as_deref(),
        headers: &parts.headers,
        request_id,
        model: routed_model.as_deref(),
    };
    let mut passed = send_all(&route, &candidates, &send, body, arrived).await?;
    if let Some((id, deletes)) = owned
        && deletes
        && passed.response.status().is_success()
    {
        app.registries.affinity.forget(&id);
    }
    if *method == Method::POST && rest == "/conversations" && passed.response.status().is_success()
    {
        passed.response = remember_created(app, &route, &passed.provider, passed.response).await;
    }
    Ok(passed)
}

/// The owner's route and provider, or the 503 saying why the request cannot go there.
fn owner_target(routes: &[Arc<Route>], owner: &Owner, id: &str) -> Result<Target, ApiError> {
    let found = routes.iter().find(|r| r.name == owner.route).and_then(|r| {
        r.upstreams
            .iter()
            .position(|u| u.name == owner.provider)
            .map(|i| (r.clone(), i))
    });
    let Some((route, i)) = found else {
        return Err(ApiError::owner_unavailable(
            id,
            &owner.provider,
            &format!("it is no longer a provider of route {}", owner.route),
        ));
    };
    if let Some(why) = provider_down(&route, i, Instant::now().into_std()) {
        return Err(ApiError::owner_unavailable(id, &owner.provider, &why));
    }
    Ok(Target::Fixed(route, i))
}

/// What every attempt sends.
struct Forward<'a> {
    method: &'a Method,
    rest: &'a str,
    query: Option<&'a str>,
    headers: &'a HeaderMap,
    request_id: &'a str,
    /// The client-facing model a JSON body was routed by: mapped per provider.
    model: Option<&'a str>,
}

/// Sends the request to the candidates in turn (resending only where it is safe) and
/// returns the first answer.
async fn send_all(
    route: &Arc<Route>,
    candidates: &[usize],
    send: &Forward<'_>,
    mut body: Outgoing,
    arrived: Instant,
) -> Result<Passed, ApiError> {
    let deadline = arrived + route.settings.total;
    let max_attempts = route.settings.policy.schedule.max_attempts.max(1);
    let idempotent = passthrough::idempotent(send.method);
    let mut attempt = 0u32;
    loop {
        let idx = candidates[attempt as usize % candidates.len()];
        attempt += 1;
        let upstream = &route.upstreams[idx];
        let resendable = matches!(body, Outgoing::Held(_));
        let last = attempt >= max_attempts || !resendable;
        let permit = tokio::time::timeout_at(deadline, upstream.pool.limit.clone().acquire_owned())
            .await
            .map_err(|_| {
                ApiError::gateway_timeout(format!(
                    "Provider {}: all maxConnections slots stayed busy.",
                    upstream.name
                ))
            })?
            .map_err(|_| ApiError::bad_gateway("The provider's connection pool is closed."))?;
        let request_body: UpstreamBody = match &mut body {
            Outgoing::Held(bytes) => Either::Left(Full::new(
                send.model
                    .and_then(|m| with_model(bytes, upstream.provider_model(m), m))
                    .unwrap_or_else(|| bytes.clone()),
            )),
            Outgoing::Streaming(incoming) => match incoming.take() {
                Some(incoming) => Either::Right(Limited::new(
                    incoming,
                    usize::try_from(MAX_STREAMED_BYTES).unwrap_or(usize::MAX),
                )),
                None => return Err(ApiError::bad_gateway("The request body was already sent.")),
            },
        };
        let req = outgoing(upstream, send, request_body).map_err(ApiError::bad_gateway)?;
        match tokio::time::timeout_at(deadline, upstream.pool.client.request(req)).await {
            Err(_) => {
                return Err(ApiError::gateway_timeout(format!(
                    "Provider {} sent no response headers within the route's total timeout.",
                    upstream.name
                )));
            }
            Ok(Err(e)) => {
                let chain = error_chain(&e);
                if chain.contains("length limit exceeded") {
                    return Err(upload_too_large());
                }
                if !last && (e.is_connect() || idempotent) {
                    continue;
                }
                return Err(ApiError::bad_gateway(format!(
                    "Provider {}: {chain}",
                    upstream.name
                )));
            }
            Ok(Ok(response)) => {
                let status = response.status();
                if !last && idempotent && matches!(status.as_u16(), 502..=504) {
                    continue;
                }
                return Ok(Passed {
                    response: relay(response, upstream, route, permit),
                    route: route.name.clone(),
                    provider: upstream.name.clone(),
                    attempts: attempt,
                });
            }
        }
    }
}

/// The request to the provider: its base URL and the client's path and query, the client's
/// headers except credentials and framing, the provider's own auth header.
fn outgoing(
    upstream: &Upstream,
    send: &Forward<'_>,
    body: UpstreamBody,
) -> Result<Request<UpstreamBody>, String> {
    let path = match send.query {
        Some(q) => format!("{}{}?{q}", upstream.base_path, send.rest),
        None => format!("{}{}", upstream.base_path, send.rest),
    };
    let uri = http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(path)
        .build()
        .map_err(|e| format!("bad upstream URL: {e}"))?;
    let mut req = Request::builder()
        .method(send.method.clone())
        .uri(uri)
        .body(body)
        .map_err(|e| format!("cannot build request: {e}"))?;
    let headers = req.headers_mut();
    for (name, value) in send.headers {
        if passable(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if !headers.contains_key(header::USER_AGENT) {
        headers.insert(
            header::USER_AGENT,
            HeaderValue::from_static(concat!("tailwarden/", env!("CARGO_PKG_VERSION"))),
        );
    }
    if let Ok(id) = HeaderValue::from_str(send.request_id) {
        headers.insert("x-request-id", id);
    }
    if let Some(value) = upstream.auth_value() {
        headers.insert(upstream.auth_header.clone(), (*value).clone());
    }
    Ok(req)
}

/// The provider's response, relayed as it arrives.
fn relay(
    response: Response<Incoming>,
    upstream: &Upstream,
    route: &Route,
    permit: OwnedSemaphorePermit,
) -> Response<ProxyBody> {
    let (parts, incoming) = response.into_parts();
    let body = Relayed {
        inner: incoming,
        _permit: permit,
        idle: route.settings.idle,
        timer: Box::pin(tokio::time::sleep(route.settings.idle)),
    };
    let mut out = Response::new(ProxyBody::Relay(Box::pin(body)));
    *out.status_mut() = parts.status;
    copy_response_headers(&parts.headers, out.headers_mut());
    if let Ok(v) = HeaderValue::from_str(&upstream.name) {
        out.headers_mut().insert("x-tailwarden-provider", v);
    }
    out
}

/// A provider's response body on its way to the client; holds the provider's connection
/// slot until it ends and fails it when no byte comes for the route's idle timeout.
struct Relayed {
    inner: Incoming,
    _permit: OwnedSemaphorePermit,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl Body for Relayed {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.as_mut().reset(Instant::now() + this.idle);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(BodyError::Upstream(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyError::Deadline(
                    "the provider's response body stalled (timeouts.idle)",
                )))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A conversation created through the sidecar belongs to the provider that made it: its id
/// (from the small JSON answer) is remembered, so `conversation` follow-ups go there.
async fn remember_created(
    app: &App,
    route: &Route,
    provider: &Arc<str>,
    response: Response<ProxyBody>,
) -> Response<ProxyBody> {
    #[derive(Deserialize)]
    struct Created {
        id: String,
    }
    let (parts, body) = response.into_parts();
    let limited = Limited::new(body, CREATED_BODY_LIMIT);
    let collected = tokio::time::timeout(route.settings.idle, limited.collect()).await;
    let bytes = match collected {
        Ok(Ok(c)) => c.to_bytes(),
        _ => {
            return ApiError::bad_gateway(
                "The provider's answer to a new conversation could not be read.",
            )
            .into_response();
        }
    };
    if let Ok(created) = serde_json::from_slice::<Created>(&bytes) {
        app.registries.affinity.remember(
            &created.id,
            Owner {
                route: route.name.clone(),
                provider: provider.clone(),
            },
        );
    }
    let mut out = Response::from_parts(parts, ProxyBody::full(bytes));
    out.headers_mut().remove(header::CONTENT_LENGTH);
    out
}

/// The JSON body with `model` replaced by the provider's name for it (`modelMap`), or `None`
/// when the name is the same.
fn with_model(body: &Bytes, provider_model: &str, model: &str) -> Option<Bytes> {
    if provider_model == model {
        return None;
    }
    let mut value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).ok()?;
    value.insert("model".into(), provider_model.into());
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

#[derive(Deserialize)]
struct ModelOnly {
    #[serde(default)]
    model: Option<String>,
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/json")
        })
}

/// A JSON body the sidecar must read to route it, bounded like the request path's bodies.
async fn read_json(
    app: &App,
    headers: &HeaderMap,
    incoming: Incoming,
    limit: u64,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    let limited = Limited::new(incoming, usize::try_from(limit).unwrap_or(usize::MAX));
    match tokio::time::timeout(app.body_timeout, limited.collect()).await {
        Err(_) => Err(ApiError::body_timeout()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::too_large(limit)),
        Ok(Err(_)) => Err(ApiError::bad_request("The request body could not be read.")),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

fn upload_too_large() -> ApiError {
    let mut e = ApiError::too_large(MAX_STREAMED_BYTES);
    e.message = format!(
        "The request body is larger than the pass-through limit of {MAX_STREAMED_BYTES} bytes."
    );
    e
}

fn model_object(id: &str) -> Response<ProxyBody> {
    let body =
        serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "tailwarden"});
    let mut response = Response::new(ProxyBody::full(body.to_string()));
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
