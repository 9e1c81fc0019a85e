//! The request path: read and check the body, pick the route and tier, answer from the
//! exact cache if it can, admit the request under the route's limits, then run attempts
//! (retries, hedges, fallback) until one produces its first byte, and relay it.
//!
//! Cache hits are answered before admission: they cost the providers nothing, so they are not
//! charged against rate limits. Rejections by the limits are the sidecar's own 429/503s and
//! are never retried.
//!
//! The client sees nothing until an attempt has its first upstream byte in hand: until
//! then any failure can still be retried elsewhere. After that, nothing is retried; a
//! failure ends an SSE stream with an error event. Every request ends by `timeouts.total`.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use futures_util::{StreamExt, stream::FuturesUnordered};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use rand::Rng;
use tokio::time::Instant;
use tracing::Span;

use tailwarden_decide::{
    breaker::{Permit, State, Transition},
    cache_key::{CacheKey, NotCacheable},
    capabilities::{self, Decision},
    error::ApiError,
    request::RequestBody,
    retry::{self, FailureKind, RetryBudget},
    schedule::{self, Action, GiveUp, Providers, Retry, Scheduler},
    sse::{SseEvent, SseForwarder},
    tiers::CompiledTier,
    usage::{Usage, parse_usage},
};

use crate::{
    accounting::{Recorder, RequestInfo, SloTargets},
    body::{IntoResponse, ProxyBody, Relay},
    cache::Entry,
    limits::{self, AdmissionGuard, Rejection, Scope},
    metrics::Metrics,
    reload::ConfigStatus,
    routes::{Registries, Route, RouteTable, Upstream},
    semantic::{self, Lookup},
    telemetry::{self, KeyValue},
};

/// Non-stream responses up to this size are read whole before the client sees anything, so
/// a failure in the middle of one can still be retried. Larger ones are relayed.
const BUFFER_LIMIT: usize = 4 << 20;
/// Error bodies read from providers are capped at this size.
const ERROR_BODY_LIMIT: usize = 64 << 10;

/// Shared state of the sidecar.
pub struct App {
    pub table: ArcSwap<RouteTable>,
    pub metrics: Arc<Metrics>,
    /// Pools, limiters and caches kept across config reloads.
    pub registries: Registries,
    pub draining: AtomicBool,
    /// Cancelled just before the drain timeout runs out: streams still relaying end with an
    /// SSE error event instead of being cut mid-chunk when the process exits.
    pub drain_expired: tokio_util::sync::CancellationToken,
    pub body_timeout: Duration,
    next_id: AtomicU64,
    status: std::sync::Mutex<ConfigStatus>,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("App")
    }
}

impl App {
    pub fn new(table: RouteTable, metrics: Arc<Metrics>, registries: Registries) -> Self {
        Self {
            table: ArcSwap::from_pointee(table),
            metrics,
            registries,
            draining: AtomicBool::new(false),
            drain_expired: tokio_util::sync::CancellationToken::new(),
            body_timeout: Duration::from_secs(30),
            next_id: AtomicU64::new(1),
            status: std::sync::Mutex::new(ConfigStatus::default()),
        }
    }

    /// The config file's load status, for `/config`.
    pub fn config_status(&self) -> ConfigStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn set_config_status(&self, status: ConfigStatus) {
        if let Ok(mut s) = self.status.lock() {
            *s = status;
        }
    }

    fn request_id(&self, headers: &HeaderMap) -> String {
        headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map(str::to_owned)
            .unwrap_or_else(|| format!("tw-{:x}", self.next_id.fetch_add(1, Ordering::Relaxed)))
    }
}

/// Entry point for every client request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Response<ProxyBody> {
    let arrived = Instant::now();
    let path = req.uri().path().to_owned();
    let suffix = match path.as_str() {
        "/v1/chat/completions" => "/chat/completions",
        "/v1/completions" => "/completions",
        "/v1/embeddings" => "/embeddings",
        "/v1/models" => {
            return if req.method() == Method::GET {
                models(&app)
            } else {
                ApiError::method_not_allowed(req.method(), &path).into_response()
            };
        }
        _ => return ApiError::not_found(&path).into_response(),
    };
    if req.method() != Method::POST {
        return ApiError::method_not_allowed(req.method(), &path).into_response();
    }
    if app.draining.load(Ordering::Relaxed) {
        return ApiError::shutting_down().into_response();
    }
    let span = telemetry::server_span(telemetry::operation(suffix), &path, req.headers());
    match proxy(&app, req, suffix, arrived, &span).await {
        Ok(response) => response,
        Err(e) => {
            telemetry::refused(&span, e.status.as_u16(), e.code.unwrap_or(e.kind));
            e.into_response()
        }
    }
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

async fn read_body(
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

/// Per-request state shared by its attempts.
struct Call<'a> {
    app: &'a App,
    route: &'a Arc<Route>,
    suffix: &'static str,
    client_headers: &'a HeaderMap,
    request_id: &'a str,
    stream: bool,
    strip_usage: bool,
    /// Model after tier choice (client-facing).
    model: &'a str,
    body: &'a RequestBody<'a>,
    raw_body: &'a Bytes,
    deadline: Instant,
    /// The request's SERVER span (none when tracing is off).
    span: &'a Span,
    /// Per provider (by index): what its capability rules do with this request; empty
    /// when no provider of the route has rules.
    decisions: &'a [Decision],
}

/// What the exact cache decided for a request (on routes with a cache).
enum CacheState {
    /// The route has no cache.
    Off,
    /// Not cacheable, or the client opted out of storing.
    Bypass(NotCacheable),
    /// Looked up and missed, or the client bypassed the lookup: the answer may be stored.
    Miss(CacheKey),
}

impl CacheState {
    fn label(&self) -> Option<&'static str> {
        match self {
            CacheState::Off => None,
            CacheState::Bypass(_) => Some("bypass"),
            CacheState::Miss(key) if key.read => Some("miss"),
            CacheState::Miss(_) => Some("bypass"),
        }
    }
}

/// What was decided about a request before its attempts.
struct Prepared {
    request_id: String,
    /// Index into the route's tiers.
    tier: Option<usize>,
    cache: CacheState,
    admission: Option<AdmissionGuard>,
    /// A semantic-cache miss of a comparable request: its answer may be stored.
    semantic: Option<(semantic::Query, semantic::Embedding)>,
}

