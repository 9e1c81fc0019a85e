//! The attempts stage: send the request to providers until one answers, as the pure
//! [`Scheduler`] of `tailwarden_decide::schedule` says — first attempt, retries after backoff,
//! a hedge, a wait for a cool-down, or giving up — and report what each attempt did to the
//! provider's state (breaker, EWMA, TTFT quantiles, cool-down).
//!
//! The client sees nothing until an attempt has its first upstream byte in hand: until then
//! any failure can still be retried elsewhere. The winner's response goes back to ingress,
//! which relays it; the losers are cancelled.
//!
//! [`upstream`] is the one upstream call (request building, the pool's connection slot,
//! deadlines, the first byte), used by attempts and by the semantic cache's [`embed`]
//! calls alike; [`verdict`] reports outcomes to the provider's breaker.

pub mod embed;
mod fallback;
pub mod upstream;
pub mod verdict;

use std::{collections::VecDeque, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::{StreamExt, stream::FuturesUnordered};
use http::{HeaderMap, Response, StatusCode};
use hyper::body::Incoming;
use tailwarden_decide::{
    balance::Balancer,
    breaker::{CircuitBreaker, Permit, Transition},
    capabilities::Decision,
    error::ApiError,
    hedge::TtftQuantiles,
    request::RequestBody,
    retry::{FailureKind, RetryBudget},
    route::{Fleet, RouteProviders, learn},
    schedule::{self, Action, CooldownSettings, GiveUp, Retry, Scheduler},
    sse::{SseEvent, SseForwarder},
    stream_fallback::{self, FallbackSettings},
    usage::Usage,
};
use tokio::time::Instant;
use tracing::Span;

use crate::{
    app::Exchange,
    config::Route,
    record::{
        metrics::Metrics,
        telemetry::{self, KeyValue},
    },
    relay::{IntoResponse, ProxyBody},
};
use upstream::{AttemptFailure, AttemptResult, attempt, copy_response_headers};
use verdict::{StreamVerdict, note_transition, record_failure, record_first_byte, record_success};

/// The exchange as the attempts see it: the request context, its parsed body, and what
/// follows from both for every attempt.
pub(crate) struct Call<'a> {
    pub ex: &'a Exchange,
    pub route: &'a Arc<Route>,
    pub body: &'a RequestBody<'a>,
    /// The sidecar asks for the stream's usage chunk (and strips it).
    pub strip_usage: bool,
    /// `streaming.fallback`, when the route opts in and the request is a chat stream.
    pub fallback: Option<FallbackSettings>,
}

/// The attempt that won.
pub struct Won {
    pub upstream: usize,
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub held: VecDeque<Bytes>,
    pub rest: Option<Incoming>,
    pub forwarder: Option<SseForwarder>,
    pub first_events: Vec<SseEvent>,
    pub usage: Option<Usage>,
    pub permit: Option<tokio::sync::OwnedSemaphorePermit>,
    pub verdict: Option<StreamVerdict>,
    pub attempts: u32,
    pub hedged: bool,
    pub dispatch_delay: Duration,
    pub committed_at: Instant,
    /// The CLIENT span of the winning attempt (none when tracing is off).
    pub span: Span,
    /// A stream request answered by a plain call: `held` is the replayed event stream.
    pub stream_fallback: bool,
}

/// The request failed: the response to send.
pub struct Failed {
    pub upstream: Option<usize>,
    pub response: Response<ProxyBody>,
    pub attempts: u32,
    pub hedged: bool,
    pub error_type: &'static str,
    pub dispatch_delay: Duration,
}

pub enum Outcome {
    Won(Box<Won>),
    Failed(Box<Failed>),
}

/// The route's providers and their learned state as the decision crate sees them; breaker
/// transitions are logged and metered under the request's span.
pub(crate) struct RouteFleet<'a> {
    pub route: &'a Route,
    pub metrics: &'a Metrics,
    pub span: &'a Span,
}

