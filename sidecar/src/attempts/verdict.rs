//! What an attempt tells the provider's state: the breaker's verdict (at the first byte,
//! or for a stream at its end), the TTFT and latency samples behind the balancer and the
//! hedge delay, and the cool-down after a 429/503.

use std::{sync::Arc, time::Duration};

use rand::Rng;
use tailwarden_decide::{
    breaker::{Permit, Transition},
    retry::FailureKind,
    schedule,
};
use tracing::Span;

use super::{Call, std_now, upstream::AttemptFailure};
use crate::{
    config::Upstream,
    record::{
        metrics::{Metrics, breaker_gauge},
        telemetry::{self, KeyValue},
    },
    relay::{End, Observer},
};

/// The breaker's verdict on a stream, given when the stream ends: a provider that cuts its
/// streams after the first event is failing even though every attempt "started" well.
pub struct StreamVerdict {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) route: Arc<str>,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) permit: Option<Permit>,
    pub(crate) first_byte: Duration,
    pub(crate) span: Span,
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

pub(crate) fn record_first_byte(call: &Call<'_>, idx: usize, elapsed: Duration) {
    let now = std_now();
    call.route.balancer.record_ttft(idx, now, elapsed);
    call.route.upstreams[idx].state.ttft.record(now, elapsed);
}

pub(crate) fn record_success(
    call: &Call<'_>,
    idx: usize,
    permit: Option<Permit>,
    elapsed: Duration,
) {
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

pub(crate) fn record_failure(
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

pub(crate) fn log_transition(call: &Call<'_>, upstream: &Upstream, t: &Transition) {
    note_transition(
        &call.ex.app.metrics,
        &call.route.name,
        &call.ex.span,
        upstream,
        t,
    );
}

pub(crate) fn note_transition(
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
    metrics
        .breaker_state
        .with_label_values(&[route, &upstream.name])
        .set(breaker_gauge(t.to));
}

/// The verdict watches the stream: a clean end is a success, a failure the provider's
/// (a total deadline or the sidecar's own drain is not), and no end at all (the client left)
/// releases the permit on drop.
impl Observer for StreamVerdict {
    fn on_end(&mut self, end: End) {
        match end {
            End::Complete => self.success(),
            End::Failed("total_timeout" | "shutting_down") => {}
            End::Failed(_) => self.failure(),
        }
    }
}
