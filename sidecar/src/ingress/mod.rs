//! The first stage: read the request, parse its top level, pick the route and the tier,
//! and walk it through the rest of the path — [`crate::policy`] (caches, admission,
//! capabilities), [`crate::attempts`] (providers, retries, hedges) and [`respond`] (the
//! response: a cached answer, a rejection, or the winner relayed through [`crate::relay`]
//! and recorded by [`crate::record`]).
//!
//! A route with `streaming.heartbeatInterval` commits a streamed response when no attempt
//! answered within one interval and sends `: ping` comments while the attempts go on.

pub mod decode;
pub mod passthrough;
pub mod respond;

use std::sync::{Arc, atomic::Ordering};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tailwarden_decide::{
    encoding,
    error::ApiError,
    request::{Endpoint, RequestBody},
};
use tokio::time::Instant;
use tracing::Span;

use crate::{
    app::{App, Exchange, exchange::Pinned},
    config::Route,
    policy::{self, Verdict},
    record::telemetry,
    relay::{IntoResponse, ProxyBody, heartbeat_response},
};

/// Entry point for every client request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Response<ProxyBody> {
    let arrived = Instant::now();
    let path = req.uri().path().to_owned();
    let endpoint = match Endpoint::from_path(&path) {
        Some(endpoint) => endpoint,
        None if path == "/v1/models" => {
            return if req.method() == Method::GET {
                models(&app)
            } else {
                ApiError::method_not_allowed(req.method(), &path).into_response()
            };
        }
        None if path.starts_with("/v1/") => {
            if app.draining.load(Ordering::Relaxed) {
                return ApiError::shutting_down().into_response();
            }
            return passthrough::handle(app, req, arrived).await;
        }
        None => return ApiError::not_found(&path).into_response(),
    };
    if req.method() != Method::POST {
        return ApiError::method_not_allowed(req.method(), &path).into_response();
    }
    if app.draining.load(Ordering::Relaxed) {
        return ApiError::shutting_down().into_response();
    }
    let span = telemetry::server_span(endpoint.operation(), &path, req.headers());
    match proxy(app, req, endpoint, arrived, span.clone()).await {
        Ok(response) => response,
        Err(e) => {
            telemetry::refused(&span, e.status.as_u16(), e.code.unwrap_or(e.kind));
            e.into_response()
        }
    }
}

/// Read, parse, route, tier; then the policies, and the attempts unless a policy answered.
async fn proxy(
    app: Arc<App>,
    req: Request<Incoming>,
    endpoint: Endpoint,
    arrived: Instant,
    span: Span,
) -> Result<Response<ProxyBody>, ApiError> {
    let table = app.table.load_full();
    let limit = table.max_body_bytes.max(1);
    let (headers, raw_body) = read_body(&app, req, limit).await?;
    let body = RequestBody::parse(&raw_body)?;
    let route = table
        .route_for(&body.model)
        .ok_or_else(|| ApiError::model_not_found(&body.model))?
        .clone();
    telemetry::name_server_span(&span, endpoint.operation(), &body.model, &route.name);
    let pinned = pin(&app, endpoint, &body, &route)?;
    if raw_body.len() as u64 > route.settings.max_body_bytes {
        return Err(ApiError::too_large(route.settings.max_body_bytes));
    }
    let request_id = app.request_id(&headers);
    let tiers = route.tier_set.tiers();
    let tier = route
        .tier_set
        .choose_for(&body, &headers)
        .and_then(|chosen| tiers.iter().position(|t| std::ptr::eq(t, chosen)));
    let degrade = policy::degrade::choose(&app, &route, tier, &headers);
    let deadline = arrived + route.settings.total;
    let stream = endpoint.streams(&body);
    let mut ex = Exchange {
        app: app.clone(),
        endpoint,
        arrived,
        deadline,
        span,
        headers,
        raw_body: raw_body.clone(),
        route,
        request_id,
        tier,
        stream,
        decisions: Vec::new(),
        pinned,
        context: None,
        priority: None,
        degrade,
    };
    // The context budget first: every later stage sees the body as it will be sent.
    let raw_body = match policy::context::apply(&mut ex, &body) {
        Ok(None) => raw_body,
        Ok(Some(trimmed)) => {
            ex.raw_body = trimmed.clone();
            trimmed
        }
        Err(error) => {
            return Ok(respond::refused(
                &ex,
                &body,
                error,
                "context_budget_exceeded",
            ));
        }
    };
    let body = RequestBody::parse(&raw_body)?;
    // The queue priority before any policy: a bad priority header is the client's error,
    // whatever a cache holds.
    let route = ex.route.clone();
    if let Some(limiter) = &route.limiter {
        let tier = ex
            .tier
            .and_then(|i| route.tiers.get(i))
            .and_then(|t| t.priority);
        match limiter.priority_of(&ex.headers, tier) {
            Ok(priority) => ex.priority = priority,
            Err(invalid) => {
                let error = ApiError {
                    code: Some("invalid_priority"),
                    ..ApiError::bad_request(format!(
                        "{invalid} (spec.rateLimit.priority.header of route {})",
                        route.name
                    ))
                };
                return Ok(respond::refused(&ex, &body, error, "invalid_priority"));
            }
        }
    }

    let prepared = match policy::decide(&mut ex, &body).await {
        Verdict::Proceed(prepared) => prepared,
        Verdict::Hit {
            entry,
            answer,
            admission,
        } => return Ok(respond::cached(&ex, &body, &entry, answer, admission)),
        Verdict::Rejected(rejection) => return Ok(respond::rejected(&ex, &body, &rejection)),
        Verdict::Unsupported {
            error,
            cache,
            admission,
        } => return Ok(respond::unsupported(&ex, &body, error, &cache, admission)),
    };

    let Some(interval) = ex.route.settings.heartbeat.filter(|_| ex.stream) else {
        return Ok(respond::attempted(&ex, &body, prepared).await);
    };
    // Heartbeats: wait up to one interval for the response as usual; if it is not there yet,
    // commit a 200 event stream and send `: ping` comments while the attempts (retries and
    // fallback included) go on in the body. The owned future parses the body a second time:
    // the parsed view borrows the bytes, which the future must own.
    drop(body);
    let mut pending = Box::pin(async move {
        match RequestBody::parse(&raw_body) {
            Ok(body) => respond::attempted(&ex, &body, prepared).await,
            Err(e) => e.into_response(),
        }
    });
    tokio::select! {
        response = &mut pending => Ok(response),
        () = tokio::time::sleep(interval) => Ok(heartbeat_response(pending, interval, endpoint.dialect())),
    }
}