async fn proxy(
    app: &Arc<App>,
    req: Request<Incoming>,
    suffix: &'static str,
    arrived: Instant,
    span: &Span,
) -> Result<Response<ProxyBody>, ApiError> {
    let table = app.table.load_full();
    let limit = table.max_body_bytes.max(1);
    let (headers, raw_body) = read_body(app, req, limit).await?;
    let body = RequestBody::parse(&raw_body)?;
    let route = table
        .route_for(&body.model)
        .ok_or_else(|| ApiError::model_not_found(&body.model))?;
    telemetry::name_server_span(span, telemetry::operation(suffix), &body.model, &route.name);
    if raw_body.len() as u64 > route.settings.max_body_bytes {
        return Err(ApiError::too_large(route.settings.max_body_bytes));
    }
    let request_id = app.request_id(&headers);
    let tiers = route.tier_set.tiers();
    let tier = route
        .tier_set
        .choose_for(&body, &headers)
        .and_then(|chosen| tiers.iter().position(|t| std::ptr::eq(t, chosen)));
    let model = tier.map_or(body.model.as_ref(), |i| tiers[i].model.as_str());

    let cache = match &route.cache {
        None => CacheState::Off,
        Some(cache) => match cache.key(&body, suffix, model, &headers) {
            Err(reason) => CacheState::Bypass(reason),
            Ok(key) => match match cache.get(&key) {
                Some(local) => Some(local),
                None => cache.get_shared(&key).await,
            } {
                Some(entry) => {
                    let response = cached_response(
                        app,
                        route,
                        &entry,
                        &body,
                        &request_id,
                        tier,
                        suffix,
                        arrived,
                        span,
                        CacheAnswer::Exact,
                        None,
                    );
                    return Ok(response);
                }
                None => CacheState::Miss(key),
            },
        },
    };
    if let Some(label) = cache.label() {
        app.metrics
            .cache_requests
            .with_label_values(&[&*route.name, label])
            .inc();
    }

    let admission = match &route.limiter {
        None => None,
        Some(limiter) => {
            let tenant = limiter.tenant_of(&headers);
            match limits::admit(limiter, tenant.as_deref(), limits::estimate_tokens(&body)).await {
                Ok(guard) => {
                    if limiter.concurrency().0 > 0 {
                        app.metrics
                            .queue_wait
                            .with_label_values(&[&*route.name])
                            .observe(guard.waited().as_secs_f64());
                    }
                    Some(guard)
                }
                Err(rejection) => {
                    return Ok(rejected(
                        app,
                        route,
                        &rejection,
                        &body,
                        &request_id,
                        tier,
                        suffix,
                        arrived,
                        span,
                        &raw_body,
                    ));
                }
            }
        }
    };
    // The semantic cache, after admission: its embeddings call is bounded by the route's
    // limits, and a hit gives its token reservation back (it used none).
    let mut semantic_miss = None;
    let mut admission = admission;
    if let Some(sc) = &route.semantic
        && let Ok(query) = sc.query(&body, suffix, model, &headers)
        && let Some(embedder) = sc.upstream_in(route)
    {
        let remaining = (arrived + route.settings.total).saturating_duration_since(Instant::now());
        let count = |result: &str| {
            app.metrics
                .semantic_requests
                .with_label_values(&[&*route.name, result])
                .inc();
        };
        let embedded = semantic::embed(
            embedder,
            &sc.settings().model,
            &query.text,
            sc.settings().timeout.min(remaining),
        )
        .await;
        match embedded.ok().and_then(semantic::Embedding::new) {
            None => count("error"),
            Some(embedding) => match sc.lookup(&query, &embedding) {
                Lookup::Hit { similarity, entry } => {
                    count("hit");
                    return Ok(cached_response(
                        app,
                        route,
                        &entry,
                        &body,
                        &request_id,
                        tier,
                        suffix,
                        arrived,
                        span,
                        CacheAnswer::Semantic(similarity),
                        admission.take(),
                    ));
                }
                Lookup::Miss => {
                    count("miss");
                    semantic_miss = Some((query, embedding));
                }
                Lookup::Refused { similarity, reason } => {
                    count("refused");
                    tracing::debug!(route = %route.name, similarity, reason = reason.as_str(), "semantic near match refused by a guard");
                    semantic_miss = Some((query, embedding));
                }
            },
        }
    }
    let prepared = Prepared {
        request_id,
        tier,
        cache,
        admission,
        semantic: semantic_miss,
    };

    let heartbeat = route
        .settings
        .heartbeat
        .filter(|_| body.stream && suffix != "/embeddings");
    let Some(interval) = heartbeat else {
        return Ok(respond(
            app, route, &headers, &raw_body, &body, suffix, arrived, span, prepared,
        )
        .await);
    };
    // Heartbeats: wait up to one interval for the response as usual; if it is not there yet,
    // commit a 200 event stream and send `: ping` comments while the attempts (retries and
    // fallback included) go on in the body. The owned future re-parses the body, which
    // parsed once already.
    let (app, route, span) = (app.clone(), route.clone(), span.clone());
    let mut pending = Box::pin(async move {
        match RequestBody::parse(&raw_body) {
            Ok(body) => {
                respond(
                    &app, &route, &headers, &raw_body, &body, suffix, arrived, &span, prepared,
                )
                .await
            }
            Err(e) => e.into_response(),
        }
    });
    tokio::select! {
        response = &mut pending => Ok(response),
        () = tokio::time::sleep(interval) => Ok(crate::body::heartbeat_response(pending, interval)),
    }
}