impl Fleet for RouteFleet<'_> {
    fn balancer(&self) -> &Balancer {
        &self.route.balancer
    }

    fn breaker(&self, i: usize) -> std::sync::MutexGuard<'_, CircuitBreaker> {
        self.route.upstreams[i].breaker()
    }

    fn ttft(&self, i: usize) -> &TtftQuantiles {
        &self.route.upstreams[i].state.ttft
    }

    fn retry_budget(&self) -> &RetryBudget {
        &self.route.state.retry_budget
    }

    fn hedge_budget(&self) -> &RetryBudget {
        &self.route.state.hedge_budget
    }

    fn cooldown_settings(&self) -> &CooldownSettings {
        &self.route.settings.policy.cooldown
    }

    fn on_transition(&self, i: usize, t: &Transition) {
        note_transition(
            self.metrics,
            &self.route.name,
            self.span,
            &self.route.upstreams[i],
            t,
        );
    }
}

impl Call<'_> {
    /// The client-facing model after tier choice and degradation (a request switched to
    /// the degraded target mid-way asks for its model from then on).
    pub(crate) fn model(&self) -> &str {
        self.ex.model(self.body)
    }

    pub(crate) fn fleet(&self) -> RouteFleet<'_> {
        RouteFleet {
            route: self.route,
            metrics: &self.ex.app.metrics,
            span: &self.ex.span,
        }
    }
}

/// The thread's random generator, taken afresh at each draw: a request's future moves
/// between threads, so it cannot hold `rand::rng()` itself.
struct ThreadRandom;

impl rand::RngCore for ThreadRandom {
    fn next_u32(&mut self) -> u32 {
        rand::rng().next_u32()
    }
    fn next_u64(&mut self) -> u64 {
        rand::rng().next_u64()
    }
    fn fill_bytes(&mut self, dst: &mut [u8]) {
        rand::rng().fill_bytes(dst);
    }
}

