//! What the client gets back, for every way a request can end: a cached answer, the
//! sidecar's own rejection (a limit, unsupported parameters), or the attempts' outcome —
//! the winner's response relayed with its observers (the recorder, the stream's breaker
//! verdict, the cache fill), or the failure. Every response carries `x-request-id` and the
//! `x-tailwarden-*` headers.

use std::{sync::Arc, time::Duration};

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use tailwarden_decide::{error::ApiError, request::RequestBody, responses, sse::SseScanner};
use tokio::time::Instant;
use tracing::Span;

use crate::{
    app::Exchange,
    attempts::{
        self, Outcome,
        upstream::{concat, copy_response_headers},
    },
    config::Upstream,
    policy::{CacheAnswer, CacheState, Prepared},
    record::{
        recorder::{DegradeSample, Recorder, RequestInfo, SloTargets},
        telemetry,
    },
    relay::{End, IntoResponse, Observer, ProxyBody, Relay, RelayParts},
    state::{
        affinity::{Owner, Remember},
        exact::Entry,
        fill::Fill,
        limits::{self, AdmissionGuard, Rejection, Scope},
        semantic,
    },
};

/// On routes with a `degradation`: `yes` when the degraded target served the request.
pub const DEGRADED_HEADER: &str = "x-tailwarden-degraded";

/// Marks a stream request answered by a plain call (`streaming.fallback`).
pub const STREAM_FALLBACK_HEADER: &str = "x-tailwarden-stream-fallback";

/// Priorities as metric labels, without formatting one per request.
const PRIORITY_LABELS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];

/// What the recorder knows about a request no provider answered (a cache hit, a
/// rejection).
fn request_info(ex: &Exchange, body: &RequestBody<'_>, status: u16) -> RequestInfo {
    RequestInfo {
        metrics: ex.app.metrics.clone(),
        operation: ex.endpoint.operation(),
        identity: ex.app.identity.clone(),
        tenant: limits::tenant_header_value(&ex.route.spec, &ex.headers),
        request_id: ex.request_id.clone(),
        route: ex.route.name.clone(),
        model: body.model.to_string(),
        provider: Arc::from(""),
        provider_model: String::new(),
        tier: ex.tier().map(|t| t.name.clone()),
        stream: ex.stream,
        status,
        attempts: 0,
        hedged: false,
        arrived: ex.arrived,
        overhead: ex.arrived.elapsed(),
        request_bytes: 0,
        price: None,
        slo: SloTargets::of(&ex.route.spec),
        span: ex.span.clone(),
        attempt_span: Span::none(),
        cache: None,
        context: ex.context,
        priority: ex.priority,
        stream_fallback: false,
        degrade: degrade_sample(ex),
    }
}

/// The answer from a cache: the stored status, content type and body — a stream is
/// replayed as the very chunks the first client received.
pub fn cached(
    ex: &Exchange,
    body: &RequestBody<'_>,
    entry: &Arc<Entry>,
    answer: CacheAnswer,
    admission: Option<AdmissionGuard>,
) -> Response<ProxyBody> {
    if answer == CacheAnswer::Exact {
        ex.app
            .metrics
            .cache_requests
            .with_label_values(&[&*ex.route.name, "hit"])
            .inc();
    }
    let mut info = request_info(ex, body, entry.status.as_u16());
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
    finish_headers(&mut response, ex, Some(label));
    response
}

/// The sidecar's own 429/503 for a request over one of the route's limits: `Retry-After`,
/// the limit named in the message and in `x-tailwarden-limit`. Never retried.
pub fn rejected(
    ex: &Exchange,
    body: &RequestBody<'_>,
    rejection: &Rejection,
) -> Response<ProxyBody> {
    let error = rejection.to_api_error();
    let status = error.status;
    let scope = match rejection.scope() {
        Scope::Route(_) => "route",
        Scope::Tenant { .. } => "tenant",
    };
    let limit = rejection.limit().label();
    ex.app
        .metrics
        .admission_rejected
        .with_label_values(&[&*ex.route.name, limit, scope, status.as_str()])
        .inc();
    if let (Some(priority), Some(reason)) = (ex.priority, rejection.shed_reason()) {
        ex.app
            .metrics
            .queue_shed
            .with_label_values(&[
                &*ex.route.name,
                PRIORITY_LABELS
                    .get(usize::from(priority))
                    .copied()
                    .unwrap_or("9"),
                reason,
            ])
            .inc();
    }
    let mut info = request_info(ex, body, status.as_u16());
    info.request_bytes = ex.raw_body.len();
    telemetry::refused(&ex.span, status.as_u16(), error.code.unwrap_or(error.kind));
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
    finish_headers(&mut response, ex, None);
    response
}