/// Runs the attempts for a parsed request and builds the client response.
#[allow(clippy::too_many_arguments)]
async fn respond(
    app: &App,
    route: &Arc<Route>,
    headers: &HeaderMap,
    raw_body: &Bytes,
    body: &RequestBody<'_>,
    suffix: &'static str,
    arrived: Instant,
    span: &Span,
    prepared: Prepared,
) -> Response<ProxyBody> {
    let Prepared {
        request_id,
        tier,
        cache,
        admission,
        semantic: semantic_miss,
    } = prepared;
    let tier = tier.and_then(|i| route.tier_set.tiers().get(i));
    let model = tier.map_or(body.model.as_ref(), |t| t.model.as_str());
    let stream = body.stream && suffix != "/embeddings";
    if let Some(t) = tier {
        app.metrics
            .tier_requests
            .with_label_values(&[&*route.name, &*t.name])
            .inc();
    }
    let decisions = capability_decisions(route, model, body);
    if let Some(error) = unsupported_everywhere(route, &decisions) {
        let info = request_info(
            app,
            route,
            body,
            &request_id,
            tier,
            stream,
            arrived,
            span,
            error.status.as_u16(),
        );
        let mut recorder = Recorder::finished(info, Some("unsupported_parameter"));
        recorder.set_admission(admission);
        drop(recorder);
        let mut response = error.into_response();
        finish_headers(
            &mut response,
            &request_id,
            tier.map(|t| &*t.name),
            cache.label(),
        );
        return response;
    }
    let call = Call {
        app,
        route,
        suffix,
        client_headers: headers,
        request_id: &request_id,
        stream,
        strip_usage: stream && route.settings.include_usage && !body.client_wants_usage,
        model,
        body,
        raw_body,
        deadline: arrived + route.settings.total,
        span,
        decisions: &decisions,
    };
    let outcome = run(&call).await;
    let info = |status: u16,
                upstream: Option<&Upstream>,
                attempts: u32,
                hedged: bool,
                overhead: Duration| RequestInfo {
        metrics: app.metrics.clone(),
        request_id: request_id.clone(),
        route: route.name.clone(),
        model: body.model.to_string(),
        provider: upstream.map_or_else(|| Arc::from(""), |u| u.name.clone()),
        provider_model: upstream.map_or_else(String::new, |u| u.provider_model(model).to_owned()),
        tier: tier.map(|t| t.name.clone()),
        stream,
        status,
        attempts,
        hedged,
        arrived,
        overhead,
        request_bytes: raw_body.len(),
        price: upstream.and_then(|u| u.prices.get(u.provider_model(model)).cloned()),
        slo: SloTargets::of(&route.spec),
        span: span.clone(),
        attempt_span: Span::none(),
        cache: cache.label(),
    };
    let cache_key = match (&cache, &route.cache) {
        (CacheState::Miss(key), Some(store)) => Some((*key, store)),
        _ => None,
    };
    let mut response = match outcome {
        Outcome::Won(won) => {
            let upstream = &route.upstreams[won.upstream];
            let overhead = won.dispatch_delay + won.committed_at.elapsed();
            let mut info = info(
                won.status.as_u16(),
                Some(upstream),
                won.attempts,
                won.hedged,
                overhead,
            );
            info.overhead = overhead;
            info.attempt_span = won.span;
            let mut recorder = Recorder::new(info);
            recorder.set_admission(admission);
            let fill = cache_key
                .and_then(|(key, store)| store.fill(&key, won.status, &won.headers, stream));
            let semantic_fill = match (&route.semantic, &semantic_miss) {
                (Some(sc), Some((query, embedding))) => {
                    sc.fill(query, embedding, won.status, &won.headers)
                }
                _ => None,
            };
            let body = match won.rest {
                None => {
                    if let Some(usage) = won.usage {
                        recorder.set_usage(usage);
                    }
                    if !span.is_none() {
                        recorder.set_response_model(
                            won.held.front().and_then(|b| telemetry::body_model(b)),
                        );
                    }
                    let total: usize = won.held.iter().map(Bytes::len).sum();
                    recorder.add_body_bytes(total);
                    recorder.finish_ok();
                    drop(recorder);
                    let whole = concat(won.held);
                    if let Some(mut fill) = fill {
                        fill.push(&whole);
                        fill.commit();
                    }
                    if let Some(mut fill) = semantic_fill {
                        fill.push(&whole);
                        fill.commit();
                    }
                    ProxyBody::full(whole)
                }
                Some(rest) => {
                    for ev in &won.first_events {
                        recorder.on_sse_event(ev);
                    }
                    let mut relay = Relay::new(
                        won.held,
                        Some(rest),
                        won.forwarder,
                        route.settings.idle,
                        call.deadline,
                        recorder,
                        won.permit,
                        fill,
                    );
                    relay.set_verdict(won.verdict);
                    relay.set_semantic_fill(semantic_fill);
                    relay.end_on(app.drain_expired.clone());
                    ProxyBody::Relay(Box::new(relay))
                }
            };
            let mut response = Response::new(body);
            *response.status_mut() = won.status;
            copy_response_headers(&won.headers, response.headers_mut());
            set_header(
                response.headers_mut(),
                "x-tailwarden-provider",
                &upstream.name,
            );
            set_header(
                response.headers_mut(),
                "x-tailwarden-attempts",
                &won.attempts.to_string(),
            );
            set_header(
                response.headers_mut(),
                "x-tailwarden-overhead-us",
                &overhead.as_micros().to_string(),
            );
            response
        }
        Outcome::Failed(failed) => {
            let upstream = failed.upstream.map(|i| &*route.upstreams[i]);
            let status = failed.response.status();
            let info = info(
                status.as_u16(),
                upstream,
                failed.attempts,
                failed.hedged,
                failed.dispatch_delay,
            );
            let mut recorder = Recorder::finished(info, Some(failed.error_type));
            recorder.set_admission(admission);
            drop(recorder);
            let mut response = failed.response;
            if let Some(u) = upstream {
                set_header(response.headers_mut(), "x-tailwarden-provider", &u.name);
            }
            set_header(
                response.headers_mut(),
                "x-tailwarden-attempts",
                &failed.attempts.to_string(),
            );
            response
        }
    };
    finish_headers(
        &mut response,
        &request_id,
        tier.map(|t| &*t.name),
        cache.label(),
    );
    if let CacheState::Bypass(reason) = &cache {
        set_header(
            response.headers_mut(),
            "x-tailwarden-cache-reason",
            &reason.to_string(),
        );
    }
    response
}

/// Headers every response of the request path carries.
fn finish_headers(
    response: &mut Response<ProxyBody>,
    request_id: &str,
    tier: Option<&str>,
    cache: Option<&'static str>,
) {
    let headers = response.headers_mut();
    if let Some(tier) = tier {
        set_header(headers, "x-tailwarden-tier", tier);
    }
    if let Some(cache) = cache {
        headers.insert("x-tailwarden-cache", HeaderValue::from_static(cache));
    }
    set_header(headers, "x-request-id", request_id);
}

/// What is known about a request that no provider answered (a cache hit, a rejection).
#[allow(clippy::too_many_arguments)]
fn request_info(
    app: &App,
    route: &Route,
    body: &RequestBody<'_>,
    request_id: &str,
    tier: Option<&CompiledTier>,
    stream: bool,
    arrived: Instant,
    span: &Span,
    status: u16,
) -> RequestInfo {
    RequestInfo {
        metrics: app.metrics.clone(),
        request_id: request_id.to_owned(),
        route: route.name.clone(),
        model: body.model.to_string(),
        provider: Arc::from(""),
        provider_model: String::new(),
        tier: tier.map(|t| t.name.clone()),
        stream,
        status,
        attempts: 0,
        hedged: false,
        arrived,
        overhead: arrived.elapsed(),
        request_bytes: 0,
        price: None,
        slo: SloTargets::of(&route.spec),
        span: span.clone(),
        attempt_span: Span::none(),
        cache: None,
    }
}