/// Runs the request's attempts: a thin driver of the pure [`Scheduler`], which decides when
/// to start, retry, hedge, wait or give up; this loop only starts what it says and reports
/// what the attempts did.
pub async fn run(ex: &Exchange, body: &RequestBody<'_>) -> Outcome {
    let route = &ex.route;
    let call = &Call {
        ex,
        route,
        body,
        strip_usage: ex.strips_usage(body),
        fallback: route
            .settings
            .stream_fallback
            .filter(|_| stream_fallback::applies(ex.endpoint, ex.stream)),
    };
    let metrics = &ex.app.metrics;
    let dispatched = Instant::now();
    let fleet = call.fleet();
    let mut providers = RouteProviders {
        fleet: &fleet,
        // The provider the request is pinned to (Responses state), a usable key, and
        // capability rules that take the request.
        eligible: |i: usize| {
            call.ex.pinned.as_ref().is_none_or(|p| p.provider == i)
                && call.ex.may_use(i)
                && route.upstreams[i].usable()
                && !matches!(call.ex.decisions.get(i), Some(Decision::Reject { .. }))
        },
        rng: ThreadRandom,
        // A request pinned to the provider that holds its state fails fast with
        // `owner_unavailable` when that one is out, rather than panic.
        panic: call.ex.pinned.is_none(),
    };
    let mut schedule = Scheduler::new(
        route.settings.policy.schedule,
        dispatched.into_std(),
        call.ex.deadline.into_std(),
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
                    telemetry::event_with(&call.ex.span, "hedge", || {
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
                    cancel_permits(&fleet, schedule.tried(), &mut permits);
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
                        if started.forwarder.is_some() {
                            fallback::stream_started(call, idx);
                        }
                        if started.stream_fallback {
                            fallback::served(call, idx);
                        }
                        let verdict = if started.forwarder.is_some() && started.rest.is_some() {
                            record_first_byte(call, idx, elapsed);
                            Some(StreamVerdict {
                                metrics: metrics.clone(),
                                route: route.clone(),
                                idx,
                                permit,
                                first_byte: elapsed,
                                started: started_at.into_std(),
                                span: call.ex.span.clone(),
                            })
                        } else {
                            record_success(call, idx, permit, elapsed);
                            None
                        };
                        let hedged = schedule.hedged();
                        if hedged {
                            let outcome = if hedge { "won" } else { "lost" };
                            metrics.hedges.with_label_values(&[&*route.name, outcome]).inc();
                            telemetry::event_with(&call.ex.span, "hedge", || vec![
                                KeyValue::new("tailwarden.hedge.outcome", outcome),
                                KeyValue::new("gen_ai.provider.name", upstream.name.to_string()),
                            ]);
                        }
                        // Dropping `inflight` cancels the losing attempts now.
                        drop(inflight);
                        cancel_permits(&fleet, schedule.tried(), &mut permits);
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
                            stream_fallback: started.stream_fallback,
                        }));
                    }
                    Err(failure) => {
                        metrics.attempt_duration.with_label_values(&[&*route.name, &*upstream.name, failure.kind.as_str()]).observe(elapsed.as_secs_f64());
                        record_failure(call, idx, permit, &failure, elapsed);
                        if failure.before_content {
                            fallback::stream_failed(call, idx);
                        }
                        degrade_on_failure(call, &failure);
                        let reason = failure.kind.as_str();
                        let retry_after = schedule::honoured_retry_after(failure.retry_after, &route.settings.policy.cooldown);
                        let retry = schedule.on_failure_from(std_now(), failure.kind, idx, retry_after, &mut providers);
                        last_failure = Some((idx, failure));
                        note_retry(call, idx, reason, retry, schedule.attempts());
                    }
                }
            }
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// A normal-tier attempt failed: a miss for the degradation's SLO window at once (not
/// when the request ends, so a brownout is seen within one first-byte deadline), and if
/// the route is degraded now, the request's later attempts go to the degraded target.
fn degrade_on_failure(call: &Call<'_>, failure: &AttemptFailure) {
    let (Some(d), Some(choice)) = (&call.route.degrade, &call.ex.degrade) else {
        return;
    };
    if call.ex.degraded() || !failure.kind.counts_against_provider() {
        return;
    }
    let now = std_now();
    d.state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .record(now, false);
    let state = call.route.degrade_state(&call.ex.app.metrics, now);
    if state == Some(tailwarden_decide::degrade::State::Degraded) && !choice.opted_out {
        choice
            .switched
            .store(true, std::sync::atomic::Ordering::Relaxed);
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
    let metrics = &call.ex.app.metrics;
    let provider = &route.upstreams[idx].name;
    match retry {
        Retry::Scheduled { backoff, .. } | Retry::TooLate { backoff } => {
            let scheduled = matches!(retry, Retry::Scheduled { .. });
            metrics
                .retries
                .with_label_values(&[&*route.name, &**provider, reason])
                .inc();
            telemetry::event_with(&call.ex.span, "retry", || {
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
            telemetry::event_with(&call.ex.span, "retry_denied", || {
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
fn cancel_permits(fleet: &RouteFleet<'_>, tried: &[usize], permits: &mut [Option<Permit>]) {
    for (slot, permit) in permits.iter_mut().enumerate() {
        if let (Some(permit), Some(&idx)) = (permit.take(), tried.get(slot)) {
            learn::cancelled(fleet, idx, permit);
        }
    }
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
        _ if call.ex.pinned.is_some() => {
            let pinned = call.ex.pinned.as_ref().map_or(0, |p| p.provider);
            let id = call.ex.pinned.as_ref().map_or("", |p| p.id.as_str());
            let why = unavailable_reason(call, pinned, std_now());
            (
                None,
                ApiError::owner_unavailable(id, &route.upstreams[pinned].name, &why)
                    .into_response(),
                "owner_unavailable",
            )
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
    let now = std_now();
    call.route
        .upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| format!("{} ({})", u.name, unavailable_reason(call, i, now)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why provider `i` could not take the request.
fn unavailable_reason(call: &Call<'_>, i: usize, now: std::time::Instant) -> String {
    if let Some(Decision::Reject { params, .. }) = call.ex.decisions.get(i) {
        format!("does not support {}", params.join(", "))
    } else {
        provider_down(call.route, i, now).unwrap_or_else(|| "tried".to_string())
    }
}

/// Why provider `i` of `route` cannot take any request now (no key, cooling down, breaker
/// open), or `None` when it can.
pub(crate) fn provider_down(route: &Route, i: usize, now: std::time::Instant) -> Option<String> {
    let u = &route.upstreams[i];
    if let Some(reason) = u.state.unusable.lock().ok().and_then(|r| r.clone()) {
        Some(reason)
    } else if let Some(until) = route.balancer.cooling_until(i).filter(|t| *t > now) {
        Some(format!(
            "cooling down after a 429/503 for {} ms more",
            (until - now).as_millis()
        ))
    } else if u
        .state
        .breaker
        .lock()
        .map(|b| !b.is_available(now))
        .unwrap_or(true)
    {
        Some("circuit breaker open".to_string())
    } else {
        None
    }
}