/// A Responses follow-up (`previous_response_id`, `conversation`) whose owner the sidecar
/// knows goes to that provider only; an owner outside the request's route is a 400. An
/// unknown id (created before a restart, or elsewhere) is routed as usual.
fn pin(
    app: &App,
    endpoint: Endpoint,
    body: &RequestBody<'_>,
    route: &Route,
) -> Result<Option<Pinned>, ApiError> {
    let ids = [endpoint.continues(body), endpoint.conversation(body)];
    for id in ids.into_iter().flatten() {
        let Some(owner) = app.registries.affinity.owner(&id) else {
            continue;
        };
        return match route
            .upstreams
            .iter()
            .position(|u| u.name == owner.provider)
        {
            Some(provider) if owner.route == route.name => Ok(Some(Pinned {
                provider,
                id: id.into_owned(),
            })),
            _ => Err(ApiError::owner_not_in_route(
                &id,
                &owner.provider,
                &route.name,
            )),
        };
    }
    Ok(None)
}

fn models(app: &App) -> Response<ProxyBody> {
    let table = app.table.load();
    let data: Vec<serde_json::Value> = table
        .models()
        .into_iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": "tailwarden"}))
        .collect();
    let body = serde_json::json!({"object": "list", "data": data});
    let mut response = Response::new(ProxyBody::full(body.to_string()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The body, bounded by `limits.maxBodyBytes` (the largest of all routes before the route
/// is known) and the body timeout; a compressed body is decoded, the limit applying to the
/// decoded bytes, and its `Content-Encoding` removed: what goes on is the decoded JSON.
async fn read_body(
    app: &App,
    req: Request<Incoming>,
    limit: u64,
) -> Result<(HeaderMap, Bytes), ApiError> {
    // An encoding the sidecar cannot decode is refused before the body is read.
    let coding = encoding::request_coding(req.headers())?;
    let (mut headers, body) = read_raw(app, req, limit).await?;
    let Some(coding) = coding else {
        return Ok((headers, body));
    };
    let decoded = decode::decode(coding, body, limit).await?;
    headers.remove(header::CONTENT_ENCODING);
    Ok((headers, decoded))
}

/// The body as the client sent it, bounded by `limit` and the body timeout.
async fn read_raw(
    app: &App,
    req: Request<Incoming>,
    limit: u64,
) -> Result<(HeaderMap, Bytes), ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    let (parts, body) = req.into_parts();
    let limited = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX));
    match tokio::time::timeout(app.body_timeout, limited.collect()).await {
        Err(_) => Err(ApiError::body_timeout()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::too_large(limit)),
        Ok(Err(_)) => Err(ApiError::bad_request("The request body could not be read.")),
        Ok(Ok(collected)) => Ok((parts.headers, collected.to_bytes())),
    }
}