/// The answer from the exact cache: the stored status, content type and body — a stream is
/// replayed as the very chunks the first client received.
#[allow(clippy::too_many_arguments)]
fn cached_response(
    app: &App,
    route: &Route,
    entry: &Arc<Entry>,
    body: &RequestBody<'_>,
    request_id: &str,
    tier: Option<usize>,
    suffix: &'static str,
    arrived: Instant,
    span: &Span,
    answer: CacheAnswer,
    admission: Option<AdmissionGuard>,
) -> Response<ProxyBody> {
    if answer == CacheAnswer::Exact {
        app.metrics
            .cache_requests
            .with_label_values(&[&*route.name, "hit"])
            .inc();
    }
    let tier = tier.and_then(|i| route.tier_set.tiers().get(i));
    let stream = body.stream && suffix != "/embeddings";
    let mut info = request_info(
        app,
        route,
        body,
        request_id,
        tier,
        stream,
        arrived,
        span,
        entry.status.as_u16(),
    );
    let label = match answer {
        CacheAnswer::Exact => "hit",
        CacheAnswer::Semantic(_) => semantic::HIT_HEADER_VALUE,
    };
    info.cache = Some(label);
    info.provider = Arc::from("cache");
    let mut recorder = Recorder::finished(info, None);
    // Nothing was used: the reservation goes back whole.
    recorder.set_admission(admission);
    drop(recorder);
    let payload = if entry.stream {
        ProxyBody::Replay(entry.replay())
    } else {
        ProxyBody::full(entry.body())
    };
    let mut response = Response::new(payload);
    *response.status_mut() = entry.status;
    let headers = response.headers_mut();
    if let Some(ct) = &entry.content_type {
        headers.insert(header::CONTENT_TYPE, ct.clone());
    }
    if entry.stream {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    headers.insert(header::AGE, HeaderValue::from(entry.age(Instant::now())));
    if let CacheAnswer::Semantic(similarity) = answer {
        set_header(
            headers,
            semantic::SIMILARITY_HEADER,
            &format!("{similarity:.4}"),
        );
    }
    finish_headers(
        &mut response,
        request_id,
        tier.map(|t| &*t.name),
        Some(label),
    );
    response
}

/// Which cache answered.
#[derive(Debug, Clone, Copy, PartialEq)]
enum CacheAnswer {
    Exact,
    /// With the cosine similarity of the two questions.
    Semantic(f32),
}

/// The sidecar's own 429/503 for a request over one of the route's limits: `Retry-After`,
/// the limit named in the message and in `x-tailwarden-limit`. Never retried.
#[allow(clippy::too_many_arguments)]
fn rejected(
    app: &App,
    route: &Route,
    rejection: &Rejection,
    body: &RequestBody<'_>,
    request_id: &str,
    tier: Option<usize>,
    suffix: &'static str,
    arrived: Instant,
    span: &Span,
    raw_body: &Bytes,
) -> Response<ProxyBody> {
    let error = rejection.to_api_error();
    let status = error.status;
    let scope = match rejection.scope() {
        Scope::Route(_) => "route",
        Scope::Tenant { .. } => "tenant",
    };
    let limit = rejection.limit().label();
    app.metrics
        .admission_rejected
        .with_label_values(&[&*route.name, limit, scope, status.as_str()])
        .inc();
    let tier = tier.and_then(|i| route.tier_set.tiers().get(i));
    let stream = body.stream && suffix != "/embeddings";
    let mut info = request_info(
        app,
        route,
        body,
        request_id,
        tier,
        stream,
        arrived,
        span,
        status.as_u16(),
    );
    info.request_bytes = raw_body.len();
    telemetry::refused(span, status.as_u16(), error.code.unwrap_or(error.kind));
    drop(Recorder::finished(
        info,
        Some(if status == StatusCode::TOO_MANY_REQUESTS {
            "rate_limited"
        } else {
            "overloaded"
        }),
    ));
    let mut response = error.into_response();
    set_header(response.headers_mut(), "x-tailwarden-limit", limit);
    // OpenAI SDKs retry 429/503 on their own unless told not to; a limit that resets within a
    // few seconds is worth their retry, a shed for overload is too, so the hint stays theirs.
    finish_headers(&mut response, request_id, tier.map(|t| &*t.name), None);
    response
}

/// Each provider's capability decision for a request to `model` (after tier choice).
fn capability_decisions(route: &Route, model: &str, body: &RequestBody<'_>) -> Vec<Decision> {
    if !route.has_capabilities {
        return Vec::new();
    }
    route
        .upstreams
        .iter()
        .map(|u| {
            u.capabilities
                .check(&u.name, u.provider_model(model), body.members())
        })
        .collect()
}

/// The 400 when every usable provider rejects the request's parameters.
fn unsupported_everywhere(route: &Route, decisions: &[Decision]) -> Option<ApiError> {
    if decisions.is_empty() {
        return None;
    }
    let mut params: Vec<String> = Vec::new();
    let mut reasons = Vec::new();
    for (u, d) in route.upstreams.iter().zip(decisions) {
        match d {
            Decision::Reject { params: p, message } => {
                for name in p {
                    if !params.contains(name) {
                        params.push(name.clone());
                    }
                }
                reasons.push(message.clone());
            }
            _ if u.usable() => return None,
            _ => {}
        }
    }
    Some(capabilities::no_provider_supports(
        &route.name,
        &params,
        &reasons,
    ))
}

fn set_header(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        headers.insert(name, v);
    }
}

fn concat(chunks: VecDeque<Bytes>) -> Bytes {
    if chunks.len() == 1 {
        return chunks.into_iter().next().unwrap_or_default();
    }
    let mut out = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
    for c in chunks {
        out.extend_from_slice(&c);
    }
    out.freeze()
}

/// Hop-by-hop and framing headers are the sidecar's own business, never copied.
fn copy_response_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if matches!(
            name.as_str(),
            "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "te"
                | "trailer"
                | "upgrade"
                | "proxy-authenticate"
                | "proxy-connection"
                | "content-length"
        ) {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
}

/// The attempt that won.
struct Won {
    upstream: usize,
    status: StatusCode,
    headers: HeaderMap,
    held: VecDeque<Bytes>,
    rest: Option<Incoming>,
    forwarder: Option<SseForwarder>,
    first_events: Vec<SseEvent>,
    usage: Option<Usage>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    verdict: Option<StreamVerdict>,
    attempts: u32,
    hedged: bool,
    dispatch_delay: Duration,
    committed_at: Instant,
    /// The CLIENT span of the winning attempt (none when tracing is off).
    span: Span,
}

/// The request failed: the response to send.
struct Failed {
    upstream: Option<usize>,
    response: Response<ProxyBody>,
    attempts: u32,
    hedged: bool,
    error_type: &'static str,
    dispatch_delay: Duration,
}

enum Outcome {
    Won(Box<Won>),
    Failed(Box<Failed>),
}

/// One attempt's successful start.
struct Started {
    status: StatusCode,
    headers: HeaderMap,
    held: VecDeque<Bytes>,
    rest: Option<Incoming>,
    forwarder: Option<SseForwarder>,
    first_events: Vec<SseEvent>,
    usage: Option<Usage>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// One attempt's failure.
struct AttemptFailure {
    kind: FailureKind,
    retry_after: Option<Duration>,
    /// The provider's own error response, passed to the client if nothing better comes.
    response: Option<(StatusCode, HeaderMap, Bytes)>,
    message: String,
}

struct AttemptResult {
    upstream: usize,
    /// Index into the request's permit list.
    slot: usize,
    hedge: bool,
    started_at: Instant,
    result: Result<Started, AttemptFailure>,
    /// The attempt's CLIENT span, still open (none when tracing is off).
    span: Span,
}

/// The route's providers and budgets as the scheduler sees them: the balancer's choice among
/// providers whose key is loaded, whose capability rules accept the request and whose
/// breaker admits it; the breaker permit is the grant an attempt holds.
struct LiveProviders<'c, 'a> {
    call: &'c Call<'a>,
}

impl Providers for LiveProviders<'_, '_> {
    type Grant = Permit;