/// The sidecar's own refusal of a request before any policy ran (a context budget
/// overflow): recorded like every request, never sent anywhere.
pub fn refused(
    ex: &Exchange,
    body: &RequestBody<'_>,
    error: ApiError,
    error_type: &'static str,
) -> Response<ProxyBody> {
    let mut info = request_info(ex, body, error.status.as_u16());
    info.request_bytes = ex.raw_body.len();
    telemetry::refused(
        &ex.span,
        error.status.as_u16(),
        error.code.unwrap_or(error.kind),
    );
    drop(Recorder::finished(info, Some(error_type)));
    let mut response = error.into_response();
    finish_headers(&mut response, ex, None);
    response
}

/// The 400 when no provider of the route takes the request's parameters.
pub fn unsupported(
    ex: &Exchange,
    body: &RequestBody<'_>,
    error: ApiError,
    cache: &CacheState,
    admission: Option<AdmissionGuard>,
) -> Response<ProxyBody> {
    let info = request_info(ex, body, error.status.as_u16());
    let mut recorder = Recorder::finished(info, Some("unsupported_parameter"));
    recorder.set_admission(admission);
    drop(recorder);
    let mut response = error.into_response();
    finish_headers(&mut response, ex, cache.label());
    response
}

/// Runs the attempts and builds the client response from their outcome.
pub async fn attempted(
    ex: &Exchange,
    body: &RequestBody<'_>,
    prepared: Prepared,
) -> Response<ProxyBody> {
    let Prepared {
        cache,
        admission,
        semantic: semantic_miss,
    } = prepared;
    let route = &ex.route;
    let outcome = attempts::run(ex, body).await;
    // After the attempts: a request switched to the degraded target mid-way asks for its
    // model.
    let model = ex.model(body);
    let info = |status: u16,
                upstream: Option<&Upstream>,
                attempts: u32,
                hedged: bool,
                overhead: Duration| RequestInfo {
        metrics: ex.app.metrics.clone(),
        operation: ex.endpoint.operation(),
        identity: ex.app.identity.clone(),
        tenant: limits::tenant_header_value(&ex.route.spec, &ex.headers),
        request_id: ex.request_id.clone(),
        route: route.name.clone(),
        model: body.model.to_string(),
        provider: upstream.map_or_else(|| Arc::from(""), |u| u.name.clone()),
        provider_model: upstream.map_or_else(String::new, |u| u.provider_model(model).to_owned()),
        tier: ex.tier().map(|t| t.name.clone()),
        stream: ex.stream,
        status,
        attempts,
        hedged,
        arrived: ex.arrived,
        overhead,
        request_bytes: ex.raw_body.len(),
        price: upstream.and_then(|u| u.prices.get(u.provider_model(model)).cloned()),
        slo: SloTargets::of(&route.spec),
        span: ex.span.clone(),
        attempt_span: Span::none(),
        cache: cache.label(),
        context: ex.context,
        priority: ex.priority,
        stream_fallback: false,
        degrade: degrade_sample(ex),
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
            info.attempt_span = won.span;
            info.stream_fallback = won.stream_fallback;
            let mut recorder = Recorder::new(info);
            recorder.set_admission(admission);
            // One fill for the exact and the semantic cache, when either may store it.
            // A request switched to the degraded target mid-way had its key made for the
            // normal model: its answer is not stored under it.
            let exact = match (&cache, &route.cache) {
                (CacheState::Miss(key), Some(store)) if !ex.switched() => {
                    store.fill(key, won.status, &won.headers, ex.stream)
                }
                _ => None,
            };
            let semantic = match (&route.semantic, &semantic_miss) {
                (Some(sc), Some((query, embedding))) if !ex.switched() => {
                    sc.fill(query, embedding, won.status, &won.headers)
                }
                _ => None,
            };
            let fill = Fill::join(exact, semantic);
            // Affinity: a stored Responses object belongs to the provider that made it.
            let owner = (won.status.is_success() && ex.endpoint.stores(body)).then(|| Owner {
                route: route.name.clone(),
                provider: upstream.name.clone(),
            });
            if let (Some(owner), Some(conversation)) = (&owner, ex.endpoint.conversation(body)) {
                ex.app
                    .registries
                    .affinity
                    .remember(&conversation, owner.clone());
            }
            let remember = Remember {
                affinity: ex.app.registries.affinity.clone(),
                owner,
            };
            let body = match won.rest {
                None => {
                    // Buffered whole: the observers see it at once.
                    if let Some(usage) = won.usage {
                        recorder.set_usage(usage);
                    }
                    if !ex.span.is_none() {
                        recorder.set_response_model(
                            won.held.front().and_then(|b| telemetry::body_model(b)),
                        );
                    }
                    let whole = concat(won.held);
                    if let Some(owner) = remember.owner
                        && let Some(id) = responses::read_body(&whole).and_then(|b| b.id)
                    {
                        remember.affinity.remember(&id, owner);
                    }
                    let mut observers = (recorder, won.verdict, fill);
                    if won.stream_fallback {
                        // The replayed stream's events: TTFT, usage and the model, as
                        // for a stream relayed from the provider.
                        let mut scanner = SseScanner::new();
                        scanner.feed(&whole, |ev| observers.on_event(&ev));
                    }
                    observers.on_chunk(&whole);
                    observers.on_end(End::Complete);
                    drop(observers);
                    ProxyBody::full(whole)
                }
                Some(rest) => {
                    let mut observers = ((recorder, remember), won.verdict, fill);
                    for ev in &won.first_events {
                        observers.on_event(ev);
                    }
                    Relay::body(
                        RelayParts {
                            held: won.held,
                            upstream: rest,
                            forwarder: won.forwarder,
                            idle_timeout: route.settings.idle,
                            deadline: ex.deadline,
                            permit: won.permit,
                            drain_expired: ex.app.drain_expired.clone(),
                        },
                        observers,
                    )
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
            if won.stream_fallback {
                response.headers_mut().insert(
                    STREAM_FALLBACK_HEADER,
                    HeaderValue::from_static("non-stream"),
                );
            }
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
    finish_headers(&mut response, ex, cache.label());
    if let CacheState::Bypass(reason) = &cache {
        set_header(
            response.headers_mut(),
            "x-tailwarden-cache-reason",
            &reason.to_string(),
        );
    }
    response
}

/// What a request of a route with a `degradation` reports to the recorder.
fn degrade_sample(ex: &Exchange) -> Option<DegradeSample> {
    let d = ex.degrade.as_ref()?;
    Some(DegradeSample {
        state: d.state,
        served: ex.degraded(),
        machine: ex.route.degrade.as_ref()?.state.clone(),
    })
}

/// Headers every response of the request path carries.
fn finish_headers(response: &mut Response<ProxyBody>, ex: &Exchange, cache: Option<&'static str>) {
    let headers = response.headers_mut();
    if let Some(tier) = ex.tier_name() {
        set_header(headers, "x-tailwarden-tier", tier);
    }
    if let Some(cache) = cache {
        headers.insert("x-tailwarden-cache", HeaderValue::from_static(cache));
    }
    if let Some(p) = ex.priority {
        headers.insert("x-tailwarden-priority", HeaderValue::from(u16::from(p)));
    }
    if ex.degrade.is_some() {
        headers.insert(
            DEGRADED_HEADER,
            HeaderValue::from_static(if ex.degraded() { "yes" } else { "no" }),
        );
    }
    if let Some(c) = &ex.context {
        headers.insert("x-tailwarden-context-tokens", HeaderValue::from(c.tokens));
        headers.insert("x-tailwarden-context-trimmed", HeaderValue::from(c.trimmed));
        headers.insert(
            "x-tailwarden-context-tokenizer",
            HeaderValue::from_static(c.tokenizer),
        );
    }
    set_header(headers, "x-request-id", &ex.request_id);
}

fn set_header(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        headers.insert(name, v);
    }
}