    fn pick(&mut self, now: std::time::Instant, exclude: &[usize]) -> Option<(usize, Permit)> {
        let call = self.call;
        let route = call.route;
        let available = |i: usize| {
            let u = &route.upstreams[i];
            u.usable()
                && !matches!(call.decisions.get(i), Some(Decision::Reject { .. }))
                && u.breaker().is_available(now)
        };
        let mut excluded: Vec<usize> = exclude.to_vec();
        // A breaker can turn a request away between the balancer's look and the permit (a
        // half-open breaker's probe slots filled by another request): try the next one.
        for _ in 0..=route.upstreams.len() {
            let choice = route
                .balancer
                .pick(now, &mut rand::rng(), &excluded, available)?;
            let upstream = &route.upstreams[choice];
            let (result, transition) = upstream.breaker().try_acquire(now);
            if let Some(t) = transition {
                log_transition(call, upstream, &t);
            }
            if let Ok(permit) = result {
                return Some((choice, permit));
            }
            excluded.push(choice);
        }
        None
    }

    fn cooldown_end(&self, now: std::time::Instant) -> Option<std::time::Instant> {
        let route = self.call.route;
        (0..route.upstreams.len())
            .filter(|&i| route.upstreams[i].usable())
            .filter_map(|i| route.balancer.cooling_until(i))
            .filter(|&until| until > now)
            .min()
    }

    fn ttft_quantile(&self, provider: usize, now: std::time::Instant, q: f64) -> Option<Duration> {
        self.call.route.upstreams[provider]
            .state
            .ttft
            .quantile(now, q)
    }

    fn retry_budget(&self) -> &RetryBudget {
        &self.call.route.state.retry_budget
    }

    fn hedge_budget(&self) -> &RetryBudget {
        &self.call.route.state.hedge_budget
    }

    fn jitter(&mut self) -> f64 {
        rand::rng().random::<f64>()
    }
}

/// Runs the request's attempts: a thin driver of the pure [`Scheduler`], which decides when
/// to start, retry, hedge, wait or give up; this loop only starts what it says and reports
/// what the attempts did.
async fn run(call: &Call<'_>) -> Outcome {
    let route = call.route;
    let metrics = &call.app.metrics;
    let dispatched = Instant::now();
    let mut providers = LiveProviders { call };
    let mut schedule = Scheduler::new(
        route.settings.schedule,
        dispatched.into_std(),
        call.deadline.into_std(),
        &providers,
    );
    let mut inflight = FuturesUnordered::new();
    // Breaker permits of started attempts, reported exactly once (result or cancel).
    let mut permits: Vec<Option<Permit>> = Vec::new();
    let mut last_failure: Option<(usize, AttemptFailure)> = None;

    loop {
        let wake = loop {
            match schedule.next(std_now(), &mut providers) {
                Action::Start { provider, grant } => {
                    permits.push(Some(grant));
                    inflight.push(attempt(call, provider, permits.len() - 1, false));
                }
                Action::Hedge { provider, grant } => {
                    permits.push(Some(grant));
                    metrics
                        .hedges
                        .with_label_values(&[&*route.name, "started"])
                        .inc();
                    let attempts = schedule.attempts();
                    telemetry::event_with(call.span, "hedge", || {
                        vec![
                            KeyValue::new("tailwarden.hedge.outcome", "started"),
                            KeyValue::new(
                                "gen_ai.provider.name",
                                route.upstreams[provider].name.to_string(),
                            ),
                            KeyValue::new("tailwarden.attempt", i64::from(attempts)),
                        ]
                    });
                    inflight.push(attempt(call, provider, permits.len() - 1, true));
                }
                Action::Wait { until } => break Instant::from_std(until),
                Action::GiveUp(why) => {
                    drop(inflight);
                    cancel_permits(route, schedule.tried(), &mut permits);
                    let dispatch_delay = dispatch_delay(&schedule, dispatched);
                    return give_up(call, why, last_failure, &schedule, dispatch_delay);
                }
            }
        };
        tokio::select! {
            biased;
            Some(done) = inflight.next() => {
                let AttemptResult { upstream: idx, slot, hedge, started_at, result, span } = done;
                let upstream = &route.upstreams[idx];
                let elapsed = started_at.elapsed();
                let permit = permits.get_mut(slot).and_then(Option::take);
                match result {
                    Ok(started) => {
                        metrics.attempt_duration.with_label_values(&[&*route.name, &*upstream.name, "ok"]).observe(elapsed.as_secs_f64());
                        // A stream's breaker verdict waits for its end, so a provider that
                        // cuts its streams opens its breaker; half-open probes too (a probe
                        // judged at its first event would close the breaker of a provider
                        // that still cuts every stream, and it would flap).
                        let verdict = if started.forwarder.is_some() && started.rest.is_some() {
                            record_first_byte(call, idx, elapsed);
                            Some(StreamVerdict {
                                metrics: metrics.clone(),
                                route: route.name.clone(),
                                upstream: upstream.clone(),
                                permit,
                                first_byte: elapsed,
                                span: call.span.clone(),
                            })
                        } else {
                            record_success(call, idx, permit, elapsed);
                            None
                        };
                        let hedged = schedule.hedged();
                        if hedged {
                            let outcome = if hedge { "won" } else { "lost" };
                            metrics.hedges.with_label_values(&[&*route.name, outcome]).inc();
                            telemetry::event_with(call.span, "hedge", || vec![
                                KeyValue::new("tailwarden.hedge.outcome", outcome),
                                KeyValue::new("gen_ai.provider.name", upstream.name.to_string()),
                            ]);
                        }
                        // Dropping `inflight` cancels the losing attempts now.
                        drop(inflight);
                        cancel_permits(route, schedule.tried(), &mut permits);
                        return Outcome::Won(Box::new(Won {
                            upstream: idx,
                            status: started.status,
                            headers: started.headers,
                            held: started.held,
                            rest: started.rest,
                            forwarder: started.forwarder,
                            first_events: started.first_events,
                            usage: started.usage,
                            permit: started.permit,
                            verdict,
                            attempts: schedule.attempts(),
                            hedged,
                            dispatch_delay: dispatch_delay(&schedule, dispatched),
                            committed_at: Instant::now(),
                            span,
                        }));
                    }
                    Err(failure) => {
                        metrics.attempt_duration.with_label_values(&[&*route.name, &*upstream.name, failure.kind.as_str()]).observe(elapsed.as_secs_f64());
                        record_failure(call, idx, permit, &failure, elapsed);
                        let reason = failure.kind.as_str();
                        let retry = schedule.on_failure(std_now(), failure.kind, &mut providers);
                        last_failure = Some((idx, failure));
                        note_retry(call, idx, reason, retry, schedule.attempts());
                    }
                }
            }
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// Time from the request's dispatch to its first attempt: the sidecar's own delay (a wait
/// for a cool-down included).
fn dispatch_delay(schedule: &Scheduler, dispatched: Instant) -> Duration {
    schedule.first_start().map_or_else(
        || dispatched.elapsed(),
        |t| t.saturating_duration_since(dispatched.into_std()),
    )
}

/// Metrics, span events and a debug line for what the scheduler made of a failure.
fn note_retry(call: &Call<'_>, idx: usize, reason: &'static str, retry: Retry, attempts: u32) {
    let route = call.route;
    let metrics = &call.app.metrics;
    let provider = &route.upstreams[idx].name;
    match retry {
        Retry::Scheduled { backoff, .. } | Retry::TooLate { backoff } => {
            let scheduled = matches!(retry, Retry::Scheduled { .. });
            metrics
                .retries
                .with_label_values(&[&*route.name, &**provider, reason])
                .inc();
            telemetry::event_with(call.span, "retry", || {
                vec![
                    KeyValue::new("tailwarden.retry.reason", reason),
                    KeyValue::new("gen_ai.provider.name", provider.to_string()),
                    KeyValue::new("tailwarden.attempt", i64::from(attempts)),
                    KeyValue::new(
                        "tailwarden.retry.backoff_ms",
                        backoff.as_secs_f64() * 1000.0,
                    ),
                    KeyValue::new("tailwarden.retry.scheduled", scheduled),
                ]
            });
        }
        Retry::BudgetRefused => {
            tracing::debug!(route = %route.name, "retry budget exhausted; not retrying");
            metrics
                .retries
                .with_label_values(&[&*route.name, &**provider, "budget_exhausted"])
                .inc();
            telemetry::event_with(call.span, "retry_denied", || {
                vec![
                    KeyValue::new("tailwarden.retry.reason", reason),
                    KeyValue::new("tailwarden.retry.denied_by", "budget_exhausted"),
                    KeyValue::new("gen_ai.provider.name", provider.to_string()),
                ]
            });
        }
        Retry::NotRetried => {}
    }
}

/// The response when the scheduler gave up.
fn give_up(
    call: &Call<'_>,
    why: GiveUp,
    last_failure: Option<(usize, AttemptFailure)>,
    schedule: &Scheduler,
    dispatch_delay: Duration,
) -> Outcome {
    let (attempts, hedged) = (schedule.attempts(), schedule.hedged());
    match why {
        GiveUp::Deadline => {
            let response = ApiError::gateway_timeout(format!(
                "No provider answered within the route's total deadline of {} (spec.timeouts.total).",
                tailwarden_crds::units::format_duration(call.route.settings.total)
            ))
            .into_response();
            Outcome::Failed(Box::new(Failed {
                upstream: last_failure.map(|(i, _)| i),
                response,
                attempts,
                hedged,
                error_type: "total_timeout",
                dispatch_delay,
            }))
        }
        GiveUp::Exhausted => fail(call, last_failure, attempts, hedged, dispatch_delay, false),
        GiveUp::NothingAvailable => {
            fail(call, last_failure, attempts, hedged, dispatch_delay, true)
        }
    }
}

fn std_now() -> std::time::Instant {
    Instant::now().into_std()
}

/// Releases the permits of attempts that never reported (cancelled losers).
fn cancel_permits(route: &Route, tried: &[usize], permits: &mut [Option<Permit>]) {
    for (slot, permit) in permits.iter_mut().enumerate() {
        if let (Some(permit), Some(&idx)) = (permit.take(), tried.get(slot)) {
            route.upstreams[idx].breaker().on_cancel(permit);
        }
    }
}

/// The breaker's verdict on a stream, given when the stream ends: a provider that cuts its
/// streams after the first event is failing even though every attempt "started" well.
pub struct StreamVerdict {
    metrics: Arc<Metrics>,
    route: Arc<str>,
    upstream: Arc<Upstream>,
    permit: Option<Permit>,
    first_byte: Duration,
    span: Span,
}

impl StreamVerdict {
    /// The stream ended cleanly.
    pub fn success(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let jitter = rand::rng().random::<f64>();
        let now = std_now();
        let transition = self
            .upstream
            .state
            .breaker
            .lock()
            .ok()
            .and_then(|mut b| b.on_success(permit, now, self.first_byte, jitter));
        self.note(transition);
    }

    /// The provider failed the stream after its first event (reset, stall).
    pub fn failure(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let jitter = rand::rng().random::<f64>();
        let now = std_now();
        let transition = self
            .upstream
            .state
            .breaker
            .lock()
            .ok()
            .and_then(|mut b| b.on_failure(permit, now, jitter));
        self.note(transition);
    }

    fn note(&self, transition: Option<Transition>) {
        if let Some(t) = transition {
            note_transition(&self.metrics, &self.route, &self.span, &self.upstream, &t);
        }
    }
}

impl Drop for StreamVerdict {
    /// No verdict (the client left, the route's total deadline): the permit is released.
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take()
            && let Ok(mut b) = self.upstream.state.breaker.lock()
        {
            b.on_cancel(permit);
        }
    }
}

fn record_first_byte(call: &Call<'_>, idx: usize, elapsed: Duration) {
    let now = std_now();
    call.route.balancer.record_ttft(idx, now, elapsed);
    call.route.upstreams[idx].state.ttft.record(now, elapsed);
}

fn record_success(call: &Call<'_>, idx: usize, permit: Option<Permit>, elapsed: Duration) {
    let route = call.route;
    let now = std_now();
    let upstream = &route.upstreams[idx];
    record_first_byte(call, idx, elapsed);
    let Some(permit) = permit else { return };
    let jitter = rand::rng().random::<f64>();
    let transition = upstream
        .state
        .breaker
        .lock()
        .ok()
        .and_then(|mut b| b.on_success(permit, now, elapsed, jitter));
    if let Some(t) = transition {
        log_transition(call, upstream, &t);
    }
}

fn record_failure(
    call: &Call<'_>,
    idx: usize,
    permit: Option<Permit>,
    failure: &AttemptFailure,
    elapsed: Duration,
) {
    let route = call.route;
    let now = std_now();
    let upstream = &route.upstreams[idx];
    tracing::debug!(route = %route.name, provider = %upstream.name, kind = failure.kind.as_str(), message = %failure.message, "attempt failed");
    route.balancer.record_latency(idx, now, elapsed);
    if let Some(permit) = permit {
        let mut b = upstream.breaker();
        // A 429 is the provider pacing us: the Retry-After cool-down handles it, so it
        // does not also count toward opening the circuit.
        if failure.kind.counts_against_provider() && failure.kind != FailureKind::Status(429) {
            let jitter = rand::rng().random::<f64>();
            if let Some(t) = b.on_failure(permit, now, jitter) {
                drop(b);
                log_transition(call, upstream, &t);
            }
        } else {
            // Not the provider's health (a 4xx, a 429): no verdict, frees a probe slot.
            b.on_cancel(permit);
        }
    }
    if let Some(wait) =
        schedule::cooldown(failure.kind, failure.retry_after, &route.settings.cooldown)
    {
        route.balancer.cool_down(idx, now + wait);
    }
}

fn log_transition(call: &Call<'_>, upstream: &Upstream, t: &Transition) {
    note_transition(&call.app.metrics, &call.route.name, call.span, upstream, t);
}

fn note_transition(
    metrics: &Metrics,
    route: &str,
    span: &Span,
    upstream: &Upstream,
    t: &Transition,
) {
    tracing::warn!(route = %route, provider = %upstream.name, from = t.from.as_str(), to = t.to.as_str(), reason = t.reason.as_str(), "circuit breaker transition");
    telemetry::event_with(span, "breaker", || {
        vec![
            KeyValue::new("gen_ai.provider.name", upstream.name.to_string()),
            KeyValue::new("tailwarden.breaker.from", t.from.as_str()),
            KeyValue::new("tailwarden.breaker.to", t.to.as_str()),
            KeyValue::new("tailwarden.breaker.reason", t.reason.as_str()),
        ]
    });
    metrics
        .breaker_transitions
        .with_label_values(&[route, &*upstream.name, t.to.as_str(), t.reason.as_str()])
        .inc();
    let state = match t.to {
        State::Closed => 0,
        State::HalfOpen => 1,
        State::Open => 2,
    };
    metrics
        .breaker_state
        .with_label_values(&[route, &upstream.name])
        .set(state);
}

/// The response when every attempt failed (or none could start).
fn fail(
    call: &Call<'_>,
    last: Option<(usize, AttemptFailure)>,
    attempts: u32,
    hedged: bool,
    dispatch_delay: Duration,
    nothing_available: bool,
) -> Outcome {
    let route = call.route;
    let (upstream, response, error_type) = match last {
        Some((idx, failure)) if !nothing_available || failure.response.is_some() => {
            let error_type = failure.kind.as_str();
            let response = match failure.response {
                Some((status, headers, body)) => {
                    let mut r = Response::new(ProxyBody::full(body));
                    *r.status_mut() = status;
                    copy_response_headers(&headers, r.headers_mut());
                    r
                }
                None => {
                    let name = &route.upstreams[idx].name;
                    match failure.kind {
                        FailureKind::FirstByteTimeout | FailureKind::TotalTimeout => ApiError::gateway_timeout(format!(
                            "Provider {name} did not respond in time after {attempts} attempt(s): {}", failure.message
                        )),
                        _ => ApiError::bad_gateway(format!(
                            "Provider {name} failed after {attempts} attempt(s): {}", failure.message
                        )),
                    }
                    .into_response()
                }
            };
            (Some(idx), response, error_type)
        }
        _ => {
            let reasons = unavailable_reasons(call);
            (
                None,
                ApiError::upstream_unavailable(format!(
                    "No provider of route {} is available: {reasons}.",
                    route.name
                ))
                .into_response(),
                "no_provider_available",
            )
        }
    };
    Outcome::Failed(Box::new(Failed {
        upstream,
        response,
        attempts,
        hedged,
        error_type,
        dispatch_delay,
    }))
}

fn unavailable_reasons(call: &Call<'_>) -> String {
    let route = call.route;
    let now = std_now();
    route
        .upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let why = if let Some(Decision::Reject { params, .. }) = call.decisions.get(i) {
                format!("does not support {}", params.join(", "))
            } else if let Some(reason) = u.state.unusable.lock().ok().and_then(|r| r.clone()) {
                reason
            } else if let Some(until) = route.balancer.cooling_until(i).filter(|t| *t > now) {
                format!(
                    "cooling down after a 429/503 for {} ms more",
                    (until - now).as_millis()
                )
            } else if u
                .state
                .breaker
                .lock()
                .map(|b| !b.is_available(now))
                .unwrap_or(true)
            {
                "circuit breaker open".to_string()
            } else {
                "tried".to_string()
            };
            format!("{} ({why})", u.name)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Sends one attempt to one provider and waits for its first byte (or, for non-stream
/// responses, the whole body up to [`BUFFER_LIMIT`]).
async fn attempt(call: &Call<'_>, idx: usize, slot: usize, hedge: bool) -> AttemptResult {
    let started_at = Instant::now();
    // Counts toward the provider's load (P2C cost) until the first byte or failure.
    let in_flight = call.route.balancer.start(idx);
    // A hedge that loses is cancelled by dropping this future; the guard marks its span.
    let span = telemetry::AttemptGuard::new(attempt_span(call, idx, slot, hedge));
    let result = attempt_inner(call, idx, span.span()).await;
    drop(in_flight);
    if let Err(f) = &result {
        let status = match f.kind {
            FailureKind::Status(code) => Some(code),
            _ => None,
        };
        telemetry::attempt_failed(span.span(), status, f.kind.as_str());
    }
    AttemptResult {
        upstream: idx,
        slot,
        hedge,
        started_at,
        result,
        span: span.finish(),
    }
}

/// The CLIENT span of an attempt (none when tracing is off).
fn attempt_span(call: &Call<'_>, idx: usize, slot: usize, hedge: bool) -> Span {
    if call.span.is_none() {
        return Span::none();
    }
    let upstream = &call.route.upstreams[idx];
    telemetry::attempt_span(
        call.span,
        &telemetry::AttemptInfo {
            operation: telemetry::operation(call.suffix),
            provider: &upstream.name,
            provider_model: upstream.provider_model(call.model),
            authority: &upstream.authority,
            https: upstream.scheme == http::uri::Scheme::HTTPS,
            route: &call.route.name,
            attempt: u32::try_from(slot).map_or(u32::MAX, |s| s.saturating_add(1)),
            hedge,
        },
    )
}

fn failure(kind: FailureKind, message: impl Into<String>) -> AttemptFailure {
    AttemptFailure {
        kind,
        retry_after: None,
        response: None,
        message: message.into(),
    }
}

async fn attempt_inner(
    call: &Call<'_>,
    idx: usize,
    span: &Span,
) -> Result<Started, AttemptFailure> {
    let route = call.route;
    let settings = &route.settings;
    let upstream = &route.upstreams[idx];
    let first_byte_deadline = (Instant::now() + settings.first_byte).min(call.deadline);
    let timeout_kind = if first_byte_deadline == call.deadline {
        FailureKind::TotalTimeout
    } else {
        FailureKind::FirstByteTimeout
    };

    let permit = tokio::time::timeout_at(
        first_byte_deadline,
        upstream.pool.limit.clone().acquire_owned(),
    )
    .await
    .map_err(|_| failure(timeout_kind, "all maxConnections slots stayed busy"))?
    .map_err(|_| failure(FailureKind::Connect, "connection pool closed"))?;

    let provider_model = upstream.provider_model(call.model);
    // The usage request is the sidecar's own parameter: never sent to a provider whose
    // capability rules say it does not take `stream_options` (its usage is estimated).
    let add_usage = call.strip_usage
        && upstream
            .capabilities
            .supports(provider_model, "stream_options");
    let rewritten = match call.decisions.get(idx) {
        Some(Decision::Drop(params)) => {
            call.app
                .metrics
                .capability_actions
                .with_label_values(&[&*route.name, &*upstream.name, "dropped"])
                .inc();
            let params: Vec<&str> = params.iter().map(String::as_str).collect();
            call.body
                .rewrite_dropping(provider_model, add_usage, &params)
        }
        _ => call.body.rewrite(provider_model, add_usage),
    };
    let body = match rewritten {
        Some(bytes) => Bytes::from(bytes),
        None => call.raw_body.clone(),
    };
    let uri = http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(format!("{}{}", upstream.base_path, call.suffix))
        .build()
        .map_err(|e| failure(FailureKind::Connect, format!("bad upstream URL: {e}")))?;
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| failure(FailureKind::Connect, format!("cannot build request: {e}")))?;
    let headers = req.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::ACCEPT,
        if call.stream {
            HeaderValue::from_static("text/event-stream")
        } else {
            HeaderValue::from_static("application/json")
        },
    );
    for (name, value) in call.client_headers {
        if forwardable(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if !headers.contains_key(header::USER_AGENT) {
        headers.insert(
            header::USER_AGENT,
            HeaderValue::from_static(concat!("tailwarden/", env!("CARGO_PKG_VERSION"))),
        );
    }
    if let Ok(id) = HeaderValue::from_str(call.request_id) {
        headers.insert("x-request-id", id);
    }
    if let Some(value) = upstream.auth_value() {
        headers.insert(upstream.auth_header.clone(), (*value).clone());
    }
    // Traced: the provider's parent is this attempt, not the client's span.
    telemetry::inject(span, headers);

    let response =
        match tokio::time::timeout_at(first_byte_deadline, upstream.pool.client.request(req)).await
        {
            Err(_) => {
                return Err(failure(
                    timeout_kind,
                    "no response headers before the first-byte deadline",
                ));
            }
            Ok(Err(e)) => {
                let kind = if e.is_connect() {
                    FailureKind::Connect
                } else {
                    FailureKind::Reset
                };
                return Err(failure(kind, error_chain(&e)));
            }
            Ok(Ok(r)) => r,
        };
    let (parts, mut body) = response.into_parts();
    let status = parts.status;
    if !status.is_success() {
        let retry_after = parts
            .headers
            .get(header::RETRY_AFTER)
            .and_then(|v| retry::parse_retry_after(v.as_bytes(), std::time::SystemTime::now()));
        let mut collected = BytesMut::new();
        // The error body is short; read it within the same deadline, bounded in size.
        let _ = tokio::time::timeout_at(first_byte_deadline, async {
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    let room = ERROR_BODY_LIMIT.saturating_sub(collected.len());
                    collected.extend_from_slice(&data[..data.len().min(room)]);
                    if room <= data.len() {
                        break;
                    }
                }
            }
        })
        .await;
        return Err(AttemptFailure {
            kind: FailureKind::Status(status.as_u16()),
            retry_after,
            message: format!("HTTP {status}"),
            response: Some((status, parts.headers, collected.freeze())),
        });
    }

    let is_sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));

    if is_sse {
        // Hold bytes until the first complete frame: an error event before any content is
        // a failed attempt, still retryable because the client has seen nothing.
        let mut forwarder = SseForwarder::new(call.strip_usage);
        let mut held = VecDeque::new();
        let mut events = Vec::new();
        loop {
            let frame = tokio::time::timeout_at(first_byte_deadline, body.frame())
                .await
                .map_err(|_| {
                    failure(timeout_kind, "no first byte before the first-byte deadline")
                })?;
            match frame {
                None => return Err(failure(FailureKind::Reset, "stream ended before any event")),
                Some(Err(e)) => return Err(failure(FailureKind::Reset, error_chain(&e))),
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let out = forwarder.forward(data, |ev| events.push(ev));
                    if !out.is_empty() {
                        held.push_back(out);
                    }
                    let has_event = events.iter().any(|e| !matches!(e, SseEvent::Comment));
                    if has_event {
                        let error_first = events
                            .iter()
                            .find(|e| !matches!(e, SseEvent::Comment))
                            .is_some_and(|e| {
                                matches!(
                                    e,
                                    SseEvent::Data {
                                        error: true,
                                        has_content: false,
                                        ..
                                    }
                                )
                            });
                        if error_first {
                            return Err(failure(
                                FailureKind::Status(500),
                                "the stream started with an error event",
                            ));
                        }
                        break;
                    }
                }
            }
        }
        return Ok(Started {
            status,
            headers: parts.headers,
            held,
            rest: Some(body),
            forwarder: Some(forwarder),
            first_events: events,
            usage: None,
            permit: Some(permit),
        });
    }

    // Non-stream: read the whole body (bounded) so mid-body failures stay retryable.
    let mut held = VecDeque::new();
    let mut size = 0usize;
    let mut deadline = first_byte_deadline;
    loop {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .map_err(|_| {
                if held.is_empty() {
                    failure(timeout_kind, "no first byte before the first-byte deadline")
                } else {
                    failure(FailureKind::IdleTimeout, "the response body stalled")
                }
            })?;
        match frame {
            None => break,
            Some(Err(e)) => return Err(failure(FailureKind::Reset, error_chain(&e))),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                size += data.len();
                held.push_back(data);
                deadline = (Instant::now() + settings.idle).min(call.deadline);
                if size > BUFFER_LIMIT {
                    return Ok(Started {
                        status,
                        headers: parts.headers,
                        held,
                        rest: Some(body),
                        forwarder: None,
                        first_events: Vec::new(),
                        usage: None,
                        permit: Some(permit),
                    });
                }
            }
        }
    }
    let whole = concat(held);
    let usage = parse_usage(&whole);
    Ok(Started {
        status,
        headers: parts.headers,
        held: VecDeque::from([whole]),
        rest: None,
        forwarder: None,
        first_events: Vec::new(),
        usage,
        permit: None,
    })
}

/// Client headers passed to providers: everything but framing, hop-by-hop, credentials
/// (the sidecar sets the provider's own) and compression (SSE must stay scannable).
fn forwardable(name: &http::HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "host"
            | "content-length"
            | "content-type"
            | "accept"
            | "accept-encoding"
            | "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "expect"
            | "proxy-authorization"
            | "proxy-connection"
            | "authorization"
            | "api-key"
            | "x-api-key"
            | "cookie"
            | "x-request-id"
    ) && !name.as_str().starts_with("x-tailwarden-")
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
